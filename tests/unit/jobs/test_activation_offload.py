"""`activation_offload` (pylon.models.ActivationOffload): what a step's forward pass saves waits in host memory until
the backward pass. Run here with `copy_host` (a CPU has no other memory to send to, so the copies are made from host
memory to host memory, the same way there and back): every gradient is the one without it, with and without
gradient checkpointing and under DeepSpeed's ZeRO-3 (whose partitioned weights must stay where they are); parameters
and views of them are never sent; the planner counts what leaves the GPU from the same hooks on the meta device.
On a GPU: scripts/gpu_check.sh train."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from pylon.errors import SpecError
from pylon.jobs.train import forward_loss
from pylon.models import ActivationOffload, enable_gradient_checkpointing
from pylon.specs import TrainJobSpec, parse_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint import distributed  # noqa: E402, F401 (autouse: a one-process gloo world, for DeepSpeed)

LAYERS, HIDDEN, BATCH, SEQ = 4, 64, 2, 64
TINY = dict(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_gradients_are_those_without_it_and_host_memory_is_given_back(checkpointing) -> None:
    base = _llama()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    grads, hooks = [], None
    for offload in (False, True):
        model = copy.deepcopy(base)
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        hooks = ActivationOffload(model, "cpu", min_bytes=1024, copy_host=True)
        with hooks if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        if offload:
            held = hooks.host_bytes
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    block_input = BATCH * SEQ * HIDDEN * 4
    if checkpointing:  # each block's input (and what the layers outside blocks keep), never a block's insides
        assert LAYERS * block_input <= held < 40 * block_input, held
    else:
        assert held > 40 * block_input, held
    assert hooks.host_bytes == 0 and hooks.peak_host_bytes == held  # autograd dropped them after the backward pass


def test_parameters_and_views_of_them_stay_where_they_are() -> None:
    """A layer's weight, and a transposed view of it, are what autograd saves for its input's gradient: copies of
    them would be the model twice in host memory (and, under ZeRO-3, stale partitions)."""
    weight = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(64, 256, requires_grad=True)
    module = torch.nn.Module()
    module.weight = weight
    with ActivationOffload(module, "cpu", min_bytes=1024, copy_host=True) as hooks:
        y = (x @ weight).relu() @ weight.t()  # saves x, the weight, the relu's output, a view of the weight
    y.sum().backward()
    assert hooks.offloaded == 2  # x and the relu's output
    assert hooks.peak_host_bytes == 2 * 64 * 256 * 4
    # a small tensor stays too (a copy would cost more than it frees)
    with ActivationOffload(module, "cpu", min_bytes=1 << 20, copy_host=True) as hooks:
        (x @ weight).sum().backward()
    assert hooks.offloaded == 0


def test_a_tensor_saved_twice_goes_once_unless_it_changed_in_between() -> None:
    module = torch.nn.Linear(4, 4)
    x = torch.randn(64, 256, requires_grad=True)
    with ActivationOffload(module, "cpu", min_bytes=1024, copy_host=True) as hooks:
        h = x * 2  # (a tensor of its own, which the next ops save)
        a, b = h.sin(), h.cos()  # both save h: one copy
        assert hooks.offloaded == 1
        with torch.no_grad():
            h.mul_(3)  # changed in place (unseen by autograd): the next op saves the new values
        c = h.sin()
        assert hooks.offloaded == 2
    (a + b + c).sum().backward()
    h0 = x.detach() * 2  # each op's gradient at the values it saw: h0, h0, then 3 h0 (h's gradient is 2 all along)
    expected = 2 * (h0.cos() - h0.sin() + (3 * h0).cos())
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_under_zero3_the_step_is_the_one_without_it() -> None:
    """ZeRO-3's layers save their partitioned Parameter objects and gather them again in the backward pass: the
    hooks leave those alone, and two steps with them train the same weights as two without."""
    import deepspeed

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.models import build_model

    spec = TrainJobSpec.model_validate(
        {"name": "z", "model": {"config": {"model_type": "llama", **TINY}}, "data": {"uri": "/nonexistent"},
         "steps": 5, "deepspeed": {"zero_stage": 3}, "gradient_checkpointing": True,
         "batch": {"micro_batch_size": BATCH, "grad_accum_steps": 1}}
    )  # fmt: skip
    config = build_deepspeed_config(spec, world_size=1)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    losses, sent = [], []
    for offload in (False, True):
        lm = build_model(spec, vocab_size=256, eos_id=0, pad_id=1, seed=0, deepspeed_config=config)
        engine, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()), config=config)
        run = []
        for _ in range(2):
            hooks = ActivationOffload(engine.module, "cpu", min_bytes=1024, copy_host=True)
            with hooks if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss, n, _ = forward_loss(engine, {"input_ids": ids, "labels": ids}, False)
            engine.backward(loss / n)
            engine.step()
            run.append(float(loss))
            sent.append(hooks.offloaded if offload else 0)
        losses.append(run)
        engine.destroy()
    assert losses[0] == losses[1], losses  # the second step's loss follows from the first's update
    assert min(sent[2:]) >= LAYERS


def test_the_planner_counts_what_leaves_the_gpu_and_what_host_memory_holds() -> None:
    from transformers import AutoConfig

    from pylon.plan.activations import step_activations

    config = AutoConfig.for_model("llama", **{**TINY, "vocab_size": 1024})
    kw = dict(micro_batch=4, seq_len=1024, precision="bf16", lora=None, device="cuda")
    block_input = 4 * 1024 * HIDDEN * 2
    for checkpointing in (True, False):
        kept = step_activations(config, checkpointing=checkpointing, **kw)
        sent = step_activations(config, checkpointing=checkpointing, offload=True, **kw)
        assert kept.host_bytes == 0 and sent.host_bytes >= LAYERS * block_input, (kept, sent)
        # the device no longer holds what went (a backward pass brings one block's back at a time, not all of them)
        assert kept.peak_bytes - sent.peak_bytes >= (LAYERS - 1) * block_input, (kept, sent)
        assert sent.saved_bytes < kept.saved_bytes


def _train(**fields) -> dict:
    return {"kind": "TrainJob", "name": "j", "model": {"preset": "llama-7b"}, "steps": 100,
            "data": {"uri": "s3://b/corpus/", "seq_len": 8192}, "precision": "bf16",
            "scaling": {"num_workers": 8, "use_gpu": True}, "deepspeed": {"zero_stage": 3},
            "gradient_checkpointing": True, "batch": {"micro_batch_size": 4, "grad_accum_steps": 1}, **fields}  # fmt: skip


def test_a_plan_counts_it_on_the_host_and_in_the_step_time() -> None:
    from pylon.plan.train import plan_train

    plans = {
        off: plan_train(TrainJobSpec.model_validate(_train(activation_offload=off)), gpu="H100", gpus=8)
        for off in (False, True)
    }
    kept, sent = (plans[off].rows[0].requested for off in (False, True))
    assert "activations->cpu" in sent.layout.describe() and "activations->cpu" not in kept.layout.describe()
    assert sent.memory.activations < kept.memory.activations
    assert sent.memory.host_states > kept.memory.host_states + 8 * 2**30  # 8 GPUs' saved activations on the node
    assert sent.step.offload_s > kept.step.offload_s  # each micro-batch's there and back over PCIe


def test_a_plan_says_where_it_would_make_the_layout_asked_for_fit() -> None:
    """Twice the tokens and twice the rows: as requested the activations no longer fit an H100; in host memory they
    do, and the plan says so (and says nothing where the spec already asks for it)."""
    from pylon.plan.train import plan_train

    big = _train(data={"uri": "s3://b/corpus/", "seq_len": 16384}, batch={"micro_batch_size": 8, "grad_accum_steps": 1})
    plan = plan_train(TrainJobSpec.model_validate(big), gpu="H100", gpus=8)
    assert not plan.rows[0].requested.fits
    note = next(n for n in plan.notes if "activation_offload: true" in n)
    assert note.startswith("H100-SXM: as requested it does not fit (GPU memory") and "it does: " in note, note
    asked = plan_train(TrainJobSpec.model_validate({**big, "activation_offload": True}), gpu="H100", gpus=8)
    assert asked.rows[0].requested.fits and not any("activation_offload: true" in n for n in asked.notes)


def test_a_cpu_job_is_refused_naming_the_field() -> None:
    doc = _train(activation_offload=True, scaling={"num_workers": 2, "use_gpu": False})
    doc["precision"] = "fp32"
    with pytest.raises(SpecError) as info:
        parse_specs(json.dumps(doc), "train.yaml")
    assert len(info.value.problems) == 1 and "activation_offload" in info.value.problems[0], info.value.problems


@pytest.mark.skipif(
    os.environ.get("PYLON_TEST_DEVICE") != "cuda" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU (PYLON_TEST_DEVICE=cuda; scripts/gpu_check.sh train runs it)",
)
def test_on_a_gpu_the_device_holds_less_and_the_gradients_are_the_same() -> None:
    """The real way: pinned host memory, copied out in the forward pass and back in the backward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8})
    base = LlamaForCausalLM(config)
    enable_gradient_checkpointing(base)
    ids = torch.randint(0, 256, (4, 1024), device="cuda")
    peaks, grads, hooks = [], [], None
    for offload in (False, True):
        model = copy.deepcopy(base).cuda().train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        hooks = ActivationOffload(model, "cuda")
        with hooks if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        grads.append([p.grad.cpu() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads, strict=True))
    block_input = 4 * 1024 * 256 * 4
    assert peaks[0] - peaks[1] >= 6 * block_input, peaks
    assert hooks.peak_host_bytes >= 8 * block_input and hooks.host_bytes == 0
