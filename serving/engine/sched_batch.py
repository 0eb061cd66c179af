"""CPU serving is throughput work: its processes run under Linux's SCHED_BATCH policy.

At the default policy every wakeup of another thread (a replica writing a chunk, Ray's signal checks, gRPC pollers)
preempts an engine mid-step; a SCHED_BATCH thread that wakes waits for the next tick or a free core (sched(7)). Each
thread keeps its share of the CPU; most context switches, and the caches they cool, go. Only threads at SCHED_OTHER
move; no privilege is needed; threads created later inherit the policy. `PYLON_SCHED_BATCH=0` keeps the default
(a CPU deployment that must answer within a millisecond next to other work). Measurements: docs/serving.md.
"""

from __future__ import annotations

import logging
import os

from pylon.settings import switched_on

log = logging.getLogger(__name__)

ENV = "PYLON_SCHED_BATCH"


def enabled() -> bool:
    return hasattr(os, "sched_setscheduler") and switched_on(ENV)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread alone
        return [0]


class Moved(dict):
    """{thread id: previous policy} of the threads `batch_all_threads` moved, and `seen`: every thread the process
    had then. A thread started later by a moved thread inherits SCHED_BATCH; `restore` gives it the default back too."""

    def __init__(self, moved: dict[int, int] | None = None, seen: frozenset[int] = frozenset()) -> None:
        super().__init__(moved or {})
        self.seen = seen


def batch_all_threads() -> Moved:
    """Move every SCHED_OTHER thread of this process to SCHED_BATCH; returns {thread id: previous policy} of
    those moved (for `restore`), empty where the platform has no such policy or `PYLON_SCHED_BATCH=0`."""
    if not enabled():
        return Moved()
    tids = _threads()
    moved = {}
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                moved[tid] = os.SCHED_OTHER
        except OSError:  # the thread ended meanwhile, or a sandbox refuses the call: leave it as it is
            continue
    return Moved(moved, frozenset(tids))


def restore(moved: dict[int, int]) -> None:
    """Give the threads `batch_all_threads` moved their previous policy back (those still alive), and the default
    policy to every SCHED_BATCH thread started since (it inherited the policy from a moved thread: the caller's,
    or a pool's that grew meanwhile)."""
    seen = getattr(moved, "seen", None)
    targets = dict(moved)
    if moved and seen is not None:
        for tid in _threads():
            if tid not in seen and tid not in targets:
                try:
                    if os.sched_getscheduler(tid) == os.SCHED_BATCH:
                        targets[tid] = os.SCHED_OTHER
                except OSError:
                    continue
    for tid, policy in targets.items():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            continue


def serve_cpu_as_batch(device: str, what: str) -> None:
    """A serving process whose engine computes on `device`: on a CPU, the whole process goes SCHED_BATCH."""
    if device != "cpu":
        return
    moved = batch_all_threads()
    if moved:
        log.info("%s: %d thread(s) on SCHED_BATCH (CPU serving; %s=0 keeps the default policy)", what, len(moved), ENV)
