"""pylon.models.build_model at ZeRO stages 0-2 in a process group: rank 0 alone reads storage and builds, the
other ranks receive its weights.

Two real processes (torch.multiprocessing, a gloo group over a file store). The model directory the job names
lives in fsspec's memory:// filesystem, which is private to a process: rank 0 writes it there before building,
so rank 1 would fail with "not a Hugging Face model directory" if it read storage at all.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from pylon.errors import PylonError
from pylon.models import build_model
from pylon.presets import BYTE_VOCAB_SIZE
from pylon.specs import TrainJobSpec

BYTE = {"vocab_size": BYTE_VOCAB_SIZE, "eos_id": 256, "pad_id": 257}
STAGE2 = {"zero_optimization": {"stage": 2}}


def job(**fields) -> TrainJobSpec:
    spec = {"kind": "TrainJob", "name": "job", "model": {"preset": "llama-tiny"}, "data": {"uri": "/data"}, "steps": 1}
    spec.update(fields)
    return TrainJobSpec.model_validate(spec)


def _rank_main(rank: int, store: str, base_dir: str, out: str) -> None:
    import fsspec
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    # 1. Random weights and LoRA adapters: rank 0 initialises (rank 1's random stream is left elsewhere).
    if rank == 1:
        torch.manual_seed(12345)
    lora = job(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    results["random"] = build_model(lora, **BYTE, seed=5, deepspeed_config=STAGE2).state_dict()
    # 2. A model directory only rank 0's process has.
    if rank == 0:
        fs = fsspec.filesystem("memory")
        for name in os.listdir(base_dir):
            with open(os.path.join(base_dir, name), "rb") as f:
                fs.pipe_file(f"/models/base/{name}", f.read())
    pretrained = job(model={"path": "memory://models/base"})
    results["pretrained"] = build_model(pretrained, **BYTE, deepspeed_config=STAGE2).state_dict()
    # 3. Rank 0 cannot read the directory: the same error on both ranks, and neither waits for the other.
    try:
        build_model(job(model={"path": "memory://models/absent"}), **BYTE, deepspeed_config=STAGE2)
        results["error"] = None
    except PylonError as e:
        results["error"] = str(e)
    torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared-build")
    base = build_model(job(), **BYTE, seed=9)
    base.save_pretrained(tmp / "base", safe_serialization=True)
    outs = [str(tmp / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp / "store"), str(tmp / "base"), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in procs] == [0, 0]
    return base, [torch.load(o, weights_only=False) for o in outs]


def test_every_rank_starts_from_rank_0s_random_weights_and_adapters(ranks) -> None:
    _, (r0, r1) = ranks
    alone = build_model(job(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}), **BYTE, seed=5).state_dict()
    assert r0["random"].keys() == r1["random"].keys() == alone.keys()
    assert any("lora_" in k for k in alone)
    for key, value in alone.items():
        assert torch.equal(r0["random"][key], value), key  # rank 0 builds as one process does
        assert torch.equal(r1["random"][key], value), key  # and rank 1 has exactly its weights


def test_only_rank_0_reads_the_model_directory(ranks) -> None:
    base, (r0, r1) = ranks
    for key, value in base.state_dict().items():
        assert torch.equal(r0["pretrained"][key], value), key
        assert torch.equal(r1["pretrained"][key], value), key  # from rank 0: its memory:// has no model


def test_rank_0s_error_reaches_every_rank(ranks) -> None:
    _, (r0, r1) = ranks
    assert r0["error"] and "model.path memory://models/absent" in r0["error"]
    assert r1["error"] == r0["error"]
