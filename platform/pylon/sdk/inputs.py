"""What the SDK and the CLI accept as a spec (an object, a dict of its fields, a YAML file), turned into a spec or a
clear error before anything is submitted; job ids; the `pylon data prepare` entrypoint; API keys from the
environment."""

from __future__ import annotations

import os
import re
import shlex
import uuid
from pathlib import Path
from typing import Any

from pylon.errors import PylonError, SpecError
from pylon.specs import DatasetSpec, load_spec, spec_errors


def new_job_id(prefix: str, name: str) -> str:
    """A submission id people can read: `train-<name>-<6 hex>`."""
    return f"{prefix}-{name}-{uuid.uuid4().hex[:6]}"


def as_spec(spec: Any, cls: type) -> tuple[Any, Path | None]:
    """(validated spec, the YAML file it came from or None) for a spec object, a dict of its fields or a path.
    Objects are validated again: `model_copy(update=...)` skips validation, a submitted spec must not."""
    from pydantic import ValidationError

    kind = cls.model_fields["kind"].default
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec, cls), Path(spec)
    if isinstance(spec, cls):
        data = spec.model_dump(mode="json")
    elif isinstance(spec, dict):
        data = {"kind": kind, **spec}
    else:
        raise TypeError(
            f"expected a {cls.__name__}, a dict of its fields or a YAML file path (got {type(spec).__name__})"
        )
    try:
        return cls.model_validate(data), None
    except ValidationError as e:
        name = data.get("name")
        label = f"{kind} '{name}'" if isinstance(name, str) else f"{kind} spec"
        raise SpecError([f"{label}: {problem}" for problem in spec_errors(cls, e)]) from None


def dataset_spec(spec: Any, fields: dict) -> DatasetSpec:
    """`client.prepare_data`'s argument as a DatasetSpec; keyword fields get a name from the output path."""
    if spec is not None and fields:
        raise TypeError("prepare_data: give a spec (object, dict or YAML file) or keyword fields, not both")
    if spec is None:
        fields = dict(fields)
        if isinstance(fields.get("sources"), (str, os.PathLike)):
            fields["sources"] = [fields["sources"]]
        fields["sources"] = [str(s) for s in fields.get("sources") or []]
        if "output" in fields:
            fields["output"] = str(fields["output"])
            if "name" not in fields:
                base = fields["output"].rstrip("/").rsplit("/", 1)[-1].lower()
                fields["name"] = re.sub(r"[^a-z0-9]+", "-", base).strip("-")[:63].strip("-") or "dataset"
        spec = fields
    return as_spec(spec, DatasetSpec)[0]


def prepare_entrypoint(spec: DatasetSpec, *, overwrite: bool) -> str:
    """The `pylon data prepare` command line for a Dataset spec, run in the job's working directory (relative
    paths name the files shipped with it, `pylon.sdk.ship`)."""
    args = [
        "pylon",
        "data",
        "prepare",
        *spec.sources,
        "--out",
        spec.output,
        "--format",
        spec.format,
        "--seq-len",
        str(spec.seq_len),
        "--tokenizer",
        spec.tokenizer,
        "--shard-size-mb",
        str(spec.shard_size_mb),
    ]
    if spec.include:
        args += ["--include", spec.include]
    for pattern in spec.exclude:
        args += ["--exclude", pattern]
    if spec.chat:
        args.append("--chat")
    if spec.prompt_completion:
        args.append("--prompt-completion")
    if spec.preference:
        args.append("--preference")
    if spec.packing != "auto":
        args += ["--packing", spec.packing]
    if overwrite:
        args.append("--overwrite")
    return " ".join(shlex.quote(a) for a in args)


def first_api_key(env_name: str, *, required: bool = True) -> str | None:
    """The first of the comma-separated keys in environment variable `env_name`."""
    keys = [k.strip() for k in os.environ.get(env_name, "").split(",") if k.strip()]
    if keys:
        return keys[0]
    if required:
        raise PylonError(
            f"http.api_keys_env: environment variable {env_name} is empty or unset; set it to "
            f"comma-separated API keys, or set http.api_keys_env: null to serve without auth"
        )
    return None
