"""Sampling parameters of one request, and the sampler that turns a step's logits into next tokens.

Every request that samples (temperature > 0) draws from its own `torch.Generator`, seeded from `seed` when
given: a seeded request then yields the same tokens whatever else shares its batch, because no other
request ever advances its random stream.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pylon.serving.errors import InvalidRequest, shown

if TYPE_CHECKING:
    import torch


POOL_TASKS = ("", "multi_vector", "token_weights")  # SamplingParams.pool_task's values
POOL_TASK_NAMES = {"multi_vector": "token_embed", "token_weights": "token_classify"}  # as /pooling's task names them


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the model (log-softmax of the fp32 logits, before temperature, top-p and
    top-k), and the `top` most likely tokens at that position as (token id, logprob), by logprob descending, ties
    by token id. Small and flat: thousands cross the engine process's pipe per second."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # 1 + how many tokens are more likely (vLLM's rank: 1 is the most likely); 0 where not computed


@dataclass
class SamplingParams:
    """What to generate for one request. Defaults follow OpenAI's completions API (the replica gives the fields a
    request leaves out the model's defaults instead, under engine.generation_config: auto: `engine/generation.py`).

    max_tokens: new tokens at most; None means up to the engine's max_model_len, and at most the model's own default
    (its generation_config.json's max_new_tokens, under engine.generation_config: auto) where it has one.
    temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_p: keep the smallest set of most likely tokens whose probability adds up to top_p (1 keeps all).
    top_k: keep the k most likely tokens; 0 keeps all (-1, vLLM's spelling of "all", is accepted too).
    min_p: keep the tokens at least min_p times as likely as the most likely one (0 keeps all; vLLM's and SGLang's).
    min_tokens: generate at least this many tokens before an eos id or a stop token id can end the request (they
    are masked until then) or a stop string is looked for (vLLM's).
    seed: seeds this request's own random stream, for reproducible sampling.
    stop: strings that end generation; the matched stop string is not part of the output text.
    stop_token_ids: token ids that end generation (besides the model's eos ids: `engine/generation.py`).
    ignore_eos: keep generating past the model's eos ids (benchmarks).
    logprobs: None, or k >= 0: each generated token's logprob and the k most likely tokens at its position.
    prompt_logprobs: None, or k >= 0: each prompt token's logprob (from position 1 on) and the k most likely there.
    Logprobs are the model's own log-softmax over fp32 logits, before temperature, top-p and top-k (as vLLM's).
    max_tokens 0 (generate nothing) is allowed with prompt_logprobs only: a request that scores its prompt.
    guide: None, or the grammar every generated token must keep to (structured outputs, `engine/guided.py`):
    {"type": "json_object"}, {"type": "json_schema", "schema": {...}} or {"type": "lark", "grammar": "..."}, with
    an optional "param" naming the request field it came from in errors (default "response_format").
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's: subtracted from a token's logit once if it occurs in
    the generated tokens (presence), and once per occurrence (frequency). Positive values discourage repeats.
    repetition_penalty: > 0 (1 is neutral), vLLM's and `transformers`': a token of the prompt or the generated tokens
    has its logit divided by it when positive, multiplied when negative.
    logit_bias: {token id: bias in [-100, 100]}, added to the token's logit (-100 bans it, 100 all but forces it).
    The shaping runs in that order (bias, repetition, frequency, presence: vLLM's), before temperature, top-k and
    top-p, for greedy requests too; logprobs stay the model's own.
    adapter: None (the base model), or the name of one of the engine's LoRA adapters (`engine.adapters`) to run with.
    adapter_path: with `adapter` naming none of those, the local directory of an adapter loaded on demand
    (`engine.dynamic_adapters`; its replica fetched it from the root).
    add_special_tokens: a text prompt is tokenized with the special tokens its tokenizer adds (a BOS), as vLLM's
    completions do by default; off, the text's own tokens (a chat rendered by its template holds its BOS already).
    embed: compute the prompt and return its last token's final hidden state (`RequestOutput.embedding`) instead of
    generating: max_tokens must be 0, and no logprobs are asked.
    include_stop_str_in_output: the stop string that ended the text stays in it (vLLM's).
    allowed_token_ids: the only tokens that may be sampled (every other one masked; vLLM's), after the shaping above.
    truncate_prompt_tokens: k >= 1: only the prompt's last k tokens are used (left truncation, vLLM's); -1: its last
    max_model_len - max_tokens (what the context leaves). truncation_side "right": its first k tokens instead.
    logprob_token_ids: with logprobs, these tokens' logprobs at each generated position instead of the most likely
    ones (vLLM's: scoring a fixed set of labels), by logprob descending.
    cache_salt: the request's prefix-cache blocks are named under this salt too (vLLM's): only requests with the same
    salt share them, so one tenant cannot learn by timing what another sent.
    skip_special_tokens: the tokenizer's special tokens (`<|im_end|>`, `[INST]`...: its added tokens marked special,
    and its bos, eos, pad...) write no text (vLLM's default); false: they are in the text as they decode. Tokens in
    `keep_special_ids` are written all the same: the markers a reply's parser reads (a tool call's `[TOOL_CALLS]`),
    which the replica names.
    spaces_between_special_tokens: vLLM's; accepted (a fast tokenizer's decode, what Pylon's are, has no such option:
    vLLM's fast path ignores it too).
    bad_words: words that are never generated (vLLM's): each is tokenized as it is and with a leading space, and the
    last token of either is banned wherever the tokens before it were just generated (a one-token word: always).
    The engine tokenizes them (`bad_words_ids`).
    priority: the order the engine's scheduler takes waiting requests in, lower first (vLLM's priority scheduling;
    ties in arrival order); a running request is preempted before one with a lower value (0: everyone's default).
    thinking_token_budget: at most this many tokens of reasoning (vLLM's; None or -1: no limit): once the reasoning
    has that many, the tokens that end it are the only ones that may be sampled, one after the other, and the reply
    goes on to its answer. `reasoning_tags` say what reasoning is, as token ids: (the tokens that open it, those that
    end it, whether the prompt opened it already: DeepSeek-R1's template ends with `<think>`); the replica gives them
    from its reasoning parser. Reasoning starts after the first opening in the generated tokens (at the start where
    the prompt opened it) and ends at the first ending after that.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guide: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    adapter: str | None = None
    adapter_path: str | None = None
    add_special_tokens: bool = False
    embed: bool = False
    # With embed: what comes back beside a model's one vector, from an encoder's token heads (bge-m3's, see
    # pylon.serving.model.encoder): "multi_vector", each token's ColBERT vector but the first's; "token_weights", each
    # token's sparse (lexical) weight. "": the one vector.
    pool_task: str = ""
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    keep_special_ids: tuple[int, ...] = ()
    spaces_between_special_tokens: bool = True
    bad_words: list[str] = field(default_factory=list)
    bad_words_ids: list[list[int]] | None = None  # filled in by the engine, from bad_words and its tokenizer
    priority: int = 0
    return_prompt_token_ids: bool = False  # the first output carries the prompt's token ids (RequestOutput)
    thinking_token_budget: int | None = None
    # A model with recurrent layers: a prompt position before which the prompt is likely shared by later requests
    # (the server's: where a chat's last message begins), where the engine snapshots the states (kv_cache.py)
    snapshot_at: int | None = None
    # vLLM's repetition_detection: (max_pattern_size, min_pattern_size, min_count); None: off (see `repeats`)
    repetition_detection: tuple[int, int, int] | None = None
    truncation_side: str = "left"
    logprob_token_ids: list[int] | None = None
    reasoning_tags: tuple[tuple[int, ...], tuple[int, ...], bool] | None = None
    # vLLM's logprobs_mode: "raw", the model's own log-softmax (the default, as above); "processed", the log of the
    # distribution the token was drawn from (after the shaping, temperature, top-k, min-p, top-p and any grammar; a
    # greedy token's 0): what a trainer sampling through the engine corrects its ratios with (pylon.jobs.rollout)
    logprobs_mode: str = "raw"
    # Prefill-decode disaggregation (engine/kv_transfer.py), set by the deployment, never by a client: a prefill
    # engine's request sends back its prompt's blocks from this block position on (the asker holds those before) with
    # its last output; a decode engine's request brings another engine's blocks of its prompt (a KVTransfer), taken
    # into the cache before it is scheduled.
    kv_export_from: int | None = None
    kv_import: object = None

    def __post_init__(self) -> None:
        if self.guide is not None and (
            not isinstance(self.guide, dict)
            or self.guide.get("type") not in ("json_object", "json_schema", "lark", "regex")
        ):
            raise InvalidRequest(
                f"guide must be a json_object, json_schema, lark or regex grammar (got {shown(self.guide)})",
                param="response_format",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS} (got {value})", param=name)
        if self.logprobs_mode not in ("raw", "processed"):
            raise InvalidRequest(
                f"logprobs_mode must be 'raw' or 'processed' (got {shown(self.logprobs_mode)})", param="logprobs_mode"
            )
        if self.embed:  # an embedding generates nothing and scores nothing
            for name, neutral in (("max_tokens", 0), ("logprobs", None), ("prompt_logprobs", None)):
                if getattr(self, name) != neutral:
                    raise InvalidRequest(
                        f"an embedding request generates nothing: {name} must be {neutral} (got {getattr(self, name)})",
                        param=name,
                    )
        if self.pool_task not in POOL_TASKS or self.pool_task and not self.embed:
            raise InvalidRequest(
                f"pool_task must be one of {', '.join(map(repr, POOL_TASKS))}, with embed "
                f"(got {shown(self.pool_task)})",
                param="task",
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1 and not (self.max_tokens == 0 and (self.prompt_logprobs is not None or self.embed)):
                raise InvalidRequest(
                    f"max_tokens must be >= 1 (0 only with prompt_logprobs) (got {self.max_tokens})",
                    param="max_tokens",
                )
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature <= 100:  # far past any useful value; inf/nan would poison the softmax
            raise InvalidRequest(f"temperature must be between 0 and 100 (got {self.temperature})", param="temperature")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be > 0 and <= 1 (got {self.top_p})", param="top_p")
        _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 or -1 keeps every token) (got {self.top_k})", param="top_k")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be between 0 and 1 (got {self.min_p})", param="min_p")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequest(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}) (got {self.min_tokens})",
                param="min_tokens",
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        if isinstance(self.stop, str):  # OpenAI accepts one string or a list
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(
                f"stop must be a non-empty string or a list of them (got {shown(self.stop)})", param="stop"
            )
        self.stop = list(self.stop)
        # Every generated token is checked against every stop string in the engine's step, for every request of
        # the batch: bounds keep one request from slowing all the others (1,000 stop strings of 1,000 characters
        # cost 22 ms a token). OpenAI takes at most 4.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(self.stop)})", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequest(
                f"stop: each stop string may have at most {MAX_STOP_LENGTH} characters (got one of "
                f"{max(len(s) for s in self.stop)})",
                param="stop",
            )
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequest(
                f"stop_token_ids must be a list of token ids >= 0 (got {shown(self.stop_token_ids)})",
                param="stop_token_ids",
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids (got {len(self.stop_token_ids)})",
                param="stop_token_ids",
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be true or false (got {self.ignore_eos!r})", param="ignore_eos")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be between -2 and 2 (got {getattr(self, name)})", param=name)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be > 0 and <= {MAX_REPETITION_PENALTY:g} (1 is neutral) "
                f"(got {self.repetition_penalty})",
                param="repetition_penalty",
            )
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequest(
                f"include_stop_str_in_output must be true or false (got {shown(self.include_stop_str_in_output)})",
                param="include_stop_str_in_output",
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                not isinstance(ids, (list, tuple))
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise InvalidRequest(
                    f"allowed_token_ids must be a non-empty list of token ids >= 0 (got {shown(ids)})",
                    param="allowed_token_ids",
                )
            self.allowed_token_ids = sorted(set(ids))
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise InvalidRequest(
                    f"truncate_prompt_tokens must be >= 1, or -1 for what the context leaves (got "
                    f"{self.truncate_prompt_tokens})",
                    param="truncate_prompt_tokens",
                )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise InvalidRequest(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters", param="cache_salt")
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be true or false (got {shown(getattr(self, name))})", param=name)
        self.keep_special_ids = tuple(self.keep_special_ids)
        if not isinstance(self.bad_words, (list, tuple)) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise InvalidRequest(
                f"bad_words must be a list of words, each with some text (got {shown(self.bad_words)})",
                param="bad_words",
            )
        if len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_LENGTH for w in self.bad_words):
            raise InvalidRequest(
                f"bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_STOP_LENGTH} characters each",
                param="bad_words",
            )
        self.bad_words = list(self.bad_words)
        _check_int("priority", self.priority)
        if self.truncation_side not in ("left", "right"):
            raise InvalidRequest(
                f"truncation_side must be left or right (got {shown(self.truncation_side)})", param="truncation_side"
            )
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if (
                not isinstance(ids, (list, tuple))
                or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise InvalidRequest(
                    f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids >= 0 "
                    f"(got {shown(ids)})",
                    param="logprob_token_ids",
                )
            if self.logprobs is None:
                raise InvalidRequest("logprob_token_ids needs logprobs", param="logprob_token_ids")
            self.logprob_token_ids = list(dict.fromkeys(ids))
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget)
            if self.thinking_token_budget < -1:
                raise InvalidRequest(
                    f"thinking_token_budget must be >= 0, or -1 for no limit (got {self.thinking_token_budget})",
                    param="thinking_token_budget",
                )
            if self.thinking_token_budget == -1:
                self.thinking_token_budget = None
        if self.repetition_detection is not None:
            largest, smallest, count = self.repetition_detection
            for name, value in (("max_pattern_size", largest), ("min_pattern_size", smallest), ("min_count", count)):
                _check_int(f"repetition_detection.{name}", value)
            if largest <= 0:
                self.repetition_detection = None  # vLLM's: 0 turns it off
            elif count < 2 or not 0 <= smallest <= largest or largest > MAX_PATTERN_SIZE:
                raise InvalidRequest(
                    "repetition_detection: max_pattern_size at most "
                    f"{MAX_PATTERN_SIZE}, min_pattern_size from 0 (1) to max_pattern_size, and min_count >= 2 "
                    f"(got {largest}, {smallest}, {count})",
                    param="repetition_detection",
                )
            else:
                self.repetition_detection = (largest, max(smallest, 1), count)

    def repeats(self, output_ids: list[int]) -> bool:
        """Whether the output ends in a pattern of max_pattern_size tokens or fewer (min_pattern_size or more) said
        min_count times in a row (vLLM's repetition_detection; the request then ends, finish reason "repetition")."""
        largest, smallest, count = self.repetition_detection
        n = len(output_ids)
        for size in range(smallest, largest + 1):
            if size * count > n:
                return False
            tail = output_ids[n - size :]
            if all(output_ids[n - size * (k + 1) : n - size * k] == tail for k in range(1, count)):
                return True
        return False

    @property
    def shapes_logits(self) -> bool:
        """Whether this request changes the model's logits before sampling (penalties, logit_bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids
            or self.bad_words_ids
            or self.thinking_token_budget is not None
        )

    @property
    def alternatives(self) -> "int | list[int]":
        """What each generated token's logprobs come with (`token_logprobs`' ks): logprob_token_ids, else logprobs'
        count of the most likely tokens."""
        return self.logprob_token_ids if self.logprob_token_ids is not None else self.logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def new_generator(self) -> "torch.Generator | None":
        """This request's own random stream (None when greedy: nothing to draw)."""
        import torch

        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.SystemRandom().getrandbits(63)
        return torch.Generator().manual_seed(seed % 2**64)


MAX_PATTERN_SIZE = 1024  # repetition_detection's largest pattern (each token checks up to this many)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROB_TOKEN_IDS = 1024  # logprob_token_ids: ids at most
MAX_BAD_WORDS = 128  # bad_words: words at most (each is up to two token sequences checked every step)
MAX_CACHE_SALT = 256  # cache_salt: characters at most
MAX_LOGIT_BIAS = 1024  # entries (OpenAI's own limit is lower)
MAX_REPETITION_PENALTY = 100.0  # far past any useful value: 2 is already strong
MAX_LOGPROBS = 20  # alternatives per position at most (OpenAI's chat API takes 20, its completions API 5)
TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer (got {value!r})", param=name)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequest(f"{name} must be a number (got {value!r})", param=name)


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """`logit_bias` as {token id: bias}, each checked (a token id >= the vocabulary is the engine's to refuse: it
    knows the vocabulary). None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequest(
            f"logit_bias must be an object mapping token ids to biases (got {shown(bias)})", param="logit_bias"
        )
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens (got {len(bias)})", param="logit_bias")
    out = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdecimal():  # JSON's keys: "50256", not " 7" or "٣"
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(
                f"logit_bias: keys must be token ids, integers >= 0 (got {shown(key)})", param="logit_bias"
            )
        param = f"logit_bias.{token}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise InvalidRequest(f"{param} must be a number (got {shown(value)})", param=param)
        if not -100 <= value <= 100:
            raise InvalidRequest(f"{param} must be between -100 and 100 (got {value})", param=param)
        out[token] = float(value)
    return out or None


def shape_logits(
    logits: "torch.Tensor",
    params: list[SamplingParams],
    histories: list[tuple[object, list[int]]],
    eos_ids: Collection[int] = (),
) -> "torch.Tensor":
    """`logits` ([rows, vocab], float32) as row i's request shapes them (`SamplingParams.shapes_logits`): its
    logit_bias added, then its repetition penalty over the tokens of `histories[i]` (prompt ids as a list or a CPU
    tensor, generated ids) and its frequency and presence penalties over the generated ones; then, while it has
    fewer than min_tokens generated tokens, the tokens that would end it (the model's `eos_ids` unless it ignores
    eos, its stop_token_ids) pushed to float32's lowest (not -inf: a grammar that allows only eos then still leaves a
    token), and so are the tokens that would complete one of its bad words after the generated ones. Every row that
    shapes is done in the same few indexed reads and writes, touching only the tokens concerned (never a whole row:
    a vocabulary-wide pass per row cost more than the rest); rows that shape nothing are left as they are, and
    when none does, `logits` itself comes back (no copy)."""
    import torch

    shaping = [i for i, p in enumerate(params) if p.shapes_logits]
    if not shaping:
        return logits
    device, dtype = logits.device, logits.dtype
    out = logits.clone()  # the model's logits stay for logprobs
    bias = [(i, t, v) for i in shaping if params[i].logit_bias for t, v in params[i].logit_bias.items()]
    if bias:
        at, ids, values = zip(*bias)
        out.index_put_(
            (torch.tensor(at, device=device), torch.tensor(ids, device=device)),
            torch.tensor(values, dtype=dtype, device=device),
            accumulate=True,
        )
    rep = [i for i in shaping if params[i].repetition_penalty != 1]
    if rep:
        # Every (row, token) of the history, repeats included: each write of a repeated pair puts the same value.
        at, ids = _flat(rep, [torch.cat([_ids(histories[i][0]), _ids(histories[i][1])]) for i in rep], device)
        r = torch.tensor([params[i].repetition_penalty for i in range(len(params))], dtype=dtype, device=device)[at]
        seen = out[at, ids]
        # A repetition penalty of 1e-300 is a request's to give (> 0) and divides a logit to inf, and inf - inf in
        # the sampler is NaN, which would stop the step for the whole batch: shaped logits stay finite.
        out[at, ids] = torch.where(seen > 0, seen / r, seen * r).clamp_(max=torch.finfo(dtype).max)
    counted = [i for i in shaping if (params[i].frequency_penalty or params[i].presence_penalty) and histories[i][1]]
    if counted:
        at, ids = _flat(counted, [_ids(histories[i][1]) for i in counted], device)
        vocab = logits.shape[1]
        pairs, counts = torch.unique(at * vocab + ids, return_counts=True)
        at, ids = pairs // vocab, pairs % vocab
        frequency = torch.tensor([params[i].frequency_penalty for i in range(len(params))], dtype=dtype, device=device)
        presence = torch.tensor([params[i].presence_penalty for i in range(len(params))], dtype=dtype, device=device)
        out.index_put_((at, ids), -(frequency[at] * counts.to(dtype) + presence[at]), accumulate=True)
    early = [
        (i, t)
        for i in shaping
        if len(histories[i][1]) < params[i].min_tokens
        for t in _ending_tokens(params[i], eos_ids)
        if t < logits.shape[1]
    ]
    if early:
        at, ids = zip(*early)
        out[torch.tensor(at, device=device), torch.tensor(ids, device=device)] = torch.finfo(dtype).min
    banned = [
        (i, ids[-1])
        for i in shaping
        for ids in params[i].bad_words_ids or ()
        if ids[-1] < logits.shape[1] and (len(ids) == 1 or _ends_with(histories[i][1], ids[:-1]))
    ]
    if banned:  # bad_words: float32's lowest, as min_tokens' (a grammar that allows only them still leaves a token)
        at, ids = zip(*banned)
        out[torch.tensor(at, device=device), torch.tensor(ids, device=device)] = torch.finfo(dtype).min
    for i in shaping:  # allowed_token_ids: every other token masked (a vocabulary-wide write, for these rows only)
        allowed = params[i].allowed_token_ids
        if params[i].thinking_token_budget is not None:
            forced = thinking_forced(params[i], histories[i][1])
            if forced is not None:  # the reasoning is over budget: the next token of its ending, and nothing else
                allowed = [forced]
        if allowed:
            keep = torch.tensor([t for t in allowed if t < out.shape[1]], device=device)
            kept = out[i, keep]
            out[i] = float("-inf")
            out[i, keep] = kept
    return out


def thinking_forced(params: SamplingParams, generated) -> int | None:
    """The token a request must take next because its reasoning has used its thinking_token_budget (the next token of
    the ending, after whatever part of it the generated tokens end with), or None: not reasoning, or within budget."""
    start, end, opened = params.reasoning_tags
    ids = generated if isinstance(generated, list) else generated.tolist()
    begin = 0 if opened else _find(ids, list(start), 0)
    if begin is None:
        return None
    begin += 0 if opened else len(start)
    if _find(ids, list(end), begin) is not None or len(ids) - begin < params.thinking_token_budget:
        return None
    done = next((k for k in range(len(end) - 1, 0, -1) if ids[len(ids) - k :] == list(end[:k])), 0)
    return end[done]


def _find(ids: list[int], part: list[int], start: int) -> int | None:
    """Where `part` first occurs in `ids` at or after `start`, or None (candidates found by `list.index`: C speed
    over a long reasoning, once a step)."""
    n, at = len(part), start
    while True:
        try:
            at = ids.index(part[0], at, len(ids) - n + 1)
        except ValueError:
            return None
        if ids[at : at + n] == part:
            return at
        at += 1


def _ends_with(generated, tail: list[int]) -> bool:
    """Whether the generated ids (a list or a CPU tensor) end with `tail`."""
    n = len(tail)
    if len(generated) < n:
        return False
    last = generated[-n:]
    return (last.tolist() if hasattr(last, "tolist") else list(last)) == tail


def _ending_tokens(params: SamplingParams, eos_ids: Collection[int]) -> set[int]:
    ending = set(params.stop_token_ids)
    if not params.ignore_eos:
        ending.update(eos_ids)
    return ending


def _ids(ids) -> "torch.Tensor":
    import torch

    return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)


def _flat(rows: list[int], per_row: list["torch.Tensor"], device) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Rows' token ids as one (row, token id) pair of tensors on `device`, for one indexed read or write."""
    import torch

    lengths = torch.tensor([len(t) for t in per_row])
    at = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return at.to(device), torch.cat(per_row).to(device)


def sample(
    logits: "torch.Tensor", params: list[SamplingParams], generators: list["torch.Generator | None"]
) -> list[int]:
    """One next token per row of `logits` ([rows, vocab], float32), row i following `params[i]`.

    Greedy rows take the argmax. Sampled rows are filtered (temperature, top-k, top-p) in one batched
    pass over descending-sorted logits; the draw itself happens on the CPU with each row's own generator.
    """
    import torch

    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    probs, sorted_ids = sampling_distributions(logits[index], [params[i] for i in rows])
    for j, i in enumerate(rows):
        tokens[i] = draw(probs[j], sorted_ids[j], generators[i])
    return tokens


def sampling_distributions(
    logits: "torch.Tensor", params: list[SamplingParams]
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Row i's sampling distribution under `params[i]` over its tokens sorted by logit (descending), and those ids,
    on the CPU: what `draw` takes, one row at a time."""
    probs, sorted_ids = _sorted_probs(logits, params)
    return probs.cpu(), sorted_ids.cpu()


def draw(probs: "torch.Tensor", sorted_ids: "torch.Tensor", generator: "torch.Generator | None") -> int:
    """One token from one row of `sampling_distributions`, with one draw from `generator`: the sampler's and
    speculative verification's draw alike, so that a request's random stream gives the same token at a position
    whichever of them takes it."""
    import torch

    return int(sorted_ids[torch.multinomial(probs, 1, generator=generator)])


def _sorted_probs(chosen: "torch.Tensor", params: list[SamplingParams]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Row i's sampling distribution under `params[i]` over its tokens sorted by logit (descending), and those ids."""
    import torch

    vocab = chosen.shape[1]
    # Any temperature in (0, 100] is a request's to give, and none may break the step for the whole batch: 1e-40
    # would be 0 in float32 (and x / 1e-30 overflows to inf, and inf - inf in the softmax is NaN, which the draw
    # refuses: the engine's step loop died on one such request). So each row is shifted to a maximum of 0 before
    # it is divided, and temperatures are at least float32's smallest normal number: the scaled logits are then
    # 0 for the best token and <= 0 (at worst -inf: probability 0) for the others, the limit softmax tends to.
    temperature = torch.tensor([max(p.temperature, TINY) for p in params], device=chosen.device)
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=chosen.device)
    top_p = torch.tensor([p.top_p for p in params], device=chosen.device)
    scaled = (chosen - chosen.max(dim=-1, keepdim=True).values) / temperature[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_logits.shape[1], device=chosen.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    if any(p.min_p for p in params):
        # min_p: p / p_max >= min_p, i.e. a scaled logit (the best one is 0) of at least log(min_p); the best token
        # always stays. Before top_p, which then counts the mass of what min_p kept (vLLM's order).
        floor = torch.tensor([math.log(p.min_p) if p.min_p else -math.inf for p in params], device=chosen.device)
        sorted_logits = sorted_logits.masked_fill((sorted_logits < floor[:, None]) & (rank[None, :] > 0), -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the first token always stays, whatever
    # top_p is (a top_p of 5e-324 is 0 in float32, and masking every token killed the step loop for the batch).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((mass_before >= top_p[:, None]) & (rank[None, :] > 0), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), sorted_ids


def filtered_probs(logits: "torch.Tensor", params: list[SamplingParams]) -> "torch.Tensor":
    """Row i's sampling distribution under `params[i]` (temperature > 0, top-k, top-p: exactly what `sample` draws
    from), in token order, on the CPU: [rows, vocab] float32."""
    import torch

    probs, sorted_ids = _sorted_probs(logits, params)
    return torch.zeros_like(probs).scatter_(1, sorted_ids, probs).cpu()


def token_logprobs(logits: "torch.Tensor", token_ids: list[int], ks: list) -> list[TokenLogprob]:
    """`TokenLogprob`s of row i of `logits` ([rows, vocab]): token `token_ids[i]`'s log-probability and the `ks[i]`
    most likely tokens, by logprob descending, ties by token id (`ks[i]` a list of ids: those tokens, in the same
    order: `SamplingParams.logprob_token_ids`). The log-softmax is over the fp32 logits as they are (no temperature,
    top-p or top-k: the model's own distribution, as vLLM reports by default)."""
    import torch

    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(token_ids, device=lp.device)
    picked = lp.gather(1, index[:, None])
    ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
    chosen = picked[:, 0].tolist()
    listed = {i: ks[i] for i in range(len(ks)) if isinstance(ks[i], list)}
    if listed:  # those tokens' own logprobs, in the order asked: one gather for all the rows that list them
        rows = list(listed)
        width = max(len(v) for v in listed.values())
        wanted = torch.tensor([v + [0] * (width - len(v)) for v in listed.values()], device=lp.device)
        found = lp[torch.tensor(rows, device=lp.device)].gather(1, wanted).tolist()
        for row, values in zip(rows, found):
            listed[row] = tuple(zip(listed[row], values))
        ks = [0 if isinstance(k, list) else k for k in ks]
    k = min(max(ks), lp.shape[1])
    if not k:
        return [TokenLogprob(t, c, listed.get(i, ()), r) for i, (t, c, r) in enumerate(zip(token_ids, chosen, ranks))]
    values, ids = lp.topk(k, dim=-1)
    # topk orders ties arbitrarily: where more than k tokens reach the k-th value (tied at the cut, which random
    # fp32 logits practically never are), that row is sorted whole, stably, so the lowest ids among the tied win.
    tied = ((lp >= values[:, -1:]).sum(dim=-1) > k).nonzero()[:, 0].tolist()
    for row in tied:
        order = torch.sort(-lp[row], stable=True).indices[:k]
        values[row], ids[row] = lp[row, order], order
    values, ids = values.tolist(), ids.tolist()
    out = []
    for i, (t, c) in enumerate(zip(token_ids, chosen)):
        top = listed.get(i) or tuple(sorted(zip(ids[i], values[i]), key=lambda pair: (-pair[1], pair[0]))[: ks[i]])
        out.append(TokenLogprob(t, c, top, ranks[i]))
    return out
