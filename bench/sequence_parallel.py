"""Sequence parallelism (`scaling.sequence_parallel`, DeepSpeed Ulysses) against one worker computing whole rows,
in one run, on the same model and rows: what each worker holds for the backward pass, and what a step takes.

    .venv/bin/python bench/sequence_parallel.py                 # rows of 2048 and 4096 tokens, 2 ranks
    .venv/bin/python bench/sequence_parallel.py --seq 8192 --rounds 3

For each row length: one process computes a micro-batch of whole rows (forward, the loss over every token, backward);
then two processes on gloo compute it split (`pylon.jobs.sequence_parallel`: each half of every row, the attention's
all-to-alls between them). Counted per rank, machine-independent: the bytes autograd saves for the backward pass
(every tensor a forward keeps but the weights, counted once per storage: the activations the split divides), the
logits' bytes, and the planner's prediction of the activations' peak for the same model and layouts. Timed on this
machine: a step's seconds, the slowest rank's (rounds after one untimed). With two cores, the split run's two ranks
each have one core where the whole run's one process has both threads: the time ratio is not a speed-up
measurement, only what a step costs here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=max(args.seq),
    )


def _step(model, inputs: dict, rounds: int, world: int) -> dict:
    """One untimed step, then `rounds` timed ones; the saved bytes of the first."""
    import torch.distributed as dist

    from pylon.jobs.train import forward_loss

    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (kept either way: not activations)

    def pack(t: torch.Tensor):
        if t.device.type == "cpu" and not t.is_meta and t.untyped_storage().data_ptr() not in weights:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    times, logits_bytes = [], 0
    for i in range(rounds + 1):
        model.zero_grad()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if i == 0 else contextlib.nullcontext():
            loss_sum, n, out = forward_loss(model, inputs)
        total = torch.tensor([float(n)])
        if world > 1:
            dist.all_reduce(total)
        (loss_sum * world / total.item()).backward()
        if i == 0:
            logits_bytes = out.logits.numel() * out.logits.element_size()
        del out
        times.append(time.perf_counter() - t0)
    return {"saved_bytes": sum(storages.values()), "logits_bytes": logits_bytes, "step_s": times[1:]}


def _rows(args, seq: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, args.vocab, (args.micro_batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _model(args):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(args), dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def _rank(rank: int, port: int, args, seq: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    from pylon.jobs import sequence_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    sp = sequence_parallel.groups(2, rank, 2)
    model = _model(args)
    local = sequence_parallel.shard(_rows(args, seq), sp)
    with sequence_parallel.enabled(model, sp, args.micro_batch):
        result = _step(model, local, args.rounds, 2)
    out.put((rank, result))


def _split(args, seq: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, seq, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    steps = [max(a, b) for a, b in zip(results[0]["step_s"], results[1]["step_s"])]
    return {
        "saved_bytes": max(r["saved_bytes"] for r in results.values()),
        "logits_bytes": max(r["logits_bytes"] for r in results.values()),
        "step_s": steps,
    }


def _predicted(args, seq: int, parts: int) -> int:
    """The planner's activation peak for this model, a micro-batch of these rows, `parts` ways split, on a CPU."""
    from pylon.plan.memory import Workload, model_shape

    config = _config(args)
    work = Workload(config, model_shape(config), precision="fp32", seq_len=seq)
    return work.activation_peak(args.micro_batch, False, "cpu", parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096], help="row lengths (default 2048 4096)")
    parser.add_argument("--hidden", type=int, default=256, help="the model's hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads, half as many key-value (default 8)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    parser.add_argument("--micro-batch", type=int, default=1, help="rows a micro-batch (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row length")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(
        f"llama {args.layers} layers x {args.hidden} hidden, {args.heads} heads, vocab {args.vocab}; micro-batch "
        f"{args.micro_batch}; fp32, CPU; whole rows in one process vs split over 2 ranks (gloo)",
        flush=True,
    )
    for seq in args.seq:
        whole = _step(_model(args), _rows(args, seq), args.rounds, 1)
        split = _split(args, seq)
        row = {
            "seq_len": seq,
            "saved_mib": [whole["saved_bytes"] / 2**20, split["saved_bytes"] / 2**20],
            "saved_ratio": split["saved_bytes"] / whole["saved_bytes"],
            "logits_ratio": split["logits_bytes"] / whole["logits_bytes"],
            "predicted_ratio": _predicted(args, seq, 2) / _predicted(args, seq, 1),
            "predicted_mib": [_predicted(args, seq, 1) / 2**20, _predicted(args, seq, 2) / 2**20],
            "step_s": [statistics.median(whole["step_s"]), statistics.median(split["step_s"])],
            "step_s_rounds": [whole["step_s"], split["step_s"]],
        }
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(
            f"seq {seq:>6}: saved for backward per rank {row['saved_mib'][0]:8.1f} -> {row['saved_mib'][1]:8.1f} MiB "
            f"({row['saved_ratio']:.2f}x; planner's activation peak {row['predicted_mib'][0]:.1f} -> "
            f"{row['predicted_mib'][1]:.1f} MiB, {row['predicted_ratio']:.2f}x); logits {row['logits_ratio']:.2f}x; "
            f"step {row['step_s'][0]:.2f} s whole (2 threads) vs {row['step_s'][1]:.2f} s split (1 thread a rank)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
