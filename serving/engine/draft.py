"""Speculative decoding's second source: draft tokens from a smaller model (`engine.speculative.method: draft`).

The draft model is a model directory of its own (a smaller Pylon export, or any Hugging Face model the engine
serves) with the target's tokenizer. It runs on the engine's device in its own `ModelRunner`, with its own paged KV
cache (`KVBlockPool`, no prefix caching): a speculating step first brings each request's draft cache up to the
request's tokens (the prompt the first time, then the tokens the last verification emitted), which also gives the
first draft token, then feeds each draft back for the next, `k - 1` more one-token steps, all requests batched in
each. Drafts are the draft model's greedy choices, one token each (q(d) = 1), so the target verifies them by the
same rule as prompt lookup's (`speculative.verify`): greedy outputs stay token for token the target's own and
sampled ones keep their distribution, whatever the draft model says.

The draft cache never counts a draft as computed: a rejected draft's keys and values are overwritten when the
request's real token at that position is fed, and an accepted one's are computed again then (one token's worth of
the small model, for a much simpler cache). A request's draft cache is freed when it finishes.

Each of the draft model's passes is timed (`StepCosts`, as the engine's own steps), so that `estimate` can tell the
speculation rule what proposing for a step's decodes will cost before it is done, catch-up included (a large
catch-up pass of a size not seen is priced per token, as the large ones measured).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pylon.errors import PylonError
from pylon.serving.engine.kv_cache import KVBlockPool
from pylon.serving.engine.speculative import StepCosts
from pylon.serving.model.step import StepSequence

LARGE_PASS = 64  # tokens: a catch-up pass at least this large costs about its tokens' arithmetic
_SCRATCH = "\x00pylon-draft-warm-up"  # the pricing pass's cache (no request id starts with a NUL)

# Text whose tokens the draft's and the target's tokenizers must agree on (besides vocabulary size and eos).
TOKENIZER_PROBE = 'def main(argv):\n    return {"naïve": [1, 2.5e-3], "日本語": None}  # Größe, ñ, 🙂\n'


@dataclass
class DraftRequest:
    """One decode to draft for: its tokens so far and how many drafts it has room for."""

    request_id: str
    token_ids: list[int]
    room: int


class DraftModel:
    """Proposes `k` tokens per decode from a smaller model, batched over the step's decodes."""

    def __init__(
        self,
        directory: str,
        *,
        where: str,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        kv_cache_tokens: int,
        block_size: int,
        max_num_batched_tokens: int,
        device: str,
        dtype: str,
    ) -> None:
        """`directory`: the draft model's local directory (`where` names it in errors: the spec's field and URI);
        `tokenizer` and `vocab_size`: the model's, which the draft model's must equal; `kv_cache_tokens`: the draft
        cache's size."""
        from pylon.serving.engine.tokenization import load_model_tokenizer
        from pylon.serving.model.runner import ModelRunner

        _check_same_tokenizer(load_model_tokenizer(directory), tokenizer, where)
        self.pool = KVBlockPool.for_tokens(kv_cache_tokens, block_size)
        self.runner = ModelRunner(
            directory, num_blocks=self.pool.num_blocks, block_size=block_size, device=device, dtype=dtype
        )
        if self.runner.recurrent:  # its proposals run ahead of the target's tokens, and a state cannot take one back
            raise PylonError(
                f"{where}: a draft model with recurrent layers is not served (its states cannot take back the drafts "
                "the target rejects); use a draft model of attention layers, or engine.speculative.method: ngram"
            )
        if self.runner.vocab_size != vocab_size:
            raise PylonError(
                f"{where}: its output layer scores {self.runner.vocab_size} tokens, the model's {vocab_size}; a "
                "draft model must share the served model's vocabulary"
            )
        if self.runner.max_position_embeddings < max_model_len:
            raise PylonError(
                f"{where}: the draft model attends over {self.runner.max_position_embeddings} positions, fewer than "
                f"the engine's max_model_len ({max_model_len}); lower engine.max_model_len or use a draft model "
                "with a longer position table"
            )
        self.budget = max_num_batched_tokens  # tokens per catch-up step, as the target's steps
        self._computed: dict[str, int] = {}  # request id -> its tokens whose keys and values the draft cache holds
        self.forward_passes = 0  # the draft model's steps (a machine-independent counter for benchmarks)
        self.costs = PassCosts()  # its passes' wall times, and per token of its large (catch-up) ones

    def warm_up(self, max_num_seqs: int) -> None:
        self.runner.warm_up(max_num_seqs, self.budget)
        self._price_large_passes()

    def _price_large_passes(self) -> None:
        """Time a catch-up pass of the token budget (twice: the first pays for first calls) in a scratch cache, so
        that the rule can price a prompt's catch-up before the draft model has proposed anything."""
        if self.budget < LARGE_PASS or not self.pool.allocate(_SCRATCH, self.budget):
            return
        try:
            step = StepSequence([0] * self.budget, 0, self.pool.block_table(_SCRATCH), True)
            for _ in range(2):
                started = time.perf_counter()
                self.runner.execute([step]).argmax(dim=-1).tolist()  # reading the token waits for the device
                self.costs.per_token = (time.perf_counter() - started) / self.budget
        finally:
            self.pool.free(_SCRATCH)

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's drafts (up to its `room`), by request id; a request the draft cache has no room for
        gets none this step."""
        ready = []
        for r in requests:
            # Slots up to the last draft fed back: the request's tokens and room - 1 drafts.
            if r.room > 0 and self._allocate(r.request_id, len(r.token_ids) + r.room - 1, requests):
                ready.append(r)
        if not ready:
            return {}
        drafts = {r.request_id: [t] for r, t in zip(ready, self._catch_up(ready))}
        for i in range(1, max(r.room for r in ready)):
            going = [r for r in ready if r.room > i]
            steps = [
                StepSequence([drafts[r.request_id][-1]], len(r.token_ids) + i - 1, self._table(r), True) for r in going
            ]
            for r, token in zip(going, self._pass(steps)):
                drafts[r.request_id].append(token)
        return drafts

    def estimate(self, requests: list[DraftRequest]) -> tuple[float | None, float]:
        """What `propose(requests)` would take, in seconds, by the passes measured so far: the catch-up on the tokens
        each request's draft cache lacks (after steps that did not speculate, many), then k - 1 one-token passes.
        Returns (that, or None while a pass of some size it needs was never measured; a floor: its passes that were)."""
        lag = sum(len(r.token_ids) - self._start(r) for r in requests)
        passes = math.ceil(lag / self.budget)
        sizes = [  # each request's first draft comes out of its last catch-up pass, taken as the last
            (min(self.budget, lag - i * self.budget), len(requests) if i == passes - 1 else 0) for i in range(passes)
        ]
        for i in range(1, max((r.room for r in requests), default=0)):
            going = sum(1 for r in requests if r.room > i)
            sizes.append((going, going))
        return price(sizes, self.costs)

    def _catch_up(self, ready: list[DraftRequest]) -> list[int]:
        """Feed each request's tokens the draft cache lacks (its last token at least, for its logits), in steps of
        at most `budget` tokens; returns each request's first draft, the argmax after its last token."""
        start = {r.request_id: self._start(r) for r in ready}
        first: dict[str, int] = {}
        while len(first) < len(ready):
            steps, fed, budget = [], [], self.budget
            for r in ready:
                at = start[r.request_id]
                if r.request_id in first or budget <= 0:
                    continue
                n = min(len(r.token_ids) - at, budget)
                steps.append(StepSequence(r.token_ids[at : at + n], at, self._table(r), at + n == len(r.token_ids)))
                fed.append(r)
                budget -= n
            rows = iter(self._pass(steps))
            for r, step in zip(fed, steps):
                start[r.request_id] += step.num_new_tokens
                if step.samples:
                    first[r.request_id] = next(rows)
                    self._computed[r.request_id] = len(r.token_ids)
        return [first[r.request_id] for r in ready]

    def _start(self, r: DraftRequest) -> int:
        """Where the request's catch-up starts: the tokens its draft cache lacks, and its last token at least, fed
        again even when cached, as the row that gives the first draft."""
        return min(self._computed.get(r.request_id, 0), len(r.token_ids) - 1)

    def _pass(self, steps: list[StepSequence]) -> list[int]:
        """One forward pass of the draft model: the argmax token of each sampling sequence, in order (reading them
        waits for the device, so the pass's time is all in)."""
        import torch

        started = time.perf_counter()
        logits = self.runner.execute(steps)
        tokens = torch.argmax(logits, dim=-1).tolist() if logits.numel() else []
        seconds = time.perf_counter() - started
        fed = sum(s.num_new_tokens for s in steps)
        self.costs.observe(fed, len(tokens), seconds)
        self.forward_passes += 1
        return [int(t) for t in tokens]

    def _table(self, r: DraftRequest) -> list[int]:
        return self.pool.block_table(r.request_id)

    def _allocate(self, request_id: str, tokens: int, step: list[DraftRequest]) -> bool:
        """Room for `tokens` of the request in the draft cache; when full, the caches of requests not drafting in
        this step (preempted or waiting in the target) are freed first."""
        if self.pool.allocate(request_id, tokens):
            return True
        drafting = {r.request_id for r in step}
        for other in [rid for rid in self._computed if rid not in drafting]:
            self.forget(other)
        return self.pool.allocate(request_id, tokens)

    def forget(self, request_id: str) -> None:
        """The request finished: free its draft cache."""
        self._computed.pop(request_id, None)
        self.pool.free(request_id)


class PassCosts(StepCosts):
    """A draft source's passes' wall times by size (`StepCosts`), and seconds per token of its large ones (a catch-up
    of many tokens is bound by its arithmetic: priced per token where its size was not measured)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_token: float | None = None

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        super().observe(tokens, rows, seconds)
        if tokens >= LARGE_PASS:
            now = seconds / tokens
            self.per_token = now if self.per_token is None else 0.8 * self.per_token + 0.2 * now


def price(sizes: list[tuple[int, int]], costs: PassCosts, small: Callable | None = None) -> tuple[float | None, float]:
    """What passes of `sizes` ((tokens, rows) each) take, in seconds, by the passes measured (`costs`): a large pass
    not measured at `costs.per_token` (its arithmetic), a small one by `small(tokens, rows)` where given. Returns
    (that, or None while some pass cannot be priced; a floor: the passes that can)."""
    known, floor = True, 0.0
    for tokens, rows in sizes:
        seconds = costs.measured(tokens, rows)
        if seconds is None and tokens >= LARGE_PASS and costs.per_token is not None:
            seconds = tokens * costs.per_token  # a pass this large is bound by its arithmetic: per token
        if seconds is None and tokens < LARGE_PASS and small is not None:
            seconds = small(tokens, rows)
        if seconds is None:
            known = False
        else:
            floor += seconds
    return (floor if known else None), floor


def _check_same_tokenizer(draft, target, where: str) -> None:
    """Drafts are token ids: the draft model must number tokens as the target does."""
    differ = []
    if draft.vocab_size != target.vocab_size:
        differ.append(f"vocabulary of {draft.vocab_size} tokens, the model's {target.vocab_size}")
    if draft.eos_id != target.eos_id:
        differ.append(f"end-of-text token {draft.eos_id}, the model's {target.eos_id}")
    if not differ and list(draft.encode(TOKENIZER_PROBE)) != list(target.encode(TOKENIZER_PROBE)):
        differ.append("it encodes text into other token ids")
    if differ:
        raise PylonError(
            f"{where}: its tokenizer is not the model's ({'; '.join(differ)}); a draft model must share the served "
            "model's tokenizer (train it with the same one, e.g. a smaller model of the same family)"
        )
