"""Quantized checkpoints (pylon.serving.model.stored): block FP8 (quant_method fp8 with a weight_block_size:
DeepSeek-V3's, Kimi K2's, the "-FP8" releases) and compressed-tensors' FP8, INT8 and packed INT4 ("-FP8-dynamic",
"-W8A8", "-W4A16"): the engine reads each weight as its scales (less its zero points) make it, partial edge blocks and
groups included (which transformers' own FP8 dequantization refuses), so it serves what the dequantized model
computes; tensor-parallel shards and pipeline stages read their slices of them."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_models import PROMPTS, QUANTIZED, Family, hf_greedy, save_quantized
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence
from pylon.serving.model.tensor import Shard, load_shard, refused


def _dequantized_copy(source: str, directory, dequantized: dict[str, torch.Tensor]) -> str:
    """The float export `source` with each quantized weight replaced by its dequantized value: the model the FP8
    checkpoint holds, loaded the ordinary way."""
    shutil.copytree(source, directory)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({k: dequantized.get(k, v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return str(directory)


def _logits(runner: ModelRunner, prompt: list[int]) -> list[torch.Tensor]:
    """A prompt in two chunks, then 4 greedy decodes: every step's logits."""
    table, tokens = [0, 1, 2, 3], list(prompt)
    out = [runner.execute([StepSequence(prompt[:24], 0, table, samples=False)])]
    out.append(runner.execute([StepSequence(prompt[24:], 24, table, samples=True)]))
    for _ in range(4):
        tokens.append(int(out[-1][-1].argmax()))
        out.append(runner.execute([StepSequence([tokens[-1]], len(tokens) - 1, table, samples=True)]))
    return out


# Llama (its 344-wide MLP: 10 blocks or groups of 32 and one of 24) in each layout; DeepSeek-V3 (its 48-row latent
# projection, 1.5 blocks; its 48-wide q_b_proj inputs, 1.5 groups; its experts stored one by one, fused at load; its
# router in float, as the releases keep it) in block FP8 and packed INT4.
@pytest.mark.parametrize(
    "name,scheme",
    [*(("llama", s) for s in QUANTIZED), *(("deepseek_v3", s) for s in ("fp8-block", "w4a16", "gptq", "awq"))],
)
def test_a_quantized_checkpoint_is_served_as_its_dequantized_weights(name, scheme, tmp_path):
    family = Family(name, tmp_path / name, greedy=False)
    dequantized = save_quantized(family.dir, tmp_path / "fp8", scheme, block=32)
    assert any(w.shape[0] % 32 or w.shape[1] % 32 for w in dequantized.values())  # (partial edge blocks, groups)
    reference = _dequantized_copy(family.dir, tmp_path / "reference", dequantized)
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    assert refused(name, config, 2) is None  # (its shards read their slices of the blocks: below)
    fp8 = ModelRunner(str(tmp_path / "fp8"), num_blocks=32, block_size=16, dtype="fp32", device="cpu")
    method = {"fp8-block": "fp8", "gptq-int8": "gptq"}.get(scheme, scheme if scheme in ("gptq", "awq") else None)
    assert fp8.stored.method == (method or "compressed-tensors")
    assert fp8.stored.bits == (4 if scheme in ("w4a16", "gptq", "awq") else 8)
    whole = ModelRunner(reference, num_blocks=32, block_size=16, dtype="fp32", device="cpu")
    served = _logits(fp8, PROMPTS[2])
    for got, want in zip(served, _logits(whole, PROMPTS[2])):
        # (float32 rounding: the same weights, loaded by another path, sit elsewhere in memory)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # transformers' greedy tokens from the dequantized model
    dequantized_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    assert [int(x[-1].argmax()) for x in served[1:]] == hf_greedy(dequantized_model, PROMPTS[2], 5)
    # (and the quantization is there: the float model's logits are off by far more than rounding)
    original = ModelRunner(family.dir, num_blocks=32, block_size=16, dtype="fp32", device="cpu")
    assert float((_logits(original, PROMPTS[2])[1] - served[1]).abs().max()) > 1e-2


@pytest.mark.parametrize("scheme", ["fp8-block", "w4a16", "gptq", "awq"])
def test_shards_read_their_slices_of_the_blocks(scheme, tmp_path):
    """Two shards of a DeepSeek-V3 quantized checkpoint: each one's heads of q_b_proj, its columns of o_proj (a slice
    starting mid-block: 48 of the 96 columns of 2 heads' 24-wide values, blocks or groups of 32), its slice of each
    expert's gate, up and down (packed INT4: the second shard's down_proj columns start mid-int32, 16 of 32 in 4 ints
    of 8; GPTQ's are its inputs, packed down the int32 rows, in activation-ordered groups; AWQ's gate and up rows are
    its outputs, packed in AWQ's order): the dequantized whole's, exactly."""
    family = Family("deepseek_v3", tmp_path / "v3", greedy=False)
    dequantized = save_quantized(family.dir, tmp_path / "fp8", scheme, block=32)
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    whole = load_shard(str(tmp_path / "fp8"), config, torch.float32, Shard(0, 1)).state_dict()
    for key, w in dequantized.items():
        if key in whole:
            assert torch.equal(whole[key], w), key
    experts = "model.layers.1.mlp.experts"
    gate_up = torch.stack(
        [torch.cat([dequantized[f"{experts}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(8)]
    )
    assert torch.equal(whole[f"{experts}.gate_up_proj"], gate_up)
    width = config.moe_intermediate_size // 2
    for r in range(2):
        shard = load_shard(str(tmp_path / "fp8"), config, torch.float32, Shard(r, 2)).state_dict()
        o = whole["model.layers.0.self_attn.o_proj.weight"]
        half = o.shape[1] // 2
        assert torch.equal(shard["model.layers.0.self_attn.o_proj.weight"], o[:, r * half : (r + 1) * half])
        q = whole["model.layers.0.self_attn.q_b_proj.weight"]
        assert torch.equal(shard["model.layers.0.self_attn.q_b_proj.weight"], q.chunk(2)[r])
        up = gate_up[:, 64 + r * width : 64 + (r + 1) * width]
        assert torch.equal(shard[f"{experts}.gate_up_proj"][:, width:], up)
        down = whole[f"{experts}.down_proj"][:, :, r * width : (r + 1) * width]
        assert torch.equal(shard[f"{experts}.down_proj"], down)


@pytest.mark.parametrize("scheme", ["awq", "w4a16"])
def test_a_4bit_checkpoint_served_in_int4_keeps_its_own_grid(scheme, tmp_path):
    """engine.quantization int4 over an AWQ or W4A16 checkpoint (groups of 32): each projection whose inputs are
    whole groups is served in 4 bits on the checkpoint's own grid, its weights the checkpoint's exactly (not rounded
    a second time), in the checkpoint's groups."""
    family = Family("llama", tmp_path / "llama", greedy=False)
    dequantized = save_quantized(family.dir, tmp_path / "q", scheme, block=32)
    runner = ModelRunner(
        str(tmp_path / "q"), num_blocks=32, block_size=16, dtype="fp32", device="cpu", quantization="int4"
    )
    checked = 0
    for i, layer in enumerate(runner.model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj"):
            weight = layer.get_submodule(name).weight_q
            assert weight.group == 32 and weight.int4_kernel
            want = dequantized[f"model.layers.{i}.{name}.weight"]
            torch.testing.assert_close(weight.dequantized(torch.float32), want, rtol=1e-5, atol=1e-6)  # (float32)
            checked += 1
    assert checked == 10


def test_an_fp8_checkpoint_whose_scales_do_not_fit_its_blocks_is_named(tmp_path):
    family = Family("llama", tmp_path / "llama", greedy=False)
    save_quantized(family.dir, tmp_path / "fp8", "fp8-block", block=32)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    key = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(PylonError, match=r"model.layers.1.mlp.down_proj.weight: its scales' shape \[4, 10\] is not"):
        ModelRunner(str(tmp_path / "fp8"), num_blocks=8, block_size=16, dtype="fp32", device="cpu")
    other = AutoConfig.from_pretrained(tmp_path / "fp8")
    other.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert "its checkpoint is quantized (bitsandbytes)" in refused("llama", other, 2)
    other.quantization_config = {"quant_method": "gptq", "bits": 3}
    assert "its GPTQ weights are 3-bit (read: 2, 4, 8)" in refused("llama", other, 2)
    other.quantization_config = {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}
    assert "its GPTQ checkpoint_format 'marlin' is not read (read: gptq, gptq_v2)" in refused("llama", other, 2)
    other.quantization_config = {"quant_method": "awq", "bits": 4, "version": "gemv"}
    assert "its AWQ version 'gemv' is not read" in refused("llama", other, 2)
    # a family the shards' reader does not split: named, with what to do
    gpt2 = Family("gpt2", tmp_path / "gpt2", greedy=False)
    save_quantized(gpt2.dir, tmp_path / "gpt2-w4", "w4a16")
    with pytest.raises(PylonError, match=r"compressed-tensors \(4-bit weights\) checkpoint is read for the families"):
        ModelRunner(str(tmp_path / "gpt2-w4"), num_blocks=8, block_size=16, dtype="fp32", device="cpu")
    other.quantization_config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    assert "its compressed-tensors checkpoint's format 'nvfp4-pack-quantized' is not read" in refused("llama", other, 2)


@pytest.mark.slow  # make test-all (~15 s each): two processes
@pytest.mark.parametrize(
    "name,scheme", [("deepseek_v3", "fp8-block"), ("llama", "w4a16"), ("llama", "gptq"), ("deepseek_v3", "awq")]
)
def test_two_shards_of_a_quantized_checkpoint_compute_the_dequantized_model(name, scheme, tmp_path):
    """DeepSeek-V3's block FP8 and AWQ checkpoints and Llama's packed INT4 and GPTQ in 2 tensor-parallel shards
    (gloo): the whole runner's logits over the same checkpoint, and transformers' greedy tokens from the dequantized
    model."""
    from test_tensor_shards import _compare

    family = Family(name, tmp_path / name, greedy=False)
    dequantized = save_quantized(family.dir, tmp_path / "fp8", scheme, block=32)
    reference = _dequantized_copy(family.dir, tmp_path / "reference", dequantized)
    family.model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    family.dir = str(tmp_path / "fp8")
    _compare(family, 2, tmp_path)


def test_a_pipeline_stage_reads_its_layers_of_an_fp8_checkpoint(tmp_path):
    """engine.pipeline_parallel over an FP8 checkpoint: each stage's weights are the dequantized model's (read by the
    same reader: transformers' own dequantization takes no partial blocks), and nothing of the other stages'."""
    from pylon.serving.model.stages import load_stage, stage_of

    family = Family("llama", tmp_path / "llama", greedy=False)
    dequantized = save_quantized(family.dir, tmp_path / "fp8", "fp8-block", block=32)
    reference = _dequantized_copy(family.dir, tmp_path / "reference", dequantized)
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    for index in range(2):
        stage = stage_of(config.num_hidden_layers, index, 2)
        held = load_stage(str(tmp_path / "fp8"), config, torch.float32, stage).state_dict()
        want = load_stage(reference, AutoConfig.from_pretrained(reference), torch.float32, stage).state_dict()
        assert held.keys() == want.keys() and all(torch.equal(held[k], want[k]) for k in want), index
        assert all(f"layers.{index}." in k for k in held if ".layers." in k)
