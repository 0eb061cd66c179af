"""The prefix cache's host tier (engine.kv_offload_tokens): the pool's bookkeeping (what is copied out, back, and
in which order), and the engine's outputs, which must be exactly those of an engine whose device cache kept every
block, while computing only what neither tier holds."""

from __future__ import annotations

import pytest
import torch
from engine_models import GREEDY, Family, assert_pool_empty, run, tokens_of

from pylon.serving.engine.kv_cache import KVBlockPool, block_hashes
from pylon.serving.engine.sampling import SamplingParams
from pylon.specs import EngineSpec

# ---------------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------------


def _filled(pool: KVBlockPool, rid: str, tokens: list[int]) -> list[bytes]:
    """`rid`'s blocks for `tokens`, registered (as computed), then let go of: cached and free."""
    hashes = block_hashes(tokens, pool.block_size, [])
    assert pool.allocate(rid, len(tokens), cached=pool.restore(hashes[: pool.reachable(hashes)]))
    pool.cache_blocks(rid, hashes, len(hashes))
    pool.free(rid)
    return hashes


def test_a_cached_block_taken_for_other_contents_is_copied_out_first_and_copied_back_for_its_prefix() -> None:
    pool = KVBlockPool(4, 4, enable_caching=True, offload_blocks=8)
    pool.track_changes()
    a = _filled(pool, "a", list(range(16)))
    assert pool.drain_copies() == [] and pool.num_offloaded_blocks == 0  # nothing let go of yet
    assert pool.allocate("b", 16)  # every block, each holding a's contents: copied out before b writes it
    assert pool.drain_copies() == [("save", [0, 1, 2, 3], [0, 1, 2, 3])]
    assert pool.lookup(a) == [] and pool.reachable(a) == 4 and pool.num_offloaded_blocks == 4
    assert set(pool.cached_hashes()) == set(a)  # still a copy away: the router still counts them
    assert pool.drain_changes() == [(True, h) for h in a]  # registered, and never said forgotten
    pool.free("b")

    blocks = pool.restore(a[:3])
    assert pool.drain_copies() == [("load", [0, 1, 2], blocks)] and pool.offload_loaded == 3
    assert pool.lookup(a) == blocks  # registered on the device again, free until a request holds them
    assert pool.allocate("c", 13, cached=blocks) and pool.block_table("c")[:3] == blocks
    pool.free("c")
    # Taken again: the host tier still holds their contents, so they are not copied out twice.
    assert pool.allocate("d", 16) and pool.drain_copies() == []
    assert pool.offload_saved == 4 and pool.reachable(a) == 4
    pool.free("d")


def test_the_host_tier_lets_go_of_the_least_recently_used_and_never_of_a_slot_a_restore_reads() -> None:
    pool = KVBlockPool(2, 4, enable_caching=True, offload_blocks=2)
    pool.track_changes()
    a = _filled(pool, "a", list(range(8)))  # blocks 0, 1
    b = _filled(pool, "b", list(range(100, 108)))  # a's copied out to slots 0, 1; b in blocks 0, 1
    assert pool.drain_copies() == [("save", [0, 1], [0, 1])]
    c = _filled(pool, "c", list(range(200, 208)))  # b's copied out: a's slots were the least recently used
    assert pool.drain_copies() == [("save", [0, 1], [0, 1])]
    assert pool.reachable(a) == 0 and pool.reachable(b) == 2 and pool.lookup(c) == [0, 1]
    changes = pool.drain_changes()
    assert (False, a[0]) in changes and (False, a[1]) in changes and not any(not r and h in b for r, h in changes)

    # b back from the host tier: its blocks are c's (free, cached), whose contents must go to the host tier too,
    # but both slots hold what is being read: c's are let go of, not copied over b's.
    blocks = pool.restore(b)
    assert pool.drain_copies() == [("load", [0, 1], blocks)] and sorted(blocks) == [0, 1]  # (no save among them)
    assert pool.reachable(c) == 0 and pool.reachable(b) == 2
    assert (False, c[0]) in pool.drain_changes()


def test_a_restore_takes_no_block_of_the_prefix_it_restores() -> None:
    """No free block without cached contents: a block for a host-held hash is the least recently used free one that
    is not the prefix's own (y's, older, is kept; w's goes, copied to the host tier first)."""
    pool = KVBlockPool(2, 4, enable_caching=True, offload_blocks=4)
    x = _filled(pool, "x", list(range(4)))  # block 0
    y = _filled(pool, "y", list(range(50, 54)))  # block 1
    assert pool.allocate("z", 4) and pool.block_table("z") == [0]  # x's, least recently used: to slot 0
    pool.free("z")
    w = _filled(pool, "w", list(range(70, 74)))  # block 0 again, used after y's
    assert pool.drain_copies() == [("save", [0], [0])] and pool.lookup(y + w) == [1, 0]
    blocks = pool.restore([y[0], x[0]])  # y's block on the device, then x's in the host tier only
    assert blocks == [1, 0]
    assert pool.drain_copies() == [("save", [0], [1]), ("load", [0], [0])]  # w's out to slot 1, then x's in
    assert pool.reachable(w) == 1 and pool.lookup([y[0], x[0]]) == [1, 0]


def test_forgetting_the_cache_forgets_the_host_tier_too() -> None:
    pool = KVBlockPool(2, 4, enable_caching=True, offload_blocks=4)
    a = _filled(pool, "a", list(range(8)))
    _filled(pool, "b", list(range(100, 108)))
    assert pool.reachable(a) == 2
    assert pool.forget_cached() == 4  # b's two on the device, a's two in the host tier
    assert pool.reachable(a) == 0 and pool.num_offloaded_blocks == 0 and pool.cached_hashes() == []


def test_the_spec_names_what_a_host_tier_needs() -> None:
    with pytest.raises(ValueError, match="kv_offload_tokens: must be a multiple of block_size"):
        EngineSpec(kv_offload_tokens=100)
    with pytest.raises(ValueError, match="kv_offload_tokens: is the prefix cache's second tier"):
        EngineSpec(kv_offload_tokens=64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_path: holds the prefix cache's host tier: set kv_offload_tokens"):
        EngineSpec(kv_offload_path="/mnt/nvme")
    with pytest.raises(ValueError, match="kv_offload_path: must be a directory on the replica's own disk"):
        EngineSpec(kv_offload_tokens=64, kv_offload_path="s3://bucket/kv")


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------

G = torch.Generator().manual_seed(7)
# Four documents of five full blocks and a little more, each asked about twice; the device's cache holds fewer
# blocks than two of them and their answers, so by the time a document comes back, its blocks are gone from it.
DOCS = [torch.randint(0, 256, (84,), generator=G).tolist() for _ in range(4)]
QUESTIONS = [[doc + torch.randint(0, 256, (4,), generator=G).tolist() for doc in DOCS] for _ in range(2)]
SMALL = {"kv_cache_tokens": 128, "max_model_len": 128, "max_num_seqs": 2}
LOGPROBS = SamplingParams(max_tokens=8, temperature=0, logprobs=2)


def _ask_in_turn(engine) -> tuple[list, list[int]]:
    """Each question, one at a time: its output tokens and log-probabilities, and the tokens it found cached."""
    outs, cached = [], []
    for i, prompt in enumerate(q for round_ in QUESTIONS for q in round_):
        engine.add_request(str(i), prompt, LOGPROBS)
        got = run(engine)[str(i)]
        outs.append((tokens_of(got), [(e.logprob, e.top) for o in got for e in o.logprobs]))
        cached.append(got[-1].num_cached_tokens)
    return outs, cached


@pytest.mark.parametrize(
    "name, fields",
    [
        ("gpt2", {}),
        ("llama", {"kv_cache_dtype": "fp8"}),
        ("llama", {"block_size": 8, "max_num_batched_tokens": 24}),
        ("qwen3_next", {}),  # recurrent layers: their states' snapshots beside the blocks (kv_cache.StateSnapshots)
        ("deepseek_v3", {}),  # latent attention: one cache a layer, keys and values both
    ],
    ids=["gpt2", "llama-fp8-cache", "llama-chunked", "qwen3-next", "deepseek-v3"],
)
def test_a_prefix_the_device_let_go_of_comes_back_from_host_memory_with_the_same_outputs(
    name: str, fields: dict, tmp_path
) -> None:
    family = Family(name, tmp_path / name, greedy=False)
    # Every block stays on the device; else as the small engines (the same max_num_seqs: the same padded row counts,
    # whose matmuls round alike)
    big, big_cached = _ask_in_turn(family.engine(**{**SMALL, "kv_cache_tokens": 2048}, **fields))
    assert big_cached == [0] * 4 + [80] * 4  # each document's full blocks, the second time it is asked about
    small = family.engine(**SMALL, **fields)
    _, small_cached = _ask_in_turn(small)
    assert small_cached[4:] == [0] * 4  # the device's cache alone has let go of each document by its second question

    tiered = family.engine(**SMALL, **fields, kv_offload_tokens=1024)
    assert tiered.pool.offload_blocks == 1024 // tiered.pool.block_size
    got, cached = _ask_in_turn(tiered)
    assert cached == big_cached  # every document's blocks found again, as where the device kept them
    assert got == big  # tokens and log-probabilities exactly: the blocks came back bit for bit
    stats = tiered.stats()
    bs = tiered.pool.block_size
    assert stats.kv_offload_loaded_blocks_total == sum(cached) // bs
    assert stats.kv_offload_saved_blocks_total >= stats.kv_offload_loaded_blocks_total
    assert stats.prefill_tokens_computed_total == small.stats().prefill_tokens_computed_total - sum(cached)
    assert stats.num_offloaded_blocks > 0
    assert_pool_empty(tiered)


def test_prompt_log_probabilities_and_preemption_with_the_host_tier(gpt2: Family) -> None:
    """What the cache keeps with a block (its prompt log-probabilities) goes with it to the host tier and back; a
    batch that preempts (its requests' blocks taken from under others' cached ones) gives the plain engine's tokens."""
    off = gpt2.engine(enable_prefix_caching=False)
    tiered = gpt2.engine(**SMALL, kv_offload_tokens=1024)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    prompt = QUESTIONS[0][0]
    off.add_request("x", prompt, scored)
    want = run(off)["x"][0].prompt_logprobs
    tiered.add_request("first", prompt, scored)
    run(tiered)
    tiered.generate(QUESTIONS[0][1:], GREEDY)  # the first document's blocks go to the host tier
    assert tiered.pool.lookup(block_hashes(prompt, 16, [])[:5]) == []
    tiered.add_request("again", prompt, scored)
    outs = run(tiered)["again"]
    assert outs[-1].num_cached_tokens == 80
    got = outs[0].prompt_logprobs
    assert [e and (e.token_id, e.top) for e in got] == [e and (e.token_id, e.top) for e in want]
    assert [e and e.logprob for e in got] == pytest.approx([e and e.logprob for e in want], abs=1e-5)

    everything = [q for round_ in QUESTIONS for q in round_]
    longer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    busy = gpt2.engine(kv_cache_tokens=192, block_size=8, max_model_len=128, kv_offload_tokens=512)
    got = [c.token_ids for c in busy.generate(everything + everything[:3], longer)]  # more than its blocks hold
    assert busy.stats().num_preemptions_total > 0 and busy.stats().kv_offload_loaded_blocks_total > 0, busy.stats()
    assert got == [c.token_ids for c in off.generate(everything + everything[:3], longer)]
    assert_pool_empty(busy)


def test_the_tier_on_disk_gives_the_same_outputs_and_leaves_no_file_behind(gpt2: Family, tmp_path) -> None:
    """engine.kv_offload_path: the tier's blocks in files under the directory, mapped and deleted at once (the
    process's maps still name them), their space reserved; the same outputs as in RAM. A directory that is not one,
    or that cannot hold the tier, fails the start naming the field."""
    import os

    from pylon.errors import PylonError

    ram, ram_cached = _ask_in_turn(gpt2.engine(**SMALL, kv_offload_tokens=1024))
    disk = gpt2.engine(**SMALL, kv_offload_tokens=1024, kv_offload_path=str(tmp_path))
    assert os.listdir(tmp_path) == []  # deleted once mapped
    maps = [line for line in open("/proc/self/maps") if f"{tmp_path}/pylon-kv-" in line]
    assert len(maps) >= 2 * 2 and all(line.rstrip().endswith("(deleted)") for line in maps)  # K and V, 2 layers
    got, cached = _ask_in_turn(disk)
    assert (got, cached) == (ram, ram_cached) and disk.stats().kv_offload_loaded_blocks_total > 0
    with pytest.raises(PylonError, match=r"engine.kv_offload_path .*/nowhere: not a directory on this node"):
        gpt2.engine(**SMALL, kv_offload_tokens=1024, kv_offload_path=str(tmp_path / "nowhere"))
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    os.system(f"mount -t tmpfs -o size=64k tmpfs {tiny} 2>/dev/null")
    if os.path.ismount(tiny):  # (as root: a 64 KiB filesystem, too small for 1,024 tokens' blocks: 0.5 MiB a tensor)
        try:
            with pytest.raises(
                PylonError, match=r"engine.kv_offload_path .*/tiny: cannot reserve 0.5 MiB there \(No space left"
            ):
                gpt2.engine(**SMALL, kv_offload_tokens=1024, kv_offload_path=str(tiny))
            assert os.listdir(tiny) == []
        finally:
            os.system(f"umount {tiny}")
