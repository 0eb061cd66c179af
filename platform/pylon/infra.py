"""A `Cluster` spec in, the files that run it out: Ray cluster-launcher YAML or KubeRay manifests, the image's
Dockerfile, a Prometheus scrape config and a Grafana dashboard.

    files = render(cluster, "ray-up")                        # {"cluster.yaml": ..., "Dockerfile": ..., ...}
    files = render(cluster, "kuberay", jobs=[train], deployments=[serve])
    problems = validate_files(files)                         # [] when every manifest passes its schema
    write(files, "infra/aws")

Nothing here is hand-written twice: the worker groups, GPU counts, spot flags and idle timeout come from the
`Cluster` spec; a RayJob's entrypoint and config from a `TrainJob` spec; a RayService's `serveConfigV2` from a
`Deployment` spec (the same builder, `pylon.serving.app:app_builder`, that `serve run` would import).
Validation is offline: launcher YAML against the JSON schema Ray ships (`ray/autoscaler/ray-schema.json`),
KubeRay manifests against the CRD schemas copied into `pylon/schemas/kuberay/` (see SOURCE.md there).

Secrets are never rendered: Ray's auth token reaches the nodes from a file (`~/.ray/auth_token`, copied by
the launcher's file_mounts) or from a Kubernetes Secret named in the manifests; API keys the same way.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

from pylon import __version__
from pylon.cluster import SERVE_ENV, SERVE_INGRESS_ENV
from pylon.errors import PylonError, SpecError
from pylon.specs import ClusterSpec, DeploymentSpec, NodeShape, TrainJobSpec, WorkerGroupSpec, to_yaml

# Serve's settings on every node of a rendered cluster: HAProxy ingress, handlers on the HTTP server's loop.
RENDERED_SERVE_ENV = {**SERVE_INGRESS_ENV, **SERVE_ENV}

TARGETS = ("ray-up", "kuberay")
PROVIDERS_FOR_TARGET = {"ray-up": ("aws", "gcp"), "kuberay": ("kubernetes",)}

# The committed examples under infra/: which spec renders which folder, for which target.
EXAMPLES = {
    "infra/aws": ("cluster-aws.yaml", "ray-up"),
    "infra/gcp": ("cluster-gcp.yaml", "ray-up"),
    "infra/kuberay": ("cluster-k8s.yaml", "kuberay"),
}

# The Ray images are published per Python minor version; Pylon's tested one (constraints.txt) is 3.11.
PYTHON_TAG = "py311"
RAY_PORT = 6379
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
METRICS_PORT = 8080
# Where the token lives on every node / pod (the launcher copies the local ~/.ray/auth_token there).
NODE_HOME = "/home/ray"
TOKEN_PATH = f"{NODE_HOME}/.ray/auth_token"
SOURCE_DIR = "/opt/pylon/src"
ROOT_DISK_GB = 256
# Ray's object store takes about 30% of a node's memory by default; the rest is what tasks may reserve.
TASK_MEMORY_SHARE = 0.7
DEFAULT_MEMORY_GB_PER_CPU = 4

# GCP wants its own accelerator names on the VM (guestAccelerators); Pylon's GPU names as the catalog spells them.
GCP_ACCELERATORS = {
    "T4": "nvidia-tesla-t4",
    "V100": "nvidia-tesla-v100",
    "L4": "nvidia-l4",
    "A100-40GB": "nvidia-tesla-a100",
    "A100-80GB": "nvidia-a100-80gb",
    "H100": "nvidia-h100-80gb",
    "H100-SXM": "nvidia-h100-80gb",
    "H100-MEGA": "nvidia-h100-mega-80gb",
    "H200": "nvidia-h200-141gb",
}
# Deep Learning VM families: NVIDIA driver and Docker installed, so the launcher can run the GPU image.
GCP_SOURCE_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
# Kubernetes nodes that sell spare capacity, as each managed offering labels them (any one matches).
SPOT_NODE_LABELS = {
    "cloud.google.com/gke-spot": "true",  # GKE
    "eks.amazonaws.com/capacityType": "SPOT",  # EKS managed node groups
    "karpenter.sh/capacity-type": "spot",  # Karpenter (EKS, AKS)
}

Files = dict[str, str]


# ---------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------


def render(cluster: ClusterSpec, target: str, *, jobs: Sequence[TrainJobSpec] = (),
           deployments: Sequence[DeploymentSpec] = ()) -> Files:
    """Every file for `target`, by relative path. TrainJobs and Deployments become RayJobs and RayServices
    (kuberay only: the cluster launcher runs them with `pylon train` / `pylon serve` against the head)."""
    if target not in TARGETS:
        raise PylonError(f"--target: must be one of {', '.join(TARGETS)} (got {target!r})")
    allowed = PROVIDERS_FOR_TARGET[target]
    if cluster.provider.type not in allowed:
        hint = ("use target kuberay" if cluster.provider.type == "kubernetes"
                else "use target ray-up" if cluster.provider.type in ("aws", "gcp")
                else "a local cluster needs no files: run `pylon cluster up`")
        raise SpecError([f"Cluster '{cluster.name}': provider.type: target {target} needs one of "
                         f"{', '.join(allowed)} (got {cluster.provider.type!r}); {hint}"])
    if target == "kuberay":
        _require_shared_storage(jobs, deployments)
    files: Files = {}
    if target == "ray-up":
        files["cluster.yaml"] = _dump(launcher_config(cluster), header=_header(cluster, "ray up"))
    else:
        files["raycluster.yaml"] = _dump(ray_cluster(cluster), header=_header(cluster, "kubectl apply -f"))
        for job in jobs:
            docs = [job_spec_configmap(cluster, job), ray_job(cluster, job)]
            files[f"rayjob-{job.name}.yaml"] = _dump(*docs, header=_header(cluster, "kubectl apply -f"))
        for dep in deployments:
            files[f"rayservice-{dep.name}.yaml"] = _dump(ray_service(cluster, dep),
                                                         header=_header(cluster, "kubectl apply -f"))
    files["Dockerfile"] = dockerfile(cluster)
    files["prometheus.yml"] = _dump(prometheus_config(cluster, target),
                                    header=_header(cluster, "prometheus --config.file="))
    files["grafana-dashboard.json"] = json.dumps(grafana_dashboard(cluster), indent=2) + "\n"
    return files


def _require_shared_storage(jobs: Sequence[TrainJobSpec], deployments: Sequence[DeploymentSpec]) -> None:
    """Pods share no disk: what a RayJob reads and writes, and what a RayService loads, must be object storage."""
    problems = []

    def need(uri: str | None, label: str, field: str) -> None:
        if uri is None or "://" not in uri or uri.startswith("file://"):
            problems.append(f"{label}: {field}: must be object storage (s3://, gs://) on Kubernetes, where pods "
                            f"share no local disk (got {'nothing: the default is local' if uri is None else repr(uri)})")

    for job in jobs:
        need(job.data.uri, f"TrainJob '{job.name}'", "data.uri")
        need(job.checkpoint.storage, f"TrainJob '{job.name}'", "checkpoint.storage")
    for dep in deployments:
        need(dep.model, f"Deployment '{dep.name}'", "model")
    if problems:
        raise SpecError(problems)


def render_file(paths: Iterable[str | os.PathLike], target: str) -> tuple[ClusterSpec, Files]:
    """The one Cluster in `paths` rendered for `target`, with the file's TrainJobs and Deployments."""
    from pylon.specs import load_specs

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


def check(cluster: ClusterSpec, *, jobs: Sequence[TrainJobSpec] = (),
          deployments: Sequence[DeploymentSpec] = ()) -> list[str]:
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


# ---------------------------------------------------------------------------------------------------------
# Ray cluster launcher (ray up): AWS and GCP
# ---------------------------------------------------------------------------------------------------------


def launcher_config(cluster: ClusterSpec) -> dict:
    provider = cluster.provider
    if provider.type == "aws":
        provider_cfg = {"type": "aws", "region": provider.region,
                        # Terminate idle nodes instead of stopping them: stopped nodes still pay for their disks.
                        "cache_stopped_nodes": False}
        if provider.zone:
            provider_cfg["availability_zone"] = provider.zone
    else:
        provider_cfg = {"type": "gcp", "region": provider.region, "availability_zone": provider.zone,
                        "project_id": provider.project_id}
    node_types = {"head": {"resources": _launcher_resources(cluster.head),
                           "node_config": _node_config(cluster, cluster.head),
                           "min_workers": 0, "max_workers": 0}}
    for group in cluster.worker_groups:
        node_type = {"resources": _launcher_resources(group), "node_config": _node_config(cluster, group, group),
                     "min_workers": group.min_workers, "max_workers": group.max_workers}
        if group.gpu_type:
            node_type["labels"] = {"ray.io/accelerator-type": group.gpu_type}
        node_types[group.name] = node_type
    serve_env = " ".join(f"{k}={v}" for k, v in RENDERED_SERVE_ENV.items())
    env = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={TOKEN_PATH} {serve_env}; ulimit -n 65536"
    return {
        "cluster_name": cluster.name,
        "max_workers": sum(g.max_workers for g in cluster.worker_groups),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cluster.idle_timeout_minutes,
        "docker": {"image": cluster.image, "container_name": "pylon", "pull_before_run": True,
                   "run_options": ["--ulimit nofile=65536:65536"]},
        "provider": provider_cfg,
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": node_types,
        "head_node_type": "head",
        # The token is a local file (`ray get-auth-token --generate` makes one), copied to every node: no secret
        # is written into this config. The Pylon source tree is copied so that setup installs exactly it.
        "file_mounts": {TOKEN_PATH: "~/.ray/auth_token", SOURCE_DIR: "."},
        "rsync_exclude": [".git", ".venv", "**/__pycache__", ".cache"],
        "rsync_filter": [".gitignore"],
        "initialization_commands": [],
        "setup_commands": [f"pip install --quiet -c {SOURCE_DIR}/constraints.txt {SOURCE_DIR}"],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [
            "ray stop",
            f"{env}; ray start --head --port={RAY_PORT} --object-manager-port=8076 "
            f"--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=0.0.0.0 "
            f"--metrics-export-port={METRICS_PORT}",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            f"{env}; ray start --address=$RAY_HEAD_IP:{RAY_PORT} --object-manager-port=8076 "
            f"--metrics-export-port={METRICS_PORT}",
        ],
    }


def _launcher_resources(shape: NodeShape) -> dict[str, int]:
    resources = {"CPU": shape.cpus}
    if shape.gpus:
        resources["GPU"] = shape.gpus
    if shape.gpu_type:
        # Ray's accelerator_type resource: `@ray.remote(accelerator_type="A100-40GB")` lands on this group.
        resources[f"accelerator_type:{shape.gpu_type}"] = 1
    if shape.memory_gb:
        resources["memory"] = int(shape.memory_gb * TASK_MEMORY_SHARE * 2**30)
    return resources


def _node_config(cluster: ClusterSpec, shape: NodeShape, group: WorkerGroupSpec | None = None) -> dict:
    spot = bool(group and group.spot)
    if cluster.provider.type == "aws":
        config = {"InstanceType": shape.instance_type,
                  "BlockDeviceMappings": [{"DeviceName": "/dev/sda1",
                                           "Ebs": {"VolumeSize": ROOT_DISK_GB, "VolumeType": "gp3"}}]}
        if spot:
            # One-time spot requests, terminated on interruption: Ray Train restarts from the last checkpoint.
            config["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        return config
    config = {"machineType": shape.instance_type,
              "disks": [{"boot": True, "autoDelete": True, "type": "PERSISTENT",
                         "initializeParams": {"diskSizeGb": ROOT_DISK_GB, "sourceImage": GCP_SOURCE_IMAGE}}]}
    scheduling: dict = {}
    if shape.gpus:
        accelerator = GCP_ACCELERATORS.get(shape.gpu_type or "")
        if accelerator is None:
            where = f"worker_groups '{group.name}'" if group else "head"
            raise SpecError([f"Cluster '{cluster.name}': {where}.gpu_type: GCP needs one of "
                             f"{', '.join(GCP_ACCELERATORS)} (got {shape.gpu_type!r})"])
        config["guestAccelerators"] = [{"acceleratorType": accelerator, "acceleratorCount": shape.gpus}]
        scheduling["onHostMaintenance"] = "TERMINATE"  # GPU VMs cannot live-migrate
    if spot:
        scheduling.update({"preemptible": True, "automaticRestart": False, "onHostMaintenance": "TERMINATE"})
    if scheduling:
        config["scheduling"] = scheduling
    return config


# ---------------------------------------------------------------------------------------------------------
# Local autoscaling (`pylon cluster up --autoscale`): Ray's autoscaler on the head, logical nodes as processes
# ---------------------------------------------------------------------------------------------------------

LOCAL_HEAD_NODE_TYPE = "ray.head.default"  # the name Ray's fake multi-node provider gives the head
LOCAL_PROVIDER = "pylon.autoscale.LocalNodeProvider"
# A logical node's object store when the spec does not give the group's memory: small, because every node
# of a local cluster shares this machine's /dev/shm.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
MIN_OBJECT_STORE_BYTES = 80 * 2**20  # Ray's own minimum


def local_autoscaler_config(cluster: ClusterSpec, *, temp_dir: str | os.PathLike) -> dict:
    """The autoscaling config `ray start --head --autoscaling-config` takes for a local cluster: the spec's
    worker groups as node types whose nodes are local processes (see pylon/autoscale.py)."""
    node_types: dict[str, dict] = {
        LOCAL_HEAD_NODE_TYPE: {"resources": {k: v for k, v in _launcher_resources(cluster.head).items()
                                             if k != "memory"},
                               "node_config": {}, "min_workers": 0, "max_workers": 0},
    }
    for group in cluster.worker_groups:
        resources = {k: v for k, v in _launcher_resources(group).items() if k != "memory"}
        resources["object_store_memory"] = (
            max(MIN_OBJECT_STORE_BYTES, int(group.memory_gb * (1 - TASK_MEMORY_SHARE) * 2**30))
            if group.memory_gb else LOCAL_OBJECT_STORE_BYTES)
        node_types[group.name] = {"resources": resources, "node_config": {},
                                  "min_workers": group.min_workers, "max_workers": group.max_workers}
    return {
        "cluster_name": cluster.name,
        "max_workers": sum(g.max_workers for g in cluster.worker_groups),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cluster.idle_timeout_minutes,
        "provider": {
            "type": "external", "module": LOCAL_PROVIDER, "temp_dir": str(temp_dir),
            # Logical nodes share this machine's IP: the autoscaler tells them apart by node id. There is
            # nothing to SSH into or set up, and no launch config that could drift.
            "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True,
        },
        "auth": {},
        "docker": {},
        "available_node_types": node_types,
        "head_node_type": LOCAL_HEAD_NODE_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


# ---------------------------------------------------------------------------------------------------------
# KubeRay: RayCluster, RayJob, RayService
# ---------------------------------------------------------------------------------------------------------


def auth_secret_name(cluster: ClusterSpec) -> str:
    return f"{cluster.name}-ray-auth"


def ray_cluster(cluster: ClusterSpec) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": _metadata(cluster, cluster.name, "Cluster"),
            "spec": ray_cluster_spec(cluster)}


def ray_cluster_spec(cluster: ClusterSpec, *, head_env: Sequence[dict] = ()) -> dict:
    """The RayCluster spec (also a RayService's rayClusterConfig): in-tree autoscaler v2, groups from 0."""
    ray_version = importlib.metadata.version("ray")
    head = cluster.head
    return {
        "rayVersion": ray_version,
        # KubeRay gives the token to every Ray container and uses it itself to reach the dashboard.
        "authOptions": {"mode": "token", "secretName": auth_secret_name(cluster)},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2",
            "upscalingMode": "Default",
            "idleTimeoutSeconds": int(cluster.idle_timeout_minutes * 60),
            "imagePullPolicy": "IfNotPresent",
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                          "limits": {"cpu": "500m", "memory": "512Mi"}},
        },
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)},
            "template": {"metadata": {"labels": _pod_labels(cluster, "head")},
                         "spec": {"containers": [_ray_container(cluster, "ray-head", head, head=True,
                                                                extra_env=head_env)],
                                  "volumes": [_shm_volume()]}},
        },
        "workerGroupSpecs": [_worker_group(cluster, g) for g in cluster.worker_groups],
    }


def _worker_group(cluster: ClusterSpec, group: WorkerGroupSpec) -> dict:
    pod: dict = {"containers": [_ray_container(cluster, "ray-worker", group)], "volumes": [_shm_volume()],
                 # Autoscaler v2 replaces a failed worker pod itself; a kubelet restart would hide the failure.
                 "restartPolicy": "Never"}
    tolerations = []
    if group.gpus:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    if group.spot:
        tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoSchedule"})
        pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
                                  for key, value in SPOT_NODE_LABELS.items()]}}}
    if tolerations:
        pod["tolerations"] = tolerations
    spec = {"groupName": group.name, "replicas": group.min_workers, "minReplicas": group.min_workers,
            "maxReplicas": group.max_workers, "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
            "template": {"metadata": {"labels": _pod_labels(cluster, group.name)}, "spec": pod}}
    if group.gpu_type:
        spec["labels"] = {"ray.io/accelerator-type": group.gpu_type}
    return spec


def _ray_container(cluster: ClusterSpec, name: str, shape: NodeShape, *, head: bool = False,
                   extra_env: Sequence[dict] = ()) -> dict:
    memory = f"{_memory_gb(shape):g}Gi"
    limits = {"cpu": str(shape.cpus), "memory": memory}
    if shape.gpus:
        limits["nvidia.com/gpu"] = str(shape.gpus)
    ports = [{"containerPort": METRICS_PORT, "name": "metrics"}]
    if head:
        ports = [{"containerPort": RAY_PORT, "name": "gcs-server"},
                 {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                 {"containerPort": 10001, "name": "client"},
                 {"containerPort": SERVE_PORT, "name": "serve"}] + ports
    return {
        "name": name, "image": cluster.image, "imagePullPolicy": "IfNotPresent",
        # Requests equal limits: a Ray node that is promised what it schedules by (Guaranteed QoS).
        "resources": {"requests": dict(limits), "limits": limits},
        # Serve's ingress (HAProxy in front of the replicas, see pylon.cluster.SERVE_INGRESS_ENV) and its replicas'
        # handlers on their HTTP server's loop (SERVE_ENV) on every node.
        "env": _auth_env(cluster) + [{"name": k, "value": v} for k, v in RENDERED_SERVE_ENV.items()]
               + list(extra_env),
        "ports": ports,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _auth_env(cluster: ClusterSpec) -> list[dict]:
    # Said explicitly (KubeRay's authOptions does the same): the token only ever comes from the Secret.
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": auth_secret_name(cluster),
                                                                      "key": "auth_token"}}}]


def _memory_gb(shape: NodeShape) -> float:
    return shape.memory_gb or shape.cpus * DEFAULT_MEMORY_GB_PER_CPU or DEFAULT_MEMORY_GB_PER_CPU


def _shm_volume() -> dict:
    # Ray's object store lives in /dev/shm; a container's default 64 MiB would spill everything to disk.
    return {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def _pod_labels(cluster: ClusterSpec, group: str) -> dict:
    return {"app.kubernetes.io/name": "pylon", "app.kubernetes.io/instance": cluster.name, "pylon.io/group": group}


def _metadata(cluster: ClusterSpec, name: str, kind: str) -> dict:
    return {"name": name, "namespace": cluster.provider.namespace,
            "labels": {"app.kubernetes.io/name": "pylon", "app.kubernetes.io/part-of": cluster.name,
                       "app.kubernetes.io/version": __version__, "pylon.io/kind": kind}}


def job_spec_configmap(cluster: ClusterSpec, job: TrainJobSpec) -> dict:
    """The TrainJob spec as a ConfigMap: the RayJob's submitter uploads it as the job's working_dir."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(cluster, f"train-{job.name}-spec", "TrainJob"),
            "data": {"train.yaml": to_yaml(job)}}


def ray_job(cluster: ClusterSpec, job: TrainJobSpec) -> dict:
    """A RayJob that runs `python -m pylon.jobs.train` on the cluster's RayCluster (clusterSelector): one
    autoscaling cluster for every job, not a cluster per job."""
    spec_dir = "/etc/pylon/job"
    submitter = {
        "name": "ray-job-submitter", "image": cluster.image,
        "env": _auth_env(cluster),
        # subPath: a plain file, not the ConfigMap's symlink farm, so the working_dir upload holds just it.
        "volumeMounts": [{"name": "spec", "mountPath": f"{spec_dir}/train.yaml", "subPath": "train.yaml",
                          "readOnly": True}],
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
    }
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": _metadata(cluster, f"train-{job.name}", "TrainJob"),
        "spec": {
            "clusterSelector": {"ray.io/cluster": cluster.name},
            "submissionMode": "K8sJobMode",
            "entrypoint": "python -m pylon.jobs.train --config train.yaml",
            "runtimeEnvYAML": yaml.safe_dump({"working_dir": spec_dir}, sort_keys=False),
            # The same metadata `pylon train` attaches, so `pylon jobs list` names it.
            "metadata": {"pylon_kind": "TrainJob", "pylon_name": job.name},
            "backoffLimit": 0,
            "submitterPodTemplate": {"spec": {
                "restartPolicy": "Never", "containers": [submitter],
                "volumes": [{"name": "spec", "configMap": {"name": f"train-{job.name}-spec"}}],
            }},
        },
    }


def serve_config(dep: DeploymentSpec) -> dict:
    """Ray Serve's config file for `dep`: the application builder and the spec as its args."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [{"name": dep.name, "import_path": "pylon.serving.app:app_builder",
                          "route_prefix": dep.http.route_prefix, "args": dep.model_dump(mode="json")}],
    }


def api_keys_secret_name(dep: DeploymentSpec) -> str:
    return f"{dep.name}-api-keys"


def ray_service(cluster: ClusterSpec, dep: DeploymentSpec) -> dict:
    head_env = []
    if dep.http.api_keys_env:
        # The builder runs on the head and hands replicas only the keys' digests; the keys come from a Secret.
        head_env.append({"name": dep.http.api_keys_env, "valueFrom": {"secretKeyRef": {
            "name": api_keys_secret_name(dep), "key": "keys"}}})
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": _metadata(cluster, dep.name, "Deployment"),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(dep), sort_keys=False),
            "rayClusterConfig": ray_cluster_spec(cluster, head_env=head_env),
        },
    }


# ---------------------------------------------------------------------------------------------------------
# Image and observability
# ---------------------------------------------------------------------------------------------------------


def dockerfile(cluster: ClusterSpec) -> str:
    ray_version = importlib.metadata.version("ray")
    gpu = any(g.gpus for g in [cluster.head, *cluster.worker_groups])
    base = f"rayproject/ray:{ray_version}-{PYTHON_TAG}" + ("-gpu" if gpu else "")
    return f"""\
# Rendered by `pylon infra render` from Cluster '{cluster.name}' (pylon {__version__}); edit the spec and
# re-render rather than this file. The cluster image: Ray {ray_version} and Pylon with its tested pins.
# Build it from the repository root:  docker build -f <this file> -t {cluster.image} .
FROM {base}

# libaio for DeepSpeed's NVMe offload; TCMalloc, which a CPU serving engine's process preloads (pylon.serving.heap;
# libtcmalloc-minimal4t64 on Ubuntu 24.04).
RUN sudo apt-get update -qq \\
    && (sudo apt-get install -y -qq --no-install-recommends libaio-dev libtcmalloc-minimal4 \\
        || sudo apt-get install -y -qq --no-install-recommends libaio-dev libtcmalloc-minimal4t64) \\
    && sudo rm -rf /var/lib/apt/lists/*

WORKDIR {SOURCE_DIR}
COPY --chown=ray:users pyproject.toml README.md constraints.txt ./
COPY --chown=ray:users platform/ platform/
COPY --chown=ray:users data/ data/
COPY --chown=ray:users jobs/ jobs/
COPY --chown=ray:users serving/ serving/
# constraints.txt pins every distribution to the versions the test suite ran with.
RUN pip install --no-cache-dir -c constraints.txt . && python -c "import pylon; print('pylon', pylon.__version__)"

WORKDIR {NODE_HOME}
# Ray's token auth stays on: the token arrives at run time (a mounted file or a Secret), never in the image.
ENV RAY_AUTH_MODE=token
"""


def prometheus_config(cluster: ClusterSpec, target: str) -> dict:
    if target == "ray-up":
        # Ray's head writes every node's metrics endpoint to this file and keeps it current as nodes come and go.
        scrape = {"job_name": "ray", "file_sd_configs": [
            {"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}]}
    else:
        scrape = {
            "job_name": "ray",
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [cluster.provider.namespace]}}],
            "relabel_configs": [
                # Every Ray pod KubeRay makes (the RayCluster's and each RayService's), on its metrics port.
                {"source_labels": ["__meta_kubernetes_pod_label_ray_io_is_ray_node"], "regex": "yes",
                 "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
                 "action": "keep"},
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
        return [{"expr": f"histogram_quantile({p}, sum by (le, model) (rate(ray_{metric}_bucket[5m])))",
                 "legendFormat": f"{{{{model}}}} p{int(p * 100)}", "refId": ref}
                for p, ref in ((0.5, "A"), (0.99, "B"))]

    panels_spec = [
        ("Serving", None, None),
        ("Time to first token", "s", quantiles("pylon_time_to_first_token_seconds")),
        ("Inter-token latency", "s", quantiles("pylon_inter_token_latency_seconds")),
        ("End-to-end request latency", "s", quantiles("pylon_e2e_request_latency_seconds")),
        ("Queue time", "s", quantiles("pylon_request_queue_time_seconds")),
        ("Requests running / waiting", "short", [
            q("sum by (model) (ray_pylon_num_requests_running)", "{{model}} running"),
            {**q("sum by (model) (ray_pylon_num_requests_waiting)", "{{model}} waiting"), "refId": "B"}]),
        ("KV cache usage", "percentunit", [q("max by (model) (ray_pylon_kv_cache_usage_ratio)", "{{model}}")]),
        ("Tokens per second", "short", [
            q("sum by (model) (rate(ray_pylon_generation_tokens_total[1m]))", "{{model}} generated"),
            {**q("sum by (model) (rate(ray_pylon_prompt_tokens_total[1m]))", "{{model}} prompt"), "refId": "B"}]),
        ("Requests per second by status", "reqps", [
            q("sum by (model, status) (rate(ray_pylon_requests_total[1m]))", "{{model}} {{status}}")]),
        ("Training and cluster", None, None),
        ("GPU utilization", "percent", [
            q("avg by (ip, GpuIndex) (ray_node_gpus_utilization)", "{{ip}} GPU {{GpuIndex}}")]),
        ("GPU memory used", "bytes", [q("sum by (ip, GpuIndex) (ray_node_gram_used)", "{{ip}} GPU {{GpuIndex}}")]),
        ("CPU utilization by node", "percent", [q("avg by (ip) (ray_node_cpu_utilization)", "{{ip}}")]),
        ("Host memory used by node", "bytes", [q("sum by (ip) (ray_node_mem_used)", "{{ip}}")]),
        ("Active nodes by type (autoscaler)", "short", [
            q("sum by (node_type) (ray_cluster_active_nodes)", "{{node_type}}")]),
    ]
    panels, y, x = [], 0, 0
    for i, (title, unit, targets) in enumerate(panels_spec, start=1):
        if targets is None:
            y += 8 if x else 0
            panels.append({"id": i, "type": "row", "title": title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y, x = y + 1, 0
            continue
        panels.append({"id": i, "type": "timeseries", "title": title, "datasource": {"uid": "${datasource}"},
                       "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                       "targets": targets, "gridPos": {"h": 8, "w": 12, "x": x, "y": y}})
        x = 12 - x
        if x == 0:
            y += 8
    return {
        "title": f"Pylon: {cluster.name}", "uid": f"pylon-{cluster.name}"[:40], "schemaVersion": 39,
        "tags": ["pylon", "ray"], "timezone": "browser", "refresh": "30s", "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


# ---------------------------------------------------------------------------------------------------------
# Offline validation
# ---------------------------------------------------------------------------------------------------------

_CRD_SCHEMAS = {"RayCluster": "raycluster", "RayJob": "rayjob", "RayService": "rayservice"}


@functools.cache
def _validator(name: str):
    import jsonschema

    if name == "ray-up":
        import importlib.util

        # Found without importing ray (seconds): the schema ships in the wheel next to the autoscaler.
        path = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler" / "ray-schema.json"
    else:
        path = Path(__file__).parent / "schemas" / "kuberay" / f"{name}.schema.json"
    schema = json.loads(path.read_text())
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


def validate_manifest(doc: dict) -> list[str]:
    """Schema errors of one rendered document: a launcher config, or a RayCluster / RayJob / RayService."""
    if "cluster_name" in doc:
        validator = _validator("ray-up")
    elif doc.get("kind") in _CRD_SCHEMAS:
        validator = _validator(_CRD_SCHEMAS[doc["kind"]])
    else:
        return []
    problems = [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
                for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    if doc.get("kind") == "RayService" and not problems:
        problems += _serve_config_problems(doc["spec"]["serveConfigV2"])
    return problems


def _serve_config_problems(text: str) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        return [f"spec.serveConfigV2: {err['loc']}: {err['msg']}" for err in e.errors()]
    return []


def validate_files(files: Files) -> list[str]:
    """Every schema problem of every YAML file in a render, as 'file: document N (Kind): path: message'."""
    problems = []
    for name, text in sorted(files.items()):
        if not name.endswith((".yaml", ".yml")) or name == "prometheus.yml":
            continue
        for index, doc in enumerate(yaml.safe_load_all(text), start=1):
            if not isinstance(doc, dict):
                continue
            label = doc.get("kind") or "ray cluster launcher config"
            problems += [f"{name}: document {index} ({label}): {p}" for p in validate_manifest(doc)]
    return problems


# ---------------------------------------------------------------------------------------------------------
# YAML output
# ---------------------------------------------------------------------------------------------------------


def _header(cluster: ClusterSpec, use: str) -> str:
    return (f"# Rendered by `pylon infra render` from Cluster '{cluster.name}' (pylon {__version__}); edit the\n"
            f"# spec and re-render rather than this file. Use: {use}{'' if use.endswith('=') else ' '}<this file>\n")


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper, data: str):
    # Multi-line strings (serveConfigV2, runtimeEnvYAML, a spec in a ConfigMap) as readable literal blocks.
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def _dump(*docs: dict, header: str = "") -> str:
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120,
                                  explicit_start=len(docs) > 1)
