"""A reasoning model's thinking, apart from its answer: `reasoning_content` beside `content` in chat replies.

Models trained to think before answering (DeepSeek-R1 and its distillations, Qwen3, QwQ) write their reasoning
between `<think>` and `</think>`, then the answer. A deployment that sets `http.reasoning_parser` gets that part of
each chat reply as the message's `reasoning_content` (streamed as `delta.reasoning_content`), the rest as
`content`, as vLLM's reasoning parsers of the same names give them:

- `deepseek_r1`: the chat template opens the block (the prompt ends with `<think>`), so the reply starts inside
  it: everything up to the first `</think>` is reasoning (all of it while none has come: a reply cut short by
  max_tokens is reasoning only). A `<think>` the model writes again at the start is dropped.
- `qwen3`: the model opens the block itself: a reply that starts with `<think>` (after whitespace) has its
  reasoning up to `</think>`; any other reply is all content (Qwen3 with `enable_thinking: false`, whose template
  writes an empty block into the prompt).

The tags themselves are in neither part. Tool calls are read from the content only. Completions
(`/v1/completions`) return the raw text. A chat whose output a grammar constrains (`response_format`, a required or
named `tool_choice`) is split the same way: its grammar lets the reasoning come first (`reply_guide`).
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # http.reasoning_parser's values (a test keeps the spec's list equal to this)


def split(text: str, parser: str) -> tuple[str | None, str]:
    """A whole reply as (reasoning, content); reasoning None where the reply has none."""
    stream = ReasoningStream(parser)
    parts = [stream.feed(text), stream.finish()]
    reasoning = "".join(r for r, _ in parts)
    content = "".join(c for _, c in parts)
    return (reasoning if stream.had_reasoning else None), content


class ReasoningStream:
    """A reply's text as it streams, told apart: `feed` gives (reasoning, content) that can go out now, holding back
    only a tail that may still grow into a tag; `finish` gives the rest at the end of the reply."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(PARSERS)}")
        self.parser = parser
        # "start": nothing decided yet (qwen3: the reply may open with <think>; deepseek_r1: may repeat it)
        self.state = "start"
        self.held = ""
        self.had_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                return "", ""  # whitespace, or the start of a <think> tag: wait
            if stripped.startswith(START):
                self.held = stripped[len(START) :]
                self.state = "thinking"
            elif self.parser == "deepseek_r1":
                self.state = "thinking"  # the template opened the block
            else:
                self.state = "answering"  # qwen3: no block
        if self.state == "thinking":
            self.had_reasoning = True
            at = self.held.find(END)
            if at < 0:
                keep = tag_prefix(self.held, END)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return reasoning, ""
            reasoning, self.held = self.held[:at], self.held[at + len(END) :]
            self.state = "answering"
        if self.state == "answering":
            content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the reply: reasoning left open stays reasoning; a reply that was only
        whitespace or part of a tag is content (qwen3) or reasoning (deepseek_r1, whose block the template opened)."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        if self.state == "start" and self.parser == "deepseek_r1":
            self.had_reasoning = True
            return held, ""
        return "", held


class ReasoningCount:
    """How many of a reply's tokens are its reasoning (`usage.completion_tokens_details.reasoning_tokens`, as OpenAI
    reports a reasoning model's hidden tokens): each generated token's own text (`texts(id)`) goes through a parser of
    its own, and a token counts while the reply is in its reasoning block, the ones that open and close it included
    (all of them while the block is open: a reply cut short; none for a reply without a block)."""

    def __init__(self, parser: str, texts):
        self._stream = ReasoningStream(parser)
        self._texts = texts
        self.tokens = 0  # reasoning tokens so far
        self._pending = 0  # tokens fed while undecided (whitespace, part of a tag): reasoning if the block opens

    def add(self, token_ids) -> None:
        stream = self._stream
        for token_id in token_ids:
            if stream.state == "answering":
                return
            stream.feed(self._texts(token_id))
            if stream.state == "start":
                self._pending += 1
            elif stream.had_reasoning:  # inside the block, or the token that closed it
                self.tokens += self._pending + 1
                self._pending = 0

    def finish(self) -> int:
        if self._stream.state == "start" and self._stream.parser == "deepseek_r1":
            self.tokens += self._pending  # deepseek_r1: the template opened the block; undecided text is reasoning
        self._pending = 0
        return self.tokens


def tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until the next text)."""
    longest = min(len(tag) - 1, len(text))
    return next((k for k in range(longest, 0, -1) if tag.startswith(text[-k:])), 0)
