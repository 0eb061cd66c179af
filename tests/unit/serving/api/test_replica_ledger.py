"""A replica's ledger: busy time is the union of its finished requests' intervals; the report sums replicas."""

from __future__ import annotations

import pytest

from pylon.serving.api import ledger as ledger_module
from pylon.serving.api.ledger import ReplicaLedger, report

SPEC = {"name": "ledger-unit", "model": "/models/x", "replica": {"num_cpus": 2, "num_gpus": 0}}


class _Clock:
    """The ledger's clock, held still: replica time is what the test says, however slow the machine."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_request_intervals_and_the_report_prices_it(tmp_path, monkeypatch) -> None:
    clock = _Clock(1_000.0)
    monkeypatch.setattr(ledger_module, "time", clock)
    ledger = ReplicaLedger(SPEC)
    ledger.finished(10, 4, 100.0, 102.0)
    ledger.finished(10, 4, 101.0, 103.0)  # overlaps the first: 1 s more
    ledger.finished(10, 0, 104.0, None)  # no token: counts tokens, not time
    ledger.finished(10, 8, 105.0, 106.5)
    assert ledger.record["busy_s"] == pytest.approx(3.0 + 1.5)
    assert (ledger.record["requests"], ledger.record["prompt_tokens"], ledger.record["output_tokens"]) == (4, 40, 16)
    clock.now += 45.0  # 45 s of replica time
    ledger.write(ended=True)
    r = report("ledger-unit", now=ledger.record["ended_at"])
    assert r["replica_hours"] == pytest.approx(45.0 / 3600, rel=1e-3)
    assert r["cpu_hours"] == pytest.approx(2 * r["replica_hours"])
    assert r["idle_fraction"] == pytest.approx(1 - 4.5 / 45.0, rel=1e-3)
    assert r["output_tokens_per_s"] == pytest.approx(16 / 4.5)
    assert r["cost_per_million_output_tokens_usd"] == pytest.approx(r["cost_usd"] / 16 * 1e6)


def test_the_report_splits_the_cost_between_the_base_model_and_its_adapters_by_their_tokens(
    tmp_path, monkeypatch
) -> None:
    """Two replicas, each counting requests by the model they named (the base model or a LoRA adapter); one record
    from before the count by model (its requests the base model's). The report sums them per model across replicas
    and gives each its share of the tokens and of the cost; `pylon cost` prints it."""
    from pylon.cli.cost import render

    clock = _Clock(1_000.0)
    monkeypatch.setattr(ledger_module, "time", clock)
    spec = {**SPEC, "name": "ledger-models"}
    first, second = ReplicaLedger(spec), ReplicaLedger(spec)
    first.finished(30, 10, 100.0, 101.0)  # the base model
    first.finished(20, 20, 100.0, 101.0, "shout")
    second.finished(40, 20, 100.0, 101.0, "shout")
    second.finished(10, 10, 100.0, 101.0, "hush")
    old = ReplicaLedger(spec)
    old.finished(25, 15, 100.0, 101.0)
    del old.record["by_model"]
    clock.now += 60.0
    for ledger in (first, second, old):
        ledger.write(ended=True)
    r = report("ledger-models", now=clock.now)
    rows = {row["model"]: row for row in r["by_model"]}
    assert [row["model"] for row in r["by_model"]] == ["shout", "ledger-models", "hush"]  # costliest first
    assert (rows["ledger-models"]["requests"], rows["ledger-models"]["tokens_in"]) == (2, 55)
    assert (rows["shout"]["requests"], rows["shout"]["tokens_in"], rows["shout"]["tokens_out"]) == (2, 60, 40)
    assert rows["shout"]["token_share"] == pytest.approx(100 / 200)
    assert rows["hush"]["cost_usd"] == pytest.approx(r["cost_usd"] * 20 / 200)
    assert sum(row["cost_usd"] for row in r["by_model"]) == pytest.approx(r["cost_usd"])
    text = render(r)
    assert "by model (cost split by the share of tokens in + out)" in text
    assert "shout          2 requests, 60 / 40 tokens, 50%" in text


def test_prefill_replicas_count_in_the_hours_and_cost_and_their_prompts_apart(tmp_path, monkeypatch) -> None:
    """A deployment with `prefill`: its prefill replica's record (role prefill, the resources of prefill.replica)
    adds its hours and cost to the deployment's, its prompts apart; the requests, tokens, busy time and idle fraction
    are the decoding replica's; `pylon cost` says so."""
    from pylon.cli.cost import render

    clock = _Clock(1_000.0)
    monkeypatch.setattr(ledger_module, "time", clock)
    spec = {**SPEC, "name": "ledger-pd", "prefill": {"replicas": 1, "replica": {"num_cpus": 6, "num_gpus": 0}}}
    decoding, prefilling = ReplicaLedger(spec), ReplicaLedger(spec, role="prefill")
    alone = ReplicaLedger({**SPEC, "name": "ledger-alone"})
    for ledger in (decoding, alone):
        ledger.finished(500, 20, 100.0, 110.0)
    prefilling.finished(500, 0, 100.0, 101.0)
    clock.now += 100.0
    for ledger in (decoding, prefilling, alone):
        ledger.write(ended=True)
    r, a = report("ledger-pd", now=clock.now), report("ledger-alone", now=clock.now)
    assert (r["replicas"], r["requests"], r["tokens_in"], r["tokens_out"]) == (1, 1, 500, 20)
    assert r["replica_hours"] == pytest.approx(100 / 3600) and r["idle_fraction"] == pytest.approx(0.9)
    assert r["cpu_hours"] == pytest.approx((2 + 6) * 100 / 3600)  # both replicas' CPUs
    assert r["cost_usd"] == pytest.approx(4 * a["cost_usd"])  # 8 CPUs' hours against 2
    assert r["prefill"] == {
        "replicas": 1,
        "replica_hours": pytest.approx(100 / 3600),
        "prompts": 1,
        "prompt_tokens": 500,
        "idle_fraction": pytest.approx(0.99),
    }
    assert "prefill" not in a
    assert "  prefill          1 replica(s)" in render(r) and "1 prompts of 500 tokens, idle 99%" in render(r)
