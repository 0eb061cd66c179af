"""Speculative decoding from the checkpoint's own multi-token-prediction layer (`engine.speculative.method: mtp`).

DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 ship a layer trained to predict the token after next from the model's
final hidden state and the next token's embedding (pylon.serving.model.mtp). Its KV cache is one more layer beside the
model's, in the model's own blocks: it has the model's number of blocks and reads the model's block tables, so a
prefix the model's cache shares (the prefix cache) carries the layer's keys and values with it, and no second pool is
kept.

The layer must see every position the model computed: for each position p (a prompt chunk's, a decode's and the
drafts it accepted) it reads h_p, which the model's runner kept for it (`ModelRunner.keep_hidden`), and the token at
p + 1, and writes its keys and values at p; where p + 1 is the request's last known token its output there scores
the token to come (the first draft). That catch-up is one decoder layer and no output layer, but a pass of its own:
taken every step, its fixed cost would weigh on every plain step too. So the engine hands the rows over after each
step (`advance`) and the layer holds them (copied: the step's tensor goes) until a step speculates, when it catches
up on the drafting requests' rows in one batched pass before proposing (`propose`); a request whose held rows reach
`HOLD` (a prompt chunk's at once) is caught up then, unasked, so that what is held stays small and a request the rule
never lets speculate costs a pass per `HOLD` tokens. The speculation rule prices that catch-up with the rest of the
proposing (`estimate`: every pass timed by size, as a draft model's).

A speculating step's first draft is the argmax of the output at the decode's last token (through the layer's norm and
the model's head), each next one the argmax after feeding the layer the draft before with its own last output in place
of h (Qwen's: after its norm), one one-token pass each (`num_tokens - 1`), at the positions the verification will
compute: the engine gives the model's table room for them first. Their keys and values are overwritten by the next
catch-up, which rewrites every position the model verified. The drafts are argmax choices (q(d) = 1) and verified by
the same rule as the others (pylon.serving.engine.speculative): greedy outputs stay token for token the model's, and
sampled ones keep their distribution, whatever the layer proposes.

A prefix the model's cache shares keeps the layer's entries of the request that computed it (written when its rows
were caught up, or not yet): where they differ from this request's (the next token after the prefix, rows not caught
up), drafts are worse, never outputs. A prefill engine's request (its blocks sent to another engine,
engine/kv_transfer.py) is caught up as it ends (`catch_up`), so that its blocks carry the layer's entries. A
preempted request's held rows are dropped (its positions are computed again).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pylon.serving.engine.draft import LARGE_PASS, DraftRequest, PassCosts, price
from pylon.serving.model.step import StepSequence

HOLD = 64  # rows a request's held hidden states may reach before the layer catches up on them unasked


@dataclass
class Computed:
    """What the model computed for one request in a step, that the layer catches up on: `hidden` (`[n, hidden]`, its
    final hidden states at positions start .. start + n - 1) and `next_ids`, the tokens at start + 1 .. start + n."""

    request_id: str
    start: int
    next_ids: list[int]
    hidden: object
    last: bool  # start + n is the request's last known token: the output there scores the token to come


class MtpDrafter:
    """Drafts from the multi-token-prediction layer's runner (`ModelRunner(mtp=...)`), its cache the model's blocks."""

    def __init__(self, runner, budget: int) -> None:
        """`budget`: tokens a catch-up pass takes at most (the engine's max_num_batched_tokens)."""
        self.runner = runner
        self.budget = budget
        self._held: dict[str, list[Computed]] = {}  # request id -> the rows not caught up yet, in order
        self._known: dict[str, int] = {}  # request id -> its last known token's position, where it can draft from
        self._outputs: dict[str, object] = {}  # request id -> the layer's output at the position before that
        self.forward_passes = 0  # the layer's passes (a machine-independent counter)
        self.costs = PassCosts()  # its passes' wall times, by (tokens, rows), and per token of its large ones
        self.catch_up_seconds = 0.0  # the last `advance`'s (a catch-up taken unasked)
        self._last_out = None  # the last chain pass's outputs (`_pass` with `head`)

    def advance(self, computed: list[Computed], table: Callable[[str], list[int]]) -> None:
        """Hold what the model's step computed (`table`: a request's block table); catch up on the requests whose held
        rows reached `HOLD`."""
        started = time.perf_counter()
        due = []
        for c in computed:
            held = self._held.setdefault(c.request_id, [])
            held.append(dataclasses.replace(c, hidden=c.hidden.clone()))
            self._outputs.pop(c.request_id, None)
            if c.last:
                self._known[c.request_id] = c.start + len(c.next_ids)
            else:
                self._known.pop(c.request_id, None)
            if sum(len(h.next_ids) for h in held) >= HOLD:
                due.append(c.request_id)
        if due:
            self._catch_up(due, table)
        self.catch_up_seconds = time.perf_counter() - started

    def catch_up(self, request_id: str, table: Callable[[str], list[int]]) -> None:
        """Catch up on everything held for the request now (a prefill engine's request, before its blocks go to another
        engine: so that they carry the layer's keys and values at every position, and its drafts there are right)."""
        if self._held.get(request_id):
            self._catch_up([request_id], table)

    def ready(self, request_id: str, num_tokens: int) -> bool:
        """Whether the layer can draft for the request: it has seen every position before its last known token."""
        return self._known.get(request_id) == num_tokens - 1

    def _catch_up(self, request_ids: list[str], table: Callable[[str], list[int]]) -> None:
        """Write the layer's keys and values at the requests' held rows, in passes of at most `budget` tokens, and keep
        each one's output at its last known token's position before (where its rows end there)."""
        import torch

        queue = []  # (request id, start, next ids, hidden, ends at the last known token), one a request
        for rid in request_ids:
            held = self._held.pop(rid, [])
            if held:
                ids = [t for h in held for t in h.next_ids]
                queue.append((rid, held[0].start, ids, torch.cat([h.hidden for h in held]), held[-1].last))
        while queue:
            steps, rows, fed, room = [], [], [], self.budget
            while queue and room > 0:
                rid, start, ids, hidden, last = queue.pop(0)
                n = min(len(ids), room)
                if n < len(ids):  # the rest in the next pass
                    queue.insert(0, (rid, start + n, ids[n:], hidden[n:], last))
                steps.append(StepSequence(ids[:n], start, table(rid), last and n == len(ids)))
                rows.append(hidden[:n])
                fed.append(rid)
                room -= n
            out = self._pass(steps, torch.cat(rows))
            outs = iter(out)
            for rid, step in zip(fed, steps):
                if step.samples:
                    self._outputs[rid] = next(outs)

    def estimate(self, requests: list[DraftRequest]) -> tuple[float | None, float]:
        """What `propose(requests)` would take, in seconds, by the passes measured so far: the catch-up on the rows
        held for them, the first drafts' output layer, then k - 1 one-token passes. Returns (that, or None while a pass
        of some size it needs was never measured; a floor: its passes that were)."""
        lag = [sum(len(h.next_ids) for h in self._held.get(r.request_id, ())) for r in requests]
        tokens, lagging = sum(lag), sum(1 for n in lag if n)
        passes = math.ceil(tokens / self.budget)
        sizes = [(min(self.budget, tokens - i * self.budget), lagging if i == passes - 1 else 0) for i in range(passes)]
        sizes.append((0, len(requests)))
        for i in range(1, max((r.room for r in requests), default=0)):
            going = sum(1 for r in requests if r.room > i)
            sizes.append((going, going))
        # (a small pass costs about what the nearest one measured did)
        return price(sizes, self.costs, small=self._nearest)

    def _nearest(self, tokens: int, rows: int) -> float | None:
        """The time of the measured small pass nearest in size to (tokens, rows), the larger of two as near: a pass of
        a few tokens is bound by its fixed costs (a layer's launches, the attention's metadata), not its arithmetic."""
        near = [
            (abs(n - tokens) + abs(r - rows), -n, seconds)
            for (n, r), seconds in self.costs.times.items()
            if n < LARGE_PASS and (n == 0) == (tokens == 0)
        ]
        return min(near)[2] if near else None

    def propose(self, requests: list[DraftRequest], tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Each request's drafts (up to its `room`; those `ready` only), by request id; `tables`: each one's block
        table in the model's pool, with room for its tokens and its drafts but the last."""
        import torch

        ready = [r for r in requests if r.room > 0 and self.ready(r.request_id, len(r.token_ids))]
        lagging = [r.request_id for r in ready if r.request_id in self._held]
        if lagging:
            self._catch_up(lagging, tables.__getitem__)
        ready = [r for r in ready if r.request_id in self._outputs]
        if not ready:
            return {}
        started = time.perf_counter()
        out = torch.stack([self._outputs[r.request_id] for r in ready])
        first = self.runner.head_logits(out).argmax(dim=-1).tolist()
        self.costs.observe(0, len(ready), time.perf_counter() - started)
        drafts = {r.request_id: [int(t)] for r, t in zip(ready, first)}
        outputs = dict(zip((r.request_id for r in ready), self.runner.mtp_hidden(out)))
        for i in range(1, max(r.room for r in ready)):
            going = [r for r in ready if r.room > i]
            # draft i + 1 comes from the layer at the position before draft i's (len - 2 + i), fed draft i
            steps = [
                StepSequence([drafts[r.request_id][-1]], len(r.token_ids) - 2 + i, tables[r.request_id], True)
                for r in going
            ]
            out = self._pass(steps, torch.stack([outputs[r.request_id] for r in going]), head=True)
            tokens = out.argmax(dim=-1).tolist()
            for r, row, token in zip(going, self.runner.mtp_hidden(self._last_out), tokens):
                drafts[r.request_id].append(int(token))
                outputs[r.request_id] = row
        return drafts

    def _pass(self, steps: list[StepSequence], hidden, head: bool = False):
        """One pass of the layer: its outputs at the sampling rows (`head`: their logits instead, the outputs kept in
        `_last_out`), timed by size (reading the result waits for the device)."""
        started = time.perf_counter()
        out, _ = self.runner.execute_step(steps, hidden=hidden)
        if head:
            self._last_out = out
            out = self.runner.head_logits(out)
        out.sum().item()  # (the device done: the pass's whole time)
        seconds = time.perf_counter() - started
        fed = sum(s.num_new_tokens for s in steps)
        self.costs.observe(fed, len(out), seconds)
        self.forward_passes += 1
        return out

    def forget(self, request_id: str) -> None:
        """The request finished, or was preempted (its positions are computed again): what is held for it goes."""
        self._held.pop(request_id, None)
        self._known.pop(request_id, None)
        self._outputs.pop(request_id, None)
