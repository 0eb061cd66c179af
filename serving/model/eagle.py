"""EAGLE draft heads, read as a draft module (`engine.speculative.method: eagle` or `eagle3`, `draft_model` the head's
directory).

An EAGLE head (Li et al., "EAGLE", 2024; "EAGLE-3", 2025) is a decoder layer or two trained on a model's own hidden
states to guess its next tokens; the model verifies them. It has no embeddings or output layer of its own to speak of
and cannot run alone, so it is not a draft model (`method: draft`): it runs as the checkpoint's multi-token-prediction
layer does (pylon.serving.model.mtp, pylon.serving.engine.mtp), from the model's hidden states, its KV cache beside
the model's in the model's blocks. Two kinds, as vLLM's `EagleLlamaForCausalLM` and `Eagle3LlamaForCausalLM` compute
them:

- **EAGLE** (EAGLE-1 and EAGLE-2's heads; HASS's): at position p it reads the model's final hidden state h_p (after
  the model's last norm) and the embedding of the token at p + 1, projects their concatenation to its width (`fc`,
  with a bias where the checkpoint has one; HASS's `add_para_norm`: each RMS-normed first), runs its decoder layers
  (Llama's, the first without its input norm), and its output as it is (no final norm), through the model's output
  layer, scores the token at p + 2. The next draft feeds that output in place of h. The embeddings and the output
  layer are the model's (a copy in the checkpoint is not read).
- **EAGLE-3**: it reads three of the model's hidden states at p, the inputs of its layers 2, N // 2 and N - 3 (N the
  model's layers; or the head's `eagle_aux_hidden_state_layer_ids`, numbered as vLLM numbers them: id j is the input
  of layer j, the output of layer j - 1), concatenated and projected to its width (`fc`): g. Its first decoder
  layer's attention reads [input_layernorm(embedding of the token at p + 1), hidden_norm(g)], twice the width, its
  residual g (`norm_before_residual`: hidden_norm(g)); its output through its final norm (`norm`) and its own output
  layer (`lm_head`, over a draft vocabulary of `draft_vocab_size` tokens: its token i is the model's i + d2t[i])
  scores the token at p + 2. The next draft feeds the output before the norm in place of g (not through `fc`). The
  embeddings are the head's where its checkpoint holds them, else the model's.

Checkpoints read: EAGLE's releases (`yuhuili/EAGLE-*`, `yuhuili/EAGLE3-*`, SGLang's `lmsys/sglang-EAGLE3-*`,
SpecForge's output: a Llama config.json, `LlamaForCausalLMEagle3` for EAGLE-3, tensors `midlayer.*` or `layers.0.*`,
pytorch_model.bin or safetensors), and the speculators format (vLLM's: `speculators_model_type`, the layer's config
under `transformer_layer_config`). Which kind a head is, its `fc` says (2 x its width: EAGLE; 3 x the model's: EAGLE-3).

This module reads and checks the head against the model (`read`: what is at fault named) and builds it as a Llama
causal LM of its decoder layers (`build`), its input `EagleInput` beside them as `mtp_input`; `ModelRunner(eagle=...)`
runs it.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch

from pylon.errors import PylonError

_SPECULATORS_KEYS = (  # a speculators config's keys of the head, beside its layer's config
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "add_para_norm",
)


@dataclass
class Head:
    """A head's checkpoint, read and checked against the model it drafts for."""

    directory: str
    kind: str  # "eagle" or "eagle3"
    config: object  # the head's decoder layers' LlamaConfig (vocab_size the model's)
    tensors: dict[str, torch.Tensor]  # by the head's names: fc.*, layers.{i}.*, norm.weight, lm_head.weight, d2t, ...
    aux_layers: tuple[int, ...]  # EAGLE-3: the model's layers whose inputs it reads; EAGLE: ()

    @property
    def own_embeddings(self) -> bool:
        return self.kind == "eagle3" and "embed_tokens.weight" in self.tensors


def config_dict(config: dict) -> dict:
    """A head's config.json, as the keys of its decoder layers' Llama config and the head's own (a speculators
    config's layer config beside its keys; SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` at the top)."""
    if isinstance(config.get("transformer_layer_config"), dict):  # the speculators format
        layer = dict(config["transformer_layer_config"])
        layer.update({k: config[k] for k in _SPECULATORS_KEYS if k in config})
        return layer
    eagle = config.get("eagle_config")  # (SGLang's heads keep the ids there)
    if isinstance(eagle, dict) and "eagle_aux_hidden_state_layer_ids" in eagle:
        config = {"eagle_aux_hidden_state_layer_ids": eagle["eagle_aux_hidden_state_layer_ids"], **config}
    return config


def layer_config(raw: dict, vocab_size: int, layers: int | None = None):
    """The head's decoder layers' LlamaConfig, from its `config_dict`, over the model's vocabulary."""
    from transformers import LlamaConfig

    known = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
    config = LlamaConfig(**known)
    config.num_hidden_layers = layers or int(raw.get("num_hidden_layers") or 1)  # (EAGLE's heads: one)
    config.vocab_size = vocab_size
    config.tie_word_embeddings = False
    config.pad_token_id = None
    return config


def head_params(method: str, raw: dict, target) -> tuple[object, int, int]:
    """For the planner, from a head's `config_dict` alone: its layers' config, and its parameters beyond the
    decoder layers (fc, its first layer's wider attention input, its output layer and norms) and in them."""
    config = layer_config(raw, target.vocab_size)
    width = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or width // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if method == "eagle":  # (fc and its bias; no final norm, its first layer no input norm: as many uncounted)
        return config, 2 * width * width + width - 2 * width, 0
    extra = 3 * target.hidden_size * width + (heads + 2 * kv) * head_dim * width + width  # (hidden_norm)
    return config, extra, int(raw.get("draft_vocab_size") or target.vocab_size) * width


def _read_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (safetensors, one file or an index of them, or pytorch_model.bin), by the
    head's names: a `model.` prefix dropped, `midlayer.` read as `layers.0.`, the speculators format's `fusion_fc` as
    `fc`."""
    from safetensors.torch import load_file

    files = []
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.exists(os.path.join(directory, index)):
            with open(os.path.join(directory, index)) as f:
                files = sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
            break
    for single in ("model.safetensors", "pytorch_model.bin"):
        if not files and os.path.exists(os.path.join(directory, single)):
            files = [os.path.join(directory, single)]
    if not files:
        raise PylonError(
            f"engine.speculative.draft_model {directory}: no weights (model.safetensors or pytorch_model.bin, one "
            "file or an index of them)"
        )
    raw: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            if path.endswith(".safetensors"):
                raw.update(load_file(path))
            else:
                raw.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # (a truncated or foreign file: which, and what it said)
            raise PylonError(
                f"engine.speculative.draft_model {directory}: {os.path.relpath(path, directory)} is unreadable as an "
                f"EAGLE head's weights ({type(e).__name__}: {e})"
            ) from None
    named = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        elif name.startswith("fusion_fc."):
            name = "fc." + name.removeprefix("fusion_fc.")
        named[name] = t
    return named


def read(directory: str, method: str, target) -> Head:
    """The EAGLE head in `directory` for the model of config `target`, of `method`'s kind (`eagle` or `eagle3`):
    refused, its fault named, where it is of the other kind or does not fit the model (widths, vocabulary, layers)."""
    where = f"engine.speculative.draft_model {directory}"
    try:
        with open(os.path.join(directory, "config.json")) as f:
            raw = config_dict(json.load(f))
    except (OSError, ValueError, AttributeError) as e:
        raise PylonError(f"{where}: config.json is not an EAGLE head's config ({type(e).__name__}: {e})") from None
    tensors = _read_tensors(directory)
    if "fc.weight" not in tensors:
        raise PylonError(
            f"{where}: not an EAGLE head (no fc.weight: the projection of the model's hidden states); a smaller "
            "model of the same tokenizer drafts with method draft"
        )
    width = int(raw.get("hidden_size") or 0)
    fc_in = tensors["fc.weight"].shape[1]
    target_hidden = target.hidden_size
    kind = "eagle" if fc_in == 2 * width else "eagle3" if fc_in == 3 * target_hidden else None
    if kind is None:
        raise PylonError(
            f"{where}: its fc.weight reads {fc_in} values a row: neither an EAGLE head's 2 x its hidden_size "
            f"({2 * width}) nor an EAGLE-3 head's 3 x the model's hidden_size ({3 * target_hidden})"
        )
    if kind != method:
        said = "an EAGLE head (fc: the embedding and the final hidden state)" if kind == "eagle" else "an EAGLE-3 head"
        raise PylonError(f"{where}: holds {said}, not {method}'s: set engine.speculative.method {kind}")
    if kind == "eagle" and width != target_hidden:
        raise PylonError(
            f"{where}: its hidden_size {width} is not the model's {target_hidden}: an EAGLE head reads the model's "
            "final hidden states as they are"
        )
    if kind == "eagle3" and int(raw.get("target_hidden_size") or width) != target_hidden:
        raise PylonError(
            f"{where}: its target_hidden_size {raw.get('target_hidden_size') or width} is not the model's hidden_size "
            f"{target_hidden}: it was trained for another model"
        )
    vocab = int(raw.get("vocab_size") or 0)
    if vocab != target.vocab_size:
        raise PylonError(
            f"{where}: its vocab_size {vocab} is not the model's {target.vocab_size}: it was trained for another "
            "model's tokenizer"
        )
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    if not layers or layers != list(range(len(layers))):
        raise PylonError(f"{where}: its decoder layers are not layers.0 .. layers.{{n - 1}} (found {layers})")
    config = layer_config(raw, target.vocab_size, len(layers))
    aux: tuple[int, ...] = ()
    if kind == "eagle3":
        n = target.num_hidden_layers
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
        if len(aux) != 3 or not all(0 < i < n for i in aux):
            whence = "its eagle_aux_hidden_state_layer_ids" if ids else "EAGLE-3's default (2, N // 2, N - 3)"
            raise PylonError(
                f"{where}: {whence} {list(aux)} are not three of the model's {n} layers (1 .. {n - 1}, the inputs of "
                "those layers)" + ("" if ids else ": set eagle_aux_hidden_state_layer_ids in its config.json")
            )
        draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
        config.draft_vocab_size = draft_vocab
        if draft_vocab != target.vocab_size or "d2t" in tensors:
            d2t = tensors.get("d2t")
            if d2t is None or d2t.shape != (draft_vocab,):
                raise PylonError(
                    f"{where}: its draft vocabulary of {draft_vocab} tokens needs d2t, a tensor of {draft_vocab} "
                    f"offsets to the model's tokens (found {None if d2t is None else tuple(d2t.shape)})"
                )
            targets = torch.arange(draft_vocab) + d2t.long()
            if int(targets.min()) < 0 or int(targets.max()) >= target.vocab_size:
                raise PylonError(f"{where}: its d2t maps draft tokens outside the model's {target.vocab_size}")
        if "lm_head.weight" not in tensors and draft_vocab != target.vocab_size:
            raise PylonError(f"{where}: no lm_head.weight, the output layer of its draft vocabulary")
        if width != target_hidden and "embed_tokens.weight" not in tensors:
            raise PylonError(
                f"{where}: its hidden_size {width} is not the model's {target_hidden} and it holds no "
                "embed_tokens.weight of its own"
            )
    return Head(directory, kind, config, tensors, aux)


class EagleInput(torch.nn.Module):
    """The head's input from the embeddings of the next tokens and the hidden states fed to it: `forward` returns
    (h, the first layer's attention input or None: its own input norm of h). EAGLE: h = fc([e, hidden]) (HASS's:
    each normed first), the first layer's input norm none. EAGLE-3: g = fc(hidden) where hidden is the model's three
    (a draft's own output passes as it is), h = g (or hidden_norm(g), `norm_before_residual`), the attention's input
    [input_layernorm(e), hidden_norm(g)]."""

    def __init__(self, head: Head) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        config = head.config
        width, eps = config.hidden_size, config.rms_norm_eps
        self.kind = head.kind
        fc = head.tensors["fc.weight"]
        self.fc = torch.nn.Linear(fc.shape[1], width, bias="fc.bias" in head.tensors)
        self.wide = fc.shape[1]  # the model's hidden states' width, as fed
        self.para_norm = head.kind == "eagle" and bool(getattr(config, "add_para_norm", False))
        if self.para_norm:
            self.embedding_layernorm = LlamaRMSNorm(width, eps=eps)
            self.hidden_states_layernorm = LlamaRMSNorm(width, eps=eps)
        if head.kind == "eagle3":
            self.input_layernorm = LlamaRMSNorm(width, eps=eps)  # (the checkpoint's layers.0.input_layernorm)
            self.hidden_norm = LlamaRMSNorm(width, eps=eps)
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        hidden = hidden.to(embeds.dtype)
        if self.kind == "eagle":
            if self.para_norm:
                embeds, hidden = self.embedding_layernorm(embeds), self.hidden_states_layernorm(hidden)
            return self.fc(torch.cat([embeds, hidden], dim=-1)), None
        g = self.fc(hidden) if hidden.shape[-1] == self.wide else hidden
        normed = self.hidden_norm(g)
        return (normed if self.norm_before_residual else g), torch.cat([self.input_layernorm(embeds), normed], dim=-1)


def build(head: Head, dtype: torch.dtype, model: torch.nn.Module, shard=None) -> torch.nn.Module:
    """The head as a Llama causal LM of its decoder layers with `mtp_input` (EagleInput), in `dtype` on the CPU,
    sharing `model`'s embeddings (unless an EAGLE-3 head holds its own) and, for EAGLE, its output layer (`model`: the
    served model, as loaded). EAGLE's final norm and first input norm are identities; EAGLE-3's first layer's
    attention projections read twice the width, its output layer the draft vocabulary (`draft_to_target`: each draft
    token's id in the model's vocabulary, a buffer). `shard`: a tensor-parallel shard's slices of its decoder layers
    (pylon.serving.model.tensor: its heads, its MLP slice; `model` that shard's), the rest whole."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from pylon.serving.model import tensor as shards

    split = shard is not None and shard.count > 1
    config = shards.local_config(head.config, shard.count) if split else copy.deepcopy(head.config)
    config.vocab_size = 1  # (no vocabulary of its own: the model's, or its draft one, given below)
    with no_init_weights():
        lm = LlamaForCausalLM._from_config(config, dtype=dtype)
    lm.config.vocab_size = head.config.vocab_size
    first = lm.model.layers[0]
    lm.mtp_input = EagleInput(head).to(dtype)
    state = {}
    for name, t in head.tensors.items():
        if name.startswith(("fc.", "embedding_layernorm.", "hidden_states_layernorm.")):
            state["mtp_input." + name] = t
        elif name in ("layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight") and head.kind == "eagle3":
            state["mtp_input." + name.removeprefix("layers.0.")] = t
        elif name == "layers.0.input_layernorm.weight":  # (EAGLE's first layer has none: not read, as vLLM's)
            continue
        elif name.startswith("layers.") or (name == "norm.weight" and head.kind == "eagle3"):
            state["model." + name] = t
    if head.kind == "eagle":
        first.input_layernorm = torch.nn.Identity()
        lm.model.norm = torch.nn.Identity()
        lm.lm_head = model.get_output_embeddings()
    else:
        first.input_layernorm = torch.nn.Identity()  # (its norm of the embeddings is EagleInput's)
        attn = first.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, torch.nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None))
        if "lm_head.weight" in head.tensors:
            rows = head.tensors["lm_head.weight"].shape[0]
            lm.lm_head = torch.nn.Linear(config.hidden_size, rows, bias=False)
            state["lm_head.weight"] = head.tensors["lm_head.weight"]
        else:
            lm.lm_head = model.get_output_embeddings()
        d2t = head.tensors.get("d2t")
        rows = lm.lm_head.weight.shape[0]
        lm.register_buffer(
            "draft_to_target", torch.arange(rows) + (d2t.long() if d2t is not None else torch.zeros(rows, dtype=int))
        )
    if head.own_embeddings:
        rows, width = head.tensors["embed_tokens.weight"].shape
        lm.model.embed_tokens = torch.nn.Embedding(rows, width)
        state["model.embed_tokens.weight"] = head.tensors["embed_tokens.weight"]
    else:
        lm.model.embed_tokens = model.get_input_embeddings()
    lm.to(dtype)
    # (the model's modules, shared: a shard's wrap its rows, `tensor.vocab_parallel`)
    shared = tuple(f"{m}." for m in ("model.embed_tokens", "lm_head") if f"{m}.weight" not in state)
    expected = {k for k in lm.state_dict() if not k.startswith(shared) and not k.endswith("draft_to_target")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise PylonError(
            f"engine.speculative.draft_model {head.directory}: its tensors are not the {head.kind} head its config "
            f"describes (missing: {', '.join(missing[:4]) or 'none'}; not read: {', '.join(unexpected[:4]) or 'none'})"
        )
    own = {k: v for k, v in lm.state_dict().items() if k in state}
    if split:  # each tensor as the shard takes it (a layer's heads, its MLP's slice; the rest whole)
        state = {name: shards._slicer(name, own[name].shape, list(t.shape), shard)(t) for name, t in state.items()}
    for name, t in state.items():
        if own[name].shape != t.shape:
            raise PylonError(
                f"engine.speculative.draft_model {head.directory}: {name} is {tuple(t.shape)}, its config makes it "
                f"{tuple(own[name].shape)}"
            )
    lm.load_state_dict(state, strict=False)
    return lm


def refused(method: str, model_type: str, families: tuple[str, ...]) -> str | None:
    """Why a model of `model_type` cannot feed an EAGLE head of `method`'s kind, or None: EAGLE-3 reads hidden states
    from inside the model, which the engine keeps for the Llama-like families (`families`)."""
    if method == "eagle3" and model_type not in families:
        return f"an EAGLE-3 head reads hidden states inside the model, which the engine keeps for {', '.join(families)}"
    return None


def refuse_as_model(directory: str, uri: str) -> None:
    """Fail, saying what to do instead, where the directory given as a model holds an EAGLE head (EAGLE-3's
    `LlamaForCausalLMEagle3`, EAGLE's `EagleLlamaForCausalLM`, a speculators config; what `objective: eagle3`
    exports): it has no embeddings or layers of its own to serve."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return  # (no config: the loader says what is missing)
    if not isinstance(raw, dict):
        return
    architectures = [str(a) for a in raw.get("architectures") or []]
    if not (any("eagle" in a.lower() for a in architectures) or "speculators_model_type" in raw):
        return
    drafts_for = None
    try:
        with open(os.path.join(directory, "pylon_export.json")) as f:
            drafts_for = json.load(f).get("drafts_for")
    except (OSError, ValueError, AttributeError):
        pass
    method = "eagle3" if raw.get("draft_vocab_size") or "Eagle3" in "".join(architectures) else "eagle"
    raise PylonError(
        f"model {uri}: is an EAGLE drafting head ({', '.join(architectures) or raw['speculators_model_type']}), not "
        f"a model: serve the model it drafts for{f' ({drafts_for})' if drafts_for else ''} as model, with "
        f"engine.speculative: {{method: {method}, draft_model: {uri}}}"
    )
