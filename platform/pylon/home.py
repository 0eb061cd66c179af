"""Where Pylon's local state lives and how a process finds and joins its cluster.

`$PYLON_HOME` (default `~/.pylon`) holds `cluster.json` (what `pylon cluster up` started) and `auth_token` (the
cluster's Ray token, mode 0600). `resolve(address)` turns an address (or `RAY_ADDRESS`, or the local cluster) into
a dashboard URL, a GCS address and a token; `init_ray` makes this process a Ray driver of that cluster. The SDK's
`connect()`, the training driver and Ray Data readers all go through here, so none of them imports another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import psutil
import requests

from pylon import settings
from pylon.errors import ClusterError

STATE_FILE = "cluster.json"
TOKEN_FILE = "auth_token"

pylon_home = settings.pylon_home  # where Pylon keeps its local state: $PYLON_HOME, else ~/.pylon


@dataclass
class LocalCluster:
    """What `up` started, as recorded in `$PYLON_HOME/cluster.json`."""

    gcs_address: str
    dashboard_url: str
    temp_dir: str
    token_path: str
    gcs_port: int
    dashboard_port: int
    client_server_port: int
    started_at: float
    home: str
    serve_port: int = 8000  # where Serve's HTTP ingress (HAProxy) listens once something is deployed
    metrics_port: int = 0  # Ray's Prometheus endpoint on the head (Serve and Pylon metrics)
    autoscaler_config: str = ""  # with `up --autoscale`: the autoscaling config the head runs with

    @property
    def jobs_api(self) -> str:
        return self.dashboard_url

    def auth_env(self) -> dict[str, str]:
        """Environment that lets Ray clients (and `ray job submit`) authenticate to this cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}

    def processes(self) -> list[psutil.Process]:
        """Live processes of this cluster: those naming its temp dir or GCS address, and their descendants."""
        return ray_processes((self.temp_dir, self.gcs_address))

    def is_running(self) -> bool:
        # The dashboard listens where `up --host` said: 127.0.0.1, one address, or all (recorded as this machine's).
        host = urlparse(self.dashboard_url).hostname or "127.0.0.1"
        return _port_open(host, self.dashboard_port) and bool(self.processes())


def ray_processes(markers: tuple[str, ...]) -> list[psutil.Process]:
    """Live processes whose command line names one of `markers` (a Ray temp dir, a GCS address), and their
    descendants (workers, agents), this process excepted. Only those that see this process's files: one in
    another mount namespace (a container, or a simulated machine of the test suite) has its own /tmp, so a temp
    dir of the same name there is another directory, and a raylet there naming our GCS is another machine's."""
    roots = []
    mine = _mount_namespace(os.getpid())
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(m in arg for arg in cmdline for m in markers) and _mount_namespace(proc.pid) == mine:
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = {p.pid: p for p in roots}
    for root in roots:
        try:
            for child in root.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            continue
    me = os.getpid()
    return [p for pid, p in found.items() if pid != me and _alive(p)]


def _mount_namespace(pid: int) -> str | None:
    """The mount namespace of process `pid` (Linux), or None where that cannot be read (then all look alike)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ray_temp_dir(home: Path) -> Path:
    """Ray's temp dir for the cluster of `home`. Short, because Ray puts Unix sockets below it
    (socket paths are limited to 107 bytes), and unique to `home`, because it marks our processes."""
    return Path(tempfile.gettempdir()) / f"pylon-{hashlib.sha1(str(home).encode()).hexdigest()[:10]}"


def read_state(home: Path | None = None) -> LocalCluster | None:
    path = (home or pylon_home()) / STATE_FILE
    try:
        return LocalCluster(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ClusterError(f"{path}: unreadable cluster state ({e}); remove it and run `pylon cluster up`") from None


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ClusterError(f"cannot read the cluster's auth token at {path}: {e.strerror}") from None


def user_token() -> str | None:
    """The token Ray itself would use for a cluster Pylon did not start."""
    if token := settings.value(settings.RAY_AUTH_TOKEN):
        return token.strip()
    path = Path(settings.value(settings.RAY_AUTH_TOKEN_PATH) or Path.home() / ".ray" / "auth_token").expanduser()
    return path.read_text().strip() if path.is_file() else None


# The header a deployment's prefix-aware router (pylon.serving.api.routing) requires of HAProxy, which
# `pylon-haproxy` (pylon.infra.haproxy) adds to Ray's Lua script.
ROUTER_KEY_HEADER = "X-Pylon-Router-Key"


def router_key(token: str | None = None) -> str | None:
    """The key HAProxy sends a deployment's ingress request router: HMAC-SHA256 of a fixed label under the cluster's
    Ray token (`user_token()` unless given; never the token itself). None on a cluster without a token."""
    token = user_token() if token is None else token
    if not token:
        return None
    return hmac.new(token.encode(), b"pylon ingress request router", hashlib.sha256).hexdigest()


def use_cluster_auth(token_path: str) -> None:
    """Let Ray's own clients in this process (ray.init, state API, Ray Data) authenticate too."""
    if settings.value(settings.RAY_AUTH_TOKEN) or settings.value(settings.RAY_AUTH_TOKEN_PATH):
        return  # the user chose a token explicitly; keep it
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = token_path
    if "ray._raylet" in sys.modules:
        # Ray read its auth mode when it was imported; make it read the environment again (as Ray's own
        # `ray.init()` does when it turns token auth on for a new local cluster).
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


HOW_TO_START = (
    "Start the embedded local cluster with `pylon cluster up`, or point at a running one with "
    "`pylon.connect('http://HOST:8265')` / `export RAY_ADDRESS=http://HOST:8265`."
)


@dataclass
class ClusterAddress:
    """How to reach one cluster: its dashboard (Jobs and State APIs), its GCS (Ray drivers) and the token."""

    dashboard_url: str
    gcs_address: str | None = None
    token: str | None = None
    # True only for the cluster `pylon cluster up` started from this $PYLON_HOME: its head is this machine, so a
    # local path means the same file here and there. Any other address is taken to share no disk with us.
    shares_disk: bool = False

    def __repr__(self) -> str:  # the token never appears here
        return f"ClusterAddress(dashboard_url={self.dashboard_url!r}, gcs_address={self.gcs_address!r})"

    @property
    def headers(self) -> dict[str, str]:
        """What the dashboard's HTTP APIs need to let a request in."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


@dataclass
class NodeInfo:
    node_id: str
    ip: str
    state: str
    is_head: bool
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)  # Ray node labels: `join --labels`, Ray's own ray.io/...


def cluster_nodes(where: ClusterAddress) -> list[NodeInfo]:
    """The cluster's nodes, alive or not, from Ray's state API on its dashboard (no Ray driver needed)."""
    from ray.util.state import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    api = StateApiClient(address=where.dashboard_url, headers={"Content-Type": "application/json", **where.headers})
    rows = api.list(StateResource.NODES, options=ListApiOptions(detail=True), raise_on_missing_output=False)
    return [
        NodeInfo(
            node_id=n.node_id,
            ip=n.node_ip,
            state=n.state,
            is_head=bool(n.is_head_node),
            resources=dict(n.resources_total or {}),
            labels=dict(n.labels or {}),
        )
        for n in rows
    ]


def resolve(address: str | None = None) -> ClusterAddress:
    """`address`, else `RAY_ADDRESS`, else the cluster `pylon cluster up` started. For a cluster Pylon started,
    Ray's own clients in this process are pointed at its token too (`use_cluster_auth`)."""
    state = read_state()
    address = address or settings.value(settings.RAY_ADDRESS)
    if address in (None, "auto"):
        if state is None or not state.is_running():
            raise ClusterError("no Ray cluster is running. " + HOW_TO_START)
        ours = True
    elif address.startswith("ray://"):
        raise ClusterError(
            f"{address}: Ray Client addresses are not supported; give the dashboard URL (http://HOST:8265) instead"
        )
    else:
        ours = state is not None and address in (
            state.dashboard_url,
            state.gcs_address,
            f"127.0.0.1:{state.gcs_port}",
            f"localhost:{state.gcs_port}",
        )
    if ours:
        use_cluster_auth(state.token_path)
        return ClusterAddress(state.dashboard_url, state.gcs_address, read_token(state.token_path), shares_disk=True)
    on_a_node = on_cluster_node()
    if address.startswith(("http://", "https://")):
        return ClusterAddress(address, token=user_token(), shares_disk=on_a_node)
    host = address.rsplit(":", 1)[0]
    return ClusterAddress(f"http://{host}:8265", gcs_address=address, token=user_token(), shares_disk=on_a_node)


def on_cluster_node() -> bool:
    """Whether this process is a Ray job's entrypoint, so runs on a node of the cluster (its local paths are that
    node's, as the job's Ray tasks pinned to it see them)."""
    return settings.value(settings.RAY_JOB_CONFIG) is not None


def job_working_dir() -> str | None:
    """The working directory of the Ray job this process is the entrypoint of, when its runtime_env has one (the
    process runs in it, and Ray gives every worker and task of the job its own copy on its node)."""
    raw = settings.value(settings.RAY_JOB_CONFIG)
    if raw is None:
        return None
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return os.getcwd() if runtime_env.get("working_dir") else None


def ping(where: ClusterAddress, timeout_s: float = 10.0) -> str:
    """The cluster's Ray version; ClusterError when it cannot be reached or refuses the token."""
    url = f"{where.dashboard_url}/api/version"
    try:
        r = requests.get(url, headers=where.headers, timeout=timeout_s)
    except requests.RequestException as e:
        raise ClusterError(
            f"no Ray cluster answers at {where.dashboard_url} ({type(e).__name__}). " + HOW_TO_START
        ) from None
    if r.status_code in (401, 403):
        raise ClusterError(
            f"the Ray cluster at {where.dashboard_url} refused the request (HTTP {r.status_code}): token "
            "authentication is on and no valid token was found. Set RAY_AUTH_TOKEN_PATH to the cluster's "
            "token file (for `pylon cluster up` clusters: $PYLON_HOME/auth_token)."
        )
    if r.status_code != 200:
        raise ClusterError(f"{url} answered HTTP {r.status_code}; is this a Ray dashboard address?")
    return r.json().get("ray_version", "unknown")


def init_ray(where: ClusterAddress | str | None = None, **kwargs) -> None:
    """Connect this process to the cluster as a Ray driver (for Ray Data, tasks), once. Given an address (or
    nothing), the cluster is resolved and checked first (`ping`), as `pylon.connect()` does."""
    import ray  # heavy: only the processes that become drivers pay for it

    if ray.is_initialized():
        return
    if not isinstance(where, ClusterAddress):
        where = resolve(where)
        ping(where)
    if not where.gcs_address:
        raise ClusterError(
            f"the GCS address of {where.dashboard_url} is unknown; connect with the GCS "
            "address (HOST:6379) to run Ray work from this process"
        )
    ray.init(address=where.gcs_address, **{"log_to_driver": False, **kwargs})
    _raylet_messages_to_stderr()


def _raylet_messages_to_stderr() -> None:
    """Ray prints the cluster's error messages (a raylet's "WARNING: 8 PYTHON worker processes have been started
    ...") to every driver's standard output, from a thread of its own, whenever they come, `log_to_driver` or not;
    in a `pylon ... --json` that broke the JSON on stdout (CI, `pylon jobs list --json`). They are diagnostics: this
    process prints them to stderr instead. (Ray's thread looks `print_to_stdstream` up in its module each time.)"""
    import functools

    from ray._private import worker

    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "pylon_to_stderr", False):
        return

    @functools.wraps(original)
    def to_stderr(data, *args, **kwargs):
        return original({**data, "is_err": True}, *args, **kwargs)

    to_stderr.pylon_to_stderr = True
    worker.print_to_stdstream = to_stderr
