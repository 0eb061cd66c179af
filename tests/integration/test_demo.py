"""`pylon demo` end to end on the session's cluster (what `make demo` runs after set-up)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pylon.data.shards import read_manifest

pytestmark = pytest.mark.integration


def test_demo_prepares_the_stdlib_as_a_job_and_streams_it_back(ray_cluster, pylon_home):
    out = subprocess.run([str(Path(sys.executable).parent / "pylon"), "demo", "--steps", "12"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "local Ray cluster reused" in out.stdout
    manifest = read_manifest(str(pylon_home / "demo" / "corpus"))
    assert manifest.totals.documents > 500 and manifest.totals.tokens > 5_000_000
    assert not any("site-packages" in s for s in manifest.sources)
    assert f"[4/5] streamed {manifest.totals.rows:,} sequences ({manifest.totals.tokens:,} tokens" in out.stdout
    assert "decoded:" in out.stdout
    # Training on the corpus: 2 workers, ZeRO-2 + CPU offload, exported; data never starves the steps.
    from pylon.jobs.train import read_metrics

    run = pylon_home / "demo" / "runs" / "stdlib-gpt"
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"]
    steady = [r["data_wait_fraction"] for r in records[1:]]
    assert sum(steady) / len(steady) < 0.05, steady
    assert (run / "loss.png").exists() and (run / "export" / "model.safetensors").exists()
    assert "waiting for data:" in out.stdout and "loss curve:" in out.stdout
    # It reused the session's cluster, so it must have left it running.
    assert "cluster still running" in out.stdout
