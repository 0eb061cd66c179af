"""One line of a batch (an OpenAI Batch API request, or a record of a dataset) as a request to a replica, the Batch
API's output line for its answer or its error, and a replica's ASGI app called in-process. Shared by `pylon batch`'s
engines (pylon.serving.api.batch) and a deployment's Batch API (pylon.serving.api.batch_api)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class LineError(Exception):
    """A line that is no request: its answer is an error line naming it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class Request:
    custom_id: str
    url: str
    body: dict
    record: dict | None  # a record's fields (messages or prompt mode); None for an OpenAI Batch API line


def request_of(obj, where: str, name: str, defaults: dict) -> Request:
    """A line's JSON value as a request to the engine, or a LineError saying what is wrong with it.

    An OpenAI Batch API line: {custom_id, method: POST, url, body}. A record: `messages` (a chat request answering
    them, a last assistant message dropped: a conversation's reply is regenerated) or `prompt` (a string: a
    completion request; a list of messages: a chat request, TRL's conversational prompt). A record's request takes
    `defaults` (the spec's `body`: max_tokens, temperature...); a Batch API line is sent as written. `model`
    defaults to the job's name."""
    if not isinstance(obj, dict):
        raise LineError(f"{where}: a JSON object, got {type(obj).__name__}")
    if any(k in obj for k in ("custom_id", "body", "url")):
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError(f"{where}: custom_id: a non-empty string naming the request", "custom_id")
        method = obj.get("method", "POST")
        if method != "POST":
            raise LineError(f"{where}: method: POST (a batch answers POST requests), got {method!r}", "method")
        url = obj.get("url")
        if not isinstance(url, str) or not url.startswith("/"):
            raise LineError(f"{where}: url: the request's path, e.g. {CHAT!r}, got {url!r}", "url")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError(f"{where}: body: the request's JSON object, got {type(body).__name__}", "body")
        for flag in ("stream", "background"):  # an answer is written whole, when it is done
            if body.get(flag):
                raise LineError(
                    f"{where}: body.{flag}: a batch answer is written whole; leave {flag} out", f"body.{flag}"
                )
        return Request(custom_id, url.split("?")[0], {"model": name, **body}, None)
    record = {k: v for k, v in obj.items()}
    custom_id = where
    if "messages" in obj:
        messages = _prompt_messages(obj["messages"], f"{where}: messages", "messages")
        body = {"model": name, **defaults, "messages": messages}
        if isinstance(obj.get("tools"), list):
            body["tools"] = obj["tools"]
        return Request(custom_id, CHAT, body, record)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            return Request(custom_id, COMPLETIONS, {"model": name, **defaults, "prompt": prompt}, record)
        messages = _prompt_messages(prompt, f"{where}: prompt", "prompt")
        return Request(custom_id, CHAT, {"model": name, **defaults, "messages": messages}, record)
    raise LineError(
        f"{where}: neither an OpenAI Batch API request (custom_id, method, url, body) nor a record with 'messages' "
        f"or 'prompt' (its keys: {', '.join(sorted(obj)) or 'none'})"
    )


def _prompt_messages(messages, where: str, param: str) -> list:
    """A conversation to answer: its messages up to its last reply's (a trailing assistant message dropped)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise LineError(f"{where}: a list of messages, each an object with a role", param)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # (a Parquet row's absent fields)
    while messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    if not messages:
        raise LineError(f"{where}: no message before the assistant's reply to answer", param)
    return messages


def _answer_id(custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def openai_line(custom_id: str | None, status: int, body: dict | None, request_id: str) -> dict:
    """The Batch API's output line for an answer (`status` < 400) or a failed request."""
    return {
        "id": _answer_id(custom_id or request_id),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, where: str, error: LineError) -> dict:
    """The Batch API's output line for a line that is no request (never sent to the engine)."""
    return {
        "id": _answer_id(custom_id or where),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": error.message, "param": error.param, "line": where},
    }


async def call(app, path: str, body: dict, request_id: str, headers: tuple = ()) -> tuple[int, dict]:
    """POST `body` to `app` (a replica's ASGI app) in this process, as a client that never goes away would:
    (status, JSON answer). `headers`: more request headers, as (name, value) bytes pairs (an Authorization)."""
    data = json.dumps(body).encode()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client never goes away

    status, chunks = 500, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode()), *headers],
    }
    await app(scope, receive, send)
    try:
        answer = json.loads(b"".join(chunks) or b"{}")
    except ValueError:  # (every answer of the server is JSON; kept whole if one is not)
        answer = {"error": {"message": b"".join(chunks).decode(errors="replace"), "type": "server_error"}}
    return status, answer
