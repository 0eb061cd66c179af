"""vLLM's request parameters for prefills, RL and evaluation clients over HTTP, against a real server: a chat that
continues its last message (`continue_final_message`, `add_generation_prompt`) and echoes it (`echo`), the token ids
of the prompt and the reply (`return_token_ids`), the prompt's log-probabilities in vLLM's shape (`prompt_logprobs`),
logprob tokens as ids (`return_tokens_as_token_ids`), `bad_words`, `priority` (and the X-Vllm-Priority header),
`request_id`; streamed and not; each bad value a 400 naming its field."""

from __future__ import annotations

import pytest
import requests
from test_serving_http import auth, model_dir, server, serving, sse  # noqa: F401 (fixtures)

QUESTION = {"role": "user", "content": "What is 2+2?"}
PREFILL = {"role": "assistant", "content": "The answer is"}


def post(server, path: str, body: dict, headers: dict | None = None) -> requests.Response:  # noqa: F811
    return requests.post(f"{server}{path}", headers={**auth(), **(headers or {})}, json=body, timeout=60)


def ok(r: requests.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chat_continues_its_last_message_and_echoes_it(server) -> None:  # noqa: F811
    """continue_final_message: the reply is the model's continuation of the prompt that ends inside the assistant's
    message, which a completion of that very text gives too; echo puts the message before the reply's content,
    streamed and not."""
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = {**base, "messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True}
    reply = ok(post(server, "/v1/chat/completions", chat))
    content = reply["choices"][0]["message"]["content"]
    prompt = "user: What is 2+2?\nassistant: The answer is"  # the tiny model's plain chat lines, left open
    same = ok(post(server, "/v1/completions", {**base, "prompt": prompt, "add_special_tokens": False}))
    assert content == same["choices"][0]["text"] and reply["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    tokenized = ok(post(server, "/tokenize", {"model": "tiny", "prompt": prompt, "add_special_tokens": False}))
    assert tokenized["count"] == reply["usage"]["prompt_tokens"]
    as_chat = {"model": "tiny", "messages": chat["messages"], "add_generation_prompt": False}
    assert ok(post(server, "/tokenize", {**as_chat, "continue_final_message": True}))["tokens"] == tokenized["tokens"]
    ended = ok(post(server, "/v1/chat/completions", {**base, "messages": [QUESTION], "add_generation_prompt": False}))
    assert ended["usage"]["prompt_tokens"] == len("user: What is 2+2?\n")  # no "assistant: " after it

    echoed = ok(post(server, "/v1/chat/completions", {**chat, "echo": True}))
    assert echoed["choices"][0]["message"]["content"] == "The answer is" + content
    events = sse(post(server, "/v1/chat/completions", {**chat, "echo": True, "stream": True}))
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == "The answer is" + content
    plain = ok(post(server, "/v1/chat/completions", {**base, "messages": [QUESTION, PREFILL], "echo": True}))
    assert plain["choices"][0]["message"]["content"].startswith("The answer is")  # a new turn after it: echoed too
    no_echo = ok(post(server, "/v1/chat/completions", {**base, "messages": [QUESTION], "echo": True}))
    assert (
        no_echo["choices"][0]["message"]["content"]
        == ok(post(server, "/v1/chat/completions", {**base, "messages": [QUESTION]}))["choices"][0]["message"][
            "content"
        ]
    )  # the last message is the user's: nothing to echo


def test_token_ids_and_prompt_logprobs_come_back_in_vllms_shape(server) -> None:  # noqa: F811
    """return_token_ids: the prompt's ids as /tokenize counts them and the reply's ids, whose text is the reply's;
    streamed, the prompt's on the first chunk and each chunk's own after. prompt_logprobs: per prompt token (null at
    the first) its token's logprob (the echoed prompt's, as the legacy shape gives it), its rank, and the most likely
    tokens with ranks 1, 2, ..."""
    prompt = "hello world, hello"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    extra = {"return_token_ids": True, "prompt_logprobs": 2}
    answer = ok(post(server, "/v1/completions", {**body, **extra}))
    choice = answer["choices"][0]
    ids = ok(post(server, "/tokenize", {"model": "tiny", "prompt": prompt}))["tokens"]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 6
    back = ok(post(server, "/detokenize", {"model": "tiny", "tokens": choice["token_ids"]}))
    assert back["prompt"] == choice["text"]
    lp = choice["prompt_logprobs"]
    assert len(lp) == len(ids) and lp[0] is None
    echo = ok(post(server, "/v1/completions", {**body, "echo": True, "logprobs": 2}))["choices"][0]["logprobs"]
    for p in range(1, len(ids)):
        entry = lp[p]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - echo["token_logprobs"][p]) < 1e-6
        assert mine["decoded_token"] == echo["tokens"][p]
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked[:2]] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        # the prompt's token: one of the two most likely (one entry for both), or a third entry ranked after them
        assert len(entry) == 2 if mine["rank"] <= 2 else (len(entry) == 3 and mine["logprob"] <= ranked[1]["logprob"])
    events = sse(post(server, "/v1/completions", {**body, **extra, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == ids and chunks[0]["prompt_logprobs"] == lp
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert "token_ids" not in ok(post(server, "/v1/completions", body))["choices"][0]  # only where asked

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    rendered = ok(post(server, "/tokenize", {"model": "tiny", "messages": messages}))["tokens"]
    reply = ok(post(server, "/v1/chat/completions", {**chat, **extra, "logprobs": True}))
    assert reply["prompt_token_ids"] == rendered and len(reply["prompt_logprobs"]) == len(rendered)
    own = reply["choices"][0]["token_ids"]
    assert [t["token"] for t in reply["choices"][0]["logprobs"]["content"]] == [
        ok(post(server, "/detokenize", {"model": "tiny", "tokens": [t]}))["prompt"] for t in own
    ]
    as_ids = ok(post(server, "/v1/chat/completions", {**chat, **extra, "logprobs": True, "top_logprobs": 1,
                                                      "return_tokens_as_token_ids": True}))  # fmt: skip
    content = as_ids["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == [f"token_id:{t}" for t in own]
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    events = sse(post(server, "/v1/chat/completions", {**chat, **extra, "stream": True}))
    assert events[0]["prompt_token_ids"] == rendered and len(events[0]["prompt_logprobs"]) == len(rendered)
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])] == own


def test_bad_words_priority_and_request_id(server) -> None:  # noqa: F811
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    free = ok(post(server, "/v1/completions", body))["choices"][0]["text"]
    printable = [c for c in free if c.isascii() and c.isprintable() and not c.isspace()]
    assert printable, free
    banned = max(set(printable), key=printable.count)
    text = ok(post(server, "/v1/completions", {**body, "bad_words": [banned]}))["choices"][0]["text"]
    assert banned not in text and text != free
    # priorities order the engine's queue; a request of any priority is answered as any other
    for extra, headers in (({"priority": -5}, None), ({}, {"X-Vllm-Priority": "7"}), ({"request_id": "mine-1"}, None)):
        assert ok(post(server, "/v1/completions", {**body, **extra}, headers))["choices"][0]["text"] == free


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "bad_words", [""]),
        ("/v1/completions", "bad_words", "word"),
        ("/v1/completions", "prompt_logprobs", 21),
        ("/v1/completions", "priority", "high"),
        ("/v1/completions", "request_id", "no spaces please"),
        ("/v1/completions", "return_token_ids", "yes"),
        ("/v1/completions", "skip_special_tokens", 0),
        ("/v1/chat/completions", "continue_final_message", True),  # with add_generation_prompt (the default)
        ("/v1/chat/completions", "documents", [{"title": 3}]),
        ("/v1/chat/completions", "thinking_token_budget", 5),  # a deployment that reads no reasoning
        ("/v1/completions", "thinking_token_budget", -2),
    ],
)
def test_a_bad_value_is_a_400_naming_it(server, path, field, value) -> None:  # noqa: F811
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [QUESTION, PREFILL]})
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_continuing_needs_an_assistant_message_and_the_priority_header_an_integer(server) -> None:  # noqa: F811
    chat = {"model": "tiny", "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True}
    r = post(server, "/v1/chat/completions", {**chat, "messages": [QUESTION]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0", r.text
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}, {"X-Vllm-Priority": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_logprobs_of_given_tokens_and_truncation_from_the_right(server) -> None:  # noqa: F811
    chat = {"model": "tiny", "messages": [QUESTION], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    reply = ok(post(server, "/v1/chat/completions", {**chat, "logprobs": True, "logprob_token_ids": [98, 97]}))
    for entry in reply["choices"][0]["logprobs"]["content"]:
        assert [t["token"] for t in entry["top_logprobs"]] == ["b", "a"]
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = ok(post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 9, "truncation_side": "right"}))
    head = ok(post(server, "/v1/completions", {**body, "prompt": "the quick"}))
    assert cut["usage"]["prompt_tokens"] == 9 and cut["choices"][0]["text"] == head["choices"][0]["text"]
    r = post(server, "/v1/completions", {**body, "logprob_token_ids": [97]})  # without logprobs
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server) -> None:  # noqa: F811
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse(post(server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}}))
    chunks = events[:-1]
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    generated = [c["usage"]["completion_tokens"] for c in chunks]
    assert generated == sorted(generated) and generated[-1] == 6 and generated[0] >= 1
    assert all(c["usage"]["total_tokens"] == 5 + c["usage"]["completion_tokens"] for c in chunks)
    assert all("usage" not in c for c in sse(post(server, "/v1/completions", body))[:-1])  # only where asked
    chat = {"model": "tiny", "messages": [QUESTION], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    events = sse(post(server, "/v1/chat/completions", {**chat, "stream": True,
                                                       "stream_options": {"continuous_usage_stats": True}}))  # fmt: skip
    assert events[-2]["usage"]["completion_tokens"] == 4 and all("usage" in e for e in events[:-1])


TEMPLATE = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"


def test_a_requests_own_chat_template_where_the_deployment_trusts_them(model_dir) -> None:  # noqa: F811
    """chat_template: rendered in place of the model's (here, the plain lines of a model without one), as a
    completion of the text it renders; refused by a deployment that does not take them (the default), and a template
    that fails is a 400 naming it."""
    chat = {"model": "tiny", "messages": [QUESTION], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with serving(model_dir, {"trust_request_chat_template": True}, max_model_len=256, separate_process=False) as (
        url,
        _,
    ):
        reply = ok(post(url, "/v1/chat/completions", {**chat, "chat_template": TEMPLATE}))
        text = "[USER] What is 2+2?\n[ASSISTANT] "
        completion = {k: v for k, v in chat.items() if k != "messages"}
        same = ok(post(url, "/v1/completions", {**completion, "prompt": text, "add_special_tokens": False}))
        assert reply["choices"][0]["message"]["content"] == same["choices"][0]["text"]
        assert reply["usage"]["prompt_tokens"] == len(text)
        for bad in ("{% for %}", "{{ messages[0].content + 1 }}", "{{ raise_exception('no') }}"):
            r = post(url, "/v1/chat/completions", {**chat, "chat_template": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    with serving(model_dir, max_model_len=256, separate_process=False) as (url, _):
        r = post(url, "/v1/chat/completions", {**chat, "chat_template": TEMPLATE})
        assert r.status_code == 400 and "trust_request_chat_template" in r.json()["error"]["message"], r.text
