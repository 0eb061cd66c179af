"""The replica's published contract: an OpenAPI 3.1 document of every route in `ROUTES` (`GET /openapi.json`).

Generated from the protocol's pydantic models (the same ones that validate requests), so the document cannot drift
from what the server takes and sends. Per deployment: the served model's name and context length, whether a bearer
key is required, and the route prefix the app is mounted under (`servers`). Every error status a route can answer
is listed with OpenAI's error object. A replica builds it once per mount point and serves the cached bytes."""

from __future__ import annotations

import json

from pydantic.json_schema import models_json_schema

from pylon.serving.api import anthropic, protocol, responses
from pylon.serving.api.http import (
    BATCH_CANCEL_PATH,
    BATCH_PATH,
    CANCEL_PATH,
    FILE_CONTENT_PATH,
    FILE_PATH,
    INPUT_ITEMS_PATH,
    MAX_BODY_BYTES,
    MODEL_PATH,
    RESPONSE_PATH,
    RETRY_AFTER_S,
    ROUTES,
)
from pylon.version import __version__

OPENAPI_VERSION = "3.1.0"
OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"

_MODELS = (
    protocol.CompletionRequest,
    protocol.ChatCompletionRequest,
    protocol.ErrorResponse,
    protocol.CompletionResponse,
    protocol.CompletionChunk,
    protocol.ChatCompletionResponse,
    protocol.ChatCompletionChunk,
    protocol.UsageChunk,
    protocol.ModelList,
    protocol.TokenizeRequest,
    protocol.TokenizeResponse,
    protocol.DetokenizeRequest,
    protocol.DetokenizeResponse,
    protocol.EmbeddingRequest,
    protocol.EmbeddingResponse,
    protocol.RerankRequest,
    protocol.RerankResponse,
    protocol.ScoreRequest,
    protocol.ScoreResponse,
    protocol.PoolingRequest,
    protocol.ClassificationResponse,
    protocol.PoolingResponse,
    protocol.HealthStatus,
    protocol.ReadyStatus,
    responses.ResponsesRequest,
    responses.ResponseObject,
    responses.ResponseStreamEvent,
    responses.DeletedResponse,
    responses.InputItemList,
    protocol.BatchCreateRequest,
    protocol.FileObject,
    protocol.FileList,
    protocol.Deleted,
    protocol.Batch,
    protocol.BatchList,
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    anthropic.AnthropicMessage,
    anthropic.AnthropicStreamEvent,
    anthropic.AnthropicError,
    anthropic.TokenCount,
)


def _ref(model) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _header(description: str, schema: dict, required: bool = True) -> dict:
    return {"description": description, "required": required, "schema": schema}


_RETRY_AFTER = _header(f"seconds to wait before retrying ({RETRY_AFTER_S})", {"type": "string", "pattern": "^[0-9]+$"})

# status -> (description, response headers): the errors the server answers itself, each with OpenAI's error object.
_ERRORS = {
    400: ("Invalid request: a malformed body, a wrong type, a value out of range, an unsupported parameter.", {}),
    401: (
        "Missing or wrong API key.",
        {"WWW-Authenticate": _header("the scheme to authenticate with", {"type": "string", "const": "Bearer"})},
    ),
    404: ("Unknown model (the request's `model`), or an unknown path.", {}),
    405: (
        "The path exists, the method does not.",
        {"Allow": _header("the method the path answers", {"type": "string"})},
    ),
    413: (f"The request body is larger than {MAX_BODY_BYTES // 2**20} MiB.", {}),
    415: ("A compressed body (`Content-Encoding` other than identity).", {}),
    429: ("The replica's queue is full: retry after `Retry-After` seconds.", {"Retry-After": _RETRY_AFTER}),
    500: ("An internal error while serving this request (the replica's log says more); the server serves on.", {}),
    503: (
        "The model's engine is unavailable.",
        {"Retry-After": {**_RETRY_AFTER, "required": False}},
    ),
    504: ("The request took longer than the deployment's `http.request_timeout_s`.", {}),
}


def _error(status: int) -> dict:
    description, headers = _ERRORS[status]
    response = {"description": description, "content": _json(_ref(protocol.ErrorResponse))}
    if headers:
        response["headers"] = headers
    return response


def _event_schema(chunk) -> dict:
    """One server-sent event (OpenAPI before 3.2 describes an event stream by its events): `data: <JSON>`, the
    JSON a chunk, the usage chunk or an error object (a timeout or a dead engine mid-stream), and last `[DONE]`."""
    payload = {"anyOf": [_ref(chunk), _ref(protocol.UsageChunk), _ref(protocol.ErrorResponse)]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"type": "string", "const": "[DONE]"},
                    {
                        "type": "string",
                        "not": {"const": "[DONE]"},
                        "contentMediaType": "application/json",
                        "contentSchema": payload,
                    },
                ]
            },
            "event": {"type": "string", "const": "message"},
        },
    }


def _typed_event_schema(model) -> dict:
    """A typed server-sent event (the Responses API's, Anthropic's): `event: <type>`, its data a `model` (no
    `[DONE]`)."""
    return {
        "type": "object",
        "required": ["data", "event"],
        "properties": {
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(model)},
            "event": {"type": "string"},
        },
    }


def _anthropic_error(status: int) -> dict:
    """An error of the Anthropic routes: Anthropic's error object (anthropic.anthropic_errors)."""
    response = _error(status)
    return {**response, "content": _json(_ref(anthropic.AnthropicError))}


def _messages_operation(secured: bool) -> dict:
    statuses = [400, *([401] if secured else []), 404, 413, 415, 429, 503, 504]
    event = _typed_event_schema(anthropic.AnthropicStreamEvent)
    return {
        "summary": "Answer a conversation (Anthropic's Messages API, on the chat path)",
        "requestBody": {"required": True, "content": _json(_ref(anthropic.MessagesRequest))},
        "responses": {
            "200": {
                "description": "Anthropic's message, or with `stream: true` its server-sent events, `message_start` "
                "first and `message_stop` last.",
                "content": {**_json(_ref(anthropic.AnthropicMessage)), "text/event-stream": {"schema": event}},
            },
            **{str(s): _anthropic_error(s) for s in statuses},
            "500": _error(500),
        },
    }


def _count_tokens_operation(secured: bool) -> dict:
    statuses = [400, *([401] if secured else []), 404, 413, 415]
    return {
        "summary": "The tokens of a Messages request's prompt, rendered as /v1/messages renders it (Anthropic's)",
        "requestBody": {"required": True, "content": _json(_ref(anthropic.CountTokensRequest))},
        "responses": {
            "200": {"description": "Its count.", "content": _json(_ref(anthropic.TokenCount))},
            **{str(s): _anthropic_error(s) for s in statuses},
            "500": _error(500),
        },
    }


def _generate(summary: str, request, response, chunk, secured: bool) -> dict:
    statuses = [400, *([401] if secured else []), 404, 413, 415, 429, 500, 503, 504]
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {
            "200": {
                "description": "The generation: JSON, or with `stream: true` server-sent events ending in "
                "`data: [DONE]`.",
                "content": {
                    **_json(_ref(response)),
                    **({"text/event-stream": {"schema": _event_schema(chunk)}} if chunk is not None else {}),
                },
            },
            **{str(s): _error(s) for s in statuses},
        },
    }


def _responses_operation(secured: bool) -> dict:
    operation = _generate(
        "Respond to a conversation (OpenAI's Responses API, on the chat path; kept where the deployment has "
        "http.responses_store, unless store is false)",
        responses.ResponsesRequest,
        responses.ResponseObject,
        None,
        secured,
    )
    ok = operation["responses"]["200"]
    ok["description"] = (
        "The Response object, or with `stream: true` the Responses API's typed server-sent events, "
        "`response.created` first and `response.completed` (or `response.incomplete`) last."
    )
    ok["content"]["text/event-stream"] = {"schema": _typed_event_schema(responses.ResponseStreamEvent)}
    return operation


# The routes that answer without a key: probes and this document.
_OPEN = ("/health", "/ready", OPENAPI_PATH)


def _stored(summary: str, response, secured: bool, query: bool = False, refused: bool = False) -> dict:
    """An operation on a stored response (pylon.serving.api.response_store): 404 where the key has none by that id,
    or the deployment keeps none; 503 where the store cannot be read."""
    parameters = [
        {
            "name": "response_id",
            "in": "path",
            "required": True,
            "description": "the response's id (resp_...), as POST /v1/responses answered it",
            "schema": {"type": "string", "minLength": 1},
        }
    ]
    if query:
        parameters += [
            {
                "name": "limit",
                "in": "query",
                "description": "items per page",
                "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
            },
            {
                "name": "order",
                "in": "query",
                "description": "desc: newest first",
                "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"},
            },
            {
                "name": "after",
                "in": "query",
                "description": "an item id: the page after it",
                "schema": {"type": "string"},
            },
        ]
    statuses = [*([400] if query or refused else []), *([401] if secured else []), 404, 500, 503]
    return {
        "summary": summary,
        "parameters": parameters,
        "responses": {
            "200": {"description": "The answer.", "content": _json(_ref(response))},
            **{str(s): _error(s) for s in statuses},
        },
    }


def _batch_op(
    summary: str,
    response,
    secured: bool,
    *,
    param: str | None = None,
    request=None,
    listing: bool = False,
    raw: bool = False,
    statuses: tuple[int, ...] = (),
) -> dict:
    """An operation of OpenAI's Files and Batch APIs (pylon.serving.api.batch_api): 400 where the deployment keeps
    none (http.batch_store null) or the request is wrong, 404 where the key has no object by that id, 503 where the
    store cannot be reached."""
    operation: dict = {"summary": summary}
    parameters = []
    if param is not None:
        what = "file-..." if param == "file_id" else "batch_..."
        parameters.append(
            {
                "name": param,
                "in": "path",
                "required": True,
                "description": f"the id ({what}) its create answered",
                "schema": {"type": "string", "minLength": 1},
            }
        )
    if listing:
        parameters += [
            {
                "name": "limit",
                "in": "query",
                "description": "objects per page, newest first",
                "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
            },
            {"name": "after", "in": "query", "description": "an id: the page after it", "schema": {"type": "string"}},
            {
                "name": "order",
                "in": "query",
                "description": "desc: newest first",
                "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"},
            },
        ]
        if param is None and response is protocol.FileList:
            parameters.append(
                {
                    "name": "purpose",
                    "in": "query",
                    "description": "only the files of this purpose",
                    "schema": {"type": "string", "enum": ["batch", "batch_output"]},
                }
            )
    if parameters:
        operation["parameters"] = parameters
    if request is not None:
        operation["requestBody"] = {"required": True, "content": request}
    ok = {"application/jsonl": {"schema": {"type": "string"}}} if raw else _json(_ref(response))
    codes = sorted({400, *([401] if secured else []), *([404] if param is not None else []), 500, 503, *statuses})
    operation["responses"] = {
        "200": {"description": "The answer.", "content": ok},
        **{str(s): _error(s) for s in codes},
    }
    return operation


def _tokens(summary: str, request, response, secured: bool, statuses: tuple[int, ...] = ()) -> dict:
    statuses = sorted([400, *([401] if secured else []), 404, 413, 415, 500, *statuses])
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {
            "200": {"description": "The answer.", "content": _json(_ref(response))},
            **{str(s): _error(s) for s in statuses},
        },
    }


def build(
    *,
    model: str,
    max_model_len: int,
    secured: bool,
    route_prefix: str = "/",
    server_url: str | None = None,
    adapters: tuple[str, ...] = (),
) -> dict:
    """The OpenAPI document of one deployment: `model` (and its LoRA `adapters`) served with `max_model_len` tokens
    of context, a bearer key required when `secured`, mounted under `route_prefix` (or reached at `server_url`, for
    a document served elsewhere)."""
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    schemas = defs["$defs"]
    # The engine refuses a prompt plus max_tokens past the context, and a prompt has at least one token.
    for name, field in (
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
    ):
        schemas[name]["properties"][field]["anyOf"][0]["maximum"] = max_model_len - 1
    schemas["MessagesRequest"]["properties"]["max_tokens"]["maximum"] = max_model_len - 1  # (required: no anyOf)
    schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] = max_model_len - 1
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "EmbeddingRequest",
        "RerankRequest",
        "ScoreRequest",
        "ResponsesRequest",
        "MessagesRequest",
        "CountTokensRequest",
    ):  # else 404
        schemas[name]["properties"]["model"]["enum"] = [model, *adapters]

    security = [{"bearer": []}] if secured else []
    internal = {"500": _error(500)}
    operations = {
        "/v1/completions": (
            "post",
            _generate(
                "Complete a prompt (OpenAI's completions API)",
                protocol.CompletionRequest,
                protocol.CompletionResponse,
                protocol.CompletionChunk,
                secured,
            ),
        ),
        "/v1/chat/completions": (
            "post",
            _generate(
                "Answer a chat (OpenAI's chat completions API)",
                protocol.ChatCompletionRequest,
                protocol.ChatCompletionResponse,
                protocol.ChatCompletionChunk,
                secured,
            ),
        ),
        "/v1/responses": ("post", _responses_operation(secured)),
        "/v1/messages": ("post", _messages_operation(secured)),
        "/v1/messages/count_tokens": ("post", _count_tokens_operation(secured)),
        RESPONSE_PATH: {
            "get": _stored(
                "A stored response (OpenAI's retrieve a response; the deployment's http.responses_store)",
                responses.ResponseObject,
                secured,
            ),
            "delete": _stored("Delete a stored response", responses.DeletedResponse, secured),
        },
        CANCEL_PATH: (
            "post",
            _stored(
                "Cancel a background response still in progress (OpenAI's cancel a response): 400 once it has ended",
                responses.ResponseObject,
                secured,
                refused=True,
            ),
        ),
        INPUT_ITEMS_PATH: (
            "get",
            _stored(
                "A stored response's input items, a page at a time (OpenAI's list input items)",
                responses.InputItemList,
                secured,
                query=True,
            ),
        ),
        "/v1/embeddings": (
            "post",
            _tokens(
                "Embed texts or token ids (OpenAI's embeddings API): each input's last-token hidden state, normalised",
                protocol.EmbeddingRequest,
                protocol.EmbeddingResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/v1/rerank": (
            "post",
            _tokens(
                "Rank documents by relevance to a query (vLLM's, Jina's and Cohere's rerank API): a cross-encoder's "
                "score of each (query, document) pair, or the cosine of the embedding model's vectors",
                protocol.RerankRequest,
                protocol.RerankResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/rerank": (
            "post",
            _tokens(
                "The rerank API at vLLM's path without /v1 (the same as /v1/rerank)",
                protocol.RerankRequest,
                protocol.RerankResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/score": (
            "post",
            _tokens(
                "The score API at vLLM's path without /v1 (the same as /v1/score)",
                protocol.ScoreRequest,
                protocol.ScoreResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/v2/rerank": (
            "post",
            _tokens(
                "The rerank API at Cohere's v2 path (the same as /v1/rerank)",
                protocol.RerankRequest,
                protocol.RerankResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/v1/score": (
            "post",
            _tokens(
                "Score text pairs (vLLM's score API): a cross-encoder's score of each pair (a classifier of one "
                "label), or the cosine of the embedding model's vectors",
                protocol.ScoreRequest,
                protocol.ScoreResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        **{
            path: (
                "post",
                _tokens(
                    "Classify texts or a chat (vLLM's classification API): each input's label and label probabilities "
                    "from a classifier (a reward model, a cross-encoder: a *ForSequenceClassification checkpoint, or "
                    "engine.classifier_from_token); 400 for a model that is not one",
                    protocol.PoolingRequest,
                    protocol.ClassificationResponse,
                    secured,
                    statuses=(429, 503, 504),
                ),
            )
            for path in ("/classify", "/v1/classify")
        },
        "/pooling": (
            "post",
            _tokens(
                "Pooled outputs (vLLM's pooling API): a classifier's label probabilities (its logits with "
                "use_activation false: a reward model's reward), or an embedding model's vectors",
                protocol.PoolingRequest,
                protocol.PoolingResponse,
                secured,
                statuses=(429, 503, 504),
            ),
        ),
        "/v1/files": {
            "post": _batch_op(
                "Upload a JSONL file of Batch API requests (OpenAI's upload file: multipart/form-data, purpose batch)",
                protocol.FileObject,
                secured,
                request={
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["file", "purpose"],
                            "properties": {
                                "file": {"type": "string", "contentMediaType": "application/octet-stream"},
                                "purpose": {"type": "string", "enum": ["batch"]},
                            },
                        }
                    }
                },
                statuses=(413,),
            ),
            "get": _batch_op("The key's files (OpenAI's list files)", protocol.FileList, secured, listing=True),
        },
        FILE_PATH: {
            "get": _batch_op("A file (OpenAI's retrieve file)", protocol.FileObject, secured, param="file_id"),
            "delete": _batch_op("Delete a file", protocol.Deleted, secured, param="file_id"),
        },
        FILE_CONTENT_PATH: (
            "get",
            _batch_op(
                "A file's bytes: an input, or a batch's output or error file (OpenAI's retrieve file content)",
                None,
                secured,
                param="file_id",
                raw=True,
            ),
        ),
        "/v1/batches": {
            "post": _batch_op(
                "Create a batch of an uploaded file, answered in the background by the replica (OpenAI's create batch)",
                protocol.Batch,
                secured,
                request=_json(_ref(protocol.BatchCreateRequest)),
                statuses=(404,),
            ),
            "get": _batch_op("The key's batches (OpenAI's list batches)", protocol.BatchList, secured, listing=True),
        },
        BATCH_PATH: (
            "get",
            _batch_op(
                "A batch: its status, counts and files (OpenAI's retrieve batch)",
                protocol.Batch,
                secured,
                param="batch_id",
            ),
        ),
        BATCH_CANCEL_PATH: (
            "post",
            _batch_op(
                "Cancel a batch in progress (OpenAI's cancel batch): 400 once it has ended",
                protocol.Batch,
                secured,
                param="batch_id",
            ),
        ),
        "/v1/models": (
            "get",
            {
                "summary": "The served model and its context length",
                "responses": {
                    "200": {"description": "One model.", "content": _json(_ref(protocol.ModelList))},
                    **({"401": _error(401)} if secured else {}),
                    **internal,
                },
            },
        ),
        MODEL_PATH: (
            "get",
            {
                "summary": "The served model's card (OpenAI's retrieve model); another id is a 404",
                "parameters": [
                    {
                        "name": "model",
                        "in": "path",
                        "required": True,
                        "description": "the model's id, as GET /v1/models lists it",
                        "schema": {"type": "string", "minLength": 1},
                    }
                ],
                "responses": {
                    "200": {"description": "The model.", "content": _json(_ref(protocol.ModelCard))},
                    "404": _error(404),
                    **({"401": _error(401)} if secured else {}),
                    **internal,
                },
            },
        ),
        "/tokenize": (
            "post",
            _tokens(
                "The token ids of a prompt, or of a chat as the chat endpoint renders it (vLLM's), and their count",
                protocol.TokenizeRequest,
                protocol.TokenizeResponse,
                secured,
            ),
        ),
        "/detokenize": (
            "post",
            _tokens("The text of token ids (vLLM's)", protocol.DetokenizeRequest, protocol.DetokenizeResponse, secured),
        ),
        "/health": (
            "get",
            {
                "summary": "Liveness: 200 while the engine's step loop is beating (no key needed: a probe)",
                "responses": {
                    "200": {"description": "The engine is alive.", "content": _json(_ref(protocol.HealthStatus))},
                    "503": {"description": "The engine is not.", "content": _json(_ref(protocol.HealthStatus))},
                    **internal,
                },
            },
        ),
        "/ready": (
            "get",
            {
                "summary": "Readiness: requests running and waiting, KV-cache usage (no key needed: a probe)",
                "responses": {
                    "200": {"description": "Ready.", "content": _json(_ref(protocol.ReadyStatus))},
                    "503": {"description": "The engine is not alive.", "content": _json(_ref(protocol.ReadyStatus))},
                    **internal,
                },
            },
        ),
        OPENAPI_PATH: (
            "get",
            {
                "summary": "This document (no key needed)",
                "responses": {
                    "200": {
                        "description": "The OpenAPI 3.1 document.",
                        "content": _json({"type": "object", "required": ["openapi", "paths"]}),
                    },
                    **internal,
                },
            },
        ),
    }
    assert set(operations) == set(ROUTES), "every route in ROUTES is documented, and nothing else"
    paths = {}
    for path, entry in operations.items():
        by_method = entry if isinstance(entry, dict) else {entry[0]: entry[1]}
        assert [m.upper() for m in by_method] == list(ROUTES[path]), path
        for method, operation in by_method.items():
            operation["operationId"] = ROUTES[path][method.upper()].strip("_")
            operation["security"] = security if secured and path not in _OPEN else []
        paths[path] = by_method

    components = {
        "schemas": schemas,
        "responses": {"NotFound": _error(404), "MethodNotAllowed": _error(405)},
    }
    if secured:
        components["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "`Authorization: Bearer <key>`: one of the keys in the variable the deployment's "
                "`http.api_keys_env` names.",
            }
        }
    prefix = route_prefix.rstrip("/") or "/"
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": f"Pylon: {model}",
            "version": __version__,
            "description": (
                f"OpenAI-compatible API serving `{model}` ({max_model_len} tokens of context). Every error this "
                "server answers is OpenAI's error object (`components/schemas/ErrorResponse`): a path it does not "
                "have is a 404 (`components/responses/NotFound`), a method a path does not answer a 405 with "
                "`Allow` (`components/responses/MethodNotAllowed`). Ray Serve's own proxy may answer 503 in plain "
                "text when every replica's queue is full."
            ),
        },
        "servers": [{"url": server_url or prefix}],
        "paths": paths,
        "components": components,
    }


def document_bytes(**kwargs) -> bytes:
    """`build(...)` as the JSON bytes the replica sends."""
    return json.dumps(build(**kwargs), ensure_ascii=False, separators=(",", ":")).encode()
