"""A `Deployment` spec in, a Ray Serve application out: the OpenAI-compatible API over the engine.

    app = build_app(spec)                      # like ray.serve.llm's build_openai_app(LLMConfig)
    serve.run(app, name=spec.name, route_prefix=spec.http.route_prefix)
    url = deploy(spec)                         # the same, on the local Pylon cluster; returns the base URL

Each replica owns one engine (the model, its KV cache and its step loop, in a child process by default) and
answers HTTP itself (`@serve.ingress` over a plain ASGI app, `OpenAIApp`): a separate router deployment would add
a hop per streamed token for nothing.

    POST /v1/completions   POST /v1/chat/completions   GET /v1/models   GET /health   GET /ready

Admission: Serve routes up to `max_num_seqs + 2 * max_queued_requests` requests to a replica; the replica
answers 429 with Retry-After once `max_queued_requests` are already waiting for the engine. Every error is
OpenAI's JSON error object. API keys: the spec names an environment variable (read where `build_app` runs);
the replica receives only their SHA-256 digests, so no key is in the Serve config, the dashboard or a log.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import time

from pylon.errors import PylonError
from pylon.serving.errors import EngineDeadError, InvalidRequest, RequestFailed
from pylon.serving.scheduling import serve_cpu_as_batch
from pylon.specs import DeploymentSpec

log = logging.getLogger("pylon.serving")

RETRY_AFTER_S = 1
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


def api_key_digests(spec: DeploymentSpec, environ: dict | None = None) -> list[str]:
    """SHA-256 hex digests of the keys in the env var the spec names ([] = auth off)."""
    env_name = spec.http.api_keys_env
    if not env_name:
        return []
    raw = (environ if environ is not None else os.environ).get(env_name, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if not keys:
        raise PylonError(f"http.api_keys_env: environment variable {env_name} is empty or unset; set it to "
                         f"comma-separated API keys, or set http.api_keys_env: null to serve without auth")
    return [hashlib.sha256(k.encode()).hexdigest() for k in keys]


MAX_BODY_BYTES = 16 * 2**20  # a request body past this is a 413 (a prompt of 100k token ids is ~0.7 MB)
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
# path -> (method, handler): the whole API. Anything else is a 404, another method a 405, both as JSON.
_ROUTES = {
    "/v1/completions": ("POST", "_completions"),
    "/v1/chat/completions": ("POST", "_chat_completions"),
    "/v1/models": ("GET", "_models"),
    "/health": ("GET", "_health"),
    "/ready": ("GET", "_ready"),
}


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


class _ClientGone(Exception):
    """The client disconnected before its request body had arrived: nothing to answer."""


async def _send_json(send, status: int, obj: dict, headers: dict | None = None) -> None:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    extra = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, status: int, message: str, *, type: str, param: str | None = None,
                      headers: dict | None = None) -> None:
    """OpenAI's error JSON. No X-Request-Id here: Serve's ingress (the replica's own HTTP server behind HAProxy,
    or Serve's proxy) echoes (or assigns) it on every response, ours included."""
    from pylon.serving.protocol import error_body

    await _send_json(send, status, error_body(message, type=type, param=param, code=status), headers)


def _route_path(scope) -> str:
    """The path below the app's mount point (Serve mounts it at root_path + route_prefix), as Starlette routes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _read_body(receive) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        part = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise _HttpError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                             type="invalid_request_error", param="body")
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _lifespan(receive, send) -> None:
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
            await _lifespan(receive, send)
        elif kind == "websocket":  # no websocket API: refuse the handshake (the client sees a 403)
            await receive()
            await send({"type": "websocket.close", "code": 1008})


def _metrics(model: str):
    from ray.serve import metrics

    tags = {"model": model}

    def hist(name, desc):
        h = metrics.Histogram(name, description=desc, boundaries=_LATENCY_BOUNDARIES, tag_keys=("model",))
        h.set_default_tags(dict(tags))  # Serve adds its own tags to the dict it gets
        return h

    def gauge(name, desc):
        g = metrics.Gauge(name, description=desc, tag_keys=("model",))
        g.set_default_tags(dict(tags))  # Serve adds its own tags to the dict it gets
        return g

    def counter(name, desc, keys=("model",)):
        c = metrics.Counter(name, description=desc, tag_keys=keys)
        c.set_default_tags(dict(tags))  # Serve adds its own tags to the dict it gets
        return c

    return {
        "ttft": hist("pylon_time_to_first_token_seconds", "Time from arrival to the first generated token"),
        "itl": hist("pylon_inter_token_latency_seconds", "Time between consecutive generated tokens"),
        "e2e": hist("pylon_e2e_request_latency_seconds", "Time from arrival to the last token"),
        "queue": hist("pylon_request_queue_time_seconds", "Time from arrival to first being scheduled"),
        "running": gauge("pylon_num_requests_running", "Requests in the engine's running batch"),
        "waiting": gauge("pylon_num_requests_waiting", "Requests waiting for the engine"),
        "kv": gauge("pylon_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
        "prompt_tokens": counter("pylon_prompt_tokens_total", "Prompt tokens processed"),
        "generation_tokens": counter("pylon_generation_tokens_total", "Tokens generated"),
        "requests": counter("pylon_requests_total", "Finished requests by HTTP status and finish reason",
                            keys=("model", "status", "finish_reason")),
    }


class PylonLLMServer:
    """One replica: the engine for `spec.model` and the HTTP API in front of it."""

    def __init__(self, spec: dict, key_digests: list[str]):
        from pylon.serving.engine import AsyncLLMEngine
        from pylon.serving.engine_process import EnginePool, ProcessLLMEngine

        self.spec = DeploymentSpec.model_validate(spec)
        self.model_name = self.spec.name
        self._key_digests = [bytes.fromhex(d) for d in key_digests]
        t0 = time.monotonic()
        engine = self.spec.engine
        kind = EnginePool if engine.data_parallel > 1 else ProcessLLMEngine if engine.separate_process else AsyncLLMEngine
        self.engine = kind.from_model(self.spec.model, self.spec.engine)
        log.info("loaded %s from %s in %.1f s", self.model_name, self.spec.model, time.monotonic() - t0)
        # On a CPU the engines are throughput work and this process's wakeups (chunks, Ray's own threads) should
        # not preempt them mid-step (pylon.serving.scheduling).
        serve_cpu_as_batch(self.engine.device, f"replica of {self.model_name}")
        self.metrics = _metrics(self.model_name)
        self._gauges_task = None

    # -- Serve hooks ------------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Serve's replica health check: a dead or stuck step loop gets the replica replaced."""
        if not self.engine.check_health():
            raise RuntimeError(f"{self.model_name}: the engine's step loop is not running")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2)

    # -- plumbing ---------------------------------------------------------------------------------------

    def _ensure_gauges(self) -> None:
        if self._gauges_task is None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._report_gauges())

    async def _report_gauges(self) -> None:
        while True:
            stats = self.engine.stats()
            self.metrics["running"].set(stats.num_running)
            self.metrics["waiting"].set(stats.num_waiting)
            self.metrics["kv"].set(stats.kv_cache_utilization)
            await asyncio.sleep(1.0)

    def _authorize(self, headers: dict[str, str]) -> None:
        if not self._key_digests:
            return
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _HttpError(401, "missing API key: send 'Authorization: Bearer <key>'",
                             type="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        digest = hashlib.sha256(token.strip().encode()).digest()
        if not any(hmac.compare_digest(digest, d) for d in self._key_digests):
            raise _HttpError(401, "invalid API key", type="authentication_error",
                             headers={"WWW-Authenticate": "Bearer"})

    def _admit(self) -> None:
        waiting = self.engine.stats().num_waiting
        if waiting >= self.spec.http.max_queued_requests:
            raise _HttpError(429, f"server busy: {waiting} requests already waiting for {self.model_name}; "
                                  f"retry after {RETRY_AFTER_S} s", type="rate_limit_error",
                             headers={"Retry-After": str(RETRY_AFTER_S)})

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise _HttpError(404, f"model '{name}' does not exist; this server has '{self.model_name}' "
                                  "(see GET /v1/models)", type="invalid_request_error", param="model")

    async def _dispatch(self, scope, receive, send) -> None:
        path, method = _route_path(scope), scope["method"]
        route = _ROUTES.get(path)
        if route is None:
            return await _send_error(send, 404, f"no route {path}; this server answers POST /v1/completions, "
                                                "POST /v1/chat/completions, GET /v1/models, GET /health and GET /ready",
                                     type="invalid_request_error")
        allowed, handler = route
        if method != allowed:
            return await _send_error(send, 405, f"{method} {path} is not allowed; use {allowed}",
                                     type="invalid_request_error", headers={"Allow": allowed})
        try:
            await getattr(self, handler)(scope, receive, send)
        except _ClientGone:
            return
        except Exception:  # a bug of ours: a 500 with an error body, not a dropped connection (if nothing was sent yet)
            log.exception("%s %s failed", method, path)
            try:
                await _send_error(send, 500, f"internal error while serving {method} {path} (see the replica's log)",
                                  type="server_error")
            except Exception:  # the response had already started
                pass

    async def _completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, "completion")

    async def _chat_completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, "chat")

    async def _models(self, scope, receive, send) -> None:
        try:
            self._authorize(_headers(scope))
        except _HttpError as e:
            return await _send_error(send, e.status, e.message, type=e.type, headers=e.headers)
        await _send_json(send, 200, {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "owned_by": "pylon", "created": 0,
            "max_model_len": self.engine.max_model_len}]})

    async def _health(self, scope, receive, send) -> None:
        """Liveness that probes the engine: its step loop must have beaten within the heartbeat window."""
        ok = self.engine.check_health()
        await _send_json(send, 200 if ok else 503, {"status": "ok" if ok else "engine loop not running"})

    async def _ready(self, scope, receive, send) -> None:
        stats = self.engine.stats()
        ok = self.engine.check_health()
        await _send_json(send, 200 if ok else 503, {
            "ready": ok, "model": self.model_name, "running": stats.num_running, "waiting": stats.num_waiting,
            "kv_cache_usage": round(stats.kv_cache_utilization, 4)})

    async def _generate(self, scope, receive, send, kind: str) -> None:
        from pylon.serving import protocol

        headers = _headers(scope)
        # Serve's ingress puts the client's X-Request-Id (or one it made up) on the request and the response.
        request_id = headers.get("x-request-id", "")
        if not _REQUEST_ID.match(request_id):
            request_id = protocol.new_id("req")
        self._ensure_gauges()
        try:
            self._authorize(headers)
            cls = protocol.CompletionRequest if kind == "completion" else protocol.ChatCompletionRequest
            encoding = headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):  # read as JSON, a compressed body would be a baffling 400
                raise _HttpError(415, f"Content-Encoding {encoding!r} is not supported: send the JSON body "
                                      "uncompressed", type="invalid_request_error", param="body")
            body = protocol.parse_request(cls, await _read_body(receive))
            self._check_model(body.model)
            if kind == "completion":
                prompt = body.prompt
                if isinstance(prompt, str) and not prompt:
                    raise InvalidRequest("prompt must not be empty", param="prompt")
            else:
                from pylon.serving.tokenization import apply_chat_template

                prompt = apply_chat_template(self.engine.tokenizer, [m.model_dump(exclude_none=True)
                                                                     for m in body.messages])
            # OpenAI's completions default is 16 tokens; chat runs to the end of the context by default.
            params = body.sampling_params(default_max_tokens=16 if kind == "completion" else None)
            self._admit()
            engine_id = f"{request_id}-{protocol.new_id('e')}"
            stream = self.engine.generate(engine_id, prompt, params,
                                          interval_s=self.spec.http.stream_interval_ms / 1000)
            first = await self._first(stream)  # validation errors surface here, before any byte is sent
        except _HttpError as e:
            self._count(e.status, "none")
            return await _send_error(send, e.status, e.message, type=e.type, param=e.param, headers=e.headers)
        except InvalidRequest as e:
            self._count(400, "none")
            return await _send_error(send, 400, str(e), type="invalid_request_error", param=e.param)
        except EngineDeadError as e:
            self._count(503, "none")
            return await _send_error(send, 503, f"{self.model_name} is unavailable: {e}", type="server_error",
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        except RequestFailed as e:  # the engine's fault, this request's alone: the engine serves on
            log.error("%s: %s", self.model_name, e)
            self._count(500, "none")
            return await _send_error(send, 500, str(e), type="server_error")

        rid = protocol.new_id("cmpl" if kind == "completion" else "chatcmpl")
        timeout = self.spec.http.request_timeout_s
        if body.stream:
            return await self._stream(send, protocol.StreamEvents(kind, rid, self.model_name), body, first, stream,
                                      timeout)
        text, last = [], first
        try:
            async with asyncio.timeout(timeout):
                async for out in _chain(first, stream):
                    text.append(out.text)
                    last = out
        except TimeoutError:
            self._count(504, "timeout")
            return await _send_error(send, 504, f"the request took longer than request_timeout_s ({timeout:g} s)",
                                     type="timeout_error")
        except EngineDeadError as e:
            self._count(503, "none")
            return await _send_error(send, 503, str(e), type="server_error")
        finally:
            await stream.aclose()  # aborts the engine request if it has not finished (a timeout, a cancel)
        self._observe(last)
        make = protocol.completion_response if kind == "completion" else protocol.chat_response
        await _send_json(send, 200, make(rid, self.model_name, "".join(text), last.finish_reason,
                                         last.num_prompt_tokens, last.num_output_tokens))

    async def _first(self, stream):
        return await stream.__anext__()

    async def _stream(self, send, events, body, first, stream, timeout: float) -> None:
        """Server-sent events: one chunk per engine output, a usage chunk if asked, then [DONE]. A client that
        disconnects gets this task cancelled by Serve's ingress; closing `stream` then aborts the engine request.

        Events that are ready together go out as one write: chat's role chunk with the first content, and the
        last content chunk with the usage chunk and [DONE]."""
        from pylon.serving import protocol

        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        last, held = first, events.role() if events.kind == "chat" else ""
        try:
            async with asyncio.timeout(timeout):
                async for out in _chain(first, stream):
                    last = out
                    if not out.text and not out.finished:
                        continue
                    held += events.chunk(out.text, out.finish_reason)
                    if not out.finished:  # the last one waits for the usage chunk and [DONE]
                        await send({"type": "http.response.body", "body": held.encode(), "more_body": True})
                        held = ""
            if body.include_usage:
                held += events.usage(last.num_prompt_tokens, last.num_output_tokens)
            self._observe(last)
        except TimeoutError:
            self._count(504, "timeout")
            held += events.event(protocol.error_body(f"the request took longer than request_timeout_s "
                                                     f"({timeout:g} s)", type="timeout_error", code=504))
        except EngineDeadError as e:
            self._count(503, "none")
            held += events.event(protocol.error_body(str(e), type="server_error", code=503))
        finally:
            await stream.aclose()  # aborts the engine request if it has not finished
        await send({"type": "http.response.body", "body": (held + "data: [DONE]\n\n").encode(), "more_body": False})

    def _observe(self, last) -> None:
        m, metrics = self.metrics, last.metrics
        if metrics.time_to_first_token is not None:
            m["ttft"].observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            m["queue"].observe(metrics.queue_time)
        if metrics.last_token_time is not None:
            m["e2e"].observe(metrics.last_token_time - metrics.arrival_time)
            if last.num_output_tokens > 1 and metrics.first_token_time is not None:
                m["itl"].observe((metrics.last_token_time - metrics.first_token_time) / (last.num_output_tokens - 1))
        m["prompt_tokens"].inc(last.num_prompt_tokens)
        if last.num_output_tokens:
            m["generation_tokens"].inc(last.num_output_tokens)
        self._count(200, last.finish_reason or "none")

    def _count(self, status: int, reason: str) -> None:
        self.metrics["requests"].inc(tags={"status": str(status), "finish_reason": reason})

    def __serve_build_asgi_app__(self) -> OpenAIApp:
        """Serve's ingress calls this once the replica is constructed: the ASGI app it hands HTTP requests."""
        return OpenAIApp(self)


def _ingress_class():
    from ray import serve

    return serve.ingress()(PylonLLMServer)


LLMServerDeployment = _ingress_class()


async def _chain(first, stream):
    yield first
    if first.finished:
        return
    async for out in stream:
        yield out


def build_app(spec: DeploymentSpec, *, key_digests: list[str] | None = None):
    """The Serve application for `spec` (not yet running): pass it to `serve.run`."""
    from ray import serve

    digests = api_key_digests(spec) if key_digests is None else key_digests
    a, http = spec.autoscaling, spec.http
    autoscaling = {
        "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
    }
    if a.initial_replicas is not None:
        autoscaling["initial_replicas"] = a.initial_replicas
    running = spec.engine.data_parallel * spec.engine.max_num_seqs  # a replica's running batches, all its engines'
    deployment = serve.deployment(
        LLMServerDeployment,
        name=f"{spec.name}",
        autoscaling_config=autoscaling,
        # Serve hands a replica up to its running batch, its wait queue, and as many again that the replica
        # itself turns away with a 429 and Retry-After (cheap: no engine work). Past that, requests wait in
        # Serve's queue in front of the replicas for the replica's answer. That queue is kept well above a
        # replica's own limit: when it is full, Serve answers 503 with a plain-text body, not the
        # 429 with an OpenAI error JSON clients expect (seen when a burst arrived while the replica's 429s
        # were still on their way back), so it is only the last guard against a flood.
        max_ongoing_requests=running + 2 * http.max_queued_requests,
        max_queued_requests=4 * (running + 2 * http.max_queued_requests),
        ray_actor_options={"num_cpus": spec.replica.num_cpus, "num_gpus": spec.replica.num_gpus},
        health_check_period_s=5, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
    )
    return deployment.bind(spec.model_dump(mode="json"), digests)


def app_builder(args: dict):
    """Serve's application builder: a Deployment spec as `args` (a RayService's serveConfigV2, as
    `pylon infra render` writes it, or `serve run pylon.serving.app:app_builder --config-file ...`)."""
    return build_app(DeploymentSpec.model_validate(args))


def deploy(spec: DeploymentSpec, *, address: str | None = None, timeout_s: float = 600) -> str:
    """Run `spec` on the cluster (the local one by default) and return its base URL."""
    import pylon
    from pylon.cluster import read_state

    spec = _checked_model(spec)
    client = pylon.connect(address)
    client.init_ray()
    from ray import serve

    state = read_state()
    port = getattr(state, "serve_port", 0) or 8000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(spec), name=spec.name, route_prefix=spec.http.route_prefix, blocking=False)
    except Exception as e:  # Serve's controller raises it wrapped in a RayTaskError
        used = re.search(r'Prefix (\S+) is being used by application "([^"]+)"', str(e))
        if used:
            raise PylonError(f"http.route_prefix: {used.group(1)} is already served by application "
                             f"'{used.group(2)}'; give '{spec.name}' its own prefix (e.g. /{spec.name}) or "
                             f"delete that one first (pylon serve --delete {used.group(2)})") from None
        raise
    url = f"http://127.0.0.1:{port}{spec.http.route_prefix.rstrip('/')}"
    _wait_ready(url, timeout_s, spec.name)
    return url


def _checked_model(spec: DeploymentSpec) -> DeploymentSpec:
    """Fail before deploying when `model` is not a model directory (a replica would only crash-loop), and
    make a local path absolute: replicas do not run in the caller's directory."""
    from pylon import storage

    uri = spec.model
    if "://" not in uri:
        uri = os.path.abspath(os.path.expanduser(uri))
    try:
        has_config = storage.exists(storage.join(uri, "config.json"))
    except Exception as e:  # storage or credential errors while looking
        raise PylonError(f"model {storage.describe(uri)}: cannot be read ({type(e).__name__}: {e})") from None
    if not has_config:
        raise PylonError(f"model {storage.describe(uri)}: not a Hugging Face model directory (no config.json); "
                         "point it at a `pylon export` output or a saved transformers model")
    return spec.model_copy(update={"model": uri})


def _app_failure(name: str) -> str | None:
    """Serve's message when application `name` failed to deploy (e.g. the replica's constructor raised)."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None or str(app.status) not in ("DEPLOY_FAILED", "ApplicationStatus.DEPLOY_FAILED"):
        return None
    details = [d.message for d in app.deployments.values() if d.message]
    return (details[-1] if details else app.message) or "no message"


def _wait_ready(url: str, timeout_s: float, name: str | None = None) -> None:
    import urllib.error
    import urllib.request

    import sys

    from tqdm import tqdm

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # On a terminal, a line that says what is being waited for and for how long (loading a model takes a while).
    with tqdm(desc=f"loading {name or url} (replica starting, model loading)", bar_format="{desc}: {elapsed}",
              file=sys.stderr, disable=None) as bar:
        while time.monotonic() < deadline:
            failure = _app_failure(name) if name else None
            if failure:
                raise PylonError(f"deployment '{name}' failed to start: {failure.strip()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except OSError as e:
                last = str(e)
            time.sleep(0.5)
            bar.refresh()
    raise PylonError(f"{url}/ready did not answer 200 within {timeout_s:.0f} s (last: {last})")


def delete(name: str, *, address: str | None = None) -> None:
    import pylon

    pylon.connect(address).init_ray()
    from ray import serve

    serve.delete(name)
