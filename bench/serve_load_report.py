"""bench/serve_load.py's statistics and report: a leg's records summarized (`summarize`), the round of median
throughput, the table, the targets' ratios (round by round), the same by CPU, and the lines after them. See
serve_load.py's docstring; it re-exports every name here."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from serve_load_cpu import cpu_line, roofline, roofline_line, workload_cost
from serve_load_legs import LEGS

if TYPE_CHECKING:
    from serve_load_legs import Record, Req

# (name, numerator leg, denominator leg, target, description)
TARGETS = [
    ("engine/hf-single", "engine", "hf-single", 8.0, "engine / one-at-a-time"),
    ("engine/hf-static", "engine", "hf-static", 2.0, "engine / static batches"),
    ("http/engine", "http", "engine", 0.90, "Serve+HTTP / engine"),
]


# ---------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------


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
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "req_per_s": len(ok) / duration,
        "output_tok_per_s": tokens / duration,
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
# Report
# ---------------------------------------------------------------------------------------------------------


def median_round(summaries: list[dict]) -> dict:
    """The round whose output throughput is the median (the lower middle one of an even count)."""
    ordered = sorted(summaries, key=lambda r: r["output_tok_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2])


def fmt(v, width: int, spec: str = ".0f") -> str:
    return f"{'-' if v is None else format(v, spec):>{width}}"


def print_table(results: dict, errors: dict) -> None:
    head = (
        f"{'leg':<11}{'req/s':>7}{'out tok/s':>11} {'TTFT p50':>9}{'p99':>8} {'TPOT p50':>9}{'p99':>7}"
        f" {'ITL p50':>8}{'p99':>7} {'E2E p50':>8}{'p99':>8}"
    )
    print(f"\n{head}\n{'':<29}(all latencies in ms)")
    for leg in LEGS:
        if leg in results:
            r = results[leg]
            print(
                f"{leg:<11}{fmt(r['req_per_s'], 7, '.2f')}{fmt(r['output_tok_per_s'], 11, ',.0f')} "
                f"{fmt(r['ttft_p50_ms'], 9)}{fmt(r['ttft_p99_ms'], 8)} {fmt(r['tpot_p50_ms'], 9, '.1f')}"
                f"{fmt(r['tpot_p99_ms'], 7, '.1f')} {fmt(r['itl_p50_ms'], 8, '.1f')}{fmt(r['itl_p99_ms'], 7, '.1f')}"
                f" {fmt(r['e2e_p50_ms'], 8)}{fmt(r['e2e_p99_ms'], 8)}"
                + (f"   ({r['failed']} failed)" if r["failed"] else "")
            )
        elif leg in errors:
            print(f"{leg:<11}  FAILED: {errors[leg].splitlines()[0][:200]}")


def print_targets(rounds: dict) -> dict:
    """Each target's ratio of output tokens/s, the median of its rounds' (a leg against the other leg of its
    own round); returns them by name."""
    ratios = {}
    print()
    for name, num, den, target, what in TARGETS:
        # Round by round: a leg is compared with the other leg of its own round (the same conditions).
        nums, dens = rounds.get(num, {}), rounds.get(den, {})
        per_round = [
            nums[r]["output_tok_per_s"] / dens[r]["output_tok_per_s"]
            for r in sorted(nums)
            if r in dens and dens[r]["output_tok_per_s"]
        ]
        if per_round:
            ratio = statistics.median(per_round)
            met = ratio >= target
            ratios[name] = {"ratio": ratio, "target": target, "met": met, "rounds": per_round}
            spread = (
                ""
                if len(per_round) == 1
                else (f"  median of {len(per_round)} rounds: " + ", ".join(f"{r:.2f}" for r in per_round))
            )
            print(
                f"target: {what:<24} output tok/s {ratio:6.2f}x  (>= {target:g}x: {'met' if met else 'MISSED'})"
                + spread
            )
        else:
            print(f"target: {what:<24} not measured ({num} or {den} did not run)")
    return ratios


def print_cpu_ratios(rounds: dict, ratios: dict) -> None:
    """Serve+HTTP / engine by CPU per output token (into `ratios`), and the same without Ray's and Serve's own
    processes."""
    # The same figure by CPU: the engine leg's CPU-seconds (its own processes) over the http leg's, for the same
    # tokens. It moves less than throughput between rounds, so it tells a real change from noise.
    engine_rounds, http_rounds = rounds.get("engine", {}), rounds.get("http", {})
    by_cpu = [
        engine_rounds[r]["cpu_s_ours"] / max(http_rounds[r]["cpu_s_ours"], 1e-9)
        for r in sorted(engine_rounds)
        if r in http_rounds
    ]
    if by_cpu:
        ratios["http/engine by cpu"] = {"ratio": statistics.median(by_cpu), "rounds": by_cpu}
        print(
            f"Serve+HTTP / engine by CPU per output token (not a target; steadier): {statistics.median(by_cpu):.2f}x"
            + ("" if len(by_cpu) == 1 else "  rounds: " + ", ".join(f"{r:.2f}" for r in by_cpu))
        )
        # How much of that is the cluster's fixed cost: Ray's and Serve's own processes (the "ray" group: controller,
        # proxies, dashboard, GCS, raylet...) spend about as much a second with nothing to serve (measured just
        # before each http leg) as during it. On a small machine that is most of Serve + HTTP's cost, and it does
        # not grow with the machine: the ratio without that group's CPU is printed beside it (a diagnostic).
        shared = [r for r in sorted(engine_rounds) if r in http_rounds and "idle_cpu_ms_per_s" in http_rounds[r]]
        if shared:
            without = [
                engine_rounds[r]["cpu_s_ours"]
                / max(http_rounds[r]["cpu_s_ours"] - http_rounds[r]["cpu_s"]["ray"], 1e-9)
                for r in shared
            ]
            idle = statistics.median(http_rounds[r]["idle_cpu_ms_per_s"]["ray"] for r in shared)
            busy = statistics.median(
                1000 * http_rounds[r]["cpu_s"]["ray"] / http_rounds[r]["duration_s"] for r in shared
            )
            ratios["http/engine by cpu without ray's processes"] = {
                "ratio": statistics.median(without),
                "rounds": without,
            }
            print(
                f"  Ray's and Serve's own processes: {idle:.0f} CPU-ms a second deployed and idle, {busy:.0f} during "
                f"the http leg ({busy / 10 / (os.cpu_count() or 1):.1f}% of {os.cpu_count()} cores); by CPU "
                f"without them: {statistics.median(without):.2f}x (a diagnostic)"
            )


def print_details(args, reqs: list[Req], results: dict, errors: dict, tokens: dict, rates: dict | None) -> None:
    """Greedy parity, the roofline, the http and engine legs' particulars, their CPU, and the errors."""
    if "engine" in tokens and "hf-single" in tokens:
        reference = tokens["hf-single"][0]
        same = [sum(a == b for a, b in zip(run, reference)) for run in tokens["engine"]]
        print(
            f"greedy parity: engine tokens == hf-single tokens for {min(same)}/{len(reqs)} requests"
            + ("" if len(same) == 1 else f" (the worst of {len(same)} rounds)")
        )
        results["engine"]["parity_with_hf_single"] = min(same)
    if rates and "cpu_s" in results.get("engine", {}):
        line = roofline(workload_cost(args, reqs), rates, results["engine"]["cpu_s"]["engine"])
        results["engine"]["roofline"] = line
        print(roofline_line(line))
    if "http" in results:
        r = results["http"]
        print(
            f"http: {r['events']:,} SSE chunks for {r['output_tokens']:,} tokens (ITL is per chunk); ingress "
            f"{r.get('ingress', '?')}; niceness: engine {r.get('engine_niceness', '?')}, load generator "
            f"{r.get('client_niceness', '?')}; engines' malloc {r.get('malloc', '?')}"
        )
    if "malloc" in results.get("engine", {}):
        print(f"engine leg: engines' malloc {results['engine']['malloc']}")
    for leg in ("engine", "http"):
        if leg in results and "cpu_s" in results[leg]:
            print(cpu_line(leg, results[leg]))
    for leg, err in errors.items():
        print(f"error in {leg}: {err.splitlines()[0][:500]}")
