"""Suffix decoding (`engine.speculative.method: suffix`): drafts from what the request and earlier requests wrote.

Prompt lookup (`ngram`) drafts what followed the latest earlier occurrence of the request's last few tokens in its own
tokens. Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; vLLM's `suffix`, Arctic Inference's) looks in two
suffix trees of bounded depth and picks by frequency, not recency:

- the request's own: every run of up to `depth` tokens of its prompt and output, counted;
- the engine's: the same over the outputs of the last `max_cached_requests` requests that finished, so that what an
  agent, a tool loop or a templated workload wrote before (a tool call's JSON, a SQL query's shape, the same
  answer to the same question) drafts the next request's output, which its own prompt does not hold.

For each decode it finds the longest suffix of the request's tokens (up to `depth - 1`) that the tree holds, then
walks down it, each step to the child seen most often, the draft's probability the product of each child's share of
its parent's count; it stops where that falls below `min_token_prob`, after `max_spec_factor` x the match's length
tokens (a short match earns a short draft), or at `k`. Past the tree's depth it finds its place again from the
draft's own last tokens. Of the two trees' drafts it takes the one whose expected accepted length (the sum of its
probabilities) is larger. The drafts are verified as any others are (speculative.py): outputs are the model's.
"""

from __future__ import annotations

import math
from collections import OrderedDict

WINDOW = 4096  # a request's tokens its own tree is built from at first (its latest), as prompt lookup searches


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counts of every run of up to `depth` tokens in the sequences added (a trie of their suffixes, cut at `depth`).
    `extend` continues a sequence token by token (its open suffixes kept), `remove` takes a whole sequence out."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self._open: dict[object, list[_Node]] = {}  # a sequence being extended -> its open suffixes' nodes

    def extend(self, key: object, tokens: list[int]) -> None:
        """Append `tokens` to the sequence `key` (a new one if unknown): every run ending at each of them, counted."""
        open_ = self._open.get(key) or [self.root]
        for t in tokens:
            moved = [self.root]
            for node in open_:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                moved.append(child)
            open_ = moved[: self.depth]  # (a run of `depth` tokens extends no further)
        self._open[key] = open_

    def close(self, key: object) -> None:
        """The sequence `key` is complete: its open suffixes are let go (its counts stay)."""
        self._open.pop(key, None)

    def remove(self, tokens: list[int]) -> None:
        """Take back what `extend` counted for the whole sequence `tokens`, dropping the nodes that reach 0."""
        for start in range(len(tokens)):
            node, path = self.root, []
            for t in tokens[start : start + self.depth]:
                child = node.children[t]
                path.append((node, t, child))
                node = child
            for parent, t, child in path:
                child.count -= 1
                if child.count == 0:
                    del parent.children[t]
                    break  # (its subtree goes with it: its counts could not exceed its own)

    def match(self, context: list[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (up to depth - 1 tokens) that the tree holds with something
        after it, and its length; (None, 0) if none. (A request's own tree holds its latest tokens, never continued:
        an earlier occurrence is what drafts.)"""
        for n in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - n :]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children:
                    return node, n
        return None, 0

    def speculate(self, context: list[int], k: int, max_spec_factor: float, min_token_prob: float):
        """A draft continuing `context`: (tokens, their expected accepted length), see the module's docstring."""
        node, matched = self.match(context)
        if node is None:
            return [], 0.0
        limit = min(k, max(1, math.floor(max_spec_factor * matched)))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if not node.children:  # the tree's depth, or a run's end: its place again, from the latest tokens
                node, matched = self.match(context[len(context) - self.depth :] + draft)
                if node is None:
                    break
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / max(node.count, sum(c.count for c in node.children.values()))
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


class SuffixDecoding:
    """The engine's suffix drafter: each running request's tree, and the tree of recently finished outputs."""

    def __init__(self, depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float) -> None:
        self.depth, self.max_cached = depth, max_cached_requests
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.cached = SuffixTree(depth)  # the finished outputs'
        self._outputs: OrderedDict[str, list[int]] = OrderedDict()  # request id -> its output, oldest first
        self._own: dict[str, tuple[SuffixTree, int]] = {}  # request id -> its tree, and how many tokens it holds

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens after `token_ids` (the request's prompt and output so far)."""
        tree, held = self._own.get(request_id) or (SuffixTree(self.depth), max(0, len(token_ids) - WINDOW))
        tree.extend(request_id, token_ids[held:])
        self._own[request_id] = (tree, len(token_ids))
        context = token_ids[-self.depth :]
        own, own_score = tree.speculate(context, k, self.factor, self.min_prob)
        other, other_score = self.cached.speculate(context, k, self.factor, self.min_prob)
        return other if other_score > own_score else own

    def finish(self, request_id: str, output_ids: list[int]) -> None:
        """The request is done: its tree goes, its output joins the cached ones (the oldest let go past the limit)."""
        self._own.pop(request_id, None)
        if self.max_cached == 0 or not output_ids:
            return
        again = self._outputs.pop(request_id, None)  # (an id used before: its earlier output goes)
        if again is not None:
            self.cached.remove(again)
        key = ("output", request_id)
        self.cached.extend(key, output_ids)
        self.cached.close(key)
        self._outputs[request_id] = list(output_ids)
        while len(self._outputs) > self.max_cached:
            _, old = self._outputs.popitem(last=False)
            self.cached.remove(old)
