"""Speculative decoding by n-gram prompt lookup (`engine/speculative.py`): greedy outputs token for token those of
`transformers` (and of the engine without it) while drafts are proposed and accepted; the acceptance rule leaves a
sampled token's distribution exactly the model's; the measured rule that turns it off; the counters."""

from __future__ import annotations

import pytest
import torch
from engine_models import FAMILIES, Family, assert_pool_empty, run, tokens_of

from pylon.serving.engine.sampling import SamplingParams, filtered_probs
from pylon.serving.engine.speculative import SpecPolicy, ngram_propose, verify

NGRAM = {"method": "ngram", "num_tokens": 4}


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
    plain, spec = family.engine(), family.engine(speculative=NGRAM)
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
    spec = family.engine(speculative=NGRAM)
    for i, prompt in enumerate(prompts):
        spec.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0))
    got = run(spec)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[f"r{i}"]) == family.hf_greedy(prompt, 60)
    stats = spec.stats()
    assert stats.spec_accepted_tokens_total >= stats.spec_draft_tokens_total / 2 > 0, stats
    assert max(len(o.token_ids) for outs in got.values() for o in outs) > 1  # a step gave several tokens


def test_sampled_requests_speculate_and_seeded_ones_stay_reproducible(tmp_path) -> None:
    """Unseeded sampled requests speculate and run to their length; seeded ones decode plainly (when a step
    speculates depends on measured times, and verification draws from the request's stream), so the same seed gives
    the same tokens run to run, next to speculating requests."""
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02)
    prompts = grounded_prompts()
    outs = []
    for _ in range(2):
        engine = family.engine(speculative=NGRAM)
        for i, prompt in enumerate(prompts):
            engine.add_request(
                f"seeded{i}", prompt, SamplingParams(max_tokens=32, temperature=0.7, seed=i, ignore_eos=True)
            )
            engine.add_request(f"free{i}", prompt, SamplingParams(max_tokens=32, temperature=0.7, ignore_eos=True))
        got = run(engine)
        assert all(len(tokens_of(v)) == 32 for v in got.values())
        outs.append({k: tokens_of(v) for k, v in got.items() if k.startswith("seeded")})
        assert engine.stats().spec_verify_steps_total > 0
        assert_pool_empty(engine)
    assert outs[0] == outs[1]


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


def test_the_rule_speculates_only_while_measured_times_say_it_pays() -> None:
    policy = SpecPolicy(k=4, accept_rate=0.5)
    assert not policy.decide(8, 0, 0)  # no drafts: nothing to decide
    assert policy.decide(8, 32, 0)  # nothing measured: measure speculation
    policy.observe_drafts(4, 2)
    policy.end_step(40, 0.010)  # 8 decodes + 32 drafts
    assert policy.accept_rate == 0.5  # 2 of 4 accepted: as it was
    assert not policy.decide(8, 32, 0)  # now the plain side
    policy.observe_step(8, 0.008)
    # weight-bound: 5x the tokens for 1.25x the time, (8 + 0.5 x 32) / 0.010 > 8 / 0.008: speculate
    assert policy.decide(8, 32, 0)
    policy.observe_step(320, 0.200)  # 64 decodes + 256 drafts: compute-bound
    policy.observe_step(64, 0.040)
    assert not policy.decide(64, 256, 0)  # (64 + 128) x 0.040 = 7.7 < 64 x 0.200 = 12.8
    policy.accept_rate = 0.0
    policy.observe_step(12, 0.0085)
    assert not policy.decide(8, 4, 0)  # nothing is accepted: even cheap drafts are not worth their time


def test_with_a_draft_model_the_rule_counts_its_proposing_too() -> None:
    policy = SpecPolicy(k=4, accept_rate=0.5)
    policy.observe_step(40, 0.010)  # 8 decodes + 32 drafts verified
    policy.observe_step(8, 0.008)
    assert policy.decide(8, 32, 0)  # prompt lookup: (8 + 16) x 0.008 > 8 x 0.010
    assert policy.decide(8, 32, 0, drafting=8)  # the draft model's proposing not measured yet: measure it
    policy.observe_draft(8, 0.020)  # its 4 passes for 8 decodes
    assert not policy.decide(8, 32, 0, drafting=8)  # (8 + 16) x 0.008 = 0.19 < 8 x (0.010 + 0.020) = 0.24
    policy.observe_draft(8, 0.002)  # cheaper now (0.8 x 0.020 + 0.2 x 0.002 = 0.0164): still not
    assert not policy.decide(8, 32, 0, drafting=8)
    for _ in range(10):
        policy.observe_draft(8, 0.002)
    assert policy.decide(8, 32, 0, drafting=8)  # ~0.0022: 0.19 > 8 x 0.0122 = 0.098
