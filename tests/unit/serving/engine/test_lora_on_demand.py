"""LoRA adapters loaded on demand (`engine.dynamic_adapters`): a request names an adapter under the root and the
engine loads it into one of `max_loaded` slots, evicting the least recently used one no unfinished request runs with,
or parks the request until a slot is free; each request gets peft's greedy tokens for its adapter all the same. The
prefix cache survives an eviction and is forgotten when a name comes back with other files. HTTP and object storage:
tests/unit/serving/api/test_serving_http.py."""

from __future__ import annotations

import shutil

import pytest
from engine_models import NEW_TOKENS, PROMPTS, hf_greedy, run, spec, tokens_of
from test_lora_engine import TARGETS, Adapted, save_adapter

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest


class Root(Adapted):
    """A family's two adapters of test_lora_engine and a third ("plain": the attention projections at rank 16), all
    under one directory, the root."""

    def __init__(self, family, directory):
        super().__init__(family, directory)
        self.root = directory
        out = str(directory / "plain")
        model = save_adapter(family.dir, out, 3, r=16, lora_alpha=16, target_modules=TARGETS[family.name][0])
        self.dirs["plain"] = out
        self.greedy["plain"] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]

    def on_demand(self, **dynamic) -> LLMEngine:
        return LLMEngine(self.family.dir, spec(dynamic_adapters={"root": str(self.root), **dynamic}))

    def params(self, name: str | None) -> SamplingParams:
        path = None if name is None else str(self.root / name)
        return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter=name, adapter_path=path)


@pytest.fixture(scope="module")
def root(family, tmp_path_factory) -> Root:
    return Root(family, tmp_path_factory.mktemp(f"{family.name}-root"))


def test_three_adapters_share_two_slots_and_every_request_gets_peft_s_tokens(root) -> None:
    engine = root.on_demand(max_loaded=2)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        for name in (None, "terse", "wordy", "plain"):
            rid = f"{name}-{i}"
            engine.add_request(rid, prompt, root.params(name))
            expected[rid] = root.greedy[name][i]
    outputs: dict[str, list] = {}
    parked_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        assert len(engine.on_demand.slots) <= 2 and len(engine.runner.adapter_set) <= 2
        parked_steps += bool(engine._parked)
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == expected
    stats = engine.stats()
    # "plain" waited for a slot, then took the one of an adapter whose requests had all finished.
    assert parked_steps > 0
    assert (stats.adapter_loads_total, stats.adapter_evictions_total) == (3, 1)
    assert stats.requests_finished_total.get("abort", 0) == 0


def test_a_slot_s_adapter_comes_back_with_its_cache_and_a_replaced_one_forgets_it(root, tmp_path) -> None:
    """max_loaded 1: "terse", then "wordy" (evicting it), then "terse" again: its prompt's blocks are still cached
    (salted with its name). Its files replaced by other weights at the root, the next load forgets the cached blocks
    (a stale hit would give the old adapter's tokens)."""
    shutil.copytree(root.root / "terse", tmp_path / "terse")
    shutil.copytree(root.root / "wordy", tmp_path / "wordy")
    engine = LLMEngine(root.family.dir, spec(dynamic_adapters={"root": str(tmp_path), "max_loaded": 1}))
    prompt = PROMPTS[3]  # 90 tokens: five full blocks of 16

    def ask(k: int, name: str, cached: int, want: str) -> None:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter=name, adapter_path=str(tmp_path / name))
        engine.add_request(f"r{k}", prompt, params)
        outs = run(engine)[f"r{k}"]
        assert (outs[-1].num_cached_tokens, tokens_of(outs)) == (cached, root.greedy[want][3]), (k, name)

    ask(0, "terse", 0, "terse")
    ask(1, "wordy", 0, "wordy")
    ask(2, "terse", 80, "terse")  # reloaded (wordy evicted), its cache kept
    ask(3, "wordy", 80, "wordy")
    shutil.rmtree(tmp_path / "terse")
    shutil.copytree(root.root / "plain", tmp_path / "terse")  # "terse" now holds other weights
    ask(4, "terse", 0, "plain")
    assert engine.stats().adapter_loads_total == 5


def test_a_parked_request_can_be_aborted(root) -> None:
    engine = root.on_demand(max_loaded=1)
    engine.add_request("long", PROMPTS[0], root.params("terse"))
    first = engine.step()
    engine.add_request("waits", PROMPTS[1], root.params("wordy"))
    first += engine.step()
    assert [r.request_id for r in engine._parked] == ["waits"]
    engine.abort("waits")
    outputs = run(engine)
    assert outputs["waits"][-1].finish_reason == "abort" and not engine._parked
    assert tokens_of(first + outputs["long"]) == root.greedy["terse"][0]
    assert not engine.has_unfinished()


def test_a_bad_adapter_fails_its_request_naming_model_and_the_rest_run(root, tmp_path) -> None:
    engine = root.on_demand(max_loaded=2, max_rank=8)
    with pytest.raises(InvalidRequest, match=r"model 'plain': .*plain: .* has rank 16, above engine\.dynamic_adapters"):
        engine.add_request("wide", PROMPTS[0], root.params("plain"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match=r"model 'empty': .*empty: not a LoRA adapter \(no adapter_config\.json\)"):
        engine.add_request("empty", PROMPTS[0], SamplingParams(adapter="empty", adapter_path=str(tmp_path / "empty")))
    engine.add_request("ok", PROMPTS[0], root.params("terse"))
    assert tokens_of(run(engine)["ok"]) == root.greedy["terse"][0]
    assert engine.stats().adapter_loads_total == 1


def test_without_a_root_an_adapter_path_is_not_loaded(root) -> None:
    engine = LLMEngine(root.family.dir, spec())
    with pytest.raises(InvalidRequest, match=r"adapter 'terse' is not loaded in this engine"):
        engine.add_request("r", PROMPTS[0], root.params("terse"))
