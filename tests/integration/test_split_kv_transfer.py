"""Prefill-decode disaggregation's blocks (pylon.serving.engine.kv_transfer) between two engines of a model in two
tensor-parallel shards (pylon.serving.engine.tensor), or two pipeline stages (pylon.serving.engine.pipeline), each in
a process of its own: the prefill engine reads every shard's (stage's) share of a block's keys and values (a shard
its heads', a stage its layers'), its own first and its actor's after, and the decoding engine writes each share
back to its own part; the decoding engine then computes only each prompt's tail and writes transformers' tokens. The engines in one process, the blocks' arithmetic:
tests/unit/serving/engine/test_kv_transfer.py."""

from __future__ import annotations

import json
import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

# Two engines of shards cannot share a process (each shard group its own torch.distributed default group): the
# prefill engine's driver pickles its transfers to a file, the decoding engine's reads them.
DRIVER = """
import dataclasses, json, pickle, sys
sys.path.insert(0, sys.argv[3])
import ray, torch
from engine_models import GREEDY, run, spec, tokens_of
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
ray.init(address=sys.argv[1], log_to_driver=False)
role, path = sys.argv[4], sys.argv[5]
g = torch.Generator().manual_seed(9)
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (84, 40, 100)]
engine = LLMEngine(sys.argv[2], spec(**json.loads(sys.argv[6])))
if role == "prefill":
    transfers = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0, kv_export_from=0))
        transfers.append(run(engine)[f"p{i}"][-1].kv_transfer)
    with open(path, "wb") as f:
        pickle.dump(transfers, f)
    print(json.dumps({"tensors": [len(t.data) for t in transfers]}))
else:
    with open(path, "rb") as f:
        transfers = pickle.load(f)
    tokens, cached = [], []
    for i, (prompt, transfer) in enumerate(zip(prompts, transfers)):
        engine.add_request(str(i), prompt, dataclasses.replace(GREEDY, kv_import=transfer))
        out = run(engine)[str(i)]
        tokens.append(tokens_of(out))
        cached.append(out[-1].num_cached_tokens)
    stats = engine.stats()
    print(json.dumps({"prompts": prompts, "tokens": tokens, "cached": cached,
                      "computed": stats.prefill_tokens_computed_total,
                      "received": stats.kv_transfer_received_blocks_total}))
engine.runner.shutdown()
"""


@pytest.mark.parametrize(
    "split, tensors",
    [
        # 2 layers x K and V x 2 shards: each shard's own tensors, its heads' share
        ({"tensor_parallel": 2}, 8),
        # 2 stages of 1 layer x K and V: each stage's own layer's (make test-all: the same SplitRunner path as shards)
        pytest.param({"pipeline_parallel": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=["shards", "stages"],
)
def test_every_shard_s_share_of_the_blocks_goes_to_its_own_shard(split, tensors, ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import Family

    family = Family("llama", tmp_path / "llama", greedy=False)
    result = {}
    for role in ("prefill", "decode"):
        result.update(engine_driver(DRIVER, family.dir, role, str(tmp_path / "transfers.pickle"), json.dumps(split)))
    assert result["tensors"] == [tensors] * 3
    assert result["cached"] == [80, 32, 96]  # each prompt's full blocks short of its last token, from the transfer
    assert result["received"] == (80 + 32 + 96) // 16
    assert result["computed"] == sum(len(p) for p in result["prompts"]) - sum(result["cached"])
    # transformers' tokens: a shard that wrote another's share, or none, would write others
    assert result["tokens"] == [family.hf_greedy(p, 20) for p in result["prompts"]]
