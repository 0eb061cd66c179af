"""How Pylon's objects show themselves in Jupyter: one small HTML table (`_repr_html_`), values escaped."""

from __future__ import annotations

import html
import json
from typing import Any

_TABLE = "border-collapse:collapse;font-size:90%"
_CELL = "text-align:left;vertical-align:top;padding:2px 8px"


def html_table(title: str | None, rows: list[tuple[str, Any]]) -> str:
    """`rows` of (label, value); a value that is already HTML must be wrapped in `Html`, anything else is
    shown as text (JSON for lists and dicts) and escaped."""
    body = "".join(
        f"<tr><th style='{_CELL}'>{html.escape(label)}</th><td style='{_CELL}'>{_cell(value)}</td></tr>"
        for label, value in rows
    )
    caption = f"<caption style='text-align:left;font-weight:bold'>{html.escape(title)}</caption>" if title else ""
    return f"<table style='{_TABLE}'>{caption}{body}</table>"


class Html(str):
    """Markup to put in a cell as is (a nested table)."""


def _cell(value: Any) -> str:
    if isinstance(value, Html):
        return value
    if value is None:
        return "<i>none</i>"
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, default=str)
    return html.escape(str(value))
