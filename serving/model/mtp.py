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

# Families whose checkpoints' multi-token-prediction layers are read (their layout, above).
MTP_FAMILIES = ("deepseek_v3", "glm4_moe")
_OWN = ("enorm", "hnorm", "eh_proj")  # the layer's input tensors (`MtpInput`)
_UNREAD = ("embed_tokens", "shared_head.head")  # its copies of the model's embeddings and output layer
_SHARED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})  # the model's, given by the caller


def refused(model_type: str, config) -> str | None:
    """Why the model's checkpoint has no multi-token-prediction layer to draft with, or None."""
    if model_type not in MTP_FAMILIES:
        return (
            f"a {model_type} checkpoint has no multi-token-prediction layer the engine reads (it reads "
            f"{', '.join(MTP_FAMILIES)}'s: DeepSeek-V3, R1, GLM-4.5); use method ngram or draft"
        )
    if not getattr(config, "num_nextn_predict_layers", 0):
        return (
            "its config.json says num_nextn_predict_layers 0: the checkpoint has no multi-token-prediction layer "
            "(Kimi K2 and Moonlight ship none); use method ngram or draft"
        )
    return None


class MtpInput(torch.nn.Module):
    """The layer's input: eh_proj([enorm(embedding of the next token), hnorm(h)]), position 0's embedding zeroed."""

    def __init__(self, norm: type, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.enorm = norm(hidden_size, eps=eps)
        self.hnorm = norm(hidden_size, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden_size, hidden_size, bias=False)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))


def layer_config(config):
    """The model of the layer alone: one decoder layer, sparse as the layer is (its index is past
    `first_k_dense_replace`), no vocabulary of its own (the model's embeddings and head are given to it)."""
    local = copy.deepcopy(config)
    local.num_hidden_layers = 1
    local.first_k_dense_replace = 0
    local.num_nextn_predict_layers = 0
    local.vocab_size = 1
    local.pad_token_id = None
    local.tie_word_embeddings = False
    return local


def _checkpoint_names(index: int):
    """The model's tensor names of the checkpoint's layer `index` (`load_shard`'s `names`)."""
    prefix = f"model.layers.{index}."

    def names(files: dict[str, str]) -> dict[str, str]:
        named = {}
        for name in files:
            if not name.startswith(prefix):
                continue
            rest = name.removeprefix(prefix)
            if rest.startswith(_UNREAD):
                continue
            if rest.startswith("shared_head.norm."):
                named["model.norm." + rest.removeprefix("shared_head.norm.")] = name
            elif rest.startswith(_OWN):
                named["mtp_input." + rest] = name
            else:
                named["model.layers.0." + rest] = name
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
            self.mtp_input = MtpInput(norm, config.hidden_size, config.rms_norm_eps)

    # (named as its class, and of its module: the runner reads the family's functions from the model's module)
    MtpModel.__name__ = MtpModel.__qualname__ = base.__name__
    MtpModel.__module__ = base.__module__
    return MtpModel


def load(model_dir: str, config, dtype: torch.dtype, model: torch.nn.Module) -> torch.nn.Module:
    """The first multi-token-prediction layer of `model_dir`'s checkpoint (its config `config`) as a causal LM of one
    decoder layer with `mtp_input`, in `dtype` on the CPU, sharing `model`'s embeddings and output layer (`model`: the
    served model, as loaded)."""
    from pylon.serving.model import tensor as shards

    index = config.num_hidden_layers
    files = shards._weight_files(model_dir)
    wanted = f"model.layers.{index}.eh_proj.weight"
    if wanted not in files:
        raise PylonError(
            f"model {model_dir}: its checkpoint holds no multi-token-prediction layer ({wanted} is in none of its "
            f"{'safetensors files' if len(set(files.values())) > 1 else os.path.basename(next(iter(files.values())))}"
            "; a checkpoint saved by transformers drops it): serve the checkpoint as released, or use method ngram"
        )
    local = layer_config(config)
    names = _checkpoint_names(index)
    cls = _layer_class(local)
    layer = shards.load_shard(model_dir, local, dtype, shards.Shard(0, 1), cls=cls, names=names, skip=_SHARED)
    layer.model.embed_tokens = model.get_input_embeddings()
    layer.lm_head = model.get_output_embeddings()
    layer.config.vocab_size = config.vocab_size
    return layer
