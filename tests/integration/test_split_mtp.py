"""Speculative decoding from the checkpoint's multi-token-prediction layer, or an EAGLE-3 head, with the model in two
tensor-parallel shards (engine.tensor_parallel 2, engine.speculative.method mtp or eagle3): each shard holds its slices
of the layer beside its shard of the model, the layer's passes run on both (their input sent once from the engine's
process), and the drafts are the ones the model in one process proposes. The layer's arithmetic in shards:
tests/unit/serving/engine/test_speculative_mtp.py, test_speculative_eagle.py."""

from __future__ import annotations

import json
import sys

import pytest
from serving_models import ENGINE_MODELS, engine_driver

DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import ray
from engine_models import GREEDY, PROMPTS, recorded, run, spec, speculating, tokens_of
from pylon.serving.engine.engine import LLMEngine
ray.init(address=sys.argv[1], log_to_driver=False)
split, speculative = json.loads(sys.argv[4]), json.loads(sys.argv[5])
engine = speculating(LLMEngine(sys.argv[2], spec(**split, speculative={**speculative, "num_tokens": 3})))
proposed = recorded(engine)
for i, prompt in enumerate(PROMPTS[:4]):
    engine.add_request(str(i), prompt, GREEDY)
outputs = run(engine)
stats = engine.stats()
print(json.dumps({"tokens": [tokens_of(outputs[str(i)]) for i in range(4)], "proposed": proposed,
                  "drafts": stats.spec_draft_tokens_total, "passes": stats.spec_draft_model_steps_total}))
if hasattr(engine.runner, "shutdown"):
    engine.runner.shutdown()
"""


def _drive(ray_cluster, directory: str, split: dict, speculative: dict | None = None) -> dict:
    speculative = json.dumps(speculative or {"method": "mtp"})
    return engine_driver(DRIVER, directory, json.dumps(split), speculative)


# ~40 s: a driver and a shard actor loading the model and its layer. `make test-all`.
@pytest.mark.slow
def test_the_layer_in_two_shards_drafts_as_the_model_in_one_process(ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import PROMPTS, Family, add_mtp_layer

    family = Family("deepseek_v3", tmp_path / "deepseek_v3", greedy=False)
    add_mtp_layer(family.dir)
    want = [family.hf_greedy(p, 20) for p in PROMPTS[:4]]
    shards = _drive(ray_cluster, family.dir, {"tensor_parallel": 2})
    whole = _drive(ray_cluster, family.dir, {})
    assert shards["tokens"] == whole["tokens"] == want
    assert shards["drafts"] > 0 and shards["passes"] > 0, shards
    assert shards["proposed"] == whole["proposed"] != []


# ~40 s, as above. `make test-all`.
@pytest.mark.slow
def test_an_eagle3_head_in_two_shards_drafts_as_in_one_process(ray_cluster, tmp_path):
    sys.path.insert(0, str(ENGINE_MODELS))
    from engine_models import PROMPTS, Family
    from test_speculative_eagle import write_head

    family = Family("llama", tmp_path / "llama", greedy=False, num_hidden_layers=8)
    write_head(tmp_path / "head", family.model.config, "eagle3", draft_vocab=96)
    speculative = {"method": "eagle3", "draft_model": str(tmp_path / "head")}
    want = [family.hf_greedy(p, 20) for p in PROMPTS[:4]]
    shards = _drive(ray_cluster, family.dir, {"tensor_parallel": 2}, speculative)
    whole = _drive(ray_cluster, family.dir, {}, speculative)
    assert shards["tokens"] == whole["tokens"] == want
    assert shards["drafts"] > 0 and shards["passes"] > 0, shards
    assert shards["proposed"] == whole["proposed"] != []
