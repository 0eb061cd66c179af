"""Prometheus scrape config and the Grafana dashboard rendered beside each cluster."""

from __future__ import annotations

from pylon.specs import ClusterSpec


def prometheus_config(cluster: ClusterSpec, target: str) -> dict:
    if target == "ray-up":
        # Ray's head writes every node's metrics endpoint to this file and keeps it current as nodes come and go.
        scrape = {"job_name": "ray", "file_sd_configs": [{"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}]}
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
    return {"global": {"scrape_interval": "15s", "evaluation_interval": "15s"}, "scrape_configs": [scrape]}


def grafana_dashboard(cluster: ClusterSpec) -> dict:
    """Pylon's serving metrics (`pylon_*`, exported by Ray with the `ray_` prefix) and the training side as
    Ray reports it per node (GPU, GPU memory, CPU) and per node type (the autoscaler's view)."""

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
        ("Training and cluster", None, None),
        (
            "GPU utilization",
            "percent",
            [q("avg by (ip, GpuIndex) (ray_node_gpus_utilization)", "{{ip}} GPU {{GpuIndex}}")],
        ),
        ("GPU memory used", "bytes", [q("sum by (ip, GpuIndex) (ray_node_gram_used)", "{{ip}} GPU {{GpuIndex}}")]),
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
