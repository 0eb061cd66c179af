"""Paged attention in plain PyTorch: the one part of the model the engine replaces.

A step's tokens arrive flattened, every sequence's new tokens one after the other (`[T, heads, head_dim]`).
Each layer writes the new keys and values into the paged pool at each token's slot, then lets every
sequence's new queries attend over its cached keys. Decodes (one query each) are batched rather than looped
over, and apart from prompt chunks, so a long chunk never pads a hundred decodes; chunks (a few per step) go
one at a time through a fused kernel (below).

The cache is head-major, `[kv_heads, num_blocks, block_size, head_dim]` (`new_kv_cache`), so that gathering a
group's blocks (one `index_select` of whole blocks into a reused workspace: no allocation, no page faults)
leaves every (kv head, sequence) pair's keys contiguous, and attention is two batched matmuls with the
transpose folded into BLAS: `[kv_heads x B, group x Q, D] @ [kv_heads x B, D, K]`. Grouped-query attention
(fewer kv heads) puts a kv head's query heads side by side in the same matmul instead of repeating keys.

The mask is causal with an offset, as an additive bias built once per step: query q of a sequence whose step
starts at position `start` sees keys 0..start+q, which is what makes a prompt chunked across steps compute
exactly what one pass would.

A layer with a sliding window (`families.layer_windows`) sees only the last `window` of those keys: the query at
position p, keys p - window + 1 .. p, as `transformers` masks them. Its metadata (`build_metadata(window=...)`) puts
the window into the decode groups' bias and the prompt chunks' masks (a chunk that starts its prompt gets a mask
too, in place of `is_causal`, once the window cuts into it), and never goes to the compiled kernels, which take no
window. Only the blocks that hold a query's window are gathered (`WINDOW_GATHER`; vLLM's sliding-window kernels skip
the rest the same way): a decode from the block of its first key in the window, a prompt chunk from that of its first
query's, so that a windowed layer's attention reads and multiplies window + a block of keys however long the context
(Llama 4's chunks likewise, from the start of the query's chunk, where a chunk is whole blocks); keys of those blocks
before the window are masked out. (Decode steps replayed from CUDA graphs, pylon.serving.model.graphs, gather every
block: their tables are captured at fixed sizes.) Where every layer is windowed, the engine has let go of the blocks
before it and the table names the runner's scratch block in their places (engine/kv_cache.py, `trim`), which are then
never read. A model without a window builds exactly the metadata it would without this.

Prompt chunks are attended one sequence at a time by torch's fused `scaled_dot_product_attention` (a flash
kernel on CPU and CUDA: it skips the masked half of a causal square and never materialises the scores): a
chunk that starts the prompt attends over its own fresh keys with `is_causal`, a later chunk over its cached
keys (its blocks gathered) with the offset causal mask. On a CPU with AVX-512 or AVX2 over a float32 cache, chunks
go to the compiled prefill kernel instead (`kernels.prefill_attention_`), which reads every key, the chunk's own
included, through the block table (`PromptChunk.key_blocks`). On a GPU the runner keeps SDPA off cuDNN's attention
(`prompt_attention_backends`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pylon.serving.model import kernels
from pylon.serving.model.families import Chunk

# The SDPA backends a step may use on a GPU: flash and memory-efficient attention (math as their fallback), not
# cuDNN's. torch prefers cuDNN's attention on Hopper for bf16/fp16, and cuDNN builds an execution plan on the host
# for each new shape, which a prompt chunk's (queries, keys) nearly always is: on an H100 a 12-layer bf16 GPT-2's
# steps with a prompt chunk took 102 ms (p50) with it and 22 ms without, 83% of the engine's CPU time in
# `_cudnn_attention_forward` (docs/benchmarks/2026-11-27-set21-serve-load-h100.md).
GPU_PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prompt_attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """A step's context for `scaled_dot_product_attention`'s backends on `device` (GPU_PROMPT_BACKENDS on CUDA;
    elsewhere nothing: entering torch's `sdpa_kernel` costs ~30 us, and only CUDA has cuDNN's backend)."""
    return sdpa_kernel(GPU_PROMPT_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


# A windowed layer's attention gathers the blocks that hold its queries' windows only (see the module's docs); False:
# every key from position 0, masked (what the engine did before: bench/serve_window_gather.py's baseline).
WINDOW_GATHER = True

DECODE_GROUPS = 4  # at most this many padded batches of decodes per step...
MIN_GROUP = 8  # ...each of at least this many sequences (a group costs a few small kernel launches per layer)


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """One layer's K (or V) pool: `[kv_heads, num_blocks, block_size, head_dim]`, zeroed."""
    return torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: `num_new` tokens from position `start`, cached in `block_table`."""

    start: int
    num_new: int
    block_table: list[int]
    # Runs of positions [a, b) whose queries attend the whole run, keys after their own included (an image's
    # placeholders in Gemma 3: pylon.serving.engine.images); the step never ends inside one.
    spans: tuple[tuple[int, int], ...] = ()
    # A draft tree (`StepSequence.tree`): each new token's parent among them (-1: the first). Token i's keys are at
    # slot start + i, its position start + its depth; it attends to the cache before `start` and its own ancestors.
    tree: tuple[int, ...] = ()


def tree_depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Each node's depth in a tree given as its nodes' parents (-1: a root), parents before children."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_positions(start: int, parents: tuple[int, ...] | list[int]) -> list[int]:
    """The positions of a draft tree's tokens (`SequenceSlice.tree`): its first at `start`, each other one past its
    parent's."""
    return [start + d for d in tree_depths(parents)]


def _ancestry(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Each node's ancestors and itself as the bits of an int (bit j: node j), parents before children."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    return bits


def tree_bits(parents: tuple[int, ...] | list[int]) -> list[int]:
    """`_ancestry` of a tree of at most 64 nodes as signed 64-bit integers: what the compiled prefill kernel masks a
    draft tree's rows by (`kernels.prefill_attention_`)."""
    return [b - (1 << 64) if b >= 1 << 63 else b for b in _ancestry(parents)]


TREE_KERNEL_NODES = 64  # the most nodes the prefill kernel's masks hold (engine.speculative.num_tokens <= 32)


def _tree_mask(seq: SequenceSlice, key_start: int, window: int | None, device: torch.device) -> torch.Tensor:
    """`[num_new, start + num_new - key_start]` True where a draft tree's token may attend: every cached key (each
    is before it), and of the tree's own, its ancestors and itself; with a `window`, by positions as `_mask`."""
    n, parents = seq.num_new, seq.tree
    own = [[bool(bits >> j & 1) for j in range(n)] for bits in _ancestry(parents)]
    mask = torch.cat([torch.ones(n, seq.start - key_start, dtype=torch.bool), torch.tensor(own)], dim=1)
    if window is not None:
        position = torch.tensor(tree_positions(seq.start, parents))
        key = torch.cat([torch.arange(key_start, seq.start), position])
        if isinstance(window, Chunk):
            mask &= key[None, :] >= (position[:, None] // window) * window
        else:
            mask &= key[None, :] > position[:, None] - window
    return mask.to(device, non_blocking=True)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one padded batch: B sequences, Q queries (the most new tokens of any of them),
    K keys (the longest context among them)."""

    query_index: torch.Tensor  # [B, Q]: flat token index of each query; padding repeats a real query
    real: torch.Tensor | None  # indices into the padded [B*Q] rows that are real queries... (None: kernel)
    tokens: torch.Tensor  # ...and the flat token index each of them is, in the same order
    key_blocks: torch.Tensor  # [B * blocks]: each sequence's block table, padded with block 0 (masked out)
    num_blocks: int
    num_keys: int
    bias: torch.Tensor | None  # [B, Q, K]: 0 where the query may attend the key, -inf where not (None: kernel)
    context_lens: torch.Tensor  # [B]: keys of each sequence (int64)


@dataclass(frozen=True)
class PromptChunk:
    """A sequence with more than one new token in the step: tokens offset..offset+num_new of the flat batch,
    at positions start..start+num_new."""

    offset: int
    start: int
    num_new: int
    key_blocks: torch.Tensor | None  # its block table up to its last new token (None when start == 0, unless the
    # prefill kernel reads even a fresh prompt's keys from the cache: `AttentionMetadata.prefill`)
    mask: torch.Tensor | None  # [num_new, start + num_new - key_start] bool: True where the query may attend the key
    # (SDPA's); None with key_blocks None: plain causal attention over the chunk's own keys (`is_causal`)
    key_start: int = 0  # the position of key_blocks' first key (a windowed layer's: the block of its first query's
    # window; `WINDOW_GATHER`)
    tree: torch.Tensor | None = None  # a draft tree's `tree_bits` for the prefill kernel (mask None then)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T]: where each new token's key and value go in a head's flattened pool
    # (None: the keys and values are already in the cache; see `final_metadata`)
    groups: list[AttentionGroup]  # decodes (one query each)
    kernel: bool = False  # decode groups go to the compiled kernel (pylon.serving.model.kernels)
    chunks: tuple[PromptChunk, ...] = ()
    prefill: bool = False  # prompt chunks go to the compiled prefill kernel (kernels.prefill_attention_)
    window: int | None = None  # the sliding window its masks apply (None: plain causal attention)
    # The metadata of the model's windowed layers, where they mix with layers of full attention (Qwen's
    # max_window_layers): the same step and slot mapping, with the window. None where every layer attends as this
    # metadata says (a model with no window, or windowed in every layer: then this one has the window).
    windowed: AttentionMetadata | None = None
    # The KV cache in groups of layers, each with block tables of its own (ModelRunner.kv_groups): group g's metadata at
    # g, this one group 0's (None at 0). Empty: every layer's blocks are the same.
    kv_groups: tuple[AttentionMetadata | None, ...] = ()

    def over_cache(self) -> AttentionMetadata:
        """This metadata (and its `windowed`, its `kv_groups`) without the slot mapping: the keys and values are
        already in the cache (a step of decodes only's last layer: `Final`)."""
        windowed = self.windowed.over_cache() if self.windowed is not None else None
        groups = tuple(m.over_cache() if m is not None else None for m in self.kv_groups)
        return dataclasses.replace(self, slot_mapping=None, windowed=windowed, kv_groups=groups)


class Workspace:
    """Reused buffers for the gathered keys and values: a fresh multi-megabyte tensor per layer and step
    would cost page faults on every allocation (glibc hands large blocks back to the OS)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(
                max(numel, int(buf.numel() * 1.25) if buf is not None else 0), dtype=like.dtype, device=like.device
            )
            self._buffers[name] = buf
        return buf[:numel].view(shape)


class HostStage:
    """The integer tensors of a step (token ids, positions, slots, block tables, context lengths), sent to the device
    in one copy.

    On a GPU each `torch.tensor(..., device="cuda")` is a copy from pageable memory: ~65 us of the host's time each
    (staged through a driver buffer), and an eager step made ~20 of them (torch.profiler on an H100, a 12-layer bf16
    GPT-2: `cudaMemcpyAsync` 13% of the engine's CPU time; docs/benchmarks/2026-11-27-set23-serve-load-h100.md).
    Staged, `add`
    writes a list into a reused page-locked buffer and returns its place in a reused device buffer, `then` queues
    device work that reads it, and `send` copies everything added since the last send in one non-blocking copy and
    then queues that work. Views are handed out before the copy is queued: nothing may read them before `send`.

    Unstaged (a CPU, unless `staged` says otherwise), `add` makes a tensor as `torch.tensor` would, `then` runs at
    once and `send` does nothing: on a CPU the lists are already where the kernels read them."""

    def __init__(self, device: torch.device | str, *, staged: bool | None = None, min_size: int = 4096):
        self.device = torch.device(device)
        self.staged = self.device.type == "cuda" if staged is None else staged
        self.min_size = min_size
        self.copies = 0  # copies to the device so far (staged)
        self._host: torch.Tensor | None = None  # int64, page-locked on CUDA
        self._values = None  # its numpy view: a list is written into it without a tensor in between
        self._dev: torch.Tensor | None = None
        self._used = self._sent = 0
        self._then: list = []
        self._done = None  # a CUDA event after the last copy out of `_host`

    def begin(self) -> None:
        """Start a step: the previous copy out of the page-locked buffer must have happened before it is rewritten
        (a step that samples nothing returns without waiting on the device)."""
        if self._done is not None:
            self._done.synchronize()
        self._used = self._sent = 0
        self._then.clear()

    def _room(self, n: int) -> None:
        if self._host is not None and self._used + n <= len(self._host):
            return
        self.send()  # what was added goes from the buffers it was written in; fresh ones take the rest
        size = max(self.min_size, 2 * n, 2 * len(self._host) if self._host is not None else 0)
        pin = self.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.long, pin_memory=pin)
        self._values = self._host.numpy()
        self._dev = torch.empty(size, dtype=torch.long, device=self.device)
        self._used = self._sent = 0

    def add(self, values: list[int]) -> torch.Tensor:
        """A 1-D int64 tensor on the device holding `values` (staged: once `send` has run)."""
        if not self.staged:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        n = len(values)
        self._room(n)
        a = self._used
        self._values[a : a + n] = values
        self._used = a + n
        return self._dev[a : a + n]

    def then(self, work) -> None:
        """Run `work()` (device work reading what was added) once it is on the device."""
        if self.staged:
            self._then.append(work)
        else:
            work()

    def send(self) -> None:
        if self.staged and self._used > self._sent:
            a, b = self._sent, self._used
            self._dev[a:b].copy_(self._host[a:b], non_blocking=True)
            self._sent = b
            self._copied()
        work, self._then = self._then, []
        for w in work:
            w()

    def upload(self, dst: torch.Tensor, values: list[int]) -> None:
        """Copy `values` into the int64 device tensor `dst` (a CUDA graph's inputs): one copy, page-locked."""
        if not self.staged:
            dst.copy_(torch.tensor(values, dtype=torch.long))
            return
        self.begin()
        self._room(len(values))
        n = len(values)
        self._values[:n] = values
        dst[:n].copy_(self._host[:n], non_blocking=True)
        self._copied()

    def _copied(self) -> None:
        """A copy out of the page-locked buffer was queued: count it, and mark its place in the stream (`begin`)."""
        self.copies += 1
        if self.device.type == "cuda":
            self._done = self._done or torch.cuda.Event()
            self._done.record()


def build_metadata(
    seqs: list[SequenceSlice],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    kernel: bool = False,
    prefill: bool = False,
    stage: HostStage | None = None,
    slots: bool = True,
    rounded: bool = False,
    window: int | None = None,
) -> AttentionMetadata:
    """What every layer's attention needs to know about this step, for `seqs` in their flat token order.
    `kernel`: decodes are attended by the compiled paged kernel, in place, so they form one group. `prefill`: prompt
    chunks are attended by the compiled prefill kernel, over the cache (`kernels.prefill_usable`). `stage`: the
    step's HostStage, which the caller sends (without one, the lists go over before this returns); `slots`: make the
    slot mapping (else None: see `final_metadata`). `rounded`: the cache is narrower than the model computes
    (kv_cache_dtype), and every prompt chunk, the first too, attends over the keys and values read back from it, so a
    prompt's outputs do not depend on where its chunks start: in one chunk, in several, or after a cached prefix.
    `window`: the layers it is for have this sliding window (`families.layer_windows`): every query attends to the
    `window` keys up to its own only, and neither kernel runs (`kernel` and `prefill` are ignored: they take no
    window)."""
    if window is not None:
        kernel = prefill = False
    own = stage is None
    stage = stage or HostStage(device)
    # Plain Python ints, one tensor at the end: a step of 32 decodes would otherwise make ~100 tiny tensors.
    offsets, slot_list, offset = [], [], 0
    for seq in seqs:
        offsets.append(offset)
        offset += seq.num_new
        if slots:
            table = seq.block_table
            slot_list.extend(
                table[p // block_size] * block_size + p % block_size for p in range(seq.start, seq.start + seq.num_new)
            )
    # Decodes are grouped by context length: one padded batch would gather every sequence's keys up to the
    # longest context, and gathering is most of the cost of attention here. Sorted, in up to
    # DECODE_GROUPS groups of at least MIN_GROUP sequences, the padding shrinks to a fraction.
    # On a GPU, one group: padding costs device bandwidth there, which is plentiful, while every group adds a dozen
    # kernel launches per layer to a step whose time is the host's launching them (a 12-layer model's 32-decode
    # step on an H100: 30 ms with four groups, of which 3 ms on the device).
    decodes = [i for i, s in enumerate(seqs) if s.num_new == 1]
    if not kernel:  # the kernel needs no padding, and takes them in the step's order (see paged_attention)
        decodes.sort(key=lambda i: seqs[i].start)
    if kernel or torch.device(device).type == "cuda":
        parts = 1
    else:
        parts = min(DECODE_GROUPS, max(1, len(decodes) // MIN_GROUP))
    bounds = [round(j * len(decodes) / parts) for j in range(parts + 1)]
    members = [decodes[a:b] for a, b in zip(bounds, bounds[1:])]
    if kernel:
        groups = [_kernel_group([seqs[i] for i in m], [offsets[i] for i in m], block_size, stage) for m in members if m]
    else:
        groups = [
            _group([seqs[i] for i in m], [offsets[i] for i in m], block_size, device, dtype, stage, window)
            for m in members
            if m
        ]
    chunks = tuple(
        _chunk(seq, offset, block_size, device, prefill, stage, rounded, window)
        for seq, offset in zip(seqs, offsets)
        if seq.num_new > 1
    )
    meta = AttentionMetadata(stage.add(slot_list) if slots else None, groups, kernel, chunks, prefill, window)
    if own:
        stage.send()
    return meta


def final_metadata(
    seqs: list[SequenceSlice],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    kernel: bool = False,
    stage: HostStage | None = None,
    window: int | None = None,
    prefill: bool = False,
) -> AttentionMetadata:
    """The last layer's attention for the step's sampling tokens only, one query each: `seqs` are
    `SequenceSlice(position, 1, table)` of each sampling token, in the order of the queries. Their keys and values,
    the step's included, are in the cache when it runs (the layer stores every token's first), so it stores
    nothing and every query is a decode over the cache; a draft tree's tokens are one slice, attended as its chunk
    (`prefill`: through the prefill kernel, as `build_metadata`'s). `window`: as `build_metadata`'s."""
    return build_metadata(
        seqs, block_size, device, dtype, kernel=kernel, prefill=prefill, stage=stage, slots=False, window=window
    )


def padded_tables(tables: Iterable[list[int]], num_blocks: int) -> list[int]:
    """Block tables cut or padded with block 0 to `num_blocks` each, one after another (a flat `[B * num_blocks]`):
    what a padded batch of sequences reads its keys through (the padding's keys are masked out or never reached)."""
    flat = []
    for table in tables:
        row = table[:num_blocks]
        flat.extend(row)
        flat.extend([0] * (num_blocks - len(row)))
    return flat


def _kernel_group(
    seqs: list[SequenceSlice],
    offsets: list[int],
    block_size: int,
    stage: HostStage,
) -> AttentionGroup:
    """Decodes for the kernel, which needs only block tables and lengths: no padding, no mask (plain Python,
    three tensors: this runs every step)."""
    num_keys = [s.start + 1 for s in seqs]
    nb = -(-max(num_keys) // block_size)
    tokens = stage.add(offsets)
    return AttentionGroup(
        tokens.view(-1, 1),
        None,
        tokens,
        stage.add(padded_tables((s.block_table for s in seqs), nb)),
        nb,
        max(num_keys),
        None,
        stage.add(num_keys),
    )


def _chunk(
    seq: SequenceSlice,
    offset: int,
    block_size: int,
    device: torch.device,
    prefill: bool,
    stage: HostStage,
    rounded: bool = False,
    window: int | None = None,
) -> PromptChunk:
    num_keys = seq.start + seq.num_new
    if seq.tree:  # a draft tree (never a prompt's first chunk): over the cache, masked by ancestry
        first = _first_block(seq.start, window, block_size)
        blocks = stage.add(seq.block_table[first : -(-num_keys // block_size)])
        if prefill and seq.num_new <= TREE_KERNEL_NODES:  # (no window here: build_metadata cleared prefill)
            return PromptChunk(offset, seq.start, seq.num_new, blocks, None, tree=stage.add(tree_bits(seq.tree)))
        mask = _tree_mask(seq, first * block_size, window, device)
        return PromptChunk(offset, seq.start, seq.num_new, blocks, mask, first * block_size)
    # The window hides keys from some of the chunk's queries: its last query's, at position num_keys - 1, begin at
    # num_keys - window (within the window, windowed attention is causal attention).
    cut = window is not None and num_keys > window
    if seq.start == 0 and not prefill and not rounded:  # its keys are its own new tokens: plain causal attention
        if not cut and not seq.spans:
            return PromptChunk(offset, 0, seq.num_new, None, None)
        key = torch.arange(num_keys, device=device)
        return PromptChunk(offset, 0, seq.num_new, None, _mask(key, key, seq.spans, window if cut else None))
    first = _first_block(seq.start, window, block_size)  # (0 without a window: prefill's too)
    blocks = stage.add(seq.block_table[first : -(-num_keys // block_size)])
    if prefill:  # the kernel reads every key through the block table and masks by position itself
        if seq.spans:
            raise ValueError("the prefill kernel masks causally only: a chunk with spans needs prefill=False")
        return PromptChunk(offset, seq.start, seq.num_new, blocks, None)
    # Made where it is used: on a GPU, building the [num_new, num_keys] mask on the host and copying it over took
    # ~0.5 ms a chunk (torch.profiler on an H100: `aten::le` on the CPU 0.42 ms, then a pageable copy).
    position = torch.arange(seq.start, num_keys, device=device)
    key = torch.arange(first * block_size, num_keys, device=device)
    mask = _mask(position, key, seq.spans, window if cut else None)
    return PromptChunk(offset, seq.start, seq.num_new, blocks, mask, first * block_size)


def _first_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position` (and every later one) reads through a `window`: that of its window's
    first key, or for a `Chunk` of whole blocks, of its chunk's start; 0 without a window (or `WINDOW_GATHER` off)."""
    if window is None or not WINDOW_GATHER:
        return 0
    if isinstance(window, Chunk):
        return position // window * window // block_size if window % block_size == 0 else 0
    return max(position - window + 1, 0) // block_size


def _mask(
    position: torch.Tensor, key: torch.Tensor, spans: tuple[tuple[int, int], ...], window: int | None
) -> torch.Tensor:
    """`[queries, keys]` True where the query at `position` attends the key: causal; each of `spans`' queries also
    sees its whole span (transformers' OR(causal, block) for Gemma 3's images); and, with a `window`, only keys
    p - window + 1 .. (AND(window, ...), as transformers composes Gemma 3's sliding layers' masks)."""
    mask = key[None, :] <= position[:, None]
    start = int(position[0]) if len(position) else 0
    k0 = int(key[0]) if len(key) else 0  # (the first key's position: a windowed chunk's keys start at its window)
    for a, b in spans:
        q0, q1 = max(a - start, 0), min(b - start, len(position))
        if q1 > q0 and b > k0:
            mask[q0:q1, max(a - k0, 0) : min(b - k0, len(key))] = True
    if isinstance(window, Chunk):  # Llama 4's chunks: the query at position p sees keys (p // size) * size .. p
        mask &= key[None, :] >= (position[:, None] // window) * window
    elif window is not None:  # and past its window: the query at position p sees keys p - window + 1 .. p
        mask &= key[None, :] > position[:, None] - window
    return mask


def _group(
    seqs: list[SequenceSlice],
    offsets: list[int],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    stage: HostStage,
    window: int | None = None,
) -> AttentionGroup:
    """Decodes (one new token each) in one padded batch: each sequence's keys up to the group's longest context,
    masked past its own (the bias is made on the device, from the lengths, once they are there); with a `window`,
    masked before its window too (its query, at position n - 1 of a context of n keys, sees keys n - window ..),
    each sequence's keys gathered from its window's first block on (`_first_block`): its lengths and mask are then
    counted from there (a window's and a chunk's masks are the same counted from a block, or a chunk, boundary)."""
    firsts = [_first_block(s.start, window, block_size) for s in seqs]
    num_keys = [s.start + 1 - first * block_size for s, first in zip(seqs, firsts)]
    K, B = max(num_keys), len(seqs)
    num_blocks = -(-K // block_size)
    tokens = stage.add(offsets)
    table = stage.add(padded_tables((seq.block_table[first:] for seq, first in zip(seqs, firsts)), num_blocks))
    lens = stage.add(num_keys)
    bias = torch.empty(B, 1, K, dtype=dtype, device=device)
    keys = torch.arange(K, device=device)
    stage.then(lambda: bias.zero_().masked_fill_(decode_mask(keys, lens, window), float("-inf")))
    return AttentionGroup(tokens.view(-1, 1), torch.arange(B, device=device), tokens, table, num_blocks, K, bias, lens)


def decode_mask(keys: torch.Tensor, lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """`[B, 1, K]` bool, True where a decode may not attend: the `keys` (`arange(K)`) at or past each sequence's
    context length `lens` (`[B]`), and with a `window` those before its last `window` (`_group`; CUDA graphs), or
    with a `Chunk` those before its chunk."""
    hidden = keys[None, None, :] >= lens[:, None, None]
    if isinstance(window, Chunk):  # the query at position n - 1 sees its chunk's keys only
        hidden |= keys[None, None, :] < ((lens - 1) // window * window)[:, None, None]
    elif window is not None:
        hidden |= keys[None, None, :] < (lens - window)[:, None, None]
    return hidden


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Write the step's keys (or values) `x` (`[T, kv_heads, head_dim]`) at their slots of `cache`, converted to how
    the cache stores them (the engine's kv_cache_dtype: float8 saturates at +-448, as torch's conversion does)."""
    num_kv_heads, _, _, head_dim = cache.shape
    src = x.transpose(0, 1).to(cache.dtype)
    flat = cache.view(num_kv_heads, -1, head_dim)
    if cache.element_size() == 1:  # torch has no index_copy_ for float8: copy the bytes
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(1, slot_mapping, src)


def store_kv_pair(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: bool = False,
) -> None:
    """`store_kv` of a step's keys and of its values; `kernel` (the CPU kernels are built, as `meta.kernel` says): both
    in one call of `pylon.serving.model.kernels.store_kv_` where the caches store what the model computes (two
    `index_copy_`s a layer were ~5% of a 16-sequence decode step)."""
    if kernel and k.dtype == k_cache.dtype and k.stride(-1) == 1 and v.stride(-1) == 1:
        kernels.store_kv_(k_cache, v_cache, slot_mapping, k, v)
        return
    store_kv(k_cache, slot_mapping, k)
    store_kv(v_cache, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output `[T, heads, head_dim]` for the step's queries `q` (`[T, heads, head_dim]`), after
    storing the step's `k`, `v` (`[T, kv_heads, head_dim]`) in the caches (`new_kv_cache` layout; unless
    `meta.slot_mapping` is None: then they are there already and `k`, `v` are not used). The caches may
    be stored in a narrower dtype than `q` (kv_cache_dtype): keys and values read back are widened to `q`'s; a
    prompt chunk that starts its prompt attends over its own fresh keys and values, unrounded, as vLLM does.
    (With `build_metadata(rounded=True)` it reads them back from the cache too.)
    `q` may have rows past the step's tokens (the model runner pads a step with a prompt chunk to one of a few row
    counts, `linear.padded_rows`): their output is zeros. `softcap` (Gemma 2's attn_logit_softcapping): every score,
    once scaled, becomes softcap * tanh(score / softcap) before the mask and the softmax, as transformers computes it;
    neither compiled kernel takes it (the runner builds no metadata for them: `ModelRunner.attn_softcap`), and SDPA
    cannot, so prompt chunks attend through `_eager_attention`. `sinks` (`[heads]`, GPT-OSS's): each head's learned
    logit joins every query's softmax as one more column, which takes its share of the weight and adds no value, as
    transformers' eager GPT-OSS attention computes it; likewise through `_eager_attention` and no kernel."""
    num_kv_heads, num_pool_blocks, block_size, head_dim = k_cache.shape
    heads = q.shape[1]
    share = heads // num_kv_heads  # query heads per kv head
    if meta.slot_mapping is not None:
        store_kv_pair(k_cache, v_cache, meta.slot_mapping, k, v, kernel=meta.kernel)
    workspace = workspace or Workspace()
    out = torch.empty_like(q)
    if k is not None and len(q) > len(k):  # rows past the step's tokens (the model runner's padding)
        out[len(k) :].zero_()
    for c in meta.chunks:
        rows = slice(c.offset, c.offset + c.num_new)
        if meta.prefill and c.mask is None:  # float32 cache: the chunk's own keys read back are the ones it computed
            kernels.prefill_attention_(out[rows], q[rows], k_cache, v_cache, c.key_blocks, c.start, scale, c.tree)
            continue
        queries = q[rows].transpose(0, 1)[None]  # [1, heads, num_new, D]
        if c.key_blocks is None:  # a chunk that starts its prompt: its own keys (causal, or masked by a window)
            keys, values = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        else:
            num_keys = c.start + c.num_new - c.key_start
            keys = k_cache.index_select(1, c.key_blocks).view(num_kv_heads, -1, head_dim)[None, :, :num_keys]
            values = v_cache.index_select(1, c.key_blocks).view(num_kv_heads, -1, head_dim)[None, :, :num_keys]
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-ops where the cache is stored as computed
        mask = c.mask
        if softcap is not None or sinks is not None:
            attended = _eager_attention(queries[0], keys[0], values[0], mask, scale, softcap, sinks)
            out[rows] = attended.transpose(0, 1)
            continue
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=share > 1
        )
        out[rows] = attended[0].transpose(0, 1)
    for g in meta.groups:
        B, Q = g.query_index.shape
        if meta.kernel and Q == 1:
            # Decodes only (no chunk, and the kernel's one group keeps the step's order): every query, as it is.
            if not meta.chunks and B == len(q):
                return kernels.paged_decode(q, k_cache, v_cache, g.key_blocks.view(B, -1), g.context_lens, scale)
            out[g.tokens] = kernels.paged_decode(
                q[g.tokens], k_cache, v_cache, g.key_blocks.view(B, -1), g.context_lens, scale
            )
            continue
        K, nb = g.num_keys, g.num_blocks
        shape = (num_kv_heads, B * nb, block_size, head_dim)
        keys = torch.index_select(k_cache, 1, g.key_blocks, out=workspace.get("k", shape, k_cache))
        values = torch.index_select(v_cache, 1, g.key_blocks, out=workspace.get("v", shape, v_cache))
        keys = keys.view(num_kv_heads * B, nb * block_size, head_dim)[:, :K].to(q.dtype)
        values = values.view(num_kv_heads * B, nb * block_size, head_dim)[:, :K].to(q.dtype)
        # [B, Q, kv_heads, share, D] -> [kv_heads, B, share, Q, D]: a kv head's query heads share its keys.
        queries = (
            q[g.query_index]
            .view(B, Q, num_kv_heads, share, head_dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(num_kv_heads * B, share * Q, head_dim)
        )
        scores = torch.bmm(queries, keys.transpose(1, 2))  # [kv_heads * B, share * Q, K]
        scores = scores.view(num_kv_heads, B, share, Q, K).mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores = scores.add_(g.bias[None, :, None])
        if sinks is not None:  # one more column per head: its sink's logit (dropped once softmaxed)
            sink = sinks.to(scores.dtype).view(num_kv_heads, 1, share, 1, 1).expand(num_kv_heads, B, share, Q, 1)
            scores = torch.cat([scores, sink], dim=-1)
        if scores.dtype != torch.float32:  # softmax of half-precision scores loses too much
            probs = scores.float().softmax(dim=-1).to(scores.dtype)
        else:
            probs = scores.softmax(dim=-1)
        if sinks is not None:
            probs = probs[..., :K].contiguous()
        attended = torch.bmm(probs.view(num_kv_heads * B, share * Q, K), values)
        attended = (
            attended.view(num_kv_heads, B, share, Q, head_dim).permute(1, 3, 0, 2, 4).reshape(B * Q, heads, head_dim)
        )
        out[g.tokens] = attended[g.real]
    return out


def _eager_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prompt chunk's attention with soft-capped scores or sinks, as transformers' eager Gemma 2 and GPT-OSS
    attentions compute it: `queries` `[heads, Q, D]` over `keys` and `values` `[kv_heads, K, D]` (a kv head's query
    heads side by side in one matmul, as the decode groups do), `mask` `[Q, K]` True where a query may attend (None:
    causal over the chunk's own keys, Q == K); `sinks` `[heads]`: one more logit per head in each softmax (see
    `paged_attention`). The scores are made whole (`[heads, Q, K]`): a chunk is at most max_num_batched_tokens long.
    The softmax is float32 whatever the model's dtype. Returns `[heads, Q, D]`."""
    heads, Q, D = queries.shape
    kv_heads, K = keys.shape[0], keys.shape[1]
    share = heads // kv_heads
    grouped = queries.reshape(kv_heads, share * Q, D)  # heads are kv-head-major: head h reads kv head h // share
    scores = torch.bmm(grouped, keys.transpose(1, 2)).view(kv_heads, share, Q, K).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is None:
        mask = torch.ones(Q, K, dtype=torch.bool, device=queries.device).tril_()
    scores = scores.float().masked_fill_(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kv_heads, share, 1, 1).expand(kv_heads, share, Q, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :K].to(values.dtype).contiguous()
    else:
        probs = scores.softmax(dim=-1).to(values.dtype)
    attended = torch.bmm(probs.view(kv_heads, share * Q, K), values)
    return attended.view(heads, Q, D)


@dataclass(frozen=True)
class Final:
    """The last layer of a step, for the tokens that sample only.

    Every token's keys and values must reach the cache, at every layer: later tokens attend to them. But a token's
    output of the last layer (its attention, output projection and MLP) feeds nothing but its own logits, which
    only the sampling tokens (each decode, and a prompt's last token) need. A step that is mostly prompt chunks
    would spend a quarter of a 4-layer model's projections and MLPs on outputs thrown away, so the last layer stores
    every token's keys and values, then attends and runs its MLP for the sampling tokens only, each one query over
    the cache (`final_metadata`)."""

    rows: torch.Tensor | None  # [S]: the sampling tokens' indices in the step's flat batch; None: every token
    # samples (a step of decodes only), in order
    meta: AttentionMetadata | None  # their attention, one query each over the cache; None when none samples
