"""Pylon's compiled CPU serving kernels and the Python functions that call them.

The C++ is in `csrc/` beside this module: decode attention over the paged KV cache (`paged_decode`: each
sequence's query reads its blocks in place, in one pass with a running softmax), causal attention of prompt chunks
over a float32 cache (`prefill_attention_`), the store of a step's keys and values into both caches (`store_kv_`)
and GPT-2's tanh GELU (`gelu_tanh_`). They exist because the PyTorch path copies every sequence's blocks into a
batch before attending, SDPA packs its operands on every call, and torch's CPU GELU and `index_copy_` are slow.

Torch's C++ extension loader compiles them once per machine into `$TORCH_EXTENSIONS_DIR/<NAME>` (`make setup`, or
`python -m pylon.serving.model.kernels`) with `-march=native`: the preprocessor picks the AVX-512 loops, else the
AVX2 ones (with FMA and F16C), else scalar ones. Queries and arithmetic are float32; a cache may be stored as
float32, bfloat16, float16 or float8 e4m3. Without a compiler, or with `PYLON_PAGED_KERNEL=0`, the engine takes the
PyTorch path, with the same results up to float rounding. Design and measurements: see docs/serving.md.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from pylon.ops import venv_tools_first
from pylon.settings import switched_on

log = logging.getLogger(__name__)

# The build directory under $TORCH_EXTENSIONS_DIR: a new name whenever the sources change shape (v10: the C++ in
# csrc/ files, no longer one generated main.cpp; v11: prefill_attention_ takes a draft tree's masks), so a checkout
# of another version keeps its own build.
NAME = "pylon_paged_attention_v11"

# The extension's sources, compiled with the same flags into one module; ninja rebuilds what a changed source or
# header (cpu_vec.h, ops.h) touches.
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "cache.cpp", "activation.cpp")

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:

    return switched_on("PYLON_PAGED_KERNEL")


def load(verbose: bool = False):
    """The compiled module (building it the first time on this machine), or None where it cannot be had."""
    global _module, _failed
    if _module is not None or _failed is not None or not enabled():
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_extension

            venv_tools_first()  # torch runs the `ninja` first on PATH: the venv's, as for every build of Pylon's

            _module = load_extension(
                name=NAME,
                sources=[str(_CSRC / source) for source in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=verbose,
            )
        except Exception as e:  # no compiler, no headers, a build error: the PyTorch path still works
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("paged-attention kernel unavailable (%s); decoding uses the PyTorch path", _failed)
    return _module


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`[B, heads, head_dim]` attention output of one query per sequence; see the module's docstring."""
    module = load()
    if module is None:
        raise RuntimeError(f"the paged-attention kernel is not available: {_failed or 'disabled'}")
    return module.paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's "gelu_new") applied to the contiguous float32 CPU tensor `x` in
    place; returns `x`."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    module.gelu_tanh_(x)
    return x


def store_kv_(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write a step's keys and values (`[T, kv_heads, head_dim]`, the caches' dtype) at their slots of both caches
    (`[kv_heads, num_blocks, block_size, head_dim]`) in one call; see `pylon.serving.model.attention.store_kv`."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    module.store_kv_(k_cache, v_cache, slot_mapping, k, v)


def prefill_attention_(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt chunk's queries `q` (`[T, heads, head_dim]`, at positions start..start+T-1) over
    its sequence's keys and values 0..start+T-1 in the float32 caches, found through its block `table`, into `out`
    (`q`'s shape, rows contiguous); returns `out`. Only where `prefill_usable` says so. `tree` (int64 `[T]`, T <= 64):
    a draft tree's rows instead (their keys at slots start..start+T-1), row i seeing the keys before `start` and those
    of the chunk's own whose bits `tree[i]` sets (`attention.tree_bits`)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels are not available: {_failed or 'disabled'}")
    none = _NO_TREE if tree is None else tree
    module.prefill_attention_(out, q, k_cache, v_cache, table, int(start), float(scale), none)
    return out


_NO_TREE = torch.empty(0, dtype=torch.int64)


PREFILL_HEAD_DIMS = (32, 64, 128, 256)


def prefill_usable(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt chunks of a CPU model can go to `prefill_attention_`: float32 compute over a float32 cache
    (narrower caches keep SDPA over the chunk's own unrounded keys), a head_dim it is built for, and AVX-512 or AVX2."""

    if dtype != torch.float32 or kv_dtype != torch.float32 or head_dim not in PREFILL_HEAD_DIMS:
        return False
    module = load()
    return module is not None and bool(module.has_prefill()) and switched_on("PYLON_PREFILL_KERNEL")


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)  # how the kernel reads a cache


def usable(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decodes of a model computing in `dtype` over a cache stored as `kv_dtype` (default: `dtype`) can
    go to the kernel: on a CPU, float32 compute, any of KV_DTYPES, and the kernel built."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return device.type == "cpu" and dtype == torch.float32 and kv_dtype in KV_DTYPES and load() is not None


if __name__ == "__main__":
    import time

    started = time.perf_counter()
    mod = load(verbose=False)
    if mod is None:
        raise SystemExit(f"paged-attention kernel: not built ({_failed or 'disabled by PYLON_PAGED_KERNEL'})")
    print(f"paged-attention kernel ready ({time.perf_counter() - started:.1f}s)")
