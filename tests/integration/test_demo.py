"""`pylon demo` end to end on the session's cluster (what `make demo` runs after set-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pylon.data.shards import read_manifest

pytestmark = pytest.mark.integration


@pytest.fixture
def demo_deployment(ray_cluster):
    yield "stdlib-gpt"
    from pylon.sdk.serve import delete

    delete("stdlib-gpt")  # it holds route "/", which the serving tests use next


@pytest.mark.slow  # the whole demo again (what `make demo` runs); `make test-all`
def test_demo_prepares_trains_exports_and_serves(ray_cluster, pylon_home, demo_deployment):
    out = subprocess.run(
        [str(Path(sys.executable).parent / "pylon"), "demo", "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "local Ray cluster reused" in out.stdout
    manifest = read_manifest(str(pylon_home / "demo" / "corpus"))
    assert manifest.totals.documents > 500 and manifest.totals.tokens > 5_000_000
    assert not any("site-packages" in s for s in manifest.sources)
    assert f"[4/7] streamed {manifest.totals.rows:,} sequences ({manifest.totals.tokens:,} tokens" in out.stdout
    assert "decoded:" in out.stdout
    # Training on the corpus: 2 workers, ZeRO-2 + CPU offload, exported; data never starves the steps.
    from pylon.jobs.run_dir import read_metrics

    run = pylon_home / "demo" / "runs" / "stdlib-gpt"
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"]
    steady = [r["data_wait_fraction"] for r in records[1:]]
    assert sum(steady) / len(steady) < 0.05, steady
    assert (run / "loss.png").exists() and (run / "export" / "model.safetensors").exists()
    assert "waiting for data:" in out.stdout and "loss curve:" in out.stdout
    # Served: a streamed completion and a burst over HTTP with the demo's API key, which is never printed.
    key = (pylon_home / "demo" / "api_key").read_text().strip()
    assert key not in out.stdout + out.stderr
    assert (pylon_home / "demo" / "api_key").stat().st_mode & 0o777 == 0o600
    assert "[6/7] deploying on Ray Serve" in out.stdout and "streamed completion of 'def fibonacci('" in out.stdout
    assert "[7/7] burst of 32 concurrent requests:" in out.stdout and "output tokens/s" in out.stdout, out.stdout
    url = next(line.split(" at ")[1].split()[0] for line in out.stdout.splitlines() if "ready in" in line)
    import requests

    r = requests.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": "stdlib-gpt", "prompt": "import ", "max_tokens": 8},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8  # the endpoint stays up
    assert "cluster still running" in out.stdout
