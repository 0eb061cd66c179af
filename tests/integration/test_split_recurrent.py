"""A model with recurrent layers (Qwen3-Next's Gated DeltaNet) in two tensor-parallel shards, or two pipeline stages,
through the engine (pylon.serving.engine.tensor, .pipeline): each part keeps its share of each sequence's recurrent
state (a shard its heads', a stage its layers'), and what the engine does to the states (a speculating step's kept
drafts, a finished sequence's release, the prefix cache's snapshots and restores) every part does. Their arithmetic:
tests/unit/serving/engine/test_tensor_shards.py, test_pipeline_stages.py."""

from __future__ import annotations

import json
import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

DRIVER = """
import gc, json, sys
sys.path.insert(0, sys.argv[3])
import ray
from engine_models import GREEDY, PROMPTS, run, spec, speculating, tokens_of
from pylon.serving.engine.engine import LLMEngine
ray.init(address=sys.argv[1], log_to_driver=False)
split = json.loads(sys.argv[4])
engine = speculating(LLMEngine(sys.argv[2], spec(**split, speculative={"method": "ngram", "num_tokens": 3})))
assert engine.snapshots is not None and engine.pool.enable_caching  # (each part snapshots its share of the states)
for i, prompt in enumerate(PROMPTS[:4]):
    engine.add_request(str(i), prompt, GREEDY)
outputs = run(engine)
tokens = [tokens_of(outputs[str(i)]) for i in range(4)]
# a chat's next turn: the first turn's prompt and reply, then a new message, from the snapshot the first left
second = PROMPTS[3] + tokens[3] + PROMPTS[6]
engine.add_request("turn-2", second, GREEDY)
turn = run(engine)["turn-2"]
shard = engine.runner.actors[0]  # (the other shard, or the second stage)
held, snapshots = ray.get(shard.held_states.remote()), ray.get(shard.held_snapshots.remote())
kept = sorted(s.name for s in engine.snapshots._kept.values())
engine.snapshots._kept.clear()  # (the engine lets its snapshots go: the other shard lets its own go)
gc.collect()
print(json.dumps({"tokens": tokens, "held": held, "drafts": engine.stats().spec_draft_tokens_total,
                  "second": second, "turn": tokens_of(turn), "cached": turn[0].num_cached_tokens,
                  "restored": engine.snapshots.restored, "snapshots": snapshots, "kept": kept,
                  "left": ray.get(shard.held_snapshots.remote())}))
engine.runner.shutdown()
"""


# ~60 s each: a driver and a shard (stage) actor loading the model. `make test-all`.
@pytest.mark.slow
@pytest.mark.parametrize("split", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["two-shards", "two-stages"])
def test_a_split_recurrent_model_decodes_as_one_with_speculation_and_its_prefix_cache(ray_cluster, tmp_path, split):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import PROMPTS, Family

    family = Family("qwen3_next", tmp_path / "qwen3_next", greedy=False)
    want = [family.hf_greedy(p, 20) for p in PROMPTS[:4]]
    result = engine_driver(DRIVER, family.dir, json.dumps(split))
    assert result["tokens"] == want
    assert result["drafts"] > 0  # (steps speculated: every shard kept the same accepted drafts' states)
    assert result["held"] == []  # (every finished sequence's state released on the other shard too)
    # The prefix cache across shards: the next turn started from the first turn's snapshot (each shard restoring its
    # own heads' states), as transformers continues the whole prompt; the other shard holds the snapshots the engine
    # keeps, no more, and none once the engine lets them go.
    assert result["turn"] == family.hf_greedy(result["second"], 20)
    assert result["cached"] >= 80 and result["restored"] >= 1, result
    assert result["snapshots"] == result["kept"] != [] and result["left"] == [], result
