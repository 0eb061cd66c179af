"""`prepare` and `inspect` on local disk and memory://, without a cluster, and `pylon data` as a real process.

Round trips decode the written shards and compare them with the original documents' tokens (each followed
by eos) in the documented order: sources as given, a directory's files sorted, hidden ones skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import pylon.data.prepare as prepare_module
from pylon import storage
from pylon.data.inspect import inspect
from pylon.data.prepare import plan_shards, prepare, prepare_spec
from pylon.data.shards import DataError, decode_shard, read_manifest
from pylon.data.tokenizer import load_tokenizer
from pylon.specs import DatasetSpec

STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = ["textwrap.py", "fnmatch.py", "keyword.py", "this.py"]
SHARD_NAME = re.compile(r"^part-[0-9a-f]{8}-\d{5}\.(parquet|tar)$")


# ---------------------------------------------------------------------------------------------------------
# A corpus and how to read a prepared dataset back
# ---------------------------------------------------------------------------------------------------------


def generated_text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = ["pylon", "ray", "shard", "token", "schön", "naïve", "日本語", "🦊", "\n", "def", "return", "α"]
    return " ".join(rng.choice(vocab, size=words).tolist()) + "\n"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Generated text, a few of the standard library's own sources, hidden entries and one Latin-1 file."""
    root = tmp_path / "corpus"
    (root / "b-docs" / "nested").mkdir(parents=True)
    (root / "a-code").mkdir()
    (root / ".git").mkdir()
    for name in STDLIB_FILES:
        (root / "a-code" / name).write_bytes((STDLIB / name).read_bytes())
    (root / "b-docs" / "one.txt").write_text(generated_text(1, 3000), encoding="utf-8")
    (root / "b-docs" / "nested" / "two.txt").write_text(generated_text(2, 2000), encoding="utf-8")
    (root / "b-docs" / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (root / ".hidden.txt").write_text("never read")
    (root / ".git" / "config").write_text("never read either")
    (root / "z-last.md").write_text(generated_text(3, 500), encoding="utf-8")
    return root


def corpus_documents(root: Path) -> list[str]:
    """The documents `prepare` must read from `corpus`, in its order."""
    order = [*(f"a-code/{n}" for n in sorted(STDLIB_FILES)), "b-docs/nested/two.txt", "b-docs/one.txt", "z-last.md"]
    return [(root / rel).read_text(encoding="utf-8") for rel in order]


def token_stream(documents: list[str], tokenizer: str = "byte") -> np.ndarray:
    tok = load_tokenizer(tokenizer)
    return np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in documents])


def read_rows(out: str):
    """(manifest, tokens (rows, seq_len), num_tokens, ids) of every shard, in shard order, checked."""
    manifest = read_manifest(out)
    tokens, num_tokens, ids = [], [], []
    for shard in manifest.shards:
        data = storage.read_bytes(storage.join(out, shard.file))
        assert len(data) == shard.bytes
        rows = decode_shard(manifest.format, data, shard=shard.file, seq_len=manifest.seq_len, dtype=manifest.dtype)
        assert len(rows) == shard.rows and int(rows.num_tokens.sum()) == shard.tokens
        assert rows.ids.tolist() == list(range(shard.first_id, shard.first_id + shard.rows))
        tokens.append(rows.tokens)
        num_tokens.append(rows.num_tokens)
        ids.append(rows.ids)
    return manifest, np.concatenate(tokens), np.concatenate(num_tokens), np.concatenate(ids)


def real_tokens(tokens: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    return np.concatenate([row[:n] for row, n in zip(tokens, num_tokens)])


def files_under(path: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.fixture(autouse=True)
def no_cluster(tmp_path, monkeypatch):
    """A private PYLON_HOME and no RAY_ADDRESS: `use_ray=None` finds no cluster and runs in this process,
    whatever runs on the developer's machine."""
    monkeypatch.setenv("PYLON_HOME", str(tmp_path / ".pylon-home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    root = f"/t-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root.lstrip('/')}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------------------------------------------------
# Round trips and the manifest
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_round_trip_gives_back_every_documents_tokens_with_eos_separators(corpus, tmp_path, fmt):
    before = files_under(corpus)
    out = str(tmp_path / "out")
    manifest = prepare([str(corpus)], out, fmt=fmt, seq_len=64, progress=False)

    read, tokens, num_tokens, ids = read_rows(out)
    assert read.model_dump() == manifest.model_dump()
    expected = token_stream(corpus_documents(corpus))
    assert np.array_equal(real_tokens(tokens, num_tokens), expected)
    # One group here, so only the very last row is short, and it is padded with the pad id.
    assert (num_tokens[:-1] == 64).all() and 0 < num_tokens[-1] <= 64
    assert (tokens[-1, num_tokens[-1] :] == 257).all()
    assert ids.tolist() == list(range(len(ids)))

    assert manifest.format == fmt and manifest.seq_len == 64 and manifest.dtype == "uint16"
    assert manifest.tokenizer.model_dump() == load_tokenizer("byte").info.model_dump()
    t = manifest.totals
    assert (t.documents, t.skipped_files) == (len(corpus_documents(corpus)), 1)  # latin1.txt; empty.txt is no document
    assert (t.rows, t.tokens) == (len(num_tokens), len(expected))
    assert manifest.sources == [str(corpus)] and re.fullmatch(r"[0-9a-f]{32}", manifest.run_id)
    names = sorted(os.listdir(out))
    assert names == sorted(["manifest.json", *(s.file for s in manifest.shards)])
    for index, shard in enumerate(manifest.shards):
        assert SHARD_NAME.match(shard.file) and shard.file.startswith(f"part-{manifest.run_id[:8]}-{index:05d}.")
        data = (Path(out) / shard.file).read_bytes()
        assert shard.bytes == len(data) and shard.sha256 == __import__("hashlib").sha256(data).hexdigest()
    assert files_under(corpus) == before  # nothing written into the source


def test_memory_uris_in_and_out(corpus, memfs):
    src = f"{memfs}/src"
    for path in sorted(corpus.rglob("*")):
        if path.is_file():
            storage.atomic_write(storage.join(src, str(path.relative_to(corpus))), path.read_bytes())
    out = f"{memfs}/out"
    manifest = prepare([src], out, fmt="webdataset", seq_len=32, progress=False)
    _, tokens, num_tokens, _ = read_rows(out)
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(corpus_documents(corpus)))
    assert manifest.totals.skipped_files == 1 and manifest.sources == [src]


def test_several_groups_pad_only_each_groups_last_row_and_shards_span_groups(corpus, tmp_path, monkeypatch):
    # Tiny groups: every file is its own group (the rule Ray tasks follow too), shards cross group borders.
    monkeypatch.setattr(prepare_module, "GROUP_BYTES", 1)
    out = str(tmp_path / "out")
    manifest = prepare([str(corpus)], out, seq_len=50, shard_size_mb=40 * 50 * 2 / 2**20, progress=False)
    _, tokens, num_tokens, ids = read_rows(out)
    documents = corpus_documents(corpus)
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(documents))
    # Each document is packed on its own: full rows, then its remainder (latin1.txt and empty.txt give none).
    expected_lengths = []
    for doc in documents:
        n = len(doc.encode("utf-8")) + 1
        expected_lengths += [50] * (n // 50) + ([n % 50] if n % 50 else [])
    assert num_tokens.tolist() == expected_lengths
    assert all(s.rows == 40 for s in manifest.shards[:-1]) and len(manifest.shards) == -(-len(expected_lengths) // 40)
    assert ids.tolist() == list(range(manifest.totals.rows))


def test_plan_shards_cuts_rows_at_fixed_multiples_across_groups():
    assert plan_shards([3, 0, 5, 1], 4) == [[(0, 0, 3), (2, 0, 1)], [(2, 1, 5)], [(3, 0, 1)]]
    assert plan_shards([4], 4) == [[(0, 0, 4)]]
    assert plan_shards([0, 0], 4) == []


def test_shard_size_gives_several_shards_with_contiguous_ids(corpus, tmp_path):
    out = str(tmp_path / "out")
    # 100 rows of 64 uint16 tokens per shard.
    manifest = prepare([str(corpus)], out, seq_len=64, shard_size_mb=100 * 64 * 2 / 2**20, progress=False)
    assert len(manifest.shards) >= 3
    assert all(s.rows == 100 for s in manifest.shards[:-1]) and 0 < manifest.shards[-1].rows <= 100
    assert [s.first_id for s in manifest.shards] == [100 * i for i in range(len(manifest.shards))]
    assert sum(s.rows for s in manifest.shards) == manifest.totals.rows
    _, tokens, num_tokens, _ = read_rows(out)
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(corpus_documents(corpus)))


def test_a_trained_bpe_tokenizer_file(corpus, tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus_documents(corpus),
        trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=["<|endoftext|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = str(tmp_path / "bpe.json")
    tok.save(path)
    out = str(tmp_path / "out")
    manifest = prepare([str(corpus)], out, seq_len=32, tokenizer=path, progress=False)
    _, tokens, num_tokens, _ = read_rows(out)
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(corpus_documents(corpus), path))
    assert manifest.tokenizer == load_tokenizer(path).info.model_copy(update={"uri": path})
    assert manifest.tokenizer.kind == "tokenizers"
    assert (tokens[-1, num_tokens[-1] :] == tok.token_to_id("<pad>")).all()


def test_include_glob_filters_files_in_directories_but_not_files_named_directly(corpus, tmp_path):
    out = str(tmp_path / "out")
    manifest = prepare([str(corpus), str(corpus / "z-last.md")], out, seq_len=16, include="*.py", progress=False)
    _, tokens, num_tokens, _ = read_rows(out)
    documents = [(corpus / "a-code" / n).read_text() for n in sorted(STDLIB_FILES)]
    documents.append((corpus / "z-last.md").read_text())
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(documents))
    assert manifest.totals.skipped_files == 0
    with pytest.raises(DataError, match=r"empty dataset: no files in .* match --include '\*\.rs'"):
        prepare([str(corpus)], str(tmp_path / "none"), include="*.rs", progress=False)


def test_jsonl_one_document_per_line_from_the_text_field(tmp_path):
    docs = ["first document", "zweites Dokument mit ü", "third\nwith a newline and a \u2028 line separator"]
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    (tmp_path / "a.jsonl").write_text(lines[0] + "\n\n" + lines[1] + "\r\n" + lines[2] + "\n")
    out = str(tmp_path / "out")
    manifest = prepare([str(tmp_path / "a.jsonl")], out, seq_len=8, text_field="body", progress=False)
    _, tokens, num_tokens, _ = read_rows(out)
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(docs))
    assert manifest.totals.documents == 3


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"text": "fine"}\n{"text": broken}\n', r"b\.jsonl: line 2: not a JSON object"),
        (
            '{"text": "fine"}\n\n{"body": "x"}\n',
            r"b\.jsonl: line 3: no 'text' field \(has \['body'\]\); choose the field with --text-field",
        ),
        ('{"text": 5}\n', r"b\.jsonl: line 1: field 'text' is a int, not a string"),
        ('["text"]\n', r"b\.jsonl: line 1: no 'text' field \(is a list\)"),
    ],
)
def test_bad_jsonl_lines_are_errors_naming_file_and_line(tmp_path, line, problem):
    (tmp_path / "b.jsonl").write_text(line)
    with pytest.raises(DataError, match=problem):
        prepare([str(tmp_path / "b.jsonl")], str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_prepare_spec_uses_the_specs_fields(corpus, tmp_path):
    spec = DatasetSpec(
        name="corpus",
        sources=[str(corpus)],
        output=str(tmp_path / "out"),
        format="webdataset",
        seq_len=128,
        shard_size_mb=0.01,
    )
    manifest = prepare_spec(spec, progress=False)
    assert (manifest.format, manifest.seq_len) == ("webdataset", 128)
    assert len(manifest.shards) > 1 and all(s.file.endswith(".tar") for s in manifest.shards)


# ---------------------------------------------------------------------------------------------------------
# Never mixing: refuse, or replace whole
# ---------------------------------------------------------------------------------------------------------


def test_an_existing_dataset_or_any_files_are_refused_without_overwrite(corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare([str(corpus)], str(out), progress=False)
    with pytest.raises(DataError, match=r"already holds a prepared dataset; pass --overwrite .* overwrite=True"):
        prepare([str(corpus)], str(out), progress=False)
    assert read_manifest(str(out)) == first
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"already holds 1 file\(s\) \(notes.txt, \.\.\.\); pass --overwrite"):
        prepare([str(corpus)], str(other), progress=False)


def test_overwrite_replaces_whole_and_removes_old_shards_and_leftovers(corpus, tmp_path):
    out = tmp_path / "out"
    old = prepare([str(corpus)], str(out), seq_len=16, shard_size_mb=0.01, progress=False)
    # What crashed runs leave: a shard no manifest lists and a temporary file of an unfinished write.
    (out / "part-deadbeef-00000.parquet").write_bytes(b"half a shard")
    (out / f".part-deadbeef-00001.parquet.tmp-{uuid.uuid4().hex}").write_bytes(b"unfinished")
    new = prepare([str(corpus / "b-docs")], str(out), fmt="webdataset", seq_len=32, overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == sorted(["manifest.json", *(s.file for s in new.shards)])
    assert not {s.file for s in old.shards} & {s.file for s in new.shards}
    _, tokens, num_tokens, _ = read_rows(str(out))
    b_docs = [(corpus / "b-docs/nested/two.txt").read_text(), (corpus / "b-docs/one.txt").read_text()]
    assert np.array_equal(real_tokens(tokens, num_tokens), token_stream(b_docs))


def test_overwrite_never_deletes_files_that_are_not_a_datasets(corpus, tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(DataError, match=r"holds files that are not part of a prepared dataset \(thesis.tex\)"):
        prepare([str(corpus)], str(out), overwrite=True, progress=False)
    assert os.listdir(out) == ["thesis.tex"]


def test_a_run_failing_midway_leaves_the_committed_dataset_readable_and_intact(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old = prepare([str(corpus)], str(out), seq_len=16, shard_size_mb=0.01, progress=False)
    before = files_under(out)

    real_encode = prepare_module.encode_shard
    calls = []

    def encode_then_fail_on_the_second_shard(fmt, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise OSError("disk full (injected while writing shard 2)")
        return real_encode(fmt, rows)

    monkeypatch.setattr(prepare_module, "encode_shard", encode_then_fail_on_the_second_shard)
    with pytest.raises(OSError, match="injected"):
        prepare([str(corpus)], str(out), seq_len=8, shard_size_mb=0.01, overwrite=True, progress=False)
    assert len(calls) == 2
    assert read_manifest(str(out)) == old
    assert files_under(out) == before  # the failed run's first shard is gone again, the old ones untouched
    assert inspect(str(out), verify=True, progress=False)[1] == []


# ---------------------------------------------------------------------------------------------------------
# Bad sources and arguments
# ---------------------------------------------------------------------------------------------------------


def test_a_missing_source_is_named(corpus, tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(DataError, match=f"source {re.escape(str(missing))}: no such file or directory"):
        prepare([str(corpus), str(missing)], str(tmp_path / "out"), progress=False)
    with pytest.raises(DataError, match="source memory://nowhere/x.txt: no such file or directory"):
        prepare(["memory://nowhere/x.txt"], str(tmp_path / "out"), progress=False)


def test_no_documents_is_an_empty_dataset_error_naming_the_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"empty dataset: no files in {re.escape(str(tmp_path / 'empty'))}"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"), progress=False)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.bin").write_bytes(bytes(range(128, 256)))
    (tmp_path / "binary" / "nothing.txt").write_text("")
    with pytest.raises(DataError, match=r"empty dataset: no documents in .*binary \(1 file\(s\) skipped: not UTF-8"):
        prepare([str(tmp_path / "binary")], str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_output_inside_or_around_a_source_is_refused(corpus, tmp_path):
    before = files_under(corpus)
    for out in (corpus, corpus / "b-docs" / "prepared", tmp_path):
        with pytest.raises(DataError, match="overlaps the source .*nothing is ever written into the input"):
            prepare([str(corpus)], str(out), overwrite=True, progress=False)
    assert files_under(corpus) == before


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"fmt": "csv"}, "format 'csv': must be one of parquet, webdataset"),
        ({"seq_len": 0}, "seq_len 0: must be a whole number >= 1"),
        ({"shard_size_mb": 0}, "shard_size_mb 0: must be > 0"),
        ({"tokenizer": "nope.json"}, "tokenizer nope.json: no such file or directory"),
        ({"use_ray": True}, "memory:// storage exists only in this process"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(corpus, memfs, kw, message):
    out = f"{memfs}/out"
    with pytest.raises(DataError, match=message):
        prepare([str(corpus)], out, progress=False, **kw)
    assert storage.listdir(out) == []


def test_credentials_never_reach_the_recorded_sources():
    assert prepare_module._without_credentials("s3://AKIA:secret@bucket/key") == "s3://bucket/key"
    assert prepare_module._without_credentials("s3://bucket/a@b") == "s3://bucket/a@b"


# ---------------------------------------------------------------------------------------------------------
# inspect --verify
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_verify_names_every_damaged_shard(corpus, tmp_path, fmt):
    out = tmp_path / "out"
    manifest = prepare([str(corpus)], str(out), fmt=fmt, seq_len=32, shard_size_mb=0.02, progress=False)
    assert len(manifest.shards) >= 4
    assert inspect(str(out), verify=True, progress=False) == (manifest, [])
    truncated, flipped, removed = manifest.shards[0].file, manifest.shards[2].file, manifest.shards[3].file
    data = (out / truncated).read_bytes()
    (out / truncated).write_bytes(data[: len(data) // 2])
    data = bytearray((out / flipped).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / flipped).write_bytes(bytes(data))
    (out / removed).unlink()
    read, problems = inspect(str(out), verify=True, progress=False)
    assert read == manifest
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"shard {truncated}: ") and "truncated" in problems[0]
    assert problems[1].startswith(f"shard {flipped}: ") and "sha256" in problems[1]
    assert problems[2].startswith(f"shard {removed}: cannot be read")
    assert inspect(str(out))[1] == []  # without verify nothing is read


# ---------------------------------------------------------------------------------------------------------
# The command line, as a real process
# ---------------------------------------------------------------------------------------------------------


def pylon(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # A private PYLON_HOME and no RAY_ADDRESS: no cluster, so prepare runs in the process.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYLON_HOME"] = str(cwd / ".pylon-home")
    result = subprocess.run(
        [sys.executable, "-m", "pylon.cli", "data", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def test_cli_prepare_refuse_overwrite_and_inspect(corpus, tmp_path):
    first = pylon(["prepare", str(corpus), "--out", "ds", "--seq-len", "64", "--shard-size-mb", "0.01"], tmp_path)
    assert first.returncode == 0, first.stderr
    manifest = read_manifest(str(tmp_path / "ds"))
    assert f"{len(manifest.shards)} shard(s), {manifest.totals.rows:,} sequences of 64 tokens" in first.stdout
    assert "tokens/s" in first.stdout and "manifest: ds/manifest.json" in first.stdout
    assert "skipped 1 file(s)" in first.stdout
    assert "not using Ray: no Ray cluster is running" in first.stderr and "latin1.txt: not UTF-8" in first.stderr

    again = pylon(["prepare", str(corpus), "--out", "ds"], tmp_path)
    assert again.returncode == 1 and "pass --overwrite" in again.stderr

    replaced = pylon(
        [
            "prepare",
            str(corpus / "b-docs"),
            "--out",
            "ds",
            "--overwrite",
            "--local",
            "--json",
            "--format",
            "webdataset",
        ],
        tmp_path,
    )
    assert replaced.returncode == 0, replaced.stderr
    summary = json.loads(replaced.stdout)
    manifest = read_manifest(str(tmp_path / "ds"))
    assert (summary["shards"], summary["rows"], summary["tokens"], summary["documents"]) == (
        len(manifest.shards),
        manifest.totals.rows,
        manifest.totals.tokens,
        2,
    )

    shown = pylon(["inspect", "ds", "--verify"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    for shard in manifest.shards:
        line = rf"{shard.file}\s+{shard.rows:,}\s+{shard.tokens:,}\s+[\d.]+\s+{shard.sha256[:16]}"
        assert re.search(line, shown.stdout)
    assert f"verified {len(manifest.shards)} shard(s)" in shown.stdout

    (tmp_path / "ds" / manifest.shards[0].file).write_bytes(b"not a tar")
    broken = pylon(["inspect", "ds", "--verify", "--json"], tmp_path)
    assert broken.returncode == 1
    assert [p.split(":")[0] for p in json.loads(broken.stdout)["problems"]] == [f"shard {manifest.shards[0].file}"]


def test_cli_errors_exit_1_with_a_message_and_no_traceback(tmp_path):
    missing = pylon(["prepare", "no-such-file.txt", "--out", "ds"], tmp_path)
    assert missing.returncode == 1 and "error: source no-such-file.txt: no such file or directory" in missing.stderr
    nothing = pylon(["inspect", "ds"], tmp_path)
    assert nothing.returncode == 1 and "no manifest.json" in nothing.stderr
    usage = pylon(["prepare", "x.txt"], tmp_path)
    assert usage.returncode == 2 and "--out" in usage.stderr


def test_exclude_drops_files_under_matching_path_components(tmp_path):
    from pylon.data.prepare import find_source_files

    for rel in ("a.py", "pkg/b.py", "site-packages/x/c.py", "pkg/test_d.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    found = find_source_files([str(tmp_path)], include="*.py", exclude=["site-packages", "test_*"])
    assert [f.uri.rsplit(str(tmp_path), 1)[1] for f in found] == ["/a.py", "/pkg/b.py"]


@pytest.mark.parametrize("dtype", ["<u2", "<i4", "<i8", ">i4", "<f4"])
@pytest.mark.parametrize("n", [0, 1, 256, 100_000])
def test_read_npy_matches_np_load_for_1d_arrays(dtype, n):
    import io as _io

    from pylon.data.shards import read_npy

    arr = (np.arange(n) % 60_000).astype(dtype)
    buf = _io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    got = read_npy(buf.getvalue())
    assert got.dtype == arr.dtype and np.array_equal(got, arr)
    got.setflags(write=True)  # a private copy, not a view of the shard's bytes


def test_read_npy_falls_back_to_numpy_and_refuses_a_short_body():
    import io as _io

    from pylon.data.shards import read_npy

    two_d = np.arange(12, dtype=np.int32).reshape(3, 4)
    buf = _io.BytesIO()
    np.save(buf, two_d, allow_pickle=False)
    assert np.array_equal(read_npy(buf.getvalue()), two_d)
    buf = _io.BytesIO()
    np.save(buf, np.arange(10, dtype=np.int32), allow_pickle=False)
    with pytest.raises(ValueError, match="header says 10"):
        read_npy(buf.getvalue()[:-4])


def test_webdataset_shards_decode_in_many_threads_at_once(corpus, tmp_path):
    """`inspect --verify` decodes shards in threads; numpy's own .npy header parsing (ast) is not safe there
    on CPython <= 3.11.7 ("AST constructor recursion depth mismatch", seen in CI)."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "wds"
    prepare([str(corpus)], str(out), seq_len=64, shard_size_mb=0.05, fmt="webdataset", use_ray=False, progress=False)
    manifest = read_manifest(str(out))
    blobs = [(s, (out / s.file).read_bytes()) for s in manifest.shards] * 8
    with ThreadPoolExecutor(8) as pool:
        rows = list(
            pool.map(
                lambda sb: decode_shard("webdataset", sb[1], shard=sb[0].file, seq_len=64, dtype=manifest.dtype), blobs
            )
        )
    assert [len(r.ids) for r in rows] == [s.rows for s, _ in blobs]
