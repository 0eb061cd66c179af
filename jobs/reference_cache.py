"""Precomputed reference log-probabilities (`TrainJobSpec.precompute_reference`; TRL's `precompute_ref_log_probs`):
objective dpo's reference is read once, before the first step, for every document of the dataset, and then let go,
so that training holds no frozen copy of the model (its weights' bytes again, in the training precision) and runs no
reference pass a micro-batch.

Each rank reads an equal, contiguous part of the dataset's rows (`rank_rows`) straight from the shards (their size
and sha256 checked), a micro-batch at a time, through the reference as the training loop would (`pylon.jobs.dpo.
reference_logprobs`: the frozen copy, or with LoRA the model with its adapters disabled), every rank taking the same
number of passes (ZeRO-3 gathers collectively; a rank with fewer rows passes padding). The values go to the run's
directory, one part a rank (`reference_logprobs/rank-00000.npz`: row ids, documents a row, each document's value),
committed by a manifest rank 0 writes once every part is there; every rank then loads all parts (a float a
document). A resumed run finds the committed table for the same dataset (its `run_id`) and reads it instead.
`ReferenceTable.lookup` gives a batch's values in its rows' document order, as the reference pass would have.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass

import numpy as np

from pylon import storage
from pylon.data.reader import Batch
from pylon.data.shards import DataError, decode_shard, verify_shard_bytes

CACHE_DIR = "reference_logprobs"
MANIFEST = "manifest.json"


@dataclass
class ReferenceTable:
    """Each row's documents' reference values (summed log-probabilities, or their tokens' mean: `DpoLoss.mean`)."""

    rows: dict[int, np.ndarray]

    def lookup(self, sample_ids, device) -> tuple:
        """(the rows' documents' values [documents] float32, documents a row [rows] int64), in row order: what
        `pylon.jobs.dpo.reference_logprobs` returns for the same rows."""
        import torch

        parts = [self.rows[int(i)] for i in np.asarray(sample_ids).tolist()]
        values = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        counts = np.asarray([len(p) for p in parts], dtype=np.int64)
        return torch.from_numpy(values).to(device), torch.from_numpy(counts).to(device)


def rank_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous part [lo, hi) of `total` rows: equal to within one."""
    return rank * total // world, (rank + 1) * total // world


def _read_table(cache: str, manifest, mean: bool) -> ReferenceTable | None:
    """The committed table in `cache`, if it is `manifest`'s dataset's, of the same values (`mean`: each document's
    tokens' mean rather than their sum), and holds every row; else None."""
    uri = storage.join(cache, MANIFEST)
    if not storage.exists(uri):
        return None
    meta = storage.read_json(uri)
    if not _matches(meta, manifest, mean):
        return None
    rows: dict[int, np.ndarray] = {}
    for part in meta["parts"]:
        with np.load(io.BytesIO(storage.read_bytes(storage.join(cache, part))), allow_pickle=False) as data:
            ids, counts, values = data["ids"], data["counts"], data["values"]
        for row_id, piece in zip(ids.tolist(), np.split(values, np.cumsum(counts)[:-1]) if len(ids) else []):
            rows[row_id] = piece
    if len(rows) != manifest.totals.rows:
        raise DataError(f"{cache}: {len(rows)} rows' reference values, the dataset has {manifest.totals.rows}")
    return ReferenceTable(rows)


def committed(run_uri: str, manifest, loss) -> bool:
    """Whether the run's directory holds a committed table for `manifest`'s dataset and `loss`'s values (a resumed
    run then builds no reference at all)."""
    uri = storage.join(run_uri, CACHE_DIR, MANIFEST)
    if not storage.exists(uri):
        return False
    return _matches(storage.read_json(uri), manifest, bool(loss.mean))


def _matches(meta: dict, manifest, mean: bool) -> bool:
    """Whether a table's manifest `meta` is `manifest`'s dataset's (its run_id and rows), of the same values."""
    return (meta.get("dataset_run_id"), meta.get("rows"), meta.get("mean")) == (
        manifest.run_id,
        manifest.totals.rows,
        mean,
    )


def precompute(
    reference,
    module,
    data_uri: str,
    manifest,
    run_uri: str,
    *,
    rank: int,
    world: int,
    micro_batch_size: int,
    device,
    loss,
    model_inputs,
    padding,
) -> tuple[ReferenceTable, float, bool]:
    """The dataset's reference table (see the module's docstring): (the table, seconds it took, whether a committed
    one was read). `padding()` gives an all-padding micro-batch's inputs (a rank with fewer rows passes it)."""
    import torch
    import torch.distributed as dist

    from pylon.jobs.dpo import reference_logprobs

    t0 = time.perf_counter()
    cache = storage.join(run_uri, CACHE_DIR)
    found = _read_table(cache, manifest, bool(loss.mean))
    if found is not None:
        return found, time.perf_counter() - t0, True
    tok = manifest.tokenizer
    lo, hi = rank_rows(manifest.totals.rows, rank, world)
    ids, counts, values = [], [], []
    pending: list = []  # (ids, tokens, num_tokens) slices not yet passed

    def run(parts) -> None:
        if parts:
            batch = Batch(
                np.concatenate([p[0] for p in parts]),
                np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]),
                0.0,
                manifest.loss_mask,
                tok.eos_id,
            )
            inputs = batch.to_torch(tok.pad_id, device=device, documents=True)
        else:
            inputs = padding()
        positions = inputs.get("position_ids", torch.zeros_like(inputs["labels"]))
        vals, per_row = reference_logprobs(reference, module, model_inputs(inputs), inputs["labels"], positions, loss)
        if parts:
            ids.append(batch.sample_ids)
            counts.append(per_row.cpu().numpy())
            values.append(vals.float().cpu().numpy())

    passes = 0
    for shard in manifest.shards:
        first, last = max(lo, shard.first_id), min(hi, shard.first_id + shard.rows)
        if first >= last:
            continue
        data = storage.read_bytes(storage.join(data_uri, shard.file))
        verify_shard_bytes(shard, data)
        rows = decode_shard(manifest.format, data, shard=shard.file, seq_len=manifest.seq_len, dtype=manifest.dtype)
        at, end = first - shard.first_id, last - shard.first_id
        while at < end:  # micro-batches of exactly micro_batch_size rows, across shards' ends
            take = min(micro_batch_size - sum(len(p[0]) for p in pending), end - at)
            pending.append((rows.ids[at : at + take], rows.tokens[at : at + take], rows.num_tokens[at : at + take]))
            at += take
            if sum(len(p[0]) for p in pending) == micro_batch_size:
                run(pending)
                pending, passes = [], passes + 1
    if pending:
        run(pending)
        passes += 1
    most = math.ceil(math.ceil(manifest.totals.rows / world) / micro_batch_size)  # (rank parts differ by one row)
    for _ in range(most - passes):
        run([])  # (ZeRO-3: every rank the same passes)
    part = f"rank-{rank:05d}.npz"
    sink = io.BytesIO()
    np.savez(
        sink,
        ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
        counts=np.concatenate(counts) if counts else np.zeros(0, np.int64),
        values=np.concatenate(values) if values else np.zeros(0, np.float32),
    )
    storage.atomic_write(storage.join(cache, part), sink.getvalue())
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:  # the commit: every part is written
        storage.atomic_write_json(
            storage.join(cache, MANIFEST),
            {
                "dataset_run_id": manifest.run_id,
                "rows": manifest.totals.rows,
                "mean": bool(loss.mean),
                "parts": [f"rank-{r:05d}.npz" for r in range(world)],
            },
        )
    if dist.is_initialized():
        dist.barrier()
    table = _read_table(cache, manifest, bool(loss.mean))
    return table, time.perf_counter() - t0, False
