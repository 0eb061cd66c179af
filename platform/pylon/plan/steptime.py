"""How long a training step takes: the model's FLOPs spread over the GPUs at an assumed MFU, the collectives where
they outlast the compute they hide behind, and the offload traffic (CPU Adam, PCIe, NVMe).

1. Compute: a step of T tokens costs T x model FLOPs per token (6N + 12 x layers x d_model x seq, PaLM's MFU
   numerator, `pylon.models.flops_per_token`), over G GPUs x peak x MFU. MFU counts model FLOPs only, as papers
   report it, so recomputation for gradient checkpointing is inside it: it is why the hardware FLOPs
   utilisation (HFU, recomputation included) is higher than the MFU, not extra time.
2. Collectives: the bytes ZeRO's stage moves per GPU (ring all-reduce, reduce-scatter, all-gather) over the bus
   bandwidth a ring reaches (NVLink or PCIe inside a node; across nodes each GPU's NIC carries its rail, so a
   ring runs at the node's network bandwidth, capped by the link inside the node), plus each ring step's
   latency. Bucketed and prefetched, they run behind the backward (ZeRO-0/1: the last micro-batch's; ZeRO-2/3:
   every micro-batch's): a paper's MFU already includes a well-overlapped run's communication, so they add
   time only where they take longer than the compute they hide behind.
3. Offload: CPU Adam, PCIe and NVMe traffic, assumed not to overlap at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pylon.errors import PylonError
from pylon.plan.catalog import Accelerator
from pylon.plan.memory import WEIGHT_BYTES, Layout, ModelShape, Workload, kv_bytes_per_token

DEFAULT_MFU = 0.40  # model FLOPs utilisation: well-tuned dense LLM training reports 0.35-0.55
COLLECTIVE_EFFICIENCY = 0.8  # of the nominal link rate, what bucketed ring collectives reach (nccl-tests: ~0.9)
RING_STEP_LATENCY_S = 6e-6  # per step of a ring (G-1 steps per all-gather): NCCL's tuning model, Simple protocol
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed's CPU Adam per GPU process (AVX-512, a node's cores shared by its GPUs)
NVME_GBS = 6.0  # NVMe read or write bandwidth per node, GB/s, shared by its GPUs


def model_flops_per_token(shape: ModelShape, seq_len: int, lora: bool, reference: bool = False) -> float:
    """Training FLOPs per token: 6N + 12 x layers x d_model x seq (PaLM's estimate, `pylon.models`); with LoRA
    the frozen weights need only the forward and the input gradients (4N) and the adapters 6 x theirs. `reference`
    (objective dpo): the reference model's forward pass too, 2N + 4 x layers x d_model x seq."""
    attention = 12.0 * shape.num_layers * shape.hidden_size * seq_len
    extra = (2.0 * shape.matmul_params + attention / 3) if reference else 0.0
    if lora:
        return 4.0 * shape.matmul_params + 6.0 * shape.trainable_matmul_params + attention + extra
    return 6.0 * shape.matmul_params + attention + extra


def work_flops_per_token(work: Workload) -> float:
    """`model_flops_per_token` of `work`; objective eagle3's (`work.head_steps` drafts deep): the frozen model's
    forward pass (2N + 4 x layers x d_model x seq) and the head's drafts trained (`pylon.draft_head`)."""
    s = work.shape
    if work.head_steps:
        from pylon.draft_head import head_flops_per_token

        model = 2.0 * s.matmul_params + 4.0 * s.num_layers * s.hidden_size * work.seq_len
        return model + head_flops_per_token(s.trainable_matmul_params, s.hidden_size, work.seq_len, work.head_steps)
    return model_flops_per_token(s, work.seq_len, work.lora is not None, work.reference != "none")


def hardware_flops_per_token(
    shape: ModelShape, seq_len: int, lora: bool, checkpointing: bool, reference: bool = False
) -> float:
    """The FLOPs the GPUs execute: the model's, plus one more forward pass when checkpointing recomputes it (the
    reference's, run without gradients, is not recomputed)."""
    flops = model_flops_per_token(shape, seq_len, lora, reference)
    if checkpointing:
        adapters = shape.trainable_matmul_params if lora else 0
        flops += 2.0 * (shape.matmul_params + adapters) + 4.0 * shape.num_layers * shape.hidden_size * seq_len
    return flops


def hfu(work: Workload, checkpointing: bool, mfu: float) -> float:
    """The hardware FLOPs utilisation a run at `mfu` implies: recomputation included."""
    lora, reference = work.lora is not None, work.reference != "none"
    if work.head_steps:  # (objective eagle3: nothing recomputed)
        return mfu
    ratio = hardware_flops_per_token(work.shape, work.seq_len, lora, checkpointing, reference) / model_flops_per_token(
        work.shape, work.seq_len, lora, reference
    )
    return mfu * ratio


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # model FLOPs / (GPUs x peak x MFU)
    comm_s: float  # the part of the collectives not hidden behind compute
    offload_s: float  # CPU Adam, PCIe and NVMe traffic
    collectives_s: float = 0.0  # all the collectives take, hidden or not
    sampling_s: float = 0.0  # objectives grpo and rloo: sampling the completions (`sampling_time`)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.offload_s + self.sampling_s


def collective_gbs(acc: Accelerator, gpus: int) -> float:
    """The bus bandwidth, GB/s per GPU, a ring collective over `gpus` GPUs reaches: the link inside a node; across
    nodes the node's network (one NIC per GPU carries each ring's crossing), capped by the link inside it."""
    link = acc.interconnect_gbs if gpus <= acc.gpus_per_node else min(acc.interconnect_gbs, acc.node_network_gbs)
    return link * COLLECTIVE_EFFICIENCY


def collectives(work: Workload, layout: Layout, acc: Accelerator) -> tuple[float, float]:
    """Seconds of collectives per optimizer step, and the compute share (of the step's) they can hide behind."""
    s, g, stage, accum = work.shape, layout.num_gpus, layout.zero_stage, layout.grad_accum_steps
    if g == 1:
        return 0.0, 1.0
    w = WEIGHT_BYTES[work.precision]
    # Bytes each GPU sends (ring: (G-1)/G of the buffer). ZeRO-0/1 reduce once per step and gather the updated
    # partitions; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also gathers the parameters for each
    # micro-batch's forward and backward.
    part = (g - 1) / g
    grads, weights = w * s.trainable_params * part, w * s.total_params * part
    volume = {0: 2 * grads, 1: 2 * grads, 2: (accum + 1) * grads, 3: accum * (2 * weights + grads)}[stage]
    if stage == 3 and work.reference == "copy":  # objective dpo's frozen copy, gathered for its forward pass too
        volume += accum * weights
    # Ring steps, each paying the latency: G-1 per reduce-scatter or all-gather (an all-reduce is both), per
    # bucket; ZeRO-3 gathers and reduces a transformer block at a time (forward, backward, gradients).
    buckets = math.ceil(s.trainable_params / layout.buffers.reduce_bucket)
    launches = {0: 2 * buckets, 1: 2 * buckets, 2: (accum + 1) * buckets, 3: accum * 3 * s.num_layers}[stage]
    if stage == 3 and work.reference == "copy":
        launches += accum * s.num_layers
    seconds = volume / (collective_gbs(acc, g) * 1e9) + launches * (g - 1) * RING_STEP_LATENCY_S
    return seconds, (1.0 / accum if stage < 2 else 1.0)


def sequence_parallel_s(work: Workload, layout: Layout, acc: Accelerator) -> float:
    """Seconds a step spends in sequence parallelism's all-to-alls (Ulysses, `scaling.sequence_parallel`), which
    attention waits on (none hidden): per layer and micro-batch, the queries, keys, values and output of the GPU's
    tokens, forward and backward (and forward again with recomputation), each GPU sending (N-1)/N of them."""
    sp = layout.sequence_parallel
    if sp <= 1:
        return 0.0
    s, w = work.shape, WEIGHT_BYTES[work.precision]
    tokens = layout.micro_batch_size * work.seq_len // sp
    kv = max(s.kv_heads, sp) * s.head_dim  # (fewer key-value heads than GPUs: repeated to one each)
    per_layer = tokens * w * (2 * s.hidden_size + 2 * kv) * (sp - 1) / sp
    passes = 3 if layout.gradient_checkpointing else 2
    exchanges = layout.grad_accum_steps * s.num_layers * passes
    return exchanges * (per_layer / (collective_gbs(acc, sp) * 1e9) + 4 * (sp - 1) * RING_STEP_LATENCY_S)


def step_time(work: Workload, layout: Layout, acc: Accelerator, mfu: float) -> StepTime:
    s, g, stage = work.shape, layout.num_gpus, layout.zero_stage
    w = WEIGHT_BYTES[work.precision]
    # (a sequence-parallel group's GPUs compute one row's tokens between them)
    tokens = layout.micro_batch_size * work.rollouts * layout.grad_accum_steps * g * work.seq_len
    tokens //= layout.sequence_parallel
    flops = tokens * work_flops_per_token(work)
    compute = flops / (g * acc.peak_flops(work.precision) * mfu)
    comm, window = collectives(work, layout, acc)
    exposed = max(0.0, comm - window * compute)
    ulysses = sequence_parallel_s(work, layout, acc)
    comm, exposed = comm + ulysses, exposed + ulysses

    offload = 0.0
    host_link = acc.host_link_gbs * 1e9
    per_rank = s.trainable_params / (g if stage >= 1 else 1)
    if layout.offload_optimizer != "none":
        offload += per_rank / CPU_ADAM_PARAMS_PER_S + 2 * w * per_rank / host_link  # Adam; grads down, weights up
        if layout.offload_optimizer == "nvme":  # master weights and moments read and written every step
            offload += 2 * 12 * per_rank * layout.gpus_on_node / (NVME_GBS * 1e9)
    if layout.offload_param != "none":
        moved = layout.grad_accum_steps * 2 * w * s.total_params / g  # fetched for every forward and backward
        offload += (
            moved / host_link if layout.offload_param == "cpu" else moved * layout.gpus_on_node / (NVME_GBS * 1e9)
        )
    if layout.activation_offload:  # each micro-batch's saved activations to host memory and back, not overlapped
        saved = work.activation_host(
            layout.micro_batch_size, layout.gradient_checkpointing, "cuda", layout.sequence_parallel
        )
        offload += layout.grad_accum_steps * 2 * saved / host_link
    return StepTime(compute, exposed, offload, comm, sampling_time(work, layout, acc, mfu))


def sampling_time(work: Workload, layout: Layout, acc: Accelerator, mfu: float) -> float:
    """Seconds a step of objective grpo or rloo spends sampling (0 for the others), on each GPU for its own rows:
    every micro-batch's prompts prefilled once per completion (forward FLOPs at `mfu`), then a decode step per
    completion token, whichever is longer of its FLOPs and its bytes: every weight read once (a decode is
    memory-bound) and the KV cache so far. At ZeRO-3 the model is gathered once per micro-batch
    (`zero3_gather_for_sampling`), or else every layer for every token.

    With `grpo.sampler: engine` (`work.sampler_kv_tokens`): each prompt prefilled once (its other completions read
    its blocks from the prefix cache), the decodes in waves of at most `sampler_max_num_seqs` completions, and once a
    step (the engine takes the policy's weights before the first micro-batch that samples after an update) the
    weights copied into the engine, at ZeRO-3 gathered first (a module at a time: the whole model's bytes once).
    With `grpo.sampler: server` (`work.sampler_servers`), likewise on a server as fast as a worker's accelerator, its
    waves holding the rows of every worker it samples for, and the weights sent over the network besides."""
    steps = work.completion_tokens
    if not steps:
        return 0.0
    s, g, w = work.shape, layout.num_gpus, WEIGHT_BYTES[work.precision]
    rows = layout.micro_batch_size * work.rollouts
    prompt = work.seq_len - steps
    peak, bandwidth = acc.peak_flops(work.precision) * mfu, acc.bandwidth_gbs * 1e9
    forward = 2 * s.total_params  # FLOPs a token, forward only (attention aside)
    weights = w * s.total_params
    gathered = weights * (g - 1) / g if layout.zero_stage == 3 and g > 1 else 0.0  # what a gather moves to a GPU

    def decode(batch: int) -> float:  # one decode step of `batch` sequences
        kv = kv_bytes_per_token(s, w) * batch * (prompt + steps / 2)  # the cache read by an average decode step
        return max(forward * batch / peak, (weights + kv) / bandwidth)

    if work.sampler_kv_tokens:
        k = math.ceil(g / work.sampler_servers) if work.sampler_servers else 1  # server: k workers' rows together
        batch = min(rows * k, work.sampler_max_num_seqs)
        waves = math.ceil(rows * k / batch)
        prefill = forward * layout.micro_batch_size * k * prompt / peak
        sync = gathered / (collective_gbs(acc, g) * 1e9) + weights / bandwidth  # (a copy: read and written once)
        if work.sampler_servers:  # and sent to the servers through the object store, over the network
            sync += weights / (collective_gbs(acc, g) * 1e9)
        return layout.grad_accum_steps * (prefill + waves * steps * decode(batch)) + sync
    prefill = forward * rows * prompt / peak
    gather = 0.0
    if gathered:
        per_micro = gathered if work.gathered_sampling else gathered * steps
        gather = per_micro / (collective_gbs(acc, g) * 1e9)
    return layout.grad_accum_steps * (prefill + steps * decode(rows) + gather)


def _check_knobs(
    *,
    mfu: float | None = None,
    gpus: int | None = None,
    utilization: float | None = None,
    deadline_days: float | None = None,
    budget_usd: float | None = None,
) -> None:
    if mfu is not None and not 0 < mfu <= 1:
        raise PylonError(f"mfu: must be in (0, 1], e.g. 0.4 (got {mfu})")
    if gpus is not None and gpus < 1:
        raise PylonError(f"gpus: must be at least 1 (got {gpus})")
    if utilization is not None and not 0 < utilization <= 1:
        raise PylonError(f"utilization: must be in (0, 1], e.g. 0.5 (got {utilization})")
    if deadline_days is not None and not deadline_days > 0:
        raise PylonError(f"deadline: must be a positive number of days, e.g. 30 (got {deadline_days})")
    if budget_usd is not None and not budget_usd > 0:
        raise PylonError(f"budget: must be a positive number of US dollars, e.g. 50000 (got {budget_usd})")
