"""Where a training step's memory goes, per GPU and per node, for a model shape and a DeepSpeed layout.

    shape = model_shape(config, lora=None)                     # parameter counts, on the meta device
    work = Workload(config, shape, precision="bf16", seq_len=4096, lora=None)
    mem = train_memory(work, Layout(zero_stage=2, micro_batch_size=1, num_gpus=8))
    mem.device_total, mem.host_total, mem.nvme                 # bytes per GPU, per node (RAM), per node (NVMe)

The accounting is DeepSpeed's (0.19: `runtime/zero/stage_1_and_2.py`, `stage3.py`, `bf16_optimizer.py`), for
AdamW, with N parameters of which T are trained (T = N unless LoRA) on G data-parallel GPUs, w bytes per
weight in the training precision (2 for bf16/fp16, 4 for fp32) and L the largest module's parameters:

    term              ZeRO-0           ZeRO-1           ZeRO-2           ZeRO-3
    parameters        w*N              w*N              w*N              w*N/G + w*L (the module being gathered)
    gradients         w*T (+4*T)       w*T (+4*T/G)     w*T/G (+4*T/G)   4*T/G + w*L
    optimizer states  12*T (8*T fp32)  12*T/G           12*T/G           12*T/G

"(+4...)": with bf16/fp16 DeepSpeed keeps an fp32 copy of the gradients for the step, and the optimizer states
are the fp32 master weights plus Adam's two moments (4 + 4 + 4 bytes). Plain fp32 at ZeRO-0 has no master
copy: 4 + 4 + 8 = 16 bytes per parameter, the "7B model needs 112 GB" figure; the often-quoted "8 bytes per
parameter" counts only Adam's moments. In mixed precision ZeRO-2 comes to 2*N + 18*N/G and ZeRO-3 to
18*N/G + 4*L: exactly DeepSpeed's own `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs` (tests/unit/plan/test_plan.py checks it on real models). Offloading the
optimizer moves the optimizer states and the fp32 gradients (and ZeRO-1/2's gradients) to host RAM or NVMe;
offloading parameters (ZeRO-3) moves the parameter partitions.

Host RAM per node: at ZeRO-0-2 rank 0 alone builds the model in fp32 on the CPU (or loads it) and broadcasts it,
while the other ranks allocate theirs on their GPUs (`pylon.models.build_model`), so a node holds one fp32 copy at
most (DeepSpeed's estimators assume one per process); on CPU workers every process keeps its replica in RAM. At
ZeRO-3 the model is built under `zero.Init`, so a process holds only the module being constructed (4*L) before it
is partitioned, as DeepSpeed's estimators (with `zero_init`) count. Then the node holds what is offloaded; the
larger of the two, times DeepSpeed's `additional_buffer_factor` of 1.5 for pinned buffers and fragmentation. (For
ZeRO-2 with optimizer offload on several nodes DeepSpeed's estimator also multiplies the fp32 model by every GPU
of the job rather than those of one node; here it is per node.)

Beyond the model states: activations come from simulating the step (`pylon.plan.activations`), working buffers
are DeepSpeed's gradient buckets at the sizes the spec gives (`deepspeed.buffers`, DeepSpeed's defaults unless
set: a 5e8-element reduce bucket is 1 GB in bf16 whatever the model size), and the CUDA context and NCCL take
about 1 GiB per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pylon.specs import LoraSpec

GIB = 2**30
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# DeepSpeed's defaults for the settings Pylon's config leaves alone (deepspeed/runtime/zero/config.py,
# offload_config.py, engine.py). The buffers a spec may size are in `Buffers` (DeepSpeed's defaults too).
PARAM_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold: smaller parameters stay whole
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # the engine's buffered all-reduce without ZeRO
NVME_OPTIMIZER_BUFFERS = 4  # offload_optimizer.buffer_count
HOST_BUFFER_FACTOR = 1.5  # DeepSpeed's estimators' additional_buffer_factor for host memory
# CUDA context, its kernels, cuBLAS workspaces and NCCL communicators, per GPU: what nvidia-smi counts for a training
# process beyond its allocator's reservation. Measured on an H200 (driver 580, CUDA 13.0, torch 2.11, DeepSpeed 0.19;
# bench/plan_accuracy.py --device cuda, docs/benchmarks.md set 51): 1318 MiB at ZeRO-3, with or without offload;
# 1690-1708 MiB at ZeRO-1 and -2, whose engines leave 390 MiB more outside the allocator from their first step on
# (cause not pinned down yet: their optimizer's reduction stream and its collectives are the candidates). Stage 0,
# not measured, is counted as 1 and 2. Before a GPU was measured the figure was 1 GiB for every stage.
CUDA_RUNTIME_BYTES = 1318 * 2**20
ZERO12_RUNTIME_EXTRA_BYTES = 390 * 2**20
# A serving replica: the CUDA context, its kernels and cuBLAS, no NCCL (not yet measured on a GPU).
CUDA_CONTEXT_BYTES = 1 * GIB
# PyTorch's caching allocator reserves more than is allocated at the peak: blocks rounded up (512 B, then 2 MiB
# segments for small blocks, 20 MiB for large ones) and segments split by frees in a different order than
# allocations. Measured on an H200: reserved / allocated at the peak 1.09 (1B parameters, ZeRO-3) to 1.16 (3M
# parameters with a 1 GiB activation peak); without it the process total is underpredicted by that much.
ALLOCATOR_RESERVE = 0.10
PROCESS_BYTES = 1 * GIB  # a CPU worker's Python, torch, transformers and DeepSpeed before the model exists
# What a training job runs besides its workers: its driver (`python -m pylon.jobs.train`), Ray Train's controller and
# its helper actors (data, synchronisation, placement). Measured on the local cluster: ~1 GiB of anonymous memory
# (tests/integration/test_offload_memory_cap.py).
JOB_PROCESSES_BYTES = 1 * GIB


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts memory and FLOPs depend on (tied weights counted once, as DeepSpeed does)."""

    total_params: int
    trainable_params: int  # LoRA: the adapters only
    largest_layer_params: int  # most parameters one module holds itself: what ZeRO-3 gathers at once
    persistent_params: int  # parameters under ZeRO-3's persistence threshold, kept whole on every GPU
    matmul_params: int  # parameters in a matmul per token (all but input embeddings), for FLOPs
    trainable_matmul_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    kv_heads: int
    head_dim: int
    projection_params: int = 0  # the decoder layers' linear projections (not lm_head): what engine.quantization shrinks
    projection_channels: int = 0  # their output channels: one quantization scale each
    latent_kv: bool = False  # DeepSeek's latent attention: one cached latent a token and layer, its key and value
    # A mixture-of-experts model's expert weights (all experts, all sparse layers; in projection_params too) and the
    # share of them a token runs (top_k / num_experts); 0 and 1.0 for a dense model.
    expert_params: int = 0
    expert_share: float = 1.0
    # The layers that cache keys and values: all of them (None), or the attention layers of a model whose other layers
    # are recurrent (Qwen3-Next's linear_attention layers keep a state per sequence instead)
    kv_layers: int | None = None


def model_shape(config, lora: LoraSpec | None = None) -> ModelShape:
    """`config`'s model (with `lora`'s adapters) built on the meta device and counted: no memory, any size."""
    import torch

    from pylon.models import _matmul_parameters, expert_parameters, expert_weights, with_lora
    from pylon.serving.model.families import ENCODER_MODEL_TYPES, causal_lm_from_config, is_sequence_classifier

    with torch.device("meta"):
        # A classifier (a reward model, a cross-encoder): its head of num_labels rows, not a vocabulary's lm_head.
        if is_sequence_classifier(config):
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_config(config)
        elif config.model_type in ENCODER_MODEL_TYPES:  # an encoder's embedding model: its body, no head
            from transformers import AutoModel

            model = AutoModel.from_config(config)
        else:
            model = causal_lm_from_config(config)
        matmul = _matmul_parameters(model)
        experts, share = expert_parameters(model)
        if lora is not None:
            model = with_lora(model, lora)
    output = model.get_output_embeddings() or getattr(model, "score", None)  # (a classifier's head stays in float)
    projections = [  # (weight, its output channels): nn.Linear's weight is [out, in], GPT-2's Conv1D's [in, out]
        (m.weight, m.weight.shape[1] if type(m).__name__ == "Conv1D" else m.weight.shape[0])
        for name, m in model.named_modules()
        if type(m).__name__ in ("Linear", "Conv1D")
        and m is not output
        and m.weight.dim() == 2
        and not name.endswith("shared_expert_gate")  # Qwen2-MoE's one-output gate stays in float, as the router
    ]
    # An MoE layer's experts: 3-D weights [experts, out, in] (GPT-OSS's [experts, in, out]), quantized per expert and
    # output channel as projections are (serving/model/moe.py); the router stays in float.
    out_dim = 2 if config.model_type == "gpt_oss" else 1
    projections += [(p, p.shape[0] * p.shape[out_dim]) for p in expert_weights(model)]
    params = list(model.parameters())  # each Parameter once, so tied embeddings count once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    heads = config.num_attention_heads
    hidden = config.hidden_size
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) if getattr(config, "kv_lora_rank", None) else 0
    return ModelShape(
        total_params=sum(p.numel() for p in params),
        trainable_params=trainable,
        largest_layer_params=largest,
        persistent_params=sum(p.numel() for p in params if p.numel() < PARAM_PERSISTENCE_THRESHOLD),
        matmul_params=matmul,
        trainable_matmul_params=trainable if lora is not None else matmul,
        num_layers=config.num_hidden_layers,
        hidden_size=hidden,
        vocab_size=config.vocab_size,
        intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        # DeepSeek's latent attention: the engine caches one latent and rotated part a token and layer (its "kv head")
        kv_heads=1 if latent else getattr(config, "num_key_value_heads", None) or heads,
        head_dim=latent or getattr(config, "head_dim", None) or hidden // heads,
        projection_params=sum(w.numel() for w, _ in projections),
        projection_channels=sum(channels for _, channels in projections),
        expert_params=experts,
        expert_share=share,
        latent_kv=bool(latent),
        kv_layers=_attention_layers(config),
    )


@dataclass(frozen=True)
class Workload:
    """What a training job fixes: the model, its precision, sequence length and adapters."""

    config: object  # a transformers PretrainedConfig
    shape: ModelShape
    precision: str
    seq_len: int
    lora: LoraSpec | None = None
    documents: bool = False  # each packed document attended on its own (`attention_mask: document`): a mask
    loss_chunk_tokens: int = 0  # the loss a chunk of tokens at a time (`loss_chunk_tokens`): no whole-batch logits
    # objective dpo's (and grpo's with a KL term) reference model: "adapters" (LoRA: the model with its adapters
    # disabled, one more forward pass), "copy" (full fine-tuning: a frozen copy in the training precision too); "none"
    # for other objectives
    reference: str = "none"
    # objective grpo: the sequences each micro-batch row becomes (its prompt's `grpo.generations` completions)
    rollouts: int = 1
    # objective grpo at ZeRO-3: the whole model gathered on every GPU while it samples (`zero3_gather_for_sampling`)
    gathered_sampling: bool = False
    # objectives grpo and rloo: the tokens each completion is sampled for at most (`grpo.max_completion_tokens`),
    # the last of seq_len; 0: no sampling
    completion_tokens: int = 0
    # objectives grpo and rloo with `grpo.sampler: engine`: the serving engine's KV cache tokens on every worker (it
    # holds a whole copy of the model besides); 0: the model samples itself
    sampler_kv_tokens: int = 0
    # and the completions it decodes at once (`grpo.sampler_max_num_seqs`)
    sampler_max_num_seqs: int = 64
    # `grpo.sampler: server`: the sampling servers (each samples for num_gpus / sampler_servers workers, their rows
    # batched together there; the engine then holds nothing on the workers), and the GPUs each holds (its cost).
    # 0: colocated (or no engine)
    sampler_servers: int = 0
    sampler_server_gpus: float = 0.0
    # objective eagle3: the head trained beside the frozen model (its LlamaConfig, `pylon.draft_head.head_config`)
    # and the drafts deep it is unrolled (`eagle3.ttt_steps`); None and 0 for other objectives
    head: object | None = None
    head_steps: int = 0
    _peaks: dict = field(default_factory=dict, compare=False, repr=False)

    def activation_peak(
        self, micro_batch: int, checkpointing: bool, device: str, parts: int = 1, offload: bool = False
    ) -> int:
        """Peak activation bytes of one micro-batch on the device (`pylon.plan.activations`), remembered: a plan asks
        thousands of times for a handful of distinct answers. `parts`: sequence parallelism's split of each row
        (Ulysses): a GPU holds seq_len / parts tokens of each row, whose attention over the whole row for heads /
        parts heads keeps as much as its own tokens' would. `offload`: activation_offload (what the forward pass saves
        waits in host memory: `activation_host`)."""
        return self._profile(micro_batch, checkpointing, device, parts, offload).peak_bytes

    def activation_host(self, micro_batch: int, checkpointing: bool, device: str, parts: int = 1) -> int:
        """activation_offload: the most bytes one micro-batch's saved activations hold in host memory."""
        return self._profile(micro_batch, checkpointing, device, parts, True).host_bytes

    def _profile(self, micro_batch: int, checkpointing: bool, device: str, parts: int, offload: bool):
        # (objective eagle3's frozen model saves nothing: its head's few tensors are planned on the device)
        offload = offload and self.head is None
        key = (micro_batch, checkpointing, device, parts, offload)
        if key not in self._peaks and self.head is not None:  # objective eagle3: the model frozen, the head trained
            from pylon.plan.activations import eagle3_activations

            self._peaks[key] = eagle3_activations(
                self.config,
                self.head,
                micro_batch=micro_batch,
                seq_len=self.seq_len // parts,
                precision=self.precision,
                device=device,
                documents=self.documents,
                steps=self.head_steps,
            )
        if key not in self._peaks:
            from pylon.plan.activations import step_activations

            self._peaks[key] = step_activations(
                self.config,
                micro_batch=micro_batch * self.rollouts,
                seq_len=self.seq_len // parts,
                precision=self.precision,
                checkpointing=checkpointing,
                lora=self.lora,
                device=device,
                documents=self.documents,
                loss_chunk_tokens=self.loss_chunk_tokens,
                offload=offload,
            )
        return self._peaks[key]


@dataclass(frozen=True)
class Buffers:
    """DeepSpeed's working buffers in elements: `deepspeed.buffers` of a spec (`DeepSpeedBuffersSpec`), whose
    defaults are DeepSpeed's."""

    reduce_bucket: int = 500_000_000  # zero_optimization.reduce_bucket_size
    prefetch_bucket: int = 50_000_000  # stage3_prefetch_bucket_size
    sub_group: int = 1_000_000_000  # sub_group_size: the optimizer steps (and swaps) this many at a time
    param_buffer: int = 100_000_000  # offload_param.buffer_size
    param_buffers: int = 5  # offload_param.buffer_count
    param_in_cpu: int = 1_000_000_000  # offload_param.max_in_cpu: swapped parameters also kept in host RAM

    @classmethod
    def of(cls, spec) -> "Buffers":
        """From a `DeepSpeedBuffersSpec`."""
        return cls(
            spec.reduce_bucket_size,
            spec.prefetch_bucket_size,
            spec.sub_group_size,
            spec.param_buffer_size,
            spec.param_buffer_count,
            spec.param_max_in_cpu,
        )


@dataclass(frozen=True)
class Layout:
    """What the planner may change: how the job is spread over GPUs and what it trades memory for."""

    zero_stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    gradient_checkpointing: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    num_gpus: int = 1
    gpus_per_node: int = 8
    buffers: Buffers = Buffers()
    grad_accum: str | None = None  # ZeRO-3: the dtype of its gradient partitions (`deepspeed.grad_accum_dtype`)
    # scaling.sequence_parallel: GPUs that split each row along its tokens (Ulysses); a group shares its micro-batches
    sequence_parallel: int = 1
    activation_offload: bool = False  # what the forward pass saves waits in host memory (TrainJobSpec's)

    @property
    def rows_per_step(self) -> int:
        """The rows (sequences) one optimizer step trains."""
        return self.micro_batch_size * self.grad_accum_steps * self.num_gpus // self.sequence_parallel

    @property
    def gpus_on_node(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"

    def describe(self) -> str:
        parts = [f"ZeRO-{self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        if self.gradient_checkpointing:
            parts.append("grad ckpt")
        if self.activation_offload:
            parts.append("activations->cpu")
        if self.sequence_parallel > 1:
            parts.append(f"sequence parallel {self.sequence_parallel}")
        parts.append(
            f"micro-batch {self.micro_batch_size}"
            + (f" x {self.grad_accum_steps} accum" if self.grad_accum_steps > 1 else "")
        )
        return ", ".join(parts)


@dataclass(frozen=True)
class TrainMemory:
    """Bytes of one training step: per GPU (the worker's device), and per node in host RAM and on NVMe."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    runtime: int
    host_build: int  # per node: what the processes hold while they build the model (fp32)
    host_states: int  # per node: offloaded optimizer states, gradients, parameters
    host_buffers: int  # per node: pinned NVMe swap buffers
    nvme: int  # per node
    notes: dict[str, str] = field(default_factory=dict, compare=False)  # term -> what it holds
    reference: int = 0  # objective dpo without LoRA: the frozen copy of the model
    sampler: int = 0  # grpo.sampler engine: the serving engine's whole copy of the model and its KV cache
    allocator: int = 0  # on a GPU: the caching allocator's reservation beyond the peak allocated (ALLOCATOR_RESERVE)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_total(self) -> int:
        return self.allocated + self.allocator + self.runtime

    @property
    def allocated(self) -> int:
        """What the step's tensors take at the peak (on a GPU, torch.cuda.max_memory_allocated's share)."""
        return self.model_states + self.reference + self.sampler + self.activations + self.buffers

    @property
    def host_total(self) -> int:
        return int(max(self.host_build, self.host_states + self.host_buffers) * HOST_BUFFER_FACTOR)

    def device_terms(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer states", self.optimizer),
            *([("reference model", self.reference)] if self.reference else []),
            *([("sampling engine", self.sampler)] if self.sampler else []),
            ("activations", self.activations),
            ("working buffers", self.buffers),
            *([("allocator reserve", self.allocator)] if self.allocator else []),
            ("runtime", self.runtime),
        ]


def train_memory(work: Workload, layout: Layout, *, device: str = "cuda") -> TrainMemory:
    """The memory of one step of `work` laid out as `layout`. `device` is where the workers compute: 'cuda',
    or 'cpu' (then the "GPU" terms live in the worker's RAM, buckets cost only the pages written, and there is
    no CUDA context)."""
    s = work.shape
    w = WEIGHT_BYTES[work.precision]
    mixed = w != 4
    stage, g, per_node = layout.zero_stage, layout.num_gpus, layout.gpus_on_node
    n, t = s.total_params, s.trainable_params
    shard = g if stage >= 1 else 1  # how many ways optimizer states (and fp32 gradients) are split
    off_opt, off_par = layout.offload_optimizer != "none", layout.offload_param != "none"
    notes = {}

    # Parameters in the training precision.
    if stage < 3:
        params = w * n
        notes["parameters"] = f"{work.precision} weights, a full copy on every GPU"
    else:
        partition = 0 if off_par else w * n / g
        params = partition + w * s.largest_layer_params
        notes["parameters"] = (
            f"partitions in {layout.offload_param}; " if off_par else "1/G partition + "
        ) + "the largest module gathered whole"

    # Gradients: in the training precision (ZeRO-0/1: full; ZeRO-2: the partition), plus the fp32 copy DeepSpeed
    # steps the optimizer on (mixed precision; ZeRO-3 accumulates straight into fp32 partitions).
    grads_lp = {0: w * t, 1: w * t, 2: w * t / g, 3: 0.0}[stage]
    grads_fp32 = 4 * t / shard if (mixed or stage == 3) else 0.0
    if stage == 3 and layout.grad_accum is not None:  # the partitions in the dtype the spec asks for
        grads_fp32 = WEIGHT_BYTES[layout.grad_accum] * t / shard
    gathered_grads = w * min(s.largest_layer_params, t) if stage == 3 else 0.0
    optimizer = (4 * t if (mixed or stage >= 1) else 0) / shard + 8 * t / shard  # fp32 master + Adam moments
    host_states = host_buffers = nvme = 0.0
    if off_opt:
        if stage < 3:
            grads_lp = 0.0  # ZeRO-1/2 offload copies each gradient to its host partition as it is reduced
        offloaded = grads_fp32 + optimizer
        if layout.offload_optimizer == "nvme":  # master weights and moments on NVMe, fp32 gradients in RAM
            nvme += optimizer * per_node
            host_states += grads_fp32 * per_node
            host_buffers += NVME_OPTIMIZER_BUFFERS * min(layout.buffers.sub_group, t / shard) * 4 * per_node
        else:
            host_states += offloaded * per_node
        grads_fp32 = optimizer = 0.0
    if off_par:
        if layout.offload_param == "nvme":
            nvme += w * n / g * per_node
            host_buffers += layout.buffers.param_buffers * layout.buffers.param_buffer * w * per_node
            host_states += min(layout.buffers.param_in_cpu, n / g) * w * per_node  # kept in RAM as well
        else:
            host_states += w * n / g * per_node
    grads = grads_lp + grads_fp32 + gathered_grads
    notes["gradients"] = {
        0: "full, plus an fp32 copy for the step" if mixed else "full, fp32",
        1: "full, plus the fp32 partition the optimizer steps",
        2: "partitioned (1/G)" + (", plus its fp32 copy" if mixed else ""),
        3: "fp32 partitions (1/G), plus the largest module's",
    }[stage]
    if off_opt:
        notes["gradients"] += f"; the partitions live with the optimizer in {layout.offload_optimizer}"
    notes["optimizer states"] = (
        ("fp32 master weights + " if mixed or stage >= 1 else "")
        + "Adam's 2 moments"
        + (", 1/G each" if stage >= 1 else "")
        + (f"; offloaded to {layout.offload_optimizer}" if off_opt else "")
    )

    # Working buffers: DeepSpeed allocates its buckets at their configured size (the caching allocator holds
    # all of it); on CPU only the pages gradients are written to become resident.
    def bucket(elements: float) -> float:
        return elements * w if device == "cuda" else min(elements, t) * w

    if stage == 0:
        buffers = min(t, ALLREDUCE_BUCKET_ELEMENTS) * w if g > 1 else 0.0
        notes["working buffers"] = "the flattened all-reduce bucket" if g > 1 else "none (one GPU)"
    elif stage < 3:
        buffers = bucket(layout.buffers.reduce_bucket)
        notes["working buffers"] = f"DeepSpeed's gradient reduce bucket ({layout.buffers.reduce_bucket:.0e} elements)"
    else:
        # Parameters under the persistence threshold (norms, biases) stay whole on every GPU.
        persistent = s.persistent_params * (1 - 1 / g) * w
        buffers = bucket(layout.buffers.reduce_bucket) + min(layout.buffers.prefetch_bucket, n) * w + persistent
        notes["working buffers"] = (
            f"reduce bucket ({layout.buffers.reduce_bucket:.0e} elements), parameter prefetch "
            f"({layout.buffers.prefetch_bucket:.0e}), small parameters kept whole"
        )

    # objective dpo, fully fine-tuned: a frozen copy of the starting model in the training precision, partitioned and
    # offloaded as the parameters are at ZeRO-3, whole on every GPU below it
    reference = 0.0
    if work.reference == "copy":
        if stage < 3:
            reference = w * n
            notes["reference model"] = f"the reference: a frozen {work.precision} copy, whole on every GPU"
        elif off_par:
            if layout.offload_param == "nvme":
                nvme += w * n / g * per_node
            else:
                host_states += w * n / g * per_node
            notes["reference model"] = f"the reference: a frozen copy, its partitions in {layout.offload_param}"
        else:
            reference = w * n / g
            notes["reference model"] = f"the reference: a frozen {work.precision} copy, a 1/G partition"

    sp = layout.sequence_parallel
    offloaded = layout.activation_offload and device == "cuda"
    acts = work.activation_peak(layout.micro_batch_size, layout.gradient_checkpointing, device, sp, offloaded)
    notes["activations"] = (
        f"micro-batch {layout.micro_batch_size}"
        + (f" x {work.rollouts} completions" if work.rollouts > 1 else "")
        + (f" x {work.seq_len // sp} tokens (1/{sp} of each row: sequence parallelism)" if sp > 1 else "")
        + ("" if sp > 1 else f" x {work.seq_len} tokens")
        + ", peak of forward + "
        "backward"
        + (", recomputing each block" if layout.gradient_checkpointing else "")
        + (", what the forward pass saves in host memory" if offloaded else "")
    )
    if offloaded:  # activation_offload: each GPU's worker keeps its saved activations in pinned host memory
        host_acts = work.activation_host(layout.micro_batch_size, layout.gradient_checkpointing, device, sp)
        host_states += host_acts * per_node
        notes["activation offload"] = (
            f"what a micro-batch's forward pass saves, {host_acts / 2**30:.2f} GiB per GPU at most, in pinned host "
            "memory until the backward pass"
        )
    # grpo.sampler engine: a serving engine on every worker for the whole run, the model whole in its dtype (the
    # training precision on a GPU, fp32 on a CPU) and its KV cache
    sampler = 0.0
    if work.sampler_kv_tokens and work.sampler_servers:
        notes["sampling servers"] = (
            "grpo.sampler server: the engine holds its weights and KV cache on the sampling servers, not here"
        )
    elif work.sampler_kv_tokens:
        e = w if device == "cuda" else 4
        weights, kv = e * n, kv_bytes_per_token(s, e) * work.sampler_kv_tokens
        sampler = weights + kv
        notes["sampling engine"] = (
            f"grpo.sampler engine: the model whole ({weights / 2**30:.1f} GiB) and its KV cache of "
            f"{work.sampler_kv_tokens:,} tokens ({kv / 2**30:.1f} GiB), on every worker"
        )
    if work.rollouts > 1 and not work.sampler_kv_tokens:  # the model samples before it trains: the larger peak
        sequences = layout.micro_batch_size * work.rollouts
        kv = kv_bytes_per_token(s, w) * sequences * work.seq_len
        whole = w * n - (params if stage == 3 else w * n) if work.gathered_sampling and stage == 3 else 0
        if kv + whole > acts:
            acts = kv + whole
            notes["activations"] = (
                f"sampling {sequences} completions: their KV cache ({kv / 2**30:.1f} GiB)"
                + (f" and the whole model gathered ({whole / 2**30:.1f} GiB more)" if whole else "")
                + ", more than the training pass's activations"
            )
    runtime = CUDA_RUNTIME_BYTES + (ZERO12_RUNTIME_EXTRA_BYTES if stage < 3 else 0) if device == "cuda" else 0
    notes["runtime"] = "CUDA context, cuBLAS and NCCL" if device == "cuda" else "none counted on CPU"
    allocated = params + grads + optimizer + reference + sampler + acts + buffers
    allocator = ALLOCATOR_RESERVE * allocated if device == "cuda" else 0
    if allocator:
        notes["allocator reserve"] = f"PyTorch's caching allocator: {ALLOCATOR_RESERVE:.0%} reserved beyond the peak"
    return TrainMemory(
        params=int(params),
        grads=int(grads),
        optimizer=int(optimizer),
        activations=int(acts),
        buffers=int(buffers),
        runtime=runtime,
        reference=int(reference),
        sampler=int(sampler),
        allocator=int(allocator),
        # ZeRO-3 builds under zero.Init: one module at a time exists whole before it is partitioned. Stages 0-2
        # build once, on rank 0's node, and broadcast: the other ranks allocate on their GPUs (on CPU workers
        # every process holds its replica in RAM).
        host_build=4 * (s.largest_layer_params * per_node if stage == 3 else n * (1 if device == "cuda" else per_node)),
        host_states=int(host_states),
        host_buffers=int(host_buffers),
        nvme=int(nvme),
        notes=notes,
    )


def sampler_server_bytes(work: Workload, device: str = "cuda") -> int:
    """`grpo.sampler: server`: what one sampling server's engine holds on its device for the whole run, the model
    whole in the engine's dtype (the training precision on a GPU, fp32 on a CPU) and its KV cache, with the CUDA
    runtime on a GPU. 0 without servers."""
    if not work.sampler_servers:
        return 0
    e = WEIGHT_BYTES[work.precision] if device == "cuda" else 4
    total = e * work.shape.total_params + kv_bytes_per_token(work.shape, e) * work.sampler_kv_tokens
    return total + (CUDA_RUNTIME_BYTES if device == "cuda" else 0)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """KV cache bytes one token takes: a key and a value per attention layer and KV head (DeepSeek's latent attention:
    one latent a layer, which is its key and its value: the engine keeps it once; Qwen3-Next: its attention layers
    only)."""
    layers = shape.num_layers if shape.kv_layers is None else shape.kv_layers
    return (1 if shape.latent_kv else 2) * layers * shape.kv_heads * shape.head_dim * dtype_bytes


def _attention_layers(config) -> int | None:
    """How many of a model's layers attend (cache keys and values), where some are recurrent (`layer_types`'
    "linear_attention"); None where all of them attend."""
    types = getattr(config, "layer_types", None) or []
    if "linear_attention" not in types:
        return None
    return sum(t != "linear_attention" for t in types)
