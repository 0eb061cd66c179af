"""Autoscaling on a latency target through a running Serve controller (pylon.serving.api.slo): the replicas' times
reach the controller as Serve's custom autoscaling metrics, and the deployment's policy adds a replica on them alone.
The policy's decisions one by one: tests/unit/serving/api/test_slo.py."""

from __future__ import annotations

import time

import pytest
import requests
from serving_models import greedy_text, tiny_llama

pytestmark = pytest.mark.integration


def _replicas(name: str) -> int:
    """The deployment's replicas running (Serve's REST API, as `pylon serve status` reads it)."""
    from pylon.sdk.serve import serve_details

    app = serve_details()["applications"].get(name) or {}
    replicas = app.get("deployments", {}).get(name, {}).get("replicas", [])
    return sum(1 for r in replicas if r["state"] == "RUNNING")


@pytest.mark.slow
def test_a_replica_is_added_when_the_time_to_first_token_is_over_its_target_and_not_for_the_request_count(
    ray_cluster, tmp_path
):
    """One client, one request at a time: never more than one request at the replica, far under
    target_ongoing_requests (1,000), so Serve's own policy keeps one replica. The time to first token's target
    (1 microsecond) cannot be met, so the latency policy asks for a second; once the requests stop and their times
    leave the window, the request counts let it go again."""
    from pylon.sdk.serve import delete, deploy
    from pylon.specs import DeploymentSpec

    model = tiny_llama(tmp_path / "llama")
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "slo",
            "model": str(tmp_path / "llama"),
            "engine": {"max_num_seqs": 4, "kv_cache_tokens": 2048, "max_model_len": 256, "device": "cpu"},
            "http": {"api_keys_env": None, "route_prefix": "/slo"},
            "replica": {"num_cpus": 0.5},
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 1000,
                "target_ttft_ms": 0.001,
                "upscale_delay_s": 0,
                "downscale_delay_s": 5,
            },
        }
    )
    url = deploy(spec)
    try:
        assert _replicas("slo") == 1
        answers, deadline, most = [], time.monotonic() + 150, 1
        while time.monotonic() < deadline and most < 2:
            prompt = f"request {len(answers)}"
            body = {"model": "slo", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append((prompt, r.json()["choices"][0]["text"]))
            most = max(most, _replicas("slo"))
            time.sleep(0.2)
        assert most == 2, f"one replica still after {len(answers)} requests over their time-to-first-token target"
        prompt, text = answers[0]
        assert text == greedy_text(model, prompt, 2)
        deadline = time.monotonic() + 180
        while _replicas("slo") > 1:
            assert time.monotonic() < deadline, "the second replica stayed once the requests stopped"
            time.sleep(2)
    finally:
        delete("slo")
