"""Planning a Deployment: per accelerator, the memory of weights and KV cache, decode throughput from memory
bandwidth, and the cost per million output tokens at the assumed utilization (`plan_serve`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pylon.errors import PylonError
from pylon.plan.catalog import Accelerator, Catalog, load_catalog
from pylon.plan.fmt import _gib
from pylon.plan.memory import CUDA_CONTEXT_BYTES, WEIGHT_BYTES, ModelShape, kv_bytes_per_token, model_shape
from pylon.plan.steptime import DEFAULT_MFU, _check_knobs
from pylon.plan.train import USABLE_FRACTION, _assumptions, _config_from_dir, vision_params
from pylon.specs import EAGLE_METHODS, HEAD_METHODS, DeploymentSpec

BANDWIDTH_EFFICIENCY = 0.8  # of datasheet memory bandwidth that decoding reaches
LAUNCH_S_PER_LAYER = 1e-4  # eager PyTorch decoding: kernel launches per layer per step, whatever the batch
DEFAULT_UTILIZATION = 0.5  # share of a serving replica's hours spent at its throughput ceiling
KV_BYTES = {**WEIGHT_BYTES, "fp8": 1}  # bytes of a key or value element per engine.kv_cache_dtype
# bytes of a quantized projection weight (engine.quantization): int8 and fp8 one (and a float32 scale per output
# channel, counted apart); int4 half, and a float32 scale and min per group of 64 inputs
QUANT_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5 + 8 / 64}
# What a KV block copied between host and GPU memory moves at (the prefix cache's host tier): PCIe 4.0 x16's ~25 GB/s
# in practice (an H100 SXM's PCIe 5.0 links reach ~50).
HOST_LINK_BYTES_S = 25e9
# What KV blocks sent between nodes move at (prefill-decode disaggregation): a 100 Gb/s link's ~12.5 GB/s, what Ray's
# object store reaches over TCP on a cloud GPU node's network (RDMA links run faster)
NETWORK_BYTES_S = 12.5e9
# Host memory of suffix decoding's trees (serving/engine/suffix.py) a cached output token: measured on text by
# tests/unit/serving/engine/test_speculative_suffix.py
SUFFIX_BYTES_PER_TOKEN = 256


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
    gpus: int = 1  # accelerators a replica takes: one a pipeline stage (the memory above is the largest stage's)...
    split: str = "stage"  # ...or one a tensor-parallel "shard" (the memory above is one shard's)
    # prefill replicas (a deployment's `prefill`): what the deployment pays per decoding replica's GPUs, as a factor
    # ((decoding + prefill replicas) / decoding replicas at min_replicas); 1 without
    cost_scale: float = 1.0
    # autoscaling.target_itl_ms: the most sequences a replica decodes with their tokens that far apart (0: not one)
    streams_within_itl: int | None = None
    prompt_tps: float = 0.0  # prompt tokens a second a replica computes (its compute ceiling)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace + self.runtime

    @property
    def cost_per_million_tokens(self) -> float:
        if self.batch_tps <= 0:
            return math.inf
        price = self.gpus * self.accelerator.price_per_gpu_hour * self.cost_scale
        return price / (self.batch_tps * 3600 * self.utilization) * 1e6

    def to_dict(self) -> dict:
        return {
            "accelerator": self.accelerator.name,
            "fits": self.fits,
            "binding": self.binding,
            "memory": {
                "weights": self.weights,
                "kv_cache": self.kv_cache,
                "workspace": self.workspace,
                "runtime": self.runtime,
                "total": self.total,
            },
            "kv_tokens_fit": self.kv_tokens_fit,
            "sequences_fit": self.sequences_fit,
            "single_stream_tokens_per_s": round(self.single_stream_tps, 1),
            "batch_tokens_per_s": round(self.batch_tps, 1),
            "batch": self.batch,
            "gpus_per_replica": self.gpus,
            **({"cost_scale_for_prefill_replicas": round(self.cost_scale, 4)} if self.cost_scale != 1.0 else {}),
            "price_per_gpu_hour": self.accelerator.price_per_gpu_hour,
            "cost_per_million_tokens_usd": (
                round(self.cost_per_million_tokens, 4) if math.isfinite(self.cost_per_million_tokens) else None
            ),
        }


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
    # the prefix cache's host tier (engine.kv_offload_tokens): host memory (or disk: kv_offload_path), every engine's
    kv_offload_bytes: int = 0

    def to_dict(self) -> dict:
        s = self.shape
        return {
            "kind": self.kind,
            "name": self.name,
            "model": {
                "path": self.model,
                "parameters": s.total_params,
                "layers": s.num_layers,
                "kv_heads": s.kv_heads,
                "head_dim": s.head_dim,
            },
            "dtype": self.dtype,
            "kv_cache_bytes_per_token": self.kv_per_token,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_offload_host_bytes": self.kv_offload_bytes,
            "accelerators": [r.to_dict() for r in self.rows],
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "assumptions": {
                **_assumptions(self.mfu, self.prices_source),
                "utilization": self.utilization,
                "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
                "launch_s_per_layer": LAUNCH_S_PER_LAYER,
                "average_context": self.max_model_len // 2,
            },
            "notes": self.notes,
        }


# The projections the serving engine adapts, by model_type (serving/model/lora.py's PROJECTIONS): a Llama-like model's
# seven unless listed here (Phi-3's fused ones, an MoE model's attention).
_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ADAPTED_TARGETS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    # Mixture-of-experts models: the attention's projections (their experts are not adapted)
    "mixtral": _LLAMA_TARGETS[:4],
    "qwen2_moe": _LLAMA_TARGETS[:4],
    "qwen3_moe": _LLAMA_TARGETS[:4],
    "starcoder2": (*_LLAMA_TARGETS[:4], "c_fc", "c_proj"),
}


def _adapter_params(config, i: int, uri: str, counted: dict) -> int:
    """The parameters of the LoRA adapter at `uri` (engine.adapters[i]) on `config`'s model, from its
    adapter_config.json alone (rank and target modules), counted as peft builds it; `counted` keeps each
    (rank, targets)'s count, so adapters of one shape build the model on the meta device once."""
    from pydantic import ValidationError

    from pylon import storage
    from pylon.errors import StorageError
    from pylon.specs import LoraSpec

    where = f"engine.adapters[{i}].path {storage.describe(uri)}"
    try:
        raw = storage.read_json(storage.join(uri, "adapter_config.json"))
    except StorageError as e:
        raise PylonError(
            f"{where}: cannot read adapter_config.json ({e}); the planner needs the adapter's rank"
        ) from None
    try:
        targets = raw.get("target_modules")
        lora = LoraSpec(
            r=raw.get("r"),
            alpha=raw.get("lora_alpha") or 1,
            target_modules=[targets] if isinstance(targets, str) else targets,
        )
        key = (lora.r, tuple(lora.target_modules))
        if key not in counted:
            counted[key] = model_shape(config, lora).trainable_params
        return counted[key]
    except (ValidationError, ValueError, TypeError, AttributeError) as e:
        raise PylonError(f"{where}: adapter_config.json is not a LoRA adapter of this model ({e})") from None


MAX_SUGGESTED_STAGES = 16


SUGGESTED_SHARDS = (2, 4, 8)  # the GPUs of one node


def _fewest_shards(spec: DeploymentSpec, config, shape: ModelShape, **options) -> tuple[int, ServeOption] | None:
    """The fewest tensor-parallel shards past the spec's (2, 4 or 8: one node's GPUs; each pipeline stage's, with the
    spec's stages) with which the model fits some GPU considered, and that plan's recommendation; None where none
    does or the model cannot be split so (pylon.serving.model.tensor.refused), or the spec's data parallelism stands
    in the way."""
    from pylon.serving.model.stages import weight_sizes
    from pylon.serving.model.tensor import refused

    engine = spec.engine
    if engine.data_parallel > 1:
        return None
    # (a shard holds 1/n of the weights: per-layer sizes are needed for stages only)
    counted = (shape, weight_sizes(config) if engine.pipeline_parallel > 1 else None)
    for n in (n for n in SUGGESTED_SHARDS if n > engine.tensor_parallel):
        if refused(config.model_type, config, n, engine.expert_parallel) is not None:
            continue
        split = spec.model_copy(update={"engine": engine.model_copy(update={"tensor_parallel": n})})
        plan = plan_serve(split, config=config, _suggest=False, _counted=counted, **options)
        if plan.recommendation is not None:
            return n, plan.recommendation
    return None


def _kv_window(config, e) -> int | None:
    """The sliding window every layer of the model attends within, where the engine lets go of a sequence's KV blocks
    before it (serving/engine/engine.py, `_kv_window`: one process or tensor-parallel shards, no pipeline stages, no
    multi-token-prediction layer or EAGLE head); None otherwise."""
    from pylon.serving.model.families import layer_windows

    if e.pipeline_parallel > 1 or e.speculative.method in HEAD_METHODS:
        return None
    windows = layer_windows(config)
    if not windows or any(w is None for w in windows) or len(set(windows)) > 1:
        return None
    return int(windows[0])


def _kv_groups(config, e) -> list[tuple[list[int], int | None]]:
    """The KV cache's groups of layers where windowed layers mix with full ones (serving/engine/kv_cache.py's
    HybridKVBlockPool, `families.kv_groups`: one process or tensor-parallel shards, not pipeline stages); []
    otherwise."""
    from pylon.serving.model.families import kv_groups, layer_windows

    if e.pipeline_parallel > 1:
        return []
    return kv_groups(layer_windows(config), e.max_model_len, e.block_size, e.max_num_batched_tokens, e.kv_cache_tokens)


def _fewest_stages(spec: DeploymentSpec, config, shape: ModelShape, **options) -> tuple[int, ServeOption] | None:
    """The fewest pipeline stages past the spec's (up to MAX_SUGGESTED_STAGES, one layer a stage at least; each of
    the spec's tensor-parallel shards) with which the model fits some GPU considered, and that plan's
    recommendation; None where none does or the model cannot be split (pylon.serving.model.stages.refused)."""
    from pylon.serving.model.stages import refused, weight_sizes

    if refused(config.model_type, config) is not None:  # (a multimodal checkpoint's: its text model's, as staged)
        return None
    engine = spec.engine
    if engine.data_parallel > 1:
        return None
    counted = (shape, weight_sizes(config))
    for n in range(engine.pipeline_parallel + 1, min(shape.num_layers, MAX_SUGGESTED_STAGES) + 1):
        split = spec.model_copy(update={"engine": engine.model_copy(update={"pipeline_parallel": n})})
        plan = plan_serve(split, config=config, _suggest=False, _counted=counted, **options)
        if plan.recommendation is not None:
            return n, plan.recommendation
    return None


def _prefill_cost_scale(spec: DeploymentSpec) -> float:
    """What the deployment's GPUs cost per decoding replica's: the prefill replicas' beside the decoding ones (both at
    min_replicas, at least one), each taking as many accelerators as its replica spec asks against a decoding
    replica's."""
    decoding = max(1, spec.autoscaling.min_replicas)
    own, theirs = spec.replica, spec.prefill_replica()
    each = (theirs.num_gpus / own.num_gpus) if own.num_gpus else 1.0
    return (decoding + max(1, spec.prefill.replica_range()[0]) * each) / decoding


def _prefill_note(spec: DeploymentSpec, per_token: int) -> str:
    """What `prefill` costs and moves, in words."""
    p = spec.prefill
    prompt = spec.engine.max_model_len // 2
    sent = prompt * per_token
    decoding = max(1, spec.autoscaling.min_replicas)
    return (
        f"prefill: {p.describe_replicas()} prefill replica(s) of this engine beside {decoding} "
        f"decoding one(s) (the cost per million tokens counts their GPUs, {_prefill_cost_scale(spec):.2f}x a "
        f"decoding replica's); a prompt of {prompt:,} new tokens sends {sent / 2**20:,.1f} MiB of KV blocks to the "
        f"replica that decodes it ({per_token:,} bytes a token; ~{sent / NETWORK_BYTES_S * 1e3:,.0f} ms at "
        f"{NETWORK_BYTES_S * 8 / 1e9:,.0f} Gb/s between nodes, nothing on one node's object store); prompts of fewer "
        f"than {p.min_prompt_tokens} new tokens stay where they are decoded"
    )


def _latency_notes(spec: DeploymentSpec, row: ServeOption) -> list[str]:
    """What the latency targets (`autoscaling.target_itl_ms`, `target_ttft_ms`, `prefill.autoscaling.target_ttft_ms`)
    ask of the recommended accelerator, in words: how many sequences or prompts a replica serves within them, or that
    no number of replicas meets one (a single sequence, or a single prompt of half max_model_len, takes longer)."""
    notes, acc = [], row.accelerator.name
    a = spec.autoscaling
    if a.target_itl_ms is not None and row.streams_within_itl is not None:
        one = 1000 / row.single_stream_tps if row.single_stream_tps else math.inf
        if row.streams_within_itl == 0:
            notes.append(
                f"autoscaling.target_itl_ms {a.target_itl_ms:g}: one sequence alone gets a token every ~{one:,.1f} ms "
                f"on {acc}, so no number of replicas meets it (a faster GPU, engine.tensor_parallel or speculative "
                "decoding would shorten it)"
            )
        else:
            n = row.streams_within_itl
            notes.append(
                f"autoscaling.target_itl_ms {a.target_itl_ms:g}: a replica decodes about {n:,} sequences with their "
                f"tokens that far apart on {acc} (one alone: ~{one:,.1f} ms a token); at max_replicas "
                f"({a.max_replicas}), about {n * a.max_replicas:,} at once"
            )
    prompt = spec.engine.max_model_len // 2
    prompt_ms = prompt / row.prompt_tps * 1000 if row.prompt_tps else math.inf
    for where, target in (
        ("autoscaling.target_ttft_ms", a.target_ttft_ms),
        (
            "prefill.autoscaling.target_ttft_ms",
            spec.prefill.autoscaling.target_ttft_ms if spec.prefill and spec.prefill.autoscaling else None,
        ),
    ):
        if target is None:
            continue
        if prompt_ms > target:
            notes.append(
                f"{where} {target:g}: a prompt of {prompt:,} tokens alone takes ~{prompt_ms:,.0f} ms to compute on "
                f"{acc}, so prompts that long miss it whatever the replicas"
            )
        else:
            notes.append(
                f"{where} {target:g}: a prompt of {prompt:,} tokens takes ~{prompt_ms:,.1f} ms to compute on {acc}: "
                f"about {int(target // prompt_ms):,} such prompt(s) at once a replica meet it"
            )
    return notes


def experts_read(shape, seqs: int) -> float:
    """The share of an MoE model's expert weights a decode step of `seqs` tokens reads: each layer's experts that
    some token picks, expected under routing spread evenly (each token's top_k of num_experts): 1 - (1 - share)^seqs.
    1.0 for a dense model."""
    return 1.0 - (1.0 - shape.expert_share) ** seqs if shape.expert_params else 1.0


def plan_serve(
    spec: DeploymentSpec,
    *,
    catalog: Catalog | None = None,
    gpu: str | None = None,
    mfu: float = DEFAULT_MFU,
    utilization: float = DEFAULT_UTILIZATION,
    config=None,
    _suggest: bool = True,
    _counted: tuple | None = None,
) -> ServePlan:
    """Weights, KV cache per token, what fits and the decode throughput ceiling of a Deployment per accelerator
    (one GPU per replica, or one per pipeline stage with engine.pipeline_parallel). `config` stands in for an unread
    model dir."""
    _check_knobs(mfu=mfu, utilization=utilization)
    catalog = catalog or load_catalog()
    accelerators = [catalog.get(gpu)] if gpu else list(catalog.accelerators)
    given = config is not None
    config = config if given else _config_from_dir(spec.model, "model")
    # (_counted: the model's shape and its weights by layer, counted once where `_fewest_stages` plans it again)
    shape = _counted[0] if _counted is not None else model_shape(config)
    e = spec.engine
    dtype = "bf16" if e.dtype == "auto" else e.dtype  # auto is bf16 on these GPUs (fp32 only on CPU)
    b = WEIGHT_BYTES[dtype]
    weights = shape.total_params * b
    qb = QUANT_BYTES.get(e.quantization, b)
    if e.quantization != "none":  # the projections at qb bytes a weight (int8, fp8: plus a scale per output channel)
        channels = shape.projection_channels * 4 if e.quantization != "int4" else 0
        weights -= int(shape.projection_params * (b - qb)) - channels
    expert_bytes = int(shape.expert_params * qb)
    kv_dtype = dtype if e.kv_cache_dtype == "auto" else e.kv_cache_dtype
    per_token = kv_bytes_per_token(shape, KV_BYTES[kv_dtype])
    from pylon.serving.model.families import ENCODER_MODEL_TYPES
    from pylon.serving.model.stored import checkpoint_quantization

    if config.model_type in ENCODER_MODEL_TYPES:  # a cross-encoder reads each input whole: no KV cache
        per_token = 0
    notes = []
    if shape.expert_params:
        notes.append(
            f"mixture of experts: {shape.expert_params:,} of the {shape.total_params:,} parameters are experts, a "
            f"token runs {shape.expert_share:.0%} of them ({shape.matmul_params:,} parameters in a matmul per "
            f"token); a decode step of n tokens reads the experts they pick, 1 - (1 - {shape.expert_share:.3g})^n of "
            "them with routing spread evenly"
        )
    quant_method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    if quant_method == "mxfp4":  # gpt-oss's checkpoints: experts in MXFP4, dequantized by transformers at load
        notes.append(
            f"the checkpoint's experts are MXFP4 (~{_gib(shape.expert_params * 17 // 32)} on disk); the engine "
            f"dequantizes them at load to {dtype} (transformers does where its MXFP4 kernels are not installed), so "
            "they weigh as counted here"
            + ("" if e.quantization != "none" else "; engine.quantization int8 (or fp8) halves them again")
        )
    stored = checkpoint_quantization(config)
    if stored is not None:  # DeepSeek-V3's, the "-FP8", "-W4A16" releases: read dequantized (serving/model/stored.py)
        on_disk = shape.projection_params * stored.bits // 8
        if e.quantization == "int4":
            then = "; engine.quantization int4 serves its projections in 4 bits again, as counted here"
            if stored.bits == 4 and stored.group:
                then += f" (in its own groups of {stored.group} where they fit: its grid found again)"
        elif e.quantization != "none":
            then = ""
        elif stored.bits == 4:
            then = "; engine.quantization int4 serves it in 4 bits, in its own groups (fp8 or int8 halves it)"
        else:
            then = "; engine.quantization fp8 (or int8) halves it again"
        notes.append(
            f"the checkpoint is {stored.describe()} (~{_gib(on_disk)} of its projections on disk); the engine reads "
            f"it dequantized to {dtype}" + (", so it weighs as counted here" if e.quantization == "none" else "") + then
        )
    # A multimodal checkpoint's vision tower and projector, kept for requests with images (engine.max_images_per_prompt
    # > 0), unquantized, in the engine's dtype.
    vision = vision_params(spec.model, "model") if not given and e.max_images_per_prompt > 0 else 0
    if vision:
        weights += vision * b
        notes.append(
            f"weights include the vision tower and projector: {_gib(vision * b)} ({vision:,} parameters; "
            "engine.max_images_per_prompt: 0 drops them); each request's images run through them once, beside the "
            "steps"
        )
    draft_kv = draft_weights = 0
    # Windowed layers mixed with full ones: the KV cache in groups of layers (below); a drafting layer's or head's cache
    # is in their block ids, each of which stands for a group's layers: as many more blocks as the layers to a group
    groups = _kv_groups(config, e)
    per_group = sum(len(g) for g, _ in groups) / max(len(g) for g, _ in groups) if groups else 1
    if e.speculative.method == "draft":
        # The draft model beside it: its weights (unquantized) and its own KV cache, sized by the engine as the
        # model's plus each running request's drafts (engine.LLMEngine._load_draft_model), in the engine's dtype.
        draft = model_shape(_config_from_dir(e.speculative.draft_model, "engine.speculative.draft_model"))
        draft_weights = draft.total_params * b
        draft_tokens = e.kv_cache_tokens + e.max_num_seqs * (e.speculative.num_tokens + e.block_size)
        draft_kv = draft_tokens * kv_bytes_per_token(draft, b)
        weights += draft_weights
        notes.append(
            f"weights include the draft model's {_gib(draft_weights)} ({draft.total_params:,} parameters) and the "
            f"KV cache its {_gib(draft_kv)} ({draft_tokens:,} tokens); decode throughput is without speculation"
        )
    if e.speculative.method == "mtp":
        # The checkpoint's multi-token-prediction layer (serving/model/mtp.py): one more decoder layer of the model's
        # kind (DeepSeek's sparse, Qwen's full attention), its input projection and norms, quantized as the model is;
        # the embeddings and head the model's; its KV cache one more layer in the model's blocks.
        from pylon.serving.model.mtp import layer_config
        from pylon.serving.model.mtp import refused as mtp_refused

        why = mtp_refused(config.model_type, config)
        if why is not None:
            raise PylonError(f"engine.speculative.method mtp: model {spec.model}: {why}")
        layer = model_shape(layer_config(config))  # (its vocabulary of 1: the model's embeddings and head shared)
        hidden = config.hidden_size
        layer_params = layer.total_params + 2 * hidden * hidden + 2 * hidden
        layer_bytes = layer_params * b
        if e.quantization != "none":
            projections = layer.projection_params + 2 * hidden * hidden
            layer_bytes -= int(projections * (b - qb))
        # (its weights split as the model's among tensor-parallel shards; its KV cache counted whole on each)
        draft_kv = int(e.kv_cache_tokens * per_group) * kv_bytes_per_token(layer, KV_BYTES[kv_dtype])
        weights += layer_bytes
        notes.append(
            f"weights include the checkpoint's multi-token-prediction layer, {_gib(layer_bytes)} ({layer_params:,} "
            f"parameters), and the KV cache its layer, {_gib(draft_kv)}; decode throughput is without speculation"
        )
    if e.speculative.method in EAGLE_METHODS:
        # An EAGLE head (serving/model/eagle.py): its decoder layers, fc and (EAGLE-3) its output layer over its draft
        # vocabulary, unquantized but its layers' projections; the model's embeddings and head shared; its KV cache
        # its layers in the model's blocks.
        from pylon import storage
        from pylon.errors import StorageError
        from pylon.serving.model.eagle import config_dict, head_params

        uri = e.speculative.draft_model
        try:
            raw = config_dict(storage.read_json(storage.join(uri, "config.json")))
        except (StorageError, AttributeError) as err:
            raise PylonError(f"engine.speculative.draft_model {uri}: cannot read config.json ({err})") from None
        head_config, extra, output = head_params(e.speculative.method, raw, config)
        head = model_shape(head_config)
        own = head.total_params - 2 * config.vocab_size * head_config.hidden_size  # (its embeddings and head: shared)
        layer_params = own + extra + output
        layer_bytes = layer_params * b
        if e.quantization != "none":
            layer_bytes -= int(head.projection_params * (b - qb))
        draft_kv = int(e.kv_cache_tokens * per_group) * kv_bytes_per_token(head, KV_BYTES[kv_dtype])
        weights += layer_bytes
        notes.append(
            f"weights include the {e.speculative.method} head, {_gib(layer_bytes)} ({layer_params:,} parameters), "
            f"and the KV cache its layers, {_gib(draft_kv)}; decode throughput is without speculation"
        )
    if e.speculative.method == "suffix":
        # Suffix decoding's trees (serving/engine/suffix.py) live in the replica's host memory, not the GPU's: ~250
        # bytes a cached output token (SUFFIX_BYTES_PER_TOKEN), every output at most max_model_len.
        cached = e.speculative.suffix_max_cached_requests * e.max_model_len * SUFFIX_BYTES_PER_TOKEN
        notes.append(
            f"suffix decoding's trees take host memory, not the GPU's: ~{SUFFIX_BYTES_PER_TOKEN} bytes a cached output "
            "token, "
            f"up to {_gib(cached)} were all {e.speculative.suffix_max_cached_requests:,} cached outputs "
            f"{e.max_model_len:,} tokens long (engine.speculative.suffix_max_cached_requests bounds it); decode "
            "throughput is without speculation"
        )
    counted: dict = {}  # LoRA parameters by (rank, targets)
    if e.adapters:
        adapter_params = sum(_adapter_params(config, i, a.path, counted) for i, a in enumerate(e.adapters))
        weights += adapter_params * b
        notes.append(
            f"weights include {len(e.adapters)} LoRA adapter(s): {_gib(adapter_params * b)} "
            f"({adapter_params:,} parameters); decode throughput is the base model's"
        )
    dynamic = e.dynamic_adapters
    if dynamic.root is not None:
        # Adapters loaded on demand: max_loaded of them at once, each at most max_rank on every projection the
        # engine adapts (serving/model/lora.py's PROJECTIONS), as peft would build such an adapter.
        from pylon.specs import LoraSpec

        targets = list(_ADAPTED_TARGETS.get(config.model_type, _LLAMA_TARGETS))
        key = (dynamic.max_rank, tuple(targets))
        if key not in counted:
            lora = LoraSpec(r=dynamic.max_rank, alpha=dynamic.max_rank, target_modules=targets)
            counted[key] = model_shape(config, lora).trainable_params
        on_demand = dynamic.max_loaded * counted[key]
        weights += on_demand * b
        notes.append(
            f"weights include room for {dynamic.max_loaded} LoRA adapter(s) loaded on demand, rank up to "
            f"{dynamic.max_rank} on every projection: {_gib(on_demand * b)} ({on_demand:,} parameters)"
        )
    # Prefill of a token batch: a few hidden-size tensors and the MLP's intermediate ones; fp32 logits of the
    # sequences that sample.
    workspace = (
        e.max_num_batched_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * b
        + e.max_num_seqs * shape.vocab_size * 4
    )
    # Recurrent layers' states: one per running sequence, and with the prefix cache its snapshots of them (kv_cache.py)
    # and each running sequence's latest one in decoding (kept for the cache when it ends).
    from pylon.serving.model.families import recurrent_state_bytes

    state = recurrent_state_bytes(config, b)
    if state:
        snapshots = e.recurrent_state_snapshots if e.enable_prefix_caching else 0
        kept = e.max_num_seqs * (2 if snapshots else 1) + snapshots
        workspace += kept * state
        notes.append(
            f"recurrent layers' states: {_gib(kept * state)}, {state / 2**20:.1f} MiB a sequence for up to "
            f"{e.max_num_seqs} running (engine.max_num_seqs)"
            + (
                f", each one's latest snapshot in decoding and {snapshots} prefix-cache snapshots "
                "(engine.recurrent_state_snapshots)"
                if snapshots
                else ""
            )
        )
    # Pipeline stages (engine.pipeline_parallel): each on a GPU of its own, holding its share of the model's weights and
    # of its layers' KV cache, with a step's workspace; each row counts the largest stage (the most weights, the most
    # layers: an upper bound where they differ) and a replica's cost is all of its GPUs'. A step still reads every
    # weight, one stage after another: the throughput is the whole model's (the hops between stages not counted).
    stages = e.pipeline_parallel
    held, held_per_token = weights, per_token  # what one GPU holds: the whole replica's, or its largest stage's
    if stages > 1:
        from pylon.serving.model.stages import split_layers, stage_parameters

        per_stage = stage_parameters(config, stages, _counted[1] if _counted is not None else None)
        held = int((weights - draft_weights) * max(per_stage) / sum(per_stage)) + draft_weights
        most_layers = max(len(r) for r in split_layers(shape.num_layers, stages))
        held_per_token = per_token * most_layers // shape.num_layers
        each = f"{e.tensor_parallel} GPUs of a node each" if e.tensor_parallel > 1 else "one GPU each"
        notes.append(
            f"{stages} pipeline stages, {each}: the memory shown is the largest stage's (of "
            f"{', '.join(f'{n:,}' for n in per_stage)} parameters, and its layers' share of the KV cache"
            + ("; one shard's share of it, below" if e.tensor_parallel > 1 else "")
            + f"); the cost is the replica's {stages * e.tensor_parallel} GPUs; decode throughput is the whole "
            "model's, the stages computing in turn (plus one hop of a step's hidden states between stages, not "
            "counted)"
        )
    # Tensor-parallel shards (engine.tensor_parallel): each on a GPU of the node, holding its share of every layer
    # (heads and MLP) and of the vocabulary's rows of the embeddings and lm_head, and its heads' share of the KV cache;
    # a decode step reads each shard's weights at once, so at the GPUs' bandwidth together (their all-reduces not
    # counted).
    shards = e.tensor_parallel
    if shards > 1:  # (of the whole model, or of the largest pipeline stage: `held`)
        share = 1 / shards
        held = int((held - draft_weights) * share) + draft_weights
        # past their count, the key-value heads are replicated: one a shard (pylon.serving.model.tensor.kv_replicas);
        # DeepSeek's latent (one "head" that every query head attends over) is every shard's, whole
        kv_held = max(1, shape.kv_heads // shards)
        held_per_token = held_per_token * kv_held // shape.kv_heads
        replicated = (
            ", but each token's whole latent on every shard"
            if shape.latent_kv
            else f", one of the {shape.kv_heads} key-value heads a shard, each held by {shards // shape.kv_heads}"
            if shards > shape.kv_heads
            else ""
        )
        whose = "the largest stage's" if stages > 1 else "the"
        notes.append(
            (f"each stage in {shards}" if stages > 1 else f"{shards}")
            + f" tensor-parallel shards on one node, one GPU each: the memory shown is one shard's ({share:.0%} of "
            f"{whose} weights: its share of every layer's heads and MLP and of the vocabulary's rows of the "
            f"embeddings and lm_head; its heads' share of the KV cache{replicated}); the cost is the replica's "
            f"{stages * shards} GPUs; a decode step reads the shards' weights at once (their all-reduces, two a "
            "layer, not counted)"
        )
    context = max(1, e.max_model_len // 2)
    longest = e.max_model_len  # the tokens a sequence's KV blocks hold at most
    window = _kv_window(config, e)
    if window is not None and window + e.block_size < e.max_model_len:
        longest = window + e.block_size
        notes.append(
            f"every layer attends within {window:,} tokens: a sequence holds at most its window's KV blocks "
            f"({longest:,} tokens' of its {e.max_model_len:,}; the engine lets go of those before the window), so the "
            "cache holds more sequences than its tokens / max_model_len (a decode step still reads a whole context's "
            "keys, masked: its time is counted as without the window)"
        )
    held_context = min(context, longest)  # what an average sequence holds
    if groups:  # in every layer's tokens: the full groups' whole context, the windowed groups' window (and slack)
        width, layers = max(len(g) for g, _ in groups), sum(len(g) for g, _ in groups)
        full = sum(width for _, w in groups if w is None) / layers
        windowed = sum(width for _, w in groups if w is not None) / layers
        w = next(w for _, w in groups if w is not None)
        held_context = math.ceil(context * full + min(context, w + e.block_size) * windowed)
        longest = math.ceil(e.max_model_len * full + min(e.max_model_len, w + e.block_size) * windowed)
        notes.append(
            f"{sum(1 for _, w in groups if w is not None) * width} of the {layers} layers' slots attend within {w:,} "
            f"tokens: the KV cache is in {len(groups)} groups of {width} layers, each with a block table of its own, "
            f"a sequence holding its window's blocks in the windowed ones (the engine lets go of those before it) "
            f"and its context's in the others: at {e.max_model_len:,} tokens, as much as {longest:,} tokens in every "
            "layer, so the cache holds more sequences than its tokens / max_model_len"
        )
    offload = 0
    if e.kv_offload_tokens and e.enable_prefix_caching and per_token:
        # The prefix cache's host tier (serving/engine/kv_cache.py): each engine's, every layer's keys and values (a
        # drafting layer's or head's too: its cache is in the model's blocks), each shard or stage its share.
        # (a block of the groups of layers, a group's layers: the tier's blocks are as many, each that much smaller)
        head = draft_kv // int(e.kv_cache_tokens * per_group) if e.speculative.method in HEAD_METHODS else 0
        block = int((per_token / per_group + head) * e.block_size)
        offload = int(e.kv_offload_tokens * (per_token / per_group + head)) * e.data_parallel
        engines = f", {e.data_parallel} engines' together" if e.data_parallel > 1 else ""
        where = (
            f"of disk under {e.kv_offload_path} (engine.kv_offload_path; reserved at start, its pages cached as the OS "
            "sees fit)"
            if e.kv_offload_path
            else "of the replica's host memory, pinned"
        )
        notes.append(
            f"the prefix cache's host tier (engine.kv_offload_tokens: {e.kv_offload_tokens:,} tokens) takes "
            f"{_gib(offload)} {where}{engines}, not the GPU's; a block found there is copied back "
            f"({block / 2**20:.2f} MiB, ~{block / HOST_LINK_BYTES_S * 1e6:.0f} us at {HOST_LINK_BYTES_S / 1e9:.0f} "
            f"GB/s from memory) rather than its {e.block_size} tokens computed"
        )
    rows = []
    for acc in accelerators:
        usable = acc.memory_bytes * USABLE_FRACTION
        kv = e.kv_cache_tokens * held_per_token + draft_kv
        free = usable - held - draft_kv - workspace - CUDA_CONTEXT_BYTES
        kv_fit = max(0, int(free // held_per_token)) if held_per_token else (e.kv_cache_tokens if free >= 0 else 0)
        total = held + kv + workspace + CUDA_CONTEXT_BYTES
        if total <= usable:
            fits, binding = True, f"{total / usable:.0%} of {_gib(usable)} usable"
        elif held + workspace + CUDA_CONTEXT_BYTES > usable:
            fits, binding = False, f"weights {_gib(held)} alone exceed {_gib(usable)} usable"
        else:
            fits, binding = (
                False,
                (
                    f"KV cache {_gib(kv)} ({e.kv_cache_tokens:,} tokens) + weights {_gib(held)} "
                    f"exceed {_gib(usable)}; {kv_fit:,} tokens fit"
                ),
            )
        bandwidth = acc.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
        batch = max(0, min(e.max_num_seqs, kv_fit // held_context))
        launch = LAUNCH_S_PER_LAYER * shape.num_layers

        def decode_tps(seqs: int) -> float:  # a decode step reads every weight and each sequence's KV cache
            read = weights - expert_bytes * (1 - experts_read(shape, seqs))  # an MoE model: the experts hit
            return seqs / ((read + seqs * context * per_token) / shards / bandwidth + launch) if seqs else 0.0

        single = decode_tps(1 if kv_fit >= context else 0)
        batched = decode_tps(batch)
        compute_ceiling = shards * acc.peak_flops(dtype) * mfu / (2 * shape.matmul_params)
        within = None
        if spec.autoscaling.target_itl_ms is not None:  # each sequence gets a token per step: seqs / tokens a second
            apart = spec.autoscaling.target_itl_ms / 1000
            within = max(
                (n for n in range(1, batch + 1) if n / min(decode_tps(n), compute_ceiling) <= apart), default=0
            )
        rows.append(
            ServeOption(
                acc,
                held,
                kv,
                workspace,
                CUDA_CONTEXT_BYTES,
                fits,
                binding,
                kv_fit,
                kv_fit // longest,
                min(single, compute_ceiling),
                min(batched, compute_ceiling),
                batch,
                utilization,
                stages * shards,
                "shard" if shards > 1 else "stage",
                streams_within_itl=within,
                prompt_tps=compute_ceiling,
            )
        )
    if spec.prefill is not None:
        rows = [replace(r, cost_scale=_prefill_cost_scale(spec)) for r in rows]
        notes.append(_prefill_note(spec, per_token))
    fitting = [r for r in rows if r.fits]
    recommendation = min(fitting, key=lambda r: r.cost_per_million_tokens) if fitting else None
    if recommendation is not None:
        notes.extend(_latency_notes(spec, recommendation))
    if recommendation is None and _suggest:
        options = {"catalog": catalog, "gpu": gpu, "mfu": mfu, "utilization": utilization}
        fitting_none = "it fits no one GPU as asked" if stages == shards == 1 else "it fits nothing as asked"
        sharded = _fewest_shards(spec, config, shape, **options)
        if e.speculative.method in HEAD_METHODS:  # (not in stages: planned with prompt lookup there)
            drafter = "mtp" if e.speculative.method == "mtp" else f"an {e.speculative.method} head"
            ngram = e.speculative.model_copy(update={"method": "ngram", "draft_model": None})
            spec = spec.model_copy(update={"engine": e.model_copy(update={"speculative": ngram})})
            e = spec.engine
            notes.append(
                "in pipeline stages as suggested below, the model drafts by prompt lookup (engine.speculative.method: "
                f"ngram): {drafter} drafts beside the model's last layer in one stage, and those plans count no such "
                "layer"
            )
        if sharded is not None:
            n, rec = sharded
            notes.append(
                f"{fitting_none}; "
                + (f"each of its {stages} stages " if stages > 1 else "")
                + f"in {n} tensor-parallel shards on one node (engine.tensor_parallel: {n}, one GPU a shard) it fits "
                f"{rec.accelerator.name}: ${rec.cost_per_million_tokens:,.3f} per million tokens at "
                f"{utilization:.0%} utilisation, one shard {_gib(rec.total)}"
            )
        staged = _fewest_stages(spec, config, shape, **options)
        if staged is not None:
            n, rec = staged
            notes.append(
                ("or, across nodes" if sharded is not None else fitting_none)
                + f"; in {n} pipeline stages (engine.pipeline_parallel: {n}, "
                + (f"{shards} GPUs of a node a stage" if shards > 1 else "one GPU a stage")
                + f") it fits {rec.accelerator.name}: ${rec.cost_per_million_tokens:,.3f} per million tokens at "
                f"{utilization:.0%} utilisation, the largest stage {_gib(rec.total)}"
                + (" a shard" if shards > 1 else "")
            )
        node = max(SUGGESTED_SHARDS)
        if sharded is None and shards < node and stages == 1:
            # past one node: stages across nodes, each a node's GPUs in shards (vLLM's TP 8 x PP n)
            from pylon.serving.model.tensor import refused

            if refused(config.model_type, config, node, e.expert_parallel) is None:
                wide = spec.model_copy(update={"engine": e.model_copy(update={"tensor_parallel": node})})
                both = _fewest_stages(wide, config, shape, **options)
                if both is not None:
                    n, rec = both
                    notes.append(
                        (
                            "or, each stage a node"
                            if staged is not None
                            else f"it fits no one GPU, nor one node of {node}, as asked"
                        )
                        + f"; in {n} pipeline stages of {node} "
                        f"tensor-parallel shards each (engine.pipeline_parallel: {n}, engine.tensor_parallel: "
                        f"{node}; a node of {node} GPUs a stage, {n * node} GPUs) it fits {rec.accelerator.name}: "
                        f"${rec.cost_per_million_tokens:,.3f} per million tokens at {utilization:.0%} utilisation, "
                        f"one shard {_gib(rec.total)}"
                    )
    if e.device == "cpu" or spec.replica.num_gpus == 0:
        notes.append("the spec serves on CPU; the table shows what each GPU would do")
    return ServePlan(
        spec.name,
        spec.model,
        shape,
        dtype,
        per_token,
        e.max_model_len,
        e.max_num_seqs,
        e.kv_cache_tokens,
        rows,
        recommendation,
        mfu,
        utilization,
        catalog.prices_source,
        notes,
        kv_offload_bytes=offload,
    )
