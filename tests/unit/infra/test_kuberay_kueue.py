"""A TrainJob with `queue.kueue_queue` renders as a RayJob Kueue manages (KubeRay's and Kueue's RayJob guides):
queue and priority-class labels, suspended, a fixed-size cluster of its own; valid against the KubeRay CRD."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pylon import infra
from pylon.errors import SpecError
from pylon.infra.kuberay import ray_job
from pylon.infra.schema import validate_manifest
from pylon.specs import load_specs

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "platform" / "pylon" / "examples"
SHARED_CRD = REPO.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayjobs.yaml"


def cluster_and_job(**queue):
    docs = load_specs(EXAMPLES / "cluster-k8s.yaml")
    cluster, job = docs[0].spec, docs[1].spec
    job = job.model_copy(update={"queue": job.queue.model_copy(update=queue)})
    return cluster, job


def test_without_a_kueue_queue_the_rayjob_runs_on_the_shared_cluster() -> None:
    cluster, job = cluster_and_job()
    rayjob = ray_job(cluster, job)
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": "pylon-k8s"}
    assert "suspend" not in rayjob["spec"] and "rayClusterSpec" not in rayjob["spec"]
    assert not any(k.startswith("kueue.x-k8s.io/") for k in rayjob["metadata"]["labels"])


def test_a_kueue_queue_makes_a_suspended_rayjob_with_its_own_fixed_cluster() -> None:
    cluster, job = cluster_and_job(kueue_queue="team-a", kueue_priority_class="prod-priority")
    text = infra.render(cluster, "kuberay", jobs=[job])["rayjob-gpt-medium.yaml"]
    _, rayjob = yaml.safe_load_all(text)
    labels = rayjob["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert labels["kueue.x-k8s.io/priority-class"] == "prod-priority"
    spec = rayjob["spec"]
    # What Kueue's RayJob webhook requires of a job it manages.
    assert spec["suspend"] is True and spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec
    own = spec["rayClusterSpec"]
    assert own["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in own
    # 4 workers of {CPU: 8, GPU: 1}: one per A100 node (12 CPUs, 1 GPU); none of the CPU-only group.
    sizes = {g["groupName"]: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in own["workerGroupSpecs"]}
    assert sizes == {"cpu": (0, 0, 0), "a100": (4, 4, 4)}
    assert spec["entrypoint"] == "python -m pylon.jobs.train --config train.yaml"
    assert validate_manifest(rayjob) == []


def test_the_kueue_rayjob_passes_the_shared_kuberay_crd() -> None:
    import jsonschema

    if not SHARED_CRD.is_file():
        pytest.skip(f"{SHARED_CRD} is not here (the shared KubeRay CRDs)")
    crd = yaml.load(SHARED_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    cluster, job = cluster_and_job(kueue_queue="team-a")
    rayjob = ray_job(cluster, job)
    assert "kueue.x-k8s.io/priority-class" not in rayjob["metadata"]["labels"]  # Kueue's default priority then
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    assert [e.message for e in validator.iter_errors(rayjob)] == []


def test_cpu_workers_pack_onto_the_first_group_that_holds_them() -> None:
    cluster, job = cluster_and_job(kueue_queue="team-a")
    job = job.model_copy(
        update={
            "precision": "fp32",
            "scaling": job.scaling.model_copy(
                update={"use_gpu": False, "num_workers": 5, "resources_per_worker": {"CPU": 2}}
            ),
        }
    )
    groups = {
        g["groupName"]: g["replicas"] for g in ray_job(cluster, job)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    }
    assert groups == {"cpu": 2, "a100": 0}  # 4 workers per 8-CPU node: 2 nodes for 5


def test_a_worker_no_group_holds_is_refused() -> None:
    cluster, job = cluster_and_job(kueue_queue="team-a")
    job = job.model_copy(
        update={"scaling": job.scaling.model_copy(update={"resources_per_worker": {"CPU": 64, "GPU": 1}})}
    )
    with pytest.raises(SpecError, match="no worker group of Cluster 'pylon-k8s' holds one worker"):
        ray_job(cluster, job)
