"""Beam search over HTTP (vLLM's `use_beam_search`, `n` beams, `length_penalty`), run by the replica on its engine.

Each step asks the engine for one token of every live beam, with the `2 x n` most likely tokens' logprobs (the model's
own log-softmax): every beam extended by each of those is a candidate, scored by its summed logprob over its length to
the `length_penalty` (`transformers`' score: the generated tokens, an ending eos counted); the `n` best candidates
that have not ended are the next step's beams, those that end (an eos id, unless `ignore_eos`) are kept aside. After
`max_tokens` steps (or once no beam is left), the `n` best of the ended and the live beams are the choices, best first.
The `n` best of all extensions are always among the `2 x n` best of each beam's (vLLM's and `transformers`' rule), so
no candidate that could make the cut is left out.

A step's requests are the beams' whole token sequences; the prefix cache (engine.enable_prefix_caching, on by default)
holds what the last step computed, so each computes about a block per beam. Every beam of a step runs in the same
batched engine steps. What shapes sampling (penalties, logit_bias, stop conditions, grammars, tools) is not applied to
beams: such a request is a 400 naming the field, as is a streamed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from pylon.serving.engine.sampling import MAX_LOGPROBS, SamplingParams
from pylon.serving.errors import InvalidRequest

MAX_BEAMS = MAX_LOGPROBS // 2  # each step asks for 2 x n alternatives
# The request fields a beam search takes; any other one given is a 400 (it would be ignored otherwise).
TAKEN = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "use_beam_search",
        "length_penalty",
        "ignore_eos",
        "temperature",
        "seed",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "add_special_tokens",
        "cache_salt",
        "truncate_prompt_tokens",
        "truncation_side",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "priority",
        "request_id",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "reasoning_effort",
        "stream",
    }
)


@dataclass
class Beam:
    tokens: list[int]  # generated so far
    logprob: float = 0.0  # summed over them
    ended: bool = False  # its last token is an eos id


def score(beam: Beam, length_penalty: float) -> float:
    """A beam's rank: its summed logprob over its length (an ending eos counted, as `transformers` counts it) to the
    `length_penalty`."""
    return beam.logprob / max(len(beam.tokens), 1) ** length_penalty


def check(body) -> None:
    """A 400 for a beam search request with a field beams do not take, a stream, or too many beams."""
    if body.stream:
        raise InvalidRequest("use_beam_search: beams are not streamed; send stream: false", param="stream")
    for name in sorted(body.model_fields_set - TAKEN):
        if getattr(body, name) != type(body).model_fields[name].get_default(call_default_factory=True):
            raise InvalidRequest(
                f"{name} is not applied to beam search (beams are ranked by the model's own logprobs); leave it out",
                param=name,
            )
    if body.n > MAX_BEAMS:
        raise InvalidRequest(f"use_beam_search: n (the beams) is at most {MAX_BEAMS} (got {body.n})", param="n")
    if getattr(body, "tools", None) or getattr(body, "response_format", None) is not None:
        raise InvalidRequest("tools and response_format are not applied to beam search", param="use_beam_search")


async def search(
    engine,
    request_id: str,
    prompt,
    params: SamplingParams,
    width: int,
    max_tokens: int,
    length_penalty: float,
    eos_ids: frozenset[int],
    max_model_len: int,
) -> tuple[list[Beam], list[int], int]:
    """The `width` best beams (best first) of `prompt` (a text or token ids, as the engine takes them), the prompt's
    token ids, and the tokens the prefix cache gave its first step. `params`: the request's (its tokenization, salt,
    adapter, priority). `max_tokens` None: what the context leaves.

    Stops early, as `transformers`' beam search does by default, once `width` beams have ended and the best live
    one scores no better than the worst of them (a live beam's score only falls as it grows, for a length_penalty of
    at most 0; for a positive one this is the same heuristic `transformers` uses)."""
    step = dataclasses.replace(
        params,
        max_tokens=1,
        temperature=0.0,
        logprobs=2 * width,
        ignore_eos=True,
        return_prompt_token_ids=True,
        stop=[],
        stop_token_ids=[],
    )
    first = await _one(engine, f"{request_id}-b0", prompt, step)
    prompt_ids, cached = first.prompt_token_ids, first.num_cached_tokens
    ended: list[Beam] = []
    live = _extend([Beam([])], [first], width, length_penalty, eos_ids, ended)
    then = dataclasses.replace(step, return_prompt_token_ids=False, truncate_prompt_tokens=None)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    elif len(prompt_ids) + max_tokens > max_model_len:  # refused before any later step runs, as the engine would
        raise InvalidRequest(
            f"max_tokens ({max_tokens}) plus the prompt ({len(prompt_ids)} tokens) exceed max_model_len "
            f"({max_model_len}); ask for at most {max_model_len - len(prompt_ids)} tokens",
            param="max_tokens",
        )
    rank = lambda b: score(b, length_penalty)  # noqa: E731
    for n in range(1, max_tokens):
        if not live:
            break
        if len(ended) >= width and rank(live[0]) <= sorted(map(rank, ended), reverse=True)[width - 1]:
            break
        outs = await asyncio.gather(
            *(_one(engine, f"{request_id}-b{n}-{j}", prompt_ids + b.tokens, then) for j, b in enumerate(live))
        )
        live = _extend(live, outs, width, length_penalty, eos_ids, ended)
    best = sorted(ended + live, key=rank, reverse=True)
    return best[:width], prompt_ids, cached


def _extend(
    beams: list[Beam], outs: list, width: int, length_penalty: float, eos_ids: frozenset[int], ended: list[Beam]
) -> list[Beam]:
    """Every beam extended by each token of its step's logprobs: those that end go to `ended`; the `width` best of
    the others are returned."""
    candidates = []
    for beam, out in zip(beams, outs):
        entry = out.logprobs[0]
        options = dict(entry.top)
        options.setdefault(entry.token_id, entry.logprob)
        for token, logprob in options.items():
            extended = Beam([*beam.tokens, token], beam.logprob + logprob, token in eos_ids)
            (ended if extended.ended else candidates).append(extended)
    candidates.sort(key=lambda b: score(b, length_penalty), reverse=True)
    return candidates[:width]


async def _one(engine, request_id: str, prompt, params: SamplingParams):
    """One step of one beam: the engine's one output (its token and that token's alternatives)."""
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last
