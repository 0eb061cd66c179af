"""pylon.serving.model.quant: weight-only int8 projections against the float ones, the spec field, fp8's refusal
off a capable GPU, and the planner's smaller weights."""

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


def test_the_spec_field_takes_none_int8_fp8_only() -> None:
    assert EngineSpec().quantization == "none"
    assert EngineSpec(quantization="int8").quantization == "int8"
    with pytest.raises(ValidationError) as e:
        DeploymentSpec(name="q", model="/m", engine={"quantization": "int4"})
    assert "engine.quantization" in str(e.value) or "quantization" in str(e.value)
    assert "int4" in str(e.value)


def test_fp8_is_refused_on_a_cpu_naming_the_field_and_what_to_do() -> None:
    with pytest.raises(PylonError, match=r"engine\.quantization: fp8 .*compute capability 8\.9.*use int8"):
        quant.check("fp8", CPU)
    quant.check("int8", CPU)
    quant.check("none", CPU)
    with pytest.raises(PylonError, match=r"engine\.quantization: must be one of none, int8, fp8"):
        quant.check("int4", CPU)


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
