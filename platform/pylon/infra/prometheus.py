"""A Prometheus for the local cluster (`pylon cluster up --metrics`).

It runs Debian's `prometheus` program (the package, installed by `make system-packages` where root; never the
package's own service) as a child of nobody: its own config, rules and data under `$PYLON_HOME/prometheus/`,
listening on 127.0.0.1 only (no credentials: nothing else may reach it). It scrapes every node Ray's head lists in its
service discovery file (`<temp dir>/session_latest/prom_metrics_service_discovery.json`, kept current as nodes
join and leave) and evaluates Pylon's recording and alert rules (`pylon.infra.observability.prometheus_rules`, the
same as `infra/prometheus/rules.yml`), or the rules file the caller names.

`$PYLON_HOME/prometheus.json` records the process (pid and start time) and its address; `stop` (which `pylon cluster
down` calls) ends that process by its pid, checked to still be that Prometheus, never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import yaml

from pylon import storage
from pylon.errors import ClusterError
from pylon.infra.observability import local_prometheus_config, rules_text

PROMETHEUS_FILE = "prometheus.json"
PROMETHEUS_DIR = "prometheus"
DEFAULT_PORT = 9090  # Prometheus' usual port, when free; else any free one
INSTALL_HELP = (
    "the `prometheus` program is not installed: install Debian's package as root (`apt-get install prometheus`, "
    "or `make system-packages` in the repository), or put a Prometheus 2.x binary on PATH"
)


@dataclass
class PrometheusRecord:
    """What `start` started, as recorded in `$PYLON_HOME/prometheus.json`."""

    url: str  # http://127.0.0.1:PORT
    pid: int
    started: float  # the process's create_time, to recognise it before stopping it
    config: str
    rules: str
    data_dir: str
    log: str

    def is_running(self) -> bool:
        return _same_process(self.pid, self.started)


def prometheus_program() -> str:
    """The `prometheus` program; ClusterError saying how to install it where it is missing."""
    found = shutil.which("prometheus")
    if not found:
        raise ClusterError(INSTALL_HELP)
    return found


def read_record(home: Path) -> PrometheusRecord | None:
    try:
        return PrometheusRecord(**json.loads((home / PROMETHEUS_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ClusterError(f"{home / PROMETHEUS_FILE}: unreadable record ({e}); stop its process and remove it")


def start(
    home: Path,
    temp_dir: str,
    *,
    rules_file: str | os.PathLike | None = None,
    interval_s: float = 5.0,
    port: int | None = None,
    timeout_s: float = 60.0,
) -> tuple[PrometheusRecord, bool]:
    """Start Prometheus for the cluster whose Ray temp dir is `temp_dir`; returns (record, started). One already
    running from `home` is returned as is. `rules_file`: rules to load instead of Pylon's own (their default
    thresholds); `interval_s`: the scrape and rule evaluation interval."""
    existing = read_record(home)
    if existing is not None:
        if existing.is_running():
            return existing, False
        (home / PROMETHEUS_FILE).unlink(missing_ok=True)
    program = prometheus_program()
    folder = home / PROMETHEUS_DIR
    data_dir = folder / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yml"
    if rules_file is not None:
        text = Path(rules_file).read_text()
    else:
        text = rules_text()
    storage.atomic_write_text(str(rules), text)
    config = folder / "prometheus.yml"
    storage.atomic_write_text(
        str(config), yaml.safe_dump(local_prometheus_config(temp_dir, str(rules), interval_s), sort_keys=False)
    )
    check = _promtool_check(config)
    if check:
        raise ClusterError(f"the Prometheus config or rules do not pass `promtool check config`:\n{check}")
    port = port or _port(DEFAULT_PORT)
    log = folder / "prometheus.log"
    cmd = [
        program,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=7d",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=folder
        )
    record = PrometheusRecord(
        url=f"http://127.0.0.1:{port}",
        pid=proc.pid,
        started=psutil.Process(proc.pid).create_time(),
        config=str(config),
        rules=str(rules),
        data_dir=str(data_dir),
        log=str(log),
    )
    storage.atomic_write_json(str(home / PROMETHEUS_FILE), asdict(record))  # before waiting: `stop` finds it
    try:
        _wait_ready(record, proc, timeout_s)
    except ClusterError:
        stop(home)
        raise
    return record, True


def stop(home: Path, timeout_s: float = 10.0) -> PrometheusRecord | None:
    """End the Prometheus `start` started from `home` (by its recorded pid, if it is still that process)."""
    record = read_record(home)
    if record is None:
        return None
    if _same_process(record.pid, record.started):
        p = psutil.Process(record.pid)
        for sig in ("terminate", "kill"):
            try:
                getattr(p, sig)()
                p.wait(timeout_s)
                break
            except psutil.NoSuchProcess:
                break
            except psutil.TimeoutExpired:
                continue
    (home / PROMETHEUS_FILE).unlink(missing_ok=True)
    return record


def _same_process(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.01 and p.name() == "prometheus" and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _promtool_check(config: Path) -> str:
    """promtool's complaints about the config and its rules ('' when fine, or when promtool is not installed)."""
    promtool = shutil.which("promtool")
    if not promtool:
        return ""
    proc = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]


def _wait_ready(record: PrometheusRecord, proc: subprocess.Popen, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(
                f"prometheus exited ({proc.returncode}) during start-up; its log ends with:\n"
                f"{Path(record.log).read_text()[-2000:]}"
            )
        try:
            if requests.get(f"{record.url}/-/ready", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise ClusterError(f"prometheus did not become ready at {record.url} within {timeout_s:.0f}s; see {record.log}")


def _port(preferred: int) -> int:
    """`preferred` when nothing listens there, else a free port (loopback)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
