"""The published contract (`GET /openapi.json`, `pylon.serving.api.openapi`): a valid OpenAPI 3.1 document (checked by
openapi-spec-validator and loaded by schemathesis) covering every route, every error as OpenAI's error object, the
bearer scheme where keys are on; and what a real server (uvicorn, mounted under a prefix) sends conforms to it.
The live check against a Serve deployment is tests/integration/test_serving_openapi.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from math import inf

import pytest
import requests
import torch
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.api import keys, openapi, protocol, responses
from pylon.serving.api import server as serving_server
from pylon.serving.api.http import ROUTES
from pylon.serving.engine.request import TokenLogprob
from pylon.serving.engine.tokenization import TokenTexts

KEY = "sk-openapi-unit"
PREFIX = "/svc/v2"
GENERATE = ("/v1/completions", "/v1/chat/completions")
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _doc(secured: bool = True, route_prefix: str = "/") -> dict:
    return openapi.build(model="tiny", max_model_len=128, secured=secured, route_prefix=route_prefix)


def _validator(doc: dict, schema: dict) -> Draft202012Validator:
    """A JSON Schema validator for `schema` that resolves the document's `#/components/...` references."""
    return Draft202012Validator({**doc, **schema})


def _assert_valid(doc: dict, schema: dict, instance) -> None:
    errors = [e.message for e in _validator(doc, schema).iter_errors(instance)]
    assert not errors, (instance, errors)


@pytest.mark.parametrize("secured", [True, False])
@pytest.mark.parametrize("prefix", ["/", PREFIX])
def test_the_document_is_valid_openapi_3_1_and_schemathesis_loads_every_operation(secured, prefix):
    import schemathesis

    doc = _doc(secured, prefix)
    assert doc["openapi"].startswith("3.1.")
    errors = [str(e.message) for e in OpenAPIV31SpecValidator(doc).iter_errors()]
    assert not errors, errors
    assert doc["servers"] == [{"url": prefix}]
    loaded = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in loaded.get_all_operations()]  # .ok() raises on a schema error
    assert sorted((op.method.upper(), op.path) for op in operations) == sorted(
        (method, path) for path, methods in ROUTES.items() for method in methods
    )


def test_every_route_is_documented_with_its_method_and_nothing_else():
    doc = _doc()
    assert set(doc["paths"]) == set(ROUTES) and "/openapi.json" in ROUTES
    for path, methods in ROUTES.items():
        assert list(doc["paths"][path]) == [method.lower() for method in methods], path


@pytest.mark.parametrize("secured", [True, False])
def test_every_error_response_is_the_openai_error_object(secured):
    """(Anthropic's Messages routes answer Anthropic's error object instead.)"""
    doc = _doc(secured)
    seen = set()
    for path, item in doc["paths"].items():
        for operation in item.values():
            for status, response in operation["responses"].items():
                if int(status) < 400:
                    continue
                seen.add(int(status))
                schema = response["content"]["application/json"]["schema"]
                if path in ("/health", "/ready") and status == "503":  # probes answer their status object
                    assert schema["$ref"].endswith(("/HealthStatus", "/ReadyStatus")), (path, schema)
                elif path.startswith("/v1/messages") and status != "500":  # Anthropic's routes: its error object
                    assert schema == {"$ref": "#/components/schemas/AnthropicError"}, (path, status, schema)
                else:
                    assert schema == ERROR_REF, (path, status, schema)
    for response in doc["components"]["responses"].values():  # an unknown path (404), a wrong method (405)
        assert response["content"]["application/json"]["schema"] == ERROR_REF
    expected = [400, *([401] if secured else []), 404, 413, 415, 429, 500, 503, 504]
    for path in GENERATE:
        assert sorted(int(s) for s in doc["paths"][path]["post"]["responses"] if int(s) >= 400) == expected
    assert (401 in seen) == secured and {400, 404, 429, 500, 503}.issubset(seen)
    headers = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert headers["429"]["headers"]["Retry-After"]["required"] is True
    assert doc["components"]["responses"]["MethodNotAllowed"]["headers"]["Allow"]["required"] is True


def test_the_bearer_scheme_applies_where_the_server_asks_for_a_key():
    doc = _doc(secured=True)
    assert doc["components"]["securitySchemes"] == {
        "bearer": {**doc["components"]["securitySchemes"]["bearer"], "type": "http", "scheme": "bearer"}
    }
    for path, item in doc["paths"].items():
        needs_key = path in (
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/input_items",
            "/v1/responses/{response_id}/cancel",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/embeddings",
            "/v1/rerank",
            "/v2/rerank",
            "/v1/score",
            "/rerank",
            "/score",
            "/classify",
            "/v1/classify",
            "/pooling",
            "/v1/models",
            "/v1/models/{model}",
            "/tokenize",
            "/detokenize",
            "/v1/files",
            "/v1/files/{file_id}",
            "/v1/files/{file_id}/content",
            "/v1/batches",
            "/v1/batches/{batch_id}",
            "/v1/batches/{batch_id}/cancel",
        )
        for operation in item.values():
            assert operation["security"] == ([{"bearer": []}] if needs_key else []), path
            assert ("401" in operation["responses"]) == needs_key, path
    open_doc = _doc(secured=False)
    assert "securitySchemes" not in open_doc["components"]
    assert all(op["security"] == [] for item in open_doc["paths"].values() for op in item.values())


def test_requests_state_the_bounds_the_server_enforces():
    schemas = _doc()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    assert completion["properties"]["model"]["enum"] == ["tiny"]
    assert completion["additionalProperties"] is False and set(completion["required"]) == {"model", "prompt"}
    assert set(chat["required"]) == {"model", "messages"}
    # completions take max_tokens 0 (with echo: score the prompt); chat does not
    assert completion["properties"]["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 127}
    assert chat["properties"]["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 127}
    assert chat["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] == 127
    assert completion["properties"]["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 5}
    assert chat["properties"]["top_logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert completion["properties"]["echo"]["type"] == "boolean" and chat["properties"]["logprobs"]["type"] == "boolean"
    assert (
        completion["properties"]["top_p"]["exclusiveMinimum"] == 0 and completion["properties"]["top_p"]["maximum"] == 1
    )
    assert completion["properties"]["temperature"]["maximum"] == 100
    responses = schemas["ResponsesRequest"]
    assert responses["properties"]["model"]["enum"] == ["tiny"] and set(responses["required"]) == {"model", "input"}
    assert responses["properties"]["max_output_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 127}
    assert responses["additionalProperties"] is False


def _sse_events(text: str) -> list[str]:
    return [block[len("data: ") :] for block in text.split("\n\n") if block]


def _assert_event(doc: dict, path: str, data: str) -> None:
    schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    _assert_valid(doc, schema, {"data": data, "event": "message"})
    if data != "[DONE]":  # contentSchema is an annotation in JSON Schema: check the payload itself
        payload = schema["properties"]["data"]["anyOf"][1]["contentSchema"]
        _assert_valid(doc, payload, json.loads(data))


def test_what_the_protocol_builds_is_what_the_document_says():
    doc = _doc()

    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    _assert_valid(doc, ref("CompletionResponse"), protocol.completion_response("cmpl-1", "tiny", "hi", "length", 3, 2))
    _assert_valid(doc, ref("ChatCompletionResponse"), protocol.chat_response("chatcmpl-1", "tiny", "hi", "stop", 3, 1))
    _assert_valid(doc, ref("ErrorResponse"), protocol.error_body("bad", param="prompt", code=400))
    # with logprobs (an echoed prompt's first token has none; a token ruled out is sent as -9999), cached tokens
    entries = [(104, None), (105, TokenLogprob(105, -1.5, ((106, -0.5), (105, -1.5)))), (255, TokenLogprob(255, -inf))]
    texts = TokenTexts(ByteTokenizer())
    completion_lp = protocol.LogprobsFormat(texts).completion(entries)
    assert completion_lp["token_logprobs"] == [None, -1.5, -9999.0] and completion_lp["text_offset"] == [0, 1, 2]
    chat_lp = protocol.LogprobsFormat(texts).chat(entries)
    assert chat_lp["content"][1] == {"token": "\ufffd", "logprob": -9999.0, "bytes": [255], "top_logprobs": []}
    built = protocol.completion_response("c", "tiny", "hij", "length", 3, 0, logprobs=completion_lp, cached_tokens=2)
    _assert_valid(doc, ref("CompletionResponse"), built)
    _assert_valid(
        doc, ref("ChatCompletionResponse"), protocol.chat_response("c", "tiny", "h", "stop", 3, 1, logprobs=chat_lp)
    )
    for kind, path in (("completion", "/v1/completions"), ("chat", "/v1/chat/completions")):
        events = protocol.StreamEvents(kind, "id-1", "tiny")
        stream = (events.role() if kind == "chat" else "") + events.chunk("a", None) + events.chunk("", "length")
        stream += events.chunk("b", None, completion_lp if kind == "completion" else chat_lp)
        stream += events.usage(3, 2, 1) + events.event(protocol.error_body("late", type="timeout_error", code=504))
        for data in [*_sse_events(stream), "[DONE]"]:
            _assert_event(doc, path, data)
    # The Responses API's object and events, with every kind of output item (reasoning, message, tool calls).
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    chat = protocol.chat_response(
        "c", "tiny", "", "tool_calls", 3, 4, tool_calls=[call], reasoning_content="hm", with_reasoning=True
    )
    request = responses.ResponsesRequest.model_validate({"model": "tiny", "input": "x", "metadata": {"k": "v"}})
    built = responses.response_object(request, chat, "resp_1")
    assert [item["type"] for item in built["output"]] == ["reasoning", "function_call"]
    _assert_valid(doc, ref("ResponseObject"), built)
    text_reply = protocol.chat_response("c", "tiny", "hi", "length", 3, 2, logprobs=chat_lp)
    built = responses.response_object(request, text_reply, "resp_2")
    assert built["status"] == "incomplete" and built["output"][0]["content"][0]["logprobs"] == chat_lp["content"]
    _assert_valid(doc, ref("ResponseObject"), built)
    events = responses.ResponseEvents(request, "resp_3")
    stream = (
        events.role()
        + events.reasoning("hm")
        + events.chunk("a", None, chat_lp)
        + events.tool_calls([call], "tool_calls")
    )
    stream += events.usage(3, 2, 1, 1) + events.event(protocol.error_body("late", type="timeout_error", code=504))
    schema = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    kinds = []
    for block in (b for b in stream.split("\n\n") if b):
        event, data = block.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        kinds.append(payload["type"])
        assert event == f"event: {payload['type']}"
        _assert_valid(doc, schema["properties"]["data"]["contentSchema"], payload)
    assert kinds[0] == "response.created" and kinds[-2:] == ["response.completed", "error"], kinds
    assert (
        json.loads(stream.split("\n\n")[-3].split("data: ", 1)[1])["response"]["output"][-1]["type"] == "function_call"
    )
    # and the schemas are strict enough to fail: an extra key, a wrong object, a bad finish reason
    bad = protocol.completion_response("cmpl-1", "tiny", "hi", "length", 3, 2)
    for broken in ({**bad, "extra": 1}, {**bad, "object": "chat.completion"}):
        assert not _validator(doc, ref("CompletionResponse")).is_valid(broken)
    bad["choices"][0]["finish_reason"] = "eos"
    assert not _validator(doc, ref("CompletionResponse")).is_valid(bad)
    assert not _validator(doc, ref("ErrorResponse")).is_valid({"error": {"message": "x"}})


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """A real uvicorn server mounted under PREFIX (as a proxy that strips it would), serving a PylonLLMServer with
    API keys; yields (url, replica)."""
    import os

    import uvicorn

    from pylon.specs import DeploymentSpec

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2", n_layer=1, n_head=2, n_embd=32, n_positions=128, vocab_size=320, eos_token_id=tok.eos_id
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("openapi-model")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    os.environ["PYLON_SCHED_BATCH"] = "0"
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "tiny",
            "model": str(directory),
            "engine": {
                "max_num_seqs": 2,
                "kv_cache_tokens": 512,
                "max_model_len": 128,
                "device": "cpu",
                "separate_process": False,
            },
            "http": {"api_keys_env": "PYLON_TEST_OPENAPI_KEYS", "route_prefix": PREFIX, "stream_interval_ms": 0},
        }
    )
    stored = keys.api_keys_config(spec, {"PYLON_TEST_OPENAPI_KEYS": KEY})
    replica = serving_server.PylonLLMServer(spec.model_dump(mode="json"), stored)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = replica.__serve_build_asgi_app__()
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", root_path=PREFIX))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", replica
    http.should_exit = True
    thread.join(10)
    replica.engine.shutdown()
    os.environ.pop("PYLON_SCHED_BATCH", None)


def _response_schema(doc: dict, path: str, method: str, status: int, media: str = "application/json") -> dict:
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, which the document does not list"
    return responses[str(status)]["content"][media]["schema"]


def test_the_served_document_is_json_cached_and_mounted_where_the_server_is(mounted):
    url, replica = mounted
    r = requests.get(f"{url}/openapi.json", timeout=30)  # no key: the contract is public, like /health
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc == _doc(secured=True, route_prefix=PREFIX)
    assert doc["servers"] == [{"url": PREFIX}]
    again = requests.get(f"{url}/openapi.json", timeout=30)
    assert again.content == r.content and list(replica._openapi_docs) == [(PREFIX, True)]


def test_what_the_mounted_server_answers_conforms_to_its_document(mounted):
    url, _ = mounted
    doc = requests.get(f"{url}/openapi.json", timeout=30).json()
    auth = {"Authorization": f"Bearer {KEY}"}
    calls = [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3}, auth, 200),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            auth,
            200,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, auth, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 2}, auth, 200),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 0}, auth, 200),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True},
            auth,
            200,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 9}, auth, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 500}, auth, 400),
        ("/v1/completions", {"model": "other", "prompt": "hi"}, auth, 404),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, {}, 401),
    ]
    for path, body, headers, status in calls:
        r = requests.post(f"{url}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (path, body, r.text)
        _assert_valid(doc, _response_schema(doc, path, "post", status), r.json())
        if status >= 400:
            assert r.json()["error"]["code"] == status
    for path in GENERATE:
        body = {"model": "tiny", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        body.update(
            {"logprobs": 2, "echo": True} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 2}
        )
        body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
        r = requests.post(f"{url}{path}", json=body, headers=auth, timeout=60)
        assert (
            r.status_code == 200
            and r.headers["content-type"].split(";")[0] in doc["paths"][path]["post"]["responses"]["200"]["content"]
        )
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]" and len(events) >= 3
        for data in events:
            _assert_event(doc, path, data)
    for path in ("/v1/models", "/health", "/ready"):
        r = requests.get(f"{url}{path}", headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        _assert_valid(doc, _response_schema(doc, path, "get", 200), r.json())
    # OpenAI's retrieve model: the served one's card; another id (a name with a slash, escaped, too) a 404 naming it
    for model, status, named in (("tiny", 200, ""), ("other", 404, "other"), ("org%2Fname", 404, "org/name")):
        r = requests.get(f"{url}/v1/models/{model}", headers=auth, timeout=30)
        assert r.status_code == status, (model, r.text)
        _assert_valid(doc, _response_schema(doc, "/v1/models/{model}", "get", status), r.json())
        if status == 404:
            assert r.json()["error"]["param"] == "model" and f'"{named}"' in r.json()["error"]["message"], r.text
        else:
            assert r.json()["id"] == "tiny" and r.json()["max_model_len"] > 0
    assert requests.get(f"{url}/v1/models/tiny", timeout=30).status_code == 401
    # The Responses API: its object and typed events, its 400s (one of them the engine's: the tool preamble is past
    # this model's 128 tokens, named as `input`) and 401; tool calls' items: test_what_the_protocol_builds_...
    tools = [
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    ]
    for body, status in (
        ({"model": "tiny", "input": "x", "max_output_tokens": 3, "include": ["message.output_text.logprobs"]}, 200),
        ({"model": "tiny", "input": "x", "tools": tools, "tool_choice": "required", "max_output_tokens": 40}, 400),
        ({"model": "tiny", "input": "x", "previous_response_id": "resp_1"}, 400),
    ):
        r = requests.post(f"{url}/v1/responses", json=body, headers=auth, timeout=60)
        assert r.status_code == status, (body, r.text)
        _assert_valid(doc, _response_schema(doc, "/v1/responses", "post", status), r.json())
        if status != 200:
            assert r.json()["error"]["param"] in ("previous_response_id", "input"), r.text
            continue
        r = requests.post(f"{url}/v1/responses", json={**body, "stream": True}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == "text/event-stream"
        schema = _response_schema(doc, "/v1/responses", "post", 200, "text/event-stream")
        blocks = [b for b in r.text.split("\n\n") if b]
        assert len(blocks) >= 4 and "[DONE]" not in r.text
        for block in blocks:
            event, data = block.split("\n", 1)
            event, data = event.removeprefix("event: "), data.removeprefix("data: ")
            _assert_valid(doc, schema, {"event": event, "data": data})
            payload = json.loads(data)
            assert payload["type"] == event
            _assert_valid(doc, schema["properties"]["data"]["contentSchema"], payload)
    r = requests.post(f"{url}/v1/responses", json={"model": "tiny", "input": "x"}, timeout=30)
    assert r.status_code == 401
    r = requests.delete(f"{url}/v1/models", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    _assert_valid(
        doc, doc["components"]["responses"]["MethodNotAllowed"]["content"]["application/json"]["schema"], r.json()
    )
