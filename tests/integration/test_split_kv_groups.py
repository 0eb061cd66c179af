"""A model whose windowed layers mix with full ones, in two tensor-parallel shards (engine.tensor_parallel): each shard
keeps its share of the KV cache in the same groups of layers (kv_cache.HybridKVBlockPool, ModelRunner.kv_groups), the
windowed groups' tables letting go of the blocks before the window on both (the null block names each shard's scratch
block), so that four sequences run in the memory of fewer tokens than theirs together, none preempted, as transformers
computes them. In one process (the prefix cache's hits among them): test_model_families.py's window tests."""

from __future__ import annotations

import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import ray, torch
from engine_models import run, spec, tokens_of
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
ray.init(address=sys.argv[1], log_to_driver=False)
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 33, 21, 17)]
engine = LLMEngine(sys.argv[2], spec(tensor_parallel=2, kv_cache_tokens=512, max_model_len=256, max_num_seqs=4,
                                     enable_prefix_caching=True))
params = SamplingParams(max_tokens=200, min_tokens=200, temperature=0)
rounds = []
for r in range(1):
    for i, p in enumerate(prompts):
        engine.add_request(f"{r}-{i}", p, params)
    outputs, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        most = max([most, *(engine.pool.held_blocks(f"{r}-{i}") for i in range(len(prompts)))])
    rounds.append({"tokens": [tokens_of(outputs[f"{r}-{i}"]) for i in range(len(prompts))], "most": most,
                   "cached": [outputs[f"{r}-{i}"][0].num_cached_tokens for i in range(len(prompts))]})
groups = [engine.runner.kv_groups] + ray.get([a.kv_groups.remote() for a in engine.runner.actors])
print(json.dumps({"prompts": prompts, "rounds": rounds, "groups": groups, "pool": type(engine.pool).__name__,
                  "window": engine.scheduler.window, "blocks": engine.pool.num_blocks,
                  "preemptions": engine.scheduler.num_preemptions}))
engine.runner.shutdown()
"""


def _run(family) -> dict:
    result = engine_driver(DRIVER, family.dir)
    want = [family.hf_greedy(p, 200, min_tokens=200) for p in result["prompts"]]
    assert [r["tokens"] for r in result["rounds"]] == [want]
    return result


# ~40 s: a driver and a shard actor loading the model
def test_two_shards_of_a_model_mixing_windowed_and_full_layers_keep_their_kv_cache_in_groups(ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import Family

    # Gemma 3's five windowed layers to one full one, a window of 16
    family = Family("gemma3_text", tmp_path / "gemma3", greedy=False, sliding_window=16, num_hidden_layers=6)
    result = _run(family)
    # both shards in the same six groups of one layer, the full one first; the pool's blocks one layer's each
    assert result["groups"][0] == result["groups"][1] == [[[5], None]] + [[[i], 16] for i in range(5)]
    assert result["pool"] == "HybridKVBlockPool" and result["window"] == 16 and result["blocks"] == 512 // 16 * 6
    # 911 tokens in the memory of 512 in every layer (one table for all would preempt), none preempted: each sequence
    # at most its context in the full group and its window's and a prompt's blocks in each windowed one
    assert sum(len(p) + 200 for p in result["prompts"]) > 512 + 256 and result["preemptions"] == 0
    assert max(r["most"] for r in result["rounds"]) <= -(-240 // 16) + 5 * (-(-(16 + 40) // 16) + 1)


@pytest.mark.slow  # make test-all (~40 s)
def test_two_shards_of_a_model_windowed_in_every_layer_let_go_of_the_blocks_before_the_window(ray_cluster, tmp_path):
    """Mistral's window in every layer: one table, trimmed on both shards (each shard's scratch block its null)."""
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import Family

    family = Family("mistral", tmp_path / "mistral", greedy=False, sliding_window=16)
    result = _run(family)
    assert result["groups"] == [[], []] and result["pool"] == "KVBlockPool" and result["window"] == 16
    assert result["blocks"] == 512 // 16 and result["preemptions"] == 0
    assert max(r["most"] for r in result["rounds"]) <= -(-(16 + 40) // 16) + 1
