"""The SDK's parts that need no cluster: spec arguments, the prepare command line, notebook display, keys."""

from __future__ import annotations

import io
import shlex
import sys
from pathlib import Path

import pytest

from pylon.errors import SpecError
from pylon.sdk.handles import DataJob, Run, Service
from pylon.sdk.inputs import as_spec, dataset_spec, first_api_key, prepare_entrypoint
from pylon.specs import DatasetSpec, DeploymentSpec, TrainJobSpec, load_spec

TRAIN = {"name": "tiny", "model": {"preset": "gpt-tiny"}, "data": {"uri": "corpus/"}, "steps": 10}


class NoCluster:
    """A client whose every call fails, as when the cluster is gone: displays must still work."""

    dashboard_url = "http://127.0.0.1:1"
    gcs_address = None

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError("no cluster")

        return fail


def test_as_spec_takes_objects_dicts_and_files(tmp_path: Path) -> None:
    spec, path = as_spec(TRAIN, TrainJobSpec)
    assert isinstance(spec, TrainJobSpec) and spec.name == "tiny" and path is None
    again, _ = as_spec(spec, TrainJobSpec)
    assert again == spec
    f = tmp_path / "train.yaml"
    f.write_text("kind: TrainJob\nname: tiny\nmodel: {preset: gpt-tiny}\ndata: {uri: corpus/}\nsteps: 10\n")
    from_file, path = as_spec(str(f), TrainJobSpec)
    assert from_file == spec and path == f
    with pytest.raises(TypeError, match="TrainJobSpec"):
        as_spec(42, TrainJobSpec)


def test_as_spec_errors_name_the_field_and_objects_are_validated_again() -> None:
    with pytest.raises(SpecError) as e:
        as_spec({**TRAIN, "deepspeed": {"zero_stage": 5}, "colour": "blue"}, TrainJobSpec)
    assert "TrainJob 'tiny': deepspeed.zero_stage: must be one of 0, 1, 2, 3 (got 5)" in e.value.problems
    assert any(p.startswith("TrainJob 'tiny': colour: unknown field") for p in e.value.problems)
    # model_copy(update=...) skips validation; a submitted spec must not.
    spec = TrainJobSpec.model_validate(TRAIN).model_copy(update={"steps": 0})
    with pytest.raises(SpecError, match="steps"):
        as_spec(spec, TrainJobSpec)
    with pytest.raises(SpecError, match="kind: must be one of TrainJob"):
        as_spec({**TRAIN, "kind": "Deployment"}, TrainJobSpec)


def test_dataset_from_keywords_gets_a_name_from_its_output(tmp_path: Path) -> None:
    spec = dataset_spec(
        None, {"sources": tmp_path, "output": tmp_path / "My_Corpus v2", "seq_len": 64, "include": "*.py"}
    )
    assert spec.name == "my-corpus-v2" and spec.sources == [str(tmp_path)] and spec.seq_len == 64
    assert dataset_spec(None, {"name": "x", "sources": ["a"], "output": "s3://b/ds/"}).name == "x"
    assert dataset_spec({"name": "d", "sources": ["a"], "output": "o"}, {}).name == "d"
    with pytest.raises(TypeError, match="not both"):
        dataset_spec({"name": "d", "sources": ["a"], "output": "o"}, {"seq_len": 8})
    with pytest.raises(SpecError, match="output: required"):
        dataset_spec(None, {"sources": ["a"]})


def test_prepare_entrypoint_is_the_cli_command_line(tmp_path: Path) -> None:
    from pylon.cli import build_parser

    spec = DatasetSpec(
        name="d",
        sources=["src dir/", "b.jsonl"],
        output="s3://bucket/out",
        format="webdataset",
        seq_len=64,
        include="*.py",
        exclude=["site-packages", "tests"],
        shard_size_mb=8,
    )
    entry = prepare_entrypoint(spec, overwrite=True)  # run in the job's working directory: no `cd` to the client's
    assert "&&" not in entry and " cd " not in f" {entry}"
    argv = shlex.split(entry)
    assert argv[0] == "pylon"
    args = build_parser().parse_args(argv[1:])  # what the job's `pylon` will understand
    assert (
        args.sources,
        args.out,
        args.format,
        args.seq_len,
        args.include,
        args.exclude,
        args.shard_size_mb,
        args.overwrite,
        args.tokenizer,
    ) == (
        ["src dir/", "b.jsonl"],
        "s3://bucket/out",
        "webdataset",
        64,
        "*.py",
        ["site-packages", "tests"],
        8.0,
        True,
        "byte",
    )
    assert not args.chat
    # A chat dataset's job prepares conversations (the field a Dataset spec names, said on the command line).
    chat = build_parser().parse_args(
        shlex.split(prepare_entrypoint(spec.model_copy(update={"chat": True}), overwrite=False))[1:]
    )
    assert chat.chat and not chat.overwrite


def test_specs_show_as_html_tables_without_changing_validation() -> None:
    spec = load_spec(Path(__file__).parents[3] / "platform/pylon/examples/stdlib-gpt.yaml", DeploymentSpec)
    html = spec._repr_html_()
    assert html.startswith("<table") and f"Deployment &#x27;{spec.name}&#x27;" in html
    assert (
        "api_keys_env" in html and "max_num_seqs" in html and html.count("<table") == 1 + 6
    )  # engine, engine.speculative, engine.dynamic_adapters, autoscaling, http, replica
    hostile = DatasetSpec(name="d", sources=["<script>alert(1)</script>"], output="o")
    assert "<script>" not in hostile._repr_html_() and "&lt;script&gt;" in hostile._repr_html_()
    # Still pydantic models that forbid unknown keys; the display is a method, not a field.
    with pytest.raises(Exception, match="extra"):
        DatasetSpec(name="d", sources=["a"], output="o", _repr_html_="x")
    assert "_repr_html_" not in DatasetSpec.model_fields


def test_first_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYS", " sk-one , sk-two")
    assert first_api_key("KEYS") == "sk-one"
    monkeypatch.setenv("KEYS", " , ")
    with pytest.raises(Exception, match="KEYS is empty or unset"):
        first_api_key("KEYS")
    assert first_api_key("KEYS", required=False) is None


def test_reprs_never_show_the_api_key_and_survive_a_lost_cluster() -> None:
    svc = Service(NoCluster(), "gpt", "http://127.0.0.1:8000/gpt", api_key="sk-secret-123")
    for text in (repr(svc), svc._repr_html_()):
        assert "sk-secret-123" not in text and "gpt" in text and "unknown" in text
    run = Run(NoCluster(), "train-tiny-abc123", name="tiny", run_uri="/runs/tiny")
    assert repr(run) == "Run(name='tiny', job_id='train-tiny-abc123', status='unknown', run_uri='/runs/tiny')"
    assert "train-tiny-abc123" in run._repr_html_() and "/runs/tiny" in run._repr_html_()
    data = DataJob(NoCluster(), "data-d-1", name="d", output="s3://b/d")
    assert "s3://b/d" in repr(data)


def test_a_run_shows_its_held_out_evaluation_apart_from_its_steps(tmp_path: Path) -> None:
    from pylon.jobs.run_dir import MetricsLog, eval_record

    log = MetricsLog(str(tmp_path), enabled=True, resume_step=0)
    log.write({"step": 1, "loss": 3.5, "tokens_per_s": 100.0})
    log.write({"step": 2, "loss": 3.0, "tokens_per_s": 100.0})
    log.write_eval(eval_record(2, loss_sum=25.0, tokens=10, sequences=2, batches=1, val_ids=(8, 10), seconds=0.0))
    log.flush()
    run = Run(NoCluster(), "train-tiny-abc123", name="tiny", run_uri=str(tmp_path))
    assert list(run.metrics()["step"]) == [1, 2] and "val_loss" not in run.metrics()
    evals = run.evaluations()
    assert list(evals["step"]) == [2] and list(evals["val_loss"]) == [2.5]
    page = run._repr_html_()
    assert "step 2: validation loss 2.5000, perplexity 12.182" in page
    labels = [t.get_text() for t in run.plot().axes[0].get_legend().get_texts()]
    assert labels == ["training", "validation"]
    assert run.completions().empty  # (a run that samples nothing)
    from pylon.jobs.run_dir import CompletionsLog

    sampled = CompletionsLog(str(tmp_path), enabled=True, resume_step=0)
    sampled.write_step(2, [{"prompt": "Q ", "completion": "a", "answer": "a", "rewards": {"exact_match": 1.0},
                            "reward": 1.0, "advantage": 0.5, "tokens": 2, "ended": True}])  # fmt: skip
    sampled.flush()
    table = run.completions()
    assert table.to_dict("records") == [{"step": 2, "prompt": "Q ", "completion": "a", "answer": "a",
                                         "rewards": {"exact_match": 1.0}, "reward": 1.0, "advantage": 0.5,
                                         "tokens": 2, "ended": True}]  # fmt: skip


def test_a_run_without_a_known_directory_says_so() -> None:
    run = Run(NoCluster(), "raysubmit_1", name=None, run_uri=None)
    assert run.name == "raysubmit_1"
    with pytest.raises(Exception, match="run directory is unknown"):
        run.metrics()


def test_sdk_names_are_exported_lazily() -> None:
    import pylon

    assert pylon.Run is Run and pylon.Service is Service
    assert {"Run", "Service"} <= set(pylon.__all__)
    with pytest.raises(AttributeError):
        pylon.NoSuchThing  # noqa: B018


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _GrowingJob:
    """A job whose logs grow by one chunk per status poll, then it succeeds."""

    def __init__(self, chunks: list[str]):
        self.chunks, self.polls = chunks, 0

    def job_status(self, job_id):
        self.polls += 1
        return "SUCCEEDED" if self.polls >= len(self.chunks) else "RUNNING"

    def job_logs(self, job_id):
        return "".join(self.chunks[: self.polls])


def test_following_a_training_job_moves_a_step_bar_on_a_terminal_only(monkeypatch) -> None:
    from pylon.sdk.handles import follow_logs

    chunks = [
        "training tiny\n",
        '{"step": 1, "loss": 5.5, "tokens_per_s": 900.0}\n',
        '{"step": 11, "loss": 3.25, "tokens_per_s": 1000.0}\n{"result": {}}\n',
    ]
    out, err = io.StringIO(), _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert (
        follow_logs(_GrowingJob(chunks), "train-tiny-1", out=out, poll_s=0, progress=True, total_steps=12)
        == "SUCCEEDED"
    )
    assert out.getvalue() == "".join(chunks)  # every log line, once, in order
    assert "11/12" in err.getvalue() and "loss=3.2500" in err.getvalue()

    out, err = io.StringIO(), io.StringIO()  # not a terminal: no bar at all
    monkeypatch.setattr(sys, "stderr", err)
    follow_logs(_GrowingJob(chunks), "train-tiny-1", out=out, poll_s=0, progress=True, total_steps=12)
    assert out.getvalue() == "".join(chunks) and err.getvalue() == ""


class _FailedJob:
    dashboard_url = "http://127.0.0.1:8265"

    def wait_job(self, job_id, timeout_s, poll_s=1.0):
        return "FAILED"

    def job_info(self, job_id):
        from pylon.sdk.client import JobInfo

        return JobInfo(
            job_id=job_id,
            status="FAILED",
            entrypoint="python -m pylon.jobs.train",
            start_time=None,
            message="Job entrypoint command failed with exit code 1",
        )

    def job_logs(self, job_id):
        return "".join(f"line {i}\n" for i in range(100)) + "error: data.uri: /nowhere has no manifest.json\n"


def test_a_failed_run_raises_with_the_end_of_its_logs() -> None:
    from pylon.errors import JobFailedError

    run = Run(_FailedJob(), "train-tiny-1a2b3c", name="tiny", run_uri="/runs/tiny")
    with pytest.raises(JobFailedError) as failed:
        run.wait(timeout=5)
    message = str(failed.value)
    assert "train-tiny-1a2b3c ended FAILED" in message and "exit code 1" in message
    assert message.count("line ") < 40 and "/nowhere has no manifest.json" in message  # the end, not all of it
    assert "pylon jobs logs train-tiny-1a2b3c" in message
    assert run.wait(timeout=5, check=False) == "FAILED"
