"""bench/serve_load.py's workload, model and legs: the requests, the random GPT-2, the transformers legs (a server
taking 1 or up to N waiting requests at a time), the asyncio load generator, and the engine and Ray Serve + HTTP
legs. See serve_load.py's docstring; it re-exports every name here."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from serve_load_cpu import CpuAccount

LEGS = ("hf-single", "hf-static", "engine", "http")
DEPLOYMENT = "bench"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Workload and model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    index: int
    text: str
    ids: list[int]
    max_tokens: int


def make_requests(args) -> list[Req]:
    """`--num-requests` windows of the text's bytes, seeded: mixed prompt and output lengths."""
    data = args.data.read_bytes()
    rng = random.Random(args.seed)
    reqs = []
    for i in range(args.num_requests):
        n = rng.randint(*args.prompt_len)
        start = rng.randrange(0, len(data) - n)
        ids = list(data[start : start + n])
        reqs.append(Req(i, bytes(ids).decode("utf-8"), ids, rng.randint(*args.output_len)))
    return reqs


def arrival_times(args, n: int) -> list[float] | None:
    """Offsets (s) of Poisson arrivals at `--rate`, seeded; None for closed-loop concurrency."""
    if not args.rate:
        return None
    rng, t, out = random.Random(args.seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(args.rate)
    return out


def build_model(args, directory: Path):
    """A random GPT-2 saved as a Pylon export (byte tokenizer), as tests/integration/test_serving.py's does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        n_positions=args.n_positions,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)  # float32 on disk; each leg loads it in --dtype
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    from pylon.serving.model.runner import DTYPES  # the engine's own names for dtypes

    return model.to(device=args.device, dtype=DTYPES[args.dtype]), tok


def engine_spec(args):
    from pylon.specs import EngineSpec

    block = args.block_size
    kv = args.kv_cache_tokens or args.concurrency * args.max_model_len
    kv = -(-max(kv, args.max_model_len) // block) * block
    return EngineSpec(
        max_num_seqs=max(args.concurrency, args.max_num_seqs or 0),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=kv,
        block_size=block,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        separate_process=not args.in_process_engine,
    )


# ---------------------------------------------------------------------------------------------------------
# Records and progress
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as its client saw it: when it was sent, and when each piece of output arrived."""

    sent: float
    times: list[float] = field(default_factory=list)  # arrival of each output event (token / chunk / step)
    num_tokens: int = 0
    token_ids: list[int] | None = None
    error: str | None = None


class Progress:
    """A line on stderr every 25% of a leg's requests (and at least every 15 s), so long runs show life."""

    def __init__(self, leg: str, total: int):
        self.leg, self.total, self.done = leg, total, 0
        self.t0 = self.last = time.perf_counter()
        self.step = max(1, total // 4)

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.done == self.total or self.done % self.step == 0 or now - self.last > 15:
            self.last = now
            log(f"  [{self.leg}] {self.done}/{self.total} requests, {now - self.t0:.1f} s")


# ---------------------------------------------------------------------------------------------------------
# Legs a and b: transformers generate, as a server that takes 1 or up to N waiting requests at a time
# ---------------------------------------------------------------------------------------------------------


class StepTimes:
    """A `generate` streamer that only timestamps: put() is called once with the prompt, then once per step."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, batch: list[Req], pad_id: int) -> tuple[list[float], list[list[int]]]:
    """One static batch (left-padded): per-step arrival times and every row's new tokens."""
    import torch

    width = max(len(r.ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.ids) :] = torch.tensor(r.ids)
        mask[row, width - len(r.ids) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    new = max(r.max_tokens for r in batch)
    timer = StepTimes()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=timer,
        )
    return timer.times, out[:, width:].tolist()


def run_hf(model, reqs: list[Req], batch_size: int, args, label: str, pad_id: int) -> tuple[list[Record], float]:
    """Serve `reqs` with static batches of at most `batch_size` under the run's load (closed-loop clients or
    Poisson arrivals, in real time): a request waits while the server is busy with an earlier batch."""
    arrivals = arrival_times(args, len(reqs))
    records: dict[int, Record] = {}
    progress = Progress(label, len(reqs))
    t0 = time.perf_counter()
    queue: deque[tuple[Req, float]] = deque()
    upcoming = deque(reqs)
    if arrivals is None:
        for _ in range(min(args.concurrency, len(reqs))):
            queue.append((upcoming.popleft(), t0))
    while len(records) < len(reqs):
        if arrivals is not None:
            now = time.perf_counter()
            while upcoming and t0 + arrivals[upcoming[0].index] <= now:
                r = upcoming.popleft()
                queue.append((r, t0 + arrivals[r.index]))
            if not queue:
                time.sleep(max(0.0, t0 + arrivals[upcoming[0].index] - time.perf_counter()))
                continue
        batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        times, tokens = hf_generate(model, [r for r, _ in batch], pad_id)
        finished = []
        for (r, sent), toks in zip(batch, tokens):
            mine = times[: r.max_tokens]
            records[r.index] = Record(sent, mine, len(mine), toks[: r.max_tokens])
            finished.append(mine[-1])
        progress.update(len(batch))
        if arrivals is None:  # each client sends its next request when its own last token came
            for done_at in sorted(finished):
                if upcoming:
                    queue.append((upcoming.popleft(), done_at))
    return [records[r.index] for r in reqs], t0


# ---------------------------------------------------------------------------------------------------------
# Load generator for the engine and HTTP legs (asyncio clients)
# ---------------------------------------------------------------------------------------------------------


def run_async(coro):
    """Runs a leg's clients on uvloop where it is installed (Ray's dependency on Linux, as in its replicas and
    Serve's proxy): the load generator shares the machine with what it measures, and asyncio's own loop spends
    more CPU per socket read and per cross-thread callback, taken from the engines on a small machine. Both
    the engine and the http legs' clients run on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def drive(reqs: list[Req], args, one, label: str, cluster=None) -> tuple[list[Record], float, dict]:
    """Run `one(req, record)` for every request: from `--concurrency` closed-loop clients, or at the Poisson
    arrival times of `--rate`."""
    arrivals = arrival_times(args, len(reqs))
    records = [Record(0.0) for _ in reqs]
    progress = Progress(label, len(reqs))
    account = CpuAccount(cluster)
    t0 = time.perf_counter()

    async def send(r: Req) -> None:
        rec = records[r.index]
        rec.sent = time.perf_counter()
        try:
            await one(r, rec)
        except Exception as e:  # one failed request must not stop the load
            rec.error = f"{type(e).__name__}: {e}"
        progress.update()

    if arrivals is None:
        pending = deque(reqs)

        async def client() -> None:
            while pending:
                await send(pending.popleft())

        await asyncio.gather(*(client() for _ in range(min(args.concurrency, len(reqs)))))
    else:
        tasks = []
        for r in reqs:
            delay = t0 + arrivals[r.index] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(r)))
        await asyncio.gather(*tasks)
    cpu = account.finish(
        max((t for r in records for t in r.times[-1:]), default=t0) - t0,
        sum(r.num_tokens for r in records if r.error is None),
    )
    return records, t0, cpu


# ---------------------------------------------------------------------------------------------------------
# Leg c: the engine in this process
# ---------------------------------------------------------------------------------------------------------


def engine_params(max_tokens: int):
    from pylon.serving.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def serving_warmup(warmup: list[Req], args) -> list[Req]:
    """The engine and http legs' untimed requests, sent at once: `--warmup` of them, and at least one per client
    (`--concurrency`). In the http leg each client then has its keep-alive connection (client -> HAProxy ->
    replica) open before the clock starts, as on a server that has been up; with two warm-up requests, 30 of the
    32 connections were opened inside a ~3 s timed leg. The engine leg takes the same wave, so both legs start
    with engines that have run a full batch."""
    if not warmup:
        return []
    return [warmup[i % len(warmup)] for i in range(max(len(warmup), args.concurrency))]


async def engine_leg(model_dir: Path, reqs: list[Req], warmup: list[Req], args) -> tuple[list[Record], float, dict]:
    from pylon.serving.engine.engine import AsyncLLMEngine
    from pylon.serving.engine.process import EnginePool

    spec = engine_spec(args)
    if spec.separate_process:
        # The engine processes as one replica runs them (engine.data_parallel): Ray sets OMP_NUM_THREADS to a
        # replica's CPUs and the pool gives each engine its share, --replica-cpus; a request goes to the engine with
        # the fewest open streams, as HAProxy's leastconn picks a replica with --replicas > 1.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads_per_engine(args) * args.engines)
        try:
            engine = EnginePool.from_model(str(model_dir), spec.model_copy(update={"data_parallel": args.engines}))
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    else:
        engine = AsyncLLMEngine.from_model(str(model_dir), spec)
    counter = iter(range(10**9))

    async def one(r: Req, rec: Record) -> None:
        rec.token_ids = []
        async for out in engine.generate(f"r{next(counter)}", r.ids, engine_params(r.max_tokens)):
            if out.token_ids:
                rec.times.append(time.perf_counter())
                rec.token_ids.extend(out.token_ids)
        rec.num_tokens = len(rec.token_ids)

    nice, moved = os.getpriority(os.PRIO_PROCESS, 0), {}
    try:
        if isinstance(engine, EnginePool):
            moved = match_policy(engine.pids[0], "engine")
        await asyncio.gather(*(one(r, Record(0.0)) for r in serving_warmup(warmup, args)))
        idle = await idle_background(None)  # as the http leg does, so that both start from the same pause
        records, t0, cpu = await drive(reqs, args, one, "engine")
        stats = engine.stats()
        return (
            records,
            t0,
            {
                "engines": args.engines if isinstance(engine, EnginePool) else 1,
                "preemptions": stats.num_preemptions_total,
                "kv_blocks": stats.num_blocks,
                "malloc": getattr(engine, "allocator", "in-process"),
                **cpu,
                "idle_cpu_ms_per_s": idle,
            },
        )
    finally:
        settle_threads(moved, nice, "engine")
        engine.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Leg d: Ray Serve + HTTP
# ---------------------------------------------------------------------------------------------------------


def threads_per_engine(args) -> int:
    return max(1, int(args.replica_cpus))


def deployment_spec(args, model_dir: Path):
    from pylon.specs import DeploymentSpec

    max_queued = max(256, args.num_requests)
    per_replica = args.engines // args.replicas  # engine.data_parallel
    return DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": DEPLOYMENT,
            "model": str(model_dir),
            "engine": {**engine_spec(args).model_dump(mode="json"), "data_parallel": per_replica},
            "autoscaling": {"min_replicas": args.replicas, "max_replicas": args.replicas},
            "http": {
                "api_keys_env": None,
                "max_queued_requests": max_queued,
                "request_timeout_s": 600,
                **({} if args.stream_interval_ms is None else {"stream_interval_ms": args.stream_interval_ms}),
            },
            "replica": {
                "num_cpus": args.replica_cpus * per_replica,
                "num_gpus": float(per_replica) if args.device == "cuda" else 0,
            },
        }
    )


async def http_load(url: str, reqs: list[Req], warmup: list[Req], args, cluster) -> tuple[list[Record], float, dict]:
    import aiohttp

    async def one_on(session, r: Req, rec: Record) -> None:
        body = {
            "model": DEPLOYMENT,
            "prompt": r.text,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"error event: {obj['error']}")
                if obj.get("choices"):
                    rec.times.append(now)
                if obj.get("usage"):
                    rec.num_tokens = obj["usage"]["completion_tokens"]

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(r: Req, rec: Record) -> None:
            await one_on(session, r, rec)

        await asyncio.gather(*(one(r, Record(0.0)) for r in serving_warmup(warmup, args)))
        idle = await idle_background(cluster)
        records, t0, cpu = await drive(reqs, args, one, "http", cluster)
        return records, t0, {**cpu, "idle_cpu_ms_per_s": idle}


IDLE_WINDOW_S = 3.0


async def idle_background(cluster) -> dict[str, float]:
    """CPU-ms a second each group of a leg's processes (`cluster`'s too, for the http leg) spends warm but with no
    request in flight, over IDLE_WINDOW_S just before the timed leg: for the http leg, what the cluster costs whether
    it serves or not (Ray's and Serve's own processes, the replica's and engines' idle loops, HAProxy)."""
    account = CpuAccount(cluster)
    await asyncio.sleep(IDLE_WINDOW_S)
    cpu = account.finish(IDLE_WINDOW_S, 1)["cpu_s"]
    return {
        group: round(1000 * cpu[group] / IDLE_WINDOW_S, 1) for group in CpuAccount.GROUPS if group != "load generator"
    }


def engine_malloc(engines) -> str:
    """Which malloc the replicas' engine processes run on (pylon.serving.engine.host: TCMalloc preloaded on a CPU)."""
    try:
        maps = [Path(f"/proc/{p.pid}/maps").read_text() for p in engines]
    except OSError:
        return "?"
    return "?" if not maps else "tcmalloc" if all("tcmalloc" in m for m in maps) else "glibc"


def ingress_and_niceness(info, args) -> dict:
    """Which ingress serves the leg, and the niceness of the engine it reaches; then, unless --keep-niceness,
    this process's threads take that niceness.

    Ray starts its workers at niceness 15 (RAY_worker_niceness), so the replica and its engine process run at 15
    while this load generator runs at 0: on a machine the clients share, the kernel would then hand every client
    wakeup the CPU at once, preempting the engine's threads mid-step. In the engine leg the engine process is this
    process's child, at its niceness. Matching them makes the legs differ in Serve + HTTP, not in priority."""
    procs = info.processes()
    names = {p.pid: " ".join(p.cmdline()) for p in procs}
    engines = [p for p in procs if "pylon.serving.engine.process" in names[p.pid]]
    replicas = [p for p in procs if "ServeReplica" in names[p.pid]]
    target = (engines or replicas)[0].nice() if (engines or replicas) else os.getpriority(os.PRIO_PROCESS, 0)
    haproxy = any(p.name() == "haproxy" for p in procs)
    out = {
        "ingress": "haproxy" if haproxy else "serve-proxy",
        "engine_niceness": target,
        "client_niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "malloc": engine_malloc(engines),
    }
    if not args.keep_niceness and target > out["client_niceness"]:
        for tid in os.listdir("/proc/self/task"):  # niceness is per thread on Linux
            os.setpriority(os.PRIO_PROCESS, int(tid), target)
        out["client_niceness"] = target
    log(f"  [http] ingress: {out['ingress']}; engine niceness {target}, load generator {out['client_niceness']}")
    return out


def settle_threads(moved: dict[int, int], nice: int, leg: str) -> None:
    """Every thread of this process back to its policy and to niceness `nice`, as before the leg. The leg moved them
    to the engine's policy and niceness (`match_policy`, `ingress_and_niceness`), and threads started during it
    (Ray's driver threads in the http leg) inherited both: `scheduling.restore` gives those the default policy back
    too. The next legs, rounds and private clusters (their processes inherit it; Ray adds its worker niceness on top)
    start from here. Lowering niceness needs CAP_SYS_NICE (root here); without it the rest of the run stays at the
    leg's niceness."""
    from pylon.serving.engine import sched_batch as scheduling

    scheduling.restore(moved)
    refused = False
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except PermissionError:
            refused = True
        except OSError:  # the thread ended meanwhile
            continue
    if refused:
        log(
            f"  [{leg}] cannot lower this process's niceness back to {nice} (no CAP_SYS_NICE): later legs and rounds "
            "run at this leg's"
        )


def match_policy(engine_pid: int, leg: str) -> dict[int, int]:
    """This process's threads take the served engine's scheduling policy for the leg, as they take its niceness:
    on a CPU an engine process runs SCHED_BATCH (pylon.serving.engine.sched_batch), and so does a replica, whose part
    the load generator plays in the engine leg. Returns the threads moved, for `settle_threads`."""
    from pylon.serving.engine import sched_batch as scheduling

    try:
        batch = os.sched_getscheduler(engine_pid) == os.SCHED_BATCH
    except OSError:
        return {}
    moved = scheduling.batch_all_threads() if batch else {}
    log(
        f"  [{leg}] engine scheduling policy {'SCHED_BATCH' if batch else 'default'}; load generator "
        f"{'the same' if batch else 'default'}"
    )
    return moved


@contextmanager
def private_cluster(num_cpus: int, label: str = "http"):
    """A private local Ray cluster for a bench run (`pylon.infra.local.up` under a PYLON_HOME of its own, so a
    user's cluster and ~/.pylon are never touched): yields its `ClusterInfo` and how long it took to start, and
    always stops it again. Stop what the run moved onto the cluster's processes before leaving the block."""
    home = Path(tempfile.mkdtemp(prefix="pylon-bench-"))
    os.environ["PYLON_HOME"] = str(home)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(name, None)
    from pylon.infra import local as cluster

    try:
        t = time.perf_counter()
        info, _ = cluster.up(num_cpus=num_cpus, object_store_memory=256 * 2**20, home=home)
        up_s = round(time.perf_counter() - t, 1)
        log(f"  [{label}] private Ray cluster up in {up_s} s ({info.dashboard_url}); deploying")
        yield info, up_s
    finally:
        t = time.perf_counter()
        cluster.down(home=home)
        shutil.rmtree(home, ignore_errors=True)
        log(f"  [{label}] cluster stopped in {time.perf_counter() - t:.1f} s")


def deploy_and_leave(spec, label: str = "http") -> tuple[str, float]:
    """Deploy `spec` on the private cluster and leave it as a Ray driver: the URL and how long deploying took."""
    from pylon.sdk.serve import deploy

    t = time.perf_counter()
    url = deploy(spec, timeout_s=300)
    deploy_s = round(time.perf_counter() - t, 1)
    log(f"  [{label}] deployed at {url} in {deploy_s} s")
    # The load generator is an HTTP client, as a user's are: deploying connected it to the cluster as a Ray
    # driver (its core worker's threads, and the GCS's and raylet's bookkeeping for it), which it leaves now.
    import ray

    ray.shutdown()
    return url, deploy_s


def http_leg(model_dir: Path, reqs: list[Req], warmup: list[Req], args) -> tuple[list[Record], float, dict]:
    """Start a private cluster, deploy, load it over HTTP, and always stop the cluster again."""
    num_cpus = max(int(args.engines * args.replica_cpus + 0.999), os.cpu_count() or 1)
    with private_cluster(num_cpus) as (info, up_s):
        extra, nice, moved = {"cluster_up_s": up_s}, os.getpriority(os.PRIO_PROCESS, 0), {}
        try:
            url, extra["deploy_s"] = deploy_and_leave(deployment_spec(args, model_dir))
            extra.update(ingress_and_niceness(info, args))
            engines = [p for p in info.processes() if "pylon.serving.engine.process" in " ".join(p.cmdline())]
            if engines:
                moved = match_policy(engines[0].pid, "http")
            records, t0, cpu = run_async(http_load(url, reqs, warmup, args, info))
            return records, t0, {**extra, **cpu}
        finally:
            settle_threads(moved, nice, "http")
