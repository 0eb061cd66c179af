"""Quantized checkpoints read dequantized, by slice: the projection weights of a checkpoint published quantized, each
read as the float weight it stands for, into the engine's dtype (engine.quantization may quantize them again, per
output channel).

Two layouts, the ones most large models and most vLLM-ready checkpoints ship in:

- `fp8` with a `weight_block_size` (DeepSeek-V3's, R1's and Kimi K2's releases, Qwen3's and GLM-4.5's "-FP8"): each
  weight float8 (e4m3), one float32 scale a `[128, 128]` block (`weight_scale_inv`, `[ceil(rows / 128), ceil(columns
  / 128)]`), the weight being each element times its block's scale. A dimension that is no multiple of the block ends
  in a partial block (DeepSeek-V3's 576-row latent projection), which transformers' own dequantization refuses.
- `compressed-tensors` (llm-compressor's, vLLM's own format: the "-FP8-dynamic", "-W8A8" and "-W4A16" releases): each
  weight float8 or int8 (`float-quantized`, `int-quantized`, `naive-quantized`), or ints of 4 bits and under packed
  eight to an int32 along the columns (`pack-quantized`: `weight_packed`, its unpacked shape in `weight_shape`, stored
  unsigned with an offset of half their range), and `weight_scale` per tensor (`[1]`), per output channel (`[rows,
  1]`), per group of columns (`[rows, columns / group]`) or per block (`[rows / b, columns / b]`), with an optional
  `weight_zero_point` of the same shape (asymmetric ints): the weight is (q - zero point) x scale. The activations'
  quantization the checkpoint asks for (W8A8's) is not applied: activations stay in the engine's dtype.

- `gptq` (AutoGPTQ's and GPTQModel's: the "-GPTQ-Int4" and "-GPTQ-Int8" releases): a projection `X` stored
  transposed, `X.qweight` `[in / (32 / bits), out]` ints of 2, 4 or 8 bits packed along the inputs (input row
  `p x per + i` at bits `bits x i` of int32 row `p`), `X.scales` `[groups, out]`, `X.qzeros` `[groups, out / per]`
  packed along the outputs, and `X.g_idx` `[in]`, each input row's group (activation order, `desc_act`, permutes
  them; without it, row // group_size). The weight is (q - zero) x scale of its row's group, the zero stored one less
  (`checkpoint_format: gptq`, AutoGPTQ's) or as it is (`gptq_v2`, GPTQModel's).
- `awq` (AutoAWQ's GEMM layout: the "-AWQ" releases): `X.qweight` `[in, out / 8]` 4-bit ints packed along the outputs
  in AWQ's interleaved order (output column `8p + j` at nibble `[0, 4, 1, 5, 2, 6, 3, 7][j]`), `X.qzeros` `[groups,
  out / 8]` packed alike, `X.scales` `[groups, out]`, groups of group_size input rows: (q - zero) x scale.

`Dequantized` and `GroupPacked` read a slice of such a weight: the slice's elements (the packed ints holding it), the
scales and zero points of its blocks, nothing else of the tensor, so that a tensor-parallel shard
(pylon.serving.model.tensor) reads its slice of each quantized weight as it reads a float one's. Other quantized
checkpoints (MXFP4, AWQ's GEMV layouts, Marlin's, compressed-tensors' sparse or NVFP4 formats, its activation-ordered
groups) are refused by name (`unreadable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pylon.errors import PylonError

# compressed-tensors' formats read here: the weights as ints or floats of 8 bits, or ints packed into int32 columns
_COMPRESSED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class Stored:
    """How a checkpoint's quantized weights are laid out: `method` (`fp8`: DeepSeek's block FP8; `compressed-tensors`),
    the suffix of a weight's scale after the weight's name (`X.weight_scale_inv`, `X.weight_scale`), fp8's block (or
    compressed-tensors' `block_structure`; None: each tensor's grid from its scale's shape), and the bits of packed
    ints (pack-quantized), and the columns of a group (group strategy)."""

    method: str
    scale: str
    block: tuple[int, int] | None = None
    bits: int = 8
    group: int | None = None  # compressed-tensors', GPTQ's and AWQ's group_size (the last group partial)
    zero_offset: int = 0  # added to the stored zero points (GPTQ's `checkpoint_format: gptq` stores them one less)

    def describe(self) -> str:
        if self.method == "fp8":
            return f"FP8 in blocks of {self.block[0]}x{self.block[1]}"
        if self.method in _GROUP_PACKED:
            groups = f"groups of {self.group}" if self.group else "one group a column"
            return f"{_GROUP_PACKED[self.method]} ({self.bits}-bit weights, {groups})"
        return f"compressed-tensors ({self.bits}-bit weights)"


# GPTQ's and AWQ's layouts (quant_method -> its name in messages), and the bits each packs
_GROUP_PACKED = {"gptq": "GPTQ", "awq": "AWQ"}
_GROUP_PACKED_BITS = {"gptq": (2, 4, 8), "awq": (4,)}
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its stored zero points are short of
# AWQ's GEMM packing: output column 8p + j of int32 p at nibble AWQ_NIBBLE[j] (its pack order [0, 2, 4, 6, 1, 3, 5, 7])
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def _config_dict(config) -> dict:
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None and not isinstance(quantized, dict):
        quantized = quantized.to_dict()
    return quantized or {}


def _weight_args(quantized: dict) -> list[dict]:
    return [g.get("weights") or {} for g in (quantized.get("config_groups") or {}).values()]


def unreadable(config) -> str | None:
    """Why `config`'s quantized checkpoint is not read here (None: it is, or it is not quantized)."""
    quantized = _config_dict(config)
    method = quantized.get("quant_method")
    if not quantized:
        return None
    if method == "fp8":
        block = quantized.get("weight_block_size")
        return None if block and len(block) == 2 else "its FP8 checkpoint has no weight_block_size"
    if method in _GROUP_PACKED:
        name, bits = _GROUP_PACKED[method], _bits(quantized)
        if bits not in _GROUP_PACKED_BITS[method]:
            read = ", ".join(map(str, _GROUP_PACKED_BITS[method]))
            return f"its {name} weights are {bits}-bit (read: {read})"
        if method == "gptq" and quantized.get("checkpoint_format", "gptq") not in _GPTQ_FORMATS:
            form = quantized["checkpoint_format"]
            return f"its GPTQ checkpoint_format {form!r} is not read (read: {', '.join(_GPTQ_FORMATS)})"
        version = str(quantized.get("version", "gemm")).lower()
        if method == "awq" and version != "gemm":
            return f"its AWQ version {version!r} is not read (read: gemm, AutoAWQ's default)"
        if method == "awq" and quantized.get("zero_point") is False:
            return "its AWQ weights have no zero points (zero_point: false)"
        return None
    if method != "compressed-tensors":
        return f"its checkpoint is quantized ({method or '?'})"
    form = quantized.get("format")
    if form not in _COMPRESSED_FORMATS:
        read = ", ".join(_COMPRESSED_FORMATS)
        return f"its compressed-tensors checkpoint's format {form!r} is not read (the formats read: {read})"
    if quantized.get("sparsity_config"):
        return "its compressed-tensors checkpoint is sparse (sparsity_config)"
    weights = _weight_args(quantized)
    if not weights:
        return "its compressed-tensors checkpoint has no config_groups with weights"
    for args in weights:
        if args.get("actorder") not in (None, False, "static"):
            return f"its compressed-tensors weights are activation-ordered (actorder {args['actorder']!r})"
        if form == "pack-quantized" and not args.get("symmetric", True):
            return "its pack-quantized weights are asymmetric (packed zero points)"
    if len({int(args.get("num_bits", 8)) for args in weights}) > 1 and form == "pack-quantized":
        return "its pack-quantized groups have different num_bits"
    return None


def checkpoint_quantization(config) -> Stored | None:
    """How `config`'s checkpoint stores its quantized weights, where they are read here (`unreadable` is None); None
    for a float checkpoint, or one not read here."""
    quantized = _config_dict(config)
    if not quantized or unreadable(config) is not None:
        return None
    if quantized["quant_method"] == "fp8":
        block = quantized["weight_block_size"]
        return Stored("fp8", "_scale_inv", (int(block[0]), int(block[1])))
    if quantized["quant_method"] in _GROUP_PACKED:
        group = int(quantized.get("group_size", quantized.get("q_group_size", 128)))
        offset = _GPTQ_FORMATS[quantized.get("checkpoint_format", "gptq")] if quantized["quant_method"] == "gptq" else 0
        return Stored(
            quantized["quant_method"], ".scales", None, _bits(quantized), group if group > 0 else None, offset
        )
    weights = _weight_args(quantized)
    blocks = {tuple(a["block_structure"]) for a in weights if a.get("block_structure")}
    block = next(iter(blocks)) if len(blocks) == 1 else None
    bits = int(weights[0].get("num_bits", 8)) if quantized.get("format") == "pack-quantized" else 8
    groups = {int(a["group_size"]) for a in weights if a.get("group_size")}
    return Stored("compressed-tensors", "_scale", block, bits, next(iter(groups)) if len(groups) == 1 else None)


def _bits(quantized: dict) -> int:
    return int(quantized.get("bits", quantized.get("w_bit", 4)))


def stored_name(name: str, files) -> str | None:
    """The checkpoint's tensor that holds the model's tensor `name`: itself, or its packed ints (`X.weight_packed`,
    compressed-tensors'; `X.qweight`, GPTQ's and AWQ's); None where none is there."""
    if name in files:
        return name
    if not name.endswith(".weight"):
        return None
    for packed in (f"{name}_packed", f"{name.removesuffix('weight')}qweight"):
        if packed in files:
            return packed
    return None


def _rows_columns(index, shape: list[int], name: str) -> tuple[int, int, int, int]:
    """`r0, r1, c0, c1` of a slice index into a 2-D quantized weight of `shape` (contiguous slices only)."""
    index = (index if isinstance(index, tuple) else (index,)) + (slice(None),) * 2
    (r0, r1, rs), (c0, c1, cs) = (i.indices(n) for i, n in zip(index[:2], shape))
    if rs != 1 or cs != 1:
        raise PylonError(f"{name}: a quantized weight is read by contiguous slices")
    return r0, max(r0, r1), c0, max(c0, c1)


def _grid(scale: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`scale` as the 2-D grid of its blocks: a per-tensor scale `[1, 1]`, a per-channel one `[rows, 1]`."""
    if scale.dim() == 2:
        return scale
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() == 1 and scale.numel() == shape[0]:
        return scale.reshape(-1, 1)
    return scale


class Dequantized:
    """A quantized weight (`Stored`'s layout) read by slice as the float32 weight it stands for: the slice's elements
    times the scales of their blocks (less their zero points), reading only what the slice needs of the weight.
    `weight`: the checkpoint's slice view of the weight (or of its packed ints); `scale` and `zero`: the whole scale
    and zero point tensors (small); `shape`: a packed weight's unpacked shape."""

    def __init__(
        self,
        name: str,
        weight,
        scale: torch.Tensor,
        stored: Stored,
        zero: torch.Tensor | None = None,
        shape: list[int] | None = None,
    ):
        self.name, self.weight, self.stored, self.packed = name, weight, stored, shape is not None
        self.shape = [int(n) for n in shape] if shape is not None else list(weight.get_shape())
        if len(self.shape) != 2:
            raise PylonError(
                f"{name}: a quantized weight of shape {self.shape} is read as a 2-D projection's only (fused experts' "
                "are not): save the model dequantized"
            )
        rows, cols = self.shape
        self.scale = _grid(scale.to(torch.float32), self.shape)
        self.zero = _grid(zero.to(torch.float32), self.shape) if zero is not None else None
        grid = list(self.scale.shape)
        group = stored.group if stored.group and grid == [rows, -(-cols // stored.group)] else None
        block = stored.block or ((1, group) if group else (-(-rows // grid[0]), -(-cols // grid[1])))
        want = [-(-rows // block[0]), -(-cols // block[1])]
        if grid != want or (self.zero is not None and list(self.zero.shape) != grid):
            raise PylonError(
                f"{name}: its scales' shape {grid} is not the {want} blocks of {list(block)} that its shape "
                f"{self.shape} holds (quantization_config)"
            )
        self.block = block

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _values(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """The stored values of rows `r0:r1`, columns `c0:c1`, as float32 (packed ints unpacked, their offset off)."""
        if not self.packed:
            return self.weight[r0:r1, c0:c1].to(torch.float32)
        bits = self.stored.bits
        per = 32 // bits
        values = _unpack(self.weight[r0:r1, c0 // per : -(-c1 // per)], bits, 1)  # column 8p + i at bits 4i
        return values[:, c0 - c0 // per * per :][:, : c1 - c0].to(torch.float32) - (1 << (bits - 1))

    def __getitem__(self, index) -> torch.Tensor:
        r0, r1, c0, c1 = _rows_columns(index, self.shape, self.name)
        bm, bn = self.block

        def spread(grid: torch.Tensor) -> torch.Tensor:  # each element's block's value, over the slice
            g = grid[r0 // bm : -(-r1 // bm), c0 // bn : -(-c1 // bn)]
            g = g.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
            return g[r0 - r0 // bm * bm :][: r1 - r0, c0 - c0 // bn * bn :][:, : c1 - c0]

        values = self._values(r0, r1, c0, c1)
        if self.zero is not None:
            values = values - spread(self.zero)
        return values * spread(self.scale)


def _unpack(packed: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Ints of `bits` packed `32 // bits` to an int32 along `dim` (0 or 1) of a 2-D tensor, unpacked in place of it
    (int64): value i of each int32 at bits `bits x i`, or at the nibble `order[i]` (AWQ's)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[list(order)]
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [k, per, columns]
        return values.reshape(-1, packed.shape[1]).to(torch.int64)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, k, per]
    return values.reshape(packed.shape[0], -1).to(torch.int64)


class GroupPacked:
    """A GPTQ or AWQ projection (`Stored` method `gptq`, `awq`) read by slice as the float32 weight `[out, in]` it
    stands for: the packed ints holding the slice, unpacked, less their group's zero point, times its scale.
    `qweight`: the checkpoint's slice view of the packed weight; `scales`, `qzeros`, `g_idx`: whole (small)."""

    def __init__(self, name: str, qweight, scales: torch.Tensor, stored: Stored, qzeros=None, g_idx=None):
        self.name, self.qweight, self.stored = name, qweight, stored
        bits = stored.bits
        self.per = per = 32 // bits
        rows, cols = qweight.get_shape()
        self.gptq = stored.method == "gptq"
        inputs, outputs = (rows * per, cols) if self.gptq else (rows, cols * per)
        self.shape = [outputs, inputs]
        what = _GROUP_PACKED[stored.method]
        self.scales = scales.to(torch.float32)
        groups = self.scales.shape[0]
        if self.scales.dim() != 2 or self.scales.shape[1] != outputs:
            raise PylonError(
                f"{name}: its {what} scales' shape {list(self.scales.shape)} is not [groups, {outputs}] for a qweight "
                f"of shape {[rows, cols]} (quantization_config bits {bits})"
            )
        if g_idx is not None and self.gptq:
            self.groups = g_idx.to(torch.int64)
            if self.groups.numel() != inputs or int(self.groups.max()) >= groups or int(self.groups.min()) < 0:
                raise PylonError(f"{name}: its g_idx is not one group of {groups} for each of its {inputs} input rows")
        else:
            size = stored.group or inputs
            if groups != -(-inputs // size):
                raise PylonError(
                    f"{name}: its {what} scales hold {groups} groups, not the {-(-inputs // size)} groups of {size} of "
                    f"its {inputs} input rows (quantization_config group_size)"
                )
            self.groups = torch.arange(inputs) // size
        if qzeros is None:  # (symmetric: the middle of the range)
            self.zeros = torch.full((groups, outputs), float(1 << (bits - 1)))
        else:
            zeros = _unpack(qzeros.to(torch.int32), bits, 1, None if self.gptq else AWQ_NIBBLE)
            if list(zeros.shape) != [groups, outputs]:
                raise PylonError(
                    f"{name}: its {what} qzeros' shape {list(qzeros.shape)} does not hold [{groups}, {outputs}] "
                    "zero points"
                )
            self.zeros = zeros.to(torch.float32) + stored.zero_offset

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        r0, r1, c0, c1 = _rows_columns(index, self.shape, self.name)
        per = self.per
        if self.gptq:  # packed along the inputs: the int32 rows holding inputs c0:c1, outputs r0:r1
            q = _unpack(self.qweight[c0 // per : -(-c1 // per), r0:r1], self.stored.bits, 0)
            q = q[c0 - c0 // per * per :][: c1 - c0]
        else:  # packed along the outputs (AWQ's order): inputs c0:c1, the int32 columns holding outputs r0:r1
            q = _unpack(self.qweight[c0:c1, r0 // per : -(-r1 // per)], self.stored.bits, 1, AWQ_NIBBLE)
            q = q[:, r0 - r0 // per * per :][:, : r1 - r0]
        groups = self.groups[c0:c1]
        weight = (q.to(torch.float32) - self.zeros[groups, r0:r1]) * self.scales[groups, r0:r1]  # [in, out]
        return weight.t().contiguous()


def open_stored(name: str, tensor, read, stored: Stored | None, files):
    """The checkpoint's tensor `name` (its slice view `tensor`; `read(other)`: another tensor of the checkpoint, whole)
    as the engine reads it: a quantized weight (its scale beside it in `files`) as `Dequantized` (GPTQ's and AWQ's as
    `GroupPacked`), else as it is."""
    if stored is not None and stored.method in _GROUP_PACKED:
        if not name.endswith(".qweight"):
            return tensor
        base = name.removesuffix("qweight")
        if f"{base}scales" not in files:
            raise PylonError(f"{name}: its scales ({base}scales) are not in the checkpoint")
        zeros, order = f"{base}qzeros", f"{base}g_idx"
        return GroupPacked(
            f"{base}weight",
            tensor,
            read(f"{base}scales"),
            stored,
            read(zeros) if zeros in files else None,
            read(order) if order in files else None,
        )
    if stored is None or not name.endswith((".weight", ".weight_packed")):
        return tensor
    weight = name.removesuffix("_packed")
    scale = f"{weight}{stored.scale}"
    if scale not in files:
        return tensor
    if f"{weight}_g_idx" in files:
        raise PylonError(f"{weight}: its groups are activation-ordered (weight_g_idx), which is not read")
    zero = f"{weight}_zero_point"
    shape = read(f"{weight}_shape").tolist() if name.endswith("_packed") else None
    return Dequantized(weight, tensor, read(scale), stored, read(zero) if zero in files else None, shape)
