"""Planning a TrainJob (`plan_train`):

1. its workload: the model's shape, precision, sequence length and adapters (`train_workload`);
2. per accelerator, every layout worth trying (ZeRO stage, offload, checkpointing, micro-batch, GPU count: 1, 2,
   4, then whole nodes doubling to 16,384), each one's memory, time and cost; the best that fits at each GPU
   count (`search_options`) and of those the time/cost Pareto front (`pareto`);
3. the recommendation (`choose`): the cheapest that finishes within the deadline and budget, else the fastest
   (within the budget when anything is) and what meeting them would take;
4. where data parallelism alone cannot get there -- the global batch has too few sequences for the GPUs the
   deadline needs, or one sequence's activations do not fit -- which parallelism would (`_advice`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pylon import storage
from pylon.errors import PylonError, StorageError
from pylon.plan.catalog import Accelerator, Catalog, load_catalog
from pylon.plan.fmt import _gib, _usd
from pylon.plan.memory import (
    ALLOCATOR_RESERVE,
    CUDA_RUNTIME_BYTES,
    JOB_PROCESSES_BYTES,
    PROCESS_BYTES,
    ZERO12_RUNTIME_EXTRA_BYTES,
    Buffers,
    Layout,
    ModelShape,
    TrainMemory,
    Workload,
    model_shape,
    sampler_server_bytes,
    train_memory,
)
from pylon.plan.steptime import (
    COLLECTIVE_EFFICIENCY,
    CPU_ADAM_PARAMS_PER_S,
    DEFAULT_MFU,
    NVME_GBS,
    RING_STEP_LATENCY_S,
    StepTime,
    _check_knobs,
    hfu,
    step_time,
    work_flops_per_token,
)
from pylon.specs import RL_OBJECTIVES, Eagle3Spec, LoraSpec, TrainJobSpec, sampler_kv_cache_tokens

USABLE_FRACTION = 0.95  # of a GPU's memory; the rest a margin for what the model of memory does not count
MAX_GPUS = 16_384
COST_TIE = 0.01  # configurations within 1% of the cheapest count as equally cheap
DEFAULT_DEADLINE_DAYS = 30.0
DAY_S = 86_400.0
MFU_MEANS = (
    "model FLOPs utilisation: model FLOPs (6N + 12 x layers x d_model x seq per token, PaLM's definition) over "
    "GPUs x peak, as papers report it; recomputation for gradient checkpointing is inside it (HFU, which counts "
    "the recomputed FLOPs too, is higher), not extra time"
)


def gpu_counts(gpus_per_node: int, limit: int = MAX_GPUS) -> list[int]:
    """The GPU counts the search tries: 1, 2, 4 (below a node), then whole nodes, doubling, up to `limit`."""
    counts = [c for c in (1, 2, 4) if c < gpus_per_node]
    c = gpus_per_node
    while c <= limit:
        counts.append(c)
        c *= 2
    return counts


GPU_COUNTS = tuple(gpu_counts(8))


# (optimizer, parameters) offload targets, in the order the planner prefers them when costs tie.
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme"))
COUNTED = (
    "Model states follow DeepSpeed's accounting (its estimate_zero2/zero3_model_states_mem_needs, which they "
    "equal): bf16/fp16 training keeps 2-byte weights and gradients plus an fp32 gradient copy, fp32 master "
    "weights and Adam's two fp32 moments (2+2+4+12 = 20 bytes per parameter at ZeRO-0, partitioned by ZeRO "
    "1-3); fp32 training at ZeRO-0 keeps 4+4+8 = 16 bytes per parameter, so a 7B model's weights, gradients "
    "and Adam states take ~112 GB (the often-quoted ~56 GB counts only Adam's two moments, 8 bytes per "
    "parameter). Activations: one micro-batch's forward + backward peak, simulated. Working buffers: "
    "DeepSpeed's reduce/prefetch buckets at the sizes the spec gives (deepspeed.buffers; DeepSpeed's defaults). "
    "Runtime: ~1 GiB for the CUDA context and NCCL. Host RAM per node: the larger of what the processes hold "
    "while they build the model (ZeRO-0-2: each its fp32 replica; ZeRO-3, built under zero.Init: the module "
    "being built) and what is offloaded, times 1.5 (DeepSpeed's additional_buffer_factor). A GPU fits at <= 95% "
    "of its memory."
)


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
    mfu: float  # assumed: model FLOPs only
    hfu: float  # what the GPUs execute at that MFU, recomputation included
    extra_gpus: float = 0.0  # held for the whole run besides the layout's (grpo.sampler server's GPUs)

    @property
    def achieved_mfu(self) -> float:
        """The MFU the step reaches once exposed communication and offload are added to compute."""
        return self.mfu * self.step.compute_s / self.step.total_s if self.step.total_s else self.mfu

    @property
    def usable_bytes(self) -> int:
        return int(self.accelerator.memory_bytes * USABLE_FRACTION)

    @property
    def wall_s(self) -> float:
        return self.steps * self.step.total_s

    @property
    def wall_days(self) -> float:
        return self.wall_s / DAY_S

    @property
    def gpu_hours(self) -> float:
        return self.wall_s / 3600 * (self.layout.num_gpus + self.extra_gpus)

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.accelerator.price_per_gpu_hour

    def to_dict(self) -> dict:
        m, lay = self.memory, self.layout
        return {
            "accelerator": self.accelerator.name,
            "gpus": lay.num_gpus,
            "nodes": lay.nodes,
            "layout": {
                "zero_stage": lay.zero_stage,
                "offload_optimizer": lay.offload_optimizer,
                "offload_param": lay.offload_param,
                "gradient_checkpointing": lay.gradient_checkpointing,
                "activation_offload": lay.activation_offload,
                "micro_batch_size": lay.micro_batch_size,
                "grad_accum_steps": lay.grad_accum_steps,
                "sequence_parallel": lay.sequence_parallel,
            },
            "description": lay.describe(),
            "fits": self.fits,
            "binding": self.binding,
            "memory_per_gpu": _memory_dict(m),
            "usable_per_gpu": self.usable_bytes,
            "host_ram_per_node": m.host_total,
            "nvme_per_node": m.nvme,
            "step_time_s": round(self.step.total_s, 4),
            "compute_s": round(self.step.compute_s, 4),
            "comm_s": round(self.step.comm_s, 4),
            "collectives_s": round(self.step.collectives_s, 4),
            "offload_s": round(self.step.offload_s, 4),
            "sampling_s": round(self.step.sampling_s, 4),
            "mfu": self.mfu,
            "hfu": round(self.hfu, 4),
            "achieved_mfu": round(self.achieved_mfu, 4),
            "tokens_per_step": self.tokens_per_step,
            "wall_hours": round(self.wall_s / 3600, 4),
            "wall_days": round(self.wall_days, 4),
            "gpu_hours": round(self.gpu_hours, 4),
            "cost_usd": round(self.cost, 2),
        }


def _memory_dict(m: TrainMemory) -> dict:
    terms = {name.replace(" ", "_"): b for name, b in m.device_terms()}
    return {**terms, "total": m.device_total}


def evaluate(work: Workload, layout: Layout, acc: Accelerator, *, steps: int, mfu: float) -> Option:
    memory = train_memory(work, layout, device="cuda")
    fits, binding = _binding(memory, acc)
    server = sampler_server_bytes(work) if work.sampler_server_gpus else 0  # grpo.sampler server on a GPU of its own
    if server > acc.memory_bytes * USABLE_FRACTION * work.sampler_server_gpus:
        fits = False
        binding = (
            f"a grpo.sampler server's GPU memory {_gib(server)} (the model whole and its KV cache) of "
            f"{_gib(acc.memory_bytes * USABLE_FRACTION * work.sampler_server_gpus)} usable"
        )
    tokens = layout.rows_per_step * work.seq_len
    step = step_time(work, layout, acc, mfu)
    return Option(
        acc,
        layout,
        memory,
        fits,
        binding,
        step,
        steps,
        tokens,
        mfu,
        hfu(work, layout.gradient_checkpointing, mfu),
        extra_gpus=work.sampler_servers * work.sampler_server_gpus,
    )


def _binding(m: TrainMemory, acc: Accelerator) -> tuple[bool, str]:
    usable = acc.memory_bytes * USABLE_FRACTION
    term, largest = max(m.device_terms(), key=lambda t: t[1])
    checks = [  # (used / available, description)
        (
            m.device_total / usable,
            f"GPU memory {_gib(m.device_total)} of {_gib(usable)} usable (largest: {term} {_gib(largest)})",
        ),
        (
            m.host_total / acc.host_memory_bytes,
            f"host RAM {_gib(m.host_total)} per node of {_gib(acc.host_memory_bytes)}",
        ),
    ]
    if m.nvme:
        checks.append((m.nvme / acc.nvme_bytes, f"NVMe {_gib(m.nvme)} per node of {_gib(acc.nvme_bytes)}"))
    over = [text for ratio, text in checks if ratio > 1]
    if over:
        return False, "; ".join(over)
    ratio, text = max(checks)
    return True, f"{ratio:.0%} " + text


def candidate_layouts(
    *,
    global_batch: int,
    max_micro_batch: int,
    gpus: int | None,
    gpus_per_node: int,
    has_nvme_path: bool = True,
    sequence_parallel: int = 1,
) -> list[Layout]:
    """Every layout the search tries: ZeRO 0-3 x offload targets x checkpointing x micro-batch x GPU count (1, 2,
    4, then whole nodes doubling to 16,384), each keeping the global batch (exactly, unless `gpus` is fixed and
    does not divide it): data parallelism gives each GPU at least one sequence, or with `sequence_parallel` each
    group of that many GPUs (which split each row between them)."""
    sp = sequence_parallel
    micro = sorted({m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= max_micro_batch} | {max_micro_batch})
    counts = [gpus] if gpus else [c for c in gpu_counts(gpus_per_node) if c <= global_batch * sp]
    out = []
    for g in counts:
        if g % sp:
            continue
        groups = g // sp
        for mb in micro:
            if gpus:
                accum = max(1, math.ceil(global_batch / (mb * groups)))
            elif global_batch % (mb * groups):
                continue
            else:
                accum = global_batch // (mb * groups)
            for stage in (0, 1, 2, 3):
                for opt, par in OFFLOADS:
                    if not _offload_allowed(stage, opt, par) or ("nvme" in (opt, par) and not has_nvme_path):
                        continue
                    for ckpt in (False, True):
                        out.append(Layout(stage, opt, par, ckpt, mb, accum, g, gpus_per_node, sequence_parallel=sp))
    return out


def sequence_parallel_degrees(work: Workload, gpus_per_node: int) -> list[int]:
    """The sequence-parallel group sizes (`scaling.sequence_parallel`) the search may try for `work`, beyond 1: powers
    of two up to a node's GPUs (the all-to-alls stay on its links) that divide the model's heads (the key-value heads
    too, or are a multiple of them) and the rows; none for an objective other than causal_lm's (the spec refuses
    them)."""
    if work.rollouts > 1 or work.reference != "none" or work.head is not None or work.completion_tokens:
        return []
    text = work.config.get_text_config() if hasattr(work.config, "get_text_config") else work.config
    heads = getattr(text, "num_attention_heads", 0) or 0
    kv = work.shape.kv_heads or heads
    out, d = [], 2
    while d <= gpus_per_node:
        if heads and heads % d == 0 and (kv % d == 0 or d % kv == 0) and work.seq_len % d == 0:
            out.append(d)
        d *= 2
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


def fastest(options: list[Option]) -> Option | None:
    """The option that finishes first (the cheaper of two that tie)."""
    return min(options, key=lambda o: (round(o.wall_s, 6), o.cost), default=None)


def _preference(o: Option) -> tuple:
    lay = o.layout
    return (
        lay.num_gpus,
        OFFLOADS.index((lay.offload_optimizer, lay.offload_param)),
        lay.gradient_checkpointing,
        -lay.micro_batch_size,
        o.memory.device_total,
        -lay.zero_stage,
    )


def pareto(options: list[Option]) -> list[Option]:
    """The time/cost front: options nothing else is both faster and cheaper than, fastest first (so cost falls
    along it). A slower option joins only if it saves more than COST_TIE: a cent's saving is not a trade-off."""
    front: list[Option] = []
    for o in sorted(options, key=lambda o: (o.wall_s, o.cost)):
        if not front or o.cost < front[-1].cost * (1 - COST_TIE):
            front.append(o)
    return front


def search_options(
    work: Workload,
    acc: Accelerator,
    *,
    global_batch: int,
    max_micro_batch: int,
    steps: int,
    mfu: float,
    gpus: int | None = None,
) -> list[Option]:
    """The best configuration of `work` on `acc` that fits at each GPU count (the cheapest, near ties broken by
    preference), fewest GPUs first. Where no layout of data parallelism alone fits (a row's activations too large
    for one GPU), the layouts of sequence parallelism too (`sequence_parallel_degrees`): groups of GPUs that split
    each row."""
    by_count: dict[int, list[Option]] = {}
    for sp in [1, *sequence_parallel_degrees(work, acc.gpus_per_node)]:
        if by_count:
            break
        layouts = candidate_layouts(
            global_batch=global_batch,
            max_micro_batch=max_micro_batch,
            gpus=gpus,
            gpus_per_node=acc.gpus_per_node,
            sequence_parallel=sp,
        )
        for lay in layouts:
            if work.head is not None and lay.gradient_checkpointing:
                continue  # (objective eagle3 refuses it: the frozen model keeps no activations to recompute)
            o = evaluate(work, lay, acc, steps=steps, mfu=mfu)
            if o.fits:
                by_count.setdefault(lay.num_gpus, []).append(o)
    return [cheapest(by_count[g]) for g in sorted(by_count)]


def search(
    work: Workload,
    acc: Accelerator,
    *,
    global_batch: int,
    max_micro_batch: int,
    steps: int,
    mfu: float,
    gpus: int | None = None,
) -> Option | None:
    """The cheapest configuration of `work` on `acc` that fits (None if none does), whatever it takes."""
    return cheapest(
        search_options(
            work, acc, global_batch=global_batch, max_micro_batch=max_micro_batch, steps=steps, mfu=mfu, gpus=gpus
        )
    )


def choose(options: list[Option], *, deadline_s: float, budget_usd: float | None) -> tuple[Option | None, str | None]:
    """The recommendation among fitting options and what it misses ('deadline', 'budget' or None): the cheapest
    within the deadline and the budget; else, if anything is within the budget, the fastest that is; else the
    cheapest that meets the deadline (or the cheapest of all)."""
    if not options:
        return None, None
    affordable = [o for o in options if budget_usd is None or o.cost <= budget_usd]
    both = [o for o in affordable if o.wall_s <= deadline_s]
    if both:
        return cheapest(both), None
    if affordable:
        return fastest(affordable), "deadline"
    in_time = [o for o in options if o.wall_s <= deadline_s]
    return cheapest(in_time or options), "budget"


def _config_from_dir(uri: str, what: str):
    """The Hugging Face config of a model directory, reading only its config.json (never the weights); of a multimodal
    checkpoint (Gemma 3 4B-27B), its language model's (the vision tower's weights: `vision_params`)."""
    config = _whole_config_from_dir(uri, what)
    text = config.get_text_config()
    if text is not config:  # the multimodal model ties its lm_head as its own config says
        text = copy.deepcopy(text)
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def vision_params(uri: str, what: str) -> int:
    """The parameters of a multimodal checkpoint's vision tower and projector (what the serving engine keeps for
    requests with images), counted on the meta device from its config.json; 0 for a text-only model."""
    import torch
    from transformers import AutoModelForImageTextToText

    from pylon.serving.model.families import IMAGE_MODELS, has_processor

    config = _whole_config_from_dir(uri, what)
    if getattr(config, "vision_config", None) is None or config.model_type not in IMAGE_MODELS:
        return 0  # (Llama 4's multimodal checkpoints are served for their text: no vision tower kept)
    if not has_processor(uri):
        return 0  # (saved without its image processor: served for its text, as the engine does)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    inner = model.model
    parts = (inner.visual,) if hasattr(inner, "visual") else (inner.vision_tower, inner.multi_modal_projector)
    return sum(p.numel() for part in parts for p in part.parameters())  # (Qwen's `visual` holds its merger)


def _whole_config_from_dir(uri: str, what: str):
    from transformers import AutoConfig

    try:
        raw = storage.read_json(storage.join(uri, "config.json"))
    except StorageError as e:
        raise PylonError(f"{what} {uri}: cannot read config.json ({e}); the planner needs the model's config") from None
    with tempfile.TemporaryDirectory(prefix="pylon-plan-") as tmp:
        Path(tmp, "config.json").write_text(json.dumps(raw))
        try:
            config = AutoConfig.from_pretrained(tmp, local_files_only=True)
        except (OSError, ValueError) as e:
            raise PylonError(f"{what} {uri}: not a Hugging Face config.json ({e})") from None
    return config


def train_workload(spec: TrainJobSpec, *, seq_len: int | None = None) -> tuple[Workload, list[str]]:
    """The model, precision, sequence length and adapters `spec` trains, with notes on where they came from."""
    from pylon.models import model_config, with_head

    notes = []
    manifest = None
    try:
        from pylon.data.shards import read_manifest

        manifest = read_manifest(spec.data.uri)
    except Exception as e:  # no dataset yet, or unreachable storage: plan from the spec alone
        notes.append(f"dataset {spec.data.uri} not read ({type(e).__name__}); vocabulary from the model")
    seq = seq_len or spec.data.seq_len or (manifest.seq_len if manifest else None)
    if not seq:
        raise PylonError(
            f"TrainJob '{spec.name}': the sequence length is unknown: set data.seq_len in the spec, "
            f"prepare the dataset at {spec.data.uri} first, or pass --seq-len"
        )
    if spec.model.path is not None:
        config = _config_from_dir(spec.model.path, "model.path")
    else:
        # The dataset's tokenizer sizes the embeddings, as in training; without it, the model's own vocabulary
        # (special ids only keep transformers from warning about ids outside it).
        tok = manifest.tokenizer if manifest else None
        config = model_config(
            spec.model,
            vocab_size=tok.vocab_size if tok else None,
            eos_id=tok.eos_id if tok else 0,
            pad_id=tok.pad_id if tok else 0,
        )
    config = with_head(config, reward=spec.objective == "reward")  # a reward model: a scalar head, no lm_head
    shape = model_shape(config, spec.lora)
    head = None
    if spec.objective == "eagle3":  # the model frozen, the drafting head trained beside it (pylon.draft_head)
        head, shape = _eagle3_head(spec, config, shape, notes)
    if manifest is not None:
        from pylon.data.shards import separate_documents

        documents = separate_documents(spec.attention_mask, manifest, f"data.uri {spec.data.uri}")
    else:
        documents = spec.attention_mask == "document"
        if spec.attention_mask == "auto":
            notes.append("attention_mask auto planned as causal (a chat dataset would attend each document apart)")
    rl = spec.objective in RL_OBJECTIVES
    referenced = spec.objective in ("dpo", "kto", "online_dpo") or (rl and spec.grpo.beta > 0)
    reference = "none" if not referenced else "adapters" if spec.lora else "copy"
    if spec.precompute_reference:  # read once before the first step: no copy held, no pass a step
        reference = "none"
        notes.append(
            "precompute_reference: the reference's one forward pass over the dataset before the first step is not in "
            "the time; no frozen copy is held and no reference pass runs a step"
        )
    if spec.objective == "kto" and spec.kto_loss == "kto":
        notes.append(
            "objective kto's KL baseline (the model and the reference on mismatched prompts and completions, without "
            "gradients) is not in the time: two more forward passes a micro-batch, half as many FLOPs again"
        )
    rollouts = 1
    if rl:  # each row's prompt and its completions, trained as one micro-batch
        rollouts, seq = spec.grpo.generations, seq + spec.grpo.max_completion_tokens
        notes.append(
            f"objective {spec.objective} planned as {rollouts} sequences of seq_len + max_completion_tokens "
            f"({seq:,}) tokens per micro-batch row (one prompt a row); sampling's memory (its KV cache and, at "
            "ZeRO-3, the gathered model) where it is more than the training pass's activations; its time as a "
            "prefill of the prompts and a decode step per completion token, each reading every weight once"
        )
    chunk = spec.loss_chunk_tokens
    engine = rl and spec.grpo.sampler != "model"
    gathered = rl and spec.grpo.zero3_gather_for_sampling and not engine
    sampler_kv, servers, server_gpus = 0, 0, 0.0
    if engine:
        sampler_kv = sampler_kv_cache_tokens(spec, seq - spec.grpo.max_completion_tokens)
    if engine and spec.grpo.sampler == "server":
        g = spec.grpo
        servers, server_gpus = g.sampler_servers, g.sampler_resources.get("GPU", 0.0)
        workers = -(-spec.scaling.num_workers // servers)
        device = "cuda" if server_gpus else "cpu"
        held = sampler_server_bytes(
            Workload(config, shape, spec.precision, seq, None, sampler_kv_tokens=sampler_kv, sampler_servers=servers),
            device,
        )
        notes.append(
            f"grpo.sampler server: {g.sampler_servers} sampling server(s) of {dict(g.sampler_resources)}, each "
            f"holding the model whole and {sampler_kv:,} KV cache tokens ({held / 2**30:.1f} GiB on its {device}) "
            f"outside the workers' memory, and sampling the rows of up to {workers} worker(s) together; its time as "
            "the engine's on the workers' accelerator, the weights sent to it once a step; its GPUs in the cost"
        )
    elif engine:
        notes.append(
            f"grpo.sampler engine: a serving engine on every worker holds the model whole and {sampler_kv:,} KV cache "
            "tokens for the whole run; its sampling time as a prefill of each prompt once (its other completions "
            f"read it from the prefix cache), decode steps of at most {spec.grpo.sampler_max_num_seqs} completions "
            "(grpo.sampler_max_num_seqs) at a time, and the weights copied in once a step (at ZeRO-3, gathered)"
        )
    work = Workload(
        config, shape, spec.precision, seq, spec.lora, documents, chunk, reference, rollouts,
        gathered_sampling=gathered, completion_tokens=spec.grpo.max_completion_tokens if rl else 0,
        sampler_kv_tokens=sampler_kv, sampler_max_num_seqs=spec.grpo.sampler_max_num_seqs if rl else 64,
        sampler_servers=servers, sampler_server_gpus=server_gpus,
        head=head, head_steps=(spec.eagle3 or Eagle3Spec()).ttt_steps if head is not None else 0,
    )  # fmt: skip
    return work, notes


def _eagle3_head(spec: TrainJobSpec, config, shape: ModelShape, notes: list[str]):
    """objective eagle3: the head's config, and the model's shape with the head's parameters added to it and the
    head's alone trained."""
    from pylon.draft_head import aux_layers, head_config, head_parameters

    settings = spec.eagle3 or Eagle3Spec()
    n = config.num_hidden_layers
    aux = aux_layers(settings.aux_layers, n)
    draft = min(settings.draft_vocab_size, config.vocab_size)
    head = head_config(config, draft_vocab=draft, aux=aux, intermediate_size=settings.intermediate_size)
    params, matmul = head_parameters(head)
    notes.append(
        f"objective eagle3: the model frozen in {spec.precision} (no gradients, optimizer states or kept activations "
        "of its own; whole on every GPU at ZeRO 0-2, partitioned at ZeRO-3); the head's "
        f"{params / 1e6:,.1f}M parameters trained, {settings.ttt_steps} drafts deep (each draft's queries over the "
        "first draft's keys and its chain's, one masked attention); gradient checkpointing is not planned (objective "
        "eagle3 refuses it)"
    )
    shape = dataclasses.replace(
        shape, total_params=shape.total_params + params, trainable_params=params, trainable_matmul_params=matmul
    )
    return head, shape


def _requested_layout(spec: TrainJobSpec, gpus: int | None, gpus_per_node: int) -> Layout:
    g = gpus or spec.scaling.num_workers
    mb, sp = spec.batch.micro_batch_size, spec.scaling.sequence_parallel
    if g % sp:
        sp = 1  # (--gpus that a group of the spec's size does not divide: planned without)
    accum = max(1, math.ceil(spec.global_batch_size / (mb * g // sp)))
    ds = spec.deepspeed
    return Layout(
        ds.zero_stage,
        ds.offload_optimizer,
        ds.offload_param,
        spec.gradient_checkpointing,
        mb,
        accum,
        g,
        gpus_per_node,
        buffers=Buffers.of(ds.buffers),
        grad_accum=ds.grad_accum_dtype,
        sequence_parallel=sp,
        activation_offload=spec.activation_offload,
    )


@dataclass
class AcceleratorRow:
    accelerator: Accelerator
    requested: Option
    options: list[Option]  # the best that fits at each GPU count, fewest GPUs first
    best: Option | None = None  # the choice on this accelerator alone, by the plan's deadline and budget
    pareto: list[Option] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)  # what data parallelism alone cannot do here, and what would

    @property
    def cheapest(self) -> Option | None:
        """The cheapest configuration that fits, whatever it takes."""
        return cheapest(self.options)


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
    deadline_days: float = DEFAULT_DEADLINE_DAYS
    budget_usd: float | None = None
    shortfall: str | None = None  # what the recommendation misses: 'deadline', 'budget' or None
    verdict: str = ""  # one sentence on the deadline and the budget: met, or what meeting them would take
    cpu_worker_bytes: int | None = None  # a CPU worker's RAM as requested (use_gpu false)
    cpu_job_bytes: int | None = None  # the whole job's RAM on CPU workers: its workers, driver and controller
    lora_alternative: tuple[LoraSpec, Option] | None = None
    # bytes per GPU the recommendation's activations would shrink by with the loss a chunk at a time (when off)
    chunked_loss_saving: int | None = None
    notes: list[str] = field(default_factory=list)
    kind: str = "TrainJob"

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch * self.work.rollouts * self.work.seq_len

    def row(self, name: str) -> AcceleratorRow:
        return next(r for r in self.rows if r.accelerator.name == name)

    def to_dict(self) -> dict:
        s = self.work.shape
        rec = self.recommendation
        return {
            "kind": self.kind,
            "name": self.name,
            "model": {
                "description": self.model,
                "parameters": s.total_params,
                "trainable_parameters": s.trainable_params,
                "largest_layer_parameters": s.largest_layer_params,
                "layers": s.num_layers,
                "hidden_size": s.hidden_size,
                "vocab_size": s.vocab_size,
            },
            "precision": self.work.precision,
            "seq_len": self.work.seq_len,
            "lora": _lora_dict(self.work.lora),
            "steps": self.steps,
            "global_batch": self.global_batch,
            "tokens": self.tokens,
            "flops_per_token": work_flops_per_token(self.work),
            "utilization": {"mfu": self.mfu, "hfu": round(rec.hfu, 4) if rec else None, "mfu_means": MFU_MEANS},
            "deadline_days": self.deadline_days,
            "budget_usd": self.budget_usd,
            "meets_deadline": bool(rec) and rec.wall_s <= self.deadline_days * DAY_S,
            "meets_budget": bool(rec) and (self.budget_usd is None or rec.cost <= self.budget_usd),
            "verdict": self.verdict,
            "requested": {
                "layout": self.requested_layout.describe(),
                "gpus": self.requested_layout.num_gpus,
                "use_gpu": self.use_gpu,
                "memory_per_gpu": _memory_dict(self.requested_memory),
                "memory_notes": self.requested_memory.notes,
                "host_ram_per_node": self.requested_memory.host_total,
                "nvme_per_node": self.requested_memory.nvme,
                "cpu_worker_ram": self.cpu_worker_bytes,
                "cpu_job_ram": self.cpu_job_bytes,
            },
            "accelerators": [
                {
                    "name": r.accelerator.name,
                    "memory_gib": r.accelerator.memory_gib,
                    "price_per_gpu_hour": r.accelerator.price_per_gpu_hour,
                    "requested": r.requested.to_dict(),
                    "cheapest": r.cheapest.to_dict() if r.cheapest else None,
                    "best": r.best.to_dict() if r.best else None,
                    "pareto": [o.to_dict() for o in r.pareto],
                    "advice": r.advice,
                }
                for r in self.rows
            ],
            "recommendation": rec.to_dict() if rec else None,
            "explanation": self.explanation,
            "lora_alternative": (
                {"lora": _lora_dict(self.lora_alternative[0]), **self.lora_alternative[1].to_dict()}
                if self.lora_alternative
                else None
            ),
            "chunked_loss": (
                {"loss_chunk_tokens": CHUNK_HINT_TOKENS, "activation_bytes_saved_per_gpu": self.chunked_loss_saving}
                if self.chunked_loss_saving
                else None
            ),
            "assumptions": _assumptions(self.mfu, self.prices_source, self.deadline_days, self.budget_usd),
            "counted": COUNTED,
            "notes": self.notes,
        }


def _lora_dict(lora: LoraSpec | None) -> dict | None:
    return lora.model_dump(mode="json") if lora else None


def _assumptions(mfu: float, prices: str, deadline_days: float | None = None, budget_usd: float | None = None) -> dict:
    """What a plan assumed, for its JSON; a training plan's with its deadline and budget (a serving plan has none)."""
    return {
        "mfu": mfu,
        "mfu_means": MFU_MEANS,
        "usable_memory_fraction": USABLE_FRACTION,
        "collective_efficiency": COLLECTIVE_EFFICIENCY,
        "ring_step_latency_s": RING_STEP_LATENCY_S,
        "communication": COMMUNICATION,
        "cpu_adam_params_per_s": CPU_ADAM_PARAMS_PER_S,
        "nvme_gbs_per_node": NVME_GBS,
        "cuda_runtime_bytes": CUDA_RUNTIME_BYTES,
        "zero12_runtime_extra_bytes": ZERO12_RUNTIME_EXTRA_BYTES,
        "allocator_reserve": ALLOCATOR_RESERVE,
        "gpu_counts": f"1, 2, 4, then whole nodes doubling, up to {MAX_GPUS:,}; at most one GPU per sequence",
        **({"deadline_days": deadline_days, "budget_usd": budget_usd} if deadline_days is not None else {}),
        "prices": prices,
    }


COMMUNICATION = (
    f"ZeRO's collectives at {COLLECTIVE_EFFICIENCY:.0%} of the link rate (inside a node the GPU interconnect; "
    "across nodes the node's network, capped by the interconnect) plus "
    f"{RING_STEP_LATENCY_S * 1e6:.0f} us per ring step, hidden behind compute (ZeRO-2/3: every micro-batch's "
    "backward; ZeRO-0/1: the last one's) except where they take longer; offload traffic is not hidden"
)


def plan_train(
    spec: TrainJobSpec,
    *,
    catalog: Catalog | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    mfu: float = DEFAULT_MFU,
    seq_len: int | None = None,
    deadline_days: float = DEFAULT_DEADLINE_DAYS,
    budget_usd: float | None = None,
) -> TrainPlan:
    """The plan of a TrainJob on every accelerator of the catalog (or only `gpu`): as requested; the best that
    fits at each GPU count and their time/cost front; and the recommendation: the cheapest that finishes within
    `deadline_days` and costs at most `budget_usd`, else the fastest and what meeting them would take. `gpus`
    fixes the GPU count (default: the spec's workers as requested, any count for the search)."""
    _check_knobs(mfu=mfu, gpus=gpus, deadline_days=deadline_days, budget_usd=budget_usd)
    catalog = catalog or load_catalog()
    accelerators = [catalog.get(gpu)] if gpu else list(catalog.accelerators)
    work, notes = train_workload(spec, seq_len=seq_len)
    global_batch, steps = spec.global_batch_size, spec.steps
    deadline_s = deadline_days * DAY_S
    if gpus and global_batch % gpus:
        notes.append(
            f"{gpus} GPUs do not divide the global batch of {global_batch} sequences: gradient "
            "accumulation is rounded up, so each step trains slightly more sequences"
        )
    rows = []
    for acc in accelerators:
        requested = evaluate(work, _requested_layout(spec, gpus, acc.gpus_per_node), acc, steps=steps, mfu=mfu)
        options = search_options(
            work,
            acc,
            global_batch=global_batch,
            max_micro_batch=spec.batch.micro_batch_size,
            steps=steps,
            mfu=mfu,
            gpus=gpus,
        )
        best, _ = choose(options, deadline_s=deadline_s, budget_usd=budget_usd)
        advice = _advice(work, acc, options, global_batch=global_batch, deadline_s=deadline_s, gpus=gpus)
        rows.append(AcceleratorRow(acc, requested, options, best, pareto(options), advice))
    if spec.scaling.use_gpu and not spec.activation_offload:
        notes.extend(_offload_would_fit(work, rows, steps=steps, mfu=mfu))
    everything = [o for r in rows for o in r.options]
    recommendation, shortfall = choose(everything, deadline_s=deadline_s, budget_usd=budget_usd)
    requested_layout = _requested_layout(spec, gpus, min(8, gpus or spec.scaling.num_workers))
    plan = TrainPlan(
        name=spec.name,
        model=spec.model.describe(),
        work=work,
        steps=steps,
        global_batch=global_batch,
        requested_layout=requested_layout,
        requested_memory=train_memory(work, requested_layout, device="cuda"),
        rows=rows,
        recommendation=recommendation,
        explanation=[],
        mfu=mfu,
        prices_source=catalog.prices_source,
        use_gpu=spec.scaling.use_gpu,
        deadline_days=deadline_days,
        budget_usd=budget_usd,
        shortfall=shortfall,
        verdict=_verdict(recommendation, shortfall, everything, deadline_days, budget_usd),
        notes=notes,
    )
    if not spec.scaling.use_gpu:
        plan.cpu_worker_bytes = cpu_worker_bytes(work, _requested_layout(spec, None, spec.scaling.num_workers))
        plan.cpu_job_bytes = cpu_job_bytes(work, _requested_layout(spec, None, spec.scaling.num_workers))
    if recommendation is not None and spec.lora is None and recommendation.layout.offloads:
        plan.lora_alternative = _lora_alternative(spec, recommendation, work, mfu=mfu)
    from pylon.models import is_classifier

    # (a reward model has no output layer to chunk)
    if recommendation is not None and not work.loss_chunk_tokens and not is_classifier(work.config):
        plan.chunked_loss_saving = _chunked_loss_saving(work, recommendation)
    if recommendation is not None and recommendation.hfu > MAX_HFU:
        notes.append(
            f"MFU {mfu:.2f} with recomputation means the GPUs execute {recommendation.hfu:.0%} of their peak "
            f"(HFU), more than dense training sustains (~{MAX_HFU:.0%}): a lower --mfu is likelier"
        )
    plan.explanation = _explain(plan)
    return plan


def _offload_would_fit(work: Workload, rows: list[AcceleratorRow], *, steps: int, mfu: float) -> list[str]:
    """Where the layout as requested does not fit an accelerator and would with `activation_offload` (its saved
    activations in host memory): a note each, with what it then takes on the GPU and the host and how long it runs.
    (The search does not propose it: a spec asks for it.)"""
    out = []
    for r in rows:
        o = r.requested
        if o.fits:
            continue
        off = evaluate(
            work, dataclasses.replace(o.layout, activation_offload=True), r.accelerator, steps=steps, mfu=mfu
        )
        if off.fits:
            out.append(
                f"{r.accelerator.name}: as requested it does not fit ({o.binding}); with activation_offload: true "
                f"(what the forward pass saves in pinned host memory) it does: {_gib(off.memory.device_total)} per "
                f"GPU, {_gib(off.memory.host_total)} host RAM per node, {off.wall_s / 3600:,.1f} h, ${off.cost:,.2f}"
            )
    return out


MAX_HFU = 0.8  # hardware FLOPs utilisation beyond which an assumed MFU is implausible
CHUNK_HINT_TOKENS = 4096  # the loss_chunk_tokens a plan suggests where the logits weigh
CHUNK_HINT_SHARE = 0.1  # suggested when it frees at least this share of the recommendation's memory per GPU


def _chunked_loss_saving(work: Workload, rec: Option) -> int | None:
    """Activation bytes per GPU the recommended layout would save with `loss_chunk_tokens` (the planner's simulated
    step, chunked); None when under CHUNK_HINT_SHARE of its memory (the logits do not weigh)."""
    lay = rec.layout
    chunked = dataclasses.replace(work, loss_chunk_tokens=CHUNK_HINT_TOKENS, _peaks={})
    device = "cuda"
    saving = work.activation_peak(lay.micro_batch_size, lay.gradient_checkpointing, device) - chunked.activation_peak(
        lay.micro_batch_size, lay.gradient_checkpointing, device
    )
    return saving if saving >= CHUNK_HINT_SHARE * rec.memory.device_total else None


LONG_SEQUENCE = 32_768  # tokens from which context parallelism is the usual way to split a sequence


def _pow2(x: float) -> int:
    """The smallest power of two at least `x` (at least 1)."""
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0)) - 1e-9))


def _dp_limit(global_batch: int, gpus_per_node: int) -> int:
    """The most GPUs data parallelism spreads the global batch over: one sequence each, at a count searched."""
    counts = [c for c in gpu_counts(gpus_per_node) if c <= global_batch and global_batch % c == 0]
    return max(counts, default=1)


def _advice(
    work: Workload, acc: Accelerator, options: list[Option], *, global_batch: int, deadline_s: float, gpus: int | None
) -> list[str]:
    """What data parallelism (ZeRO) alone cannot do on `acc`, and which parallelism would, with rough figures:
    fitting one sequence's activations (tensor, then context parallelism), model states that ZeRO-3 cannot
    spread thinly enough (pipeline), or a deadline that needs more GPUs than the global batch has sequences."""
    seq, per_node = work.seq_len, acc.gpus_per_node
    limit = gpus or _dp_limit(global_batch, per_node)
    where = f"{gpus} GPUs, as --gpus fixes" if gpus else f"{limit} GPUs: one sequence each of the {global_batch} a step"
    long_seq = ", or context parallelism (CP) for sequences this long" if seq >= LONG_SEQUENCE else ""
    if not options:
        lay = Layout(3, "none", "none", True, 1, max(1, math.ceil(global_batch / limit)), limit, per_node)
        m = train_memory(work, lay)
        usable = acc.memory_bytes * USABLE_FRACTION
        if m.device_total <= usable:
            return []  # GPU memory is not what binds (host RAM or NVMe is): more parallelism would not help
        rest = m.device_total - m.activations
        if rest >= usable:
            room = usable - (rest - m.model_states) - m.activations
            pp = f"PP={_pow2(m.model_states / room)}" if room > 0 else "PP"
            return [
                f"ZeRO-3 over {where} still leaves {_gib(rest)} of model states and buffers per GPU (of "
                f"{_gib(usable)} usable) before activations: it needs pipeline parallelism across nodes ({pp}, "
                "each stage holding its share of the layers) or more sequences per step to spread over more GPUs"
            ]
        tp = _pow2(m.activations / (usable - rest))
        degrees = sequence_parallel_degrees(work, per_node)
        tried = (
            f" (sequence parallelism, scaling.sequence_parallel, splitting each row over up to {max(degrees)} GPUs "
            "of a node, does not fit it either)"
            if degrees
            else ""
        )
        head = (
            f"one {seq:,}-token sequence's activations take {_gib(m.activations)} per GPU even with recomputation, "
            f"beside {_gib(rest)} of model states and buffers (ZeRO-3 over {where}), of {_gib(usable)} usable"
            f"{tried}: "
        )
        if tp <= per_node:
            return [
                head + f"it needs tensor parallelism within a node, TP={tp} (with sequence parallelism the "
                f"activations split {tp} ways){long_seq}"
            ]
        cp = _pow2(m.activations / per_node / (usable - rest))
        return [
            head + f"it needs TP={per_node} within a node and context parallelism across nodes, CP={cp} (each "
            f"sequence split over {cp} x {per_node} GPUs)"
        ]
    quickest = fastest(options)
    if quickest.wall_s <= deadline_s:
        return []
    needed = math.ceil(quickest.wall_s * quickest.layout.num_gpus / deadline_s)
    head = (
        f"{quickest.layout.num_gpus} x {acc.name} ({quickest.layout.describe()}) take {quickest.wall_days:,.1f} d; "
        f"{deadline_s / DAY_S:g} d would take ~{needed:,} GPUs"
    )
    if needed > limit and quickest.layout.num_gpus >= limit:
        factor = needed / limit
        degree = _pow2(factor)
        how = (
            f"tensor parallelism within a node (TP={degree})"
            if degree <= per_node
            else f"tensor parallelism within a node and pipeline parallelism across nodes (TP={per_node} x "
            f"PP={degree // per_node})"
        )
        beyond = f"; beyond {MAX_GPUS:,} GPUs, the most the planner searches" if needed > MAX_GPUS else ""
        return [
            f"{head}, {factor:.1f}x more than data parallelism can use ({where}): {how} lets {degree} GPUs share "
            f"each sequence, or a global batch of at least {needed:,} sequences{long_seq}{beyond}"
        ]
    slower = [o for o in options if o.layout.num_gpus > quickest.layout.num_gpus]
    if slower:
        o = slower[0]
        return [
            f"{head}, but more GPUs do not finish sooner under ZeRO alone: at {o.layout.num_gpus} its collectives "
            f"take {o.step.collectives_s:.2f} s a step against {o.step.compute_s:.2f} s of compute. Tensor "
            f"parallelism within a node (TP={per_node}) or hierarchical sharding (ZeRO++ hpZ, HSDP) keeps most of "
            "the traffic on the node's own links"
        ]
    return [f"{head}: no more fit on {acc.name} with ZeRO alone"]


def _verdict(
    rec: Option | None, shortfall: str | None, options: list[Option], deadline_days: float, budget: float | None
) -> str:
    """One sentence on the deadline and budget: met, or what meeting them would take."""
    if rec is None:
        return ""
    deadline = f"{deadline_days:g} d"
    in_time = [o for o in options if o.wall_days <= deadline_days]
    if shortfall is None:
        return f"meets the deadline of {deadline}" + (f" and the budget of {_usd(budget)}" if budget else "")
    if shortfall == "deadline":
        within = f" within the budget of {_usd(budget)}" if budget is not None else ""
        fastest_one = "the fastest configuration within it" if budget is not None else "the fastest configuration"
        out = (
            f"the deadline of {deadline} cannot be met{within}: {fastest_one} takes {rec.wall_days:,.1f} d. "
            f"It would take a deadline of {math.ceil(rec.wall_days):,} d"
        )
        if in_time:
            c = cheapest(in_time)
            out += (
                f", or a budget of {_usd(c.cost)} ({c.layout.num_gpus} x {c.accelerator.name} finishes in "
                f"{c.wall_days:,.1f} d)"
            )
        else:
            out += ", or parallelism beyond ZeRO's (below)"
        return out
    what = " that meets the deadline" if rec.wall_days <= deadline_days else ""
    return (
        f"no configuration costs at most {_usd(budget)}: the cheapest{what} costs {_usd(rec.cost)} "
        f"({rec.layout.num_gpus} x {rec.accelerator.name}, {rec.wall_days:,.1f} d): it would take a budget of at "
        f"least {_usd(rec.cost)}"
    )


def cpu_worker_bytes(work: Workload, layout: Layout) -> int:
    """RAM one CPU worker needs as requested: its step's memory (model states, activations, the buckets' written
    pages), its share of what is offloaded, and the process itself."""
    m = train_memory(work, layout, device="cpu")
    return m.device_total + (m.host_states + m.host_buffers) // layout.gpus_on_node + PROCESS_BYTES


def cpu_job_bytes(work: Workload, layout: Layout) -> int:
    """RAM a training job on CPU workers adds to a cluster: its workers, plus its driver and Ray Train's
    controller and helper actors."""
    return cpu_worker_bytes(work, layout) * layout.num_gpus + JOB_PROCESSES_BYTES


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
    adapted = dataclasses.replace(  # (the sampling engine's settings kept: a LoRA run samples as the run would)
        work,
        shape=model_shape(work.config, lora),
        lora=lora,
        reference="none" if work.reference == "none" else "adapters",
        _peaks={},
    )
    best = search(
        adapted,
        rec.accelerator,
        global_batch=spec.global_batch_size,
        max_micro_batch=spec.batch.micro_batch_size,
        steps=spec.steps,
        mfu=mfu,
        gpus=rec.layout.num_gpus,
    )
    if best is None or best.layout.offloads:
        return None
    return lora, best


def _explain(plan: TrainPlan) -> list[str]:
    rec = plan.recommendation
    if rec is None:
        out = [
            f"no configuration fits on any accelerator considered, up to {MAX_GPUS:,} GPUs (at most one per "
            f"sequence of the global batch of {plan.global_batch}): shorten the sequences, use LoRA, or a smaller model"
        ]
        return out + [f"{r.accelerator.name}: {a}" for r in plan.rows for a in r.advice]
    lay, acc = rec.layout, rec.accelerator
    row = plan.row(acc.name)
    out = []
    fitting = sum(1 for r in plan.rows if r.options)
    limits = f"finish within {plan.deadline_days:g} d" + (
        f" and cost at most {_usd(plan.budget_usd)}" if plan.budget_usd is not None else ""
    )
    which = {
        None: f"cheapest of the configurations that {limits}",
        "deadline": f"fastest of the configurations{' within the budget' if plan.budget_usd is not None else ''} "
        f"(none can {limits})",
        "budget": "cheapest configuration"
        + (" that finishes in time" if rec.wall_days <= plan.deadline_days else "")
        + f" (none can {limits})",
    }[plan.shortfall]
    out.append(
        f"{which}, on the {fitting} accelerator(s) on which the job fits; {acc.name} at "
        f"${acc.price_per_gpu_hour:.2f} per GPU-hour needs {_gib(rec.memory.device_total)} of "
        f"{_gib(rec.usable_bytes)} usable per GPU"
    )
    req = row.requested
    if not req.fits:
        out.append(
            f"as requested ({req.layout.describe()}, {req.layout.num_gpus} GPU(s)) it does not fit on "
            f"{acc.name}: {req.binding}"
        )
    if lay.zero_stage and lay.num_gpus > 1:
        what = {
            1: "optimizer states",
            2: "optimizer states and gradients",
            3: "parameters, gradients and optimizer states",
        }[lay.zero_stage]
        out.append(f"ZeRO-{lay.zero_stage} splits the {what} over the {lay.num_gpus} GPUs")
    elif lay.offloads:
        out.append(f"ZeRO-{lay.zero_stage} on one GPU is what lets DeepSpeed offload")
    elif lay.zero_stage == 3:
        out.append(
            "ZeRO-3 on one GPU accumulates gradients straight into fp32 partitions: 18 bytes per "
            "parameter instead of 20"
        )
    if lay.offloads:
        out.append(
            f"offloading ({lay.describe().split(', micro')[0]}) needs {_gib(rec.memory.host_total)} of host "
            f"RAM per node (of {_gib(acc.host_memory_bytes)})"
            + (f" and {_gib(rec.memory.nvme)} of NVMe" if rec.memory.nvme else "")
            + f"; it adds {rec.step.offload_s:.2f} s per step of CPU Adam and PCIe/NVMe traffic"
        )
    if lay.gradient_checkpointing:
        out.append(
            "gradient checkpointing recomputes each block's forward in the backward pass to keep activations "
            f"small enough: at MFU {rec.mfu:.2f} the GPUs execute HFU {rec.hfu:.2f} of their peak (the MFU, as "
            "papers report it, already pays for the recomputation)"
        )
    sp = lay.sequence_parallel
    if sp > 1:
        from pylon.plan.steptime import sequence_parallel_s

        out.append(
            f"sequence parallelism (scaling.sequence_parallel: {sp}, DeepSpeed Ulysses): one row's activations do "
            f"not fit one GPU, so groups of {sp} GPUs split each row, each computing {plan.work.seq_len // sp:,} of "
            f"its {plan.work.seq_len:,} tokens; attention's all-to-alls within the group take "
            f"{sequence_parallel_s(plan.work, lay, acc):.2f} s a step"
        )
    out.append(
        f"micro-batch {lay.micro_batch_size} x {lay.grad_accum_steps} accumulation step(s) x "
        f"{lay.num_gpus} GPU(s)"
        + (f" in groups of {sp}" if sp > 1 else "")
        + f" keeps the global batch of {plan.global_batch} sequences"
    )
    hidden = (
        "hidden behind compute"
        if rec.step.comm_s == 0
        else f"longer than the compute they overlap: the MFU reached falls to {rec.achieved_mfu:.2f}"
    )
    out.append(
        f"{rec.wall_s / 3600:,.1f} h wall time, {rec.gpu_hours:,.1f} GPU-hours, ${rec.cost:,.2f}; "
        f"step {rec.step.total_s:.2f} s = compute {rec.step.compute_s:.2f} + exposed communication "
        f"{rec.step.comm_s:.2f} + offload {rec.step.offload_s:.2f}"
        + (f" + sampling {rec.step.sampling_s:.2f}" if rec.step.sampling_s else "")
        + (f" (collectives {rec.step.collectives_s:.2f} s, {hidden})" if lay.num_gpus > 1 else "")
    )
    out += [f"parallelism: {a}" for a in row.advice]
    if plan.chunked_loss_saving:
        out.append(
            f"the loss a chunk at a time (loss_chunk_tokens: {CHUNK_HINT_TOKENS}) would free "
            f"{_gib(plan.chunked_loss_saving)} per GPU: the logits of a micro-batch, which the output layer and the "
            "cross-entropy otherwise hold whole"
        )
    if plan.lora_alternative:
        lora, alt = plan.lora_alternative
        out.append(
            f"if a full fine-tune is not required: LoRA r={lora.r} on {', '.join(lora.target_modules)} "
            f"fits without offloading ({alt.layout.describe()}, {_gib(alt.memory.device_total)} per GPU, "
            f"{alt.wall_s / 3600:,.1f} h, ${alt.cost:,.2f})"
        )
    return out
