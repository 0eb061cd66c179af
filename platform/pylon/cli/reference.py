"""The spec reference, generated from the pydantic models in `pylon.specs`, so it cannot drift from them.

    python -m pylon.cli.reference > docs/specs.md      # what `tests/unit/cli/test_reference.py` compares against
    python -m pylon.cli.reference --cli > docs/cli.md  # every `pylon` command's --help, the same way
    python -m pylon.cli.reference --settings > docs/settings.md  # every environment variable Pylon reads

One table per kind (Dataset, TrainJob, Deployment, BatchJob, Cluster): every field by its dotted path, its type with
allowed values, its default and constraints, and its description. Cross-field rules live in validators; the
kind's docstring and the README list them.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pylon import settings
from pylon.specs import SPEC_KINDS

HEADER = """# Spec reference

Generated from `platform/pylon/specs.py` by `python -m pylon.cli.reference > docs/specs.md`; a test fails when
the two differ. Every spec is YAML with a `kind`; unknown keys are errors, and `pylon validate FILE` names
the file, line, document and field path of every problem.
"""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        text = " \\| ".join(names)
        return f"{text} \\| null" if type(None) in args else text
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]" if args else "map"
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return "object"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The spec class inside `tp` (plain, Optional, or list of), if any."""
    if inspect.isclass(tp) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _constraints(field: FieldInfo) -> str:
    out = []
    for item in field.metadata:
        for name, sign in (
            ("gt", ">"),
            ("ge", ">="),
            ("lt", "<"),
            ("le", "<="),
            ("min_length", "min length "),
            ("max_length", "max length "),
            ("pattern", "matches "),
        ):
            value = getattr(item, name, None)
            if value is not None:
                out.append(f"{sign}{'`' + value + '`' if name == 'pattern' else value}")
    return ", ".join(out)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(the fields below)"
        return f"`{value!r}`"
    if field.default is PydanticUndefined:
        return ""
    return f"`{field.default!r}`" if field.default is not None else "`null`"


def _own_doc(cls: type) -> str:
    """The class's own docstring (not one inherited from pydantic's BaseModel)."""
    return inspect.cleandoc(cls.__dict__.get("__doc__") or "")


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _model_of(field.annotation)
        is_list = typing.get_origin(field.annotation) is list or any(
            typing.get_origin(a) is list for a in typing.get_args(field.annotation)
        )
        description = (field.description or "").replace("|", "\\|")
        if nested is not None and not description:
            description = _own_doc(nested).split("\n")[0].replace("|", "\\|")
        rows.append(
            (
                path,
                _type_name(field.annotation) if nested is None else ("list of objects" if is_list else "object"),
                _default(field),
                _constraints(field),
                description,
            )
        )
        if nested is not None:
            rows.extend(_rows(nested, f"{path}[]." if is_list else f"{path}."))
    return rows


def render() -> str:
    parts = [HEADER]
    for kind, cls in SPEC_KINDS.items():
        doc = _own_doc(cls)
        parts.append(
            f"\n## {kind}\n\n{doc}\n\n| field | type | default | constraints | description |\n|---|---|---|---|---|"
        )
        for row in _rows(cls):
            parts.append("| " + " | ".join(f"`{row[0]}`" if i == 0 else row[i] for i in range(5)) + " |")
    return "\n".join(parts) + "\n"


CLI_HEADER = """# `pylon` command reference

Generated from the CLI's own parser by `python -m pylon.cli.reference --cli > docs/cli.md`; a test fails when
the two differ, so this is exactly what `pylon COMMAND --help` prints. Exit codes: 0 success, 1 a failure the
message explains (bad spec, failed job, unreachable cluster), 2 a command-line usage error.
"""


def _subcommands(parser) -> list:
    import argparse

    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((name, sub))
    return found


def render_cli() -> str:
    """Every command's help, depth first, at a fixed width (argparse wraps to the terminal otherwise)."""
    import os

    from pylon.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"
    try:
        parts = [CLI_HEADER]

        def walk(parser, path: str) -> None:
            parts.append(f"\n## `{path}`\n\n```text\n{parser.format_help().rstrip()}\n```")
            for name, sub in _subcommands(parser):
                walk(sub, f"{path} {name}")

        walk(build_parser(), "pylon")
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    if "--settings" in sys.argv[1:]:
        sys.stdout.write(settings.render())
    else:
        sys.stdout.write(render_cli() if "--cli" in sys.argv[1:] else render())
