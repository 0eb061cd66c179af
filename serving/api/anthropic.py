"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat path, as vLLM and
SGLang serve it for Anthropic's SDKs and the tools built on them: a request becomes the chat request it means
(`MessagesRequest.chat`), runs as any chat does (the model's template, tools, reasoning, grammars, batching), and its
answer is Anthropic's message (`message_object`) or its stream of events (`MessageEvents`).

What maps to what:

- `system` (a string or text blocks) is the system message; a user message's text and image blocks (base64 or URL)
  its content, its `tool_result` blocks tool messages before it; an assistant message's text its content, its
  `tool_use` blocks its tool calls, its `thinking` blocks its reasoning (`reasoning_content`, which templates read).
- `max_tokens` (required), `stop_sequences`, `temperature` (0 to 1), `top_p`, `top_k` and the chat's `seed` (which
  Anthropic's newer clients send in `extra_body`); `metadata.user_id` is the chat's `user`; `output_config.format`
  (a JSON schema the reply is held to, as response_format holds a chat's) and `output_config.effort`
  (reasoning_effort); `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool` with
  its `name`, `none`; `disable_parallel_tool_use`); `thinking` `enabled` with `budget_tokens` (vLLM's
  `thinking_token_budget`, and `enable_thinking` for the template), `adaptive`, `between_tools` or `disabled`;
  `cache_control`, `speed`, `service_tier`, `inference_geo` are accepted and change nothing (the prefix cache is
  automatic).
- The answer: `thinking`, `text` and `tool_use` blocks; `stop_reason` `end_turn`, `stop_sequence` (with the
  `stop_sequence` that ended it, removed from the text as Anthropic does), `max_tokens` or `tool_use`; `usage` with
  `input_tokens` (those not read from the prefix cache), `cache_read_input_tokens` (those read) and `output_tokens`.
- Streamed: `message_start`, `ping`, each block's `content_block_start`, deltas (`text_delta`, `thinking_delta`,
  `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`; an
  error after the stream started is an `error` event.
- A refusal is Anthropic's error object (`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`,
  with the field at fault as `param`), through `anthropic_errors`; `x-api-key` is taken for a key as Anthropic's
  clients send it (`server._authorize`).

- A user message's `document` blocks (a plain-text document, or a content document of text and images) and
  `search_result` blocks are read as text, after their title (and a document's context). A tool result's content
  may hold text, images, documents and search results: its text is the tool message; its images open the user
  message after the tool messages (a chat's tool message holds text only).

Not there, said plainly: server tools (`web_search`, `bash`, ...: a 400 naming `tools.<i>.type`), PDF, URL and file
documents (a 400 naming the source), citations (a 400 naming `citations` where enabled), and thinking `signature`s
(empty: nothing here signs reasoning).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pylon.serving.api import protocol
from pylon.serving.errors import InvalidRequest

MAX_STOP_SEQUENCES = 16


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """`POST /v1/messages`: Anthropic's fields (strict, as Anthropic's API is: an unknown field is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None  # (the chat's: a sampled reply that comes out the same each time)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema"}} (the reply's JSON held to it), {"effort"} (reasoning_effort)
    output_config: dict[str, Any] | None = None
    # Anthropic's, accepted where they change nothing here: the prefix cache is automatic (cache_control), one
    # speed, one place, no workspaces
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Anthropic's code execution container (its server tools'): a 400 where set
    container: Any = None

    def model_post_init(self, _context) -> None:
        self._chat: protocol.ChatCompletionRequest | None = None
        self._origins: dict[str, str] = {}  # a chat message's path -> the Anthropic message's it came from

    def check_supported(self) -> None:
        """What the server asks of every request once parsed: here, that it becomes a chat request."""
        self.chat()

    def chat(self) -> protocol.ChatCompletionRequest:
        """The chat request this one becomes (checked: a 400 names this request's fields)."""
        if self._chat is None:
            try:
                body = self._to_chat()
            except InvalidRequest as e:  # named as this request's field already
                e.named_for_messages = True
                raise
            try:
                self._chat = protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode())
                self._chat.check_supported()
            except InvalidRequest as e:
                raise self.refusal(e) from None
        return self._chat

    def refusal(self, error: InvalidRequest) -> InvalidRequest:
        """A chat request's refusal (its own or the engine's) naming the field of this request it came from (once:
        a refusal named so already is returned as it is)."""
        if not error.param or getattr(error, "named_for_messages", False):
            return error
        param = error.param
        for chat_path, origin in sorted({**_CHAT_FIELDS, **self._origins}.items(), key=lambda kv: -len(kv[0])):
            if param == chat_path or param.startswith(chat_path + "."):
                param = origin + param[len(chat_path) :]
                break
        if param.endswith(".image_url.url"):  # an image part's URL is an image block's source here
            param = param.removesuffix(".image_url.url") + ".source"
        named = InvalidRequest(str(error).replace(error.param, param), param=param)
        named.named_for_messages = True
        return named

    def _to_chat(self) -> dict:
        messages: list[dict] = []
        if self.system is not None:
            system = _content_parts(self.system, "system", ("text",))
            messages.append({"role": "system", "content": "".join(p["text"] for p, _ in system)})
            self._origins["messages.0"] = "system"
        for i, message in enumerate(self.messages):
            where = f"messages.{i}"
            blocks = (
                [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
            )
            if message.role == "user":
                parts: list[tuple[dict, str]] = []  # the user message's parts, each with the block it came from
                for j, block in enumerate(blocks):
                    at = f"{where}.content.{j}"
                    kind = _kind(block, at)
                    if kind == "tool_result":
                        # The result's text is the tool message; its images (a screenshot, a file the tool read) go
                        # first in the user message after the tool messages: a chat's tool message holds text only.
                        text, images = [], []
                        for part, part_at in _content_parts(block.get("content", ""), f"{at}.content", _CONTENT_KINDS):
                            (images if part["type"] == "image_url" else text).append((part, part_at))
                        self._origins[f"messages.{len(messages)}"] = at
                        messages.append(
                            {
                                "role": "tool",
                                "tool_call_id": _string(block, "tool_use_id", at),
                                "content": "".join(p["text"] for p, _ in text),
                            }
                        )
                        parts.extend(images)
                    elif kind in _CONTENT_KINDS:
                        parts.extend(_content_parts([block], at, _CONTENT_KINDS, single=True))
                    else:
                        raise _unsupported_block(kind, at, user=True)
                if parts:
                    k = len(messages)
                    self._origins[f"messages.{k}"] = where
                    for m, (_, part_at) in enumerate(parts):
                        self._origins[f"messages.{k}.content.{m}"] = part_at
                    plain = all(p["type"] == "text" for p, _ in parts)
                    content = "".join(p["text"] for p, _ in parts) if plain else [p for p, _ in parts]
                    messages.append({"role": "user", "content": content})
            else:
                text, thought, calls = [], [], []
                for j, block in enumerate(blocks):
                    at = f"{where}.content.{j}"
                    kind = _kind(block, at)
                    if kind == "text":
                        text.append(_string(block, "text", at))
                    elif kind == "thinking":
                        thought.append(_string(block, "thinking", at))
                    elif kind == "redacted_thinking":
                        continue  # (sealed by Anthropic's servers: nothing here reads it)
                    elif kind == "tool_use":
                        arguments = block.get("input", {})
                        if not isinstance(arguments, dict):
                            raise InvalidRequest(f"{at}.input: a tool call's input is an object", param=f"{at}.input")
                        calls.append(
                            {
                                "id": _string(block, "id", at),
                                "type": "function",
                                "function": {"name": _string(block, "name", at), "arguments": json.dumps(arguments)},
                            }
                        )
                    else:
                        raise _unsupported_block(kind, at, user=False)
                self._origins[f"messages.{len(messages)}"] = where
                reply: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
                if calls:
                    reply["tool_calls"] = calls
                if thought:
                    reply["reasoning_content"] = "".join(thought)
                messages.append(reply)
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            # kept in the output, to say which one ended it (and then removed, as Anthropic does)
            chat["stop"] = list(self.stop_sequences)
            chat["include_stop_str_in_output"] = True
        user = (self.metadata or {}).get("user_id")
        if isinstance(user, str):
            chat["user"] = user
        if self.tools:
            chat["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat.update(_tool_choice(self.tool_choice, bool(self.tools)))
        if self.thinking is not None:
            chat.update(_thinking(self.thinking))
        if self.output_config is not None:
            chat.update(_output_config(self.output_config))
        if self.container is not None:
            raise InvalidRequest(
                "container: Anthropic's code execution containers (its server tools') are not run here",
                param="container",
            )
        return chat


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)


# the chat's fields that are this API's under other names
_CHAT_FIELDS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "chat_template_kwargs": "thinking",
    "thinking_token_budget": "thinking.budget_tokens",
    "response_format": "output_config.format",
    "response_format.json_schema.schema": "output_config.format.schema",
    "reasoning_effort": "output_config.effort",
}


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{at}: a content block is an object with a type", param=at)
    return block["type"]


def _string(block: dict, name: str, at: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{at}.{name}: a string is required", param=f"{at}.{name}")
    return value


# The content blocks of a user message (besides tool results) and of a tool result
_CONTENT_KINDS = ("text", "image", "document", "search_result")


def _content_parts(value: Any, at: str, kinds: tuple[str, ...], single: bool = False) -> list[tuple[dict, str]]:
    """Content (a string, or blocks of `kinds`) as the chat's parts, each with the path of the block it came from:
    text; an image's image_url; a document's text (a plain-text document, or a content document's blocks), after
    its title and context; a search result's source, title and text. A document's and a search result's text end
    with a blank line, so that text after them starts a paragraph of its own. `single`: `value` is one block, at
    `at`."""
    if isinstance(value, str):
        return [({"type": "text", "text": value}, at)]
    if not isinstance(value, list):
        raise InvalidRequest(f"{at}: a string or a list of content blocks", param=at)
    out: list[tuple[dict, str]] = []
    for j, block in enumerate(value):
        block_at = at if single else f"{at}.{j}"
        kind = _kind(block, block_at)
        if kind not in kinds:
            raise InvalidRequest(
                f"{block_at}.type: {kind!r} blocks are not read here ({', '.join(kinds)})", param=f"{block_at}.type"
            )
        if kind == "text":
            out.append(({"type": "text", "text": _string(block, "text", block_at)}, block_at))
        elif kind == "image":
            out.append(({"type": "image_url", "image_url": {"url": _image_url(block, block_at)}}, block_at))
        elif kind == "document":
            out.extend(_document(block, block_at))
        else:
            out.append(({"type": "text", "text": _search_result(block, block_at)}, block_at))
    return out


def _no_citations(block: dict, at: str) -> None:
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled"):
        raise InvalidRequest(
            f"{at}.citations: citations are not produced here (a reply's text blocks carry none); leave them off",
            param=f"{at}.citations",
        )


def _document(block: dict, at: str) -> list[tuple[dict, str]]:
    """A document block's parts: a plain-text document's text, or a content document's text and image blocks, after
    its title and context (each on its own paragraph). PDFs, URLs and file ids are refused, naming the source."""
    _no_citations(block, at)
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(f"{at}.source: a document block needs a source object", param=f"{at}.source")
    head = [block[name] for name in ("title", "context") if isinstance(block.get(name), str) and block[name]]
    kind = source.get("type")
    if kind == "text":
        body = [({"type": "text", "text": _string(source, "data", f"{at}.source")}, at)]
    elif kind == "content":
        body = _content_parts(source.get("content"), f"{at}.source.content", ("text", "image"))
    elif not isinstance(kind, str):
        raise InvalidRequest(f"{at}.source.type: a document's source is text or content", param=f"{at}.source.type")
    else:
        raise InvalidRequest(
            f"{at}.source.type: {kind!r} documents are not read here (a PDF's pages, a URL or a file id); send the "
            'document\'s text as {"type": "text", "media_type": "text/plain", "data": ...}',
            param=f"{at}.source.type",
        )
    if body and body[-1][0]["type"] == "text":
        body[-1] = ({"type": "text", "text": body[-1][0]["text"] + "\n\n"}, body[-1][1])
    if not head:
        return body
    first = "\n\n".join(head) + "\n\n"
    if body and body[0][0]["type"] == "text":
        return [({"type": "text", "text": first + body[0][0]["text"]}, body[0][1]), *body[1:]]
    return [({"type": "text", "text": first}, at), *body]


def _search_result(block: dict, at: str) -> str:
    """A search result block's text: its title and source, then its text blocks."""
    _no_citations(block, at)
    title, source = _string(block, "title", at), _string(block, "source", at)
    text = "".join(p["text"] for p, _ in _content_parts(block.get("content"), f"{at}.content", ("text",)))
    return f"{title} ({source})\n\n{text}\n\n"


def _image_url(block: dict, at: str) -> str:
    """An image block's source as the chat path's image_url takes it: a data URL, or the URL."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(f"{at}.source: an image block needs a source object", param=f"{at}.source")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise InvalidRequest(f"{at}.source: base64 needs media_type and data", param=f"{at}.source")
        return f"data:{media};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise InvalidRequest(f"{at}.source.type: base64 or url", param=f"{at}.source.type")


def _unsupported_block(kind: str, at: str, user: bool) -> InvalidRequest:
    kinds = (*_CONTENT_KINDS, "tool_result") if user else ("text", "thinking", "redacted_thinking", "tool_use")
    role = "a user message" if user else "an assistant message"
    return InvalidRequest(
        f"{at}.type: {kind!r} blocks are not read in {role} here ({', '.join(kinds)})", param=f"{at}.type"
    )


def _tool(tool: dict, at: str) -> dict:
    """A client tool as the chat's function tool; Anthropic's server tools are refused by name."""
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise InvalidRequest(
            f"{at}.type: {kind!r} is one of Anthropic's server tools, which this server does not run; describe a "
            "client tool (name, description, input_schema) and run it yourself",
            param=f"{at}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", name):
        raise InvalidRequest(f"{at}.name: 1 to 128 letters, digits, _ or -", param=f"{at}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{at}.input_schema: a JSON schema object is required", param=f"{at}.input_schema")
    function = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict, has_tools: bool) -> dict:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    if kind == "auto":
        return {**out, "tool_choice": "auto"} if has_tools else out
    if kind == "any":
        return {**out, "tool_choice": "required"}
    if kind == "none":
        return {**out, "tool_choice": "none"} if has_tools else out
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name: the tool to call", param="tool_choice.name")
        return {**out, "tool_choice": {"type": "function", "function": {"name": name}}}
    raise InvalidRequest("tool_choice.type: auto, any, tool or none", param="tool_choice.type")


def _output_config(config: dict) -> dict:
    """`format` (a JSON schema the reply's text is held to: the chat's response_format) and `effort` (the chat's
    reasoning_effort: xhigh and max are its high)."""
    out: dict[str, Any] = {}
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise InvalidRequest(
            f"output_config.{unknown[0]}: not a field here (format, effort)", param=f"output_config.{unknown[0]}"
        )
    form = config.get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise InvalidRequest(
                'output_config.format: {"type": "json_schema", "schema": {...}}', param="output_config.format"
            )
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        efforts = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
        if effort not in efforts:
            raise InvalidRequest("output_config.effort: low, medium, high, xhigh or max", param="output_config.effort")
        out["reasoning_effort"] = efforts[effort]
    return out


def _thinking(thinking: dict) -> dict:
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind in ("enabled", "adaptive", "between_tools"):
        out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
        budget = thinking.get("budget_tokens")
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise InvalidRequest("thinking.budget_tokens: a positive integer", param="thinking.budget_tokens")
            out["thinking_token_budget"] = budget
        return out
    raise InvalidRequest("thinking.type: enabled, adaptive, between_tools or disabled", param="thinking.type")


def new_message_id() -> str:
    """An id as Anthropic's look: msg_ and 24 base-62 characters."""
    import secrets
    import string

    alphabet = string.ascii_letters + string.digits
    return "msg_" + "".join(secrets.choice(alphabet) for _ in range(24))


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _stop(request: MessagesRequest, finish_reason: str | None, text: str, calls: bool) -> tuple[str, str | None, str]:
    """(stop_reason, stop_sequence, the text without it)."""
    if calls:
        return "tool_use", None, text
    if finish_reason == "length":
        return "max_tokens", None, text
    if finish_reason == "stop":
        for s in sorted(request.stop_sequences or (), key=len, reverse=True):
            if text.endswith(s):
                return "stop_sequence", s, text[: -len(s)]
    return "end_turn", None, text


def message_object(request: MessagesRequest, merged: dict, rid: str) -> dict:
    """Anthropic's message for a chat answer (`merged`: the chat response's JSON)."""
    choice = merged["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    reason, sequence, text = _stop(request, choice["finish_reason"], message.get("content") or "", bool(calls))
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {}
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments})
    usage = merged["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"], cached),
    }


class MessageEvents:
    """One message's server-sent events, in `protocol.StreamEvents`' interface (what the server's stream loop
    calls): `role()` starts the message, `reasoning`/`chunk`/`tool_calls` add to its blocks as the model writes
    them, `usage()` ends it (`message_delta`, `message_stop`), `event()` reports an error, `done()` adds nothing.
    With stop sequences, the text's last characters wait until the next chunk (or the end), so that a stop
    sequence that ends the message never goes out."""

    kind = "chat"  # the server's chat path: tool calls parsed, reasoning split

    def __init__(self, request: MessagesRequest, rid: str, input_tokens: int, cached: int):
        self.messages_request, self.rid = request, rid
        self.input_tokens, self.cached = input_tokens, cached
        self._block: str | None = None  # the block being written: "text" or "thinking"
        self._index = -1
        self._held = ""  # text held back: it may be the start of a stop sequence
        self._hold = max((len(s) for s in request.stop_sequences or ()), default=0)
        self._finish: str | None = None
        self._calls = False

    @staticmethod
    def _event(kind: str, **fields) -> str:
        body = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {body}\n\n"

    def role(self) -> str:
        message = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.messages_request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.input_tokens, 0, self.cached),
        }
        return self._event("message_start", message=message) + self._event("ping")

    def _open(self, kind: str) -> str:
        if self._block == kind:
            return ""
        out = self._close()
        self._index, self._block = self._index + 1, kind
        block = (
            {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
        )
        return out + self._event("content_block_start", index=self._index, content_block=block)

    def _close(self) -> str:
        if self._block is None:
            return ""
        out = ""
        if self._block == "thinking":
            out = self._event(
                "content_block_delta", index=self._index, delta={"type": "signature_delta", "signature": ""}
            )
        self._block = None
        return out + self._event("content_block_stop", index=self._index)

    def _text(self, text: str) -> str:
        if not text:
            return ""
        return self._open("text") + self._event(
            "content_block_delta", index=self._index, delta={"type": "text_delta", "text": text}
        )

    def reasoning(self, text: str, logprobs: dict | None = None) -> str:
        return self._open("thinking") + self._event(
            "content_block_delta", index=self._index, delta={"type": "thinking_delta", "thinking": text}
        )

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> str:
        self._held += text
        if finish_reason is not None:
            self._finish = finish_reason
            return ""  # the rest goes out with usage(), once the stop sequence is known
        cut = max(0, len(self._held) - self._hold)
        out, self._held = self._held[:cut], self._held[cut:]
        return self._text(out)

    def tool_calls(self, calls: list[dict], finish_reason: str | None) -> str:
        out = self._text(self._held)
        self._held = ""
        out += self._close()
        for call in calls:
            self._index += 1
            function = call["function"]
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            out += self._event("content_block_start", index=self._index, content_block=block)
            delta = {"type": "input_json_delta", "partial_json": function.get("arguments") or "{}"}
            out += self._event("content_block_delta", index=self._index, delta=delta)
            out += self._event("content_block_stop", index=self._index)
        self._calls, self._finish = bool(calls), finish_reason
        return out

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
    ) -> str:
        reason, sequence, rest = _stop(self.messages_request, self._finish, self._held, self._calls)
        self._held = ""
        out = self._text(rest) + self._close()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out += self._event("message_delta", delta=delta, usage=_usage(prompt_tokens, completion_tokens, cached_tokens))
        return out + self._event("message_stop")

    def event(self, obj: dict) -> str:
        error = obj.get("error", {})
        return self._event("error", error={"type": _ERROR_TYPES.get(error.get("code"), "api_error"), **_said(error)})

    @staticmethod
    def done() -> str:
        return ""


# HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def _said(error: dict) -> dict:
    out = {"message": error.get("message", "")}
    if error.get("param"):
        out["param"] = error["param"]
    return out


def anthropic_errors(send):
    """`send` with every error answer (an HTTP status of 400 or more, OpenAI's error object) turned into
    Anthropic's (`{"type": "error", "error": {"type", "message"}}`), its headers kept."""
    started: dict | None = None

    async def wrapped(message: dict) -> None:
        nonlocal started
        if message["type"] == "http.response.start" and message["status"] >= 400:
            started = message  # held until its body, whose length changes
            return
        if started is not None and message["type"] == "http.response.body":
            try:
                error = json.loads(message.get("body") or b"{}").get("error", {})
            except ValueError:
                error = {}
            status = started["status"]
            body = json.dumps(
                {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), **_said(error)}},
                separators=(",", ":"),
                ensure_ascii=False,
            ).encode()
            headers = [(k, v) for k, v in started["headers"] if k != b"content-length"]
            await send({**started, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            started = None
            return
        await send(message)

    return wrapped


# -- the published contract (serving/api/openapi.py) ---------------------------------------------------------------


class AnthropicContentBlock(BaseModel):
    """A reply's content block: `text` (`text`), `thinking` (`thinking`, `signature`) or `tool_use` (`id`, `name`,
    `input`)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "thinking", "tool_use"]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class AnthropicMessage(BaseModel):
    """`POST /v1/messages`' answer: Anthropic's message."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicStreamEvent(BaseModel):
    """One streamed event's data: `message_start`, `ping`, `content_block_start`, `content_block_delta`,
    `content_block_stop`, `message_delta`, `message_stop`, or `error`."""

    model_config = ConfigDict(extra="allow")
    type: Literal[
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "error",
    ]


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None


class AnthropicError(BaseModel):
    """Anthropic's error object: what every refusal of /v1/messages and its token count is."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class TokenCount(BaseModel):
    """`POST /v1/messages/count_tokens`' answer."""

    input_tokens: int
