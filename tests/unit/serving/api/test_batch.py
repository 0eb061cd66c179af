"""Offline batch inference (`pylon batch`, pylon.serving.api.batch) without a cluster: each line read as a request or
an error naming it, the input cut into parts at their lines' bytes, a part answered by an engine in this process
exactly as the same bodies POSTed to a replica over real HTTP are, the conversations format read by `pylon data
prepare --chat`, and an output directory claimed by one batch only (tests/integration/test_batch.py runs the job on
a cluster)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests
from test_serving_http import auth, model_dir, serving  # noqa: F401 (fixtures)

from pylon.errors import PylonError, SpecError
from pylon.serving.api import batch
from pylon.specs import BatchJobSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))
ENGINE = {
    "device": "cpu",
    "dtype": "fp32",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "kv_cache_tokens": 4096,
    "max_model_len": 1024,
    "separate_process": False,
}


def _spec(tmp_path: Path, model: str, **fields) -> BatchJobSpec:
    return BatchJobSpec.model_validate(
        {
            "name": "tiny",
            "model": model,
            "input": str(tmp_path / "in.jsonl"),
            "output": str(tmp_path / "out"),
            "engine": ENGINE,
            **fields,
        }
    )


def _write(path: Path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def test_a_line_is_a_request_or_an_error_naming_it() -> None:
    defaults = {"max_tokens": 8, "temperature": 0}
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 3}}
    r = batch.request_of(line, "in.jsonl:1", "tiny", defaults)
    assert (r.custom_id, r.url, r.record) == ("q1", "/v1/completions", None)
    assert r.body == {"model": "tiny", "prompt": "x", "max_tokens": 3}  # as written: the defaults are records'
    r = batch.request_of({**line, "body": {"model": "other", "input": "x"}}, "in.jsonl:1", "tiny", defaults)
    assert r.body == {"model": "other", "input": "x"}
    conversation = [
        {"role": "system", "content": "brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "the reply regenerated"},
    ]
    r = batch.request_of({"messages": conversation, "source": "a"}, "in.jsonl:2", "tiny", defaults)
    assert (r.custom_id, r.url) == ("in.jsonl:2", batch.CHAT)
    assert r.body == {"model": "tiny", **defaults, "messages": conversation[:2]} and r.record["source"] == "a"
    r = batch.request_of({"prompt": "def f"}, "in.jsonl:3", "tiny", {})
    assert (r.url, r.body) == (batch.COMPLETIONS, {"model": "tiny", "prompt": "def f"})
    r = batch.request_of({"prompt": conversation[1:2]}, "in.jsonl:4", "tiny", {})  # TRL's conversational prompt
    assert r.url == batch.CHAT and r.body["messages"] == conversation[1:2]

    def refused(obj) -> tuple[str, str | None]:
        with pytest.raises(batch.LineError) as e:
            batch.request_of(obj, "in.jsonl:9", "tiny", defaults)
        assert e.value.message.startswith("in.jsonl:9: ")
        return e.value.message, e.value.param

    assert refused([1, 2])[0] == "in.jsonl:9: a JSON object, got list"
    assert refused({**line, "custom_id": ""})[1] == "custom_id"
    assert refused({**line, "method": "GET"})[1] == "method"
    assert refused({**line, "url": "v1/completions"})[1] == "url"
    assert refused({**line, "body": "prompt"})[1] == "body"
    assert refused({**line, "body": {"prompt": "x", "stream": True}})[1] == "body.stream"
    assert refused({**line, "url": "/v1/responses", "body": {"input": "x", "background": True}})[1] == "body.background"
    assert refused({"messages": [conversation[2]]}) == (
        "in.jsonl:9: messages: no message before the assistant's reply to answer",
        "messages",
    )
    message, _ = refused({"text": "hello", "id": 3})
    assert "nor a record with 'messages' or 'prompt' (its keys: id, text)" in message


def test_parts_begin_at_their_lines_bytes_and_custom_ids_are_unique(tmp_path: Path) -> None:
    lines = [{"prompt": f"é{i}"} for i in range(7)]
    lines[2] = ""  # a blank line: counted, never a request
    _write(tmp_path / "b.jsonl", lines)
    _write(tmp_path / "a.jsonl", [{"custom_id": "x", "body": {}}, "{broken"])
    (tmp_path / "notes.txt").write_text("not an input")
    files = batch.input_files(str(tmp_path))
    assert [Path(f).name for f in files] == ["a.jsonl", "b.jsonl"]
    parts, listing = batch.plan_parts(files, 3)
    assert listing == [
        {"file": "a.jsonl", "lines": 2, "bytes": (tmp_path / "a.jsonl").stat().st_size},
        {"file": "b.jsonl", "lines": 7, "bytes": (tmp_path / "b.jsonl").stat().st_size},
    ]
    assert [(p.index, p.name, p.start, p.stop) for p in parts] == [
        (0, "a.jsonl", 0, 2),
        (1, "b.jsonl", 0, 3),
        (2, "b.jsonl", 3, 6),
        (3, "b.jsonl", 6, 7),
    ]
    read = [batch.part_lines(p) for p in parts]
    assert [[n for n, _ in lines] for lines in read] == [[1, 2], [1, 2], [4, 5, 6], [7]]
    assert [json.loads(text)["prompt"] for _, text in read[2]] == ["é3", "é4", "é5"]
    _write(tmp_path / "c.jsonl", [{"custom_id": "y"}, {"custom_id": "x"}])
    with pytest.raises(PylonError, match=r"input: c.jsonl:2: custom_id 'x' is also a.jsonl:1's"):
        batch.plan_parts(batch.input_files(str(tmp_path)), 3)
    with pytest.raises(PylonError, match=r"input: .*missing.jsonl does not exist"):
        batch.input_files(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PylonError, match="a directory with no .jsonl or .parquet files"):
        batch.input_files(str(tmp_path / "empty"))


def test_the_spec_body_is_read_as_a_request_before_any_engine_starts(tmp_path: Path) -> None:
    batch.check_defaults(_spec(tmp_path, "m", body={"max_tokens": 8, "temperature": 0.5, "seed": 1}))
    batch.check_defaults(_spec(tmp_path, "m", body={"response_format": {"type": "json_object"}}))  # chat's only
    with pytest.raises(SpecError, match=r"BatchJob 'tiny': body.temperature: .*greater than or equal to 0"):
        batch.check_defaults(_spec(tmp_path, "m", body={"temperature": -1}))
    with pytest.raises(SpecError, match=r"body.max_token: unknown field 'max_token'"):
        batch.check_defaults(_spec(tmp_path, "m", body={"max_token": 8}))
    with pytest.raises(Exception, match="replica.num_gpus"):  # a Deployment's rules, by the same field paths
        _spec(tmp_path, "m", engine={**ENGINE, "device": "cuda"})


def test_a_part_is_answered_as_a_replica_answers_over_http(model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("PYLON_SCHED_BATCH", "0")
    bodies = [
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "abc", "max_tokens": 9, "temperature": 0.9, "seed": 7, "n": 2}),
        (batch.CHAT, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0}),
        (batch.CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "logprobs": True, "seed": 3}),
        ("/v1/embeddings", {"input": "embed me"}),
        ("/v1/completions", {"prompt": "x", "temperature": -2}),  # a 400, in the errors
    ]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": url, "body": body} for i, (url, body) in enumerate(bodies)]
    lines.insert(2, "not json")
    lines.append({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "old"}]})
    _write(tmp_path / "in.jsonl", lines)
    spec = _spec(tmp_path, model_dir, body={"temperature": 0, "max_tokens": 12})  # the record's
    parts, _ = batch.plan_parts(batch.input_files(spec.input), spec.chunk_lines)
    answerer = batch.PartAnswerer(spec.model_dump(mode="json"))
    try:
        (stats,) = answerer.answer_parts(parts)
        (again,) = answerer.answer_parts(parts)  # committed: a second attempt answers nothing
    finally:
        answerer.close()
    assert stats["lines"] == 8 and (stats["answered"], stats["failed"]) == (6, 2)
    assert again["lines"] == again["answered"] == 0
    results = [json.loads(x) for x in Path(parts[0].results(spec.output)).read_text().splitlines()]
    errors = [json.loads(x) for x in Path(parts[0].errors(spec.output)).read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2", "r3", "r4", "in.jsonl:8"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    assert stats["tokens_out"] == sum(r["response"]["body"]["usage"].get("completion_tokens", 0) for r in results)
    bad_json, bad_temperature = errors
    assert bad_json["response"] is None and bad_json["error"]["line"] == "in.jsonl:3"
    assert bad_json["error"]["message"].startswith("in.jsonl:3: not JSON")
    assert bad_temperature["custom_id"] == "r5" and bad_temperature["response"]["status_code"] == 400
    assert bad_temperature["response"]["body"]["error"]["param"] == "temperature"

    def same(answer):  # what must match: the ids and times are each answer's own; floats as a batch's sums give
        if isinstance(answer, dict):  # them (the engine's batch differs: the last bits of a sum do)
            return {k: same(v) for k, v in answer.items() if k not in ("id", "created")}
        if isinstance(answer, list):
            return [same(v) for v in answer]
        return round(answer, 4) if isinstance(answer, float) else answer

    with serving(model_dir, **ENGINE) as (url, _):
        for result, (path, body) in zip(results[:5], bodies[:5]):
            r = requests.post(url + path, headers=auth(), json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 200, r.text
            assert same(result["response"]["body"]) == same(r.json()), path
        reply = requests.post(
            url + batch.CHAT,
            headers=auth(),
            json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **spec.body},
            timeout=60,
        ).json()
    assert reply["choices"][0]["message"] == results[-1]["response"]["body"]["choices"][0]["message"]


def test_conversations_are_what_prepare_takes(tmp_path: Path) -> None:
    from test_chat_data import CONVERSATIONS, _tokenizer

    from pylon.data.prepare import prepare

    records = []
    for i, conversation in enumerate(CONVERSATIONS):
        request = batch.request_of({"messages": conversation, "id": i}, f"in.jsonl:{i + 1}", "tiny", {"n": 2})
        answer = {
            "choices": [
                {"index": k, "message": {"role": "assistant", "content": f"reply {k}", "refusal": None}}
                for k in range(2)
            ]
        }
        out = batch.conversations(request, answer)
        assert [o["messages"][-1] for o in out] == [{"role": "assistant", "content": f"reply {k}"} for k in range(2)]
        assert all(o["messages"][:-1] == request.body["messages"] and o["id"] == i for o in out)
        records += out
    completion = batch.request_of({"prompt": "def f", "tag": 1}, "in.jsonl:9", "tiny", {})
    assert batch.conversations(completion, {"choices": [{"text": "(x):"}]}) == [
        {"prompt": "def f", "tag": 1, "completion": "(x):"}
    ]
    _write(tmp_path / "regen.jsonl", records)
    out = tmp_path / "data"
    manifest = prepare(
        [str(tmp_path / "regen.jsonl")],
        str(out),
        seq_len=128,
        tokenizer=_tokenizer(tmp_path / "tok"),
        chat=True,
        use_ray=False,
        progress=False,
    )
    assert manifest.loss_mask and manifest.totals.documents == len(records) == 2 * len(CONVERSATIONS)


def test_an_output_holds_one_batch_and_the_same_batch_goes_on(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "m")
    identity = batch._identity(spec, [{"file": "in.jsonl", "lines": 3, "bytes": 30}])
    assert batch._start(spec, identity, overwrite=False) is None  # a new directory
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / batch.MANIFEST).write_text(json.dumps({"identity": identity, "runs": [{}]}))
    (tmp_path / "out" / batch.RESULTS).mkdir()
    (tmp_path / "out" / batch.RESULTS / "part-00000.jsonl").write_text("{}\n")
    assert batch._start(spec, identity, overwrite=False)["runs"] == [{}]  # the same job: goes on
    other = batch._identity(spec.model_copy(update={"body": {"temperature": 1}}), identity["input"])
    with pytest.raises(PylonError, match=r"holds the answers of another batch \(it differs in body\).*--overwrite"):
        batch._start(spec, other, overwrite=False)
    assert batch._start(spec, other, overwrite=True) is None
    assert not (tmp_path / "out" / batch.RESULTS).exists() and not (tmp_path / "out" / batch.MANIFEST).exists()
    (tmp_path / "out" / "mine.txt").write_text("a user's file")
    with pytest.raises(PylonError, match="is not empty and holds no batch's answers"):
        batch._start(spec, identity, overwrite=True)


def test_an_engine_that_dies_leaves_its_part_to_another_attempt(
    model_dir,  # noqa: F811
    tmp_path: Path,
    monkeypatch,
) -> None:
    """The engine's process killed while a part is answered: the part is not committed (its lines in flight would be
    503s) and EngineDied says so (a job's actor exits on it, to be restarted); on the part's last attempt its
    unanswered lines are committed as errors, so that a line that kills engines cannot hold a job forever."""
    import threading

    from faults import kill

    monkeypatch.setenv("PYLON_SCHED_BATCH", "0")
    body = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    _write(tmp_path / "in.jsonl", [{"prompt": f"line {i}"} for i in range(16)])
    spec = _spec(tmp_path, model_dir, body=body, engine={**ENGINE, "separate_process": True})
    (part,), _ = batch.plan_parts(batch.input_files(spec.input), spec.chunk_lines)

    def answer_with_a_kill() -> dict | Exception:
        answerer = batch.PartAnswerer(spec.model_dump(mode="json"))
        pid = answerer.server.engine._proc.pid
        threading.Timer(0.5, kill, args=(pid,)).start()
        try:
            return answerer.answer_parts([part])[0]
        except batch.EngineDied as e:
            return e
        finally:
            answerer.close()

    died = answer_with_a_kill()
    assert isinstance(died, batch.EngineDied) and "the engine died while it answered it (attempt 1 of 3)" in str(died)
    assert not Path(part.results(spec.output)).exists() and not Path(part.errors(spec.output)).exists()
    assert json.loads(Path(part.attempts(spec.output)).read_text()) == {"attempts": 1}
    Path(part.attempts(spec.output)).write_text(json.dumps({"attempts": batch.MAX_ATTEMPTS - 1}))
    stats = answer_with_a_kill()  # the last attempt: committed, the lines it could not answer as errors
    assert stats["lines"] == 16 and stats["failed"] > 0 and stats["answered"] + stats["failed"] == 16
    errors = [json.loads(x) for x in Path(part.errors(spec.output)).read_text().splitlines()]
    assert {e["response"]["status_code"] for e in errors} == {503}


def test_pylon_cost_reads_a_batch_jobs_engines_as_a_deployments_replicas(tmp_path: Path) -> None:
    from pylon.cli.cost import DEPLOYMENT, resolve_target

    path = tmp_path / "batch.yaml"
    path.write_text("kind: BatchJob\nname: nightly\nmodel: m\ninput: in.jsonl\noutput: out\n")
    assert resolve_target(str(path)) == (DEPLOYMENT, "nightly")  # the ledger its engines keep, under its name


def test_parquet_rows_are_records_read_by_row_group(model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    """A Parquet file's rows are records (a dataset's usual form: its messages a list of structs, absent fields
    null), planned from its footer and read a part's row groups at a time; custom_ids in a column are checked as a
    JSONL file's are; a file that is not Parquet is an error naming it."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("PYLON_SCHED_BATCH", "0")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}", "name": None},
                {"role": "assistant", "content": "old reply", "name": None},
            ],
            "source": f"s{i}",
            "when": datetime.date(2026, 12, i + 1),
        }
        for i in range(7)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet", row_group_size=2)
    _write(tmp_path / "more.jsonl", [{"prompt": "x"}])
    files = batch.input_files(str(tmp_path))
    assert [Path(f).name for f in files] == ["chats.parquet", "more.jsonl"]
    parts, listing = batch.plan_parts(files, 3)
    assert listing[0] == {"file": "chats.parquet", "lines": 7, "bytes": (tmp_path / "chats.parquet").stat().st_size}
    assert [(p.name, p.start, p.stop) for p in parts] == [
        ("chats.parquet", 0, 3),
        ("chats.parquet", 3, 6),
        ("chats.parquet", 6, 7),
        ("more.jsonl", 0, 1),
    ]
    middle = batch.part_lines(parts[1])  # rows 4-6: across the second and third row groups
    assert [(n, r["source"]) for n, r in middle] == [(4, "s3"), (5, "s4"), (6, "s5")]
    spec = _spec(
        tmp_path,
        model_dir,
        input=str(tmp_path / "chats.parquet"),
        output_format="conversations",
        body={"max_tokens": 4, "temperature": 0},
        chunk_lines=3,
    )
    parts, _ = batch.plan_parts(batch.input_files(spec.input), spec.chunk_lines)
    answerer = batch.PartAnswerer(spec.model_dump(mode="json"))
    try:
        stats = answerer.answer_parts(parts)
    finally:
        answerer.close()
    assert sum(s["answered"] for s in stats) == 7 and sum(s["failed"] for s in stats) == 0
    out = [json.loads(x) for p in parts for x in Path(p.results(spec.output)).read_text().splitlines()]
    assert [r["source"] for r in out] == [f"s{i}" for i in range(7)] and out[0]["when"] == "2026-12-01"
    assert all(r["messages"][0] == {"role": "user", "content": f"question {i}"} for i, r in enumerate(out))
    assert all(r["messages"][1]["role"] == "assistant" and len(r["messages"]) == 2 for r in out)

    pq.write_table(pa.table({"custom_id": ["a", "b", "a"], "x": [1, 2, 3]}), tmp_path / "ids.parquet")
    with pytest.raises(PylonError, match=r"ids.parquet:3: custom_id 'a' is also ids.parquet:1's"):
        batch.plan_parts([str(tmp_path / "ids.parquet")], 3)
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(PylonError, match=r"input: .*fake.parquet: not a readable Parquet file"):
        batch.plan_parts([str(tmp_path / "fake.parquet")], 3)
