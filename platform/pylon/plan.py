"""The planner: before anything launches, will a job fit, where does its memory go, how long will it take, what
will it cost -- and what is the cheapest configuration that fits (`pylon plan FILE`, `client.plan(spec)`).

    plan = plan_spec(spec)                    # TrainPlan for a TrainJob, ServePlan for a Deployment
    print(render(plan))                       # the tables `pylon plan` prints
    plan.to_dict()                            # what `pylon plan --json` prints
    check_fits(spec, client=client)           # WontFitError before `pylon train` asks for workers

Memory is `pylon.memory`'s (DeepSpeed's model-state accounting, activations simulated on the meta device,
DeepSpeed's buffers). Time is FLOPs over peak throughput times an assumed MFU: a step of T tokens costs
T x (6N + 12 x layers x d_model x seq) FLOPs (`pylon.models.flops_per_token`; 4N + 6N_adapters with LoRA, since
frozen weights get no weight gradients), plus a recomputed forward pass with gradient checkpointing, spread
over the GPUs at `mfu` x the accelerator's dense bf16 (or fp32) peak. To that come the collectives a quarter
of which are assumed not to overlap compute (all of what exceeds compute), and offloading (CPU Adam, PCIe,
NVMe), which is assumed not to overlap at all. Every assumption is a named constant below and is printed with
the plan.

Advice searches, per accelerator, ZeRO stage, offload targets, gradient checkpointing, micro-batch (keeping
the global batch) and GPU count, and picks the cheapest configuration that fits; among those within 1% of
the cheapest it prefers fewer GPUs, no offload, no recomputation, larger micro-batches, then the most
headroom. Precision and LoRA are the user's choice and are kept (a LoRA alternative is suggested when a full
fine-tune needs offloading).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pylon.catalog import Accelerator, Catalog, load_catalog
from pylon.errors import PylonError, StorageError
from pylon.memory import (CUDA_RUNTIME_BYTES, GIB, PROCESS_BYTES, WEIGHT_BYTES, Layout, ModelShape, TrainMemory,
                          Workload, kv_bytes_per_token, model_shape, train_memory)
from pylon.specs import DeploymentSpec, LoraSpec, TrainJobSpec

DEFAULT_MFU = 0.40  # model FLOPs utilisation: well-tuned dense LLM training reaches 0.35-0.55
USABLE_FRACTION = 0.95  # of a GPU's memory, the rest left to the caching allocator's fragmentation
EXPOSED_COMM = 0.25  # share of the collectives that does not overlap compute
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed's CPU Adam per GPU process (AVX-512, a node's cores shared by its GPUs)
NVME_GBS = 6.0  # NVMe read or write bandwidth per node, GB/s, shared by its GPUs
BANDWIDTH_EFFICIENCY = 0.8  # of datasheet memory bandwidth that decoding reaches
LAUNCH_S_PER_LAYER = 1e-4  # eager PyTorch decoding: kernel launches per layer per step, whatever the batch
DEFAULT_UTILIZATION = 0.5  # share of a serving replica's hours spent at its throughput ceiling
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COST_TIE = 0.01  # configurations within 1% of the cheapest count as equally cheap
# (optimizer, parameters) offload targets, in the order the planner prefers them when costs tie.
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme"))

COUNTED = (
    "Model states follow DeepSpeed's accounting (its estimate_zero2/zero3_model_states_mem_needs, which they "
    "equal): bf16/fp16 training keeps 2-byte weights and gradients plus an fp32 gradient copy, fp32 master "
    "weights and Adam's two fp32 moments (2+2+4+12 = 20 bytes per parameter at ZeRO-0, partitioned by ZeRO "
    "1-3); fp32 training at ZeRO-0 keeps 4+4+8 = 16 bytes per parameter, so a 7B model's weights, gradients "
    "and Adam states take ~112 GB (the often-quoted ~56 GB counts only Adam's two moments, 8 bytes per "
    "parameter). Activations: one micro-batch's forward + backward peak, simulated. Working buffers: "
    "DeepSpeed's reduce/prefetch buckets at their default sizes. Runtime: ~1 GiB for the CUDA context and "
    "NCCL. Host RAM per node: the larger of every process's fp32 model while it is built and what is "
    "offloaded, times 1.5 (DeepSpeed's additional_buffer_factor). A GPU fits at <= 95% of its memory."
)


class WontFitError(PylonError):
    """The planner says a job cannot run on the resources it asks for (`pylon train --force` overrides)."""


# ---------------------------------------------------------------------------------------------------------
# Time and cost
# ---------------------------------------------------------------------------------------------------------


def model_flops_per_token(shape: ModelShape, seq_len: int, lora: bool) -> float:
    """Training FLOPs per token: 6N + 12 x layers x d_model x seq (PaLM's estimate, `pylon.models`); with LoRA
    the frozen weights need only the forward and the input gradients (4N) and the adapters 6 x theirs."""
    attention = 12.0 * shape.num_layers * shape.hidden_size * seq_len
    if lora:
        return 4.0 * shape.matmul_params + 6.0 * shape.trainable_matmul_params + attention
    return 6.0 * shape.matmul_params + attention


def hardware_flops_per_token(shape: ModelShape, seq_len: int, lora: bool, checkpointing: bool) -> float:
    """The FLOPs the GPUs execute: the model's, plus one more forward pass when checkpointing recomputes it."""
    flops = model_flops_per_token(shape, seq_len, lora)
    if checkpointing:
        adapters = shape.trainable_matmul_params if lora else 0
        flops += 2.0 * (shape.matmul_params + adapters) + 4.0 * shape.num_layers * shape.hidden_size * seq_len
    return flops


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float  # the part of the collectives not hidden behind compute
    offload_s: float  # CPU Adam, PCIe and NVMe traffic

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.offload_s


def step_time(work: Workload, layout: Layout, acc: Accelerator, mfu: float) -> StepTime:
    s, g, stage = work.shape, layout.num_gpus, layout.zero_stage
    w = WEIGHT_BYTES[work.precision]
    tokens = layout.micro_batch_size * layout.grad_accum_steps * g * work.seq_len
    flops = hardware_flops_per_token(s, work.seq_len, work.lora is not None, layout.gradient_checkpointing)
    compute = tokens * flops / (g * acc.peak_flops(work.precision) * mfu)

    comm = 0.0
    if g > 1:
        # Bytes each GPU sends per optimizer step (ring collectives: (G-1)/G of the buffer). ZeRO-0/1 reduce once
        # per step and gather the updated partitions; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also
        # gathers the parameters for each micro-batch's forward and backward.
        part = (g - 1) / g
        grads, weights, accum = w * s.trainable_params * part, w * s.total_params * part, layout.grad_accum_steps
        volume = {0: 2 * grads, 1: 2 * grads, 2: (accum + 1) * grads, 3: accum * (2 * weights + grads)}[stage]
        link = acc.interconnect_gbs if g <= acc.gpus_per_node else acc.network_gbs
        comm = volume / (link * 1e9)
    exposed = max(0.0, comm - compute) + EXPOSED_COMM * min(comm, compute)

    offload = 0.0
    host_link = acc.host_link_gbs * 1e9
    per_rank = s.trainable_params / (g if stage >= 1 else 1)
    if layout.offload_optimizer != "none":
        offload += per_rank / CPU_ADAM_PARAMS_PER_S + 2 * w * per_rank / host_link  # Adam; grads down, weights up
        if layout.offload_optimizer == "nvme":  # master weights and moments read and written every step
            offload += 2 * 12 * per_rank * layout.gpus_on_node / (NVME_GBS * 1e9)
    if layout.offload_param != "none":
        moved = layout.grad_accum_steps * 2 * w * s.total_params / g  # fetched for every forward and backward
        offload += (moved / host_link if layout.offload_param == "cpu"
                    else moved * layout.gpus_on_node / (NVME_GBS * 1e9))
    return StepTime(compute, exposed, offload)


# ---------------------------------------------------------------------------------------------------------
# One configuration on one accelerator
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """A layout on an accelerator: its memory, whether it fits (and what binds), its time and its cost."""

    accelerator: Accelerator
    layout: Layout
    memory: TrainMemory
    fits: bool
    binding: str  # the tightest resource and its largest term (why it does not fit, when it does not)
    step: StepTime
    steps: int
    tokens_per_step: int

    @property
    def usable_bytes(self) -> int:
        return int(self.accelerator.memory_bytes * USABLE_FRACTION)

    @property
    def wall_s(self) -> float:
        return self.steps * self.step.total_s

    @property
    def gpu_hours(self) -> float:
        return self.wall_s / 3600 * self.layout.num_gpus

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.accelerator.price_per_gpu_hour

    def to_dict(self) -> dict:
        m, lay = self.memory, self.layout
        return {
            "accelerator": self.accelerator.name, "gpus": lay.num_gpus, "nodes": lay.nodes,
            "layout": {"zero_stage": lay.zero_stage, "offload_optimizer": lay.offload_optimizer,
                       "offload_param": lay.offload_param, "gradient_checkpointing": lay.gradient_checkpointing,
                       "micro_batch_size": lay.micro_batch_size, "grad_accum_steps": lay.grad_accum_steps},
            "description": lay.describe(), "fits": self.fits, "binding": self.binding,
            "memory_per_gpu": _memory_dict(m), "usable_per_gpu": self.usable_bytes,
            "host_ram_per_node": m.host_total, "nvme_per_node": m.nvme,
            "step_time_s": round(self.step.total_s, 4), "compute_s": round(self.step.compute_s, 4),
            "comm_s": round(self.step.comm_s, 4), "offload_s": round(self.step.offload_s, 4),
            "tokens_per_step": self.tokens_per_step, "wall_hours": round(self.wall_s / 3600, 4),
            "gpu_hours": round(self.gpu_hours, 4), "cost_usd": round(self.cost, 2),
        }


def _memory_dict(m: TrainMemory) -> dict:
    terms = {name.replace(" ", "_"): b for name, b in m.device_terms()}
    return {**terms, "total": m.device_total}


def evaluate(work: Workload, layout: Layout, acc: Accelerator, *, steps: int, mfu: float) -> Option:
    memory = train_memory(work, layout, device="cuda")
    fits, binding = _binding(memory, acc)
    tokens = layout.micro_batch_size * layout.grad_accum_steps * layout.num_gpus * work.seq_len
    return Option(acc, layout, memory, fits, binding, step_time(work, layout, acc, mfu), steps, tokens)


def _binding(m: TrainMemory, acc: Accelerator) -> tuple[bool, str]:
    usable = acc.memory_bytes * USABLE_FRACTION
    term, largest = max(m.device_terms(), key=lambda t: t[1])
    checks = [  # (used / available, description)
        (m.device_total / usable, f"GPU memory {_gib(m.device_total)} of {_gib(usable)} usable "
                                  f"(largest: {term} {_gib(largest)})"),
        (m.host_total / acc.host_memory_bytes, f"host RAM {_gib(m.host_total)} per node of "
                                               f"{_gib(acc.host_memory_bytes)}"),
    ]
    if m.nvme:
        checks.append((m.nvme / acc.nvme_bytes, f"NVMe {_gib(m.nvme)} per node of {_gib(acc.nvme_bytes)}"))
    over = [text for ratio, text in checks if ratio > 1]
    if over:
        return False, "; ".join(over)
    ratio, text = max(checks)
    return True, f"{ratio:.0%} " + text


# ---------------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------------


def candidate_layouts(*, global_batch: int, max_micro_batch: int, gpus: int | None, gpus_per_node: int,
                      has_nvme_path: bool = True) -> list[Layout]:
    """Every layout the search tries: ZeRO 0-3 x offload targets x checkpointing x micro-batch x GPU count,
    each keeping the global batch (exactly, unless `gpus` is fixed and does not divide it)."""
    micro = sorted({m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= max_micro_batch} | {max_micro_batch})
    counts = [gpus] if gpus else [c for c in GPU_COUNTS if c <= global_batch]
    out = []
    for g in counts:
        for mb in micro:
            if gpus:
                accum = max(1, math.ceil(global_batch / (mb * g)))
            elif global_batch % (mb * g):
                continue
            else:
                accum = global_batch // (mb * g)
            for stage in (0, 1, 2, 3):
                for opt, par in OFFLOADS:
                    if not _offload_allowed(stage, opt, par) or ("nvme" in (opt, par) and not has_nvme_path):
                        continue
                    for ckpt in (False, True):
                        out.append(Layout(stage, opt, par, ckpt, mb, accum, g, gpus_per_node))
    return out


def _offload_allowed(stage: int, opt: str, par: str) -> bool:
    # The rules `DeepSpeedSpec` enforces.
    return not ((par != "none" and stage != 3) or (opt != "none" and stage == 0) or (opt == "nvme" and stage != 3))


def cheapest(options: list[Option]) -> Option | None:
    fitting = [o for o in options if o.fits]
    if not fitting:
        return None
    best = min(o.cost for o in fitting)
    near = [o for o in fitting if o.cost <= best * (1 + COST_TIE) + 1e-9]
    # Among near-ties (a short job costs cents anywhere): fewest GPUs, then the cheaper GPU-hour.
    return min(near, key=lambda o: (o.layout.num_gpus, o.accelerator.price_per_gpu_hour, *_preference(o)[1:]))


def _preference(o: Option) -> tuple:
    lay = o.layout
    return (lay.num_gpus, OFFLOADS.index((lay.offload_optimizer, lay.offload_param)), lay.gradient_checkpointing,
            -lay.micro_batch_size, o.memory.device_total, -lay.zero_stage)


def search(work: Workload, acc: Accelerator, *, global_batch: int, max_micro_batch: int, steps: int, mfu: float,
           gpus: int | None = None) -> Option | None:
    """The cheapest configuration of `work` on `acc` that fits (None if none does)."""
    layouts = candidate_layouts(global_batch=global_batch, max_micro_batch=max_micro_batch, gpus=gpus,
                                gpus_per_node=acc.gpus_per_node)
    return cheapest([evaluate(work, lay, acc, steps=steps, mfu=mfu) for lay in layouts])


# ---------------------------------------------------------------------------------------------------------
# Inputs: the model config, the sequence length, the tokenizer's vocabulary
# ---------------------------------------------------------------------------------------------------------


def _config_from_dir(uri: str, what: str):
    """The Hugging Face config of a model directory, reading only its config.json (never the weights)."""
    from transformers import AutoConfig

    from pylon import storage

    try:
        raw = storage.read_json(storage.join(uri, "config.json"))
    except StorageError as e:
        raise PylonError(f"{what} {uri}: cannot read config.json ({e}); the planner needs the model's config") from None
    with tempfile.TemporaryDirectory(prefix="pylon-plan-") as tmp:
        Path(tmp, "config.json").write_text(json.dumps(raw))
        try:
            return AutoConfig.from_pretrained(tmp, local_files_only=True)
        except (OSError, ValueError) as e:
            raise PylonError(f"{what} {uri}: not a Hugging Face config.json ({e})") from None


def train_workload(spec: TrainJobSpec, *, seq_len: int | None = None) -> tuple[Workload, list[str]]:
    """The model, precision, sequence length and adapters `spec` trains, with notes on where they came from."""
    from pylon.models import model_config

    notes = []
    manifest = None
    try:
        from pylon.data.shards import read_manifest

        manifest = read_manifest(spec.data.uri)
    except Exception as e:  # no dataset yet, or unreachable storage: plan from the spec alone
        notes.append(f"dataset {spec.data.uri} not read ({type(e).__name__}); vocabulary from the model")
    seq = seq_len or spec.data.seq_len or (manifest.seq_len if manifest else None)
    if not seq:
        raise PylonError(f"TrainJob '{spec.name}': the sequence length is unknown: set data.seq_len in the spec, "
                         f"prepare the dataset at {spec.data.uri} first, or pass --seq-len")
    if spec.model.path is not None:
        config = _config_from_dir(spec.model.path, "model.path")
    else:
        # The dataset's tokenizer sizes the embeddings, as in training; without it, the model's own vocabulary
        # (special ids only keep transformers from warning about ids outside it).
        tok = manifest.tokenizer if manifest else None
        config = model_config(spec.model, vocab_size=tok.vocab_size if tok else None,
                              eos_id=tok.eos_id if tok else 0, pad_id=tok.pad_id if tok else 0)
    shape = model_shape(config, spec.lora)
    return Workload(config, shape, spec.precision, seq, spec.lora), notes


def _requested_layout(spec: TrainJobSpec, gpus: int | None, gpus_per_node: int) -> Layout:
    g = gpus or spec.scaling.num_workers
    mb = spec.batch.micro_batch_size
    accum = max(1, math.ceil(spec.global_batch_size / (mb * g)))
    ds = spec.deepspeed
    return Layout(ds.zero_stage, ds.offload_optimizer, ds.offload_param, spec.gradient_checkpointing, mb, accum, g,
                  gpus_per_node)


# ---------------------------------------------------------------------------------------------------------
# Training plans
# ---------------------------------------------------------------------------------------------------------


@dataclass
class AcceleratorRow:
    accelerator: Accelerator
    requested: Option
    cheapest: Option | None


@dataclass
class TrainPlan:
    name: str
    model: str
    work: Workload
    steps: int
    global_batch: int
    requested_layout: Layout
    requested_memory: TrainMemory
    rows: list[AcceleratorRow]
    recommendation: Option | None
    explanation: list[str]
    mfu: float
    prices_source: str
    use_gpu: bool
    cpu_worker_bytes: int | None = None  # a CPU worker's RAM as requested (use_gpu false)
    lora_alternative: tuple[LoraSpec, Option] | None = None
    notes: list[str] = field(default_factory=list)
    kind: str = "TrainJob"

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch * self.work.seq_len

    def row(self, name: str) -> AcceleratorRow:
        return next(r for r in self.rows if r.accelerator.name == name)

    def to_dict(self) -> dict:
        s = self.work.shape
        return {
            "kind": self.kind, "name": self.name,
            "model": {"description": self.model, "parameters": s.total_params, "trainable_parameters": s.trainable_params,
                      "largest_layer_parameters": s.largest_layer_params, "layers": s.num_layers,
                      "hidden_size": s.hidden_size, "vocab_size": s.vocab_size},
            "precision": self.work.precision, "seq_len": self.work.seq_len, "lora": _lora_dict(self.work.lora),
            "steps": self.steps, "global_batch": self.global_batch, "tokens": self.tokens,
            "flops_per_token": model_flops_per_token(s, self.work.seq_len, self.work.lora is not None),
            "requested": {"layout": self.requested_layout.describe(), "gpus": self.requested_layout.num_gpus,
                          "use_gpu": self.use_gpu, "memory_per_gpu": _memory_dict(self.requested_memory),
                          "memory_notes": self.requested_memory.notes,
                          "host_ram_per_node": self.requested_memory.host_total,
                          "nvme_per_node": self.requested_memory.nvme,
                          "cpu_worker_ram": self.cpu_worker_bytes},
            "accelerators": [{"name": r.accelerator.name, "memory_gib": r.accelerator.memory_gib,
                              "price_per_gpu_hour": r.accelerator.price_per_gpu_hour,
                              "requested": r.requested.to_dict(),
                              "cheapest": r.cheapest.to_dict() if r.cheapest else None} for r in self.rows],
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "explanation": self.explanation,
            "lora_alternative": ({"lora": _lora_dict(self.lora_alternative[0]), **self.lora_alternative[1].to_dict()}
                                 if self.lora_alternative else None),
            "assumptions": _assumptions(self.mfu, self.prices_source),
            "counted": COUNTED, "notes": self.notes,
        }


def _lora_dict(lora: LoraSpec | None) -> dict | None:
    return lora.model_dump(mode="json") if lora else None


def _assumptions(mfu: float, prices: str) -> dict:
    return {"mfu": mfu, "usable_memory_fraction": USABLE_FRACTION, "exposed_comm_fraction": EXPOSED_COMM,
            "cpu_adam_params_per_s": CPU_ADAM_PARAMS_PER_S, "nvme_gbs_per_node": NVME_GBS,
            "cuda_runtime_bytes": CUDA_RUNTIME_BYTES, "prices": prices}


def plan_train(spec: TrainJobSpec, *, catalog: Catalog | None = None, gpu: str | None = None,
               gpus: int | None = None, mfu: float = DEFAULT_MFU, seq_len: int | None = None) -> TrainPlan:
    """The plan of a TrainJob on every accelerator of the catalog (or only `gpu`), as requested and at its
    cheapest; `gpus` fixes the GPU count (default: the spec's workers as requested, any count for the search)."""
    _check_knobs(mfu=mfu, gpus=gpus)
    catalog = catalog or load_catalog()
    accelerators = [catalog.get(gpu)] if gpu else list(catalog.accelerators)
    work, notes = train_workload(spec, seq_len=seq_len)
    global_batch, steps = spec.global_batch_size, spec.steps
    if gpus and global_batch % gpus:
        notes.append(f"{gpus} GPUs do not divide the global batch of {global_batch} sequences: gradient "
                     "accumulation is rounded up, so each step trains slightly more sequences")
    rows = []
    for acc in accelerators:
        requested = evaluate(work, _requested_layout(spec, gpus, acc.gpus_per_node), acc, steps=steps, mfu=mfu)
        best = search(work, acc, global_batch=global_batch, max_micro_batch=spec.batch.micro_batch_size,
                      steps=steps, mfu=mfu, gpus=gpus)
        rows.append(AcceleratorRow(acc, requested, best))
    fitting = [r.cheapest for r in rows if r.cheapest]
    recommendation = cheapest(fitting) if fitting else None
    requested_layout = _requested_layout(spec, gpus, min(8, gpus or spec.scaling.num_workers))
    plan = TrainPlan(
        name=spec.name, model=spec.model.describe(), work=work, steps=steps, global_batch=global_batch,
        requested_layout=requested_layout, requested_memory=train_memory(work, requested_layout, device="cuda"),
        rows=rows, recommendation=recommendation, explanation=[], mfu=mfu, prices_source=catalog.prices_source,
        use_gpu=spec.scaling.use_gpu, notes=notes)
    if not spec.scaling.use_gpu:
        plan.cpu_worker_bytes = cpu_worker_bytes(work, _requested_layout(spec, None, spec.scaling.num_workers))
    if recommendation is not None and spec.lora is None and recommendation.layout.offloads:
        plan.lora_alternative = _lora_alternative(spec, recommendation, work, mfu=mfu)
    plan.explanation = _explain(plan)
    return plan


def cpu_worker_bytes(work: Workload, layout: Layout) -> int:
    """RAM one CPU worker needs as requested: its step's memory (model states, activations, the buckets' written
    pages), its share of what is offloaded, and the process itself."""
    m = train_memory(work, layout, device="cpu")
    return m.device_total + (m.host_states + m.host_buffers) // layout.gpus_on_node + PROCESS_BYTES


def _lora_alternative(spec: TrainJobSpec, rec: Option, work: Workload, *, mfu: float):
    """LoRA (r=8 on the attention projections) on the recommendation's accelerator and GPU count, if it fits
    without offloading: the usual answer when a full fine-tune only fits by offloading."""
    import torch
    from transformers import AutoModelForCausalLM

    from pylon.models import lora_layer_names

    with torch.device("meta"):
        names = {n.rsplit(".", 1)[-1] for n in lora_layer_names(AutoModelForCausalLM.from_config(work.config))}
    targets = [t for t in ("q_proj", "v_proj") if t in names] or [t for t in ("c_attn",) if t in names]
    if not targets:
        return None
    lora = LoraSpec(r=8, alpha=16, target_modules=targets)
    adapted = Workload(work.config, model_shape(work.config, lora), work.precision, work.seq_len, lora)
    best = search(adapted, rec.accelerator, global_batch=spec.global_batch_size,
                  max_micro_batch=spec.batch.micro_batch_size, steps=spec.steps, mfu=mfu, gpus=rec.layout.num_gpus)
    if best is None or best.layout.offloads:
        return None
    return lora, best


def _explain(plan: TrainPlan) -> list[str]:
    rec = plan.recommendation
    if rec is None:
        return [f"no configuration fits on any accelerator considered, up to {max(GPU_COUNTS)} GPUs: "
                "shorten the sequences, use LoRA, or a smaller model"]
    lay, acc = rec.layout, rec.accelerator
    row = plan.row(acc.name)
    out = []
    fitting = sum(1 for r in plan.rows if r.cheapest)
    out.append(f"cheapest of the {fitting} accelerator(s) on which the job fits, at ${acc.price_per_gpu_hour:.2f} "
               f"per GPU-hour; it needs {_gib(rec.memory.device_total)} of {_gib(rec.usable_bytes)} usable per GPU")
    req = row.requested
    if not req.fits:
        out.append(f"as requested ({req.layout.describe()}, {req.layout.num_gpus} GPU(s)) it does not fit on "
                   f"{acc.name}: {req.binding}")
    if lay.zero_stage and lay.num_gpus > 1:
        what = {1: "optimizer states", 2: "optimizer states and gradients", 3: "parameters, gradients and "
                "optimizer states"}[lay.zero_stage]
        out.append(f"ZeRO-{lay.zero_stage} splits the {what} over the {lay.num_gpus} GPUs")
    elif lay.offloads:
        out.append(f"ZeRO-{lay.zero_stage} on one GPU is what lets DeepSpeed offload")
    elif lay.zero_stage == 3:
        out.append("ZeRO-3 on one GPU accumulates gradients straight into fp32 partitions: 18 bytes per "
                   "parameter instead of 20")
    if lay.offloads:
        out.append(f"offloading ({lay.describe().split(', micro')[0]}) needs {_gib(rec.memory.host_total)} of host "
                   f"RAM per node (of {_gib(acc.host_memory_bytes)})"
                   + (f" and {_gib(rec.memory.nvme)} of NVMe" if rec.memory.nvme else "")
                   + f"; it adds {rec.step.offload_s:.2f} s per step of CPU Adam and PCIe/NVMe traffic")
    if lay.gradient_checkpointing:
        out.append("gradient checkpointing recomputes each block in the backward pass (about a third more "
                   "compute) to keep activations small enough")
    out.append(f"micro-batch {lay.micro_batch_size} x {lay.grad_accum_steps} accumulation step(s) x "
               f"{lay.num_gpus} GPU(s) keeps the global batch of {plan.global_batch} sequences")
    out.append(f"{rec.wall_s / 3600:,.1f} h wall time, {rec.gpu_hours:,.1f} GPU-hours, ${rec.cost:,.2f}; "
               f"step {rec.step.total_s:.2f} s = compute {rec.step.compute_s:.2f} + exposed communication "
               f"{rec.step.comm_s:.2f} + offload {rec.step.offload_s:.2f}")
    if plan.lora_alternative:
        lora, alt = plan.lora_alternative
        out.append(f"if a full fine-tune is not required: LoRA r={lora.r} on {', '.join(lora.target_modules)} "
                   f"fits without offloading ({alt.layout.describe()}, {_gib(alt.memory.device_total)} per GPU, "
                   f"{alt.wall_s / 3600:,.1f} h, ${alt.cost:,.2f})")
    return out


# ---------------------------------------------------------------------------------------------------------
# Serving plans
# ---------------------------------------------------------------------------------------------------------

KV_BYTES = {**WEIGHT_BYTES, "fp8": 1}  # bytes of a key or value element per engine.kv_cache_dtype


@dataclass(frozen=True)
class ServeOption:
    accelerator: Accelerator
    weights: int
    kv_cache: int  # the spec's kv_cache_tokens
    workspace: int
    runtime: int
    fits: bool
    binding: str
    kv_tokens_fit: int  # KV cache tokens the memory left after weights holds
    sequences_fit: int  # of max_model_len tokens
    single_stream_tps: float
    batch_tps: float  # decode ceiling at max_num_seqs (or as many sequences as fit) at half-full contexts
    batch: int
    utilization: float

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace + self.runtime

    @property
    def cost_per_million_tokens(self) -> float:
        if self.batch_tps <= 0:
            return math.inf
        return self.accelerator.price_per_gpu_hour / (self.batch_tps * 3600 * self.utilization) * 1e6

    def to_dict(self) -> dict:
        return {"accelerator": self.accelerator.name, "fits": self.fits, "binding": self.binding,
                "memory": {"weights": self.weights, "kv_cache": self.kv_cache, "workspace": self.workspace,
                           "runtime": self.runtime, "total": self.total},
                "kv_tokens_fit": self.kv_tokens_fit, "sequences_fit": self.sequences_fit,
                "single_stream_tokens_per_s": round(self.single_stream_tps, 1),
                "batch_tokens_per_s": round(self.batch_tps, 1), "batch": self.batch,
                "price_per_gpu_hour": self.accelerator.price_per_gpu_hour,
                "cost_per_million_tokens_usd": (round(self.cost_per_million_tokens, 4)
                                                if math.isfinite(self.cost_per_million_tokens) else None)}


@dataclass
class ServePlan:
    name: str
    model: str
    shape: ModelShape
    dtype: str
    kv_per_token: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_tokens: int
    rows: list[ServeOption]
    recommendation: ServeOption | None
    mfu: float
    utilization: float
    prices_source: str
    notes: list[str] = field(default_factory=list)
    kind: str = "Deployment"

    def to_dict(self) -> dict:
        s = self.shape
        return {"kind": self.kind, "name": self.name,
                "model": {"path": self.model, "parameters": s.total_params, "layers": s.num_layers,
                          "kv_heads": s.kv_heads, "head_dim": s.head_dim},
                "dtype": self.dtype, "kv_cache_bytes_per_token": self.kv_per_token,
                "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "kv_cache_tokens": self.kv_cache_tokens, "accelerators": [r.to_dict() for r in self.rows],
                "recommendation": self.recommendation.to_dict() if self.recommendation else None,
                "assumptions": {**_assumptions(self.mfu, self.prices_source), "utilization": self.utilization,
                                "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
                                "launch_s_per_layer": LAUNCH_S_PER_LAYER,
                                "average_context": self.max_model_len // 2},
                "notes": self.notes}


def plan_serve(spec: DeploymentSpec, *, catalog: Catalog | None = None, gpu: str | None = None,
               mfu: float = DEFAULT_MFU, utilization: float = DEFAULT_UTILIZATION, config=None) -> ServePlan:
    """Weights, KV cache per token, what fits and the decode throughput ceiling of a Deployment per accelerator
    (one GPU per replica: Pylon's engine does not shard a model). `config` stands in for an unread model dir."""
    _check_knobs(mfu=mfu, utilization=utilization)
    catalog = catalog or load_catalog()
    accelerators = [catalog.get(gpu)] if gpu else list(catalog.accelerators)
    config = config if config is not None else _config_from_dir(spec.model, "model")
    shape = model_shape(config)
    e = spec.engine
    dtype = "bf16" if e.dtype == "auto" else e.dtype  # auto is bf16 on these GPUs (fp32 only on CPU)
    b = WEIGHT_BYTES[dtype]
    weights = shape.total_params * b
    kv_dtype = dtype if e.kv_cache_dtype == "auto" else e.kv_cache_dtype
    per_token = kv_bytes_per_token(shape, KV_BYTES[kv_dtype])
    # Prefill of a token batch: a few hidden-size tensors and the MLP's intermediate ones; fp32 logits of the
    # sequences that sample.
    workspace = (e.max_num_batched_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * b
                 + e.max_num_seqs * shape.vocab_size * 4)
    context = max(1, e.max_model_len // 2)
    rows = []
    for acc in accelerators:
        usable = acc.memory_bytes * USABLE_FRACTION
        kv = e.kv_cache_tokens * per_token
        free = usable - weights - workspace - CUDA_RUNTIME_BYTES
        kv_fit = max(0, int(free // per_token))
        total = weights + kv + workspace + CUDA_RUNTIME_BYTES
        if total <= usable:
            fits, binding = True, f"{total / usable:.0%} of {_gib(usable)} usable"
        elif weights + workspace + CUDA_RUNTIME_BYTES > usable:
            fits, binding = False, f"weights {_gib(weights)} alone exceed {_gib(usable)} usable"
        else:
            fits, binding = False, (f"KV cache {_gib(kv)} ({e.kv_cache_tokens:,} tokens) + weights {_gib(weights)} "
                                    f"exceed {_gib(usable)}; {kv_fit:,} tokens fit")
        bandwidth = acc.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
        batch = max(0, min(e.max_num_seqs, kv_fit // context))
        launch = LAUNCH_S_PER_LAYER * shape.num_layers

        def decode_tps(seqs: int) -> float:  # a decode step reads every weight and each sequence's KV cache
            return seqs / ((weights + seqs * context * per_token) / bandwidth + launch) if seqs else 0.0

        single = decode_tps(1 if kv_fit >= context else 0)
        batched = decode_tps(batch)
        compute_ceiling = acc.peak_flops(dtype) * mfu / (2 * shape.matmul_params)
        rows.append(ServeOption(acc, weights, kv, workspace, CUDA_RUNTIME_BYTES, fits, binding, kv_fit,
                                kv_fit // e.max_model_len, min(single, compute_ceiling),
                                min(batched, compute_ceiling), batch, utilization))
    fitting = [r for r in rows if r.fits]
    recommendation = min(fitting, key=lambda r: r.cost_per_million_tokens) if fitting else None
    notes = []
    if e.device == "cpu" or spec.replica.num_gpus == 0:
        notes.append("the spec serves on CPU; the table shows what each GPU would do")
    return ServePlan(spec.name, spec.model, shape, dtype, per_token, e.max_model_len, e.max_num_seqs,
                     e.kv_cache_tokens, rows, recommendation, mfu, utilization, catalog.prices_source, notes)


# ---------------------------------------------------------------------------------------------------------
# Specs and files
# ---------------------------------------------------------------------------------------------------------


def plan_spec(spec, *, catalog: Catalog | None = None, gpu: str | None = None, gpus: int | None = None,
              mfu: float = DEFAULT_MFU, seq_len: int | None = None, utilization: float = DEFAULT_UTILIZATION):
    """A TrainPlan for a TrainJobSpec, a ServePlan for a DeploymentSpec."""
    if isinstance(spec, TrainJobSpec):
        return plan_train(spec, catalog=catalog, gpu=gpu, gpus=gpus, mfu=mfu, seq_len=seq_len)
    if isinstance(spec, DeploymentSpec):
        return plan_serve(spec, catalog=catalog, gpu=gpu, mfu=mfu, utilization=utilization)
    raise PylonError(f"the planner plans TrainJob and Deployment specs, not {getattr(spec, 'kind', type(spec).__name__)}")


def plan_file(path: str | os.PathLike, **options) -> tuple[list, list[str]]:
    """Plans for every TrainJob and Deployment in a YAML file, and notes on the documents not planned. A
    Deployment of a model a TrainJob of the same file will export is planned with that job's model."""
    from pylon.specs import load_specs

    docs = load_specs(path)
    plans, skipped = [], []
    trains = [d.spec for d in docs if isinstance(d.spec, TrainJobSpec)]
    for doc in docs:
        spec = doc.spec
        if isinstance(spec, TrainJobSpec):
            plans.append(plan_spec(spec, **options))
        elif isinstance(spec, DeploymentSpec):
            config = _exported_config(spec, trains, options.get("seq_len"))
            serve_options = {k: v for k, v in options.items() if k not in ("gpus", "seq_len")}
            plans.append(plan_serve(spec, config=config, **serve_options))
        else:
            skipped.append(f"{doc.source}: document {doc.index} ({spec.kind} '{spec.name}'): nothing to plan")
    if not plans:
        raise PylonError(f"{path}: no TrainJob or Deployment documents to plan")
    return plans, skipped


def _exported_config(spec: DeploymentSpec, trains: list[TrainJobSpec], seq_len: int | None):
    """The config of the model a TrainJob in the same file exports to `spec.model`, if its directory does not
    exist yet (the demo's file trains, exports and serves); None to read the directory itself."""
    from pylon import storage
    from pylon.jobs.train import run_uri_of

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


def _check_knobs(*, mfu: float | None = None, gpus: int | None = None, utilization: float | None = None) -> None:
    if mfu is not None and not 0 < mfu <= 1:
        raise PylonError(f"mfu: must be in (0, 1], e.g. 0.4 (got {mfu})")
    if gpus is not None and gpus < 1:
        raise PylonError(f"gpus: must be at least 1 (got {gpus})")
    if utilization is not None and not 0 < utilization <= 1:
        raise PylonError(f"utilization: must be in (0, 1], e.g. 0.5 (got {utilization})")


# ---------------------------------------------------------------------------------------------------------
# Refusing what cannot fit (pylon train)
# ---------------------------------------------------------------------------------------------------------


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
        available = sum(n.resources.get("memory", 0) + n.resources.get("object_store_memory", 0)
                        for n in nodes if n.state == "ALIVE")
        need = cpu_worker_bytes(work, _requested_layout(spec, None, g)) * g
        if available and need > available:
            return (f"TrainJob '{spec.name}' needs about {_gib(need)} of RAM for its {g} CPU worker(s); the "
                    f"cluster has {_gib(available)}. Use fewer workers, a smaller micro-batch or gradient "
                    "checkpointing, or submit anyway with --force")
        return None
    accelerator = _requested_accelerator(spec, nodes, catalog)
    candidates = [accelerator] if accelerator else list(catalog.accelerators)
    options = [evaluate(work, _requested_layout(spec, None, acc.gpus_per_node), acc, steps=spec.steps,
                        mfu=DEFAULT_MFU) for acc in candidates]
    if any(o.fits for o in options):
        return None
    if accelerator is None:
        largest = max(options, key=lambda o: o.accelerator.memory_gib)
        return (f"TrainJob '{spec.name}' does not fit on {g} GPU(s) of any kind the planner knows, as requested "
                f"({largest.layout.describe()}): even on {largest.accelerator.name}, {largest.binding}. Run "
                "`pylon plan` on the spec for configurations that fit, or submit anyway with --force")
    option = options[0]
    best = search(work, accelerator, global_batch=spec.global_batch_size, max_micro_batch=spec.batch.micro_batch_size,
                  steps=spec.steps, mfu=DEFAULT_MFU, gpus=g)
    advice = (f"the cheapest configuration that fits on {g} x {accelerator.name} is {best.layout.describe()} "
              f"({_gib(best.memory.device_total)} per GPU)" if best else
              f"nothing fits on {g} x {accelerator.name}; ask for more GPUs (`pylon plan --gpu {accelerator.name}` "
              "shows how many)")
    return (f"TrainJob '{spec.name}' will not fit on {g} x {accelerator.name} as requested "
            f"({option.layout.describe()}): {option.binding}. Recommendation: {advice}. Run `pylon plan` on the "
            "spec for every option, or submit anyway with --force")


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
    wanted = [k[len(prefix):] for k in spec.scaling.resources_per_worker if k.startswith(prefix)]
    if not wanted:
        wanted = sorted({k[len(prefix):] for n in nodes if n.state == "ALIVE" for k in n.resources
                         if k.startswith(prefix)})
    known = []
    for name in wanted:
        try:
            known.append(catalog.get(name))
        except PylonError:
            continue
    return min(known, key=lambda a: a.memory_gib) if known else None


# ---------------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------------


def render(plan) -> str:
    return _render_train(plan) if isinstance(plan, TrainPlan) else _render_serve(plan)


def _render_train(p: TrainPlan) -> str:
    s, w = p.work.shape, p.work
    lay, m = p.requested_layout, p.requested_memory
    lines = [
        f"TrainJob '{p.name}': {p.model}, {_count(s.total_params)} parameters"
        + (f" ({_count(s.trainable_params)} trained: LoRA r={w.lora.r})" if w.lora else "")
        + f", {w.precision}, seq {w.seq_len:,}",
        f"  {p.steps:,} steps x {p.global_batch:,} sequences = {_count(p.tokens)} tokens; "
        f"{model_flops_per_token(s, w.seq_len, w.lora is not None) / 1e9:,.2f} GFLOP per token",
        "",
        f"Memory per GPU as requested ({lay.describe()}, {lay.num_gpus} GPU(s)):",
    ]
    for name, b in m.device_terms():
        lines.append(f"  {name:<18}{_gib(b):>11}  {m.notes.get(name, '')}")
    lines.append(f"  {'total':<18}{_gib(m.device_total):>11}")
    lines.append(f"  {'host RAM per node':<18}{_gib(m.host_total):>11}  max(fp32 model while built "
                 f"{_gib(m.host_build)}, offloaded {_gib(m.host_states + m.host_buffers)}) x 1.5")
    if m.nvme:
        lines.append(f"  {'NVMe per node':<18}{_gib(m.nvme):>11}")
    if p.cpu_worker_bytes is not None:
        lines.append(f"  {'CPU worker RAM':<18}{_gib(p.cpu_worker_bytes):>11}  as the spec runs (use_gpu: false): "
                     f"step, offloaded share and the process, x {lay.num_gpus} worker(s)")
    lines += ["", f"Per accelerator, as requested ({lay.num_gpus} GPU(s)):"]
    table = [("GPU", "memory", "needs/GPU", "fits", "time", "GPU-hours", "cost", "binding")]
    for r in p.rows:
        o = r.requested
        table.append((r.accelerator.name, _gib(r.accelerator.memory_bytes), _gib(o.memory.device_total),
                      "yes" if o.fits else "NO", _duration(o.wall_s), f"{o.gpu_hours:,.1f}", _usd(o.cost), o.binding))
    lines += _table(table)
    lines += ["", "Cheapest configuration that fits, per accelerator (global batch kept):"]
    table = [("GPU", "GPUs", "configuration", "needs/GPU", "time", "GPU-hours", "cost")]
    for r in p.rows:
        o = r.cheapest
        if o is None:
            table.append((r.accelerator.name, "-", "nothing fits", "-", "-", "-", "-"))
        else:
            table.append((r.accelerator.name, str(o.layout.num_gpus), o.layout.describe(),
                          _gib(o.memory.device_total), _duration(o.wall_s), f"{o.gpu_hours:,.1f}", _usd(o.cost)))
    lines += _table(table)
    rec = p.recommendation
    lines.append("")
    if rec is None:
        lines.append("Recommendation: none -- " + p.explanation[0])
    else:
        lines.append(f"Recommendation: {rec.layout.num_gpus} x {rec.accelerator.name}, {rec.layout.describe()}: "
                     f"{_duration(rec.wall_s)}, {_usd(rec.cost)}")
        lines += [f"  - {e}" for e in p.explanation]
    lines += ["", f"Assumptions: MFU {p.mfu:.2f} (--mfu), prices: {p.prices_source} (--prices or $PYLON_GPU_PRICES); "
              f"{EXPOSED_COMM:.0%} of collectives exposed, CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} params/s per GPU.",
              "Counted: " + COUNTED]
    lines += [f"Note: {n}" for n in p.notes]
    return "\n".join(lines)


def _render_serve(p: ServePlan) -> str:
    s = p.shape
    kv_bytes = p.kv_per_token // max(1, s.num_layers * s.kv_heads * s.head_dim * 2)  # per key or value element
    lines = [
        f"Deployment '{p.name}': {p.model}, {_count(s.total_params)} parameters, {p.dtype}",
        f"  weights {_gib(s.total_params * WEIGHT_BYTES[p.dtype])}, KV cache {p.kv_per_token / 2**10:,.1f} KiB per "
        f"token ({s.num_layers} layers x {s.kv_heads} KV heads x {s.head_dim} x 2 x {kv_bytes} bytes); spec: "
        f"{p.kv_cache_tokens:,} KV tokens, max_model_len {p.max_model_len:,}, max_num_seqs {p.max_num_seqs}",
        "",
        f"Per accelerator (one GPU per replica; throughput at contexts of {p.max_model_len // 2:,} tokens):",
    ]
    table = [("GPU", "memory", "needs", "fits", "KV tokens fit", "seqs x len", "tok/s 1 seq", "tok/s batch",
              f"$/M tok @{p.utilization:.0%}", "binding")]
    for r in p.rows:
        cpm = r.cost_per_million_tokens
        table.append((r.accelerator.name, _gib(r.accelerator.memory_bytes), _gib(r.total), "yes" if r.fits else "NO",
                      f"{r.kv_tokens_fit:,}", f"{r.sequences_fit:,} x {p.max_model_len:,}",
                      f"{r.single_stream_tps:,.0f}", f"{r.batch_tps:,.0f} (x{r.batch})",
                      f"{cpm:,.3f}" if math.isfinite(cpm) else "-", r.binding))
    lines += _table(table)
    rec = p.recommendation
    lines.append("")
    lines.append(f"Recommendation: {rec.accelerator.name}: ${rec.cost_per_million_tokens:,.3f} per million tokens "
                 f"at {p.utilization:.0%} utilisation, up to {rec.batch_tps:,.0f} tokens/s per replica"
                 if rec else "Recommendation: none -- the model does not fit one GPU of any kind considered")
    lines += ["", f"Assumptions: decode reads the weights and each sequence's KV cache every step at "
              f"{BANDWIDTH_EFFICIENCY:.0%} of datasheet bandwidth plus {LAUNCH_S_PER_LAYER * 1e3:.1f} ms of kernel "
              f"launches per layer, capped at MFU {p.mfu:.2f} of peak; "
              f"prices: {p.prices_source}."]
    lines += [f"Note: {n}" for n in p.notes]
    return "\n".join(lines)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(f"{str(c):<{wd}}" for c, wd in zip(r, widths)) + "  " + str(r[-1]) for r in rows]


def _gib(b: float) -> str:
    return f"{b / GIB:,.1f} GiB" if b >= GIB / 10 or b == 0 else f"{b / 2**20:,.1f} MiB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
