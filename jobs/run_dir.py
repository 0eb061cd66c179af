"""A training run's directory: its layout, and the readers and writers of what the trainer leaves there.

    <checkpoint.storage>/<name>/     run_uri_of(spec); default storage $PYLON_HOME/runs
        run.json                     the spec and the tokenizer it trained with
        metrics.jsonl                one JSON record per logged step (MetricsLog writes, read_metrics reads)
        workers.json                 where each rank ran
        reference_logits.json        the last state's logits on a fixed batch (export checks against them)
        loss.png                     the loss curve (plot_loss)
        checkpoints/, export/        see pylon.jobs.checkpoint and pylon.jobs.export

No Ray or DeepSpeed at import: the SDK and the planner read runs through this module, not through the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from pylon import home, storage
from pylon.specs import TrainJobSpec

METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
LOSS_PLOT = "loss.png"
WORKERS_FILE = "workers.json"


def run_uri_of(spec: TrainJobSpec) -> str:
    """Where a run lives: `<checkpoint.storage>/<name>` (default `$PYLON_HOME/runs/<name>`)."""
    root = spec.checkpoint.storage or str(home.pylon_home() / "runs")
    return storage.join(_absolute(root), spec.name)


def _absolute(uri: str) -> str:
    # Workers may start in another directory than the driver: pin relative paths to the driver's.
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


REFERENCE_FILE = "reference_logits.json"


class MetricsLog:
    """Rank 0's per-step records. Kept locally and committed whole to `<run>/metrics.jsonl` (object stores
    cannot append); on resume the records past the resumed step are dropped, so the curve continues."""

    def __init__(self, run_uri: str, *, enabled: bool, resume_step: int):
        self.uri = storage.join(run_uri, METRICS_FILE)
        self.enabled = enabled
        self.records = [r for r in read_metrics(run_uri) if r["step"] <= resume_step] if enabled else []

    def write(self, record: dict) -> None:
        if self.enabled:
            self.records.append(record)
            if record["step"] % 10 == 1 or record["step"] < 5:
                print(
                    json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}), flush=True
                )

    def flush(self) -> None:
        if self.enabled:
            storage.atomic_write_text(self.uri, "".join(json.dumps(r) + "\n" for r in self.records))


def read_metrics(run_uri: str) -> list[dict]:
    uri = storage.join(run_uri, METRICS_FILE)
    if not storage.exists(uri):
        return []
    return [json.loads(line) for line in storage.read_text(uri).splitlines() if line.strip()]


def loss_figure(records: list[dict], *, title: str):
    """The loss curve as a matplotlib Figure (what `Run.plot()` returns; Jupyter draws it inline)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.5)
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title=f"{title}: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    # pyplot forgets the figure: a notebook then shows it once (as the returned value, not again at the
    # cell's end), and a loop of plots holds no memory. The figure itself stays drawable and savable.
    plt.close(fig)
    return fig


def plot_loss(records: list[dict], out_uri: str, *, title: str) -> None:
    """A loss-curve PNG (people would rather look than read)."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # a job has no display
    buf = io.BytesIO()
    loss_figure(records, title=title).savefig(buf, format="png")
    storage.atomic_write(out_uri, buf.getvalue())
