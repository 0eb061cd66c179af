"""OPT (vLLM's quickstart model, facebook/opt-125m) in the engine, as OPT-125m and the larger ones are laid out
(LayerNorms before each block) and as OPT-350m is (after them, with 512-wide embeddings projected in and out of its
layers): greedy output token for token `transformers`' own through continuous batching, chunked prefill and the prefix
cache; log-probabilities within 1e-4 of its log-softmax; int8 projections computing the dequantized model; a LoRA
adapter computing what peft computes."""

from __future__ import annotations

import pytest
import torch
from engine_models import GREEDY, NEW_TOKENS, PROMPTS, Family, hf_greedy, run, spec, tokens_of
from test_lora_engine import save_adapter
from test_serving_logprobs import INIT, check_request
from test_serving_quant_engine import _dequantized_copy, _greedy, _last_logits, _rel

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.model.quant import QuantLinear

OPT = {
    "hidden_size": 128,
    "ffn_dim": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "vocab_size": 320,
    "word_embed_proj_dim": 128,
}
LAYOUTS = {"opt-125m": {}, "opt-350m": {"do_layer_norm_before": False, "word_embed_proj_dim": 64}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def opt(request, tmp_path_factory) -> Family:
    return Family("opt", tmp_path_factory.mktemp(request.param), **{**OPT, **LAYOUTS[request.param]})


def test_opt_is_what_sets_it_apart(opt) -> None:
    """Its positions offset by 2 and its layout each change transformers' continuations."""
    decoder = opt.model.model.decoder
    assert decoder.embed_positions.offset == 2 and opt.model.config.activation_function == "relu"
    if opt.model.config.do_layer_norm_before:
        assert decoder.final_layer_norm is not None and decoder.project_in is None
    else:  # OPT-350m: no final norm; its embeddings projected in and out
        assert decoder.final_layer_norm is None and decoder.project_in.in_features == 64
    table = decoder.embed_positions.weight
    kept = table.detach().clone()
    with torch.no_grad():
        table.copy_(torch.roll(kept, 2, dims=0))  # positions read without the offset
    try:
        shifted = [opt.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
    finally:
        with torch.no_grad():
            table.copy_(kept)
    assert sum(a != b for a, b in zip(shifted, opt.greedy)) >= len(PROMPTS) - 2
    assert sum(a != b for a, b in zip(opt.greedy, opt.greedy[1:])) >= len(PROMPTS) - 2  # context-dependent


def test_greedy_output_is_transformers_through_batching_chunks_and_the_prefix_cache(opt) -> None:
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = opt.engine(**fields)
        for round_ in range(2):  # the second round from the prefix cache
            for i, p in enumerate(PROMPTS):
                engine.add_request(f"{round_}-{i}", p, GREEDY)
            outputs = run(engine)
            assert [tokens_of(outputs[f"{round_}-{i}"]) for i in range(len(PROMPTS))] == opt.greedy
        assert engine.stats().prefix_cache_hits_total > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_are_transformers_own(layout, tmp_path) -> None:
    family = Family("opt", tmp_path / layout, initializer_range=INIT, **{**OPT, **LAYOUTS[layout]})
    engine = family.engine()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        check_request(family, prompt, outputs[str(i)], k=5, prompt_k=5)


def test_int8_projections_compute_the_dequantized_model(opt) -> None:
    engine = opt.engine(quantization="int8")
    layer = engine.runner.model.model.decoder.layers[0]
    assert isinstance(layer.self_attn.out_proj, QuantLinear) and isinstance(layer.fc1, QuantLinear)
    reference = _dequantized_copy(opt.model)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=opt.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    assert _greedy(engine) == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_a_lora_adapter_computes_what_peft_computes(opt, tmp_path) -> None:
    adapter = str(tmp_path / "adapter")
    targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    peft_model = save_adapter(opt.dir, adapter, seed=3, r=8, lora_alpha=16, target_modules=targets)
    want = [hf_greedy(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, opt.greedy)) >= len(PROMPTS) - 1
    engine = LLMEngine(opt.dir, spec(adapters=[{"name": "tuned", "path": adapter}]))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"base-{i}", p, GREEDY)
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == want
    assert [tokens_of(outputs[f"base-{i}"]) for i in range(len(PROMPTS))] == opt.greedy
