"""The replica's HTTP API (`pylon.serving.api.http.OpenAIApp`) under a real uvicorn server on loopback, without Ray: a
tiny random GPT-2 export behind it, real HTTP clients (requests, the `openai` client) in front. Routing, errors as
OpenAI's JSON, auth, streaming, and the SSE chunks' JSON. Serve's own parts (X-Request-Id, disconnects cancelling
the request, HAProxy) are in tests/integration/test_serving.py."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.api import http as serving_http
from pylon.serving.api import keys, protocol
from pylon.serving.api import server as serving_server

KEY = "sk-unit-test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=1024,  # room for a tool preamble (byte tokens)
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("http-model")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


@pytest.fixture(scope="module")
def server(model_dir):
    """A real uvicorn server on a free loopback port serving OpenAIApp over a PylonLLMServer (in-process engine)."""
    with serving(
        model_dir,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_tokens=4096,
        max_model_len=1024,
        separate_process=False,
    ) as (url, _):
        yield url


@contextlib.contextmanager
def serving(model_dir, http: dict | None = None, **engine):
    """A uvicorn server on a free loopback port in front of a PylonLLMServer of the tiny model (`engine`: the spec's
    engine fields): its base URL and the replica."""
    import os

    import uvicorn

    from pylon.specs import DeploymentSpec

    os.environ["PYLON_SCHED_BATCH"] = "0"  # leave this test process's threads at their policy
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "tiny",
            "model": model_dir,
            "engine": {"device": "cpu", "dtype": "fp32", **engine},
            "http": {
                "api_keys_env": "PYLON_TEST_HTTP_KEYS",
                "stream_interval_ms": 20,
                "max_queued_requests": 8,
                **(http or {}),
            },
        }
    )
    # as build_app does: the env var's keys become salted hashes, and the replica gets only those
    stored = keys.api_keys_config(spec, {"PYLON_TEST_HTTP_KEYS": f"{KEY},sk-other"})
    replica = serving_server.PylonLLMServer(spec.model_dump(mode="json"), stored)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    http = uvicorn.Server(
        uvicorn.Config(
            replica.__serve_build_asgi_app__(), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    )
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", replica
    finally:
        http.should_exit = True
        thread.join(10)
        replica.engine.shutdown()
        os.environ.pop("PYLON_SCHED_BATCH", None)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def sse(r) -> list:
    """The events of a streamed response: parsed JSON objects, then the literal "[DONE]"."""
    events = []
    for block in r.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completions_streamed_and_not_agree_and_count_usage(server):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{server}/v1/completions", headers=auth(), json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    whole = r.json()
    assert whole["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 24,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert whole["choices"][0]["finish_reason"] == "length" and whole["object"] == "text_completion"

    r = requests.post(
        f"{server}/v1/completions",
        headers=auth(),
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert len(chunks) >= 2  # streamed, not one blob
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks + [usage]} == {
        (chunks[0]["id"], chunks[0]["created"], "tiny", "text_completion")
    }
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]  # greedy: the same text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_chat_streams_the_role_first_and_the_openai_client_reads_it(server):
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 12 and whole.choices[0].message.role == "assistant"
    parts = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert parts[0].choices[0].delta.role == "assistant" and parts[0].choices[0].delta.content == ""
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.models.retrieve("gpt-4o")


def test_openai_fields_at_their_neutral_value_are_served_and_the_rest_named(server):
    """What OpenAI's clients and agent frameworks send by habit (no tools, text output, a tool result message)
    is served; asking for what this server does not do (function calling, structured output, top logprobs without
    logprobs, a compressed body) is a 4xx that names the field, never "unknown field"."""
    import gzip

    from openai import OpenAI

    url = f"{server}/v1/chat/completions"
    # ignore_eos: the default temperature (1) samples, and a sampled end-of-text would end a reply short of 3 tokens.
    base = {"model": "tiny", "max_tokens": 3, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
    neutral = [
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True},
        {"tool_choice": "auto", "tools": None, "logprobs": False},
        {"response_format": {"type": "text"}},
        {
            "messages": [
                {"role": "user", "content": "what is 2+2?"},
                {"role": "assistant", "content": "", "tool_calls": []},
                {"role": "tool", "content": "4", "tool_call_id": "call_1"},
            ]
        },
    ]
    for extra in neutral:
        r = requests.post(url, headers=auth(), json={**base, **extra}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, (extra, r.text)
    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny",
        messages=base["messages"],
        max_tokens=3,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},  # a sampled end-of-text would end the reply short of 3 tokens
    )
    assert reply.usage.completion_tokens == 3

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    refused = [
        ({"tools": [{"type": "retrieval"}]}, "tools.0", '"type": "function"'),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice.function.name",
            "not one of",
        ),
        (
            {"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "give one",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema.type",
            "not a valid JSON Schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/$defs/nope"}}}},
                }
            },
            "response_format.json_schema.schema.$defs.nope",
            "cannot be compiled",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"schema": {}}}, "response_format.type", "missing required field"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"top_logprobs": 0, "logprobs": False}, "top_logprobs", "needs logprobs: true"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages.0.tool_calls.0",
            "a tool call is",
        ),
    ]
    for extra, param, words in refused:
        r = requests.post(url, headers=auth(), json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (extra, error)

    packed = gzip.compress(json.dumps(base).encode())
    r = requests.post(
        url, headers={**auth(), "Content-Type": "application/json", "Content-Encoding": "gzip"}, data=packed, timeout=30
    )
    assert r.status_code == 415 and r.json()["error"]["param"] == "body", r.text
    assert "'gzip' is not supported" in r.json()["error"]["message"]
    r = requests.post(url, headers={**auth(), "Content-Encoding": "identity"}, json=base, timeout=30)
    assert r.status_code == 200, r.text


def test_embeddings_through_the_openai_client_are_the_models_last_hidden_state(server, model_dir):
    """POST /v1/embeddings (OpenAI's): each input's last token's final hidden state, L2-normalised, as transformers
    computes it; texts and token ids, batches, base64 (the openai client's default) and floats, `dimensions`; bad
    inputs are 400s naming the input."""
    import base64

    import numpy as np
    from openai import OpenAI

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def want(ids: list[int], dimensions: int | None = None) -> np.ndarray:
        with torch.no_grad():
            hidden = model.base_model(torch.tensor([ids])).last_hidden_state[0, -1, :dimensions]
        return (hidden / hidden.norm()).numpy()

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    texts = ["hello", "a longer sentence about something else entirely", "hello"]
    out = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
    assert out.model == "tiny" and [d.index for d in out.data] == [0, 1, 2]
    for d, text in zip(out.data, texts):
        assert np.allclose(d.embedding, want(list(text.encode())), atol=1e-5), text
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(t.encode()) for t in texts)
    assert not np.allclose(out.data[0].embedding, out.data[1].embedding)

    url = f"{server}/v1/embeddings"
    ids = [[104, 105], [1, 2, 3, 4]]
    r = requests.post(url, headers=auth(), json={"model": "tiny", "input": ids, "encoding_format": "float"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["embedding"] * 2
    for d, item in zip(body["data"], ids):
        assert len(d["embedding"]) == 64 and np.allclose(d["embedding"], want(item), atol=1e-5)
    r = requests.post(
        url, headers=auth(), json={"model": "tiny", "input": [104, 105], "dimensions": 16, "encoding_format": "base64"}
    )
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (16,) and np.allclose(vector, want([104, 105], 16), atol=1e-5)

    refused = [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["fine", ""]}, "input.1", "must not be empty"),
        ({"input": "x" * 1100}, "input", "max_model_len"),
        ({"input": ["fine", "x" * 1100]}, "input.1", "max_model_len"),
        ({"input": [[1, 2], [999]]}, "input.1", "token ids"),
        ({"input": "hi", "dimensions": 65}, "dimensions", "at most the model's hidden size, 64"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": 5}, "input", ""),
    ]
    for extra, param, words in refused:
        r = requests.post(url, headers=auth(), json={"model": "tiny", **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (extra, error)
    r = requests.post(url, headers=auth(), json={"model": "text-embedding-3-small", "input": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert requests.post(url, json={"model": "tiny", "input": "hi"}, timeout=30).status_code == 401


def test_penalties_and_logit_bias_through_the_openai_client(server):
    """presence/frequency_penalty and logit_bias (OpenAI's) and repetition_penalty (vLLM's, in extra_body) reach the
    engine on both endpoints, streamed and not; values it cannot take are a 400 naming the field."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    common = {"model": "tiny", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    # The byte tokenizer's id 65 is "A": a bias of 100 makes every greedy token that one.
    forced = client.completions.create(prompt="hello", logit_bias={"65": 100}, **common)
    assert forced.choices[0].text == "A" * 12
    streamed = client.chat.completions.create(
        messages=[{"role": "user", "content": "hello"}], logit_bias={"66": 100}, stream=True, **common
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "B" * 12

    def tokens(**fields) -> str:
        body = {**common, **fields, "extra_body": {**common["extra_body"], **fields.pop("extra_body", {})}}
        return client.completions.create(prompt="hello there, hello there, hello", **body).choices[0].text

    plain = tokens()
    assert tokens(frequency_penalty=2.0) != plain
    assert tokens(presence_penalty=-2.0) != plain
    assert tokens(extra_body={"repetition_penalty": 3.0}) != plain
    assert tokens(frequency_penalty=0.0, presence_penalty=0.0, logit_bias={}) == plain  # neutral: unchanged
    # vLLM's min_p and min_tokens: min_p 1 keeps the best token only, whatever the temperature; a stop token that
    # would end the reply at once is masked until min_tokens are out
    assert tokens(temperature=1.5, seed=4, extra_body={"min_p": 1.0}) == plain
    assert tokens(temperature=1.5, seed=4) != plain
    # "A" (id 65) is made the best token by a bias and is a stop token: the reply ends at once, or after 5 tokens
    ending = {"model": "tiny", "max_tokens": 12, "temperature": 0, "logit_bias": {"65": 100}}
    stopped = client.completions.create(prompt="hello", **ending, extra_body={"stop_token_ids": [65]})
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    late = client.completions.create(prompt="hello", **ending, extra_body={"stop_token_ids": [65], "min_tokens": 5})
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 6
    assert "A" not in late.choices[0].text

    url = f"{server}/v1/completions"
    base = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for extra, param, words in [
        ({"logit_bias": {"400": 5}}, "logit_bias.400", "not in the model's vocabulary"),
        ({"logit_bias": {"A": 5}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": 200}}, "logit_bias.5", "less than or equal to 100"),
        ({"frequency_penalty": 3}, "frequency_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ]:
        r = requests.post(url, headers=auth(), json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (extra, error)


def test_n_choices_streamed_and_not_through_the_openai_client(server):
    """`n` choices: one engine request each, every choice with its index; a seed moves on by one per choice, so
    choice 0 is what n=1 gives and a repeat gives the same choices; streamed, every choice's chunks carry its index
    and join to the unstreamed text; usage counts the prompt once and every choice's tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    common = {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    three = client.completions.create(prompt="once upon", n=3, **common)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) == 3, texts  # three different draws
    assert three.usage.completion_tokens == 24 and three.usage.prompt_tokens == 9
    assert three.usage.total_tokens == 33
    one = client.completions.create(prompt="once upon", **common)
    assert one.choices[0].text == texts[0]
    assert [c.text for c in client.completions.create(prompt="once upon", n=3, **common).choices] == texts

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=messages, n=2, **common)
    assert [c.index for c in whole.choices] == [0, 1] and all(c.finish_reason == "length" for c in whole.choices)
    chunks = list(
        client.chat.completions.create(
            messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    joined, roles, reasons = ["", ""], [0, 0], [None, None]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        joined[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert joined == [c.message.content for c in whole.choices]
    assert roles == [1, 1] and reasons == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    url = f"{server}/v1/completions"
    for extra, param in [({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 3}, "best_of")]:
        r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "x", **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_a_batch_of_prompts_streamed_and_not(server):
    """OpenAI's batch of prompts (strings or token-id lists): prompt i's n choices are indexes i x n to i x n + n - 1,
    each what that prompt alone gives; usage counts each prompt once; a bad prompt of the batch is named by its
    index."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    common = {"model": "tiny", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **common).choices[0].text for p in ("once upon", "hello there")]
    batch = client.completions.create(prompt=["once upon", "hello there"], n=2, echo=True, **common)
    assert [(c.index, c.text) for c in batch.choices] == [
        (0, "once upon" + alone[0]),
        (1, "once upon" + alone[0]),
        (2, "hello there" + alone[1]),
        (3, "hello there" + alone[1]),
    ]
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (9 + 11, 4 * 6)
    chunks = list(
        client.completions.create(
            prompt=[[104, 105], [111, 110, 99, 101]], stream=True, stream_options={"include_usage": True}, **common
        )
    )
    joined = ["", ""]
    for chunk in chunks[:-1]:
        joined[chunk.choices[0].index] += chunk.choices[0].text
    assert joined == [client.completions.create(prompt=p, **common).choices[0].text for p in ("hi", "once")]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 12)

    url = f"{server}/v1/completions"
    for prompt, n, param in [
        (["fine", ""], 1, "prompt.1"),
        (["fine", "y" * 2000], 1, "prompt.1"),
        ([[1, 2], [3, 99999]], 1, "prompt.1"),
        (["p"] * 33, 2, "prompt"),
    ]:
        body = {"model": "tiny", "prompt": prompt, "n": n, "max_tokens": 2}
        r = requests.post(url, headers=auth(), json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (prompt[:3], r.text)
    # the server still answers
    assert client.completions.create(prompt="still here", **common).choices[0].text


def test_tokenize_and_detokenize_count_what_the_engine_computes(server):
    """vLLM's /tokenize and /detokenize: a prompt's count is its completion's prompt_tokens, a chat's its chat
    completion's (rendered by the same template); detokenize gives the text back; errors name the field."""
    url = f"{server}/tokenize"
    r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "hello there"}, timeout=30)
    assert r.status_code == 200, r.text
    answer = r.json()
    completion = requests.post(
        f"{server}/v1/completions",
        headers=auth(),
        json={"model": "tiny", "prompt": "hello there", "max_tokens": 1},
        timeout=30,
    ).json()
    assert answer["count"] == len(answer["tokens"]) == completion["usage"]["prompt_tokens"] == 11
    assert answer["max_model_len"] == 1024
    back = requests.post(f"{server}/detokenize", headers=auth(), json={"model": "tiny", "tokens": answer["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello there"}

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = requests.post(url, headers=auth(), json={"model": "tiny", "messages": messages}, timeout=30).json()
    reply = requests.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        json={"model": "tiny", "messages": messages, "max_tokens": 1},
        timeout=30,
    ).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"] > answer["count"]

    for path, body, status, param in [
        ("/tokenize", {"model": "tiny"}, 400, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "tools": []}, 400, "tools"),
        ("/tokenize", {"model": "tiny", "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "tiny", "tokens": [104, 99999]}, 400, "tokens.1"),
        ("/detokenize", {"model": "tiny", "tokens": [-1]}, 400, "tokens.0"),
    ]:
        r = requests.post(f"{server}{path}", headers=auth(), json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    r = requests.post(url, json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


INVOICE = {
    "type": "object",
    "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{3}$"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["kg", "m"]}},
                "required": ["qty", "unit"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["number", "lines", "paid"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_openai_client(server):
    """response_format json_schema and json_object on both endpoints, streamed and not, through the official client:
    every output of a random-weight model validates."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    schema_format = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": INVOICE, "strict": True}}
    messages = [{"role": "user", "content": "an invoice please"}]
    for seed in range(2):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=90, seed=seed, response_format=schema_format
        )
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), INVOICE)
        chunks = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=90, seed=seed, response_format=schema_format, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), INVOICE)
    # The completions endpoint takes response_format too (as vLLM's does).
    r = requests.post(
        f"{server}/v1/completions",
        headers=auth(),
        json={"model": "tiny", "prompt": "invoice:", "max_tokens": 90, "response_format": schema_format},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), INVOICE)
    obj = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=60, seed=3, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")


# The tool-calling tests' function's parameters (test_responses_api.py's too).
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_a_tool_calling_loop_through_the_openai_client(server):
    """The official client's loop: tool_choice "required" gets valid tool_calls (their arguments follow the
    function's schema), the tool's result goes back as a "tool" message after the assistant's message as the client
    returned it, and the model answers in text; the same calls stream as deltas the client reads."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    add = ADD
    tool_list = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": add}}]
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=tool_list, tool_choice="required", max_tokens=490, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.function.name == "add" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), add)
    messages.append(choice.message)  # as the client returned it: content null, tool_calls, refusal null...
    for call in calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    final = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=tool_list,
        tool_choice="none",
        max_tokens=8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)

    one = client.chat.completions.create(
        model="tiny",
        messages=messages[:1],
        tools=tool_list,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=120,
        seed=2,
        stream=True,
    )
    deltas, reasons = [], []
    for chunk in one:
        if chunk.choices:
            deltas.extend(chunk.choices[0].delta.tool_calls or [])
            reasons.append(chunk.choices[0].finish_reason)
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "add", deltas
    jsonschema.validate(json.loads(deltas[0].function.arguments), add)
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/nothing-here", 404),
        ("POST", "/", 404),
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("DELETE", "/health", 405),
    ],
)
def test_unknown_paths_and_wrong_methods_are_json_errors(server, method, path, status):
    r = requests.request(method, f"{server}{path}", headers=auth(), timeout=30)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error" and path.rstrip("/") in error["message"]
    if status == 405:
        assert r.headers["allow"] in ("GET", "POST")


def test_bad_bodies_auth_and_limits_are_4xx_and_the_server_still_answers(server, monkeypatch):
    url = f"{server}/v1/completions"
    r = requests.post(
        url, headers={**auth(), "Content-Type": "application/json"}, data=b'{"model": "tiny", "prom', timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "x", "max_tokenz": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokenz", r.text
    r = requests.post(url, headers=auth(), json={"model": "gpt-9", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        r = requests.post(url, headers=headers, json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert KEY not in r.text
    assert requests.get(f"{server}/v1/models", timeout=30).status_code == 401
    monkeypatch.setattr(serving_http, "MAX_BODY_BYTES", 4096)
    r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "x" * 5000}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    monkeypatch.undo()
    # Odd but valid parameters answer 200 and leave the engine serving (a temperature of 1e-40 used to make the
    # step's draw see NaN and stop the engine's loop: every later request a 503).
    for odd in (
        {"temperature": 1e-40},
        {"temperature": 1.0, "top_k": 2**70, "seed": 2**70},
        {"stop_token_ids": [2**70], "stream": True, "stream_options": None},
    ):
        r = requests.post(
            url, headers=auth(), json={"model": "tiny", "prompt": "x", "max_tokens": 3, **odd}, timeout=30
        )
        assert r.status_code == 200, (odd, r.text)
    health = requests.get(f"{server}/health", timeout=30)  # probes need no key
    ready = requests.get(f"{server}/ready", timeout=30).json()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready["ready"] is True and ready["model"] == "tiny" and ready["running"] == 0
    r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "still here", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_a_request_the_engine_fails_to_take_is_a_500_for_it_alone(server, monkeypatch):
    """The engine's fault in taking one request (RequestFailed) answers that request 500 with a JSON error, and the
    next request is served. The fault: sampling parameters corrupted after validation, as a bug might leave them."""
    original = protocol._Request.sampling_params

    def corrupted(self, default_max_tokens, defaults=None):
        params = original(self, default_max_tokens, defaults)
        if self.user == "break":
            params.stop = [3]  # not a string: the engine cannot build the request's detokenizer
        return params

    monkeypatch.setattr(protocol._Request, "sampling_params", corrupted)
    url = f"{server}/v1/completions"
    r = requests.post(
        url, headers=auth(), json={"model": "tiny", "prompt": "x", "max_tokens": 3, "user": "break"}, timeout=30
    )
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "could not take the request" in r.json()["error"]["message"]
    r = requests.post(url, headers=auth(), json={"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and requests.get(f"{server}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "text", ["", "plain", 'quotes " and \\ backslash', "new\nline\ttab\x01", "unicode: é ü 你好 🙂", "</script>"]
)
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_stream_events_are_the_chunk_dicts_json(text, reason):
    def dumped(obj):
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    completion = protocol.StreamEvents("completion", "cmpl-1", 'model "x"')
    expected = protocol.completion_chunk("cmpl-1", 'model "x"', text, reason)
    expected["created"] = completion.created
    assert completion.chunk(text, reason) == dumped(expected)
    chat = protocol.StreamEvents("chat", "chatcmpl-1", "m")
    expected = protocol.chat_chunk("chatcmpl-1", "m", {"content": text} if text else {}, reason)
    expected["created"] = chat.created
    assert chat.chunk(text, reason) == dumped(expected)
    role = protocol.chat_chunk("chatcmpl-1", "m", {"role": "assistant", "content": ""}, None)
    role["created"] = chat.created
    assert chat.role() == dumped(role)
    usage = protocol.usage_chunk("chatcmpl-1", "m", "chat.completion.chunk", 5, 7)
    usage["created"] = chat.created
    assert chat.usage(5, 7) == dumped(usage)


# -- EnginePool: engine.data_parallel engines behind one replica -------------------------------------------------


def _pool_spec():
    """Two engine processes of the tiny model, small enough to start in seconds."""
    from pylon.specs import EngineSpec

    return EngineSpec(
        max_num_seqs=4,
        max_num_batched_tokens=128,
        kv_cache_tokens=1024,
        max_model_len=128,
        device="cpu",
        dtype="fp32",
        data_parallel=2,
    )


def test_an_engine_pool_spreads_requests_and_matches_one_engine(model_dir):
    import asyncio

    from pylon.serving.engine.engine import AsyncLLMEngine
    from pylon.serving.engine.process import EnginePool
    from pylon.serving.engine.sampling import SamplingParams

    spec = _pool_spec()
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def run(engine, during=None):
        async def one(i):
            out = []
            async for o in engine.generate(f"r{i}", prompts[i], params, interval_s=0.02):
                out.extend(o.token_ids)
                if during is not None and i == 0:
                    during.append(engine.stats())
            return out

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    pool = EnginePool.from_model(model_dir, spec)
    try:
        assert len(set(pool.pids)) == 2 and pool.max_model_len == 128 and pool.device == "cpu"
        seen = []
        got = asyncio.run(run(pool, seen))
        per_engine = [e.stats() for e in pool.engines]
        # 8 requests at once: 4 to each engine (the one with the fewest open streams), none left waiting
        assert [s.requests_finished_total.get("length", 0) for s in per_engine] == [4, 4]
        total = pool.stats()
        assert total.num_blocks == sum(s.num_blocks for s in per_engine) and total.requests_finished_total == {
            "length": 8
        }
        assert total.generation_tokens_total == 8 * 12 and total.num_running == 0
        assert seen and max(s.num_running for s in seen) >= 1  # combined stats while streaming
        assert pool.check_health()
    finally:
        pool.shutdown()
    assert not pool.check_health()
    # (the reference in this process: one engine process fewer to start)
    single = AsyncLLMEngine.from_model(model_dir, spec.model_copy(update={"data_parallel": 1}))
    try:
        assert asyncio.run(run(single)) == got  # greedy: the same tokens whichever engine served a request
    finally:
        single.shutdown()


@pytest.mark.slow  # make test-all: engine processes, ~15-20 s each on CI
def test_a_batch_of_prompts_spreads_over_an_engine_pool(model_dir):
    """A batch's engine requests are made one after the other, each once the previous one is counted: on a replica
    with two engine processes, a batch of 8 prompts goes 4 and 4, and each choice is what its prompt alone gives."""
    pool = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "kv_cache_tokens": 1024, "max_model_len": 128}
    with serving(model_dir, data_parallel=2, **pool) as (url, replica):
        prompts = [f"prompt number {i}:" for i in range(8)]
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, "prompt": prompts}, timeout=60)
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        per_engine = [e.stats().requests_finished_total.get("length", 0) for e in replica.engine.engines]
        assert per_engine == [4, 4]
        for prompt, text in zip(prompts, texts):
            alone = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, "prompt": prompt}, timeout=60)
            assert alone.json()["choices"][0]["text"] == text


def test_a_client_gone_mid_stream_aborts_every_choice(model_dir):
    """n choices streamed, then the client goes, which Serve's ingress turns into cancelling the request's task:
    every choice's engine request is aborted, none left running, every KV block back."""
    import asyncio

    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_cache_tokens": 4096, "max_model_len": 1024}
    with serving(model_dir, separate_process=False, **engine) as (_, replica):
        body = json.dumps(
            {"model": "tiny", "prompt": "go on:", "n": 3, "max_tokens": 1000, "stream": True, "ignore_eos": True}
        ).encode()
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
        }

        async def scenario() -> int:
            received, every_choice = [b""], asyncio.Event()

            async def receive():
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message):
                if message["type"] == "http.response.body":
                    received[0] += message["body"]
                    if all(f'"index":{k}'.encode() in received[0] for k in range(3)):
                        every_choice.set()

            task = asyncio.create_task(replica.__serve_build_asgi_app__()(scope, receive, send))
            await asyncio.wait_for(every_choice.wait(), 60)
            running = replica.engine.stats().num_running
            task.cancel()  # what Serve's ingress does when the client disconnects
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # within the replica's own loop, still running (asyncio.run's exit would close any stream left open)
            deadline = time.monotonic() + 5
            while replica.engine.stats().num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return running, replica.engine.stats().num_running

        assert asyncio.run(scenario()) == (3, 0)
        stats = replica.engine.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.requests_finished_total == {"abort": 3}


@pytest.mark.slow  # make test-all: engine processes, ~15-20 s each on CI
def test_an_engine_pool_routes_around_a_dead_engine(model_dir):
    """One engine of a pool dies (the OOM killer, a segfault): its streams end with EngineDeadError, the pool
    reports unhealthy (Serve replaces the replica), and until then every new request goes to the live engine
    instead of a 503 from the dead one, which by open streams alone would have looked the least busy."""
    import asyncio

    from pylon.serving.engine.process import EnginePool
    from pylon.serving.engine.sampling import SamplingParams

    spec = _pool_spec()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def run(n):
        async def one(i):
            return [t async for o in pool.generate(f"r{i}", [5 + i, 6, 7], params) for t in o.token_ids]

        return await asyncio.gather(*(one(i) for i in range(n)))

    pool = EnginePool.from_model(model_dir, spec)
    try:
        before = asyncio.run(run(6))
        dead, live = pool.engines
        dead._proc.kill()
        deadline = time.monotonic() + 10
        while dead.check_health():
            assert time.monotonic() < deadline, "the pool did not notice its engine's death"
            time.sleep(0.05)
        assert not pool.check_health() and live.check_health()
        finished = live.stats().requests_finished_total.get("length", 0)
        assert asyncio.run(run(6)) == before  # all six served, by the live engine, the same greedy tokens
        assert live.stats().requests_finished_total["length"] == finished + 6
    finally:
        pool.shutdown()


@pytest.mark.slow  # make test-all: engine processes, ~15-20 s each on CI
def test_an_engine_pool_sends_a_prompt_to_the_engine_that_holds_its_prefix(model_dir):
    """Two long prefixes, A and B, start together: one engine each. Later requests that continue B go to B's engine
    (its reported cache holds B's blocks) although by open streams alone the first engine, A's, would take them
    (both idle: a tie goes to the first); they find B's blocks cached. With the holder busy, the least loaded
    engine takes a request instead."""
    import asyncio

    from pylon.serving.engine.process import EnginePool
    from pylon.serving.engine.sampling import SamplingParams

    a, b = [(3 * j) % 250 for j in range(70)], [(5 * j + 1) % 250 for j in range(70)]

    async def one(pool, rid, prompt):
        outs = [o async for o in pool.generate(rid, prompt, SamplingParams(max_tokens=4, temperature=0))]
        return outs[-1]

    async def scenario(pool):
        await asyncio.gather(one(pool, "a", a), one(pool, "b", b))
        holders = [e.cached_prefix_blocks(pool_hashes(b)) for e in pool.engines]
        later = [await one(pool, f"b{i}", b + [i, i + 1]) for i in range(3)]
        return holders, later

    def pool_hashes(prompt):
        from pylon.serving.engine.kv_cache import block_hashes

        return block_hashes(prompt[:-1], 16, [])

    pool = EnginePool.from_model(model_dir, _pool_spec())
    try:
        deadline = time.monotonic() + 10
        holders, later = asyncio.run(scenario(pool))
        while sorted(holders) != [0, 4] and time.monotonic() < deadline:  # the engines report at their next beat
            time.sleep(0.1)
            holders = [e.cached_prefix_blocks(pool_hashes(b)) for e in pool.engines]
        assert sorted(holders) == [0, 4], holders  # B's four full blocks, on one engine only
        assert holders[1] == 4  # the second engine: A took the first
        assert [o.num_cached_tokens for o in later] == [64, 64, 64], later
        finished = [e.stats().requests_finished_total.get("length", 0) for e in pool.engines]
        assert finished == [1, 4], finished
    finally:
        pool.shutdown()


def test_engine_pool_children_split_the_cpus_or_take_a_gpu_each():
    from pylon.errors import PylonError
    from pylon.serving.engine.process import _engine_envs

    assert _engine_envs(1, "cpu", {"OMP_NUM_THREADS": "8"}) == [{}]
    assert _engine_envs(2, "cpu", {"OMP_NUM_THREADS": "8"}) == [{"OMP_NUM_THREADS": "4"}] * 2
    assert (
        _engine_envs(4, "cpu", {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
        == [{"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}] * 4
    )
    assert _engine_envs(2, "cuda", {"CUDA_VISIBLE_DEVICES": "3,5"}) == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "5"},
    ]
    with pytest.raises(PylonError, match="data_parallel: 2 engines need 2 GPUs.*has 1.*num_gpus to 2"):
        _engine_envs(2, "cuda", {"CUDA_VISIBLE_DEVICES": "0"})


def test_data_parallel_spec_rules():
    from pylon.errors import PylonError
    from pylon.specs import DeploymentSpec, EngineSpec

    assert EngineSpec(data_parallel=2).data_parallel == 2
    with pytest.raises((PylonError, ValueError), match="data_parallel"):
        EngineSpec(data_parallel=2, separate_process=False)
    base = {"kind": "Deployment", "name": "m", "model": "/m"}
    assert DeploymentSpec.model_validate({**base, "engine": {"data_parallel": 2}, "replica": {"num_cpus": 2}})
    with pytest.raises((PylonError, ValueError), match="replica.num_gpus.*data_parallel"):
        DeploymentSpec.model_validate(
            {**base, "engine": {"data_parallel": 2, "device": "cuda"}, "replica": {"num_gpus": 1}}
        )


@pytest.mark.slow  # make test-all: engine processes, ~15-20 s each on CI
def test_an_engine_pool_that_cannot_load_says_why_and_leaves_no_process(tmp_path):
    import psutil

    from pylon.errors import PylonError
    from pylon.serving.engine.process import EnginePool
    from pylon.specs import EngineSpec

    (tmp_path / "config.json").write_text("{}")  # a directory, but not a model
    with pytest.raises(PylonError) as e:
        EnginePool.from_model(str(tmp_path), EngineSpec(device="cpu", data_parallel=2))
    assert str(tmp_path) in str(e.value)  # the loader's own message, naming the directory
    left = [
        c for c in psutil.Process().children(recursive=True) if "pylon.serving.engine.process" in " ".join(c.cmdline())
    ]
    assert not left, left


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            b'{"model": "m", "prompt": null}',
            "prompt",
            "prompt: expected str, list[int], list[str] or list[list[int]] (got null)",
        ),
        (b'{"model": "m", "prompt": [1, "a"]}', "prompt", '(got [1, "a"])'),
        (b'{"model": "m", "prompt": "x", "stop": 5}', "stop", "stop: expected str or list[str] (got 5)"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
            "messages.0.content",
            "messages.0.content: expected str or list[dict[str,any]] (got 5)",
        ),
        (b'{"model": "m", "messages": [{"role": "bot", "content": "x"}]}', "messages.0.role", '(got "bot")'),
        (b'{"model": "m", "prompt": "x", "temperature": "1"}', "temperature", 'valid number (got "1")'),
        (
            b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}',
            "stream_options.include_usage",
            'valid boolean (got "yes")',
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x", "name": 3}]}', "messages.0.name", "(got 3)"),
    ],
)
def test_type_errors_name_the_field_and_what_it_takes(body, param, message):
    """A union field's error names the field, not pydantic's branch ("prompt", not "prompt.str"), and lists the
    types it takes; values are shown as the client wrote them (JSON null, "strings"); nested objects are as strict
    as the request (a "yes" is not a boolean)."""
    cls = protocol.ChatCompletionRequest if b"messages" in body else protocol.CompletionRequest
    with pytest.raises(protocol.InvalidRequest) as e:
        protocol.parse_request(cls, body)
    assert e.value.param == param and message in str(e.value), str(e.value)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_reasoning_parser_splits_chat_replies_streamed_and_not(model_dir, server, parser):
    """With http.reasoning_parser, a chat reply's <think> block is `reasoning_content`: this random model never
    closes one, so under deepseek_r1 (the template opened it) the whole reply is reasoning and under qwen3 (it never
    opened one) the whole reply is content; streamed deltas add up to the same split, the role first. The same
    request to a server without a parser gives the raw reply. Completions and grammar-constrained chats stay raw."""
    messages = [{"role": "user", "content": "think about it"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 48, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    raw = requests.post(f"{server}/v1/chat/completions", headers=auth(), json=body, timeout=60).json()
    raw_text = raw["choices"][0]["message"]["content"]
    assert "reasoning_content" not in raw["choices"][0]["message"] and raw_text
    engine = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_cache_tokens": 4096, "max_model_len": 1024}
    with serving(
        model_dir, http={"reasoning_parser": parser, "stream_interval_ms": 0}, separate_process=False, **engine
    ) as (url, _):
        whole = requests.post(f"{url}/v1/chat/completions", headers=auth(), json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        message = whole.json()["choices"][0]["message"]
        expected = (raw_text, "") if parser == "deepseek_r1" else (None, raw_text)
        assert (message["reasoning_content"], message["content"]) == expected
        # usage says how many of the 48 tokens were reasoning: all of them under deepseek_r1, none under qwen3
        reasoning_tokens = 48 if parser == "deepseek_r1" else 0
        assert whole.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
        assert "completion_tokens_details" not in raw["usage"]  # no parser: no count
        streamed_usage = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = requests.post(f"{url}/v1/chat/completions", headers=auth(), json=streamed_usage, timeout=60)
        usage = sse(r)[-2]["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}, usage
        r = requests.post(f"{url}/v1/chat/completions", headers=auth(), json={**body, "stream": True}, timeout=60)
        events = sse(r)
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        streamed = (
            "".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") or "" for d in deltas),
        )
        assert streamed == (raw_text, "") if parser == "deepseek_r1" else streamed == ("", raw_text)
        if parser == "deepseek_r1":
            assert sum("reasoning_content" in d for d in deltas) >= 2, deltas  # streamed step by step (interval 0)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        # completions return the raw text; a grammar-constrained chat is not split (its output is the JSON)
        completion = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0}
        assert (
            requests.post(f"{url}/v1/completions", headers=auth(), json=completion, timeout=60).json()["choices"][0][
                "text"
            ]
            == requests.post(f"{server}/v1/completions", headers=auth(), json=completion, timeout=60).json()["choices"][
                0
            ]["text"]
        )
        # a grammar-constrained chat reasons first (pylon.serving.api.reply_guide): under deepseek_r1 the template
        # opened the block and this random model never closes it, so the reply is reasoning cut by max_tokens; under
        # qwen3 it opens none, so the reply is the JSON
        constrained = {**body, "max_tokens": 200, "response_format": {"type": "json_object"}, "ignore_eos": False}
        answer = requests.post(f"{url}/v1/chat/completions", headers=auth(), json=constrained, timeout=60).json()
        message, reason = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
        if parser == "deepseek_r1":
            assert message["reasoning_content"] and message["content"] == "" and reason == "length", answer
        else:
            assert message["reasoning_content"] is None and isinstance(json.loads(message["content"]), dict), answer


def test_lora_adapters_are_models_clients_name_and_each_answers_as_peft(model_dir, tmp_path):
    """engine.adapters over HTTP: GET /v1/models lists the base model and each adapter (its `parent` the base, as
    vLLM's); a request naming an adapter gets that adapter's greedy tokens (peft's own, streamed and not, through
    the `openai` client) and its name back in `model`; the base model's requests are untouched; an unknown name is
    a 404 listing the served ones."""
    import openai
    from openai import OpenAI
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)  # a change the tokens show (peft's random B alone barely moves them)
    peft_model.save_pretrained(tmp_path / "shout")
    prompt = list(b"the quick brown fox")

    @torch.no_grad()
    def greedy(model) -> list[int]:  # 12 argmax tokens, end of text or not (the requests ignore eos)
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    expected = greedy(peft_model)
    base_expected = greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    assert expected != base_expected
    adapters = [{"name": "shout", "path": str(tmp_path / "shout")}]
    with serving(model_dir, max_model_len=256, kv_cache_tokens=1024, separate_process=False, adapters=adapters) as (
        url,
        _,
    ):
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        cards = client.models.list().data
        assert [(m.id, m.parent) for m in cards] == [("tiny", None), ("shout", "tiny")]
        assert client.models.retrieve("shout").parent == "tiny"
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for model, want in (("shout", expected), ("tiny", base_expected), ("shout", expected)):
            r = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, "model": model}, timeout=60)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["model"] == model and answer["usage"]["completion_tokens"] == 12
            # The engine's tokens are peft's: their text is the text of peft's ids.
            text = requests.post(f"{url}/detokenize", headers=auth(), json={"model": model, "tokens": want}, timeout=60)
            assert text.status_code == 200, text.text
            assert answer["choices"][0]["text"] == text.json()["prompt"]
            streamed = list(
                client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            assert {c.model for c in streamed} == {model}
            assert "".join(c.choices[0].text for c in streamed) == answer["choices"][0]["text"]
        with pytest.raises(
            openai.NotFoundError, match=r"model \"whisper\" does not exist; this server has 'tiny', 'shout'"
        ):
            client.completions.create(model="whisper", prompt="hi", max_tokens=1)


def test_adapters_load_on_demand_from_object_storage_by_the_name_a_request_gives(model_dir, tmp_path, s3_root):
    """engine.dynamic_adapters with an s3:// root (a real S3-protocol server), one slot, in an engine process: each
    adapter named in `model` is fetched, loaded and answers peft's greedy tokens, the other evicted and loaded again
    as they alternate; GET /v1/models lists those fetched; a name with no adapter at the root is a 404 naming the
    root, a name outside the grammar a 404 without a look, an adapter above max_rank a 400 naming `model`."""
    import openai
    from openai import OpenAI
    from peft import LoraConfig, get_peft_model

    from pylon import storage

    prompt = list(b"the quick brown fox")

    @torch.no_grad()
    def greedy(model) -> list[int]:
        ids = list(prompt)
        for _ in range(10):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    expected = {}
    for seed, (name, r) in enumerate((("shout", 4), ("hush", 8), ("wide", 32))):
        torch.manual_seed(seed)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            LoraConfig(r=r, lora_alpha=r, target_modules=["c_attn", "c_fc"], init_lora_weights=False),
        )
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(20)
        model.save_pretrained(tmp_path / name)
        expected[name] = greedy(model)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            storage.upload_file(tmp_path / name / file, storage.join(s3_root, name, file))
    assert expected["shout"] != expected["hush"]
    dynamic = {"root": s3_root, "max_loaded": 1, "max_rank": 16}
    with serving(model_dir, max_model_len=256, kv_cache_tokens=1024, dynamic_adapters=dynamic) as (url, replica):
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        for model in ("shout", "hush", "shout", "hush"):
            r = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, "model": model}, timeout=60)
            assert r.status_code == 200, r.text
            text = requests.post(
                f"{url}/detokenize", headers=auth(), json={"model": model, "tokens": expected[model]}, timeout=60
            )
            assert (r.json()["model"], r.json()["choices"][0]["text"]) == (model, text.json()["prompt"])
        stats = replica.engine.stats()
        assert (stats.adapter_loads_total, stats.adapter_evictions_total) == (4, 3)
        cards = client.models.list().data
        assert [(m.id, m.parent) for m in cards] == [("tiny", None), ("shout", "tiny"), ("hush", "tiny")]
        with pytest.raises(openai.NotFoundError, match=r"model 'nope' does not exist: .*s3://.*/nope .*no adapter"):
            client.completions.create(model="nope", prompt="hi", max_tokens=1)
        with pytest.raises(openai.NotFoundError, match=r"model \"\.\./shout\" does not exist; this server has 'tiny'"):
            client.completions.create(model="../shout", prompt="hi", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match=r"model 'wide': s3://\S+/wide \(endpoint .* rank 32, above"):
            client.completions.create(model="wide", prompt="hi", max_tokens=1)
        r = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, "model": "tiny"}, timeout=60)
        assert r.status_code == 200, r.text


# A Qwen3-like generation_config.json (two eos ids, sampling defaults), over the tiny model.
GENERATION_CONFIG = {
    "eos_token_id": [300, 256],
    "do_sample": True,
    "temperature": 0,  # greedy: a request that leaves temperature out gives transformers' greedy tokens
    "top_p": 0.9,
    "top_k": 20,
    "max_new_tokens": 7,
}


def with_generation_config(model_dir: str, directory) -> str:
    import shutil

    shutil.copytree(model_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(directory)


def spy_on_params(replica, monkeypatch) -> list:
    """The SamplingParams of every engine request the replica makes from now on."""
    seen = []
    generate = replica.engine.generate

    def spy(request_id, prompt, params=None, **kwargs):
        seen.append(params)
        return generate(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(replica.engine, "generate", spy)
    return seen


def test_sampling_fields_a_request_leaves_out_take_the_models_defaults(model_dir, tmp_path, monkeypatch, caplog):
    """engine.generation_config auto (the default): a field a request leaves out takes the model's default from its
    generation_config.json, read by the engine process where it loads the model and handed to the replica; a field the
    request gives wins, at OpenAI's default value too. The replica says which defaults it took, once."""
    import logging

    directory = with_generation_config(model_dir, tmp_path / "model")
    pool = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "kv_cache_tokens": 1024, "max_model_len": 128}
    with (
        caplog.at_level(logging.INFO, logger="pylon.serving"),
        serving(directory, **pool) as (
            url,
            replica,
        ),
    ):
        assert replica.engine.generation.eos_token_ids == (300, 256)
        seen = spy_on_params(replica, monkeypatch)

        def post(path: str, body: dict) -> dict:
            r = requests.post(f"{url}{path}", headers=auth(), json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        prompt = {"prompt": "hello there", "ignore_eos": True}
        left_out = post("/v1/completions", prompt)
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 0.9, 20, 0.0, 1.0)
        assert p.max_tokens is None and left_out["usage"]["completion_tokens"] == 7  # the model's, not OpenAI's 16
        given = post("/v1/completions", {**prompt, "temperature": 0, "top_p": 1, "top_k": 0, "max_tokens": 7})
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0, 1, 0, 7)  # given, at OpenAI's defaults: kept
        assert left_out["choices"][0]["text"] == given["choices"][0]["text"]  # greedy either way
        answer = post("/v1/completions", {**prompt, "temperature": 0.5, "top_k": 5, "max_tokens": 3})
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.5, 0.9, 5, 3)
        assert answer["usage"]["completion_tokens"] == 3
        # chat, n choices: each takes the defaults
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "ignore_eos": True}
        answer = post("/v1/chat/completions", chat)
        assert [(p.temperature, p.top_k, p.max_tokens) for p in seen[-2:]] == [(0, 20, None)] * 2
        replies = [c["message"]["content"] for c in answer["choices"]]
        assert replies[0] == replies[1] and answer["usage"]["completion_tokens"] == 14  # greedy, 7 tokens each
    said = [r.getMessage() for r in caplog.records if "sets the sampling defaults" in r.getMessage()]
    assert len(said) == 1 and "temperature=0, top_p=0.9, top_k=20, max_tokens=7" in said[0], said


def test_generation_config_none_gives_openais_defaults_and_keeps_the_eos_ids(model_dir, tmp_path, monkeypatch):
    directory = with_generation_config(model_dir, tmp_path / "model")
    small = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "kv_cache_tokens": 1024, "max_model_len": 128}
    with serving(directory, generation_config="none", separate_process=False, **small) as (url, replica):
        assert replica.engine.generation.eos_token_ids == (300, 256) and replica.sampling_defaults == {}
        seen = spy_on_params(replica, monkeypatch)
        body = {"model": "tiny", "prompt": "hello there", "ignore_eos": True}
        r = requests.post(f"{url}/v1/completions", headers=auth(), json=body, timeout=60)
        assert r.status_code == 200, r.text
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 16)  # sampled, OpenAI's 16 tokens
        assert r.json()["usage"]["completion_tokens"] == 16


def test_a_completion_prompt_gets_its_tokenizers_bos_as_vllm_gives_it_and_a_chat_does_not(tmp_path):
    """A tokenizer that adds a BOS (Llama's, Gemma's): a completions text prompt is tokenized with it by default
    (vLLM's add_special_tokens: true), so its tokens are the model's greedy continuation of BOS + the text; with
    add_special_tokens false, of the text alone. /tokenize counts the same way (a chat's messages without it: its
    template writes its own); the routing key hashes what the engine computes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from pylon.serving.api.routing import HASH_BYTES, routing_key
    from pylon.serving.engine.kv_cache import block_hashes
    from pylon.serving.engine.tokenization import load_model_tokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 20], trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", chat_template=template
    ).save_pretrained(str(tmp_path))
    eos = raw.token_to_id("</s>")
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=256,
        vocab_size=300,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=0.5,  # a model whose continuations follow the context (the default's repeat one token)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    text = "the quick brown fox"
    plain = raw.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def greedy(ids: list[int]) -> list[int]:
        ids = list(ids)
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-8:]

    with_bos, without = greedy([bos, *plain]), greedy(plain)
    assert with_bos != without  # else the test could not tell
    with serving(str(tmp_path), max_model_len=128, kv_cache_tokens=1024, separate_process=False) as (url, _):
        body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for extra, want, count in (
            ({}, with_bos, len(plain) + 1),
            ({"add_special_tokens": False}, without, len(plain)),
        ):
            r = requests.post(f"{url}/v1/completions", headers=auth(), json={**body, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["usage"]["prompt_tokens"] == count
            # special tokens write no text (skip_special_tokens, vLLM's default)
            assert answer["choices"][0]["text"] == raw.decode(want, skip_special_tokens=True), extra
            tokenized = requests.post(
                f"{url}/tokenize", headers=auth(), json={"model": "tiny", "prompt": text, **extra}, timeout=60
            ).json()
            assert tokenized["tokens"] == ([bos] if not extra else []) + plain
        chat = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
        rendered = requests.post(f"{url}/tokenize", headers=auth(), json=chat, timeout=60).json()["tokens"]
        assert rendered[0] == bos and rendered[1] != bos  # the template's BOS only
        r = requests.post(f"{url}/v1/chat/completions", headers=auth(), json={**chat, "max_tokens": 2}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(rendered)
    tokenizer = load_model_tokenizer(str(tmp_path))
    key = routing_key(tokenizer, 2, {"model": "tiny", "prompt": text})
    assert key.hashes == tuple(h[:HASH_BYTES] for h in block_hashes([bos, *plain][:-1], 2, []))
