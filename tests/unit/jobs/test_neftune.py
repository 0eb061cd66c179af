"""`neftune_noise_alpha`: NEFTune's uniform noise on the input embeddings (transformers' own hook, as its Trainer and
TRL register it), in training passes only, of magnitude alpha / sqrt(length x hidden), with LoRA and without."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pylon.models import build_model
from pylon.specs import TrainJobSpec

VOCAB = 320


def _model(alpha: float, lora: bool):
    spec = TrainJobSpec.model_validate(
        {"name": "n", "model": {"preset": "llama-tiny"}, "data": {"uri": "/nonexistent"}, "steps": 1,
         "neftune_noise_alpha": alpha, **({"lora": {"r": 4, "target_modules": ["q_proj"]}} if lora else {})}
    )  # fmt: skip
    return build_model(spec, vocab_size=VOCAB, eos_id=256, pad_id=257, seed=0)


@pytest.mark.parametrize("lora", [False, True])
def test_noise_on_the_embeddings_in_training_only(lora) -> None:
    alpha = 5.0
    model, plain = _model(alpha, lora), _model(0.0, lora)
    embeddings = model.get_input_embeddings()
    seen = []
    embeddings.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 24))
    clean = F.embedding(ids, embeddings.weight).detach()
    bound = alpha / math.sqrt(ids.shape[1] * clean.shape[-1])

    model.train()
    first = model(input_ids=ids, labels=ids).loss
    second = model(input_ids=ids, labels=ids).loss
    noise = seen[0] - clean
    assert noise.abs().max() <= bound * (1 + 1e-5) and noise.abs().max() > 0.9 * bound  # uniform in [-m, m]
    assert abs(noise.mean().item()) < 0.05 * bound and not torch.equal(seen[0], seen[1])  # fresh each pass
    assert first.item() != second.item()

    model.eval()
    plain.eval()
    seen.clear()
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert torch.equal(seen[0], clean) and torch.equal(got, want)  # evaluation: the model itself


def test_the_spec_takes_a_non_negative_alpha() -> None:
    with pytest.raises(ValueError, match="neftune_noise_alpha"):
        _model(-1.0, False)
