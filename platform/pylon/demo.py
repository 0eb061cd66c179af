"""`pylon demo`: the end-to-end path that exists today, for real, on the embedded local cluster.

1. start (or reuse) the local Ray head, token auth on;
2. validate the bundled example specs;
3. submit `pylon data prepare` as a Ray job through the Jobs API: the standard library's own `.py` files
   are tokenized in parallel Ray tasks into parquet shards plus a manifest on local object storage;
4. stream the shards back the way a training worker reads them (Ray Data, checksums, shuffling) and print
   throughput, and a sample decoded back to text.
Training, export and serving join this path as they land.
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
        corpus = storage.join(str(cluster.pylon_home()), "demo", "corpus")
        entrypoint = " ".join(shlex.quote(a) for a in [
            "pylon", "data", "prepare", stdlib, "--include", "*.py", "--exclude", "site-packages",
            "--exclude", "dist-packages", "--out", corpus, "--seq-len", "256", "--overwrite"])
        job_id = client.submit_job(entrypoint)
        print(f"[3/4] submitted Ray job {job_id}: {entrypoint}")
        status = client.wait_job(job_id, timeout_s=600)
        logs = client.job_logs(job_id).strip().splitlines()
        if status != "SUCCEEDED":
            print("\n".join(logs[-30:]), file=sys.stderr)
            print(f"error: job {job_id} ended {status}; see its logs in the dashboard", file=sys.stderr)
            return 1
        for line in logs[-6:]:
            print(f"      {line}")

        from pylon.data.reader import ShardStream
        from pylon.data.tokenizer import load_tokenizer

        client.init_ray()
        stream = ShardStream(corpus, batch_size=64, seed=0)
        last = None
        for batch in stream.epoch():
            last = batch if len(batch) else last
        stats = stream.stats.as_dict()
        print(f"[4/4] streamed {stats['rows']:,} sequences ({stats['tokens']:,} tokens, "
              f"{stats['bytes_read'] / 2**20:.1f} MiB) through Ray Data: {stats['tokens_per_s'] / 1e6:.1f} M tokens/s, "
              f"{stats['rows_per_s']:,.0f} rows/s; {stream.manifest.summary()}")
        if last is not None:
            text = load_tokenizer("byte").decode(last.tokens[0, : last.num_tokens[0]].tolist())
            print(f"      sample {int(last.sample_ids[0])}, decoded:\n" +
                  "\n".join("        | " + line for line in text.splitlines()[:8]))
        print(f"demo finished in {time.perf_counter() - t0:.0f}s")
        return 0
    finally:
        if started and not keep_cluster:
            cluster.down()
            print("stopped the demo's local cluster (use --keep-cluster to leave it up)")
        else:
            print(f"cluster still running: {info.dashboard_url} (stop it with `pylon cluster down`)")
