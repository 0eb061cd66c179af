"""`pylon demo`: the end-to-end path that exists today, for real, on the embedded local cluster.

1. start (or reuse) the local Ray head, token auth on;
2. validate the bundled example specs;
3. submit `pylon data prepare` as a Ray job through the Jobs API: the standard library's own `.py` files
   are tokenized in parallel Ray tasks into parquet shards plus a manifest on local object storage;
4. stream the shards back the way a training worker reads them (Ray Data, checksums, shuffling) and print
   throughput, and a sample decoded back to text;
5. train the example TrainJob on them as a Ray job (2 Ray Train workers, DeepSpeed ZeRO-2, optimizer
   offloaded to CPU, checkpoints), export it, and print the loss curve's ends, tokens/s, the share of step
   time spent waiting for data, and where the plot, run and export are.
Serving joins this path as it lands.
"""
from __future__ import annotations

import shlex
import sys
import sysconfig
import time
from importlib import resources

from pylon import cluster, storage
from pylon.client import connect
from pylon.specs import TrainJobSpec, load_specs, to_yaml


def _train(client, corpus: str, steps: int) -> bool:
    """Train the bundled example TrainJob on the prepared corpus as a Ray job; print what it learned."""
    import statistics

    from pylon.jobs.train import read_metrics, run_uri_of

    examples = resources.files("pylon") / "examples" / "stdlib-gpt.yaml"
    with resources.as_file(examples) as path:
        spec = next(d.spec for d in load_specs(path) if isinstance(d.spec, TrainJobSpec))
    home = cluster.pylon_home()
    every = max(1, steps // 4)
    spec = spec.model_copy(update={
        "steps": steps,
        "data": spec.data.model_copy(update={"uri": corpus}),
        "optim": spec.optim.model_copy(update={"warmup_steps": min(spec.optim.warmup_steps, steps // 10)}),
        "checkpoint": spec.checkpoint.model_copy(update={"storage": str(home / "demo" / "runs"),
                                                         "every_steps": every}),
    })
    spec = TrainJobSpec.model_validate(spec.model_dump())  # the same rules as a file would get
    run_uri = run_uri_of(spec)
    if storage.exists(run_uri):  # a demo run starts afresh (a user's re-submitted run would resume)
        storage.remove(run_uri, recursive=True)
    spec_path = home / "demo" / "train.yaml"
    spec_path.write_text(to_yaml(spec))
    entrypoint = f"python -m pylon.jobs.train --config {shlex.quote(str(spec_path))}"
    job_id = client.submit_job(entrypoint)
    print(f"[5/{STEPS}] submitted Ray job {job_id}: {entrypoint}\n      {spec.summary()}")
    status = client.wait_job(job_id, timeout_s=1800)
    if status != "SUCCEEDED":
        print("\n".join(client.job_logs(job_id).strip().splitlines()[-40:]), file=sys.stderr)
        print(f"error: training job {job_id} ended {status}", file=sys.stderr)
        return False
    records = read_metrics(run_uri)
    first, last = records[0], records[-1]
    steady = records[1:] or records
    wait = statistics.mean(r["data_wait_fraction"] for r in steady)
    print(f"      loss {first['loss']:.3f} at step 1 -> {last['loss']:.3f} at step {last['step']}; "
          f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s; "
          f"MFU {statistics.median(r['mfu'] for r in steady):.1%}")
    print(f"      waiting for data: {wait:.2%} of step time (steps 2-{last['step']}); step 1 includes the "
          f"pipeline start-up ({first['data_wait_fraction'] * first['step_time_s']:.1f}s)")
    print(f"      loss curve: {storage.join(run_uri, 'loss.png')}\n      run: {run_uri}\n"
          f"      export (Hugging Face): {storage.join(run_uri, 'export')}")
    return True


STEPS = 5


def run_demo(*, keep_cluster: bool = False, steps: int = 200) -> int:
    t0 = time.perf_counter()
    info, started = cluster.up()
    print(f"[1/{STEPS}] local Ray cluster {'started' if started else 'reused'}: dashboard {info.dashboard_url}")
    try:
        examples = resources.files("pylon") / "examples"
        for item in sorted(examples.iterdir(), key=lambda p: p.name):
            if item.name.endswith(".yaml"):
                with resources.as_file(item) as path:
                    for doc in load_specs(path):
                        print(f"[2/{STEPS}] valid: {doc.spec.summary()}")

        client = connect(info.dashboard_url)
        stdlib = sysconfig.get_paths()["stdlib"]
        corpus = storage.join(str(cluster.pylon_home()), "demo", "corpus")
        entrypoint = " ".join(shlex.quote(a) for a in [
            "pylon", "data", "prepare", stdlib, "--include", "*.py", "--exclude", "site-packages",
            "--exclude", "dist-packages", "--out", corpus, "--seq-len", "256", "--overwrite"])
        job_id = client.submit_job(entrypoint)
        print(f"[3/{STEPS}] submitted Ray job {job_id}: {entrypoint}")
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
        print(f"[4/{STEPS}] streamed {stats['rows']:,} sequences ({stats['tokens']:,} tokens, "
              f"{stats['bytes_read'] / 2**20:.1f} MiB) through Ray Data: {stats['tokens_per_s'] / 1e6:.1f} M tokens/s, "
              f"{stats['rows_per_s']:,.0f} rows/s; {stream.manifest.summary()}")
        if last is not None:
            text = load_tokenizer("byte").decode(last.tokens[0, : last.num_tokens[0]].tolist())
            print(f"      sample {int(last.sample_ids[0])}, decoded:\n" +
                  "\n".join("        | " + line for line in text.splitlines()[:8]))
        if steps > 0 and not _train(client, corpus, steps):
            return 1
        print(f"demo finished in {time.perf_counter() - t0:.0f}s")
        return 0
    finally:
        if started and not keep_cluster:
            cluster.down()
            print("stopped the demo's local cluster (use --keep-cluster to leave it up)")
        else:
            print(f"cluster still running: {info.dashboard_url} (stop it with `pylon cluster down`)")
