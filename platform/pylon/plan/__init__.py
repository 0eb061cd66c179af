"""The planner: before anything launches, will a job fit, where does its memory go, how long will it take, what
will it cost -- and what is the cheapest configuration that fits (`pylon plan FILE`, `client.plan(spec)`).

    plan = plan_spec(spec)                    # TrainPlan for a TrainJob, ServePlan for a Deployment
    print(render(plan))                       # the tables `pylon plan` prints
    plan.to_dict()                            # what `pylon plan --json` prints
    check_fits(spec, client=client)           # WontFitError before `pylon train` asks for workers
    check_serve_fits(spec, nodes)             # WontFitError before `pylon serve` or `pylon batch` deploys a replica

Memory is `pylon.plan.memory`'s (DeepSpeed's model-state accounting, activations simulated on the meta device,
DeepSpeed's buffers). Time is `pylon.plan.steptime`'s: a step of T tokens costs T x (6N + 12 x layers x
d_model x seq) model FLOPs (`pylon.models.flops_per_token`; 4N + 6N_adapters with LoRA, since frozen weights
get no weight gradients), spread over the GPUs at `mfu` x the accelerator's dense bf16 (or fp32) peak. MFU is
model FLOPs utilisation as papers report it: recomputation for gradient checkpointing is inside it (the plan
prints the HFU it implies). ZeRO's collectives run at the catalog's link rates (the GPU interconnect inside a
node, the node's network across nodes) and add time only where they outlast the compute they hide behind;
offloading (CPU Adam, PCIe, NVMe) is assumed not to overlap at all. Every assumption is a named constant and is
printed with the plan.

Advice searches, per accelerator, ZeRO stage, offload targets, gradient checkpointing, micro-batch (keeping
the global batch) and GPU count (1, 2, 4, then whole nodes doubling to 16,384; at most one GPU per sequence),
keeps the best that fits at each count and their time/cost Pareto front, and recommends the cheapest that
finishes within `deadline_days` (30 unless given) and costs at most `budget_usd` -- else the fastest, with what
meeting them would take, and which parallelism beyond ZeRO (tensor, pipeline, context) the job would need
where data parallelism cannot get there. Among options within 1% of the cheapest it prefers fewer GPUs, no
offload, no recomputation, larger micro-batches, then the most headroom. Precision and LoRA are the user's
choice and are kept (a LoRA alternative is suggested when a full fine-tune needs offloading).
"""

from __future__ import annotations

import os
from pathlib import Path

from pylon import storage
from pylon.errors import PylonError
from pylon.jobs.run_dir import run_uri_of
from pylon.plan.catalog import Catalog
from pylon.plan.fits import WontFitError, check_fits, check_serve_fits
from pylon.plan.serve import DEFAULT_UTILIZATION, ServePlan, plan_serve
from pylon.plan.steptime import DEFAULT_MFU, hardware_flops_per_token, model_flops_per_token
from pylon.plan.text import render
from pylon.plan.train import (
    DEFAULT_DEADLINE_DAYS,
    MAX_GPUS,
    USABLE_FRACTION,
    TrainPlan,
    gpu_counts,
    pareto,
    plan_train,
    train_workload,
)
from pylon.specs import BatchJobSpec, DeploymentSpec, TrainJobSpec, load_specs

__all__ = [
    "DEFAULT_DEADLINE_DAYS",
    "DEFAULT_MFU",
    "DEFAULT_UTILIZATION",
    "MAX_GPUS",
    "USABLE_FRACTION",
    "ServePlan",
    "TrainPlan",
    "WontFitError",
    "check_fits",
    "check_serve_fits",
    "gpu_counts",
    "hardware_flops_per_token",
    "model_flops_per_token",
    "pareto",
    "plan_file",
    "plan_serve",
    "plan_spec",
    "plan_train",
    "render",
    "train_workload",
]


def plan_spec(
    spec,
    *,
    catalog: Catalog | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    mfu: float = DEFAULT_MFU,
    seq_len: int | None = None,
    utilization: float = DEFAULT_UTILIZATION,
    deadline_days: float = DEFAULT_DEADLINE_DAYS,
    budget_usd: float | None = None,
):
    """A TrainPlan for a TrainJobSpec (the cheapest within `deadline_days` and `budget_usd`), a ServePlan for a
    DeploymentSpec, and for a BatchJobSpec the ServePlan of the Deployment each of its engines is."""
    if isinstance(spec, BatchJobSpec):
        spec = spec.deployment()
    if isinstance(spec, TrainJobSpec):
        return plan_train(
            spec,
            catalog=catalog,
            gpu=gpu,
            gpus=gpus,
            mfu=mfu,
            seq_len=seq_len,
            deadline_days=deadline_days,
            budget_usd=budget_usd,
        )
    if isinstance(spec, DeploymentSpec):
        return plan_serve(spec, catalog=catalog, gpu=gpu, mfu=mfu, utilization=utilization)
    raise PylonError(
        f"the planner plans TrainJob, Deployment and BatchJob specs, not {getattr(spec, 'kind', type(spec).__name__)}"
    )


def plan_file(path: str | os.PathLike, **options) -> tuple[list, list[str]]:
    """Plans for every TrainJob and Deployment in a YAML file, and notes on the documents not planned. A
    Deployment of a model a TrainJob of the same file will export is planned with that job's model. `options`
    are `plan_spec`'s (gpu, gpus, mfu, seq_len, utilization, deadline_days, budget_usd, catalog)."""

    docs = load_specs(path)
    plans, skipped = [], []
    trains = [d.spec for d in docs if isinstance(d.spec, TrainJobSpec)]
    for doc in docs:
        spec = doc.spec
        if isinstance(spec, TrainJobSpec):
            plans.append(plan_spec(spec, **options))
        elif isinstance(spec, (DeploymentSpec, BatchJobSpec)):
            if isinstance(spec, BatchJobSpec):
                spec = spec.deployment()
            config = _exported_config(spec, trains, options.get("seq_len"))
            serve_options = {
                k: v for k, v in options.items() if k not in ("gpus", "seq_len", "deadline_days", "budget_usd")
            }
            plans.append(plan_serve(spec, config=config, **serve_options))
        else:
            skipped.append(f"{doc.source}: document {doc.index} ({spec.kind} '{spec.name}'): nothing to plan")
    if not plans:
        raise PylonError(f"{path}: no TrainJob, Deployment or BatchJob documents to plan")
    return plans, skipped


def _exported_config(spec: DeploymentSpec, trains: list[TrainJobSpec], seq_len: int | None):
    """The config of the model a TrainJob in the same file exports to `spec.model`, if its directory does not
    exist yet (the demo's file trains, exports and serves); None to read the directory itself."""

    try:
        if storage.exists(storage.join(spec.model, "config.json")):
            return None
    except PylonError:
        return None
    for train in trains:
        if _same_place(storage.join(run_uri_of(train), "export"), spec.model):
            work, _ = train_workload(train, seq_len=seq_len or train.data.seq_len or 1)
            return work.config
    return None


def _same_place(a: str, b: str) -> bool:
    def norm(u: str) -> str:
        return u.rstrip("/") if "://" in u else str(Path(u).expanduser().resolve())

    return norm(a) == norm(b)
