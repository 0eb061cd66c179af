"""A Ray job that surveys a source tree in parallel and commits its findings to object storage.

    python -m pylon.jobs.corpus_stats --src /usr/lib/python3.11 --out s3://bucket/demo/stats.json

Run with `ray job submit` (or `pylon demo`). Files are split into chunks, each chunk is read by a Ray
task on whichever node has a free CPU, and the driver writes one JSON document atomically.
"""

from __future__ import annotations

import argparse
import collections
import io
import keyword
import sys
import time
import tokenize
from pathlib import Path

import ray

from pylon import storage


@ray.remote(num_cpus=1)
def survey_chunk(paths: list[str]) -> dict:
    """Bytes, lines and Python keyword counts of a chunk of files (unreadable files are counted, not fatal)."""
    import socket

    counts: collections.Counter = collections.Counter()
    totals = {"files": 0, "bytes": 0, "lines": 0, "unreadable": 0}
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError:
            totals["unreadable"] += 1
            continue
        totals["files"] += 1
        totals["bytes"] += len(raw)
        totals["lines"] += raw.count(b"\n")
        try:
            for tok in tokenize.tokenize(io.BytesIO(raw).readline):
                if tok.type == tokenize.NAME and keyword.iskeyword(tok.string):
                    counts[tok.string] += 1
        except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
            totals["unreadable"] += 1
    return {"totals": totals, "keywords": dict(counts), "host": socket.gethostname()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="directory whose *.py files are surveyed")
    parser.add_argument("--out", required=True, help="URI of the JSON result (local path, file://, s3://)")
    parser.add_argument("--chunks", type=int, default=16, help="number of Ray tasks")
    args = parser.parse_args(argv)

    src = Path(args.src)
    # The standard library's directory also holds installed packages; they are not its own source.
    files = sorted(
        str(p)
        for p in src.rglob("*.py")
        if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(src).parts)
    )
    if not files:
        print(f"error: no *.py files under {src}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    ray.init()
    n = max(1, min(args.chunks, len(files)))
    chunks = [files[i::n] for i in range(n)]
    results = ray.get([survey_chunk.remote(c) for c in chunks])
    totals = collections.Counter()
    keywords = collections.Counter()
    for r in results:
        totals.update(r["totals"])
        keywords.update(r["keywords"])
    elapsed = time.perf_counter() - started
    summary = {
        "source": str(src),
        "tasks": n,
        "totals": dict(totals),
        "top_keywords": keywords.most_common(10),
        "seconds": round(elapsed, 3),
        "bytes_per_s": round(totals["bytes"] / elapsed),
    }
    storage.atomic_write_json(args.out, summary)
    print(
        f"surveyed {totals['files']} files, {totals['bytes']:,} bytes, {totals['lines']:,} lines "
        f"in {n} Ray tasks ({elapsed:.1f}s); wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
