"""pylon.serving's engine end to end on tiny random GPT-2 and Llama models saved as Pylon exports (safetensors
+ pylon_tokenizer.json for the byte tokenizer): greedy outputs token for token equal to `transformers`'
own `generate`, under continuous batching, chunked prefill and preemption; abort, stop conditions, seeded
sampling, validation, and the asyncio engine with its health check."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fsspec
import pytest
import torch
from engine_models import (
    GREEDY,
    NEW_TOKENS,
    ON_CUDA,
    PROMPT_LENGTHS,
    PROMPTS,
    Family,
    assert_pool_empty,
    run,
    spec,
    tokens_of,
)

from pylon.data.tokenizer import ByteTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest
from pylon.specs import EngineSpec

# ---------------------------------------------------------------------------------------------------------
# Greedy outputs equal transformers' generate
# ---------------------------------------------------------------------------------------------------------


def test_reference_continuations_are_not_trivial(family: Family) -> None:
    # Guards the premise of the comparisons below: outputs that vary with the prompt and within themselves.
    assert len({tuple(g) for g in family.greedy}) == len(PROMPTS)
    assert all(len(set(g)) > 3 for g in family.greedy)


def test_continuous_batching_matches_transformers_greedy(family: Family) -> None:
    engine = family.engine()
    for i in range(5):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    outputs = run(engine, steps=4)  # the first five are mid-decode when the rest arrive
    assert all(len(tokens_of(outputs[f"r{i}"])) >= 2 for i in range(5))
    for i in range(5, len(PROMPTS)):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    for rid, outs in run(engine).items():
        outputs.setdefault(rid, []).extend(outs)

    for i, expected in enumerate(family.greedy):
        outs = outputs[f"r{i}"]
        assert tokens_of(outs) == expected, f"prompt {i} ({len(PROMPTS[i])} tokens)"
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == ("stop" if expected[-1] == 256 else "length")
        assert outs[-1].num_output_tokens == len(expected) and outs[-1].num_prompt_tokens == len(PROMPTS[i])
    stats = engine.stats()
    assert stats.prompt_tokens_total == sum(PROMPT_LENGTHS)
    assert stats.generation_tokens_total == sum(len(g) for g in family.greedy)
    assert_pool_empty(engine)


def test_chunked_prefill_matches_transformers_greedy(family: Family) -> None:
    engine = family.engine(max_num_batched_tokens=16, block_size=4)
    if not ON_CUDA:  # on an AVX-512 or AVX2 CPU the chunks go through the prefill kernel (head_dim 32, float32)
        from pylon.serving.model import kernels

        assert engine.runner.prefill == kernels.prefill_usable(torch.float32, torch.float32, 32)
        assert engine.runner.prefill or not kernels.load().has_prefill() or os.environ.get("PYLON_PREFILL_KERNEL")
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append(
            [(s.request.request_id, s.start, s.num_new_tokens, s.request.num_prompt_tokens) for s in batch.scheduled]
        )
        return batch

    engine.scheduler.schedule = recording_schedule
    result = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in result] == family.greedy

    assert all(sum(n for _, _, n, _ in step) <= 16 for step in steps)
    # Prompts longer than the budget were split across steps, and chunks shared steps with decodes.
    assert any(0 < start < prompt_len for step in steps for _, start, _, prompt_len in step)
    assert any(
        any(start >= prompt_len for _, start, _, prompt_len in step)
        and any(start + n < prompt_len for _, start, n, prompt_len in step)
        for step in steps
    )
    assert_pool_empty(engine)


def test_preemption_recomputes_and_matches_transformers_greedy(family: Family) -> None:
    # 256 tokens of KV (32 blocks of 8): each request fits alone, all eight together (~400 tokens) do not.
    engine = family.engine(kv_cache_tokens=256, block_size=8, max_num_batched_tokens=64)
    result = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in result] == family.greedy
    assert engine.stats().num_preemptions_total > 0
    assert_pool_empty(engine)


def test_model_from_a_uri_and_max_model_len_capped_at_the_models_positions(gpt2: Family) -> None:
    fs = fsspec.filesystem("memory")
    for path in Path(gpt2.dir).iterdir():
        fs.pipe(f"/serving-test/model/{path.name}", path.read_bytes())
    engine = LLMEngine("memory://serving-test/model", spec(max_model_len=1024, kv_cache_tokens=1024))
    assert engine.max_model_len == 256  # n_positions
    assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids == gpt2.greedy[1]


def test_a_damaged_file_of_a_remote_model_is_named_by_the_models_uri(gpt2: Family) -> None:
    """A remote model is loaded from a temporary copy, removed afterwards: the error names the model as given (the
    place to fix the file), not the copy."""
    fs = fsspec.filesystem("memory")
    for path in Path(gpt2.dir).iterdir():
        data = path.read_bytes()
        fs.pipe(f"/serving-test/damaged/{path.name}", data[: len(data) // 2] if path.suffix == ".safetensors" else data)
    with pytest.raises(PylonError) as raised:
        LLMEngine("memory://serving-test/damaged", spec())
    message = str(raised.value)
    assert (
        message.startswith("model memory://")
        and "serving-test/damaged: weights file model.safetensors is damaged" in message
    )
    assert "pylon-model-" not in message


# ---------------------------------------------------------------------------------------------------------
# Finishing: abort, length, stop strings, stop tokens, eos
# ---------------------------------------------------------------------------------------------------------


def test_abort_frees_slot_and_blocks_at_the_next_step(gpt2: Family) -> None:
    engine = gpt2.engine(max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i + 2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    run(engine, steps=3)
    assert [r.request_id for r in engine.scheduler.running] == ["r0", "r1"]
    held = len(engine.pool.block_table("r0"))
    free_before = engine.pool.num_free_blocks
    assert held > 0

    engine.abort("r0")  # running
    engine.abort("r2")  # still waiting: the sequence cap is 2
    engine.abort("no-such-request")
    assert engine.pool.num_free_blocks == free_before  # nothing happens until the next step
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "abort"}
    assert set(aborted) == {"r0", "r2"}
    assert engine.pool.block_table("r0") == [] and "r0" not in engine.scheduler.requests
    assert [r.request_id for r in engine.scheduler.running] == ["r1"]
    assert engine.pool.num_free_blocks >= free_before + held - 1  # r1 may have taken one block this step
    rest = run(engine)
    assert rest["r1"][-1].finish_reason == "length"
    assert engine.stats().requests_finished_total == {"abort": 2, "length": 1}
    assert_pool_empty(engine)
    engine.add_request("r0", PROMPTS[0], GREEDY)  # a finished id may be used again


def test_max_tokens_finishes_with_length(gpt2: Family) -> None:
    [c] = gpt2.engine().generate([PROMPTS[0]], SamplingParams(max_tokens=7, temperature=0))
    assert (c.token_ids, c.finish_reason) == (gpt2.greedy[0][:7], "length")


def test_max_tokens_none_runs_to_max_model_len(gpt2: Family) -> None:
    [c] = gpt2.engine(max_model_len=40).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    )
    assert len(c.token_ids) == 40 - len(PROMPTS[1]) and c.finish_reason == "length"


def test_stop_strings_truncate_the_text(gpt2: Family) -> None:
    engine = gpt2.engine()
    [full] = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    text = full.text
    # A two-character stop string taken from the middle of the greedy text (no replacement characters).
    k = next(k for k in range(3, len(text) - 2) if "\ufffd" not in text[k : k + 2])
    stop = text[k : k + 2]
    expected = text[: text.find(stop)]

    engine.add_request(
        "s", PROMPTS[3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["never-appears", stop])
    )
    outs = run(engine)["s"]
    assert "".join(o.text for o in outs) == expected
    assert outs[-1].finish_reason == "stop"
    assert tokens_of(outs) == full.token_ids[: len(tokens_of(outs))] and len(tokens_of(outs)) < 60
    assert_pool_empty(engine)


def test_stop_token_ids_and_eos(gpt2: Family) -> None:
    expected = gpt2.greedy[3]
    stop_at = next(i for i in range(3, len(expected)) if expected[i] not in expected[:i])
    engine = gpt2.engine()
    [c] = engine.generate(
        [PROMPTS[3]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[expected[stop_at]])
    )
    assert c.token_ids == expected[: stop_at + 1] and c.finish_reason == "stop"
    assert c.text == ByteTokenizer().decode(expected[:stop_at])  # the stop token is not text

    # An eos id of the model's stops the same way, unless ignore_eos (test_generation_config.py reads them from files).
    engine.eos_ids = frozenset({expected[stop_at]})
    [c] = engine.generate([PROMPTS[3]], GREEDY)
    assert c.token_ids == expected[: stop_at + 1] and c.finish_reason == "stop"
    [c] = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert c.token_ids == expected and c.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_batch_companions(gpt2: Family) -> None:
    engine = gpt2.engine()
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    [alone] = engine.generate([PROMPTS[2]], seeded)
    [again] = engine.generate([PROMPTS[2]], seeded)
    assert again.token_ids == alone.token_ids
    companions = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=s) for s in (1, 2)] + [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0),
        GREEDY,
    ]
    batch = engine.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[1], PROMPTS[3]],
        [companions[0], seeded, companions[1], companions[2], companions[3]],
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[4].token_ids == gpt2.greedy[3]
    [other_seed] = engine.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, top_k=50, seed=99)
    )
    assert other_seed.token_ids != alone.token_ids
    assert alone.token_ids != gpt2.greedy[2]  # it did sample


def test_top_k_1_is_greedy(gpt2: Family) -> None:
    result = gpt2.engine().generate(PROMPTS[:3], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.5, top_k=1))
    assert [r.token_ids for r in result] == gpt2.greedy[:3]


def test_extreme_sampling_parameters_never_break_the_step_for_the_batch(gpt2: Family) -> None:
    """Any temperature in (0, 100] and any top_k are a request's to give. 1e-40 is 0 in float32 and x / 1e-30
    overflows: before, such a request made the draw see NaN and the whole step (every request of the engine)
    fail. A near-zero temperature is the limit softmax tends to, the argmax: greedy's tokens."""
    engine = gpt2.engine()
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=t, seed=3) for t in (1e-40, 1e-30, 1e-300)] + [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=2**70, seed=3),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=100.0, top_p=1e-9, seed=3),
        GREEDY,
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results[:3]] == gpt2.greedy[:3]
    assert len(results[3].token_ids) == NEW_TOKENS and results[3].finish_reason == "length"
    assert results[4].token_ids == gpt2.greedy[4]  # top_p that small keeps only the best token
    assert results[5].token_ids == gpt2.greedy[5]
    [unbounded] = engine.generate([PROMPTS[3]], params[3])
    [all_k] = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=0, seed=3))
    assert unbounded.token_ids == all_k.token_ids  # a top_k past the vocabulary keeps every token
    assert_pool_empty(engine)


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_errors_name_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert e.value.param == param and param in str(e.value)
    assert isinstance(e.value, ValueError)


def test_sampling_params_accept_openai_and_vllm_spellings() -> None:
    p = SamplingParams(stop="###", top_k=-1)
    assert (p.stop, p.top_k) == (["###"], 0)


def test_request_errors_name_the_parameter(gpt2: Family) -> None:
    engine = gpt2.engine(max_model_len=64, kv_cache_tokens=64)
    cases = [
        (("a", "x" * 64, GREEDY), "prompt"),  # 64 tokens: no room left for output
        (("a", "", GREEDY), "prompt"),
        (("a", [1, 2, 320], GREEDY), "prompt"),  # past the vocabulary
        (("a", 12345, GREEDY), "prompt"),
        (("a", "x" * 50, SamplingParams(max_tokens=15)), "max_tokens"),  # 50 + 15 > 64
        (("", "hi", GREEDY), "request_id"),
    ]
    for args, param in cases:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request(*args)
        assert e.value.param == param, (args, e.value)
    engine.add_request("a", "x" * 50, SamplingParams(max_tokens=14))  # exactly max_model_len: fine
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("a", "hi", GREEDY)
    assert e.value.param == "request_id" and "already in use" in str(e.value)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(gpt2: Family) -> None:
    """The engine's step loop waits while a prompt is tokenized (21 s for 15 MB with a byte-level BPE): one that is
    longer in characters than max_model_len tokens can cover is refused on its length, and a list of token ids on
    its length before each id is looked at."""
    engine = gpt2.engine(max_model_len=64, kv_cache_tokens=64)
    encoded = []

    class Spy:  # the byte tokenizer, counting what it is asked to encode
        def __getattr__(self, name):
            return getattr(gpt2_tokenizer, name)

        def encode(self, text):
            encoded.append(len(text))
            return gpt2_tokenizer.encode(text)

    gpt2_tokenizer, engine.tokenizer = engine.tokenizer, Spy()
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("big", "é" * 5_000_000, GREEDY)
    assert e.value.param == "prompt" and "5000000 characters" in str(e.value) and "max_model_len (64)" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("ids", [1] * 1_000_000 + ["not an id"], GREEDY)
    assert e.value.param == "prompt" and "1000001 tokens" in str(e.value)
    assert encoded == []
    with pytest.raises(InvalidRequest) as e:  # 40 characters could be 40 tokens, but are 80 bytes: tokenized
        engine.add_request("two-byte", "é" * 40, GREEDY)
    assert encoded == [40] and "80 tokens" in str(e.value)
    [done] = engine.generate(["é" * 20], SamplingParams(max_tokens=3, temperature=0))
    assert len(done.token_ids) == 3 and encoded == [40, 20]


def test_unsupported_model_type_and_missing_tokenizer_are_clear(gpt2: Family, tmp_path: Path) -> None:
    mamba = tmp_path / "mamba"  # (a state-space model: no attention, nothing the engine's caches hold)
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (mamba / "pylon_tokenizer.json").write_text(Path(gpt2.dir, "pylon_tokenizer.json").read_text())
    with pytest.raises(PylonError, match=r"model_type 'mamba' is not supported.*gpt2, opt, gpt_neox, llama"):
        LLMEngine(str(mamba), EngineSpec(device="cpu"))

    no_tokenizer = tmp_path / "no-tok"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes(Path(gpt2.dir, name).read_bytes())
    with pytest.raises(PylonError, match="has no tokenizer"):
        LLMEngine(str(no_tokenizer), EngineSpec(device="cpu"))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "tokenizer-not-json", "tokenizer-not-object"])
def test_damaged_weights_and_tokenizer_files_are_named(gpt2: Family, tmp_path: Path, damage: str) -> None:
    """A model directory with a truncated or foreign weights file, none at all, or a broken pylon_tokenizer.json: the
    error names the directory and the file, and says what to do (transformers' and safetensors' own say "Error while
    deserializing header: incomplete metadata, file not fully covered", naming neither)."""
    model = tmp_path / "model"
    shutil.copytree(gpt2.dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    expected = {
        "truncated": r"weights file model\.safetensors is damaged \(SafetensorError: .*incomplete metadata",
        "garbage": r"weights file model\.safetensors is damaged",
        "missing": r"has no weights \(no \*\.safetensors or pytorch_model\.bin file\)",
        "tokenizer-not-json": r"pylon_tokenizer\.json cannot be read \(Expecting",
        "tokenizer-not-object": r"pylon_tokenizer\.json cannot be read \(a JSON object was expected",
    }[damage]
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x00" * 100)
    elif damage == "missing":
        weights.unlink()
    else:
        (model / "pylon_tokenizer.json").write_text("{oops" if damage == "tokenizer-not-json" else "[1, 2]")
    with pytest.raises(PylonError, match=expected) as raised:
        LLMEngine(str(model), EngineSpec(device="cpu"))
    assert str(model) in str(raised.value)
