"""A model with recurrent layers (Qwen3-Next's Gated DeltaNet) in two tensor-parallel shards through the engine
(pylon.serving.engine.tensor): each shard keeps its heads' recurrent state of each sequence, and what the engine does to
the states (a speculating step's kept drafts, a finished sequence's release) every shard does. The shards' arithmetic:
tests/unit/serving/engine/test_tensor_shards.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import pylon

ENGINE_MODELS = Path(__file__).resolve().parents[1] / "unit" / "serving" / "engine"

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import ray
from engine_models import GREEDY, PROMPTS, run, spec, speculating, tokens_of
from pylon.serving.engine.engine import LLMEngine
ray.init(address=sys.argv[1], log_to_driver=False)
engine = speculating(LLMEngine(sys.argv[2], spec(tensor_parallel=2, speculative={"method": "ngram", "num_tokens": 3})))
assert engine.snapshots is None and not engine.pool.enable_caching  # (states split across shards: not snapshotted)
for i, prompt in enumerate(PROMPTS[:4]):
    engine.add_request(str(i), prompt, GREEDY)
outputs = run(engine)
held = ray.get(engine.runner.workers[0].held_states.remote())
print(json.dumps({"tokens": [tokens_of(outputs[str(i)]) for i in range(4)], "held": held,
                  "drafts": engine.stats().spec_draft_tokens_total}))
engine.runner.shutdown()
"""


# ~60 s: a driver and a shard actor loading the model. `make test-all`.
@pytest.mark.slow
def test_two_shards_of_a_recurrent_model_decode_as_one_with_speculation(ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import PROMPTS, Family

    family = Family("qwen3_next", tmp_path / "qwen3_next", greedy=False)
    want = [family.hf_greedy(p, 20) for p in PROMPTS[:4]]
    client = pylon.connect()
    child = subprocess.run(
        [sys.executable, "-c", DRIVER, client.gcs_address, family.dir, str(ENGINE_MODELS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["tokens"] == want
    assert result["drafts"] > 0  # (steps speculated: every shard kept the same accepted drafts' states)
    assert result["held"] == []  # (every finished sequence's state released on the other shard too)
