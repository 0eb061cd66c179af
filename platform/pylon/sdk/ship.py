"""What travels with a job from the client to the cluster: the spec as content, and the local files it names.

A job runs on the cluster, not where it was submitted, and the two need not share a disk. So every job the SDK or
the CLI submits carries its spec in a Ray `runtime_env` working directory (uploaded through the dashboard, with
the token), never as a path on the client. The local paths a spec names are handled by their role:

- inputs (a training job's `data.uri`, `model.path` and objective grpo's reward models, a dataset's `sources` and
  `tokenizer`, a deployment's `model`): on a cluster that shares this machine's disk (the one `pylon cluster up`
  started here) they are made absolute and read in place. On any other cluster they are copied into the working
  directory (up to `PYLON_SHIP_LIMIT_MB`, with a progress bar) and the spec names the copies, relative to it: Ray
  unpacks the working directory on every node a job's workers and tasks run on, so every node reads them. Larger
  ones are refused before anything is submitted, naming the field.
- code: objective grpo's reward functions named `module:function` whose module (a `.py` file, or a package's
  directory) sits in the directory the job is submitted from are copied to the working directory's top, which Ray
  puts on every worker's import path; others must be installed on the cluster.
- outputs (`checkpoint.storage`, a dataset's `output`): a directory on this machine cannot be written by a
  cluster elsewhere, so those are refused, naming the field, on any cluster but a local one.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pylon import home, settings
from pylon.errors import SpecError
from pylon.specs import BatchJobSpec, DatasetSpec, DeploymentSpec, TrainJobSpec, to_yaml

SPEC_FILE = "spec.yaml"
INPUTS_DIR = "inputs"
BYTE_TOKENIZERS = ("byte",)  # tokenizer values that name no file


@dataclass
class LocalPath:
    field: str  # the field path, as errors name it: data.uri, sources[0]
    value: str
    output: bool  # written by the job (refused when remote) or read by it (shipped when remote)


@dataclass
class Package:
    """A spec ready to submit: `spec` names paths the job can read on the cluster; `runtime_env` carries it."""

    spec: Any
    working_dir: Path
    shipped_bytes: int

    @property
    def runtime_env(self) -> dict:
        return {"working_dir": str(self.working_dir)}

    def cleanup(self) -> None:
        shutil.rmtree(self.working_dir, ignore_errors=True)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _plain(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def local_paths(spec: Any) -> list[LocalPath]:
    """Every local path `spec` names, with its field path and role."""
    found: list[LocalPath] = []
    if isinstance(spec, TrainJobSpec):
        found.append(LocalPath("data.uri", spec.data.uri, False))
        if spec.model.path is not None:
            found.append(LocalPath("model.path", spec.model.path, False))
        if spec.checkpoint.storage is not None:
            found.append(LocalPath("checkpoint.storage", spec.checkpoint.storage, True))
        for i, reward in enumerate(spec.grpo.rewards if spec.grpo is not None else []):
            if reward.model is not None:
                found.append(LocalPath(f"grpo.rewards[{i}].model", reward.model, False))
    elif isinstance(spec, DatasetSpec):
        found += [LocalPath(f"sources[{i}]", s, False) for i, s in enumerate(spec.sources)]
        if spec.tokenizer not in BYTE_TOKENIZERS:
            found.append(LocalPath("tokenizer", spec.tokenizer, False))
        found.append(LocalPath("output", spec.output, True))
    elif isinstance(spec, DeploymentSpec):
        found.append(LocalPath("model", spec.model, False))
    elif isinstance(spec, BatchJobSpec):
        found += [LocalPath("model", spec.model, False), LocalPath("input", spec.input, False)]
        found.append(LocalPath("output", spec.output, True))
    return [p for p in found if is_local(p.value)]


def _label(spec: Any) -> str:
    return f"{spec.kind} '{spec.name}'"


def _set(spec: Any, field: str, value: str) -> Any:
    """`spec` with the field at `field` (dotted, or `sources[i]`) set to `value`."""
    if field.startswith("sources["):
        sources = list(spec.sources)
        sources[int(field[len("sources[") : -1])] = value
        return spec.model_copy(update={"sources": sources})
    if field.startswith("grpo.rewards["):  # an objective grpo reward model's directory
        i = int(field[len("grpo.rewards[") : field.index("]")])
        rewards = list(spec.grpo.rewards)
        rewards[i] = rewards[i].model_copy(update={"model": value})
        return spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"rewards": rewards})})
    head, _, rest = field.partition(".")
    if not rest:
        return spec.model_copy(update={head: value})
    return spec.model_copy(update={head: getattr(spec, head).model_copy(update={rest: value})})


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ship_limit_bytes() -> int:
    raw = settings.value(settings.SHIP_LIMIT_MB) or settings.SETTINGS[settings.SHIP_LIMIT_MB].default
    try:
        return int(float(raw) * 2**20)
    except ValueError:
        raise SpecError([f"{settings.SHIP_LIMIT_MB}={raw!r}: not a number of MiB"]) from None


def package(spec: Any, where: home.ClusterAddress, *, default_runs: bool = False, progress: bool = True) -> Package:
    """`spec` and the local files it reads, in a fresh working directory for a job on the cluster at `where`.

    `default_runs`: the spec leaves `checkpoint.storage` unset, so the job would write under the cluster's
    `$PYLON_HOME/runs`: fine where the cluster is this machine, refused elsewhere (the client could not read
    the run). Every problem is a SpecError naming the field, raised before anything is written."""
    problems, inputs = [], []
    label = _label(spec)
    for p in local_paths(spec):
        path = Path(_plain(p.value)).expanduser()
        if where.shares_disk:
            spec = _set(spec, p.field, str(path.resolve()))
            continue
        if p.output:
            problems.append(
                f"{label}: {p.field}: {p.value} is a path on this machine, and the cluster at {where.dashboard_url} "
                "shares no disk with it, so the job could not write there (nor could you read it back); use "
                "object storage every node can reach, e.g. s3://BUCKET/..."
            )
        elif not path.exists():
            problems.append(f"{label}: {p.field}: {p.value} does not exist on this machine")
        else:
            inputs.append((p, path))
    if default_runs and not where.shares_disk:
        problems.append(
            f"{label}: checkpoint.storage: not set, so the run would go to a directory on the cluster's head "
            f"({where.dashboard_url}), which this machine cannot read; set it to object storage, e.g. "
            "s3://BUCKET/runs"
        )
    sizes = [_size(path) for _, path in inputs]
    limit = ship_limit_bytes()
    if sum(sizes) > limit:
        named = ", ".join(f"{p.field} ({n / 2**20:.1f} MiB)" for (p, _), n in zip(inputs, sizes))
        problems.append(
            f"{label}: {named}: {sum(sizes) / 2**20:.1f} MiB of local files is more than a job carries to a cluster "
            f"that shares no disk with this machine ({settings.SHIP_LIMIT_MB}={limit / 2**20:.0f} MiB); copy them to "
            "object storage (e.g. `pylon data prepare SRC --out s3://BUCKET/corpus`) and name that URI instead"
        )
    if problems:
        raise SpecError(problems)

    workdir = Path(tempfile.mkdtemp(prefix="pylon-job-"))
    try:
        if inputs:
            _copy_inputs(inputs, sizes, workdir, progress=progress)
        for i, (p, path) in enumerate(inputs):
            spec = _set(spec, p.field, f"{INPUTS_DIR}/{i}-{path.name}")
        _copy_reward_modules(spec, workdir)
        (workdir / SPEC_FILE).write_text(to_yaml(spec))
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Package(spec=spec, working_dir=workdir, shipped_bytes=sum(sizes))


def _copy_inputs(inputs: list, sizes: list[int], workdir: Path, *, progress: bool) -> None:
    from tqdm import tqdm

    with tqdm(
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        desc="shipping local inputs with the job",
        file=sys.stderr,
        disable=None if progress else True,
    ) as bar:
        for i, (_, path) in enumerate(inputs):
            dest = workdir / INPUTS_DIR / f"{i}-{path.name}"
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for src in files:
                target = dest if src == path else dest / src.relative_to(path)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, target)
                bar.update(os.path.getsize(src))


def reward_module_paths(spec: Any, base: Path | None = None) -> list[Path]:
    """The files or package directories under `base` (the current directory) that hold the modules of `spec`'s
    `module:function` reward functions (objective grpo; online_dpo's judge), top-level name first: what `package`
    copies."""
    if not isinstance(spec, TrainJobSpec) or spec.grpo is None:
        return []
    base = Path.cwd() if base is None else base
    found = []
    functions = [reward.function for reward in spec.grpo.rewards] + [spec.grpo.judge]  # (and online_dpo's judge)
    for function in functions:
        if function is None or ":" not in function:
            continue  # a reward model, or a built-in
        top = function.split(":", 1)[0].split(".", 1)[0]
        for candidate in (base / top, base / f"{top}.py"):
            if (candidate.is_dir() and (candidate / "__init__.py").is_file()) or candidate.is_file():
                if candidate not in found:
                    found.append(candidate)
                break
    return found


def _copy_reward_modules(spec: Any, workdir: Path) -> None:
    for path in reward_module_paths(spec):
        if path.is_file():
            shutil.copyfile(path, workdir / path.name)
        else:
            shutil.copytree(path, workdir / path.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
