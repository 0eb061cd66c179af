"""Two ranks on gloo running models sequence-parallel (`pylon.jobs.sequence_parallel`), each case checked against the
same model run whole in one process: `python sequence_parallel_ranks.py PORT` prints one JSON line a case
(`tests/unit/jobs/test_sequence_parallel.py` reads them).

Each rank builds the same model (same seed), computes the whole batch's logits, loss and gradients alone (the
reference), then its slice of the rows through the sequence-parallel attention: the loss over the global token
count times the ranks (as `pylon.jobs.train._global_mean_loss` scales it), the gradients averaged over the ranks (as
DeepSpeed averages them). Rank 0 reports the largest relative differences."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

WORLD = 2
SEQ = 32
ROWS = 2
VOCAB = 97


def _llama(model_type: str = "llama", **over):
    from transformers import LlamaConfig, MistralConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return {"llama": LlamaConfig, "mistral": MistralConfig}[model_type](**{**base, **over})


def _configs():
    from transformers import GPT2Config

    return {
        # grouped-query attention, one row padded at its end
        "llama-gqa": (_llama(), {}),
        # one key-value head for two ranks (repeated), packed documents (position_ids restart)
        "llama-mqa-documents": (_llama(num_key_value_heads=1), {"documents": True}),
        # a sliding window shorter than the row
        "mistral-window": (
            _llama(model_type="mistral", sliding_window=8),
            {},
        ),
        # the window within packed documents (row 0's are shorter than it, row 1's first longer)
        "mistral-window-documents": (
            _llama(model_type="mistral", sliding_window=8),
            {"documents": True},
        ),
        # learned positions, and layers that are not handed position_ids
        "gpt2": (GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, n_positions=64), {}),
        # the loss a chunk at a time (labels one column longer reach the chunked loss)
        "llama-chunked-loss": (_llama(), {"chunked": True}),
        # gradient checkpointing: the all-to-alls run again in the backward pass
        "llama-checkpointing": (_llama(), {"checkpointing": True}),
    }


def _batch(documents: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[1, -6:] = -100  # (row 1's padding)
    out = {"input_ids": ids, "labels": labels}
    if documents:  # row 0: documents of 10, 13 and 9 tokens; row 1: 20 and 12
        positions = []
        for lengths in ((10, 13, 9), (20, 12)):
            positions.append(torch.cat([torch.arange(n) for n in lengths]))
        out["position_ids"] = torch.stack(positions)
        out["labels"] = labels.masked_fill(out["position_ids"] == 0, -100)  # (a document's first token: no label)
    return out


def _model(config, extra: dict):
    from transformers import AutoModelForCausalLM

    from pylon.models import enable_gradient_checkpointing, with_chunked_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    if extra.get("checkpointing"):
        enable_gradient_checkpointing(model)
        model.train()
    else:
        model.eval()  # (no dropout either way: the configs' are 0 or the model is in eval)
    if extra.get("chunked"):
        with_chunked_loss(model, 7)
    return model


def _loss(model, inputs: dict, chunked: bool):
    from pylon.jobs.train import forward_loss

    loss_sum, n, out = forward_loss(model, inputs, chunked)
    return loss_sum, n, None if chunked else out.logits


def _case(name: str, config, extra: dict, rank: int, sp) -> dict:
    import torch.distributed as dist

    from pylon.jobs import sequence_parallel

    batch = _batch(extra.get("documents", False))
    chunked = bool(extra.get("chunked"))
    model = _model(config, extra)
    whole = dict(batch)
    if "position_ids" not in whole:
        whole["attention_mask"] = torch.ones_like(whole["input_ids"])
    ref_sum, ref_n, ref_logits = _loss(model, whole, chunked)
    (ref_sum / ref_n).backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    local = sequence_parallel.shard(batch, sp)
    with sequence_parallel.enabled(model, sp, ROWS):
        loss_sum, n, logits = _loss(model, local, chunked)
        total = torch.tensor([float(n)])
        dist.all_reduce(total)
        (loss_sum * WORLD / total.item()).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= WORLD
    summed = loss_sum.detach().clone()
    dist.all_reduce(summed)
    grads = max(
        float((p.grad - ref_grads[k]).abs().max() / (ref_grads[k].abs().max() + 1e-12))
        for k, p in model.named_parameters()
        if p.grad is not None
    )
    logit_diff = 0.0
    if logits is not None:
        part = SEQ // WORLD
        mine = ref_logits[:, rank * part : (rank + 1) * part]
        logit_diff = float((logits - mine).abs().max() / mine.abs().max())
    # after the scope, the model runs whole again as before (num_key_value_groups put back)
    with torch.no_grad():
        again = _loss(model, whole, chunked)[0]
    return {
        "case": name,
        "loss": float(summed) / total.item(),
        "reference_loss": float(ref_sum) / ref_n,
        "tokens": int(total.item()),
        "reference_tokens": ref_n,
        "grad_rel_diff": grads,
        "logit_rel_diff": logit_diff,
        "after_rel_diff": abs(float(again) - float(ref_sum)) / float(ref_sum),
        "grads": len(ref_grads),
    }


def _rank(rank: int, port: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    import deepspeed

    from pylon.jobs import sequence_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    sp = sequence_parallel.groups(WORLD, rank, WORLD)
    for name, (config, extra) in _configs().items():
        result = _case(name, config, extra, rank, sp)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    mp.spawn(_rank, args=(sys.argv[1],), nprocs=WORLD)
