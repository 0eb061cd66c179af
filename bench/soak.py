"""Soak: a bounded mixed load on one deployment for a set time, to find what only time finds (a leak, a 5xx that
one request in thousands hits, latency that creeps up).

    .venv/bin/python bench/soak.py                  # 10 minutes after a 30 s warm-up
    .venv/bin/python bench/soak.py --minutes 2      # a short run

Like bench/serve_load.py's http leg (whose setup it reuses: `private_cluster`, `deploy_and_leave`,
`deployment_spec`, `build_model`, the same random-weight GPT-2 of `--quick` saved as a Pylon export): a private
local Ray cluster on 127.0.0.1, one replica running an engine per core (`engine.data_parallel`), Serve's
HAProxy ingress, and `--concurrency` closed-loop aiohttp clients. Each client's next request is drawn (seeded)
from a mix: completions and chat completions, streamed and not (prompts cut from tinyshakespeare.txt, greedy,
`max_tokens` 8-32), client cancellations (a stream read for two events, then the connection closed), and bad
requests among the good ones (invalid JSON, wrong types, an unknown model, max_tokens past the context, an empty
prompt, an unknown field, a wrong method, an unknown path), each with the 4xx it should get.

It reports requests by outcome: 2xx, each 4xx status, 5xx the server chose (503: its engine is dead, 504: the
request ran past request_timeout_s; a status or an SSE error event) and unexpected 5xx (anything else: a 500, a
proxy's 502), client cancellations, and connection errors (a stream cut, a client timeout). Then a table per
minute of the measured time: requests, the good ones' end-to-end latency p50/p99, errors, and the replica's RSS
(the replica process and its engine processes) at the minute's end. The RSS at the start is taken after the
warm-up (`--warmup-s` of the same mix, not counted). Targets: 0 unexpected 5xx; RSS growth < 5% after warm-up.
Progress goes to stderr; the last stdout line is `soak: {json}` with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402
from serve_load_legs import (  # noqa: E402
    DEPLOYMENT,
    build_model,
    deploy_and_leave,
    deployment_spec,
    ingress_and_niceness,
    log,
    make_requests,
    private_cluster,
    run_async,
    settle_threads,
)
from serve_load_report import fmt, pct  # noqa: E402

RESULT = "soak: "
CLIENT_TIMEOUT_S = 120  # a request not answered in this long counts as a connection error (a hang)
REQUEST_TIMEOUT_S = 60  # the deployment's http.request_timeout_s: past it the server answers 504 itself
RSS_TARGET = 0.05  # growth after warm-up
CHOSEN_5XX = (503, 504)  # the server's own answers: a dead engine, a request past request_timeout_s

# kind -> weight in the mix
MIX = {"completion": 20, "completion-stream": 25, "chat": 12, "chat-stream": 13, "cancel": 12, "bad": 18}


def bad_requests(max_model_len: int) -> list[tuple[str, str, str, object, int]]:
    """(case, method, path, body: bytes or JSON, expected status)."""
    m = DEPLOYMENT
    return [
        ("invalid json", "POST", "/v1/completions", b'{"model": "bench", "prompt": ', 400),
        ("wrong type", "POST", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": "ten"}, 400),
        ("wrong type chat", "POST", "/v1/chat/completions", {"model": m, "messages": "hello"}, 400),
        ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
        (
            "oversize max_tokens",
            "POST",
            "/v1/completions",
            {"model": m, "prompt": "x", "max_tokens": max_model_len},
            400,
        ),
        ("empty prompt", "POST", "/v1/completions", {"model": m, "prompt": ""}, 400),
        ("unknown field", "POST", "/v1/completions", {"model": m, "prompt": "x", "max_tokenz": 3}, 400),
        ("wrong method", "GET", "/v1/completions", None, 405),
        ("unknown path", "POST", "/v1/nothing-here", {"model": m, "prompt": "x"}, 404),
    ]


@dataclass
class Outcome:
    kind: str
    sent: float  # perf_counter
    done: float = 0.0
    cls: str = ""  # "2xx", "4xx 400", "5xx chosen 503", "5xx unexpected 500", "cancelled", "connection error"
    detail: str = ""
    good: bool = False  # a good request answered in full (its latency counts)


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    mismatched: dict = field(default_factory=dict)  # bad request case -> statuses it got other than expected


def classify_status(status: int) -> str:
    if 200 <= status < 300:
        return "2xx"
    if 400 <= status < 500:
        return f"4xx {status}"
    if status in CHOSEN_5XX:
        return f"5xx chosen {status}"
    return f"5xx unexpected {status}"


async def one_request(session, url: str, kind: str, prompt: str, max_tokens: int, bad, soak: Soak) -> None:
    import aiohttp

    out = Outcome(kind, time.perf_counter())
    soak.outcomes.append(out)
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            if kind == "bad":
                await _bad(session, url, bad, out, soak)
            else:
                await _good(session, url, kind, prompt, max_tokens, out)
    except TimeoutError:
        out.cls, out.detail = "connection error", f"no answer within {CLIENT_TIMEOUT_S} s"
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        out.cls, out.detail = "connection error", f"{type(e).__name__}: {e}"
    out.done = time.perf_counter()


async def _bad(session, url: str, bad, out: Outcome, soak: Soak) -> None:
    case, method, path, body, expected = bad
    kwargs = {"data": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    headers = {"Content-Type": "application/json"} if isinstance(body, bytes) else {}
    async with session.request(method, f"{url}{path}", headers=headers, **kwargs) as r:
        text = await r.text()
        out.cls, out.detail = classify_status(r.status), case
        if r.status != expected:
            soak.mismatched.setdefault(case, []).append(r.status)
        elif r.status >= 400 and "error" not in json.loads(text):
            soak.mismatched.setdefault(case, []).append("no OpenAI error body")


async def _good(session, url: str, kind: str, prompt: str, max_tokens: int, out: Outcome) -> None:
    chat = kind.startswith("chat")
    stream = kind.endswith("stream") or kind == "cancel"
    body = {"model": DEPLOYMENT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind == "cancel":
        body.update(max_tokens=64, ignore_eos=True)
    async with session.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body) as r:
        if r.status != 200 or not stream:
            data = await r.read()
            out.cls = classify_status(r.status)
            if r.status == 200:
                out.good = bool(json.loads(data).get("choices"))
                if not out.good:
                    out.cls, out.detail = "5xx unexpected 200", "a 200 without choices"
            else:
                out.detail = data[:200].decode(errors="replace")
            return
        events = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out.cls, out.good = "2xx", True
                return
            events += 1
            obj = json.loads(data)
            if "error" in obj:  # the server's error event, then [DONE]
                code = obj["error"].get("code")
                out.cls = f"5xx chosen {code}" if code in CHOSEN_5XX else f"5xx unexpected {code} (SSE)"
                out.detail = obj["error"].get("message", "")[:200]
                return
            if kind == "cancel" and events >= 2:
                r.close()  # the client goes away mid-stream; the server aborts the engine request
                out.cls = "cancelled"
                return
        out.cls, out.detail = "connection error", "the stream ended before [DONE]"


async def load(url: str, args, prompts, phase: str, until: float, soak: Soak) -> None:
    import aiohttp

    bad = bad_requests(args.max_model_len)
    kinds, weights = list(MIX), list(MIX.values())
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client(i: int) -> None:
            rng = random.Random(f"{args.seed}-{phase}-{i}")
            while time.perf_counter() < until:
                kind = rng.choices(kinds, weights)[0]
                r = rng.choice(prompts)
                await one_request(session, url, kind, r.text, r.max_tokens, rng.choice(bad), soak)

        await asyncio.gather(*(client(i) for i in range(args.concurrency)))


def replica_pids(info) -> dict[str, int]:
    """The deployment's replica process and its engine processes: {"replica": pid, "engine 0": pid, ...}."""
    procs = info.processes()  # the private cluster's: the deployment's replica and its engines are the only ones
    replicas = [p for p in procs if f"ServeReplica:{DEPLOYMENT}" in " ".join(p.cmdline())]
    if len(replicas) != 1:
        raise RuntimeError(f"expected one replica process of {DEPLOYMENT}, found {len(replicas)}")
    engines = sorted((p for p in procs if "pylon.serving.engine.process" in " ".join(p.cmdline())), key=lambda p: p.pid)
    procs = replicas
    return {"replica": procs[0].pid, **{f"engine {i}": e.pid for i, e in enumerate(engines)}}


def rss_mib(pids: dict[str, int]) -> dict[str, float | None]:
    out = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            out[name] = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            out[name] = None  # the process is gone
    return out


async def soak_run(url: str, args, prompts, pids: dict[str, int]) -> dict:
    warm = Soak()
    log(f"[soak] warm-up: {args.warmup_s:g} s of the mix")
    await load(url, args, prompts, "warmup", time.perf_counter() + args.warmup_s, warm)
    start_rss = rss_mib(pids)
    log(f"[soak] RSS after warm-up (MiB): {start_rss}; measuring for {args.minutes:g} min")
    soak, t0 = Soak(), time.perf_counter()
    minutes = math.ceil(args.minutes)
    per_minute_rss: list[dict] = []

    async def sample() -> None:  # the RSS at each minute's end (the last one after the load has drained)
        for m in range(1, minutes):
            await asyncio.sleep(max(0.0, t0 + 60 * m - time.perf_counter()))
            per_minute_rss.append(rss_mib(pids))
            done = sum(1 for o in soak.outcomes if o.done)
            rss = sum(v or 0 for v in per_minute_rss[-1].values())
            log(f"[soak] minute {m}: {done} requests so far, RSS {rss:.0f} MiB")

    sampler = asyncio.create_task(sample())
    await load(url, args, prompts, "soak", t0 + args.minutes * 60, soak)
    sampler.cancel()
    per_minute_rss = per_minute_rss[: minutes - 1] + [rss_mib(pids)]
    return {"t0": t0, "soak": soak, "warm": warm, "start_rss": start_rss, "per_minute_rss": per_minute_rss}


def report(args, result: dict, pids: dict[str, int], extra: dict) -> dict:
    soak, t0 = result["soak"], result["t0"]
    outcomes = soak.outcomes
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.cls or "unfinished"] = counts.get(o.cls or "unfinished", 0) + 1
    order = sorted(counts, key=lambda c: (c[:3] != "2xx", c[:3] != "4xx", c.startswith("5xx u"), c))
    print(f"\nrequests by outcome ({len(outcomes)} in {args.minutes:g} min, {args.concurrency} clients):")
    for c in order:
        print(f"  {c:<28}{counts[c]:>8}")
    kinds = {k: sum(1 for o in outcomes if o.kind == k) for k in MIX}
    print("  by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    if soak.mismatched:
        print("  bad requests answered otherwise than expected: " + json.dumps(soak.mismatched))
    errors = [o for o in outcomes if o.cls == "connection error" or o.cls.startswith("5xx")]
    for o in errors[:5]:
        print(f"  e.g. {o.kind}: {o.cls}: {o.detail[:160]}")

    start = result["start_rss"]
    print("\nper minute (good requests' end-to-end latency; RSS of the replica and its engines at the minute's end):")
    print(f"{'minute':>6}{'requests':>10}{'good':>7}{'p50 ms':>9}{'p99 ms':>9}{'5xx':>6}{'conn err':>9}{'RSS MiB':>9}")
    table = []
    rss_rows = result["per_minute_rss"]
    for m, rss in enumerate(rss_rows):
        rows = [
            o
            for o in outcomes
            if m * 60 <= o.sent - t0 < (m + 1) * 60 or (m == len(rss_rows) - 1 and o.sent - t0 >= (m + 1) * 60)
        ]
        lat = [(o.done - o.sent) * 1e3 for o in rows if o.good]
        row = {
            "minute": m + 1,
            "requests": len(rows),
            "good": len(lat),
            "p50_ms": pct(lat, 50),
            "p99_ms": pct(lat, 99),
            "5xx": sum(1 for o in rows if o.cls.startswith("5xx")),
            "connection_errors": sum(1 for o in rows if o.cls == "connection error"),
            "rss_mib": round(sum(v or 0 for v in rss.values()), 1),
        }
        table.append(row)
        print(
            f"{row['minute']:>6}{row['requests']:>10}{row['good']:>7}{fmt(row['p50_ms'], 9)}{fmt(row['p99_ms'], 9)}"
            f"{row['5xx']:>6}{row['connection_errors']:>9}{row['rss_mib']:>9.1f}"
        )

    end = rss_rows[-1]
    print("\nRSS (MiB), after the warm-up -> at the end:")
    for name in pids:
        a, b = start.get(name), end.get(name)
        growth = f"{(b - a) / a:+.2%}" if a and b else "gone"
        print(f"  {name:<10} (pid {pids[name]}) {fmt(a, 8, '.1f')} -> {fmt(b, 8, '.1f')}  {growth}")
    total_a, total_b = sum(v or 0 for v in start.values()), sum(v or 0 for v in end.values())
    alive = all(v is not None for v in end.values())
    growth = (total_b - total_a) / total_a if total_a and alive else None
    print(
        f"  {'total':<10}{'':>13}{total_a:>8.1f} -> {total_b:>8.1f}  "
        + (f"{growth:+.2%}" if growth is not None else "a process is gone (replaced?)")
    )

    unexpected = sum(n for c, n in counts.items() if c.startswith("5xx unexpected"))
    met = {
        "0 unexpected 5xx": unexpected == 0,
        f"RSS growth < {RSS_TARGET:.0%} after warm-up": growth is not None and growth < RSS_TARGET,
    }
    print("\ntargets:")
    print(f"  0 unexpected 5xx: {unexpected} -> {'met' if met['0 unexpected 5xx'] else 'NOT met'}")
    key = f"RSS growth < {RSS_TARGET:.0%} after warm-up"
    shown = f"{growth:+.2%}" if growth is not None else "a process is gone"
    print(f"  {key}: {shown} -> {'met' if met[key] else 'NOT met'}")
    conn = counts.get("connection error", 0)
    mismatched = sum(len(v) for v in soak.mismatched.values())
    print(f"  (not a target) connection errors or hangs: {conn}; bad requests answered otherwise: {mismatched}")
    return {
        "counts": counts,
        "kinds": kinds,
        "mismatched": soak.mismatched,
        "per_minute": table,
        "rss_start_mib": start,
        "rss_end_mib": end,
        "rss_growth": growth,
        "targets_met": met,
        "warmup_requests": len(result["warm"].outcomes),
        **extra,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10, help="measured time, after the warm-up (default 10)")
    p.add_argument("--warmup-s", type=float, default=30, help="the mix before the RSS baseline is taken (default 30)")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default 16)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.warmup_s < 0:
        p.error("--minutes must be > 0, --concurrency >= 1, --warmup-s >= 0")
    # The deployment, the model and the prompts as serve_load's --quick http leg has them.
    load_args = serve_load.parse_args(
        [
            "--quick",
            "--legs",
            "http",
            "--concurrency",
            str(args.concurrency),
            "--num-requests",
            "256",
            "--seed",
            str(args.seed),
        ]
    )
    for k, v in vars(args).items():
        setattr(load_args, k, v)
    return load_args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(serve_load.REPO / ".cache" / "torch_extensions"))
    wall0, load_start = time.perf_counter(), os.getloadavg()
    prompts = make_requests(args)
    with tempfile.TemporaryDirectory(prefix="pylon-soak-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        build_model(args, model_dir)
        spec = deployment_spec(args, model_dir)
        spec = spec.model_copy(update={"http": spec.http.model_copy(update={"request_timeout_s": REQUEST_TIMEOUT_S})})
        print(
            f"soak: {args.minutes:g} min after a {args.warmup_s:g} s warm-up, {args.concurrency} clients; mix "
            + ", ".join(f"{k} {v}%" for k, v in MIX.items())
            + f"; random GPT-2 n_layer {args.n_layer} n_embd {args.n_embd}; one replica of {spec.engine.data_parallel} "
            f"engine(s), max_num_seqs {spec.engine.max_num_seqs}, request_timeout_s {REQUEST_TIMEOUT_S}; "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        num_cpus = max(int(args.engines * args.replica_cpus + 0.999), os.cpu_count() or 1)
        with private_cluster(num_cpus, "soak") as (info, up_s):
            nice, moved = os.getpriority(os.PRIO_PROCESS, 0), {}
            try:
                url, deploy_s = deploy_and_leave(spec, "soak")
                extra = {"cluster_up_s": up_s, "deploy_s": deploy_s, **ingress_and_niceness(info, args)}
                pids = replica_pids(info)
                result = run_async(soak_run(url, args, prompts, pids))
                still = replica_pids(info)
                if still != pids:
                    print(f"the replica's processes changed during the run: {pids} -> {still}")
                summary = report(args, result, pids, extra)
            finally:
                settle_threads(moved, nice, "soak")
    wall, load_end = time.perf_counter() - wall0, os.getloadavg()
    print(
        f"wall time {wall:.0f} s; load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
        f"on {os.cpu_count()} cores"
    )
    config = {k: v for k, v in vars(args).items() if k in ("minutes", "warmup_s", "concurrency", "seed")}
    print(RESULT + json.dumps({"config": config, **summary, "wall_s": round(wall, 1)}, default=str), flush=True)
    return 0 if all(summary["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
