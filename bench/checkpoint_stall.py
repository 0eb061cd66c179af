"""Checkpoint stalls: the training time one save blocks, synchronous vs asynchronous upload, in one run.

    .venv/bin/python bench/checkpoint_stall.py                  # a ~25M-parameter GPT-2, ~300 MB checkpoints
    .venv/bin/python bench/checkpoint_stall.py --layers 8 --width 768 --rounds 3

A real DeepSpeed engine (ZeRO-2, AdamW, fp32, one process, gloo) trains a GPT-2-shaped model and the trainer's
`CheckpointCommitter` saves it to an S3-protocol server (moto, in a process of its own) on loopback, every
`--every` steps, `--saves` times per mode; the modes alternate over `--rounds` rounds, each on a fresh run
directory. Per save, the blocked time is what the step loop waited for `committer.save` (measured around the
call), split by the committer into waiting for the previous save, the snapshot (DeepSpeed's files written to
staging: /dev/shm in async mode when it has room, the temporary directory otherwise) and the synchronous upload and
commit. The async mode's last save is waited for after the loop (counted apart: at the end of a run the trainer
waits for it too). Printed: the median blocked seconds per save and its min-max for each mode, their ratio
(target: sync/async >= 5), the median step time with and without an upload running beside it (the background
upload takes CPU from the steps: the price of not blocking), the checkpoint's size, and the CPU seconds of this
process per save in each mode, a figure less at the mercy of the machine's load than wall time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import _SERVER, BUCKET  # noqa: E402  (the same moto server, in a process of its own)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(layers: int, width: int, seq: int):
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        os.environ.setdefault(name, value)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=max(1, width // 64),
        vocab_size=8192,
        n_positions=seq,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine, sum(p.numel() for p in model.parameters())


def _step(engine, step: int, seq: int) -> float:
    import torch

    t0 = time.perf_counter()
    tokens = torch.randint(0, 8192, (2, seq), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def _run(engine, mode: str, run_uri: str, *, saves: int, every: int, seq: int, step0: int) -> dict:
    from pylon.jobs.checkpoint import CheckpointCommitter

    committer = CheckpointCommitter(run_uri, rank=0, world_size=1, keep_last=2, async_upload=mode == "async")
    blocked, parts, steps_beside, steps_alone, cpu = [], [], [], [], []
    step = step0
    for _ in range(saves):
        for _ in range(every):
            step += 1
            beside = committer._pending is not None and not committer._pending.done()
            (steps_beside if beside else steps_alone).append(_step(engine, step, seq))
        c0, t0 = time.process_time(), time.perf_counter()
        committer.save(engine, step, extra={"step": step})
        blocked.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        parts.append(dict(committer.last_blocked))
    t0 = time.perf_counter()
    committer.wait()
    final_wait = time.perf_counter() - t0
    size = sum(f["bytes"] for f in committer.latest().manifest["files"].values())
    committer.close()
    return {
        "blocked": blocked,
        "parts": parts,
        "steps_beside": steps_beside,
        "steps_alone": steps_alone,
        "final_wait": final_wait,
        "size": size,
        "cpu": cpu,
        "step": step,
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = server.stdout.readline().strip()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        engine, params = _engine(args.layers, args.width, args.seq)
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        step = 0
        for r in range(args.rounds):
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                uri = f"s3://{BUCKET}/stall-{mode}-{r}-{uuid.uuid4().hex[:6]}"
                out = _run(engine, mode, uri, saves=args.saves, every=args.every, seq=args.seq, step0=step)
                step = out["step"]
                results[mode].append(out)
                print(
                    f"round {r + 1} {mode:>5}: blocked per save "
                    + ", ".join(f"{b:.2f}" for b in out["blocked"])
                    + f" s (final wait {out['final_wait']:.2f} s)",
                    flush=True,
                )
    finally:
        server.stdin.close()
        server.wait(timeout=30)

    from pylon.jobs.checkpoint import snapshot_dir

    size = results["sync"][0]["size"]
    where = snapshot_dir(size) or tempfile.gettempdir()
    print(
        f"\nmodel {params / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB per save (ZeRO-2 fp32 + AdamW), "
        f"S3 (moto) on loopback, async staging in {where}"
    )
    summary = {}
    for mode in ("sync", "async"):
        blocked = [b for o in results[mode] for b in o["blocked"]]
        parts = [p for o in results[mode] for p in o["parts"]]
        cpu = [c for o in results[mode] for c in o["cpu"]]
        med = _median(blocked)
        summary[mode] = med
        split = ", ".join(f"{k[:-2]} {_median([p[k] for p in parts]):.2f}" for k in parts[0])
        print(
            f"{mode:>5}: blocked {med:.2f} s per save (min {min(blocked):.2f}, max {max(blocked):.2f}, "
            f"n={len(blocked)}; {split}); CPU {_median(cpu):.2f} s per save (this process, during the call)"
        )
    ratio = summary["sync"] / summary["async"] if summary["async"] else float("inf")
    alone = _median([s for o in results["async"] + results["sync"] for s in o["steps_alone"]])
    beside = _median([s for o in results["async"] for s in o["steps_beside"]])
    print(f"ratio sync/async blocked time: {ratio:.1f}x (target >= 5x: {'met' if ratio >= 5 else 'NOT met'})")
    print(
        f"step time: {alone * 1000:.0f} ms alone, {beside * 1000:.0f} ms beside a background upload "
        f"({beside / alone:.2f}x: what the upload takes from the steps on this 2-core machine)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
