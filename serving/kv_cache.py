"""The KV cache's memory, in fixed-size blocks: which blocks are free and which request holds which.

The pool hands out block *ids*; the tensors they index live in the model runner (one K and one V tensor
per layer, `[num_blocks, block_size, n_kv_heads, head_dim]`). A request's block table lists its blocks in
order, so token position p lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are
never shared between requests (no prefix caching), so freeing a request returns all of its blocks.
"""
from __future__ import annotations

from collections import deque


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a freed block goes to the back, which spreads writes and makes use-after-free bugs
        # show up as wrong outputs in tests rather than hiding behind the same block being handed back.
        self._free: deque[int] = deque(range(num_blocks))
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
            table.append(self._free.popleft())
        return True

    def free(self, request_id: str) -> None:
        """Return every block `request_id` holds (nothing if it holds none)."""
        self._free.extend(self._tables.pop(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def utilization(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks
