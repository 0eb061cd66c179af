"""Training end to end on the session's Ray cluster: `ray job submit`-style jobs running DeepSpeed on 2
workers, checkpoints on the S3 server with retention, export loaded by `transformers`, resume after a
re-submission and after a worker is killed mid-run."""
from __future__ import annotations

import json
import os
import signal
import sysconfig
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

import pylon
from pylon import storage

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from pylon.data.prepare import prepare

    src = tmp_path_factory.mktemp("train-src")
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py"):
        (src / name).write_bytes((STDLIB / name).read_bytes())
    out = str(tmp_path_factory.mktemp("train-data") / "corpus")
    prepare([str(src)], out, seq_len=64, use_ray=False, progress=False)
    return out


def _write_spec(path: Path, corpus: str, storage_root: str, *, name: str, steps: int, every: int, **over) -> Path:
    spec = {
        "kind": "TrainJob", "name": name,
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"},
        "precision": "fp32",
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "steps": steps,
        "checkpoint": {"storage": storage_root, "every_steps": every, "keep_last": 2},
    }
    for key, value in over.items():
        spec[key] = value
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(spec_path: Path) -> str:
    client = pylon.connect()
    return client.submit_job(f"cd {spec_path.parent} && python -m pylon.jobs.train --config {spec_path.name}")


def _wait(job_id: str, timeout_s: float = 600) -> str:
    client = pylon.connect()
    status = client.wait_job(job_id, timeout_s=timeout_s)
    assert status == "SUCCEEDED", client.job_logs(job_id)[-6000:]
    return client.job_logs(job_id)


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _committed_steps(run_uri: str) -> list[int]:
    from pylon.jobs.checkpoint import list_committed

    return [c.step for c in list_committed(run_uri)]


def test_ray_job_trains_checkpoints_to_s3_and_exports(ray_cluster, corpus, s3_root, tmp_path):
    spec = _write_spec(tmp_path / "train.yaml", corpus, f"{s3_root}/runs", name="tiny-s3", steps=16, every=4)
    logs = _wait(_submit(spec))
    run_uri = f"{s3_root}/runs/tiny-s3"
    records = _metrics(run_uri)
    assert [r["step"] for r in records] == list(range(1, 17))
    for key in ("loss", "lr", "tokens_per_s", "mfu", "step_time_s", "data_wait_fraction", "peak_memory_bytes"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert np.mean([r["loss"] for r in records[-4:]]) < records[0]["loss"] - 0.5, "it did not learn"
    assert 0 < records[-1]["mfu"] < 1
    assert storage.read_bytes(f"{run_uri}/loss.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert _committed_steps(run_uri) == [12, 16]  # keep_last 2 of 4, 8, 12, 16

    # The export loads with transformers and reproduces the trained engine's logits.
    import torch
    from transformers import AutoModelForCausalLM

    local = tmp_path / "export"
    for name in storage.listdir(f"{run_uri}/export"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(storage.read_bytes(f"{run_uri}/export/{name}"))
    assert {"config.json", "model.safetensors", "pylon_tokenizer.json"} <= set(os.listdir(local))
    model = AutoModelForCausalLM.from_pretrained(local).eval()
    ref = storage.read_json(f"{run_uri}/reference_logits.json")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ref["input_ids"]])).logits[0, :, :16]
    assert torch.allclose(logits, torch.tensor(ref["logits"]), atol=1e-4), (logits - torch.tensor(ref["logits"])).abs().max()
    assert "Traceback" not in logs


def test_resubmitting_the_same_run_resumes_it(ray_cluster, corpus, tmp_path):
    root = str(tmp_path / "runs")
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="tiny-resume", steps=8, every=4)
    _wait(_submit(spec))
    first = _metrics(f"{root}/tiny-resume")
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="tiny-resume", steps=14, every=4)
    logs = _wait(_submit(spec))
    assert "resumed tiny-resume from step 8" in logs
    records = _metrics(f"{root}/tiny-resume")
    assert [r["step"] for r in records] == list(range(1, 15))
    assert records[:8] == first  # the curve continues; nothing before the resume point was redone
    assert records[8]["tokens_seen"] == first[-1]["tokens_seen"] + records[8]["tokens"]


def _train_workers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([p.info["name"] or ""] + (p.info["cmdline"] or []))
        if "RayTrainWorker" in text:
            found.append(p)
    return found


def test_a_killed_worker_resumes_from_the_last_commit(ray_cluster, corpus, tmp_path):
    from pylon.data.reader import ShardStream

    root = str(tmp_path / "runs")
    run_uri = f"{root}/tiny-kill"
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="tiny-kill", steps=30, every=5)
    job_id = _submit(spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(s >= 10 for s in _committed_steps(run_uri)):
        time.sleep(0.5)
    victims = _train_workers()
    assert victims, "no Ray Train worker process found to kill"
    victims[0].send_signal(signal.SIGKILL)
    logs = _wait(job_id)
    assert "resumed tiny-kill from step" in logs
    records = _metrics(run_uri)
    assert [r["step"] for r in records] == list(range(1, 31))
    # Each rank's data position after 30 steps is exactly where an uninterrupted stream would be.
    from pylon.jobs.checkpoint import latest_committed

    final = latest_committed(run_uri)
    assert final.step == 30
    for rank in range(2):
        saved = storage.read_json(f"{final.uri}/rank-{rank}.json")["extra"]["data"]["position"]
        replay = ShardStream(corpus, batch_size=4, rank=rank, world_size=2, seed=1, shuffle_buffer=64)
        batches = (b for _ in range(100) for b in replay.epoch())
        for _ in range(30):
            next(batches)
        assert saved == json.loads(json.dumps(replay.state_dict()["position"]))
