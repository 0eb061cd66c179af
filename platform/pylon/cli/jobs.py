"""`pylon train`, `pylon jobs list|logs|stop` and `pylon export`: training runs as Ray jobs.

Submit a TrainJob through the Ray Jobs API, follow, list and stop the cluster's jobs, and export a run's
latest checkpoint as one Hugging Face model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from pylon.cli.common import ADDRESS_HELP


def _cmd_train(args: argparse.Namespace) -> int:
    import pylon

    client = pylon.connect(args.address)
    run = client.train(
        args.file, force=args.force, export=not args.no_export
    )  # every spec error, and a job that cannot fit, refused first
    if not announce(run.job_id, {"run_uri": run.run_uri}, args, f", or the dashboard at {client.dashboard_url}"):
        return 0
    # With --json, stdout stays one JSON document: the logs go to stderr.
    from pylon.specs import TrainJobSpec, load_spec

    steps = load_spec(args.file, TrainJobSpec).steps
    return _follow(client, run.job_id, out=sys.stderr if args.json else None, total_steps=steps)


def announce(job_id: str, fields: dict, args: argparse.Namespace, where: str) -> bool:
    """Print a job just submitted: its id (with --json, {"job_id": ..., **fields}); without --follow, how to follow
    it (`where` ends that line) on stderr. Returns whether the caller goes on to follow its logs."""
    if args.json:
        print(json.dumps({"job_id": job_id, **fields}), flush=True)
    else:
        print(job_id, flush=True)
    if not args.follow:
        print(f"follow it with: pylon jobs logs {job_id} --follow{where}", file=sys.stderr)
    return args.follow


def _follow(client, job_id: str, *, out=None, total_steps: int | None = None) -> int:
    """Stream a job's logs until it ends (a step progress bar on a terminal); exit 0 only if it succeeded."""
    from pylon.sdk.handles import follow_logs

    status = follow_logs(client, job_id, out=out, progress=True, total_steps=total_steps)
    print(f"job {job_id} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def _queue_of(client, jobs) -> dict[str, dict]:
    """The job queue's entries (pylon.jobs.queue) when a TrainJob runs; {} with a note when it cannot be read."""
    if not any(j.kind == "TrainJob" and j.status in ("PENDING", "RUNNING") for j in jobs):
        return {}
    try:
        return client.job_queue()
    except Exception as e:  # noqa: BLE001 - the list itself is still worth printing
        print(f"note: the job queue cannot be read from here ({e}); queued jobs show as RUNNING", file=sys.stderr)
        return {}


def _cmd_jobs_list(args: argparse.Namespace) -> int:
    import pylon

    client = pylon.connect(args.address)
    jobs = client.jobs()
    queue = _queue_of(client, jobs)
    if args.json:
        print(json.dumps([asdict(j) | {"kind": j.kind, "queue": queue.get(j.job_id)} for j in jobs], indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0

    def status(j) -> str:
        entry = queue.get(j.job_id)
        return "QUEUED" if j.status == "RUNNING" and entry and entry["state"] == "queued" else j.status

    rows = [
        (
            j.job_id,
            status(j),
            j.kind or "-",
            j.metadata.get("pylon_name", "-"),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.start_time)) if j.start_time else "-",
            j.entrypoint if len(j.entrypoint) <= 60 else j.entrypoint[:57] + "...",
        )
        for j in jobs
    ]
    header = ("JOB ID", "STATUS", "KIND", "NAME", "STARTED", "ENTRYPOINT")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + "  " + row[-1])
    waiting = sorted(
        (e for e in queue.values() if e["state"] == "queued"), key=lambda e: (-e["priority"], e["submitted"], e["key"])
    )
    if waiting:
        print("\nwaiting in the job queue (highest priority, then earliest, first):")
        for e in waiting:
            print(f"  {e['key']}  {e['reason']}")
    return 0


def _cmd_jobs_logs(args: argparse.Namespace) -> int:
    import pylon

    client = pylon.connect(args.address)
    if args.follow:
        return _follow(client, args.job_id)
    sys.stdout.write(client.job_logs(args.job_id))
    return 0


def _cmd_jobs_stop(args: argparse.Namespace) -> int:
    import pylon
    from pylon.sdk.client import TERMINAL_JOB_STATES
    from pylon.sdk.handles import Job

    client = pylon.connect(args.address)
    status = client.job_status(args.job_id)
    if status in TERMINAL_JOB_STATES:
        print(f"job {args.job_id} had already ended: {status}")
        return 0
    status = Job(client, args.job_id).stop(timeout=args.timeout)  # ClusterError (exit 1) if it will not end
    print(f"job {args.job_id} {status}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pylon.jobs.export import EVAL_FILE, export_run, read_export_eval

    out = export_run(args.run_uri, args.out, step=args.step, lora=args.lora)
    from types import SimpleNamespace

    from pylon import storage
    from pylon.models import is_classifier

    config = storage.join(out, "config.json")  # (an adapter alone has none)
    classifier = storage.exists(config) and is_classifier(SimpleNamespace(**storage.read_json(config)))
    head = storage.read_json(storage.join(out, "pylon_export.json")).get("objective") == "eagle3"
    how = (
        "peft.PeftModel.from_pretrained(base_model, DIR)"
        if args.lora == "adapter"
        else f"transformers.{'AutoModelForSequenceClassification' if classifier else 'AutoModelForCausalLM'}"
        ".from_pretrained(DIR)"
    )
    if head:  # objective eagle3: a drafting head, which the engine runs beside the model it drafts for
        how = f"a Deployment of the model it drafts for, engine.speculative: {{method: eagle3, draft_model: {out}}}"
    print(f"exported {args.run_uri} to {out} ({'serve it with' if head else 'load it with'} {how})")
    evaluation = read_export_eval(out)
    if evaluation is not None and head:
        print(
            f"held-out evaluation at step {evaluation['step']}: the drafts' loss {evaluation['loss']:.4f} over "
            f"{evaluation['tokens']:,} drafted positions, first draft {evaluation['eagle3_accuracy_0']:.0%} the "
            f"model's top token, {evaluation['eagle3_accept_length']:.2f} drafts a verification would accept "
            f"({EVAL_FILE})"
        )
    elif evaluation is not None and evaluation["perplexity"] is None:  # a reward model's
        print(
            f"held-out evaluation at step {evaluation['step']}: validation loss {evaluation['loss']:.4f} "
            f"(Bradley-Terry) over {evaluation['tokens']:,} preference pairs ({EVAL_FILE})"
        )
    elif evaluation is not None:
        print(
            f"held-out evaluation at step {evaluation['step']}: validation loss {evaluation['loss']:.4f}, "
            f"perplexity {evaluation['perplexity']:.3f} over {evaluation['tokens']:,} tokens ({EVAL_FILE})"
        )
    return 0


def add_train_parser(sub, fmt) -> None:
    t = sub.add_parser(
        "train",
        formatter_class=fmt,
        help="submit a TrainJob through the Ray Jobs API",
        description="Validate a TrainJob spec, then submit `python -m pylon.jobs.train --config FILE` "
        "as a Ray job and print its id. Submitting a run name again resumes it. A job "
        "the planner (`pylon plan`) says cannot fit on the workers it asks for is "
        "refused, with the reason and what would fit, unless --force. A job that the cluster's free "
        "capacity cannot hold yet waits in the cluster's job queue, by the spec's `priority` (higher first) "
        "then submission time; `pylon jobs list` shows it as QUEUED with what it waits for.",
        epilog="examples:\n  pylon train train.yaml --follow\n  pylon train train.yaml --json\n"
        "  pylon train train.yaml --address http://head:8265\n"
        "  pylon train big.yaml --force      # submit even if the planner says it will not fit",
    )
    t.add_argument("file", metavar="FILE", help="YAML file with one TrainJob document")
    t.add_argument("--follow", action="store_true", help="stream the job's logs until it ends (exit 1 if it fails)")
    t.add_argument(
        "--json",
        action="store_true",
        help='print {"job_id": ..., "run_uri": ...} on stdout (with --follow, the logs go to stderr)',
    )
    t.add_argument("--address", help=ADDRESS_HELP)
    t.add_argument(
        "--force",
        action="store_true",
        help="submit even if the planner says the job cannot fit on the resources it asks for",
    )
    t.add_argument(
        "--no-export",
        action="store_true",
        help="skip the export at the end (it gathers the whole model into one process); `pylon export` later",
    )
    t.set_defaults(func=_cmd_train)


def add_jobs_parser(sub, fmt) -> None:
    jb = sub.add_parser(
        "jobs",
        formatter_class=fmt,
        help="list Ray jobs, read or follow their logs, stop them",
        description="The cluster's Ray jobs (Pylon's and any others), through the Ray Jobs API. "
        "Pylon's jobs have readable ids: train-<name>-<hex>, data-<name>-<hex>.",
        epilog="examples:\n  pylon jobs list\n  pylon jobs logs train-stdlib-gpt-1a2b3c --follow\n"
        "  pylon jobs stop train-stdlib-gpt-1a2b3c",
    )
    jsub = jb.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    jl = jsub.add_parser(
        "list",
        formatter_class=fmt,
        help="every job, oldest first: id, status, kind, name, start; queued jobs and why they wait",
        description="List every job the cluster knows, running and ended, oldest first, with "
        "its status, what Pylon submitted it as (TrainJob, Dataset, BatchJob; '-' for other "
        "jobs), its name, start time and entrypoint. A TrainJob waiting in the cluster's job queue "
        "(its driver runs, its workers wait) shows as QUEUED, and is listed again below the table with its "
        "position, priority and the resources it waits for, e.g. 'queued (2nd, priority 5): needs {CPU: 2}, "
        "cluster has 0 CPU free of 2'. Reading the queue connects to the cluster as a Ray driver (its GCS "
        "address); where only the Jobs API is reachable, queued jobs show as RUNNING.",
        epilog="examples:\n  pylon jobs list\n  pylon jobs list --json | jq '.[] | select(.status == \"RUNNING\")'",
    )
    jl.add_argument(
        "--json",
        action="store_true",
        help="machine-readable list on stdout (with metadata, times, and each TrainJob's queue entry)",
    )
    jl.add_argument("--address", help=ADDRESS_HELP)
    jl.set_defaults(func=_cmd_jobs_list)
    jg = jsub.add_parser(
        "logs",
        formatter_class=fmt,
        help="print a job's logs; --follow streams them until it ends",
        description="Print a job's logs so far. With --follow, keep printing them as they grow "
        "until the job ends, then exit 0 if it SUCCEEDED, else 1.",
        epilog="examples:\n  pylon jobs logs train-stdlib-gpt-1a2b3c\n"
        "  pylon jobs logs train-stdlib-gpt-1a2b3c --follow",
    )
    jg.add_argument("job_id", metavar="ID", help="the job's submission id (as `pylon jobs list` shows it)")
    jg.add_argument("--follow", action="store_true", help="stream until the job ends (exit 1 unless it succeeded)")
    jg.add_argument("--address", help=ADDRESS_HELP)
    jg.set_defaults(func=_cmd_jobs_logs)
    js = jsub.add_parser(
        "stop",
        formatter_class=fmt,
        help="stop a running job and wait until it has ended",
        description="Ask Ray to stop a job (SIGTERM to its entrypoint, SIGKILL after a grace "
        "period) and wait until it is STOPPED. A job that already ended is left as "
        "it is (exit 0). A stopped training run resumes from its last checkpoint "
        "when submitted again.",
        epilog="examples:\n  pylon jobs stop train-stdlib-gpt-1a2b3c",
    )
    js.add_argument("job_id", metavar="ID", help="the job's submission id (as `pylon jobs list` shows it)")
    js.add_argument("--timeout", type=float, default=60, help="seconds to wait for it to end (default 60)")
    js.add_argument("--address", help=ADDRESS_HELP)
    js.set_defaults(func=_cmd_jobs_stop)


def add_export_parser(sub, fmt) -> None:
    e = sub.add_parser(
        "export",
        formatter_class=fmt,
        help="consolidate a run's ZeRO shards into one HF model",
        description="Export the latest committed checkpoint of a run (ZeRO stage 0-3 shards) as "
        "one Hugging Face directory (safetensors, config, tokenizer identity).",
        epilog="examples:\n  pylon export ~/.pylon/runs/stdlib-gpt --out ./stdlib-gpt-hf\n"
        "  pylon export s3://bucket/runs/stdlib-gpt --out s3://bucket/models/stdlib-gpt --step 200",
    )
    e.add_argument("run_uri", metavar="RUN_URI", help="the run directory (<checkpoint.storage>/<name>)")
    e.add_argument("--out", required=True, help="where to write the model (local path or URI)")
    e.add_argument("--step", type=int, help="a committed step (default: the latest)")
    e.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        help="for a LoRA run: write the adapters folded into the base weights (a plain model) or the "
        "adapters alone in peft's format (default: the spec's lora.merge_on_export)",
    )
    e.set_defaults(func=_cmd_export)
