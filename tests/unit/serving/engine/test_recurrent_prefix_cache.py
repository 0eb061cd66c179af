"""The prefix cache of a model with recurrent layers (Qwen3-Next's Gated DeltaNet; kv_cache.StateSnapshots): a
request starts from a cached prefix as far as a snapshot of the recurrent layers' states reaches: a prompt's last
block boundary (its computing split there), or the last boundary a request reached in decoding, so that a chat's
next turn starts past the whole of the last one. Every output is `transformers`' greedy continuation of its whole
prompt computed from scratch; prompt log-probabilities from the cache are the ones computed; at most
`engine.recurrent_state_snapshots` snapshots are kept, and 0 shares no prefix at all."""

from __future__ import annotations

import pytest
from engine_models import GREEDY, NEW_TOKENS, PROMPTS, Family, run, tokens_of

from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.model.families import recurrent_state_bytes


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Family:
    return Family("qwen3_next", tmp_path_factory.mktemp("qwen3-next-cache"))


SCORED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=1)


def turn(engine, name: str, prompt: list[int], params=GREEDY):
    engine.add_request(name, prompt, params)
    outs = run(engine)[name]
    return tokens_of(outs), outs[0].num_cached_tokens


def logprobs_of(engine, name: str, prompt: list[int]) -> list[float]:
    """Each generated token's log-probability (greedy): what a lost or wrong recurrent state changes even where a
    tiny model's argmax does not."""
    engine.add_request(name, prompt, SCORED)
    return [e.logprob for o in run(engine)[name] for e in o.logprobs]


@pytest.mark.parametrize("fields", [{}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}])
def test_a_chats_next_turn_starts_past_the_last_one(family, fields) -> None:
    engine = family.engine(**fields)
    first = PROMPTS[3]  # 90 tokens: its snapshot boundary is 80
    reply, cached = turn(engine, "turn-1", first)
    assert reply == family.greedy[3] and cached == 0
    assert engine.snapshots.stored >= 1
    # The next turn: the whole first turn, then a new message. The first turn computed 90 + len(reply) - 1 tokens
    # (its last token is never computed): its latest boundary in decoding, or its prompt's.
    second = first + reply + PROMPTS[6]
    computed = len(first) + len(reply) - 1
    deepest = max(computed // 16 * 16, 80)
    got, cached = turn(engine, "turn-2", second)
    assert got == family.hf_greedy(second, NEW_TOKENS) and cached == deepest, (cached, deepest)
    # The same prompt again: from its own prompt boundary (its last token's block is never shared).
    again, cached = turn(engine, "again", second)
    assert again == got and cached == (len(second) - 1) // 16 * 16
    assert engine.snapshots.restored == 2 and engine.runner._states == {}
    # A snapshot's bytes are what `pylon plan` counts for one (families.recurrent_state_bytes, fp32 here).
    kept = next(iter(engine.snapshots._kept.values()))
    assert sum(t.nbytes for layer in kept for t in layer) == recurrent_state_bytes(family.model.config, 4)
    # Its log-probabilities from the cache (the third start from it) are those computed from scratch.
    fresh = family.engine(enable_prefix_caching=False, **fields)
    want = logprobs_of(fresh, "scratch", second)
    got = logprobs_of(engine, "scored", second)
    assert engine.snapshots.restored == 3 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_prompt_logprobs_from_the_cache_are_the_computed_ones(family) -> None:
    engine = family.engine()
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    engine.add_request("a", PROMPTS[3], params)
    first = run(engine)["a"][0]
    engine.add_request("b", PROMPTS[3], params)
    second = run(engine)["b"][0]
    assert second.num_cached_tokens == 80
    assert [
        (e.token_id, round(e.logprob, 5), [t for t, _ in e.top]) if e else None for e in second.prompt_logprobs
    ] == [(e.token_id, round(e.logprob, 5), [t for t, _ in e.top]) if e else None for e in first.prompt_logprobs]


def test_snapshots_are_bounded_and_none_means_no_prefix_is_shared(family) -> None:
    engine = family.engine(recurrent_state_snapshots=1)
    for i in (3, 5, 6):  # 90, 64 and 33 tokens: snapshots at their prompts' and replies' boundaries, the last kept
        turn(engine, str(i), PROMPTS[i])
    assert len(engine.snapshots) == 1 and engine.snapshots.stored >= 3  # (a prompt's each, at least)
    reply = family.greedy[6]
    out, cached = turn(engine, "next-turn", PROMPTS[6] + reply + PROMPTS[0])  # the one kept: the last reply's
    assert cached == (len(PROMPTS[6]) + len(reply) - 1) // 16 * 16 > 32
    assert out == family.hf_greedy(PROMPTS[6] + reply + PROMPTS[0], NEW_TOKENS)
    out, cached = turn(engine, "90-again", PROMPTS[3])  # its snapshots were let go: computed from the start
    assert cached == 0 and out == family.greedy[3]
    off = family.engine(recurrent_state_snapshots=0)
    assert off.snapshots is None and not off.pool.enable_caching
    turn(off, "a", PROMPTS[3])
    out, cached = turn(off, "b", PROMPTS[3])
    assert cached == 0 and out == family.greedy[3]
