"""The KV cache's memory, in fixed-size blocks: which blocks are free, which request holds which, and which hold a
cached prefix that a later request may share.

The pool hands out block *ids*; the tensors they index live in the model runner (one K and one V tensor per layer,
`[kv_heads, num_blocks, block_size, head_dim]`). A request's block table lists its blocks in order, so token position
p lives in block `table[p // block_size]` at offset `p % block_size`.

**Prefix caching** (vLLM v1's automatic prefix caching, `engine.enable_prefix_caching`). A full block's contents are
named by a hash chained over its tokens and every token before it (`block_hashes`): two requests whose first k
blocks' tokens are equal have equal first k hashes, and equal keys and values in those blocks. Once a request has
computed a full block, the scheduler registers it under its hash (`cache_blocks`). A later request looks its
prompt's hashes up (`lookup`) and starts its table with the blocks found (`allocate(cached=...)`): they are shared,
counted by reference, and the scheduler skips computing those tokens. Only full blocks are shared, and a request
writes only at positions past those it starts with, so a shared block is never written. When the last request
holding a cached block lets it go, the block stays cached but free: it counts as free, and is handed out again (its
contents forgotten) only when a request needs a block and no block without cached contents is free, least recently
used first. A hash is a 128-bit BLAKE2b digest, so one user's prompt cannot be made to collide with another's.

Where blocks go matters on a CPU: every decode step reads every live block, and a sequence whose blocks lie one after
another is read much faster than a scattered one (the hardware prefetchers follow a run). So the pool keeps each
request's own blocks in one run where it can:

- a request's first own blocks are the lowest run of free blocks long enough for its whole expected length
  (`reserve_tokens`: prompt plus max_tokens, capped at `RESERVE_MAX_BLOCKS` beyond what it needs now), a run of
  blocks without cached contents if there is one, else any run of free blocks (the cached contents in it are
  forgotten: a run beats the least-recently-used order there); the rest of the run is set aside for it;
- a growing request takes the block right after its last one where that block is free and set aside for it, or set
  aside for no one and holding no cached contents; otherwise the lowest free block without cached contents that no one
  has set aside; otherwise the least recently used free cached block;
- set-aside blocks are still free: when nothing else is free, any request takes them. Capacity, `allocate`'s
  all-or-nothing answer and preemption are as if nothing were set aside.

Lowest first also keeps the live blocks packed at the start of the pool however many requests come and go.

**Sliding windows** (`set_window`, `trim`; vLLM v1's sliding-window manager). Where every layer of the model attends
within a window of W tokens, a query at position p reads no key before p - W + 1: the scheduler has the pool let go
of a request's blocks wholly before its window each step, as `free` lets go of blocks (a registered one stays cached
for a later request's prefix until it is needed), and puts a null block id in their places (one past the pool's: the
runner's scratch block, whose keys the window's mask hides), so that every position keeps its block's index. A
sequence then holds its window's blocks and the step's, not its whole context's.

**A host tier** (`offload_blocks`, engine.kv_offload_tokens; vLLM's CPU KV offloading, SGLang's HiCache). A cached block
whose contents would be forgotten because its block is taken for other contents is first copied to one of
`offload_blocks` slots in host memory (the runner's, pinned on a GPU), named by the same hash; a later request whose
prefix runs on past the device's cached blocks into the host's has those blocks copied back into free blocks
(`restore`) rather than computed. The pool only decides: the copies are queued in order (`drain_copies`) and the
engine has the runner make them before its next pass reads or writes a block. A slot is let go of least recently used
first (a restored block's slot stays: a block evicted again with a slot still holding it is not copied twice).
`forget_cached` forgets the host tier's contents too. A hash the host tier holds counts as cached (`cached_hashes`, the
journal): it is a copy away.

**Recurrent layers' states** (`StateSnapshots`; Qwen3-Next's and Qwen3.5's Gated DeltaNet layers). Such a layer keeps
no keys and values: a sequence's whole past is one state, which a cached block cannot hold. So next to the blocks the
engine keeps snapshots of every recurrent layer's state at some block boundaries, named by the hash of the block that
ends there: a request starts from a cached prefix only as far as its deepest block with a snapshot, its attention
layers from the blocks and its recurrent layers from that snapshot (`Scheduler._cached_prefix`). Snapshots are taken
where a step's tokens end on a boundary (a prompt's computing is split at each of these): the last boundary of a
prompt short of its last token (what the same prompt, or one that extends it, will look up); the last boundary before
the position a request names (`SamplingParams.snapshot_at`: the server's, where a chat's last message begins, so that
another conversation with the same system prompt starts past it); every `engine.recurrent_snapshot_interval` tokens
where that is set; and, in decoding, the latest boundary a request reached (kept when it ends: the next turn of a chat
extends the whole of it). They are kept least recently used first, at most `engine.recurrent_state_snapshots`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import islice
from typing import Any

from pylon.serving.engine.tokenization import prompt_ids
from pylon.serving.model.families import first_key

DIGEST_BYTES = 16  # a block hash's size (128 bits)
# A new request's run of blocks may take cached ones only among this many times its size least recently used
# (KVBlockPool._cold); past that, its blocks are the least recently used ones wherever they are.
COLD_RUN_FACTOR = 4
RESERVE_MAX_BLOCKS = 64  # at most this many blocks set aside beyond what a request needs when it starts


def cache_salt(adapter: str | None, salt: str | None = None) -> bytes:
    """What a request's first block hash starts from: nothing for the base model, the adapter's name for a LoRA
    adapter's request, whose keys and values differ from the base model's for the same tokens (engine.adapters);
    and the request's own `salt` (SamplingParams.cache_salt), which only requests with the same salt share."""
    named = b"" if adapter is None else b"adapter\0" + adapter.encode()
    return named if salt is None else named + b"salt\0" + salt.encode()


def prompt_prefix(tokenizer, prompt, block_size: int, params) -> tuple[list[int], list[bytes]]:
    """A text or token-id prompt's ids as the engine reads them (`params`' special tokens; a SamplingParams or None),
    and the hashes of its full blocks short of its last token, which is always computed (`block_hashes`, from
    `params`' adapter and cache salt): what a lookup in an engine's prefix cache may find, asked from outside it
    (an engine pool's routing, a prefill replica's asker). Raises what tokenizing it raises."""
    special = params.add_special_tokens if params is not None else False
    salt = cache_salt(params.adapter, params.cache_salt) if params is not None else b""
    ids = prompt_ids(tokenizer, prompt, special) if isinstance(prompt, str) else list(prompt)
    return ids, block_hashes(ids[: len(ids) - 1], block_size, [], salt)


def block_hashes(token_ids: list[int], block_size: int, hashes: list[bytes], salt: bytes = b"") -> list[bytes]:
    """Extend `hashes` (those of `token_ids`' first full blocks, computed before) to every full block of `token_ids`:
    block k's hash is BLAKE2b over block k-1's hash (block 0: over `salt`, `cache_salt`) and block k's token ids.
    Returns `hashes`."""
    parent = hashes[-1] if hashes else salt
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class StateSnapshots:
    """The recurrent layers' states at block boundaries, by the hash of the block that ends there (see the module's
    docs), at most `capacity` of them, the least recently used let go first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._kept: OrderedDict[bytes, Any] = OrderedDict()
        self.stored = 0  # snapshots put, a counter
        self.restored = 0  # requests started from one

    def __contains__(self, h: bytes) -> bool:
        return h in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, h: bytes, snapshot: Any) -> None:
        self._kept[h] = snapshot
        self._kept.move_to_end(h)
        self.stored += 1
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, h: bytes) -> Any:
        snapshot = self._kept[h]
        self._kept.move_to_end(h)
        return snapshot


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False, offload_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # One byte per block, so that runs are found by bytes.find (C speed) rather than a Python loop.
        self._free = bytearray(b"\x01") * num_blocks  # held by no request
        self._open = bytearray(b"\x01") * num_blocks  # free and set aside for no request
        self._bare = bytearray(b"\x01") * num_blocks  # open, and holding no cached contents
        self._refs = [0] * num_blocks  # requests holding each block
        self._num_free = num_blocks
        self._tables: dict[str, list[int]] = {}
        self._aside: dict[str, range] = {}  # request -> the run set aside for it when it was placed
        self._aside_for: dict[int, str] = {}  # block -> the request it is still set aside for (while free)
        # Prefix caching: hash <-> block for blocks whose contents are cached, the free ones among them oldest-used
        # first, and what else the engine keeps about a cached block (its prompt log-probabilities), by hash.
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._meta: dict[bytes, Any] = {}
        self._registered: dict[str, int] = {}  # request -> how many of its table's first blocks are registered
        self._journal: list[tuple[bool, bytes]] | None = None  # (registered?, hash) since `drain_changes`
        # A model whose every layer attends within a sliding window (`set_window`): the block id that stands in a
        # table for a block let go because it fell out of the window, and how many of each table's first blocks were
        # let go of so (`trim`)
        self.null_block: int | None = None
        self._trimmed: dict[str, int] = {}
        # The host tier (see the module's docs): hash -> slot, least recently used first; the slots no hash holds;
        # what was kept with each (`set_meta`); the copies not made yet, in order ([kind, sources, destinations]);
        # the slots a `restore` reads from (never handed to a save meanwhile); counters, in blocks.
        self.offload_blocks = offload_blocks if enable_caching else 0
        self._host: OrderedDict[bytes, int] = OrderedDict()
        self._host_free = list(range(self.offload_blocks - 1, -1, -1))
        self._host_meta: dict[bytes, Any] = {}
        self._copies: list[tuple[str, list[int], list[int]]] = []
        self._pinned: set[int] = set()
        self.offload_saved = 0  # blocks copied to the host tier
        self.offload_loaded = 0  # blocks copied back from it

    @classmethod
    def for_tokens(
        cls, kv_cache_tokens: int, block_size: int, *, enable_caching: bool = False, offload_tokens: int = 0
    ) -> "KVBlockPool":
        return cls(
            kv_cache_tokens // block_size,
            block_size,
            enable_caching=enable_caching,
            offload_blocks=offload_tokens // block_size,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching -------------------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a request's block hashes, in order)."""
        found = []
        if self.enable_caching:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def reachable(self, hashes: list[bytes]) -> int:
        """How many of `hashes`' first blocks are cached, on the device or in the host tier (`restore` them)."""
        n = 0
        if self.enable_caching:
            for h in hashes:
                if h not in self._block_of and h not in self._host:
                    break
                n += 1
        return n

    def restore(self, hashes: list[bytes]) -> list[int]:
        """The device blocks of `hashes` (a prefix `reachable` counted), each one only the host tier holds copied back
        into a free block (taken as a request takes one, a block with no cached contents first; the copy queued for
        `drain_copies`), registered and free: for `allocate(cached=...)`. Shorter where no free block is left to
        copy one into."""
        if not self._host:  # (no host tier, or nothing in it: `reachable` counted device blocks only)
            return [self._block_of[h] for h in hashes]
        keep = {self._block_of[h] for h in hashes if h in self._block_of}
        self._pinned = {self._host[h] for h in hashes if h not in self._block_of and h in self._host}
        blocks: list[int] = []
        try:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    slot = self._host.get(h)
                    if slot is None:
                        break
                    block = self._cache_into_free(h, keep)
                    if block < 0:
                        break
                    if h in self._host_meta:
                        self._meta[h] = self._host_meta[h]
                    self._host.move_to_end(h)
                    self._copy("load", slot, block)
                    self.offload_loaded += 1
                    keep.add(block)
                blocks.append(block)
        finally:
            self._pinned = set()
        return blocks

    def _cache_into_free(self, name: bytes, keep: set[int]) -> int:
        """A free block to hold contents named `name` from elsewhere (the host tier, another engine), taken as a request
        takes one (a block with no cached contents first, else the least recently used free cached one not in `keep`),
        registered under `name`, free and most recently used; -1 where none is free."""
        block = self._bare.find(1)
        if block < 0:
            block = next((b for b in self._lru if self._open[b] and b not in keep), -1)
        if block < 0:
            return -1
        self._forget(block)  # (what it cached goes to the host tier, never into a slot a restore reads)
        self._hash_of[block] = name
        self._block_of[name] = block
        self._bare[block] = 0
        self._lru[block] = None
        return block

    # -- blocks sent between engines (prefill-decode disaggregation: engine/kv_transfer.py) ------------------------

    def prefix_names(self, hashes: list[bytes]) -> list[tuple[int, bytes]]:
        """The blocks a cached prefix of `hashes` is made of, as (position, name) pairs: here a block a hash."""
        return list(enumerate(hashes))

    def adopt(self, names: list[bytes]) -> list[tuple[int, int]]:
        """Blocks for another engine's blocks named `names` (the same model's, `prefix_names`): each name no block here
        holds yet (nor the host tier) gets a free block, registered under it, free and cached, for a request to find
        as a prefix. Returns (index in `names`, block) for the caller to write the contents into before the next pass
        (the runner's `write_blocks`); stops where no free block is left. Blocks of these names already here are
        kept, not taken for others."""
        if not self.enable_caching:
            return []
        keep = {self._block_of[n] for n in names if n in self._block_of}
        taken = []
        for i, name in enumerate(names):
            if name in self._block_of or name in self._host:
                continue
            block = self._cache_into_free(name, keep)
            if block < 0:
                break
            keep.add(block)
            taken.append((i, block))
            if self._journal is not None:
                self._journal.append((True, name))
        return taken

    def drain_copies(self) -> list[tuple[str, list[int], list[int]]]:
        """The copies queued since the last call, in the order they must run: ("save", device blocks, host slots)
        and ("load", host slots, device blocks). The engine's runner makes them before its next pass."""
        copies, self._copies = self._copies, []
        return copies

    def _copy(self, kind: str, source: int, destination: int) -> None:
        if self._copies and self._copies[-1][0] == kind:
            self._copies[-1][1].append(source)
            self._copies[-1][2].append(destination)
        else:
            self._copies.append((kind, [source], [destination]))

    def _offload(self, h: bytes, block: int, meta: Any) -> bool:
        """Keep the contents of `block` (named `h`, about to be forgotten) in the host tier: False where it has no
        slot (every one being read by a `restore`)."""
        if h in self._host:  # (restored from there, and still there: nothing to copy)
            self._host.move_to_end(h)
        else:
            if self._host_free:
                slot = self._host_free.pop()
            else:
                old = next((k for k, v in self._host.items() if v not in self._pinned), None)
                if old is None:
                    return False
                slot = self._host.pop(old)
                self._host_meta.pop(old, None)
                if self._journal is not None and old not in self._block_of:
                    self._journal.append((False, old))
            self._host[h] = slot
            self._copy("save", block, slot)
            self.offload_saved += 1
        if meta is not None:
            self._host_meta[h] = meta
        return True

    @property
    def num_offloaded_blocks(self) -> int:
        """Blocks whose contents the host tier holds."""
        return len(self._host)

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_blocks: int, suffix: bytes = b"") -> None:
        """Register the first `num_blocks` blocks of `request_id`'s table (full, and computed) under `hashes` (each with
        `suffix` appended: a group's names, HybridKVBlockPool). A block whose hash another block already holds stays
        unregistered (both hold the same keys and values)."""
        if not self.enable_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        start = self._registered.get(request_id, 0)
        end = min(num_blocks, len(table), len(hashes))
        for i in range(start, end):
            block, h = table[i], hashes[i] + suffix
            if block == self.null_block:  # (let go of before it was registered: its keys are not kept)
                continue
            if block not in self._hash_of and h not in self._block_of:
                self._hash_of[block] = h
                self._block_of[h] = block
                if self._journal is not None and h not in self._host:
                    self._journal.append((True, h))
        if end > start:
            self._registered[request_id] = end

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def meta(self, h: bytes) -> Any:
        """What was kept with the cached block named `h` (`set_meta`; on the device or in the host tier), or None."""
        return self._meta[h] if h in self._meta else self._host_meta.get(h)

    def set_meta(self, h: bytes, value: Any) -> None:
        """Keep `value` with the cached block named `h` while its contents stay cached (nothing if none is)."""
        if h in self._block_of:
            self._meta[h] = value
        if h in self._host:
            self._host_meta[h] = value

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def cached_hashes(self) -> list[bytes]:
        """The hashes of every block whose contents are cached now (held or free, or in the host tier)."""
        if not self._host:
            return list(self._block_of)
        return list(self._block_of.keys() | self._host.keys())

    def track_changes(self) -> None:
        """From now on, remember which hashes are registered and forgotten, for `drain_changes` (an engine process
        tells its replica what it has cached, which routes requests by it)."""
        self._journal = [(True, h) for h in self.cached_hashes()]

    def drain_changes(self) -> list[tuple[bool, bytes]]:
        """What changed since the last call, in order: (True, hash) registered, (False, hash) forgotten."""
        journal = self._journal or []
        if self._journal is not None:
            self._journal = []
        return journal

    def _forget(self, block: int, *, keep: bool = True) -> None:
        """`block`'s contents are no longer cached on the device (it is taken to be written): kept in the host tier
        where there is one (`keep`), else forgotten."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            meta = self._meta.pop(h, None)
            self._lru.pop(block, None)
            if keep and self.offload_blocks and self._offload(h, block, meta):
                return
            if self._journal is not None and h not in self._host:
                self._journal.append((False, h))

    def forget_cached(self) -> int:
        """Forget the contents of every cached block no request holds (later lookups miss them); how many. An engine
        does this when a name its hashes are salted with comes to stand for other weights (an adapter loaded on
        demand that was replaced at its root: engine/adapters.py), and so does one whose weights are replaced. The host
        tier's contents are forgotten too (counted)."""
        blocks = [b for b in self._hash_of if not self._refs[b]]
        hosted = list(self._host)
        self._host.clear()
        self._host_meta.clear()
        self._host_free = list(range(self.offload_blocks - 1, -1, -1))
        for block in blocks:
            self._forget(block, keep=False)
            if self._open[block]:
                self._bare[block] = 1
        if self._journal is not None:
            self._journal.extend((False, h) for h in hosted if h not in self._block_of)
        return len(blocks) + len(hosted)

    # -- allocation -----------------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, *, reserve_tokens: int = 0, cached: list[int] = ()) -> bool:
        """Grow `request_id`'s table to hold `num_tokens` tokens. All or nothing: False (and nothing taken)
        when the pool has too few free blocks. `reserve_tokens`: how long the request is expected to grow (its
        prompt plus max_tokens), used to place a new table where it has room to grow (see the module's docs).
        `cached`: for a request that holds no blocks yet, the cached blocks (`lookup`) its table starts with."""
        if self._need(request_id, num_tokens, cached) > self._num_free:
            return False
        self._grow(request_id, num_tokens, reserve_tokens, cached)
        return True

    def _need(self, owner: str, num_tokens: int, cached: list[int], skip: int = 0) -> int:
        """The free blocks `_grow` would take: its own new ones and the free cached ones it starts with."""
        table = self._tables.get(owner)
        if table:
            return max(self.blocks_for(num_tokens) - len(table), 0)
        shared_free = sum(1 for b in cached if not self._refs[b])
        return max(self.blocks_for(num_tokens) - skip - len(cached), 0) + shared_free

    def _grow(self, owner: str, num_tokens: int, reserve_tokens: int, cached: list[int], skip: int = 0) -> None:
        """`allocate`'s taking, the room checked. `skip`: a new table's first `skip` places are let go of already (the
        null block's: a windowed group's, before its window; HybridKVBlockPool), `cached` after them."""
        table = self._tables.get(owner)
        if table:
            cached, skip = (), 0
        if table is None:
            table = self._tables[owner] = [self.null_block] * skip if skip else []
            if skip:
                self._trimmed[owner] = skip
        for block in cached:
            self._hold(block)
            table.append(block)
        if cached or skip:
            self._registered[owner] = skip + len(cached)
        missing = self.blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return
        if len(table) == skip + len(cached):  # no block of its own yet: place them
            expected = self.blocks_for(reserve_tokens) - len(table)
            if self._place(owner, table, missing, expected):
                return
        for _ in range(missing):
            after = table[-1] + 1 if table else self.num_blocks
            if after < self.num_blocks and self._free[after] and self._next_is_mine(owner, after):
                block = after
            else:
                block = self._bare.find(1)
                if block < 0:
                    block = next((b for b in self._lru if self._open[b]), -1)
                if block < 0:  # only set-aside blocks are left: take one all the same
                    block = self._free.find(1)
            self._take(owner, table, block)

    def _next_is_mine(self, request_id: str, block: int) -> bool:
        """Whether a growing request takes the free `block` right after its last one: when it was set aside for it,
        or is neither set aside for another nor holding cached contents (those go least recently used first)."""
        owner = self._aside_for.get(block)
        return owner == request_id or (owner is None and block not in self._hash_of)

    def _place(self, request_id: str, table: list[int], need: int, expected: int) -> bool:
        """A new table's first own `need` blocks as the lowest open run that also fits its `expected` length (the
        rest set aside for it), or else the lowest open run of `need`, bare blocks preferred, cached ones only among
        the least recently used (`_cold`); False when there is no such run."""
        want = min(max(need, expected), need + RESERVE_MAX_BLOCKS)
        start = -1
        for size in (want, need) if want > need else (need,):
            start = self._bare.find(b"\x01" * size)
            if start < 0 and self._lru:
                start = self._cold(size).find(b"\x01" * size)
            if start >= 0:
                want = size
                break
        if start < 0:
            return False
        for block in range(start, start + need):
            self._take(request_id, table, block)
        if want > need:
            self._aside[request_id] = aside = range(start + need, start + want)
            for block in aside:
                self._aside_for[block] = request_id
                self._open[block] = self._bare[block] = 0
        return True

    def _cold(self, size: int) -> bytearray:
        """The open blocks a new run of `size` may take: bare ones, and cached ones among the `COLD_RUN_FACTOR x size`
        least recently used. A run is taken for speed (attention reads a sequence's blocks in one run faster), never
        at the cost of a prefix used lately: with the cache full, the lowest open run would often hold a chat's
        prefix that least-recently-used order keeps (its next turn would compute it again)."""
        cold = bytearray(self._bare)
        for block in islice(self._lru, COLD_RUN_FACTOR * size):
            if self._open[block]:
                cold[block] = 1
        return cold

    def _hold(self, block: int) -> None:
        """One more request holds `block` (its contents kept)."""
        if not self._refs[block]:
            self._free[block] = self._open[block] = self._bare[block] = 0
            self._num_free -= 1
            self._lru.pop(block, None)
            self._aside_for.pop(block, None)
        self._refs[block] += 1

    def _take(self, request_id: str, table: list[int], block: int) -> None:
        """`block` (free) becomes `request_id`'s own, to write: whatever it cached is forgotten."""
        self._forget(block)
        self._hold(block)
        table.append(block)

    def set_window(self, null_block: int) -> None:
        """The model attends within a sliding window in every layer: tables may let go of the blocks before it
        (`trim`), `null_block` (an id past the pool's, whose keys and values the window's mask hides) standing in
        their place, so that positions keep their blocks' indices."""
        self.null_block = null_block

    def trim(self, request_id: str, position: int) -> int:
        """Let go of `request_id`'s blocks wholly before `position` (its queries from there on see no key before
        it: the window's start), as `free` lets go of them (cached contents kept until needed), the null block in
        their place; never its last block. Returns how many it let go of now."""
        table = self._tables.get(request_id)
        if self.null_block is None or not table:
            return 0
        start = self._trimmed.get(request_id, 0)
        end = min(position // self.block_size, len(table) - 1)
        for i in range(start, end):
            self._release(table[i])
            table[i] = self.null_block
        if end > start:
            self._trimmed[request_id] = end
        return max(end - start, 0)

    def held_blocks(self, request_id: str) -> int:
        """The blocks `request_id` holds (its table's, less those `trim` let go of)."""
        return len(self._tables.get(request_id, ())) - self._trimmed.get(request_id, 0)

    def _release(self, block: int) -> None:
        """One request fewer holds `block`; held by none, it is free (its cached contents kept until needed)."""
        self._refs[block] -= 1
        if self._refs[block]:
            return
        self._free[block] = self._open[block] = 1
        self._num_free += 1
        if block in self._hash_of:
            self._lru[block] = None
        else:
            self._bare[block] = 1

    def free(self, request_id: str) -> None:
        """Let go of every block `request_id` holds, and those set aside for it (nothing if it holds none). Blocks
        no request holds any more are free; those with cached contents keep them until they are needed, the last of
        a table first (a later request shares a prefix from its start)."""
        self._registered.pop(request_id, None)
        trimmed = self._trimmed.pop(request_id, 0)
        for block in reversed(self._tables.pop(request_id, [])[trimmed:]):
            self._release(block)
        for block in self._aside.pop(request_id, ()):
            if self._aside_for.get(block) == request_id:  # still free and still its: open to all again
                del self._aside_for[block]
                self._open[block] = 1
                self._bare[block] = block not in self._hash_of

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, those with cached contents among them."""
        return self._num_free

    @property
    def utilization(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return 1.0 - self._num_free / self.num_blocks


class HybridKVBlockPool(KVBlockPool):
    """A pool for a model whose windowed layers mix with full ones (Gemma 2 and 3, gpt-oss, Cohere 2, OLMo 3, Llama 4's
    chunks; vLLM's hybrid KV cache manager): its layers in groups of one kind (`families.kv_groups`), each group with a
    block table of its own drawn from the one pool of block ids, a block id standing for one group's share of layers
    (the runner's tensors are shared across groups). A request's tables grow together; a windowed group's lets go of
    the blocks before its window (`trim`), the full groups' hold the whole context. So a sequence far past the window
    holds its context's blocks in the full groups and its window's in the windowed ones, not its context's in every
    layer.

    The scheduler sees one request as before: `allocate`, `trim`, `free` and the prefix cache act on all its groups'
    tables at once. Each group registers its blocks under its own names (the request's hashes, the group's index
    appended past group 0), so routing hears group 0's only. A cached prefix of k blocks (`reachable`, `restore`) is
    the full groups' first k blocks and the windowed groups' blocks from that of the first key position k *
    block_size sees to k (what its next queries read): a windowed group's blocks before are not needed, and a prefix is
    found though they were let go of. `restore` returns one tuple of block ids a block (a windowed group's null block
    where it needs none), which `allocate(cached=...)` takes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: list,
        *,
        enable_caching: bool = False,
        offload_blocks: int = 0,
    ):
        super().__init__(num_blocks, block_size, enable_caching=enable_caching, offload_blocks=offload_blocks)
        self.windows = list(windows)  # each group's window (None: a full group), full groups first
        self.window = next(w for w in self.windows if w is not None)
        self._owner_names: dict[str, list[str]] = {}

    def _owners(self, request_id: str) -> list[str]:
        """The names `request_id`'s groups' tables go by in the pool (group 0's is its own), kept from its first
        `allocate` to its `free`."""
        owners = self._owner_names.get(request_id)
        if owners is None:
            owners = [request_id] + [f"{request_id}\x00{g}" for g in range(1, len(self.windows))]
        return owners

    @staticmethod
    def _named(h: bytes, group: int) -> bytes:
        return h + bytes((group,)) if group else h

    def _first(self, num_blocks: int) -> int:
        """The first block a windowed group needs of a cached prefix of `num_blocks` blocks."""
        return first_key(self.window, num_blocks * self.block_size) // self.block_size

    def _needed(self, num_blocks: int) -> list[tuple[int, int]]:
        """(block index, group) pairs a prefix of `num_blocks` blocks needs, by position, then group."""
        first = self._first(num_blocks)
        return [(i, g) for i in range(num_blocks) for g, w in enumerate(self.windows) if w is None or i >= first]

    def _held(self, h: bytes) -> bool:
        return h in self._block_of or h in self._host

    def prefix_names(self, hashes: list[bytes]) -> list[tuple[int, bytes]]:
        """The blocks a cached prefix of `hashes` is made of: the full groups' every block's, the windowed groups' those
        its next queries read (`_needed`), each named for its group."""
        return [(i, self._named(hashes[i], g)) for i, g in self._needed(len(hashes))]

    def reachable(self, hashes: list[bytes]) -> int:
        """How many of `hashes`' first blocks a request may start with: the full groups' cached up to there (on the
        device or in the host tier), and the windowed groups' blocks its queries from there read."""
        if not self.enable_caching:
            return 0
        full = [g for g, w in enumerate(self.windows) if w is None]
        n = 0
        while n < len(hashes) and all(self._held(self._named(hashes[n], g)) for g in full):
            n += 1
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        for k in range(n, 0, -1):
            if all(self._held(self._named(hashes[i], g)) for i in range(self._first(k), k) for g in windowed):
                return k
        return 0

    def restore(self, hashes: list[bytes]) -> list[tuple[int, ...]]:
        """`reachable`'s prefix of `hashes`, a tuple of each group's block a position (the null block where a windowed
        group needs none), those only the host tier holds copied back (`KVBlockPool.restore`, in one call: no block
        of the prefix is taken for another of it). Shorter where no free block is left to copy one into."""
        needed = self._needed(len(hashes))
        blocks = super().restore([self._named(hashes[i], g) for i, g in needed])
        got: dict[tuple[int, int], int] = dict(zip(needed, blocks))
        if len(blocks) < len(needed):  # (copied back as far as a position's every group: fewer positions)
            k = needed[len(blocks)][0]
            while k and any((i, g) not in got for i, g in self._needed(k)):
                k -= 1
            hashes = hashes[:k]
        first = self._first(len(hashes))
        return [
            tuple(got[i, g] if w is None or i >= first else self.null_block for g, w in enumerate(self.windows))
            for i in range(len(hashes))
        ]

    def allocate(self, request_id: str, num_tokens: int, *, reserve_tokens: int = 0, cached: list = ()) -> bool:
        """Grow every group's table of `request_id` to hold `num_tokens` tokens, all or nothing across them. `cached`:
        `restore`'s tuples, for a request that holds no blocks yet."""
        owners = self._owner_names[request_id] = self._owners(request_id)
        starts = [self._start(cached, g) for g in range(len(owners))]
        if sum(self._need(o, num_tokens, c, skip) for o, (skip, c) in zip(owners, starts)) > self._num_free:
            return False
        for owner, (skip, c) in zip(owners, starts):
            self._grow(owner, num_tokens, reserve_tokens, c, skip)
        return True

    def _start(self, cached: list, group: int) -> tuple[int, list[int]]:
        """Group `group`'s part of `cached`: how many places it skips (the null block's), then its blocks."""
        column = [c[group] for c in cached]
        skip = 0
        while skip < len(column) and column[skip] == self.null_block:
            skip += 1
        return skip, column[skip:]

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_blocks: int, suffix: bytes = b"") -> None:
        for g, owner in enumerate(self._owners(request_id)):
            super().cache_blocks(owner, hashes, num_blocks, self._named(suffix, g))

    def trim(self, request_id: str, position: int) -> int:
        """Let go of each windowed group's blocks wholly before `position` (`KVBlockPool.trim`)."""
        owners = self._owners(request_id)
        return sum(
            super(HybridKVBlockPool, self).trim(o, position) for o, w in zip(owners, self.windows) if w is not None
        )

    def held_blocks(self, request_id: str) -> int:
        return sum(super(HybridKVBlockPool, self).held_blocks(o) for o in self._owners(request_id))

    def free(self, request_id: str) -> None:
        for owner in self._owners(request_id):
            super().free(owner)
        self._owner_names.pop(request_id, None)

    def group_tables(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block table of `request_id`, in the groups' order (the first is `block_table`'s)."""
        return tuple(self._tables.get(o, []) for o in self._owners(request_id))

    def cached_hashes(self) -> list[bytes]:
        """Group 0's cached hashes: what a request's hashes are (routing)."""
        return [h for h in super().cached_hashes() if len(h) == DIGEST_BYTES]

    def drain_changes(self) -> list[tuple[bool, bytes]]:
        return [(added, h) for added, h in super().drain_changes() if len(h) == DIGEST_BYTES]
