"""The planner's memory against real training steps: predicted vs measured peak memory, on CPU.

    .venv/bin/python bench/plan_accuracy.py                     # every case, one fresh process each
    .venv/bin/python bench/plan_accuracy.py --only tiny-fp32,small-bf16-z2

Each case is a TrainJob (a model preset, precision, ZeRO stage, offload, checkpointing, micro-batch, sequence
length, LoRA) trained for `--steps` real steps in a process of its own: Pylon's model (`pylon.models.build_model`),
Pylon's DeepSpeed config and engine (one rank, gloo), Pylon's loss (`pylon.jobs.train._global_mean_loss`), random
tokens. The process first runs a throwaway step of a DeepSpeed engine of the same kind on another (tiny) model,
so that libraries, DeepSpeed's C++ ops, thread pools and kernels are loaded, then records its resident set size (RSS)
and resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`). What the step adds -- model, DeepSpeed's states and buffers, activations -- is the peak
RSS afterwards minus that baseline ("measured"). "Predicted" is what `pylon.plan.memory.train_memory` says a CPU
worker's step needs: model states + activations (simulated on the meta device) + the pages of DeepSpeed's buckets
that are written, + what is offloaded to host RAM (all of it is the same RAM on CPU).

The workers run with `MALLOC_MMAP_THRESHOLD_=131072`: glibc then gives large freed blocks back at once, as
PyTorch's CUDA allocator would reuse them, instead of keeping them in its heap (which inflates the peak by an
amount that depends on the order of frees, not on the job). Target: every ratio within 25% (0.75-1.25).
Also printed: the step's own increment (peak during a later step minus RSS just before it) against predicted
activations + gradients + buffers -- the part of the peak that comes and goes with each step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = "plan_accuracy: "
MIB = 2**20

# name -> the TrainJob fields that vary
CASES = {
    "tiny-fp32-z0": dict(preset="gpt-tiny", precision="fp32", zero=0, micro=32, seq=256),
    "tiny-bf16-z2": dict(preset="gpt-tiny", precision="bf16", zero=2, micro=32, seq=256),
    "tiny-bf16-z2-ckpt": dict(preset="gpt-tiny", precision="bf16", zero=2, micro=32, seq=256, ckpt=True),
    "llama-tiny-fp32-z3": dict(preset="llama-tiny", precision="fp32", zero=3, micro=32, seq=256),
    "small-fp32-z0": dict(preset="gpt-small", precision="fp32", zero=0, micro=16, seq=256),
    "small-bf16-z2": dict(preset="gpt-small", precision="bf16", zero=2, micro=8, seq=256),
    "small-bf16-z2-ckpt": dict(preset="gpt-small", precision="bf16", zero=2, micro=8, seq=256, ckpt=True),
    "small-bf16-z2-offload": dict(preset="gpt-small", precision="bf16", zero=2, micro=8, seq=256, offload="cpu"),
    "small-fp32-z1-lora": dict(
        preset="gpt-small", precision="fp32", zero=1, micro=16, seq=256, lora={"r": 8, "target_modules": ["c_attn"]}
    ),
}


def case_spec(case: dict) -> dict:
    return {
        "kind": "TrainJob",
        "name": "bench",
        "model": {"preset": case["preset"]},
        "data": {"uri": "unused", "seq_len": case["seq"]},
        "scaling": {"num_workers": 1, "use_gpu": False},
        "deepspeed": {"zero_stage": case["zero"], "offload_optimizer": case.get("offload", "none")},
        "precision": case["precision"],
        "gradient_checkpointing": case.get("ckpt", False),
        "batch": {"micro_batch_size": case["micro"]},
        "steps": 10,
        "lora": case.get("lora"),
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)


def _settle() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker(case_name: str, steps: int) -> None:
    """One case, in a process of its own."""
    import deepspeed
    import torch

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.train import _global_mean_loss
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    case = CASES[case_name]
    spec = TrainJobSpec.model_validate(case_spec(case))
    deepspeed.init_distributed(dist_backend="gloo")

    # Warm up: the same kind of DeepSpeed engine on a tiny model, one step, then let it all go. Building a ZeRO
    # optimizer imports ~200 modules (torch._inductor, torch._dynamo, ...) and DeepSpeed's Adam is a C++
    # extension: ~30-75 MiB of code per process whatever the model, which the planner counts as the process
    # (PROCESS_BYTES), not the job.
    warm_case = dict(case, preset="gpt-tiny", micro=2, seq=32, lora=None)
    warm = TrainJobSpec.model_validate(case_spec(warm_case))
    warm_model = build_model(warm, vocab_size=320, eos_id=256, pad_id=257)
    warm_engine, *_ = deepspeed.initialize(
        model=warm_model,
        model_parameters=list(warm_model.parameters()),
        config=build_deepspeed_config(warm, world_size=1),
    )
    ids = torch.randint(0, 256, (2, 32))
    loss, _, _ = _global_mean_loss(warm_engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids, 1)
    warm_engine.backward(loss)
    warm_engine.step()
    warm_engine.destroy()
    del warm_engine, warm_model, ids, loss
    _settle()

    baseline = _rss()
    _reset_peak()
    config = build_deepspeed_config(spec, world_size=1)
    # As a training job builds it: partitioned at ZeRO-3 (zero.Init), which the planner's host-RAM term assumes.
    model = build_model(spec, vocab_size=320, eos_id=256, pad_id=257, seed=0, deepspeed_config=config)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    generator = torch.Generator().manual_seed(0)
    before_step = after_step = step_peak = 0
    for i in range(steps):
        ids = torch.randint(0, 256, (case["micro"], case["seq"]), generator=generator)
        if i == steps - 1:  # the last step's own increment, on top of the steady state
            _settle()
            before_step, outer_peak = _rss(), _peak_rss()
            _reset_peak()
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss, _, _ = _global_mean_loss(logits, ids, 1)
        engine.backward(loss)
        engine.step()
        del logits, loss
        if i == steps - 1:
            step_peak = _peak_rss()
            after_step = _rss()
    total_peak = max(outer_peak, step_peak)
    print(
        RESULT
        + json.dumps(
            {
                "baseline": baseline,
                "total_peak": total_peak - baseline,
                "step_increment": step_peak - before_step,
                "steady": before_step - baseline,
                "after_step": after_step - baseline,
            }
        ),
        flush=True,
    )


def predict(case: dict) -> dict:
    from pylon.plan import train_workload
    from pylon.plan.memory import Layout, train_memory
    from pylon.specs import TrainJobSpec

    spec = TrainJobSpec.model_validate(case_spec(case))
    work, _ = train_workload(spec)
    ds = spec.deepspeed
    layout = Layout(
        ds.zero_stage, ds.offload_optimizer, ds.offload_param, spec.gradient_checkpointing, case["micro"], 1, 1, 1
    )
    m = train_memory(work, layout, device="cpu")
    return {
        "total": m.device_total + m.host_states + m.host_buffers,
        "per_step": m.activations + m.grads + m.buffers,
        "activations": m.activations,
        "states": m.model_states + m.host_states,
        "params": work.shape.total_params,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(name: str, steps: int, threads: int) -> dict:
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS=str(threads),
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--steps", str(steps)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated case names (default: all): {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=3, help="real training steps per case (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per case (default 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    print(
        f"{len(names)} case(s), {args.steps} steps each, one process each, CPU; MiB of RSS above the baseline",
        flush=True,
    )
    rows = []
    for name in names:
        t0 = time.perf_counter()
        measured, predicted = run_case(name, args.steps, args.threads), predict(CASES[name])
        rows.append((name, measured, predicted))
        print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    print(
        f"\n{'case':<24}{'params':>9}{'baseline':>10}{'predicted':>11}{'measured':>10}{'ratio':>7}"
        f"{'step pred':>11}{'step meas':>11}{'ratio':>7}"
    )
    worst = 0.0
    for name, m, p in rows:
        ratio, step_ratio = m["total_peak"] / p["total"], m["step_increment"] / p["per_step"]
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name:<24}{p['params'] / 1e6:>8.2f}M{m['baseline'] / MIB:>10.0f}{p['total'] / MIB:>11.1f}"
            f"{m['total_peak'] / MIB:>10.1f}{ratio:>7.2f}{p['per_step'] / MIB:>11.1f}"
            f"{m['step_increment'] / MIB:>11.1f}{step_ratio:>7.2f}"
        )
    print(
        f"\ntarget: measured / predicted peak within 0.75-1.25 for every case -> worst {1 + worst:.2f}x or "
        f"{1 - worst:.2f}x ({'met' if worst <= 0.25 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
