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
"""
from __future__ import annotations

import functools
import logging

import torch

from pylon.serving import switched_on

log = logging.getLogger(__name__)

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
