"""What travels with a job (pylon.sdk.ship) and which storage a cluster of several nodes can share
(pylon.jobs.run_dir.storage_problems): the rules, on real files, with no cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pylon import home
from pylon.errors import SpecError
from pylon.jobs.run_dir import every_node_reads, filesystem_type, storage_problems
from pylon.sdk import ship
from pylon.specs import BatchJobSpec, DatasetSpec, DeploymentSpec, TrainJobSpec

REMOTE = home.ClusterAddress("http://head:8265", shares_disk=False)
LOCAL = home.ClusterAddress("http://127.0.0.1:8265", shares_disk=True)


def _train(**over) -> TrainJobSpec:
    fields = {"name": "t", "model": {"preset": "gpt-tiny"}, "data": {"uri": "corpus"}, "steps": 4}
    fields.update(over)
    return TrainJobSpec.model_validate(fields)


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "corpus"
    (d / "shards").mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    (d / "shards" / "a.parquet").write_bytes(b"x" * 1000)
    return d


def test_local_paths_are_named_by_field_with_their_role() -> None:
    spec = _train(model={"path": "./model"}, checkpoint={"storage": "/runs"})
    assert [(p.field, p.value, p.output) for p in ship.local_paths(spec)] == [
        ("data.uri", "corpus", False),
        ("model.path", "./model", False),
        ("checkpoint.storage", "/runs", True),
    ]
    ds = DatasetSpec(name="d", sources=["a", "s3://b/c", "file:///x"], output="out", tokenizer="tok.json")
    assert [(p.field, p.output) for p in ship.local_paths(ds)] == [
        ("sources[0]", False),
        ("sources[2]", False),
        ("tokenizer", False),
        ("output", True),
    ]
    assert ship.local_paths(DatasetSpec(name="d", sources=["s3://b/a"], output="s3://b/o")) == []  # 'byte': no file


def test_for_a_remote_cluster_inputs_travel_in_the_working_dir_and_the_spec_names_the_copies(corpus) -> None:
    spec = _train(checkpoint={"storage": "s3://bucket/runs"})
    package = ship.package(spec, REMOTE, progress=False)
    try:
        assert package.spec.data.uri == "inputs/0-corpus" and package.shipped_bytes == 1002
        shipped = package.working_dir / "inputs" / "0-corpus"
        assert (shipped / "shards" / "a.parquet").read_bytes() == b"x" * 1000
        sent = yaml.safe_load((package.working_dir / ship.SPEC_FILE).read_text())
        assert sent["data"]["uri"] == "inputs/0-corpus" and sent["checkpoint"]["storage"] == "s3://bucket/runs"
        assert package.runtime_env == {"working_dir": str(package.working_dir)}
    finally:
        package.cleanup()
    assert not package.working_dir.exists()


def test_for_the_local_cluster_paths_are_made_absolute_and_nothing_is_copied(corpus) -> None:
    package = ship.package(_train(checkpoint={"storage": "runs"}), LOCAL, progress=False)
    try:
        assert package.spec.data.uri == str(corpus) and package.spec.checkpoint.storage == str(corpus.parent / "runs")
        assert package.shipped_bytes == 0 and sorted(os.listdir(package.working_dir)) == [ship.SPEC_FILE]
    finally:
        package.cleanup()


@pytest.mark.parametrize("where", [LOCAL, REMOTE], ids=["local", "remote"])
def test_grpo_reward_modules_in_the_submitting_directory_travel_with_the_job(corpus, where) -> None:
    (corpus.parent / "rewards_a.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    (corpus.parent / "pkg" / "sub").mkdir(parents=True)
    (corpus.parent / "pkg" / "__init__.py").write_text("")
    (corpus.parent / "pkg" / "sub" / "r.py").write_text("def g(**kw):\n    return []\n")
    (corpus.parent / "pkg" / "__pycache__").mkdir()
    (corpus.parent / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    rewards = [{"function": f} for f in ("exact_match", "rewards_a:f", "pkg.sub.r:g", "json:loads", "rewards_a:f")]
    spec = _train(objective="grpo", grpo={"rewards": rewards}, checkpoint={"storage": "s3://bucket/runs"})
    # built-ins and modules found elsewhere (installed, or the standard library's json) are not shipped; each once
    assert ship.reward_module_paths(spec) == [corpus.parent / "rewards_a.py", corpus.parent / "pkg"]
    assert ship.reward_module_paths(_train()) == []
    (corpus.parent / "judges.py").write_text("def prefer(prompts, completions):\n    return [0] * len(completions)\n")
    judged = _train(objective="online_dpo", grpo={"judge": "judges:prefer", "generations": 2})
    assert ship.reward_module_paths(judged) == [corpus.parent / "judges.py"]  # (online_dpo's judge travels too)
    package = ship.package(spec, where, progress=False)
    try:
        top = package.working_dir
        assert (top / "rewards_a.py").read_text().startswith("def f") and (top / "pkg" / "sub" / "r.py").is_file()
        assert not (top / "pkg" / "__pycache__").exists()
    finally:
        package.cleanup()


def test_a_grpo_reward_model_is_an_input(corpus) -> None:
    (corpus.parent / "rm").mkdir()
    (corpus.parent / "rm" / "config.json").write_text("{}")
    rewards = [{"function": "exact_match"}, {"model": "rm"}, {"model": "s3://bucket/rm"}]
    spec = _train(objective="grpo", grpo={"rewards": rewards}, checkpoint={"storage": "s3://bucket/runs"})
    assert [(p.field, p.value) for p in ship.local_paths(spec)] == [
        ("data.uri", "corpus"),
        ("grpo.rewards[1].model", "rm"),
    ]
    remote, local = ship.package(spec, REMOTE, progress=False), ship.package(spec, LOCAL, progress=False)
    try:
        assert [r.model for r in remote.spec.grpo.rewards] == [None, "inputs/1-rm", "s3://bucket/rm"]
        assert (remote.working_dir / "inputs" / "1-rm" / "config.json").read_text() == "{}"
        assert [r.model for r in local.spec.grpo.rewards] == [None, str(corpus.parent / "rm"), "s3://bucket/rm"]
    finally:
        remote.cleanup()
        local.cleanup()


def test_outputs_on_this_machine_are_refused_for_a_remote_cluster_naming_the_field(corpus) -> None:
    with pytest.raises(SpecError) as e:
        ship.package(_train(checkpoint={"storage": "/tmp/runs"}), REMOTE, progress=False)
    assert "TrainJob 't': checkpoint.storage: /tmp/runs is a path on this machine" in str(e.value)
    assert "s3://" in str(e.value)
    with pytest.raises(SpecError, match=r"checkpoint.storage: not set"):
        ship.package(_train(), REMOTE, default_runs=True, progress=False)
    with pytest.raises(SpecError, match=r"Dataset 'd': output: out is a path on this machine"):
        ship.package(DatasetSpec(name="d", sources=["s3://b/a"], output="out"), REMOTE, progress=False)


def test_missing_and_too_large_inputs_are_refused_before_anything_is_written(corpus, monkeypatch, tmp_path) -> None:
    with pytest.raises(SpecError, match=r"data.uri: nowhere does not exist on this machine"):
        ship.package(_train(data={"uri": "nowhere"}, checkpoint={"storage": "s3://b/r"}), REMOTE, progress=False)
    monkeypatch.setenv("PYLON_SHIP_LIMIT_MB", "0.0005")  # 524 bytes
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    with pytest.raises(SpecError) as e:
        ship.package(_train(checkpoint={"storage": "s3://b/r"}), REMOTE, progress=False)
    assert "data.uri (0.0 MiB)" in str(e.value) and "PYLON_SHIP_LIMIT_MB" in str(e.value)
    assert "object storage" in str(e.value)
    assert not {n for n in set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) - before if n.startswith("pylon-job-")}


def test_a_deployment_model_is_an_input() -> None:
    spec = DeploymentSpec(name="d", model="./model")
    assert [(p.field, p.output) for p in ship.local_paths(spec)] == [("model", False)]


def test_a_batch_jobs_model_and_input_travel_and_its_output_must_be_reachable(corpus) -> None:
    (corpus.parent / "requests.jsonl").write_text('{"prompt": "x"}\n')
    spec = BatchJobSpec(name="b", model="corpus", input="requests.jsonl", output="answers")
    assert [(p.field, p.output) for p in ship.local_paths(spec)] == [
        ("model", False),
        ("input", False),
        ("output", True),
    ]
    with pytest.raises(SpecError, match=r"BatchJob 'b': output: answers is a path on this machine"):
        ship.package(spec, REMOTE, progress=False)
    package = ship.package(spec.model_copy(update={"output": "s3://b/answers"}), REMOTE, progress=False)
    try:
        assert (package.spec.model, package.spec.input) == ("inputs/0-corpus", "inputs/1-requests.jsonl")
        assert (package.working_dir / "inputs" / "1-requests.jsonl").read_text() == '{"prompt": "x"}\n'
    finally:
        package.cleanup()


def test_several_nodes_refuse_one_machines_disk_but_not_object_storage_or_the_jobs_working_dir(tmp_path) -> None:
    fields = {"data.uri": "s3://b/corpus", "checkpoint.storage": str(tmp_path / "runs")}
    assert storage_problems(fields, 1) == []  # one node: its own disk is everyone's
    [problem] = storage_problems(fields, 2)
    assert problem.startswith(f"checkpoint.storage: {tmp_path / 'runs'} is a directory on one machine's own disk")
    assert "this cluster has 2 nodes" in problem and "s3://" in problem
    # Inside the job's working directory (relative, or absolute under it): every node has a copy.
    assert every_node_reads("inputs/0-corpus", working_dir=str(tmp_path))
    assert every_node_reads(str(tmp_path / "inputs" / "x"), working_dir=str(tmp_path))
    assert not every_node_reads(str(tmp_path / "inputs" / "x"))
    assert every_node_reads("s3://b/x") and not every_node_reads(f"file://{tmp_path}")


def test_the_filesystem_type_comes_from_the_deepest_mount_point() -> None:
    mounts = Path("/proc/mounts").read_text().split("\n")
    root_type = next(line.split()[2] for line in mounts if line.split()[1:2] == ["/"])
    assert filesystem_type("/") == root_type
    proc_type = next(line.split()[2] for line in mounts if line.split()[1:2] == ["/proc"])
    assert filesystem_type("/proc/self") == proc_type == "proc"
