"""`pylon data tokenizer`: a byte-level BPE learned from a corpus, used by prepare, carried into exports."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from pylon.data.bpe import train_bpe
from pylon.data.prepare import prepare
from pylon.data.shards import DataError
from pylon.data.tokenizer import load_tokenizer
from pylon.errors import PylonError

STDLIB = sysconfig.get_paths()["stdlib"]
FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "fnmatch.py", "bisect.py"]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "src"
    for rel in FILES:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(open(os.path.join(STDLIB, rel), "rb").read())
    (root / "legacy.py").write_bytes(b"# caf\xe9 in latin-1\n")  # not UTF-8: skipped, like prepare does
    return root


def test_learns_a_vocabulary_that_round_trips_and_compresses(corpus, tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    tok = train_bpe([str(corpus)], str(out), vocab_size=600, include="*.py")
    assert out.exists() and tok.info.kind == "tokenizers" and 257 < tok.vocab_size <= 600
    assert tok.info.sha256 and tok.eos_id == 0 == tok.pad_id  # <|endoftext|> is the only special token
    text = (corpus / "textwrap.py").read_text()
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte-level: exact, whitespace and all
    assert len(text.encode()) / len(ids) > 2.0, "a BPE of its own corpus should beat bytes"
    assert tok.decode(tok.encode("naïve — ünïcode 😀")) == "naïve — ünïcode 😀"  # bytes it never saw still work
    assert load_tokenizer(str(out)).info.sha256 == tok.info.sha256


def test_bad_arguments_name_what_is_wrong(corpus, tmp_path):
    out = tmp_path / "tokenizer.json"
    with pytest.raises(DataError, match="vocab_size 100"):
        train_bpe([str(corpus)], str(out), vocab_size=100)
    with pytest.raises(DataError, match="no files .* match --include"):
        train_bpe([str(corpus)], str(out), include="*.rs")
    with pytest.raises(DataError, match="no such file"):
        train_bpe([str(tmp_path / "missing")], str(out))
    with pytest.raises(DataError, match="name the tokenizer file"):
        train_bpe([str(corpus)], str(tmp_path) + "/")
    out.write_text("keep me")
    with pytest.raises(DataError, match="already exists; pass --overwrite"):
        train_bpe([str(corpus)], str(out), vocab_size=300)
    assert out.read_text() == "keep me"  # nothing written is lost
    train_bpe([str(corpus)], str(out), vocab_size=300, overwrite=True)
    assert load_tokenizer(str(out)).vocab_size <= 300


def test_cli_then_prepare_records_where_the_tokenizer_is(corpus, tmp_path, monkeypatch):
    out = tmp_path / "tokenizer.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pylon.cli",
            "data",
            "tokenizer",
            str(corpus),
            "--include",
            "*.py",
            "--vocab-size",
            "500",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["kind"] == "tokenizers" and summary["vocab_size"] <= 500
    assert "trained a BPE tokenizer" in run.stderr
    monkeypatch.chdir(tmp_path)  # a relative --tokenizer is recorded as an absolute path: a job elsewhere must find it
    manifest = prepare(
        [str(corpus)], str(tmp_path / "ds"), include="*.py", tokenizer="tokenizer.json", use_ray=False, progress=False
    )
    assert manifest.tokenizer.uri == str(out) and manifest.tokenizer.sha256 == summary["sha256"]
    assert manifest.dtype == "uint16"


def test_export_carries_the_tokenizer_as_hugging_face_files(corpus, tmp_path):
    from transformers import AutoTokenizer

    from pylon.jobs.export import write_tokenizer_files
    from pylon.serving.engine.tokenization import load_model_tokenizer

    tok = train_bpe([str(corpus)], str(tmp_path / "tokenizer.json"), vocab_size=500)
    info = tok.info.model_copy(update={"uri": str(tmp_path / "tokenizer.json")}).model_dump(mode="json")
    model_dir = tmp_path / "export"
    model_dir.mkdir()
    write_tokenizer_files(info, str(model_dir), 512)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(model_dir))
    code = "def f(x):\n    return x . y , [ 1 ]  # spaces kept\n"
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert hf.eos_token_id == tok.eos_id and hf.model_max_length == 512 and len(hf) == tok.vocab_size
    assert hf.encode(code, add_special_tokens=False) == tok.encode(code).tolist()
    assert hf.decode(hf.encode(code)) == code
    served = load_model_tokenizer(str(model_dir))  # what the serving engine loads
    assert served.eos_id == tok.eos_id and served.decode(served.encode(code)) == code

    (tmp_path / "tokenizer.json").write_text(
        (tmp_path / "tokenizer.json").read_text().replace("<|endoftext|>", "<|eot|>")
    )
    with pytest.raises(PylonError, match="changed after the dataset was prepared"):
        write_tokenizer_files(info, str(tmp_path / "again"), 512)
    with pytest.raises(PylonError, match="does not record where its files are"):
        write_tokenizer_files({**info, "uri": None}, str(tmp_path / "again"), 512)
    write_tokenizer_files({"kind": "byte"}, str(tmp_path / "none"), 512)  # the byte tokenizer has no files
    assert not (tmp_path / "none").exists()
