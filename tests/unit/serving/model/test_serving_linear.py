"""pylon.serving.model.linear: oneDNN projections over reordered weights, against torch's own."""

import pytest
import torch

from pylon.serving.model import linear

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


def test_padded_rows_are_few_sizes_and_never_far_above_the_count() -> None:
    sizes = {linear.padded_rows(n) for n in range(1, 8193)}
    assert all(0 <= linear.padded_rows(n) - n < max(16, n / 16) for n in range(1, 8193))
    assert len(sizes) == 32 + 4 * 16  # multiples of 16 up to 512, then 16 sizes per doubling up to 8192
    assert [linear.padded_rows(n) for n in (1, 16, 17, 512, 513, 1025)] == [16, 16, 32, 512, 544, 1088]
    counts = linear.row_counts(8, 100)
    assert counts == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64, 80, 96, 112]  # decodes exactly; the rest padded


def test_warm_up_stays_within_onednns_cache(tmp_path, monkeypatch, caplog) -> None:
    """Compiling more kernels than oneDNN's cache keeps would evict the first ones again: the warm-up stops at the
    cache's capacity and says how to raise it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.serving.model.runner import ModelRunner

    monkeypatch.delenv("PYLON_PADDED_ROWS", raising=False)
    config = AutoConfig.for_model("gpt2", n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path), num_blocks=8, block_size=16)
    assert runner.pad_rows
    assert runner.warm_up(4, 64) == (8, 8)  # 1-4 rows, then 16, 32, 48, 64
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "40")  # 5 row counts of 4 kernels, 2 entries each
    with caplog.at_level("WARNING"):
        assert runner.warm_up(4, 64) == (5, 8)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY=64" in caplog.text
    monkeypatch.setenv("PYLON_PADDED_ROWS", "0")
    assert ModelRunner(str(tmp_path), num_blocks=8, block_size=16).warm_up(4, 64) == (0, 0)
