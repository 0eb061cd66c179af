"""Models for training: `transformers` causal LMs from a `ModelSpec`, LoRA adapters, and the FLOP counts MFU needs.

    config = model_config(job.model, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    model = build_model(job, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=0)

A model comes from a named preset (`pylon.presets`), an explicit Hugging Face config, or a model directory on
a local path or object storage (fine-tuning). Nothing is ever downloaded from a hub: directories are read with
`local_files_only=True`. Models are built in fp32; DeepSpeed casts them for bf16/fp16 and keeps fp32 masters.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from fsspec.implementations.local import LocalFileSystem

from pylon import storage
from pylon.errors import PylonError, StorageError
from pylon.presets import preset_config
from pylon.specs import LoraSpec, ModelSpec, TrainJobSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# Module types LoRA can wrap in the architectures we build: torch's Linear, and GPT-2's Conv1D (a Linear
# with its weight stored transposed).
_LORA_LAYER_TYPES = ("Linear", "Conv1D")


# ---------------------------------------------------------------------------------------------------------
# Configs and models
# ---------------------------------------------------------------------------------------------------------


def model_config(
    model: ModelSpec, *, vocab_size: int | None = None, eos_id: int | None = None, pad_id: int | None = None
) -> "PretrainedConfig":
    """The Hugging Face config `model` describes, sized for the dataset's tokenizer.

    `vocab_size` (the tokenizer's) replaces a preset's or an explicit config's vocabulary; a model directory
    keeps its own embedding table, which must be at least that large. `eos_id`/`pad_id` (the tokenizer's) are
    written into the config; bos is set to eos, since packing separates documents with eos only.
    """
    from transformers import AutoConfig

    special = {}
    if eos_id is not None:
        special.update(eos_token_id=eos_id, bos_token_id=eos_id)
    if pad_id is not None:
        special["pad_token_id"] = pad_id

    if model.path is not None:
        with local_model_dir(model.path, weights=False) as directory:  # the config only: never copy the weights
            try:
                config = AutoConfig.from_pretrained(directory, local_files_only=True)
            except (OSError, ValueError) as e:
                raise PylonError(f"model.path {model.path}: not a Hugging Face model directory ({e})") from None
        if vocab_size is not None and vocab_size > config.vocab_size:
            raise PylonError(
                f"model.path {model.path}: the tokenizer's vocabulary ({vocab_size} tokens) is larger than the "
                f"model's embedding table ({config.vocab_size} tokens); use the model's own tokenizer"
            )
        for key, value in special.items():
            setattr(config, key, value)
        return config

    fields = preset_config(model.preset) if model.preset is not None else copy.deepcopy(model.config)
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(special)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:  # an unknown model_type
        raise PylonError(f"model.config.model_type: {e}") from None


def build_model(
    spec: TrainJobSpec,
    *,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    seed: int = 0,
    deepspeed_config: dict | None = None,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """The causal LM `spec` describes, ready to hand to `deepspeed.initialize`.

    The same `seed` gives the same initial weights (and LoRA adapters) in every process and at every ZeRO stage,
    which is what lets every rank start from one model. With `spec.lora` the result is a `peft` model whose only
    trainable parameters are the adapters.

    `deepspeed_config` (the dict the engine will get) at ZeRO-3 builds the model partitioned: under
    `deepspeed.zero.Init`, each module's parameters are split across the ranks (and offloaded, if the config
    offloads parameters) as soon as the module exists, so no process ever holds the whole model; initialisation
    then gathers one module at a time. Pretrained weights (`model.path`) stream into the partitions one tensor
    at a time (`_load_partitioned`). The process group must exist.

    At stages 0-2 (a `deepspeed_config` of another stage, in a process group of several ranks) the model is built
    once, by rank 0: it alone reads the config and the weights from storage and initialises, and broadcasts the
    result (`_broadcast_module`). The other ranks build without initialising, straight on `device` (their GPU:
    no copy in host RAM; on CPU each keeps its replica in RAM, as it does in training), and never touch
    storage. Rank 0 builds on the CPU, as a single process does, and moves the model to `device`. Without a
    process group (or without `deepspeed_config`) the process builds the whole model itself.
    """
    partitioned = bool(deepspeed_config) and deepspeed_config.get("zero_optimization", {}).get("stage") == 3
    ranks = _world_size() if deepspeed_config else 1
    rank = _rank() if ranks > 1 else 0
    # Rank 0 alone reads the config (and any model directory's) from storage; every rank gets it, or its error.
    config = _from_rank0(
        lambda: model_config(spec.model, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id), ranks, rank
    )
    config = with_head(config, reward=spec.objective == "reward")
    shared = ranks > 1 and not partitioned  # stages 0-2: rank 0 builds, the others receive
    torch.manual_seed(seed)
    with _zero3_construction(deepspeed_config if partitioned else None):
        if partitioned:
            # transformers sees the config (HfDeepSpeedConfig): it builds under zero.Init with init switched off,
            # then initialises each module gathered on rank 0 and broadcasts it (initialize_weights_zero3).
            model = auto_model_class(config).from_config(config, dtype=torch.float32)
            if spec.model.path is not None:
                _load_partitioned(model, spec.model.path)
        elif shared:
            path = spec.model.path
            model = _from_rank0(
                (lambda: _load_whole(path, config)) if path is not None else (lambda: _initialised(config)),
                ranks,
                rank,
                share=False,
            )
            if rank != 0:
                model = _uninitialised(config, device)
            elif device is not None:
                model.to(device)
        elif spec.model.path is not None:
            model = _load_whole(spec.model.path, config)
        else:
            model = _initialised(config)

        if spec.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if spec.lora is not None:
            model = with_lora(model, spec.lora)
        if spec.loss_chunk_tokens:
            with_chunked_loss(model, spec.loss_chunk_tokens)
        if spec.neftune_noise_alpha:
            with_neftune(model, spec.neftune_noise_alpha)
    if shared:
        _broadcast_module(model)  # after LoRA: its adapters are rank 0's too
    return model


def _initialised(config: "PretrainedConfig") -> torch.nn.Module:
    """A new model from `config`, in fp32 on the CPU, initialised from torch's random stream.

    Built with init off, then initialised in one pass: the same random stream, module for module, as the
    partitioned build (whose constructors cannot initialise), so every stage starts equal."""
    from transformers import initialization

    with initialization.no_init_weights():
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
    model.initialize_weights()
    model.tie_weights()
    return model


def _uninitialised(config: "PretrainedConfig", device: torch.device | str | None) -> torch.nn.Module:
    """A model from `config` in fp32, allocated on `device` (the CPU by default) and left uninitialised: storage
    for weights another rank broadcasts."""
    from transformers import initialization

    with initialization.no_init_weights(), torch.device(device or "cpu"):
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
    model.tie_weights()
    return model


def is_classifier(config: "PretrainedConfig") -> bool:
    """Whether `config` is a `*ForSequenceClassification` model's (a reward model, a classifier)."""
    return any(str(name).endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or ())


def auto_model_class(config: "PretrainedConfig"):
    """The transformers auto class that builds `config`'s model: a classifier's, or the causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if is_classifier(config) else AutoModelForCausalLM


def with_head(config: "PretrainedConfig", *, reward: bool) -> "PretrainedConfig":
    """`config` with the head a TrainJob trains: `reward` (objective reward), its family's
    `*ForSequenceClassification` with one label, the reward (from a causal LM's checkpoint, the body is loaded and
    the head starts new: TRL's RewardTrainer does the same); otherwise the causal LM's, whatever checkpoint it
    came from. Its `pad_token_id` must be set: the classifier reads each row's last token that is not padding."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    names = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if reward else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if reward == is_classifier(config) and (not reward or config.num_labels == 1):
        return config
    name = names.get(config.model_type)
    if name is None:
        raise PylonError(
            f"objective {'reward' if reward else 'causal_lm'}: transformers has no "
            f"{'sequence-classification' if reward else 'causal LM'} model for model_type {config.model_type}"
        )
    config.architectures = [name]
    if reward:
        config.num_labels = 1  # (id2label/label2id follow)
    return config


@contextlib.contextmanager
def head_outputs(module: torch.nn.Module) -> Iterator[list]:
    """The classification head's output at every position, for the passes run inside: a list that holds it (a
    [rows, length, labels] tensor, in the autograd graph) after each forward of `module` (a reward model; a peft
    model's head reached through it)."""
    outputs = []
    handle = module.score.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def _load_whole(uri: str, config: "PretrainedConfig") -> torch.nn.Module:
    """The model directory `uri`'s model, whole, in fp32, on the CPU."""
    with local_model_dir(uri) as directory:
        try:
            return auto_model_class(config).from_pretrained(
                directory, config=config, dtype=torch.float32, local_files_only=True
            )
        except (OSError, ValueError) as e:
            raise PylonError(f"model.path {uri}: cannot load the model ({e})") from None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _from_rank0(make, ranks: int, rank: int, *, share: bool = True):
    """`make()` run on rank 0 alone. With `share`, every rank gets its result (picklable). An error it raises is
    raised on every rank (rank 0's own exception there, a PylonError with its message on the others) rather than
    left for the others to wait on forever. Single process: `make()`."""
    if ranks == 1:
        return make()
    result, error, failure = None, None, None
    if rank == 0:
        try:
            result = make()
        except Exception as e:
            failure = e
            error = (
                str(e) if isinstance(e, PylonError) else f"rank 0 could not build the model ({type(e).__name__}: {e})"
            )
    outcome = _broadcast_object((result if share else None, error))
    if failure is not None:
        raise failure
    if outcome[1] is not None:
        raise PylonError(outcome[1])
    return result if rank == 0 else outcome[0]


def _broadcast_module(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, in place, one tensor at a time (tied weights once)."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


@contextlib.contextmanager
def _zero3_construction(deepspeed_config: dict | None) -> Iterator[None]:
    """While inside, `transformers` builds models partitioned for ZeRO-3 (it looks for a live HfDeepSpeedConfig,
    which it holds by weak reference only); a no-op without a config."""
    if deepspeed_config is None:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    alive = HfDeepSpeedConfig(deepspeed_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del alive


_CLASSIFIER_HEADS = ("score.", "classifier.")  # a *ForSequenceClassification's head (Llama's, Qwen's; others')


def _load_partitioned(model: torch.nn.Module, uri: str) -> None:
    """The weights of the model directory `uri` into `model`, built partitioned under ZeRO-3.

    Rank 0 alone reads the weight files, one file at a time (a remote file is copied to a private temporary
    file, loaded and deleted before the next), and one tensor at a time: each parameter is gathered, filled
    from the file on rank 0 and partitioned again (broadcast to the other ranks), so no process holds more than
    the parameter being loaded. The other ranks never touch storage. Every rank learns each file's tensor names
    and shapes first, so that a bad file is the same error on every rank instead of a hang. Safetensors are read
    lazily; a `pytorch_model*.bin` is memory-mapped.
    """
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") or ""
    loaded: set[int] = set()

    def target(key: str) -> str | None:
        for name in (key, f"{prefix}.{key}", key[len(prefix) + 1 :] if key.startswith(prefix + ".") else None):
            if name and (name in params or name in buffers):
                return name
        return None

    listing = _broadcast_object(_weight_file_names(uri) if rank == 0 else None)
    for file_name in listing:
        with _weight_file(uri, file_name, open_it=rank == 0) as reader:
            shapes = _broadcast_object(reader.shapes() if rank == 0 else None)
            if isinstance(shapes, str):  # rank 0 could not read it: the same error everywhere
                raise PylonError(shapes)
            for key, shape in shapes:
                name = target(key)
                if name is None:
                    continue  # not a weight of this model (e.g. a rotary buffer an old version saved)
                if name in params:
                    param = params[name]
                    expected = tuple(getattr(param, "ds_shape", param.shape))
                    if tuple(shape) != expected:
                        raise PylonError(
                            f"model.path {storage.describe(uri)}: {file_name}: tensor {key} has shape "
                            f"{list(shape)}, the model expects {list(expected)}"
                        )
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                        if rank == 0:
                            with torch.no_grad():
                                param.data.copy_(reader.tensor(key))
                    loaded.add(id(param))
                else:  # a persistent buffer: not partitioned, every rank needs its value
                    buf = buffers[name]
                    value = reader.tensor(key).to(buf.device, buf.dtype) if rank == 0 else torch.empty_like(buf)
                    dist.broadcast(value, src=0)
                    with torch.no_grad():
                        buf.copy_(value)
    missing = [name for name, p in model.named_parameters() if id(p) not in loaded]
    if is_classifier(model.config):  # a reward model from a causal LM: its new head keeps its initialisation
        missing = [name for name in missing if not name.startswith(_CLASSIFIER_HEADS)]
    if missing:
        raise PylonError(
            f"model.path {storage.describe(uri)}: no weights for {len(missing)} of the model's parameters "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); is it this architecture's checkpoint?"
        )


def _broadcast_object(obj):
    """Rank 0's `obj` on every rank (picklable; small: names and shapes)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _weight_file_names(uri: str) -> list[str] | str:
    """The weight files of the model directory `uri`, in load order: its safetensors, else its PyTorch `.bin`
    files. A message (str) when there are none, so that every rank raises it."""
    try:
        fs, path = storage.resolve(uri)
        names = sorted(os.path.basename(f) for f in fs.ls(path.rstrip("/"), detail=False))
    except Exception as e:  # StorageError, fsspec/botocore errors
        return f"model.path {storage.describe(uri)}: cannot be listed ({type(e).__name__}: {e})"
    for suffix in (".safetensors", ".bin"):
        found = [n for n in names if n.endswith(suffix) and not n.startswith("training_args")]
        if found:
            return found
    return f"model.path {storage.describe(uri)}: no weight files (*.safetensors or pytorch_model*.bin)"


class _WeightReader:
    """One weight file, read a tensor at a time."""

    def __init__(self, uri: str, file_name: str, local: str) -> None:
        self.uri, self.file_name, self.local = uri, file_name, local
        self._safetensors = None
        self._state: dict | None = None

    def open(self) -> None:
        if self.file_name.endswith(".safetensors"):
            from safetensors import safe_open

            self._safetensors = safe_open(self.local, framework="pt")
        else:
            self._state = torch.load(self.local, map_location="cpu", mmap=True, weights_only=True)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]] | str:
        try:
            self.open()
            if self._safetensors is not None:
                return [(k, tuple(self._safetensors.get_slice(k).get_shape())) for k in self._safetensors.keys()]
            return [(k, tuple(v.shape)) for k, v in self._state.items()]
        except Exception as e:  # a truncated or foreign file
            return (
                f"model.path {storage.describe(self.uri)}: {self.file_name}: cannot be read ({type(e).__name__}: {e})"
            )

    def tensor(self, key: str) -> torch.Tensor:
        if self._safetensors is not None:
            return self._safetensors.get_tensor(key)
        return self._state[key]


@contextlib.contextmanager
def _weight_file(uri: str, file_name: str, *, open_it: bool) -> Iterator[_WeightReader]:
    """A reader of `file_name` in the model directory `uri`: the file itself when local, else a private
    temporary copy removed on exit. Nothing is read unless `open_it` (rank 0)."""
    if not open_it:
        yield _WeightReader(uri, file_name, "")
        return
    fs, path = storage.resolve(uri)
    remote = path.rstrip("/") + "/" + file_name
    if isinstance(fs, LocalFileSystem):
        yield _WeightReader(uri, file_name, remote)
        return
    tmp = tempfile.mkdtemp(prefix="pylon-weights-")
    try:
        local = os.path.join(tmp, file_name)
        try:
            fs.get(remote, local)
        except Exception as e:  # fsspec/botocore errors while copying: reported on every rank, as a bad file is
            yield _BrokenReader(uri, file_name, f"cannot be copied ({type(e).__name__}: {e})")
        else:
            yield _WeightReader(uri, file_name, local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _BrokenReader(_WeightReader):
    def __init__(self, uri: str, file_name: str, why: str) -> None:
        super().__init__(uri, file_name, "")
        self.why = why

    def shapes(self) -> str:
        return f"model.path {storage.describe(self.uri)}: {self.file_name}: {self.why}"


def enable_gradient_checkpointing(model: "PreTrainedModel") -> None:
    """Recompute each decoder block in the backward pass instead of keeping its activations.

    A model setting, not DeepSpeed's activation_checkpointing: transformers recomputes each block in the backward
    pass. Non-reentrant checkpointing also works when the inputs need no grad (frozen embeddings under LoRA). A KV
    cache is useless while training and conflicts with recomputation. (`pylon.plan.activations` simulates exactly this.)
    """
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """`activation_offload`: the tensors a training step's forward pass keeps for its backward pass, in host memory
    until the backward pass needs them (torch's `save_on_cpu`, TorchTune's and TorchTitan's activation offloading).
    With gradient checkpointing those are each decoder block's input (what torch's non-reentrant checkpoint saves
    outside the block) and what the layers outside blocks keep; the block's own activations are recomputed in the
    backward pass, on the device, and never leave it. Without checkpointing, every activation goes.

    Entered around the forward pass (`with ActivationOffload(model, device):`): each tensor autograd saves is copied
    to host memory (pinned on CUDA, so that its way back overlaps the backward pass's compute) and the device's copy
    freed; `unpack` copies it back when the backward pass asks. Kept where they are: parameters (and views of
    them: a transposed weight; ZeRO-3 regathers its own), tensors already in host memory, and those under
    `min_bytes` (a copy costs more than it frees). On the meta device (`pylon.plan.activations`) only the bytes are
    kept, as a tensor's description: the planner's simulation counts what leaves the device and what host memory
    holds. `host_bytes`/`peak_host_bytes`: what host memory holds now / held at most; `offloaded`: tensors sent."""

    MIN_BYTES = 1 << 16

    def __init__(
        self, model: torch.nn.Module, device: torch.device | str, *, min_bytes: int = MIN_BYTES, copy_host: bool = False
    ):
        """`copy_host`: tensors already in host memory are copied too (a CPU job's step gains nothing by it; the
        way there and back is then run, and tested, on a machine without a GPU)."""
        self.device = torch.device(device)
        self.min_bytes, self.copy_host = min_bytes, copy_host
        self._params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.host_bytes = self.peak_host_bytes = self.offloaded = 0
        self._pin = self.device.type == "cuda"
        # a tensor saved by several operators (the rotary embeddings every layer takes) goes once: id -> its copy
        self._sent: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if (
            (t.device.type == "cpu" and not self.copy_host)
            or nbytes < self.min_bytes
            or isinstance(t, torch.nn.Parameter)
            or t.untyped_storage()._cdata in self._params
        ):
            return t
        sent = self._sent.get(id(t))  # (the same tensor, unchanged since: an in-place op bumps its version)
        if sent is not None and sent[0]() is t and sent[1] == t._version and sent[2]() is not None:
            return sent[2]()
        self.offloaded += 1
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        if t.device.type == "meta":
            packed = _Offloaded(t.device, None, t.shape, t.dtype, nbytes, self)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
            host.copy_(t)  # (synchronous: the device's copy may be reused once this returns)
            packed = _Offloaded(t.device, host, t.shape, t.dtype, nbytes, self)
        self._sent[id(t)] = (weakref.ref(t), t._version, weakref.ref(packed))
        return packed

    def __enter__(self) -> "ActivationOffload":
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._sent.clear()  # (only a forward pass saves: the backward pass unpacks what was sent)

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Offloaded):
            return packed
        return packed.restore()


class _Offloaded:
    """A saved tensor in host memory (`ActivationOffload`): its copy there (None on the meta device) and where it
    goes back; the host bytes are given back to the count when autograd drops it."""

    __slots__ = ("device", "host", "shape", "dtype", "nbytes", "owner", "__weakref__")

    def __init__(self, device, host, shape, dtype, nbytes: int, owner: ActivationOffload):
        self.device, self.host, self.shape, self.dtype = device, host, shape, dtype
        self.nbytes, self.owner = nbytes, owner

    def restore(self) -> torch.Tensor:
        if self.host is None:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.host.to(self.device, non_blocking=self.host.is_pinned())

    def __del__(self):
        self.owner.host_bytes -= self.nbytes


def without_padding_warning(model: torch.nn.Module) -> torch.nn.Module:
    """`model` without transformers' "input_ids may be padded, pass an attention_mask" check: Pylon's batches either
    pass a mask, or (`attention_mask: document`) give the padding positions of its own, which is how packed rows are
    attended, so the warning would only mislead a job's log; and the check reads token values (on the meta device of
    `pylon.plan.activations` there are none). Returns `model`."""
    for module in model.modules():
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = _no_padding_warning
    return model


def _no_padding_warning(*args, **kwargs) -> None:
    return None


class TokenLoss(dict):
    """What a causal LM under `with_chunked_loss` returns when given `labels`: the next-token cross-entropy summed
    over the tokens the labels count (`loss_sum`, fp32, a tensor with gradient), their count (`tokens`), and a
    mixture-of-experts model's load-balancing loss (`aux_loss`, with `output_router_logits`); no logits. With
    `token_logprobs=True` the counted tokens' log-probabilities too (`token_logprobs`, fp32 [tokens], in the order
    of `labels[:, 1:]`'s counted positions, row by row: what the preference objectives sum per completion). A dict
    (as transformers' outputs are), so that ZeRO-3's hooks find its tensors."""

    def __init__(
        self,
        loss_sum: torch.Tensor,
        tokens: int,
        aux_loss: torch.Tensor | None = None,
        token_logprobs: torch.Tensor | None = None,
    ):
        super().__init__(loss_sum=loss_sum, tokens=tokens, aux_loss=aux_loss, token_logprobs=token_logprobs)

    @property
    def loss_sum(self) -> torch.Tensor:
        return self["loss_sum"]

    @property
    def tokens(self) -> int:
        return self["tokens"]

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return self["aux_loss"]

    @property
    def token_logprobs(self) -> torch.Tensor | None:
        return self["token_logprobs"]


def mean_token_loss(out) -> torch.Tensor:
    """The mean token loss of a causal LM's forward pass with labels: transformers' `loss`, or, for a model under
    `with_chunked_loss`, its summed loss over its token count (`TokenLoss`)."""
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.loss_sum / max(out.tokens, 1)


def with_neftune(model: torch.nn.Module, alpha: float) -> torch.nn.Module:
    """`model` (a transformers model, or a peft model around one) adding NEFTune's noise to its input embeddings in
    training mode (`TrainJobSpec.neftune_noise_alpha`): transformers' own hook (`integrations.neftune`, what its
    Trainer and TRL's register), uniform in [-m, m] with m = alpha / sqrt(length x hidden) of each batch's embeddings.
    In eval mode (evaluation, a preference objective's reference pass) it adds nothing. Returns `model`."""
    from transformers.integrations.neftune import activate_neftune

    activate_neftune(model, alpha)
    return model


def with_chunked_loss(model: torch.nn.Module, chunk_tokens: int) -> torch.nn.Module:
    """`model` (a transformers causal LM, or a peft model around one) computing its loss `chunk_tokens` tokens at a
    time when called with `labels` (`TrainJobSpec.loss_chunk_tokens`): the decoder's last hidden states of the tokens
    the labels count only, through the output layer and the cross-entropy one chunk at a time, each chunk recomputed
    in the backward pass (non-reentrant checkpointing) rather than kept. The logits of a whole micro-batch
    (micro_batch x seq_len x vocab, and their fp32 copy) never exist; a chunk's do. Liger's fused linear
    cross-entropy does the same in Triton kernels; this is PyTorch's own ops on any device. Called without
    `labels`, the model is what it was (logits). `check_chunked_loss` compares both ways before a job trains.
    `logits_temperature` (objective grpo's sampling temperature) divides the logits before the loss, as the
    sampler divided them. Returns `model`."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    original = lm.forward

    def forward(*args, labels=None, token_logprobs=False, logits_temperature=1.0, **kwargs):
        if labels is None:
            return original(*args, **kwargs)
        return _chunked_loss_forward(lm, labels, chunk_tokens, args, kwargs, token_logprobs, logits_temperature)

    lm.forward = forward
    return model


def _chunked_loss_forward(
    lm, labels: torch.Tensor, chunk_tokens: int, args, kwargs, token_logprobs: bool = False, temperature: float = 1.0
) -> TokenLoss:
    import sys

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    router = bool(kwargs.pop("output_router_logits", False))
    for key in ("use_cache", "logits_to_keep", "return_dict"):
        kwargs.pop(key, None)
    decoder = getattr(lm, lm.base_model_prefix)
    out = decoder(*args, use_cache=False, **({"output_router_logits": True} if router else {}), **kwargs)
    hidden = out.last_hidden_state
    head = lm.get_output_embeddings()
    transform = _logits_transform(lm, temperature)

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # each token's loss (the preference objectives sum them per completion), or the chunk's sum
        return F.cross_entropy(transform(head(h)).float(), y, reduction="none" if token_logprobs else "sum")

    width = hidden.shape[-1]
    # position t predicts label t+1, as `token_loss_sum` shifts (labels one column longer: a sequence-parallel slice)
    h = hidden[:, : labels.shape[1] - 1].reshape(-1, width)
    y = labels[:, 1:].reshape(-1)
    if not y.is_meta:  # (the planner's meta tensors have no values: every token counts there)
        keep = (y != -100).nonzero().squeeze(1)
        h, y = h.index_select(0, keep), y.index_select(0, keep)
    n = int(y.shape[0])
    per_token = None
    if n == 0:  # nothing to count: a zero through the output layer, so that its parameters still get gradients
        loss_sum = head(hidden[:, :1].reshape(-1, width)).float().sum() * 0.0
        per_token = loss_sum.reshape(1)[:0] if token_logprobs else None
    elif type(head) is torch.nn.Linear:
        losses = _head_losses(head, h, y, chunk_tokens, transform, token_logprobs)
        per_token = -losses if token_logprobs else None
        loss_sum = losses.sum() if token_logprobs else losses
    else:  # an output layer with adapters of its own (LoRA on lm_head): each chunk through the module, checkpointed
        parts = []
        for start in range(0, n, chunk_tokens):
            hc, yc = h[start : start + chunk_tokens], y[start : start + chunk_tokens]
            grad = torch.is_grad_enabled() and (hc.requires_grad or any(p.requires_grad for p in head.parameters()))
            parts.append(checkpoint(chunk_loss, hc, yc, use_reentrant=False) if grad else chunk_loss(hc, yc))
        if token_logprobs:
            per_token = -torch.cat(parts)
            loss_sum = -per_token.sum()
        else:
            loss_sum = torch.stack(parts).sum()
    aux = None
    if router:
        balance = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
        if balance is None:
            raise PylonError(
                f"loss_chunk_tokens: {type(lm).__name__} has no load_balancing_loss_func beside it; set "
                "loss_chunk_tokens: 0 for this mixture-of-experts model"
            )
        aux = balance(out.router_logits, lm.num_experts, lm.num_experts_per_tok, kwargs.get("attention_mask"))
    return TokenLoss(loss_sum, n, aux, per_token)


def _head_losses(head, h, y, chunk_tokens: int, transform, per_token: bool) -> torch.Tensor:
    """The cross-entropy of `h` [n, width] through the output layer `head` (an `nn.Linear`) and `transform` against
    `y` [n], `chunk_tokens` rows at a time: each token's ([n]) or their sum (a scalar). The chunks run inside one
    call of `head`, so that ZeRO-3 gathers its weight once for the forward pass and once for the backward, however
    many chunks there are. Called a chunk at a time instead, the layer is gathered again for each chunk's forward,
    recomputation and backward whenever the chunk count changes between micro-batches (it does: it follows the
    tokens the labels count), since every change invalidates the trace DeepSpeed keeps gathered parameters by."""
    original = head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _ChunkedHeadLoss.apply(x, head.weight, head.bias, y, chunk_tokens, transform, per_token)

    head.forward = forward
    try:
        return head(h)
    finally:
        head.forward = original


def _chunk_losses(logits, y, transform, per_token: bool) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(transform(logits).float(), y, reduction="none" if per_token else "sum")


class _ChunkedHeadLoss(torch.autograd.Function):
    """`_head_losses`' pass: the forward keeps no chunk's logits; the backward computes each chunk's again and the
    gradients from them, the output layer's added in place into one tensor (`addmm_` from the logits' gradient, as
    `F.linear`'s backward computes it), so that no chunk's weight gradient exists beside it."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk_tokens, transform, per_token):
        import torch.nn.functional as F

        ctx.save_for_backward(h, weight, bias, y)
        ctx.chunk_tokens, ctx.transform, ctx.per_token = chunk_tokens, transform, per_token
        parts = []
        for s in range(0, int(y.shape[0]), chunk_tokens):
            logits = F.linear(h[s : s + chunk_tokens], weight, bias)
            parts.append(_chunk_losses(logits, y[s : s + chunk_tokens], transform, per_token))
        return torch.cat(parts) if per_token else torch.stack(parts).sum()

    @staticmethod
    def backward(ctx, grad):
        import torch.nn.functional as F

        h, weight, bias, y = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None  # in the weight's dtype, as autograd sums a layer's uses
        grad_b = torch.zeros_like(bias) if want_b else None
        step = ctx.chunk_tokens
        for s in range(0, int(y.shape[0]), step):
            hc = h[s : s + step].detach()

            @torch.no_grad()
            def layer_grads(dlogits: torch.Tensor, hc: torch.Tensor = hc) -> None:
                if want_w:
                    grad_w.addmm_(dlogits.t(), hc)
                if want_b:
                    grad_b.add_(dlogits.sum(0))

            with torch.enable_grad():
                x = hc.requires_grad_()  # a view: no copy
                logits = F.linear(x, weight.detach(), bias.detach() if bias is not None else None)
                if want_w or want_b:
                    logits.register_hook(layer_grads)
                loss = _chunk_losses(logits, y[s : s + step], ctx.transform, ctx.per_token)
                del logits  # freed as soon as the loss no longer needs it (as in the forward pass)
                (dx,) = torch.autograd.grad(loss, x, grad[s : s + step] if ctx.per_token else grad)
            if want_h:
                grad_h[s : s + step] = dx
        return grad_h, grad_w, grad_b, None, None, None, None


def _logits_transform(lm, temperature: float = 1.0):
    """What a causal LM does to its output layer's result before the loss, read from its config: Gemma 2/3's final
    soft-capping, Cohere's `logit_scale` (times), Granite's `logits_scaling` (divided by); identity otherwise. Then
    divided by `temperature` (a sampling temperature: the distribution sampled from)."""
    config = lm.config
    cap = getattr(config, "final_logit_softcapping", None)
    times = getattr(lm, "logit_scale", None) if isinstance(getattr(lm, "logit_scale", None), float | int) else None
    divide = getattr(config, "logits_scaling", None)

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if times is not None:
            logits = logits * times
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if temperature != 1.0:
            logits = logits / temperature
        return logits

    return transform


def with_lora(model: "PreTrainedModel", lora: LoraSpec) -> torch.nn.Module:
    """`model` as a peft model whose only trainable parameters are the LoRA adapters `lora` describes."""
    from peft import LoraConfig, get_peft_model

    matched = lora_targets(model, lora)
    # GPT-2's Conv1D stores weights as (in, out); peft must be told, or it warns and guesses.
    fan_in_fan_out = any(type(model.get_submodule(n)).__name__ == "Conv1D" for names in matched.values() for n in names)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        fan_in_fan_out=fan_in_fan_out,
        # a classifier (objective reward): peft trains its new head whole beside the adapters (modules_to_save)
        task_type="SEQ_CLS" if is_classifier(model.config) else "CAUSAL_LM",
    )
    return get_peft_model(model, config)


def lora_targets(model: torch.nn.Module, lora: LoraSpec) -> dict[str, list[str]]:
    """For each of `lora.target_modules`, the dotted names of the modules it adapts (PylonError if none)."""
    layers = lora_layer_names(model)
    # peft matches a target against the last components of a module's dotted name.
    matched = {t: [n for n in layers if n == t or n.endswith("." + t)] for t in lora.target_modules}
    missing = [t for t, names in matched.items() if not names]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in layers})
        raise PylonError(
            f"lora.target_modules: {', '.join(missing)} not found in this {model.config.model_type} model; "
            f"its linear modules are: {', '.join(short)}"
        )
    return matched


def lora_layer_names(model: torch.nn.Module) -> list[str]:
    """Dotted names of the modules LoRA can adapt (Linear and GPT-2's Conv1D)."""
    return [name for name, module in model.named_modules() if name and type(module).__name__ in _LORA_LAYER_TYPES]


def export_lora(model: torch.nn.Module, out_dir: str | os.PathLike, merge: bool) -> None:
    """Write a LoRA model to the local directory `out_dir`.

    merge=True: the adapters are folded into the base weights and a plain `transformers` model is written
    (safetensors + config), loadable with `AutoModelForCausalLM.from_pretrained`. This changes `model` in
    place (it is the base model afterwards), so pass a model that is done training.
    merge=False: only the adapters are written, in peft's format (`adapter_config.json`,
    `adapter_model.safetensors`), for `PeftModel.from_pretrained(base, out_dir)`.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise PylonError(f"export_lora: expected a LoRA (peft) model, got {type(model).__name__}")
    os.makedirs(out_dir, exist_ok=True)
    if merge:
        merged = model.merge_and_unload()
        merged.config.use_cache = True  # training turns the cache off (gradient checkpointing); serving wants it
        merged.save_pretrained(out_dir, safe_serialization=True)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


@contextlib.contextmanager
def local_model_dir(uri: str, *, weights: bool = True) -> Iterator[str]:
    """A local directory holding the model directory `uri`: the path itself when local, else a private copy
    (removed on exit), since `transformers` reads only local files. A PylonError raised inside about a file of the
    copy names `uri` instead (without credentials). `weights=False`: the copy leaves out the weight files (what a
    tokenizer alone needs: its files and the config)."""
    try:
        fs, path = storage.resolve(uri)
        is_dir = fs.isdir(path)
    except StorageError as e:
        raise PylonError(f"model.path {uri}: {e}") from None
    except Exception as e:  # fsspec/botocore errors while looking
        raise PylonError(f"model.path {storage.describe(uri)}: cannot be read ({type(e).__name__}: {e})") from None
    if not is_dir:
        raise PylonError(f"model.path {uri}: no such directory (expected a Hugging Face model directory)")
    if isinstance(fs, LocalFileSystem):
        yield path
        return
    tmp = tempfile.mkdtemp(prefix="pylon-model-")
    try:
        try:
            if weights:
                fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
            else:
                root = path.rstrip("/")
                for name in fs.find(root):
                    rel = name[len(root) :].lstrip("/")
                    if rel and not rel.endswith(WEIGHT_SUFFIXES):
                        os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
                        fs.get(name, os.path.join(tmp, rel))
        except Exception as e:  # fsspec/botocore errors while copying
            raise PylonError(
                f"model.path {storage.describe(uri)}: cannot be copied ({type(e).__name__}: {e})"
            ) from None
        try:
            yield tmp
        except PylonError as e:  # about a file of the copy, gone when this returns: name the model as given
            raise PylonError(str(e).replace(tmp, storage.describe(uri))) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Sizes and FLOPs (for MFU)
# ---------------------------------------------------------------------------------------------------------


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters). Under ZeRO-3 a parameter's local tensor is a partition (often
    empty); DeepSpeed records the full size in `ds_numel`."""
    total = trainable = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def flops_per_token(config: "PretrainedConfig", seq_len: int) -> float:
    """Model FLOPs to train on one token (forward + backward): 6·N + 12·n_layer·d_model·seq_len.

    This is the PaLM estimate (Chowdhery et al. 2022, appendix B; Chinchilla's 6N plus attention): each weight
    in a matmul costs 2 FLOPs per token forward and 4 backward (6N), and attention's QKᵀ and AV add
    2·2·n_layer·seq_len·d_model forward, times 3 with the backward. N counts the parameters that take part
    in a matmul per token: every parameter except the input embedding tables (token and position lookups
    cost no FLOPs), with the output projection counted once whether or not it is tied to the token embedding
    (it is a d_model x vocab matmul either way) -- nanoGPT's convention. Recomputation for gradient
    checkpointing is deliberately not counted: MFU measures useful model FLOPs.
    """
    from transformers import AutoModelForCausalLM

    # Count on the meta device: exact for any architecture, with no memory even for 7B/13B shapes.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_matmul = _matmul_parameters(model)
    return 6.0 * n_matmul + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def _matmul_parameters(model: torch.nn.Module) -> int:
    """The parameters in a matmul per token (see `flops_per_token`). A mixture-of-experts layer's experts count as
    the share a token runs, top_k of num_experts (`expert_parameters`): Mixtral 8x7B's 46.7B parameters are 12.9B
    active, the figure its FLOPs and MFU are reported in."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    if output is not None and id(output.weight) in embeddings:  # tied: the lm_head matmul still happens
        total += output.weight.numel()
    experts, share = expert_parameters(model)
    return total - round(experts * (1 - share))


def router_aux_coef(config) -> float:
    """The weight of a mixture-of-experts model's load-balancing loss in its training objective: its config's
    `router_aux_loss_coef` (Mixtral's and Qwen MoE's 0.001; set `model.config.router_aux_loss_coef: 0` to train
    without it), as transformers adds it to the loss (Switch Transformer's auxiliary loss over every sparse layer's
    router); 0.0 for a dense model."""
    if not getattr(config, "num_experts_per_tok", None):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def expert_parameters(model: torch.nn.Module) -> tuple[int, float]:
    """A mixture-of-experts model's expert weights (transformers' 3-D `experts.gate_up_proj` and `down_proj`: every
    expert of every sparse layer) and the share of them one token runs (num_experts_per_tok / num_experts); (0, 1.0)
    for a dense model. A shared expert (Qwen2-MoE's) is dense: every token runs it."""
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not top_k or not num_experts:
        return 0, 1.0
    n = sum(p.numel() for p in expert_weights(model))
    return (n, top_k / num_experts) if n else (0, 1.0)


def expert_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every sparse layer's expert weights: transformers' 3-D `<layer>.experts.gate_up_proj` / `down_proj`."""
    return [p for name, p in model.named_parameters() if p.dim() == 3 and name.rsplit(".", 2)[-2] == "experts"]


def measure_matmul_peak_flops(
    seconds: float = 1.0,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
) -> float:
    """FLOP/s of large square matmuls on `device`: the "measured peak" MFU is taken against.

    On CPU there is no datasheet number to trust (it depends on the cores, the threads torch uses and what
    else runs), so MFU here is model FLOPs per second over this measurement, taken in the same process with
    the same thread count. The best of several timed rounds is returned, which filters out interruptions.
    """
    device = torch.device(device)
    # Square matmuls of `size` (default: 1024 on CPU; 8192 on a GPU, whose tensor cores 1024 leaves launch-bound).
    size = size or (8192 if device.type == "cuda" else 1024)
    # A private generator: measuring must not move the global RNG that seeds models and data.
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    flops_per_matmul = 2.0 * size**3

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)  # warm-up: thread pools, kernels, caches
    sync()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        repeats = 0
        while repeats < 4 or time.perf_counter() - start < min(0.1, seconds / 4):
            torch.matmul(a, b)
            repeats += 1
        sync()
        elapsed = time.perf_counter() - start
        best = max(best, repeats * flops_per_matmul / elapsed)
        if time.perf_counter() >= deadline:
            return best
