"""Executes one scheduled step: a Hugging Face causal LM's own weights and submodules, our paged attention.

The forward pass is written out per model family (GPT-2; Llama and the families built as it is: Mistral, Qwen2 and
Qwen2.5, Qwen3 with its per-head query and key norms, Gemma 3 with those and its norms of the attention's and the MLP's
outputs and a rotary embedding per layer type, Phi-3 and Phi-4 with their fused projections and partial rotary
embedding; see `pylon.serving.model.families`), calling the loaded model's embeddings, norms, projections, rotary
embedding, MLPs and lm_head; only attention is ours (`pylon.serving.model.attention`), because it must read and write
the paged KV cache. All tokens of a step run as one flat batch `[T, hidden]` (with oneDNN projections, a step with a
prompt chunk pads T to one of a few row counts; see `linear.py`).
Logits are computed only for each sampling sequence's last token: a prompt chunk that does not finish its
prompt needs none, and the other positions of a prefill never need any, unless the sequence asks for them
(`StepSequence.prompt_logits`: a request that wants its prompt's log-probabilities).

The runner owns the KV tensors, one K and one V per layer, `[num_blocks, block_size, kv_heads, head_dim]`;
which blocks belong to whom is `KVBlockPool`'s business.

LoRA adapters (`adapters`: peft's saved adapter directories; `pylon.serving.model.lora`) are served per sequence
(`StepSequence.adapter`), many at once on the one base model: the base weights stay as loaded, and after each
projection the step's rows of each adapter get that adapter's low-rank delta. A step whose sequences all run the base
model computes exactly what it would without adapters; only such steps replay CUDA decode graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek_v3
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pylon.errors import PylonError
from pylon.serving.model import eagle as eagle_head
from pylon.serving.model import kernels, linear, lora, moe, quant, stages
from pylon.serving.model import mtp as mtp_layer
from pylon.serving.model import tensor as shards
from pylon.serving.model.attention import (
    AttentionMetadata,
    Final,
    HostStage,
    SequenceSlice,
    Workspace,
    build_metadata,
    final_metadata,
    new_kv_cache,
    paged_attention,
    prompt_attention_backends,
    store_kv_pair,
    tree_positions,
)
from pylon.serving.model.families import (
    FP16_UNSAFE,
    LINEAR_ATTENTION_FAMILIES,
    LLAMA_FAMILIES,
    MLA_FAMILIES,
    MOE_MODEL_TYPES,
    PARALLEL_FAMILIES,
    RENAMED_MODULES,
    SINK_FAMILIES,
    SUPPORTED_MODEL_TYPES,
    TEXT_MODELS,
    attention_softcap,
    causal_lm_from_config,
    is_sequence_classifier,
    kv_groups,
    layer_windows,
    linear_layers,
    position_limit,
    reshaped_at_load,
    rope_layer_types,
    unsupported,
)
from pylon.serving.model.graphs import DecodeGraphs
from pylon.serving.model.step import StepSequence
from pylon.serving.model.stored import checkpoint_quantization
from pylon.settings import switched_on

log = logging.getLogger(__name__)

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # GELU's tanh approximation, under its Hugging Face names
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}
WARM_UP_GFLOP = 20.0  # ModelRunner.warm_up's arithmetic at most: ~0.2 s on a core


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PylonError("engine.device: 'cuda', but torch sees no CUDA device here; use 'cpu' or 'auto'")
    if device not in ("cpu", "cuda"):
        raise PylonError(f"engine.device: must be one of auto, cpu, cuda (got {device!r})")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # fp32 on CPU (fp16/bf16 matmuls are slow or missing there); half precision on GPU
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise PylonError(f"engine.dtype: must be one of auto, {', '.join(DTYPES)} (got {dtype!r})")
    return DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """How the KV cache stores keys and values: `auto` as the model computes (`dtype`)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise PylonError(f"engine.kv_cache_dtype: must be one of auto, {', '.join(KV_DTYPES)} (got {kv_cache_dtype!r})")
    return KV_DTYPES[kv_cache_dtype]


def weights_failure(model_dir: str, error: Exception) -> str:
    """What is wrong with `model_dir`'s weights, given the error loading them raised: the first safetensors file
    whose header or tensors cannot be read is named (transformers' own message names neither the file nor the
    directory), else the directory with the error."""
    from safetensors import safe_open

    listing = os.listdir(model_dir)
    files = sorted(f for f in listing if f.endswith(".safetensors"))
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    f.get_slice(key)  # each tensor's extent within the file
        except Exception as e:
            return (
                f"model {model_dir}: weights file {name} is damaged ({type(e).__name__}: {e}); copy it again "
                "or export the model again (`pylon export`)"
            )
    if not files and not any(f.endswith(".bin") for f in listing):
        return (
            f"model {model_dir}: has no weights (no *.safetensors or pytorch_model.bin file); point `model` at "
            "a `pylon export` output or a saved transformers model"
        )
    return f"model {model_dir}: its weights cannot be loaded ({type(error).__name__}: {str(error)[:500]})"


def _language_model(model_dir: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A multimodal checkpoint's language model as the causal LM of its family (families.TEXT_MODELS: Gemma 3's
    Gemma3ForConditionalGeneration, Mistral 3's Mistral3ForConditionalGeneration), and the conditional model's inner
    model, which holds its vision tower and projector (`get_image_features`): the conditional model loaded as it
    ships (the hub's layout: `language_model.model.*`), then its text model and lm_head (tied to the embeddings or
    not, as loaded) put in the causal LM of its text config (Gemma3ForCausalLM, MistralForCausalLM), whose forward is
    the conditional model's on text; Llama 4's conditional model holds its causal LM whole (`language_model`). The
    caller keeps the vision part for images, or drops it."""
    from transformers import AutoModelForImageTextToText

    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    inner = getattr(full, "language_model", None)
    if inner is not None and hasattr(inner, "lm_head"):  # Llama 4's holds a whole causal LM (Llama4ForCausalLM)
        inner.generation_config = full.generation_config
        del full.language_model
        return inner, full
    with torch.device("meta"):  # a shell: both of its parts are replaced by the loaded ones
        causal = causal_lm_from_config(full.config.get_text_config())
    causal.model, causal.lm_head = full.model.language_model, full.lm_head
    causal.generation_config = full.generation_config
    vision = full.model
    del vision.language_model  # the causal LM's now: one copy, not registered twice
    return causal, vision


def _sequence_classifier(model_dir: str, config, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A `*ForSequenceClassification` checkpoint (a reward model, a cross-encoder, a classifier) as the causal LM of its
    family, which the runner's forward calls, and its classification head (`score`: hidden -> num_labels): the
    classifier loaded as it ships (transformers' AutoModelForSequenceClassification), then its base model put in the
    causal LM of its config (the same module names: `model`, GPT-2's `transformer`, GPT-NeoX's `gpt_neox`). The causal
    LM's output embeddings are the head too (a module on the device, never called for a token: the engine takes no
    generating request for a classifier)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        classifier = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    except ValueError as e:  # a family transformers has no sequence-classification class for
        raise PylonError(f"model {model_dir}: its classifier cannot be loaded ({str(e)[:300]})") from None
    with torch.device("meta"):  # a shell: its base model and head are replaced by the loaded ones
        causal = AutoModelForCausalLM.from_config(config)
    prefix = classifier.base_model_prefix
    setattr(causal, prefix, getattr(classifier, prefix))
    causal.set_output_embeddings(classifier.score)
    left = [name for name, p in causal.named_parameters() if p.is_meta]
    if left:
        raise PylonError(f"model {model_dir}: its classifier's layout is not its causal LM's (not loaded: {left[0]})")
    return causal, classifier.score


def _token_classifier(rows: torch.Tensor) -> torch.nn.Module:
    """A classification head made of the lm_head's rows of engine.classifier_from_token's ids, `rows` (vLLM's
    `classifier_from_token`, for rerankers trained as language models: Qwen3-Reranker answers "yes" or "no"): one id,
    its logit; two ids `[no, yes]`, the difference of their logits, whose sigmoid is P(yes) / (P(yes) + P(no)), what
    such a reranker's card computes."""
    head = torch.nn.Linear(rows.shape[1], 1, bias=False, device=rows.device, dtype=rows.dtype)
    head.weight.data.copy_(rows[-1:] - rows[:1] if len(rows) == 2 else rows)
    return head


def _sharded_classifier(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """A `*ForSequenceClassification` checkpoint's head (`score`: hidden -> labels), whole, for a tensor-parallel
    shard of it (each shard's pooled rows are whole after the layers' all-reduces)."""
    found = shards.whole_tensors(model_dir, ["score.weight", "score.bias"])
    if "score.weight" not in found:
        raise PylonError(
            f"model {model_dir}: its classifier's head is not score.weight, the head engine.tensor_parallel reads for "
            "a classifier (Llama's, Qwen's, Mistral's, Gemma's ...ForSequenceClassification)"
        )
    weight = found["score.weight"]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias="score.bias" in found, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(found["score.bias"])
    return head


def model_type_of(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise PylonError(f"model {model_dir}: not a Hugging Face model directory (config.json: {e})") from None


def _mrope_rows(steps: list[StepSequence], positions: list[int], stage) -> torch.Tensor:
    """M-RoPE's rotary positions `[3, rows]` of a step's rows (`positions`, padded rows included): a sequence's with
    `mrope` (its table `[3, p]` and offset: pylon.serving.engine.images.mrope_positions) by its table below p and
    position + offset from p on; every other row's three its position. A decode (or draft) past its prompt's images
    costs an addition a row; a prompt chunk reaching into them, a gather from its table."""
    streams: list[list[int]] = [[], [], []]
    row = 0
    for s in steps:
        n = s.num_new_tokens
        at = positions[row : row + n]
        row += n
        if s.mrope is None:
            for stream in streams:
                stream.extend(at)
            continue
        table, offset = s.mrope
        if min(at) >= table.shape[1]:  # past the last image (trees' rows too: any order)
            shifted = [q + offset for q in at]
            for stream in streams:
                stream.extend(shifted)
            continue
        where = torch.tensor(at)
        part = (where + offset).expand(3, -1).clone()
        inside = where < table.shape[1]
        part[:, inside] = table[:, where[inside]]
        for stream, values in zip(streams, part.tolist()):
            stream.extend(values)
    rest = positions[row:]  # (padded rows)
    for stream in streams:
        stream.extend(rest)
    return stage.add(streams[0] + streams[1] + streams[2]).view(3, -1)


def _gpt2_activation(name: str) -> Callable:
    """GPT-2's MLP activation. Its default, "gelu_new", is the tanh approximation of GELU written out in
    Python as five tensor ops (transformers' NewGELUActivation); torch's fused `gelu(approximate="tanh")` is
    the same function in one op (results within 3e-7) and took the activation from 8% of a step to 3%."""
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    if name in TANH_GELUS:
        return lambda x: F.gelu(x, approximate="tanh")
    return ACT2FN[name]


@dataclass(frozen=True)
class _GPT2Layer:
    ln_1: tuple  # (normalized_shape, weight, bias, eps): F.layer_norm's arguments after the input
    qkv_w: torch.Tensor  # Conv1D weights are [in, out]: y = addmm(b, x, w)
    qkv_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    ln_2: tuple
    fc_w: torch.Tensor
    fc_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class _GPT2Weights:
    wte: torch.Tensor
    wpe: torch.Tensor
    layers: list[_GPT2Layer]
    ln_f: tuple

    @classmethod
    def of(cls, model, *, packed: bool = False, quantization: str = "none") -> "_GPT2Weights":
        """The model's weights; `packed`: the projections reordered for oneDNN (`pylon.serving.model.linear`), or
        `quantization` (int8, fp8, int4): quantized (`pylon.serving.model.quant`), and either way the modules' own
        copies released (the runner never calls those modules)."""
        gpt = model.transformer

        def ln(m):
            return (m.normalized_shape, m.weight, m.bias, m.eps)

        def w(conv):
            if quantization != "none":
                converted = quant.QuantWeight(conv.weight.detach().t(), quantization)
            elif packed:
                converted = linear.pack(conv.weight.detach().t())
            else:
                return conv.weight
            conv.weight = None
            return converted

        layers = [
            _GPT2Layer(
                ln(b.ln_1),
                w(b.attn.c_attn),
                b.attn.c_attn.bias,
                w(b.attn.c_proj),
                b.attn.c_proj.bias,
                ln(b.ln_2),
                w(b.mlp.c_fc),
                b.mlp.c_fc.bias,
                w(b.mlp.c_proj),
                b.mlp.c_proj.bias,
                b.attn.num_heads,
                b.attn.head_dim,
                b.attn.scaling,
            )
            for b in gpt.h
        ]
        return cls(gpt.wte.weight, gpt.wpe.weight, layers, ln(gpt.ln_f))


_GPT2_PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # `_GPT2Layer`'s four, in its order


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise PylonError(
            f"weight {name}: shape {list(tensor.shape)}, but the engine's model has {list(shape)}; give the weights "
            "of the model it was loaded from"
        )


def _decoder_layers(model) -> torch.nn.ModuleList:
    """A Llama-like causal LM's decoder layers (`model.layers`), OPT's (`model.decoder.layers`) or GPT-NeoX's
    (`gpt_neox.layers`)."""
    if hasattr(model, "gpt_neox"):
        return model.gpt_neox.layers
    inner = model.model
    return inner.decoder.layers if hasattr(inner, "decoder") else inner.layers


def _pack_llama(model, quantization: str = "none", group: int | None = None) -> None:
    """Every projection of every decoder layer as a `PackedLinear`, or with `quantization` (int8, fp8, int4: in
    `group`s where given) a `QuantLinear` (lm_head, tied to the embeddings or not, stays); OPT's MLP projections are
    its layers' own."""
    for layer in filter(stages.owned, _decoder_layers(model)):
        # An MoE layer's experts are its SparseMoE's own (pylon.serving.model.moe); its shared expert is a module here.
        mlp = getattr(layer, "mlp", layer)  # (OPT: fc1 and fc2 on the layer itself)
        # (GPT-NeoX: `attention`; Qwen3-Next's recurrent layers: `linear_attn`)
        attention = getattr(layer, "attention", None) or getattr(layer, "self_attn", None) or layer.linear_attn
        for parent in (attention, mlp, getattr(mlp, "shared", None)):
            if parent is None:
                continue
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    if quantization != "none":
                        setattr(parent, name, quant.QuantLinear(child, quantization, group))
                    else:
                        setattr(parent, name, linear.PackedLinear(child))


def mapped_tensor(directory: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of `shape` held in a file under `directory` (mapped shared: what is written goes to the file,
    the OS keeping what it can in its page cache): the file's space reserved first, so that a full disk fails here,
    naming the directory, not as a SIGBUS mid-step; then the file deleted, so that nothing is left behind once the
    process ends (the mapping keeps it until then)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    where = f"engine.kv_offload_path {directory}"
    if not os.path.isdir(directory):
        raise PylonError(f"{where}: not a directory on this node ({socket.gethostname()}): create it, or set another")
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix="pylon-kv-", suffix=".bin")
    except OSError as e:
        raise PylonError(f"{where}: cannot create a file there ({e.strerror})") from None
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            free = shutil.disk_usage(directory).free
            raise PylonError(
                f"{where}: cannot reserve {nbytes / 2**20:,.1f} MiB there ({e.strerror}; {free / 2**20:,.1f} MiB "
                "free): make room, or lower engine.kv_offload_tokens"
            ) from None
        mapped = torch.from_file(name, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(name)
    return mapped[:nbytes].view(dtype).view(shape)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage as integers of its element's width (a copy moves bits; fp8 has no index_copy_ kernel)."""
    return t.view(_BITS[t.element_size()])


def _rotate_complex(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, _sin=None, unsqueeze_dim: int = 1):
    """DeepSeek-V2's rotation (its `apply_rotary_emb`) of `q` and `k` (`[T, heads, dims]`): each interleaved pair of
    dimensions a complex number, times its position's complex frequency (`freqs` `[T, dims / 2]`), in float32."""
    f = freqs.unsqueeze(unsqueeze_dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * f).flatten(-2).type_as(x)

    return rotate(q), rotate(k)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        *,
        num_blocks: int,
        block_size: int,
        device: str = "auto",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str = "none",
        adapters: Sequence[str] = (),
        images: bool = False,
        classifier_from_token: Sequence[int] = (),
        stage: stages.Stage | None = None,
        shard: shards.Shard | None = None,
        mtp: "ModelRunner | None" = None,
        eagle: "eagle_head.Head | None" = None,
        hybrid_kv: tuple[int, int] | None = None,
    ):
        """`stage`: hold only that pipeline stage's decoder layers (and their KV cache), and the embeddings and the
        head (final norm, lm_head) where it is the first (pylon.serving.model.stages); its `execute_step` then takes
        the previous stage's hidden states and returns its own, and the first stage's `finish_step` turns the last
        stage's into the step's outputs.

        `shard`: hold only that tensor-parallel shard's heads and MLP slice of every layer (and its heads' KV cache;
        pylon.serving.model.tensor), its config the shard's (`config`: fewer heads, narrower MLP); every shard runs
        every step, in a torch.distributed group of them all (initialised by the caller), whose all-reduces make
        each layer's output whole. Both: that shard of that stage's layers (and of the embeddings and the head on the
        first stage), in a group of the stage's shards alone; each computes every step of its stage (and the first
        stage's shards every `finish_step`).

        `images`: keep a multimodal checkpoint's vision tower and projector, for requests with images
        (`embed_images`); without it they are dropped once loaded (`vision` is None). `classifier_from_token`: token
        ids whose lm_head rows make the classification head of a causal LM (`_token_classifier`).

        `mtp`: the runner of the model served; this one then holds its checkpoint's multi-token-prediction layer
        (pylon.serving.model.mtp) as a model of one layer sharing `mtp`'s embeddings and output layer. Its
        `execute_step` takes `hidden`, the model's final hidden states a row (the layer's input beside the next
        tokens), and returns the layer's output at the sampling rows, before the norm; `finish_step` (or
        `head_logits`) scores them.

        `eagle` (with `mtp`): hold that EAGLE head (pylon.serving.model.eagle, read from `model_dir`) in place of a
        multi-token-prediction layer, run as one is: `hidden` the model's final hidden states (EAGLE) or the three it
        reads (EAGLE-3: `keep_layers`), `head_logits` over the model's vocabulary."""
        from transformers import AutoConfig, AutoModelForCausalLM

        model_type = "llama" if eagle is not None else model_type_of(model_dir)  # (an EAGLE head's layers: Llama's)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise PylonError(
                f"model {model_dir}: model_type '{model_type}' is not supported by the serving "
                f"engine (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        config = eagle.config if eagle is not None else AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.full_config = config  # a multimodal checkpoint's whole config (its vision's too); else the model's
        # A multimodal checkpoint served for its text (families.TEXT_MODELS: Gemma 3 4B-27B, Mistral Small 3.1 and
        # 3.2): its language model's config and family from here on; its vision tower is dropped once loaded
        # (`_language_model`).
        multimodal = model_type in TEXT_MODELS
        if multimodal:
            config = config.get_text_config()
            if config.model_type not in LLAMA_FAMILIES:
                raise PylonError(
                    f"model {model_dir}: its language model's model_type '{config.model_type}' (text_config) is not "
                    f"one the serving engine runs (supported: {', '.join(LLAMA_FAMILIES)})"
                )
            model_type = config.model_type
        problem = unsupported(config)
        if problem is not None:
            raise PylonError(f"model {model_dir}: {problem}; the serving engine cannot serve it")
        # A quantized checkpoint (DeepSeek-V3's block FP8, compressed-tensors' FP8, INT8 and packed INT4: the "-FP8",
        # "-FP8-dynamic", "-W8A8", "-W4A16" releases): its weights read dequantized into the engine's dtype
        # (engine.quantization quantizes them per channel again), by the shards' reader (pylon.serving.model.stored:
        # any block, partial edge blocks too) where the family is one it splits; else a block FP8 one by transformers,
        # told to dequantize on every device (it would keep FP8 modules, which the engine does not run, on a GPU).
        self.stored = checkpoint_quantization(config)
        if self.stored is not None and model_type not in shards.SPLIT_FAMILIES and self.stored.method != "fp8":
            raise PylonError(
                f"model {model_dir}: its {self.stored.describe()} checkpoint is read for the families "
                f"{', '.join(shards.SPLIT_FAMILIES)}, not {model_type}: save it dequantized, and use "
                "engine.quantization"
            )
        if self.stored is not None and isinstance(config.quantization_config, dict):
            config.quantization_config["dequantize"] = True
        self.pipeline = stage  # None: the whole model
        # A stage of several: its forward ends without the final norm (the first stage's `finish_step` applies it);
        # a multi-token-prediction layer's likewise (its output feeds its next draft).
        self._staged = (stage is not None and stage.count > 1) or mtp is not None
        if mtp is not None:
            why = mtp_layer.refused(model_type, config) if eagle is None else None
            if why is None and (stage is not None or adapters or images):
                why = "its layer runs beside a model's runner (not a pipeline stage's), without adapters"
            if why is not None and eagle is not None:
                raise PylonError(f"engine.speculative.draft_model {model_dir}: {why}")
            if why is not None:
                raise PylonError(f"engine.speculative.method mtp: model {model_dir}: {why}")
        if stage is not None:
            why = stages.refused(model_type, config, self.full_config.model_type if multimodal else None)
            if why is None and multimodal and images:
                why = "a multimodal checkpoint's stages serve its text: set engine.max_images_per_prompt to 0"
            if why is not None:
                raise PylonError(f"engine.pipeline_parallel: model {model_dir}: {why}")
        if shard is not None:
            why = shards.refused(model_type, config, shard.count, shard.experts)
            if why is None and multimodal and images:
                why = "a multimodal checkpoint's shards serve its text: set engine.max_images_per_prompt to 0"
            if why is None and multimodal and self.full_config.model_type not in shards.SPLIT_MULTIMODAL:
                why = f"a {self.full_config.model_type} multimodal checkpoint is not split into shards"
            if why is not None:
                raise PylonError(f"engine.tensor_parallel: model {model_dir}: {why}")
        self._forward: Callable = (
            self._forward_gpt2
            if model_type == "gpt2"
            else self._forward_opt
            if model_type == "opt"
            else self._forward_neox
            if model_type == "gpt_neox"
            else self._forward_llama
        )
        if model_type == "gpt2":
            self._gpt2_act = _gpt2_activation(config.activation_function)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if model_type in FP16_UNSAFE and self.dtype == torch.float16:
            # Gemma 2's and 3's activations pass fp16's range (as vLLM, which refuses fp16 for them): fp32 where `auto`
            # would pick fp16 (a GPU without bf16), and a named refusal where the spec asks for it.
            if dtype != "auto":
                raise PylonError(
                    f"engine.dtype: fp16 cannot serve {model_dir} ({FP16_UNSAFE[model_type]}'s activations overflow "
                    "fp16); use bf16 or fp32"
                )
            self.dtype = torch.float32
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        quant.check(quantization, self.device)  # before loading: fp8 on a CPU is refused at once
        self.quantization = quantization
        self.vision: torch.nn.Module | None = None  # the vision tower and projector (`_language_model`), with images
        # A classifier's head (hidden -> labels), applied to its pooled rows instead of the lm_head: a
        # `*ForSequenceClassification` checkpoint's `score`, or one made of lm_head rows (`classifier_from_token`).
        self.classifier: torch.nn.Module | None = None
        if multimodal and is_sequence_classifier(self.full_config):
            raise PylonError(f"model {model_dir}: a multimodal classifier is not served; serve its text model")
        try:
            if eagle is not None:  # (a shard's: its slices, beside that shard of the model)
                self.model = eagle_head.build(eagle, self.dtype, mtp.model, shard)
                self._whole_config = config
            elif mtp is not None:  # (a shard's: its slices, beside that shard of the model)
                self.model = mtp_layer.load(model_dir, config, self.dtype, mtp.model, shard)
                self._whole_config = config
            elif multimodal and shard is None and stage is None:
                self.model, vision = _language_model(model_dir, self.dtype)
                if images:
                    self.vision = vision.to(self.device).eval()
                del vision
            elif is_sequence_classifier(config) and shard is None:
                self.model, self.classifier = _sequence_classifier(model_dir, config, self.dtype)
            elif shard is not None:  # (of a pipeline stage: its layers' slices, and the head's on the first stage)
                cls = stages.stage_class(config, stage) if stage is not None else None
                classifier = is_sequence_classifier(config)  # (a reward model's: its head whole on every shard)
                self.model = shards.load_shard(model_dir, config, self.dtype, shard, cls=cls, head=not classifier)
                if classifier:
                    self.classifier = _sharded_classifier(model_dir, self.dtype)
                    self.model.set_output_embeddings(self.classifier)
                self._whole_config = config  # (adapters are checked against the whole model's projections)
                config = self.model.config  # the shard's: its heads, its MLP width
                self.stage_weights_bytes = stages.stage_bytes(self.model)
            elif stage is not None:  # (a multimodal checkpoint's: its language model's layers, by their names)
                self.model = stages.load_stage(model_dir, config, self.dtype, stage, multimodal)
                self.stage_weights_bytes = stages.stage_bytes(self.model)  # as loaded (before packing)
            elif self.stored is not None and model_type in shards.SPLIT_FAMILIES:  # (as one shard of one)
                self.model = shards.load_shard(model_dir, config, self.dtype, shards.Shard(0, 1))
                log.info(
                    "model %s: a checkpoint of %s, read dequantized to %s",
                    model_dir,
                    self.stored.describe(),
                    str(self.dtype).removeprefix("torch."),
                )
            else:
                loaded = {"config": config} if self.stored is not None else {}
                self.model = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=self.dtype, local_files_only=True, **loaded
                )
        except PylonError:
            raise
        except Exception as e:  # a missing, truncated or foreign weights file: say which, and what to do
            raise PylonError(weights_failure(model_dir, e)) from e
        if classifier_from_token:
            if self.classifier is not None:
                raise PylonError(
                    f"engine.classifier_from_token: model {model_dir} is a classifier already "
                    f"({config.architectures[0]}); leave the setting empty"
                )
            rows = (  # (a shard's lm_head holds its rows of the vocabulary: the tokens' read whole)
                shards.vocabulary_rows(model_dir, config, list(classifier_from_token)).to(self.dtype)
                if shard is not None
                else self.model.get_output_embeddings().weight.detach()[list(classifier_from_token)]
            )
            self.classifier = _token_classifier(rows)
        self.model.to(self.device).eval()
        if self.classifier is not None:
            self.classifier.to(self.device).eval()
        # The multi-token-prediction layer's input (mtp_layer.MtpInput; an EAGLE head's eagle_head.EagleInput); None for
        # a model's runner. Its output feeds its next draft before its final norm (DeepSeek's, EAGLE's) or after it
        # (Qwen's): `mtp_hidden`.
        self.mtp_input = getattr(self.model, "mtp_input", None) if mtp is not None else None
        self._mtp_normed = mtp is not None and mtp_layer.layout(model_type) == "qwen"
        if mtp is not None:
            config = self.model.config  # (one decoder layer)
        # A model's runner that keeps its steps' final hidden states, every row's (`step_hidden`), for a
        # multi-token-prediction layer (pylon.serving.engine.mtp) to read; set by the engine.
        self.keep_hidden = False
        self.step_hidden: torch.Tensor | None = None
        # With `keep_hidden`, the layers whose inputs are kept instead, side by side (`[rows, 3 x hidden]` for an
        # EAGLE-3 head: pylon.serving.model.eagle); () the final hidden states. The Llama-like forward keeps them.
        self.keep_layers: tuple[int, ...] = ()
        self._kept: dict[int, torch.Tensor] = {}  # (this step's, by layer)
        self.config = config
        # The decoder layers this runner computes: all, or its pipeline stage's (the others are `stages.Elsewhere`).
        self.layers = stage.layers if stage is not None else range(config.num_hidden_layers)
        for old, new in RENAMED_MODULES.get(model_type, {}).items():  # (Llama 4's feed_forward, Apertus's norms)
            for layer in self._own_layers():
                setattr(layer, new, layer._modules.pop(old))
        # What the Llama-like forward does beyond Llama's, read once here (families.py): each layer's rotary
        # embedding by its type (None: one for all), norms of the attention's and the MLP's outputs (Gemma 3's
        # post_attention_layernorm and post_feedforward_layernorm, with pre_feedforward_layernorm before the MLP),
        # and the logits' soft cap; fused projections (Phi-3's qkv_proj, split by `_qkv_sizes`, and gate_up_proj), and
        # the rotary embedding applied to the first `cos.shape[-1]` dimensions of each head only (Phi-3's
        # partial_rotary_factor; Llama's apply rotates them all).
        self._rope_types = rope_layer_types(config)
        # (the first layer with attention: Qwen3-Next's first layers are recurrent)
        first = (
            next((layer for layer in self._own_layers() if hasattr(layer, "self_attn")), None)
            if model_type in LLAMA_FAMILIES
            else None
        )
        # Norms of the attention's and the MLP's outputs (Gemma 2 and 3, OLMo 2: post_feedforward_layernorm), and of
        # their inputs (every family but OLMo 2, whose layers normalise outputs only: no input_layernorm).
        self._output_norms = first is not None and hasattr(first, "post_feedforward_layernorm")
        # GLM-4's names for them: post_self_attn_layernorm and post_mlp_layernorm (post_attention_layernorm: the MLP's
        # input norm, as Llama's).
        self._glm_norms = first is not None and hasattr(first, "post_mlp_layernorm")
        self._input_norms = first is None or hasattr(first, "input_layernorm")
        # Per-head query and key norms (Qwen3, Gemma 3), or norms over the whole projection (OLMo 2's q_norm and k_norm:
        # over heads x head_dim), or none.
        q_norm = getattr(first.self_attn, "q_norm", None) if first is not None else None
        # (Cohere's per-head LayerNorms carry a weight per head: [heads, head_dim], applied to the split heads too.)
        self._qk_norms = (
            None
            if q_norm is None
            else "all"
            if shard is not None and model_type in shards.SPANNING_NORM_FAMILIES  # (a shard of one head: OLMo's still)
            else "head"
            if q_norm.weight.numel() == first.self_attn.head_dim or q_norm.weight.dim() == 2
            else "all"
        )
        # Granite's multipliers (families.py): of the embeddings, of the attention's and the MLP's outputs before they
        # join the residual, and the logits' divisor; None where the family has none.
        self._embedding_multiplier = getattr(config, "embedding_multiplier", None)
        self._residual_multiplier = getattr(config, "residual_multiplier", None)
        self.logits_scaling = getattr(config, "logits_scaling", None)
        self._fused = first is not None and hasattr(first.self_attn, "qkv_proj")
        if self._fused:
            attn = first.self_attn
            q_size, kv_size = config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
            self._qkv_sizes = (q_size, kv_size, kv_size)
        # The rotary embedding as the family's own modeling code applies it (its module's `apply_rotary_pos_emb`:
        # Llama's halves, Phi-3's and GLM-4.5's partial, Cohere's, GLM-4's, Helium's and ERNIE's interleaved pairs,
        # GPT-OSS's half-span cos and sin), Llama's where a module has none.
        self._apply_rope: Callable = getattr(
            sys.modules[type(self.model).__module__], "apply_rotary_pos_emb", apply_rotary_pos_emb
        )
        if model_type == "llama4_text":  # its `apply_rotary_emb`: interleaved pairs by complex frequencies
            self._apply_rope = _rotate_complex
        # The layers that rotate (all but SmolLM3's and Llama 4's NoPE layers: their configs' no_rope_layers holds 0
        # for those; Cohere 2's windowed layers only).
        no_rope = getattr(config, "no_rope_layers", None) if model_type in ("smollm3", "llama4_text") else None
        self._rotates = [bool(r) for r in no_rope] if no_rope is not None else None
        if model_type == "cohere2" or (model_type == "exaone4" and getattr(config, "sliding_window", None)):
            self._rotates = [t == "sliding_attention" for t in config.layer_types]
        # Ministral 3's queries scaled by position once past original_max_position_embeddings (Llama 4's scale:
        # 1 + beta * log(1 + floor(position / original)), after the rotation), as its attention scales them.
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        self._llama4_scale = (
            (float(rope_parameters["llama_4_scaling_beta"]), int(rope_parameters["original_max_position_embeddings"]))
            if model_type == "ministral3" and rope_parameters.get("llama_4_scaling_beta") is not None
            else None
        )
        # Qwen3-Next: its recurrent layers (`_linear_attention`, each sequence's state under its `StepSequence.state`
        # in `_states`: per recurrent layer, the convolution's last inputs and the delta rule's matrices), and its
        # attention's output gate (half of q_proj's output, per head).
        self._linear = linear_layers(config)
        self.recurrent = self._linear is not None
        # each recurrent layer's index among them: where its state sits in a sequence's list of states
        self._state_slot = list(itertools.accumulate(self._linear, initial=0))[:-1] if self.recurrent else None
        self._num_states = sum(self._linear) if self.recurrent else 0
        self._states: dict[str, list[list[torch.Tensor]]] = {}
        self._step_spans: list[tuple[int, int, str | None, int]] = []  # the step's (offset, tokens, state, start)
        # Speculating sequences' states after each of the step's tokens, per recurrent layer (`keep_state`).
        self._drafting: set[str] = set()
        self._drafted: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # (Qwen3-Next's and Qwen3.5's attention layers; their multi-token-prediction layer's too, which is no recurrent)
        self._gated_attention = model_type in LINEAR_ATTENTION_FAMILIES
        self.batch_recurrent_decodes = True  # a step's decodes in one call a layer (off: one a sequence; the bench's)
        self.recurrent_rule_calls = 0  # delta-rule calls: a counter of the per-sequence work
        if self.recurrent:
            module = sys.modules[type(self.model).__module__]
            self._delta_rules = (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule)
        # HunYuan's per-head query and key norms (query_layernorm, key_layernorm), applied after the rotation.
        self._qk_norms_after_rope = first is not None and hasattr(first.self_attn, "query_layernorm")
        # Llama 4: an L2 norm of each head's query and key after the rotation (`qk_norm`, in its rotating layers where
        # use_qk_norm), and its NoPE layers' queries scaled by position (attn_temperature_tuning: attn_scale and
        # floor_scale), as Llama4TextAttention computes them.
        self._l2_qk_norm = model_type == "llama4_text" and bool(getattr(config, "use_qk_norm", False))
        self._nope_temperature = (
            (float(config.attn_scale), float(config.floor_scale))
            if model_type == "llama4_text" and getattr(config, "attn_temperature_tuning", False)
            else None
        )
        # Cohere: the attention and the MLP side by side on one normed input; the logits multiplied by logit_scale.
        self._parallel = model_type in PARALLEL_FAMILIES
        self.logit_scale = getattr(config, "logit_scale", None) if self._parallel else None
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        # Gemma 2's attention logits soft-capped (families.attention_softcap): through the PyTorch attention only.
        self.attn_softcap = attention_softcap(config)
        # GPT-OSS's attention sinks, each layer's `[heads]` (families.SINK_FAMILIES): through the PyTorch attention too.
        self.attn_sinks = (
            [layer.self_attn.sinks.detach() if stages.owned(layer) else None for layer in self.model.model.layers]
            if model_type in SINK_FAMILIES
            else None
        )
        # LoRA adapters, slot k = adapters[k - 1], checked against the model's projections and kept in its dtype and
        # on its device (pylon.serving.model.lora); None without any, and then no step spends anything on them.
        self.model_type = model_type
        self.shard = shard
        self.adapter_set = (
            lora.load_adapters(
                adapters,
                self.model,
                model_type,
                dtype=self.dtype,
                device=self.device,
                layers=stage.layers if stage is not None else None,
                shard=self._shard_adapters if shard is not None else None,
            )
            if adapters
            else None
        )
        self.adapter_bytes = self.adapter_set.nbytes if self.adapter_set is not None else 0
        # oneDNN for the projections on a CPU (pylon.serving.model.linear), or quantized weights in their place
        # (pylon.serving.model.quant); `self._mm(bias, x, w)` is addmm's signature.
        quantized = quantization != "none"
        # int4's groups: a 4-bit checkpoint's own (GPTQ, AWQ, W4A16, read dequantized), where they fit: its grid found
        # again, its weights served in 4 bits as published (pylon.serving.model.quant)
        group = self.stored.group if self.stored is not None and self.stored.bits == 4 else None
        self.packed_linear = not quantized and linear.usable(self.device, self.dtype)
        self._mm: Callable = quant.addmm if quantized else linear.addmm if self.packed_linear else torch.addmm
        # Steps with a prompt chunk run their projections over padded_rows rows, compiled at start (see linear.py).
        self.pad_rows = self.packed_linear and switched_on("PYLON_PADDED_ROWS")
        if model_type == "gpt2":
            self._gpt2 = _GPT2Weights.of(self.model, packed=self.packed_linear, quantization=quantization)
        # DeepSeek's latent attention (families.py): each layer's kv_b_proj split into its key and value halves
        # ([heads, qk_nope_head_dim or v_head_dim, kv_lora_rank]), absorbed into the queries and outputs (with
        # engine.quantization, its weights' round trip through it, in float); the module itself dropped.
        self._mla = None
        if model_type in MLA_FAMILIES:
            self._mla = []
            for layer in self.model.model.layers:
                if not stages.owned(layer):
                    self._mla.append(None)
                    continue
                attn = layer.self_attn
                w = attn.kv_b_proj.weight.detach()
                if quantization != "none":  # as quantized as the other projections: their round trip, absorbed
                    w = quant.QuantWeight(w, quantization, group).dequantized(self.dtype)
                w = w.view(attn.num_heads, -1, attn.kv_lora_rank)
                keys, values = w.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=1)
                self._mla.append((keys.contiguous(), values.contiguous()))
                attn.kv_b_proj = None
            self._mla_rope = (
                _rotate_complex  # DeepSeek-V2: complex frequencies from its rotary embedding
                if model_type == "deepseek_v2"
                else deepseek_v3.apply_rotary_pos_emb_interleave
                if getattr(config, "rope_interleave", False)
                else deepseek_v3.apply_rotary_pos_emb
            )
        # Mixture-of-experts layers (Mixtral, Qwen MoE): their sparse blocks computed by pylon.serving.model.moe, the
        # experts' weights quantized there with the rest, else kept as loaded (torch's matmul: see moe.py).
        self.moe_layers, self.moe_grouped = 0, False
        if model_type in MOE_MODEL_TYPES:
            project = functools.partial(quant.QuantLinear, method=quantization, group=group) if quantized else None
            # On a GPU, float experts as grouped matmuls, which CUDA graphs capture (moe.py: checked at load).
            # Expert parallelism (a tensor-parallel shard's experts whole: model/tensor.py): its experts from the first
            # of its share on; their rows picked out on the host, by the loop.
            first = None
            if shard is not None and shard.experts:
                first = shard.rank * shards.num_experts(config)  # (the shard's config: its count of experts)
            self.moe_grouped = (
                not quantized
                and self.device.type == "cuda"
                and first is None
                and moe.grouped_usable(self.device, self.dtype)
            )
            self.moe_layers = moe.replace_blocks(self.model, project, grouped=self.moe_grouped, first_expert=first)
        if model_type != "gpt2" and (self.packed_linear or quantized):
            _pack_llama(self.model, quantization, group)
        if shard is not None:  # (on the projections as the forward calls them: packed, quantized or not)
            shards.reduce_outputs(self.model, self._own_layers())
            if model_type in shards.SPANNING_NORM_FAMILIES:  # OLMo's query and key norms over every shard's heads
                shards.spanning_norms(self._own_layers(), self._whole_config, shard)
            if (stage is None or stage.first) and mtp is None:  # its rows of the embeddings and lm_head, made whole
                shards.vocab_parallel(self.model, shard, head=not is_sequence_classifier(self._whole_config))
        self.vocab_size = config.vocab_size
        # The positions served: the model's, or fewer where the engine cannot compute past them (families.py:
        # LongRoPE's switch to its long factors), said once here.
        self.max_position_embeddings, why = position_limit(config)
        if why is not None:
            log.warning(
                "model %s: served up to %d positions, not its max_position_embeddings %d: %s",
                model_dir,
                self.max_position_embeddings,
                config.max_position_embeddings,
                why,
            )
        # Each layer's sliding window (None: full attention; families.layer_windows), applied by the attention
        # metadata of the step (pylon.serving.model.attention): `step_window` in the step's own metadata, which every
        # layer reads, where every layer has the window (Mistral); where windowed layers mix with full ones (Qwen's
        # max_window_layers), `mixed_window` in a second metadata for the windowed ones (`AttentionMetadata.windowed`).
        # Windowed metadata never goes to the compiled kernels. Where every layer is windowed, the engine lets go of a
        # sequence's blocks before its window (engine/kv_cache.py, `trim`): their places in its table name the
        # scratch block (`add_scratch_block`), gathered and masked out like any key before the window.
        self.layer_windows = layer_windows(config)
        self.attention_window = next((w for w in self.layer_windows if w is not None), None)
        if len({w for w in self.layer_windows if w is not None}) > 1:
            raise PylonError(f"model {model_dir}: its layers have sliding windows of different sizes")
        every = all(w is not None for w in self.layer_windows)
        self.step_window = self.attention_window if every else None
        self.mixed_window = None if every else self.attention_window
        self.block_size = block_size
        # `hybrid_kv` (the engine's max_model_len and max_num_batched_tokens): where windowed layers mix with full ones,
        # the KV cache in groups of layers of one kind, each with its own block table (`families.kv_groups`; the
        # engine's HybridKVBlockPool): `num_blocks` is then the pool's blocks in every layer as one table would have
        # them, and the groups get as many block ids as that memory holds of `g` layers each (`num_kv_blocks`); a
        # layer's tensors are its place's in its group (`group_of`), shared with the other groups'. StepSequence's
        # `group_tables` name each group's blocks, each group's metadata made from its own (AttentionMetadata's
        # `kv_groups`).
        self.kv_groups: list[tuple[list[int], int | None]] = []
        if hybrid_kv is not None and stage is None and not self._linear and self._mla is None:
            self.kv_groups = kv_groups(
                self.layer_windows, hybrid_kv[0], block_size, hybrid_kv[1], num_blocks * block_size
            )
        self.group_of = [0] * config.num_hidden_layers
        place = list(range(config.num_hidden_layers))
        for g, (layers, _) in enumerate(self.kv_groups):
            for k, i in enumerate(layers):
                self.group_of[i], place[i] = g, k
        width = max((len(layers) for layers, _ in self.kv_groups), default=0)
        self.num_kv_blocks = num_blocks * config.num_hidden_layers // width if width else num_blocks

        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if self._mla is not None:  # one latent and its rotated part a token, shared by every head
            num_kv_heads, head_dim = 1, config.kv_lora_rank + config.qk_rope_head_dim
        if self.kv_groups:  # a tensor a place in a group, each layer's its place's
            shape = (self.num_kv_blocks, block_size, num_kv_heads, head_dim)
            shared = [new_kv_cache(*shape, dtype=self.kv_dtype, device=self.device) for _ in range(2 * width)]
            self.k_cache = [shared[place[i]] for i in range(config.num_hidden_layers)]
            self.v_cache = [shared[width + place[i]] for i in range(config.num_hidden_layers)]
        else:
            self.k_cache = [  # (a recurrent layer caches nothing: an empty placeholder keeps the layers' indices)
                new_kv_cache(
                    0 if (self._linear and self._linear[i]) or i not in self.layers else num_blocks,
                    block_size,
                    num_kv_heads,
                    head_dim,
                    dtype=self.kv_dtype,
                    device=self.device,
                )
                for i in range(config.num_hidden_layers)
            ]
            # (DeepSeek's latent attention: a token's latent is its key and its value: one cache, both names)
            self.v_cache = list(self.k_cache) if self._mla is not None else [torch.zeros_like(k) for k in self.k_cache]
        self.workspace = Workspace()  # gathered keys/values, reused by every layer and step
        self.stage = HostStage(self.device)  # a step's integer tensors, in one copy to a GPU
        self.scratch_slot: int | None = None  # where padded rows store their keys and values (add_scratch_block)
        self.host_kv: list[torch.Tensor] = []  # the prefix cache's host tier, kv_tensors' blocks (offload_to_host)
        self.decode_graphs = None  # pylon.serving.model.graphs.DecodeGraphs, on a GPU (use_decode_graphs)
        self._step_rope: torch.Tensor | None = None  # M-RoPE's positions of the step's rows (`_mrope_rows`)

        # Decodes attend in place (see kernels.py), unless the attention soft-caps its scores or has sinks, which the
        # kernels do not take.
        self.kernel = (
            self.attn_softcap is None
            and self.attn_sinks is None
            and kernels.usable(self.device, self.dtype, self.kv_dtype)
        )
        # Prompt chunks too, through the prefill kernel, where it is built for this model (float32, AVX-512 or AVX2).
        self.prefill = self.kernel and kernels.prefill_usable(self.dtype, self.kv_dtype, head_dim)
        if model_type == "gpt2" and self.kernel and config.activation_function in TANH_GELUS:
            self._gpt2_act = kernels.gelu_tanh_  # the same function, ~10x torch's on a CPU (see kernels.py)

    def _own_layers(self) -> list[torch.nn.Module]:
        """The decoder layers this runner computes (its pipeline stage's, or all)."""
        return [self.model.model.layers[i] for i in self.layers]

    @torch.no_grad()
    def warm_up(
        self, max_num_seqs: int, max_num_batched_tokens: int, max_gflop: float = WARM_UP_GFLOP
    ) -> tuple[int, int]:
        """Compile oneDNN's kernels for the row counts the projections will run over (`linear.row_counts`), so that
        no step compiles one: each projection shape of a layer (the layers share them) once per count, on zeros,
        fewest rows first, while the arithmetic stays within `max_gflop` (a large model's compiling is a small part
        of its steps anyway; counts left out compile when first met). Returns (counts compiled, counts in all)."""
        if not self.pad_rows:
            return 0, 0
        shapes = self._projection_shapes()
        per_row = 2 * sum(n_in * n_out for n_in, n_out, _ in shapes)
        counts = linear.row_counts(max_num_seqs, max_num_batched_tokens)
        kernels, cached = len(counts) * len(shapes), linear.cached_kernels()
        room = cached // len(shapes)
        if len(counts) > room:
            log.warning(
                "engine: its steps run %d row counts, %d kernels, and oneDNN keeps %d: steps will compile "
                "kernels all along; set ONEDNN_PRIMITIVE_CACHE_CAPACITY=%d in the engine's environment "
                "(~0.6 MB of machine code each), or lower max_num_seqs",
                len(counts),
                kernels,
                cached,
                kernels * linear.CACHE_ENTRIES_PER_KERNEL,
            )
        spent, done = 0, 0
        for rows in counts[:room]:
            if spent + rows * per_row > max_gflop * 1e9:
                break
            for n_in, _, project in shapes:
                project(torch.zeros(rows, n_in, dtype=self.dtype, device=self.device))
            spent += rows * per_row
            done += 1
        return done, len(counts)

    def add_scratch_block(self) -> int:
        """One more block in every layer's caches, past the pool's (the KV pool never hands it out): where a
        fixed-shape step's padding rows store their keys and values. Returns its first slot."""
        if self.scratch_slot is None:
            num_blocks = self.k_cache[0].shape[1]
            grown = {}  # (each tensor once: latent attention's K is its V, a group's place is shared: kv_groups)
            for t in self.k_cache + self.v_cache:
                if id(t) not in grown:
                    grown[id(t)] = torch.cat([t, torch.zeros_like(t[:, :1])], 1)
            self.k_cache = [grown[id(k)] for k in self.k_cache]
            self.v_cache = [grown[id(v)] for v in self.v_cache]
            self.scratch_slot = num_blocks * self.block_size
        return self.scratch_slot

    # -- the prefix cache's host tier (engine.kv_offload_tokens; engine/kv_cache.py) ------------------------------

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every K and V pool of this runner's layers that holds blocks, in a fixed order (latent attention's one a
        layer once; a recurrent layer's or another stage's placeholder not at all)."""
        unique = {id(t): t for t in self.k_cache + self.v_cache if t.shape[1]}
        return list(unique.values())

    def offload_to_host(self, slots: int, path: str | None = None) -> int:
        """Room in host memory for `slots` blocks of each of `kv_tensors` (pinned on a GPU, so that copies run at the
        bus's speed): the prefix cache's host tier. With `path` (engine.kv_offload_path), in files under that
        directory instead, mapped (`mapped_tensor`). Returns its bytes."""
        pin = self.device.type == "cuda"
        shapes = [((t.shape[0], slots, *t.shape[2:]), t.dtype) for t in self.kv_tensors()]
        if path is not None:
            self.host_kv = [mapped_tensor(path, shape, dtype) for shape, dtype in shapes]
        else:
            self.host_kv = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in shapes]
        return sum(h.numel() * h.element_size() for h in self.host_kv)

    def copy_blocks(self, copies: list[tuple[str, list[int], list[int]]]) -> None:
        """Make the pool's copies (`KVBlockPool.drain_copies`), in order: ("save", device blocks, host slots),
        ("load", host slots, device blocks), every layer's keys and values. Before the next pass reads or writes a
        block: the engine's, and in the step's order on the device."""
        pairs = [(_as_bits(d), _as_bits(h)) for d, h in zip(self.kv_tensors(), self.host_kv)]  # (no fp8 index_copy_)
        for kind, source, destination in copies:
            blocks, slots = (source, destination) if kind == "save" else (destination, source)
            blocks, slots = torch.tensor(blocks, device=self.device), torch.tensor(slots)  # (once for every layer)
            for device_kv, host_kv in pairs:
                if kind == "save":
                    host_kv.index_copy_(1, slots, device_kv.index_select(1, blocks).cpu())
                else:
                    device_kv.index_copy_(1, blocks, host_kv.index_select(1, slots).to(self.device))

    def move_kv(self, moves: list[list[tuple[int, int]]]) -> None:
        """Draft trees (`StepSequence.tree`): each accepted token's keys and values from the slot the step wrote them
        at (its index in the tree) to the one of its position, every layer's. `moves[g]`: (from, to) slots in the
        KV cache's group g's blocks (`kv_groups`; one list where there are none). No slot moved to is moved from:
        the moves are one gather, then one scatter, per tensor."""
        for g, pairs in enumerate(moves):
            if not pairs:
                continue
            layers = [i for i in range(len(self.k_cache)) if self.group_of[i] == g]
            tensors = {id(t): t for i in layers for t in (self.k_cache[i], self.v_cache[i]) if t.shape[1]}
            source = torch.tensor([a for a, _ in pairs], device=self.device)
            target = torch.tensor([b for _, b in pairs], device=self.device)
            for t in tensors.values():
                flat = _as_bits(t).view(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])  # [heads, slots, ...]
                flat.index_copy_(1, target, flat.index_select(1, source))

    # -- blocks sent to another engine (prefill-decode disaggregation; pylon.serving.engine.kv_transfer) -----------

    def kv_layout(self) -> list[tuple[tuple[int, ...], str]]:
        """What a block of each of `kv_tensors` is: its shape without the blocks' dimension, and its dtype. Two runners
        whose layouts are equal hold blocks that mean the same (with the same model and block names)."""
        return [((t.shape[0], *t.shape[2:]), str(t.dtype).removeprefix("torch.")) for t in self.kv_tensors()]

    def read_blocks(self, blocks: list[int]) -> list:
        """Blocks `blocks` of each of `kv_tensors`, in order: one numpy array of bytes a tensor, `[heads, len(blocks),
        block_size, ...]` as unsigned bytes (bf16 and fp8 have no numpy type; `write_blocks` views them back)."""
        index = torch.tensor(blocks, device=self.device)
        return [t.index_select(1, index).contiguous().view(torch.uint8).cpu().numpy() for t in self.kv_tensors()]

    def write_blocks(self, blocks: list[int], arrays: list) -> None:
        """`read_blocks`' arrays (another runner's, of the same `kv_layout`) into blocks `blocks`."""
        index = torch.tensor(blocks, device=self.device)
        for t, array in zip(self.kv_tensors(), arrays, strict=True):
            with warnings.catch_warnings():  # (an array from Ray's object store is read-only; it is only read here)
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(array)
            _as_bits(t).index_copy_(1, index, data.to(self.device).view(_BITS[t.element_size()]))

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        """On a GPU, capture the CUDA graphs that steps of decodes only will replay (pylon.serving.model.graphs;
        the engine asks unless `engine.cuda_graphs` is false). Returns how many (0: none, every step runs eagerly)."""
        if self.device.type != "cuda":
            return 0
        if self.recurrent:
            log.info("model with recurrent layers: decode steps run eagerly (its states are kept per sequence)")
            return 0
        if self.moe_layers and not self.moe_grouped:
            log.info(
                "MoE model: decode steps run eagerly, without CUDA graphs (its experts run one by one, their rows read "
                "back to the host every layer: quantized experts, or no grouped matmul here; pylon.serving.model.moe)"
            )
            return 0

        self.add_scratch_block()
        self.decode_graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        return self.decode_graphs.capture_all()

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        workspace: Workspace | None = None,
        adapters: lora.StepAdapters | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's final hidden states at the sampling tokens (see `_forward_gpt2`); `workspace`: gather into
        these buffers instead of the runner's own (a CUDA graph's step keeps its own); `adapters`: which rows run
        which LoRA adapter (None: every row the base model); `images`: rows of the step and the embeddings that
        replace their tokens' (the vision tower's: `embed_images`); `hidden`: a pipeline stage's input, the previous
        stage's output (`_forward_llama`)."""
        saved = self.workspace
        self.workspace = saved if workspace is None else workspace
        try:
            with prompt_attention_backends(self.device):
                if hidden is not None:
                    return self._forward(ids, positions, meta, final, adapters, images, hidden)
                if images is not None:
                    return self._forward(ids, positions, meta, final, adapters, images)
                return self._forward(ids, positions, meta, final, adapters)
        finally:
            self.workspace = saved
            self._step_rope = None  # (one step's: set by `execute_step` for the forward it calls)

    def _projection_shapes(self) -> list[tuple[int, int, Callable]]:
        """(in, out, projection) for each distinct shape of the first layer's oneDNN projections."""
        found: dict[tuple[int, int], Callable] = {}
        if self.config.model_type == "gpt2":
            layer = self._gpt2.layers[0]
            hidden = self.config.hidden_size
            for n_in, b, w in (
                (hidden, layer.qkv_b, layer.qkv_w),
                (hidden, layer.proj_b, layer.proj_w),
                (hidden, layer.fc_b, layer.fc_w),
                (len(layer.fc_b), layer.down_b, layer.down_w),
            ):
                found.setdefault((n_in, len(b)), functools.partial(self._mm, b, packed=w))
        else:
            for module in _decoder_layers(self.model)[self.layers.start].modules():
                if isinstance(module, linear.PackedLinear):
                    found.setdefault((module.in_features, module.out_features), module)
        return [(n_in, n_out, project) for (n_in, n_out), project in found.items()]

    def execute(self, steps: list[StepSequence]) -> torch.Tensor:
        """Run one step; return float32 logits `[rows, vocab]`: for each of `steps` in order, one row per token it
        computes (positions start, start + 1, ...) when its `prompt_logits` is true, else one row (its last token's)
        when its `samples` is true, else none (empty when no sequence has a row). Without `prompt_logits` that is
        `[sampling sequences, vocab]`, each sampling sequence's last token only. Each sequence runs with its
        `adapter` (0: the base model). `pooled` sequences have no row here: see `execute_step`."""
        return self.execute_step(steps)[0]

    @torch.no_grad()
    def execute_step(
        self, steps: list[StepSequence], hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute`'s logits, and the final hidden states `[pooled sequences, hidden]` (float32) of the sampling
        `pooled` sequences' last tokens, in order (None when the step has none): their rows skip the lm_head.

        A pipeline stage's runner (`stage`, of more than one) takes `hidden`, the previous stage's output for the step's
        rows, unless it is the first, and returns its own output (in the model's dtype) and None: every step, with or
        without rows to sample, since each stage writes its own layers' KV cache. That is `[rows, hidden]`, but for
        the last stage, whose rows past the last layer are the sampling ones only (as the lm_head would take them,
        before the final norm): the first stage's `finish_step` makes the outputs of them."""
        with_adapters = any(s.adapter for s in steps)
        keep = self.keep_hidden
        if with_adapters:
            self._check_adapters(steps)
        elif (
            self.decode_graphs is not None
            and not keep
            and all(
                s.num_new_tokens == 1
                and s.samples
                and not s.pooled
                and not s.image_rows
                and (s.mrope is None or s.start >= s.mrope[0].shape[1])  # (past its images: DecodeGraphs.run)
                for s in steps
            )
        ):
            logits = self.decode_graphs.run(steps)  # one token a sequence: its one row, prompt_logits or not
            if logits is not None:
                return logits, None
        token_ids, positions, seqs, last_tokens = [], [], [], []
        image_rows, image_embeds = [], []  # the step's rows that are images' (pylon.serving.engine.images)
        if self.recurrent:  # where each sequence's rows are, for the recurrent layers
            offsets = itertools.accumulate((s.num_new_tokens for s in steps), initial=0)
            self._step_spans = [(o, s.num_new_tokens, s.state, s.start) for o, s in zip(offsets, steps)]
            self._drafting = {s.state for s in steps if s.speculative}
            self._drafted = {}
        for s in steps:
            if s.image_rows:
                image_rows.extend(len(token_ids) + r for r in s.image_rows)
                image_embeds.append(s.image_embeds)
            token_ids.extend(s.token_ids)
            if s.tree:  # (a draft tree: each token past its parent)
                positions.extend(tree_positions(s.start, s.tree))
            else:
                positions.extend(range(s.start, s.start + s.num_new_tokens))
            seqs.append(SequenceSlice(s.start, s.num_new_tokens, s.block_table, s.image_spans, s.tree))
            if s.prompt_logits or keep:  # (`keep_hidden`: every row's final hidden state)
                last_tokens.extend(range(len(token_ids) - s.num_new_tokens, len(token_ids)))
            elif s.samples:
                last_tokens.append(len(token_ids) - 1)
        stage = self.stage
        stage.begin()

        def metadata(seqs: list[SequenceSlice], window: int | None) -> AttentionMetadata:
            return build_metadata(
                seqs,
                self.block_size,
                self.device,
                self.dtype,
                kernel=self.kernel,
                # The prefill kernel masks causally only: a step with spans attended both ways goes through PyTorch's.
                prefill=self.prefill and not any(s.image_spans for s in steps),
                stage=stage,
                rounded=self.kv_dtype != self.dtype,
                window=window,
            )

        meta = metadata(seqs, self.step_window)
        if self.kv_groups:  # each group's own metadata, from its own tables (and slots)
            if any(len(s.group_tables) != len(self.kv_groups) for s in steps):
                raise ValueError(
                    f"the KV cache is in {len(self.kv_groups)} groups of layers: each step names each "
                    "group's block table (StepSequence.group_tables)"
                )
            group_meta = [None] + [
                metadata(
                    [SequenceSlice(s.start, s.num_new_tokens, s.group_tables[g], s.image_spans, s.tree) for s in steps],
                    w,
                )
                for g, (_, w) in enumerate(self.kv_groups)
                if g
            ]
            meta = dataclasses.replace(meta, kv_groups=tuple(group_meta))
        elif self.mixed_window is not None:  # the windowed layers' metadata: the same step, through the same slots
            windowed = build_metadata(
                seqs,
                self.block_size,
                self.device,
                self.dtype,
                stage=stage,
                slots=False,
                rounded=self.kv_dtype != self.dtype,
                window=self.mixed_window,
            )
            meta = dataclasses.replace(meta, windowed=dataclasses.replace(windowed, slot_mapping=meta.slot_mapping))
        if len(last_tokens) == len(token_ids) == len(steps):  # decodes only: the last layer's queries are the step's
            final = Final(None, meta.over_cache())
        else:
            # Each row's query over the cache: a prompt_logits sequence's every token (each one query, as a decode
            # would be), the other sampling sequences' last token.
            # A draft tree's tokens are one query each too, but attend as its chunk does: its rows, as one slice.
            finals = []  # (position, step), or (start, step) of a draft tree
            for s in steps:
                if s.tree:
                    finals.append((s.start, s))
                elif s.prompt_logits or keep:
                    finals.extend((p, s) for p in range(s.start, s.start + s.num_new_tokens))
                elif s.samples:
                    finals.append((s.start + s.num_new_tokens - 1, s))
            final = Final(stage.add(last_tokens), self._final_metadata(finals) if finals else None)
        if final.rows is not None and self.pad_rows:
            # A step with a prompt chunk: its projections run over one of a few row counts (linear.padded_rows),
            # the extra rows token 0 at position 0, which store nothing, attend nothing and sample nothing.
            pad = linear.padded_rows(len(token_ids)) - len(token_ids)
            token_ids.extend([0] * pad)
            positions.extend([0] * pad)
        # M-RoPE (a Qwen-VL prompt with images): each row's three rotary positions, `[3, rows]`; else its position.
        self._step_rope = _mrope_rows(steps, positions, stage) if any(s.mrope is not None for s in steps) else None
        ids, positions = stage.add(token_ids), stage.add(positions)
        adapters = self._step_adapters(steps, len(token_ids), last_tokens, final) if with_adapters else None
        images = None
        if image_rows:
            images = (stage.add(image_rows), torch.cat(image_embeds))
        stage.send()
        if hidden is not None:
            hidden = hidden.to(self.device, self.dtype)
            if len(hidden) < len(token_ids):  # (a multi-token-prediction layer's input: the padded rows' zeros)
                hidden = torch.cat([hidden, hidden.new_zeros(len(token_ids) - len(hidden), hidden.shape[1])])
        hidden = self.forward(ids, positions, meta, final, adapters=adapters, images=images, hidden=hidden)
        if self._staged:
            return hidden, None
        if keep:  # every row's, kept; the sampling rows' go on (those `prompt_logits` or `samples` gives)
            self.step_hidden = hidden
            if self.keep_layers:  # (their padded rows dropped as the last layer drops them)
                kept = [self._kept[i] if final.rows is None else self._kept[i][final.rows] for i in self.keep_layers]
                self.step_hidden, self._kept = torch.cat(kept, dim=-1), {}
            rows, row = [], 0
            for s in steps:
                if s.prompt_logits:
                    rows.extend(range(row, row + s.num_new_tokens))
                elif s.samples:
                    rows.append(row + s.num_new_tokens - 1)
                row += s.num_new_tokens
            hidden = hidden[rows] if len(rows) < row else hidden
            return self._outputs(steps, hidden, bool(rows))
        return self._outputs(steps, hidden, bool(last_tokens))

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of a multi-token-prediction layer's outputs (`execute_step`'s, before the final norm), over
        the model's vocabulary (an EAGLE-3 head's draft vocabulary's placed at their tokens, the others -inf)."""
        logits = self.logits(self.model.model.norm(hidden.to(self.device, self.dtype))).float()
        placed = getattr(self.model, "draft_to_target", None)
        if placed is None:
            return logits
        full = logits.new_full((len(logits), self.vocab_size), float("-inf"))
        full[:, placed] = logits
        return full

    @torch.no_grad()
    def mtp_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a multi-token-prediction layer's output (`execute_step`'s) feeds its next draft as the hidden state:
        itself (DeepSeek's layout), or after the final norm (Qwen's: pylon.serving.model.mtp)."""
        return self.model.model.norm(hidden) if self._mtp_normed else hidden

    @torch.no_grad()
    def finish_step(self, steps: list[StepSequence], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first pipeline stage's end of a step: `execute_step`'s outputs from the last stage's output `hidden`
        (its sampling rows, before the final norm), through this stage's final norm and head."""
        hidden = self.model.model.norm(hidden.to(self.device, self.dtype))
        return self._outputs(steps, hidden, any(s.prompt_logits or s.samples for s in steps))

    def _outputs(
        self, steps: list[StepSequence], hidden: torch.Tensor, rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute_step`'s outputs from the final hidden states (after the last norm) of the step's sampling rows;
        `rows`: whether it has any."""
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device), None
        if not any(s.pooled and s.samples for s in steps):
            return self.logits(hidden).float(), None
        pooled, row = [], 0  # the pooled sequences' rows among `hidden`'s (last_tokens' order)
        for s in steps:
            if s.pooled and s.prompt_logits:
                raise ValueError("StepSequence: a pooled sequence has no logits (prompt_logits must be false)")
            if s.pooled and s.samples:
                pooled.append(row)
            row += s.num_new_tokens if s.prompt_logits else int(s.samples)
        rest = sorted(set(range(len(hidden))) - set(pooled))
        logits = self.logits(hidden[rest]) if rest else hidden.new_empty(0, self.vocab_size)
        finals = hidden[pooled]
        if self.classifier is not None:  # a classifier's pooled rows are its labels' logits
            finals = self.classifier(finals)
        return logits.float(), finals.float()

    @torch.no_grad()
    def embed_images(self, pixels: dict) -> torch.Tensor:
        """The rows `[placeholders, hidden]` a request's images put in its prompt (the multimodal model's
        `get_image_features`: the vision tower, then the projector), in the order of their placeholders; `pixels`:
        the processor's tensors (pylon.serving.engine.images.ImageInputs.pixels)."""
        if self.vision is None:
            raise ValueError("this runner keeps no vision tower (ModelRunner(images=True))")
        kwargs = {"pixel_values": pixels["pixel_values"].to(self.device, self.dtype)}
        if "image_sizes" in pixels:  # Mistral 3 (Pixtral): each image's own size, and the layer its features are from
            kwargs["image_sizes"] = pixels["image_sizes"].to(self.device)
            kwargs["vision_feature_layer"] = self.full_config.vision_feature_layer
        if "image_grid_thw" in pixels:  # Qwen-VL: each image's grid of patches
            kwargs["image_grid_thw"] = pixels["image_grid_thw"].to(self.device)
        out = self.vision.get_image_features(**kwargs)
        hidden = self.config.hidden_size

        def rows(features) -> torch.Tensor:
            if isinstance(features, torch.Tensor):
                return features.reshape(-1, hidden)
            return torch.cat([f.reshape(-1, hidden) for f in features])

        deepstack = getattr(out, "deepstack_features", None)
        if not deepstack:
            return rows(out.pooler_output)
        # Qwen3-VL: each placeholder's row, then its features from the vision tower's inner layers, which the first
        # layers of the language model add to their outputs (`_forward_llama`): [placeholders, 1 + levels, hidden].
        return torch.stack([rows(out.pooler_output), *(rows(f) for f in deepstack)], dim=1)

    def fixed_weights(self) -> str | None:
        """Why this runner's weights cannot be replaced by `load_weights` (weights transformed at load into a form
        other than the checkpoint's), or None when they can."""
        if self.quantization != "none":
            return f"its projections are quantized ({self.quantization}) at load"
        why = reshaped_at_load(self.full_config.model_type)  # (a multimodal checkpoint's own type, not its text's)
        if why is not None:
            return why
        if self.classifier is not None or self.vision is not None:
            return "it is a classifier or keeps a vision tower"
        if self.adapter_set is not None:
            return "it serves LoRA adapters (engine.adapters)"
        return None

    @torch.no_grad()
    def load_weights(self, weights) -> int:
        """Replace the model's weights by `weights`, (name, tensor) pairs named as the checkpoint names them (a
        `*ForCausalLM`'s `state_dict` keys: `model.layers.0.self_attn.q_proj.weight`...), in any dtype and on any
        device: each copied into the runner's own storage, in place (CUDA graphs keep reading it), a projection
        reordered for oneDNN packed again. Every weight of the model must be given (tied ones once); a name the
        model does not have, a shape that differs, or a weight left out is a PylonError naming it. Returns how many
        tensors were taken. vLLM's `load_weights`, which TRL calls to sync a policy into a colocated engine."""
        why = self.fixed_weights()
        if why is not None:
            raise PylonError(f"model ({self.model_type}): its weights cannot be replaced: {why}")
        renames = [(f".{old}.", f".{new}.") for old, new in RENAMED_MODULES.get(self.model_type, {}).items()]
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters(remove_duplicate=False))
        # what must be given: each parameter once (tied embeddings: one entry), and each projection packed at load
        wanted = {id(p): n for n, p in params.items()}
        wanted.update({id(m): f"{n}.weight" for n, m in modules.items() if isinstance(m, linear.PackedLinear)})
        gpt2_packed: dict[str, torch.Tensor] = {}  # GPT-2's projections, reordered once all are in (`_GPT2Weights`)
        taken = 0
        for name, tensor in weights:
            own = name
            for old, new in renames:
                own = own.replace(old, new)
            owner, _, attr = own.rpartition(".")
            module = modules.get(owner)
            tensor = tensor.detach()
            if isinstance(module, linear.PackedLinear) and attr in ("weight", "bias"):
                shape = (module.out_features, module.in_features) if attr == "weight" else (module.out_features,)
                _check_shape(name, tensor, shape)
                if attr == "weight":
                    module.packed = linear.pack(tensor.to(self.device, self.dtype))
                    wanted.pop(id(module), None)
                else:
                    module.bias.copy_(tensor)
                taken += 1
                continue
            if self.model_type == "gpt2" and self.packed_linear and attr == "weight" and module is not None:
                if type(module).__name__ == "Conv1D":
                    _check_shape(name, tensor, (module.nx, module.nf))
                    gpt2_packed[owner] = tensor.to(self.device, self.dtype)
                    taken += 1
                    continue
            param = params.get(own)
            if param is None:
                raise PylonError(
                    f"weight {name}: the engine's model ({self.model_type}) has no such weight; give the weights of "
                    "the model it was loaded from, named as its checkpoint names them"
                )
            _check_shape(name, tensor, tuple(param.shape))
            param.copy_(tensor)
            wanted.pop(id(param), None)
            taken += 1
        if self.model_type == "gpt2" and self.packed_linear:
            self._pack_gpt2(gpt2_packed)
        missing = list(wanted.values())
        if missing:
            raise PylonError(
                f"load_weights: {len(missing)} of the model's weights were not given ({', '.join(missing[:5])}); "
                "give every weight, or the model would compute with a mix of old and new ones"
            )
        return taken

    def _pack_gpt2(self, given: dict[str, torch.Tensor]) -> None:
        """GPT-2's projections, reordered for oneDNN again: every layer's four, all given ([in, out], Conv1D's)."""
        names = [f"transformer.h.{i}.{p}" for i in range(len(self._gpt2.layers)) for p in _GPT2_PROJECTIONS]
        left = [n for n in names if n not in given]
        if left:
            raise PylonError(f"load_weights: GPT-2's projection weights are taken all together; missing {left[:3]}")
        layers = []
        for i, layer in enumerate(self._gpt2.layers):
            packed = [linear.pack(given[f"transformer.h.{i}.{p}"].t()) for p in _GPT2_PROJECTIONS]
            layers.append(
                dataclasses.replace(layer, qkv_w=packed[0], proj_w=packed[1], fc_w=packed[2], down_w=packed[3])
            )
        self._gpt2 = dataclasses.replace(self._gpt2, layers=layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits of final hidden states, in the model's dtype, soft-capped where the config says
        (`final_logit_softcapping`: cap * tanh(logits / cap), as transformers' Gemma 3 computes it)."""
        logits = self.model.get_output_embeddings()(hidden)  # lm_head (GPT-NeoX's embed_out)
        if self.logits_scaling is not None:  # Granite: the logits divided, as GraniteForCausalLM divides them
            logits = logits / self.logits_scaling
        if self.logit_scale is not None:  # Cohere: multiplied, as CohereForCausalLM multiplies them
            logits = logits * self.logit_scale
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _final_metadata(self, finals: list[tuple[int, StepSequence]]) -> AttentionMetadata:
        """`final_metadata` of the step's sampling queries `finals` (each a position of a step's sequence), with the
        windowed layers' (see `step_window`) or each group's of the KV cache (`kv_groups`)."""

        def sliced(p: int, s: StepSequence, table: list[int]) -> SequenceSlice:
            return SequenceSlice(p, s.num_new_tokens, table, tree=s.tree) if s.tree else SequenceSlice(p, 1, table)

        slices = [sliced(p, s, s.block_table) for p, s in finals]
        args = (slices, self.block_size, self.device, self.dtype)
        # (its only chunks are draft trees': the prefill kernel takes them where it takes the step's)
        meta = final_metadata(
            *args, kernel=self.kernel, stage=self.stage, window=self.step_window, prefill=self.prefill
        )
        if self.kv_groups:
            groups = [None] + [
                final_metadata(
                    [sliced(p, s, s.group_tables[g]) for p, s in finals],
                    *args[1:],
                    kernel=self.kernel,
                    stage=self.stage,
                    window=window,
                )
                for g, (_, window) in enumerate(self.kv_groups)
                if g
            ]
            return dataclasses.replace(meta, kv_groups=tuple(groups))
        if self.mixed_window is None:
            return meta
        return dataclasses.replace(meta, windowed=final_metadata(*args, stage=self.stage, window=self.mixed_window))

    def _check_adapters(self, steps: list[StepSequence]) -> None:
        served = self.adapter_set.slots if self.adapter_set is not None else {}
        for s in steps:
            if s.adapter and s.adapter not in served:
                raise ValueError(
                    f"StepSequence.adapter {s.adapter}: this runner serves adapters in slots {sorted(served)} "
                    "(0: the base model)"
                )

    def read_adapter(self, directory: str, *, max_rank: int | None = None, rank_limit: str = "max_rank"):
        """The LoRA adapter peft saved in `directory`, checked against this model and in its dtype and on its device,
        not yet served (`put_adapter`); a PylonError naming the directory if it cannot be served as it is."""
        return lora.load_adapter(
            directory,
            self.model_type,
            self._adapter_shapes,
            dtype=self.dtype,
            device=self.device,
            max_rank=max_rank,
            rank_limit=rank_limit,
            held=(self.layers, self.config.num_hidden_layers) if self._staged else None,
            split=self._shard_adapters[1] if self.shard is not None else None,
        )

    @functools.cached_property
    def _adapter_shapes(self) -> dict[str, tuple[int, int]]:
        """Every adaptable projection's (in, out), read once (`lora.projection_shapes`): the whole model's for a
        tensor-parallel shard (an adapter is checked against them, then split)."""
        if self.shard is not None:
            return self._shard_adapters[0]
        return lora.projection_shapes(self.model, self.model_type)

    @functools.cached_property
    def _shard_adapters(self) -> tuple[dict[str, tuple[int, int]], Callable, tuple[frozenset[str], Callable]]:
        """A tensor-parallel shard's adapters (`lora.load_adapters`' `shard`): the whole model's projection shapes,
        this shard's part of each adapter's matrices, and its row-parallel projections' low-rank sums all-reduced."""
        import torch.distributed as dist

        shapes = lora.projection_shapes(self.model, self.model_type)
        split = shards.adapter_split(self._whole_config, self.shard, shapes)
        reduced = (shards.row_parallel_paths(lora.PROJECTIONS[self.model_type]), dist.all_reduce)
        return shards.whole_shapes(self._whole_config, self.model_type), split, reduced

    def put_adapter(self, slot: int, adapter) -> None:
        """Serve `adapter` (`read_adapter`'s) in `slot` from the next step on; None empties the slot."""
        if self.adapter_set is None:
            num_layers = len(self.model.get_submodule(lora.LAYERS[self.model_type]))
            reduced = self._shard_adapters[2] if self.shard is not None else None
            self.adapter_set = lora.AdapterSet([], self.model_type, num_layers, reduced)
        self.adapter_set.put(slot, adapter)
        self.adapter_bytes = self.adapter_set.nbytes

    def _step_adapters(
        self, steps: list[StepSequence], num_rows: int, last_tokens: list[int], final: Final
    ) -> lora.StepAdapters:
        """Each row's adapter: the step's token rows (padding rows past the tokens are base rows), and the rows the
        last layer keeps after attention (`final.rows`: `last_tokens`), their index tensors staged with the step's."""
        slots = [s.adapter for s in steps for _ in range(s.num_new_tokens)]
        tokens = self.adapter_set.rows(slots, num_rows, self.stage.add)
        if final.rows is None:  # decodes only: the last layer keeps every row
            return lora.StepAdapters(tokens, tokens)
        finals = self.adapter_set.rows([slots[t] for t in last_tokens], len(last_tokens), self.stage.add)
        return lora.StepAdapters(tokens, finals)

    def _attend(
        self,
        i: int,
        last: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        h: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        scale: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer i's attention output and the hidden states it is added to: every token's, or in the `last`
        layer the sampling tokens' only (see Final); `(None, h)` there when no token samples. Rows past the step's
        tokens (`execute`'s padding) have their keys and values stored nowhere and an attention output of zeros.
        A layer with a sliding window attends through the windowed metadata, where the step has one of its own
        (`AttentionMetadata.windowed`); a layer of the KV cache's group g > 0, through that group's
        (`AttentionMetadata.kv_groups`)."""
        if meta.kv_groups:
            g = self.group_of[i]
            if g:
                meta = meta.kv_groups[g]
                if final.meta is not None:
                    final = Final(final.rows, final.meta.kv_groups[g])
        elif meta.windowed is not None and self.layer_windows[i] is not None:
            meta = meta.windowed
            if final.meta is not None:
                final = Final(final.rows, final.meta.windowed)
        if meta.slot_mapping is not None and len(k) > len(meta.slot_mapping):
            k, v = k[: len(meta.slot_mapping)], v[: len(meta.slot_mapping)]
        sinks = self.attn_sinks[i] if self.attn_sinks is not None else None
        if not last:
            attended = paged_attention(
                q,
                k,
                v,
                self.k_cache[i],
                self.v_cache[i],
                meta,
                scale,
                self.workspace,
                softcap=self.attn_softcap,
                sinks=sinks,
            )
            return attended, h
        store_kv_pair(
            self.k_cache[i],
            self.v_cache[i],
            meta.slot_mapping,
            k,
            v,  # every token's, as
            kernel=meta.kernel,
        )  # paged_attention would
        if final.rows is not None:
            h, q = h[final.rows], q[final.rows]
        if final.meta is None:
            return None, h
        attended = paged_attention(
            q,
            None,
            None,
            self.k_cache[i],
            self.v_cache[i],
            final.meta,
            scale,
            self.workspace,
            softcap=self.attn_softcap,
            sinks=sinks,
        )
        return attended, h

    def _forward_gpt2(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        adapters: lora.StepAdapters | None = None,
    ) -> torch.Tensor:
        """Final hidden states (after ln_f) of GPT-2 (pre-norm blocks, learned positions) at the sampling tokens
        (`final`): `[sampling tokens, hidden]`.

        The loaded model's own parameters, called through the functional ops its modules would run (GPT-2's
        Conv1D is `addmm(bias, x, weight)`, or oneDNN's linear over the reordered weight; dropout is the identity
        in eval): the same arithmetic without a dozen module calls and shape juggling per layer, which on a small
        model is a good part of a step.

        `adapters`: each LoRA adapter's delta is added to its rows' output of each projection (`lora.Rows.add`);
        the last layer's rows past attention are `final`'s."""
        T = len(ids)
        h = F.embedding(ids, self._gpt2.wte) + F.embedding(positions, self._gpt2.wpe)
        last = len(self._gpt2.layers) - 1
        mm = self._mm
        rows = adapters.tokens if adapters is not None else None  # None: no row of this part of the step adapted
        for i, layer in enumerate(self._gpt2.layers):
            x = F.layer_norm(h, *layer.ln_1)
            qkv = mm(layer.qkv_b, x, layer.qkv_w)
            if rows is not None:
                rows.add(qkv, x, i, "attn.c_attn")
            q, k, v = qkv.view(T, 3, layer.heads, layer.head_dim).unbind(1)
            # layer.scaling is attn.scaling: it folds in scale_attn_weights and scale_attn_by_inverse_layer_idx.
            a, h = self._attend(i, i == last, q, k, v, h, meta, final, layer.scaling)
            if a is None:
                break
            if i == last and adapters is not None:
                rows = adapters.finals  # the sampling rows only, from here on
            T = len(h)
            a = a.view(T, -1)
            proj = mm(layer.proj_b, a, layer.proj_w)
            if rows is not None:
                rows.add(proj, a, i, "attn.c_proj")
            h = h + proj
            x = F.layer_norm(h, *layer.ln_2)
            fc = mm(layer.fc_b, x, layer.fc_w)
            if rows is not None:
                rows.add(fc, x, i, "mlp.c_fc")
            up = self._gpt2_act(fc)
            down = mm(layer.down_b, up, layer.down_w)
            if rows is not None:
                rows.add(down, up, i, "mlp.c_proj")
            h = h + down
        return F.layer_norm(h, *self._gpt2.ln_f)

    def _forward_neox(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        adapters: lora.StepAdapters | None = None,
    ) -> torch.Tensor:
        """Final hidden states of GPT-NeoX (Pythia, GPT-NeoX-20B, Dolly v2: LayerNorms; one fused projection whose
        output holds each head's query, key and value side by side; the rotary embedding of the first
        `partial_rotary_factor` of each head's dimensions; the attention and the MLP side by side on the same input
        where `use_parallel_residual`, else one after the other) at the sampling tokens (`final`), its modules' own
        computations in GPTNeoXLayer's order. `adapters`: as in `_forward_gpt2`."""
        neox = self.model.gpt_neox
        h = neox.embed_in(ids)
        cos, sin = neox.rotary_emb(h, positions[None])
        parallel = self.config.use_parallel_residual
        last = len(neox.layers) - 1
        rows = adapters.tokens if adapters is not None else None

        def project(module, x, i, name):
            return module(x) if rows is None else rows.add(module(x), x, i, name)

        for i, layer in enumerate(neox.layers):
            attn, mlp = layer.attention, layer.mlp
            T = len(h)
            x = layer.input_layernorm(h)
            qkv = project(attn.query_key_value, x, i, "attention.query_key_value").view(T, -1, 3 * attn.head_size)
            q, k, v = qkv.chunk(3, dim=-1)
            q, k = self._apply_rope(q, k, cos[0], sin[0], unsqueeze_dim=1)
            # h: the layer's input (its sampling rows' in the last layer)
            a, h = self._attend(i, i == last, q, k, v, h, meta, final, attn.scaling)
            if a is None:
                break
            if i == last and adapters is not None:
                rows = adapters.finals
            o = project(attn.dense, a.reshape(len(h), -1), i, "attention.dense")
            # the MLP of the layer's input (parallel residual) or of the input plus the attention's output
            x = layer.post_attention_layernorm(h if parallel else h + o)
            up = mlp.act(project(mlp.dense_h_to_4h, x, i, "mlp.dense_h_to_4h"))
            h = h + o + project(mlp.dense_4h_to_h, up, i, "mlp.dense_4h_to_h")
        return neox.final_layer_norm(h)

    def _forward_opt(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        adapters: lora.StepAdapters | None = None,
    ) -> torch.Tensor:
        """Final hidden states of OPT (learned positions, offset by 2; LayerNorms before each block, or after them
        where `do_layer_norm_before` is false, as OPT-350m; a ReLU MLP of fc1 and fc2; 350m's project_in and
        project_out between its 512-wide embeddings and its 1024-wide layers) at the sampling tokens (`final`), the
        loaded modules' own computations in OPTDecoder's order. The queries' scale goes to the attention (OPT
        multiplies its queries by it before; the same product). `adapters`: as in `_forward_gpt2`."""
        decoder = self.model.model.decoder
        h = decoder.embed_tokens(ids)
        if decoder.project_in is not None:
            h = decoder.project_in(h)
        h = h + F.embedding(positions + decoder.embed_positions.offset, decoder.embed_positions.weight)
        before = self.config.do_layer_norm_before
        last = len(decoder.layers) - 1
        rows = adapters.tokens if adapters is not None else None

        def project(module, x, i, name):
            return module(x) if rows is None else rows.add(module(x), x, i, name)

        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(h) if before else h
            T = len(x)
            q = project(attn.q_proj, x, i, "self_attn.q_proj").view(T, attn.num_heads, attn.head_dim)
            k = project(attn.k_proj, x, i, "self_attn.k_proj").view(T, attn.num_heads, attn.head_dim)
            v = project(attn.v_proj, x, i, "self_attn.v_proj").view(T, attn.num_heads, attn.head_dim)
            a, h = self._attend(i, i == last, q, k, v, h, meta, final, attn.scaling)
            if a is None:
                break
            if i == last and adapters is not None:
                rows = adapters.finals
            a = a.reshape(len(h), -1)
            h = h + project(attn.out_proj, a, i, "self_attn.out_proj")
            if not before:
                h = layer.self_attn_layer_norm(h)
            x = layer.final_layer_norm(h) if before else h
            up = layer.activation_fn(project(layer.fc1, x, i, "fc1"))
            h = h + project(layer.fc2, up, i, "fc2")
            if not before:
                h = layer.final_layer_norm(h)
        if decoder.final_layer_norm is not None:
            h = decoder.final_layer_norm(h)
        if decoder.project_out is not None:
            h = decoder.project_out(h)
        return h

    def _forward_llama(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
        adapters: lora.StepAdapters | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (after the last RMSNorm) of Llama (RoPE, grouped-query attention) at the sampling
        tokens (`final`): `[sampling tokens, hidden]`, and of the families built as it is
        (`families.LLAMA_FAMILIES`): the projections' biases are the modules' own, and a layer with `q_norm` and
        `k_norm` (Qwen3, Gemma 3) normalises each head's query and key before the rotary embedding (OLMo 2's norms span
        all the heads at once: `_qk_norms`). Gemma 3 (see families.py): its embedding module scales, its norms compute
        x * (1 + w), each layer takes the rotary embedding of its type (`_rope_types`), and the attention's and the
        MLP's outputs are normalised before they join the residual (`_output_norms`; Gemma 2's too, and OLMo 2's,
        whose inputs are not normalised: `_input_norms`). Granite: its multipliers (`_embedding_multiplier`,
        `_residual_multiplier`; `logits_scaling` in `logits`). SmolLM3: no rotary embedding in its NoPE layers
        (`_rotates`). Phi-3: its fused projections (`_fused`: qkv_proj split into queries, keys and values;
        gate_up_proj) and the rotary embedding of the first `partial_rotary_factor` of each head's dimensions
        (`_apply_rope`). `adapters`: as in `_forward_gpt2`; the MLP is written out (LlamaMLP's
        and Gemma3MLP's forward: down(act(gate(x)) * up(x)); Phi3MLP's with gate and up from one projection) for the
        rows that need its projections' deltas. A pipeline stage (`self.pipeline`) computes its own layers only,
        from `hidden`, the previous stage's output, unless it is the first, and returns its last layer's output
        without the final norm (see `execute_step`)."""
        llama = self.model.model
        wide = deepstack = None
        if hidden is not None and self.mtp_input is not None:  # a multi-token-prediction layer: h and the next tokens
            h, wide = self.mtp_input(llama.embed_tokens(ids), positions, hidden)
        elif hidden is not None:
            h = hidden
        else:
            h = llama.embed_tokens(ids)
            if self._embedding_multiplier is not None:  # Granite: GraniteModel scales its embeddings
                h = h * self._embedding_multiplier
            if images is not None:  # the images' rows in place of their placeholders' (after Gemma 3's scaling)
                image_rows, embeds = images
                if embeds.dim() == 3:  # Qwen3-VL: [rows, 1 + levels, hidden], the later ones added after layers
                    embeds, deepstack = embeds[:, 0], embeds[:, 1:].to(h.dtype)
                h = h.index_copy(0, image_rows, embeds.to(h.dtype))
        rope_types, output_norms, input_norms = self._rope_types, self._output_norms, self._input_norms
        residual = self._residual_multiplier  # Granite: each output scaled as it joins the residual
        qk_norms, rotates = self._qk_norms, self._rotates
        fused, apply_rope = self._fused, self._apply_rope
        if rope_types is None:
            # [1, T, head_dim]; handles rope scaling variants, and M-RoPE's three positions a row (`_step_rope`)
            rotary = llama.rotary_emb(h, positions[None] if self._step_rope is None else self._step_rope[:, None])
            # (DeepSeek-V2's: one complex tensor of frequencies, [1, T, rotated dims / 2])
            cos, sin = (rotary, rotary) if isinstance(rotary, torch.Tensor) else rotary
        else:  # one per layer type, as Gemma3TextModel computes them
            ropes = {t: llama.rotary_emb(h, positions[None], t) for t in set(rope_types)}
        last = len(llama.layers) - 1
        rows = adapters.tokens if adapters is not None else None  # None: no row of this part of the step adapted
        query_scale = nope_scale = None
        if self._llama4_scale is not None:  # Ministral 3: [T, 1, 1], 1 within original_max_position_embeddings
            beta, original = self._llama4_scale
            query_scale = (1 + beta * torch.log1p(torch.floor(positions / original)))[:, None, None].to(h.dtype)
        if self._nope_temperature is not None:  # Llama 4's NoPE layers: [T, 1, 1] in float32, as it scales them
            attn_scale, floor_scale = self._nope_temperature
            nope_scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            nope_scale = nope_scale[:, None, None]
        keep = self.keep_layers if self.keep_hidden else ()
        for i in self.layers:
            layer = llama.layers[i]
            if deepstack is not None and 0 < i <= deepstack.shape[1]:  # Qwen3-VL: the vision tower's inner features
                h = h.index_add(0, image_rows, deepstack[:, i - 1])  # added to the image rows' output of layer i - 1
            if i in keep:  # (an EAGLE-3 head's: this layer's input, every row)
                self._kept[i] = h
            if rope_types is not None:
                cos, sin = ropes[rope_types[i]]
            if self._linear is not None and self._linear[i]:  # Qwen3-Next's recurrent layers
                h = h + self._linear_attention(i, layer.linear_attn, layer.input_layernorm(h))
                if i == last and final.rows is not None:
                    h = h[final.rows]
                if i == last and adapters is not None:
                    rows = adapters.finals
                x = layer.post_attention_layernorm(h)
                h = h + (layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i))
                continue
            attn = layer.self_attn
            x = layer.input_layernorm(h) if input_norms else h
            if wide is not None and i == 0:  # an EAGLE-3 head's first layer: [its embeddings' norm, its h's]
                x = wide
            if self._mla is not None:  # DeepSeek: attention over latents (`_mla_attention`)
                a, h = self._mla_attention(i, i == last, attn, x, h, cos[0], sin[0], meta, final)
                if a is None:
                    break
                if i == last and adapters is not None:
                    rows = adapters.finals
                o = attn.o_proj(a) if rows is None else rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
                h = h + o
                x = layer.post_attention_layernorm(h)
                h = h + (layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i))
                continue
            if fused:  # Phi-3: one projection, queries then keys then values along its output
                qkv = attn.qkv_proj(x)
                if rows is not None:
                    rows.add(qkv, x, i, "self_attn.qkv_proj")
                q, k, v = qkv.split(self._qkv_sizes, dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
                if rows is not None:
                    rows.add(q, x, i, "self_attn.q_proj")
                    rows.add(k, x, i, "self_attn.k_proj")
                    rows.add(v, x, i, "self_attn.v_proj")
            T = len(x)
            if self._gated_attention:  # Qwen3-Next: each head's query, then its output gate
                q, gate = q.view(T, -1, attn.head_dim * 2).chunk(2, dim=-1)
                gate = gate.reshape(T, -1)
            if qk_norms == "all":  # OLMo 2: an RMSNorm over all the heads' queries (and keys) at once
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.view(T, -1, attn.head_dim), k.view(T, -1, attn.head_dim), v.view(T, -1, attn.head_dim)
            if qk_norms == "head":  # Qwen3, Gemma 3: an RMSNorm over each head's dimensions
                q, k = attn.q_norm(q), attn.k_norm(k)
            if rotates is None or rotates[i]:  # (SmolLM3's NoPE layers attend without positions)
                q, k = apply_rope(q, k, cos[0], sin[0], unsqueeze_dim=1)  # heads sit at dim 1 here
            if self._qk_norms_after_rope:
                q, k = attn.query_layernorm(q), attn.key_layernorm(k)
            if self._l2_qk_norm and rotates[i]:  # Llama 4's rotating layers
                q, k = attn.qk_norm(q), attn.qk_norm(k)
            if query_scale is not None:
                q = q * query_scale
            if nope_scale is not None and not rotates[i]:  # Llama 4's NoPE layers
                q = (q * nope_scale).to(q.dtype)
            a, h = self._attend(i, i == last, q, k, v, h, meta, final, attn.scaling)
            if a is None:
                break
            if i == last and adapters is not None:
                rows = adapters.finals  # the sampling rows only, from here on
            a = a.reshape(len(h), -1)
            if self._gated_attention:
                a = a * torch.sigmoid(gate if i != last or final.rows is None else gate[final.rows])
            if self._parallel:  # Cohere: the MLP reads the attention's input (that of the sampling rows, in the last)
                if i == last and final.rows is not None:
                    x = x[final.rows]
                o = attn.o_proj(a) if rows is None else rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
                h = h + o + (layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i))
                continue
            if self._glm_norms:  # GLM-4: the attention's and the MLP's outputs normalised before they join h
                o = attn.o_proj(a) if rows is None else rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
                h = h + layer.post_self_attn_layernorm(o)
                x = layer.post_attention_layernorm(h)
                h = h + layer.post_mlp_layernorm(layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i))
                continue
            # Gemma 2 and 3, OLMo 2: the attention's and the MLP's outputs normalised before they join h
            if output_norms:
                o = attn.o_proj(a) if rows is None else rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
                h = h + layer.post_attention_layernorm(o)
                x = layer.pre_feedforward_layernorm(h) if input_norms else h
                h = h + layer.post_feedforward_layernorm(layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i))
                continue
            if residual is not None:  # Granite
                o = attn.o_proj(a) if rows is None else rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
                h = h + o * residual
                x = layer.post_attention_layernorm(h)
                h = h + (layer.mlp(x) if rows is None else self._mlp(layer, x, rows, i)) * residual
                continue
            if rows is None:
                h = h + attn.o_proj(a)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                continue
            h = h + rows.add(attn.o_proj(a), a, i, "self_attn.o_proj")
            h = h + self._mlp(layer, layer.post_attention_layernorm(h), rows, i)
        return h if self._staged else llama.norm(h)

    def _linear_attention(self, i: int, attn, x: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's Gated DeltaNet layer `attn` over the step's rows `x` (`[T, hidden]`, normed), as
        Qwen3NextGatedDeltaNet computes it with a cache, one sequence at a time (`_step_spans`): its queries, keys and
        values through the depthwise causal convolution continued from the sequence's last inputs, then the gated
        delta rule from the sequence's state (the chunked rule over a prompt's chunk, the recurrent one for a
        decode), the gated norm and the output projection. Each sequence's state is kept for its next step; a
        sequence at position 0 starts from zeros."""
        T = len(x)
        if hasattr(attn, "in_proj_qkvz"):  # Qwen3-Next: queries, keys, values and gates interleaved by key head
            qkvz, ba = attn.in_proj_qkvz(x)[None], attn.in_proj_ba(x)[None]
            q, k, v, z, b, a = attn.fix_query_key_value_ordering(qkvz, ba)
            mixed = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], dim=-1)[0].t()  # [conv_dim, T]
        else:  # Qwen3.5: a projection each
            mixed, z = attn.in_proj_qkv(x).t(), attn.in_proj_z(x)
            b, a = attn.in_proj_b(x)[None], attn.in_proj_a(x)[None]
        beta = b.sigmoid()
        g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
        weight = attn.conv1d.weight  # [conv_dim, 1, kernel]
        width, layer = weight.shape[-1] - 1, self._state_slot[i]
        chunk_rule, recurrent_rule = self._delta_rules
        out = torch.zeros(T, attn.num_v_heads, attn.head_v_dim, dtype=x.dtype, device=x.device)  # (padded rows: 0)
        spans = self._step_spans
        # Decodes of sequences with a state: one batched convolution and recurrent step for all of them.
        decodes = [
            (offset, key)
            for offset, n, key, start in spans
            if n == 1 and start > 0 and key in self._states and self._states[key][layer][1] is not None
        ]
        if len(decodes) > 1 and self.batch_recurrent_decodes:
            self._recurrent_decodes(attn, decodes, layer, mixed, g, beta, out, x.dtype)
            done = {offset for offset, _ in decodes}
            spans = [span for span in spans if span[0] not in done]
        for offset, n, key, start in spans:
            states = self._states.get(key)
            if states is None or (start == 0 and layer == 0):  # a new sequence, or one computed again from its start
                states = self._states[key] = [[None, None] for _ in range(self._num_states)]
            state = states[layer]
            if start == 0 or state[0] is None:
                state[0] = torch.zeros(mixed.shape[0], width, dtype=mixed.dtype, device=mixed.device)
            seen = torch.cat([state[0], mixed[:, offset : offset + n]], dim=1)
            state[0] = seen[:, seen.shape[1] - width :]
            conv = ACT2FN[attn.activation](
                F.conv1d(seen[None].to(weight.dtype), weight, attn.conv1d.bias, groups=seen.shape[0])
            )
            qs, ks, vs = conv[0].t()[None].to(x.dtype).split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
            qs, ks = qs.reshape(1, n, -1, attn.head_k_dim), ks.reshape(1, n, -1, attn.head_k_dim)
            vs = vs.reshape(1, n, -1, attn.head_v_dim)
            if key in self._drafting and state[1] is not None:  # a decode and its drafts: a state after each token
                kept = self._drafted.setdefault(key, [[] for _ in range(self._num_states)])[layer]
                for j in range(n):
                    self.recurrent_rule_calls += 1
                    o, state[1] = recurrent_rule(
                        qs[:, j : j + 1],
                        ks[:, j : j + 1],
                        vs[:, j : j + 1],
                        g=g[:, offset + j : offset + j + 1],
                        beta=beta[:, offset + j : offset + j + 1],
                        initial_state=state[1],
                        output_final_state=True,
                        use_qk_l2norm_in_kernel=True,
                    )
                    out[offset + j] = o[0, 0].to(x.dtype)
                    kept.append((seen[:, j + 1 : j + 1 + width], state[1]))
                continue
            rule = recurrent_rule if n == 1 and state[1] is not None else chunk_rule
            self.recurrent_rule_calls += 1
            o, state[1] = rule(
                qs,
                ks,
                vs,
                g=g[:, offset : offset + n],
                beta=beta[:, offset : offset + n],
                initial_state=None if start == 0 else state[1],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            out[offset : offset + n] = o[0].to(x.dtype)
        z = z.reshape(T, -1, attn.head_v_dim)
        core = attn.norm(out.reshape(-1, attn.head_v_dim), z.reshape(-1, attn.head_v_dim))
        return attn.out_proj(core.reshape(T, -1))

    def _recurrent_decodes(self, attn, decodes, layer: int, mixed, g, beta, out, dtype) -> None:
        """`_linear_attention`'s decodes at once: each sequence's one new row through the convolution from its last
        inputs and one step of the recurrent delta rule from its state, the states stacked into a batch and written
        back (what a loop over the sequences computes, in one call each)."""
        rows = torch.tensor([offset for offset, _ in decodes], device=mixed.device)
        states = [self._states[key][layer] for _, key in decodes]
        weight = attn.conv1d.weight
        seen = torch.cat([torch.stack([s[0] for s in states]), mixed[:, rows].t()[:, :, None]], dim=2)  # [B, C, W+1]
        conv = ACT2FN[attn.activation](F.conv1d(seen.to(weight.dtype), weight, attn.conv1d.bias, groups=seen.shape[1]))
        qs, ks, vs = conv[:, :, -1].to(dtype)[:, None].split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
        B = len(decodes)
        qs, ks = qs.reshape(B, 1, -1, attn.head_k_dim), ks.reshape(B, 1, -1, attn.head_k_dim)
        vs = vs.reshape(B, 1, -1, attn.head_v_dim)
        self.recurrent_rule_calls += 1
        o, final = self._delta_rules[1](
            qs,
            ks,
            vs,
            g=g[0, rows][:, None],
            beta=beta[0, rows][:, None],
            initial_state=torch.cat([s[1] for s in states]),  # (each [1, heads, key_dim, value_dim])
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        out[rows] = o[:, 0].to(dtype)
        width = seen.shape[2] - 1
        for j, s in enumerate(states):
            s[0], s[1] = seen[j, :, seen.shape[2] - width :], final[j : j + 1]

    def keep_state(self, key: str, count: int, snapshot: int | None = None) -> list | None:
        """A speculating sequence's recurrent states as they were after the first `count` of its step's tokens (the
        decoded token and the drafts accepted), the rest let go; with `snapshot`, a copy of them after its first
        `snapshot` tokens (`snapshot_state`'s form) is returned."""
        drafted = self._drafted.pop(key, None)
        states = self._states.get(key)
        if drafted is None or states is None:
            return None
        copy = None  # (a pipeline stage's: its own layers' states; the others', none)
        if snapshot is not None:
            copy = [[t.clone() for t in layer[snapshot - 1]] if layer else [None, None] for layer in drafted]
        for layer, kept in enumerate(drafted):
            if kept:
                states[layer][0], states[layer][1] = kept[count - 1]
        return copy

    def snapshot_state(self, key: str) -> list:
        """A copy of a sequence's recurrent states (every recurrent layer's convolution inputs and delta-rule
        matrices), for `restore_state`."""
        return [[t.clone() if t is not None else None for t in layer] for layer in self._states[key]]

    def restore_state(self, key: str, snapshot: list) -> None:
        """A sequence's recurrent states from a snapshot (`snapshot_state` of another sequence at the same tokens):
        it continues from there."""
        self._states[key] = [[t.clone() if t is not None else None for t in layer] for layer in snapshot]

    def release_state(self, key: str) -> None:
        """Forget a finished sequence's recurrent state (`StepSequence.state`)."""
        self._states.pop(key, None)

    def _mla_attention(
        self,
        i: int,
        last: bool,
        attn,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        final: Final,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer i's latent attention (DeepSeek-V3's MLA; families.py), `[rows, heads x v_head_dim]` before o_proj,
        and the hidden states it joins (`_attend`'s). The cache holds each token's normed latent and rotated key part
        (one kv head); each head's query part times its key half of kv_b_proj is its query in the latent's space, so
        the scores are the expanded keys' scores, and the output over the latents times the value half is the
        expanded values' output."""
        keys_half, values_half = self._mla[i]  # [heads, nope, rank], [heads, v, rank]
        heads, nope, rank = keys_half.shape
        rope = attn.qk_rope_head_dim
        T = len(x)
        if attn.q_lora_rank is None:
            queries = attn.q_proj(x)
        else:
            queries = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q_pass, q_rot = queries.view(T, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        q_rot, k_rot = self._mla_rope(q_rot, k_rot.view(T, 1, rope), cos, sin, unsqueeze_dim=1)
        q = torch.cat([torch.einsum("thn,hnr->thr", q_pass, keys_half), q_rot], dim=-1)  # [T, heads, rank + rope]
        k = torch.cat([latent.view(T, 1, rank), k_rot], dim=-1)  # [T, 1, rank + rope]: its values too
        a, h = self._attend(i, last, q, k, k, h, meta, final, attn.scaling)
        if a is None:
            return None, h
        out = torch.einsum("thr,hvr->thv", a[..., :rank], values_half)  # the values' output, per head
        return out.reshape(len(h), -1), h

    def _mlp(self, layer, x: torch.Tensor, rows: lora.Rows, i: int) -> torch.Tensor:
        """Layer i's MLP of `x` with `rows`' adapters' deltas on its projections (an MoE layer's are not adapted:
        pylon.serving.model.lora)."""
        mlp = layer.mlp
        if self.moe_layers:
            return mlp(x)
        if hasattr(mlp, "c_fc"):  # Starcoder2MLP's forward: c_proj(act(c_fc(x))), no gate
            up = mlp.act(rows.add(mlp.c_fc(x), x, i, "mlp.c_fc"))
            return rows.add(mlp.c_proj(up), up, i, "mlp.c_proj")
        if hasattr(mlp, "gate_up_proj"):  # Phi3MLP's and Glm4MLP's forward: gate then up in one projection
            gate, up = rows.add(mlp.gate_up_proj(x), x, i, "mlp.gate_up_proj").chunk(2, dim=-1)
            up = up * mlp.activation_fn(gate)
            return rows.add(mlp.down_proj(up), up, i, "mlp.down_proj")
        if not hasattr(mlp, "gate_proj"):  # ArceeMLP's forward: down(act(up(x))), no gate
            up = mlp.act_fn(rows.add(mlp.up_proj(x), x, i, "mlp.up_proj"))
            return rows.add(mlp.down_proj(up), up, i, "mlp.down_proj")
        gate = rows.add(mlp.gate_proj(x), x, i, "mlp.gate_proj")
        up = mlp.act_fn(gate) * rows.add(mlp.up_proj(x), x, i, "mlp.up_proj")
        return rows.add(mlp.down_proj(up), up, i, "mlp.down_proj")
