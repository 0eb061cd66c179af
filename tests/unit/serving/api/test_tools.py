"""Tool calling's parts (`pylon.serving.api.tools`): what a request may declare, how replies in the Hermes, Llama 3,
Mistral, Qwen3-Coder, GLM-4.5, DeepSeek, Kimi K2 and Llama 4 formats become OpenAI `tool_calls` (and malformed ones stay text), how a stream holds back only what may be a call,
and the grammar that constrains `required` and named choices, run by llguidance against the byte tokenizer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.api import tools
from pylon.serving.engine.guided import Guides
from pylon.serving.errors import InvalidRequest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]


def plan(choice="auto", parallel=None) -> tools.ToolPlan:
    if choice not in ("auto", "required", "none"):  # a named function
        choice = {"type": "function", "function": {"name": choice}}
    return tools.plan_of(TOOLS, choice, parallel)


@pytest.mark.parametrize(
    "declared, choice, param, words",
    [
        ([{"type": "retrieval"}], None, "tools.0", '"type": "function"'),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0.function.name", "letters, digits"),
        ([TOOLS[1], TOOLS[1]], None, "tools.1.function.name", "declared twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            None,
            "tools.0.function.parameters.type",
            "not a valid JSON Schema",
        ),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name", "not one of"),
        (TOOLS, "sometimes", "tool_choice", '"required"'),
        (None, "required", "tool_choice", "needs tools"),
    ],
)
def test_bad_declarations_name_the_field(declared, choice, param, words) -> None:
    with pytest.raises(InvalidRequest) as e:
        tools.plan_of(declared, choice, None)
    assert e.value.param == param and words in str(e.value), (e.value.param, str(e.value))


def test_none_and_no_tools_mean_no_plan() -> None:
    assert tools.plan_of(TOOLS, "none", None) is None
    assert tools.plan_of(None, None, None) is None
    assert tools.plan_of([], "auto", None) is None


def test_hermes_blocks_become_calls_and_text_around_them_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    )
    text += '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = tools.parse(text, plan())
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_llama3_json_becomes_a_call() -> None:
    content, calls = tools.parse('<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}', plan())
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 4, "b": 5}
    content, calls = tools.parse('[{"name": "add", "parameters": {"a": 1, "b": 1}}]', plan())
    assert len(calls) == 1


def test_mistral_calls_become_calls_with_ids_its_templates_take_back() -> None:
    # Mistral 7B v0.3, Nemo: a JSON list after [TOOL_CALLS], any text before it the content.
    content, calls = tools.parse(
        'Checking. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 4, "b": 5}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]',
        plan(),
    )
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 4, "b": 5}),
        ("get_weather", {"city": "Oslo", "unit": "c"}),
    ]
    # Mistral's templates refuse any id but 9 letters and digits.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]
    # Tokenizers v11+ (Mistral Small 3.1+): name[ARGS]{...}, one [TOOL_CALLS] per call.
    content, calls = tools.parse('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}', plan())
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": 1, "b": 2},
        {"a": 3, "b": 4},
    ]
    text = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}'
    assert tools.parse(text, plan(parallel=False)) == (text, [])

    stream = tools.ToolStream(plan())
    sent = [stream.feed(piece) for piece in ["Sure. ", "[TOOL", "_CALLS]", 'add[ARGS]{"a": 1, "b": 2}']]
    assert "".join(sent) == "Sure. "
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "add"


# Each model family's own format (the model's text as its tokenizer decodes it), the content before the calls, and
# the calls (name, arguments) it holds: what vLLM's parser of that name reads.
FORMATS = {
    "qwen3_coder": (
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
        "<parameter=a>\n4\n</parameter>\n<parameter=b>\n-5\n</parameter>\n</function>\n</tool_call>",
        "Let me look.",
        [("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 4, "b": -5})],
    ),
    "glm45": (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n<arg_key>unit</arg_key>\n"
        "<arg_value>f</arg_value>\n</tool_call><tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        None,
        [("get_weather", {"city": "New York", "unit": "f"}), ("add", {"a": 1, "b": 2})],
    ),
    "deepseek_v3": (
        "Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "unit": "c"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
        '```json\n{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking both.",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 3})],
    ),
    "deepseek_v31": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 7, "b": 8}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [("add", {"a": 7, "b": 8})],
    ),
    "kimi_k2": (
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
        '{"a": 1, "b": 1}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
        '{"city": "Rome", "unit": "c"}<|tool_call_end|><|tool_calls_section_end|>',
        "Sure.",
        [("add", {"a": 1, "b": 1}), ("get_weather", {"city": "Rome", "unit": "c"})],
    ),
    "llama4_pythonic": (
        '[get_weather(city="Lima", unit="c"), add(a=1, b=-2)]',
        None,
        [("get_weather", {"city": "Lima", "unit": "c"}), ("add", {"a": 1, "b": -2})],
    ),
    "llama4_pythonic_tagged": ("<|python_start|>[add(a=3, b=4)]<|python_end|>", None, [("add", {"a": 3, "b": 4})]),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_families_own_format_becomes_calls_whole_and_streamed(name) -> None:
    text, content, expected = FORMATS[name]
    found, calls = tools.parse(text, plan())
    assert found == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    for c in calls:
        jsonschema.validate(
            json.loads(c["function"]["arguments"]), WEATHER if c["function"]["name"] == "get_weather" else ADD
        )
    if name == "kimi_k2":  # its template takes back the ids it wrote
        assert [c["id"] for c in calls] == ["functions.add:0", "functions.get_weather:1"]
    # streamed in small pieces: the content goes out, the calls come whole at the end
    stream = tools.ToolStream(plan())
    sent = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert (sent + rest).strip() == (content or "") and len(streamed) == len(expected)
    # one call too many without parallel calls: all text
    if len(expected) > 1:
        assert tools.parse(text, plan(parallel=False)) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>",  # GLM's, not declared
        "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value> and more</tool_call>",  # GLM's, stray text
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # Qwen3-Coder's, unclosed
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1',  # DeepSeek's, cut
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜>",  # DeepSeek's, not declared
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{]<|tool_call_end|>",
        "[add(a=1, b=open('x'))]",  # pythonic, an argument that is no literal
        "[print(1), add(a=1, b=2)]",  # pythonic, a function not declared
        "[1, 2, 3]",  # a list that is no call
        "[add(1, 2)]",  # positional arguments: no names to give them
    ],
)
def test_malformed_calls_of_the_families_formats_come_back_as_text(text) -> None:
    assert tools.parse(text, plan()) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]add[ARGS]{"a": 1',  # Mistral's, cut
        '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]',  # Mistral's, not declared
        "[TOOL_CALLS]add",  # Mistral's, no arguments
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # cut JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not declared
        '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name"',  # an unclosed block
        '{"answer": 42}',  # JSON that is no call
        "plain words",
    ],
)
def test_malformed_calls_come_back_as_text(text) -> None:
    assert tools.parse(text, plan()) == (text, [])


def test_without_parallel_calls_two_calls_are_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' * 2
    assert tools.parse(text, plan(parallel=False)) == (text, [])


def test_a_stream_holds_back_only_what_may_be_a_call() -> None:
    stream = tools.ToolStream(plan())
    sent = [stream.feed(piece) for piece in ["Sure", ", one moment <", "tool_", "call>", '{"name": "add", ']]
    assert "".join(sent) == "Sure, one moment "
    stream.feed('"arguments": {"a": 1, "b": 2}}</tool_call>')
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "add"

    stream = tools.ToolStream(plan())
    assert stream.feed("a <b> tag") == "a <b> tag"  # a "<" that is no call streams on
    assert stream.finish() == ("", [])

    stream = tools.ToolStream(plan())
    assert stream.feed('{"answer": ') == ""  # may be a Llama call: held
    assert stream.feed("42}") == ""
    assert stream.finish() == ('{"answer": 42}', [])  # it was not: all of it is content


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("add", True)])
def test_the_constraining_grammar_only_lets_declared_calls_out(choice, parallel) -> None:
    """Random logits through the grammar's masks: every reply parses into calls of the allowed functions whose
    arguments validate against their schemas."""
    import torch

    the_plan = plan(choice, parallel)
    guides = Guides(ByteTokenizer(), 320)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        matcher = guides.matcher(the_plan.guide())
        out = []
        while not matcher.is_stopped() and len(out) < 3000:
            logits = guides.apply(torch.randn(1, 320, generator=generator), [0], [matcher], 256)
            token = int(torch.multinomial(logits[0].softmax(-1), 1, generator=generator))
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
        text = bytes(t for t in out if t < 256).decode()
        content, calls = tools.parse(text, the_plan)
        assert calls and content is None, text
        assert parallel or len(calls) == 1
        for call in calls:
            name = call["function"]["name"]
            assert name in (("get_weather", "add") if choice == "required" else (choice,))
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER if name == "get_weather" else ADD)
    assert guides.compiled_total == 1


def test_template_messages_give_templates_arguments_as_objects() -> None:
    messages = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    fixed = tools.template_messages(messages)
    assert fixed[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request's own is untouched


TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_reach_the_model_through_its_template_or_a_preamble(tmp_path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pylon.serving.engine.tokenization import apply_chat_template, load_model_tokenizer

    the_plan = plan()
    messages = tools.template_messages(
        [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello"], trainers.BpeTrainer(vocab_size=270, special_tokens=["</s>"]))
    for name, template in (
        ("aware", TOOL_TEMPLATE),
        ("unaware", "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"),
    ):
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", chat_template=template).save_pretrained(
            tmp_path / name
        )
    aware = apply_chat_template(
        load_model_tokenizer(str(tmp_path / "aware")), messages, tools=the_plan.tools, tool_preamble=the_plan.preamble()
    )
    assert (
        aware.startswith("<|tools|>get_weather;add;<|user|>")
        and '[add {"a": 2}]' in aware
        and "<tool_call>" not in aware
    )
    unaware = apply_chat_template(
        load_model_tokenizer(str(tmp_path / "unaware")),
        messages,
        tools=the_plan.tools,
        tool_preamble=the_plan.preamble(),
    )
    assert unaware.startswith("<|system|>You may call one or more functions") and '"name": "get_weather"' in unaware
    plain = apply_chat_template(ByteTokenizer(), messages, tools=the_plan.tools, tool_preamble=the_plan.preamble())
    assert (
        plain.startswith("system: You may call")
        and '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in plain
    )
    assert plain.endswith("tool: 5\nassistant: ")
