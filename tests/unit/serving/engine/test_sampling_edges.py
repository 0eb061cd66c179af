"""The sampler at the edges of what a request may ask (found by schemathesis against the live API)."""

from __future__ import annotations

import torch

from pylon.serving.engine.sampling import SamplingParams, sample, shape_logits


def test_a_top_p_that_is_zero_in_float32_keeps_the_best_token():
    # 5e-324 is a valid top_p (> 0) but 0 in float32: every token used to be masked, the draw saw NaN, and the
    # engine's step loop died for every request of the batch.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=1) for top_p in (5e-324, 1e-45, 1.0)]
    tokens = sample(logits, params, [p.new_generator() for p in params])
    assert tokens[:2] == logits[:2].argmax(dim=-1).tolist()
    assert 0 <= tokens[2] < 50


def test_a_tiny_repetition_penalty_keeps_the_logits_finite():
    # 1e-300 is a valid repetition_penalty (> 0): it divides the positive logits of seen tokens to inf, and the
    # sampler's inf - inf would be NaN for the draw. Shaped logits stay finite; the seen tokens win.
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)).abs() + 0.1
    params = [SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=2), SamplingParams(temperature=0)]
    shaped = shape_logits(logits, params, [([3, 7], [9]), ([], [])])
    assert torch.isfinite(shaped).all()
    tokens = sample(shaped, params, [p.new_generator() for p in params])
    assert tokens[0] in (3, 7, 9) and tokens[1] == int(logits[1].argmax())
