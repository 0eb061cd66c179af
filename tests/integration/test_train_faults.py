"""Training through faults, each test asserting what survives (the harness: tests/faults.py).

- Object storage unreachable (every connection reset) while workers read shards, and for 30 s during a checkpoint
  upload of a training job: the reads and the upload are retried (pylon.storage, PYLON_STORAGE_RETRY_S), the run
  finishes, and latest.json only ever names a complete checkpoint (its manifest, and every file the manifest lists,
  stored with the listed size).
- A training worker killed while a checkpoint commit is in flight (held there by a stalled store): the group
  restarts from the previous commit and the data positions end exactly where an uninterrupted stream's would.
- The driver of a training job killed: submitting the same spec again resumes from the last commit, and no step
  is trained twice.

Covered elsewhere, not repeated here: a process SIGKILLed at each point of a save (mid-upload, before the manifest,
before latest.json) keeps the previous checkpoint loadable, and losses after the resume match an uninterrupted
run's: tests/integration/test_checkpoint_s3.py; a worker killed between commits resumes with exact data positions:
tests/integration/test_train.py (slow); a whole worker machine lost: tests/integration/test_hosts.py; re-submitting a
finished run continues it: tests/integration/test_ray_job_submit.py; a full disk during a save:
tests/unit/jobs/test_checkpoint_faults.py; the retries themselves against a stalled, reset or dropping store:
tests/unit/ground/test_storage_faults.py.
"""

from __future__ import annotations

import json
import re
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import faults
import psutil
import pytest
from test_train import (  # the same small ZeRO-2 TrainJob as the resume tests, and how they look at it
    _committed_steps,
    _train_workers,
    _write_spec,
)

import pylon
from pylon import storage

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture
def s3_proxy(s3_server):
    """A proxy that the jobs reach the store through (their runtime_env names it). This process keeps talking to the
    server directly: the test's own look at the store (which steps are committed) must not hang in a stall it made."""
    with faults.proxied(s3_server.endpoint_url) as proxy:
        yield proxy


def _direct(s3_server):
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.endpoint_url)


# ---------------------------------------------------------------------------------------------------------
# Shard reads through an outage (no training: the reader alone, in Ray Data read tasks on the session's cluster)
# ---------------------------------------------------------------------------------------------------------


def test_shard_reads_outlast_an_outage_and_yield_exactly_the_same_samples(ray_cluster, s3_server, monkeypatch):
    from pylon.data.reader import ShardStream
    from pylon.data.testing import write_synthetic_dataset

    uri = f"s3://{s3_server.bucket}/faults-shards-{uuid.uuid4().hex[:8]}"
    write_synthetic_dataset(uri, rows=600, rows_per_shard=50, seq_len=16)  # 12 shards, straight to the server

    def ids(stream: ShardStream) -> list[int]:
        return [i for batch in stream.epoch() for i in batch.sample_ids.tolist()]

    expected = ids(ShardStream(uri, batch_size=8, seed=3, shuffle_buffer=64, prefetch_shards=1))
    with faults.proxied(s3_server.endpoint_url, monkeypatch) as proxy:
        stream = ShardStream(uri, batch_size=8, seed=3, shuffle_buffer=64, prefetch_shards=1)
        # Once the first shard's GET went through, every connection is reset for 12 s: longer than botocore's and
        # s3fs's own retries last, so the read tasks that follow carry on only through storage's retries.
        outage = proxy.when(lambda: proxy.requested(".parquet"), "reset", 12)
        got = ids(stream)
    assert outage.started_at is not None and proxy.faulted > 0, "the outage never hit the reads"
    after = [t for t in proxy.requested(".parquet") if t > outage.started_at + 11]
    assert after, "no shard was read after the outage: it hit none of the reads"
    assert got == expected


# ---------------------------------------------------------------------------------------------------------
# Training jobs
# ---------------------------------------------------------------------------------------------------------


def _submit(spec_path: Path, env: dict[str, str] | None = None) -> str:
    runtime_env = {"env_vars": env} if env else None
    return pylon.connect().submit_job(
        f"cd {spec_path.parent} && python -m pylon.jobs.train --config {spec_path.name} --no-export",
        runtime_env=runtime_env,
    )


def _wait(job_id: str, timeout_s: float = 600) -> str:
    client = pylon.connect()
    status = client.wait_job(job_id, timeout_s=timeout_s)
    logs = client.job_logs(job_id)
    assert status == "SUCCEEDED", logs[-6000:]
    return logs


def _steps(run_uri: str) -> list[int]:
    return [json.loads(line)["step"] for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _assert_exact_data_positions(run_uri: str, corpus: str, steps: int) -> None:
    """Each rank's data position in the final checkpoint is where an uninterrupted stream is after `steps`
    batches (the check tests/integration/test_train.py's killed-worker test makes)."""
    from pylon.data.reader import ShardStream
    from pylon.jobs.checkpoint import latest_committed

    final = latest_committed(run_uri)
    assert final.step == steps
    for rank in range(2):
        saved = storage.read_json(f"{final.uri}/rank-{rank}.json")["extra"]["data"]["position"]
        replay = ShardStream(corpus, batch_size=4, rank=rank, world_size=2, seed=1, shuffle_buffer=64)
        batches = (b for _ in range(100) for b in replay.epoch())
        for _ in range(steps):
            next(batches)
        assert saved == json.loads(json.dumps(replay.state_dict()["position"])), rank


class LatestWatcher:
    """Polls `<run>/latest.json` on the server itself (not through the proxy) while a job runs, and checks that
    every checkpoint it names is complete: its manifest, and every file the manifest lists, stored with the listed
    size. Retention may delete a checkpoint after the pointer moved on; only the pointer's current one counts."""

    def __init__(self, s3_server, run_uri: str):
        self.client = _direct(s3_server)
        self.bucket, _, self.prefix = run_uri.removeprefix("s3://").partition("/")
        self.named: list[int] = []
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _get_json(self, key: str):
        return json.loads(self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read())

    def _latest(self) -> dict | None:
        try:
            return self._get_json("latest.json")
        except self.client.exceptions.NoSuchKey:
            return None

    def _check(self, latest: dict) -> str | None:
        try:
            manifest = self._get_json(f"{latest['path']}/manifest.json")
        except self.client.exceptions.NoSuchKey:
            return f"latest.json names step {latest['step']}, which has no manifest"
        listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/{latest['path']}/")
        stored = {o["Key"].split(f"{latest['path']}/", 1)[1]: o["Size"] for o in listing.get("Contents", [])}
        wrong = [r for r, e in manifest["files"].items() if stored.get(r) != e["bytes"]]
        return f"step {latest['step']}: files missing or of the wrong size: {wrong}" if wrong else None

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            latest = self._latest()
            if latest is None or (self.named and self.named[-1] == latest["step"]):
                continue
            problem = self._check(latest)
            if problem and self._latest() == latest:  # still the latest: a real problem, not retention racing us
                self.problems.append(problem)
            self.named.append(latest["step"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# ~3 min: a 30 s outage in the middle of a 2-worker run on the S3 server. `make test-all`; `make test` covers the
# same retries in the shard-read test above and in tests/unit/ground/test_storage_faults.py.
@pytest.mark.slow
def test_a_30s_storage_outage_during_a_checkpoint_upload_is_retried_and_the_run_finishes(
    ray_cluster, s3_server, s3_proxy, tmp_path
):
    from pylon.data.prepare import prepare

    root = f"s3://{s3_server.bucket}/faults-runs-{uuid.uuid4().hex[:8]}"
    corpus = f"{root}/corpus"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py"):
        (src / name).write_bytes((STDLIB / name).read_bytes())
    prepare([str(src)], corpus, seq_len=64, use_ray=False, progress=False)
    run_uri = f"{root}/outage"
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="outage", steps=20, every=5)
    watcher = LatestWatcher(s3_server, run_uri)
    # The job reaches the store only through the proxy; every connection is reset for 30 s from the first request
    # for step 10's checkpoint.
    outage = s3_proxy.when(lambda: s3_proxy.requested("checkpoints/step-00000010/"), "reset", 30, timeout_s=900)
    try:
        logs = _wait(_submit(spec, {"AWS_ENDPOINT_URL": s3_proxy.url, "PYLON_STORAGE_RETRY_S": "180"}), 900)
    finally:
        watcher.stop()
    assert outage.started_at is not None and s3_proxy.faulted > 0, "the outage never happened"
    assert "retrying in" in logs, logs[-4000:]  # storage's retries carried the save through
    assert "resumed outage from step" not in logs, "the workers failed and restarted instead of retrying"
    assert _steps(run_uri) == list(range(1, 21))
    assert _committed_steps(run_uri) == [15, 20]
    assert not watcher.problems, watcher.problems
    assert watcher.named and watcher.named[-1] == 20 and 10 in watcher.named, watcher.named


# ~3 min: two runs' worth of a 2-worker job (the restart rebuilds the group). `make test-all`.
@pytest.mark.slow
def test_a_worker_killed_during_the_checkpoint_commit_resumes_from_the_previous_commit_exactly(
    ray_cluster, s3_server, s3_proxy, corpus, tmp_path
):
    root = f"s3://{s3_server.bucket}/faults-runs-{uuid.uuid4().hex[:8]}"
    run_uri = f"{root}/kill-commit"
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="kill-commit", steps=20, every=5)
    # The store stalls at the first request for step 10's checkpoint: the save is held in the middle of its commit.
    stall = s3_proxy.when(lambda: s3_proxy.requested("checkpoints/step-00000010/"), "stall", 600, timeout_s=600)
    job_id = _submit(spec, {"AWS_ENDPOINT_URL": s3_proxy.url})
    deadline = time.monotonic() + 600
    while stall.started_at is None:
        assert time.monotonic() < deadline, "step 10's save never started"
        assert pylon.connect().job_status(job_id) in ("PENDING", "RUNNING"), pylon.connect().job_logs(job_id)[-4000:]
        time.sleep(0.2)
    time.sleep(2)  # every rank inside the save
    assert _committed_steps(run_uri) == [5], "step 10 committed before the kill"
    victims = _train_workers()
    assert victims, "no Ray Train worker process found to kill"
    faults.kill(victims[0].pid)
    s3_proxy.set("pass")
    logs = _wait(job_id)
    assert "resumed kill-commit from step 5" in logs, logs[-4000:]
    assert _steps(run_uri) == list(range(1, 21))  # the records past step 5 were dropped and written again, once
    assert _committed_steps(run_uri) == [15, 20]
    _assert_exact_data_positions(run_uri, corpus, 20)


def _driver(job_id: str) -> psutil.Process | None:
    """The job's entrypoint process, `python -m pylon.jobs.train`, told apart from other jobs' by the job id Ray
    passes it in its environment."""
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if "pylon.jobs.train" not in cmdline or "-m" not in cmdline:
            continue
        try:
            if job_id in p.environ().get("RAY_JOB_CONFIG_JSON_ENV_VAR", ""):
                return p
        except psutil.Error:
            continue
    return None


# ~3 min: a run, killed, and submitted again. `make test-all`.
@pytest.mark.slow
def test_a_killed_driver_is_resumed_by_submitting_the_same_spec_again(ray_cluster, corpus, tmp_path):
    root = str(tmp_path / "runs")
    run_uri = f"{root}/kill-driver"
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="kill-driver", steps=20, every=4)
    client = pylon.connect()
    first = client.train(str(spec))
    deadline = time.monotonic() + 600
    while not any(s >= 8 for s in _committed_steps(run_uri)):
        assert time.monotonic() < deadline, "no commit at step 8"
        time.sleep(0.3)
    driver = _driver(first.job_id)
    assert driver is not None, "the job's driver process was not found"
    faults.kill(driver.pid)
    assert client.wait_job(first.job_id, timeout_s=120) == "FAILED"
    deadline = time.monotonic() + 120
    while _train_workers() and time.monotonic() < deadline:  # the driver's workers go with it
        time.sleep(0.5)
    killed_at = max(_committed_steps(run_uri))
    assert killed_at < 20

    second = client.train(str(spec))
    logs = _wait(second.job_id)
    resumed = [int(s) for s in re.findall(r"resumed kill-driver from step (\d+)", logs)]
    assert set(resumed) == {killed_at}, logs[-4000:]  # each rank says it (Ray may repeat a line per worker)
    assert _steps(run_uri) == list(range(1, 21))  # nothing trained twice: the steps continue from the commit
    _assert_exact_data_positions(run_uri, corpus, 20)
