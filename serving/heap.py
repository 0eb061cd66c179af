"""An engine process keeps the memory it frees (glibc's malloc is told not to hand large blocks back to the kernel),
and its garbage collector leaves alone the objects it loaded (`freeze_loaded_objects`).

Every step of a CPU engine allocates and frees the same few megabytes of activations (a 512-token step's
`[512, 1024]` MLP output is 2 MB), of a size that changes from step to step. glibc serves blocks that large with
`mmap` and unmaps them on free, or grows its heap for them and trims it again once the top is free, and its
thresholds for both adapt to one size at a time, not to these. The next step's allocation then comes back as fresh
pages, and the kernel faults in and zeroes every 4 KB of them. With the mmap threshold at glibc's maximum (32 MB on
64-bit) and the trim threshold at 1 GB, those blocks come from the heap and stay there. Measured on a one-thread
engine that serves the serving bench's workload five times over in one process (4 layers, 256 wide, 64 requests
a run): 157,000 page faults in the process's life against 310,000-465,000 (the 157,000 are its start: imports and
the model), and 1,622-1,671 against 1,528-1,602 out tok/s over runs 2-5, the same runs alternated (+4-5%). A
fresh process's first run gains nothing (its pages are new either way): the bench's engine leg, two engine
processes that live for ~64 requests each, moved within its noise (three pairs, 2,427-2,622 against
2,320-2,591). The gain is a long-running server's.

Only the engine's own process does this (`pylon.serving.engine_process`), whose memory is the engine's: its peak
stays reserved for it, which is what a server wants. glibc only (elsewhere, or with `PYLON_KEEP_HEAP=0`: nothing).

A CPU engine process goes further where gperftools' TCMalloc is installed (`libtcmalloc-minimal4`, which `make setup`
installs; `engine_process_env`): it starts with TCMalloc preloaded in place of glibc's malloc, as vLLM's and Intel's
CPU serving guides advise. glibc's malloc, even with the thresholds above, spent ~4% of a one-thread engine's
samples in `_int_malloc`, `malloc_consolidate` and `_int_free` (perf over the serving bench's workload): every op of
a step allocates its output and frees its inputs' predecessors, ~60 tensors a step from a few KB to 2 MB, and
glibc sorts freed blocks into bins and merges neighbours on the way. TCMalloc hands back recently freed blocks of
the size class from a per-thread cache, the same warm memory step after step. One engine process serving 64 of the
bench's requests three times, five processes per allocator alternated: 2.70-2.98 s a run with TCMalloc against
2.87-3.27 with glibc; the same engine in-process, two processes per allocator: 2.62-2.76 against 2.78-2.98 (jemalloc:
2.86-3.12, faulting in pages all along). `PYLON_TCMALLOC=0` keeps glibc's; a CUDA engine keeps it too (its
activations live in the device's caching allocator).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys

from pylon.serving import switched_on

log = logging.getLogger(__name__)

ENV = "PYLON_KEEP_HEAP"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): larger blocks are still mapped
TRIM_THRESHOLD = 1 << 30


TCMALLOC_ENV = "PYLON_TCMALLOC"
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # gperftools' (Debian/Ubuntu, RHEL, conda)
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def tcmalloc_path(dirs: tuple[str, ...] | None = None) -> str | None:
    """Where gperftools' TCMalloc is installed (the first of `TCMALLOC_NAMES` in the active conda or virtual
    environment's lib, then the system's `LIBRARY_DIRS`), or None: not installed, or `PYLON_TCMALLOC=0`."""
    if not switched_on(TCMALLOC_ENV) or not sys.platform.startswith("linux"):
        return None
    if dirs is None:
        prefixes = [os.environ.get("CONDA_PREFIX"), sys.prefix]
        dirs = tuple(os.path.join(p, "lib") for p in prefixes if p) + LIBRARY_DIRS
    for directory in dirs:
        for name in TCMALLOC_NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def engine_process_env(device: str, environ: dict | None = None, *, dirs: tuple[str, ...] | None = None) -> dict:
    """The environment an engine process starts with: `environ` (default this process's), and for a CPU engine
    TCMalloc first in `LD_PRELOAD` where it is installed (see the module's docstring)."""
    env = dict(os.environ if environ is None else environ)
    path = tcmalloc_path(dirs) if device == "cpu" else None
    if path:
        preload = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != path]
        env["LD_PRELOAD"] = ":".join([path, *preload])
    return env


def allocator() -> str:
    """Which malloc this process runs on: "tcmalloc" (preloaded) or "glibc" (or "other")."""
    process = ctypes.CDLL(None)
    if hasattr(process, "tc_malloc"):
        return "tcmalloc"
    return "glibc" if hasattr(process, "mallopt") and hasattr(process, "malloc_trim") else "other"


def keep_freed_memory() -> bool:
    """Set this process's malloc to reuse freed blocks instead of returning them to the kernel. True where it took
    effect (glibc); False elsewhere (TCMalloc keeps what it frees by itself), or when `PYLON_KEEP_HEAP=0`."""
    if not switched_on(ENV) or allocator() != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("malloc refused the engine's thresholds; freed memory goes back to the kernel as before")
    return ok


def freeze_loaded_objects() -> int:
    """Move every object alive now (after the imports and the model's load) out of the garbage collector's reach:
    its full collections then walk only what serving creates. An engine process holds ~390,000 tracked objects
    once torch and transformers are imported and a model is loaded (the serving bench's), and a full collection
    of them took 175 ms, against none after the freeze: a pause of a dozen decode steps every time the objects
    that requests leave behind add up to a quarter of the heap's, in the middle of everyone's streams. vLLM's
    engine freezes its heap after start for the same reason. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
