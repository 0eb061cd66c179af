"""Tensor-parallel shards of a model: each process holds a slice of every decoder layer (Megatron-LM's split, vLLM's
`tensor_parallel_size`), so that a model larger than one GPU's memory is served by the GPUs of one node together.

Shard `rank` of `count` holds, in each layer, the query, key and value projections of heads `rank * heads / count`
... (whole heads, and their KV cache), and the same slice of the MLP's gate and up projections' outputs (column
parallel); the attention's output projection and the MLP's down projection take the matching slice of their inputs
(row parallel), so each shard's output is a partial sum, made whole by an all-reduce across the shards (two a
layer, `[tokens, hidden]` each). The norms are every shard's; the embeddings and the lm_head are split by vocabulary
rows (`vocab_parallel`: one more all-reduce a step, and the sampled rows' logits gathered).

A shard is a model of its own: the family's class built from the config with `count` times fewer heads and MLP
width (`local_config`), so that everything downstream (the runner's KV cache, its attention, packing, quantization)
sees an ordinary, smaller model; its weights are the checkpoint's slices, each read from the safetensors files by
slice (`get_slice`: a shard never reads the other shards' slices). The families split are the Llama-like ones
(`refused`); a fused projection (Phi-3's `qkv_proj`, Phi-3's and GLM-4's `gate_up_proj`) is split part by part, the
shard's rows of each part read and joined (`fused_rows`).

Where the shards outnumber the key-value heads (Qwen3-30B-A3B's 4 in 8 shards), each shard holds the one head its
query heads attend with, the heads replicated (`kv_replicas`: vLLM's way), so each shard still computes its heads'
attention whole.

DeepSeek's latent attention (DeepSeek-V2 and V3, Kimi K2) splits by heads too: a shard holds its heads' rows of the
query projection (`q_proj`, or `q_b_proj` after the whole low-rank `q_a_proj`) and of `kv_b_proj` (each head's key and
value expansion of the latent), and the matching columns of `o_proj`; the latent's own projection (`kv_a_proj_with_mqa`)
and norms are whole, so every shard caches each token's whole latent, as vLLM's MLA does under tensor parallelism (a
576-number latent a token and layer: nothing to gain by splitting it).

OLMo 2 and 3, OLMoE and FlexOlmo normalise all the heads' queries (and keys) at once (one RMSNorm over the whole
projection's output, not per head): a shard's norm sums its heads' squares and all-reduces them (one more small
all-reduce, `[tokens, 1]`, per norm), each key head held by several shards counted once, then scales its slice by its
slice of the weight (`spanning_norms`).

Qwen3-Next's and Qwen3.5's recurrent layers split by heads too (RECURRENT_SPLIT_FAMILIES): each shard computes its
key heads and their value heads, keeping their recurrent state (the engine's runner, pylon.serving.engine.tensor, has
every shard keep and let go of each sequence's states alike). Multimodal checkpoints (SPLIT_MULTIMODAL) are split for
their text: a shard reads its language model's tensors under their prefix, never the vision model's.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, dots.llm1, ERNIE 4.5 MoE, GPT-OSS, OLMoE,
FlexOlmo, DeepSeek; vLLM's default for them under tensor parallelism) split every expert as the dense MLP is split:
each shard holds the same slice of every expert's gate, up and down projections (and of the shared experts'), the
router whole, so that every shard routes every token alike and its experts' weighted outputs, summed, are a partial
sum of the block's: one all-reduce per MoE block, as per dense MLP. The checkpoint's experts are separate tensors
(`experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`), or fused as transformers holds
them (`experts.gate_up_proj`); a shard reads its slice of each and fuses them as transformers' loader does
(`_expert_reads`). GPT-OSS's experts are stored `[in, out]`, gate and up interleaved column by column, with biases: a
shard takes a block of column pairs, and the down projection's biases are added by the first shard alone.

A block-quantized FP8 checkpoint (quant_method fp8 with a `weight_block_size`: DeepSeek-V3's, Kimi K2's, Qwen3's and
GLM-4.5's "-FP8" releases), and one in compressed-tensors' layouts (FP8, INT8, packed INT4: the "-FP8-dynamic",
"-W8A8", "-W4A16" releases), and GPTQ's and AWQ's (the "-GPTQ-Int4", "-GPTQ-Int8", "-AWQ" releases), is read by
slice too, dequantized (pylon.serving.model.stored); the runner reads a whole model's, and a pipeline stage's, the
same way (as one shard of one). Other quantized checkpoints (GPT-OSS's MXFP4 as published, Marlin's, AWQ's GEMV) are
not read by slice: refused by name (`refused`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pylon.errors import PylonError
from pylon.serving.model.stored import checkpoint_quantization, open_stored, stored_name, unreadable

# The families split by heads and MLP width: q/k/v/o and gate/up/down projections (StarCoder2's c_fc and c_proj;
# Cohere's attention and MLP side by side), per-head (or no) query and key norms, or OLMo's over all heads at once
# (SPANNING_NORM_FAMILIES: their squares summed across the shards, `spanning_norms`), DeepSeek's latent attention
# (LATENT_SPLIT_FAMILIES), no recurrent layers; experts split by their width (MOE_SPLIT_FAMILIES: routers over the
# whole hidden state, gate and up as halves of one fused weight or interleaved); GPT-OSS's attention sinks follow their
# heads.
FUSED_SPLIT_FAMILIES = ("phi3", "glm4")  # qkv_proj and gate_up_proj, or gate_up_proj: each part split (`fused_rows`)
MOE_SPLIT_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "dots1",
    "ernie4_5_moe",
    "gpt_oss",
    "olmoe",
    "flex_olmo",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_moe_text",
)
# Qwen3-Next's and Qwen3.5's recurrent (Gated DeltaNet) layers, split by key heads and their value heads: their input
# projections' rows (Qwen3-Next's grouped by key head; Qwen3.5's queries, keys and values apart, `fused_rows`), the
# convolution's channels of the shard's queries, keys and values (`fused_rows`), their gates' and decays' heads, and
# the output projection's columns (row parallel); each shard keeps its heads' recurrent states.
RECURRENT_SPLIT_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# OLMo's query and key norms: one RMSNorm over all the heads' queries (keys) at once, not per head
SPANNING_NORM_FAMILIES = ("olmo2", "olmo3", "olmoe", "flex_olmo")
# DeepSeek's latent attention (MLA): the query and kv_b projections split by heads, the latent's projections whole (its
# cache, one latent a token, every shard's: vLLM's way); their MoE blocks as GLM-4.5's
LATENT_SPLIT_FAMILIES = ("deepseek_v2", "deepseek_v3")
# experts stored [in, out]: GPT-OSS's gate and up interleaved, with biases; Llama 4's gate, then up (`_expert_reads`)
IN_OUT_EXPERTS = {"gpt_oss": "interleaved", "llama4_text": "halves"}
# multimodal checkpoints whose language model is split, served for their text (no images: their vision model is never
# read): Llama 4's (a whole causal LM under `language_model.`), Gemma 3's, Mistral 3's, Qwen3.5's
SPLIT_MULTIMODAL = ("llama4", "gemma3", "mistral3", "qwen3_5", "qwen3_5_moe")
_LANGUAGE_MODEL_PREFIXES = (("language_model.", ""), ("model.language_model.", "model."), ("lm_head.", "lm_head."))


def language_model_tensor(name: str) -> bool:
    """Whether a multimodal checkpoint's tensor (by name) is its language model's (`_LANGUAGE_MODEL_PREFIXES`)."""
    return name.startswith(tuple(prefix for prefix, _ in _LANGUAGE_MODEL_PREFIXES))


SPLIT_FAMILIES = (
    "llama",
    "mistral",
    "ministral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "smollm3",
    "helium",
    "exaone4",
    "seed_oss",
    "arcee",
    "apertus",
    "hunyuan_v1_dense",
    "ernie4_5",
    "ministral3",
    "cohere",
    "cohere2",
    "starcoder2",
    "olmo2",
    "olmo3",
    "qwen3_5_text",
    *FUSED_SPLIT_FAMILIES,
    *MOE_SPLIT_FAMILIES,
    *LATENT_SPLIT_FAMILIES,
)
# The MLP widths a shard holds 1/count of: the dense MLP's (and Mixtral's experts'), Qwen MoE's experts' and their
# shared expert's.
_WIDTHS = (
    ("intermediate_size", "MLP width"),
    ("moe_intermediate_size", "experts' width"),
    ("shared_expert_intermediate_size", "shared expert's width"),
    ("intermediate_size_mlp", "dense MLP width"),  # (Llama 4's dense layers; its experts' is intermediate_size)
)
# Expert parallelism (`Shard.experts`, vLLM's --enable-expert-parallel): the experts stay whole while the dense MLPs
# and shared experts are sliced (the shared experts of GLM-4.5, dots.llm1, ERNIE 4.5 and DeepSeek, as wide as the
# experts' width times their count, rebuilt narrower: `_sliced_shared_experts`).
EXPERT_PARALLEL_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "glm4_moe",
    "dots1",
    "ernie4_5_moe",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "flex_olmo",
)
_SHARED_COUNTS = ("n_shared_experts", "moe_num_shared_experts")  # shared experts `moe_intermediate_size` wide each
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # the config's number of routed experts
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")  # their rows split (`vocab_parallel`)
# their inputs sliced: partial sums, reduced across the shards (a recurrent layer's out_proj too)
ROW_PARALLEL = ("o_proj", "down_proj", "c_proj", "out_proj")
# their heads split, or one each shard where the shards outnumber them (Cohere's key norms: a weight per head)
KEY_VALUE = ("k_proj", "v_proj", "k_norm")


@dataclass(frozen=True)
class Shard:
    """Shard `rank` of `count`; `experts`: an MoE model's experts divided among the shards whole (expert
    parallelism, `EXPERT_PARALLEL_FAMILIES`) rather than each expert sliced."""

    rank: int
    count: int
    experts: bool = False

    def describe(self) -> str:
        return f"tensor-parallel shard {self.rank + 1} of {self.count}" if self.count > 1 else "its weights"


def _heads(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def num_experts(config) -> int:
    """The routed experts of `config`'s MoE blocks (0: none)."""
    return next((getattr(config, n) for n in _EXPERT_COUNTS if getattr(config, n, None)), 0)


def _experts_width(config) -> str:
    """The config field that gives an expert's width: Mixtral's and GPT-OSS's experts are `intermediate_size` wide."""
    return "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) else "intermediate_size"


def refused(model_type: str, config, count: int, experts: bool = False) -> str | None:
    """Why `config`'s model cannot be split into `count` tensor-parallel shards (None: it can); `experts`: its experts
    divided among them whole (expert parallelism)."""
    if experts and model_type not in EXPERT_PARALLEL_FAMILIES:
        return (
            f"expert parallelism (engine.expert_parallel) divides the experts of {', '.join(EXPERT_PARALLEL_FAMILIES)} "
            f"models, not {model_type}'s: leave it off, each expert is then sliced across the shards"
        )
    if experts and num_experts(config) % count:
        return (
            f"its {num_experts(config)} experts do not divide among {count} shards (use a count that divides them, or "
            "leave engine.expert_parallel off)"
        )
    if model_type not in SPLIT_FAMILIES:
        return (
            f"the {model_type} family is not split for tensor parallelism (the families split: "
            f"{', '.join(SPLIT_FAMILIES)})"
        )
    why = unreadable(config)
    if why is not None:
        return (
            f"{why}, and a shard reads float weights, block FP8, compressed-tensors', GPTQ's and AWQ's by slice: "
            "save the model dequantized (transformers' from_pretrained, then save_pretrained), and use "
            "engine.quantization to serve smaller weights"
        )
    heads, kv_heads, _ = _heads(config)
    if model_type in LATENT_SPLIT_FAMILIES:  # (one latent a token, every shard's: no key-value heads to split)
        kv_heads = count
    if heads % count == 0 and count > kv_heads and count % kv_heads:
        return (
            f"its {kv_heads} key-value heads neither split into {count} equal shards nor are held by {count} shards "
            f"alike (use a count that divides them, or a multiple of them)"
        )
    whole = _experts_width(config) if experts else None  # (expert parallelism: the experts' width is not split)
    widths = [(what, getattr(config, name)) for name, what in _WIDTHS if getattr(config, name, None) and name != whole]
    shared = next((getattr(config, n) for n in _SHARED_COUNTS if getattr(config, n, None)), 0)
    if whole == "moe_intermediate_size" and shared:  # (its shared experts, still sliced)
        widths.append(("shared experts' width", config.moe_intermediate_size * shared))
    kv = [] if count > kv_heads else [("key-value heads", kv_heads)]
    if model_type in RECURRENT_SPLIT_FAMILIES and getattr(config, "linear_num_key_heads", None):  # (their heads)
        kv.append(("recurrent layers' key heads", config.linear_num_key_heads))
        kv.append(("recurrent layers' value heads", config.linear_num_value_heads))
    for what, n in (("attention heads", heads), *kv, *widths):
        if n % count:
            return f"its {n} {what} do not split into {count} equal shards (use a count that divides them)"
    return None


def kv_replicas(config, count: int) -> int:
    """How many of `count` shards hold each key-value head: 1 where the shards split them, else `count` over their
    number (each shard one head, its query heads' group's: vLLM's replication past their count)."""
    kv_heads = _heads(config)[1]
    return count // kv_heads if count > kv_heads else 1


def local_config(config, count: int, experts: bool = False):
    """`config` with `count` times fewer attention heads, key-value heads (one where there are fewer than `count`) and
    MLP width (the experts' too; the head size kept): the config of one shard's model. `experts`: count times fewer
    experts instead, each as wide as the model's (expert parallelism)."""
    heads, kv_heads, head_dim = _heads(config)
    local = copy.deepcopy(config)
    local.head_dim = head_dim
    local.num_attention_heads = heads // count
    local.num_key_value_heads = max(1, kv_heads // count)  # (past their count: one, replicated; `kv_replicas`)
    whole = _experts_width(config) if experts else None
    for name, _ in _WIDTHS:
        if getattr(config, name, None) and name != whole:
            setattr(local, name, getattr(config, name) // count)
    if experts:  # each shard a count-th of the experts, whole
        for name in _EXPERT_COUNTS:
            if getattr(config, name, None):
                setattr(local, name, getattr(config, name) // count)
    for name in ("linear_num_key_heads", "linear_num_value_heads"):  # (a recurrent layer's heads, split alike)
        if getattr(config, name, None):
            setattr(local, name, getattr(config, name) // count)
    local.vocab_size = vocab_rows(config.vocab_size, count)  # (its embeddings' and lm_head's rows: `vocab_parallel`)
    if getattr(local, "quantization_config", None) is not None:  # (a quantized checkpoint's: read dequantized)
        del local.quantization_config
    local.pad_token_id = None  # (an embedding's padding_idx, for training only, may be another shard's row)
    return local


def vocab_rows(vocab: int, count: int) -> int:
    """The embedding and lm_head rows each of `count` shards holds: a count-th of the vocabulary, rounded up (the last
    shard's rows past the vocabulary are zeros, their logits dropped)."""
    return -(-vocab // count)


def _weight_files(model_dir: str) -> dict[str, str]:
    """Each tensor of the checkpoint in `model_dir`: the safetensors file holding it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.exists(single):
        raise PylonError(
            f"model {model_dir}: engine.tensor_parallel reads safetensors checkpoints (model.safetensors, or shards "
            "with model.safetensors.index.json); save the model with safe_serialization"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def fused_rows(config, shard: Shard) -> dict[str, list[slice]]:
    """The output rows of each fused projection (Phi-3's `qkv_proj`: queries, keys, values; Phi-3's and GLM-4's
    `gate_up_proj`: gate, up; a recurrent layer's convolution channels and Qwen3.5's `in_proj_qkv`: queries, keys,
    values of all its heads) that shard `shard` holds: its slice of each part, in order."""
    heads, kv_heads, d = _heads(config)
    r, n = shard.rank, shard.count
    q = heads // n * d
    kv = max(1, kv_heads // n) * d
    kv_index = r // kv_replicas(config, n)
    width = (getattr(config, "intermediate_size", None) or 0) // n
    recurrent = {}
    if getattr(config, "linear_num_key_heads", None):  # Qwen3-Next's, Qwen3.5's recurrent layers
        keys = config.linear_num_key_heads * config.linear_key_head_dim
        values = config.linear_num_value_heads * config.linear_value_head_dim
        k, v = keys // n, values // n
        parts = [slice(r * k, (r + 1) * k), slice(keys + r * k, keys + (r + 1) * k)]
        recurrent = dict.fromkeys(("conv1d", "in_proj_qkv"), [*parts, slice(2 * keys + r * v, 2 * keys + (r + 1) * v)])
    return recurrent | {
        "qkv_proj": [
            slice(r * q, (r + 1) * q),
            slice(heads * d + kv_index * kv, heads * d + (kv_index + 1) * kv),
            slice((heads + kv_heads) * d + kv_index * kv, (heads + kv_heads) * d + (kv_index + 1) * kv),
        ],
        "gate_up_proj": [
            slice(r * width, (r + 1) * width),
            slice(config.intermediate_size + r * width, config.intermediate_size + (r + 1) * width),
        ],
    }


def _slicer(
    name: str, local: torch.Size, full: list[int], shard: Shard, fused: dict[str, list[slice]] | None = None
) -> Callable | None:
    """How shard `shard` takes tensor `name` (local shape `local`, the checkpoint's `full`) from its slice view:
    whole, rows, columns, or the rows of each part of a fused projection (`fused`, `fused_rows`'s; None: not at all:
    a row-parallel projection's bias, on shards but the first)."""
    r, n = shard.rank, shard.count
    rows = (fused or {}).get(name.rsplit(".", 2)[-2])
    if rows is not None and len(full) in (1, 2, 3) and sum(p.stop - p.start for p in rows) == local[0]:
        if rows[-1].stop > full[0]:
            raise PylonError(f"{name}: the checkpoint's shape {full} does not hold the model config's parts")
        return lambda s: torch.cat([s[p] for p in rows])
    if list(local) == list(full):
        row_bias = name.endswith(".bias") and name.rsplit(".", 2)[-2] in ROW_PARALLEL
        if (row_bias or name.endswith(".experts.down_proj_bias")) and r:
            return None  # (added once: by the first shard, to the partial sums)
        return lambda s: s[:]
    if len(full) >= 1 and local[0] * n == full[0] and list(local[1:]) == list(full[1:]):
        size = local[0]
        return lambda s: s[r * size : (r + 1) * size]
    if len(full) == 2 and local[1] * n == full[1] and local[0] == full[0]:
        size = local[1]
        return lambda s: s[:, r * size : (r + 1) * size]
    if name in VOCAB_PARALLEL and len(full) == 2 and local[0] * n >= full[0] > local[0] * (n - 1):
        size = local[0]  # (a count-th of the vocabulary rounded up: the last shard's rows past it zeros)
        start, stop = min(r * size, full[0]), min((r + 1) * size, full[0])
        return lambda s: torch.nn.functional.pad(s[start:stop], (0, 0, 0, size - (stop - start)))
    groups = full[0] // local[0] if full and local[0] else 0
    if name.rsplit(".", 2)[-2] in KEY_VALUE and groups and full[0] % local[0] == 0 and n % groups == 0:
        # fewer key-value heads than shards: each shard the head of its query heads' group (`kv_replicas`)
        size, head = local[0], r // (n // groups)
        return lambda s: s[head * size : (head + 1) * size]
    raise PylonError(f"{name}: the shard's shape {list(local)} is no slice of the checkpoint's {full}")


# How checkpoints hold an expert's projections, which transformers holds fused (`experts.gate_up_proj`, `[experts,
# 2 x width, hidden]`, and `experts.down_proj`, `[experts, hidden, width]`): each expert's apart, Qwen's names or
# Mixtral's.
_EXPERT_PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


# The checkpoints' names for what transformers renames at load: Mixtral's MoE block (`block_sparse_moe`, transformers'
# `mlp`), ERNIE 4.5's router correction (beside the router, transformers' within it).
_RENAMED = ((r"\.mlp(\.|$)", r".block_sparse_moe\1"), (r"\.mlp\.gate\.moe_statics\.", ".mlp.moe_statics."))


def _names(key: str) -> list[str]:
    """`key`, then the names a checkpoint may give it (`_RENAMED`)."""
    return [key, *(re.sub(pattern, name, key) for pattern, name in _RENAMED if re.search(pattern, key))]


def _sources(key: str, files: dict[str, str], experts: int) -> list[str] | None:
    """The checkpoint's tensors that the model's tensor `key` is read from: itself (or its name in the checkpoint), or,
    for fused expert weights, each expert's in order (gate and up alternating); None where they are not all there."""
    for name in _names(key):
        if stored_name(name, files) is not None:  # (or its packed ints: pylon.serving.model.stored)
            return [stored_name(name, files)]
    head, _, part = key.rpartition(".experts.")
    for prefix in _names(head) if head and part in _EXPERT_PARTS else ():
        for names in _EXPERT_PARTS[part]:
            sources = [
                stored_name(f"{prefix}.experts.{e}.{name}.weight", files) for e in range(experts) for name in names
            ]
            if all(sources):
                return sources
    return None


def _expert_reads(
    key: str, local: torch.Tensor, sources: list[str], view: Callable, shard: Shard, in_out: str | None = None
) -> None:
    """Shard `shard`'s part of every expert's fused weight `key` (`local`, the shard's) read into it: each expert's
    gate and up rows `rank * width ...` (the shard's `width`), or its down projection's columns, from the fused
    checkpoint tensor or each expert's; with expert parallelism (`shard.experts`), its experts `rank * n ...` whole.
    `in_out`: stored `[experts, in, out]`, gate and up `interleaved` column by column (GPT-OSS's: the shard's `2 x
    width` columns of gate_up, pairs of gate and up) or as `halves` (Llama 4's: its `width` columns of each), and its
    `width` rows of down."""
    experts = local.shape[0]
    # expert parallelism: the shard's experts from `first`, whole (as one shard of one); else every expert, sliced
    first, total = (shard.rank * experts, experts * shard.count) if shard.experts else (0, experts)
    r, count = (0, 1) if shard.experts else (shard.rank, shard.count)
    held = slice(first, first + experts)
    down = key.endswith("down_proj")

    def checked(source: str, want: list[int]):
        v = view(source)
        if list(v.get_shape()) != want:
            got = list(v.get_shape())
            raise PylonError(f"{source}: its shape {got} is not the {want} that {key} of the model's config holds")
        return v

    if in_out:
        width = local.shape[1] if down else local.shape[2] // 2
        hidden, full = local.shape[2] if down else local.shape[1], width * count
        v = checked(sources[0], [total, full, hidden] if down else [total, hidden, 2 * full])
        if down:
            local.copy_(v[held, r * width : (r + 1) * width])
        elif in_out == "interleaved":
            local.copy_(v[held, :, 2 * r * width : 2 * (r + 1) * width])
        else:
            local[:, :, :width].copy_(v[held, :, r * width : (r + 1) * width])
            local[:, :, width:].copy_(v[held, :, full + r * width : full + (r + 1) * width])
        return
    width = local.shape[2] if down else local.shape[1] // 2
    part = slice(r * width, (r + 1) * width)
    hidden = local.shape[1] if down else local.shape[2]
    full = width * count
    if len(sources) == 1:  # fused as transformers holds them
        if down:
            local.copy_(checked(sources[0], [total, hidden, full])[held, :, part])
        else:
            v = checked(sources[0], [total, 2 * full, hidden])
            local[:, :width].copy_(v[held, part])
            local[:, width:].copy_(v[held, full + r * width : full + (r + 1) * width])
        return
    for e in range(experts):
        if down:
            local[e].copy_(checked(sources[first + e], [hidden, full])[:, part])
        else:
            for half, source in enumerate(sources[2 * (first + e) : 2 * (first + e) + 2]):
                local[e, half * width : (half + 1) * width].copy_(checked(source, [full, hidden])[part])


def _whole_routers(model: torch.nn.Module, experts: int) -> None:
    """Each MoE block's router of `model` (a shard's, built with a count-th of the experts) made to route over all
    `experts` (its weight, bias and correction bias, DeepSeek's a buffer, ERNIE's `[1, experts]` in a module of its
    own; uninitialised: read from the checkpoint whole), as expert parallelism needs."""
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        router = getattr(mlp, "router", None) or getattr(mlp, "gate", None)
        if router is None or not hasattr(mlp, "experts"):
            continue
        for path, t in [*router.named_parameters(), *router.named_buffers()]:
            owner_path, _, name = path.rpartition(".")
            owner = router.get_submodule(owner_path)
            dim = t.dim() - 1 if name == "e_score_correction_bias" else 0
            whole = t.new_empty((*t.shape[:dim], experts, *t.shape[dim + 1 :]))
            if isinstance(t, torch.nn.Parameter):
                setattr(owner, name, torch.nn.Parameter(whole, requires_grad=False))
            else:
                owner.register_buffer(name, whole)


def _local_norms(model: torch.nn.Module, local) -> None:
    """OLMo's query and key norms of `model` (a shard's, of config `local`) as wide as the shard's heads: OLMoE builds
    them from the hidden size (its query norm) and the whole heads' size, which a shard does not split."""
    heads, kv_heads, d = _heads(local)
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        for name, width in (("q_norm", heads * d), ("k_norm", kv_heads * d)) if attn is not None else ():
            norm = getattr(attn, name)
            if norm.weight.numel() != width:
                setattr(attn, name, type(norm)(width, eps=norm.variance_epsilon).to(norm.weight.dtype))


def _sliced_shared_experts(model: torch.nn.Module, config, count: int) -> None:
    """Expert parallelism: each MoE block's shared experts (GLM-4.5's, dots.llm1's, ERNIE 4.5's, DeepSeek's: built
    `moe_intermediate_size` times their count wide, a width the routed experts keep whole) rebuilt a count-th as wide
    (uninitialised: read as slices), as the dense MLPs are sliced."""
    from transformers.initialization import no_init_weights

    dtype = model.dtype
    for layer in model.model.layers:
        shared = getattr(getattr(layer, "mlp", None), "shared_experts", None)
        if shared is None:
            continue
        with no_init_weights():
            layer.mlp.shared_experts = type(shared)(config, intermediate_size=shared.down_proj.in_features // count)
        layer.mlp.shared_experts.to(dtype)


def load_shard(
    model_dir: str,
    config,
    dtype: torch.dtype,
    shard: Shard,
    cls: type | None = None,
    head: bool = True,
    names: Callable[[dict[str, str]], dict[str, str]] | None = None,
    skip: frozenset[str] = frozenset(),
) -> torch.nn.Module:
    """Shard `shard`'s causal LM of `model_dir` (its config `config`), in `dtype` on the CPU: the family's class
    (or `cls`: a pipeline stage's, pylon.serving.model.stages) built from `local_config` (no initialisation), each
    tensor read as the shard's slice of the checkpoint's (an MoE model's experts fused from each expert's, as
    transformers' loader fuses them; a quantized checkpoint's weights dequantized, pylon.serving.model.stored).
    `head` False: the checkpoint has no lm_head (a classifier's: its head is `whole_tensors`' `score`), which is
    left unread (zeros). `names`: the model's tensor names of the checkpoint's (given its `_weight_files`), where they
    are not the model's own (a multi-token-prediction layer's: pylon.serving.model.mtp); `skip`: the model's tensors
    left unread (their modules replaced by the caller)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.models.auto.auto_factory import _get_model_class

    local = local_config(config, shard.count, shard.experts)
    cls = cls or _get_model_class(local, AutoModelForCausalLM._model_mapping)
    with no_init_weights():
        model = cls._from_config(local, dtype=dtype)
    # what the runner samples over (its rows are `vocab_parallel`'s), and the model's pad id
    model.config.vocab_size, model.config.pad_token_id = config.vocab_size, getattr(config, "pad_token_id", None)
    if config.model_type in SPANNING_NORM_FAMILIES:
        _local_norms(model, local)
    if shard.experts:
        _whole_routers(model, num_experts(config))
        if any(getattr(config, n, None) for n in _SHARED_COUNTS):
            _sliced_shared_experts(model, local, shard.count)
    files = _weight_files(model_dir)
    # a multimodal checkpoint's language model (SPLIT_MULTIMODAL): its tensors under `language_model.` (Llama 4's) or
    # `model.language_model.` (Gemma 3's, Mistral 3's, Qwen3.5's), its lm_head beside them; the vision model's never
    # read
    named: dict[str, str] = {}
    if names is not None:
        named = names(files)
        files = {short: files[name] for short, name in named.items()}
    elif not any(k.startswith("model.layers.") for k in files):
        for name in files:
            for prefix, short in _LANGUAGE_MODEL_PREFIXES:
                if name.startswith(prefix):
                    named[short + name.removeprefix(prefix)] = name
        files = {short: files[name] for short, name in named.items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    experts = num_experts(config)
    unread = "lm_head.weight" if tied or not head else None
    sources = {k: _sources(k, files, experts) for k in state if k != unread and k not in skip}
    missing = [k for k, found in sources.items() if found is None]
    if missing:
        raise PylonError(
            f"model {model_dir}: {shard.describe()}: {len(missing)} of its tensors are not in the checkpoint under "
            f"the model's names ({', '.join(missing[:3])}): a checkpoint whose weights transformers converts at load "
            "(other than fusing experts, or dequantizing a quantized one) is not split for tensor parallelism"
        )
    fused = fused_rows(config, shard)
    stored = checkpoint_quantization(config)
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened: dict[str, object] = {}

        def checkpoint(source: str):
            path = files[source]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            return opened[path]

        def view(source: str):  # (a quantized weight: read dequantized, pylon.serving.model.stored)
            read = lambda other: checkpoint(other).get_tensor(named.get(other, other))  # noqa: E731
            return open_stored(source, checkpoint(source).get_slice(named.get(source, source)), read, stored, files)

        for key, found in sources.items():
            if key.rpartition(".experts.")[2] in _EXPERT_PARTS and state[key].dim() == 3:
                _expert_reads(key, state[key], found, view, shard, in_out=IN_OUT_EXPERTS.get(config.model_type))
                continue
            v = view(found[0])
            take = _slicer(key, state[key].shape, v.get_shape(), shard, fused)
            if take is None:
                state[key].zero_()
            else:
                state[key].copy_(take(v))
    if tied and "model.embed_tokens.weight" in state:  # (a pipeline stage past the first holds neither)
        model.tie_weights()
    elif not head and "lm_head.weight" in state:
        state["lm_head.weight"].zero_()
    # the buffers computed at construction (the rotary embedding's frequencies), as the whole model's
    return model.eval()


def whole_tensors(model_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors every shard holds whole, read from the checkpoint by name (a classifier's head, `score.*`); a name the
    checkpoint does not hold is left out."""
    from safetensors import safe_open

    files = _weight_files(model_dir)
    found = {}
    for name in names:
        if name in files:
            with safe_open(files[name], framework="pt") as f:
                found[name] = f.get_tensor(name)
    return found


def vocabulary_rows(model_dir: str, config, ids: list[int]) -> torch.Tensor:
    """The lm_head's rows of `ids` (the embeddings' where they are tied), whole, read from the checkpoint: what
    engine.classifier_from_token makes its head of, whichever shard holds the rows."""
    from safetensors import safe_open

    files = _weight_files(model_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    name = "model.embed_tokens.weight" if tied or "lm_head.weight" not in files else "lm_head.weight"
    if name not in files:
        raise PylonError(
            f"model {model_dir}: no {name} in the checkpoint, whose rows engine.classifier_from_token reads"
        )
    with safe_open(files[name], framework="pt") as f:
        rows = f.get_slice(name)
        return torch.cat([rows[i : i + 1] for i in ids])


def adapter_split(config, shard: Shard, shapes: dict[str, tuple[int, int]]) -> Callable:
    """`lora.load_adapter`'s `split` for shard `shard` of `config`'s model (`shapes`: the shard's projections' `(in,
    out)`, `lora.projection_shapes`): a column-parallel projection's B `[out, r]` as its weight's rows (its heads, its
    MLP slice, each part of a fused one's), A whole; a row-parallel one's A `[r, in]` as its weight's columns, B whole
    (the shard's x @ A^T a partial sum: `lora.Rows.add` reduces it)."""
    fused = fused_rows(config, shard)

    def split(module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_in, n_out = shapes[module]
        name = f"{module}.weight"
        if module.rsplit(".", 1)[-1] in ROW_PARALLEL:
            return _slicer(name, torch.Size((a.shape[0], n_in)), list(a.shape), shard)(a), b
        return a, _slicer(name, torch.Size((n_out, b.shape[1])), list(b.shape), shard, fused)(b)

    return split


def whole_shapes(config, model_type: str) -> dict[str, tuple[int, int]]:
    """The whole model's projection shapes (`lora.projection_shapes`), from its class built on the meta device (no
    memory): what a shard checks an adapter against."""
    from transformers import AutoModelForCausalLM

    from pylon.serving.model.lora import projection_shapes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return projection_shapes(model, model_type)


def row_parallel_paths(paths) -> frozenset[str]:
    """Those of `paths` (projections' paths under a decoder layer) whose inputs a shard holds a slice of."""
    return frozenset(p for p in paths if p.rsplit(".", 1)[-1] in ROW_PARALLEL)


class _VocabEmbedding(torch.nn.Module):
    """A shard's rows `start ...` of the embeddings (`inner`, the family's module: Gemma's scaling kept): each id's
    row from the shard holding it, zeros from the others, summed across the shards."""

    def __init__(self, inner: torch.nn.Module, start: int, rows: int):
        super().__init__()
        self.inner, self.start, self.rows = inner, start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = ids - self.start
        held = (local >= 0) & (local < self.rows)
        out = self.inner(local.clamp(0, self.rows - 1)) * held.unsqueeze(-1)
        dist.all_reduce(out)
        return out


class _VocabHead(torch.nn.Module):
    """A shard's rows of the lm_head (`inner`): its logits of its share of the vocabulary, gathered from every shard
    into the whole vocabulary's (`vocab` columns; the last shard's padding dropped)."""

    def __init__(self, inner: torch.nn.Module, vocab: int, count: int):
        super().__init__()
        self.inner, self.vocab, self.count = inner, vocab, count

    @property
    def weight(self) -> torch.Tensor:  # (the shard's rows, as the lm_head's)
        return self.inner.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = self.inner(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.count)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def vocab_parallel(model: torch.nn.Module, shard: Shard, head: bool = True) -> None:
    """`model`'s (a shard's, `load_shard`'s) embeddings and lm_head, each holding `vocab_rows` of the vocabulary (rows
    `rank * rows ...`; one matrix where they are tied), made to compute the whole vocabulary's: an id's embedding from
    the shard holding its row, summed across the shards; the logits of each shard's rows, gathered (vLLM's
    VocabParallelEmbedding and ParallelLMHead). `head` False: the embeddings only (a classifier's head is whole)."""
    rows = model.model.embed_tokens.weight.shape[0]
    vocab = model.config.vocab_size
    held = max(0, min(rows, vocab - shard.rank * rows))  # (the last shard's rows past the vocabulary: none of its ids)
    model.model.embed_tokens = _VocabEmbedding(model.model.embed_tokens, shard.rank * rows, max(held, 1))
    if head:
        model.lm_head = _VocabHead(model.lm_head, vocab, shard.count)


class _SpanningNorm(torch.nn.Module):
    """OLMo's query (or key) norm on a shard (`inner`, its slice of the weight): an RMSNorm over all the heads at once,
    the squares of each shard's heads summed across the shards (`width`: the whole projection's; each key head held by
    `replicas` shards counted once), then each shard's slice scaled by its weights, as the whole norm computes."""

    def __init__(self, inner: torch.nn.Module, width: int, replicas: int):
        super().__init__()
        self.weight, self.width, self.replicas = inner.weight, width, replicas
        self.eps = getattr(inner, "variance_epsilon", None) or inner.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        variance = squares / (self.width * self.replicas)
        return (self.weight * (xf * torch.rsqrt(variance + self.eps))).to(x.dtype)


def spanning_norms(layers, config, shard: Shard) -> None:
    """Each layer of `layers` (a shard's, of a SPANNING_NORM_FAMILIES model with `config`) given query and key norms
    that span the shards (`_SpanningNorm`)."""
    heads, kv_heads, d = _heads(config)
    replicas = kv_replicas(config, shard.count)
    for layer in layers:
        attn = layer.self_attn
        attn.q_norm = _SpanningNorm(attn.q_norm, heads * d, 1)
        attn.k_norm = _SpanningNorm(attn.k_norm, kv_heads * d, replicas)


def reduce_outputs(model: torch.nn.Module, layers) -> None:
    """Each row-parallel projection of `layers` (`ROW_PARALLEL`, as the runner calls them after packing or
    quantizing), and each sparse MoE block (`SparseMoE`, whose shared expert's down projection is not reduced apart),
    all-reduces its output across the shards, in place: the whole projection's or block's output on every shard."""
    import torch.distributed as dist

    from pylon.serving.model.moe import SparseMoE

    def reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    for layer in layers:
        if isinstance(layer.mlp, SparseMoE):  # its experts' and shared expert's partial sums: once, on the block
            layer.mlp.register_forward_hook(reduce)
        attention = getattr(layer, "self_attn", None) or layer.linear_attn  # (a recurrent layer's: `linear_attn`)
        for parent in (attention, layer.mlp):
            for name in ROW_PARALLEL:
                child = getattr(parent, name, None)
                if child is not None:
                    child.register_forward_hook(reduce)
