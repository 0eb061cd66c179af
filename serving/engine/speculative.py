"""Speculative decoding: draft tokens by n-gram prompt lookup, verified in the step's one forward pass.

A decode that speculates computes its last token and `k` draft tokens in one step; the model's logits at those
1 + k positions say which drafts it would have produced itself. Accepted drafts and one more token (the model's own
at the first mismatch, or after the last draft) all come out of that one step, and the KV the step wrote for the
accepted drafts is kept (the rejected ones' is overwritten later: the request's computed length never covers it).

Acceptance is the standard rule (Leviathan et al. 2023; Chen et al. 2023) for a draft that is one token, not a
distribution (prompt lookup proposes exactly one continuation, q(d) = 1): greedy rows accept a draft while it is the
argmax, so their output is token for token what plain decoding gives; sampled rows accept draft d with probability
p(d) under the request's own filtered distribution (temperature, top-k, top-p) and on a rejection draw from p with d
removed, which leaves every token's probability exactly p (docs/serving.md, "Speculative decoding").

When to speculate is measured, not guessed (`SpecPolicy`): verification turns a step of B decodes into one of
B x (1 + k) tokens, which costs little while a step is bound by reading the weights and a lot once it is bound by
compute. The engine keeps the wall time of its steps by tokens computed and the acceptance rate it sees, proposes
the step's drafts (D in all, for B decodes), and speculates only while (B + rate x D) x T(B) > B x T(B + D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pylon.serving.engine.sampling import SamplingParams, filtered_probs

if TYPE_CHECKING:
    import torch

WINDOW = 4096  # how far back in a request's tokens prompt lookup searches
EXPLORE_EVERY = 50  # steps: re-measure the road not taken, as loads change


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


def verify(
    rows: "torch.Tensor", draft: list[int], params: SamplingParams, generator: "torch.Generator | None"
) -> tuple[list[int], int]:
    """The tokens a speculating step emits for one request, and how many of them are accepted drafts. `rows`: the
    logits at the request's last known token and at each draft ([1 + len(draft), vocab]); row i scores the token
    after position i, so draft[i] is checked against row i."""
    import torch

    if params.greedy:
        best = rows.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(draft):
            if d != best[i]:
                return out + [best[i]], i
            out.append(d)
        return out + [best[len(draft)]], len(draft)
    probs = filtered_probs(rows, [params] * rows.shape[0])
    out = []
    for i, d in enumerate(draft):
        p = probs[i]
        if torch.rand((), generator=generator).item() < p[d].item():
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        if residual.sum() <= 0:  # p was all on d: (cannot happen after a rejection, but never divide by 0)
            return out + [d], i
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))], i
    return out + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))], len(draft)


def _average(times: dict[int, float], bucket: int, seconds: float) -> None:
    """An exponential average of `seconds` into `times[bucket]`."""
    old = times.get(bucket)
    times[bucket] = seconds if old is None else 0.8 * old + 0.2 * seconds


def _bucket(tokens: int) -> int:
    """Step sizes grouped 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: steps this close cost alike."""
    if tokens <= 4:
        return tokens
    power = 1 << (tokens.bit_length() - 1)
    return power if tokens < power * 3 // 2 else power * 3 // 2


@dataclass
class SpecPolicy:
    """Whether this step's decodes should speculate, from what the engine measured: each step's wall time by the
    tokens it computed (an exponential average per size bucket) and the drafts accepted per draft proposed."""

    k: int
    times: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per step
    # A draft model's proposing, by the decodes it proposed for (bucket): seconds, apart from the model's step, and
    # only from proposals that fed each request at most a step's tokens (a prompt's catch-up is not what a step costs).
    draft_times: dict[int, float] = field(default_factory=dict)
    accept_rate: float = 0.6  # accepted / proposed; a prior until drafts have been verified
    steps: int = 0
    proposed_total: int = 0
    accepted_total: int = 0
    verified_total: int = 0  # requests' speculating steps
    speculated_steps_total: int = 0
    skipped_steps_total: int = 0  # steps where the rule said no
    _step_proposed: int = 0
    _step_accepted: int = 0

    def observe_step(self, tokens: int, seconds: float) -> None:
        _average(self.times, _bucket(tokens), seconds)

    def observe_drafts(self, proposed: int, accepted: int) -> None:
        """One request's verification (its share of `observe_step`'s step)."""
        self.proposed_total += proposed
        self.accepted_total += accepted
        self.verified_total += 1
        self._step_proposed += proposed
        self._step_accepted += accepted

    def observe_draft(self, drafting: int, seconds: float) -> None:
        """A draft model proposed for `drafting` decodes in `seconds` (k passes, none of them a long catch-up)."""
        _average(self.draft_times, _bucket(drafting), seconds)

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step is done: `tokens` computed in `seconds` of the engine's step (verifying included; a draft model's
        proposing is not: it is timed apart, `observe_draft`)."""
        self.observe_step(tokens, seconds)
        if self._step_proposed:
            self.accept_rate = 0.7 * self.accept_rate + 0.3 * (self._step_accepted / self._step_proposed)
        self._step_proposed = self._step_accepted = 0

    def decide(self, decodes: int, drafts: int, other_tokens: int, *, drafting: int | None = None) -> bool:
        """Speculate in a step of `decodes` decodes holding `drafts` draft tokens among them, next to
        `other_tokens` prompt tokens? Yes while the tokens it is expected to emit per second, (decodes +
        rate x drafts) / T(with drafts), beat decodes / T(without), by the measured step times. `drafting`: the
        decodes a draft model would propose for; T(with drafts) then also counts its proposing, as measured."""
        self.steps += 1
        if decodes == 0 or drafts == 0:
            return False
        plain = self.times.get(_bucket(decodes + other_tokens))
        spec = self.times.get(_bucket(decodes + drafts + other_tokens))
        if drafting is not None and spec is not None:
            proposing = self.draft_times.get(_bucket(drafting))
            spec = None if proposing is None else spec + proposing
        if plain is None or spec is None:
            yes = spec is None  # measure the side not measured yet (a plain step is also any step without drafts)
        else:
            yes = (decodes + self.accept_rate * drafts) * plain > decodes * spec
            if self.steps % EXPLORE_EVERY == 0:
                yes = not yes  # now and then the other side, whose time may have changed with the load
        if yes:
            self.speculated_steps_total += 1
        else:
            self.skipped_steps_total += 1
        return yes

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating request emitted per step on average (accepted drafts + the one sampled)."""
        return 1 + self.accepted_total / self.verified_total if self.verified_total else math.nan
