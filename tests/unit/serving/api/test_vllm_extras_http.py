"""vLLM's request extras over HTTP (`include_stop_str_in_output`, `allowed_token_ids`, `truncate_prompt_tokens`,
`cache_salt`), through the official client's `extra_body` against a real server: each reaches the engine and shows in
the answer; a bad value is a 400 naming the field."""

from __future__ import annotations

import pytest
import requests
from test_serving_http import KEY, auth, model_dir, server  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_the_extras_reach_the_engine(client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    free = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    k = next(k for k in range(3, len(text) - 2) if "\ufffd" not in text[k : k + 2])
    stop = text[k : k + 2]
    for keep in (False, True):
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True, "include_stop_str_in_output": keep},
        )
        assert reply.choices[0].text == text[: text.find(stop) + (2 if keep else 0)]
    allowed = [ord(c) for c in "abc "]  # the byte tokenizer: a byte is its id
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=1.0, seed=1, extra_body={"allowed_token_ids": allowed}
    )
    assert reply.choices[0].text and set(reply.choices[0].text) <= set("abc ")
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 10}
    )
    assert reply.usage.prompt_tokens == 10
    chat = [{"role": "user", "content": "a long shared context " * 8}]
    salted = {"cache_salt": "tenant-a"}
    first = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, extra_body=salted)
    again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, extra_body=salted)
    other = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, extra_body={"cache_salt": "b"})
    cached = [
        r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        for r in (first, again, other)
    ]
    assert cached[0] == 0 and cached[1] >= 64 and cached[2] == 0, cached


@pytest.mark.parametrize(
    "field, value",
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [10**7]),
        ("truncate_prompt_tokens", -2),
        ("cache_salt", ""),
        ("include_stop_str_in_output", "yes"),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 1}),
        ("repetition_detection", {"max_pattern_size": 4, "min_pattern_size": 5, "min_count": 3}),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 3, "mode": "x"}),
    ],
)
def test_a_bad_extra_is_a_400_naming_it(server, field, value) -> None:  # noqa: F811
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}
    r = requests.post(f"{server}/v1/completions", headers=auth(), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_a_looping_output_ends_with_finish_reason_repetition(client) -> None:
    """repetition_detection: one allowed token repeats it; the output ends once it is said min_count times (streamed
    and not, both endpoints); max_pattern_size 0 leaves it off."""
    loop = {"allowed_token_ids": [ord("a")], "repetition_detection": {"max_pattern_size": 3, "min_count": 5}}
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=40, temperature=0, extra_body=loop)
    assert reply.choices[0].text == "aaaaa" and reply.choices[0].finish_reason == "repetition"
    chat = [{"role": "user", "content": "hi"}]
    streamed = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=40, temperature=0, stream=True, extra_body=loop
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "aaaaa"
    assert chunks[-1].choices[0].finish_reason == "repetition"
    off = {**loop, "repetition_detection": {"max_pattern_size": 0, "min_count": 5}}
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=12, temperature=0, extra_body=off)
    assert reply.choices[0].text == "a" * 12 and reply.choices[0].finish_reason == "length"
