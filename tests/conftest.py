"""Session-wide fixtures: one real S3-protocol server (moto) on loopback, shared by every s3:// test."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pylon.ops import build_command, venv_tools_first

# The venv's bin first on PATH for this process and what it starts (see pylon.ops.venv_tools_first).
venv_tools_first()


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1, with the AWS environment pointing at it for the whole session."""
    # Imported here so that unit-only runs never pay for moto.
    import boto3
    from moto.server import ThreadedMotoServer

    # Port 0: the OS picks a free port at bind time, so there is no window for another process to take it.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint_url = f"http://{host}:{port}"
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request drowns failures
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AWS_ENDPOINT_URL", endpoint_url)
            env.setenv("AWS_ACCESS_KEY_ID", "testing")
            env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            env.setenv("AWS_DEFAULT_REGION", "us-east-1")
            for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_SESSION_TOKEN"):
                env.delenv(name, raising=False)
            bucket = "pylon-test"
            boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=bucket)
            yield S3Server(endpoint_url=endpoint_url, bucket=bucket)
    finally:
        server.stop()


@pytest.fixture
def s3_root(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh prefix in the session's bucket, unique to this test."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")
    return f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's async I/O op (NVMe offload) takes minutes of compiling on a fresh clone, and only the NVMe
# combinations of tests/integration/test_deepspeed_combinations.py need it. Building it at low priority from the
# start of the session lets it use the CPU the earlier tests leave idle (cluster start-ups, jobs polling),
# instead of stalling that module. The build writes where the tests load it from; a test that needs it before
# it is done waits on torch's build lock, as it would have built it itself.
# ---------------------------------------------------------------------------------------------------------


def pytest_sessionstart(session) -> None:
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("PYLON_NO_OP_PREBUILD") or not any(
        "integration" in str(a) for a in session.config.args or ["integration"]
    ):
        return
    # NVMe tests are slow ones: without make test-all (or a -m selection) they are skipped, and nothing needs the op
    if os.environ.get("PYLON_ALL_TESTS") != "1" and not session.config.getoption("markexpr", default=""):
        return
    cache = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
    )
    if (cache / "async_io" / "async_io.so").exists():
        return
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache))  # PATH: the venv's ninja first (venv_tools_first)
    session.config._pylon_prebuild = subprocess.Popen(
        ["nice", "-n", "15", *build_command("async_io")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def pytest_sessionfinish(session) -> None:
    build = getattr(session.config, "_pylon_prebuild", None)
    if build is not None:
        # Waited for, never killed: a build killed mid-way leaves torch's lock file, and every later load of
        # the op would wait on it forever.
        build.wait()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `slow` run with `make test-all` (PYLON_ALL_TESTS=1) or when selected with -m; `make test`
    (what CI runs, within its 30 minutes) skips them, saying so."""
    import os

    # NVMe offload needs DeepSpeed's async_io op, built in the background from the session's start (minutes):
    # its tests go last, when the build is done, instead of waiting for it in the middle of the session.
    items.sort(key=lambda item: "nvme" in item.nodeid or item.get_closest_marker("nvme") is not None)  # stable
    if os.environ.get("PYLON_ALL_TESTS") == "1" or config.getoption("markexpr", default=""):
        return
    skip = pytest.mark.skip(reason="slow: runs with `make test-all` (PYLON_ALL_TESTS=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def peak_bytes():
    """A function: tracemalloc's peak of Python allocations while `fn()` runs, above what was allocated before."""
    import tracemalloc

    def measure(fn) -> int:
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            fn()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak - before

    return measure
