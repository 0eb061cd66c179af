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


def test_conversational_records_are_rendered_by_the_template_the_loss_on_the_completion_only(tmp_path) -> None:
    """TRL's conversational prompt-completion format: the prompt a list of messages, the completion the messages after
    it (ending with the assistant's). Each record is rendered and tokenized as a chat dataset's conversation, the loss
    on the completion's reply only (not the replies in its prompt); its prompt's messages are kept in its record (for
    objective grpo's reward functions), not as a record field."""
    from test_chat_data import _tokenizer

    from pylon.data.reader import RecordReader
    from pylon.data.shards import PROMPT_MESSAGES

    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    hf = tok._tok
    first = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "capital of France?"}]
    later = [*first, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Norway?"}]
    records = [
        {"prompt": first, "completion": [{"role": "assistant", "content": "Paris."}], "id": 1},
        {"prompt": later, "completion": [{"role": "assistant", "content": "Oslo, on the fjord."}]},
    ]
    out = str(tmp_path / "pc")
    manifest = prepare([_jsonl(tmp_path / "pc.jsonl", records)], out, seq_len=128, tokenizer=tokenizer,
                       prompt_completion=True, progress=False)  # fmt: skip
    assert manifest.prompt_format == "conversational" and manifest.record_fields == ["id"] and manifest.has_records
    assert "prompts and completions, the loss on the completions (as conversations)" in manifest.summary()
    _, tokens, num_tokens, ids = read_rows(out)
    inputs = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id, documents=True)
    got = [row[:n] for row, n in zip(inputs["input_ids"].tolist(), num_tokens)]
    whole = [hf.apply_chat_template(r["prompt"] + r["completion"], tokenize=False) for r in records]
    want = [hf(text, add_special_tokens=False)["input_ids"] for text in whole]  # as the engine tokenizes a chat
    assert sum(map(len, got)) == sum(map(len, want))
    for doc in want:  # each whole, in one row
        assert any(row[i : i + len(doc)] == doc for row in got for i in range(len(row))), doc
    labels = inputs["labels"]
    counted = [hf.decode(row[row != -100].tolist()) for row in labels]
    a, b = "Paris.<|im_end|>\n", "Oslo, on the fjord.<|im_end|>\n"
    assert "".join(counted) in (a + b, b + a)  # each completion's reply, not the reply in the second's prompt
    rows = RecordReader(out, manifest).rows(ids)
    kept = sorted((d[PROMPT_MESSAGES], d.get("id")) for row in rows for d in row)
    assert kept == sorted((r["prompt"], r.get("id")) for r in records)
    mixed = prepare([_jsonl(tmp_path / "mixed.jsonl", [*records, {"prompt": "Q: ", "completion": "A."}])],
                    str(tmp_path / "mixed"), seq_len=128, tokenizer=tokenizer, prompt_completion=True,
                    progress=False)  # fmt: skip
    assert mixed.prompt_format == "mixed" and "(as text and as conversations)" in mixed.summary()
    user = [{"role": "user", "content": "hi"}]
    for i, (record, message) in enumerate([
        ({"prompt": user, "completion": "hello"}, r"line 1: completion: a non-empty list of messages, as prompt is "
                                                  r"\(a str\); TRL's conversational format"),
        ({"prompt": user}, r"line 1: completion: a non-empty list of messages, as prompt is \(absent\)"),
        ({"prompt": [], "completion": user}, "line 1: prompt: a non-empty list of messages"),
        ({"prompt": user, "completion": [{"role": "assistant", "content": "a"}, *user]},
         "line 1: completion: the conversation must end with the assistant's reply"),
        ({"prompt": user, "completion": [{"content": "a"}]}, r"line 1\.1: a message is an object with a string role"),
    ]):  # fmt: skip
        with pytest.raises(DataError, match=message):
            prepare([_jsonl(tmp_path / f"bad{i}.jsonl", [record])], str(tmp_path / f"bad{i}"), tokenizer=tokenizer,
                    prompt_completion=True, progress=False)  # fmt: skip
    with pytest.raises(DataError, match="conversational records need a Hugging Face tokenizer directory with a chat"):
        prepare([_jsonl(tmp_path / "b.jsonl", records)], str(tmp_path / "b"), prompt_completion=True, progress=False)
