"""Stored responses of the Responses API (`http.responses_store`, pylon.serving.api.response_store) through the official
`openai` client against a real uvicorn server: a response continued by `previous_response_id` is the reply to the
whole conversation sent at once (a chain of three, a streamed one, a tool loop), found again after a redeploy (a new
replica, a new salt for its keys, the same store), retrieved, listed and deleted by id, found only with the key that
made it, never stored with `store: false`; the stored files hold no key; bad ids and queries are 4xx naming them; a
store that cannot take a response leaves the reply whole, answered `store: false`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from test_responses_api import TOOLS
from test_serving_http import ADD, KEY, auth, model_dir, serving  # noqa: F401 (fixtures)

OTHER = "sk-other"  # the second key the test deployments accept


def _serve(model_dir, store: str, **http):  # noqa: F811
    return serving(
        model_dir,
        http={"responses_store": store, **http},
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_tokens=4096,
        max_model_len=1024,
        separate_process=False,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def server(model_dir, store):  # noqa: F811
    with _serve(model_dir, str(store)) as (url, _):
        yield url


def _client(url: str, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}


def test_a_continued_response_is_the_reply_to_the_whole_conversation(client):
    """Three turns by previous_response_id give, turn for turn, what the whole conversation sent as input gives (the
    first turn's instructions are not carried on, as OpenAI's are not); each reply says it is stored and what it
    continued."""
    first = client.responses.create(instructions="be brief", input="name a colour", **GREEDY)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(previous_response_id=first.id, input="another", **GREEDY)
    assert second.store is True and second.previous_response_id == first.id
    third = client.responses.create(
        previous_response_id=second.id, input=[{"role": "user", "content": "and a third"}], **GREEDY
    )
    whole = [
        {"role": "user", "content": "name a colour"},
        *first.output,
        {"role": "user", "content": "another"},
        *second.output,
        {"role": "user", "content": "and a third"},
    ]
    assert client.responses.create(input=whole[:3], store=False, **GREEDY).output_text == second.output_text
    sent_whole = client.responses.create(input=whole, store=False, **GREEDY)
    assert sent_whole.output_text == third.output_text
    assert sent_whole.usage.input_tokens == third.usage.input_tokens
    # The continuation's prompt starts with the stored conversation's tokens: the prefix cache holds them.
    assert third.usage.input_tokens_details.cached_tokens > 0
    # With new instructions, they lead the continued conversation in place of none.
    briefed = client.responses.create(previous_response_id=first.id, instructions="be brief", input="another", **GREEDY)
    again = client.responses.create(instructions="be brief", input=whole[:3], store=False, **GREEDY)
    assert (briefed.output_text, briefed.usage.input_tokens) == (again.output_text, again.usage.input_tokens)
    assert again.usage.input_tokens > second.usage.input_tokens  # the instructions count: they are there


def test_a_streamed_response_is_stored_as_its_completed_event_says(client):
    events = list(client.responses.create(input="tell me a story", stream=True, **GREEDY))
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and final.store is True
    kept = client.responses.retrieve(final.id)
    assert kept.output_text == final.output_text and kept.usage.output_tokens == final.usage.output_tokens
    follow = list(client.responses.create(previous_response_id=final.id, input="go on", stream=True, **GREEDY))
    whole = [{"role": "user", "content": "tell me a story"}, *final.output, {"role": "user", "content": "go on"}]
    sent = client.responses.create(input=whole, store=False, **GREEDY)
    assert follow[-1].response.output_text == sent.output_text
    assert follow[-1].response.usage.input_tokens == sent.usage.input_tokens  # the same prompt, token for token


def test_a_tool_loop_continues_by_id_with_only_the_calls_outputs(client):
    """The function_call items stay in the stored conversation: the next request sends only their outputs."""
    import jsonschema

    reply = client.responses.create(  # greedy: sampled, the random model may ramble past the budget inside the call
        model="tiny", input="what is 2 + 3?", tools=TOOLS, tool_choice="required", max_output_tokens=480, temperature=0
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls, reply.output
    outputs = []
    for call in calls:
        args = json.loads(call.arguments)
        jsonschema.validate(args, ADD)
        outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])})
    final = client.responses.create(
        previous_response_id=reply.id, input=outputs, tools=TOOLS, tool_choice="none", **GREEDY
    )
    whole = [{"role": "user", "content": "what is 2 + 3?"}, *reply.output, *outputs]
    sent = client.responses.create(input=whole, tools=TOOLS, tool_choice="none", store=False, **GREEDY)
    assert [item.type for item in final.output] == ["message"] and final.output_text == sent.output_text
    assert final.usage.input_tokens == sent.usage.input_tokens


def test_a_response_is_retrieved_listed_and_deleted_by_id(client, server):
    from openai import BadRequestError, NotFoundError

    items = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}]},
    ]
    reply = client.responses.create(input=items, metadata={"run": "7"}, **GREEDY)
    kept = client.responses.retrieve(reply.id)
    assert kept.model_dump() == reply.model_dump()
    listed = client.responses.input_items.list(reply.id)  # newest first, as OpenAI lists them
    texts = [item.content[0].text if isinstance(item.content, list) else item.content for item in listed.data]
    assert texts == ["three", "two", "one"] and all(item.id.startswith("msg_") for item in listed.data)
    page = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [item.id for item in listed.data[::-1][:2]] and page.has_more
    rest = client.responses.input_items.list(reply.id, order="asc", after=page.last_id)
    assert [item.id for item in rest.data] == [listed.data[0].id] and not rest.has_more
    for query, param in (("limit=0", "limit"), ("order=sideways", "order"), ("after=msg_nope", "after")):
        r = requests.get(f"{server}/v1/responses/{reply.id}/input_items?{query}", headers=auth(), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    client.responses.delete(reply.id)
    with pytest.raises(NotFoundError, match="no stored response"):
        client.responses.retrieve(reply.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(reply.id)
    with pytest.raises(BadRequestError, match="previous_response_id"):
        client.responses.create(previous_response_id=reply.id, input="more", **GREEDY)
    # A request that asks not to be stored is not.
    unkept = client.responses.create(input="hi", store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_response_is_found_only_with_the_key_that_made_it_and_the_store_holds_no_key(client, server, store):
    from openai import BadRequestError, NotFoundError

    reply = client.responses.create(input="a secret plan", **GREEDY)
    other = _client(server, OTHER)
    with pytest.raises(NotFoundError):
        other.responses.retrieve(reply.id)
    with pytest.raises(NotFoundError):
        other.responses.input_items.list(reply.id)
    with pytest.raises(NotFoundError):
        other.responses.delete(reply.id)
    with pytest.raises(BadRequestError, match="previous_response_id"):
        other.responses.create(previous_response_id=reply.id, input="more", **GREEDY)
    assert client.responses.retrieve(reply.id).id == reply.id  # still there for its owner
    r = requests.get(f"{server}/v1/responses/{reply.id}", timeout=30)
    assert r.status_code == 401 and KEY not in r.text
    files = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.name == f"{reply.id}.json" for p in files)
    for p in files:
        text = p.read_text()
        assert KEY not in text and OTHER not in text, p
    # A stored file that is not a stored response is a 503 (the store's fault), not a 500 or a reply without it.
    mine = next(p for p in files if p.name == f"{reply.id}.json")
    (mine.parent / "resp_corrupt.json").write_text("[]")
    r = requests.get(f"{server}/v1/responses/resp_corrupt", headers=auth(), timeout=30)
    assert r.status_code == 503 and "cannot be read" in r.json()["error"]["message"], r.text
    body = {"model": "tiny", "input": "more", "previous_response_id": "resp_corrupt"}
    r = requests.post(f"{server}/v1/responses", headers=auth(), json=body, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    # A path in an id never leaves the store: it names no route, or no response.
    for rid in ("..%2F..%2Fetc%2Fpasswd", "resp_x%2F..%2F..%2Fy", "resp_" + "a" * 65, "resp_..", "..", "resp_x.json"):
        r = requests.get(f"{server}/v1/responses/{rid}", headers=auth(), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (rid, r.text)


def test_a_response_continues_after_a_redeploy_on_another_replica(client, model_dir, store):  # noqa: F811
    """A new replica with the same store (and its keys hashed under a new salt, as every deploy does) continues a
    response the first one stored, and reads it."""
    reply = client.responses.create(input="name a colour", **GREEDY)
    with _serve(model_dir, str(store)) as (url, _):
        other = _client(url)
        assert other.responses.retrieve(reply.id).output_text == reply.output_text
        follow = other.responses.create(previous_response_id=reply.id, input="another", **GREEDY)
        whole = [{"role": "user", "content": "name a colour"}, *reply.output, {"role": "user", "content": "another"}]
        sent = other.responses.create(input=whole, store=False, **GREEDY)
        assert (follow.output_text, follow.usage.input_tokens) == (sent.output_text, sent.usage.input_tokens)


def test_a_store_that_cannot_take_a_response_leaves_the_reply_whole(model_dir, tmp_path, caplog):  # noqa: F811
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's directory should be")
    with _serve(model_dir, str(blocker / "responses")) as (url, _):
        client = _client(url)
        reply = client.responses.create(input="name a colour", **GREEDY)
        assert reply.store is False and reply.output_text is not None
        events = list(client.responses.create(input="name a colour", stream=True, **GREEDY))
        assert events[-1].type == "error" and "not stored" in events[-1].message
        assert events[-2].response.output_text == reply.output_text
    assert "not stored" in caplog.text and KEY not in caplog.text


def _polled(client, response, timeout_s: float = 60.0):
    """`response` retrieved until it is no longer queued or in progress."""
    import time

    deadline = time.monotonic() + timeout_s
    while response.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)
        response = client.responses.retrieve(response.id)
    return response


def test_a_background_response_is_polled_to_the_reply_and_continues(client):
    """background: true answers at once, queued; polled, it completes with the reply a waiting request gets, and a
    request continues from it."""
    queued = client.responses.create(input="name a colour", background=True, **GREEDY)
    assert queued.background and queued.status in ("queued", "in_progress") and not queued.output
    done = _polled(client, queued)
    waited = client.responses.create(input="name a colour", store=False, **GREEDY)
    assert done.status == waited.status == "incomplete" and done.output_text == waited.output_text  # 12 tokens
    assert done.usage.output_tokens == waited.usage.output_tokens
    follow = client.responses.create(previous_response_id=done.id, input="another", **GREEDY)
    whole = [{"role": "user", "content": "name a colour"}, *done.output, {"role": "user", "content": "another"}]
    sent = client.responses.create(input=whole, store=False, **GREEDY)
    assert (follow.output_text, follow.usage.input_tokens) == (sent.output_text, sent.usage.input_tokens)
    assert [i.id for i in client.responses.input_items.list(done.id).data] == [
        queued_item.id for queued_item in client.responses.input_items.list(queued.id).data
    ]


def test_a_background_response_cancelled_on_another_replica_stops_and_stays_so(client, model_dir, store):  # noqa: F811
    """A cancel stored by another replica (the same store) stops the replica that runs the response within its next
    look at the store, and what it had computed is not stored over the cancel."""
    import time

    with _serve(model_dir, str(store)) as (url, _):  # the other replica up first: the cancel follows the create
        queued = client.responses.create(
            input="write at length", background=True, **{**GREEDY, "max_output_tokens": 900}
        )
        assert _client(url).responses.cancel(queued.id).status == "cancelled"
    time.sleep(2.5)
    assert client.responses.retrieve(queued.id).status == "cancelled"


def test_a_background_response_is_cancelled_and_stays_so(model_dir, tmp_path):  # noqa: F811
    import time

    with _serve(model_dir, str(tmp_path)) as (server, replica):
        # Each engine step made to take 20 ms more: 900 tokens take 18 s, so the answer is still running when the
        # cancel comes, however loaded the machine is.
        engine, step = replica.engine.engine, replica.engine.engine.step
        engine.step = lambda: (time.sleep(0.02), step())[1]
        client = _client(server)
        long = {**GREEDY, "max_output_tokens": 900}
        queued = client.responses.create(input="write at length", background=True, **long)
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and not cancelled.output
        time.sleep(2.5)  # past the running task's look at the store
        assert client.responses.retrieve(queued.id).status == "cancelled"
        assert client.responses.cancel(queued.id).status == "cancelled"  # again: itself
        engine.step = step
        done = _polled(client, client.responses.create(input="hi", background=True, **GREEDY))
        for response_id, says in (
            (done.id, "has ended (incomplete)"),
            (client.responses.create(input="hi", **GREEDY).id, "background: true"),
        ):
            r = requests.post(f"{server}/v1/responses/{response_id}/cancel", headers=auth(), timeout=30)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        r = requests.post(f"{server}/v1/responses/resp_unknown/cancel", headers=auth(), timeout=30)
        assert r.status_code == 404, r.text


def test_a_background_response_past_its_time_fails_and_one_whose_replica_stopped_reads_failed(model_dir, tmp_path):  # noqa: F811
    """http.background_timeout_s ends a background response failed, its engine request aborted; a record left
    queued by a replica that stopped reads failed once that time (and a minute) has passed."""
    import time

    with _serve(model_dir, str(tmp_path), background_timeout_s=0.05) as (url, replica):
        # Each engine step made to take 20 ms more, so that 900 tokens take 18 s however loaded the machine is: on a
        # busy one the tiny model's whole answer could otherwise be queued before the server's loop ran its timer.
        engine, step = replica.engine.engine, replica.engine.engine.step
        engine.step = lambda: (time.sleep(0.02), step())[1]
        client = _client(url)
        queued = client.responses.create(
            input="write at length", background=True, **{**GREEDY, "max_output_tokens": 900}
        )
        failed = _polled(client, queued)
        assert failed.status == "failed" and "background_timeout_s" in failed.error.message
        deadline = time.monotonic() + 10  # its engine request aborted (at the engine's next step)
        while replica.engine.stats().num_running:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A record as a replica that stopped leaves it: queued, started long ago.
        stopped = client.responses.create(input="hi", background=True, **GREEDY)
        _polled(client, stopped)
        (path,) = tmp_path.glob(f"*/{stopped.id}.json")
        record = json.loads(path.read_text())
        record["response"]["status"], record["started"] = "queued", 0
        path.write_text(json.dumps(record))
        again = client.responses.retrieve(stopped.id)
        assert again.status == "failed" and "stopped" in again.error.message


def test_background_refusals(client, server):
    for body, says in (
        ({"background": True, "stream": True}, "give one of stream and background"),
        ({"background": True, "store": False}, "needs store"),
    ):
        r = requests.post(
            f"{server}/v1/responses", json={"model": "tiny", "input": "hi", **body}, headers=auth(), timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        assert says in r.json()["error"]["message"]


def test_a_replica_that_stops_ends_its_background_responses_failed(model_dir, tmp_path):  # noqa: F811
    """A replica stopping (Serve calls its __del__ at a redeploy or a scale-down) stores its running background
    responses failed, so that a GET says so at once."""
    with _serve(model_dir, str(tmp_path)) as (url, replica):
        client = _client(url)
        queued = client.responses.create(
            input="write at length", background=True, **{**GREEDY, "max_output_tokens": 900}
        )
        replica._stop_background()
        stopped = client.responses.retrieve(queued.id)
        assert stopped.status == "failed" and "stopped" in stopped.error.message


def test_an_item_reference_names_an_item_of_the_continued_conversation(client, server):
    """input's item_reference items are the continued conversation's items by id, at their place in the input."""
    first = client.responses.create(input="name a colour", **GREEDY)
    said = first.output[0]
    follow = client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "item_reference", "id": said.id}, {"role": "user", "content": "again"}],
        **GREEDY,
    )
    whole = [{"role": "user", "content": "name a colour"}, said, said, {"role": "user", "content": "again"}]
    sent = client.responses.create(input=whole, store=False, **GREEDY)
    assert (follow.output_text, follow.usage.input_tokens) == (sent.output_text, sent.usage.input_tokens)
    body = {
        "model": "tiny",
        "previous_response_id": first.id,
        "input": [{"type": "item_reference", "id": "msg_nowhere"}],
    }
    r = requests.post(f"{server}/v1/responses", json=body, headers=auth(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.id", r.text
