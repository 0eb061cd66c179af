"""A Cluster spec's `ha` (GCS fault tolerance): checked per provider, rendered as KubeRay's gcsFaultToleranceOptions
(the Redis password from a Secret, never in the manifest) on the RayCluster, the RayService's cluster and a RayJob's
own cluster, each valid against the KubeRay CRD; the local side's records and messages carry no password."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from pylon import infra
from pylon.errors import ClusterError, SpecError
from pylon.infra import ha
from pylon.infra.schema import validate_manifest
from pylon.specs import ClusterSpec, load_specs, parse_specs

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "platform" / "pylon" / "examples"
HA = {"redis_address": "redis.ray-system.svc:6379", "redis_password_secret": "ray-redis"}


def k8s(ha_spec: dict | None = HA, **job_queue):
    docs = load_specs(EXAMPLES / "cluster-k8s.yaml")
    data = docs[0].spec.model_dump(mode="json", exclude_none=True)
    if ha_spec is not None:
        data["ha"] = ha_spec
    job, dep = docs[1].spec, docs[2].spec
    if job_queue:
        job = job.model_copy(update={"queue": job.queue.model_copy(update=job_queue)})
    return ClusterSpec.model_validate(data), job, dep


def _docs(files: dict) -> list[dict]:
    return [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_ha_renders_gcs_fault_tolerance_with_the_password_from_a_secret_on_every_cluster() -> None:
    cluster, job, dep = k8s(kueue_queue="team-a")  # a queued RayJob brings a cluster of its own
    docs = _docs(infra.render(cluster, "kuberay", jobs=[job], deployments=[dep]))
    specs = {
        "RayCluster": lambda d: d["spec"],
        "RayService": lambda d: d["spec"]["rayClusterConfig"],
        "RayJob": lambda d: d["spec"]["rayClusterSpec"],
    }
    seen = []
    for doc in docs:
        if doc["kind"] not in specs:
            continue
        seen.append(doc["kind"])
        assert validate_manifest(doc) == [], doc["kind"]
        assert specs[doc["kind"]](doc)["gcsFaultToleranceOptions"] == {
            "redisAddress": "redis.ray-system.svc:6379",
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "ray-redis", "key": "password"}}},
        }
        # KubeRay names the storage namespace after each RayCluster's UID: a RayService's new cluster starts clean.
        assert "externalStorageNamespace" not in specs[doc["kind"]](doc)["gcsFaultToleranceOptions"]
    assert sorted(seen) == ["RayCluster", "RayJob", "RayService"]


def test_without_ha_nothing_changes() -> None:
    cluster, _, _ = k8s(None)
    assert cluster.ha is None
    assert "gcsFaultToleranceOptions" not in infra.kuberay.ray_cluster(cluster)["spec"]


def test_another_key_of_the_secret() -> None:
    cluster, _, _ = k8s({**HA, "redis_password_key": "redis-password"})
    options = infra.kuberay.ray_cluster(cluster)["spec"]["gcsFaultToleranceOptions"]
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"


@pytest.mark.parametrize(
    ("provider", "ha_spec", "problem"),
    [
        ("kubernetes", {}, "ha.redis_address: required for provider type 'kubernetes'"),
        ("kubernetes", {"redis_address": "r:6379"}, "ha.redis_password_secret: required"),
        ("kubernetes", {**HA, "redis_address": "redis-no-port"}, "redis_address: must be HOST:PORT"),
        ("local", {"redis_address": "127.0.0.1:6379"}, "ha.redis_address: not for provider type 'local'"),
        ("aws", {}, "ha: GCS fault tolerance runs on provider types 'local' and 'kubernetes', not 'aws'"),
    ],
)
def test_ha_is_checked_per_provider(provider: str, ha_spec: dict, problem: str) -> None:
    data = {"kind": "Cluster", "name": "c", "provider": {"type": provider}, "ha": ha_spec}
    if provider == "aws":
        data["provider"]["region"] = "us-east-1"
        data["head"] = {"instance_type": "m5.xlarge"}
    with pytest.raises(ValueError) as e:  # pydantic's ValidationError; `load_spec` makes it a SpecError
        ClusterSpec.model_validate(data)
    assert problem in str(e.value)
    with pytest.raises(SpecError, match="ha"):
        parse_specs(yaml.safe_dump(data), "cluster.yaml")


def test_a_local_cluster_turns_ha_on_with_an_empty_mapping() -> None:
    spec = ClusterSpec.model_validate({"kind": "Cluster", "name": "c", "ha": {}})
    assert spec.ha is not None and spec.ha.redis_address is None
    ok = ClusterSpec.model_validate({"kind": "Cluster", "name": "c", "provider": {"type": "kubernetes"}, "ha": HA})
    assert ok.ha.redis_address == HA["redis_address"]
    assert ClusterSpec.model_validate({"kind": "Cluster", "name": "c"}).ha is None


def test_without_redis_server_ha_fails_naming_the_package(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ClusterError, match=r"`redis-server` package.*apt-get install -y redis-server"):
        ha.redis_server()
    from pylon.infra import local

    with pytest.raises(ClusterError, match="redis-server"):
        local.up(home=tmp_path / "home", ha=True)
    assert not (tmp_path / "home" / "cluster.json").exists()


@pytest.mark.skipif(shutil.which(ha.REDIS_PACKAGE) is None, reason="the redis-server package is not installed")
def test_redis_starts_on_loopback_with_a_password_kept_in_0600_files_only(tmp_path) -> None:
    from pylon.infra.local import _free_port

    home = tmp_path / "home"
    record = ha.start_redis(home, _free_port())
    try:
        password = (home / ha.PASSWORD_FILE).read_text()
        host, port = record.redis_address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert ha.redis_ping(host, int(port), password) is None
        assert "WRONGPASS" in (ha.redis_ping(host, int(port), "not-it") or "")
        for name in (ha.PASSWORD_FILE, ha.REDIS_CONF):
            assert (home / name).stat().st_mode & 0o777 == 0o600
        assert password not in (home / ha.HA_FILE).read_text()
        assert password not in " ".join(ha.psutil.Process(record.redis_pid).cmdline())
        assert json.loads((home / ha.HA_FILE).read_text())["redis_address"] == record.redis_address
        assert record.summary()["redis_running"] and password not in json.dumps(record.summary())
    finally:
        ha.stop(home)
    assert not ha._same_process(record.redis_pid, record.redis_started)
    assert not (home / ha.PASSWORD_FILE).exists() and not (home / ha.HA_FILE).exists()
