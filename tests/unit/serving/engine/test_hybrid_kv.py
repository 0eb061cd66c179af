"""The KV cache in groups of layers for a model whose windowed layers mix with full ones (kv_cache.HybridKVBlockPool,
families.kv_groups; vLLM's hybrid KV cache manager): the groups a model's layers make, and the pool's bookkeeping, a
table a group from one pool of blocks: all or nothing across the groups, the windowed groups letting go of the blocks
before their window, a cached prefix found though a windowed group's blocks before its window are gone. The engine's
outputs through it are transformers' own: test_model_families.py's window tests (every mixed family)."""

from __future__ import annotations

from pylon.serving.engine.kv_cache import DIGEST_BYTES, HybridKVBlockPool, block_hashes
from pylon.serving.model.families import Chunk, first_key, kv_groups

NULL = 100  # the null block's id in these pools (the runner's scratch block: one past the pool's)


def _pool(num_blocks: int, windows=(None, 8), **kw) -> HybridKVBlockPool:
    pool = HybridKVBlockPool(num_blocks, 4, list(windows), **kw)
    pool.set_window(NULL)
    return pool


def test_the_groups_are_of_one_kind_each_full_ones_first_and_only_where_they_save_memory() -> None:
    gemma3 = [None if i % 6 == 5 else 1024 for i in range(62)]  # 10 full layers, 52 windowed
    groups = kv_groups(gemma3, 32768, 16, 8192, 32768)
    assert [len(layers) for layers, _ in groups] == [10] + [10] * 5 + [2]
    assert [w for _, w in groups] == [None] + [1024] * 6
    assert groups[0][0] == list(range(5, 62, 6)) and sorted(i for g, _ in groups for i in g) == list(range(62))
    gpt_oss = [128 if i % 2 == 0 else None for i in range(24)]
    assert [(len(g), w) for g, w in kv_groups(gpt_oss, 131072, 16, 8192, 131072)] == [(12, None), (12, 128)]
    assert kv_groups([None] * 4, 4096, 16, 512, 4096) == []  # no window
    assert kv_groups([64] * 4, 4096, 16, 512, 4096) == []  # every layer windowed: one table, trimmed (trim)
    # a window as long as the context: nothing to save (the short groups' slack would cost)
    assert kv_groups(gemma3, 1024, 16, 512, 1024) == []
    # a step of a whole max_model_len prompt at once would not fit the groups' blocks in a pool of that many tokens
    assert kv_groups(gemma3, 8192, 16, 8192, 8192) == [] and kv_groups(gemma3, 8192, 16, 2048, 8192)
    assert first_key(8, 20) == 13 and first_key(Chunk(8), 20) == 16 and first_key(8, 3) == 0


def test_the_groups_tables_grow_together_all_or_nothing_and_the_windowed_ones_let_go_before_the_window() -> None:
    pool = _pool(10)
    assert not pool.allocate("a", 24)  # 6 blocks a group, 12 in all: not in 10, and nothing taken
    assert pool.num_free_blocks == 10 and pool.group_tables("a") == ([], [])
    assert pool.allocate("a", 16)  # 4 blocks each
    full, windowed = pool.group_tables("a")
    assert len(full) == len(windowed) == 4 and not set(full) & set(windowed) and pool.block_table("a") == full
    assert pool.held_blocks("a") == 8 and pool.num_free_blocks == 2
    assert pool.trim("a", first_key(8, 16)) == 2  # queries from 16 on see keys from 9: blocks 0 and 1 go
    full, windowed = pool.group_tables("a")
    assert windowed[:2] == [NULL, NULL] and NULL not in full and pool.held_blocks("a") == 6
    assert pool.allocate("a", 24)  # 2 more a group: the 2 let go of and the 2 free
    assert pool.num_free_blocks == 0
    pool.free("a")
    assert pool.num_free_blocks == 10 and pool.held_blocks("a") == 0


def test_a_prefix_is_found_though_a_windowed_groups_blocks_before_its_window_were_taken_for_others() -> None:
    pool = _pool(16, enable_caching=True)
    pool.track_changes()
    tokens = list(range(32))  # 8 blocks
    hashes = block_hashes(tokens, 4, [])
    assert pool.allocate("a", 32)
    pool.cache_blocks("a", hashes, 8)
    pool.trim("a", first_key(8, 32))  # the windowed group keeps blocks 6 and 7 (keys 25..31)
    assert pool.held_blocks("a") == 8 + 2
    assert pool.allocate("b", 12)  # 3 + 3 of the 6 free, each cached (a's windowed blocks 0-5): forgotten
    assert pool.num_free_blocks == 0
    pool.free("a")
    pool.free("b")
    # a prompt of a's 32 tokens and more: its first 7 blocks in the full group; the windowed group's from that of
    # key 28 - 8 + 1 = 21 (block 5) on, which b took: so 7 blocks would need block 5, 6 would need 4..5 (gone too)...
    longer = block_hashes(tokens + [99] * 8, 4, [])
    found = pool.reachable(longer[:9])
    assert found == 8  # ...but at 8 blocks its next queries (from 32) read keys from 25: blocks 6 and 7, kept
    restored = pool.restore(longer[:found])
    assert len(restored) == 8 and all(len(t) == 2 for t in restored)
    assert [t[1] for t in restored[:6]] == [NULL] * 6 and NULL not in [t[0] for t in restored]
    assert pool.allocate("c", 40, cached=restored)
    full, windowed = pool.group_tables("c")
    assert full[:8] == [t[0] for t in restored] and windowed[:8] == [t[1] for t in restored]
    assert pool.held_blocks("c") == 10 + 4  # 8 shared + 2 own in the full group; 2 shared + 2 own in the windowed
    pool.cache_blocks("c", longer, 10)  # (the skipped places registered as nothing)
    # routing hears the request's own hashes only, never a group's names
    assert all(len(h) == DIGEST_BYTES for _, h in pool.drain_changes()) and set(pool.cached_hashes()) <= set(longer)
    pool.free("c")
    assert pool.num_free_blocks == 16


def test_a_windowed_groups_block_goes_to_the_host_tier_and_comes_back_with_its_prefix() -> None:
    pool = _pool(12, enable_caching=True, offload_blocks=16)
    tokens = list(range(16))  # 4 blocks
    hashes = block_hashes(tokens, 4, [])
    assert pool.allocate("a", 16)
    pool.cache_blocks("a", hashes, 4)
    pool.free("a")
    assert pool.allocate("b", 24)  # every block: a's contents copied out first, both groups'
    assert [c[0] for c in pool.drain_copies()] == ["save"] and pool.num_offloaded_blocks == 8
    pool.free("b")
    found = pool.reachable(hashes)
    assert found == 4
    restored = pool.restore(hashes[:found])
    # the windowed group needs the blocks of keys from 16 - 8 + 1 = 9 on: blocks 2 and 3
    assert [t[1] for t in restored[:2]] == [NULL, NULL] and NULL not in [t[1] for t in restored[2:]]
    copies = pool.drain_copies()
    assert [c[0] for c in copies] == ["load"] and len(copies[0][1]) == 4 + 2  # the full group's 4, the windowed 2
    assert pool.allocate("c", 20, cached=restored) and pool.held_blocks("c") == 5 + 3
    pool.free("c")
    assert pool.num_free_blocks == 12
