"""Session-wide fixtures: one real S3-protocol server (moto) on loopback, shared by every s3:// test."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


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
