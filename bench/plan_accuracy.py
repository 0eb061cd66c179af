"""The planner's memory against real training steps: predicted vs measured peak memory, on CPU or on a CUDA GPU.

    .venv/bin/python bench/plan_accuracy.py                     # every CPU case, one fresh process each
    .venv/bin/python bench/plan_accuracy.py --only tiny-fp32-z0,small-bf16-z2
    python3 bench/plan_accuracy.py --device cuda --json $OUT/plan_accuracy.json   # the GPU cases (~3-4 min)
    python3 bench/plan_accuracy.py --device cuda --only small-bf16-z2,llama1b-bf16-z3-offload

Each case is a TrainJob (a model preset or an explicit Hugging Face config, precision, ZeRO stage, offload,
checkpointing, micro-batch, sequence length, LoRA) trained for `--steps` real steps in a process of its own: Pylon's
model (`pylon.models.build_model`), Pylon's DeepSpeed config and engine (one rank), Pylon's loss
(`pylon.jobs.train.step_loss`: the whole micro-batch's logits, or a chunk at a time where a case sets
`loss_chunk_tokens`), random tokens.

CPU (`--device cpu`, the default; gloo): the process first runs a throwaway step of a DeepSpeed engine of the same
kind on another (tiny) model, so that libraries, DeepSpeed's C++ ops, thread pools and kernels are loaded, then
records its resident set size (RSS) and resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`). What the step adds -- model, DeepSpeed's states and buffers, activations -- is the peak
RSS afterwards minus that baseline ("measured"). "Predicted" is what `pylon.plan.memory.train_memory` says a CPU
worker's step needs: model states + activations (simulated on the meta device) + the pages of DeepSpeed's buckets
that are written, + what is offloaded to host RAM (all of it is the same RAM on CPU).

The workers run with `MALLOC_MMAP_THRESHOLD_=131072`: glibc then gives large freed blocks back at once, as
PyTorch's CUDA allocator would reuse them, instead of keeping them in its heap (which inflates the peak by an
amount that depends on the order of frees, not on the job). Target: every ratio within 25% (0.75-1.25).
Also printed: the step's own increment (peak during a later step minus RSS just before it) against predicted
activations + gradients + buffers -- the part of the peak that comes and goes with each step.

CUDA (`--device cuda`; GPU 0, nccl, `scaling.use_gpu: true`, the model built as `pylon.jobs.train.train_loop` builds
it, random tokens on the GPU): DeepSpeed's ops (FusedAdam, CPU Adam) are compiled once before the cases; each case
process runs a throwaway step of an engine of its kind on a tiny model (the CUDA context, cuBLAS, NCCL's communicator,
the kernels and the libraries loaded), frees it, and measures from there, through the engine's construction and every
step, the first included (it allocates Adam's moments at ZeRO-1/2, and DeepSpeed's buffers come and go with each
step):
- "measured" total: the process's device memory as `nvidia-smi --query-compute-apps=pid,used_memory` reports it,
  sampled every ~50 ms and once after the last step, the largest; against `device_total` of
  `pylon.plan.memory.train_memory(..., device="cuda")`. Target: every ratio within 10% (0.90-1.10).
- "max alloc": `torch.cuda.max_memory_allocated` over the steps above what the allocator held before the model,
  against `device_total - runtime`; "reserved" the allocator's most (`max_memory_reserved`, construction included);
  "runtime" what nvidia-smi counts beyond the allocator's reserved memory after the last step (the CUDA context, its
  kernels, NCCL), against `runtime`; "est" = runtime + reserved, a check on the sampling.
- per case: the predicted terms; the allocator's peaks while the engine is built, in the first step and the later
  ones; host RAM above the baseline (peak RSS; the machine's used RAM, which counts the pinned buffers the CUDA driver
  maps and RSS may not, but also whatever else runs; the pinned allocator's peak) against the planner's host terms.
Where nvidia-smi does not list the process (another pid namespace) the only process it lists is taken; with several
listed and not this one, the case has no total of its own (n/a); without nvidia-smi, the device's used memory
(cudaMemGetInfo), which is the process's only when nothing else uses the GPU. Then a table for docs/benchmarks.md;
`--json` writes every figure (after each case, so a run cut short keeps what it measured). About 3-4 minutes on one
H100 or H200, a minute of it compiling DeepSpeed's ops (seconds where `python -m pylon.ops` built them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = "plan_accuracy: "
MIB = 2**20

VOCAB_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "vocab_size": 32000,
}
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
    # A small Llama with a 32,000-token vocabulary: the logits (8 x 256 x 32000 fp32, 250 MiB, and their gradient)
    # weigh; computed whole, and a chunk of 256 tokens at a time (loss_chunk_tokens).
    "vocab-fp32-z0": dict(config=VOCAB_LLAMA, precision="fp32", zero=0, micro=8, seq=256),
    "vocab-fp32-z0-chunked": dict(config=VOCAB_LLAMA, precision="fp32", zero=0, micro=8, seq=256, chunk=256),
}
# A Llama shape of ~1.1B parameters (TinyLlama's): large enough that activations and DeepSpeed's buckets, not the
# CUDA runtime, make most of a GPU step's memory.
LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# The GPU cases (--device cuda): the same kinds of job as above, larger batches, and the ~1B model.
CUDA_CASES = {
    "small-bf16-z2": dict(preset="gpt-small", precision="bf16", zero=2, micro=32, seq=512),
    "small-bf16-z3-offload": dict(
        preset="gpt-small", precision="bf16", zero=3, micro=32, seq=512, offload="cpu", offload_param="cpu"
    ),
    "small-fp16-z2": dict(preset="gpt-small", precision="fp16", zero=2, micro=32, seq=512),
    "small-bf16-z2-ckpt": dict(preset="gpt-small", precision="bf16", zero=2, micro=32, seq=512, ckpt=True),
    "small-fp32-z1-lora": dict(
        preset="gpt-small", precision="fp32", zero=1, micro=32, seq=512, lora={"r": 8, "target_modules": ["c_attn"]}
    ),
    "llama1b-bf16-z3-offload": dict(
        config=LLAMA_1B, precision="bf16", zero=3, micro=8, seq=2048, offload="cpu", offload_param="cpu"
    ),
    "llama1b-bf16-z3": dict(config=LLAMA_1B, precision="bf16", zero=3, micro=4, seq=2048),
}
TARGET = {"cpu": 0.25, "cuda": 0.10}  # |measured / predicted - 1| at most


def case_spec(case: dict) -> dict:
    return {
        "kind": "TrainJob",
        "name": "bench",
        "model": {"preset": case["preset"]} if "preset" in case else {"config": case["config"]},
        "data": {"uri": "unused", "seq_len": case["seq"]},
        "scaling": {"num_workers": 1, "use_gpu": case.get("gpu", False)},
        "deepspeed": {
            "zero_stage": case["zero"],
            "offload_optimizer": case.get("offload", "none"),
            "offload_param": case.get("offload_param", "none"),
        },
        "precision": case["precision"],
        "gradient_checkpointing": case.get("ckpt", False),
        "batch": {"micro_batch_size": case["micro"]},
        "steps": 10,
        "lora": case.get("lora"),
        "loss_chunk_tokens": case.get("chunk", 0),
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
    }


def _step_loss(engine, ids, chunked: bool):
    """Pylon's training loss of one micro-batch of `ids` (`pylon.jobs.train.step_loss`, one rank): from the whole
    micro-batch's logits, or with `chunked` (the spec's `loss_chunk_tokens`) a chunk at a time."""
    import torch

    from pylon.jobs.train import step_loss

    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return step_loss(engine, inputs, 1, chunked=chunked)[0]


def cases_for(device: str) -> dict[str, dict]:
    """The cases of `device`: each a dict of the fields that vary (GPU cases marked `gpu`)."""
    if device == "cuda":
        return {name: dict(case, gpu=True) for name, case in CUDA_CASES.items()}
    return CASES


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
    loss = _step_loss(warm_engine, ids, False)
    warm_engine.backward(loss)
    warm_engine.step()
    warm_engine.destroy()
    del warm_engine, warm_model, ids, loss
    _settle()

    baseline = _rss()
    _reset_peak()
    config = build_deepspeed_config(spec, world_size=1)
    # As a training job builds it: partitioned at ZeRO-3 (zero.Init), which the planner's host-RAM term assumes.
    vocab, eos, pad = _vocab(spec)
    model = build_model(spec, vocab_size=vocab, eos_id=eos, pad_id=pad, seed=0, deepspeed_config=config)
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
        loss = _step_loss(engine, ids, bool(spec.loss_chunk_tokens))
        engine.backward(loss)
        engine.step()
        del loss
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


# ---------------------------------------------------------------------------------------------------------
# CUDA: nvidia-smi, the sampler, the case process
# ---------------------------------------------------------------------------------------------------------


def _smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it is missing or fails."""
    try:
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_compute_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` as {pid: MiB}. Lines without
    two numbers ("No running processes found", "[N/A]", "[Not Supported]") are skipped; a pid listed on several GPUs
    is summed."""
    apps: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            pid, mib = int(parts[0]), int(float(parts[1]))
        except ValueError:
            continue
        apps[pid] = apps.get(pid, 0) + mib
    return apps


def pick_process(apps: dict[int, int], pid: int) -> tuple[int | None, str]:
    """(MiB, how it was found) of process `pid` among nvidia-smi's compute apps: by pid; else, when exactly one
    process is listed, that one (a container whose pid namespace is not the driver's); else (None, 'not listed')."""
    if pid in apps:
        return apps[pid], "pid"
    if len(apps) == 1:
        return next(iter(apps.values())), "only process"
    return None, "not listed"


def _compute_apps() -> dict[int, int] | None:
    """{pid: MiB} of the processes nvidia-smi lists on the GPUs; None without nvidia-smi."""
    out = _smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    return None if out is None else parse_compute_apps(out)


def process_mib(pid: int) -> tuple[int | None, str]:
    """This process's device memory in MiB as nvidia-smi reports it, and how it was found ('unavailable': no
    nvidia-smi)."""
    apps = _compute_apps()
    return (None, "unavailable") if apps is None else pick_process(apps, pid)


def _first_int(text: str | None) -> int | None:
    for line in (text or "").splitlines():
        try:
            return int(float(line.strip()))
        except ValueError:
            continue
    return None


def _host_used() -> int | None:
    """Bytes of host RAM in use on the whole machine (MemTotal - MemAvailable): unlike a process's RSS it counts
    pinned memory the CUDA driver maps (cudaHostAlloc), which is where offloaded states live."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemTotal"] - info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None


class _Sampler(threading.Thread):
    """Every `interval` s (or as fast as nvidia-smi answers): the process's device memory from nvidia-smi, and the
    device's used memory from cudaMemGetInfo (the fallback where nvidia-smi cannot see the process); the largest
    of each."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.done = threading.Event()
        self.smi_peak_mib: int | None = None
        self.smi_source = "unavailable"
        self.device_used_peak = 0
        self.host_used_peak: int | None = None
        self.processes = 0  # the most processes nvidia-smi listed at once (others share the GPU when > 1)
        self.last_mib: int | None = None
        self.samples = 0
        self._smi_works = True

    def sample(self) -> None:
        import torch

        if self._smi_works:
            apps = _compute_apps()
            mib, source = (None, "unavailable") if apps is None else pick_process(apps, self.pid)
            self._smi_works = apps is not None
            self.processes = max(self.processes, len(apps or {}))
            if source == "only process" and self.processes > 1:
                # Not listed by pid, and other processes come and go on this GPU: the one listed may be another's.
                mib, source = None, "not listed"
                self.smi_peak_mib = None
            self.last_mib = mib
            if mib is not None:
                self.smi_peak_mib = max(self.smi_peak_mib or 0, mib)
                self.smi_source = source
            elif self.smi_peak_mib is None:
                self.smi_source = source
        host = _host_used()
        if host is not None:
            self.host_used_peak = max(self.host_used_peak or 0, host)
        free, total = torch.cuda.mem_get_info(0)
        self.device_used_peak = max(self.device_used_peak, total - free)
        self.samples += 1

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.sample()
            except Exception:  # a sample missed is a sample missed; the measurement goes on
                pass
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=60)
        try:
            self.sample()
        except Exception:
            self.last_mib = None


def _try_reset_peak() -> bool:
    try:
        _reset_peak()
        return True
    except OSError:  # no clear_refs (gVisor, say): the peak since the process started
        return False


def _vocab(spec) -> tuple[int, int, int]:
    """(vocabulary, eos id, pad id) the model is built with: the model's own vocabulary, as the planner sizes it
    (the byte tokenizer's 320 for the small presets, with its ids 256 and 257)."""
    from pylon.models import model_config

    vocab = model_config(spec.model, eos_id=0, pad_id=0).vocab_size  # ids within it: transformers stays quiet
    eos = min(256, vocab - 2)
    return vocab, eos, eos + 1


def _cuda_device():
    import torch

    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def cuda_worker(case_name: str, steps: int) -> None:
    """One GPU case, in a process of its own: what the process holds on the device, and host RAM, while a
    DeepSpeed engine is built and trained as `pylon.jobs.train.train_loop` builds and trains it."""
    import gc

    import torch

    case = cases_for("cuda")[case_name]
    pid = os.getpid()
    used_before = _first_int(_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits"))  # MiB, no context yet
    device = _cuda_device()

    import deepspeed

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    spec = TrainJobSpec.model_validate(case_spec(case))
    vocab, eos, pad = _vocab(spec)
    deepspeed.init_distributed(dist_backend="nccl")

    # Warm up: the same kind of engine on a tiny model, one step, then let it all go: the CUDA context, cuBLAS,
    # NCCL's communicator, DeepSpeed's ops and the libraries' code are the process's, not the job's.
    warm_case = {k: v for k, v in case.items() if k != "config"}
    warm_case.update(preset="gpt-tiny", micro=2, seq=32, lora=None)
    warm = TrainJobSpec.model_validate(case_spec(warm_case))
    warm_config = build_deepspeed_config(warm, world_size=1)
    warm_model = build_model(warm, vocab_size=320, eos_id=256, pad_id=257, deepspeed_config=warm_config, device=device)
    warm_engine, *_ = deepspeed.initialize(
        model=warm_model,
        model_parameters=[p for p in warm_model.parameters() if p.requires_grad],
        config=warm_config,
    )
    ids = torch.randint(0, 256, (2, 32), device=device)
    loss = _step_loss(warm_engine, ids, False)
    warm_engine.backward(loss)
    warm_engine.step()
    warm_engine.destroy()
    del warm_engine, warm_model, ids, loss
    _settle()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    baseline = {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "smi_mib": process_mib(pid)[0],
        "rss": _rss(),
        "host_used": _host_used(),
    }
    peak_reset = _try_reset_peak()
    sampler = _Sampler(pid)
    sampler.start()

    def window() -> dict:
        torch.cuda.synchronize()
        out = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
        torch.cuda.reset_peak_memory_stats()
        return out

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    config = build_deepspeed_config(spec, world_size=1)
    # As train_loop builds it: at ZeRO-3 partitioned (zero.Init), on this GPU or in host RAM per offload_param.
    model = build_model(spec, vocab_size=vocab, eos_id=eos, pad_id=pad, seed=0, deepspeed_config=config, device=device)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    init = window()
    init["seconds"] = time.perf_counter() - t0
    generator = torch.Generator(device=device).manual_seed(0)
    first = steady = None
    step_seconds = []
    for i in range(steps):
        t0 = time.perf_counter()
        ids = torch.randint(0, eos, (case["micro"], case["seq"]), device=device, generator=generator)
        loss = _step_loss(engine, ids, bool(spec.loss_chunk_tokens))
        engine.backward(loss)
        engine.step()
        del loss, ids
        if i == 0:  # Adam's moments (ZeRO-1/2) and DeepSpeed's lazy buffers appear in the first step
            first = window()
        step_seconds.append(time.perf_counter() - t0)
    if steps > 1:
        steady = window()
    final = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    sampler.stop()  # its last sample is taken now, after the last step
    final["smi_mib"] = sampler.last_mib
    stats = torch.cuda.memory_stats()
    try:  # the pinned-memory allocator's (torch >= 2.5): it rounds each block up to a power of two
        host_stats = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
    except (AttributeError, RuntimeError):
        host_stats = {}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scale = getattr(scaler, "cur_scale", None)
    props = torch.cuda.get_device_properties(0)
    print(
        RESULT
        + json.dumps(
            {
                "env": {
                    "device_name": torch.cuda.get_device_name(0),
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                    "device_memory": props.total_memory,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "deepspeed": deepspeed.__version__,
                    "transformers": __import__("transformers").__version__,
                },
                "device_used_before_mib": used_before,
                "baseline": baseline,
                "init": init,
                "first": first,
                "steady": steady,
                "final": final,
                "smi_peak_mib": sampler.smi_peak_mib,
                "smi_source": sampler.smi_source,
                "device_used_peak": sampler.device_used_peak,
                "samples": sampler.samples,
                "gpu_processes": sampler.processes,
                "rss_peak_delta": _peak_rss() - baseline["rss"],
                "rss_peak_reset": peak_reset,
                "host_used_peak_delta": (
                    sampler.host_used_peak - baseline["host_used"]
                    if sampler.host_used_peak is not None and baseline["host_used"] is not None
                    else None
                ),
                "pinned_peak": host_stats.get("allocated_bytes.peak"),
                "pinned_active_peak": host_stats.get("active_bytes.peak"),
                "host_stats": host_stats,
                "step_seconds": step_seconds,
                "skipped_steps": getattr(engine, "skipped_steps", None),
                "loss_scale": float(scale) if scale is not None else None,
                "alloc_retries": stats.get("num_alloc_retries"),
                "ooms": stats.get("num_ooms"),
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------------------
# The planner's figures
# ---------------------------------------------------------------------------------------------------------


def predict(case: dict, device: str = "cpu") -> dict:
    """What `pylon.plan.memory.train_memory` says `case` needs on `device`: 'total' is the figure compared with the
    measured peak (on CPU, RSS: device terms + host RAM; on CUDA, the GPU's `device_total`)."""
    from pylon.plan import train_workload
    from pylon.plan.memory import Buffers, Layout, train_memory
    from pylon.specs import TrainJobSpec

    spec = TrainJobSpec.model_validate(case_spec(case))
    work, _ = train_workload(spec)
    ds = spec.deepspeed
    layout = Layout(
        ds.zero_stage,
        ds.offload_optimizer,
        ds.offload_param,
        spec.gradient_checkpointing,
        case["micro"],
        1,
        1,
        1,
        buffers=Buffers.of(ds.buffers),
        grad_accum=ds.grad_accum_dtype,
    )
    m = train_memory(work, layout, device=device)
    out = {
        "total": m.device_total + m.host_states + m.host_buffers,
        "per_step": m.activations + m.grads + m.buffers,
        "activations": m.activations,
        "states": m.model_states + m.host_states,
        "params": work.shape.total_params,
        "trainable": work.shape.trainable_params,
        "terms": dict(m.device_terms()),
        "host_total": m.host_total,
        "host_states": m.host_states,
        "host_buffers": m.host_buffers,
        "host_build": m.host_build,
    }
    if device == "cuda":
        out["total"] = m.device_total
        out["allocated"] = m.allocated
    return out


# ---------------------------------------------------------------------------------------------------------
# Running the cases
# ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case_env(threads: int) -> dict:
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
    return env


def run_case(name: str, steps: int, threads: int, device: str = "cpu", timeout: float | None = None) -> dict:
    """The case's measured figures. On CUDA a failed case (out of memory, say) is a result, `{"error": ...}`, so
    that the other cases still run; on CPU it ends the run."""
    command = [sys.executable, __file__, "--worker", name, "--steps", str(steps), "--device", device]
    try:
        proc = subprocess.run(command, env=_case_env(threads), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return {"error": f"timed out after {timeout:.0f} s\n{out[-1500:]}\n{err[-3000:]}"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        message = f"case {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        if device == "cpu":
            raise SystemExit(message)
        return {"error": message}
    return json.loads(lines[-1][len(RESULT) :])


def _prebuild_ops(names: list[str], threads: int) -> None:
    """Compile (or load) the DeepSpeed ops the cases use, each in a process of its own and at once, so that no case
    spends its first minute in nvcc: FusedAdam where the optimizer stays on the GPU, CPU Adam where it is
    offloaded."""
    from pylon.ops import build_command

    cases = cases_for("cuda")
    ops = sorted({"cpu_adam" if cases[n].get("offload", "none") != "none" else "fused_adam" for n in names})
    t0 = time.perf_counter()
    procs = {
        op: subprocess.Popen(
            build_command(op), env=_case_env(threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for op in ops
    }
    for op, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"  building {op} failed (exit {proc.returncode}; the cases will try again):\n{out[-2000:]}")
    print(f"  DeepSpeed ops ready ({', '.join(ops)}) in {time.perf_counter() - t0:.0f} s", flush=True)


def _gpu_line() -> str | None:
    out = _smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    return out.strip().splitlines()[0] if out and out.strip() else None


def _driver(gpu: str | None) -> str:
    parts = (gpu or "").split(",")
    return parts[1].strip() if len(parts) > 1 else "?"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "deepspeed", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _mib(x: float | None, width: int, digits: int = 0) -> str:
    return f"{'-':>{width}}" if x is None else f"{x / MIB:>{width}.{digits}f}"


def cuda_figures(measured: dict, predicted: dict) -> dict:
    """What a GPU case's measurements compare: the process's device memory (nvidia-smi, or the device's used memory
    where nvidia-smi cannot see the process) against `device_total`, the allocator's peak over the steps against
    `device_total - runtime`, and the runtime (what nvidia-smi counts beyond the allocator's reserved memory)."""
    smi = [x for x in (measured.get("smi_peak_mib"), measured["final"].get("smi_mib")) if x is not None]
    if smi:
        total, source = max(smi) * MIB, f"nvidia-smi ({measured.get('smi_source')})"
    elif measured.get("smi_source") == "unavailable":  # the whole device's, as if nothing else used it
        before = (measured.get("device_used_before_mib") or 0) * MIB
        total, source = measured["device_used_peak"] - before, "cudaMemGetInfo, no nvidia-smi"
    else:  # other processes on the GPU and this one not among them: no figure of its own
        total, source = None, "nvidia-smi does not list this process"
    windows = [w for w in (measured.get("first"), measured.get("steady")) if w]
    allocated = max(w["max_allocated"] for w in windows) - measured["baseline"]["allocated"]
    reserved = max(w["max_reserved"] for w in (measured["init"], *windows))
    final_smi = measured["final"].get("smi_mib")
    runtime = final_smi * MIB - measured["final"]["reserved"] if final_smi is not None else None
    return {
        "measured_total": total,
        "total_source": source,
        "ratio": total / predicted["total"] if total is not None else None,
        "measured_allocated": allocated,
        "allocated_ratio": allocated / predicted["allocated"],
        "max_reserved": reserved,
        "measured_runtime": runtime,
        # nvidia-smi's figure should be about the runtime plus the most the allocator held: a check on the sampling
        "estimated_total": runtime + reserved if runtime is not None else None,
    }


def _describe(case: dict) -> str:
    model = case.get("preset") or f"{case['config']['model_type']} {case['config']['hidden_size']}x" + str(
        case["config"]["num_hidden_layers"]
    )
    parts = [model, case["precision"], f"ZeRO-{case['zero']}"]
    if case.get("offload", "none") != "none":
        parts.append(f"optimizer->{case['offload']}")
    if case.get("offload_param", "none") != "none":
        parts.append(f"params->{case['offload_param']}")
    if case.get("ckpt"):
        parts.append("grad ckpt")
    if case.get("lora"):
        parts.append(f"LoRA r={case['lora']['r']} ({', '.join(case['lora']['target_modules'])})")
    return " ".join(parts[:1]) + " " + ", ".join(parts[1:]) + f", {case['micro']} x {case['seq']}"


def _ratio(r: float | None, width: int) -> str:
    return f"{'n/a':>{width}}" if r is None else f"{r:>{width}.2f}"


def _verdict(r: float | None) -> str:
    return "ok" if r is not None and abs(r - 1) <= TARGET["cuda"] else "MISS"


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))


def main_cuda(names: list[str], args) -> int:
    from pylon.ops import plain_cuda_arch_list, venv_tools_first

    venv_tools_first()  # the ninja `python -m pylon.ops` builds with: another one would rebuild every op
    plain_cuda_arch_list()  # one DeepSpeed reads (the cases' processes inherit it)
    cases = cases_for("cuda")
    threads = args.threads or os.cpu_count() or 1
    gpu, versions = _gpu_line(), _versions()
    print(
        f"{len(names)} case(s), {args.steps} steps each, one process each, CUDA GPU 0 ({gpu or 'nvidia-smi: none'}); "
        f"torch {versions['torch']}, deepspeed {versions['deepspeed']}, transformers {versions['transformers']}; "
        f"{threads} threads",
        flush=True,
    )
    payload = {"device": "cuda", "gpu": gpu, "versions": versions, "steps": args.steps, "cases": {}}
    _prebuild_ops(names, threads)
    rows, env = [], None
    for name in names:
        t0 = time.perf_counter()
        predicted = predict(cases[name], "cuda")
        measured = run_case(name, args.steps, threads, "cuda", timeout=args.case_timeout)
        record = {"case": cases[name], "predicted": predicted, "measured": measured}
        if "error" in measured:
            print(f"  {name}: FAILED in {time.perf_counter() - t0:.0f} s\n{measured['error']}", flush=True)
        else:
            env = env or measured["env"]
            record["compared"] = figures = cuda_figures(measured, predicted)
            print(
                f"  {name}: done in {time.perf_counter() - t0:.0f} s: predicted {predicted['total'] / MIB:.0f} MiB, "
                f"measured {_mib(figures['measured_total'], 0)} MiB ({figures['total_source']}), ratio "
                f"{_ratio(figures['ratio'], 0)} ({_verdict(figures['ratio'])})",
                flush=True,
            )
        rows.append((name, measured, predicted, record.get("compared")))
        payload["cases"][name] = record
        payload["env"] = env
        _write_json(args.json, payload)  # after every case: a run cut short keeps what it measured

    if env:
        print(
            f"\n{env['device_name']} (sm_{env['capability'].replace('.', '')}, "
            f"{env['device_memory'] / 2**30:.1f} GiB), driver {_driver(gpu)}, "
            f"CUDA {env['cuda']}, torch {env['torch']}, deepspeed {env['deepspeed']}, "
            f"transformers {env['transformers']}"
        )
    print(
        f"\n{'case':<26}{'params':>9}{'predicted':>11}{'measured':>10}{'ratio':>7}{'':>6}"
        f"{'pred alloc':>12}{'max alloc':>11}{'ratio':>7}{'reserved':>10}{'runtime':>9}{'est':>8}"
    )
    worst = 0.0
    for name, m, p, f in rows:
        if f is None:
            print(f"{name:<26}{p['params'] / 1e6:>8.1f}M{_mib(p['total'], 11, 1)}  FAILED")
            worst = float("inf")
            continue
        worst = max(worst, abs(f["ratio"] - 1) if f["ratio"] is not None else float("inf"))
        print(
            f"{name:<26}{p['params'] / 1e6:>8.1f}M{_mib(p['total'], 11, 1)}{_mib(f['measured_total'], 10, 1)}"
            f"{_ratio(f['ratio'], 7)}{_verdict(f['ratio']):>6}"
            f"{_mib(p['allocated'], 12, 1)}{_mib(f['measured_allocated'], 11, 1)}{f['allocated_ratio']:>7.2f}"
            f"{_mib(f['max_reserved'], 10)}{_mib(f['measured_runtime'], 9)}{_mib(f['estimated_total'], 8)}"
        )
    print("\nper case, MiB: the predicted terms; the allocator's peaks (building the engine, the first step, the later")
    print("steps) and what it held before the model; nvidia-smi (before the model, after the last step); host RAM")
    for name, m, p, f in rows:
        if f is None:
            continue
        t = p["terms"]
        print(
            f"  {name}: predicted parameters {t['parameters'] / MIB:.1f}, gradients {t['gradients'] / MIB:.1f}, "
            f"optimizer {t['optimizer states'] / MIB:.1f}, activations {t['activations'] / MIB:.1f}, "
            f"buffers {t['working buffers'] / MIB:.1f}, runtime {t['runtime'] / MIB:.0f}"
        )
        steady = m["steady"]["max_allocated"] / MIB if m.get("steady") else float("nan")
        print(
            f"  {' ' * len(name)}  allocated: init {m['init']['max_allocated'] / MIB:.1f}, first step "
            f"{m['first']['max_allocated'] / MIB:.1f}, later steps {steady:.1f}, before the model "
            f"{m['baseline']['allocated'] / MIB:.1f}; nvidia-smi: {m['baseline']['smi_mib']} -> "
            f"{m['final']['smi_mib']} (peak {m['smi_peak_mib']}, {m['samples']} samples, {f['total_source']}"
            + (f"; {m['gpu_processes']} processes on the GPU" if (m.get("gpu_processes") or 0) > 1 else "")
            + ")"
        )
        print(
            f"  {' ' * len(name)}  host: predicted {p['host_total'] / MIB:.0f} (offloaded states "
            f"{(p['host_states'] + p['host_buffers']) / MIB:.0f}, build {p['host_build'] / MIB:.0f}); above the "
            f"baseline: peak RSS {m['rss_peak_delta'] / MIB:.0f}, machine's used RAM "
            f"{_mib(m.get('host_used_peak_delta'), 0)}, pinned peak {_mib(m.get('pinned_peak'), 0)} "
            f"(active {_mib(m.get('pinned_active_peak'), 0)}); "
            f"engine built in {m['init']['seconds']:.2f} s, "
            f"steps {', '.join(f'{s:.2f}' for s in m['step_seconds'])} s"
            + (f"; skipped steps {m['skipped_steps']}" if m.get("skipped_steps") else "")
            + (
                f", loss scale {m['loss_scale']:g}"
                if m.get("loss_scale") is not None and cases[name]["precision"] == "fp16"
                else ""
            )
            + (f"; allocator retries {m['alloc_retries']}" if m.get("alloc_retries") else "")
        )
    if env:
        date = time.strftime("%Y-%m-%d")
        print("\nfor docs/benchmarks.md:\n")
        print(
            "| date | machine | case | params | predicted MiB | nvidia-smi MiB | ratio | predicted w/o runtime "
            "| max allocated MiB | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        machine = f"{env['device_name']}, driver {_driver(gpu)}, CUDA {env['cuda']}"
        lead = f"{date} | {machine}"  # on the first row only
        for name, m, p, f in rows:
            if f is None:
                continue
            print(
                f"| {lead} | {_describe(cases[name])} | "
                f"{p['params'] / 1e6:.1f}M | {p['total'] / MIB:.1f} | {_mib(f['measured_total'], 0, 1)}"
                f"{'' if f['total_source'] == 'nvidia-smi (pid)' else ' (' + f['total_source'] + ')'} | "
                f"{_ratio(f['ratio'], 0)} | {p['allocated'] / MIB:.1f} | {f['measured_allocated'] / MIB:.1f} | "
                f"{f['allocated_ratio']:.2f} |"
            )
            lead = " | "
    low, high = 1 - TARGET["cuda"], 1 + TARGET["cuda"]
    print(
        f"\ntarget: measured / predicted device memory within {low:.2f}-{high:.2f} for every case -> "
        + (
            "a case failed or has no figure of its own (NOT met)"
            if worst == float("inf")
            else f"worst {1 + worst:.2f}x or {1 - worst:.2f}x ({'met' if worst <= TARGET['cuda'] else 'NOT met'})"
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        help=f"comma-separated case names (default: all). CPU: {', '.join(CASES)}. CUDA: {', '.join(CUDA_CASES)}",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the cases train (default cpu)")
    parser.add_argument("--steps", type=int, default=3, help="real training steps per case (default 3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per case (default 1; on cuda every core, for CPU Adam)"
    )
    parser.add_argument("--json", help="also write every case's figures to this file")
    parser.add_argument(
        "--case-timeout", type=float, default=240, help="cuda: seconds a case may take before it counts as failed"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        (cuda_worker if args.device == "cuda" else worker)(args.worker, args.steps)
        return 0
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    cases = cases_for(args.device)
    names = args.only.split(",") if args.only else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"unknown {args.device} case(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    if args.device == "cuda":
        return main_cuda(names, args)
    threads = args.threads or 1
    print(
        f"{len(names)} case(s), {args.steps} steps each, one process each, CPU; MiB of RSS above the baseline",
        flush=True,
    )
    rows = []
    for name in names:
        t0 = time.perf_counter()
        measured, predicted = run_case(name, args.steps, threads), predict(CASES[name])
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
    _write_json(
        args.json,
        {
            "device": "cpu",
            "versions": _versions(),
            "steps": args.steps,
            "cases": {name: {"case": CASES[name], "predicted": p, "measured": m} for name, m, p in rows},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
