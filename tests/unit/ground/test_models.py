"""pylon.models: configs and models from a ModelSpec, LoRA, export, and the FLOP counts behind MFU."""

from __future__ import annotations

import math

import fsspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.models import (
    build_model,
    export_lora,
    flops_per_token,
    lora_layer_names,
    measure_matmul_peak_flops,
    model_config,
    parameter_counts,
)
from pylon.presets import BYTE_VOCAB_SIZE, MODEL_PRESETS
from pylon.specs import ModelSpec, TrainJobSpec

BYTE = {"vocab_size": BYTE_VOCAB_SIZE, "eos_id": 256, "pad_id": 257}


def job(**fields) -> TrainJobSpec:
    spec = {"kind": "TrainJob", "name": "job", "model": {"preset": "gpt-tiny"}, "data": {"uri": "/data"}, "steps": 10}
    spec.update(fields)
    return TrainJobSpec.model_validate(spec)


def tokens(batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------------------
# Configs and models
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt-tiny", "gpt-small", "llama-tiny", "qwen3-tiny"])
def test_small_presets_build_trainable_causal_lms(preset: str) -> None:
    model = build_model(job(model={"preset": preset}), **BYTE)
    expected = MODEL_PRESETS[preset]
    assert model.config.model_type == expected["model_type"]
    assert model.get_input_embeddings().weight.shape[0] == BYTE_VOCAB_SIZE
    total, trainable = parameter_counts(model)
    assert total == trainable == sum(p.numel() for p in model.parameters()) > 0
    ids = tokens()
    loss = model(input_ids=ids, labels=ids).loss
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(BYTE_VOCAB_SIZE), rel=0.1)  # untrained: about uniform


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_every_preset_has_a_config(preset: str) -> None:
    config = model_config(ModelSpec(preset=preset))
    assert config.model_type == MODEL_PRESETS[preset]["model_type"]
    assert config.vocab_size == MODEL_PRESETS[preset]["vocab_size"]


def test_the_tokenizer_sets_vocab_and_special_ids() -> None:
    config = model_config(ModelSpec(preset="gpt-tiny"), vocab_size=1000, eos_id=256, pad_id=257)
    assert (config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id) == (1000, 256, 256, 257)
    model = build_model(job(), vocab_size=1000, eos_id=256, pad_id=257)
    assert model.get_input_embeddings().weight.shape == (1000, 64)
    assert model.get_output_embeddings().weight.shape == (1000, 64)


def test_explicit_config() -> None:
    fields = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "vocab_size": 999,
    }
    spec = job(model={"config": fields})
    model = build_model(spec, **BYTE)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 1 and model.config.vocab_size == BYTE_VOCAB_SIZE
    assert spec.model.config["vocab_size"] == 999  # the spec itself is left alone


def test_unknown_model_type_is_a_pylon_error() -> None:
    with pytest.raises(PylonError, match=r"model\.config\.model_type: .*nonsense"):
        model_config(ModelSpec(config={"model_type": "nonsense"}))


def test_same_seed_same_weights() -> None:
    a, b = build_model(job(), **BYTE, seed=3), build_model(job(), **BYTE, seed=3)
    c = build_model(job(), **BYTE, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


# ---------------------------------------------------------------------------------------------------------
# Models from a directory (fine-tuning)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A gpt-tiny saved with save_pretrained, as a base model for fine-tuning."""
    model = build_model(job(), **BYTE, seed=7)
    path = tmp_path_factory.mktemp("base-model")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def test_path_model_round_trips(saved_model) -> None:
    original, path = saved_model
    loaded = build_model(job(model={"path": str(path)}), **BYTE)
    assert type(loaded) is type(original)
    ids = tokens()
    assert torch.equal(logits(loaded, ids), logits(original, ids))


def test_path_model_from_object_storage_is_copied_locally(saved_model) -> None:
    original, path = saved_model
    fs = fsspec.filesystem("memory")
    for file in path.iterdir():
        fs.pipe_file(f"/models/tiny/{file.name}", file.read_bytes())
    try:
        loaded = build_model(job(model={"path": "memory://models/tiny"}), **BYTE)
    finally:
        fs.rm("/models/tiny", recursive=True)
    ids = tokens()
    assert torch.equal(logits(loaded, ids), logits(original, ids))


def test_path_model_vocab_must_fit(saved_model) -> None:
    _, path = saved_model
    assert model_config(ModelSpec(path=str(path)), vocab_size=300).vocab_size == BYTE_VOCAB_SIZE  # kept
    with pytest.raises(
        PylonError,
        match=rf"vocabulary \(400 tokens\) is larger than the model's embedding table "
        rf"\({BYTE_VOCAB_SIZE} tokens\)",
    ):
        model_config(ModelSpec(path=str(path)), vocab_size=400)


def test_missing_path_model_is_a_pylon_error(tmp_path) -> None:
    with pytest.raises(PylonError, match="no such directory"):
        model_config(ModelSpec(path=str(tmp_path / "absent")))
    with pytest.raises(PylonError, match="not a Hugging Face model directory"):
        model_config(ModelSpec(path=str(tmp_path)))


# ---------------------------------------------------------------------------------------------------------
# Gradient checkpointing and LoRA
# ---------------------------------------------------------------------------------------------------------


def _checkpointing(model) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    return flag if flag is not None else model.is_gradient_checkpointing


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "qwen3-tiny"])
def test_gradient_checkpointing_is_set_and_gives_the_same_gradients(preset: str) -> None:
    plain = build_model(job(model={"preset": preset}), **BYTE)
    ckpt = build_model(job(model={"preset": preset}, gradient_checkpointing=True), **BYTE)
    assert _checkpointing(ckpt) and not _checkpointing(plain)
    assert ckpt.config.use_cache is False
    ids = tokens()
    for model in (plain, ckpt):
        model.eval()  # no dropout: both runs must compute the same thing
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize(
    "preset, targets",
    [("gpt-tiny", ["c_attn", "c_fc"]), ("llama-tiny", ["q_proj", "v_proj"]), ("qwen3-tiny", ["q_proj", "down_proj"])],
)
def test_lora_trains_only_the_adapters(preset: str, targets: list[str]) -> None:
    model = build_model(
        job(model={"preset": preset}, lora={"r": 4, "target_modules": targets}, gradient_checkpointing=True), **BYTE
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # r x (in + out) per adapted module, for every module the targets name.
    base = model.get_base_model()
    expected = 0
    for name in lora_layer_names(base):
        if name.rsplit(".", 1)[-1] in targets:
            weight = base.get_submodule(name).base_layer.weight
            expected += 4 * sum(weight.shape)
    total, counted = parameter_counts(model)
    assert counted == expected and counted < total
    # A backward pass through the checkpointed, frozen-embedding model reaches the adapters only.
    ids = tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_lora_target_that_is_not_in_the_model() -> None:
    with pytest.raises(PylonError) as e:
        build_model(job(lora={"target_modules": ["q_proj", "c_attn"]}), **BYTE)
    assert str(e.value) == (
        "lora.target_modules: q_proj not found in this gpt2 model; its linear modules are: "
        "c_attn, c_fc, c_proj, lm_head"
    )


def _trained_lora(seed: int = 0):
    """A LoRA gpt-tiny whose adapters are not zero (fresh LoRA B is zero, which would make merging trivial)."""
    model = build_model(job(lora={"r": 4, "target_modules": ["c_attn", "c_proj"]}), **BYTE)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def test_export_lora_merged_loads_as_a_plain_model_with_the_same_logits(tmp_path) -> None:
    model = _trained_lora()
    ids = tokens()
    expected = logits(model, ids)
    with model.disable_adapter():
        assert not torch.allclose(logits(model, ids), expected)  # the adapters matter
    export_lora(model, tmp_path / "merged", merge=True)
    assert (tmp_path / "merged" / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.use_cache
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)


def test_export_lora_separate_writes_a_peft_adapter(tmp_path) -> None:
    from peft import PeftModel

    model = _trained_lora()
    ids = tokens()
    expected = logits(model, ids)
    export_lora(model, tmp_path / "adapter", merge=False)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    restored = PeftModel.from_pretrained(build_model(job(), **BYTE), tmp_path / "adapter")
    torch.testing.assert_close(logits(restored, ids), expected)


def test_export_lora_needs_a_lora_model(tmp_path) -> None:
    with pytest.raises(PylonError, match="expected a LoRA"):
        export_lora(build_model(job(), **BYTE), tmp_path, merge=True)


# ---------------------------------------------------------------------------------------------------------
# Parameter counts, FLOPs, measured peak
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_flops_per_token_is_six_n_plus_attention(preset: str) -> None:
    config = model_config(ModelSpec(preset=preset))
    model = build_model(job(model={"preset": preset}), **BYTE)
    total, _ = parameter_counts(model)
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    if preset.startswith("gpt"):  # tied head: count it once; position embeddings are a lookup
        n = total - config.n_positions * d
    else:  # separate head: the token embedding is the only lookup
        n = total - vocab * d
    for seq_len in (1, 128):
        assert flops_per_token(config, seq_len) == 6 * n + 12 * layers * d * seq_len


def test_flops_per_token_for_a_llama_7b_shape() -> None:
    # Llama-2-7B has 6.74e9 parameters: 6.61e9 in matmuls (all but the 32000 x 4096 input embedding).
    config = model_config(ModelSpec(preset="llama-7b"))
    assert flops_per_token(config, 4096) == pytest.approx(6 * 6.607e9 + 12 * 32 * 4096 * 4096, rel=1e-3)


def test_parameter_counts_with_frozen_parameters() -> None:
    model = build_model(job(), **BYTE)
    frozen = model.get_input_embeddings().weight
    frozen.requires_grad_(False)
    total, trainable = parameter_counts(model)
    assert total - trainable == frozen.numel()


def test_measured_matmul_peak_is_a_positive_rate_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(0)
    state = torch.get_rng_state()
    peak = measure_matmul_peak_flops(0.05, size=256)
    assert math.isfinite(peak) and peak > 0
    assert torch.equal(torch.get_rng_state(), state)  # measuring must not change what a seed gives
