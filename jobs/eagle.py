"""objective eagle3: an EAGLE-3 drafting head trained for a frozen model (SpecForge's training; docs/training.md,
"Drafting heads").

The head is what `engine.speculative.method: eagle3` runs (pylon.serving.model.eagle): `fc` over the inputs of three
of the model's layers at position i, one Llama decoder layer whose attention reads [input_layernorm(the embedding of
the token at i + 1), hidden_norm(g)] (twice the width) with residual g, its final norm and an output layer over a
draft vocabulary (`d2t` maps it to the model's tokens). It is trained as EAGLE-3 trains one, with training-time test:
unrolled `ttt_steps` drafts deep, draft k at row i fed the head's own output of draft k - 1 (before its norm) in place
of g and the text's token at i + k + 1, at position i + k; its queries attend the first draft's keys of the rows up to
i (what the engine's head caught up on) and its own earlier drafts' keys of row i (its chain), as the engine's drafts
attend them. Draft k at row i is taught the model's distribution of the token at i + k + 2 (at position i + k + 1,
over the draft vocabulary: a soft target, the model's own, not the text's token), weighted `ttt_decay ** k`, where
that token is one the labels count and the chain stays within one packed document.

The head and the trainer that holds it beside the model are `pylon.draft_head`'s (the planner simulates them too).
The model is built as training builds any (`pylon.models.build_model`, `model.path`), frozen and in eval mode; the
DeepSpeed engine holds it and the head (`Eagle3Trainer`) and optimises the head's parameters alone, and checkpoints
hold the head alone (the model is `model.path`'s). The draft vocabulary is chosen before the first step from the
labels of the training split (`draft_vocabulary`). The export (`export_head`) is the head's directory as EAGLE-3's
releases hold it: config.json (`LlamaForCausalLMEagle3`, `eagle_config.eagle_aux_hidden_state_layer_ids`), and
model.safetensors with `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; read back by the serving side's reader
before it is written.
"""

from __future__ import annotations

import json
import os

import torch

from pylon.draft_head import Eagle3Head, Eagle3Trainer, aux_layers, head_config
from pylon.errors import PylonError


def draft_vocabulary(stream, size: int, vocab_size: int, max_tokens: int) -> tuple[torch.Tensor, int, float]:
    """The draft vocabulary: the `size` tokens the labels of `stream` (from its start, up to `max_tokens` counted
    tokens) count most often, ascending by id (ties: the lower id; all of the model's `vocab_size` where `size`
    reaches it). Returns (ids, tokens counted, the share of them the vocabulary covers)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    seen = 0
    batches = stream.epoch()
    try:
        for batch in batches:
            if not len(batch):
                continue
            labels = batch.to_torch(stream.manifest.tokenizer.pad_id)["labels"]
            kept = labels[labels != -100]
            if len(kept) and int(kept.max()) >= vocab_size:
                raise PylonError(
                    f"objective eagle3: the data holds token {int(kept.max())}, past the model's vocabulary of "
                    f"{vocab_size}: the data was prepared with another tokenizer"
                )
            counts += torch.bincount(kept, minlength=vocab_size).double()
            seen += len(kept)
            if seen >= max_tokens:
                break
    finally:
        batches.close()
    if size >= vocab_size:
        return torch.arange(vocab_size), seen, 1.0
    chosen = most_frequent(counts, size)
    covered = float(counts[chosen].sum() / max(seen, 1))
    return chosen, seen, covered


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ids of the `size` largest `counts` (of equal counts, the lower id), ascending: a draft vocabulary."""
    return torch.argsort(-counts, stable=True)[:size].sort().values


def build_trainer(target: torch.nn.Module, spec, draft_tokens: torch.Tensor, seed: int = 0) -> Eagle3Trainer:
    """The head for `target` as `spec.eagle3` says (its output layer started from the model's rows of its draft
    vocabulary, its final norm from the model's; the rest initialised from `seed`, the same on every rank), beside
    the frozen model."""
    from pylon.specs import Eagle3Spec

    settings = spec.eagle3 or Eagle3Spec()
    config = target.config
    aux = aux_layers(settings.aux_layers, config.num_hidden_layers)
    hc = head_config(config, draft_vocab=len(draft_tokens), aux=aux, intermediate_size=settings.intermediate_size)
    import deepspeed

    torch.manual_seed(seed)
    head = Eagle3Head(hc, draft_tokens).to(next(target.parameters()).device)
    output = target.get_output_embeddings()
    final = getattr(getattr(target, "model", None), "norm", None)
    starts = [m.weight for m in (output, final) if m is not None and getattr(m, "weight", None) is not None]
    # (ZeRO-3: the model's partitions gathered for the copy; DeepSpeed's context does nothing for whole parameters)
    with deepspeed.zero.GatheredParameters(starts, modifier_rank=None), torch.no_grad():
        if output is not None and output.weight.shape[1] == hc.hidden_size:
            head.lm_head.weight.copy_(output.weight[head.draft_tokens].float())
        if final is not None and getattr(final, "weight", None) is not None:
            head.norm.weight.copy_(final.weight.float())
    return Eagle3Trainer(target, head, aux, settings.ttt_steps, settings.ttt_decay)


def eagle3_record(stats: list[float], prefix: str = "") -> dict:
    """Per draft depth k, the share of counted drafts whose top token is the model's (`eagle3_accuracy_k`), and the
    chain's expected accepted drafts if each depth is right that often given the ones before (`eagle3_accept_length`:
    the sum over k of the product of the first k + 1 shares; a verification step adds the model's own token)."""
    record, chain, length = {}, 1.0, 0.0
    for k in range(len(stats) // 2):
        right, counted = stats[2 * k], stats[2 * k + 1]
        share = right / counted if counted else 0.0
        record[f"{prefix}eagle3_accuracy_{k}"] = share
        chain *= share
        length += chain
    record[f"{prefix}eagle3_accept_length"] = length
    return record


def export_head(state: dict, spec, target_config, out_dir: str) -> dict:
    """Write the head of a consolidated checkpoint `state` (the trainer's names: `head.*`) to `out_dir` in EAGLE-3's
    layout, read back by the engine's reader (pylon.serving.model.eagle.read) before it is kept; returns its
    config.json's fields."""
    from safetensors.torch import save_file

    from pylon.serving.model.eagle import read
    from pylon.specs import Eagle3Spec

    settings = spec.eagle3 or Eagle3Spec()
    head = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    if "draft_tokens" not in head or "fc.weight" not in head:
        raise PylonError(f"the checkpoint holds no EAGLE-3 head (found {sorted(head)[:5]})")
    draft = head.pop("draft_tokens").long()
    n = target_config.num_hidden_layers
    aux = aux_layers(settings.aux_layers, n)
    config = head_config(target_config, draft_vocab=len(draft), aux=aux, intermediate_size=settings.intermediate_size)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in head.items() if k.endswith(".weight")}
    tensors["d2t"] = (draft - torch.arange(len(draft))).contiguous()
    tensors["t2d"] = torch.zeros(target_config.vocab_size, dtype=torch.bool).index_fill(0, draft, True)
    os.makedirs(out_dir, exist_ok=True)
    fields = config.to_dict()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    read(out_dir, "eagle3", target_config)  # (the engine's reader: what it would refuse, refused here)
    return fields
