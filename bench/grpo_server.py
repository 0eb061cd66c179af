"""GRPO's sampling server (`grpo.sampler: server`, TRL's vllm_mode server) against the engine beside each worker
(`grpo.sampler: engine`), in one run, on the same model, prompts and sampling settings.

    .venv/bin/python bench/grpo_server.py                  # 2 workers x 4 prompts of 48-112 tokens x 8 x 64 tokens
    .venv/bin/python bench/grpo_server.py --workers 4      # one server sampling for 4 workers

What it compares: `--workers` workers' micro-batches, each either sampled by that worker's own engine (colocated: one
engine a device, the workers side by side) or sent to one sampling server (a Ray actor on a local Ray of its own) in
one call, as the first worker sends every worker's rows, which samples all of them in the same steps. Per round, after
one untimed round: each colocated engine's forward passes and seconds for its own rows (one after another here: on a
cluster each worker has its device); the server's forward passes and seconds for every worker's rows (its device's
time for the whole step's sampling); and a sync's cost: the bytes the first worker puts in the object store and the
seconds until every server took them (`RemoteRollout.sync`'s steps: the weights read, put, loaded in place), against
the colocated engine's in-place copy.

Machine-independent counters: forward passes (the server's for W workers against one worker's engine: close to 1x
when the rows fit a batch) and tokens computed (equal: the same prefix-cache sharing). The seconds are this machine's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers sampling on the one server (default 2)")
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts in a worker's micro-batch (default 4)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="max_completion_tokens (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    args = parser.parse_args(argv)

    import numpy as np
    import ray
    import torch

    from pylon.data.shards import TokenizerInfo
    from pylon.jobs.grpo import GrpoLoss
    from pylon.jobs.rollout import (
        RolloutEngine,
        SamplingServer,
        engine_spec,
        policy_config,
        put_weights,
        worker_rows,
    )
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    vocab, eos, pad = args.vocab, args.vocab - 1, args.vocab - 2
    spec = TrainJobSpec.model_validate(
        {"name": "bench", "data": {"uri": "/nonexistent"}, "steps": 1,
         "model": {"config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": args.hidden,
                              "intermediate_size": int(args.hidden * 2.6875), "num_hidden_layers": args.layers,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}},
         "batch": {"micro_batch_size": args.prompts},
         "scaling": {"num_workers": args.workers},
         "objective": "grpo", "grpo": {"rewards": [{"function": "exact_match"}], "generations": args.generations,
                                       "max_completion_tokens": args.tokens, "sampler": "server",
                                       "sampler_max_num_seqs": 256}}
    )  # fmt: skip
    model = build_model(spec, vocab_size=vocab, eos_id=eos, pad_id=pad, seed=0).eval()
    params = sum(p.numel() for p in model.parameters())
    g = np.random.default_rng(0)
    lengths = np.linspace(48, 112, args.prompts).astype(int) if args.prompts > 1 else [64]
    batches = [[g.integers(0, vocab - 2, n).astype(np.int64) for n in lengths] for _ in range(args.workers)]
    loss = GrpoLoss(generations=args.generations, max_tokens=args.tokens)
    tokenizer = TokenizerInfo(kind="byte", name="bench", vocab_size=vocab, eos_id=eos, pad_id=pad).model_dump(
        mode="json"
    )
    seq_len = int(max(lengths))
    beside = spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"sampler": "engine"})})
    colocated = [
        RolloutEngine(model, tokenizer, spec=beside, device=torch.device("cpu"), seq_len=seq_len)
        for _ in range(args.workers)
    ]
    espec = engine_spec(spec, seq_len, on_gpu=False)

    # A local Ray of its own, token auth on: the token Ray generates goes to $HOME/.ray, here a temporary home
    home = tempfile.mkdtemp(prefix="bench-grpo-server-")
    os.environ["HOME"] = home
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    server = ray.remote(SamplingServer).options(num_cpus=2, max_concurrency=8).remote("bench")  # the machine, as here

    def rows(worker: int, seed: int) -> list:
        return worker_rows(batches[worker], loss, eos, seed + 1000 * worker, copies=loss.generations)

    def send(version: str) -> int:  # RemoteRollout.sync's steps: read the weights, put them, every server loads
        refs, names, size = put_weights(model, espec.dtype)
        ray.get(
            server.load.remote(version, policy_config(model, names), tokenizer, espec.model_dump(mode="json"), refs)
        )
        return size

    fig = {"engine_s": [], "engine_cpu": [], "engine_passes": [], "engine_tokens": 0, "server_s": [], "server_cpu": [],
           "server_passes": [], "server_tokens": 0, "copy_s": [], "sync_s": [], "bytes": 0}  # fmt: skip
    for r in range(args.rounds + 1):
        # colocated: each worker's engine given the weights in place, then its own rows
        t = time.perf_counter()
        for engine in colocated:
            engine.sync(model)
        copy_s = (time.perf_counter() - t) / args.workers
        walls, cpus, passes, tokens = [], [], [], 0
        for w, engine in enumerate(colocated):
            before = engine.engine.stats().forward_passes_total
            computed = engine.computed_tokens
            t, c = time.perf_counter(), time.process_time()
            engine.sample(batches[w], loss, seed=r + 1000 * w)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            passes.append(engine.engine.stats().forward_passes_total - before)
            tokens += engine.computed_tokens - computed
        # the server: the weights sent, then every worker's rows at once
        t = time.perf_counter()
        size = send(f"v{r}")
        sync_s = time.perf_counter() - t
        before = ray.get(server.stats.remote())
        t = time.perf_counter()
        every = [row for w in range(args.workers) for row in rows(w, r)]  # (as the first worker gathers them)
        got = ray.get(server.sample.remote(f"v{r}", every, loss.generations))
        server_s = time.perf_counter() - t
        after = ray.get(server.stats.remote())
        server_passes = after["forward_passes_total"] - before["forward_passes_total"]
        if r:  # (round 0: untimed, warming everything up)
            fig["engine_s"].append(max(walls))  # the workers side by side: the slowest one's
            fig["engine_cpu"].append(sum(cpus))
            fig["server_cpu"].append(after["cpu_s"] - before["cpu_s"])
            fig["engine_passes"].append(max(passes))
            fig["engine_tokens"] = tokens
            fig["server_s"].append(server_s)
            fig["server_passes"].append(server_passes)
            fig["server_tokens"] = got["computed"]
            fig["copy_s"].append(copy_s)
            fig["sync_s"].append(sync_s)
            fig["bytes"] = size
    ray.shutdown()
    shutil.rmtree(home, ignore_errors=True)

    med = statistics.median
    print(
        f"model: llama {args.hidden} x {args.layers} layers, vocab {vocab}: {params / 1e6:.1f}M parameters, fp32; "
        f"{args.workers} workers x {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens x "
        f"{args.generations} completions x up to {args.tokens} tokens; {args.rounds} rounds"
    )
    print(
        "| sampler | forward passes a step (a device) | tokens computed | s a step (median) | spread | weights a sync |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| engine beside each worker ({args.workers} devices) | {med(fig['engine_passes']):.0f} (each) | "
        f"{fig['engine_tokens']:,} | {med(fig['engine_s']):.3f} (slowest worker) | "
        f"{min(fig['engine_s']):.3f}-{max(fig['engine_s']):.3f} | copied in place, {med(fig['copy_s']):.3f} s |"
    )
    print(
        f"| one server for {args.workers} workers (1 device) | {med(fig['server_passes']):.0f} | "
        f"{fig['server_tokens']:,} | {med(fig['server_s']):.3f} | "
        f"{min(fig['server_s']):.3f}-{max(fig['server_s']):.3f} | {fig['bytes'] / 2**20:.1f} MiB through the "
        f"object store, {med(fig['sync_s']):.3f} s |"
    )
    print(
        f"ratio server / one worker's engine: {med(fig['server_passes']) / med(fig['engine_passes']):.2f}x forward "
        f"passes for {args.workers}x the rows; {med(fig['server_s']) / med(fig['engine_s']):.2f}x seconds; tokens "
        f"computed {fig['server_tokens'] / max(fig['engine_tokens'], 1):.2f}x; a sync {med(fig['sync_s']):.3f} s "
        f"against {med(fig['copy_s']):.3f} s"
    )
    print(
        f"CPU-seconds for all {args.workers} workers' rows: the engines {med(fig['engine_cpu']):.2f}, the server "
        f"{med(fig['server_cpu']):.2f} ({med(fig['server_cpu']) / med(fig['engine_cpu']):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
