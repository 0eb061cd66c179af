"""`LLMEngine.load_weights`: an engine given another model's weights computes what an engine loaded from that model
computes (greedy continuations token for token, GPT-2 and Llama, oneDNN's packed projections and plain ones), forgets
its prefix cache, and refuses weights it cannot take, naming them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_models import GREEDY, PROMPTS, Family, spec

from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams


def _other(family: Family, directory) -> tuple[dict, str]:
    """Another model of `family`'s shape (its weights moved by noise), saved as an export: its state dict and
    directory."""
    other = copy.deepcopy(family.model).cpu()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    other.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text((Path(family.dir) / "pylon_tokenizer.json").read_text())
    return other.state_dict(), str(directory)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("packed", ["1", "0"])
def test_an_engine_given_other_weights_computes_what_one_loaded_from_them_does(family, tmp_path, monkeypatch, packed):
    monkeypatch.setenv("PYLON_ONEDNN_LINEAR", packed)
    state, directory = _other(family, tmp_path / "other")
    want = _greedy(LLMEngine(directory, spec()))
    engine = family.engine()
    before = _greedy(engine)
    assert before != want  # (the noise changes what the model says)
    taken = engine.load_weights(state.items())
    assert taken >= len([k for k in state if not k.endswith("attn.bias") and not k.endswith("masked_bias")]) - 1
    assert _greedy(engine) == want
    # back to the first weights: the first outputs again (nothing of the other model's left in any packed form)
    engine.load_weights(family.model.state_dict().items())
    assert _greedy(engine) == before


def test_new_weights_forget_the_prefix_cache(family, tmp_path):
    state, directory = _other(family, tmp_path / "other")
    engine = family.engine(enable_prefix_caching=True)
    prompt = PROMPTS[3]  # 90 tokens: five full blocks
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert engine.stats().num_cached_blocks > 0
    engine.load_weights(state.items())
    assert engine.stats().num_cached_blocks == 0
    hits = engine.stats().prefix_cache_hits_total
    got = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    assert engine.stats().prefix_cache_hits_total == hits  # the old keys and values were not reused
    assert (
        got == LLMEngine(directory, spec()).generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    )


def test_weights_it_cannot_take_are_refused_by_name(gpt2, tmp_path):
    engine = gpt2.engine()
    state = gpt2.model.state_dict()
    with pytest.raises(PylonError, match=r"weight transformer\.h\.0\.mlp\.c_fc\.weight: shape \[3, 4\]"):
        engine.load_weights([*state.items(), ("transformer.h.0.mlp.c_fc.weight", torch.zeros(3, 4))])
    with pytest.raises(PylonError, match=r"weight model\.layers\.0\.mlp\.up_proj\.weight: the engine's model"):
        engine.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 4))])
    with pytest.raises(PylonError, match=r"not given \(transformer\.wpe\.weight"):
        engine.load_weights([(k, v) for k, v in state.items() if k != "transformer.wpe.weight"])
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(PylonError, match="unfinished requests"):
        engine.load_weights(state.items())


def test_a_quantized_engine_says_why_it_cannot_take_weights(gpt2):
    engine = gpt2.engine(quantization="int8")
    with pytest.raises(PylonError, match=r"cannot be replaced: its projections are quantized \(int8\)"):
        engine.load_weights(gpt2.model.state_dict().items())
