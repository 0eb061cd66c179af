"""Group relative policy optimisation end to end on the session's Ray cluster: prompts and answers prepared with
`--prompts`, a TrainJob with `objective: grpo` submitted through the SDK, whose reward function is the user's own
module in the directory it is submitted from (shipped with the job) beside a built-in one; two workers at ZeRO-3 with
LoRA and a KL term against the adapters disabled, sampling through a serving engine beside each worker (and, under
`make test-all`, from the model gathered once per micro-batch, and layer by layer with both ranks decoding in step). The reward rises as the model learns to say what it
is asked; the held-out prompts' greedy completions are scored; the run exports its model and plots its reward
(tests/unit/jobs/test_grpo.py checks the sampling, the advantages and the loss against TRL's)."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

import pylon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
from test_chat_data import _jsonl  # noqa: E402

pytestmark = pytest.mark.integration

REWARDS = """
def share_of_answer(completions, target, **kw):
    # the share of a completion's characters that are its record's target (one character here): a record field
    return [sum(ch == t for ch in c) / max(len(c), 1) if len(t) == 1 else None for c, t in zip(completions, target)]

def lowercase(completions, **kw):
    # the share of a completion's characters that are lowercase letters: a dense reward, few pairs tied
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]

def more_lowercase(prompts, completions):
    # a pairwise judge (objective online_dpo's grpo.judge): the completion with the larger share, or neither
    verdicts = []
    for a, b in completions:
        x, y = lowercase([a, b])
        verdicts.append(0 if x > y else 1 if y > x else -1)
    return verdicts
"""


def _grpo_spec(
    tmp_path, monkeypatch, name: str = "grpo", gather: bool = True, sampler: str = "model", repeat: int = 0
) -> dict:
    """Prompts whose answer is "a" and a TrainJob learning to say it: a user's reward module in the submitting
    directory beside a built-in; two workers at ZeRO-3, LoRA, a KL term; `sampler` samples. The prompts say "a" with
    0-7 "!"s, the last two held out; `repeat`: with 0 to `repeat` - 1 of them, over again (held-out prompts then ask
    as training ones do)."""
    from pylon.data.prepare import prepare

    monkeypatch.chdir(tmp_path)  # the directory the job is submitted from: its reward module travels with it
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(REWARDS))
    data = str(tmp_path / "prompts")
    if not (tmp_path / "prompts").exists():
        marks = [i % repeat if repeat else i for i in range(8)]
        records = [{"prompt": f"Say a{'!' * k}: ", "answer": "a", "target": "a"} for k in marks]
        prepare([_jsonl(tmp_path / "p.jsonl", records)], data, seq_len=16, prompts=True, use_ray=False,
                progress=False)  # fmt: skip
    spec = {
        "kind": "TrainJob",
        "name": name,
        "model": {"preset": "llama-tiny"},
        "objective": "grpo",
        "grpo": {
            "rewards": [{"function": "user_rewards:share_of_answer"}, {"function": "contains_answer", "weight": 0.5}],
            "generations": 8,
            "max_completion_tokens": 8,
            "beta": 0.02,
            "zero3_gather_for_sampling": gather,
            "sampler": sampler,
        },
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]},
        "data": {"uri": data, "seq_len": 16, "validation_fraction": 0.25},
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 3},
        "batch": {"micro_batch_size": 2, "grad_accum_steps": 1},
        "optim": {"lr": 2e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
        "steps": 12,
        "eval": {"every_steps": 12},
        "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 6},
    }
    if sampler == "server":  # (the session cluster's 2 CPUs: both workers and the server)
        spec["scaling"]["resources_per_worker"] = {"CPU": 0.75}
        spec["grpo"]["sampler_resources"] = {"CPU": 0.5}
    return spec


def _run(spec: dict) -> tuple[str, list[dict], list[dict]]:
    """Submit `spec` and wait: (its job's logs, its steps' records, its evaluations)."""
    client = pylon.connect()
    run = client.train(spec)
    status = client.wait_job(run.job_id, timeout_s=600, poll_s=1)
    logs = client.job_logs(run.job_id)
    assert status == "SUCCEEDED", logs[-4000:]
    run_dir = Path(spec["checkpoint"]["storage"]) / spec["name"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        logs,
        [r for r in records if r.get("kind", "train") == "train"],
        [r for r in records if r.get("kind") == "eval"],
    )


def test_a_grpo_run_learns_what_its_reward_asks_for(ray_cluster, tmp_path, monkeypatch):
    """Sampled by a serving engine beside each worker (`grpo.sampler: engine`), given the policy's weights, its LoRA
    adapters merged and its ZeRO-3 partitions gathered, after every update; its greedy evaluation too."""
    spec = _grpo_spec(tmp_path, monkeypatch, sampler="engine", repeat=4)
    logs, steps, evals = _run(spec)
    assert "greedy completions" in logs and "grpo_reward" in logs, logs[-4000:]  # the evaluation's line, step records
    assert "grpo.sampler engine: completions sampled by a serving engine" in logs, logs[-4000:]
    run_dir = tmp_path / "runs" / "grpo"
    (evaluation,) = evals
    assert [r["step"] for r in steps] == list(range(1, 13))
    rewards = [round(r["grpo_reward"], 3) for r in steps]
    print("grpo: rewards by step", rewards)
    print("grpo: step 12", {k: v for k, v in steps[-1].items() if k.startswith("grpo")})
    print("grpo: held out", {k: v for k, v in evaluation.items() if k.startswith("val_")})
    first = steps[0]
    # 2 workers x 2 rows x one prompt a row x 8 completions; the start is the reference (its adapters' B is 0)
    assert first["grpo_completions"] == 32 and first["grpo_kl"] < 1e-6, first
    assert first["grpo_reward"] == pytest.approx(
        first["grpo_rewards.share_of_answer"] + 0.5 * first["grpo_rewards.contains_answer"]
    )
    early, late = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert late > early + 0.3, rewards
    assert steps[-1]["grpo_kl"] > 0 and 0 < steps[-1]["grpo_completion_length"] <= 8
    # the engine's correction: each token's pi_old / pi_engine, ~1 where the engine computes in fp32 as the model does
    assert all(r["grpo_sampler_ratio"] == pytest.approx(1.0, abs=1e-3) for r in steps), steps[-1]
    # MFU counts sampling and the passes over prompts too: more FLOPs per step than its completion tokens' alone
    assert all(r["mfu"] > 0 for r in steps), [r["mfu"] for r in steps]
    assert evaluation["val_grpo_completions"] == 2 and evaluation["val_grpo_reward"] > 0.5, evaluation
    assert evaluation["val_loss"] > 0  # the dataset's own completions' loss, as for any prompt-completion run
    assert (run_dir / "export" / "config.json").exists() and (run_dir / "loss.png").stat().st_size > 0
    # the completions it sampled, 4 a step (grpo.log_completions' default), each with every function's score
    from pylon.jobs.run_dir import read_completions

    sampled = read_completions(str(run_dir))
    assert [r["step"] for r in sampled] == [s for s in range(1, 13) for _ in range(4)]
    assert all(set(r["rewards"]) == {"share_of_answer", "contains_answer"} and r["prompt"].startswith("Say a")
               for r in sampled)  # fmt: skip
    assert "step 1 completion: reward" in logs and "step 11 completion: reward" in logs, logs[-4000:]


def test_a_grpo_run_samples_on_a_server_of_its_own_and_learns(ray_cluster, tmp_path, monkeypatch):
    """`grpo.sampler: server` (TRL's vllm_mode server): the engine in a Ray actor of its own, holding its own share of
    the cluster, sent the policy's weights (LoRA merged, ZeRO-3 gathered by both workers) by the first worker through
    the object store before each sampling step; both workers' rows gathered by the first and sampled there together."""
    spec = _grpo_spec(tmp_path, monkeypatch, name="grpo-server", sampler="server", repeat=4)
    logs, steps, evals = _run(spec)
    assert "grpo.sampler server: completions sampled by 1 sampling server(s)" in logs, logs[-4000:]
    up = re.search(r"grpo\.sampler server: (pylon-sampler-\S+-0) is up \(node \w+, pid (\d+)\)", logs)
    assert up, logs[-4000:]
    workers = json.loads((tmp_path / "runs" / "grpo-server" / "workers.json").read_text())["workers"]
    assert int(up.group(2)) not in {w["pid"] for w in workers}  # a process of its own, not a worker's
    # one load a sampling step (12) and one for the evaluation after the last update, all it generated
    done = re.search(rf"{up.group(1)} took (\d+) weight loads .* and generated ([\d,]+) tokens", logs)
    assert done and int(done.group(1)) == 13, logs[-4000:]
    generated = int(done.group(2).replace(",", ""))
    assert generated == pytest.approx(
        sum(r["grpo_completions"] * r["grpo_completion_length"] for r in steps)
        + sum(e["val_grpo_completions"] * e["val_grpo_completion_length"] for e in evals)
    )
    rewards = [round(r["grpo_reward"], 3) for r in steps]
    print("grpo server: rewards by step", rewards)
    assert steps[0]["grpo_completions"] == 32 and steps[0]["grpo_kl"] < 1e-6, steps[0]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
    assert all(r["grpo_sampler_ratio"] == pytest.approx(1.0, abs=1e-3) for r in steps), steps[-1]
    (evaluation,) = evals
    assert evaluation["val_grpo_completions"] == 2 and evaluation["val_grpo_reward"] > 0.5, evaluation
    # the ledger counts the server's share of the cluster from its start to its stop
    run_dir = tmp_path / "runs" / "grpo-server"
    (session,) = [json.loads(p.read_text()) for p in (run_dir / "ledger").glob("session-*.json")]
    servers = session["servers"]
    assert servers["count"] == 1 and servers["resources"] == {"CPU": 0.5}, servers
    assert session["started_at"] < servers["started_at"] < servers["ended_at"] <= session["ended_at"]


@pytest.mark.slow  # (make test-all: three more jobs each)
@pytest.mark.parametrize("sampler", ["model", "engine", "server"])
def test_a_resumed_grpo_run_samples_and_learns_what_the_uninterrupted_one_did(
    ray_cluster, tmp_path, monkeypatch, sampler
):
    """A run stopped at its step-6 checkpoint and submitted again goes on from there, sampling with the same seeds
    and the same restored state: its steps 7-12 are, figure for figure, an uninterrupted run's. The model sampler's
    uninterrupted run decodes layer by layer with both ranks in step (`zero3_gather_for_sampling: false`), the same
    model either way; the engine of the resumed run is built from the restored weights, the uninterrupted one's was
    given them step by step."""
    whole = _run(_grpo_spec(tmp_path, monkeypatch, "whole", gather=False, sampler=sampler))[1]
    _run(_grpo_spec(tmp_path, monkeypatch, "split", sampler=sampler) | {"steps": 6, "eval": {"every_steps": 6}})
    logs, resumed, _ = _run(_grpo_spec(tmp_path, monkeypatch, "split", sampler=sampler))
    assert "resumed split from step 6" in logs, logs[-4000:]
    assert [r["step"] for r in resumed] == list(range(1, 13))
    keys = ["loss", "grpo_reward", "grpo_kl", "grpo_completion_length", "grpo_rewards.share_of_answer"]
    for a, b in zip(whole, resumed):
        differ = {k: (a[k], b[k]) for k in keys if a[k] != pytest.approx(b[k], rel=1e-5, abs=1e-7)}
        assert not differ, (a["step"], differ)


@pytest.mark.slow  # make test-all: ~1.5 min; tests/unit/jobs/test_grpo.py checks its loss and that it learns
def test_an_rloo_run_learns_with_its_kl_in_the_reward(ray_cluster, tmp_path, monkeypatch):
    """objective rloo on the same prompts and rewards: two workers at ZeRO-2 with LoRA, its KL to the start (the
    adapters disabled, read through the DeepSpeed engine as it samples) a cost in each completion's reward, the
    leave-one-out baseline, one clipped ratio per completion. The reward rises; the KL is reported. (beta 0.01: the
    KL is summed over a completion's tokens, and saying "a" takes this model ~6 nats a token from its start; at
    TRL's 0.05 that cost outweighs the reward and the run stays where it began, as it should.)"""
    spec = _grpo_spec(tmp_path, monkeypatch, name="rloo")
    spec["objective"] = "rloo"
    spec["grpo"] = {**spec["grpo"], "beta": 0.01}
    del spec["grpo"]["zero3_gather_for_sampling"]
    spec["deepspeed"] = {"zero_stage": 2}
    logs, steps, evals = _run(spec)
    rewards = [round(r["grpo_reward"], 3) for r in steps]
    print("rloo: rewards by step", rewards)
    print("rloo: step 12", {k: v for k, v in steps[-1].items() if k.startswith("grpo") or k == "mfu"})
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert steps[0]["grpo_completions"] == 32 and steps[0]["grpo_kl"] < 1e-6  # 2 workers x 2 prompts x 8
    early, late = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert late > early + 0.3, rewards
    assert steps[-1]["grpo_kl"] > 0 and all(r["mfu"] > 0 for r in steps)
    (evaluation,) = evals
    assert evaluation["val_grpo_completions"] == 2 and "val_grpo_reward" in evaluation
    assert (tmp_path / "runs" / "rloo" / "export" / "config.json").exists()


@pytest.mark.slow  # (make test-all: tests/unit/jobs/test_grpo.py checks its loss against TRL's and that it learns)
@pytest.mark.parametrize("judge", [False, True])  # a reward function; a pairwise judge (grpo.judge) in its place
def test_an_online_dpo_run_learns_what_its_reward_prefers(ray_cluster, tmp_path, monkeypatch, judge):
    """objective online_dpo on the same prompts: two workers at ZeRO-3 with LoRA (the reference: the adapters
    disabled), each prompt's two completions a pair, the better-rewarded chosen, a dense reward (the share of
    lowercase letters: two completions seldom tie, where saying "a" at random would leave most pairs tied at 0). The
    reward rises and the pairs' implicit reward accuracy passes one half. With a judge of pairs (the user's module,
    shipped as a reward module is), the completions it logs rise in the same share."""
    spec = _grpo_spec(tmp_path, monkeypatch, name="online-dpo")
    spec["objective"] = "online_dpo"
    spec["dpo_beta"] = 0.1
    scoring = (
        {"judge": "user_rewards:more_lowercase"} if judge else {"rewards": [{"function": "user_rewards:lowercase"}]}
    )
    spec["grpo"] = {
        **{k: v for k, v in spec["grpo"].items() if k != "rewards"},
        "generations": 2,
        "beta": 0.0,
        **scoring,
    }
    spec["steps"], spec["eval"], spec["checkpoint"]["every_steps"] = 24, {"every_steps": 24}, 24
    logs, steps, evals = _run(spec)
    if judge:  # no reward figures: the logged completions' share of lowercase letters (4 a step) is the curve
        from pylon.jobs.run_dir import read_completions

        assert "grpo_reward" not in steps[0] and "grpo_rewards.more_lowercase" not in steps[0], steps[0]
        sampled = read_completions(str(tmp_path / "runs" / "online-dpo"))
        for r in steps:
            texts = [c["completion"] for c in sampled if c["step"] == r["step"]]
            r["grpo_reward"] = sum(sum(ch.islower() for ch in t) / max(len(t), 1) for t in texts) / max(len(texts), 1)
    rewards = [round(r["grpo_reward"], 3) for r in steps]
    print("online_dpo: rewards by step", rewards)
    print("online_dpo: step 24", {k: v for k, v in steps[-1].items() if "dpo" in k or k.startswith("grpo")})
    assert steps[0]["grpo_completions"] == 8 and steps[0]["online_dpo_reward_margin"] == 0.0  # 2 x 2 prompts x 2
    early, late = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    # (the pairs' accuracy on the steps where any pair prefers, after the first: once every completion scores 1,
    # every pair ties)
    preferring = [r["online_dpo_reward_accuracy"] for r in steps[1:] if r["grpo_zero_std_groups"] < 1]
    print("online_dpo: accuracy where pairs prefer", preferring)
    assert late > early + 0.2 and sum(preferring) / max(len(preferring), 1) > 0.5, (rewards, preferring)
    (evaluation,) = evals
    assert (evaluation["val_grpo_reward"] is None) == judge, evaluation  # (a judge cannot score one completion)
    assert (tmp_path / "runs" / "online-dpo" / "export" / "config.json").exists()
