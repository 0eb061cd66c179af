"""pylon.serving.model.quant: weight-only int8 and int4 projections against the float ones (int4's packing, groups
and a 4-bit checkpoint's grid found again), the spec field, fp8's refusal off a capable GPU, and the planner's
smaller weights."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import GPT2Config
from transformers.pytorch_utils import Conv1D

from pylon.errors import PylonError
from pylon.plan.serve import plan_serve
from pylon.serving.model import quant
from pylon.specs import DeploymentSpec, EngineSpec

CPU = torch.device("cpu")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
def test_int8_projection_is_close_to_the_float_one(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 768, generator=g), torch.randn(2304, 768, generator=g) * 0.02, torch.randn(2304)
    q = quant.QuantWeight(w)
    assert q.q.dtype == torch.int8 and q.q.shape == (2304, 768) and q.scales.shape == (2304,)
    assert q.nbytes == 2304 * 768 + 2304 * 4  # a quarter of float32's bytes, and the scales
    got = quant.addmm(b, x, q)
    assert got.shape == (rows, 2304)
    # Exactly the matmul over the dequantized weight (the kernel or the fallback), up to float rounding ...
    torch.testing.assert_close(got, F.linear(x, q.dequantized(torch.float32), b), rtol=1e-4, atol=1e-4)
    # ... and within int8's rounding of the float weight: ~0.5/127 of a channel's largest weight per weight.
    assert _relative_error(got - b, x @ w.t()) < 0.01
    assert _relative_error(quant.addmm(None, x, q), x @ w.t()) < 0.01


def test_the_cpu_kernel_is_built_and_used_here() -> None:
    """On this x86 machine with a compiler, float32 int8 projections go through Pylon's kernel, not the fallback."""
    assert quant.kernel_usable(), f"int8 kernel unavailable: {quant._failed}"
    w = torch.randn(48, 64)
    assert quant.QuantWeight(w).kernel
    assert not quant.QuantWeight(w.bfloat16()).kernel  # bf16 on a CPU: the dequantized matmul
    x = torch.randn(3, 64).bfloat16()
    q = quant.QuantWeight(w.bfloat16())
    assert _relative_error(quant.addmm(None, x, q).float(), x.float() @ w.t()) < 0.02


def test_quantization_rounds_each_channel_to_its_own_scale() -> None:
    w = torch.tensor([[1.0, -0.4, 0.25], [100.0, 40.0, -100.0], [0.0, 0.0, 0.0]])
    q, scales = quant.quantize(w)
    assert q.tolist() == [[127, -51, 32], [127, 51, -127], [0, 0, 0]]  # symmetric, per output channel
    torch.testing.assert_close(scales[:2], torch.tensor([1 / 127, 100 / 127]))
    assert torch.isfinite(q.float() * scales[:, None]).all()  # an all-zero channel stays zeros


def test_quant_linear_replaces_an_nn_linear_and_keeps_no_float_weight() -> None:
    torch.manual_seed(0)
    for bias in (True, False):
        source = torch.nn.Linear(64, 48, bias=bias)
        layer = quant.QuantLinear(source)
        x = torch.randn(2, 5, 64)
        with torch.no_grad():
            assert _relative_error(layer(x), source(x)) < 0.01
        assert not any(
            p.dtype == torch.float32 and p.shape == (48, 64) for p in vars(layer).values() if torch.is_tensor(p)
        )
        assert (layer.in_features, layer.out_features) == (64, 48)


def test_a_gpt2_conv1d_quantizes_from_its_transposed_weight() -> None:
    torch.manual_seed(0)
    conv = Conv1D(96, 64)  # weight [in, out]
    q = quant.QuantWeight(conv.weight.detach().t())
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert _relative_error(quant.addmm(conv.bias, x, q), conv(x)) < 0.01


def test_the_spec_field_takes_none_int8_fp8_int4_only() -> None:
    assert EngineSpec().quantization == "none"
    assert EngineSpec(quantization="int8").quantization == "int8"
    assert EngineSpec(quantization="int4").quantization == "int4"
    with pytest.raises(ValidationError) as e:
        DeploymentSpec(name="q", model="/m", engine={"quantization": "int2"})
    assert "engine.quantization" in str(e.value) or "quantization" in str(e.value)
    assert "int2" in str(e.value)


def test_fp8_is_refused_on_a_cpu_naming_the_field_and_what_to_do() -> None:
    with pytest.raises(PylonError, match=r"engine\.quantization: fp8 .*compute capability 8\.9.*use int8"):
        quant.check("fp8", CPU)
    quant.check("int8", CPU)
    quant.check("none", CPU)
    quant.check("int4", CPU)
    with pytest.raises(PylonError, match=r"engine\.quantization: must be one of none, int8, fp8, int4"):
        quant.check("int2", CPU)


def test_the_planner_counts_int8_projections_at_one_byte(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))

    def weights(**engine) -> int:
        spec = DeploymentSpec(
            name="q", model=str(tmp_path), replica={"num_gpus": 1}, engine={"device": "cuda", "dtype": "bf16", **engine}
        )
        return next(r for r in plan_serve(spec).rows if r.accelerator.name == "H100-SXM").weights

    bf16, int8 = weights(), weights(quantization="int8")
    projections = 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    channels = 12 * (3 * 768 + 768 + 3072 + 768)
    assert bf16 - int8 == projections * (2 - 1) - channels * 4
    assert weights(quantization="fp8") == int8
    assert weights(dtype="fp32") - weights(dtype="fp32", quantization="int8") == projections * 3 - channels * 4
    # int4: half a byte a weight and a float32 scale and min per group of 64 inputs, no scale per channel
    assert bf16 - weights(quantization="int4") == int(projections * (2 - 0.5 - 8 / 64))


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 200])  # (decodes, the tiles' dot products, a prompt chunk's matmul)
def test_int4_projection_is_the_matmul_over_its_dequantized_weight(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 768, generator=g), torch.randn(2306, 768, generator=g) * 0.02, torch.randn(2306)
    q = quant.QuantWeight(w, "int4")
    assert q.q.dtype == torch.uint8 and q.q.shape == (2306, 384) and q.scales.shape == q.mins.shape == (2306, 12)
    assert q.nbytes == 2306 * 384 + 2 * 2306 * 12 * 4  # half a byte a weight, a scale and a min per 64 inputs
    assert q.int4_kernel, f"int4 kernel unavailable: {quant._int4_failed}"  # (x86 with a compiler: the kernel)
    got = quant.addmm(b, x, q)
    # exactly the matmul over the dequantized weight (2306 channels: the kernel's scalar tail too) ...
    torch.testing.assert_close(got, F.linear(x, q.dequantized(torch.float32), b), rtol=1e-4, atol=1e-4)
    # ... and within 4-bit rounding of the float weight (a step is 1/15 of its group's range)
    assert _relative_error(got - b, x @ w.t()) < 0.15


def test_int4_packs_two_inputs_a_byte_and_rounds_each_group_to_its_own_range() -> None:
    w = torch.zeros(2, 64)
    w[0, 0], w[0, 16], w[0, 31] = 1.0, 0.5, -1.0  # first group: levels of 0.5 from -1
    w[0, 32:] = torch.linspace(0, 3, 32)  # second group: 0..3, not a grid of 16 levels: (max - min) / 15
    w[1] = 7.0  # one value: a range of nothing
    q, scales, mins = quant.quantize_int4(w, 32)
    ints = quant.unpack_int4(q)
    assert q[0, 0].item() == 4 | (3 << 4)  # input 0 in the low nibble of byte 0, input 16 in the high one
    assert ints[0, [0, 16, 31, 1]].tolist() == [4, 3, 0, 2] and scales[0, 0].item() == 0.5 and mins[0, 0] == -1
    torch.testing.assert_close(scales[0, 1], torch.tensor(3 / 15))
    assert ints[0, 32].item() == 0 and ints[0, 63].item() == 15
    assert mins[1].tolist() == [7.0, 7.0] and ints[1].eq(0).all()
    weight = quant.QuantWeight(w, "int4")
    assert weight.group == 64  # (INT4_GROUP where it divides the inputs)
    assert (weight.dequantized(torch.float32)[1] == 7.0).all()


def test_a_4bit_checkpoints_grid_is_found_again_in_its_own_groups() -> None:
    """Weights that sit on a 4-bit grid (a GPTQ, AWQ or W4A16 checkpoint's, read dequantized) in groups of 128 come
    back exactly, even where a group's ints do not reach both 0 and 15 (its step is the checkpoint's scale)."""
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(0, 14, (48, 256), generator=g)  # (never 14 or 15: (max - min) / 15 would be wrong)
    ints[:, ::128] = 0
    ints[:, 1::128] = 1
    scale, zero = torch.rand(48, 2, generator=g) * 0.01 + 1e-3, torch.randint(0, 16, (48, 2), generator=g)
    w = ((ints.view(48, 2, 128) - zero[..., None]).float() * scale[..., None]).view(48, 256)
    weight = quant.QuantWeight(w, "int4", group=128)
    assert weight.group == 128
    torch.testing.assert_close(weight.dequantized(torch.float32), w, rtol=0, atol=1e-6)
    torch.testing.assert_close(weight.scales, scale, rtol=1e-5, atol=0)
    # in groups of 64 instead the grid is found as well (each half of a group is on it); random floats are not
    torch.testing.assert_close(quant.QuantWeight(w, "int4").dequantized(torch.float32), w, rtol=0, atol=1e-6)
    noisy = w + torch.randn(48, 256, generator=g) * 1e-3
    assert (quant.QuantWeight(noisy, "int4", group=128).dequantized(torch.float32) - noisy).abs().max() > 1e-4


def test_int4_inputs_no_multiple_of_32_are_padded_and_dequantized_per_call() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 344, generator=g), torch.randn(64, 344, generator=g)
    weight = quant.QuantWeight(w, "int4")
    assert weight.group is None and not weight.int4_kernel and weight.q.shape == (64, 176)  # (352 inputs, padded)
    got = quant.addmm(None, x, weight)
    torch.testing.assert_close(got, x @ weight.dequantized(torch.float32).t(), rtol=1e-4, atol=1e-4)
    assert _relative_error(got, x @ w.t()) < 0.2  # (one group of 344: a coarser grid)
