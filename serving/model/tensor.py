"""Tensor-parallel shards of a model: each process holds a slice of every decoder layer (Megatron-LM's split, vLLM's
`tensor_parallel_size`), so that a model larger than one GPU's memory is served by the GPUs of one node together.

Shard `rank` of `count` holds, in each layer, the query, key and value projections of heads `rank * heads / count`
... (whole heads, and their KV cache), and the same slice of the MLP's gate and up projections' outputs (column
parallel); the attention's output projection and the MLP's down projection take the matching slice of their inputs
(row parallel), so each shard's output is a partial sum, made whole by an all-reduce across the shards (the only
communication: two a layer, `[tokens, hidden]` each). The embeddings, the norms and the lm_head are every shard's.

A shard is a model of its own: the family's class built from the config with `count` times fewer heads and MLP
width (`local_config`), so that everything downstream (the runner's KV cache, its attention, packing, quantization)
sees an ordinary, smaller model; its weights are the checkpoint's slices, each read from the safetensors files by
slice (`get_slice`: a shard never reads the other shards' slices). The families split are the Llama-like ones whose
projections are separate modules and whose checkpoint keys are the model's (`refused`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pylon.errors import PylonError

# The families split by heads and MLP width: separate q/k/v/o and gate/up/down projections, per-head (or no) query
# and key norms, no experts, no latent attention, no recurrent layers, no attention sinks.
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
)
ROW_PARALLEL = ("o_proj", "down_proj")  # their inputs sliced: partial sums, reduced across the shards


@dataclass(frozen=True)
class Shard:
    """Shard `rank` of `count`."""

    rank: int
    count: int

    def describe(self) -> str:
        return f"tensor-parallel shard {self.rank + 1} of {self.count}"


def _heads(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def refused(model_type: str, config, count: int) -> str | None:
    """Why `config`'s model cannot be split into `count` tensor-parallel shards (None: it can)."""
    if model_type not in SPLIT_FAMILIES:
        return (
            f"a {model_type} model is not split for tensor parallelism (the families split: "
            f"{', '.join(SPLIT_FAMILIES)})"
        )
    heads, kv_heads, _ = _heads(config)
    width = config.intermediate_size
    for what, n in (("attention heads", heads), ("key-value heads", kv_heads), ("MLP width", width)):
        if n % count:
            return f"its {n} {what} do not split into {count} equal shards (use a count that divides them)"
    return None


def local_config(config, count: int):
    """`config` with `count` times fewer attention heads, key-value heads and MLP width (the head size kept): the
    config of one shard's model."""
    heads, kv_heads, head_dim = _heads(config)
    local = copy.deepcopy(config)
    local.head_dim = head_dim
    local.num_attention_heads = heads // count
    local.num_key_value_heads = kv_heads // count
    local.intermediate_size = config.intermediate_size // count
    return local


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


def _slicer(name: str, local: torch.Size, full: list[int], shard: Shard) -> Callable | None:
    """How shard `shard` takes tensor `name` (local shape `local`, the checkpoint's `full`) from its slice view:
    whole, rows, or columns (None: not at all: a row-parallel projection's bias, on shards but the first)."""
    r, n = shard.rank, shard.count
    if list(local) == list(full):
        if name.endswith(".bias") and name.rsplit(".", 2)[-2] in ROW_PARALLEL and r:
            return None  # (added once: by the first shard, to the partial sums)
        return lambda s: s[:]
    if len(full) >= 1 and local[0] * n == full[0] and list(local[1:]) == list(full[1:]):
        size = local[0]
        return lambda s: s[r * size : (r + 1) * size]
    if len(full) == 2 and local[1] * n == full[1] and local[0] == full[0]:
        size = local[1]
        return lambda s: s[:, r * size : (r + 1) * size]
    raise PylonError(f"{name}: the shard's shape {list(local)} is no slice of the checkpoint's {full}")


def load_shard(model_dir: str, config, dtype: torch.dtype, shard: Shard) -> torch.nn.Module:
    """Shard `shard`'s causal LM of `model_dir` (its config `config`), in `dtype` on the CPU: the family's class
    built from `local_config` (no initialisation), each tensor read as the shard's slice of the checkpoint's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.models.auto.auto_factory import _get_model_class

    local = local_config(config, shard.count)
    cls = _get_model_class(local, AutoModelForCausalLM._model_mapping)
    with no_init_weights():
        model = cls._from_config(local, dtype=dtype)
    files = _weight_files(model_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    missing = [k for k in state if k not in files and not (tied and k == "lm_head.weight")]
    if missing:
        raise PylonError(
            f"model {model_dir}: {shard.describe()}: {len(missing)} of its tensors are not in the checkpoint under "
            f"the model's names ({', '.join(missing[:3])}): a checkpoint whose weights transformers converts at load "
            "is not split for tensor parallelism"
        )
    by_file: dict[str, list[str]] = {}
    for key in state:
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(path, framework="pt") as f:
                for key in keys:
                    view = f.get_slice(key)
                    take = _slicer(key, state[key].shape, view.get_shape(), shard)
                    if take is None:
                        state[key].zero_()
                    else:
                        state[key].copy_(take(view))
    if tied:
        model.tie_weights()
    # the buffers computed at construction (the rotary embedding's frequencies), as the whole model's
    return model.eval()


def reduce_outputs(model: torch.nn.Module, layers) -> None:
    """Each row-parallel projection of `layers` (`ROW_PARALLEL`, as the runner calls them after packing or
    quantizing) all-reduces its output across the shards, in place: the whole projection's output on every shard."""
    import torch.distributed as dist

    def reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    for layer in layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in ROW_PARALLEL:
                child = getattr(parent, name, None)
                if child is not None:
                    child.register_forward_hook(reduce)
