"""The published contract against the live deployment: schemathesis reads `GET /openapi.json` from a deployment on the
session's Ray cluster (API keys on, mounted under a route prefix) and sends every operation generated requests, valid
and not. Every answer must be no 5xx, conform to the document (status, content type, body, headers; streamed bodies
event by event), and every 4xx must be OpenAI's error object."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# What `schemathesis.openapi.from_url` imports lazily, imported here at collection, before the session's Ray cluster
# has threads: CPython 3.11.7's ast is not thread-safe, and pytest's assertion rewriting compiled these modules inside
# the fixture while another thread parsed ("AST constructor recursion depth mismatch", seen once in CI).
import schemathesis.specs.openapi.schemas  # noqa: E402, F401 isort: skip
from test_serving import API_KEY, KEYS_ENV, MAX_QUEUED, TinyModel, _spec

from pylon.serving.api.http import ROUTES

pytestmark = pytest.mark.integration

PREFIX = "/contract"
EXAMPLES = 15  # per operation and mode (valid, invalid)
MAX_TOKENS = 8  # what a generated request may ask the model for (the schema allows up to max_model_len - 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return TinyModel(tmp_path_factory.mktemp("contract-model"))


@pytest.fixture(scope="module")
def contract(ray_cluster, tiny, tmp_path_factory):
    """The tiny model deployed with API keys under PREFIX, keeping files and batches; its base URL."""
    from pylon.sdk.serve import delete, deploy

    http = {
        "api_keys_env": KEYS_ENV,
        "max_queued_requests": MAX_QUEUED,
        "request_timeout_s": 60,
        "batch_store": str(tmp_path_factory.mktemp("contract-batches")),
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEYS_ENV, API_KEY)
        url = deploy(_spec("contract", tiny.dir, http={**http, "route_prefix": PREFIX}))
    yield url
    delete("contract")


@pytest.fixture(scope="module")
def contract_schema(contract):
    r = requests.get(f"{contract}/openapi.json", timeout=30)  # no key needed
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:300]
    assert r.json()["servers"] == [{"url": PREFIX}] and sorted(r.json()["paths"]) == sorted(ROUTES)
    config = schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {API_KEY}"},
            "generation": {"mode": "all", "database": "none", "deterministic": True},
            "phases": {"examples": {"enabled": False}, "stateful": {"enabled": False}},
        }
    )
    schema = schemathesis.openapi.from_url(f"{contract}/openapi.json", config=config, timeout=30)
    assert schema.get_base_url() == contract, "the document's servers must lead back to the mount point"
    return schema


def openai_error_object(ctx, response, case) -> None:
    """Every 4xx is `{"error": {"message", "type", "param", "code"}}`, as OpenAI's clients read it; Anthropic's routes'
    are Anthropic's error object, `{"type": "error", "error": {"type", "message", "param"}}`."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    if "/v1/messages" in case.operation.path:
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", response.text
        error = body["error"]
        assert set(error) <= {"type", "message", "param"} and error["type"] and error["message"], error
        return None
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error object: {response.text[:300]}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"error keys: {sorted(error)}"
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == response.status_code, error
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    openai_error_object,
]


def _bounded(case) -> None:
    """At most MAX_TOKENS new tokens per generated request: the server itself only refuses more than the context
    holds (max_tokens is capped where valid, and chat, which otherwise runs to the end of the context, gets it)."""
    body = case.body
    if not isinstance(body, dict) or case.operation.method.upper() != "POST":
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if case.operation.path.endswith("/chat/completions") and "max_tokens" not in body:
        body.setdefault("max_completion_tokens", MAX_TOKENS)
    if case.operation.path.endswith("/responses"):  # like chat, it runs to the end of the context by default
        value = body.get("max_output_tokens")
        if not isinstance(value, int) or isinstance(value, bool) or value > MAX_TOKENS:
            body["max_output_tokens"] = MAX_TOKENS


@pytest.mark.slow  # make test-all: ~1.5 min; tests/unit/serving/api checks the published schema
def test_the_live_api_keeps_its_published_contract(contract_schema):
    """Every operation, valid and invalid requests (hypothesis, bounded and derandomized), every check above.
    (Schemathesis's own pytest plugin, `from_fixture(...).parametrize()`, does not run under pytest 9.)"""
    operations = [result.ok() for result in contract_schema.get_all_operations()]
    # Schemathesis leaves out the operation at the document's own URL (GET /openapi.json, which the fixture has
    # just fetched and checked); every other route is there.
    assert sorted((op.method.upper(), op.path) for op in operations) == sorted(
        (method, path) for path, methods in ROUTES.items() for method in methods if path != "/openapi.json"
    )
    negative = 0
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not len(operation.body):
                continue  # nothing to make invalid: no body, no parameter (GET /health, /ready, /v1/models)
            negative += mode is GenerationMode.NEGATIVE

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def conforms(case):
                _bounded(case)
                case.call_and_validate(checks=CHECKS, timeout=60)

            conforms()
    assert negative == 18, (
        "invalid bodies went to every operation with a body (generation, responses, messages and its token count, "
        "embeddings, rerank (three paths), score (two), classify (two), pooling, /tokenize, /detokenize, a file's "
        "upload, a batch's create)"
    )
