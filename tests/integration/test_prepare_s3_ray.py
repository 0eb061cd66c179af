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
    return data


def test_ray_and_local_runs_write_identical_shards_to_s3(ray_cluster, s3_root, corpus, small_groups, caplog):
    caplog.set_level("INFO", logger="pylon.data")
    on_ray = prepare([str(corpus)], f"{s3_root}/ray", seq_len=128, shard_size_mb=0.05, use_ray=True,
                     progress=False)
    assert any("on the Ray cluster" in r.getMessage() for r in caplog.records)
    here = prepare([str(corpus)], f"{s3_root}/local", seq_len=128, shard_size_mb=0.05, use_ray=False,
                   progress=False)
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
        rows = decode_shard("parquet", storage.read_bytes(f"{s3_root}/ray/{shard.file}"), shard=shard.file,
                            seq_len=128, dtype="uint16")
        got += [row[:n] for row, n in zip(rows.tokens, rows.num_tokens)]
    assert np.array_equal(np.concatenate(got), expected)


def test_s3_sources_on_ray_match_the_same_files_on_local_disk(ray_cluster, s3_root, corpus, small_groups, tmp_path,
                                                              caplog):
    caplog.set_level("INFO", logger="pylon.data")
    upload_dir(corpus, f"{s3_root}/src")
    from_s3 = prepare([f"{s3_root}/src"], f"{s3_root}/out", fmt="webdataset", seq_len=64, shard_size_mb=0.05,
                      use_ray=None, progress=False)  # None: the session's cluster is up, so Ray
    assert any("on the Ray cluster" in r.getMessage() for r in caplog.records)
    from_disk = prepare([str(corpus)], str(tmp_path / "out"), fmt="webdataset", seq_len=64, shard_size_mb=0.05,
                        use_ray=False, progress=False)
    assert [s.sha256 for s in from_s3.shards] == [s.sha256 for s in from_disk.shards]
    assert from_s3.sources == [f"{s3_root}/src"]
    assert storage.listdir(f"{s3_root}/src") == sorted(["stdlib", "notes-0.txt", "notes-1.txt", "notes-2.txt",
                                                        "notes-3.txt", "legacy.txt", ".cache"])  # untouched


def test_a_bad_jsonl_line_in_a_ray_task_is_the_tasks_own_error(ray_cluster, s3_root, tmp_path):
    good = "\n".join(f'{{"text": "document {i}"}}' for i in range(50))
    storage.atomic_write(f"{s3_root}/src/a.jsonl", good.encode())
    storage.atomic_write(f"{s3_root}/src/b.jsonl", (good + '\n{"txt": "typo"}\n').encode())
    with pytest.raises(DataError) as caught:
        prepare([f"{s3_root}/src"], f"{s3_root}/out", use_ray=True, progress=False)
    assert str(caught.value) == (f"{s3_root}/src/b.jsonl: line 51: no 'text' field (has ['txt']); "
                                 "choose the field with --text-field")
    assert storage.listdir(f"{s3_root}/out") == []


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
    cmd = [sys.executable, "-m", "pylon.cli", "data", "prepare", *sources, "--out", f"{s3_root}/cli",
           "--seq-len", "256", "--shard-size-mb", "0.5"]
    env = {**os.environ, "PYLON_HOME": str(pylon_home)}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert f"on the Ray cluster at {ray_cluster.dashboard_url}" in first.stderr
    old = read_manifest(f"{s3_root}/cli")
    again = subprocess.run(cmd + ["--overwrite", "--format", "webdataset"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    new = read_manifest(f"{s3_root}/cli")
    assert storage.listdir(f"{s3_root}/cli") == sorted(["manifest.json", *(s.file for s in new.shards)])
    assert new.totals.tokens == old.totals.tokens and new.format == "webdataset"
    shown = subprocess.run([sys.executable, "-m", "pylon.cli", "data", "inspect", f"{s3_root}/cli", "--verify"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and f"verified {len(new.shards)} shard(s)" in shown.stdout
