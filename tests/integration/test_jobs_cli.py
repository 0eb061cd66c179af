"""`pylon jobs list | logs ID [--follow] | stop ID` and `pylon train --json`, as real processes against real jobs
on the session's Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import yaml

import pylon

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "pylon", *args], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def test_jobs_list_logs_and_stop(ray_cluster):
    client = pylon.connect()
    tag = uuid.uuid4().hex[:6]
    hello = client.submit_job("python -c \"print('hello from a job')\"", submission_id=f"hello-{tag}")
    sleeper = client.submit_job("sleep 60", submission_id=f"sleep-{tag}")

    r = cli("jobs", "logs", hello, "--follow")
    assert r.returncode == 0 and "hello from a job" in r.stdout and f"job {hello} SUCCEEDED" in r.stderr, r
    r = cli("jobs", "logs", hello)
    # The job's output as a line of its own (Ray's "Running entrypoint" line may land before or after it).
    assert r.returncode == 0 and "hello from a job" in r.stdout.splitlines(), r

    r = cli("jobs", "list", "--json")
    assert r.returncode == 0, r.stderr
    jobs = {j["job_id"]: j for j in json.loads(r.stdout)}
    assert jobs[hello]["status"] == "SUCCEEDED" and jobs[hello]["kind"] is None
    assert jobs[sleeper]["status"] in ("PENDING", "RUNNING") and jobs[sleeper]["entrypoint"] == "sleep 60"
    r = cli("jobs", "list")
    assert r.returncode == 0 and r.stdout.startswith("JOB ID") and hello in r.stdout and sleeper in r.stdout

    r = cli("jobs", "stop", sleeper)
    assert r.returncode == 0 and f"job {sleeper} STOPPED" in r.stdout, r
    assert client.job_status(sleeper) == "STOPPED"
    r = cli("jobs", "stop", hello)
    assert r.returncode == 0 and "already ended: SUCCEEDED" in r.stdout, r

    for args in (["logs", "no-such-job"], ["logs", "no-such-job", "--follow"], ["stop", "no-such-job"]):
        r = cli("jobs", *args)
        assert r.returncode == 1 and r.stderr.startswith("error: no job 'no-such-job'"), (args, r)


def test_train_json_then_a_failed_job_follows_to_exit_1(ray_cluster, tmp_path):
    spec = tmp_path / "train.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "kind": "TrainJob",
                "name": "cli-broken",
                "model": {"preset": "gpt-tiny"},
                "data": {"uri": str(tmp_path / "no-data-here")},
                "steps": 4,
                "checkpoint": {"storage": str(tmp_path / "runs")},
            }
        )
    )
    r = cli("train", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    submitted = json.loads(r.stdout)
    assert submitted["job_id"].startswith("train-cli-broken-")
    assert submitted["run_uri"] == str(tmp_path / "runs" / "cli-broken")

    r = cli("jobs", "logs", submitted["job_id"], "--follow", timeout=300)
    assert r.returncode == 1 and f"job {submitted['job_id']} FAILED" in r.stderr, r
    assert "no-data-here" in r.stdout  # the job's own error, in its logs
    listed = {j["job_id"]: j for j in json.loads(cli("jobs", "list", "--json").stdout)}[submitted["job_id"]]
    assert listed["kind"] == "TrainJob" and listed["metadata"]["pylon_name"] == "cli-broken"
    assert listed["metadata"]["pylon_run_uri"] == submitted["run_uri"]
