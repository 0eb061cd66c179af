"""`pylon cluster up|status|down`: start, inspect and stop the embedded local Ray cluster.

A real Ray head on this machine with token authentication; its state lives in $PYLON_HOME.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from pylon.cli.common import EXAMPLES_DIR


def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from pylon import home
    from pylon.infra import local as cluster

    spec = None
    if args.autoscale is not None:
        from pylon.specs import ClusterSpec, load_spec

        spec = load_spec(args.autoscale, ClusterSpec)
    running = home.read_state()
    if running is None or not running.is_running():
        print(
            "starting a local Ray head (token authentication on)"
            + (f", autoscaling {spec.summary()}" if spec else "")
            + "...",
            file=sys.stderr,
        )
    info, started = cluster.up(
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        object_store_memory=_gib_to_bytes(args.object_store_gib),
        port=args.port,
        dashboard_port=args.dashboard_port,
        autoscale=spec,
    )
    print(
        ("started" if started else "already running")
        + " local Ray cluster"
        + (" with autoscaling" if info.autoscaler_config else "")
    )
    print(f"  dashboard / Jobs API: {info.dashboard_url}")
    print(f"  GCS address:          {info.gcs_address}")
    print(f"  auth token file:      {info.token_path}")
    print(
        "  submit jobs with:     "
        f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={info.token_path} "
        f"ray job submit --address {info.dashboard_url} -- python ..."
    )
    if info.autoscaler_config:
        print(f"  autoscaler config:    {info.autoscaler_config}")
        print(f"  autoscaler log:       {info.temp_dir}/session_latest/logs/monitor.log")
        print("  watch nodes with:     pylon cluster status")
    print("  stop it with:         pylon cluster down")
    return 0


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    import pylon

    status = pylon.connect(args.address).status()
    if args.json:
        print(
            json.dumps(
                {
                    "dashboard_url": status.dashboard_url,
                    "gcs_address": status.gcs_address,
                    "nodes": [asdict(n) for n in status.nodes],
                    "resources": status.total_resources(),
                    "jobs": [asdict(j) for j in status.jobs],
                },
                indent=2,
            )
        )
    else:
        print(status)
    return 0


def _cmd_cluster_down(args: argparse.Namespace) -> int:
    from pylon.infra import local as cluster

    stopped = cluster.down()
    if stopped is None:
        print("no cluster started by `pylon cluster up` is recorded; nothing to stop")
    else:
        print(f"stopped the local Ray cluster at {stopped.dashboard_url}")
    return 0


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def add_cluster_parser(sub, fmt) -> None:
    c = sub.add_parser(
        "cluster",
        formatter_class=fmt,
        help="start, inspect or stop the local Ray cluster",
        description="The embedded default: a real Ray head on this machine, dashboard and Jobs "
        "API on 127.0.0.1, Ray's token authentication on. State lives in "
        "$PYLON_HOME (default ~/.pylon).",
        epilog="examples:\n  pylon cluster up --num-cpus 4\n  pylon cluster status --json\n  pylon cluster down",
    )
    csub = c.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = csub.add_parser(
        "up",
        formatter_class=fmt,
        help="start a local Ray head and print its addresses",
        description="Start a local Ray head (`ray start --head`) with token auth. Does nothing "
        "but print the addresses if one started by Pylon is already running.",
        epilog="examples:\n  pylon cluster up\n  pylon cluster up --num-cpus 4 --object-store-gib 2\n"
        "  pylon cluster up --autoscale                  # worker nodes come and go with the work\n"
        "  pylon cluster up --autoscale my-cluster.yaml  # worker groups from a local Cluster spec\n"
        "  PYLON_HOME=/tmp/other pylon cluster up --dashboard-port 8266   # a second cluster",
    )
    up.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    up.add_argument("--num-gpus", type=int, help="GPUs Ray may schedule (default: detected)")
    up.add_argument("--object-store-gib", type=float, help="object store size in GiB (default: Ray's choice)")
    up.add_argument("--port", type=int, help="GCS port (default 6379, or a free one if taken)")
    up.add_argument("--dashboard-port", type=int, help="dashboard/Jobs API port (default 8265, or a free one)")
    up.add_argument(
        "--autoscale",
        nargs="?",
        metavar="CLUSTER_YAML",
        const=str(EXAMPLES_DIR / "cluster-local.yaml"),
        help="run Ray's autoscaler on the head: the worker groups of a local Cluster spec start as "
        "logical nodes (local processes) when work does not fit, and stop after the spec's "
        "idle_timeout_minutes (default spec: pylon/examples/cluster-local.yaml, head 1 CPU, "
        "0-2 nodes of 1 CPU)",
    )
    up.set_defaults(func=_cmd_cluster_up)
    st = csub.add_parser(
        "status",
        formatter_class=fmt,
        help="show nodes, resources and running jobs",
        description="Show the cluster's nodes, resources and running jobs.",
        epilog="examples:\n  pylon cluster status\n  pylon cluster status --json\n"
        "  pylon cluster status --address http://head:8265",
    )
    st.add_argument("--address", help="dashboard URL or GCS address (default: RAY_ADDRESS, else the local one)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_cmd_cluster_status)
    dn = csub.add_parser(
        "down",
        help="stop the cluster `pylon cluster up` started (nothing else)",
        formatter_class=fmt,
        description="Stop exactly the Ray processes `pylon cluster up` started; other Ray "
        "clusters on this machine are left alone.",
        epilog="examples:\n  pylon cluster down\n  PYLON_HOME=/tmp/other pylon cluster down",
    )
    dn.set_defaults(func=_cmd_cluster_down)
