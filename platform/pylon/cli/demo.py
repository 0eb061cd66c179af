"""`pylon demo`: the end-to-end path that exists today, for real, on the embedded local cluster.

1. start (or reuse) the local Ray head, token auth on;
2. validate the bundled example specs;
3. submit `pylon data tokenizer` + `pylon data prepare` as a Ray job through the Jobs API: a byte-level BPE
   is learned from the standard library's own `.py` files (its test suites left out), which are then
   tokenized with it in parallel Ray tasks into parquet shards plus a manifest on local object storage;
4. stream the shards back the way a training worker reads them (Ray Data, checksums, shuffling) and print
   throughput, and a sample decoded back to text;
5. train the example TrainJob on them as a Ray job (2 Ray Train workers, DeepSpeed ZeRO-2, optimizer
   offloaded to CPU, checkpoints), export it, and print the loss curve's ends, tokens/s, the share of step
   time spent waiting for data, and where the plot, run and export are;
6. deploy the export on Ray Serve (continuous batching, API key on) and stream a completion of
   `def fibonacci(` over HTTP, then send a burst of concurrent requests and print serving throughput.
The cluster and the endpoint stay up afterwards (`pylon cluster down` stops both) unless --down is given.
"""

from __future__ import annotations

import shlex
import sys
import sysconfig
import time
from importlib import resources

from pylon import storage
from pylon.home import pylon_home
from pylon.infra import local as cluster
from pylon.sdk.client import connect
from pylon.sdk.inputs import first_api_key
from pylon.specs import TrainJobSpec, load_specs, to_yaml


def _train(client, corpus: str, steps: int) -> str | None:
    """Train the bundled example TrainJob on the prepared corpus as a Ray job; print what it learned."""
    import statistics

    from pylon.jobs.run_dir import read_metrics, run_uri_of

    examples = resources.files("pylon") / "examples" / "stdlib-gpt.yaml"
    with resources.as_file(examples) as path:
        spec = next(d.spec for d in load_specs(path) if isinstance(d.spec, TrainJobSpec))
    home = pylon_home()
    every = max(1, steps // 4)
    spec = spec.model_copy(
        update={
            "steps": steps,
            "data": spec.data.model_copy(update={"uri": corpus}),
            "optim": spec.optim.model_copy(update={"warmup_steps": min(spec.optim.warmup_steps, steps // 10)}),
            "checkpoint": spec.checkpoint.model_copy(
                update={"storage": str(home / "demo" / "runs"), "every_steps": every}
            ),
        }
    )
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
        return None
    records = read_metrics(run_uri)
    first, last = records[0], records[-1]
    steady = records[1:] or records
    wait = statistics.mean(r["data_wait_fraction"] for r in steady)
    print(
        f"      loss {first['loss']:.3f} at step 1 -> {last['loss']:.3f} at step {last['step']}; "
        f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s; "
        f"MFU {statistics.median(r['mfu'] for r in steady):.1%}"
    )
    print(
        f"      waiting for data: {wait:.2%} of step time (steps 2-{last['step']}); step 1 includes the "
        f"pipeline start-up ({first['data_wait_fraction'] * first['step_time_s']:.1f}s)"
    )
    print(
        f"      loss curve: {storage.join(run_uri, 'loss.png')}\n      run: {run_uri}\n"
        f"      export (Hugging Face): {storage.join(run_uri, 'export')}"
    )
    return storage.join(run_uri, "export")


def _demo_api_key(home) -> tuple[str, str]:
    """The demo endpoint's API key: $PYLON_API_KEYS if set, else one made up once and kept in a 0600 file
    beside Ray's token (printed as a path, never as the key)."""
    import os
    import secrets

    if key := first_api_key("PYLON_API_KEYS", required=False):  # the example spec's http.api_keys_env
        return key, "$PYLON_API_KEYS"
    path = home / "demo" / "api_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("sk-pylon-" + secrets.token_urlsafe(24))
    return path.read_text().strip(), str(path)


def _serve(model_uri: str) -> bool:
    """Deploy the exported model, stream one completion, then a burst of concurrent ones."""
    import concurrent.futures
    import json
    import os

    import requests

    from pylon.sdk.serve import deploy
    from pylon.specs import DeploymentSpec

    examples = resources.files("pylon") / "examples" / "stdlib-gpt.yaml"
    with resources.as_file(examples) as path:
        spec = next(d.spec for d in load_specs(path) if isinstance(d.spec, DeploymentSpec))
    spec = spec.model_copy(update={"model": model_uri})
    key, key_source = _demo_api_key(pylon_home())
    os.environ[spec.http.api_keys_env] = key  # read by deploy(); replicas get only its digest
    t0 = time.perf_counter()
    print(f"[6/{STEPS}] deploying on Ray Serve: {spec.summary()}")
    url = deploy(spec)
    print(f"      ready in {time.perf_counter() - t0:.0f}s at {url}  (API key: {key_source})")
    headers = {"Authorization": f"Bearer {key}"}
    prompt = "def fibonacci("
    body = {
        "model": spec.name,
        "prompt": prompt,
        "max_tokens": 96,
        "temperature": 0.6,
        "top_k": 40,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    print(f"      streamed completion of {prompt!r}:\n        | {prompt}", end="", flush=True)
    t0 = time.perf_counter()
    first, usage = None, {}
    with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=120) as r:
        if r.status_code != 200:
            print(f"\nerror: the endpoint answered {r.status_code}: {r.text}", file=sys.stderr)
            return False
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                first = first or time.perf_counter()
                print(choice["text"].replace("\n", "\n        | "), end="", flush=True)
    elapsed = time.perf_counter() - t0
    print(
        f"\n      {usage.get('completion_tokens', 0)} tokens in {elapsed:.2f}s "
        f"(first token after {((first or t0) - t0) * 1000:.0f} ms)"
    )

    prompts = [
        "import ",
        "class ",
        "def __init__(self",
        "    return ",
        "for i in range(",
        "if __name__",
        "from collections import ",
        "    def ",
    ] * 4

    def complete(p: str) -> int:
        r = requests.post(
            f"{url}/v1/completions",
            headers=headers,
            timeout=300,
            json={"model": spec.name, "prompt": p, "max_tokens": 64, "temperature": 0.8, "top_k": 40, "seed": 1},
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(complete, prompts))
    elapsed = time.perf_counter() - t0
    print(
        f"[7/{STEPS}] burst of {len(prompts)} concurrent requests: {tokens} tokens in {elapsed:.1f}s = "
        f"{tokens / elapsed:,.0f} output tokens/s through Serve + HTTP, batched continuously"
    )
    print(
        f"      endpoint: {url}/v1 (OpenAI-compatible; `Authorization: Bearer <key from {key_source}>`)\n"
        f'      try: curl {url}/v1/completions -H "Authorization: Bearer $(cat {key_source})" '
        f'-H \'Content-Type: application/json\' -d \'{{"model": "{spec.name}", "prompt": "def ", '
        f'"max_tokens": 64}}\''
        if key_source != "$PYLON_API_KEYS"
        else f"      endpoint: {url}/v1 (OpenAI-compatible; `Authorization: Bearer $PYLON_API_KEYS`)"
    )
    return True


STEPS = 7


def run_demo(*, down: bool = False, steps: int = 160) -> int:
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
        corpus = storage.join(str(pylon_home()), "demo", "corpus")
        tokenizer = storage.join(str(pylon_home()), "demo", "tokenizer.json")
        # The library's own code: not its test suites (thousands of self.assertEqual lines would dominate), its
        # codec tables (encodings/, 1.4 MB of "LATIN SMALL LETTER") or pydoc's help text (0.7 MB of prose).
        selection = [
            "--include",
            "*.py",
            *[
                a
                for pattern in (
                    "site-packages",
                    "dist-packages",
                    "test",
                    "tests",
                    "test_*",
                    "idle_test",
                    "encodings",
                    "pydoc_data",
                )
                for a in ("--exclude", pattern)
            ],
        ]
        entrypoint = " && ".join(
            " ".join(shlex.quote(a) for a in command)
            for command in (
                [
                    "pylon",
                    "data",
                    "tokenizer",
                    stdlib,
                    *selection,
                    "--vocab-size",
                    "2048",
                    "--out",
                    tokenizer,
                    "--overwrite",
                ],
                [
                    "pylon",
                    "data",
                    "prepare",
                    stdlib,
                    *selection,
                    "--tokenizer",
                    tokenizer,
                    "--out",
                    corpus,
                    "--seq-len",
                    "256",
                    "--overwrite",
                ],
            )
        )
        job_id = client.submit_job(entrypoint)
        print(f"[3/{STEPS}] submitted Ray job {job_id}: {entrypoint}")
        status = client.wait_job(job_id, timeout_s=600)
        logs = client.job_logs(job_id).strip().splitlines()
        if status != "SUCCEEDED":
            print("\n".join(logs[-30:]), file=sys.stderr)
            print(f"error: job {job_id} ended {status}; see its logs in the dashboard", file=sys.stderr)
            return 1
        for line in [line for line in logs if "trained a BPE tokenizer" in line] + logs[-6:]:
            print(f"      {line}")

        from pylon.data.reader import ShardStream
        from pylon.data.tokenizer import load_tokenizer

        client.init_ray()
        stream = ShardStream(corpus, batch_size=64, seed=0)
        last = None
        for batch in stream.epoch():
            last = batch if len(batch) else last
        stats = stream.stats.as_dict()
        print(
            f"[4/{STEPS}] streamed {stats['rows']:,} sequences ({stats['tokens']:,} tokens, "
            f"{stats['bytes_read'] / 2**20:.1f} MiB) through Ray Data: {stats['tokens_per_s'] / 1e6:.1f} M tokens/s, "
            f"{stats['rows_per_s']:,.0f} rows/s; {stream.manifest.summary()}"
        )
        if last is not None:
            text = load_tokenizer(stream.manifest.tokenizer.uri or "byte").decode(
                last.tokens[0, : last.num_tokens[0]].tolist()
            )
            print(
                f"      sample {int(last.sample_ids[0])}, decoded:\n"
                + "\n".join("        | " + line for line in text.splitlines()[:8])
            )
        if steps > 0:
            export = _train(client, corpus, steps)
            if export is None or not _serve(export):
                return 1
        print(f"demo finished in {time.perf_counter() - t0:.0f}s")
        return 0
    finally:
        if started and down:
            cluster.down()
            print("stopped the demo's local cluster")
        else:
            print(
                f"cluster still running: dashboard {info.dashboard_url} (stop it, and the endpoint, with "
                "`pylon cluster down`)"
            )
