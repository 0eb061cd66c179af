"""`pylon cluster up|join|status|down`: start, grow, inspect and stop the embedded Ray cluster.

A real Ray head on this machine with token authentication (`up`), worker nodes on other machines that join it
(`join`); what each machine started lives in its $PYLON_HOME.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pylon.cli.common import EXAMPLES_DIR


def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from pylon import home
    from pylon.infra import local as cluster
    from pylon.specs import is_loopback

    spec = None
    if args.autoscale is not None:
        from pylon.specs import ClusterSpec, load_spec

        spec = load_spec(args.autoscale, ClusterSpec)
    if args.metrics:
        from pylon.infra import prometheus

        prometheus.prometheus_program()  # before anything starts: the program is there
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
        host=args.host,
        node_ip_address=args.node_ip_address,
        ha=args.ha,
        labels=args.labels,
    )
    print(
        ("started" if started else "already running")
        + " local Ray cluster"
        + (" with autoscaling" if info.autoscaler_config else "")
    )
    if started and not is_loopback(args.host):
        print(
            f"  the dashboard / Jobs API listens on {args.host}, not only on this machine: Ray's token "
            "authentication is on, so requests without the cluster's token are refused"
        )
    print(f"  dashboard / Jobs API: {info.dashboard_url}")
    print(f"  GCS address:          {info.gcs_address}")
    print(f"  auth token file:      {info.token_path}")
    print(
        "  submit jobs with:     "
        f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={info.token_path} "
        f"ray job submit --address {info.dashboard_url} -- python ..."
    )
    _print_ha(info.home)
    if args.metrics:
        _start_metrics(info, args.metrics_rules)
    if info.autoscaler_config:
        print(f"  autoscaler config:    {info.autoscaler_config}")
        print(f"  autoscaler log:       {info.temp_dir}/session_latest/logs/monitor.log")
        print("  watch nodes with:     pylon cluster status")
    print(f"  add a machine with:   pylon cluster join {info.gcs_address} --token-file <a copy of the token file>")
    print("  stop it with:         pylon cluster down")
    return 0


def _print_ha(pylon_home: str) -> None:
    """The GCS fault tolerance lines of `up` (`--ha`): the Redis address and password file, never the password."""
    from pylon.infra import ha

    record = ha.read_record(Path(pylon_home))
    if record is not None:
        print(
            f"  GCS fault tolerance:  on, tables in Redis at {record.redis_address} (password file "
            f"{record.password_file}); a supervisor restarts the GCS (log: {Path(pylon_home) / ha.SUPERVISOR_LOG})"
        )


def _ha_summary(address: str | None) -> dict | None:
    """GCS fault tolerance of the local cluster (`up --ha`), when `status` shows that one."""
    from pylon import home
    from pylon.infra import ha

    state = home.read_state()
    if state is None or address not in (None, state.dashboard_url, state.gcs_address):
        return None
    record = ha.read_record(Path(state.home))
    return record.summary() if record is not None else None


def _start_metrics(info, rules_file: str | None) -> None:
    """`up --metrics`: Prometheus for the cluster (pylon.infra.prometheus), and where it is."""
    from pylon.infra import prometheus

    record, started = prometheus.start(Path(info.home), info.temp_dir, rules_file=rules_file)
    print(f"  Prometheus:           {record.url}  ({'started' if started else 'already running'}; 127.0.0.1 only)")
    print(f"  Prometheus rules:     {record.rules}  (alerts: {record.url}/alerts)")


def _cmd_cluster_join(args: argparse.Namespace) -> int:
    from pylon.infra import local as cluster

    print(f"joining the Ray cluster at {args.head_address} (token authentication on)...", file=sys.stderr)
    node, started = cluster.join(
        args.head_address,
        token_file=args.token_file,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        memory=_gib_to_bytes(args.memory_gib),
        object_store_memory=_gib_to_bytes(args.object_store_gib),
        resources=args.resources,
        labels=args.labels,
        node_ip_address=args.node_ip_address,
    )
    print(("joined" if started else "already joined") + f" the Ray cluster at {node.head_address} as a worker node")
    print(f"  node id:              {node.node_id}")
    print(f"  node IP:              {node.node_ip}")
    print(f"  resources:            {_resources(node.resources)}")
    labels = {k: v for k, v in node.labels.items() if k != "ray.io/node-id"}
    print(f"  labels:               {', '.join(f'{k}={v}' for k, v in sorted(labels.items())) or 'none'}")
    if node.gpu_type:
        print(
            f"  GPU type:             {node.gpu_type} (Ray's own detection: resource accelerator_type:{node.gpu_type})"
        )
    print(f"  Ray logs:             {node.temp_dir}/session_latest/logs")
    print(f"  auth token file:      {node.token_path}")
    if node.head_dashboard:
        print(f"  head dashboard:       {node.head_dashboard}  (as the head records it)")
    print("  leave with:           pylon cluster down" + _home_hint(node.home))
    return 0


def _resources(resources: dict[str, float]) -> str:
    shown = []
    for name, amount in sorted(resources.items()):
        if name.startswith("node:"):
            continue
        shown.append(f"{name} {amount / 2**30:.1f} GiB" if "memory" in name else f"{name} {amount:g}")
    return ", ".join(shown) or "none"


def _home_hint(node_home: str) -> str:
    """Which PYLON_HOME `down` needs, where the node's is not the default one."""
    return "" if str((Path.home() / ".pylon").resolve()) == node_home else f"   (with PYLON_HOME={node_home})"


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    import pylon

    status = pylon.connect(args.address).status()
    ha_summary = _ha_summary(args.address)
    if args.json:
        print(
            json.dumps(
                {
                    "dashboard_url": status.dashboard_url,
                    "gcs_address": status.gcs_address,
                    "nodes": [asdict(n) for n in status.nodes],
                    "resources": status.total_resources(),
                    "jobs": [asdict(j) for j in status.jobs],
                    "ha": ha_summary or {"gcs_fault_tolerance": False},
                },
                indent=2,
            )
        )
    else:
        print(status)
        if ha_summary:
            print(
                f"GCS fault tolerance: on (Redis at {ha_summary['redis_address']}"
                f"{'' if ha_summary['redis_running'] else ', NOT RUNNING'}; supervisor "
                f"{'running' if ha_summary['supervisor_running'] else 'NOT RUNNING'}; "
                f"GCS restarts: {ha_summary['gcs_restarts']})"
            )
    return 0


def _cmd_cluster_down(args: argparse.Namespace) -> int:
    from pylon.infra import local as cluster

    stopped = cluster.down()
    if stopped is None:
        print("no cluster started by `pylon cluster up` or node by `pylon cluster join` is recorded; nothing to stop")
    elif isinstance(stopped, cluster.JoinedNode):
        node_id = stopped.node_id or "(not yet listed)"
        print(f"stopped the Ray node {node_id}: it left the cluster at {stopped.head_address}")
    else:
        print(f"stopped the local Ray cluster at {stopped.dashboard_url}")
    return 0


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


NODE_IP_HELP = (
    "the address Ray advertises for this node, for machines with several networks (default: Ray's choice, the "
    "address of the interface that routes outward)"
)


def add_cluster_parser(sub, fmt) -> None:
    c = sub.add_parser(
        "cluster",
        formatter_class=fmt,
        help="start, grow, inspect or stop the Ray cluster",
        description="The embedded default: a real Ray head on this machine, dashboard and Jobs "
        "API on 127.0.0.1 (or --host), Ray's token authentication on; other machines join it as "
        "worker nodes. State lives in $PYLON_HOME (default ~/.pylon).",
        epilog="examples:\n  pylon cluster up --num-cpus 4\n  pylon cluster status --json\n  pylon cluster down\n"
        "  pylon cluster up --host 0.0.0.0                                 # on the first machine\n"
        "  pylon cluster join 10.0.0.1:6379 --token-file ~/head-token      # on each other machine",
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
        "  PYLON_HOME=/tmp/other pylon cluster up --dashboard-port 8266   # a second cluster\n"
        "  pylon cluster up --host 0.0.0.0               # other machines may join and submit (token auth on)\n"
        "  pylon cluster up --ha                         # the GCS survives a crash (Redis + a supervisor)\n"
        "  pylon cluster up --metrics                    # and a Prometheus with Pylon's alert rules",
    )
    up.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    up.add_argument("--num-gpus", type=int, help="GPUs Ray may schedule (default: detected)")
    up.add_argument("--object-store-gib", type=float, help="object store size in GiB (default: Ray's choice)")
    up.add_argument("--port", type=int, help="GCS port (default 6379, or a free one if taken)")
    up.add_argument("--dashboard-port", type=int, help="dashboard/Jobs API port (default 8265, or a free one)")
    up.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address the dashboard/Jobs API binds to: 127.0.0.1 (this machine only), one of this machine's "
        "addresses, or 0.0.0.0 (every interface); off loopback is safe because token authentication is on "
        "(default 127.0.0.1; docs/security.md lists what else listens where)",
    )
    up.add_argument("--node-ip-address", metavar="IP", help=NODE_IP_HELP)
    up.add_argument(
        "--labels",
        metavar="K=V,...",
        help="the head node's Ray labels (Kubernetes label syntax), e.g. pool=decode; tasks and replicas "
        "(replica.labels, prefill.replica.labels) select nodes by them",
    )
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
    up.add_argument(
        "--ha",
        action="store_true",
        help="GCS fault tolerance, as KubeRay configures it: the GCS keeps its tables in a Redis started here "
        "(127.0.0.1, password in $PYLON_HOME/redis_password) and a supervisor restarts it when it dies; serving "
        "and jobs carry on (needs the redis-server package; docs/many-machines.md)",
    )
    up.add_argument(
        "--metrics",
        action="store_true",
        help="also start Prometheus (Debian's prometheus package) on 127.0.0.1, scraping every node of the cluster "
        "and evaluating Pylon's recording and alert rules; data and config in $PYLON_HOME/prometheus, stopped by "
        "`pylon cluster down` (docs/observability.md)",
    )
    up.add_argument(
        "--metrics-rules",
        metavar="RULES_YAML",
        help="with --metrics: a Prometheus rules file to load instead of Pylon's (infra/prometheus/rules.yml)",
    )
    up.set_defaults(func=_cmd_cluster_up)
    join = csub.add_parser(
        "join",
        formatter_class=fmt,
        help="start a worker node here that joins a running cluster",
        description="Start a Ray worker node on this machine (`ray start --address`) that joins the "
        "cluster whose head's GCS address is HEAD_ADDRESS, with token authentication. Checks that the "
        "head answers and accepts the token first; waits until the node is ALIVE; prints its id, IP and "
        "resources. `pylon cluster down` (same PYLON_HOME) stops exactly this node. Ray adds a GPU type "
        "resource (accelerator_type:<type>) and label (ray.io/accelerator-type) itself where it finds NVIDIA "
        "GPUs. One PYLON_HOME holds one head or one joined node.",
        epilog="examples:\n"
        "  pylon cluster join 10.0.0.1:6379 --token-file ~/head-token\n"
        "  pylon cluster join 10.0.0.1:6379 --num-gpus 8 --labels zone=a,disk=nvme\n"
        "  pylon cluster join 10.0.0.1:6379 --resources '{\"nvme\": 1}' --object-store-gib 32\n"
        "  PYLON_HOME=/tmp/node2 pylon cluster join 127.0.0.1:6379 --num-cpus 2   # a second node on one machine",
    )
    join.add_argument(
        "head_address",
        metavar="HEAD_ADDRESS",
        help="the head's GCS address HOST:PORT, as `pylon cluster up` prints it (not the dashboard URL)",
    )
    join.add_argument(
        "--token-file",
        metavar="PATH",
        help="the cluster's token file, a copy of the head's $PYLON_HOME/auth_token (default: RAY_AUTH_TOKEN, "
        "else RAY_AUTH_TOKEN_PATH, else $PYLON_HOME/auth_token, else ~/.ray/auth_token); it is copied to "
        "$PYLON_HOME/auth_token (mode 0600)",
    )
    join.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule here (default: all)")
    join.add_argument("--num-gpus", type=int, help="GPUs Ray may schedule here (default: detected)")
    join.add_argument("--memory-gib", type=float, help="memory for tasks and actors in GiB (default: what is free)")
    join.add_argument("--object-store-gib", type=float, help="object store size in GiB (default: Ray's choice)")
    join.add_argument("--resources", metavar="JSON", help="custom resources, e.g. '{\"nvme\": 1}'")
    join.add_argument(
        "--labels",
        metavar="K=V,...",
        help="Ray node labels (Kubernetes label syntax), e.g. zone=a,disk=nvme; tasks select nodes by them "
        "with label_selector",
    )
    join.add_argument("--node-ip-address", metavar="IP", help=NODE_IP_HELP)
    join.set_defaults(func=_cmd_cluster_join)
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
        help="stop the cluster `pylon cluster up` started, or the node `join` started (nothing else)",
        formatter_class=fmt,
        description="Stop exactly the Ray processes `pylon cluster up` (the head) or `pylon cluster "
        "join` (a worker node, which then leaves its cluster) started from this PYLON_HOME; other Ray "
        "clusters and nodes on this machine are left alone.",
        epilog="examples:\n  pylon cluster down\n  PYLON_HOME=/tmp/other pylon cluster down",
    )
    dn.set_defaults(func=_cmd_cluster_down)
