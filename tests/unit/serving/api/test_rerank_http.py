"""vLLM's rerank and score APIs (`POST /v1/rerank`, `/v2/rerank`, `/v1/score`, and `/rerank`, `/score`) against a real server: each score is
the cosine of the texts' last-token hidden states as `transformers` computes them, documents ranked best first and cut
to `top_n`; bad input is a 400 naming the query, the document or the text at fault."""

from __future__ import annotations

import pytest
import requests
import torch
from test_serving_http import auth, model_dir, server  # noqa: F401 (fixtures)

QUERY = "the quick brown fox"
DOCUMENTS = ["a fox jumps over the dog", "stock prices fell today", "the quick brown fox", "hello"]


@pytest.fixture(scope="module")
def cosine(model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model.base_model(torch.tensor([list(text.encode())])).last_hidden_state[0, -1]
        return hidden / hidden.norm()

    return lambda a, b: float(vector(a) @ vector(b))


def post(server, path: str, body: dict) -> requests.Response:  # noqa: F811
    return requests.post(f"{server}{path}", headers=auth(), json={"model": "tiny", **body}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_documents_are_ranked_by_the_cosine_of_their_vectors(server, cosine, path) -> None:  # noqa: F811
    r = post(server, path, {"query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    answer = r.json()
    want = sorted(((cosine(QUERY, d), i) for i, d in enumerate(DOCUMENTS)), reverse=True)
    assert [x["index"] for x in answer["results"]] == [i for _, i in want]
    for result, (score, i) in zip(answer["results"], want):
        assert abs(result["relevance_score"] - score) < 1e-5 and result["document"] == {"text": DOCUMENTS[i]}
    assert answer["results"][0]["index"] == 2 and abs(answer["results"][0]["relevance_score"] - 1) < 1e-5  # itself
    tokens = len(QUERY) + sum(len(d) for d in DOCUMENTS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    top = post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == [i for _, i in want[:2]]
    assert all(x["document"] is None for x in top["results"])


def test_pairs_are_scored_one_against_many_or_pair_by_pair(server, cosine) -> None:  # noqa: F811
    one = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert one.status_code == 200, one.text
    data = one.json()["data"]
    assert [d["index"] for d in data] == list(range(4)) and all(d["object"] == "score" for d in data)
    assert all(abs(d["score"] - cosine(QUERY, doc)) < 1e-5 for d, doc in zip(data, DOCUMENTS))
    firsts = ["hello", "stock prices"]
    pairwise = post(server, "/v1/score", {"text_1": firsts, "text_2": DOCUMENTS[:2]}).json()["data"]
    assert post(server, "/score", {"text_1": firsts, "text_2": DOCUMENTS[:2]}).json()["data"] == pairwise  # vLLM's
    assert all(abs(d["score"] - cosine(a, b)) < 1e-5 for d, a, b in zip(pairwise, firsts, DOCUMENTS[:2]))


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a", "x" * 1100]}, "documents.1"),  # past max_model_len
        ("/v1/rerank", {"query": "x" * 1100, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", "x" * 1100]}, "text_2.1"),
        ("/v1/score", {"text_1": [], "text_2": ["b"]}, "text_1"),
    ],
)
def test_bad_input_is_a_400_naming_the_text(server, path, body, param) -> None:  # noqa: F811
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
