"""gpt-oss's harmony format read from generated token ids (`pylon.serving.api.harmony`): reasoning, content and tool
calls of whole replies, replies cut short or off the format, and the same reading whatever the stream's chunking.
The tokenizer is a tiny harmony one (tests/harmony_models.py), loaded as the server loads a model's."""

from __future__ import annotations

import json
import random
import re

import harmony_models
import pytest

from pylon.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer
from pylon.serving.api.harmony import HarmonyStream, HarmonyTokens, parse
from pylon.serving.engine.tokenization import load_model_tokenizer

FUNCTIONS = ["get_weather", "get_time"]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harmony")
    harmony_models.harmony_tokenizer(directory)
    return load_model_tokenizer(str(directory))


@pytest.fixture(scope="module")
def tokens(tokenizer):
    found = HarmonyTokens.of(tokenizer)
    assert found is not None
    return found


def read(tokenizer, tokens, text: str, functions=FUNCTIONS):
    return parse(tokenizer, tokens, harmony_models.harmony_ids(tokenizer, text), functions)


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    for call in calls:
        assert CALL_ID.match(call["id"]) and call["type"] == "function" and set(call) == {"id", "type", "function"}
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_fixture_tokenizer_is_the_servers_kind_and_fits_the_test_models(tokenizer):
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.vocab_size <= 320
    ids = harmony_models.harmony_ids(tokenizer, "<|start|>assistant<|channel|>final<|message|>日本 é 🙂<|return|>")
    assert max(ids) < 320 and ids[0] == tokenizer._tok.convert_tokens_to_ids("<|start|>")
    assert tokenizer.decode(ids) == "<|start|>assistant<|channel|>final<|message|>日本 é 🙂<|return|>"


def test_the_fixture_template_renders_a_chat_in_harmony(tokenizer):
    from pylon.serving.engine.tokenization import apply_chat_template

    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The weather now", "parameters": {"type": "object"}},
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Tokyo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ]
    assert apply_chat_template(tokenizer, messages, tools=tools) == (
        "<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        'namespace functions {\n\n// The weather now\ntype get_weather = (_: {"type": "object"}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Tokyo?<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Tokyo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20C<|end|>"
        "<|start|>assistant"
    )


# -- whole replies ------------------------------------------------------------------------------------------------


def test_reasoning_then_final_answer(tokenizer, tokens):
    reply = (
        "<|channel|>analysis<|message|>Thinking about 2+2... café, 日本, 🙂<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is 4. Très bien 日本語 🎉<|return|>"
    )
    assert read(tokenizer, tokens, reply) == (
        "Thinking about 2+2... café, 日本, 🙂",
        "The answer is 4. Très bien 日本語 🎉",
        [],
    )


def test_a_final_answer_alone_has_no_reasoning(tokenizer, tokens):
    assert read(tokenizer, tokens, "<|channel|>final<|message|>Just this.<|return|>") == (None, "Just this.", [])


def test_a_call_of_a_declared_function_is_a_tool_call(tokenizer, tokens):
    reply = (
        "<|channel|>analysis<|message|>User asks the weather. Call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"東京",  "days": [1,2]}<|call|>'
    )
    reasoning, content, calls = read(tokenizer, tokens, reply)
    assert (reasoning, content) == ("User asks the weather. Call the tool.", None)
    assert calls_of(calls) == [("get_weather", '{"location": "東京", "days": [1, 2]}')]


def test_two_calls_in_one_reply_keep_their_order(tokenizer, tokens):
    reply = (
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "JST"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Paris"}<|call|>'
    )
    reasoning, content, calls = read(tokenizer, tokens, reply)
    assert (reasoning, content) == (None, None)
    assert calls_of(calls) == [("get_time", '{"zone": "JST"}'), ("get_weather", '{"location": "Paris"}')]
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "reply",
    [
        # the recipient before the channel, and `json` without <|constrain|>
        '<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}<|call|>',
        # the same in the reply's first header (the prompt ended with <|start|>assistant)
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}<|call|>',
        # on the analysis channel, as gpt-oss sometimes calls
        '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>',
        # the recipient right against <|constrain|>
        '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"location": "Tokyo"}<|call|>',
    ],
)
def test_a_call_is_read_wherever_its_header_puts_the_recipient(tokenizer, tokens, reply):
    _, content, calls = read(tokenizer, tokens, reply)
    assert content is None
    assert calls_of(calls) == [("get_weather", '{"location": "Tokyo"}')]


def test_the_functions_may_be_the_plans_dict(tokenizer, tokens):
    reply = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Oslo"}<|call|>'
    _, _, calls = read(tokenizer, tokens, reply, functions={"get_weather": {"name": "get_weather"}})
    assert calls_of(calls) == [("get_weather", '{"location": "Oslo"}')]


@pytest.mark.parametrize(
    "header,body,functions",
    [
        ("commentary to=functions.get_stock <|constrain|>json", '{"symbol": "X"}', FUNCTIONS),  # not declared
        ("commentary to=functions.get_weather <|constrain|>json", '{"location": "Tokyo"}', None),  # no tools
        ("commentary to=functions.get_weather <|constrain|>json", "Tokyo, please", FUNCTIONS),  # not JSON
        ("commentary to=functions.get_weather <|constrain|>json", '["Tokyo"]', FUNCTIONS),  # not an object
        ("commentary to=functions.get_weather <|constrain|>json", '{"location": "Tok', FUNCTIONS),  # cut JSON
        ("analysis to=browser.search code", '{"query": "weather Tokyo"}', FUNCTIONS),  # a built-in tool
        ("analysis to=python code", "print(1 + 1)", FUNCTIONS),
        ("commentary to=get_weather <|constrain|>json", '{"location": "Tokyo"}', FUNCTIONS),  # outside functions.
    ],
)
def test_a_call_that_is_no_tool_call_is_content_text(tokenizer, tokens, header, body, functions):
    reply = f"<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>{header}<|message|>{body}<|call|>"
    assert read(tokenizer, tokens, reply, functions) == ("Look it up.", body, [])


def test_a_preamble_on_commentary_is_content(tokenizer, tokens):
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Tokyo"}<|call|>'
    )
    reasoning, content, calls = read(tokenizer, tokens, reply)
    assert (reasoning, content) == ("Need the weather.", "Let me check the weather.")
    assert calls_of(calls) == [("get_weather", '{"location": "Tokyo"}')]
    assert read(tokenizer, tokens, "<|channel|>commentary<|message|>Only a preamble.<|end|>") == (
        None,
        "Only a preamble.",
        [],
    )


def test_messages_of_one_kind_are_joined_by_a_newline(tokenizer, tokens):
    reply = (
        "<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
        "<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    assert read(tokenizer, tokens, reply) == ("First thought.\nSecond.", "Checking.\nDone.", [])


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("<|channel|>analysis<|message|>Still thinking about 日", ("Still thinking about 日", "")),
        (
            "<|channel|>analysis<|message|>Done thinking.<|end|><|start|>assistant<|channel|>final<|message|>The ans",
            ("Done thinking.", "The ans"),
        ),
        ("<|channel|>analysis<|message|>Done thinking.<|end|><|start|>assistant<|channel|>fin", ("Done thinking.", "")),
        (
            '<|channel|>analysis<|message|>Call.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tok',
            ("Call.", '{"location": "Tok'),
        ),
        ("<|channel|>analy", (None, "")),
    ],
)
def test_a_reply_cut_short_keeps_what_its_open_message_had(tokenizer, tokens, reply, expected):
    assert read(tokenizer, tokens, reply) == (*expected, [])


def test_a_call_cut_short_with_a_whole_object_is_still_content(tokenizer, tokens):
    # No <|call|>: the model did not finish the call (max_tokens), so nothing is called.
    reply = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}'
    assert read(tokenizer, tokens, reply) == (None, '{"location": "Tokyo"}', [])


@pytest.mark.parametrize(
    "reply,content",
    [
        ("Hello there, plain text: café 日本 🙂", "Hello there, plain text: café 日本 🙂"),
        ("Plain text then the end.<|return|>", "Plain text then the end."),
        ("Plain<|endoftext|> text", "Plain text"),
        ("", ""),
    ],
)
def test_a_reply_off_the_format_is_all_content(tokenizer, tokens, reply, content):
    assert read(tokenizer, tokens, reply) == (None, content, [])


def test_header_text_and_special_tokens_never_reach_the_text(tokenizer, tokens):
    reply = (
        "stray<|channel|>analysis<|message|>Think<|endoftext|>ing.<|end|>between"
        "<|start|>assistant<|channel|>final<|message|>Answer.<|return|><|endoftext|>"
    )
    assert read(tokenizer, tokens, reply) == ("Thinking.", "Answer.", [])


def test_a_message_without_its_end_token_ends_at_the_next_start(tokenizer, tokens):
    reply = "<|channel|>analysis<|message|>Think.<|start|>assistant<|channel|>final<|message|>Answer.<|return|>"
    assert read(tokenizer, tokens, reply) == ("Think.", "Answer.", [])


# -- streaming --------------------------------------------------------------------------------------------------------

REPLIES = [
    "<|channel|>analysis<|message|>Thinking about 2+2... café, 日本, 🙂<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4. Très bien 日本語 🎉<|return|>",
    "<|channel|>analysis<|message|>User asks the weather in 東京. Call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking 🌤<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"東京"}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json'
    '<|message|>{"zone": "JST"}<|call|>',
    "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>analysis to=browser.search code"
    '<|message|>{"query": "天気"}<|call|><|start|>assistant<|channel|>analysis<|message|>Again é.<|end|>'
    "<|start|>assistant<|channel|>final<|message|>Rainy ☔<|return|>",
    "<|channel|>analysis<|message|>Still thinking about 日本",
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "東',
    "Plain text with no harmony: café 日本 🙂<|return|>",
    "<|channel|>final<|message|>é🙂日<|return|>",
]


def streamed(tokenizer, tokens, ids: list[int], cuts: list[int]):
    stream = HarmonyStream(tokenizer, tokens, FUNCTIONS)
    reasoning, content = [], []
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        r, c = stream.feed(ids[a:b])
        assert "\ufffd" not in r + c  # no character goes out in part
        reasoning.append(r)
        content.append(c)
    r, c, calls = stream.finish()
    reasoning.append(r)
    content.append(c)
    return stream, "".join(reasoning), "".join(content), calls


def expected_of(tokenizer, tokens, ids):
    reasoning, content, calls = parse(tokenizer, tokens, ids, FUNCTIONS)
    return reasoning, content or "", calls_of(calls)


@pytest.mark.parametrize("reply", REPLIES)
def test_streaming_one_token_at_a_time_gives_the_whole_reply(tokenizer, tokens, reply):
    ids = harmony_models.harmony_ids(tokenizer, reply)
    reasoning, content, calls = expected_of(tokenizer, tokens, ids)
    stream, r, c, streamed_calls = streamed(tokenizer, tokens, ids, list(range(1, len(ids))))
    assert (r if stream.had_reasoning else None, c, calls_of(streamed_calls)) == (reasoning, content, calls)


@pytest.mark.parametrize("reply", REPLIES)
def test_streaming_split_anywhere_gives_the_whole_reply(tokenizer, tokens, reply):
    ids = harmony_models.harmony_ids(tokenizer, reply)
    expected = expected_of(tokenizer, tokens, ids)
    rng = random.Random(reply)
    chunkings = [[at] for at in range(len(ids) + 1)]  # every split in two
    chunkings += [sorted(rng.sample(range(1, len(ids)), rng.randint(1, len(ids) - 1))) for _ in range(30)]
    for cuts in chunkings:
        stream, r, c, calls = streamed(tokenizer, tokens, ids, cuts)
        assert (r if stream.had_reasoning else None, c, calls_of(calls)) == expected, cuts


def test_streaming_sends_text_as_it_comes_and_calls_at_the_end(tokenizer, tokens):
    ids = harmony_models.harmony_ids(
        tokenizer,
        "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>final<|message|>Yes"
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_time<|constrain|>json<|message|>{}<|call|>",
    )
    stream = HarmonyStream(tokenizer, tokens, FUNCTIONS)
    first_end = ids.index(tokens.end)
    second_end = ids.index(tokens.end, first_end + 1)
    assert stream.feed(ids[:first_end]) == ("Hmm", "")  # the analysis body, before its end token
    assert stream.feed(ids[first_end:second_end]) == ("", "Yes")  # the final one, before its end token
    assert stream.feed(ids[second_end:]) == ("", "")  # the call's body is held
    reasoning, content, calls = stream.finish()
    assert (reasoning, content, calls_of(calls)) == ("", "", [("get_time", "{}")])


def test_a_character_split_across_tokens_goes_out_whole(tokenizer, tokens):
    ids = harmony_models.harmony_ids(tokenizer, "<|channel|>final<|message|>🙂<|return|>")
    body = ids[ids.index(tokens.message) + 1 : -1]
    assert len(body) > 1  # the emoji is several byte tokens in the fixture's vocabulary
    stream = HarmonyStream(tokenizer, tokens)
    sent = [stream.feed([i]) for i in ids]
    assert [c for _, c in sent if c] == ["🙂"]
    assert sent[ids.index(tokens.message) + len(body)] == ("", "🙂")  # with its last byte, not at the end token


# -- reasoning tokens ---------------------------------------------------------------------------------------------


def test_reasoning_tokens_count_the_analysis_messages_with_their_headers_and_end_tokens(tokenizer, tokens):
    ids_of = lambda text: harmony_models.harmony_ids(tokenizer, text)
    thinking, again, answer = ids_of("Thinking..."), ids_of("More é."), ids_of("The answer is 4.")
    analysis, final, assistant = ids_of("analysis"), ids_of("final"), ids_of("assistant")
    ids = [tokens.channel, *analysis, tokens.message, *thinking, tokens.end]  # the first header: no <|start|>
    ids += [tokens.start, *assistant, tokens.channel, *analysis, tokens.message, *again, tokens.end]
    ids += [tokens.start, *assistant, tokens.channel, *final, tokens.message, *answer, tokens.return_]
    expected = (3 + len(analysis) + len(thinking)) + (4 + len(assistant) + len(analysis) + len(again))
    # The fixture's BPE, counted by hand: "analysis" and "assistant" 4 tokens each, the two bodies 8 each.
    assert (len(analysis), len(assistant), len(thinking), len(again)) == (4, 4, 8, 8)
    assert expected == (3 + 4 + 8) + (4 + 4 + 4 + 8) == 35
    for cuts in ([], list(range(1, len(ids))), [5, 9, 20]):
        stream = HarmonyStream(tokenizer, tokens)
        parts = [stream.feed(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        parts.append(stream.finish()[:2])
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            "Thinking...\nMore é.",
            "The answer is 4.",
        )
        assert stream.reasoning_tokens == expected and stream.had_reasoning


def test_reasoning_tokens_are_none_without_analysis_and_count_an_open_one(tokenizer, tokens):
    def count(text):
        stream = HarmonyStream(tokenizer, tokens, FUNCTIONS)
        stream.feed(harmony_models.harmony_ids(tokenizer, text))
        stream.finish()
        return stream.reasoning_tokens, stream.had_reasoning

    assert count("<|channel|>final<|message|>The answer is 4.<|return|>") == (0, False)
    assert count("The answer is 4.") == (0, False)
    assert count('<|channel|>commentary to=functions.get_weather<|message|>{"location": "Tokyo"}<|call|>') == (0, False)
    open_ids = harmony_models.harmony_ids(tokenizer, "<|channel|>analysis<|message|>Thinking...")
    assert count("<|channel|>analysis<|message|>Thinking...") == (len(open_ids), True)


# -- the tokens -----------------------------------------------------------------------------------------------------


def test_harmony_tokens_are_the_tokenizers_ids(tokenizer, tokens):
    to_id = tokenizer._tok.convert_tokens_to_ids
    assert tokens == HarmonyTokens(
        start=to_id("<|start|>"),
        end=to_id("<|end|>"),
        message=to_id("<|message|>"),
        channel=to_id("<|channel|>"),
        constrain=to_id("<|constrain|>"),
        return_=to_id("<|return|>"),
        call=to_id("<|call|>"),
    )
    assert len(tokens.ids) == 7
    assert HarmonyTokens.of(tokenizer._tok) == tokens  # the Hugging Face tokenizer itself too


def test_a_tokenizer_without_the_harmony_tokens_has_none(tmp_path):
    assert HarmonyTokens.of(ByteTokenizer()) is None
    # A GPT-2 style tokenizer with an unk token (whose id transformers gives for any unknown token).
    gpt2 = harmony_models.bpe_tokenizer(["<|endoftext|>", "<unk>"], eos_token="<|endoftext|>", unk_token="<unk>")
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert HarmonyTokens.of(load_model_tokenizer(str(tmp_path / "gpt2"))) is None
    # All of harmony's tokens but one.
    partial = [t for t in harmony_models.SPECIALS if t != "<|constrain|>"]
    assert HarmonyTokens.of(harmony_models.bpe_tokenizer(partial, eos_token="<|return|>")) is None
    assert HarmonyTokens.of(harmony_models.bpe_tokenizer(harmony_models.SPECIALS, eos_token="<|return|>")) is not None


def test_the_whole_reply_text_round_trips_through_json(tokenizer, tokens):
    # A call's arguments are JSON text the client can load back to the object the model wrote.
    body = {"location": "São Paulo", "when": {"day": 1, "hours": [9, 17]}, "note": 'say "hi"'}
    reply = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(body, separators=(",", ":"), ensure_ascii=False)
        + "<|call|>"
    )
    _, _, calls = read(tokenizer, tokens, reply)
    ((name, arguments),) = calls_of(calls)
    assert name == "get_weather" and json.loads(arguments) == body
    assert arguments == json.dumps(body, ensure_ascii=False)


def test_a_responses_reasoning_item_goes_back_to_the_turn_it_reasoned_and_round_trips_encoded(tokenizer):
    """The Responses API: a reasoning item in `input` (its text, or the `encrypted_content` this server wrote with
    include ["reasoning.encrypted_content"]) becomes the next assistant turn's reasoning, which gpt-oss's template
    writes back on the analysis channel of a turn that called tools; another server's encrypted_content, and a
    reasoning item before a user message, give none."""
    from pylon.serving.api import protocol, responses
    from pylon.serving.errors import InvalidRequest

    request = responses.ResponsesRequest(model="m", input="hi", include=[responses.ENCRYPTED_INCLUDE])
    request.check_supported()
    chat = protocol.chat_response("c", "m", "4", "stop", 1, 1, reasoning_content="Add them.", with_reasoning=True)
    out = responses.response_object(request, chat, "resp_1")["output"]
    responses.ResponseObject.model_validate(responses.response_object(request, chat, "resp_1"))  # the contract
    blob = out[0]["encrypted_content"]
    assert out[0]["type"] == "reasoning" and blob.startswith("pylon-reasoning:") and "Add them." not in blob
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    question = {"role": "user", "content": "Weather in Paris?"}
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    for reasoning, written in (
        ({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]}, "Call it."),
        ({"type": "reasoning", "summary": [], "encrypted_content": blob}, "Add them."),
        ({"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-openai-s-own"}, None),
    ):
        turn = responses.ResponsesRequest(model="m", input=[question, reasoning, call, result], tools=tools)
        turn.check_supported()
        prompt = turn.chat().render(tokenizer)
        analysis = f"<|channel|>analysis<|message|>{written}<|end|>"
        assert (analysis in prompt) == (written is not None), prompt
        if written is None:
            assert "<|channel|>analysis" not in prompt
    before_user = responses.ResponsesRequest(model="m", input=[out[0], question])  # nothing to reason for
    before_user.check_supported()
    assert all("reasoning_content" not in m for m in before_user.chat().model_dump(exclude_none=True)["messages"])
    bad = responses.ResponsesRequest(model="m", input=[{"type": "reasoning", "summary": [], "x": 1}, question])
    with pytest.raises(InvalidRequest) as e:
        bad.check_supported()
    assert e.value.param == "input.0.x"
