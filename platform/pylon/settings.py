"""Every environment variable Pylon reads, in one registry, with its default and meaning (as vLLM's `envs.py`).

What a user chooses belongs in a spec field; these are the escape hatches: where Pylon keeps its state, which
cluster and object store it talks to, a price list, and the engine's on-by-default optimisations, each of which a
variable turns off (to measure it, or where it misbehaves). Only this module reads them; the rest of Pylon asks it:

    settings.pylon_home()                 # $PYLON_HOME, else ~/.pylon
    settings.switched_on(PAGED_KERNEL)    # False when PYLON_PAGED_KERNEL is 0, false, no or off

Values are read when asked, not cached at import: a test or an engine process started with another environment
sees its own. `docs/settings.md` is generated from `SETTINGS` (`python -m pylon.cli.reference --settings`), and a
test fails when it drifts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # as the variable would spell it; "" for none
    meaning: str
    switch: bool = False  # an on-by-default switch: 0, false, no or off turn it off


HOME = "PYLON_HOME"
RAY_ADDRESS = "RAY_ADDRESS"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SHIP_LIMIT_MB = "PYLON_SHIP_LIMIT_MB"
HAPROXY_ADMIN_HOST = "PYLON_HAPROXY_ADMIN_HOST"
S3_ENDPOINT = "AWS_ENDPOINT_URL_S3"
ENDPOINT = "AWS_ENDPOINT_URL"
REGION = "AWS_REGION"
DEFAULT_REGION = "AWS_DEFAULT_REGION"
MAX_ATTEMPTS = "AWS_MAX_ATTEMPTS"
RETRY_MODE = "AWS_RETRY_MODE"
STORAGE_RETRY_S = "PYLON_STORAGE_RETRY_S"
STORAGE_TIMEOUT_S = "PYLON_STORAGE_TIMEOUT_S"
TORCH_EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
GPU_PRICES = "PYLON_GPU_PRICES"
PAGED_KERNEL = "PYLON_PAGED_KERNEL"
PREFILL_KERNEL = "PYLON_PREFILL_KERNEL"
ONEDNN_LINEAR = "PYLON_ONEDNN_LINEAR"
PADDED_ROWS = "PYLON_PADDED_ROWS"
SCHED_BATCH = "PYLON_SCHED_BATCH"
KEEP_HEAP = "PYLON_KEEP_HEAP"
TCMALLOC = "PYLON_TCMALLOC"
QUEUE_MAX_JOBS_PER_USER = "PYLON_QUEUE_MAX_JOBS_PER_USER"
LEDGER_URI = "PYLON_LEDGER_URI"

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting(
            HOME,
            "~/.pylon",
            "Where Pylon keeps its local state: the local cluster's `cluster.json` and "
            "`auth_token`, specs submitted by the SDK, and the default runs root (`runs/`).",
        ),
        Setting(
            RAY_ADDRESS,
            "",
            "The cluster `pylon.connect()`, the CLI and Ray drivers use when none is given: a dashboard URL "
            "(http://HOST:8265) or a GCS address (HOST:6379); unset: the cluster `pylon cluster up` started.",
        ),
        Setting(
            RAY_AUTH_TOKEN,
            "",
            "Ray's token for a cluster Pylon did not start (Ray's own variable); wins over RAY_AUTH_TOKEN_PATH.",
        ),
        Setting(
            RAY_AUTH_TOKEN_PATH,
            "~/.ray/auth_token",
            "The file holding Ray's token for a cluster Pylon did not start (Ray's own variable). For a cluster "
            "`pylon cluster up` started, Pylon points it at `$PYLON_HOME/auth_token` unless one of the two is set.",
        ),
        Setting(
            RAY_JOB_CONFIG,
            "",
            "Set by Ray in the process of a Ray job's entrypoint (Ray's own variable): Pylon reads only whether it is "
            "set, which means this process runs on a node of the cluster, so local paths are that node's.",
        ),
        Setting(
            SHIP_LIMIT_MB,
            "100",
            "The most a client ships with a job to a cluster that shares no disk with it: the local files a spec "
            "names (a small corpus, tokenizer files), in MiB. Larger inputs are refused before submission: put them "
            "in object storage.",
        ),
        Setting(
            HAPROXY_ADMIN_HOST,
            "127.0.0.1",
            "Where Serve's HAProxy binds its stats page and Prometheus exporter (`pylon-haproxy`), on each node; "
            "they answer without credentials, so loopback unless a scraper on another machine needs them (then "
            "firewall them to it). Set it in the environment of `pylon cluster up` / `join`.",
        ),
        Setting(
            S3_ENDPOINT,
            "",
            "The S3-protocol endpoint for s3:// URIs (MinIO, a local server); wins over AWS_ENDPOINT_URL.",
        ),
        Setting(ENDPOINT, "", "The S3-protocol endpoint for s3:// URIs when AWS_ENDPOINT_URL_S3 is unset; unset: AWS."),
        Setting(REGION, "", "The region of s3:// buckets; wins over AWS_DEFAULT_REGION."),
        Setting(DEFAULT_REGION, "", "The region of s3:// buckets when AWS_REGION is unset."),
        Setting(MAX_ATTEMPTS, "3", "Attempts per S3 request (botocore's retries)."),
        Setting(RETRY_MODE, "standard", "botocore's retry mode for S3 requests."),
        Setting(
            STORAGE_RETRY_S,
            "120",
            "How long, in seconds, a storage operation (a checkpoint file's upload or download, a data shard's read, "
            "a small state file) keeps retrying transient failures of object storage (connection refused or reset, "
            "timeouts, 5xx, SlowDown), with exponential backoff and jitter, before it fails naming the URI; 0: no "
            "retries beyond botocore's.",
        ),
        Setting(
            STORAGE_TIMEOUT_S,
            "60",
            "Seconds an S3 request waits to connect, and for each read from its connection, before it counts as a "
            "timed-out (transient) failure.",
        ),
        Setting(
            TORCH_EXTENSIONS_DIR,
            "~/.cache/torch_extensions",
            "Where DeepSpeed's ops and Pylon's CPU kernels are compiled and kept (`python -m pylon.ops` builds them).",
        ),
        Setting(
            ONEDNN_CACHE,
            "1024",
            "oneDNN's kernel cache size (oneDNN's own variable); a CPU engine compiles at most this many at start-up.",
        ),
        Setting(
            GPU_PRICES,
            "",
            "A YAML file of accelerator prices ($/hour) that the planner uses instead of the "
            "catalog's (`pylon plan --prices FILE` wins over it).",
        ),
        Setting(
            PAGED_KERNEL,
            "1",
            "CPU engines attend with Pylon's compiled paged-attention kernel for decodes "
            "(`pylon.serving.model.kernels`); off: PyTorch's SDPA over gathered blocks.",
            switch=True,
        ),
        Setting(
            PREFILL_KERNEL,
            "1",
            "CPU engines attend for prompt chunks with the compiled kernel too; off: SDPA.",
            switch=True,
        ),
        Setting(
            ONEDNN_LINEAR,
            "1",
            "CPU engines run fp32 projections through oneDNN over weights reordered once "
            "at load (`pylon.serving.model.linear`); off: MKL's addmm.",
            switch=True,
        ),
        Setting(
            PADDED_ROWS,
            "1",
            "Steps with a prompt chunk run their projections over one of a few padded row "
            "counts, compiled at start-up; off: no padding, kernels compiled as steps come.",
            switch=True,
        ),
        Setting(
            SCHED_BATCH,
            "1",
            "CPU engine processes and replicas run under Linux's SCHED_BATCH policy "
            "(`pylon.serving.engine.sched_batch`); off: the default policy.",
            switch=True,
        ),
        Setting(
            KEEP_HEAP,
            "1",
            "An engine process keeps the memory it frees (glibc's malloc thresholds; "
            "`pylon.serving.engine.heap`); off: glibc's defaults.",
            switch=True,
        ),
        Setting(
            TCMALLOC,
            "1",
            "A CPU engine process starts with gperftools' TCMalloc preloaded where it is "
            "installed; off: glibc's malloc.",
            switch=True,
        ),
        Setting(
            QUEUE_MAX_JOBS_PER_USER,
            "",
            "The most TrainJobs one user (`queue.user`, else the submitting user) runs at once on the cluster; "
            "more wait in the job queue (docs/training.md, Job queue). Read by each job's driver, so set it "
            "where the cluster's nodes start. Unset: no limit.",
        ),
        Setting(
            LEDGER_URI,
            "",
            "Where serving replicas keep their ledger (`pylon cost DEPLOYMENT`): a storage URI that every node and "
            "the client reach (e.g. s3://bucket/pylon-ledger). Unset: `$PYLON_HOME/ledger` on each replica's node, "
            "which `pylon cost` reads on that machine. Set it where the cluster's nodes start.",
        ),
    ]
}


def _registered(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered setting; add it to pylon.settings.SETTINGS") from None


def value(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty (its default then applies)."""
    _registered(name)
    return os.environ.get(name) or None


def switched_on(name: str) -> bool:
    """An on-by-default switch: off when set to 0, false, no or off."""
    if not _registered(name).switch:
        raise KeyError(f"{name} is not an on/off switch")
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def pylon_home() -> Path:
    """Where Pylon keeps its local state: `$PYLON_HOME`, else `~/.pylon`."""
    return Path(value(HOME) or Path.home() / ".pylon").expanduser().resolve()


def render() -> str:
    """docs/settings.md: the registry as a table."""
    lines = [
        "# Settings: the environment variables Pylon reads",
        "",
        "Generated from `platform/pylon/settings.py` by `python -m pylon.cli.reference --settings > docs/settings.md`;",
        "a test fails when they differ. What a user chooses is a spec field (docs/specs.md); these say where Pylon",
        "runs and hold its escape hatches. Switches are on by default; `0`, `false`, `no` or `off` turn one off.",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for s in SETTINGS.values():
        default = f"`{s.default}`" if s.default else "(none)"
        lines.append(f"| `{s.name}` | {default} | {s.meaning} |")
    return "\n".join(lines) + "\n"
