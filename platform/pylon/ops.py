"""Build, ahead of time, the C++ ops that training and serving compile on first use.

DeepSpeed compiles its CPU ops (the host Adam of optimizer offload, the fused Adam of CPU training, the shared-
memory collectives) and Pylon its paged-attention and int8 kernels just in time, into `$TORCH_EXTENSIONS_DIR`, the first
time a process needs them: minutes on a small machine, stalling the first training job or replica (and every
process that waits on the build's lock). `make setup` runs this once instead, building them side by side:

    python -m pylon.ops            # cpu_adam, fused_adam, deepspeed_shm_comm, pylon_paged_attention,
                                   # pylon_int8_linear, pylon_int4_linear
    python -m pylon.ops --nvme     # and async_io (NVMe offload; needs libaio, several minutes)

Builds are reused by every later process of this environment; a failed build is reported and left to the
just-in-time path (which reports it again where it matters).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from pylon import settings

# op name -> the DeepSpeed CPU accelerator's builder class that makes it
DEEPSPEED_OPS = {
    "cpu_adam": "CPUAdamBuilder",
    "fused_adam": "FusedAdamBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}
NVME_OPS = {"async_io": "AsyncIOBuilder"}
# Pylon's own kernels: op name -> the module whose `python -m` builds (and checks) it
SERVING_OPS = {
    "pylon_paged_attention": "pylon.serving.model.kernels",
    "pylon_int8_linear": "pylon.serving.model.quant",
    "pylon_int4_linear": "pylon.serving.model.quant --int4",
}

_BUILD_DEEPSPEED = """
import sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[1])
if builder is None or not builder.is_compatible(verbose=False):
    sys.exit(3)
builder.load(verbose=False)
"""


def venv_tools_first() -> None:
    """Put this interpreter's bin directory first on PATH, for this process and what it starts.

    torch builds C++ ops with whichever `ninja` is first on PATH, and the venv's (pip's ninja 1.13) and a system
    one (1.11) log build commands differently: each rebuilds from scratch what the other built (minutes per op
    here). Every Pylon process that may build, and every Ray process `pylon.infra.local.up` starts, uses the venv's.
    """
    bindir = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


def plain_cuda_arch_list(environ: dict | None = None) -> str | None:
    """Make TORCH_CUDA_ARCH_LIST readable by DeepSpeed's just-in-time builders, for this process and what it starts.

    torch takes architecture-specific entries such as `9.0a` (Hopper's wgmma) or `10.0f`, and CUDA images set them;
    DeepSpeed 0.19 reads each entry as MAJOR.MINOR[+PTX] and fails (`invalid literal for int() with base 10: '0a'`),
    so its fused Adam -- the optimizer Pylon's config gets on a GPU -- could not be built on such a machine (seen on a
    lent H200). Each entry loses its suffix letters (`9.0a` -> `9.0`; `+PTX` kept, duplicates dropped): DeepSpeed's
    kernels use no architecture-specific instruction. Returns the list now set, None where nothing changed."""
    env = os.environ if environ is None else environ
    value = env.get("TORCH_CUDA_ARCH_LIST", "")
    entries = [e for e in value.replace(";", " ").split() if e]
    plain = []
    for entry in entries:
        arch, ptx = (entry.split("+", 1) + [""])[:2]
        major, _, minor = arch.partition(".")
        cleaned = f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}" if minor else arch
        cleaned += f"+{ptx}" if ptx else ""
        if cleaned not in plain:
            plain.append(cleaned)
    if plain == entries:
        return None
    env["TORCH_CUDA_ARCH_LIST"] = ";".join(plain)
    return env["TORCH_CUDA_ARCH_LIST"]


def build_command(name: str) -> list[str]:
    """The command that builds op `name` (a key of DEEPSPEED_OPS, NVME_OPS or SERVING_OPS);
    it exits 0 when built, 3 when the op is not compatible with this machine."""
    if name in SERVING_OPS:
        return [sys.executable, "-m", *SERVING_OPS[name].split()]
    builder = {**DEEPSPEED_OPS, **NVME_OPS}[name]
    if name == "async_io":  # what DeepSpeed's swappers load (deepspeed.ops.op_builder, not the accelerator's)
        code = (
            "from deepspeed.ops.op_builder import AsyncIOBuilder as B\nimport sys\nb = B()\n"
            "sys.exit(3) if not b.is_compatible(verbose=False) else b.load(verbose=False)"
        )
        return [sys.executable, "-c", code]
    return [sys.executable, "-c", _BUILD_DEEPSPEED, builder]


def build(nvme: bool = False) -> dict[str, str]:
    """Build every op in parallel; returns {op: 'ok (Ns)' | 'skipped: ...' | 'failed: ...'}."""
    ops = [*DEEPSPEED_OPS, *(NVME_OPS if nvme else {}), *SERVING_OPS]
    venv_tools_first()
    plain_cuda_arch_list()
    env = dict(os.environ)
    started = time.perf_counter()
    procs = {
        name: subprocess.Popen(
            build_command(name), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name in ops
    }
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        took = time.perf_counter() - started
        if proc.returncode == 0:
            results[name] = f"ok ({took:.0f}s)"
        elif proc.returncode == 3:
            results[name] = "skipped: not compatible with this machine"
        else:
            last = (out or "").strip().splitlines()[-1:] or ["no output"]
            results[name] = f"failed (exit {proc.returncode}): {last[0][:200]}"
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pylon.ops",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  python -m pylon.ops\n  TORCH_EXTENSIONS_DIR=/shared/ops python -m pylon.ops --nvme",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nvme", action="store_true", help="also build async_io (NVMe offload)")
    args = parser.parse_args(argv)
    print(
        f"building C++ ops into {settings.value(settings.TORCH_EXTENSIONS_DIR) or '~/.cache/torch_extensions'} ...",
        flush=True,
    )
    results = build(nvme=args.nvme)
    for name, outcome in results.items():
        print(f"  {name:<24} {outcome}")
    return 0 if not any(r.startswith("failed") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
