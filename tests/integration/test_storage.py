"""pylon.storage against a real S3-protocol server (moto) and local disk, with the same assertions."""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import pytest

from pylon import storage
from pylon.errors import StorageError

pytestmark = pytest.mark.integration


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_root")
    return str(tmp_path / "root")


def _raw_names(root_uri: str) -> list[str]:
    """Every object/file under `root_uri`, relative to it, as an independent client sees them."""
    if root_uri.startswith("s3://"):
        import boto3

        bucket, _, prefix = root_uri.removeprefix("s3://").partition("/")
        listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        return sorted(obj["Key"].removeprefix(prefix + "/") for obj in listing.get("Contents", []))
    return sorted(
        os.path.relpath(os.path.join(folder, name), root_uri)
        for folder, _, files in os.walk(root_uri)
        for name in files
    )


def _raw_read(uri: str) -> bytes:
    """The object's bytes through a client that shares nothing with pylon.storage."""
    if uri.startswith("s3://"):
        import boto3

        bucket, _, key = uri.removeprefix("s3://").partition("/")
        return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    with open(uri, "rb") as f:
        return f.read()


def _raw_write(uri: str, data: bytes) -> None:
    """Write as another process would (a Ray worker, another tool): not through pylon.storage."""
    if uri.startswith("s3://"):
        import boto3

        bucket, _, key = uri.removeprefix("s3://").partition("/")
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data)
        return
    os.makedirs(os.path.dirname(uri), exist_ok=True)
    with open(uri, "wb") as f:
        f.write(data)


def test_bytes_round_trip_and_overwrite(root: str) -> None:
    uri = storage.join(root, "blob.bin")
    payload = bytes(range(256)) * 40
    storage.atomic_write(uri, payload)
    assert storage.read_bytes(uri) == payload
    assert _raw_read(uri) == payload
    storage.atomic_write(uri, b"shorter")
    assert storage.read_bytes(uri) == b"shorter"
    assert _raw_read(uri) == b"shorter"
    assert _raw_names(root) == ["blob.bin"]


def test_json_round_trip_is_sorted_and_indented(root: str) -> None:
    uri = storage.join(root, "runs", "r1", "manifest.json")
    manifest = {"step": 200, "shards": ["a", "b"], "meta": {"z": 1, "a": None}}
    storage.atomic_write_json(uri, manifest)
    assert storage.read_json(uri) == manifest
    raw = _raw_read(uri).decode()
    assert raw == json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    assert raw.index('"meta"') < raw.index('"shards"') < raw.index('"step"')


def test_nested_keys_listdir_and_no_temp_left(root: str) -> None:
    for name in ("ckpt-200/rank0.pt", "ckpt-100/rank0.pt", "ckpt-100/rank1.pt", "latest.json"):
        storage.atomic_write(storage.join(root, name), name.encode())
    assert storage.listdir(root) == ["ckpt-100", "ckpt-200", "latest.json"]
    assert storage.listdir(storage.join(root, "ckpt-100")) == ["rank0.pt", "rank1.pt"]
    assert storage.listdir(storage.join(root, "never-written")) == []
    assert _raw_names(root) == ["ckpt-100/rank0.pt", "ckpt-100/rank1.pt", "ckpt-200/rank0.pt", "latest.json"]
    assert _raw_read(storage.join(root, "ckpt-100/rank1.pt")) == b"ckpt-100/rank1.pt"


def test_sees_what_other_writers_wrote_after_a_listing(root: str) -> None:
    storage.atomic_write(storage.join(root, "ckpt-1", "done"), b"1")
    assert storage.listdir(root) == ["ckpt-1"]
    assert not storage.exists(storage.join(root, "ckpt-2", "done"))
    _raw_write(storage.join(root, "ckpt-2", "done"), b"2")  # e.g. another worker committing
    assert storage.listdir(root) == ["ckpt-1", "ckpt-2"]
    assert storage.exists(storage.join(root, "ckpt-2", "done"))
    assert storage.read_bytes(storage.join(root, "ckpt-2", "done")) == b"2"


def test_exists_and_remove(root: str) -> None:
    file_uri = storage.join(root, "d", "f.txt")
    assert not storage.exists(file_uri)
    storage.atomic_write_text(file_uri, "x")
    storage.atomic_write_text(storage.join(root, "d", "g.txt"), "y")
    assert storage.exists(file_uri) and storage.exists(storage.join(root, "d"))
    storage.remove(file_uri)
    assert not storage.exists(file_uri)
    assert _raw_names(root) == ["d/g.txt"]
    with pytest.raises(StorageError, match="recursive=True"):
        storage.remove(storage.join(root, "d"))
    storage.remove(storage.join(root, "d"), recursive=True)
    assert _raw_names(root) == []
    assert not storage.exists(storage.join(root, "d"))
    with pytest.raises(StorageError, match="no such file"):
        storage.remove(file_uri)


def test_missing_file_error_names_uri(root: str) -> None:
    uri = storage.join(root, "absent.json")
    with pytest.raises(StorageError) as err:
        storage.read_json(uri)
    assert str(err.value) == f"{uri}: no such file or directory"


def test_corrupt_json_error_names_uri(root: str) -> None:
    uri = storage.join(root, "broken.json")
    storage.atomic_write(uri, b'{"a": 1,}')
    with pytest.raises(StorageError, match=r"broken\.json: not valid JSON: line 1, column 9"):
        storage.read_json(uri)


def test_failed_commit_keeps_old_content_and_leaves_no_temp(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = storage.join(root, "state.json")
    storage.atomic_write_json(uri, {"step": 1})
    with pytest.raises(StorageError, match="state.json"):
        storage.atomic_write_json(uri, {"step": object()})
    # Fail the commit itself: the PUT of the object (S3), the rename of the fully written temporary file (local).
    fs, _ = storage.resolve(uri)
    if root.startswith("s3://"):
        monkeypatch.setattr(fs, "pipe_file", _fail_commit)
    else:
        monkeypatch.setattr(storage.os, "replace", _fail_commit)
    with pytest.raises(StorageError, match="injected commit failure"):
        storage.atomic_write_json(uri, {"step": 2})
    monkeypatch.undo()
    assert json.loads(_raw_read(uri)) == {"step": 1}
    assert _raw_names(root) == ["state.json"]


def _fail_commit(*args: object, **kwargs: object) -> None:
    raise OSError(5, "injected commit failure")


def test_resolve_follows_endpoint_env(s3_server, s3_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = storage.join(s3_root, "a.txt")
    storage.atomic_write(uri, b"via moto")
    fs, _ = storage.resolve(uri)
    assert fs.client_kwargs["endpoint_url"] == s3_server.endpoint_url
    assert storage.resolve(uri)[0] is fs  # same environment, same cached instance
    assert s3_server.endpoint_url in storage.describe(uri)

    # AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL: pointing it elsewhere must fail...
    closed = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", closed)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no retry backoff against a port nobody listens on
    monkeypatch.setenv("PYLON_STORAGE_RETRY_S", "0")  # nor storage's retries of the refused connection
    with pytest.raises(StorageError, match=closed):
        storage.read_bytes(uri)
    # ...and removing it again must give back a working instance, the cached one.
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.delenv("PYLON_STORAGE_RETRY_S")
    assert storage.resolve(uri)[0] is fs
    assert storage.read_bytes(uri) == b"via moto"


def test_unreachable_endpoint_error_names_uri_endpoint_not_secret(
    s3_server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-value-xyz"
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    # One attempt each: the default (3, botocore's standard backoff) costs seconds per call, for nothing here.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("PYLON_STORAGE_RETRY_S", "0")  # and no retries of the refused connection by storage
    uri = storage.join(s3_root, "state.json")
    for operation in (storage.read_bytes, storage.exists, lambda u: storage.atomic_write(u, b"x")):
        with pytest.raises(StorageError) as err:
            operation(uri)
        message = str(err.value)
        assert uri in message and endpoint in message
        assert "AWS_ENDPOINT_URL" in message and "AWS_SECRET_ACCESS_KEY" in message
        whole_chain = "".join(traceback.format_exception(err.value))
        assert secret not in whole_chain


def _closed_port() -> int:
    """A loopback port with nothing listening (bound then released, so connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
