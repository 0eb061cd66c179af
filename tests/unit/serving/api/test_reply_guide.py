"""`pylon.serving.api.reply_guide`: a constrained chat reply's grammar in the model's own format. The replies a
reasoning model, a harmony model and a model with tag tokens write (their tags as the tokens they have) pass the
rewritten grammar token by token, where the request's own grammar refuses them at their first token; and whatever
random logits the masks let through reads back, as the server reads it, as reasoning and a valid answer."""

from __future__ import annotations

import json

import jsonschema
import pytest
from harmony_models import bpe_tokenizer, harmony_ids, harmony_tokenizer

from pylon.serving.api import harmony, reasoning, reply_guide, tools
from pylon.serving.api.harmony import HarmonyTokens
from pylon.serving.api.protocol import ResponseFormat
from pylon.serving.engine.guided import Guides
from pylon.serving.engine.tokenization import load_model_tokenizer

VOCAB = 320
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 10}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}
QWEN_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def _tokenizer(tmp_path, tags: list[str]):
    """A Qwen-like tokenizer (ChatML specials), with `tags` as added tokens as Qwen's has them, loaded as a
    deployment loads its model's."""
    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, eos_token="<|im_end|>")
    tok.add_tokens(tags)
    tok.save_pretrained(tmp_path)
    return load_model_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("qwen"), QWEN_TAGS)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("plain"), [])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harmony")
    harmony_tokenizer(directory)
    return load_model_tokenizer(str(directory))


def _plan(choice: str = "required", parallel: bool = True) -> tools.ToolPlan:
    named = choice if choice in ("required", "auto") else {"type": "function", "function": {"name": choice}}
    return tools.plan_of(TOOLS, named, parallel)


def _json_guide() -> dict:
    return ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    ).guide()


def _walk(tokenizer, guide: dict, ids: list[int]) -> tuple[bool, object]:
    """Whether the grammar takes `ids` one token at a time and may end after them (the matcher, for its error)."""
    matcher = Guides(tokenizer, VOCAB).matcher(guide)
    for token in ids:
        if not matcher.consume_token(token) or matcher.is_error():
            return False, matcher
    return matcher.is_accepting(), matcher


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer._tok.encode(text, add_special_tokens=False))


QWEN_CALL = (
    "<think>\nThe user wants the weather in Paris.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "parser, reply, kind",
    [
        ("qwen3", QWEN_CALL, "calls"),
        ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "calls"),  # no thinking
        ("qwen3", '<think>\nJSON it is.\n</think>\n\n{"answer":4,"why":"2+2"}', "json"),
        ("deepseek_r1", 'The template opened the block.\n</think>\n\n{"answer":4,"why":"2+2"}', "json"),
        ("deepseek_r1", "<think>Again.</think>" + QWEN_CALL[QWEN_CALL.index("\n\n") :], "calls"),
        (None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "calls"),
        (None, '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>', "calls"),  # compact JSON too
    ],
)
def test_a_models_own_reply_passes_the_rewritten_grammar(qwen, parser, reply, kind) -> None:
    """The model's tags are its tokens (`<think>` is one id here, as in Qwen's tokenizer); the reply passes, and the
    request's own grammar (JSON or Hermes from the first token, tags spelled out) refuses it."""
    ids = _ids(qwen, reply)
    assert qwen._tok.convert_tokens_to_ids("<tool_call>") in ids or "<tool_call>" not in reply
    plan = _plan() if kind == "calls" else None
    request_guide = plan.guide() if plan is not None else _json_guide()
    guide = reply_guide.for_reply(request_guide, plan, qwen, parser=parser)
    ok, matcher = _walk(qwen, guide, ids)
    assert ok, matcher.get_error()
    assert not _walk(qwen, request_guide, ids)[0]
    # and the server reads it back: reasoning apart, the answer valid
    text = qwen._tok.decode(ids)
    thought, content = reasoning.split(text, parser) if parser else (None, text)
    if kind == "calls":
        content, calls = tools.parse(content, plan)
        assert calls and content is None, text
    else:
        jsonschema.validate(json.loads(content), ANSWER)
    assert (thought is not None) == ("think" in reply or parser == "deepseek_r1")


def test_a_reasoning_model_may_not_skip_its_answer_or_put_it_inside_the_block(qwen) -> None:
    guide = reply_guide.for_reply(_json_guide(), None, qwen, parser="qwen3")
    assert not _walk(qwen, guide, _ids(qwen, "<think>x</think>\n\nnot json"))[0]
    assert not _walk(qwen, guide, _ids(qwen, "<think>x</think>"))[0]  # the answer must come
    assert not _walk(qwen, guide, _ids(qwen, 'x</think>{"answer":4,"why":""}'))[0]  # qwen3 opens its own block


def test_text_tags_are_held_as_text(plain) -> None:
    """A tokenizer without tag tokens: the tags are text, the block one lazy lexeme ending at the first `</think>`."""
    guide = reply_guide.for_reply(_plan().guide(), _plan(), plain, parser="qwen3")
    assert _walk(plain, guide, _ids(plain, QWEN_CALL))[0]
    guide = reply_guide.for_reply(_json_guide(), None, plain, parser="deepseek_r1")
    assert _walk(plain, guide, _ids(plain, 'a</think>\n{"answer":1,"why":""}'))[0]
    assert not _walk(plain, guide, _ids(plain, 'a</think>b</think>{"answer":1,"why":""}'))[0]
    # without a parser and without tag tokens the request's guide goes to the engine as it is
    assert reply_guide.for_reply(_json_guide(), None, plain) == _json_guide()


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather: call the tool.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
)


@pytest.mark.parametrize(
    "reply, kind",
    [
        (HARMONY_CALL, "calls"),
        ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>', "calls"),
        ('<|channel|>commentary to=functions.add<|message|>{"a":1,"b":2}<|call|>', "calls"),  # no <|constrain|>
        (' to=functions.add<|channel|>commentary <|constrain|>json<|message|>{"a":1,"b":2}<|call|>', "calls"),
        (
            "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Let me check.<|end|><|start|>assistant" + HARMONY_CALL[HARMONY_CALL.index("<|channel|>commentary") :],
            "calls",
        ),
        (
            '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>{"answer":4,"why":"x"}'
            "<|return|>",
            "json",
        ),
        ('<|channel|>final<|message|>{"answer":4,"why":"x"}<|return|>', "json"),
    ],
)
def test_a_harmony_reply_passes_the_rewritten_grammar(gpt_oss, reply, kind) -> None:
    tokens = HarmonyTokens.of(gpt_oss)
    plan = _plan() if kind == "calls" else None
    request_guide = plan.guide() if plan is not None else _json_guide()
    guide = reply_guide.for_reply(request_guide, plan, gpt_oss, harmony=tokens)
    ids = harmony_ids(gpt_oss, reply)
    ok, matcher = _walk(gpt_oss, guide, ids)
    assert ok, matcher.get_error()
    assert not _walk(gpt_oss, request_guide, ids)[0]
    thought, content, calls = harmony.parse(gpt_oss, tokens, ids, list(plan.functions) if plan else None)
    if kind == "calls":
        assert [c["function"]["name"] for c in calls]
        assert content == ("Let me check." if "Let me check." in reply else None)  # a preamble is content
    else:
        jsonschema.validate(json.loads(content), ANSWER)
    assert (thought is not None) == ("analysis" in reply)


def test_harmony_calls_are_of_the_allowed_functions_only(gpt_oss) -> None:
    tokens = HarmonyTokens.of(gpt_oss)
    plan = _plan("add")
    guide = reply_guide.for_reply(plan.guide(), plan, gpt_oss, harmony=tokens)
    weather = HARMONY_CALL[HARMONY_CALL.index("<|channel|>commentary") :]
    assert not _walk(gpt_oss, guide, harmony_ids(gpt_oss, weather))[0]  # a named choice: only `add`
    final = '<|channel|>final<|message|>{"a":1,"b":2}<|return|>'
    assert not _walk(gpt_oss, guide, harmony_ids(gpt_oss, final))[0]  # a call is required
    bad = '<|channel|>commentary to=functions.add<|message|>{"a":"1","b":2}<|call|>'
    assert not _walk(gpt_oss, guide, harmony_ids(gpt_oss, bad))[0]  # arguments held to the schema


def _sample(tokenizer, guide: dict, finish: set[int], seed: int) -> list[int]:
    """Tokens drawn from random logits under the grammar's masks; the tokens in `finish` (those that end the
    model's free text) pushed up once it has written a few, so that a reply gets to its answer."""
    import torch

    guides = Guides(tokenizer, VOCAB)
    matcher = guides.matcher(guide)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not matcher.is_stopped() and len(out) < 800:
        logits = torch.randn(1, VOCAB, generator=generator) * 2
        if len(out) % 12 > 6:
            logits[0, sorted(finish)] += 30
        masked = guides.apply(logits, [0], [matcher], tokenizer.eos_id)
        token = int(torch.multinomial(masked[0].softmax(-1), 1, generator=generator))
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_stopped(), "no end in 800 tokens"
    return out


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("kind", ["calls", "json"])
def test_random_logits_through_a_thinking_grammar_read_back_valid(qwen, parser, kind) -> None:
    plan = _plan(parallel=False) if kind == "calls" else None
    guide = reply_guide.for_reply(plan.guide() if plan else _json_guide(), plan, qwen, parser=parser)
    finish = {qwen._tok.convert_tokens_to_ids("</think>")}
    for seed in range(3):
        ids = _sample(qwen, guide, finish, seed)
        text = qwen._tok.decode([t for t in ids if t != qwen.eos_id])
        thought, content = reasoning.split(text, parser)
        if kind == "calls":
            content, calls = tools.parse(content, plan)
            assert len(calls) == 1 and content is None, text
            name = calls[0]["function"]["name"]
            jsonschema.validate(
                json.loads(calls[0]["function"]["arguments"]), WEATHER if name == "get_weather" else ADD
            )
        else:
            jsonschema.validate(json.loads(content), ANSWER)


@pytest.mark.parametrize("kind", ["calls", "json"])
def test_random_logits_through_a_harmony_grammar_read_back_valid(gpt_oss, kind) -> None:
    tokens = HarmonyTokens.of(gpt_oss)
    plan = _plan() if kind == "calls" else None
    guide = reply_guide.for_reply(plan.guide() if plan else _json_guide(), plan, gpt_oss, harmony=tokens)
    for seed in range(3):
        ids = _sample(gpt_oss, guide, {tokens.end}, seed)
        thought, content, calls = harmony.parse(gpt_oss, tokens, ids, list(plan.functions) if plan else None)
        if kind == "calls":
            assert len(calls) == 1 and content is None, (thought, content)
            name = calls[0]["function"]["name"]
            jsonschema.validate(
                json.loads(calls[0]["function"]["arguments"]), WEATHER if name == "get_weather" else ADD
            )
        else:
            jsonschema.validate(json.loads(content), ANSWER)


DEEPSEEK_TAGS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
]
KIMI_TAGS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
GLM_TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
NATIVE = {  # each family's tags, a chat template's tell-tale, a reply in its own format (and the tag ending a call)
    "deepseek_v3": (
        DEEPSEEK_TAGS,
        "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n' }}",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
        '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    "deepseek_v31": (
        DEEPSEEK_TAGS,
        "{{ '<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments }}",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a":1,"b":2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    "kimi_k2": (
        KIMI_TAGS,
        "{{ '<|tool_call_begin|>' + id + '<|tool_call_argument_begin|>' }}",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    "qwen3_coder": (
        ["<tool_call>", "</tool_call>"],
        "{{ '<tool_call>\\n<function=' + name + '>\\n' }}{{ '<parameter=' + key + '>\\n' }}",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n<parameter=unit>\n"
        "celsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n"
        "</parameter>\n<parameter=b>\n-2\n</parameter>\n</function>\n</tool_call>",
        "</tool_call>",
    ),
    "mistral_v11": (
        ["[TOOL_CALLS]", "[ARGS]"],
        "{{ '[TOOL_CALLS]' + tool_call.name + '[ARGS]' + tool_call.arguments }}",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        "[ARGS]",
    ),
    "mistral_v3": (
        ["[TOOL_CALLS]"],
        "{{ '[TOOL_CALLS]' + tool_calls | tojson }}",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}]',
        "]",
    ),
    "llama3_json": (
        [],
        """{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}""",
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
        "}",
    ),
    "glm45": (
        GLM_TAGS,
        "{{ '<tool_call>' + name }}{{ '<arg_key>' + k + '</arg_key>' }}",
        "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n"
        "<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Oslo</arg_value>\n</tool_call>",
        "</tool_call>",
    ),
}


@pytest.mark.parametrize("family", list(NATIVE))
def test_a_required_call_is_held_to_the_models_own_markers(tmp_path, family) -> None:
    """DeepSeek's and Kimi K2's tokenizers have their call markers as tokens: a required tool_choice holds the reply
    to calls in those markers (the template tells DeepSeek V3's fenced JSON from V3.1's), which the model's own reply
    passes and Hermes blocks do not; Qwen3-Coder's and GLM-4.5's templates write their calls' arguments as tags (the
    template tells which), text where a parameter is a string, and Llama's templates write `{"name", "parameters"}`
    JSON; Mistral's tokenizers have `[TOOL_CALLS]` (and, v11+, `[ARGS]`); random logits through the masks read back as
    valid calls."""
    tags, template, reply, *rest = NATIVE[family]
    end = rest[0] if rest else tags[4]
    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], template, eos_token="<|im_end|>")
    tok.add_tokens(tags)
    tok.save_pretrained(tmp_path)
    tokenizer = load_model_tokenizer(str(tmp_path))
    plan = _plan()
    guide = reply_guide.for_reply(plan.guide(), plan, tokenizer)
    assert ("<tool_call>" in guide["grammar"]) == (family in ("qwen3_coder", "glm45")) and "%json" in guide["grammar"]
    assert ('"parameters"' in guide["grammar"]) == (family == "llama3_json")
    ok, matcher = _walk(tokenizer, guide, _ids(tokenizer, reply))
    assert ok, matcher.get_error()
    hermes = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert not _walk(tokenizer, guide, _ids(tokenizer, hermes))[0]
    content, calls = tools.parse(tokenizer._tok.decode(_ids(tokenizer, reply)), plan)
    assert calls and content is None
    finish = {tokenizer._tok.convert_tokens_to_ids(end)}  # the end of a call
    for seed in range(3):
        ids = _sample(tokenizer, guide, finish, seed)
        text = tokenizer._tok.decode([t for t in ids if t != tokenizer.eos_id])
        content, calls = tools.parse(text, plan)
        assert calls and content is None, text
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER if name == "get_weather" else ADD)
