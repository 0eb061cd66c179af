"""Speculative decoding by n-gram prompt lookup (`engine/speculative.py`): greedy outputs token for token those of
`transformers` (and of the engine without it) while drafts are proposed and accepted; the acceptance rule leaves a
sampled token's distribution exactly the model's; the measured rule that turns it off; the counters."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from engine_models import FAMILIES, Family, assert_pool_empty, run, speculating, tokens_of

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.engine.sampling import SamplingParams, filtered_probs, shape_logits
from pylon.serving.engine.speculative import BUDGET, SpecPolicy, ngram_propose, verify

NGRAM = {"method": "ngram", "num_tokens": 4}
EOS = ByteTokenizer().eos_id


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}-spec"))


def grounded_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (as code edits and summaries copy from their input)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (5, 9, 14, 20):
        phrase = torch.randint(0, 256, (n,), generator=g).tolist()
        out.append(phrase * 3 + phrase[: n // 2])
    return out


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 3, 1) == [7, 5, 1]  # the latest "1 2 3"
    assert ngram_propose([4, 5, 6, 4, 5], 2, 3, 1) == [6, 4]  # "4 5" (no "6 4 5" earlier)
    assert ngram_propose([4, 5, 6, 7], 2, 3, 1) == []  # nothing repeats
    assert ngram_propose([8, 1, 8], 4, 1, 1) == [1, 8]  # stops at the end of the tokens
    assert ngram_propose([5, 5, 5, 5, 5, 5, 5], 3, 2, 1) == [5, 5, 5]  # a loop: an earlier match with k to follow
    assert ngram_propose([3], 2, 3, 1) == []


def test_greedy_outputs_are_unchanged_and_drafts_are_accepted(family: Family) -> None:
    prompts = grounded_prompts()
    greedy = SamplingParams(max_tokens=48, temperature=0)
    plain, spec = family.engine(), speculating(family.engine(speculative=NGRAM))
    for engine in (plain, spec):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy)
    expected, got = run(plain), run(spec)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[f"r{i}"]) == tokens_of(expected[f"r{i}"]) == family.hf_greedy(prompt, 48)
    stats = spec.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_verify_steps_total > 0, stats
    assert stats.generation_tokens_total == plain.stats().generation_tokens_total
    assert_pool_empty(spec)


def test_a_model_that_repeats_itself_gets_several_tokens_a_step(tmp_path) -> None:
    """At the default init scale a random model's greedy output falls into a loop, which prompt lookup predicts:
    drafts are accepted, steps emit several tokens, and the output is still transformers' own."""
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02)
    prompts = grounded_prompts()
    spec = speculating(family.engine(speculative=NGRAM))
    for i, prompt in enumerate(prompts):
        spec.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0))
    got = run(spec)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[f"r{i}"]) == family.hf_greedy(prompt, 60)
    stats = spec.stats()
    assert stats.spec_accepted_tokens_total >= stats.spec_draft_tokens_total / 2 > 0, stats
    assert max(len(o.token_ids) for outs in got.values() for o in outs) > 1  # a step gave several tokens


def test_sampled_requests_speculate_and_a_seed_gives_plain_decodings_tokens(tmp_path) -> None:
    """Sampled requests speculate, seeded ones included: verification draws each row's token as the sampler would,
    from the request's own stream, one draw per token emitted, so a seeded request gives the tokens plain decoding gives
    it, whether and whenever its steps speculate (here: next to unseeded requests, at temperatures 0.1 and 0.3, with
    top-k and min-p: low enough that this random model's loops are still drawn and drafts accepted)."""
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02)
    prompts = grounded_prompts()
    runs = []
    for speculative in (None, NGRAM, NGRAM):
        engine = family.engine(speculative=speculative) if speculative else family.engine()
        if speculative:
            speculating(engine)
        for i, prompt in enumerate(prompts):
            hot = {"temperature": 0.3, "top_k": 20, "min_p": 0.01} if i % 2 else {"temperature": 0.1}
            engine.add_request(f"seeded{i}", prompt, SamplingParams(max_tokens=32, seed=i, ignore_eos=True, **hot))
            engine.add_request(f"free{i}", prompt, SamplingParams(max_tokens=32, temperature=0.7, ignore_eos=True))
        got = run(engine)
        assert all(len(tokens_of(v)) == 32 for v in got.values())
        runs.append({k: tokens_of(v) for k, v in got.items() if k.startswith("seeded")})
        if speculative:
            stats = engine.stats()
            assert stats.spec_verify_steps_total > 0 and stats.spec_accepted_tokens_total > 0, stats
            assert max(len(o.token_ids) for k, outs in got.items() if k.startswith("seeded") for o in outs) > 1
        assert_pool_empty(engine)
    assert runs[0] == runs[1] == runs[2]


SHAPED = {
    "repetition": SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3),
    "presence+frequency": SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.2, frequency_penalty=0.1),
    "logit_bias": SamplingParams(max_tokens=40, temperature=0, logit_bias={7: 2.5, 65: -100.0}),
    # eos made the likeliest token by far: held back until 30 tokens are out, then taken
    "min_tokens": SamplingParams(max_tokens=40, temperature=0, min_tokens=30, logit_bias={EOS: 50.0}),
    "logprobs": SamplingParams(max_tokens=40, temperature=0, logprobs=3),
    "prompt_logprobs": SamplingParams(max_tokens=40, temperature=0, logprobs=2, prompt_logprobs=2),  # echo's
    "all": SamplingParams(
        max_tokens=40, temperature=0, repetition_penalty=1.1, frequency_penalty=0.2, logit_bias={7: 1.0}, logprobs=2
    ),
}

BARE = {"max_tokens": 40, "temperature": 0}


@pytest.mark.parametrize("case", list(SHAPED))
def test_penalties_bias_min_tokens_and_logprobs_speculate_and_change_nothing(case: str, tmp_path) -> None:
    """Requests that shape their logits (penalties, logit_bias, min_tokens) or want logprobs speculate: each draft
    position's row is shaped by the history up to it, so greedy tokens are token for token plain decoding's, and each
    token's logprobs are the ones plain decoding reports (the model's own row that scored it)."""
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02)  # repeats itself: drafts get accepted
    params = SHAPED[case]
    plain, spec, unshaped = family.engine(), speculating(family.engine(speculative=NGRAM)), family.engine()
    for engine in (plain, spec, unshaped):
        for i, prompt in enumerate(grounded_prompts()):
            engine.add_request(f"r{i}", prompt, params if engine is not unshaped else SamplingParams(**BARE))
    expected, got, bare = run(plain), run(spec), run(unshaped)
    if params.shapes_logits:  # the shaping is in force: some request's tokens are not the bare model's
        assert any(tokens_of(got[key]) != tokens_of(bare[key]) for key in bare)
    for key in expected:
        assert tokens_of(got[key]) == tokens_of(expected[key]), key
        if params.logprobs is not None:
            want = [lp for o in expected[key] for lp in o.logprobs]
            have = [lp for o in got[key] for lp in o.logprobs]
            assert [lp.token_id for lp in have] == tokens_of(got[key])
            assert [[t for t, _ in lp.top] for lp in have] == [[t for t, _ in lp.top] for lp in want], key
            assert have[0].top and len(have[0].top) == params.logprobs
            flat = lambda lps: [lp.logprob for lp in lps] + [v for lp in lps for _, v in lp.top]  # noqa: E731
            assert flat(have) == pytest.approx(flat(want), abs=1e-4), key
        if params.prompt_logprobs is not None:
            want, have = expected[key][0].prompt_logprobs, got[key][0].prompt_logprobs
            assert have[0] is None and [lp.token_id for lp in have[1:]] == [lp.token_id for lp in want[1:]], key
            assert [lp.logprob for lp in have[1:]] == pytest.approx([lp.logprob for lp in want[1:]], abs=1e-4)
    stats = spec.stats()
    assert stats.spec_verify_steps_total > 0 and stats.spec_accepted_tokens_total > 0, stats
    assert max(len(o.token_ids) for outs in got.values() for o in outs) > 1  # some step gave several tokens
    if params.min_tokens:  # each request ends on the eos it was kept from: its 31st token
        assert all(outs[-1].finish_reason == "stop" and tokens_of(outs)[30:] == [EOS] for outs in got.values())
    assert_pool_empty(spec)


RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "role", "tags"],
    "additionalProperties": False,
}


def record_prompts() -> list[list[int]]:
    """Prompts that hold records of the schema's shape (as an extraction task's input does), compact and spaced."""
    out = []
    for name, role, tags in (("ada", "admin", ["red"]), ("bo", "guest", ["green", "blue"]), ("cy", "user", [])):
        one = json.dumps({"name": name, "role": role, "tags": tags})
        compact = json.dumps({"name": name, "role": role, "tags": tags}, separators=(",", ":"))
        out.append(list(f"records: {one}\n{compact}\nnext: ".encode()))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_speculate_and_still_validate(temperature: float, tmp_path) -> None:
    """Guided requests speculate: each draft position's row is masked by the grammar's state after the drafts before
    it, a draft the grammar refuses is cut there, and the matcher takes exactly the tokens emitted. Greedy output is
    token for token plain decoding's; every output, greedy or sampled, validates; the drafts the grammar forces are
    accepted. A seeded sampled request gives plain decoding's tokens too."""
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02)
    guide = {"type": "json_schema", "schema": RECORD}
    plain, spec = family.engine(), speculating(family.engine(speculative=NGRAM))
    for engine in (plain, spec):
        for i, prompt in enumerate(record_prompts()):
            # room for the longest record the schema allows (sampled: 77 tokens at most in 45 tries), seeded
            params = SamplingParams(max_tokens=128, temperature=temperature, seed=i, guide=guide)
            engine.add_request(f"r{i}", prompt, params)
    expected, got = run(plain), run(spec)
    for key, outs in got.items():
        text = "".join(o.text for o in outs)
        assert outs[-1].finish_reason == "stop", (key, text)
        jsonschema.validate(json.loads(text), RECORD)
        assert tokens_of(outs) == tokens_of(expected[key]), key  # greedy, and sampled with a seed
    stats = spec.stats()
    assert stats.spec_verify_steps_total > 0 and stats.spec_accepted_tokens_total > 0, stats
    assert max(len(o.token_ids) for outs in got.values() for o in outs) > 1  # some step gave several tokens
    assert spec.guides.guided_tokens_total == sum(len(tokens_of(outs)) for outs in got.values())
    assert_pool_empty(spec)


def test_sampled_rows_with_penalties_keep_the_shaped_distribution() -> None:
    """A sampled request with penalties verifies against the shaped rows it is given: the first token emitted is
    distributed as the shaped row's probabilities (the penalty moved mass off the penalised token), not the model's."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 8, generator=g)
    rows[0, 2] = 3.0  # the token the penalty hits would be the likeliest
    params = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0)
    shaped = shape_logits(rows, [params] * 2, [([], [2, 2]), ([], [2, 2, 5])])
    p = filtered_probs(shaped, [params] * 2)
    assert p[0, 2] < filtered_probs(rows, [params] * 2)[0, 2] / 10
    n, first = 8000, torch.zeros(8)
    gen = torch.Generator().manual_seed(4)
    for _ in range(n):
        out, _ = verify(shaped, [2], params, gen)
        first[out[0]] += 1
    assert torch.allclose(first / n, p[0], atol=0.02), (first / n, p[0])


@pytest.mark.parametrize("draft", [[0, 1], [7, 0]])
def test_the_acceptance_rule_keeps_the_models_distribution(draft) -> None:
    """Whatever the draft, the first token emitted is distributed as the model's own (temperature, top-k) and so is
    the second given the first: 12,000 verifications against the exact probabilities (4 standard errors)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 8, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6)
    p = filtered_probs(rows, [params] * 3)
    n = 12_000
    first = torch.zeros(8)
    second_after = torch.zeros(8)  # the second token's counts, where the first was draft[0] (accepted)
    accepted_first = 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        out, _ = verify(rows, draft, params, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            accepted_first += 1
            second_after[out[1]] += 1
    assert torch.allclose(first / n, p[0], atol=0.018), (first / n, p[0])
    if accepted_first > 1000:
        tol = 4 * (0.25 / accepted_first) ** 0.5
        assert torch.allclose(second_after / accepted_first, p[1], atol=tol), (second_after / accepted_first, p[1])


def test_greedy_verification_takes_drafts_while_they_are_the_argmax() -> None:
    rows = torch.full((4, 5), -1.0)
    for i, best in enumerate([2, 3, 1, 4]):
        rows[i, best] = 1.0
    assert verify(rows, [2, 3, 1], SamplingParams(temperature=0), None) == ([2, 3, 1, 4], 3)
    assert verify(rows, [2, 0, 1], SamplingParams(temperature=0), None) == ([2, 3], 1)
    assert verify(rows, [0, 3, 1], SamplingParams(temperature=0), None) == ([2], 0)


def _steps(policy: SpecPolicy, decodes: int, cost, n: int, *, per: int = 4, accepted: int = 2, other: int = 0) -> int:
    """`n` engine steps of `decodes` decodes with `per` drafts each when the rule speculates (`accepted` of them
    accepted), each taking `cost(tokens, rows)` seconds; returns the steps that speculated."""
    tried = 0
    for _ in range(n):
        drafts = per * decodes
        if policy.decide(decodes, drafts, other):
            tried += 1
            for _ in range(decodes):
                policy.observe_drafts(per, accepted)
            size = decodes + drafts
        else:
            size = decodes
        policy.end_step(size + other, size, cost(size + other, size))
    return tried


def _weight_bound(tokens: int, rows: int) -> float:
    """A GPU at small batches: a step costs reading the weights, whatever its size, up to ~500 tokens."""
    return max(0.010, 0.00002 * tokens)


def _cpu_like(tokens: int, rows: int) -> float:
    """A CPU: bound by reading the weights up to ~30 tokens a step, then by arithmetic (the output layer's rows
    too)."""
    return max(0.020, 0.0007 * tokens) + 0.0002 * rows


def test_the_acceptance_rate_weighs_a_step_by_the_drafts_it_verified() -> None:
    """One decode's 3 rejected drafts say little about a source (its first tries, right after a prompt, may be its
    worst); 32 decodes' 96 say much: the first moves the rate a little, the second nearly all the way."""
    few, many = SpecPolicy(k=3, accept_rate=0.6), SpecPolicy(k=3, accept_rate=0.6)
    few.observe_drafts(3, 0)
    few.end_step(4, 4, 0.010)
    for _ in range(32):
        many.observe_drafts(3, 0)
    many.end_step(128, 128, 0.010)
    assert 0.5 < few.accept_rate < 0.6 and many.accept_rate < 0.02
    # three such steps of one decode, 1 draft of 9 accepted: still above a break-even of 0.3, so it goes on looking
    for accepted in (0, 1, 0):
        few.observe_drafts(3, accepted)
        few.end_step(4, 4, 0.010)
    assert 0.3 < few.accept_rate < 0.5


def test_drafts_are_counted_by_their_position_among_a_request_s_drafts() -> None:
    """vLLM's num_accepted_tokens_per_pos: a request's i-th draft is accepted only after the ones before it, so the
    counts fall with the position; verified counts fall where some requests had fewer drafts."""
    policy = SpecPolicy(k=4)
    for proposed, accepted in ((4, 4), (4, 1), (2, 0), (3, 2)):
        policy.observe_drafts(proposed, accepted)
    assert policy.proposed_by_position == [4, 4, 3, 2]
    assert policy.accepted_by_position == [3, 2, 1, 1]
    assert sum(policy.accepted_by_position) == policy.accepted_total == 7


def test_the_rule_measures_each_side_then_speculates_only_while_it_pays() -> None:
    policy = SpecPolicy(k=4, accept_rate=0.5)
    assert not policy.decide(8, 0, 0)  # no drafts: nothing to decide
    assert not policy.decide(8, 32, 0)  # nothing measured: the plain side first (it costs nothing)
    policy.end_step(8, 8, 0.008)
    assert policy.decide(8, 32, 0)  # then speculation, to measure it
    policy.observe_drafts(32, 16)
    policy.end_step(40, 40, 0.010)
    assert policy.accept_rate == 0.5  # 16 of 32 accepted: as it was
    # weight-bound: 5x the tokens for 1.25x the time; break-even r = 8 x (0.010 - 0.008) / (32 x 0.008) < 0.5
    assert policy.decide(8, 32, 0)
    assert policy.breakeven[(8, 4)] == pytest.approx(0.0625)
    # On a weight-bound device it then speculates in every step; the plain side is looked at again now and then.
    assert _steps(policy, 8, _weight_bound, 100) >= 97
    # Nothing accepted any more: even cheap drafts are not worth their time.
    policy.accept_rate = 0.0
    assert not policy.decide(8, 32, 0)


def test_under_load_on_a_compute_bound_device_the_rule_stops_after_measuring_and_infers_the_other_sizes() -> None:
    """~64 decodes x 5 tokens cost ~4.5x a plain step on a CPU for ~3x the tokens: two speculating steps measure it,
    then none (the choice is far from close: explored again only every EXPLORE_FAR_EVERY steps, within the budget);
    a larger batch is then known not to gain without trying it, and a smaller one that gained says yes for those
    below it."""
    policy = SpecPolicy(k=4, accept_rate=0.5)
    assert _steps(policy, 64, _cpu_like, 300) == 2
    assert policy.breakeven[(64, 4)] > 0.5
    assert _steps(policy, 128, _cpu_like, 50) == 0 and (128, 4) not in policy.breakeven
    assert _steps(policy, 2, _cpu_like, 50) >= 45  # weight-bound at 10 tokens: measured, then yes
    assert policy.breakeven[(2, 4)] < 0.5
    assert policy.decide(1, 4, 0) and (1, 4) not in policy.breakeven  # inferred from 2


def test_steps_with_prompt_tokens_never_measure_and_speculate_where_decode_steps_gain() -> None:
    policy = SpecPolicy(k=4, accept_rate=0.5)
    assert _steps(policy, 8, _weight_bound, 20, other=100) == 0  # sizes that rarely repeat: not a measurement
    assert _steps(policy, 8, _weight_bound, 5) == 4  # decodes alone: plain, then measured, then yes
    assert _steps(policy, 8, _weight_bound, 20, other=100) == 20  # decodes alone gain: so does a step beside a prompt


def test_the_rule_stops_trying_once_speculation_lost_its_budget() -> None:
    policy = SpecPolicy(k=4, accept_rate=0.5)
    _steps(policy, 8, _weight_bound, 3)  # the plain side measured, and plenty of time
    policy._lost = BUDGET * policy.seconds_total + 1.0  # speculating steps that did not pay lost more than that
    assert not policy.may_try
    assert _steps(policy, 16, _weight_bound, 10) == 0  # a size not measured yet is not tried
    assert policy.lost_seconds > 0


def test_with_a_draft_model_the_rule_counts_its_proposing_too() -> None:
    def measured() -> SpecPolicy:
        policy = SpecPolicy(k=4, accept_rate=0.5)
        for tokens, seconds in [(40, 0.010), (40, 0.010), (8, 0.008)]:  # 8 decodes + 32 drafts, 8 decodes
            policy.observe_step(tokens, tokens, seconds)
        return policy

    assert measured().decide(8, 32, 0)  # prompt lookup: r = 0.0625 < 0.5
    assert measured().decide(8, 32, 0, proposing=None)  # the draft model's proposing not predictable yet: measure it
    assert not measured().decide(8, 32, 0, proposing=0.020)  # r = 8 x (0.010 + 0.020 - 0.008) / (32 x 0.008) = 0.69
    assert measured().decide(8, 32, 0, proposing=0.002)  # r = 0.125
    # Not predictable, but its passes that were measured (a prompt's catch-up) already cost more than it could gain:
    # no speculating step is spent to measure the rest. r >= 8 x 0.1 / (32 x 0.008) = 3.1.
    fresh = SpecPolicy(k=4, accept_rate=0.5)
    fresh.end_step(8, 8, 0.008)
    assert not fresh.decide(8, 32, 0, proposing=None, floor=0.1)
    assert fresh.decide(8, 32, 0, proposing=None, floor=0.001)


def test_without_a_draft_model_fewer_drafts_per_decode_are_inferred_from_more() -> None:
    """A speculating step's fixed cost is shared by its drafts: where 4 drafts a decode did not gain, 1-3 would not
    either, and are not tried; a draft model's passes grow with its drafts, so there nothing is inferred."""

    def twice(tokens: int, rows: int) -> float:  # a speculating step costs two plain ones (the output layer's rows)
        return 0.040 if rows > 1 else 0.020

    policy = SpecPolicy(k=4, accept_rate=0.2)
    # Plain, then 4 drafts measured: r = 0.25, no (not measured again: that step lost 0.02 s of 0.14, over budget).
    assert _steps(policy, 1, twice, 6, accepted=0) == 1
    assert policy.breakeven[(1, 4)] > policy.accept_rate
    policy.seconds_total += 10.0  # budget to measure with, had it reason to
    for per in (1, 2, 3):
        assert not policy.decide(1, per, 0), per
    with_draft = SpecPolicy(k=4, accept_rate=0.2)
    with_draft.breakeven[(1, 4)] = 1.0
    with_draft.observe_step(1, 1, 0.02)
    assert with_draft.decide(1, 2, 0, proposing=None)  # 2 drafts a decode: measured
