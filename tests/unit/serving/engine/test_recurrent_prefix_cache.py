"""The prefix cache of a model with recurrent layers (Qwen3-Next's Gated DeltaNet; kv_cache.StateSnapshots): a
request starts from a cached prefix as far as a snapshot of the recurrent layers' states reaches: a prompt's last
block boundary (its computing split there), or the last boundary a request reached in decoding, so that a chat's
next turn starts past the whole of the last one. Every output is `transformers`' greedy continuation of its whole
prompt computed from scratch; prompt log-probabilities from the cache are the ones computed; at most
`engine.recurrent_state_snapshots` snapshots are kept, and 0 shares no prefix at all."""

from __future__ import annotations

import pytest
from engine_models import GREEDY, NEW_TOKENS, PROMPTS, Family, run, speculating, tokens_of

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


@pytest.mark.slow  # make test-all: ~15 s
def test_speculative_drafts_are_verified_and_rejected_ones_taken_back(family, monkeypatch) -> None:
    """Drafts on a model with recurrent layers: the runner keeps each layer's state after every draft and goes back
    to the last one accepted, so greedy outputs and their log-probabilities are those of plain decoding. The drafts
    here are the model's own continuation with every third token wrong (a random model follows no n-gram), so each
    step accepts two and takes one back, and block boundaries fall inside speculating steps; the latest one a request
    reached is snapshotted there, and its next turn, started from it, scores as one computed from scratch."""
    import pylon.serving.engine.engine as engine_module

    def propose(token_ids, room, *_):
        for p, continuation in zip(PROMPTS, family.greedy):
            if token_ids[: len(p)] == p:
                draft = continuation[len(token_ids) - len(p) :][:room]
                return [t if k % 3 < 2 else (t + 1) % 256 for k, t in enumerate(draft)]
        return []

    monkeypatch.setattr(engine_module, "ngram_propose", propose)
    plain = family.engine(enable_prefix_caching=False)
    want = [logprobs_of(plain, f"p{i}", p) for i, p in enumerate(PROMPTS)]
    engine = speculating(family.engine(speculative={"method": "ngram", "num_tokens": 4}))
    kept = []
    keep_state = engine.runner.keep_state
    engine.runner.keep_state = lambda key, count, snapshot=None: (
        kept.append(snapshot) or keep_state(key, count, snapshot)
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SCORED)
    outputs = run(engine)
    for i, p in enumerate(PROMPTS):
        assert tokens_of(outputs[str(i)]) == family.greedy[i], i
        got = [e.logprob for o in outputs[str(i)] for e in o.logprobs]
        # (a draft's row is a query among several over the cache, a decode's alone: fp32 rounding apart)
        assert max(abs(a - b) for a, b in zip(got, want[i])) < 1e-3, i
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total  # some taken, some taken back
    assert any(at is not None and at > 1 for at in kept)  # a boundary passed by accepted drafts: snapshotted there
    for i, p in enumerate(PROMPTS):
        reply = tokens_of(outputs[str(i)])
        second = p + reply + PROMPTS[0]
        engine.add_request(f"next-{i}", second, SCORED)
        outs = run(engine)[f"next-{i}"]
        deepest = (len(p) + len(reply) - 1) // 16 * 16
        assert outs[0].num_cached_tokens == (deepest if deepest > len(p) else (len(p) - 1) // 16 * 16), i
        got = [e.logprob for o in outs for e in o.logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs_of(plain, f"next-{i}", second))) < 1e-3, i


def test_a_draft_model_with_recurrent_layers_is_refused_by_name(family) -> None:
    from pylon.errors import PylonError

    with pytest.raises(PylonError, match="engine.speculative.draft_model .*recurrent layers is not served"):
        family.engine(speculative={"method": "draft", "draft_model": family.dir, "num_tokens": 3})


def test_a_shared_system_prompt_is_snapshotted_where_the_server_says(family) -> None:
    """`snapshot_at` (the server's: where a chat's last message begins): the prompt's computing is also split at the
    last block boundary before it, and the states snapshotted there, so another conversation with the same system
    prompt starts past it; without it, nothing before the prompt's own last boundary is kept."""
    system, first, second = PROMPTS[3][:70], PROMPTS[6], PROMPTS[2]  # 70 shared tokens, then 33 or 40 of each
    engine = family.engine()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=1, snapshot_at=len(system))
    engine.add_request("a", system + first, params)
    run(engine)
    engine.add_request("b", system + second, params)
    outs = run(engine)["b"]
    assert outs[0].num_cached_tokens == 64  # (70 - 1) // 16 * 16
    plain = family.engine(enable_prefix_caching=False)
    want = logprobs_of(plain, "b", system + second)
    # (the prompt computed in other chunks than from scratch: the chunked delta rule's fp32 rounding, 1e-4's order)
    assert max(abs(e.logprob - w) for e, w in zip((e for o in outs for e in o.logprobs), want)) < 1e-3
    assert tokens_of(outs) == family.hf_greedy(system + second, NEW_TOKENS)
    unhinted = family.engine()
    turn(unhinted, "a", system + first)
    assert turn(unhinted, "b", system + second)[1] == 0


def test_prompts_sharing_a_long_start_share_it_every_interval(family) -> None:
    """engine.recurrent_snapshot_interval: a prompt's states are snapshotted every that many tokens too, so another
    prompt that shares its start (a document, then another question) starts from the deepest such boundary within
    it; its log-probabilities are those computed from scratch."""
    document, first, second = PROMPTS[3][:75], PROMPTS[6], PROMPTS[2]  # 75 shared tokens, then 33 or 40 of each
    engine = family.engine(recurrent_snapshot_interval=32)
    assert engine.scheduler.snapshot_boundaries(_request(document + first)) == (32, 64, 96)
    turn(engine, "a", document + first)
    engine.add_request("b", document + second, SCORED)
    outs = run(engine)["b"]
    assert outs[0].num_cached_tokens == 64  # the interval's last boundary within the shared 75
    want = logprobs_of(family.engine(enable_prefix_caching=False), "b", document + second)
    assert max(abs(e.logprob - w) for e, w in zip((e for o in outs for e in o.logprobs), want)) < 1e-3
    plain = family.engine()  # no interval: nothing before the prompts' own last boundaries is kept
    turn(plain, "a", document + first)
    assert turn(plain, "b", document + second)[1] == 0


def _request(prompt: list[int]):
    from pylon.serving.engine.request import Request

    return Request("x", prompt, GREEDY, 4, None, None)
