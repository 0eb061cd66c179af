"""Paged attention in plain PyTorch: the one part of the model the engine replaces.

A step's tokens arrive flattened, every sequence's new tokens one after the other (`[T, heads, head_dim]`).
Each layer writes the new keys and values into the paged pool at each token's slot, then lets every
sequence's new queries attend over its cached keys, gathered from its blocks. Sequences are batched
through `scaled_dot_product_attention` with padding and a mask rather than looped over: decodes (one
query each) form one batch and prompt chunks another, so a long chunk never pads a hundred decodes.

The mask is causal with an offset: query q of a sequence whose step starts at position `start` sees keys
0..start+q, which is what makes a prompt chunked across steps compute exactly what one pass would.
Everything here that does not depend on the layer is built once per step (`AttentionMetadata`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: `num_new` tokens from position `start`, cached in `block_table`."""

    start: int
    num_new: int
    block_table: list[int]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one padded batch: B sequences, Q queries (the most new tokens of any of them),
    K keys (the longest context among them)."""

    query_index: torch.Tensor  # [B, Q]: flat token index of each query; padding repeats a real query
    real: torch.Tensor  # indices into the padded [B*Q] rows that are real queries...
    tokens: torch.Tensor  # ...and the flat token index each of them is, in the same order
    block_table: torch.Tensor  # [B, blocks]: padded with block 0, masked out anyway
    num_keys: int
    mask: torch.Tensor  # [B, 1, Q, K]: True where the query may attend the key


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]: where each new token's key and value go in the flattened pool
    groups: list[AttentionGroup]


def build_metadata(seqs: list[SequenceSlice], block_size: int, device: torch.device) -> AttentionMetadata:
    """What every layer's attention needs to know about this step, for `seqs` in their flat token order."""
    offsets, slots, offset = [], [], 0
    for seq in seqs:
        offsets.append(offset)
        offset += seq.num_new
        positions = torch.arange(seq.start, seq.start + seq.num_new)
        table = torch.tensor(seq.block_table)
        slots.append(table[positions // block_size] * block_size + positions % block_size)
    decodes = [i for i, s in enumerate(seqs) if s.num_new == 1]
    chunks = [i for i, s in enumerate(seqs) if s.num_new > 1]
    groups = [_group([seqs[i] for i in members], [offsets[i] for i in members], block_size, device)
              for members in (decodes, chunks) if members]
    return AttentionMetadata(torch.cat(slots).to(device), groups)


def _group(seqs: list[SequenceSlice], offsets: list[int], block_size: int, device: torch.device) -> AttentionGroup:
    start = torch.tensor([s.start for s in seqs])
    num_new = torch.tensor([s.num_new for s in seqs])
    num_keys = start + num_new
    Q, K = int(num_new.max()), int(num_keys.max())
    q = torch.arange(Q)
    query_index = torch.tensor(offsets)[:, None] + torch.minimum(q[None, :], num_new[:, None] - 1)
    is_real = (q[None, :] < num_new[:, None]).reshape(-1)
    real = is_real.nonzero().squeeze(1)
    query_position = start[:, None] + q[None, :]  # [B, Q]
    key = torch.arange(K)
    # Padding queries (q >= num_new) see the whole real context: a row with no key at all would be NaN.
    mask = (key[None, None, :] <= query_position[:, :, None]) & (key[None, None, :] < num_keys[:, None, None])
    num_blocks = -(-K // block_size)
    table = torch.zeros(len(seqs), num_blocks, dtype=torch.long)
    for b, seq in enumerate(seqs):
        row = seq.block_table[:num_blocks]
        table[b, :len(row)] = torch.tensor(row)
    return AttentionGroup(query_index.to(device), real.to(device), query_index.reshape(-1)[real].to(device),
                          table.to(device), K, mask[:, None].to(device))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention output `[T, heads, head_dim]` for the step's queries `q` (`[T, heads, head_dim]`), after
    storing the step's `k`, `v` (`[T, kv_heads, head_dim]`) in the caches (`[blocks, block_size, kv_heads,
    head_dim]`). Grouped-query attention (fewer kv heads) is handled by SDPA's `enable_gqa`."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for g in meta.groups:
        B, Q = g.query_index.shape
        queries = q[g.query_index].transpose(1, 2)  # [B, heads, Q, head_dim]
        keys = k_cache[g.block_table].flatten(1, 2)[:, :g.num_keys].transpose(1, 2)  # [B, kv_heads, K, head_dim]
        values = v_cache[g.block_table].flatten(1, 2)[:, :g.num_keys].transpose(1, 2)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale,
                                                  enable_gqa=q.shape[1] != num_kv_heads)
        out[g.tokens] = attended.transpose(1, 2).reshape(B * Q, *q.shape[1:])[g.real]
    return out
