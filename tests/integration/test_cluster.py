"""The session's local cluster: status, token auth, jobs through the Jobs API, connect()."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import requests

import pylon
from pylon.errors import ClusterError
from pylon.infra import local as cluster

pytestmark = pytest.mark.integration
PYLON = str(Path(sys.executable).parent / "pylon")


def test_status_shows_the_head_node_and_its_resources(ray_cluster):
    status = pylon.connect().status()
    alive = [n for n in status.nodes if n.state == "ALIVE"]
    assert len(alive) == 1 and alive[0].is_head
    assert status.total_resources()["CPU"] == 2
    assert status.dashboard_url == ray_cluster.dashboard_url
    text = str(status)
    assert "nodes: 1 alive" in text and "CPU 2" in text and "running jobs: 0" in text


def test_dashboard_and_jobs_api_listen_on_loopback_only(ray_cluster):
    assert ray_cluster.dashboard_url.startswith("http://127.0.0.1:")
    import psutil

    listeners = {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == ray_cluster.dashboard_port
    }
    assert listeners == {"127.0.0.1"}


def test_token_auth_is_on_and_the_token_stays_private(ray_cluster):
    url = f"{ray_cluster.dashboard_url}/api/jobs/"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, timeout=10, headers={"Authorization": "Bearer not-the-token"}).status_code in (401, 403)
    token = Path(ray_cluster.token_path).read_text().strip()
    assert requests.get(url, timeout=10, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert stat.S_IMODE(os.stat(ray_cluster.token_path).st_mode) == 0o600
    # Neither the CLI nor the client's repr show it.
    for args in (["cluster", "status"], ["cluster", "status", "--json"], ["cluster", "up"]):
        out = subprocess.run([PYLON, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert token not in out.stdout + out.stderr
    assert token not in repr(pylon.connect())


def test_up_again_reuses_the_running_cluster(ray_cluster, pylon_home):
    again, started = cluster.up(home=pylon_home)
    assert not started and again.dashboard_url == ray_cluster.dashboard_url


def test_status_json_for_scripts(ray_cluster):
    out = subprocess.run([PYLON, "cluster", "status", "--json"], capture_output=True, text=True, timeout=120)
    data = json.loads(out.stdout)
    assert data["resources"]["CPU"] == 2
    assert data["nodes"][0]["state"] == "ALIVE"


def test_a_job_runs_ray_tasks_and_commits_to_s3(ray_cluster, s3_root, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def f(x):\n    return x if x else None\n")
    (src / "pkg" / "b.py").write_text("for i in range(3):\n    pass\n")
    (src / "pkg" / "site-packages").mkdir()
    (src / "pkg" / "site-packages" / "skip.py").write_text("import os\n")
    out = f"{s3_root}/stats.json"
    client = pylon.connect()
    job_id = client.submit_job(f"python -m pylon.jobs.corpus_stats --src {src} --out {out} --chunks 2")
    status = client.wait_job(job_id, timeout_s=300)
    logs = client.job_logs(job_id)
    assert status == "SUCCEEDED", logs
    bucket, key = out[len("s3://") :].split("/", 1)
    result = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    assert result["totals"]["files"] == 2
    assert result["totals"]["lines"] == 4
    assert dict(result["top_keywords"]) == {
        "def": 1,
        "return": 1,
        "if": 1,
        "else": 1,
        "None": 1,
        "for": 1,
        "in": 1,
        "pass": 1,
    }


def test_local_cluster_paces_rays_log_monitor_and_worker_output_still_reaches_the_job_log(ray_cluster):
    """`cluster.LOCAL_RAY_ENV` reaches Ray's processes, and with the log monitor rescanning its folder once a
    second (not ten times), a Ray task's print in a new worker still arrives in the job's log."""
    monitors = [p for p in ray_cluster.processes() if any("log_monitor" in a for a in p.cmdline())]
    assert len(monitors) == 1
    env = dict(
        line.split("=", 1)
        for line in Path(f"/proc/{monitors[0].pid}/environ").read_bytes().decode(errors="replace").split("\0")
        if "=" in line
    )
    for name, value in cluster.LOCAL_RAY_ENV.items():
        assert env.get(name) == value, name
    script = (
        "import ray; ray.init(); "
        "f = ray.remote(lambda: print('pylon-worker-said-hello', flush=True)); "
        "ray.get(f.options(num_cpus=0.01).remote()); import time; time.sleep(3)"
    )
    client = pylon.connect()
    job_id = client.submit_job(f'python -c "{script}"')
    status = client.wait_job(job_id, timeout_s=180)
    logs = client.job_logs(job_id)
    assert status == "SUCCEEDED", logs
    assert "pylon-worker-said-hello" in logs


def test_status_lists_running_jobs_and_stop_works(ray_cluster):
    client = pylon.connect()
    job_id = client.submit_job("python -c 'import time; time.sleep(120)'")
    deadline = time.monotonic() + 60
    while client.job_status(job_id) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    status = client.status()
    assert job_id in [j.job_id for j in status.running_jobs]
    out = subprocess.run([PYLON, "cluster", "status"], capture_output=True, text=True, timeout=120)
    assert "running jobs: 1" in out.stdout and job_id in out.stdout
    client.stop_job(job_id)
    assert client.wait_job(job_id, timeout_s=60) == "STOPPED"


def test_jobs_use_the_interpreter_pylon_is_installed_in(ray_cluster):
    client = pylon.connect()
    job_id = client.submit_job("python -c 'import sys, platform, pylon; print(sys.executable, platform.system())'")
    assert client.wait_job(job_id, timeout_s=120) == "SUCCEEDED"
    # The job's own line, wherever it lands: Ray may log around it ("Running entrypoint ..." comes after the
    # job's output in some runs), so the last line is not necessarily ours.
    logs = client.job_logs(job_id)
    ours = [
        line.split()
        for line in logs.splitlines()
        if len(line.split()) == 2 and Path(line.split()[0]).name.startswith("python")
    ]
    assert ours, f"no 'EXECUTABLE SYSTEM' line in the job's logs:\n{logs}"
    exe, system = ours[-1]
    assert Path(exe).parent == Path(sys.executable).parent
    assert system == "Linux"


def test_connect_resolution(ray_cluster, monkeypatch, tmp_path):
    assert pylon.connect().dashboard_url == ray_cluster.dashboard_url
    assert pylon.connect(ray_cluster.dashboard_url).gcs_address == ray_cluster.gcs_address
    assert pylon.connect(ray_cluster.gcs_address).dashboard_url == ray_cluster.dashboard_url
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.dashboard_url)
    assert pylon.connect().dashboard_url == ray_cluster.dashboard_url


def test_connect_without_a_cluster_says_how_to_start_one(monkeypatch, tmp_path):
    monkeypatch.setenv("PYLON_HOME", str(tmp_path / "empty-home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ClusterError, match="pylon cluster up"):
        pylon.connect()
    with pytest.raises(ClusterError, match=r"no Ray cluster answers at http://127\.0\.0\.1:9"):
        pylon.connect("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(ClusterError, match="Ray Client addresses are not supported"):
        pylon.connect("ray://127.0.0.1:10001")
    out = subprocess.run(
        [PYLON, "cluster", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYLON_HOME": str(tmp_path / "empty-home")},
    )
    assert out.returncode == 1 and "pylon cluster up" in out.stderr and "Traceback" not in out.stderr


def test_connect_with_a_wrong_token_is_refused_clearly(ray_cluster, monkeypatch, tmp_path):
    bad = tmp_path / "bad_token"
    bad.write_text("0" * 64)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(bad))
    with pytest.raises(ClusterError, match="token"):
        pylon.connect(f"http://localhost:{ray_cluster.dashboard_port}")
