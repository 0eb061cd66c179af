"""Fault injection for tests: an object store that goes away, a disk that fills up, a process that dies.

- `FaultProxy`: a TCP proxy on 127.0.0.1 in front of a real server (the session's S3-protocol server), switched at
  run time between "pass" (forward both ways), "stall" (connections accepted, no byte forwarded either way until
  the mode changes back: requests hang), "reset" (open connections reset with a TCP RST, new ones reset as soon as
  they are accepted) and "drop" (open connections closed, new ones closed at once). Point AWS_ENDPOINT_URL at
  `proxy.url` (`proxied(endpoint, monkeypatch)` does, for this process; a Ray job gets it in its runtime_env).
  `proxy.outage(mode, seconds)` switches now and back to "pass" after `seconds`, in the background;
  `proxy.when(condition, mode, seconds)` waits for `condition()` first (a number of bytes sent, a file appearing).
- `tmpfs(path, size)`: a tmpfs of limited size mounted at `path` (needs root: the test is skipped otherwise),
  unmounted on exit, for disk-full cases.
- `kill(pid)`: SIGKILL a process and wait until it is gone.

Used by tests/unit/ground/test_storage_faults.py (retries against the proxy, no Ray),
tests/unit/jobs/test_checkpoint_faults.py (a full disk during a save) and
tests/integration/test_train_faults.py (training jobs through an outage, killed workers and drivers).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

MODES = ("pass", "stall", "reset", "drop")


class FaultProxy:
    """A TCP proxy to `upstream` ("http://HOST:PORT"); see the module's docstring for the modes."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.mode = "pass"
        self.bytes_up = 0  # client -> server, forwarded
        self.connections = 0  # accepted
        self.faulted = 0  # connections reset or dropped by the proxy
        self.history: list[tuple[float, str]] = []  # (time.monotonic(), mode) of every switch
        self.requests: list[tuple[float, str]] = []  # (time.monotonic(), first line) of every HTTP request forwarded
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        host, port = self._listener.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._accepting.start()

    # -- control -------------------------------------------------------------------------------------------

    def set(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
        with self._lock:
            self.mode = mode
            self.history.append((time.monotonic(), mode))

    def outage(self, mode: str, seconds: float) -> threading.Thread:
        """Switch to `mode` now and back to "pass" after `seconds`, in the background."""
        return self.when(lambda: True, mode, seconds)

    def when(
        self, condition: Callable[[], bool], mode: str, seconds: float, *, poll_s: float = 0.05, timeout_s: float = 600
    ) -> threading.Thread:
        """In the background: once `condition()` is true, `mode` for `seconds`, then "pass" again. The thread's
        `started_at` is when the fault began (None if the condition never came true within `timeout_s`)."""

        def run() -> None:
            deadline = time.monotonic() + timeout_s
            while not condition():
                if self._stopped.is_set() or time.monotonic() > deadline:
                    return
                time.sleep(poll_s)
            thread.started_at = time.monotonic()
            self.set(mode)
            if not self._stopped.wait(seconds):
                self.set("pass")

        thread = threading.Thread(target=run, name=f"fault-{mode}", daemon=True)
        thread.started_at = None
        thread.start()
        return thread

    def requested(self, fragment: str) -> list[float]:
        """When requests whose first line ("PUT /bucket/key?... HTTP/1.1") contains `fragment` were forwarded."""
        return [t for t, line in list(self.requests) if fragment in line]

    def close(self) -> None:
        self._stopped.set()
        self._accepting.join(5)
        self._listener.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the proxy ---------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            while not self._stopped.is_set():
                mode = self.mode
                if mode in ("reset", "drop"):
                    self.faulted += 1
                    _close(client, reset=mode == "reset")
                    client = None
                    return
                if mode == "stall":  # hold: read nothing, send nothing; the kernel buffers fill up
                    time.sleep(0.05)
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=10)
                    upstream.settimeout(None)
                readable, _, _ = select.select([client, upstream], [], [], 0.05)
                for sock in readable:
                    if self.mode != "pass":
                        break  # switched while waiting: the next turn of the loop applies it
                    data = sock.recv(65536)
                    if not data:
                        return
                    other = upstream if sock is client else client
                    other.sendall(data)
                    if sock is client:
                        self.bytes_up += len(data)
                        if data[:8].split(b" ")[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
                            line = data.split(b"\r\n", 1)[0].decode("latin-1")
                            self.requests.append((time.monotonic(), line))
        except OSError:
            return
        finally:
            if client is not None:
                _close(client, reset=False)
            if upstream is not None:
                _close(upstream, reset=self.mode == "reset")


def _close(sock: socket.socket, *, reset: bool) -> None:
    with contextlib.suppress(OSError):
        if reset:  # SO_LINGER 0: close() sends a RST, the peer sees "connection reset by peer"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@contextlib.contextmanager
def proxied(upstream: str, monkeypatch: pytest.MonkeyPatch | None = None) -> Iterator[FaultProxy]:
    """A FaultProxy to `upstream`; with `monkeypatch`, this process's AWS_ENDPOINT_URL points at it meanwhile."""
    with FaultProxy(upstream) as proxy:
        if monkeypatch is not None:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield proxy


# ---------------------------------------------------------------------------------------------------------
# A small disk
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: str | os.PathLike, size: str) -> Iterator[Path]:
    """A tmpfs of `size` ("4m", "512k") mounted at `path` (created), unmounted on exit. Skips the test where this
    process may not mount (not root, or no CAP_SYS_ADMIN in a container)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path}: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it now, freed when idle


def fill(path: str | os.PathLike, *, leave: int = 0) -> Path:
    """Fill the filesystem holding directory `path` with one file, until at most `leave` bytes are free."""
    filler = Path(path) / "filler.bin"
    with open(filler, "wb") as f:
        chunk = b"\0" * 65536
        while True:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                f.write(chunk[: max(1, min(len(chunk), free - leave))])
                f.flush()
            except OSError:
                break
    return filler


# ---------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------


def kill(pid: int, timeout_s: float = 30) -> None:
    """SIGKILL `pid` and wait until it is gone (reaped by its parent, or a zombie of someone else's)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout_s)
    except psutil.NoSuchProcess:
        return
