"""`pylon cluster up && status && down`, twice, beside the session's cluster: down stops only its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
PYLON = str(Path(sys.executable).parent / "pylon")


def _ray_processes_of(temp_dir: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(temp_dir in a for a in p.info["cmdline"] or []):
                found.append(" ".join(p.info["cmdline"])[:120])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


# `make test-all`: ~85 s for two full starts, and `make test` already runs `pylon cluster up` / `down` from the CLI
# on a simulated host (test_hosts.py) and on the session's cluster; this adds the second round's clean slate.
@pytest.mark.slow
def test_up_status_down_twice_leaves_nothing_behind(ray_cluster, tmp_path):
    import pylon

    env = {**os.environ, "PYLON_HOME": str(tmp_path / "home")}
    for round_ in (1, 2):
        up = subprocess.run(
            [PYLON, "cluster", "up", "--num-cpus", "1", "--object-store-gib", "0.25"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stderr
        assert "started local Ray cluster" in up.stdout
        assert "dashboard / Jobs API: http://127.0.0.1:" in up.stdout
        dashboard = up.stdout.split("dashboard / Jobs API: ")[1].split()[0]
        assert dashboard != ray_cluster.dashboard_url

        from pylon.infra.local import read_state

        state = read_state(Path(env["PYLON_HOME"]))
        assert _ray_processes_of(state.temp_dir), "up started no processes that carry its temp dir"

        status = subprocess.run([PYLON, "cluster", "status"], env=env, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert dashboard in status.stdout and "nodes: 1 alive" in status.stdout and "CPU 1" in status.stdout

        down = subprocess.run([PYLON, "cluster", "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert "stopped the local Ray cluster" in down.stdout
        assert _ray_processes_of(state.temp_dir) == [], f"round {round_}: processes left behind"
        assert not (Path(env["PYLON_HOME"]) / "cluster.json").exists()

        # The session's own cluster is untouched.
        assert pylon.connect(ray_cluster.dashboard_url).status().nodes[0].state == "ALIVE"

    again = subprocess.run([PYLON, "cluster", "down"], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


def test_a_failed_start_is_reported_and_leaves_no_record(tmp_path):
    from pylon.errors import ClusterError
    from pylon.infra import local as cluster

    home = tmp_path / "home"
    # Ray's GCS starts before the raylet rejects the CPU count: that half-started cluster must go too.
    with pytest.raises(ClusterError, match=r"(?s)ray start --head` failed \(exit 1\).*CPU.*full log: "):
        cluster.up(num_cpus=-3, home=home)
    assert cluster.read_state(home) is None
    temp_dir = str(cluster.ray_temp_dir(home))
    assert _ray_processes_of(temp_dir) == []
    assert (home / "ray-start.log").exists()


@pytest.mark.slow  # make test-all: ~0.5 min
def test_a_start_that_times_out_in_ray_is_tried_once_more(tmp_path, monkeypatch, capsys):
    """Ray's `ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded machine it can miss
    that. The first `ray start` here is a script that fails the way Ray does; the second is the real one."""
    from pylon.infra import local as cluster

    real = cluster._ray_executable()
    marker = tmp_path / "failed-once"
    script = tmp_path / "ray"
    script.write_text(
        f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; "
        f"echo 'Exception: {cluster.RAY_STARTUP_TIMEOUT}. This could happen because ...'; exit 1; fi\n"
        f'exec {real} "$@"\n'
    )
    script.chmod(0o755)
    monkeypatch.setattr(cluster, "_ray_executable", lambda: str(script))
    home = tmp_path / "home"
    try:
        info, started = cluster.up(num_cpus=1, home=home)
        assert started and marker.exists()
        assert "timed out during start-up" in capsys.readouterr().err
        assert cluster.read_state(home) is not None
    finally:
        cluster.down(home=home)
    assert _ray_processes_of(str(cluster.ray_temp_dir(home))) == []
