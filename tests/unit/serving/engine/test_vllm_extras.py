"""vLLM's sampling extras in the engine: `include_stop_str_in_output` (the stop string kept, streamed and not),
`allowed_token_ids` (only those sampled, greedy equal to transformers' with the rest masked, beside requests that mask
nothing), `truncate_prompt_tokens` (the prompt's last k tokens: the same tokens as a request of those alone), and
`cache_salt` (prefix-cache blocks shared only under the same salt); each bad value a 400 naming its field."""

from __future__ import annotations

import pytest
import torch
from engine_models import DEVICE, NEW_TOKENS, PROMPTS, Family, assert_pool_empty, run, tokens_of

from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest


def test_the_stop_string_is_kept_where_asked(gpt2: Family) -> None:
    engine = gpt2.engine()
    [full] = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    text = full.text
    k = next(k for k in range(3, len(text) - 2) if "\ufffd" not in text[k : k + 2])
    stop = text[k : k + 2]
    cut = text.find(stop)
    for keep, expected in ((False, text[:cut]), (True, text[: cut + 2])):
        params = SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep
        )
        engine.add_request("s", PROMPTS[3], params)
        outs = run(engine)["s"]  # streamed: one output a token
        assert "".join(o.text for o in outs) == expected and outs[-1].finish_reason == "stop"
    assert_pool_empty(engine)


def test_only_the_allowed_tokens_are_sampled(gpt2: Family) -> None:
    """Greedy under allowed_token_ids is transformers' greedy with every other logit masked; sampled tokens all come
    from the list; a request beside it that masks nothing is untouched."""
    allowed = [32, 65, 66, 97, 101, 116]
    engine = gpt2.engine()
    engine.add_request(
        "masked", PROMPTS[3], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, allowed_token_ids=allowed)
    )
    engine.add_request("free", PROMPTS[2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    engine.add_request(
        "sampled", PROMPTS[1], SamplingParams(max_tokens=40, temperature=1.5, seed=3, allowed_token_ids=allowed)
    )
    outs = run(engine)
    bias = torch.full((gpt2.model.config.vocab_size,), float("-inf"), device=DEVICE)
    bias[allowed] = 0
    ids = torch.tensor([PROMPTS[3]], device=DEVICE)
    want = gpt2.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=257,
        eos_token_id=256,
        logits_processor=[lambda _ids, scores: scores + bias],
    )[0, ids.shape[1] :].tolist()
    assert tokens_of(outs["masked"]) == want != gpt2.greedy[3]
    assert tokens_of(outs["free"]) == gpt2.greedy[2]
    assert set(tokens_of(outs["sampled"])) <= set(allowed)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("x", PROMPTS[0], SamplingParams(allowed_token_ids=[1, 10**6]))
    assert e.value.param == "allowed_token_ids"
    assert_pool_empty(engine)


def test_a_truncated_prompt_is_its_last_tokens(gpt2: Family) -> None:
    engine = gpt2.engine()
    prompt = PROMPTS[3]  # 90 tokens
    engine.add_request("cut", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, truncate_prompt_tokens=20))
    engine.add_request("tail", prompt[-20:], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    engine.add_request(
        "short", PROMPTS[4], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, truncate_prompt_tokens=50)
    )
    outs = run(engine)
    assert tokens_of(outs["cut"]) == tokens_of(outs["tail"]) and outs["cut"][0].num_prompt_tokens == 20
    assert tokens_of(outs["short"]) == gpt2.greedy[4]  # shorter than k: the whole prompt
    # -1: what the context leaves (max_model_len 256 less max_tokens): a prompt past it still runs
    long = (PROMPTS[3] * 3)[:250]
    with pytest.raises(InvalidRequest):
        engine.add_request("long", long, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    engine.add_request("long", long, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, truncate_prompt_tokens=-1))
    outs = run(engine)
    assert outs["long"][0].num_prompt_tokens == 256 - NEW_TOKENS
    for bad in (0, -2):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(truncate_prompt_tokens=bad)
        assert e.value.param == "truncate_prompt_tokens"
    assert_pool_empty(engine)


def test_the_prefix_cache_is_shared_under_one_salt_only(gpt2: Family) -> None:
    engine = gpt2.engine()
    prompt = PROMPTS[3]  # 90 tokens: five full blocks of 16 to share

    def cached(salt: str | None) -> tuple[int, list[int]]:
        engine.add_request(f"r{cached.n}", prompt, SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))
        outs = run(engine)[f"r{cached.n}"]
        cached.n += 1
        return outs[0].num_cached_tokens, tokens_of(outs)

    cached.n = 0
    assert cached(None)[0] == 0
    assert cached(None)[0] == 80  # no salt: shared, as before
    first, tokens = cached("tenant-a")
    assert first == 0  # a salt of its own: nothing of the unsalted blocks
    again, same = cached("tenant-a")
    assert again == 80 and same == tokens == gpt2.greedy[3][:4]  # its own blocks, the same tokens
    assert cached("tenant-b")[0] == 0
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(cache_salt="")
    assert e.value.param == "cache_salt"
    assert_pool_empty(engine)


def _reference(gpt2: Family, prompt: list[int], new_tokens: int, banned) -> list[int]:
    """transformers' greedy continuation of `prompt`, eos ignored, with `banned(generated ids)`'s tokens masked at
    each step."""
    ids = torch.tensor([prompt], device=DEVICE)

    def mask(seen, scores):
        for t in banned(seen[0, len(prompt) :].tolist()):
            scores[0, t] = float("-inf")
        return scores

    return gpt2.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=257,
        eos_token_id=256,
        logits_processor=[mask],
    )[0, ids.shape[1] :].tolist()


def test_bad_words_are_never_generated_and_the_rest_is_transformers_greedy(gpt2: Family) -> None:
    """vLLM's bad_words: a one-token word is masked everywhere; a longer word's last token is masked right after the
    generated tokens end with the ones before it (the prompt's tokens do not count). Greedy is then transformers'
    greedy under the same masks, and the words are nowhere in the output, beside a request that bans nothing."""
    engine = gpt2.engine()
    prompt, n = PROMPTS[3], 40
    [free] = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ids = free.token_ids
    word = lambda t: 33 <= t < 127  # noqa: E731 (printable ASCII, not a space: one byte, one token, as its text)
    single = max((t for t in ids if word(t)), key=ids.count)
    pair = next((a, b) for a, b in zip(ids, ids[1:]) if word(a) and word(b) and b != single)
    params = dict(max_tokens=n, temperature=0, ignore_eos=True)
    engine.add_request("one", prompt, SamplingParams(**params, bad_words=[chr(single)]))
    engine.add_request("two", prompt, SamplingParams(**params, bad_words=[" " + chr(pair[0]) + chr(pair[1])]))
    engine.add_request("none", prompt, SamplingParams(**params))
    outs = run(engine)
    one, two = tokens_of(outs["one"]), tokens_of(outs["two"])
    assert single not in one and one == _reference(gpt2, prompt, n, lambda seen: [single])
    assert all((a, b) != pair for a, b in zip(two, two[1:])) and two != ids
    assert two == _reference(gpt2, prompt, n, lambda seen: [pair[1]] if seen and seen[-1] == pair[0] else [])
    assert tokens_of(outs["none"]) == ids
    for bad in ([""], ["  "], "word", [3]):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(bad_words=bad)
        assert e.value.param == "bad_words"
    assert_pool_empty(engine)


def test_a_thinking_budget_ends_the_reasoning_with_its_closing_tokens(gpt2: Family) -> None:
    """vLLM's thinking_token_budget: once the reasoning (after the opening tokens, or from the start where the prompt
    opened it) has that many tokens, its closing tokens are forced one after the other, and the reply goes on as the
    model continues it (transformers' greedy after them); a reply that never opens reasoning, or one within its budget,
    is the model's own."""
    engine = gpt2.engine()
    prompt, n = PROMPTS[3], 30
    [free] = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ids = free.token_ids
    end = tuple(b"</t>")
    assert not any(ids[i : i + 4] == list(end) for i in range(n))

    def run_one(**fields) -> list[int]:
        [out] = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **fields))
        return out.token_ids

    def after(head: list[int]) -> list[int]:  # transformers' greedy continuation once the closing tokens are in
        return gpt2.hf_greedy(prompt + head, n - len(head))

    opened = run_one(thinking_token_budget=5, reasoning_tags=((), end, True))
    assert opened[:5] == ids[:5] and tuple(opened[5:9]) == end and opened[9:] == after(opened[:9])[: n - 9]
    start = tuple(ids[2:4])  # "opens" its reasoning at its third token: 3 tokens of reasoning from the fifth
    tagged = run_one(thinking_token_budget=3, reasoning_tags=(start, end, False))
    assert tagged[:7] == ids[:7] and tuple(tagged[7:11]) == end
    assert run_one(thinking_token_budget=0, reasoning_tags=((), end, True))[:4] == list(end)
    assert run_one(thinking_token_budget=3, reasoning_tags=((1, 2, 3), end, False)) == ids  # never opened
    assert run_one(thinking_token_budget=n, reasoning_tags=((), end, True)) == ids  # within its budget
    assert run_one(thinking_token_budget=-1, reasoning_tags=((), end, True)) == ids  # no limit
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("x", prompt, SamplingParams(thinking_token_budget=3))  # what is reasoning? not said
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(thinking_token_budget=-2)
    assert e.value.param == "thinking_token_budget"
    assert_pool_empty(engine)


def test_logprobs_of_given_tokens_and_a_prompt_cut_from_the_right(gpt2: Family) -> None:
    """vLLM's logprob_token_ids: each generated position's logprobs of those tokens (transformers' log-softmax there),
    in the order given, beside the chosen token's; truncation_side right: the prompt's first k tokens."""
    engine = gpt2.engine()
    prompt, labels = PROMPTS[3], [97, 98, 32, 300 % 258]
    engine.add_request(
        "labels", prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=0, logprob_token_ids=labels)
    )
    outs = run(engine)["labels"]
    entries = [lp for o in outs for lp in o.logprobs]
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens_of(outs)], device=DEVICE)
        lp = torch.log_softmax(gpt2.model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
    assert len(entries) == 6
    for row, entry in zip(lp, entries):
        assert [t for t, _ in entry.top] == labels
        assert all(abs(v - float(row[t])) < 1e-4 for t, v in entry.top)
        assert abs(entry.logprob - float(row[entry.token_id])) < 1e-4 and entry.rank == 1  # greedy: the best
    engine.add_request("right", prompt, SamplingParams(max_tokens=8, temperature=0, truncate_prompt_tokens=20,
                                                       truncation_side="right"))  # fmt: skip
    engine.add_request("head", prompt[:20], SamplingParams(max_tokens=8, temperature=0))
    outs = run(engine)
    assert tokens_of(outs["right"]) == tokens_of(outs["head"]) and outs["right"][0].num_prompt_tokens == 20
    for bad in ({"logprob_token_ids": [1]}, {"logprob_token_ids": [], "logprobs": 0}, {"truncation_side": "middle"}):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad)), bad
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("x", prompt, SamplingParams(logprobs=0, logprob_token_ids=[10**6]))
    assert e.value.param == "logprob_token_ids"
    assert_pool_empty(engine)


def test_repetition_detection_is_vllms_rule() -> None:
    """The output's last tokens a pattern of min_pattern_size..max_pattern_size tokens said min_count times in a row,
    as vLLM's check_sequence_repetition reads it; values that cannot detect anything are refused by name."""
    params = SamplingParams(max_tokens=10, repetition_detection=(4, 2, 3))
    assert params.repeats([9, 1, 2, 1, 2, 1, 2])  # "1 2" three times
    assert not params.repeats([1, 2, 1, 2])  # twice
    assert not params.repeats([7, 5, 5, 5, 5])  # one token four times: below min_pattern_size 2; "5 5" only twice
    assert SamplingParams(max_tokens=10, repetition_detection=(4, 0, 3)).repeats([7, 5, 5, 5])  # min 0 means 1
    assert params.repeats([1, 2, 3, 4] * 3) and not params.repeats([1, 2, 3, 4, 5] * 3)  # 5 > max_pattern_size
    assert SamplingParams(max_tokens=10, repetition_detection=(0, 0, 0)).repetition_detection is None  # off
    for bad in ((4, 0, 1), (4, 5, 3), (4, -1, 3), (10**6, 1, 3)):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(max_tokens=10, repetition_detection=bad)
        assert e.value.param == "repetition_detection"


def test_a_looping_output_ends_at_min_count(gpt2: Family) -> None:
    engine = gpt2.engine()
    loop = {"max_tokens": 50, "temperature": 0, "allowed_token_ids": [65], "repetition_detection": (2, 1, 4)}
    engine.add_request("loop", PROMPTS[3], SamplingParams(**loop))
    engine.add_request("late", PROMPTS[3], SamplingParams(**loop, min_tokens=9))  # looked for once min_tokens are out
    engine.add_request("free", PROMPTS[2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    outs = run(engine)
    assert tokens_of(outs["loop"]) == [65] * 4 and outs["loop"][-1].finish_reason == "repetition"
    assert tokens_of(outs["late"]) == [65] * 9 and outs["late"][-1].finish_reason == "repetition"
    assert tokens_of(outs["free"]) == gpt2.greedy[2]
    assert engine.stats().requests_finished_total["repetition"] == 2
    assert_pool_empty(engine)
