"""Offline checks of rendered manifests against the KubeRay CRD schemas shipped in `schemas/kuberay/`."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import yaml

from pylon.infra.common import Files

_CRD_SCHEMAS = {"RayCluster": "raycluster", "RayJob": "rayjob", "RayService": "rayservice"}


@functools.cache
def _validator(name: str):
    import jsonschema

    if name == "ray-up":
        import importlib.util

        # Found without importing ray (seconds): the schema ships in the wheel next to the autoscaler.
        path = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler" / "ray-schema.json"
    else:
        path = Path(__file__).parent / "schemas" / "kuberay" / f"{name}.schema.json"
    schema = json.loads(path.read_text())
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


def validate_manifest(doc: dict) -> list[str]:
    """Schema errors of one rendered document: a launcher config, or a RayCluster / RayJob / RayService."""
    if "cluster_name" in doc:
        validator = _validator("ray-up")
    elif doc.get("kind") in _CRD_SCHEMAS:
        validator = _validator(_CRD_SCHEMAS[doc["kind"]])
    else:
        return []
    problems = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if doc.get("kind") == "RayService" and not problems:
        problems += _serve_config_problems(doc["spec"]["serveConfigV2"])
    return problems


def _serve_config_problems(text: str) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        return [f"spec.serveConfigV2: {err['loc']}: {err['msg']}" for err in e.errors()]
    return []


def validate_files(files: Files) -> list[str]:
    """Every schema problem of every YAML file in a render, as 'file: document N (Kind): path: message'."""
    problems = []
    for name, text in sorted(files.items()):
        if not name.endswith((".yaml", ".yml")) or name.startswith("prometheus"):  # Prometheus' config, rules
            continue
        for index, doc in enumerate(yaml.safe_load_all(text), start=1):
            if not isinstance(doc, dict):
                continue
            label = doc.get("kind") or "ray cluster launcher config"
            problems += [f"{name}: document {index} ({label}): {p}" for p in validate_manifest(doc)]
    return problems
