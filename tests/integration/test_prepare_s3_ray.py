"""`prepare` on the session's real Ray cluster and real S3-protocol server (moto).

Ray and in-process runs must write byte-identical shards; s3:// sources give the same shards as the same
files on local disk; `inspect --verify` reads every shard back from S3 and names a damaged one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import pylon.data.prepare as prepare_module
from pylon import storage
from pylon.data.inspect import inspect
from pylon.data.prepare import prepare
from pylon.data.shards import DataError, decode_shard, read_manifest
from pylon.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.integration

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "tinyshakespeare.txt"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A few hundred KiB: standard-library sources, generated text, hidden files and one Latin-1 file."""
    root = tmp_path / "corpus"
    (root / "stdlib").mkdir(parents=True)
    for name in ("argparse.py", "textwrap.py", "fnmatch.py", "shlex.py", "keyword.py"):
        (root / "stdlib" / name).write_bytes((STDLIB / name).read_bytes())
    rng = np.random.default_rng(0)
    words = ["ray", "shard", "token", "schön", "日本語", "🦊", "\n"]
    for i in range(4):
        (root / f"notes-{i}.txt").write_text(" ".join(rng.choice(words, 4000).tolist()), encoding="utf-8")
    (root / "legacy.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / ".cache").mkdir()
    (root / ".cache" / "skip.txt").write_text("hidden")
    return root


@pytest.fixture
def small_groups(monkeypatch):
    # ~64 KiB of source per group: several Ray tasks over this corpus, as a large corpus would have.
    monkeypatch.setattr(prepare_module, "GROUP_BYTES", 64 * 2**10)


def upload_dir(local: Path, uri: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            storage.atomic_write(storage.join(uri, str(path.relative_to(local))), path.read_bytes())


def comparable(manifest) -> dict:
    """The manifest without what differs between runs by design: run id, shard names, time."""
    data = manifest.model_dump(exclude={"created_at", "run_id", "sources"})
    for shard in data["shards"]:
        shard.pop("file")
        if shard["records"]:
            shard["records"].pop("file")
    return data


def test_ray_and_local_runs_write_identical_shards_to_s3(ray_cluster, s3_root, corpus, small_groups, caplog):
    caplog.set_level("INFO", logger="pylon.data")
    on_ray = prepare([str(corpus)], f"{s3_root}/ray", seq_len=128, shard_size_mb=0.05, use_ray=True, progress=False)
    assert any("on the Ray cluster" in r.getMessage() for r in caplog.records)
    here = prepare([str(corpus)], f"{s3_root}/local", seq_len=128, shard_size_mb=0.05, use_ray=False, progress=False)
    assert len(on_ray.shards) >= 3 and on_ray.totals.skipped_files == 1
    assert [s.sha256 for s in on_ray.shards] == [s.sha256 for s in here.shards]
    assert comparable(on_ray) == comparable(here)
    assert read_manifest(f"{s3_root}/ray") == on_ray

    # And the shards hold the documents: sorted, hidden and Latin-1 files left out, each followed by eos.
    order = sorted(p for p in corpus.rglob("*") if p.is_file() and ".cache" not in p.parts and p.name != "legacy.txt")
    order.sort(key=lambda p: p.relative_to(corpus).parts)
    tok = load_tokenizer("byte")
    expected = np.concatenate([np.append(tok.encode(p.read_text(encoding="utf-8")), tok.eos_id) for p in order])
    got = []
    for shard in on_ray.shards:
        rows = decode_shard(
            "parquet", storage.read_bytes(f"{s3_root}/ray/{shard.file}"), shard=shard.file, seq_len=128, dtype="uint16"
        )
        got += [row[:n] for row, n in zip(rows.tokens, rows.num_tokens)]
    assert np.array_equal(np.concatenate(got), expected)


def test_records_other_fields_on_ray_match_an_in_process_run(ray_cluster, s3_root, tmp_path, monkeypatch):
    """A prompts dataset whose records carry other fields, in files some of which have none, tokenized by Ray tasks a
    file each: the same shards and records files (by sha256) as in this process."""
    import json

    monkeypatch.setattr(prepare_module, "GROUP_BYTES", 1)
    src = tmp_path / "prompts"
    src.mkdir()
    for f in range(5):
        lines = []
        for i in range(12):
            record = {"prompt": f"file {f} question {i}: " + "x" * (i * 5 % 17), "answer": str(i)}
            if f in (0, 4) and i % 3:  # (files 1-3 have none: a shard of their rows alone has no records file)
                record |= {"id": f"{f}-{i}", "tests": [i, i + 1]}
            lines.append(json.dumps(record))
        (src / f"{f}.jsonl").write_text("\n".join(lines) + "\n")
    kw = {"seq_len": 64, "prompts": True, "shard_size_mb": 7 * 64 * 4 / 2**20, "progress": False}
    on_ray = prepare([str(src)], f"{s3_root}/rec-ray", use_ray=True, **kw)
    here = prepare([str(src)], f"{s3_root}/rec-local", use_ray=False, **kw)
    assert on_ray.record_fields == ["id", "tests"] and len(on_ray.shards) > 3
    assert any(s.records is None for s in here.shards) and any(s.records for s in here.shards)
    assert comparable(on_ray) == comparable(here)
    _, problems = inspect(f"{s3_root}/rec-ray", verify=True, progress=False)
    assert problems == []


def test_s3_sources_on_ray_match_the_same_files_on_local_disk(
    ray_cluster, s3_root, corpus, small_groups, tmp_path, caplog
):
    caplog.set_level("INFO", logger="pylon.data")
    upload_dir(corpus, f"{s3_root}/src")
    from_s3 = prepare(
        [f"{s3_root}/src"],
        f"{s3_root}/out",
        fmt="webdataset",
        seq_len=64,
        shard_size_mb=0.05,
        use_ray=None,
        progress=False,
    )  # None: the session's cluster is up, so Ray
    assert any("on the Ray cluster" in r.getMessage() for r in caplog.records)
    from_disk = prepare(
        [str(corpus)],
        str(tmp_path / "out"),
        fmt="webdataset",
        seq_len=64,
        shard_size_mb=0.05,
        use_ray=False,
        progress=False,
    )
    assert [s.sha256 for s in from_s3.shards] == [s.sha256 for s in from_disk.shards]
    assert from_s3.sources == [f"{s3_root}/src"]
    assert storage.listdir(f"{s3_root}/src") == sorted(
        ["stdlib", "notes-0.txt", "notes-1.txt", "notes-2.txt", "notes-3.txt", "legacy.txt", ".cache"]
    )  # untouched


def test_a_bad_jsonl_line_in_a_ray_task_is_the_tasks_own_error(ray_cluster, s3_root, tmp_path):
    good = "\n".join(f'{{"text": "document {i}"}}' for i in range(50))
    storage.atomic_write(f"{s3_root}/src/a.jsonl", good.encode())
    storage.atomic_write(f"{s3_root}/src/b.jsonl", (good + '\n{"txt": "typo"}\n').encode())
    with pytest.raises(DataError) as caught:
        prepare([f"{s3_root}/src"], f"{s3_root}/out", use_ray=True, progress=False)
    assert str(caught.value) == (
        f"{s3_root}/src/b.jsonl: line 51: no 'text' field (has ['txt']); choose the field with --text-field"
    )
    assert storage.listdir(f"{s3_root}/out") == []


def _timed_task(marks: str, index: int, fail_at: int) -> int:
    """A stand-in for a group's task: records when it ran (on this machine's disk), fails at `fail_at`."""
    import time

    started = time.time()
    time.sleep(0.3)
    Path(marks, f"{index}").write_text(f"{started} {time.time()}")
    if index == fail_at:
        raise ValueError(f"task {index} failed")
    return index


def test_ray_tasks_stay_bounded_and_a_failure_waits_for_them_instead_of_cancelling(ray_cluster, tmp_path, monkeypatch):
    """`ray.cancel` racing with a task's reply aborted the whole test session twice in CI (a check in Ray's
    core worker): prepare never cancels. At most `per_cpu` tasks per CPU run at once (zero-CPU tasks here, so
    Ray itself would run all 40 together); after a failure nothing new starts, and what is in flight finishes."""
    import ray

    prepare_module._ray_executor(True, [str(tmp_path)])  # connects this process, as prepare does

    def no_cancel(*args, **kwargs):
        raise AssertionError("ray.cancel was called")

    monkeypatch.setattr(ray, "cancel", no_cancel)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module
    marks = tmp_path / "marks"
    marks.mkdir()
    task = ray.remote(num_cpus=0, max_retries=0)(_timed_task)
    limit = prepare_module.in_flight_limit(per_cpu=1)
    submitted, results = [], []

    def submit(i: int, fail_at: int):
        submitted.append(i)
        return task.remote(str(marks), i, fail_at)

    with pytest.raises(ray.exceptions.RayTaskError, match="task 5 failed"):
        prepare_module._run_bounded(lambda i: submit(i, 5), 40, lambda i, r: results.append(r), per_cpu=1)
    assert max(submitted) < 5 + limit, submitted  # nothing started after the failure was seen
    assert sorted(int(n) for n in os.listdir(marks)) == sorted(submitted)  # those in flight finished
    spans = [tuple(map(float, (marks / n).read_text().split())) for n in os.listdir(marks)]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= limit

    # Without a failure: every task once, each result with its index.
    results.clear()
    prepare_module._run_bounded(lambda i: submit(i, -1), 12, lambda i, r: results.append((i, r)), per_cpu=1)
    assert sorted(results) == [(i, i) for i in range(12)]


def test_verify_on_s3_names_a_damaged_shard(ray_cluster, s3_root, corpus, small_groups):
    out = f"{s3_root}/verify"
    manifest = prepare([str(corpus)], out, seq_len=256, shard_size_mb=0.05, use_ray=True, progress=False)
    assert inspect(out, verify=True, progress=False) == (manifest, [])
    victim = manifest.shards[1]
    data = bytearray(storage.read_bytes(f"{out}/{victim.file}"))
    data[100] ^= 0xFF
    storage.atomic_write(f"{out}/{victim.file}", bytes(data))
    _, problems = inspect(out, verify=True, progress=False)
    assert len(problems) == 1 and problems[0].startswith(f"shard {victim.file}: sha256")


def test_cli_uses_the_running_cluster_and_overwrites_on_s3(ray_cluster, s3_root, corpus, pylon_home):
    sources = [str(corpus)] + ([str(SHAKESPEARE)] if SHAKESPEARE.exists() else [])
    cmd = [
        sys.executable,
        "-m",
        "pylon.cli",
        "data",
        "prepare",
        *sources,
        "--out",
        f"{s3_root}/cli",
        "--seq-len",
        "256",
        "--shard-size-mb",
        "0.5",
    ]
    env = {**os.environ, "PYLON_HOME": str(pylon_home)}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert f"on the Ray cluster at {ray_cluster.dashboard_url}" in first.stderr
    old = read_manifest(f"{s3_root}/cli")
    again = subprocess.run(
        cmd + ["--overwrite", "--format", "webdataset"], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    new = read_manifest(f"{s3_root}/cli")
    assert storage.listdir(f"{s3_root}/cli") == sorted(["manifest.json", *(s.file for s in new.shards)])
    assert new.totals.tokens == old.totals.tokens and new.format == "webdataset"
    shown = subprocess.run(
        [sys.executable, "-m", "pylon.cli", "data", "inspect", f"{s3_root}/cli", "--verify"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0 and f"verified {len(new.shards)} shard(s)" in shown.stdout
