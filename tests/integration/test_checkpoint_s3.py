"""pylon.jobs.checkpoint against the real S3-protocol server, and a process SIGKILLed in the middle of a save.

Run as a program, this file is that process: `python test_checkpoint_s3.py RUN_URI PAUSE_AT REF_DIR STAGING`
commits step 10, then starts saving step 20 and stops (prints PAUSED, sleeps) just before writing the file
whose name ends with PAUSE_AT, for the test to kill it there.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "jobs"))
# One copy of the engine and the one-process world, shared with the unit tests (`distributed` is autouse).
from test_checkpoint import build_engine, distributed, train_step, weights  # noqa: E402, F401

from pylon import storage  # noqa: E402
from pylon.errors import PylonError  # noqa: E402
from pylon.jobs.checkpoint import CheckpointCommitter  # noqa: E402

pytestmark = pytest.mark.integration


def _committed(committer: CheckpointCommitter) -> list[int]:
    return [info.step for info in committer.list_committed()]


def _raw_keys(s3_root: str) -> list[str]:
    """Every object under `s3_root` as an independent client lists them."""
    import boto3

    bucket, _, prefix = s3_root.removeprefix("s3://").partition("/")
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(obj["Key"][len(prefix) + 1 :] for page in pages for obj in page.get("Contents", []))


def test_save_load_retention_and_corruption_on_s3(s3_root, tmp_path):
    a = build_engine(seed=0)
    async_committer = CheckpointCommitter(
        s3_root, rank=0, world_size=1, keep_last=2, keep_every=2, async_upload=True, staging_dir=tmp_path / "staging"
    )
    for step in (1, 2):
        train_step(a, step)
        async_committer.save(a, step, extra={"data": {"batches": step}}, meta={"tokens": 32 * step})
    async_committer.wait()
    committer = CheckpointCommitter(s3_root, rank=0, world_size=1, keep_last=2, keep_every=2)
    for step in (3, 4, 5):
        train_step(a, step)
        committer.save(a, step, extra={"data": {"batches": step}}, meta={"tokens": 32 * step})
    saved = weights(a)
    uninterrupted = [train_step(a, step) for step in (6, 7)]

    # Newest two (4, 5) and every 2nd (2, 4); 1 and 3 are gone, object by object.
    assert _committed(committer) == [2, 4, 5]
    keys = _raw_keys(s3_root)
    assert {k.split("/")[1] for k in keys if k.startswith("checkpoints/")} == {
        "step-00000002",
        "step-00000004",
        "step-00000005",
    }
    assert [k for k in keys if k.startswith("checkpoints/step-00000005/")] == [
        "checkpoints/step-00000005/ds/mp_rank_00_model_states.pt",
        "checkpoints/step-00000005/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "checkpoints/step-00000005/manifest.json",
        "checkpoints/step-00000005/rank-0.json",
        "checkpoints/step-00000005/zero_to_fp32.py",
        "checkpoints/step-00000005/zero_to_torch.py",
    ]
    assert not [k for k in keys if ".tmp-" in k], "atomic-write temporaries left behind"
    assert storage.read_json(storage.join(s3_root, "latest.json")) == {"step": 5, "path": "checkpoints/step-00000005"}

    b = build_engine(seed=1)
    info = committer.latest()
    assert (info.step, info.manifest["meta"]) == (5, {"tokens": 160})
    assert committer.load(b, info) == {"data": {"batches": 5}}
    assert all(torch.equal(v, saved[k]) for k, v in weights(b).items())
    assert [train_step(b, step) for step in (6, 7)] == pytest.approx(uninterrupted, rel=1e-5)  # see unit test

    # One flipped byte in a stored shard is caught, and named, before DeepSpeed reads anything.
    older = committer.list_committed()[1]
    shard = storage.join(older.uri, "ds", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    data = bytearray(storage.read_bytes(shard))
    data[100] ^= 0x01
    storage.atomic_write(shard, bytes(data))
    with pytest.raises(
        PylonError,
        match=r"step-00000004/ds/zero_pp_rank_0_mp_rank_00_optim_states\.pt: "
        r"checkpoint file is corrupt",
    ):
        committer.load(b, older)


# ---------------------------------------------------------------------------------------------------------
# SIGKILL in the middle of a save
# ---------------------------------------------------------------------------------------------------------


def _run_until_paused(run_uri: str, pause_at: str, ref_dir: Path, staging_dir: Path, log_path: Path) -> None:
    """Start the saving process, wait until it pauses before writing `pause_at`, SIGKILL it."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, run_uri, pause_at, str(ref_dir), str(staging_dir)],
            stdout=subprocess.PIPE,
            stderr=log,
            env=os.environ.copy(),
        )
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + 180
            buffered = b""
            while b"PAUSED" not in buffered:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or proc.poll() is not None:
                    raise AssertionError(
                        f"the saving process never paused (exit {proc.poll()}); its log:\n"
                        + log_path.read_text()[-4000:]
                    )
                if sel.select(timeout=min(remaining, 1.0)):
                    buffered += os.read(proc.stdout.fileno(), 4096)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("where", "pause_at", "latest_after_kill"),
    [
        # mid-upload of DeepSpeed's files (on S3 in make test, below; on a filesystem in make test-all)
        pytest.param("local", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", 10, marks=pytest.mark.slow),
        # every file and rank-0.json stored, commit marker not yet (make test-all)
        pytest.param("local", "manifest.json", 10, marks=pytest.mark.slow),
        ("local", "latest.json", 20),  # committed; the pointer still names step 10
        ("s3", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", 10),
    ],
)
def test_sigkill_during_save_keeps_the_previous_checkpoint(request, tmp_path, where, pause_at, latest_after_kill):
    run_uri = request.getfixturevalue("s3_root") if where == "s3" else str(tmp_path / "run")
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    _run_until_paused(run_uri, pause_at, ref_dir, tmp_path / "staging", tmp_path / "child.log")

    step20 = storage.join(run_uri, "checkpoints", "step-00000020")
    assert storage.exists(step20), "the killed save had started writing step 20"
    assert storage.read_json(storage.join(run_uri, "latest.json"))["step"] == 10
    committer = CheckpointCommitter(run_uri, rank=0, world_size=1, keep_last=2)
    info = committer.latest()
    assert info.step == latest_after_kill
    engine = build_engine(seed=3)
    assert committer.load(engine, info) == {"step": latest_after_kill}
    expected = torch.load(ref_dir / f"{latest_after_kill}.pt")
    assert all(torch.equal(v, expected[k]) for k, v in weights(engine).items())

    # The next commit's retention removes the partial step 20 (older than the newest commit).
    committer.save(engine, 30, extra={"step": 30})
    assert _committed(committer) == sorted({latest_after_kill, 30})
    assert storage.exists(step20) == (latest_after_kill == 20)


def _save_until_paused(run_uri: str, pause_at: str, ref_dir: Path, staging_dir: Path) -> None:
    import deepspeed
    from test_checkpoint import _free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    armed = False

    def pause(uri: str) -> None:
        if armed and uri.endswith(pause_at):
            print("PAUSED", uri, flush=True)
            time.sleep(600)

    committer = CheckpointCommitter(
        run_uri, rank=0, world_size=1, keep_last=2, staging_dir=staging_dir, before_write=pause
    )
    engine = build_engine(seed=0)
    for step in (10, 20):
        train_step(engine, step)
        torch.save(weights(engine), ref_dir / f"{step}.pt")
        armed = step == 20
        committer.save(engine, step, extra={"step": step})
    raise SystemExit("step 20 was saved without pausing: nothing matched " + json.dumps(pause_at))


if __name__ == "__main__":
    _save_until_paused(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
