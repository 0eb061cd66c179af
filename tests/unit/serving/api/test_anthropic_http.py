"""Anthropic's Messages API (serving/api/anthropic.py) through Anthropic's own client against a real server of the
tiny model: each answer is the chat path's for the chat it means (text, usage, cached tokens), streamed and not;
stop sequences end it as Anthropic's do; a forced tool call is a tool_use block whose input follows the schema, and
its result goes back; count_tokens is /tokenize's count; refusals are Anthropic's error objects naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests
from test_serving_http import ADD, KEY, auth, model_dir, server  # noqa: F401 (fixtures)

TOOLS = [{"name": "add", "description": "a + b", "input_schema": ADD}]
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}  # (to a model that takes no images)
PDF = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}
TEXT = {"type": "text", "text": "see "}
TEXT_DOCUMENT = {
    "type": "document",
    "source": {"type": "text", "media_type": "text/plain", "data": "The tide is high."},
}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}
# Anthropic's newer clients have no sampling parameters: vLLM's extension, in the body.
GREEDY = {"temperature": 0}
SEEDED = {"seed": 7}  # sampled, the same text each time (the greedy reply of the random model is mostly spaces)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def _chat(server, messages: list, **fields) -> dict:  # noqa: F811
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        json={"model": "tiny", "messages": messages, "temperature": 0, **fields},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_it_means_streamed_and_not(client, server):  # noqa: F811
    system = "You answer briefly."
    turns = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "hi there"}]},
        {"role": "user", "content": [{"type": "text", "text": "count "}, {"type": "text", "text": "to three"}]},
    ]
    reply = client.messages.create(model="tiny", max_tokens=12, system=system, messages=turns, extra_body=GREEDY)
    chat = _chat(
        server,
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "count to three"},
        ],
        max_tokens=12,
    )
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == chat["choices"][0]["message"][
        "content"
    ]
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    usage = chat["usage"]
    assert reply.usage.output_tokens == usage["completion_tokens"] == 12
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == usage["prompt_tokens"]

    with client.messages.stream(
        model="tiny", max_tokens=12, system=system, messages=turns, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # the same prompt a third time: read from the prefix cache, counted as Anthropic counts cache reads
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == usage["prompt_tokens"]

    counted = client.messages.count_tokens(model="tiny", system=system, messages=turns)
    assert counted.input_tokens == usage["prompt_tokens"]


def test_a_stop_sequence_ends_the_message_and_is_named(client, server):  # noqa: F811
    turns = [{"role": "user", "content": "say something"}]
    free = client.messages.create(model="tiny", max_tokens=24, messages=turns, extra_body=SEEDED).content[0].text
    stop = free[8:10]  # two characters from the middle of what the model says
    assert len(free) > 12 and free.index(stop) > 0, free
    reply = client.messages.create(
        model="tiny", max_tokens=24, messages=turns, extra_body=SEEDED, stop_sequences=[stop]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == free[: free.index(stop)]  # up to it, without it
    with client.messages.stream(
        model="tiny", max_tokens=24, messages=turns, extra_body=SEEDED, stop_sequences=["zzzz-never", stop]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == free[: free.index(stop)] and stop not in "".join(pieces)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_forced_tool_call_is_a_tool_use_block_and_its_result_goes_back(client):
    turns: list = [{"role": "user", "content": "what is 2 + 3?"}]
    forced = {
        "model": "tiny",
        "max_tokens": 200,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "extra_body": GREEDY,
    }
    reply = client.messages.create(messages=turns, **forced)
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "add" and reply.stop_reason == "tool_use", reply
    jsonschema.validate(calls[0].input, ADD)
    with client.messages.stream(messages=turns, **forced) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "input_json" for e in events)  # the SDK's event for input_json_delta
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [b.input for b in streamed] == [calls[0].input] and final.stop_reason == "tool_use"

    a, b = calls[0].input["a"], calls[0].input["b"]
    turns += [
        {"role": "assistant", "content": [c.model_dump() for c in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": str(a + b)}]},
    ]
    answer = client.messages.create(
        model="tiny", max_tokens=6, messages=turns, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY
    )
    assert [x.type for x in answer.content] == ["text"] and answer.stop_reason == "max_tokens"


def test_output_config_holds_the_reply_to_a_schema(client):
    reply = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "two numbers"}],
        output_config={"format": {"type": "json_schema", "schema": ADD}},
    )
    assert reply.stop_reason == "end_turn", reply
    jsonschema.validate(json.loads(reply.content[0].text), ADD)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "add"}]}, "tools.0.input_schema"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": PDF}]}]},
            "messages.0.content.0.source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{**TEXT_DOCUMENT, "citations": {"enabled": True}}]}]},
            "messages.0.content.0.citations",
        ),
        (  # a block a tool result cannot hold, named inside it
            {"messages": [{"role": "user", "content": [{**RESULT, "content": [{"type": "tool_use"}]}]}]},
            "messages.0.content.0.content.0.type",
        ),
        (  # an image in a tool result, to a model that takes none: named as the block inside the result
            {
                "messages": [
                    {"role": "user", "content": [{**RESULT, "content": [TEXT, {"type": "image", "source": PNG}]}]}
                ]
            },
            "messages.0.content.0.content.1.source",
        ),
        (  # the image after a tool result and a text block is block 2 (the chat's part 1)
            {"messages": [{"role": "user", "content": [RESULT, TEXT, {"type": "image", "source": PNG}]}]},
            "messages.0.content.2.source",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
        (  # named once, as this request's (the system prompt is the chat's message 0)
            {"system": "be brief", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
        ),
        (  # the chat's refusal of the chat's message 1, named as this request's message 0
            {"system": "be brief", "messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]},
            "messages.0.content.0.source",
        ),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
        ({"stop_sequences": [""]}, "stop_sequences.0"),
        ({"top_k": 0}, "top_k"),
        ({"unknown_field": 1}, "unknown_field"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}},
            "output_config.format.schema.type",
        ),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"container": "c-1"}, "container"),
    ],
)
def test_refusals_are_anthropics_error_objects_naming_the_field(server, fields, param):  # noqa: F811
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = requests.post(f"{server}/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["param"] == param and error["error"]["message"], error


def test_a_key_comes_as_anthropics_clients_send_it(server):  # noqa: F811
    anthropic = pytest.importorskip("anthropic")
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers, status in (({"x-api-key": KEY}, 200), ({"x-api-key": "sk-wrong"}, 401), ({}, 401), (auth(), 200)):
        r = requests.post(f"{server}/v1/messages", headers=headers, json=body, timeout=60)
        assert r.status_code == status, (headers, r.text)
    wrong = anthropic.Anthropic(base_url=server, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    r = requests.post(f"{server}/v1/messages", headers={"x-api-key": KEY}, json={**body, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "max_tokens"


def test_documents_search_results_and_a_tool_results_images_become_the_chats_messages():
    from pylon.serving.api.anthropic import MessagesRequest

    image = {"type": "image", "source": PNG}
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {**RESULT, "content": [{"type": "text", "text": "5, "}, image, {"type": "text", "text": "shown"}]},
                    {**TEXT_DOCUMENT, "title": "Song", "context": "lyrics"},
                    {
                        "type": "search_result",
                        "source": "https://example.com/tides",
                        "title": "Tides",
                        "content": [{"type": "text", "text": "Twice a day."}],
                    },
                    {
                        "type": "document",
                        "source": {"type": "content", "content": [TEXT, image]},
                        "title": "Figure",
                    },
                    {"type": "text", "text": "what now?"},
                ],
            },
        ],
    }
    chat = MessagesRequest(**body).chat()
    tool, user = chat.messages[2], chat.messages[3]
    assert tool.role == "tool" and tool.content == "5, shown" and tool.tool_call_id == "toolu_1"
    kinds, texts = [p["type"] for p in user.content], [p.get("text") for p in user.content]
    # the result's image first, then the document's title, context and text, the search result, the content
    # document's title and text and its image, the question
    assert kinds == ["image_url", "text", "text", "text", "image_url", "text"], kinds
    assert texts[1] == "Song\n\nlyrics\n\nThe tide is high.\n\n"  # (text after it starts a paragraph)
    assert texts[2] == "Tides (https://example.com/tides)\n\nTwice a day.\n\n"
    assert texts[3] == "Figure\n\nsee " and texts[5] == "what now?"
