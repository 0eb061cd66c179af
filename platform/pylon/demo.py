"""`pylon demo`: the end-to-end path that exists today, for real, on the embedded local cluster.

1. start (or reuse) the local Ray head, token auth on;
2. validate the bundled example specs;
3. submit a Ray job through the Jobs API that surveys the standard library's sources in parallel
   Ray tasks and commits the result atomically to local object storage;
4. read the result back and print it with the addresses a person needs.
"""
from __future__ import annotations

import shlex
import sys
import sysconfig
import time
from importlib import resources

from pylon import cluster, storage
from pylon.client import connect
from pylon.specs import load_specs


def run_demo(*, keep_cluster: bool = False) -> int:
    t0 = time.perf_counter()
    info, started = cluster.up()
    print(f"[1/4] local Ray cluster {'started' if started else 'reused'}: dashboard {info.dashboard_url}")
    try:
        examples = resources.files("pylon") / "examples"
        for item in sorted(examples.iterdir(), key=lambda p: p.name):
            if item.name.endswith(".yaml"):
                with resources.as_file(item) as path:
                    for doc in load_specs(path):
                        print(f"[2/4] valid: {doc.spec.summary()}")

        client = connect(info.dashboard_url)
        stdlib = sysconfig.get_paths()["stdlib"]
        out = storage.join(str(cluster.pylon_home()), "demo", "corpus-stats.json")
        entrypoint = f"python -m pylon.jobs.corpus_stats --src {shlex.quote(stdlib)} --out {shlex.quote(out)}"
        job_id = client.submit_job(entrypoint)
        print(f"[3/4] submitted Ray job {job_id}: {entrypoint}")
        status = client.wait_job(job_id, timeout_s=600)
        logs = client.job_logs(job_id).strip().splitlines()
        if status != "SUCCEEDED":
            print("\n".join(logs[-30:]), file=sys.stderr)
            print(f"error: job {job_id} ended {status}; full logs: pylon jobs logs / the dashboard", file=sys.stderr)
            return 1
        print(f"      job {job_id} {status}: {logs[-1] if logs else ''}")

        result = storage.read_json(out)
        totals = result["totals"]
        print(f"[4/4] result committed at {out}:")
        print(f"      {totals['files']:,} files, {totals['bytes'] / 2**20:.1f} MiB, {totals['lines']:,} lines "
              f"surveyed by {result['tasks']} Ray tasks at {result['bytes_per_s'] / 2**20:.1f} MiB/s")
        print("      most used keywords: " + ", ".join(f"{k} {v:,}" for k, v in result["top_keywords"][:6]))
        print(f"demo finished in {time.perf_counter() - t0:.0f}s")
        return 0
    finally:
        if started and not keep_cluster:
            cluster.down()
            print("stopped the demo's local cluster (use --keep-cluster to leave it up)")
        else:
            print(f"cluster still running: {info.dashboard_url} (stop it with `pylon cluster down`)")
