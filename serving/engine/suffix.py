"""Suffix decoding (`engine.speculative.method: suffix`): drafts from what the request and earlier requests wrote.

Prompt lookup (`ngram`) drafts what followed the latest earlier occurrence of the request's last few tokens in its own
tokens. Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; vLLM's `suffix`, Arctic Inference's) looks in two
suffix trees of bounded depth and picks by frequency, not recency:

- the request's own: every run of up to `depth` tokens of its prompt and output, counted (each once it is complete);
- the engine's: the same over the outputs of the last `max_cached_requests` requests that finished, so that what an
  agent, a tool loop or a templated workload wrote before (a tool call's JSON, a SQL query's shape, the same
  answer to the same question) drafts the next request's output, which its own prompt does not hold; and over the
  outputs of the requests still running, as far as they go (each run once complete), so that requests running side
  by side (the choices of one prompt, the same question asked twice at once) draft from each other.

For each decode it finds the longest suffix of the request's tokens (up to `depth - 1`) that a tree holds with something
after it, then walks down it, each step to the child seen most often, the draft's probability the product of each
child's share of its parent's count; it stops where that falls below `min_token_prob`, after `max_spec_factor` x the
match's length tokens (a short match earns a short draft), or at `k`. Past the tree's depth it finds its place again
from the draft's own last tokens. Of the two trees' drafts it takes the one whose expected accepted length (the sum of
its probabilities) is larger. The drafts are verified as any others are (speculative.py): outputs are the model's.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict

from pylon.serving.engine.speculative import best_first

WINDOW = 4096  # a request's tokens its own tree is built from at first (its latest), as prompt lookup searches


class _Node:
    """A node of the tree: the path from the root to it ends with its edge's tokens, `seq[start : start + length]`
    (one of the sequences added); `count` runs pass through its end, and as many through every position inside its
    edge (a run that ends inside an edge splits it there)."""

    __slots__ = ("count", "children", "seq", "start", "length")

    def __init__(self, count: int, seq, start: int, length: int, children: dict | None = None) -> None:
        self.count = count
        self.children = children
        self.seq, self.start, self.length = seq, start, length


class SuffixTree:
    """Counts of runs of up to `depth` tokens (a suffix trie cut at `depth`, its single-child chains compressed to one
    edge, so that it holds about two nodes a token, not `depth`). `add` counts every run of a whole sequence (each
    start, `depth` tokens or to its end), `remove` takes them back; `Growing` adds a sequence's runs as they
    complete."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0, (), 0, 0, {})

    def add(self, tokens) -> None:
        seq = array("l", tokens)
        for s in range(len(seq)):
            self.insert(seq, s, min(self.depth, len(seq) - s))

    def remove(self, tokens) -> None:
        seq = list(tokens)
        for s in range(len(seq)):
            self.take(seq[s : s + self.depth])

    def insert(self, seq, s: int, d: int) -> None:
        """Count the run `seq[s : s + d]` (and so each of its prefixes)."""
        node, i = self.root, 0
        while i < d:
            t = seq[s + i]
            child = node.children.get(t) if node.children else None
            if child is None:
                if node.children is None:
                    node.children = {}
                node.children[t] = _Node(1, seq, s + i, d - i)
                return
            label, at, length = child.seq, child.start, child.length
            j = 1
            while j < length and i + j < d and label[at + j] == seq[s + i + j]:
                j += 1
            if j < length:  # the run leaves the edge (or ends) inside it: a node there
                mid = _Node(child.count, label, at, j, {label[at + j]: child})
                child.start, child.length = at + j, length - j
                node.children[t] = mid
                child = mid
            child.count += 1
            node, i = child, i + j

    def take(self, run) -> None:
        """Take back one run `insert` counted."""
        node, i = self.root, 0
        while i < len(run):
            child = node.children[run[i]]
            child.count -= 1
            if child.count == 0:  # (its subtree goes with it: no run passes it any more)
                del node.children[run[i]]
                return
            node, i = child, i + child.length

    def _find(self, context: list[int]):
        """Where the path `context` ends: (node, tokens of its edge matched), or None if the tree does not hold it."""
        node, i, n = self.root, 0, len(context)
        while i < n:
            child = node.children.get(context[i]) if node.children else None
            if child is None:
                return None
            label, at = child.seq, child.start
            j = 1
            while j < child.length and i + j < n:
                if label[at + j] != context[i + j]:
                    return None
                j += 1
            node, i = child, i + j
            if j < child.length:
                return node, j
        return node, node.length

    def match(self, context: list[int]):
        """Where the longest suffix of `context` (up to depth - 1 tokens) that the tree holds with something after it
        ends, and its length; (None, 0) if none. (A request's own tree holds its latest tokens, never continued: an
        earlier occurrence is what drafts.)"""
        for n in range(min(self.depth - 1, len(context)), 0, -1):
            found = self._find(context[len(context) - n :])
            if found is not None and (found[1] < found[0].length or found[0].children):
                return found, n
        return None, 0

    def speculate(self, context: list[int], k: int, max_spec_factor: float, min_token_prob: float):
        """A draft continuing `context`: (tokens, their expected accepted length), see the module's docstring."""
        place, matched = self.match(context)
        if place is None:
            return [], 0.0
        node, j = place
        limit = min(k, max(1, math.floor(max_spec_factor * matched)))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if j < node.length:  # inside an edge: its next token, every run here goes on to it
                token = node.seq[node.start + j]
                j += 1
            else:
                if not node.children:  # the tree's depth, or a run's end: its place again, from the latest tokens
                    place, _ = self.match(context[len(context) - self.depth :] + draft)
                    if place is None:
                        break
                    node, j = place
                    continue
                token, child = max(node.children.items(), key=lambda item: item[1].count)
                prob *= child.count / max(node.count, sum(c.count for c in node.children.values()))
                node, j = child, 1
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
        return draft, score

    def speculate_tree(self, context: list[int], k: int, max_spec_factor: float, min_token_prob: float, width: int):
        """A draft tree continuing `context` (`speculative.best_first`: tokens, parents, expected accepted length):
        from the match, each node's children the tree's continuations there, their shares of its count, the
        likeliest first; at most `width` children a node and max_spec_factor x the match's length nodes in all (a
        short match earns a small tree), none below `min_token_prob`. Width 1 gives `speculate`'s path (which
        `propose` takes, a third faster)."""
        place, matched = self.match(context)
        if place is None:
            return [], [], 0.0
        limit = min(k, max(1, math.floor(max_spec_factor * matched)))
        tail = list(context[len(context) - self.depth :])

        def expand(state) -> list:
            node, j, path = state
            if j < node.length:  # inside an edge: its next token, every run here goes on to it
                token = node.seq[node.start + j]
                return [(token, 1.0, (node, j + 1, path + (token,)))]
            if not node.children:  # the tree's depth, or a run's end: its place again, from the latest tokens
                again, _ = self.match((tail + list(path))[-self.depth :] if path else tail)
                return expand((*again, path)) if again is not None else []
            total = max(node.count, sum(c.count for c in node.children.values()))
            ranked = heapq.nlargest(width, node.children.items(), key=lambda item: item[1].count)
            return [(token, child.count / total, (child, 1, path + (token,))) for token, child in ranked]

        return best_first(expand((place[0], place[1], ())), expand, limit, width, min_token_prob)


class Growing:
    """A sequence's tree as the sequence grows (a request's own tokens): each run of `depth` tokens counted once it is
    complete (so the latest depth - 1 starts wait for their tokens)."""

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.tokens = array("l")
        self._next = 0  # the next start whose run is not counted yet

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)
        depth = self.tree.depth
        while self._next + depth <= len(self.tokens):
            self.tree.insert(self.tokens, self._next, depth)
            self._next += 1


class SuffixDecoding:
    """The engine's suffix drafter: each running request's tree, and the tree of recently finished outputs."""

    def __init__(self, depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float) -> None:
        self.depth, self.max_cached = depth, max_cached_requests
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.cached = SuffixTree(depth)  # the finished outputs'
        self._outputs: OrderedDict[str, array] = OrderedDict()  # request id -> its output, oldest first
        self._own: dict[str, tuple[Growing, int]] = {}  # request id -> its tree, and how many of its tokens it holds
        # request id -> its output so far, and the next start whose run the engine's tree does not count yet
        self._live: dict[str, tuple[array, int]] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int, num_prompt_tokens: int) -> list[int]:
        """Up to `k` draft tokens after `token_ids` (the request's prompt and output so far; its prompt the first
        `num_prompt_tokens`)."""
        return self.propose_tree(request_id, token_ids, k, num_prompt_tokens, 1)[0]

    def propose_tree(
        self, request_id: str, token_ids: list[int], k: int, num_prompt_tokens: int, width: int
    ) -> tuple[list[int], list[int]]:
        """`propose`'s draft as a tree of up to `k` nodes, `width` children a node (`SuffixTree.speculate_tree`):
        its tokens and their parents."""
        grown, held = self._own.get(request_id) or (Growing(self.depth), max(0, len(token_ids) - WINDOW))
        grown.extend(token_ids[held:])
        self._own[request_id] = (grown, len(token_ids))
        if self.max_cached:  # its output's complete runs, in the engine's tree while it runs
            output, start = self._live.get(request_id) or (array("l"), 0)
            output.extend(token_ids[num_prompt_tokens + len(output) :])
            while start + self.depth <= len(output):
                self.cached.insert(output, start, self.depth)
                start += 1
            self._live[request_id] = (output, start)
        context = token_ids[-self.depth :]
        if width == 1:
            own, own_score = grown.tree.speculate(context, k, self.factor, self.min_prob)
            other, other_score = self.cached.speculate(context, k, self.factor, self.min_prob)
            best = other if other_score > own_score else own
            return best, list(range(-1, len(best) - 1))
        *own, own_score = grown.tree.speculate_tree(context, k, self.factor, self.min_prob, width)
        *other, other_score = self.cached.speculate_tree(context, k, self.factor, self.min_prob, width)
        return tuple(other) if other_score > own_score else tuple(own)

    def finish(self, request_id: str, output_ids: list[int]) -> None:
        """The request is done: its tree goes, its output joins the cached ones, every run of it counted (the oldest
        let go past the limit)."""
        self._own.pop(request_id, None)
        live, start = self._live.pop(request_id, (None, 0))
        if self.max_cached == 0:
            return
        again = self._outputs.pop(request_id, None)  # (an id used before: its earlier output goes)
        if again is not None:
            self.cached.remove(again)
        output = array("l", output_ids)
        if live is not None and live != output[: len(live)]:  # (not what it wrote as it ran: those runs go)
            for s in range(start):
                self.cached.take(live[s : s + self.depth])
            start = 0
        for s in range(start, len(output)):  # the runs not counted yet: the latest starts', to the output's end
            self.cached.insert(output, s, min(self.depth, len(output) - s))
        if output:
            self._outputs[request_id] = output
        while len(self._outputs) > self.max_cached:
            _, old = self._outputs.popitem(last=False)
            self.cached.remove(old)
