"""The epoch plan: every sample exactly once per epoch across workers, deterministic, balanced."""

from __future__ import annotations

import numpy as np
import pytest

from pylon.data.reader import epoch_plan, plan_rows, split_ids
from pylon.data.shards import ShardInfo, ShardManifest, TokenizerInfo, Totals


def _manifest(rows_per_shard: list[int]) -> ShardManifest:
    shards, first = [], 0
    for i, n in enumerate(rows_per_shard):
        shards.append(ShardInfo(file=f"s{i}.parquet", rows=n, tokens=n * 8, bytes=100, sha256="0" * 64, first_id=first))
        first += n
    return ShardManifest(
        format="parquet",
        seq_len=8,
        dtype="uint16",
        tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=320, eos_id=256, pad_id=257),
        shards=shards,
        totals=Totals(documents=1, rows=first, tokens=first * 8, bytes=100 * len(shards)),
    )


def _ids(segments) -> list[int]:
    return [i for s in segments for i in range(s.lo, s.hi)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_every_sample_exactly_once_per_epoch(world_size):
    m = _manifest([7, 30, 1, 16, 16, 5])
    for epoch in range(3):
        seen = []
        sizes = []
        for rank in range(world_size):
            segs = epoch_plan(m, id_range=(0, 75), seed=1, epoch=epoch, rank=rank, world_size=world_size)
            seen += _ids(segs)
            sizes.append(plan_rows(segs))
            assert [s.start for s in segs] == list(np.cumsum([0] + [s.rows for s in segs])[:-1])
        assert sorted(seen) == list(range(75))
        assert max(sizes) - min(sizes) <= 1  # balanced


def test_order_is_seeded_and_changes_per_epoch():
    m = _manifest([10] * 12)
    plan = lambda seed, epoch: _ids(epoch_plan(m, id_range=(0, 120), seed=seed, epoch=epoch, rank=0, world_size=1))
    assert plan(0, 0) == plan(0, 0)
    assert plan(0, 0) != plan(0, 1)
    assert plan(0, 0) != plan(1, 0)
    assert plan(0, 0) != list(range(120))
    unshuffled = _ids(epoch_plan(m, id_range=(0, 120), seed=0, epoch=3, rank=0, world_size=1, shuffle=False))
    assert unshuffled == list(range(120))


def test_a_worker_touches_about_its_share_of_shards():
    m = _manifest([10] * 40)
    for rank in range(4):
        segs = epoch_plan(m, id_range=(0, 400), seed=0, epoch=0, rank=rank, world_size=4)
        assert len({s.shard for s in segs}) <= 10 + 1


def test_validation_split_is_held_out():
    m = _manifest([50, 50])
    splits = split_ids(m, 0.1)
    assert splits == {"train": (0, 90), "validation": (90, 100)}
    train = set(_ids(epoch_plan(m, id_range=splits["train"], seed=0, epoch=0, rank=0, world_size=1)))
    val = set(_ids(epoch_plan(m, id_range=splits["validation"], seed=0, epoch=0, rank=0, world_size=1)))
    assert train.isdisjoint(val) and len(train) == 90 and len(val) == 10
    assert split_ids(m, 0.0)["validation"] == (100, 100)
    assert split_ids(_manifest([1]), 0.5) == {"train": (0, 1), "validation": (1, 1)}
