"""`pylon validate` and `pylon --help`, run as real processes (the module and the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pylon.specs

EXAMPLES = Path(pylon.specs.__file__).parent / "examples"

TRAIN = "kind: TrainJob\nname: job\nmodel: {preset: gpt-tiny}\ndata: {uri: corpus/}\nsteps: 10\n"
DATASET = "kind: Dataset\nname: ds\nsources: [text/]\noutput: corpus/\n"


def pylon_script() -> str:
    """The console script installed next to this interpreter (the venv's bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "pylon"
    found = str(beside) if beside.exists() else shutil.which("pylon")
    assert found, "the `pylon` console script is not installed"
    return found


def run(args: list[str], cwd: Path, *, script: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [pylon_script()] if script else [sys.executable, "-m", "pylon.cli"]
    env = {**os.environ, "PYLON_HOME": str(cwd / ".pylon-home")}
    result = subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    """good.yaml (two valid documents), bad.yaml (errors in two documents), cluster.yaml (a copy of the example)."""
    (tmp_path / "good.yaml").write_text(DATASET + "---\n" + TRAIN)
    (tmp_path / "bad.yaml").write_text(
        TRAIN
        + "deepspeed: {zero_stage: 5}\n"  # line 6, document 1
        + "---\n"
        + DATASET
        + "format: csv\n"  # line 12, document 2
        + "colour: blue\n"  # line 13
    )
    shutil.copy(EXAMPLES / "cluster-aws.yaml", tmp_path / "cluster.yaml")
    return tmp_path


BAD_ERRORS = [
    "bad.yaml:6: document 1 (TrainJob 'job'): deepspeed.zero_stage: must be one of 0, 1, 2, 3 (got 5)",
    "bad.yaml:12: document 2 (Dataset 'ds'): format: must be one of parquet, webdataset (got 'csv')",
    "bad.yaml:13: document 2 (Dataset 'ds'): colour: unknown field; allowed fields: kind, name, sources, output, "
    "format, seq_len, tokenizer, include, exclude, shard_size_mb, chat, prompt_completion, preference, prompts, packing",
]


def test_valid_files_exit_0_with_one_ok_line_per_document(specs: Path) -> None:
    result = run(["validate", "good.yaml", "cluster.yaml"], specs)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "ok  good.yaml: document 1: Dataset 'ds': 1 source(s) -> corpus/ (parquet, seq_len 256, tokenizer byte)",
        "ok  good.yaml: document 2: TrainJob 'job': preset gpt-tiny, 1 CPU worker(s), ZeRO-2, fp32, "
        "10 steps x 8 sequences, data corpus/, checkpoints -> $PYLON_HOME/runs every 200",
        "ok  cluster.yaml: document 1: Cluster 'pylon-aws': provider aws, head 8 CPU, cpu 0-4x(16 CPU), "
        "a100 0-2x(96 CPU, 8 A100-40GB)",
    ]


def test_bundled_examples_validate_with_the_installed_console_script(tmp_path: Path) -> None:
    result = run(["validate", *sorted(str(p) for p in EXAMPLES.glob("*.yaml"))], tmp_path, script=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 9 and all(line.startswith("ok  ") for line in lines)
    # cluster-aws, cluster-gcp, cluster-k8s (with the TrainJob and Deployment it runs), cluster-local, stdlib-gpt
    assert [line.split(": ")[2].split(" '")[0] for line in lines] == [
        "Cluster",
        "Cluster",
        "Cluster",
        "TrainJob",
        "Deployment",
        "Cluster",
        "Dataset",
        "TrainJob",
        "Deployment",
    ]


def test_broken_file_exits_1_with_every_error_on_stderr(specs: Path) -> None:
    result = run(["validate", "bad.yaml"], specs)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"error  {e}" for e in BAD_ERRORS] + ["3 error(s) in 1 file(s)"]


def test_broken_file_with_the_console_script(specs: Path) -> None:
    result = run(["validate", "bad.yaml"], specs, script=True)
    assert result.returncode == 1
    assert result.stderr.splitlines()[:3] == [f"error  {e}" for e in BAD_ERRORS]


def test_missing_file(specs: Path) -> None:
    result = run(["validate", "nope.yaml"], specs)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["error  nope.yaml: no such file", "1 error(s) in 1 file(s)"]


def test_good_and_bad_files_together(specs: Path) -> None:
    (specs / "syntax.yaml").write_text("kind: Dataset\nname: [x\n")
    result = run(["validate", "good.yaml", "bad.yaml", "nope.yaml", "syntax.yaml", "cluster.yaml"], specs)
    assert result.returncode == 1
    ok = result.stdout.splitlines()
    assert [line.split(": document ")[0] for line in ok] == ["ok  good.yaml", "ok  good.yaml", "ok  cluster.yaml"]
    errors = result.stderr.splitlines()
    assert errors[:4] == [f"error  {e}" for e in BAD_ERRORS] + ["error  nope.yaml: no such file"]
    assert errors[4].startswith("error  syntax.yaml:3:1: YAML syntax error: ")
    assert errors[5:] == ["5 error(s) in 5 file(s)"]


def test_json_output(specs: Path) -> None:
    result = run(["validate", "--json", "good.yaml", "bad.yaml", "cluster.yaml"], specs)
    assert result.returncode == 1
    assert result.stderr == ""
    assert json.loads(result.stdout) == {
        "valid": [
            {"file": "good.yaml", "document": 1, "kind": "Dataset", "name": "ds"},
            {"file": "good.yaml", "document": 2, "kind": "TrainJob", "name": "job"},
            {"file": "cluster.yaml", "document": 1, "kind": "Cluster", "name": "pylon-aws"},
        ],
        "errors": BAD_ERRORS,
    }
    result = run(["validate", "good.yaml", "--json"], specs)
    assert result.returncode == 0
    assert json.loads(result.stdout)["errors"] == []


def test_problem_input_that_once_crashed_is_reported_not_raised(specs: Path) -> None:
    # A kind that is a list, a recursive alias, an alias fan-out of 9**10 nodes, a name with a newline.
    (specs / "odd.yaml").write_text(
        "kind: [TrainJob]\n---\n"
        + DATASET.replace("sources: [text/]", "sources: &s [text/, *s]")
        + "---\n"
        + DATASET.replace("name: ds", 'name: "ds\\n"')
    )
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 11)]
    (specs / "bomb.yaml").write_text(DATASET + "\n".join(levels) + "\n")
    result = run(["validate", "odd.yaml", "bomb.yaml"], specs)  # run() times out after 60 s
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert errors[:3] == [
        "error  odd.yaml:1: document 1: kind: must be one of Dataset, TrainJob, Deployment, BatchJob, Cluster (got list)",
        "error  odd.yaml:5: document 2 (Dataset 'ds'): sources[1]: must be a valid string (got list)",
        "error  odd.yaml:9: document 3 (Dataset 'ds\\n'): name: must be 1-63 lowercase letters, digits or '-', "
        "starting and ending with a letter or digit, e.g. 'stdlib-gpt' (got 'ds\\n')",
    ]
    assert len(errors) == 3 + 11 + 1 and errors[-1] == "14 error(s) in 2 file(s)"
    assert all(line.startswith("error  bomb.yaml:") and ": unknown field;" in line for line in errors[3:-1])


def test_secret_values_never_reach_the_output(specs: Path) -> None:
    secret = "AKIA-SUPER-SECRET-123"
    (specs / "leak.yaml").write_text(
        TRAIN
        + f"aws_secret_access_key: {secret}\n---\n"
        + f"kind: Deployment\nname: svc\nmodel: m/\nhttp: {{api_keys_env: 'sk-{secret}'}}\n"
    )
    for args in (["validate", "leak.yaml"], ["validate", "--json", "leak.yaml"]):
        result = run(args, specs)
        assert result.returncode == 1
        output = result.stdout + result.stderr
        assert "aws_secret_access_key: unknown field" in output and "http.api_keys_env: " in output
        assert secret not in output


def test_help_lists_the_commands(tmp_path: Path) -> None:
    result = run(["--help"], tmp_path, script=True)
    assert result.returncode == 0
    assert result.stdout.startswith("usage: pylon ")
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ")]
    assert {"validate", "cluster", "demo"} <= set(listed)
    result = run(["validate", "--help"], tmp_path)
    assert result.returncode == 0
    assert "--json" in result.stdout and "pylon validate train.yaml serve.yaml" in result.stdout


def test_validate_without_files_is_a_usage_error(tmp_path: Path) -> None:
    result = run(["validate"], tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: pylon validate ")
    assert "the following arguments are required: FILE" in result.stderr
    assert run([], tmp_path).returncode == 2
