"""Serving under load: Pylon's continuous-batching engine, in-process and behind Ray Serve + HTTP, against
`transformers` generate one request at a time and in static batches, in one run, on the same requests.

    .venv/bin/python bench/serve_load.py                          # 4 legs, 128 requests, 32 concurrent clients
    .venv/bin/python bench/serve_load.py --quick                  # a small smoke run
    .venv/bin/python bench/serve_load.py --legs engine,http --rate 8     # Poisson arrivals at 8 req/s
    .venv/bin/python bench/serve_load.py --rounds 3               # every leg 3 times; median ratios (~4 min)
    .venv/bin/python bench/serve_load.py --kv-cache-dtype bf16    # the engine's KV cache in bfloat16
    .venv/bin/python bench/serve_load.py --n-layer 8 --n-embd 512 --n-head 8 --num-requests 64 \
        --prompt-len 32,256 --output-len 64,256                   # a 25M-parameter model (~6 min)

The model is a random-weight GPT-2 built from a config (no download) and saved as a Pylon export: safetensors
plus `pylon_tokenizer.json` (the byte tokenizer). The requests are `--num-requests` prompts cut from
`../shared/datasets/tinyshakespeare.txt` (real text, as bytes), with prompt lengths drawn uniformly from
`--prompt-len` and output lengths (max_tokens, with ignore_eos so every request generates exactly that many)
from `--output-len`; seeded, and the same list for every leg. Greedy decoding everywhere.

Legs (`--legs`, default all four, in this order):
  hf-single   transformers `model.generate`, one request at a time (greedy, min_new_tokens = max_new_tokens):
              the baseline.
  hf-static   `generate` on static batches of up to `--concurrency` waiting requests, left-padded with an
              attention mask. A batch runs until its longest request is done; each request's tokens count
              only up to its own max_tokens, and it is done (E2E) at its own last token.
  engine      Pylon's engine called directly, streamed to asyncio clients in this process, as a replica runs it
              by default (`engine.separate_process`): the engine loop in a child process (`EnginePool`);
              `--engines` of them (default one per core, each with `--replica-cpus` torch threads: the cores
              divided among them), each request to the one with the fewest open requests. On a CPU one
              single-threaded engine per core beats one engine over all cores (2,094-2,134 against 1,678-1,809
              out tok/s on 2 cores, default workload): each step's Python runs on both cores at once, and no
              thread waits at a parallel region's barrier for a sibling the kernel took off its core.
              `--in-process-engine`: one `AsyncLLMEngine`, the loop on a thread of this process (its Python then
              shares one interpreter lock with the clients').
  http        the same engines behind Ray Serve (`pylon.serving.app.deploy` on a private local Ray cluster that
              the run starts and stops): by default one replica running all of them (`engine.data_parallel`,
              the layout for a CPU node; `--replicas` spreads them over more), `POST /v1/completions` with
              `stream: true` (SSE) over
              real HTTP from aiohttp clients. As deployed by default: Serve's HAProxy ingress in front of the
              replica's own HTTP server (pylon.cluster.SERVE_INGRESS_ENV; RAY_SERVE_ENABLE_HA_PROXY=0 in the
              environment for Serve's Python proxy), the engine in a child process of the replica, streams
              coalesced every `--stream-interval-ms` (the spec's default 50 ms). Ray runs the replica and its
              engine at niceness 15; the load generator takes that niceness for this leg, as the engine leg's
              engine shares the load generator's (`--keep-niceness` to leave it at its own). On a CPU the
              engine processes (and replicas) run SCHED_BATCH (pylon.serving.scheduling); in both the engine and
              the http legs the load generator takes the engine's policy, as a replica has it (`match_policy`).

Load: `--concurrency N` closed-loop clients (default 32): each sends its next request when its previous one
is done. Or `--rate R`: open-loop Poisson arrivals at R req/s (the same arrival times for every leg). The
two transformers legs are a server facing that same load: requests queue while it is busy, and it takes up
to 1 (hf-single) or `--concurrency` (hf-static) of the waiting requests at a time.

Metrics, as vLLM's `vllm bench serve` defines them, each p50 and p99 in ms, all measured from the moment the
client sent the request (so for the transformers legs they include waiting for the server):
  TTFT  time to first token. transformers legs: a `generate` streamer timestamps every decoding step, so a
        request's first token is the end of its batch's prefill step (the whole padded batch's prefill).
  TPOT  (E2E - TTFT) / (output tokens - 1), per request.
  ITL   every gap between consecutive token arrivals (engine: per output; http: per SSE chunk; transformers:
        per decoding step), pooled over all requests.
  E2E   time to the last token.
Throughput: finished requests and output tokens over the leg's duration (first send to last token).
CPU (engine and http legs): the CPU-seconds every process on the machine spent during the leg, grouped (engine
processes, Serve replicas, the load generator, HAProxy, Ray's and Serve's other processes, anything else), per
1,000 output tokens, and how often the engines were preempted (involuntary context switches): what Serve + HTTP
costs, in a unit that moves less between rounds than throughput does (`CpuAccount`). The run also prints
Serve+HTTP / engine by CPU per output token (the engine leg's CPU-seconds over the http leg's, neighbours left
out): not a target, but steadier than the throughput ratio, so it tells a real change from a noisy round.
Before each engine and http leg's clock starts, 3 s with nothing in flight (the same pause in both legs) measure
what each group spends idle; for the http leg that is the cluster's fixed cost (Ray's and Serve's own processes:
controller, proxies, dashboard, GCS, raylet...), and the run prints it and the CPU ratio without it (a diagnostic:
on 2 cores it is most of what Serve + HTTP costs, and it stays the same on a larger machine).
Roofline (engine leg, on a CPU): what the requests need of the hardware, counted from the model's shapes as the
engine runs them (`workload_cost`: GFLOP of projections and prompt attention, GB of cached keys and values that
decodes read), against two rates measured at the start of the run on one thread (`hardware_rates`: a 512-row fp32
GEMM, a 256 MB read): the least CPU-seconds the work could take on this machine, and what fraction of the engines'
real CPU-seconds that is. It says how far the engine is from the hardware, which no throughput ratio does.

On a shared or virtual machine a leg's throughput can move by 10% from one run to the next (neighbours, clock):
`--rounds N` runs the legs N times in turn and takes, per target, the median of the N ratios, each between two
legs of the same round. Every other round runs the engine and http legs in the opposite order (`round_legs`): on
these VMs the leg that runs first after a lull was often the faster one (in three 3-round runs the first round's
http / engine, engine leg first, was 0.77-0.80 against 0.90-0.97 in the later rounds; with the http leg first the
first round gave 1.07), so a fixed order would tilt the first round, and with few rounds the median, one way.

Ratios of output tokens/s, with targets (issue 5): engine / hf-single >= 8x, engine / hf-static >= 2x,
http / engine >= 0.90 (Serve + HTTP cost at most 10%). Progress goes to stderr; the last stdout line is
`serve_load: {json}` with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt"
RESULT = "serve_load: "
LEGS = ("hf-single", "hf-static", "engine", "http")
DEPLOYMENT = "bench"
# (name, numerator leg, denominator leg, target, description)
TARGETS = [
    ("engine/hf-single", "engine", "hf-single", 8.0, "engine / one-at-a-time"),
    ("engine/hf-static", "engine", "hf-static", 2.0, "engine / static batches"),
    ("http/engine", "http", "engine", 0.90, "Serve+HTTP / engine"),
]


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
        ids = list(data[start:start + n])
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
    config = AutoConfig.for_model("gpt2", n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                  n_positions=args.n_positions, vocab_size=320, eos_token_id=tok.eos_id,
                                  bos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)  # float32 on disk; each leg loads it in --dtype
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    from pylon.serving.model_runner import DTYPES  # the engine's own names for dtypes

    return model.to(device=args.device, dtype=DTYPES[args.dtype]), tok


def engine_spec(args):
    from pylon.specs import EngineSpec

    block = args.block_size
    kv = args.kv_cache_tokens or args.concurrency * args.max_model_len
    kv = -(-max(kv, args.max_model_len) // block) * block
    return EngineSpec(max_num_seqs=max(args.concurrency, args.max_num_seqs or 0),
                      max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=kv, block_size=block,
                      max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
                      kv_cache_dtype=args.kv_cache_dtype, separate_process=not args.in_process_engine)


# ---------------------------------------------------------------------------------------------------------
# Records and statistics
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


class CpuAccount:
    """CPU-seconds each kind of process on the machine spent during a leg, from /proc (psutil), and the engine
    processes' involuntary context switches (a core taken from them mid-step). Throughput moves by 10-20% between
    rounds on these VMs; CPU-seconds per 1,000 output tokens say where a leg's time went, and move far less.

    Groups: engine (pylon.serving.engine_process), replica (Serve replicas), load generator (this process),
    haproxy, ray (Ray's and Serve's other processes: GCS, raylet, dashboard, agents, controller, proxies), each
    only among this process's descendants and `cluster`'s processes; other (everything else on the machine: a
    busy neighbour, another Ray cluster, shows here)."""

    GROUPS = ("engine", "replica", "load generator", "haproxy", "ray", "other")

    def __init__(self, cluster=None):
        self.cluster = cluster  # the http leg's private cluster (pylon.cluster.ClusterInfo), whose processes count
        self.start = self._snapshot()

    def _ours(self) -> set[int]:
        import psutil

        me = psutil.Process()
        pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
        if self.cluster is not None:
            pids |= {p.pid for p in self.cluster.processes()}
        return pids

    @staticmethod
    def _group(pid: int, name: str, cmdline: str, ours: set[int]) -> str:
        if pid not in ours:
            return "other"
        if pid == os.getpid():
            return "load generator"
        if "pylon.serving.engine_process" in cmdline:
            return "engine"
        if "ServeReplica" in cmdline:
            return "replica"
        if name == "haproxy":
            return "haproxy"
        return "ray"

    def _snapshot(self) -> dict:
        import psutil

        out, ours = {}, self._ours()
        for p in psutil.process_iter(["name", "cmdline", "cpu_times", "num_ctx_switches", "create_time"]):
            info = p.info
            if info["cpu_times"] is None:
                continue
            t = info["cpu_times"]
            ctx = info["num_ctx_switches"]
            cmdline = info["cmdline"] or []
            out[(p.pid, info["create_time"])] = (
                self._group(p.pid, info["name"] or "", " ".join(cmdline), ours),
                t.user + t.system, ctx.involuntary if ctx else 0, self._label(info["name"] or "", cmdline))
        return out

    @staticmethod
    def _label(name: str, cmdline: list[str]) -> str:
        """A short name for a process of Ray's: its actor (`ray::ServeController`) or its script."""
        if cmdline and cmdline[0].startswith("ray::"):
            return cmdline[0].split()[0]
        scripts = [Path(a).name for a in cmdline[1:] if a.endswith(".py")]
        modules = [b for a, b in zip(cmdline, cmdline[1:]) if a == "-m"]
        return (scripts or modules or [name])[0]

    def finish(self, seconds: float, output_tokens: int) -> dict:
        end = self._snapshot()
        cpu = dict.fromkeys(self.GROUPS, 0.0)
        preempted, ray = 0, {}
        for key, (group, used, invol, label) in end.items():
            _, used0, invol0, _ = self.start.get(key, (group, 0.0, 0, label))
            cpu[group] += max(0.0, used - used0)
            if group == "engine":
                preempted += max(0, invol - invol0)
            if group == "ray":
                ray[label] = ray.get(label, 0.0) + max(0.0, used - used0)
        total = sum(cpu.values())
        per_k = 1000 / max(output_tokens, 1)
        return {"cpu_s": {g: round(v, 2) for g, v in cpu.items()}, "cpu_s_total": round(total, 2),
                "cpu_s_ours": round(total - cpu["other"], 2),  # the leg's own processes, neighbours left out
                "cpu_ms_per_1k_tokens": {g: round(v * per_k * 1000) for g, v in cpu.items()},
                "cpu_busy_fraction": round(total / max(seconds, 1e-9) / (os.cpu_count() or 1), 3),
                "engine_preemptions_per_s": round(preempted / max(seconds, 1e-9)),
                "ray_cpu_s": {k: round(v, 3) for k, v in sorted(ray.items(), key=lambda kv: -kv[1]) if v >= 0.005}}


def cpu_line(leg: str, r: dict) -> str:
    per_k = r["cpu_ms_per_1k_tokens"]
    parts = ", ".join(f"{g} {per_k[g]:,}" for g in CpuAccount.GROUPS if r["cpu_s"][g] >= 0.01)
    ray = ", ".join(f"{k} {v:.2f}" for k, v in list(r.get("ray_cpu_s", {}).items())[:8])
    idle = ", ".join(f"{g} {v:g}" for g, v in r.get("idle_cpu_ms_per_s", {}).items() if v >= 0.5)
    return (f"cpu {leg}: {r['cpu_s_total']:.1f} CPU-s, {r['cpu_busy_fraction']:.0%} of the machine; ms per 1k output "
            f"tokens: {parts}; engines preempted {r['engine_preemptions_per_s']:,}/s"
            + (f"\n  ray's processes, CPU-s: {ray}" if ray else "")
            + (f"\n  deployed and idle just before, CPU-ms a second: {idle}" if idle else ""))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(records: list[Record], t_start: float) -> dict:
    ok = [r for r in records if r.error is None and r.times]
    ttft = [(r.times[0] - r.sent) * 1e3 for r in ok]
    e2e = [(r.times[-1] - r.sent) * 1e3 for r in ok]
    tpot = [(r.times[-1] - r.times[0]) * 1e3 / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.times, r.times[1:])]
    end = max((r.times[-1] for r in ok), default=t_start)
    duration = max(end - t_start, 1e-9)
    tokens = sum(r.num_tokens for r in ok)
    out = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": round(duration, 3),
        "output_tokens": tokens, "req_per_s": len(ok) / duration, "output_tok_per_s": tokens / duration,
        "events": sum(len(r.times) for r in ok),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_mean_ms"] = statistics.fmean(values) if values else None
        out[f"{name}_p50_ms"] = pct(values, 50)
        out[f"{name}_p99_ms"] = pct(values, 99)
    errors = [r.error for r in records if r.error]
    if errors:
        out["first_error"] = errors[0]
    return out


# ---------------------------------------------------------------------------------------------------------
# The hardware's floor for the engine's work
# ---------------------------------------------------------------------------------------------------------

def workload_cost(args, reqs: list[Req], vocab: int = 320) -> dict:
    """What the engine leg's requests need of the hardware, counted from the model's shapes as the engine runs them
    (`pylon.serving.model_runner`): GFLOP of compute-bound work (projections, lm_head, attention among a prompt's
    own tokens) and GB of cached keys and values that decoding attention reads (bound by memory bandwidth: a step
    reads every live sequence's cache, far past the CPU's caches). A request of P prompt and O output tokens feeds
    P + O - 1 tokens through the model; O of them sample (the prompt's last and every decode) and run every layer
    and lm_head; the other P - 1 run the first L - 1 layers and only the last layer's QKV projection (their keys
    and values), as `Final` skips the rest. Preemptions' recomputation is left out: this is a floor."""
    from pylon.serving.model_runner import DTYPES, resolve_kv_dtype

    d, L = args.n_embd, args.n_layer
    kv_bytes = resolve_kv_dtype(args.kv_cache_dtype, DTYPES[args.dtype]).itemsize  # per cached element
    layer = 2 * 12 * d * d  # QKV (3d^2), output (d^2), MLP up and down (4d^2 each); 2 FLOPs a multiply-add
    proj = attn = kv = 0
    for r in reqs:
        P, O = len(r.ids), r.max_tokens
        proj += (P - 1) * ((L - 1) * layer + 2 * 3 * d * d) + O * (L * layer + 2 * d * vocab)
        attn += (L - 1) * 2 * d * P * (P + 1)  # causal QK^T and PV among the prompt's tokens, 4d a pair
        # Decodes: token j (0 .. O-2) attends over P + j + 1 cached positions in every layer; the prompt's last
        # token over its P in the last layer. Keys and values: 2 * d elements a position.
        kv += (L * sum(P + j + 1 for j in range(O - 1)) + P) * 2 * d * kv_bytes
    return {"gflop": (proj + attn) / 1e9, "kv_gb": kv / 1e9, "projection_flop": proj, "attention_flop": attn,
            "kv_bytes": kv}


def hardware_rates(args) -> dict:
    """One core's float32 GEMM rate at the model's prefill shape (512 rows through the MLP's up projection) and its
    read bandwidth from memory (a 256 MB sum), measured now, on one thread as each engine runs: the two rates the
    engine's work is bound by. The best of three tries of each: the floor, not the typical."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = args.n_embd
        x, lin = torch.randn(512, d), torch.nn.Linear(d, 4 * d)
        big = torch.ones(64 * 2**20)  # 256 MB, past any L3
        with torch.no_grad():
            for _ in range(5):
                lin(x)
            n = max(10, int(2e9 / (2 * 512 * d * 4 * d)))  # ~2 GFLOP a try
            gemm = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(n):
                    lin(x)
                gemm.append(2 * 512 * d * 4 * d * n / (time.perf_counter() - t))
            big.sum()
            read = []
            for _ in range(3):
                t = time.perf_counter()
                big.sum()
                read.append(big.numel() * 4 / (time.perf_counter() - t))
        return {"gemm_gflops": max(gemm) / 1e9, "read_gbs": max(read) / 1e9}
    finally:
        torch.set_num_threads(threads)


def roofline(cost: dict, rates: dict, engine_cpu_s: float) -> dict:
    floor = cost["gflop"] / rates["gemm_gflops"] + cost["kv_gb"] / rates["read_gbs"]
    shown = {k: round(cost[k], 3) for k in ("gflop", "kv_gb")} | {k: round(v, 2) for k, v in rates.items()}
    return {**shown, "floor_cpu_s": round(floor, 3),
            "engine_cpu_s": engine_cpu_s, "fraction": round(floor / max(engine_cpu_s, 1e-9), 3)}


def _figure(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def roofline_line(r: dict) -> str:
    return (f"roofline (engine leg): {_figure(r['gflop'])} GFLOP of projections and prompt attention, "
            f"{_figure(r['kv_gb'])} GB of cached keys and values read by decodes; at one core's "
            f"{r['gemm_gflops']:.0f} GF/s (512-row fp32 GEMM) and {r['read_gbs']:.0f} GB/s (memory read), measured "
            f"now, that is at least {_figure(r['floor_cpu_s'])} CPU-s; the engines used {_figure(r['engine_cpu_s'])}: "
            f"{r['fraction']:.0%} of the hardware's pace (the rest: Python and dispatch, norms, KV writes, sampling, "
            f"GEMMs of fewer rows)")


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
        ids[row, width - len(r.ids):] = torch.tensor(r.ids)
        mask[row, width - len(r.ids):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    new = max(r.max_tokens for r in batch)
    timer = StepTimes()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad_id, streamer=timer)
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
            mine = times[:r.max_tokens]
            records[r.index] = Record(sent, mine, len(mine), toks[:r.max_tokens])
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
    cpu = account.finish(max((t for r in records for t in r.times[-1:]), default=t0) - t0,
                         sum(r.num_tokens for r in records if r.error is None))
    return records, t0, cpu


# ---------------------------------------------------------------------------------------------------------
# Leg c: the engine in this process
# ---------------------------------------------------------------------------------------------------------


def engine_params(max_tokens: int):
    from pylon.serving.sampling import SamplingParams

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
    from pylon.serving.engine import AsyncLLMEngine
    from pylon.serving.engine_process import EnginePool

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
        return records, t0, {"engines": args.engines if isinstance(engine, EnginePool) else 1,
                             "preemptions": stats.num_preemptions_total, "kv_blocks": stats.num_blocks,
                             "malloc": getattr(engine, "allocator", "in-process"), **cpu, "idle_cpu_ms_per_s": idle}
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
    return DeploymentSpec.model_validate({
        "kind": "Deployment", "name": DEPLOYMENT, "model": str(model_dir),
        "engine": {**engine_spec(args).model_dump(mode="json"), "data_parallel": per_replica},
        "autoscaling": {"min_replicas": args.replicas, "max_replicas": args.replicas},
        "http": {"api_keys_env": None, "max_queued_requests": max_queued, "request_timeout_s": 600,
                 **({} if args.stream_interval_ms is None else {"stream_interval_ms": args.stream_interval_ms})},
        "replica": {"num_cpus": args.replica_cpus * per_replica,
                    "num_gpus": float(per_replica) if args.device == "cuda" else 0},
    })


async def http_load(url: str, reqs: list[Req], warmup: list[Req], args, cluster) -> tuple[list[Record], float, dict]:
    import aiohttp

    async def one_on(session, r: Req, rec: Record) -> None:
        body = {"model": DEPLOYMENT, "prompt": r.text, "max_tokens": r.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
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
    return {group: round(1000 * cpu[group] / IDLE_WINDOW_S, 1) for group in CpuAccount.GROUPS
            if group != "load generator"}


def engine_malloc(engines) -> str:
    """Which malloc the replicas' engine processes run on (pylon.serving.heap: TCMalloc preloaded on a CPU)."""
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
    engines = [p for p in procs if "pylon.serving.engine_process" in names[p.pid]]
    replicas = [p for p in procs if "ServeReplica" in names[p.pid]]
    target = (engines or replicas)[0].nice() if (engines or replicas) else os.getpriority(os.PRIO_PROCESS, 0)
    haproxy = any(p.name() == "haproxy" for p in procs)
    out = {"ingress": "haproxy" if haproxy else "serve-proxy", "engine_niceness": target,
           "client_niceness": os.getpriority(os.PRIO_PROCESS, 0), "malloc": engine_malloc(engines)}
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
    from pylon.serving import scheduling

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
        log(f"  [{leg}] cannot lower this process's niceness back to {nice} (no CAP_SYS_NICE): later legs and rounds "
            "run at this leg's")


def match_policy(engine_pid: int, leg: str) -> dict[int, int]:
    """This process's threads take the served engine's scheduling policy for the leg, as they take its niceness:
    on a CPU an engine process runs SCHED_BATCH (pylon.serving.scheduling), and so does a replica, whose part
    the load generator plays in the engine leg. Returns the threads moved, for `settle_threads`."""
    from pylon.serving import scheduling

    try:
        batch = os.sched_getscheduler(engine_pid) == os.SCHED_BATCH
    except OSError:
        return {}
    moved = scheduling.batch_all_threads() if batch else {}
    log(f"  [{leg}] engine scheduling policy {'SCHED_BATCH' if batch else 'default'}; load generator "
        f"{'the same' if batch else 'default'}")
    return moved


def http_leg(model_dir: Path, reqs: list[Req], warmup: list[Req], args) -> tuple[list[Record], float, dict]:
    """Start a private cluster, deploy, load it over HTTP, and always stop the cluster again."""
    home = Path(tempfile.mkdtemp(prefix="pylon-bench-"))
    os.environ["PYLON_HOME"] = str(home)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(name, None)
    from pylon import cluster

    extra, nice, moved = {}, os.getpriority(os.PRIO_PROCESS, 0), {}
    try:
        t = time.perf_counter()
        info, _ = cluster.up(num_cpus=max(int(args.engines * args.replica_cpus + 0.999), os.cpu_count() or 1),
                             object_store_memory=256 * 2**20, home=home)
        extra["cluster_up_s"] = round(time.perf_counter() - t, 1)
        log(f"  [http] private Ray cluster up in {extra['cluster_up_s']} s ({info.dashboard_url}); deploying")
        from pylon.serving.app import deploy

        t = time.perf_counter()
        url = deploy(deployment_spec(args, model_dir), timeout_s=300)
        extra["deploy_s"] = round(time.perf_counter() - t, 1)
        log(f"  [http] deployed at {url} in {extra['deploy_s']} s")
        # The load generator is an HTTP client, as a user's are: deploying connected it to the cluster as a Ray
        # driver (its core worker's threads, and the GCS's and raylet's bookkeeping for it), which it leaves now.
        import ray

        ray.shutdown()
        extra.update(ingress_and_niceness(info, args))
        engines = [p for p in info.processes() if "pylon.serving.engine_process" in " ".join(p.cmdline())]
        if engines:
            moved = match_policy(engines[0].pid, "http")
        records, t0, cpu = run_async(http_load(url, reqs, warmup, args, info))
        return records, t0, {**extra, **cpu}
    finally:
        settle_threads(moved, nice, "http")
        t = time.perf_counter()
        cluster.down(home=home)
        shutil.rmtree(home, ignore_errors=True)
        log(f"  [http] cluster stopped in {time.perf_counter() - t:.1f} s")


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX (got {text!r})")
    return lo, hi


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated legs to run (default: {','.join(LEGS)})")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run: 24 requests, 8 clients, a 2-layer 128-wide model, short prompts/outputs")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed-loop clients; also the static batch size and the engine's minimum max_num_seqs "
                           "(default 32)")
    load.add_argument("--rate", type=float, default=None,
                      help="open-loop Poisson arrivals at this many requests/s instead of closed-loop clients "
                           "(static batches and max_num_seqs then use --batch-size)")
    p.add_argument("--batch-size", type=int, default=32, help="with --rate: static batch size and max_num_seqs")
    p.add_argument("--num-requests", type=int, default=None, help="timed requests per leg (default 128)")
    p.add_argument("--prompt-len", type=_range, default=None, help="MIN,MAX prompt bytes (= tokens) (default 32,512)")
    p.add_argument("--output-len", type=_range, default=None, help="MIN,MAX max_tokens per request (default 16,128)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed requests before each leg (default 2); the engine and http legs send at least one "
                        "per client, at once (serving_warmup)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DATA,
                   help=f"text the prompts are cut from (default {DATA.relative_to(REPO.parent)})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every leg runs the model (default cpu). cuda: one engine (--engines 1); the http leg "
                        "then asks Serve for a GPU per replica")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32",
                   help="model weights and compute, the same in every leg (default fp32; bf16/fp16 need --device cuda)")
    m = p.add_argument_group("model (random-weight GPT-2)")
    m.add_argument("--n-layer", type=int, default=None, help="default 4")
    m.add_argument("--n-embd", type=int, default=None, help="default 256")
    m.add_argument("--n-head", type=int, default=None, help="default 4")
    m.add_argument("--n-positions", type=int, default=1024)
    e = p.add_argument_group("engine (EngineSpec)")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="default: the concurrency")
    e.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="default: concurrency x max_model_len (never preempts)")
    e.add_argument("--max-model-len", type=int, default=None, help="default: n_positions")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                   help="how the KV cache stores keys and values (default auto: fp32, as the model computes); "
                        "a narrower cache gives up exact greedy parity, which the run then reports as it finds it")
    e.add_argument("--in-process-engine", action="store_true",
                   help="engine leg and replica: the engine loop on a thread of the same process "
                        "(engine.separate_process: false) instead of a child process")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="http leg: the deployment's http.stream_interval_ms (default: the spec's default, 50)")
    p.add_argument("--keep-niceness", action="store_true",
                   help="http leg: leave the load generator at its niceness instead of taking the served engine's "
                        "(Ray runs workers at 15; see ingress_and_niceness)")
    p.add_argument("--engines", type=int, default=None,
                   help="engine processes, in both legs (default: one per core; 1 with --in-process-engine)")
    p.add_argument("--replicas", type=int, default=None,
                   help="http leg: the Serve replicas the engines are spread over, --engines / --replicas engine "
                        "processes each (engine.data_parallel) (default 1: one replica with an engine per core, "
                        "the layout for a CPU node; --replicas = --engines gives a replica per engine)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs per engine: each engine process's torch threads, in both legs; a replica's num_cpus "
                        "is this times its engines (default: the cores divided among --engines)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in this process")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every leg this many times, round after round; each target is the median of the rounds' "
                        "ratios (legs of one round run back to back, under the same conditions), the table shows "
                        "each leg's median-throughput round (default 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    cores = os.cpu_count() or 1
    if args.in_process_engine and (args.engines or 1) != 1:
        p.error("--in-process-engine runs one engine (on a thread of this process); leave --engines out")
    if args.dtype != "fp32" and args.device != "cuda":
        p.error("--dtype bf16/fp16 needs --device cuda (half-precision matmuls on a CPU are not what is served)")
    if not args.data.is_file():
        p.error(f"--data: {args.data} is not a file (the prompts are cut from it)")
    args.engines = args.engines or (1 if args.in_process_engine or args.device == "cuda" else cores)
    if args.engines < 1:
        p.error("--engines must be at least 1")
    args.replica_cpus = args.replica_cpus or max(1.0, cores / args.engines)
    args.replicas = args.replicas or 1
    if args.replicas < 1 or args.engines % args.replicas:
        p.error(f"--replicas must divide --engines ({args.engines}) (got {args.replicas})")
    if args.in_process_engine and args.replicas != 1:
        p.error("--in-process-engine runs one engine in one replica; leave --replicas out")

    quick = dict(num_requests=24, concurrency=8, prompt_len=(16, 128), output_len=(8, 32), n_layer=2, n_embd=128,
                 n_head=4)
    full = dict(num_requests=128, concurrency=32, prompt_len=(32, 512), output_len=(16, 128), n_layer=4, n_embd=256,
                n_head=4)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rate:
        args.concurrency = args.batch_size
    args.max_model_len = args.max_model_len or args.n_positions
    args.legs = [x.strip() for x in args.legs.split(",") if x.strip()]
    unknown = [x for x in args.legs if x not in LEGS]
    if unknown:
        p.error(f"--legs: unknown {unknown}; choose from {', '.join(LEGS)}")
    if args.prompt_len[1] + args.output_len[1] > args.max_model_len:
        p.error(f"--prompt-len max + --output-len max must be <= max_model_len ({args.max_model_len})")
    return args


def round_legs(legs: list[str], rnd: int) -> list[str]:
    """The legs of round `rnd` (from 0) in the order they run: as given, except that every odd round swaps the
    engine and http legs where both run, so that neither always runs first (see the module's docstring)."""
    if rnd % 2 == 0 or not {"engine", "http"} <= set(legs):
        return list(legs)
    i, j = legs.index("engine"), legs.index("http")
    out = list(legs)
    out[i], out[j] = out[j], out[i]
    return out


def median_round(summaries: list[dict]) -> dict:
    """The round whose output throughput is the median (the lower middle one of an even count)."""
    ordered = sorted(summaries, key=lambda r: r["output_tok_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2])


def fmt(v, width: int, spec: str = ".0f") -> str:
    return f"{'-' if v is None else format(v, spec):>{width}}"


def print_table(results: dict, errors: dict) -> None:
    head = (f"{'leg':<11}{'req/s':>7}{'out tok/s':>11} {'TTFT p50':>9}{'p99':>8} {'TPOT p50':>9}{'p99':>7}"
            f" {'ITL p50':>8}{'p99':>7} {'E2E p50':>8}{'p99':>8}")
    print(f"\n{head}\n{'':<29}(all latencies in ms)")
    for leg in LEGS:
        if leg in results:
            r = results[leg]
            print(f"{leg:<11}{fmt(r['req_per_s'], 7, '.2f')}{fmt(r['output_tok_per_s'], 11, ',.0f')} "
                  f"{fmt(r['ttft_p50_ms'], 9)}{fmt(r['ttft_p99_ms'], 8)} {fmt(r['tpot_p50_ms'], 9, '.1f')}"
                  f"{fmt(r['tpot_p99_ms'], 7, '.1f')} {fmt(r['itl_p50_ms'], 8, '.1f')}{fmt(r['itl_p99_ms'], 7, '.1f')}"
                  f" {fmt(r['e2e_p50_ms'], 8)}{fmt(r['e2e_p99_ms'], 8)}"
                  + (f"   ({r['failed']} failed)" if r["failed"] else ""))
        elif leg in errors:
            print(f"{leg:<11}  FAILED: {errors[leg].splitlines()[0][:200]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    wall0 = time.perf_counter()
    load_start = os.getloadavg()
    import torch

    torch.set_num_threads(args.threads)
    reqs = make_requests(args)
    phrase = "To be, or not to be, that is the question"
    warm = [Req(-1 - i, phrase[:8 + 4 * i], list(phrase[:8 + 4 * i].encode()), 4 + i) for i in range(args.warmup)]
    load = f"Poisson arrivals at {args.rate:g} req/s" if args.rate else f"{args.concurrency} concurrent clients"
    prompt_tokens = sum(len(r.ids) for r in reqs)
    out_tokens = sum(r.max_tokens for r in reqs)
    print(f"model: random GPT-2 n_layer {args.n_layer} n_embd {args.n_embd} n_head {args.n_head} (vocab 320, "
          f"{args.dtype}, {args.device.upper()}, {args.threads} torch threads); {args.num_requests} requests from "
          f"{args.data.name}: prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens ({prompt_tokens:,} in all), max_tokens "
          f"{args.output_len[0]}-{args.output_len[1]} ({out_tokens:,} in all, ignore_eos); {load}", flush=True)

    rounds, errors, tokens = {}, {}, {}  # per leg: {round: its summary}, [each round's token ids]
    tmp = Path(tempfile.mkdtemp(prefix="pylon-serve-load-"))
    try:
        model_dir = tmp / "model"
        model_dir.mkdir()
        model, tok = build_model(args, model_dir)
        spec = engine_spec(args)
        print(f"engine: max_num_seqs {spec.max_num_seqs}, max_num_batched_tokens {spec.max_num_batched_tokens}, "
              f"kv_cache_tokens {spec.kv_cache_tokens} ({spec.kv_cache_dtype}), block_size {spec.block_size}, "
              f"max_model_len {spec.max_model_len}; {args.engines} engine process(es) of {args.replica_cpus:g} CPU "
              f"({threads_per_engine(args)} torch thread(s) each); http leg: {args.replicas} replica(s) of "
              f"{args.engines // args.replicas} engine(s)", flush=True)
        rates = hardware_rates(args) if "engine" in args.legs and args.device == "cpu" else None
        for rnd in range(args.rounds):
            for leg in round_legs(args.legs, rnd):
                t = time.perf_counter()
                label = f"[{leg}]" if args.rounds == 1 else f"[{leg}, round {rnd + 1}/{args.rounds}]"
                log(f"{label} start")
                try:
                    if leg in ("hf-single", "hf-static"):
                        size = 1 if leg == "hf-single" else args.concurrency
                        for w in range(0, len(warm), size):
                            hf_generate(model, warm[w:w + size], tok.pad_id)
                        records, t0 = run_hf(model, reqs, size, args, leg, tok.pad_id)
                        extra = {}
                    elif leg == "engine":
                        records, t0, extra = run_async(engine_leg(model_dir, reqs, warm, args))
                    else:
                        records, t0, extra = http_leg(model_dir, reqs, warm, args)
                    summary = summarize(records, t0)
                    summary.update(extra)
                    rounds.setdefault(leg, {})[rnd] = summary
                    if records and records[0].token_ids is not None:
                        tokens.setdefault(leg, []).append([r.token_ids for r in records])
                    log(f"{label} done in {time.perf_counter() - t:.0f} s: "
                        f"{summary['output_tok_per_s']:,.0f} output tok/s")
                    if "cpu_s" in summary:
                        log(f"  {cpu_line(leg, summary)}")
                except Exception as e:
                    errors.setdefault(leg, f"{type(e).__name__}: {e}")
                    log(f"{label} FAILED after {time.perf_counter() - t:.0f} s:\n{traceback.format_exc()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {leg: median_round(list(rs.values())) for leg, rs in rounds.items()}
    for leg in rounds:
        if leg in errors:
            results[leg]["failed_rounds"] = args.rounds - len(rounds[leg])
    print_table(results, errors)
    ratios = {}
    print()
    for name, num, den, target, what in TARGETS:
        # Round by round: a leg is compared with the other leg of its own round (the same conditions).
        nums, dens = rounds.get(num, {}), rounds.get(den, {})
        per_round = [nums[r]["output_tok_per_s"] / dens[r]["output_tok_per_s"]
                     for r in sorted(nums) if r in dens and dens[r]["output_tok_per_s"]]
        if per_round:
            ratio = statistics.median(per_round)
            met = ratio >= target
            ratios[name] = {"ratio": ratio, "target": target, "met": met, "rounds": per_round}
            spread = "" if len(per_round) == 1 else (f"  median of {len(per_round)} rounds: "
                                                     + ", ".join(f"{r:.2f}" for r in per_round))
            print(f"target: {what:<24} output tok/s {ratio:6.2f}x  (>= {target:g}x: {'met' if met else 'MISSED'})"
                  + spread)
        else:
            print(f"target: {what:<24} not measured ({num} or {den} did not run)")
    # The same figure by CPU: the engine leg's CPU-seconds (its own processes) over the http leg's, for the same
    # tokens. It moves less than throughput between rounds, so it tells a real change from noise.
    engine_rounds, http_rounds = rounds.get("engine", {}), rounds.get("http", {})
    by_cpu = [engine_rounds[r]["cpu_s_ours"] / max(http_rounds[r]["cpu_s_ours"], 1e-9)
              for r in sorted(engine_rounds) if r in http_rounds]
    if by_cpu:
        ratios["http/engine by cpu"] = {"ratio": statistics.median(by_cpu), "rounds": by_cpu}
        print(f"Serve+HTTP / engine by CPU per output token (not a target; steadier): {statistics.median(by_cpu):.2f}x"
              + ("" if len(by_cpu) == 1 else "  rounds: " + ", ".join(f"{r:.2f}" for r in by_cpu)))
        # How much of that is the cluster's fixed cost: Ray's and Serve's own processes (the "ray" group: controller,
        # proxies, dashboard, GCS, raylet...) spend about as much a second with nothing to serve (measured just
        # before each http leg) as during it. On a small machine that is most of Serve + HTTP's cost, and it does
        # not grow with the machine: the ratio without that group's CPU is printed beside it (a diagnostic).
        shared = [r for r in sorted(engine_rounds) if r in http_rounds and "idle_cpu_ms_per_s" in http_rounds[r]]
        if shared:
            without = [engine_rounds[r]["cpu_s_ours"] / max(http_rounds[r]["cpu_s_ours"]
                                                            - http_rounds[r]["cpu_s"]["ray"], 1e-9) for r in shared]
            idle = statistics.median(http_rounds[r]["idle_cpu_ms_per_s"]["ray"] for r in shared)
            busy = statistics.median(1000 * http_rounds[r]["cpu_s"]["ray"] / http_rounds[r]["duration_s"]
                                     for r in shared)
            ratios["http/engine by cpu without ray's processes"] = {"ratio": statistics.median(without),
                                                                   "rounds": without}
            print(f"  Ray's and Serve's own processes: {idle:.0f} CPU-ms a second deployed and idle, {busy:.0f} during "
                  f"the http leg ({busy / 10 / (os.cpu_count() or 1):.1f}% of {os.cpu_count()} cores); by CPU "
                  f"without them: {statistics.median(without):.2f}x (a diagnostic)")
    if "engine" in tokens and "hf-single" in tokens:
        reference = tokens["hf-single"][0]
        same = [sum(a == b for a, b in zip(run, reference)) for run in tokens["engine"]]
        print(f"greedy parity: engine tokens == hf-single tokens for {min(same)}/{len(reqs)} requests"
              + ("" if len(same) == 1 else f" (the worst of {len(same)} rounds)"))
        results["engine"]["parity_with_hf_single"] = min(same)
    if rates and "cpu_s" in results.get("engine", {}):
        line = roofline(workload_cost(args, reqs), rates, results["engine"]["cpu_s"]["engine"])
        results["engine"]["roofline"] = line
        print(roofline_line(line))
    if "http" in results:
        r = results["http"]
        print(f"http: {r['events']:,} SSE chunks for {r['output_tokens']:,} tokens (ITL is per chunk); ingress "
              f"{r.get('ingress', '?')}; niceness: engine {r.get('engine_niceness', '?')}, load generator "
              f"{r.get('client_niceness', '?')}; engines' malloc {r.get('malloc', '?')}")
    if "malloc" in results.get("engine", {}):
        print(f"engine leg: engines' malloc {results['engine']['malloc']}")
    for leg in ("engine", "http"):
        if leg in results and "cpu_s" in results[leg]:
            print(cpu_line(leg, results[leg]))
    for leg, err in errors.items():
        print(f"error in {leg}: {err.splitlines()[0][:500]}")
    wall = time.perf_counter() - wall0
    load_end = os.getloadavg()
    print(f"wall time {wall:.0f} s; load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
          f"on {os.cpu_count()} cores (a busy machine slows the legs unevenly)")
    config = {k: v for k, v in vars(args).items()}
    print(RESULT + json.dumps({"config": config, "legs": results, "rounds": rounds, "ratios": ratios, "errors": errors,
                               "wall_s": round(wall, 1), "loadavg_start": load_start, "loadavg_end": load_end,
                               "cpus": os.cpu_count()}, default=str), flush=True)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
