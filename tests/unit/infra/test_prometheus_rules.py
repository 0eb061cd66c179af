"""Pylon's Prometheus rules and configs: the committed rules file is what the code renders, promtool accepts the rules,
the local config and a rendered config, and each alert fires on made-up series (infra/prometheus/rules_test.yml);
`--metrics` without Prometheus installed says how to install it. (With a real Prometheus scraping a cluster:
tests/integration/test_prometheus.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pylon import infra
from pylon.errors import ClusterError
from pylon.infra import observability, prometheus

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "infra" / "prometheus" / "rules.yml"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed"
)


def test_committed_rules_are_what_the_code_renders() -> None:
    assert RULES.read_text() == observability.rules_text(), (
        "infra/prometheus/rules.yml has drifted: python -c 'from pylon.infra.observability import rules_text; "
        'print(rules_text(), end="")\' > infra/prometheus/rules.yml'
    )
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {
        "PylonTimeToFirstTokenP99OverSLO",
        "PylonKVCacheFull",
        "PylonWaitingRequestsGrowing",
        "PylonTrainDataWaitHigh",
        "PylonCheckpointFailures",
        "PylonReplicaRestarting",
    }


def test_thresholds_reach_the_rules() -> None:
    text = observability.rules_text(observability.AlertThresholds(ttft_p99_slo_s=0.25, hold="0s"))
    rules = {r.get("alert"): r for g in yaml.safe_load(text)["groups"] for r in g["rules"]}
    assert rules["PylonTimeToFirstTokenP99OverSLO"]["expr"].endswith("> 0.25")
    assert {r["for"] for name, r in rules.items() if name} == {"0s"}


@needs_promtool
def test_promtool_checks_and_tests_the_rules() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        ["promtool", "test", "rules", "rules_test.yml"], cwd=RULES.parent, capture_output=True, text=True
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


@needs_promtool
def test_promtool_accepts_the_local_and_the_rendered_configs(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(observability.rules_text())
    local = observability.local_prometheus_config("/tmp/pylon-x", str(tmp_path / "rules.yml"), 2)
    assert local["scrape_configs"][0]["file_sd_configs"][0]["files"] == [
        "/tmp/pylon-x/session_latest/prom_metrics_service_discovery.json"
    ]
    (tmp_path / "local.yml").write_text(yaml.safe_dump(local))
    rendered = tmp_path / "rendered"
    # The ray-up render: Debian's Prometheus is built without Kubernetes service discovery (the kuberay render's).
    infra.write(infra.render_file([REPO / "platform/pylon/examples/cluster-aws.yaml"], "ray-up")[1], rendered)
    for config in (tmp_path / "local.yml", rendered / "prometheus.yml"):
        proc = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rendered_config_loads_the_same_rules() -> None:
    files = infra.render_file([REPO / "platform/pylon/examples/cluster-aws.yaml"], "ray-up")[1]
    assert yaml.safe_load(files["prometheus.yml"])["rule_files"] == [observability.RULES_FILE]
    rendered = yaml.safe_load(files[observability.RULES_FILE])
    assert rendered == observability.prometheus_rules()
    assert infra.validate_files(files) == []


def test_dashboard_reads_no_gpu_metrics() -> None:
    """The dashboard reads only what the Prometheus integration test sees on a CPU cluster."""
    files = infra.render_file([REPO / "platform/pylon/examples/cluster-k8s.yaml"], "kuberay")[1]
    used = observability.dashboard_metrics(json.loads(files["grafana-dashboard.json"]))
    assert "ray_pylon_time_to_first_token_seconds_bucket" in used and "ray_pylon_train_loss" in used
    assert not {m for m in used if "gpu" in m or "gram" in m}


def test_metrics_without_prometheus_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus here
    with pytest.raises(ClusterError, match=r"apt-get install prometheus.*make system-packages"):
        prometheus.prometheus_program()
    from pylon.cli import main

    monkeypatch.setenv("PYLON_HOME", str(tmp_path / "home"))
    assert main(["cluster", "up", "--metrics"]) != 0
    assert not (tmp_path / "home" / "cluster.json").exists()  # nothing started
