"""Autoscaling on one machine: `pylon cluster up --autoscale [CLUSTER.yaml]`.

Ray's autoscaler runs on the head (`ray start --head --autoscaling-config=...`) and launches the worker
groups of a `Cluster` spec as *logical* nodes: each one a raylet with its own resources, started as local
processes by Ray's fake multi-node provider and stopped again once idle for the spec's `idle_timeout_minutes`.
Everything above the raylet (scheduling, placement groups, Train, Serve, the autoscaler's own decisions) is
the same code that runs on a cloud fleet, so a job that asks for more than the head holds makes nodes appear
here exactly as it would make VMs appear there.

Ray keeps that provider's default config (`example.yaml`) out of its wheel, and `type: fake_multinode`
cannot start without it. Pylon writes the whole config itself (`$PYLON_HOME/autoscaler.yaml`, validated
against `ray-schema.json` like every launcher config Pylon renders) and names the provider class through Ray's
`type: external` hook: `LocalNodeProvider` below, Ray's provider with the head's GCS address filled in. The config
itself is built by
`pylon.infra.local_autoscaler_config`; this module is imported only by the autoscaler process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class LocalNodeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider, pointed at this cluster's head.

    Ray's provider joins new nodes to `<this machine's IP>:6379` unless told otherwise, and the GCS port of a
    Pylon cluster is only 6379 when that port was free. The head records the address it chose in its temp
    dir (`ray_current_cluster`); nodes are created only after the head is up, so it is read then.
    """

    def __init__(self, provider_config: dict[str, Any], cluster_name: str):
        super().__init__(provider_config, cluster_name)
        self._temp_dir = provider_config.get("temp_dir")

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        if not self._gcs_address and self._temp_dir:
            self._gcs_address = (Path(self._temp_dir) / "ray_current_cluster").read_text().strip()
        return super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
