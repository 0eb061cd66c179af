"""`check_fits`: refuse a TrainJob before submission when the cluster it would run on cannot hold it (WontFitError
says what does not fit and what would); `check_serve_fits`: the same for a Deployment's replica (or a BatchJob's
engine) before it is deployed, where a replica that cannot hold its model would only fail to start, again and
again."""

from __future__ import annotations

from pylon.errors import PylonError
from pylon.plan.catalog import Accelerator, Catalog, load_catalog
from pylon.plan.fmt import _gib
from pylon.plan.steptime import DEFAULT_MFU
from pylon.plan.train import _requested_layout, cpu_job_bytes, evaluate, search, train_workload
from pylon.specs import BatchJobSpec, DeploymentSpec, TrainJobSpec


class WontFitError(PylonError):
    """The planner says a job cannot run on the resources it asks for (`pylon train --force` overrides)."""


def check_fits(spec: TrainJobSpec, *, client=None, catalog: Catalog | None = None) -> None:
    """WontFitError if the planner says `spec` cannot run on what it asks for: `scaling.num_workers` GPUs of the
    type its resources or the cluster name (any GPU of the catalog when neither does), or on CPU workers, the
    cluster's RAM (a loose check: CPU jobs are small). A job the planner cannot size (no sequence length yet,
    an unreadable model, an architecture it cannot simulate) is let through: the job itself will say more."""
    _refuse(lambda: _refusal(spec, client, catalog or load_catalog()))


def _refuse(refusal) -> None:
    """WontFitError with what `refusal()` says, if it says anything. The checks are advice: a planner failure must
    never block a submission or a deployment."""
    try:
        message = refusal()
    except Exception:
        return
    if message:
        raise WontFitError(message)


def _node_ram(node) -> float:
    """A node's RAM as Ray counts it: its memory resource and its object store."""
    return node.resources.get("memory", 0) + node.resources.get("object_store_memory", 0)


def _refusal(spec: TrainJobSpec, client, catalog: Catalog) -> str | None:
    work, _ = train_workload(spec)
    nodes = cluster_nodes(client)
    g = spec.scaling.num_workers
    if not spec.scaling.use_gpu:
        available = sum(_node_ram(n) for n in nodes if n.state == "ALIVE")
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


def cluster_nodes(client) -> list:
    """`client.nodes()`, or none where there is no client or its cluster's state API does not answer."""
    if client is None:
        return []
    try:
        return client.nodes()
    except Exception:  # the check is advice; an unreachable state API must not block a submission
        return []


def _requested_accelerator(spec: TrainJobSpec, nodes: list, catalog: Catalog) -> Accelerator | None:
    """The GPU type a worker asks for (an `accelerator_type:NAME` resource), else the cluster's smallest known."""
    wanted = [k[len(_TYPE) :] for k in spec.scaling.resources_per_worker if k.startswith(_TYPE)]
    return _smallest_known(wanted, catalog) if wanted else _cluster_accelerator(nodes, catalog)


def check_serve_fits(spec: DeploymentSpec | BatchJobSpec, nodes: list, *, catalog: Catalog | None = None) -> None:
    """WontFitError if the planner says a replica of `spec` (a BatchJob: one of its engines) cannot hold its model on
    the cluster's nodes (`nodes`: the state API's, each with `state` and `resources`): on GPUs, the cluster's
    smallest known GPU type; on CPUs, the largest node's RAM (Ray's memory and object store). A spec the planner
    cannot size (an unreadable model, an architecture it does not know) or a cluster it cannot see is let through:
    the replica itself will say more."""
    _refuse(lambda: _serve_refusal(spec, nodes, catalog or load_catalog()))


def _serve_refusal(spec: DeploymentSpec | BatchJobSpec, nodes: list, catalog: Catalog) -> str | None:
    from pylon.plan.serve import plan_serve

    what = f"{spec.kind} '{spec.name}'"
    deployment = spec.deployment() if isinstance(spec, BatchJobSpec) else spec
    alive = [n for n in nodes if n.state == "ALIVE"]
    e = deployment.engine
    if e.device == "cuda" or deployment.replica.num_gpus > 0:
        accelerator = _cluster_accelerator(alive, catalog)
        if accelerator is None:
            return None
        plan = plan_serve(deployment, catalog=catalog, gpu=accelerator.name)
        row = plan.rows[0]
        if row.fits:
            return None
        hints = [n for n in plan.notes if "fits" in n]
        return (
            f"{what} will not fit a replica on {accelerator.name}, the cluster's GPU: {row.binding}"
            + (f". {hints[0][0].upper() + hints[0][1:]}" if hints else "")
            + ". Run `pylon plan` on the spec for what would fit, or deploy anyway with --force (e.g. where the "
            "autoscaler adds nodes of larger GPUs)"
        )
    largest = max((_node_ram(n) for n in alive), default=0)
    if not largest:
        return None
    if e.dtype == "auto":  # (the planner's auto is a GPU's bf16; an engine on a CPU runs fp32)
        deployment = deployment.model_copy(update={"engine": e.model_copy(update={"dtype": "fp32"})})
    plan = plan_serve(deployment, catalog=catalog)
    row = plan.rows[0]
    engines = e.data_parallel * e.tensor_parallel  # each holds its share of the weights and its own KV cache
    need = engines * (row.weights + row.kv_cache + row.workspace) + plan.kv_offload_bytes
    if need <= largest:
        return None
    return (
        f"{what} needs about {_gib(need)} of RAM for a replica (weights {_gib(engines * row.weights)}, KV cache "
        f"{_gib(engines * row.kv_cache)} for engine.kv_cache_tokens {e.kv_cache_tokens:,}"
        + (f", host tier {_gib(plan.kv_offload_bytes)}" if plan.kv_offload_bytes else "")
        + f"); the cluster's largest node has {_gib(largest)}. Lower engine.kv_cache_tokens, quantize the weights "
        "(engine.quantization), or deploy anyway with --force (e.g. where the autoscaler adds larger nodes)"
    )


_TYPE = "accelerator_type:"  # Ray's resource of a node's GPU type


def _cluster_accelerator(nodes: list, catalog: Catalog) -> Accelerator | None:
    """The smallest GPU type of the catalog among the alive cluster nodes' (their `accelerator_type:NAME` resources)."""
    names = {k[len(_TYPE) :] for n in nodes if n.state == "ALIVE" for k in n.resources if k.startswith(_TYPE)}
    return _smallest_known(sorted(names), catalog)


def _smallest_known(names: list[str], catalog: Catalog) -> Accelerator | None:
    known = []
    for name in names:
        try:
            known.append(catalog.get(name))
        except PylonError:
            continue
    return min(known, key=lambda a: a.memory_gib) if known else None
