"""Classifiers over HTTP (vLLM's `/classify`, `/pooling`, and `/v1/score` and `/rerank` with a cross-encoder) against
a real server: every probability is the softmax (or sigmoid) of `transformers`' own
`AutoModelForSequenceClassification` logits of the same tokens, a chat is scored as `/tokenize` renders it, a pair as
one sequence; a classifier refuses to generate or embed, a model that is not one refuses to classify, and each bad
field is a 400 naming it."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from test_serving_http import auth, model_dir, server, serving  # noqa: F401 (fixtures)
from transformers import AutoConfig, AutoModelForSequenceClassification

from pylon.data.tokenizer import ByteTokenizer

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["what a lovely day", "the service was slow and the food cold", "it is a table"]


def save(directory, **fields):
    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.5,
        **fields,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return model


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sentiment")
    model = save(directory, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    with serving(str(directory), max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=4096) as (url, _):
        yield url, model


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cross-encoder")
    model = save(directory, num_labels=1)
    with serving(str(directory), max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=4096) as (url, _):
        yield url, model


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", headers=auth(), json={"model": "tiny", **body}, timeout=60)


def close(got: list[float], want: torch.Tensor, tolerance: float = 1e-4) -> bool:
    return len(got) == len(want) and torch.allclose(torch.tensor(got), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_each_input_gets_its_label_and_probabilities(classifier, path) -> None:
    url, model = classifier
    r = post(url, path, {"input": TEXTS})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["id"].startswith("classify-") and answer["model"] == "tiny"
    tokens = sum(len(t.encode()) for t in TEXTS)
    assert answer["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    for i, (data, text) in enumerate(zip(answer["data"], TEXTS)):
        logits = logits_of(model, list(text.encode()))
        assert data["index"] == i and data["num_classes"] == 3
        assert close(data["probs"], torch.softmax(logits, -1), 1e-5), (i, data, logits)
        assert data["label"] == LABELS[int(logits.argmax())]
    # the logits themselves (a reward model's raw score), by vLLM's three names for it; token ids as input
    ids = list(TEXTS[1].encode())
    for flag in ("use_activation", "activation", "softmax"):
        raw = post(url, path, {"input": ids, flag: False}).json()["data"][0]["probs"]
        assert close(raw, logits_of(model, ids)), flag


def test_a_chat_is_classified_as_tokenize_renders_it(classifier) -> None:
    url, model = classifier
    messages = [{"role": "user", "content": "is it good?"}, {"role": "assistant", "content": "it is very good"}]
    r = post(url, "/classify", {"messages": messages})
    assert r.status_code == 200, r.text
    rendered = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    (data,) = r.json()["data"]
    assert close(data["probs"], torch.softmax(logits_of(model, rendered), -1), 1e-5)
    assert r.json()["usage"]["prompt_tokens"] == len(rendered)


def test_pooling_gives_the_outputs_and_truncation_keeps_the_last_tokens(classifier) -> None:
    url, model = classifier
    r = post(url, "/pooling", {"input": TEXTS[0], "truncate_prompt_tokens": 5, "use_activation": False})
    assert r.status_code == 200, r.text
    (data,) = r.json()["data"]
    assert data["object"] == "pooling" and r.json()["id"].startswith("pool-")
    assert close(data["data"], logits_of(model, list(TEXTS[0].encode())[-5:]))
    assert r.json()["usage"]["prompt_tokens"] == 5


def test_a_classifier_refuses_what_it_cannot_do(classifier) -> None:
    url, _ = classifier
    for path, body, param in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/embeddings", {"input": "hi"}, "model"),
        ("/v1/score", {"text_1": "a", "text_2": "b"}, "model"),  # three labels: not a cross-encoder
        ("/classify", {"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "input"),
        ("/classify", {}, "input"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": ["hi", ""]}, "input.1"),
        ("/classify", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/pooling", {"input": "hi", "dimensions": 2}, "dimensions"),
        ("/classify", {"input": "hi", "encoding_format": "base64"}, "encoding_format"),
        ("/classify", {"input": "x" * 1100}, "input"),  # past the context (1024)
        ("/classify", {"input": "hi", "n": 2}, "n"),
    ):
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.json())
    assert "classifier" in post(url, "/v1/embeddings", {"input": "hi"}).json()["error"]["message"]
    # it still answers after all of them
    assert post(url, "/classify", {"input": "hi"}).status_code == 200


def test_a_model_that_is_not_a_classifier_pools_its_vectors(server) -> None:  # noqa: F811
    r = post(server, "/classify", {"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "not a classifier" in r.json()["error"]["message"]
    pooled = post(server, "/pooling", {"input": ["hello", "there"], "dimensions": 8})
    assert pooled.status_code == 200, pooled.text
    embedded = post(server, "/v1/embeddings", {"input": ["hello", "there"], "dimensions": 8}).json()["data"]
    assert [d["data"] for d in pooled.json()["data"]] == [e["embedding"] for e in embedded]


def test_a_cross_encoder_scores_each_pair_as_one_sequence(cross_encoder) -> None:
    url, model = cross_encoder
    query, documents = "the quick brown fox", ["a fox jumps", "stock prices fell", "the quick brown fox"]

    def want(a: str, b: str) -> float:
        return torch.sigmoid(logits_of(model, list((a + b).encode()))[0]).item()

    r = post(url, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2})
    assert r.status_code == 200, r.text
    expected = sorted(((want(query, d), i) for i, d in enumerate(documents)), reverse=True)[:2]
    results = r.json()["results"]
    assert [x["index"] for x in results] == [i for _, i in expected]
    assert all(abs(x["relevance_score"] - s) < 1e-5 for x, (s, _) in zip(results, expected))
    tokens = sum(len((query + d).encode()) for d in documents)
    assert r.json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    pairwise = post(url, "/v1/score", {"text_1": ["hi", "yo"], "text_2": ["there", "you"]}).json()["data"]
    assert [round(d["score"], 5) for d in pairwise] == [round(want("hi", "there"), 5), round(want("yo", "you"), 5)]
    raw = post(url, "/v1/score", {"text_1": "hi", "text_2": "there", "use_activation": False}).json()["data"][0]
    assert abs(raw["score"] - logits_of(model, list(b"hithere"))[0].item()) < 1e-4
    # its one label's probability on /classify is the sigmoid of its logit too
    (data,) = post(url, "/classify", {"input": "hithere"}).json()["data"]
    assert (
        data["num_classes"] == 1 and data["label"] == "LABEL_0" and abs(data["probs"][0] - want("hi", "there")) < 1e-5
    )
    # a pair past the context is named by its document
    long = post(url, "/v1/rerank", {"query": query, "documents": ["ok", "x" * 1100]})
    assert long.status_code == 400 and long.json()["error"]["param"] == "documents.1", long.text


def test_the_sdk_classifies_scores_and_reranks(classifier, cross_encoder) -> None:
    from test_serving_http import KEY

    from pylon.sdk.handles import Service

    url, model = classifier
    svc = Service(None, "tiny", url, api_key=KEY)
    one = svc.classify(TEXTS[0])
    assert one["label"] == LABELS[int(logits_of(model, list(TEXTS[0].encode())).argmax())]
    assert [r["label"] for r in svc.classify(TEXTS)] == [svc.classify(t)["label"] for t in TEXTS]
    chat = [{"role": "user", "content": "is it good?"}, {"role": "assistant", "content": "yes"}]
    rendered = post(url, "/tokenize", {"messages": chat, "add_generation_prompt": False}).json()["tokens"]
    assert close(svc.classify(chat, raw=True)["probs"], logits_of(model, rendered))
    url, model = cross_encoder
    svc = Service(None, "tiny", url, api_key=KEY)
    scores = svc.score("hi", ["there", "you"])
    assert len(scores) == 2 and abs(svc.score("hi", "there") - scores[0]) < 1e-6
    ranked = svc.rerank("hi", ["there", "you", "hello"], top_n=2)
    best = sorted(range(3), key=lambda i: -svc.score("hi", ["there", "you", "hello"])[i])[:2]
    assert [i for i, _ in ranked] == best and ranked[0][1] >= ranked[1][1]
