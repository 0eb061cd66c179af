"""Draft trees (`engine.speculative.tree_width`): drafts that branch, every branch verified in the step's one forward
pass, each node attending to its ancestors only, the accepted path's keys and values moved to their positions.

The engine tests draft through an oracle that knows transformers' greedy continuation and hides it on a branch that
is not the tree's first: every step accepts tokens off the first path, so the outputs stay transformers' own only if
the tree's mask, its positions and the moves of its keys and values are all right (a step that left an accepted
token's keys where the tree wrote them, or let a node see its siblings, would change every later token)."""

from __future__ import annotations

import pytest
import torch
from engine_models import Family, assert_pool_empty, run, speculating, tokens_of

from pylon.errors import PylonError
from pylon.serving.engine import engine as engine_module
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.engine.speculative import best_first, chain_length, ngram_tree, verify, verify_tree
from pylon.serving.engine.suffix import SuffixTree
from pylon.serving.model.attention import SequenceSlice, _tree_mask, tree_positions
from pylon.specs import SpeculativeSpec

NEW = 40


def test_best_first_takes_the_likeliest_nodes_and_lists_them_in_pre_order() -> None:
    # a: 0.6 (then a1 0.5 of it, a2 0.5), b: 0.3 (then b1 0.9), c: 0.1
    table = {
        (): [("a", 0.6), ("b", 0.3), ("c", 0.1)],
        ("a",): [("a1", 0.5), ("a2", 0.5)],
        ("b",): [("b1", 0.9)],
        ("a", "a1"): [("a11", 1.0)],
    }

    def expand(path):
        return [(t, p, (*path, t)) for t, p in table.get(path, [])]

    tokens, parents, score = best_first(expand(()), expand, 5, 2)
    # taken: a .6, a1 .3, a2 .3, b .3, a11 .3 (ties in the order pushed); c never (width 2)
    assert tokens == ["a", "a1", "a11", "a2", "b"] and parents == [-1, 0, 1, 0, -1]
    assert score == pytest.approx(0.6 + 0.3 * 4)
    assert best_first(expand(()), expand, 5, 1)[:2] == (["a", "a1", "a11"], [-1, 0, 1])  # one path
    assert best_first(expand(()), expand, 3, 3, min_prob=0.35)[:2] == (["a"], [-1])
    assert chain_length([-1, 0, 1, 0, -1]) == 3 and chain_length([]) == 0


def test_prompt_lookup_merges_what_followed_each_occurrence() -> None:
    ids = [1, 2, 9, 8, 7, 1, 2, 5, 6, 3, 1, 2, 5, 4, 0, 1, 2]
    tokens, parents = ngram_tree(ids, 4, 2, 1, 2)
    # "1 2" was followed by 5 twice (then 6 and 4) and by 9 once
    assert tokens[0] == 5 and parents[0] == -1 and 9 in [t for t, p in zip(tokens, parents) if p == -1]
    assert len(tokens) == 4
    assert {t for t, p in zip(tokens, parents) if p == 0} == {4, 6}  # both continuations of "1 2 5", latest first
    assert tokens[1] == 4
    assert ngram_tree([4, 5, 6, 7], 3, 3, 1, 2) == ([], [])


def test_the_suffix_tree_branches_where_earlier_runs_went_on_differently() -> None:
    tree = SuffixTree(8)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 7, 7]):
        tree.add(seq)
    path, _ = tree.speculate([9, 1, 2], 4, 4.0, 0.0)
    assert path == [3, 4]
    tokens, parents, score = tree.speculate_tree([9, 1, 2], 4, 4.0, 0.0, 2)
    assert tokens[:2] == [3, 4] and parents[:2] == [-1, 0]  # the first path is the one path's
    assert set(zip(tokens, parents)) == {(3, -1), (4, 0), (5, 0), (7, -1)}
    assert score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25)


def test_a_suffix_tree_one_wide_is_the_one_path_suffix_decoding_drafts() -> None:
    """`speculate_tree` at width 1 and `speculate` (the path `propose` takes, kept for its speed) draft alike: on
    text's runs, from many places, with and without a probability floor, past the tree's depth included."""
    text = list(
        b"the quick brown fox jumps over the lazy dog; the quick red fox naps; the lazy dog jumps over it. " * 3
    )
    tree = SuffixTree(6)
    tree.add(text)
    for end in range(3, len(text), 7):
        for k, factor, floor in ((8, 1.0, 0.1), (16, 4.0, 0.0), (4, 0.5, 0.3)):
            path, score = tree.speculate(text[:end], k, factor, floor)
            tokens, parents, tree_score = tree.speculate_tree(text[:end], k, factor, floor, 1)
            assert tokens == path and parents == list(range(-1, len(path) - 1)), end
            assert tree_score == pytest.approx(score)


def test_a_tree_s_mask_lets_each_node_see_the_cache_and_its_ancestors() -> None:
    parents = (-1, 0, 1, 0, 3, 0)
    seq = SequenceSlice(10, 6, list(range(4)), tree=parents)
    assert tree_positions(10, parents) == [10, 11, 12, 11, 12, 11]
    mask = _tree_mask(seq, 0, None, torch.device("cpu"))
    assert mask.shape == (6, 16) and mask[:, :10].all()
    own = mask[:, 10:].int().tolist()
    assert own == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 0, 1],
    ]
    windowed = _tree_mask(seq, 0, 3, torch.device("cpu"))  # position p sees p - 2 .. p
    assert windowed[0, :10].int().tolist() == [0] * 8 + [1, 1]
    assert windowed[2, :10].int().tolist() == [0] * 10 and windowed[2, 10:].int().tolist() == [1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("start,parents", [(21, (-1, 0, 1, 0, 3, 0, 5, 6, 2)), (40, (-1, *range(0, 32)))])
def test_the_prefill_kernel_attends_a_tree_as_its_mask_says(dim: int, start: int, parents) -> None:
    """The compiled prefill kernel with a tree's bits (`tree_bits`) against dense attention by ancestry: every row
    over the cached keys and its ancestors and itself (a tree across key groups, one that is 33 nodes deep)."""
    from pylon.serving.model import kernels
    from pylon.serving.model.attention import build_metadata, new_kv_cache, paged_attention, tree_bits

    if kernels.load() is None or not kernels.load().has_prefill():
        pytest.skip("the prefill kernel needs AVX-512 or AVX2")
    assert tree_bits((-1, 0, 1, 0)) == [1, 3, 7, 9]
    torch.manual_seed(dim + start)
    heads, kv_heads, block_size, T = 4, 2, 16, len(parents)
    total = start + T
    k_cache = new_kv_cache(8, block_size, kv_heads, dim, dtype=torch.float32, device="cpu")
    v_cache = torch.zeros_like(k_cache)
    table = [5, 2, 7, 0, 3, 1][: -(-total // block_size)]
    keys, values = torch.randn(total, kv_heads, dim) * 2, torch.randn(total, kv_heads, dim)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
    k_cache.view(kv_heads, -1, dim)[:, slots] = keys.transpose(0, 1)
    v_cache.view(kv_heads, -1, dim)[:, slots] = values.transpose(0, 1)
    q = torch.randn(T, heads, dim)
    seq = SequenceSlice(start, T, table, tree=tuple(parents))
    outs = []
    for prefill in (True, False):
        meta = build_metadata([seq], block_size, "cpu", kernel=True, prefill=prefill, slots=False)
        assert (meta.chunks[0].tree is not None) == prefill and (meta.chunks[0].mask is None) == prefill
        outs.append(paged_attention(q, None, None, k_cache, v_cache, meta, dim**-0.5))
    mask = _tree_mask(seq, 0, None, torch.device("cpu"))
    share = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.repeat_interleave(share, 1).transpose(0, 1)[None],
        values.repeat_interleave(share, 1).transpose(0, 1)[None],
        attn_mask=mask,
        scale=dim**-0.5,
    )[0].transpose(0, 1)
    torch.testing.assert_close(outs[1], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[0], want, rtol=1e-4, atol=1e-5)


def test_tree_verification_walks_the_branch_the_model_takes() -> None:
    draft, parents = [5, 6, 7, 8], [-1, 0, -1, 2]  # 5 -> 6, or 7 -> 8
    rows = torch.full((5, 10), -5.0)
    for row, best in enumerate([7, 1, 2, 8, 3]):  # root takes 7, node 7 (row 3) takes 8, node 8 (row 4) takes 3
        rows[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify_tree(rows, draft, parents, greedy, None) == ([7, 8, 3], [2, 3])
    rows[0] = -5.0
    rows[0, 4] = 5.0
    assert verify_tree(rows, draft, parents, greedy, None) == ([4], [])
    # one path, verified as a tree or as a path: the same
    rows = torch.randn(4, 10)
    best = rows.argmax(-1).tolist()
    path = [best[0], best[1], 9 if best[2] != 9 else 0]
    emitted, accepted = verify(rows, path, greedy, None)
    assert verify_tree(rows, path, [-1, 0, 1], greedy, None) == (emitted, list(range(accepted)))


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_tree_verification_keeps_the_model_s_distribution(seed: int) -> None:
    """Whatever the tree holds, each emitted token is the sampler's own draw from the row it follows: the first
    token's frequencies over many draws are the model's distribution, and the second's, given the first, too."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6
    rows = torch.randn(4, vocab, generator=g)
    rows[0, 0] += 2.0  # (node 0 often taken: the second token's frequencies from many draws)
    draft, parents = [0, 1, 2], [-1, -1, 0]  # 0 -> 2, or 1
    params = SamplingParams(temperature=1.0)
    draws = 6000
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    stream = torch.Generator().manual_seed(seed + 10)
    for _ in range(draws):
        emitted, path = verify_tree(rows, draft, parents, params, stream)
        first[emitted[0]] += 1
        if emitted[0] == 0:  # went down node 0: its next token is row 1's draw
            second[emitted[1]] += 1
    p = rows[0].softmax(-1)
    assert torch.allclose(first / draws, p, atol=0.025)
    assert torch.allclose(second / second.sum(), rows[1].softmax(-1), atol=0.04)


def test_the_spec_takes_trees_for_lookup_methods_only() -> None:
    assert SpeculativeSpec(method="suffix", tree_width=4, num_tokens=8).tree_width == 4
    with pytest.raises(ValueError, match="tree_width 2 needs method ngram or suffix"):
        SpeculativeSpec(method="draft", draft_model="/m", tree_width=2)
    with pytest.raises(ValueError, match="num_tokens >= 2"):
        SpeculativeSpec(method="ngram", tree_width=2, num_tokens=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 23, 40, 61)]


def _oracle(expected: dict[tuple[int, ...], list[int]], shape: str):
    """A drafter (in `ngram_tree`'s place) that knows each prompt's greedy continuation and puts it on a branch
    that is not the first path: `after-root` (a wrong path of 3, then the right one beside it), `deep` (the right
    token, then a wrong pair, then the right ones beside them)."""

    def propose(token_ids, k, n_max, n_min, width):
        for prompt, out in expected.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                right = out[len(token_ids) - len(prompt) :][:3]
                break
        else:
            raise AssertionError("a request the oracle does not know")
        wrong = [(t + 1) % 256 for t in right]
        if len(right) < 3:
            return right, list(range(-1, len(right) - 1))
        if shape == "after-root":
            return wrong + right, [-1, 0, 1, -1, 3, 4]
        return [right[0], wrong[1], wrong[2], right[1], right[2]], [-1, 0, 1, 0, 3]

    return propose


FAMILY_CASES = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 13}),  # a window narrower than the contexts, every layer
    "gemma3-hybrid": ("gemma3_text", {"sliding_window": 16, "num_hidden_layers": 6}),  # KV cache in groups
    "deepseek-latent": ("deepseek_v3", {}),  # one latent a token, its keys and values one tensor
    "gpt-oss-sinks": ("gpt_oss", {}),  # sinks (attended eagerly), windowed layers beside full ones
}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family(request, tmp_path_factory) -> Family:
    name, overrides = FAMILY_CASES[request.param]
    return Family(name, tmp_path_factory.mktemp(f"{request.param}-tree"), greedy=False, **overrides)


@pytest.mark.parametrize("shape", ["after-root", "deep"])
def test_greedy_outputs_are_transformers_own_through_branches_off_the_first_path(
    family: Family, shape: str, monkeypatch
) -> None:
    prompts = _prompts()
    expected = {tuple(p): family.hf_greedy(p, NEW) for p in prompts}
    monkeypatch.setattr(engine_module, "ngram_tree", _oracle(expected, shape))
    engine = speculating(family.engine(speculative={"method": "ngram", "num_tokens": 6, "tree_width": 2}))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=NEW, temperature=0))
    got = run(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[f"r{i}"]) == expected[tuple(prompt)], (family.name, shape, i)
    stats = engine.stats()
    # every full step accepted its 3 right drafts, off the first path (after-root: 3 of them; deep: 2)
    assert stats.spec_tree_branch_tokens_total >= (3 if shape == "after-root" else 2) * len(prompts) * 5, stats
    assert stats.spec_accepted_tokens_total >= 3 * len(prompts) * 5
    assert stats.spec_draft_tokens_by_position[:3] == stats.spec_accepted_tokens_by_position[:3]
    assert_pool_empty(engine)


def test_narrower_caches_and_the_prefill_kernel_s_steps_take_trees_too(tmp_path, monkeypatch) -> None:
    """A KV cache stored in bf16 (the steps read every key back from it), beside prompt chunks in the same steps
    (the runner's other rows go on through the prefill kernel where it is built): outputs as without a tree."""
    family = Family("llama", tmp_path / "m", greedy=False)
    prompts = _prompts()
    plain = family.engine(kv_cache_dtype="bf16")
    for i, prompt in enumerate(prompts):
        plain.add_request(f"r{i}", prompt, SamplingParams(max_tokens=NEW, temperature=0))
    want = {k: tokens_of(v) for k, v in run(plain).items()}
    expected = {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)}
    monkeypatch.setattr(engine_module, "ngram_tree", _oracle(expected, "deep"))
    engine = speculating(
        family.engine(kv_cache_dtype="bf16", speculative={"method": "ngram", "num_tokens": 6, "tree_width": 3})
    )
    for i, prompt in enumerate(prompts):  # (staggered: later prompts' chunks share steps with earlier decodes)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=NEW, temperature=0))
        engine.step()
    got = run(engine)
    # (the first request's first token came out of the staggered steps)
    assert engine.stats().spec_tree_branch_tokens_total > 0
    for i in range(1, len(prompts)):
        assert tokens_of(got[f"r{i}"])[-NEW // 2 :] == want[f"r{i}"][-NEW // 2 :]


def test_real_lookup_trees_keep_greedy_and_seeded_outputs(tmp_path, monkeypatch) -> None:
    """Prompt lookup's and suffix decoding's own trees on prompts that repeat with variations, greedy and seeded
    sampled requests: the tokens plain decoding gives them (trees that branch drafted and verified)."""
    branched = []

    def counting(propose):
        def counted(*args):
            tokens, parents = propose(*args)
            branched.append(chain_length(parents) < len(parents))
            return tokens, parents

        return counted

    monkeypatch.setattr(engine_module, "ngram_tree", counting(ngram_tree))
    family = Family("gpt2", tmp_path / "m", initializer_range=0.02, greedy=False)
    g = torch.Generator().manual_seed(5)
    prompts = []
    for n in (6, 9, 12):
        phrase = torch.randint(0, 256, (n,), generator=g).tolist()
        prompts.append([t for v in (1, 2, 3, 4, 5) for t in phrase + [v]] + phrase)
    runs = []
    for speculative in (
        None,
        {"method": "ngram", "num_tokens": 8, "tree_width": 3},
        {"method": "suffix", "num_tokens": 8, "tree_width": 3, "suffix_max_depth": 8, "suffix_max_spec_factor": 4.0},
    ):
        engine = family.engine(speculative=speculative) if speculative else family.engine()
        if speculative:
            speculating(engine)
        if engine.suffix is not None:
            engine.suffix.propose_tree = counting(engine.suffix.propose_tree)
        branched.clear()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"greedy{i}", prompt, SamplingParams(max_tokens=32, temperature=0))
            engine.add_request(
                f"seeded{i}", prompt, SamplingParams(max_tokens=32, seed=i, temperature=0.3, ignore_eos=True)
            )
            for j in range(3):  # (outputs that part where the seeded ones may go: the engine's suffix tree branches)
                engine.add_request(f"free{i}-{j}", prompt, SamplingParams(max_tokens=32, temperature=1.0))
        got = run(engine)
        runs.append({k: tokens_of(v) for k, v in got.items() if not k.startswith("free")})
        if speculative:
            stats = engine.stats()
            assert stats.spec_verify_steps_total > 0 and stats.spec_accepted_tokens_total > 0, stats
            assert sum(branched) > 0, (speculative["method"], len(branched))
        assert_pool_empty(engine)
    assert runs[0] == runs[1] == runs[2]


def test_a_model_with_recurrent_layers_refuses_a_tree(tmp_path) -> None:
    family = Family("qwen3_next", tmp_path / "m", greedy=False)
    with pytest.raises(PylonError, match="engine.speculative.tree_width 2: .*recurrent"):
        family.engine(speculative={"method": "ngram", "num_tokens": 4, "tree_width": 2})
