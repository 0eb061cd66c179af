"""The families built as Llama is (pylon.serving.model.families: Mistral, Qwen2, Qwen3) in the engine: greedy output
token for token `transformers`' own, through continuous batching, chunked prefill and the prefix cache;
log-probabilities within 1e-4 of its log-softmax; int8 projections computing the dequantized model; LoRA adapters
computing what peft computes; and a sliding window (Mistral 7B v0.1's) capping the context at the window, within which
windowed attention is the full attention the engine computes."""

from __future__ import annotations

import pytest
import torch
from engine_models import GREEDY, LLAMA_LIKE, NEW_TOKENS, PROMPTS, Family, hf_greedy, run, spec, tokens_of
from test_lora_engine import save_adapter
from test_serving_logprobs import INIT, check_request
from test_serving_quant_engine import _dequantized_copy, _greedy, _last_logits, _rel
from transformers import AutoConfig

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest
from pylon.serving.model.families import attention_window
from pylon.serving.model.quant import QuantLinear

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=list(LLAMA_LIKE))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def test_each_family_is_what_sets_it_apart(family) -> None:
    """Else the parity below would hold for an engine that ran every family as plain Llama."""
    layer = family.model.model.layers[0]
    if family.name == "qwen2":
        assert layer.self_attn.q_proj.bias is not None and layer.self_attn.q_proj.bias.abs().sum() > 0
    if family.name == "qwen3":
        assert hasattr(layer.self_attn, "q_norm") and layer.self_attn.q_norm.weight.std() > 0
        assert layer.self_attn.q_proj.out_features == 4 * 32 != family.model.config.hidden_size
        assert family.model.lm_head.weight is family.model.model.embed_tokens.weight
    assert sum(a != b for a, b in zip(family.greedy, family.greedy[1:])) >= len(PROMPTS) - 2  # context-dependent


def test_greedy_output_is_transformers_through_batching_chunks_and_the_prefix_cache(family) -> None:
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = family.engine(**fields)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == family.greedy, fields
        # Again: the prompts' blocks now come from the prefix cache, and the tokens are the same.
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"again-{i}", p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[f"again-{i}"]) for i in range(len(PROMPTS))] == family.greedy, fields
        assert sum(outputs[f"again-{i}"][0].num_cached_tokens for i in range(len(PROMPTS))) >= 16 * 6


def test_logprobs_are_transformers_own(tmp_path) -> None:
    family = Family("qwen3", tmp_path / "qwen3", initializer_range=INIT)
    engine = family.engine()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        check_request(family, prompt, outputs[str(i)], k=5, prompt_k=5)


def test_int8_projections_compute_the_dequantized_model(family) -> None:
    engine = family.engine(quantization="int8")
    attention = engine.runner.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, QuantLinear) and isinstance(attention.o_proj, QuantLinear)
    reference = _dequantized_copy(family.model)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=family.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    assert _greedy(engine) == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_a_lora_adapter_computes_what_peft_computes(family, tmp_path) -> None:
    adapter = str(tmp_path / "adapter")
    peft_model = save_adapter(family.dir, adapter, seed=3, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)
    want = [hf_greedy(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, family.greedy)) >= len(PROMPTS) - 1  # the adapter changes the outputs
    engine = LLMEngine(family.dir, spec(adapters=[{"name": "tuned", "path": adapter}]))
    for i, p in enumerate(PROMPTS):  # base and adapted requests in the same steps
        engine.add_request(f"base-{i}", p, GREEDY)
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == want
    assert [tokens_of(outputs[f"base-{i}"]) for i in range(len(PROMPTS))] == family.greedy


def test_a_sliding_window_caps_the_context_at_the_window(tmp_path) -> None:
    windowed = Family("mistral", tmp_path / "mistral-window", sliding_window=48)
    assert attention_window(windowed.model.config) == 48
    engine = windowed.engine()
    assert engine.max_model_len == 48  # of the spec's 256 and the model's 256 positions
    fits = [p for p in PROMPTS if len(p) + NEW_TOKENS <= 48]
    for i, p in enumerate(fits):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(fits))] == [windowed.greedy[PROMPTS.index(p)] for p in fits]
    with pytest.raises(InvalidRequest, match="max_model_len"):
        engine.add_request("long", PROMPTS[2], GREEDY)  # 40 tokens + 20 new: past the window

    # A window every layer leaves off is no window: Qwen's configs clear it unless use_sliding_window is set.
    common = {"model_type": "qwen2", "max_position_embeddings": 4096, "sliding_window": 1024}
    assert attention_window(AutoConfig.for_model(**common)) is None
    assert attention_window(AutoConfig.for_model(**common, use_sliding_window=True, max_window_layers=0)) == 1024
    assert attention_window(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert attention_window(AutoConfig.for_model("llama")) is None
