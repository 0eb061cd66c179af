"""A reasoning model's <think> block as `reasoning_content` (`pylon.serving.api.reasoning`): the two parsers' rules
on whole replies, and the same split whatever the stream's chunking (tags cut anywhere)."""

from __future__ import annotations

import random
from typing import get_args

import pytest

from pylon.serving.api.reasoning import END, PARSERS, ReasoningCount, ReasoningStream, split
from pylon.specs import HttpSpec

CASES = [
    # (reply, deepseek_r1's (reasoning, content), qwen3's)
    ("<think>plan it</think>The answer.", ("plan it", "The answer."), ("plan it", "The answer.")),
    ("\n<think>\nplan</think>\n\nAnswer", ("\nplan", "\n\nAnswer"), ("\nplan", "\n\nAnswer")),
    ("plan it</think>The answer.", ("plan it", "The answer."), (None, "plan it</think>The answer.")),
    (
        "still thinking when max_tokens ran out",
        ("still thinking when max_tokens ran out", ""),
        (None, "still thinking when max_tokens ran out"),
    ),
    ("<think></think>Just the answer", ("", "Just the answer"), ("", "Just the answer")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("x <think>y</think>", ("x <think>y", ""), (None, "x <think>y</think>")),
    ("<thin", ("<thin", ""), (None, "<thin")),
    ("", ("", ""), (None, "")),
    ("<think>unclosed", ("unclosed", ""), ("unclosed", "")),
]


@pytest.mark.parametrize("reply,r1,qwen3", CASES)
def test_each_parser_splits_a_whole_reply_by_its_rule(reply, r1, qwen3):
    assert split(reply, "deepseek_r1") == r1
    assert split(reply, "qwen3") == qwen3


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("reply,r1,qwen3", CASES)
def test_a_stream_cut_anywhere_gives_the_whole_replys_split(parser, reply, r1, qwen3):
    rng = random.Random(len(reply))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randrange(0, 6)))) if reply else []
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        stream = ReasoningStream(parser)
        thought, content = "", ""
        for piece in pieces:
            r, c = stream.feed(piece)
            assert not (c and stream.state != "answering"), "content went out before the reasoning ended"
            thought, content = thought + r, content + c
        r, c = stream.finish()
        thought, content = thought + r, content + c
        expected = r1 if parser == "deepseek_r1" else qwen3
        assert (thought if stream.had_reasoning else None, content) == expected, pieces


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("reply,r1,qwen3", CASES)
def test_reasoning_tokens_are_the_tokens_that_start_before_the_block_ends(parser, reply, r1, qwen3):
    """`ReasoningCount` over a reply cut into tokens anywhere (each token's text its own): the tokens that start
    before the end of the reasoning block's closing tag (the whole reply while it never closes; none without a
    block), whether they come one output at a time or several together."""
    thought, _ = r1 if parser == "deepseek_r1" else qwen3
    if thought is None:
        end = 0
    else:
        closed = reply.find(END, reply.find(thought) + len(thought)) if thought else reply.find(END)
        end = closed + len(END) if closed >= 0 else len(reply)
    rng = random.Random(len(reply) + len(parser))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randrange(0, 8)))) if reply else []
        starts = [0, *cuts]
        tokens = [reply[a:b] for a, b in zip(starts, [*cuts, len(reply)])] if reply else []
        count = ReasoningCount(parser, tokens.__getitem__)
        ids = list(range(len(tokens)))
        while ids:  # outputs of one to three tokens
            k = rng.randrange(1, 4)
            count.add(ids[:k])
            ids = ids[k:]
        assert count.finish() == sum(start < end for start in starts[: len(tokens)]), tokens


def test_a_tag_cut_between_chunks_is_never_sent_as_text():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("step one </th") == ("step one ", "")  # the tail that may be "</think>" waits
    assert stream.feed("ink>done") == ("", "done")
    stream = ReasoningStream("qwen3")
    assert stream.feed("  <thi") == ("", "")  # may still open a block
    assert stream.feed("nk>why") == ("why", "")


def test_the_spec_offers_the_parsers_this_module_has():
    field = HttpSpec.model_fields["reasoning_parser"]
    assert set(get_args(get_args(field.annotation)[0])) == set(PARSERS)
    with pytest.raises(ValueError, match="one of deepseek_r1, qwen3"):
        ReasoningStream("granite")
