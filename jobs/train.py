"""Train a `TrainJob` on Ray Train workers running DeepSpeed: `python -m pylon.jobs.train --config FILE`.

What `ray job submit` runs (and `pylon train FILE` submits). The driver validates the spec, checks the data,
and runs a `TorchTrainer`; each worker reads its part of the data (`pylon.data.reader`), trains with the
DeepSpeed engine built from the spec, commits sharded checkpoints (`pylon.jobs.checkpoint`), and writes
per-step metrics. A worker failure restarts the group from the latest committed checkpoint
(`FailureConfig`); submitting the same run name again resumes it. At the end the run is exported to
`<run>/export/` as one Hugging Face model, with a loss-curve PNG beside the metrics.

The train loop, as a list of steps (TorchTitan/nanoGPT style): build model -> DeepSpeed engine -> data stream
-> resume -> for each optimizer step: micro-batches (forward, loss over the global token count, backward,
engine.step) -> metrics -> held-out evaluation (every `eval.every_steps` steps and at the end, when
`data.validation_fraction` > 0: `"kind": "eval"` records in metrics.jsonl, `eval.json` in the export) -> checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

from pylon import home, settings, storage
from pylon.errors import PylonError, SpecError
from pylon.jobs import sequence_parallel
from pylon.jobs.run_dir import (
    LOSS_PLOT,
    REFERENCE_FILE,
    RUN_FILE,
    WORKERS_FILE,
    CompletionsLog,
    MetricsLog,
    _absolute,
    eval_line,
    eval_record,
    plot_loss,
    read_metrics,
    run_uri_of,
    storage_problems,
)
from pylon.specs import PREFERENCE_OBJECTIVES, RL_OBJECTIVES, Eagle3Spec, TrainJobSpec, load_spec

log = logging.getLogger("pylon.train")


def run(spec: TrainJobSpec, *, export: bool = True, max_failures: int = 3) -> dict:
    """Train `spec` on the connected Ray cluster; returns a summary (final step, loss, run URI, export)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pylon.data.shards import read_manifest, separate_documents
    from pylon.jobs.checkpoint import ray_train_storage

    working_dir = home.job_working_dir()
    if working_dir is None:  # paths in a job's working dir stay relative: each node's workers read their own copy
        spec = spec.model_copy(update={"data": spec.data.model_copy(update={"uri": _absolute(spec.data.uri)})})
        if spec.grpo is not None:  # (a reward model's directory, likewise)
            absolute = [r.model_copy(update={"model": _absolute(r.model)}) if r.model else r for r in spec.grpo.rewards]
            spec = spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"rewards": absolute})})
    run_uri = run_uri_of(spec)
    if not ray.is_initialized():
        if os.environ.get("RAY_JOB_ID") or settings.value(settings.RAY_ADDRESS):
            ray.init(log_to_driver=True)  # inside a Ray job: the job's cluster
        else:
            home.init_ray(log_to_driver=True)
    # Before asking for workers: storage that only one node can see would fail them all, after a long wait.
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    shared = {"data.uri": spec.data.uri, "checkpoint.storage": run_uri}
    if spec.model.path is not None:
        shared["model.path"] = spec.model.path
    for i, reward in enumerate(spec.grpo.rewards if spec.grpo is not None else []):
        if reward.model is not None:
            shared[f"grpo.rewards[{i}].model"] = reward.model
    problems = storage_problems(shared, nodes, working_dir=working_dir)
    if problems:
        raise SpecError([f"TrainJob '{spec.name}': {p}" for p in problems])
    manifest = read_manifest(spec.data.uri)  # fail here, before asking for workers, if the data is not usable
    if spec.data.seq_len is not None and spec.data.seq_len != manifest.seq_len:
        raise PylonError(
            f"data.seq_len is {spec.data.seq_len} but {spec.data.uri} was prepared with seq_len {manifest.seq_len}"
        )
    separate_documents(spec.attention_mask, manifest, f"data.uri {spec.data.uri}")
    for note in check_objective(spec, manifest):
        print(note, flush=True)
    if spec.scaling.sequence_parallel > 1:  # before workers start: can the rows and the model's heads be split
        from pylon.models import model_config

        config = model_config(spec.model, vocab_size=manifest.tokenizer.vocab_size)
        sequence_parallel.check(config, spec.scaling.sequence_parallel, manifest.seq_len, spec.model.describe())
    if spec.objective == "eagle3":  # before workers start: can the engine run a head for this model
        _check_eagle3_model(spec, manifest)
    if spec.grpo is not None and spec.grpo.sampler != "model":  # before workers start: can the engine sample it
        from pylon.jobs.rollout import check_sampler

        check_sampler(spec, manifest)
    _record_run(run_uri, spec, tokenizer=manifest.tokenizer.model_dump(mode="json"))
    from pylon.jobs.ledger import LEDGER_FILE, SessionRecorder

    session = SessionRecorder(run_uri, spec=spec.model_dump(mode="json"))
    from pylon.data.reader import pin_ray_data_helpers_here

    pin_ray_data_helpers_here()  # on this driver's node, not on a worker node the autoscaler must stop later

    use_gpu = spec.scaling.use_gpu
    resources = dict(spec.scaling.resources_per_worker) or {"CPU": 1}
    loop_config = {"spec": spec.model_dump(mode="json"), "run_uri": run_uri, "session": session.id}
    if spec.grpo is not None and spec.grpo.sampler == "server":  # started once admitted (_fit_and_export)
        from pylon.jobs.rollout import server_names

        loop_config["sampler_servers"] = server_names(session.id, spec.grpo.sampler_servers)
        loop_config["sampler_namespace"] = ray.get_runtime_context().namespace
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=spec.scaling.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=resources,
            placement_strategy=spec.scaling.placement_strategy,
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            # Ray Train's experiment directory is the run directory, on storage every node reaches: checkpoints are
            # reported to Ray where they are (NO_UPLOAD), which Ray accepts only under its experiment directory.
            **ray_train_storage(run_uri),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    print(f"training {spec.summary()}\nrun directory: {run_uri}", flush=True)
    try:
        summary = _fit_and_export(trainer, spec, run_uri, session, export=export)
    except BaseException:
        session.finish("failed")
        raise
    ledger = session.finish("succeeded")
    summary["ledger"] = storage.join(run_uri, LEDGER_FILE)
    if ledger:
        good = ledger["goodput"]
        print(
            f"ledger: {ledger['cpu_hours']:.4f} CPU-hours, {ledger['accelerator_hours']:.4f} GPU-hours, "
            f"{ledger['bytes_read'] / 1e6:.1f} MB read, {ledger['bytes_written'] / 1e6:.1f} MB written, "
            f"${ledger['cost_usd']:.4f}; goodput {good['fraction']:.0%} of {good['wall_s']:.0f}s "
            f"(pylon cost {spec.name} for the rest)",
            flush=True,
        )
    return summary


def _fit_and_export(trainer, spec: TrainJobSpec, run_uri: str, session, *, export: bool) -> dict:
    from pylon.jobs.queue import admitted

    t0 = time.perf_counter()
    with admitted(spec):  # waits in the cluster's job queue while jobs ahead of it hold the workers it needs
        session.queued(time.perf_counter() - t0)
        servers = []
        if spec.grpo is not None and spec.grpo.sampler == "server":  # grpo.sampler server: before the workers
            from pylon.jobs.rollout import start_servers, stop_servers

            servers = start_servers(spec, session.id, say=lambda line: print(line, flush=True))
            session.servers_started(len(servers), spec.grpo.sampler_resources)  # (the ledger counts their hours)
        try:
            result = trainer.fit()
        finally:
            if servers:
                stop_servers(servers, say=lambda line: print(line, flush=True))
                session.servers_stopped()
    summary = {"run_uri": run_uri, **(result.metrics or {})}
    records = read_metrics(run_uri)
    evals = read_metrics(run_uri, kind="eval")
    if records:
        plot_loss(records, storage.join(run_uri, LOSS_PLOT), title=spec.name, evals=evals)
        summary["loss_plot"] = storage.join(run_uri, LOSS_PLOT)
    if evals:
        final = evals[-1]
        summary.update(val_loss=final["val_loss"], val_perplexity=final["val_perplexity"], val_step=final["step"])
        print(f"final {eval_line(final)}", flush=True)
    if export:
        from pylon.jobs.export import export_run

        out = storage.join(run_uri, "export")
        t0, moved = time.perf_counter(), {}
        export_run(run_uri, out, moved=moved)
        session.exported(time.perf_counter() - t0, read=moved.get("read", 0), written=moved.get("written", 0))
        summary["export"] = out
        if spec.objective == "eagle3":  # a head, not a model: how it is served
            depth = min(3, (spec.eagle3 or Eagle3Spec()).ttt_steps)
            print(
                f"exported the EAGLE-3 head to {out}: serve {spec.model.path} with engine.speculative: "
                f"{{method: eagle3, draft_model: {out}, num_tokens: {depth}}}",
                flush=True,
            )
    return summary


def _record_placement(run_uri: str, rank: int, world: int) -> None:
    """Where every worker of this attempt runs, in `<run>/workers.json` and the job log: which node (Ray node
    id and host) and which process. A restarted attempt overwrites it with its own placement."""
    import socket

    import ray
    import torch.distributed as dist

    me = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me)
    if rank == 0:
        storage.atomic_write_json(storage.join(run_uri, WORKERS_FILE), {"workers": everyone, "at": time.time()})
        nodes = sorted({w["node_id"] for w in everyone})
        print(
            f"{world} worker(s) on {len(nodes)} node(s): "
            + ", ".join(f"rank {w['rank']} on node {w['node_id']}" for w in everyone),
            flush=True,
        )


def _record_run(run_uri: str, spec: TrainJobSpec, *, tokenizer: dict) -> None:
    """`run.json`: the spec a run was started with. Re-submitting the same name resumes the run, so the
    parts that define its checkpoints must not change; steps, optimiser and checkpoint policy may."""
    uri = storage.join(run_uri, RUN_FILE)
    now = spec.model_dump(mode="json")
    if storage.exists(uri):
        before = storage.read_json(uri)["spec"]
        fixed = ("model", "data", "scaling", "deepspeed", "precision", "lora", "batch", "eagle3")
        changed = [k for k in fixed if before.get(k) != now.get(k)]
        if changed:
            raise PylonError(
                f"run '{spec.name}' already exists at {run_uri} with a different "
                f"{', '.join(changed)}; resume it with the same settings or choose another name"
            )
    storage.atomic_write_json(uri, {"spec": now, "tokenizer": tokenizer, "updated_at": time.time()})


def check_objective(spec: TrainJobSpec, manifest, labels: bool = True) -> list[str]:
    """The preference objectives (dpo, simpo, orpo, reward) train on preference pairs, kto on labelled
    prompt-completion records (with `labels`, every label read and checked here: the driver's check, before workers
    start), grpo and rloo on prompts: a PylonError naming data.uri for a dataset of anything else. Returns what the
    job's log should say of the data (kto's balance of labels)."""
    if spec.objective in PREFERENCE_OBJECTIVES and not manifest.preference:
        raise PylonError(
            f"objective {spec.objective}: data.uri {spec.data.uri} holds no preference pairs; prepare JSONL of prompt, "
            "chosen and rejected with `pylon data prepare --preference`"
        )
    if spec.objective not in RL_OBJECTIVES and manifest.prompts:
        raise PylonError(
            f"objective {spec.objective}: data.uri {spec.data.uri} holds prompts (`pylon data prepare --prompts`), "
            "whose answers may be empty, for objective grpo or rloo; prepare prompt and completion records with "
            "`--prompt-completion` to fine-tune on them"
        )
    if spec.objective in RL_OBJECTIVES:
        from pylon.jobs.grpo import check_rewards

        if manifest.preference or not manifest.loss_mask or not manifest.document_starts:
            held = "preference pairs" if manifest.preference else "text" if not manifest.loss_mask else "conversations"
            raise PylonError(
                f"objective {spec.objective}: data.uri {spec.data.uri} holds {held}"
                + (
                    " without the marks of where each starts (prepared by an older Pylon)"
                    if held == "conversations"
                    else ""
                )
                + "; it samples completions of prompts: prepare JSONL of prompts and their answers, which the reward "
                "functions compare with, with `pylon data prepare --prompts` (or `--prompt-completion`), or "
                "conversations (the last assistant reply the answer) with `--chat`"
            )
        check_rewards(spec, manifest)
    if spec.objective == "kto":
        from pylon.jobs.kto import KtoLoss, balance_note, label_counts

        if not manifest.prompt_completion or manifest.preference or manifest.prompts or not manifest.document_starts:
            held = "preference pairs" if manifest.preference else "prompts" if manifest.prompts else "other data"
            raise PylonError(
                f"objective kto: data.uri {spec.data.uri} holds {held}; it learns from completions each labelled "
                "desirable or not: prepare JSONL of prompt, completion and label (true or false) with `pylon data "
                "prepare --prompt-completion`"
            )
        if labels:
            return [balance_note(*label_counts(spec.data.uri, manifest), KtoLoss.of(spec))]
    if spec.objective == "reward" and manifest.preference_format == "mixed":
        raise PylonError(
            f"objective reward: data.uri {spec.data.uri} holds pairs given both as text and as conversations, which a "
            "reward model reads at different tokens (a text completion before the eos prepare appends, a "
            "conversation at its template's last token); prepare them in one format"
        )
    return []


def _check_eagle3_model(spec: TrainJobSpec, manifest) -> None:
    """objective eagle3: the data is text, chat or prompt-completion records (the tokens the model answers with), and
    the model one the engine keeps the hidden states of for an EAGLE-3 head, with the layers `eagle3.aux_layers`
    names."""
    from pylon.draft_head import aux_layers
    from pylon.models import model_config
    from pylon.serving.model.eagle import refused
    from pylon.serving.model.families import LLAMA_FAMILIES
    from pylon.specs import Eagle3Spec

    if manifest.preference:
        raise PylonError(
            f"objective eagle3: data.uri {spec.data.uri} holds preference pairs; a drafting head learns the model's "
            "next tokens over text, chat or prompt-completion records (the tokens it answers with)"
        )
    config = model_config(spec.model)
    why = refused("eagle3", config.model_type, LLAMA_FAMILIES)
    if why:
        raise PylonError(f"objective eagle3: model.path {spec.model.path} is a {config.model_type} model: {why}")
    settings = spec.eagle3 or Eagle3Spec()
    aux_layers(settings.aux_layers, config.num_hidden_layers)  # (the fault named, before any worker starts)


def check_completion_room(config, seq_len: int, max_tokens: int) -> None:
    """Objective grpo: a PylonError naming grpo.max_completion_tokens unless a prompt as long as a row (`seq_len`) and
    a completion of `max_tokens` fit the model's positions (`max_position_embeddings`, where it has one)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and seq_len + max_tokens > limit:
        raise PylonError(
            f"grpo.max_completion_tokens: {max_tokens} after a prompt of up to the dataset's seq_len {seq_len} makes "
            f"{seq_len + max_tokens} positions, more than the model's {limit}; lower it to {max(limit - seq_len, 0)} "
            "or prepare the prompts with a shorter --seq-len"
        )


def train_loop(config: dict) -> None:
    import random

    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    import deepspeed

    from pylon.data.reader import stream_from_spec
    from pylon.data.shards import separate_documents
    from pylon.jobs.checkpoint import CheckpointCommitter, RayTrainReports
    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.dpo import DpoLoss, RunningMean, dpo_forward, dpo_record, frozen_reference
    from pylon.jobs.eagle import eagle3_record
    from pylon.jobs.grpo import (
        STAT_NAMES,
        GrpoEvaluation,
        GrpoLoss,
        Rewards,
        grpo_record,
        grpo_sample,
        grpo_train,
        sample_seed,
    )
    from pylon.jobs.kto import KtoLoss, kto_forward, kto_record
    from pylon.jobs.ledger import AttemptRecorder
    from pylon.jobs.train_metrics import TrainMetrics
    from pylon.models import (
        ActivationOffload,
        build_model,
        flops_per_token,
        measure_matmul_peak_flops,
        parameter_counts,
        router_aux_coef,
        without_padding_warning,
    )

    started_at = time.time()
    spec = TrainJobSpec.model_validate(config["spec"])
    run_uri = config["run_uri"]
    _return_freed_memory()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    seed = spec.data.shuffle_seed
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)

    deepspeed.init_distributed(dist_backend="nccl" if spec.scaling.use_gpu else "gloo")
    _record_placement(run_uri, rank, world)
    # scaling.sequence_parallel (pylon.jobs.sequence_parallel): groups of ranks that read the same rows, each computing
    # a slice of every row's tokens; the data is split among the groups
    sp = sequence_parallel.groups(spec.scaling.sequence_parallel, rank, world)
    data_rank, data_world = (sp.data_rank, sp.data_world) if sp is not None else (rank, world)
    # the rows' records (their source records' other fields): what grpo's and rloo's reward functions and kto's labels
    # read; the other objectives never open the records files
    records = spec.objective in (*RL_OBJECTIVES, "kto")
    stream = stream_from_spec(
        spec.data, batch_size=spec.batch.micro_batch_size, rank=data_rank, world_size=data_world, records=records
    )
    val_stream = None
    if spec.data.validation_fraction > 0:  # the held-out split: the tail of the id space, never trained on
        val_stream = stream_from_spec(
            spec.data,
            batch_size=spec.batch.micro_batch_size,
            rank=data_rank,
            world_size=data_world,
            split="validation",
            records=records,
        )
    tok = stream.manifest.tokenizer
    documents = separate_documents(spec.attention_mask, stream.manifest, f"data.uri {spec.data.uri}")
    check_objective(spec, stream.manifest, labels=False)  # (the labels: read and counted by the driver)
    dpo = spec.objective in PREFERENCE_OBJECTIVES  # dpo, simpo, orpo, reward (pylon.jobs.dpo)
    dpo_loss = DpoLoss.of(spec, stream.manifest)
    # objective kto (pylon.jobs.kto): unpaired completions, each labelled desirable or not in its record
    kto = KtoLoss.of(spec) if spec.objective == "kto" else None
    # objective grpo (pylon.jobs.grpo): completions sampled by the model, scored by the reward functions (decoded text)
    grpo = GrpoLoss.of(spec) if spec.objective in RL_OBJECTIVES else None
    rewards = Rewards.of(spec.grpo, stream.manifest.record_fields) if grpo is not None else None
    grpo_eval = None
    if grpo is not None:
        from pylon.data.tokenizer import load_tokenizer

        text_tokenizer = load_tokenizer(tok.uri or "byte")
    ds_config = build_deepspeed_config(spec, world_size=world)
    if spec.scaling.use_gpu and spec.deepspeed.offload_optimizer == "none":
        _torch_adam_unless_fused_adam_builds(ds_config, rank)
    # ZeRO-3 builds partitioned (zero.Init): no process ever holds the whole model, nor pretrained weights. Stages
    # 0-2 build once, on rank 0, which broadcasts; the other ranks allocate straight on their GPU.
    model = build_model(
        spec,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        seed=seed,
        deepspeed_config=ds_config,
        device=ray.train.torch.get_device() if spec.scaling.use_gpu else None,
    )
    if documents:
        without_padding_warning(model)  # the padding of a document batch is a segment of its own: nothing to warn of
    eagle3 = None  # objective eagle3 (pylon.jobs.eagle): the model frozen beside the drafting head it trains
    if spec.objective == "eagle3":
        model = eagle3 = _eagle3_trainer(model, spec, run_uri, rank, seed)
    if sp is not None:  # (every rank: each raises the same)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        sequence_parallel.check(base.config, sp.size, stream.manifest.seq_len, spec.model.describe())
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    device = engine.device
    if rewards is not None:
        rewards.to(device)
    synced = spec.deepspeed.zero_stage == 3 and world > 1  # ZeRO-3's gathering forward passes: in step on every rank
    if grpo is not None:
        grpo_eval = GrpoEvaluation(engine, grpo, rewards, text_tokenizer, tok.eos_id, tok.pad_id, device, synced)
    # objective dpo's reference: with lora, the model with its adapters disabled; without, a frozen copy of it (the
    # other preference objectives have none)
    reference = None
    referenced = (dpo and dpo_loss.needs_reference) or (grpo is not None and grpo.needs_reference) or kto is not None
    if spec.precompute_reference:
        from pylon.jobs.reference_cache import committed

        ahead = committed(run_uri, stream.manifest, dpo_loss)  # (a resumed run's table: no reference to build)
    if referenced and spec.lora is None and not (spec.precompute_reference and ahead):
        reference = frozen_reference(
            spec,
            ds_config,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            seed=seed,
            device=ray.train.torch.get_device() if spec.scaling.use_gpu else None,
            dtype=_compute_dtype(spec.precision),
        )
    chunked = spec.loss_chunk_tokens > 0
    if chunked:  # every rank, as below
        check_chunked_loss(engine, tok.vocab_size, aux=router_aux_coef(model.config) > 0, device=device)
    if documents:  # every rank: under ZeRO-3 the forward passes gather parameters collectively
        left = check_document_attention(
            engine.module.target if eagle3 is not None else engine,
            tok.vocab_size,
            where=spec.model.describe(),
            device=device,
        )
        if rank == 0:
            print(
                f"attention_mask document: each packed document attended on its own (checked: {left:.1e} of the "
                "cross-document effect left)",
                flush=True,
            )
    if rank == 0:
        total, trainable = parameter_counts(model)
        print(
            f"model: {total:,} parameters, {trainable:,} trainable"
            + (f" (LoRA r={spec.lora.r} on {', '.join(spec.lora.target_modules)})" if spec.lora else "")
            + (
                f" (an EAGLE-3 head reading the inputs of layers {', '.join(map(str, eagle3.aux))}, "
                f"{len(eagle3.head.draft_tokens):,} draft tokens, {eagle3.steps} drafts deep; the model frozen)"
                if eagle3 is not None
                else ""
            ),
            flush=True,
        )
        if reference is not None:
            print(
                f"objective {spec.objective}: the reference is a frozen copy of the model as it started ("
                + ("partitioned as the model is, ZeRO-3" if spec.deepspeed.zero_stage == 3 else "whole on every rank")
                + f", {spec.precision})",
                flush=True,
            )
    ref_table = None  # precompute_reference: every document's reference value, read once (pylon.jobs.reference_cache)
    if spec.precompute_reference:
        from pylon.jobs.reference_cache import precompute

        ref_table, took, reused = precompute(
            reference,
            engine.module,
            spec.data.uri,
            stream.manifest,
            run_uri,
            rank=rank,
            world=world,
            micro_batch_size=spec.batch.micro_batch_size,
            device=device,
            loss=dpo_loss,
            model_inputs=model_inputs,
            padding=lambda: _padding_batch(stream, device),
        )
        if rank == 0:
            print(
                f"objective dpo: the reference's log-probabilities of {len(ref_table.rows):,} rows' documents "
                + ("read from this run's reference_logprobs/" if reused else f"precomputed in {took:.1f} s")
                + ("; the frozen copy let go" if reference is not None else ""),
                flush=True,
            )
        reference = None  # (nothing holds the frozen copy now: its memory goes back)
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    committer = CheckpointCommitter(
        run_uri,
        rank=rank,
        world_size=world,
        keep_last=spec.checkpoint.keep_last,
        keep_every=spec.checkpoint.keep_every,
        async_upload=spec.checkpoint.async_upload,
        exclude_frozen=eagle3 is not None,
    )
    ray_reports = RayTrainReports(committer)
    step, tokens_seen = 0, 0
    # dpo_loss bco_pair's running mean of the rewards: in every checkpoint, so that a resumed run goes on with it
    running = RunningMean() if dpo and dpo_loss.bco else None
    latest = committer.latest()
    if latest is not None:
        extra = committer.load(engine, latest)
        stream.load_state_dict(extra["data"])
        step, tokens_seen = latest.step, int(extra.get("tokens_seen", 0))
        if running is not None and "bco_running" in extra:
            running.load_state_dict(extra["bco_running"])
        if rank == 0:
            print(f"resumed {spec.name} from step {step} ({latest.uri})", flush=True)
    metrics = MetricsLog(run_uri, enabled=rank == 0, resume_step=step)
    completions = CompletionsLog(run_uri, enabled=rank == 0 and grpo is not None, resume_step=step)

    cfg = model.config if not hasattr(model, "get_base_model") else model.get_base_model().config
    if grpo is not None:  # a prompt as long as a row and its longest completion must fit the model's positions
        check_completion_room(cfg, stream.manifest.seq_len, grpo.max_tokens)
    rollout_engine = None  # grpo.sampler engine (pylon.jobs.rollout): a serving engine beside the model samples
    if grpo is not None and spec.grpo.sampler == "server":  # or in sampling servers of their own
        from pylon.jobs.rollout import RemoteRollout

        rollout_engine = RemoteRollout(
            tok.model_dump(mode="json"),
            spec=spec,
            seq_len=stream.manifest.seq_len,
            servers=config["sampler_servers"],
            namespace=config["sampler_namespace"],
            rank=rank,
            world=world,
        )
        grpo_eval.rollout = rollout_engine
        if rank == 0:
            print(
                f"grpo.sampler server: completions sampled by {len(config['sampler_servers'])} sampling server(s) "
                f"({rollout_engine.spec.device}, {rollout_engine.spec.dtype}, "
                f"{rollout_engine.spec.kv_cache_tokens:,} KV tokens, {rollout_engine.spec.max_num_seqs} at once), "
                "sent the policy's weights before each sampling step",
                flush=True,
            )
    if grpo is not None and spec.grpo.sampler == "engine":  # (every rank: at ZeRO-3 its weights gather collectively)
        from pylon.jobs.rollout import RolloutEngine

        rollout_engine = RolloutEngine(
            engine, tok.model_dump(mode="json"), spec=spec, device=device, seq_len=stream.manifest.seq_len
        )
        grpo_eval.rollout = rollout_engine
        if rank == 0:
            print(
                f"grpo.sampler engine: completions sampled by a serving engine beside the model on each worker "
                f"({rollout_engine.spec.dtype}, {rollout_engine.spec.kv_cache_tokens:,} KV tokens, "
                f"{rollout_engine.spec.max_num_seqs} at once), given the policy's weights before each sampling step",
                flush=True,
            )
    flops_tok = flops_per_token(cfg, stream.manifest.seq_len)
    if eagle3 is not None:  # the frozen model's forward pass, and the head's drafts trained
        from pylon.draft_head import head_flops_per_token, head_parameters

        matmul = head_parameters(eagle3.head.config)[1]
        head = head_flops_per_token(matmul, eagle3.head.config.hidden_size, stream.manifest.seq_len, eagle3.steps)
        flops_tok = flops_tok / 3 + head
    trained_flops = flops_tok  # objective grpo's MFU counts its passes itself (Rollout.trained_token_units)
    if referenced and ref_table is None:  # the reference's forward pass too: a third of a trained token's FLOPs
        flops_tok *= 4 / 3
    if kto is not None and kto.baseline:  # and the KL baseline's two, over as many tokens (mismatched pairs)
        flops_tok *= 6 / 4
    aux_coef = router_aux_coef(cfg)
    # The peak is measured in the precision the model trains in, on the worker's own device.
    peak = measure_matmul_peak_flops(seconds=0.5, device=device, dtype=_compute_dtype(spec.precision))
    gas = spec.batch.grad_accum_steps
    batches = _batches(stream)
    ledger = AttemptRecorder(
        run_uri,
        session=config.get("session"),
        workers=world,
        resources_per_worker=spec.scaling.resources_per_worker or {"CPU": 1},
        resumed_from=step,
        accelerator=torch.cuda.get_device_name(device) if getattr(device, "type", "") == "cuda" else None,
        flops_per_token=flops_tok,
        peak_flops=peak,
        started_at=started_at,
        enabled=rank == 0,
    )
    ledger.update(force=True)
    prometheus = TrainMetrics(spec.name, rank)

    def moved() -> list[float]:  # this rank's bytes so far: data read, checkpoints written, checkpoints read
        data = stream.stats.bytes_read + (val_stream.stats.bytes_read if val_stream is not None else 0)
        data *= sp is None or sp.reads_data  # (a sequence-parallel group's ranks read the same rows: counted once)
        return [float(data), float(committer.bytes_written), float(committer.bytes_read)]

    def record_moved(totals) -> None:
        ledger.bytes_moved(data_read=totals[0], checkpoint_written=totals[1], checkpoint_read=totals[2])

    rollouts: dict = {}  # objective grpo with iterations > 1: the last sampled batch's micro-batches, by index
    # sequence parallelism: from here to the end of training, attention runs across the group over sharded rows
    scope = contextlib.ExitStack()
    scope.enter_context(sequence_parallel.enabled(engine.module, sp, spec.batch.micro_batch_size))
    if sp is not None and rank == 0:
        print(
            f"{sequence_parallel.FIELD}: {data_world} group(s) of {sp.size} workers, each worker computing "
            f"{stream.manifest.seq_len // sp.size} of every row's {stream.manifest.seq_len} tokens",
            flush=True,
        )

    def offload_step():
        """A micro-batch's forward pass runs in this: `activation_offload`'s hooks (pylon.models.ActivationOffload,
        counting afresh), or nothing."""
        return ActivationOffload(engine.module, device) if spec.activation_offload else contextlib.nullcontext()

    while step < spec.steps:
        t_step = time.perf_counter()
        step_started_at = time.time()
        wait_s, loss_sum, tokens_sum, aux_sum, aux_n = 0.0, 0.0, 0, 0.0, 0
        offloaded_peak = 0  # activation_offload: the most bytes a micro-batch kept in host memory
        # objective dpo: pairs; chosen and rejected rewards, correct pairs. kto: completions; desirable and undesirable
        # rewards, their counts, the KL baseline
        # objective eagle3: per draft depth, the drafts whose top token is the model's, and the drafts counted
        pairs_sum, dpo_sums = 0, [0.0] * (2 * eagle3.steps if eagle3 is not None else 5 if kto is not None else 3)
        grpo_sums, sample_s = [0.0] * (len(STAT_NAMES) + 2 * len(rewards.functions) if rewards else 0), 0.0
        grpo_units = 0.0  # objective grpo: its model FLOPs this step, in trained tokens (sampling included)
        samples: list = []  # objective grpo: the first micro-batch's logged completions (`grpo.log_completions`)
        # objective grpo: a step that samples (and reads data), or one of the later updates on the last sampled batch
        fresh = grpo is None or step % grpo.iterations == 0
        for micro in range(gas):
            batch = next(batches) if fresh else None
            wait_s += batch.wait_s if batch is not None else 0.0
            inputs = (
                None  # (objective grpo trains on the completions it samples)
                if grpo is not None
                else batch.to_torch(tok.pad_id, device=device, documents=documents)
                if len(batch)
                else _padding_batch(stream, device)
            )
            if sp is not None:
                inputs = sequence_parallel.shard(inputs, sp)
            # activation_offload: what the forward pass keeps for the backward pass waits in host memory
            with offload_step() as offload:
                if grpo is not None:  # sample and score, then train (its loss averaged over what `grpo.loss` says)
                    if fresh:
                        rollout = grpo_sample(
                            engine,
                            batch,
                            grpo,
                            rewards,
                            text_tokenizer,
                            eos_id=tok.eos_id,
                            pad_id=tok.pad_id,
                            seed=sample_seed(seed, step, micro, rank),
                            synced=synced,
                            reference=reference,
                            rollout=rollout_engine,
                        )
                        sample_s += rollout.sample_s
                        if micro == 0:  # (rank 0's are logged: `grpo.log_completions`)
                            samples = rollout.samples
                        if grpo.iterations > 1:
                            rollouts[micro] = rollout
                    else:
                        rollout = rollouts[micro]
                    loss_t, count, n_tokens, stats = grpo_train(
                        engine, engine.module, rollout, grpo, reference, first=fresh
                    )
                    grpo_units += rollout.trained_token_units(grpo, fresh)
                    loss, local_sum = _global_mean_loss(loss_t, count, world)
                    aux = None
                    pairs_sum += count
                    grpo_sums = [a + b for a, b in zip(grpo_sums, stats)]
                elif dpo:
                    loss_t, pairs, n_tokens, stats, _ = dpo_forward(
                        engine,
                        engine.module,
                        inputs,
                        dpo_loss,
                        f"data.uri {spec.data.uri}",
                        model_inputs,
                        reference,
                        running=running,
                        precomputed=ref_table.lookup(batch.sample_ids, device) if ref_table is not None else None,
                    )
                    loss, local_sum = _global_mean_loss(loss_t, pairs, world)
                    aux = None
                    pairs_sum += pairs
                    dpo_sums = [a + b for a, b in zip(dpo_sums, stats)]
                elif kto is not None:
                    loss_t, completions_n, n_tokens, stats, _ = kto_forward(
                        engine,
                        engine.module,
                        inputs,
                        batch,
                        kto,
                        f"data.uri {spec.data.uri}",
                        model_inputs,
                        reference,
                        eos_id=tok.eos_id,
                        pad_id=tok.pad_id,
                    )
                    loss, local_sum = _global_mean_loss(loss_t, completions_n, world)
                    aux = None
                    pairs_sum += completions_n
                    dpo_sums = [a + b for a, b in zip(dpo_sums, stats)]
                elif eagle3 is not None:  # (its loss a TokenLoss's: its drafts' weighted soft cross-entropy)
                    loss_t, n_tokens, out = forward_loss(engine, inputs, chunked=True)
                    loss, local_sum = _global_mean_loss(loss_t, n_tokens, world)
                    aux = None
                    dpo_sums = [a + b for a, b in zip(dpo_sums, out["stats"])]
                else:
                    loss, local_sum, n_tokens, aux = step_loss(engine, inputs, world, aux_coef, chunked=chunked)
            engine.backward(loss)
            if offload is not None:
                offloaded_peak = max(offloaded_peak, offload.peak_host_bytes)
            engine.step()
            loss_sum += local_sum
            tokens_sum += n_tokens
            if aux is not None and n_tokens:
                aux_sum, aux_n = aux_sum + aux, aux_n + 1
        step += 1
        step_s = time.perf_counter() - t_step
        # fp16: a step whose gradients overflowed was skipped by DeepSpeed (its update not applied; the loss scale
        # halves after `hysteresis` such steps in a row): said in the step's record and the log, not passed off as
        # a trained step.
        skipped = spec.precision == "fp16" and not engine.was_step_applied()
        # On the device the process group reduces on: NCCL reduces CUDA tensors only, gloo CPU ones.
        totals = torch.tensor(
            [
                loss_sum,
                float(tokens_sum),
                *moved(),
                aux_sum,
                float(aux_n),
                float(pairs_sum),
                *dpo_sums,
                *grpo_sums,
                grpo_units,
            ],
            dtype=torch.float64,
            device=device,
        )
        if dist.is_initialized():
            dist.all_reduce(totals)
        global_tokens = int(totals[1].item())
        ledger.step(step, step_s=step_s, wait_s=wait_s, tokens=global_tokens, started_at=step_started_at)
        record_moved(totals[2:5].tolist())
        tokens_seen += global_tokens
        record = {
            "step": step,
            # the mean over the global batch's tokens; a preference objective's: over its pairs; grpo's: over what its
            # loss is averaged over
            "loss": totals[0].item()
            / max(totals[7].item() if dpo or grpo is not None or kto is not None else global_tokens, 1),
            "lr": float(engine.get_lr()[0]) if engine.get_lr() else 0.0,
            "tokens": global_tokens,
            "tokens_seen": tokens_seen,
            "tokens_per_s": global_tokens / step_s,
            "step_time_s": step_s,
            "data_wait_fraction": min(1.0, wait_s / step_s) if step_s > 0 else 0.0,
            # model FLOPs over the workers' matmul peak; objective grpo's count its sampling and every pass over
            # prompts and completions, not only the completion tokens it reports
            "mfu": (
                (trained_flops * totals[-1].item() if grpo is not None else flops_tok * global_tokens)
                / step_s
                / (peak * world)
                if peak
                else 0.0
            ),
            "peak_memory_bytes": _peak_memory_bytes(device),
            "epoch": stream.position.epoch,
        }
        if dpo:  # the pairs' rewards, margin and accuracy (TRL's figures)
            record.update(dpo_record(*totals[[0, 7, 8, 9, 10]].tolist(), name=dpo_loss.objective))
        if kto is not None:  # the completions' rewards, margin and KL baseline (TRL's figures)
            record.update(kto_record(*totals[[0, 7, 8, 9, 10, 11, 12]].tolist(), passes=gas * world))
        if eagle3 is not None:  # each draft depth's accuracy, and the chain's expected accepted drafts
            record.update(eagle3_record(totals[8 : 8 + 2 * eagle3.steps].tolist()))
        if grpo is not None:  # the completions' rewards, lengths and KL (TRL's figures); this rank's sampling time
            record.update(
                grpo_record(
                    totals[11:-1].tolist(),
                    rewards.names,
                    online_dpo=grpo.online_dpo,
                    corrected=grpo.corrects,
                    judged=rewards.judged,
                ),
                grpo_sample_s=sample_s,
            )
        if spec.activation_offload:  # this worker's: what its forward passes kept in host memory at most
            record["activation_offload_bytes"] = offloaded_peak
        if aux_coef:  # a mixture-of-experts model: its routers' load-balancing loss, the micro-batches' mean
            record["router_aux_loss"] = totals[5].item() / max(totals[6].item(), 1.0)
        if spec.precision == "fp16":
            record["loss_scale"] = float(engine.optimizer.loss_scale)
            record["skipped"] = skipped
            record["skipped_steps"] = int(engine.skipped_steps)
            if skipped and rank == 0:
                print(
                    f"step {step}: fp16 gradients overflowed; the update was skipped (loss scale now "
                    f"{record['loss_scale']:g}, {record['skipped_steps']} steps skipped so far)",
                    flush=True,
                )
        metrics.write(record)
        if grpo is not None and fresh:
            completions.write_step(step, samples)
        prometheus.step(record)
        last = step == spec.steps
        outside_s = 0.0  # loop time that is neither the step nor its bookkeeping
        if val_stream is not None and (last or (spec.eval.every_steps and step % spec.eval.every_steps == 0)):
            # Before the checkpoint below: its metrics then hold this evaluation (an export of it reads it there).
            t0 = time.perf_counter()
            metrics.write_eval(
                _evaluate(
                    engine,
                    val_stream,
                    step,
                    max_batches=spec.eval.max_batches,
                    documents=documents,
                    chunked=chunked,
                    dpo_loss=dpo_loss if dpo else None,
                    kto=kto,
                    pad_eos=(tok.pad_id, tok.eos_id),
                    ref_table=ref_table,
                    reference=reference,
                    running=running,
                    grpo_eval=grpo_eval,
                    eagle3=eagle3.steps if eagle3 is not None else 0,
                    sp=sp,
                )
            )
            outside_s += time.perf_counter() - t0
            ledger.add("evaluation_s", time.perf_counter() - t0)
        saving = step % spec.checkpoint.every_steps == 0 or last
        if saving:
            # Metrics first: a crash between the two leaves records past the last commit, which a resume
            # drops; the other order could commit a step whose records were never written.
            metrics.flush()
            completions.flush()
            ledger.saving(step)
            t0 = time.perf_counter()
            try:
                committer.save(
                    engine,
                    step,
                    extra={
                        "data": stream.state_dict(),
                        "tokens_seen": tokens_seen,
                        **({"bco_running": running.state_dict()} if running is not None else {}),
                    },
                    meta={"loss": record["loss"], "tokens_seen": tokens_seen},
                )
            except BaseException:
                ledger.checkpoint(step, {"failed_s": time.perf_counter() - t0}, ok=False)
                ledger.update(force=True)
                prometheus.checkpoint(time.perf_counter() - t0, ok=False)
                raise
            outside_s += time.perf_counter() - t0
            ledger.checkpoint(step, committer.last_blocked)
            prometheus.checkpoint(time.perf_counter() - t0, ok=True)
        if saving or step % 10 == 0:
            # Every rank, at the same steps; rank 0 attaches the checkpoint it knows committed (this step's, or
            # with async_upload the previous save's: this save waited for it).
            reported = {k: record[k] for k in ("step", "loss", "tokens_per_s", "data_wait_fraction", "mfu")}
            ray_reports.report(reported, step=step, saved=saving)
        # the loop's own bookkeeping (metrics, reports) counts with the step it follows
        ledger.add("productive_s", time.perf_counter() - t_step - step_s - outside_s)
        ledger.update(force=saving)
    t0 = time.perf_counter()
    try:
        committer.wait()
    except BaseException:
        ledger.checkpoint(step, {"failed_s": time.perf_counter() - t0}, ok=False)
        ledger.update(force=True)
        prometheus.checkpoint(time.perf_counter() - t0, ok=False)
        raise
    ledger.add("checkpoint_stall_s", time.perf_counter() - t0)
    prometheus.checkpoint(time.perf_counter() - t0, ok=True)
    ray_reports.finish()  # with async_upload, the last save: committed in the background
    scope.close()  # (the reference logits below: a whole row on every rank)
    metrics.flush()
    completions.flush()
    if eagle3 is None:  # (a head has no logits of its own to check an export against)
        _record_reference_logits(engine, run_uri, rank, stream.manifest.seq_len)
    totals = torch.tensor(moved(), dtype=torch.float64, device=device)  # the last upload's bytes, from every rank
    if dist.is_initialized():
        dist.all_reduce(totals)
    record_moved(totals.tolist())
    ledger.finish()


def _eagle3_trainer(model, spec: TrainJobSpec, run_uri: str, rank: int, seed: int):
    """objective eagle3: the frozen `model` beside a new EAGLE-3 head (pylon.jobs.eagle), its draft vocabulary chosen
    by rank 0 from the training split's labels and given to every rank; a run that resumes reads it from its
    checkpoint (the head's `draft_tokens`) instead, and reads no data for it."""
    import torch
    import torch.distributed as dist

    from pylon.data.reader import stream_from_spec
    from pylon.jobs.checkpoint import list_committed
    from pylon.jobs.eagle import build_trainer, draft_vocabulary
    from pylon.specs import Eagle3Spec

    settings = spec.eagle3 or Eagle3Spec()
    vocab = model.config.vocab_size
    chosen = None
    if rank == 0 and list_committed(run_uri):  # (a placeholder of its size: the checkpoint's replaces it)
        chosen = list(range(min(settings.draft_vocab_size, vocab)))
        print(
            f"objective eagle3: the draft vocabulary of {len(chosen):,} of the model's {vocab:,} tokens comes with "
            "the checkpoint it resumes from",
            flush=True,
        )
    elif rank == 0:
        t0 = time.perf_counter()
        stream = stream_from_spec(spec.data, batch_size=spec.batch.micro_batch_size, rank=0, world_size=1)
        ids, seen, covered = draft_vocabulary(stream, settings.draft_vocab_size, vocab, settings.vocab_sample_tokens)
        chosen = ids.tolist()
        print(
            f"objective eagle3: a draft vocabulary of {len(chosen):,} of the model's {vocab:,} tokens, "
            f"{covered:.1%} of the {seen:,} counted tokens of the training split read "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [chosen]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    return build_trainer(model, spec, torch.tensor(chosen, dtype=torch.long), seed=seed + 1)


def _torch_adam_unless_fused_adam_builds(ds_config: dict, rank: int) -> None:
    """On a GPU DeepSpeed steps AdamW with its fused CUDA kernel, compiled (nvcc) the first time a process needs it.
    Where it cannot be built (no CUDA compiler, or one that does not match torch's CUDA), torch's fused AdamW takes
    the step instead (the same update; DeepSpeed's `torch_adam`) and the job's log says why, rather than the job
    failing at start."""
    from deepspeed.accelerator import get_accelerator

    from pylon.ops import plain_cuda_arch_list

    plain_cuda_arch_list()  # the engine builds it too, in this process, reading the same list
    try:
        builder = get_accelerator().create_op_builder("FusedAdamBuilder")
        if builder is None or not builder.is_compatible(verbose=False):
            raise RuntimeError("not compatible with this machine")
        builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure has the same remedy
        ds_config["optimizer"]["params"].update(torch_adam=True, fused=True)
        if rank == 0:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            print(
                f"DeepSpeed's fused Adam could not be built here ({reason}); torch's fused AdamW takes the step",
                flush=True,
            )


def _return_freed_memory() -> None:
    """Make this worker give freed memory back to the system (glibc's malloc).

    By default glibc serves allocations below a threshold that grows up to 32 MiB from its heap, and keeps what is
    freed there for reuse. DeepSpeed's gathered parameters, gradient buckets and swap staging are transient blocks of
    megabytes, so a ZeRO-3 worker's resident memory climbs far above what it holds at any moment. From here on,
    blocks of 1 MiB or more are their own mappings, unmapped when freed, the heap is trimmed above 1 MiB, and two
    arenas serve the threads. Measured on a 1B-parameter ZeRO-3 run with NVMe offload: a worker's peak fell from
    4.0 to 2.8 GB (tests/integration/test_offload_memory_cap.py). A no-op under another malloc (TCMalloc preloaded).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # <malloc.h>
    for option, value in ((m_mmap_threshold, 1 << 20), (m_trim_threshold, 1 << 20), (m_arena_max, 2)):
        mallopt(option, value)


def _record_reference_logits(engine, run_uri: str, rank: int, seq_len: int) -> None:
    """The trained engine's logits on a fixed input, so an export can be checked against the engine itself.
    Every rank runs the forward pass (under ZeRO-3 it gathers parameters collectively); rank 0 records."""
    import torch

    ids = (torch.arange(min(seq_len, 32), device=engine.device) % 200).unsqueeze(0)
    engine.eval()
    with torch.no_grad():
        logits = position_outputs(engine, input_ids=ids).float()
    engine.train()
    if rank == 0:
        storage.atomic_write_json(
            storage.join(run_uri, REFERENCE_FILE), {"input_ids": ids[0].tolist(), "logits": logits[0, :, :16].tolist()}
        )


def _batches(stream):
    """Batches across epochs, forever (the step count, not the epoch count, ends training)."""
    while True:
        yield from stream.epoch()


def _padding_batch(stream, device) -> dict:
    """One all-padding row for a worker whose epoch ran out a step before the others: it joins the
    collective step with zero tokens, contributing nothing to the loss or the gradients."""
    import torch

    seq = stream.manifest.seq_len
    ids = torch.full((1, seq), stream.manifest.tokenizer.pad_id, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100)}


def model_inputs(inputs: dict) -> dict:
    """The keyword arguments a causal LM takes for `Batch.to_torch`'s inputs: all but the labels, and no KV cache,
    which a training or scoring pass has no use for and whose presence stops `transformers` from reading packed
    documents from `position_ids` (it then attends across them)."""
    return {**{k: v for k, v in inputs.items() if k != "labels"}, "use_cache": False}


def position_outputs(model, **inputs):
    """`model`'s output at every position: a causal LM's logits, or a classifier's head (objective reward's reward
    model, whose own output is each row's last position only). `model` may be a DeepSpeed engine."""
    from pylon.models import head_outputs, is_classifier

    module = getattr(model, "module", model)
    if not is_classifier(module.config):
        return model(**inputs).logits
    with head_outputs(module) as heads:
        model(**inputs)
    return heads[-1]


# Two documents the document-attention check packs into one row: the second's logits must not see the first.
_PROBE_LENGTHS = (16, 16)
_PROBE_LEAK = 0.1  # largest share of the cross-document effect left by a working mask (numerical noise: ~1e-6 fp32)


def check_document_attention(model, vocab_size: int, *, where: str, device=None) -> float:
    """Fail unless `model` attends packed documents apart (`attention_mask: document`): the second of two documents
    packed into a row, with `position_ids` restarting, must give the logits it gives alone. Some architectures build
    their masks or positions another way and would silently attend across (in transformers 5: Falcon, OPT, BLOOM
    among others). Measured against the same row attended plainly, so the bound holds in bf16 and fp16 too.
    Every rank calls it (ZeRO-3 gathers parameters collectively). Returns the share of the effect left."""
    import torch

    a, b = _PROBE_LENGTHS
    device = device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    first = (torch.arange(a, device=device) * 7 + 3) % vocab_size
    second = (torch.arange(b, device=device) * 5 + 11) % vocab_size
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(a, device=device), torch.arange(b, device=device)])[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = position_outputs(model, input_ids=second[None], use_cache=False).float()
            packed = position_outputs(model, input_ids=row, position_ids=positions, use_cache=False)[:, a:].float()
            plain = position_outputs(model, input_ids=row, use_cache=False)[:, a:].float()
    finally:
        model.train(was_training)
    effect = float((plain - alone).abs().max())
    left = float((packed - alone).abs().max())
    share = left / effect if effect > 0 else 0.0
    if share > _PROBE_LEAK:
        raise PylonError(
            f"attention_mask document: {where} does not attend packed documents apart (a document's logits "
            f"changed by {left:.3g} when another was packed before it, {share:.0%} of the change with no mask at "
            "all); this architecture builds its attention mask or positions without reading packed "
            "position_ids. Set attention_mask: causal (documents in a row then see the ones before them)"
        )
    return share


def step_loss(engine, inputs: dict, world: int, aux_coef: float = 0.0, chunked: bool = False):
    """One micro-batch's training loss (see `_global_mean_loss`), and for a mixture-of-experts model (`aux_coef`:
    `pylon.models.router_aux_coef`) its routers' load-balancing loss weighted by `aux_coef` on top, as transformers'
    MoE models add it (each rank's own, which DeepSpeed's gradient average makes the ranks' mean; nothing for an
    all-padding row). `chunked`: the model computes its loss in chunks (`loss_chunk_tokens`). Returns (loss to
    backpropagate, this rank's summed token loss, its token count, the load-balancing loss as a float or None for a
    dense model)."""
    extra = {"output_router_logits": True} if aux_coef else {}
    loss_sum, n_tokens, out = forward_loss(engine, inputs, chunked, **extra)
    loss, local_sum = _global_mean_loss(loss_sum, n_tokens, world)
    if not aux_coef:
        return loss, local_sum, n_tokens, None
    aux = out.aux_loss
    if n_tokens:
        loss = loss + aux_coef * aux
    return loss, local_sum, n_tokens, float(aux.item())


def forward_loss(model, inputs: dict, chunked: bool = False, **extra):
    """A forward pass of `Batch.to_torch`'s inputs and its summed next-token loss: (loss as a tensor, tokens counted,
    the model's output). `chunked`: the model was made by `pylon.models.with_chunked_loss` and computes the loss
    itself from the labels, a chunk at a time (no logits); else from its logits (`token_loss_sum`)."""
    if chunked:
        out = model(**model_inputs(inputs), labels=inputs["labels"], **extra)
        return out.loss_sum, out.tokens, out
    out = model(**model_inputs(inputs), **extra)
    loss_sum, n_tokens = token_loss_sum(out.logits, inputs["labels"])
    return loss_sum, n_tokens, out


def _global_mean_loss(loss_sum, n_local: int, world: int):
    """Next-token cross-entropy summed over this rank's tokens, divided by the tokens of all ranks and
    multiplied by the world size: DeepSpeed then averages gradients over ranks, which makes the result
    the mean over every token of the global batch, as one process would compute it.
    Returns (loss to backpropagate, this rank's summed loss as a float)."""
    import torch
    import torch.distributed as dist

    n_global = torch.tensor([n_local], dtype=torch.float64, device=loss_sum.device)  # NCCL: a CUDA tensor
    if dist.is_initialized():
        dist.all_reduce(n_global)
    return loss_sum * world / max(n_global.item(), 1.0), float(loss_sum.item())


def check_chunked_loss(model, vocab_size: int, *, aux: bool = False, device=None) -> float:
    """Fail unless `model`'s chunked loss (`pylon.models.with_chunked_loss`) is the loss of its own logits: on two
    rows of a fixed input (a few labels masked), in eval mode, in the training precision. A model that does more to
    its output layer's result than `_logits_transform` knows would train on another objective. Every rank calls it
    (ZeRO-3 gathers parameters collectively). Returns the relative difference."""
    import torch

    device = device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = ((torch.arange(48, device=device) * 7 + 3) % vocab_size).reshape(2, 24)
    labels = ids.masked_fill(torch.arange(24, device=device) % 5 == 0, -100)
    inputs = {"input_ids": ids, "labels": labels}
    extra = {"output_router_logits": True} if aux else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want, n_want, out_want = forward_loss(model, inputs, False, **extra)
            got, n_got, out_got = forward_loss(model, inputs, True, **extra)
    finally:
        model.train(was_training)
    diff = abs(float(got) - float(want)) / max(abs(float(want)), 1e-6)
    if aux:
        a, b = float(out_got.aux_loss), float(out_want.aux_loss)
        diff = max(diff, abs(a - b) / max(abs(b), 1e-6))
    half = next((p.dtype for p in model.parameters()), torch.float32) != torch.float32
    if n_got != n_want or diff > (2e-2 if half else 1e-4):
        raise PylonError(
            f"loss_chunk_tokens: the chunked loss of {type(model).__name__} is {float(got):.6g} over {n_got} "
            f"tokens, its logits' loss {float(want):.6g} over {n_want}: this model does something to its output "
            "layer's result that the chunked loss does not; set loss_chunk_tokens: 0"
        )
    return diff


def token_loss_sum(logits, labels):
    """Next-token cross-entropy summed over the tokens of a batch, and their count: position t predicts label
    t+1, labels -100 (padding) count for nothing; in fp32 whatever the logits' precision. The one loss training
    optimizes and evaluation reports. `labels` may have one column more than `logits` (a sequence-parallel rank's
    slice, `pylon.jobs.sequence_parallel.shard`: its last position's label is the next slice's first token): every
    position then has its label. Returns (summed loss as a tensor, token count as an int)."""
    import torch.nn.functional as F

    shift_logits = logits[:, : labels.shape[1] - 1, :].float()
    shift_labels = labels[:, 1:]
    n_tokens = int((shift_labels != -100).sum().item())
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss_sum, n_tokens


def reduce_eval(
    loss_sum: float, tokens: int, sequences: int, batches: int, *, device=None
) -> tuple[float, int, int, int]:
    """Every rank's share of an evaluation summed over the ranks (float64, so token counts stay exact): the mean
    is then the sum over all tokens over their count, each token weighing the same whichever rank held it, and
    the figure does not depend on the number of workers. `device`: the process group's (a GPU under NCCL)."""
    import torch
    import torch.distributed as dist

    totals = torch.tensor([loss_sum, tokens, sequences, batches], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return float(totals[0].item()), int(totals[1].item()), int(totals[2].item()), int(totals[3].item())


def _evaluate(
    engine,
    val_stream,
    step: int,
    *,
    max_batches: int = 0,
    documents: bool = False,
    chunked: bool = False,
    dpo_loss=None,
    reference=None,
    running=None,
    grpo_eval=None,
    kto=None,
    pad_eos: tuple[int, int] = (0, 0),
    ref_table=None,
    eagle3: int = 0,
    sp=None,
) -> dict:
    """Mean token cross-entropy over the validation split (or each rank's first `max_batches` micro-batches of
    it), in eval mode without gradients; returns its `metrics.jsonl` record. `dpo_loss` (a preference objective):
    the held-out pairs' figures too (`val_dpo_*`, `val_simpo_*`, `val_orpo_*` or `val_reward_*`; dpo's against
    `reference`: `pylon.jobs.dpo.dpo_forward`), the completions' tokens being what val_loss counts (a reward model's
    val_loss: its pairs' loss). Every rank takes part with the
    same number of forward passes, as ZeRO-3's collective parameter gathering needs: each reads its own part of the
    split (the stream pads a short part with empty batches, which run as all-padding rows). `grpo_eval` (objective grpo:
    a `pylon.jobs.grpo.GrpoEvaluation`): its held-out prompts' greedy completions' rewards too. `kto` (objective kto's
    `KtoLoss`; `pad_eos` the tokenizer's pad and eos ids): the held-out completions' figures (`val_kto_*`). `eagle3`
    (objective eagle3: its drafts deep): val_loss is the drafts' (no perplexity), and each depth's accuracy
    (`val_eagle3_*`). `sp` (`pylon.jobs.sequence_parallel.SequenceParallel`): each row's slice, its sequences
    counted once a group."""
    import torch

    from pylon.data.reader import DataPosition
    from pylon.jobs.dpo import dpo_forward, dpo_record
    from pylon.jobs.kto import kto_forward, kto_record

    t0 = time.perf_counter()
    device = engine.device
    pad_id = val_stream.manifest.tokenizer.pad_id
    n_batches = val_stream.steps_per_epoch if not max_batches else min(max_batches, val_stream.steps_per_epoch)
    val_stream.position = DataPosition()  # the same sequences every time: the split from its start
    batches = val_stream.epoch()
    loss_sum, tokens, sequences = 0.0, 0, 0
    dpo_sums = [0.0] * 5  # objective dpo: pairs' loss, pairs, chosen and rejected rewards, correct pairs
    grpo_sums = None  # objective grpo: its figures' sums (`GrpoEvaluation`)
    kto_sums = [0.0] * 8  # objective kto: loss, completions, the rewards' sums, their counts, the baseline, passes
    eagle3_sums = [0.0] * (2 * eagle3)  # objective eagle3: per draft depth, the drafts right and counted
    engine.eval()
    try:
        with torch.no_grad():
            for _ in range(n_batches):
                batch = next(batches)
                inputs = (
                    batch.to_torch(pad_id, device=device, documents=documents)
                    if len(batch)
                    else _padding_batch(val_stream, device)
                )
                if sp is not None:
                    inputs = sequence_parallel.shard(inputs, sp)
                if dpo_loss is not None:
                    pair_loss, pairs, _, stats, out = dpo_forward(
                        engine,
                        engine.module,
                        inputs,
                        dpo_loss,
                        "the validation split",
                        model_inputs,
                        reference,
                        running=running,
                        update=False,  # (bco_pair: read as training left it)
                        precomputed=ref_table.lookup(batch.sample_ids, device) if ref_table is not None else None,
                    )
                    dpo_sums = [a + b for a, b in zip(dpo_sums, [float(pair_loss.item()), pairs, *stats])]
                    # a reward model has no next-token loss: its val_loss is the pairs' (Bradley-Terry)
                    if dpo_loss.scores:
                        part, n = pair_loss, pairs
                    elif dpo_loss.chunked:  # (a TokenLoss: the completions' tokens, a chunk at a time)
                        part, n = out.loss_sum, out.tokens
                    else:
                        part, n = token_loss_sum(out.logits, inputs["labels"])
                elif kto is not None:
                    kto_loss, completions, _, stats, out = kto_forward(
                        engine, engine.module, inputs, batch, kto, "the validation split", model_inputs, reference,
                        pad_id=pad_eos[0], eos_id=pad_eos[1],
                    )  # fmt: skip
                    kto_sums = [a + b for a, b in zip(kto_sums, [float(kto_loss.item()), completions, *stats, 1.0])]
                    if kto.chunked:  # (a TokenLoss: the completions' tokens, a chunk at a time)
                        part, n = out.loss_sum, out.tokens
                    else:
                        part, n = token_loss_sum(out.logits, inputs["labels"])
                else:
                    part, n, out = forward_loss(engine, inputs, chunked or bool(eagle3))
                    if eagle3:
                        eagle3_sums = [a + b for a, b in zip(eagle3_sums, out["stats"])]
                if grpo_eval is not None:
                    stats = grpo_eval(batch)
                    grpo_sums = stats if grpo_sums is None else [a + b for a, b in zip(grpo_sums, stats)]
                loss_sum += float(part.item())
                tokens += n
                sequences += len(batch) if sp is None or sp.reads_data else 0
    finally:
        batches.close()
        engine.train()
    loss_sum, tokens, sequences, n_batches = reduce_eval(loss_sum, tokens, sequences, n_batches, device=device)
    extra = {}
    if dpo_loss is not None:
        sums = torch.tensor(dpo_sums, dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        extra = dpo_record(*sums.tolist(), prefix="val_", name=dpo_loss.objective)
    if kto is not None:
        sums = torch.tensor(kto_sums, dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        extra = kto_record(*sums.tolist(), prefix="val_")
    if grpo_sums is not None:
        from pylon.jobs.grpo import grpo_eval_record

        sums = torch.tensor(grpo_sums, dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        extra = grpo_eval_record(sums.tolist(), grpo_eval.names)
    if eagle3:
        from pylon.jobs.eagle import eagle3_record

        sums = torch.tensor(eagle3_sums, dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        extra = eagle3_record(sums.tolist(), prefix="val_")
    return extra | eval_record(
        step,
        loss_sum=loss_sum,
        tokens=tokens,
        sequences=sequences,
        batches=n_batches,
        val_ids=val_stream.id_range,
        seconds=time.perf_counter() - t0,
        attention_mask="document" if documents else "causal",
        pairs=(dpo_loss is not None and dpo_loss.scores) or bool(eagle3),  # (no perplexity: no next-token loss)
    )


def _compute_dtype(precision: str):
    """The dtype a model trained in `precision` computes in (DeepSpeed casts the module to it)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _peak_memory_bytes(device) -> int:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pylon.jobs.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML file with one TrainJob document")
    parser.add_argument("--no-export", action="store_true", help="skip the export at the end")
    parser.add_argument("--max-failures", type=int, default=3, help="worker-group restarts before giving up")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec = load_spec(args.config, TrainJobSpec)
        summary = run(spec, export=not args.no_export, max_failures=args.max_failures)
    except PylonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"result": summary}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
