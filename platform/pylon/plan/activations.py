"""Activation memory of one training step, found by running the step on PyTorch's meta device.

    profile = step_activations(config, micro_batch=8, seq_len=4096, precision="bf16", checkpointing=True,
                               lora=None, device="cuda", documents=False)
    profile.saved_bytes   # tensors kept for the backward pass when the forward pass ends
    profile.peak_bytes    # most bytes live at once during forward + backward (saved tensors, activation
                          # gradients, temporaries), beyond the weights and the optimizer's states

Meta tensors have shapes and dtypes but no data, so the step of a 70B model "runs" in a fraction of a second.
A `TorchDispatchMode` sees every tensor each operator creates, and a finalizer on its storage sees it freed, so
the count of live bytes is the one PyTorch's allocator would see, operator by operator, for any architecture
`transformers` builds -- including what formulas miss (dropout masks, fp32 upcasts in norms and the loss,
GELU's intermediates, LoRA's extra inputs, what recomputation keeps). Measured against real CPU steps it agrees
to within a few percent when glibc returns freed memory promptly (bench/plan_accuracy.py).

The step is Pylon's own (`pylon.jobs.train`): forward with no padding, logits upcast to fp32 for the summed
cross-entropy, backward; gradient checkpointing and LoRA are applied by the same functions training uses
(`pylon.models`). Gradients of parameters are dropped as soon as they are accumulated: what happens to them next
is DeepSpeed's business (partitioned, bucketed, offloaded), and `pylon.plan.memory` counts them.

Two things differ between the meta device and the device a job runs on, and are handled:
- attention: `scaled_dot_product_attention` picks a kernel by device and inputs. The fused kernels (flash,
  memory-efficient; every CUDA case here, and CPU when torch's flash kernel accepts the inputs) keep only
  O(seq) state for the backward pass, the math kernel keeps seq x seq probabilities (and dropout masks). The
  simulation asks torch which kernel the target device would pick and, for a fused one, stands in a function
  that keeps what the fused kernel keeps.
- transformers checks position ids for packed sequences, and unmasked input ids for padding, by reading values,
  which meta tensors do not have. The checks are answered as the job's batches would answer them: "not packed"
  (`attention_mask: causal`: Pylon's batches are then always masked), or, for a job that attends each packed
  document on its own (`documents`), "packed", so that transformers builds the block-diagonal mask it will
  build for real (batch x seq x seq booleans) and attention runs as it does with a mask.

Depth and batch: the model runs at depth 1 and 2 and micro-batch 1 and 2, and the results are extrapolated
bilinearly to the job's depth and micro-batch: every decoder layer adds the same bytes, and so does every
sequence of a batch (within 3% of a full-depth simulation for GPT-2 and Llama shapes).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pylon.models import (
    ActivationOffload,
    auto_model_class,
    enable_gradient_checkpointing,
    head_outputs,
    is_classifier,
    with_chunked_loss,
    with_lora,
    without_padding_warning,
)
from pylon.specs import LoraSpec

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LOCK = threading.Lock()  # the simulation patches module attributes while it runs
_CONFIGS: dict[str, object] = {}  # config JSON -> config, so the cache below can be keyed by text


@dataclass(frozen=True)
class ActivationProfile:
    saved_bytes: int  # kept for backward at the end of the forward pass (logits included)
    peak_bytes: int  # the step's peak of live activation bytes (saved + gradients of activations + temporaries)
    host_bytes: int = 0  # activation_offload: the most of them held in host memory at once


def step_activations(
    config,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    lora: LoraSpec | None,
    device: str,
    documents: bool = False,
    loss_chunk_tokens: int = 0,
    offload: bool = False,
) -> ActivationProfile:
    """Activation memory of one micro-batch of Pylon's training step on `device` ('cuda' or 'cpu'); `documents`:
    each packed document attended on its own (`TrainJobSpec.attention_mask: document`); `loss_chunk_tokens`: the
    loss computed that many tokens at a time (`pylon.models.with_chunked_loss`); `offload`: what the forward pass
    saves kept in host memory (`TrainJobSpec.activation_offload`, `pylon.models.ActivationOffload`, the same hooks)."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    _CONFIGS.setdefault(key, config)
    lora_key = lora.model_dump_json() if lora is not None else ""
    # A chunked loss's peak is one chunk's logits whatever the batch, beside what does grow with it: not linear in
    # the batch, so it is simulated at the micro-batch itself (and the one below), where the fit is exact.
    batches = (max(1, micro_batch - 1), max(2, micro_batch)) if loss_chunk_tokens else (1, 2)
    saved, peak, host = _coefficients(
        key, seq_len, precision, checkpointing, lora_key, device, documents, loss_chunk_tokens, batches, offload
    )
    layers = config.num_hidden_layers
    return ActivationProfile(
        saved_bytes=int(_extrapolate(saved, micro_batch, layers)),
        peak_bytes=int(_extrapolate(peak, micro_batch, layers)),
        host_bytes=int(_extrapolate(host, micro_batch, layers)),
    )


def eagle3_activations(
    config, head, *, micro_batch: int, seq_len: int, precision: str, device: str, documents: bool, steps: int
) -> ActivationProfile:
    """Activation memory of one micro-batch of objective eagle3's step (`pylon.draft_head.Eagle3Trainer`): the frozen
    model's forward pass without gradients at its full depth (its hidden states, which transformers keeps for every
    layer, its logits, the teacher's over the draft vocabulary), then the head's `steps` drafts trained, forward and
    backward. Simulated at micro-batch 1 and 2 and extrapolated linearly."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    head_key = json.dumps(head.to_dict(), sort_keys=True, default=str)
    _CONFIGS.setdefault(key, config)
    _CONFIGS.setdefault(head_key, head)
    (s1, p1), (s2, p2) = (_eagle3_run(key, head_key, b, seq_len, precision, device, documents, steps) for b in (1, 2))
    return ActivationProfile(
        saved_bytes=int(max(0.0, s1 + (s2 - s1) * (micro_batch - 1))),
        peak_bytes=int(max(0.0, p1 + (p2 - p1) * (micro_batch - 1))),
    )


@functools.lru_cache(maxsize=32)
def _eagle3_run(
    config_key: str, head_key: str, batch: int, seq_len: int, precision: str, device: str, documents: bool, steps: int
) -> tuple[int, int]:
    from pylon.draft_head import Eagle3Head, Eagle3Trainer, draft_loss

    config, head_config = _CONFIGS[config_key], _CONFIGS[head_key]
    dtype = _DTYPES[precision]
    aux = tuple(head_config.eagle_config["eagle_aux_hidden_state_layer_ids"])
    with torch.device("meta"):
        target = auto_model_class(config).from_config(config, dtype=dtype)
        draft = torch.zeros(head_config.draft_vocab_size, dtype=torch.long)
        head = Eagle3Head(head_config, draft).to(dtype)  # (DeepSpeed casts the whole module)
        trainer = Eagle3Trainer(target, head, aux, steps, 0.8)
    trainer.train()
    without_padding_warning(target)
    for p in head.parameters():
        p.register_post_accumulate_grad_hook(_drop_grad)
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device="meta")
    extra = {"position_ids": torch.zeros((batch, seq_len), dtype=torch.long, device="meta")} if documents else {}
    tracker = _LiveBytes()
    tracker.preexisting([*trainer.parameters(), *trainer.buffers(), ids, *extra.values()])
    with _LOCK, _attention_as_on(device), _packed_batches(documents), tracker:
        drafts, teacher, greedy, _ = trainer.drafts(ids, **extra)
        saved = tracker.live
        # the trainer's loss (its counted rows a mask: the boolean indexing reads values, which meta tensors lack)
        loss = None
        for k, d in enumerate(drafts):
            part = draft_loss(d, teacher, k).sum()
            loss = part if loss is None else loss + part
            del part
        del drafts, teacher, greedy
        loss.backward()
        del loss
    return saved, tracker.peak


def _extrapolate(c: tuple[float, float, float, float], batch: int, layers: int) -> float:
    # Bilinear in micro-batch and depth: bytes(b, L) = k0 + kL*L + b*(kb + kbL*L). Constants and per-layer
    # terms that do not grow with the batch (parameter gradients in flight) are k0 and kL.
    k0, kl, kb, kbl = c
    return max(0.0, k0 + kl * layers + batch * (kb + kbl * layers))


@functools.lru_cache(maxsize=64)
def _coefficients(
    config_key: str,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    lora_json: str,
    device: str,
    documents: bool,
    loss_chunk_tokens: int,
    batches: tuple[int, int] = (1, 2),
    offload: bool = False,
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    config = _CONFIGS[config_key]
    lora = LoraSpec.model_validate_json(lora_json) if lora_json else None
    runs = {
        (b, n): _simulate(
            config,
            batch=b,
            layers=n,
            seq_len=seq_len,
            precision=precision,
            checkpointing=checkpointing,
            lora=lora,
            device=device,
            documents=documents,
            loss_chunk_tokens=loss_chunk_tokens,
            offload=offload,
        )
        for b in batches
        for n in (1, 2)
    }
    b1, b2 = batches

    def fit(i: int) -> tuple[float, float, float, float]:
        # bytes(b, n) = k0 + kl*n + b*(kb + kbl*n) through the four runs, at depths 1 and 2, batches b1 and b2
        p11, p12, p21, p22 = runs[b1, 1][i], runs[b1, 2][i], runs[b2, 1][i], runs[b2, 2][i]
        kbl = ((p22 - p12) - (p21 - p11)) / (b2 - b1)
        kb = (p21 - p11) / (b2 - b1) - kbl
        kl = (p12 - p11) - b1 * kbl
        return p11 - kl - b1 * (kb + kbl), kl, kb, kbl

    return fit(0), fit(1), fit(2)


def _with_depth(config, layers: int):
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    # Some configs list a type per layer (sliding/full attention); keep the first `layers`.
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return config


def _simulate(
    config,
    *,
    batch: int,
    layers: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    lora: LoraSpec | None,
    device: str,
    documents: bool = False,
    loss_chunk_tokens: int = 0,
    offload: bool = False,
) -> tuple[int, int, int]:
    """(bytes live when the forward pass ends, peak live bytes, peak bytes in host memory) of one step of a
    `layers`-deep copy. A classifier's config (objective reward's reward model) simulates its head over every position
    (what the trainer reads) and no vocabulary's logits. `offload`: the forward pass under training's own
    `ActivationOffload` hooks, which on the meta device keep a saved tensor's description: its bytes leave the count
    as the device's copy is freed and come back when the backward pass unpacks it."""
    dtype = _DTYPES[precision]
    config = _with_depth(config, layers)
    classifier = is_classifier(config)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=dtype)
        if checkpointing:
            enable_gradient_checkpointing(model)
        if lora is not None:
            # DeepSpeed casts the whole module, adapters included, to the training precision.
            model = with_lora(model, lora).to(dtype)
        if loss_chunk_tokens:
            with_chunked_loss(model, loss_chunk_tokens)
    model.train()
    without_padding_warning(model)  # which reads the input ids' values
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_drop_grad)
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device="meta")
    tracker = _LiveBytes()
    # Weights, buffers and the input batch exist before the step; views of them (a transposed weight kept for
    # backward, a slice of the batch) allocate nothing and must not be counted as new bytes.
    tracker.preexisting([*model.parameters(), *model.buffers(), ids])
    # The inputs `pylon.jobs.train.model_inputs` gives: a causal batch's all-ones mask is dropped by transformers
    # unread, as no mask at all is; a document batch's restarting positions (their values are the check's answer).
    extra = {"position_ids": torch.zeros((batch, seq_len), dtype=torch.long, device="meta")} if documents else {}
    tracker.preexisting(list(extra.values()))
    hooks = ActivationOffload(model, "meta") if offload else contextlib.nullcontext()
    with _LOCK, _attention_as_on(device), _packed_batches(documents), tracker:
        with hooks:  # (training's: around the forward pass, the loss included)
            if classifier:  # a reward model: its head at every position, each pair's loss from a few of them
                with head_outputs(model) as heads:
                    model(input_ids=ids, use_cache=False, **extra)
                saved = tracker.live
                loss = heads[-1].float().sum()
                heads.clear()
            elif loss_chunk_tokens:  # the model computes its loss a chunk at a time: no logits
                loss = model(input_ids=ids, labels=ids, use_cache=False, **extra).loss_sum
                saved = tracker.live
            else:
                logits = model(input_ids=ids, use_cache=False, **extra).logits
                saved = tracker.live
                loss = _summed_cross_entropy(logits, ids)
                # the trainer's step keeps no reference to the logits once the loss has them: the cross-entropy keeps
                # what its backward needs (its log-softmax), and the logits go
                del logits
        loss.backward()
        del loss
    return saved, tracker.peak, hooks.peak_host_bytes if offload else 0


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The allocations of `pylon.jobs.train._global_mean_loss` (which reads values, so cannot run on meta):
    # shifted logits upcast to fp32, reshaped (a copy: the slice is not contiguous), summed cross-entropy.
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


class _LiveBytes(TorchDispatchMode):
    """Bytes of every storage an operator creates, until it is freed; and the peak of that sum."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def preexisting(self, tensors) -> None:
        """Storages allocated before the step: never counted, whichever views of them operators return."""
        for t in tensors:
            self._seen.add(t.untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen:  # a view, or an in-place result
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


# ---------------------------------------------------------------------------------------------------------
# Attention as the target device runs it
# ---------------------------------------------------------------------------------------------------------


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel allocates and keeps: the output and a float32 log-sum-exp per query row
    (plus its inputs, a mask among them) for backward, and input-sized gradients -- never the seq x seq
    probabilities."""

    @staticmethod
    def forward(ctx, query, key, value, mask=None):
        out = query.new_empty(query.shape[:-1] + value.shape[-1:])
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None


@functools.lru_cache(maxsize=256)
def _cpu_kernel_is_fused(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    mask_dims: int,
    dropout: bool,
    is_causal: bool,
    enable_gqa: bool,
) -> bool:
    """Would torch on CPU run these inputs through a fused kernel? Asked of torch itself, on small tensors."""
    from torch.nn.attention import SDPBackend

    seq = 8
    q = torch.zeros(1, heads, seq, head_dim, dtype=dtype, requires_grad=True)
    k = torch.zeros(1, kv_heads, seq, head_dim, dtype=dtype, requires_grad=True)
    v = torch.zeros(1, kv_heads, seq, v_dim, dtype=dtype, requires_grad=True)
    mask = torch.zeros((1,) * (mask_dims - 2) + (seq, seq), dtype=dtype) if mask_dims else None
    try:
        choice = torch._fused_sdp_choice(
            q, k, v, attn_mask=mask, dropout_p=0.1 if dropout else 0.0, is_causal=is_causal, enable_gqa=enable_gqa
        )
    except (RuntimeError, TypeError):
        return False
    return choice in (SDPBackend.FLASH_ATTENTION.value, SDPBackend.EFFICIENT_ATTENTION.value)


@contextlib.contextmanager
def _attention_as_on(device: str):
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if device == "cuda":
            # Flash and memory-efficient kernels cover head dims up to 256, with dropout and masks.
            fused = query.shape[-1] <= 256
        else:
            fused = _cpu_kernel_is_fused(
                query.dtype,
                query.shape[-3],
                key.shape[-3],
                query.shape[-1],
                value.shape[-1],
                attn_mask.dim() if attn_mask is not None else 0,
                dropout_p > 0,
                bool(is_causal),
                bool(enable_gqa),
            )
        if fused:
            return _FusedAttention.apply(query, key, value, attn_mask)
        return real(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


@contextlib.contextmanager
def _packed_batches(packed: bool):
    """transformers' packed-sequence check answered without reading values: None ("not packed"), or with
    `packed` a segment index per token (as meta, the shape is what counts)."""
    try:
        from transformers import masking_utils
    except ImportError:  # an older transformers: no packed-sequence detection to answer
        yield
        return
    real = getattr(masking_utils, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = (
        (lambda position_ids: torch.zeros_like(position_ids)) if packed else (lambda position_ids: None)
    )
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real
