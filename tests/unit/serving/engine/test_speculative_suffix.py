"""Suffix decoding (`engine.speculative.method: suffix`, engine/suffix.py): the trees count every run of tokens up to
their depth and give it back exactly; drafts follow the most frequent continuation of the longest matched suffix, as
long as the match and the probability allow; through the engine, outputs stay the model's and what earlier requests
wrote drafts later ones, which prompt lookup cannot."""

from __future__ import annotations

import random
from collections import Counter

from engine_models import GREEDY, PROMPTS, Family, assert_pool_empty, run, speculating, tokens_of

from pylon.serving.engine.suffix import Growing, SuffixDecoding, SuffixTree


def counted(tree: SuffixTree) -> Counter:
    """Every path of the tree and its count (each position inside an edge counted as the edge's end)."""
    found: Counter = Counter()

    def walk(node, path):
        for child in (node.children or {}).values():
            label = tuple(child.seq[child.start : child.start + child.length])
            for i in range(1, len(label) + 1):
                found[(*path, *label[:i])] = child.count
            walk(child, (*path, *label))

    walk(tree.root, ())
    return found


def nodes(tree: SuffixTree) -> int:
    todo, n = [tree.root], 0
    while todo:
        node = todo.pop()
        n += 1
        todo.extend((node.children or {}).values())
    return n


def runs(sequences: list[list[int]], depth: int, complete: bool = False) -> Counter:
    """Every run of 1 .. depth tokens of the sequences, counted: what the tree must hold (`complete`: of the starts
    with `depth` tokens after them only, as a growing sequence's tree holds them)."""
    found: Counter = Counter()
    for s in sequences:
        for i in range(len(s) - (depth - 1 if complete else 0)):
            for n in range(1, depth + 1):
                if i + n <= len(s):
                    found[tuple(s[i : i + n])] += 1
    return found


def test_the_tree_counts_every_run_up_to_its_depth_and_gives_them_back() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    tree = SuffixTree(depth=6)
    for s in seqs:
        tree.add(s)
    assert counted(tree) == runs(seqs, 6)
    for s in seqs[::2]:
        tree.remove(s)
    assert counted(tree) == runs(seqs[1::2], 6)
    for s in seqs[1::2]:
        tree.remove(s)
    assert not tree.root.children


def test_a_growing_sequence_s_tree_counts_its_runs_as_they_complete() -> None:
    rng = random.Random(1)
    seq = [rng.randrange(4) for _ in range(60)]
    grown = Growing(depth=5)
    grown.extend(seq[:17])  # (in two calls: the starts waiting for their tokens carry over)
    grown.extend(seq[17:])
    assert counted(grown.tree) == runs([seq], 5, complete=True)


def test_the_tree_holds_a_few_nodes_a_token_not_its_depth() -> None:
    """Single-child chains are one edge: text's tree holds ~2 nodes a token, where one node a run would be ~depth."""
    text = [ord(c) for c in "the quick brown fox jumps over the lazy dog; " * 3 + "pack my box with five dozen jugs"]
    tree = SuffixTree(depth=24)
    tree.add(text)
    assert nodes(tree) < 2.5 * len(text), (nodes(tree), len(text))
    assert counted(tree) == runs([text], 24)


def test_a_draft_follows_the_most_frequent_continuation_while_it_is_likely() -> None:
    tree = SuffixTree(depth=8)
    for s in [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [7, 2, 3, 4, 6]]:
        tree.add(s)
    # [2, 3] is followed by 4 three times in four: 4, then 5 (two of the three 2 3 4), probability 3/4 * 2/3
    draft, score = tree.speculate([0, 2, 3], k=5, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft == [4, 5] and abs(score - (0.75 + 0.5)) < 1e-9
    # the longest match wins: [1, 2, 3] -> 4 (2 of 3), then 5
    assert tree.speculate([1, 2, 3], k=5, max_spec_factor=2.0, min_token_prob=0.1)[0] == [4, 5]
    # a draft stops where its probability falls below the floor, or at the match's length x the factor, or at k
    assert tree.speculate([0, 2, 3], k=5, max_spec_factor=2.0, min_token_prob=0.6)[0] == [4]
    assert tree.speculate([0, 2, 3], k=5, max_spec_factor=0.5, min_token_prob=0.1)[0] == [4]
    assert tree.speculate([0, 2, 3], k=1, max_spec_factor=2.0, min_token_prob=0.1)[0] == [4]
    assert tree.speculate([8], k=5, max_spec_factor=2.0, min_token_prob=0.1) == ([], 0.0)


def test_past_the_tree_s_depth_a_draft_finds_its_place_again() -> None:
    tree = SuffixTree(depth=3)
    text = list(range(20))
    tree.add(text)
    assert tree.speculate([0, 4, 5], k=8, max_spec_factor=8.0, min_token_prob=0.1)[0] == [6, 7, 8, 9, 10, 11, 12, 13]


def test_the_engine_s_drafter_takes_the_likelier_tree_and_lets_old_outputs_go() -> None:
    suffix = SuffixDecoding(depth=4, max_cached_requests=2, max_spec_factor=4.0, min_token_prob=0.1)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    suffix.finish("a", answer)
    # a new request whose own tokens hold nothing like it drafts the earlier output once it starts writing it
    assert suffix.propose("b", [1, 2, 3, 40, 41], k=4, num_prompt_tokens=3) == [42, 43, 44, 45]
    assert suffix.propose("b", [1, 2, 3, 40, 41, 42, 43], k=4, num_prompt_tokens=3) == [44, 45, 46, 47]
    # its own tokens win where they are likelier: a loop it wrote itself
    own = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    assert suffix.propose("c", own, k=3, num_prompt_tokens=len(own)) == [7, 5, 6]
    suffix.finish("b", [40, 41, 42, 43])
    suffix.finish("c", [9, 9])
    suffix.finish("d", [8, 8])  # (max 2 kept: a's and b's outputs let go)
    assert suffix.propose("e", [1, 40, 41], k=4, num_prompt_tokens=1) == []
    assert counted(suffix.cached) == runs([[9, 9], [8, 8]], 4)


def test_a_running_request_s_output_drafts_another_and_is_counted_once_when_it_finishes() -> None:
    suffix = SuffixDecoding(depth=4, max_cached_requests=8, max_spec_factor=4.0, min_token_prob=0.1)
    prompt, answer = [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]
    for n in range(1, len(answer) + 1):  # request a decodes its answer, proposing at each step
        suffix.propose("a", prompt + answer[:n], k=4, num_prompt_tokens=len(prompt))
    # b, the same prompt asked beside it, drafts a's answer once it starts on it (a's runs, complete, are counted)
    assert suffix.propose("b", prompt + answer[:2], k=4, num_prompt_tokens=len(prompt)) == [42, 43, 44, 45]
    suffix.finish("a", answer)
    suffix.finish("b", answer[:2])
    assert counted(suffix.cached) == runs([answer, answer[:2]], 4)
    # an output that is not what the request wrote as it ran (its runs so far taken back, the output's counted)
    for n in range(1, 8):
        suffix.propose("c", prompt + [7] * n, k=4, num_prompt_tokens=len(prompt))
    suffix.finish("c", [9, 9, 9])
    assert counted(suffix.cached) == runs([answer, answer[:2], [9, 9, 9]], 4)


def test_through_the_engine_outputs_stay_the_model_s_and_earlier_outputs_draft_later_requests(tmp_path) -> None:
    """Prompts answered once, then again as new requests: greedy outputs are transformers' both times; the second
    time suffix decoding drafts each answer from the first (most drafts accepted, few forward passes a token), where
    prompt lookup finds only what the request itself holds."""
    family = Family("llama", tmp_path / "m", greedy=False)
    prompts = PROMPTS[:4]
    passes = {}
    for method in ("ngram", "suffix"):
        engine = speculating(family.engine(speculative={"method": method, "num_tokens": 4}))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"first-{i}", prompt, GREEDY)
        run(engine)
        before = engine.stats()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"again-{i}", prompt, GREEDY)
        steps, got = 0, {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).append(out)
            steps += 1
        for i, prompt in enumerate(prompts):
            assert tokens_of(got[f"again-{i}"]) == family.hf_greedy(prompt, GREEDY.max_tokens), (method, i)
        stats = engine.stats()
        drafts = stats.spec_draft_tokens_total - before.spec_draft_tokens_total
        accepted = stats.spec_accepted_tokens_total - before.spec_accepted_tokens_total
        passes[method] = steps / GREEDY.max_tokens
        if method == "suffix":
            assert drafts > 0 and accepted / drafts > 0.9, (drafts, accepted)
        assert_pool_empty(engine)
    # the second round's steps per output token (the 4 requests batched): suffix's at most a third of prompt lookup's
    assert passes["suffix"] < passes["ngram"] / 3, passes


def test_through_the_engine_a_request_drafts_from_one_running_beside_it(tmp_path) -> None:
    """The same prompt asked twice at once, the second a few steps after the first, on an engine that has finished
    nothing yet: the second drafts the first's answer as far as it goes, and both are transformers' answer."""
    family = Family("llama", tmp_path / "m", greedy=False)
    engine = speculating(family.engine(speculative={"method": "suffix", "num_tokens": 24, "suffix_max_depth": 6}))
    prompt = PROMPTS[1]
    engine.add_request("first", prompt, GREEDY)
    got = run(engine, steps=12)  # (its prompt, then 11 decodes)
    engine.add_request("second", prompt, GREEDY)
    accepted = None  # the drafts accepted while the first still runs: the second's, from the first's answer so far
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
            if out.request_id == "first" and out.finished:
                accepted = engine.stats().spec_accepted_tokens_total
    want = family.hf_greedy(prompt, GREEDY.max_tokens)
    assert tokens_of(got["first"]) == tokens_of(got["second"]) == want
    assert accepted is not None and accepted >= 4, accepted
    assert_pool_empty(engine)


def test_the_trees_host_memory_a_token_is_what_the_planner_counts() -> None:
    """Outputs of real text in the engine's tree take about `BYTES_PER_TOKEN` of host memory a token (the figure
    `pylon plan` multiplies out), and give it back when they are let go."""
    import tracemalloc
    from pathlib import Path

    from pylon.plan.serve import SUFFIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN

    text = list((Path(__file__).resolve().parents[5] / "shared" / "datasets" / "tinyshakespeare.txt").read_bytes())
    outputs = [text[i : i + 500] for i in range(0, 50_000, 500)]
    suffix = SuffixDecoding(depth=24, max_cached_requests=len(outputs), max_spec_factor=1.0, min_token_prob=0.1)
    tracemalloc.start()
    try:
        for i, output in enumerate(outputs):
            suffix.finish(str(i), output)
        held = tracemalloc.get_traced_memory()[0] / 50_000
        suffix.max_cached = 1
        suffix.finish("last", [1])  # (past the limit: every other output let go)
        left = tracemalloc.get_traced_memory()[0] / 50_000
    finally:
        tracemalloc.stop()
    assert 0.5 * BYTES_PER_TOKEN < held < 1.3 * BYTES_PER_TOKEN, held
    assert list(suffix.cached.root.children) == [1] and left < 0.1 * BYTES_PER_TOKEN, left
