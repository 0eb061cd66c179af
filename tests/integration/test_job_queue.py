"""The cluster's job queue (pylon.jobs.queue) on the session's 2-CPU Ray cluster: three TrainJobs that each need
the whole cluster run one after another, the two that wait in priority order, and `pylon jobs list` says why
they wait."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import pylon

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from pylon.data.prepare import prepare

    src = tmp_path_factory.mktemp("queue-src")
    for name in ("argparse.py", "textwrap.py"):
        (src / name).write_bytes((STDLIB / name).read_bytes())
    out = str(tmp_path_factory.mktemp("queue-data") / "corpus")
    prepare([str(src)], out, seq_len=64, use_ray=False, progress=False)
    return out


def _spec(corpus: str, root: Path, name: str, *, priority: int, steps: int) -> dict:
    return {
        "kind": "TrainJob",
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64},
        # 2 workers x 1 CPU: the whole cluster.
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 0},
        "batch": {"micro_batch_size": 2, "grad_accum_steps": 1},
        "optim": {"warmup_steps": 0},
        "steps": steps,
        "checkpoint": {"storage": str(root), "every_steps": steps},
        "priority": priority,
    }


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "pylon", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r
    return r


# Three training jobs one after another (4 minutes); the queue's rules are tests/unit/jobs/test_queue.py's. `make
# test-all`, for make test's time.
@pytest.mark.slow
def test_jobs_that_need_the_whole_cluster_run_one_after_another_in_priority_order(ray_cluster, corpus, tmp_path):
    client = pylon.connect()
    first = client.train(_spec(corpus, tmp_path, "queue-first", priority=0, steps=40), export=False)
    seen: list[dict] = []  # every poll of the queue's own record

    def poll() -> dict[str, dict]:
        queue = client.job_queue()
        seen.append(queue)
        return queue

    deadline = time.monotonic() + 120
    while poll().get(first.job_id, {}).get("state") != "admitted":
        assert client.job_status(first.job_id) in ("PENDING", "RUNNING"), client.job_logs(first.job_id)[-3000:]
        assert time.monotonic() < deadline, "the first job was never admitted"
        time.sleep(1)
    low = client.train(_spec(corpus, tmp_path, "queue-low", priority=1, steps=3), export=False)
    high = client.train(_spec(corpus, tmp_path, "queue-high", priority=5, steps=3), export=False)
    while not all(poll().get(j.job_id, {}).get("state") == "queued" for j in (low, high)):
        assert time.monotonic() < deadline + 60, f"the later jobs never queued: {seen[-1]}"
        time.sleep(1)
    queue = seen[-1]
    assert queue[first.job_id]["state"] == "admitted", "the first job ended before the others queued: too short"
    assert queue[high.job_id]["reason"].startswith("queued (1st, priority 5): needs {CPU: 2}, cluster has 0 CPU free")
    assert queue[low.job_id]["reason"].startswith("queued (2nd, priority 1)")

    listed = _cli("jobs", "list")
    table, waiting = listed.stdout.split("waiting in the job queue")
    lines = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert lines[high.job_id].split()[1] == "QUEUED" and lines[low.job_id].split()[1] == "QUEUED", listed.stdout
    assert lines[first.job_id].split()[1] == "RUNNING", listed.stdout
    assert waiting.index(high.job_id) < waiting.index(low.job_id)
    assert "needs {CPU: 2}, cluster has 0 CPU free of 2" in waiting
    as_json = {j["job_id"]: j for j in json.loads(_cli("jobs", "list", "--json").stdout)}
    assert as_json[low.job_id]["queue"]["priority"] == 1 and as_json[low.job_id]["queue"]["state"] == "queued"

    for run in (first, high, low):
        status = client.wait_job(run.job_id, timeout_s=300, poll_s=1)
        assert status == "SUCCEEDED", client.job_logs(run.job_id)[-4000:]
        if run is not low:
            poll()
    # One after another: never two admitted at once; each one's workers started after the one before it.
    for queue in seen:
        assert sum(1 for e in queue.values() if e["state"] == "admitted") <= 1, queue
    started = {
        run.job_id: json.loads((tmp_path / name / "workers.json").read_text())["at"]
        for run, name in ((first, "queue-first"), (high, "queue-high"), (low, "queue-low"))
    }
    assert started[first.job_id] < started[high.job_id] < started[low.job_id], started
    assert "pylon queue: " + high.job_id + " queued (1st" in client.job_logs(high.job_id)
    assert client.job_queue() == {}  # every place given back


CHILD_DRIVER = """
import os, sys, time
from dataclasses import asdict
import ray
from pylon.jobs.queue import Entry, queue_actor
ray.init(address=sys.argv[1], log_to_driver=False)
entry = Entry(key=sys.argv[2], name="killed", priority=0, user="u", need={"CPU": 2}, submitted=time.time(),
              driver_job_id=ray.get_runtime_context().get_job_id())
print(ray.get(queue_actor().wait.remote(asdict(entry)))["state"], flush=True)
os._exit(0)  # dies holding the whole cluster, never giving its place back
"""


# The queue's own unit tests cover giving a place back; this one kills a real driver. `make test-all`, for make test's
# time.
@pytest.mark.slow
def test_a_driver_that_dies_admitted_does_not_keep_its_place(ray_cluster):
    client = pylon.connect()
    key = f"killed-{time.time_ns()}"
    child = subprocess.run(
        [sys.executable, "-c", CHILD_DRIVER, client.gcs_address, key], capture_output=True, text=True, timeout=120
    )
    assert child.stdout.strip() == "admitted", child.stderr[-3000:]
    deadline = time.monotonic() + 30
    while key in client.job_queue():  # Ray's job table says the driver is dead: its place is given back
        assert time.monotonic() < deadline, client.job_queue()
        time.sleep(1)
