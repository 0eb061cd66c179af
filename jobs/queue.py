"""The cluster's TrainJob queue: jobs that do not fit wait, in priority order, instead of each taking part of it.

Every TrainJob's driver (`pylon train`, the SDK, `ray job submit ... python -m pylon.jobs.train`) asks one named,
detached Ray actor, `pylon-job-queue` in the `pylon` namespace (started by the first job that needs it), for
admission before it asks Ray Train for its workers, and gives its place back when training ends, fails or is
stopped:

    with admitted(spec):
        trainer.fit()

Waiting jobs are ordered by `priority` (higher first), then submission time. The queue admits from the head only:
the first waiting job starts when the cluster's free capacity (its total resources less what the jobs already
admitted asked for) covers its need (`scaling.num_workers` x `scaling.resources_per_worker`), and no job starts
before a waiting one of higher priority. A job that needs more than the whole cluster starts alone, when nothing
else runs (an autoscaling cluster then grows for it). A user (`queue.user`, else the submitting user) runs at most
`PYLON_QUEUE_MAX_JOBS_PER_USER` jobs at once; their further jobs wait without holding back anyone else's.

A driver that dies without saying so (killed, its node lost) is noticed through Ray's job table, so its place
never stays taken. `pylon jobs list` shows the waiting jobs with their position and what they wait for. On
Kubernetes with `queue.kueue_queue` set, Kueue queues the RayJobs instead (pylon.infra.kuberay.ray_job).
"""

from __future__ import annotations

import getpass
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from pylon import settings
from pylon.specs import TrainJobSpec

log = logging.getLogger("pylon.queue")

ACTOR_NAME = "pylon-job-queue"
NAMESPACE = "pylon"
# A waiting driver asks again this often; one that has not asked for STALE_S is taken for gone (its Ray job
# entry says so sooner, where Ray keeps one).
POLL_S = 1.0
STALE_S = 60.0


@dataclass
class Entry:
    """One job in the queue."""

    key: str  # the Ray job's submission id, else the driver's Ray job id
    name: str
    priority: int
    user: str
    need: dict[str, float]
    submitted: float  # when it joined the queue (time.time())
    max_per_user: int | None = None  # the limit its driver read (PYLON_QUEUE_MAX_JOBS_PER_USER)
    driver_job_id: str | None = None  # Ray's job id of the driver (hex), to notice a dead driver
    state: str = "queued"  # queued | admitted
    admitted_at: float | None = None
    seen: float = field(default_factory=time.time)  # the last time its driver asked


def job_need(spec: TrainJobSpec) -> dict[str, float]:
    """What the job's Ray Train workers ask for, in all: workers x resources per worker (a GPU each with
    `use_gpu` unless the spec names GPUs), as `jobs.train.run` asks, and with `grpo.sampler: server` its sampling
    servers' (`grpo.sampler_servers` x `grpo.sampler_resources`). Pylon's drivers ask for nothing themselves (no
    entrypoint resources)."""
    per_worker = dict(spec.scaling.resources_per_worker) or {"CPU": 1}
    if spec.scaling.use_gpu and "GPU" not in per_worker:
        per_worker["GPU"] = 1
    need = {k: v * spec.scaling.num_workers for k, v in per_worker.items() if v}
    if spec.grpo is not None and spec.grpo.sampler == "server":
        for k, v in spec.grpo.sampler_resources.items():
            if v:
                need[k] = need.get(k, 0.0) + v * spec.grpo.sampler_servers
    return need


def _fits(need: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _exceeds(need: dict[str, float], total: dict[str, float]) -> bool:
    return not _fits(need, total)


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class JobQueue:
    """The queue's state and rules, plain Python (the actor below holds one): ordering, admission, release."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def waiting(self) -> list[Entry]:
        """The queued entries in the order they are admitted: higher priority first, then earlier submission."""
        return sorted(
            (e for e in self.entries.values() if e.state == "queued"), key=lambda e: (-e.priority, e.submitted, e.key)
        )

    def running(self) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.state == "admitted"), key=lambda e: e.admitted_at or 0)

    def held(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.running():
            for k, v in e.need.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def free(self, total: dict[str, float]) -> dict[str, float]:
        held = self.held()
        return {k: max(0.0, v - held.get(k, 0.0)) for k, v in total.items()}

    def add(self, entry: Entry) -> None:
        """Join the queue (again: the first submission time is kept, so a restarted actor keeps the order)."""
        known = self.entries.get(entry.key)
        if known is None:
            self.entries[entry.key] = entry
        else:
            known.seen = entry.seen

    def release(self, key: str) -> bool:
        return self.entries.pop(key, None) is not None

    def _user_full(self, entry: Entry) -> bool:
        if not entry.max_per_user:
            return False
        return sum(1 for e in self.running() if e.user == entry.user) >= entry.max_per_user

    def schedule(self, total: dict[str, float], now: float | None = None) -> list[str]:
        """Admit from the head of the queue while the head fits; returns the keys admitted now."""
        now = time.time() if now is None else now
        admitted = []
        for entry in self.waiting():
            if self._user_full(entry):
                continue  # waits for its user's jobs, without holding back other users' jobs
            if _fits(entry.need, self.free(total)) or (_exceeds(entry.need, total) and not self.running()):
                entry.state, entry.admitted_at = "admitted", now
                admitted.append(entry.key)
                continue
            break  # strictly in order: nothing behind a job that does not fit yet starts before it
        return admitted

    def reason(self, entry: Entry, total: dict[str, float]) -> str:
        """Why a queued job waits, in one line (what `pylon jobs list` and the job's log say)."""
        if entry.state == "admitted":
            return "admitted"
        order = self.waiting()
        position = order.index(entry) + 1 if entry in order else 0
        head = f"queued ({_ordinal(position)}, priority {entry.priority})"
        if self._user_full(entry):
            return f"{head}: user {entry.user} already runs {entry.max_per_user} job(s), the most at once"
        ahead = next((e for e in order[: position - 1] if not self._user_full(e)), None)
        workers = entry.need
        free = self.free(total)
        cluster = ", ".join(f"cluster has {free.get(k, 0):g} {k} free of {total.get(k, 0):g}" for k in sorted(workers))
        why = f"needs {_fmt(workers)}, {cluster}"
        if ahead is not None:
            why += f"; behind {ahead.key} (priority {ahead.priority})"
        elif _exceeds(entry.need, total):
            why += "; more than the whole cluster: starts when nothing else runs"
        return f"{head}: {why}"

    def reap(self, dead: set[str], now: float | None = None) -> list[str]:
        """Drop the entries whose driver is gone: its Ray job ended (`dead`: driver job ids), or, while queued, it
        stopped asking for STALE_S."""
        now = time.time() if now is None else now
        gone = [
            e.key
            for e in self.entries.values()
            if (e.driver_job_id and e.driver_job_id in dead) or (e.state == "queued" and now - e.seen > STALE_S)
        ]
        for key in gone:
            self.entries.pop(key, None)
        return gone

    def snapshot(self, total: dict[str, float]) -> list[dict]:
        """Every entry, running first then queued in order, with its reason."""
        rows = []
        for e in self.running() + self.waiting():
            rows.append(asdict(e) | {"reason": self.reason(e, total)})
        return rows


class _QueueActor:
    """The detached actor that holds the cluster's JobQueue (methods run one at a time)."""

    def __init__(self) -> None:
        self.queue = JobQueue()

    def _total(self) -> dict[str, float]:
        import ray

        return {k: float(v) for k, v in ray.cluster_resources().items() if not k.startswith(("node:", "memory"))}

    def _dead_drivers(self) -> set[str]:
        try:
            from ray._private import state

            return {j["JobID"] for j in state.jobs() if j.get("IsDead")}
        except Exception as e:  # noqa: BLE001 - the stale rule still applies
            log.warning("pylon-job-queue: cannot read Ray's job table: %s", e)
            return set()

    def _tick(self) -> dict[str, float]:
        gone = self.queue.reap(self._dead_drivers())
        if gone:
            log.info("pylon-job-queue: dropped %s (driver gone)", gone)
        total = self._total()
        self.queue.schedule(total)
        return total

    def wait(self, entry: dict) -> dict:
        """Join (or stay in) the queue; returns {"state": queued|admitted, "reason": ...}."""
        self.queue.add(Entry(**entry))
        total = self._tick()
        e = self.queue.entries[entry["key"]]
        return {"state": e.state, "reason": self.queue.reason(e, total)}

    def release(self, key: str) -> bool:
        released = self.queue.release(key)
        self._tick()
        return released

    def list(self) -> list[dict]:
        total = self._tick()
        return self.queue.snapshot(total)


def queue_actor():
    """The cluster's queue actor, started here if no job started it yet (the connected Ray cluster's)."""
    import ray

    return (
        ray.remote(_QueueActor)
        .options(
            name=ACTOR_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
        )
        .remote()
    )


def existing_queue():
    """The queue actor if a job started it on the connected cluster, else None (nothing ever queued there)."""
    import ray

    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _job_metadata() -> dict:
    raw = settings.value(settings.RAY_JOB_CONFIG)
    try:
        return dict(json.loads(raw).get("metadata") or {}) if raw else {}
    except (ValueError, AttributeError, TypeError):
        return {}


def _max_per_user() -> int | None:
    raw = settings.value(settings.QUEUE_MAX_JOBS_PER_USER)
    if raw is None:
        return None
    try:
        limit = int(raw)
    except ValueError:
        log.warning("%s=%r is not a whole number: no per-user limit", settings.QUEUE_MAX_JOBS_PER_USER, raw)
        return None
    return limit if limit > 0 else None


def current_user() -> str:
    """This process's user name ("unknown" where the system has none, as in some containers)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


def entry_for(spec: TrainJobSpec) -> Entry:
    """This driver's entry: keyed by its Ray job's submission id (what `pylon jobs list` shows)."""
    import ray

    meta = _job_metadata()
    driver = ray.get_runtime_context().get_job_id()
    return Entry(
        key=meta.get("job_submission_id") or driver,
        name=spec.name,
        priority=spec.priority,
        user=spec.queue.user or meta.get("pylon_user") or current_user(),
        need=job_need(spec),
        submitted=time.time(),
        max_per_user=_max_per_user(),
        driver_job_id=driver,
    )


@contextmanager
def admitted(spec: TrainJobSpec, *, poll_s: float = POLL_S) -> Iterator[Entry]:
    """Wait in the cluster's queue until this job may ask for its workers; give the place back on the way out
    (finished, failed, or stopped). Ray must be initialised (the job's cluster)."""
    import ray

    queue = queue_actor()
    entry = entry_for(spec)
    fields = asdict(entry)
    started, said = time.monotonic(), None
    try:
        while True:
            fields["seen"] = time.time()
            answer = ray.get(queue.wait.remote(fields))
            if answer["state"] == "admitted":
                break
            if answer["reason"] != said:
                print(f"pylon queue: {entry.key} {answer['reason']}", flush=True)
                said = answer["reason"]
            time.sleep(poll_s)
        if said is not None:
            print(f"pylon queue: {entry.key} admitted after {time.monotonic() - started:.0f}s", flush=True)
        yield entry
    finally:
        try:
            ray.get(queue.release.remote(entry.key), timeout=30)
        except Exception as e:  # noqa: BLE001 - the queue notices the ended job itself
            log.warning("pylon queue: could not release %s: %s", entry.key, e)


def describe_waiting() -> dict[str, dict]:
    """The queue's entries by key, on the connected cluster ({} when no queue was ever started)."""
    import ray

    actor = existing_queue()
    if actor is None:
        return {}
    return {row["key"]: row for row in ray.get(actor.list.remote(), timeout=30)}
