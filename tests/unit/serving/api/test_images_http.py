"""Images over HTTP through the official `openai` client against a real uvicorn server whose engine runs in its own
process (engine.separate_process, the default): a chat message's image_url parts (data: URLs) and the Responses API's
input_image parts reach a tiny Gemma 3 (Qwen2.5-VL; Mistral 3, Qwen3-VL) checkpoint's vision tower, and the reply is the conditional model's greedy
continuation as `transformers` computes it (tests/image_models.py), streamed and not; bad images are 400s naming
the part; a text-only model refuses images naming the part."""

from __future__ import annotations

import base64

import image_models
import pytest
import requests
from test_serving_http import KEY, auth, model_dir, serving  # noqa: F401 (fixtures)


def _url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(
    scope="module",
    params=["gemma3", "qwen2_5_vl", *(pytest.param(m, marks=pytest.mark.slow) for m in ("mistral3", "qwen3_vl"))],
)  # (the slow ones with make test-all)
def gemma(request, tmp_path_factory):
    directory = image_models.image_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return directory, image_models.Reference(directory)


@pytest.fixture(scope="module")
def server(gemma):
    directory, _ = gemma
    with serving(
        str(directory),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_tokens=2048,
        max_model_len=512,
        max_images_per_prompt=2,
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _expected(gemma, parts: list, new_tokens: int, logprobs: bool = False):
    """The reference's greedy reply text to one user message of `parts` (text, or bytes for an image), and the
    prompt's tokens (each image's placeholders counted); with `logprobs`, each reply token's log-probability too."""
    directory, reference = gemma
    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    text = image_models.render(directory, [{"role": "user", "content": content}])
    images = [p for p in parts if isinstance(p, bytes)]
    tokens = reference.greedy(text, images, new_tokens)
    prompt_tokens = reference.inputs(text, images)["input_ids"].shape[1]
    # The engine's text: every token's but the special ones' (skip_special_tokens, vLLM's default) and the eos.
    shown = tokens[:-1] if tokens and tokens[-1] == reference.tokenizer.eos_token_id else tokens
    reply = reference.tokenizer.decode(shown, skip_special_tokens=True)
    if not logprobs:
        return reply, prompt_tokens
    rows = reference.logprobs(text, images, tokens)
    return reply, prompt_tokens, [float(rows[i, t]) for i, t in enumerate(tokens)]


def _chat_content(parts: list) -> list[dict]:
    return [
        {"type": "image_url", "image_url": {"url": _url(p)}} if isinstance(p, bytes) else {"type": "text", "text": p}
        for p in parts
    ]


def test_a_chat_with_images_is_answered_as_the_model_reads_them(gemma, client) -> None:
    a, b = image_models.png(1), image_models.png(2, (40, 70))
    for parts in (["describe ", a, " what you see"], ["compare ", a, " and ", b, " please"]):
        want, prompt_tokens, logprobs = _expected(gemma, parts, 10, logprobs=True)
        messages = [{"role": "user", "content": _chat_content(parts)}]
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True
        )
        assert reply.choices[0].message.content == want
        # Each token's log-probability the reference's: two images move them by more than 1e-3 (test_images.py).
        got = [t.logprob for t in reply.choices[0].logprobs.content]
        assert len(got) == len(logprobs) and all(abs(g - w) < 1e-4 for g, w in zip(got, logprobs)), (got, logprobs)
        assert reply.usage.prompt_tokens == prompt_tokens  # each image's placeholder tokens counted
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_the_responses_api_takes_input_images(gemma, client) -> None:
    a = image_models.png(3, (90, 30))
    want, _ = _expected(gemma, ["what is this ", a], 10)
    response = client.responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this "},
                    {"type": "input_image", "image_url": _url(a)},
                ],
            }
        ],
        max_output_tokens=10,
        temperature=0,
    )
    assert response.output_text == want


@pytest.mark.parametrize(
    "part, param, says",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url.url", "inline"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "image_url.url", "base64"),
        (
            {"type": "image_url", "image_url": {"url": _url(b"just some text", "png")}},
            "image_url.url",
            "not a readable image",
        ),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "image_url.url", "not an image data URL"),
        ({"type": "image_url", "image_url": 42}, "image_url", "a string"),
        ({"type": "input_audio", "input_audio": {}}, "", "text (and image_url) parts"),
    ],
)
def test_bad_images_are_400s_naming_the_part(server, part, param, says) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, part]}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == ("messages.0.content.1." + param if param else "messages.0"), error
    assert says in error["message"], error


def test_too_many_images_and_file_ids_are_refused(server) -> None:
    image = {"type": "image_url", "image_url": {"url": _url(image_models.png(1))}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": [image, image, image]}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.2.image_url.url", r.text
    assert "at most 2" in r.json()["error"]["message"]
    body = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    r = requests.post(f"{server}/v1/responses", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.0.file_id", r.text


def test_a_text_only_model_refuses_images_naming_the_part(model_dir) -> None:  # noqa: F811
    with serving(model_dir, max_num_seqs=2, kv_cache_tokens=2048, max_model_len=512, separate_process=False) as (
        url,
        _,
    ):
        image = {"type": "image_url", "image_url": {"url": _url(image_models.png(1))}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
        r = requests.post(f"{url}/v1/chat/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.content.1.image_url.url"
        assert "takes no images" in r.json()["error"]["message"]


def _anthropic_image(data: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
    }


def test_tokenize_and_count_tokens_count_each_images_tokens(gemma, server, client) -> None:
    """/tokenize and Anthropic's count_tokens run the model's processor in the replica: the ids and the count are
    the engine's (the reference's inputs; the usage the same chat reports), each image's placeholders included."""
    directory, reference = gemma
    a, b = image_models.png(1), image_models.png(2, (40, 70))
    parts = ["compare ", a, " and ", b, " please"]
    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    want = reference.inputs(image_models.render(directory, [{"role": "user", "content": content}]), [a, b])
    want = want["input_ids"][0].tolist()
    messages = [{"role": "user", "content": _chat_content(parts)}]
    r = requests.post(f"{server}/tokenize", json={"model": "tiny", "messages": messages}, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    text_only = requests.post(
        f"{server}/tokenize",
        json={"model": "tiny", "messages": [{"role": "user", "content": "compare  and  please"}]},
        headers=auth(),
        timeout=60,
    ).json()["count"]
    assert len(want) > text_only + 2  # (each image is many tokens)
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens == len(
        want
    )

    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)
    turns = [
        {
            "role": "user",
            "content": [_anthropic_image(p) if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts],
        }
    ]
    assert claude.messages.count_tokens(model="tiny", messages=turns).input_tokens == len(want)
    # An image a tool gave back (a screenshot) is counted and read as the message's
    tool = {"name": "screenshot", "input_schema": {"type": "object", "properties": {}}}
    turns = [
        {"role": "user", "content": "what is on the screen?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "the screen:"}, _anthropic_image(b)],
                }
            ],
        },
    ]
    counted = claude.messages.count_tokens(model="tiny", messages=turns, tools=[tool]).input_tokens
    reply = claude.messages.create(model="tiny", max_tokens=1, messages=turns, tools=[tool], extra_body={"seed": 1})
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted
    without = [*turns[:2], {"role": "user", "content": [{**turns[2]["content"][0], "content": "the screen:"}]}]
    assert counted > claude.messages.count_tokens(model="tiny", messages=without, tools=[tool]).input_tokens + 2


def test_a_function_call_outputs_image_is_shown_to_the_model(gemma, client, server) -> None:
    """The Responses API's function_call_output may hold input_image parts (a screenshot a tool took): its text is
    the tool message, its images one user message after the tool messages, so the reply is the chat's for those
    messages; a bad image there is named by its own field."""
    a = image_models.png(4, (50, 60))
    call = {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"}
    output = [{"type": "input_text", "text": "the screen:"}, {"type": "input_image", "image_url": _url(a)}]
    items = [
        {"role": "user", "content": "what is on the screen?"},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]
    response = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    chat = [
        {"role": "user", "content": "what is on the screen?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "the screen:"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(a)}}]},
    ]
    reply = client.chat.completions.create(model="tiny", messages=chat, max_tokens=6, temperature=0)
    assert response.output_text == reply.choices[0].message.content
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    text_only = client.responses.create(
        model="tiny",
        input=[*items[:2], {**items[2], "output": "the screen:"}],
        max_output_tokens=1,
        temperature=0,
    )
    assert response.usage.input_tokens > text_only.usage.input_tokens + 2  # the image's tokens

    bad = [
        *items[:2],
        {**items[2], "output": [output[0], {"type": "input_image", "image_url": "data:image/png;base64,%%"}]},
    ]
    r = requests.post(f"{server}/v1/responses", json={"model": "tiny", "input": bad}, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.2.output.1.image_url", r.text
