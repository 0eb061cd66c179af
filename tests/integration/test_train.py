"""Training end to end on the session's Ray cluster: `ray job submit`-style jobs running DeepSpeed on 2
workers, resume after a worker is killed mid-run (resuming on re-submission:
tests/integration/test_ray_job_submit.py; checkpoints on the S3 server with retention and an export loaded by
`transformers`, with the two workers on two nodes: tests/integration/test_multinode.py)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

import pylon
from pylon import storage

pytestmark = pytest.mark.integration


def _write_spec(path: Path, corpus: str, storage_root: str, *, name: str, steps: int, every: int, **over) -> Path:
    spec = {
        "kind": "TrainJob",
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"},
        "precision": "fp32",
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "steps": steps,
        "checkpoint": {"storage": storage_root, "every_steps": every, "keep_last": 2},
    }
    for key, value in over.items():
        spec[key] = value
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(spec_path: Path) -> str:
    client = pylon.connect()
    return client.submit_job(f"cd {spec_path.parent} && python -m pylon.jobs.train --config {spec_path.name}")


def _wait(job_id: str, timeout_s: float = 600) -> str:
    client = pylon.connect()
    status = client.wait_job(job_id, timeout_s=timeout_s)
    assert status == "SUCCEEDED", client.job_logs(job_id)[-6000:]
    return client.job_logs(job_id)


def _metrics(run_uri: str, kind: str = "train") -> list[dict]:
    """metrics.jsonl's training steps (records without a kind), or its `"kind": "eval"` records."""
    records = [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]
    return [r for r in records if r.get("kind", "train") == kind]


def _committed_steps(run_uri: str) -> list[int]:
    from pylon.jobs.checkpoint import list_committed

    return [c.step for c in list_committed(run_uri)]


def _train_workers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([p.info["name"] or ""] + (p.info["cmdline"] or []))
        if "RayTrainWorker" in text:
            found.append(p)
    return found


# ~140 s. `make test` sees a run resume from its last commit in tests/integration/test_hosts.py, where a whole worker
# machine is lost (every process at once); this one kills one worker process on one node. `make test-all`.
@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_commit(ray_cluster, corpus, tmp_path):
    from pylon.data.reader import ShardStream

    root = str(tmp_path / "runs")
    run_uri = f"{root}/tiny-kill"
    spec = _write_spec(tmp_path / "train.yaml", corpus, root, name="tiny-kill", steps=30, every=5)
    job_id = _submit(spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(s >= 10 for s in _committed_steps(run_uri)):
        time.sleep(0.5)
    victims = _train_workers()
    assert victims, "no Ray Train worker process found to kill"
    victims[0].send_signal(signal.SIGKILL)
    logs = _wait(job_id)
    assert "resumed tiny-kill from step" in logs
    records = _metrics(run_uri)
    assert [r["step"] for r in records] == list(range(1, 31))
    # Each rank's data position after 30 steps is exactly where an uninterrupted stream would be.
    from pylon.jobs.checkpoint import latest_committed

    final = latest_committed(run_uri)
    assert final.step == 30
    for rank in range(2):
        saved = storage.read_json(f"{final.uri}/rank-{rank}.json")["extra"]["data"]["position"]
        replay = ShardStream(corpus, batch_size=4, rank=rank, world_size=2, seed=1, shuffle_buffer=64)
        batches = (b for _ in range(100) for b in replay.epoch())
        for _ in range(30):
            next(batches)
        assert saved == json.loads(json.dumps(replay.state_dict()["position"]))


# Wide enough that ZeRO-3 really partitions and offloads the matrices (DeepSpeed keeps parameters under 1e5
# elements whole on every rank); dropout off so the engine's and the export's logits agree exactly.
WIDE_GPT = {
    "config": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 384,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
}


def _download(uri: str, local: Path) -> Path:
    for name in storage.listdir(uri):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(storage.read_bytes(f"{uri}/{name}"))
    return local


@pytest.mark.slow  # LoRA also trains in test_deepspeed_combinations and tests/unit/ground/test_models.py; `make test-all`
def test_lora_on_zero3_with_cpu_offload_trains_only_adapters_and_exports(ray_cluster, corpus, tmp_path):
    """ZeRO-3 with parameters and optimizer offloaded to CPU, LoRA adapters on the attention and MLP input
    projections: the job trains and checkpoints; the merged export loads with transformers and reproduces the
    trained engine's logits; everything outside the adapters is still the base model's initial weights; the
    adapter-only export loads with peft on that base and gives the same logits. With a held-out split, every rank
    evaluates every 3 steps (ZeRO-3 gathers parameters collectively), and the export's eval.json holds the final
    loss, which transformers recomputes on the export over the same validation sequences, and `pylon.evaluate`
    through a live deployment of the export."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pylon.data.reader import ShardStream
    from pylon.jobs.export import export_run
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    root = str(tmp_path / "runs")
    lora = {"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_fc"]}
    spec_path = _write_spec(
        tmp_path / "train.yaml",
        corpus,
        root,
        name="lora-z3",
        steps=6,
        every=3,
        model=WIDE_GPT,
        lora=lora,
        deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        optim={"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        data={"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64, "validation_fraction": 0.05},
        eval={"every_steps": 3},
    )
    logs = _wait(_submit(spec_path))
    run_uri = f"{root}/lora-z3"
    found = re.search(r"model: ([\d,]+) parameters, ([\d,]+) trainable", logs)
    assert found, logs[-3000:]
    total, trainable = (int(x.replace(",", "")) for x in found.groups())
    line = found.group(0)
    expected_adapters = 2 * (4 * (384 + 3 * 384) + 4 * (384 + 4 * 384))  # 2 layers x (c_attn + c_fc): r*(in+out)
    assert trainable == expected_adapters and total > 30 * trainable, line
    records = _metrics(run_uri)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert min(r["loss"] for r in records[1:]) < records[0]["loss"], [r["loss"] for r in records]
    assert _committed_steps(run_uri) == [3, 6]

    merged = AutoModelForCausalLM.from_pretrained(_download(f"{run_uri}/export", tmp_path / "merged")).eval()
    ref = storage.read_json(f"{run_uri}/reference_logits.json")
    ids = torch.tensor([ref["input_ids"]])
    with torch.no_grad():
        logits = merged(input_ids=ids).logits[0, :, :16]
    assert torch.allclose(logits, torch.tensor(ref["logits"]), atol=1e-4), (
        (logits - torch.tensor(ref["logits"])).abs().max()
    )

    # Held-out evaluation: records apart from the steps, finite, the last one in the export's eval.json ...
    evals = _metrics(run_uri, kind="eval")
    assert [r["step"] for r in evals] == [3, 6], evals
    assert all(math.isfinite(r["val_loss"]) and math.isfinite(r["val_perplexity"]) for r in evals), evals
    assert all(r["val_tokens"] > 0 and r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in evals)
    assert re.search(r"final evaluation at step 6: validation loss [\d.]+, perplexity", logs), logs[-3000:]
    evaluation = json.loads((tmp_path / "merged" / "eval.json").read_text())
    assert evaluation["step"] == 6 and evaluation["loss"] == evals[-1]["val_loss"]
    assert evaluation["dataset"] == corpus and evaluation["split"] == "validation"
    # ... equal to transformers' own loss on the exported model, over the same validation sequences (fp32).
    val = ShardStream(corpus, batch_size=16, split="validation", validation_fraction=0.05)
    assert list(val.id_range) == evaluation["ids"]
    loss_sum, tokens, sequences = 0.0, 0, 0
    for batch in val.epoch():
        if len(batch):
            t = batch.to_torch(val.pad_id)
            with torch.no_grad():
                out = merged(input_ids=t["input_ids"], attention_mask=t["attention_mask"], labels=t["labels"])
            n = int((t["labels"][:, 1:] != -100).sum())
            loss_sum, tokens, sequences = loss_sum + out.loss.item() * n, tokens + n, sequences + len(batch)
    assert (tokens, sequences) == (evaluation["tokens"], evaluation["sequences"])
    assert abs(loss_sum / tokens - evaluation["loss"]) < 1e-3, (loss_sum / tokens, evaluation)
    # ... and to `pylon.evaluate` through a live deployment of the export (its prompt log-probabilities).
    from pylon.sdk.evaluate import evaluate
    from pylon.sdk.serve import delete, deploy
    from pylon.specs import DeploymentSpec

    served_spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "lora-z3-eval",
            "model": f"{run_uri}/export",
            "engine": {"max_num_seqs": 8, "kv_cache_tokens": 4096, "max_model_len": 128, "device": "cpu"},
            "http": {"route_prefix": "/lora-z3-eval", "api_keys_env": None},
            "replica": {"num_cpus": 0.25},
        }
    )
    url = deploy(served_spec)
    try:
        through = evaluate(url, data=corpus, validation_fraction=0.05)
    finally:
        delete("lora-z3-eval")
    assert (through.source, through.tokens, through.sequences) == ("endpoint", tokens, sequences), through
    assert abs(through.loss - evaluation["loss"]) < 1e-3, (through.loss, evaluation)
    print(
        f"held-out loss: trainer {evaluation['loss']:.6f}, transformers on the export {loss_sum / tokens:.6f}, "
        f"the deployment {through.loss:.6f} ({tokens} tokens, {sequences} sequences)"
    )

    # Only the adapters trained: every weight LoRA does not touch is bit-identical to the base model's.
    spec = TrainJobSpec.model_validate(yaml.safe_load(spec_path.read_text()))
    base = build_model(spec.model_copy(update={"lora": None}), vocab_size=320, eos_id=256, pad_id=257, seed=1)
    base_state, merged_state = base.state_dict(), merged.state_dict()
    adapted = {k for k in merged_state if ".c_attn." in k or ".c_fc." in k}
    adapted_weights = {k for k in adapted if k.endswith(".weight")}
    assert adapted_weights and all(not torch.equal(merged_state[k], base_state[k]) for k in adapted_weights)
    for key in set(merged_state) - adapted_weights:
        assert torch.equal(merged_state[key], base_state[key]), key

    # The adapters alone, in peft's format, on the same base.
    adapter_dir = tmp_path / "adapter"
    export_run(run_uri, str(adapter_dir), lora="adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits[0, :, :16]
    assert torch.allclose(peft_logits, torch.tensor(ref["logits"]), atol=1e-4)


TINY_MIXTRAL = {
    "config": {
        "model_type": "mixtral",
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
        "router_aux_loss_coef": 0.02,
    }
}


# ~90 s with the cluster's start: a mixture-of-experts model's whole life (the MoE parts each have unit tests: tests/unit/jobs/
# test_moe_training.py, tests/unit/serving/engine/test_model_families.py); `make test-all`.
@pytest.mark.slow
def test_a_mixture_of_experts_model_trains_on_zero3_exports_and_serves(ray_cluster, corpus, tmp_path):
    """A Mixtral-shaped model on 2 workers with ZeRO-3: metrics.jsonl records the routers' load-balancing loss
    beside the cross-entropy, a checkpoint commits, the export (the hub's per-expert layout) reproduces the
    trained engine's logits in transformers, and Pylon's serving engine gives transformers' greedy tokens on it."""
    import torch
    from transformers import AutoModelForCausalLM

    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    root = str(tmp_path / "runs")
    spec_path = _write_spec(
        tmp_path / "train.yaml",
        corpus,
        root,
        name="moe-z3",
        steps=6,
        every=6,
        model=TINY_MIXTRAL,
        deepspeed={"zero_stage": 3},
        optim={"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
    )
    logs = _wait(_submit(spec_path))
    run_uri = f"{root}/moe-z3"
    records = _metrics(run_uri)
    assert [r["step"] for r in records] == list(range(1, 7)), logs[-3000:]
    assert all(math.isfinite(r["router_aux_loss"]) and r["router_aux_loss"] > 0 for r in records), records
    assert min(r["loss"] for r in records[1:]) < records[0]["loss"], [r["loss"] for r in records]
    assert _committed_steps(run_uri) == [6]
    print(
        "loss",
        [round(r["loss"], 3) for r in records],
        "router_aux_loss",
        [round(r["router_aux_loss"], 3) for r in records],
    )

    local = _download(f"{run_uri}/export", tmp_path / "export")
    from safetensors import safe_open

    with safe_open(str(local / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    ref = storage.read_json(f"{run_uri}/reference_logits.json")
    ids = torch.tensor([ref["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :, :16]
    assert torch.allclose(logits, torch.tensor(ref["logits"]), atol=1e-4), (logits - torch.tensor(ref["logits"])).abs()

    engine = LLMEngine(
        str(local),
        EngineSpec(max_num_seqs=4, kv_cache_tokens=2048, max_model_len=128, block_size=16, device="cpu", dtype="fp32"),
    )
    prompts = [ids[0, :n].tolist() for n in (5, 17, 30)]
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )
        want = generated[0, len(prompt) :].tolist()
        assert list(out.token_ids) == want, (prompt, out.token_ids, want)
