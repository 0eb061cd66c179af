"""vLLM's `structured_outputs` (json, regex, choice, grammar, json_object): what each request becomes, the 400s that
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
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
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
