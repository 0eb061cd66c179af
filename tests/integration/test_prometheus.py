"""A real Prometheus beside the session's cluster (`pylon cluster up --metrics`): it scrapes Ray's service discovery
file's targets, sees Pylon's serving metrics while a tiny model serves and its training metrics while a TrainJob
trains, and fires an alert; every metric the rendered Grafana dashboard reads is among what it scraped.

The alert: the test's rules are Pylon's own (`rules_text`) with a time-to-first-token SLO of 1 ms and no `for:`
hold, so PylonTimeToFirstTokenP99OverSLO fires as soon as Prometheus has two scrapes of TTFT histograms from
served requests (a CPU replica's first token takes more than 1 ms).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests
import yaml

pytestmark = pytest.mark.integration
PYLON = str(Path(sys.executable).parent / "pylon")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
EXAMPLES = Path(__file__).resolve().parents[2] / "platform" / "pylon" / "examples"


@pytest.fixture(scope="module")
def prom(ray_cluster, pylon_home, tmp_path_factory):
    """`pylon cluster up --metrics` on the session's (running) cluster: it starts only Prometheus."""
    from pylon.infra import prometheus
    from pylon.infra.observability import AlertThresholds, rules_text

    if shutil.which("prometheus") is None:
        pytest.skip(prometheus.INSTALL_HELP)
    rules = tmp_path_factory.mktemp("prom-rules") / "rules.yml"
    rules.write_text(rules_text(AlertThresholds(ttft_p99_slo_s=0.001, hold="0s")))
    env = {**os.environ, "PYLON_HOME": str(pylon_home)}
    up = subprocess.run(
        [PYLON, "cluster", "up", "--metrics", "--metrics-rules", str(rules)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 0, up.stderr
    assert "already running local Ray cluster" in up.stdout and "Prometheus:           http://127.0.0.1:" in up.stdout
    record = prometheus.read_record(pylon_home)
    assert record is not None and record.is_running()
    try:
        yield record
    finally:
        prometheus.stop(pylon_home)
        assert not record.is_running()


def _api(prom, path: str, **params) -> dict | list:
    r = requests.get(f"{prom.url}/api/v1/{path}", params=params, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def _tiny_model(directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=320, eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return directory


def _train_spec(tmp: Path, name: str) -> Path:
    from pylon.data.prepare import prepare

    src = tmp / "src"
    src.mkdir(parents=True)
    for file in ("argparse.py", "textwrap.py"):
        (src / file).write_bytes((STDLIB / file).read_bytes())
    corpus = str(tmp / "corpus")
    prepare([str(src)], corpus, seq_len=64, use_ray=False, progress=False)
    spec = {
        "kind": "TrainJob",
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 1, "use_gpu": False, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 1},
        "precision": "fp32",
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "steps": 20,
        "checkpoint": {"storage": str(tmp / "runs"), "every_steps": 10, "keep_last": 1},
    }
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow  # make test-all: ~2.5 min
def test_prometheus_scrapes_serving_and_training_and_fires_an_alert(prom, ray_cluster, tmp_path):
    import pylon
    from pylon.infra.observability import dashboard_metrics, grafana_dashboard
    from pylon.sdk.serve import delete, deploy
    from pylon.specs import ClusterSpec, DeploymentSpec, load_spec

    deadline, targets = time.monotonic() + 60, []
    while time.monotonic() < deadline and not any(t["health"] == "up" for t in targets):
        time.sleep(1)  # the service discovery file, read at start and as it changes; a first scrape
        targets = _api(prom, "targets")["activeTargets"]
    assert any(t["health"] == "up" for t in targets) and all(t["labels"]["job"] == "ray" for t in targets), targets

    # A real TrainJob (one worker, 1 CPU) trains while a replica (0.5 CPU) serves: the session's cluster has 2.
    t0 = time.monotonic()
    run = f"prom-train-{os.getpid()}"
    spec_path = _train_spec(tmp_path / "train", run)
    client = pylon.connect()
    job = client.submit_job(f"cd {spec_path.parent} && python -m pylon.jobs.train --config {spec_path.name}")
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "tiny-prom",
            "model": str(_tiny_model(tmp_path / "model")),
            "engine": {"max_num_seqs": 4, "kv_cache_tokens": 1024, "block_size": 16, "max_model_len": 128,
                       "device": "cpu"},
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "http": {"api_keys_env": None, "route_prefix": "/prom", "request_timeout_s": 60},
            "replica": {"num_cpus": 0.5},
            # prompts of 32+ tokens computed on prefill replicas (one, autoscaled up to two: routed by prefix)
            "prefill": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}, "min_prompt_tokens": 32,
                        "replica": {"num_cpus": 0.25}},
        }
    )  # fmt: skip
    url = deploy(spec)
    print(f"deployed: {time.monotonic() - t0:.0f}s", file=sys.stderr)
    firing: list[dict] = []
    try:
        # Requests until the alert fires: the TTFT histogram must grow between two scrapes for its rate.
        deadline = time.monotonic() + 120
        n = 0
        while time.monotonic() < deadline and not firing:
            n += 1  # every other prompt long enough for a prefill replica
            prompt = "abc" if n % 2 else f"{n:04d} " + "the quick brown fox jumps over the lazy dog " * 2
            r = requests.post(
                f"{url}/v1/completions", json={"model": "tiny-prom", "prompt": prompt, "max_tokens": 4}, timeout=60
            )
            assert r.status_code == 200, r.text
            firing = [
                a
                for a in _api(prom, "alerts")["alerts"]
                if a["state"] == "firing" and a["labels"]["alertname"] == "PylonTimeToFirstTokenP99OverSLO"
            ]
            time.sleep(1)
    finally:
        delete("tiny-prom")
    assert any(a["labels"].get("model") == "tiny-prom" for a in firing), firing
    groups = _api(prom, "rules")["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert loaded == {
        "PylonTimeToFirstTokenP99OverSLO",
        "PylonKVCacheFull",
        "PylonWaitingRequestsGrowing",
        "PylonTrainDataWaitHigh",
        "PylonCheckpointFailures",
        "PylonReplicaRestarting",
    }
    p99 = _api(prom, "query", query='pylon:time_to_first_token_seconds:p99_5m{model="tiny-prom"}')["result"]
    assert p99 and float(p99[0]["value"][1]) > 0.001, p99
    print(f"alert fired: {time.monotonic() - t0:.0f}s", file=sys.stderr)

    # The TrainJob's steps reach Prometheus from its Ray Train worker while it runs. A gauge's series goes stale
    # when the worker exits (Ray's agent stops exporting it), and a job that finished before this point has no
    # current value: last_over_time reads the last sample Prometheus scraped.
    wanted = ("ray_pylon_train_step", "ray_pylon_train_loss", "ray_pylon_train_tokens_total")
    seen: dict[str, list] = {}
    while True:
        status = client.job_status(job)
        for m in wanted:
            query = f'last_over_time({m}{{run="{run}"}}[15m])'
            seen[m] = seen.get(m) or _api(prom, "query", query=query)["result"]
        if status in ("SUCCEEDED", "FAILED", "STOPPED") or time.monotonic() - t0 > 600:
            break
        time.sleep(2)
    assert status == "SUCCEEDED", client.job_logs(job)[-4000:]
    print(f"trained: {time.monotonic() - t0:.0f}s", file=sys.stderr)
    assert all(seen.values()), seen
    assert 1 <= float(seen["ray_pylon_train_step"][0]["value"][1]) <= 20, seen
    assert seen["ray_pylon_train_step"][0]["metric"]["rank"] == "0"

    # Every metric the rendered dashboard reads is one Prometheus scraped here.
    names = set(_api(prom, "label/__name__/values"))
    dashboard = grafana_dashboard(load_spec(EXAMPLES / "cluster-k8s.yaml", ClusterSpec))
    missing = sorted(dashboard_metrics(dashboard) - names)
    assert not missing, (missing, sorted(n for n in names if n.startswith("ray_pylon")))
