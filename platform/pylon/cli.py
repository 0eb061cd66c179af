"""The `pylon` command line. Every command has help text with examples; errors print without tracebacks.

Exit codes: 0 success, 1 a problem with input or environment (the message says what to do),
2 wrong command-line usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import asdict

from pylon import __version__
from pylon.errors import PylonError, SpecError


def _cmd_validate(args: argparse.Namespace) -> int:
    from pylon.specs import load_specs

    problems: list[str] = []
    valid = []
    for path in args.files:
        try:
            valid.extend(load_specs(path))
        except SpecError as e:
            problems.extend(e.problems)
    if args.json:
        print(json.dumps({"valid": [{"file": d.source, "document": d.index, "kind": d.spec.kind,
                                     "name": d.spec.name} for d in valid],
                          "errors": problems}, indent=2))
    else:
        for doc in valid:
            print(f"ok  {doc.summary()}")
        for problem in problems:
            print(f"error  {problem}", file=sys.stderr)
        if problems:
            print(f"{len(problems)} error(s) in {len(args.files)} file(s)", file=sys.stderr)
    return 1 if problems else 0


def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from pylon import cluster

    running = cluster.read_state()
    if running is None or not running.is_running():
        print("starting a local Ray head (token authentication on)...", file=sys.stderr)
    info, started = cluster.up(num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                               object_store_memory=_gib_to_bytes(args.object_store_gib),
                               port=args.port, dashboard_port=args.dashboard_port)
    print(("started" if started else "already running") + " local Ray cluster")
    print(f"  dashboard / Jobs API: {info.dashboard_url}")
    print(f"  GCS address:          {info.gcs_address}")
    print(f"  auth token file:      {info.token_path}")
    print("  submit jobs with:     "
          f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={info.token_path} "
          f"ray job submit --address {info.dashboard_url} -- python ...")
    print("  stop it with:         pylon cluster down")
    return 0


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    import pylon

    status = pylon.connect(args.address).status()
    if args.json:
        print(json.dumps({"dashboard_url": status.dashboard_url, "gcs_address": status.gcs_address,
                          "nodes": [asdict(n) for n in status.nodes],
                          "resources": status.total_resources(),
                          "jobs": [asdict(j) for j in status.jobs]}, indent=2))
    else:
        print(status)
    return 0


def _cmd_cluster_down(args: argparse.Namespace) -> int:
    from pylon import cluster

    stopped = cluster.down()
    if stopped is None:
        print("no cluster started by `pylon cluster up` is recorded; nothing to stop")
    else:
        print(f"stopped the local Ray cluster at {stopped.dashboard_url}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pylon.demo import run_demo

    return run_demo(keep_cluster=args.keep_cluster)


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="pylon", formatter_class=fmt,
        description="Pylon: data, DeepSpeed training and continuous-batching serving on one Ray cluster.",
        epilog=textwrap.dedent("""\
            examples:
              pylon cluster up                 # start the embedded local Ray cluster
              pylon validate train.yaml        # check specs before launching anything
              pylon cluster status             # nodes, resources, running jobs
              pylon demo                       # the whole path, end to end
            """),
    )
    parser.add_argument("--version", action="version", version=f"pylon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("validate", formatter_class=fmt, help="check spec files; exit 1 with every error",
                       description="Validate Dataset, TrainJob, Deployment and Cluster specs (YAML; several "
                                   "documents per file allowed). Prints one line per valid document, or every "
                                   "error with its file, line, document and field path.",
                       epilog="examples:\n  pylon validate train.yaml serve.yaml\n  pylon validate --json specs/*.yaml")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML spec files")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=_cmd_validate)

    c = sub.add_parser("cluster", formatter_class=fmt, help="start, inspect or stop the local Ray cluster",
                       description="The embedded default: a real Ray head on this machine, dashboard and Jobs "
                                   "API on 127.0.0.1, Ray's token authentication on. State lives in "
                                   "$PYLON_HOME (default ~/.pylon).",
                       epilog="examples:\n  pylon cluster up --num-cpus 4\n  pylon cluster status --json\n"
                              "  pylon cluster down")
    csub = c.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = csub.add_parser("up", help="start a local Ray head and print its addresses",
                         description="Start a local Ray head (`ray start --head`) with token auth. Does nothing "
                                     "but print the addresses if one started by Pylon is already running.")
    up.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    up.add_argument("--num-gpus", type=int, help="GPUs Ray may schedule (default: detected)")
    up.add_argument("--object-store-gib", type=float, help="object store size in GiB (default: Ray's choice)")
    up.add_argument("--port", type=int, help="GCS port (default 6379, or a free one if taken)")
    up.add_argument("--dashboard-port", type=int, help="dashboard/Jobs API port (default 8265, or a free one)")
    up.set_defaults(func=_cmd_cluster_up)
    st = csub.add_parser("status", help="show nodes, resources and running jobs",
                         description="Show the cluster's nodes, resources and running jobs.")
    st.add_argument("--address", help="dashboard URL or GCS address (default: RAY_ADDRESS, else the local one)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_cmd_cluster_status)
    dn = csub.add_parser("down", help="stop the cluster `pylon cluster up` started (nothing else)",
                         description="Stop exactly the Ray processes `pylon cluster up` started; other Ray "
                                     "clusters on this machine are left alone.")
    dn.set_defaults(func=_cmd_cluster_down)

    d = sub.add_parser("demo", formatter_class=fmt, help="run the end-to-end path on the embedded local cluster",
                       description="Start the local cluster if needed, validate the bundled example specs, run a "
                                   "real Ray job over the Python standard library's sources that writes its "
                                   "result to local object storage, and print what happened.",
                       epilog="example:\n  pylon demo --keep-cluster")
    d.add_argument("--keep-cluster", action="store_true", help="leave the cluster running afterwards")
    d.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        for problem in e.problems:
            print(f"error  {problem}", file=sys.stderr)
        return 1
    except PylonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
