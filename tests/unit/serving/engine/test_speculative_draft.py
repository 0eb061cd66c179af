"""Speculative decoding from a draft model (`engine.speculative.method: draft`, `engine/draft.py`): greedy outputs
token for token those of `transformers` whatever the draft model says; a draft that is the model itself is always
accepted and cuts the model's steps; long prompts catch the draft cache up in steps of the engine's token budget;
a draft model with another tokenizer or vocabulary is refused at start, naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from engine_models import FAMILIES, PROMPTS, Family, assert_pool_empty, run, spec, speculating, tokens_of
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}-draft"))


def save_model(directory, name: str, *, layers: int = 1, vocab: int = 320, seed: int = 3) -> str:
    """A random model of `name`'s family with `layers` layers, saved as a Pylon export with the byte tokenizer."""
    tok = ByteTokenizer()
    fields = dict(FAMILIES[name], vocab_size=vocab)
    fields["n_layer" if name == "gpt2" else "num_hidden_layers"] = layers
    config = AutoConfig.for_model(
        name, **fields, eos_token_id=tok.eos_id, bos_token_id=tok.eos_id, pad_token_id=tok.pad_id, initializer_range=0.5
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


def draft(model: str, num_tokens: int = 4) -> dict:
    return {"method": "draft", "draft_model": model, "num_tokens": num_tokens}


def test_the_model_as_its_own_draft_is_always_accepted_and_steps_emit_five_tokens(family: Family) -> None:
    # A token budget of 32: the 90- and 64-token prompts reach the draft cache over several catch-up steps.
    engine = speculating(family.engine(speculative=draft(family.dir), max_num_batched_tokens=32))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    got = run(engine)
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(got[f"r{i}"]) == family.hf_greedy(prompt, 24)
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_draft_model_steps_total > 0
    assert stats.spec_accepted_tokens_total >= 0.95 * stats.spec_draft_tokens_total, stats  # the same model
    # Each speculating step of a request emits its 4 drafts and the model's next token (fewer only at its
    # max_tokens).
    assert stats.spec_accepted_tokens_total / stats.spec_verify_steps_total + 1 >= 3.5, stats
    assert max(len(o.token_ids) for outs in got.values() for o in outs) == 5
    assert_pool_empty(engine)
    assert engine.drafter.pool.num_free_blocks == engine.drafter.pool.num_blocks  # every draft cache freed


def test_greedy_outputs_are_the_models_whatever_another_draft_model_says(family: Family, tmp_path) -> None:
    small = save_model(tmp_path / "small", family.name, layers=1, seed=11)
    engine = speculating(family.engine(speculative=draft(small, num_tokens=3)))
    plain = family.engine()
    for e in (engine, plain):
        for i, prompt in enumerate(PROMPTS):
            e.add_request(f"r{i}", prompt, GREEDY)
    got, expected = run(engine), run(plain)
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(got[f"r{i}"]) == tokens_of(expected[f"r{i}"]) == family.hf_greedy(prompt, 24)
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_verify_steps_total > 0, stats
    assert stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total  # another model: some are rejected
    assert_pool_empty(engine)


def test_sampled_requests_run_to_their_length_with_a_draft_model(family: Family) -> None:
    engine = speculating(family.engine(speculative=draft(family.dir)))
    params = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, params)
    got = run(engine)
    assert all(len(tokens_of(v)) == 30 for v in got.values())
    assert engine.stats().spec_verify_steps_total > 0
    assert_pool_empty(engine)


def test_a_draft_model_with_another_vocabulary_is_refused_naming_the_field(tmp_path) -> None:
    target = save_model(tmp_path / "target", "gpt2", layers=2)
    other = save_model(tmp_path / "other", "gpt2", vocab=384)
    with pytest.raises(
        PylonError, match=r"engine\.speculative\.draft_model .*other.*scores 384 tokens, the model's 320"
    ):
        LLMEngine(target, spec(speculative=draft(other)))
    with pytest.raises(PylonError, match=r"engine\.speculative\.draft_model .*absent"):
        LLMEngine(target, spec(speculative=draft(str(tmp_path / "absent"))))


def test_the_spec_says_what_method_draft_needs() -> None:
    with pytest.raises(ValueError, match="method draft needs draft_model"):
        spec(speculative={"method": "draft"})
    with pytest.raises(ValueError, match="draft_model is set but method is ngram"):
        spec(speculative={"method": "ngram", "draft_model": "/models/small"})


def test_the_draft_models_proposing_is_predicted_from_its_measured_passes_catch_up_included(family: Family) -> None:
    """What the rule weighs before the draft model runs: its catch-up on the tokens each draft cache lacks, in
    passes of the token budget, then k - 1 one-token passes, each priced as measured (a large catch-up pass of a size
    not measured, per token as the large ones were, which the engine times at start); and a floor, what the passes
    priced so far take, while some are not."""
    from pylon.serving.engine.draft import LARGE_PASS, DraftRequest, PassCosts

    engine = family.engine(speculative=draft(family.dir), max_num_batched_tokens=2 * LARGE_PASS)
    drafter = engine.drafter
    assert drafter.costs.per_token is not None and drafter.costs.per_token > 0  # priced at start
    assert drafter.pool.num_free_blocks == drafter.pool.num_blocks  # its scratch cache freed
    fresh = DraftRequest("new", list(range(3 * LARGE_PASS)), room=4)
    seconds, floor = drafter.estimate([fresh])
    # The prompt's catch-up is priced per token; the one-token passes were never measured: no estimate, a floor.
    assert seconds is None and floor == pytest.approx(3 * LARGE_PASS * drafter.costs.per_token)

    def cost(tokens: int, rows: int) -> float:
        return 0.001 + 0.0001 * tokens + 0.0005 * rows

    def measure(tokens: int, rows: int) -> None:
        drafter.costs.observe(tokens, rows, cost(tokens, rows))

    drafter.costs = PassCosts()
    for size in [(2 * LARGE_PASS, 0), (1, 1)]:
        measure(*size)
    drafter.costs.per_token = 0.0002  # (the large passes' per token, as if measured so)
    # 3 x LARGE_PASS tokens to catch up at 2 x LARGE_PASS a pass (the last gives the first draft; its size is
    # priced per token), then 3 one-token passes for drafts 2-4.
    expected = cost(2 * LARGE_PASS, 0) + 0.0002 * LARGE_PASS + 3 * cost(1, 1)
    assert drafter.estimate([fresh]) == pytest.approx((expected, expected))
    # Two requests, one a step behind (it holds all but 2 of its tokens): small passes are priced only as measured.
    drafter._computed["behind"] = 6
    behind = DraftRequest("behind", list(range(8)), room=2)
    small = DraftRequest("small", list(range(3)), room=2)
    assert drafter.estimate([behind, small]) == (None, 0.0)  # a 5-token pass for 2, a 2-row pass: never measured
    measure(5, 2)
    measure(2, 2)
    assert drafter.estimate([behind, small]) == pytest.approx((cost(5, 2) + cost(2, 2),) * 2)


def test_guided_requests_speculate_from_the_draft_model_too(family: Family) -> None:
    """The draft model knows nothing of the grammar: verification masks each of its drafts' rows by the grammar's
    state there and cuts a draft at its first refused token, so greedy guided output is still plain decoding's and
    validates."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "bb", "ccc"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=40, temperature=0, guide={"type": "json_schema", "schema": schema})
    plain, spec = family.engine(), speculating(family.engine(speculative=draft(family.dir)))
    for engine in (plain, spec):
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", prompt, params)
    expected, got = run(plain), run(spec)
    for key, outs in got.items():
        assert tokens_of(outs) == tokens_of(expected[key]), key
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(o.text for o in outs)), schema)
    stats = spec.stats()
    assert stats.spec_draft_model_steps_total > 0 and stats.spec_verify_steps_total > 0, stats
    assert_pool_empty(spec)
