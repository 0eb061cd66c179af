"""Number formatting shared by the planner's tables: GiB, counts, dollars, durations."""

from __future__ import annotations

from pylon.plan.memory import GIB


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  " + "  ".join(f"{str(c):<{wd}}" for c, wd in zip(r, widths)) + "  " + str(r[-1]) for r in rows]
    return [line.rstrip() for line in lines]


def _gib(b: float) -> str:
    return f"{b / GIB:,.1f} GiB" if b >= GIB / 10 or b == 0 else f"{b / 2**20:,.1f} MiB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.1f} d"
