"""The local autoscaler's config: `pylon cluster up --autoscale` adds and removes worker nodes on this machine
through Ray's fake multi-node provider (`pylon.infra.node_provider`)."""

from __future__ import annotations

import os

from pylon.infra.common import TASK_MEMORY_SHARE
from pylon.infra.launcher import _launcher_resources
from pylon.specs import ClusterSpec

LOCAL_HEAD_NODE_TYPE = "ray.head.default"  # the name Ray's fake multi-node provider gives the head
LOCAL_PROVIDER = "pylon.infra.node_provider.LocalNodeProvider"


# A logical node's object store when the spec does not give the group's memory: small, because every node
# of a local cluster shares this machine's /dev/shm.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
MIN_OBJECT_STORE_BYTES = 80 * 2**20  # Ray's own minimum


def local_autoscaler_config(cluster: ClusterSpec, *, temp_dir: str | os.PathLike) -> dict:
    """The autoscaling config `ray start --head --autoscaling-config` takes for a local cluster: the spec's
    worker groups as node types whose nodes are local processes (see pylon/autoscale.py)."""
    node_types: dict[str, dict] = {
        LOCAL_HEAD_NODE_TYPE: {
            "resources": {k: v for k, v in _launcher_resources(cluster.head).items() if k != "memory"},
            "node_config": {},
            "min_workers": 0,
            "max_workers": 0,
        },
    }
    for group in cluster.worker_groups:
        resources = {k: v for k, v in _launcher_resources(group).items() if k != "memory"}
        resources["object_store_memory"] = (
            max(MIN_OBJECT_STORE_BYTES, int(group.memory_gb * (1 - TASK_MEMORY_SHARE) * 2**30))
            if group.memory_gb
            else LOCAL_OBJECT_STORE_BYTES
        )
        node_types[group.name] = {
            "resources": resources,
            "node_config": {},
            "min_workers": group.min_workers,
            "max_workers": group.max_workers,
        }
    return {
        "cluster_name": cluster.name,
        "max_workers": sum(g.max_workers for g in cluster.worker_groups),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cluster.idle_timeout_minutes,
        "provider": {
            "type": "external",
            "module": LOCAL_PROVIDER,
            "temp_dir": str(temp_dir),
            # Logical nodes share this machine's IP: the autoscaler tells them apart by node id. There is
            # nothing to SSH into or set up, and no launch config that could drift.
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
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
