"""Checkpoint I/O: the trainer's save and load vs a bare multipart transfer of the same bytes, on an S3-protocol
server (moto) on loopback, in one run.

    .venv/bin/python bench/checkpoint_io.py                       # a 64 MB checkpoint, 8 MiB parts, 3 rounds
    .venv/bin/python bench/checkpoint_io.py --mb 512 --part-mb 16 --rounds 5

The checkpoint is one rank's share of a ZeRO-2 checkpoint in DeepSpeed's layout: model states (1/4 of the bytes),
the rank's optimizer shard (3/4), the two recovery scripts. An engine stand-in puts those files into the
committer's staging directory by hard links, so no time goes to making them. Each round, in this order:
- pylon save: `CheckpointCommitter.save`, the code the trainer runs (each file streamed once to its key, multipart
  for files of more than one part, sha256 on the way; rank JSON, size check, manifest, latest.json, retention);
- bare put: s3fs's own `put_file` of the same files (the same client stack, aiobotocore; multipart with the same
  part size, s3fs's default 10 parts in flight; no hashing, no commit);
- pylon load: `CheckpointCommitter.load` (streamed downloads into local staging, sha256 checked on the way);
- bare get: s3fs's `get_file` of the same objects (ranged GETs of a part each, 10 in flight, no checks).
Each runs in a fresh child process, after a small warm-up there (imports, the client, botocore's service model),
so that its memory is its own. Printed: MB/s (median and min-max over the rounds; MB = 10^6 bytes of DeepSpeed
files), the ratio pylon/bare of the medians (target >= 0.8), and the peak extra memory of the process (the one
rank) during the operation: the growth of its RSS high-water mark (VmHWM, reset through /proc/self/clear_refs
just before; everything: Python, C buffers, thread stacks) in every round, and tracemalloc's peak of Python
allocations in one extra round with tracing on (tracing slows Python, so that round is not timed). Target: <= 2 x
the part size. The S3 server runs in a process of its own, so its memory is not counted. Also printed, for a figure
less at the mercy of the machine's load: CPU seconds per GB of the client (every thread of the child process) and of
the server (its whole process, over the child's life) for each operation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

MiB = 2**20
BUCKET = "pylon-bench"
_SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


# ---------------------------------------------------------------------------------------------------------
# The child: one operation, measured
# ---------------------------------------------------------------------------------------------------------


class LinkEngine:
    """The DeepSpeed engine where only its files matter: `save_checkpoint` hard-links the files under `src` into
    the staging directory; `load_checkpoint` accepts what was downloaded (the committer has checked every sha256)."""

    def __init__(self, src: Path):
        self.src = src

    def zero_optimization_stage(self) -> int:
        return 2

    def zero_elastic_checkpoint(self) -> bool:
        return False

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        for path in sorted(p for p in self.src.rglob("*") if p.is_file()):
            target = Path(save_dir) / path.relative_to(self.src)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs) -> tuple[str, dict]:
        return load_dir, {}


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def child(op: str, args) -> dict:
    """Run `op` once (after a warm-up) and measure it; what the parent prints."""
    from pylon import storage
    from pylon.jobs.checkpoint import CheckpointCommitter

    part = int(args.part_mb * MiB)
    src, work = Path(args.src), Path(args.work)
    fs, _ = storage.resolve(args.run_uri)
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    # Warm-up, below one part: imports, the S3 client and its service model, the connection pool.
    tiny = work / "tiny"
    (tiny / "ds").mkdir(parents=True, exist_ok=True)
    (tiny / "ds" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
    if op.startswith("pylon"):
        warm = CheckpointCommitter(args.run_uri + "-warm", rank=0, world_size=1, keep_last=1, part_size=part)
        warm.save(LinkEngine(tiny), 1, extra={})
        warm.load(LinkEngine(tiny), warm.latest())
        committer = CheckpointCommitter(args.run_uri, rank=0, world_size=1, keep_last=1, part_size=part)
        if op == "pylon-save":
            run = lambda: committer.save(LinkEngine(src), 1, extra={"data": {"position": 1}})  # noqa: E731
        else:
            info = committer.latest()
            run = lambda: committer.load(LinkEngine(src), info)  # noqa: E731
    else:
        warm_path = storage.resolve(args.run_uri + "-warm/x")[1]
        fs.put_file(str(tiny / "ds" / "mp_rank_00_model_states.pt"), warm_path, chunksize=part)
        fs.get_file(warm_path, str(work / "warm.out"), chunksize=part)
        root = storage.resolve(args.run_uri)[1]
        out = work / "bare-get"
        if op == "bare-put":

            def run() -> None:
                for rel in files:
                    fs.put_file(str(src / rel), f"{root}/{rel}", chunksize=part)

        else:

            def run() -> None:
                for rel in files:
                    (out / rel).parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(f"{root}/{rel}", str(out / rel), chunksize=part)

    if args.trace:
        tracemalloc.start()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    rss0 = _rss_kib()
    traced0 = tracemalloc.get_traced_memory()[0] if args.trace else 0
    cpu0, t0 = os.times(), time.perf_counter()
    run()
    seconds, cpu1 = time.perf_counter() - t0, os.times()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)  # every thread of this process
    result = {"op": op, "seconds": seconds, "cpu": cpu, "rss_growth": (_hwm_kib() - rss0) * 1024}
    if args.trace:
        result["traced_peak"] = tracemalloc.get_traced_memory()[1] - traced0
        tracemalloc.stop()
    return result


# ---------------------------------------------------------------------------------------------------------
# The parent: the server, the files, the rounds, the report
# ---------------------------------------------------------------------------------------------------------


def _write_noise(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for start in range(0, size, 4 * MiB):
            f.write(os.urandom(min(4 * MiB, size - start)))


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of process `pid` so far, all its threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_child(op: str, run_uri: str, src: Path, work: Path, args, *, server_pid: int, trace: bool = False) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", op, "--run-uri", run_uri, "--src", str(src), "--work", str(work)]
    cmd += ["--part-mb", str(args.part_mb)] + (["--trace"] if trace else [])
    server0 = _cpu_seconds(server_pid)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{op} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    # The server's CPU over the child's whole life (its warm-up too, a few small requests): an upper bound.
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"server_cpu": _cpu_seconds(server_pid) - server0}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} MB/s  (min {min(values):.1f}, max {max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=64, help="checkpoint size (this rank's files), MB")
    parser.add_argument("--part-mb", type=float, default=8, help="part size, MiB (S3's minimum is 5)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    for hidden in ("--run-uri", "--src", "--work"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)), flush=True)
        return 0

    import boto3

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = server.stdout.readline().strip()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_SESSION_TOKEN"):
            os.environ.pop(name, None)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        # The server's first multipart upload and GET import what they need there: not in any measured round.
        upload = client.create_multipart_upload(Bucket=BUCKET, Key="warm")
        etags = [
            client.upload_part(Bucket=BUCKET, Key="warm", UploadId=upload["UploadId"], PartNumber=n, Body=data)["ETag"]
            for n, data in ((1, os.urandom(5 * MiB)), (2, b"last"))
        ]
        client.complete_multipart_upload(
            Bucket=BUCKET,
            Key="warm",
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]},
        )
        client.get_object(Bucket=BUCKET, Key="warm", Range="bytes=0-99")["Body"].read()
        client.get_object(Bucket=BUCKET, Key="warm")["Body"].read()
        with tempfile.TemporaryDirectory(prefix="pylon-bench-ckpt-") as tmp:
            return _bench(Path(tmp), args, server.pid)
    finally:
        server.stdin.close()
        server.wait(30)


def _bench(tmp: Path, args, server_pid: int) -> int:
    from pylon import storage

    total = int(args.mb * 1e6)
    src = tmp / "src"
    sizes = {
        "ds/mp_rank_00_model_states.pt": total // 4,
        "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": total - total // 4 - 2 * 24_000,
        "zero_to_fp32.py": 24_000,
        "zero_to_torch.py": 24_000,
    }
    for rel, size in sizes.items():
        _write_noise(src / rel, size)
    part = int(args.part_mb * MiB)
    print(
        f"checkpoint: {total / 1e6:.0f} MB in {len(sizes)} files (largest {max(sizes.values()) / 1e6:.1f} MB), "
        f"part size {part / MiB:g} MiB, {args.rounds} round(s), S3 server (moto) on 127.0.0.1 in its own process"
    )
    mbps: dict[str, list[float]] = {op: [] for op in ("pylon-save", "bare-put", "pylon-load", "bare-get")}
    rss: dict[str, list[int]] = {op: [] for op in mbps}
    cpu: dict[str, list[tuple[float, float]]] = {op: [] for op in mbps}  # (client, server) CPU seconds per GB
    traced_peaks: dict[str, int] = {}
    for r in range(args.rounds + 1):
        trace = r == args.rounds  # the last round: tracemalloc on, not timed
        for op in mbps:
            uri = f"s3://{BUCKET}/{'pylon' if op.startswith('pylon') else 'bare'}-{r}"
            result = _run_child(op, uri, src, tmp / f"work-{r}-{op}", args, server_pid=server_pid, trace=trace)
            if trace:
                traced = traced_peaks[op] = result["traced_peak"]
                print(
                    f"  traced round: {op:10s} tracemalloc peak {traced / MiB:6.1f} MiB "
                    f"({traced / part:.2f} x part), RSS high-water growth {result['rss_growth'] / MiB:6.1f} MiB"
                )
                continue
            mbps[op].append(total / 1e6 / result["seconds"])
            rss[op].append(result["rss_growth"])
            cpu[op].append((result["cpu"] / (total / 1e9), result["server_cpu"] / (total / 1e9)))
            growth = rss[op][-1] / MiB
            print(
                f"  round {r + 1}: {op:10s} {mbps[op][-1]:7.1f} MB/s  RSS high-water growth {growth:6.1f} MiB  "
                f"CPU s/GB: client {cpu[op][-1][0]:5.1f}, server {cpu[op][-1][1]:5.1f}"
            )
        for kind in ("pylon", "bare"):  # the server keeps objects in memory: a round's go when it is done
            storage.remove(f"s3://{BUCKET}/{kind}-{r}", recursive=True)
        for work in tmp.glob(f"work-{r}-*"):
            shutil.rmtree(work)
    print()
    for op in mbps:
        worst = max(rss[op])
        client_cpu = statistics.median(c for c, _ in cpu[op])
        server_cpu = statistics.median(s for _, s in cpu[op])
        print(
            f"{op:10s} {_spread(mbps[op])}  RSS growth max {worst / MiB:5.1f} MiB ({worst / part:.2f} x part)  "
            f"CPU s/GB median: client {client_cpu:.1f}, server {server_cpu:.1f}"
        )
    met = True
    for name, ours, bare in (("save", "pylon-save", "bare-put"), ("load", "pylon-load", "bare-get")):
        ratio = statistics.median(mbps[ours]) / statistics.median(mbps[bare])
        growth = max(rss[ours] + [traced_peaks[ours]]) / part
        met = met and ratio >= 0.8 and growth <= 2
        print(
            f"{name}: pylon/bare {ratio:.2f} (medians; target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}); "
            f"peak extra memory {growth:.2f} x part, the larger of RSS growth and tracemalloc "
            f"(target <= 2: {'met' if growth <= 2 else 'NOT met'})"
        )
    print("summary: " + ("all targets met" if met else "a target is NOT met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
