"""`check_fits`: refuse a TrainJob before submission when the cluster it would run on cannot hold it (WontFitError
says what does not fit and what would)."""

from __future__ import annotations

from pylon.errors import PylonError
from pylon.plan.catalog import Accelerator, Catalog, load_catalog
from pylon.plan.fmt import _gib
from pylon.plan.steptime import DEFAULT_MFU
from pylon.plan.train import _requested_layout, cpu_job_bytes, evaluate, search, train_workload
from pylon.specs import TrainJobSpec


class WontFitError(PylonError):
    """The planner says a job cannot run on the resources it asks for (`pylon train --force` overrides)."""


def check_fits(spec: TrainJobSpec, *, client=None, catalog: Catalog | None = None) -> None:
    """WontFitError if the planner says `spec` cannot run on what it asks for: `scaling.num_workers` GPUs of the
    type its resources or the cluster name (any GPU of the catalog when neither does), or on CPU workers, the
    cluster's RAM (a loose check: CPU jobs are small). A job the planner cannot size (no sequence length yet,
    an unreadable model, an architecture it cannot simulate) is let through: the job itself will say more."""
    try:
        refusal = _refusal(spec, client, catalog or load_catalog())
    except Exception:  # the check is advice: a planner failure must never block a submission
        return
    if refusal:
        raise WontFitError(refusal)


def _refusal(spec: TrainJobSpec, client, catalog: Catalog) -> str | None:
    work, _ = train_workload(spec)
    nodes = _cluster_nodes(client)
    g = spec.scaling.num_workers
    if not spec.scaling.use_gpu:
        available = sum(
            n.resources.get("memory", 0) + n.resources.get("object_store_memory", 0)
            for n in nodes
            if n.state == "ALIVE"
        )
        need = cpu_job_bytes(work, _requested_layout(spec, None, g))
        if available and need > available:
            return (
                f"TrainJob '{spec.name}' needs about {_gib(need)} of RAM for its {g} CPU worker(s) and its driver; the "
                f"cluster has {_gib(available)}. Use fewer workers, a smaller micro-batch or gradient "
                "checkpointing, or submit anyway with --force"
            )
        return None
    accelerator = _requested_accelerator(spec, nodes, catalog)
    candidates = [accelerator] if accelerator else list(catalog.accelerators)
    options = [
        evaluate(work, _requested_layout(spec, None, acc.gpus_per_node), acc, steps=spec.steps, mfu=DEFAULT_MFU)
        for acc in candidates
    ]
    if any(o.fits for o in options):
        return None
    if accelerator is None:
        largest = max(options, key=lambda o: o.accelerator.memory_gib)
        return (
            f"TrainJob '{spec.name}' does not fit on {g} GPU(s) of any kind the planner knows, as requested "
            f"({largest.layout.describe()}): even on {largest.accelerator.name}, {largest.binding}. Run "
            "`pylon plan` on the spec for configurations that fit, or submit anyway with --force"
        )
    option = options[0]
    best = search(
        work,
        accelerator,
        global_batch=spec.global_batch_size,
        max_micro_batch=spec.batch.micro_batch_size,
        steps=spec.steps,
        mfu=DEFAULT_MFU,
        gpus=g,
    )
    advice = (
        f"the cheapest configuration that fits on {g} x {accelerator.name} is {best.layout.describe()} "
        f"({_gib(best.memory.device_total)} per GPU)"
        if best
        else f"nothing fits on {g} x {accelerator.name}; ask for more GPUs (`pylon plan --gpu {accelerator.name}` "
        "shows how many)"
    )
    return (
        f"TrainJob '{spec.name}' will not fit on {g} x {accelerator.name} as requested "
        f"({option.layout.describe()}): {option.binding}. Recommendation: {advice}. Run `pylon plan` on the "
        "spec for every option, or submit anyway with --force"
    )


def _cluster_nodes(client) -> list:
    if client is None:
        return []
    try:
        return client.nodes()
    except Exception:  # the check is advice; an unreachable state API must not block a submission
        return []


def _requested_accelerator(spec: TrainJobSpec, nodes: list, catalog: Catalog) -> Accelerator | None:
    """The GPU type a worker asks for (an `accelerator_type:NAME` resource), else the cluster's smallest known."""
    prefix = "accelerator_type:"
    wanted = [k[len(prefix) :] for k in spec.scaling.resources_per_worker if k.startswith(prefix)]
    if not wanted:
        wanted = sorted(
            {k[len(prefix) :] for n in nodes if n.state == "ALIVE" for k in n.resources if k.startswith(prefix)}
        )
    known = []
    for name in wanted:
        try:
            known.append(catalog.get(name))
        except PylonError:
            continue
    return min(known, key=lambda a: a.memory_gib) if known else None
