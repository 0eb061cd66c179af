"""Draft trees (engine.speculative.tree_width) with the model in two tensor-parallel shards (engine.tensor_parallel 2):
each shard attends a tree's nodes to their ancestors only and moves the accepted path's keys and values in its own
slice of the KV cache (`SplitRunner.move_kv`, in order with its steps), so greedy outputs are transformers' own while
every step accepts drafts off the tree's first path. In one process: tests/unit/serving/engine/test_speculative_tree.py,
whose oracle drafter this driver uses."""

from __future__ import annotations

import json
import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import ray
from engine_models import run, spec, speculating, tokens_of
from test_speculative_tree import _oracle, _prompts
from pylon.serving.engine import engine as engine_module
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
ray.init(address=sys.argv[1], log_to_driver=False)
split, expected = json.loads(sys.argv[4]), json.loads(sys.argv[5])
prompts = _prompts()
engine_module.ngram_tree = _oracle({tuple(p): e for p, e in zip(prompts, expected)}, "deep")
speculative = {"method": "ngram", "num_tokens": 6, "tree_width": 2}
engine = speculating(LLMEngine(sys.argv[2], spec(**split, speculative=speculative)))
for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=len(expected[i]), temperature=0))
outputs = run(engine)
stats = engine.stats()
print(json.dumps({"tokens": [tokens_of(outputs[str(i)]) for i in range(len(prompts))],
                  "branch": stats.spec_tree_branch_tokens_total}))
if hasattr(engine.runner, "shutdown"):
    engine.runner.shutdown()
"""


# ~30 s: a driver and a shard actor loading the model. `make test-all`.
@pytest.mark.slow
def test_two_shards_verify_trees_and_move_the_accepted_path_in_each_slice(ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import Family
    from test_speculative_tree import NEW, _prompts

    family = Family("llama", tmp_path / "llama", greedy=False)
    expected = [family.hf_greedy(p, NEW) for p in _prompts()]
    got = engine_driver(DRIVER, family.dir, json.dumps({"tensor_parallel": 2}), json.dumps(expected))
    assert got["tokens"] == expected
    assert got["branch"] >= 2 * len(expected) * 5, got
