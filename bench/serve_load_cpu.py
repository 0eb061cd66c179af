"""bench/serve_load.py's CPU accounting and the hardware's floor for the engine's work: what every process on the
machine spent during a leg (`CpuAccount`, `cpu_line`), and what the engine leg's requests need of the hardware
against the rates this machine measures (`workload_cost`, `hardware_rates`, `roofline`). See serve_load.py's
docstring; it re-exports every name here."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_load_legs import Req


# ---------------------------------------------------------------------------------------------------------
# CPU accounting of the machine's processes
# ---------------------------------------------------------------------------------------------------------


class CpuAccount:
    """CPU-seconds each kind of process on the machine spent during a leg, from /proc (psutil), and the engine
    processes' involuntary context switches (a core taken from them mid-step). Throughput moves by 10-20% between
    rounds on these VMs; CPU-seconds per 1,000 output tokens say where a leg's time went, and move far less.

    Groups: engine (pylon.serving.engine.process), replica (Serve replicas), load generator (this process),
    haproxy, ray (Ray's and Serve's other processes: GCS, raylet, dashboard, agents, controller, proxies), each
    only among this process's descendants and `cluster`'s processes; other (everything else on the machine: a
    busy neighbour, another Ray cluster, shows here)."""

    GROUPS = ("engine", "replica", "load generator", "haproxy", "ray", "other")

    def __init__(self, cluster=None):
        self.cluster = cluster  # the http leg's private cluster (pylon.infra.local.ClusterInfo), whose processes count
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
        if "pylon.serving.engine.process" in cmdline:
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
                t.user + t.system,
                ctx.involuntary if ctx else 0,
                self._label(info["name"] or "", cmdline),
            )
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
        return {
            "cpu_s": {g: round(v, 2) for g, v in cpu.items()},
            "cpu_s_total": round(total, 2),
            "cpu_s_ours": round(total - cpu["other"], 2),  # the leg's own processes, neighbours left out
            "cpu_ms_per_1k_tokens": {g: round(v * per_k * 1000) for g, v in cpu.items()},
            "cpu_busy_fraction": round(total / max(seconds, 1e-9) / (os.cpu_count() or 1), 3),
            "engine_preemptions_per_s": round(preempted / max(seconds, 1e-9)),
            "ray_cpu_s": {k: round(v, 3) for k, v in sorted(ray.items(), key=lambda kv: -kv[1]) if v >= 0.005},
        }


def cpu_line(leg: str, r: dict) -> str:
    per_k = r["cpu_ms_per_1k_tokens"]
    parts = ", ".join(f"{g} {per_k[g]:,}" for g in CpuAccount.GROUPS if r["cpu_s"][g] >= 0.01)
    ray = ", ".join(f"{k} {v:.2f}" for k, v in list(r.get("ray_cpu_s", {}).items())[:8])
    idle = ", ".join(f"{g} {v:g}" for g, v in r.get("idle_cpu_ms_per_s", {}).items() if v >= 0.5)
    return (
        f"cpu {leg}: {r['cpu_s_total']:.1f} CPU-s, {r['cpu_busy_fraction']:.0%} of the machine; ms per 1k output "
        f"tokens: {parts}; engines preempted {r['engine_preemptions_per_s']:,}/s"
        + (f"\n  ray's processes, CPU-s: {ray}" if ray else "")
        + (f"\n  deployed and idle just before, CPU-ms a second: {idle}" if idle else "")
    )


# ---------------------------------------------------------------------------------------------------------
# The hardware's floor for the engine's work
# ---------------------------------------------------------------------------------------------------------


def workload_cost(args, reqs: list[Req], vocab: int = 320) -> dict:
    """What the engine leg's requests need of the hardware, counted from the model's shapes as the engine runs them
    (`pylon.serving.model.runner`): GFLOP of compute-bound work (projections, lm_head, attention among a prompt's
    own tokens) and GB of cached keys and values that decoding attention reads (bound by memory bandwidth: a step
    reads every live sequence's cache, far past the CPU's caches). A request of P prompt and O output tokens feeds
    P + O - 1 tokens through the model; O of them sample (the prompt's last and every decode) and run every layer
    and lm_head; the other P - 1 run the first L - 1 layers and only the last layer's QKV projection (their keys
    and values), as `Final` skips the rest. Preemptions' recomputation is left out: this is a floor."""
    from pylon.serving.model.runner import DTYPES, resolve_kv_dtype

    d, L = args.n_embd, args.n_layer
    kv_bytes = resolve_kv_dtype(args.kv_cache_dtype, DTYPES[args.dtype]).itemsize  # per cached element
    layer = 2 * 12 * d * d  # QKV (3d^2), output (d^2), MLP up and down (4d^2 each); 2 FLOPs a multiply-add
    proj = attn = kv = 0
    for r in reqs:
        P, O = len(r.ids), r.max_tokens  # noqa: E741 (prompt and output lengths, as the formula names them)
        proj += (P - 1) * ((L - 1) * layer + 2 * 3 * d * d) + O * (L * layer + 2 * d * vocab)
        attn += (L - 1) * 2 * d * P * (P + 1)  # causal QK^T and PV among the prompt's tokens, 4d a pair
        # Decodes: token j (0 .. O-2) attends over P + j + 1 cached positions in every layer; the prompt's last
        # token over its P in the last layer. Keys and values: 2 * d elements a position.
        kv += (L * sum(P + j + 1 for j in range(O - 1)) + P) * 2 * d * kv_bytes
    return {
        "gflop": (proj + attn) / 1e9,
        "kv_gb": kv / 1e9,
        "projection_flop": proj,
        "attention_flop": attn,
        "kv_bytes": kv,
    }


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
    return {
        **shown,
        "floor_cpu_s": round(floor, 3),
        "engine_cpu_s": engine_cpu_s,
        "fraction": round(floor / max(engine_cpu_s, 1e-9), 3),
    }


def _figure(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def roofline_line(r: dict) -> str:
    return (
        f"roofline (engine leg): {_figure(r['gflop'])} GFLOP of projections and prompt attention, "
        f"{_figure(r['kv_gb'])} GB of cached keys and values read by decodes; at one core's "
        f"{r['gemm_gflops']:.0f} GF/s (512-row fp32 GEMM) and {r['read_gbs']:.0f} GB/s (memory read), measured "
        f"now, that is at least {_figure(r['floor_cpu_s'])} CPU-s; the engines used {_figure(r['engine_cpu_s'])}: "
        f"{r['fraction']:.0%} of the hardware's pace (the rest: Python and dispatch, norms, KV writes, sampling, "
        f"GEMMs of fewer rows)"
    )
