"""A `Deployment` spec in, a Ray Serve application out: the OpenAI-compatible API over the engine.

    app = build_app(spec)                      # like ray.serve.llm's build_openai_app(LLMConfig)
    serve.run(app, name=spec.name, route_prefix=spec.http.route_prefix)
    url = pylon.sdk.serve.deploy(spec)         # the same, from a client; returns the base URL

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

from pylon.serving.api.http import api_key_digests
from pylon.serving.api.server import PylonLLMServer
from pylon.specs import DeploymentSpec


def _ingress_class():
    from ray import serve

    return serve.ingress()(PylonLLMServer)


LLMServerDeployment = _ingress_class()


def build_app(spec: DeploymentSpec, *, key_digests: list[str] | None = None):
    """The Serve application for `spec` (not yet running): pass it to `serve.run`."""
    from ray import serve

    digests = api_key_digests(spec) if key_digests is None else key_digests
    a, http = spec.autoscaling, spec.http
    autoscaling = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
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
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
    )
    return deployment.bind(spec.model_dump(mode="json"), digests)


def app_builder(args: dict):
    """Serve's application builder: a Deployment spec as `args` (a RayService's serveConfigV2, as
    `pylon infra render` writes it, or `serve run pylon.serving.api.builder:app_builder --config-file ...`; its
    API keys are read from the environment here), or `{"spec": ..., "key_digests": [...]}` as a client's
    `pylon.sdk.serve.deploy` sends it through Serve's REST API (the keys stayed on the client)."""
    if set(args) == {"spec", "key_digests"}:
        return build_app(DeploymentSpec.model_validate(args["spec"]), key_digests=list(args["key_digests"]))
    return build_app(DeploymentSpec.model_validate(args))
