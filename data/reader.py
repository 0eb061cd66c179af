"""Streaming prepared shards into training: deterministic, exactly once per epoch, resumable to the sample.

Each Ray Train worker builds its own Ray Data stream over the shards it owns this epoch:

1. **Epoch plan** (`epoch_plan`): every worker computes the same plan from the manifest, the seed and the
   epoch. Shards are permuted (seeded by seed and epoch), their rows laid end to end, and worker r of W
   owns the contiguous range [r*T/W, (r+1)*T/W) of that sequence. Every sample is in exactly one worker's
   range, and a worker touches only ~1/W of the shards (plus at most two it shares with a neighbour).
2. **Reading** (`ShardDatasource`): a Ray Data `FileBasedDatasource` reads each owned shard in a read task
   through the right pyarrow filesystem (local or s3), checks its size and sha256 against the manifest,
   decodes it and streams it on in order (`preserve_order`), with Ray Data's prefetching and backpressure.
3. **Shuffle windows**: the worker's sequence is cut into windows of `shuffle_buffer` rows; each window is
   permuted by a generator seeded by (seed, epoch, rank, window). Unlike a sliding shuffle buffer, a window
   is a pure function of its index, so a position (epoch, window, offset) is enough to resume exactly:
   the stream restarts at that window's first shard, with nothing replayed and nothing skipped.

Why not `get_dataset_shard`/`streaming_split`: it hands blocks to whichever worker asks first, so which
samples a worker sees depends on timing and a resumed run cannot continue where the first one stopped.
The stream here is what a worker's `get_dataset_shard` iterator would be, made deterministic.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from pylon import home, storage
from pylon.data.shards import (
    BadShardError,
    DataError,
    ShardInfo,
    ShardManifest,
    decode_records,
    decode_shard_table,
    read_manifest,
    split_words,
    verify_shard_bytes,
)
from pylon.errors import StorageError

log = logging.getLogger(__name__)

POSITION_VERSION = 1
_SKIP_HINT = " (set data.on_bad_shard: skip to skip such shards)"


# ---------------------------------------------------------------------------------------------------------
# The plan: which rows each worker reads, in which order
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Rows with ids in [lo, hi) of one shard, taken in id order; `start` is their plan position."""

    shard: int
    lo: int
    hi: int
    start: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def split_ids(manifest: ShardManifest, validation_fraction: float) -> dict[str, tuple[int, int]]:
    """Id ranges of the train and validation splits: validation is the tail of the id space."""
    total = manifest.totals.rows
    n_val = 0
    if validation_fraction > 0 and total > 1:
        n_val = min(total - 1, max(1, round(total * validation_fraction)))
    return {"train": (0, total - n_val), "validation": (total - n_val, total)}


def epoch_plan(
    manifest: ShardManifest,
    *,
    id_range: tuple[int, int],
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
) -> list[Segment]:
    """The segments worker `rank` reads in `epoch`, in order. Same inputs, same plan, on every worker."""
    lo_id, hi_id = id_range
    pieces = []  # (shard index, lo, hi) clipped to the split
    for index, shard in enumerate(manifest.shards):
        lo, hi = max(lo_id, shard.first_id), min(hi_id, shard.first_id + shard.rows)
        if lo < hi:
            pieces.append((index, lo, hi))
    if shuffle and len(pieces) > 1:
        order = np.random.default_rng([seed, epoch]).permutation(len(pieces))
        pieces = [pieces[i] for i in order]
    total = sum(hi - lo for _, lo, hi in pieces)
    begin, end = rank * total // world_size, (rank + 1) * total // world_size
    segments, pos = [], 0
    for index, lo, hi in pieces:
        n = hi - lo
        a, b = max(begin, pos), min(end, pos + n)
        if a < b:
            segments.append(Segment(index, lo + (a - pos), lo + (b - pos), a - begin))
        pos += n
    return segments


def plan_rows(segments: list[Segment]) -> int:
    return sum(s.rows for s in segments)


# ---------------------------------------------------------------------------------------------------------
# Reading shards with Ray Data
# ---------------------------------------------------------------------------------------------------------


def _shard_datasource_class():
    # Imported lazily: ray.data is heavy, and the plan above is useful (and tested) without it.
    from ray.data.datasource.file_based_datasource import FileBasedDatasource

    class ShardDatasource(FileBasedDatasource):
        """Reads Pylon shards: size and sha256 checked against the manifest, then decoded.

        With on_bad_shard="skip", a bad shard yields one tombstone row (id -1) instead of data, so the
        consumer can count and log it; with "error", the read fails with an error naming the shard.
        """

        _FILE_EXTENSIONS = ["parquet", "tar"]

        def __init__(
            self,
            paths: list[str],
            *,
            shard_meta: dict[str, tuple[int, dict]],
            fmt: str,
            seq_len: int,
            dtype: str,
            on_bad_shard: str,
            filesystem,
            sources: dict[str, tuple[str, object, str]],
        ):
            super().__init__(paths, filesystem=filesystem)
            self._shard_meta, self._sources = shard_meta, sources
            self._fmt, self._seq_len, self._dtype = fmt, seq_len, dtype
            self._on_bad_shard = on_bad_shard

        def _open_input_source(self, filesystem, path: str, **open_args):
            # Nothing is opened here: `_read_stream` reads the shard through pylon.storage, whose retries outlast
            # an object store that is unreachable for a while (Ray Data's retry only errors of pyarrow's own S3).
            return contextlib.nullcontext()

        def _read_stream(self, f, path: str):
            import pyarrow as pa

            index, info_dict = self._shard_meta[_normalize(path)]
            info = ShardInfo(**info_dict)
            try:
                # The stream's own fsspec filesystem (pickled with its endpoint), retried as storage retries.
                uri, fs, fs_path = self._sources[_normalize(path)]
                data = storage.with_retries(uri, "read", lambda: fs.cat_file(fs_path))
                verify_shard_bytes(info, data)
                table = decode_shard_table(self._fmt, data, shard=info.file, seq_len=self._seq_len, dtype=self._dtype)
                first = table.column("id")[0].as_py() if len(table) else None
                if len(table) != info.rows or (len(table) and first != info.first_id):
                    raise BadShardError(
                        info.file,
                        f"holds {len(table)} rows from id {first}, manifest says {info.rows} from id {info.first_id}",
                    )
            except BadShardError as e:
                if self._on_bad_shard != "skip":
                    raise
                logging.getLogger("pylon.data").warning("skipping bad %s", e)
                yield _block(
                    index, np.array([-1], np.int64), np.zeros(1, np.int32), np.zeros((1, self._seq_len), self._dtype)
                )
                return
            # One block per shard, straight from the decoder: no copies on the way to the object store.
            yield table.append_column("shard", pa.array(np.full(len(table), index, np.int32)))

    return ShardDatasource


def _block(shard: int, ids: np.ndarray, num_tokens: np.ndarray, tokens: np.ndarray):
    """A plain Arrow table (tokens as a fixed-size list): it crosses the object store and comes back to
    numpy without copies, where Ray's tensor extension would convert twice."""
    import pyarrow as pa

    return pa.table(
        {
            "shard": pa.array(np.full(len(ids), shard, np.int32)),
            "id": pa.array(ids),
            "num_tokens": pa.array(num_tokens),
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1]),
        }
    )


def _columns(table) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(shard, ids, num_tokens, tokens) of a block, as numpy views where Arrow allows."""
    shard = int(table.column("shard")[0].as_py())
    ids = table.column("id").to_numpy()
    num_tokens = table.column("num_tokens").to_numpy()
    tokens_col = table.column("tokens").combine_chunks()
    width = tokens_col.type.list_size
    flat = tokens_col.values.to_numpy(zero_copy_only=False)[
        tokens_col.offset * width : (tokens_col.offset + len(tokens_col)) * width
    ]
    return shard, ids, num_tokens, flat.reshape(len(ids), width)


def _normalize(path: str) -> str:
    return path.lstrip("/")


# ---------------------------------------------------------------------------------------------------------
# Positions and measurements
# ---------------------------------------------------------------------------------------------------------


@dataclass
class DataPosition:
    """Where a worker is in its stream: the next row is row `offset` of shuffle window `window` of `epoch`."""

    epoch: int = 0
    window: int = 0
    offset: int = 0
    rows_consumed: int = 0  # this epoch
    batches: int = 0  # this epoch


@dataclass
class DataStats:
    rows: int = 0
    tokens: int = 0
    bytes_read: int = 0
    batches: int = 0
    skipped_shards: list[str] = field(default_factory=list)
    wait_s: float = 0.0  # inside the stream, waiting for data
    step_s: float = 0.0  # outside it, between batches: the consumer's own work (the training step)
    started: float = field(default_factory=time.perf_counter)

    @property
    def wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting for data (0 = never starved)."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    def as_dict(self) -> dict:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "rows": self.rows,
            "tokens": self.tokens,
            "bytes_read": self.bytes_read,
            "batches": self.batches,
            "skipped_shards": len(self.skipped_shards),
            "wait_s": round(self.wait_s, 4),
            "step_s": round(self.step_s, 4),
            "wait_fraction": round(self.wait_fraction, 4),
            "rows_per_s": self.rows / elapsed,
            "tokens_per_s": self.tokens / elapsed,
        }


@dataclass
class Batch:
    """One batch of samples; `to_torch` gives what a causal LM takes."""

    sample_ids: np.ndarray  # (b,) dataset-wide ids, for tests and audits
    tokens: np.ndarray  # (b, seq_len)
    num_tokens: np.ndarray  # (b,)
    wait_s: float  # how long the consumer waited for this batch
    # a chat dataset's rows (ShardManifest.loss_mask): tokens outside the assistant's replies stored as -(id + 1)
    loss_mask: bool = False
    eos_id: int = -1  # a text dataset's document end (`shards.split_words`): needed by `to_torch(documents=True)`
    # each row's documents' source records' other fields (`ShardManifest.record_fields`, a records file's line: one
    # entry per document that starts in the row, None where its record had none); None: the dataset has no such fields
    records: list[list[dict | None]] | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def to_torch(self, pad_id: int, device=None, *, documents: bool = False) -> dict:
        """The model's inputs and `labels`: -100 past each row's real tokens, and in a chat dataset's rows outside
        the assistant's replies (what the loss does not count).

        `documents` (`TrainJobSpec.attention_mask: document`): each document packed into a row is attended on its
        own. No `attention_mask`; `position_ids` restart at 0 where each document starts (and where the padding
        does), which `transformers` turns into a block-diagonal causal mask (`packed_sequence_mask`; FlashAttention's
        variable-length path on a GPU), as TRL's `padding_free` and TorchTitan's `block_causal` attend; and a
        document's first token is not a label (nothing of its own document predicts it)."""
        import torch

        ids, context, starts = split_words(self.tokens, loss_mask=self.loss_mask, eos_id=self.eos_id)
        length = ids.shape[1]
        real = np.arange(length)[None, :] < self.num_tokens.astype(np.int64)[:, None]
        unlearnt = ~real if context is None else ~real | context
        out = {"input_ids": torch.from_numpy(ids)}
        if documents:
            if not self.loss_mask and self.eos_id < 0:
                raise ValueError("Batch.to_torch(documents=True) on a text dataset needs its eos_id")
            starts &= real
            padding = self.num_tokens < length
            starts[np.flatnonzero(padding), self.num_tokens[padding]] = True  # the padding: a segment of its own
            unlearnt |= starts
            index = np.arange(length)
            first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)  # each token's segment's first index
            out["position_ids"] = torch.from_numpy(index - first)
        else:
            out["attention_mask"] = torch.from_numpy(real.astype(np.int64))
        out["labels"] = out["input_ids"].masked_fill(torch.from_numpy(unlearnt), -100)
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


# ---------------------------------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------------------------------


class ShardStream:
    """One worker's view of a prepared dataset: `for batch in stream.epoch(): ...`, resumable.

    stream = ShardStream(spec.data, rank=ctx.get_world_rank(), world_size=ctx.get_world_size(),
                         batch_size=spec.batch.micro_batch_size)
    stream.load_state_dict(checkpoint["data"])     # optional: continue where a run stopped
    for epoch in range(stream.position.epoch, n_epochs):
        for batch in stream.epoch():
            ... batch.to_torch(stream.pad_id) ...
            checkpoint["data"] = stream.state_dict()   # position after this batch
    """

    def __init__(
        self,
        uri: str,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        seed: int = 0,
        shuffle_buffer: int = 1024,
        validation_fraction: float = 0.0,
        on_bad_shard: str = "error",
        seq_len: int | None = None,
        prefetch_shards: int = 2,
        read_num_cpus: float = 0.0,
        records: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation' (got {split!r})")
        if on_bad_shard not in ("error", "skip"):
            raise ValueError(f"on_bad_shard must be 'error' or 'skip' (got {on_bad_shard!r})")
        self.uri = uri
        self.manifest = read_manifest(uri)
        if seq_len is not None and seq_len != self.manifest.seq_len:
            raise DataError(
                f"{uri}: prepared with seq_len {self.manifest.seq_len}, the job asks for {seq_len}; "
                f"prepare it again with --seq-len {seq_len} or change data.seq_len"
            )
        if self.manifest.totals.rows == 0:
            raise DataError(f"{uri}: the dataset is empty (0 rows)")
        self.batch_size, self.rank, self.world_size, self.split = batch_size, rank, world_size, split
        self.seed, self.on_bad_shard = seed, on_bad_shard
        self.shuffle = split == "train" and shuffle_buffer > 0
        self.window_rows = shuffle_buffer if self.shuffle else max(batch_size, 4096)
        self.id_range = split_ids(self.manifest, validation_fraction)[split]
        if self.id_range[0] == self.id_range[1]:
            raise DataError(
                f"{uri}: the {split} split is empty ({self.manifest.totals.rows} rows, "
                f"validation_fraction {validation_fraction})"
            )
        self.prefetch_shards, self.read_num_cpus = prefetch_shards, read_num_cpus
        self.position = DataPosition()
        self.stats = DataStats()
        self._fs, self._root = storage.arrow_filesystem(uri)
        self._missing = self._missing_shards()
        # `records`: the batches carry their rows' records (`Batch.records`), for the objectives that read them
        self.records = RecordReader(uri, self.manifest) if records and self.manifest.has_records else None

    # -- public ------------------------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return self.manifest.tokenizer.pad_id

    def plan(self, epoch: int, rank: int | None = None) -> list[Segment]:
        return epoch_plan(
            self.manifest,
            id_range=self.id_range,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
        )

    @property
    def steps_per_epoch(self) -> int:
        """Batches every worker yields per epoch (the same on all, so collective steps line up)."""
        total = self.id_range[1] - self.id_range[0]
        most = math.ceil(total / self.world_size)
        return math.ceil(most / self.batch_size)

    def state_dict(self) -> dict:
        return {
            "version": POSITION_VERSION,
            "uri": self.uri,
            "run_id": self.manifest.run_id,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "window_rows": self.window_rows,
            "split": self.split,
            "position": asdict(self.position),
        }

    def load_state_dict(self, state: dict) -> None:
        expect = {
            "run_id": self.manifest.run_id,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "window_rows": self.window_rows,
            "split": self.split,
        }
        wrong = {k: (state.get(k), v) for k, v in expect.items() if state.get(k) != v}
        if state.get("version") != POSITION_VERSION or wrong:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
            raise DataError(
                f"cannot resume the data position of {self.uri}: it was saved for a different stream "
                f"({detail or 'unknown version'}); resume with the same dataset, seed, world size and "
                f"shuffle_buffer, or start a new run"
            )
        self.position = DataPosition(**state["position"])

    def epoch(self) -> Iterator[Batch]:
        """Batches of the current epoch from the current position; afterwards the position is the next epoch."""
        resume = self.position
        epoch = resume.epoch
        segments = self.plan(epoch)
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, num_tokens, tokens) slices
        pending_n = 0
        t_wait = time.perf_counter()
        for window, ids, lens, toks in self._windows(epoch, segments, resume.window):
            offset = resume.offset if window == resume.window else 0
            while offset < len(ids):
                take = min(self.batch_size - pending_n, len(ids) - offset)
                pending.append(
                    (ids[offset : offset + take], lens[offset : offset + take], toks[offset : offset + take])
                )
                pending_n += take
                offset += take
                if pending_n == self.batch_size:
                    batch = self._make_batch(pending, time.perf_counter() - t_wait)
                    pending, pending_n = [], 0
                    self._advance(batch, window, offset) if offset < len(ids) else self._advance(batch, window + 1, 0)
                    yielded_at = time.perf_counter()
                    yield batch
                    t_wait = time.perf_counter()
                    self.stats.step_s += t_wait - yielded_at
        if pending_n:
            batch = self._make_batch(pending, time.perf_counter() - t_wait)
            self._advance(batch, math.ceil(plan_rows(segments) / self.window_rows) + 1, 0)
            yield batch
        # Equal step counts on every worker: a worker with fewer rows ends with empty batches.
        while self.position.batches < self.steps_per_epoch:
            self._advance(self._make_batch([], 0.0), self.position.window, 0)
            yield self._make_batch([], 0.0)
        self.position = DataPosition(epoch + 1)

    # -- internals ---------------------------------------------------------------------------------------

    def _advance(self, batch: Batch, window: int, offset: int) -> None:
        p = self.position
        self.position = DataPosition(p.epoch, window, offset, p.rows_consumed + len(batch), p.batches + 1)
        self.stats.rows += len(batch)
        self.stats.tokens += int(batch.num_tokens.sum())
        self.stats.batches += 1
        self.stats.wait_s += batch.wait_s

    def _make_batch(self, parts, wait_s: float) -> Batch:
        if not parts:
            seq_len = self.manifest.seq_len
            return Batch(
                np.zeros(0, np.int64),
                np.zeros((0, seq_len), self.manifest.dtype),
                np.zeros(0, np.int32),
                wait_s,
                self.manifest.loss_mask,
                self.manifest.tokenizer.eos_id,
            )
        ids = np.concatenate([p[0] for p in parts])
        return Batch(
            ids,
            np.concatenate([p[2] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            wait_s,
            self.manifest.loss_mask,
            self.manifest.tokenizer.eos_id,
            self.records.rows(ids) if self.records is not None else None,
        )

    def _windows(self, epoch: int, segments: list[Segment], first_window: int):
        """(window index, ids, num_tokens, tokens) per non-empty window from `first_window`, each permuted."""
        s = self.window_rows
        start_pos = first_window * s
        remaining = [seg for seg in segments if seg.start + seg.rows > start_pos]
        if remaining and remaining[0].start < start_pos:  # resuming inside a segment: begin at the window
            first = remaining[0]
            cut = start_pos - first.start
            remaining[0] = Segment(first.shard, first.lo + cut, first.hi, start_pos)
        window, buf = first_window, []
        for seg, (ids, lens, toks) in self._segment_rows(remaining):
            positions = seg.start + (ids - seg.lo)  # ascending: shards store ids in order
            while len(ids):
                w = int(positions[0] // s)
                if w != window:
                    if buf:
                        yield self._emit(epoch, window, buf)
                        buf = []
                    window = w
                k = int(np.searchsorted(positions, (window + 1) * s))
                buf.append((ids[:k], lens[:k], toks[:k]))
                ids, lens, toks, positions = ids[k:], lens[k:], toks[k:], positions[k:]
        if buf:
            yield self._emit(epoch, window, buf)

    def _emit(self, epoch: int, window: int, buf):
        ids = np.concatenate([b[0] for b in buf])
        lens = np.concatenate([b[1] for b in buf])
        toks = np.concatenate([b[2] for b in buf])
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, self.rank, window]).permutation(len(ids))
            ids, lens, toks = ids[order], lens[order], toks[order]
        return window, ids, lens, toks

    def _segment_rows(self, segments: list[Segment]):
        """(segment, (ids, num_tokens, tokens)) blocks in plan order; bad shards are reported or skipped."""
        for seg in segments:
            if seg.shard in self._missing:
                self._bad(self.manifest.shards[seg.shard].file, "is listed in the manifest but missing from storage")
        readable = [seg for seg in segments if seg.shard not in self._missing]
        if not readable:
            return
        by_shard = {seg.shard: seg for seg in readable}
        seen: set[int] = set()
        ds = self._dataset([seg.shard for seg in readable])
        try:
            for block in iter_without_cancelling(
                ds, batch_size=None, batch_format="pyarrow", prefetch_batches=self.prefetch_shards
            ):
                shard, ids, num_tokens, tokens = _columns(block)
                info, seg = self.manifest.shards[shard], by_shard[shard]
                if shard not in seen:
                    seen.add(shard)
                    self.stats.bytes_read += info.bytes
                if int(ids[0]) == -1:  # tombstone from the datasource
                    self._bad(info.file, "failed its checks")
                    continue
                if seg.lo <= ids[0] and ids[-1] < seg.hi:  # the usual case: the whole block is ours
                    yield seg, (ids, num_tokens, tokens)
                    continue
                mask = (ids >= seg.lo) & (ids < seg.hi)
                if mask.any():
                    yield seg, (ids[mask], num_tokens[mask], tokens[mask])
        except Exception as e:  # Ray wraps errors from read tasks; say which shard, not where in Ray
            cause = _find_cause(e, BadShardError)
            if cause is not None:
                raise BadShardError(cause.shard, cause.problem + _SKIP_HINT) from None
            raise

    def _bad(self, shard: str, problem: str) -> None:
        if self.on_bad_shard != "skip":
            raise BadShardError(shard, problem + _SKIP_HINT)
        if shard not in self.stats.skipped_shards:
            self.stats.skipped_shards.append(shard)
            log.warning("skipping shard %s: %s", shard, problem)

    def _missing_shards(self) -> set[int]:
        present = set(storage.listdir(self.uri))
        return {i for i, s in enumerate(self.manifest.shards) if s.file not in present}

    def _dataset(self, shard_indices: list[int]):
        import ray
        import ray.data

        if not ray.is_initialized():
            home.init_ray()
        paths, meta, sources = [], {}, {}
        fs, root = storage.resolve(self.uri)
        for i in shard_indices:
            info = self.manifest.shards[i]
            path = f"{self._root.rstrip('/')}/{info.file}"
            paths.append(path)
            meta[_normalize(path)] = (i, info.model_dump())
            sources[_normalize(path)] = (storage.join(self.uri, info.file), fs, f"{root.rstrip('/')}/{info.file}")
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        # Ray Data looks every path up as it builds the source: retried like every storage operation.
        source = storage.with_retries(
            self.uri,
            "look up the shards",
            lambda: _shard_datasource_class()(
                paths,
                shard_meta=meta,
                fmt=self.manifest.format,
                seq_len=self.manifest.seq_len,
                dtype=self.manifest.dtype,
                on_bad_shard=self.on_bad_shard,
                filesystem=self._fs,
                sources=sources,
            ),
        )
        # Where and with what a read runs. On this process's node, always: a training worker reads its own shards
        # there, never from a node the autoscaler is about to stop, nor through another node for nothing. With
        # the memory it holds reserved (a shard in flight, decoded: twice its stored size, the largest of these),
        # so Ray places no more reads than fit. CPU only as asked (default none): Train workers usually hold
        # every CPU of their node, and a read is I/O bound. `concurrency` bounds the shards in flight.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        largest = max(self.manifest.shards[i].bytes for i in shard_indices)
        return ray.data.read_datasource(
            source,
            override_num_blocks=len(paths),
            concurrency=min(self.prefetch_shards, len(paths)),
            num_cpus=self.read_num_cpus,
            memory=2 * largest,
            ray_remote_args={
                "scheduling_strategy": NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False
                ),
                # A read task puts its one shard's blocks without waiting for them to be taken: the shards in
                # flight are bounded above (`concurrency`, `memory`), and a stream stopped early then waits for
                # its reads to end rather than cancelling them (`iter_without_cancelling`).
                "_generator_backpressure_num_objects": -1,
            },
        )


# How long a stream stopped early waits for the reads it started (each one shard) before it cancels what is left.
READS_END_WAIT_S = 60.0


def iter_without_cancelling(ds, *, wait_s: float = READS_END_WAIT_S, **iter_batches_args):
    """`ds.iter_batches(**iter_batches_args)`, except that where the consumer stops before the end (a training
    run's last step mid-epoch, a resumed stream, an error) the tasks still running are waited for (up to
    `wait_s`) instead of `ray.cancel`led, and only those still running after that are cancelled.

    Ray Data ends an iteration by cancelling its operators' active tasks, and in Ray 2.60 a cancel that races with
    a task's reply fails a check in the calling core worker ("Check failed: it != submissible_tasks_.end() Tried
    to complete task that was not pending") and aborts the whole process: a Train worker, a notebook, or
    `make test`'s integration session (CI, 2026-12-07, in test_data_stream's resume test; `data/prepare.py`'s
    `_run_bounded` avoids the same race). A task that has ended is never cancelled here, so the race cannot
    happen unless a read outlives the wait. The hook is Ray Data's own (`DataIterator._on_iteration_end`, fired
    from the consumer's thread), set on this iterator only."""
    it = ds.iterator()
    it._on_iteration_end = _end_without_cancelling(wait_s)
    return it.iter_batches(**iter_batches_args)


def _end_without_cancelling(wait_s: float):
    def on_iteration_end(executor) -> None:
        if executor is None:
            return
        for op in list(getattr(executor, "_topology", None) or ()):
            op._cancel_active_tasks = _cancel_unfinished(op, wait_s)
        # The executor stops its scheduling loop first (nothing new starts), then shuts each operator down.
        executor.shutdown(force=False)

    return on_iteration_end


def _cancel_unfinished(op, wait_s: float):
    def cancel_active_tasks(force: bool) -> None:
        import ray

        tasks = op.get_active_tasks()
        if not tasks or not ray.is_initialized():  # (a process shutting down: its tasks end with it)
            return
        ends = [_task_end(task.get_waitable()) for task in tasks]
        done, _ = ray.wait(ends, num_returns=len(ends), timeout=wait_s, fetch_local=False)
        done = set(done)
        left = [task for task, end in zip(tasks, ends, strict=True) if end not in done]
        if left:
            log.warning(
                "%d read task(s) still running %.0f s after the stream stopped: cancelling them", len(left), wait_s
            )
        for task in left:
            task._cancel(force=False)

    return cancel_active_tasks


def _task_end(waitable):
    """The ref that is ready when the task behind `waitable` has ended (a streaming generator's `completed()`)."""
    completed = getattr(waitable, "completed", None)
    return completed() if callable(completed) else waitable


class RecordReader:
    """The rows' records (`Batch.records`) of a dataset with records files (`ShardManifest.has_records`): each
    shard's records file read when a row of it is first asked for (through pylon.storage, with its retries), checked
    against the manifest (`shards.decode_records`), and kept for the next rows (the last `keep` shards: a worker
    reads a few shards at a time). A file that cannot be read or fails its checks is a DataError naming it: rewards
    computed without their fields would be wrong, not merely fewer."""

    def __init__(self, uri: str, manifest: ShardManifest, keep: int = 4) -> None:
        self.uri, self.manifest, self.keep = uri, manifest, keep
        self._first_ids = [s.first_id for s in manifest.shards]
        self._cache: OrderedDict[int, list[list[dict | None]]] = OrderedDict()

    def rows(self, ids: np.ndarray) -> list[list[dict | None]]:
        """Each row's records, for the dataset-wide row `ids`."""
        out = []
        for row_id in ids.tolist():
            shard = bisect.bisect_right(self._first_ids, row_id) - 1
            out.append(self._shard(shard)[row_id - self.manifest.shards[shard].first_id])
        return out

    def _shard(self, index: int) -> list[list[dict | None]]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        info = self.manifest.shards[index]
        if info.records is None:  # no document of this shard had other fields
            rows = [[] for _ in range(info.rows)]
        else:
            try:
                data = storage.read_bytes(storage.join(self.uri, info.records.file))
            except StorageError as e:
                raise DataError(f"records file {info.records.file} of shard {info.file}: {e}") from None
            rows = decode_records(data, info=info)
        self._cache[index] = rows
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return rows


def _find_cause(error: BaseException, kind: type):
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__
    return None


def stream_from_spec(
    data_spec, *, batch_size: int, rank: int = 0, world_size: int = 1, split: str = "train", **kw
) -> ShardStream:
    """A ShardStream configured from a TrainJob's `data` block."""
    return ShardStream(
        data_spec.uri,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        split=split,
        seed=data_spec.shuffle_seed,
        shuffle_buffer=data_spec.shuffle_buffer,
        validation_fraction=data_spec.validation_fraction,
        on_bad_shard=data_spec.on_bad_shard,
        seq_len=data_spec.seq_len,
        **kw,
    )


# Ray Data's cluster-wide helpers, created detached and pinned to the node of the first process that runs a
# dataset there (module, function). Ray 2.60 creates these two for a streaming read.
_RAY_DATA_HELPERS = (
    ("ray.data._internal.stats", "get_or_create_stats_actor"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator", "get_or_create_autoscaling_coordinator"),
)


def pin_ray_data_helpers_here() -> list[str]:
    """Create Ray Data's detached helper actors from this process, on its node (a job's driver: the head).

    Left to the training workers, whichever reads first places them, and that can be a worker node the
    autoscaler started for this job. A node holding a detached actor is never idle, so the autoscaler would
    never stop it. They need no CPU and exist once per cluster. Returns the helpers created or found; a Ray
    without one of them (internal names) is skipped with a debug line, never an error.
    """
    import importlib

    done = []
    for module, function in _RAY_DATA_HELPERS:
        try:
            getattr(importlib.import_module(module), function)()
            done.append(function)
        except Exception as e:  # an internal API: its absence only costs the placement, not the run
            log.debug("could not start Ray Data's %s.%s here: %s", module, function, e)
    return done
