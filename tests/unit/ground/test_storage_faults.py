"""pylon.storage against an object store that goes away: the session's S3-protocol server (moto) behind a
FaultProxy (tests/faults.py) that stalls, resets or drops connections for a while. Transient failures are retried
with backoff until PYLON_STORAGE_RETRY_S; after it, the StorageError names the URI; a retried multipart upload
never shows half an object; errors that retrying cannot cure fail at once. No Ray here: the same retries under a
training job are tests/integration/test_train_faults.py."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
from pathlib import Path

import faults
import pytest

from pylon import storage
from pylon.errors import StorageError

MiB = 2**20
PART = 5 * MiB


@pytest.fixture
def s3_proxy(s3_server, monkeypatch):
    with faults.proxied(s3_server.endpoint_url, monkeypatch) as proxy:
        yield proxy


@pytest.fixture
def root(s3_proxy, s3_server) -> str:
    return f"s3://{s3_server.bucket}/faults-{uuid.uuid4().hex[:8]}"


def _direct(s3_server):
    """A client of the server itself, not through the proxy: what another reader sees meanwhile."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.endpoint_url)


def _noise(path: Path, size: int) -> str:
    data = hashlib.sha256(b"seed").digest() * (size // 32 + 1)
    path.write_bytes(data[:size])
    return hashlib.sha256(data[:size]).hexdigest()


def test_an_outage_mid_multipart_upload_is_retried_and_never_shows_half_an_object(
    s3_proxy,
    s3_server,
    root,
    tmp_path,
    caplog,
):
    src = tmp_path / "shard.bin"
    sha = _noise(src, 3 * PART + 123)
    uri = storage.join(root, "ckpt", "shard.bin")
    bucket, key = s3_server.bucket, uri.removeprefix(f"s3://{s3_server.bucket}/")
    direct = _direct(s3_server)
    seen: list[int] = []  # sizes of the object as a reader of the server saw it while the upload ran
    uploading = threading.Event()

    def watch() -> None:
        while uploading.is_set():
            try:
                seen.append(direct.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except direct.exceptions.ClientError:
                pass
            time.sleep(0.02)

    # Reset every connection once the first part is on the wire, for 8 s: longer than botocore's and s3fs's own
    # retries last, so only storage's retries carry the upload through.
    outage = s3_proxy.when(lambda: s3_proxy.bytes_up > PART, "reset", 8)
    uploading.set()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="pylon.storage"):
            assert storage.upload_file(src, uri, part_size=PART) == (sha, 3 * PART + 123)
    finally:
        uploading.clear()
        watcher.join(5)
    assert outage.started_at is not None and s3_proxy.faulted > 0, "the outage never hit the upload"
    assert time.monotonic() - started >= 7
    assert "retrying in" in caplog.text and "cannot write" in caplog.text
    assert set(seen) <= {3 * PART + 123}, f"a reader saw a partial object: sizes {sorted(set(seen))}"
    body = direct.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == sha
    # The failed attempt's parts were aborted once the store answered again.
    uploads = direct.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert uploads == []


@pytest.mark.parametrize(  # (reset and stall: make test-all, ~13 s each on CI)
    "mode", [pytest.param("reset", marks=pytest.mark.slow), "drop", pytest.param("stall", marks=pytest.mark.slow)]
)
def test_reads_writes_and_downloads_outlast_an_outage(s3_proxy, root, tmp_path, monkeypatch, mode):
    monkeypatch.setenv("PYLON_STORAGE_TIMEOUT_S", "1")  # a stalled request times out after 1 s, then is retried
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no botocore retries: the retries that carry it through are storage's
    src = tmp_path / "f.bin"
    sha = _noise(src, PART + 7)
    uri, state = storage.join(root, "f.bin"), storage.join(root, "state.json")
    storage.upload_file(src, uri, part_size=PART)
    storage.atomic_write_json(state, {"step": 1})

    def outage(operation):
        s3_proxy.outage(mode, 4)
        started = time.monotonic()
        result = operation()
        assert time.monotonic() - started >= 3, "the outage did not delay the operation: it was not injected"
        return result

    assert outage(lambda: storage.read_json(state)) == {"step": 1}
    outage(lambda: storage.atomic_write_json(state, {"step": 2}))
    assert (
        outage(lambda: storage.download_file(uri, tmp_path / "copy.bin", part_size=PART, expect_sha256=sha))[0] == sha
    )
    assert storage.listdir(root) == ["f.bin", "state.json"]
    assert storage.read_json(state) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.bin", "f.bin"]  # no partial download left


def test_after_the_deadline_the_error_names_the_uri_and_how_long_it_retried(
    s3_proxy,
    root,
    monkeypatch,
):
    monkeypatch.setenv("PYLON_STORAGE_RETRY_S", "4")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # each attempt fails at once: the retries here are storage's
    s3_proxy.set("reset")
    uri = storage.join(root, "latest.json")
    with pytest.raises(StorageError) as err:
        storage.atomic_write_json(uri, {"step": 3})
    message = str(err.value)
    assert message.startswith(f"{uri} (endpoint {s3_proxy.url}): cannot write"), message
    # Attempts, not seconds: on a loaded machine one attempt may outlast the deadline by itself.
    assert re.search(
        r"still failing after \d+ attempts? over \d+s; PYLON_STORAGE_RETRY_S=4 bounds the retries", message
    )
    assert "testing" not in message  # never a credential


def test_what_retrying_cannot_cure_fails_at_once(s3_proxy, root):
    sent = len(s3_proxy.requests)
    with pytest.raises(StorageError, match=r"missing\.json: no such file or directory") as missing:
        storage.read_bytes(storage.join(root, "missing.json"))
    with pytest.raises(StorageError, match="no such bucket") as bucket:
        storage.read_bytes("s3://no-such-bucket-pylon/x.json")
    for err in (missing, bucket):  # not retried: no "still failing after N attempts"
        assert "still failing" not in str(err.value), err.value
    assert len(s3_proxy.requests) - sent <= 4, s3_proxy.requests[sent:]  # a request or two each, none again


def test_transient_errors_are_told_from_permanent_ones():
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert storage.is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert storage.is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert storage.is_transient(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert storage.is_transient(client_error("SlowDown", 503))
    assert storage.is_transient(client_error("InternalError", 500))
    wrapped = OSError(errno.EIO, "translated by s3fs")
    wrapped.__cause__ = client_error("ServiceUnavailable", 503)
    assert storage.is_transient(wrapped)
    assert not storage.is_transient(client_error("AccessDenied", 403))
    assert not storage.is_transient(client_error("NoSuchKey", 404))
    assert not storage.is_transient(FileNotFoundError("gone"))
    assert not storage.is_transient(OSError(errno.ENOSPC, "No space left on device"))
