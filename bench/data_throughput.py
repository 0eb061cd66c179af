"""Data throughput: Pylon's Ray Data stream vs a bare pyarrow reader, on the same shards, in one run.

    .venv/bin/python bench/data_throughput.py                 # local disk and a moto S3 server on loopback
    .venv/bin/python bench/data_throughput.py --rows 200000 --format webdataset --stores local

For each store (local disk, S3 protocol on 127.0.0.1), the same prepared shards are read to the end twice:
- baseline: a bare loop over the manifest's shards (read bytes through the same pyarrow filesystem, decode
  with pyarrow / tarfile, count tokens) — the ceiling for one process, with no checks and no shuffling;
- pylon: `ShardStream` (Ray Data reads with size + sha256 checks, seeded shuffle windows, batches).
It prints tokens/s of each and the ratio. Target: pylon >= 0.5 x baseline on 2 cores.
Needs a running cluster (`pylon cluster up`); it starts its own S3 server.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def bare_reader_tokens(uri: str) -> int:
    """The ceiling: read and decode every shard in order, in this process, nothing else."""
    from pylon import storage
    from pylon.data.shards import decode_shard, read_manifest

    manifest = read_manifest(uri)
    fs, root = storage.arrow_filesystem(uri)
    tokens = 0
    for shard in manifest.shards:
        with fs.open_input_stream(f"{root.rstrip('/')}/{shard.file}") as f:
            data = f.readall()
        rows = decode_shard(manifest.format, data, shard=shard.file, seq_len=manifest.seq_len, dtype=manifest.dtype)
        tokens += int(rows.num_tokens.sum())
    return tokens


def pylon_stream_tokens(uri: str, batch_size: int) -> int:
    from pylon.data.reader import ShardStream

    stream = ShardStream(uri, batch_size=batch_size, seed=0, shuffle_buffer=4096)
    tokens = 0
    for batch in stream.epoch():
        tokens += int(batch.num_tokens.sum())
    return tokens


def measure(name: str, fn, *args) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn(*args)
    return tokens, time.perf_counter() - t0


def run_store(label: str, uri: str, args) -> float:
    from pylon.data.testing import write_synthetic_dataset

    t0 = time.perf_counter()
    m = write_synthetic_dataset(
        uri, rows=args.rows, rows_per_shard=args.rows_per_shard, seq_len=args.seq_len, fmt=args.format
    )
    print(
        f"[{label}] wrote {len(m.shards)} {args.format} shards, {m.totals.tokens:,} tokens, "
        f"{m.totals.bytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s"
    )
    # Warm both paths once (imports, Ray Data start-up, page cache), then alternate timed runs.
    pylon_stream_tokens(uri, args.batch_size)
    bare_reader_tokens(uri)
    best = {"baseline": 0.0, "pylon": 0.0}
    for _ in range(args.repeats):
        for name, fn, fargs in (
            ("baseline", bare_reader_tokens, (uri,)),
            ("pylon", pylon_stream_tokens, (uri, args.batch_size)),
        ):
            tokens, seconds = measure(name, fn, *fargs)
            assert tokens == m.totals.tokens, f"{name} read {tokens} tokens, expected {m.totals.tokens}"
            best[name] = max(best[name], tokens / seconds)
    ratio = best["pylon"] / best["baseline"]
    print(f"[{label}] baseline (bare pyarrow reader): {best['baseline'] / 1e6:8.2f} M tokens/s")
    print(f"[{label}] pylon (Ray Data ShardStream):   {best['pylon'] / 1e6:8.2f} M tokens/s")
    print(f"[{label}] ratio pylon/baseline: {ratio:.2f}  (target >= 0.50: {'met' if ratio >= 0.5 else 'NOT met'})")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=524_288)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--rows-per-shard",
        type=int,
        default=65_536,
        help="default: 64 MiB shards at seq-len 512, as `prepare` writes by default",
    )
    parser.add_argument("--format", choices=["parquet", "webdataset"], default="parquet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    args = parser.parse_args(argv)

    import pylon

    pylon.connect().init_ray()
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="pylon-bench-") as tmp:
        if "local" in args.stores:
            ratios["local"] = run_store("local", os.path.join(tmp, "shards"), args)
        if "s3" in args.stores:
            import boto3
            from moto.server import ThreadedMotoServer

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            os.environ.update(
                AWS_ENDPOINT_URL=f"http://{host}:{port}",
                AWS_ACCESS_KEY_ID="bench",
                AWS_SECRET_ACCESS_KEY="bench",
                AWS_DEFAULT_REGION="us-east-1",
            )
            boto3.client("s3").create_bucket(Bucket="bench")
            try:
                # The read tasks run in Ray workers: they reach the server through the same environment.
                import ray

                ray.shutdown()
                pylon.connect().init_ray(
                    runtime_env={
                        "env_vars": {
                            k: os.environ[k]
                            for k in (
                                "AWS_ENDPOINT_URL",
                                "AWS_ACCESS_KEY_ID",
                                "AWS_SECRET_ACCESS_KEY",
                                "AWS_DEFAULT_REGION",
                            )
                        }
                    }
                )
                ratios["s3"] = run_store("s3", "s3://bench/shards", args)
            finally:
                server.stop()
    print("summary: " + ", ".join(f"{k} ratio {v:.2f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
