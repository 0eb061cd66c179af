"""Tokenizers: the built-in byte tokenizer, a real BPE trained here and saved as `tokenizers` JSON, and the
same BPE as a Hugging Face tokenizer directory; from local paths and memory:// URIs. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pylon import storage
from pylon.data.shards import DataError
from pylon.data.tokenizer import load_tokenizer
from pylon.presets import BYTE_VOCAB_SIZE

TRAINING_TEXT = [
    "def tokenize(text):\n    return [ord(c) for c in text]\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ist schön.\n",
    "for i in range(10):\n    print(i, i * i)\n",
] * 20
SAMPLE = "def fox(x):\n    return 'schön' * x  # ünseen wörds 🦊\n"


def train_bpe(special_tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "stdlib-bpe.json"
    train_bpe(["<|endoftext|>", "<pad>"]).save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf") / "stdlib-tok"
    tok = train_bpe(["</s>", "<unk>", "[PAD]"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="[PAD]").save_pretrained(str(path))
    return path


def upload(local: Path, uri: str) -> None:
    for file in sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]:
        target = storage.join(uri, str(file.relative_to(local))) if local.is_dir() else uri
        storage.atomic_write(target, file.read_bytes())


def test_byte_tokenizer_is_utf8_bytes_with_eos_and_pad_above_them():
    tok = load_tokenizer()
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int64
    assert ids.tolist() == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, BYTE_VOCAB_SIZE)
    # Special ids carry no text; a character cut in half decodes to U+FFFD instead of failing.
    assert tok.decode([104, 105, 256, 257, 257]) == "hi"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"
    info = tok.info
    assert (info.kind, info.name, info.vocab_size, info.eos_id, info.pad_id) == ("byte", "byte", 320, 256, 257)
    assert info.sha256 is None


def test_tokenizers_json_file_round_trips_and_finds_eos_and_pad(bpe_file):
    tok = load_tokenizer(str(bpe_file))
    raw = Tokenizer.from_file(str(bpe_file))
    assert tok.eos_id == raw.token_to_id("<|endoftext|>") and tok.pad_id == raw.token_to_id("<pad>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int64 and len(ids) < len(SAMPLE.encode())  # merges learned from the training text
    assert ids.tolist() == raw.encode(SAMPLE, add_special_tokens=False).ids
    assert tok.decode(ids) == SAMPLE
    info = tok.info
    assert (info.kind, info.name, info.eos_id, info.pad_id) == ("tokenizers", "stdlib-bpe.json", tok.eos_id, tok.pad_id)
    h = hashlib.sha256()
    data = bpe_file.read_bytes()
    h.update(b"tokenizer.json\0" + len(data).to_bytes(8, "little") + data)
    assert info.sha256 == h.hexdigest()


def test_tokenizer_identity_follows_content_not_location(bpe_file, tmp_path):
    copy = tmp_path / "renamed.json"
    shutil.copy(bpe_file, copy)
    assert load_tokenizer(str(copy)).info.sha256 == load_tokenizer(str(bpe_file)).info.sha256
    # Rewritten in place with different content: a different tokenizer, never a stale cached one.
    train_bpe(["<|endoftext|>"]).save(str(copy))
    changed = load_tokenizer(str(copy))
    assert changed.info.sha256 != load_tokenizer(str(bpe_file)).info.sha256
    assert changed.pad_id == changed.eos_id  # no pad token in this one: pad with eos


def test_tokenizer_from_a_uri_matches_the_local_file(bpe_file):
    uri = "memory://tokenizers/stdlib-bpe.json"
    upload(bpe_file, uri)
    try:
        remote, local = load_tokenizer(uri), load_tokenizer(str(bpe_file))
        assert remote.info == local.info
        assert remote.encode(SAMPLE).tolist() == local.encode(SAMPLE).tolist()
    finally:
        fsspec.filesystem("memory").rm("/tokenizers", recursive=True)


def test_huggingface_directory_local_and_from_a_uri(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.eos_id == raw.token_to_id("</s>") and tok.pad_id == raw.token_to_id("[PAD]")
    assert tok.encode(SAMPLE).tolist() == raw.encode(SAMPLE, add_special_tokens=False).ids
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    info = tok.info
    assert (info.kind, info.name) == ("huggingface", "stdlib-tok")
    h = hashlib.sha256()
    for f in sorted(p for p in hf_dir.iterdir()):
        data = f.read_bytes()
        h.update(f.name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert info.sha256 == h.hexdigest()
    uri = "memory://hf/stdlib-tok"
    upload(hf_dir, uri)
    try:
        assert load_tokenizer(uri).info == info
    finally:
        fsspec.filesystem("memory").rm("/hf", recursive=True)


def test_a_tokenizer_without_an_end_of_document_token_is_refused_with_what_to_add(tmp_path):
    path = tmp_path / "no-eos.json"
    train_bpe(["<unk>"]).save(str(path))
    with pytest.raises(DataError, match=r"no-eos\.json: has no end-of-document token; add one of <\|endoftext\|>"):
        load_tokenizer(str(path))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.json", "no such file or directory"),
        (lambda d: (d / "garbage.json").write_text("{not json") and d / "garbage.json", "not a `tokenizers` JSON file"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "an empty directory"),
        (
            lambda d: (d / "notatok").mkdir() or (d / "notatok" / "readme.txt").write_text("hi") and d / "notatok",
            "not a Hugging Face tokenizer directory",
        ),
    ],
)
def test_missing_or_unparseable_tokenizers_name_the_path(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError, match=message) as caught:
        load_tokenizer(str(path))
    assert str(path) in str(caught.value)
