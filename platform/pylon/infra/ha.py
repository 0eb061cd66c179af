"""A head that survives: Ray's GCS fault tolerance on a local cluster (`pylon cluster up --ha`).

Ray keeps the GCS's tables (nodes, actors, jobs, placement groups, internal KV) in an external Redis when
`RAY_REDIS_ADDRESS` names one at `ray start --head`; a GCS that restarts reads them back, and raylets, workers and
drivers reconnect to it (each waits up to `gcs_rpc_server_reconnect_timeout_s`, 60 s by default). That is how
KubeRay runs it (`gcsFaultToleranceOptions`; the head pod restarts the GCS). Locally nothing would restart a killed
GCS, so `up(ha=True)` starts, besides the head:

- `redis-server` (Debian's package), on 127.0.0.1 only (only the head's GCS talks to it) at a free port, always with
  a password (`requirepass`, in a 0600 config file: not on its command line), data (append-only file) in
  `$PYLON_HOME/redis/`. The password lives in `$PYLON_HOME/redis_password` (0600); records, logs and errors name
  the file, never the password. Ray itself passes it to the GCS as a command-line flag (`--redis_password`, as it
  does under KubeRay): other local users who can read /proc see it there (docs/many-machines.md).
- a supervisor (`supervise_main`, a small Python process) that watches the head's `gcs_server` and, when it exits,
  starts it again with the same command line, environment and working directory (read from /proc when the
  supervisor starts). It stops once the head's raylet is gone (the cluster is stopping) and gives up after
  `MAX_RESTARTS` restarts within `RESTART_WINDOW_S` (a GCS that cannot start), logging to
  `$PYLON_HOME/gcs-supervisor.log`.

`$PYLON_HOME/ha.json` records both (pids, Redis address, password file, never the password); `stop` ends them by
those pids (each checked to still be that program), never by name.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from pylon import storage
from pylon.errors import ClusterError

REDIS_PACKAGE = "redis-server"  # Debian's package, and its program
HA_FILE = "ha.json"
PASSWORD_FILE = "redis_password"
REDIS_CONF = "redis.conf"
REDIS_DIR = "redis"
SUPERVISOR_LOG = "gcs-supervisor.log"
RESTART_ERR = "gcs-restart.err"
GCS_NAME = "gcs_server"
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
POLL_S = 0.2


@dataclass
class HaRecord:
    """What `up --ha` started besides Ray, as recorded in `$PYLON_HOME/ha.json` (no secret in it)."""

    redis_address: str  # host:port, loopback
    redis_pid: int
    redis_started: float  # the process's create_time, to recognise it before stopping it
    password_file: str
    supervisor_pid: int = 0
    supervisor_started: float = 0.0
    gcs_pid: int = 0  # the GCS the supervisor watches first (it logs later ones)

    def summary(self) -> dict:
        """For `pylon cluster status`: the Redis address and whether the supervisor runs; no password."""
        return {
            "gcs_fault_tolerance": True,
            "redis_address": self.redis_address,
            "redis_running": _same_process(self.redis_pid, self.redis_started),
            "supervisor_running": _same_process(self.supervisor_pid, self.supervisor_started),
            "gcs_restarts": gcs_restarts(Path(self.password_file).parent),
        }


def redis_server() -> str:
    """The `redis-server` program; ClusterError naming the package where it is missing."""
    found = shutil.which(REDIS_PACKAGE) or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)), None
    )
    if not found:
        raise ClusterError(
            f"`--ha` (GCS fault tolerance) needs Redis: the `{REDIS_PACKAGE}` program was not found. Install the "
            f"`{REDIS_PACKAGE}` package (`make system-packages` as root, or `apt-get install -y {REDIS_PACKAGE}`)"
        )
    return found


def read_record(home: Path) -> HaRecord | None:
    try:
        return HaRecord(**json.loads((home / HA_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ClusterError(f"{home / HA_FILE}: unreadable record ({e}); stop its Redis and remove it") from None


def _write_record(home: Path, record: HaRecord) -> None:
    storage.atomic_write_json(str(home / HA_FILE), asdict(record))


def _write_secret(path: Path, text: str) -> None:
    """`text` into `path`, created with mode 0600 (never readable by others, not even for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def start_redis(home: Path, port: int, timeout_s: float = 30.0) -> HaRecord:
    """A fresh Redis for this cluster's GCS: 127.0.0.1:`port`, a new password, an empty data dir under `home`."""
    program = redis_server()
    home.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(32)
    password_file = home / PASSWORD_FILE
    _write_secret(password_file, password)
    data = home / REDIS_DIR
    shutil.rmtree(data, ignore_errors=True)  # a new cluster: no tables of an earlier one
    data.mkdir(mode=0o700)
    conf = home / REDIS_CONF
    _write_secret(
        conf,
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                "protected-mode yes",
                f"requirepass {password}",
                f'dir "{data}"',
                'dbfilename "dump.rdb"',
                'save ""',
                "appendonly yes",
                "appendfsync everysec",
                "daemonize no",
                f'logfile "{home / "redis.log"}"',
                "",
            ]
        ),
    )
    proc = subprocess.Popen(
        [program, str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives `pylon cluster up`; `stop` ends it by pid
    )
    record = HaRecord(
        redis_address=f"127.0.0.1:{port}",
        redis_pid=proc.pid,
        redis_started=psutil.Process(proc.pid).create_time(),
        password_file=str(password_file),
    )
    _write_record(home, record)  # before waiting: `stop` can always find it
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            last = f"redis-server exited with {proc.returncode}"
            break
        last = redis_ping("127.0.0.1", port, password) or ""
        if not last:
            return record
        time.sleep(0.1)
    stop(home)
    raise ClusterError(f"Redis for GCS fault tolerance did not start ({last}); see {home / 'redis.log'}")


def flush_redis(record: HaRecord) -> None:
    """Empty the cluster's Redis (before a second `ray start --head`: the first GCS's session is in it)."""
    host, port = record.redis_address.rsplit(":", 1)
    problem = redis_ping(host, int(port), Path(record.password_file).read_text().strip(), command="FLUSHALL")
    if problem:
        raise ClusterError(f"could not empty the Redis at {record.redis_address} before starting again: {problem}")


def redis_ping(host: str, port: int, password: str, timeout_s: float = 2.0, command: str = "PING") -> str | None:
    """None when Redis at host:port accepts `password` and answers `command` (PING, or FLUSHALL) with +PONG / +OK;
    else what went wrong (no secret in it)."""

    def bulk(*words: str) -> bytes:
        out = f"*{len(words)}\r\n".encode()
        for w in words:
            b = w.encode()
            out += b"$%d\r\n%s\r\n" % (len(b), b)
        return out

    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(bulk("AUTH", password) + bulk(command))
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = s.recv(256)
                if not chunk:
                    break
                reply += chunk
    except OSError as e:
        return e.strerror or type(e).__name__
    expected = b"+OK\r\n" + (b"+PONG" if command == "PING" else b"+OK")
    return None if reply.startswith(expected) else reply.decode(errors="replace").split("\r\n")[0]


def ray_env(record: HaRecord) -> dict[str, str]:
    """What `ray start --head` needs in its environment for GCS fault tolerance."""
    return {"RAY_REDIS_ADDRESS": record.redis_address}


def ray_start_args(record: HaRecord) -> list[str]:
    """What `ray start --head` needs on its command line: Ray takes the Redis password only as a flag."""
    return [f"--redis-password={Path(record.password_file).read_text().strip()}"]


def start_supervisor(home: Path, temp_dir: Path, processes: list[psutil.Process]) -> HaRecord:
    """Start the GCS supervisor for the head whose processes (`processes`, from `ray start --head`) include one
    gcs_server and one raylet; record it."""
    record = read_record(home)
    if record is None:
        raise ClusterError(f"{home / HA_FILE} is missing: Redis for GCS fault tolerance was not started")
    gcs = [p for p in processes if _name(p) == GCS_NAME]
    raylets = [p for p in processes if _name(p) == "raylet"]
    if len(gcs) != 1 or not raylets:
        raise ClusterError(f"the head's gcs_server and raylet were not found among its processes ({temp_dir})")
    pid = gcs[0].pid
    # Read here, now, and handed over on the supervisor's stdin (the command line holds the Redis password: not
    # in a file, nor on the supervisor's command line): a GCS that dies before the supervisor runs is restarted too.
    try:
        how = {
            "cmdline": Path(f"/proc/{pid}/cmdline").read_bytes().decode("latin-1").split("\0")[:-1],
            "environ": Path(f"/proc/{pid}/environ").read_bytes().decode("latin-1").split("\0"),
            "cwd": os.readlink(f"/proc/{pid}/cwd"),
        }
    except OSError as e:
        raise ClusterError(f"cannot read the head's gcs_server ({pid}) from /proc: {e.strerror}") from None
    code = "import sys; from pylon.infra.ha import supervise_main; sys.exit(supervise_main(sys.argv[1:]))"
    # The temp dir on the command line: the cluster's processes are found by it (`LocalCluster.processes`).
    cmd = [sys.executable, "-c", code, f"--temp-dir={temp_dir}", str(home), str(pid), str(raylets[0].pid)]
    log = open(home / SUPERVISOR_LOG, "a")  # noqa: SIM115 -- handed to the child
    with log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.stdin.write(json.dumps(how).encode())
    proc.stdin.close()
    record.supervisor_pid = proc.pid
    record.supervisor_started = psutil.Process(proc.pid).create_time()
    record.gcs_pid = gcs[0].pid
    _write_record(home, record)
    return record


def stop_supervisor(home: Path, timeout_s: float = 10.0) -> None:
    """End the supervisor first when a cluster stops: it would otherwise start the GCS `down` just stopped."""
    record = read_record(home)
    if record is not None and record.supervisor_pid:
        _end(record.supervisor_pid, record.supervisor_started, timeout_s)


def stop(home: Path, timeout_s: float = 10.0) -> None:
    """End the supervisor and Redis this home's `up --ha` started (by their recorded pids); remove the record
    and the password (a new `up --ha` makes a new one). The data dir stays until the next `up --ha`."""
    record = read_record(home)
    if record is None:
        return
    if record.supervisor_pid:
        _end(record.supervisor_pid, record.supervisor_started, timeout_s)
    _end(record.redis_pid, record.redis_started, timeout_s)
    for name in (HA_FILE, PASSWORD_FILE, REDIS_CONF):
        (home / name).unlink(missing_ok=True)


def gcs_restarts(home: Path) -> int:
    """How many times the supervisor restarted the GCS (its log's `restarted` lines)."""
    try:
        return sum(1 for line in (home / SUPERVISOR_LOG).read_text().splitlines() if " restarted gcs_server" in line)
    except FileNotFoundError:
        return 0


def _same_process(pid: int, started: float) -> bool:
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _end(pid: int, started: float, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL, the process `pid` if it still is the one started at `started`."""
    if not _same_process(pid, started):
        return
    p = psutil.Process(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            p.send_signal(sig)
            p.wait(timeout_s)
            return
        except psutil.NoSuchProcess:
            return
        except psutil.TimeoutExpired:
            continue
        except ChildProcessError:  # not our child: poll instead
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _same_process(pid, started):
                time.sleep(0.05)
            if not _same_process(pid, started):
                return


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def _alive(pid: int, child: subprocess.Popen | None) -> bool:
    if child is not None:
        return child.poll() is None
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", flush=True)


def supervise_main(argv: list[str]) -> int:
    """The supervisor: `--temp-dir=DIR HOME GCS_PID RAYLET_PID`. Restarts the GCS with the command line,
    environment and working directory it had, whenever it exits while the head's raylet runs. Logs pids and
    counts only (the GCS's command line holds the Redis password)."""
    home, gcs_pid, raylet_pid = Path(argv[1]), int(argv[2]), int(argv[3])  # argv[0]: the temp dir, a marker
    how = json.loads(sys.stdin.read())  # from `start_supervisor`: the GCS's command line, environment, directory
    cmd = [a.encode("latin-1") for a in how["cmdline"]]
    env = {k.encode("latin-1"): v.encode("latin-1") for k, _, v in (e.partition("=") for e in how["environ"] if e)}
    cwd = how["cwd"]
    stopping = False

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    _log(f"watching gcs_server {gcs_pid} (head raylet {raylet_pid}); Redis-backed GCS fault tolerance on")
    child: subprocess.Popen | None = None
    restarts: list[float] = []
    while not stopping:
        time.sleep(POLL_S)
        if _alive(gcs_pid, child):
            continue
        if stopping:
            break
        if not _alive(raylet_pid, None):
            _log(f"gcs_server {gcs_pid} exited and the head raylet {raylet_pid} is gone: the cluster stopped")
            return 0
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(restarts) > MAX_RESTARTS:
            _log(f"gcs_server exited {len(restarts)} times within {RESTART_WINDOW_S:.0f}s; giving up")
            return 1
        exit_code = child.returncode if child is not None else "?"
        try:
            # The GCS writes its own log files (--stdout_filepath, --stderr_filepath); what it prints before it
            # opens them goes to gcs-restart.err.
            with open(home / RESTART_ERR, "ab") as err:
                child = subprocess.Popen(
                    cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
                )
        except OSError as e:
            _log(f"could not start gcs_server again ({e.strerror}); giving up")
            return 1
        _log(f"gcs_server {gcs_pid} exited (code {exit_code}); restarted gcs_server as {child.pid}")
        gcs_pid = child.pid
    _log("stopping (asked to)")
    return 0
