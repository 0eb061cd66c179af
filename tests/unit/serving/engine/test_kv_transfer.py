"""Prefill-decode disaggregation's engine part (engine/kv_transfer.py): a prefill engine's prompt blocks sent with its
one-token request's output, taken in by a decode engine, which then computes only what follows the prompt's last full
block and writes exactly what it would had it computed the prompt itself; what the pool does with such blocks; and
a transfer of another layout refused, the prompt computed where it is."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_models import Family, add_mtp_layer, assert_pool_empty, recorded, run, speculating, tokens_of

from pylon.serving.engine import kv_transfer
from pylon.serving.engine.kv_cache import HybridKVBlockPool, KVBlockPool, block_hashes
from pylon.serving.engine.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------------


def test_adopted_blocks_are_cached_and_free_and_a_request_starts_with_them() -> None:
    pool = KVBlockPool(6, 4, enable_caching=True)
    pool.track_changes()
    hashes = block_hashes(list(range(16)), 4, [])
    taken = pool.adopt(hashes[:3])
    assert [i for i, _ in taken] == [0, 1, 2] and pool.lookup(hashes) == [b for _, b in taken]
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3  # free: no request holds them yet
    assert pool.drain_changes() == [(True, h) for h in hashes[:3]]  # routing hears of them
    assert pool.adopt(hashes[:4]) == [(3, pool.lookup(hashes)[3])]  # only what it lacks
    blocks = pool.restore(hashes[: pool.reachable(hashes)])
    assert pool.allocate("r", 17, cached=blocks) and pool.block_table("r")[:4] == blocks
    pool.free("r")


def test_adopting_takes_the_least_recently_used_block_but_never_one_of_its_own_prefix() -> None:
    pool = KVBlockPool(3, 4, enable_caching=True)
    a = block_hashes(list(range(8)), 4, [])
    assert pool.allocate("a", 8)
    pool.cache_blocks("a", a, 2)
    pool.free("a")  # blocks 0, 1: a's, cached and free (0 used longest ago)
    other = block_hashes(list(range(50, 58)), 4, [])
    taken = pool.adopt([a[0], other[0], other[1]])  # a[0] kept; block 2 (bare), then block 1 (a[1]'s, not a[0]'s)
    assert taken == [(1, 2), (2, 1)]
    assert pool.lookup(a) == [0] and pool.lookup(other) == [2, 1]
    assert pool.adopt(block_hashes(list(range(90, 94)), 4, [])) == [(0, 0)]  # a[0]'s now: no other is older


def test_a_hybrid_pool_names_a_prefix_by_group_and_windowed_groups_only_where_their_queries_read() -> None:
    pool = HybridKVBlockPool(32, 4, [None, 6], enable_caching=True)
    hashes = block_hashes(list(range(20)), 4, [])  # five blocks; the window (6) reads from position 14 on: block 3
    named = pool.prefix_names(hashes)
    assert [(i, n[16:]) for i, n in named] == [
        (0, b""),
        (1, b""),
        (2, b""),
        (3, b""),
        (3, b"\x01"),
        (4, b""),
        (4, b"\x01"),
    ]
    pool.adopt([n for _, n in named])
    assert pool.reachable(hashes) == 5  # the whole prefix, though the window's first blocks were never sent


def test_a_transfer_of_another_layout_is_refused_naming_what_differs() -> None:
    ours = {"block_size": 16, "groups": [None], "tensors": [[[[2, 16, 32], "float32"]] * 4]}
    theirs = {**ours, "tensors": [[[[2, 16, 32], "float8_e4m3fn"]] * 4]}
    said = kv_transfer.differences(theirs, ours)
    assert len(said) == 1 and "tensor 0: float8_e4m3fn [2, 16, 32] there, float32 [2, 16, 32] here" in said[0], said
    assert kv_transfer.differences({**ours, "block_size": 8}, ours) == ["engine.block_size: 8 there, 16 here"]
    assert kv_transfer.differences(ours, ours) == []


# ---------------------------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------------------------

G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (84, 37, 100, 16)]
ASK = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
PREFILL = SamplingParams(max_tokens=1, temperature=0, kv_export_from=0)


def _answers(outs) -> tuple:
    return tokens_of(outs), [(e.token_id, e.logprob, e.top) for o in outs for e in o.logprobs]


def _prefilled(prefill, rid: str, prompt: list[int], params: SamplingParams = PREFILL):
    prefill.add_request(rid, prompt, params)
    return run(prefill)[rid][-1].kv_transfer


@pytest.mark.parametrize(
    "name, fields, overrides",
    [
        ("gpt2", {}, {}),
        ("llama", {"kv_cache_dtype": "fp8"}, {}),
        ("deepseek_v3", {}, {}),  # latent attention: one cache a layer
        ("gemma3_text", {}, {"sliding_window": 16, "num_hidden_layers": 6}),  # groups of layers (HybridKVBlockPool)
    ],
    ids=["gpt2", "llama-fp8-cache", "deepseek-v3", "gemma3-groups"],
)
def test_a_decode_engine_given_the_prefill_engines_blocks_computes_only_the_tail_and_answers_the_same(
    name: str, fields: dict, overrides: dict, tmp_path
) -> None:
    family = Family(name, tmp_path / name, greedy=False, **overrides)
    # What one engine answers having computed the prompt itself earlier (its own cached blocks: the path a decode
    # engine's taken-in blocks take), and with nothing cached (transformers' tokens)
    alone = family.engine(**fields)
    want, first = [], []
    for i, prompt in enumerate(PROMPTS):
        alone.add_request(f"cold-{i}", prompt, ASK)
        first.append(tokens_of(run(alone)[f"cold-{i}"]))
        alone.add_request(f"warm-{i}", prompt, ASK)
        want.append(_answers(run(alone)[f"warm-{i}"]))
    assert [w[0] for w in want] == first
    if "kv_cache_dtype" not in fields:  # (an fp8 cache's keys are not transformers' own)
        assert first == [family.hf_greedy(p, 10) for p in PROMPTS]

    prefill, decode = family.engine(**fields), family.engine(**fields)
    bs = decode.pool.block_size
    hybrid = isinstance(decode.pool, HybridKVBlockPool)
    assert hybrid == (name == "gemma3_text")
    got, cached = [], []
    for i, prompt in enumerate(PROMPTS):
        transfer = _prefilled(prefill, f"p-{i}", prompt)
        usable = (len(prompt) - 1) // bs
        if not usable:  # (a prompt of one block: its last token is computed anyway, and no block is sent)
            assert transfer is None
        else:
            assert transfer.prompt_tokens == len(prompt) and transfer.first_block == 0
            assert transfer.num_blocks == (len(decode.pool.prefix_names([b""] * usable)) if hybrid else usable)
            assert [len(a) for a in transfer.data] and transfer.nbytes > 0
        decode.add_request(f"d-{i}", prompt, dataclasses.replace(ASK, kv_import=transfer))
        outs = run(decode)[f"d-{i}"]
        got.append(_answers(outs))
        cached.append(outs[-1].num_cached_tokens)
    assert got == want  # tokens and log-probabilities, bit for bit
    assert cached == [(len(p) - 1) // bs * bs for p in PROMPTS]
    stats = decode.stats()
    assert stats.prefill_tokens_computed_total == sum(len(p) for p in PROMPTS) - sum(cached)  # the tails only
    sent = prefill.stats()
    assert stats.kv_transfer_received_blocks_total == sent.kv_transfer_sent_blocks_total > 0
    assert stats.kv_transfer_received_bytes_total == sent.kv_transfer_sent_bytes_total > 0
    assert stats.kv_transfer_refused_total == 0
    assert_pool_empty(decode)
    assert_pool_empty(prefill)


def test_a_multi_token_prediction_layer_s_blocks_go_with_the_model_s(tmp_path) -> None:
    """DeepSeek-V3 with its checkpoint's multi-token-prediction layer drafting (engine.speculative.method: mtp): the
    layer's cache is in the model's blocks, so a transfer carries both runners' tensors, the layer caught up on the
    prompt's every position as the prefill request ends; the decoding engine's drafts and outputs after another
    engine's blocks are those after its own."""
    family = Family("deepseek_v3", tmp_path / "m", greedy=False)
    add_mtp_layer(family.dir)
    fields = {"speculative": {"method": "mtp", "num_tokens": 3}}
    alone = speculating(family.engine(**fields))
    prefill, decode = speculating(family.engine(**fields)), speculating(family.engine(**fields))
    assert len(decode._kv_runners()) == 2
    drafted, drafts = recorded(alone), recorded(decode)  # (each proposal: the tokens then, and the layer's drafts)
    want, got, warm = [], [], []
    for i, prompt in enumerate(PROMPTS[:3]):
        alone.add_request(f"cold-{i}", prompt, PREFILL)
        run(alone)
        mark = len(drafted)
        alone.add_request(f"warm-{i}", prompt, ASK)
        want.append(_answers(run(alone)[f"warm-{i}"]))
        warm += drafted[mark:]
        transfer = _prefilled(prefill, f"p-{i}", prompt)
        assert (
            len(transfer.data) == sum(len(t) for t in transfer.layout["tensors"])
            and len(transfer.layout["tensors"]) == 2
        )
        decode.add_request(f"d-{i}", prompt, dataclasses.replace(ASK, kv_import=transfer))
        got.append(_answers(run(decode)[f"d-{i}"]))
    assert got == want
    # the layer drafts from the blocks' keys and values: the same drafts from the same tokens
    assert len(drafts) >= 3 * 5 and drafts == warm
    assert decode.stats().spec_draft_tokens_total == alone.stats().spec_draft_tokens_total > 0
    assert decode.stats().spec_accepted_tokens_total == alone.stats().spec_accepted_tokens_total


def test_a_chats_next_turn_sends_only_the_blocks_the_decode_engine_lacks(gpt2: Family) -> None:
    prefill, decode = gpt2.engine(), gpt2.engine()
    turn = PROMPTS[0]
    decode.add_request("1", turn, dataclasses.replace(ASK, kv_import=_prefilled(prefill, "1", turn)))
    answer = tokens_of(run(decode)["1"])
    following = turn + answer + PROMPTS[2][:40]  # the next turn: the first, its answer, and more
    held = (len(turn) - 1) // 16  # what the decode engine holds of it (its own answer's blocks aside)
    transfer = _prefilled(prefill, "2", following, dataclasses.replace(PREFILL, kv_export_from=held))
    assert transfer.first_block == held and transfer.num_blocks == (len(following) - 1) // 16 - held
    decode.add_request("2", following, dataclasses.replace(ASK, kv_import=transfer))
    outs = run(decode)["2"]
    assert outs[-1].num_cached_tokens == (len(following) - 1) // 16 * 16
    assert tokens_of(outs) == gpt2.hf_greedy(following, 10)


def test_blocks_taken_in_over_cached_ones_send_those_to_the_host_tier_first(gpt2: Family) -> None:
    """A decoding engine with a host tier whose device cache holds one prompt's blocks: taking in the next prompt's
    blocks takes those blocks, so their contents go to the host tier first (before the new bytes are written over
    them), and the first prompt, asked again, comes back from there with the same answer."""
    prefill = gpt2.engine()
    decode = gpt2.engine(kv_cache_tokens=128, max_model_len=128, max_num_seqs=2, kv_offload_tokens=1024)
    first, second = PROMPTS[0], PROMPTS[2][:90]
    want = {}
    for name, prompt in (("first", first), ("second", second)):
        decode.add_request(name, prompt, dataclasses.replace(ASK, kv_import=_prefilled(prefill, name, prompt)))
        want[name] = _answers(run(decode)[name])
    assert decode.stats().kv_offload_saved_blocks_total > 0  # the first's blocks, taken for the second's
    decode.add_request("again", first, ASK)
    outs = run(decode)["again"]
    assert outs[-1].num_cached_tokens == (len(first) - 1) // 16 * 16 and decode.stats().kv_offload_loaded_blocks_total
    assert _answers(outs) == want["first"] and want["first"][0] == gpt2.hf_greedy(first, 10)


def test_a_transfer_from_an_engine_of_another_kv_layout_is_refused_and_the_prompt_computed_here(tmp_path) -> None:
    family = Family("llama", tmp_path / "llama", greedy=False)
    transfer = _prefilled(family.engine(kv_cache_dtype="fp8"), "p", PROMPTS[0])
    decode = family.engine()
    decode.add_request("d", PROMPTS[0], dataclasses.replace(ASK, kv_import=transfer))
    outs = run(decode)["d"]
    assert outs[-1].num_cached_tokens == 0 and tokens_of(outs) == family.hf_greedy(PROMPTS[0], 10)
    stats = decode.stats()
    assert stats.kv_transfer_refused_total == 1 and stats.kv_transfer_received_blocks_total == 0
    assert stats.prefill_tokens_computed_total == len(PROMPTS[0])
