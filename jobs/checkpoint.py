"""Sharded training checkpoints in a run directory (local or object storage), committed atomically.

Layout under a run directory URI (`s3://bucket/runs/<name>` or a local path):

    checkpoints/step-00000200/
        ds/...                    DeepSpeed's files for tag "ds": model states (rank 0; every rank under ZeRO-3),
                                  one optimizer shard per rank (ZeRO 1-3), NVMe-offloaded tensors per rank
        zero_to_fp32.py ...       DeepSpeed's recovery scripts (rank 0)
        rank-<r>.json             rank r's own state: data position + anything else the trainer passes
                                  (`extra`), RNG states, and sha256 + bytes of every file rank r uploaded
        manifest.json             THE COMMIT MARKER, written last by rank 0: step, world_size, every file with
                                  sha256 and bytes, created_at, the trainer's `meta`
    latest.json                   {"step": N, "path": "checkpoints/step-..."}: a pointer for people and tools

The commit protocol. Every rank saves DeepSpeed's files into its own local staging directory (ranks share no
filesystem), streams each one to its final name with `storage.upload_file` (parts of `part_size` bytes, sha256
computed on the way, at most two parts in memory whatever the model's size; to object storage one PUT or one
multipart upload per file, each object written once; on local disk a temporary file renamed into place), then
writes its `rank-<r>.json` listing them (`storage.atomic_write`, like every small JSON file). Then rank 0 waits until
every rank's JSON of *this* save attempt is there (each save attempt has an id that rank 0 hands out, so a leftover
JSON from a crashed attempt at the same step is never mistaken for a new one), checks the listed files are stored
with the listed sizes, and only then writes `manifest.json`, then `latest.json`, then applies retention. A step
directory without `manifest.json` does not exist as far as readers are concerned, so a process killed at any
point of a save leaves the previous committed checkpoint as the latest (a multipart upload killed mid-way leaves
only invisible parts, which the store drops when told to: an S3 lifecycle rule aborting incomplete multipart
uploads after a day does it). Retention removes a checkpoint's manifest before its files, so a crash mid-delete
leaves an uncommitted directory (cleaned by the next retention), never a committed checkpoint with missing files.

Loading streams each file it needs into local staging (`storage.download_file`, bounded memory too), its sha256
computed on the way and checked with its size against the manifest before DeepSpeed reads anything; each rank
downloads rank 0's files and its own (DeepSpeed reads only those, unless ZeRO's elastic checkpoints are on).

Ray Train sees every committed checkpoint: the trainer reports each one (`RayTrainReports`) as a
`ray.train.Checkpoint` of its step directory, with `CheckpointUploadMode.NO_UPLOAD` (Ray copies nothing), which
Ray accepts only under its experiment directory: `ray_train_storage` makes that the run directory itself.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pylon import storage
from pylon.errors import PylonError, StorageError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
DS_TAG = "ds"  # one fixed DeepSpeed tag: the step lives in our directory name, not in DeepSpeed's
MANIFEST = "manifest.json"
LATEST = "latest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_RANK_FILE = re.compile(r"^rank-(\d+)\.json$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step, the URI of its step directory and its manifest."""

    step: int
    uri: str
    manifest: dict


# ---------------------------------------------------------------------------------------------------------
# Reading committed checkpoints (no DeepSpeed needed: export and the CLI use these too)
# ---------------------------------------------------------------------------------------------------------


def _step_dirs(run_uri: str) -> list[tuple[int, str]]:
    """(step, step directory URI) of every step directory, committed or not, oldest first."""
    root = storage.join(run_uri, CHECKPOINTS_DIR)
    found = []
    for name in storage.listdir(root):
        if m := _STEP_DIR.match(name):
            found.append((int(m.group(1)), storage.join(root, name)))
    return sorted(found)


def _committed(step: int, step_uri: str) -> CheckpointInfo | None:
    manifest_uri = storage.join(step_uri, MANIFEST)
    if not storage.exists(manifest_uri):
        return None
    try:
        manifest = storage.read_json(manifest_uri)
    except StorageError as e:
        # Manifests are written atomically, so this is damage from outside; an older checkpoint still works.
        log.warning("ignoring checkpoint %s: %s", step_uri, e)
        return None
    if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
        log.warning(
            "ignoring checkpoint %s: its manifest is for format %s, step %s",
            step_uri,
            manifest.get("format"),
            manifest.get("step"),
        )
        return None
    return CheckpointInfo(step=step, uri=step_uri, manifest=manifest)


def list_committed(run_uri: str) -> list[CheckpointInfo]:
    """Every committed checkpoint under `run_uri`, oldest first."""
    return [info for step, uri in _step_dirs(run_uri) if (info := _committed(step, uri))]


def latest_committed(run_uri: str) -> CheckpointInfo | None:
    """The newest committed checkpoint, or None.

    Found from the step directories, never from latest.json alone: a crash between a commit and the
    pointer's update, or a pointer naming a directory whose save never finished, must not mislead a resume.
    """
    for step, uri in reversed(_step_dirs(run_uri)):
        if info := _committed(step, uri):
            return info
    return None


def download(
    info: CheckpointInfo,
    dest: str | os.PathLike,
    *,
    ranks: set[int] | None = None,
    part_size: int = storage.DEFAULT_PART_SIZE,
) -> Path:
    """Copy the DeepSpeed files of `info` (those uploaded by `ranks`; all when None) into local `dest`, streamed
    in parts of `part_size` bytes, each one's sha256 and size checked against the manifest on the way. Returns
    `dest`, ready for `engine.load_checkpoint(dest, tag=DS_TAG)` or DeepSpeed's zero_to_fp32 helpers."""
    dest = Path(dest)
    for rel, entry in sorted(info.manifest["files"].items()):
        if _RANK_FILE.match(rel) or (ranks is not None and entry["rank"] not in ranks):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = storage.download_file(storage.join(info.uri, rel), target, part_size=part_size)
        if size != entry["bytes"] or digest != entry["sha256"]:
            target.unlink(missing_ok=True)
            raise _corrupt(info, rel, size, digest)
    return dest


def _read_verified(info: CheckpointInfo, rel: str) -> bytes:
    """A small file of `info` (a rank's JSON), whole, checked against the manifest."""
    data = storage.read_bytes(storage.join(info.uri, rel))
    digest = hashlib.sha256(data).hexdigest()
    entry = info.manifest["files"][rel]
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise _corrupt(info, rel, len(data), digest)
    return data


def _corrupt(info: CheckpointInfo, rel: str, size: int, digest: str) -> PylonError:
    entry = info.manifest["files"][rel]
    return PylonError(
        f"{storage.join(info.uri, rel)}: checkpoint file is corrupt: {size} bytes with sha256 {digest}, the manifest "
        f"says {entry['bytes']} bytes with sha256 {entry['sha256']}; load an older checkpoint "
        f"(delete {info.uri}/{MANIFEST} to uncommit this one)"
    )


# ---------------------------------------------------------------------------------------------------------
# RNG states as JSON
# ---------------------------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """This process's random states (python, numpy, torch CPU, and every CUDA device), JSON-safe."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": base64.b64encode(keys.astype("<u4").tobytes()).decode("ascii"),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    keys = np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(_from_b64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            log.warning(
                "checkpoint has CUDA RNG states for %d device(s), this process sees %d; restoring %d",
                len(saved),
                torch.cuda.device_count(),
                min(len(saved), torch.cuda.device_count()),
            )
        for device, s in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_from_b64(s), device)


# ---------------------------------------------------------------------------------------------------------
# Collective helpers (main thread only; no-ops in a single process)
# ---------------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _from_rank0(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all_ranks_succeeded(error: BaseException | None, what: str) -> None:
    """A barrier that also tells every rank whether any rank failed, so none is left waiting in the next
    collective while another has given up. Re-raises this rank's own error, else names the failed ranks."""
    messages: list[str | None] = []
    if _distributed():
        messages = [None] * torch.distributed.get_world_size()
        mine = None if error is None else f"{type(error).__name__}: {error}"
        torch.distributed.all_gather_object(messages, mine)
    if error is not None:
        raise error
    if failed := {r: m for r, m in enumerate(messages) if m is not None}:
        raise PylonError(
            f"{what} failed on rank(s) {sorted(failed)}: " + "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        )


# ---------------------------------------------------------------------------------------------------------
# The committer
# ---------------------------------------------------------------------------------------------------------


class CheckpointCommitter:
    """Saves, commits, retains and loads the checkpoints of one run; one instance per rank.

        committer = CheckpointCommitter(run_uri, rank=r, world_size=w, keep_last=3, keep_every=1000)
        if info := committer.latest():
            extra = committer.load(engine, info)           # collective
        ...
        committer.save(engine, step, extra={"data": stream.state_dict()}, meta={"loss": loss})  # collective
        committer.wait()                                   # before exiting: finishes an async upload

    `staging_dir` is local disk for DeepSpeed's files between engine and storage (a fresh temporary directory
    per save or load when None): it needs room for this rank's share of one checkpoint (a save waits for the
    previous async upload, so there is never a second). With async_upload and no staging_dir, a save stages in
    host memory (`/dev/shm`) when it has room for the rank's share twice over: the training step then blocks only
    for that snapshot, not for a disk write (see `snapshot_dir`). `commit_timeout_s` bounds how long rank 0's
    background commit waits for the other ranks' uploads. `before_write(uri)` is called before every file this
    rank writes to the run directory (progress reporting, or a test pausing a save where it wants to kill it).
    `part_size`: the bytes of one part of a streamed upload or download; a save or load holds at most two parts
    in memory.
    """

    def __init__(
        self,
        run_uri: str,
        *,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int = 0,
        async_upload: bool = False,
        staging_dir: str | os.PathLike | None = None,
        commit_timeout_s: float = 1800.0,
        before_write: Callable[[str], None] | None = None,
        part_size: int = storage.DEFAULT_PART_SIZE,
        exclude_frozen: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the newest checkpoint is always kept")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0 (got {keep_every})")
        self.run_uri = run_uri
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_upload = async_upload
        self.commit_timeout_s = commit_timeout_s
        self.before_write = before_write
        self.part_size = part_size
        # objective eagle3: the frozen model is model.path's; its checkpoints hold the trained head alone
        self.exclude_frozen = exclude_frozen
        self.staging_dir = None if staging_dir is None else Path(staging_dir)
        self._uploader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pylon-ckpt")
        self._pending: concurrent.futures.Future | None = None
        self._unreported: CheckpointInfo | None = None  # rank 0: committed, not yet handed out by take_committed
        # What this rank's saves and loads cost, for the run's ledger: bytes moved to and from storage (the
        # background upload adds to bytes_written from its thread), and the seconds the caller was blocked.
        self.bytes_written = 0
        self.bytes_read = 0
        self.saves = 0
        self.failures = 0
        self.last_blocked: dict[str, float] = {}  # the last save: wait_previous_s, snapshot_s, upload_s
        self._last_share = 0  # the bytes of this rank's last staged share: how much room the next one needs

    @property
    def checkpoints_uri(self) -> str:
        return storage.join(self.run_uri, CHECKPOINTS_DIR)

    def step_uri(self, step: int) -> str:
        return storage.join(self.checkpoints_uri, step_dir_name(step))

    def latest(self) -> CheckpointInfo | None:
        return latest_committed(self.run_uri)

    def list_committed(self) -> list[CheckpointInfo]:
        return list_committed(self.run_uri)

    # -- saving ------------------------------------------------------------------------------------------

    def save(self, engine, step: int, *, extra: dict, meta: dict | None = None) -> None:
        """Checkpoint `engine` at `step` with this rank's `extra` state (JSON: the data position etc.).

        Collective: every rank calls it. Synchronous: returns on every rank once the checkpoint is committed.
        With async_upload: returns once DeepSpeed's files are staged (in host memory where it has room, else on
        local disk); the upload and commit continue in the background (see `wait`). A save first waits for the
        previous one: at most one is in flight. `last_blocked` says how long each part held the caller.
        """
        t0 = time.perf_counter()
        self.last_blocked = {"wait_previous_s": 0.0, "snapshot_s": 0.0, "upload_s": 0.0}
        try:
            self.wait()
        finally:
            self.last_blocked["wait_previous_s"] = time.perf_counter() - t0
        self._check_world()
        try:
            # A copy, too: with async_upload the caller may change its dicts while the upload runs.
            extra, meta = json.loads(json.dumps(extra)), json.loads(json.dumps(meta or {}))
        except (TypeError, ValueError) as e:
            raise PylonError(f"checkpoint extra and meta must be JSON-serializable: {e}") from e
        rng = capture_rng_state()
        # Rank 0 decides for everyone (ranks may see storage at different moments): whether this step is
        # already committed, and the attempt id that tells this save's rank files from a crashed attempt's.
        plan = _from_rank0(
            {"save_id": uuid.uuid4().hex, "skip": self.rank == 0 and _committed(step, self.step_uri(step)) is not None}
        )
        if plan["skip"]:
            log.warning("checkpoint step %d is already committed in %s; not saving it again", step, self.run_uri)
            return
        staging = self._staging("save", step, snapshot=self.async_upload)
        t_snapshot = time.perf_counter()
        try:
            frozen = {"exclude_frozen_parameters": True} if self.exclude_frozen else {}
            engine.save_checkpoint(str(staging), tag=DS_TAG, save_latest=False, **frozen)
        except BaseException as e:
            full = _disk_full(staging, e)  # before the partial files are removed
            shutil.rmtree(staging, ignore_errors=True)
            if full:
                raise PylonError(
                    f"checkpoint step {step}: no space left on the device holding the staging directory {staging} "
                    f"{full} while DeepSpeed wrote rank {self.rank}'s files there; nothing was uploaded and the "
                    "previous checkpoint stays the latest. Free space there, or stage on a larger disk (the "
                    "committer's staging_dir; by default the temporary directory, TMPDIR)"
                ) from e
            raise
        self._last_share = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        self.saves += 1
        t_upload = time.perf_counter()
        self.last_blocked["snapshot_s"] = t_upload - t_snapshot
        rank_state = {"extra": extra, "rng": rng}
        swapped = swapped_master_weights(engine)
        if swapped:
            rank_state["swapped_master_weights"] = swapped
        context = {"zero_stage": int(engine.zero_optimization_stage()), "deepspeed_version": _deepspeed_version()}
        if self.async_upload:
            self._pending = self._uploader.submit(
                self._publish_in_background, step, staging, plan["save_id"], rank_state, meta, context
            )
            return
        try:
            error = None
            try:
                self._upload_rank(step, staging, plan["save_id"], rank_state)
            except Exception as e:
                error = e
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            _all_ranks_succeeded(error, f"uploading checkpoint step {step}")
            error = None
            if self.rank == 0:
                try:
                    self._unreported = self._commit(
                        step, plan["save_id"], meta, context, timeout_s=self.commit_timeout_s
                    )
                except Exception as e:
                    error = e
            _all_ranks_succeeded(error, f"committing checkpoint step {step}")
        except BaseException:
            self.failures += 1
            raise
        finally:
            self.last_blocked["upload_s"] = time.perf_counter() - t_upload

    def wait(self) -> None:
        """Block until the background upload/commit (if any) is done; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            committed = pending.result()
        except BaseException:
            self.failures += 1
            raise
        if committed is not None:
            self._unreported = committed

    def take_committed(self) -> CheckpointInfo | None:
        """The newest checkpoint this committer committed that no earlier call returned, else None (always None
        on ranks other than 0, which commit nothing). A background commit counts once `wait` (or the next
        `save`, which waits first) has seen it finish: what this returns is committed, never in flight."""
        committed, self._unreported = self._unreported, None
        return committed

    def _publish_in_background(
        self, step: int, staging: Path, save_id: str, rank_state: dict, meta: dict, context: dict
    ) -> CheckpointInfo | None:
        # No collective calls here: they would interleave with the training loop's on the main thread.
        try:
            self._upload_rank(step, staging, save_id, rank_state)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if self.rank == 0:
            return self._commit(step, save_id, meta, context, timeout_s=self.commit_timeout_s)
        return None

    def _before_write(self, uri: str) -> None:
        if self.before_write is not None:
            self.before_write(uri)

    def _write(self, uri: str, data: bytes) -> None:
        """A small file (JSON), written whole and atomically."""
        self._before_write(uri)
        storage.atomic_write(uri, data)
        self.bytes_written += len(data)

    def _upload_rank(self, step: int, staging: Path, save_id: str, rank_state: dict) -> None:
        """Stream this rank's staged files to their final names, then write its rank-<r>.json listing them (the
        order matters: the JSON is this rank's word that its files are complete)."""
        step_uri = self.step_uri(step)
        files = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = path.relative_to(staging).as_posix()
            uri = storage.join(step_uri, rel)
            self._before_write(uri)
            digest, size = storage.upload_file(path, uri, part_size=self.part_size)
            self.bytes_written += size
            files[rel] = {"sha256": digest, "bytes": size}
        record = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "save_id": save_id,
            "files": files,
            **rank_state,
        }
        self._write(storage.join(step_uri, rank_file_name(self.rank)), _json_bytes(record))

    # -- committing (rank 0) -----------------------------------------------------------------------------

    def _commit(self, step: int, save_id: str, meta: dict, context: dict, *, timeout_s: float) -> CheckpointInfo:
        step_uri = self.step_uri(step)
        rank_files = self._await_rank_files(step, save_id, timeout_s)
        files: dict[str, dict] = {}
        for rank, (raw, record) in sorted(rank_files.items()):
            for rel, entry in record["files"].items():
                if rel in files and files[rel]["sha256"] != entry["sha256"]:
                    raise PylonError(
                        f"{step_uri}/{rel}: ranks {files[rel]['rank']} and {rank} uploaded different "
                        "contents under the same name; not committing this checkpoint"
                    )
                files.setdefault(rel, {**entry, "rank": rank})
            files[rank_file_name(rank)] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "rank": rank}
        stored = _stored_sizes(step_uri)
        wrong = [
            f"{rel} ({_size_problem(stored.get(rel), entry['bytes'])})"
            for rel, entry in sorted(files.items())
            if stored.get(rel) != entry["bytes"]
        ]
        if wrong:
            raise PylonError(
                f"{step_uri}: not committing checkpoint step {step}: stored files do not match what "
                f"the ranks uploaded: {', '.join(wrong)}"
            )
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "tag": DS_TAG,
            "save_id": save_id,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "meta": meta,
            **context,
        }
        self._write(storage.join(step_uri, MANIFEST), _json_bytes(manifest))
        total = sum(e["bytes"] for e in files.values())
        log.info("committed checkpoint step %d: %d files, %.1f MB in %s", step, len(files), total / 1e6, step_uri)
        committed = self.list_committed()
        newest = committed[-1]  # this one unless a newer one exists; latest.json always names the newest
        self._write(
            storage.join(self.run_uri, LATEST),
            _json_bytes({"step": newest.step, "path": f"{CHECKPOINTS_DIR}/{step_dir_name(newest.step)}"}),
        )
        self._apply_retention(committed, just_committed=step)
        return CheckpointInfo(step=step, uri=step_uri, manifest=manifest)

    def _await_rank_files(self, step: int, save_id: str, timeout_s: float) -> dict[int, tuple[bytes, dict]]:
        """Every rank's rank-<r>.json of this save attempt: {rank: (raw bytes, parsed)}."""
        step_uri = self.step_uri(step)
        found: dict[int, tuple[bytes, dict]] = {}
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            for name in storage.listdir(step_uri):
                m = _RANK_FILE.match(name)
                if not m or int(m.group(1)) in found:
                    continue
                raw = storage.read_bytes(storage.join(step_uri, name))
                record = json.loads(raw)
                if record.get("save_id") != save_id:
                    continue  # a crashed attempt's; this attempt's rank will overwrite it
                expect = {"step": step, "rank": int(m.group(1)), "world_size": self.world_size}
                if any(record.get(k) != v for k, v in expect.items()):
                    raise PylonError(
                        f"{step_uri}/{name}: does not describe this save: "
                        + ", ".join(f"{k} {record.get(k)} (expected {v})" for k, v in expect.items())
                    )
                found[expect["rank"]] = (raw, record)
            if len(found) == self.world_size:
                return found
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(found))
                raise PylonError(
                    f"{step_uri}: rank(s) {missing} did not finish uploading within {timeout_s:.0f}s; "
                    "the checkpoint stays uncommitted"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _apply_retention(self, committed: list[CheckpointInfo], *, just_committed: int) -> None:
        """Keep the newest keep_last committed checkpoints and every keep_every-th; delete the rest, and
        uncommitted step directories older than the newest commit (leftovers of crashed saves)."""
        steps = [info.step for info in committed]
        keep = set(steps[-self.keep_last :]) | {just_committed, steps[-1]}
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        newest = steps[-1]
        for step, uri in _step_dirs(self.run_uri):
            if step in keep or (step not in steps and step > newest):
                continue
            manifest_uri = storage.join(uri, MANIFEST)
            if step in steps:
                storage.remove(manifest_uri)  # uncommit first: a crash mid-delete leaves no broken commit
            with contextlib.suppress(StorageError):  # gone already (a concurrent cleanup) is fine
                storage.remove(uri, recursive=True)
            log.info("retention: removed %s checkpoint step %d", "committed" if step in steps else "partial", step)

    # -- loading -----------------------------------------------------------------------------------------

    def load(self, engine, info: CheckpointInfo) -> dict:
        """Load `info` into `engine` (collective), restore this rank's RNG states, return its `extra`."""
        self.wait()
        self._check_world()
        saved_world = info.manifest["world_size"]
        if saved_world != self.world_size:
            raise PylonError(
                f"{info.uri}: saved by {saved_world} rank(s), this run has {self.world_size}; ZeRO optimizer "
                f"shards cannot be re-partitioned, so resume with {saved_world} workers (scaling.num_workers)"
            )
        local = self._staging("load", info.step)
        error, record = None, None
        try:
            # DeepSpeed reads the model states (rank 0's; each rank's own under ZeRO-3) and this rank's
            # optimizer shard, unless elastic checkpoints make every rank read every shard.
            ranks = None if engine.zero_elastic_checkpoint() else {0, self.rank}
            download(info, local, ranks=ranks, part_size=self.part_size)
            self.bytes_read += sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
            record = json.loads(_read_verified(info, rank_file_name(self.rank)))
        except Exception as e:
            error = e
        try:
            _all_ranks_succeeded(error, f"downloading checkpoint step {info.step}")
            frozen = {"load_module_strict": False} if self.exclude_frozen else {}  # (the frozen model: not in it)
            load_path, _ = engine.load_checkpoint(
                str(local), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True, **frozen
            )
            if load_path is None:
                raise PylonError(f"{info.uri}: DeepSpeed found no checkpoint in the downloaded files")
            if _zero3_with_nvme_optimizer(engine):
                _restore_swapped_optimizer(engine, Path(engine._get_zero_ckpt_name(str(local), DS_TAG)))
        finally:
            shutil.rmtree(local, ignore_errors=True)
        restore_rng_state(record["rng"])
        log.info("loaded checkpoint step %d from %s", info.step, info.uri)
        return record["extra"]

    # -- misc --------------------------------------------------------------------------------------------

    def _staging(self, purpose: str, step: int, *, snapshot: bool = False) -> Path:
        """A fresh local directory for one save or load, private to this rank even when ranks share a disk
        (DeepSpeed's shard names differ per rank, its recovery scripts and directories do not). `snapshot`: in
        host memory if `snapshot_dir` finds room (the staging_dir, when given, wins)."""
        name = f"{purpose}-{step_dir_name(step)}"
        if self.staging_dir is None:
            where = snapshot_dir(self._last_share) if snapshot else None
            return Path(tempfile.mkdtemp(prefix=f"pylon-ckpt-rank{self.rank}-{name}-", dir=where))
        path = self.staging_dir / f"rank-{self.rank}" / name
        shutil.rmtree(path, ignore_errors=True)  # a leftover of a crashed process
        path.mkdir(parents=True)
        return path

    def _check_world(self) -> None:
        if _distributed() and (
            torch.distributed.get_world_size() != self.world_size or torch.distributed.get_rank() != self.rank
        ):
            raise PylonError(
                f"CheckpointCommitter was made for rank {self.rank} of {self.world_size}, but this "
                f"process is rank {torch.distributed.get_rank()} of {torch.distributed.get_world_size()}"
            )

    def close(self) -> None:
        """Finish pending work (re-raising its error) and stop the upload thread."""
        try:
            self.wait()
        finally:
            self._uploader.shutdown(wait=True)


SHM = Path("/dev/shm")
SNAPSHOT_HEADROOM = 2  # room for this many shares of the last save (the first save: 1 GiB) before staging in memory


def snapshot_dir(share_bytes: int, shm: Path = SHM) -> str | None:
    """Where an async save stages: host memory (`/dev/shm`, a tmpfs) if it has room for `SNAPSHOT_HEADROOM` times
    this rank's last share (1 GiB before the first save), else None (the temporary directory, TMPDIR). Ray's object
    store lives in /dev/shm too, so the room is what is free now, with a margin for it."""
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return None
    needed = SNAPSHOT_HEADROOM * share_bytes if share_bytes else 2**30
    return str(shm) if free >= needed + 2**30 else None


def _zero3_with_nvme_optimizer(engine) -> bool:
    """Whether `engine` is a DeepSpeed engine at ZeRO-3 with its optimizer on NVMe (anything else: False)."""
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    nvme = getattr(engine, "zero_nvme_offload_optimizer", None)
    return callable(partitioned) and callable(nvme) and bool(partitioned()) and bool(nvme())


def swapped_master_weights(engine) -> list[dict]:
    """ZeRO-3 with the optimizer on NVMe: the sub-groups whose fp32 master weights live in DeepSpeed's swap files,
    not in its checkpoint shard (which holds an empty tensor for each, tagged with the sub-group's `ds_id`). The
    checkpoint keeps a copy of the swap files (`ds/offloaded_tensors/rank<NN>/<ds_id>.tensor.swp`), padded to the
    I/O alignment, so each entry's `numel` says how much of its file is weights: what `pylon export` reads back
    (`jobs.export`). Empty for any other engine."""
    if not _zero3_with_nvme_optimizer(engine):
        return []
    zero = engine.optimizer
    return [
        {"sub_group": i, "ds_id": str(flat.ds_id), "numel": int(zero.fp16_partitioned_groups_flat_numel[i])}
        for i, flat in enumerate(zero.fp32_partitioned_groups_flat)
        if zero._swappable_optimizer_subgroup(i)
    ]


def _restore_swapped_optimizer(engine, shard: Path) -> None:
    """Finish what DeepSpeed's `load_checkpoint` leaves undone when the optimizer is offloaded to NVMe (ZeRO-3).

    DeepSpeed then skips its ZeRO shard (`_load_zero_checkpoint`): it copies the checkpoint's swap files over
    its own and re-reads the fp32 master weights from them, nothing more. Three things stay as they were in
    this process (freshly initialised, in a resumed job):
      - sub-groups too small to swap (under `min_aio_bytes`, e.g. the last few norms): their master weights,
        Adam moments and model partitions live in the shard file only;
      - every sub-group's Adam step count (bias correction), which never goes to disk;
      - in a new process, the moments of swapped sub-groups: the swapper only reads the state tensors it has
        already seen, so the copied `exp_avg`/`exp_avg_sq` files are ignored and Adam restarts from zero.
    This reads this rank's shard and restores all three, so the steps after a resume repeat the steps the
    saving run took (tests/integration/test_deepspeed_combinations.py). Collective (gathers persistent params).
    """
    zero = engine.optimizer
    base = zero.optimizer
    saved = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    saved_state = saved["optimizer_state_dict"]["state"]
    saved_flat = saved["fp32_flat_groups"]
    # The base optimizer's params in state-dict order: its groups in order, each group's sub-groups in order,
    # as DeepSpeed lays them out (`_set_fp32_optimizer_param_groups`) when it saves.
    order = [[] for _ in base.param_groups]
    for sub_group in range(len(zero.fp32_partitioned_groups_flat)):
        order[zero.sub_group_to_group_id[sub_group]].append(sub_group)
    index_of = {sub_group: i for i, sub_group in enumerate(g for group in order for g in group)}
    if len(saved_flat) != len(zero.fp32_partitioned_groups_flat):
        raise PylonError(
            f"{shard.name}: the checkpoint has {len(saved_flat)} optimizer sub-groups, this run "
            f"{len(zero.fp32_partitioned_groups_flat)}; resume with the same deepspeed.buffers.sub_group_size"
        )
    swapper = zero.optimizer_swapper
    zero._partition_all_parameters()  # persistent parameters too: the gather at the end refreshes them
    for sub_group, flat in enumerate(zero.fp32_partitioned_groups_flat):
        state = saved_state.get(index_of[sub_group])
        if not state:
            continue  # this sub-group had not stepped when the checkpoint was taken
        tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and k != "step"}
        others = {k: v for k, v in state.items() if k not in tensors}
        if zero._swappable_optimizer_subgroup(sub_group):
            current = base.state.get(flat)
            if current:  # this process has stepped: its swapper knows the state files, now the checkpoint's
                current.update(others)
                continue
            # Register state tensors of the right size, so that the swapper reads the checkpoint's files for
            # them at the next step; their memory is given back at once.
            numel = swapper.swap_params_info[swapper.parameter_id(flat)].numel()
            base.state[flat] = {**others, **{k: torch.empty(numel, dtype=flat.dtype) for k in tensors}}
            info = swapper._get_param_swap_info(flat)
            if info is None or not info.has_state_tensors:
                raise PylonError(
                    f"{shard.name}: DeepSpeed's swapper did not take the optimizer state of sub-group {sub_group}"
                )
            for context in info.tensors[1:]:
                context.release_memory()
        else:
            flat.data.copy_(saved_flat[sub_group].data)
            base.state[flat] = {**others, **{k: v.to(flat.dtype).clone() for k, v in tensors.items()}}
            zero._reassign_or_swap_out_partitioned_parameters(sub_group)
    zero.checkpoint_event_epilogue()  # re-gathers the persistent (unpartitioned) parameters from the partitions


def _disk_full(path: Path, error: BaseException) -> str | None:
    """Whether `error`, raised while writing under `path`, came from its disk being full: ENOSPC in the error's
    chain, or (torch.save reports a full disk as an obscure RuntimeError) under 1 MiB left on that disk. Returns
    the disk's free and total space as text, or None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    chain, seen = error, set()
    enospc = False
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        enospc |= getattr(chain, "errno", None) == errno.ENOSPC or "No space left" in str(chain)
        chain = chain.__cause__ or chain.__context__
    if not enospc and free >= 2**20:
        return None
    return f"({free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB)"


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode("utf-8")


def _stored_sizes(step_uri: str) -> dict[str, int]:
    """{relative path: bytes} of every file stored under `step_uri`, from one recursive listing."""
    fs, root = storage.resolve(step_uri)

    def find() -> dict:
        try:
            return fs.find(root, detail=True)
        except FileNotFoundError:
            return {}

    entries = storage.with_retries(step_uri, "list", find)
    prefix = root.rstrip("/") + "/"
    return {name[len(prefix) :]: int(e["size"]) for name, e in entries.items() if name.startswith(prefix)}


def _size_problem(stored: int | None, expected: int) -> str:
    return "missing" if stored is None else f"{stored} bytes stored, {expected} uploaded"


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


# ---------------------------------------------------------------------------------------------------------
# Ray Train's view of the checkpoints (Result.checkpoint, Result.best_checkpoints, the Train dashboard)
# ---------------------------------------------------------------------------------------------------------


def ray_train_storage(run_uri: str) -> dict[str, Any]:
    """`RunConfig` arguments (name, storage_path, storage_filesystem) that make Ray Train's experiment directory
    the run directory itself, on the same storage every node reaches (object storage through the pyarrow
    filesystem of `storage.arrow_filesystem`, which honours the custom S3 endpoint).

    Why there: a checkpoint reported with `CheckpointUploadMode.NO_UPLOAD` must lie under the experiment
    directory (Ray 2.60 refuses it otherwise), and ours are `<run>/checkpoints/step-N`. Ray keeps beside them
    its `.validate_storage_marker` and its record of the reported checkpoints, `checkpoint_manager_snapshot.json`,
    which it reloads when the run is submitted again, refusing to start if one of them is gone. Retention deletes
    checkpoints Ray does not know about, so before each submission this removes them from that record (or, were
    the record not in the form this Ray writes, removes the record: Ray then starts a new one). Within a run Ray's
    list (`Result.best_checkpoints`) still names the checkpoints retention deleted; `Result.checkpoint`, the
    newest, is always there."""
    parent, sep, name = run_uri.rstrip("/").rpartition("/")
    if not parent or not name or parent.endswith(":/"):
        raise PylonError(f"{run_uri}: a run directory needs a parent directory to hold Ray Train's experiment")
    _forget_deleted_checkpoints(run_uri)
    filesystem, path = storage.arrow_filesystem(parent)
    return {"name": name, "storage_path": path, "storage_filesystem": filesystem}


class RayTrainReports:
    """`ray.train.report` for the training loop, which every rank calls at the same steps (a report is a barrier):
    rank 0 attaches each checkpoint its committer committed since the last report, with the metrics of the
    checkpoint's own step. Ray records the step directory as it is, without copying it
    (`CheckpointUploadMode.NO_UPLOAD`; see `ray_train_storage` for where Ray accepts that).

        reports = RayTrainReports(committer)
        ... reports.report(metrics, step=step, saved=saved_this_step)   # every rank, same steps
        committer.wait(); reports.finish()                               # every rank

    With async_upload a save is known committed only at the next save (which waits for it) or at `wait`: its
    checkpoint goes with that later report, still with its own step's metrics, and `finish` reports the last one.
    """

    def __init__(self, committer: CheckpointCommitter):
        self.committer = committer
        self._at_save: dict[int, dict] = {}  # the metrics of the last saves' steps, for their checkpoints
        self._last: dict | None = None

    def report(self, metrics: dict, *, step: int, saved: bool) -> None:
        if saved:  # at most one save is in flight: the previous one's metrics and this one's are all that is needed
            self._at_save = {**dict(list(self._at_save.items())[-1:]), step: metrics}
        info = self.committer.take_committed()
        self._last = metrics
        _report_to_ray_train(self._at_save.get(info.step, metrics) if info else metrics, info)

    def finish(self) -> None:
        """After `committer.wait()`: with async_upload, report the last save, committed in the background."""
        if self.committer.async_upload and self._last is not None:
            info = self.committer.take_committed()
            _report_to_ray_train(self._at_save.get(info.step, self._last) if info else self._last, info)


def _report_to_ray_train(metrics: dict, info: CheckpointInfo | None) -> None:
    import ray.train

    checkpoint = None
    if info is not None:
        ray_storage = ray.train.get_context().get_storage()
        checkpoint = ray.train.Checkpoint(path=storage.resolve(info.uri)[1], filesystem=ray_storage.storage_filesystem)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)


def _forget_deleted_checkpoints(run_uri: str) -> None:
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    uri = storage.join(run_uri, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME)
    if not storage.exists(uri):
        return
    live = {f"{CHECKPOINTS_DIR}/{step_dir_name(info.step)}" for info in list_committed(run_uri)}
    try:
        state = storage.read_json(uri)
        results, indices = state["checkpoint_results"], state["checkpoint_report_indices"]
        pending, specs = state["pending_training_results"], state["pending_validation_specs"]
        if len(results) != len(indices) or len(pending) != len(specs):
            raise ValueError("lists of different lengths")
        known = [r["checkpoint_dir_name"] for r in results] + [r["checkpoint_dir_name"] for r in pending]
        latest = state.get("latest_checkpoint_result")
        if latest is not None:
            known.append(latest["checkpoint_dir_name"])
        if set(known) <= live:
            return
        kept = [(r, i) for r, i in zip(results, indices) if r["checkpoint_dir_name"] in live]
        state["checkpoint_results"] = [r for r, _ in kept]
        state["checkpoint_report_indices"] = [i for _, i in kept]
        kept_pending = [(r, v) for r, v in zip(pending, specs) if r["checkpoint_dir_name"] in live]
        state["pending_training_results"] = [r for r, _ in kept_pending]
        state["pending_validation_specs"] = [v for _, v in kept_pending]
        if latest is not None and latest["checkpoint_dir_name"] not in live:
            state["latest_checkpoint_result"] = max(kept, key=lambda k: k[1])[0] if kept else None
        for key in (
            "validated_checkpoint_dir_names",
            "timed_out_validation_checkpoint_dir_names",
            "failed_validation_checkpoint_dir_names",
        ):
            state[key] = [n for n in state.get(key, []) if n in live]
        storage.atomic_write_json(uri, state)
        log.info("forgot %d deleted checkpoint(s) in Ray Train's record %s", len(set(known) - live), uri)
    except (StorageError, KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("removing Ray Train's record %s, which this version cannot update (%s)", uri, e)
        storage.remove(uri)
