"""What runs in each step: continuous batching under a token budget, chunked prefill, and preemption.

Each `schedule()` builds one step of at most `max_num_batched_tokens` tokens over at most `max_num_seqs`
requests, in this order:

1. running requests, oldest first: a decode needs one token; a prompt still being prefilled in chunks
   gets what the budget has left. A request that needs a new KV block when the pool has none preempts the
   *newest* running request (its blocks are freed; it goes back to the front of the waiting queue and is
   recomputed later, prompt and generated tokens alike), until the block is free or the request itself
   was the newest. Older requests keep their progress, so the oldest always advances: no request ever
   fails for lack of blocks, since one request (at most max_model_len tokens) fits in the pool alone.
2. waiting requests, first come first served (see Priority below), while the budget, the sequence cap and the
   free blocks allow:
   a long prompt takes as much of the budget as is left, and continues in the next steps.
   No new request is admitted in a step that had to preempt: the pool is full.
   With prefix caching on, a request taken from the queue first looks up the blocks of its tokens that some
   request computed before (`KVBlockPool.lookup`): it starts with those blocks shared and those tokens computed,
   so its first chunk begins past them (at least its last token is always computed: it samples from it).
   A request preempted and taken again finds what it had computed the same way, while its blocks are still cached.

**Priority** (vLLM's priority scheduling: `SamplingParams.priority`, lower first). Both queues are kept in
(priority, arrival) order, so "oldest" above reads "first in that order" and "newest" "last": a waiting request is
admitted before those of a higher value, and the running request preempted for blocks is the one of the highest value
(the newest among them). A running request is never preempted to admit a waiting one (vLLM's rule too). With every
priority 0, the default, this is exactly first come first served.

A request's full blocks are registered in the cache once a step has computed them (from the next `schedule()` on,
or when the request finishes or is preempted), never in the step that computes them: a request taken in the same
step never shares keys and values not yet written.

The scheduler decides; `KVBlockPool` owns the blocks; the model runner executes what is decided here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pylon.serving.engine.kv_cache import KVBlockPool, StateSnapshots, block_hashes
from pylon.serving.engine.request import FinishReason, Request, TokenLogprob
from pylon.serving.model.families import first_key


@dataclass(frozen=True)
class CachedLogprobs:
    """What the cache keeps with a block for requests that want their prompt's log-probabilities: each position's
    entry (scored by the row before it; None at position 0 of a prompt), computed with `k` top alternatives, and the
    entry of the token after the block, by that token (the next block's first, scored by this block's last row)."""

    entries: tuple[TokenLogprob | None, ...]
    k: int
    next: dict[int, TokenLogprob]


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # position of the first token computed in this step (tokens before it are cached)
    num_new_tokens: int
    # The step computes the request's last known token, so it produces the next one. A prompt chunk that
    # does not reach the prompt's end produces nothing.
    samples: bool
    # Speculative decoding: the first `num_draft` of `request.draft` are computed after the last known token, at
    # the positions that follow it (their KV is written; the engine counts the accepted ones as computed).
    num_draft: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        pool: KVBlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        snapshots: StateSnapshots | None = None,
        whole_prompts: bool = False,
        snapshot_interval: int = 0,
        window: int | None = None,
    ):
        self.pool = pool
        # A model attending within a sliding window of this many tokens (or a `families.Chunk`) in every layer (the
        # pool's `set_window`), or in some, their groups' tables apart (HybridKVBlockPool): each step first lets go of
        # a request's blocks before its window
        self.window = window
        # An encoder's inputs (model/encoder.py): each computed whole in one step, never in chunks
        self.whole_prompts = whole_prompts
        # Recurrent layers: their states snapshotted every this many tokens of a prompt too (a multiple of blocks)
        self.snapshot_interval = snapshot_interval // pool.block_size * pool.block_size
        # A model with recurrent layers (with the prefix cache): their states' snapshots, which a cached prefix needs
        self.snapshots = snapshots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        # Both in `Request.order`: priority (lower first), then arrival. With every priority 0 (the default) that is
        # first come first served, and the running list is in admission order, the newest last.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self._arrivals = 0
        # Prefix caching, in tokens (vLLM's counters): tokens of requests taken from the queue that were looked up
        # in the cache, and those found there. Prefill: tokens computed by steps, past those a request had computed
        # (every scheduled token but decodes').
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefill_tokens_computed = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrivals += 1
        request.order = (request.params.priority, self._arrivals)
        _insert(self.waiting, request, from_end=True)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.window is not None:  # its queries from num_computed_tokens on see no key before the window
                self._register(request)  # (the blocks earlier steps filled, cached before any is let go of)
                self.pool.trim(request.request_id, first_key(self.window, request.num_computed_tokens))
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.images is not None and request.num_computed_tokens < request.num_prompt_tokens:
                num_new = request.images.cut(request.num_computed_tokens, num_new)  # never inside an image's run
                if not num_new:  # the rest of its image does not fit what this step has left: the next step
                    i += 1
                    continue
            if request.draft and num_new == 1:
                # A speculating decode: its drafts too, if the budget and the free blocks allow (never preempting
                # anyone for a draft); otherwise a plain decode.
                k = min(len(request.draft), budget - 1)
                if k > 0 and self.pool.allocate(request.request_id, request.num_computed_tokens + 1 + k):
                    scheduled.append(self._take(request, 1, num_draft=k))
                    budget -= 1 + k
                    i += 1
                    continue
                request.draft = []
            num_new = self._to_boundary(request, request.num_computed_tokens, num_new)
            if not self._make_room(request, request.num_computed_tokens + num_new, preempted):
                break  # it was the newest running request itself: nothing after it is left
            scheduled.append(self._take(request, num_new))
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            cached = self._cached_prefix(request)
            num_cached = len(cached) * self.pool.block_size
            num_new = self._to_boundary(request, num_cached, min(request.num_tokens - num_cached, budget))
            if request.images is not None:
                num_new = request.images.cut(num_cached, num_new)
                if not num_new:  # its first chunk would end inside an image's run: it waits for a fuller budget
                    break
            if self.whole_prompts and num_new < request.num_tokens - num_cached:
                break  # an encoder's input is read whole: it waits for a step with room for all of it
            # Placed where its whole expected length fits in one run if it can (see KVBlockPool).
            expected = len(request.prompt_token_ids) + request.max_tokens
            if not self.pool.allocate(request.request_id, num_cached + num_new, reserve_tokens=expected, cached=cached):
                break  # the pool is full; running requests free blocks as they finish
            self.waiting.popleft()
            _insert(self.running, request, from_end=True)
            if self.pool.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
            request.num_computed_tokens = num_cached
            if self.window is not None:  # (a long cached prefix: the blocks before its window go back at once)
                self.pool.trim(request.request_id, first_key(self.window, num_cached))
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            scheduled.append(self._take(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted)

    def snapshot_boundaries(self, request: Request) -> tuple[int, ...]:
        """Where a request's recurrent states are snapshotted in its prompt, in order: the last block boundary before
        the position its params name (`snapshot_at`: where a chat's shared part ends, the server's), every
        `snapshot_interval` tokens (engine.recurrent_snapshot_interval), and the last block boundary short of its last
        token (the deepest a later request with the same prompt starts from); 0s left out."""
        bs = self.pool.block_size
        last = (request.num_prompt_tokens - 1) // bs * bs
        hint = request.params.snapshot_at
        shared = (min(hint, request.num_prompt_tokens) - 1) // bs * bs if hint else 0
        every = range(self.snapshot_interval, last, self.snapshot_interval) if self.snapshot_interval else ()
        return tuple(b for b in sorted({shared, last, *every}) if b > 0)

    def _to_boundary(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, or fewer so that the step ends on the prompt's next snapshot boundary where
        it would pass it (a model with recurrent layers, with the prefix cache: see kv_cache.py)."""
        if self.snapshots is not None:
            for boundary in self.snapshot_boundaries(request):
                if start < boundary < start + num_new:
                    return boundary - start
        return num_new

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

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks `request` (taken from the queue, nothing computed) may start with: the longest cached
        prefix of its full blocks, short of its last token (which it computes to sample from). A request that wants
        its prompt's log-probabilities starts only with blocks whose entries it has or the cache kept with them
        (`_with_prompt_logprobs`), and gets those entries filled in."""
        if not self.pool.enable_caching:
            return []
        hashes = self.block_hashes(request)
        usable = (request.num_tokens - 1) // self.pool.block_size
        found = self.pool.reachable(hashes[:usable])  # (on the device, or in the host tier: copied back)
        if found and request.prompt_logprobs is not None:
            found = self._with_prompt_logprobs(request, hashes, found)
        if self.snapshots is not None:
            found = self._deepest_snapshot(hashes, found)
        blocks = self.pool.restore(hashes[:found]) if found else []
        if self.snapshots is not None:  # as far as its recurrent layers' states were kept: the deepest with one
            blocks = blocks[: self._deepest_snapshot(hashes, len(blocks))]
            request.restore_from = hashes[len(blocks) - 1] if blocks else None
        return blocks

    def _deepest_snapshot(self, hashes: list[bytes], found: int) -> int:
        """How many of the `found` blocks a request may start with, its recurrent layers' states kept at the last."""
        return next((m for m in range(found, 0, -1) if hashes[m - 1] in self.snapshots), 0)

    def _with_prompt_logprobs(self, request: Request, hashes: list[bytes], found: int) -> int:
        """How many of the `found` cached blocks `request` may start with, its prompt log-probabilities complete:
        every prompt token up to the first one it computes (that one's entry, at the first uncached position, is
        scored by the row before it: kept with the block before as `next`). Fills in the entries it takes."""
        bs, k, entries = self.pool.block_size, request.params.prompt_logprobs, request.prompt_logprobs
        prompt = request.prompt_token_ids
        for m in range(found, 0, -1):
            fill: dict[int, TokenLogprob] = {}
            ok = True
            for p in range(1, min(m * bs + 1, len(prompt))):  # positions whose entry the cached rows would score
                if entries[p] is not None:
                    continue
                kept: CachedLogprobs | None = self.pool.meta(hashes[min(p // bs, m - 1)])
                entry = None
                if kept is not None and kept.k >= k:
                    entry = kept.entries[p % bs] if p < m * bs else kept.next.get(prompt[p])
                if entry is None:
                    ok = False
                    break
                if len(entry.top) > k:
                    entry = TokenLogprob(entry.token_id, entry.logprob, entry.top[:k], entry.rank)
                fill[p] = entry
            if ok:
                for p, entry in fill.items():
                    entries[p] = entry
                return m
        return 0

    def _keep_prompt_logprobs(self, request: Request, num_blocks: int) -> None:
        """Keep the prompt log-probabilities of `request`'s first `num_blocks` registered blocks with them in the
        cache (`CachedLogprobs`), for later requests that want them and would otherwise compute the block again."""
        bs, entries, prompt = self.pool.block_size, request.prompt_logprobs, request.prompt_token_ids
        k = request.params.prompt_logprobs
        for i in range(min(num_blocks, -(-len(prompt) // bs))):
            h = request.block_hashes[i]
            kept: CachedLogprobs | None = self.pool.meta(h)
            block = tuple(entries[i * bs + j] if i * bs + j < len(prompt) else None for j in range(bs))
            if any(e is None for j, e in enumerate(block) if 0 < i * bs + j < len(prompt)):
                continue  # not all scored (this request started past them): nothing to keep
            if kept is None or kept.k < k:
                kept = CachedLogprobs(block, k, {})
                self.pool.set_meta(h, kept)
            nxt = (i + 1) * bs
            if nxt < len(prompt) and entries[nxt] is not None and kept.k == k:
                kept.next[prompt[nxt]] = entries[nxt]

    def block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of every full block of `request`'s tokens (computed once each, kept with it)."""
        # An image's placeholders hash as its contents (ImageInputs.hash_ids): one image's blocks never serve another.
        hashed = len(request.block_hashes) * self.pool.block_size
        ids = request.token_ids if request.images is None else request.images.hash_ids(request.token_ids, hashed)
        return block_hashes(ids, self.pool.block_size, request.block_hashes, request.cache_salt)

    def _register(self, request: Request) -> None:
        """Register `request`'s full blocks that earlier steps computed (see the module's docs)."""
        if self.pool.enable_caching:
            computed = request.num_computed_tokens // self.pool.block_size
            if computed <= request.num_registered_blocks:
                return  # no block has filled since (a decode fills one every block_size steps): nothing to hash
            request.num_registered_blocks = computed
            self.pool.cache_blocks(request.request_id, self.block_hashes(request), computed)
            if request.prompt_logprobs is not None and computed > request.num_kept_logprob_blocks:
                self._keep_prompt_logprobs(request, computed)
                request.num_kept_logprob_blocks = computed

    def _take(self, request: Request, num_new: int, num_draft: int = 0) -> ScheduledRequest:
        self._register(request)  # what earlier steps computed; this step's tokens are not written yet
        # The runner will compute these tokens in this step, so they count as computed from here on.
        start = request.num_computed_tokens
        if not (num_new == 1 and start == request.num_tokens - 1 and start >= request.num_prompt_tokens):
            self.prefill_tokens_computed += num_new
        step = ScheduledRequest(
            request, start, num_new, samples=start + num_new == request.num_tokens, num_draft=num_draft
        )
        request.num_computed_tokens += num_new
        return step

    def _preempt(self, request: Request) -> None:
        self._register(request)
        self.pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        _insert(self.waiting, request, from_end=False)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take `request` out of whichever queue holds it and free its blocks."""
        if self.requests.pop(request.request_id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._register(request)
        self.pool.free(request.request_id)
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()


def _insert(queue, request: Request, *, from_end: bool) -> None:
    """Put `request` into `queue` (the waiting deque or the running list, both in `Request.order`) where its order
    puts it, looking from the end (a new arrival: its place is the end unless it has a lower priority than some)
    or from the start (a preempted request: the front unless a request of a lower priority value waits)."""
    key = request.order
    if from_end:
        at = len(queue)
        while at and queue[at - 1].order > key:
            at -= 1
    else:
        at = 0
        while at < len(queue) and queue[at].order < key:
            at += 1
    queue.insert(at, request)
