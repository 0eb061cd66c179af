"""Penalties and logit_bias (`SamplingParams` presence/frequency/repetition_penalty, logit_bias): greedy outputs of
the engine token for token equal to `transformers`' `generate` with the same shaping (its own SequenceBias and
RepetitionPenalty processors, and OpenAI's presence/frequency rule as a logits processor written out here), under
continuous batching beside requests that shape nothing; the sampler's distribution shaped the same way; bad values
named; logprobs left as the model's own. min_p (the sampler's filter) and min_tokens (as transformers'
min_new_tokens; stop strings deferred)."""

from __future__ import annotations

import pytest
import torch
from engine_models import DEVICE, NEW_TOKENS, PROMPTS, Family, assert_pool_empty, run, speculating, tokens_of
from transformers import LogitsProcessor, LogitsProcessorList

from pylon.serving.engine.sampling import SamplingParams, filtered_probs, shape_logits
from pylon.serving.errors import InvalidRequest


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented rule: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty, where
    count[t] is how often t occurs in the generated tokens (not the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            for token, count in zip(*input_ids[row, self.prompt_len :].unique(return_counts=True)):
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def hf_shaped(family: Family, prompt: list[int], params: SamplingParams) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    kwargs = {}
    if params.repetition_penalty != 1:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    out = family.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=params.max_tokens,
        do_sample=False,
        eos_token_id=256,
        pad_token_id=257,
        logits_processor=processors,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def shaped(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, **fields)


CASES = {
    "repetition": shaped(repetition_penalty=1.8),
    "repetition below 1": shaped(repetition_penalty=0.6),
    "frequency": shaped(frequency_penalty=2.0),
    "frequency below 0": shaped(frequency_penalty=-1.0),  # repeats: counts above 1
    "presence": shaped(presence_penalty=-2.0),
    "bias": shaped(logit_bias={65: 9.0, 66: 12.5, 1: -100.0}),
    "everything": shaped(repetition_penalty=1.3, frequency_penalty=0.9, presence_penalty=1.1, logit_bias={97: 10.0}),
}


def test_shaped_greedy_matches_transformers_beside_plain_requests(family: Family) -> None:
    engine = family.engine()
    expected = {}
    for n, (name, params) in enumerate(CASES.items()):
        prompt = PROMPTS[n % len(PROMPTS)]
        expected[name] = hf_shaped(family, prompt, params)
        engine.add_request(name, prompt, params)
        engine.add_request(f"plain-{name}", prompt, shaped())  # the same prompt, shaping nothing, in the batch
    outputs = run(engine)
    for n, name in enumerate(CASES):
        plain = family.greedy[n % len(PROMPTS)]
        assert tokens_of(outputs[f"plain-{name}"]) == plain, name
        got = tokens_of(outputs[name])
        assert got == expected[name], name
        assert got != plain, f"{name}: the shaping changed nothing, so the comparison shows nothing"
    assert_pool_empty(engine)


def test_logit_bias_forces_and_bans_tokens(gpt2: Family) -> None:
    engine = gpt2.engine()
    [forced] = engine.generate([PROMPTS[1]], shaped(logit_bias={"120": 100}))  # JSON's keys are strings
    assert forced.token_ids == [120] * NEW_TOKENS
    banned = set(gpt2.greedy[1])
    [avoided] = engine.generate([PROMPTS[1]], shaped(logit_bias=dict.fromkeys(banned, -100)))
    assert not banned & set(avoided.token_ids) and len(avoided.token_ids) == NEW_TOKENS


def test_logprobs_stay_the_models_own_and_shaping_requests_speculate_to_transformers_tokens(gpt2: Family) -> None:
    engine = speculating(gpt2.engine(speculative={"method": "ngram", "num_tokens": 4}))
    prompt = PROMPTS[3][:20] * 4  # repeats: prompt lookup finds drafts
    first = PROMPTS[3][0]
    engine.add_request("plain", prompt, shaped(logprobs=0))
    engine.add_request("biased", prompt, shaped(logprobs=0, logit_bias={first: 100.0}))
    outputs = run(engine)
    biased = [lp for out in outputs["biased"] for lp in out.logprobs]
    plain = [lp for out in outputs["plain"] for lp in out.logprobs]
    assert tokens_of(outputs["biased"]) == [first] * NEW_TOKENS
    # the first token's logprob is the model's, not the biased distribution's (which puts it near 0)
    with torch.no_grad():
        ref = torch.log_softmax(gpt2.model(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float(), -1)
    assert biased[0].logprob == pytest.approx(ref[first].item(), abs=1e-4) and biased[0].logprob < -0.5
    assert plain[0].logprob == pytest.approx(ref.max().item(), abs=1e-4)
    # Shaping requests speculate too (each draft position shaped by the history up to it), and give transformers'
    # tokens, which are not the unshaped ones; the stats count drafts proposed for this request alone.
    before = engine.stats()
    penalized = shaped(frequency_penalty=0.3, repetition_penalty=1.05, logit_bias={first: 1.0})
    [out] = engine.generate([prompt], penalized)
    assert out.token_ids == hf_shaped(gpt2, prompt, penalized)
    after = engine.stats()
    assert after.spec_draft_tokens_total > before.spec_draft_tokens_total, after
    assert after.spec_verify_steps_total > before.spec_verify_steps_total, after
    [bare] = engine.generate([prompt], shaped())
    assert bare.token_ids != out.token_ids


def test_sampled_distribution_is_shaped_before_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]])
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={4: 3.0})
    out = shape_logits(logits, [params], [([0, 2], [3, 3, 0])])
    # bias: token 4 -> 3.0; repetition over {0, 2, 3}: 2.0 -> 1.0, -1.0 -> -2.0, 0.5 -> 0.25; frequency over the
    # generated [3, 3, 0]: token 3 -= 1.0, token 0 -= 0.5
    expected = torch.tensor([[0.5, 1.0, -2.0, -0.75, 3.0]])
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]]))  # the model's logits are left alone
    assert torch.allclose(filtered_probs(out, [params]), (expected / 0.5).softmax(-1))
    plain = SamplingParams()
    assert shape_logits(logits, [plain], [([], [])]) is logits


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": "high"}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-4": 1}}, "logit_bias"),
        ({"logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic 3 is a digit to str.isdecimal
        ({"logit_bias": {" 7": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ],
)
def test_bad_shaping_values_name_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert e.value.param == param


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_by_the_engine(gpt2: Family) -> None:
    engine = gpt2.engine()
    with pytest.raises(InvalidRequest, match="not in the model's vocabulary") as e:
        engine.add_request("r", PROMPTS[0], shaped(logit_bias={320: 5.0}))
    assert e.value.param == "logit_bias.320"
    assert not engine.has_unfinished()


# ---------------------------------------------------------------------------------------------------------
# min_p and min_tokens (vLLM's)
# ---------------------------------------------------------------------------------------------------------


def test_min_p_keeps_the_tokens_near_the_best_before_top_p() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, -5.0], [3.0, 2.0, 0.0, -5.0]])
    # p / p_max = exp(l - 3) at temperature 1: 1, 0.37, 0.05, 0.0003
    kept = filtered_probs(logits, [SamplingParams(min_p=0.3), SamplingParams(min_p=0.01)])
    assert torch.allclose(kept[0], torch.tensor([*torch.tensor([3.0, 2.0]).softmax(-1).tolist(), 0.0, 0.0]))
    assert torch.allclose(kept[1], torch.tensor([*torch.tensor([3.0, 2.0, 0.0]).softmax(-1).tolist(), 0.0]))
    # top_p then counts what min_p kept: 0.73 of the two kept reaches 0.7 with the first alone
    both = filtered_probs(logits[:1], [SamplingParams(min_p=0.3, top_p=0.7)])
    assert both[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # temperature first: at 3, p / p_max = exp((l - 3) / 3): 1, 0.72, 0.37, 0.07
    hot = filtered_probs(logits[:1], [SamplingParams(temperature=3.0, min_p=0.3)])
    assert (hot[0] > 0).tolist() == [True, True, True, False]


def test_min_p_of_one_samples_the_greedy_tokens(gpt2: Family) -> None:
    engine = gpt2.engine()
    hot = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.5, seed=3)
    [free] = engine.generate([PROMPTS[2]], hot)
    [near] = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.5, seed=3, min_p=1.0))
    assert near.token_ids == gpt2.greedy[2] and free.token_ids != gpt2.greedy[2]


def test_min_tokens_masks_what_ends_a_request_as_transformers_min_new_tokens(family: Family) -> None:
    engine = family.engine()
    expected, stops = {}, {}
    for n, prompt in enumerate(PROMPTS[:4]):
        stop = family.greedy[n][2]  # plain greedy ends at its third token
        stops[n] = stop
        ids = torch.tensor([prompt], device=DEVICE)
        out = family.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=12,
            do_sample=False,
            eos_token_id=[256, stop],
            pad_token_id=257,
        )
        expected[n] = out[0, len(prompt) :].tolist()
        expected[n] = expected[n][: next((i + 1 for i, t in enumerate(expected[n]) if t in (256, stop)), None)]
        engine.add_request(f"plain-{n}", prompt, shaped(stop_token_ids=[stop]))
        engine.add_request(f"min-{n}", prompt, shaped(stop_token_ids=[stop], min_tokens=12))
    outputs = run(engine)
    for n in expected:
        assert len(tokens_of(outputs[f"plain-{n}"])) <= 3
        got = tokens_of(outputs[f"min-{n}"])
        assert got == expected[n] and len(got) >= 12, n
        assert stops[n] not in got[:11] and 256 not in got[:11]


def test_min_tokens_defers_stop_strings(gpt2: Family) -> None:
    engine = gpt2.engine()
    [plain] = engine.generate([PROMPTS[4]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    stop = plain.text[:2]
    [cut] = engine.generate([PROMPTS[4]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=[stop]))
    assert cut.text == "" and cut.finish_reason == "stop"
    [late] = engine.generate(
        [PROMPTS[4]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=[stop], min_tokens=6, ignore_eos=True)
    )
    assert late.text.startswith(stop) and len(late.token_ids) >= 6


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": 2.5}, "min_tokens"),
    ],
)
def test_bad_min_p_and_min_tokens_name_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert e.value.param == param
