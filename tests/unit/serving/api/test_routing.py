"""Pylon's prefix-aware routing across replicas (pylon.serving.api.routing): the routing key is the engine's own block
hashes of the prompt as a replica renders it; the policy sends a prefix to its holder unless the holder is busy; the
router refuses anyone without the key HAProxy is given. End to end through HAProxy and two replicas:
tests/integration/test_serving.py::test_requests_that_share_a_prefix_go_to_the_replica_that_caches_it."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.api import protocol, routing
from pylon.serving.api.response_store import valid_id
from pylon.serving.api.routing import HASH_BYTES, ReplicaView, RoutingKey, choose, routing_key
from pylon.serving.engine.kv_cache import KVBlockPool, block_hashes, cache_salt
from pylon.serving.engine.tokenization import apply_chat_template

BLOCK = 16


def _key(text: str) -> RoutingKey:
    return routing_key(ByteTokenizer(), BLOCK, {"model": "m", "prompt": text})


def test_the_key_is_the_engines_own_block_hashes_of_the_prompt_a_replica_renders():
    tok = ByteTokenizer()
    text = "def main():\n    return 42  # " * 4
    ids = tok.encode(text)
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    engine = block_hashes(ids[: len(ids) - 1], BLOCK, [])  # what the scheduler looks up
    assert _key(text).hashes == tuple(h[:HASH_BYTES] for h in engine) and len(engine) == (len(ids) - 1) // BLOCK
    messages = [{"role": "system", "content": "You are terse. " * 5}, {"role": "user", "content": "hi"}]
    chat = routing_key(tok, BLOCK, {"model": "m", "messages": messages})
    rendered = tok.encode(apply_chat_template(tok, messages))
    rendered = rendered.tolist() if hasattr(rendered, "tolist") else list(rendered)
    assert chat.hashes == tuple(h[:HASH_BYTES] for h in block_hashes(rendered[:-1], BLOCK, []))
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": ids}).hashes == _key(text).hashes  # token ids as such
    # With tools, the replica's prompt carries them (a system preamble here): the key is that prompt's.
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": messages, "tools": [tool]}
    with_tools = protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode())
    rendered = tok.encode(with_tools.render(tok))
    rendered = rendered.tolist() if hasattr(rendered, "tolist") else list(rendered)
    assert routing_key(tok, BLOCK, body).hashes == tuple(h[:HASH_BYTES] for h in block_hashes(rendered[:-1], BLOCK, []))
    assert routing_key(tok, BLOCK, body).hashes[:1] != chat.hashes[:1]
    # A chat that continues its last message is the prompt the replica renders, left open: its key is that prompt's.
    prefill = [*messages, {"role": "assistant", "content": "Sure: " * 8}]
    open_chat = {"model": "m", "messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    rendered = tok.encode(apply_chat_template(tok, prefill, add_generation_prompt=False, continue_final_message=True))
    rendered = rendered.tolist() if hasattr(rendered, "tolist") else list(rendered)
    assert routing_key(tok, BLOCK, open_chat).hashes == tuple(
        h[:HASH_BYTES] for h in block_hashes(rendered[:-1], BLOCK, [])
    )
    # A request's own chat template is never rendered by the router (a client's code on the router): by load.
    assert routing_key(tok, BLOCK, {**open_chat, "chat_template": "{{ messages }}"}).hashes == ()
    # The Responses API's request: its instructions and input are the chat's messages, and its key the chat's.
    responses = {"model": "m", "instructions": messages[0]["content"], "input": "hi"}
    assert routing_key(tok, BLOCK, responses).hashes == chat.hashes and chat.hashes
    flat_tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    items = {"model": "m", "input": messages, "tools": [flat_tool]}
    assert routing_key(tok, BLOCK, items).hashes == routing_key(tok, BLOCK, body).hashes
    # Anthropic's Messages API: its system and messages are the chat's, and its key the chat's.
    anthropic = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": messages[0]["content"]}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert routing_key(tok, BLOCK, anthropic).hashes == chat.hashes
    # A LoRA adapter's request: hashed from its adapter's name, as its engine hashes it (engine.adapters).
    adapters = frozenset({"terse"})
    adapted = routing_key(tok, BLOCK, {"model": "terse", "prompt": ids}, adapters)
    assert adapted.hashes == tuple(h[:HASH_BYTES] for h in block_hashes(ids[:-1], BLOCK, [], cache_salt("terse")))
    assert adapted.hashes[0] != _key(text).hashes[0]
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": ids}, adapters).hashes == _key(text).hashes
    # Adapters loaded on demand (engine.dynamic_adapters): any name but the base model's is hashed from its name.
    on_demand = routing_key(tok, BLOCK, {"model": "shout", "prompt": ids}, adapters, base="m")
    assert on_demand.hashes == tuple(h[:HASH_BYTES] for h in block_hashes(ids[:-1], BLOCK, [], cache_salt("shout")))
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": ids}, adapters, base="m").hashes == _key(text).hashes
    assert routing_key(tok, BLOCK, {"model": "shout", "prompt": ids}, adapters).hashes == _key(text).hashes
    # Same first blocks, same first hashes: a longer question on the same system prompt shares its prefix.
    longer = _key(text + " and one more question")
    assert longer.hashes[: len(_key(text).hashes)] == _key(text).hashes


@pytest.mark.parametrize(
    "body",
    [None, [], {"model": "m"}, {"model": "m", "prompt": 3}, {"model": "m", "messages": "hi"}, {"prompt": ["a", "b"]}],
)
def test_a_body_a_replica_would_refuse_routes_by_load(body):
    assert routing_key(ByteTokenizer(), BLOCK, body).hashes == ()


def _views(n: int, capacity: int = 4) -> dict:
    return {f"r{i}": ReplicaView(capacity=capacity) for i in range(n)}


def test_a_prefix_goes_to_its_holder_then_to_the_least_loaded_when_the_holder_is_busy():
    views, key, now = _views(3), _key("x" * 100), 1000.0
    views["r2"].blocks = frozenset(key.hashes[:3])
    views["r1"].blocks = frozenset(key.hashes[:5])  # the longest prefix
    views["r1"].ongoing = 3
    order, why = choose(views, key, now, random.Random(0))
    assert order[0] == "r1" and why == "prefix:5" and set(order) == set(views)
    views["r1"].ongoing = 4  # its sequence slots are full: a new request would wait there
    order, why = choose(views, key, now, random.Random(0))
    assert why == "load" and order[0] == "r0" and order[-1] == "r1", order  # least loaded first, busiest last
    views["r0"].ongoing = views["r2"].ongoing = 4  # all busy: by load alone
    assert choose(views, key, now, random.Random(0))[1] == "load"


def test_no_prefix_held_anywhere_spreads_equal_replicas_by_load():
    views, now = _views(4), 1000.0
    firsts = set()
    for i in range(40):
        order, why = choose(views, _key(f"{i:03d}" * 40), now, random.Random(i))
        assert why == "load"
        firsts.add(order[0])
        assert views[order[0]].load(now) == min(v.load(now) for v in views.values())
    assert firsts == set(views)  # ties broken at random, not always the first replica


def test_what_the_router_sent_counts_until_the_replicas_report_says_so():
    view, key, now = ReplicaView(capacity=8), _key("y" * 80), 1000.0
    assert view.cached_prefix(key, now) == 0
    view.routed(key, now)
    assert view.cached_prefix(key, now) == len(key.hashes)  # its blocks are being computed there
    assert view.load(now) == 1 and view.load(now + routing.GRACE_S + 0.01) == 0  # on its way, then the probe's
    assert view.cached_prefix(key, now + routing.RECENT_S + 1) == 0  # not reported in time: forgotten
    view.routed(key, now)
    report = {"blocks": routing.short_hashes(h + b"\0" * 8 for h in key.hashes[:2]), "capacity": 8}
    view.update(report)
    assert view.blocks == frozenset(key.hashes[:2]) and view.capacity == 8
    assert view.cached_prefix(key, now + routing.RECENT_S + 1) == 2  # the report's blocks stay
    view.blocks = frozenset()
    view.update(report)  # the same report again changes nothing
    assert view.blocks == frozenset()


def test_a_replica_reports_every_block_its_engine_caches():
    pool = KVBlockPool(64, BLOCK, enable_caching=True)
    ids = list(range(1, 70))
    hashes = block_hashes(ids, BLOCK, [])
    assert pool.allocate("a", len(ids))
    pool.cache_blocks("a", hashes, len(hashes))
    assert sorted(pool.cached_hashes()) == sorted(hashes)
    blob = routing.short_hashes(pool.cached_hashes())
    assert len(blob) == HASH_BYTES * len(hashes)


def test_the_router_copies_a_models_tokenizer_from_object_storage_without_its_weights(s3_server, tmp_path):
    import uuid

    from pylon import storage
    from pylon.models import local_model_dir
    from pylon.serving.engine.tokenization import load_model_tokenizer

    uri = f"s3://{s3_server.bucket}/router-{uuid.uuid4().hex[:8]}/model"
    fs, path = storage.resolve(uri)
    fs.pipe(f"{path}/pylon_tokenizer.json", json.dumps(ByteTokenizer().info.model_dump(mode="json")).encode())
    fs.pipe(f"{path}/config.json", b"{}")
    fs.pipe(f"{path}/model-00001-of-00002.safetensors", b"w" * 1000)
    fs.pipe(f"{path}/sub/pytorch_model.bin", b"w" * 1000)
    with local_model_dir(uri, weights=False) as directory:
        assert sorted(p.name for p in Path(directory).rglob("*") if p.is_file()) == [
            "config.json",
            "pylon_tokenizer.json",
        ]
        assert isinstance(load_model_tokenizer(directory), ByteTokenizer)
    assert not Path(directory).exists()


@pytest.fixture
def router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A PylonRouter on a byte-tokenizer model directory (tokenizer files only: it loads no weights)."""
    from pylon.specs import DeploymentSpec

    (tmp_path / "pylon_tokenizer.json").write_text(json.dumps(ByteTokenizer().info.model_dump(mode="json")))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "cluster-token-123")
    spec = DeploymentSpec.model_validate({"kind": "Deployment", "name": "m", "model": str(tmp_path)})
    return routing.PylonRouter(None, spec.model_dump(mode="json"))


def _call(app, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_the_router_answers_only_the_key_haproxy_is_given(router):
    from pylon.infra.haproxy import ROUTER_KEY_HEADER, router_key

    app = router.__serve_build_asgi_app__()
    key = router_key()
    assert key and key == router_key("cluster-token-123") and "cluster-token-123" not in key
    assert router_key("another-cluster") != key
    for method, path in [("GET", "/"), ("GET", "/health"), ("POST", "/internal/route")]:
        status, body = _call(app, method, path)
        assert status == 401 and ROUTER_KEY_HEADER in body["error"], (path, body)
        assert _call(app, method, path, {ROUTER_KEY_HEADER: "0" * 64})[0] == 401
    assert _call(app, "GET", "/health", {ROUTER_KEY_HEADER: key}) == (200, {"status": "ok"})
    assert _call(app, "GET", "/v1/models", {ROUTER_KEY_HEADER: key})[0] == 404


def test_haproxy_sends_the_router_key_from_a_keyed_copy_of_rays_lua(tmp_path: Path, monkeypatch):
    """pylon-haproxy's copy of Ray's config loads a copy of Ray's router script with the key header added."""
    import ray.serve._private as serve_private

    from pylon.infra import haproxy

    template = (Path(serve_private.__file__).parent / "ingress_request_router.lua.tmpl").read_text()
    lua = tmp_path / "ingress_request_router.lua"
    lua.write_text(template)
    config = tmp_path / "haproxy.cfg"
    config.write_text(f"global\n    lua-load-per-thread {lua}\nlisten stats\n  bind *:8404\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "cluster-token-123")
    out = Path(haproxy._rewrite(str(config), "127.0.0.1")).read_text()
    assert f"lua-load-per-thread {lua}.pylon\n" in out and "bind 127.0.0.1:8404" in out
    keyed = Path(f"{lua}.pylon").read_text()
    assert f'"{haproxy.ROUTER_KEY_HEADER}: {haproxy.router_key()}\\r\\n"' in keyed
    assert keyed.replace(f'\n        .. "{haproxy.ROUTER_KEY_HEADER}: {haproxy.router_key()}\\r\\n"', "") == template
    assert Path(f"{lua}.pylon").stat().st_mode & 0o077 == 0  # the key is for HAProxy's eyes
    with pytest.raises(SystemExit, match="Connection header"):
        haproxy.keyed_lua(template.replace("Connection: close", "Connection: keep-alive"), "k")


def test_a_batch_of_prompts_routes_by_the_blocks_they_all_start_with():
    """A completions batch (few-shot questions on one preamble, an evaluation's shared context) is keyed by the blocks
    every prompt of it starts with: what its engine requests will reuse. Prompts that share nothing route by load."""
    tok = ByteTokenizer()
    preamble = "Q: what is 2 + 2?\nA: 4\n" * 4
    first, second = preamble + "Q: 3 + 3 is what, in words?\nA:", preamble + "Q: 5 + 1 is what, in words?\nA:"
    a, b = _key(first).hashes, _key(second).hashes
    common = next(n for n in range(min(len(a), len(b)) + 1) if n == min(len(a), len(b)) or a[n] != b[n])
    assert common >= len(preamble) // BLOCK and common < len(a)  # the preamble's blocks, not the questions'
    batch = routing_key(tok, BLOCK, {"model": "m", "prompt": [first, second]})
    assert batch.hashes == a[:common]
    ids = [tok.encode(first), tok.encode(second)]
    ids = [i.tolist() if hasattr(i, "tolist") else list(i) for i in ids]
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": ids}).hashes == a[:common]  # token-id lists alike
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": [first]}).hashes == a  # a batch of one is that prompt
    assert routing_key(tok, BLOCK, {"model": "m", "prompt": ["x" * 80, "y" * 80]}).hashes == ()


def test_a_continued_response_goes_back_to_the_replica_that_made_it():
    """A response's id names the replica that made it (a tag of its Serve replica id); a Responses request continuing
    it (previous_response_id) goes there, before any prefix holder, unless that replica is busy or gone."""
    tag = routing.replica_tag("r1")
    made = routing.response_id(tag)
    assert routing.response_replica(made) == tag and valid_id(made)
    plain = routing.response_id("")
    assert routing.response_replica(plain) == "" and valid_id(plain)
    assert routing.response_replica("resp_p" + "0" * 8) == "" and routing.response_replica(None) == ""
    body = {"model": "m", "previous_response_id": made, "input": "and then? " * 20}
    key = routing_key(ByteTokenizer(), BLOCK, body)
    assert key.replica == tag and key.hashes  # the new input's blocks too, for when the maker cannot take it
    assert routing_key(ByteTokenizer(), BLOCK, {"model": "m", "input": "hi " * 40}).replica == ""
    views, now = _views(3), 1000.0
    views["r2"].blocks = frozenset(key.hashes)  # another replica holds the new input's every block
    order, why = choose(views, key, now, random.Random(0))
    assert (order[0], why) == ("r1", "response")
    views["r1"].ongoing = 4  # busy: the prefix holder, then by load
    order, why = choose(views, key, now, random.Random(0))
    assert (order, why) == (["r2", "r0", "r1"], f"prefix:{len(key.hashes)}")
    del views["r1"]  # gone (a replica replaced)
    assert choose(views, key, now, random.Random(0))[1].startswith("prefix:")
