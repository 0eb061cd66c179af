"""A run's ledger: what it held, moved and cost, and where its wall time went (goodput), written as it runs.

Three writers, each its own files under `<run>/ledger/` (object stores cannot append, and no two writers share a
file):
- the driver (`python -m pylon.jobs.train`, one per submission): `session-<id>.json`, its start and end, how it
  ended, the export's time and bytes;
- rank 0 of each attempt of the worker group (Ray Train starts a new one after a failure):
  `attempt-<session>-<id>.json`, rewritten at every checkpoint, every `UPDATE_EVERY_S` and at the end, with the
  attempt's workers and resources, and running totals of its steps' time by kind and of every rank's bytes;
- both then write `<run>/ledger.json`, the report `report()` makes of all of them: measured figures, their cost
  at the catalog's prices, the planner's prediction beside them, and the goodput decomposition.

Goodput: the wall time of the run's sessions, split into parts that sum to it:
- `productive_s`: the training steps kept (forward, backward, optimizer, the loop's bookkeeping), less data wait;
- `queued_s`: waiting in the cluster's job queue for jobs ahead of it (`pylon.jobs.queue`);
- `startup_s`: a session's start to its first step, less the queue (validation, scheduling workers, building the
  model and the engine, loading the checkpoint it resumes from);
- `data_wait_s`: inside kept steps, waiting for data;
- `checkpoint_stall_s`: the step loop blocked by saves (the snapshot, a synchronous upload, or waiting for the
  previous asynchronous one);
- `evaluation_s`: held-out evaluation;
- `failure_s`: the work of a failed attempt that the next one did again (everything after the checkpoint it
  resumed from);
- `restart_s`: from a failed attempt's last sign of life to its successor's first step;
- `export_s`: the end-of-run export;
- `idle_s`: the rest (the driver before and after its workers, the last writes).
`goodput` is productive_s / wall_s.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

from pylon import storage

log = logging.getLogger("pylon.ledger")

LEDGER_FILE = "ledger.json"
LEDGER_DIR = "ledger"
UPDATE_EVERY_S = 10.0
FORMAT = 1
HOUR = 3600.0
GB = 1e9
KINDS = ("data", "checkpoints", "export")  # what bytes were moved for
PARTS = (
    "productive_s",
    "queued_s",
    "startup_s",
    "data_wait_s",
    "checkpoint_stall_s",
    "evaluation_s",
    "failure_s",
    "restart_s",
    "export_s",
    "idle_s",
)
_STEP_PARTS = ("productive_s", "data_wait_s", "checkpoint_stall_s", "evaluation_s")
OBJECT_STORES = ("s3", "gs", "gcs")


def _new_id() -> str:
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"


def _write(uri: str, record: dict) -> None:
    try:
        storage.atomic_write_json(uri, record)
    except Exception as e:  # the ledger never stops training
        log.warning("could not write the ledger file %s: %s", uri, e)


class SessionRecorder:
    """The driver's part: one per submission of a run (a resubmission resumes the run in a new session)."""

    def __init__(self, run_uri: str, *, spec: dict, job_id: str | None = None, now: float | None = None):
        self.run_uri = run_uri
        self.id = _new_id()
        self.uri = storage.join(run_uri, LEDGER_DIR, f"session-{self.id}.json")
        scaling = spec.get("scaling", {})
        self.record: dict[str, Any] = {
            "format": FORMAT,
            "session": self.id,
            "job_id": job_id or os.environ.get("RAY_JOB_ID"),
            "started_at": now if now is not None else time.time(),
            "updated_at": now if now is not None else time.time(),
            "ended_at": None,
            "outcome": "running",
            "workers": int(scaling.get("num_workers", 1)),
            "resources_per_worker": dict(scaling.get("resources_per_worker") or {"CPU": 1}),
            "use_gpu": bool(scaling.get("use_gpu", False)),
            "queued_s": 0.0,
            "export_s": 0.0,
            "bytes": {"export": {"read": 0, "written": 0}},
        }
        _write(self.uri, self.record)

    def queued(self, seconds: float) -> None:
        self.record["queued_s"] += seconds
        self.record["updated_at"] = time.time()
        _write(self.uri, self.record)

    def servers_started(self, count: int, resources: dict, *, now: float | None = None) -> None:
        """`count` actors of the run's own besides its workers (grpo.sampler server's), each holding `resources`
        from now until `servers_stopped` (or the session's end): their hours are the job's too."""
        now = now if now is not None else time.time()
        self.record["servers"] = {"count": count, "resources": dict(resources), "started_at": now, "ended_at": None}
        self.record["updated_at"] = now
        _write(self.uri, self.record)

    def servers_stopped(self, *, now: float | None = None) -> None:
        if "servers" in self.record:
            now = now if now is not None else time.time()
            self.record["servers"]["ended_at"] = now
            self.record["updated_at"] = now
            _write(self.uri, self.record)

    def exported(self, seconds: float, *, read: int, written: int) -> None:
        self.record["export_s"] += seconds
        self.record["bytes"]["export"]["read"] += read
        self.record["bytes"]["export"]["written"] += written
        self.record["updated_at"] = time.time()
        _write(self.uri, self.record)

    def finish(self, outcome: str, *, now: float | None = None) -> dict:
        """Record how the session ended ('succeeded', 'failed' or 'stopped'); writes and returns the report."""
        self.record.update(outcome=outcome, ended_at=now if now is not None else time.time())
        self.record["updated_at"] = self.record["ended_at"]
        _write(self.uri, self.record)
        return write_report(self.run_uri)


class AttemptRecorder:
    """Rank 0's part, for one attempt of the worker group. `step`, `add` and `saved` keep running totals; the
    file is rewritten by `update` (at most every UPDATE_EVERY_S unless forced) and `finish`."""

    def __init__(
        self,
        run_uri: str,
        *,
        session: str | None,
        workers: int,
        resources_per_worker: dict,
        resumed_from: int,
        accelerator: str | None = None,
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
        started_at: float | None = None,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.run_uri = run_uri
        self.id = _new_id()
        session = session or "none"  # a train_loop run outside the driver (tests, a bare TorchTrainer)
        self.uri = storage.join(run_uri, LEDGER_DIR, f"attempt-{session}-{self.id}.json")
        now = time.time()
        self.record: dict[str, Any] = {
            "format": FORMAT,
            "session": session,
            "attempt": self.id,
            "started_at": started_at if started_at is not None else now,
            "first_step_at": None,
            "updated_at": now,
            "ended_at": None,
            "workers": workers,
            "resources_per_worker": dict(resources_per_worker or {"CPU": 1}),
            "accelerator": accelerator,
            "flops_per_token": flops_per_token,
            "matmul_peak_flops": peak_flops,
            "resumed_from": resumed_from,
            "first_step": None,
            "last_step": resumed_from,
            "tokens": 0,
            **{part: 0.0 for part in _STEP_PARTS},
            "checkpoint_blocked": {"wait_previous_s": 0.0, "snapshot_s": 0.0, "upload_s": 0.0},
            "checkpoint_saves": 0,
            "checkpoint_failures": 0,
            # running totals at each save, by step: what a failure after it loses is the difference
            "saves": {},
            "bytes": {kind: {"read": 0, "written": 0} for kind in ("data", "checkpoints")},
        }
        self._written_at = 0.0

    def step(self, step: int, *, step_s: float, wait_s: float, tokens: int, started_at: float) -> None:
        r = self.record
        if r["first_step_at"] is None:
            r["first_step_at"], r["first_step"] = started_at, step
        r["last_step"] = step
        r["tokens"] += tokens
        r["productive_s"] += max(0.0, step_s - wait_s)
        r["data_wait_s"] += min(wait_s, step_s)

    def add(self, part: str, seconds: float) -> None:
        """Loop time outside the steps: 'productive_s' (bookkeeping), 'checkpoint_stall_s' or 'evaluation_s'."""
        self.record[part] += max(0.0, seconds)

    def saving(self, step: int) -> None:
        """Before the save of `step`: the running totals a resume from it keeps, written before the checkpoint can
        be committed (a worker lost right after the commit has then recorded them)."""
        r = self.record
        r["saves"][str(step)] = {p: r[p] for p in (*_STEP_PARTS, "tokens")}
        self.update(force=True)

    def checkpoint(self, step: int, blocked: dict, *, ok: bool = True) -> None:
        """After the save of `step`: the time it blocked the loop (kept by a resume from it, when it succeeded)."""
        r = self.record
        for k, v in blocked.items():
            r["checkpoint_blocked"][k] = r["checkpoint_blocked"].get(k, 0.0) + v
        seconds = sum(blocked.values())
        r["checkpoint_stall_s"] += seconds
        r["checkpoint_saves"] += 1
        r["checkpoint_failures"] += 0 if ok else 1
        if ok and str(step) in r["saves"]:
            r["saves"][str(step)]["checkpoint_stall_s"] += seconds
        else:
            r["saves"].pop(str(step), None)

    def bytes_moved(self, *, data_read: int, checkpoint_written: int, checkpoint_read: int) -> None:
        """Every rank's totals for this attempt (summed over ranks by the caller)."""
        b = self.record["bytes"]
        b["data"]["read"] = int(data_read)
        b["checkpoints"]["written"], b["checkpoints"]["read"] = int(checkpoint_written), int(checkpoint_read)

    def update(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if not force and now - self._written_at < UPDATE_EVERY_S:
            return
        self.record["updated_at"] = now
        self._written_at = now
        _write(self.uri, self.record)

    def finish(self) -> None:
        if not self.enabled:
            return
        self.record["ended_at"] = self.record["updated_at"] = time.time()
        _write(self.uri, self.record)
        write_report(self.run_uri)


# ---------------------------------------------------------------------------------------------------------
# Reading: the measured figures, then the report with prices and the planner's prediction
# ---------------------------------------------------------------------------------------------------------


def read_records(run_uri: str) -> tuple[list[dict], list[dict]]:
    """(sessions, attempts), each oldest first. Unreadable files are skipped with a warning."""
    folder = storage.join(run_uri, LEDGER_DIR)
    sessions, attempts = [], []
    for name in storage.listdir(folder):
        if not name.endswith(".json"):
            continue
        try:
            record = storage.read_json(storage.join(folder, name))
        except Exception as e:
            log.warning("skipping ledger file %s: %s", name, e)
            continue
        (sessions if name.startswith("session-") else attempts if name.startswith("attempt-") else []).append(record)
    sessions.sort(key=lambda r: r["started_at"])
    attempts.sort(key=lambda r: r["started_at"])
    return sessions, attempts


def _end(record: dict, now: float, *, live: bool) -> float:
    """When a session or attempt ended: as recorded; else now while it runs, else its last sign of life."""
    if record.get("ended_at") is not None:
        return record["ended_at"]
    return max(now, record["updated_at"]) if live else record["updated_at"]


def measure(run_uri: str, *, now: float | None = None, records: tuple[list, list] | None = None) -> dict:
    """The measured part of the ledger: hours held, bytes moved, and the goodput decomposition. `records`:
    `read_records(run_uri)` when the caller has them already."""
    now = time.time() if now is None else now
    sessions, attempts = records if records is not None else read_records(run_uri)
    wall = 0.0
    parts = dict.fromkeys(PARTS, 0.0)
    hours: dict[str, float] = {}
    moved = {kind: {"read": 0, "written": 0} for kind in KINDS}
    failures = restarts = saves = save_failures = 0
    tokens = 0
    blocked = {"wait_previous_s": 0.0, "snapshot_s": 0.0, "upload_s": 0.0}
    for s_index, session in enumerate(sessions):
        s_start = session["started_at"]
        live = session.get("ended_at") is None and s_index == len(sessions) - 1  # else: ended, or died unrecorded
        mine = [a for a in attempts if a["session"] == session["session"]]
        s_end = _end(session, now, live=live)
        if session.get("ended_at") is None:  # its workers may have outlived the driver's last word
            s_end = max([s_end, *(a["updated_at"] for a in mine)])
        s_wall = max(0.0, s_end - s_start)
        wall += s_wall
        servers = session.get("servers")
        if servers:  # held from their start to their stop (or, never stopped, the session's end)
            held_s = max(0.0, (servers["ended_at"] or s_end) - servers["started_at"])
            for resource, amount in servers["resources"].items():
                hours[resource] = hours.get(resource, 0.0) + held_s * amount * servers["count"] / HOUR
        s_parts = dict.fromkeys(PARTS, 0.0)
        s_parts["export_s"] = session.get("export_s", 0.0)
        s_parts["queued_s"] = session.get("queued_s", 0.0)
        for kind in ("read", "written"):
            moved["export"][kind] += session.get("bytes", {}).get("export", {}).get(kind, 0)
        previous_seen = None
        for i, a in enumerate(mine):
            a_end = _end(a, now, live=live and i == len(mine) - 1)
            held_s = max(0.0, a_end - a["started_at"])
            for resource, amount in a["resources_per_worker"].items():
                hours[resource] = hours.get(resource, 0.0) + held_s * amount * a["workers"] / HOUR
            for kind in ("data", "checkpoints"):
                for d in ("read", "written"):
                    moved[kind][d] += a.get("bytes", {}).get(kind, {}).get(d, 0)
            saves += a.get("checkpoint_saves", 0)
            save_failures += a.get("checkpoint_failures", 0)
            for k, v in a.get("checkpoint_blocked", {}).items():
                blocked[k] = blocked.get(k, 0.0) + v
            first = a["first_step_at"] if a["first_step_at"] is not None else a_end
            if i == 0:
                s_parts["startup_s"] += max(0.0, first - s_start - s_parts["queued_s"])
            else:
                restarts += 1
                s_parts["restart_s"] += max(0.0, first - previous_seen)
            # what the next attempt (of any later session) redid: the work after the checkpoint it resumed from
            later = next((b for b in attempts if b["started_at"] > a["started_at"]), None)
            kept = {p: a[p] for p in (*_STEP_PARTS, "tokens")}
            if later is not None and a.get("ended_at") is None:  # it never finished: it failed or was stopped
                failures += 1
            if later is not None and later["resumed_from"] < a["last_step"]:
                base = a["saves"].get(str(later["resumed_from"]))
                if base is None:  # resumed from before this attempt's saves: all its work is redone
                    base = {p: 0.0 for p in kept}
                lost = {p: kept[p] - base[p] for p in kept}
                s_parts["failure_s"] += sum(lost[p] for p in _STEP_PARTS)
                kept = base
            for p in _STEP_PARTS:
                s_parts[p] += kept[p]
            tokens += int(kept["tokens"])
            previous_seen = a_end
        s_parts["idle_s"] = max(0.0, s_wall - sum(s_parts.values()))
        for p in PARTS:
            parts[p] += s_parts[p]
    total = sum(parts.values())
    if total > wall:  # clocks of different nodes disagree: keep the sum equal to the wall time
        wall = total
    read = sum(m["read"] for m in moved.values())
    written = sum(m["written"] for m in moved.values())
    return {
        "wall_s": wall,
        "sessions": len(sessions),
        "attempts": len(attempts),
        "failures": failures,
        "restarts": restarts,
        "tokens": tokens,
        "resource_hours": hours,
        "cpu_hours": hours.get("CPU", 0.0),
        "accelerator_hours": hours.get("GPU", 0.0),
        "bytes_read": read,
        "bytes_written": written,
        "bytes": moved,
        "checkpoints": {"saves": saves, "failures": save_failures, "blocked_s": blocked},
        "goodput": {
            "fraction": parts["productive_s"] / wall if wall > 0 else 0.0,
            "wall_s": wall,
            **parts,
        },
    }


def _egress_bytes(run_uri: str, spec: dict, measured: dict) -> int:
    """Bytes read out of object storage (an estimate of egress: reads that leave the store's region or cloud;
    zero where the data and the run live on a filesystem)."""
    data_uri = (spec.get("data") or {}).get("uri", "")
    b = measured["bytes"]
    egress = 0
    if _is_object_store(data_uri):
        egress += b["data"]["read"]
    if _is_object_store(run_uri):
        egress += b["checkpoints"]["read"] + b["export"]["read"]
    return egress


def _is_object_store(uri: str) -> bool:
    return isinstance(uri, str) and uri.partition("://")[0].lower() in OBJECT_STORES and "://" in uri


def report(run_uri: str, *, prices: str | None = None, now: float | None = None) -> dict:
    """The ledger of the run at `run_uri`: measured figures, cost, the planner's prediction, goodput."""
    from pylon.plan.catalog import load_catalog

    records = read_records(run_uri)
    measured = measure(run_uri, now=now, records=records)
    run_file = storage.join(run_uri, "run.json")
    spec = storage.read_json(run_file)["spec"] if storage.exists(run_file) else {}
    attempts = records[1]
    catalog = load_catalog(prices)
    accelerator = next((a["accelerator"] for a in reversed(attempts) if a.get("accelerator")), None)
    gpu_price = None
    if accelerator:
        try:
            gpu_price = catalog.get(accelerator).price_per_gpu_hour
        except Exception:
            gpu_price = None
    egress = _egress_bytes(run_uri, spec, measured)
    cost = {
        "accelerators": measured["accelerator_hours"] * (gpu_price or 0.0),
        "cpu": measured["cpu_hours"] * catalog.vcpu_price_per_hour,
        "egress": egress / GB * catalog.egress_price_per_gb,
    }
    return {
        "format": FORMAT,
        "kind": "run",
        "run": spec.get("name") or run_uri.rstrip("/").rsplit("/", 1)[-1],
        "run_uri": run_uri,
        "updated_at": time.time() if now is None else now,
        **measured,
        "egress_bytes": egress,
        "cost_usd": sum(cost.values()),
        "cost_breakdown_usd": cost,
        "prices": {
            "source": catalog.prices_source,
            "accelerator": accelerator,
            "per_gpu_hour": gpu_price,
            "per_vcpu_hour": catalog.vcpu_price_per_hour,
            "egress_per_gb": catalog.egress_price_per_gb,
        },
        "predicted": predicted(spec, attempts, catalog),
    }


def predicted(spec: dict, attempts: list[dict], catalog) -> dict:
    """The planner's figures for this job, beside which the measured ones stand. On GPUs: `pylon plan`'s own
    (its time model, at its default MFU, on the accelerator the workers ran on). On CPUs, where the planner has
    no time model: the model's FLOPs over the matmul peak the workers measured at start, at that same MFU."""
    from pylon.plan.steptime import DEFAULT_MFU
    from pylon.plan.train import plan_train
    from pylon.specs import TrainJobSpec

    if not spec:
        return {"note": "no run.json: nothing to predict from"}
    job = TrainJobSpec.model_validate(spec)
    tokens = job.steps * job.global_batch_size * (job.data.seq_len or 0)
    out: dict[str, Any] = {"mfu": DEFAULT_MFU, "steps": job.steps}
    last = attempts[-1] if attempts else {}
    accelerator = last.get("accelerator")
    workers = job.scaling.num_workers
    try:
        if job.scaling.use_gpu and accelerator:
            plan = plan_train(job, catalog=catalog, gpu=accelerator, gpus=workers)
            option = plan.rows[0].requested
            out.update(
                source=f"pylon plan on {option.accelerator.name} x {workers}",
                wall_s=option.wall_s,
                accelerator_hours=option.gpu_hours,
                cpu_hours=0.0,
                cost_usd=option.cost_usd,
                peak_device_bytes=option.memory.device_total,
                tokens=plan.tokens,
            )
        else:
            plan = plan_train(job, catalog=catalog)
            out.update(tokens=plan.tokens, peak_host_bytes=plan.cpu_job_bytes)
            flops, peak = last.get("flops_per_token", 0.0), last.get("matmul_peak_flops", 0.0)
            resources = job.scaling.resources_per_worker or {"CPU": 1}  # Ray Train's default
            if flops and peak:
                wall = plan.tokens * flops / (peak * workers * DEFAULT_MFU)
                cpu_hours = wall * workers * resources.get("CPU", 0) / HOUR
                out.update(
                    source="model FLOPs over the workers' measured matmul peak (the planner has no CPU time model)",
                    wall_s=wall,
                    cpu_hours=cpu_hours,
                    accelerator_hours=0.0,
                    cost_usd=cpu_hours * catalog.vcpu_price_per_hour,
                )
            else:
                out["source"] = "the planner's memory figures only (no attempt has measured the matmul peak yet)"
    except Exception as e:  # a prediction that cannot be made is said, not fatal to the ledger
        out["error"] = str(e)
    if "tokens" not in out:
        out["tokens"] = tokens
    return out


def write_report(run_uri: str) -> dict:
    try:
        ledger = report(run_uri)
    except Exception as e:
        log.warning("could not make the ledger of %s: %s", run_uri, e)
        return {}
    _write(storage.join(run_uri, LEDGER_FILE), ledger)
    return ledger


def dumps(ledger: dict) -> str:
    return json.dumps(ledger, indent=2, sort_keys=True)
