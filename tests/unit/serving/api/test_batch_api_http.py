"""OpenAI's Files and Batch APIs on a deployment (`http.batch_store`, pylon.serving.api.batch_api), over real HTTP with
the official `openai` client: a file of requests uploaded, a batch of it answered in the background as the same bodies
POSTed are, its output and error files downloaded; a cancel; another key sees nothing of it; a deployment without a
store says which field to set."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests
from test_serving_http import KEY, auth, model_dir, server, serving  # noqa: F401 (fixtures)

from pylon.serving.api import batch_api
from pylon.serving.api.http import BATCH_CANCEL_PATH, BATCH_PATH, FILE_CONTENT_PATH, FILE_PATH, route_of


@pytest.fixture(scope="module")
def stored(model_dir, tmp_path_factory):  # noqa: F811
    """A server keeping files and batches in a directory (as it would in s3://...)."""
    store = tmp_path_factory.mktemp("batch-store")
    with serving(
        model_dir,
        http={"batch_store": str(store)},
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_tokens=4096,
        max_model_len=1024,
        separate_process=False,
    ) as (url, _):
        yield url, store


def _client(url: str, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _wait(client, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "failed"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def test_a_batch_of_an_uploaded_file_is_answered_as_its_bodies_posted(stored, tmp_path: Path) -> None:
    url, store = stored
    client = _client(url)
    bodies = [
        {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        {"model": "tiny", "prompt": "abc", "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2},
        {"model": "tiny", "prompt": "x", "temperature": -1},  # a 400: in the error file
    ]
    lines = [
        json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": b})
        for i, b in enumerate(bodies)
    ]
    lines.insert(1, "not json")
    lines.append(json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}))
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "requests.jsonl")
    assert uploaded.bytes == path.stat().st_size and uploaded.id.startswith("file-")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == path.read_bytes()
    assert uploaded.id in [f.id for f in client.files.list()]

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "nightly"}
    )
    assert batch.status in ("in_progress", "completed") and batch.request_counts.total == 5
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "nightly"}
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)
    assert done.completed_at >= done.created_at and batch.id in [b.id for b in client.batches.list()]
    answers = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    failures = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [a["custom_id"] for a in answers] == ["q0", "q1"]
    for answer, body in zip(answers, bodies):  # what the same body POSTed answers
        direct = requests.post(f"{url}/v1/completions", headers=auth(), json=body, timeout=60).json()
        assert [c["text"] for c in answer["response"]["body"]["choices"]] == [c["text"] for c in direct["choices"]]
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
    assert [(f["custom_id"], f["error"] and f["error"]["line"]) for f in failures] == [
        (None, "line 2"),
        ("q2", None),
        ("chat", "line 5"),
    ]
    assert failures[1]["response"]["status_code"] == 400
    assert failures[1]["response"]["body"]["error"]["param"] == "temperature"
    assert "url: the batch's endpoint '/v1/completions'" in failures[2]["error"]["message"]
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
    assert [f.id for f in client.files.list(purpose="batch")] == [uploaded.id]
    assert {f.id for f in client.files.list(purpose="batch_output")} == {done.output_file_id, done.error_file_id}
    newest_first = [f.id for f in client.files.list()]
    assert [f.id for f in client.files.list(order="asc")] == newest_first[::-1] and len(newest_first) == 3

    # another key's owner sees none of it
    other = _client(url, "sk-other")
    for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.retrieve(uploaded.id)):
        with pytest.raises(Exception) as e:
            call()
        assert getattr(e.value, "status_code", None) == 404
    assert list(other.batches.list()) == [] and list(other.files.list()) == []
    with pytest.raises(Exception) as e:  # an ended batch cannot be cancelled
        client.batches.cancel(batch.id)
    assert e.value.status_code == 400 and "has ended (completed)" in str(e.value)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(Exception) as e:
        client.files.retrieve(uploaded.id)
    assert e.value.status_code == 404


def test_a_cancelled_batch_keeps_what_it_answered(stored, tmp_path: Path) -> None:
    url, _ = stored
    client = _client(url)
    line = {"method": "POST", "url": "/v1/completions"}
    body = {"model": "tiny", "prompt": "long ", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({**line, "custom_id": f"l{i}", "body": body}) + "\n" for i in range(40)))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    time.sleep(1.0)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts.completed < 40
    if done.output_file_id is not None:
        kept = client.files.content(done.output_file_id).text.splitlines()
        assert len(kept) == done.request_counts.completed


def test_bad_uploads_and_batches_are_400s_naming_the_field(stored, server, tmp_path: Path) -> None:  # noqa: F811
    url, _ = stored
    client = _client(url)
    path = tmp_path / "r.jsonl"
    path.write_text("{}\n")
    with pytest.raises(Exception) as e:
        client.files.create(file=path.open("rb"), purpose="fine-tune")
    assert e.value.status_code == 400 and e.value.body["param"] == "purpose"
    r = requests.post(f"{url}/v1/files", headers=auth(), json={"file": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    for missing in ("file-nothere", "0", "../etc"):
        with pytest.raises(Exception) as e:
            client.batches.create(input_file_id=missing, endpoint="/v1/completions", completion_window="24h")
        assert e.value.status_code == 404 and f'no file "{missing}"' in str(e.value)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    blank = client.files.create(file=(tmp_path / "blank.jsonl").open("rb"), purpose="batch")
    with pytest.raises(Exception) as e:
        client.batches.create(input_file_id=blank.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.status_code == 400 and "holds no requests" in str(e.value)
    r = requests.post(
        f"{url}/v1/batches",
        headers=auth(),
        json={"input_file_id": "file-x", "endpoint": "/v1/images", "completion_window": "24h"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
    r = requests.get(f"{url}/v1/batches/../../etc", headers=auth(), timeout=30)
    assert r.status_code == 404
    r = requests.get(f"{url}/v1/batches/not_a_batch", headers=auth(), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "batch_id"
    r = requests.get(f"{url}/v1/batches?limit=0", headers=auth(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = requests.get(f"{server}/v1/batches", headers=auth(), timeout=30)  # a deployment that keeps none
    assert r.status_code == 400 and r.json()["error"]["param"] == "http.batch_store"
    r = requests.get(f"{url}/v1/batches", timeout=30)
    assert r.status_code == 401


def test_routes_and_a_batch_whose_replica_stopped() -> None:
    assert route_of("/v1/files/file-abc") == (FILE_PATH, "file-abc")
    assert route_of("/v1/files/file-abc/content") == (FILE_CONTENT_PATH, "file-abc")
    assert route_of("/v1/batches/batch_1") == (BATCH_PATH, "batch_1")
    assert route_of("/v1/batches/batch_1/cancel") == (BATCH_CANCEL_PATH, "batch_1")
    assert route_of("/v1/files") == ("/v1/files", None)
    batch = batch_api.new_batch("file-a", "/v1/completions", "24h", None, 3)
    assert batch_api.public(batch)["status"] == "in_progress" and "_heartbeat" not in batch_api.public(batch)
    assert batch_api.public(batch, cancelling_at=5)["status"] == "cancelling"
    batch["_heartbeat"] -= batch_api.STALE_S + 1
    stale = batch_api.public(batch)
    assert stale["status"] == "failed" and stale["errors"]["data"][0]["code"] == "replica_stopped"
