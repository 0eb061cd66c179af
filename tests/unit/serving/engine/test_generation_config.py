"""The model's generation_config.json (`engine/generation.py`): every end-of-sequence id it lists ends a generation
(not as text, finish reason "stop", unless ignore_eos; min_tokens holds all of them back; a speculating step's
accepted drafts past one are cut), its sampling defaults are read and checked, and a bad file stops the engine at
start naming the file and the key. The replica's use of the defaults: tests/unit/serving/api/test_serving_http.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import fsspec
import pytest
from engine_models import GREEDY, PROMPTS, Family, assert_pool_empty, run, spec, speculating, tokens_of

from pylon.data.tokenizer import ByteTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.generation import GenerationConfig, read_generation_config
from pylon.serving.engine.sampling import SamplingParams

EOS = ByteTokenizer().eos_id  # 256: the tokenizer's, and the tiny models' config.json's
VOCAB = 320


def with_generation_config(family: Family, directory: Path, generation: dict | str) -> str:
    """A copy of `family`'s export whose generation_config.json is `generation` (JSON, or the file's text)."""
    shutil.copytree(family.dir, directory)
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (directory / "generation_config.json").write_text(text)
    return str(directory)


def first_new(tokens: list[int], start: int, avoid: set[int]) -> int:
    """The first index >= start whose token occurs nowhere before it and is not in `avoid`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in avoid)


# ---------------------------------------------------------------------------------------------------------
# Reading the files
# ---------------------------------------------------------------------------------------------------------


def model_dir(tmp_path: Path, generation: dict | str | None, config: dict | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config if config is not None else {"eos_token_id": EOS}))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    return str(tmp_path)


def test_eos_ids_and_sampling_defaults_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    qwen3 = {
        "bos_token_id": 151643,
        "do_sample": True,  # ignored, as vLLM ignores it
        "eos_token_id": [300, 7],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0,
        "repetition_penalty": 1.05,
        "max_new_tokens": 64,
        "num_beams": 4,  # not a key vLLM reads
        "transformers_version": "4.51.0",
    }
    directory = model_dir(tmp_path, qwen3, {"eos_token_id": 7})
    read = read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB)
    # generation_config.json's, then config.json's, then the tokenizer's, each once
    assert read.eos_token_ids == (300, 7, EOS)
    assert read.sampling == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    defaults = read.default_params()  # a request that gives nothing
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    assert defaults.max_tokens is None  # the engine caps the model's 64 by the context left
    # engine.generation_config: none: the sampling keys are not read; the eos ids count all the same
    unread = read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB, sampling=False)
    assert unread == GenerationConfig((300, 7, EOS), {})
    assert unread.default_params() == SamplingParams()

    # do_sample false with a temperature samples at that temperature (vLLM's reading); nulls are not set
    directory = model_dir(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": None, "eos_token_id": 9})
    assert read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB) == GenerationConfig(
        (9, EOS), {"temperature": 0.7}
    )
    (tmp_path / "generation_config.json").unlink()  # no file: config.json's eos and the tokenizer's
    assert read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB) == GenerationConfig((EOS,), {})


BAD = {
    "temperature -1": ({"temperature": -1}, "temperature: must be between 0 and 100 (0 is greedy) (got -1)"),
    "temperature a string": ({"temperature": "0.7"}, 'temperature: must be a number (got "0.7")'),
    "top_p 0": ({"top_p": 0}, "top_p: must be > 0 and <= 1 (got 0)"),
    "top_k a fraction": ({"top_k": 2.5}, "top_k: must be an integer (got 2.5)"),
    "top_k -2": ({"top_k": -2}, "top_k: must be >= -1 (0 and -1 keep every token) (got -2)"),
    "min_p 2": ({"min_p": 2}, "min_p: must be between 0 and 1 (got 2)"),
    "repetition_penalty true": ({"repetition_penalty": True}, "repetition_penalty: must be a number (got true)"),
    "max_new_tokens 0": ({"max_new_tokens": 0}, "max_new_tokens: must be >= 1 (got 0)"),
    "temperature NaN": ('{"temperature": NaN}', "temperature: must be a number (got NaN)"),
}
BAD_EOS = {
    "eos past the vocabulary": (
        {"eos_token_id": [5, VOCAB]},
        "eos_token_id: 320 is not in the model's vocabulary (ids 0 to 319)",
    ),
    "eos a string": ({"eos_token_id": "2"}, 'eos_token_id: "2" is not a token id or a list of them'),
    "eos negative": ({"eos_token_id": [1, -1]}, "eos_token_id: [1, -1] is not a token id or a list of them"),
}


@pytest.mark.parametrize("case", [*BAD, *BAD_EOS])
def test_a_bad_value_names_the_file_and_the_key_and_what_to_do(tmp_path: Path, case: str) -> None:
    generation, expected = {**BAD, **BAD_EOS}[case]
    directory = model_dir(tmp_path, generation)
    where = f"{directory}/generation_config.json: "
    with pytest.raises(PylonError, match=re.escape(where + expected)) as raised:
        read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB)
    remedy = "engine.generation_config: none" if case in BAD else "fix the file"
    assert remedy in str(raised.value)
    if case in BAD:  # engine.generation_config: none does not read the sampling keys: the engine starts
        assert read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB, sampling=False).sampling == {}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_file_that_is_no_json_object_is_named(tmp_path: Path, text: str) -> None:
    directory = model_dir(tmp_path, text)
    with pytest.raises(PylonError, match=re.escape(f"{directory}/generation_config.json: cannot be read")):
        read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB, sampling=False)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": VOCAB + 5}))  # config.json's ids are checked too
    with pytest.raises(PylonError, match=re.escape(f"{directory}/config.json: eos_token_id: 325 is not in")):
        read_generation_config(directory, tokenizer_eos=EOS, vocab_size=VOCAB)


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "generation, key",
    [({"temperature": -1}, "temperature"), ({"eos_token_id": [7, 400]}, "eos_token_id"), ({"top_k": "20"}, "top_k")],
)
def test_a_bad_generation_config_stops_the_engine_at_start(gpt2: Family, tmp_path: Path, generation, key) -> None:
    directory = with_generation_config(gpt2, tmp_path / "m", generation)
    with pytest.raises(PylonError, match=re.escape(f"{directory}/generation_config.json: {key}: ")):
        LLMEngine(directory, spec())
    if key != "eos_token_id":  # the model's sampling defaults unread: it serves
        assert LLMEngine(directory, spec(generation_config="none")).generation.sampling == {}


def test_a_remote_models_bad_generation_config_is_named_by_its_uri(gpt2: Family) -> None:
    fs = fsspec.filesystem("memory")
    for path in Path(gpt2.dir).iterdir():
        fs.pipe(f"/generation-test/model/{path.name}", path.read_bytes())
    fs.pipe("/generation-test/model/generation_config.json", json.dumps({"top_p": 1.5}).encode())
    with pytest.raises(PylonError) as raised:
        LLMEngine("memory://generation-test/model", spec())
    message = str(raised.value)
    assert "generation-test/model/generation_config.json: top_p: must be > 0 and <= 1 (got 1.5)" in message
    assert message.startswith("memory://") and "pylon-model-" not in message


def test_generation_stops_at_any_eos_id_the_model_lists(gpt2: Family, tmp_path: Path) -> None:
    expected = gpt2.greedy[3]
    stop_at = first_new(expected, 3, {EOS})
    unused = next(t for t in range(EOS + 1, VOCAB) if t not in expected)
    # Llama 3.1 Instruct's shape: a list, here whose second id is the one the greedy output reaches
    directory = with_generation_config(gpt2, tmp_path / "m", {"eos_token_id": [unused, expected[stop_at]]})
    engine = LLMEngine(directory, spec())
    assert engine.eos_ids == {unused, expected[stop_at], EOS}
    engine.add_request("r", PROMPTS[3], GREEDY)
    outs = run(engine)["r"]
    assert tokens_of(outs) == expected[: stop_at + 1] and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == ByteTokenizer().decode(expected[:stop_at])  # the eos is not text
    [c] = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=len(expected), temperature=0, ignore_eos=True))
    assert c.token_ids == expected and c.finish_reason == "length"
    assert_pool_empty(engine)


def test_min_tokens_holds_back_every_eos_id(gpt2: Family, tmp_path: Path) -> None:
    first, second = 300, 301
    directory = with_generation_config(gpt2, tmp_path / "m", {"eos_token_id": [first, second]})
    engine = LLMEngine(directory, spec())
    # Every eos id made far likelier than any other token: one of them left unmasked would end the request at once.
    ends = {first, second, EOS}
    bias = dict.fromkeys(ends, 100.0)
    [c] = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias=bias))
    assert not ends & set(c.token_ids[:5]) and len(c.token_ids) == 6, c.token_ids
    assert c.token_ids[5] in ends and c.finish_reason == "stop"
    [c] = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, logit_bias=bias))
    assert len(c.token_ids) == 1 and c.token_ids[0] in ends and c.text == "" and c.finish_reason == "stop"


def test_a_speculating_step_stops_at_an_eos_id_among_its_accepted_drafts(gpt2: Family, tmp_path: Path) -> None:
    """The model as its own draft: each speculating step accepts its drafts and emits several tokens. An eos id
    in the middle of such a step ends the request there; the step's tokens after it are dropped."""
    draft = {"method": "draft", "draft_model": gpt2.dir, "num_tokens": 4}
    probe = speculating(gpt2.engine(speculative=draft))
    found = None  # a token that first occurs inside a step's tokens, not at the step's end (the request alone)
    for i, prompt in enumerate(PROMPTS):
        probe.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        chunks = [o.token_ids for o in run(probe)["r"]]
        tokens, start = [t for chunk in chunks for t in chunk], 0
        for chunk in chunks:
            for j in range(start, start + len(chunk) - 1):
                if found is None and tokens[j] not in tokens[:j] and EOS not in tokens[: j + 1]:
                    found = (i, tokens, j, len(chunk))
            start += len(chunk)
        if found is not None:
            break
    assert found is not None
    i, tokens, j, chunk_size = found
    directory = with_generation_config(gpt2, tmp_path / "m", {"eos_token_id": [tokens[j]]})
    engine = speculating(LLMEngine(directory, spec(speculative=draft)))
    engine.add_request("r", PROMPTS[i], SamplingParams(max_tokens=24, temperature=0))
    outs = run(engine)["r"]
    assert tokens_of(outs) == tokens[: j + 1] and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == ByteTokenizer().decode(tokens[:j])
    assert len(outs[-1].token_ids) < chunk_size  # the step that reached the eos, cut after it
    assert engine.stats().spec_accepted_tokens_total > 0
    assert_pool_empty(engine)


def test_a_request_without_params_takes_the_models_defaults(gpt2: Family, tmp_path: Path) -> None:
    """temperature 0 in the file: a request that gives no SamplingParams is greedy, transformers' own; the model's
    max_new_tokens bounds it, and is capped by the context the prompt leaves (never a refusal)."""
    directory = with_generation_config(gpt2, tmp_path / "m", {"temperature": 0, "max_new_tokens": 20})
    engine = LLMEngine(directory, spec())
    assert [c.token_ids for c in engine.generate(PROMPTS)] == gpt2.greedy  # 20 tokens each, or up to eos
    long_prompt = (PROMPTS[3] * 3)[:252]  # 252 of max_model_len's 256 tokens: 4 left
    [c] = engine.generate([long_prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(c.token_ids) == 4 and c.finish_reason == "length"
    [c] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(c.token_ids) == 20

    # engine.generation_config: none: OpenAI's defaults (temperature 1, 16 tokens); the eos ids count all the same
    openai = LLMEngine(directory, spec(generation_config="none"))
    assert openai.generation.sampling == {} and openai.eos_ids == {EOS}
    assert openai.generation.default_params() == SamplingParams()
    assert all(len(c.token_ids) <= 16 for c in openai.generate(PROMPTS[:2]))
