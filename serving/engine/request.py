"""A request's state inside the engine, and what the engine hands back for it after each step.

Prefill and decode are not separate states: a request has `num_tokens` (prompt + generated) of which
`num_computed_tokens` are in the KV cache; a step computes some of the rest. A fresh prompt, a prompt
chunked across steps, a decode (one token) and a preempted request being recomputed are all that one case.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pylon.serving.engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

    from pylon.serving.engine.images import ImageInputs
    from pylon.serving.engine.tokenization import IncrementalDetokenizer

FinishReason = Literal["stop", "length", "abort", "repetition"]


@dataclass
class RequestMetrics:
    """Times on `time.monotonic()`'s clock (differences are what matter: queue time, time to first token,
    inter-token latency), filled in as they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(eq=False)  # a request is itself, not its field values (queues find and remove it by identity)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what max_model_len leaves after the prompt
    detokenizer: "IncrementalDetokenizer"
    generator: "torch.Generator | None"
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far (kv_cache.block_hashes)
    num_registered_blocks: int = 0  # full computed blocks `Scheduler._register` gave the pool (0 after a preemption)
    # A model with recurrent layers: the hash of the block whose states snapshot (kv_cache.StateSnapshots) its
    # recurrent layers start from, set where it starts from a cached prefix, until the engine has restored them
    restore_from: bytes | None = None
    num_kept_logprob_blocks: int = 0  # blocks whose prompt logprobs the cache keeps (Scheduler._keep_prompt_logprobs)
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # With params.prompt_logprobs: one entry per prompt position (index 0 None: nothing predicts the first token),
    # filled by position as the prompt's chunks are computed. A cached prefix's entries are filled by whoever finds
    # it cached (the engine only writes the positions its steps compute).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in a prefix cache, not computed for this request
    prompt_logprobs_sent: bool = False  # its first output (which carries prompt_logprobs) has gone out
    prompt_ids_sent: bool = False  # with params.return_prompt_token_ids: its first output (which carries them) went
    order: tuple[int, int] = (0, 0)  # (params.priority, arrival number): the scheduler's order (Scheduler.add)
    guide: object | None = None  # with params.guide: its llguidance matcher, advanced by each generated token
    draft: list[int] = field(default_factory=list)  # speculative decoding: tokens proposed for this step to verify
    # ...as a tree (engine.speculative.tree_width): each draft token's parent among them (-1: after the last known
    # token), in pre-order; empty: one path
    draft_parents: list[int] = field(default_factory=list)
    adapter: int = 0  # the runner's slot of its LoRA adapter (params.adapter); 0: the base model
    cache_salt: bytes = b""  # where its block hashes start (kv_cache.cache_salt): apart per adapter
    on_demand_adapter: str | None = None  # the name of its adapter when loaded on demand (engine/adapters.py);
    # `adapter` is 0 until the step that takes it in gives it its slot
    images: "ImageInputs | None" = field(default=None, repr=False)  # its prompt's images (engine/images.py)
    image_embeds: "torch.Tensor | None" = field(default=None, repr=False)  # their rows, while its prompt needs them
    _prompt_tensor: "torch.Tensor | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def prompt_tensor(self) -> "torch.Tensor":
        """The prompt's token ids as a CPU tensor, made once (penalties read them at every step)."""
        if self._prompt_tensor is None:
            import torch

            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        return self._prompt_tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: deltas since the previous output, cumulative counts."""

    request_id: str
    text: str  # new text (complete characters only; stop strings never included)
    token_ids: list[int]  # new token ids (a stop or eos token is included here though not in the text)
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far
    finish_reason: FinishReason | None
    metrics: RequestMetrics  # a snapshot, taken when this output was made
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per token of `token_ids`
    # with params.prompt_logprobs: the whole prompt's (index 0 None), on the request's first output only
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens that came from a prefix cache
    # with params.embed: the prompt's last token's final hidden state (float32), on its one output
    embedding: list[float] | None = None
    # with params.return_prompt_token_ids: the prompt's token ids as the engine computed them, on the first output
    prompt_token_ids: list[int] | None = None
    # with params.kv_export_from: the prompt's blocks (engine/kv_transfer.py's KVTransfer), on its last output
    kv_transfer: object = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(
        cls, request: Request, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> "RequestOutput":
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs = list(request.prompt_logprobs)
            request.prompt_logprobs_sent = True
        prompt_ids = None
        if request.params.return_prompt_token_ids and not request.prompt_ids_sent:
            prompt_ids = list(request.prompt_token_ids)
            request.prompt_ids_sent = True
        return cls(
            request.request_id,
            text,
            token_ids,
            request.num_prompt_tokens,
            request.num_output_tokens,
            request.finish_reason,
            dataclasses.replace(request.metrics),
            logprobs,
            prompt_logprobs,
            request.num_cached_tokens,
            prompt_token_ids=prompt_ids,
        )
