"""OpenAIApp: the replica's ASGI app (`@serve.ingress` over it: the replica answers HTTP itself, no router hop).

Routes, body limits, SSE streaming and OpenAI's JSON error object for every error. API keys:
`pylon.serving.api.keys`."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import TYPE_CHECKING

from pylon.serving.api.protocol import error_body

if TYPE_CHECKING:  # the server imports this module; the name is for type hints only
    from pylon.serving.api.server import PylonLLMServer


RETRY_AFTER_S = 1
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_BODY_BYTES = 16 * 2**20  # a request body past this is a 413 (a prompt of 100k token ids is ~0.7 MB)
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


MODEL_PATH = "/v1/models/{model}"  # routes with a parameter: the rest of the path after /v1/models/...
RESPONSE_PATH = "/v1/responses/{response_id}"  # ...and a stored response's id (pylon.serving.api.response_store)
INPUT_ITEMS_PATH = "/v1/responses/{response_id}/input_items"
CANCEL_PATH = "/v1/responses/{response_id}/cancel"  # a background response's
# OpenAI's Files and Batch APIs (pylon.serving.api.batch_api): a file's object and bytes, a batch and its cancel
FILE_PATH = "/v1/files/{file_id}"
FILE_CONTENT_PATH = "/v1/files/{file_id}/content"
BATCH_PATH = "/v1/batches/{batch_id}"
BATCH_CANCEL_PATH = "/v1/batches/{batch_id}/cancel"

# path -> {method: handler}: the whole API. Anything else is a 404, another method a 405, both as JSON.
ROUTES = {
    "/v1/completions": {"POST": "_completions"},
    "/v1/chat/completions": {"POST": "_chat_completions"},
    # OpenAI's Responses API, on the chat path (pylon.serving.api.responses), and its stored responses
    "/v1/responses": {"POST": "_responses"},
    RESPONSE_PATH: {"GET": "_get_response", "DELETE": "_delete_response"},
    INPUT_ITEMS_PATH: {"GET": "_response_input_items"},
    CANCEL_PATH: {"POST": "_cancel_response"},
    # Anthropic's Messages API, on the chat path (pylon.serving.api.anthropic), and its token count
    "/v1/messages": {"POST": "_messages"},
    "/v1/messages/count_tokens": {"POST": "_count_tokens"},
    "/v1/embeddings": {"POST": "_embeddings"},  # OpenAI's: each input's last-token hidden state, normalised
    # vLLM's (Jina's, Cohere's v2): documents ranked, and pairs scored, by a cross-encoder or the cosine of vectors
    "/v1/rerank": {"POST": "_rerank"},
    "/v2/rerank": {"POST": "_rerank_v2"},
    "/v1/score": {"POST": "_score"},
    "/rerank": {"POST": "_rerank_bare"},  # (vLLM's paths without /v1, which clients of its score API use)
    "/score": {"POST": "_score_bare"},
    # vLLM's: a classifier's labels (a reward model's, a cross-encoder's), and any pooled output
    "/classify": {"POST": "_classify"},
    "/v1/classify": {"POST": "_classify_v1"},  # (SGLang's path)
    "/pooling": {"POST": "_pooling"},
    "/v1/files": {"POST": "_create_file", "GET": "_list_files"},
    FILE_PATH: {"GET": "_get_file", "DELETE": "_delete_file"},
    FILE_CONTENT_PATH: {"GET": "_file_content"},
    "/v1/batches": {"POST": "_create_batch", "GET": "_list_batches"},
    BATCH_PATH: {"GET": "_get_batch"},
    BATCH_CANCEL_PATH: {"POST": "_cancel_batch"},
    "/v1/models": {"GET": "_models"},
    MODEL_PATH: {"GET": "_model"},  # OpenAI's "retrieve model": this server's one model, or a 404 naming the id
    "/tokenize": {"POST": "_tokenize"},  # vLLM's: the token ids of a prompt or a chat, and their count
    "/detokenize": {"POST": "_detokenize"},
    "/health": {"GET": "_health"},
    "/ready": {"GET": "_ready"},
    "/openapi.json": {"GET": "_openapi"},  # this API as an OpenAPI 3.1 document (pylon.serving.api.openapi)
}


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


class ClientGone(Exception):
    """The client disconnected before its request body had arrived: nothing to answer."""


async def send_json(send, status: int, obj: dict, headers: dict | None = None) -> None:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    extra = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send, status: int, message: str, *, type: str, param: str | None = None, headers: dict | None = None
) -> None:
    """OpenAI's error JSON. No X-Request-Id here: Serve's ingress (the replica's own HTTP server behind HAProxy,
    or Serve's proxy) echoes (or assigns) it on every response, ours included."""

    await send_json(send, status, error_body(message, type=type, param=param, code=status), headers)


def route_of(path: str) -> tuple[str, str | None]:
    """The ROUTES key a request path goes to, and its parameter where the route takes one (`MODEL_PATH`'s model
    id, `RESPONSE_PATH`'s, `INPUT_ITEMS_PATH`'s and `CANCEL_PATH`'s response id)."""
    prefix = MODEL_PATH.split("{")[0]
    if path.startswith(prefix) and len(path) > len(prefix):
        return MODEL_PATH, urllib.parse.unquote(path[len(prefix) :])
    prefix = RESPONSE_PATH.split("{")[0]
    if path.startswith(prefix) and len(path) > len(prefix):
        rest = path[len(prefix) :]
        for route in (INPUT_ITEMS_PATH, CANCEL_PATH):
            tail = route.split("}")[1]
            if rest.endswith(tail) and len(rest) > len(tail) and "/" not in rest[: -len(tail)]:
                return route, urllib.parse.unquote(rest[: -len(tail)])
        if "/" not in rest:
            return RESPONSE_PATH, urllib.parse.unquote(rest)
    for route in (FILE_CONTENT_PATH, FILE_PATH, BATCH_CANCEL_PATH, BATCH_PATH):  # the longer of each pair first
        prefix, tail = route.split("{")[0], route.split("}")[1]
        middle = path[len(prefix) : len(path) - len(tail)] if path.startswith(prefix) and path.endswith(tail) else ""
        if len(path) > len(prefix) + len(tail) and middle and "/" not in middle:
            return route, urllib.parse.unquote(middle)
    return path, None


def route_path(scope) -> str:
    """The path below the app's mount point (Serve mounts it at root_path + route_prefix), as Starlette routes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def request_headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def read_body(receive, limit: int | None = None) -> bytes:
    """The request's body, up to `limit` bytes (MAX_BODY_BYTES by default), else a 413."""
    limit = MAX_BODY_BYTES if limit is None else limit
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise HttpError(
                413,
                f"the request body is larger than {limit // 2**20} MiB",
                type="invalid_request_error",
                param="body",
            )
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class OpenAIApp:
    """The replica's HTTP API as a plain ASGI app, bound to its `PylonLLMServer` (what Serve's ingress calls).

    Plain ASGI rather than FastAPI: a streamed request went through FastAPI's routing, dependency resolution and
    exception middlewares, and Starlette's StreamingResponse ran every stream in an anyio task group with a second
    task listening for the disconnect that Serve's own ingress already watches for (it cancels the request's task,
    which aborts the engine request). Profiled under the serving benchmark, that was ~15% of a replica's CPU. Here
    a request is one dict lookup and one coroutine, and a chunk one `send`."""

    def __init__(self, server: "PylonLLMServer"):
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.server._dispatch(scope, receive, send)
        elif kind == "lifespan":
            await lifespan(receive, send)
        elif kind == "websocket":  # no websocket API: refuse the handshake (the client sees a 403)
            await receive()
            await send({"type": "websocket.close", "code": 1008})
