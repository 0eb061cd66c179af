"""Autoscaling on latency targets: replicas added while requests wait too long for their first token or between tokens.

Serve's own autoscaling counts the requests at each replica (`target_ongoing_requests`). What a user states, though,
is a latency: "first token within 500 ms, then a token every 50 ms" (Dynamo's planner scales prefill and decode
workers on exactly these two). Here each replica keeps its last `WINDOW_S` of requests' times (`LatencyWindow`) and
hands Serve their 90th percentiles as its autoscaling stats (Serve's `record_autoscaling_stats`); the Serve controller
runs `LatencyPolicy` (a custom autoscaling policy, `autoscaling_config.policy`) on them each tick:

- a time over its target asks for replicas in proportion (p90 twice the target: twice the replicas), as Serve's own
  policy does with its request counts;
- times under `DOWN_FRACTION` of every target they have ask for one replica fewer; in between, as many as now;
- with no request finished lately there is no time to go by, and the request counts decide alone;
- the request counts' decision (Serve's policy on `target_ongoing_requests`) is a floor throughout, so a queue that
  builds up before its requests finish still adds replicas.

Serve's wrapper around a custom policy then applies `upscale_delay_s`, `downscale_delay_s` and the replica bounds.
A decoding replica's time to first token runs from its request's arrival to the first token (its queue included); a
prefill replica's from the prompt's arrival there to its KV blocks being ready, its share of the request's.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

WINDOW_S = 30.0  # the requests a replica's percentiles cover: those that ended this recently
QUANTILE = 0.9
DOWN_FRACTION = 0.5  # times under this share of their targets let a replica go
MIN_SAMPLES = 3  # fewer requests than this in the window say nothing about its latency

# The names a replica's stats are reported under (Serve's custom autoscaling metrics).
TTFT = "pylon_ttft_p90_s"
ITL = "pylon_itl_p90_s"
SAMPLES = "pylon_latency_samples"


class LatencyWindow:
    """The times of a replica's requests that ended in the last `window_s` (the last `MAX_SAMPLES` of them at most):
    time to first token and (for requests of two tokens or more) the mean time between their tokens. Requests end on
    the replica's event loop and Serve asks for the stats on its own thread: a lock keeps the two apart."""

    MAX_SAMPLES = 10_000  # a replica answering thousands a second keeps its memory and its percentiles' time bounded

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._ttft: deque[tuple[float, float]] = deque(maxlen=self.MAX_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=self.MAX_SAMPLES)
        self._lock = threading.Lock()

    def add(self, ttft_s: float | None, itl_s: float | None = None) -> None:
        now = self._clock()
        with self._lock:
            if ttft_s is not None:
                self._ttft.append((now, ttft_s))
            if itl_s is not None:
                self._itl.append((now, itl_s))

    def stats(self) -> dict[str, float]:
        """Serve's autoscaling stats of the replica: each time's 90th percentile over the window (where it has
        `MIN_SAMPLES` requests), and how many requests the window holds."""
        horizon = self._clock() - self.window_s
        with self._lock:
            for samples in (self._ttft, self._itl):
                while samples and samples[0][0] < horizon:
                    samples.popleft()
            ttft, itl = [v for _, v in self._ttft], [v for _, v in self._itl]
        out: dict[str, float] = {}
        for name, values in ((TTFT, ttft), (ITL, itl)):
            if len(values) >= MIN_SAMPLES:
                out[name] = quantile(values, QUANTILE)
        out[SAMPLES] = float(len(ttft))
        return out


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank: one of the values, as Prometheus' histograms are not)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class LatencyPolicy:
    """Serve's autoscaling policy (a class: Serve builds it once with `policy_kwargs` and calls it each tick) for a
    deployment with latency targets. `target_ttft_s`, `target_itl_s`: the 90th percentiles aimed at (None: not
    aimed at). Returns (replicas wanted, policy state); the state, which Serve keeps between ticks, carries what the
    decision went by (the times, their worst ratio to a target, and whether latency or the request counts decided)."""

    def __init__(self, target_ttft_s: float | None = None, target_itl_s: float | None = None):
        if target_ttft_s is None and target_itl_s is None:
            raise ValueError("LatencyPolicy needs target_ttft_s or target_itl_s")
        self.targets = {TTFT: target_ttft_s, ITL: target_itl_s}

    def __call__(self, ctx) -> tuple[float, dict]:
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        by_requests, _ = replica_queue_length_autoscaling_policy(ctx)
        state = {k: v for k, v in ctx.policy_state.items() if not k.startswith("pylon_")}
        current = ctx.current_num_replicas
        if current == 0:  # a cold start: Serve's own rule (scale up on the first request)
            return by_requests, state
        times = fleet_times(ctx.aggregated_metrics or {})
        ratios = {name: times[name] / target for name, target in self.targets.items() if target and name in times}
        state.update({f"pylon_{name}": round(value, 6) for name, value in times.items()})
        if not ratios:  # nothing finished lately: no latency to go by
            state["pylon_reason"] = "requests"
            return by_requests, state
        worst = max(ratios.values())
        if worst > 1:
            by_latency = current * worst
        elif worst < DOWN_FRACTION:
            by_latency = current - 1
        else:
            by_latency = current
        state["pylon_latency_ratio"] = round(worst, 4)
        state["pylon_reason"] = "latency" if by_latency >= by_requests else "requests"
        return max(by_latency, by_requests), state


def fleet_times(aggregated: dict[str, dict]) -> dict[str, float]:
    """The deployment's times from its replicas' stats (`aggregated`: Serve's custom metrics, name -> replica ->
    value over its look-back period): each replica's percentile weighted by the requests it finished."""
    weights = aggregated.get(SAMPLES, {})
    out = {}
    for name in (TTFT, ITL):
        per_replica = aggregated.get(name, {})
        pairs = [(value, max(weights.get(replica, 1.0), 1.0)) for replica, value in per_replica.items()]
        if pairs:
            out[name] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return out


POLICY = f"{__name__}:LatencyPolicy"


def policy_config(target_ttft_ms: float | None, target_itl_ms: float | None) -> dict | None:
    """Serve's `autoscaling_config.policy` for these targets (None where neither is set)."""
    if target_ttft_ms is None and target_itl_ms is None:
        return None
    kwargs = {
        "target_ttft_s": None if target_ttft_ms is None else target_ttft_ms / 1000,
        "target_itl_s": None if target_itl_ms is None else target_itl_ms / 1000,
    }
    return {"policy_function": POLICY, "policy_kwargs": kwargs}
