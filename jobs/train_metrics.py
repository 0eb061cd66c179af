"""A training run's Prometheus metrics, through Ray's metrics agent (`ray.util.metrics`; scraped with the `ray_`
prefix, e.g. `ray_pylon_train_loss`). The trainer makes one per worker after it knows its rank:

    train_metrics = TrainMetrics(spec.name, rank)
    ...
    metrics.write(record)
    train_metrics.step(record)
    ...
    t = time.perf_counter(); ok = False
    try:
        committer.save(...); ok = True
    finally:
        train_metrics.checkpoint(time.perf_counter() - t, ok)

What each rank exports: the run's global values (the step, the loss and the tokens, all-reduced over the ranks)
come from rank 0 only, so a sum over ranks counts them once; what differs per rank (the share of a step spent
waiting for data, the time a checkpoint save blocked training, failed saves) comes from every rank, tagged `rank`.

| metric (as scraped)                                    | type    | ranks | tags        |
|--------------------------------------------------------|---------|-------|-------------|
| `ray_pylon_train_step`                                 | gauge   | 0     | run, rank   |
| `ray_pylon_train_loss`                                 | gauge   | 0     | run, rank   |
| `ray_pylon_train_tokens_total`                         | counter | 0     | run, rank   |
| `ray_pylon_train_data_wait_fraction`                   | gauge   | all   | run, rank   |
| `ray_pylon_train_checkpoint_blocked_seconds_total`     | counter | all   | run, rank   |
| `ray_pylon_train_checkpoint_failures_total`            | counter | all   | run, rank   |

Ray exports a counter's series from its first increment on: `..._failures_total` exists only once a save failed
(the PylonCheckpointFailures alert counts a new series as a failure).
"""

from __future__ import annotations

from typing import Any


class TrainMetrics:
    """One training worker's metrics; `step` after each optimizer step, `checkpoint` after each save."""

    def __init__(self, run_name: str, rank: int) -> None:
        from ray.util import metrics

        self.rank = rank
        tags = {"run": run_name, "rank": str(rank)}
        keys = ("run", "rank")

        def made(kind, name: str, description: str):
            m = kind(name, description=description, tag_keys=keys)
            m.set_default_tags(dict(tags))
            return m

        self._data_wait = made(
            metrics.Gauge, "pylon_train_data_wait_fraction", "Share of the last step spent waiting for data"
        )
        self._blocked = made(
            metrics.Counter,
            "pylon_train_checkpoint_blocked_seconds_total",
            "Seconds training was blocked by checkpoint saves",
        )
        self._failures = made(metrics.Counter, "pylon_train_checkpoint_failures_total", "Checkpoint saves that failed")
        if rank == 0:
            self._step = made(metrics.Gauge, "pylon_train_step", "The last optimizer step completed")
            self._loss = made(metrics.Gauge, "pylon_train_loss", "Training loss of the last step (mean over tokens)")
            self._tokens = made(metrics.Counter, "pylon_train_tokens_total", "Tokens trained on (all ranks)")

    def step(self, record: dict[str, Any]) -> None:
        """One step's record (as the trainer writes it to metrics.jsonl: step, loss, tokens, data_wait_fraction...)."""
        self._data_wait.set(float(record["data_wait_fraction"]))
        if self.rank == 0:
            self._step.set(float(record["step"]))
            self._loss.set(float(record["loss"]))
            if record["tokens"] > 0:  # Ray's counters take increments > 0 only
                self._tokens.inc(float(record["tokens"]))

    def checkpoint(self, blocked_s: float, ok: bool) -> None:
        """A save that blocked training for `blocked_s` seconds, and whether it succeeded."""
        if blocked_s > 0:
            self._blocked.inc(float(blocked_s))
        if not ok:
            self._failures.inc()
