"""docs/specs.md is generated from the spec models: it must match what `python -m pylon.cli.reference` prints,
and it must cover every field of every kind."""

from __future__ import annotations

from pathlib import Path

from pylon.cli import reference
from pylon.specs import SPEC_KINDS

DOC = Path(__file__).resolve().parents[3] / "docs" / "specs.md"


def test_committed_reference_matches_the_models() -> None:
    assert DOC.read_text() == reference.render(), (
        "docs/specs.md is stale: regenerate it with `.venv/bin/python -m pylon.cli.reference > docs/specs.md`"
    )


def test_every_field_of_every_kind_is_listed() -> None:
    text = reference.render()
    for kind, cls in SPEC_KINDS.items():
        assert f"## {kind}" in text
        for name in cls.model_fields:
            assert f"| `{name}` |" in text.split(f"## {kind}")[1].split("\n## ")[0], (kind, name)
    assert "| `deepspeed.aio.queue_depth` | int | `8` | >=1 |" in text
    assert "| `worker_groups[].max_workers` |" in text
    assert "'none' \\| 'cpu' \\| 'nvme'" in text


CLI_DOC = DOC.with_name("cli.md")


def test_committed_cli_reference_matches_the_parser() -> None:
    assert CLI_DOC.read_text() == reference.render_cli(), (
        "docs/cli.md is stale: regenerate it with `.venv/bin/python -m pylon.cli.reference --cli > docs/cli.md`"
    )


def test_every_command_has_help_and_examples() -> None:
    text = reference.render_cli()
    sections = text.split("\n## `")[1:]
    assert len(sections) >= 15
    for section in sections:
        name = section.split("`", 1)[0]
        assert "usage: " in section, name
        if name.count(" ") >= 1 and name not in ("pylon cluster", "pylon data", "pylon jobs"):
            assert "example" in section, f"`{name} --help` shows no example"


SETTINGS_DOC = DOC.with_name("settings.md")


def test_committed_settings_reference_matches_the_registry() -> None:
    from pylon import settings

    assert SETTINGS_DOC.read_text() == settings.render(), (
        "docs/settings.md is stale: regenerate it with "
        "`.venv/bin/python -m pylon.cli.reference --settings > docs/settings.md`"
    )


def test_pylon_variables_are_read_in_the_settings_module_only() -> None:
    """No module but pylon.settings reads a PYLON_* variable, or any other registered one, from the environment (a
    name in a string is fine: docs and messages name them; reading is `os.environ`/`os.getenv` with the literal)."""
    import re

    from pylon import settings

    repo = DOC.parents[1]
    names = "|".join(["PYLON_", *(re.escape(n) + r"\b" for n in settings.SETTINGS)])
    reads = re.compile(r"""(os\.environ(\.get)?\s*[\[(]\s*|os\.getenv\(\s*)["'](""" + names + ")")
    offenders = []
    for folder in ("platform/pylon", "data", "jobs", "serving"):
        for path in (repo / folder).rglob("*.py"):
            text = path.read_text()
            for found in reads.finditer(text) if path.name != "settings.py" else ():
                rest = text[found.end() :].split("\n", 1)[0]
                if not re.match(r"""[A-Z0-9_]*["']\]\s*=[^=]""", rest):  # setting one for a child process is fine
                    offenders.append(f"{path.relative_to(repo)}: {text[found.start() :].split(chr(10), 1)[0]}")
    assert offenders == []
