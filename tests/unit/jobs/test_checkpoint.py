"""pylon.jobs.checkpoint on local directories, with a real DeepSpeed engine (ZeRO-2, gloo, one process); its streamed
I/O (each object written once, multipart, bounded memory) with an engine that only writes files, locally and on the
session's S3-protocol server; and the run directory as Ray Train's experiment directory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[3] / ".cache" / "torch_extensions"))

from pylon import storage  # noqa: E402
from pylon.errors import PylonError  # noqa: E402
from pylon.jobs import checkpoint as checkpoint_module  # noqa: E402
from pylon.jobs.checkpoint import (  # noqa: E402
    CheckpointCommitter,
    RayTrainReports,
    capture_rng_state,
    ray_train_storage,
    restore_rng_state,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def distributed():
    """A one-process gloo world. Created once per process: DeepSpeed caches its process groups, so a world
    destroyed and created again breaks the next engine; later modules reuse this one."""
    import deepspeed

    with pytest.MonkeyPatch.context() as env:
        for name, value in {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }.items():
            env.setenv(name, value)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
        yield


def build_engine(seed: int):
    """A tiny GPT-2 (dropout on, so RNG state matters) under ZeRO-2 with AdamW and a warmup schedule."""
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=320, n_positions=32, bos_token_id=0, eos_token_id=0)
    )
    model.train()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine, step: int) -> float:
    """One optimizer step on a batch that depends only on `step` (the data position)."""
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1000 + step))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def stored_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def committed_steps(committer: CheckpointCommitter) -> list[int]:
    return [info.step for info in committer.list_committed()]


@pytest.fixture(scope="module")
def engine():
    """One engine for the tests that only need something to save."""
    return build_engine(seed=0)


# ---------------------------------------------------------------------------------------------------------


def test_round_trip_restores_weights_optimizer_rng_and_extra(tmp_path):
    run = tmp_path / "run"
    staging = tmp_path / "staging"
    a = build_engine(seed=0)
    for step in range(1, 4):
        train_step(a, step)
    committer = CheckpointCommitter(str(run), rank=0, world_size=1, keep_last=2, staging_dir=staging)
    extra = {"data": {"epoch": 0, "window": 1, "offset": 6}, "tokens_seen": 96}
    committer.save(a, 3, extra=extra, meta={"loss": 5.5})
    reported = committer.take_committed()  # what the trainer reports to Ray Train: this save, committed
    assert (reported.step, reported.uri) == (3, storage.join(str(run), "checkpoints", "step-00000003"))
    assert committer.take_committed() is None, "handed out once"
    saved_weights, saved_lr = weights(a), a.get_lr()
    # Draw from every generator, then continue the uninterrupted run: the resumed run must see the same.
    draws = (random.random(), np.random.rand(), torch.rand(3))
    uninterrupted = [train_step(a, step) for step in range(4, 7)]

    step_dir = run / "checkpoints" / "step-00000003"
    assert stored_files(run) == {
        "latest.json",
        "checkpoints/step-00000003/manifest.json",
        "checkpoints/step-00000003/rank-0.json",
        "checkpoints/step-00000003/ds/mp_rank_00_model_states.pt",
        "checkpoints/step-00000003/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "checkpoints/step-00000003/zero_to_fp32.py",
        "checkpoints/step-00000003/zero_to_torch.py",
    }
    assert json.loads((run / "latest.json").read_text()) == {"step": 3, "path": "checkpoints/step-00000003"}
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["meta"] == {"loss": 5.5}
    assert manifest["zero_stage"] == 2 and manifest["created_at"]
    for rel, entry in manifest["files"].items():
        assert (step_dir / rel).stat().st_size == entry["bytes"]
    assert set(manifest["files"]) == stored_files(step_dir) - {"manifest.json"}
    assert stored_files(staging) == set(), "local staging must be removed after the upload"

    b = build_engine(seed=1)
    assert any(not torch.equal(saved_weights[k], v) for k, v in weights(b).items())
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # the resumed process's RNGs start elsewhere
    info = committer.latest()
    assert info.step == 3
    assert committer.load(b, info) == extra
    for name, value in weights(b).items():
        assert torch.equal(value, saved_weights[name]), name
    assert b.get_lr() == saved_lr
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(3), draws[2])
    resumed = [train_step(b, step) for step in range(4, 7)]
    # Same weights, Adam moments, step counts, schedule and dropout masks. Not bit-for-bit: CPU matmul
    # kernels may round differently for tensors at other addresses (seen: 5e-7). Without the optimizer
    # state or the RNG states the losses differ by ~1e-2.
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
    assert stored_files(staging) == set()


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "expected"),
    [
        (2, 4, [[1], [1, 2], [2, 3], [3, 4], [4, 5], [4, 5, 6], [4, 6, 7], [4, 7, 8], [4, 8, 9]]),
        (1, 0, [[1], [2], [3], [4]]),
        (3, 2, [[1], [1, 2], [1, 2, 3], [2, 3, 4], [2, 3, 4, 5], [2, 4, 5, 6], [2, 4, 5, 6, 7]]),
    ],
)
def test_retention_keeps_exactly_the_expected_set(engine, tmp_path, keep_last, keep_every, expected):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=keep_last, keep_every=keep_every)
    for step, kept in enumerate(expected, start=1):
        committer.save(engine, step, extra={"step": step})
        assert committed_steps(committer) == kept, f"after saving step {step}"
        assert storage.listdir(str(tmp_path / "checkpoints")) == [f"step-{s:08d}" for s in kept]
    assert committer.latest().step == len(expected)


def test_async_upload_returns_before_the_upload_and_wait_commits(engine, tmp_path):
    entered, release = threading.Event(), threading.Event()
    uploads = []

    def hold_first_write(uri: str) -> None:
        uploads.append(uri)
        if len(uploads) == 1:
            entered.set()
            assert release.wait(60), "the test never released the upload"

    staging = tmp_path / "staging"
    committer = CheckpointCommitter(
        str(tmp_path / "run"),
        rank=0,
        world_size=1,
        keep_last=5,
        async_upload=True,
        staging_dir=staging,
        before_write=hold_first_write,
    )
    committer.save(engine, 10, extra={"data": 10}, meta={"loss": 1.0})
    assert entered.wait(60), "the background upload never started"
    # save() has returned while the first file's upload is held: nothing is committed, DeepSpeed's files
    # are still in local staging.
    assert committer.latest() is None
    assert committer.take_committed() is None, "in flight is not committed"
    assert "rank-0/save-step-00000010/ds/mp_rank_00_model_states.pt" in stored_files(staging)
    release.set()
    committer.wait()
    assert committed_steps(committer) == [10]
    assert committer.take_committed().step == 10
    assert committer.latest().manifest["meta"] == {"loss": 1.0}
    assert stored_files(staging) == set()

    # Two saves in a row: the second waits for the first, so both commit in order.
    committer.save(engine, 20, extra={"data": 20})
    committer.save(engine, 30, extra={"data": 30})
    assert committer.take_committed().step == 20, "the second save waited for the first's commit"
    committer.wait()
    assert committer.take_committed().step == 30
    assert committed_steps(committer) == [10, 20, 30]
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 30


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_async_save_snapshots_to_host_memory_and_counts_what_it_moved(engine, tmp_path):
    from pylon.jobs.checkpoint import snapshot_dir

    entered, release = threading.Event(), threading.Event()

    def hold(uri: str) -> None:
        if not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never released the upload"

    committer = CheckpointCommitter(
        str(tmp_path / "run"), rank=0, world_size=1, keep_last=5, async_upload=True, before_write=hold
    )
    committer.save(engine, 10, extra={})
    assert entered.wait(60)
    staged = list(Path("/dev/shm").glob("pylon-ckpt-rank0-save-step-00000010-*"))
    assert staged, "an async save with room in /dev/shm stages there"
    blocked = committer.last_blocked
    assert blocked["snapshot_s"] > 0 and blocked["upload_s"] == 0.0  # the upload is not the caller's time
    release.set()
    committer.wait()
    assert not any(p.exists() for p in staged)
    files = committer.latest().manifest["files"]
    listed = sum(f["bytes"] for f in files.values())  # DeepSpeed's files and the rank's JSON
    assert listed < committer.bytes_written < listed + 64 * 1024  # and the manifest and latest.json
    assert (committer.saves, committer.failures) == (1, 0)
    # A synchronous save blocks for the upload and the commit too.
    sync = CheckpointCommitter(str(tmp_path / "run-sync"), rank=0, world_size=1, keep_last=5)
    sync.save(engine, 10, extra={})
    assert sync.last_blocked["upload_s"] > 0
    committer.load(engine, committer.latest())
    assert committer.bytes_read >= committer.bytes_written * 0.9  # this rank's files, back
    # No room: the temporary directory instead (a tmpfs of one's own stands in for a full /dev/shm).
    assert snapshot_dir(2**50) is None
    assert snapshot_dir(1) == "/dev/shm" or shutil.disk_usage("/dev/shm").free < 2**30 + 2


def test_async_upload_error_surfaces_in_wait_and_nothing_commits(engine, tmp_path):
    def fail_on_rank_file(uri: str) -> None:
        if uri.endswith("rank-0.json"):
            raise OSError("disk full (simulated)")

    committer = CheckpointCommitter(
        str(tmp_path), rank=0, world_size=1, keep_last=2, async_upload=True, before_write=fail_on_rank_file
    )
    committer.save(engine, 5, extra={})
    with pytest.raises(OSError, match="disk full"):
        committer.wait()
    assert committer.latest() is None
    committer.wait()  # the error is reported once


def test_failed_save_keeps_the_previous_latest_and_retention_removes_the_partial_dir(engine, tmp_path):
    writes = []

    def fail_second_file_of_step_2(uri: str) -> None:
        if "step-00000002" in uri:
            writes.append(uri)
            if len(writes) == 2:
                raise OSError("connection reset (simulated)")

    committer = CheckpointCommitter(
        str(tmp_path), rank=0, world_size=1, keep_last=3, before_write=fail_second_file_of_step_2
    )
    committer.save(engine, 1, extra={"at": 1})
    with pytest.raises(OSError, match="connection reset"):
        committer.save(engine, 2, extra={"at": 2})
    partial = tmp_path / "checkpoints" / "step-00000002"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert committer.latest().step == 1
    assert committer.load(engine, committer.latest()) == {"at": 1}
    committer.save(engine, 3, extra={"at": 3})
    assert not partial.exists(), "an uncommitted step older than the newest commit is a leftover"
    assert committed_steps(committer) == [1, 3]


def test_corrupted_file_is_detected_on_load_naming_the_file(engine, tmp_path):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=2)
    committer.save(engine, 4, extra={})
    shard = tmp_path / "checkpoints" / "step-00000004" / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(PylonError, match=r"ds/zero_pp_rank_0_mp_rank_00_optim_states\.pt: checkpoint file is corrupt"):
        committer.load(engine, committer.latest())


def test_latest_trusts_only_committed_directories(engine, tmp_path):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=5)
    committer.save(engine, 1, extra={"at": 1})
    committer.save(engine, 2, extra={"at": 2})
    latest_json = tmp_path / "latest.json"
    assert json.loads(latest_json.read_text())["step"] == 2

    # latest.json names a directory that lost its commit marker: fall back to the newest committed one.
    (tmp_path / "checkpoints" / "step-00000002" / "manifest.json").unlink()
    assert committer.latest().step == 1
    assert committer.load(engine, committer.latest()) == {"at": 1}
    # No latest.json at all.
    latest_json.unlink()
    assert committer.latest().step == 1
    # A stale pointer (a crash after a commit, before the pointer moved) does not hide a newer commit.
    committer.save(engine, 3, extra={"at": 3})
    latest_json.write_text(json.dumps({"step": 1, "path": "checkpoints/step-00000001"}))
    assert committer.latest().step == 3
    # An empty run directory has no checkpoint.
    assert CheckpointCommitter(str(tmp_path / "empty"), rank=0, world_size=1, keep_last=1).latest() is None


def test_saving_a_committed_step_again_changes_nothing(engine, tmp_path):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=2)
    committer.save(engine, 7, extra={"first": True})
    manifest = (tmp_path / "checkpoints" / "step-00000007" / "manifest.json").read_text()
    committer.save(engine, 7, extra={"first": False})
    assert (tmp_path / "checkpoints" / "step-00000007" / "manifest.json").read_text() == manifest
    assert committer.load(engine, committer.latest()) == {"first": True}


def test_load_refuses_a_different_world_size(engine, tmp_path):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=1)
    committer.save(engine, 1, extra={})
    info = committer.latest()
    from_two_ranks = replace(info, manifest={**info.manifest, "world_size": 2})
    with pytest.raises(PylonError, match=r"saved by 2 rank\(s\), this run has 1"):
        committer.load(engine, from_two_ranks)


def test_extra_must_be_json(engine, tmp_path):
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=1)
    with pytest.raises(PylonError, match="JSON-serializable"):
        committer.save(engine, 1, extra={"tensor": torch.zeros(1)})
    assert committer.latest() is None


def test_rng_state_survives_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.randn(), torch.rand(4))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(state)
    assert (random.random(), np.random.randn()) == expected[:2]
    assert torch.equal(torch.rand(4), expected[2])


# ---------------------------------------------------------------------------------------------------------
# Streamed I/O: each object written once, multipart for large files, bounded memory
# ---------------------------------------------------------------------------------------------------------

MiB = 2**20
WRITES = {
    "PutObject",
    "CopyObject",
    "DeleteObject",
    "DeleteObjects",
    "CreateMultipartUpload",
    "UploadPart",
    "UploadPartCopy",
    "CompleteMultipartUpload",
    "AbortMultipartUpload",
}


def _noise(path: Path, size: int, seed: int) -> str:
    """`size` bytes of seeded noise at `path`, 1 MiB at a time; their sha256."""
    rng, digest = random.Random(seed), hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, size, MiB):
            chunk = rng.randbytes(min(MiB, size - start))
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


class FileEngine:
    """Stands in for DeepSpeed's engine where only its files matter (the committer's I/O at sizes a real engine
    would take minutes to reach): `save_checkpoint` writes files laid out as a ZeRO-2 rank 0's, seeded noise of
    the given sizes; `load_checkpoint` records the sha256 of every file it is handed."""

    def __init__(self, sizes: dict[str, int], seed: int = 0):
        self.sizes, self.seed = sizes, seed
        self.saved: dict[str, str] = {}
        self.loaded: dict[str, str] | None = None

    def zero_optimization_stage(self) -> int:
        return 2

    def zero_elastic_checkpoint(self) -> bool:
        return False

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        for i, (rel, size) in enumerate(sorted(self.sizes.items())):
            path = Path(save_dir) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            self.saved[rel] = _noise(path, size, seed=self.seed * 100 + i)

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs) -> tuple[str, dict]:
        root = Path(load_dir)
        self.loaded = {p.relative_to(root).as_posix(): _sha256_of(p) for p in root.rglob("*") if p.is_file()}
        return load_dir, {}


class S3Calls:
    """The S3 operations storage's client sends while active, as (operation, key relative to `root`)."""

    def __init__(self, root: str):
        self.fs, path = storage.resolve(root)
        self.prefix = path.partition("/")[2] + "/"
        self.calls: list[tuple[str, str]] = []

    def _record(self, params, model, **kwargs) -> None:
        self.calls.append((model.name, params.get("Key", "").removeprefix(self.prefix)))

    def __enter__(self) -> S3Calls:
        self.fs.connect()
        self.fs.s3.meta.events.register("before-parameter-build.s3", self._record)
        return self

    def __exit__(self, *exc) -> None:
        self.fs.s3.meta.events.unregister("before-parameter-build.s3", self._record)

    def writes(self) -> list[tuple[str, str]]:
        return [(op, key) for op, key in self.calls if op in WRITES]


def test_save_streams_each_file_once_to_its_key_multipart_when_large_and_load_verifies(s3_root, tmp_path):
    part = 5 * MiB  # S3's smallest
    model, optim = "ds/mp_rank_00_model_states.pt", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    engine = FileEngine({model: 2 * part + 1, optim: part - 1, "zero_to_fp32.py": 1000})
    committer = CheckpointCommitter(s3_root, rank=0, world_size=1, keep_last=1, part_size=part)
    with S3Calls(s3_root) as s3:
        committer.save(engine, 1, extra={"at": 1})
    step = "checkpoints/step-00000001/"
    assert s3.writes() == [
        ("CreateMultipartUpload", step + model),  # three parts: one multipart upload straight to the key
        ("UploadPart", step + model),
        ("UploadPart", step + model),
        ("UploadPart", step + model),
        ("CompleteMultipartUpload", step + model),
        ("PutObject", step + optim),  # one part or less: one PUT
        ("PutObject", step + "zero_to_fp32.py"),
        ("PutObject", step + "rank-0.json"),
        ("PutObject", step + "manifest.json"),  # the commit, after every file
        ("PutObject", "latest.json"),
    ]
    manifest = committer.latest().manifest
    assert {rel: e["sha256"] for rel, e in manifest["files"].items() if not rel.startswith("rank-")} == engine.saved

    other = FileEngine({})
    assert committer.load(other, committer.latest()) == {"at": 1}
    assert other.loaded == engine.saved

    # One flipped byte in the stored multipart object: refused, named, and nothing left in local staging.
    import boto3

    bucket, _, key = storage.join(committer.latest().uri, model).removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[part + 3] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    staging = tmp_path / "staging"
    loading = CheckpointCommitter(s3_root, rank=0, world_size=1, keep_last=1, part_size=part, staging_dir=staging)
    with pytest.raises(PylonError, match=r"step-00000001/ds/mp_rank_00_model_states\.pt: checkpoint file is corrupt"):
        loading.load(FileEngine({}), loading.latest())
    assert stored_files(staging) == set()


def test_save_and_load_memory_is_bounded_by_the_part_size_not_the_checkpoint(tmp_path, peak_bytes):
    part = 2 * MiB
    engine = FileEngine({"ds/mp_rank_00_model_states.pt": 12 * part + 5, "ds/zero_pp_rank_0_optim.pt": 6 * part})
    committer = CheckpointCommitter(str(tmp_path / "run"), rank=0, world_size=1, keep_last=1, part_size=part)
    committer.save(engine, 1, extra={})  # warm-up: imports, first-use caches
    saving = peak_bytes(lambda: committer.save(engine, 2, extra={}))
    loaded = FileEngine({})
    loading = peak_bytes(lambda: committer.load(loaded, committer.latest()))
    assert loaded.loaded == engine.saved
    # Whole files would be 24 MiB; a part is 2 MiB. (FileEngine itself writes 1 MiB at a time.)
    assert saving < 3 * part, f"a save peaked at {saving / MiB:.1f} MiB of Python allocations"
    assert loading < 3 * part, f"a load peaked at {loading / MiB:.1f} MiB of Python allocations"


# ---------------------------------------------------------------------------------------------------------
# Ray Train's experiment directory is the run directory
# ---------------------------------------------------------------------------------------------------------


def test_ray_train_storage_is_the_run_dir_and_forgets_checkpoints_retention_deleted(engine, tmp_path):
    """Ray's own CheckpointManager (internal API, Ray 2.60) reloads its record of reported checkpoints when a run
    is submitted again, and refuses to start if one of them is gone: retention deletes them."""
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        CheckpointManager,
        _CheckpointManagerState,
        _TrainingResultState,
    )
    from ray.train.v2._internal.execution.storage import StorageContext

    run = tmp_path / "runs" / "my-run"
    committer = CheckpointCommitter(str(run), rank=0, world_size=1, keep_last=2)
    args = ray_train_storage(str(run))
    assert (args["name"], args["storage_path"]) == ("my-run", str(tmp_path / "runs"))
    ray_storage = StorageContext(args["storage_path"], args["name"], args["storage_filesystem"])
    assert ray_storage.experiment_fs_path == str(run)

    # As Ray records three reported checkpoints (its snapshot, in its own schema), while retention keeps two.
    for step in (1, 2, 3):
        committer.save(engine, step, extra={})
    names = [f"checkpoints/step-0000000{s}" for s in (1, 2, 3)]
    results = [_TrainingResultState(checkpoint_dir_name=n, metrics={"step": i + 1}) for i, n in enumerate(names)]
    snapshot = _CheckpointManagerState(
        checkpoint_results=results,
        checkpoint_report_indices=[0, 1, 2],
        latest_checkpoint_result=results[-1],
        pending_training_results=[],
        pending_validation_specs=[],
        current_report_index=3,
        validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[names[0]],
    )
    (run / "checkpoint_manager_snapshot.json").write_text(snapshot.json())
    assert committed_steps(committer) == [2, 3]
    with pytest.raises(CheckpointManagerInitializationError, match="does not exist anymore"):
        CheckpointManager(CheckpointConfig(), ray_storage)  # what the next submission would meet

    ray_train_storage(str(run))
    manager = CheckpointManager(CheckpointConfig(), ray_storage)
    assert [r.checkpoint.path for r in manager.best_checkpoint_results] == [str(run / n) for n in names[1:]]
    assert manager.latest_checkpoint_result.checkpoint.path == str(run / names[2])

    # A record this version cannot read is removed: Ray starts a new one instead of refusing to start.
    (run / "checkpoint_manager_snapshot.json").write_text('{"ray_version": "0.0"}')
    ray_train_storage(str(run))
    assert not (run / "checkpoint_manager_snapshot.json").exists()
    assert CheckpointManager(CheckpointConfig(), ray_storage).latest_checkpoint_result is None


@pytest.mark.parametrize(
    ("async_upload", "expected"),
    [
        (False, [(2, 2), (4, 4), (5, None), (6, 6)]),
        # A save is known committed at the next save (or wait): its checkpoint goes then, with its own metrics.
        (True, [(2, None), (2, 2), (5, None), (4, 4), (6, 6)]),
    ],
)
def test_ray_train_reports_attach_each_commit_once_with_its_own_steps_metrics(
    tmp_path, monkeypatch, async_upload, expected
):
    sent = []  # ray.train.report needs a Ray Train worker: what would be reported, as (metrics' step, checkpoint's)
    monkeypatch.setattr(
        checkpoint_module,
        "_report_to_ray_train",
        lambda metrics, info: sent.append((metrics["step"], info and info.step)),
    )
    committer = CheckpointCommitter(str(tmp_path), rank=0, world_size=1, keep_last=5, async_upload=async_upload)
    reports = RayTrainReports(committer)
    engine = FileEngine({"ds/mp_rank_00_model_states.pt": 1000})
    for step in range(1, 7):
        saving = step % 2 == 0
        if saving:
            committer.save(engine, step, extra={})
        if saving or step == 5:
            reports.report({"step": step}, step=step, saved=saving)
    committer.wait()
    reports.finish()
    assert sent == expected
