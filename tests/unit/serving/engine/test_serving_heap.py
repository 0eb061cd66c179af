"""pylon.serving.engine.heap: an engine process reuses the memory its steps free instead of faulting in fresh pages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pylon.serving.engine import heap

# Activations of growing sizes (a step's rows vary from 16 to the token budget), each written and freed. glibc by
# default maps each block past its adaptive threshold afresh, which it then raises to that block's size: every
# larger block is new pages. Kept, a block reuses the heap's freed top and only its growth is new.
CHURN = r"""
import json, resource, sys, torch
from pylon.serving.engine import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(100):
    torch.empty((1 << 20) // 4 + i * 16384).fill_(1.0)  # 1 MB, then 64 KB more each time
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def churn(mode: str, env: dict | None = None) -> dict:
    import os

    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_are_reused_without_page_faults() -> None:
    kept, default = churn("keep"), churn("default")
    assert kept["kept"] is True
    # 100 blocks of 1-7.4 MB: ~105,000 pages if each is fresh, a few thousand if the heap is reused.
    assert kept["faults"] < 15_000, kept  # 2,400-5,500 measured: other allocations land between the blocks
    assert default["faults"] > 50_000, default


def test_turned_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.keep_freed_memory() is False
    assert churn("keep", {heap.ENV: "0"})["kept"] is False


def test_a_cpu_engine_process_starts_with_tcmalloc_preloaded(tmp_path, monkeypatch) -> None:
    """`engine_process_env`: TCMalloc first in LD_PRELOAD for a CPU engine (what was preloaded before stays, once),
    nothing for a CUDA engine, nothing with PYLON_TCMALLOC=0 or where it is not installed."""
    monkeypatch.delenv(heap.TCMALLOC_ENV, raising=False)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
    dirs = (str(tmp_path / "missing"), str(lib))
    path = str(lib / "libtcmalloc_minimal.so.4")
    assert heap.tcmalloc_path(dirs) == path
    env = heap.engine_process_env("cpu", {"PATH": "/bin"}, dirs=dirs)
    assert env == {"PATH": "/bin", "LD_PRELOAD": path}
    env = heap.engine_process_env("cpu", {"LD_PRELOAD": f"/x/libfoo.so {path}"}, dirs=dirs)
    assert env["LD_PRELOAD"] == f"{path}:/x/libfoo.so"
    assert heap.engine_process_env("cuda", {"PATH": "/bin"}, dirs=dirs) == {"PATH": "/bin"}
    assert heap.engine_process_env("cpu", {}, dirs=(str(tmp_path / "missing"),)) == {}
    monkeypatch.setenv(heap.TCMALLOC_ENV, "0")
    assert heap.tcmalloc_path(dirs) is None and heap.engine_process_env("cpu", {}, dirs=dirs) == {}


ALLOCATOR = "from pylon.serving.engine import heap; print(heap.allocator(), heap.keep_freed_memory())"


@pytest.mark.skipif(
    heap.tcmalloc_path() is None,
    reason="TCMalloc is not installed (make setup installs libtcmalloc-minimal4 where it runs as root)",
)
def test_the_preloaded_tcmalloc_is_the_process_malloc() -> None:
    """A process started with `engine_process_env("cpu")` runs on TCMalloc (and leaves glibc's thresholds alone);
    one started without it, on glibc's malloc."""
    preloaded = subprocess.run(
        [sys.executable, "-c", ALLOCATOR],
        capture_output=True,
        text=True,
        check=True,
        env=heap.engine_process_env("cpu"),
    )
    assert preloaded.stdout.split() == ["tcmalloc", "False"]
    plain = subprocess.run(
        [sys.executable, "-c", ALLOCATOR],
        capture_output=True,
        text=True,
        check=True,
        env=heap.engine_process_env("cuda"),
    )
    assert plain.stdout.split() == ["glibc", "True"]


def test_loaded_objects_leave_the_collectors_reach() -> None:
    """After the freeze, a full collection walks only objects made since: the loaded ones are not among those it
    tracks, and a cycle made later is still collected."""
    import gc
    import weakref

    class Node:
        pass

    loaded = [Node() for _ in range(1000)]
    try:
        assert heap.freeze_loaded_objects() >= 1000
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in loaded)
        later = Node()
        later.self = later  # a cycle: only the collector frees it
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
