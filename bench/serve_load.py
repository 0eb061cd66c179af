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
  http        the same engines behind Ray Serve (`pylon.sdk.serve.deploy` on a private local Ray cluster that
              the run starts and stops): by default one replica running all of them (`engine.data_parallel`,
              the layout for a CPU node; `--replicas` spreads them over more), `POST /v1/completions` with
              `stream: true` (SSE) over
              real HTTP from aiohttp clients. As deployed by default: Serve's HAProxy ingress in front of the
              replica's own HTTP server (pylon.infra.local.SERVE_INGRESS_ENV; RAY_SERVE_ENABLE_HA_PROXY=0 in the
              environment for Serve's Python proxy), the engine in a child process of the replica, streams
              coalesced every `--stream-interval-ms` (the spec's default 50 ms). Ray runs the replica and its
              engine at niceness 15; the load generator takes that niceness for this leg, as the engine leg's
              engine shares the load generator's (`--keep-niceness` to leave it at its own). On a CPU the
              engine processes (and replicas) run SCHED_BATCH (pylon.serving.engine.sched_batch); in both the engine and
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
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt"
RESULT = "serve_load: "

# The legs, the CPU accounting and the report live beside this file (serve_load_legs, serve_load_cpu,
# serve_load_report); every name of theirs is importable from here too, as before the split. Run as a script,
# bench/ is on sys.path already; loaded by its path (tests/unit/bench/test_bench_roofline.py), it is added.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from serve_load_cpu import (  # noqa: E402,F401
    CpuAccount,
    cpu_line,
    hardware_rates,
    roofline,
    roofline_line,
    workload_cost,
)
from serve_load_legs import (  # noqa: E402,F401
    DEPLOYMENT,
    IDLE_WINDOW_S,
    LEGS,
    Progress,
    Record,
    Req,
    StepTimes,
    arrival_times,
    build_model,
    deployment_spec,
    drive,
    engine_leg,
    engine_malloc,
    engine_params,
    engine_spec,
    hf_generate,
    http_leg,
    http_load,
    idle_background,
    ingress_and_niceness,
    log,
    make_requests,
    match_policy,
    run_async,
    run_hf,
    serving_warmup,
    settle_threads,
    threads_per_engine,
)
from serve_load_report import (  # noqa: E402,F401
    TARGETS,
    fmt,
    median_round,
    pct,
    print_cpu_ratios,
    print_details,
    print_table,
    print_targets,
    summarize,
)

# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX (got {text!r})")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated legs to run (default: {','.join(LEGS)})")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small smoke run: 24 requests, 8 clients, a 2-layer 128-wide model, short prompts/outputs",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed-loop clients; also the static batch size and the engine's minimum max_num_seqs (default 32)",
    )
    load.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open-loop Poisson arrivals at this many requests/s instead of closed-loop clients "
        "(static batches and max_num_seqs then use --batch-size)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="with --rate: static batch size and max_num_seqs")
    p.add_argument("--num-requests", type=int, default=None, help="timed requests per leg (default 128)")
    p.add_argument("--prompt-len", type=_range, default=None, help="MIN,MAX prompt bytes (= tokens) (default 32,512)")
    p.add_argument("--output-len", type=_range, default=None, help="MIN,MAX max_tokens per request (default 16,128)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed requests before each leg (default 2); the engine and http legs send at least one "
        "per client, at once (serving_warmup)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        type=Path,
        default=DATA,
        help=f"text the prompts are cut from (default {DATA.relative_to(REPO.parent)})",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where every leg runs the model (default cpu). cuda: one engine (--engines 1); the http leg "
        "then asks Serve for a GPU per replica",
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="fp32",
        help="model weights and compute, the same in every leg (default fp32; bf16/fp16 need --device cuda)",
    )
    _add_model_and_engine_arguments(p)
    return p


def _add_model_and_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model's and the engine's options, and how the legs run."""
    m = p.add_argument_group("model (random-weight GPT-2)")
    m.add_argument("--n-layer", type=int, default=None, help="default 4")
    m.add_argument("--n-embd", type=int, default=None, help="default 256")
    m.add_argument("--n-head", type=int, default=None, help="default 4")
    m.add_argument("--n-positions", type=int, default=1024)
    e = p.add_argument_group("engine (EngineSpec)")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="default: the concurrency")
    e.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="default: concurrency x max_model_len (never preempts)"
    )
    e.add_argument("--max-model-len", type=int, default=None, help="default: n_positions")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16", "fp8"],
        help="how the KV cache stores keys and values (default auto: fp32, as the model computes); "
        "a narrower cache gives up exact greedy parity, which the run then reports as it finds it",
    )
    e.add_argument(
        "--in-process-engine",
        action="store_true",
        help="engine leg and replica: the engine loop on a thread of the same process "
        "(engine.separate_process: false) instead of a child process",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=None,
        help="http leg: the deployment's http.stream_interval_ms (default: the spec's default, 50)",
    )
    p.add_argument(
        "--keep-niceness",
        action="store_true",
        help="http leg: leave the load generator at its niceness instead of taking the served engine's "
        "(Ray runs workers at 15; see ingress_and_niceness)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=None,
        help="engine processes, in both legs (default: one per core; 1 with --in-process-engine)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="http leg: the Serve replicas the engines are spread over, --engines / --replicas engine "
        "processes each (engine.data_parallel) (default 1: one replica with an engine per core, "
        "the layout for a CPU node; --replicas = --engines gives a replica per engine)",
    )
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs per engine: each engine process's torch threads, in both legs; a replica's num_cpus "
        "is this times its engines (default: the cores divided among --engines)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in this process")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every leg this many times, round after round; each target is the median of the rounds' "
        "ratios (legs of one round run back to back, under the same conditions), the table shows "
        "each leg's median-throughput round (default 1)",
    )


def parse_args(argv):
    p = build_parser()
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

    quick = dict(
        num_requests=24, concurrency=8, prompt_len=(16, 128), output_len=(8, 32), n_layer=2, n_embd=128, n_head=4
    )
    full = dict(
        num_requests=128, concurrency=32, prompt_len=(32, 512), output_len=(16, 128), n_layer=4, n_embd=256, n_head=4
    )
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


def run_leg(leg: str, model, tok, model_dir: Path, reqs: list[Req], warm: list[Req], args):
    """One leg, once: its records, the time its clock started, and its extra figures."""
    if leg in ("hf-single", "hf-static"):
        size = 1 if leg == "hf-single" else args.concurrency
        for w in range(0, len(warm), size):
            hf_generate(model, warm[w : w + size], tok.pad_id)
        records, t0 = run_hf(model, reqs, size, args, leg, tok.pad_id)
        extra = {}
    elif leg == "engine":
        records, t0, extra = run_async(engine_leg(model_dir, reqs, warm, args))
    else:
        records, t0, extra = http_leg(model_dir, reqs, warm, args)
    return records, t0, extra


def run_rounds(args, reqs: list[Req], warm: list[Req]):
    """Build the model, then run every leg `--rounds` times: per leg, {round: its summary}; the legs' errors; per
    leg, [each round's token ids]; and the hardware's rates (engine leg on a CPU, else None)."""
    rounds, errors, tokens = {}, {}, {}  # per leg: {round: its summary}, [each round's token ids]
    tmp = Path(tempfile.mkdtemp(prefix="pylon-serve-load-"))
    try:
        model_dir = tmp / "model"
        model_dir.mkdir()
        model, tok = build_model(args, model_dir)
        spec = engine_spec(args)
        print(
            f"engine: max_num_seqs {spec.max_num_seqs}, max_num_batched_tokens {spec.max_num_batched_tokens}, "
            f"kv_cache_tokens {spec.kv_cache_tokens} ({spec.kv_cache_dtype}), block_size {spec.block_size}, "
            f"max_model_len {spec.max_model_len}; {args.engines} engine process(es) of {args.replica_cpus:g} CPU "
            f"({threads_per_engine(args)} torch thread(s) each); http leg: {args.replicas} replica(s) of "
            f"{args.engines // args.replicas} engine(s)",
            flush=True,
        )
        rates = hardware_rates(args) if "engine" in args.legs and args.device == "cpu" else None
        for rnd in range(args.rounds):
            for leg in round_legs(args.legs, rnd):
                t = time.perf_counter()
                label = f"[{leg}]" if args.rounds == 1 else f"[{leg}, round {rnd + 1}/{args.rounds}]"
                log(f"{label} start")
                try:
                    records, t0, extra = run_leg(leg, model, tok, model_dir, reqs, warm, args)
                    summary = summarize(records, t0)
                    summary.update(extra)
                    rounds.setdefault(leg, {})[rnd] = summary
                    if records and records[0].token_ids is not None:
                        tokens.setdefault(leg, []).append([r.token_ids for r in records])
                    log(
                        f"{label} done in {time.perf_counter() - t:.0f} s: "
                        f"{summary['output_tok_per_s']:,.0f} output tok/s"
                    )
                    if "cpu_s" in summary:
                        log(f"  {cpu_line(leg, summary)}")
                except Exception as e:
                    errors.setdefault(leg, f"{type(e).__name__}: {e}")
                    log(f"{label} FAILED after {time.perf_counter() - t:.0f} s:\n{traceback.format_exc()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rounds, errors, tokens, rates


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    wall0 = time.perf_counter()
    load_start = os.getloadavg()
    import torch

    torch.set_num_threads(args.threads)
    reqs = make_requests(args)
    phrase = "To be, or not to be, that is the question"
    warm = [Req(-1 - i, phrase[: 8 + 4 * i], list(phrase[: 8 + 4 * i].encode()), 4 + i) for i in range(args.warmup)]
    load = f"Poisson arrivals at {args.rate:g} req/s" if args.rate else f"{args.concurrency} concurrent clients"
    prompt_tokens = sum(len(r.ids) for r in reqs)
    out_tokens = sum(r.max_tokens for r in reqs)
    print(
        f"model: random GPT-2 n_layer {args.n_layer} n_embd {args.n_embd} n_head {args.n_head} (vocab 320, "
        f"{args.dtype}, {args.device.upper()}, {args.threads} torch threads); {args.num_requests} requests from "
        f"{args.data.name}: prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens ({prompt_tokens:,} in all), max_tokens "
        f"{args.output_len[0]}-{args.output_len[1]} ({out_tokens:,} in all, ignore_eos); {load}",
        flush=True,
    )

    rounds, errors, tokens, rates = run_rounds(args, reqs, warm)

    results = {leg: median_round(list(rs.values())) for leg, rs in rounds.items()}
    for leg in rounds:
        if leg in errors:
            results[leg]["failed_rounds"] = args.rounds - len(rounds[leg])
    print_table(results, errors)
    ratios = print_targets(rounds)
    print_cpu_ratios(rounds, ratios)
    print_details(args, reqs, results, errors, tokens, rates)
    wall = time.perf_counter() - wall0
    load_end = os.getloadavg()
    print(
        f"wall time {wall:.0f} s; load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
        f"on {os.cpu_count()} cores (a busy machine slows the legs unevenly)"
    )
    config = {k: v for k, v in vars(args).items()}
    print(
        RESULT
        + json.dumps(
            {
                "config": config,
                "legs": results,
                "rounds": rounds,
                "ratios": ratios,
                "errors": errors,
                "wall_s": round(wall, 1),
                "loadavg_start": load_start,
                "loadavg_end": load_end,
                "cpus": os.cpu_count(),
            },
            default=str,
        ),
        flush=True,
    )
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
