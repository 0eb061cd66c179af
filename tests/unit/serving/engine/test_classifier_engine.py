"""Classifiers in the engine (engine/pooling.py): a `*ForSequenceClassification` checkpoint (a reward model, a
cross-encoder) computes each pooled request's logits over its labels, which are `transformers`' own
`AutoModelForSequenceClassification` logits within 1e-4 for every family tried, alone, in chunks, from the prefix
cache and beside other requests; a causal LM with `engine.classifier_from_token` scores by its tokens' logits; a
classifier refuses to generate, and bad settings stop the engine with the setting named."""

from __future__ import annotations

import json

import pytest
import torch
from engine_models import DEVICE, FAMILIES, LLAMA_LIKE, PROMPTS, Family, assert_pool_empty, run, spec
from transformers import AutoConfig, AutoModelForSequenceClassification

from pylon.data.tokenizer import ByteTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest

POOL = SamplingParams(max_tokens=0, embed=True)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_classifier(name: str, directory, **config_fields):
    """A tiny random `<family>ForSequenceClassification` (three labels unless told) saved as a Pylon export."""
    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        name,
        **{
            **(FAMILIES | LLAMA_LIKE)[name],
            "id2label": LABELS,
            "label2id": {v: k for k, v in LABELS.items()},
            **config_fields,
        },
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,  # 257: in no prompt, so that transformers pools at the last token as the engine does
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return model.to(DEVICE)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def classifier(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"{request.param}-classifier")
    return save_classifier(request.param, directory), str(directory)


def reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], device=DEVICE)).logits[0].float().cpu()


def close(got: list[float], want: torch.Tensor) -> bool:
    got = torch.tensor(got)
    # (the hidden states are within 1e-5 of transformers'; the head over 128 of them, within 1e-4)
    return got.shape == want.shape and ((got - want).norm() / want.norm()).item() < 1e-4


def test_a_classifiers_outputs_are_its_labels_logits(classifier) -> None:
    model, directory = classifier
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):  # whole prompts, then chunks of 32
        engine = LLMEngine(directory, spec(**fields))
        meaning = engine.generation.classifier
        assert meaning.labels == ("negative", "neutral", "positive") and meaning.activation == "softmax"
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"c-{i}", p, POOL)
        outputs = run(engine)
        for i, p in enumerate(PROMPTS):
            (last,) = outputs[f"c-{i}"]
            assert last.finished and last.finish_reason == "stop" and last.token_ids == []
            assert close(last.embedding, reference(model, p)), (fields, i)
        assert_pool_empty(engine)
    # From the prefix cache: the same logits.
    engine.add_request("again", PROMPTS[3], POOL)
    again = run(engine)["again"][-1]
    assert again.num_cached_tokens >= 80 and close(again.embedding, reference(model, PROMPTS[3]))


def test_a_classifier_generates_nothing(classifier) -> None:
    _, directory = classifier
    engine = LLMEngine(directory, spec())
    for params in (SamplingParams(max_tokens=4), SamplingParams(max_tokens=0, prompt_logprobs=1)):
        with pytest.raises(InvalidRequest, match="classifier .*generates no text") as e:
            engine.add_request("gen", PROMPTS[0], params)
        assert e.value.param == "model"
    assert not engine.has_unfinished()


def test_labels_and_activations_follow_the_config(tmp_path) -> None:
    one = tmp_path / "reward"
    model = save_classifier("qwen2", one, num_labels=1, id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0})
    engine = LLMEngine(str(one), spec())
    meaning = engine.generation.classifier
    assert meaning.labels == ("LABEL_0",) and meaning.activation == "sigmoid" == meaning.score_activation
    engine.add_request("r", PROMPTS[1], POOL)
    (reward,) = run(engine)["r"][-1].embedding
    want = float(reference(model, PROMPTS[1])[0])
    assert abs(reward - want) < 1e-5 * max(1.0, abs(want))
    assert abs(meaning.apply([reward])[0] - torch.sigmoid(torch.tensor(want)).item()) < 1e-6
    assert meaning.apply([reward], activation=False) == [reward]
    regression = tmp_path / "regression"
    save_classifier("llama", regression, problem_type="regression")
    assert LLMEngine(str(regression), spec()).generation.classifier.activation == "none"
    cross = tmp_path / "cross"
    save_classifier("llama", cross, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    meaning = LLMEngine(str(cross), spec()).generation.classifier
    assert meaning.activation == "softmax" and meaning.score_activation == "none"
    bad = tmp_path / "bad"
    save_classifier("llama", bad, sentence_transformers={"activation_fn": "os.system"})
    with pytest.raises(PylonError, match="config.json: sentence_transformers.activation_fn: 'os.system'"):
        LLMEngine(str(bad), spec())


@pytest.fixture(scope="module")
def causal(tmp_path_factory) -> Family:
    return Family("qwen2", tmp_path_factory.mktemp("qwen2-reranker"))


def test_a_causal_lm_scores_by_its_tokens_logits(causal) -> None:
    """engine.classifier_from_token ["n", "y"]: each input's score is the logit of "y" less that of "n" at its last
    token, whose sigmoid is P(y) / (P(y) + P(n)) under the model's next-token distribution."""
    no, yes = ord("n"), ord("y")  # the byte tokenizer's ids
    engine = causal.engine(classifier_from_token=["n", "y"])
    meaning = engine.generation.classifier
    assert meaning.labels == ("yes",) and meaning.score_activation == "sigmoid"
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"s-{i}", p, POOL)
    outputs = run(engine)
    for i, p in enumerate(PROMPTS):
        (score,) = outputs[f"s-{i}"][-1].embedding
        with torch.no_grad():
            logits = causal.model(torch.tensor([p], device=DEVICE)).logits[0, -1].float().cpu()
        assert abs(score - float(logits[yes] - logits[no])) < 1e-4, i
        p_yes = torch.softmax(logits, -1)[[no, yes]]
        assert abs(meaning.apply([score], score=True)[0] - float(p_yes[1] / p_yes.sum())) < 1e-5
    single = causal.engine(classifier_from_token=["y"])
    single.add_request("one", PROMPTS[0], POOL)
    (logit,) = run(single)["one"][-1].embedding
    with torch.no_grad():
        want = causal.model(torch.tensor([PROMPTS[0]], device=DEVICE)).logits[0, -1, yes].item()
    assert abs(logit - want) < 1e-4
    with pytest.raises(PylonError, match=r"engine.classifier_from_token.1: 'yes' is 3 tokens"):
        causal.engine(classifier_from_token=["n", "yes"])
