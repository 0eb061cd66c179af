"""The model's own generation settings, as it ships them: how it ends a turn and how it is meant to be sampled, read
once at engine start from its directory's `generation_config.json` (and `config.json`).

- **End-of-sequence ids**: generation_config.json's `eos_token_id` (one id or a list: Llama 3.1 Instruct lists
  128001, 128008 and 128009; Qwen2.5 and Qwen3 Instruct <|im_end|> and <|endoftext|>), then config.json's, then the
  tokenizer's eos, each once. Any of them ends a request (finish reason "stop"; the id is in its token ids, never in
  its text) unless it asks `ignore_eos`, and `min_tokens` holds all of them back. They count whatever
  `engine.generation_config` says: they are how the model ends a turn, not a sampling choice.
- **Sampling defaults** (`engine.generation_config: auto`, as vLLM's `--generation-config auto`): the keys vLLM reads,
  `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`), where the
  file sets them (null is not set). The replica gives them to the fields a request leaves out; a value the request
  gives wins. A `max_tokens` default is capped by what the context leaves after the prompt (the engine's rule for a
  request without max_tokens). `do_sample` is ignored, as vLLM ignores it: a file with `do_sample: false` and a
  temperature samples at that temperature; greedy is temperature 0. Every other key is ignored too. Under
  `engine.generation_config: none` these keys are not read at all (requests get OpenAI's defaults).

A file that cannot be read as a JSON object, an eos id that is not an integer or is outside the model's vocabulary,
and a default of the wrong type or outside what a request may ask (`SamplingParams`) stop the engine at start with a
PylonError naming `<model dir>/<file>: <key>` and saying what to do. No generation_config.json: no defaults, and the
eos ids of config.json and the tokenizer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from pylon.errors import PylonError
from pylon.serving.engine.pooling import Classifier
from pylon.serving.engine.sampling import MAX_REPETITION_PENALTY, SamplingParams
from pylon.serving.errors import InvalidRequest, shown

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# generation_config.json's key -> (SamplingParams' field, integer or number, the values allowed, said in words):
# the ranges SamplingParams accepts from a request.
SAMPLING_KEYS = {
    "temperature": ("temperature", float, lambda v: 0 <= v <= 100, "between 0 and 100 (0 is greedy)"),
    "top_p": ("top_p", float, lambda v: 0 < v <= 1, "> 0 and <= 1"),
    "top_k": ("top_k", int, lambda v: v >= -1, ">= -1 (0 and -1 keep every token)"),
    "min_p": ("min_p", float, lambda v: 0 <= v <= 1, "between 0 and 1"),
    "repetition_penalty": (
        "repetition_penalty",
        float,
        lambda v: 0 < v <= MAX_REPETITION_PENALTY,
        f"> 0 and <= {MAX_REPETITION_PENALTY:g} (1 is neutral)",
    ),
    "max_new_tokens": ("max_tokens", int, lambda v: v >= 1, ">= 1"),
}


@dataclass(frozen=True)
class GenerationConfig:
    """What a model directory says about generating from it (plain data: it crosses the engine process's pipe).

    eos_token_ids: every id that ends a generation, generation_config.json's first, then config.json's, then the
    tokenizer's, each once.
    sampling: {SamplingParams field: the model's default} for the fields its generation_config.json sets (empty
    under `engine.generation_config: none`, or without the file).
    classifier: what a classifier's outputs mean (pooling.py), or None for a model that generates.
    """

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)
    # A classifier's labels and activations (pylon.serving.engine.pooling); None: a model that generates.
    classifier: Classifier | None = None
    # The engine keeps its recurrent layers' states where a request asks (SamplingParams.snapshot_at): a model with
    # recurrent layers, with the prefix cache (kv_cache.StateSnapshots)
    snapshots: bool = False
    # An encoder's token heads (SamplingParams.pool_task): "multi_vector" (ColBERT), "token_weights" (sparse)
    pool_tasks: tuple[str, ...] = ()

    def default_params(self) -> SamplingParams:
        """The SamplingParams of a request that gives none: SamplingParams' own defaults under the model's. A
        max_tokens default leaves max_tokens None, for the engine to cap by the context."""
        sampling = dict(self.sampling)
        if sampling.pop("max_tokens", None) is not None:
            sampling["max_tokens"] = None
        return SamplingParams(**sampling)

    def describe_sampling(self) -> str:
        """The sampling defaults as a log line shows them: "temperature=0.6, top_p=0.95, top_k=20"."""
        return ", ".join(f"{name}={value!r}" for name, value in self.sampling.items())


def read_generation_config(
    model_dir: str, *, tokenizer_eos: int | None, vocab_size: int, sampling: bool = True
) -> GenerationConfig:
    """The generation settings of the local model directory `model_dir` (see the module's docstring), for a model
    whose vocabulary has `vocab_size` ids and whose tokenizer ends a text with `tokenizer_eos`. `sampling` False
    (`engine.generation_config: none`): the sampling keys are neither read nor checked."""
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    generation = _read_json(path) if os.path.exists(path) else {}
    config_path = os.path.join(model_dir, MODEL_CONFIG_FILE)
    config = _read_json(config_path) if os.path.exists(config_path) else {}
    eos: list[int] = []
    for where, values in ((path, generation), (config_path, config)):
        for token in _eos_ids(where, values.get("eos_token_id"), vocab_size):
            if token not in eos:
                eos.append(token)
    if tokenizer_eos is not None and tokenizer_eos not in eos:
        eos.append(tokenizer_eos)
    defaults = _sampling_defaults(path, generation) if sampling else {}
    return GenerationConfig(tuple(eos), defaults)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"a JSON object was expected, not {type(values).__name__}")
    except (OSError, ValueError) as e:
        raise PylonError(f"{path}: cannot be read ({e}); fix the file, or remove it if it is not the model's") from None
    return values


def _eos_ids(where: str, value, vocab_size: int) -> list[int]:
    """`eos_token_id` of the file `where`: None (not set), one id, or a list of ids; each checked."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise PylonError(
                f"{where}: eos_token_id: {shown(value)} is not a token id or a list of them (integers >= 0); fix "
                "the file (the model's end-of-sequence ids: its tokenizer_config.json names the tokens)"
            )
        if token >= vocab_size:
            raise PylonError(
                f"{where}: eos_token_id: {token} is not in the model's vocabulary (ids 0 to {vocab_size - 1}); fix "
                "the file (the model's end-of-sequence ids: its tokenizer_config.json names the tokens)"
            )
    return list(ids)


def _sampling_defaults(where: str, generation: dict) -> dict:
    """{SamplingParams field: value} of the sampling keys `generation` (the file `where`) sets, each checked."""
    remedy = "fix or remove it, or set engine.generation_config: none to serve without the model's sampling defaults"
    defaults = {}
    for key, (name, kind, allowed, words) in SAMPLING_KEYS.items():
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PylonError(f"{where}: {key}: must be a number (got {shown(value)}); {remedy}")
        if kind is int and not isinstance(value, int):
            raise PylonError(f"{where}: {key}: must be an integer (got {shown(value)}); {remedy}")
        if not allowed(value):
            raise PylonError(f"{where}: {key}: must be {words} (got {shown(value)}); {remedy}")
        defaults[name] = value
    try:  # what a request may ask, as SamplingParams checks it (the table above says the same)
        SamplingParams(**{n: v for n, v in defaults.items() if n != "max_tokens"})
    except InvalidRequest as e:
        raise PylonError(f"{where}: {e.param}: {e}; {remedy}") from None
    return defaults
