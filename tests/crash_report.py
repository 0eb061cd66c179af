"""What `make test` prints when the integration run ended without pytest's own summary: the process was killed or
aborted (a check failing inside Ray's core worker aborts a driver; the OOM killer; a segfault), so the usual
report never came. CI shows the end of the output only, so this goes there: the end of the run's log, and the
fatal lines from the Ray logs of every cluster the tests recorded (their temp dirs outlive an aborted run).

    python tests/crash_report.py LOG EXIT_CODE STARTED_AT   (STARTED_AT: the run's start, in seconds since the epoch)
"""

from __future__ import annotations

import getpass
import glob
import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

FATAL = re.compile(r"Check failed|\] F |\bFATAL\b|Fatal Python error|Segmentation fault|Killed|out of memory")


def _short(line: str) -> str:
    """Ray's check failures put a paragraph of apology between the time stamp and what failed."""
    line = line.rstrip()
    at = line.find("Check failed")
    return (line[:40] + " ... " + line[at:] if at > 40 else line)[:600]


def main(log: str, code: int, since: float, base: str | None = None) -> int:
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    if re.search(r"^=+ .*\b(passed|failed|error|errors)\b.* in [\d.]+s", text, re.M):
        return 0  # pytest reported; its summary says what failed
    how = f"signal {signal.Signals(code - 128).name}" if 128 < code < 160 else f"exit {code}"
    print(f"=== the integration run ended without pytest's summary ({how}): it was killed or aborted ===")
    print("--- the end of its log ---")
    print("\n".join(text.splitlines()[-40:]))
    # pytest's temp dirs of this user (the unit run's too: pytest-current may be either), clusters of this run.
    base = base or os.path.join(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}")
    seen = set()
    for state in sorted(glob.glob(os.path.join(base, "pytest-*", "**", "cluster.json"), recursive=True)):
        try:
            temp_dir = os.path.realpath(json.loads(Path(state).read_text())["temp_dir"])
        except (OSError, ValueError, KeyError):
            continue
        if temp_dir in seen:
            continue
        seen.add(temp_dir)
        for path in sorted(glob.glob(os.path.join(temp_dir, "session_latest", "logs", "*"))):
            if not os.path.isfile(path) or os.path.getmtime(path) < since:
                continue
            lines = [_short(line) for line in open(path, errors="replace") if FATAL.search(line)]
            if lines:
                print(f"--- {path} ---")
                print("\n".join(lines[-5:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
