"""A training run's directory: its layout, and the readers and writers of what the trainer leaves there.

    <checkpoint.storage>/<name>/     run_uri_of(spec); default storage $PYLON_HOME/runs
        run.json                     the spec and the tokenizer it trained with
        metrics.jsonl                one JSON record per logged step (MetricsLog writes, read_metrics reads), and
                                     one `"kind": "eval"` record per held-out evaluation (eval_record)
        completions.jsonl            objective grpo and rloo: a few sampled completions a step, with their rewards
                                     (CompletionsLog writes, read_completions reads)
        workers.json                 where each rank ran
        reference_logits.json        the last state's logits on a fixed batch (export checks against them)
        loss.png                     the loss curve (plot_loss)
        checkpoints/, export/        see pylon.jobs.checkpoint and pylon.jobs.export

No Ray or DeepSpeed at import: the SDK and the planner read runs through this module, not through the trainer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pylon import home, storage
from pylon.specs import TrainJobSpec

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
RUN_FILE = "run.json"
LOSS_PLOT = "loss.png"
WORKERS_FILE = "workers.json"


def run_uri_of(spec: TrainJobSpec) -> str:
    """Where a run lives: `<checkpoint.storage>/<name>` (default `$PYLON_HOME/runs/<name>`)."""
    root = spec.checkpoint.storage or str(home.pylon_home() / "runs")
    return storage.join(_absolute(root), spec.name)


# Filesystems that are the same files on every machine that mounts them (network and cluster filesystems, and FUSE
# mounts of object stores: gcsfuse, s3fs-fuse, JuiceFS, Mountpoint for S3). A path on any other (ext4, xfs, tmpfs,
# overlay...) is one machine's own.
SHARED_FS_TYPES = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p", "wekafs")


def filesystem_type(path: str) -> str:
    """The type of the filesystem `path` lives on (the deepest mount point above it in /proc/mounts)."""
    target = Path(path).expanduser().absolute()
    best, fstype = "", "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fstype
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (str(target) == mount or str(target).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return fstype


def every_node_reads(uri: str, *, working_dir: str | None = None) -> bool:
    """Whether every node of a cluster sees the same thing at `uri`: object storage, a shared filesystem, or a path
    inside the job's own working directory (Ray unpacks that on every node a job's workers run on)."""
    if "://" in uri and not uri.startswith("file://"):
        return True
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    if working_dir is not None:
        if not os.path.isabs(path):
            return True
        root = os.path.realpath(working_dir)
        if os.path.realpath(path) == root or os.path.realpath(path).startswith(root + os.sep):
            return True
    fstype = filesystem_type(path)
    return fstype in SHARED_FS_TYPES or fstype.startswith("fuse.")


def storage_problems(fields: dict[str, str], nodes: int, *, working_dir: str | None = None) -> list[str]:
    """Why a job on a cluster of `nodes` nodes cannot use the storage `fields` name ({field path: uri}): each
    local path one node cannot share, named by its field."""
    if nodes <= 1:
        return []
    return [
        f"{field}: {uri} is a directory on one machine's own disk ({filesystem_type(uri)}), and this cluster has "
        f"{nodes} nodes: the workers on the others could not read or write it. Use object storage every node "
        "reaches (s3://BUCKET/...), or a shared filesystem (NFS, Lustre...) mounted at the same path on every node"
        for field, uri in fields.items()
        if not every_node_reads(uri, working_dir=working_dir)
    ]


def _absolute(uri: str) -> str:
    # Workers may start in another directory than the driver: pin relative paths to the driver's.
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


REFERENCE_FILE = "reference_logits.json"


class MetricsLog:
    """Rank 0's per-step records. Kept locally and committed whole to `<run>/metrics.jsonl` (object stores
    cannot append); on resume the records past the resumed step are dropped, so the curve continues."""

    name = METRICS_FILE

    def __init__(self, run_uri: str, *, enabled: bool, resume_step: int):
        self.uri = storage.join(run_uri, self.name)
        self.enabled = enabled
        kept = _read_jsonl(self.uri) if enabled else []
        self.records = [r for r in kept if r["step"] <= resume_step]

    def write_eval(self, record: dict) -> None:
        """A held-out evaluation (`"kind": "eval"`, see `eval_record`), with one readable log line: not a
        `{"step": ...}` line, which log followers take for a training step."""
        if self.enabled:
            self.records.append(record)
            print(eval_line(record), flush=True)

    def write(self, record: dict) -> None:
        if self.enabled:
            self.records.append(record)
            if printed_step(record["step"]):
                print(
                    json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}), flush=True
                )

    def flush(self) -> None:
        if self.enabled:
            storage.atomic_write_text(self.uri, "".join(json.dumps(r) + "\n" for r in self.records))


class CompletionsLog(MetricsLog):
    """Rank 0's sampled completions (objective grpo and rloo: `grpo.log_completions` a step, TRL's
    `log_completions`), each a record of its step, prompt, completion, answer, rewards and advantage; kept and
    committed with the metrics (`flush`), and cut back to the resumed step as they are. One of each printed step's
    is printed too (`sample_line`)."""

    name = COMPLETIONS_FILE

    def write_step(self, step: int, samples: list[dict]) -> None:
        if self.enabled and samples:
            self.records.extend({"step": step, **s} for s in samples)
            if printed_step(step):
                print(sample_line(step, samples[0]), flush=True)


def printed_step(step: int) -> bool:
    """Whether the job's log shows `step` (its record as a JSON line): the first few, then every tenth."""
    return step % 10 == 1 or step < 5


def sample_line(step: int, sample: dict, width: int = 100) -> str:
    """One sampled completion as a log line: not a `{"step": ...}` line, which log followers take for a step."""

    def short(text: str, keep_end: bool) -> str:
        text = json.dumps(text, ensure_ascii=False)[1:-1]  # newlines and quotes escaped: one line
        if len(text) <= width:
            return text
        return "..." + text[-width:] if keep_end else text[:width] + "..."

    return (
        f"step {step} completion: reward {sample['reward']:.3g}, advantage {sample['advantage']:.3g}: "
        f'"{short(sample["prompt"], True)}" -> "{short(sample["completion"], False)}"'
    )


def _read_jsonl(uri: str) -> list[dict]:
    if not storage.exists(uri):
        return []
    return [json.loads(line) for line in storage.read_text(uri).splitlines() if line.strip()]


def read_metrics(run_uri: str, kind: str | None = "train") -> list[dict]:
    """The records of `metrics.jsonl`: by default the training steps only (one per optimizer step, as
    always); `kind="eval"` the held-out evaluations (`"kind": "eval"` records); `kind=None` every record."""
    records = _read_jsonl(storage.join(run_uri, METRICS_FILE))
    if kind is None:
        return records
    return [r for r in records if r.get("kind", "train") == kind]


def read_completions(run_uri: str) -> list[dict]:
    """The records of `completions.jsonl` (`CompletionsLog`): none for a run that samples nothing."""
    return _read_jsonl(storage.join(run_uri, COMPLETIONS_FILE))


def eval_record(
    step: int,
    *,
    loss_sum: float,
    tokens: int,
    sequences: int,
    batches: int,
    val_ids,
    seconds: float,
    attention_mask: str = "causal",
    pairs: bool = False,
) -> dict:
    """A held-out evaluation as a `metrics.jsonl` record. `"kind": "eval"` and `val_*` names keep it apart
    from the training steps (`read_metrics` returns those alone unless asked); `step` is the optimizer step
    it evaluated, so a resume drops it with the steps after its checkpoint. `attention_mask`: how its packed
    rows were attended ("causal" or "document", `TrainJobSpec.attention_mask` resolved for the dataset). `pairs`
    (a reward model's evaluation): `loss_sum` is its preference pairs' Bradley-Terry loss and `tokens` their count;
    there is no perplexity (None)."""
    import math

    loss = loss_sum / max(tokens, 1)
    return {
        "kind": "eval",
        "step": step,
        "val_loss": loss,
        "val_perplexity": None if pairs else math.exp(loss) if loss < 700 else float("inf"),
        "val_tokens": int(tokens),
        "val_sequences": int(sequences),
        "val_batches": int(batches),
        "val_ids": [int(val_ids[0]), int(val_ids[1])],
        "eval_time_s": seconds,
        "attention_mask": attention_mask,
    }


def eval_line(record: dict) -> str:
    """One readable line for an evaluation record (job logs, the final summary)."""
    if record["val_perplexity"] is None:  # a reward model's: its pairs' loss
        return (
            f"evaluation at step {record['step']}: validation loss {record['val_loss']:.4f} (Bradley-Terry) over "
            f"{record['val_tokens']:,} preference pairs ({record['val_sequences']:,} rows)"
        )
    line = (
        f"evaluation at step {record['step']}: validation loss {record['val_loss']:.4f}, perplexity "
        f"{record['val_perplexity']:.3f} over {record['val_tokens']:,} tokens ({record['val_sequences']:,} sequences)"
    )
    if record.get("val_grpo_reward") is not None:  # objective grpo: its held-out prompts' greedy completions, scored
        n = record["val_grpo_completions"]
        line += f"; mean reward {record['val_grpo_reward']:.4f} over {n:,} greedy completions"
    return line


def loss_figure(records: list[dict], *, title: str, evals: list[dict] | None = None):
    """The loss curve as a matplotlib Figure (what `Run.plot()` returns; Jupyter draws it inline); with
    `evals` (`read_metrics(run, kind="eval")`), the validation loss as points on a line beside it. Objective grpo's:
    the mean reward, and the held-out prompts' greedy completions' beside it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    records = [r for r in records if r.get("kind", "train") == "train"]
    # objective grpo: its loss is near 0 by construction (advantages centred per group); its reward is the curve
    reward = bool(records) and "grpo_reward" in records[0]
    key, val_key = ("grpo_reward", "val_grpo_reward") if reward else ("loss", "val_loss")
    ax.plot([r["step"] for r in records], [r[key] for r in records], lw=1.5, label="training")
    evals = [r for r in evals or [] if r.get(val_key) is not None]
    if evals:
        label = "validation (greedy)" if reward else "validation"
        ax.plot([r["step"] for r in evals], [r[val_key] for r in evals], "o-", lw=1.2, ms=4, label=label)
        ax.legend()
    if reward:
        ax.set(xlabel="step", ylabel="mean reward of the sampled completions", title=f"{title}: reward")
    else:
        ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{title}: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    # pyplot forgets the figure: a notebook then shows it once (as the returned value, not again at the
    # cell's end), and a loop of plots holds no memory. The figure itself stays drawable and savable.
    plt.close(fig)
    return fig


def plot_loss(records: list[dict], out_uri: str, *, title: str, evals: list[dict] | None = None) -> None:
    """A loss-curve PNG (people would rather look than read), with the validation loss when given."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # a job has no display
    buf = io.BytesIO()
    loss_figure(records, title=title, evals=evals).savefig(buf, format="png")
    storage.atomic_write(out_uri, buf.getvalue())
