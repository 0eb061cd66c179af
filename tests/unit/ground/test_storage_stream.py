"""pylon.storage's streamed transfers (upload_file, download_file) and its one-write atomic_write, against a real
S3-protocol server (moto, in a process of its own so that its memory is not this process's) and local disk.

What a test counts is what the S3 client sends: botocore's `before-parameter-build` event for every operation, observed on the
very client storage uses."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pylon import storage
from pylon.errors import StorageError

MiB = 2**20
PART = 5 * MiB  # S3's smallest part

_SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()  # until the test process closes our stdin (or dies)
server.stop()
"""


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """moto's S3 server in a child process, the AWS environment pointing at it; yields a bucket name."""
    import boto3

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = server.stdout.readline().strip()
        assert endpoint.startswith("http://"), "moto's server did not start"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AWS_ENDPOINT_URL", endpoint)
            env.setenv("AWS_ACCESS_KEY_ID", "testing")
            env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_SESSION_TOKEN"):
                env.delenv(name, raising=False)
            boto3.client("s3").create_bucket(Bucket="pylon-stream")
            yield "pylon-stream"
    finally:
        server.stdin.close()
        server.wait(30)


@pytest.fixture
def s3_root(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:8]}"


class S3Calls:
    """The S3 operations storage's client sends while active, as (operation, key)."""

    def __init__(self, uri: str):
        self.fs, _ = storage.resolve(uri)
        self.calls: list[tuple[str, str]] = []

    def _record(self, model, params, **kwargs) -> None:
        self.calls.append((model.name, params.get("Key", "")))

    def __enter__(self) -> S3Calls:
        self.fs.connect()  # the client exists from here on
        self.fs.s3.meta.events.register("before-parameter-build.s3", self._record)
        return self

    def __exit__(self, *exc) -> None:
        self.fs.s3.meta.events.unregister("before-parameter-build.s3", self._record)

    def operations(self) -> list[str]:
        return [op for op, _ in self.calls]


def _write_random(path: Path, size: int, seed: int = 0) -> str:
    """`size` bytes of seeded noise at `path`, written 1 MiB at a time; returns their sha256."""
    import random

    rng, digest = random.Random(seed), hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = rng.randbytes(min(left, MiB))
            digest.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _raw_keys(root: str) -> list[str]:
    import boto3

    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(obj["Key"].removeprefix(prefix + "/") for obj in listing.get("Contents", []))


def _raw_read(uri: str) -> bytes:
    import boto3

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def test_upload_writes_each_object_once_at_its_final_key(s3_root: str, tmp_path: Path) -> None:
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small_sha = _write_random(small, PART - 1, seed=1)
    big_sha = _write_random(big, 2 * PART + 123, seed=2)  # three parts, the last one short
    with S3Calls(s3_root) as s3:
        assert storage.upload_file(small, storage.join(s3_root, "ds", "small.bin"), part_size=PART) == (
            small_sha,
            PART - 1,
        )
        assert storage.upload_file(big, storage.join(s3_root, "ds", "big.bin"), part_size=PART) == (
            big_sha,
            2 * PART + 123,
        )
        storage.atomic_write_json(storage.join(s3_root, "manifest.json"), {"step": 1})
    prefix = storage.resolve(s3_root)[1].partition("/")[2]
    assert s3.calls == [
        ("PutObject", f"{prefix}/ds/small.bin"),  # one part: one PUT
        ("CreateMultipartUpload", f"{prefix}/ds/big.bin"),  # more: one multipart upload, straight to the key
        ("UploadPart", f"{prefix}/ds/big.bin"),
        ("UploadPart", f"{prefix}/ds/big.bin"),
        ("UploadPart", f"{prefix}/ds/big.bin"),
        ("CompleteMultipartUpload", f"{prefix}/ds/big.bin"),
        ("PutObject", f"{prefix}/manifest.json"),  # small state: one PUT, no temporary key, copy or delete
    ]
    assert _raw_keys(s3_root) == ["ds/big.bin", "ds/small.bin", "manifest.json"]
    assert hashlib.sha256(_raw_read(storage.join(s3_root, "ds", "big.bin"))).hexdigest() == big_sha


def test_part_size_is_the_part_size_of_the_multipart_upload(s3_root: str, tmp_path: Path) -> None:
    import boto3

    src = tmp_path / "f.bin"
    _write_random(src, 3 * PART + 7)
    storage.upload_file(src, storage.join(s3_root, "f.bin"), part_size=PART)
    bucket, _, key = storage.join(s3_root, "f.bin").removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    sizes = [client.head_object(Bucket=bucket, Key=key, PartNumber=n)["ContentLength"] for n in (1, 2, 3, 4)]
    assert sizes == [PART, PART, PART, 7]
    with pytest.raises(ValueError, match="part_size"):
        storage.upload_file(src, storage.join(s3_root, "g.bin"), part_size=PART - 1)  # S3 would refuse the parts


def test_failed_multipart_upload_is_aborted_and_leaves_no_object(
    s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    monkeypatch.setenv("PYLON_STORAGE_RETRY_S", "0")  # no retries: the first failure is the answer

    src = tmp_path / "f.bin"
    sha = _write_random(src, 3 * PART)
    uri = storage.join(s3_root, "ds", "f.bin")
    fs, _ = storage.resolve(uri)
    sent = []

    def fail_second_part(model, **kwargs) -> None:  # the connection dropping mid-upload, as the client sees it
        sent.append(model.name)
        if sent.count("UploadPart") == 2:
            raise ConnectionResetError(104, "connection reset by peer (injected)")

    with S3Calls(s3_root):
        fs.s3.meta.events.register("before-call.s3.UploadPart", fail_second_part)
        try:
            with pytest.raises(StorageError, match=r"ds/f\.bin.*cannot write.*injected"):
                storage.upload_file(src, uri, part_size=PART)
        finally:
            fs.s3.meta.events.unregister("before-call.s3.UploadPart", fail_second_part)
    assert _raw_keys(s3_root) == []
    bucket = s3_root.removeprefix("s3://").partition("/")[0]
    assert boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    # With retries (the default), the same failure costs one more multipart upload, and the failed one is aborted.
    monkeypatch.delenv("PYLON_STORAGE_RETRY_S")
    sent.clear()
    with S3Calls(s3_root) as s3:
        fs.s3.meta.events.register("before-call.s3.UploadPart", fail_second_part)
        try:
            assert storage.upload_file(src, uri, part_size=PART) == (sha, 3 * PART)
        finally:
            fs.s3.meta.events.unregister("before-call.s3.UploadPart", fail_second_part)
    assert s3.operations().count("CreateMultipartUpload") == 2 and "AbortMultipartUpload" in s3.operations()
    assert _raw_keys(s3_root) == ["ds/f.bin"]
    assert boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_download_streams_verifies_and_refuses_a_wrong_checksum(s3_root: str, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    sha = _write_random(src, 2 * PART + 5)
    uri = storage.join(s3_root, "ds", "f.bin")
    storage.upload_file(src, uri, part_size=PART)
    out = tmp_path / "out" / "f.bin"
    out.parent.mkdir()
    with S3Calls(s3_root) as s3:
        assert storage.download_file(uri, out, part_size=PART, expect_sha256=sha) == (sha, 2 * PART + 5)
    assert s3.operations() == ["GetObject"]  # one streamed GET
    assert out.read_bytes() == src.read_bytes()

    again = tmp_path / "out" / "g.bin"
    with pytest.raises(StorageError) as err:
        storage.download_file(uri, again, part_size=PART, expect_sha256="0" * 64)
    assert str(err.value).startswith(f"{uri}: corrupt: {2 * PART + 5} bytes with sha256 {sha}, expected sha256 0000")
    assert sorted(os.listdir(out.parent)) == ["f.bin"], "a refused download leaves no file, and no temporary one"

    with pytest.raises(StorageError, match=r"missing\.bin: no such file"):
        storage.download_file(storage.join(s3_root, "missing.bin"), tmp_path / "m.bin")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_and_checksum_on_local_disk_and_memory(where: str, tmp_path: Path) -> None:
    root = str(tmp_path / "root") if where == "local" else f"memory://stream-{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src.bin"
    sha = _write_random(src, 3 * MiB + 1)
    uri = storage.join(root, "a", "f.bin")
    assert storage.upload_file(src, uri, part_size=MiB) == (sha, 3 * MiB + 1)
    assert storage.read_bytes(uri) == src.read_bytes()
    assert storage.listdir(storage.join(root, "a")) == ["f.bin"]
    if where == "local":
        assert os.listdir(tmp_path / "root" / "a") == ["f.bin"], "no temporary file left beside it"
    out = tmp_path / "out.bin"
    assert storage.download_file(uri, out, part_size=MiB, expect_sha256=sha) == (sha, 3 * MiB + 1)
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(StorageError, match="corrupt"):
        storage.download_file(uri, tmp_path / "bad.bin", part_size=MiB, expect_sha256=hashlib.sha256(b"").hexdigest())
    assert not (tmp_path / "bad.bin").exists()
    if where == "memory":
        storage.remove(root, recursive=True)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_memory_stays_bounded_by_two_parts_for_a_file_of_many(where: str, request, tmp_path: Path, peak_bytes) -> None:
    root = request.getfixturevalue("s3_root") if where == "s3" else str(tmp_path / "root")
    src = tmp_path / "big.bin"
    sha = _write_random(src, 8 * PART + 99)  # nine parts
    # Warm up first: the client's first requests load botocore's service model (megabytes, once per process).
    warm = tmp_path / "warm.bin"
    _write_random(warm, PART + 1)
    storage.upload_file(warm, storage.join(root, "warm.bin"), part_size=PART)
    storage.download_file(storage.join(root, "warm.bin"), tmp_path / "warm.out", part_size=PART)

    uri = storage.join(root, "big.bin")
    up = peak_bytes(lambda: storage.upload_file(src, uri, part_size=PART))
    out = tmp_path / "big.out"
    down = peak_bytes(lambda: storage.download_file(uri, out, part_size=PART, expect_sha256=sha))
    # Whole-file buffers would be 40 MiB; the target is at most two parts (10 MiB): an upload to S3 holds no part
    # (each is read from the file as it is sent), a download one (two halves), plus the HTTP client's buffers.
    print(f"peak Python allocations: upload {up / MiB:.2f} MiB, download {down / MiB:.2f} MiB (part {PART / MiB} MiB)")
    assert up < 2 * PART, f"upload peaked at {up / MiB:.1f} MiB of Python allocations"
    assert down < 2 * PART, f"download peaked at {down / MiB:.1f} MiB of Python allocations"
