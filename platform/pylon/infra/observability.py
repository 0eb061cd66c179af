"""Prometheus: the scrape config and the recording and alert rules, for the local cluster (`pylon cluster up
--metrics`) and beside each rendered cluster (`pylon infra render`); and the Grafana dashboard rendered beside each
cluster.

The rules are written here once and rendered to `infra/prometheus/rules.yml` (the committed copy, with the default
thresholds of `AlertThresholds`), to `$PYLON_HOME/prometheus/rules.yml` by `pylon cluster up --metrics`, and to
`prometheus-rules.yml` beside every rendered `prometheus.yml`. Every metric Pylon defines is exported by Ray's
metrics agent with the `ray_` prefix: `pylon_time_to_first_token_seconds` is scraped as
`ray_pylon_time_to_first_token_seconds_bucket` (and `_sum`, `_count`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from pylon.specs import ClusterSpec

# Where Ray's head writes every node's metrics endpoint (and keeps it current as nodes come and go), below its temp
# dir: `<temp dir>/session_latest/prom_metrics_service_discovery.json` (Ray also links it from the temp dir itself).
SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
RULES_FILE = "prometheus-rules.yml"  # beside a rendered prometheus.yml


@dataclass(frozen=True)
class AlertThresholds:
    """The alerts' thresholds (docs/observability.md lists them). `hold`: one `for:` for every alert instead of each
    alert's own (a test uses "0s")."""

    ttft_p99_slo_s: float = 2.0  # time to first token, p99 over 5 minutes, per model
    kv_cache_full_ratio: float = 0.95  # fraction of a replica's KV-cache blocks in use
    waiting_requests: int = 1  # waiting requests (per model) at or above which a growing queue alerts
    data_wait_fraction: float = 0.3  # share of a training step spent waiting for data, per rank
    hold: str | None = None


def prometheus_rules(t: AlertThresholds | None = None) -> dict:
    """Recording rules (`pylon:*`) and alert rules: TTFT p99 over its SLO, KV cache full, waiting requests growing,
    training data wait high, checkpoint failures, a Serve replica restarting."""
    t = t or AlertThresholds()

    def alert(name: str, expr: str, hold: str, severity: str, summary: str) -> dict:
        return {
            "alert": name,
            "expr": expr,
            "for": t.hold if t.hold is not None else hold,
            "labels": {"severity": severity},
            "annotations": {"summary": summary},
        }

    failures = "ray_pylon_train_checkpoint_failures_total"
    return {
        "groups": [
            {
                "name": "pylon-recording",
                "rules": [
                    {
                        "record": "pylon:time_to_first_token_seconds:p99_5m",
                        "expr": "histogram_quantile(0.99, sum by (le, model) "
                        "(rate(ray_pylon_time_to_first_token_seconds_bucket[5m])))",
                    },
                    {
                        "record": "pylon:e2e_request_latency_seconds:p99_5m",
                        "expr": "histogram_quantile(0.99, sum by (le, model) "
                        "(rate(ray_pylon_e2e_request_latency_seconds_bucket[5m])))",
                    },
                    {
                        "record": "pylon:kv_cache_usage_ratio:max",
                        "expr": "max by (model) (ray_pylon_kv_cache_usage_ratio)",
                    },
                    {"record": "pylon:requests_waiting:sum", "expr": "sum by (model) (ray_pylon_num_requests_waiting)"},
                    {
                        "record": "pylon:generation_tokens:rate1m",
                        "expr": "sum by (model) (rate(ray_pylon_generation_tokens_total[1m]))",
                    },
                    {
                        "record": "pylon:train_tokens:rate1m",
                        "expr": "sum by (run) (rate(ray_pylon_train_tokens_total[1m]))",
                    },
                    {
                        "record": "pylon:train_data_wait_fraction:max",
                        "expr": "max by (run) (ray_pylon_train_data_wait_fraction)",
                    },
                ],
            },
            {
                "name": "pylon-alerts",
                "rules": [
                    alert(
                        "PylonTimeToFirstTokenP99OverSLO",
                        f"pylon:time_to_first_token_seconds:p99_5m > {t.ttft_p99_slo_s:g}",
                        "5m",
                        "warning",
                        f"{{{{ $labels.model }}}}: p99 time to first token {{{{ $value | humanizeDuration }}}} "
                        f"over 5 minutes, above its SLO of {t.ttft_p99_slo_s:g} s",
                    ),
                    alert(
                        "PylonKVCacheFull",
                        f"pylon:kv_cache_usage_ratio:max >= {t.kv_cache_full_ratio:g}",
                        "5m",
                        "warning",
                        "{{ $labels.model }}: a replica's KV cache is {{ $value | humanizePercentage }} full: requests "
                        "wait for blocks (or are preempted); add replicas or KV-cache memory",
                    ),
                    alert(
                        "PylonWaitingRequestsGrowing",
                        f"pylon:requests_waiting:sum >= {t.waiting_requests} "
                        "and deriv(pylon:requests_waiting:sum[5m]) > 0",
                        "5m",
                        "warning",
                        "{{ $labels.model }}: {{ $value }} requests waiting and the queue keeps growing: the replicas "
                        "do not keep up",
                    ),
                    alert(
                        "PylonTrainDataWaitHigh",
                        f"pylon:train_data_wait_fraction:max > {t.data_wait_fraction:g}",
                        "10m",
                        "warning",
                        "run {{ $labels.run }}: {{ $value | humanizePercentage }} of a step waits for data: the "
                        "input pipeline (Ray Data, storage) is the bottleneck",
                    ),
                    alert(
                        "PylonCheckpointFailures",
                        _increased(failures, "run", "30m"),
                        "0s",
                        "critical",
                        "run {{ $labels.run }}: a checkpoint save failed in the last 30 minutes",
                    ),
                    alert(
                        "PylonReplicaRestarting",
                        # Serve's controller counts the health checks a replica fails; a replica that fails one
                        # (its process died, its engine is dead, a check timed out) is stopped and replaced.
                        _increased("ray_serve_health_check_failures_total", "application, deployment", "15m"),
                        "0s",
                        "warning",
                        "{{ $labels.application }}/{{ $labels.deployment }}: a replica failed its health checks "
                        "in the last 15 minutes; Serve replaces (restarts) such replicas",
                    ),
                ],
            },
        ]
    }


def rules_text(t: AlertThresholds | None = None) -> str:
    """`prometheus_rules` as the YAML file Prometheus loads (`infra/prometheus/rules.yml` holds the defaults')."""
    import yaml

    t = t or AlertThresholds()
    thresholds = ", ".join(f"{k}={v}" for k, v in asdict(t).items())
    head = (
        "# Pylon's Prometheus recording and alert rules, rendered by pylon.infra.observability.rules_text(); edit\n"
        f"# that, not this file. Thresholds: {thresholds}.\n"
        "# docs/observability.md lists the alerts. `pylon cluster up --metrics` loads these; `pylon infra render`\n"
        "# writes them beside prometheus.yml. Check with `promtool check rules` and `promtool test rules`.\n"
    )
    return head + yaml.safe_dump(prometheus_rules(t), sort_keys=False, width=120)


def _increased(counter: str, by: str, window: str) -> str:
    """`counter` grew within `window`, per `by`. Ray creates a counter's series at its first increment, so a series
    absent `window` ago (born at 1) counts too: `increase` alone never sees that first step."""
    return (
        f"sum by ({by}) (increase({counter}[{window}])) > 0 "
        f"or sum by ({by}) ({counter} > 0 unless {counter} offset {window})"
    )


def prometheus_config(cluster: ClusterSpec, target: str) -> dict:
    if target == "ray-up":
        # Ray's head writes every node's metrics endpoint to this file and keeps it current as nodes come and go.
        scrape = {"job_name": "ray", "file_sd_configs": [{"files": [f"/tmp/ray/{SERVICE_DISCOVERY_FILE}"]}]}
    else:
        scrape = {
            "job_name": "ray",
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [cluster.provider.namespace]}}],
            "relabel_configs": [
                # Every Ray pod KubeRay makes (the RayCluster's and each RayService's), on its metrics port.
                {"source_labels": ["__meta_kubernetes_pod_label_ray_io_is_ray_node"], "regex": "yes", "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "target_label": "ray_cluster"},
                {"source_labels": ["__meta_kubernetes_pod_label_ray_io_group"], "target_label": "ray_group"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        # Relative to this file: the rules rendered beside it.
        "rule_files": [RULES_FILE],
        "scrape_configs": [scrape],
    }


def local_prometheus_config(temp_dir: str, rules_file: str, interval_s: float = 5.0) -> dict:
    """The config of the Prometheus `pylon cluster up --metrics` starts: every node Ray's head lists in its service
    discovery file (re-read every 5 s, and as it changes), scraped and the rules evaluated every `interval_s`."""
    every = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
        "rule_files": [rules_file],
        "scrape_configs": [
            {
                "job_name": "ray",
                "file_sd_configs": [
                    {"files": [f"{temp_dir}/session_latest/{SERVICE_DISCOVERY_FILE}"], "refresh_interval": "5s"}
                ],
            }
        ],
    }


def dashboard_metrics(dashboard: dict) -> set[str]:
    """The metric names a dashboard's queries read (Ray's exported names, `ray_*`)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b(ray_[A-Za-z0-9_]+)", e)}


def grafana_dashboard(cluster: ClusterSpec) -> dict:
    """Pylon's serving metrics and training metrics (`pylon_*`, `pylon_train_*`: exported by Ray with the `ray_`
    prefix) and each node's CPU and memory as Ray reports them. Every metric it reads is one the Prometheus test
    (tests/integration/test_prometheus.py) sees on a CPU cluster; Ray's GPU metrics (`ray_node_gpus_utilization`,
    `ray_node_gram_used`) appear only on nodes with GPUs and are left out until such a test shows them."""

    def q(expr: str, legend: str) -> dict:
        return {"expr": expr, "legendFormat": legend, "refId": "A"}

    def quantiles(metric: str) -> list[dict]:
        return [
            {
                "expr": f"histogram_quantile({p}, sum by (le, model) (rate(ray_{metric}_bucket[5m])))",
                "legendFormat": f"{{{{model}}}} p{int(p * 100)}",
                "refId": ref,
            }
            for p, ref in ((0.5, "A"), (0.99, "B"))
        ]

    panels_spec = [
        ("Serving", None, None),
        ("Time to first token", "s", quantiles("pylon_time_to_first_token_seconds")),
        ("Inter-token latency", "s", quantiles("pylon_inter_token_latency_seconds")),
        ("End-to-end request latency", "s", quantiles("pylon_e2e_request_latency_seconds")),
        ("Queue time", "s", quantiles("pylon_request_queue_time_seconds")),
        (
            "Requests running / waiting",
            "short",
            [
                q("sum by (model) (ray_pylon_num_requests_running)", "{{model}} running"),
                {**q("sum by (model) (ray_pylon_num_requests_waiting)", "{{model}} waiting"), "refId": "B"},
            ],
        ),
        ("KV cache usage", "percentunit", [q("max by (model) (ray_pylon_kv_cache_usage_ratio)", "{{model}}")]),
        (
            "Tokens per second",
            "short",
            [
                q("sum by (model) (rate(ray_pylon_generation_tokens_total[1m]))", "{{model}} generated"),
                {**q("sum by (model) (rate(ray_pylon_prompt_tokens_total[1m]))", "{{model}} prompt"), "refId": "B"},
            ],
        ),
        (
            "Requests per second by status",
            "reqps",
            [q("sum by (model, status) (rate(ray_pylon_requests_total[1m]))", "{{model}} {{status}}")],
        ),
        ("Prefill replicas", None, None),
        (
            # (a deployment's `prefill`: where its decoding replicas had prompts computed, and what chose the prefill
            # replica)
            "Prompts by where computed",
            "reqps",
            [
                q("sum by (model, where) (rate(ray_pylon_prefill_requests_total[1m]))", "{{model}} {{where}}"),
                {
                    **q("sum by (model, by) (rate(ray_pylon_prefill_routed_total[1m]))", "{{model}} routed by {{by}}"),
                    "refId": "B",
                },
            ],
        ),
        ("Wait for a prefill replica's blocks", "s", quantiles("pylon_prefill_remote_seconds")),
        (
            "KV blocks between replicas",
            "Bps",
            [
                q("sum by (model) (rate(ray_pylon_kv_transfer_sent_bytes_total[1m]))", "{{model}} sent"),
                {
                    **q("sum by (model) (rate(ray_pylon_kv_transfer_received_bytes_total[1m]))", "{{model}} received"),
                    "refId": "B",
                },
            ],
        ),
        (
            "Prompt tokens computed by deployment",
            "short",
            [q("sum by (deployment) (rate(ray_pylon_prefill_tokens_computed_total[1m]))", "{{deployment}}")],
        ),
        ("Training", None, None),
        ("Training loss", "short", [q("max by (run) (ray_pylon_train_loss)", "{{run}}")]),
        (
            "Training tokens per second",
            "short",
            [q("sum by (run) (rate(ray_pylon_train_tokens_total[1m]))", "{{run}}")],
        ),
        (
            "Data wait (share of a step)",
            "percentunit",
            [q("max by (run, rank) (ray_pylon_train_data_wait_fraction)", "{{run}} rank {{rank}}")],
        ),
        (
            # Seconds of training blocked by checkpoint saves, per second of training. Failures: the
            # PylonCheckpointFailures alert (the counter exists only once a save failed).
            "Checkpoint saves: training blocked",
            "percentunit",
            [q("max by (run) (rate(ray_pylon_train_checkpoint_blocked_seconds_total[5m]))", "{{run}}")],
        ),
        ("Cluster", None, None),
        ("CPU utilization by node", "percent", [q("avg by (ip) (ray_node_cpu_utilization)", "{{ip}}")]),
        ("Host memory used by node", "bytes", [q("sum by (ip) (ray_node_mem_used)", "{{ip}}")]),
        (
            "Active nodes by type (autoscaler)",
            "short",
            [q("sum by (node_type) (ray_cluster_active_nodes)", "{{node_type}}")],
        ),
    ]
    panels, y, x = [], 0, 0
    for i, (title, unit, targets) in enumerate(panels_spec, start=1):
        if targets is None:
            y += 8 if x else 0
            panels.append(
                {
                    "id": i,
                    "type": "row",
                    "title": title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                }
            )
            y, x = y + 1, 0
            continue
        panels.append(
            {
                "id": i,
                "type": "timeseries",
                "title": title,
                "datasource": {"uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": targets,
                "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            }
        )
        x = 12 - x
        if x == 0:
            y += 8
    return {
        "title": f"Pylon: {cluster.name}",
        "uid": f"pylon-{cluster.name}"[:40],
        "schemaVersion": 39,
        "tags": ["pylon", "ray"],
        "timezone": "browser",
        "refresh": "30s",
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }
