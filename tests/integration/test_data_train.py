"""Real Ray Train workers streaming their parts: 2 workers x 2 epochs, every sample once per epoch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pylon.data.testing import write_synthetic_dataset

pytestmark = pytest.mark.integration


def _train_loop(config):
    import ray.train

    from pylon.data.reader import ShardStream

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    stream = ShardStream(config["uri"], batch_size=16, rank=rank, world_size=world, seed=11, shuffle_buffer=64)
    epochs = []
    for _ in range(2):
        ids = []
        for batch in stream.epoch():
            tensors = batch.to_torch(stream.pad_id)
            assert tensors["input_ids"].shape == (len(batch), 16)
            ids.extend(batch.sample_ids.tolist())
        epochs.append(ids)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps({"epochs": epochs, "stats": stream.stats.as_dict()}))
    ray.train.report({"rows": stream.stats.rows})


# ~90 s. Every training test of `make test` streams data into two Ray Train workers (test_ray_job_submit, test_hosts,
# test_job_queue), and tests/unit/data checks every sample once per epoch across ranks; `make test-all`.
@pytest.mark.slow
def test_two_train_workers_two_epochs(ray_cluster, tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import pylon
    from pylon.data.reader import ShardStream

    uri = str(tmp_path / "ds")
    write_synthetic_dataset(uri, rows=700, rows_per_shard=90, seq_len=16)
    out = tmp_path / "out"
    out.mkdir()
    pylon.connect().init_ray()
    # Workers cannot import this test module; ship the train loop by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"uri": uri, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="data-two-workers", storage_path=str(tmp_path / "runs")),
    )
    trainer.fit()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert sorted(a + b) == list(range(700)), f"epoch {epoch}: not every sample exactly once"
        assert len(a + b) == len(set(a + b))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    # Deterministic: the same seed gives each rank the same sequence outside Train too.
    replay = ShardStream(uri, batch_size=16, rank=1, world_size=2, seed=11, shuffle_buffer=64)
    assert [i for b in replay.epoch() for i in b.sample_ids.tolist()] == ranks[1]["epochs"][0]
    assert ranks[0]["stats"]["rows"] + ranks[1]["stats"]["rows"] == 1400
