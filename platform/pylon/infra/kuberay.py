"""KubeRay manifests: a RayCluster per Cluster spec, a RayJob per TrainJob, a RayService per Deployment."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence

import yaml

from pylon.errors import SpecError
from pylon.infra.common import DASHBOARD_PORT, METRICS_PORT, RAY_PORT, RENDERED_SERVE_ENV, SERVE_PORT, _memory_gb
from pylon.specs import ClusterSpec, DeploymentSpec, NodeShape, TrainJobSpec, WorkerGroupSpec, to_yaml
from pylon.version import __version__

# Kubernetes nodes that sell spare capacity, as each managed offering labels them (any one matches).
SPOT_NODE_LABELS = {
    "cloud.google.com/gke-spot": "true",  # GKE
    "eks.amazonaws.com/capacityType": "SPOT",  # EKS managed node groups
    "karpenter.sh/capacity-type": "spot",  # Karpenter (EKS, AKS)
}


# Listeners that answer without credentials on a node (docs/security.md): Ray's metrics exporter, the dashboard's
# and the autoscaler's metrics (Ray binds them to every interface), HAProxy's stats and Prometheus exporter.
OPEN_METRICS_PORTS = (METRICS_PORT, 44217, 44227, 8404, 9101)
# The label a namespace carries when its Prometheus may scrape those.
METRICS_NAMESPACE_LABEL = {"pylon.io/metrics": "scrape"}


def network_policy(cluster: ClusterSpec) -> dict:
    """Ingress to the cluster's pods: from each other on any port (Ray's nodes talk on ports of their choosing),
    from anywhere to the ports that check a credential (GCS, dashboard and Jobs API, Ray client: the cluster
    token; Serve: API keys), and to the unauthenticated metrics ports only from namespaces labelled
    `pylon.io/metrics: scrape`. Every other port of a pod is closed to the rest of the Kubernetes network."""
    pods = lambda: {"matchLabels": {"app.kubernetes.io/instance": cluster.name}}  # noqa: E731  (no YAML anchors)
    tcp = lambda port: {"protocol": "TCP", "port": port}  # noqa: E731
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(cluster, f"{cluster.name}-ingress", "Cluster"),
        "spec": {
            "podSelector": pods(),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": pods()}]},
                {"ports": [tcp(p) for p in (RAY_PORT, DASHBOARD_PORT, 10001, SERVE_PORT)]},
                {
                    "from": [{"namespaceSelector": {"matchLabels": METRICS_NAMESPACE_LABEL}}],
                    "ports": [tcp(p) for p in OPEN_METRICS_PORTS],
                },
            ],
        },
    }


def auth_secret_name(cluster: ClusterSpec) -> str:
    return f"{cluster.name}-ray-auth"


def ray_cluster(cluster: ClusterSpec) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(cluster, cluster.name, "Cluster"),
        "spec": ray_cluster_spec(cluster),
    }


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
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
        },
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)},
            "template": {
                "metadata": {"labels": _pod_labels(cluster, "head")},
                "spec": {
                    "containers": [_ray_container(cluster, "ray-head", head, head=True, extra_env=head_env)],
                    "volumes": [_shm_volume()],
                },
            },
        },
        "workerGroupSpecs": [_worker_group(cluster, g) for g in cluster.worker_groups],
        **gcs_fault_tolerance(cluster),
    }


def gcs_fault_tolerance(cluster: ClusterSpec) -> dict:
    """With `ha`: KubeRay's gcsFaultToleranceOptions, the GCS's tables in the user's Redis, its password from a
    Secret (never in the manifest). KubeRay then restarts the head's GCS with its pod, gives the GCS storage
    namespace the RayCluster's UID (a RayService's new cluster starts clean) and has workers wait for a GCS that
    comes back. Empty without `ha`."""
    if cluster.ha is None:
        return {}
    ha = cluster.ha
    return {
        "gcsFaultToleranceOptions": {
            "redisAddress": ha.redis_address,
            "redisPassword": {
                "valueFrom": {"secretKeyRef": {"name": ha.redis_password_secret, "key": ha.redis_password_key}}
            },
        }
    }


def _worker_group(cluster: ClusterSpec, group: WorkerGroupSpec) -> dict:
    pod: dict = {
        "containers": [_ray_container(cluster, "ray-worker", group)],
        "volumes": [_shm_volume()],
        # Autoscaler v2 replaces a failed worker pod itself; a kubelet restart would hide the failure.
        "restartPolicy": "Never",
    }
    tolerations = []
    if group.gpus:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    if group.spot:
        tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoSchedule"})
        pod["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
                        for key, value in SPOT_NODE_LABELS.items()
                    ]
                }
            }
        }
    if tolerations:
        pod["tolerations"] = tolerations
    spec = {
        "groupName": group.name,
        "replicas": group.min_workers,
        "minReplicas": group.min_workers,
        "maxReplicas": group.max_workers,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": {"metadata": {"labels": _pod_labels(cluster, group.name)}, "spec": pod},
    }
    if group.gpu_type:
        spec["labels"] = {"ray.io/accelerator-type": group.gpu_type}
    return spec


def _ray_container(
    cluster: ClusterSpec, name: str, shape: NodeShape, *, head: bool = False, extra_env: Sequence[dict] = ()
) -> dict:
    memory = f"{_memory_gb(shape):g}Gi"
    limits = {"cpu": str(shape.cpus), "memory": memory}
    if shape.gpus:
        limits["nvidia.com/gpu"] = str(shape.gpus)
    ports = [{"containerPort": METRICS_PORT, "name": "metrics"}]
    if head:
        ports = [
            {"containerPort": RAY_PORT, "name": "gcs-server"},
            {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": SERVE_PORT, "name": "serve"},
        ] + ports
    return {
        "name": name,
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        # Requests equal limits: a Ray node that is promised what it schedules by (Guaranteed QoS).
        "resources": {"requests": dict(limits), "limits": limits},
        # Serve's ingress (HAProxy in front of the replicas, see pylon.infra.local.SERVE_INGRESS_ENV) and its replicas'
        # handlers on their HTTP server's loop (SERVE_ENV) on every node.
        "env": _auth_env(cluster) + [{"name": k, "value": v} for k, v in RENDERED_SERVE_ENV.items()] + list(extra_env),
        "ports": ports,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _auth_env(cluster: ClusterSpec) -> list[dict]:
    # Said explicitly (KubeRay's authOptions does the same): the token only ever comes from the Secret.
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": auth_secret_name(cluster), "key": "auth_token"}},
        },
    ]


def _shm_volume() -> dict:
    # Ray's object store lives in /dev/shm; a container's default 64 MiB would spill everything to disk.
    return {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def _pod_labels(cluster: ClusterSpec, group: str) -> dict:
    return {"app.kubernetes.io/name": "pylon", "app.kubernetes.io/instance": cluster.name, "pylon.io/group": group}


def _metadata(cluster: ClusterSpec, name: str, kind: str) -> dict:
    return {
        "name": name,
        "namespace": cluster.provider.namespace,
        "labels": {
            "app.kubernetes.io/name": "pylon",
            "app.kubernetes.io/part-of": cluster.name,
            "app.kubernetes.io/version": __version__,
            "pylon.io/kind": kind,
        },
    }


def job_spec_configmap(cluster: ClusterSpec, job: TrainJobSpec) -> dict:
    """The TrainJob spec as a ConfigMap: the RayJob's submitter uploads it as the job's working_dir."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(cluster, f"train-{job.name}-spec", "TrainJob"),
        "data": {"train.yaml": to_yaml(job)},
    }


def ray_job(cluster: ClusterSpec, job: TrainJobSpec) -> dict:
    """A RayJob that runs `python -m pylon.jobs.train` on the cluster's RayCluster (clusterSelector): one
    autoscaling cluster for every job, not a cluster per job."""
    spec_dir = "/etc/pylon/job"
    submitter = {
        "name": "ray-job-submitter",
        "image": cluster.image,
        "env": _auth_env(cluster),
        # subPath: a plain file, not the ConfigMap's symlink farm, so the working_dir upload holds just it.
        "volumeMounts": [
            {"name": "spec", "mountPath": f"{spec_dir}/train.yaml", "subPath": "train.yaml", "readOnly": True}
        ],
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
    }
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(cluster, f"train-{job.name}", "TrainJob"),
        "spec": {
            "clusterSelector": {"ray.io/cluster": cluster.name},
            "submissionMode": "K8sJobMode",
            "entrypoint": "python -m pylon.jobs.train --config train.yaml",
            "runtimeEnvYAML": yaml.safe_dump({"working_dir": spec_dir}, sort_keys=False),
            # The same metadata `pylon train` attaches, so `pylon jobs list` names it.
            "metadata": {"pylon_kind": "TrainJob", "pylon_name": job.name},
            "backoffLimit": 0,
            "submitterPodTemplate": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [submitter],
                    "volumes": [{"name": "spec", "configMap": {"name": f"train-{job.name}-spec"}}],
                }
            },
        },
    }
    if job.queue.kueue_queue:
        _queue_in_kueue(rayjob, cluster, job)
    return rayjob


def _queue_in_kueue(rayjob: dict, cluster: ClusterSpec, job: TrainJobSpec) -> None:
    """Hand the RayJob to Kueue, as KubeRay's and Kueue's RayJob guides say: the LocalQueue and priority class as
    labels, created suspended (Kueue unsuspends it when its ClusterQueue has quota), and, since Kueue admits only
    what it can count, a RayCluster of its own of a fixed size (no clusterSelector, no autoscaler) that is
    deleted when the job ends."""
    labels = rayjob["metadata"]["labels"]
    labels["kueue.x-k8s.io/queue-name"] = job.queue.kueue_queue
    if job.queue.kueue_priority_class:
        labels["kueue.x-k8s.io/priority-class"] = job.queue.kueue_priority_class
    spec = rayjob["spec"]
    del spec["clusterSelector"]
    cluster_spec = ray_cluster_spec(cluster)
    cluster_spec["enableInTreeAutoscaling"] = False
    del cluster_spec["autoscalerOptions"]
    groups = _job_worker_groups(cluster, job)
    for group in cluster_spec["workerGroupSpecs"]:
        group["replicas"] = group["minReplicas"] = group["maxReplicas"] = groups.get(group["groupName"], 0)
    spec["rayClusterSpec"] = cluster_spec
    spec["shutdownAfterJobFinishes"] = True
    spec["suspend"] = True


def _job_worker_groups(cluster: ClusterSpec, job: TrainJobSpec) -> dict[str, int]:
    """Pods per worker group for the job's own cluster: enough nodes of the first group whose shape holds a
    worker (CPUs, GPUs) for `scaling.num_workers` of them."""
    per_worker = dict(job.scaling.resources_per_worker) or {"CPU": 1}
    cpus = per_worker.get("CPU", 0)
    gpus = per_worker.get("GPU", 1 if job.scaling.use_gpu else 0)
    for group in cluster.worker_groups:
        fit = [group.cpus // cpus if cpus else None, group.gpus // gpus if gpus else None]
        per_node = min((n for n in fit if n is not None), default=job.scaling.num_workers)
        if per_node >= 1:
            return {group.name: -(-job.scaling.num_workers // int(per_node))}
    raise SpecError(
        [
            f"TrainJob '{job.name}': no worker group of Cluster '{cluster.name}' holds one worker "
            f"({cpus:g} CPU, {gpus:g} GPU) for the RayJob's own cluster that Kueue admits"
        ]
    )


def serve_config(dep: DeploymentSpec) -> dict:
    """Ray Serve's config file for `dep`: the application builder and the spec as its args."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [
            {
                "name": dep.name,
                "import_path": "pylon.serving.api.builder:app_builder",
                "route_prefix": dep.http.route_prefix,
                "args": dep.model_dump(mode="json"),
            }
        ],
    }


def api_keys_secret_name(dep: DeploymentSpec) -> str:
    return f"{dep.name}-api-keys"


def ray_service(cluster: ClusterSpec, dep: DeploymentSpec) -> dict:
    head_env = []
    if dep.http.api_keys_env:
        # The builder runs on the head and hands replicas only the keys' digests; the keys come from a Secret.
        head_env.append(
            {
                "name": dep.http.api_keys_env,
                "valueFrom": {"secretKeyRef": {"name": api_keys_secret_name(dep), "key": "keys"}},
            }
        )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _metadata(cluster, dep.name, "Deployment"),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(dep), sort_keys=False),
            "rayClusterConfig": ray_cluster_spec(cluster, head_env=head_env),
        },
    }
