"""The families built as Llama is (pylon.serving.model.families: Mistral, Qwen2, Qwen3) in the engine: greedy output
token for token `transformers`' own, through continuous batching, chunked prefill and the prefix cache;
log-probabilities within 1e-4 of its log-softmax; int8 projections computing the dequantized model; LoRA adapters
computing what peft computes; and a sliding window (Mistral's in every layer, Qwen2's in the layers from
max_window_layers on) applied as transformers applies it, through batching, chunked prefill, the prefix cache,
speculative verification and fixed-shape decode steps."""

from __future__ import annotations

import pytest
import torch
from engine_models import (
    GREEDY,
    LLAMA_LIKE,
    NEW_TOKENS,
    ON_CUDA,
    PROMPTS,
    Family,
    assert_pool_empty,
    hf_greedy,
    run,
    spec,
    speculating,
    tokens_of,
)
from test_lora_engine import save_adapter
from test_serving_logprobs import INIT, check_request
from test_serving_quant_engine import _dequantized_copy, _greedy, _last_logits, _rel
from transformers import AutoConfig

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.model.families import attention_window, layer_windows
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


# Sliding windows narrower than the prompts and continuations (and than a block, or one block exactly), at every
# layer (Mistral) or at the layers from max_window_layers on (Qwen2: layer 0 full, 1 and 2 windowed).
WINDOWED = {
    "mistral": {"sliding_window": 13},
    "qwen2": {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 3},
}
_g = torch.Generator().manual_seed(2)
WINDOW_PROMPTS = [torch.randint(0, 256, (n,), generator=_g).tolist() for n in (40, 90, 57, 33, 3, 17, 5, 12)]
WINDOW_NEW = 30
WINDOW_GREEDY = SamplingParams(max_tokens=WINDOW_NEW, temperature=0)


class Windowed(Family):
    """A family with a sliding window, and transformers' greedy continuations of WINDOW_PROMPTS (`window_greedy`) and
    those of the same weights without the window (`unwindowed`): the test's window must change what transformers
    computes, or an engine that ignored it would pass."""

    def __init__(self, name: str, directory):
        super().__init__(name, directory, **WINDOWED[name])
        self.window_greedy = [self.hf_greedy(p, WINDOW_NEW) for p in WINDOW_PROMPTS]
        config = self.model.config.__class__.from_dict(self.model.config.to_dict())
        config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
        full = type(self.model)(config).to(self.model.device).eval()
        full.load_state_dict(self.model.state_dict())
        self.unwindowed = [hf_greedy(full, p, WINDOW_NEW) for p in WINDOW_PROMPTS]


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request, tmp_path_factory) -> Windowed:
    return Windowed(request.param, tmp_path_factory.mktemp(f"{request.param}-window"))


def test_layer_windows_are_the_ones_transformers_applies(windowed) -> None:
    model = windowed.model.model
    if windowed.name == "mistral":
        assert layer_windows(windowed.model.config) == [13, 13]
        assert model.config.sliding_window == 13 and model.layers[0].self_attn.config.sliding_window == 13
    else:
        assert layer_windows(windowed.model.config) == [None, 16, 16]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [None, 16, 16]
    assert attention_window(windowed.model.config) == WINDOWED[windowed.name]["sliding_window"]
    # The window changes transformers' continuations: an engine that ignored it would not pass the tests below.
    assert sum(a != b for a, b in zip(windowed.window_greedy, windowed.unwindowed)) >= len(WINDOW_PROMPTS) - 2

    # A window every layer leaves off is no window: Qwen's configs clear it unless use_sliding_window is set.
    common = {"model_type": "qwen2", "max_position_embeddings": 4096, "sliding_window": 1024, "num_hidden_layers": 4}
    assert layer_windows(AutoConfig.for_model(**common)) == [None] * 4
    assert layer_windows(AutoConfig.for_model(**common, use_sliding_window=True, max_window_layers=0)) == [1024] * 4
    assert layer_windows(AutoConfig.for_model(**common, use_sliding_window=True, max_window_layers=3)) == [None] * 3 + [
        1024
    ]
    assert attention_window(AutoConfig.for_model(**common, use_sliding_window=True, max_window_layers=3)) == 1024
    assert attention_window(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert attention_window(AutoConfig.for_model("llama")) is None
    assert attention_window(AutoConfig.for_model("gpt2")) is None


def test_a_sliding_window_is_transformers_own_through_batching_chunks_and_the_prefix_cache(windowed) -> None:
    """Prompts and continuations well past the window, all in one batch of different lengths: decodes in padded
    groups, prompts in one chunk each (the first chunk masked by the window in place of `is_causal`), then split across
    steps (max_num_batched_tokens 32), then again from the prefix cache, and a prompt that shares a cached prefix."""
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = windowed.engine(**fields)
        assert engine.max_model_len == 256  # the spec's, and the model's positions: the window does not cap it
        runner = engine.runner
        if windowed.name == "mistral":  # one metadata, windowed, for every layer
            assert (runner.step_window, runner.mixed_window) == (13, None)
        else:  # a second one for the windowed layers
            assert (runner.step_window, runner.mixed_window) == (None, 16)
        for i, p in enumerate(WINDOW_PROMPTS):
            engine.add_request(str(i), p, WINDOW_GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[str(i)]) for i in range(len(WINDOW_PROMPTS))] == windowed.window_greedy, fields
        for i, p in enumerate(WINDOW_PROMPTS):
            engine.add_request(f"again-{i}", p, WINDOW_GREEDY)
        shared = WINDOW_PROMPTS[1][:64] + WINDOW_PROMPTS[0][:20]  # four blocks of a cached prompt, then its own
        engine.add_request("shared", shared, WINDOW_GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[f"again-{i}"]) for i in range(len(WINDOW_PROMPTS))] == windowed.window_greedy, fields
        assert sum(outputs[f"again-{i}"][0].num_cached_tokens for i in range(len(WINDOW_PROMPTS))) >= 16 * 8
        assert outputs["shared"][0].num_cached_tokens == 64
        assert tokens_of(outputs["shared"]) == windowed.hf_greedy(shared, WINDOW_NEW)
        assert_pool_empty(engine)


def test_a_sliding_window_holds_through_speculative_verification(windowed) -> None:
    """Drafts verified several queries a sequence at once (a chunk over the cache, masked by the window)."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for n in (7, 11, 18):  # phrases that repeat: prompt lookup finds drafts
        phrase = torch.randint(0, 256, (n,), generator=g).tolist()
        prompts.append(phrase * 3 + phrase[: n // 2])
    engine = speculating(windowed.engine(speculative={"method": "ngram", "num_tokens": 4}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, WINDOW_GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(prompts))] == [
        windowed.hf_greedy(p, WINDOW_NEW) for p in prompts
    ]
    assert engine.stats().spec_verify_steps_total > 0


def test_a_sliding_window_holds_in_fixed_shape_decode_steps_over_a_staged_step(windowed) -> None:
    """What a GPU runs: decode steps in fixed shapes (CUDA graphs; here run eagerly, `capture=False`), their bias made
    from the context lengths with the window, and each step's integer tensors staged in one copy."""
    from pylon.serving.model.attention import HostStage
    from pylon.serving.model.graphs import DecodeGraphs

    engine = windowed.engine()
    runner = engine.runner
    if not ON_CUDA:
        runner.stage = HostStage(runner.device, staged=True)
        runner.add_scratch_block()
        runner.decode_graphs = DecodeGraphs(runner, 8, engine.max_model_len, capture=False)
        runner.decode_graphs.capture_all()
    got = [c.token_ids for c in engine.generate(WINDOW_PROMPTS, WINDOW_GREEDY)]
    assert got == windowed.window_greedy
    assert runner.decode_graphs.replays >= WINDOW_NEW - 1
    assert_pool_empty(engine)
