"""`pylon demo` end to end on the session's cluster (what `make demo` runs after set-up)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_demo_runs_a_real_job_and_commits_its_result(ray_cluster, pylon_home):
    out = subprocess.run([str(Path(sys.executable).parent / "pylon"), "demo"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "local Ray cluster reused" in out.stdout
    assert "SUCCEEDED" in out.stdout
    result = json.loads((pylon_home / "demo" / "corpus-stats.json").read_text())
    assert result["totals"]["files"] > 100 and result["totals"]["bytes"] > 1_000_000
    assert dict(result["top_keywords"])["def"] > 1000
    # It reused the session's cluster, so it must have left it running.
    assert "cluster still running" in out.stdout
