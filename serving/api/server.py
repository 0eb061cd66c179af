"""PylonLLMServer, the Serve deployment: each replica owns one engine (the model, its KV cache and its step loop, in
a child process by default, or `engine.data_parallel` of them in a pool), turns requests into engine calls, streams
outputs, answers 429 when its queue is full, and exports Prometheus metrics labelled by model."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import time
from collections.abc import Collection

from pylon.errors import StorageError
from pylon.serving.api import (
    anthropic,
    batch_api,
    beam_search,
    harmony,
    openapi,
    protocol,
    reasoning,
    reply_guide,
    responses,
    routing,
    slo,
    tools,
)
from pylon.serving.api.adapters import AdapterFetcher
from pylon.serving.api.batch_lines import call as batch_api_call
from pylon.serving.api.http import (
    JSON_HEADERS,
    REQUEST_ID,
    RETRY_AFTER_S,
    ROUTES,
    SSE_HEADERS,
    ClientGone,
    HttpError,
    OpenAIApp,
    read_body,
    request_headers,
    route_of,
    route_path,
    send_error,
    send_json,
)
from pylon.serving.api.keys import KeyCheck
from pylon.serving.api.ledger import ReplicaLedger
from pylon.serving.api.prefill import RemotePrefill
from pylon.serving.api.replica_engine import accelerator_name, start_engine
from pylon.serving.api.response_store import ResponseStore
from pylon.serving.engine.sampling import POOL_TASK_NAMES, SamplingParams
from pylon.serving.engine.sched_batch import serve_cpu_as_batch
from pylon.serving.engine.tokenization import (
    TokenTexts,
    added_token_ids,
    chars_per_token_bound,
    embedding_ids,
    fim_ids,
    pair_ids,
    prompt_ids,
    special_token_ids,
)
from pylon.serving.errors import EngineDeadError, InvalidRequest, RequestFailed, shown
from pylon.specs import NAME_RE, DeploymentSpec

log = logging.getLogger("pylon.serving")
_ROUTE = re.compile(r"^(prefix:\d{1,6}|load|response)$")
BACKGROUND_POLL_S = 1.0  # how often a background response's task looks for a cancel stored by another replica
_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


# The body each generating endpoint takes (a Responses API request becomes a chat one: pylon.serving.api.responses).
_REQUESTS = {
    "completion": protocol.CompletionRequest,
    "chat": protocol.ChatCompletionRequest,
    "responses": responses.ResponsesRequest,
    "messages": anthropic.MessagesRequest,
}


def _metrics(model: str):
    from ray.serve import metrics

    tags = {"model": model}
    # A finished request's series also carry its LoRA adapter (engine.adapters; "" for the base model): latencies,
    # tokens and request counts per adapter, as a deployment serving many fine-tunes bills and watches them.
    per_request = {"model": model, "adapter": ""}

    def hist(name, desc):
        h = metrics.Histogram(name, description=desc, boundaries=_LATENCY_BOUNDARIES, tag_keys=tuple(per_request))
        h.set_default_tags(dict(per_request))  # Serve adds its own tags to the dict it gets
        return h

    def gauge(name, desc):
        g = metrics.Gauge(name, description=desc, tag_keys=("model",))
        g.set_default_tags(dict(tags))  # Serve adds its own tags to the dict it gets
        return g

    def counter(name, desc, keys=("model",)):
        c = metrics.Counter(name, description=desc, tag_keys=keys)
        c.set_default_tags({k: v for k, v in per_request.items() if k in keys})  # Serve adds its own tags to it
        return c

    return {
        "ttft": hist("pylon_time_to_first_token_seconds", "Time from arrival to the first generated token"),
        "itl": hist("pylon_inter_token_latency_seconds", "Time between consecutive generated tokens"),
        "e2e": hist("pylon_e2e_request_latency_seconds", "Time from arrival to the last token"),
        "queue": hist("pylon_request_queue_time_seconds", "Time from arrival to first being scheduled"),
        "running": gauge("pylon_num_requests_running", "Requests in the engine's running batch"),
        "waiting": gauge("pylon_num_requests_waiting", "Requests waiting for the engine"),
        "kv": gauge("pylon_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
        "prompt_tokens": counter("pylon_prompt_tokens_total", "Prompt tokens processed", ("model", "adapter")),
        "generation_tokens": counter("pylon_generation_tokens_total", "Tokens generated", ("model", "adapter")),
        "prefix_queries": counter("pylon_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
        "prefix_hits": counter("pylon_prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
        "offload_saved": counter(
            "pylon_kv_offload_saved_blocks_total",
            "KV blocks copied to the prefix cache's host tier as the device's cache let go of them",
        ),
        "offload_loaded": counter(
            "pylon_kv_offload_loaded_blocks_total",
            "KV blocks copied back from the prefix cache's host tier for a request's prefix (not computed again)",
        ),
        "offloaded": gauge("pylon_kv_offload_blocks", "KV blocks the prefix cache's host tier holds"),
        "spec_drafts": counter("pylon_spec_decode_draft_tokens_total", "Draft tokens verified (speculative decoding)"),
        "spec_accepted": counter("pylon_spec_decode_accepted_tokens_total", "Draft tokens accepted"),
        "spec_steps": counter(
            "pylon_spec_decode_verify_steps_total",
            "Requests' speculating steps (accepted / steps + 1 = mean acceptance length)",
        ),
        "spec_drafts_by_position": counter(
            "pylon_spec_decode_draft_tokens_per_pos_total",
            "Draft tokens verified, by their position among a request's drafts (0: the first)",
            ("model", "position"),
        ),
        "spec_accepted_by_position": counter(
            "pylon_spec_decode_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by their position among a request's drafts (vLLM's num_accepted_tokens_per_pos)",
            ("model", "position"),
        ),
        "spec_draft_model_steps": counter(
            "pylon_spec_decode_draft_model_steps_total",
            "The draft model's forward passes (engine.speculative.method: draft), or the MTP layer's (mtp) or EAGLE "
            "head's (eagle, eagle3)",
        ),
        "spec_tree_branch": counter(
            "pylon_spec_decode_tree_branch_tokens_total",
            "Accepted draft tokens off their draft tree's first path (engine.speculative.tree_width)",
        ),
        "images": counter("pylon_images_total", "Images in the requests the engine took"),
        "images_encoded": counter(
            "pylon_images_encoded_total",
            "Images run through the vision tower (fewer than pylon_images_total where the prefix cache held them)",
        ),
        "adapter_loads": counter(
            "pylon_lora_adapter_loads_total", "LoRA adapters loaded on demand (engine.dynamic_adapters) into a slot"
        ),
        "pipeline_steps": counter(
            "pylon_pipeline_steps_total", "Steps through the pipeline stages (pipeline_parallel)"
        ),
        "pipeline_stage_seconds": counter(
            "pylon_pipeline_stage_seconds_total", "Seconds the pipeline stages after the first computed steps"
        ),
        "pipeline_hop_seconds": counter(
            "pylon_pipeline_hop_seconds_total",
            "Seconds steps waited on the other pipeline stages beyond their computing (Ray's calls, the hops)",
        ),
        "pipeline_weights_read": counter(
            "pylon_pipeline_weights_read_bytes_total",
            "Bytes of the model's weights the pipeline stages read from object storage at load (each its own tensors)",
        ),
        "adapter_evictions": counter(
            "pylon_lora_adapter_evictions_total", "LoRA adapters unloaded to make room for another"
        ),
        "prefill_computed": counter(
            "pylon_prefill_tokens_computed_total", "Prompt tokens the engine computed (not found in a cache)"
        ),
        "kv_received_blocks": counter(
            "pylon_kv_transfer_received_blocks_total",
            "KV blocks taken in from prefill replicas (prefill; the blocks this engine lacked)",
        ),
        "kv_received_bytes": counter(
            "pylon_kv_transfer_received_bytes_total", "Bytes of KV blocks received from prefill replicas"
        ),
        "kv_refused": counter(
            "pylon_kv_transfer_refused_total",
            "Prefill replicas' blocks refused (another KV layout): their prompts computed here",
        ),
        "requests": counter(
            "pylon_requests_total",
            "Finished requests by HTTP status and finish reason",
            keys=("model", "adapter", "status", "finish_reason"),
        ),
    }


def _own_replica_tag() -> str:
    try:
        from ray import serve

        return routing.replica_tag(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not a Serve replica (a test's server, a notebook's)
        return ""


def _check_dimensions(dimensions: int | None, lasts: list) -> None:
    """`dimensions` (an embedding request's) at most the model's hidden size, the width of its vectors."""
    width = len(lasts[0].embedding)
    if dimensions is not None and dimensions > width:
        raise InvalidRequest(
            f"dimensions must be at most the model's hidden size, {width} (got {dimensions})", param="dimensions"
        )


class PylonLLMServer:
    """One replica: the engine for `spec.model` and the HTTP API in front of it."""

    def __init__(self, spec: dict, api_keys: dict | None = None, prefill=None):
        """`prefill`: the handle of the deployment's prefill replicas (`prefill`; pylon.serving.api.prefill)."""
        self.spec = DeploymentSpec.model_validate(spec)
        self.model_name = self.spec.name
        # Auth: the salted key hashes (`pylon.serving.api.keys`), replaced in place by `reconfigure`. Without them a
        # spec that names an API-key variable refuses every key (fails closed).
        self._keys = KeyCheck(api_keys, required=bool(self.spec.http.api_keys_env))
        # The Responses API's stored responses (pylon.serving.api.response_store), where the spec keeps them.
        store = self.spec.http.responses_store
        self._response_store = ResponseStore(store) if store is not None else None
        # OpenAI's Files and Batch APIs (pylon.serving.api.batch_api), where the spec keeps them; the batches this
        # replica answers, by id: the task and the event that cancels it.
        store = self.spec.http.batch_store
        self._batch_store = batch_api.BatchStore(store) if store is not None else None
        self._batch_runs: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}
        # The tag this replica puts in its responses' ids, so that the router sends their continuations here
        # (routing.response_id; "" outside Serve).
        self._replica_tag = _own_replica_tag()
        # Background responses this replica runs, by id: the task, its owner and its queued record.
        self._background: dict[str, tuple[asyncio.Task, str, dict]] = {}
        # held while a background response's end or its cancel is read and stored: one of them wins, whole
        self._background_ends: asyncio.Lock | None = None
        self._processing: asyncio.Lock | None = None  # one prompt with images through the processor at a time
        self._revision = ""  # of the user_config in force: /ready reports it, so a deploy knows when it holds
        t0 = time.monotonic()
        self.engine = start_engine(self.spec)
        log.info("loaded %s from %s in %.1f s", self.model_name, self.spec.model, time.monotonic() - t0)
        # Prefill-decode disaggregation: long prompts computed on the prefill replicas, their blocks sent here.
        self._prefill = None
        if prefill is not None:
            try:
                self._prefill = RemotePrefill(prefill, self.spec, self.engine)
            except BaseException:
                self.engine.shutdown()
                raise
        # The model's sampling defaults (its generation_config.json's; none under engine.generation_config: none),
        # read by the engine where it loaded the model: the fields a request leaves out take them.
        generation = self.engine.generation
        self.sampling_defaults = dict(generation.sampling)
        if self.sampling_defaults:
            log.info(
                "%s: the model's generation_config.json sets the sampling defaults %s, which requests that leave "
                "them out take (engine.generation_config: none gives OpenAI's defaults instead)",
                self.model_name,
                generation.describe_sampling(),
            )
        if len(generation.eos_token_ids) > 1:
            log.info(
                "%s: a generation ends at any of the model's end-of-sequence ids %s",
                self.model_name,
                list(generation.eos_token_ids),
            )
        # A model that speaks OpenAI's harmony format (gpt-oss: its tokenizer has harmony's special tokens): its chat
        # replies read by channel, reasoning, answer and tool calls (pylon.serving.api.harmony), in place of
        # http.reasoning_parser and the text formats of tool calls.
        self._harmony = harmony.HarmonyTokens.of(self.engine.tokenizer)
        if self._harmony is not None:
            log.info("%s: speaks OpenAI's harmony format: chat replies are read by channel", self.model_name)
            if self.spec.http.reasoning_parser is not None:
                log.warning(
                    "%s: http.reasoning_parser %s is not used: the model's harmony channels say what is reasoning",
                    self.model_name,
                    self.spec.http.reasoning_parser,
                )
        # On a CPU the engines are throughput work and this process's wakeups (chunks, Ray's own threads) should
        # not preempt them mid-step (pylon.serving.engine.sched_batch).
        serve_cpu_as_batch(self.engine.device, f"replica of {self.model_name}")
        self.metrics = _metrics(self.model_name)
        self._gauges_task = None
        self.ledger = ReplicaLedger(self.spec.model_dump(mode="json"), accelerator=accelerator_name(self.engine.device))
        self.latency = slo.LatencyWindow()  # the last requests' times, for autoscaling on latency targets
        # LoRA adapters loaded on demand: this replica's copies of those requests named (engine.dynamic_adapters).
        dynamic = self.spec.engine.dynamic_adapters
        self.fetcher = (
            AdapterFetcher(dynamic.root, keep=max(32, 4 * dynamic.max_loaded)) if dynamic.root is not None else None
        )

    # -- Serve hooks ------------------------------------------------------------------------------------

    def reconfigure(self, user_config: dict) -> None:
        """Serve's in-place update of a running replica: its `user_config`, `{"api_keys": <salted hashes> | None,
        "revision": <this deploy's id>}`.
        A key added or removed takes effect on the next request; the engine and its KV cache are untouched."""
        self._keys = KeyCheck(user_config.get("api_keys"), required=bool(self.spec.http.api_keys_env))
        self._revision = str(user_config.get("revision", ""))
        log.info("%s: %d API key(s) in force", self.model_name, self._keys.count)

    def record_routing_stats(self) -> dict:
        """Serve's routing stats of this replica, which its controller asks for every `ROUTING_STATS_PERIOD_S` and
        hands every handle's request router: the hashes of the blocks its engines hold cached, and its engines'
        sequence slots (pylon.serving.api.routing reads them)."""
        if not self.spec.engine.enable_prefix_caching:
            return {}
        return routing.replica_stats(self.engine, self.spec)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica, which it pushes to its controller for the deployment's
        autoscaling policy: its requests' time to first token and between tokens (90th percentiles over the last
        30 s; pylon.serving.api.slo.LatencyPolicy reads them where `autoscaling` sets latency targets)."""
        return self.latency.stats()

    def check_health(self) -> None:
        """Serve's replica health check: a dead or stuck step loop gets the replica replaced."""
        if not self.engine.check_health():
            raise RuntimeError(f"{self.model_name}: the engine's step loop is not running")
        if self._gauges_task is None and self.ledger.due():  # before any request: alive all the same
            self.ledger.write()

    def __del__(self):
        self.close()

    def close(self) -> None:
        """Stop the replica: its background responses ended, its ledger's last record, its engine shut down (once;
        Serve's replica calls it by dropping the object, a batch job's engine when its pool ends)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._stop_background()
        fetcher = getattr(self, "fetcher", None)
        if fetcher is not None:
            fetcher.close()
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.write(ended=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2)

    def _stop_background(self) -> None:
        """As the replica stops (a redeploy, a scale-down): its background responses still running end failed in the
        store, so that their clients' next GET says so rather than waiting out http.background_timeout_s."""
        for rid, (task, owner, record) in list(getattr(self, "_background", {}).items()):
            try:  # (__del__ runs in whichever thread dropped the replica)
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has closed: nothing runs it any more
                pass
            ended = responses.ended(record["response"], "failed", "the replica running it stopped; create it again")
            try:
                self._response_store.put_now(owner, rid, {**record, "response": ended})
            except Exception as e:  # the store cannot take it: GET reads it failed later all the same
                log.error("%s: background response %s: its end not stored: %s", self.model_name, rid, e)

    # -- plumbing ---------------------------------------------------------------------------------------

    def _ensure_gauges(self) -> None:
        if self._gauges_task is None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._report_gauges())

    async def _report_gauges(self) -> None:
        # the engines' totals counted so far
        reported = dict.fromkeys(
            (
                "prefix_queries",
                "prefix_hits",
                "offload_saved",
                "offload_loaded",
                "spec_drafts",
                "spec_accepted",
                "spec_steps",
                "spec_draft_model_steps",
                "spec_tree_branch",
                "adapter_loads",
                "adapter_evictions",
                "images",
                "images_encoded",
                "pipeline_steps",
                "pipeline_stage_seconds",
                "pipeline_hop_seconds",
                "pipeline_weights_read",
                "prefill_computed",
                "kv_received_blocks",
                "kv_received_bytes",
                "kv_refused",
            ),
            0,
        )
        while True:
            stats = self.engine.stats()
            if self.ledger.due():  # storage I/O (object storage, maybe) off the event loop
                await asyncio.to_thread(self.ledger.write)
            self.metrics["running"].set(stats.num_running)
            self.metrics["waiting"].set(stats.num_waiting)
            self.metrics["kv"].set(stats.kv_cache_utilization)
            self.metrics["offloaded"].set(stats.num_offloaded_blocks)
            for name, total in (
                ("prefix_queries", stats.prefix_cache_queries_total),
                ("prefix_hits", stats.prefix_cache_hits_total),
                ("offload_saved", stats.kv_offload_saved_blocks_total),
                ("offload_loaded", stats.kv_offload_loaded_blocks_total),
                ("spec_drafts", stats.spec_draft_tokens_total),
                ("spec_accepted", stats.spec_accepted_tokens_total),
                ("spec_steps", stats.spec_verify_steps_total),
                ("spec_draft_model_steps", stats.spec_draft_model_steps_total),
                ("spec_tree_branch", stats.spec_tree_branch_tokens_total),
                ("adapter_loads", stats.adapter_loads_total),
                ("adapter_evictions", stats.adapter_evictions_total),
                ("images", stats.images_total),
                ("images_encoded", stats.images_encoded_total),
                ("pipeline_steps", stats.pipeline_steps_total),
                ("pipeline_stage_seconds", stats.pipeline_stage_seconds_total),
                ("pipeline_hop_seconds", stats.pipeline_hop_seconds_total),
                ("pipeline_weights_read", stats.pipeline_weights_read_bytes),
                ("prefill_computed", stats.prefill_tokens_computed_total),
                ("kv_received_blocks", stats.kv_transfer_received_blocks_total),
                ("kv_received_bytes", stats.kv_transfer_received_bytes_total),
                ("kv_refused", stats.kv_transfer_refused_total),
            ):
                if total > reported[name]:
                    self.metrics[name].inc(total - reported[name])
                    reported[name] = total
            for name, totals in (
                ("spec_drafts_by_position", stats.spec_draft_tokens_by_position),
                ("spec_accepted_by_position", stats.spec_accepted_tokens_by_position),
            ):
                for position, total in enumerate(totals):
                    key = (name, position)
                    if total > reported.get(key, 0):
                        self.metrics[name].inc(total - reported.get(key, 0), tags={"position": str(position)})
                        reported[key] = total
            await asyncio.sleep(1.0)

    async def _authorize(self, headers: dict[str, str]) -> None:
        keys = self._keys
        if not keys.required:
            return
        token = _key_of(headers)
        if not token:
            raise HttpError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' (or Anthropic's 'x-api-key: <key>')",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not await keys.verify(token):
            raise HttpError(401, "invalid API key", type="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    def _admit(self) -> None:
        waiting = self.engine.stats().num_waiting
        if waiting >= self.spec.http.max_queued_requests:
            raise HttpError(
                429,
                f"server busy: {waiting} requests already waiting for {self.model_name}; retry after {RETRY_AFTER_S} s",
                type="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    @functools.cached_property
    def _served(self) -> list[str]:
        """The model ids requests may name: the deployment's own (the base model), then its LoRA adapters'."""
        return [self.model_name, *(a.name for a in self.spec.engine.adapters)]

    def _served_list(self) -> str:
        return ", ".join(f"'{m}'" for m in self._served)

    async def _check_model(self, name: str) -> None:
        """`name` is served: the base model, one of its adapters, or an adapter at the root of those loaded on demand
        (fetched here if need be: `adapter_path`)."""
        if name in self._served:
            return
        if self._on_demand(name):
            await self.fetcher.fetch(name)
            return
        raise HttpError(
            404,
            f"model {shown(name)} does not exist; this server has {self._served_list()}"
            + (
                " and LoRA adapters by name (lowercase letters, digits and '-') from engine.dynamic_adapters.root"
                if self.fetcher is not None
                else ""
            )
            + " (see GET /v1/models)",
            type="invalid_request_error",
            param="model",
        )

    def _on_demand(self, name: str) -> bool:
        """Whether `name` may be an adapter at engine.dynamic_adapters.root (one is set, and the name is a spec
        name: nothing that could leave the root)."""
        return self.fetcher is not None and NAME_RE.fullmatch(name) is not None

    def _adapter_params(self, params: SamplingParams, model: str) -> SamplingParams:
        """`params` for a request whose `model` is `model`: a LoRA adapter's name, and where an adapter loaded on
        demand was fetched to, unless `model` is the base model's."""
        if model != self.model_name:
            params.adapter = model
            params.adapter_path = self.fetcher.path(model) if self.fetcher is not None else None
        return params

    async def _dispatch(self, scope, receive, send) -> None:
        path, method = route_path(scope), scope["method"]
        route = ROUTES.get(route_of(path)[0])
        if route is None:
            return await send_error(
                send,
                404,
                f"no route {path}; this server answers POST /v1/completions, POST /v1/chat/completions, "
                "POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, "
                "POST /v1/messages (Anthropic's), POST /v1/messages/count_tokens, "
                "POST and GET /v1/files, GET and DELETE /v1/files/{id}, GET /v1/files/{id}/content, "
                "POST and GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel, "
                "POST /v1/embeddings, POST /v1/rerank, POST /v1/score, POST /classify, POST /pooling, "
                "GET /v1/models, GET /v1/models/{model}, POST /tokenize, POST /detokenize, "
                "GET /health, GET /ready and GET /openapi.json",
                type="invalid_request_error",
            )
        handler = route.get(method)
        if handler is None:
            allowed = ", ".join(route)
            return await send_error(
                send,
                405,
                f"{method} {path} is not allowed; use {' or '.join(route)}",
                type="invalid_request_error",
                headers={"Allow": allowed},
            )
        try:
            await getattr(self, handler)(scope, receive, send)
        except ClientGone:
            return
        except Exception:  # a bug of ours: a 500 with an error body, not a dropped connection (if nothing was sent yet)
            log.exception("%s %s failed", method, path)
            try:
                await send_error(
                    send,
                    500,
                    f"internal error while serving {method} {path} (see the replica's log)",
                    type="server_error",
                )
            except Exception:  # the response had already started
                pass

    async def _request(self, headers: dict[str, str], receive, cls):
        """The request's body as `cls`, once its key is checked and its model is this one's (HttpError,
        InvalidRequest otherwise)."""
        await self._authorize(headers)
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # read as JSON, a compressed body would be a baffling 400
            raise HttpError(
                415,
                f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed",
                type="invalid_request_error",
                param="body",
            )
        body = protocol.parse_request(cls, await read_body(receive))
        await self._check_model(body.model)
        return body

    async def _tokenize(self, scope, receive, send) -> None:
        """vLLM's /tokenize: the ids the engine computes for a prompt (or a chat, rendered as the chat endpoint
        renders it), so a client can count a prompt's tokens against the context before sending it."""

        async def answer(body) -> dict:
            prompt = body.text(self.engine.tokenizer, self.engine.max_images)
            ids = await self._prompt_token_ids(prompt, body.special)
            return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

        await self._answer(scope, receive, send, protocol.TokenizeRequest, answer)

    async def _prompt_token_ids(self, prompt, special: bool) -> list[int]:
        """A rendered prompt's token ids as the engine computes them: a text's, or a chat's with images (an
        ImagePrompt) through the model's own processor, each image's placeholders counted. The processor runs in a
        thread (decoding and resizing images takes milliseconds each), one request at a time."""
        if isinstance(prompt, str):
            return prompt_ids(self.engine.tokenizer, prompt, special)
        processor = self.engine.image_processor
        if self._processing is None:
            self._processing = asyncio.Lock()
        async with self._processing:
            ids, _ = await asyncio.to_thread(processor.prepare, prompt, special)
        return ids

    async def _detokenize(self, scope, receive, send) -> None:
        """vLLM's /detokenize: the text of token ids."""

        def answer(body) -> dict:
            tokenizer = self.engine.tokenizer
            bad = next((i for i, t in enumerate(body.tokens) if t >= tokenizer.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {body.tokens[bad]} is not in the vocabulary (ids 0 to {tokenizer.vocab_size - 1})",
                    param=f"tokens.{bad}",
                )
            return {"prompt": tokenizer.decode(body.tokens)}

        await self._answer(scope, receive, send, protocol.DetokenizeRequest, answer)

    async def _answer(self, scope, receive, send, cls, answer) -> None:
        """A request that is answered at once (no engine request): its body as `cls`, then `answer(body)` as JSON;
        a refused key, body or value is its 4xx."""
        try:
            result = answer(await self._request(request_headers(scope), receive, cls))
            if asyncio.iscoroutine(result):
                result = await result
        except HttpError as e:
            return await send_error(send, e.status, e.message, type=e.type, param=e.param, headers=e.headers)
        except InvalidRequest as e:
            return await send_error(send, 400, str(e), type="invalid_request_error", param=e.param)
        await send_json(send, 200, result)

    async def _completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, "completion")

    async def _chat_completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, "chat")

    async def _responses(self, scope, receive, send) -> None:
        """OpenAI's Responses API on the chat path (pylon.serving.api.responses)."""
        await self._generate(scope, receive, send, "responses")

    async def _messages(self, scope, receive, send) -> None:
        """Anthropic's Messages API on the chat path (pylon.serving.api.anthropic), its errors in Anthropic's shape."""
        await self._generate(scope, receive, anthropic.anthropic_errors(send), "messages")

    async def _count_tokens(self, scope, receive, send) -> None:
        """Anthropic's token count of a Messages request: its chat rendered as /v1/messages renders it."""

        async def answer(body) -> dict:
            chat = body.chat()
            try:
                prompt = chat.render(self.engine.tokenizer, self.engine.max_images)
                return {"input_tokens": len(await self._prompt_token_ids(prompt, chat.add_special_tokens))}
            except InvalidRequest as e:
                raise body.refusal(e) from None

        await self._answer(scope, receive, anthropic.anthropic_errors(send), anthropic.CountTokensRequest, answer)

    async def _embeddings(self, scope, receive, send) -> None:
        """OpenAI's embeddings API: one engine request per input (`SamplingParams(embed=True)`), run in the engine's
        steps beside the generating requests; each input's last token's final hidden state, L2-normalised
        (`protocol.embedding_data`). A bad input is a 400 naming it (`input.3`), and the other inputs are aborted."""
        headers = request_headers(scope)
        self._ensure_gauges()
        adapter = ""
        try:
            body = await self._request(headers, receive, protocol.EmbeddingRequest)
            adapter = self._adapter_of(body)
            self._not_a_classifier()
            lasts = await self._embedded(headers, body.model, body.inputs())
            _check_dimensions(body.dimensions, lasts)
        except (HttpError, InvalidRequest, TimeoutError, EngineDeadError, RequestFailed) as e:
            return await self._refuse(send, e, adapter)
        for k, last in enumerate(lasts):
            self._observe(last, count=k == 0, adapter=adapter)
        tokens = sum(last.num_prompt_tokens for last in lasts)
        await send_json(
            send,
            200,
            {
                "object": "list",
                "data": [
                    protocol.embedding_data(i, last.embedding, body.dimensions, body.encoding_format)
                    for i, last in enumerate(lasts)
                ],
                "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    async def _embedded(
        self,
        headers: dict,
        model: str,
        inputs: list,
        field: str = "input",
        truncate: int | None = None,
        pool_task: str = "",
    ) -> list:
        """The engine's pooled outputs (last-token hidden states; a classifier's logits) of `inputs` (texts or token
        ids), one engine request each, run in the engine's steps beside the generating requests; a bad one is an
        InvalidRequest naming `field.i`, and the others are aborted. `truncate`: each keeps its last that many tokens
        (-1: the context's worth). `pool_task`: an encoder's token outputs instead (SamplingParams.pool_task), each
        output with the token ids they are of."""
        request_id = headers.get("x-request-id", "")
        if not REQUEST_ID.match(request_id):
            request_id = protocol.new_id("req")
        params = SamplingParams(
            max_tokens=0,
            embed=True,
            truncate_prompt_tokens=truncate,
            pool_task=pool_task,
            return_prompt_token_ids=bool(pool_task),
        )
        params = self._adapter_params(params, model)
        tokenizer = self.engine.tokenizer
        inputs = [embedding_ids(tokenizer, i) if isinstance(i, str) else i for i in inputs]
        self._admit()
        engine_id = f"{request_id}-{protocol.new_id('e')}"
        streams = [
            self.engine.generate(f"{engine_id}-{i}", item, params, interval_s=0.0) for i, item in enumerate(inputs)
        ]
        try:
            async with asyncio.timeout(self.spec.http.request_timeout_s):
                return await _all(
                    [_naming_prompt(_last(stream), i, len(inputs), field) for i, stream in enumerate(streams)]
                )
        finally:
            for stream in streams:
                await stream.aclose()  # aborts the inputs not finished (a refused one, a timeout, a cancel)

    def _not_a_classifier(self) -> None:
        """An embedding model's outputs asked of a classifier: refused, saying where its outputs are."""
        classifier = self.engine.generation.classifier
        if classifier is not None:
            raise InvalidRequest(
                f"this model is a classifier ({classifier.describe()}): it has no embeddings; send its inputs to "
                "/classify or /pooling (texts), /v1/score or /rerank (pairs)",
                param="model",
            )

    async def _classify(self, scope, receive, send) -> None:
        """vLLM's classification API: each input's (or the chat's) label and label probabilities, from a classifier
        (a *ForSequenceClassification checkpoint, or engine.classifier_from_token)."""
        await self._pool(scope, receive, send, classify=True)

    async def _classify_v1(self, scope, receive, send) -> None:
        """The classification API at SGLang's path."""
        await self._pool(scope, receive, send, classify=True)

    async def _pooling(self, scope, receive, send) -> None:
        """vLLM's pooling API: a classifier's outputs (probabilities, or logits with use_activation false), or an
        embedding model's vectors."""
        await self._pool(scope, receive, send, classify=False)

    async def _pool(self, scope, receive, send, *, classify: bool) -> None:
        headers = request_headers(scope)
        self._ensure_gauges()
        adapter = ""
        classifier = self.engine.generation.classifier
        try:
            body = await self._request(headers, receive, protocol.PoolingRequest)
            adapter = self._adapter_of(body)
            task = body.task
            if classifier is not None and task in ("embed", "token_embed", "token_classify", "lexical_weights"):
                raise InvalidRequest(
                    f"task {task}: this model is a classifier ({classifier.describe()}); its task is classify",
                    param="task",
                )
            if classifier is None and task == "classify":
                raise InvalidRequest(
                    "task classify: this model is not a classifier (it embeds); its tasks are embed"
                    + "".join(f", {POOL_TASK_NAMES[t]}" for t in self.engine.generation.pool_tasks),
                    param="task",
                )
            if classify and classifier is None:
                raise InvalidRequest(
                    "this model is not a classifier (a *ForSequenceClassification checkpoint, or a deployment with "
                    "engine.classifier_from_token): it has no labels; its vectors are at /v1/embeddings or /pooling",
                    param="model",
                )
            if classifier is not None:
                for name, value in (("dimensions", body.dimensions), ("encoding_format", body.encoding_format)):
                    if value not in (None, "float"):
                        raise InvalidRequest(
                            f"{name} is an embedding's; a classifier's outputs are its {classifier.num_labels} "
                            "label(s)' values, as floats",
                            param=name,
                        )
            ids = body.inputs(self.engine.tokenizer)
            lasts = await self._embedded(
                headers, body.model, ids, truncate=body.truncate_prompt_tokens, pool_task=body.pool_task
            )
            if classifier is None and not body.pool_task:
                _check_dimensions(body.dimensions, lasts)
        except (HttpError, InvalidRequest, TimeoutError, EngineDeadError, RequestFailed) as e:
            return await self._refuse(send, e, adapter)
        for k, last in enumerate(lasts):
            self._observe(last, count=k == 0, adapter=adapter)
        tokens = sum(last.num_prompt_tokens for last in lasts)
        data = []
        for i, last in enumerate(lasts):
            if body.pool_task:  # an encoder's token outputs (bge-m3's token heads)
                data.append({"index": i, "object": "pooling", "data": self._token_outputs(body.task, last)})
                continue
            if classifier is None:  # an embedding model's vector, as /v1/embeddings gives it
                vector = protocol.embedding_data(i, last.embedding, body.dimensions, body.encoding_format)["embedding"]
                data.append({"index": i, "object": "pooling", "data": vector})
                continue
            values = classifier.apply(last.embedding, body.activated)
            if classify:
                label = classifier.label(last.embedding)
                data.append({"index": i, "label": label, "probs": values, "num_classes": classifier.num_labels})
            else:
                data.append({"index": i, "object": "pooling", "data": values})
        answer = {
            "id": protocol.new_id("classify" if classify else "pool"),
            "object": "list",
            "created": int(time.time()),
            "model": body.model,
            "data": data,
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        await send_json(send, 200, answer)

    def _token_outputs(self, task: str, last) -> list | dict:
        """A token task's outputs as /pooling answers them: token_embed, each token's vector (the CLS's left out by
        the engine); token_classify, each token's [weight], a special first and last token left out (vLLM's); and
        lexical_weights, {token id: its largest weight} over the tokens that are not special, weights above 0 only
        (FlagEmbedding's)."""
        if task == "token_embed":
            return last.embedding
        special = special_token_ids(self.engine.tokenizer)
        ids, weights = last.prompt_token_ids, last.embedding
        if task == "token_classify":
            first = 1 if ids and ids[0] in special else 0
            end = len(ids) - 1 if len(ids) > first and ids[-1] in special else len(ids)
            return [[w] for w in weights[first:end]]
        lexical: dict[str, float] = {}
        for token, w in zip(ids, weights):
            if token not in special and w > lexical.get(str(token), 0.0):
                lexical[str(token)] = w
        return lexical

    async def _rerank(self, scope, receive, send) -> None:
        """vLLM's rerank API: each document's relevance to the query, the best first (`top_n` of them): a
        cross-encoder's score of the (query, document) pair where the model is a classifier of one label, else the
        cosine of their vectors (a bi-encoder's)."""
        await self._similarity(scope, receive, send, protocol.RerankRequest)

    async def _rerank_v2(self, scope, receive, send) -> None:
        """The rerank API at Cohere's v2 path."""
        await self._similarity(scope, receive, send, protocol.RerankRequest)

    async def _rerank_bare(self, scope, receive, send) -> None:
        """The rerank API at vLLM's path without /v1."""
        await self._similarity(scope, receive, send, protocol.RerankRequest)

    async def _score_bare(self, scope, receive, send) -> None:
        """The score API at vLLM's path without /v1."""
        await self._similarity(scope, receive, send, protocol.ScoreRequest)

    async def _score(self, scope, receive, send) -> None:
        """vLLM's score API: each pair's score, text_1's against text_2's: a cross-encoder's, or a cosine."""
        await self._similarity(scope, receive, send, protocol.ScoreRequest)

    async def _similarity(self, scope, receive, send, cls) -> None:
        headers = request_headers(scope)
        self._ensure_gauges()
        adapter = ""
        try:
            body = await self._request(headers, receive, cls)
            adapter = self._adapter_of(body)
            if cls is protocol.RerankRequest:
                firsts, seconds = [body.query], list(body.documents)
                pairs = [(0, k) for k in range(len(seconds))]
                first_names, second_names = ["query"], [f"documents.{k}" for k in range(len(seconds))]
            else:
                firsts, seconds = body.sides()
                pairs = body.pairs()
                first_names = [
                    ("text_1" if isinstance(body.text_1, str) else f"text_1.{k}") for k in range(len(firsts))
                ]
                second_names = [
                    ("text_2" if isinstance(body.text_2, str) else f"text_2.{k}") for k in range(len(seconds))
                ]
            scores, lasts = await self._pair_scores(headers, body, firsts, seconds, pairs, first_names, second_names)
        except (HttpError, InvalidRequest, TimeoutError, EngineDeadError, RequestFailed) as e:
            return await self._refuse(send, e, adapter)
        for k, last in enumerate(lasts):
            self._observe(last, count=k == 0, adapter=adapter)
        tokens = sum(last.num_prompt_tokens for last in lasts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        if cls is protocol.RerankRequest:
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
            results = [
                {
                    "index": i,
                    "document": {"text": body.documents[i]} if body.return_documents else None,
                    "relevance_score": scores[i],
                }
                for i in order
            ]
            answer = {"id": protocol.new_id("rerank"), "model": body.model, "usage": usage, "results": results}
        else:
            answer = {
                "id": protocol.new_id("score"),
                "object": "list",
                "created": int(time.time()),
                "model": body.model,
                "data": [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)],
                "usage": usage,
            }
        await send_json(send, 200, answer)

    async def _pair_scores(self, headers, body, firsts, seconds, pairs, first_names, second_names):
        """Each pair's (index in firsts, index in seconds) score, and the engine outputs it came from: a
        cross-encoder's (a classifier of one label: the pair as one sequence, `pair_ids`, its logit through the
        classifier's score activation), else the cosine of the two texts' vectors. An input the engine refuses is an
        InvalidRequest naming the field it came from."""
        import torch

        classifier = self.engine.generation.classifier
        if classifier is not None:
            if classifier.num_labels != 1:
                raise InvalidRequest(
                    f"this model is a classifier of {classifier.num_labels} labels ({classifier.describe()}): it "
                    "scores no pairs (a cross-encoder has one label); send texts to /classify",
                    param="model",
                )
            tokenizer = self.engine.tokenizer
            texts = [pair_ids(tokenizer, firsts[a], seconds[b]) for a, b in pairs]
            names = [second_names[b] for _, b in pairs]  # (a pair past the context: named by its second text)
        else:
            texts, names = [*firsts, *seconds], [*first_names, *second_names]
        try:
            lasts = await self._embedded(headers, body.model, texts, "text")
        except InvalidRequest as e:  # "text.<i>": named as the field the text came from
            if e.param is None or not e.param.startswith("text."):
                raise
            i = int(e.param.split(".")[1])
            message = str(e).removeprefix(f"text {i}: ")
            raise InvalidRequest(f"{names[i]}: {message}", param=names[i]) from None
        if classifier is not None:
            activated = body.use_activation is not False
            return [classifier.apply(last.embedding, activated, score=True)[0] for last in lasts], lasts
        vectors = torch.nn.functional.normalize(torch.tensor([last.embedding for last in lasts]), dim=-1)
        return [float(vectors[a] @ vectors[len(firsts) + b]) for a, b in pairs], lasts

    async def _models(self, scope, receive, send) -> None:
        try:
            await self._authorize(request_headers(scope))
        except HttpError as e:
            return await send_error(send, e.status, e.message, type=e.type, headers=e.headers)
        # Adapters loaded on demand: those this replica holds a copy of (the root may have more).
        fetched = [m for m in self.fetcher.names() if m not in self._served] if self.fetcher is not None else []
        await send_json(send, 200, {"object": "list", "data": [self._model_card(m) for m in [*self._served, *fetched]]})

    async def _owner(self, headers: dict[str, str]) -> str:
        """Whose stored responses a request (already authorized) may read: its key's `KeyCheck.owner`."""
        token = _key_of(headers) if self._keys.required else ""
        return await self._keys.owner(token or None, self.model_name)

    async def _stored(self, owner: str, response_id: str) -> dict | None:
        """`owner`'s stored response record (response_store), None where there is none; a store that cannot be read is
        a 503."""
        try:
            return await self._response_store.get(owner, response_id)
        except StorageError as e:
            log.error("%s: the response store cannot be read: %s", self.model_name, e)
            raise HttpError(
                503,
                "the response store cannot be read right now (see the replica's log); retry later",
                type="server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None

    async def _continue(self, headers: dict[str, str], request: responses.ResponsesRequest) -> None:
        """Where the deployment keeps responses: keep `request`'s (unless it says store: false), and put the stored
        conversation its previous_response_id names before its input."""
        previous = request.previous_response_id
        if self._response_store is None:
            if request.background:
                raise InvalidRequest(
                    "background: true keeps the response to be polled, and this deployment keeps no responses (its "
                    "spec's http.responses_store is null): set one, or leave background out",
                    param="background",
                )
            if previous is not None:
                raise InvalidRequest(
                    "previous_response_id: this deployment keeps no responses (its spec's http.responses_store is "
                    "null): set one to continue responses by id, or send the whole conversation in input",
                    param="previous_response_id",
                )
            return
        if request.store is False and previous is None:
            return  # nothing to keep or read: no owner to work out (a scrypt, the first time per key)
        owner = await self._owner(headers)
        if request.store is not False:
            request.keep(owner)
        if previous is not None:
            record = await self._stored(owner, previous)
            if record is None:
                raise InvalidRequest(
                    f"previous_response_id: no stored response {shown(previous)} (a response is found with the API "
                    "key that made it, unless it was made with store: false or deleted)",
                    param="previous_response_id",
                )
            request.continue_from(record["conversation"])

    async def _keep_response(self, request: responses.ResponsesRequest, response: dict) -> bool:
        """Store `response` (`request`'s) with its input and the conversation so far; False (and its `store` false)
        where the store cannot take it: the reply still goes out."""
        record = {"response": response, "input": request.input_items(), "conversation": request.conversation(response)}
        try:
            await self._response_store.put(request.owner, response["id"], record)
            return True
        except StorageError as e:
            log.error("%s: response %s not stored: %s", self.model_name, response["id"], e)
            response["store"] = False
            return False

    async def _stored_answer(self, scope, send, answer) -> None:
        """GET/DELETE on a stored response: `await answer(owner, response_id)`'s JSON, or its 4xx."""
        headers = request_headers(scope)
        response_id = route_of(route_path(scope))[1]
        try:
            await self._authorize(headers)
            if self._response_store is None:
                raise HttpError(
                    404,
                    f"no stored response {shown(response_id)}: this deployment keeps no responses (its spec's "
                    "http.responses_store is null)",
                    type="invalid_request_error",
                    param="response_id",
                )
            result = await answer(await self._owner(headers), response_id, scope)
        except HttpError as e:
            return await send_error(send, e.status, e.message, type=e.type, param=e.param, headers=e.headers)
        except InvalidRequest as e:
            return await send_error(send, 400, str(e), type="invalid_request_error", param=e.param)
        await send_json(send, 200, result)

    @staticmethod
    def _not_stored(response_id: str) -> HttpError:
        return HttpError(
            404,
            f"no stored response {shown(response_id)} (a response is found with the API key that made it)",
            type="invalid_request_error",
            param="response_id",
        )

    async def _get_response(self, scope, receive, send) -> None:
        """OpenAI's "retrieve a response": the stored Response object. A background response still queued past
        http.background_timeout_s (and a minute) after it started is answered failed: the replica running it
        stopped."""

        async def answer(owner: str, response_id: str, scope) -> dict:
            record = await self._stored(owner, response_id)
            if record is None:
                raise self._not_stored(response_id)
            response = record["response"]
            limit = self.spec.http.background_timeout_s + 60
            if response["status"] in ("queued", "in_progress") and time.time() - record.get("started", 0) > limit:
                return responses.ended(response, "failed", "the replica running it stopped before it finished")
            return response

        await self._stored_answer(scope, send, answer)

    async def _delete_response(self, scope, receive, send) -> None:
        """OpenAI's "delete a response"."""

        async def answer(owner: str, response_id: str, scope) -> dict:
            try:
                deleted = await self._response_store.delete(owner, response_id)
            except StorageError as e:
                log.error("%s: the response store cannot delete %s: %s", self.model_name, response_id, e)
                raise HttpError(503, "the response store cannot delete it right now; retry later", type="server_error")
            if not deleted:
                raise self._not_stored(response_id)
            return {"id": response_id, "object": "response", "deleted": True}

        await self._stored_answer(scope, send, answer)

    async def _cancel_response(self, scope, receive, send) -> None:
        """OpenAI's "cancel a response": a background response still queued is stored cancelled (the replica running
        it stops it: at once where this is that replica, else within BACKGROUND_POLL_S); one that has ended is a 400
        (cancelled again: itself)."""

        async def answer(owner: str, response_id: str, scope) -> dict:
            async with self._ending():  # not between a running response's look at the store and its end's write
                return await cancel(owner, response_id)

        async def cancel(owner: str, response_id: str) -> dict:
            record = await self._stored(owner, response_id)
            if record is None:
                raise self._not_stored(response_id)
            response = record["response"]
            if not response.get("background"):
                raise InvalidRequest(
                    f"{response_id} was not made with background: true; only a background response can be cancelled",
                    param="response_id",
                )
            if response["status"] == "cancelled":
                return response
            if response["status"] not in ("queued", "in_progress"):
                raise InvalidRequest(
                    f"{response_id} has ended ({response['status']}); only a response in progress can be cancelled",
                    param="response_id",
                )
            response = responses.ended(response, "cancelled")
            try:
                await self._response_store.cancel(owner, response_id, {**record, "response": response})
            except StorageError as e:
                log.error("%s: the response store cannot take the cancel of %s: %s", self.model_name, response_id, e)
                raise HttpError(503, "the response store cannot take the cancel right now; retry", type="server_error")
            running = self._background.get(response_id)
            if running is not None:
                running[0].cancel()
            return response

        await self._stored_answer(scope, send, answer)

    async def _response_input_items(self, scope, receive, send) -> None:
        """OpenAI's "list input items": a stored response's input items, a page at a time (`limit`, `order`,
        `after`, as OpenAI's query parameters)."""

        async def answer(owner: str, response_id: str, scope) -> dict:
            page = responses.ItemsQuery.parse(scope.get("query_string", b""))
            record = await self._stored(owner, response_id)
            if record is None:
                raise self._not_stored(response_id)
            return page.of(record["input"])

        await self._stored_answer(scope, send, answer)

    # -- OpenAI's Files and Batch APIs (pylon.serving.api.batch_api) ----------------------------------------------

    async def _batch_call(self, scope, receive, send, answer) -> None:
        """A Files or Batch API request: authorized, on a deployment that keeps them, `await answer(owner, object id,
        headers)`'s JSON (or raw bytes), or its 4xx; a store that cannot be reached is a 503."""
        headers = request_headers(scope)
        route, object_id = route_of(route_path(scope))
        try:
            await self._authorize(headers)
            if self._batch_store is None:
                raise InvalidRequest(
                    "this deployment keeps no files or batches (its spec's http.batch_store is null): set one, or "
                    "answer a file of requests offline with `pylon batch`",
                    param="http.batch_store",
                )
            kind, pattern = (
                ("file", batch_api.FILE_ID) if route.startswith("/v1/files") else ("batch", batch_api.BATCH_ID)
            )
            if object_id is not None and not pattern.match(object_id):  # (an id names an object: nothing else)
                raise self._no_batch_object(kind, object_id)
            result = await answer(await self._owner(headers), object_id, headers)
        except HttpError as e:
            return await send_error(send, e.status, e.message, type=e.type, param=e.param, headers=e.headers)
        except InvalidRequest as e:
            return await send_error(send, 400, str(e), type="invalid_request_error", param=e.param)
        except StorageError as e:
            log.error("%s: the batch store cannot be reached: %s", self.model_name, e)
            return await send_error(
                send,
                503,
                "the batch store cannot be reached right now (see the replica's log); retry later",
                type="server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if isinstance(result, bytes):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/jsonl"),
                        (b"content-length", str(len(result)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": result})
            return
        await send_json(send, 200, result)

    @staticmethod
    def _no_batch_object(kind: str, object_id: str) -> HttpError:
        return HttpError(
            404,
            f"no {kind} {shown(object_id)} (a {kind} is found with the API key that made it)",
            type="invalid_request_error",
            param=f"{kind}_id",
        )

    async def _stored_file(self, owner: str, file_id: str) -> dict:
        if not batch_api.FILE_ID.match(file_id):  # (a request's input_file_id: an id, or nothing here)
            raise self._no_batch_object("file", file_id)
        meta = await asyncio.to_thread(self._batch_store.file, owner, file_id)
        if meta is None:
            raise self._no_batch_object("file", file_id)
        return meta

    async def _create_file(self, scope, receive, send) -> None:
        """OpenAI's "upload file": a JSONL file of Batch API requests (multipart/form-data, purpose batch)."""

        async def answer(owner: str, _, headers) -> dict:
            body = await read_body(receive, batch_api.MAX_FILE_BYTES)
            filename, purpose, data = batch_api.upload(headers.get("content-type", ""), body)
            meta = batch_api.file_object(batch_api.new_id("file-"), filename, purpose, len(data))
            await asyncio.to_thread(self._batch_store.put_file, owner, meta, data)
            return meta

        await self._batch_call(scope, receive, send, answer)

    async def _list_files(self, scope, receive, send) -> None:
        """OpenAI's "list files": the key's files, newest first, a page at a time (`limit`, `after`)."""

        async def answer(owner: str, _, headers) -> dict:
            records = await asyncio.to_thread(self._batch_store.files, owner)
            return batch_api.page(records, scope.get("query_string", b""))

        await self._batch_call(scope, receive, send, answer)

    async def _get_file(self, scope, receive, send) -> None:
        async def answer(owner: str, file_id: str, headers) -> dict:
            return await self._stored_file(owner, file_id)

        await self._batch_call(scope, receive, send, answer)

    async def _file_content(self, scope, receive, send) -> None:
        """OpenAI's "retrieve file content": the file's bytes (an input, or a batch's output or error file)."""

        async def answer(owner: str, file_id: str, headers) -> bytes:
            await self._stored_file(owner, file_id)
            return await asyncio.to_thread(self._batch_store.content, owner, file_id)

        await self._batch_call(scope, receive, send, answer)

    async def _delete_file(self, scope, receive, send) -> None:
        async def answer(owner: str, file_id: str, headers) -> dict:
            if not await asyncio.to_thread(self._batch_store.delete_file, owner, file_id):
                raise self._no_batch_object("file", file_id)
            return {"id": file_id, "object": "file", "deleted": True}

        await self._batch_call(scope, receive, send, answer)

    async def _create_batch(self, scope, receive, send) -> None:
        """OpenAI's "create batch": every line of an uploaded file answered in the background by this replica."""

        async def answer(owner: str, _, headers) -> dict:
            request = protocol.parse_batch_request(await read_body(receive))
            meta = await self._stored_file(owner, request.input_file_id)
            if meta["purpose"] != "batch":
                raise InvalidRequest(
                    f"input_file_id: {request.input_file_id} is a {meta['purpose']} file, not a batch's input",
                    param="input_file_id",
                )
            data = await asyncio.to_thread(self._batch_store.content, owner, request.input_file_id)
            lines = batch_api.lines_of(data)
            if not lines:
                raise InvalidRequest(
                    f"input_file_id: {request.input_file_id} holds no requests (every line is blank)",
                    param="input_file_id",
                )
            batch = batch_api.new_batch(
                request.input_file_id, request.endpoint, request.completion_window, request.metadata, len(lines)
            )
            await asyncio.to_thread(self._batch_store.put_batch, owner, batch)
            self._start_batch(owner, batch, lines, headers)
            return batch_api.public(batch)

        await self._batch_call(scope, receive, send, answer)

    def _start_batch(self, owner: str, batch: dict, lines: list, headers: dict) -> None:
        """Answer `batch` in the background on this replica, each line with the creator's key (in memory only)."""
        key = [(b"authorization", headers["authorization"].encode("latin-1"))] if "authorization" in headers else []
        if not key and "x-api-key" in headers:
            key = [(b"x-api-key", headers["x-api-key"].encode("latin-1"))]
        app = OpenAIApp(self)
        count = [0]

        async def ask(path: str, body: dict) -> tuple[int, dict, str]:
            count[0] += 1
            request_id = f"{batch['id']}-{count[0]}"
            # after the live traffic: a line that asks for no priority waits behind requests that did not (OpenAI's
            # flex tier, the scheduler's priority 1); running lines are never preempted for them
            tier = [] if "priority" in body or "service_tier" in body else [(b"x-vllm-priority", b"1")]
            status, answer = await batch_api_call(app, path, body, request_id, (*key, *tier))
            return status, answer, request_id

        cancelled = asyncio.Event()
        engine = self.spec.engine

        async def run() -> None:
            try:
                await batch_api.answer(
                    self._batch_store,
                    owner,
                    batch,
                    lines,
                    ask,
                    self.model_name,
                    engine.max_num_seqs * engine.data_parallel,
                    cancelled,
                )
            except Exception:
                log.exception("%s: batch %s failed", self.model_name, batch["id"])
                batch.update(status="failed", failed_at=int(time.time()))
                try:
                    await asyncio.to_thread(self._batch_store.put_batch, owner, batch)
                except StorageError:
                    pass
            finally:
                self._batch_runs.pop(batch["id"], None)

        self._batch_runs[batch["id"]] = (asyncio.get_running_loop().create_task(run()), cancelled)

    async def _list_batches(self, scope, receive, send) -> None:
        """OpenAI's "list batches": the key's batches, newest first, a page at a time (`limit`, `after`)."""

        async def answer(owner: str, _, headers) -> dict:
            records = await asyncio.to_thread(self._batch_store.batches, owner)
            return batch_api.page(records, scope.get("query_string", b""), batch_api.public)

        await self._batch_call(scope, receive, send, answer)

    async def _stored_batch(self, owner: str, batch_id: str) -> dict:
        batch = await asyncio.to_thread(self._batch_store.batch, owner, batch_id)
        if batch is None:
            raise self._no_batch_object("batch", batch_id)
        at = await asyncio.to_thread(self._batch_store.cancelling_at, owner, batch_id)
        return batch_api.public(batch, at)

    async def _get_batch(self, scope, receive, send) -> None:
        """OpenAI's "retrieve batch": its status, counts and, once it has ended, its output and error files."""

        async def answer(owner: str, batch_id: str, headers) -> dict:
            return await self._stored_batch(owner, batch_id)

        await self._batch_call(scope, receive, send, answer)

    async def _cancel_batch(self, scope, receive, send) -> None:
        """OpenAI's "cancel batch": cancelling, then cancelled with the lines answered so far in its output file (at
        once on the replica answering it, else at its next heartbeat); a batch that has ended is a 400."""

        async def answer(owner: str, batch_id: str, headers) -> dict:
            batch = await self._stored_batch(owner, batch_id)
            if batch["status"] in ("cancelling", "cancelled"):
                return batch
            if batch["status"] not in batch_api.ACTIVE:
                raise InvalidRequest(
                    f"{batch_id} has ended ({batch['status']}); only a batch in progress can be cancelled",
                    param="batch_id",
                )
            at = await asyncio.to_thread(self._batch_store.cancel, owner, batch_id)
            running = self._batch_runs.get(batch_id)
            if running is not None:
                running[1].set()
            return {**batch, "status": "cancelling", "cancelling_at": at}

        await self._batch_call(scope, receive, send, answer)

    async def _model(self, scope, receive, send) -> None:
        """OpenAI's "retrieve model": the served model's card, or a 404 naming the id asked for."""
        try:
            await self._authorize(request_headers(scope))
        except HttpError as e:
            return await send_error(send, e.status, e.message, type=e.type, headers=e.headers)
        model = route_of(route_path(scope))[1]
        if model not in self._served and self._on_demand(model):
            try:
                await self.fetcher.fetch(model)
            except HttpError as e:
                return await send_error(send, e.status, e.message, type=e.type, param=e.param, headers=e.headers)
        elif model not in self._served:
            return await send_error(
                send,
                404,
                f"the model {shown(model)} does not exist here; this server serves {self._served_list()} "
                "(GET /v1/models lists them)",
                type="invalid_request_error",
                param="model",
            )
        await send_json(send, 200, self._model_card(model))

    def _model_card(self, model: str) -> dict:
        """`model`'s card: the base model's, or a LoRA adapter's (its `parent` the base model, as vLLM's)."""
        return {
            "id": model,
            "object": "model",
            "owned_by": "pylon",
            "created": 0,
            "max_model_len": self.engine.max_model_len,
            "parent": None if model == self.model_name else self.model_name,
        }

    async def _health(self, scope, receive, send) -> None:
        """Liveness that probes the engine: its step loop must have beaten within the heartbeat window."""
        ok = self.engine.check_health()
        await send_json(send, 200 if ok else 503, {"status": "ok" if ok else "engine loop not running"})

    async def _ready(self, scope, receive, send) -> None:
        stats = self.engine.stats()
        ok = self.engine.check_health()
        await send_json(
            send,
            200 if ok else 503,
            {
                "ready": ok,
                "model": self.model_name,
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "kv_cache_usage": round(stats.kv_cache_utilization, 4),
                "revision": self._revision,
            },
        )

    async def _openapi(self, scope, receive, send) -> None:
        """This API as an OpenAPI 3.1 document (no key needed), built once per mount point (Serve's root_path: the
        route prefix) and cached."""
        prefix = scope.get("root_path") or self.spec.http.route_prefix
        secured = self._keys.required  # whether a request needs a key
        cached = self.__dict__.setdefault("_openapi_docs", {})
        if (prefix, secured) not in cached:
            cached[prefix, secured] = openapi.document_bytes(
                model=self.model_name,
                max_model_len=self.engine.max_model_len,
                secured=secured,
                route_prefix=prefix,
                adapters=tuple(self._served[1:]),
            )
        body = cached[prefix, secured]
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, send, error: BaseException, adapter: str = "") -> None:
        """The error answer for a request that failed before its response started, counted in the metrics: the
        request's own fault (4xx naming the parameter), a timeout (504), the engine gone (503 with Retry-After, the
        replica restarts it), or the engine's fault for this request alone (500, the engine serves on)."""
        if isinstance(error, HttpError):
            self._count(error.status, "none", adapter)
            return await send_error(
                send, error.status, error.message, type=error.type, param=error.param, headers=error.headers
            )
        if isinstance(error, InvalidRequest):
            self._count(400, "none", adapter)
            message = self.fetcher.named(str(error)) if self.fetcher is not None else str(error)
            return await send_error(send, 400, message, type="invalid_request_error", param=error.param)
        if isinstance(error, TimeoutError):
            self._count(504, "timeout", adapter)
            timeout = self.spec.http.request_timeout_s
            return await send_error(
                send, 504, f"the request took longer than request_timeout_s ({timeout:g} s)", type="timeout_error"
            )
        if isinstance(error, EngineDeadError):
            self._count(503, "none", adapter)
            return await send_error(
                send,
                503,
                f"{self.model_name} is unavailable: {error}",
                type="server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        assert isinstance(error, RequestFailed), error
        log.error("%s: %s", self.model_name, error)
        self._count(500, "none", adapter)
        return await send_error(send, 500, str(error), type="server_error")

    async def _generate(self, scope, receive, send, kind: str) -> None:

        headers = request_headers(scope)
        # How Pylon's router routed it (pylon.serving.api.routing), echoed for clients and tests to see.
        route = headers.get(routing.ROUTE_REQUEST_HEADER, "")
        answer_headers = {routing.ROUTE_RESPONSE_HEADER: route} if _ROUTE.match(route) else {}
        # Serve's ingress puts the client's X-Request-Id (or one it made up) on the request and the response.
        request_id = headers.get("x-request-id", "")
        if not REQUEST_ID.match(request_id):
            request_id = protocol.new_id("req")
        self._ensure_gauges()
        request = None  # a Responses API request, whose chat request `body` is
        message = None  # an Anthropic Messages request, whose chat request `body` is
        try:
            cls = _REQUESTS[kind]
            body = await self._request(headers, receive, cls)
            if kind == "messages":
                message = body
                body = message.chat()
            if kind == "responses":
                request = body
                await self._continue(headers, request)
                request.fit(self._fits)  # truncation "auto": the earliest turns dropped until it fits
                body = request.chat()
            if kind == "completion":
                prompts = body.prompts()
                for i, prompt in enumerate(prompts):
                    if isinstance(prompt, str) and not prompt and body.suffix is None:
                        raise InvalidRequest("prompt must not be empty", param=_prompt_param(i, len(prompts)))
                if body.suffix is not None:  # fill in the middle: the code model's tokens around prefix and suffix
                    special = body.add_special_tokens
                    prompts = [fim_ids(self.engine.tokenizer, p, body.suffix, special) for p in prompts]
            else:
                if getattr(body, "chat_template", None) is not None and not self.spec.http.trust_request_chat_template:
                    raise InvalidRequest(
                        "chat_template: this deployment renders chats with the model's own template; a request's "
                        "is taken only where http.trust_request_chat_template is true",
                        param="chat_template",
                    )
                prompts = [body.render(self.engine.tokenizer, self.engine.max_images)]
            # OpenAI's completions default is 16 tokens; chat runs to the end of the context by default; a model whose
            # generation_config.json sets max_new_tokens runs up to that instead (and the other defaults it sets).
            if body.request_id is not None and not headers.get("x-request-id"):
                request_id = body.request_id  # vLLM's field; a client's X-Request-Id header wins
            params = body.sampling_params(16 if kind == "completion" else None, self.sampling_defaults)
            params.priority = _priority(headers, params.priority)
            if kind != "completion" and self.engine.generation.snapshots:  # recurrent layers: keep the shared part
                shared = body.shared_prefix(self.engine.tokenizer)
                if shared is not None:
                    params.snapshot_at = len(prompt_ids(self.engine.tokenizer, shared, params.add_special_tokens))
            if kind != "completion":  # a constrained chat reply in the model's own format, its reasoning first
                params.guide = reply_guide.for_reply(
                    params.guide,
                    body.tool_plan,
                    self.engine.tokenizer,
                    parser=self.spec.http.reasoning_parser if self._harmony is None else None,
                    harmony=self._harmony,
                )
                params.keep_special_ids = self._parsed_markers(body)
            self._adapter_params(params, body.model)  # one of its LoRA adapters, if not the base model
            if getattr(body, "use_beam_search", False):
                beam_search.check(body)
                self._admit()
                return await self._beams(send, kind, body, prompts, params, request_id, answer_headers)
            self._admit()
            engine_id = f"{request_id}-{protocol.new_id('e')}"
            interval_s = self.spec.http.stream_interval_ms / 1000
            # `n` choices per prompt (and a batch of prompts): one engine request each; a prompt's choices share
            # its KV blocks once they are cached.
            plan = [(i, k) for i in range(len(prompts)) for k in range(body.n)]
            streams: list = [None] * len(plan)
            # Each long prompt's blocks from a prefill replica, taken in with its first choice (the others then find
            # them cached too): `prefill`, pylon.serving.api.prefill.
            transfers = [None] * len(prompts)
            if self._prefill is not None:
                transfers = await asyncio.gather(
                    *(self._prefill.blocks(f"{engine_id}-p{i}", p, params) for i, p in enumerate(prompts))
                )

            if params.thinking_token_budget is not None:
                tags = [self._reasoning_tags(prompt) for prompt in prompts]

            async def start(j: int, i: int, k: int):
                # Made and first iterated in its own task, in order: an engine pool picks each request's engine by
                # its open streams, which the previous request's first iteration has just counted.
                own = _choice_params(params, k)
                if params.thinking_token_budget is not None:
                    own = dataclasses.replace(own, reasoning_tags=tags[i])
                if transfers[i] is not None and k == 0:
                    own = dataclasses.replace(own, kv_import=transfers[i])
                streams[j] = self.engine.generate(
                    engine_id if len(plan) == 1 else f"{engine_id}-{j}",
                    prompts[i],
                    own,
                    interval_s=interval_s,
                )
                return await _naming_prompt(self._first(streams[j]), i, len(prompts))

            try:  # validation errors surface here, before any byte is sent
                firsts = await _all([start(j, i, k) for j, (i, k) in enumerate(plan)])
            except BaseException:
                for stream in streams:
                    if stream is not None:
                        await stream.aclose()
                raise
        except (HttpError, InvalidRequest, EngineDeadError, RequestFailed) as e:
            if request is not None and isinstance(e, InvalidRequest):  # named as the Responses request's field
                e = request.refusal(e)
            if message is not None and isinstance(e, InvalidRequest):  # ...or the Messages request's
                e = message.refusal(e)
            return await self._refuse(send, e)

        chat = kind != "completion"
        if request is not None:
            rid = routing.response_id(self._replica_tag)
        elif message is not None:
            rid = anthropic.new_message_id()
        else:
            rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        # A chat reply's <think> block as reasoning_content (`reasoning`), or a harmony model's channels; a grammar
        # that constrains the reply lets the reasoning come first (`reply_guide`).
        read_harmony = chat and self._harmony is not None
        parser = self.spec.http.reasoning_parser if chat and not read_harmony else None
        timeout = self.spec.http.request_timeout_s
        shape = "chat" if chat else "completion"
        speaks = None
        if read_harmony:
            tool_plan = body.tool_plan
            speaks = (self._harmony, None if tool_plan is None else tool_plan.functions)
        choices = [
            _Choice(shape, body, prompts[i], self.engine.tokenizer, self._token_texts, parser, speaks) for i, _ in plan
        ]
        if body.stream:
            created = int(time.time())
            if request is not None:
                events = [responses.ResponseEvents(request, rid, created)]
            elif message is not None:
                first = firsts[0]
                events = [anthropic.MessageEvents(message, rid, first.num_prompt_tokens, first.num_cached_tokens)]
            else:
                events = [
                    protocol.StreamEvents(shape, rid, body.model, index=j, created=created) for j in range(len(plan))
                ]
            return await self._stream(send, events, body, firsts, streams, timeout, choices, answer_headers, parser)

        if request is not None and request.background:  # answered queued now; polled from the store
            return await self._start_background(send, request, rid, (body, firsts, streams, choices, parser))
        try:
            merged = await self._whole_answer(kind, body, rid, firsts, streams, choices, parser, timeout)
        except (TimeoutError, EngineDeadError) as e:
            return await self._refuse(send, e, self._adapter_of(body))
        if request is not None:
            merged = responses.response_object(request, merged, rid)
            if request.kept:
                await self._keep_response(request, merged)
        if message is not None:
            merged = anthropic.message_object(message, merged, rid)
        await send_json(send, 200, merged, answer_headers)

    async def _beams(self, send, kind: str, body, prompts: list, params, request_id: str, headers: dict) -> None:
        """A beam search request (`use_beam_search`): each prompt's `n` best beams as its choices, best first
        (`beam_search.search`), answered whole within request_timeout_s."""
        eos = frozenset() if body.ignore_eos else frozenset(self.engine.generation.eos_token_ids)
        tokenizer, parser = self.engine.tokenizer, self.spec.http.reasoning_parser if kind != "completion" else None
        skipped = special_token_ids(tokenizer) if params.skip_special_tokens else frozenset()
        engine_id = f"{request_id}-{protocol.new_id('e')}"
        limit, started = self.engine.max_model_len, time.monotonic()

        async def one(i: int, prompt):
            return await beam_search.search(
                self.engine, f"{engine_id}-{i}", prompt, params, body.n, params.max_tokens, body.length_penalty, eos,
                limit,
            )  # fmt: skip

        try:
            async with asyncio.timeout(self.spec.http.request_timeout_s):
                found = await _all([one(i, prompt) for i, prompt in enumerate(prompts)])
        except TimeoutError as e:
            return await self._refuse(send, e, self._adapter_of(body))
        except (InvalidRequest, EngineDeadError, RequestFailed) as e:
            return await self._refuse(send, e)
        rid = protocol.new_id("chatcmpl" if kind != "completion" else "cmpl")
        answers, prompt_tokens, cached, generated = [], 0, 0, 0
        for beams, ids, hits in found:
            prompt_tokens, cached = prompt_tokens + len(ids), cached + hits
            for beam in beams:
                tokens = beam.tokens[:-1] if beam.ended else beam.tokens
                text = tokenizer.decode([t for t in tokens if t not in skipped])
                reason = "stop" if beam.ended else "length"
                generated += len(beam.tokens)
                if kind == "completion":
                    answers.append(protocol.completion_response(rid, body.model, text, reason, 0, 0))
                else:
                    extra = {}
                    if parser is not None:
                        thought, text = reasoning.split(text, parser)
                        extra = {"reasoning_content": thought, "with_reasoning": True}
                    answers.append(protocol.chat_response(rid, body.model, text, reason, 0, 0, **extra))
        merged = protocol.merge_choices(answers)
        merged["usage"] = protocol.usage(prompt_tokens, generated, cached)
        adapter = self._adapter_of(body)
        self._count(200, merged["choices"][0]["finish_reason"], adapter)
        # the ledger counts what the answer counts (the beams' steps recompute little: the prefix cache has it)
        self.ledger.finished(prompt_tokens, generated, started, time.monotonic(), adapter or None)
        await send_json(send, 200, merged, headers)

    async def _whole_answer(self, kind: str, body, rid: str, firsts, streams, choices, parser, timeout: float) -> dict:
        """The whole answer (a completion's or a chat's JSON) of a request whose engine streams have started: each
        choice collected, within `timeout` (TimeoutError); the streams closed whatever happens (which aborts what
        has not finished)."""
        chat = kind != "completion"

        async def collect(k: int):
            text, pairs, last = [], [], firsts[k]
            async for out in _chain(firsts[k], streams[k]):
                delta, tokens = choices[k].take(out)
                text.append(delta)
                pairs.extend(tokens)
                last = out
            return "".join(text), pairs, last

        try:
            async with asyncio.timeout(timeout):
                results = await _all([collect(j) for j in range(len(streams))])
        finally:
            for stream in streams:
                await stream.aclose()  # aborts the engine request if it has not finished (a timeout, a cancel)
        make = protocol.completion_response if kind == "completion" else protocol.chat_response
        answers = []
        for k, (content, pairs, last) in enumerate(results):
            self._observe(last, count=k == 0, adapter=self._adapter_of(body))
            reason, extra = last.finish_reason, {}
            read = choices[k].harmony
            if read is not None:  # the reply's channels, fed as the engine gave its tokens (`_Choice.take`)
                content, calls = choices[k].harmony_reply()
                extra.update(reasoning_content=choices[k].harmony_thought, with_reasoning=True)
                if calls:
                    extra["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            elif parser is not None:
                thought, content = reasoning.split(content, parser)
                extra.update(reasoning_content=thought, with_reasoning=True)
            if chat and body.tool_plan is not None and read is None:
                content, calls = tools.parse(content, body.tool_plan)
                if calls:
                    extra["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            if choices[k].echoed:
                content = choices[k].echoed + (content or "")
            answer = make(
                rid,
                body.model,  # the model or adapter asked for, as vLLM answers
                content,
                reason,
                last.num_prompt_tokens,
                last.num_output_tokens,
                logprobs=choices[k].logprobs(pairs),
                cached_tokens=last.num_cached_tokens,
                **extra,
            )
            own, top = choices[k].fields()
            answer["choices"][0].update(own)
            answer.update(top)
            answers.append(answer)
        merged = protocol.merge_choices(answers)
        merged["usage"] = protocol.usage(*_usage([last for _, _, last in results], body.n, choices))
        return merged

    async def _start_background(self, send, request: responses.ResponsesRequest, rid: str, work: tuple) -> None:
        """A Responses request with background: true, its engine request started: kept queued in the store, answered
        so at once, and run to its end by a task of this replica (`_run_background`), which stores what it ends as."""
        _, _, streams, _, _ = work
        response = responses.queued_object(request, rid, int(time.time()))
        record = {"response": response, "input": request.input_items(), "conversation": [], "started": time.time()}
        try:
            await self._response_store.put(request.owner, rid, record)
        except StorageError as e:
            for stream in streams:
                await stream.aclose()
            log.error("%s: background response %s not stored: %s", self.model_name, rid, e)
            return await send_error(
                send,
                503,
                "the response store cannot take a background response right now (see the replica's log); retry later",
                type="server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        task = asyncio.get_running_loop().create_task(self._run_background(request, rid, response, work))
        self._background[rid] = (task, request.owner, record)
        task.add_done_callback(lambda _: self._background.pop(rid, None))
        await send_json(send, 200, response)

    async def _run_background(self, request: responses.ResponsesRequest, rid: str, queued: dict, work: tuple) -> None:
        """Run a background response to its end and store it: completed (or incomplete), failed (an engine fault,
        http.background_timeout_s), or left as a cancel stored it (`_cancel_response`, on any replica: checked every
        BACKGROUND_POLL_S, and before the end is stored)."""
        body, firsts, streams, choices, parser = work
        answer = asyncio.ensure_future(
            self._whole_answer("chat", body, rid, firsts, streams, choices, parser, self.spec.http.background_timeout_s)
        )
        store, owner = self._response_store, request.owner
        try:
            while not answer.done():
                await asyncio.wait({answer}, timeout=BACKGROUND_POLL_S)
                if answer.done():
                    break
                record = await store.get(owner, rid)
                if record is None or record["response"]["status"] == "cancelled":  # deleted, or cancelled elsewhere
                    answer.cancel()
                    return
            try:
                result = responses.response_object(request, answer.result(), rid)
            except (TimeoutError, EngineDeadError, RequestFailed, InvalidRequest) as e:
                why = "it ran past http.background_timeout_s" if isinstance(e, TimeoutError) else str(e)
                result = responses.ended(queued, "failed", f"the response did not finish: {why}")
            async with self._ending():  # a cancel on this replica comes before this look or after the write
                record = await store.get(owner, rid)
                if record is None or record["response"]["status"] == "cancelled":
                    return
                # shielded: a cancel waiting for the lock must find the end stored, not half a write; then a cancel
                # another replica stored after the look above is put back over the end (response_store's docstring)
                await asyncio.shield(self._end_background(request, result))
        except asyncio.CancelledError:  # the replica is stopping, or a cancel on this replica
            answer.cancel()
            raise
        except StorageError as e:
            answer.cancel()
            log.error("%s: background response %s: the store failed: %s", self.model_name, rid, e)
        except Exception:
            answer.cancel()
            log.exception("%s: background response %s failed", self.model_name, rid)

    async def _end_background(self, request: responses.ResponsesRequest, result: dict) -> None:
        if await self._keep_response(request, result):
            await self._response_store.settle(request.owner, result["id"])

    def _ending(self) -> asyncio.Lock:
        """The lock a background response's end and a cancel of one take on this replica (made in its loop)."""
        if self._background_ends is None:
            self._background_ends = asyncio.Lock()
        return self._background_ends

    def _fits(self, chat: protocol.ChatCompletionRequest) -> bool:
        """Whether a chat's prompt and the tokens it asks for (at least one) fit the engine's context (a prompt with
        images: as the engine will say)."""
        tokenizer, limit = self.engine.tokenizer, self.engine.max_model_len
        prompt = chat.render(tokenizer, self.engine.max_images)
        if not isinstance(prompt, str):
            return True
        bound = self._chars_per_token
        if bound is not None and len(prompt) > bound * limit:  # cannot fit: not tokenized (a huge one stalls)
            return False
        return len(prompt_ids(tokenizer, prompt, chat.add_special_tokens)) + (chat.max_tokens or 1) <= limit

    @functools.cached_property
    def _chars_per_token(self) -> int | None:
        return chars_per_token_bound(self.engine.tokenizer)

    def _reasoning_tags(self, prompt) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """What a reply's reasoning is, for thinking_token_budget (SamplingParams.reasoning_tags), as this model
        writes it: a `<think>` block (http.reasoning_parser), already open where the prompt ends with `<think>`
        (DeepSeek-R1's template), or a harmony model's analysis message, which ends by the final channel's header.
        A 400 for a deployment that reads no reasoning."""
        if self._reasoning_marks is None:
            raise InvalidRequest(
                "thinking_token_budget: this deployment reads no reasoning (set http.reasoning_parser for a model "
                "that thinks in <think> blocks)",
                param="thinking_token_budget",
            )
        start, start_ids, end_ids = self._reasoning_marks
        text = (
            self.engine.tokenizer.decode(prompt[-16:]) if isinstance(prompt, list) else getattr(prompt, "text", prompt)
        )
        return start_ids, end_ids, text.rstrip().endswith(start)

    @functools.cached_property
    def _reasoning_marks(self) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
        """What opens and what ends this model's reasoning (the opening's text, both as token ids), tokenized once;
        None where the deployment reads no reasoning."""
        if self._harmony is not None:
            start, end = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
        elif self.spec.http.reasoning_parser is not None:
            start, end = reasoning.START, reasoning.END
        else:
            return None
        tokenizer = self.engine.tokenizer
        return start, tuple(prompt_ids(tokenizer, start)), tuple(prompt_ids(tokenizer, end))

    def _parsed_markers(self, body) -> tuple[int, ...]:
        """The special tokens a chat reply's parsers read, kept in its text whatever `skip_special_tokens` says: the
        tool-call markers where the request has tools, the reasoning tags where the deployment reads reasoning (a
        harmony reply is read by token id, not text)."""
        if self._harmony is not None:
            return ()
        markers = [*tools.MARKERS] if body.tool_plan is not None else []
        if self.spec.http.reasoning_parser is not None:
            markers += [reasoning.START, reasoning.END]
        return added_token_ids(self.engine.tokenizer, markers) if markers else ()

    @functools.cached_property
    def _token_texts(self) -> TokenTexts:
        """Token ids' texts and bytes for logprobs, cached across requests (built at the first use)."""
        return TokenTexts(self.engine.tokenizer)

    async def _first(self, stream):
        return await stream.__anext__()

    async def _stream(
        self,
        send,
        events: list,
        body,
        firsts: list,
        streams: list,
        timeout: float,
        choices: list,
        answer_headers: dict,
        parser: str | None = None,
    ) -> None:
        """Server-sent events: the chunks of every choice as they come, a usage chunk if asked, then [DONE]. A client
        that disconnects gets this task cancelled by Serve's ingress; closing the streams then aborts the engine
        requests.

        Events that are ready together go out as one write: chat's role chunk with the first content, and the
        last content chunk with the usage chunk and [DONE]."""

        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer_headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *extra]})
        lasts, held, left = list(firsts), "", len(streams)
        parts = [
            self._choice_events(k, events[k], body, firsts[k], streams[k], choices[k], parser)
            for k in range(len(streams))
        ]
        source = parts[0] if len(parts) == 1 else _interleave(parts)
        try:
            async with asyncio.timeout(timeout):
                async for k, piece, out in source:
                    lasts[k] = out
                    held += piece
                    left -= out.finished
                    if left:  # the last piece of the last choice waits for the usage chunk and [DONE]
                        await send({"type": "http.response.body", "body": held.encode(), "more_body": True})
                        held = ""
            if body.include_usage:
                held += events[0].usage(*_usage(lasts, body.n, choices))
            kept = getattr(events[0], "request", None)  # a Responses API request the deployment keeps
            if kept is not None and kept.kept and not await self._keep_response(kept, events[0].response):
                held += events[0].event(
                    protocol.error_body(
                        "the response was not stored (see the replica's log); previous_response_id cannot name it",
                        type="server_error",
                        code=503,
                    )
                )
            for k, last in enumerate(lasts):
                self._observe(last, count=k == 0, adapter=self._adapter_of(body))
        except TimeoutError:
            self._count(504, "timeout", self._adapter_of(body))
            held += events[0].event(
                protocol.error_body(
                    f"the request took longer than request_timeout_s ({timeout:g} s)", type="timeout_error", code=504
                )
            )
        except EngineDeadError as e:
            self._count(503, "none", self._adapter_of(body))
            held += events[0].event(protocol.error_body(str(e), type="server_error", code=503))
        finally:
            for part in parts:
                await part.aclose()
            for stream in streams:
                await stream.aclose()  # aborts the engine request if it has not finished
        await send({"type": "http.response.body", "body": (held + events[0].done()).encode(), "more_body": False})

    async def _choice_events(self, k: int, events, body, first, stream, choice: "_Choice", parser: str | None = None):
        """One choice's server-sent events as they become ready to go out: (k, text, the engine output they end
        at). Chat's role chunk waits for the first reasoning or content; text that may be a tool call, or the end of
        a reasoning block, is held back."""
        held = ""  # chat's role chunk (and an echoed message) goes out with the first reasoning or content
        pending = []  # tokens whose logprobs go with the next chunk (tokens without text yet wait for their text)
        plan = body.tool_plan if events.kind == "chat" else None
        read = choice.harmony  # a harmony model's reply: read by channel (`_Choice.take`), no text formats
        calling = tools.ToolStream(plan) if plan is not None and read is None else None  # holds a possible call
        thinking = reasoning.ReasoningStream(parser) if parser is not None else None
        mark = choice.mark
        async for out in _chain(first, stream):
            text, tokens = choice.take(out)
            if events.kind == "chat" and out is first:
                held = mark(events.role(), tokens=False)
                if choice.echoed:
                    held += mark(events.chunk(choice.echoed, None), tokens=False)
            thought = ""
            calls = []
            if read is not None:
                thought, text = choice.harmony_delta
                if out.finished:
                    more_thought, more_text, calls = read.finish()
                    thought, text = thought + more_thought, text + more_text
            elif thinking is not None:
                thought, text = thinking.feed(text)
                if out.finished:
                    more_thought, more_text = thinking.finish()
                    thought, text = thought + more_thought, text + more_text
            pending.extend(tokens)
            if thought:
                held += mark(events.reasoning(thought, choice.logprobs(pending)))
                pending = []
            if calling is not None:
                text = calling.feed(text)
                if out.finished:
                    rest, calls = calling.finish()
                    text += rest
            if not text and not out.finished:
                if thought:
                    yield k, held, out
                    held = ""
                continue
            if calls:  # content first (if any), then the calls with the finish reason
                if text:
                    held += mark(events.chunk(text, None, choice.logprobs(pending)))
                    pending = []
                reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
                held += mark(events.tool_calls(calls, reason))
            else:
                held += mark(events.chunk(text, out.finish_reason, choice.logprobs(pending)))
            pending = []
            yield k, held, out
            held = ""

    def _adapter_of(self, body) -> str:
        """The metrics' `adapter` of a request: the LoRA adapter its `model` names, "" for the base model."""
        return "" if body.model == self.model_name else body.model

    def _observe(self, last, *, count: bool = True, adapter: str = "") -> None:
        """A finished engine request's latencies and tokens into the metrics (under its LoRA `adapter`) and the
        ledger; `count`: the HTTP request's status too (once per request, whatever its `n`)."""
        m, metrics, tags = self.metrics, last.metrics, {"adapter": adapter}
        if metrics.time_to_first_token is not None:
            m["ttft"].observe(metrics.time_to_first_token, tags=tags)
        if metrics.queue_time is not None:
            m["queue"].observe(metrics.queue_time, tags=tags)
        # An embedding ends with no token: its request ends when its prompt is computed.
        end = metrics.last_token_time if last.embedding is None else metrics.finished_time
        itl = None
        if end is not None:
            m["e2e"].observe(end - metrics.arrival_time, tags=tags)
            if last.num_output_tokens > 1 and metrics.first_token_time is not None:
                itl = (metrics.last_token_time - metrics.first_token_time) / (last.num_output_tokens - 1)
                m["itl"].observe(itl, tags=tags)
        self.latency.add(metrics.time_to_first_token, itl)
        m["prompt_tokens"].inc(last.num_prompt_tokens, tags=tags)
        self.ledger.finished(last.num_prompt_tokens, last.num_output_tokens, metrics.arrival_time, end, adapter or None)
        if last.num_output_tokens:
            m["generation_tokens"].inc(last.num_output_tokens, tags=tags)
        if count:
            self._count(200, last.finish_reason or "none", adapter)

    def _count(self, status: int, reason: str, adapter: str = "") -> None:
        """A request's HTTP status into the metrics; `adapter`: its LoRA adapter's name (requests refused before their
        body was read count under "")."""
        self.metrics["requests"].inc(tags={"status": str(status), "finish_reason": reason, "adapter": adapter})

    def __serve_build_asgi_app__(self) -> OpenAIApp:
        """Serve's ingress calls this once the replica is constructed: the ASGI app it hands HTTP requests."""
        return OpenAIApp(self)


class _Choice:
    """What a request's choice carries besides the engine's text: the echoed prompt (completions' `echo`) and the
    tokens' logprobs in OpenAI's shape (`protocol.LogprobsFormat`)."""

    def __init__(
        self,
        kind: str,
        body,
        prompt,
        tokenizer,
        texts: TokenTexts,
        parser: str | None = None,
        speaks: tuple[harmony.HarmonyTokens, Collection[str] | None] | None = None,
    ):
        """`speaks`: the reply is read as harmony (the model's marker ids, and the request's functions or None):
        `harmony` reads it as it comes, `harmony_delta` is what the last `take` gave (reasoning, content)."""
        self.kind, self.prompt, self.tokenizer = kind, prompt, tokenizer
        self.harmony = harmony.HarmonyStream(tokenizer, *speaks) if speaks is not None else None
        self.harmony_delta = ("", "")
        self.harmony_thought: str | None = None
        self._harmony_parts: tuple[list[str], list[str]] = ([], [])
        self.special = body.add_special_tokens  # how the engine tokenizes a text prompt (`prompt_ids`)
        self.echo = kind == "completion" and body.echo
        self.echo_logprobs = body.logprobs if self.echo else None  # the echoed prompt's alternatives: logprobs' count
        # chat's echo: the last message's content, where it is the assistant's, before the reply's
        self.echoed = body.echoed() if kind == "chat" else ""
        wanted = body.logprobs is not None if kind == "completion" else body.logprobs
        names = protocol.LogprobsFormat(texts, as_ids=body.return_tokens_as_token_ids)  # a token's text, or its id
        self.format = names if wanted else None
        self.token_text = names.token_text
        self.started = False
        # vLLM's return_token_ids and prompt_logprobs: what the answer carries besides (`fields`, `mark`)
        self.return_ids, self.prompt_k = body.return_token_ids, body.prompt_logprobs
        # vLLM's continuous_usage_stats (chat and completions' events; a Responses stream has none): the usage so far
        self.continuous = kind in ("chat", "completion") and getattr(body, "continuous_usage", False)
        self.usage: dict | None = None
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.prompt_entries: list | None = None
        self._unmarked: list[int] = []  # token ids no streamed chunk has carried yet
        self._marked_prompt = False
        # The reply's reasoning tokens, where a reasoning parser reads it (usage.completion_tokens_details).
        self.reasoning = reasoning.ReasoningCount(parser, texts.text) if parser is not None else None
        if self.harmony is not None:
            self.reasoning = _HarmonyCount(self.harmony)

    def take(self, out) -> tuple[str, list]:
        """One engine output's text (after the echoed prompt, on the first) and its (token id, logprob) pairs; a
        harmony reply's ids read on (`harmony_delta`)."""
        text, pairs = out.text, []
        if self.return_ids:
            self.token_ids.extend(out.token_ids)
            self._unmarked.extend(out.token_ids)
            if out.prompt_token_ids is not None:
                self.prompt_token_ids = out.prompt_token_ids
        if self.prompt_k is not None and out.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs
        if self.continuous:
            self.usage = protocol.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        if self.harmony is not None:
            self.harmony_delta = self.harmony.feed(out.token_ids)
            self._harmony_parts[0].append(self.harmony_delta[0])
            self._harmony_parts[1].append(self.harmony_delta[1])
        elif self.reasoning is not None:
            self.reasoning.add(out.token_ids)
        if not self.started:
            self.started = True
            if self.echo:
                prompt = self.prompt
                text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) + text
                if self.format is not None and out.prompt_logprobs is not None:
                    pairs.extend(self._prompt_pairs(out.prompt_logprobs, self.echo_logprobs))
        if self.format is not None and out.logprobs is not None:
            pairs.extend(zip(out.token_ids, out.logprobs))
        return text, pairs

    def harmony_reply(self) -> tuple[str | None, list[dict]]:
        """A whole harmony reply, all its outputs taken: its content and tool calls (`harmony_thought`: its reasoning,
        None where it had none)."""
        thought, content, calls = self.harmony.finish()
        self._harmony_parts[0].append(thought)
        self._harmony_parts[1].append(content)
        reasoning_text = "".join(self._harmony_parts[0])
        self.harmony_thought = reasoning_text if self.harmony.had_reasoning else None
        content = "".join(self._harmony_parts[1])
        return (content or None) if calls else content, calls

    def _prompt_pairs(self, entries: list, k: int) -> list:
        """The prompt's (token id, logprob) pairs, each with at most `k` alternatives (the engine may have scored
        more, for prompt_logprobs); the first token's logprob is None (nothing predicts it). The ids of tokens without
        an entry come from the prompt, tokenized here as the engine tokenized it."""
        ids = None
        pairs = []
        for p, entry in enumerate(entries):
            if entry is not None:
                if len(entry.top) > k:
                    entry = dataclasses.replace(entry, top=entry.top[:k])
                pairs.append((entry.token_id, entry))
                continue
            if ids is None:
                prompt = self.prompt
                ids = list(prompt) if not isinstance(prompt, str) else prompt_ids(self.tokenizer, prompt, self.special)
            pairs.append((ids[p], None))
        return pairs

    def logprobs(self, pairs: list) -> dict | None:
        if self.format is None:
            return None
        return self.format.completion(pairs) if self.kind == "completion" else self.format.chat(pairs)

    def prompt_logprobs(self) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt position, None at the first, else {token id: {logprob, rank,
        decoded_token}} for the prompt's token there and the `prompt_logprobs` most likely tokens (ranks 1 on)."""
        if self.prompt_entries is None:
            return None
        text = self.token_text
        out: list = []
        for entry in self.prompt_entries:
            if entry is None:
                out.append(None)
                continue
            found = {str(entry.token_id): protocol.vllm_logprob(entry.logprob, entry.rank, text(entry.token_id))}
            for rank, (t, value) in enumerate(entry.top[: self.prompt_k], 1):
                found.setdefault(str(t), protocol.vllm_logprob(value, rank, text(t)))
            out.append(found)
        return out

    def fields(self) -> tuple[dict, dict]:
        """What the whole answer carries besides, for vLLM's return_token_ids and prompt_logprobs: (the choice's
        fields, the response's). A completion's choice carries them all; a chat's prompt fields are the response's."""
        prompt: dict = {}
        if self.prompt_k is not None:
            prompt["prompt_logprobs"] = self.prompt_logprobs()
        if self.return_ids:
            prompt["prompt_token_ids"] = self.prompt_token_ids
        own = {"token_ids": list(self.token_ids)} if self.return_ids else {}
        return ({**prompt, **own}, {}) if self.kind == "completion" else (own, prompt)

    def mark(self, event: str, tokens: bool = True) -> str:
        """A streamed event (`StreamEvents`') with vLLM's fields: the token ids since the last marked event
        (`tokens`), the prompt's token ids and logprobs on the first one marked, and the usage so far (with
        stream_options.continuous_usage_stats)."""
        if not self.return_ids and self.prompt_k is None and not self.continuous:
            return event
        own, prompt = {}, {}
        if not self._marked_prompt:
            self._marked_prompt = True
            own, prompt = self.fields()
            own.pop("token_ids", None)
        if self.return_ids and tokens:
            own["token_ids"], self._unmarked = self._unmarked, []
        if self.kind == "completion":
            own, prompt = {**prompt, **own}, {}
        if self.continuous:
            prompt["usage"] = self.usage
        return protocol.StreamEvents.splice(event, own, prompt)


class _HarmonyCount:
    """A harmony reply's reasoning tokens (its analysis messages'), as its stream counted them: `ReasoningCount`'s
    part in `_usage`."""

    def __init__(self, stream: harmony.HarmonyStream):
        self._stream = stream

    def finish(self) -> int:
        return self._stream.reasoning_tokens


def _priority(headers: dict[str, str], given: int) -> int:
    """The request's scheduling priority: vLLM's X-Vllm-Priority header (an integer) where sent, else the body's."""
    raw = headers.get("x-vllm-priority")
    if raw is None:
        return given
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not -(2**63) <= value < 2**63:
        raise InvalidRequest(
            f"the X-Vllm-Priority header must be a 64-bit integer (got {shown(raw)})", param="priority"
        )
    return value


def _prompt_param(i: int, count: int) -> str:
    """How an error names prompt i of `count`: "prompt" for a single one, "prompt.<i>" in a batch."""
    return "prompt" if count == 1 else f"prompt.{i}"


async def _naming_prompt(awaitable, i: int, count: int, field: str = "prompt"):
    """`awaitable`'s result; an error about its prompt names prompt i of a batch (`_prompt_param`), or the request's
    own `field` that holds the prompts (embeddings' `input`, `input.<i>`)."""
    try:
        return await awaitable
    except InvalidRequest as e:
        if e.param != "prompt" or (count == 1 and field == "prompt"):
            raise
        if count == 1:
            raise InvalidRequest(str(e), param=field) from e
        raise InvalidRequest(f"{field} {i}: {e}", param=f"{field}.{i}") from e


async def _last(stream):
    """A stream's last output (an embedding request's one)."""
    last = None
    async for out in stream:
        last = out
    return last


def _usage(lasts: list, n: int, choices: list) -> tuple[int, int, int, int | None]:
    """A request's usage from its choices' last engine outputs, `n` per prompt, prompt by prompt: (prompt tokens,
    completion tokens, cached tokens, reasoning tokens), each prompt counted once (its first choice's), every choice's
    tokens; reasoning tokens None unless the choices' replies are read for reasoning (`_Choice.reasoning`)."""
    firsts = lasts[::n]
    counts = [c.reasoning.finish() for c in choices if c.reasoning is not None]
    return (
        sum(o.num_prompt_tokens for o in firsts),
        sum(o.num_output_tokens for o in lasts),
        sum(o.num_cached_tokens for o in firsts),
        sum(counts) if counts else None,
    )


def _choice_params(params, k: int):
    """Choice k's sampling parameters: the request's, with a given seed moved on by k (the choices then differ, and
    each is reproducible)."""
    if k == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + k)


async def _all(awaitables: list) -> list:
    """Await them together; their results in order. The first to fail cancels the others and its error is raised;
    a cancelled caller (a timeout, a client gone) cancels them all."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _interleave(parts: list):
    """The items of several async iterators as each comes (in the iterators' order when several are ready)."""
    ahead = {asyncio.ensure_future(part.__anext__()): k for k, part in enumerate(parts)}
    try:
        while ahead:
            done, _ = await asyncio.wait(ahead, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=ahead.__getitem__):
                k = ahead.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                ahead[asyncio.ensure_future(parts[k].__anext__())] = k
                yield item
    finally:
        for future in ahead:
            future.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)


async def _chain(first, stream):
    yield first
    if first.finished:
        return
    async for out in stream:
        yield out


def _key_of(headers: dict[str, str]) -> str:
    """The API key a request sends: `Authorization: Bearer <key>` (OpenAI's clients), else `x-api-key` (Anthropic's);
    "" where it sends none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()
