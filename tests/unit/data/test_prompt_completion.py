"""Prompt-completion datasets (`pylon data prepare --prompt-completion`, TRL's prompt-completion format): each JSONL
record's prompt tokenized as a completions request's prompt is (with the special tokens the tokenizer adds), then its
completion and eos; the loss on the completion and its eos only; each record whole in a row and attended on its own
by default; bad records name their file, line and field."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pylon.data.prepare import prepare
from pylon.data.reader import Batch
from pylon.data.shards import DataError, separate_documents
from pylon.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harmony_models import bpe_tokenizer  # noqa: E402
from test_chat_data import _jsonl  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

RECORDS = [
    {"prompt": "Translate to French: cat", "completion": " chat"},
    {"prompt": "Translate to French: dog", "completion": " chien"},
    {"prompt": "Q: 2 + 2 =", "completion": " 4"},
]


def test_the_loss_counts_each_completion_and_its_eos(tmp_path) -> None:
    text = " ".join(r["prompt"] + r["completion"] for r in RECORDS) * 4
    from tokenizers.processors import TemplateProcessing

    hf = bpe_tokenizer(["<s>", "</s>"], None, text=text, eos_token="</s>", bos_token="<s>")
    hf.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # Llama's
    hf.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    out = str(tmp_path / "pc")
    manifest = prepare([_jsonl(tmp_path / "pc.jsonl", RECORDS)], out, seq_len=64, tokenizer=str(tmp_path / "tok"),
                       prompt_completion=True, progress=False)  # fmt: skip
    assert manifest.prompt_completion and manifest.loss_mask and manifest.packing == "bfd"
    assert manifest.totals.documents == 3 and "the loss on the completions" in manifest.summary()
    assert separate_documents("auto", manifest, out)  # each record attended on its own
    _, tokens, num_tokens, ids = read_rows(out)
    inputs = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id, documents=True)
    got = [t for row, n in zip(inputs["input_ids"].tolist(), num_tokens) for t in row[:n]]
    want, counted = [], []
    for r in RECORDS:
        prompt = hf(r["prompt"])["input_ids"]  # as a completions request's prompt: with its BOS
        assert prompt[0] == hf.bos_token_id
        completion = hf(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_id]
        want += prompt + completion
        counted += completion
    assert sorted(got) == sorted(want)  # every record's tokens, each whole in the one row
    labels = inputs["labels"]
    assert sorted(labels[labels != -100].tolist()) == sorted(counted)


def test_bad_records_name_their_line_and_field(tmp_path) -> None:
    cases = [
        ({"prompt": "x"}, "line 1: no 'completion' field"),
        ({"prompt": 3, "completion": "y"}, "line 1: prompt is a int, not a string"),
        ({"prompt": "x", "completion": ""}, "line 1: completion is empty: nothing in it to learn"),
        (["x", "y"], "line 1: a record is an object with 'prompt' and 'completion' strings"),
    ]
    for i, (record, message) in enumerate(cases):
        source = _jsonl(tmp_path / f"bad{i}.jsonl", [record])
        with pytest.raises(DataError, match=message):
            prepare([source], str(tmp_path / f"o{i}"), prompt_completion=True, progress=False)
    (tmp_path / "plain.txt").write_text("text")
    with pytest.raises(DataError, match="a prompt-completion dataset is JSON Lines"):
        prepare([str(tmp_path / "plain.txt")], str(tmp_path / "o9"), prompt_completion=True, progress=False)
    with pytest.raises(DataError, match="chat, prompt_completion, preference and prompts: choose one"):
        prepare([source], str(tmp_path / "o8"), chat=True, prompt_completion=True, progress=False)


def test_the_byte_tokenizer_works_too(tmp_path) -> None:
    manifest = prepare([_jsonl(tmp_path / "pc.jsonl", RECORDS)], str(tmp_path / "pc"), seq_len=48,
                       prompt_completion=True, progress=False)  # fmt: skip
    _, tokens, num_tokens, ids = read_rows(str(tmp_path / "pc"))
    labels = Batch(ids, tokens, num_tokens, 0.0, True, 256).to_torch(257, documents=True)["labels"]
    want = sum(len(r["completion"].encode()) + 1 for r in RECORDS)
    assert manifest.dtype == "int32" and int((labels != -100).sum()) == want
    assert np.isin(labels[labels != -100].numpy(), [256, *b" chatien4"]).all()
