"""`render(plan)`: the tables `pylon plan` prints for a TrainPlan or a ServePlan."""

from __future__ import annotations

import math

from pylon.plan.fmt import _count, _duration, _gib, _table, _usd
from pylon.plan.memory import WEIGHT_BYTES
from pylon.plan.serve import BANDWIDTH_EFFICIENCY, LAUNCH_S_PER_LAYER, ServePlan
from pylon.plan.steptime import CPU_ADAM_PARAMS_PER_S, work_flops_per_token
from pylon.plan.train import COMMUNICATION, COUNTED, MFU_MEANS, TrainPlan

SHOWN_DEADLINES = 10  # the text's Pareto tables stop at options this many deadlines long (JSON has them all)


def render(plan) -> str:
    return _render_train(plan) if isinstance(plan, TrainPlan) else _render_serve(plan)


def _render_train(p: TrainPlan) -> str:
    s, w = p.work.shape, p.work
    lay, m = p.requested_layout, p.requested_memory
    lines = [
        f"TrainJob '{p.name}': {p.model}, {_count(s.total_params)} parameters"
        + (f" ({_count(s.trainable_params)} trained: LoRA r={w.lora.r})" if w.lora else "")
        + f", {w.precision}, seq {w.seq_len:,}",
        f"  {p.steps:,} steps x {p.global_batch:,} "
        + (f"prompts x {w.rollouts} completions" if w.rollouts > 1 else "sequences")
        + f" = {_count(p.tokens)} tokens; "
        f"{work_flops_per_token(w) / 1e9:,.2f} GFLOP per "
        "token (model FLOPs" + (", the reference's forward pass included)" if w.reference != "none" else ")"),
        "",
        f"Memory per GPU as requested ({lay.describe()}, {lay.num_gpus} GPU(s)):",
    ]
    for name, b in m.device_terms():
        lines.append(f"  {name:<18}{_gib(b):>11}  {m.notes.get(name, '')}")
    lines.append(f"  {'total':<18}{_gib(m.device_total):>11}")
    lines.append(
        f"  {'host RAM per node':<18}{_gib(m.host_total):>11}  max(while the model is built "
        f"{_gib(m.host_build)}, offloaded {_gib(m.host_states + m.host_buffers)}) x 1.5"
    )
    if m.nvme:
        lines.append(f"  {'NVMe per node':<18}{_gib(m.nvme):>11}")
    if p.cpu_worker_bytes is not None:
        lines.append(
            f"  {'CPU worker RAM':<18}{_gib(p.cpu_worker_bytes):>11}  as the spec runs (use_gpu: false): "
            f"step, offloaded share and the process, x {lay.num_gpus} worker(s)"
        )
        lines.append(
            f"  {'CPU job RAM':<18}{_gib(p.cpu_job_bytes):>11}  the workers, plus the job's driver and "
            "Ray Train's controller"
        )
    lines += ["", f"Per accelerator, as requested ({lay.num_gpus} GPU(s)):"]
    table = [("GPU", "memory", "needs/GPU", "fits", "time", "GPU-hours", "cost", "binding")]
    for r in p.rows:
        o = r.requested
        table.append(
            (
                r.accelerator.name,
                _gib(r.accelerator.memory_bytes),
                _gib(o.memory.device_total),
                "yes" if o.fits else "NO",
                _duration(o.wall_s),
                f"{o.gpu_hours:,.1f}",
                _usd(o.cost),
                o.binding,
            )
        )
    lines += _table(table)
    limits = f"{p.deadline_days:g} d" + (f" and {_usd(p.budget_usd)}" if p.budget_usd is not None else "")
    lines += [
        "",
        f"Best per accelerator: the cheapest within {limits} (of costs within 1%, the fewest GPUs), else the "
        "fastest; global batch kept:",
    ]
    table = [("GPU", "GPUs", "configuration", "needs/GPU", "time", "GPU-hours", "cost", "in time", "in budget")]
    for r in p.rows:
        o = r.best
        if o is None:
            table.append((r.accelerator.name, "-", "nothing fits", "-", "-", "-", "-", "-", "-"))
            continue
        table.append(
            (
                r.accelerator.name,
                str(o.layout.num_gpus),
                o.layout.describe(),
                _gib(o.memory.device_total),
                _duration(o.wall_s),
                f"{o.gpu_hours:,.1f}",
                _usd(o.cost),
                "yes" if o.wall_days <= p.deadline_days else "NO",
                "-" if p.budget_usd is None else ("yes" if o.cost <= p.budget_usd else "NO"),
            )
        )
    lines += _table(table)
    lines += [
        "",
        "Time against cost per accelerator (Pareto front: nothing is both faster and cheaper; a slower option is "
        f"listed if it saves more than 1%, and if it takes at most {SHOWN_DEADLINES}x the deadline):",
    ]
    table = [("GPU", "GPUs", "configuration", "time", "cost")]
    for r in p.rows:
        shown = [o for i, o in enumerate(r.pareto) if i == 0 or o.wall_days <= SHOWN_DEADLINES * p.deadline_days]
        for i, o in enumerate(shown):
            table.append(
                (
                    r.accelerator.name if i == 0 else "",
                    str(o.layout.num_gpus),
                    o.layout.describe(),
                    _duration(o.wall_s),
                    _usd(o.cost),
                )
            )
        if len(shown) < len(r.pareto):
            slow = len(r.pareto) - len(shown)
            table.append(("", "", f"(+{slow} slower, cheaper: --json lists them)", "", ""))
    lines += _table(table) if len(table) > 1 else ["  (nothing fits)"]
    rec = p.recommendation
    lines.append("")
    if rec is None:
        lines.append("Recommendation: none -- " + p.explanation[0])
        lines += [f"  - {e}" for e in p.explanation[1:]]
    else:
        lines.append(
            f"Recommendation: {rec.layout.num_gpus} x {rec.accelerator.name}, {rec.layout.describe()}: "
            f"{_duration(rec.wall_s)}, {_usd(rec.cost)}"
        )
        lines.append(("Deadline and budget: " if p.shortfall else "  ") + p.verdict)
        lines += [f"  - {e}" for e in p.explanation]
    hfu = f"; HFU {rec.hfu:.2f} for the recommendation (recomputed FLOPs counted too)" if rec else ""
    budget = _usd(p.budget_usd) if p.budget_usd is not None else "none"
    lines += [
        "",
        f"Assumptions: MFU {p.mfu:.2f} (--mfu): {MFU_MEANS}{hfu}. Deadline {p.deadline_days:g} d (--deadline), "
        f"budget {budget} (--budget). Communication: {COMMUNICATION}. CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} "
        f"params/s per GPU. Prices: {p.prices_source} (--prices or $PYLON_GPU_PRICES).",
        "Counted: " + COUNTED,
    ]
    lines += [f"Note: {n}" for n in p.notes]
    return "\n".join(lines)


def _render_serve(p: ServePlan) -> str:
    s = p.shape
    stored = 1 if s.latent_kv else 2  # a key and a value, or one latent that is both
    kv_bytes = p.kv_per_token // max(1, s.num_layers * s.kv_heads * s.head_dim * stored)  # per element
    lines = [
        f"Deployment '{p.name}': {p.model}, {_count(s.total_params)} parameters, {p.dtype}",
        # the weights as loaded: quantized projections, adapters and a draft model included (every row's are these)
        f"  weights {_gib(p.rows[0].weights if p.rows else s.total_params * WEIGHT_BYTES[p.dtype])}"
        + (
            (" (one tensor-parallel shard's)" if p.rows[0].split == "shard" else " (the largest pipeline stage's)")
            if p.rows and p.rows[0].gpus > 1
            else ""
        )
        + ", KV cache "
        f"{p.kv_per_token / 2**10:,.1f} KiB per "
        f"token ({s.num_layers} layers x "
        + (
            f"one latent of {s.head_dim}, its key and value, x {kv_bytes} bytes); spec: "
            if s.latent_kv
            else f"{s.kv_heads} KV heads x {s.head_dim} x 2 x {kv_bytes} bytes); spec: "
        )
        + f"{p.kv_cache_tokens:,} KV tokens, max_model_len {p.max_model_len:,}, max_num_seqs {p.max_num_seqs}",
        "",
        "Per accelerator ("
        + (
            (
                f"{p.rows[0].gpus} GPUs per replica, one a tensor-parallel shard, the memory one shard's"
                if p.rows[0].split == "shard"
                else f"{p.rows[0].gpus} GPUs per replica, one a pipeline stage, the memory the largest stage's"
            )
            if p.rows and p.rows[0].gpus > 1
            else "one GPU per replica"
        )
        + f"; throughput at contexts of {p.max_model_len // 2:,} tokens):",
    ]
    table = [
        (
            "GPU",
            "memory",
            "needs",
            "fits",
            "KV tokens fit",
            "seqs x len",
            "tok/s 1 seq",
            "tok/s batch",
            f"$/M tok @{p.utilization:.0%}",
            "binding",
        )
    ]
    for r in p.rows:
        cpm = r.cost_per_million_tokens
        table.append(
            (
                r.accelerator.name,
                _gib(r.accelerator.memory_bytes),
                _gib(r.total),
                "yes" if r.fits else "NO",
                f"{r.kv_tokens_fit:,}",
                f"{r.sequences_fit:,} x {p.max_model_len:,}",
                f"{r.single_stream_tps:,.0f}",
                f"{r.batch_tps:,.0f} (x{r.batch})",
                f"{cpm:,.3f}" if math.isfinite(cpm) else "-",
                r.binding,
            )
        )
    lines += _table(table)
    rec = p.recommendation
    lines.append("")
    lines.append(
        f"Recommendation: {rec.accelerator.name}: ${rec.cost_per_million_tokens:,.3f} per million tokens "
        f"at {p.utilization:.0%} utilisation, up to {rec.batch_tps:,.0f} tokens/s per replica"
        if rec
        else "Recommendation: none -- the model does not fit one GPU of any kind considered"
        + (" a stage (more engine.pipeline_parallel stages hold less each)" if p.rows and p.rows[0].gpus > 1 else "")
    )
    lines += [
        "",
        f"Assumptions: decode reads the weights and each sequence's KV cache every step at "
        f"{BANDWIDTH_EFFICIENCY:.0%} of datasheet bandwidth plus {LAUNCH_S_PER_LAYER * 1e3:.1f} ms of kernel "
        f"launches per layer, capped at MFU {p.mfu:.2f} of peak; "
        f"prices: {p.prices_source}.",
    ]
    lines += [f"Note: {n}" for n in p.notes]
    return "\n".join(lines)
