"""The job queue's rules (pylon.jobs.queue.JobQueue): order, strict admission, per-user limit, release, reaping."""

from __future__ import annotations

from pylon.jobs.queue import STALE_S, Entry, JobQueue, job_need
from pylon.specs import TrainJobSpec

CLUSTER = {"CPU": 2.0}


def job(**fields) -> TrainJobSpec:
    spec = {"kind": "TrainJob", "name": "job", "model": {"preset": "gpt-tiny"}, "data": {"uri": "/data"}, "steps": 100}
    spec.update(fields)
    return TrainJobSpec.model_validate(spec)


def entry(key: str, *, priority: int = 0, submitted: float, cpus: float = 2, user: str = "ann", limit=None) -> Entry:
    return Entry(
        key=key,
        name=key,
        priority=priority,
        user=user,
        need={"CPU": cpus},
        submitted=submitted,
        max_per_user=limit,
        driver_job_id=f"{key}-driver",
        seen=submitted,
    )


def test_need_is_workers_times_resources_per_worker() -> None:
    assert job_need(job(scaling={"num_workers": 2})) == {"CPU": 2}
    assert job_need(job(scaling={"num_workers": 3, "resources_per_worker": {"CPU": 2, "memory": 1e9}})) == {
        "CPU": 6,
        "memory": 3e9,
    }
    assert job_need(job(scaling={"num_workers": 2, "use_gpu": True, "resources_per_worker": {"CPU": 4}})) == {
        "CPU": 8,
        "GPU": 2,
    }


def test_spec_priority_and_queue_fields() -> None:
    spec = job(priority=7, queue={"user": "ann.lee", "kueue_queue": "team-a", "kueue_priority_class": "prod"})
    assert (spec.priority, spec.queue.user, spec.queue.kueue_queue) == (7, "ann.lee", "team-a")
    assert job().priority == 0 and job().queue.kueue_queue is None


def test_jobs_that_need_the_whole_cluster_run_one_at_a_time_in_priority_order() -> None:
    q = JobQueue()
    q.add(entry("first", priority=0, submitted=1))
    assert q.schedule(CLUSTER, now=1) == ["first"]
    q.add(entry("low", priority=1, submitted=2))
    q.add(entry("high", priority=5, submitted=3))
    q.add(entry("high-later", priority=5, submitted=4))
    assert q.schedule(CLUSTER, now=4) == []
    assert [e.key for e in q.waiting()] == ["high", "high-later", "low"]
    reason = q.reason(q.entries["high-later"], CLUSTER)
    assert reason.startswith("queued (2nd, priority 5): needs {CPU: 2}, cluster has 0 CPU free of 2"), reason
    assert "behind high (priority 5)" in reason
    order = []
    for now in (5, 6, 7):
        q.release(q.running()[0].key)
        order += q.schedule(CLUSTER, now=now)
    assert order == ["high", "high-later", "low"]


def test_admission_is_strictly_in_order() -> None:
    """A small job does not jump a bigger one of higher priority, even where it would fit."""
    q = JobQueue()
    q.add(entry("running", submitted=0, cpus=1))
    q.schedule(CLUSTER, now=0)
    q.add(entry("big", priority=2, submitted=1, cpus=2))
    q.add(entry("small", priority=1, submitted=2, cpus=1))
    assert q.schedule(CLUSTER, now=2) == []
    q.release("running")
    assert q.schedule(CLUSTER, now=3) == ["big"]
    q.release("big")
    assert q.schedule(CLUSTER, now=4) == ["small"]


def test_jobs_that_fit_together_start_together() -> None:
    q = JobQueue()
    q.add(entry("a", submitted=0, cpus=1))
    q.add(entry("b", submitted=1, cpus=1))
    q.add(entry("c", submitted=2, cpus=1))
    assert q.schedule(CLUSTER, now=2) == ["a", "b"]
    assert q.free(CLUSTER) == {"CPU": 0}


def test_a_job_larger_than_the_cluster_starts_alone() -> None:
    q = JobQueue()
    q.add(entry("small", submitted=0, cpus=1))
    q.schedule(CLUSTER, now=0)
    q.add(entry("huge", submitted=1, cpus=8))
    assert q.schedule(CLUSTER, now=1) == []
    assert "more than the whole cluster" in q.reason(q.entries["huge"], CLUSTER)
    q.release("small")
    assert q.schedule(CLUSTER, now=2) == ["huge"]


def test_per_user_limit_holds_back_only_that_users_jobs() -> None:
    q = JobQueue()
    cluster = {"CPU": 4.0}
    q.add(entry("ann-1", submitted=0, cpus=1, user="ann", limit=1))
    q.add(entry("ann-2", priority=9, submitted=1, cpus=1, user="ann", limit=1))
    q.add(entry("bob-1", submitted=2, cpus=1, user="bob", limit=1))
    assert q.schedule(cluster, now=2) == ["ann-2", "bob-1"]
    assert "user ann already runs 1 job(s)" in q.reason(q.entries["ann-1"], cluster)
    q.release("ann-2")
    assert q.schedule(cluster, now=3) == ["ann-1"]


def test_dead_and_silent_drivers_give_their_place_back() -> None:
    q = JobQueue()
    q.add(entry("running", submitted=0))
    q.schedule(CLUSTER, now=0)
    q.add(entry("waiting", submitted=1))
    q.add(entry("silent", submitted=2))
    assert q.reap({"running-driver"}, now=3) == ["running"]
    q.entries["waiting"].seen = 2 + STALE_S
    assert q.reap(set(), now=3 + STALE_S) == ["silent"]
    assert q.schedule(CLUSTER, now=4 + STALE_S) == ["waiting"]


def test_asking_again_keeps_the_first_submission_time() -> None:
    q = JobQueue()
    q.add(entry("a", submitted=1))
    q.add(entry("a", submitted=50))
    assert q.entries["a"].submitted == 1 and q.entries["a"].seen == 50
    rows = q.snapshot(CLUSTER)
    assert rows[0]["key"] == "a" and rows[0]["reason"].startswith("queued (1st")
