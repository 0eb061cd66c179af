"""The prefix cache's host tier (engine.kv_offload_tokens) with a model in two tensor-parallel shards, or two
pipeline stages (pylon.serving.engine.tensor, .pipeline): each part copies its own share of a block's keys and values
(a shard its heads', a stage its layers') to its host memory and back, in order with the steps, so that a prefix
the device's cache let go of comes back whole on every part. The copies' arithmetic in one process:
tests/unit/serving/engine/test_kv_offload.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import ray, torch
from engine_models import GREEDY, run, spec, tokens_of
from pylon.serving.engine.engine import LLMEngine
ray.init(address=sys.argv[1], log_to_driver=False)
split = json.loads(sys.argv[4])
g = torch.Generator().manual_seed(5)
docs = [torch.randint(0, 256, (84,), generator=g).tolist() for _ in range(3)]
prompts = [d + [1, 2, 3] for d in docs] + [d + [7, 8] for d in docs]
engine = LLMEngine(sys.argv[2], spec(**split, kv_cache_tokens=128, max_model_len=128, max_num_seqs=1,
                                     kv_offload_tokens=1024))
parts = ray.get([a.mapped_files.remote() for a in engine.runner.actors]) if "kv_offload_path" in split else []
mapped = [name for files in parts for name in files]
tokens, cached = [], []
for i, prompt in enumerate(prompts):  # one at a time: each document gone from the device by its second prompt
    engine.add_request(str(i), prompt, GREEDY)
    out = run(engine)[str(i)]
    tokens.append(tokens_of(out))
    cached.append(out[-1].num_cached_tokens)
stats = engine.stats()
print(json.dumps({"prompts": prompts, "tokens": tokens, "cached": cached, "mapped": mapped,
                  "loaded": stats.kv_offload_loaded_blocks_total, "saved": stats.kv_offload_saved_blocks_total}))
engine.runner.shutdown()
"""


# ~40 s each: a driver and a shard (stage) actor loading the model. Two shards in `make test`; two stages in
# `make test-all`.
@pytest.mark.parametrize(
    "split",
    [{"tensor_parallel": 2, "kv_offload_path": "disk"}, pytest.param({"pipeline_parallel": 2}, marks=pytest.mark.slow)],
    ids=["two-shards-on-disk", "two-stages"],
)
def test_a_split_model_s_prefix_comes_back_from_every_part_s_host_memory(ray_cluster, tmp_path, split):
    """Two shards with the tier on disk (engine.kv_offload_path: the shard actor maps its own files there), or two
    stages with it in RAM."""
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import Family

    family = Family("llama", tmp_path / "llama", greedy=False)
    if "kv_offload_path" in split:
        (tmp_path / "disk").mkdir()
        split = {**split, "kv_offload_path": str(tmp_path / "disk")}
    result = engine_driver(DRIVER, family.dir, json.dumps(split))
    # Every prompt's tokens are transformers' own: the second prompt of each document read its first five blocks
    # back from host memory on both parts (a part that kept its share elsewhere, or none, would write other tokens).
    assert result["tokens"] == [family.hf_greedy(p, 20) for p in result["prompts"]]
    assert result["cached"] == [0, 0, 0, 80, 80, 80], result["cached"]
    assert result["loaded"] == 15 and result["saved"] >= 15, result
    if "kv_offload_path" in split:  # the other shard's K and V of its 2 layers, in files there, deleted at once
        assert len(result["mapped"]) == 4 and os.listdir(split["kv_offload_path"]) == [], result["mapped"]
        assert all(name.endswith(".bin (deleted)") for name in result["mapped"]), result["mapped"]
