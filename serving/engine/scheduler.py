"""What runs in each step: continuous batching under a token budget, chunked prefill, and preemption.

Each `schedule()` builds one step of at most `max_num_batched_tokens` tokens over at most `max_num_seqs`
requests, in this order:

1. running requests, oldest first: a decode needs one token; a prompt still being prefilled in chunks
   gets what the budget has left. A request that needs a new KV block when the pool has none preempts the
   *newest* running request (its blocks are freed; it goes back to the front of the waiting queue and is
   recomputed later, prompt and generated tokens alike), until the block is free or the request itself
   was the newest. Older requests keep their progress, so the oldest always advances: no request ever
   fails for lack of blocks, since one request (at most max_model_len tokens) fits in the pool alone.
2. waiting requests, first come first served, while the budget, the sequence cap and the free blocks allow:
   a long prompt takes as much of the budget as is left, and continues in the next steps.
   No new request is admitted in a step that had to preempt: the pool is full.

The scheduler decides; `KVBlockPool` owns the blocks; the model runner executes what is decided here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pylon.serving.engine.kv_cache import KVBlockPool
from pylon.serving.engine.request import FinishReason, Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # position of the first token computed in this step (tokens before it are cached)
    num_new_tokens: int
    # The step computes the request's last known token, so it produces the next one. A prompt chunk that
    # does not reach the prompt's end produces nothing.
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: KVBlockPool, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is last
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, request.num_computed_tokens + num_new, preempted):
                break  # it was the newest running request itself: nothing after it is left
            scheduled.append(self._take(request, num_new))
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Placed where its whole expected length fits in one run if it can (see KVBlockPool).
            expected = len(request.prompt_token_ids) + request.max_tokens
            if not self.pool.allocate(
                request.request_id, request.num_computed_tokens + num_new, reserve_tokens=expected
            ):
                break  # the pool is full; running requests free blocks as they finish
            self.waiting.popleft()
            self.running.append(request)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            scheduled.append(self._take(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted)

    def _make_room(self, request: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Give `request` blocks for `num_tokens`, preempting the newest running requests while the pool is
        short. False when `request` itself was the newest and had to go."""
        while not self.pool.allocate(request.request_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _take(self, request: Request, num_new: int) -> ScheduledRequest:
        # The runner will compute these tokens in this step, so they count as computed from here on.
        start = request.num_computed_tokens
        step = ScheduledRequest(request, start, num_new, samples=start + num_new == request.num_tokens)
        request.num_computed_tokens += num_new
        return step

    def _preempt(self, request: Request) -> None:
        self.pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take `request` out of whichever queue holds it and free its blocks."""
        if self.requests.pop(request.request_id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.pool.free(request.request_id)
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()
