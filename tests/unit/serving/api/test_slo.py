"""Autoscaling on latency targets (pylon.serving.api.slo): a replica's window of its requests' times, the policy the
Serve controller runs on them (on Serve's own AutoscalingContext and through Serve's own deserialization of the
deployment's policy), the specs that ask for it, and a replica's stats after real requests. Through a running Serve
controller: tests/integration/test_serving_slo.py."""

from __future__ import annotations

import json

import pytest
import requests
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from test_serving_http import auth, model_dir, serving  # noqa: F401 (fixtures)

from pylon.errors import SpecError
from pylon.serving.api import slo
from pylon.serving.api.builder import autoscaling_config, build_app, prefill_deployment
from pylon.specs import DeploymentSpec, parse_specs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_reports_each_times_90th_percentile_over_its_last_30_seconds() -> None:
    clock = Clock()
    window = slo.LatencyWindow(window_s=30, clock=clock)
    assert window.stats() == {slo.SAMPLES: 0.0}
    window.add(0.5, None)
    window.add(0.7, 0.02)
    assert window.stats() == {slo.SAMPLES: 2.0}  # too few to say anything yet
    for i in range(8):
        window.add(0.1 * (i + 1), 0.01 * (i + 1))
    stats = window.stats()
    # ten first-token times: 0.1..0.8, 0.5 and 0.7; the 9th of them in order is the 90th percentile
    assert stats[slo.TTFT] == pytest.approx(0.7) and stats[slo.SAMPLES] == 10
    assert stats[slo.ITL] == pytest.approx(0.08)  # nine ITLs (one request had a single token): 9th of 9
    clock.now += 20
    window.add(2.0, 0.5)
    window.add(2.0, 0.5)
    clock.now += 15  # the first ten are now 35 s old: gone
    stats = window.stats()
    assert stats == {slo.SAMPLES: 2.0}
    window.add(3.0, None)
    assert window.stats()[slo.TTFT] == 3.0 and slo.ITL not in window.stats()


def _context(current: int, requests_total: float, metrics: dict, *, target_ongoing: float = 16) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target_ongoing)
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="m",
        app_name="m",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[f"r{i}" for i in range(current)],
        total_num_requests=requests_total,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )


def _ttft(**per_replica: tuple[float, float]) -> dict:
    return {
        slo.TTFT: {r: v for r, (v, _) in per_replica.items()},
        slo.SAMPLES: {r: n for r, (_, n) in per_replica.items()},
    }


def test_the_policy_scales_in_proportion_to_the_time_over_its_target_and_lets_one_go_well_under_it() -> None:
    policy = slo.LatencyPolicy(target_ttft_s=0.35)
    # two replicas: 1.0 s over 10 requests, 0.6 s over 30: 0.7 s for the deployment, twice the target
    wanted, state = policy(_context(2, 1, _ttft(r0=(1.0, 10), r1=(0.6, 30))))
    assert wanted == pytest.approx(4) and state["pylon_reason"] == "latency"
    assert state["pylon_latency_ratio"] == pytest.approx(2)
    # under half the target: one fewer (the request counts would let it go to one at once)
    wanted, state = policy(_context(3, 1, _ttft(r0=(0.1, 10))))
    assert wanted == 2
    # between half and the whole: as many as now
    assert policy(_context(3, 1, _ttft(r0=(0.3, 10))))[0] == 3
    # nothing finished lately: the request counts decide alone (one request on 3 replicas aiming at 16 each)
    wanted, state = policy(_context(3, 1, {slo.SAMPLES: {"r0": 0.0}}))
    assert wanted == pytest.approx(3 * 1 / 48) and state["pylon_reason"] == "requests"
    # and are a floor throughout: 100 requests at replicas aiming at 16 each want 6.25 whatever the latency
    wanted, state = policy(_context(2, 100, _ttft(r0=(0.1, 10))))
    assert wanted == pytest.approx(100 / 16) and state["pylon_reason"] == "requests"


def test_the_worst_of_two_targets_decides_and_a_cold_deployment_starts_as_serves_own() -> None:
    policy = slo.LatencyPolicy(target_ttft_s=1.0, target_itl_s=0.05)
    metrics = {**_ttft(r0=(0.3, 10)), slo.ITL: {"r0": 0.15}}  # first tokens well in time, the rest 3x too slow
    wanted, state = policy(_context(2, 1, metrics))
    assert wanted == pytest.approx(6) and state["pylon_latency_ratio"] == pytest.approx(3)
    # both well under: one fewer
    assert policy(_context(2, 1, {**_ttft(r0=(0.3, 10)), slo.ITL: {"r0": 0.02}}))[0] == 1
    # no replica yet and a request waiting: one (Serve's cold start), whatever the stats say
    assert policy(_context(0, 1, {}))[0] == 1
    with pytest.raises(ValueError, match="target_ttft_s or target_itl_s"):
        slo.LatencyPolicy()


def _spec(**fields) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "m", "model": "s3://b/m", **fields})


def test_a_deployment_with_targets_gets_the_policy_serve_deserializes_and_runs() -> None:
    spec = _spec(autoscaling={"min_replicas": 1, "max_replicas": 4, "target_ttft_ms": 500, "target_itl_ms": 40})
    config = build_app(spec, api_keys=None)._bound_deployment._deployment_config.autoscaling_config
    assert config.policy.policy_function == "pylon.serving.api.slo:LatencyPolicy"
    assert config.policy.policy_kwargs == {"target_ttft_s": 0.5, "target_itl_s": 0.04}
    # what the controller does with it (ray.serve._private.autoscaling_state._resolve_policy_callable)
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)
    assert policy(_context(1, 1, _ttft(r0=(1.5, 10))))[0] == pytest.approx(3)
    # without targets: Serve's own policy, as before
    assert "policy" not in autoscaling_config(_spec(autoscaling={"max_replicas": 2}).autoscaling)
    assert (
        build_app(_spec(), api_keys=None)._bound_deployment._deployment_config.autoscaling_config.policy.policy_function
        != slo.POLICY
    )
    # prefill replicas on their share of the time to first token
    prefill = _spec(prefill={"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ttft_ms": 200}})
    pconfig = prefill_deployment(prefill)._bound_deployment._deployment_config.autoscaling_config
    assert pconfig.policy.policy_kwargs == {"target_ttft_s": 0.2, "target_itl_s": None}


@pytest.mark.parametrize(
    "fields,where",
    [
        ({"autoscaling": {"target_ttft_ms": 500}}, "autoscaling.max_replicas"),  # 1 to 1: nothing to scale
        ({"autoscaling": {"max_replicas": 2, "target_itl_ms": 0}}, "autoscaling.target_itl_ms"),
        (
            {"prefill": {"autoscaling": {"max_replicas": 2, "target_itl_ms": 50}}},
            "prefill.autoscaling.target_itl_ms",
        ),
        (
            {"autoscaling": {"max_replicas": 2, "target_ttft_ms": 500}, "prefill": {}},
            "autoscaling.target_ttft_ms",
        ),
    ],
)
def test_targets_that_cannot_work_are_refused_naming_the_field(fields, where) -> None:
    text = json.dumps({"kind": "Deployment", "name": "m", "model": "s3://b/m", **fields})  # (JSON is YAML)
    with pytest.raises(SpecError) as info:
        parse_specs(text, "svc.yaml")
    assert len(info.value.problems) == 1 and where in info.value.problems[0], info.value.problems


def test_a_replica_reports_its_requests_times_as_serves_autoscaling_stats(model_dir) -> None:  # noqa: F811
    with serving(model_dir, max_num_seqs=2, max_model_len=256, separate_process=False) as (url, replica):
        assert replica.record_autoscaling_stats() == {slo.SAMPLES: 0.0}
        for prompt in ("a", "bc", "def"):
            r = requests.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
                headers=auth(),
                timeout=60,
            )
            assert r.status_code == 200, r.text
        stats = replica.record_autoscaling_stats()
        assert stats[slo.SAMPLES] == 3
        assert 0 < stats[slo.TTFT] < 60 and 0 < stats[slo.ITL] < 60
        # what Serve takes: a dict of numbers (ray.serve._private.replica checks it once)
        assert all(isinstance(v, float) for v in stats.values())


def test_the_window_keeps_its_last_samples_only_however_many_requests_end() -> None:
    clock = Clock()
    window = slo.LatencyWindow(window_s=30, clock=clock)
    for i in range(slo.LatencyWindow.MAX_SAMPLES + 500):
        window.add(1.0 if i < 500 else 0.2, 0.01)
    stats = window.stats()
    # the 500 oldest (1 s) fell out: only the 0.2 s ones are left
    assert stats[slo.SAMPLES] == slo.LatencyWindow.MAX_SAMPLES and stats[slo.TTFT] == 0.2
