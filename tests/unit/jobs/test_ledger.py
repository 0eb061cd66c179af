"""The run ledger's arithmetic: a session whose first attempt failed after a save and whose second resumed from it.
Every part of the wall time is accounted for once; the failed attempt's work after the save counts as failure."""

from __future__ import annotations

import json
import math

import pytest

from pylon import storage
from pylon.jobs import ledger
from pylon.specs import TrainJobSpec

SPEC = {
    "kind": "TrainJob",
    "name": "ledger-run",
    "model": {"preset": "gpt-tiny"},
    "data": {"uri": "s3://bucket/corpus", "seq_len": 64},
    "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
    "steps": 10,
    "batch": {"micro_batch_size": 4},
}


def _attempt(**over) -> dict:
    base = {
        "format": 1,
        "session": "s1",
        "workers": 2,
        "resources_per_worker": {"CPU": 1},
        "accelerator": None,
        "flops_per_token": 1e6,
        "matmul_peak_flops": 1e10,
        "checkpoint_blocked": {"wait_previous_s": 0.5, "snapshot_s": 1.0, "upload_s": 0.0},
        "checkpoint_saves": 1,
        "checkpoint_failures": 0,
        "bytes": {"data": {"read": 1000, "written": 0}, "checkpoints": {"read": 0, "written": 5000}},
        "ended_at": None,
        "first_step": 1,
    }
    return {**base, **over}


@pytest.fixture
def run(tmp_path) -> str:
    uri = str(tmp_path / "ledger-run")
    storage.atomic_write_json(f"{uri}/run.json", {"spec": TrainJobSpec.model_validate(SPEC).model_dump(mode="json")})
    session = {
        "format": 1,
        "session": "s1",
        "started_at": 1000.0,
        "updated_at": 1100.0,
        "ended_at": 1100.0,
        "outcome": "succeeded",
        "workers": 2,
        "resources_per_worker": {"CPU": 1},
        "queued_s": 5.0,
        "export_s": 4.0,
        "bytes": {"export": {"read": 300, "written": 200}},
    }
    failed = _attempt(
        attempt="a1",
        started_at=1010.0,
        first_step_at=1030.0,
        updated_at=1060.0,
        resumed_from=0,
        last_step=8,
        tokens=800,
        productive_s=20.0,
        data_wait_s=2.0,
        checkpoint_stall_s=3.0,
        evaluation_s=0.0,
        saves={
            "4": {
                "productive_s": 10.0,
                "data_wait_s": 1.0,
                "checkpoint_stall_s": 2.0,
                "evaluation_s": 0.0,
                "tokens": 400,
            }
        },
    )
    resumed = _attempt(
        attempt="a2",
        started_at=1070.0,
        first_step_at=1080.0,
        updated_at=1095.0,
        ended_at=1095.0,
        resumed_from=4,
        last_step=10,
        tokens=600,
        productive_s=9.0,
        data_wait_s=1.0,
        checkpoint_stall_s=1.0,
        evaluation_s=1.0,
        saves={},
    )
    storage.atomic_write_json(f"{uri}/ledger/session-s1.json", session)
    storage.atomic_write_json(f"{uri}/ledger/attempt-s1-a1.json", failed)
    storage.atomic_write_json(f"{uri}/ledger/attempt-s1-a2.json", resumed)
    return uri


def test_the_parts_sum_to_the_wall_time_and_the_failure_is_the_work_redone(run) -> None:
    m = ledger.measure(run, now=2000.0)
    g = m["goodput"]
    assert g["wall_s"] == 100.0
    expected = {
        "queued_s": 5.0,
        "export_s": 4.0,
        "startup_s": 25.0,  # 1000 -> first step at 1030, less 5 s queued
        "restart_s": 20.0,  # last sign of the failed attempt at 1060 -> the next one's first step at 1080
        "failure_s": 12.0,  # the failed attempt's parts after its save at step 4: 10 + 1 + 1 + 0
        "productive_s": 19.0,  # 10 kept of the failed attempt + 9
        "data_wait_s": 2.0,
        "checkpoint_stall_s": 3.0,
        "evaluation_s": 1.0,
    }
    for part, seconds in expected.items():
        assert g[part] == pytest.approx(seconds), part
    assert g["idle_s"] == pytest.approx(9.0)
    assert sum(g[p] for p in ledger.PARTS) == pytest.approx(g["wall_s"])
    assert g["fraction"] == pytest.approx(0.19)
    assert (m["failures"], m["restarts"], m["attempts"], m["sessions"]) == (1, 1, 2, 1)
    assert m["tokens"] == 1000  # 400 kept + 600
    assert m["cpu_hours"] == pytest.approx((50 + 25) * 2 / 3600)
    assert m["accelerator_hours"] == 0.0
    assert m["bytes"]["data"]["read"] == 2000 and m["bytes"]["checkpoints"]["written"] == 10_000
    assert (m["bytes_read"], m["bytes_written"]) == (2300, 10_200)


def test_a_runs_sampling_servers_hours_are_the_jobs_too(run, tmp_path) -> None:
    """grpo.sampler server: the servers' resources count from their start to their stop, or, never stopped (the
    driver died), to the session's end; the workers' hours are unchanged."""
    before = ledger.measure(run, now=2000.0)
    recorder = ledger.SessionRecorder(str(tmp_path / "with-servers"), spec=SPEC, now=1000.0)
    recorder.servers_started(2, {"CPU": 0.5, "GPU": 1}, now=1010.0)
    recorder.servers_stopped(now=1082.0)
    session = json.loads(storage.read_bytes(recorder.uri))
    assert session["servers"] == {"count": 2, "resources": {"CPU": 0.5, "GPU": 1}, "started_at": 1010.0,
                                  "ended_at": 1082.0}  # fmt: skip
    stored = json.loads(storage.read_bytes(f"{run}/ledger/session-s1.json"))
    storage.atomic_write_json(f"{run}/ledger/session-s1.json", {**stored, "servers": session["servers"]})
    m = ledger.measure(run, now=2000.0)
    assert m["cpu_hours"] == pytest.approx(before["cpu_hours"] + 72 * 0.5 * 2 / 3600)
    assert m["accelerator_hours"] == pytest.approx(72 * 2 / 3600)
    assert m["goodput"] == before["goodput"]  # (the wall time's parts are the workers')
    never_stopped = {**session["servers"], "ended_at": None}
    storage.atomic_write_json(f"{run}/ledger/session-s1.json", {**stored, "servers": never_stopped})
    assert ledger.measure(run, now=2000.0)["accelerator_hours"] == pytest.approx((1100 - 1010) * 2 / 3600)


def test_the_report_prices_the_hours_and_the_egress_and_predicts_beside_them(run, tmp_path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("vCPU: 0.10\negress_GB: 1000\n")
    r = ledger.report(run, prices=str(prices), now=2000.0)
    assert r["egress_bytes"] == 2000  # the data on s3 was read; the run directory is local
    assert r["cost_breakdown_usd"]["cpu"] == pytest.approx(r["cpu_hours"] * 0.10)
    assert r["cost_breakdown_usd"]["egress"] == pytest.approx(2000 / 1e9 * 1000)
    assert r["cost_usd"] == pytest.approx(sum(r["cost_breakdown_usd"].values()))
    p = r["predicted"]
    assert p["tokens"] == 10 * 2 * 4 * 64  # steps x global batch x seq_len
    assert p["wall_s"] == pytest.approx(p["tokens"] * 1e6 / (1e10 * 2 * p["mfu"]))
    assert p["cpu_hours"] == pytest.approx(p["wall_s"] * 2 / 3600)
    assert p["peak_host_bytes"] > 0


def test_a_session_still_running_ends_now_and_a_dead_driver_at_its_last_word(run) -> None:
    session = storage.read_json(f"{run}/ledger/session-s1.json")
    session.update(ended_at=None, outcome="running")
    storage.atomic_write_json(f"{run}/ledger/session-s1.json", session)
    attempt = storage.read_json(f"{run}/ledger/attempt-s1-a2.json")
    attempt["ended_at"] = None
    storage.atomic_write_json(f"{run}/ledger/attempt-s1-a2.json", attempt)
    live = ledger.measure(run, now=1200.0)
    assert live["goodput"]["wall_s"] == 200.0  # still running: up to now
    # a later submission means the first driver died: its session ends at the last word of it or its workers
    storage.atomic_write_json(
        f"{run}/ledger/session-s2.json",
        {**session, "session": "s2", "started_at": 1500.0, "updated_at": 1500.0, "queued_s": 0.0, "export_s": 0.0},
    )
    both = ledger.measure(run, now=1510.0)
    assert both["sessions"] == 2
    assert both["goodput"]["wall_s"] == pytest.approx(100.0 + 10.0)
    assert sum(both["goodput"][p] for p in ledger.PARTS) == pytest.approx(both["goodput"]["wall_s"])


def test_pylon_cost_prints_the_ledger_and_its_json(run, capsys) -> None:
    from pylon.cli import main

    assert main(["cost", run, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("accelerator_hours", "cpu_hours", "bytes_read", "bytes_written", "cost_usd", "goodput", "predicted"):
        assert key in data, key
    assert 0 < data["goodput"]["fraction"] < 1
    assert main(["cost", run]) == 0
    text = capsys.readouterr().out
    assert "goodput 19.0% of 100 s" in text and "predicted" in text
    assert main(["cost", "no-such-thing"]) == 1
    assert "no ledger for a deployment named 'no-such-thing'" in capsys.readouterr().err


def test_prices_files_take_vcpu_and_egress_and_refuse_bad_values(tmp_path) -> None:
    from pylon.errors import PylonError
    from pylon.plan.catalog import load_catalog

    good = tmp_path / "p.yaml"
    good.write_text("H100-SXM: 2.0\nvcpu: 0.02\negress_gb: 0.01\n")
    c = load_catalog(str(good))
    assert (c.vcpu_price_per_hour, c.egress_price_per_gb, c.get("h100").price_per_gpu_hour) == (0.02, 0.01, 2.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("vCPU: -1\n")
    with pytest.raises(PylonError, match=r"vCPU: must be a non-negative number of US dollars per vCPU-hour"):
        load_catalog(str(bad))
    assert math.isclose(load_catalog().vcpu_price_per_hour, 0.0504)


def test_an_attempt_records_what_a_resume_keeps_before_the_checkpoint_exists(tmp_path) -> None:
    rec = ledger.AttemptRecorder(
        str(tmp_path / "run"), session="s", workers=1, resources_per_worker={"CPU": 1}, resumed_from=0
    )
    rec.step(1, step_s=2.0, wait_s=0.5, tokens=10, started_at=1.0)
    rec.saving(1)
    written = storage.read_json(rec.uri)  # on storage before the save could commit
    assert written["saves"]["1"] == {
        "productive_s": 1.5,
        "data_wait_s": 0.5,
        "checkpoint_stall_s": 0.0,
        "evaluation_s": 0.0,
        "tokens": 10,
    }
    rec.checkpoint(1, {"wait_previous_s": 0.0, "snapshot_s": 0.25, "upload_s": 0.0})
    assert rec.record["saves"]["1"]["checkpoint_stall_s"] == 0.25  # a resume from it keeps its save's time
    rec.step(2, step_s=1.0, wait_s=0.0, tokens=10, started_at=3.0)
    rec.saving(2)
    rec.checkpoint(2, {"failed_s": 0.5}, ok=False)
    assert "2" not in rec.record["saves"] and rec.record["checkpoint_failures"] == 1
