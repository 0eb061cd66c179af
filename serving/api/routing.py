"""Routing across replicas that keeps prefix caches warm: a request goes to the replica whose engines hold the longest
cached prefix of its prompt, by the blocks they really cache, unless that replica is busy; then the least loaded
takes it (and its prefix, from then on).

    client -> HAProxy -(body)-> PylonRouter /internal/route -> PrefixAffinityRouter -> {"host", "port", "replica_id"}
           -> HAProxy -> that replica's own HTTP port (the request itself, streamed; no router hop per token)

The pieces, in the order a request meets them:

- **HAProxy** (Serve's ingress on every cluster Pylon starts) calls the application's *ingress request router* with
  each POST's body before it picks a backend (Ray Serve's hook for this, the one Ray Serve LLM's own router uses,
  internal to Ray 2.60: `Application._with_ingress_request_router`). `pylon-haproxy` adds the router key to that
  call (pylon.infra.haproxy), and `RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1` (pylon.infra.common) makes
  HAProxy send the body at all.
- **PylonRouter** (a deployment of its own, `<name>-router`, no CPU reserved) checks the key, renders the prompt
  exactly as a replica does (the chat template, the model's tokenizer), hashes its full blocks with the engine's
  own chained hash (`kv_cache.block_hashes`) and asks the deployment's request router to pick.
- **PrefixAffinityRouter** (the LLM deployment's `request_router_class`, pylon.serving.api.request_router, run
  inside PylonRouter's handle; its decision is `rank` and `choose` here) scores
  each replica by how many of the prompt's first blocks it holds: each replica reports the hashes of every block its
  engines hold cached (8 bytes each) and its load every `ROUTING_STATS_PERIOD_S` (`PylonLLMServer.
  record_routing_stats`, through Serve's controller). Between two reports it also counts what it has routed itself:
  requests sent to a replica since its last report add to its load, and their blocks count as that replica's (they
  are being computed there), so a burst of one prefix lands on one replica before any report says so.
  Busy: a replica's requests fill its engines' sequence slots (`data_parallel x max_num_seqs`); a busy holder
  loses the request to the least loaded replica, which then computes (and caches) the prefix too.

Without HAProxy (RAY_SERVE_ENABLE_HA_PROXY=0), or with prefix caching off, or one replica at most, there is nothing
to route by and no router is built; Serve's own balancing applies.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import re
import time
import uuid
from dataclasses import dataclass, field

from pylon.serving.api.http import lifespan, read_body, request_headers, route_path, send_json
from pylon.serving.engine.kv_cache import block_hashes, cache_salt

log = logging.getLogger("pylon.serving")

# The request header HAProxy sets from the router's answer (Serve's `x-serve-router-` namespace: HAProxy drops any a
# client sends), and the response header a replica echoes it in: how the request was routed.
ROUTE_REQUEST_HEADER = "x-serve-router-pylon-route"
ROUTE_RESPONSE_HEADER = "X-Pylon-Route"
STATS_KEY = "pylon_prefix"  # the entry of a replica's routing stats this module reads
HASH_BYTES = 8  # of each block hash a replica reports (the first 8 of the engine's 16): 2^-64 collisions per pair
ROUTING_STATS_PERIOD_S = 1.0  # at most this often (Serve's request_routing_stats_period_s)
# How long a routed request's blocks count as its replica's without a report saying so. Serve's controller pulls a
# replica's report at its health checks (every HEALTH_CHECK_PERIOD_S), and asks for the next one then: a report is
# at most two periods old.
HEALTH_CHECK_PERIOD_S = 2.0
RECENT_S = 10.0
GRACE_S = 0.1  # how long a routed request counts toward its replica's load beside the probe's count (it is on its way)
PROBE_ALL_UP_TO = 16  # replicas: with more, the probe asks the likeliest holders and two at random


@dataclass(frozen=True)
class RoutingKey:
    """What a request is routed by: its prompt's full-block hashes (first `HASH_BYTES` bytes each, in order), the
    tag of the replica that made the response it continues (`response_replica`: a Responses request's
    previous_response_id), and an id under which the decision leaves what decided it (`decision`)."""

    hashes: tuple[bytes, ...] = ()
    id: int = field(default_factory=lambda: next(_KEY_IDS))
    replica: str = ""


# A response made by a replica under Serve carries the replica's tag in its id (`response_id`), so that a request
# continuing it (previous_response_id) goes back to the replica that holds its conversation's blocks: the router never
# sees the stored conversation (it has no API key to read it by), only the id. An id without a tag is a 32-hex uuid.
TAG_LENGTH = 8
_TAGGED = re.compile(r"^resp_p([0-9a-f]{%d})[0-9a-f]{32}$" % TAG_LENGTH)


def replica_tag(unique_id: str) -> str:
    """The tag of a Serve replica (its replica id's unique part), in its responses' ids."""
    return hashlib.blake2b(unique_id.encode(), digest_size=TAG_LENGTH // 2).hexdigest()


def response_id(tag: str) -> str:
    """A new response id (resp_...) that names the replica of `tag` ("": none, outside Serve)."""
    return f"resp_p{tag}{uuid.uuid4().hex}" if tag else f"resp_{uuid.uuid4().hex}"


def response_replica(response_id: object) -> str:
    """The tag of the replica that made `response_id` ("" for an id without one)."""
    found = _TAGGED.match(response_id) if isinstance(response_id, str) else None
    return found.group(1) if found else ""


_KEY_IDS = itertools.count()
# Key id -> what decided its route: "response" (the replica that made the response it continues), "prefix:N" (the
# replica holding its first N blocks) or "load" (the least loaded replica). Written by `rank` in the handle's routing
# thread, taken by PylonRouter (the key it sees there is a copy).
_DECISIONS: dict[int, str] = {}


def decision(key: RoutingKey) -> str:
    return _DECISIONS.pop(key.id, "load")


def replica_stats(engine, spec) -> dict:
    """A replica's routing stats (its `record_routing_stats`, decoding or prefill): the hashes of the blocks its
    engines hold cached, and its engines' sequence slots. No timestamp: a report equal to the last is no change, so
    Serve re-sends nothing to the handles."""
    return {
        STATS_KEY: {
            "blocks": short_hashes(engine.cached_block_hashes()),
            "capacity": spec.engine.data_parallel * spec.engine.max_num_seqs,
        }
    }


def short_hashes(hashes) -> bytes:
    """A replica's report of its cached blocks: their hashes' first `HASH_BYTES` bytes, one after another."""
    return b"".join(h[:HASH_BYTES] for h in hashes)


def routing_key(
    tokenizer,
    block_size: int,
    body: dict | None,
    adapters: frozenset[str] = frozenset(),
    *,
    base: str | None = None,
) -> RoutingKey:
    """The key of a request body (parsed JSON), rendered and tokenized as a replica renders it for its engine; for a
    batch of prompts (completions), the blocks every prompt of it starts with (a few-shot preamble, an evaluation's
    shared context): those are what its engine requests reuse. Any body a replica would refuse, or that names no
    prompt, routes by load alone (the replica answers the 4xx). `adapters`: the LoRA adapters' names; `base`: the
    base model's, when every other name is an adapter (engine.dynamic_adapters)."""
    from pylon.serving.api import protocol
    from pylon.serving.engine.tokenization import prompt_ids

    if not isinstance(body, dict):
        return RoutingKey()
    # A LoRA adapter's request (`model` names one of engine.adapters): its blocks are hashed apart, as its engine's.
    model = body.get("model")
    adapter = model in adapters or (base is not None and isinstance(model, str) and model != base)
    request_salt = body.get("cache_salt")  # a request's own salt (vLLM's cache_salt) names its blocks apart too
    salt = cache_salt(model if adapter else None, request_salt if isinstance(request_salt, str) else None)
    replica = ""
    try:
        if body.get("chat_template") is not None:
            return RoutingKey()  # the router renders no request's own template: by load (the replica may refuse it)
        if "messages" in body:
            try:
                request = protocol.ChatCompletionRequest.model_validate(body)
            except ValueError:  # Anthropic's Messages API: its chat request (pylon.serving.api.anthropic)
                from pylon.serving.api.anthropic import MessagesRequest

                request = MessagesRequest.model_validate(body).chat()
            prompts = [request.render(tokenizer)]  # as the replica renders it, tools included
        elif "input" in body:  # the Responses API: its chat request, rendered as the replica renders it
            from pylon.serving.api.responses import ResponsesRequest

            replica = response_replica(body.get("previous_response_id"))
            request = ResponsesRequest.model_validate(body).chat()
            prompts = [request.render(tokenizer)]
        elif "prompt" in body:
            request = protocol.CompletionRequest.model_validate(body)
            prompts = request.prompts()
            if request.suffix is not None:  # fill in the middle: the prompt the replica builds
                from pylon.serving.engine.tokenization import fim_ids

                prompts = [fim_ids(tokenizer, p, request.suffix, request.add_special_tokens) for p in prompts]
            if len(prompts) > protocol.MAX_BATCH_CHOICES:
                return RoutingKey()  # the replica refuses it
        else:
            return RoutingKey()
        keys = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = prompt_ids(tokenizer, prompt, request.add_special_tokens)
            elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                ids = list(prompt)
            else:
                return RoutingKey()
            # The engine always computes a prompt's last token (kv_cache: the same cut as the scheduler's lookup).
            keys.append(block_hashes(ids[: len(ids) - 1], block_size, [], salt))
    except Exception:  # invalid for the replica too, which says why
        return RoutingKey(replica=replica)
    # Chained hashes: equal at position n means equal prompts up to there, so the common prefix of the hash lists.
    return RoutingKey(tuple(h[:HASH_BYTES] for h in os.path.commonprefix(keys)), replica=replica)


# -- the policy --------------------------------------------------------------------------------------------------


@dataclass
class ReplicaView:
    """What the router knows of one replica: its cache as last reported, its requests as last probed, and what it
    routed there itself."""

    blocks: frozenset = frozenset()  # short hashes of the blocks its engines hold cached, as last reported
    capacity: int = 1  # sequence slots of its engines: past this, a new request waits
    reported: bytes | None = None  # the last report's blocks, as sent (a report that repeats it changes nothing)
    ongoing: int = 0  # requests at the replica when last probed (Serve's queue-length probe: live)
    sent: list = field(default_factory=list)  # monotonic times of requests routed here in the last GRACE_S
    recent: dict = field(default_factory=dict)  # short hash -> until when it counts as this replica's (monotonic)

    def load(self, now: float) -> int:
        """Its requests: those the probe counted, and those routed here so lately that the probe may have missed
        them (HAProxy sends a request on only once its route is answered)."""
        self.sent = [t for t in self.sent if t > now - GRACE_S]
        return self.ongoing + len(self.sent)

    def busy(self, now: float) -> bool:
        return self.load(now) >= self.capacity

    def cached_prefix(self, key: RoutingKey, now: float) -> int:
        n = 0
        for h in key.hashes:
            if h not in self.blocks and self.recent.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def update(self, stats: dict | None) -> None:
        """Take a replica's routing stats (`PylonLLMServer.record_routing_stats`) if they are new."""
        if not stats:
            return
        self.capacity = max(1, int(stats.get("capacity", 1)))
        blob = stats.get("blocks") or b""
        if blob == self.reported:
            return
        self.blocks = frozenset(blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES))
        self.reported = blob
        now = time.monotonic()
        self.recent = {h: until for h, until in self.recent.items() if until > now and h not in self.blocks}

    def routed(self, key: RoutingKey, now: float) -> None:
        self.sent.append(now)
        until = now + RECENT_S
        for h in key.hashes:
            if h not in self.blocks:
                self.recent[h] = until


def choose(views: dict, key: RoutingKey, now: float, rng: random.Random = random) -> tuple[list, str]:
    """The replica ids of `views` in the order to try them, and what decided: first the replica that made the
    response `key` continues ("response"), unless it is gone or busy; else the one holding the longest cached prefix
    of `key` (fewest requests among equals; "prefix:N") unless it holds none or is busy; then the rest, least loaded
    first (ties in random order, so that equal replicas share the work; "load")."""
    ids = list(views)
    rng.shuffle(ids)
    by_load = sorted(ids, key=lambda r: views[r].load(now))
    if key.replica:
        maker = next((r for r in ids if replica_tag(getattr(r, "unique_id", str(r))) == key.replica), None)
        if maker is not None and not views[maker].busy(now):
            return [maker, *(r for r in by_load if r != maker)], "response"
    if key.hashes:
        holder = max(ids, key=lambda r: (views[r].cached_prefix(key, now), -views[r].load(now)))
        held = views[holder].cached_prefix(key, now)
        if held > 0 and not views[holder].busy(now):
            return [holder, *(r for r in by_load if r != holder)], f"prefix:{held}"
    return by_load, "load"


def key_of(pending_request) -> RoutingKey | None:
    """The RoutingKey a request was sent to the handle with (PylonRouter's), or None."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RoutingKey) else None


def views_of(views: dict, live_ids, candidate_replicas, capacity: int) -> dict:
    """`views` (ReplicaView by replica id, the router's state) brought up to date with the replicas' latest routing
    stats, without replicas that are gone; returns those of `candidate_replicas`. `capacity`: a replica's sequence
    slots until its first report says."""
    current = {}
    for replica in candidate_replicas:
        view = views.setdefault(replica.replica_id, ReplicaView(capacity=capacity))
        view.update(replica.routing_stats.get(STATS_KEY))
        current[replica.replica_id] = view
    for gone in set(views) - set(live_ids):
        del views[gone]
    return current


def to_probe(current: dict, key: RoutingKey, candidate_replicas, most: int = PROBE_ALL_UP_TO) -> list:
    """Whose requests to count live: every candidate when there are few, else the two holding the longest prefix of
    `key` and two others at random (power of two choices)."""
    if len(candidate_replicas) <= most:
        return list(candidate_replicas)
    now = time.monotonic()
    ranked = sorted(candidate_replicas, key=lambda r: -current[r.replica_id].cached_prefix(key, now))
    return ranked[:2] + random.sample(ranked[2:], 2)


def rank(current: dict, key: RoutingKey, candidate_replicas, probed: dict) -> list:
    """PrefixAffinityRouter's decision (pylon.serving.api.request_router): `candidate_replicas` in the order to try
    them. `probed`: replica id -> requests it has now (Serve's queue-length probe; unanswered ones are left out)."""
    now = time.monotonic()
    views = {}
    for replica in candidate_replicas:
        view = current[replica.replica_id]
        if replica.replica_id in probed:
            view.ongoing = probed[replica.replica_id]
        views[replica.replica_id] = view
    by_id = {r.replica_id: r for r in candidate_replicas}
    # Replicas left unprobed (many replicas) stay out of the running unless nothing else answered.
    pool = {rid: v for rid, v in views.items() if rid in probed} or views
    order, why = choose(pool, key, now)
    views[order[0]].routed(key, now)
    if len(_DECISIONS) > 10_000:  # a caller that never took its decision (cancelled): forget the oldest
        _DECISIONS.pop(next(iter(_DECISIONS)))
    _DECISIONS[key.id] = why
    return [by_id[rid] for rid in order]


# -- the ingress request router deployment -----------------------------------------------------------------------


class PylonRouter:
    """`<name>-router`: HAProxy's `/internal/route` for a deployment (see the module's docstring). It holds the
    model's tokenizer (its files only, copied from object storage if need be), no weights."""

    def __init__(self, server, spec: dict):
        from pylon.home import router_key
        from pylon.models import local_model_dir
        from pylon.serving.engine.tokenization import load_model_tokenizer
        from pylon.specs import DeploymentSpec

        spec = DeploymentSpec.model_validate(spec)
        self.name = spec.name
        self.block_size = spec.engine.block_size
        self.adapters = frozenset(a.name for a in spec.engine.adapters)
        # With adapters loaded on demand, any name but the deployment's is one.
        self.base = spec.name if spec.engine.dynamic_adapters.root is not None else None
        with local_model_dir(spec.model, weights=False) as directory:
            self.tokenizer = load_model_tokenizer(directory)
        self._key = router_key()
        self._handle = server
        self._warned_empty = False

    def authorized(self, headers: dict[str, str]) -> bool:
        import hmac

        from pylon.home import ROUTER_KEY_HEADER

        return self._key is None or hmac.compare_digest(headers.get(ROUTER_KEY_HEADER.lower(), ""), self._key)

    async def route(self, body: bytes) -> tuple[int, dict]:
        """(status, JSON body) for one routing call: 200 with the replica's host, port and id."""
        from ray.serve.exceptions import DeploymentUnavailableError

        if not body and not self._warned_empty:
            self._warned_empty = True
            log.warning(
                "%s router: HAProxy sent no request body, so requests are routed by load alone; set "
                "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 on the cluster's nodes",
                self.name,
            )
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        key = routing_key(self.tokenizer, self.block_size, parsed, self.adapters, base=self.base)
        try:
            async with self._handle.choose_replica(key, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    return 503, {"error": f"replica {selection.replica_id} has no HTTP port yet"}
                host, port = endpoint
                return 200, {
                    "host": host,
                    "port": port,
                    "replica_id": replica.replica_id.to_full_id_str(),
                    # HAProxy sets these on the request it sends the replica (Serve's router response contract).
                    "request_headers": {ROUTE_REQUEST_HEADER: decision(key)},
                }
        except (RuntimeError, DeploymentUnavailableError) as e:
            return 503, {"error": str(e)}

    def __serve_build_asgi_app__(self):
        return _RouterApp(self)


class _RouterApp:
    """PylonRouter's HTTP API: `POST /internal/route` (HAProxy) and `GET /health`, both behind the router key (a
    request without it is a 401 whatever its path: the port listens on the node's address)."""

    def __init__(self, router: PylonRouter):
        self.router = router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] != "http":
            return
        from pylon.home import ROUTER_KEY_HEADER

        path, method = route_path(scope), scope["method"]
        if not self.router.authorized(request_headers(scope)):
            status, obj = 401, {"error": f"{ROUTER_KEY_HEADER} is missing or wrong: only the cluster's HAProxy routes"}
        elif path == "/internal/route" and method == "POST":
            status, obj = await self.router.route(await read_body(receive))
        elif path == "/health" and method == "GET":
            status, obj = 200, {"status": "ok"}
        else:
            status, obj = 404, {"error": f"no route {method} {path}: this is {self.router.name}'s request router"}
        await send_json(send, status, obj)
