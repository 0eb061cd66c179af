"""A disk filling up during a checkpoint: the local staging directory, or a run directory on local disk, on a
small tmpfs (tests/faults.py) that a test fills. The save fails with an error naming the path and saying what to
do; the previous checkpoint stays the latest and loads; once there is room again, the next save commits.
(Object storage unreachable during a save, and killed processes: tests/integration/test_train_faults.py and
tests/integration/test_checkpoint_s3.py.)"""

from __future__ import annotations

import re

import faults
import pytest
import torch

# One copy of the engine and the one-process world, shared with the committer's unit tests (`distributed` is autouse).
from test_checkpoint import build_engine, distributed, train_step, weights  # noqa: F401

from pylon.errors import PylonError, StorageError
from pylon.jobs.checkpoint import CheckpointCommitter


def _committed(committer: CheckpointCommitter) -> list[int]:
    return [info.step for info in committer.list_committed()]


def test_a_full_staging_disk_fails_the_save_naming_it_and_keeps_the_previous_checkpoint(tmp_path):
    engine = build_engine(seed=0)
    with faults.tmpfs(tmp_path / "staging", "8m") as staging:
        committer = CheckpointCommitter(str(tmp_path / "run"), rank=0, world_size=1, keep_last=3, staging_dir=staging)
        train_step(engine, 1)
        committer.save(engine, 1, extra={"at": 1})
        saved = weights(engine)
        train_step(engine, 2)
        filler = faults.fill(staging, leave=64 * 1024)
        with pytest.raises(PylonError) as err:
            committer.save(engine, 2, extra={"at": 2})
        message = str(err.value)
        assert re.search(
            rf"checkpoint step 2: no space left on the device holding the staging directory {staging}/\S+ "
            r"\([\d.]+ MiB free of 8\.0 MiB\)",
            message,
        ), message
        assert "previous checkpoint stays the latest" in message and "Free space there" in message
        assert not (tmp_path / "run" / "checkpoints" / "step-00000002").exists()  # nothing was uploaded
        assert sorted(p.name for p in staging.iterdir()) == ["filler.bin", "rank-0"]
        assert not list((staging / "rank-0").iterdir()), "the failed save's staged files were left behind"

        # A load staged on the full disk fails naming it; staged elsewhere (a restarted worker), step 1 loads.
        info = committer.latest()
        assert info.step == 1
        other = build_engine(seed=1)
        with pytest.raises(StorageError, match=rf"No space left on the device holding {staging}/rank-0/load-"):
            committer.load(other, info)
        elsewhere = CheckpointCommitter(str(tmp_path / "run"), rank=0, world_size=1, keep_last=3)
        assert elsewhere.load(other, info) == {"at": 1}
        assert all(torch.equal(v, saved[k]) for k, v in weights(other).items())

        filler.unlink()  # room again: the next save commits
        committer.save(engine, 2, extra={"at": 2})
        assert _committed(committer) == [1, 2]


def test_a_full_checkpoint_disk_fails_the_upload_naming_it_and_keeps_the_previous_checkpoint(tmp_path):
    engine = build_engine(seed=0)
    with faults.tmpfs(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        committer = CheckpointCommitter(str(run), rank=0, world_size=1, keep_last=3, staging_dir=tmp_path / "staging")
        train_step(engine, 1)
        committer.save(engine, 1, extra={"at": 1})
        saved = weights(engine)
        train_step(engine, 2)
        filler = faults.fill(disk, leave=256 * 1024)
        with pytest.raises(StorageError) as err:
            committer.save(engine, 2, extra={"at": 2})
        message = str(err.value)
        assert re.search(
            rf"{run}/checkpoints/step-00000002/\S+: cannot write: No space left on the device holding "
            rf"{run}/checkpoints/step-00000002/\S+ \([\d.]+ MiB free of 8\.0 MiB\); free space there",
            message,
        ), message
        partial = run / "checkpoints" / "step-00000002"
        assert not (partial / "manifest.json").exists()
        assert not [p for p in partial.rglob("*") if ".tmp-" in p.name], "a temporary file was left behind"
        assert (run / "latest.json").read_text().count('"step": 1') == 1

        info = committer.latest()
        assert info.step == 1
        other = build_engine(seed=1)
        assert committer.load(other, info) == {"at": 1}
        assert all(torch.equal(v, saved[k]) for k, v in weights(other).items())

        filler.unlink()
        train_step(engine, 3)
        committer.save(engine, 3, extra={"at": 3})
        assert _committed(committer) == [1, 3]
        assert not partial.exists(), "retention removes the partial step older than the newest commit"
