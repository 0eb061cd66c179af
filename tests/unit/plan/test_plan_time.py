"""The planner's time model and search: MFU as papers report it (Llama 2's published GPU-hours within 20% at MFU 0.4),
the HFU it implies printed beside it, collectives adding time only where they outlast compute, GPU counts up to
16,384, the deadline and the budget, the time/cost Pareto front, and the parallelism advice where ZeRO alone cannot
get there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from test_plan import LLAMA_70B  # the module beside this one

from pylon.errors import PylonError
from pylon.plan import MAX_GPUS, gpu_counts, hardware_flops_per_token, model_flops_per_token, plan_train, render
from pylon.plan.catalog import load_catalog
from pylon.plan.memory import Layout, train_memory
from pylon.plan.steptime import COLLECTIVE_EFFICIENCY, collective_gbs, hfu, step_time
from pylon.plan.train import candidate_layouts, pareto, train_workload
from pylon.specs import TrainJobSpec

LLAMA2_70B = LLAMA_70B  # the same shape as test_plan.py's
LLAMA31_405B = {
    **LLAMA2_70B,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "vocab_size": 128256,
}
# Touvron et al. 2023 (Llama 2), Table 2: A100-80GB GPU-hours for 2.0T tokens at 4M tokens (1,024 x 4,096) a step.
PUBLISHED = {"7b": ({"preset": "llama-7b"}, 2, 184_320), "70b": ({"config": LLAMA2_70B}, 3, 1_720_320)}


def _pretrain(
    model: dict, *, workers: int = 1024, seq: int = 4096, micro: int = 1, accum: int = 1, tokens=2.0e12, **kw
):
    """A TrainJob pre-training `model` on `tokens` tokens at a global batch of workers x micro x accum sequences."""
    steps = round(tokens / (workers * micro * accum * seq))
    fields = {
        "kind": "TrainJob",
        "name": "pretrain",
        "model": model,
        "data": {"uri": "/nonexistent/pylon-plan-data", "seq_len": seq},
        "scaling": {"num_workers": workers, "use_gpu": True},
        "precision": "bf16",
        "gradient_checkpointing": True,
        "deepspeed": {"zero_stage": 3},
        "steps": steps,
        "batch": {"micro_batch_size": micro, "grad_accum_steps": accum},
    }
    return TrainJobSpec.model_validate({**fields, **kw})


@pytest.fixture(scope="module")
def llama70_h100():
    """Llama 2 70B on 2.0T tokens, searched on H100s with the default deadline (30 days)."""
    return plan_train(_pretrain({"config": LLAMA2_70B}), gpu="H100")


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_llama2_gpu_hours_at_mfu_04_are_within_20_percent_of_the_published(size) -> None:
    model, stage, published = PUBLISHED[size]
    plan = plan_train(_pretrain(model, deepspeed={"zero_stage": stage}), gpu="A100-80GB", gpus=1024, mfu=0.4)
    option = plan.row("A100-80GB").requested  # as laid out: 1,024 GPUs, one 4,096-token sequence each
    assert 0.8 <= option.gpu_hours / published <= 1.2, (size, option.gpu_hours, published)
    # Compute bounds the step (the collectives hide behind it), so the GPU-hours are the arithmetic of the model
    # FLOPs at the MFU: recomputation (70B checkpoints) costs no extra time, it raises the HFU.
    assert option.step.comm_s == 0 and option.step.collectives_s > 0
    s = plan.work.shape
    flops = plan.tokens * model_flops_per_token(s, 4096, False)
    assert option.gpu_hours == pytest.approx(flops / (312e12 * 0.4) / 3600, rel=1e-6)
    if option.layout.gradient_checkpointing:
        assert option.hfu == pytest.approx(0.4 * hardware_flops_per_token(s, 4096, False, True) / (flops / plan.tokens))
        assert 0.5 < option.hfu < 0.56


def test_step_time_is_model_flops_at_the_mfu_and_collectives_add_only_what_outlasts_compute() -> None:
    catalog = load_catalog()
    h100, rtx = catalog.get("H100"), catalog.get("4090")
    work, _ = train_workload(_pretrain({"preset": "llama-7b"}))
    per_token = model_flops_per_token(work.shape, 4096, False)
    plain, ckpt = (step_time(work, Layout(3, "none", "none", c, 1, 1, 64), h100, 0.4) for c in (False, True))
    assert plain.compute_s == ckpt.compute_s == pytest.approx(64 * 4096 * per_token / (64 * 989.4e12 * 0.4))
    assert hfu(work, True, 0.4) > hfu(work, False, 0.4) == 0.4
    # Bus bandwidth: the GPU interconnect inside a node, the node's network across nodes (capped by the former).
    assert collective_gbs(h100, 8) == pytest.approx(450 * COLLECTIVE_EFFICIENCY)
    assert collective_gbs(h100, 16) == pytest.approx(400 * COLLECTIVE_EFFICIENCY)
    assert collective_gbs(rtx, 16) == pytest.approx(3.125 * COLLECTIVE_EFFICIENCY)
    assert plain.comm_s == 0 < plain.collectives_s < plain.compute_s  # 64 H100s: hidden
    slow = step_time(work, Layout(3, "none", "none", True, 1, 1, 64), rtx, 0.4)  # 25 Gb/s Ethernet between nodes
    assert slow.comm_s == pytest.approx(slow.collectives_s - slow.compute_s) and slow.comm_s > slow.compute_s
    # ZeRO-1 reduces once per step: with accumulation only the last micro-batch's backward hides it.
    accum = step_time(work, Layout(1, "none", "none", True, 1, 16, 64), h100, 0.4)
    assert accum.comm_s == pytest.approx(max(0.0, accum.collectives_s - accum.compute_s / 16))


def test_the_search_reaches_16384_gpus_in_node_sized_steps() -> None:
    assert gpu_counts(8) == [1, 2, 4] + [8 * 2**k for k in range(12)] and gpu_counts(8)[-1] == MAX_GPUS == 16_384
    assert gpu_counts(4)[:4] == [1, 2, 4, 8]
    layouts = candidate_layouts(global_batch=16_384, max_micro_batch=1, gpus=None, gpus_per_node=8)
    assert max(lay.num_gpus for lay in layouts) == 16_384
    # No GPU gets less than a sequence: at a global batch of 1,024 the search stops at 1,024.
    assert (
        max(lay.num_gpus for lay in candidate_layouts(global_batch=1024, max_micro_batch=1, gpus=None, gpus_per_node=8))
        == 1024
    )
    # A 405B model with 16,384 sequences a step: the fastest plan uses all 16,384 H100s, and still misses 30 days.
    plan = plan_train(_pretrain({"config": LLAMA31_405B}, workers=16_384, seq=8192, tokens=15.6e12), gpu="H100")
    rec = plan.recommendation
    assert rec.layout.num_gpus == 16_384 and plan.shortfall == "deadline" and rec.step.comm_s == 0
    assert "beyond 16,384 GPUs" in plan.row("H100-SXM").advice[0]


def test_70b_on_h100_meets_a_30_day_deadline_at_the_least_cost(llama70_h100) -> None:
    plan = llama70_h100
    rec = plan.recommendation
    assert rec is not None and rec.fits and rec.accelerator.name == "H100-SXM"
    assert rec.wall_days <= 30 and plan.shortfall is None and plan.verdict == "meets the deadline of 30 d"
    assert rec.layout.num_gpus == 1024  # 512 take ~51 days; one sequence per GPU at most
    within = [o for o in plan.row("H100-SXM").options if o.wall_days <= 30]
    assert rec.cost <= min(o.cost for o in within) * 1.01
    text = render(plan)
    assert "Recommendation: 1024 x H100-SXM" in text and "meets the deadline of 30 d" in text


def test_mfu_and_the_hfu_it_implies_are_both_printed(llama70_h100) -> None:
    plan = llama70_h100
    rec = plan.recommendation
    assert rec.layout.gradient_checkpointing and rec.hfu == pytest.approx(0.4 * 4 / 3, rel=0.02)
    text = render(plan)
    assert "MFU 0.40 (--mfu)" in text and f"HFU {rec.hfu:.2f}" in text and "PaLM's definition" in text
    d = plan.to_dict()
    assert d["utilization"]["mfu"] == 0.4 and d["utilization"]["hfu"] == pytest.approx(rec.hfu, abs=1e-4)
    assert d["recommendation"]["mfu"] == 0.4 and d["recommendation"]["hfu"] == pytest.approx(rec.hfu, abs=1e-4)
    assert "recomputation" in d["assumptions"]["mfu_means"] and d["assumptions"]["collective_efficiency"] > 0


def test_the_pareto_front_is_non_dominated_and_sorted() -> None:
    plan = plan_train(_pretrain({"preset": "llama-7b"}, deepspeed={"zero_stage": 2}))
    fronts = 0
    for row in plan.rows:
        front = row.pareto
        assert front == pareto(row.options) and set(map(id, front)) <= set(map(id, row.options))
        times, costs = [o.wall_s for o in front], [o.cost for o in front]
        assert times == sorted(times) and costs == sorted(costs, reverse=True)  # faster first, cost falling
        assert len(set(times)) == len(times) and len(set(costs)) == len(costs)
        for f in front:
            for o in row.options:
                assert not (o.wall_s <= f.wall_s and o.cost < f.cost) and not (o.wall_s < f.wall_s and o.cost <= f.cost)
        fronts += len(front) > 1
    assert fronts  # somewhere more GPUs buy time at a price
    d = plan.to_dict()
    for acc, row in zip(d["accelerators"], plan.rows):
        assert [o["gpus"] for o in acc["pareto"]] == [o.layout.num_gpus for o in row.pareto]
    assert "Pareto front" in render(plan)


def test_a_budget_too_small_says_so_and_what_it_would_take() -> None:
    spec = _pretrain({"preset": "llama-7b"}, deepspeed={"zero_stage": 2})
    plan = plan_train(spec, gpu="H100", budget_usd=10_000)
    rec = plan.recommendation
    assert plan.shortfall == "budget" and rec is not None and rec.cost > 10_000 and rec.wall_days <= 30
    assert plan.verdict.startswith("no configuration costs at most $10,000: the cheapest that meets the deadline")
    assert f"a budget of at least ${rec.cost:,.0f}" in plan.verdict
    assert "Deadline and budget: no configuration costs at most $10,000" in render(plan)
    d = plan.to_dict()
    assert d["budget_usd"] == 10_000 and d["meets_budget"] is False and d["meets_deadline"] is True
    # A budget that covers it changes nothing but the sentence.
    enough = plan_train(spec, gpu="H100", budget_usd=rec.cost * 2)
    assert enough.shortfall is None and enough.recommendation.cost == pytest.approx(rec.cost)
    assert "and the budget of" in enough.verdict


def test_a_deadline_data_parallelism_cannot_meet_names_the_parallelism_it_needs() -> None:
    spec = _pretrain({"preset": "llama-7b"}, deepspeed={"zero_stage": 2})
    plan = plan_train(spec, gpu="H100", deadline_days=1)
    rec = plan.recommendation
    assert plan.shortfall == "deadline" and rec.layout.num_gpus == 1024 and rec.wall_days > 1  # the fastest
    assert "the deadline of 1 d cannot be met" in plan.verdict and "a deadline of 3 d" in plan.verdict
    (advice,) = plan.row("H100-SXM").advice
    assert "more than data parallelism can use (1024 GPUs: one sequence each of the 1024 a step)" in advice
    assert "TP=4" in advice and "global batch of at least" in advice
    assert any(e.startswith("parallelism: ") for e in plan.explanation)
    # A deadline only more money meets, with a budget short of it: the fastest within the budget, and the price.
    front = plan_train(spec, gpu="L40S").row("L40S").pareto
    fast, cheaper = front[0], front[1]
    capped = plan_train(
        spec,
        gpu="L40S",
        deadline_days=(fast.wall_days + cheaper.wall_days) / 2,
        budget_usd=(fast.cost + cheaper.cost) / 2,
    )
    assert capped.shortfall == "deadline" and capped.recommendation.layout == cheaper.layout
    assert "cannot be met within the budget of" in capped.verdict
    assert f"or a budget of ${fast.cost:,.0f} ({fast.layout.num_gpus} x L40S" in capped.verdict


def test_activations_that_do_not_fit_one_gpu_are_split_by_sequence_parallelism() -> None:
    """Llama 2 70B's 65,536-token rows: no layout of data parallelism alone fits an H100 (one row's activations,
    113 GiB with recomputation); groups of GPUs splitting each row (scaling.sequence_parallel) do, the smallest
    group that fits, its all-to-alls in the step time. A row no node's group can hold: tensor and context
    parallelism advised, saying sequence parallelism was tried."""
    spec = _pretrain({"config": LLAMA2_70B}, workers=64, seq=65536, tokens=1e10)
    plan = plan_train(spec, gpu="H100")
    rec = plan.recommendation
    assert rec is not None and rec.fits and rec.layout.sequence_parallel == 2
    assert not plan.row("H100-SXM").requested.fits  # (as requested: 64 GPUs, each a whole row)
    assert rec.layout.rows_per_step == 64 and rec.tokens_per_step == 64 * 65536  # the global batch kept
    assert "(1/2 of each row: sequence parallelism)" in rec.memory.notes["activations"]
    whole = dataclasses.replace(rec.layout, sequence_parallel=1)
    assert rec.memory.activations < 0.6 * train_memory(plan.work, whole).activations
    assert "sequence parallelism (scaling.sequence_parallel: 2, DeepSpeed Ulysses)" in render(plan)
    assert rec.step.collectives_s > 0 and rec.to_dict()["layout"]["sequence_parallel"] == 2

    plan = plan_train(_pretrain({"preset": "llama-7b"}, workers=64, seq=1048576, tokens=1e10), gpu="H100")
    assert plan.recommendation is None
    (advice,) = plan.row("H100-SXM").advice
    assert "1,048,576-token sequence's activations" in advice and "TP=8" in advice and "context parallelism" in advice
    assert "splitting each row over up to 8 GPUs of a node, does not fit it either" in advice


def test_deadline_and_budget_through_the_cli_and_the_sdk(tmp_path: Path, capsys) -> None:
    from pylon.cli import main
    from pylon.sdk.client import Client

    spec = _pretrain({"preset": "llama-7b"}, deepspeed={"zero_stage": 2})
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["plan", str(path), "--gpu", "H100", "--deadline", "1", "--budget", "1000000", "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert plan["deadline_days"] == 1 and plan["budget_usd"] == 1_000_000 and not plan["meets_deadline"]
    assert (
        "cannot be met" in plan["verdict"] and plan["accelerators"][0]["pareto"] and plan["accelerators"][0]["advice"]
    )
    assert plan["assumptions"]["deadline_days"] == 1
    assert main(["plan", str(path), "--deadline", "0"]) == 1
    assert "deadline: must be a positive number of days" in capsys.readouterr().err
    client = Client("http://127.0.0.1:1")  # needs no cluster
    sdk = client.plan(str(path), gpu="H100", deadline_days=1, budget_usd=1_000_000)
    assert sdk.deadline_days == 1 and sdk.budget_usd == 1_000_000 and sdk.shortfall == "deadline"
    with pytest.raises(PylonError, match="budget"):
        plan_train(spec, gpu="H100", budget_usd=-1)


def test_a_spec_with_sequence_parallelism_is_planned_as_it_asks() -> None:
    """scaling.sequence_parallel in the spec: the requested layout's groups split each row (half the activations of
    the same layout whole), the global batch counts a group's rows once, and the all-to-alls are in its step."""
    over = {"scaling": {"num_workers": 16, "use_gpu": True, "sequence_parallel": 2}}
    spec = _pretrain({"preset": "llama-7b"}, workers=16, seq=32768, tokens=1e9, **over)
    assert spec.global_batch_size == 8
    plan = plan_train(spec, gpu="H100")
    requested = plan.row("H100-SXM").requested
    lay = requested.layout
    assert (lay.sequence_parallel, lay.num_gpus, lay.rows_per_step) == (2, 16, 8)
    whole = train_memory(plan.work, dataclasses.replace(lay, sequence_parallel=1))
    assert requested.memory.activations < 0.6 * whole.activations
    assert requested.tokens_per_step == 8 * 32768
    assert "sequence parallel 2" in lay.describe() and "sequence parallel 2" in spec.summary()
