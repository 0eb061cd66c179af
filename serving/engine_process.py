"""The engine in a process of its own: what a Serve replica runs, so HTTP never waits on the model's Python.

A replica is one Python process: Serve's request handling, the SSE streams and, with `AsyncLLMEngine`, the
engine's step loop on a thread. They share one interpreter lock, and a step of a small or medium model on a
CPU is mostly Python dispatching tensor ops: every chunk Serve ships takes the lock from the step loop, and
measured on 2 cores a 32-sequence decode step took 33 ms in a replica under load against 14 ms alone. vLLM
v1 answers the same contention by running its engine core in a separate process; so does this.

`ProcessLLMEngine` has `AsyncLLMEngine`'s interface (generate / abort / stats / check_health / shutdown,
`tokenizer`, `max_model_len`). It starts `python -m pylon.serving.engine_process FD` with one end of a
socket pair; the child builds the `LLMEngine`, answers `ready` with the tokenizer, then loops: take in the
adds and aborts that arrived, step, send the step's outputs and the engine's stats back (an idle child
sends its stats every `IDLE_WAIT_S`, which is the heartbeat). Outputs for streams that are coalesced anyway
wait in the child for a few steps and go back together, one merged output per request (`_Outbox`). A request
the engine refuses comes back as an `invalid` message and is raised by the stream's first iteration, as
in-process. The child exits when the
parent asks, or when the socket closes (the replica died), so no engine outlives its replica.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from pylon.errors import PylonError
from pylon.serving.engine import AsyncLLMEngine, EngineStats, Prompt, expected_waiting, merge_outputs
from pylon.serving.errors import EngineDeadError, InvalidRequest
from pylon.serving.heap import allocator, engine_process_env, freeze_loaded_objects, keep_freed_memory
from pylon.serving.sampling import SamplingParams
from pylon.serving.scheduling import serve_cpu_as_batch
from pylon.specs import EngineSpec

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # an idle child sends its stats this often: the heartbeat


class ProcessLLMEngine(AsyncLLMEngine):
    """`AsyncLLMEngine`'s interface over an engine in a child process (see the module's docstring)."""

    START_TIMEOUT_S = 900.0  # loading a model (from object storage, onto a device) can take minutes

    def __init__(self, model: str, spec: EngineSpec | None = None, *, heartbeat_timeout_s: float = 60.0):
        # Not AsyncLLMEngine.__init__: no engine and no step thread in this process.
        spec = spec or EngineSpec()
        self._max_num_seqs = spec.max_num_seqs
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._streams = {}
        self._dead: EngineDeadError | None = None
        self._stopping = threading.Event()
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "pylon.serving.engine_process", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], env=engine_process_env(_device_type(spec.device)))
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(("start", model, spec))
            message = self._wait_ready(model)
        except BaseException:
            self._kill()
            raise
        _, self._tokenizer, self._max_model_len, self._device, self._stats, self.allocator = message
        self._heartbeat = time.monotonic()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="pylon-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="pylon-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    @classmethod
    def from_model(cls, model: str, spec: EngineSpec | None = None, **kwargs) -> "ProcessLLMEngine":
        return cls(model, spec, **kwargs)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _wait_ready(self, model: str):
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not self._conn.poll(0.5):
            code = self._proc.poll()
            if code is not None:
                raise PylonError(f"the engine process for {model} exited with code {code} while loading it "
                                 "(its output is in this replica's log)")
            if time.monotonic() > deadline:
                raise PylonError(f"the engine process did not load {model} within {self.START_TIMEOUT_S:g} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise PylonError(f"the engine process for {model} exited while loading it (its output is in this "
                             "replica's log)") from None
        if message[0] == "failed":
            raise PylonError(message[1])
        return message

    # -- the interface -------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def device(self) -> str:
        return self._device

    def _submit(self, request_id: str, prompt: Prompt, params: SamplingParams | None, interval_s: float = 0.0) -> None:
        self._outbox.put(("add", request_id, prompt, params, interval_s))

    def abort(self, request_id: str) -> None:
        self._outbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The child's stats as of its last step (or idle beat, at most `IDLE_WAIT_S` old). Requests sent since
        then count as waiting beyond the sequence slots that were free (`expected_waiting`)."""
        stats = self._stats
        arrived = max(0, len(self._streams) - stats.num_running - stats.num_waiting)
        return dataclasses.replace(stats, num_waiting=expected_waiting(stats.num_running, stats.num_waiting, arrived,
                                                                       self._max_num_seqs))

    def check_health(self) -> bool:
        return (self._dead is None and self._proc.poll() is None
                and time.monotonic() - self._heartbeat < self.heartbeat_timeout_s)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, wait for it (then kill it), and end every open stream."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._outbox.put(("stop",))
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
        self._reader.join(timeout)
        self._end_streams(EngineDeadError("the engine was shut down"))

    # -- plumbing ----------------------------------------------------------------------------------------

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone; the reader reports it
                return
            if message[0] == "stop":
                return

    def _read(self) -> None:
        reason = None
        try:
            while True:
                message = self._conn.recv()
                self._heartbeat = time.monotonic()
                kind = message[0]
                if kind == "step":
                    self._stats = message[2]
                    self._deliver_step(message[1])
                elif kind == "idle":
                    self._stats = message[1]
                elif kind == "invalid":
                    _, request_id, text, param = message
                    self._deliver(request_id, InvalidRequest(text, param=param))
                elif kind == "crashed":
                    reason = f"the engine's step loop crashed ({message[1]})"
                    log.error("engine process: %s", reason)
        except (EOFError, OSError):
            pass
        if self._stopping.is_set():
            self._end_streams(EngineDeadError("the engine was shut down"))
        else:
            code = self._proc.wait()
            self._end_streams(EngineDeadError(reason or f"the engine process exited with code {code}"))

    def _end_streams(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for request_id in list(self._streams):
            self._deliver(request_id, self._dead)

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def _device_type(device: str) -> str:
    """The spec's engine.device as the child will resolve it ("auto": CUDA where there is a GPU), without importing
    torch into a replica that has not: an NVIDIA device node counts as a GPU (the side that keeps glibc's malloc)."""
    if device != "auto":
        return device
    torch = sys.modules.get("torch")
    if torch is not None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if glob.glob("/dev/nvidia[0-9]*") else "cpu"


# -- the child -----------------------------------------------------------------------------------------------


MAX_HOLD_S = 0.025  # the longest a step's output waits in the child for later steps' outputs


class _Outbox:
    """A step's outputs go to the parent at once when one starts or ends a request, or belongs to a stream
    whose consumer takes every step (interval 0: the engine leg's clients, tests); otherwise they wait, with
    the next steps', until the oldest has waited half its stream's interval (at most `MAX_HOLD_S`). The
    parent's consumer coalesces those steps into one output per interval anyway (`generate(interval_s)`),
    and each message it receives wakes a reader thread and an event loop in the replica: a 16-sequence
    engine steps ~150 times a second, which was ~150 wake-ups a second for outputs nobody takes yet."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.hold: dict[str, float] = {}  # request id -> how long its outputs may wait
        self.pending: list = []
        self.deadline = float("inf")

    def expect(self, request_id: str, interval_s: float) -> None:
        """`request_id` joined the engine; its consumer takes outputs every `interval_s`."""
        self.hold[request_id] = min(MAX_HOLD_S, interval_s / 2)

    def add(self, outputs: list) -> None:
        now = time.monotonic()
        for out in outputs:
            hold = self.hold.get(out.request_id, 0.0)
            if out.finish_reason is not None:
                self.hold.pop(out.request_id, None)
                hold = 0.0
            elif out.num_output_tokens == len(out.token_ids):
                hold = 0.0  # the first token(s): time to first token is never held back
            self.deadline = min(self.deadline, now + hold)
        self.pending.extend(outputs)

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() >= self.deadline

    def flush(self, stats) -> None:
        self.conn.send(("step", merge_by_request(self.pending), stats))
        self.pending, self.deadline = [], float("inf")


def merge_by_request(outputs: list) -> list:
    """Held steps' outputs with one output per request (`merge_outputs`: deltas joined, the last one's state).
    The stream's consumer would merge them itself at its next tick; merged here, the message pickles, the replica
    unpickles and hands its event loop a few outputs per stream instead of one per step (a 16-sequence engine
    steps ~100 times a second)."""
    groups: dict[str, list] = {}
    for out in outputs:
        groups.setdefault(out.request_id, []).append(out)
    return [group[0] if len(group) == 1 else merge_outputs(group) for group in groups.values()]


def _child(conn: Connection) -> int:
    from pylon.serving.engine import LLMEngine

    keep_freed_memory()  # before the model: its steps' activations are reused, not faulted in again (heap.py)
    _, model, spec = conn.recv()
    try:
        engine = LLMEngine(model, spec)
    except PylonError as e:
        conn.send(("failed", str(e)))
        return 1
    except Exception as e:
        log.exception("engine process: loading %s failed", model)
        conn.send(("failed", f"loading {model} failed: {type(e).__name__}: {e}"))
        return 1
    device = engine.runner.device.type
    serve_cpu_as_batch(device, "engine process")  # its torch threads exist by now; all of them move
    freeze_loaded_objects()  # full collections then never walk the model's and the libraries' objects (heap.py)
    malloc = allocator()
    log.info("engine process %d ready on %s, malloc: %s", os.getpid(), device, malloc)
    conn.send(("ready", engine.tokenizer, engine.max_model_len, device, engine.stats(), malloc))
    outbox = _Outbox(conn)
    while True:
        # Busy: take in what has arrived and step at once. Idle: wait for work, beating every IDLE_WAIT_S.
        wait = 0.0 if engine.has_unfinished() else IDLE_WAIT_S
        while conn.poll(wait):
            wait = 0.0
            message = conn.recv()
            kind = message[0]
            if kind == "add":
                _, request_id, prompt, params, interval_s = message
                try:
                    engine.add_request(request_id, prompt, params)
                    outbox.expect(request_id, interval_s)
                except InvalidRequest as e:
                    conn.send(("invalid", request_id, str(e), e.param))
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "stop":
                return 0
        if engine.has_unfinished():
            try:
                outputs = engine.step()
            except Exception as e:
                log.exception("engine process: the step failed")
                conn.send(("crashed", f"{type(e).__name__}: {e}"))
                return 1
            outbox.add(outputs)
            if not engine.has_unfinished() or outbox.due():
                outbox.flush(engine.stats())
        elif outbox.pending:
            outbox.flush(engine.stats())
        else:
            conn.send(("idle", engine.stats()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s pylon-engine: %(message)s")
    conn = Connection(int(argv[0]))
    try:
        return _child(conn)
    except (EOFError, OSError):  # the parent went away: nothing left to serve
        return 0


if __name__ == "__main__":
    sys.exit(main())
