"""Structured outputs: each step's token masks, from a grammar a request names (a JSON schema, any JSON object, or a
Lark grammar for tool calls), so that whatever the model's weights the output parses and validates.

The masks come from llguidance (the Rust library behind OpenAI-compatible structured outputs in vLLM's and
SGLang's `guidance` backend). Chosen over XGrammar on two counts measured here: it needs nothing but its own 3 MB
wheel (XGrammar 0.2.9 requires torch, transformers, triton and apache-tvm-ffi, and triton alone is hundreds of MB on
a CPU machine), and it computes a mask lazily per step from the token trie with no per-schema precompilation, so a
new schema costs milliseconds to take (docs/serving.md, "Structured outputs", has the figures).

A grammar is compiled once: `Guides` keeps a pristine `LLMatcher` per distinct grammar (LRU, `CACHE_SIZE`) and
every request gets a `deep_copy` of it. The step asks each guided row for its mask before sampling and the
sampled token is fed back after; rows without a guide are untouched, so guided and free requests share batches.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pylon.serving.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_SIZE = 128  # distinct grammars kept compiled
MAX_GRAMMAR_CHARS = 1_000_000  # a schema or grammar past this is refused before it is compiled
# OpenAI's structured outputs emit compact JSON; flexible whitespace would let a weak model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(guide: dict[str, Any]) -> str:
    """The llguidance grammar (its JSON form) for a request's `guide`:
    {"type": "json_object"}, {"type": "json_schema", "schema": {...}}, {"type": "lark", "grammar": "..."} or
    {"type": "regex", "regex": "..."} (the whole output matches it).
    Raises InvalidRequest (param `guide["param"]`, default "response_format") for what cannot be one."""
    import llguidance

    param = guide.get("param") or "response_format"
    kind = guide.get("type")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            schema = guide.get("schema")
            if not isinstance(schema, dict):
                got = type(schema).__name__
                raise InvalidRequest(f"{param}: the JSON schema must be an object (got {got})", param=param)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(str(guide.get("grammar", "")))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(guide.get("regex", "")))
    except ValueError as e:
        raise InvalidRequest(f"{param}: {e}", param=param) from None
    raise InvalidRequest(f"{param}: unknown guide type {kind!r}", param=param)


def choice_rule(choices: list[str]) -> str:
    """The body of a Lark rule that matches exactly one of `choices` (string literals: JSON's escapes are Lark's)."""
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def cache_key(guide: dict[str, Any]) -> str:
    """One string per distinct grammar (key order in the schema does not matter)."""
    key = json.dumps({k: v for k, v in guide.items() if k != "param"}, sort_keys=True, separators=(",", ":"))
    return key


class Guides:
    """The engine's grammar side: an llguidance tokenizer built once from the model's tokenizer, a cache of
    compiled grammars, and the batched mask a step applies."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.compiled_total = 0  # grammars compiled (cache misses)
        self.guided_tokens_total = 0  # tokens sampled under a mask

    @property
    def lltokenizer(self):
        if self._lltok is None:
            self._lltok = _lltokenizer(self._tokenizer, self.vocab_size)
        return self._lltok

    def matcher(self, guide: dict[str, Any]):
        """A fresh matcher (at the start of the output) for `guide`; compiles it on first sight. Raises
        InvalidRequest naming the grammar's fault."""
        import llguidance

        param = guide.get("param") or "response_format"
        key = cache_key(guide)
        if len(key) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"{param}: the schema is {len(key):,} characters; at most {MAX_GRAMMAR_CHARS:,} are taken", param=param
            )
        pristine = self._compiled.get(key)
        if pristine is None:
            grammar = grammar_of(guide)
            try:
                failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
                if not failed:
                    pristine = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
                    failed, messages = pristine.is_error(), [pristine.get_error()]
            except Exception as e:  # the grammar is the request's: whatever it does to the compiler is a 400
                failed, messages = True, [f"{type(e).__name__}: {e}"]
            if failed:
                raise InvalidRequest(
                    f"{param}: cannot be compiled: {messages[0]}", param=_pointer_param(param, messages[0])
                )
            self.compiled_total += 1
            self._compiled[key] = pristine
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return pristine.deep_copy()

    def apply(self, logits: "torch.Tensor", rows: list[int], matchers: list, eos_id: int) -> "torch.Tensor":
        """`logits` with every token the matchers of `rows` forbid at -inf (a new tensor; the model's own logits
        stay for log-probabilities). A matcher in an error state (it should not be: only allowed tokens reach it)
        allows only `eos_id`, which ends its request."""
        import torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        failed = []
        for j, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
            if matcher.is_error():
                error = matcher.get_error()
                log.warning("structured output: the matcher failed (%s); ending the request", error[:300])
                failed.append(j)
        allowed = _allowed(bitmask, logits.shape[1])
        for j in failed:
            allowed[j] = False
            allowed[j, eos_id] = True
        masked = logits.clone()
        index = torch.tensor(rows, device=logits.device)
        masked[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        self.guided_tokens_total += len(rows)
        return masked

    def draft_rows(
        self, rows: "torch.Tensor", draft: list[int], matcher, eos_id: int
    ) -> tuple["torch.Tensor", list[int]]:
        """A speculating guided request's verification rows masked as a plain step would mask each: row i by the
        matcher's state after draft[:i]. The draft is cut before its first token the grammar refuses (that token's
        probability is 0 under the mask, so the acceptance rule rejects it for certain; the rows past it are never
        read). Returns (the masked rows, one more than the draft kept; the draft kept). The matcher is walked along
        the draft and rolled back: it ends as it started, for the caller to consume what verification emits."""
        import torch

        keep = matcher.validate_tokens(draft) if draft else 0
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((keep + 1, words), dtype=torch.int32)
        n, failed, consumed = keep + 1, False, 0
        for i in range(keep + 1):
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            if matcher.is_error():  # as in `apply`: only eos, which ends the request
                log.warning("structured output: the matcher failed (%s); ending the request", matcher.get_error()[:300])
                n, failed = i + 1, True
                break
            if i < keep:
                matcher.consume_token(draft[i])  # validated above; were it refused, the next mask sees the error
                consumed += 1
        matcher.rollback(consumed)
        allowed = _allowed(bitmask[:n], rows.shape[1])
        if failed:
            allowed[n - 1] = False
            allowed[n - 1, eos_id] = True
        return rows[:n].masked_fill(~allowed.to(rows.device), float("-inf")), draft[: n - 1]


def _allowed(bitmask: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """llguidance's bitmasks ([rows, words] int32, one bit per token) as [rows, vocab] booleans."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _pointer_param(param: str, message: str) -> str:
    """`param` extended by the schema path llguidance names in `message` ("Pointer '/defs/x' does not exist"),
    where it names one."""
    import re

    found = re.search(r"'(/[^']*)'", message)
    if not found:
        return param
    return param + "".join(f".{part}" for part in found.group(1).strip("/").split("/") if part)


def _lltokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model's tokenizer: the `tokenizers` JSON of a Hugging Face or tokenizers-file
    tokenizer, or each id's bytes for the byte tokenizer."""
    import llguidance

    eos = int(tokenizer.eos_id)
    inner = getattr(tokenizer, "_tok", None)
    backend = getattr(inner, "backend_tokenizer", None) or inner
    if backend is not None and hasattr(backend, "to_str"):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    from pylon.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(vocab_size, eos)), n_vocab=vocab_size)
    raise InvalidRequest(
        f"structured outputs need a tokenizer llguidance can read (Hugging Face fast, a tokenizers file, or bytes); "
        f"this model's is {type(tokenizer).__name__}",
        param="response_format",
    )


class _ByteTokens:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads one: ids 0-255 are bytes, the rest special."""

    bos_token_id = None

    def __init__(self, vocab_size: int, eos: int):
        self.eos_token_id = eos
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def check_json_schema(schema: dict, param: str) -> None:
    """`schema` is a JSON Schema by its own metaschema (draft 2020-12 unless it says `$schema`); otherwise an
    InvalidRequest whose param is `param` plus the path of the fault inside the schema."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f".{part}" for part in e.path)
        raise InvalidRequest(f"{param}{where}: not a valid JSON Schema: {e.message}", param=f"{param}{where}") from None
