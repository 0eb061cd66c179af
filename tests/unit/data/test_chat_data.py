"""Chat datasets (`pylon data prepare --chat`): each JSONL record's messages rendered by the tokenizer's chat
template and tokenized as the serving engine tokenizes a chat, packed like documents; the loss counts the
assistant's replies only (their tokens and each reply's end-of-turn), in training (`Batch.to_torch`'s labels, the
trainer's `token_loss_sum`) and in evaluation (`pylon eval`'s held-out rows); bad records name their file and line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.prepare import prepare
from pylon.data.reader import Batch
from pylon.data.shards import DataError
from pylon.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harmony_models import bpe_tokenizer  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Norway?"},
        {"role": "assistant", "content": "Oslo, on the fjord."},
    ],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there, friend"}],
]
REPLIES = ["Paris.<|im_end|>\n", "Oslo, on the fjord.<|im_end|>\n", "hello there, friend<|im_end|>\n"]


def _tokenizer(directory: Path, template: str = CHATML) -> str:
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c) * 3
    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], template, text=text, eos_token="<|im_end|>")
    tok.save_pretrained(directory)
    return str(directory)


def _jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_replies_are_the_assistants_turns_and_their_ends(tmp_path) -> None:
    tok = load_tokenizer(_tokenizer(tmp_path / "tok"))
    hf = tok._tok
    for conversation in CONVERSATIONS:
        ((ids, replies),) = tok.encode_chat(conversation, "test")  # rendered in order: one example
        rendered = hf.apply_chat_template(conversation, tokenize=False)
        assert ids.tolist() == hf(rendered, add_special_tokens=False)["input_ids"]  # as the engine tokenizes a chat
        spans, start = [], None  # each run of reply tokens, decoded
        for i, r in enumerate([*replies.tolist(), False]):
            if r and start is None:
                start = i
            elif not r and start is not None:
                spans.append(hf.decode(ids[start:i].tolist()))
                start = None
        want = [r for r in REPLIES if any(r.startswith(m["content"]) for m in conversation)]
        assert spans == want


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_a_prepared_chat_dataset_counts_the_loss_on_the_replies_only(tmp_path, fmt) -> None:
    from pylon.jobs.train import token_loss_sum

    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CONVERSATIONS * 3])
    out = str(tmp_path / "sft")
    manifest = prepare(
        [source], out, fmt=fmt, seq_len=32, tokenizer=tokenizer, chat=True, packing="wrapped", progress=False
    )
    assert manifest.loss_mask and manifest.dtype == "int32" and manifest.totals.documents == 6

    read, tokens, num_tokens, ids = read_rows(out)
    inputs = Batch(ids, tokens, num_tokens, 0.0, read.loss_mask).to_torch(tok.pad_id)
    real = inputs["attention_mask"].bool()
    want_ids, want_replies = [], []
    for conversation in CONVERSATIONS * 3:  # packed one after another, no eos between (the template ends turns)
        ((i, r),) = tok.encode_chat(conversation, "test")
        want_ids.append(i)
        want_replies.append(r)
    assert inputs["input_ids"][real].tolist() == np.concatenate(want_ids).tolist()
    labels = inputs["labels"][real]
    replies = torch.from_numpy(np.concatenate(want_replies))
    assert (labels[~replies] == -100).all() and (labels[replies] == inputs["input_ids"][real][replies]).all()
    # The trainer's loss counts those tokens (each predicted from the one before it, within a row) and no other.
    logits = torch.randn(*inputs["input_ids"].shape, len(tok._tok))
    _, counted = token_loss_sum(logits, inputs["labels"])
    assert counted == int((inputs["labels"][:, 1:] != -100).sum()) and 0 < counted < int(replies.sum()) + 1
    # Without the mask every real token counts: the same rows read as a pretraining dataset would be wrong.
    plain = Batch(ids, np.abs(tokens), num_tokens, 0.0).to_torch(tok.pad_id)
    assert int((plain["labels"] != -100).sum()) == int(real.sum())


def test_held_out_chat_rows_score_the_replies_only(tmp_path) -> None:
    from pylon.sdk.evaluate import held_out, prompt_loss_sum

    tokenizer = _tokenizer(tmp_path / "tok")
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CONVERSATIONS * 4])
    out = str(tmp_path / "sft")
    prepare([source], out, seq_len=16, tokenizer=tokenizer, chat=True, progress=False)
    held = held_out(out, 0.25)
    assert held.loss_mask and held.sequences
    for seq in held.sequences:
        assert (held.token_ids(seq) >= 0).all() and held.counted(seq).tolist() == (seq >= 0).tolist()
    logprobs = [None, -1.0, -2.0, -4.0]
    assert prompt_loss_sum(logprobs, 4, [True, False, True, True]) == (6.0, 2)  # the first position predicts none
    assert prompt_loss_sum(logprobs, 4) == (7.0, 3)


def test_a_records_tools_reach_the_template_and_calls_are_replies(tmp_path) -> None:
    """A record's `tools` go to the chat template (as the chat API's do), and an assistant turn that calls one is
    a reply the loss counts like any other."""
    template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
        "{% endif %}"
        + CHATML.replace(
            "{{ m['content'] }}",
            "{{ m['content'] or '' }}{% for c in m.get('tool_calls') "
            "or [] %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}",
        )
    )
    tokenizer = _tokenizer(tmp_path / "tok", template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    conversation = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    tok = load_tokenizer(tokenizer)
    ((ids, replies),) = tok.encode_chat(conversation, "test", tools)
    text = tok._tok.decode(ids.tolist())
    assert text.startswith("<|im_start|>system\nget_weather;<|im_end|>")
    spans = tok._tok.decode(ids[replies].tolist())
    assert spans == "<tool_call>get_weather</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n"
    source = _jsonl(tmp_path / "calls.jsonl", [{"messages": conversation, "tools": tools}])
    manifest = prepare(
        [source], str(tmp_path / "out"), seq_len=64, tokenizer=tokenizer, chat=True, packing="wrapped", progress=False
    )
    _, tokens, num_tokens, _ = read_rows(str(tmp_path / "out"))
    stored = np.concatenate([row[:n] for row, n in zip(tokens, num_tokens)])
    assert manifest.totals.tokens == len(ids) and (stored >= 0).tolist() == replies.tolist()
    with pytest.raises(DataError, match="line 1: tools: a list of tool objects"):
        prepare([_jsonl(tmp_path / "bad.jsonl", [{"messages": conversation, "tools": "x"}])], str(tmp_path / "o2"),
                tokenizer=tokenizer, chat=True, progress=False)  # fmt: skip


def test_bad_chat_records_name_their_file_and_line(tmp_path) -> None:
    tokenizer = _tokenizer(tmp_path / "tok")
    out = str(tmp_path / "out")
    cases = [
        ([{"messages": CONVERSATIONS[0]}, {"text": "no messages"}], "line 2: no 'messages' field"),
        ([{"messages": []}], "line 1: messages: a conversation is a non-empty list"),
        ([{"messages": [{"content": "no role"}]}], "line 1: messages.0: a message is an object with a string role"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "line 1: messages: no assistant message"),
    ]
    for records, says in cases:
        source = _jsonl(tmp_path / "bad.jsonl", records)
        with pytest.raises(DataError, match=says):
            prepare([source], out, tokenizer=tokenizer, chat=True, progress=False)
    source = _jsonl(tmp_path / "good.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match="needs a Hugging Face tokenizer directory with a chat template"):
        prepare([source], out, chat=True, progress=False)  # the byte tokenizer
    (tmp_path / "plain.txt").write_text("just text")
    with pytest.raises(DataError, match="a chat dataset is JSON Lines"):
        prepare([str(tmp_path / "plain.txt")], out, tokenizer=tokenizer, chat=True, progress=False)
    # A template whose assistant turn is not what its generation prompt opens cannot say where a reply starts.
    opens_otherwise = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>{% endif %}")
    other = _tokenizer(tmp_path / "opens-otherwise", opens_otherwise)
    source = _jsonl(tmp_path / "two.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=r"two.jsonl: line 1: message 2: the chat template renders this reply's turn"):
        prepare([source], out, tokenizer=other, chat=True, progress=False)


def test_a_template_that_rewrites_earlier_turns_gives_one_example_per_reply(tmp_path) -> None:
    """A template that renders earlier replies otherwise once the conversation goes on (here it drops them, as
    Qwen3's drops past reasoning): each reply is learnt from the conversation up to it as the template renders it
    then, one example each, only that reply counted."""
    forgetful = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = load_tokenizer(_tokenizer(tmp_path / "forgetful", forgetful))
    examples = tok.encode_chat(CONVERSATIONS[0], "test")
    assert len(examples) == 2
    for (ids, replies), reply, upto in zip(examples, REPLIES[:2], (3, 5)):
        assert ids.tolist() == tok._tok(tok._tok.apply_chat_template(CONVERSATIONS[0][:upto], tokenize=False),
                                        add_special_tokens=False)["input_ids"]  # fmt: skip
        assert tok._tok.decode(ids[replies].tolist()) == reply
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATIONS[0]}])
    manifest = prepare([source], str(tmp_path / "out"), seq_len=32, tokenizer=str(tmp_path / "forgetful"), chat=True,
                       packing="wrapped", progress=False)  # fmt: skip
    assert manifest.totals.documents == 1 and manifest.totals.tokens == sum(len(i) for i, _ in examples)
