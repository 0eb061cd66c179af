"""pylon.serving.linear: oneDNN projections over reordered weights, against torch's own."""
import pytest
import torch

from pylon.serving import linear

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not linear.usable(CPU, torch.float32), reason="this torch has no usable oneDNN")


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_linear_over_a_packed_weight_is_addmm(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 256, generator=g), torch.randn(256, 768, generator=g), torch.randn(768, generator=g)
    got = linear.addmm(b, x, linear.pack(w.t()))
    assert got.shape == (rows, 768)
    torch.testing.assert_close(got, torch.addmm(b, x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear.addmm(None, x, linear.pack(w.t())), x @ w, rtol=1e-5, atol=1e-4)


def test_packed_linear_replaces_an_nn_linear() -> None:
    torch.manual_seed(0)
    for bias in (True, False):
        source = torch.nn.Linear(64, 48, bias=bias)
        packed = linear.PackedLinear(source)
        x = torch.randn(2, 5, 64)  # any leading shape, as nn.Linear takes
        with torch.no_grad():
            torch.testing.assert_close(packed(x), source(x), rtol=1e-5, atol=1e-5)
        assert (packed.in_features, packed.out_features) == (64, 48)


def test_only_float32_on_a_cpu_and_not_when_turned_off(monkeypatch) -> None:
    assert not linear.usable(CPU, torch.bfloat16)
    assert not linear.usable(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("PYLON_ONEDNN_LINEAR", "0")
    assert not linear.usable(CPU, torch.float32)
