"""LoRA adapters served on one base model, per request: many adapters and the base model share one batched step.

An adapter is what peft's `PeftModel.save_pretrained` writes (Pylon's `pylon export --lora adapter`):
`adapter_config.json` and `adapter_model.safetensors` (or `adapter_model.bin`), holding for each adapted projection
`base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`. Adapted, a projection computes
`y = base(x) + scale * (x @ A^T) @ B^T` with scale = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`); peft
keeps A and B as plain `nn.Linear` weights even for GPT-2's Conv1D (its `fan_in_fan_out` concerns the base weight
only), so both families read the same way.

The base weights are never changed (merging an adapter into them would serve one adapter at a time). Instead, as
Punica and S-LoRA do, each projection of a step runs the base weights over every row, then for each adapter present
in the step adds its low-rank product to that adapter's rows only (`Rows.add`: gather the rows, two thin matmuls,
scatter-add back). A step with no adapter rows runs none of this. The base projection may be anything that maps `x`
to `y` (torch's addmm, oneDNN's packed weight, an int8 weight): the delta is added to its output. A and B are kept
transposed (`[in, r]`, `[r, out]`) with the scale folded into B, in the runner's dtype and on its device.

Per-module rank and alpha (peft's `rank_pattern` / `alpha_pattern`) are honoured, matched as peft matches them. What
changes the forward pass beyond that (DoRA, LoRA biases, `modules_to_save`, adapted embeddings or lm_head, ...) is
refused when the adapter is loaded, with what to do instead: merging such an adapter into the base model
(`pylon export --lora merged`, or peft's `merge_and_unload`) gives a model the engine serves as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pylon.errors import PylonError
from pylon.serving.model.families import LLAMA_FAMILIES, MOE_MODEL_TYPES

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # the first found is read
# The projections the runner adapts, by their path under a decoder layer, and where the layers sit in the model.
_LLAMA_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROJECTIONS = (
    {"gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    | {"opt": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")}
    | {"gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}
    | dict.fromkeys(LLAMA_FAMILIES, _LLAMA_PROJECTIONS)
    # Phi-3's fused projections, adapted whole, as peft targets them (pylon.serving.model.families).
    | {"phi3": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    # GLM-4's fused MLP (gate, then up, in one projection) beside separate attention projections.
    | {"glm4": (*_LLAMA_PROJECTIONS[:4], "mlp.gate_up_proj", "mlp.down_proj")}
    # Arcee's and Apertus's MLPs have no gate: down(act(up(x))).
    | dict.fromkeys(("arcee", "apertus"), (*_LLAMA_PROJECTIONS[:4], "mlp.up_proj", "mlp.down_proj"))
    # Mixture-of-experts families: the attention's projections (the experts are 3-D weights, not modules, and
    # peft's LoRA on them, target_parameters, is refused below).
    | dict.fromkeys(MOE_MODEL_TYPES, _LLAMA_PROJECTIONS[:4])
    # DeepSeek-V3's latent attention: its output projection (its query and latent projections are absorbed into the
    # attention at load: pylon.serving.model.families).
    | dict.fromkeys(("deepseek_v2", "deepseek_v3"), ("self_attn.o_proj",))
    # StarCoder2's plain MLP (c_proj(act(c_fc(x)))).
    | {"starcoder2": (*_LLAMA_PROJECTIONS[:4], "mlp.c_fc", "mlp.c_proj")}
)
LAYERS = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "gpt_neox": "gpt_neox.layers"} | dict.fromkeys(
    LLAMA_FAMILIES, "model.layers"
)
# peft's key for one of a projection's two matrices (the adapter's name is not in a saved adapter's keys).
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")
# Initialisations that change the base weights too (PiSSA, OLoRA, CorDA, LoRA-GA move the principal part of each
# weight into the adapter; LoftQ quantizes the base): such an adapter is meant for the changed base, not this one.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
# LoraConfig fields that, set, change what a projection computes beyond `base(x) + scale * B A x`, with what they are.
_VARIANTS = {
    "lora_bias": "a bias on lora_B (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters)",
}
_MERGE_INSTEAD = (
    "merge it into its base model instead (`pylon export --lora merged`, or peft's merge_and_unload) and serve "
    "that as a model of its own"
)


def projection_shapes(model: torch.nn.Module, model_type: str) -> dict[str, tuple[int, int]]:
    """`(in, out)` of every projection an adapter may adapt, by its module path in `model` (peft's names:
    `transformer.h.0.attn.c_attn`). Read from the modules' sizes, so packed or quantized ones answer too."""
    shapes = {}
    for i, layer in enumerate(model.get_submodule(LAYERS[model_type])):
        for path in PROJECTIONS[model_type]:
            try:
                m = layer.get_submodule(path)
            except AttributeError:  # a layer without it (Qwen3-Next's recurrent layers have no self_attn)
                continue
            if hasattr(m, "nx"):  # GPT-2's Conv1D: nx inputs, nf outputs
                shapes[f"{LAYERS[model_type]}.{i}.{path}"] = (m.nx, m.nf)
            else:  # nn.Linear, linear.PackedLinear, quant.QuantLinear
                shapes[f"{LAYERS[model_type]}.{i}.{path}"] = (m.in_features, m.out_features)
    return shapes


def _pattern_value(patterns: dict, module: str, default):
    """peft's per-module value (`rank_pattern`, `alpha_pattern`): the first pattern that matches the end of the
    module's path, at a dot (peft.utils.other.get_pattern_key), else the default."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


# A multimodal checkpoint's language model (families.TEXT_MODELS: Gemma 3 4B-27B), as peft names its modules on the
# conditional model (transformers 5's layout, then the hub's), and as the engine's causal LM of it names them.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def _language_model_module(module: str) -> str:
    """`module` of a multimodal model's language model as the engine's causal LM of it names it (`model.layers...`);
    other names as they are (a vision tower's module stays foreign, and is refused naming it)."""
    for prefix in _LANGUAGE_MODEL_PREFIXES:
        if module.startswith(prefix):
            return "model." + module[len(prefix) :]
    return module


def _module_of(key: str) -> str:
    """The module a saved tensor belongs to: its key without peft's prefix and what peft appends (`lora_A.weight`,
    `lora_embedding_A`, `base_layer.weight`, `modules_to_save...`, a plain `weight`)."""
    module = key.removeprefix("base_model.model.")
    for part in (".lora_", ".base_layer.", ".modules_to_save.", ".original_module."):
        module = module.split(part, 1)[0]
    return module.removesuffix(".weight").removesuffix(".bias")


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isdir(directory):
        raise PylonError(
            f"{directory}: no such LoRA adapter directory; give the directory peft's save_pretrained "
            "(or `pylon export --lora adapter`) wrote"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise PylonError(
            f"{directory}: not a LoRA adapter (no {CONFIG_FILE}); give the directory peft's save_pretrained "
            "(or `pylon export --lora adapter`) wrote"
        ) from None
    except (OSError, ValueError) as e:
        raise PylonError(f"{directory}: {CONFIG_FILE} cannot be read ({e}); write the adapter again") from None
    if not isinstance(config, dict):
        raise PylonError(f"{directory}: {CONFIG_FILE} is not a JSON object; write the adapter again")
    return config


def _check_config(directory: str, config: dict) -> None:
    """Refuse what the runner cannot apply as `base(x) + scale * B A x` on its projections."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise PylonError(
            f"{directory}: a {peft_type or 'non-LoRA'} adapter (peft_type {peft_type!r}); the serving engine applies "
            f"LoRA adapters only: {_MERGE_INSTEAD}"
        )
    if config.get("use_dora"):
        raise PylonError(
            f"{directory}: a DoRA adapter (use_dora: true), which rescales each base weight's columns; the serving "
            f"engine applies plain LoRA only: {_MERGE_INSTEAD}"
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise PylonError(
            f"{directory}: trains the base model's biases too (bias: {bias!r}), which the adapter's file carries "
            f"and the engine would not apply; retrain with bias 'none', or {_MERGE_INSTEAD}"
        )
    if config.get("modules_to_save"):
        raise PylonError(
            f"{directory}: replaces whole modules (modules_to_save: {config['modules_to_save']}), which the engine "
            f"cannot swap per request; retrain without modules_to_save, or {_MERGE_INSTEAD}"
        )
    for field, what in _VARIANTS.items():
        if config.get(field):
            raise PylonError(f"{directory}: uses {what}, which the serving engine does not apply; {_MERGE_INSTEAD}")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise PylonError(
            f"{directory}: initialised with {config['init_lora_weights']!r}, which changed the base weights too, so "
            "the adapter only holds on that changed base; save it again with peft's save_pretrained("
            "path_initial_model_for_weight_conversion=...) to make it an adapter of the original base model"
        )
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise PylonError(f"{directory}: {CONFIG_FILE} has no integer r and numeric lora_alpha; write the adapter again")


def _read_tensors(directory: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            raise PylonError(
                f"{directory}: {name} cannot be read ({type(e).__name__}: {str(e)[:300]}); copy or write the "
                "adapter again"
            ) from None
    raise PylonError(
        f"{directory}: has {CONFIG_FILE} but no weights ({' or '.join(WEIGHT_FILES)}); copy the whole directory "
        "peft's save_pretrained wrote"
    )


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: for each adapted projection (its module path), `(A^T [in, r], scale * B^T [r, out])`."""

    directory: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""  # of its files' bytes (config and weights): the same name with other contents differs

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(
    directory: str,
    model_type: str,
    shapes: dict[str, tuple[int, int]],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_rank: int | None = None,
    rank_limit: str = "max_rank",
    held: tuple[range, int] | None = None,
    split: Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Adapter:
    """Read and check the adapter peft saved in `directory` for a `model_type` model whose projections are `shapes`
    (`projection_shapes`); its matrices in `dtype` on `device`. Raises a PylonError naming the directory and what to
    do when the adapter cannot be served on this model as it is, or when a projection's rank is above `max_rank`
    (the field that sets it named as `rank_limit`). `held`: a pipeline stage's layers and the model's number of
    layers: the adapter's matrices of the other stages' layers are left out (their stages load and check them).
    `split(module, A, B)`: a tensor-parallel shard's part of each projection's matrices (pylon.serving.model.tensor's
    `adapter_split`), taken after they are checked against `shapes`, the whole model's."""
    config = _read_config(directory)
    _check_config(directory, config)
    tensors = _read_tensors(directory)
    layers, projections = LAYERS[model_type], PROJECTIONS[model_type]
    module_re = re.compile(rf"{re.escape(layers)}\.(\d+)\.({'|'.join(map(re.escape, projections))})")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    foreign: list[str] = []  # modules the adapter changes that the engine does not adapt
    elsewhere = 0  # its tensors of the layers other pipeline stages hold (`held`)
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        module = _language_model_module(match["module"] if match else _module_of(key))
        projection = module_re.fullmatch(module) if match is not None else None
        if projection is None:
            foreign.append(module)
            continue
        layer = int(projection[1])
        if held is not None and layer < held[1] and layer not in held[0]:
            elsewhere += 1  # another stage's layer
            continue
        if module not in shapes:  # a projection of a layer this model does not have
            num_layers = held[1] if held is not None else len(shapes) // len(projections)
            raise PylonError(
                f"{directory}: adapts {module}, but this model has {num_layers} layers (0 to {num_layers - 1}); "
                "the adapter was trained on another base model: serve it with that one"
            )
        pairs.setdefault(module, {})[match["which"]] = tensor
    if foreign:
        raise PylonError(
            f"{directory}: changes {', '.join(sorted(set(foreign)))}, which the serving engine does not adapt (it "
            f"applies LoRA to {', '.join(projections)} of each of {layers} only); retrain with target_modules among "
            f"those, or {_MERGE_INSTEAD}"
        )
    if not pairs and not elsewhere:
        raise PylonError(f"{directory}: holds no LoRA weights; write the adapter again with peft's save_pretrained")
    rslora = bool(config.get("use_rslora"))
    weights = {}
    for module in (m for m in shapes if m in pairs):  # the model's order: layer by layer
        pair = pairs[module]
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise PylonError(f"{directory}: {module} has no {missing}.weight; write the adapter again")
        a, b = pair["A"], pair["B"]
        n_in, n_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise PylonError(
                f"{directory}: {module}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, not [r, in] and "
                "[out, r]: the file is damaged or not peft's; write the adapter again"
            )
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise PylonError(
                f"{directory}: {module}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but this model's "
                f"{module} maps {n_in} inputs to {n_out} outputs (lora_A [r, {n_in}], lora_B [{n_out}, r] expected); "
                "the adapter was trained on another base model: serve it with that one"
            )
        r = _pattern_value(config.get("rank_pattern"), module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        if a.shape[0] != r:
            raise PylonError(
                f"{directory}: {module} has rank {a.shape[0]} in its weights but {r} in {CONFIG_FILE} (r, "
                "rank_pattern): the two files are from different adapters; write the adapter again"
            )
        if max_rank is not None and r > max_rank:
            raise PylonError(
                f"{directory}: {module} has rank {r}, above {rank_limit} ({max_rank}); raise {rank_limit} or serve "
                "an adapter of a lower rank"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if split is not None:
            a, b = split(module, a, b)
        a_t = a.float().t().contiguous().to(device, dtype)
        b_t = (b.float() * scale).t().contiguous().to(device, dtype)
        weights[module] = (a_t, b_t)
    return Adapter(directory, weights, _digest(directory))


def _digest(directory: str) -> str:
    """sha256 over the adapter's config and weight files (the ones `load_adapter` read)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


class Rows:
    """A step's rows (of one batch of projections' inputs) grouped by adapter: `groups` holds, for each adapter
    present, its slot and the indices of its rows (None: every row), and `table` the adapters' matrices."""

    def __init__(
        self,
        groups: list[tuple[int, torch.Tensor | None]],
        table: list[dict[str, dict[int, tuple]]],
        reduced: tuple[frozenset[str], Callable[[torch.Tensor], object]] | None = None,
    ):
        self.groups = groups
        self.table = table
        self.reduced = reduced

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """`y` (`[rows, out]`, a projection's output over `x` `[rows, in]` in layer `layer`) with each adapter's
        delta added to its rows, in place; returns `y`."""
        adapted = self.table[layer].get(projection)
        if adapted is None:
            return y
        # A tensor-parallel shard's row-parallel projection: `x` is its slice of the input and A^T its rows, so x @ A^T
        # is a partial sum, made whole across the shards before B (`AdapterSet.reduced`).
        reduce = self.reduced[1] if self.reduced is not None and projection in self.reduced[0] else None
        for slot, rows in self.groups:
            ab = adapted.get(slot)
            if ab is None:  # this adapter leaves the projection as it is
                continue
            a, b = ab
            low = x @ a if rows is None else x.index_select(0, rows) @ a
            if reduce is not None:
                reduce(low)
            if rows is None:
                y.addmm_(low, b)
            else:
                y.index_add_(0, rows, low @ b)
        return y


@dataclass(frozen=True)
class StepAdapters:
    """Which adapter each row of a step uses: `tokens` for the step's rows (its tokens'; padding rows past them are
    base rows), `finals` for the rows the last layer keeps after attention (`attention.Final.rows`); either None when
    none of its rows uses an adapter."""

    tokens: Rows | None
    finals: Rows | None


class AdapterSet:
    """The adapters a runner serves, slot k = `adapters[k - 1]` (slot 0 is the base model), arranged per layer and
    projection for `Rows.add`."""

    def __init__(
        self,
        adapters: Sequence[Adapter],
        model_type: str,
        num_layers: int,
        reduced: tuple[frozenset[str], Callable[[torch.Tensor], object]] | None = None,
    ):
        """`reduced`: a tensor-parallel shard's row-parallel projections (their paths under a layer), and how a partial
        sum is made whole across the shards in place (`Rows.add`)."""
        self.prefix = LAYERS[model_type]
        self.reduced = reduced
        self.slots: dict[int, Adapter] = {}
        # table[layer][projection path under the layer] = {slot: (A^T, scale * B^T)}
        self.table: list[dict[str, dict[int, tuple]]] = [{} for _ in range(num_layers)]
        for slot, adapter in enumerate(adapters, start=1):
            self.put(slot, adapter)

    def put(self, slot: int, adapter: Adapter | None) -> None:
        """Serve `adapter` in `slot` (>= 1) from the next step on, in the place of the one there; None empties it.
        (An engine loads adapters on demand this way: engine/adapters.py.)"""
        if slot < 1:
            raise ValueError(f"adapter slot {slot}: slots start at 1 (0 is the base model)")
        for projections in self.table:
            for by_slot in projections.values():
                by_slot.pop(slot, None)
        self.slots.pop(slot, None)
        if adapter is None:
            return
        self.slots[slot] = adapter
        for module, ab in adapter.weights.items():
            layer, projection = module[len(self.prefix) + 1 :].split(".", 1)
            self.table[int(layer)].setdefault(projection, {})[slot] = ab

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, slot: int) -> bool:
        return slot in self.slots

    @property
    def adapters(self) -> list[Adapter]:
        return [self.slots[k] for k in sorted(self.slots)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slots.values())

    def rows(self, slots: Sequence[int], num_rows: int, index: Callable[[list[int]], torch.Tensor]) -> Rows | None:
        """`slots[i]`: the adapter of row i (rows past `len(slots)`, up to `num_rows`, are base rows); `index(list)`
        makes a row index tensor on the device (the runner's HostStage.add). None when no row uses an adapter."""
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot:
                by_slot.setdefault(slot, []).append(i)
        if not by_slot:
            return None
        groups = [(slot, None if len(rows) == num_rows else index(rows)) for slot, rows in sorted(by_slot.items())]
        return Rows(groups, self.table, self.reduced)


def load_adapters(
    directories: Sequence[str],
    model: torch.nn.Module,
    model_type: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    layers: range | None = None,
    shard: tuple[dict[str, tuple[int, int]], Callable, tuple[frozenset[str], Callable]] | None = None,
) -> AdapterSet:
    """Every adapter of `directories` checked against `model` (a loaded Hugging Face model of `model_type`) and
    loaded; the k-th is slot k. `layers`: a pipeline stage's (the matrices of its layers only). `shard`: a
    tensor-parallel shard's model: the whole model's projection shapes (to check against), `load_adapter`'s `split`,
    and `AdapterSet`'s `reduced`."""
    shapes, split, reduced = shard if shard is not None else (projection_shapes(model, model_type), None, None)
    num_layers = len(model.get_submodule(LAYERS[model_type]))
    held = (layers, num_layers) if layers is not None and len(layers) < num_layers else None
    return AdapterSet(
        [
            load_adapter(str(d), model_type, shapes, dtype=dtype, device=device, held=held, split=split)
            for d in directories
        ],
        model_type,
        num_layers,
        reduced,
    )
