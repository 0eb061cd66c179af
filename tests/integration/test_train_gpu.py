"""Training on a GPU as a TrainJob runs it: Ray Train + DeepSpeed, one worker per job (issue 36, item 1).

`make test-gpu` (PYLON_TEST_DEVICE=cuda, a machine with a CUDA GPU) runs every variant below on the one GPU at once,
each job's worker taking a sixth of it, on NCCL: ZeRO-2 bf16; ZeRO-3 bf16 with parameters and optimizer offloaded to
CPU and the loss computed a chunk of tokens at a time (`loss_chunk_tokens`); fp16 with dynamic loss scaling started
high enough that the first steps overflow (skipped and reported, not a crash); gradient checkpointing, with each
packed document attended on its own (`attention_mask: document`, whose check runs in bf16 on the GPU's attention
kernels); LoRA; ZeRO-3 with parameters and optimizer on NVMe where DeepSpeed's async I/O op
builds (libaio). On a CPU (gloo; `make test-all`) the same runs, bar fp16 (a GPU's).

Each variant trains a small GPT for STEPS steps in two submissions of one job, as a user resumes one: the first
stops at HALF (its checkpoint commits there), the second, submitted with `steps: STEPS`, resumes from that commit.
Then: a record for every step, the loss falls, both commits kept, and the export (written when the job ends) loads
in `transformers`, in the training precision on the training device, and gives the trained engine's logits on a
fixed input (`reference_logits.json`, which the trainer records after its last step).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from test_train import WIDE_GPT  # beside this file

import pylon
from pylon import storage

pytestmark = pytest.mark.integration

DEVICE = os.environ.get("PYLON_TEST_DEVICE", "cpu")
ON_CUDA = DEVICE == "cuda"
if not ON_CUDA:
    pytestmark = [pytestmark, pytest.mark.slow]  # on a CPU: `make test-all` (each path also runs in other tests)

STEPS, HALF = 24, 12
MODEL = WIDE_GPT  # a GPT wide enough that ZeRO-3 partitions and NVMe swapping writes; dropout off


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    deepspeed: dict
    extra: dict = field(default_factory=dict)
    gpu_only: bool = False
    nvme: bool = False


VARIANTS = [
    Variant("zero2-bf16", "bf16", {"zero_stage": 2}),
    Variant(
        "zero3-bf16-offload-chunked",
        "bf16",
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        extra={"loss_chunk_tokens": 48},  # the loss a chunk at a time, its check in bf16 on the GPU
    ),
    # The loss scale starts at 2**28 and halves at every overflow (hysteresis 1): fp16 gradients of a random model
    # (largest elements ~1e-2) times it overflow (max 65,504), so the first steps are skipped until it is ~2**22.
    Variant(
        "zero2-fp16-overflow",
        "fp16",
        {"zero_stage": 2, "loss_scaling": {"initial_power": 28, "hysteresis": 1}},
        gpu_only=True,
    ),
    Variant(
        "zero2-bf16-ckpt-docs",
        "bf16",
        {"zero_stage": 2},
        extra={"gradient_checkpointing": True, "attention_mask": "document"},
    ),
    Variant(
        "zero2-bf16-lora",
        "bf16",
        {"zero_stage": 2},
        extra={"lora": {"r": 8, "alpha": 16, "target_modules": ["c_attn", "c_fc"]}},
    ),
    Variant(
        "zero3-bf16-nvme", "bf16", {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}, nvme=True
    ),
]


def _aio_builds() -> bool:
    """Whether DeepSpeed's async I/O op (NVMe offload) can be built here: it needs libaio's headers."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


@pytest.fixture(scope="module")
def cluster(request, pylon_home, tmp_path_factory) -> Iterator[None]:
    """On a GPU machine: a local cluster of its own (the GPU found by Ray; no S3 server needed). On a CPU: the
    integration session's cluster."""
    if not ON_CUDA:
        request.getfixturevalue("ray_cluster")
        yield
        return
    import torch

    from pylon.infra import local

    if not torch.cuda.is_available():
        pytest.fail("PYLON_TEST_DEVICE=cuda, but torch sees no CUDA GPU")
    # GPUs named, not left to Ray's detection (which reads NVML, not always there in a container).
    info, started = local.up(
        num_cpus=min(12, os.cpu_count() or 2),
        num_gpus=torch.cuda.device_count(),
        object_store_memory=2 * 2**30,
        home=pylon_home,
    )
    try:
        yield
    finally:
        if started:
            local.down(home=pylon_home)


def _spec(variant: Variant, corpus: str, root: Path, steps: int) -> dict:
    deepspeed = dict(variant.deepspeed)
    if variant.nvme:
        deepspeed["nvme_path"] = str(root / "nvme" / variant.name)
    per_worker = {"CPU": 1, "GPU": round(1 / len(VARIANTS), 3)} if ON_CUDA else {"CPU": 1}
    return {
        "kind": "TrainJob",
        "name": variant.name,
        "model": MODEL,
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 1, "use_gpu": ON_CUDA, "resources_per_worker": per_worker},
        "deepspeed": deepspeed,
        "precision": variant.precision,
        # A constant lr: the second submission's larger `steps` leaves the schedule as it was.
        "optim": {"lr": 2e-3, "warmup_steps": 0, "schedule": "constant"},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "steps": steps,
        "checkpoint": {"storage": str(root / "runs"), "every_steps": HALF, "keep_last": 2},
        **variant.extra,
    }


def _submit_all(variants: list[Variant], corpus: str, root: Path, steps: int) -> dict[str, str]:
    client = pylon.connect()
    jobs = {}
    for v in variants:
        spec = root / "specs" / f"{v.name}-{steps}.yaml"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(yaml.safe_dump(_spec(v, corpus, root, steps)))
        jobs[v.name] = client.submit_job(
            f"cd {spec.parent} && {sys.executable} -m pylon.jobs.train --config {spec.name}"
        )
    return jobs


def _wait_all(jobs: dict[str, str], timeout_s: float) -> dict[str, tuple[str, str]]:
    """Each job's final status and logs, waiting for all of them."""
    client = pylon.connect()
    deadline = time.monotonic() + timeout_s
    out = {}
    for name, job_id in jobs.items():
        status = client.wait_job(job_id, timeout_s=max(1.0, deadline - time.monotonic()))
        out[name] = (status, client.job_logs(job_id))
    return out


def _metrics(run_uri: str) -> list[dict]:
    lines = storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def _check_export(variant: Variant, run_uri: str, local: Path) -> str:
    """The export, loaded by transformers in the training precision on the training device, against the trained
    engine's logits. Returns a line for the log."""
    import torch
    from transformers import AutoModelForCausalLM

    for name in storage.listdir(f"{run_uri}/export"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(storage.read_bytes(f"{run_uri}/export/{name}"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(variant.precision, torch.float32)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype).to(device).eval()
    ref = storage.read_json(f"{run_uri}/reference_logits.json")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ref["input_ids"]], device=device)).logits[0, :, :16].float().cpu()
    want = torch.tensor(ref["logits"])
    diff = (logits - want).abs().max().item()
    # The same weights in the same precision on the same device: equal but for the order of half-precision sums
    # (a LoRA engine adds its adapters' product; the export has it merged into the weights).
    tolerance = 1e-4 if dtype == torch.float32 else 0.05 * max(1.0, want.abs().max().item())
    assert diff <= tolerance, f"export's logits differ from the trained engine's by {diff:.4g} (> {tolerance:.3g})"
    return f"export logits within {diff:.3g} of the engine's ({variant.precision}, {device.type})"


@pytest.mark.timeout(2400)  # two rounds of jobs, each waited on for up to 900 s
def test_each_variant_trains_checkpoints_resumes_and_exports(cluster, corpus, tmp_path) -> None:
    variants = [v for v in VARIANTS if ON_CUDA or not v.gpu_only]
    if any(v.nvme for v in variants) and not _aio_builds():
        variants = [v for v in variants if not v.nvme]
        print("NVMe variant skipped: DeepSpeed's async I/O op cannot be built here (libaio's headers missing)")
    root = tmp_path
    t0 = time.monotonic()
    first = _wait_all(_submit_all(variants, corpus, root, HALF), timeout_s=900)
    second = {}
    resumable = [v for v in variants if first[v.name][0] == "SUCCEEDED"]
    if resumable:
        second = _wait_all(_submit_all(resumable, corpus, root, STEPS), timeout_s=900)
    problems, lines = [], []
    for v in variants:
        run_uri = str(root / "runs" / v.name)
        status, logs = second.get(v.name) or first[v.name]
        if status != "SUCCEEDED":
            problems.append(f"{v.name}: {'resumed' if v.name in second else 'first'} job {status}:\n{logs[-4000:]}")
            continue
        try:
            assert f"resumed {v.name} from step {HALF}" in logs, "the second submission did not resume"
            records = _metrics(run_uri)
            assert [r["step"] for r in records] == list(range(1, STEPS + 1)), [r["step"] for r in records]
            losses = [r["loss"] for r in records]
            assert all(map(lambda x: x == x and abs(x) < 1e4, losses)), losses
            first_loss, last = losses[0], sum(losses[-4:]) / 4
            assert last < first_loss - 0.3, f"loss did not fall: {first_loss:.3f} -> {last:.3f}"
            from pylon.jobs.checkpoint import list_committed

            assert [c.step for c in list_committed(run_uri)] == [HALF, STEPS]
            line = f"{v.name}: loss {first_loss:.3f} -> {last:.3f}"
            if v.precision == "fp16":
                skipped = [r["step"] for r in records if r["skipped"]]
                assert skipped and skipped[0] == 1, f"no overflow at the start (skipped: {skipped})"
                assert not records[-1]["skipped"] and records[-1]["skipped_steps"] == len(skipped), records[-1]
                assert records[-1]["loss_scale"] < 2**28, records[-1]
                log_first = first[v.name][1]
                assert re.search(r"step 1: fp16 gradients overflowed; the update was skipped", log_first), log_first[
                    -3000:
                ]
                line += f"; {len(skipped)} overflowing steps skipped, loss scale now {records[-1]['loss_scale']:g}"
            if v.extra.get("attention_mask") == "document":
                found = re.search(r"attention_mask document: each packed document attended on its own.*", logs)
                assert found, "no document-attention check in the log"
                line += f"; {found.group(0)}"
            if "lora" in v.extra:
                found = re.search(r"model: ([\d,]+) parameters, ([\d,]+) trainable", first[v.name][1])
                assert found, "no parameter count in the log"
                total, trainable = (int(x.replace(",", "")) for x in found.groups())
                assert trainable * 20 < total, found.group(0)
            lines.append(f"{line}; {_check_export(v, run_uri, tmp_path / 'exports' / v.name)}")
        except AssertionError as e:
            problems.append(f"{v.name}: {e}")
    print(f"\n{len(variants)} variants on {DEVICE} in {time.monotonic() - t0:.0f} s:\n  " + "\n  ".join(lines))
    assert not problems, "\n\n".join(problems)
