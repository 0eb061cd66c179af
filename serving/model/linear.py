"""The model's projections on a CPU: oneDNN's matmul over weights reordered once at load.

torch's CPU `addmm` (MKL's sgemm) packs the weight into its own layout on every call; oneDNN can reorder a weight
once into the blocked layout its kernels read, and then each call only packs the activations, which matters for the
engine's many small-row calls over cold weights. Used where it helps and is safe: CPU, float32, torch built with
oneDNN, and a check at load that the reordered weight gives what `addmm` gives (greedy outputs stay `transformers`'
own). `PYLON_ONEDNN_LINEAR=0` keeps MKL.

oneDNN compiles a kernel per row count. So steps with a prompt chunk run their projections over `padded_rows` rows (one
of a few dozen sizes), decode-only steps over their exact count, and the engine compiles them all at start-up
(`ModelRunner.warm_up`), as vLLM captures CUDA graphs for a list of batch sizes. `PYLON_PADDED_ROWS=0` pads nothing
and compiles as steps come. Measurements: docs/serving.md.
"""

from __future__ import annotations

import functools
import logging

import torch

from pylon import settings
from pylon.settings import switched_on

log = logging.getLogger(__name__)

ROW_STEP = 16  # padded_rows' granularity up to 512 rows
CACHE_ENTRIES_PER_KERNEL = 2  # a projection's kernel is an inner product and the matmul it runs: two cache entries


def cached_kernels() -> int:
    """How many projection kernels oneDNN's cache keeps in this process: ONEDNN_PRIMITIVE_CACHE_CAPACITY entries
    (default 1,024), `CACHE_ENTRIES_PER_KERNEL` a kernel."""
    try:
        capacity = int(settings.value(settings.ONEDNN_CACHE) or "1024")
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
