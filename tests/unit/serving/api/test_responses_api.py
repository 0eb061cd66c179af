"""OpenAI's Responses API (`POST /v1/responses`, pylon.serving.api.responses) through the official `openai` client
(`client.responses.create`) against the same uvicorn server as test_serving_http.py: a response is the chat reply to
the same conversation in the Responses shape, streamed as the typed events the client reads, with structured outputs,
a tool-calling loop (function_call items out, function_call_output items back in), log-probabilities, and bad input
answered 400 naming the Responses field."""

from __future__ import annotations

import json

import pytest
import requests
from test_serving_http import ADD, INVOICE, KEY, auth, model_dir, server  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_reply(server, messages: list, **fields) -> dict:  # noqa: F811
    body = {"model": "tiny", "messages": messages, "temperature": 0, **fields}
    r = requests.post(f"{server}/v1/chat/completions", headers=auth(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_response_is_the_chat_reply_to_the_same_conversation(server, client):  # noqa: F811
    """`instructions` + `input` are the system and user messages; greedy, the text is the chat reply's token for
    token, and the usage its counts; a budget that runs out is status incomplete (max_output_tokens)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]
    want = chat_reply(server, messages, max_tokens=24)
    reply = client.responses.create(
        model="tiny", instructions="be brief", input="name a colour", max_output_tokens=24, temperature=0
    )
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "tiny"
    assert reply.output_text == want["choices"][0]["message"]["content"]
    message = reply.output[-1]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    usage = want["usage"]
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
    )
    if want["choices"][0]["finish_reason"] == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed" and reply.incomplete_details is None
    # The same conversation as input items (a message item with content parts) gives the same reply.
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "name a colour"}]}]
    again = client.responses.create(
        model="tiny", instructions="be brief", input=items, max_output_tokens=24, temperature=0
    )
    assert again.output_text == reply.output_text and again.usage.input_tokens == reply.usage.input_tokens
    # An earlier assistant turn goes back as the message item the client returned.
    follow = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "name a colour"}, *reply.output, {"role": "user", "content": "another"}],
        max_output_tokens=8,
        temperature=0,
    )
    turns = [
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": reply.output_text},
        {"role": "user", "content": "another"},
    ]
    assert follow.output_text == chat_reply(server, turns, max_tokens=8)["choices"][0]["message"]["content"]


def test_a_streamed_response_is_the_typed_events_the_client_reads(client):
    """response.created and in_progress first, the message item opened, its text in output_text deltas, closed, and
    response.completed (or incomplete) holding what the unstreamed request returns; sequence numbers count up."""
    fields = {"model": "tiny", "input": "tell me a story", "max_output_tokens": 40, "temperature": 0}
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ], kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_structured_outputs_streamed_and_not(client):
    import jsonschema

    text = {"format": {"type": "json_schema", "name": "invoice", "schema": INVOICE, "strict": True}}
    for temperature in (0.0, 1.0):
        reply = client.responses.create(
            model="tiny", input="an invoice please", max_output_tokens=90, temperature=temperature, text=text
        )
        assert reply.status == "completed", reply
        jsonschema.validate(json.loads(reply.output_text), INVOICE)
        events = client.responses.create(
            model="tiny",
            input="an invoice please",
            max_output_tokens=90,
            temperature=temperature,
            text=text,
            stream=True,
        )
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        jsonschema.validate(json.loads(streamed), INVOICE)
    obj = client.responses.create(
        model="tiny", input="any object", max_output_tokens=60, text={"format": {"type": "json_object"}}
    )
    assert obj.output_text.lstrip().startswith("{")


TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": ADD, "strict": True}]


def test_a_tool_calling_loop_through_the_openai_client(client):
    """tool_choice "required": function_call items whose arguments follow the tool's schema; the client appends the
    response's output and a function_call_output per call to its input, and the model answers in text; a named
    tool_choice streams its call as function_call_arguments events."""
    import jsonschema

    conversation: list = [{"role": "user", "content": "what is 2 + 3?"}]
    reply = client.responses.create(  # greedy: sampled, the random model's calls could run past the budget
        model="tiny", input=conversation, tools=TOOLS, tool_choice="required", max_output_tokens=480, temperature=0
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed" and all(c.name == "add" for c in calls), reply.output
    assert len({c.call_id for c in calls}) == len(calls) and all(c.id.startswith("fc_") for c in calls)
    conversation += reply.output  # as the client returned them
    for call in calls:
        args = json.loads(call.arguments)
        jsonschema.validate(args, ADD)
        conversation.append(
            {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])}
        )
    final = client.responses.create(
        model="tiny", input=conversation, tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0
    )
    assert [item.type for item in final.output] == ["message"] and isinstance(final.output_text, str)

    events = list(
        client.responses.create(
            model="tiny",
            input=conversation[:1],
            tools=TOOLS,
            tool_choice={"type": "function", "name": "add"},
            parallel_tool_calls=False,
            max_output_tokens=120,
            stream=True,
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "add", [e.type for e in events]
    jsonschema.validate(json.loads(done[0].arguments), ADD)
    final = events[-1].response
    assert [item.type for item in final.output] == ["function_call"] and final.output[0].arguments == done[0].arguments


def test_log_probabilities_come_with_the_output_text(client):
    reply = client.responses.create(
        model="tiny",
        input="count",
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    entries = reply.output[-1].content[0].logprobs
    assert len(entries) == reply.usage.output_tokens == 6
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries) == reply.output_text
    plain = client.responses.create(model="tiny", input="count", max_output_tokens=6, temperature=0)
    assert plain.output[-1].content[0].logprobs == []


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "http.responses_store is null"),
        ({"previous_response_id": "../../etc/passwd"}, "previous_response_id", "not a response id"),
        ({"background": True}, "background", "http.responses_store is null"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"instructionz": "x"}, "instructionz", "unknown field"),
        ({"input": []}, "input", "at least one item"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role", "user, system, developer or assistant"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input.0.content.0.image_url",
            "takes no images",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.id", "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "no built-in tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, "tools.0.parameters", ""),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "2"}}
                }
            },
            "text.format.schema",
            "",
        ),
        ({"include": ["file_search_call.results"]}, "include.0", "not available"),
        ({"max_output_tokens": 100000}, "max_output_tokens", ""),
    ],
)
def test_bad_input_is_a_400_naming_the_responses_field(server, fields, param, words):  # noqa: F811
    body = {"model": "tiny", "input": "hi", **fields}
    r = requests.post(f"{server}/v1/responses", headers=auth(), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert words in error["message"], error
    assert "messages" not in error["message"] and "response_format" not in error["message"], error


def test_an_unknown_model_is_a_404_and_a_missing_key_a_401(server):  # noqa: F811
    r = requests.post(f"{server}/v1/responses", headers=auth(), json={"model": "gpt-9", "input": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = requests.post(f"{server}/v1/responses", json={"model": "tiny", "input": "hi"}, timeout=30)
    assert r.status_code == 401 and KEY not in r.text


def test_truncation_auto_drops_the_earliest_turns_until_the_conversation_fits(server, client):  # noqa: F811
    """truncation "auto": a conversation past the context loses its earliest turns (a user message and what follows
    it), never the instructions or the last turn, as few as make it fit: the reply is the chat reply to what is
    left; "disabled" (the default) is the 400 it was."""
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " + "x" * 200}, {"role": "assistant", "content": "ok"}]
    turns.append({"role": "user", "content": "and the last one?"})
    out = 16
    body = {"model": "tiny", "instructions": "be brief", "input": turns, "max_output_tokens": out, "temperature": 0}
    r = requests.post(f"{server}/v1/responses", headers=auth(), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("input", "max_output_tokens"), r.text

    def counted(k: int) -> int:
        messages = [{"role": "system", "content": "be brief"}, *turns[2 * k :]]
        r = requests.post(f"{server}/tokenize", headers=auth(), json={"model": "tiny", "messages": messages})
        return r.json()["count"]

    k = next(k for k in range(1, 7) if counted(k) + out <= 1024)
    assert k >= 2  # the test drops more than one turn
    reply = client.responses.create(**body, truncation="auto")
    want = chat_reply(server, [{"role": "system", "content": "be brief"}, *turns[2 * k :]], max_tokens=out)
    assert reply.output_text == want["choices"][0]["message"]["content"] and reply.truncation == "auto"
    assert reply.usage.input_tokens == counted(k) == want["usage"]["prompt_tokens"]
    long_last = [{"role": "user", "content": "y" * 1100}]  # the last turn alone is past it: nothing to drop
    r = requests.post(
        f"{server}/v1/responses", headers=auth(), json={**body, "input": long_last, "truncation": "auto"}, timeout=60
    )
    assert r.status_code == 400, r.text


def test_a_stateless_agents_request_is_served_as_codex_sends_it(server):  # noqa: F811
    """What Codex CLI and the Agents SDK send with store: false (its fields as Codex's Responses request has them):
    include reasoning.encrypted_content, prompt_cache_key, reasoning with a summary, text.verbosity, a function tool,
    streamed; answered, the same text as without those fields. service_tier and safety_identifier on chat too."""
    tool = {"type": "function", "name": "shell", "description": "run", "strict": False,
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}  # fmt: skip
    plain = {"model": "tiny", "instructions": "be brief", "input": [{"role": "user", "content": "hi"}],
             "max_output_tokens": 6, "temperature": 0, "tools": [tool], "tool_choice": "auto"}  # fmt: skip
    codex = {**plain, "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
             "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-conversation",
             "text": {"verbosity": "medium"}, "service_tier": "priority", "safety_identifier": "u-1"}  # fmt: skip
    want = requests.post(f"{server}/v1/responses", headers=auth(), json=plain, timeout=60)
    got = requests.post(f"{server}/v1/responses", headers=auth(), json=codex, timeout=60)
    assert want.status_code == got.status_code == 200, got.text
    text = lambda r: "".join(p["text"] for i in r["output"] if i["type"] == "message" for p in i["content"])  # noqa: E731
    assert text(got.json()) == text(want.json())
    streamed = requests.post(f"{server}/v1/responses", headers=auth(), json={**codex, "stream": True}, timeout=60)
    ended = ("event: response.completed" in streamed.text) or ("event: response.incomplete" in streamed.text)
    assert streamed.status_code == 200 and ended, streamed.text[-300:]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    extra = {"service_tier": "flex", "safety_identifier": "u-1", "prompt_cache_key": "k"}
    assert (
        chat_reply(server, chat["messages"], max_tokens=4, **extra)["choices"][0]["message"]["content"]
        == (chat_reply(server, chat["messages"], max_tokens=4)["choices"][0]["message"]["content"])
    )
