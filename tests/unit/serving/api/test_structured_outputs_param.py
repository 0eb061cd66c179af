"""vLLM's `structured_outputs` (json, regex, choice, grammar, json_object, structural_tag): what each request becomes, the 400s that
name the field at fault, and random logits through each one's masks coming out as the request said; then the same
through the official client against a real server, both endpoints, streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests
from test_serving_http import KEY, auth, model_dir, server  # noqa: F401 (fixtures)

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.api import protocol, reply_guide
from pylon.serving.engine.guided import Guides
from pylon.serving.errors import InvalidRequest

SIZE = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["size", "count"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", 'ne "quoted" \\ one', "naïve — ünïcode"]
REGEX = r"[A-Z]{2}-[0-9]{3,4}"
GBNF = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?\n'


WEATHER = {
    "begin": "<function=get_weather>",
    "schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "end": "</function>",
}
TIME = {"begin": "<function=get_time>", "schema": {"type": "object", "maxProperties": 0}, "end": "</function>"}
TAG = {"type": "structural_tag", "structures": [WEATHER, TIME], "triggers": ["<function="]}


def _chat(**fields) -> protocol.ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    request = protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode())
    request.check_supported()
    return request


def _guide(**outputs) -> dict:
    return _chat(structured_outputs=outputs).sampling_params(None).guide


def _sampled(guide: dict, seed: int) -> str:
    """The byte tokenizer's text of random logits through `guide`'s masks, to the grammar's end."""
    import torch

    guides = Guides(ByteTokenizer(), 320)
    matcher = guides.matcher(guide)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not matcher.is_stopped() and len(out) < 400:
        logits = guides.apply(torch.randn(1, 320, generator=generator), [0], [matcher], 256)
        token = int(torch.multinomial(logits[0].softmax(-1), 1, generator=generator))
        if token == 256:
            break
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return bytes(t for t in out if t < 256).decode()


@pytest.mark.parametrize("seed", range(4))
def test_each_kind_holds_random_logits_to_what_it_names(seed) -> None:
    jsonschema.validate(json.loads(_sampled(_guide(json=SIZE), seed)), SIZE)
    jsonschema.validate(json.loads(_sampled(_guide(json=json.dumps(SIZE)), seed)), SIZE)  # a JSON string, as vLLM
    assert _sampled(_guide(choice=CHOICES), seed) in CHOICES
    assert re.fullmatch(REGEX, _sampled(_guide(regex=REGEX), seed))
    assert re.fullmatch(r"(yes|no) [1-9][0-9]?", _sampled(_guide(grammar=GBNF), seed))  # GBNF, converted
    lark = 'start: "id=" NUM\nNUM: /[0-9]{2}/\n'
    assert re.fullmatch(r"id=[0-9]{2}", _sampled(_guide(grammar=lark), seed))  # Lark as it is
    assert isinstance(json.loads(_sampled(_guide(json_object=True), seed)), dict)
    spaced = _sampled(_guide(json=SIZE, whitespace_pattern=" "), seed)  # spaces (only) where JSON allows them
    assert json.loads(spaced) and " " in spaced and not set(spaced) & set("\n\t\r"), spaced


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "an object"),
        ({"structured_outputs": {"json": {"type": "strnig"}}}, "structured_outputs.json.type", "not a valid"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "not a Lark or GBNF"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "both",
        ),
        (
            {
                "structured_outputs": {"choice": ["a"]},
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            },
            "structured_outputs",
            "tool_choice",
        ),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag", "not JSON"),
        (
            {"structured_outputs": {"structural_tag": {"structures": [WEATHER]}}},
            "structured_outputs.structural_tag.triggers",
            "missing required field 'structured_outputs.structural_tag.triggers'",
        ),
        (
            {"structured_outputs": {"structural_tag": {**TAG, "triggers": ["<tool="]}}},
            "structured_outputs.structural_tag.structures.0.begin",
            "starts with none of the triggers",
        ),
        (
            {"structured_outputs": {"structural_tag": {**TAG, "structures": [{**WEATHER, "schema": {"type": "x"}}]}}},
            "structured_outputs.structural_tag.structures.0.schema.type",
            "not a valid",
        ),
        (
            {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "any_text"}}}},
            "structured_outputs.structural_tag.format",
            "not supported",
        ),
        (
            {"response_format": {"type": "structural_tag", **TAG, "structures": [{"begin": "<function=f>"}]}},
            "response_format.structures.0.schema",
            "missing required field 'response_format.structures.0.schema'",
        ),
        ({"response_format": {"type": "json_object", "triggers": ["<f"]}}, "response_format.triggers", "belongs to"),
        (
            {"structured_outputs": {"json": SIZE, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties",
            "not supported",
        ),
        ({"structured_outputs": {"choice": [""]}}, "structured_outputs.choice.0", ""),
    ],
)
def test_what_cannot_be_held_is_a_400_naming_the_field(fields, param, message) -> None:
    with pytest.raises(InvalidRequest) as e:
        _chat(**fields).sampling_params(None)
    assert e.value.param == param and message in str(e.value), str(e.value)


def test_a_regex_or_grammar_the_library_refuses_is_a_400_naming_it() -> None:
    guides = Guides(ByteTokenizer(), 320)
    for outputs, param in (
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "start: x"}, "structured_outputs.grammar"),
    ):
        with pytest.raises(InvalidRequest) as e:
            guides.matcher(_guide(**outputs))
        assert e.value.param == param, str(e.value)


def test_a_reasoning_model_reasons_before_its_choice(tmp_path) -> None:
    """A choice, like a schema, is held after the reasoning (reply_guide); a regex or grammar of the request's own
    from the first token."""
    from harmony_models import bpe_tokenizer

    from pylon.serving.engine.tokenization import load_model_tokenizer

    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, eos_token="<|im_end|>")
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(tmp_path)
    tokenizer = load_model_tokenizer(str(tmp_path))
    guide = reply_guide.for_reply(_guide(choice=["positive", "negative"]), None, tokenizer, parser="qwen3")
    matcher = Guides(tokenizer, 320).matcher(guide)
    for token in tok.encode("<think>\nIt is good.\n</think>\n\nnegative", add_special_tokens=False):
        assert matcher.consume_token(token) and not matcher.is_error(), matcher.get_error()
    assert matcher.is_accepting()
    regex = _guide(regex=REGEX)
    assert reply_guide.for_reply(regex, None, tokenizer, parser="qwen3") is regex


def test_structured_outputs_through_the_openai_client(server):  # noqa: F811
    """extra_body structured_outputs on chat and completions, streamed and not: each output is what it named."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "classify this"}]
    for seed in range(2):
        for outputs, check in (
            ({"choice": CHOICES}, lambda text: text in CHOICES),
            ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
            ({"json": SIZE}, lambda text: jsonschema.validate(json.loads(text), SIZE) is None),
            ({"grammar": GBNF}, lambda text: re.fullmatch(r"(yes|no) [1-9][0-9]?", text)),
        ):
            extra = {"structured_outputs": outputs}
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=60, seed=seed, extra_body=extra
            )
            assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].message.content), reply
            chunks = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=60, seed=seed, extra_body=extra, stream=True
            )
            assert check("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            completion = client.completions.create(
                model="tiny", prompt="label:", max_tokens=60, seed=seed, extra_body=extra
            )
            assert check(completion.choices[0].text), completion
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        json={"model": "tiny", "messages": messages, "structured_outputs": {"regex": "a(b"}},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text


DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Each lowercase letter a trigger, and the structure it begins: a random model writes some soon.
LETTER_TAG = {
    "structures": [{"begin": c, "schema": DIGIT, "end": "!"} for c in LETTERS],
    "triggers": list(LETTERS),
}


def _held_by_letter_tag(text: str, cut: bool) -> int:
    """How many structures `text` holds, asserting that each lowercase letter of its free text begins one (`cut`:
    the last may be cut short, at max_tokens)."""
    held, at = 0, 0
    while match := re.compile("[a-z]").search(text, at):
        start = match.start()
        try:
            value, end = json.JSONDecoder().raw_decode(text, start + 1)
        except ValueError:
            assert cut and len(text) - start < 12, text
            return held
        jsonschema.validate(value, DIGIT)
        assert text.startswith("!", end) or (cut and end == len(text)), text
        held, at = held + 1, end + 1
    return held


def test_a_structural_tag_through_the_openai_client(server):  # noqa: F811
    """A structural tag whose triggers are the lowercase letters, which a random model writes soon: through
    response_format (type structural_tag) and structured_outputs.structural_tag, chat and completions, each letter it
    writes begins a structure held to its schema and end; a bad tag is a 400 naming the field."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "say something"}]
    held = 0
    for seed in range(2):
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=60,
            seed=seed,
            response_format={"type": "structural_tag", **LETTER_TAG},
        )
        choice = reply.choices[0]
        held += _held_by_letter_tag(choice.message.content, choice.finish_reason == "length")
        completion = client.completions.create(
            model="tiny",
            prompt="text:",
            max_tokens=60,
            seed=seed,
            extra_body={"structured_outputs": {"structural_tag": json.dumps(LETTER_TAG)}},
        )
        choice = completion.choices[0]
        held += _held_by_letter_tag(choice.text, choice.finish_reason == "length")
    assert held >= 3  # the model wrote the trigger, and what followed was held
    bad = {"type": "structural_tag", "structures": [{"begin": "x", "schema": DIGIT}], "triggers": ["e"]}
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        json={"model": "tiny", "messages": messages, "response_format": bad},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.structures.0.begin", r.text


@pytest.mark.parametrize("seed", range(3))
def test_a_structural_tag_holds_what_follows_each_trigger_and_frees_the_rest(seed) -> None:
    """vLLM's structural tag (structured_outputs.structural_tag, a JSON string or an object, and response_format
    type structural_tag, the same guide): free text, but once the model writes a trigger it writes one of the
    structures it begins, each held to its begin, schema and end, and then free text again."""
    import torch

    guide = _guide(structural_tag=json.dumps(TAG))
    assert _guide(structural_tag=TAG)["grammar"] == guide["grammar"]
    assert _chat(response_format=TAG).sampling_params(None).guide["grammar"] == guide["grammar"]
    guides = Guides(ByteTokenizer(), 320)
    generator = torch.Generator().manual_seed(seed)

    def write(matcher, text: str) -> None:
        for b in text.encode():
            assert matcher.consume_token(b), (text, matcher.get_error())

    def sample(matcher, until: str) -> str:
        out = b""
        while not out.decode(errors="ignore").endswith(until):
            logits = guides.apply(torch.randn(1, 320, generator=generator), [0], [matcher], 256)
            logits[0, 256] = float("-inf")  # (not the end of text, inside a structure the mask forbids it anyway)
            token = int(torch.multinomial(logits[0].softmax(-1), 1, generator=generator))
            assert matcher.consume_token(token), matcher.get_error()
            out += bytes([token])
            assert len(out) < 400
        return out.decode()

    matcher = guides.matcher(guide)
    write(matcher, "Let me look. <function=get_weather>")
    args = sample(matcher, "</function>")
    assert json.loads(args.removesuffix("</function>"))["city"] in ("Paris", "Oslo"), args
    write(matcher, " and the time: <function=get_time>")
    assert sample(matcher, "</function>") == "{}</function>"  # compact JSON
    write(matcher, " done, anything < > {} goes")
    assert matcher.is_accepting()  # text may end here
    # After a trigger, only a structure's own begin: a function the tag does not name is refused at its first byte
    # that no structure has, and a structure's arguments outside its schema too.
    matcher = guides.matcher(guide)
    write(matcher, "ok <function=get_")
    assert not matcher.consume_token(ord("x"))
    matcher = guides.matcher(guide)
    write(matcher, '<function=get_weather>{"city":"')
    assert not matcher.consume_token(ord("R"))
