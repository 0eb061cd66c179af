"""`loss_chunk_tokens`: the output layer and the cross-entropy a chunk of tokens at a time (`pylon.models.
with_chunked_loss`), each chunk recomputed in the backward pass. The loss, its token count and every parameter's
gradient are those of the whole micro-batch's logits, for each family's way of turning hidden states into logits
(tied embeddings, an output bias, Gemma 2's soft-capping, Cohere's and Granite's scales, a mixture of experts' load balancing,
LoRA); a model that does something else is refused before it trains; the planner counts the logits that no longer
exist."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from pylon.errors import PylonError
from pylon.jobs.train import check_chunked_loss, forward_loss
from pylon.models import with_chunked_loss, with_lora
from pylon.specs import LoraSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint import distributed  # noqa: E402, F401 (autouse: a one-process gloo world, for DeepSpeed)

VOCAB = 96
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "llama": SMALL,
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "qwen3": dict(SMALL, head_dim=8, tie_word_embeddings=True),
    "gemma2": dict(SMALL, head_dim=8, final_logit_softcapping=0.1),  # small enough to bite at random init
    "cohere": dict(SMALL, logit_scale=0.5),
    "granite": dict(SMALL, logits_scaling=4.0),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "phi": SMALL,  # an output layer with a bias
}


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                                  **FAMILIES[model_type])  # fmt: skip
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(2, VOCAB, (3, 20))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt the loss does not count
    labels[2, 15:] = -100  # padding
    return {"input_ids": ids, "attention_mask": (labels != -100).long() | (torch.arange(20) < 15).long(),
            "labels": labels}  # fmt: skip


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_chunked_loss_and_its_gradients_are_the_whole_batchs(model_type) -> None:
    plain = _model(model_type)
    chunked = with_chunked_loss(copy.deepcopy(plain), 7)  # 3 x 19 positions, 7 uncounted: chunks of 7, the last short
    inputs = _batch()
    aux = {"output_router_logits": True} if model_type == "mixtral" else {}
    want, n_want, out_want = forward_loss(plain, inputs, False, **aux)
    got, n_got, out_got = forward_loss(chunked, inputs, True, **aux)
    assert n_got == n_want == int((inputs["labels"][:, 1:] != -100).sum())
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    total_want, total_got = want, got
    if aux:
        assert out_got.aux_loss.item() == pytest.approx(out_want.aux_loss.item(), rel=1e-5)
        total_want, total_got = want + 0.1 * out_want.aux_loss, got + 0.1 * out_got.aux_loss
    total_want.backward()
    total_got.backward()
    named = dict(chunked.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # without labels the model is what it was
    with torch.no_grad():
        torch.testing.assert_close(
            chunked(input_ids=inputs["input_ids"]).logits, plain(input_ids=inputs["input_ids"]).logits
        )


def test_lora_and_a_batch_with_nothing_to_count() -> None:
    lora = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    plain = with_lora(_model("llama"), lora)
    chunked = with_chunked_loss(copy.deepcopy(plain), 8)
    inputs = _batch()
    want, _, _ = forward_loss(plain, inputs, False)
    got, _, _ = forward_loss(chunked, inputs, True)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    want.backward()
    got.backward()
    named = dict(chunked.named_parameters())
    trainable = [(n, p) for n, p in plain.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n, _ in trainable)
    for name, p in trainable:
        torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # an all-padding row (a worker whose data ran out): zero, and the output layer still gets (zero) gradients
    empty = {"input_ids": inputs["input_ids"][:1], "labels": torch.full((1, 20), -100)}
    chunked.zero_grad()
    zero, n, _ = forward_loss(chunked, empty, True)
    zero.backward()
    assert n == 0 and float(zero) == 0.0
    head = chunked.get_base_model().lm_head
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters() if p.requires_grad)


def test_the_check_refuses_a_model_whose_logits_it_does_not_reproduce(monkeypatch) -> None:
    model = with_chunked_loss(_model("gemma2"), 16)
    assert check_chunked_loss(model, VOCAB) < 1e-5
    assert model.training  # restored
    mixtral = with_chunked_loss(_model("mixtral"), 16)
    assert check_chunked_loss(mixtral, VOCAB, aux=True) < 1e-5
    import pylon.models

    monkeypatch.setattr(
        pylon.models, "_logits_transform", lambda lm, temperature=1.0: lambda logits: logits
    )  # soft-capping forgotten
    with pytest.raises(PylonError, match="loss_chunk_tokens: the chunked loss of Gemma2ForCausalLM is .* set "
                       "loss_chunk_tokens: 0"):  # fmt: skip
        check_chunked_loss(model, VOCAB)


def test_the_planner_counts_a_chunk_of_logits_not_the_batchs() -> None:
    from transformers import AutoConfig

    from pylon.plan.activations import step_activations

    # a large vocabulary beside a small model: the logits dominate the activations
    config = AutoConfig.for_model("llama", vocab_size=32000, **SMALL)
    kw = dict(micro_batch=4, seq_len=512, precision="bf16", checkpointing=False, lora=None, device="cuda")
    whole = step_activations(config, **kw)
    chunked = step_activations(config, loss_chunk_tokens=256, **kw)
    logits = 4 * 512 * 32000 * (2 + 4)  # bf16 logits and their fp32 copy for the loss
    assert whole.peak_bytes - chunked.peak_bytes > 0.8 * logits, (whole, chunked)


@pytest.mark.slow  # make test-all: ~25 s
def test_a_plan_says_what_the_chunked_loss_would_free_where_the_logits_weigh() -> None:
    from pylon.plan.train import CHUNK_HINT_TOKENS, plan_train
    from pylon.specs import TrainJobSpec

    def plan(vocab: int, **fields):
        model = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 1024, "intermediate_size": 2816,
                 "num_hidden_layers": 4, "num_attention_heads": 8}  # fmt: skip
        spec = TrainJobSpec.model_validate(
            {
                "kind": "TrainJob",
                "name": "job",
                "model": {"config": model},
                "data": {"uri": "/nonexistent/pylon-plan-data", "seq_len": 4096},
                "scaling": {"num_workers": 1, "use_gpu": True},
                "precision": "bf16",
                "steps": 100,
                "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
                **fields,
            }  # fmt: skip
        )
        return plan_train(spec, gpu="H100-80GB", gpus=1)

    big = plan(128256)  # Llama 3's vocabulary: 4 x 4096 x 128256 logits, 4 GiB in bf16, 8 GiB more in fp32
    hint = big.to_dict()["chunked_loss"]
    assert hint["loss_chunk_tokens"] == CHUNK_HINT_TOKENS and hint["activation_bytes_saved_per_gpu"] > 8 * 2**30
    assert any("loss_chunk_tokens: 4096" in line for line in big.explanation), big.explanation
    on = plan(128256, loss_chunk_tokens=4096)  # already chunked: nothing to suggest, and the plan counts less
    assert on.to_dict()["chunked_loss"] is None
    assert on.requested_memory.activations < big.requested_memory.activations - 8 * 2**30
    assert plan(512).to_dict()["chunked_loss"] is None  # a small vocabulary: the logits do not weigh


def test_zero3_gathers_the_output_layer_once_a_step_however_many_chunks() -> None:
    """The chunks run inside one call of the output layer: ZeRO-3 gathers its partitioned weight for the forward
    pass and keeps it to the backward, once a micro-batch, as it does for the unchunked model. Called a chunk at a
    time, the layer was gathered for each chunk's forward, recomputation and backward whenever the chunk count
    changed between micro-batches (it follows the tokens the labels count): 14 gathers for 7 chunks."""
    import deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    vocab = 4096  # 4096 x 32: above DeepSpeed's persistence threshold, so the output layer is partitioned
    spec = TrainJobSpec.model_validate(
        {"name": "z", "model": {"config": {"model_type": "llama", "vocab_size": vocab, **SMALL}},
         "data": {"uri": "/nonexistent"}, "steps": 5, "deepspeed": {"zero_stage": 3},
         "batch": {"micro_batch_size": 2, "grad_accum_steps": 1}, "loss_chunk_tokens": 16}
    )  # fmt: skip
    config = build_deepspeed_config(spec, world_size=1)
    lm = build_model(spec, vocab_size=vocab, eos_id=0, pad_id=1, seed=0, deepspeed_config=config)
    assert lm.lm_head.weight.ds_numel == vocab * 32  # partitioned (and chunked, as the spec asks)
    engine, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()), config=config)
    head = lm.lm_head.weight
    gathers = []
    original = coordinator.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_

    def counted(self, params, forward, quantize=False):
        gathers.extend(p for p in params if p is head and p.ds_status == coordinator.ZeroParamStatus.NOT_AVAILABLE)
        return original(self, params, forward, quantize)

    setattr(coordinator.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_",
            counted)  # fmt: skip
    try:
        torch.manual_seed(2)
        ids = torch.randint(0, vocab, (2, 64))
        per_step = []
        for step in range(5):
            labels = ids.clone()
            labels[:, : 10 * step] = -100  # a longer prompt each step: 8, 7, 6, 5 and 4 chunks
            gathers.clear()
            loss, n, _ = forward_loss(engine, {"input_ids": ids, "labels": labels}, True)
            engine.backward(loss / n)
            engine.step()
            per_step.append(len(gathers))
            assert torch.isfinite(loss)
    finally:
        setattr(coordinator.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_",
                original)  # fmt: skip
    assert per_step[1:] == [1, 1, 1, 1] and per_step[0] <= 2, per_step  # the first step records DeepSpeed's trace
