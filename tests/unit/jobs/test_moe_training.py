"""Training a mixture-of-experts model (pylon.jobs.train.step_loss): the objective is transformers' own for the
family (token cross-entropy plus router_aux_loss_coef times the routers' load-balancing loss), its gradient reaches
the routers and evens out a router that sends every token to one expert, a dense model's objective is the
cross-entropy alone, and the FLOPs behind MFU count the experts a token runs."""

from __future__ import annotations

import pytest
import torch

from pylon.jobs.train import step_loss
from pylon.models import build_model, expert_parameters, flops_per_token, router_aux_coef
from pylon.specs import TrainJobSpec

BYTE = {"vocab_size": 320, "eos_id": 256, "pad_id": 257}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
}
QWEN3_MOE = {
    **MIXTRAL,
    "model_type": "qwen3_moe",
    "num_local_experts": None,
    "num_experts": 6,
    "moe_intermediate_size": 48,
    "norm_topk_prob": True,
    "head_dim": 16,
}


def job(config: dict) -> TrainJobSpec:
    config = {k: v for k, v in config.items() if v is not None}
    return TrainJobSpec.model_validate(
        {"kind": "TrainJob", "name": "moe", "model": {"config": config}, "data": {"uri": "/data"}, "steps": 10}
    )


def batch(seed: int = 0, rows: int = 4, seq: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, seq), generator=g)
    labels = ids.clone()
    labels[1, 10:] = -100  # a shorter row: padding counts for nothing
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


@pytest.mark.parametrize("config", [MIXTRAL, QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_the_objective_is_transformers_own_for_the_family(config) -> None:
    model = build_model(job({**config, "router_aux_loss_coef": 0.05}), seed=0, **BYTE)
    coef = router_aux_coef(model.config)
    assert coef == 0.05
    inputs = batch()
    loss, local_sum, n_tokens, aux = step_loss(model, inputs, world=1, aux_coef=coef)
    # transformers' own: labels and output_router_logits make its forward add coef x its load-balancing loss.
    want = model(**inputs, output_router_logits=True)
    assert aux is not None and aux > 0 and want.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    assert local_sum / n_tokens == pytest.approx(want.loss.item() - coef * aux, rel=1e-5)
    loss.backward()
    routers = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    # An all-padding row (a worker whose epoch ran out) adds nothing, load balance included.
    empty = {**inputs, "labels": torch.full_like(inputs["labels"], -100)}
    loss, _, n_tokens, _ = step_loss(model, empty, world=1, aux_coef=coef)
    assert n_tokens == 0 and loss.item() == 0.0


def test_the_load_balancing_loss_evens_out_a_collapsed_router() -> None:
    """Every token sent to expert 0 first (its router row along the hidden states' mean): trained on the Pylon
    objective the busiest expert's share of the routing falls, and the load-balancing loss with it; trained with the
    coefficient set to 0 (the cross-entropy alone) it stays collapsed."""

    def busiest_share(model, inputs) -> float:
        counts = torch.zeros(4)

        def count(module, args, out) -> None:  # out: the router's (logits, top weights, top experts)
            counts.add_(torch.bincount(out[2].flatten(), minlength=4).float())

        hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers]
        with torch.no_grad():
            model(input_ids=inputs["input_ids"])
        for h in hooks:
            h.remove()
        return (counts.max() / counts.sum()).item()

    inputs = batch(rows=8, seq=32)
    shares = {}
    for coef in (1.0, 0.0):
        model = build_model(job({**MIXTRAL, "router_aux_loss_coef": coef}), seed=0, **BYTE)
        with torch.no_grad():  # a direction every hidden state shares, and expert 0's router row along it
            c = torch.nn.functional.normalize(torch.randn(64, generator=torch.Generator().manual_seed(1)), dim=0)
            model.model.embed_tokens.weight.add_(c)
            for layer in model.model.layers:
                layer.mlp.gate.weight[0] = 0.5 * c
        before = busiest_share(model, inputs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        auxes = []
        for _ in range(30):
            loss, _, _, aux = step_loss(model, inputs, world=1, aux_coef=router_aux_coef(model.config))
            opt.zero_grad()
            loss.backward()
            opt.step()
            auxes.append(aux)
        shares[coef] = (before, busiest_share(model, inputs), auxes)
    before, after, auxes = shares[1.0]
    assert before >= 0.49 and after < before - 0.1 and auxes[-1] < auxes[0]  # 0.5: expert 0 is each token's first
    before, after, auxes = shares[0.0]
    assert auxes == [None] * 30 and after >= 0.49


def test_a_dense_model_trains_on_the_cross_entropy_alone_and_moe_flops_count_active_experts() -> None:
    dense = build_model(job({**MIXTRAL, "model_type": "mistral"}), seed=0, **BYTE)
    assert router_aux_coef(dense.config) == 0.0 and expert_parameters(dense) == (0, 1.0)
    loss, local_sum, n_tokens, aux = step_loss(dense, batch(), world=1)
    assert aux is None and loss.item() == pytest.approx(local_sum / n_tokens, rel=1e-6)

    moe = build_model(job(MIXTRAL), seed=0, **BYTE)
    assert router_aux_coef(moe.config) == 0.001  # Mixtral's default: on unless the config sets it to 0
    experts, share = expert_parameters(moe)
    assert experts == 2 * 4 * 3 * 64 * 96 and share == 0.5
    total = sum(p.numel() for p in moe.parameters()) - moe.model.embed_tokens.weight.numel()
    assert flops_per_token(moe.config, 24) == 6.0 * (total - experts // 2) + 12.0 * 2 * 64 * 24
