"""Where an engine's steps go: step times by kind, then torch.profiler's table of ops over a window of steps.

Not a ratio benchmark: a diagnostic for the engine's own host and device time, on a CPU or a GPU. It builds a random
GPT-2 (the bench's), runs an in-process `LLMEngine` over seeded prompts, times every step (steps of decodes only that
replayed a CUDA graph apart from the rest), then profiles `--profile-steps` steps of a second batch and prints the ops
by self CPU time (and, on CUDA, by GPU time). On an H100 this is what found cuDNN's attention planning every prompt
chunk's shape on the host (docs/benchmarks/2026-11-27-set21-serve-load-h100.md).

    .venv/bin/python bench/engine_profile.py                       # CPU, the bench's default model
    python bench/engine_profile.py --device cuda --dtype bf16 --n-layer 12 --n-embd 768 --n-head 12
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="bf16/fp16 need --device cuda")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--requests", type=int, default=64, help="requests per batch (default 64)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--profile-steps", type=int, default=40, help="steps under torch.profiler (default 40)")
    p.add_argument("--rows", type=int, default=25, help="ops in each table (default 25)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.dtype != "fp32" and args.device != "cuda":
        p.error("--dtype bf16/fp16 needs --device cuda")

    import tempfile

    import torch
    from serve_load import build_model
    from torch.profiler import ProfilerActivity, profile

    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="pylon-engine-profile-") as tmp:
        build_model(
            argparse.Namespace(
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
                n_positions=1024,
                seed=args.seed,
                device="cpu",
                dtype="fp32",
            ),
            Path(tmp),
        )
        engine = LLMEngine(
            tmp,
            EngineSpec(
                max_num_seqs=args.max_num_seqs,
                kv_cache_tokens=32768,
                block_size=16,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=1024,
                device=args.device,
                dtype=args.dtype,
            ),
        )
        rng = random.Random(args.seed)
        graphs = engine.runner.decode_graphs

        def add(n: int, tag: str) -> None:
            for i in range(n):
                engine.add_request(
                    f"{tag}{i}",
                    [rng.randrange(256) for _ in range(rng.randint(32, 512))],
                    SamplingParams(max_tokens=rng.randint(16, 128), temperature=0, ignore_eos=True),
                )

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def steps(limit: int | None = None) -> list[tuple[float, bool]]:
            rows = []
            while engine.has_unfinished() and (limit is None or len(rows) < limit):
                replays = graphs.replays if graphs else 0
                sync()
                t = time.perf_counter()
                engine.step()
                sync()
                rows.append((time.perf_counter() - t, bool(graphs) and graphs.replays > replays))
            return rows

        add(8, "warm-")
        steps()
        add(args.requests, "a-")
        started = time.perf_counter()
        rows = steps()
        wall = time.perf_counter() - started
        print(
            f"{args.requests} requests in {wall:.2f} s, {len(rows)} steps "
            f"({args.n_layer} layers x {args.n_embd}, {args.dtype}, {args.device})"
        )
        for kind, graphed in (("decodes only, CUDA graph", True), ("run eagerly", False)):
            ms = sorted(t * 1e3 for t, g in rows if g == graphed)
            if ms:
                print(
                    f"  {kind}: {len(ms)} steps, {sum(ms):.0f} ms in all, p50 {ms[len(ms) // 2]:.2f} ms, "
                    f"p90 {ms[int(len(ms) * 0.9)]:.2f}, max {ms[-1]:.1f}"
                )
        add(args.requests, "p-")
        steps(6)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            profiled = steps(args.profile_steps)
        steps()
        print(
            f"profiled {len(profiled)} steps ({sum(g for _, g in profiled)} replayed a graph): "
            f"{sum(t for t, _ in profiled) * 1e3:.0f} ms with the profiler on"
        )
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if cuda:
            print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
