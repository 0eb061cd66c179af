"""`pylon.connect()`: a client bound to a running Ray cluster, through Ray's public HTTP APIs.

Which cluster: the `address` given, else `RAY_ADDRESS`, else the one `pylon cluster up` started.
Addresses may be a dashboard/Jobs API URL (`http://host:8265`) or a GCS address (`host:6379`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pylon import home
from pylon.errors import ClusterError, JobNotFoundError, PylonError, SpecError
from pylon.home import NodeInfo
from pylon.jobs.queue import current_user
from pylon.jobs.run_dir import run_uri_of, storage_problems
from pylon.plan import DEFAULT_DEADLINE_DAYS, DEFAULT_MFU, check_fits, check_serve_fits, plan_file, plan_spec
from pylon.plan.catalog import load_catalog
from pylon.plan.fits import cluster_nodes
from pylon.sdk import inputs, ship
from pylon.sdk.handles import TERMINAL_JOB_STATES, BatchRun, DataJob, JobInfo, Run, Service
from pylon.sdk.serve import base_url, deploy, serve_details
from pylon.specs import BatchJobSpec, DeploymentSpec, TrainJobSpec, to_yaml


@dataclass
class ClusterStatus:
    dashboard_url: str
    gcs_address: str | None
    nodes: list[NodeInfo]
    jobs: list[JobInfo] = field(default_factory=list)

    @property
    def running_jobs(self) -> list[JobInfo]:
        return [j for j in self.jobs if j.status in ("PENDING", "RUNNING")]

    def total_resources(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for node in self.nodes:
            if node.state == "ALIVE":
                for name, amount in node.resources.items():
                    total[name] = total.get(name, 0.0) + amount
        return total

    def __str__(self) -> str:
        lines = [f"dashboard / Jobs API: {self.dashboard_url}"]
        if self.gcs_address:
            lines.append(f"GCS address:          {self.gcs_address}")
        alive = [n for n in self.nodes if n.state == "ALIVE"]
        lines.append(
            f"nodes: {len(alive)} alive"
            + (f", {len(self.nodes) - len(alive)} dead" if len(alive) < len(self.nodes) else "")
        )
        for n in self.nodes:
            res = ", ".join(f"{_fmt_resource(k, v)}" for k, v in sorted(n.resources.items()) if _shown(k))
            labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items()) if k != "ray.io/node-id")
            res += f"  labels {labels}" if labels else ""
            lines.append(f"  {n.node_id[:12]}  {n.ip:<15} {n.state:<6} {'head' if n.is_head else 'worker':<6} {res}")
        total = self.total_resources()
        lines.append(
            "resources: " + (", ".join(_fmt_resource(k, v) for k, v in sorted(total.items()) if _shown(k)) or "none")
        )
        running = self.running_jobs
        lines.append(f"running jobs: {len(running)}")
        for j in running:
            lines.append(f"  {j.job_id}  {j.status:<8} {j.entrypoint}")
        return "\n".join(lines)


def _shown(resource: str) -> bool:
    # Per-node and accelerator-type markers are noise in a summary.
    return not resource.startswith("node:") and not resource.startswith("accelerator_type")


def _fmt_resource(name: str, amount: float) -> str:
    if name in ("memory", "object_store_memory"):
        return f"{name} {amount / 2**30:.1f} GiB"
    return f"{name} {amount:g}"


class Client:
    """A handle on one Ray cluster. Everything goes through Ray's public Jobs and State HTTP APIs."""

    def __init__(
        self,
        dashboard_url: str,
        *,
        gcs_address: str | None = None,
        token: str | None = None,
        shares_disk: bool = False,
    ):
        self.dashboard_url = dashboard_url.rstrip("/")
        self.gcs_address = gcs_address
        # Whether the cluster's head is this machine (the cluster `pylon cluster up` started here): then local paths
        # in specs are read in place; otherwise a job carries the local files it reads (pylon.sdk.ship).
        self.shares_disk = shares_disk
        self._token = token
        self._job_client = None

    def __repr__(self) -> str:  # the token never appears here
        return f"Client(dashboard_url={self.dashboard_url!r}, gcs_address={self.gcs_address!r})"

    @property
    def _headers(self) -> dict[str, str]:
        return self._where.headers

    @property
    def _where(self) -> home.ClusterAddress:
        return home.ClusterAddress(self.dashboard_url, self.gcs_address, self._token, shares_disk=self.shares_disk)

    def ping(self, timeout_s: float = 10.0) -> str:
        """The cluster's Ray version; ClusterError when it cannot be reached or refuses our token."""
        return home.ping(self._where, timeout_s)

    def init_ray(self, **kwargs) -> None:
        """Connect this process to the cluster as a Ray driver (for Ray Data, tasks), once."""
        home.init_ray(self._where, **kwargs)

    # -- jobs -------------------------------------------------------------------------------------------

    def _jobs(self):
        from ray.job_submission import JobSubmissionClient

        if self._job_client is None:  # it checks the server's version when made: once is enough
            self._job_client = JobSubmissionClient(self.dashboard_url, headers=self._headers)
        return self._job_client

    def _job_call(self, job_id: str, fn, *args):
        """`fn(job_id)` on the Jobs API, with Ray's 404 RuntimeError turned into JobNotFoundError."""
        try:
            return fn(job_id, *args)
        except RuntimeError as e:
            if "status code 404" in str(e):
                raise JobNotFoundError(job_id, self.dashboard_url) from None
            raise

    def submit_job(
        self,
        entrypoint: str,
        *,
        runtime_env: dict | None = None,
        submission_id: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        return self._jobs().submit_job(
            entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id, metadata=metadata
        )

    def jobs(self) -> list[JobInfo]:
        """Every job the cluster knows (running and ended), oldest first."""
        return sorted((_job_info(j) for j in self._jobs().list_jobs()), key=lambda j: j.start_time or 0)

    def job_info(self, job_id: str) -> JobInfo:
        return _job_info(self._job_call(job_id, self._jobs().get_job_info))

    def job_status(self, job_id: str) -> str:
        return str(self._job_call(job_id, self._jobs().get_job_status).value)

    def job_logs(self, job_id: str) -> str:
        return self._job_call(job_id, self._jobs().get_job_logs)

    def stop_job(self, job_id: str) -> bool:
        """Ask a job to stop (SIGTERM, then SIGKILL); False if it had already ended."""
        return self._job_call(job_id, self._jobs().stop_job)

    def job_queue(self) -> dict[str, dict]:
        """The cluster's TrainJob queue (`pylon.jobs.queue`) by job id: every job it admitted or keeps waiting,
        with its priority, user, need and why it waits (`reason`); {} when no TrainJob ever ran there. It asks
        the queue's Ray actor, so this process connects to the cluster as a Ray driver (the GCS address)."""
        from pylon.jobs.queue import describe_waiting

        self.init_ray()
        return describe_waiting()

    def wait_job(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> str:
        """Block until the job ends; returns its final status (ClusterError on timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.job_status(job_id)
            if status in TERMINAL_JOB_STATES:
                return status
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} still {status} after {timeout_s:.0f}s")
            time.sleep(poll_s)

    # -- the SDK: training runs, datasets, deployments (handles in pylon.sdk.handles) ---------------------------

    def train(self, spec, *, force: bool = False, export: bool = True) -> Run:
        """Submit a TrainJob (a `TrainJobSpec`, a dict of its fields, or a YAML file) as a Ray job: the
        job `pylon train FILE` submits, `python -m pylon.jobs.train --config spec.yaml`, with the spec carried in
        the job's working directory (a copy is kept in `$PYLON_HOME/specs/<job id>.yaml`). Relative paths in the
        spec mean what they mean in this process's working directory; on a cluster that shares no disk with this
        machine, the local files it reads travel with the job and local output paths are refused
        (`pylon.sdk.ship`). Submitting a run name again resumes it. A job the planner says cannot fit on the
        resources it asks for is refused first (`pylon.plan.WontFitError`, with the reason and what would fit);
        `force=True` submits it anyway. `export=False` skips the export at the end (it gathers the whole model
        into one process; a model trained only because ZeRO-3 spreads it may not fit there)."""
        spec, _ = inputs.as_spec(spec, TrainJobSpec)  # every spec error before anything is submitted
        if not force:
            check_fits(spec, client=self)  # before asking for workers (and before contacting the cluster)
        job_id = inputs.new_job_id("train", spec.name)
        if spec.checkpoint.storage is None and self.shares_disk:  # the default, named: the job may run elsewhere
            spec = spec.model_copy(
                update={"checkpoint": spec.checkpoint.model_copy(update={"storage": str(home.pylon_home() / "runs")})}
            )
        package = ship.package(spec, self._where, default_runs=spec.checkpoint.storage is None)
        try:
            spec = package.spec
            run_uri = run_uri_of(spec)
            self._check_storage({"data.uri": spec.data.uri, "checkpoint.storage": run_uri}, f"TrainJob '{spec.name}'")
            record = home.pylon_home() / "specs" / f"{job_id}.yaml"
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(to_yaml(spec))
            self.submit_job(
                f"python -m pylon.jobs.train --config {ship.SPEC_FILE}" + ("" if export else " --no-export"),
                runtime_env=package.runtime_env,
                submission_id=job_id,
                metadata={
                    "pylon_kind": "TrainJob",
                    "pylon_name": spec.name,
                    "pylon_run_uri": run_uri,
                    "pylon_steps": str(spec.steps),
                    # For the cluster's job queue (pylon.jobs.queue): whose job, for the per-user limit.
                    "pylon_user": spec.queue.user or current_user(),
                    "pylon_priority": str(spec.priority),
                },
            )
        finally:
            package.cleanup()
        return Run(self, job_id, name=spec.name, run_uri=run_uri, start_time=time.time(), steps=spec.steps)

    def _check_storage(self, fields: dict[str, str], label: str) -> None:
        """Refuse, before submitting, local paths a job on a cluster of several nodes could not share (the job
        checks again on the cluster; this saves a submission and says it sooner)."""
        if not any(ship.is_local(uri) for uri in fields.values()):
            return
        nodes = sum(1 for n in self.nodes() if n.state == "ALIVE")
        problems = storage_problems({k: v for k, v in fields.items() if not v.startswith(ship.INPUTS_DIR)}, nodes)
        if problems:
            raise SpecError([f"{label}: {p}" for p in problems])

    def plan(
        self,
        spec,
        *,
        gpu: str | None = None,
        gpus: int | None = None,
        mfu: float | None = None,
        prices: str | None = None,
        seq_len: int | None = None,
        deadline_days: float | None = None,
        budget_usd: float | None = None,
    ):
        """Memory, time and cost of a TrainJob or Deployment before it launches (`pylon plan`): a spec object, a
        dict of its fields (a TrainJob unless `kind` says otherwise) or a YAML file (a list of plans when it holds
        several). `gpu` limits it to one accelerator, `gpus` fixes the GPU count, `mfu` and `prices` (a YAML
        file) override the assumptions; a TrainJob's recommendation is the cheapest that finishes within
        `deadline_days` (default 30) and costs at most `budget_usd`. Needs no cluster;
        `print(pylon.plan.render(p))` shows the tables."""

        options = dict(
            catalog=load_catalog(prices),
            gpu=gpu,
            gpus=gpus,
            mfu=DEFAULT_MFU if mfu is None else mfu,
            seq_len=seq_len,
            deadline_days=DEFAULT_DEADLINE_DAYS if deadline_days is None else deadline_days,
            budget_usd=budget_usd,
        )
        if isinstance(spec, (str, os.PathLike)):
            plans, _ = plan_file(spec, **options)
            return plans[0] if len(plans) == 1 else plans
        kind = spec.get("kind") if isinstance(spec, dict) else getattr(spec, "kind", None)
        spec, _ = inputs.as_spec(spec, DeploymentSpec if kind == "Deployment" else TrainJobSpec)
        return plan_spec(spec, **options)

    def runs(self) -> list[Run]:
        """Every training run submitted through Pylon (`pylon train`, `client.train`), oldest first."""

        return [Run.from_info(self, j) for j in self.jobs() if j.kind == "TrainJob"]

    def prepare_data(self, spec=None, /, *, overwrite: bool = False, **fields) -> DataJob:
        """Submit `pylon data prepare` as a Ray job: for a `DatasetSpec`, a dict of its fields, a YAML file
        with one Dataset document, or the fields as keyword arguments (`sources`, `output`, `seq_len`,
        `include`, `exclude`, `tokenizer`, `format`, `shard_size_mb`, `chat`, `prompt_completion`, `packing`; `name`
        defaults to the output's last path component). `overwrite` replaces a dataset already at the output."""

        spec = inputs.dataset_spec(spec, fields)
        package = ship.package(spec, self._where)
        try:
            spec = package.spec
            job_id = inputs.new_job_id("data", spec.name)
            self.submit_job(
                inputs.prepare_entrypoint(spec, overwrite=overwrite),
                runtime_env=package.runtime_env,
                submission_id=job_id,
                metadata={"pylon_kind": "Dataset", "pylon_name": spec.name, "pylon_output": spec.output},
            )
        finally:
            package.cleanup()
        return DataJob(self, job_id, name=spec.name, output=spec.output, start_time=time.time())

    def batch(self, spec, *, overwrite: bool = False, force: bool = False) -> BatchRun:
        """Submit a BatchJob (a `BatchJobSpec`, a dict of its fields, or a YAML file) as a Ray job: offline batch
        inference, `python -m pylon.serving.api.batch --config spec.yaml`, every line of its input answered by the
        serving engine on `replicas` engines of the cluster, the answers written to its output. Submitting the same
        job again goes on from the parts already answered; `overwrite` replaces another batch's answers there. An
        engine the planner says the cluster cannot hold is refused first (`pylon.plan.WontFitError`); `force=True`
        submits it anyway."""
        spec, _ = inputs.as_spec(spec, BatchJobSpec)
        if not force:
            check_serve_fits(spec, cluster_nodes(self))
        package = ship.package(spec, self._where)
        try:
            spec = package.spec
            self._check_storage(
                {"model": spec.model, "input": spec.input, "output": spec.output}, f"BatchJob '{spec.name}'"
            )
            job_id = inputs.new_job_id("batch", spec.name)
            self.submit_job(
                f"python -m pylon.serving.api.batch --config {ship.SPEC_FILE}" + (" --overwrite" if overwrite else ""),
                runtime_env=package.runtime_env,
                submission_id=job_id,
                metadata={"pylon_kind": "BatchJob", "pylon_name": spec.name, "pylon_output": spec.output},
            )
        finally:
            package.cleanup()
        return BatchRun(self, job_id, name=spec.name, output=spec.output, start_time=time.time())

    def deploy(self, spec, *, timeout_s: float = 600, force: bool = False) -> Service:
        """Deploy a Deployment (a `DeploymentSpec`, a dict of its fields, or a YAML file) on Ray Serve, wait
        for its first replica, and return a `Service`. Its API key is the first of those in the environment
        variable `http.api_keys_env` names, read now and kept in this object's memory only. A replica the planner
        says the cluster cannot hold is refused first (`pylon.plan.WontFitError`); `force=True` deploys it anyway."""

        spec, _ = inputs.as_spec(spec, DeploymentSpec)
        key = inputs.first_api_key(spec.http.api_keys_env) if spec.http.api_keys_env else None
        url = deploy(spec, address=self._where, timeout_s=timeout_s, force=force)
        return Service(self, spec.name, url, api_key=key)

    def services(self, *, api_key: str | None = None) -> list[Service]:
        """Every Ray Serve application on the cluster, as a `Service`. Keys never leave where a deployment
        was made (replicas hold only digests), so these carry `api_key`, else the first of $PYLON_API_KEYS."""

        details = self.serve_applications()
        key = api_key or inputs.first_api_key("PYLON_API_KEYS", required=False)
        return [
            Service(
                self,
                name,
                base_url(details.get("http_options") or {}, app.get("route_prefix") or "/", self.dashboard_url),
                api_key=key,
            )
            for name, app in sorted(details.get("applications", {}).items())
        ]

    def service(self, name: str, *, api_key: str | None = None) -> Service:
        """The Serve application `name` as a `Service` (PylonError if there is none)."""
        for svc in self.services(api_key=api_key):
            if svc.name == name:
                return svc
        raise PylonError(f"no Serve application '{name}' on the cluster at {self.dashboard_url}")

    def serve_applications(self) -> dict:
        """Ray Serve's details of every application and replica, from the dashboard's REST API
        (`GET /api/serve/applications/`): the same facts as `ray.serve.status()`, without joining the
        cluster as a Ray driver."""
        return serve_details(self._where)

    # -- cluster ----------------------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        return home.cluster_nodes(self._where)

    def status(self) -> ClusterStatus:
        return ClusterStatus(
            dashboard_url=self.dashboard_url, gcs_address=self.gcs_address, nodes=self.nodes(), jobs=self.jobs()
        )


def connect(address: str | None = None, *, timeout_s: float = 10.0) -> Client:
    """A Client bound to a running cluster: `address`, else `RAY_ADDRESS`, else the one `up` started."""
    where = home.resolve(address)
    client = Client(
        where.dashboard_url, gcs_address=where.gcs_address, token=where.token, shares_disk=where.shares_disk
    )
    client.ping(timeout_s)
    return client


def _job_info(j) -> JobInfo:
    """Ray's JobDetails as a JobInfo (times in seconds)."""
    return JobInfo(
        job_id=j.submission_id or j.job_id or "?",
        status=str(j.status.value),
        entrypoint=j.entrypoint,
        start_time=(j.start_time or 0) / 1000 or None,
        message=j.message,
        end_time=(j.end_time or 0) / 1000 or None,
        metadata=dict(j.metadata or {}),
    )
