"""One real Ray cluster for the whole integration suite, started the way users start it."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from pylon.infra import local as cluster


@pytest.fixture(scope="session")
def pylon_home(tmp_path_factory) -> Iterator:
    """A private PYLON_HOME for the session, so tests never touch a user's ~/.pylon or cluster."""
    home = tmp_path_factory.mktemp("pylon-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYLON_HOME", str(home))
        env.delenv("RAY_ADDRESS", raising=False)
        # DeepSpeed's CPU ops are built once into the repository's ignored cache, and reused by workers.
        env.setenv(
            "TORCH_EXTENSIONS_DIR",
            os.environ.get("TORCH_EXTENSIONS_DIR")
            or str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"),
        )
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.delenv(name, raising=False)
        yield home


@pytest.fixture(scope="session")
def ray_cluster(s3_server, pylon_home) -> Iterator[cluster.LocalCluster]:
    """`pylon cluster up` for the session (started after the S3 server, so its workers see the endpoint)."""
    info, started = cluster.up(num_cpus=2, object_store_memory=512 * 2**20, home=pylon_home)
    assert started, "a cluster was already recorded in a fresh PYLON_HOME"
    try:
        yield info
    finally:
        cluster.down(home=pylon_home)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A small prepared dataset for training jobs: four of the standard library's modules as bytes, 64-token
    sequences (a module may define its own `corpus` instead)."""
    from pylon.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src = tmp_path_factory.mktemp("corpus-src")
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py"):
        (src / name).write_bytes((stdlib / name).read_bytes())
    out = str(tmp_path_factory.mktemp("corpus-data") / "corpus")
    prepare([str(src)], out, seq_len=64, use_ray=False, progress=False)
    return out
