"""A `Cluster` spec in, the files that run it out: Ray cluster-launcher YAML or KubeRay manifests, the image's
Dockerfile, a Prometheus scrape config and a Grafana dashboard.

    files = render(cluster, "ray-up")                        # {"cluster.yaml": ..., "Dockerfile": ..., ...}
    files = render(cluster, "kuberay", jobs=[train], deployments=[serve])
    problems = validate_files(files)                         # [] when every manifest passes its schema
    write(files, "infra/aws")

Nothing here is hand-written twice: the worker groups, GPU counts, spot flags and idle timeout come from the
`Cluster` spec; a RayJob's entrypoint and config from a `TrainJob` spec; a RayService's `serveConfigV2` from a
`Deployment` spec (the same builder, `pylon.serving.api.builder:app_builder`, that `serve run` would import).
Validation is offline: launcher YAML against the JSON schema Ray ships (`ray/autoscaler/ray-schema.json`),
KubeRay manifests against the CRD schemas copied into `pylon/infra/schemas/kuberay/` (see SOURCE.md there).

Secrets are never rendered: Ray's auth token reaches the nodes from a file (`~/.ray/auth_token`, copied by
the launcher's file_mounts) or from a Kubernetes Secret named in the manifests; API keys the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from pylon.errors import PylonError, SpecError
from pylon.infra.autoscaler import LOCAL_OBJECT_STORE_BYTES, LOCAL_PROVIDER, local_autoscaler_config
from pylon.infra.common import TOKEN_PATH, Files, _dump, _header
from pylon.infra.kuberay import job_spec_configmap, network_policy, ray_cluster, ray_job, ray_service
from pylon.infra.launcher import dockerfile, launcher_config
from pylon.infra.observability import RULES_FILE, grafana_dashboard, prometheus_config, prometheus_rules
from pylon.infra.schema import validate_files, validate_manifest
from pylon.specs import ClusterSpec, DeploymentSpec, TrainJobSpec, load_specs

__all__ = [
    "EXAMPLES",
    "LOCAL_OBJECT_STORE_BYTES",
    "LOCAL_PROVIDER",
    "TARGETS",
    "TOKEN_PATH",
    "Files",
    "check",
    "default_target",
    "dockerfile",
    "grafana_dashboard",
    "job_spec_configmap",
    "launcher_config",
    "local_autoscaler_config",
    "prometheus_config",
    "ray_cluster",
    "ray_job",
    "ray_service",
    "render",
    "render_file",
    "validate_files",
    "validate_manifest",
    "write",
]

TARGETS = ("ray-up", "kuberay")
PROVIDERS_FOR_TARGET = {"ray-up": ("aws", "gcp"), "kuberay": ("kubernetes",)}


# The committed examples under infra/: which spec renders which folder, for which target.
EXAMPLES = {
    "infra/aws": ("cluster-aws.yaml", "ray-up"),
    "infra/gcp": ("cluster-gcp.yaml", "ray-up"),
    "infra/kuberay": ("cluster-k8s.yaml", "kuberay"),
}


def render(
    cluster: ClusterSpec, target: str, *, jobs: Sequence[TrainJobSpec] = (), deployments: Sequence[DeploymentSpec] = ()
) -> Files:
    """Every file for `target`, by relative path. TrainJobs and Deployments become RayJobs and RayServices
    (kuberay only: the cluster launcher runs them with `pylon train` / `pylon serve` against the head)."""
    if target not in TARGETS:
        raise PylonError(f"--target: must be one of {', '.join(TARGETS)} (got {target!r})")
    allowed = PROVIDERS_FOR_TARGET[target]
    if cluster.provider.type not in allowed:
        hint = (
            "use target kuberay"
            if cluster.provider.type == "kubernetes"
            else "use target ray-up"
            if cluster.provider.type in ("aws", "gcp")
            else "a local cluster needs no files: run `pylon cluster up`"
        )
        raise SpecError(
            [
                f"Cluster '{cluster.name}': provider.type: target {target} needs one of "
                f"{', '.join(allowed)} (got {cluster.provider.type!r}); {hint}"
            ]
        )
    if target == "kuberay":
        _require_shared_storage(jobs, deployments)
    files: Files = {}
    if target == "ray-up":
        files["cluster.yaml"] = _dump(launcher_config(cluster), header=_header(cluster, "ray up"))
    else:
        files["raycluster.yaml"] = _dump(ray_cluster(cluster), header=_header(cluster, "kubectl apply -f"))
        # Closes what Ray leaves open on every pod (docs/security.md); applies to RayJobs' and RayServices' pods too.
        files["networkpolicy.yaml"] = _dump(network_policy(cluster), header=_header(cluster, "kubectl apply -f"))
        for job in jobs:
            docs = [job_spec_configmap(cluster, job), ray_job(cluster, job)]
            files[f"rayjob-{job.name}.yaml"] = _dump(*docs, header=_header(cluster, "kubectl apply -f"))
        for dep in deployments:
            files[f"rayservice-{dep.name}.yaml"] = _dump(
                ray_service(cluster, dep), header=_header(cluster, "kubectl apply -f")
            )
    files["Dockerfile"] = dockerfile(cluster)
    files["prometheus.yml"] = _dump(
        prometheus_config(cluster, target), header=_header(cluster, "prometheus --config.file=")
    )
    files[RULES_FILE] = _dump(prometheus_rules(), header=_header(cluster, "promtool check rules"))
    files["grafana-dashboard.json"] = json.dumps(grafana_dashboard(cluster), indent=2) + "\n"
    return files


def _require_shared_storage(jobs: Sequence[TrainJobSpec], deployments: Sequence[DeploymentSpec]) -> None:
    """Pods share no disk: what a RayJob reads and writes, and what a RayService loads, must be object storage."""
    problems = []

    def need(uri: str | None, label: str, field: str) -> None:
        if uri is None or "://" not in uri or uri.startswith("file://"):
            problems.append(
                f"{label}: {field}: must be object storage (s3://, gs://) on Kubernetes, where pods "
                f"share no local disk (got {'nothing: the default is local' if uri is None else repr(uri)})"
            )

    for job in jobs:
        need(job.data.uri, f"TrainJob '{job.name}'", "data.uri")
        need(job.checkpoint.storage, f"TrainJob '{job.name}'", "checkpoint.storage")
    for dep in deployments:
        need(dep.model, f"Deployment '{dep.name}'", "model")
    if problems:
        raise SpecError(problems)


def render_file(paths: Iterable[str | os.PathLike], target: str) -> tuple[ClusterSpec, Files]:
    """The one Cluster in `paths` rendered for `target`, with the file's TrainJobs and Deployments."""

    docs, problems = [], []
    for path in paths:
        try:
            docs.extend(load_specs(path))
        except SpecError as e:
            problems.extend(e.problems)
    if problems:
        raise SpecError(problems)
    clusters = [d.spec for d in docs if isinstance(d.spec, ClusterSpec)]
    if len(clusters) != 1:
        names = ", ".join(str(p) for p in paths)
        raise SpecError([f"{names}: expected exactly one Cluster document, found {len(clusters)}"])
    jobs = [d.spec for d in docs if isinstance(d.spec, TrainJobSpec)]
    deployments = [d.spec for d in docs if isinstance(d.spec, DeploymentSpec)]
    return clusters[0], render(clusters[0], target, jobs=jobs, deployments=deployments)


def write(files: Files, out_dir: str | os.PathLike) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def default_target(cluster: ClusterSpec) -> str | None:
    """The target a Cluster spec renders for (None for a local cluster: `pylon cluster up` runs it)."""
    for target, providers in PROVIDERS_FOR_TARGET.items():
        if cluster.provider.type in providers:
            return target
    return None


def check(
    cluster: ClusterSpec, *, jobs: Sequence[TrainJobSpec] = (), deployments: Sequence[DeploymentSpec] = ()
) -> list[str]:
    """What `pylon validate` adds for a Cluster: render it for its target and validate every manifest."""
    target = default_target(cluster)
    if target is None:
        config = local_autoscaler_config(cluster, temp_dir="/tmp/pylon")
        return [f"Cluster '{cluster.name}' as a local autoscaling config: {p}" for p in validate_manifest(config)]
    try:
        files = render(cluster, target, jobs=jobs, deployments=deployments)
    except SpecError as e:
        return list(e.problems)
    except PylonError as e:
        return [f"Cluster '{cluster.name}': {e}"]
    return [f"Cluster '{cluster.name}' rendered for {target}: {p}" for p in validate_files(files)]
