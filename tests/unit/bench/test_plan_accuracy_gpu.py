"""The planner's GPU memory against what a GPU measured: bench/plan_accuracy.py --device cuda's cases, predicted now,
against the process totals nvidia-smi reported for them on a lent H200 (docs/benchmarks/2026-12-04-set51-gpu-training-
h200.md). The measurements do not depend on the model of memory, so a change to that model that moves a case out of
the bench's target (0.90-1.10) fails here, on a CPU, before the next GPU is lent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "plan_accuracy.py"

# case -> (nvidia-smi's peak for the process, MiB; torch.cuda.max_memory_allocated above the baseline, MiB), from
# set 51: NVIDIA H200, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, DeepSpeed 0.19.8, transformers 5.23.0.
MEASURED_H200 = {
    "small-bf16-z2": (3978, 2010.5),
    "small-bf16-z3-offload": (3598, 1971.2),
    "small-fp16-z2": (3978, 2010.5),
    "small-bf16-z2-ckpt": (3252, 1328.5),
    "small-fp32-z1-lora": (5464, 3240.4),
    "llama1b-bf16-z3-offload": (43810, 39089.6),
    "llama1b-bf16-z3": (43060, 35850.2),
}


@pytest.fixture(scope="module")
def plan_accuracy():
    spec = importlib.util.spec_from_file_location("plan_accuracy_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_measured_case_is_a_bench_case(plan_accuracy):
    assert set(MEASURED_H200) == set(plan_accuracy.CUDA_CASES)


@pytest.mark.parametrize("name", sorted(MEASURED_H200))
def test_predicted_gpu_memory_is_within_ten_percent_of_the_h200s(plan_accuracy, name):
    predicted = plan_accuracy.predict(plan_accuracy.cases_for("cuda")[name], "cuda")
    smi_mib, allocated_mib = MEASURED_H200[name]
    ratio = smi_mib / (predicted["total"] / 2**20)
    assert 1 - plan_accuracy.TARGET["cuda"] <= ratio <= 1 + plan_accuracy.TARGET["cuda"], (name, ratio)
    # the tensors' own peak, without the allocator's reserve and the runtime: within the CPU target (25%)
    assert 0.75 <= allocated_mib / (predicted["allocated"] / 2**20) <= 1.25, name
