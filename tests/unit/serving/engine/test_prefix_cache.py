"""Automatic prefix caching: the pool's content-addressed blocks, and the engine's outputs with the cache on, which
must be token for token those with it off (and `transformers`' greedy ones) whatever shares, preempts or aborts."""

from __future__ import annotations

import random

import pytest
import torch
from engine_models import GREEDY, Family, assert_pool_empty, run, tokens_of

from pylon.serving.engine.kv_cache import KVBlockPool, block_hashes
from pylon.serving.engine.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_prefix() -> None:
    a = block_hashes(list(range(10)), 4, [])
    assert len(a) == 2  # two full blocks; the last two tokens are no block yet
    assert block_hashes(list(range(12)), 4, list(a))[:2] == a  # extending keeps what was there
    b = block_hashes([99] + list(range(1, 10)), 4, [])
    assert a[0] != b[0] and a[1] != b[1]  # the second blocks hold equal tokens, but after another first block
    assert block_hashes(list(range(4, 8)), 4, []) != a[1:]  # a block alone is not the block after a prefix


def test_cached_blocks_are_shared_by_reference_and_kept_after_free() -> None:
    pool = KVBlockPool(8, 4, enable_caching=True)
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4, [])
    assert pool.allocate("a", 12)
    pool.cache_blocks("a", hashes, 3)
    assert pool.lookup(hashes) == pool.block_table("a")
    assert pool.allocate("b", 14, cached=pool.lookup(hashes[:2]))  # shares two, takes two of its own
    shared = pool.block_table("a")[:2]
    assert pool.block_table("b")[:2] == shared and all(pool.ref_count(x) == 2 for x in shared)
    assert pool.num_free_blocks == 8 - 3 - 2
    pool.free("a")
    assert [pool.ref_count(x) for x in shared] == [1, 1] and pool.num_free_blocks == 8 - 4
    pool.free("b")
    assert pool.num_free_blocks == 8 and pool.utilization == 0.0
    assert pool.lookup(hashes) == [0, 1, 2]  # free, and still cached
    # Sharing free cached blocks takes them from the free count, all or nothing.
    assert pool.allocate("c", 16, cached=pool.lookup(hashes))
    assert pool.num_free_blocks == 4 and pool.block_table("c")[:3] == [0, 1, 2]


def test_free_cached_blocks_are_reused_least_recently_used_first_and_only_when_nothing_bare_is_left() -> None:
    pool = KVBlockPool(6, 2, enable_caching=True)
    old, new = block_hashes([1, 1, 1, 1], 2, []), block_hashes([2, 2, 2, 2], 2, [])
    for rid, hashes in (("old", old), ("new", new)):
        assert pool.allocate(rid, 4)
        pool.cache_blocks(rid, hashes, 2)
        pool.free(rid)
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 6
    assert pool.allocate("x", 4) and pool.block_table("x") == [4, 5]  # the bare blocks first
    assert pool.num_cached_blocks == 4
    assert pool.allocate("x", 6) and pool.block_table("x")[2] == 1  # then the least recently used: old's, its end
    assert pool.lookup(old) == [0] and pool.lookup(new) == [2, 3]
    assert pool.allocate("x", 8) and pool.block_table("x")[3] == 0  # block 2, right after, holds new's: not it
    assert pool.lookup(old) == [] and pool.lookup(new) == [2, 3] and pool.num_cached_blocks == 2


def test_a_full_cache_keeps_the_prefix_used_lately_whatever_run_a_new_request_takes() -> None:
    """A new request takes a run of blocks (attention reads one faster), but with the cache full of cached contents
    only among the least recently used: a chat's prefix used a request ago is never the lowest open run taken for a
    newcomer (before, the lowest open run was taken wherever it lay, and the chat computed its prefix again)."""
    pool = KVBlockPool(256, 16, enable_caching=True)
    rng = random.Random(0)

    def request(rid: str, ids: list[int]) -> int:
        hashes = block_hashes(ids, 16, [])
        cached = pool.lookup(hashes)
        assert pool.allocate(rid, len(ids), reserve_tokens=len(ids), cached=cached)
        pool.cache_blocks(rid, hashes, len(ids) // 16)
        pool.free(rid)
        return len(cached)

    chat = [rng.randrange(256) for _ in range(320)]  # 20 blocks
    found, runs = [], 0
    for turn in range(40):
        found.append(request(f"chat{turn}", chat))
        assert pool.allocate(f"new{turn}", 480, reserve_tokens=480)  # 30 blocks of new text
        table = pool.block_table(f"new{turn}")
        runs += table == list(range(table[0], table[0] + 30))
        pool.cache_blocks(f"new{turn}", block_hashes([rng.randrange(256) for _ in range(480)], 16, []), 30)
        pool.free(f"new{turn}")
    assert found == [0] + [20] * 39  # (the pool holds 256 blocks: 12 turns of new text fill it)
    assert runs >= 30, runs  # and most newcomers still got a run of their own


def test_a_windowed_table_lets_go_of_the_blocks_before_the_window() -> None:
    """`trim` (a model attending within a sliding window in every layer): the blocks wholly before a position go back
    to the pool, the null block in their place so that positions keep their indices, never the table's last; a
    registered block stays cached for a later request; one let go of before it was registered is not registered; a
    block another request shares stays held by it; `free` lets go of the rest."""
    pool = KVBlockPool(8, 4, enable_caching=True)
    pool.set_window(null_block=8)
    tokens = list(range(20))
    hashes = block_hashes(tokens, 4, [])
    assert pool.allocate("a", 12)
    pool.cache_blocks("a", hashes, 2)  # blocks 0 and 1 registered; block 2 not yet
    assert pool.trim("a", 11) == 2  # positions 0-7 (blocks 0, 1); block 2 holds position 11's keys
    assert pool.block_table("a") == [8, 8, 2] and pool.held_blocks("a") == 1 and pool.num_free_blocks == 7
    assert pool.lookup(hashes) == [0, 1]  # let go of, and still cached
    assert pool.trim("a", 11) == 0  # (nothing more before it)
    assert pool.allocate("b", 12, cached=pool.lookup(hashes[:2]))  # shares the cached two, takes one of its own
    assert pool.trim("a", 100) == 0  # never the last block
    assert pool.allocate("a", 20) and pool.trim("a", 17) == 2  # blocks 2 and 3 go; 4 (positions 16-19) stays
    pool.cache_blocks("a", hashes, 5)  # (the let go of ones are not registered: their keys may be overwritten)
    assert pool.lookup(hashes) == [0, 1] and pool.is_cached(pool.block_table("a")[4])
    assert pool.trim("b", 9) == 2 and [pool.ref_count(x) for x in (0, 1)] == [0, 0]
    pool.free("a")
    pool.free("b")
    assert pool.num_free_blocks == 8 and pool.utilization == 0.0
    plain = KVBlockPool(8, 4)
    assert plain.allocate("a", 12) and plain.trim("a", 11) == 0 and plain.held_blocks("a") == 3  # no window: kept


def test_no_block_is_written_while_shared_under_random_traffic() -> None:
    """Requests from a few shared prefixes come, grow and go at random; a request writes only from its first
    uncached token on. No block written is ever held by another request or registered in the cache."""
    rng = random.Random(0)
    bs, pool = 4, KVBlockPool(48, 4, enable_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    live: dict[str, tuple[list[int], int, list[bytes]]] = {}  # id -> tokens, computed, hashes
    for i in range(3000):
        if live and rng.random() < 0.25:
            rid = rng.choice(sorted(live))
            tokens, computed, hashes = live.pop(rid)
            pool.cache_blocks(rid, hashes, computed // bs)
            pool.free(rid)
            continue
        if live and rng.random() < 0.6:
            rid = rng.choice(sorted(live))
            tokens, computed, hashes = live[rid]
            tokens.append(rng.randrange(50))
            start = computed
        else:
            rid = f"r{i}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
            hashes = block_hashes(tokens, bs, [])
            cached = pool.lookup(hashes[: (len(tokens) - 1) // bs])
            start = len(cached) * bs
            if not pool.allocate(rid, len(tokens), reserve_tokens=len(tokens) + 8, cached=cached):
                continue
            live[rid] = (tokens, start, hashes)
        if not pool.allocate(rid, len(tokens)):
            tokens, computed, hashes = live.pop(rid)
            pool.cache_blocks(rid, hashes, computed // bs)
            pool.free(rid)
            continue
        table = pool.block_table(rid)
        for pos in range(start, len(tokens)):  # what this step writes
            block = table[pos // bs]
            assert pool.ref_count(block) == 1 and not pool.is_cached(block), (i, rid, pos)
        live[rid] = (tokens, len(tokens), block_hashes(tokens, bs, hashes))
        pool.cache_blocks(rid, live[rid][2], len(tokens) // bs)
        held = {b for r in live for b in pool.block_table(r)}
        assert pool.num_free_blocks == 48 - len(held)
    for rid in list(live):
        pool.free(rid)
    assert pool.num_free_blocks == 48 and pool.allocate("all", 48 * bs)


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------

G = torch.Generator().manual_seed(7)
SYSTEM = torch.randint(0, 256, (70,), generator=G).tolist()  # a shared "system prompt": 4 full blocks of 16 and more
SHARED = [SYSTEM + torch.randint(0, 256, (n,), generator=G).tolist() for n in (3, 9, 20, 1)]
OTHER = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (30, 12)]
MIX = SHARED + OTHER + [SHARED[1], SYSTEM[:64], SYSTEM[:65]]  # the same prompt twice; a prompt that is all blocks


def _generate_in_waves(engine, prompts, params=GREEDY) -> list[list[int]]:
    """The first prompt alone (it fills the cache), then the rest together."""
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)
    return [r.token_ids for r in first + rest]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # chunked prefill
        {"kv_cache_tokens": 256, "block_size": 8, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(family: Family, fields: dict) -> None:
    off = family.engine(enable_prefix_caching=False, **fields)
    expected = _generate_in_waves(off, MIX)
    assert off.stats().prefix_cache_hits_total == 0
    assert expected[:1] == [family.hf_greedy(MIX[0], 20)]  # and the cache-off engine agrees with transformers

    on = family.engine(**fields)
    assert _generate_in_waves(on, MIX) == expected
    stats = on.stats()
    assert stats.prefix_cache_hits_total > 0, stats
    assert stats.prefill_tokens_computed_total < off.stats().prefill_tokens_computed_total
    if "kv_cache_tokens" in fields:
        assert stats.num_preemptions_total > 0
    assert_pool_empty(on)
    # Again, with everything cached that fits: still the same.
    assert _generate_in_waves(on, MIX) == expected


def test_the_second_request_reuses_the_prefix_and_skips_its_prefill(gpt2: Family) -> None:
    engine = gpt2.engine()
    prompt = SHARED[2]  # 90 tokens: 5 full blocks of 16
    engine.add_request("first", prompt, GREEDY)
    first = run(engine)["first"]
    computed = engine.stats().prefill_tokens_computed_total
    assert computed == len(prompt) and first[-1].num_cached_tokens == 0

    engine.add_request("again", prompt, GREEDY)
    again = run(engine)["again"]
    assert tokens_of(again) == tokens_of(first)
    assert again[-1].num_cached_tokens == 80  # the five full blocks
    assert engine.stats().prefill_tokens_computed_total - computed == len(prompt) - 80
    stats = engine.stats()
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (2 * len(prompt), 80)

    # A prompt of whole blocks only: the last block is computed again (its last token samples), not shared.
    engine.add_request("blocks", SYSTEM[:64], GREEDY)
    assert run(engine)["blocks"][-1].num_cached_tokens == 48


def test_aborted_requests_leave_the_cache_consistent(gpt2: Family) -> None:
    engine = gpt2.engine(max_num_batched_tokens=32, block_size=8)
    for i, prompt in enumerate(SHARED):
        engine.add_request(f"a{i}", prompt, GREEDY)
    run(engine, steps=2)  # mid-prefill for some
    for i in range(0, len(SHARED), 2):
        engine.abort(f"a{i}")
    run(engine)
    assert_pool_empty(engine)
    off = gpt2.engine(enable_prefix_caching=False, max_num_batched_tokens=32, block_size=8)
    assert [r.token_ids for r in engine.generate(MIX, GREEDY)] == [r.token_ids for r in off.generate(MIX, GREEDY)]


def test_a_narrower_kv_cache_gives_the_same_outputs_with_the_cache_on_and_off(gpt2: Family) -> None:
    off = gpt2.engine(enable_prefix_caching=False, kv_cache_dtype="bf16")
    on = gpt2.engine(kv_cache_dtype="bf16")
    assert _generate_in_waves(on, MIX) == _generate_in_waves(off, MIX)
    assert on.stats().prefix_cache_hits_total > 0


def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(gpt2: Family) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    off = _generate_in_waves(gpt2.engine(enable_prefix_caching=False), SHARED, params)
    assert _generate_in_waves(gpt2.engine(), SHARED, params) == off


# ---------------------------------------------------------------------------------------------------------
# Prompt log-probabilities with the cache (vLLM v1 turns one or the other off)
# ---------------------------------------------------------------------------------------------------------


def _assert_close(got, want, tol: float = 1e-5) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=tol)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=tol)


def _scored(engine, rid: str, prompt: list[int], k: int = 2):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=k))
    outs = run(engine)[rid]
    return outs[0].prompt_logprobs, outs[-1].num_cached_tokens


@pytest.mark.parametrize("fields", [{}, {"max_num_batched_tokens": 16, "block_size": 4}], ids=["plain", "chunked"])
def test_prompt_logprobs_come_from_the_cache_equal_to_computing_them(family: Family, fields: dict) -> None:
    engine = family.engine(**fields)
    off = family.engine(enable_prefix_caching=False, **fields)
    prompt = SHARED[2]
    expected, _ = _scored(off, "x", prompt)
    assert expected[0] is None and all(e is not None for e in expected[1:])

    # A request that wants none fills the cache, but keeps no log-probabilities with it: the first scored request
    # computes its prompt, and keeps them; the next finds them, and its prefix, cached.
    engine.generate([prompt], GREEDY)
    first, cached_first = _scored(engine, "first", prompt)
    again, cached_again = _scored(engine, "again", prompt)
    bs = fields.get("block_size", 16)
    n = (len(prompt) - 1) // bs * bs  # the full blocks short of the last token
    assert cached_first == 0 and cached_again == n
    assert again[: n + 1] == first[: n + 1]  # the cached blocks' entries and the one after them: kept, so identical
    _assert_close(again, first)  # the rest computed again, in another chunk: equal to fp32 rounding
    assert [e.token_id for e in first[1:]] == prompt[1:]
    _assert_close(first, expected)

    # Fewer alternatives than were kept: served from the cache, cut to the request's count.
    fewer, cached_fewer = _scored(engine, "fewer", prompt, k=1)
    assert cached_fewer == cached_again and [len(e.top) for e in fewer[1:]] == [1] * (len(prompt) - 1)
    assert [e.logprob for e in fewer[1 : n + 1]] == [e.logprob for e in first[1 : n + 1]]
    # More than were kept: computed again.
    more, cached_more = _scored(engine, "more", prompt, k=4)
    assert cached_more == 0 and [len(e.top) for e in more[1:]] == [4] * (len(prompt) - 1)
    assert [e.logprob for e in more[1:]] == pytest.approx([e.logprob for e in first[1:]], abs=1e-5)
    assert _scored(engine, "more again", prompt, k=4)[1] == n  # and now they are kept with four
    # A prompt that continues the cached one past a block boundary: the token after the shared blocks differs, so
    # only as many blocks are taken as have that token's entry kept; the rest is computed, and still right.
    other = prompt[:48] + [(t + 1) % 256 for t in prompt[48:]]
    got, cached_other = _scored(engine, "other", other)
    want, _ = _scored(off, "other", other)
    assert cached_other == 48 - bs  # the blocks up to 48 are cached, but token 48's entry is not kept with them
    _assert_close(got, want)
