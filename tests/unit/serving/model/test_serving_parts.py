"""pylon.serving's parts on their own, no model: the KV block pool, the scheduler's step building and
preemption, paged attention against dense attention, and the sampler's filters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pylon.serving.engine.kv_cache import KVBlockPool
from pylon.serving.engine.request import Request
from pylon.serving.engine.sampling import SamplingParams, sample
from pylon.serving.engine.scheduler import Scheduler
from pylon.serving.model.attention import HostStage, SequenceSlice, build_metadata, new_kv_cache, paged_attention
from pylon.serving.model.families import Chunk


def request(request_id: str, prompt_len: int) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(temperature=0), 100, None, None)


def step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """One scheduled step, as (id, start, new tokens); every sampling request gets a token, as the engine does."""
    batch = scheduler.schedule()
    for s in batch.scheduled:
        if s.samples:
            s.request.token_ids.append(7)
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in batch.scheduled]


# ---------------------------------------------------------------------------------------------------------
# KVBlockPool
# ---------------------------------------------------------------------------------------------------------


def test_pool_allocates_all_or_nothing_and_frees_everything() -> None:
    pool = KVBlockPool.for_tokens(64, 16)
    assert (pool.num_blocks, pool.num_free_blocks, pool.utilization) == (4, 4, 0.0)
    assert pool.allocate("a", 17) and len(pool.block_table("a")) == 2
    assert pool.allocate("a", 32) and len(pool.block_table("a")) == 2  # still fits: nothing new
    assert not pool.allocate("b", 33)  # needs 3, 2 free: takes none
    assert pool.num_free_blocks == 2 and pool.block_table("b") == []
    assert pool.allocate("b", 20) and pool.utilization == 1.0
    assert not set(pool.block_table("a")) & set(pool.block_table("b"))
    pool.free("a")
    pool.free("a")  # twice is harmless
    assert pool.num_free_blocks == 2 and pool.utilization == 0.5
    pool.free("b")
    assert pool.num_free_blocks == 4


def test_pool_keeps_a_growing_request_in_one_run_with_room_set_aside() -> None:
    pool = KVBlockPool(16, 4)
    assert pool.allocate("a", 8, reserve_tokens=24)  # needs 2 blocks now, 6 in all: 0-1 taken, 2-5 set aside
    assert pool.block_table("a") == [0, 1] and pool.num_free_blocks == 14  # set aside is still free
    assert pool.allocate("b", 4, reserve_tokens=8) and pool.block_table("b") == [6]  # placed past a's room
    assert pool.allocate("c", 4) and pool.block_table("c") == [8]  # no reservation: the lowest open block
    for n in (12, 16, 20, 24):  # a grows into its own run
        assert pool.allocate("a", n)
    assert pool.block_table("a") == [0, 1, 2, 3, 4, 5]
    assert pool.allocate("b", 8) and pool.block_table("b") == [6, 7]
    assert pool.allocate("a", 28) and pool.block_table("a")[-1] == 9  # 6-8 are others': the lowest open one
    pool.free("a")
    assert pool.num_free_blocks == 13


def test_pool_set_aside_blocks_are_free_blocks_when_nothing_else_is() -> None:
    pool = KVBlockPool(8, 4)
    assert pool.allocate("a", 4, reserve_tokens=32)  # takes 0, sets 1-7 aside
    assert pool.num_free_blocks == 7
    assert pool.allocate("b", 20)  # five blocks: only set-aside ones are left, so it takes them
    assert len(pool.block_table("b")) == 5 and pool.num_free_blocks == 2
    assert not pool.allocate("c", 12)  # all or nothing, as ever
    assert pool.allocate("a", 12) and len(pool.block_table("a")) == 3 and pool.num_free_blocks == 0
    pool.free("b")
    pool.free("a")
    assert pool.num_free_blocks == 8 and pool.allocate("d", 32, reserve_tokens=32)
    assert pool.block_table("d") == list(range(8))


def test_pool_invariants_under_random_traffic() -> None:
    import random

    rng = random.Random(0)
    pool = KVBlockPool(64, 4)
    lengths: dict[str, int] = {}
    for i in range(3000):
        if lengths and rng.random() < 0.3:
            rid = rng.choice(sorted(lengths))
            pool.free(rid)
            del lengths[rid]
        elif lengths and rng.random() < 0.6:
            rid = rng.choice(sorted(lengths))
            before = list(pool.block_table(rid))
            if pool.allocate(rid, lengths[rid] + rng.randint(1, 9)):
                lengths[rid] = len(pool.block_table(rid)) * 4
            assert pool.block_table(rid)[: len(before)] == before  # a table only grows at its end
        else:
            rid, n = f"r{i}", rng.randint(1, 40)
            free = pool.num_free_blocks
            ok = pool.allocate(rid, n, reserve_tokens=n + rng.randint(0, 60))
            assert ok == (pool.blocks_for(n) <= free)
            if ok:
                lengths[rid] = n
        held = [b for rid in lengths for b in pool.block_table(rid)]
        assert len(held) == len(set(held)) and all(0 <= b < 64 for b in held)
        assert pool.num_free_blocks == 64 - len(held)
    for rid in list(lengths):
        pool.free(rid)
    assert pool.num_free_blocks == 64 and pool.allocate("all", 256, reserve_tokens=256)


def test_pool_hands_out_the_lowest_free_blocks_so_live_blocks_stay_packed() -> None:
    pool = KVBlockPool(8, 4)
    for rid in "abcd":
        assert pool.allocate(rid, 8)  # two blocks each: a 0,1  b 2,3  c 4,5  d 6,7
    pool.free("a")
    pool.free("c")
    assert pool.allocate("e", 12) and pool.block_table("e") == [0, 1, 4]  # the lowest first, not the oldest freed
    pool.free("b")
    assert pool.allocate("f", 4) and pool.block_table("f") == [2]
    assert sorted(b for rid in "def" for b in pool.block_table(rid)) == [0, 1, 2, 4, 6, 7]


# ---------------------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------------------


def test_decodes_first_then_prefill_chunks_under_the_budget_and_the_sequence_cap() -> None:
    scheduler = Scheduler(KVBlockPool(100, 4), max_num_seqs=2, max_num_batched_tokens=16)
    a, b, c = request("a", 10), request("b", 10), request("c", 10)
    for r in (a, b, c):
        scheduler.add(r)
    assert step(scheduler) == [("a", 0, 10), ("b", 0, 6)]  # b's prompt is chunked; only a samples
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert step(scheduler) == [("a", 10, 1), ("b", 6, 4)]  # a decode and the rest of b's prompt, together
    assert list(scheduler.waiting) == [c]  # two sequences at most
    scheduler.finish(a, "length")
    assert a.finish_reason == "length" and scheduler.pool.block_table("a") == []
    assert step(scheduler) == [("b", 10, 1), ("c", 0, 10)]


def test_preemption_takes_the_newest_and_recomputes_it_later() -> None:
    pool = KVBlockPool(4, 4)  # 16 tokens
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = request("a", 6), request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):  # 6 -> 9 tokens each; 8 fit in their 2 blocks
        assert [rid for rid, _, _ in step(scheduler)] == ["a", "b"]
    assert pool.num_free_blocks == 0
    assert step(scheduler) == [("a", 8, 1)]  # a needs a third block: b (the newest) gives its two back
    assert list(scheduler.waiting) == [b] and scheduler.running == [a]
    assert (b.num_computed_tokens, b.num_preemptions, scheduler.num_preemptions) == (0, 1, 1)
    assert pool.block_table("b") == [] and pool.num_free_blocks == 1
    assert step(scheduler) == [("a", 9, 1)]  # b needs 3 blocks again; 1 free: it waits
    scheduler.finish(a, "stop")
    assert step(scheduler) == [("b", 0, 9)]  # prompt and its 3 generated tokens, recomputed in one go
    assert b.num_output_tokens == 4


def test_a_request_that_is_itself_the_newest_preempts_itself() -> None:
    pool = KVBlockPool(4, 4)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = request("a", 11), request("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # a: 3 blocks, b: 1 block
    assert step(scheduler) == [("a", 11, 1)]  # b's fifth token needs a block nobody older can spare
    assert list(scheduler.waiting) == [b] and scheduler.num_preemptions == 1


def test_priority_orders_admission_and_preemption_and_zero_is_first_come_first_served() -> None:
    """vLLM's priority scheduling: waiting requests are admitted lowest value first (ties by arrival), and the
    running request preempted for blocks is the one of the highest value, which goes back before the waiting ones
    of a higher value."""

    def prioritised(request_id: str, prompt_len: int, priority: int) -> Request:
        return Request(
            request_id, list(range(prompt_len)), SamplingParams(temperature=0, priority=priority), 100, None, None
        )

    scheduler = Scheduler(KVBlockPool(100, 4), max_num_seqs=2, max_num_batched_tokens=64)
    late, urgent, normal, urgent_too = (
        prioritised("late", 4, 5),
        prioritised("urgent", 4, -1),
        prioritised("normal", 4, 0),
        prioritised("urgent_too", 4, -1),
    )
    for r in (late, urgent, normal, urgent_too):
        scheduler.add(r)
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "urgent_too", "normal", "late"]
    assert [rid for rid, _, _ in step(scheduler)] == ["urgent", "urgent_too"]  # two sequences at most
    scheduler.finish(urgent, "stop")
    assert [rid for rid, _, _ in step(scheduler)] == ["urgent_too", "normal"]

    pool = KVBlockPool(4, 4)  # 16 tokens: the preemption case of the test above, with priorities
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    low, high, waiting = prioritised("low", 6, 1), prioritised("high", 6, 0), prioritised("waiting", 2, 2)
    scheduler.add(low)
    scheduler.add(high)
    assert [r.request_id for r in scheduler.waiting] == ["high", "low"]  # arrived second, admitted first
    for _ in range(3):
        assert [rid for rid, _, _ in step(scheduler)] == ["high", "low"]
    scheduler.add(waiting)
    assert pool.num_free_blocks == 0
    # high needs a third block: low (the highest value running, though the older arrival) gives its two back and
    # waits before `waiting` (value 2)
    assert step(scheduler) == [("high", 8, 1)]
    assert [r.request_id for r in scheduler.waiting] == ["low", "waiting"] and scheduler.running == [high]

    fifo = Scheduler(KVBlockPool(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    plain = [request(str(i), 3) for i in range(5)]
    for r in plain:
        fifo.add(r)
    assert list(fifo.waiting) == plain  # every priority 0: arrival order


def test_finish_takes_a_waiting_request_out_too() -> None:
    scheduler = Scheduler(KVBlockPool(10, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = request("a", 3), request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    scheduler.finish(b, "abort")
    assert not scheduler.waiting and b.finish_reason == "abort" and set(scheduler.requests) == {"a"}


# ---------------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["pytorch", "kernel", "prefill"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
# head_dim 8: the kernel's generic loop; 32/64/128/256: its vectorised path on AVX-512 (2, 4, 8, 16 registers a
# row, 16-key chunks) or on AVX2 (16-256: 2-32 registers, 8-key chunks), with blocks shorter and longer than a chunk
# and ones that end in a partial chunk (24 = 16 + 8; 12 = 8 + 4).
@pytest.mark.parametrize("dim,block_size", [(8, 4), (16, 12), (64, 4), (64, 32), (32, 24), (128, 16), (256, 8)])
def test_paged_attention_equals_dense_causal_attention(kernel: str, kv_heads: int, dim: int, block_size: int) -> None:
    """ "kernel": decodes through the compiled kernel; "prefill": prompt chunks through the compiled prefill kernel too
    (AVX-512 or AVX2, head_dim 32-256: its 8-query tiles, 16- or 8-key groups across blocks of any size, a chunk's
    offset mask)."""
    prefill = kernel == "prefill"
    if prefill:
        from pylon.serving.model import kernels

        if dim not in kernels.PREFILL_HEAD_DIMS:
            pytest.skip(f"the prefill kernel is not built for head_dim {dim}: SDPA runs those")
        assert kernels.load() is not None, f"the CPU kernels did not build: {kernels._failed}"
        if not kernels.load().has_prefill():
            pytest.skip(
                "the prefill kernel needs AVX-512 or AVX2 (this CPU's build has neither): SDPA runs prompt chunks"
            )
    check_paged_attention(kernel != "pytorch", kv_heads, dim, block_size, torch.float32, prefill=prefill)


# A cache stored narrower than the model computes (kv_cache_dtype): what is read back is the stored keys and values
# widened exactly, so attention must equal dense attention over the rounded keys and values, to float32 precision.
@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("dim,block_size", [(8, 4), (64, 16), (32, 24), (128, 8)])
def test_paged_attention_over_a_narrower_cache_reads_back_what_it_stored(
    kernel: bool, kv_dtype: torch.dtype, dim: int, block_size: int
) -> None:
    check_paged_attention(kernel, 2, dim, block_size, kv_dtype)


def check_paged_attention(
    kernel: bool,
    kv_heads: int,
    dim: int,
    block_size: int,
    kv_dtype: torch.dtype,
    *,
    prefill: bool = False,
    stage: HostStage | None = None,
    window: int | None = None,
) -> None:
    if kernel:
        from pylon.serving.model import kernels

        # Fails rather than skips where the compiler is missing: `make setup` builds it on this machine.
        assert kernels.load() is not None, f"paged-attention kernel did not build: {kernels._failed}"
    torch.manual_seed(0)
    heads = 4
    # A fresh prompt, decodes (one over a long context: many blocks, a running softmax across them), chunks
    # continuing a prompt (a short one, and one of 37 tokens from position 21: 8-query tiles and a partial one, across
    # 16-key groups).
    cached, new = [0, 5, 9, 13, 2, 70, 21], [7, 1, 4, 1, 1, 1, 37]
    total = [c + n for c, n in zip(cached, new)]
    q = [torch.randn(t, heads, dim) for t in total]
    k = [torch.randn(t, kv_heads, dim) * 2 for t in total]  # spread-out scores: a softmax far from uniform
    v = [torch.randn(t, kv_heads, dim) for t in total]
    pool = sum(-(-t // block_size) for t in total) + 3
    k_cache = new_kv_cache(pool, block_size, kv_heads, dim, dtype=kv_dtype, device="cpu")
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.randperm(pool).tolist()  # scattered blocks, as a pool that has been in use hands them out
    tables, used = [], 0
    for t in total:
        n = -(-t // block_size)
        tables.append(blocks[used : used + n])
        used += n

    def run_step(starts, counts, stage=None):
        seqs = [SequenceSlice(s, n, table) for s, n, table in zip(starts, counts, tables) if n]
        live = [i for i, n in enumerate(counts) if n]
        cat = lambda xs: torch.cat([xs[i][starts[i] : starts[i] + counts[i]] for i in live])  # noqa: E731
        if stage is not None:
            stage.begin()
        meta = build_metadata(
            seqs, block_size, torch.device("cpu"), kernel=kernel, prefill=prefill, stage=stage, window=window
        )
        if stage is not None:
            stage.send()
        assert meta.prefill == (prefill and window is None) and meta.window == window
        return paged_attention(cat(q), cat(k), cat(v), k_cache, v_cache, meta, dim**-0.5), live

    run_step([0] * len(cached), [c if c else 0 for c in cached])  # what earlier steps cached
    out, live = run_step(cached, new, stage)
    offset = 0
    for i in live:
        # A chunk that starts its prompt attends over its fresh keys and values; everything else over the cache's.
        rounded = (lambda x: x) if cached[i] == 0 else (lambda x: x.to(kv_dtype).float())  # noqa: E731
        causal = torch.ones(total[i], total[i], dtype=torch.bool).tril()
        if isinstance(window, Chunk):  # Llama 4's chunks: the query at p sees keys (p // size) * size .. p
            p = torch.arange(total[i])
            causal &= p[None, :] >= (p[:, None] // window) * window
        elif window is not None:  # transformers' sliding window: the query at p sees keys p - window + 1 .. p
            causal &= torch.ones(total[i], total[i], dtype=torch.bool).triu(1 - window)
        dense = F.scaled_dot_product_attention(
            q[i][None].transpose(1, 2),
            rounded(k[i])[None].transpose(1, 2),
            rounded(v[i])[None].transpose(1, 2),
            is_causal=False,
            enable_gqa=True,
            attn_mask=causal,
        )
        expected = dense[0].transpose(0, 1)[cached[i] :]
        torch.testing.assert_close(out[offset : offset + new[i]], expected)
        offset += new[i]
    if kv_dtype != torch.float32:  # and the cache really holds the narrower values (not float32 ones)
        assert k_cache.dtype == kv_dtype and not torch.equal(rounded(k[5]), k[5])
    if prefill and window is None:  # and the kernel really ran: every chunk found through its block table
        assert all(c.key_blocks is not None and c.mask is None for c in meta_chunks(tables, cached, new, block_size))


# A sliding window (pylon.serving.model.families.layer_windows): of one key (the query's own), of fewer keys than a block
# and than the fresh prompt (whose chunk gets a mask in place of `is_causal`), of several blocks, of more keys than any
# sequence has (attention as without one). The kernels take no window: asked for, they are not used.
@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel-asked"])
@pytest.mark.parametrize("window", [1, 3, 5, 16, 100])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_with_a_sliding_window_equals_dense_windowed_attention(
    kernel: bool, window: int, kv_dtype: torch.dtype
) -> None:
    check_paged_attention(kernel, 2, 32, 4, kv_dtype, prefill=kernel, window=window)
    fresh = meta_chunks([[0, 1]], [0], [7], 4, window=window)[0]  # 7 tokens starting a prompt
    assert fresh.key_blocks is None and (fresh.mask is None) == (window >= 7)


@pytest.mark.parametrize("window", [5, 16, Chunk(8), Chunk(6)], ids=["5", "16", "chunk-8", "chunk-6"])
@pytest.mark.parametrize("gather", [True, False], ids=["window-blocks", "every-block"])
def test_a_windowed_layer_gathers_only_the_blocks_its_queries_windows_hold(window: int, gather: bool, monkeypatch):
    """attention.WINDOW_GATHER: a decode at position 70 reads from the block of its window's first key (position
    66 for a window of 5: block 16 of 4 tokens), a chunk from position 21 from its first query's (17: block 4),
    Llama 4's chunks of whole blocks from their chunk's start (64; 16); a chunk of 6 tokens (not whole blocks) reads
    every block. Either way attention equals the dense reference's; off, every block is read."""
    from pylon.serving.model import attention

    monkeypatch.setattr(attention, "WINDOW_GATHER", gather)
    check_paged_attention(False, 2, 32, 4, torch.float32, window=window)
    seqs = [SequenceSlice(70, 1, list(range(18))), SequenceSlice(21, 37, list(range(100, 115)))]
    meta = build_metadata(seqs, 4, torch.device("cpu"), window=window)
    (group,), (chunk,) = meta.groups, meta.chunks
    first_key = {5: (66, 17), 16: (55, 6), Chunk(8): (64, 16), Chunk(6): (0, 0)}[window] if gather else (0, 0)
    decode_start, chunk_start = (k // 4 * 4 for k in first_key)
    assert group.num_keys == 71 - decode_start and group.key_blocks.tolist() == list(range(decode_start // 4, 18))
    assert chunk.key_start == chunk_start and chunk.key_blocks.tolist() == list(range(100 + chunk_start // 4, 115))
    assert chunk.mask.shape == (37, 58 - chunk_start)


def test_a_windowed_chunk_s_mask_keeps_an_image_s_span_from_its_first_key() -> None:
    """A span (Gemma 3's image, attended both ways) that begins before a windowed chunk's first gathered key: its
    part from there on is in the mask, as in the mask over every key."""
    from pylon.serving.model.attention import _mask

    position, keys = torch.arange(30, 40), torch.arange(0, 40)
    for spans in (((20, 35),), ((33, 38),), ((2, 6),)):
        whole = _mask(position, keys, spans, 8)
        assert torch.equal(_mask(position, keys[24:], spans, 8), whole[:, 24:]), spans


def test_a_staged_step_applies_the_window_to_the_decode_bias() -> None:
    """The decode groups' bias is made from the lengths after the copy (HostStage), with the window."""
    check_paged_attention(False, 2, 32, 4, torch.float32, stage=HostStage("cpu", staged=True), window=5)


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
@pytest.mark.parametrize("min_size", [4096, 8], ids=["one-copy", "regrown"])
def test_metadata_staged_in_one_copy_attends_as_unstaged(kernel: bool, min_size: int) -> None:
    """A GPU's step sends its integer tensors in one copy (HostStage): views of a device buffer handed out before the
    copy, and the decode bias made from the lengths only after it. Staged on a CPU, the same path: had the bias been
    made before the copy (from an empty buffer), or a view pointed at a buffer the lists did not go through (one
    regrown mid-step, `min_size` 8), attention would not match the dense reference (the step before it, which fills
    the cache, runs unstaged)."""
    if kernel:
        from pylon.serving.model import kernels

        assert kernels.load() is not None, f"paged-attention kernel did not build: {kernels._failed}"
    stage = HostStage("cpu", staged=True, min_size=min_size)
    check_paged_attention(kernel, 2, 32, 4, torch.float32, stage=stage)
    if min_size == 8:
        assert stage.copies > 1  # the buffers were regrown mid-step, and what came before went first
    else:
        assert stage.copies == 1  # the step's every integer tensor in one copy


def meta_chunks(tables, cached, new, block_size, window=None):
    seqs = [SequenceSlice(c, n, t) for c, n, t in zip(cached, new, tables)]
    return build_metadata(seqs, block_size, torch.device("cpu"), kernel=True, prefill=True, window=window).chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_store_kernel_writes_what_index_copy_writes(dtype: torch.dtype) -> None:
    from pylon.serving.model import kernels
    from pylon.serving.model.attention import store_kv, store_kv_pair

    assert kernels.load() is not None, f"CPU kernels did not build: {kernels._failed}"
    torch.manual_seed(0)
    kv_heads, dim, T = 3, 64, 9
    # Keys and values as the model has them: strided views of one fused projection's output.
    qkv = torch.randn(T, 3, kv_heads, dim).to(dtype)
    _, k, v = qkv.unbind(1)
    assert not k.is_contiguous()
    expected_k = new_kv_cache(5, 4, kv_heads, dim, dtype=dtype, device="cpu")
    expected_v = torch.zeros_like(expected_k)
    slots = torch.randperm(20)[:T]
    store_kv(expected_k, slots, k)
    store_kv(expected_v, slots, v)
    got_k, got_v = torch.zeros_like(expected_k), torch.zeros_like(expected_k)
    kernels.store_kv_(got_k, got_v, slots, k, v)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    both_k, both_v = torch.zeros_like(expected_k), torch.zeros_like(expected_k)
    store_kv_pair(both_k, both_v, slots, k, v, kernel=True)
    assert torch.equal(both_k, expected_k) and torch.equal(both_v, expected_v)
    # A slot past the pool is refused before anything is written.
    bad = slots.clone()
    bad[-1] = 20
    untouched = torch.zeros_like(expected_k)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.store_kv_(untouched, torch.zeros_like(expected_k), bad, k, v)
    assert not untouched.any()
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.store_kv_(
            torch.zeros_like(expected_k, dtype=torch.float16),
            torch.zeros_like(expected_k, dtype=torch.float16),
            slots,
            k,
            v,
        )


def test_the_gelu_kernel_is_gpt2s_tanh_gelu() -> None:
    from pylon.serving.model import kernels

    assert kernels.load() is not None, f"CPU kernels did not build: {kernels._failed}"
    # Whole vectors and a remainder, tiny and huge inputs (where the exponential saturates), and zero.
    for x in (
        torch.linspace(-12, 12, 100_003),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 1e30, -1e30]),
        torch.randn(7, 33) * 3,
    ):
        expected = F.gelu(x.double(), approximate="tanh")
        got = kernels.gelu_tanh_(x.clone())
        assert got.dtype == torch.float32 and got.shape == x.shape
        torch.testing.assert_close(got.double(), expected, rtol=4e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.gelu_tanh_(torch.randn(4, 4).t())


# ---------------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------------


def draws(params: SamplingParams, logits: torch.Tensor, n: int = 300) -> set[int]:
    generator = params.new_generator()
    return {sample(logits[None], [params], [generator])[0] for _ in range(n)}


def test_top_k_and_top_p_filter_what_can_be_drawn() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert draws(SamplingParams(temperature=1.0, seed=0), logits) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, seed=0, top_k=2), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, seed=0, top_p=0.7), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, seed=0, top_p=0.5), logits) == {0}
    assert draws(SamplingParams(temperature=1.0, seed=0, top_k=3, top_p=0.9), logits) == {0, 1, 2}
    assert draws(SamplingParams(temperature=0), logits, n=3) == {0}


def test_each_row_uses_its_own_generator() -> None:
    logits = torch.zeros(3, 50)  # uniform: every draw consumes randomness
    seeded, other, greedy = (
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, seed=6),
        SamplingParams(temperature=0),
    )
    g = seeded.new_generator()
    alone = [sample(logits[:1], [seeded], [g])[0] for _ in range(10)]
    g, g_other = seeded.new_generator(), other.new_generator()
    together = [sample(logits, [other, seeded, greedy], [g_other, g, None])[1] for _ in range(10)]
    assert together == alone


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_changes_the_distribution(temperature: float) -> None:
    logits = torch.tensor([2.0, 0.0])
    params = SamplingParams(temperature=temperature, seed=1)
    g = params.new_generator()
    share = sum(sample(logits[None], [params], [g])[0] == 0 for _ in range(2000)) / 2000
    expected = torch.softmax(logits / temperature, 0)[0].item()
    assert abs(share - expected) < 0.05


def test_requests_arriving_between_steps_wait_only_beyond_the_free_slots() -> None:
    from pylon.serving.engine.engine import expected_waiting

    # A burst of 20 into an idle engine with 8 slots: 8 start at the next step, 12 wait (not 20).
    assert expected_waiting(running=0, waiting=0, arrived=20, max_num_seqs=8) == 12
    assert expected_waiting(running=3, waiting=0, arrived=5, max_num_seqs=8) == 0
    # Requests already waiting take the free slots first; the new ones queue behind them.
    assert expected_waiting(running=6, waiting=4, arrived=3, max_num_seqs=8) == 7
    # Full of running requests: everything that arrives waits.
    assert expected_waiting(running=8, waiting=0, arrived=2, max_num_seqs=8) == 2
