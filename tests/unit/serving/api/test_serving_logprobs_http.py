"""Logprobs, echo and max_tokens 0 through the HTTP API (`/v1/completions`' legacy logprobs shape, `/v1/chat/completions`'
content list), streamed and not, against `transformers`' own log-softmax of the served model; usage's
`prompt_tokens_details.cached_tokens`; and the 400s that name the parameter. The server is test_serving_http's."""

from __future__ import annotations

import pytest
import requests
import torch
from test_serving_http import KEY, auth, model_dir, server, sse  # noqa: F401 - the fixtures, imported to be used
from transformers import AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer

TOL = 1e-4
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy_reference(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt`, and its log-softmax rows over prompt + continuation."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids, torch.log_softmax(hf(torch.tensor([ids])).logits.float(), -1)[0]


def expected_top(row: torch.Tensor, chosen: int, k: int) -> dict[str, float]:
    """OpenAI's legacy top_logprobs entry: the k best by their text (the first of equal texts), and the chosen."""
    top: dict[str, float] = {}
    for i in row.topk(k).indices.tolist():
        top.setdefault(TOK.decode([i]), float(row[i]))
    top.setdefault(TOK.decode([chosen]), float(row[chosen]))
    return top


def assert_close_dict(got: dict, want: dict, where) -> None:
    assert set(got) == set(want), (where, got, want)
    assert all(abs(got[t] - want[t]) < TOL for t in want), (where, got, want)


def post(server, path: str, body: dict) -> requests.Response:  # noqa: F811
    return requests.post(f"{server}{path}", headers=auth(), json={"model": "tiny", **body}, timeout=60)


def test_completion_logprobs_with_echo_match_transformers_streamed_and_not(server, hf):  # noqa: F811
    prompt = TOK.encode("logprobs, please").tolist()
    new = 6
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": 3, "echo": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, ref = greedy_reference(hf, prompt, new)
    lp = choice["logprobs"]
    assert lp["tokens"] == [TOK.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - float(ref[p - 1, ids[p]])) < TOL, p
        assert_close_dict(lp["top_logprobs"][p], expected_top(ref[p - 1], ids[p], 3), p)
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    assert choice["text"].startswith("logprobs, please") and choice["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    streamed = sse(post(server, "/v1/completions", {**body, "stream": True}))
    chunks = [e for e in streamed[:-1] if e["choices"]]
    assert len(chunks) >= 2 and chunks[0]["choices"][0]["text"].startswith("logprobs, please")
    joined = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(joined["token_logprobs"][1:], lp["token_logprobs"][1:])) < 1e-6
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]

    # without echo: the generated tokens only, offsets from the generated text's start
    r = post(server, "/v1/completions", {**body, "echo": False, "logprobs": 0, "prompt": TOK.decode(prompt)})
    lp = r.json()["choices"][0]["logprobs"]
    generated = ids[len(prompt) :]
    assert lp["tokens"] == [TOK.decode([i]) for i in generated] and lp["text_offset"][0] == 0
    for j, token in enumerate(generated):
        row = ref[len(prompt) + j - 1]
        assert abs(lp["token_logprobs"][j] - float(row[token])) < TOL
        assert_close_dict(lp["top_logprobs"][j], {TOK.decode([token]): float(row[token])}, j)  # logprobs 0: the chosen


def test_max_tokens_0_with_echo_scores_the_prompt(server, hf):  # noqa: F811
    text = "score me"
    prompt = TOK.encode(text).tolist()
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    whole = r.json()
    choice = whole["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == len(prompt)
    _, ref = greedy_reference(hf, prompt, 0)
    lp = choice["logprobs"]
    assert lp["tokens"] == list(text) and lp["token_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][p] - float(ref[p - 1, prompt[p]])) < TOL
        assert_close_dict(lp["top_logprobs"][p], expected_top(ref[p - 1], prompt[p], 2), p)
    events = sse(post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "stream": True}))
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["choices"][0] == {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == text and r.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_match_transformers_streamed_and_not(server, hf):  # noqa: F811
    messages = [{"role": "user", "content": "hi there"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True}
    r = post(server, "/v1/chat/completions", {**body, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    whole = r.json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 5
    prompt = TOK.encode("user: hi there\nassistant: ").tolist()  # the plain chat format of a model without a template
    ids, ref = greedy_reference(hf, prompt, 5)
    for j, entry in enumerate(content):
        token, row = ids[len(prompt) + j], ref[len(prompt) + j - 1]
        assert entry["token"] == TOK.decode([token]) and abs(entry["logprob"] - float(row[token])) < TOL
        # bytes: the token's own byte (a lone byte past ASCII is U+FFFD as text, its raw byte as bytes)
        assert entry["bytes"] == ([token] if token < 256 else [])
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
        assert [t["bytes"] for t in entry["top_logprobs"]] == [[i] if i < 256 else [] for i in row.topk(2).indices]
    # logprobs alone: the chosen tokens, no alternatives
    r = post(server, "/v1/chat/completions", body)
    assert [e["top_logprobs"] for e in r.json()["choices"][0]["logprobs"]["content"]] == [[]] * 5

    events = sse(post(server, "/v1/chat/completions", {**body, "top_logprobs": 2, "stream": True}))
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content], abs=1e-6)


def test_the_openai_client_reads_logprobs(server):  # noqa: F811
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = client.chat.completions.create(  # (sampled: ignore_eos, or a drawn eos would end it short of 3)
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 1
    completion = client.completions.create(
        model="tiny", prompt="abc", max_tokens=2, logprobs=1, echo=True, extra_body={"ignore_eos": True}
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens[:3] == ["a", "b", "c"] and logprobs.token_logprobs[0] is None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_cached_tokens_are_reported_in_usage(server):  # noqa: F811
    prompt = TOK.encode("a prompt long enough to fill a few KV blocks of sixteen tokens").tolist()
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    first = sse(post(server, "/v1/completions", body))[-2]["usage"]
    again = sse(post(server, "/v1/completions", body))[-2]["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # the engine caches prefixes by default (engine.enable_prefix_caching): the same prompt again finds its full
    # blocks (16 tokens each), short of its last token
    assert again["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16 > 0
    chat = {"messages": [{"role": "user", "content": "zqx: a chat nobody sent before"}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", chat)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r = post(server, "/v1/chat/completions", chat)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ("/v1/completions", {"max_tokens": -1, "echo": True}, "max_tokens"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": 1}, "echo"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_out_of_range_logprobs_parameters_are_400s_naming_them(server, path, extra, param):  # noqa: F811
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = post(server, path, {**body, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400, error


def test_stream_events_with_logprobs_are_the_chunk_dicts_json():
    import json

    from pylon.serving.api import protocol
    from pylon.serving.engine.request import TokenLogprob
    from pylon.serving.engine.tokenization import TokenTexts

    pairs = [(104, TokenLogprob(104, -0.25, ((104, -0.25), (300, -2.0)))), (34, TokenLogprob(34, -3.0))]
    for kind, make in (("completion", protocol.completion_chunk), ("chat", protocol.chat_chunk)):
        events = protocol.StreamEvents(kind, "id-1", "m")
        fmt = protocol.LogprobsFormat(TokenTexts(TOK))
        logprobs = fmt.completion(pairs) if kind == "completion" else fmt.chat(pairs)
        expected = make("id-1", "m", 'h"' if kind == "completion" else {"content": 'h"'}, None, logprobs)
        expected["created"] = events.created
        assert events.chunk('h"', None, logprobs) == f"data: {json.dumps(expected, separators=(',', ':'))}\n\n"
    assert fmt.offset == 0  # chat keeps no offsets; completions' run on across a stream's chunks
    completion = protocol.LogprobsFormat(TokenTexts(TOK))
    assert completion.completion(pairs)["text_offset"] == [0, 1]
    assert completion.completion(pairs)["text_offset"] == [2, 3]
    # top_logprobs by text: the chosen token is there once; an id without text (>= 256) is the empty string
    assert completion.completion(pairs)["top_logprobs"] == [{"h": -0.25, "": -2.0}, {'"': -3.0}]
