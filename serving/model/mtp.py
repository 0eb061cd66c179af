"""A checkpoint's multi-token-prediction layer, read as a draft module (`engine.speculative.method: mtp`).

DeepSeek-V3 (V3.1, R1) and GLM-4.5 (GLM-4.5-Air, GLM-4.6) were trained to predict a second token ahead: past the
model's `num_hidden_layers` decoder layers their checkpoints hold `num_nextn_predict_layers` more (`model.layers.{N}`,
N = num_hidden_layers), which transformers does not load. Each is a decoder layer of the model's own kind (its
attention, its MoE block) with a few tensors of its own:

- at position p it reads the model's final hidden state h_p (after the model's last norm) and the embedding of the
  token at p + 1, each RMS-normed (`hnorm`, `enorm`), and projects their concatenation back to the model's width
  (`eh_proj`);
- its decoder layer runs over that, attending over the positions before p in a KV cache of its own;
- its output, through its final norm (`shared_head.norm`) and the model's output layer, scores the token at p + 2.

The embeddings and the output layer are the model's (DeepSeek-V3's report, 2.2: "shared with the main model"; the
checkpoint's copies under the layer, `embed_tokens` and `shared_head.head`, are not read, so they take no memory), and
position 0's embedding is zeroed as vLLM's `DeepSeekMultiTokenPredictorLayer` zeroes it. The first of the layers is
read (DeepSeek-V3 and GLM-4.5 ship one); it proposes every draft, further drafts feeding it its own output in place of
h, as vLLM runs them.

Qwen3-Next and Qwen3.5 ship theirs under `mtp.` (`mtp.layers.0`, which transformers skips too), as vLLM's
`qwen3_next_mtp` reads it: the same computation with their names (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`fc`, the final norm `mtp.norm`), a full-attention decoder layer of the family's (its gated attention, its MoE block
where the model has them), position 0's embedding kept, and the output after the norm fed to the next draft (DeepSeek's
before it). The model's layers there are recurrent; the layer is not.

This module builds it as a model of one decoder layer of the family's class (`load`): the layer's tensors read under the
model's names for layer 0 (an MoE layer: `first_k_dense_replace` 0), the final norm `shared_head.norm`, and the input
projection `MtpInput` beside them; `ModelRunner(mtp=...)` runs it (its `hidden` input, its output before the norm),
and pylon.serving.engine.mtp drafts with it.
"""

from __future__ import annotations

import copy
import os

import torch

from pylon.errors import PylonError

# Families whose checkpoints' multi-token-prediction layers are read (their layouts, above): DeepSeek's, at
# `model.layers.{N}`, and Qwen's, under `mtp.`.
DEEPSEEK_LAYOUT = ("deepseek_v3", "glm4_moe")
QWEN_LAYOUT = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MTP_FAMILIES = DEEPSEEK_LAYOUT + QWEN_LAYOUT
# The layer's input tensors (`MtpInput`): the next token's embedding's norm, the hidden state's, the projection.
_INPUTS = {"deepseek": ("enorm", "hnorm", "eh_proj"), "qwen": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")}
_UNREAD = ("embed_tokens", "shared_head.head")  # DeepSeek's layer's copies of the model's embeddings and output layer
_SHARED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})  # the model's, given by the caller


def refused(model_type: str, config) -> str | None:
    """Why the model's checkpoint has no multi-token-prediction layer to draft with, or None."""
    if model_type not in MTP_FAMILIES:
        return (
            f"a {model_type} checkpoint has no multi-token-prediction layer the engine reads (it reads "
            f"{', '.join(MTP_FAMILIES)}'s: DeepSeek-V3, R1, GLM-4.5, Qwen3-Next, Qwen3.5); use method ngram or draft"
        )
    if model_type in QWEN_LAYOUT:
        if getattr(config, "mtp_num_hidden_layers", 1) == 0:
            return "its config.json says mtp_num_hidden_layers 0: the checkpoint has no multi-token-prediction layer"
        return None
    if not getattr(config, "num_nextn_predict_layers", 0):
        return (
            "its config.json says num_nextn_predict_layers 0: the checkpoint has no multi-token-prediction layer "
            "(Kimi K2 and Moonlight ship none); use method ngram or draft"
        )
    return None


def layout(model_type: str) -> str:
    return "qwen" if model_type in QWEN_LAYOUT else "deepseek"


class MtpInput(torch.nn.Module):
    """The layer's input: eh_proj([enorm(embedding of the next token), hnorm(h)]), position 0's embedding zeroed
    (DeepSeek's names); fc([pre_fc_norm_embedding(...), pre_fc_norm_hidden(h)]), none zeroed (Qwen's)."""

    def __init__(self, norm: type, hidden_size: int, eps: float, kind: str) -> None:
        super().__init__()
        self.names = _INPUTS[kind]
        self.zero_first = kind == "deepseek"
        embedding, hidden, projection = self.names
        setattr(self, embedding, norm(hidden_size, eps=eps))
        setattr(self, hidden, norm(hidden_size, eps=eps))
        setattr(self, projection, torch.nn.Linear(2 * hidden_size, hidden_size, bias=False))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedding, previous, projection = (getattr(self, name) for name in self.names)
        if self.zero_first:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        # (and no input of the first layer's own: its input norm of h)
        return projection(torch.cat([embedding(embeds), previous(hidden.to(embeds.dtype))], dim=-1)), None


def layer_config(config):
    """The model of the layer alone: one decoder layer, sparse as the layer is (DeepSeek's: its index is past
    `first_k_dense_replace`; Qwen's: full attention), no vocabulary of its own (the model's embeddings and head are
    given to it)."""
    local = copy.deepcopy(config)
    local.num_hidden_layers = 1
    if layout(config.model_type) == "qwen":
        local.layer_types = ["full_attention"]
        local.mlp_only_layers = []
    else:
        local.first_k_dense_replace = 0
        local.num_nextn_predict_layers = 0
    local.vocab_size = 1
    local.pad_token_id = None
    local.tie_word_embeddings = False
    return local


def _checkpoint_names(kind: str, index: int):
    """The model's tensor names of the checkpoint's layer (`load_shard`'s `names`): DeepSeek's `model.layers.{index}`,
    Qwen's `mtp.layers.0` and its norms and projection under `mtp.`."""
    prefix, norm = (f"model.layers.{index}.", "shared_head.norm.") if kind == "deepseek" else ("mtp.", "norm.")
    inputs = tuple(f"{name}." for name in _INPUTS[kind])
    layer = "layers.0." if kind == "qwen" else ""

    def names(files: dict[str, str]) -> dict[str, str]:
        named = {}
        for name in files:
            if not name.startswith(prefix):
                continue
            rest = name.removeprefix(prefix)
            if kind == "deepseek" and rest.startswith(_UNREAD):
                continue
            if rest.startswith(norm):
                named["model.norm." + rest.removeprefix(norm)] = name
            elif rest.startswith(inputs):
                named["mtp_input." + rest] = name
            elif rest.startswith(layer):
                named["model.layers.0." + rest.removeprefix(layer)] = name
        return named

    return names


def _layer_class(config) -> type:
    """The family's causal LM class, its construction ending with the layer's input beside the model (`mtp_input`)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    base = _get_model_class(config, AutoModelForCausalLM._model_mapping)

    class MtpModel(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            norm = type(self.model.norm)
            self.mtp_input = MtpInput(norm, config.hidden_size, config.rms_norm_eps, layout(config.model_type))

    # (named as its class, and of its module: the runner reads the family's functions from the model's module)
    MtpModel.__name__ = MtpModel.__qualname__ = base.__name__
    MtpModel.__module__ = base.__module__
    return MtpModel


def load(model_dir: str, config, dtype: torch.dtype, model: torch.nn.Module, shard=None) -> torch.nn.Module:
    """The first multi-token-prediction layer of `model_dir`'s checkpoint (its config `config`) as a causal LM of one
    decoder layer with `mtp_input`, in `dtype` on the CPU, sharing `model`'s embeddings and output layer (`model`: the
    served model, as loaded); `shard`: a tensor-parallel shard's slices of it (pylon.serving.model.tensor; `model` that
    shard's, its vocabulary's rows), its input projection and norms whole."""
    from pylon.serving.model import tensor as shards

    index, kind = config.num_hidden_layers, layout(config.model_type)
    files = shards._weight_files(model_dir)
    wanted = f"model.layers.{index}.eh_proj.weight" if kind == "deepseek" else "mtp.fc.weight"
    if wanted not in files:
        raise PylonError(
            f"model {model_dir}: its checkpoint holds no multi-token-prediction layer ({wanted} is in none of its "
            f"{'safetensors files' if len(set(files.values())) > 1 else os.path.basename(next(iter(files.values())))}"
            "; a checkpoint saved by transformers drops it): serve the checkpoint as released, or use method ngram"
        )
    local = layer_config(config)
    names = _checkpoint_names(kind, index)
    cls = _layer_class(local)
    shard = shard or shards.Shard(0, 1)
    layer = shards.load_shard(model_dir, local, dtype, shard, cls=cls, names=names, skip=_SHARED)
    layer.model.embed_tokens = model.get_input_embeddings()
    layer.lm_head = model.get_output_embeddings()
    layer.config.vocab_size = config.vocab_size
    return layer
