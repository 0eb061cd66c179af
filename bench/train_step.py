"""Training step time: plain PyTorch DDP vs DeepSpeed ZeRO-1, -2, -3 and ZeRO-2 + CPU optimizer offload, in one
run, on the same model and the same data.

    .venv/bin/python bench/train_step.py                         # gpt-small shape, 2 workers, CPU
    .venv/bin/python bench/train_step.py --model gpt-tiny --steps 6 --workers 2
    .venv/bin/python bench/train_step.py --device cuda --workers 1 --precision bf16   # on a GPU machine

Each variant runs as `--workers` processes of one process group (gloo on CPU, NCCL on CUDA), started the same
way; the model comes from `pylon.models.build_model` and every DeepSpeed config from
`pylon.jobs.deepspeed_config.build_deepspeed_config`, as a Pylon training job builds them. The data is
`../shared/datasets/tinyshakespeare.txt` as bytes (the byte tokenizer), the same rows for every variant.
After `--warmup` untimed steps, the median of `--steps` timed steps is the step time. The baseline is DDP
(torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW, torch's gradient clipping).

Prints per variant: step time, tokens/s, ratio to DDP's step time, MFU against the matmul peak measured in the
same run. Target on CPU: ZeRO-2 within 1.3x of DDP's step time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt"
RESULT = "train_step: "
# (name, zero stage or None for DDP, optimizer offload)
VARIANTS = [
    ("ddp", None, "none"),
    ("zero1", 1, "none"),
    ("zero2", 2, "none"),
    ("zero3", 3, "none"),
    ("zero2+cpu-offload", 2, "cpu"),
]


def _spec(args, stage: int, offload: str) -> dict:
    return {
        "kind": "TrainJob",
        "name": "bench",
        "model": {"preset": args.model},
        "data": {"uri": "unused"},
        "scaling": {"num_workers": args.workers, "use_gpu": args.device == "cuda"},
        "deepspeed": {"zero_stage": stage, "offload_optimizer": offload},
        "precision": args.precision,
        "steps": args.warmup + args.steps,
        "batch": {"micro_batch_size": args.micro_batch},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
    }


def _rows(rank: int, world: int, steps: int, micro: int, seq_len: int):
    """This rank's batches: consecutive windows of the text's bytes, the same for every variant."""
    import torch

    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
    need = steps * micro * world * seq_len
    data = data[:need].reshape(steps, world, micro, seq_len) if len(data) >= need else None
    if data is None:
        raise SystemExit(f"{DATA} has too few bytes for {steps} steps of {world}x{micro}x{seq_len}")
    return [data[s, rank] for s in range(steps)]


def worker(args) -> None:
    """One rank of one variant (runs in its own process)."""
    import torch
    import torch.distributed as dist

    from pylon.models import build_model, flops_per_token, measure_matmul_peak_flops
    from pylon.specs import TrainJobSpec

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stage = None if args.variant_stage < 0 else args.variant_stage
    spec = TrainJobSpec.model_validate(_spec(args, stage or 0, args.variant_offload))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    model = build_model(spec, vocab_size=320, eos_id=256, pad_id=257, seed=0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)

    if stage is None:
        dist.init_process_group(backend)
        model = model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        optimizer = torch.optim.AdamW(
            ddp.parameters(),
            lr=spec.optim.lr,
            betas=spec.optim.betas,
            eps=spec.optim.eps,
            weight_decay=spec.optim.weight_decay,
        )

        def step(ids):
            optimizer.zero_grad(set_to_none=True)
            # Mixed precision the torch way (fp32 weights, autocast matmuls), as DeepSpeed's bf16 keeps fp32 masters.
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), spec.optim.grad_clip)
            optimizer.step()
            return loss
    else:
        import deepspeed

        from pylon.jobs.deepspeed_config import build_deepspeed_config

        deepspeed.init_distributed(dist_backend=backend)
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=list(model.parameters()),
            config=build_deepspeed_config(spec, world_size=world),
        )

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

    rows = _rows(rank, world, args.warmup + args.steps, args.micro_batch, args.seq_len)
    times, losses = [], []
    for i, ids in enumerate(rows):
        ids = ids.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(ids)
        losses.append(loss.item())  # .item() waits for the step to finish on any device
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        if i >= args.warmup:
            times.append(elapsed.item())
    base_config = model.config if not hasattr(model, "module") else model.module.config
    peak = measure_matmul_peak_flops(seconds=1.0, device=device, dtype=dtype) if rank == 0 else 0.0
    if rank == 0:
        print(
            RESULT
            + json.dumps(
                {
                    "times": times,
                    "losses": losses,
                    "peak_flops": peak,
                    "flops_per_token": flops_per_token(base_config, args.seq_len),
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(args, stage: int | None, offload: str) -> dict:
    """Start `--workers` ranks of one variant and return rank 0's result."""
    port = str(_free_port())
    threads = max(1, (os.cpu_count() or 1) // args.workers) if args.device == "cpu" else 1
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--variant-stage",
        str(-1 if stage is None else stage),
        "--variant-offload",
        offload,
    ] + args.passthrough
    procs = []
    for rank in range(args.workers):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.workers),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS=str(threads),
        )
        env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"rank {rank} of zero={stage} offload={offload} failed:\n{out[-2000:]}\n{err[-4000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small", help="a Pylon model preset (default gpt-small)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant-stage", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--variant-offload", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.passthrough = [
        "--model",
        args.model,
        "--workers",
        str(args.workers),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--precision",
        args.precision,
        "--device",
        args.device,
    ]
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]
    tokens_per_step = args.workers * args.micro_batch * args.seq_len
    print(
        f"model {args.model}, {args.workers} workers x micro-batch {args.micro_batch} x seq {args.seq_len} "
        f"({tokens_per_step:,} tokens/step), {args.precision} on {args.device}; "
        f"median of {args.steps} steps after {args.warmup} warm-up",
        flush=True,
    )
    results = {}
    for name, stage, offload in variants:
        t0 = time.perf_counter()
        results[name] = run_variant(args, stage, offload)
        print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    base = statistics.median(results["ddp"]["times"]) if "ddp" in results else None
    peak = next(iter(results.values()))["peak_flops"]
    print(f"\nmeasured matmul peak per worker: {peak / 1e9:.1f} GFLOP/s ({args.precision})")
    print(f"{'variant':<20}{'step time':>12}{'tokens/s':>12}{'vs DDP':>9}{'MFU':>8}{'loss 1st→last':>18}")
    for name, r in results.items():
        t = statistics.median(r["times"])
        tps = tokens_per_step / t
        mfu = r["flops_per_token"] * tps / (r["peak_flops"] * args.workers) if r["peak_flops"] else 0.0
        ratio = f"{t / base:.2f}x" if base else "-"
        print(
            f"{name:<20}{t * 1000:>10.0f}ms{tps:>12,.0f}{ratio:>9}{mfu:>8.1%}"
            f"{r['losses'][0]:>9.3f}→{r['losses'][-1]:.3f}"
        )
    if base and "zero2" in results:
        ratio = statistics.median(results["zero2"]["times"]) / base
        print(f"\ntarget: ZeRO-2 step time <= 1.3x DDP's -> {ratio:.2f}x ({'met' if ratio <= 1.3 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
