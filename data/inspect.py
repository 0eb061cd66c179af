"""Inspecting a prepared dataset: its manifest, and on request every shard checked against it
(`pylon data inspect URI [--verify]`).

Verification reports every problem, each naming its shard, rather than stopping at the first: someone
repairing a dataset wants the whole list in one pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from pylon import storage
from pylon.data.shards import (
    BadShardError,
    ShardInfo,
    ShardManifest,
    decode_records,
    decode_shard,
    read_manifest,
    verify_shard_bytes,
)
from pylon.errors import StorageError

# Shards read at once: reads from object storage are latency-bound; four keep memory at four shards.
_PARALLEL_READS = 4


def inspect(uri: str, verify: bool = False, *, progress: bool = True) -> tuple[ShardManifest, list[str]]:
    """The dataset's manifest and, with `verify`, every problem found in its shards (empty: all good).

    Each shard is read whole and checked for size and sha256, then decoded and checked against its manifest
    entry (rows, ids, tokens); its records file too, when it has one (size, sha256, a line per row). A missing or
    unreadable manifest is a DataError, not a problem in the list.
    """
    manifest = read_manifest(uri)
    if not verify:
        return manifest, []
    problems: list[str] = []
    with (
        ThreadPoolExecutor(_PARALLEL_READS) as pool,
        tqdm(
            total=len(manifest.shards),
            unit="shard",
            desc="verifying",
            dynamic_ncols=True,
            disable=None if progress else True,
        ) as bar,
    ):
        for found in pool.map(lambda info: _shard_problem(uri, manifest, info), manifest.shards):
            if found:
                problems.append(found)
            bar.update(1)
    return manifest, problems


def _shard_problem(uri: str, manifest: ShardManifest, info: ShardInfo) -> str | None:
    try:
        data = storage.read_bytes(storage.join(uri, info.file))
    except StorageError as e:
        return f"shard {info.file}: cannot be read ({e})"
    try:
        verify_shard_bytes(info, data)
        rows = decode_shard(manifest.format, data, shard=info.file, seq_len=manifest.seq_len, dtype=manifest.dtype)
        _check_rows(info, rows.ids, rows.num_tokens)
    except BadShardError as e:
        return str(e)
    if info.records is not None:  # the source records' other fields, per row (`shards.RecordsInfo`)
        try:
            decode_records(storage.read_bytes(storage.join(uri, info.records.file)), info=info)
        except StorageError as e:
            return f"records file {info.records.file}: cannot be read ({e})"
        except BadShardError as e:
            return str(e)
    return None


def _check_rows(info: ShardInfo, ids: np.ndarray, num_tokens: np.ndarray) -> None:
    """A shard whose bytes match can still disagree with its entry if the manifest was edited by hand."""
    if len(ids) != info.rows:
        raise BadShardError(info.file, f"{len(ids)} rows, manifest says {info.rows}")
    if not np.array_equal(ids, np.arange(info.first_id, info.first_id + info.rows)):
        raise BadShardError(info.file, f"ids are not {info.first_id}..{info.first_id + info.rows - 1} in order")
    if int(num_tokens.sum()) != info.tokens:
        raise BadShardError(info.file, f"{int(num_tokens.sum())} tokens, manifest says {info.tokens}")
