"""`pylon cluster join`: a second machine, here a second PYLON_HOME on this one, joins a head that `pylon cluster up`
started, with a copy of the head's token file; it shows in the head's `pylon cluster status` with its resources and
labels, and `pylon cluster down` from its own PYLON_HOME takes exactly that node out, the head staying up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pylon.errors import ClusterError
from pylon.infra import local as cluster

pytestmark = pytest.mark.integration


@pytest.fixture
def head_home(pylon_home, tmp_path, monkeypatch) -> Path:
    """The head's PYLON_HOME, this test's own, whatever the session's cluster is doing; stopped after."""
    home = tmp_path / "head"
    monkeypatch.setenv("PYLON_HOME", str(home))
    yield home
    cluster.down(home=home)


def _pylon(args: list[str], home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYLON_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "pylon.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def _nodes(head_home: Path) -> list[dict]:
    status = _pylon(["cluster", "status", "--json"], head_home, timeout=60)
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)["nodes"]


# ~45 s. `make test` joins machines with `pylon cluster join` in tests/integration/test_hosts.py (each on its own
# simulated host); this one also checks the refusals and that `down` on a joined node leaves the head alone, on one
# host. `make test-all`.
@pytest.mark.slow
def test_a_node_joins_with_a_token_file_shows_in_status_and_leaves_alone(head_home: Path, tmp_path: Path) -> None:
    info, started = cluster.up(num_cpus=1, object_store_memory=100 * 2**20, home=head_home)
    assert started
    token = Path(info.token_path).read_text().strip()
    copied = tmp_path / "head-token"  # what a user copies to the other machine
    shutil.copy(info.token_path, copied)
    node_home = tmp_path / "node"
    try:
        joined = _pylon(
            [
                "cluster",
                "join",
                info.gcs_address,
                "--token-file",
                str(copied),
                "--num-cpus",
                "1",
                "--object-store-gib",
                "0.1",
                "--labels",
                "pylon-test=yes",
            ],
            node_home,
        )
        assert joined.returncode == 0, joined.stderr + joined.stdout
        assert token not in joined.stdout + joined.stderr
        node = cluster.read_node(node_home)
        assert node is not None and node.is_running() and node.head_address == info.gcs_address
        assert f"node id:              {node.node_id}" in joined.stdout
        assert "pylon-test=yes" in joined.stdout and "leave with:           pylon cluster down" in joined.stdout
        # The token reached Ray as a 0600 file of the node's own home, never on a command line.
        assert (
            Path(node.token_path) == node_home / "auth_token" and (node_home / "auth_token").stat().st_mode & 0o77 == 0
        )
        assert all(token not in " ".join(p.cmdline()) for p in node.processes())

        alive = [n for n in _nodes(head_home) if n["state"] == "ALIVE"]
        assert len(alive) == 2 and sum(n["is_head"] for n in alive) == 1
        (worker,) = [n for n in alive if not n["is_head"]]
        assert worker["node_id"] == node.node_id
        assert worker["resources"]["CPU"] == 1 and worker["resources"]["object_store_memory"] < 2**30
        assert worker["labels"]["pylon-test"] == "yes"

        # One PYLON_HOME holds one head or one node; joining again returns the running node.
        with pytest.raises(ClusterError, match="holds a node that joined the cluster"):
            cluster.up(home=node_home)
        with pytest.raises(ClusterError, match="holds the head of a running cluster"):
            cluster.join(info.gcs_address, home=head_home)
        again, started_again = cluster.join(info.gcs_address, home=node_home)
        assert not started_again and again.node_id == node.node_id

        left = _pylon(["cluster", "down"], node_home, timeout=60)
        assert left.returncode == 0 and f"stopped the Ray node {node.node_id}" in left.stdout, left.stdout
        assert node.processes() == [] and cluster.read_node(node_home) is None

        # The head stays, alone: the node said it was leaving (its raylet went first), so it is DEAD at once.
        deadline = time.monotonic() + 20
        while True:
            nodes = _nodes(head_home)
            if [n["is_head"] for n in nodes if n["state"] == "ALIVE"] == [True] or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert [n["is_head"] for n in nodes if n["state"] == "ALIVE"] == [True], nodes
        assert all(n["state"] == "DEAD" for n in nodes if n["node_id"] == node.node_id)
        assert cluster.read_state(head_home).is_running()
    finally:
        cluster.down(home=node_home)
