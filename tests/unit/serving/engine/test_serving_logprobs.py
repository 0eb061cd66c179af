"""Log-probabilities from the engine: generated tokens' (`SamplingParams.logprobs`) and prompt tokens'
(`prompt_logprobs`), equal within 1e-4 to `transformers`' own log-softmax over the same model's fp32 logits, for both
model families, under continuous batching, chunked prefill, preemption and through the engine process (the outputs
pickled across its pipe); max_tokens 0 scoring a prompt; and a step without a logprobs request doing nothing more."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from engine_models import DEVICE, FAMILIES, PROMPTS, Family, assert_pool_empty, run, spec, tokens_of
from test_serving_text import hf_dir  # noqa: F401 - a byte-level BPE tokenizer's directory (the fixture)

from pylon.serving.engine import engine as engine_module
from pylon.serving.engine.engine import merge_outputs
from pylon.serving.engine.request import RequestMetrics, RequestOutput, TokenLogprob
from pylon.serving.engine.sampling import SamplingParams, token_logprobs
from pylon.serving.errors import InvalidRequest

TOL = 1e-4
K = 5
# The engine tests' tiny models at half their weights' scale: at 0.5 their logits are so sharp that transformers'
# own fp32 log-softmax at a position moves by 1.3e-4 with the length of the sequence it is computed in (GPT-2), the
# noise floor above the 1e-4 checked here; at 0.25 that is ~1e-5, and the continuations still vary with the prompt.
INIT = 0.25


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}-logprobs"), initializer_range=INIT)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Family:
    return Family("gpt2", tmp_path_factory.mktemp("gpt2-logprobs"), initializer_range=INIT)


def reference(family: Family, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the fp32 logits of `ids`: row p scores the token at p + 1."""
    with torch.no_grad():
        logits = family.model(torch.tensor([ids], device=DEVICE)).logits
    return torch.log_softmax(logits.float(), -1)[0].cpu()


def assert_entry(entry: TokenLogprob, row: torch.Tensor, token: int, k: int, where: str) -> None:
    assert entry.token_id == token, where
    assert abs(entry.logprob - float(row[token])) < TOL, (where, entry.logprob, float(row[token]))
    assert len(entry.top) == k and len({t for t, _ in entry.top}) == k, where
    values, ids = row.topk(k)
    for (t, v), best in zip(entry.top, values.tolist()):
        # each alternative's own logprob, and the k best: the i-th is transformers' i-th (or tied with it)
        assert abs(v - float(row[t])) < TOL and abs(v - best) < TOL, (where, entry.top, ids.tolist())
    assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True), where


def check_request(family: Family, prompt: list[int], outs: list[RequestOutput], *, k: int, prompt_k: int | None):
    """Every generated token's logprob entry (and the prompt's, when asked) against transformers'."""
    generated = tokens_of(outs)
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(logprobs) == len(generated) and all(len(o.logprobs or []) == len(o.token_ids) for o in outs)
    ref = reference(family, prompt + generated)
    for j, (entry, token) in enumerate(zip(logprobs, generated)):
        assert_entry(entry, ref[len(prompt) + j - 1], token, k, f"generated token {j}")
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    if prompt_k is None:
        assert carried == []
        return
    assert len(carried) == 1 and outs[0].prompt_logprobs is carried[0]  # the first output only
    entries = carried[0]
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        assert_entry(entries[p], ref[p - 1], prompt[p], prompt_k, f"prompt token {p}")


def test_generated_and_prompt_logprobs_match_transformers(family: Family) -> None:
    engine = family.engine()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=K, prompt_logprobs=K)
    for i, prompt in enumerate(PROMPTS[:5]):
        engine.add_request(f"r{i}", prompt, params)
    # sampled at a high temperature: the logprobs are still the model's own distribution's
    engine.add_request("hot", PROMPTS[5], SamplingParams(max_tokens=8, temperature=5.0, top_k=3, seed=1, logprobs=2))
    engine.add_request("plain", PROMPTS[6], SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("zero", PROMPTS[7], SamplingParams(max_tokens=4, temperature=0, logprobs=0, prompt_logprobs=0))
    outputs = run(engine)
    for i, prompt in enumerate(PROMPTS[:5]):
        check_request(family, prompt, outputs[f"r{i}"], k=K, prompt_k=K)
        assert tokens_of(outputs[f"r{i}"]) == family.greedy[i][:12]
    check_request(family, PROMPTS[5], outputs["hot"], k=2, prompt_k=None)
    check_request(family, PROMPTS[7], outputs["zero"], k=0, prompt_k=0)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outputs["plain"])
    assert all(o.num_cached_tokens == 0 for outs in outputs.values() for o in outs)
    assert_pool_empty(engine)


def test_prompt_logprobs_across_chunked_prefill(family: Family) -> None:
    engine = family.engine(max_num_batched_tokens=16, block_size=4)
    chunks = []
    execute = engine.runner.execute_step

    def recording_execute(steps):
        logits, pooled = execute(steps)
        chunks.append([(s.start, s.num_new_tokens, s.prompt_logits) for s in steps])
        expected = sum(s.num_new_tokens if s.prompt_logits else int(s.samples) for s in steps)
        assert logits.shape[0] == expected and pooled is None
        return logits, pooled

    engine.runner.execute_step = recording_execute
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=4)
    long, other = PROMPTS[3], PROMPTS[1]  # 90 tokens: six steps' budget and more
    engine.add_request("long", long, params)
    engine.add_request("other", other, SamplingParams(max_tokens=6, temperature=0))
    outputs = run(engine)
    check_request(family, long, outputs["long"], k=3, prompt_k=4)
    assert any(0 < start for step in chunks for start, n, wants in step if wants)  # chunks past the first asked too
    # once the prompt is scored, its decodes ask for no prompt logits
    assert all(not wants for step in chunks for start, n, wants in step if start >= len(long))
    assert_pool_empty(engine)


def test_logprobs_under_preemption(family: Family) -> None:
    engine = family.engine(kv_cache_tokens=256, block_size=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, prompt_logprobs=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run(engine)
    assert engine.stats().num_preemptions_total > 0
    for i, prompt in enumerate(PROMPTS):
        check_request(family, prompt, outputs[f"r{i}"], k=2, prompt_k=2)
        assert tokens_of(outputs[f"r{i}"]) == family.greedy[i]
    assert_pool_empty(engine)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(gpt2: Family) -> None:
    engine = gpt2.engine(max_num_batched_tokens=32)
    prompt = PROMPTS[3]
    engine.add_request("score", prompt, SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=1))
    engine.add_request("one", [7], SamplingParams(max_tokens=0, prompt_logprobs=0))
    outputs = run(engine)
    (out,) = outputs["score"]
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == "" and out.logprobs == []
    assert out.num_output_tokens == 0 and out.num_prompt_tokens == len(prompt)
    check_request(gpt2, prompt, [out], k=1, prompt_k=1)
    (one,) = outputs["one"]
    assert one.prompt_logprobs == [None] and one.finish_reason == "length" and one.logprobs is None
    assert engine.stats().generation_tokens_total == 0
    assert_pool_empty(engine)


def test_a_prompt_that_fills_the_context_is_scored_but_not_continued(gpt2: Family) -> None:
    """A trained model's sequences fill its positions (seq_len = n_positions): scoring one (max_tokens 0, what
    `pylon eval` sends) is served; continuing one is refused, saying how to score it."""
    engine = gpt2.engine(max_model_len=32, kv_cache_tokens=64)
    prompt = (PROMPTS[3] * 8)[:32]
    engine.add_request("full", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    (out,) = run(engine)["full"]
    assert out.num_prompt_tokens == 32 and out.finish_reason == "length"
    check_request(gpt2, prompt, [out], k=0, prompt_k=0)
    with pytest.raises(InvalidRequest, match=r"at most 31 tokens \(or max_model_len with max_tokens 0\)"):
        engine.add_request("more", prompt, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="at most 32 tokens"):
        engine.add_request("past", prompt + [7], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert_pool_empty(engine)


def test_a_step_without_logprobs_requests_does_no_logprobs_work(gpt2: Family, monkeypatch) -> None:
    engine = gpt2.engine(max_num_batched_tokens=16)
    seen = []
    execute = engine.runner.execute_step

    def recording_execute(steps):
        logits, pooled = execute(steps)
        seen.append((any(s.prompt_logits for s in steps), logits.shape[0], sum(s.samples for s in steps)))
        return logits, pooled

    def no_logprobs(*args, **kwargs):
        raise AssertionError("token_logprobs ran in a step without a logprobs request")

    engine.runner.execute_step = recording_execute
    monkeypatch.setattr(engine_module, "token_logprobs", no_logprobs)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i + 2], SamplingParams(max_tokens=5, temperature=0))
    outputs = run(engine)
    assert all(o.logprobs is None and o.prompt_logprobs is None for outs in outputs.values() for o in outs)
    assert seen and all(not wants and rows == samples for wants, rows, samples in seen)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "logprobs": 2}, "max_tokens"),
        ({"max_tokens": -1, "prompt_logprobs": 0}, "max_tokens"),
    ],
)
def test_logprobs_params_are_checked(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert e.value.param == param
    SamplingParams(max_tokens=0, prompt_logprobs=0)
    SamplingParams(logprobs=20, prompt_logprobs=20)


def test_ties_are_ordered_by_token_id_and_k_is_per_row() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    first, second = token_logprobs(logits, [3, 0], [2, 0])
    lp = torch.log_softmax(logits, -1)
    assert [t for t, _ in first.top] == [1, 2] and first.token_id == 3  # of three tied at the top: the lowest ids
    assert abs(first.logprob - float(lp[0, 3])) < 1e-7 and second.top == ()


def test_outputs_merge_their_logprobs_and_pickle_small() -> None:
    metrics = RequestMetrics(0.0)
    a = TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.0)))
    b = TokenLogprob(3, -2.0, ((4, -0.1), (3, -2.0)))
    prompt = [None, TokenLogprob(9, -3.0)]
    first = RequestOutput("r", "x", [1], 2, 1, None, metrics, [a], prompt, 4)
    second = RequestOutput("r", "", [3], 2, 2, None, metrics, [b], None, 4)
    last = RequestOutput("r", "", [], 2, 2, "abort", metrics, None, None, 4)
    merged = merge_outputs([first, second, last])
    assert merged.token_ids == [1, 3] and merged.logprobs == [a, b] and merged.prompt_logprobs == prompt
    assert merged.num_cached_tokens == 4 and merged.finish_reason == "abort"
    assert merge_outputs([second, second]).prompt_logprobs is None
    plain = merge_outputs(
        [RequestOutput("r", "a", [1], 2, 1, None, metrics), RequestOutput("r", "b", [2], 2, 2, None, metrics)]
    )
    assert plain.logprobs is None and plain.num_cached_tokens == 0
    again = pickle.loads(pickle.dumps(merged))
    assert again == merged and again.logprobs[1].top == ((4, -0.1), (3, -2.0))
    with pytest.raises(AttributeError):
        a.__dict__  # noqa: B018 - slots: no per-instance dict to pickle


def test_logprobs_through_the_engine_process(gpt2: Family) -> None:
    """Outputs pickled across the child's pipe, held and merged there (interval_s > 0) and by the stream."""
    from pylon.serving.engine.process import ProcessLLMEngine

    engine = ProcessLLMEngine.from_model(gpt2.dir, spec(max_num_seqs=4, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3, prompt_logprobs=2)

    async def one(i: int, interval_s: float) -> list[RequestOutput]:
        return [o async for o in engine.generate(f"p{i}", PROMPTS[i], params, interval_s=interval_s)]

    async def all_of():
        return await asyncio.gather(*(one(i, 0.05 if i % 2 else 0.0) for i in range(4)))

    try:
        got = asyncio.run(all_of())
        scored = asyncio.run(
            _collect(engine.generate("s", PROMPTS[5], SamplingParams(max_tokens=0, logprobs=0, prompt_logprobs=1)))
        )
    finally:
        engine.shutdown()
    for i, outs in enumerate(got):
        check_request(gpt2, PROMPTS[i], outs, k=3, prompt_k=2)
        assert tokens_of(outs) == gpt2.greedy[i][:10]
    assert len(scored) == 1 and scored[0].finish_reason == "length"
    check_request(gpt2, PROMPTS[5], scored, k=0, prompt_k=1)


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_token_texts_give_raw_bytes_for_part_of_a_character(hf_dir) -> None:  # noqa: F811
    from pylon.data.tokenizer import ByteTokenizer
    from pylon.serving.engine.tokenization import TokenTexts, load_model_tokenizer

    byte = TokenTexts(ByteTokenizer())
    assert (byte.text(104), byte.bytes(104)) == ("h", [104])
    assert (byte.text(0xC3), byte.bytes(0xC3)) == ("\ufffd", [0xC3])  # half of "ç": its raw byte
    assert (byte.text(256), byte.bytes(256)) == ("", [])  # eos: no text
    tokenizer = load_model_tokenizer(str(hf_dir))  # a byte-level BPE (GPT-2's scheme)
    texts = TokenTexts(tokenizer)
    half = tokenizer._tok.convert_tokens_to_ids("Ã")  # the byte 0xC3 as byte-level BPE writes it
    assert (texts.text(half), texts.bytes(half)) == ("\ufffd", [0xC3])
    space = tokenizer._tok.convert_tokens_to_ids("Ġ")
    assert (texts.text(space), texts.bytes(space)) == (" ", [32])
    whole = tokenizer.encode("ça").tolist()
    assert b"".join(bytes(texts.bytes(i)) for i in whole) == "ça".encode()


def test_processed_logprobs_are_the_log_of_what_each_token_was_drawn_from(gpt2) -> None:
    """`logprobs_mode: processed` (vLLM's processed_logprobs): each token's logprob under the distribution it was
    drawn from, after temperature and top-k, which a trainer's importance-sampling correction needs; raw stays the
    model's own log-softmax. A greedy token's is 0."""
    import torch

    engine = gpt2.engine()
    prompt = PROMPTS[2]
    params = dict(max_tokens=6, temperature=0.7, top_k=20, seed=3, logprobs=0)
    raw = engine.generate([prompt], SamplingParams(**params))[0]
    engine.add_request("p", prompt, SamplingParams(**params, logprobs_mode="processed"))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    processed = [lp for o in outs for lp in o.logprobs]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == raw.token_ids  # the same draws: the mode changes what is reported, not what is sampled
    ids = list(prompt)
    with torch.no_grad():
        for token, lp in zip(tokens, processed):
            logits = gpt2.model(torch.tensor([ids], device=gpt2.model.device)).logits[0, -1].float().cpu() / 0.7
            kth = logits.topk(20).values[-1]
            want = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)[token]
            assert lp.logprob == pytest.approx(float(want), abs=1e-4)
            ids.append(token)
    greedy = SamplingParams(max_tokens=3, temperature=0, logprobs=0, logprobs_mode="processed")
    engine.add_request("g", prompt, greedy)
    while engine.has_unfinished():
        assert all(lp.logprob == 0.0 for o in engine.step() for lp in o.logprobs)
    with pytest.raises(InvalidRequest, match="logprobs_mode must be 'raw' or 'processed'"):
        SamplingParams(logprobs_mode="sampled")
