"""The families built as Llama is (pylon.serving.model.families: Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3,
Granite, OLMo 2, OLMo 3, SmolLM3, StarCoder2, Cohere, GLM-4, and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5,
DeepSeek-V2 and V3 with their latent attention, and GPT-OSS, with its attention sinks and its MXFP4 checkpoints) in the engine:
greedy output token for token `transformers`' own, through continuous batching, chunked prefill and the prefix cache;
log-probabilities within 1e-4 of its log-softmax (Gemma 3's soft-capped, Gemma 2's attention scores and logits both);
int8 projections computing the dequantized model (an MoE model's experts quantized too); LoRA adapters computing what
peft computes (Phi-3's on its fused projections; an MoE model's on its attention, and one on its experts refused naming
them); a sliding window (Mistral's, Phi-3's and StarCoder2's in every layer, Qwen2's in the layers from
max_window_layers on, Gemma 2's in every other layer, Gemma 3's in five layers of six, SmolLM3's in its NoPE layers)
applied as transformers applies it, through batching, chunked prefill, the prefix cache, speculative verification and
fixed-shape decode steps; a LongRoPE model served within its original_max_position_embeddings, as transformers
computes it there; the multimodal Gemma 3 and Mistral 3 checkpoints served for their text; and what the engine cannot
compute refused at load, naming the field."""

from __future__ import annotations

import json
import logging
import math
import types

import pytest
import torch
from engine_models import (
    DEVICE,
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
from safetensors import safe_open
from test_lora_engine import save_adapter
from test_serving_logprobs import INIT, check_request
from test_serving_quant_engine import _dequantized_copy, _greedy, _last_logits, _rel
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as apply_partial_rotary_pos_emb

from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.kv_cache import HybridKVBlockPool
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.model.families import (
    LINEAR_ATTENTION_FAMILIES,
    MOE_MODEL_TYPES,
    Chunk,
    attention_softcap,
    attention_window,
    layer_windows,
    position_limit,
)
from pylon.serving.model.moe import SparseMoE
from pylon.serving.model.quant import QuantLinear
from pylon.serving.model.runner import ModelRunner

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Where a family's projections are named otherwise: Phi-3's fused ones, as peft targets them.
FAMILY_PROJECTIONS = (
    {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
    | dict.fromkeys(MOE_MODEL_TYPES, ALL_PROJECTIONS[:4])
    | {"starcoder2": [*ALL_PROJECTIONS[:4], "c_fc", "c_proj"]}
    | {"glm4": [*ALL_PROJECTIONS[:4], "gate_up_proj", "down_proj"]}
    | {"arcee": [*ALL_PROJECTIONS[:4], "up_proj", "down_proj"]}
    | dict.fromkeys(("deepseek_v2", "deepseek_v3"), ["o_proj"])  # latent attention: its output projection only
)


# The families `make test` runs each family test on: one of each way the engine computes a layer (Llama's; Qwen 3's
# per-head norms and tied embeddings; Phi-3's fused projections and partial rotation; Cohere's parallel block;
# Mixtral's experts; DeepSeek-V3's latent attention and grouped router; Qwen3-Next's recurrent layers; GPT-OSS's
# sinks). `make test-all` runs every family (the rest are marked slow): each takes ~15-60 s of a 2-core CI machine.
CORE_FAMILIES = ("mistral", "qwen3", "phi3", "cohere", "mixtral", "deepseek_v3", "qwen3_next", "gpt_oss")


def core_first(names, core=CORE_FAMILIES) -> list:
    """`names` as parameters, those outside `core` marked slow (`make test-all`)."""
    return [n if n in core else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.fixture(scope="module", params=core_first(LLAMA_LIKE))
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
    if family.name == "gemma3_text":
        config, model = family.model.config, family.model.model
        assert model.embed_tokens.embed_scale.item() == pytest.approx(math.sqrt(config.hidden_size))
        assert layer.self_attn.scaling == 20**-0.5 != layer.self_attn.head_dim**-0.5
        rope = model.rotary_emb
        assert not torch.equal(rope.sliding_attention_inv_freq, rope.full_attention_inv_freq)  # bases 100 and 1e4
        assert layer_windows(config) == [16] * 5 + [None, 16]  # every 6th layer full, as the checkpoints
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            assert getattr(layer, norm).weight.abs().mean() > 0.05  # x * (1 + w): w off its zeros
        assert layer.post_feedforward_layernorm.weight.abs().mean() > 0.05 and layer.self_attn.q_norm.weight.std() > 0
        assert config.final_logit_softcapping == 30.0 and config.attn_logit_softcapping is None
    if family.name in ("gemma", "gemma2"):
        config, model = family.model.config, family.model.model
        assert model.embed_tokens.embed_scale.item() == pytest.approx(math.sqrt(config.hidden_size))
        assert layer.input_layernorm.weight.abs().mean() > 0.05 and not hasattr(layer.self_attn, "q_norm")
        assert layer.mlp.act_fn.__class__.__name__ == "GELUTanh"  # gelu_pytorch_tanh gates the MLP
    if family.name == "gemma":
        assert layer.self_attn.head_dim * 4 != config.hidden_size and not hasattr(layer, "pre_feedforward_layernorm")
    if family.name == "gemma2":
        assert layer.self_attn.scaling == 20**-0.5 != layer.self_attn.head_dim**-0.5
        assert layer_windows(config) == [16, None, 16, None]  # layer_types: windowed and full by turns
        assert layer.post_feedforward_layernorm.weight.abs().mean() > 0.05
        assert config.final_logit_softcapping == 30.0 and attention_softcap(config) == 10.0
        # The attention's soft cap changes transformers' continuations: an engine without it could not pass.
        attns = [layer.self_attn for layer in model.layers]
        for a in attns:
            a.attn_logit_softcapping = None
        try:
            uncapped = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            for a in attns:
                a.attn_logit_softcapping = config.attn_logit_softcapping
        assert sum(a != b for a, b in zip(uncapped, family.greedy)) >= len(PROMPTS) - 2
    if family.name == "granite":
        config, model = family.model.config, family.model.model
        assert layer.self_attn.scaling == 0.1 != layer.self_attn.head_dim**-0.5 and config.logits_scaling == 4.0
        # Each multiplier changes transformers' continuations: an engine that ignored one could not pass.
        for owners, name in (([model], "embedding_multiplier"), (list(model.layers), "residual_multiplier")):
            kept = [getattr(o, name) for o in owners]
            for o in owners:
                setattr(o, name, 1.0)
            try:
                changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
            finally:
                for o, value in zip(owners, kept):
                    setattr(o, name, value)
            assert sum(a != b for a, b in zip(changed, family.greedy)) >= len(PROMPTS) - 2, name
    if family.name == "smollm3":  # NoPE layers 1 and 3: rotating them too changes transformers' continuations
        attns = [layer.self_attn for layer in family.model.model.layers]
        assert [a.use_rope for a in attns] == [1, 0, 1, 0]
        for a in attns:
            a.use_rope = 1
        try:
            rotated = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            for a, r in zip(attns, [1, 0, 1, 0]):
                a.use_rope = r
        assert sum(a != b for a, b in zip(rotated, family.greedy)) >= len(PROMPTS) - 2
    if family.name in ("cohere", "cohere2"):
        import importlib

        config = family.model.config
        assert not hasattr(layer, "post_attention_layernorm") and config.logit_scale == 0.25  # one norm, side by side
        # Its rotary embedding rotates interleaved pairs: rotating as Llama does changes transformers' continuations.
        module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
        own = module.apply_rotary_pos_emb
        module.apply_rotary_pos_emb = apply_rotary_pos_emb
        try:
            as_llama = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            module.apply_rotary_pos_emb = own
        assert sum(a != b for a, b in zip(as_llama, family.greedy)) >= len(PROMPTS) // 2
    if family.name == "cohere":  # Command R+'s per-head query and key LayerNorms: a weight per head
        assert tuple(layer.self_attn.q_norm.weight.shape) == (4, 32) and layer.self_attn.q_norm.weight.std() > 0
    if family.name == "cohere2":  # every 4th layer full and unrotated (NoPE), as its checkpoints
        assert layer_windows(family.model.config) == [16, 16, 16, None]
        assert LLMEngine(family.dir, spec()).runner._rotates == [True, True, True, False]
    if family.name == "starcoder2":
        assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) and layer.input_layernorm.bias.abs().sum() > 0
        assert layer.mlp.c_fc.bias.abs().sum() > 0 and not hasattr(layer.mlp, "gate_proj")
    if family.name == "olmo2":
        attn = layer.self_attn
        assert not hasattr(layer, "input_layernorm") and layer.post_feedforward_layernorm.weight.std() > 0
        assert attn.q_norm.weight.numel() == 4 * attn.head_dim and attn.k_norm.weight.numel() == 2 * attn.head_dim
    if family.name == "phi3":
        attn, config = layer.self_attn, family.model.config
        assert not hasattr(attn, "q_proj") and hasattr(layer.mlp, "gate_up_proj")
        assert attn.qkv_proj.out_features == (4 + 2 * 2) * 32  # 4 query heads, 2 key and 2 value heads, of 32
        assert family.model.model.rotary_emb.inv_freq.numel() * 2 == 16 < attn.head_dim  # 16 of 32 dimensions rotated
        assert config.sliding_window is None and family.model.model.rotary_emb.attention_scaling == 1.0
    if family.name == "gpt_oss":
        check_gpt_oss_parts_matter(family)
    if family.name in ("glm4_moe", "dots1", "deepseek_v2", "deepseek_v3"):
        check_deepseek_router_matters(family)
    if family.name == "deepseek_v3":
        check_latent_attention(family)
    if family.name == "deepseek_v2":  # its latent cache, and no query rank (V2-Lite's one q_proj)
        engine = family.engine()
        assert [tuple(k.shape) for k in engine.runner.k_cache] == [(1, 2048 // 16, 16, 32 + 16)] * 3
        assert layer.self_attn.q_proj is not None and layer.self_attn.q_a_proj is None
    if family.name == "seed_oss":
        assert layer.self_attn.o_proj.bias.abs().sum() > 0 and layer.self_attn.k_proj.bias.abs().sum() > 0
    if family.name == "apertus":  # Qwen3's norms, a gateless xIELU MLP, its own names for Llama's norms
        assert layer.self_attn.q_norm.weight.std() > 0 and not hasattr(layer.mlp, "gate_proj")
        assert type(layer.mlp.act_fn).__name__ == "XIELUActivation" and hasattr(layer, "attention_layernorm")
        act = layer.mlp.act_fn
        with torch.no_grad():  # its learned parameters count: moved, transformers' continuations change
            kept = [p.clone() for p in act.parameters()]
            for p in act.parameters():
                p.add_(0.5)
        try:
            moved = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            with torch.no_grad():
                for p, k in zip(act.parameters(), kept):
                    p.copy_(k)
        assert sum(a != b for a, b in zip(moved, family.greedy)) >= 2
    if family.name == "arcee":
        assert not hasattr(layer.mlp, "gate_proj") and family.model.config.hidden_act == "relu2"
    if family.name == "hunyuan_v1_dense":
        assert layer.self_attn.query_layernorm.weight.std() > 0 and not hasattr(layer.self_attn, "q_norm")
    if family.name == "exaone4":  # output norms only; its full layer unrotated
        assert not hasattr(layer, "input_layernorm") and layer_windows(family.model.config) == [16, 16, 16, None]
    if family.name == "ministral":
        assert layer_windows(family.model.config) == [16, 16, 16]
    if family.name in ("ernie4_5", "helium", "ministral3"):  # what their modules compute apart from Llama's
        check_family_part_matters(family)
    if family.name == "olmo3":  # OLMo 2's layer, windowed in three layers of four; YaRN in the full layer only
        rotary = family.model.model.rotary_emb
        assert layer_windows(family.model.config) == [16, 16, 16, None] and not hasattr(layer, "input_layernorm")
        assert rotary.full_attention_attention_scaling == 1.2 and rotary.sliding_attention_attention_scaling == 1.0
        assert not torch.equal(rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq)
    if family.name == "glm4":  # four norms, a fused MLP; its interleaved rotation changes transformers' continuations
        assert hasattr(layer, "post_self_attn_layernorm") and layer.post_mlp_layernorm.weight.std() > 0
        assert hasattr(layer.mlp, "gate_up_proj") and layer.self_attn.q_proj.bias.abs().sum() > 0
        assert family.model.model.rotary_emb.inv_freq.numel() * 2 == 16 < layer.self_attn.head_dim
        import transformers.models.glm4.modeling_glm4 as glm4

        interleaved = glm4.apply_rotary_pos_emb
        glm4.apply_rotary_pos_emb = apply_partial_rotary_pos_emb  # Phi-3's: the first half's halves, not pairs
        try:
            halves = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS[:4]]
        finally:
            glm4.apply_rotary_pos_emb = interleaved
        assert sum(a != b for a, b in zip(halves, family.greedy)) >= 3
    if family.name == "llama4_text":
        check_llama4_parts_matter(family)
    elif family.name in MOE_MODEL_TYPES:
        check_experts_matter(family)
    assert sum(a != b for a, b in zip(family.greedy, family.greedy[1:])) >= len(PROMPTS) - 2  # context-dependent


def check_gpt_oss_parts_matter(family) -> None:
    """GPT-OSS's attention sinks, its experts' clamp and their biases each change transformers' continuations: an
    engine that left one out could not pass the parity below. Its layers windowed and full by turns; YaRN's attention
    scaling on."""
    model, config = family.model, family.model.config
    assert layer_windows(config) == [16, None, 16, None]
    assert model.model.rotary_emb.attention_scaling > 1.05  # YaRN's attention scaling, folded into cos and sin
    layers = model.model.layers
    assert all(
        layer.self_attn.o_proj.bias.abs().sum() > 0 and layer.mlp.router.bias.abs().sum() > 0 for layer in layers
    )

    def changes(part: str, saved: list, set_to) -> None:
        for owner in saved:
            set_to(owner)
        try:  # half the prompts: transformers' MoE loop is slow on a CPU
            changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS[:4]]
        finally:
            for owner, value in saved.items():
                setattr(*owner, value) if isinstance(owner, tuple) else owner.data.copy_(value)
        assert sum(a != b for a, b in zip(changed, family.greedy)) >= 3, part

    sinks = {layer.self_attn.sinks: layer.self_attn.sinks.detach().clone() for layer in layers}
    changes("sinks", sinks, lambda p: p.data.fill_(-1e4))  # a sink of -1e4 weighs nothing: plain attention
    limits = {(layer.mlp.experts, "limit"): layer.mlp.experts.limit for layer in layers}
    changes("swiglu_limit", limits, lambda owner: setattr(*owner, 1e9))
    biases = {
        layer.mlp.experts.gate_up_proj_bias: layer.mlp.experts.gate_up_proj_bias.detach().clone() for layer in layers
    }
    changes("experts' biases", biases, lambda p: p.data.zero_())


def test_recurrent_layers_keep_each_sequences_state_through_preemption(tmp_path) -> None:
    """Qwen3-Next's recurrent layers: a KV pool too small for the batch preempts requests, which compute again from
    their start (their states anew) and still give transformers' tokens; the states are let go when requests end;
    speculation is refused naming the field."""
    family = Family("qwen3_next", tmp_path / "qwen3-next")
    layers = family.model.model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert family.model.config.rope_parameters["partial_rotary_factor"] == 0.25
    engine = family.engine(kv_cache_tokens=384, max_num_seqs=8, max_model_len=128)
    assert engine.runner.recurrent and engine.pool.enable_caching and engine.snapshots is not None
    # the recurrent layers cache no keys and values; the planner counts the attention layer's only
    assert [k.shape[1] for k in engine.runner.k_cache] == [0, 0, 0, 384 // 16]
    from pylon.plan.memory import kv_bytes_per_token, model_shape

    assert kv_bytes_per_token(model_shape(family.model.config), 2) == 2 * 1 * 2 * 32 * 2  # K and V, 1 layer, 2 heads
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    assert engine.stats().num_preemptions_total > 0  # the pool held fewer sequences than were running
    assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == family.greedy
    assert engine.runner._states == {}  # every finished request's state let go


def check_llama4_parts_matter(family) -> None:
    """Llama 4's layers as its checkpoints lay them out (chunks in the rotating layers, the last NoPE, MoE blocks by
    turns with a shared expert), every expert picked by some prompt token, and each part that sets it apart changing
    transformers' continuations when it is off: the chunks, the L2 query and key norms, the NoPE layer's query
    temperature, the NoPE layer itself (rotated), and the router's weights on the experts' inputs (on their outputs
    instead)."""
    import transformers.models.llama4.modeling_llama4 as llama4

    model, config = family.model, family.model.config
    layers = model.model.layers
    assert layer_windows(config) == [16, 16, 16, None] and config.no_rope_layers == [1, 1, 1, 0]
    assert [hasattr(layer.feed_forward, "experts") for layer in layers] == [False, True, False, True]
    assert hasattr(layers[0].self_attn, "qk_norm") and not hasattr(layers[3].self_attn, "qk_norm")
    picked = {i: set() for i in (1, 3)}
    hooks = [
        layers[i].feed_forward.router.register_forward_hook(
            lambda m, args, out, i=i: picked[i].update(out[0].argmax(-1).flatten().tolist())
        )
        for i in picked
    ]
    with torch.no_grad():
        for p in PROMPTS:
            model(torch.tensor([p], device=model.device))
    for h in hooks:
        h.remove()
    assert all(picked[i] == set(range(4)) for i in picked), picked

    def changed(undo, redo) -> int:
        undo()
        try:
            out = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            redo()
        return sum(a != b for a, b in zip(out, family.greedy))

    attns = [layer.self_attn for layer in layers]
    norm = attns[0].qk_norm

    def set_all(name, value):
        return lambda: [setattr(a, name, value) for a in attns]

    chunk = config.attention_chunk_size
    assert (
        changed(
            lambda: setattr(config, "attention_chunk_size", 10**6),
            lambda: setattr(config, "attention_chunk_size", chunk),
        )
        >= 2
    )
    assert (
        changed(
            lambda: [delattr(a, "qk_norm") for a in attns[:3]], lambda: [setattr(a, "qk_norm", norm) for a in attns[:3]]
        )
        >= 2
    )
    assert changed(set_all("attn_temperature_tuning", False), set_all("attn_temperature_tuning", True)) >= 2
    assert changed(lambda: setattr(attns[3], "use_rope", 1), lambda: setattr(attns[3], "use_rope", 0)) >= 2
    moe_forward = llama4.Llama4TextMoe.forward

    def outputs_weighted(self, hidden_states):  # the router's weights on the experts' outputs, as other MoEs
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden_states)
        routed = self.experts(hidden_states.repeat(scores.shape[1], 1))
        routed = routed * scores.transpose(0, 1).reshape(-1, 1)
        out = self.shared_expert(hidden_states)
        return out + routed.reshape(scores.shape[1], -1, routed.shape[-1]).sum(dim=0), logits

    undo = lambda: setattr(llama4.Llama4TextMoe, "forward", outputs_weighted)  # noqa: E731
    assert changed(undo, lambda: setattr(llama4.Llama4TextMoe, "forward", moe_forward)) >= 2


def check_family_part_matters(family) -> None:
    """ERNIE 4.5's and Helium's rotation of interleaved pairs (rotating halves, as Llama, changes transformers'
    continuations), and Ministral 3's query scale past original_max_position_embeddings (off, it changes them)."""
    import importlib

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    module = importlib.import_module(type(family.model.model).__module__)
    if family.name == "ministral3":
        name, replacement = "get_llama_4_attn_scale", lambda positions, beta, original: torch.ones(1)
    else:
        name, replacement = "apply_rotary_pos_emb", llama_rope
    kept = getattr(module, name)
    setattr(module, name, replacement)
    try:
        changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
    finally:
        setattr(module, name, kept)
    assert sum(a != b for a, b in zip(changed, family.greedy)) >= 3


def check_latent_attention(family) -> None:
    """DeepSeek-V3's latent attention: the engine caches one latent and rotated part a token and layer (48 numbers
    here, against 4 heads x (56 + 24) expanded), and its parts each change transformers' continuations: the YaRN
    mscale in the scale, the interleaved rotation."""
    model, config = family.model, family.model.config
    attn = model.model.layers[0].self_attn
    assert attn.scaling > attn.qk_head_dim**-0.5 * 1.1 and attn.q_lora_rank == 48  # YaRN's mscale squared
    engine = family.engine()
    assert [tuple(k.shape) for k in engine.runner.k_cache] == [(1, 2048 // 16, 16, 32 + 16)] * 3
    assert all(layer.self_attn.kv_b_proj is None for layer in engine.runner.model.model.layers)  # absorbed
    assert all(k is v for k, v in zip(engine.runner.k_cache, engine.runner.v_cache))  # the latent: key and value
    config.rope_interleave = False
    try:
        halves = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS[:4]]
    finally:
        config.rope_interleave = True
    assert sum(a != b for a, b in zip(halves, family.greedy)) >= 3


def check_deepseek_router_matters(family) -> None:
    """DeepSeek's router (GLM-4.5's too): its correction bias, groups and scaling each change transformers'
    continuations: an engine that left one out could not pass the parity below. GLM-4.5's half-rotated heads."""
    model = family.model
    layer = model.model.layers[1]
    if family.name == "glm4_moe":
        assert model.model.rotary_emb.inv_freq.numel() * 2 == 16 < layer.self_attn.head_dim  # 16 of 32 dimensions
        assert layer.self_attn.q_proj.bias.abs().sum() > 0 and layer.self_attn.q_norm.weight.numel() == 32
    routers = [model.model.layers[i].mlp.gate for i in (1, 2)]
    if family.name != "deepseek_v2":  # (DeepSeek-V2's router has no correction bias)
        assert all(r.e_score_correction_bias.abs().sum() > 0 for r in routers)

    def changes(part: str, name: str, value) -> None:
        kept = [getattr(r, name) for r in routers]
        for r in routers:
            setattr(r, name, value if not isinstance(value, torch.Tensor) else torch.zeros_like(getattr(r, name)))
        try:
            changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS[:4]]
        finally:
            for r, v in zip(routers, kept):
                setattr(r, name, v)
        assert sum(a != b for a, b in zip(changed, family.greedy)) >= 3, part

    if family.name != "deepseek_v2":  # (DeepSeek-V2's router has none)
        changes("the correction bias", "e_score_correction_bias", torch.zeros(1))
    changes("groups", "topk_group", 2)  # every group eligible
    changes("routed_scaling_factor", "routed_scaling_factor", 1.0)


def check_experts_matter(family) -> None:
    """Every expert of every MoE layer is picked by some prompt token (an engine that never ran one could pass the
    parity otherwise), and the router's weights as the family computes them matter: flipped renormalisation changes
    transformers' continuations. Qwen2-MoE's shared expert and its dense layer are there."""
    model, config = family.model, family.model.config
    # Saved as the published checkpoints are laid out (one weight per expert and projection; transformers merges
    # them into 3-D weights at load): what the engine reads from the hub's files.
    with safe_open(f"{family.dir}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    per_expert = {
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "qwen2_moe": "model.layers.0.mlp.experts.5.gate_proj.weight",
        "qwen3_moe": "model.layers.1.mlp.experts.7.down_proj.weight",
        "gpt_oss": "model.layers.3.mlp.experts.gate_up_proj_bias",  # its checkpoints keep the 3-D weights
        "glm4_moe": "model.layers.2.mlp.experts.7.up_proj.weight",
        "deepseek_v3": "model.layers.2.mlp.experts.7.up_proj.weight",
        "deepseek_v2": "model.layers.2.mlp.experts.7.up_proj.weight",
        "dots1": "model.layers.2.mlp.experts.7.up_proj.weight",
        "olmoe": "model.layers.2.mlp.experts.7.up_proj.weight",
        "flex_olmo": "model.layers.2.mlp.experts.7.up_proj.weight",
        "ernie4_5_moe": "model.layers.2.mlp.experts.7.gate_proj.weight",
        "qwen3_next": "model.layers.3.mlp.experts.3.gate_proj.weight",
        "qwen3_5_moe_text": "model.layers.3.mlp.experts.3.gate_proj.weight",
    }
    assert per_expert[family.name] in keys, sorted(keys)[:8]
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    if family.name == "qwen2_moe":
        assert sparse == [0] and hasattr(model.model.layers[0].mlp, "shared_expert")
        assert model.model.layers[0].mlp.shared_expert_gate.weight.abs().sum() > 0
        assert not hasattr(model.model.layers[1].mlp, "experts")  # mlp_only_layers: dense
    elif family.name in ("glm4_moe", "dots1", "deepseek_v2", "deepseek_v3"):  # layer 0 dense (first_k_dense_replace)
        assert sparse == [1, 2] and hasattr(model.model.layers[1].mlp, "shared_experts")
    elif family.name == "ernie4_5_moe":  # layer 0 dense (moe_layer_start_index); a correction bias off its zeros
        assert sparse == [1, 2] and model.model.layers[1].mlp.shared_experts is not None
        statics = [model.model.layers[i].mlp.gate.moe_statics.e_score_correction_bias for i in sparse]
        kept = [b.detach().clone() for b in statics]
        with torch.no_grad():
            for b in statics:
                b.zero_()
        try:  # the bias chooses the experts: without it, transformers' continuations change
            unbiased = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
        finally:
            with torch.no_grad():
                for b, k in zip(statics, kept):
                    b.copy_(k)
        assert sum(a != b for a, b in zip(unbiased, family.greedy)) >= 2
    else:
        assert sparse == list(range(len(model.model.layers)))
    picked = {i: set() for i in sparse}
    router_of = "router" if family.name == "gpt_oss" else "gate"
    hooks = [
        getattr(model.model.layers[i].mlp, router_of).register_forward_hook(
            lambda m, args, out, i=i: picked[i].update(out[2].flatten().tolist())
        )
        for i in sparse
    ]
    with torch.no_grad():
        for p in PROMPTS:
            model(torch.tensor([p], device=model.device))
    for h in hooks:
        h.remove()
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert all(picked[i] == set(range(num_experts)) for i in sparse), picked
    routers = [getattr(model.model.layers[i].mlp, router_of) for i in sparse]
    # Mixtral's and GPT-OSS's routers always renormalise: scale the top weights as a sum of 1 would not.
    # FlexOlmo normalises the MLP's output, so a scale of all the weights is lost: its top two weights swapped instead.
    retuned = ("mixtral", "gpt_oss", "deepseek_v2", "flex_olmo", "ernie4_5_moe", "qwen3_5_moe_text")
    if family.name in retuned:  # (DeepSeek-V2's: no renormalisation to flip)
        forward = type(routers[0]).forward
        tweak = (lambda w: w.flip(-1)) if family.name == "flex_olmo" else (lambda w: w * 0.7)
        for r in routers:
            r.forward = lambda x, r=r: (lambda o: (o[0], tweak(o[1]), o[2]))(forward(r, x))
    else:
        for r in routers:
            r.norm_topk_prob = not r.norm_topk_prob
    try:
        changed = [family.hf_greedy(p, NEW_TOKENS) for p in PROMPTS]
    finally:
        for r in routers:
            if family.name in retuned:
                del r.forward
            else:
                r.norm_topk_prob = not r.norm_topk_prob
    assert sum(a != b for a, b in zip(changed, family.greedy)) >= 2  # the parity below would catch it


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
        cached = sum(outputs[f"again-{i}"][0].num_cached_tokens for i in range(len(PROMPTS)))
        # (recurrent layers: as far as a snapshot of their states, the last block boundary of each prompt)
        assert cached >= 16 * 6, (cached, fields)


def fixed_shape_decodes(engine: LLMEngine) -> None:
    """`engine`'s steps of decodes in fixed shapes (CUDA graphs, which a GPU's engine has already; here run eagerly,
    `capture=False`), each step's integer tensors staged in one copy, as a GPU's are."""
    from pylon.serving.model.attention import HostStage
    from pylon.serving.model.graphs import DecodeGraphs

    runner = engine.runner
    if not ON_CUDA:
        runner.stage = HostStage(runner.device, staged=True)
        runner.add_scratch_block()
        runner.decode_graphs = DecodeGraphs(runner, 8, engine.max_model_len, capture=False)
        runner.decode_graphs.capture_all()


# Where a family's own fp32 arithmetic moves log-probabilities past the check's 1e-4 at INIT, a smaller init (see below).
NOISE_FLOOR_INIT = {"gpt_oss": 0.15, "qwen3_next": 0.05}


@pytest.mark.parametrize(
    "name",
    core_first(
        [
            "qwen3",
            "gemma3_text",
            "gemma2",
            "phi3",
            "granite",
            "cohere",
            "cohere2",
            "gpt_oss",
            "glm4_moe",
            "deepseek_v3",
            "llama4_text",
            "qwen3_next",
        ]
    ),
)
def test_logprobs_are_transformers_own(name, tmp_path) -> None:
    """Gemma 3's through its soft cap (final_logit_softcapping), Gemma 2's through both of its caps, in eager steps
    and fixed-shape decode steps; Granite's logits divided by logits_scaling."""
    # GPT-OSS's fp32 noise floor (transformers' own fp32 log-probabilities against fp64's) is ~1.5e-4 at INIT and
    # ~2e-5 at 0.15, where the engine's stay within 1e-6 of transformers' fp32 ones. Qwen3-Next's recurrent layers
    # compute a prompt with the chunked delta rule and a decode with the recurrent one: transformers' own incremental
    # log-probabilities differ from its one-forward ones by 2.3e-3 at 0.5, 1.6e-4 at 0.15 and 1e-5 at 0.05.
    family = Family(name, tmp_path / name, initializer_range=NOISE_FLOOR_INIT.get(name, INIT))
    engine = family.engine()
    if name in ("gemma3_text", "gemma2"):
        fixed_shape_decodes(engine)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        check_request(family, prompt, outputs[str(i)], k=5, prompt_k=5)
    if name in ("gemma3_text", "gemma2"):
        assert engine.runner.decode_graphs.replays > 0


def test_what_the_engine_cannot_compute_is_refused_naming_the_field(tmp_path) -> None:
    """Refused before any weight is read: a config.json alone is enough to tell."""
    common = {**LLAMA_LIKE["gemma3_text"], "model_type": "gemma3_text"}
    for fields, named in (
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ):
        directory = tmp_path / named.split()[0]
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**common, **fields}))
        with pytest.raises(PylonError, match=named):
            ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu")
    directory = tmp_path / "fp16"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(common))
    with pytest.raises(PylonError, match="engine.dtype: fp16 .*Gemma 3's activations overflow fp16"):
        ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu", dtype="fp16")
    directory = tmp_path / "gemma2-fp16"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA_LIKE["gemma2"], "model_type": "gemma2"}))
    with pytest.raises(PylonError, match="engine.dtype: fp16 .*Gemma 2's activations overflow fp16"):
        ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu", dtype="fp16")
    # The multimodal Gemma 3 is checked as its language model is.
    directory = tmp_path / "gemma3"
    directory.mkdir()
    text = {**common, "attn_logit_softcapping": 50.0}
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    with pytest.raises(PylonError, match="attn_logit_softcapping is 50.0"):
        ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu")
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": common}))
    with pytest.raises(PylonError, match="Gemma 3's activations overflow fp16"):
        ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu", dtype="fp16")


def _multimodal(name: str):
    """A tiny multimodal checkpoint of `name`'s kind: its conditional model (a vision tower and projector beside a
    language model of the family LLAMA_LIKE shapes), and the language model's layer windows."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
    )

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": 257}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14}
    # image_token_index past the byte tokenizer's ids: no prompt holds an image; untied: a random model this small
    # repeats its last token with tied embeddings (see engine_models).
    common = {"image_token_index": 300, "tie_word_embeddings": False, **ids}
    if name == "gemma3":
        text = {**LLAMA_LIKE["gemma3_text"], "initializer_range": 0.5, **ids}
        # As the checkpoints ship: no final soft cap (transformers' conditional model would not apply one: its
        # Gemma3ForCausalLM does).
        text["final_logit_softcapping"] = None
        config = Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=301,
            eoi_token_index=302,
            **common,
        )
        return Gemma3ForConditionalGeneration(config), [16] * 5 + [None, 16]
    if name == "llama4":  # a whole Llama4ForCausalLM under language_model.*
        from transformers import Llama4Config, Llama4ForConditionalGeneration

        text = {**LLAMA_LIKE["llama4_text"], "initializer_range": 0.5, **ids}
        vision |= {"num_hidden_layers": 1, "vision_output_dim": 32, "projector_input_dim": 32}
        vision |= {"projector_output_dim": 128}
        return Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision, **ids)), None
    if name == "qwen3_5":  # under model.language_model.*, its recurrent layers
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        text = {**LLAMA_LIKE["qwen3_5_text"], "initializer_range": 0.5, **ids}
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128}
        vision |= {"patch_size": 14, "spatial_merge_size": 2}
        tokens = {
            "image_token_id": 300,
            "video_token_id": 301,
            "vision_start_token_id": 302,
            "vision_end_token_id": 303,
        }
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
        return Qwen3_5ForConditionalGeneration(config), None
    # As Mistral Small 3.1 and 3.2 ship: no sliding window (MistralConfig's default has one). At the logprob tests'
    # scale (INIT): at 0.5 its logits are large enough for fp32 rounding to move a logprob past their 1e-4.
    text = {**LLAMA_LIKE["mistral"], "model_type": "mistral", "sliding_window": None, "initializer_range": INIT, **ids}
    vision = {**vision, "model_type": "pixtral", "head_dim": 16}
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=1, **common)
    return Mistral3ForConditionalGeneration(config), [None, None]


@pytest.mark.parametrize("name", core_first(["gemma3", "mistral3"], core=("mistral3",)))
def test_a_multimodal_checkpoint_is_served_for_its_text(name, tmp_path) -> None:
    """Gemma 3 4B, 12B and 27B and Mistral Small 3.1 and 3.2 ship as conditional models (a vision tower and projector
    beside the language model, saved under the hub's language_model.model.* keys): served for their text, the
    engine's greedy tokens and log-probabilities are what that model computes on text alone, through batching,
    chunks and the prefix cache, with the vision tower not kept; a LoRA adapter of the conditional model adapts its
    language model."""
    from safetensors import safe_open

    from pylon.data.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model, windows = _multimodal(name)
    model.eval()
    conditional = type(model)
    with torch.no_grad():  # the norms off their zeros and ones, as the family fixture's
        for key, p in model.model.language_model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.25)
    directory = tmp_path / f"{name}-like"
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(ByteTokenizer().info.model_dump(mode="json")))
    with safe_open(f"{directory}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys  # the hub's layout, as it ships
    assert any(k.startswith("vision_tower.") for k in keys) and any(k.startswith("multi_modal_projector") for k in keys)
    model.to(DEVICE)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, want[1:])) >= len(PROMPTS) - 2  # context-dependent continuations...
    assert sum(len(set(w)) > 3 for w in want) >= len(PROMPTS) - 2  # ...that do not repeat one token
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = LLMEngine(str(directory), spec(**fields))
        runner = engine.runner
        assert runner.model_type == model.config.text_config.model_type and runner.layer_windows == windows
        names = [name for name, _ in runner.model.named_parameters()]
        assert not any("vision" in n or "multi_modal" in n for n in names), names[:5]
        assert torch.equal(runner.model.lm_head.weight.cpu(), model.lm_head.weight.cpu())  # the checkpoint's own
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == want, fields
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"again-{i}", p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[f"again-{i}"]) for i in range(len(PROMPTS))] == want, fields
    # A LoRA adapter trained on the conditional model (peft names its modules model.language_model.layers...) adapts
    # the engine's language model as peft computes it; one that changes the vision tower is refused naming it.
    from peft import LoraConfig, get_peft_model

    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    torch.manual_seed(3)
    base = conditional.from_pretrained(directory, dtype=torch.float32)
    tuned = get_peft_model(base, LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    tuned.save_pretrained(tmp_path / "adapter")
    tuned = tuned.eval().to(DEVICE)
    adapted = [hf_greedy(tuned, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(adapted, want)) >= len(PROMPTS) - 1  # the adapter changes the outputs
    engine = LLMEngine(str(directory), spec(adapters=[{"name": "tuned", "path": str(tmp_path / "adapter")}]))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
        engine.add_request(f"base-{i}", p, GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == adapted
    assert [tokens_of(outputs[f"base-{i}"]) for i in range(len(PROMPTS))] == want
    vision = get_peft_model(
        conditional.from_pretrained(directory, dtype=torch.float32),
        LoraConfig(r=4, target_modules=["q_proj"]),  # the vision tower's attention has q_proj too
    )
    vision.save_pretrained(tmp_path / "vision-adapter")
    with pytest.raises(PylonError, match="vision_tower"):
        LLMEngine(str(directory), spec(adapters=[{"name": "v", "path": str(tmp_path / "vision-adapter")}]))
    # The planner sizes what the engine holds: the language model's parameters, and the vision tower's and the
    # projector's where images are taken (engine.max_images_per_prompt > 0, the default; test_images.py).
    from pylon.plan.serve import plan_serve
    from pylon.specs import DeploymentSpec

    language = sum(p.numel() for p in model.model.language_model.parameters()) + model.lm_head.weight.numel()
    seeing = sum(
        p.numel() for m in (model.model.vision_tower, model.model.multi_modal_projector) for p in m.parameters()
    )
    text_only = {"max_images_per_prompt": 0}
    plan = plan_serve(DeploymentSpec(name="g", model=str(directory), engine=text_only), gpu="A100-80GB")
    assert plan.rows[0].weights == language * 2  # bf16 on a GPU
    plan = plan_serve(DeploymentSpec(name="g", model=str(directory)), gpu="A100-80GB")
    assert plan.rows[0].weights == language * 2  # (saved without its image processor: served for its text)
    (directory / "preprocessor_config.json").write_text("{}")  # as a checkpoint ships: images taken
    plan = plan_serve(DeploymentSpec(name="g", model=str(directory)), gpu="A100-80GB")
    assert plan.rows[0].weights == (language + seeing) * 2 and "vision tower" in " ".join(plan.notes)
    # Log-probabilities: the conditional model's log-softmax of its logits, generated and prompt tokens.
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"lp-{i}", prompt, params)
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:3]):
        check_request(types.SimpleNamespace(model=model), prompt, outputs[f"lp-{i}"], k=5, prompt_k=5)


@pytest.mark.slow  # (Llama 4 is a make test-all family)
def test_a_llama4_multimodal_checkpoint_is_served_for_its_text(tmp_path) -> None:
    """Llama 4 Scout and Maverick ship as Llama4ForConditionalGeneration (a vision model and projector beside a whole
    Llama4ForCausalLM, under language_model.*): served for its text, its greedy tokens are the conditional model's on
    text alone, through batching and chunks; the vision model is not kept, no image is taken, the planner counts the
    language model only; a LoRA adapter of the conditional model's attention adapts the engine's as peft computes."""
    from peft import LoraConfig, get_peft_model
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from pylon.data.tokenizer import ByteTokenizer
    from pylon.plan.serve import plan_serve
    from pylon.specs import DeploymentSpec

    tok = ByteTokenizer()
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": 257}
    text = {**LLAMA_LIKE["llama4_text"], "initializer_range": 0.5, **ids}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32}
    vision |= {"projector_output_dim": 128}
    config = Llama4Config(text_config=text, vision_config=vision, image_token_index=300, **ids)
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the norms off their ones, as the family fixture's
        for key, p in model.language_model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.25)
    directory = tmp_path / "llama4-like"
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    with safe_open(f"{directory}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys and "language_model.lm_head.weight" in keys
    assert any(k.startswith("vision_model.") for k in keys) and any(k.startswith("multi_modal_projector") for k in keys)
    model.to(DEVICE)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, want[1:])) >= len(PROMPTS) - 2
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = LLMEngine(str(directory), spec(**fields))
        runner = engine.runner
        assert runner.model_type == "llama4_text" and runner.layer_windows == [16, 16, 16, None]
        assert engine.max_images == 0 and runner.vision is None
        names = [name for name, _ in runner.model.named_parameters()]
        assert not any("vision" in n or "multi_modal" in n for n in names), names[:5]
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == want, fields
    language = sum(p.numel() for p in model.language_model.parameters())
    plan = plan_serve(DeploymentSpec(name="l", model=str(directory)), gpu="A100-80GB")
    assert plan.rows[0].weights == language * 2  # bf16; no vision tower: its images are not taken
    torch.manual_seed(3)
    base = Llama4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
    tuned = get_peft_model(base, LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    tuned.save_pretrained(tmp_path / "adapter")
    tuned = tuned.eval().to(DEVICE)
    adapted = [hf_greedy(tuned, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(adapted, want)) >= len(PROMPTS) - 1
    engine = LLMEngine(str(directory), spec(adapters=[{"name": "tuned", "path": str(tmp_path / "adapter")}]))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == adapted


def test_a_qwen3_5_multimodal_checkpoint_is_served_for_its_text(tmp_path) -> None:
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration (a vision model beside its language model, under
    model.language_model.*): served for its text, through its recurrent layers, its greedy tokens are the conditional
    model's on text alone; the vision model is not kept and the planner counts the language model only."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from pylon.data.tokenizer import ByteTokenizer
    from pylon.plan.serve import plan_serve
    from pylon.specs import DeploymentSpec

    tok = ByteTokenizer()
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": 257}
    text = {**LLAMA_LIKE["qwen3_5_text"], "initializer_range": 0.5, **ids}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128}
    vision |= {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    tokens = {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    directory = tmp_path / "qwen3_5-like"
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    model.to(DEVICE)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, want[1:])) >= len(PROMPTS) - 2
    engine = LLMEngine(str(directory), spec(max_num_batched_tokens=32, max_num_seqs=4))
    runner = engine.runner
    assert runner.model_type == "qwen3_5_text" and runner.recurrent and engine.max_images == 0
    assert not any("visual" in n for n, _ in runner.model.named_parameters())
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == want
    language = sum(p.numel() for p in model.model.language_model.parameters()) + model.lm_head.weight.numel()
    plan = plan_serve(DeploymentSpec(name="q", model=str(directory)), gpu="A100-80GB")
    assert plan.rows[0].weights == language * 2


def test_a_longrope_model_is_served_within_its_original_positions_as_transformers_computes_it(tmp_path, caplog) -> None:
    """LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): transformers rotates with the short factors while a
    sequence stays within original_max_position_embeddings and with the long ones past it (recomputing the cache), which
    the engine cannot do per sequence: it serves the positions up to there (max_model_len capped, with a warning saying
    why) and within them computes what transformers does, the rotary module's attention scaling (from the ratio of
    max_position_embeddings to original_max_position_embeddings, applied at every length) included."""
    g = torch.Generator().manual_seed(5)
    half = 8  # a factor for each pair of the 16 rotated dimensions (partial_rotary_factor 0.5 of head_dim 32)
    rope = {
        "rope_type": "longrope",
        "short_factor": (1 + 3 * torch.rand(half, generator=g)).tolist(),
        "long_factor": (8 + 24 * torch.rand(half, generator=g)).tolist(),
    }
    family = Family(
        "phi3",
        tmp_path / "longrope",
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling=rope,
    )
    config, rotary = family.model.config, family.model.model.rotary_emb
    assert rotary.rope_type == "longrope"
    assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(256 / 64) / math.log(64)))  # ~1.155
    assert position_limit(config)[0] == 64
    assert position_limit(AutoConfig.for_model("phi3", max_position_embeddings=4096)) == (4096, None)
    with caplog.at_level(logging.WARNING, logger="pylon.serving.model.runner"):
        engine = family.engine()
    assert engine.max_model_len == 64 and engine.runner.max_position_embeddings == 64
    assert "not its max_position_embeddings 256" in caplog.text and "LongRoPE" in caplog.text

    prompts = [p[:40] for p in PROMPTS]  # each continued to the last position served
    want = [family.hf_greedy(p, 64 - len(p)) for p in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=64 - len(p), temperature=0))
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(prompts))] == want
    assert_pool_empty(engine)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", PROMPTS[3], GREEDY)  # 90 tokens: past the positions served
    fixed = family.engine()  # and in fixed-shape decode steps (a GPU's CUDA graphs, whose warm-up rotates first)
    fixed_shape_decodes(fixed)
    params = [SamplingParams(max_tokens=64 - len(p), temperature=0) for p in prompts]
    assert [c.token_ids for c in fixed.generate(prompts, params)] == want
    assert fixed.runner.decode_graphs.replays > 0

    # The attention scaling and the short factors change transformers' continuations: an engine that left out the
    # one or used the long factors would not pass the parity above.
    scaling, rotary.attention_scaling = rotary.attention_scaling, 1.0
    unscaled = [family.hf_greedy(p, 64 - len(p)) for p in prompts]
    rotary.attention_scaling = scaling
    short = rotary.original_inv_freq.clone()
    rotary.original_inv_freq.copy_(ROPE_INIT_FUNCTIONS["longrope"](config, short.device, seq_len=65)[0])
    long = [family.hf_greedy(p, 64 - len(p)) for p in prompts]
    rotary.original_inv_freq.copy_(short)
    assert sum(a != b for a, b in zip(want, unscaled)) >= len(prompts) - 2
    assert sum(a != b for a, b in zip(want, long)) >= len(prompts) - 2


def test_int8_projections_compute_the_dequantized_model(family) -> None:
    engine = family.engine(quantization="int8")
    layer = next(layer for layer in engine.runner.model.model.layers if hasattr(layer, "self_attn"))
    attention = layer.self_attn
    if family.name == "phi3":  # its fused projections, quantized whole
        assert isinstance(attention.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    elif family.name in MOE_MODEL_TYPES:  # each expert's two weights, and the shared expert's projections
        layers = engine.runner.model.model.layers
        sparse = next(layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE))  # (GLM-4.5's layer 0 dense)
        assert all(isinstance(e, QuantLinear) for e in sparse.gate_up)
        assert all(isinstance(e, QuantLinear) for e in sparse.down) and sparse.router.dtype == torch.float32
        if family.name in ("qwen2_moe", "glm4_moe"):
            assert isinstance(sparse.shared.down_proj, QuantLinear)
    else:
        assert isinstance(attention.q_proj, QuantLinear)
    assert isinstance(attention.o_proj, QuantLinear)
    reference = _dequantized_copy(family.model)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=family.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    assert _greedy(engine) == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_a_lora_adapter_computes_what_peft_computes(family, tmp_path) -> None:
    adapter = str(tmp_path / "adapter")
    targets = FAMILY_PROJECTIONS.get(family.name, ALL_PROJECTIONS)
    peft_model = save_adapter(family.dir, adapter, seed=3, r=8, lora_alpha=16, target_modules=targets)
    want = [hf_greedy(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(a != b for a, b in zip(want, family.greedy)) >= len(PROMPTS) - 1  # the adapter changes the outputs
    engine = LLMEngine(family.dir, spec(adapters=[{"name": "tuned", "path": adapter}]))
    for i, p in enumerate(PROMPTS):  # base and adapted requests in the same steps
        engine.add_request(f"base-{i}", p, GREEDY)
        engine.add_request(f"tuned-{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="tuned"))
    outputs = run(engine)
    assert [tokens_of(outputs[f"tuned-{i}"]) for i in range(len(PROMPTS))] == want
    assert [tokens_of(outputs[f"base-{i}"]) for i in range(len(PROMPTS))] == family.greedy


# (a model with recurrent layers runs no fixed-shape decode steps: ModelRunner.use_decode_graphs)
@pytest.mark.parametrize("name", core_first([n for n in MOE_MODEL_TYPES if n not in LINEAR_ATTENTION_FAMILIES]))
def test_moe_experts_as_grouped_matmuls_give_transformers_tokens_in_fixed_shape_decode_steps(name, tmp_path) -> None:
    """The grouped path (moe.py: no value read back, so CUDA graphs capture it; a GPU's engine takes it by itself):
    transformers' greedy tokens through batching and fixed-shape decode steps. Forced here on a CPU, whose engine
    runs the experts' loop."""
    from pylon.serving.model import moe

    family = Family(name, tmp_path / name)
    engine = family.engine()
    runner = engine.runner
    blocks = [layer.mlp for layer in runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]
    if ON_CUDA:  # chosen at load where it agrees with the loop; decode steps then captured as graphs
        usable = moe.grouped_usable(runner.device, runner.dtype)
        assert runner.moe_grouped == usable and all(b.grouped == usable for b in blocks)
        if not usable:
            pytest.skip(f"torch's grouped matmul does not run on this GPU in {runner.dtype}: the experts' loop runs")
    else:
        assert not runner.moe_grouped and moe.grouped_usable(runner.device, runner.dtype)
        for block in blocks:
            block.grouped = True
    fixed_shape_decodes(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == family.greedy
    assert runner.decode_graphs.replays > 0


@pytest.mark.parametrize("variant", [{"q_lora_rank": None}, {"rope_interleave": False}])
def test_latent_attention_variants_are_transformers_own(variant, tmp_path) -> None:
    """DeepSeek-V3-shaped checkpoints without a query rank (Moonlight, DeepSeek-V2-Lite's layout: one q_proj) and
    with rotary pairs laid out as halves: greedy tokens through batching, chunks and the prefix cache."""
    family = Family("deepseek_v3", tmp_path / "model", **variant)
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = family.engine(**fields)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        outputs = run(engine)
        assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == family.greedy


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPT-OSS expert weight (`[experts, in, out]`) as its checkpoints store it in MXFP4: per expert and output row,
    blocks of 32 inputs, each a power-of-two scale (a byte, 127 for 2^0) and 32 FP4 values, two to a byte (low nibble
    first): `blocks` `[experts, out, in / 32, 16]` and `scales` `[experts, out, in / 32]`, both uint8; and the weight
    those decode to, as the model holds it."""
    rows = weight.transpose(1, 2).float()  # [experts, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    nearest = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)  # index into FP4
    blocks = nearest[..., 0::2] | (nearest[..., 1::2] << 4)
    decoded = (FP4[nearest.long()] * torch.exp2(exponent)[..., None]).reshape(rows.shape).transpose(1, 2)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8), decoded


def test_an_mxfp4_checkpoint_is_served_as_transformers_dequantizes_it(tmp_path) -> None:
    """gpt-oss-20b and -120b ship their experts in MXFP4 (quantization_config quant_method mxfp4: `*_blocks` and
    `*_scales` in place of the weights). Without transformers' MXFP4 kernels (Pylon's wheel set) transformers
    dequantizes them at load, and the engine serves what that model computes: its greedy tokens, token for token."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    family = Family("gpt_oss", tmp_path / "float")
    directory = tmp_path / "mxfp4"
    directory.mkdir()
    tensors, decoded = {}, {}
    for key, value in family.model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"], decoded[key] = _mxfp4(value.cpu())
        else:
            tensors[key] = value.detach().cpu().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "pylon_tokenizer.json"):
        (directory / name).write_text((tmp_path / "float" / name).read_text())
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval().to(DEVICE)
    experts = reference.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (4, 128, 128)
    # The format read as written: FP4 values times power-of-two scales, off the float weights they round.
    for key, value in decoded.items():
        assert torch.equal(reference.get_parameter(key).cpu(), value), key
        assert not torch.equal(value, family.model.get_parameter(key).cpu())
    want = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    assert want != family.greedy  # FP4's rounding shows: an engine serving the float weights could not pass
    engine = LLMEngine(str(directory), spec())
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    assert [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))] == want


def test_an_adapter_on_an_moe_models_experts_is_refused_naming_them(tmp_path) -> None:
    """The engine adapts an MoE model's attention only: an adapter that changes an expert (here Qwen2-MoE's shared
    expert) is refused at load, naming the module and what to do, not served as if the expert were not adapted."""
    family = Family("qwen2_moe", tmp_path / "base")
    adapter = str(tmp_path / "adapter")
    save_adapter(family.dir, adapter, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "shared_expert.up_proj"])
    with pytest.raises(PylonError) as e:
        LLMEngine(family.dir, spec(adapters=[{"name": "tuned", "path": adapter}]))
    assert "model.layers.0.mlp.shared_expert.up_proj" in str(e.value) and "self_attn.q_proj" in str(e.value)
    assert "merge" in str(e.value)


# Sliding windows narrower than the prompts and continuations (and than a block, or one block exactly), at every
# layer (Mistral, and Phi-3 as Phi-3-mini-4k's config sets one) or at the layers from max_window_layers on (Qwen2: layer 0 full, 1 and 2 windowed), or as Gemma 3's
# 270M checkpoint lays them out (its config's rule over 6 layers: 0-4 windowed, the last one full; the `family`
# fixture's Gemma 3 has 1B's layout, the last layer windowed).
WINDOWED = {
    "mistral": {"sliding_window": 13},
    "qwen2": {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 3},
    "gemma3_text": {"sliding_window": 16, "num_hidden_layers": 6},
    "gemma2": {"sliding_window": 13, "num_hidden_layers": 3},
    "phi3": {"sliding_window": 16},
    "starcoder2": {"sliding_window": 13},
    # its NoPE layers (1 and 3 of 4) windowed, as use_sliding_window makes them
    "smollm3": {"sliding_window": 13, "use_sliding_window": True, "num_hidden_layers": 4, "no_rope_layer_interval": 2},
    # every 4th layer full (and unrotated), as Command R7B's
    "cohere2": {
        "sliding_window": 13,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
    # Llama 4's chunks in its rotating layers (0-2; layer 3 NoPE and full), where a window would go
    "llama4_text": {"attention_chunk_size": 13},
}
_g = torch.Generator().manual_seed(2)


def _window_size(name: str) -> int:
    return WINDOWED[name].get("sliding_window") or WINDOWED[name]["attention_chunk_size"]


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
        if name == "llama4_text":  # chunks wider than every sequence
            config.attention_chunk_size = 1 << 20
        elif name in ("gemma3_text", "gemma2", "cohere2"):  # their models always mask by layer type (Gemma 3's choose
            # the rotary base too, Cohere 2's whether to rotate): the same types, a window wider than all
            config.sliding_window = 1 << 20
        else:
            config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
        full = type(self.model)(config).to(self.model.device).eval()
        full.load_state_dict(self.model.state_dict())
        self.unwindowed = [hf_greedy(full, p, WINDOW_NEW) for p in WINDOW_PROMPTS]


@pytest.fixture(scope="module", params=core_first(WINDOWED, core=("mistral", "qwen2")))  # (every layer; some)
def windowed(request, tmp_path_factory) -> Windowed:
    return Windowed(request.param, tmp_path_factory.mktemp(f"{request.param}-window"))


def test_layer_windows_are_the_ones_transformers_applies(windowed) -> None:
    model = windowed.model.model
    if windowed.name == "mistral":
        assert layer_windows(windowed.model.config) == [13, 13]
        assert model.config.sliding_window == 13 and model.layers[0].self_attn.config.sliding_window == 13
    elif windowed.name == "phi3":  # Phi3Model masks every layer by config.sliding_window (no layer_types)
        assert layer_windows(windowed.model.config) == [16, 16]
        assert getattr(model.config, "layer_types", None) is None and model.config.sliding_window == 16
    elif windowed.name == "gemma3_text":
        assert layer_windows(windowed.model.config) == [16] * 5 + [None]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [16] * 5 + [None]
    elif windowed.name == "starcoder2":  # Starcoder2Model masks every layer by config.sliding_window
        assert layer_windows(windowed.model.config) == [13, 13]
    elif windowed.name == "smollm3":
        assert layer_windows(windowed.model.config) == [None, 13, None, 13]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [None, 13, None, 13]
    elif windowed.name == "cohere2":
        assert layer_windows(windowed.model.config) == [13, 13, 13, None]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [13, 13, 13, None]
    elif windowed.name == "llama4_text":  # chunks, not windows, in its rotating layers
        windows = layer_windows(windowed.model.config)
        assert windows == [13, 13, 13, None] and all(isinstance(w, Chunk) for w in windows[:3])
        assert windowed.model.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    elif windowed.name == "gemma2":  # the last layer windowed: the sampling tokens' own attention is too
        assert layer_windows(windowed.model.config) == [13, None, 13]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [13, None, 13]
    else:
        assert layer_windows(windowed.model.config) == [None, 16, 16]
        assert [layer.self_attn.sliding_window for layer in model.layers] == [None, 16, 16]
    assert attention_window(windowed.model.config) == _window_size(windowed.name)
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
    # Gemma 3 1B's config as it ships: 26 layers, every 6th one full (sliding_window_pattern), a window of 512.
    gemma = AutoConfig.for_model("gemma3_text", num_hidden_layers=26, sliding_window=512, sliding_window_pattern=6)
    assert layer_windows(gemma) == [None if i % 6 == 5 else 512 for i in range(26)]


def test_a_window_in_every_layer_lets_go_of_the_blocks_before_it(windowed) -> None:
    """Where every layer attends within the window, a sequence holds its window's blocks only (the pool lets go of
    those before it, cached contents kept): four sequences of up to 240 tokens (960 in all) run at once, greedy as
    transformers, in a KV cache of 256 tokens, none preempted, none holding more than the window and a step's
    blocks. Where windowed layers mix with full ones, the KV cache is in groups of layers of one kind, each with its
    own table (HybridKVBlockPool): in the memory of three quarters of the four's tokens in every layer (one table for
    all would preempt), the same run, none preempted, each sequence holding its context's blocks in the full groups and
    its window's in the windowed ones."""
    prompts = [p for p in WINDOW_PROMPTS if len(p) <= 40][:4]
    want = [windowed.hf_greedy(p, 200, min_tokens=200) for p in prompts]
    every = windowed.name in ("mistral", "phi3", "starcoder2")
    # (mixed: three quarters of the four's tokens, in every layer's memory: one table for all would preempt)
    tokens = 256 if every else -(-sum(len(p) + len(g) for p, g in zip(prompts, want)) * 3 // 64) * 16
    engine = windowed.engine(kv_cache_tokens=tokens, max_num_seqs=4, enable_prefix_caching=True)
    window = _window_size(windowed.name)
    assert engine.scheduler.window == window
    groups = engine.runner.kv_groups
    assert bool(groups) == (not every) == isinstance(engine.pool, HybridKVBlockPool)
    if groups:  # the runner's tensors: one a place in a group, shared across the groups; the pool's blocks as many
        width = max(len(layers) for layers, _ in groups)
        layers = engine.runner.config.num_hidden_layers
        assert sorted(i for g, _ in groups for i in g) == list(range(layers))
        assert len({id(k) for k in engine.runner.k_cache}) == width
        assert engine.pool.num_blocks == tokens // engine.pool.block_size * layers // width
    params = SamplingParams(max_tokens=200, min_tokens=200, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs: dict[str, list] = {}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        most = max([most, *(engine.pool.held_blocks(str(i)) for i in range(len(prompts)))])
    got = [tokens_of(outputs[str(i)]) for i in range(len(prompts))]
    assert got == want
    assert sum(len(p) + len(g) for p, g in zip(prompts, got)) > tokens + (128 if every else 0)  # (past the cache)
    assert engine.scheduler.num_preemptions == 0
    bs = engine.pool.block_size
    in_window = -(-(window + 40) // bs) + 1  # (a 40-token prompt's first step)
    whole = -(-(max(len(p) for p in prompts) + 200) // bs)
    bound = sum(in_window if w is not None else whole for _, w in groups) if groups else in_window
    assert most <= bound, (most, bound)
    if groups:  # (and fewer than every group's whole context)
        assert most < len(groups) * whole
    assert_pool_empty(engine)


def test_a_sliding_window_is_transformers_own_through_batching_chunks_and_the_prefix_cache(windowed) -> None:
    """Prompts and continuations well past the window, all in one batch of different lengths: decodes in padded
    groups, prompts in one chunk each (the first chunk masked by the window in place of `is_causal`), then split across
    steps (max_num_batched_tokens 32), then again from the prefix cache, and a prompt that shares a cached prefix."""
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = windowed.engine(**fields)
        assert engine.max_model_len == 256  # the spec's, and the model's positions: the window does not cap it
        runner = engine.runner
        if windowed.name in ("mistral", "phi3", "starcoder2"):  # one metadata, windowed, for every layer
            assert (runner.step_window, runner.mixed_window) == (WINDOWED[windowed.name]["sliding_window"], None)
        else:  # a second one for the windowed layers; the KV cache in groups, each group's metadata its own
            assert (runner.step_window, runner.mixed_window) == (None, _window_size(windowed.name))
            assert runner.kv_groups and isinstance(engine.pool, HybridKVBlockPool)
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
    engine = windowed.engine()
    runner = engine.runner
    assert bool(runner.kv_groups) == (windowed.name not in ("mistral", "phi3", "starcoder2"))  # (each group's table)
    fixed_shape_decodes(engine)
    got = [c.token_ids for c in engine.generate(WINDOW_PROMPTS, WINDOW_GREEDY)]
    assert got == windowed.window_greedy
    assert runner.decode_graphs.replays >= WINDOW_NEW - 1
    assert_pool_empty(engine)
