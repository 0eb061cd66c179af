"""Direct preference optimisation end to end on the session's Ray cluster: preference pairs prepared with
`--preference` (tests/unit/jobs/test_dpo.py checks their rows and the loss against TRL's formula), trained by a
TrainJob with `objective: dpo` through Ray Train and DeepSpeed: with LoRA at ZeRO-2 (the reference: the adapters
disabled), and fully fine-tuned in bf16 on two workers at ZeRO-3 (the reference: a frozen copy, partitioned); and
ORPO, reference-free, fully fine-tuned. DPO's first step's loss is log 2 (the model is still its reference); the loss
falls and the reward accuracy rises as it learns the preferences, the held-out pairs are evaluated with the same
figures, and the run exports its model."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import pylon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "jobs"))
from test_chat_data import _jsonl  # noqa: E402
from test_dpo import PAIRS, tokenizer  # noqa: E402, F401 (fixture)

pytestmark = pytest.mark.integration


LORA = {
    "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "deepspeed": {"zero_stage": 2},
    "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
}
FULL = {
    "precision": "bf16",
    "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
    "deepspeed": {"zero_stage": 3},
    "batch": {"micro_batch_size": 2, "grad_accum_steps": 1},
    "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
}


ORPO = {
    "objective": "orpo",
    "deepspeed": {"zero_stage": 2},
    "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
}


@pytest.mark.parametrize("how", [LORA, FULL, ORPO], ids=["dpo-lora-zero2", "dpo-full-zero3-bf16", "orpo-full-zero2"])
def test_a_preference_run_learns_the_preferences(ray_cluster, tmp_path, tokenizer, how):  # noqa: F811
    from pylon.data.prepare import prepare

    data = str(tmp_path / "pref")
    prepare([_jsonl(tmp_path / "pref.jsonl", PAIRS * 4)], data, seq_len=64, tokenizer=tokenizer, preference=True,
            use_ray=False, progress=False)  # fmt: skip
    spec = {
        "kind": "TrainJob",
        "name": "dpo",
        "model": {"preset": "llama-tiny"},
        "objective": "dpo",
        "dpo_beta": 0.5,
        "data": {"uri": data, "seq_len": 64, "validation_fraction": 0.25},
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "steps": 12,
        "eval": {"every_steps": 12},
        "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 12},
    } | how
    client = pylon.connect()
    run = client.train(spec)
    status = client.wait_job(run.job_id, timeout_s=600, poll_s=1)
    logs = client.job_logs(run.job_id)
    assert status == "SUCCEEDED", logs[-4000:]
    name = spec["objective"]
    assert ("the reference is a frozen copy" in logs) == (name == "dpo" and "lora" not in how), logs[-4000:]
    run_dir = tmp_path / "runs" / "dpo"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    first, last = steps[0], steps[-1]
    assert first["loss"] == first[f"{name}_loss"] and first[f"{name}_pairs"] > 0, first
    if name == "dpo":  # the model is its reference
        assert abs(first["dpo_loss"] - math.log(2)) < 1e-5 and first["dpo_reward_margin"] == 0, first
        assert last["dpo_loss"] < 0.5 * math.log(2), last
    else:  # ORPO: the chosen completions' NLL and the odds-ratio term both fall
        assert last["orpo_loss"] < 0.7 * first["orpo_loss"], (first, last)
    assert last[f"{name}_reward_accuracy"] == 1.0 and last[f"{name}_reward_margin"] > first[f"{name}_reward_margin"]
    assert last[f"{name}_rewards_chosen"] > last[f"{name}_rewards_rejected"]
    keys = (f"{name}_loss", f"{name}_reward_accuracy", f"{name}_reward_margin")
    print(f"{name}: step 1", {k: first[k] for k in keys}, "step 12", {k: last[k] for k in keys})
    (evaluation,) = evals
    print(f"{name}: held out", {k: v for k, v in evaluation.items() if k.startswith(f"val_{name}")})
    assert evaluation["step"] == 12 and evaluation[f"val_{name}_pairs"] > 0 and "val_loss" in evaluation, evaluation
    assert (run_dir / "export" / "config.json").exists()  # the (merged) model
