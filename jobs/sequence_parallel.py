"""Sequence parallelism (`scaling.sequence_parallel`): a row too long for one worker's activations split along its
tokens across a group of workers, DeepSpeed's Ulysses (ALST's `UlyssesSPAttentionHF`, what ArcticTraining and
DeepSpeed's Hugging Face integration run).

With `sequence_parallel: N` the workers form groups of N consecutive ranks. A group reads one data-parallel part
of the data (every rank of it the same rows: `data_rank`, `data_world`), and rank k of the group computes tokens
k*S/N .. (k+1)*S/N - 1 of each row (`shard`): its embeddings, MLPs, norms, output layer and loss hold S/N tokens.
Attention needs every token: each layer's queries, keys and values go through an all-to-all within the group, from
S/N tokens x all heads to all S tokens x H/N heads, attention runs over the whole row for those heads, and a second
all-to-all brings the output back to the rank's S/N tokens (`enabled`). So the heads (query and key-value) must
divide by N or N by the key-value heads (which are then repeated), and the row's length by N (`check`).

What stays exact: each rank's positions are the row's own (position_ids k*S/N ..., so rotary embeddings are
unchanged), and its labels are the row's next tokens, the last of its slice being the next rank's first
(`shard` gives it one label more than tokens: `pylon.jobs.train.token_loss_sum` pairs logits t with labels t + 1).
The loss is summed over the rank's tokens and divided by the global batch's token count, as without sequence
parallelism (`pylon.jobs.train._global_mean_loss`): DeepSpeed's gradient average over every rank then gives the
mean over the global batch, which is what one process computes. Causal masking comes from `sdpa`'s own
(`is_causal`: no mask is built); packed documents (`attention_mask: document`; a document starts where the gathered
position_ids restart at 0) attend one at a time, as FlashAttention's variable-length path does, never through a
row-long mask; a sliding window shorter than a row or document is a boolean mask over it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from pylon.errors import PylonError

FIELD = "scaling.sequence_parallel"


@dataclass
class SequenceParallel:
    """This rank's place: its group of `size` ranks (`group`, a process group), its rank in it, and the
    data-parallel part of the data the group reads (`data_rank` of `data_world`)."""

    size: int
    rank: int
    group: Any
    data_rank: int
    data_world: int

    @property
    def reads_data(self) -> bool:
        """Whether this rank's data reading counts (the group's ranks read the same rows: the first counts them)."""
        return self.rank == 0


def groups(size: int, rank: int, world: int) -> SequenceParallel | None:
    """The sequence-parallel groups of `world` ranks, `size` consecutive ranks each (every rank calls this: each
    group is made collectively), and this rank's place. None for size 1."""
    import torch.distributed as dist

    if size <= 1:
        return None
    if world % size:
        raise PylonError(f"{FIELD} {size} must divide the number of workers ({world})")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallel(size, rank % size, mine, rank // size, world // size)


def check(config, size: int, seq_len: int, where: str) -> None:
    """Refuse, naming the field, a model or row length that `size` ranks cannot split: its query heads must divide
    by `size`, its key-value heads too or `size` by them, the rows' length by `size`; attention must be `sdpa`'s
    (the kernels Ulysses wraps; an architecture transformers runs eagerly, for a soft-cap or sinks, is refused)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % size:
        raise PylonError(
            f"{FIELD} {size}: {where} has {heads} attention heads, which do not divide by {size}; each rank of a "
            "group attends with an equal share of them. Choose a divisor of the head count"
        )
    if kv % size and size % kv:
        raise PylonError(
            f"{FIELD} {size}: {where} has {kv} key-value heads; {size} must divide them or be a multiple of them"
        )
    if seq_len % size:
        raise PylonError(
            f"{FIELD} {size}: the rows are {seq_len} tokens, which do not divide by {size}; prepare the data with a "
            f"--seq-len that does (each rank computes an equal slice of every row)"
        )
    impl = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise PylonError(
            f"{FIELD} {size}: {where} attends with transformers' {impl!r} implementation; sequence parallelism "
            "wraps 'sdpa' (this architecture's attention is not one sdpa runs: train it without "
            f"{FIELD})"
        )


def shard(inputs: dict, sp: SequenceParallel) -> dict:
    """This rank's slice of a micro-batch's inputs (`Batch.to_torch`'s): its S/N tokens of each row, their
    position_ids (the row's own, k*S/N ... where none were given; a packed row's restarting ones), and its labels
    with the next rank's first label after them (one column more than its tokens; -100 after the row's last). The
    attention_mask is left out: the rows' padding comes after their tokens, which causal attention never reads."""
    import torch

    ids = inputs["input_ids"]
    rows, length = ids.shape
    local = length // sp.size
    start, end = sp.rank * local, (sp.rank + 1) * local
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(rows, length)
    out = {"input_ids": ids[:, start:end].contiguous(), "position_ids": positions[:, start:end].contiguous()}
    if "labels" in inputs:
        labels = inputs["labels"]
        tail = torch.full((rows, 1), -100, dtype=labels.dtype, device=labels.device)
        out["labels"] = torch.cat([labels, tail], dim=1)[:, start : end + 1].contiguous()
    return out


def window_mask(length: int, window: int | None):
    """The boolean mask (True: attended), `[1, 1, length, length]`, of a sliding `window` over `length` tokens from
    position 0: causal, and keys before a query's last `window` hidden. None where the window hides nothing (plain
    causal attention, sdpa's own)."""
    import torch

    if window is None or length <= window:
        return None
    index = torch.arange(length)
    return ((index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - window))[None, None]


def documents(position_ids) -> list[list[tuple[int, int]]] | None:
    """Each row's packed documents as (start, end) token ranges, where position_ids restart at 0 (a row starts one);
    None where every row is one document."""
    if not bool((position_ids[:, 1:] == 0).any()):
        return None
    length = position_ids.shape[1]
    out = []
    for row in position_ids:
        starts = (row == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        out.append(list(zip(starts, [*starts[1:], length])))
    return out


@contextlib.contextmanager
def enabled(model, sp: SequenceParallel | None, micro_batch_size: int):
    """Within it, `model`'s attention (transformers' 'sdpa', every model in the process) runs sequence-parallel
    over `sp`'s group (`UlyssesSPAttentionHF`), its inputs being `shard`'s; after it, as before (a forward pass of a
    whole row: the export's reference logits). Nothing for `sp` None."""
    if sp is None:
        yield
        return
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]

    positions: list = [None]  # this forward pass's position_ids, for layers that are not handed them (GPT-2's)
    seen: dict = {}  # what this forward pass's layers share (its documents; recomputation in backward reuses them)

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        # The whole row's queries, keys and values, for this rank's heads. Packed documents (from the gathered
        # position_ids) attend one at a time, causal within each: no row-long mask (S x S) is built, and no score
        # across documents computed. A sliding window masks within a row, or a document, longer than it.
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)  # (Mistral's; Qwen's)
        if "documents" not in seen:  # (the same for every layer of a forward pass: found once, at its first)
            seen["documents"] = documents(kwargs["position_ids"])
        parts = seen["documents"]
        if parts is None:
            mask = window_mask(query.shape[2], window)
            return core(module, query, key, value, None if mask is None else mask.to(query.device), *args, **kwargs)
        rows = []
        for r, ranges in enumerate(parts):
            pieces = []
            for a, b in ranges:
                mask = window_mask(b - a, window)
                q, k, v = (t[r : r + 1, :, a:b] for t in (query, key, value))
                mask = None if mask is None else mask.to(query.device)
                pieces.append(core(module, q, k, v, mask, *args, **kwargs)[0])
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows, dim=0), None

    ulysses = UlyssesSPAttentionHF(
        attn=attend,
        batch_size=micro_batch_size,
        attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=sp.group,
        seq_length_is_variable=True,
    )

    def remember(_module, args, kwargs):
        positions[0] = kwargs.get("position_ids")
        seen.clear()

    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions[0]
        rows = query.shape[0]  # (a micro-batch may be short: an epoch's last, or one all-padding row)
        if rows != ulysses.batch_size:
            ulysses.batch_size = rows
            ulysses.required_query_shape = torch.Size([1, rows, *ulysses.required_query_shape[2:]])
            ulysses.required_key_value_shape = torch.Size([1, rows, *ulysses.required_key_value_shape[2:]])
            ulysses.required_context_shape = torch.Size([1, rows, *ulysses.required_context_shape[2:]])
        # (the local mask transformers built is for the rank's slice alone: `attend` builds the row's)
        out, weights = ulysses(module, query, key, value, None, *args, **kwargs)
        # [rows, tokens, heads x head_dim] -> [rows, tokens, heads, head_dim], as transformers' attention functions
        # return it (some layers reshape it from there: GPT-2's)
        return out.reshape(*out.shape[:2], heads, -1), weights

    # Ulysses repeats key-value heads where there are fewer than ranks, and sets each attention module's
    # num_key_value_groups to match: put them back after
    groups_of = {m: m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")}
    hook = model.register_forward_pre_hook(remember, with_kwargs=True)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core
        hook.remove()
        for module, value in groups_of.items():
            module.num_key_value_groups = value
