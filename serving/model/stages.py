"""Pipeline stages of a model: which decoder layers each stage holds, and a causal LM loaded with only its own.

A model larger than one machine's memory is served by `engine.pipeline_parallel` stages, each a process (on its own
node where the placement spreads them) that holds a contiguous run of the decoder layers and their KV cache (vLLM's
pipeline parallelism; the engine's side: pylon.serving.engine.pipeline). The first stage, the engine's own process,
holds the embeddings and the head too (the final norm and the lm_head, one matrix with the embeddings where they are
tied): the last stage hands back the sampling rows' hidden states, `[rows, hidden]`, and the engine computes their
logits where it samples, instead of `[rows, vocabulary]` floats crossing the network every step.

A stage never holds the other stages' weights, not even for a moment: the model is built on the meta device as
`from_pretrained` builds it, what other stages hold replaced by an empty placeholder before any weight is read, so
their tensors are never read from the checkpoint (transformers' loader skips the keys the model does not have), and
every conversion `from_pretrained` makes at load (fused experts, renamed keys) is made for what is kept exactly as for
a whole model. Nor does a stage copy them: from object storage its node fetches the stage's own tensors alone, by
byte range (`stage_model_dir`, pylon.weight_subset).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pylon.errors import PylonError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`: its decoder layers `layers` (a contiguous range of the model's); the first holds the
    embeddings and the head (final norm, lm_head) besides."""

    index: int
    count: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    def describe(self) -> str:
        return f"stage {self.index + 1} of {self.count} (layers {self.layers.start}-{self.layers.stop - 1})"


def split_layers(num_layers: int, count: int) -> list[range]:
    """The decoder layers of each of `count` stages: as even as the count allows, the layers left over going to
    the last stages (the first holds the embeddings and the lm_head besides, so it takes no extra layer while
    another can)."""
    if not 1 <= count <= num_layers:
        raise PylonError(
            f"engine.pipeline_parallel: {count} stages for a model of {num_layers} decoder layers; each stage holds "
            f"at least one layer (use at most {num_layers})"
        )
    sizes = [num_layers // count] * count
    for k in range(num_layers % count):
        sizes[-1 - k] += 1
    starts = [sum(sizes[:k]) for k in range(count)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_of(num_layers: int, index: int, count: int) -> Stage:
    return Stage(index, count, split_layers(num_layers, count)[index])


class Elsewhere(torch.nn.Module):
    """A decoder layer (or the embeddings, or the final norm and lm_head) that another pipeline stage holds: no
    weights, and never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage ran a layer another stage holds")


def owned(layer: torch.nn.Module) -> bool:
    return not isinstance(layer, Elsewhere)


def _prune(model: torch.nn.Module, stage: Stage) -> None:
    """Replace what `stage` does not hold by placeholders (before the weights load): other stages' layers; the
    embeddings and the head but on the first stage (a tied lm_head is then tied within it)."""
    inner = model.model
    for i in range(len(inner.layers)):
        if i not in stage.layers:
            inner.layers[i] = Elsewhere()
    if not stage.first:
        inner.embed_tokens = Elsewhere()
        inner.norm = Elsewhere()
        model.lm_head = Elsewhere()
        model.all_tied_weights_keys = {}


def _no_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report lists every checkpoint key of the other stages as unexpected: not logged (the
    stage checks what it loaded itself, `load_stage`)."""
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(_no_load_report)
    try:
        yield
    finally:
        logger.removeFilter(_no_load_report)


def stage_class(config, stage: Stage) -> type:
    """The class `AutoModelForCausalLM` would build for `config`, subclassed so that its construction ends with the
    placeholders of what `stage` does not hold (`_prune`): built on the meta device, loaded, or a tensor-parallel
    shard of it built (pylon.serving.model.tensor's `load_shard`), it never holds another stage's weights."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    base = _get_model_class(config, AutoModelForCausalLM._model_mapping)

    class StageModel(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            _prune(self, stage)

    # Named as its class, and of its module: the runner reads the family's own functions from the model's module
    # (`apply_rotary_pos_emb`: GPT-OSS's, Cohere's...).
    StageModel.__name__ = StageModel.__qualname__ = base.__name__
    StageModel.__module__ = base.__module__
    return StageModel


def load_stage(model_dir: str, config, dtype: torch.dtype, stage: Stage, multimodal: bool = False) -> torch.nn.Module:
    """The causal LM of `model_dir` (its config `config`) holding only what `stage` holds, in `dtype`, on the CPU:
    `stage_class`, then `from_pretrained` as usual. A weight of the stage's own missing from the checkpoint is a
    PylonError naming it (transformers would initialise it at random). `multimodal`: the checkpoint is a multimodal
    one (`config` its text model's), whose language model's tensors are read under their prefix, the vision model's
    never."""
    from pylon.serving.model.stored import checkpoint_quantization
    from pylon.serving.model.tensor import Shard, load_shard

    StageModel = stage_class(config, stage)
    # a quantized checkpoint: read dequantized (model/stored.py); a multimodal one: its text's tensors by name
    if multimodal or checkpoint_quantization(config) is not None:
        return load_shard(model_dir, config, dtype, Shard(0, 1), cls=StageModel)
    with _quiet_transformers():
        model, info = StageModel.from_pretrained(
            model_dir, config=config, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise PylonError(
            f"model {model_dir}: {stage.describe()}: {len(missing)} of its weights are not in the checkpoint "
            f"({', '.join(missing[:3])}); the checkpoint is incomplete"
        )
    return model


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def holds(stage: Stage, multimodal: bool = False) -> Callable[[str], bool]:
    """Whether a checkpoint's tensor (by its name) is `stage`'s: its layers' (`...layers.<i>.`); on the first stage
    everything outside the decoder layers besides (embeddings, final norm, lm_head). What loading the stage would
    not read anyway is never copied (`stage_model_dir`); a tensor of its own that this leaves out would be a missing
    weight, which `load_stage` refuses by name. `multimodal`: of a multimodal checkpoint, the language model's
    tensors only (under its prefixes), never the vision model's."""
    from pylon.serving.model.tensor import language_model_tensor

    def held(name: str) -> bool:
        if multimodal and not language_model_tensor(name):
            return False
        found = _LAYER_KEY.search(name)
        if found is None:
            return stage.first
        return int(found.group(1)) in stage.layers

    return held


@contextlib.contextmanager
def stage_model_dir(uri: str, index: int, count: int) -> Iterator[tuple[str, Stage, int | None]]:
    """A local directory holding what stage `index` of `count` of the model directory `uri` loads, the stage, and
    the bytes of weights read from object storage (None: a local directory):
    from object storage, its files but the weights, and of the weights the stage's tensors only, read by byte range
    (pylon.weight_subset: a stage's node copies its share of the checkpoint, not all of it); a local directory as it
    is (its files are read where they are, the stage's tensors only)."""
    from fsspec.implementations.local import LocalFileSystem
    from transformers import AutoConfig

    from pylon import storage
    from pylon.models import local_model_dir
    from pylon.serving.model.families import TEXT_MODELS
    from pylon.weight_subset import copy_tensors

    with local_model_dir(uri, weights=False) as directory:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        stage = stage_of(config.get_text_config().num_hidden_layers, index, count)
        if not isinstance(storage.resolve(uri)[0], LocalFileSystem):  # a private copy: the stage's tensors to fetch
            started = time.monotonic()
            copied = copy_tensors(uri, directory, holds(stage, config.model_type in TEXT_MODELS))
            log.info(
                "%s: copied %s from %s in %.1f s",
                stage.describe(),
                copied.describe(),
                storage.describe(uri),
                time.monotonic() - started,
            )
            yield directory, stage, copied.read
        else:
            yield directory, stage, None


def stage_bytes(model: torch.nn.Module) -> int:
    """The bytes of a stage's weights and buffers (each tensor once: a tied lm_head is the embedding's)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def refused(model_type: str, config, multimodal: str | None = None) -> str | None:
    """Why a model (its text model's type and config) cannot be split into pipeline stages (None: it can): the
    families with forwards of their own (GPT-2, OPT, GPT-NeoX), multimodal checkpoints but those split for their
    text (`multimodal`: the checkpoint's type; pylon.serving.model.tensor.SPLIT_MULTIMODAL), classifiers and models
    with recurrent layers, whose state the stages do not carry."""
    from pylon.serving.model.families import is_sequence_classifier
    from pylon.serving.model.tensor import SPLIT_MULTIMODAL

    if model_type in ("gpt2", "opt", "gpt_neox"):
        return f"a {model_type} model is not split into stages (the Llama-like families are: Llama, Qwen, Mistral, ...)"
    if multimodal is not None and multimodal not in SPLIT_MULTIMODAL:
        return f"a {multimodal} multimodal checkpoint is not split into stages; serve its text model"
    if is_sequence_classifier(config):
        return "a classifier is not split into stages"
    return None


def weight_sizes(config) -> tuple[list[int], int]:
    """The weights (parameters and persistent buffers, such as a router's correction bias) of each decoder layer of
    `config`'s causal LM, and of the rest (embeddings, final norm and lm_head: one matrix where tied), counted on the
    meta device (any size)."""
    from pylon.serving.model.families import causal_lm_from_config

    with torch.device("meta"):  # (a multimodal checkpoint's: its text model's, what its stages hold)
        model = causal_lm_from_config(config.get_text_config())
    sizes = {name: t.numel() for name, t in model.state_dict(keep_vars=True).items()}
    layers = [0] * len(model.model.layers)
    rest = 0
    for name, n in sizes.items():
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += n
        elif name.startswith(("model.embed_tokens.", "model.norm.")):
            rest += n
    if not getattr(config, "tie_word_embeddings", False):
        rest += sizes["lm_head.weight"]
    return layers, rest


def stage_parameters(config, count: int, sizes: tuple[list[int], int] | None = None) -> list[int]:
    """The weights each of `count` stages of `config`'s causal LM holds: its layers', and the first stage's
    embeddings, final norm and lm_head. `sizes`: `weight_sizes(config)`, where already counted."""
    layers, rest = sizes if sizes is not None else weight_sizes(config)
    counts = [sum(layers[i] for i in span) for span in split_layers(len(layers), count)]
    counts[0] += rest
    return counts
