"""OpenAI's Responses API (`POST /v1/responses`), served on the chat path: what the OpenAI Agents SDK and
`client.responses.create` send.

A request becomes a chat request (`ResponsesRequest.chat`): `instructions` a system message first, `input` (a string:
one user message; or a list of items) the messages, `function_call` items an assistant's tool calls,
`function_call_output` items tool messages, `tools` (flat function tools) and `tool_choice` chat's nested ones,
`text.format` chat's `response_format`, `max_output_tokens` its max_tokens, `include: ["message.output_text.logprobs"]`
with `top_logprobs` its logprobs. The engine request, the chat template, tool-call parsing, reasoning and structured
outputs are then chat's own. A field chat refuses is a 400 naming the Responses field (`input.2.content`,
`text.format.schema.properties`, `tools.0.parameters`), not the chat field it became.

The reply is a Response object: `output` holds a `reasoning` item (where the deployment reads reasoning), a `message`
item with one `output_text` part, and a `function_call` item per tool call; `status` is `completed`, or `incomplete`
with `incomplete_details.reason` `max_output_tokens` when the token budget ran out. Streamed (`stream: true`), the
server-sent events are the Responses API's typed ones (`ResponseEvents`): `response.created`,
`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`, each with its
`sequence_number`; no `[DONE]`.

Where the deployment keeps responses (`http.responses_store`: pylon.serving.api.response_store), a response is stored
unless the request says `store: false`, and a later request continues it with `previous_response_id`: the stored
conversation (its inputs and outputs, and those it continued) comes before the new `input`, the new `instructions` in
place of the old; `GET`/`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read and delete it.
Without a store nothing is kept (`store` is answered `false`; `previous_response_id` is a 400 saying what to set), and a
client sends the whole conversation in `input`, as chat clients do. With a store, `background: true` answers at once
(queued) and the replica runs the response to its end, stored for `GET` to poll, `POST /v1/responses/{id}/cancel` to
stop (pylon.serving.api.server). An `item_reference` names an item of the continued conversation. Built-in tools
(web search, file search, computer use, ...) are not there: only `function` tools. `input_image` parts are taken as
chat's image_url parts (for a model that takes images); files and audio are refused.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from pylon.serving.api import protocol
from pylon.serving.api.response_store import valid_id
from pylon.serving.errors import InvalidRequest, shown

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# A reasoning item's `encrypted_content`, which clients that keep no server state send back (store: false: Codex CLI,
# the Agents SDK). Here it is the item's own reasoning text, encoded (not encrypted: the item carries that text in its
# `content` already), and a reasoning item sent back gives its text to the assistant turn after it.
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
_ENCODED = "pylon-reasoning:"
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # {"effort": ...}: the chat's reasoning_effort (its template's variable); the rest ("summary") accepted
    reasoning: dict[str, Any] | None = None
    store: bool | None = None  # keep the response (the default where the deployment has a store: see above)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    # OpenAI's, as on chat (protocol._Request)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # vLLM's extensions, as on chat: more variables for the chat template (Qwen3's enable_thinking: false)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=protocol.MAX_TEMPLATE_KWARGS)

    _chat: protocol.ChatCompletionRequest | None = PrivateAttr(None)
    _origins: list = PrivateAttr(default_factory=list)
    # The conversation of previous_response_id (`continue_from`), before this request's input.
    _previous: list[dict] = PrivateAttr(default_factory=list)
    _input_items: list[dict] | None = PrivateAttr(None)
    _dropped_turns: int = PrivateAttr(0)  # truncation "auto": the conversation's earliest turns left out (`fit`)
    _kept: bool = PrivateAttr(False)  # whether the server keeps this response (its `store` field)...
    _owner: str = PrivateAttr("")  # ...under whose name (`KeyCheck.owner`)

    def keep(self, owner: str) -> None:
        """Have the server keep this response under `owner`'s name (a deployment with a store, `store` not false)."""
        self._kept, self._owner = True, owner

    @property
    def kept(self) -> bool:
        return self._kept

    @property
    def owner(self) -> str:
        return self._owner

    def check_supported(self) -> None:
        if self.previous_response_id is not None and not valid_id(self.previous_response_id):
            raise InvalidRequest(
                f"previous_response_id: {shown(self.previous_response_id)} is not a response id (resp_...)",
                param="previous_response_id",
            )
        if self.background and self.stream:
            raise InvalidRequest(
                "background: true runs the response to be polled (GET /v1/responses/{id}); a background stream is not "
                "served: give one of stream and background",
                param="background",
            )
        if self.background and self.store is False:
            raise InvalidRequest(
                "background: true keeps the response to be polled, so it needs store (not false)", param="background"
            )
        include = self.include or []
        for i, item in enumerate(include):
            if item not in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE):
                raise InvalidRequest(
                    f"include.{i}: {shown(item)} is not available here (only {LOGPROBS_INCLUDE!r} and "
                    f"{ENCRYPTED_INCLUDE!r})",
                    param=f"include.{i}",
                )
        if self.max_tool_calls is not None:
            raise InvalidRequest(
                "max_tool_calls limits built-in tool calls, which this server does not run; leave it out",
                param="max_tool_calls",
            )
        if self.previous_response_id is None:  # else once the stored conversation is in (`continue_from`)
            self._chat = self._to_chat()

    def continue_from(self, conversation: list[dict]) -> None:
        """Put the stored conversation of `previous_response_id` before this request's input."""
        self._previous, self._chat = list(conversation), None

    def input_items(self) -> list[dict]:
        """This request's input as items, each with an id (what GET .../input_items lists, and a stored
        conversation holds): a string input is one user message."""
        if self._input_items is None:
            if isinstance(self.input, str):
                items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
            else:
                items = [dict(item) for item in self.input]
            for item in items:
                item.setdefault("type", "message")
                if not item.get("id"):
                    item["id"] = new_item_id(_ITEM_PREFIX.get(item["type"], "item"))
            self._input_items = items
        return self._input_items

    def conversation(self, response: dict) -> list[dict]:
        """The conversation as it stands after `response` (this request's): the previous one, this input, its
        output: what a request continuing from it starts with."""
        return [*self._previous, *self.input_items(), *response["output"]]

    def chat(self) -> protocol.ChatCompletionRequest:
        """The chat request this one becomes (checked: a 400 names this request's fields)."""
        if self._chat is None:
            self._chat = self._to_chat()
        return self._chat

    def fit(self, fits) -> int:
        """truncation "auto" (OpenAI's): where the chat does not fit the context (`fits(chat)` False), drop the
        conversation's earliest turns (a turn: a user message and what follows it, up to the next user message: the
        calls and their outputs stay together), never the instructions, the leading system messages or the last
        turn, as few as make it fit (found by bisection: a few renders). Returns how many were dropped; 0 where it
        fits or where nothing dropped would make it fit (the engine's 400 then says by how much)."""
        if self.truncation != "auto" or fits(self.chat()):
            return 0
        turns = self._turns()
        low, high = 1, len(turns) - 1  # the last turn always stays
        if high < low or not fits(self._with_dropped(high)):
            self._with_dropped(0)
            return 0
        while low < high:
            mid = (low + high) // 2
            if fits(self._with_dropped(mid)):
                high = mid
            else:
                low = mid + 1
        self._with_dropped(low)
        return low

    def _with_dropped(self, k: int) -> protocol.ChatCompletionRequest:
        self._dropped_turns, self._chat = k, None
        return self.chat()

    def _turns(self) -> list[int]:
        """The indices of the chat's messages where its turns begin: its user messages after the leading system ones."""
        messages, _ = self._messages(drop=0)
        return [i for i, m in enumerate(messages) if m["role"] == "user"]

    def refusal(self, error: InvalidRequest) -> InvalidRequest:
        """A chat request's refusal (its own or the engine's) naming the Responses field the chat field came from."""
        if not error.param:
            return error
        mapped = _responses_param(error.param, self._origins)
        return InvalidRequest(str(error).replace(error.param, mapped), param=mapped)

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def encrypted_reasoning(self) -> bool:
        return ENCRYPTED_INCLUDE in (self.include or [])

    def _to_chat(self) -> protocol.ChatCompletionRequest:
        messages, origins = self._messages(self._dropped_turns)
        self._origins = origins
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
        given = self.model_fields_set
        for name, chat_name in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("user", "user"),
            ("safety_identifier", "safety_identifier"),
            ("prompt_cache_key", "prompt_cache_key"),
            ("service_tier", "service_tier"),
        ):
            if name in given and getattr(self, name) is not None:
                body[chat_name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.logprobs:
            body["logprobs"] = True
            if self.top_logprobs is not None:
                body["top_logprobs"] = self.top_logprobs
        if self.tools is not None:
            body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text is not None:
            response_format = _response_format(self.text)
            if response_format is not None:
                body["response_format"] = response_format
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            if effort not in protocol.REASONING_EFFORTS:
                raise InvalidRequest(
                    f"reasoning.effort must be one of {', '.join(protocol.REASONING_EFFORTS)} (got {effort!r})",
                    param="reasoning.effort",
                )
            body["reasoning_effort"] = effort
        try:
            chat = protocol.ChatCompletionRequest.model_validate(body)
            chat.check_supported()
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or "body"
            mapped = _responses_param(param, origins)
            raise InvalidRequest(f"{mapped}: {first['msg']} (got {shown(first.get('input'))})", param=mapped) from None
        except InvalidRequest as e:
            raise self.refusal(e) from None
        return chat

    def _referenced(self, item: dict, where: str) -> dict:
        """The item an `item_reference` names: one of the conversation previous_response_id continues (its inputs
        and outputs, and those it continued), by id."""
        extra = _unknown(item, {"type", "id"})
        if extra:
            raise InvalidRequest(
                f"{where}: unknown field '{extra[0]}' of an item_reference", param=f"{where}.{extra[0]}"
            )
        ref = item.get("id")
        if not self._previous:
            raise InvalidRequest(
                f"{where}: an item_reference names an item of the conversation previous_response_id continues: give "
                "previous_response_id, or send the item itself",
                param=f"{where}.id",
            )
        found = next((i for i in self._previous if isinstance(i, dict) and i.get("id") == ref), None)
        if found is None:
            raise InvalidRequest(
                f"{where}.id: no item {shown(ref)} in the conversation of previous_response_id", param=f"{where}.id"
            )
        return found

    def _messages(self, drop: int = 0) -> tuple[list[dict], list]:
        """Chat messages, and for each the Responses field it came from (for errors); the earliest `drop` turns
        left out (`fit`)."""
        messages: list[dict] = []
        origins: list = []  # each message's field: a name, or (a name, each content part's) for shown images
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
            origins.append("instructions")
        items = [(item, "previous_response_id") for item in self._previous]
        if isinstance(self.input, str):
            if not self.input:
                raise InvalidRequest("input must not be empty", param="input")
            items.append(({"type": "message", "role": "user", "content": self.input}, "input"))
        elif not self.input:
            raise InvalidRequest("input must hold at least one item", param="input")
        else:
            items.extend((item, f"input.{i}") for i, item in enumerate(self.input))
        thought: str | None = None  # a reasoning item's text, for the assistant turn that follows it
        # Images in function_call_output items (a screenshot a tool took), each with its field: after the run of tool
        # messages they answer, one user message holds them (a chat's tool message holds text only).
        shown_images: list[tuple[dict, str]] = []

        def show_images() -> None:
            if shown_images:
                messages.append({"role": "user", "content": [part for part, _ in shown_images]})
                origins.append(("input", [at for _, at in shown_images]))
                shown_images.clear()

        for item, where in items:
            if isinstance(item, dict) and item.get("type") != "function_call_output":
                show_images()
            if not isinstance(item, dict):
                raise InvalidRequest(f"{where}: an input item is a JSON object", param=where)
            if item.get("type") == "item_reference":  # an item of the continued conversation, here again
                item = self._referenced(item, where)
            kind = item.get("type", "message")
            if kind == "message":
                message = _message(item, where)
                if message["role"] == "assistant" and thought is not None:
                    message["reasoning_content"], thought = thought, None
                elif message["role"] != "assistant":
                    thought = None  # reasoning belongs to the assistant turn right after it
                messages.append(message)
                origins.append(where)
            elif kind == "function_call":
                call = _function_call(item, where)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and origins[-1] != "instructions":
                    last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
                    if thought is not None and "reasoning_content" not in last:
                        last["reasoning_content"], thought = thought, None
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    origins.append(where)
                    if thought is not None:
                        messages[-1]["reasoning_content"], thought = thought, None
            elif kind == "function_call_output":
                tool, images = _function_output(item, where)
                messages.append(tool)
                origins.append(where)
                shown_images.extend(images)
            elif kind == "reasoning":
                # An earlier turn's reasoning, as this server (or a client) wrote it: the assistant turn after it
                # carries it as reasoning_content, for a chat template that reads it (gpt-oss's keeps a tool-calling
                # turn's; Qwen3's drops earlier turns')
                thought = _reasoning_text(item, where)
            else:
                raise InvalidRequest(
                    f"{where}.type: {shown(kind)} is not an input item this server takes (message, function_call, "
                    "function_call_output, reasoning)",
                    param=f"{where}.type",
                )
        show_images()
        if drop:
            starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
            first, keep_from = starts[0], starts[min(drop, len(starts) - 1)]
            messages, origins = messages[:first] + messages[keep_from:], origins[:first] + origins[keep_from:]
        return messages, origins


def _unknown(item: dict, allowed: set[str]) -> list[str]:
    """An item's fields the API does not define here, in order; a field sent as null is left alone (a client that
    dumps an output item whole sends every optional field the SDK knows)."""
    return sorted(k for k, v in item.items() if k not in allowed and v is not None)


def _message(item: dict, where: str, field: str = "content") -> dict:
    """A message item as the chat's message (`field`: what its parts are called, for errors: a function_call_output's
    are its `output`)."""
    allowed = {"type", "role", "content", "id", "status", "phase"}
    extra = _unknown(item, allowed)
    if extra:
        raise InvalidRequest(f"{where}: unknown field '{extra[0]}' of a message item", param=f"{where}.{extra[0]}")
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(
            f"{where}.role: must be user, system, developer or assistant (got {shown(role)})", param=f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content: a string or a list of content parts (got {shown(content)})", param=f"{where}.content"
        )
    texts, parts = [], []  # parts: one chat part per content part (same indices), where an image makes them needed
    for j, part in enumerate(content):
        at = f"{where}.{field}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind == "input_image":
            # The image itself is checked where the chat request is rendered (a data: URL; the model takes images).
            if part.get("file_id") is not None:
                raise InvalidRequest(
                    f"{at}.file_id: there is no file store here; send the image as image_url (a data: URL)",
                    param=f"{at}.file_id",
                )
            parts.append({"type": "image_url", "image_url": part.get("image_url")})
            continue
        elif kind in ("input_file", "input_audio"):
            raise InvalidRequest(f"{at}: {kind} is not supported; send text or image parts", param=f"{at}.type")
        else:
            raise InvalidRequest(
                f"{at}: a content part is {{'type': 'input_text', 'text': ...}} (or output_text, refusal, input_image; "
                f"got {shown(part)})",
                param=at,
            )
        parts.append({"type": "text", "text": texts[-1]})
    if any(p["type"] == "image_url" for p in parts):
        return {"role": role, "content": parts}
    return {"role": role, "content": "".join(texts)}


def _string_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value and name != "arguments":
        raise InvalidRequest(
            f"{where}.{name}: a non-empty string is required (got {shown(value)})", param=f"{where}.{name}"
        )
    return value


def _function_call(item: dict, where: str) -> dict:
    extra = _unknown(item, {"type", "call_id", "name", "arguments", "id", "status", "namespace"})
    if extra:
        raise InvalidRequest(
            f"{where}: unknown field '{extra[0]}' of a function_call item", param=f"{where}.{extra[0]}"
        )
    return {
        "id": _string_field(item, "call_id", where),
        "type": "function",
        "function": {"name": _string_field(item, "name", where), "arguments": _string_field(item, "arguments", where)},
    }


def _function_output(item: dict, where: str) -> dict:
    extra = _unknown(item, {"type", "call_id", "output", "id", "status"})
    if extra:
        raise InvalidRequest(
            f"{where}: unknown field '{extra[0]}' of a function_call_output item", param=f"{where}.{extra[0]}"
        )
    output = item.get("output")
    images: list[tuple[dict, str]] = []
    if isinstance(output, list):  # content parts: their text is the tool message's, their images shown after it
        parts = _message({"role": "user", "content": output}, where, "output")["content"]
        if isinstance(parts, list):
            texts = []
            for j, part in enumerate(parts):
                if part["type"] == "text":
                    texts.append(part["text"])
                else:
                    images.append((part, f"{where}.output.{j}"))
            parts = "".join(texts)
        output = parts
    elif not isinstance(output, str):
        raise InvalidRequest(
            f"{where}.output: a string or a list of content parts (got {shown(output)})", param=f"{where}.output"
        )
    return {"role": "tool", "tool_call_id": _string_field(item, "call_id", where), "content": output}, images


def _chat_tool(i: int, tool: dict) -> dict:
    """A Responses function tool ({type, name, description, parameters, strict}) as chat's nested one."""
    where = f"tools.{i}"
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"{where}.type: {shown(kind)} tools are not available here: this server runs no built-in tools; give "
            "function tools and run them yourself",
            param=f"{where}.type",
        )
    extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if extra:
        raise InvalidRequest(f"{where}: unknown field '{extra[0]}' of a function tool", param=f"{where}.{extra[0]}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest(
        f"tool_choice: auto, none, required or {{'type': 'function', 'name': ...}} (got {shown(choice)})",
        param="tool_choice",
    )


def _response_format(text: dict) -> dict | None:
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise InvalidRequest(f"text: unknown field '{extra[0]}'", param=f"text.{extra[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"text.format: an object (got {shown(fmt)})", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema":
        extra = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
        if extra:
            raise InvalidRequest(f"text.format: unknown field '{extra[0]}'", param=f"text.format.{extra[0]}")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise InvalidRequest(
        f"text.format: type text, json_object or json_schema (got {shown(fmt)})", param="text.format.type"
    )


def _responses_param(param: str, origins: list[str]) -> str:
    """A chat request's field, named as the Responses field it came from."""
    m = re.match(r"messages\.(\d+)(.*)", param)
    if m:
        i = int(m.group(1))
        origin = origins[i] if i < len(origins) else "input"
        if isinstance(origin, tuple):  # a message of parts from several fields: (its own name, each part's field)
            part = re.match(r"\.content\.(\d+)(.*)", m.group(2))
            if part is None or int(part.group(1)) >= len(origin[1]):
                return origin[0]
            return origin[1][int(part.group(1))] + part.group(2)
        return origin + m.group(2)
    for chat, mine in (
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("tool_choice.function", "tool_choice"),
        ("prompt", "input"),  # the engine's name for the rendered conversation (its length)
    ):
        if param == chat or param.startswith(chat + "."):
            return mine + param[len(chat) :]
    m = re.match(r"tools\.(\d+)\.function(.*)", param)
    if m:
        return f"tools.{m.group(1)}{m.group(2)}"
    return param


# -- the reply -----------------------------------------------------------------------------------------------------
# Its shapes, for the published document (pylon.serving.api.openapi): what `response_object` and `ResponseEvents`
# build, key for key (tests/unit/serving/api/test_openapi.py checks them against each other).

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(protocol._Response):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[protocol.ChatTokenLogprob] = Field(
        description=f"each token's, with include [{LOGPROBS_INCLUDE!r}] (top_logprobs: that many alternatives)"
    )


class OutputMessage(protocol._Response):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(protocol._Response):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(protocol._Response):
    """The reply's reasoning block, where the deployment reads reasoning (`http.reasoning_parser`)."""

    type: Literal["reasoning"]
    id: str
    summary: list[dict[str, Any]]
    content: list[ReasoningText]
    status: ItemStatus
    encrypted_content: str = Field(
        None,
        description=f"with include [{ENCRYPTED_INCLUDE!r}]: the reasoning, encoded (not encrypted: `content` holds "
        "it), for clients that send reasoning back without a stored response",
        json_schema_extra=protocol._absent_when_unset,
    )  # type: ignore[assignment]


class FunctionCallItem(protocol._Response):
    type: Literal["function_call"]
    id: str
    call_id: str = Field(description="what the function_call_output item that answers it names")
    name: str
    arguments: str = Field(description="the arguments, JSON")
    status: ItemStatus


class InputTokensDetails(protocol._Response):
    cached_tokens: int = Field(ge=0)


class OutputTokensDetails(protocol._Response):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(protocol._Response):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class IncompleteDetails(protocol._Response):
    reason: Literal["max_output_tokens"]


class ResponseError(protocol._Response):
    code: str
    message: str


class ResponseObject(protocol._Response):
    """OpenAI's Response object (`object: "response"`); `store`: whether the deployment keeps it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    metadata: dict[str, str]
    model: str
    output: list[Annotated[OutputMessage | ReasoningItem | FunctionCallItem, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int | None
    top_p: float
    truncation: Literal["disabled", "auto"]
    usage: ResponseUsage | None
    user: str | None


class DeletedResponse(protocol._Response):
    """What DELETE /v1/responses/{response_id} answers."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(protocol._Response):
    """A page of a stored response's input items (GET /v1/responses/{response_id}/input_items)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@dataclass(frozen=True)
class ItemsQuery:
    """GET .../input_items' query parameters, as OpenAI's: `limit` (1-100, default 20), `order` (`asc` or `desc`, the
    default: newest first), `after` (an item id: the page starts past it); `include` is accepted (the items are
    stored whole)."""

    limit: int = 20
    order: str = "desc"
    after: str | None = None

    @classmethod
    def parse(cls, query: bytes) -> ItemsQuery:
        fields = {}
        for name, values in urllib.parse.parse_qs(query.decode("latin-1"), keep_blank_values=True).items():
            value = values[-1]
            if name == "limit":
                if not value.isdigit() or not 1 <= int(value) <= 100:
                    raise InvalidRequest(f"limit: an integer from 1 to 100 (got {shown(value)})", param="limit")
                fields["limit"] = int(value)
            elif name == "order":
                if value not in ("asc", "desc"):
                    raise InvalidRequest(f"order: asc or desc (got {shown(value)})", param="order")
                fields["order"] = value
            elif name == "after":
                fields["after"] = value
            elif name not in ("include", "include[]"):
                raise InvalidRequest(
                    f"{shown(name)} is not a query parameter here (limit, order, after, include)", param=name
                )
        return cls(**fields)

    def of(self, items: list[dict]) -> dict:
        """The page of `items` (in the order they were given) this query asks for: an InputItemList."""
        ordered = items if self.order == "asc" else items[::-1]
        if self.after is not None:
            ids = [item.get("id") for item in ordered]
            if self.after not in ids:
                raise InvalidRequest(f"after: no input item {shown(self.after)} in this response", param="after")
            ordered = ordered[ids.index(self.after) + 1 :]
        page = ordered[: self.limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > len(page),
        }


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response: `event: <type>` and this as its data. `response.created`,
    `response.in_progress`, `response.completed` and `response.incomplete` carry the Response object (`response`);
    the others an item (`response.output_item.added`/`.done`), a content part, or a delta of text
    (`response.output_text.delta`, `response.reasoning_text.delta`) or of a call's arguments; `error` an error."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int = Field(ge=0)
    response: ResponseObject | None = None


def new_item_id(prefix: str) -> str:
    """An id as OpenAI's Responses API writes them: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _skeleton(request: ResponsesRequest, rid: str, created: int) -> dict:
    """The Response object's fields that echo the request."""
    tools = request.tools or []
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": bool(request.background),
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "metadata": request.metadata or {},
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
        "store": request.kept,
        "temperature": request.temperature if request.temperature is not None else 1.0,
        "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": tools,
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
    }


def _usage(usage: dict) -> dict:
    """Chat's usage as the Responses API's."""
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": usage["total_tokens"],
    }


def _finish(response: dict, finish_reason: str | None) -> dict:
    if finish_reason == "length":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    return response


def _reasoning_item(item_id: str, text: str, encrypted: bool = False) -> dict:
    """A reasoning output item; `encrypted`: with `encrypted_content` (include reasoning.encrypted_content)."""
    item = {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }
    if encrypted:
        item["encrypted_content"] = _ENCODED + base64.urlsafe_b64encode(text.encode()).decode()
    return item


def _reasoning_text(item: dict, where: str) -> str | None:
    """The text of a reasoning input item: its reasoning_text parts, else its summary's texts, else what this server
    encoded in its encrypted_content (another server's, which only it can read, gives none)."""
    extra = _unknown(item, {"type", "id", "summary", "content", "encrypted_content", "status"})
    if extra:
        raise InvalidRequest(f"{where}: unknown field '{extra[0]}' of a reasoning item", param=f"{where}.{extra[0]}")
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise InvalidRequest(f"{where}.{field}: a list of text parts", param=f"{where}.{field}")
        texts = [p["text"] for p in parts if isinstance(p.get("text"), str)]
        if texts:
            return "\n".join(texts)
    blob = item.get("encrypted_content")
    if isinstance(blob, str) and blob.startswith(_ENCODED):
        try:
            return base64.urlsafe_b64decode(blob[len(_ENCODED) :].encode()).decode()
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(
                f"{where}.encrypted_content: not what this server wrote", param=f"{where}.encrypted_content"
            ) from None
    return None


def _text_part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, logprobs: list, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": new_item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": status,
    }


def queued_object(request: ResponsesRequest, rid: str, created: int) -> dict:
    """A background response as its POST answers it, before it has run: queued, no output."""
    response = _skeleton(request, rid, created)
    response["status"] = "queued"
    return response


def ended(response: dict, status: str, message: str | None = None) -> dict:
    """`response` cancelled, or failed (with `message`): no output, no usage."""
    error = {"code": "server_error", "message": message} if message is not None else None
    return {**response, "status": status, "output": [], "usage": None, "error": error}


def response_object(request: ResponsesRequest, chat: dict, rid: str) -> dict:
    """The Response object of a finished chat answer (`protocol.chat_response`'s dict, usage merged in)."""
    choice = chat["choices"][0]
    message = choice["message"]
    response = _skeleton(request, rid, chat["created"])
    output = response["output"]
    if message.get("reasoning_content"):
        output.append(_reasoning_item(new_item_id("rs"), message["reasoning_content"], request.encrypted_reasoning))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(_message_item(new_item_id("msg"), content or "", logprobs))
    output.extend(_call_item(call) for call in calls)
    response["usage"] = _usage(chat["usage"])
    return _finish(response, choice["finish_reason"])


class ResponseEvents:
    """One response's server-sent events, in `protocol.StreamEvents`' interface (what the server's stream loop
    calls): `role()` opens the response, `reasoning`/`chunk`/`tool_calls` add to its output items as the model
    writes them, `usage()` closes it (`response.completed`, or `response.incomplete`), `event()` reports an error,
    and `done()` ends the stream (nothing: the Responses API has no `[DONE]`). Each event is
    `event: <type>\\ndata: <JSON>\\n\\n` with its `sequence_number`."""

    kind = "chat"  # the server's chat path: role first, tool calls parsed, reasoning split

    def __init__(self, request: ResponsesRequest, rid: str, created: int | None = None):
        self.request, self.rid = request, rid
        self.response = _skeleton(request, rid, int(time.time()) if created is None else created)
        self._seq = 0
        self._open: str | None = None  # the item being written: "reasoning" or "message"
        self._text, self._logprobs, self._item_id = "", [], ""
        self._finish_reason: str | None = None

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    def role(self) -> str:
        return self._event("response.created", response=self._snapshot()) + self._event(
            "response.in_progress", response=self._snapshot()
        )

    def _index(self) -> int:
        return len(self.response["output"])

    def _begin(self, kind: str) -> str:
        out = self._close()
        self._open, self._text, self._logprobs = kind, "", []
        if kind == "reasoning":
            self._item_id = new_item_id("rs")
            item = {"type": "reasoning", "id": self._item_id, "summary": [], "content": [], "status": "in_progress"}
            return out + self._event("response.output_item.added", output_index=self._index(), item=item)
        self._item_id = new_item_id("msg")
        item = {"type": "message", "id": self._item_id, "status": "in_progress", "role": "assistant", "content": []}
        return (
            out
            + self._event("response.output_item.added", output_index=self._index(), item=item)
            + self._event(
                "response.content_part.added",
                item_id=self._item_id,
                output_index=self._index(),
                content_index=0,
                part=_text_part("", []),
            )
        )

    def _close(self) -> str:
        """Finish the item being written (its done events) and add it to the output."""
        if self._open is None:
            return ""
        index, item_id, text = self._index(), self._item_id, self._text
        if self._open == "reasoning":
            item = _reasoning_item(item_id, text, self.request.encrypted_reasoning)
            out = self._event(
                "response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text
            )
        else:
            item = _message_item(item_id, text, self._logprobs)
            out = self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=self._logprobs,
            ) + self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=_text_part(text, self._logprobs),
            )
        out += self._event("response.output_item.done", output_index=index, item=item)
        self.response["output"].append(item)
        self._open = None
        return out

    def reasoning(self, text: str, logprobs: dict | None = None) -> str:
        out = self._begin("reasoning") if self._open != "reasoning" else ""
        self._text += text
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=self._item_id,
            output_index=self._index(),
            content_index=0,
            delta=text,
        )

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> str:
        out = ""
        if text:
            if self._open != "message":
                out += self._begin("message")
            entries = (logprobs or {}).get("content") or []
            self._text += text
            self._logprobs.extend(entries)
            out += self._event(
                "response.output_text.delta",
                item_id=self._item_id,
                output_index=self._index(),
                content_index=0,
                delta=text,
                logprobs=entries,
            )
        if finish_reason is not None:
            if not self.response["output"] and self._open != "message":  # an empty reply: an empty message
                out += self._begin("message")
            out += self._close()
            self._finish_reason = finish_reason
        return out

    def tool_calls(self, calls: list[dict], finish_reason: str | None) -> str:
        out = self._close()
        for call in calls:
            item = _call_item(call, status="in_progress", arguments="")
            index = self._index()
            arguments = call["function"]["arguments"]
            done = {**item, "arguments": arguments, "status": "completed"}
            out += (
                self._event("response.output_item.added", output_index=index, item=item)
                + self._event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
                )
                + self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=arguments,
                )
                + self._event("response.output_item.done", output_index=index, item=done)
            )
            self.response["output"].append(done)
        self._finish_reason = finish_reason
        return out

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
    ) -> str:
        out = self._close()
        self.response["usage"] = _usage(
            protocol.usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)
        )
        _finish(self.response, self._finish_reason)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=self._snapshot())

    def event(self, obj: dict) -> str:
        """An error (`protocol.error_body`'s) as the Responses API's `error` event."""
        error = obj.get("error", obj)
        return self._event(
            "error", code=str(error.get("code")), message=error.get("message", ""), param=error.get("param")
        )

    @staticmethod
    def done() -> str:
        return ""
