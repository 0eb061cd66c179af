"""How long a training step takes: model FLOPs per token (with recomputation when checkpointing), spread over the GPUs
at an assumed MFU, plus the collectives that do not overlap compute and the offload traffic (CPU Adam, PCIe, NVMe)."""

from __future__ import annotations

from dataclasses import dataclass

from pylon.errors import PylonError
from pylon.plan.catalog import Accelerator
from pylon.plan.memory import WEIGHT_BYTES, Layout, ModelShape, Workload

DEFAULT_MFU = 0.40  # model FLOPs utilisation: well-tuned dense LLM training reaches 0.35-0.55
EXPOSED_COMM = 0.25  # share of the collectives that does not overlap compute
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed's CPU Adam per GPU process (AVX-512, a node's cores shared by its GPUs)
NVME_GBS = 6.0  # NVMe read or write bandwidth per node, GB/s, shared by its GPUs


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
        offload += (
            moved / host_link if layout.offload_param == "cpu" else moved * layout.gpus_on_node / (NVME_GBS * 1e9)
        )
    return StepTime(compute, exposed, offload)


def _check_knobs(*, mfu: float | None = None, gpus: int | None = None, utilization: float | None = None) -> None:
    if mfu is not None and not 0 < mfu <= 1:
        raise PylonError(f"mfu: must be in (0, 1], e.g. 0.4 (got {mfu})")
    if gpus is not None and gpus < 1:
        raise PylonError(f"gpus: must be at least 1 (got {gpus})")
    if utilization is not None and not 0 < utilization <= 1:
        raise PylonError(f"utilization: must be in (0, 1], e.g. 0.5 (got {utilization})")
