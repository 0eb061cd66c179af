"""pylon.storage on local disk and memory://: resolution, name safety, atomic writes, error messages."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from pylon import storage
from pylon.errors import StorageError


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://unit-{uuid.uuid4().hex[:8]}"
    yield root
    fs, path = storage.resolve(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_resolve_plain_absolute_path(tmp_path: Path) -> None:
    fs, path = storage.resolve(str(tmp_path / "a.json"))
    assert isinstance(fs, LocalFileSystem)
    assert path == str(tmp_path / "a.json")


def test_resolve_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, path = storage.resolve("runs/x")
    assert isinstance(fs, LocalFileSystem)
    assert path == str(tmp_path / "runs" / "x")


def test_resolve_file_uri(tmp_path: Path) -> None:
    fs, path = storage.resolve(f"file://{tmp_path}/b/")
    assert isinstance(fs, LocalFileSystem)
    assert path == str(tmp_path / "b")


def test_resolve_memory_uri() -> None:
    fs, path = storage.resolve("memory://some/where/")
    assert isinstance(fs, MemoryFileSystem)
    assert path == "/some/where"


def test_resolve_s3_uri_uses_endpoint_and_region_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # No request is made: only the instance's settings are checked.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    fs, path = storage.resolve("s3://bucket-a/runs/x/")
    assert path == "bucket-a/runs/x"
    assert fs.client_kwargs == {"endpoint_url": "http://127.0.0.1:10", "region_name": "eu-west-3"}
    assert storage.describe("s3://bucket-a/runs/x") == "s3://bucket-a/runs/x (endpoint http://127.0.0.1:10)"

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_REGION")
    fs2, _ = storage.resolve("s3://bucket-a/runs/x")
    assert fs2 is not fs  # fsspec's instance cache keys on the endpoint
    assert fs2.client_kwargs == {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-2"}
    assert storage.resolve("s3://bucket-a/other")[0] is fs2


@pytest.mark.parametrize("uri", ["gs://bucket/x", "http://host/x", "hdfs://nn/x"])
def test_resolve_unknown_scheme_names_uri_and_supported_schemes(uri: str) -> None:
    with pytest.raises(StorageError) as err:
        storage.resolve(uri)
    assert uri in str(err.value)
    for scheme in ("file://", "s3://", "memory://"):
        assert scheme in str(err.value)


def test_resolve_s3_without_bucket_is_refused() -> None:
    with pytest.raises(StorageError, match="needs a bucket"):
        storage.resolve("s3:///key")


def test_describe_never_shows_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-xyz")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE123")
    text = storage.describe("s3://bucket-a/k") + repr(storage.resolve("s3://bucket-a/k")[0])
    assert "s3cr3t-value-xyz" not in text and "AKIDEXAMPLE123" not in text
    assert storage.describe("memory://a/b") == "memory:///a/b"


def test_join_keeps_scheme_and_nests_names() -> None:
    assert storage.join("s3://b/runs", "x") == "s3://b/runs/x"
    assert storage.join("s3://b/runs/", "x", "ckpt-10/model.pt") == "s3://b/runs/x/ckpt-10/model.pt"
    assert storage.join("/data/root", "a") == "/data/root/a"
    assert storage.join("memory://", "a") == "memory://a"
    assert storage.join("runs") == "runs"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "empty name"),
        ("/etc/passwd", "absolute"),
        ("..", "'..'"),
        ("a/../../b", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty path component"),
        ("a/", "empty path component"),
        ("a\\..\\b", "backslash"),
        ("a\x00b", "NUL"),
    ],
)
def test_join_refuses_names_that_could_escape_the_root(name: str, problem: str) -> None:
    with pytest.raises(StorageError) as err:
        storage.join("s3://b/runs", "ok", name)
    assert repr(name) in str(err.value)
    assert problem in str(err.value)


def test_atomic_write_local_content_and_no_temp_left(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "state.json"
    storage.atomic_write_json(str(target), {"step": 3, "a": [1, 2]})
    assert target.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "step": 3\n}\n'
    storage.atomic_write(str(target), b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["state.json"]
    assert storage.read_bytes(str(target)) == b"second"


def test_atomic_write_memory_content_and_no_temp_left(memory_root: str) -> None:
    uri = storage.join(memory_root, "a", "b.txt")
    storage.atomic_write_text(uri, "héllo")
    storage.atomic_write_text(uri, "héllo again")
    assert storage.read_text(uri) == "héllo again"
    fs, path = storage.resolve(storage.join(memory_root, "a"))
    assert fs.ls(path, detail=False) == [path + "/b.txt"]


def test_failed_json_serialization_leaves_old_content(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    storage.atomic_write_json(str(target), {"ok": True})
    with pytest.raises(StorageError, match="state.json"):
        storage.atomic_write_json(str(target), {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": True}
    assert os.listdir(tmp_path) == ["state.json"]


def test_failed_local_commit_leaves_old_content_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.bin"
    storage.atomic_write(str(target), b"old")

    def failing_replace(src: str, dst: str) -> None:
        assert Path(src).read_bytes() == b"new"  # the temp was fully written beside the target
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.os, "replace", failing_replace)
    with pytest.raises(StorageError, match="No space left"):
        storage.atomic_write(str(target), b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]


def test_object_write_is_one_direct_write_and_a_failed_one_leaves_old_content(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = storage.join(memory_root, "state.bin")
    storage.atomic_write(uri, b"old")
    fs, path = storage.resolve(uri)
    calls = []

    def spy(name: str):
        real = getattr(fs, name)

        def call(*args: object, **kwargs: object) -> object:
            calls.append((name, args[0]))
            return real(*args, **kwargs)

        return call

    for name in ("pipe_file", "cp_file", "mv", "rm_file"):
        monkeypatch.setattr(fs, name, spy(name))
    storage.atomic_write(uri, b"new")
    assert calls == [("pipe_file", path)], "an object store makes a PUT visible whole: no temporary key, no copy"
    assert storage.read_bytes(uri) == b"new"

    def failing_put(path: str, data: bytes, **kwargs: object) -> None:
        raise OSError(5, "put failed")

    monkeypatch.setattr(fs, "pipe_file", failing_put)
    with pytest.raises(StorageError, match="put failed"):
        storage.atomic_write(uri, b"newer")
    monkeypatch.undo()
    assert storage.read_bytes(uri) == b"new"
    assert fs.ls(storage.resolve(memory_root)[1], detail=False) == [path]


def test_listdir_sorted_names_hides_temps_and_missing_is_empty(tmp_path: Path) -> None:
    for name in ("b", "a", "c/d"):
        storage.atomic_write(storage.join(str(tmp_path), name), b"x")
    (tmp_path / f".a.tmp-{uuid.uuid4().hex}").write_bytes(b"in flight")
    assert storage.listdir(str(tmp_path)) == ["a", "b", "c"]
    assert storage.listdir(str(tmp_path / "missing")) == []
    with pytest.raises(StorageError, match="not a directory"):
        storage.listdir(str(tmp_path / "a"))


def test_exists_and_remove(tmp_path: Path, memory_root: str) -> None:
    for root in (str(tmp_path), memory_root):
        file_uri, dir_uri = storage.join(root, "d", "f"), storage.join(root, "d")
        storage.atomic_write(file_uri, b"x")
        assert storage.exists(file_uri) and storage.exists(dir_uri)
        with pytest.raises(StorageError, match="recursive=True"):
            storage.remove(dir_uri)
        storage.remove(file_uri)
        assert not storage.exists(file_uri)
        storage.atomic_write(file_uri, b"x")
        storage.remove(dir_uri, recursive=True)
        assert not storage.exists(dir_uri)
        with pytest.raises(StorageError, match="no such file"):
            storage.remove(dir_uri)


def test_missing_file_error_names_uri(tmp_path: Path, memory_root: str) -> None:
    for uri in (str(tmp_path / "nope.json"), storage.join(memory_root, "nope.json")):
        with pytest.raises(StorageError) as err:
            storage.read_json(uri)
        assert str(err.value) == f"{uri}: no such file or directory"
        assert isinstance(err.value.__cause__, FileNotFoundError)


def test_corrupt_json_error_names_uri_line_and_column(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text('{\n  "a": 1,\n  "b": oops\n}\n')
    with pytest.raises(StorageError) as err:
        storage.read_json(str(target))
    assert str(err.value).startswith(f"{target}: not valid JSON: line 3, column 8")


def test_not_utf8_text_error_names_uri(tmp_path: Path) -> None:
    target = tmp_path / "t.txt"
    target.write_bytes(b"ok\xff")
    with pytest.raises(StorageError, match=r"t\.txt: not UTF-8 text \(byte 2\)"):
        storage.read_text(str(target))
