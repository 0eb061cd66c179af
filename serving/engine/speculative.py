"""Speculative decoding: draft tokens by n-gram prompt lookup, verified in the step's one forward pass.

A decode that speculates computes its last token and `k` draft tokens in one step; the model's logits at those
1 + k positions say which drafts it would have produced itself. Accepted drafts and one more token (the model's own
at the first mismatch, or after the last draft) all come out of that one step, and the KV the step wrote for the
accepted drafts is kept (the rejected ones' is overwritten later: the request's computed length never covers it).

Acceptance, for a draft that is one token, not a distribution (prompt lookup proposes exactly one continuation, and
a draft model its argmax: q(d) = 1): greedy rows accept a draft while it is the argmax, so their output is token for
token what plain decoding gives; a sampled row draws its token exactly as the sampler would (the request's filtered
distribution: temperature, top-k, min-p, top-p; the next draw from the request's own random stream) and accepts the
draft while it is that token. That is the standard rule (Leviathan et al. 2023; Chen et al. 2023) coupled to the
sampler: d is accepted with probability p(d), and the token emitted is always p's own draw, so every token keeps
exactly the distribution p, each emitted token takes one draw from the stream as a plain step's does, and a seeded
request gives the same tokens whether or when its steps speculate (docs/serving.md, "Speculative decoding").

Draft trees (`engine.speculative.tree_width`): prompt lookup's and suffix decoding's drafts may branch. `best_first`
grows a tree likeliest first and lists it in pre-order (its first nodes the one path width 1 drafts); the runner
computes each node at its parent's position + 1 attending to its ancestors only; `verify_tree` walks down from the
decoded token, the token the model takes at each node (argmax, or the sampler's draw: one draw per emitted token)
accepted while a child of the node is that token, so the same two properties hold: greedy output is plain decoding's
and a sampled token keeps p's distribution and the request's stream.

When to speculate is measured, not guessed (`SpecPolicy`): verification turns a step of B decodes into one of
B x (1 + k) tokens, which costs little while a step is bound by reading the weights and a lot once it is bound by
compute. The engine keeps the wall time of its steps by size (`StepCosts`) and the acceptance rate it sees, proposes
the step's drafts (D in all, for B decodes), and speculates only while (B + rate x D) x T(B) > B x (T(B + D) + P),
P being a draft model's proposing as its own measured passes predict it (catch-up included; 0 for prompt lookup):
while the acceptance rate beats the break-even rate measured at that batch size, or inferred from other sizes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pylon.serving.engine.sampling import SamplingParams, draw, sampling_distributions

if TYPE_CHECKING:
    import torch

WINDOW = 4096  # how far back in a request's tokens prompt lookup searches
EXPLORE_EVERY = 50  # steps: re-measure the road not taken, as loads change, while the choice is close...
EXPLORE_CLOSE = 1.25  # ...within this factor of break-even
EXPLORE_FAR_EVERY = 500  # steps: ...and this seldom when it is not (at a large batch, a speculating step is dear)
BUDGET = 0.03  # of the engine's time: what speculating steps taken to measure or explore may lose in all
ACCEPT_MEMORY = 24  # drafts: the acceptance rate's memory (a step's verified drafts move it by 1 - (1 - 1/24)^drafts)


def ngram_propose(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of `token_ids`, for the
    longest n in [n_min, n_max] that occurs (vLLM's prompt lookup); [] when none does."""
    total = len(token_ids)
    start = max(0, total - WINDOW)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = token_ids[total - n :]
        first = suffix[0]
        # The latest occurrence before the suffix itself, scanning back; one so late that fewer than k tokens follow
        # it (a loop shorter than k) is kept only until an earlier one with k is found.
        best: list[int] = []
        i = total - n - 1
        while i >= start:
            if token_ids[i] == first and token_ids[i : i + n] == suffix:
                follow = token_ids[i + n : i + n + k]
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):
                    best = follow
            i -= 1
        if best:
            return best
    return []


MAX_OCCURRENCES = 32  # earlier occurrences of the matched suffix a prompt-lookup draft tree is built from


def best_first(roots: list, expand, k: int, width: int, min_prob: float = 0.0) -> tuple[list[int], list[int], float]:
    """A draft tree of up to `k` nodes, grown likeliest first (EAGLE-2's and Arctic Inference's rule): a node's
    probability is the product of its and its ancestors' shares; the likeliest node not yet taken whose parent is
    taken joins next, each node taking at most `width` children, none below `min_prob`. `roots`: the first tokens'
    `(token, share, state)` and `expand(state)` a taken node's, each list likeliest first. Returns the tokens and
    their parents (-1: after the last known token) in pre-order, each node's children likeliest first (so that the
    first nodes are one path, the likeliest child's each time: what `width` 1 drafts), and the sum of the nodes'
    probabilities (the expected accepted tokens)."""
    heap: list = []
    order = 0
    for token, share, state in roots[:width]:
        if share >= min_prob:
            heap.append((-share, order, -1, token, state))
            order += 1
    heapq.heapify(heap)
    taken: list[tuple[int, int, float]] = []  # (parent, token, probability) in the order taken
    while heap and len(taken) < k:
        neg, _, parent, token, state = heapq.heappop(heap)
        index = len(taken)
        taken.append((parent, token, -neg))
        for child_token, share, child_state in expand(state)[:width]:
            prob = -neg * share
            if prob >= min_prob and prob > 0:
                heapq.heappush(heap, (-prob, order, index, child_token, child_state))
                order += 1
    children: dict[int, list[int]] = {}
    for index, (parent, _, _) in enumerate(taken):  # (taken likeliest first: each list is)
        children.setdefault(parent, []).append(index)
    tokens, parents, stack = [], [], [(c, -1) for c in reversed(children.get(-1, []))]
    while stack:  # pre-order
        index, parent = stack.pop()
        tokens.append(taken[index][1])
        parents.append(parent)
        here = len(tokens) - 1
        stack.extend((c, here) for c in reversed(children.get(index, [])))
    return tokens, parents, sum(p for _, _, p in taken)


def chain_length(parents: list[int]) -> int:
    """How many of a draft tree's first nodes are one path (each the child of the one before)."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def ngram_tree(token_ids: list[int], k: int, n_max: int, n_min: int, width: int) -> tuple[list[int], list[int]]:
    """Prompt lookup's draft tree: what followed each of the latest `MAX_OCCURRENCES` earlier occurrences of the last
    n tokens of `token_ids` (the longest n in [n_min, n_max] that occurs), up to `k` tokens each, merged into a trie;
    a continuation's share is how many of the occurrences that reach its parent go on with it (the latest first among
    equals). Up to `k` nodes, `width` children a node (`best_first`); ([], []) when nothing occurs."""
    total = len(token_ids)
    start = max(0, total - WINDOW)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = token_ids[total - n :]
        first = suffix[0]
        # trie node: [count, children {token: node}] (dicts keep the order seen: the latest occurrence's first)
        root: list = [0, {}]
        found = 0
        firsts, i = [], start  # where the suffix's first token is, before the suffix itself (list.index: C's speed)
        while True:
            try:
                i = token_ids.index(first, i, total - n)
            except ValueError:
                break
            firsts.append(i)
            i += 1
        for i in reversed(firsts):
            if token_ids[i : i + n] == suffix:
                follow = token_ids[i + n : i + n + k]
                found += 1
                node = root
                node[0] += 1
                for t in follow:
                    node = node[1].setdefault(t, [0, {}])
                    node[0] += 1
                if found == MAX_OCCURRENCES:
                    break
        if not found:
            continue

        def expand(node: list) -> list:
            ranked = sorted(node[1].items(), key=lambda item: -item[1][0])  # (stable: the latest first among equals)
            return [(t, child[0] / node[0], child) for t, child in ranked]

        tokens, parents, _ = best_first(expand(root), expand, k, width)
        return tokens, parents
    return [], []


def verify_tree(
    rows: "torch.Tensor",
    draft: list[int],
    parents: list[int],
    params: SamplingParams,
    generator: "torch.Generator | None",
) -> tuple[list[int], list[int]]:
    """`verify` for a draft tree (`best_first`'s form): the tokens the step emits, and the accepted nodes (one path
    from the root). `rows`: the logits at the last known token and at each node ([1 + len(draft), vocab]); row
    1 + i scores what follows node i. From the last known token down: the token the model takes there (its argmax,
    or the sampler's draw from the request's stream, one draw per token emitted), accepted while a child of the node
    is that token. Every emitted token is the model's own choice, so greedy outputs are plain decoding's and sampled
    ones keep its distribution, whatever the tree holds."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(draft, parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    if params.greedy:
        best = rows.argmax(dim=-1).tolist()
        pick = lambda node: best[node + 1]  # noqa: E731
    else:
        probs, sorted_ids = sampling_distributions(rows, [params] * rows.shape[0])
        pick = lambda node: draw(probs[node + 1], sorted_ids[node + 1], generator)  # noqa: E731
    emitted, path, node = [], [], -1
    while True:
        token = pick(node)
        emitted.append(token)
        child = children.get(node, {}).get(token)
        if child is None:
            return emitted, path
        path.append(child)
        node = child


def verify(
    rows: "torch.Tensor", draft: list[int], params: SamplingParams, generator: "torch.Generator | None"
) -> tuple[list[int], int]:
    """The tokens a speculating step emits for one request, and how many of them are accepted drafts. `rows`: the
    logits at the request's last known token and at each draft ([1 + len(draft), vocab]); row i scores the token
    after position i, so draft[i] is checked against row i."""
    if params.greedy:
        best = rows.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(draft):
            if d != best[i]:
                return out + [best[i]], i
            out.append(d)
        return out + [best[len(draft)]], len(draft)
    # Row by row, the token the sampler itself would draw there (the same draw from the request's stream); a draft
    # is accepted while it is that token.
    probs, sorted_ids = sampling_distributions(rows, [params] * rows.shape[0])
    out = []
    for i, d in enumerate(draft):
        token = draw(probs[i], sorted_ids[i], generator)
        if token != d:
            return out + [token], i
        out.append(token)
    return out + [draw(probs[len(draft)], sorted_ids[len(draft)], generator)], len(draft)


def _average(table: dict, key, value: float) -> None:
    """An exponential average of `value` into `table[key]`."""
    old = table.get(key)
    table[key] = value if old is None else 0.8 * old + 0.2 * value


def _bucket(tokens: int) -> int:
    """Step sizes grouped 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: steps this close cost alike."""
    if tokens <= 4:
        return tokens
    power = 1 << (tokens.bit_length() - 1)
    return power if tokens < power * 3 // 2 else power * 3 // 2


class StepCosts:
    """What a forward step costs, as measured: seconds (an exponential average) by the step's size bucket, the
    tokens it computes and the rows of logits it returns (a decode's row also costs the output layer, a prompt
    token's does not), and how many steps of that size were measured."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, int], float] = {}
        self.counts: dict[tuple[int, int], int] = {}

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        key = (_bucket(tokens), _bucket(rows))
        _average(self.times, key, seconds)
        self.counts[key] = self.counts.get(key, 0) + 1

    def measured(self, tokens: int, rows: int) -> float | None:
        return self.times.get((_bucket(tokens), _bucket(rows)))

    def count(self, tokens: int, rows: int) -> int:
        return self.counts.get((_bucket(tokens), _bucket(rows)), 0)


@dataclass
class SpecPolicy:
    """Whether this step's decodes should speculate, from what the engine measured: its steps' wall times
    (`StepCosts`), the drafts accepted per draft proposed, and from those the break-even acceptance rate per batch
    size (`breakeven`).

    A step of B decodes holding D drafts emits B + rate x D tokens in T(spec) + P (P: a draft model's proposing)
    where a plain step emits B in T(plain): speculating pays while rate > r = B x (T(spec) + P - T(plain)) /
    (D x T(plain)), the extra time per draft token relative to a plain step. Where both sizes were measured the rule
    compares them. Otherwise it uses r as measured in steps of decodes only, by batch size and drafts per decode:
    r does not fall as the batch grows (a larger step is nearer being bound by compute, where drafts cost their full
    share), so a size not measured yet is no where a smaller batch's r already exceeded the rate and yes where a
    larger one's was below it. A step that also computes prompt tokens is never a measurement (its sizes rarely
    repeat): it speculates only where steps of decodes alone say it pays at that batch, which holds a fortiori with
    the prompt's tokens beside.

    Trying costs: a speculating step that does not pay loses its time over what its tokens were worth. Steps taken
    to measure (or to look again at the road not taken) are allowed only while what speculation lost in all is at
    most `BUDGET` of the engine's time, so that measuring never makes the engine much slower than plain decoding,
    even at a large batch on a device bound by compute, where each such step is dear."""

    k: int
    costs: StepCosts = field(default_factory=StepCosts)
    # (decodes bucket, drafts per decode) -> r, as measured in steps of decodes only (averaged)
    breakeven: dict[tuple[int, int], float] = field(default_factory=dict)
    accept_rate: float = 0.6  # accepted / proposed; a prior until drafts have been verified
    steps: int = 0
    proposed_total: int = 0
    accepted_total: int = 0
    verified_total: int = 0  # requests' speculating steps
    # Per draft position (vLLM's spec_decode num_accepted_tokens_per_pos): drafts verified and accepted at position i
    # of a request's drafts; where acceptance falls with the position, fewer num_tokens cost less for the same tokens.
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    speculated_steps_total: int = 0
    skipped_steps_total: int = 0  # steps where the rule said no
    seconds_total: float = 0.0  # the engine's steps, proposing included
    _step_proposed: int = 0
    _step_accepted: int = 0
    _tried: dict[tuple[int, int], int] = field(default_factory=dict)  # (decodes bucket, per) -> speculating steps
    _speculating: tuple[int, int] | None = None  # this step's (decodes, other tokens), when it speculates
    _lost: float = 0.0  # settled: see `lost_seconds`
    _unsettled: list[tuple[int, int, float, int]] = field(default_factory=list)  # (decodes, other, seconds, accepted)

    def observe_step(self, tokens: int, rows: int, seconds: float) -> None:
        self.costs.observe(tokens, rows, seconds)

    def observe_drafts(self, proposed: int, accepted: int, depth: int | None = None) -> None:
        """One request's verification (its share of `observe_step`'s step). A draft tree's `depth` (its deepest
        node's): its positions verified, each by one node or more."""
        self.proposed_total += proposed
        self.accepted_total += accepted
        verified = proposed if depth is None else depth
        for counts, n in ((self.proposed_by_position, verified), (self.accepted_by_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1
        self.verified_total += 1
        self._step_proposed += proposed
        self._step_accepted += accepted

    def end_step(self, tokens: int, rows: int, seconds: float, proposing: float = 0.0) -> None:
        """A step is done: `tokens` computed, `rows` rows of logits returned, in `seconds` of the engine's step
        (verifying included), after `proposing` seconds of a draft model's (timed apart: `DraftModel`)."""
        spent = seconds + proposing
        self.seconds_total += spent
        if self._speculating is not None:
            decodes, other = self._speculating
            if not other:  # (beside a prompt's tokens it speculates only where decode-only steps gain: no trial)
                self._unsettled.append((decodes, other, spent, self._step_accepted))
            self._speculating = None
        self.observe_step(tokens, rows, seconds)
        self._settle()
        if self._step_proposed:  # weighed by the drafts verified: 3 drafts say less than 96 do
            weight = 1.0 - (1.0 - 1.0 / ACCEPT_MEMORY) ** self._step_proposed
            self.accept_rate += weight * (self._step_accepted / self._step_proposed - self.accept_rate)
        self._step_proposed = self._step_accepted = 0

    def decide(
        self, decodes: int, drafts: int, other_tokens: int, *, proposing: float | None = 0.0, floor: float = 0.0
    ) -> bool:
        """Speculate in a step of `decodes` decodes holding `drafts` draft tokens among them, next to
        `other_tokens` prompt tokens? `proposing`: a draft model's seconds to propose the drafts, as its measured
        passes predict them (None: not predictable yet); `floor`: seconds it takes at least (its passes that
        were measured)."""
        self.steps += 1
        self._speculating = None
        if decodes == 0 or drafts == 0:
            return False
        key = (_bucket(decodes), max(1, round(drafts / decodes)))
        yes = self._decide(key, decodes, drafts, other_tokens, proposing, floor)
        if yes:
            self._tried[key] = self._tried.get(key, 0) + 1
            self._speculating = (decodes, other_tokens)
            self.speculated_steps_total += 1
        else:
            self.skipped_steps_total += 1
        return yes

    def _settle(self) -> None:
        """What speculating steps lost: each one's time over what its tokens were worth, (1 + accepted / B) plain
        steps of its size; one whose plain size was not measured yet counts its whole time until it is."""
        left = []
        for decodes, other, spent, accepted in self._unsettled:
            plain = self.costs.measured(decodes + other, decodes)
            if plain is None:
                left.append((decodes, other, spent, accepted))
            else:
                self._lost = max(0.0, self._lost + spent - (1 + accepted / decodes) * plain)
        for _, _, spent, _ in left[:-64]:  # never settled: lost
            self._lost += spent
        self._unsettled = left[-64:]

    @property
    def lost_seconds(self) -> float:
        """Speculating steps' time over what their tokens were worth at plain steps' pace (net of the gains)."""
        return self._lost + sum(spent for _, _, spent, _ in self._unsettled)

    @property
    def may_try(self) -> bool:
        """Within the budget for speculating steps that may not pay (measuring, exploring)."""
        return self.lost_seconds <= BUDGET * self.seconds_total

    def _decide(
        self, key: tuple[int, int], decodes: int, drafts: int, other: int, proposing: float | None, floor: float
    ) -> bool:
        bucket, per = key  # per: drafts per decode (a step's fixed cost of speculating is shared by them)
        plain = self.costs.measured(decodes + other, decodes)
        spec = self.costs.measured(decodes + drafts + other, decodes + drafts)
        measured = plain is not None and spec is not None and proposing is not None
        r = decodes * (spec + proposing - plain) / (drafts * plain) if measured else None
        if r is not None and other == 0:
            _average(self.breakeven, key, r)
            r = self.breakeven[key]
        elif r is None:
            r = self.breakeven.get(key)
        # r does not fall as the batch grows: a smaller batch that did not gain says no, a larger one that did, yes.
        # Without a draft model r does not grow with the drafts per decode either (a speculating step's fixed cost is
        # shared by them): more drafts a decode that did not gain say no for fewer, fewer that did say yes for more.
        # (A draft model's passes grow with its drafts per decode: there, only the same count says anything.)
        across = proposing == 0.0
        smaller = [
            v
            for (b, p), v in self.breakeven.items()
            if (b, p) != key and b <= bucket and (p >= per if across else p == per)
        ]
        larger = [
            v
            for (b, p), v in self.breakeven.items()
            if (b, p) != key and b >= bucket and (p <= per if across else p == per)
        ]
        inferred_no = bool(smaller) and self.accept_rate <= max(smaller)
        if r is None:
            if inferred_no:
                return False
            if larger and self.accept_rate > min(larger):
                return True
            # Neither settles it: measure, in a step of decodes only and within the budget. The plain side first
            # (it costs nothing); then speculation, unless proposing alone already costs more than it could gain.
            if other or plain is None or not self.may_try:
                return False
            return self.accept_rate > decodes * floor / (drafts * plain)
        yes = self.accept_rate > r
        tried = max(self._tried.get(key, 0), self.costs.count(decodes + drafts + other, decodes + drafts))
        if not yes and not inferred_no and other == 0 and tried < 2 and self.may_try:
            return True  # one speculating step is not a measure to give up on (the first may pay for a warm-up)
        # Now and then the other side, whose time may have changed with the load: often while the choice is close,
        # seldom when it is far.
        close = r / EXPLORE_CLOSE < self.accept_rate < r * EXPLORE_CLOSE
        if self.steps % (EXPLORE_EVERY if close else EXPLORE_FAR_EVERY) == 0 and (yes or (self.may_try and not other)):
            yes = not yes
        return yes

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating request emitted per step on average (accepted drafts + the one sampled)."""
        return 1 + self.accepted_total / self.verified_total if self.verified_total else math.nan
