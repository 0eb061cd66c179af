"""The KV cache's memory, in fixed-size blocks: which blocks are free and which request holds which.

The pool hands out block *ids*; the tensors they index live in the model runner (one K and one V tensor
per layer, `[num_blocks, block_size, n_kv_heads, head_dim]`). A request's block table lists its blocks in
order, so token position p lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are
never shared between requests (no prefix caching), so freeing a request returns all of its blocks.

Free blocks are handed out lowest id first (a min-heap), so the blocks in use stay packed at the start of the
pool however many requests come and go. The pool was a FIFO queue before (a freed block went to the back): after
a few hundred requests the live blocks lay scattered over the whole pool (hundreds of MB in float32), and a
single-threaded engine on a CPU ran each run of 64 requests (the serving bench's default workload, one engine's
share) slower than the one before: 3.5, 3.8, 3.9, 4.1 s, where lowest-first held 3.3-3.4 s (decode attention reads
every live block at every step, and it reads a packed region faster than a scattered one; transparent huge pages
for the pool changed nothing, so it is not the TLB). `bench/serve_load.py`'s docs/benchmarks.md entry has the runs.
"""
from __future__ import annotations

import heapq


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a min-heap (sorted is a valid heap)
        self._tables: dict[str, list[int]] = {}

    @classmethod
    def for_tokens(cls, kv_cache_tokens: int, block_size: int) -> "KVBlockPool":
        return cls(kv_cache_tokens // block_size, block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow `request_id`'s table to hold `num_tokens` tokens. All or nothing: False (and nothing taken)
        when the pool has too few free blocks."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        for _ in range(missing):
            table.append(heapq.heappop(self._free))
        return True

    def free(self, request_id: str) -> None:
        """Return every block `request_id` holds (nothing if it holds none)."""
        for block in self._tables.pop(request_id, ()):
            heapq.heappush(self._free, block)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def utilization(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks
