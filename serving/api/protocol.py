"""The OpenAI-compatible request and response shapes, and the error body every 4xx/5xx carries.

Requests are pydantic models that forbid unknown fields: a misspelled parameter is a 400 that names it,
never a silently ignored one. Fields OpenAI defines but Pylon cannot honour (`best_of` other than `n`)
are accepted only at their neutral value, with an error that says so otherwise. `n` choices are `n` engine requests
over the same prompt. `response_format` (`json_object`, `json_schema`) is enforced on both endpoints by token masks;
`presence_penalty`, `frequency_penalty` and `logit_bias` shape the logits in the engine's step. `top_k`, `min_p`,
`min_tokens`, `stop_token_ids`, `ignore_eos` and `repetition_penalty` are vLLM's extensions, kept by name. A sampling
field a request leaves out takes the model's default from its generation_config.json where it has one
(`_Request.sampling_params`, `engine.generation_config`), else OpenAI's.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import time
from json.encoder import encode_basestring_ascii as _quote
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from pylon.serving.api import tools as tool_calls
from pylon.serving.engine.guided import check_json_schema, choice_rule
from pylon.serving.engine.sampling import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    MAX_PATTERN_SIZE,
    MAX_REPETITION_PENALTY,
    MAX_STOP_LENGTH,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pylon.serving.engine.tokenization import prompt_ids
from pylon.serving.errors import InvalidRequest, shown

if TYPE_CHECKING:
    from pylon.serving.engine.images import ImagePrompt
    from pylon.serving.engine.request import TokenLogprob
    from pylon.serving.engine.tokenization import TokenTexts


MAX_CHOICES = 16  # `n`: each choice is an engine request, and holds a slot of the batch
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs: variables at most
MAX_DOCUMENTS = 64  # documents: at most
SERVICE_TIERS = {"priority": -1, "flex": 1}  # OpenAI's service_tier as the scheduler's priority (the rest: 0)
MAX_CHAT_TEMPLATE = 65536  # chat_template: characters at most
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values (and gpt-oss's)
MAX_ALLOWED_TOKENS = 100_000  # allowed_token_ids: ids at most
MAX_BATCH_CHOICES = 64  # a batch of prompts x n: the engine requests one HTTP request may start


# The request fields a model's generation_config.json may give defaults for, besides max_tokens (engine/generation.py).
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _Request(BaseModel):
    # Strict: "5" is not a number and 1 is not a boolean here, as in OpenAI's own API.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    # The bounds the engine's SamplingParams enforces, stated here so that the published schema (/openapi.json)
    # says them too; a value outside is a 400 naming the field either way.
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices: one engine request each
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    # OpenAI's: an end user's id (as `user`); a cache key clients send to land on a replica that holds their prefix
    # (Pylon's router finds that replica by the prompt's own blocks: the key is accepted, the blocks decide); the
    # processing tier: "priority" and "flex" are the engine's scheduling priority -1 and 1 (see `priority`)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)
    # {token id (as a string, JSON's keys): bias}; the engine checks the ids against its vocabulary
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: "ResponseFormat | None" = None
    # vLLM's: the output held to a JSON schema, a regular expression, one of some strings, or a grammar
    structured_outputs: "StructuredOutputs | None" = None
    # vLLM's: the stop string that ended the output kept in it; the only tokens that may be sampled; the prompt cut to
    # its last k tokens (-1: to what the context leaves); a salt naming the request's prefix-cache blocks apart
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKENS
    )
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end truncate_prompt_tokens keeps from
    # vLLM's: with logprobs, these tokens' logprobs at each position instead of the most likely ones
    logprob_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS
    )
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: special tokens write no text (false: they do); the other is its slow tokenizers' option, accepted
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: words never generated (sampling.SamplingParams.bad_words)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] = Field(
        default_factory=list, max_length=MAX_BAD_WORDS
    )
    # vLLM's: the scheduler takes lower values first (ties in arrival order); the X-Vllm-Priority header overrides it
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    # vLLM's: each prompt token's logprob (and the k most likely there), in vLLM's shape
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: logprobs' tokens as "token_id:<id>"; the prompt's and the output's token ids in the answer
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # vLLM's: at most this many tokens of reasoning (-1: no limit), then the model is made to end it and answer
    thinking_token_budget: int | None = Field(None, ge=-1)
    # vLLM's: the output ends (finish_reason "repetition") once it ends in a pattern said min_count times in a row
    repetition_detection: "RepetitionDetection | None" = None
    # vLLM's: the n choices are the n best beams of a beam search (serving/api/beam_search.py), ranked by summed
    # logprob over length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10, le=10)
    # vLLM's: the id the engine and the logs know the request by (as the X-Request-Id header, which wins)
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:\-]{1,128}$")

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
        if (
            self.structured_outputs is not None
            and self.response_format is not None
            and self.response_format.type != "text"
        ):
            raise InvalidRequest(
                "response_format and structured_outputs both constrain the output; give one of them",
                param="structured_outputs",
            )

    def sampling_params(self, default_max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams for this request. A field the request leaves out (not in pydantic's
        `model_fields_set`; for max_tokens, null too) takes the model's default from `defaults` (its
        generation_config.json's, `GenerationConfig.sampling`: empty under engine.generation_config: none), else
        OpenAI's; a max_tokens default leaves max_tokens None for the engine, which caps the model's default by the
        context the prompt leaves. `default_max_tokens`: the endpoint's own default (OpenAI's 16 for completions)."""
        defaults = defaults or {}
        given = self.model_fields_set
        if self.max_tokens is not None:
            max_tokens = self.max_tokens
        else:
            max_tokens = None if defaults.get("max_tokens") is not None else default_max_tokens
        sampled = {
            name: defaults[name] if name in defaults and name not in given else getattr(self, name)
            for name in _MODEL_DEFAULTS
        }
        return SamplingParams(
            max_tokens=max_tokens,
            **sampled,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            guide=self._guide(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            add_special_tokens=self.add_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            cache_salt=self.cache_salt,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            bad_words=list(self.bad_words),
            priority=self.priority or SERVICE_TIERS.get(self.service_tier, 0),
            return_prompt_token_ids=self.return_token_ids,
            thinking_token_budget=self.thinking_token_budget,
            repetition_detection=self.repetition_detection.triple() if self.repetition_detection else None,
            truncation_side=self.truncation_side or "left",
            logprob_token_ids=self.logprob_token_ids,
            **self._logprobs_params(),
        )

    def _logprobs_params(self) -> dict:
        return {}

    def _response_guide(self) -> dict | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.guide()
        return self.response_format.guide() if self.response_format is not None else None

    def _guide(self) -> dict | None:
        return self._response_guide()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


@functools.cache
def _reserved_template_kwargs() -> frozenset:
    """Names Hugging Face's apply_chat_template takes as its own arguments, not template variables (as the installed
    version has them), and `messages`."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages", "self"}


def check_template_kwargs(kwargs: dict | None) -> None:
    """chat_template_kwargs: variables the model's chat template may read, by name; names that are the template
    call's own arguments, or not identifiers, are refused naming them."""
    for name in kwargs or {}:
        param = f"chat_template_kwargs.{name}"
        if not name.isidentifier() or name.startswith("_"):
            raise InvalidRequest(
                f"{param}: a template variable's name is an identifier (got {shown(name)})", param=param
            )
        if name in _reserved_template_kwargs():
            raise InvalidRequest(
                f"{param}: {name!r} is set by the server, not a template variable a request may give", param=param
            )


class RepetitionDetection(BaseModel):
    """vLLM's repetition_detection: the output ends (finish_reason "repetition") once its last tokens are a pattern of
    min_pattern_size to max_pattern_size tokens said min_count times in a row (max_pattern_size 0: off)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_pattern_size: int = Field(0, ge=0, le=MAX_PATTERN_SIZE)
    min_pattern_size: int = Field(0, ge=0, le=MAX_PATTERN_SIZE)
    min_count: int = Field(0, ge=0)

    def triple(self) -> tuple[int, int, int]:
        return (self.max_pattern_size, self.min_pattern_size, self.min_count)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (the prompt's tokens and the choice's generated ones)
    continuous_usage_stats: bool = False


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: score the prompt, generate nothing
    max_tokens: int | None = Field(None, ge=0)
    # the prompt's text before the generated text (and with logprobs, the prompt tokens' logprobs, the first null)
    echo: bool = False
    # each token's logprob and the `logprobs` most likely tokens at its position (OpenAI's legacy shape)
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: a text prompt gets the special tokens its tokenizer adds (Llama's and Gemma's BOS); false: its own only
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        prompts = self.prompts()
        if len(prompts) == 1:
            self.prompt = prompts[0]  # a batch of one is that prompt
        elif len(prompts) * self.n > MAX_BATCH_CHOICES:
            raise InvalidRequest(
                f"prompt: a batch of {len(prompts)} prompts x n {self.n} is {len(prompts) * self.n} "
                f"choices; at most {MAX_BATCH_CHOICES} per request (send the rest in another)",
                param="prompt",
            )
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "max_tokens must be >= 1; 0 (generate nothing) only with echo: true, to score the prompt",
                param="max_tokens",
            )
        if self.best_of not in (None, self.n):
            raise InvalidRequest(
                f"best_of must equal n ({self.n}): Pylon returns every choice it generates, it does not pick the best "
                f"of more (got {self.best_of})",
                param="best_of",
            )
        if self.suffix is not None:  # fill in the middle (tokenization.fim_ids): text prompts only, nothing echoed
            if any(not isinstance(p, str) for p in self.prompts()):
                raise InvalidRequest("suffix: give the prompt as text (the code before the cursor)", param="suffix")
            if self.echo:
                raise InvalidRequest("suffix: echo is not supported with a suffix", param="echo")

    def prompts(self) -> list:
        """The request's prompts: its one prompt (text or token ids), or each of a batch (OpenAI's list of strings
        or of token-id lists; the choices of prompt i are i x n to i x n + n - 1)."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return list(self.prompt)
        return [self.prompt]

    def _logprobs_params(self) -> dict:
        # The engine scores the prompt for echo's logprobs, for prompt_logprobs (the more alternatives of the two),
        # and for a request that only scores it (max_tokens 0).
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        prompt_logprobs = max(wanted) if wanted else (0 if self.max_tokens == 0 else None)
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt_logprobs}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # null on an assistant message that only calls tools
    name: str | None = None
    tool_call_id: str | None = None  # what OpenAI requires on a "tool" message; passed to a model's chat template
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (tools.check_tool_calls)
    # What the official client sends back when a reply's message object is appended to the conversation as it is.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    # An assistant reply's reasoning as this server (and vLLM) returned it, sent back with the message: its chat
    # template may read it (Qwen3's `reasoning_content`; gpt-oss's `thinking`: tools.template_messages)
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for it


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema every output must validate against."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced; accepted as OpenAI's clients send it


MAX_STRUCTURES = 128  # a structural tag's structures at most


class Structure(BaseModel):
    """One structure of a structural tag: the text that begins it (starting with one of the tag's triggers), the JSON
    schema of what follows, and the text that ends it."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    end: str = ""


class StructuralTag(BaseModel):
    """vLLM's (and SGLang's) structural tag: free text in which each trigger, once the model writes it, starts one of
    the structures whose `begin` it opens, held to that structure's begin, schema and end (a tool call in a model's
    own tags: `<function=get_weather>{...}</function>`), then free text again."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["structural_tag"] = "structural_tag"
    structures: list[Structure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_STRUCTURES)

    def guide(self, param: str) -> dict:
        """The engine's guide: llguidance's own grammar of structural tags (`StructTag.to_grammar`, as vLLM's
        guidance backend builds it). InvalidRequest naming the structure at fault."""
        from llguidance import StructTag

        tags = []
        for i, s in enumerate(self.structures):
            trigger = next((t for t in self.triggers if s.begin.startswith(t)), None)
            if trigger is None:
                raise InvalidRequest(
                    f"{param}.structures.{i}.begin: {s.begin!r} starts with none of the triggers {self.triggers}; "
                    "each structure begins with the trigger that starts it",
                    param=f"{param}.structures.{i}.begin",
                )
            check_json_schema(s.schema_, f"{param}.structures.{i}.schema")
            # compact JSON, as every schema's here (guided.JSON_OPTIONS), unless the schema says otherwise
            schema = {"x-guidance": {"whitespace_flexible": False}, **s.schema_}
            tags.append(StructTag(trigger=trigger, begin=s.begin, grammar=schema, end=s.end))
        return {"type": "lark", "grammar": StructTag.to_grammar(tags), "param": param}


def structural_tag_of(value: Any, param: str) -> StructuralTag:
    """A structural tag from a request (an object, or a JSON string of one as vLLM's `structured_outputs` takes it);
    InvalidRequest naming the field at fault."""
    import json

    import pydantic

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"{param}: not JSON ({e})", param=param) from None
    if isinstance(value, dict) and "format" in value and "structures" not in value:
        raise InvalidRequest(
            f"{param}.format: XGrammar's nested structural tag formats are not supported; give structures "
            '([{"begin", "schema", "end"}]) and triggers',
            param=f"{param}.format",
        )
    try:
        return StructuralTag.model_validate(value)
    except pydantic.ValidationError as e:
        raise invalid_request(e, param) from None


class ResponseFormat(BaseModel):
    """`text` (free), `json_object` (any JSON object), `json_schema` (JSON valid against a schema) or vLLM's
    `structural_tag` (free text with structures started by triggers): enforced by token masks
    (`pylon.serving.engine.guided`), so the output parses whatever the model."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag's (StructuralTag), read there
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: Any = None

    def guide(self) -> dict | None:
        """The engine's `SamplingParams.guide` for this format (None for text). A schema that is not a valid JSON
        Schema is an InvalidRequest naming the path inside it."""
        if self.type != "structural_tag":
            for name in ("structures", "triggers", "format"):
                if getattr(self, name) is not None:
                    raise InvalidRequest(
                        f'response_format.{name} belongs to type "structural_tag", not {self.type!r}',
                        param=f"response_format.{name}",
                    )
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object", "param": "response_format"}
        if self.type == "structural_tag":
            given = {k: v for k, v in (("structures", self.structures), ("triggers", self.triggers)) if v is not None}
            if self.format is not None:
                given["format"] = self.format
            return structural_tag_of(given, "response_format").guide("response_format")
        if self.json_schema is None:
            raise InvalidRequest(
                'response_format type "json_schema" needs a json_schema object ({"name": ..., "schema": {...}})',
                param="response_format.json_schema",
            )
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}
        param = "response_format.json_schema.schema"
        check_json_schema(schema, param)
        return {"type": "json_schema", "schema": schema, "param": param}


MAX_STRUCTURED_CHOICES = 1024  # structured_outputs.choice: strings at most


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its `StructuredOutputsParams`, on both endpoints): exactly one of `json` (a JSON
    schema, as an object or a JSON string), `regex` (the whole output matches it: Rust's regex syntax, as llguidance
    reads it), `choice` (the output is one of these strings), `grammar` (a Lark grammar in llguidance's syntax, or a
    GBNF one, converted) and `json_object` (any JSON object). Enforced by the same token masks as response_format."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_STRUCTURED_CHOICES
    )
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    # the whitespace JSON may have between its tokens (a regex; default none: compact JSON)
    whitespace_pattern: str | None = None
    # vLLM's options, accepted where they change nothing here: our JSON is compact (no free whitespace) already, and
    # there is one grammar library, so nothing to fall back from
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    # vLLM's structural tag (a JSON string of StructuralTag's fields, as its StructuredOutputsParams takes it; an
    # object too)
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's, not supported: a 400 naming it where set
    disable_additional_properties: bool | None = None

    def guide(self) -> dict:
        """The engine's `SamplingParams.guide`. InvalidRequest naming the field at fault."""
        import json

        if self.disable_additional_properties:
            name = "disable_additional_properties"
            raise InvalidRequest(
                f"structured_outputs.{name} is not supported; hold the output with json, regex, choice, grammar or "
                "structural_tag",
                param=f"structured_outputs.{name}",
            )
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        if len(given) != 1:
            listed = f" (got {', '.join(given)})" if given else ""
            raise InvalidRequest(
                "structured_outputs: give exactly one of json, regex, choice, grammar, json_object and "
                f"structural_tag{listed}",
                param="structured_outputs",
            )
        kind, param = given[0], f"structured_outputs.{given[0]}"
        if kind == "structural_tag":
            return structural_tag_of(self.structural_tag, param).guide(param)
        if kind == "json":
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequest(f"{param}: not JSON ({e})", param=param) from None
                if not isinstance(schema, dict):
                    raise InvalidRequest(f"{param}: a JSON schema is an object", param=param)
            check_json_schema(schema, param)
            if self.whitespace_pattern is not None:
                schema = {**schema, "x-guidance": {"whitespace_pattern": self.whitespace_pattern}}
            return {"type": "json_schema", "schema": schema, "param": param}
        if kind == "regex":
            return {"type": "regex", "regex": self.regex, "param": param}
        if kind == "choice":
            # One rule of string literals (JSON's escapes are Lark's); the strings themselves kept for
            # `reply_guide`, which holds a reasoning model's answer to them after its reasoning.
            grammar = f"start: {choice_rule(self.choice)}\n"
            return {"type": "lark", "grammar": grammar, "choices": list(self.choice), "param": param}
        if kind == "grammar":
            return {"type": "lark", "grammar": lark_grammar(self.grammar, param), "param": param}
        if self.whitespace_pattern is not None:
            schema = {"type": "object", "x-guidance": {"whitespace_pattern": self.whitespace_pattern}}
            return {"type": "json_schema", "schema": schema, "param": param}
        return {"type": "json_object", "param": param}


def lark_grammar(text: str, param: str) -> str:
    """A grammar as llguidance's Lark takes it: `text` itself, or converted from GBNF (llama.cpp's, vLLM's EBNF
    examples: `root ::= ...`) by llguidance's own converter. InvalidRequest naming `param` where it is neither."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the request's grammar: whatever the converter says of it is a 400
        raise InvalidRequest(f"{param}: not a Lark or GBNF grammar ({e})", param=param) from None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # each generated token's logprob; with top_logprobs, that many most likely tokens at each position too
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the model's chat template (Qwen3's enable_thinking: false); a model without a
    # chat template, or a template that does not read one, ignores it
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    # vLLM's: the rendered chat tokenized with the special tokens the tokenizer adds too (a template writes its BOS)
    add_special_tokens: bool = False
    # OpenAI's: how much a reasoning model thinks, given to its chat template as `reasoning_effort` (gpt-oss's
    # template writes it into its system message; a template that does not read it ignores it)
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    # vLLM's: the template's generation prompt (the assistant's header) ends the prompt; or, with
    # continue_final_message, the last message is left open and the reply continues it (a prefilled answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the reply's content starts with the last message's, where that message is the assistant's
    echo: bool = False
    # vLLM's: documents for a template that reads them (RAG templates: Command R's, Granite's), each {title, text}
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    # vLLM's: a Jinja chat template of the request's own, in place of the model's (http.trust_request_chat_template)
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE)

    def check_supported(self) -> None:
        super().check_supported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.reasoning_effort is not None and "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise InvalidRequest(
                "reasoning_effort is given twice (the field and chat_template_kwargs.reasoning_effort); give one",
                param="chat_template_kwargs.reasoning_effort",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequest(
                    "continue_final_message continues the last message, add_generation_prompt starts a new one: "
                    "set add_generation_prompt: false with it",
                    param="continue_final_message",
                )
            last = self.messages[-1]
            if last.role != "assistant" or not isinstance(last.content, (str, list)) or not last.content:
                raise InvalidRequest(
                    f"continue_final_message: the last message (messages.{len(self.messages) - 1}) is the one "
                    "continued: an assistant message with content",
                    param=f"messages.{len(self.messages) - 1}",
                )
        tool_calls.check_tool_calls(self.messages)
        self._tool_plan = tool_calls.plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)
        constrains = self.response_format is not None and self.response_format.type != "text"
        if self._tool_plan is not None and self._tool_plan.constrained and (constrains or self.structured_outputs):
            param = "response_format" if constrains else "structured_outputs"
            raise InvalidRequest(
                f"{param} and a required or named tool_choice both constrain the reply; give one of them",
                param=param,
            )
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequest("give max_tokens or max_completion_tokens, not both", param="max_tokens")
            self.max_tokens = self.max_completion_tokens

    _tool_plan: "tool_calls.ToolPlan | None" = PrivateAttr(None)
    _rendered: tuple | None = PrivateAttr(None)  # (the tokenizer's id and max_images, the prompt) of the last render

    def render(self, tokenizer, max_images: int = 0) -> "str | ImagePrompt":
        """The prompt the engine gets: the messages (with earlier tool calls) and the tools, through the model's chat
        template; with image_url parts (at most `max_images`: the engine's, 0 for a model that takes none), the text
        and the images' files (pylon.serving.engine.images). The replica and the prefix-aware router render with
        this one function (the router with no images: a request with images routes by load)."""
        from pylon.serving.engine.images import ImagePrompt, image_bytes
        from pylon.serving.engine.tokenization import apply_chat_template

        parts = self.image_parts()
        if parts and not max_images:
            where = parts[0][0]
            raise InvalidRequest(
                f"{where}: this deployment takes no images (a text-only model, or engine.max_images_per_prompt: 0); "
                "send text parts only",
                param=where,
            )
        if len(parts) > max_images:
            raise InvalidRequest(
                f"the messages have {len(parts)} images; this deployment takes at most {max_images} a request "
                "(engine.max_images_per_prompt)",
                param=parts[max_images][0],
            )
        if self._rendered is not None and self._rendered[0] == (id(tokenizer), max_images):
            return self._rendered[1]  # rendered already (a Responses request's truncation fitted it)
        plan = self._tool_plan
        if plan is None and self.tools:
            plan = tool_calls.plan_of(self.tools, self.tool_choice, self.parallel_tool_calls)
        text = apply_chat_template(
            tokenizer,
            tool_calls.template_messages([m.model_dump(exclude_none=True) for m in self.messages]),
            tools=plan.tools if plan is not None else None,
            tool_preamble=plan.preamble() if plan is not None else None,
            template_kwargs=self.template_kwargs(),
            images=bool(parts),
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            documents=self.documents,
            chat_template=self.chat_template,
        )
        prompt = text if not parts else ImagePrompt(text, tuple(image_bytes(url, where) for where, url in parts))
        self._rendered = ((id(tokenizer), max_images), prompt)
        return prompt

    def shared_prefix(self, tokenizer) -> str | None:
        """The rendered chat up to its last message (what later requests of the same conversation, or with the same
        system prompt, are likely to share): the messages before it through the template as the whole is rendered,
        where the whole rendering starts with that text; None for a chat of one message, with images, or where the
        template renders no such prefix."""
        if len(self.messages) < 2 or self.image_parts():
            return None
        head = self.model_copy(
            update={"messages": self.messages[:-1], "add_generation_prompt": False, "continue_final_message": False}
        )
        head._rendered = None
        try:
            text, whole = head.render(tokenizer), self.render(tokenizer)
        except Exception:  # a template that takes no chat ending there (one that insists on a user turn last)
            return None
        return text if isinstance(whole, str) and text and whole.startswith(text) else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort where given."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def image_parts(self) -> list[tuple[str, object]]:
        """The messages' image_url parts in order: each one's field path and its URL (`image_url.url`, or a bare
        string as some clients send it)."""
        found = []
        for i, message in enumerate(self.messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    if isinstance(url, dict):
                        found.append((f"messages.{i}.content.{j}.image_url.url", url.get("url")))
                    else:
                        found.append((f"messages.{i}.content.{j}.image_url", url))
        return found

    def echoed(self) -> str:
        """What `echo` puts before the reply's content: the last message's text where it is the assistant's."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        if isinstance(last.content, str):
            return last.content
        return "".join(p.get("text", "") for p in last.content or () if isinstance(p, dict) and p.get("type") == "text")

    @property
    def tool_plan(self) -> "tool_calls.ToolPlan | None":
        """What the model may do with the request's tools (None: no tool may be called); set by check_supported."""
        return self._tool_plan

    def _guide(self) -> dict | None:
        if self._tool_plan is not None and self._tool_plan.constrained:
            return self._tool_plan.guide()
        return self._response_guide()

    def _logprobs_params(self) -> dict:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return {"logprobs": logprobs, "prompt_logprobs": self.prompt_logprobs}


def render_chat(body, tokenizer, max_images: int = 0) -> "str | ImagePrompt":
    """A request's `messages` (and `tools`, where it has them) rendered as /v1/chat/completions renders them, with its
    `add_generation_prompt` and `continue_final_message` (with images: at most `max_images`, see `render`)."""
    chat = ChatCompletionRequest(
        model=body.model,
        messages=body.messages,
        tools=getattr(body, "tools", None),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    chat.check_supported()
    return chat.render(tokenizer, max_images)


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's): the token ids the engine computes for a completions `prompt`, or for a chat's
    `messages` (and `tools`) as `/v1/chat/completions` renders them through the model's chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    # vLLM's: with the special tokens the tokenizer adds; by default as the endpoint the text goes to (a prompt's
    # completions: true; a chat's: false)
    add_special_tokens: bool | None = None
    # vLLM's, with messages: as the chat endpoint takes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either prompt (text) or messages (a chat), one of them", param="prompt")
        if self.prompt == "":
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if self.tools is not None and self.messages is None:
            raise InvalidRequest("tools go with messages (a chat)", param="tools")
        if self.messages is None and (self.continue_final_message or not self.add_generation_prompt):
            raise InvalidRequest(
                "add_generation_prompt and continue_final_message go with messages (a chat)",
                param="continue_final_message" if self.continue_final_message else "add_generation_prompt",
            )

    def text(self, tokenizer, max_images: int = 0) -> "str | ImagePrompt":
        """What the engine would tokenize: the prompt, or the chat rendered as the chat endpoint renders it (with
        image parts: an ImagePrompt)."""
        if self.prompt is not None:
            return self.prompt
        return render_chat(self, tokenizer, max_images)

    @property
    def special(self) -> bool:
        """Whether the text is tokenized with the tokenizer's special tokens (`add_special_tokens`)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.prompt is not None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings API: each input's vector is the model's final hidden state at its last token (after the
    last norm: last-token pooling, as Qwen3-Embedding, gte-Qwen2 and e5-mistral are trained), L2-normalised.
    `dimensions` keeps the first that many of them, normalised again (Matryoshka models are trained for it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    # one text, texts, one token-id list, or token-id lists (OpenAI's four shapes)
    input: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] = Field(
        description=f"a text, texts, token ids, or lists of token ids: at most {MAX_EMBEDDING_INPUTS} inputs"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def check_supported(self) -> None:
        inputs = self.inputs()
        if not inputs:
            raise InvalidRequest("input must not be empty: give a text, texts or token ids", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(
                f"input: at most {MAX_EMBEDDING_INPUTS} inputs a request (got {len(inputs)}); split them over requests",
                param="input",
            )
        for i, item in enumerate(inputs):
            if len(item) == 0:
                raise InvalidRequest("an input must not be empty", param="input" if len(inputs) == 1 else f"input.{i}")

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a text or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(i, int) for i in self.input):
            return [list(self.input)]
        return list(self.input)


class RerankRequest(BaseModel):
    """vLLM's rerank API (Jina's and Cohere's shape): the documents ranked by their relevance to the query: a
    cross-encoder's score of each (query, document) pair where the model is a classifier of one label, else the cosine
    of the embedding model's vectors (last-token pooled, as /v1/embeddings gives them): a bi-encoder's score."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    query: str = Field(min_length=1)
    documents: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS - 1)
    top_n: int | None = Field(None, ge=0, description="the best this many (0 or absent: all)")
    return_documents: bool = True
    use_activation: bool | None = Field(None, description="a cross-encoder's: false, its logit as the score")
    user: str | None = None

    def check_supported(self) -> None:
        pass

    def texts(self) -> list[str]:
        return [self.query, *self.documents]


class ScoreRequest(BaseModel):
    """vLLM's score API: each pair's score, a cross-encoder's (a classifier of one label) or the cosine of the
    embedding model's vectors of its two texts: `text_1` one text scored against each of `text_2`, or two lists of the
    same length scored pair by pair."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    text_1: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
    text_2: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
    use_activation: bool | None = Field(None, description="a cross-encoder's: false, its logit as the score")
    user: str | None = None

    def check_supported(self) -> None:
        firsts, seconds = self.sides()
        if not firsts or not seconds:
            raise InvalidRequest(
                "text_1 and text_2 must not be empty lists", param="text_1" if not firsts else "text_2"
            )
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise InvalidRequest(
                f"text_2: as many texts as text_1 ({len(firsts)}) to score pair by pair, or one text_1 to score "
                f"against each (got {len(seconds)})",
                param="text_2",
            )
        if len(firsts) + len(seconds) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(f"at most {MAX_EMBEDDING_INPUTS} texts a request", param="text_2")

    def sides(self) -> tuple[list[str], list[str]]:
        as_list = lambda v: [v] if isinstance(v, str) else list(v)  # noqa: E731
        return as_list(self.text_1), as_list(self.text_2)

    def pairs(self) -> list[tuple[int, int]]:
        """Each pair as (index in text_1, index in text_2)."""
        firsts, seconds = self.sides()
        return [(0 if len(firsts) == 1 else k, k) for k in range(len(seconds))]


class PoolingRequest(BaseModel):
    """vLLM's `POST /classify` and `POST /pooling`: each input's (or the chat's) outputs of the model's pooled last
    token: a classifier's label probabilities (its activation: pylon.serving.engine.pooling), or `use_activation:
    false` its logits (a reward model's reward); an embedding model's vector on /pooling (as /v1/embeddings)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    # as /v1/embeddings' input: a text, texts, token ids, or lists of token ids
    input: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        None, description=f"a text, texts, token ids, or lists of token ids: at most {MAX_EMBEDDING_INPUTS}"
    )
    # or a chat (a conversation to score: a reward model's input), rendered through the model's chat template
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False  # vLLM's defaults for a chat to pool: as the conversation stands
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: true for input, false for messages (the template has them)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the last k tokens (-1: the context)")
    use_activation: bool | None = Field(None, description="false: the logits, not probabilities (default true)")
    activation: bool | None = None  # vLLM's earlier names for use_activation
    softmax: bool | None = None
    encoding_format: Literal["float", "base64"] = "float"  # an embedding's (/pooling of an embedding model)
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's pooling tasks (default: the model's own: classify for a classifier, embed otherwise); an encoder's token
    # heads (bge-m3's): token_embed (each token's ColBERT vector but the CLS's), token_classify (each token's sparse
    # weight, the first and last special tokens left out), and Pylon's lexical_weights ({token id: its largest
    # weight}, special tokens left out, as FlagEmbedding's BGEM3FlagModel returns them)
    task: Literal["embed", "classify", "token_embed", "token_classify", "lexical_weights"] | None = None

    @property
    def pool_task(self) -> str:
        """The engine's SamplingParams.pool_task for `task`."""
        return {
            "token_embed": "multi_vector",
            "token_classify": "token_weights",
            "lexical_weights": "token_weights",
        }.get(self.task or "", "")

    def check_supported(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise InvalidRequest(
                "give either input (texts or token ids) or messages (a chat), one of them", param="input"
            )
        if self.pool_task and (self.dimensions is not None or self.encoding_format != "float"):
            raise InvalidRequest(
                f"task {self.task}: its outputs are per token, as floats; dimensions and encoding_format are a "
                "vector's",
                param="dimensions" if self.dimensions is not None else "encoding_format",
            )
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequest(
                "truncate_prompt_tokens must be >= 1, or -1 (the context)", param="truncate_prompt_tokens"
            )
        if self.input is not None:
            EmbeddingRequest(model=self.model, input=self.input).check_supported()
        elif self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )

    @property
    def activated(self) -> bool:
        """Whether the outputs go through the classifier's activation (use_activation, or its earlier names)."""
        return next((v for v in (self.use_activation, self.activation, self.softmax) if v is not None), True)

    def inputs(self, tokenizer) -> list[list[int]]:
        """The token ids of each input (or of the rendered chat)."""
        if self.messages is not None:
            special = bool(self.add_special_tokens)
            return [prompt_ids(tokenizer, render_chat(self, tokenizer), special)]
        special = self.add_special_tokens is not False
        items = EmbeddingRequest(model=self.model, input=self.input).inputs()
        return [prompt_ids(tokenizer, i, special) if isinstance(i, str) else i for i in items]


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's): the text of token ids, as the tokenizer decodes them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)

    def check_supported(self) -> None:
        pass


def parse_request(cls: type[_Request], body: bytes) -> _Request:
    """Validate a raw JSON body; any problem is an `InvalidRequest` naming the field."""
    try:
        request = cls.model_validate_json(body)
    except ValidationError as e:
        raise invalid_request(e) from None
    request.check_supported()
    return request


def invalid_request(e: ValidationError, prefix: str | None = None) -> InvalidRequest:
    """A pydantic error as the InvalidRequest naming its first field: the body's (`parse_request`), or, with
    `prefix`, a value's inside the request validated on its own (a structural tag at `prefix`)."""
    errors = e.errors()
    first = errors[0]
    loc = list(first["loc"])
    union = next((i for i, part in enumerate(loc) if isinstance(part, str) and _UNION_BRANCH.match(part)), None)
    if union is not None:  # pydantic tried each type of a union field: name the field, list the types
        loc = loc[:union]
    param = ".".join([*([prefix] if prefix else []), *(str(p) for p in loc)]) or "body"
    if first["type"] == "json_invalid":
        message, param = f"the request body is not valid JSON ({first['msg']})", "body"
    elif first["type"] == "model_type" and param == "body":
        message = "the request body must be a JSON object"
    elif first["type"] == "extra_forbidden":
        message = f"unknown field '{param}'"
    elif first["type"] == "missing":
        message = f"missing required field '{param}'"
    elif union is not None:
        tried = list(
            dict.fromkeys(
                err["loc"][union] for err in errors if len(err["loc"]) > union and list(err["loc"][:union]) == loc
            )
        )
        got = f" (got {shown(first.get('input'))})" if len(first["loc"]) == union + 1 else ""
        message = (
            f"{param}: expected {', '.join(tried[:-1])} or {tried[-1]}{got}"
            if len(tried) > 1
            else f"{param}: {first['msg']}{got}"
        )
    else:
        message = f"{param}: {first['msg']} (got {shown(first.get('input'))})"
    return InvalidRequest(message, param=param)


# How pydantic names the member of a union it tried in an error's location ("str", "list[int]", ...), as opposed to
# a field name or a list index.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|set)\[.*\]|function-\w+\[.*\])$")


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- responses -----------------------------------------------------------------------------------------------------
# What the server sends, as models: the functions below build these shapes as plain dicts (the hot path), and the
# published contract (/openapi.json, `pylon.serving.api.openapi`) states them through these models. A unit test
# holds the two together.


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorObject(_Response):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error, ...")
    param: str | None = Field(description="the request field at fault, if one is")
    code: int | str | None = Field(description="the HTTP status")


class ErrorResponse(_Response):
    """OpenAI's error object: the body of every 4xx and 5xx this server answers itself."""

    error: ErrorObject


FinishReason = Literal["stop", "length", "abort", "tool_calls", "repetition"]


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(ge=0, description="prompt tokens whose KV cache an earlier request had computed")


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = Field(
        ge=0, description="completion tokens of the replies' reasoning blocks (with http.reasoning_parser set)"
    )


class Usage(_Response):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="present where the deployment reads reasoning (http.reasoning_parser), for chat"
    )


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: one entry per token of the choice's text (the prompt's first, with
    echo; the first prompt token has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(
        description="the `logprobs` most likely tokens at each position, and the chosen one"
    )
    text_offset: list[int] = Field(description="where each token's text starts in the choice's text")


def _absent_when_unset(schema: dict) -> None:
    schema.pop("default", None)  # a key the server leaves out, never one it sends as null


class VllmLogprob(_Response):
    """One entry of vLLM's `prompt_logprobs`."""

    logprob: float
    rank: int | None = Field(description="1 for the most likely token")
    decoded_token: str


# vLLM's fields, present where the request asks for them (prompt_logprobs, return_token_ids)
PromptLogprobs = list[dict[str, VllmLogprob] | None]


def _vllm_field(description: str):
    return Field(None, description=description, json_schema_extra=_absent_when_unset)


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs = _vllm_field(
        "with prompt_logprobs: per prompt token (null at the first), its token's and the most likely tokens' logprobs"
    )  # type: ignore[assignment]
    prompt_token_ids: list[int] | None = _vllm_field("with return_token_ids: the prompt's token ids (streamed: first)")
    token_ids: list[int] = _vllm_field("with return_token_ids: the choice's (or chunk's) generated token ids")  # type: ignore[assignment]


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Response):
    """One event of a streamed completion (`data: <this JSON>`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1, max_length=1)
    usage: Usage = _vllm_field("with stream_options.continuous_usage_stats: the usage so far")  # type: ignore[assignment]


class FunctionCall(_Response):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string (OpenAI's shape)")


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] = Field(None, json_schema_extra=_absent_when_unset)  # type: ignore[assignment]
    reasoning_content: str | None = Field(
        None,
        description="the model's reasoning (its <think> block), where the deployment sets http.reasoning_parser",
        json_schema_extra=_absent_when_unset,
    )


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes (its raw bytes, for part of a character)")


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    token_ids: list[int] = _vllm_field("with return_token_ids: the choice's generated token ids")  # type: ignore[assignment]


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = _vllm_field(
        "with prompt_logprobs: per prompt token (null at the first), its token's and the most likely tokens' logprobs"
    )  # type: ignore[assignment]
    prompt_token_ids: list[int] | None = _vllm_field("with return_token_ids: the rendered prompt's token ids")


class ChatDelta(_Response):
    """The first chunk carries the role (and empty content), the next ones content, the last one may be empty."""

    role: Literal["assistant"] = Field(None, json_schema_extra=_absent_when_unset)  # type: ignore[assignment]
    content: str = Field(None, json_schema_extra=_absent_when_unset)  # type: ignore[assignment]
    tool_calls: list["ToolCallDelta"] = Field(None, json_schema_extra=_absent_when_unset)  # type: ignore[assignment]
    reasoning_content: str = Field(None, json_schema_extra=_absent_when_unset)  # type: ignore[assignment]


class ToolCallDelta(ToolCall):
    """A streamed tool call: Pylon sends each call whole, in one delta, at the end of the reply."""

    index: int


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    token_ids: list[int] = _vllm_field("with return_token_ids: the chunk's generated token ids")  # type: ignore[assignment]


class ChatCompletionChunk(_Response):
    """One event of a streamed chat completion (`data: <this JSON>`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(min_length=1, max_length=1)
    prompt_logprobs: PromptLogprobs = _vllm_field("with prompt_logprobs: on the first chunk")  # type: ignore[assignment]
    prompt_token_ids: list[int] | None = _vllm_field("with return_token_ids: on the first chunk")
    usage: Usage = _vllm_field("with stream_options.continuous_usage_stats: the usage so far")  # type: ignore[assignment]


class UsageChunk(_Response):
    """A stream's last event before [DONE] when `stream_options.include_usage`: no choices, only usage."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[None] = Field(max_length=0)
    usage: Usage


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    owned_by: str
    created: int
    max_model_len: int
    parent: str | None = Field(
        None, description="a LoRA adapter's base model (engine.adapters), as vLLM lists one; null for the base model"
    )


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


# -- OpenAI's Files and Batch APIs (pylon.serving.api.batch_api) ---------------------------------------------------


class BatchCreateRequest(BaseModel):
    """POST /v1/batches: OpenAI's "create batch"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1, description="an uploaded file (purpose batch) of Batch API requests")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"] = Field(
        description="the url every request of the file names"
    )
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(
        None, max_length=16, description="up to 16 pairs of your own, kept with the batch"
    )
    output_expires_after: dict[str, Any] | None = Field(None, description="accepted; files here do not expire")


def parse_batch_request(body: bytes) -> BatchCreateRequest:
    try:
        return BatchCreateRequest.model_validate_json(body)
    except ValidationError as e:
        raise invalid_request(e) from None


class FileObject(_Response):
    id: str
    object: Literal["file"]
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    expires_at: int | None = None
    status_details: str | None = None


class FileList(_Response):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Deleted(_Response):
    id: str
    object: str
    deleted: bool


class BatchRequestCounts(_Response):
    total: int = Field(ge=0)
    completed: int = Field(ge=0)
    failed: int = Field(ge=0)


class BatchError(_Response):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(_Response):
    object: Literal["list"]
    data: list[BatchError]


class Batch(_Response):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(_Response):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class TokenizeResponse(_Response):
    count: int = Field(ge=0, description="how many tokens: the request's prompt_tokens in a completion's usage")
    max_model_len: int = Field(ge=1, description="the model's context, prompt and completion together")
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class Embedding(_Response):
    object: Literal["embedding"]
    index: int = Field(ge=0, description="the input's place in the request's input list")
    embedding: list[float] | str = Field(
        description="the vector, or with encoding_format base64 its float32 values (little-endian) in base64"
    )


class EmbeddingUsage(_Response):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingResponse(_Response):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int = Field(ge=0, description="the document's place in the request's documents")
    document: RerankDocument | None = Field(description="the document (null with return_documents: false)")
    relevance_score: float = Field(
        description="a cross-encoder's score of the pair, or the cosine of the query's and the document's vectors"
    )


class RerankUsage(_Response):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="the documents by relevance, the most relevant first")


class ScoreData(_Response):
    index: int = Field(ge=0, description="the pair's place: text_2's index")
    object: Literal["score"]
    score: float = Field(description="a cross-encoder's score of the pair, or the cosine of the two texts' vectors")


class ScoreResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: RerankUsage


class ClassificationData(_Response):
    index: int = Field(ge=0, description="the input's place")
    label: str = Field(description="the label of the largest output (the config's id2label)")
    probs: list[float] = Field(description="each label's probability (with use_activation false: its logit)")
    num_classes: int = Field(ge=1)


class PoolingUsage(_Response):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    prompt_tokens_details: None = None


class ClassificationResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class PoolingData(_Response):
    index: int = Field(ge=0)
    object: Literal["pooling"]
    data: list[float] | str = Field(description="a classifier's outputs, or an embedding (base64 where asked)")


class PoolingResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class HealthStatus(_Response):
    """GET /health: "ok" with 200, else why not with 503."""

    status: str


class ReadyStatus(_Response):
    ready: bool
    model: str
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    kv_cache_usage: float = Field(ge=0, le=1)
    revision: str = Field(
        description="the deployment config this replica runs (its `user_config` revision; a deploy waits for it)"
    )


def embedding_data(index: int, hidden: list[float], dimensions: int | None, encoding_format: str) -> dict:
    """One input's entry of an embeddings response: the final hidden state `hidden`, cut to `dimensions` (None: all)
    and L2-normalised, as floats or as base64 of its float32 bytes (little-endian, as OpenAI sends them)."""
    vector = np.asarray(hidden, dtype=np.float32)[:dimensions]
    vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if encoding_format == "base64":
        encoded = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return {"object": "embedding", "index": index, "embedding": encoded}
    return {"object": "embedding", "index": index, "embedding": vector.tolist()}


def new_id(prefix: str) -> str:
    """`prefix`-<32 random hex digits>, as uuid4().hex but without building a UUID object (three per request)."""
    return f"{prefix}-{os.urandom(16).hex()}"


def merge_choices(responses: list[dict]) -> dict:
    """One response of many choices from one-choice responses (`completion_response`'s or `chat_response`'s), in
    order, each choice with its `index` (the caller sets the usage of them all)."""
    if len(responses) == 1:
        return responses[0]
    return {**responses[0], "choices": [{**r["choices"][0], "index": k} for k, r in enumerate(responses)]}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> dict:
    """OpenAI's usage; `reasoning_tokens` (of the completion tokens) where a reasoning parser reads the replies."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    logprobs: dict | None = None,
    cached_tokens: int = 0,
) -> dict:
    return {
        **completion_chunk(rid, model, text, finish_reason, logprobs),
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def chat_response(
    rid: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    logprobs: dict | None = None,
    cached_tokens: int = 0,
    tool_calls: list[dict] | None = None,
    reasoning_content: str | None = None,
    with_reasoning: bool = False,
) -> dict:
    """`with_reasoning`: the deployment splits replies' reasoning off, and the message carries `reasoning_content`
    (null for a reply without any)."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if with_reasoning:
        message["reasoning_content"] = reasoning_content
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def vllm_logprob(value: float, rank: int, decoded: str) -> dict:
    """One entry of vLLM's prompt_logprobs: {logprob, rank (1: the most likely), decoded_token}."""
    return {"logprob": _logprob(value), "rank": rank or None, "decoded_token": decoded}


MIN_LOGPROB = -9999.0  # what a logprob of -inf (a token the model rules out) is sent as: JSON has no infinity


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN too


class LogprobsFormat:
    """A request's engine logprobs (`TokenLogprob`s, paired with their token ids) in OpenAI's shapes, token texts
    from `TokenTexts`. Completions' `text_offset` runs on across the calls of one stream (each call one chunk's
    tokens), counted in the tokens' own texts as vLLM counts them."""

    def __init__(self, texts: "TokenTexts", *, as_ids: bool = False):
        """`as_ids`: each token is written "token_id:<id>" (vLLM's return_tokens_as_token_ids: a token that is no
        text of its own, part of a character, still says which it is), its bytes that string's."""
        self.texts = texts
        self.offset = 0
        self.as_ids = as_ids

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or `token_id:<id>`."""
        return f"token_id:{token_id}" if self.as_ids else self.texts.text(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        return list(f"token_id:{token_id}".encode()) if self.as_ids else self.texts.bytes(token_id)

    def completion(self, pairs: "list[tuple[int, TokenLogprob | None]]") -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (the top ones and the chosen one, by token
        text; null where a token has no logprob: the first of an echoed prompt), text_offset."""
        text = self.token_text
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in pairs:
            token = text(token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_logprob(entry.logprob))
            top = {}
            for alternative, value in entry.top:
                top.setdefault(text(alternative), _logprob(value))
            top.setdefault(token, _logprob(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, pairs: "list[tuple[int, TokenLogprob | None]]") -> dict:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
        text, raw = self.token_text, self._bytes
        content = []
        for token_id, entry in pairs:
            if entry is None:
                continue
            content.append(
                {
                    "token": text(token_id),
                    "logprob": _logprob(entry.logprob),
                    "bytes": raw(token_id),
                    "top_logprobs": [{"token": text(t), "logprob": _logprob(v), "bytes": raw(t)} for t, v in entry.top],
                }
            )
        return {"content": content}


class StreamEvents:
    """One stream's server-sent events: `data: <JSON>\n\n` strings, with the parts every chunk of the stream
    shares (id, object, created, model, and the choice's index: a request of `n` choices has one per choice, sharing
    id and created) laid out once and each chunk's text and finish reason spliced in.
    The JSON is `completion_chunk`'s / `chat_chunk`'s, key for key, as `json.dumps` would write it with
    compact separators; every chunk of a stream carries the same `created`, as OpenAI's do."""

    def __init__(
        self, kind: Literal["completion", "chat"], rid: str, model: str, *, index: int = 0, created: int | None = None
    ):
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self.kind, self.rid, self.model, self.obj = kind, rid, model, obj
        self.created = int(time.time()) if created is None else created
        self._head = (
            f'data: {{"id":{_quote(rid)},"object":"{obj}","created":{self.created},'
            f'"model":{_quote(model)},"choices":[{{"index":{int(index)},'
        )

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> str:
        """A completion chunk (`"text"`) or a chat chunk (`"delta"`: content, or nothing once text is done), with
        its tokens' `logprobs` (`LogprobsFormat`'s) when the request asked for them."""
        reason = "null" if finish_reason is None else _quote(finish_reason)
        if self.kind == "completion":
            body = f'"text":{_quote(text)}'
        else:
            body = f'"delta":{{"content":{_quote(text)}}}' if text else '"delta":{}'
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"))
        return f'{self._head}{body},"finish_reason":{reason},"logprobs":{lp}}}]}}\n\n'

    def tool_calls(self, calls: list[dict], finish_reason: str | None) -> str:
        """A chat chunk carrying whole tool calls (OpenAI's delta shape, each with its `index`)."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        reason = "null" if finish_reason is None else _quote(finish_reason)
        body = json.dumps(delta, separators=(",", ":"), ensure_ascii=False)
        return f'{self._head}"delta":{body},"finish_reason":{reason},"logprobs":null}}]}}\n\n'

    def reasoning(self, text: str, logprobs: dict | None = None) -> str:
        """A chat chunk of the model's reasoning (`delta.reasoning_content`: `pylon.serving.api.reasoning`)."""
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"))
        return (
            f'{self._head}"delta":{{"reasoning_content":{_quote(text)}}},"finish_reason":null,"logprobs":{lp}}}]}}\n\n'
        )

    def role(self) -> str:
        """Chat's first chunk: the assistant's role, empty content."""
        return f'{self._head}"delta":{{"role":"assistant","content":""}},"finish_reason":null,"logprobs":null}}]}}\n\n'

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
    ) -> str:
        return self.event(
            usage_chunk(
                self.rid,
                self.model,
                self.obj,
                prompt_tokens,
                completion_tokens,
                created=self.created,
                cached_tokens=cached_tokens,
                reasoning_tokens=reasoning_tokens,
            )
        )

    @staticmethod
    def splice(event: str, choice_fields: dict, response_fields: dict) -> str:
        """A built event with more fields in its choice and at its top level (each event ends `...}]}` + two
        newlines: the choice's object, the choices list, the event's object)."""
        if not choice_fields and not response_fields:
            return event
        if not event.endswith("}]}\n\n"):
            raise ValueError("not a chunk event of one choice")
        more = "".join(f",{_quote(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in choice_fields.items())
        top = "".join(f",{_quote(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in response_fields.items())
        return f"{event[:-5]}{more}}}]{top}}}\n\n"

    @staticmethod
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    @staticmethod
    def done() -> str:
        """The stream's end."""
        return "data: [DONE]\n\n"


def usage_chunk(
    rid: str,
    model: str,
    obj: str,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    created: int | None = None,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, only usage."""
    created = int(time.time()) if created is None else created
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens),
    }


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
ChatDelta.model_rebuild()
