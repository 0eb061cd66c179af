"""Separate machines on this one: each `Host` is a mount namespace (`unshare -m`) with its own tmpfs `/tmp`,
`/dev/shm` and home, sharing the network (loopback and this machine's address: no network namespace, no added
address or route; this machine's interface sits in a range where an added address breaks its network).

What a host sees of this machine's disk: the installed software (`/usr`, the checkout with its `.venv` and
compiled-op cache, even when the checkout itself lives under `/tmp`), nothing else of `/tmp`, and nothing of
another host's. A Ray node in one host writes its sessions, sockets, spilled objects and checkpoints-in-staging to
that host's `/tmp`; a file a client writes to its `/tmp` exists nowhere else. So a path that crosses hosts fails as
it would across real machines.

    head = Host("head", env); head.start()
    head.run(["pylon", "cluster", "up"])              # a process on that host
    head.read_text("/tmp/home/.pylon/auth_token")     # what only that host's disk holds
    head.kill()                                       # every process of the host, at once, as a power cut would

Needs root (mount namespaces, tmpfs), as the rest of the integration suite's set-up does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOST_HOME = "/tmp/home"

# Variables a host does not inherit from the test process: each host has its own home, cluster and token.
_PRIVATE = ("HOME", "PYLON_HOME", "TMPDIR", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def available() -> str | None:
    """Why hosts cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "simulating separate hosts needs root (mount namespaces)"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"simulating separate hosts needs `{tool}` (util-linux)"
    return None


def _kept_paths() -> list[str]:
    """Paths under /tmp a host must still see: the checkout (its .venv, sources and build cache) and the Python
    it runs, when they live there (a CI clone in /tmp)."""
    keep = []
    for path in (REPO, Path(sys.prefix), Path(sys.executable).resolve().parent):
        real = os.path.realpath(path)
        if (real == "/tmp" or real.startswith("/tmp/")) and not any(
            real.startswith(k + "/") or real == k for k in keep
        ):
            keep.append(real)
    return keep


class Host:
    def __init__(self, name: str, env: dict[str, str] | None = None):
        self.name = name
        base = {k: v for k, v in os.environ.items() if k not in _PRIVATE}
        self.env = {
            **base,
            **(env or {}),
            "HOME": HOST_HOME,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}",
        }
        self._anchor: subprocess.Popen | None = None
        self.namespace = ""

    def __repr__(self) -> str:
        return f"Host({self.name!r}, pid={self.pid})"

    @property
    def pid(self) -> int | None:
        return None if self._anchor is None else self._anchor.pid

    def start(self, timeout_s: float = 10.0) -> Host:
        keep = _kept_paths()
        lines = ["set -e", "mount --make-rprivate /"]
        lines += [f'exec {3 + i}<"{p}"' for i, p in enumerate(keep)]
        lines += ["mount -t tmpfs -o mode=1777 tmpfs /tmp", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm"]
        for i, p in enumerate(keep):
            # `mount` would resolve the path of the descriptor to the (now empty) new directory: keep it literal.
            lines += [
                f'mkdir -p "{p}"',
                f'mount --no-canonicalize --bind /proc/self/fd/{3 + i} "{p}"',
                f"exec {3 + i}<&-",
            ]
        lines += [f"mkdir -p {HOST_HOME}", "echo ready", "exec sleep infinity"]
        self._anchor = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", "\n".join(lines)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        line = self._anchor.stdout.readline().strip()
        if line != "ready":
            rest = self._anchor.communicate(timeout=timeout_s)[0] if self._anchor.poll() is not None else ""
            raise RuntimeError(f"host {self.name}: could not set up its namespace: {line} {rest}")
        self.namespace = os.readlink(f"/proc/{self.pid}/ns/mnt")
        return self

    def _argv(self, argv: list[str], env: dict[str, str] | None) -> tuple[list[str], dict]:
        if self._anchor is None or self._anchor.poll() is not None:
            raise RuntimeError(f"host {self.name} is not running")
        full_env = {**self.env, **(env or {})}
        # nsenter keeps the caller's directory, which does not exist in the host: start in the host's home.
        return [
            "nsenter",
            "-t",
            str(self.pid),
            "-m",
            "--",
            "bash",
            "-c",
            f'cd {HOST_HOME} && exec "$@"',
            "-",
            *argv,
        ], full_env

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run `argv` on this host and wait for it."""
        full, full_env = self._argv(argv, env)
        done = subprocess.run(full, env=full_env, capture_output=True, text=True, timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise AssertionError(
                f"on host {self.name}: {' '.join(argv)} exited {done.returncode}\nstdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-6000:]}"
            )
        return done

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `argv` on this host (a long-lived process: a node, a server)."""
        full, full_env = self._argv(argv, env)
        return subprocess.Popen(full, env=full_env, **kw)

    def python(
        self, code: str, *, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-c", code], env=env, timeout=timeout)

    def read_text(self, path: str) -> str:
        return self.run(["cat", path]).stdout

    def write_text(self, path: str, text: str, mode: str = "600") -> None:
        self.run(
            ["bash", "-c", f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode} "$1"', "-", path], input=text
        )

    def copy_in(self, source: Path, dest: str) -> None:
        """Copy a file or tree of this machine's into the host (what `scp` would do between machines)."""
        self.run(["cp", "-r", str(source), dest])

    def processes(self) -> list[int]:
        """Every process of this host: those in its mount namespace."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == self.namespace:
                    pids.append(int(entry))
            except OSError:
                continue
        return pids

    def kill(self, timeout_s: float = 30.0) -> None:
        """Every process of the host dies at once (SIGKILL), as when a machine loses power; its tmpfs goes with
        the last of them."""
        if not self.namespace:
            return
        deadline = time.monotonic() + timeout_s
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        if self._anchor is not None:
            try:
                self._anchor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._anchor = None

    def stop(self) -> None:
        """Stop Pylon's Ray processes politely (`pylon cluster down`), then everything left."""
        if self._anchor is not None and self._anchor.poll() is None:
            try:
                self.run([sys.executable, "-m", "pylon.cli", "cluster", "down"], timeout=60, check=False)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
