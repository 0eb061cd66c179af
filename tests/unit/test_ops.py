"""pylon.ops: the architecture list DeepSpeed's just-in-time builders read."""

from __future__ import annotations

import pytest

from pylon.ops import plain_cuda_arch_list


def _deepspeed_arch_list(arch_list: str) -> str:
    """The architectures DeepSpeed's fused Adam builder has torch compile for, given TORCH_CUDA_ARCH_LIST (in JIT
    mode it writes them back to the variable for torch to read; no GPU needed)."""
    import os

    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder._jit_arch_list = arch_list
    assert builder.compute_capability_args() == []
    return os.environ["TORCH_CUDA_ARCH_LIST"]


@pytest.mark.parametrize(
    ("given", "plain"),
    [
        ("9.0a", "9.0"),
        ("8.0;8.6;9.0a;10.0f+PTX", "8.0;8.6;9.0;10.0+PTX"),
        ("9.0 9.0a", "9.0"),
        ("8.0 8.6", None),
        ("9.0+PTX", None),
        ("", None),
    ],
)
def test_suffixed_architectures_become_plain_ones(given, plain):
    env = {"TORCH_CUDA_ARCH_LIST": given}
    assert plain_cuda_arch_list(env) == plain
    assert env["TORCH_CUDA_ARCH_LIST"] == (plain if plain is not None else given)


def test_deepspeed_builds_for_the_list_it_could_not_read(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="0a"):  # what a CUDA image's "9.0a" did to fused Adam on an H200
        _deepspeed_arch_list("8.0;9.0a")
    assert plain_cuda_arch_list() == "8.0;9.0"
    assert _deepspeed_arch_list("8.0;9.0") == "8.0;9.0+PTX"
