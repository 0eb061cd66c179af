"""Kahneman-Tversky optimisation end to end on the session's Ray cluster: labelled prompt-completion records prepared
with `--prompt-completion` (each label a record field), trained by a TrainJob with `objective: kto` through Ray Train
and DeepSpeed, fully fine-tuned on two workers at ZeRO-3 against a frozen copy of the start (partitioned), the KL
baseline averaged over both ranks' mismatched pairs. Its first step's loss is half (the model is its reference); the
desirable completions' rewards rise above the undesirable ones', the held-out records are evaluated with the same
figures, and the run exports its model (tests/unit/jobs/test_kto.py checks the loss against TRL's formula)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "jobs"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat_data import _jsonl  # noqa: E402
from test_kto import RECORDS  # noqa: E402
from test_train_dpo import _train  # noqa: E402

# (make test-all: make test's 30 minutes have no room for another training job; tests/unit/jobs/test_kto.py checks the
# loss against TRL's formula and trains through DeepSpeed on every run)
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_kto_run_learns_which_completions_are_desirable(ray_cluster, tmp_path):
    from pylon.data.prepare import prepare

    data = str(tmp_path / "feedback")
    prepare([_jsonl(tmp_path / "feedback.jsonl", RECORDS * 4)], data, seq_len=80, prompt_completion=True,
            use_ray=False, progress=False)  # fmt: skip
    name, steps, evals, run_dir = _train(
        {
            "kind": "TrainJob",
            "name": "kto",
            "model": {"preset": "llama-tiny"},
            "objective": "kto",
            "dpo_beta": 0.5,
            "data": {"uri": data, "seq_len": 80, "validation_fraction": 0.25},
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            "deepspeed": {"zero_stage": 3},
            "batch": {"micro_batch_size": 1, "grad_accum_steps": 1},
            "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
            "steps": 12,
            "eval": {"every_steps": 12},
            "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 12},
        }
    )
    first, last = steps[0], steps[-1]
    # the model is its reference: every completion's loss is 1/2, the baseline 0
    assert first["kto_loss"] == pytest.approx(0.5, abs=1e-5) and first["kto_kl"] == 0.0, first
    assert first["loss"] == first["kto_loss"] and 0 < first["kto_desirable_share"] < 1, first
    assert last["kto_loss"] < 0.45 and last["kto_reward_margin"] > 0.1, last
    assert last["kto_rewards_chosen"] > last["kto_rewards_rejected"] and last["kto_kl"] >= 0, last
    (evaluation,) = evals
    assert evaluation["val_kto_completions"] > 0 and evaluation["val_kto_reward_margin"] > 0, evaluation
    assert (run_dir / "export" / "config.json").exists()
