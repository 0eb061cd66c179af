"""Speculative decoding from the checkpoint's own multi-token-prediction layer (`engine.speculative.method: mtp`).

DeepSeek-V3 and GLM-4.5 ship a layer trained to predict the token after next from the model's final hidden state and
the next token's embedding (pylon.serving.model.mtp). Its KV cache is one more layer beside the model's, in the
model's own blocks: it has the model's number of blocks and reads the model's block tables, so a prefix the model's
cache shares (the prefix cache) carries the layer's keys and values with it, and no second pool is kept.

After every step the layer catches up (`advance`): for each position p the model computed (a prompt chunk's, a decode's
and the drafts it accepted) it reads h_p, which the model's runner kept (`ModelRunner.keep_hidden`), and the token
at p + 1, writes its keys and values at p, and, where p + 1 is the request's last known token, keeps its output there,
which scores the token to come. That pass is one decoder layer and no output layer, whether the step speculates or
not, so the layer's cache never falls behind the model's; the hidden states are dropped once it has run.

When a step speculates (`propose`), each decode's first draft is the argmax of the output kept for it (through the
layer's norm and the model's head), and each next one the argmax after feeding the layer the draft before with its
own last output in place of h, one one-token pass each (`num_tokens - 1`), at the positions the verification will
compute: the engine gives the model's table room for them first. Their keys and values are overwritten by the next
catch-up, which rewrites every position the model verified. The drafts are argmax choices (q(d) = 1) and verified by
the same rule as the others (pylon.serving.engine.speculative): greedy outputs stay token for token the model's, and
sampled ones keep their distribution, whatever the layer proposes.

A prefix the model's cache shared keeps the layer's entries of its first request: where the next token differs (the
cached prefix's last position), those differ from what this request would write. Drafts only read them; outputs never
depend on them. The catch-up runs for every request but those that finished in the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pylon.serving.engine.draft import DraftRequest
from pylon.serving.engine.speculative import StepCosts
from pylon.serving.model.step import StepSequence


@dataclass
class Computed:
    """What the model computed for one request in a step, that the layer catches up on: `hidden` (`[n, hidden]`, its
    final hidden states at positions start .. start + n - 1) and `next_ids`, the tokens at start + 1 .. start + n."""

    request_id: str
    start: int
    next_ids: list[int]
    hidden: object
    block_table: list[int]
    last: bool  # start + n is the request's last known token: the output there scores the token to come


class MtpDrafter:
    """Drafts from the multi-token-prediction layer's runner (`ModelRunner(mtp=...)`), its cache the model's blocks."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self._outputs: dict[str, tuple[int, object]] = {}  # request id -> (its last known position, the output there)
        self.forward_passes = 0  # the layer's passes, catch-ups included (a machine-independent counter)
        self.costs = StepCosts()  # `propose`'s wall times, by (drafts, requests)
        self.catch_up_seconds = 0.0  # the last `advance`'s

    def advance(self, computed: list[Computed]) -> None:
        """Write the layer's keys and values at every position the model's step computed, and keep each request's
        output where its known tokens end (the first draft's row)."""
        import torch

        started = time.perf_counter()
        for c in computed:
            self._outputs.pop(c.request_id, None)
        if computed:
            steps = [StepSequence(c.next_ids, c.start, c.block_table, c.last) for c in computed]
            out, _ = self.runner.execute_step(steps, hidden=torch.cat([c.hidden for c in computed]))
            rows = iter(out)
            for c in computed:
                if c.last:
                    self._outputs[c.request_id] = (c.start + len(c.next_ids), next(rows))
            self.forward_passes += 1
        self.catch_up_seconds = time.perf_counter() - started

    def ready(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's first draft is at hand: the layer's output at its last known token."""
        kept = self._outputs.get(request_id)
        return kept is not None and kept[0] == num_tokens - 1

    def estimate(self, requests: list[DraftRequest]) -> tuple[float | None, float]:
        """What `propose(requests)` would take, in seconds, as its calls of that size took (None: none measured)."""
        seconds = self.costs.measured(sum(r.room for r in requests), len(requests))
        return seconds, seconds or 0.0

    def propose(self, requests: list[DraftRequest], tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Each request's drafts (up to its `room`; those `ready` only), by request id; `tables`: each one's block
        table in the model's pool, with room for its tokens and its drafts but the last."""
        import torch

        started = time.perf_counter()
        ready = [r for r in requests if r.room > 0 and self.ready(r.request_id, len(r.token_ids))]
        if not ready:
            return {}
        out = torch.stack([self._outputs[r.request_id][1] for r in ready])
        first = self.runner.head_logits(out).argmax(dim=-1).tolist()
        drafts = {r.request_id: [int(t)] for r, t in zip(ready, first)}
        outputs = dict(zip((r.request_id for r in ready), self.runner.mtp_hidden(out)))
        for i in range(1, max(r.room for r in ready)):
            going = [r for r in ready if r.room > i]
            # draft i (at position len - 1 + i) comes from the layer at the position before it, fed draft i - 1
            steps = [
                StepSequence([drafts[r.request_id][-1]], len(r.token_ids) - 2 + i, tables[r.request_id], True)
                for r in going
            ]
            out, _ = self.runner.execute_step(steps, hidden=torch.stack([outputs[r.request_id] for r in going]))
            tokens = self.runner.head_logits(out).argmax(dim=-1).tolist()
            for r, row, token in zip(going, self.runner.mtp_hidden(out), tokens):
                drafts[r.request_id].append(int(token))
                outputs[r.request_id] = row
            self.forward_passes += 1
        self.costs.observe(sum(r.room for r in requests), len(requests), time.perf_counter() - started)
        return drafts

    def forget(self, request_id: str) -> None:
        """The request finished (or was preempted): its kept output goes."""
        self._outputs.pop(request_id, None)
