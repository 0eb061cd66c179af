"""pylon.specs: where errors point (file, line, document, field), files and YAML structure, and names."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from spec_texts import (
    CLUSTER,
    DATASET,
    DEPLOY,
    NAME_MSG,
    TRAIN,
    one_problem,
    problems,
)

from pylon.errors import SpecError
from pylon.specs import (
    DatasetSpec,
    load_specs,
    parse_specs,
)

# ---------------------------------------------------------------------------------------------------------
# Where errors point: file, line, document, field path; every error is reported
# ---------------------------------------------------------------------------------------------------------


def test_error_in_second_document_names_document_2_and_its_absolute_line() -> None:
    text = DATASET + "---\n" + TRAIN + "deepspeed:\n  zero_stage: 2\n  offload_param: cpu\n"
    assert one_problem(text) == (
        "spec.yaml:13: document 2 (TrainJob 'job'): deepspeed.offload_param: 'cpu' needs zero_stage 3 "
        "(got zero_stage 2)"
    )


def test_every_error_of_every_document_is_reported_in_order(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text(
        TRAIN
        + "precision: fp8\n"  # doc 1: line 6
        + "---\n"
        + DATASET  # doc 2: valid, lines 8-11
        + "---\n"
        + DEPLOY  # doc 3: lines 13-15
        + "engine:\n  max_num_seqs: 0\n  dtype: int8\n"  # lines 16-18
        + "autoscaling: {min_replicas: -1}\n"  # line 19
        + "colour: blue\n"  # line 20
        + "---\n"
        + CLUSTER.replace("name: c", "name: Bad_Name")  # doc 4: line 23
    )
    assert load_specs_problems(path) == [
        f"{path}:6: document 1 (TrainJob 'job'): precision: must be one of fp32, fp16, bf16 (got 'fp8')",
        f"{path}:17: document 3 (Deployment 'svc'): engine.max_num_seqs: must be greater than or equal to 1 (got 0)",
        f"{path}:18: document 3 (Deployment 'svc'): engine.dtype: must be one of auto, fp32, fp16, bf16 (got 'int8')",
        f"{path}:19: document 3 (Deployment 'svc'): autoscaling.min_replicas: must be greater than or equal to 0 "
        f"(got -1)",
        f"{path}:20: document 3 (Deployment 'svc'): colour: unknown field; allowed fields: kind, name, model, engine, "
        f"autoscaling, http, replica, prefill",
        f"{path}:23: document 4 (Cluster 'Bad_Name'): name: {NAME_MSG}, e.g. 'stdlib-gpt' (got 'Bad_Name')",
    ]


def load_specs_problems(path: Path | str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_specs(path)
    return info.value.problems


def test_missing_required_fields_point_at_the_document_start() -> None:
    text = DATASET + "---\n# a comment\nkind: TrainJob\nname: job\n"
    assert problems(text) == [
        "spec.yaml:7: document 2 (TrainJob 'job'): model: required field is missing",
        "spec.yaml:7: document 2 (TrainJob 'job'): data: required field is missing",
        "spec.yaml:7: document 2 (TrainJob 'job'): steps: required field is missing",
    ]


def test_line_numbers_in_block_style_nesting_and_lists() -> None:
    text = (
        "kind: Cluster\n"  # 1
        "name: c\n"  # 2
        "head:\n"  # 3
        "  cpus: 4\n"  # 4
        "  memory_gb: 0\n"  # 5
        "worker_groups:\n"  # 6
        "  - name: a\n"  # 7
        "    cpus: 2\n"  # 8
        "  -\n"  # 9
        "    name: b\n"  # 10
        "    spot: perhaps\n"  # 11
    )
    assert problems(text) == [
        "spec.yaml:5: document 1 (Cluster 'c'): head.memory_gb: must be greater than 0 (got 0)",
        "spec.yaml:11: document 1 (Cluster 'c'): worker_groups[1].spot: must be a valid boolean, unable to "
        "interpret input (got 'perhaps')",
    ]


def test_error_names_the_file_as_given(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "train.yaml"
    path.parent.mkdir()
    path.write_text(TRAIN + "steps2: 1\n")
    [problem] = load_specs_problems(path)
    assert problem.startswith(f"{path}:6: document 1 (TrainJob 'job'): steps2: unknown field")
    rel = os.path.relpath(path)
    [problem] = load_specs_problems(rel)
    assert problem.startswith(f"{rel}:6: ")


# ---------------------------------------------------------------------------------------------------------
# Files and YAML structure
# ---------------------------------------------------------------------------------------------------------


def test_yaml_syntax_error_is_one_problem_with_line_and_column() -> None:
    text = DATASET + "---\n" + TRAIN + "optim: {lr: 0.1\nbatch: [\n"
    [problem] = problems(text)
    assert re.fullmatch(r"spec\.yaml:\d+:\d+: YAML syntax error: .+", problem), problem
    assert one_problem("kind: Dataset\nname: x\n  sources: [a]\n") == (
        "spec.yaml:3:10: YAML syntax error: mapping values are not allowed here"
    )
    assert one_problem("kind: Dataset\nname: [unclosed\n") == (
        "spec.yaml:3:1: YAML syntax error: while parsing a flow sequence expected ',' or ']', but got '<stream end>'"
    )


def test_duplicate_keys_are_rejected_top_level_and_nested() -> None:
    assert one_problem(DATASET + "name: other\n") == "spec.yaml:5:1: YAML syntax error: duplicate key 'name'"
    assert one_problem(TRAIN + "optim: {lr: 0.1, lr: 0.2}\n") == (
        "spec.yaml:6:18: YAML syntax error: duplicate key 'lr'"
    )
    assert one_problem(CLUSTER + "worker_groups:\n  - name: a\n    cpus: 1\n    cpus: 2\n") == (
        "spec.yaml:6:5: YAML syntax error: duplicate key 'cpus'"
    )


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n", "---\n", "---\n---\n...\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert load_specs_problems(path) == [f"{path}: no documents (the file is empty)"]


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert load_specs_problems(missing) == [f"{missing}: no such file"]
    assert load_specs_problems(tmp_path) == [f"{tmp_path}: is a directory, not a YAML file"]


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"kind: Dataset\nname: caf\xe9\n")
    [problem] = load_specs_problems(path)
    assert problem.startswith(f"{path}: cannot read: ")


@pytest.mark.parametrize(
    "doc, expected",
    [
        (
            "- kind: Dataset\n- name: x\n",
            "must be a mapping with a 'kind' (Dataset, TrainJob, Deployment, BatchJob, Cluster), got list",
        ),
        ("42\n", "must be a mapping with a 'kind' (Dataset, TrainJob, Deployment, BatchJob, Cluster), got int"),
        ("just text\n", "must be a mapping with a 'kind' (Dataset, TrainJob, Deployment, BatchJob, Cluster), got str"),
        ("name: x\nsteps: 1\n", "kind: required; must be one of Dataset, TrainJob, Deployment, BatchJob, Cluster"),
        ("name: x\nkind: Job\n", "kind: must be one of Dataset, TrainJob, Deployment, BatchJob, Cluster (got 'Job')"),
        (
            "name: x\nkind: [TrainJob]\n",
            "kind: must be one of Dataset, TrainJob, Deployment, BatchJob, Cluster (got list)",
        ),
        (
            "name: x\nkind: {TrainJob: 1}\n",
            "kind: must be one of Dataset, TrainJob, Deployment, BatchJob, Cluster (got dict)",
        ),
    ],
    ids=["list", "int", "str", "no-kind", "unknown-kind", "list-kind", "mapping-kind"],
)
def test_document_shape_and_kind(doc: str, expected: str) -> None:
    # The bad document is the second one, on lines 6.. (the kind line is 7 where there is one).
    text = DATASET + "---\n" + doc
    line = 7 if "kind:" in doc and not doc.startswith("- ") else 6
    assert problems(text) == [f"spec.yaml:{line}: document 2: {expected}"]


def test_empty_documents_are_skipped_and_not_counted() -> None:
    text = "---\n---\n" + DATASET + "---\n\n---\n# only a comment\n---\n" + DEPLOY + "---\n"
    docs = parse_specs(text)
    assert [(d.index, d.line, d.spec.kind) for d in docs] == [(1, 3, "Dataset"), (2, 12, "Deployment")]
    broken = text.replace("model: runs/job/export/", "model: runs/job/export/\nbogus: 1")
    assert one_problem(broken).startswith("spec.yaml:15: document 2 (Deployment 'svc'): bogus: unknown field")


def test_recursive_yaml_alias_is_an_error_not_a_crash() -> None:
    assert one_problem(DATASET.replace("sources: [text/]", "sources: &s [text/, *s]")) == (
        "spec.yaml:3: document 1 (Dataset 'ds'): sources[1]: must be a valid string (got list)"
    )


@pytest.mark.timeout(30)
def test_alias_fan_out_does_not_explode() -> None:
    # Ten levels of nine aliases each would be 9**10 nodes if every alias were walked again.
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 11)]
    found = problems(DATASET + "\n".join(levels) + "\n")
    assert len(found) == 11 and all(": unknown field; allowed fields: " in p for p in found)
    assert found[-1].startswith("spec.yaml:15: document 1 (Dataset 'ds'): l10: unknown field")


# ---------------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------------

BAD_NAMES = [
    "Bad_Name",
    "../etc",
    "a" * 64,
    "-abc",
    "abc-",
    "a/b",
    "a\\b",
    ".",
    "..",
    "a.b",
    "",
    "abc\n",
    " abc",
    "ABC",
    "a b",
    "/etc/passwd",
    "~root",
    "é",
]
GOOD_NAMES = ["a", "0", "a" * 63, "stdlib-gpt", "0day", "a--b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n) for n in BAD_NAMES])
def test_bad_names_are_rejected(name: str) -> None:
    quoted = '"' + name.replace("\\", "\\\\").replace("\n", "\\n") + '"'
    [problem] = problems(TRAIN.replace("name: job", f"name: {quoted}"))
    assert problem.startswith("spec.yaml:2: document 1 (TrainJob ")
    assert f": name: {NAME_MSG}, e.g. 'stdlib-gpt' (got " in problem
    assert "\n" not in problem  # one line per problem, whatever the name holds
    with pytest.raises(ValidationError):
        DatasetSpec(name=name, sources=["a"], output="o")


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_are_accepted(name: str) -> None:
    assert DatasetSpec(name=name, sources=["a"], output="o").name == name


def test_worker_group_and_namespace_names_follow_the_same_rule() -> None:
    assert problems(CLUSTER + "provider: {namespace: ../kube-system}\nworker_groups:\n  - name: ../x\n") == [
        f"spec.yaml:3: document 1 (Cluster 'c'): provider.namespace: {NAME_MSG}, e.g. 'stdlib-gpt' "
        f"(got '../kube-system')",
        f"spec.yaml:5: document 1 (Cluster 'c'): worker_groups[0].name: {NAME_MSG}, e.g. 'stdlib-gpt' (got '../x')",
    ]


def test_accepted_names_never_escape_a_root(tmp_path: Path) -> None:
    root = (tmp_path / "runs").resolve()
    candidates = BAD_NAMES + GOOD_NAMES + ["..a", "a..", "%2e%2e", "a\x00b", "-", "--", "runs"]
    accepted = []
    for name in candidates:
        try:
            DatasetSpec(name=name, sources=["a"], output="o")
        except ValidationError:
            continue
        accepted.append(name)
        target = (root / name).resolve()
        assert target.parent == root and target.name == name
    assert sorted(accepted) == sorted(GOOD_NAMES + ["runs"])
