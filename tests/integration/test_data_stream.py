"""Streaming shards through Ray Data into workers: exactly once, deterministic, resumable, bad shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pylon.data.reader import ShardStream
from pylon.data.shards import BadShardError, DataError
from pylon.data.testing import synthetic_tokens, write_synthetic_dataset

pytestmark = pytest.mark.integration
SEQ = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, ray_cluster):
    uri = str(tmp_path_factory.mktemp("ds") / "synthetic")
    write_synthetic_dataset(uri, rows=1000, rows_per_shard=130, seq_len=SEQ)
    return uri


def _run(stream: ShardStream, epochs: int = 1, stop_after: int | None = None) -> list[list[int]]:
    """Sample ids per batch; checks every batch's tokens are that sample's tokens."""
    out = []
    for _ in range(epochs):
        for batch in stream.epoch():
            assert (batch.tokens == synthetic_tokens(batch.sample_ids, SEQ)).all()
            out.append(batch.sample_ids.tolist())
            if stop_after is not None and len(out) == stop_after:
                return out
    return out


def _flat(batches) -> list[int]:
    return [i for b in batches for i in b]


def test_two_workers_two_epochs_see_every_sample_once(dataset):
    per_epoch = []
    for epoch in range(2):
        ids = []
        for rank in range(2):
            s = ShardStream(dataset, batch_size=32, rank=rank, world_size=2, seed=7, shuffle_buffer=100)
            s.position.epoch = epoch
            batches = _run(s)
            assert len(batches) == s.steps_per_epoch == 16
            ids.append(_flat(batches))
        assert sorted(ids[0] + ids[1]) == list(range(1000))
        assert not set(ids[0]) & set(ids[1])
        per_epoch.append(ids)
    assert per_epoch[0] != per_epoch[1]  # reshuffled each epoch
    again = ShardStream(dataset, batch_size=32, rank=1, world_size=2, seed=7, shuffle_buffer=100)
    assert _flat(_run(again)) == per_epoch[0][1]  # same seed, same order
    other = ShardStream(dataset, batch_size=32, rank=1, world_size=2, seed=8, shuffle_buffer=100)
    assert _flat(_run(other)) != per_epoch[0][1]


@pytest.mark.parametrize("stop_after", [1, 5, 13, 31, 40])
def test_resume_continues_exactly_where_it_stopped(dataset, stop_after):
    def make():
        return ShardStream(dataset, batch_size=24, rank=0, world_size=1, seed=3, shuffle_buffer=50)

    uninterrupted = _run(make(), epochs=2)
    first = make()
    head = _run(first, epochs=2, stop_after=stop_after)
    saved = json.loads(json.dumps(first.state_dict()))  # as it would be stored in a checkpoint
    resumed = make()
    resumed.load_state_dict(saved)
    tail = []
    while resumed.position.epoch < 2:
        tail += _run(resumed)
    assert head + tail == uninterrupted


def test_resume_refuses_a_position_from_another_stream(dataset):
    a = ShardStream(dataset, batch_size=8, seed=1)
    b = ShardStream(dataset, batch_size=8, seed=2, world_size=2)
    with pytest.raises(DataError, match="seed: saved 1, now 2.*world_size: saved 1, now 2"):
        b.load_state_dict(a.state_dict())


def test_validation_split_is_disjoint_and_unshuffled(dataset):
    train = ShardStream(dataset, batch_size=50, validation_fraction=0.1, seed=0)
    val = ShardStream(dataset, batch_size=50, validation_fraction=0.1, split="validation")
    t, v = _flat(_run(train)), _flat(_run(val))
    assert v == list(range(900, 1000)) and sorted(t) == list(range(900))


def test_stats_count_rows_tokens_bytes_and_waiting(dataset):
    from pylon.data.shards import read_manifest

    s = ShardStream(dataset, batch_size=100)
    _run(s)
    stats = s.stats.as_dict()
    assert stats["rows"] == 1000 and stats["tokens"] == 1000 * SEQ
    assert stats["bytes_read"] == read_manifest(dataset).totals.bytes
    assert stats["wait_s"] > 0 and stats["rows_per_s"] > 0 and stats["tokens_per_s"] > 0


def test_reads_from_s3(ray_cluster, s3_root):
    uri = f"{s3_root}/ds"
    write_synthetic_dataset(uri, rows=300, rows_per_shard=64, seq_len=SEQ, fmt="webdataset")
    s = ShardStream(uri, batch_size=32, seed=5, shuffle_buffer=40)
    assert sorted(_flat(_run(s))) == list(range(300))


@pytest.fixture
def damaged(tmp_path, ray_cluster):
    def make(fmt: str, damage: str):
        uri = str(tmp_path / f"{fmt}-{damage}")
        m = write_synthetic_dataset(uri, rows=400, rows_per_shard=100, seq_len=SEQ, fmt=fmt)
        victim = Path(uri) / m.shards[2].file
        data = bytearray(victim.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[len(data) // 3] ^= 0x40
        if damage == "missing":
            victim.unlink()
        else:
            victim.write_bytes(bytes(data))
        return uri, m.shards[2].file

    return make


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_a_bad_shard_is_named_or_skipped_and_counted(damaged, fmt, damage):
    uri, victim = damaged(fmt, damage)
    before = {p.name: p.stat().st_mtime_ns for p in Path(uri).iterdir()}
    with pytest.raises(BadShardError, match=rf"shard {victim}: .*on_bad_shard: skip"):
        _run(ShardStream(uri, batch_size=32, shuffle_buffer=0))
    s = ShardStream(uri, batch_size=32, on_bad_shard="skip", shuffle_buffer=0)
    ids = _flat(_run(s))
    assert s.stats.skipped_shards == [victim]
    assert sorted(ids) == [i for i in range(400) if not 200 <= i < 300]
    # Nothing is written back to the input.
    assert {p.name: p.stat().st_mtime_ns for p in Path(uri).iterdir()} == before


def test_missing_dataset_empty_dataset_and_wrong_seq_len(tmp_path, ray_cluster):
    with pytest.raises(DataError, match=r"no manifest.json; no dataset was prepared there"):
        ShardStream(str(tmp_path / "nowhere"), batch_size=4)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "part-x-00000.parquet").write_bytes(b"junk")
    with pytest.raises(DataError, match="a `prepare` did not finish"):
        ShardStream(str(tmp_path / "half"), batch_size=4)
    uri = str(tmp_path / "ok")
    write_synthetic_dataset(uri, rows=10, rows_per_shard=10, seq_len=SEQ)
    with pytest.raises(DataError, match=r"prepared with seq_len 16, the job asks for 32"):
        ShardStream(uri, batch_size=4, seq_len=32)
    empty = str(tmp_path / "empty")
    write_synthetic_dataset(empty, rows=0, rows_per_shard=10, seq_len=SEQ)
    with pytest.raises(DataError, match="the dataset is empty"):
        ShardStream(empty, batch_size=4)


def test_wait_fraction_separates_waiting_from_the_consumers_work(dataset):
    import time as _time

    s = ShardStream(dataset, batch_size=100)
    for _ in s.epoch():
        _time.sleep(0.05)  # the consumer's "training step"
    assert s.stats.step_s >= 0.05 * 9
    assert 0 < s.stats.wait_fraction < 1
    assert s.stats.as_dict()["wait_fraction"] == round(s.stats.wait_fraction, 4)


def test_record_fields_ride_with_their_rows_through_shuffling_workers_and_resume(tmp_path, ray_cluster):
    """A prompts dataset whose records carry other fields (`ShardManifest.record_fields`): every batch's records are
    its own rows' documents' (their prompts decoded beside them), on two shuffling workers, and after a resume."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
    from test_chat_data import _jsonl

    from pylon.data.prepare import prepare
    from pylon.jobs.grpo import prompts_and_answers

    records = [{"prompt": f"prompt {i} " + "y" * (i % 9), "answer": "a", "n": i} for i in range(300)]
    uri = str(tmp_path / "prompts")
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", records)], uri, seq_len=48, prompts=True, use_ray=False,
                       progress=False, shard_size_mb=20 * 48 * 4 / 2**20)  # fmt: skip
    assert manifest.record_fields == ["n"] and len(manifest.shards) > 3

    def seen(stream: ShardStream, stop_after: int | None = None) -> list[int]:
        out = []
        for k, batch in enumerate(stream.epoch()):
            assert batch.records is not None and len(batch.records) == len(batch)
            for prompt, _, fields in prompts_and_answers(batch, manifest.tokenizer.eos_id):
                assert bytes(prompt.tolist()).decode().startswith(f"prompt {fields['n']} ")
                out.append(fields["n"])
            if stop_after is not None and k + 1 == stop_after:
                break
        return out

    def stream(**kw) -> ShardStream:
        return ShardStream(uri, batch_size=4, world_size=2, seed=3, shuffle_buffer=16, records=True, **kw)

    both = [seen(stream(rank=r)) for r in range(2)]
    assert sorted(both[0] + both[1]) == list(range(300))
    first = stream(rank=1)
    head = seen(first, stop_after=5)
    resumed = stream(rank=1)
    resumed.load_state_dict(first.state_dict())
    assert head + seen(resumed) == both[1]
    batches = ShardStream(uri, batch_size=4).epoch()
    assert next(batches).records is None  # (not asked for: never read)
    batches.close()


def test_a_stream_stopped_early_lets_its_reads_end_instead_of_cancelling_them(tmp_path, ray_cluster):
    """Ray Data cancels the tasks still running when an iteration stops early, and in Ray 2.60 a cancel racing a
    task's reply aborts the calling process (it ended a CI run here). The reader's iteration lets them end: every
    read that started ends, those still running when the consumer stopped included. (With Ray Data's own ending,
    the reads still sleeping when the consumer stops are killed: started, never ended.)"""
    import time

    import pyarrow as pa
    import ray
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    from pylon import home
    from pylon.data.reader import iter_without_cancelling

    marks = tmp_path / "marks"
    marks.mkdir()

    def read(i: int):
        (marks / f"{i}.start").write_text(str(time.time()))
        time.sleep(0.1 if i == 0 else 3.0)  # the first block arrives while the other reads still run
        (marks / f"{i}.end").write_text(str(time.time()))
        return [pa.table({"i": [i]})]

    class SlowReads(Datasource):
        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda i=i: read(i), BlockMetadata(1, 8, None, None)) for i in range(4)]

        def estimate_inmemory_data_size(self):
            return 32

    if not ray.is_initialized():
        home.init_ray()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # (as the reader sets it: block 0 first)
    ds = ray.data.read_datasource(SlowReads(), override_num_blocks=4, concurrency=2, num_cpus=0.25)
    for _ in iter_without_cancelling(ds, batch_size=None, prefetch_batches=0):
        stopped = time.time()
        break
    started = {p.stem for p in marks.glob("*.start")}
    ended = {p.stem for p in marks.glob("*.end")}
    assert started == ended, f"reads started but never ended (cancelled): {sorted(started - ended)}"
    # a read still running when the consumer stopped ran to its end (cancelled, none would end after the stop)
    assert any(float((marks / f"{s}.end").read_text()) > stopped for s in ended), "no read outlived the stop"
