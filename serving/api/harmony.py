"""OpenAI's harmony format (the chat format of gpt-oss-20b and gpt-oss-120b), read from the token ids a model
generates: its reasoning as `reasoning_content`, its answer as `content`, its function calls as `tool_calls`, as vLLM's
openai_gptoss reasoning parser and openai tool parser give them.

A harmony chat is a run of messages, each `<|start|>{header}<|message|>{body}<|end|>`, all the markers special
tokens. The header is the author's role, then `<|channel|>` and the channel, with a recipient (` to=functions.NAME`)
before or after the channel and an optional ` <|constrain|>json` saying what the body is. A reply ends its last
message with `<|return|>` (its final answer) or `<|call|>` (a tool call) instead of `<|end|>`. The chat prompt ends
with `<|start|>assistant`, so a reply starts in the middle of its first header:

    <|channel|>analysis<|message|>The user asks the weather. Call the tool.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>

Read by message (each message's body decoded alone, its header never part of the text):
  - the `analysis` channel is the model's reasoning (its chain of thought, which OpenAI never shows users);
  - the `final` channel is the answer, and so is `commentary` without a recipient (a preamble the model writes to the
    user before it calls tools);
  - a message to `functions.NAME`, on any channel, is a call of NAME with the body as its arguments: a tool call when
    the request declared NAME and the body is a JSON object (the arguments re-serialised, the call given an id), else
    content text, its raw body, as `pylon.serving.api.tools` gives back a call that does not parse. Messages to the
    built-in tools gpt-oss knows (`browser.search`, `python`) are content text the same way: the server runs none.
Several messages of one kind are joined with a newline. A reply cut short keeps what its open message had (reasoning,
content; an unfinished call is content text); a header cut short is dropped. A reply with neither `<|channel|>` nor
`<|message|>` is not harmony at all (a model that lost the format): all of it is content, without special tokens.
Special tokens inside a body are no part of its text.

Streaming gives each message's text as it comes (`feed`), holding back only a character still incomplete; a call's
body is held until it ends, when it becomes a call or content, and a reply's first tokens until a `<|channel|>` or
`<|message|>` shows it is harmony (a reply that never does goes out whole at its end). `reasoning_tokens` counts the
analysis messages' tokens, header and end token included (a call on the analysis channel is no reasoning). The ids
of the marker tokens come from the tokenizer (`HarmonyTokens.of`), which has them as special tokens only where the
model speaks harmony.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from pylon.serving.engine.tokenization import IncrementalDetokenizer

MARKERS = {
    "start": "<|start|>",
    "end": "<|end|>",
    "message": "<|message|>",
    "channel": "<|channel|>",
    "constrain": "<|constrain|>",
    "return_": "<|return|>",
    "call": "<|call|>",
}
FUNCTIONS = "functions."  # the recipient prefix of the request's functions (harmony's `functions` namespace)
RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
CHANNEL = re.compile(r"\s*([^\s<]+)")


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's special tokens in a model's tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def of(cls, tokenizer) -> HarmonyTokens | None:
        """The ids in `tokenizer` (the serving wrapper, or a Hugging Face or `tokenizers` tokenizer itself); None where
        it lacks any of them (a model that does not speak harmony)."""
        inner = getattr(tokenizer, "_tok", tokenizer)
        ids = {}
        for field, token in MARKERS.items():
            found = _token_id(inner, token)
            if found is None:
                return None
            ids[field] = found
        return cls(**ids)

    @property
    def ends(self) -> frozenset[int]:
        """The tokens that end a message."""
        return frozenset((self.end, self.return_, self.call))

    @property
    def ids(self) -> frozenset[int]:
        """All seven."""
        return frozenset((self.start, self.end, self.message, self.channel, self.constrain, self.return_, self.call))


def _token_id(tokenizer, token: str) -> int | None:
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is not None:  # transformers: an unknown token is the unk token's id (or None); only its own id counts
        found = to_id(token)
        to_token = getattr(tokenizer, "convert_ids_to_tokens", None)
        if isinstance(found, int) and found >= 0 and (to_token is None or to_token(found) == token):
            return found
        return None
    to_id = getattr(tokenizer, "token_to_id", None)  # a `tokenizers` Tokenizer
    found = to_id(token) if to_id is not None else None
    return int(found) if found is not None else None


def parse(
    tokenizer, tokens: HarmonyTokens, token_ids: list[int], functions: Collection[str] | None = None
) -> tuple[str | None, str | None, list[dict]]:
    """A whole reply as (reasoning, content, tool calls): reasoning None where the reply had no analysis message,
    content None where it is empty and there are calls. `functions`: the names of the request's functions (None: no
    tools), the only ones whose calls become tool calls."""
    stream = HarmonyStream(tokenizer, tokens, functions)
    reasoning, content = stream.feed(token_ids)
    more_reasoning, more_content, calls = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if stream.had_reasoning else None), (content or None) if calls else content, calls


class HarmonyStream:
    """A reply's token ids as they are generated, read as harmony: `feed` gives the (reasoning, content) text that can
    go out now, `finish` the rest and the reply's tool calls at its end."""

    def __init__(self, tokenizer, tokens: HarmonyTokens, functions: Collection[str] | None = None):
        self._tokenizer = tokenizer
        self._tokens = tokens
        self._functions = functions
        self._ends = tokens.ends
        inner = getattr(tokenizer, "_tok", None)
        named = (getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None))
        # Tokens that are never text: harmony's, and the tokenizer's own special ones (an <|endoftext|> the engine
        # stopped on is among the generated ids).
        self._specials = tokens.ids | {i for i in named if isinstance(i, int)}
        self._specials |= set(getattr(inner, "all_special_ids", None) or ())
        self._harmony = False  # a <|channel|> or <|message|> has come: the reply is harmony
        self._plain: list[int] = []  # the ids until then: all content if the reply never turns out to be harmony
        self._header: list[int] = []  # the header being read (between messages)
        self._kind: str | None = None  # the open message's: "reasoning", "content" or "call"; None in a header
        self._name = ""  # the open call's function
        self._body: list[int] = []  # the open call's body
        self._text: IncrementalDetokenizer | None = None  # the open reasoning or content message's body
        self._fresh = False  # nothing of the open message is out yet
        self._said = {"reasoning": False, "content": False}  # text of each kind is out (the next is joined by "\n")
        self._calls: list[dict] = []
        self.had_reasoning = False  # an analysis message was seen
        self.reasoning_tokens = 0  # tokens of analysis messages, their headers and end tokens included

    def feed(self, token_ids: list[int]) -> tuple[str, str]:
        """(reasoning, content) text that can go out now for these newly generated ids."""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        tokens = self._tokens
        for token in token_ids:
            token = int(token)
            if not self._harmony:
                if token in (tokens.channel, tokens.message):
                    self._harmony, self._plain = True, []
                else:
                    self._plain.append(token)
            if self._kind is None:
                self._header_token(token, out)
            else:
                self._body_token(token, out)
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str, list[dict]]:
        """(reasoning, content) still to send at the end of the reply, and the reply's tool calls (OpenAI's shape)."""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        if not self._harmony:
            text = self._tokenizer.decode([i for i in self._plain if i not in self._specials])
            self._plain = []
            self._fresh = True
            self._emit("content", text, out)
        elif self._kind == "call":  # cut short in a call's body: its text, as a call that does not parse
            self._emit("content", self._tokenizer.decode(self._body), out)
        elif self._kind is not None:
            self._emit(self._kind, self._text.flush(), out)
        self._kind, self._header, self._body, self._text = None, [], [], None
        return "".join(out["reasoning"]), "".join(out["content"]), list(self._calls)

    def _header_token(self, token: int, out: dict[str, list[str]]) -> None:
        tokens = self._tokens
        if token == tokens.start:
            self._header = [token]
        elif token in self._ends:
            self._header = []  # a message without a body: nothing to read
        elif token == tokens.message:
            self._open(self._header + [token])
            self._header = []
        else:
            self._header.append(token)

    def _open(self, header: list[int]) -> None:
        channel, recipient = self._read_header(header)
        self._fresh = True
        if recipient is not None:
            name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else ""
            if name and self._functions is not None and name in self._functions:
                self._kind, self._name, self._body = "call", name, []
                return
            self._kind = "content"  # a call of something the request did not declare: its text
        elif channel == "analysis":
            self._kind = "reasoning"
            self.had_reasoning = True
            self.reasoning_tokens += len(header)
        else:
            self._kind = "content"  # final, a preamble on commentary, or a channel harmony does not have
        self._text = IncrementalDetokenizer(self._tokenizer, [], [])

    def _read_header(self, header: list[int]) -> tuple[str | None, str | None]:
        """(channel, recipient) of a header; either None where it names none."""
        tokens, parts, run = self._tokens, [], []
        for token in header:
            if token in self._specials:
                if run:
                    parts.append(self._tokenizer.decode(run))
                    run = []
                parts.append({tokens.channel: "<|channel|>", tokens.constrain: "<|constrain|>"}.get(token, " "))
            else:
                run.append(token)
        if run:
            parts.append(self._tokenizer.decode(run))
        text = "".join(parts)
        _, has_channel, after = text.partition("<|channel|>")
        channel = CHANNEL.match(after) if has_channel else None
        recipient = RECIPIENT.search(text)
        return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)

    def _body_token(self, token: int, out: dict[str, list[str]]) -> None:
        kind = self._kind
        if kind == "reasoning" and token != self._tokens.start:
            self.reasoning_tokens += 1
        if token in self._ends or token == self._tokens.start:  # the message ends (<|start|>: without its end token)
            self._close(out)
            if token == self._tokens.start:
                self._header = [token]
            return
        if token in self._specials:
            return  # no text (a marker out of place, a special token of the tokenizer)
        if kind == "call":
            self._body.append(token)
        else:
            self._emit(kind, self._text.add(token), out)

    def _close(self, out: dict[str, list[str]]) -> None:
        if self._kind == "call":
            text = self._tokenizer.decode(self._body)
            arguments = _arguments(text)
            if arguments is None:
                self._emit("content", text, out)
            else:
                self._calls.append(
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": self._name, "arguments": arguments},
                    }
                )
        else:
            self._emit(self._kind, self._text.flush(), out)
        self._kind, self._name, self._body, self._text = None, "", [], None

    def _emit(self, kind: str, text: str, out: dict[str, list[str]]) -> None:
        if not text:
            return
        if self._fresh and self._said[kind]:
            text = "\n" + text  # a message after another of its kind
        self._fresh = False
        self._said[kind] = True
        out[kind].append(text)


def _arguments(body: str) -> str | None:
    """A call's body as its `arguments` (the JSON object re-serialised), or None where it is not a JSON object."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
