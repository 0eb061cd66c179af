"""A deployment's `prefill` as Serve sees it (pylon.serving.api.builder, pylon.serving.api.prefill): the prefill
replicas' deployment beside the decoding one, placed by their own resources and node labels, handed to every
decoding replica; and what a prefill replica is asked to run. The blocks' way end to end: test_kv_transfer.py (the
engines), tests/integration/test_serving_prefill.py (through Serve), test_hosts.py (across two machines)."""

from __future__ import annotations

from pylon.serving.api.builder import build_app, prefill_deployment
from pylon.serving.api.prefill import prefill_params
from pylon.serving.api.routing import HEALTH_CHECK_PERIOD_S
from pylon.serving.engine.sampling import SamplingParams
from pylon.specs import DeploymentSpec


def _spec(**fields) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "m", "model": "s3://b/m", **fields})


def test_the_prefill_replicas_are_a_deployment_of_their_own_handed_to_every_decoding_replica() -> None:
    spec = _spec(
        engine={"tensor_parallel": 2, "max_num_seqs": 8},
        replica={"num_cpus": 2, "labels": {"pool": "decode"}},
        prefill={"replicas": 3, "replica": {"num_cpus": 4, "labels": {"pool": "prefill"}}},
    )
    prefill = prefill_deployment(spec)._bound_deployment
    assert (prefill.name, prefill.num_replicas, prefill.max_ongoing_requests) == ("m-prefill", 3, 16)
    assert prefill.ray_actor_options == {"num_cpus": 4, "num_gpus": 0}
    # each prefill replica's shards in a placement group of its own resources, as a decoding replica's are of its, on
    # nodes of its labels (each bundle's: the replica runs in the first)
    config = prefill._replica_config
    assert config.placement_group_bundles == [{"CPU": 4}] * 2
    assert config.placement_group_bundle_label_selector == [{"pool": "prefill"}] * 2
    decoding = build_app(spec, api_keys=None)._bound_deployment
    config = decoding._replica_config
    assert decoding.name == "m" and config.placement_group_bundle_label_selector == [{"pool": "decode"}] * 2
    assert config.placement_group_bundles == [{"CPU": 2}] * 2
    assert decoding.init_kwargs["prefill"]._bound_deployment.name == "m-prefill"
    # a replica of one process: its own node's labels
    whole = prefill_deployment(_spec(prefill={"replica": {"num_cpus": 1, "labels": {"pool": "prefill"}}}))
    assert whole._bound_deployment.ray_actor_options["label_selector"] == {"pool": "prefill"}


def test_prefill_replicas_may_scale_and_where_several_may_run_prompts_go_to_the_one_caching_their_prefix() -> None:
    scaled = _spec(
        engine={"data_parallel": 2, "max_num_seqs": 4},
        prefill={"autoscaling": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2}},
    )
    prefill = prefill_deployment(scaled)._bound_deployment
    config = prefill._deployment_config
    assert config.autoscaling_config.min_replicas == 1 and config.autoscaling_config.max_replicas == 3
    assert config.autoscaling_config.initial_replicas == 2
    assert (config.autoscaling_config.target_ongoing_requests, config.autoscaling_config.upscale_delay_s) == (4, 2)
    assert config.max_ongoing_requests == 16  # (its engines' 2 x 4 slots, and as many again waiting)
    router = config.request_router_config
    assert router.request_router_class.endswith("request_router.PrefixAffinityRouter")
    assert router.request_router_kwargs == {"capacity": 8}
    assert config.health_check_period_s == HEALTH_CHECK_PERIOD_S  # (routing stats are collected at health checks)
    # Several fixed ones are routed alike; one alone is not routed at all
    fixed = prefill_deployment(_spec(prefill={"replicas": 2}))._bound_deployment._deployment_config
    assert fixed.request_router_config.request_router_class.endswith("PrefixAffinityRouter")
    assert fixed.autoscaling_config is None and fixed.num_replicas == 2
    one = prefill_deployment(_spec(prefill={}))._bound_deployment._deployment_config
    assert "PrefixAffinityRouter" not in one.request_router_config.request_router_class


def test_without_prefill_there_is_no_prefill_deployment_and_a_prefill_replica_takes_the_deployments_replica() -> None:
    assert prefill_deployment(_spec()) is None
    assert build_app(_spec(), api_keys=None)._bound_deployment.init_kwargs == {"prefill": None}
    same = prefill_deployment(_spec(replica={"num_cpus": 3}, prefill={}))._bound_deployment
    assert same.ray_actor_options == {"num_cpus": 3, "num_gpus": 0} and same.num_replicas == 1


def test_a_prefill_replica_runs_one_greedy_token_reading_the_prompt_as_the_decoding_engine_does() -> None:
    asked = SamplingParams(
        max_tokens=300,
        temperature=0.8,
        logprobs=3,
        stop=["\n"],
        add_special_tokens=True,
        truncate_prompt_tokens=100,
        truncation_side="right",
        adapter="sql",
        cache_salt="tenant-7",
        priority=-2,
        guide={"type": "json_object"},
    )
    run = prefill_params(asked, first_block=5)
    assert (run.max_tokens, run.temperature, run.logprobs, run.stop, run.guide) == (1, 0, None, [], None)
    assert (run.add_special_tokens, run.truncate_prompt_tokens, run.truncation_side) == (True, 100, "right")
    assert (run.adapter, run.cache_salt, run.priority, run.kv_export_from) == ("sql", "tenant-7", -2, 5)
