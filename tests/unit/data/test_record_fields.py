"""A source record's other fields (`ShardManifest.record_fields`): kept per document in each shard's records file,
read back beside the rows they belong to (`RecordReader`), checked like the shards, and refused when too large.

Every check maps each document read back from the token rows (`prompts_and_answers`) to the source record it was
prepared from, so a record that lands beside the wrong document fails it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import pylon.data.prepare as prepare_module
from pylon import storage
from pylon.data.inspect import inspect
from pylon.data.prepare import RECORD_FIELDS_LIMIT, prepare
from pylon.data.reader import Batch, RecordReader
from pylon.data.shards import BadShardError, DataError, read_manifest
from pylon.data.tokenizer import load_tokenizer
from pylon.jobs.grpo import prompts_and_answers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat_data import _jsonl, _tokenizer  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

EOS = 256  # the byte tokenizer's


def _records(n: int = 60) -> list[dict]:
    """Prompts of many lengths (so bfd reorders them); two in three with other fields, of several JSON types."""
    out = []
    for i in range(n):
        record = {"prompt": f"question {i}: " + "x" * (i * 7 % 23), "answer": str(i)}
        if i % 3:
            record |= {"id": f"task-{i}", "tests": [{"input": i, "output": i * i}], "level": i % 4, "ok": i % 2 == 0}
        if i % 5 == 0:
            record["note"] = "naïve ✓"  # a field only some records have; non-ASCII kept as it is
        out.append(record)
    return out


def _documents(out: str, eos_id: int = EOS, tokenizer: str = "byte") -> list[tuple[str, str, dict]]:
    """(prompt, answer, record fields) of every document, read from the shards and their records files."""
    manifest, tokens, num_tokens, ids = read_rows(out)
    reader = RecordReader(out, manifest, keep=2)
    batch = Batch(ids, tokens, num_tokens, 0.0, True, eos_id, reader.rows(ids))
    tok = load_tokenizer(tokenizer)
    return [(tok.decode(p), tok.decode(a), r) for p, a, r in prompts_and_answers(batch, eos_id)]


def _expected(records: list[dict], read=("prompt", "answer")) -> dict[str, dict]:
    return {r["prompt"]: {k: v for k, v in r.items() if k not in read} for r in records}


@pytest.mark.parametrize(
    "packing, fmt, groups", [("bfd", "parquet", False), ("wrapped", "webdataset", False), ("bfd", "parquet", True)]
)
def test_each_document_gets_its_own_records_fields(tmp_path, monkeypatch, packing, fmt, groups) -> None:
    if groups:  # every line its own group: groups' records concatenated, shards cut across them
        monkeypatch.setattr(prepare_module, "GROUP_BYTES", 1)
        (tmp_path / "src").mkdir()
        for i, r in enumerate(_records()):
            _jsonl(tmp_path / "src" / f"{i:03d}.jsonl", [r])
        sources = [str(tmp_path / "src")]
    else:
        sources = [_jsonl(tmp_path / "p.jsonl", _records())]
    out = str(tmp_path / "out")
    seq_len = 48 if packing == "bfd" else 40  # (wrapped: documents run on across rows)
    manifest = prepare(sources, out, seq_len=seq_len, fmt=fmt, packing=packing, prompts=True, progress=False,
                       shard_size_mb=7 * seq_len * 4 / 2**20)  # fmt: skip
    assert manifest.record_fields == ["id", "level", "note", "ok", "tests"]
    assert "record fields id, level, note, ok, tests" in manifest.summary()
    assert len(manifest.shards) > 2 and all(s.records is not None for s in manifest.shards)
    want = _expected(_records())
    found = _documents(out)
    if packing == "wrapped":  # documents run on across rows: a row's end holds a document's beginning (and its
        # record), the next row's start the rest (no record of its own); so the records come in the source's order
        with_fields = [(p, r) for p, _, r in found if r]
        assert [r for _, r in with_fields] == [f for f in want.values() if f]
        for prompt, fields in with_fields:  # each beside its own document (whole, or its beginning)
            source = f"question {fields['id'].split('-')[1]}: " if "id" in fields else None
            assert source is None or (prompt and (source.startswith(prompt) or prompt.startswith(source))), prompt
        return
    assert len(found) == len(want)
    for prompt, answer, fields in found:
        assert fields == want[prompt], prompt  # ({} for a record without other fields)
        assert answer == str(int(prompt.split()[1].rstrip(":")))


def test_a_dataset_without_other_fields_has_no_records_files(tmp_path) -> None:
    out = str(tmp_path / "out")
    records = [{"prompt": f"q{i} ", "answer": "a"} for i in range(5)]
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", records)], out, seq_len=32, prompts=True, progress=False)
    assert manifest.record_fields == [] and all(s.records is None for s in manifest.shards)
    assert not [n for n in storage.listdir(out) if n.endswith(".records.jsonl")]
    assert all(r == {} for _, _, r in _documents(out))


def test_prompt_completion_and_chat_records_keep_their_fields(tmp_path) -> None:
    pc = [{"prompt": f"p{i} ", "completion": f"c{i}", "source": f"s{i}"} for i in range(4)]
    out = str(tmp_path / "pc")
    assert prepare([_jsonl(tmp_path / "pc.jsonl", pc)], out, seq_len=32, prompt_completion=True,
                   progress=False).record_fields == ["source"]  # fmt: skip
    assert sorted(r["source"] for _, _, r in _documents(out)) == [f"s{i}" for i in range(4)]
    tokenizer = _tokenizer(tmp_path / "tok")
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}], "n": i}
        for i in range(4)
    ]
    out = str(tmp_path / "chat")
    assert prepare([_jsonl(tmp_path / "c.jsonl", chats)], out, seq_len=128, tokenizer=tokenizer, chat=True,
                   progress=False).record_fields == ["n"]  # fmt: skip
    tok = load_tokenizer(tokenizer)
    found = _documents(out, tok.eos_id, tokenizer)
    assert sorted((a, r["n"]) for _, a, r in found) == [(f"yo {i}", i) for i in range(4)]


def test_a_damaged_records_file_is_named_when_read_and_by_inspect(tmp_path) -> None:
    out = str(tmp_path / "out")
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", _records(20))], out, seq_len=48, prompts=True, progress=False)
    info = manifest.shards[0]
    path = Path(out) / info.records.file
    path.write_bytes(path.read_bytes().replace(b'"task-', b'"TASK-', 1))
    with pytest.raises(BadShardError, match=rf"shard {info.records.file}: sha256 .* does not match"):
        RecordReader(out, read_manifest(out)).rows(np.array([0]))
    _, problems = inspect(out, verify=True, progress=False)
    assert len(problems) == 1 and info.records.file in problems[0] and "sha256" in problems[0]
    path.unlink()
    with pytest.raises(DataError, match=rf"records file {info.records.file} of shard {info.file}"):
        RecordReader(out, read_manifest(out)).rows(np.array([0]))
    _, problems = inspect(out, verify=True, progress=False)
    assert problems == [f"records file {info.records.file}: cannot be read ({problems[0].split('(', 1)[1]}"]


def test_too_large_fields_are_refused_naming_the_line(tmp_path) -> None:
    records = [{"prompt": "q ", "id": 1}, {"prompt": "q ", "blob": "x" * (RECORD_FIELDS_LIMIT + 1)}]
    with pytest.raises(DataError, match=r"p.jsonl: line 2: its other fields \(blob\) take 65,\d+ bytes as JSON"):
        prepare([_jsonl(tmp_path / "p.jsonl", records)], str(tmp_path / "out"), seq_len=32, prompts=True,
                progress=False)  # fmt: skip
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_overwrite_replaces_the_records_files_with_the_new_ones(tmp_path) -> None:
    out = str(tmp_path / "out")
    src = _jsonl(tmp_path / "p.jsonl", _records(10))
    first = prepare([src], out, seq_len=48, prompts=True, progress=False)
    second = prepare([src], out, seq_len=48, prompts=True, progress=False, overwrite=True)
    names = set(storage.listdir(out))
    assert {s.records.file for s in second.shards} <= names
    assert not {s.records.file for s in first.shards} & names
    assert json.loads(storage.read_text(storage.join(out, "manifest.json")))["record_fields"] == second.record_fields


@pytest.mark.parametrize("key", ["file", "records"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused(tmp_path, key) -> None:
    out = tmp_path / "out"
    prepare([_jsonl(tmp_path / "p.jsonl", _records(4))], str(out), seq_len=48, prompts=True, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    if key == "records":
        manifest["shards"][0]["records"]["file"] = "../../p.jsonl"
    else:
        manifest["shards"][0]["file"] = "/etc/hostname"
    (out / "manifest.json").write_text(json.dumps(manifest))
    where = "shards.0.records.file" if key == "records" else "shards.0.file"
    with pytest.raises(DataError, match=rf"not a Pylon manifest \({where}: .* is not a file name in the dataset's"):
        read_manifest(str(out))


def test_records_that_do_not_match_their_rows_documents_are_refused(tmp_path) -> None:
    out = str(tmp_path / "out")
    prepare([_jsonl(tmp_path / "p.jsonl", _records(8))], out, seq_len=48, prompts=True, progress=False)
    manifest, tokens, num_tokens, ids = read_rows(out)
    rows = RecordReader(out, manifest).rows(ids)
    rows[0] = rows[0][1:]  # (one record short: every later document would get its neighbour's)
    with pytest.raises(DataError, match=r"row 0: \d+ documents start in it, its records file line holds \d+"):
        prompts_and_answers(Batch(ids, tokens, num_tokens, 0.0, True, EOS, rows), EOS)
