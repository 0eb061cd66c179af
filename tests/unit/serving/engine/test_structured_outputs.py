"""Structured outputs in the engine (`engine/guided.py`): random-weight models, sampled at temperature 1 and greedy,
emit JSON that parses and validates against nested schemas (objects, enums, arrays, required fields, bounds) with the
byte tokenizer and a byte-level BPE; guided and free requests share steps and the free ones are untouched; a grammar
is compiled once; schemas that cannot be compiled are InvalidRequest naming where."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from engine_models import FAMILIES, PROMPTS, Family, assert_pool_empty, run, tokens_of
from test_serving_text import hf_dir  # noqa: F401 - a byte-level BPE tokenizer's directory (the fixture)

from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest

# Bounded strings and arrays: a random model never chooses to close a string, so an unbounded one runs to max_tokens.
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z0-9]{1,6}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "gift": {"type": "boolean"},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["open", "paid", "shipped"]},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z ]{0,8}$"}]},
        },
        "required": ["id", "items", "status", "note"],
        "additionalProperties": False,
    },
    "refs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def guided(schema: dict | None, **fields) -> SamplingParams:
    guide = {"type": "json_object"} if schema is None else {"type": "json_schema", "schema": schema}
    return SamplingParams(**{"max_tokens": 160, "temperature": 1.0, **fields}, guide=guide)


def text_of(outs) -> str:
    return "".join(o.text for o in outs)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}-guided"))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(family: Family, name: str) -> None:
    engine = family.engine()
    schema = SCHEMAS[name]
    for i, prompt in enumerate(PROMPTS[:4]):
        params = guided(schema, seed=i, temperature=0.0 if i == 0 else 1.0)
        engine.add_request(f"r{i}", prompt, params)
    outputs = run(engine)
    for rid, outs in outputs.items():
        text = text_of(outs)
        assert outs[-1].finish_reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)
    assert engine.guides.compiled_total == 1  # four requests, one compilation
    assert_pool_empty(engine)


def test_json_object_mode_gives_an_object(family: Family) -> None:
    engine = family.engine()
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, guided(None, seed=i, max_tokens=160))
    for rid, outs in run(engine).items():
        if outs[-1].finish_reason == "stop":  # an object a random model keeps open runs to max_tokens
            assert isinstance(json.loads(text_of(outs)), dict), text_of(outs)
        else:
            assert text_of(outs).startswith("{")


def test_guided_and_free_requests_share_steps(family: Family) -> None:
    """Free requests batched with guided ones give exactly what they give alone (greedy: transformers' tokens)."""
    engine = family.engine()
    free = SamplingParams(max_tokens=20, temperature=0)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"free{i}", prompt, free)
        engine.add_request(f"guided{i}", prompt, guided(SCHEMAS["person"], seed=i))
    outputs = run(engine)
    for i in range(4):
        assert tokens_of(outputs[f"free{i}"]) == family.greedy[i][:20]
        jsonschema.validate(json.loads(text_of(outputs[f"guided{i}"])), SCHEMAS["person"])
    assert engine.guides.guided_tokens_total >= 4 * 10


def test_a_byte_level_bpe_tokenizer_is_guided_too(hf_dir, tmp_path) -> None:  # noqa: F811
    family = Family("gpt2", tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, tmp_path / "model" / name)
    engine = family.engine()
    for i in range(4):
        engine.add_request(f"r{i}", "hello world", guided(SCHEMAS["order"], seed=i, max_tokens=160))
    for rid, outs in run(engine).items():
        text = text_of(outs)
        assert outs[-1].finish_reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMAS["order"])


@pytest.mark.parametrize(
    "schema, param, words",
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            "response_format.$defs.missing",
            "does not exist",
        ),
        ({"type": "strin"}, "response_format", "strin"),
    ],
)
def test_a_schema_that_cannot_compile_names_where(gpt2: Family, schema, param, words) -> None:
    engine = gpt2.engine()
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("bad", PROMPTS[0], guided(schema))
    assert e.value.param == param and words in str(e.value), (e.value.param, str(e.value))
    assert not engine.has_unfinished()
