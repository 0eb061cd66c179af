"""A `Deployment` spec in, a Ray Serve application out: the OpenAI-compatible API over the engine.

    app = build_app(spec)                      # like ray.serve.llm's build_openai_app(LLMConfig)
    serve.run(app, name=spec.name, route_prefix=spec.http.route_prefix)
    url = pylon.sdk.serve.deploy(spec)         # the same, from a client; returns the base URL

Each replica owns one engine (the model, its KV cache and its step loop, in a child process by default) and
answers HTTP itself (`@serve.ingress` over a plain ASGI app, `OpenAIApp`): a router deployment relaying requests
would add a hop per streamed token for nothing. With prefix caching on and more than one replica, HAProxy asks
`<name>-router` which replica takes each request (once, before it sends it there: pylon.serving.api.routing).

    POST /v1/completions   POST /v1/chat/completions   POST /v1/responses   POST /v1/messages
    POST /v1/embeddings   POST /v1/rerank   POST /v1/score   POST /classify   POST /pooling
    GET /v1/models   POST /tokenize   POST /detokenize   GET /health   GET /ready   GET /openapi.json

Admission: Serve routes up to `max_num_seqs + 2 * max_queued_requests` requests to a replica; the replica
answers 429 with Retry-After once `max_queued_requests` are already waiting for the engine. Every error is
OpenAI's JSON error object. API keys: the spec names an environment variable (read where `build_app` runs, or
on the client that deploys through Serve's REST API); the replicas receive only salted scrypt hashes, as the
deployment's `user_config`, so no key is in the Serve config, the dashboard or a log, and changing the keys is an
in-place `reconfigure` of the running replicas (`pylon.serving.api.keys`).
"""

from __future__ import annotations

from pylon.serving.api import slo
from pylon.serving.api.keys import api_keys_config
from pylon.serving.api.protocol import new_id
from pylon.serving.api.server import PylonLLMServer
from pylon.specs import DeploymentSpec


def _ingress_class():
    from ray import serve

    return serve.ingress()(PylonLLMServer)


LLMServerDeployment = _ingress_class()


_FROM_ENV = object()


def build_app(spec: DeploymentSpec, *, api_keys: dict | None | object = _FROM_ENV):
    """The Serve application for `spec` (not yet running): pass it to `serve.run`. `api_keys`: the stored form of
    the keys (`keys.hash_keys`), None for none here (a client's REST deploy overrides the deployment's
    `user_config` with them), or by default read from this process's environment."""
    from ray import serve

    keys = api_keys_config(spec) if api_keys is _FROM_ENV else api_keys
    http = spec.http
    autoscaling = autoscaling_config(spec.autoscaling)
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
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
        user_config={"api_keys": keys, "revision": new_id("rev")},
        **placed(spec, spec.replica),
    )
    prefill = prefill_deployment(spec)
    if not routes_by_prefix(spec):
        return deployment.bind(spec.model_dump(mode="json"), prefill=prefill)
    from ray.serve.config import RequestRouterConfig

    from pylon.serving.api.routing import HEALTH_CHECK_PERIOD_S, ROUTING_STATS_PERIOD_S, PylonRouter

    server = deployment.options(
        request_router_config=RequestRouterConfig(
            request_router_class="pylon.serving.api.request_router.PrefixAffinityRouter",
            request_router_kwargs={"capacity": running},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        # Serve's controller collects routing stats at health checks: these pace the router's view of the caches.
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    ).bind(spec.model_dump(mode="json"), prefill=prefill)
    router = serve.deployment(
        serve.ingress()(PylonRouter),
        name=f"{spec.name}-router",
        num_replicas=1,
        max_ongoing_requests=1000,  # on the path of every request, and each call is short: never the bottleneck
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
    ).bind(server, spec.model_dump(mode="json"))
    # Ray Serve's hook for an ingress request router (internal to Ray 2.60; Ray Serve LLM's router uses it).
    return server._with_ingress_request_router(router)


def autoscaling_config(a) -> dict:
    """Serve's autoscaling_config of an AutoscalingSpec (the deployment's, or its prefill replicas')."""
    config = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
    }
    if a.initial_replicas is not None:
        config["initial_replicas"] = a.initial_replicas
    policy = slo.policy_config(a.target_ttft_ms, a.target_itl_ms)
    if policy is not None:  # on the replicas' latencies too (pylon.serving.api.slo)
        config["policy"] = policy
    return config


def placed(spec: DeploymentSpec, replica) -> dict:
    """A deployment's options that place each replica of `replica`'s resources: its Ray actor options, and a split
    model's placement group (`pipeline_placement`); `replica.labels` select its node, or every bundle's node."""
    options = {"ray_actor_options": {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus}}
    placement = pipeline_placement(spec.model_copy(update={"replica": replica}))
    options.update(placement)
    if replica.labels and placement:  # (the replica runs in its group's first bundle: each bundle's node labelled)
        options["placement_group_bundle_label_selector"] = [dict(replica.labels)] * len(
            placement["placement_group_bundles"]
        )
    elif replica.labels:
        options["ray_actor_options"]["label_selector"] = dict(replica.labels)
    return options


def prefill_deployment(spec: DeploymentSpec):
    """The deployment's prefill replicas (`prefill`; pylon.serving.api.prefill), bound, for its decoding replicas to
    call: `<name>-prefill`, `prefill.replicas` of them or as many as `prefill.autoscaling` keeps, each the
    deployment's engine, placed by `prefill.replica` (or `replica`), a split model's parts in placement groups as the
    decoding replicas'. Where more than one may run, the decoding replicas' calls are routed by the prompts' prefixes
    the prefill replicas cache (PrefixAffinityRouter in each decoding replica's handle). None without `prefill`."""
    if spec.prefill is None:
        return None
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pylon.serving.api.prefill import PylonPrefillServer
    from pylon.serving.api.routing import HEALTH_CHECK_PERIOD_S, ROUTING_STATS_PERIOD_S

    p = spec.prefill
    slots = spec.engine.data_parallel * spec.engine.max_num_seqs  # a prefill replica's running prompts, all engines'
    if p.autoscaling is None:
        options = {"num_replicas": p.replica_range()[0]}
    else:
        options = {"autoscaling_config": autoscaling_config(p.autoscaling)}
    if p.replica_range()[1] > 1:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="pylon.serving.api.request_router.PrefixAffinityRouter",
            request_router_kwargs={"capacity": slots},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    return serve.deployment(
        PylonPrefillServer,
        name=f"{spec.name}-prefill",
        # its engines' running batch and as many again waiting: a prompt is one step or a few, so they turn over
        # fast; past that, Serve's queue holds the calls (their callers time out to computing prompts themselves)
        max_ongoing_requests=2 * slots,
        # (Serve's controller collects routing stats at health checks: these pace the routers' view of the caches)
        health_check_period_s=HEALTH_CHECK_PERIOD_S if "request_router_config" in options else 5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
        **options,
        **placed(spec, spec.prefill_replica()),
    ).bind(spec.model_dump(mode="json"))


PLACEMENT_STRATEGIES = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK"}


def pipeline_placement(spec: DeploymentSpec) -> dict:
    """A replica of a model split into pipeline stages (engine.pipeline_parallel) or tensor-parallel shards
    (engine.tensor_parallel): a placement group of one bundle a stage (shard), each the replica's resources, the
    replica (and its engine, stage or shard 1) in the first and the other stages' (shards') actors in the rest
    (pylon.serving.engine.pipeline, .tensor); stages placed by engine.pipeline_placement, shards all on one node
    (STRICT_PACK). Both: a bundle a stage, as many times the replica's resources as it has shards (a bundle is on
    one node: a stage's shards share it, each its share), placed by engine.pipeline_placement. Nothing otherwise."""
    stages, shards = spec.engine.pipeline_parallel, spec.engine.tensor_parallel
    if stages == shards == 1:
        return {}
    each = shards if stages > 1 else 1  # (a stage's shards in its bundle; shards alone, a bundle each)
    bundle = {"CPU": spec.replica.num_cpus * each, "GPU": spec.replica.num_gpus * each}
    bundle = {k: v for k, v in bundle.items() if v}
    strategy = PLACEMENT_STRATEGIES[spec.engine.pipeline_placement] if stages > 1 else "STRICT_PACK"
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(stages if stages > 1 else shards)],
        "placement_group_strategy": strategy,
    }


def routes_by_prefix(spec: DeploymentSpec) -> bool:
    """Whether the application gets Pylon's prefix-aware router (pylon.serving.api.routing): prefix caching is on,
    more than one replica may run, and Serve's ingress is HAProxy (read where the application is built: the
    driver of `serve.run`, or Serve's controller for a deploy through the REST API)."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    return spec.engine.enable_prefix_caching and spec.autoscaling.max_replicas > 1 and bool(RAY_SERVE_ENABLE_HA_PROXY)


def app_builder(args: dict):
    """Serve's application builder: a Deployment spec as `args` (a RayService's serveConfigV2, as
    `pylon infra render` writes it, or `serve run pylon.serving.api.builder:app_builder --config-file ...`; its
    API keys are read from the environment here), or `{"spec": ...}` as a client's `pylon.sdk.serve.deploy`
    sends it through Serve's REST API, with the keys' hashes as the deployment's `user_config` beside it in the
    application's config (the keys stayed on the client; a change of keys alone does not rebuild the app)."""
    if set(args) == {"spec"}:
        return build_app(DeploymentSpec.model_validate(args["spec"]), api_keys=None)
    return build_app(DeploymentSpec.model_validate(args))
