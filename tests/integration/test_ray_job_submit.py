"""docs/ray-job-submit.md's command block, run as a user would paste it: data preparation and training as
`ray job submit --working-dir <project>` jobs on the session's local cluster, with Ray's own CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
DOC = Path(__file__).resolve().parents[2] / "docs" / "ray-job-submit.md"
DOC_ADDRESS = "http://127.0.0.1:8265"


def _block() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/ray-job-submit.md should hold exactly one bash block (the tested one)"
    return blocks[0]


@pytest.mark.slow  # make test-all: ~6 min; make test submits the same entrypoint through the same Jobs API (test_jobs_cli)
def test_the_documented_ray_job_submit_commands_work_verbatim(ray_cluster, tmp_path):
    script = _block()
    assert f"ray job submit --address {DOC_ADDRESS} --working-dir my-project" in script
    assert "python -m pylon.jobs.train --config train.yaml" in script
    # The only change: the session's cluster has its dashboard where a free port was (8265 if it was free).
    script = script.replace(DOC_ADDRESS, ray_cluster.dashboard_url)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)  # the block sets it from PYLON_HOME, as it tells users to
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the activated venv
    assert Path(env["PYLON_HOME"], "auth_token").resolve() == Path(ray_cluster.token_path).resolve()
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert out.count("succeeded") >= 2, out[-3000:]  # Ray's "Job '...' succeeded" for both jobs
    assert "Traceback" not in out

    manifest = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    assert manifest["seq_len"] == 128
    run = tmp_path / "runs" / "my-gpt"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))
    assert (run / "loss.png").is_file() and (run / "export" / "config.json").is_file()
    assert "metrics.jsonl" in done.stdout and "ledger.json" in done.stdout  # the `ls`
    assert re.search(r"^goodput \d+\.\d% of \d+ s:$", done.stdout, flags=re.M), done.stdout[-3000:]  # pylon cost

    # "Submitting the same name again resumes the run": raise steps and submit the same command again.
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = tmp_path / "my-project" / "train.yaml"
    config.write_text(config.read_text().replace("steps: 10", "steps: 14"))
    again = re.search(
        r"^ray job submit [^\n]*--working-dir my-project -- \\\n\s*python -m pylon.jobs.train[^\n]*$",
        script,
        flags=re.M,
    )
    assert again, "the training command is not in the block"
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", exports + "\n" + again.group(0)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "resumed my-gpt from step 10" in out, out[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert records[:10] == first  # the curve continues; nothing before the resume point was redone
    assert records[10]["tokens_seen"] == first[-1]["tokens_seen"] + records[10]["tokens"]

    # The run's ledger over both submissions, as `pylon cost --json` prints it.
    cost = subprocess.run(
        [sys.executable, "-m", "pylon", "cost", str(run), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cost.returncode == 0, cost.stderr
    ledger = json.loads(cost.stdout)
    assert (ledger["sessions"], ledger["attempts"], ledger["failures"]) == (2, 2, 0)
    assert ledger["cpu_hours"] > 0 and ledger["accelerator_hours"] == 0
    moved = ledger["bytes"]
    assert moved["data"]["read"] > 0 and moved["checkpoints"]["written"] > 0 and moved["checkpoints"]["read"] > 0
    assert moved["export"]["read"] > 0 and moved["export"]["written"] > 0
    assert ledger["bytes_read"] == sum(m["read"] for m in moved.values())
    assert ledger["egress_bytes"] == 0  # data and run on a filesystem
    assert ledger["cost_usd"] > 0
    goodput = ledger["goodput"]
    parts = [k for k in goodput if k.endswith("_s") and k != "wall_s"]
    assert sum(goodput[k] for k in parts) == pytest.approx(goodput["wall_s"], rel=1e-9)
    assert 0 < goodput["fraction"] < 1 and goodput["productive_s"] > 0 and goodput["startup_s"] > 0
    assert goodput["export_s"] > 0 and goodput["checkpoint_stall_s"] > 0
    assert ledger["tokens"] == records[-1]["tokens_seen"]  # every step's tokens once, none redone
    assert ledger["checkpoints"]["saves"] == 3 and ledger["checkpoints"]["failures"] == 0  # steps 5, 10, 14
    predicted = ledger["predicted"]
    assert predicted["tokens"] == 14 * 2 * 4 * 128 and predicted["wall_s"] > 0 and predicted["cpu_hours"] > 0
