"""The families with forward passes of their own beside GPT-2's (pylon.serving.model.families): OPT (vLLM's
quickstart model, facebook/opt-125m), as OPT-125m and the larger ones are laid out (LayerNorms before each block) and
as OPT-350m is (after them, with 512-wide embeddings projected in and out of its layers), and GPT-NeoX (Pythia,
GPT-NeoX-20B), with its parallel residual and without: greedy output token for token `transformers`' own through
continuous batching, chunked prefill and the prefix cache; log-probabilities within 1e-4 of its log-softmax; int8
projections computing the dequantized model; a LoRA adapter computing what peft computes."""

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

SHAPE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
OPT = {**SHAPE, "ffn_dim": 344, "vocab_size": 320, "word_embed_proj_dim": 128}
NEOX = {**SHAPE, "intermediate_size": 344, "vocab_size": 320, "partial_rotary_factor": 0.25}  # Pythia's 0.25
# Each layout: its model type and config.
LAYOUTS = {
    "opt-125m": ("opt", OPT),
    "opt-350m": ("opt", {**OPT, "do_layer_norm_before": False, "word_embed_proj_dim": 64}),
    "pythia": ("gpt_neox", NEOX),
    "neox-sequential": ("gpt_neox", {**NEOX, "use_parallel_residual": False}),
}
TARGETS = {
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def _family(layout: str, directory, **fields) -> Family:
    model_type, config = LAYOUTS[layout]
    return Family(model_type, directory, **{**config, **fields})


@pytest.fixture(scope="module", params=list(LAYOUTS))
def opt(request, tmp_path_factory) -> Family:
    return _family(request.param, tmp_path_factory.mktemp(request.param))


def test_each_layout_is_what_sets_it_apart(opt) -> None:
    """OPT's positions offset by 2 and its layout, GPT-NeoX's partial rotary embedding and its residual, each change
    transformers' continuations."""
    assert sum(a != b for a, b in zip(opt.greedy, opt.greedy[1:])) >= len(PROMPTS) - 2  # context-dependent
    if opt.name == "gpt_neox":
        check_neox_parts_matter(opt)
        return
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


def check_neox_parts_matter(family) -> None:
    import transformers.models.gpt_neox.modeling_gpt_neox as neox
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    config, rotary = family.model.config, family.model.gpt_neox.rotary_emb
    assert rotary.inv_freq.numel() * 2 == 8 < family.model.gpt_neox.layers[0].attention.head_size
    parallel = config.use_parallel_residual
    kept = neox.apply_rotary_pos_emb
    full = rotary.inv_freq.clone()
    for change in ("rotation", "residual"):
        if change == "rotation":  # every dimension rotated (Llama's apply over a full-width cos and sin)
            rotary.inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
            neox.apply_rotary_pos_emb = llama_rope
        else:
            for layer in family.model.gpt_neox.layers:
                layer.use_parallel_residual = not parallel
        try:
            changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            rotary.inv_freq = full
            neox.apply_rotary_pos_emb = kept
            for layer in family.model.gpt_neox.layers:
                layer.use_parallel_residual = parallel
        assert sum(a != b for a, b in zip(changed, family.greedy)) >= len(PROMPTS) - 2, change


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
    family = _family(layout, tmp_path / layout, initializer_range=INIT)
    engine = family.engine()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        check_request(family, prompt, outputs[str(i)], k=5, prompt_k=5)


def test_int8_projections_compute_the_dequantized_model(opt) -> None:
    engine = opt.engine(quantization="int8")
    if opt.name == "opt":
        layer = engine.runner.model.model.decoder.layers[0]
        assert isinstance(layer.self_attn.out_proj, QuantLinear) and isinstance(layer.fc1, QuantLinear)
    else:
        layer = engine.runner.model.gpt_neox.layers[0]
        assert isinstance(layer.attention.query_key_value, QuantLinear) and isinstance(
            layer.mlp.dense_4h_to_h, QuantLinear
        )
    reference = _dequantized_copy(opt.model)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=opt.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    assert _greedy(engine) == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_a_lora_adapter_computes_what_peft_computes(opt, tmp_path) -> None:
    adapter = str(tmp_path / "adapter")
    peft_model = save_adapter(opt.dir, adapter, seed=3, r=8, lora_alpha=16, target_modules=TARGETS[opt.name])
    want = [hf_greedy(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, opt.greedy)) >= len(PROMPTS) - 1
    engine = LLMEngine(opt.dir, spec(adapters=[{"name": "tuned", "path": adapter}]))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"base-{i}", p, GREEDY)
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == want
    assert [tokens_of(outputs[f"base-{i}"]) for i in range(len(PROMPTS))] == opt.greedy
