"""The planner: model states equal DeepSpeed's own estimators on real models, known figures (7B fp32 + Adam,
70B bf16), plausible advice for a 7B fine-tune, `pylon plan` and `client.plan`, and `pylon train`'s refusal."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from pylon.errors import PylonError
from pylon.models import model_config
from pylon.plan import (
    DEFAULT_MFU,
    USABLE_FRACTION,
    WontFitError,
    check_fits,
    model_flops_per_token,
    plan_file,
    plan_serve,
    plan_train,
    render,
)
from pylon.plan.catalog import load_catalog
from pylon.plan.memory import GIB, HOST_BUFFER_FACTOR, Layout, Workload, kv_bytes_per_token, model_shape, train_memory
from pylon.serving.model.families import ENCODER_MODEL_TYPES
from pylon.specs import DeploymentSpec, ModelSpec, TrainJobSpec

LLAMA_58M = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "vocab_size": 32000,
}
LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
}
SHAPES = {
    "gpt-tiny": {"preset": "gpt-tiny"},
    "llama-tiny": {"preset": "llama-tiny"},
    "gpt-small": {"preset": "gpt-small"},
    "llama-58m": {"config": LLAMA_58M},
}
HARDWARE = [(1, 1), (4, 1), (8, 2)]  # (GPUs per node, nodes)


def _train(**fields) -> TrainJobSpec:
    base = {
        "kind": "TrainJob",
        "name": "job",
        "model": {"preset": "llama-7b"},
        "data": {"uri": "/nonexistent/pylon-plan-data", "seq_len": 4096},
        "scaling": {"num_workers": 8, "use_gpu": True},
        "precision": "bf16",
        "steps": 1000,
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    }
    return TrainJobSpec.model_validate({**base, **fields})


@pytest.fixture(scope="module")
def real_models() -> dict:
    """The shapes as real CPU models: DeepSpeed's estimators count parameters by their storage."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    models = {}
    for name, fields in SHAPES.items():
        config = model_config(ModelSpec(**fields), eos_id=0, pad_id=0)
        models[name] = (AutoModelForCausalLM.from_config(config), config)
    return models


def _spy(monkeypatch, module, name: str) -> list:
    """Record every call of DeepSpeed's `module.name` (keyword arguments, result) while it runs as usual."""
    calls, real = [], getattr(module, name)

    def spy(**kwargs):
        result = real(**kwargs)
        calls.append((kwargs, result))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def _printed_gib(text: str) -> list[tuple[float, float]]:
    return [(float(c), float(g)) for c, g in re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \|", text, re.M)]


def _close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= 0.01 * theirs


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_states_equal_deepspeed_zero2_estimate(real_models, shape, precision, monkeypatch, capsys) -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    model, config = real_models[shape]
    work = Workload(config, model_shape(config), precision, seq_len=64)
    for per_node, nodes in HARDWARE:
        calls = _spy(monkeypatch, stage_1_and_2, "estimate_zero2_model_states_mem_needs")
        stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=per_node, num_nodes=nodes)
        printed = _printed_gib(capsys.readouterr().out)
        assert len(calls) == len(printed) == 2
        for (kwargs, (cpu, gpu)), (cpu_gib, gpu_gib) in zip(calls, printed):
            offload = "cpu" if kwargs["cpu_offload"] else "none"
            mem = train_memory(work, Layout(2, offload, num_gpus=per_node * nodes, gpus_per_node=per_node))
            assert _close(mem.model_states, gpu), (shape, per_node, nodes, offload, mem.model_states, gpu)
            assert abs(mem.model_states / GIB - gpu_gib) <= 0.006 + 0.01 * gpu_gib  # the printed table agrees
            if nodes == 1 or offload == "none":
                # Multi-node with offload, DeepSpeed multiplies by all GPUs, not those of one node: not per node.
                # DeepSpeed's estimator counts an fp32 model built by every process of the node (4N x GPUs per
                # node); Pylon builds it once (rank 0; the others allocate on their GPUs), which is its figure for
                # one GPU: the node's offloaded states (16N with offload) do not depend on the count.
                one_copy, _ = stage_1_and_2.estimate_zero2_model_states_mem_needs(
                    total_params=model_shape(config).total_params,
                    num_gpus_per_node=1,
                    num_nodes=1,
                    cpu_offload=offload == "cpu",
                )
                assert _close(mem.host_total, one_copy), (shape, per_node, nodes, offload, mem.host_total, one_copy)
                if per_node == 1 or offload == "cpu" and per_node <= 4:
                    assert _close(mem.host_total, cpu)  # where the build does not decide it, DeepSpeed agrees


@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_states_equal_deepspeed_zero3_estimate(real_models, shape, monkeypatch, capsys) -> None:
    from deepspeed.runtime.zero import stage3

    model, config = real_models[shape]
    work = Workload(config, model_shape(config), "bf16", seq_len=64)
    for per_node, nodes in HARDWARE:
        calls = _spy(monkeypatch, stage3, "estimate_zero3_model_states_mem_needs")
        stage3.estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=per_node, num_nodes=nodes)
        printed = _printed_gib(capsys.readouterr().out)
        assert len(calls) == len(printed) == 6
        for (kwargs, (cpu, gpu, _)), (_, gpu_gib) in zip(calls, printed):
            layout = Layout(
                3,
                "cpu" if kwargs["cpu_offload"] else "none",
                "cpu" if kwargs["cpu_offload_params"] else "none",
                num_gpus=per_node * nodes,
                gpus_per_node=per_node,
            )
            mem = train_memory(work, layout)
            assert _close(mem.model_states, gpu), (shape, layout, mem.model_states, gpu)
            assert abs(mem.model_states / GIB - gpu_gib) <= 0.006 + 0.01 * gpu_gib
            if kwargs["zero_init"]:  # Pylon builds ZeRO-3 models under zero.Init (pylon.models.build_model)
                # With offload DeepSpeed's estimate leaves out the module each process holds whole while it is
                # built (4 x largest layer); on small models with many GPUs a node's builds outweigh its states.
                cpu = max(cpu, mem.host_build * HOST_BUFFER_FACTOR)
                assert _close(mem.host_total, cpu), (shape, layout, mem.host_total, cpu)


def test_7b_fp32_with_adam_is_16_bytes_per_parameter_and_the_plan_says_what_it_counts() -> None:
    plan = plan_train(
        _train(precision="fp32", deepspeed={"zero_stage": 0}, scaling={"num_workers": 1, "use_gpu": True}),
        gpu="H100",
        gpus=1,
    )
    n = plan.work.shape.total_params
    assert 6.5e9 < n < 7.0e9  # Llama-2-7B's shape
    m = plan.requested_memory
    assert (m.params, m.grads, m.optimizer) == (4 * n, 4 * n, 8 * n)  # weights, gradients, Adam's two moments
    assert m.model_states == 16 * n and abs(16 * 7e9 - 112e9) < 1e9 and 100e9 < m.model_states < 115e9
    text = render(plan)
    assert "16 bytes per parameter" in text and "~112 GB" in text and "~56 GB" in text
    assert not plan.row("H100-SXM").requested.fits


def test_70b_in_bf16_needs_140_gb_of_weights_and_does_not_fit_one_h100(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    spec = DeploymentSpec(
        name="big",
        model=str(tmp_path),
        replica={"num_gpus": 1},
        engine={"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536},
    )
    plan = plan_serve(spec)
    h100 = next(r for r in plan.rows if r.accelerator.name == "H100-SXM")
    assert 135e9 < h100.weights < 142e9 and not h100.fits and "weights" in h100.binding
    mi300x = next(r for r in plan.rows if r.accelerator.name == "MI300X")
    assert mi300x.fits and plan.recommendation is mi300x
    # Training it: even the bf16 weights alone (ZeRO-2 keeps a full copy per GPU) exceed an H100.
    train = plan_train(
        _train(model={"config": LLAMA_70B}, scaling={"num_workers": 1, "use_gpu": True}, batch={"micro_batch_size": 1}),
        gpu="H100",
        gpus=1,
    )
    req = train.row("H100-SXM").requested
    assert req.memory.params > 135e9 and not req.fits and "GPU memory" in req.binding


def test_a_window_in_every_layer_fits_more_sequences_where_the_engine_lets_go_of_blocks(tmp_path: Path) -> None:
    """Mistral 7B v0.1's layout (a 4,096-token window in every layer) at 32,768 tokens: a sequence holds its window's
    blocks, so the same KV cache holds ~8x the sequences a full-attention copy of it does, in tensor-parallel shards
    too; in pipeline stages (where the engine keeps every block) it is planned as without the window."""
    mistral = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "vocab_size": 32000,
    }
    plans = {}
    for name, config, extra in (
        ("window", mistral, {}),
        ("full", {**mistral, "sliding_window": None}, {}),
        ("sharded", mistral, {"tensor_parallel": 2}),
        ("staged", mistral, {"pipeline_parallel": 2}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        engine = {"device": "cuda", "max_model_len": 32768, "kv_cache_tokens": 262144, **extra}
        replica = {"num_gpus": extra.get("tensor_parallel", 1)}
        deployment = DeploymentSpec(name="m", model=str(tmp_path / name), replica=replica, engine=engine)
        plans[name] = plan_serve(deployment, gpu="H100")
    window, full, sharded, staged = (plans[k].rows[0] for k in ("window", "full", "sharded", "staged"))
    assert window.kv_tokens_fit == full.kv_tokens_fit and full.sequences_fit == full.kv_tokens_fit // 32768
    assert (
        window.sequences_fit == window.kv_tokens_fit // (4096 + 16) and window.sequences_fit >= 7 * full.sequences_fit
    )
    assert any("attends within 4,096 tokens" in n for n in plans["window"].notes + plans["sharded"].notes)
    assert not any("attends within" in n for n in plans["staged"].notes + plans["full"].notes)
    assert sharded.sequences_fit == sharded.kv_tokens_fit // (4096 + 16)
    assert staged.sequences_fit == staged.kv_tokens_fit // 32768


def test_windowed_layers_mixed_with_full_ones_fit_more_sequences_where_the_kv_cache_is_in_groups(
    tmp_path: Path,
) -> None:
    """Gemma 3 27B's layout (five layers in six windowed at 1,024 tokens, ten full ones) at 32,768 tokens: the KV cache
    in groups of ten layers, a table each (kv_cache.HybridKVBlockPool), a sequence of 16,384 tokens holds as much as
    16,384 x 10/62 + (1,024 + 16) x 60/62 tokens in every layer: ~4.5x the sequences of one table for all at that
    length, 8x at 32,768, in tensor-parallel shards too (pipeline stages keep one table: planned as without the
    groups)."""
    gemma3 = {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(62)],
        "vocab_size": 262208,
    }
    plans = {}
    for name, extra in (("groups", {}), ("sharded", {"tensor_parallel": 2}), ("staged", {"pipeline_parallel": 2})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(gemma3))
        engine = {"device": "cuda", "max_model_len": 32768, "kv_cache_tokens": 262144, **extra}
        replica = {"num_gpus": extra.get("tensor_parallel", 1)}
        deployment = DeploymentSpec(name="m", model=str(tmp_path / name), replica=replica, engine=engine)
        plans[name] = plan_serve(deployment, gpu="H100")
    groups, sharded, staged = (plans[k].rows[0] for k in ("groups", "sharded", "staged"))
    longest, held = (math.ceil(n * 10 / 62 + 1040 * 60 / 62) for n in (32768, 16384))
    assert groups.sequences_fit == groups.kv_tokens_fit // longest >= 6 * (groups.kv_tokens_fit // 32768)
    assert groups.batch == groups.kv_tokens_fit // held >= 4 * (groups.kv_tokens_fit // 16384)
    assert sharded.sequences_fit == sharded.kv_tokens_fit // longest
    assert staged.sequences_fit == staged.kv_tokens_fit // 32768
    assert any("in 7 groups of 10 layers" in n for n in plans["groups"].notes + plans["sharded"].notes)
    assert not any("groups of" in n for n in plans["staged"].notes)


def test_the_prefix_cache_s_host_tier_is_counted_in_host_memory_not_the_gpu_s(tmp_path: Path) -> None:
    """engine.kv_offload_tokens: Llama 2 70B's 327,680 bytes a token (80 layers x 8 key-value heads x 128 x bf16 x K
    and V) for 1,048,576 tokens is 320 GiB of the replica's host memory, two engines' twice that; the GPU's rows are
    the same as without it."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    plans = {}
    disk = {"kv_offload_tokens": 1048576, "kv_offload_path": "/mnt/nvme"}
    on = {"kv_offload_tokens": 1048576}
    for name, extra in (("off", {}), ("on", on), ("two", on), ("disk", disk)):
        engine = {"device": "cuda", "kv_cache_tokens": 65536, **extra}
        if name == "two":
            engine["data_parallel"] = 2
        replica = {"num_gpus": engine.get("data_parallel", 1)}
        deployment = DeploymentSpec(name="m", model=str(tmp_path), replica=replica, engine=engine)
        plans[name] = plan_serve(deployment, gpu="H100")
    per_token = 80 * 8 * 128 * 2 * 2
    assert plans["on"].kv_per_token == per_token
    assert plans["on"].to_dict()["kv_offload_host_bytes"] == per_token * 1048576 == 320 * 2**30
    assert plans["two"].kv_offload_bytes == 2 * plans["on"].kv_offload_bytes and plans["off"].kv_offload_bytes == 0
    note = next(n for n in plans["on"].notes if "host tier" in n)
    assert "320.0 GiB" in note and "5.00 MiB" in note, note  # a block of 16 tokens
    assert plans["on"].rows[0].to_dict() == plans["off"].rows[0].to_dict()
    assert not any("host tier" in n for n in plans["off"].notes)
    on_disk = next(n for n in plans["disk"].notes if "host tier" in n)
    assert "of the replica's host memory, pinned" in note and "pinned" not in on_disk
    assert "320.0 GiB of disk under /mnt/nvme" in on_disk, on_disk


def test_prefill_replicas_are_counted_in_the_cost_and_their_blocks_in_bytes_a_prompt(tmp_path: Path) -> None:
    """`prefill`: two prefill replicas beside two decoding ones double what the deployment pays per decoding
    replica's tokens (a prefill replica of half a decoding one's GPUs: 1.5x); the memory rows are the same; the note
    says what a prompt of half max_model_len sends (Llama 2 70B: 327,680 bytes a token, 2,048 tokens: 640 MiB)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    engine = {"device": "cuda", "kv_cache_tokens": 65536, "max_model_len": 4096, "tensor_parallel": 2}
    common = {"name": "m", "model": str(tmp_path), "replica": {"num_gpus": 1}, "engine": engine}
    scaling = {"min_replicas": 2, "max_replicas": 4}
    off = plan_serve(DeploymentSpec(**common, autoscaling=scaling), gpu="H100")
    on = plan_serve(DeploymentSpec(**common, autoscaling=scaling, prefill={"replicas": 2}), gpu="H100")
    half = {"replicas": 2, "replica": {"num_gpus": 0.5}}
    cheaper = plan_serve(DeploymentSpec(**common, autoscaling=scaling, prefill=half), gpu="H100")
    a, b, c = off.rows[0], on.rows[0], cheaper.rows[0]
    assert (a.total, a.batch_tps) == (b.total, b.batch_tps)
    assert b.cost_per_million_tokens == pytest.approx(2 * a.cost_per_million_tokens)
    assert c.cost_per_million_tokens == pytest.approx(1.5 * a.cost_per_million_tokens)
    assert (
        b.to_dict()["cost_scale_for_prefill_replicas"] == 2.0 and "cost_scale_for_prefill_replicas" not in a.to_dict()
    )
    note = next(n for n in on.notes if n.startswith("prefill:"))
    assert "2 prefill replica(s) of this engine beside 2 decoding one(s)" in note, note
    assert "640.0 MiB of KV blocks" in note and "327,680 bytes a token" in note, note
    assert not any(n.startswith("prefill:") for n in off.notes)
    # Autoscaled prefill replicas: counted at their fewest, as the decoding ones are (1 beside 2: 1.5x)
    scaled = plan_serve(
        DeploymentSpec(**common, autoscaling=scaling, prefill={"autoscaling": {"min_replicas": 1, "max_replicas": 4}}),
        gpu="H100",
    )
    assert scaled.rows[0].cost_per_million_tokens == pytest.approx(1.5 * a.cost_per_million_tokens)
    note = next(n for n in scaled.notes if n.startswith("prefill:"))
    assert "1-4 prefill replica(s) of this engine beside 2 decoding one(s)" in note, note


def test_a_narrower_kv_cache_dtype_fits_more_tokens(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    plans = {
        kv: plan_serve(
            DeploymentSpec(
                name="big",
                model=str(tmp_path),
                replica={"num_gpus": 1},
                engine={"device": "cuda", "max_model_len": 4096, "kv_cache_dtype": kv},
            )
        )
        for kv in ("auto", "bf16", "fp8", "fp32")
    }
    per_token = {kv: p.kv_per_token for kv, p in plans.items()}
    # 80 layers x 8 KV heads x 128 dims x (K and V): 2 bytes each as the model computes on a GPU (bf16)
    assert per_token == {
        "auto": 80 * 8 * 128 * 2 * 2,
        "bf16": 80 * 8 * 128 * 2 * 2,
        "fp8": 80 * 8 * 128 * 2,
        "fp32": 80 * 8 * 128 * 2 * 4,
    }
    row = {kv: next(r for r in p.rows if r.accelerator.name == "MI300X") for kv, p in plans.items()}
    assert row["fp8"].kv_tokens_fit == pytest.approx(2 * row["bf16"].kv_tokens_fit, rel=1e-6)
    assert row["fp8"].kv_cache * 2 == row["bf16"].kv_cache and row["fp8"].weights == row["bf16"].weights


def test_7b_full_finetune_on_8_a100_80gb_is_plausible_and_explained() -> None:
    plan = plan_train(_train(steps=500, batch={"micro_batch_size": 8, "grad_accum_steps": 1}), gpu="A100-80GB", gpus=8)
    req = plan.row("A100-80GB").requested
    assert not req.fits and "activations" in req.binding  # micro-batch 8 x 4096 tokens without recomputation
    rec = plan.recommendation
    assert rec is not None and rec.accelerator.name == "A100-80GB" and rec.layout.num_gpus == 8
    assert not rec.layout.offloads and rec.layout.zero_stage >= 1  # 8 x 80 GB hold 7B's states without offload
    assert rec.memory.device_total <= 80 * GIB * USABLE_FRACTION
    lay = rec.layout
    assert lay.micro_batch_size * lay.grad_accum_steps * 8 == 64  # the global batch is kept
    # Time: the step's model FLOPs over 8 x 312 TFLOP/s x MFU (recomputation is inside the MFU, as papers report
    # it: it raises the HFU, not the time); cost: GPU-hours x price.
    flops = model_flops_per_token(plan.work.shape, 4096, False)
    compute = 500 * 64 * 4096 * flops / (8 * 312e12 * DEFAULT_MFU)
    assert rec.step.compute_s * 500 == pytest.approx(compute)
    assert compute <= rec.wall_s <= 1.1 * compute
    assert rec.cost == pytest.approx(rec.gpu_hours * 1.79)
    assert any("global batch of 64" in e for e in plan.explanation) and "Recommendation: 8 x A100-80GB" in render(plan)


def test_7b_on_one_rtx_4090_offloads_or_uses_lora() -> None:
    spec = _train(
        scaling={"num_workers": 1, "use_gpu": True}, batch={"micro_batch_size": 4, "grad_accum_steps": 8}, steps=100
    )
    plan = plan_train(spec, gpu="4090", gpus=1)
    rec = plan.recommendation
    assert rec is not None and rec.layout.num_gpus == 1
    assert rec.layout.offload_optimizer == "cpu"  # 6.7B x 16 bytes of optimizer state cannot sit in 24 GB
    assert rec.memory.device_total <= 24 * GIB * USABLE_FRACTION
    assert 100 * GIB < rec.memory.host_total <= rec.accelerator.host_memory_bytes
    assert rec.step.offload_s > 0 and any("offloading" in e for e in plan.explanation)
    lora, alt = plan.lora_alternative
    assert lora.target_modules == ["q_proj", "v_proj"] and not alt.layout.offloads
    assert any("LoRA" in e for e in plan.explanation)
    # A LoRA job trains only the adapters: their optimizer states are tiny, and it fits without offloading.
    lora_plan = plan_train(spec.model_copy(update={"lora": lora}), gpu="4090", gpus=1)
    shape = lora_plan.work.shape
    assert shape.trainable_params < shape.total_params / 100
    assert lora_plan.requested_memory.optimizer == 12 * shape.trainable_params
    assert not lora_plan.recommendation.layout.offloads


def test_memory_terms_follow_the_layout() -> None:
    config = model_config(ModelSpec(preset="llama-7b"), eos_id=0, pad_id=0)
    work = Workload(config, model_shape(config), "bf16", seq_len=2048)
    n = work.shape.total_params
    z3 = train_memory(work, Layout(3, num_gpus=8))
    nvme = train_memory(work, Layout(3, "nvme", "nvme", num_gpus=8))
    assert nvme.params < z3.params and nvme.optimizer == 0 and nvme.nvme == 12 * n + 2 * n  # per node, 8 GPUs
    ckpt = train_memory(work, Layout(2, gradient_checkpointing=True, micro_batch_size=2, num_gpus=8))
    full = train_memory(work, Layout(2, micro_batch_size=2, num_gpus=8))
    assert ckpt.activations < full.activations / 4
    assert train_memory(work, Layout(2, micro_batch_size=4, num_gpus=8)).activations > 1.9 * full.activations
    assert kv_bytes_per_token(work.shape, 2) == 2 * 32 * 32 * 128 * 2  # Llama-2-7B: 0.5 MiB per token


def test_grpo_plans_each_row_as_its_completions_and_a_reference_only_with_a_kl_term() -> None:
    from dataclasses import replace

    from pylon.plan.train import train_workload

    grpo = {"rewards": [{"function": "exact_match"}], "generations": 4, "max_completion_tokens": 512}
    work, notes = train_workload(_train(objective="grpo", grpo=grpo, data={"uri": "/nonexistent/p", "seq_len": 1024}))
    assert (work.rollouts, work.seq_len, work.reference) == (4, 1024 + 512, "none")
    assert any("objective grpo planned as 4 sequences" in n for n in notes)
    # its activations: those of a causal LM's micro-batch of 4x the rows, each as long as a prompt and a completion
    plain = train_workload(_train(data={"uri": "/nonexistent/p", "seq_len": 1536}))[0]
    layout = Layout(2, micro_batch_size=2, num_gpus=8)
    assert (
        train_memory(work, layout).activations == train_memory(plain, replace(layout, micro_batch_size=8)).activations
    )
    beta = {**grpo, "beta": 0.04}
    assert train_workload(_train(objective="grpo", grpo=beta))[0].reference == "copy"
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    assert train_workload(_train(objective="grpo", grpo=beta, lora=lora))[0].reference == "adapters"
    # objective rloo samples as grpo does: the same rows, and a reference with its KL term
    rloo, rloo_notes = train_workload(_train(objective="rloo", grpo=beta, data={"uri": "/x", "seq_len": 1024}))
    assert (rloo.rollouts, rloo.seq_len, rloo.reference) == (4, 1024 + 512, "copy")
    assert any("objective rloo planned as 4 sequences" in n for n in rloo_notes)
    # objective online_dpo: a pair a prompt, and DPO's reference whatever grpo.beta (it must be 0: dpo_beta is its)
    pair = {**grpo, "generations": 2}
    online = train_workload(_train(objective="online_dpo", grpo=pair, data={"uri": "/x", "seq_len": 1024}))[0]
    assert (online.rollouts, online.seq_len, online.reference) == (2, 1024 + 512, "copy")
    # sampling's peak: the completions' KV cache, and at ZeRO-3 the whole model gathered (the default), when larger
    from pylon.plan.memory import kv_bytes_per_token

    z3 = Layout(3, gradient_checkpointing=True, micro_batch_size=1, num_gpus=8)
    z2 = Layout(2, gradient_checkpointing=True, micro_batch_size=1, num_gpus=8)
    assert work.gathered_sampling
    gathered, per_layer = train_memory(work, z3), train_memory(replace(work, gathered_sampling=False), z3)
    s = work.shape
    whole = 2 * s.total_params - gathered.params  # bf16: all but what the GPU holds anyway
    kv = kv_bytes_per_token(s, 2) * 4 * work.seq_len
    assert gathered.activations == max(per_layer.activations, kv + whole) > per_layer.activations
    assert "the whole model gathered" in gathered.notes["activations"]
    assert train_memory(work, z2).activations == train_memory(replace(work, gathered_sampling=False), z2).activations


def test_a_grpo_engine_sampler_is_planned_as_the_model_whole_and_its_kv_cache_on_every_worker() -> None:
    from dataclasses import replace

    from pylon.plan.memory import kv_bytes_per_token
    from pylon.plan.train import train_workload

    grpo = {"rewards": [{"function": "exact_match"}], "generations": 4, "max_completion_tokens": 512}
    data = {"uri": "/nonexistent/p", "seq_len": 1024}
    model = train_workload(_train(objective="grpo", grpo=grpo, data=data))[0]
    work, notes = train_workload(_train(objective="grpo", grpo={**grpo, "sampler": "engine"}, data=data))
    rows = _train().batch.micro_batch_size
    assert work.sampler_kv_tokens == max(4096, rows * (1024 + 4 * 512)) and model.sampler_kv_tokens == 0
    assert not work.gathered_sampling  # (the engine samples: the trained model is never gathered for it)
    assert any("grpo.sampler engine: a serving engine on every worker" in n for n in notes)
    z3 = Layout(3, gradient_checkpointing=True, micro_batch_size=1, num_gpus=8)
    engine, plain = train_memory(work, z3), train_memory(replace(model, gathered_sampling=False), z3)
    s = work.shape
    assert engine.sampler == 2 * s.total_params + kv_bytes_per_token(s, 2) * work.sampler_kv_tokens  # bf16
    assert ("sampling engine", engine.sampler) in engine.device_terms()
    assert engine.allocated - engine.sampler <= plain.allocated  # no sampling peak of the trained model's own
    # on CPU workers the engine computes in fp32; a smaller KV cache asked for is what is planned
    small = train_workload(
        _train(objective="grpo", grpo={**grpo, "sampler": "engine", "sampler_kv_cache_tokens": 8192}, data=data)
    )[0]
    cpu = train_memory(small, z3, device="cpu")
    assert cpu.sampler == 4 * s.total_params + kv_bytes_per_token(s, 4) * 8192


def test_a_grpo_server_sampler_holds_nothing_on_the_workers_and_batches_their_rows_together() -> None:
    """grpo.sampler server: the engine's weights and KV cache are on the servers (a note says how much), not in a
    worker's memory; a server's waves hold the rows of every worker it samples for, and the weights go to it over the
    network once a step besides the engine's copy."""
    from dataclasses import replace

    from pylon.plan.catalog import load_catalog
    from pylon.plan.steptime import sampling_time
    from pylon.plan.train import train_workload

    h100 = next(a for a in load_catalog().accelerators if a.name == "H100-SXM")
    grpo = {"rewards": [{"function": "exact_match"}], "generations": 8, "max_completion_tokens": 256}
    data = {"uri": "/nonexistent/p", "seq_len": 512}
    scaling = {"num_workers": 8, "use_gpu": True}
    engine = train_workload(_train(model={"preset": "llama-7b"}, objective="grpo", scaling=scaling,
                                   grpo={**grpo, "sampler": "engine"}, data=data))[0]  # fmt: skip
    server, notes = train_workload(
        _train(model={"preset": "llama-7b"}, objective="grpo", scaling=scaling, data=data,
               grpo={**grpo, "sampler": "server", "sampler_servers": 2, "sampler_resources": {"GPU": 1}})
    )  # fmt: skip
    assert (server.sampler_servers, server.sampler_server_gpus) == (2, 1.0) and engine.sampler_servers == 0
    assert (
        server.sampler_kv_tokens == 4 * engine.sampler_kv_tokens and not server.gathered_sampling
    )  # 4 workers a server
    assert any("grpo.sampler server: 2 sampling server(s) of {'GPU': 1.0}" in n and "up to 4 worker(s)" in n
               for n in notes), notes  # fmt: skip
    z3 = Layout(3, gradient_checkpointing=True, micro_batch_size=1, num_gpus=8)
    on_workers, served = train_memory(engine, z3), train_memory(server, z3)
    assert on_workers.sampler > 0 and served.sampler == 0
    assert served.allocated == on_workers.allocated - on_workers.sampler
    assert "sampling servers" in served.notes
    # 4 workers' rows (4 x 8 completions) in waves of 64 on a server: 2 waves where one worker's would take 1
    one = Layout(2, micro_batch_size=4, num_gpus=8)
    alone = replace(server, sampler_servers=8)
    assert sampling_time(server, one, h100, 0.4) > 1.5 * sampling_time(alone, one, h100, 0.4)
    # and the weights sent once a step: more than the colocated engine's copy alone, with the same rows
    assert sampling_time(alone, one, h100, 0.4) > sampling_time(engine, one, h100, 0.4)
    # the servers' GPUs are paid for: 8 workers' and 2 servers' GPU-hours
    from pylon.plan.train import evaluate

    option = evaluate(server, one, h100, steps=100, mfu=0.4)
    assert option.gpu_hours == pytest.approx(option.wall_s / 3600 * 10)
    assert evaluate(engine, one, h100, steps=100, mfu=0.4).extra_gpus == 0
    # a server's GPU holds the model whole (bf16) and its KV cache: a 7B model's fits an H100, not a 16 GiB GPU
    from pylon.plan.memory import CUDA_RUNTIME_BYTES, kv_bytes_per_token, sampler_server_bytes

    s = server.shape
    held = 2 * s.total_params + kv_bytes_per_token(s, 2) * server.sampler_kv_tokens + CUDA_RUNTIME_BYTES
    assert sampler_server_bytes(server) == held and sampler_server_bytes(engine) == 0
    assert "grpo.sampler server" not in option.binding  # (an H100 holds a server)
    small = replace(h100, name="small", memory_gib=16)
    refused = evaluate(server, Layout(3, micro_batch_size=1, num_gpus=8), small, steps=100, mfu=0.4)
    assert not refused.fits and refused.binding.startswith("a grpo.sampler server's GPU memory"), refused.binding


def test_dpo_counts_its_reference_models_forward_and_a_frozen_copy_without_lora() -> None:
    from dataclasses import replace

    from pylon.plan.train import train_workload

    lora = {"r": 16, "target_modules": ["q_proj", "v_proj"]}
    plain = train_workload(_train())[0]
    full = train_workload(_train(objective="dpo"))[0]
    adapters = train_workload(_train(objective="dpo", lora=lora))[0]
    assert (plain.reference, full.reference, adapters.reference) == ("none", "copy", "adapters")
    assert train_workload(_train(objective="orpo"))[0].reference == "none"  # reference-free
    ahead, ahead_notes = train_workload(_train(objective="dpo", precompute_reference=True))
    assert ahead.reference == "none" and any("precompute_reference" in n for n in ahead_notes)
    kto, kto_notes = train_workload(_train(objective="kto"))
    assert kto.reference == "copy" and train_workload(_train(objective="kto", lora=lora))[0].reference == "adapters"
    assert any("objective kto's KL baseline" in n for n in kto_notes)
    apo = train_workload(_train(objective="kto", kto_loss="apo_zero_unpaired"))[1]
    assert not any("KL baseline" in n for n in apo)  # (no baseline, no mismatched passes)
    s, seq = plain.shape, plain.seq_len
    forward = 2 * s.matmul_params + 4 * s.num_layers * s.hidden_size * seq  # a third of a trained token's FLOPs
    assert model_flops_per_token(s, seq, False, True) == model_flops_per_token(s, seq, False) + forward
    assert abs(model_flops_per_token(s, seq, False, True) / model_flops_per_token(s, seq, False) - 4 / 3) < 1e-9
    reward = train_workload(_train(objective="reward"))[0]  # a reward model: a scalar head for the lm_head
    assert reward.reference == "none"
    assert plain.shape.total_params - reward.shape.total_params == (s.vocab_size - 1) * s.hidden_size
    # and no vocabulary's logits: its step's activations are smaller by at least their bf16 and fp32 copies
    one = Layout(2, micro_batch_size=1, num_gpus=8)
    logits = seq * s.vocab_size * (2 + 4)
    assert train_memory(plain, one).activations - train_memory(reward, one).activations > logits
    n = s.total_params
    for layout, device, host in (
        (Layout(2, num_gpus=8), 2 * n, 0),  # whole on every GPU, bf16
        (Layout(3, num_gpus=8), 2 * n / 8, 0),  # a partition
        (Layout(3, offload_param="cpu", num_gpus=8), 0, 2 * n),  # with the partitions in host RAM: 8 GPUs a node
    ):
        with_copy, without = train_memory(full, layout), train_memory(replace(full, reference="none"), layout)
        assert with_copy.reference == int(device) and with_copy.allocated - without.allocated == int(device)
        assert with_copy.host_states - without.host_states == int(host), layout
        assert ("reference model" in dict(with_copy.device_terms())) == bool(device)
        assert train_memory(adapters, layout).reference == 0  # LoRA: the model itself, its adapters disabled
    # at ZeRO-3 the copy is gathered for its forward pass as the model is: a third more bytes than forward, backward
    from pylon.plan.steptime import RING_STEP_LATENCY_S, collective_gbs, collectives

    h100 = load_catalog().get("H100-SXM")
    z3 = Layout(3, num_gpus=8)
    gathered = 2 * n * 7 / 8  # bf16 weights, each GPU's ring share
    extra = collectives(full, z3, h100)[0] - collectives(replace(full, reference="none"), z3, h100)[0]
    assert abs(extra - (gathered / (collective_gbs(h100, 8) * 1e9) + s.num_layers * 7 * RING_STEP_LATENCY_S)) < 1e-9
    assert collectives(adapters, z3, h100) == collectives(replace(adapters, reference="none"), z3, h100)


def test_pylon_plan_cli_json_and_table(tmp_path: Path, capsys) -> None:
    from pylon.cli import main

    spec = tmp_path / "train.yaml"
    spec.write_text(yaml.safe_dump(_train().model_dump(mode="json")))
    assert main(["plan", str(spec), "--json", "--gpu", "H100", "--mfu", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    (plan,) = out["plans"]
    assert plan["kind"] == "TrainJob" and plan["assumptions"]["mfu"] == 0.5
    assert [a["name"] for a in plan["accelerators"]] == ["H100-SXM"]
    assert plan["recommendation"]["fits"] and plan["recommendation"]["cost_usd"] > 0
    assert main(["plan", str(spec), "--gpus", "8"]) == 0
    text = capsys.readouterr().out
    assert "Per accelerator" in text and "MI300X" in text and "RTX-4090" in text and "Recommendation:" in text


def test_prices_come_from_a_file_or_the_environment(tmp_path: Path, monkeypatch, capsys) -> None:
    from pylon.cli import main

    spec = tmp_path / "train.yaml"
    spec.write_text(yaml.safe_dump(_train(steps=10000).model_dump(mode="json")))
    prices = tmp_path / "prices.yaml"
    prices.write_text("H100: 1.0\n")
    assert main(["plan", str(spec), "--json", "--gpu", "H100", "--gpus", "8", "--prices", str(prices)]) == 0
    rec = json.loads(capsys.readouterr().out)["plans"][0]["recommendation"]
    assert rec["cost_usd"] == pytest.approx(rec["gpu_hours"] * 1.0, rel=1e-3)
    monkeypatch.setenv("PYLON_GPU_PRICES", str(prices))
    assert load_catalog().get("H100").price_per_gpu_hour == 1.0


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    from pylon.cli import main

    spec = tmp_path / "train.yaml"
    spec.write_text(yaml.safe_dump(_train().model_dump(mode="json")))
    assert main(["plan", str(spec), "--gpu", "B300"]) == 1
    err = capsys.readouterr().err
    assert "unknown GPU 'B300'" in err and "H100-SXM" in err and "Traceback" not in err
    with pytest.raises(PylonError, match="unknown GPU 'nope'"):
        plan_train(_train(), gpu="nope")
    assert main(["plan", str(spec), "--mfu", "3"]) == 1
    assert "mfu" in capsys.readouterr().err
    no_seq = tmp_path / "noseq.yaml"
    no_seq.write_text(yaml.safe_dump({**_train().model_dump(mode="json"), "data": {"uri": str(tmp_path / "none")}}))
    assert main(["plan", str(no_seq)]) == 1
    assert "data.seq_len" in capsys.readouterr().err


def test_client_plan_needs_no_cluster(tmp_path: Path) -> None:
    from pylon.sdk.client import Client

    client = Client("http://127.0.0.1:1")  # nothing listens there
    fields = {k: v for k, v in _train().model_dump(mode="json").items() if k != "kind"}
    plan = client.plan(fields, gpu="H100", gpus=8)
    assert plan.kind == "TrainJob" and plan.recommendation is not None and plan.to_dict()["name"] == "job"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_train().model_dump(mode="json")))
    assert client.plan(str(path), gpu="H100").name == "job"
    assert client.plan(_train(), gpu="H100").recommendation is not None


def test_pylon_train_refuses_what_cannot_fit(tmp_path: Path, monkeypatch) -> None:
    from pylon.sdk.client import Client

    monkeypatch.setenv("PYLON_HOME", str(tmp_path))  # client.train writes the spec there before submitting

    spec = _train(
        scaling={"num_workers": 1, "use_gpu": True, "resources_per_worker": {"GPU": 1, "accelerator_type:H100": 0.001}}
    )
    with pytest.raises(WontFitError) as e:
        check_fits(spec)
    message = str(e.value)
    assert "1 x H100-SXM" in message and "GPU memory" in message and "Recommendation" in message
    assert "--force" in message
    # No GPU type named anywhere: refused only if no GPU in the catalog could hold it.
    with pytest.raises(WontFitError, match="any kind"):
        check_fits(_train(model={"config": LLAMA_70B}, scaling={"num_workers": 1, "use_gpu": True}))
    # A tiny CPU job (what the test suite trains) passes.
    check_fits(
        TrainJobSpec.model_validate(
            {"name": "tiny", "model": {"preset": "gpt-tiny"}, "data": {"uri": "corpus/", "seq_len": 64}, "steps": 10}
        )
    )
    # client.train refuses before it contacts the cluster; force=True goes on to submit.
    client = Client("http://127.0.0.1:1")
    with pytest.raises(WontFitError):
        client.train(spec)
    with pytest.raises(Exception) as e:
        client.train(spec, force=True)
    assert not isinstance(e.value, WontFitError)


def test_a_files_deployment_of_its_own_training_run_is_planned_with_that_model(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[3] / "platform" / "pylon" / "examples" / "stdlib-gpt.yaml").read_text()
    f = tmp_path / "demo.yaml"
    f.write_text(text.replace("demo/", str(tmp_path / "demo") + "/"))
    plans, skipped = plan_file(f, gpu="L40S")
    assert [p.kind for p in plans] == ["TrainJob", "Deployment"] and "Dataset" in skipped[0]
    assert plans[1].shape.total_params == plans[0].work.shape.total_params
    assert plans[0].cpu_worker_bytes is not None  # the demo trains on CPU workers


def test_a_batch_job_is_planned_as_the_deployment_each_of_its_engines_is(tmp_path: Path, capsys) -> None:
    """`pylon plan batch.yaml`: a BatchJob's engines are its Deployment (`BatchJobSpec.deployment()`): the same plan,
    from the file and from the spec; the CLI prints it."""
    from pylon.cli import main
    from pylon.plan import plan_spec
    from pylon.specs import BatchJobSpec

    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(LLAMA_70B))
    batch = {
        "kind": "BatchJob",
        "name": "answers",
        "model": str(tmp_path / "big"),
        "input": str(tmp_path / "requests.jsonl"),
        "output": str(tmp_path / "out"),
        "replicas": 2,
        "replica": {"num_gpus": 1},
        "engine": {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536},
    }
    f = tmp_path / "batch.yaml"
    f.write_text(yaml.safe_dump(batch))
    (plan,), skipped = plan_file(f, gpu="H100-SXM")
    spec = BatchJobSpec.model_validate(batch)
    assert not skipped and plan.kind == "Deployment" and plan.name == "answers"
    assert (
        plan.to_dict()
        == plan_spec(spec.deployment(), gpu="H100-SXM").to_dict()
        == plan_spec(spec, gpu="H100-SXM").to_dict()
    )
    assert 65e9 < plan.shape.total_params < 75e9  # (the 70B's shape, read from its directory)
    assert main(["plan", str(f), "--gpu", "H100-SXM"]) == 0
    assert "answers" in capsys.readouterr().out
    # its JSON (a serving plan's assumptions have no deadline or budget: to_dict failed on them)
    assert main(["plan", str(f), "--gpu", "H100-SXM", "--json"]) == 0
    (planned,) = json.loads(capsys.readouterr().out)["plans"]
    assert planned["kind"] == "Deployment" and "deadline_days" not in planned["assumptions"]


def test_a_draft_model_counts_its_weights_and_its_kv_cache(tmp_path: Path) -> None:
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(LLAMA_70B))
    small = {**LLAMA_70B, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8}
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(small))
    engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536}

    def plan(**speculative):
        spec = DeploymentSpec(
            name="big", model=str(tmp_path / "big"), replica={"num_gpus": 1}, engine={**engine, **speculative}
        )
        return plan_serve(spec)

    plain = plan()
    spec = plan(speculative={"method": "draft", "draft_model": str(tmp_path / "small"), "num_tokens": 4})
    without, with_draft = (next(r for r in p.rows if r.accelerator.name == "MI300X") for p in (plain, spec))
    draft_shape = model_shape(model_config(ModelSpec(config=small)))
    assert with_draft.weights - without.weights == draft_shape.total_params * 2  # bf16
    draft_tokens = 65536 + 64 * (4 + 16)  # the engine's cache plus each running request's drafts
    draft_per_token = 8 * 8 * 32 * 2 * 2  # 8 layers x 8 KV heads x 32 dims (2048 / 64 heads) x K and V x bf16
    assert with_draft.kv_cache - without.kv_cache == draft_tokens * draft_per_token
    assert with_draft.kv_tokens_fit < without.kv_tokens_fit
    assert any("draft model" in n for n in spec.notes)
    with pytest.raises(PylonError, match=r"engine\.speculative\.draft_model .*absent"):
        plan(speculative={"method": "draft", "draft_model": str(tmp_path / "absent")})


def test_lora_adapters_count_their_weights(tmp_path: Path) -> None:
    """engine.adapters: each adapter's A and B at the engine's dtype, from its adapter_config.json (rank, targets),
    hand-counted here for Llama 2 70B's shapes."""
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(LLAMA_70B))
    for name, r, targets in (("a", 16, ["q_proj", "v_proj"]), ("b", 8, ["down_proj"])):
        (tmp_path / name).mkdir()
        config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))

    def plan(*names: str):
        adapters = [{"name": f"x-{n}", "path": str(tmp_path / n)} for n in names]
        engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536, "adapters": adapters}
        spec = DeploymentSpec(name="big", model=str(tmp_path / "big"), replica={"num_gpus": 1}, engine=engine)
        return plan_serve(spec)

    plain, adapted = plan(), plan("a", "b")
    without, with_adapters = (next(r for r in p.rows if r.accelerator.name == "MI300X") for p in (plain, adapted))
    hidden, kv_width, mlp, layers = 8192, 8 * 128, 28672, 80
    a = 16 * ((hidden + hidden) + (hidden + kv_width)) * layers  # q: 8192 -> 8192, v: 8192 -> 1024
    b = 8 * (mlp + hidden) * layers  # down: 28672 -> 8192
    assert with_adapters.weights - without.weights == (a + b) * 2  # bf16
    assert any("2 LoRA adapter(s)" in n for n in adapted.notes)
    with pytest.raises(PylonError, match=r"engine\.adapters\[0\]\.path .*absent.*cannot read adapter_config\.json"):
        plan("absent")


def test_adapters_loaded_on_demand_count_max_loaded_adapters_of_max_rank(tmp_path: Path) -> None:
    """engine.dynamic_adapters: room for max_loaded adapters of max_rank on all seven projections, hand-counted for
    Llama 2 70B's shapes (the root is not read: its adapters are not known before they are asked for)."""
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(LLAMA_70B))

    def plan(dynamic: dict | None):
        engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536}
        if dynamic is not None:
            engine["dynamic_adapters"] = dynamic
        spec = DeploymentSpec(name="big", model=str(tmp_path / "big"), replica={"num_gpus": 1}, engine=engine)
        return next(r for r in plan_serve(spec).rows if r.accelerator.name == "MI300X"), plan_serve(spec).notes

    (plain, _), (room, notes) = plan(None), plan({"root": "s3://adapters/big", "max_loaded": 4, "max_rank": 16})
    h, kv, mlp, layers = 8192, 8 * 128, 28672, 80
    per_layer = 16 * (2 * h + 2 * (h + kv) + 2 * h + 2 * (h + mlp) + (mlp + h))  # q, k, v, o, gate, up, down
    assert room.weights - plain.weights == 4 * per_layer * layers * 2  # bf16
    assert any("4 LoRA adapter(s) loaded on demand, rank up to 16" in n for n in notes)


def test_adapters_loaded_on_demand_on_phi3_adapt_its_fused_projections(tmp_path: Path) -> None:
    """Phi-3's adapters target its fused projections (serving/model/lora.py's PROJECTIONS["phi3"]: qkv_proj, o_proj,
    gate_up_proj, down_proj), hand-counted for Phi-3-mini's shapes."""
    phi3_mini = {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 32064,
    }
    (tmp_path / "phi3").mkdir()
    (tmp_path / "phi3" / "config.json").write_text(json.dumps(phi3_mini))

    def plan(dynamic: dict | None):
        engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536}
        if dynamic is not None:
            engine["dynamic_adapters"] = dynamic
        spec = DeploymentSpec(name="phi3", model=str(tmp_path / "phi3"), replica={"num_gpus": 1}, engine=engine)
        return next(r for r in plan_serve(spec).rows if r.accelerator.name == "MI300X")

    plain, room = plan(None), plan({"root": "s3://adapters/phi3", "max_loaded": 2, "max_rank": 8})
    h, mlp, layers = 3072, 8192, 32
    per_layer = 8 * ((h + 3 * h) + 2 * h + (h + 2 * mlp) + (mlp + h))  # qkv, o, gate_up, down
    assert room.weights - plain.weights == 2 * per_layer * layers * 2  # bf16


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1's config.json (the fields that shape it)
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "vocab_size": 32000,
}


def test_a_mixture_of_experts_model_counts_every_expert_in_memory_and_the_ones_a_token_runs_in_flops(
    tmp_path: Path,
) -> None:
    """Mixtral 8x7B, hand-counted: 46.7B parameters held (its model card's figure), 12.9B active (12.75B in a matmul:
    the input embeddings are a lookup); int8 shrinks the experts with the other projections (the router stays);
    a decode step of one token reads a quarter of the experts, a step of many nearly all of them."""
    from pylon.models import flops_per_token
    from pylon.plan.serve import experts_read

    config = model_config(ModelSpec(config=MIXTRAL_8X7B))
    shape = model_shape(config)
    h, kv, mlp, layers, vocab = 4096, 1024, 14336, 32, 32000
    attention = 2 * h * h + 2 * h * kv
    experts = 8 * 3 * h * mlp
    per_layer = attention + experts + 8 * h + 2 * h  # + router, two norms
    assert shape.total_params == per_layer * layers + 2 * vocab * h + h == 46_702_792_704
    assert shape.expert_params == experts * layers and shape.expert_share == 0.25
    active = (attention + experts // 4 + 8 * h + 2 * h) * layers + vocab * h + h
    assert shape.matmul_params == active == 12_748_853_248
    assert flops_per_token(config, 4096) == 6.0 * active + 12.0 * layers * h * 4096
    assert shape.projection_params == (attention + experts) * layers  # what int8 quantizes: experts included
    assert experts_read(shape, 1) == 0.25 and experts_read(shape, 64) > 0.999

    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL_8X7B))

    def plan(quantization: str):
        engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536, "quantization": quantization}
        spec = DeploymentSpec(name="mixtral", model=str(tmp_path / "mixtral"), replica={"num_gpus": 1}, engine=engine)
        result = plan_serve(spec)
        return next(r for r in result.rows if r.accelerator.name == "H200"), result

    (bf16, result), (int8, quantized) = plan("none"), plan("int8")
    notes = result.notes
    assert bf16.weights == 46_702_792_704 * 2
    assert int8.weights == bf16.weights - shape.projection_params + shape.projection_channels * 4
    # the plan's text says the weights as loaded: int8's, not bf16's
    assert "weights 87.0 GiB," in render(result) and "weights 43.8 GiB," in render(quantized)
    assert any("mixture of experts" in n and "25%" in n for n in notes)
    # One sequence reads the dense part and a quarter of the experts: decodes well past a dense model of its size.
    dense_bound = bf16.accelerator.bandwidth_gbs * 1e9 * 0.8 / bf16.weights
    assert bf16.single_stream_tps > 2 * dense_bound
    # In bf16 it fits no H100 (80 GB) whole: the first way out named is 2 tensor-parallel shards on one node, every
    # expert split in two (pylon.serving.model.tensor), each shard holding half of the model (the vocabulary's rows too)
    engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536}
    spec = DeploymentSpec(name="mixtral", model=str(tmp_path / "mixtral"), replica={"num_gpus": 1}, engine=engine)
    h100 = plan_serve(spec, gpu="H100-SXM")
    assert h100.recommendation is None
    assert h100.notes[1].startswith(
        "it fits no one GPU as asked; in 2 tensor-parallel shards on one node (engine.tensor_parallel: 2, one GPU a "
        "shard) it fits H100-SXM: $"
    ), h100.notes
    engine["tensor_parallel"] = 2
    spec = DeploymentSpec(name="mixtral", model=str(tmp_path / "mixtral"), replica={"num_gpus": 1}, engine=engine)
    two = plan_serve(spec, gpu="H100-SXM").rows[0]
    assert two.fits and two.split == "shard" and two.weights == bf16.weights // 2


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json (the fields that shape it)
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_shards_past_the_key_value_heads_count_hold_one_head_each(tmp_path: Path) -> None:
    """Qwen3-30B-A3B has 4 key-value heads: in 8 tensor-parallel shards each holds one (every head on two shards), so a
    shard's KV cache is a quarter of a token's, not an eighth; in 4 shards a quarter too, in 2 a half."""
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    shape = model_shape(model_config(ModelSpec(config=QWEN3_30B_A3B)))
    per_token = kv_bytes_per_token(shape, 2)

    def kv(shards: int) -> tuple[int, list[str]]:
        engine = {"device": "cuda", "tensor_parallel": shards, "kv_cache_tokens": 8192, "max_model_len": 4096}
        spec = DeploymentSpec(name="qwen", model=str(tmp_path / "qwen"), replica={"num_gpus": 1}, engine=engine)
        plan = plan_serve(spec, gpu="H100-SXM")
        return plan.rows[0].kv_cache, plan.notes

    assert kv(2)[0] == 8192 * (per_token // 2)
    assert kv(4)[0] == kv(8)[0] == 8192 * (per_token // 4)
    notes = kv(8)[1]
    assert any("one of the 4 key-value heads a shard, each held by 2" in n for n in notes), notes
    assert not any("key-value heads a shard" in n for n in kv(4)[1])


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json (its MXFP4 quantization_config aside)
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
}


def test_gpt_oss_is_counted_with_its_biases_sinks_and_experts_as_stored() -> None:
    """gpt-oss-20b, hand-counted: 20.9B parameters (its model card's 21B), 3.6B active per token; its experts' weights
    stored [experts, in, out], so their output channels (one int8 scale each) are counted along the last dimension."""
    shape = model_shape(model_config(ModelSpec(config=GPT_OSS_20B)))
    h, heads, kv, d, experts, inter, layers, vocab = 2880, 64, 8, 64, 32, 2880, 24, 201088
    attention = 2 * h * heads * d + 2 * h * kv * d + heads * d + 2 * kv * d + h + heads  # biases and sinks
    expert_weights = experts * (h * 2 * inter + 2 * inter + inter * h + h)
    router = experts * h + experts
    per_layer = attention + expert_weights + router + 2 * h
    assert shape.total_params == per_layer * layers + 2 * vocab * h + h == 20_914_757_184
    assert shape.expert_params == experts * 3 * h * inter * layers and shape.expert_share == 0.125
    attention_channels = heads * d + 2 * kv * d + h
    assert shape.projection_channels == (attention_channels + experts * (2 * inter + h)) * layers
    active = shape.total_params - shape.expert_params * 7 // 8 - vocab * h
    assert 3.5e9 < active < 3.7e9  # the model card's 3.6B active


def test_an_mxfp4_checkpoint_is_planned_as_the_engine_loads_it(tmp_path: Path) -> None:
    """gpt-oss ships its experts in MXFP4; the engine dequantizes them at load, so the plan counts bf16 weights (and
    int8's with engine.quantization) and says so."""
    directory = tmp_path / "gpt-oss-20b"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({**GPT_OSS_20B, "quantization_config": {"quant_method": "mxfp4"}})
    )

    def plan(quantization: str):
        engine = {"device": "cuda", "max_model_len": 4096, "kv_cache_tokens": 65536, "quantization": quantization}
        spec = DeploymentSpec(name="oss", model=str(directory), replica={"num_gpus": 1}, engine=engine)
        result = plan_serve(spec)
        return next(r for r in result.rows if r.accelerator.name == "H200"), result.notes

    (bf16, notes), (int8, quantized_notes) = plan("none"), plan("int8")
    assert bf16.weights == 20_914_757_184 * 2 and int8.weights < 0.6 * bf16.weights
    assert any("MXFP4" in n and "dequantizes them at load to bf16" in n and "int8" in n for n in notes)
    assert any("MXFP4" in n and "halves" not in n for n in quantized_notes)


def test_deepseek_v3_is_counted_with_its_latent_cache() -> None:
    """DeepSeek-V3 (transformers' default config is V3's): 671B parameters held and 37B active, as its model card says
    (its multi-token-prediction layer, not loaded, aside), and a KV cache of one 512-number latent and its 64 rotated
    numbers a token and layer, its key and its value at once: 61 x 576 x 2 bytes in bf16, not the
    61 x 128 heads x (192 + 128) x 2 bytes of expanded keys and values."""
    from transformers import AutoConfig

    shape = model_shape(AutoConfig.for_model("deepseek_v3"))
    assert round(shape.total_params / 1e9) == 671 and round(shape.matmul_params / 1e9) in (36, 37)
    assert (shape.kv_heads, shape.head_dim) == (1, 576)
    assert kv_bytes_per_token(shape, 2) == 61 * 576 * 2


def test_deepseek_v3_in_eight_shards_holds_an_eighth_of_its_weights_and_the_whole_latent_cache() -> None:
    """DeepSeek-V3 in fp8 (engine.quantization) in 8 tensor-parallel shards: each holds an eighth of the weights (its
    heads' query and kv_b rows, its slice of every expert), but every token's whole latent: its KV cache is the whole
    model's, not an eighth; in bf16 (its FP8 checkpoint read dequantized) no one node of 8 GPUs considered holds it."""
    from transformers import AutoConfig

    # (as DeepSeek publishes it: FP8 in blocks of 128 x 128, read dequantized)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = AutoConfig.for_model("deepseek_v3", quantization_config=fp8)
    tokens = 32768

    def plan(shards: int, quantization: str = "fp8"):
        engine = {"tensor_parallel": shards, "kv_cache_tokens": tokens, "max_model_len": 8192}
        spec = DeploymentSpec(
            name="v3", model="s3://b/m", replica={"num_gpus": 1}, engine={**engine, "quantization": quantization}
        )
        result = plan_serve(spec, config=config)
        return next(r for r in result.rows if r.accelerator.name == "H200"), result

    eight, result = plan(8)
    one, _ = plan(1)
    assert eight.fits and not one.fits and eight.gpus == 8
    assert eight.weights == pytest.approx(one.weights / 8, rel=0.01)
    assert eight.kv_cache == one.kv_cache == tokens * kv_bytes_per_token(result.shape, 2)
    assert any("but each token's whole latent on every shard" in n for n in result.notes), result.notes
    assert any("FP8 in blocks of 128x128" in n and "halves" not in n for n in result.notes), result.notes
    bf16, result = plan(8, "none")
    assert not bf16.fits and 1.9 * eight.weights < bf16.weights < 2 * eight.weights  # (embeddings, norms: bf16)
    assert any("reads it dequantized to bf16" in n and "fp8 (or int8) halves it again" in n for n in result.notes)


def test_a_gptq_or_awq_checkpoint_is_counted_dequantized_and_named_with_its_bits_and_groups() -> None:
    """The "-GPTQ-Int4" and "-AWQ" releases: read dequantized (serving/model/stored.py), so they weigh as the float
    model, the note naming their layout and what their projections take on disk (a quarter of bf16's at 4 bits)."""
    from transformers import AutoConfig

    spec = DeploymentSpec(name="q", model="s3://b/m", replica={"num_gpus": 1}, engine={"max_model_len": 4096})
    plain = plan_serve(spec, config=AutoConfig.for_model("qwen2", num_hidden_layers=4))
    for quantized, named in (
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
            "GPTQ (4-bit weights, groups of 128)",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}, "AWQ (4-bit weights, groups of 64)"),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1}, "GPTQ (8-bit weights, one group a column)"),
    ):
        config = AutoConfig.for_model("qwen2", num_hidden_layers=4, quantization_config=quantized)
        result = plan_serve(spec, config=config)
        assert result.rows[0].weights == plain.rows[0].weights  # (dequantized to the engine's dtype)
        note = next(n for n in result.notes if n.startswith("the checkpoint is "))
        assert named in note and "reads it dequantized to" in note, note


def test_deepseek_v3_in_bf16_is_planned_across_two_nodes_of_eight_shards() -> None:
    """DeepSeek-V3 in bf16 fits no GPU, nor one node of 8: the plan says in how many pipeline stages of 8
    tensor-parallel shards it fits (vLLM's TP 8 x PP n), and planned so, a shard holds an eighth of its stage's
    weights (the largest stage's: 31 of the 61 layers) and its stage's layers' whole latent cache; the replica's
    GPUs are all of them."""
    from transformers import AutoConfig

    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = AutoConfig.for_model("deepseek_v3", quantization_config=fp8)
    tokens = 32768

    def plan(**engine):
        engine = {"kv_cache_tokens": tokens, "max_model_len": 8192, **engine}
        spec = DeploymentSpec(name="v3", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        result = plan_serve(spec, config=config, gpu="H200")
        return result.rows[0], result

    whole, result = plan()
    assert not whole.fits
    said = next(n for n in result.notes if "pipeline stages of 8 tensor-parallel shards each" in n)
    stages = int(re.search(r"engine.pipeline_parallel: (\d+), engine.tensor_parallel: 8", said).group(1))
    assert stages >= 2, said
    both, result = plan(pipeline_parallel=2, tensor_parallel=8)
    assert both.fits and both.gpus == 16, both
    node, _ = plan(tensor_parallel=8)
    assert not node.fits
    # the largest stage: the second (layers 30-60, 31 of 61; the first holds the embeddings and the head besides)
    assert node.weights * 0.45 < both.weights < node.weights * 0.55, (both.weights, node.weights)
    assert both.kv_cache == tokens * kv_bytes_per_token(result.shape, 2) * 31 // 61
    assert any("2 pipeline stages, 8 GPUs of a node each" in n for n in result.notes), result.notes
    assert any(n.startswith("each stage in 8 tensor-parallel shards") for n in result.notes), result.notes


def test_a_classifier_counts_its_head_not_an_lm_head() -> None:
    """A reward model (LlamaForSequenceClassification, one label): its weights are the base model's and a head of one
    row, not a vocabulary's lm_head (half a billion parameters at Llama 3 8B's 128k x 4096); the head is no projection
    engine.quantization shrinks."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    fields = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
    causal = model_shape(AutoConfig.for_model("llama", vocab_size=8000, **fields))
    config = AutoConfig.for_model(
        "llama", vocab_size=8000, num_labels=1, architectures=["LlamaForSequenceClassification"], **fields
    )
    shape = model_shape(config)
    real = AutoModelForSequenceClassification.from_config(config)
    assert shape.total_params == sum(p.numel() for p in real.parameters()) == causal.total_params - 8000 * 256 + 256
    assert shape.projection_params == causal.projection_params


def test_a_recurrent_models_states_are_counted_per_sequence_and_snapshot(tmp_path: Path) -> None:
    """Qwen3-Next-80B-A3B's recurrent layers (36 of 48), hand-counted: per layer the convolution's last 3 inputs of
    8,192 channels in bf16 and 32 delta-rule matrices of 128 x 128 in float32; the plan counts one state per running
    sequence, and with the prefix cache one per snapshot it keeps and each running sequence's latest in decoding."""
    from transformers import AutoConfig

    from pylon.serving.model.families import recurrent_state_bytes

    fields = {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "intermediate_size": 64,
        "vocab_size": 1000,
    }
    config = AutoConfig.for_model("qwen3_next", **fields)
    per_layer = 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert recurrent_state_bytes(config, 2) == 36 * per_layer == 77_266_944
    assert recurrent_state_bytes(AutoConfig.for_model("llama"), 2) == 0
    (tmp_path / "next").mkdir()
    (tmp_path / "next" / "config.json").write_text(json.dumps({"model_type": "qwen3_next", **fields}))

    def workspace(**engine):
        spec = DeploymentSpec(name="next", model=str(tmp_path / "next"), replica={"num_gpus": 1}, engine=engine)
        result = plan_serve(spec)
        return next(r for r in result.rows if r.accelerator.name == "H200").workspace, result.notes

    base = {"device": "cuda", "max_num_seqs": 8}
    (cached, notes), (plain, _) = workspace(**base), workspace(**base, enable_prefix_caching=False)
    assert cached - plain == (16 + 8) * 77_266_944  # the default 16 snapshots, and each running sequence's latest
    assert any("recurrent layers' states" in n and "8 running" in n for n in notes)


def test_a_cross_encoder_holds_no_kv_cache(tmp_path: Path) -> None:
    """A BERT cross-encoder (model/encoder.py) reads each input whole: its plan has weights and no KV cache."""
    fields = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "num_labels": 1}
    (tmp_path / "ce").mkdir()
    (tmp_path / "ce" / "config.json").write_text(json.dumps(fields))
    spec = DeploymentSpec(name="ce", model=str(tmp_path / "ce"), replica={"num_gpus": 1}, engine={"device": "cuda"})
    row = next(r for r in plan_serve(spec).rows if r.accelerator.name == "H200")
    assert row.kv_cache == 0 and row.weights > 0 and row.fits
    # an embedding model of the same body: its weights without a head (BERT-base's 109.5M, no LM head)
    from transformers import AutoConfig, AutoModel

    body = sum(p.numel() for p in AutoModel.from_config(AutoConfig.for_model("bert")).parameters())
    assert model_shape(AutoConfig.for_model("bert")).total_params == body


@pytest.mark.parametrize("model_type", ENCODER_MODEL_TYPES)
def test_every_encoder_familys_plan_counts_its_body_and_no_kv_cache(tmp_path: Path, model_type: str) -> None:
    """Each encoder family the engine serves (families.ENCODER_MODEL_TYPES) is planned as one: its embedding model's
    parameters are transformers' own (its body), its classifier's are that and its head, and neither holds a KV cache."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.for_model(model_type)
    with torch.device("meta"):
        body = sum(p.numel() for p in AutoModel.from_config(config).parameters())
        classifier = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(model_type, num_labels=3))
    assert model_shape(config).total_params == body
    head = AutoConfig.for_model(model_type, num_labels=3, architectures=[type(classifier).__name__])
    assert model_shape(head).total_params == sum(p.numel() for p in classifier.parameters())
    (tmp_path / "m").mkdir()
    head.save_pretrained(tmp_path / "m")
    spec = DeploymentSpec(name="m", model=str(tmp_path / "m"), replica={"num_gpus": 1}, engine={"device": "cuda"})
    row = next(r for r in plan_serve(spec).rows if r.accelerator.name == "H200")
    assert row.kv_cache == 0 and row.weights > 0 and row.fits


def test_grpo_and_rloo_steps_count_their_sampling_time() -> None:
    """Sampling is a prefill of each row's prompt for every completion and a decode step per completion token that
    reads every weight once (memory-bound for a few rows): on one H100, a 7B model's 512 decode steps take at least
    512 x its bf16 bytes / the memory bandwidth. Other objectives sample nothing."""
    from pylon.plan.catalog import load_catalog
    from pylon.plan.steptime import sampling_time, step_time
    from pylon.plan.train import train_workload

    h100 = next(a for a in load_catalog().accelerators if a.name == "H100-SXM")
    grpo = {"rewards": [{"function": "exact_match"}], "generations": 8, "max_completion_tokens": 512}
    data = {"uri": "/nonexistent/p", "seq_len": 512}
    layout = Layout(3, micro_batch_size=1, num_gpus=1)
    for objective in ("grpo", "rloo"):
        work, _ = train_workload(_train(model={"preset": "llama-7b"}, objective=objective, grpo=grpo, data=data))
        assert work.completion_tokens == 512
        sampling = sampling_time(work, layout, h100, 0.4)
        weights_read = 512 * 2 * work.shape.total_params / (h100.bandwidth_gbs * 1e9)
        assert weights_read < sampling < 3 * weights_read
        assert step_time(work, layout, h100, 0.4).sampling_s == sampling
        shorter, _ = train_workload(
            _train(model={"preset": "llama-7b"}, objective=objective, grpo={**grpo, "max_completion_tokens": 128},
                   data=data)
        )  # fmt: skip
        assert sampling_time(shorter, layout, h100, 0.4) < sampling / 2
    plain, _ = train_workload(_train(model={"preset": "llama-7b"}, data=data))
    assert plain.completion_tokens == 0 and step_time(plain, layout, h100, 0.4).sampling_s == 0.0


def test_an_engine_sampler_step_prefills_each_prompt_once_decodes_in_waves_and_copies_the_weights_once() -> None:
    """grpo.sampler engine: the prompts' prefill is one pass per prompt, not per completion (the prefix cache); a
    micro-batch with more completions than sampler_max_num_seqs decodes in waves; the policy's weights copied into the
    engine once a step (gathered first at ZeRO-3 on several GPUs), not once per micro-batch."""
    from dataclasses import replace

    from pylon.plan.catalog import load_catalog
    from pylon.plan.steptime import sampling_time
    from pylon.plan.train import train_workload

    h100 = next(a for a in load_catalog().accelerators if a.name == "H100-SXM")
    grpo = {"rewards": [{"function": "exact_match"}], "generations": 8, "max_completion_tokens": 16}
    data = {"uri": "/nonexistent/p", "seq_len": 4096}  # long prompts, short completions: the prefill dominates
    spec = _train(model={"preset": "llama-7b"}, objective="grpo", grpo=grpo, data=data)
    model, notes = train_workload(spec)
    engine, notes = train_workload(_train(model={"preset": "llama-7b"}, objective="grpo",
                                          grpo={**grpo, "sampler": "engine"}, data=data))  # fmt: skip
    assert engine.sampler_max_num_seqs == 64 and any("decode steps of at most 64 completions" in n for n in notes)
    one = Layout(2, micro_batch_size=4, num_gpus=1)
    assert sampling_time(engine, one, h100, 0.4) < sampling_time(model, one, h100, 0.4) / 4
    # 32 completions a micro-batch: in one wave of 64, or in 4 waves of 8 (the same FLOPs and KV cache reads, 4x the
    # weights read: a 7B model's decodes are memory-bound)
    decodes = replace(engine, seq_len=64 + 512, completion_tokens=512)
    narrow = replace(decodes, sampler_max_num_seqs=8)
    assert sampling_time(narrow, one, h100, 0.4) > 2.5 * sampling_time(decodes, one, h100, 0.4)
    # the weights' copy once a step: 4 micro-batches a step cost less than 4 steps of one
    accum = Layout(2, micro_batch_size=4, num_gpus=1, grad_accum_steps=4)
    assert sampling_time(decodes, accum, h100, 0.4) < 4 * sampling_time(decodes, one, h100, 0.4)
    copy = 2 * engine.shape.total_params / (h100.bandwidth_gbs * 1e9)
    diff = 4 * sampling_time(decodes, one, h100, 0.4) - sampling_time(decodes, accum, h100, 0.4)
    assert abs(diff - 3 * copy) < 1e-9 * copy + 1e-12
    # at ZeRO-3 on 8 GPUs the copy gathers the model first: once a step, where the model's own sampling gathers it
    # once per micro-batch
    z3 = Layout(3, micro_batch_size=4, num_gpus=8, grad_accum_steps=4)
    gathered_model = replace(decodes, sampler_kv_tokens=0, gathered_sampling=True)
    assert sampling_time(decodes, z3, h100, 0.4) > sampling_time(
        decodes, Layout(2, micro_batch_size=4, num_gpus=8, grad_accum_steps=4), h100, 0.4
    )
    assert sampling_time(decodes, z3, h100, 0.4) < sampling_time(gathered_model, z3, h100, 0.4)


# A 13B Llama's shape (Llama 2 13B's), for the split-model plans
LLAMA_13B = {
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "vocab_size": 32000,
}


def test_pipeline_stages_are_planned_one_gpu_each_the_largest_stage_binding() -> None:
    """engine.pipeline_parallel: a 13B Llama does not fit a 24 GB GPU whole; in 4 stages each holds about a quarter (the
    largest stage's weights, from the parameters each stage loads: its layers, the first the embeddings, the last the
    norm and lm_head), and a quarter of each token's KV cache; a replica's cost is its 4 GPUs'; decode throughput stays
    the whole model's, at the batch that fits."""
    from transformers import AutoConfig

    from pylon.serving.model.stages import stage_parameters

    config = AutoConfig.for_model("llama", **LLAMA_13B)

    def rtx4090(stages: int):
        engine = {"pipeline_parallel": stages, "kv_cache_tokens": 8192, "max_model_len": 4096}
        spec = DeploymentSpec(name="big", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        plan = plan_serve(spec, config=config)
        return next(r for r in plan.rows if r.accelerator.name == "RTX-4090"), plan

    whole, _ = rtx4090(1)
    four, plan = rtx4090(4)
    per_stage = stage_parameters(config, 4)
    shape = plan.shape
    assert sum(per_stage) == shape.total_params  # (untied: each weight on one stage)
    assert not whole.fits and "alone exceed" in whole.binding
    assert four.fits and four.gpus == 4 and whole.gpus == 1
    assert four.weights == shape.total_params * 2 * max(per_stage) // sum(per_stage)
    assert four.kv_cache == 8192 * kv_bytes_per_token(shape, 2) // 4
    assert four.to_dict()["gpus_per_replica"] == 4
    # the cost per token is four GPUs' hours over the batch's tokens
    expected = 4 * four.accelerator.price_per_gpu_hour / (four.batch_tps * 3600 * four.utilization) * 1e6
    assert four.cost_per_million_tokens == pytest.approx(expected)
    assert any("4 pipeline stages, one GPU each" in n for n in plan.notes)
    text = render(plan)
    assert "4 GPUs per replica, one a pipeline stage" in text and "(the largest pipeline stage's)" in text
    # Asked for one RTX 4090 with 65,536 tokens of KV cache, the plan recommends nothing and says how few shards of
    # one node fit it, and how few stages across nodes: 4 of each (2 shards or 3 stages do not: a shard's or the
    # largest stage's weights and KV cache pass 24 GB).
    spec = DeploymentSpec(name="big", model="s3://b/m", replica={"num_gpus": 1}, engine={"max_model_len": 4096})
    alone = plan_serve(spec, config=config, gpu="RTX-4090")
    assert alone.recommendation is None
    assert alone.notes[0].startswith(
        "it fits no one GPU as asked; in 4 tensor-parallel shards on one node (engine.tensor_parallel: 4, one GPU a "
        "shard) it fits RTX-4090: $"
    ), alone.notes
    assert alone.notes[1].startswith(
        "or, across nodes; in 4 pipeline stages (engine.pipeline_parallel: 4, one GPU a stage) it fits RTX-4090: $"
    ), alone.notes
    two = spec.model_copy(update={"engine": spec.engine.model_copy(update={"tensor_parallel": 2})})
    assert plan_serve(two, config=config, gpu="RTX-4090", _suggest=False).recommendation is None
    three = spec.model_copy(update={"engine": spec.engine.model_copy(update={"pipeline_parallel": 3})})
    assert plan_serve(three, config=config, gpu="RTX-4090", _suggest=False).recommendation is None


def test_tensor_parallel_shards_are_planned_one_gpu_each_one_shards_memory() -> None:
    """engine.tensor_parallel: the 13B Llama in 4 shards on one node, each holding a quarter of every layer and of the
    embeddings' and lm_head's rows, and a quarter of each token's KV cache; a replica's cost is its 4 GPUs'; a decode
    step reads the shards' weights at once, so one stream decodes faster than on one GPU holding the whole model."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **LLAMA_13B)

    def gpu(name: str, shards: int):
        engine = {"tensor_parallel": shards, "kv_cache_tokens": 8192, "max_model_len": 4096}
        spec = DeploymentSpec(name="big", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        plan = plan_serve(spec, config=config)
        return next(r for r in plan.rows if r.accelerator.name == name), plan

    whole, _ = gpu("RTX-4090", 1)
    four, plan = gpu("RTX-4090", 4)
    shape = plan.shape
    assert not whole.fits and four.fits and four.gpus == 4 and four.split == "shard"
    assert four.weights == shape.total_params * 2 // 4
    assert four.kv_cache == 8192 * (kv_bytes_per_token(shape, 2) // 4)
    h100, _ = gpu("H100-SXM", 1)
    h100_four, _ = gpu("H100-SXM", 4)
    # (each step's kernel launches stay: faster, by less than the shard count)
    assert 1.5 < h100_four.single_stream_tps / h100.single_stream_tps < 4
    expected = 4 * four.accelerator.price_per_gpu_hour / (four.batch_tps * 3600 * four.utilization) * 1e6
    assert four.cost_per_million_tokens == pytest.approx(expected)
    assert any("4 tensor-parallel shards on one node, one GPU each" in n for n in plan.notes)
    assert "4 GPUs per replica, one a tensor-parallel shard" in render(plan)


def test_deepseek_v3_s_multi_token_prediction_layer_is_counted_when_it_drafts() -> None:
    """engine.speculative.method mtp: the plan counts the checkpoint's multi-token-prediction layer (one more sparse
    decoder layer, ~11.5B parameters: DeepSeek's 14B of MTP modules but the embeddings and head it shares) and one more
    layer's latent cache; a model without such a layer is refused by name."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v3")
    tokens = 32768

    def plan(**speculative):
        engine = {"kv_cache_tokens": tokens, "max_model_len": 8192, "quantization": "fp8", "speculative": speculative}
        spec = DeploymentSpec(name="v3", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        return plan_serve(spec, config=config, gpu="H200")

    plain, drafting = plan(), plan(method="mtp")
    note = next(n for n in drafting.notes if "multi-token-prediction layer" in n)
    params = int(re.search(r"\(([\d,]+) parameters\)", note).group(1).replace(",", ""))
    assert 11.0e9 < params < 12.0e9, note
    assert drafting.rows[0].kv_cache - plain.rows[0].kv_cache == tokens * 576 * 2
    extra = drafting.rows[0].weights - plain.rows[0].weights
    assert params * 0.95 < extra < params * 1.1, (extra, params)  # (fp8: a byte a weight, its norms and router aside)
    # it fits no one GPU: in 8 shards, each its share of the layer too; in stages, it drafts by prompt lookup
    shards = re.search(r"one shard ([\d.]+) GiB", next(n for n in drafting.notes if "tensor-parallel shards on" in n))
    plain_shards = re.search(
        r"one shard ([\d.]+) GiB", next(n for n in plain.notes if "tensor-parallel shards on" in n)
    )
    assert 0 < float(shards.group(1)) - float(plain_shards.group(1)) < 1.5 * params / 8 / 2**30, (shards, plain_shards)
    assert any("drafts by prompt lookup (engine.speculative.method: ngram)" in n for n in drafting.notes)
    stages = [n for n in drafting.notes if n.startswith("or, across nodes")]
    assert stages == [n for n in plain.notes if n.startswith("or, across nodes")], stages
    with pytest.raises(PylonError, match=r"engine\.speculative\.method mtp: .*a llama checkpoint has no"):
        spec = DeploymentSpec(
            name="l", model="s3://b/m", replica={"num_gpus": 1}, engine={"speculative": {"method": "mtp"}}
        )
        plan_serve(spec, config=AutoConfig.for_model("llama"))


def test_an_eagle_head_is_counted_as_its_checkpoint_holds_it(tmp_path) -> None:
    """engine.speculative.method eagle3: the plan counts the head from its config.json alone (its layer with the wider
    attention input, fc over three of the model's hidden states, its output layer over the draft vocabulary) as many
    parameters as the checkpoint holds, and its layer's KV cache (in the block ids of the KV cache's groups of layers,
    where the model mixes windowed layers with full ones); in shards or stages it plans prompt lookup."""
    from transformers import AutoConfig

    head = tmp_path / "head"
    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    config.num_key_value_heads, config.vocab_size = 2, 1000
    head.mkdir()
    layer = {"hidden_size": 512, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2}
    (head / "config.json").write_text(json.dumps({**layer, "model_type": "llama", "draft_vocab_size": 300}))
    wide, kv = 1024, 2 * 64
    held = {  # the tensors an EAGLE-3 checkpoint of that config holds (its embeddings: the model's)
        "fc": 3 * 512 * 512,
        "q": 512 * wide,
        "kv": 2 * kv * wide,
        "o": 512 * 512,
        "mlp": 3 * 512 * 768,
        "norms": 4 * 512,
        "lm_head": 300 * 512,
    }
    tokens = 4096

    def plan(**speculative):
        engine = {"kv_cache_tokens": tokens, "max_model_len": 2048, "speculative": speculative}
        spec = DeploymentSpec(name="e", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        return plan_serve(spec, config=config, gpu="L40S")

    plain, drafting = plan(), plan(method="eagle3", draft_model=str(head))
    note = next(n for n in drafting.notes if "eagle3 head" in n)
    params = int(re.search(r"\(([\d,]+) parameters\)", note).group(1).replace(",", ""))
    assert params == sum(held.values()), (params, held)
    assert drafting.rows[0].kv_cache - plain.rows[0].kv_cache == tokens * 2 * kv * 2
    assert drafting.rows[0].weights - plain.rows[0].weights == params * 2
    # Windowed layers (16-31 of 32) mixed with full ones: the KV cache in two groups of 16 layers, twice the block ids;
    # the head's cache in them: twice the tokens'
    config = AutoConfig.for_model("qwen2", **{k: getattr(config, k) for k in ("hidden_size", "intermediate_size")})
    config.num_attention_heads, config.num_key_value_heads, config.vocab_size = 8, 2, 1000
    config.num_hidden_layers, config.sliding_window, config.use_sliding_window = 32, 256, True
    config.max_window_layers = 16
    config.layer_types = ["full_attention"] * 16 + ["sliding_attention"] * 16
    plain, drafting = plan(), plan(method="eagle3", draft_model=str(head))
    assert any("in 2 groups of 16 layers" in n for n in plain.notes)
    assert drafting.rows[0].kv_cache - plain.rows[0].kv_cache == 2 * tokens * 2 * kv * 2


def test_suffix_decoding_s_host_memory_is_said() -> None:
    """engine.speculative.method suffix: no device memory; the plan says the host memory its trees may take."""
    from transformers import AutoConfig

    from pylon.plan.serve import SUFFIX_BYTES_PER_TOKEN as BYTES_PER_TOKEN

    def plan(**speculative):
        engine = {"max_model_len": 2048, "speculative": speculative}
        spec = DeploymentSpec(name="s", model="s3://b/m", replica={"num_gpus": 1}, engine=engine)
        return plan_serve(spec, config=AutoConfig.for_model("llama"), gpu="L40S")

    plain, suffix = plan(), plan(method="suffix", suffix_max_cached_requests=1000)
    assert suffix.rows[0].weights == plain.rows[0].weights and suffix.rows[0].kv_cache == plain.rows[0].kv_cache
    note = next(n for n in suffix.notes if n.startswith("suffix decoding's trees"))
    assert f"~{BYTES_PER_TOKEN} bytes a cached output token" in note and "1,000 cached outputs 2,048 tokens" in note
    assert f"up to {1000 * 2048 * BYTES_PER_TOKEN / 2**30:.1f} GiB" in note, note


def test_an_eagle3_head_is_planned_beside_the_frozen_model(tmp_path) -> None:
    """objective eagle3: the model's weights and the head's on every GPU (partitioned at ZeRO-3), gradients and
    optimizer states of the head alone, FLOPs of the model's forward pass and the head's drafts, never checkpointing
    (refused); the activations of its step as the trainer's own modules allocate them (`pylon.draft_head`, on the
    meta device)."""
    from pylon.draft_head import head_config, head_parameters
    from pylon.plan.steptime import work_flops_per_token
    from pylon.plan.train import train_workload

    config = model_config(ModelSpec(preset="llama-7b"), eos_id=0, pad_id=0)
    config.save_pretrained(tmp_path / "m")
    path = {"model": {"path": str(tmp_path / "m")}, "batch": {"micro_batch_size": 1, "grad_accum_steps": 1}}
    plain = train_workload(_train(**path))[0]
    work, notes = train_workload(_train(**path, objective="eagle3", eagle3={"ttt_steps": 3, "draft_vocab_size": 8000}))
    params, matmul = head_parameters(head_config(config, draft_vocab=8000, aux=(2, 16, 29), intermediate_size=None))
    h, inter = config.hidden_size, config.intermediate_size
    assert params == 3 * h * h + 2 * h * 3 * h + h * h + 3 * h * inter + 8000 * h + 4 * h  # (GQA-free 7B; 4 norms)
    assert work.shape.total_params == plain.shape.total_params + params and work.shape.trainable_params == params
    assert any("objective eagle3: the model frozen in bf16" in n for n in notes)
    n = work.shape.total_params
    memory = train_memory(work, Layout(2, micro_batch_size=1, num_gpus=8))
    assert memory.params == 2 * n and memory.optimizer == 12 * params // 8
    assert memory.grads == int(2 * params / 8 + 4 * params / 8)
    s, seq = plain.shape, plain.seq_len
    forward = 2 * s.matmul_params + 4 * s.num_layers * h * seq
    assert work_flops_per_token(work) == forward + 3 * (6 * matmul + 12 * h * seq)
    plan = plan_train(_train(**path, objective="eagle3"))
    layouts = [o.layout for row in plan.rows for o in [*row.options, *row.pareto, row.best] if o is not None]
    assert layouts and not any(lay.gradient_checkpointing for lay in layouts)
    z3 = train_memory(work, Layout(3, micro_batch_size=1, num_gpus=8))  # the frozen model partitioned as any is
    assert z3.params == int(2 * n / 8 + 2 * work.shape.largest_layer_params) and z3.optimizer == memory.optimizer


def test_an_eagle3_step_s_activations_are_what_the_step_allocates(tmp_path) -> None:
    """The planner's simulation of objective eagle3's step (meta tensors, its loss's masks left out) against the same
    step run on real tensors on this CPU (the trainer's forward with its masked loss, and backward), counted by the
    same allocation tracker."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.draft_head import Eagle3Head, Eagle3Trainer, head_config
    from pylon.plan.activations import _drop_grad, _LiveBytes, eagle3_activations

    config = AutoConfig.for_model(
        "llama", vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    head = head_config(config, draft_vocab=96, aux=(2, 3, 3), intermediate_size=None)
    batch, seq = 3, 128
    simulated = eagle3_activations(
        config, head, micro_batch=batch, seq_len=seq, precision="fp32", device="cpu", documents=False, steps=3
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    trainer = Eagle3Trainer(target, Eagle3Head(head, torch.arange(96)), (2, 3, 3), 3, 0.8).train()
    for p in trainer.head.parameters():
        p.register_post_accumulate_grad_hook(_drop_grad)
    ids = torch.randint(0, 320, (batch, seq))
    labels = ids.clone()
    tracker = _LiveBytes()
    tracker.preexisting([*trainer.parameters(), *trainer.buffers(), ids, labels])
    with tracker:
        out = trainer(input_ids=ids, labels=labels)
        loss = out.loss_sum
        del out
        loss.backward()
        del loss
    print(f"eagle3 step activations: simulated {simulated.peak_bytes:,} B, measured {tracker.peak:,} B")
    assert abs(simulated.peak_bytes / tracker.peak - 1) < 0.15, (simulated.peak_bytes, tracker.peak)


def test_latency_targets_say_how_many_sequences_and_prompts_a_replica_serves_within_them(tmp_path: Path) -> None:
    """`autoscaling.target_itl_ms`, `target_ttft_ms`: the plan says, on the recommended GPU, how many sequences a
    replica decodes with their tokens that far apart (a step of n sequences: n tokens at the decode rate of n), how
    many prompts of half max_model_len it computes within the first token's target, or that no number of replicas
    meets a target one sequence or one prompt alone misses."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    engine = {"device": "cuda", "kv_cache_tokens": 65536, "max_model_len": 4096, "tensor_parallel": 2}

    def plan(itl=None, ttft=None, prefill=None):
        scaling = {"min_replicas": 1, "max_replicas": 4, "target_itl_ms": itl}
        if prefill is None:
            scaling["target_ttft_ms"] = ttft
        spec = DeploymentSpec(
            name="m", model=str(tmp_path), replica={"num_gpus": 1}, engine=engine, autoscaling=scaling, prefill=prefill
        )
        return plan_serve(spec, gpu="H100")

    row = plan().recommendation
    one_ms = 1000 / row.single_stream_tps
    full_ms = 1000 * row.batch / row.batch_tps  # every sequence the replica holds: a token each this far apart
    assert row.streams_within_itl is None and not any("target_" in n for n in plan().notes)
    loose = plan(itl=full_ms * 1.01).recommendation
    assert loose.streams_within_itl == row.batch
    tight = plan(itl=(one_ms + full_ms) / 2)
    assert 1 < tight.recommendation.streams_within_itl < row.batch
    note = next(n for n in tight.notes if n.startswith("autoscaling.target_itl_ms"))
    n = tight.recommendation.streams_within_itl
    assert f"about {n:,} sequences" in note and f"about {4 * n:,} at once" in note, note
    missed = next(n for n in plan(itl=one_ms * 0.9).notes if n.startswith("autoscaling.target_itl_ms"))
    assert "no number of replicas meets it" in missed, missed
    prompt_ms = 2048 / row.prompt_tps * 1000
    met = next(n for n in plan(ttft=prompt_ms * 3.5).notes if n.startswith("autoscaling.target_ttft_ms"))
    assert "about 3 such prompt(s) at once" in met, met
    short = next(n for n in plan(ttft=prompt_ms / 2).notes if n.startswith("autoscaling.target_ttft_ms"))
    assert "prompts that long miss it whatever the replicas" in short, short
    split = plan(prefill={"autoscaling": {"max_replicas": 2, "target_ttft_ms": prompt_ms * 2.5}})
    assert any(n.startswith("prefill.autoscaling.target_ttft_ms") and "about 2 such" in n for n in split.notes)
