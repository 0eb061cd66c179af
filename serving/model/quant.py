"""Weight-only quantization of the model's projections (`engine.quantization`), applied at load.

1. `quantize`: each `[out, in]` weight becomes int8 (or float8 e4m3) with one float32 scale per output channel,
   symmetric: scale = max |w| of the channel / 127 (or / 448). The float weight is not kept.
   `quantize_int4` (int4): 4-bit ints in groups of `group` inputs (64; a 4-bit checkpoint's own group size where it
   has one that fits), asymmetric: each group's scale = (max - min) / 15 and its min, so that w = q * scale + min with q
   in 0..15; two to a byte in blocks of 32 inputs (`csrc/int4_linear.cpp` says how). A weight of a 4-bit checkpoint
   (GPTQ, AWQ, compressed-tensors' W4A16, read dequantized: model/stored.py) whose groups are these finds its grid
   again: each group's ints and scale come back as the checkpoint's (to float32 rounding), not rounded twice.
2. `addmm(bias, x, weight)`, in `torch.addmm`'s argument order, is `x @ w^T * scale + bias`:
   - CPU, float32, int8: Pylon's kernel (`csrc/int8_linear.cpp`), which reads a quarter of the float32 weight's
     bytes and widens it in registers; built once per machine by torch's extension loader, and checked once per
     process against the dequantized matmul. It beats oneDNN's float32 projections for decodes and is on par up
     to ~64 rows; prompt chunks of hundreds of rows run slower than float32.
   - CPU, float32, int4 (inputs a multiple of 32): Pylon's kernel (`csrc/int4_linear.cpp`): half a byte a weight
     and 8 bytes a group, widened and scaled in registers; checked once per process the same way.
   - CUDA, int8: torch's `_weight_int8pack_mm`, where it exists here and agrees with the dequantized matmul.
   - CUDA, fp8, bf16 model, projections whose sizes are multiples of 16: the fp8 tensor cores through
     `torch._scaled_mm`, as vLLM's fp8 runs (W8A8): each row of activations (a token) is quantized to e4m3 with its
     own scale (max |row| / 448) for the call, and the GEMM's epilogue applies both scales. Checked once per process
     against the same arithmetic in float32; where it is missing or disagrees, the dequantized matmul below.
   - Otherwise (fp8 otherwise, bf16 on a CPU, no compiler): the matmul over the weight dequantized for the call.
   torch's `_weight_int8pack_mm` on a CPU without AVX-512 runs a scalar loop, slower than the dequantized matmul,
   so a CPU never takes it. Which layers and measurements: docs/serving.md.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from pylon.errors import PylonError
from pylon.ops import venv_tools_first

log = logging.getLogger(__name__)

NAME = "pylon_int8_linear_v1"  # the build directory under $TORCH_EXTENSIONS_DIR; a new name when the source changes
INT4_NAME = "pylon_int4_linear_v3"  # the int4 kernel's
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude of each format; a channel's max |w| maps to it
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
METHODS = ("none", *QMAX, "int4")
INT4_GROUP = 64  # inputs a group of int4 weights shares a scale and a min over (unless the checkpoint's own fits)
INT4_BLOCK = 32  # inputs a packed block holds: a group is whole blocks
INT4_ROWS_AT_ONCE = 1024  # rows of a weight quantized at a time
# Steps of at least this many rows (prompt chunks) dequantize an int4 weight (in the kernel) and run one float32
# matmul: from ~128 rows on that beats the kernel's dot products (a 768 x 2304 projection, one thread: 6.6 against
# 6.7 ms at 128 rows, 21 against 27 ms at 512; at 32 rows the kernel's 1.9 ms against 2.8)
INT4_MATMUL_ROWS = 128
SCALED_MM_DEVICES = ("cuda",)  # where fp8 projections take torch._scaled_mm (tests add "cpu", where torch has it too)

_SOURCE = Path(__file__).parent / "csrc" / "int8_linear.cpp"
_INT4_SOURCE = Path(__file__).parent / "csrc" / "int4_linear.cpp"
_lock = threading.Lock()
_module = None
_failed: str | None = None
_int4_module = None
_int4_failed: str | None = None


def check(method: str, device: torch.device) -> None:
    """Raise a PylonError naming `engine.quantization` when `method` cannot run on `device`."""
    if method not in METHODS:
        raise PylonError(f"engine.quantization: must be one of {', '.join(METHODS)} (got {method!r})")
    if method != "fp8":
        return
    if device.type != "cuda":
        raise PylonError(
            "engine.quantization: fp8 weights need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this engine runs on {device.type}: use int8"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise PylonError(
            f"engine.quantization: fp8 weights need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}: use int8"
        )


def quantize(weight_out_in: torch.Tensor, method: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [out, in] int8 or float8, scales [out] float32)` with `q * scales[:, None] ~ weight_out_in`."""
    w = weight_out_in.detach().float()
    scales = (w.abs().amax(dim=1) / QMAX[method]).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = w / scales[:, None]
    if method == "int8":
        q = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        q = scaled.clamp_(-448, 448).to(torch.float8_e4m3fn)
    return q.contiguous(), scales


def int4_group(inputs: int, preferred: int | None = None) -> int | None:
    """The group size of an int4 weight of `inputs` inputs: `preferred` (a checkpoint's) where it is whole blocks of
    32 that divide the inputs, else `INT4_GROUP`, else 32; None where the inputs are no multiple of 32 (the weight is
    then stored padded, one group a row, and dequantized per call)."""
    for group in (preferred, INT4_GROUP, INT4_BLOCK):
        if group and group % INT4_BLOCK == 0 and inputs % group == 0:
            return group
    return None


def quantize_int4(weight_out_in: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q [out, in / 2] uint8, scales [out, in / group], mins [out, in / group])` float32, with each input i of a
    row `q_i * scales[g] + mins[g]` (g = i // group, q_i in 0..15) ~ the weight: asymmetric, the group's min and
    (max - min) / 15. `in` a multiple of `group`, `group` of 32. Packed as `csrc/int4_linear.cpp` reads it."""
    rows = weight_out_in.shape[0]
    if rows > INT4_ROWS_AT_ONCE:  # (a large weight a slice of rows at a time: the grid's sort holds a few copies)
        parts = [
            quantize_int4(weight_out_in[r : r + INT4_ROWS_AT_ONCE], group) for r in range(0, rows, INT4_ROWS_AT_ONCE)
        ]
        return tuple(torch.cat(p) for p in zip(*parts))
    w = weight_out_in.detach().float()
    inputs = w.shape[1]
    grouped = w.view(rows, inputs // group, group)
    mins, maxes = grouped.amin(dim=2), grouped.amax(dim=2)
    step, on_grid = _grid_step(grouped, mins, maxes)
    scales = torch.where(on_grid, step, (maxes - mins) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((grouped - mins[..., None]) / scales[..., None]).round_().clamp_(0, 15).to(torch.uint8).view(rows, inputs)
    blocks = q.view(rows, inputs // INT4_BLOCK, 2, INT4_BLOCK // 2)  # [rows, block, half, j]: input 32b + 16h + j
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, inputs // 2)
    return packed.contiguous(), scales.contiguous(), mins.contiguous()


def _grid_step(grouped: torch.Tensor, mins: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's values (`[rows, groups, group]`) as a 4-bit checkpoint left them, where they are: `(step, on_grid)`
    `[rows, groups]`, the smallest gap between a group's distinct values, and whether every value of the group is its
    min plus a whole number (0..15) of those steps. Such a group keeps its grid (its scale is the step, not
    (max - min) / 15, which differs where the group's ints do not reach both 0 and 15); random floats never sit on
    one."""
    span = (maxes - mins)[..., None]
    gaps = grouped.sort(dim=2).values.diff(dim=2)
    step = torch.where(gaps > span * 1e-5, gaps, torch.inf).amin(dim=2)
    levels = (grouped - mins[..., None]) / step[..., None]
    on_grid = torch.isfinite(step) & ((levels - levels.round()).abs() <= 1e-3).all(dim=2) & (levels.amax(dim=2) < 15.5)
    return torch.where(on_grid, step, torch.zeros_like(step)), on_grid


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """`quantize_int4`'s packed `[out, in / 2]` as its ints `[out, in]` (uint8)."""
    rows = q.shape[0]
    blocks = q.view(rows, -1, INT4_BLOCK // 2)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).view(rows, -1)


class QuantWeight:
    """A projection's quantized weight: `q` `[out, in]`, `scales` `[out]` (float32, or the model's dtype on a GPU),
    and the dtype the model computes in; int4's `q` `[out, in / 2]` packed, `scales` and `mins` `[out, groups]`
    (`group`: a 4-bit checkpoint's group size, used where it fits)."""

    def __init__(self, weight_out_in: torch.Tensor, method: str = "int8", group: int | None = None):
        dtype, device = weight_out_in.dtype, weight_out_in.device
        self.method = method
        self.in_features, self.out_features = weight_out_in.shape[1], weight_out_in.shape[0]
        if method == "int4":
            self._int4(weight_out_in, group)
            return
        self.group, self.mins, self.int4_kernel = None, None, False
        self.q, scales = quantize(weight_out_in, method)
        self.q = self.q.to(device)
        self.scales = scales.to(device, torch.float32 if device.type == "cpu" else dtype)
        self.kernel = method == "int8" and dtype == torch.float32 and device.type == "cpu" and kernel_usable()
        self.aten = method == "int8" and device.type == "cuda" and _aten_usable(device, dtype)
        self.scaled_mm = (
            method == "fp8"
            and device.type in SCALED_MM_DEVICES
            and dtype == torch.bfloat16
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
            and scaled_mm_usable(device)
        )
        # _scaled_mm's rowwise scales: float32, one per output channel, as a [1, out] row
        self.scales_row = scales.to(device, torch.float32).view(1, -1) if self.scaled_mm else None

    def _int4(self, weight_out_in: torch.Tensor, group: int | None) -> None:
        dtype, device = weight_out_in.dtype, weight_out_in.device
        self.kernel = self.aten = self.scaled_mm = False
        self.scales_row = None
        inputs = self.in_features
        self.group = int4_group(inputs, group)
        w = weight_out_in
        if self.group is None:  # (inputs no multiple of 32: padded to whole blocks, one group a row)
            padded = -(-inputs // INT4_BLOCK) * INT4_BLOCK
            w = torch.nn.functional.pad(weight_out_in.detach().float(), (0, padded - inputs), value=0.0)
        q, scales, mins = quantize_int4(w, self.group or w.shape[1])
        self.q, self.scales, self.mins = q.to(device), scales.to(device), mins.to(device)
        self.int4_kernel = (
            self.group is not None and dtype == torch.float32 and device.type == "cpu" and int4_kernel_usable()
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The `[out, in]` weight in `dtype`, for one call."""
        if self.method == "int4":
            rows, groups = self.scales.shape
            q = unpack_int4(self.q).to(torch.float32).view(rows, groups, -1)
            w = (q * self.scales[..., None] + self.mins[..., None]).view(rows, -1)
            return w[:, : self.in_features].to(dtype)
        return (self.q.to(dtype) * self.scales[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        rows = 0 if self.scales_row is None else self.scales_row.nbytes
        return self.q.nbytes + self.scales.nbytes + rows + (0 if self.mins is None else self.mins.nbytes)


def addmm(bias: torch.Tensor | None, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """`bias + x @ W^T` for a quantized weight, in `torch.addmm`'s argument order; x is `[rows, in]`."""
    if w.int4_kernel and x.shape[0] >= INT4_MATMUL_ROWS:  # (a prompt chunk: dequantized by the kernel, one matmul)
        return F.linear(x, _int4_module.int4_dequantize(w.q, w.scales, w.mins, w.group), bias)
    if w.int4_kernel:
        return _int4_module.int4_linear(x.contiguous(), w.q, w.scales, w.mins, w.group, bias)
    if w.kernel:
        return _module.int8_linear(x.contiguous(), w.q, w.scales, bias)
    if w.aten:
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), w.q, w.scales)
        return y if bias is None else y.add_(bias)
    if w.scaled_mm:
        return fp8_matmul(x, w.q, w.scales_row, bias)
    return F.linear(x, w.dequantized(x.dtype), bias)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(xq [rows, in] float8 e4m3, scales [rows, 1] float32)`: each row with its own scale, max |row| / 448."""
    xf = x.float()
    scales = (xf.abs().amax(dim=1, keepdim=True) / QMAX["fp8"]).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scales).clamp_(-448, 448).to(torch.float8_e4m3fn), scales


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scales_row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`bias + x @ (q * scales)^T` on fp8 tensor cores: x's rows quantized for the call (W8A8, dynamic per token);
    q `[out, in]` e4m3 is read column-major as `_scaled_mm` wants it (its transpose, no copy)."""
    xq, sx = quantize_rows(x)
    y = torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=scales_row, out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)


@functools.cache
def scaled_mm_usable(device: torch.device) -> bool:
    """Once per process: `torch._scaled_mm` with rowwise scales runs on `device` and gives what the same quantized
    operands give multiplied in float32 (odd row counts too)."""
    g = torch.Generator().manual_seed(0)
    try:
        for rows, n_in, n_out in ((1, 64, 48), (5, 128, 32), (33, 96, 80)):
            x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
            q, scales = quantize(w, "fp8")
            x, q, row = x.to(device, torch.bfloat16), q.to(device), scales.to(device).view(1, -1)
            got = fp8_matmul(x, q, row, None).float()
            xq, sx = quantize_rows(x)
            want = (xq.float() * sx) @ (q.float() * row.view(-1, 1)).t()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                log.warning("torch._scaled_mm disagrees with float32 on %s; fp8 weights are dequantized", device)
                return False
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as e:
        log.info("torch._scaled_mm unavailable on %s (%s); fp8 weights are dequantized per call", device, e)
        return False
    return True


class QuantLinear(torch.nn.Module):
    """A `torch.nn.Linear` with a quantized weight (see `QuantWeight`); the original's weight is not kept."""

    def __init__(self, source: torch.nn.Linear, method: str = "int8", group: int | None = None):
        super().__init__()
        self.weight_q = QuantWeight(source.weight.detach(), method, group)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bias = None if source.bias is None else source.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return addmm(self.bias, x.reshape(-1, shape[-1]), self.weight_q).view(*shape[:-1], self.out_features)


def _build(name: str, source: Path, what: str, verbose: bool):
    """`(module, None)`: a kernel built (or found built) by torch's extension loader; `(None, why)` where it cannot be
    had (no compiler, no headers, a build error: the dequantized matmul still works)."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        venv_tools_first()
        flags = ["-O3", "-march=native"]
        return load_extension(name=name, sources=[str(source)], extra_cflags=flags, verbose=verbose), None
    except Exception as e:
        failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("%s projection kernel unavailable (%s); %s weights are dequantized per call", what, failed, what)
        return None, failed


def load(verbose: bool = False):
    """The compiled int8 kernel's module (building it the first time on this machine), or None where it cannot be
    had."""
    global _module, _failed
    if _module is None and _failed is None:
        with _lock:
            if _module is None and _failed is None:
                _module, _failed = _build(NAME, _SOURCE, "int8", verbose)
    return _module


@functools.cache
def kernel_usable() -> bool:
    """Once per process: the int8 kernel is built here, has its vector loops, and agrees with the dequantized
    matmul (odd sizes too, for the scalar tails)."""
    module = load()
    if module is None:
        return False
    if not module.has_avx2():
        log.info("int8 projection kernel built without AVX2; int8 weights are dequantized per call")
        return False
    g = torch.Generator().manual_seed(0)
    for rows, n_in, n_out in ((1, 64, 48), (3, 77, 13), (16, 96, 40)):
        x, w, b = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g), torch.randn(n_out)
        q, scales = quantize(w)
        got = module.int8_linear(x, q, scales, b)
        if not torch.allclose(got, F.linear(x, q.float() * scales[:, None], b), rtol=1e-4, atol=1e-4):
            log.warning("int8 projection kernel disagrees with the dequantized matmul here; it is not used")
            return False
    return True


def load_int4(verbose: bool = False):
    """The compiled int4 kernel's module (building it the first time on this machine), or None where it cannot be
    had."""
    global _int4_module, _int4_failed
    if _int4_module is None and _int4_failed is None:
        with _lock:
            if _int4_module is None and _int4_failed is None:
                _int4_module, _int4_failed = _build(INT4_NAME, _INT4_SOURCE, "int4", verbose)
    return _int4_module


@functools.cache
def int4_kernel_usable() -> bool:
    """Once per process: the int4 kernel is built here, has its vector loops, and agrees with the dequantized matmul
    (several groups, odd row counts, channels past the last tile of 4)."""
    module = load_int4()
    if module is None:
        return False
    if not module.has_avx2():
        log.info("int4 projection kernel built without AVX2; int4 weights are dequantized per call")
        return False
    g = torch.Generator().manual_seed(0)
    for rows, n_in, n_out, group in ((1, 64, 48, 32), (3, 128, 13, 64), (16, 192, 40, 64), (2, 1088, 8, 64)):
        x, w, b = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g), torch.randn(n_out)
        q, scales, mins = quantize_int4(w, group)
        dequantized = unpack_int4(q).float().view(n_out, -1, group) * scales[..., None] + mins[..., None]
        want = F.linear(x, dequantized.view(n_out, n_in), b)
        got = module.int4_linear(x, q, scales, mins, group, b)
        whole = module.int4_dequantize(q, scales, mins, group)
        exact = torch.allclose(whole, dequantized.view(n_out, n_in), rtol=1e-6, atol=1e-6)  # (a fused multiply-add)
        if not exact or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            log.warning("int4 projection kernel disagrees with the dequantized matmul here; it is not used")
            return False
    return True


@functools.cache
def _aten_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per process and dtype: torch's `_weight_int8pack_mm` exists on `device` and agrees with the
    dequantized matmul."""
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(5, 64, generator=g), torch.randn(48, 64, generator=g)
        q, scales = quantize(w)
        x, q, scales = x.to(device, dtype), q.to(device), scales.to(device, dtype)
        got = torch.ops.aten._weight_int8pack_mm(x, q, scales).float()
        want = F.linear(x.float(), q.float() * scales.float()[:, None])
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        log.info("torch's _weight_int8pack_mm unavailable on %s (%s); int8 weights are dequantized per call", device, e)
        return False
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()))


if __name__ == "__main__":
    import sys

    if "--int4" in sys.argv:  # (pylon.ops' pylon_int4_linear)
        mod = load_int4(verbose=True)
        raise SystemExit(0 if mod is not None and int4_kernel_usable() else f"int4 kernel: not built ({_int4_failed})")
    mod = load(verbose=True)
    raise SystemExit(0 if mod is not None and kernel_usable() else f"int8 kernel: not built ({_failed})")
