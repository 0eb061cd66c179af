"""`pylon demo` end to end on the session's cluster (what `make demo` runs after set-up)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pylon.data.shards import read_manifest

pytestmark = pytest.mark.integration


def test_demo_prepares_the_stdlib_as_a_job_and_streams_it_back(ray_cluster, pylon_home):
    out = subprocess.run([str(Path(sys.executable).parent / "pylon"), "demo"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "local Ray cluster reused" in out.stdout
    manifest = read_manifest(str(pylon_home / "demo" / "corpus"))
    assert manifest.totals.documents > 500 and manifest.totals.tokens > 5_000_000
    assert not any("site-packages" in s for s in manifest.sources)
    assert f"[4/4] streamed {manifest.totals.rows:,} sequences ({manifest.totals.tokens:,} tokens" in out.stdout
    assert "decoded:" in out.stdout
    # It reused the session's cluster, so it must have left it running.
    assert "cluster still running" in out.stdout
