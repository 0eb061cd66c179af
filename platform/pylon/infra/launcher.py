"""`ray up` launcher configs for AWS and GCP (`pylon infra render --target ray-up`), and the node image's Dockerfile."""

from __future__ import annotations

import importlib.metadata
import shlex

from pylon.errors import SpecError
from pylon.infra.common import (
    HAPROXY_WRAPPER_PATH,
    METRICS_PORT,
    NODE_HOME,
    RAY_PORT,
    RENDERED_SERVE_ENV,
    SOURCE_DIR,
    TASK_MEMORY_SHARE,
    TOKEN_PATH,
)
from pylon.specs import ClusterSpec, NodeShape, WorkerGroupSpec
from pylon.version import __version__

# The Ray images are published per Python minor version; Pylon's tested one (constraints.txt) is 3.11.
PYTHON_TAG = "py311"
ROOT_DISK_GB = 256


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


def launcher_config(cluster: ClusterSpec) -> dict:
    provider = cluster.provider
    if provider.type == "aws":
        provider_cfg = {
            "type": "aws",
            "region": provider.region,
            # Terminate idle nodes instead of stopping them: stopped nodes still pay for their disks.
            "cache_stopped_nodes": False,
        }
        if provider.zone:
            provider_cfg["availability_zone"] = provider.zone
    else:
        provider_cfg = {
            "type": "gcp",
            "region": provider.region,
            "availability_zone": provider.zone,
            "project_id": provider.project_id,
        }
    node_types = {
        "head": {
            "resources": _launcher_resources(cluster.head),
            "node_config": _node_config(cluster, cluster.head),
            "min_workers": 0,
            "max_workers": 0,
        }
    }
    for group in cluster.worker_groups:
        node_type = {
            "resources": _launcher_resources(group),
            "node_config": _node_config(cluster, group, group),
            "min_workers": group.min_workers,
            "max_workers": group.max_workers,
        }
        if group.gpu_type:
            node_type["labels"] = {"ray.io/accelerator-type": group.gpu_type}
        node_types[group.name] = node_type
    serve_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in RENDERED_SERVE_ENV.items())  # a value may hold spaces
    env = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={TOKEN_PATH} {serve_env}; ulimit -n 65536"
    return {
        "cluster_name": cluster.name,
        "max_workers": sum(g.max_workers for g in cluster.worker_groups),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cluster.idle_timeout_minutes,
        "docker": {
            "image": cluster.image,
            "container_name": "pylon",
            "pull_before_run": True,
            "run_options": ["--ulimit nofile=65536:65536"],
        },
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
        config = {
            "InstanceType": shape.instance_type,
            "BlockDeviceMappings": [
                {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": ROOT_DISK_GB, "VolumeType": "gp3"}}
            ],
        }
        if spot:
            # One-time spot requests, terminated on interruption: Ray Train restarts from the last checkpoint.
            config["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        return config
    config = {
        "machineType": shape.instance_type,
        "disks": [
            {
                "boot": True,
                "autoDelete": True,
                "type": "PERSISTENT",
                "initializeParams": {"diskSizeGb": ROOT_DISK_GB, "sourceImage": GCP_SOURCE_IMAGE},
            }
        ],
    }
    scheduling: dict = {}
    if shape.gpus:
        accelerator = GCP_ACCELERATORS.get(shape.gpu_type or "")
        if accelerator is None:
            where = f"worker_groups '{group.name}'" if group else "head"
            raise SpecError(
                [
                    f"Cluster '{cluster.name}': {where}.gpu_type: GCP needs one of "
                    f"{', '.join(GCP_ACCELERATORS)} (got {shape.gpu_type!r})"
                ]
            )
        config["guestAccelerators"] = [{"acceleratorType": accelerator, "acceleratorCount": shape.gpus}]
        scheduling["onHostMaintenance"] = "TERMINATE"  # GPU VMs cannot live-migrate
    if spot:
        scheduling.update({"preemptible": True, "automaticRestart": False, "onHostMaintenance": "TERMINATE"})
    if scheduling:
        config["scheduling"] = scheduling
    return config


def dockerfile(cluster: ClusterSpec) -> str:
    ray_version = importlib.metadata.version("ray")
    gpu = any(g.gpus for g in [cluster.head, *cluster.worker_groups])
    base = f"rayproject/ray:{ray_version}-{PYTHON_TAG}" + ("-gpu" if gpu else "")
    return f"""\
# Rendered by `pylon infra render` from Cluster '{cluster.name}' (pylon {__version__}); edit the spec and
# re-render rather than this file. The cluster image: Ray {ray_version} and Pylon with its tested pins.
# Build it from the repository root:  docker build -f <this file> -t {cluster.image} .
FROM {base}

# libaio for DeepSpeed's NVMe offload; TCMalloc, which a CPU serving engine's process preloads (serving/engine/heap.py;
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
# Serve's HAProxy through pylon-haproxy (RAY_SERVE_HAPROXY_BINARY_PATH): its stats and metrics listeners on loopback.
RUN sudo ln -sf "$(command -v pylon-haproxy)" {HAPROXY_WRAPPER_PATH}

WORKDIR {NODE_HOME}
# Ray's token auth stays on: the token arrives at run time (a mounted file or a Secret), never in the image.
ENV RAY_AUTH_MODE=token
"""
