"""A `Deployment` spec in, a Ray Serve application out: the OpenAI-compatible API over the engine.

    app = build_app(spec)                      # like ray.serve.llm's build_openai_app(LLMConfig)
    serve.run(app, name=spec.name, route_prefix=spec.http.route_prefix)
    url = deploy(spec)                         # the same, on the local Pylon cluster; returns the base URL

Each replica owns one `AsyncLLMEngine` (the model, its KV cache and its step loop) and answers HTTP itself
(`@serve.ingress` over FastAPI): a separate router deployment would add a hop per streamed token for nothing.

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
from collections.abc import AsyncIterator

from starlette.requests import Request  # FastAPI resolves the routes' annotations when they are declared

from pylon.errors import PylonError
from pylon.serving.errors import EngineDeadError, InvalidRequest
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


def _fastapi_app():
    from fastapi import FastAPI

    return FastAPI(title="Pylon OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)


_api = _fastapi_app()


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


def _error_response(status: int, message: str, *, type: str, param: str | None = None, headers=None,
                    request_id: str | None = None):
    from fastapi.responses import JSONResponse

    from pylon.serving.protocol import error_body

    # No X-Request-Id here: Serve's ingress (the replica's own HTTP server behind HAProxy, or Serve's proxy)
    # echoes (or assigns) it on every response, ours included.
    return JSONResponse(error_body(message, type=type, param=param, code=status), status_code=status, headers=headers)


def _install_error_handlers(api) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @api.exception_handler(HTTPException)
    async def _http(request, exc):  # 404 for unknown paths, 405 for wrong methods: JSON like the rest
        return _error_response(exc.status_code, str(exc.detail), type="invalid_request_error")

    @api.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return _error_response(400, str(exc), type="invalid_request_error")


_install_error_handlers(_api)


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
        from pylon.serving.engine_process import ProcessLLMEngine

        self.spec = DeploymentSpec.model_validate(spec)
        self.model_name = self.spec.name
        self._key_digests = [bytes.fromhex(d) for d in key_digests]
        t0 = time.monotonic()
        kind = ProcessLLMEngine if self.spec.engine.separate_process else AsyncLLMEngine
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

    def _authorize(self, request) -> None:
        if not self._key_digests:
            return
        header = request.headers.get("authorization", "")
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

    async def _handle(self, request, kind: str):
        from fastapi.responses import JSONResponse, StreamingResponse

        from pylon.serving import protocol

        # Serve's ingress puts the client's X-Request-Id (or one it made up) on the request and the response.
        request_id = request.headers.get("x-request-id", "")
        if not _REQUEST_ID.match(request_id):
            request_id = protocol.new_id("req")
        self._ensure_gauges()
        try:
            self._authorize(request)
            cls = protocol.CompletionRequest if kind == "completion" else protocol.ChatCompletionRequest
            body = protocol.parse_request(cls, await request.body())
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
            return _error_response(e.status, e.message, type=e.type, param=e.param, headers=e.headers,
                                   request_id=request_id)
        except InvalidRequest as e:
            self._count(400, "none")
            return _error_response(400, str(e), type="invalid_request_error", param=e.param, request_id=request_id)
        except EngineDeadError as e:
            self._count(503, "none")
            return _error_response(503, f"{self.model_name} is unavailable: {e}", type="server_error",
                                   request_id=request_id, headers={"Retry-After": str(RETRY_AFTER_S)})

        rid = protocol.new_id("cmpl" if kind == "completion" else "chatcmpl")
        headers = {}
        timeout = self.spec.http.request_timeout_s
        if body.stream:
            return StreamingResponse(self._sse(kind, rid, body, first, stream, timeout),
                                     media_type="text/event-stream", headers=headers)
        text, last = [], first
        try:
            async with asyncio.timeout(timeout):
                async for out in _chain(first, stream):
                    text.append(out.text)
                    last = out
        except TimeoutError:
            self._count(504, "timeout")
            return _error_response(504, f"the request took longer than request_timeout_s ({timeout:g} s)",
                                   type="timeout_error", request_id=request_id)
        except EngineDeadError as e:
            self._count(503, "none")
            return _error_response(503, str(e), type="server_error", request_id=request_id)
        self._observe(last)
        make = protocol.completion_response if kind == "completion" else protocol.chat_response
        return JSONResponse(make(rid, self.model_name, "".join(text), last.finish_reason, last.num_prompt_tokens,
                                 last.num_output_tokens), headers=headers)

    async def _first(self, stream):
        return await stream.__anext__()

    async def _sse(self, kind: str, rid: str, body, first, stream, timeout: float) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine output, a usage chunk if asked, then [DONE]. A client
        that disconnects cancels this generator, which closes `stream`, which aborts the engine request.

        Events that are ready together go out as one write: chat's role chunk with the first content, and the
        last content chunk with the usage chunk and [DONE]. Each write is a trip through Serve's and the HTTP
        server's send path (most of a replica's CPU under load), and a stream has only a dozen or so."""
        from pylon.serving import protocol

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        last, held = first, ""
        try:
            if kind == "chat":
                held = event(protocol.chat_chunk(rid, self.model_name, {"role": "assistant", "content": ""}, None))
            async with asyncio.timeout(timeout):
                async for out in _chain(first, stream):
                    last = out
                    if not out.text and not out.finished:
                        continue
                    if kind == "completion":
                        held += event(protocol.completion_chunk(rid, self.model_name, out.text, out.finish_reason))
                    else:
                        delta = {"content": out.text} if out.text else {}
                        held += event(protocol.chat_chunk(rid, self.model_name, delta, out.finish_reason))
                    if not out.finished:  # the last one waits for the usage chunk and [DONE]
                        chunk, held = held, ""
                        yield chunk
            if body.include_usage:
                obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
                held += event(protocol.usage_chunk(rid, self.model_name, obj, last.num_prompt_tokens,
                                                   last.num_output_tokens))
            self._observe(last)
        except TimeoutError:
            self._count(504, "timeout")
            held += event(protocol.error_body(f"the request took longer than request_timeout_s ({timeout:g} s)",
                                              type="timeout_error", code=504))
        except EngineDeadError as e:
            self._count(503, "none")
            held += event(protocol.error_body(str(e), type="server_error", code=503))
        finally:
            await stream.aclose()  # aborts the engine request if it has not finished
        yield held + "data: [DONE]\n\n"

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

    # -- routes -----------------------------------------------------------------------------------------

    @_api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    @_api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, "chat")

    @_api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except _HttpError as e:
            return _error_response(e.status, e.message, type=e.type, headers=e.headers)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "pylon",
                                            "created": 0, "max_model_len": self.engine.max_model_len}]}

    @_api.get("/health")
    async def health(self):
        """Liveness that probes the engine: its step loop must have beaten within the heartbeat window."""
        from fastapi.responses import JSONResponse

        ok = self.engine.check_health()
        return JSONResponse({"status": "ok" if ok else "engine loop not running"}, status_code=200 if ok else 503)

    @_api.get("/ready")
    async def ready(self):
        from fastapi.responses import JSONResponse

        stats = self.engine.stats()
        ok = self.engine.check_health()
        return JSONResponse({"ready": ok, "model": self.model_name, "running": stats.num_running,
                             "waiting": stats.num_waiting, "kv_cache_usage": round(stats.kv_cache_utilization, 4)},
                            status_code=200 if ok else 503)


# Applied at import, not inside build_app: Serve's class-based view sets each route's `self` dependency by
# rewriting the endpoint functions' signatures, and a replica unpickles those functions by reference from this
# module, so the rewrite must happen in every process that imports it (the replica included).
def _ingress_class():
    from ray import serve

    return serve.ingress(_api)(PylonLLMServer)


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
        max_ongoing_requests=spec.engine.max_num_seqs + 2 * http.max_queued_requests,
        max_queued_requests=4 * (spec.engine.max_num_seqs + 2 * http.max_queued_requests),
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
