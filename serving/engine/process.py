"""The engine in a process of its own: what a Serve replica runs, so HTTP never waits on the model's Python.

A replica's request handling and SSE streams would otherwise share one interpreter lock with the step loop, and a
small model's step on a CPU is mostly Python. vLLM v1 runs its engine core in a separate process; so does this.

`ProcessLLMEngine` has `AsyncLLMEngine`'s interface (generate / abort / stats / check_health / shutdown,
`tokenizer`, `max_model_len`, `generation`). It starts `python -m pylon.serving.engine.process FD` with one end of a
socket pair; the child builds the `LLMEngine`, answers `ready` with the tokenizer and the model's generation settings,
then loops: take in adds and aborts, step, send the outputs and stats back (an idle child's stats are the heartbeat).
Outputs of coalesced streams wait in the child and go back merged (`_Outbox`). A refused request comes back as
`invalid` and is raised by the stream's first iteration. The child exits when asked or when the socket closes, so no
engine outlives its replica.

`EnginePool` runs `EngineSpec.data_parallel` such engines behind one replica (each its own model and KV cache) and
sends a request to a healthy engine with the fewest open streams.
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
from pylon.serving.engine.engine import AsyncLLMEngine, EngineStats, Prompt, expected_waiting, merge_outputs
from pylon.serving.engine.generation import GenerationConfig
from pylon.serving.engine.heap import allocator, engine_process_env, freeze_loaded_objects, keep_freed_memory
from pylon.serving.engine.kv_cache import prompt_prefix
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.engine.sched_batch import serve_cpu_as_batch
from pylon.serving.errors import EngineDeadError, InvalidRequest, RequestFailed
from pylon.specs import EngineSpec

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # an idle child sends its stats this often: the heartbeat


class ProcessLLMEngine(AsyncLLMEngine):
    """`AsyncLLMEngine`'s interface over an engine in a child process (see the module's docstring)."""

    START_TIMEOUT_S = 900.0  # loading a model (from object storage, onto a device) can take minutes

    def __init__(
        self,
        model: str,
        spec: EngineSpec | None = None,
        *,
        heartbeat_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        pipeline: dict | None = None,
    ):
        """`env`: variables the child gets on top of this process's environment (an `EnginePool` gives each of
        its engines its share of the CPUs, or its GPU). `pipeline`: where the child's pipeline stages go
        (`LLMEngine`'s, engine/pipeline.py's `placement()` of the replica)."""
        # Not AsyncLLMEngine.__init__: no engine and no step thread in this process.
        spec = spec or EngineSpec()
        self._max_num_seqs = spec.max_num_seqs
        self.cached_blocks: set[bytes] = set()  # hashes of the blocks the engine holds cached (prefix caching)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._streams = {}
        self._dead: EngineDeadError | None = None
        self._stopping = threading.Event()
        self._shut_down = False
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pylon.serving.engine.process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=engine_process_env(_device_type(spec.device), {**os.environ, **(env or {})}),
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(("start", model, spec, pipeline))
            message = self._wait_ready(model)
        except BaseException:
            self._kill()
            raise
        _, self._tokenizer, self._max_model_len, self._device, self._stats, self.allocator, *rest = message
        self._generation, self._max_images, self._image_processor = rest
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
                raise PylonError(
                    f"the engine process for {model} exited with code {code} while loading it "
                    "(its output is in this replica's log)"
                )
            if time.monotonic() > deadline:
                raise PylonError(f"the engine process did not load {model} within {self.START_TIMEOUT_S:g} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise PylonError(
                f"the engine process for {model} exited while loading it (its output is in this replica's log)"
            ) from None
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
    def generation(self) -> GenerationConfig:
        return self._generation

    @property
    def max_images(self) -> int:
        return self._max_images

    @property
    def image_processor(self):
        return self._image_processor

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
        return dataclasses.replace(
            stats, num_waiting=expected_waiting(stats.num_running, stats.num_waiting, arrived, self._max_num_seqs)
        )

    def check_health(self) -> bool:
        return (
            self._dead is None
            and self._proc.poll() is None
            and time.monotonic() - self._heartbeat < self.heartbeat_timeout_s
        )

    def stop_soon(self) -> None:
        """Ask the child to stop, without waiting for it (`shutdown` waits)."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._outbox.put(("stop",))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, wait for it (then kill it), and end every open stream."""
        if self._shut_down:
            return
        self._shut_down = True
        self.stop_soon()
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
                    self._apply_cache_changes(message[3])
                    self._deliver_step(message[1])
                elif kind == "idle":
                    self._stats = message[1]
                    self._apply_cache_changes(message[2])
                elif kind == "invalid":
                    _, request_id, text, param = message
                    self._deliver(request_id, InvalidRequest(text, param=param))
                elif kind == "failed":  # the child's add_request raised RequestFailed: that request alone fails
                    _, request_id, text = message
                    self._deliver(request_id, RequestFailed(text))
                elif kind == "crashed":
                    reason = f"the engine's step loop crashed ({message[1]})"
                    log.error("engine process: %s", reason)
        except (EOFError, OSError):
            pass
        if self._stopping.is_set():
            self._end_streams(EngineDeadError("the engine was shut down"))
        else:
            code = self._proc.wait()
            if reason is None:
                reason = f"the engine process exited with code {code}"
                log.error(
                    "engine process %d: %s%s",
                    self._proc.pid,
                    reason,
                    " (killed: out of memory? see `dmesg`)" if code == -9 else "",
                )
            self._end_streams(EngineDeadError(reason))

    def _apply_cache_changes(self, changes: list[tuple[bool, bytes]]) -> None:
        cached = self.cached_blocks
        for registered, h in changes:
            if registered:
                cached.add(h)
            else:
                cached.discard(h)

    def cached_block_hashes(self) -> list[bytes]:
        """The hashes of the blocks the engine holds cached, as it last said."""
        return list(self.cached_blocks)

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many of a prompt's first blocks (`hashes`, kv_cache.block_hashes) this engine holds cached, as it
        last said (at its last step or idle beat)."""
        n = 0
        for h in hashes:
            if h not in self.cached_blocks:
                break
            n += 1
        return n

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


class EnginePool:
    """`EngineSpec.data_parallel` engine processes behind one replica, with `ProcessLLMEngine`'s interface: each
    has its own copy of the model and its own KV cache, and a new request goes to the engine that holds the longest
    cached prefix of its prompt (each engine reports the hashes of the blocks it caches with its steps' outputs)
    while that engine has a free sequence slot, else to the one with the fewest open streams (as the bench's engine
    leg, or HAProxy's leastconn across replicas, would pick). Its stats add up the
    engines'; it is healthy while every engine is.

    Why: on a CPU node every replica is a Ray worker process with an HTTP server, an event loop, Serve's per-replica
    bookkeeping, and Ray's own periodic work (the core worker's main thread wakes 100 times a second to check for
    signals, ~11 CPU-ms a second idle). One replica in front of an engine per core pays those once per node instead
    of once per core, and writes every stream's chunks of a tick in one wake-up of one event loop."""

    def __init__(self, model: str, spec: EngineSpec, **kwargs):
        import concurrent.futures

        envs = _engine_envs(spec.data_parallel, _device_type(spec.device))
        # All load at once (N GPUs load in the time of one); if any fails, the others are stopped and its error raised.
        with concurrent.futures.ThreadPoolExecutor(len(envs), thread_name_prefix="pylon-engine-start") as pool:
            starts = [pool.submit(ProcessLLMEngine, model, spec, env=env, **kwargs) for env in envs]
            concurrent.futures.wait(starts)
        self.engines: list[ProcessLLMEngine] = [f.result() for f in starts if f.exception() is None]
        failed = next((f.exception() for f in starts if f.exception() is not None), None)
        if failed is not None:
            for engine in self.engines:
                engine.shutdown(timeout=5)
            raise failed
        self.allocator = self.engines[0].allocator
        self.spec = spec

    @classmethod
    def from_model(cls, model: str, spec: EngineSpec | None = None, **kwargs) -> "EnginePool":
        return cls(model, spec or EngineSpec(), **kwargs)

    @property
    def tokenizer(self):
        return self.engines[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engines[0].max_model_len

    @property
    def generation(self) -> GenerationConfig:
        return self.engines[0].generation

    @property
    def max_images(self) -> int:
        return self.engines[0].max_images

    @property
    def image_processor(self):
        return self.engines[0].image_processor

    @property
    def device(self) -> str:
        return self.engines[0].device

    @property
    def pids(self) -> list[int]:
        return [e.pid for e in self.engines]

    def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *, interval_s: float = 0.0
    ):
        """The chosen engine's own stream (no wrapper per output). It registers the request when first iterated,
        before it awaits anything, so requests started together in one event loop still spread out."""
        # A dead or stalled engine has no open streams, so by count alone it would take every new request and
        # answer each with a 503 until Serve replaces the replica; the live ones take them instead (the pool stays
        # unhealthy, so Serve still replaces it, letting the live engines' streams finish as it drains).
        live = [e for e in self.engines if e.check_health()] or self.engines
        engine = self._holder_of(prompt, live, params) or min(live, key=lambda e: e.open_streams)
        return engine.generate(request_id, prompt, params, interval_s=interval_s)

    def _holder_of(
        self, prompt: Prompt, engines: list[ProcessLLMEngine], params: SamplingParams | None
    ) -> ProcessLLMEngine | None:
        """With prefix caching: the engine that holds the longest cached prefix of `prompt` (by the hashes each
        engine reports of the blocks it has cached, not a guess from past routing), if it has a free sequence
        slot; the least loaded among equals. None: no engine holds a block of it, or the holder is busy (it
        would queue the request): the least loaded engine takes it, and its prefix, from then on."""
        if not self.spec.enable_prefix_caching or len(engines) < 2:
            return None
        try:
            _, hashes = prompt_prefix(self.tokenizer, prompt, self.spec.block_size, params)
        except Exception:  # the engine refuses it with the reason; routing is not the place
            return None
        if not hashes:
            return None
        best = max(engines, key=lambda e: (e.cached_prefix_blocks(hashes), -e.open_streams))
        if best.cached_prefix_blocks(hashes) == 0 or best.open_streams >= self.spec.max_num_seqs:
            return None
        return best

    def abort(self, request_id: str) -> None:
        for engine in self.engines:
            if engine.has_stream(request_id):
                engine.abort(request_id)

    def stats(self) -> EngineStats:
        return combine_stats([e.stats() for e in self.engines])

    def cached_block_hashes(self) -> list[bytes]:
        """Every engine's cached blocks (a block cached by two engines counts once)."""
        return list(set().union(*(e.cached_blocks for e in self.engines)))

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """The longest prefix of `hashes` one engine holds (the one `generate` sends such a prompt to, if free)."""
        return max(e.cached_prefix_blocks(hashes) for e in self.engines)

    def check_health(self) -> bool:
        return all(e.check_health() for e in self.engines)

    def shutdown(self, timeout: float = 10.0) -> None:
        for engine in self.engines:
            engine.stop_soon()  # all of them stop at once; then each is waited for (and killed if need be)
        for engine in self.engines:
            engine.shutdown(timeout)


def combine_stats(stats: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one: counts added, KV-cache utilisation over all their blocks."""
    blocks = sum(s.num_blocks for s in stats)
    finished: dict[str, int] = {}
    for s in stats:
        for reason, n in s.requests_finished_total.items():
            finished[reason] = finished.get(reason, 0) + n
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_utilization=sum(s.kv_cache_utilization * s.num_blocks for s in stats) / blocks if blocks else 0.0,
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_blocks=blocks,
        prompt_tokens_total=sum(s.prompt_tokens_total for s in stats),
        generation_tokens_total=sum(s.generation_tokens_total for s in stats),
        num_preemptions_total=sum(s.num_preemptions_total for s in stats),
        requests_finished_total=finished,
        prefix_cache_queries_total=sum(s.prefix_cache_queries_total for s in stats),
        prefix_cache_hits_total=sum(s.prefix_cache_hits_total for s in stats),
        prefill_tokens_computed_total=sum(s.prefill_tokens_computed_total for s in stats),
        num_cached_blocks=sum(s.num_cached_blocks for s in stats),
        kv_offload_saved_blocks_total=sum(s.kv_offload_saved_blocks_total for s in stats),
        kv_offload_loaded_blocks_total=sum(s.kv_offload_loaded_blocks_total for s in stats),
        num_offloaded_blocks=sum(s.num_offloaded_blocks for s in stats),
        adapter_loads_total=sum(s.adapter_loads_total for s in stats),
        adapter_evictions_total=sum(s.adapter_evictions_total for s in stats),
        spec_draft_tokens_total=sum(s.spec_draft_tokens_total for s in stats),
        spec_accepted_tokens_total=sum(s.spec_accepted_tokens_total for s in stats),
        spec_verify_steps_total=sum(s.spec_verify_steps_total for s in stats),
        spec_draft_model_steps_total=sum(s.spec_draft_model_steps_total for s in stats),
        spec_tree_branch_tokens_total=sum(s.spec_tree_branch_tokens_total for s in stats),
        images_total=sum(s.images_total for s in stats),
        images_encoded_total=sum(s.images_encoded_total for s in stats),
        pipeline_steps_total=sum(s.pipeline_steps_total for s in stats),
        pipeline_stage_seconds_total=sum(s.pipeline_stage_seconds_total for s in stats),
        pipeline_hop_seconds_total=sum(s.pipeline_hop_seconds_total for s in stats),
        pipeline_weights_read_bytes=sum(s.pipeline_weights_read_bytes for s in stats),
        forward_passes_total=sum(s.forward_passes_total for s in stats),
        kv_transfer_sent_blocks_total=sum(s.kv_transfer_sent_blocks_total for s in stats),
        kv_transfer_sent_bytes_total=sum(s.kv_transfer_sent_bytes_total for s in stats),
        kv_transfer_received_blocks_total=sum(s.kv_transfer_received_blocks_total for s in stats),
        kv_transfer_received_bytes_total=sum(s.kv_transfer_received_bytes_total for s in stats),
        kv_transfer_refused_total=sum(s.kv_transfer_refused_total for s in stats),
    )


def _engine_envs(n: int, device: str, environ: dict | None = None) -> list[dict[str, str]]:
    """What each of `n` engine processes gets on top of the replica's environment. On a CPU: its share of the
    threads the replica has (Ray sets OMP_NUM_THREADS to a replica's num_cpus). On a GPU: one of the replica's
    GPUs (Ray sets CUDA_VISIBLE_DEVICES to them)."""
    environ = os.environ if environ is None else environ
    if n == 1:
        return [{}]
    if device == "cuda":
        visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if not visible:
            import torch

            visible = [str(i) for i in range(torch.cuda.device_count())]
        if len(visible) < n:
            raise PylonError(
                f"engine.data_parallel: {n} engines need {n} GPUs, one each, and this replica has "
                f"{len(visible)} ({', '.join(visible) or 'none'}); set replica.num_gpus to {n}"
            )
        return [{"CUDA_VISIBLE_DEVICES": visible[i]} for i in range(n)]
    threads = int(environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
    share = str(max(1, threads // n))
    return [
        {"OMP_NUM_THREADS": share, **({"MKL_NUM_THREADS": share} if "MKL_NUM_THREADS" in environ else {})}
        for _ in range(n)
    ]


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

    def flush(self, stats, cached: list) -> None:
        self.conn.send(("step", merge_by_request(self.pending), stats, cached))
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
    from pylon.serving.engine.engine import LLMEngine

    keep_freed_memory()  # before the model: its steps' activations are reused, not faulted in again (heap.py)
    _, model, spec, pipeline = conn.recv()
    try:
        engine = LLMEngine(model, spec, pipeline=pipeline)
    except PylonError as e:
        conn.send(("failed", str(e)))
        return 1
    except Exception as e:
        log.exception("engine process: loading %s failed", model)
        conn.send(("failed", f"loading {model} failed: {type(e).__name__}: {e}"))
        return 1
    device = engine.runner.device.type
    if engine.pool.enable_caching:
        engine.pool.track_changes()  # its replica routes requests to the engine that holds their prefix
    serve_cpu_as_batch(device, "engine process")  # its torch threads exist by now; all of them move
    freeze_loaded_objects()  # full collections then never walk the model's and the libraries' objects (heap.py)
    malloc = allocator()
    log.info("engine process %d ready on %s, malloc: %s", os.getpid(), device, malloc)
    ready = (
        engine.tokenizer,
        engine.max_model_len,
        device,
        engine.stats(),
        malloc,
        engine.generation,
        engine.max_images,
        engine.images,  # (its processor, for the replica to count a prompt's image tokens without a round trip)
    )
    conn.send(("ready", *ready))
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
                except RequestFailed as e:  # that request alone fails; the engine serves on
                    conn.send(("failed", request_id, str(e)))
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
                outbox.flush(engine.stats(), engine.pool.drain_changes())
        elif outbox.pending:
            outbox.flush(engine.stats(), engine.pool.drain_changes())
        else:
            conn.send(("idle", engine.stats(), engine.pool.drain_changes()))


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
