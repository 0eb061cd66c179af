"""The model's projections on a CPU: oneDNN's matmul over weights reordered once at load.

torch's CPU `addmm`/`linear` call MKL's sgemm, which takes the weight as it lies in memory and packs it into its
own panel layout on every call. oneDNN (bundled with torch as "mkldnn") can reorder a weight once into the
blocked layout its AVX-512 kernels read (`_reorder_linear_weight`), and then each call only packs the activations.
In the serving engine's steps the weights are cold (every decode step streams the whole KV cache through the caches
in between), most calls have few rows (a decode step's 16-32 tokens), and there the per-call packing is a
good part of the call: the default serving bench's 1-thread engine (4 layers, 256 wide, 64 requests) ran at
1,380-1,450 out tok/s with MKL and 1,500-1,575 with the reordered weights, the same run alternated (+8%).

Used where it helps and is safe: CPU, float32 compute, torch built with oneDNN, and a check at load that the
reordered weight gives what `addmm` gives (to float32 rounding: the two libraries add up the products in
different orders; greedy outputs stay identical to `transformers` generate, which the parity tests check).
`PYLON_ONEDNN_LINEAR=0` keeps MKL.

oneDNN compiles a kernel for every shape it is called with (a "primitive", JIT-generated machine code), keeps the
last 1,024 in a cache, and compiling one took 0.5-1.6 ms against 0.36 ms to run it (a 256 -> 1,024 projection of
20-120 rows, one thread), faulting in ~200 fresh pages each time. A step's row count is its token count, which in
steps that carry a prompt chunk is any number up to the token budget: a fresh engine compiled four new kernels
for nearly every such step, and a server that has seen a few hundred counts evicts and recompiles for good. So
those steps run their projections over `padded_rows` rows (the token count rounded up to one of a few dozen
sizes; the extra rows are thrown away), steps of decodes only over their exact count (at most max_num_seqs), and
the engine compiles all of them when it starts (`ModelRunner.warm_up`), as vLLM captures its CUDA graphs for a
list of batch sizes at start. Measured on the serving bench's model (4 layers, 256 wide; 32 sequences, 512-token
budget: 62 row counts, 248 kernels, compiled in 0.28 s): a fresh one-thread engine serving 64 requests faulted
2,100-2,500 pages against 35,500-36,500 and ran at 1,653-1,690 against 1,570-1,663 out tok/s (four alternated
pairs); the bench's engine leg used 625-662 against 635-681 CPU-ms per 1k tokens (three pairs). The kernels' machine
code is ~0.6 MB each, held for the engine's life: +148 MB for those 248 (a server would reach it anyway, as its steps
meet the sizes). `PYLON_PADDED_ROWS=0` pads nothing and compiles as steps come.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from pylon.serving import switched_on

log = logging.getLogger(__name__)

ROW_STEP = 16  # padded_rows' granularity up to 512 rows
CACHE_ENTRIES_PER_KERNEL = 2  # a projection's kernel is an inner product and the matmul it runs: two cache entries


def cached_kernels() -> int:
    """How many projection kernels oneDNN's cache keeps in this process: ONEDNN_PRIMITIVE_CACHE_CAPACITY entries
    (default 1,024), `CACHE_ENTRIES_PER_KERNEL` a kernel."""
    try:
        capacity = int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024"))
    except ValueError:
        capacity = 1024
    return capacity // CACHE_ENTRIES_PER_KERNEL


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections of a model computing in `dtype` on `device` should go through oneDNN."""
    if device.type != "cpu" or dtype != torch.float32 or not switched_on("PYLON_ONEDNN_LINEAR"):
        return False
    return _self_test()


@functools.cache
def _self_test() -> bool:
    """Once per process: oneDNN's ops exist here and agree with `addmm`."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((5, 64), (48, 64), (48,)))
        ok = torch.allclose(addmm(b, x, pack(w)), torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError) as e:  # a torch without these ops, or a CPU oneDNN cannot run on
        log.info("oneDNN linear unavailable (%s); projections use torch's addmm", e)
        return False
    if not ok:
        log.warning("oneDNN linear disagrees with torch's addmm here; projections use addmm")
    return ok


def padded_rows(n: int) -> int:
    """The rows a step of `n` tokens that carries a prompt chunk runs its projections over: `n` rounded up to a
    multiple of 16, or of 1/16 of its power of two above 512 (at most 1/16 extra: 16 sizes per octave)."""
    step = max(ROW_STEP, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


def row_counts(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Every row count an engine's projections run over: each count of decodes (and of sampling tokens, which the
    last layer of a step runs alone) up to `max_num_seqs`, and each `padded_rows` size up to the token budget;
    fewest rows first."""
    sizes = set(range(1, max_num_seqs + 1))
    n = 1
    while n <= max_num_batched_tokens:
        sizes.add(padded := padded_rows(n))
        n = padded + 1
    return sorted(sizes)


def pack(weight_out_in: torch.Tensor) -> torch.Tensor:
    """An `[out, in]` weight (`nn.Linear`'s layout; GPT-2's Conv1D weight transposed) reordered for `addmm`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.contiguous(), None)


def addmm(bias: torch.Tensor | None, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`bias + x @ w` for a weight reordered by `pack`, in `torch.addmm`'s argument order; x is `[rows, in]`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """A `torch.nn.Linear` whose weight is reordered for oneDNN; the original's weight is not kept."""

    def __init__(self, source: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.packed = pack(source.weight.detach())
        self.bias = None if source.bias is None else source.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return addmm(self.bias, x.reshape(-1, shape[-1]), self.packed).view(*shape[:-1], self.out_features)
