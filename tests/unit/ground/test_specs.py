"""pylon.specs: the spec models, YAML loading, and error messages that point at file, line, document and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from spec_texts import (
    CLUSTER,
    DATASET,
    DEPLOY,
    DESIGN_YAML,
    EXAMPLES,
    NAME_MSG,
    TRAIN,
    one_problem,
    problems,
    train_error,
)

from pylon.errors import SpecError
from pylon.presets import MODEL_PRESETS
from pylon.specs import (
    ClusterSpec,
    DatasetSpec,
    DataSpec,
    DeepSpeedSpec,
    DeploymentSpec,
    ModelSpec,
    TrainJobSpec,
    load_spec,
    load_specs,
    parse_specs,
    spec_errors,
    to_yaml,
)

# ---------------------------------------------------------------------------------------------------------
# Valid specs load with the right values and defaults
# ---------------------------------------------------------------------------------------------------------


def test_stdlib_example_loads_three_documents_with_values_and_defaults() -> None:
    path = EXAMPLES / "stdlib-gpt.yaml"
    docs = load_specs(path)
    assert [(d.source, d.index, d.line, type(d.spec)) for d in docs] == [
        (str(path), 1, 2, DatasetSpec),
        (str(path), 2, 12, TrainJobSpec),
        (str(path), 3, 25, DeploymentSpec),
    ]
    ds, train, deploy = (d.spec for d in docs)

    assert (ds.name, ds.sources, ds.output, ds.format, ds.seq_len, ds.tokenizer) == (
        "stdlib-corpus",
        ["stdlib"],
        "demo/corpus/",
        "parquet",
        256,
        "demo/tokenizer.json",
    )
    assert (ds.include, ds.exclude[-3:]) == ("*.py", ["idle_test", "encodings", "pydoc_data"])
    assert ds.shard_size_mb == 64.0  # default

    assert train.name == "stdlib-gpt"
    assert (train.model.preset, train.model.config, train.model.path) == ("gpt-small", None, None)
    assert (train.data.uri, train.data.seq_len, train.data.shuffle_seed) == ("demo/corpus/", 256, 0)
    assert (train.data.shuffle_buffer, train.data.validation_fraction, train.data.on_bad_shard) == (1024, 0.0, "error")
    sc, dsp = train.scaling, train.deepspeed
    assert (sc.num_workers, sc.use_gpu, sc.resources_per_worker) == (2, False, {"CPU": 1.0})
    assert (dsp.zero_stage, dsp.offload_optimizer, dsp.offload_param) == (2, "cpu", "none")
    assert train.deepspeed.nvme_path is None
    assert (train.deepspeed.aio.block_size, train.deepspeed.aio.queue_depth) == (1048576, 8)
    assert train.precision == "fp32"
    assert (train.optim.lr, train.optim.warmup_steps, train.optim.schedule) == (3.0e-3, 20, "cosine")
    assert (train.optim.betas, train.optim.eps, train.optim.min_lr_ratio) == ((0.9, 0.95), 1.0e-8, 0.1)
    assert train.steps == 300
    ck = train.checkpoint
    assert (ck.storage, ck.every_steps, ck.keep_last) == ("demo/runs/", 100, 2)
    assert (train.checkpoint.keep_every, train.checkpoint.async_upload) == (0, False)
    assert train.lora is None
    assert train.global_batch_size == 8 * 1 * 2

    assert (deploy.name, deploy.model) == ("stdlib-gpt", "demo/runs/stdlib-gpt/export/")
    e = deploy.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.kv_cache_tokens, e.max_model_len, e.device) == (
        16,
        1024,
        16384,
        512,
        "cpu",
    )
    assert (e.block_size, e.dtype) == (16, "auto")  # defaults
    assert (deploy.autoscaling.min_replicas, deploy.autoscaling.max_replicas) == (1, 1)
    assert deploy.autoscaling.initial_replicas is None
    assert (deploy.http.api_keys_env, deploy.http.max_queued_requests, deploy.http.route_prefix) == (
        "PYLON_API_KEYS",
        64,
        "/",
    )
    assert (deploy.replica.num_cpus, deploy.replica.num_gpus) == (1, 0)


def test_cluster_example_loads() -> None:
    [doc] = load_specs(EXAMPLES / "cluster-aws.yaml")
    c = doc.spec
    assert isinstance(c, ClusterSpec) and c.kind == "Cluster" and c.name == "pylon-aws"
    p = c.provider
    assert (p.type, p.region, p.zone, p.namespace) == ("aws", "us-west-2", None, "default")
    assert (c.head.instance_type, c.head.cpus, c.head.gpus, c.head.memory_gb) == ("m6i.2xlarge", 8, 0, 32)
    assert [g.name for g in c.worker_groups] == ["cpu", "a100"]
    a100 = c.worker_groups[1]
    assert (a100.instance_type, a100.gpus, a100.gpu_type, a100.min_workers, a100.max_workers, a100.spot) == (
        "p4d.24xlarge",
        8,
        "A100-40GB",
        0,
        2,
        True,
    )
    assert c.worker_groups[0].spot is False
    assert c.summary() == (
        "Cluster 'pylon-aws': provider aws, head 8 CPU, cpu 0-4x(16 CPU), a100 0-2x(96 CPU, 8 A100-40GB)"
    )


def test_design_md_example_loads() -> None:
    docs = parse_specs(DESIGN_YAML, "design.yaml")
    assert [(d.index, d.line, d.spec.kind) for d in docs] == [(1, 1, "TrainJob"), (2, 15, "Deployment")]
    train, deploy = docs[0].spec, docs[1].spec
    assert train.data.uri == "s3://bucket/corpus/"
    assert train.deepspeed.nvme_path == "/local_nvme"
    assert (train.optim.lr, train.optim.warmup_steps, train.steps) == (3.0e-4, 100, 2000)
    assert (train.checkpoint.storage, train.checkpoint.keep_every, train.checkpoint.async_upload) == (
        "s3://bucket/runs/",
        1000,
        True,
    )
    assert train.lora is None and train.gradient_checkpointing is False
    assert deploy.model == "s3://bucket/runs/stdlib-gpt/export/"
    a = deploy.autoscaling
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests, a.upscale_delay_s, a.downscale_delay_s) == (
        1,
        4,
        16,
        5,
        60,
    )
    assert deploy.engine.device == "auto"
    assert docs[1].summary() == (
        "design.yaml: document 2: Deployment 'stdlib-gpt': model s3://bucket/runs/stdlib-gpt/export/, "
        "1-4 replica(s), max_num_seqs 64, KV cache 65536 tokens, auth from $PYLON_API_KEYS"
    )


def test_minimal_train_job_gets_documented_defaults() -> None:
    [doc] = parse_specs(TRAIN)
    t = doc.spec
    assert (t.scaling.num_workers, t.scaling.use_gpu, t.scaling.resources_per_worker) == (1, False, {})
    assert (t.deepspeed.zero_stage, t.deepspeed.offload_optimizer, t.deepspeed.offload_param) == (2, "none", "none")
    assert t.precision == "fp32" and t.gradient_checkpointing is False
    assert (t.optim.lr, t.optim.weight_decay, t.optim.warmup_steps, t.optim.grad_clip) == (3.0e-4, 0.1, 0, 1.0)
    assert (t.batch.micro_batch_size, t.batch.grad_accum_steps) == (8, 1)
    assert (t.checkpoint.storage, t.checkpoint.every_steps, t.checkpoint.keep_last, t.checkpoint.keep_every) == (
        None,
        200,
        3,
        0,
    )
    assert t.summary() == (
        "TrainJob 'job': preset gpt-tiny, 1 CPU worker(s), ZeRO-2, fp32, 10 steps x 8 sequences, "
        "data corpus/, checkpoints -> $PYLON_HOME/runs every 200"
    )


def test_lora_and_explicit_model_config_load() -> None:
    [doc] = parse_specs(
        "kind: TrainJob\nname: ft\nmodel: {config: {model_type: llama, hidden_size: 64}}\ndata: {uri: c/}\n"
        "steps: 5\nlora: {r: 4, target_modules: [q_proj, v_proj]}\n"
    )
    t = doc.spec
    assert t.model.config == {"model_type": "llama", "hidden_size": 64}
    assert (t.lora.r, t.lora.alpha, t.lora.dropout, t.lora.target_modules, t.lora.merge_on_export) == (
        4,
        16,
        0.0,
        ["q_proj", "v_proj"],
        True,
    )
    assert t.model.describe() == "config llama" and t.summary().endswith(", LoRA r=4")


def test_load_spec_picks_the_one_document_of_a_kind(tmp_path: Path) -> None:
    path = EXAMPLES / "stdlib-gpt.yaml"
    assert load_spec(path, TrainJobSpec).name == "stdlib-gpt"
    assert isinstance(load_spec(path, DatasetSpec), DatasetSpec)
    with pytest.raises(SpecError) as info:
        load_spec(path, ClusterSpec)
    assert info.value.problems == [f"{path}: expected exactly one Cluster document, found 0"]
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems == [f"{path}: expected exactly one spec document, found 3"]
    two = tmp_path / "two.yaml"
    two.write_text(TRAIN + "---\n" + TRAIN.replace("name: job", "name: job2"))
    with pytest.raises(SpecError, match="expected exactly one TrainJob document, found 2"):
        load_spec(two, TrainJobSpec)


# ---------------------------------------------------------------------------------------------------------
# Unknown keys
# ---------------------------------------------------------------------------------------------------------


def test_unknown_top_level_key_lists_allowed_fields() -> None:
    assert train_error("stepz: 5\n") == (
        "spec.yaml:6: document 1 (TrainJob 'job'): stepz: unknown field; allowed fields: kind, name, model, data, "
        "scaling, deepspeed, precision, gradient_checkpointing, activation_offload, attention_mask, neftune_noise_alpha, loss_chunk_tokens, objective, eagle3, grpo, dpo_beta, precompute_reference, kto_loss, kto_desirable_weight, kto_undesirable_weight, dpo_rpo_alpha, simpo_gamma, reward_center_coefficient, dpo_loss, dpo_loss_weights, dpo_discopop_tau, dpo_label_smoothing, optim, batch, steps, "
        "checkpoint, lora, eval, priority, queue"
    )


def test_unknown_nested_key_has_path_line_and_allowed_fields() -> None:
    assert train_error("deepspeed:\n  zero_stage: 3\n  zero_stge: 3\n") == (
        "spec.yaml:8: document 1 (TrainJob 'job'): deepspeed.zero_stge: unknown field; "
        "allowed fields: zero_stage, offload_optimizer, offload_param, nvme_path, aio, buffers, "
        "grad_accum_dtype, loss_scaling"
    )
    assert train_error("deepspeed:\n  aio: {blocksize: 4}\n") == (
        "spec.yaml:7: document 1 (TrainJob 'job'): deepspeed.aio.blocksize: unknown field; "
        "allowed fields: block_size, queue_depth, thread_count, single_submit, overlap_events"
    )


def test_unknown_key_inside_a_list_item() -> None:
    assert one_problem(CLUSTER + "worker_groups:\n  - name: a\n  - name: b\n    gpu: 1\n") == (
        "spec.yaml:6: document 1 (Cluster 'c'): worker_groups[1].gpu: unknown field; allowed fields: "
        "instance_type, cpus, gpus, gpu_type, memory_gb, name, min_workers, max_workers, spot"
    )


def test_unknown_keys_are_all_reported() -> None:
    assert [p.split(": ")[2] for p in problems(DATASET + "a: 1\nb: 2\nc: 3\n")] == ["a", "b", "c"]


# ---------------------------------------------------------------------------------------------------------
# Types, ranges and allowed values
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            TRAIN.replace("steps: 10", "steps: ten"),
            "spec.yaml:5: document 1 (TrainJob 'job'): steps: must be a valid integer, unable to parse string as an "
            "integer (got 'ten')",
        ),
        (
            TRAIN.replace("steps: 10", "steps: 10.5"),
            "spec.yaml:5: document 1 (TrainJob 'job'): steps: must be a valid integer, got a number with a fractional "
            "part (got 10.5)",
        ),
        (
            TRAIN + "optim: [1, 2]\n",
            "spec.yaml:6: document 1 (TrainJob 'job'): optim: must be a valid dictionary or instance of OptimSpec "
            "(got list)",
        ),
        (
            TRAIN + "scaling: {use_gpu: maybe}\n",
            "spec.yaml:6: document 1 (TrainJob 'job'): scaling.use_gpu: must be a valid boolean, unable to interpret "
            "input (got 'maybe')",
        ),
        (
            DATASET.replace("sources: [text/]", "sources: text/"),
            "spec.yaml:3: document 1 (Dataset 'ds'): sources: must be a valid list (got 'text/')",
        ),
        (
            TRAIN + "checkpoint: {keep_last: 0}\n",
            "spec.yaml:6: document 1 (TrainJob 'job'): checkpoint.keep_last: must be greater than or equal to 1 (got 0)",
        ),
        (
            TRAIN + "optim: {lr: 0}\n",
            "spec.yaml:6: document 1 (TrainJob 'job'): optim.lr: must be greater than 0 (got 0)",
        ),
        (
            TRAIN.replace("{uri: corpus/}", "{uri: corpus/, validation_fraction: 0.9}"),
            "spec.yaml:4: document 1 (TrainJob 'job'): data.validation_fraction: must be less than or equal to 0.5 "
            "(got 0.9)",
        ),
        (
            TRAIN + "optim:\n  betas: [0.9, 1.0]\n",
            "spec.yaml:7: document 1 (TrainJob 'job'): optim.betas[1]: must be less than 1 (got 1.0)",
        ),
        (
            DATASET + "sources2: x\n".replace("sources2: x\n", "") + "seq_len: -1\n",
            "spec.yaml:5: document 1 (Dataset 'ds'): seq_len: must be greater than or equal to 1 (got -1)",
        ),
        (
            DATASET.replace("sources: [text/]", "sources: []"),
            "spec.yaml:3: document 1 (Dataset 'ds'): sources: list should have at least 1 item after validation, not 0",
        ),
        (
            DATASET.replace("sources: [text/]", "sources: [text/, 'ftp://host/x']"),
            "spec.yaml:3: document 1 (Dataset 'ds'): sources[1]: unsupported URI scheme 'ftp://'; use a local path or "
            "one of file://, s3://, memory://",
        ),
    ],
    ids=[
        "str-for-int",
        "float-for-int",
        "list-for-mapping",
        "bad-bool",
        "str-for-list",
        "keep_last-0",
        "lr-0",
        "validation_fraction",
        "betas",
        "negative",
        "empty-list",
        "uri-scheme",
    ],
)
def test_wrong_types_and_out_of_range_values(text: str, expected: str) -> None:
    assert one_problem(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (TRAIN + "deepspeed: {zero_stage: 5}\n", "deepspeed.zero_stage: must be one of 0, 1, 2, 3 (got 5)"),
        (TRAIN + "precision: fp8\n", "precision: must be one of fp32, fp16, bf16 (got 'fp8')"),
        (DATASET + "format: csv\n", "format: must be one of parquet, webdataset (got 'csv')"),
        (
            TRAIN + "deepspeed: {zero_stage: 3, offload_param: gpu}\n",
            "deepspeed.offload_param: must be one of none, cpu, nvme (got 'gpu')",
        ),
        (TRAIN + "optim: {schedule: step}\n", "optim.schedule: must be one of cosine, linear, constant (got 'step')"),
        (
            TRAIN.replace("gpt-tiny", "gpt-huge"),
            "model.preset: must be one of " + ", ".join(MODEL_PRESETS) + " (got 'gpt-huge')",
        ),
        (DEPLOY + "engine: {device: tpu}\n", "engine.device: must be one of auto, cpu, cuda (got 'tpu')"),
        (
            CLUSTER + "provider: {type: azure}\n",
            "provider.type: must be one of local, aws, gcp, kubernetes (got 'azure')",
        ),
        (
            TRAIN + "scaling: {placement_strategy: spread}\n",
            "scaling.placement_strategy: must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD (got 'spread')",
        ),
    ],
    ids=["zero_stage", "precision", "format", "offload", "schedule", "preset", "device", "provider", "placement"],
)
def test_literal_errors_list_allowed_values(text: str, expected: str) -> None:
    assert one_problem(text).split(": ", 2)[2] == expected


# ---------------------------------------------------------------------------------------------------------
# Cross-field rules, one at a time
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            "deepspeed: {zero_stage: 2, offload_param: cpu}\n",
            "6: document 1 (TrainJob 'job'): deepspeed.offload_param: 'cpu' needs zero_stage 3 (got zero_stage 2)",
        ),
        (
            "deepspeed: {zero_stage: 0, offload_optimizer: cpu}\n",
            "6: document 1 (TrainJob 'job'): deepspeed.offload_optimizer: 'cpu' needs zero_stage 1, 2 or 3 "
            "(got zero_stage 0)",
        ),
        (
            "scaling: {use_gpu: true}\ndeepspeed: {zero_stage: 3, offload_param: nvme}\n",
            "7: document 1 (TrainJob 'job'): deepspeed.nvme_path: required when offload_optimizer or offload_param "
            "is 'nvme'",
        ),
        (
            "bf16: {enabled: true}\nfp16: {enabled: false}\n",
            "7: document 1 (TrainJob 'job'): fp16: fp16 and bf16 are exclusive; choose one with 'precision: fp16' or "
            "'precision: bf16'",
        ),
        ("bf16: true\n", "6: document 1 (TrainJob 'job'): bf16: not a field here; write 'precision: bf16'"),
        (
            "precision: fp16\n",
            "6: document 1 (TrainJob 'job'): precision: fp16 needs GPUs (scaling.use_gpu: true); use bf16 or fp32 on CPU",
        ),
        (
            "optim: {warmup_steps: 10}\n",
            "6: document 1 (TrainJob 'job'): optim.warmup_steps: must be less than steps (10) (got 10)",
        ),
        (
            "checkpoint: {every_steps: 200, keep_every: 300}\n",
            "6: document 1 (TrainJob 'job'): checkpoint.keep_every: must be a multiple of every_steps (200), or no "
            "checkpoint would ever be kept by it (got 300)",
        ),
        (
            "eval: {every_steps: 5}\n",
            "6: document 1 (TrainJob 'job'): eval.every_steps: evaluation needs a held-out split: set "
            "data.validation_fraction (e.g. 0.05) (got every_steps 5 with validation_fraction 0)",
        ),
        (
            "eval:\n  max_batches: 2\n",
            "7: document 1 (TrainJob 'job'): eval.max_batches: evaluation needs a held-out split: set "
            "data.validation_fraction (e.g. 0.05) (got max_batches 2 with validation_fraction 0)",
        ),
        (
            "eval: {every_step: 5}\n",
            "6: document 1 (TrainJob 'job'): eval.every_step: unknown field; allowed fields: every_steps, max_batches",
        ),
        (
            "eval: {every_steps: -1}\n",
            "6: document 1 (TrainJob 'job'): eval.every_steps: must be greater than or equal to 0 (got -1)",
        ),
    ],
    ids=[
        "offload_param-zero2",
        "offload_optimizer-zero0",
        "nvme-without-path",
        "fp16-and-bf16",
        "bf16-key",
        "fp16-on-cpu",
        "warmup>=steps",
        "keep_every",
        "eval-without-validation",
        "eval-max_batches-without-validation",
        "eval-unknown-field",
        "eval-negative",
    ],
)
def test_train_job_cross_field_rules(extra: str, expected: str) -> None:
    assert train_error(extra) == f"spec.yaml:{expected}"


@pytest.mark.parametrize(
    "extra",
    [
        "deepspeed: {zero_stage: 3, offload_param: cpu, offload_optimizer: cpu}\n",
        "deepspeed: {zero_stage: 1, offload_optimizer: cpu}\n",
        "scaling: {use_gpu: true}\ndeepspeed: {zero_stage: 3, offload_param: nvme, nvme_path: /nvme}\n",
        # NVMe offload runs on CPU workers too (DeepSpeed's CPU accelerator builds the async_io op).
        "deepspeed: {zero_stage: 3, offload_param: nvme, offload_optimizer: nvme, nvme_path: /nvme}\n",
        "precision: fp16\nscaling: {use_gpu: true}\n",
        "optim: {warmup_steps: 9}\n",
        "checkpoint: {every_steps: 200, keep_every: 400}\n",
    ],
)
def test_train_job_cross_field_rules_accept_the_valid_side(extra: str) -> None:
    [doc] = parse_specs(TRAIN + extra)
    assert doc.spec.name == "job"


def test_eval_defaults_to_the_end_of_the_run_and_takes_a_period_with_a_validation_split() -> None:
    [doc] = parse_specs(TRAIN)
    assert (doc.spec.eval.every_steps, doc.spec.eval.max_batches) == (0, 0)
    text = TRAIN.replace("{uri: corpus/}", "{uri: corpus/, validation_fraction: 0.1}")
    [doc] = parse_specs(text + "eval: {every_steps: 5, max_batches: 2}\n")
    assert (doc.spec.eval.every_steps, doc.spec.eval.max_batches) == (5, 2)


@pytest.mark.parametrize(
    "model, expected",
    [
        ("{}", "model: give exactly one of preset, config or path; presets: " + ", ".join(MODEL_PRESETS)),
        (
            "{preset: gpt-tiny, path: s3://b/m}",
            "model: give exactly one of preset, config or path (got preset, path); presets: "
            + ", ".join(MODEL_PRESETS),
        ),
        ("{config: {n_layer: 2}}", "model.config.model_type: required in an explicit config, e.g. gpt2 or llama"),
    ],
    ids=["none", "two", "config-without-model_type"],
)
def test_model_needs_exactly_one_source(model: str, expected: str) -> None:
    assert one_problem(TRAIN.replace("{preset: gpt-tiny}", model)) == (
        f"spec.yaml:3: document 1 (TrainJob 'job'): {expected}"
    )


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            "engine:\n  max_model_len: 2048\n  kv_cache_tokens: 1024\n",
            "6: document 1 (Deployment 'svc'): engine.kv_cache_tokens: must hold at least one full sequence: "
            ">= max_model_len (2048) (got 1024)",
        ),
        (
            "engine: {kv_cache_tokens: 2056}\n",
            "4: document 1 (Deployment 'svc'): engine.kv_cache_tokens: must be a multiple of block_size (16) (got 2056)",
        ),
        (
            "autoscaling:\n  max_replicas: 2\n  min_replicas: 3\n",
            "6: document 1 (Deployment 'svc'): autoscaling.min_replicas: must be <= max_replicas (2) (got 3)",
        ),
        (
            "autoscaling: {min_replicas: 1, max_replicas: 2, initial_replicas: 5}\n",
            "4: document 1 (Deployment 'svc'): autoscaling.initial_replicas: must be between min_replicas (1) and "
            "max_replicas (2) (got 5)",
        ),
        (
            "replica: {num_gpus: 0}\nengine: {device: cuda}\n",
            "4: document 1 (Deployment 'svc'): replica.num_gpus: must be > 0 when engine.device is 'cuda' (got 0)",
        ),
        (
            "http: {route_prefix: v1}\n",
            "4: document 1 (Deployment 'svc'): http.route_prefix: string should match pattern '^/[A-Za-z0-9_\\-/]*$'",
        ),
        (
            "engine:\n  adapters:\n    - {name: a, path: s3://b/a}\n    - {name: a, path: s3://b/c}\n",
            "7: document 1 (Deployment 'svc'): engine.adapters[1].name: 'a' names an earlier adapter too",
        ),
        (
            "engine:\n  adapters: [{name: svc, path: s3://b/a}]\n",
            "5: document 1 (Deployment 'svc'): engine.adapters[0].name: 'svc' is the deployment's own name, which "
            "requests use for the base model; name the adapter otherwise",
        ),
        (
            "engine: {pipeline_parallel: 2, data_parallel: 2}\n",
            "4: document 1 (Deployment 'svc'): engine.data_parallel: is not served with pipeline_parallel 2 (set it "
            "to 1, or pipeline_parallel to 1)",
        ),
        (
            "engine: {tensor_parallel: 2, data_parallel: 2}\n",
            "4: document 1 (Deployment 'svc'): engine.data_parallel: is not served with tensor_parallel 2 (set it "
            "to 1, or tensor_parallel to 1)",
        ),
        (
            "engine: {expert_parallel: true}\n",
            "4: document 1 (Deployment 'svc'): engine.expert_parallel: divides the experts among tensor-parallel "
            "shards: set tensor_parallel to the shards to divide them among (2 or more), or expert_parallel to false",
        ),
        (
            "engine: {tensor_parallel: 2}\nreplica: {num_cpus: 0}\n",
            "5: document 1 (Deployment 'svc'): replica.num_cpus: must be > 0 with engine.tensor_parallel 2: each "
            "shard takes a placement group bundle of the replica's resources, and an empty bundle places nothing "
            "(got 0, and num_gpus 0)",
        ),
        (
            "engine: {pipeline_parallel: 2, classifier_from_token: ['yes']}\n",
            "4: document 1 (Deployment 'svc'): engine.classifier_from_token: is not served with pipeline_parallel 2 "
            "(set it to [], or pipeline_parallel to 1)",
        ),
        (
            "engine: {pipeline_parallel: 3}\nreplica: {num_cpus: 0}\n",
            "5: document 1 (Deployment 'svc'): replica.num_cpus: must be > 0 with engine.pipeline_parallel 3: each "
            "stage takes a placement group bundle of the replica's resources, and an empty bundle places nothing "
            "(got 0, and num_gpus 0)",
        ),
        (
            "engine: {enable_prefix_caching: false}\nprefill: {replicas: 2}\n",
            "5: document 1 (Deployment 'svc'): prefill: needs engine.enable_prefix_caching: a prefill replica's "
            "blocks are taken into the decoding replica's prefix cache, where its request finds them",
        ),
        (
            "engine: {device: cuda}\nreplica: {num_gpus: 1}\nprefill: {replica: {num_gpus: 0}}\n",
            "6: document 1 (Deployment 'svc'): prefill.replica.num_gpus: must be > 0 when engine.device is 'cuda' "
            "(got 0)",
        ),
        (
            "engine: {tensor_parallel: 2}\nprefill: {replica: {num_cpus: 0}}\n",
            "5: document 1 (Deployment 'svc'): prefill.replica.num_cpus: must be > 0 with a model split in parts "
            "(pipeline_parallel, tensor_parallel): each part takes a placement group bundle of the replica's "
            "resources (got 0, and num_gpus 0)",
        ),
        (
            "prefill: {replicas: 2, autoscaling: {max_replicas: 4}}\n",
            "4: document 1 (Deployment 'svc'): prefill.replicas: give either replicas (a fixed number) or "
            "autoscaling (min_replicas to max_replicas), not both",
        ),
        (
            "prefill: {autoscaling: {min_replicas: 3, max_replicas: 2}}\n",
            "4: document 1 (Deployment 'svc'): prefill.autoscaling.min_replicas: must be <= max_replicas (2) (got 3)",
        ),
    ],
    ids=[
        "kv<max_model_len",
        "kv-block",
        "min>max",
        "initial",
        "cuda-no-gpus",
        "route_prefix",
        "adapter-twice",
        "adapter-own",
        "pipeline-dp",
        "tensor-dp",
        "experts-no-tensor",
        "tensor-no-resources",
        "pipeline-classifier",
        "pipeline-no-resources",
        "prefill-no-prefix-cache",
        "prefill-cuda-no-gpus",
        "prefill-split-no-resources",
        "prefill-replicas-and-autoscaling",
        "prefill-min>max",
    ],
)
def test_deployment_cross_field_rules(extra: str, expected: str) -> None:
    assert one_problem(DEPLOY + extra) == f"spec.yaml:{expected}"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            "worker_groups:\n  - name: cpu\n  - name: gpu\n    gpus: 1\n  - name: cpu\n",
            ["spec.yaml:7: document 1 (Cluster 'c'): worker_groups[2].name: duplicate worker group name 'cpu'"],
        ),
        (
            "head: {gpu_type: H100}\n",
            ["spec.yaml:3: document 1 (Cluster 'c'): head.gpu_type: 'H100' given but gpus is 0"],
        ),
        (
            "worker_groups:\n  - name: g\n    gpus: 0\n    gpu_type: A100\n",
            ["spec.yaml:6: document 1 (Cluster 'c'): worker_groups[0].gpu_type: 'A100' given but gpus is 0"],
        ),
        (
            "worker_groups:\n  - {name: g, min_workers: 3, max_workers: 2}\n",
            ["spec.yaml:4: document 1 (Cluster 'c'): worker_groups[0].min_workers: must be <= max_workers (2) (got 3)"],
        ),
        (
            "provider:\n  type: aws\nhead: {instance_type: m6i.large}\n",
            ["spec.yaml:3: document 1 (Cluster 'c'): provider.region: required for provider type 'aws'"],
        ),
        (
            "provider: {type: aws, region: us-west-2}\nworker_groups:\n  - {name: a, instance_type: m6i.large}\n"
            "  - {name: b}\n",
            # head is absent, so its error points at the document, as a missing field's does
            [
                "spec.yaml:1: document 1 (Cluster 'c'): head.instance_type: required for provider type 'aws'",
                "spec.yaml:6: document 1 (Cluster 'c'): worker_groups[1].instance_type: required for provider type 'aws'",
            ],
        ),
        (
            "provider: {type: gcp, region: us-central1}\nhead: {instance_type: n2-standard-8}\n",
            [
                "spec.yaml:3: document 1 (Cluster 'c'): provider.zone: required for provider type 'gcp'",
                "spec.yaml:3: document 1 (Cluster 'c'): provider.project_id: required for provider type 'gcp'",
            ],
        ),
    ],
    ids=["duplicate-group", "head-gpu_type", "group-gpu_type", "min>max", "aws-region", "aws-instance_type", "gcp"],
)
def test_cluster_cross_field_rules(extra: str, expected: list[str]) -> None:
    assert problems(CLUSTER + extra) == expected


def test_duplicate_worker_group_path_points_at_the_second_one() -> None:
    assert one_problem(CLUSTER + "worker_groups:\n  - name: a\n  - name: a\n") == (
        "spec.yaml:5: document 1 (Cluster 'c'): worker_groups[1].name: duplicate worker group name 'a'"
    )


def test_cross_field_readme_example_line() -> None:
    # The exact line README.md shows, produced from the original design's example with one edit.
    text = DESIGN_YAML.replace("offload_param: none", "offload_param: cpu")
    assert problems(text, "train.yaml") == [
        "train.yaml:6: document 1 (TrainJob 'stdlib-gpt'): deepspeed.offload_param: 'cpu' needs zero_stage 3 "
        "(got zero_stage 2)"
    ]


# ---------------------------------------------------------------------------------------------------------
# The same rules from Python
# ---------------------------------------------------------------------------------------------------------


def test_constructing_specs_in_python() -> None:
    spec = TrainJobSpec(
        name="py-job",
        model=ModelSpec(preset="gpt-tiny"),
        data=DataSpec(uri="c/"),
        steps=50,
        deepspeed={"zero_stage": 3, "offload_param": "cpu"},
    )
    assert spec.kind == "TrainJob" and spec.deepspeed.offload_param == "cpu" and spec.optim.lr == 3.0e-4
    assert spec == TrainJobSpec.model_validate(spec.model_dump())


@pytest.mark.parametrize(
    "build, cls, expected",
    [
        (
            lambda: TrainJobSpec(
                name="j", model={"preset": "gpt-tiny"}, data={"uri": "c/"}, steps=5, deepspeed={"zero_stage": 5}
            ),
            TrainJobSpec,
            ["deepspeed.zero_stage: must be one of 0, 1, 2, 3 (got 5)"],
        ),
        (
            lambda: DeepSpeedSpec(zero_stage=2, offload_param="cpu"),
            DeepSpeedSpec,
            ["offload_param: 'cpu' needs zero_stage 3 (got zero_stage 2)"],
        ),
        (
            lambda: TrainJobSpec(
                name="j", model={"preset": "gpt-tiny"}, data={"uri": "c/"}, steps=5, optim={"warmup_steps": 5}
            ),
            TrainJobSpec,
            ["optim.warmup_steps: must be less than steps (5) (got 5)"],
        ),
        (
            lambda: ClusterSpec(name="c", worker_groups=[{"name": "a"}, {"name": "a"}]),
            ClusterSpec,
            ["worker_groups[1].name: duplicate worker group name 'a'"],
        ),
        (
            lambda: DeploymentSpec(name="Bad_Name", model="m/", engine={"kv_cache_tokens": 16, "max_model_len": 32}),
            DeploymentSpec,
            [
                f"name: {NAME_MSG}, e.g. 'stdlib-gpt' (got 'Bad_Name')",
                "engine.kv_cache_tokens: must hold at least one full sequence: >= max_model_len (32) (got 16)",
            ],
        ),
        (
            lambda: TrainJobSpec(name="j", model={"preset": "gpt-tiny"}, data={"uri": "c/"}, steps=5, fp16=True),
            TrainJobSpec,
            ["fp16: not a field here; write 'precision: fp16'"],
        ),
        (
            lambda: DatasetSpec(name="d", sources=["a"], output="o", colour="blue"),
            DatasetSpec,
            [
                "colour: unknown field; allowed fields: kind, name, sources, output, format, seq_len, "
                "tokenizer, include, exclude, shard_size_mb, chat, prompt_completion, preference, prompts, packing"
            ],
        ),
        (
            lambda: DatasetSpec(kind="TrainJob", name="d", sources=["a"], output="o"),
            DatasetSpec,
            ["kind: must be one of Dataset (got 'TrainJob')"],
        ),
        (
            lambda: TrainJobSpec(name="j", data={"uri": "c/"}),
            TrainJobSpec,
            ["model: required field is missing", "steps: required field is missing"],
        ),
    ],
    ids=[
        "literal",
        "deepspeed-rule",
        "warmup",
        "duplicate-group",
        "two-errors",
        "fp16-key",
        "unknown",
        "kind",
        "missing",
    ],
)
def test_python_construction_enforces_the_same_rules(build, cls, expected: list[str]) -> None:
    with pytest.raises(ValidationError) as info:
        build()
    assert spec_errors(cls, info.value) == expected


def test_assignment_is_validated() -> None:
    spec = TrainJobSpec(name="j", model={"preset": "gpt-tiny"}, data={"uri": "c/"}, steps=5)
    with pytest.raises(ValidationError) as info:
        spec.steps = 0
    assert spec_errors(TrainJobSpec, info.value) == ["steps: must be greater than or equal to 1 (got 0)"]
    with pytest.raises(ValidationError):
        spec.precision = "fp8"
    with pytest.raises(ValidationError):
        spec.name = "../x"
    assert (spec.steps, spec.precision, spec.name) == (5, "fp32", "j")


# ---------------------------------------------------------------------------------------------------------
# to_yaml round trip
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        (EXAMPLES / "stdlib-gpt.yaml").read_text(),
        (EXAMPLES / "cluster-aws.yaml").read_text(),
        DESIGN_YAML,
        "kind: TrainJob\nname: ft\nmodel: {config: {model_type: llama, hidden_size: 64, rope: {theta: 10000.0}}}\n"
        "data: {uri: 's3://b/c/'}\nsteps: 5\nlora: {r: 4, target_modules: [q_proj]}\n"
        "scaling: {use_gpu: true, num_workers: 4, resources_per_worker: {GPU: 1, CPU: 8}}\n"
        "deepspeed: {zero_stage: 3, offload_param: nvme, nvme_path: /nvme, aio: {queue_depth: 32}}\n---\n"
        + DEPLOY
        + "http: {api_keys_env: null}\nautoscaling: {min_replicas: 0, max_replicas: 3, initial_replicas: 1}\n",
    ],
    ids=["stdlib-gpt", "cluster-aws", "design", "everything-else"],
)
def test_to_yaml_round_trips(text: str) -> None:
    specs = [d.spec for d in parse_specs(text)]
    dumped = to_yaml(*specs)
    again = [d.spec for d in parse_specs(dumped, "dumped.yaml")]
    assert again == specs
    assert to_yaml(*again) == dumped


def test_to_yaml_writes_defaults() -> None:
    dumped = to_yaml(parse_specs(TRAIN)[0].spec)
    assert dumped.startswith("kind: TrainJob\nname: job\n")  # field order kept, kind first
    data = yaml.safe_load(dumped)
    assert (data["precision"], data["steps"], data["lora"]) == ("fp32", 10, None)
    assert data["deepspeed"]["zero_stage"] == 2 and data["deepspeed"]["aio"]["queue_depth"] == 8
    assert data["optim"]["betas"] == [0.9, 0.95] and data["data"]["validation_fraction"] == 0.0
    assert data["checkpoint"] == {
        "storage": None,
        "every_steps": 200,
        "keep_last": 3,
        "keep_every": 0,
        "async_upload": False,
    }


# ---------------------------------------------------------------------------------------------------------
# Secrets never appear in errors
# ---------------------------------------------------------------------------------------------------------

SECRET = "AKIA-SUPER-SECRET-123"


@pytest.mark.parametrize(
    "text, path",
    [
        (TRAIN + f"aws_secret_access_key: {SECRET}\n", "aws_secret_access_key"),
        (
            TRAIN + f"checkpoint:\n  storage: s3://b/runs/\n  aws_secret_access_key: {SECRET}\n",
            "checkpoint.aws_secret_access_key",
        ),
        (TRAIN + f"checkpoint: {{storage_options: {{key: AKIA, secret: {SECRET}}}}}\n", "checkpoint.storage_options"),
        (DEPLOY + f"http: {{api_keys_env: '{SECRET}'}}\n", "http.api_keys_env"),
        (DEPLOY + f"http: {{api_keys_env: 'sk-{SECRET},sk-other'}}\n", "http.api_keys_env"),
        (DEPLOY + f"http: {{api_keys: [{SECRET}]}}\n", "http.api_keys"),
    ],
    ids=["top-level", "nested", "nested-mapping", "api_keys_env-holds-the-key", "api_keys_env-holds-keys", "api_keys"],
)
def test_errors_never_echo_secret_values(text: str, path: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_specs(text)
    [problem] = info.value.problems
    assert f": {path}: " in problem
    assert SECRET not in problem and SECRET not in str(info.value)


def test_spec_errors_never_echo_secret_values() -> None:
    with pytest.raises(ValidationError) as info:
        DeploymentSpec(name="svc", model="m/", http={"api_keys_env": SECRET}, aws_secret_access_key=SECRET)
    lines = spec_errors(DeploymentSpec, info.value)
    assert sorted(line.split(":")[0] for line in lines) == ["aws_secret_access_key", "http.api_keys_env"]
    assert not any(SECRET in line for line in lines)


def test_nvme_optimizer_offload_needs_stage_3():
    with pytest.raises(SpecError) as e:
        parse_specs(
            "kind: TrainJob\nname: j\nmodel: {preset: gpt-tiny}\ndata: {uri: d/}\nsteps: 5\n"
            "deepspeed: {zero_stage: 2, offload_optimizer: nvme, nvme_path: /nvme}\n",
            "t.yaml",
        )
    assert e.value.problems == [
        "t.yaml:6: document 1 (TrainJob 'j'): deepspeed.offload_optimizer: 'nvme' needs "
        "zero_stage 3 (got zero_stage 2); use 'cpu' with stages 1-2"
    ]
