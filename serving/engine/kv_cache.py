"""The KV cache's memory, in fixed-size blocks: which blocks are free and which request holds which.

The pool hands out block *ids*; the tensors they index live in the model runner (one K and one V tensor per layer,
`[kv_heads, num_blocks, block_size, head_dim]`). A request's block table lists its blocks in order, so token position
p lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are never shared between requests (no
prefix caching), so freeing a request returns all of its blocks.

Where blocks go matters on a CPU: every decode step reads every live block, and a sequence whose blocks lie one after
another is read much faster than a scattered one (the hardware prefetchers follow a run). So the pool keeps each
request's blocks in one run where it can:

- a request's first blocks are the lowest run of free blocks long enough for its whole expected length
  (`reserve_tokens`: prompt plus max_tokens, capped at `RESERVE_MAX_BLOCKS` beyond what it needs now); the rest of
  the run is set aside for it;
- a growing request takes the block right after its last one where that block is free and not set aside for another
  request; otherwise the lowest free block no one has set aside;
- set-aside blocks are still free: when nothing else is free, any request takes them. Capacity, `allocate`'s
  all-or-nothing answer and preemption are as if nothing were set aside.

Lowest first also keeps the live blocks packed at the start of the pool however many requests come and go.
"""

from __future__ import annotations

RESERVE_MAX_BLOCKS = 64  # at most this many blocks set aside beyond what a request needs when it starts


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One byte per block, so that runs are found by bytes.find (C speed) rather than a Python loop.
        self._free = bytearray(b"\x01") * num_blocks  # held by no request
        self._open = bytearray(b"\x01") * num_blocks  # free and set aside for no request
        self._num_free = num_blocks
        self._tables: dict[str, list[int]] = {}
        self._aside: dict[str, range] = {}  # request -> the run set aside for it when it was placed
        self._aside_for: dict[int, str] = {}  # block -> the request it is still set aside for (while free)

    @classmethod
    def for_tokens(cls, kv_cache_tokens: int, block_size: int) -> "KVBlockPool":
        return cls(kv_cache_tokens // block_size, block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_tokens: int, *, reserve_tokens: int = 0) -> bool:
        """Grow `request_id`'s table to hold `num_tokens` tokens. All or nothing: False (and nothing taken)
        when the pool has too few free blocks. `reserve_tokens`: how long the request is expected to grow (its
        prompt plus max_tokens), used to place a new table where it has room to grow (see the module's docs)."""
        table = self._tables.get(request_id)
        missing = self.blocks_for(num_tokens) - (len(table) if table else 0)
        if missing > self._num_free:
            return False
        if table is None:
            table = self._tables[request_id] = []
        if missing <= 0:
            return True
        if not table and self._place(request_id, table, missing, self.blocks_for(reserve_tokens)):
            return True
        for _ in range(missing):
            after = table[-1] + 1 if table else self.num_blocks
            if after < self.num_blocks and self._free[after] and self._aside_for.get(after, request_id) == request_id:
                block = after
            else:
                block = self._open.find(1)
                if block < 0:  # only set-aside blocks are left: take one all the same
                    block = self._free.find(1)
            self._take(request_id, table, block)
        return True

    def _place(self, request_id: str, table: list[int], need: int, expected: int) -> bool:
        """A new table's first `need` blocks as the lowest open run that also fits its `expected` length (the
        rest set aside for it), or else the lowest open run of `need`; False when there is no open run of `need`."""
        want = min(max(need, expected), need + RESERVE_MAX_BLOCKS)
        start = self._open.find(b"\x01" * want) if want > need else -1
        if start < 0:
            want = need
            start = self._open.find(b"\x01" * need)
            if start < 0:
                return False
        for block in range(start, start + need):
            self._take(request_id, table, block)
        if want > need:
            self._aside[request_id] = aside = range(start + need, start + want)
            for block in aside:
                self._aside_for[block] = request_id
                self._open[block] = 0
        return True

    def _take(self, request_id: str, table: list[int], block: int) -> None:
        self._free[block] = self._open[block] = 0
        self._num_free -= 1
        table.append(block)
        self._aside_for.pop(block, None)  # taken by its owner, or by another when nothing else was free

    def free(self, request_id: str) -> None:
        """Return every block `request_id` holds, and those set aside for it (nothing if it holds none)."""
        for block in self._tables.pop(request_id, ()):
            self._free[block] = self._open[block] = 1
            self._num_free += 1
        for block in self._aside.pop(request_id, ()):
            if self._aside_for.get(block) == request_id:  # still free and still its: open to all again
                del self._aside_for[block]
                self._open[block] = 1

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def utilization(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return 1.0 - self._num_free / self.num_blocks
