"""`pylon batch`: offline batch inference as a Ray job (a BatchJob spec: pylon.serving.api.batch)."""

from __future__ import annotations

import argparse
import sys

from pylon.cli.common import ADDRESS_HELP


def _cmd_batch(args: argparse.Namespace) -> int:
    import pylon
    from pylon.cli.jobs import _follow, announce

    client = pylon.connect(args.address)
    job = client.batch(args.file, overwrite=args.overwrite, force=args.force)  # spec errors refused before submitting
    if not announce(job.job_id, {"output": job.output}, args, f"; its answers go to {job.output}"):
        return 0
    return _follow(client, job.job_id, out=sys.stderr if args.json else None)


def add_batch_parser(sub, fmt) -> None:
    b = sub.add_parser(
        "batch",
        formatter_class=fmt,
        help="submit a BatchJob: offline batch inference over JSONL or Parquet files",
        description="Validate a BatchJob spec, then submit `python -m pylon.serving.api.batch --config FILE` as a "
        "Ray job and print its id. Every line of the spec's input (JSONL: an OpenAI Batch API request, or a record "
        "with messages or prompt; Parquet: a record a row) is answered by Pylon's serving engine on `replicas` "
        "engines of the cluster, as the same body POSTed to a Deployment would be; the answers go to the output's "
        "results/ and errors/ part files (OpenAI's output and error files), the counts to its _batch.json. "
        "Submitting the same job again goes on from the parts already answered.",
        epilog="examples:\n  pylon batch batch.yaml --follow\n  pylon batch batch.yaml --json\n"
        "  pylon batch batch.yaml --overwrite   # replace another batch's answers at the output",
    )
    b.add_argument("file", metavar="FILE", help="YAML file with one BatchJob document")
    b.add_argument("--follow", action="store_true", help="stream the job's logs until it ends (exit 1 if it fails)")
    b.add_argument(
        "--json",
        action="store_true",
        help='print {"job_id": ..., "output": ...} on stdout (with --follow, the logs go to stderr)',
    )
    b.add_argument("--overwrite", action="store_true", help="replace the answers of another batch found at the output")
    b.add_argument(
        "--force",
        action="store_true",
        help="submit even if the planner says an engine cannot hold its model on the cluster (its GPU type, or its "
        "largest node's RAM)",
    )
    b.add_argument("--address", help=ADDRESS_HELP)
    b.set_defaults(func=_cmd_batch)
