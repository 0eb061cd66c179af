"""pylon.serving.engine.sched_batch: CPU serving processes move every thread to SCHED_BATCH, and get it back."""

from __future__ import annotations

import os
import threading

import pytest

from pylon.serving.engine import sched_batch as scheduling

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")


def policies() -> dict[int, int]:
    """Every live thread's policy; a thread that ends between the listing and the call (another test's background
    thread, in this shared process) is left out."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[int(t)] = os.sched_getscheduler(int(t))
        except ProcessLookupError:
            continue
    return out


def test_every_thread_moves_new_threads_inherit_and_restore_gives_the_policy_back(monkeypatch) -> None:
    monkeypatch.delenv(scheduling.ENV, raising=False)
    started, stop = threading.Event(), threading.Event()
    seen = {}

    spawn, spawned = threading.Event(), threading.Event()

    def worker(name: str) -> None:
        seen[name] = os.sched_getscheduler(0)
        started.set()
        stop.wait()

    def pool() -> None:  # a thread that starts another one while the process is on SCHED_BATCH (a growing pool)
        spawn.wait()
        grandchild = threading.Thread(target=worker, args=("grandchild",))
        grandchild.start()
        spawned.set()
        grandchild.join()

    before = threading.Thread(target=worker, args=("before",))
    before.start()
    started.wait()
    grower = threading.Thread(target=pool)
    grower.start()
    assert set(policies().values()) == {os.SCHED_OTHER}
    moved, after = scheduling.batch_all_threads(), None
    try:
        assert len(moved) == len(policies()) >= 2  # this thread and the one started before
        assert set(policies().values()) == {os.SCHED_BATCH}
        started.clear()
        after = threading.Thread(target=worker, args=("after",))
        after.start()
        started.wait()
        assert seen == {"before": os.SCHED_OTHER, "after": os.SCHED_BATCH}  # created later: inherits
        started.clear()
        spawn.set()
        spawned.wait()
        started.wait()
        assert seen["grandchild"] == os.SCHED_BATCH  # started by a moved thread, not by this one
        scheduling.restore(moved)
        # every thread back, the ones started since included (they were not among those moved)
        assert set(policies().values()) == {os.SCHED_OTHER}
    finally:
        scheduling.restore(moved)
        spawn.set()
        stop.set()
        before.join()
        grower.join()
        if after is not None:
            after.join()
    assert set(policies().values()) == {os.SCHED_OTHER}


def test_disabled_by_the_environment_and_only_for_cpu_engines(monkeypatch) -> None:
    monkeypatch.setenv(scheduling.ENV, "0")
    assert scheduling.batch_all_threads() == {}
    assert set(policies().values()) == {os.SCHED_OTHER}
    monkeypatch.delenv(scheduling.ENV)
    scheduling.serve_cpu_as_batch("cuda", "a GPU replica")  # a GPU engine's process keeps the default
    assert set(policies().values()) == {os.SCHED_OTHER}
    scheduling.serve_cpu_as_batch("cpu", "a CPU replica")
    try:
        assert set(policies().values()) == {os.SCHED_BATCH}
    finally:
        scheduling.restore({tid: os.SCHED_OTHER for tid in policies()})
