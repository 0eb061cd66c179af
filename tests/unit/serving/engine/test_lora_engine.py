"""LoRA adapters in the engine (`engine.adapters`): requests for the base model and for several adapters share the
engine's steps, and each gets what `peft` computes for its adapter (greedy tokens equal to `PeftModel.generate`'s),
with speculation too; the prefix cache is kept apart per adapter; an unknown adapter or a bad adapter directory is
refused naming the field. The runner's arithmetic against peft's logits: tests/unit/serving/model/test_serving_lora.py."""

from __future__ import annotations

import pytest
import torch
from engine_models import DEVICE, GREEDY, NEW_TOKENS, PROMPTS, Family, hf_greedy, run, spec, speculating, tokens_of
from transformers import AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest

# Two adapters per family, unlike each other: attention alone at rank 4, and every projection at rank 8 with
# rsLoRA's scale. init_lora_weights=False: B is random too (peft's default makes B zero, an adapter that does
# nothing until trained), so each adapter's outputs differ from the base model's.
TARGETS = {
    "gpt2": (["c_attn"], ["c_attn", "c_proj", "c_fc"]),
    "llama": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def save_adapter(base_dir: str, out: str, seed: int, **config) -> AutoModelForCausalLM:
    """A random LoRA adapter of the model in `base_dir`, saved in peft's format to `out`; returns the peft model
    (base + adapter) for reference outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    # peft's random B at its init scale moves the logits only slightly; larger, so an adapter changes the tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(out)
    return model.eval().to(DEVICE)


class Adapted:
    """A family's tiny model, two adapters of it on disk, and each adapter's greedy continuations (peft's)."""

    def __init__(self, family: Family, directory):
        self.family = family
        attention, everything = TARGETS[family.name]
        self.dirs, self.greedy = {}, {}
        for name, seed, config in (
            ("terse", 1, {"r": 4, "lora_alpha": 8, "target_modules": attention}),
            ("wordy", 2, {"r": 8, "lora_alpha": 16, "target_modules": everything, "use_rslora": True}),
        ):
            out = str(directory / name)
            model = save_adapter(family.dir, out, seed, **config)
            self.dirs[name] = out
            self.greedy[name] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
        self.greedy[None] = family.greedy

    def adapters(self) -> list[dict]:
        return [{"name": name, "path": path} for name, path in self.dirs.items()]

    def engine(self, **fields) -> LLMEngine:
        return LLMEngine(self.family.dir, spec(adapters=self.adapters(), **fields))


@pytest.fixture(scope="module")
def adapted(family, tmp_path_factory) -> Adapted:
    return Adapted(family, tmp_path_factory.mktemp(f"{family.name}-adapters"))


def test_the_adapters_change_the_outputs(adapted) -> None:
    """Else the parity below would hold for an engine that ignored them."""
    for name in ("terse", "wordy"):
        differ = sum(a != b for a, b in zip(adapted.greedy[name], adapted.greedy[None]))
        assert differ >= len(PROMPTS) - 1, (name, differ)
    assert adapted.greedy["terse"] != adapted.greedy["wordy"]


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_base_and_adapter_requests_share_steps_and_each_gets_peft_s_tokens(adapted, speculate) -> None:
    fields = {"speculative": {"method": "ngram", "num_tokens": 3}} if speculate else {}
    engine = adapted.engine(**fields)
    if speculate:
        speculating(engine)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        for name in (None, "terse", "wordy"):
            rid = f"{name}-{i}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter=name))
            expected[rid] = adapted.greedy[name][i]
    mixed_steps = 0
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        slots = {r.adapter for r in engine.scheduler.running}
        mixed_steps += len(slots) == 3
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert mixed_steps > 0  # steps held rows of the base model and both adapters
    got = {rid: tokens_of(outs) for rid, outs in outputs.items()}
    assert got == expected
    if speculate:
        assert engine.stats().spec_accepted_tokens_total > 0


def test_the_prefix_cache_is_kept_apart_per_adapter(adapted) -> None:
    engine = adapted.engine()
    prompt = PROMPTS[3]  # 90 tokens: five full blocks of 16
    order = [(None, 0), ("terse", 0), ("terse", 80), ("wordy", 0), (None, 80)]
    for k, (name, cached) in enumerate(order):
        engine.add_request(f"r{k}", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter=name))
        outs = run(engine)[f"r{k}"]
        assert outs[-1].num_cached_tokens == cached, (k, name)
        assert tokens_of(outs) == adapted.greedy[name][3], (k, name)


def test_an_unknown_adapter_is_refused_naming_model(gpt2, tmp_path) -> None:
    engine = gpt2.engine()
    with pytest.raises(
        InvalidRequest, match=r"adapter 'nope' is not loaded in this engine \(its adapters: none\)"
    ) as e:
        engine.add_request("r", PROMPTS[0], SamplingParams(adapter="nope"))
    assert e.value.param == "model"
    # A request for the base model still runs.
    engine.add_request("ok", PROMPTS[0], GREEDY)
    assert tokens_of(run(engine)["ok"]) == gpt2.greedy[0]


def test_a_missing_or_foreign_adapter_fails_the_start_naming_the_field(gpt2, tmp_path) -> None:
    with pytest.raises(PylonError) as e:
        LLMEngine(gpt2.dir, spec(adapters=[{"name": "gone", "path": str(tmp_path / "nowhere")}]))
    message = str(e.value)
    assert message.startswith(f"engine.adapters[0].path (gone, {tmp_path / 'nowhere'}): no such directory")
    assert "adapter directory in peft's format" in message
    # An adapter of another model (hidden size 64, not 128): named by its field, with the module at fault.
    from transformers import AutoConfig

    other_dir = tmp_path / "other-base"
    config = AutoConfig.for_model("gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=320)
    AutoModelForCausalLM.from_config(config).save_pretrained(other_dir)
    save_adapter(str(other_dir), str(tmp_path / "foreign"), 0, r=4, lora_alpha=8, target_modules=["c_attn"])
    adapters = [{"name": "foreign", "path": str(tmp_path / "foreign")}]
    with pytest.raises(PylonError, match=r"^engine\.adapters\[0\]\.path \(foreign, .*foreign\): .*c_attn"):
        LLMEngine(gpt2.dir, spec(adapters=adapters))


def test_a_lora_runs_adapter_export_serves_as_its_merged_export(family, tmp_path) -> None:
    """What Pylon's trainer writes for a LoRA run (pylon.models.with_lora, export_lora): the adapter alone
    (`pylon export --lora adapter`), served on the base model, gives the tokens the merged export (`--lora merged`)
    gives served as a model of its own."""
    import shutil

    from pylon.models import export_lora, with_lora
    from pylon.specs import LoraSpec

    targets = TARGETS[family.name][1]
    model = with_lora(
        AutoModelForCausalLM.from_pretrained(family.dir, dtype=torch.float32),
        LoraSpec(r=4, alpha=8, target_modules=targets),
    )
    torch.manual_seed(3)
    with torch.no_grad():  # as if trained: B away from its zero start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    export_lora(model, tmp_path / "adapter", merge=False)
    export_lora(model, tmp_path / "merged", merge=True)
    shutil.copy(f"{family.dir}/pylon_tokenizer.json", tmp_path / "merged")  # as `pylon export` writes it beside
    adapted = LLMEngine(family.dir, spec(adapters=[{"name": "run", "path": str(tmp_path / "adapter")}]))
    merged = LLMEngine(str(tmp_path / "merged"), spec())
    prompts = PROMPTS[:4]
    with_adapter = [
        c.token_ids
        for c in adapted.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, adapter="run"))
    ]
    as_merged = [c.token_ids for c in merged.generate(prompts, GREEDY)]
    assert with_adapter == as_merged
    assert with_adapter != [c.token_ids for c in adapted.generate(prompts, GREEDY)]  # the adapter does something
