"""An engine process keeps the memory it frees, and its garbage collector leaves alone the objects it loaded.

Every step of a CPU engine allocates and frees the same few megabytes of activations, of sizes that change from step
to step; glibc's adaptive thresholds hand them back to the kernel, and the next step faults in fresh zeroed pages. With
the mmap threshold at glibc's maximum and the trim threshold at 1 GB they stay in the heap (`keep_freed_memory`): a
long-running server's gain. A CPU engine process also starts with gperftools' TCMalloc preloaded where it is
installed (`engine_process_env`), as vLLM's and Intel's CPU serving guides advise, and freezes what it loaded out of
the collector's reach (`freeze_loaded_objects`). Only the engine's own process does this (its memory is the engine's).
Switches: `PYLON_KEEP_HEAP`, `PYLON_TCMALLOC` (docs/settings.md); measurements: docs/serving.md.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys

from pylon.settings import switched_on

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
