"""A GPT-OSS model's harmony replies over HTTP, through the official `openai` client against a real uvicorn server
whose engine runs in its own process: the analysis channel comes back as `reasoning_content` (and counts as
reasoning tokens), the final channel as `content`, a message to `functions.NAME` as a tool call of a declared
function (else as text), streamed and not, in chat completions and the Responses API. The model is a tiny GPT-OSS
checkpoint built to write given harmony replies (tests/harmony_models.py: its greedy reply is the one the request's
logit_bias picks), so what is checked is how the server reads them: without it, the content would be the raw
`<|channel|>final<|message|>...`."""

from __future__ import annotations

import json

import pytest
from harmony_models import HarmonyModel, harmony_ids
from test_serving_http import KEY, serving  # noqa: F401 (fixtures)

FINAL = "<|channel|>final<|message|>The answer is 4.<|return|>"
THINKING = "<|channel|>analysis<|message|>Thinking about the question..."  # cut short by max_tokens 5
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
FINAL_JSON = '<|channel|>final<|message|>{"answer":4}<|return|>'  # a structured answer
WORDS = [
    "final",
    "analysis",
    "commentary",
    " to=functions.get_weather ",
    "json",
    "The answer is 4.",
    "Thinking",
    " about the question...",
    '{"city": "Paris"}',
    '{"answer":',  # (llguidance's masks leave out a token that spans a key and its value: "answer":4)
    "4}",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> HarmonyModel:
    model = HarmonyModel(tmp_path_factory.mktemp("gpt-oss"), [FINAL, THINKING, CALL, FINAL_JSON], WORDS, vocab=328)
    prompt = harmony_ids(
        model.tokenizer, model.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    )
    for reply in (FINAL, CALL, FINAL_JSON):  # transformers' greedy reply is the one the bias picks: the fixture holds
        assert model.greedy(prompt, reply, 20) == model.replies[reply]
    assert model.greedy(prompt, THINKING, 5) == model.replies[THINKING]
    return model


@pytest.fixture(scope="module")
def client(model):
    from openai import OpenAI

    with serving(
        str(model.directory), max_num_seqs=4, max_num_batched_tokens=64, kv_cache_tokens=2048, max_model_len=512
    ) as (url, _):
        yield OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, model, reply: str, *, stream: bool = False, max_tokens: int = 20, **fields):
    return client.chat.completions.create(
        model="tiny",
        messages=fields.pop("messages", QUESTION),
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=model.bias(reply),
        stream=stream,
        **fields,
    )


def _streamed(chunks) -> dict:
    """A streamed chat reply put together: reasoning, content, tool calls (by index), finish reason, usage."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None}
    for chunk in chunks:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_the_final_channel_is_the_content(client, model) -> None:
    reply = _chat(client, model, FINAL)
    message = reply.choices[0].message
    assert message.content == "The answer is 4." and reply.choices[0].finish_reason == "stop"
    assert message.model_extra.get("reasoning_content") is None and not message.tool_calls
    assert reply.usage.completion_tokens == 5  # the reply's tokens, its <|return|> included
    streamed = _streamed(_chat(client, model, FINAL, stream=True, stream_options={"include_usage": True}))
    assert (streamed["content"], streamed["reasoning"], streamed["calls"]) == ("The answer is 4.", "", {})
    assert streamed["finish"] == "stop" and streamed["usage"].completion_tokens == 5


def test_the_analysis_channel_is_the_reasoning_and_counts_as_reasoning_tokens(client, model) -> None:
    reply = _chat(client, model, THINKING, max_tokens=5)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "Thinking about the question..."
    assert message.content == "" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # header, <|message|> and the text
    streamed = _streamed(_chat(client, model, THINKING, max_tokens=5, stream=True))
    assert (streamed["reasoning"], streamed["content"]) == ("Thinking about the question...", "")


def test_a_call_of_a_declared_function_is_a_tool_call_and_the_loop_goes_on(client, model) -> None:
    reply = _chat(client, model, CALL, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    streamed = _streamed(_chat(client, model, CALL, tools=TOOLS, stream=True))
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    # The call and its result fed back through the chat template; the model answers.
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = _chat(client, model, FINAL, tools=TOOLS, messages=messages)
    assert answer.choices[0].message.content == "The answer is 4." and answer.usage.prompt_tokens > 40


def test_a_required_or_named_tool_choice_takes_the_models_own_harmony_call(client, model) -> None:
    """A constraining tool_choice holds the reply to harmony's calls of the allowed functions
    (pylon.serving.api.reply_guide), which the model's own call passes: its arguments come back as it wrote them.
    (Held to Hermes blocks from its first token, the model was made to spell out `<tool_call>` and write arguments it
    never chose.) Its reasoning comes first as it does unconstrained."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        reply = _chat(client, model, CALL, tools=TOOLS, tool_choice=choice)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert reply.usage.completion_tokens == len(model.replies[CALL])
        streamed = _streamed(_chat(client, model, CALL, tools=TOOLS, tool_choice=choice, stream=True))
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert streamed["finish"] == "tool_calls"
    thinking = _chat(client, model, THINKING, tools=TOOLS, tool_choice="required", max_tokens=5)
    message = thinking.choices[0].message
    assert message.model_extra["reasoning_content"] == "Thinking about the question..." and not message.tool_calls
    assert thinking.choices[0].finish_reason == "length"


def test_a_structured_answer_comes_on_the_final_channel_after_the_reasoning(client, model) -> None:
    """response_format holds the final channel's message to the schema; the model's own JSON answer passes, and its
    analysis comes first as reasoning. A reply the schema does not allow is made JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = _chat(client, model, FINAL_JSON, response_format=fmt)
    assert reply.choices[0].message.content == '{"answer":4}' and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(model.replies[FINAL_JSON])
    streamed = _streamed(_chat(client, model, FINAL_JSON, response_format=fmt, stream=True))
    assert (streamed["content"], streamed["reasoning"], streamed["finish"]) == ('{"answer":4}', "", "stop")
    thinking = _chat(client, model, THINKING, response_format=fmt, max_tokens=5)
    assert thinking.choices[0].message.model_extra["reasoning_content"] == "Thinking about the question..."
    prose = _chat(client, model, FINAL, response_format={"type": "json_object"}, max_tokens=20)
    assert prose.choices[0].message.content.startswith("{")  # not "The answer is 4."


def test_a_call_of_no_declared_function_is_text(client, model) -> None:
    reply = _chat(client, model, CALL)  # no tools in the request
    message = reply.choices[0].message
    assert message.content == '{"city": "Paris"}' and not message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_the_responses_api_reads_the_channels_too(client, model) -> None:
    # Without a bias the replies' first tokens tie, and the lowest id, the final channel's, wins (as it does in
    # transformers' argmax): the model answers.
    response = client.responses.create(model="tiny", input="What is 2+2?", max_output_tokens=20, temperature=0)
    assert response.output_text == "The answer is 4."
    assert [item.type for item in response.output] == ["message"]


def test_reasoning_effort_reaches_the_chat_template(client, model) -> None:
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) are the template's `reasoning_effort`
    (gpt-oss's system message says it); a value OpenAI does not have is a 400 naming the field."""
    import openai

    def rendered(effort: str) -> int:
        text = model.tokenizer.apply_chat_template(
            QUESTION, tokenize=False, add_generation_prompt=True, reasoning_effort=effort
        )
        assert f"Reasoning: {effort}\n" in text
        return len(harmony_ids(model.tokenizer, text))

    assert rendered("high") != rendered("minimal")
    for effort in ("high", "minimal"):
        reply = _chat(client, model, FINAL, reasoning_effort=effort)
        assert reply.usage.prompt_tokens == rendered(effort)
        response = client.responses.create(
            model="tiny", input=QUESTION, max_output_tokens=20, temperature=0, reasoning={"effort": effort}
        )
        assert response.usage.input_tokens == rendered(effort)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model, FINAL, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(
            client,
            model,
            FINAL,
            reasoning_effort="low",
            extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}},
        )
    assert e.value.body["param"] == "chat_template_kwargs.reasoning_effort"


def test_the_official_clients_loop_sends_the_reply_back_as_it_came(client, model) -> None:
    """The client appends the reply's message object as it is, `reasoning_content` included; it goes back through the
    template (a reasoning model's template may read it: Qwen3's `reasoning_content`, gpt-oss's `thinking`)."""
    reply = _chat(client, model, THINKING, max_tokens=5)
    assert reply.choices[0].message.model_extra["reasoning_content"]
    messages = [*QUESTION, reply.choices[0].message, {"role": "user", "content": "And 3+3?"}]
    answer = _chat(client, model, FINAL, messages=messages)
    assert answer.choices[0].message.content == "The answer is 4."
    call = _chat(client, model, CALL, tools=TOOLS).choices[0].message
    messages = [*QUESTION, call, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "21 C"}]
    assert _chat(client, model, FINAL, tools=TOOLS, messages=messages).choices[0].message.content == "The answer is 4."
    # A tool-calling turn's reasoning, sent back, is in the prompt (this template writes it on the analysis channel).
    turn = {"role": "assistant", "content": None, "tool_calls": [call.tool_calls[0].model_dump()]}
    result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "21 C"}
    tokens = {}
    for key in (None, "reasoning_content", "reasoning"):
        sent = {**turn, key: "Thinking about the question..."} if key else turn
        usage = _chat(client, model, FINAL, tools=TOOLS, messages=[*QUESTION, sent, result]).usage
        tokens[key] = usage.prompt_tokens
    assert tokens["reasoning_content"] == tokens["reasoning"] > tokens[None]


def test_a_completion_writes_the_special_tokens_only_where_asked(client, model) -> None:
    """vLLM's skip_special_tokens on a model that writes special tokens (harmony's markers): by default they write no
    text, as `decode(..., skip_special_tokens=True)`; false: every token's text; the reply's token ids the same."""
    prompt = model.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = model.replies[FINAL]
    texts = {}

    def complete(skip: bool, stream: bool = False):
        extra = {"skip_special_tokens": skip, "return_token_ids": True, "add_special_tokens": False}
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, logit_bias=model.bias(FINAL), stream=stream,
            extra_body=extra,
        )  # fmt: skip

    for skip in (True, False):
        choice = complete(skip).choices[0]
        assert choice.model_extra["token_ids"] == ids  # its <|return|> included
        assert choice.model_extra["prompt_token_ids"] == harmony_ids(model.tokenizer, prompt)
        texts[skip] = choice.text
        assert "".join(c.choices[0].text for c in complete(skip, stream=True)) == choice.text
    assert texts[True] == model.tokenizer.decode(ids[:-1], skip_special_tokens=True) == "finalThe answer is 4."
    assert texts[False] == model.tokenizer.decode(ids[:-1]) == "<|channel|>final<|message|>The answer is 4."


def test_a_thinking_budget_ends_the_analysis_and_the_reply_goes_on_to_the_final_channel(client, model) -> None:
    """vLLM's thinking_token_budget on a harmony model: after that many tokens of its analysis message, the tokens
    that end it and open the final channel are forced, and what the model writes next is the content."""
    end = harmony_ids(model.tokenizer, "<|end|><|start|>assistant<|channel|>final<|message|>")
    reply = _chat(
        client, model, THINKING, max_tokens=20, extra_body={"thinking_token_budget": 1, "return_token_ids": True}
    )
    choice = reply.choices[0]
    ids = choice.model_extra["token_ids"]
    assert ids[:4] == model.replies[THINKING][:4] and ids[4 : 4 + len(end)] == end
    assert choice.message.model_extra["reasoning_content"] == "Thinking"
    assert choice.message.content and choice.message.content.startswith("Thinking")  # the model's own, on final
    free = _chat(client, model, THINKING, max_tokens=5, extra_body={"thinking_token_budget": 5})
    assert free.choices[0].message.model_extra["reasoning_content"] == "Thinking about the question..."
