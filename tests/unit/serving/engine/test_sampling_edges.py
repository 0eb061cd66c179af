"""The sampler at the edges of what a request may ask (found by schemathesis against the live API)."""

from __future__ import annotations

import torch

from pylon.serving.engine.sampling import SamplingParams, sample


def test_a_top_p_that_is_zero_in_float32_keeps_the_best_token():
    # 5e-324 is a valid top_p (> 0) but 0 in float32: every token used to be masked, the draw saw NaN, and the
    # engine's step loop died for every request of the batch.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=1) for top_p in (5e-324, 1e-45, 1.0)]
    tokens = sample(logits, params, [p.new_generator() for p in params])
    assert tokens[:2] == logits[:2].argmax(dim=-1).tolist()
    assert 0 <= tokens[2] < 50
