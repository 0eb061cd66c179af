"""Direct preference optimisation end to end on the session's Ray cluster: preference pairs prepared with
`--preference` (tests/unit/jobs/test_dpo.py checks their rows and the loss against TRL's formula), trained by a
TrainJob with `objective: dpo` through Ray Train and DeepSpeed: with LoRA at ZeRO-2 (the reference: the adapters
disabled), and fully fine-tuned in bf16 on two workers at ZeRO-3 with a chunked output layer (the reference: a frozen
copy, partitioned); and
ORPO, reference-free, fully fine-tuned. DPO's first step's loss is log 2 (the model is still its reference); the loss
falls and the reward accuracy rises as it learns the preferences, the held-out pairs are evaluated with the same
figures, and the run exports its model. A reward model (`objective: reward`, LoRA at ZeRO-3 on two workers) learns the
same pairs, exports as a classifier, and Pylon's serving engine reads its rewards as transformers does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import pylon
from pylon.jobs.dpo import DpoLoss

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
    "loss_chunk_tokens": 32,  # the output layer 32 tokens at a time: no whole logits, for the reference too
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


# (make test runs the full fine-tune, which covers the frozen copy, ZeRO-3 and the chunked output layer; the LoRA
# reference and ORPO, whose losses tests/unit/jobs/test_dpo.py checks against TRL's formulas, run with make test-all:
# CI's 30 minutes)
@pytest.mark.parametrize(
    "how",
    [
        pytest.param(LORA, id="dpo-lora-zero2", marks=pytest.mark.slow),
        # bco_pair: its rewards' running mean goes through the run (and its checkpoint)
        pytest.param(LORA | {"dpo_loss": "bco_pair"}, id="dpo-bco-pair-lora-zero2", marks=pytest.mark.slow),
        pytest.param(FULL, id="dpo-full-zero3-bf16-chunked", marks=pytest.mark.slow),  # (~2.5 min)
        # the reference read once before the first step (two ranks' parts), then let go
        pytest.param(FULL | {"precompute_reference": True}, id="dpo-full-zero3-precomputed", marks=pytest.mark.slow),
        pytest.param(ORPO, id="orpo-full-zero2", marks=pytest.mark.slow),
    ],
)
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
    name, steps, evals, run_dir = _train(spec)
    if spec.get("precompute_reference"):
        assert (run_dir / "reference_logprobs" / "manifest.json").exists()
        assert sorted(p.name for p in (run_dir / "reference_logprobs").iterdir()) == [
            "manifest.json", "rank-00000.npz", "rank-00001.npz"]  # fmt: skip
    first, last = steps[0], steps[-1]
    assert first["loss"] == first[f"{name}_loss"] and first[f"{name}_pairs"] > 0, first
    if name == "dpo":  # the model is its reference: log 2 (bco_pair's: 2 log 2)
        start = DpoLoss(kind=spec.get("dpo_loss", "sigmoid")).at_start()
        assert abs(first["dpo_loss"] - start) < 1e-5 and first["dpo_reward_margin"] == 0, first
        # (bco_pair's floor is higher: each reward is classified against their running mean, which moves with them)
        assert last["dpo_loss"] < (0.6 if spec.get("dpo_loss") == "bco_pair" else 0.5) * start, last
    else:  # ORPO: the chosen completions' NLL and the odds-ratio term both fall
        assert last["orpo_loss"] < 0.7 * first["orpo_loss"], (first, last)
    assert last[f"{name}_reward_accuracy"] == 1.0 and last[f"{name}_reward_margin"] > first[f"{name}_reward_margin"]
    assert last[f"{name}_rewards_chosen"] > last[f"{name}_rewards_rejected"]
    (evaluation,) = evals
    assert evaluation["step"] == 12 and evaluation[f"val_{name}_pairs"] > 0 and "val_loss" in evaluation, evaluation
    assert (run_dir / "export" / "config.json").exists()  # the (merged) model


def _train(spec: dict) -> tuple:
    """Run the TrainJob `spec`; (its objective, its steps' records, its evaluations, its run directory)."""
    client = pylon.connect()
    run = client.train(spec)
    status = client.wait_job(run.job_id, timeout_s=600, poll_s=1)
    logs = client.job_logs(run.job_id)
    assert status == "SUCCEEDED", logs[-4000:]
    name = spec["objective"]
    assert ("the reference is a frozen copy" in logs) == (name in ("dpo", "kto") and "lora" not in spec), logs[-4000:]
    if spec.get("precompute_reference"):
        assert "precomputed in" in logs and "the frozen copy let go" in logs, logs[-4000:]
    run_dir = Path(spec["checkpoint"]["storage"]) / spec["name"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    first, last = steps[0], steps[-1]
    print(f"{name}: step 1", {k: v for k, v in first.items() if k.startswith(name)})
    print(f"{name}: step 12", {k: v for k, v in last.items() if k.startswith(name)})
    print(f"{name}: held out", {k: v for k, v in evals[-1].items() if k.startswith(f"val_{name}")} if evals else None)
    return name, steps, evals, run_dir


@pytest.mark.slow  # make test-all: ~2.5 min; tests/unit/jobs checks the reward loss
def test_a_reward_model_learns_the_preferences_and_serves_its_rewards(ray_cluster, tmp_path, tokenizer):  # noqa: F811
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pylon.data.prepare import prepare
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    data = str(tmp_path / "pref")
    prepare([_jsonl(tmp_path / "pref.jsonl", PAIRS * 4)], data, seq_len=64, tokenizer=tokenizer, preference=True,
            use_ray=False, progress=False)  # fmt: skip
    name, steps, evals, run_dir = _train(
        {
            "kind": "TrainJob",
            "name": "rm",
            "model": {"preset": "llama-tiny"},
            "objective": "reward",
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
            "data": {"uri": data, "seq_len": 64, "validation_fraction": 0.25},
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            "deepspeed": {"zero_stage": 3},
            "batch": {"micro_batch_size": 2, "grad_accum_steps": 1},
            "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
            "steps": 12,
            "eval": {"every_steps": 12},
            "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 12},
        }
    )
    first, last = steps[0], steps[-1]
    assert name == "reward" and first["loss"] == first["reward_loss"] and first["reward_pairs"] > 0, first
    assert last["reward_loss"] < 0.5 * first["reward_loss"] and last["reward_accuracy"] == 1.0, (first, last)
    (evaluation,) = evals  # a reward model's val_loss is its pairs' (Bradley-Terry): no perplexity
    assert evaluation["val_loss"] == evaluation["val_reward_loss"] and evaluation["val_perplexity"] is None
    assert evaluation["val_reward_accuracy"] == 1.0, evaluation
    export = str(run_dir / "export")
    recorded = json.loads((run_dir / "export" / "eval.json").read_text())  # what `pylon export` prints from
    assert recorded["perplexity"] is None and "Bradley-Terry" in recorded["metric"], recorded
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1, config
    model = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    hf = AutoTokenizer.from_pretrained(tokenizer)
    engine = LLMEngine(export, EngineSpec(device="cpu", dtype="fp32", max_model_len=64, max_num_batched_tokens=64))
    texts = [p["prompt"] + p[side] for p in PAIRS for side in ("chosen", "rejected")]
    for i, text in enumerate(texts):
        engine.add_request(str(i), hf(text)["input_ids"], SamplingParams(max_tokens=0, embed=True))
    served = {}
    while engine.has_unfinished():
        served.update((o.request_id, o.embedding[0]) for o in engine.step())
    for i, text in enumerate(texts):
        with torch.no_grad():
            want = model(**hf(text, return_tensors="pt")).logits[0, 0].item()
        assert abs(served[str(i)] - want) < 1e-4, (text, served[str(i)], want)
    assert all(served[str(2 * k)] > served[str(2 * k + 1)] for k in range(len(PAIRS))), served  # chosen scores higher
    print("reward: served", {texts[int(k)]: round(v, 3) for k, v in sorted(served.items())})
