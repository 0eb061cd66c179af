"""Small prepared datasets written straight through the shard codec, for tests and benchmarks.

Real shards and a real manifest (the same `encode_shard` and manifest model `prepare` uses), with
synthetic tokens whose values encode their sample id, so a reader's output can be checked exactly.
"""

from __future__ import annotations

import uuid

import numpy as np

from pylon import storage
from pylon.data.shards import (
    SHARD_SUFFIX,
    ShardInfo,
    ShardManifest,
    ShardRows,
    TokenizerInfo,
    Totals,
    encode_shard,
    manifest_uri,
    sha256_hex,
)


def synthetic_tokens(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Token t of sample i is a hash of (i, t) mod 256: distinct per sample, checkable after any reordering,
    and as hard to compress as real byte-level text (so benchmarks do not flatter the decoder)."""
    x = ids.astype(np.uint64)[:, None] * np.uint64(1_000_003) + np.arange(seq_len, dtype=np.uint64)[None, :]
    x ^= x >> np.uint64(13)
    x *= np.uint64(0x5BD1E995)
    x ^= x >> np.uint64(15)
    return (x % np.uint64(256)).astype(np.uint16)


def write_synthetic_dataset(
    uri: str,
    *,
    rows: int,
    rows_per_shard: int,
    seq_len: int = 16,
    fmt: str = "parquet",
    tokens: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> ShardManifest:
    """A prepared dataset of `rows` rows of `seq_len` tokens: `synthetic_tokens`, or the given `tokens`
    ([rows, seq_len], padding past each row's `lengths`, all of them by default)."""
    run_id = uuid.uuid4().hex
    shards = []
    for index, first in enumerate(range(0, rows, rows_per_shard)):
        ids = np.arange(first, min(rows, first + rows_per_shard), dtype=np.int64)
        if lengths is None:
            num_tokens = np.full(len(ids), seq_len, np.int32)
        else:
            num_tokens = np.asarray(lengths[ids], np.int32)
        rows_tokens = synthetic_tokens(ids, seq_len) if tokens is None else tokens[ids]
        data = encode_shard(fmt, ShardRows(ids, num_tokens, rows_tokens))
        name = f"part-{run_id[:8]}-{index:05d}{SHARD_SUFFIX[fmt]}"
        storage.atomic_write(storage.join(uri, name), data)
        shards.append(
            ShardInfo(
                file=name,
                rows=len(ids),
                tokens=int(num_tokens.sum()),
                bytes=len(data),
                sha256=sha256_hex(data),
                first_id=first,
            )
        )
    manifest = ShardManifest(
        format=fmt,
        seq_len=seq_len,
        dtype="uint16",
        tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=320, eos_id=256, pad_id=257),
        shards=shards,
        totals=Totals(
            documents=rows, rows=rows, tokens=sum(s.tokens for s in shards), bytes=sum(s.bytes for s in shards)
        ),
        sources=["synthetic"],
        run_id=run_id,
    )
    storage.atomic_write_json(manifest_uri(uri), manifest.model_dump(mode="json"))
    return manifest
