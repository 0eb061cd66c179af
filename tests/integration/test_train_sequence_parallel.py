"""`scaling.sequence_parallel` end to end: a TrainJob whose two Ray Train workers split every row between them
(DeepSpeed Ulysses: each computes half of each row's tokens, attention all-to-all between them) trains as one worker
trains the same rows whole: the same loss at every step, the same held-out loss, the same tokens, the data read once
(the two read the same rows), and an export that matches its trainer (the model runs whole rows again after
training); resumed, each worker from its own data position, it goes on as the whole run does. The model: llama-tiny
(grouped-query attention, rotary positions); the data: short documents, several packed into each row. Units:
tests/unit/jobs/test_sequence_parallel.py."""

from __future__ import annotations

import json

import pytest
import yaml

import pylon
from pylon import storage

pytestmark = pytest.mark.integration

VARIANTS = {
    # ZeRO-3, packed documents attended apart, gradient checkpointing, a held-out split
    "zero3-documents": {
        "deepspeed": {"zero_stage": 3},
        "attention_mask": "document",
        "gradient_checkpointing": True,
    },
    # ZeRO-2 with LoRA and the loss a chunk at a time
    "zero2-lora-chunked": {
        "deepspeed": {"zero_stage": 2},
        "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
        "loss_chunk_tokens": 48,
    },
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> str:
    """Short documents (a few of the standard library's lines each, 10-90 bytes), several packed into each 64-token
    row: what `attention_mask: document` attends apart."""
    import sysconfig
    from pathlib import Path

    from pylon.data.prepare import prepare

    lines = [ln for ln in (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text().splitlines() if ln]
    src = tmp_path_factory.mktemp("documents-src") / "docs.jsonl"
    records, i = [], 0
    while i < len(lines):
        n = 1 + i % 3
        records.append(json.dumps({"text": "\n".join(lines[i : i + n])[:90]}))
        i += n
    src.write_text("\n".join(records) + "\n")
    out = str(tmp_path_factory.mktemp("documents-data") / "documents")
    prepare([str(src)], out, seq_len=64, use_ray=False, progress=False, text_field="text")
    return out


def _run(tmp_path, corpus: str, name: str, workers: int, sp: int, over: dict, steps: int = 4) -> tuple[str, str]:
    root = str(tmp_path / "runs")
    spec = {
        "kind": "TrainJob",
        "name": name,
        "model": {"preset": "llama-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 3, "validation_fraction": 0.1},
        "scaling": {
            "num_workers": workers,
            "sequence_parallel": sp,
            "resources_per_worker": {"CPU": 2 / workers},
        },
        "precision": "fp32",
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 2},
        "steps": steps,
        "eval": {"max_batches": 2},
        "checkpoint": {"storage": root, "every_steps": 2},
        **over,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    client = pylon.connect()
    job = client.submit_job(f"cd {tmp_path} && python -m pylon.jobs.train --config {path.name}")
    status = client.wait_job(job, timeout_s=600)
    logs = client.job_logs(job)
    assert status == "SUCCEEDED", logs[-6000:]
    return f"{root}/{name}", logs


def _records(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


@pytest.mark.parametrize(
    "variant",
    [
        "zero3-documents",
        pytest.param("zero2-lora-chunked", marks=pytest.mark.slow),  # ~3 min, resumed too; `make test-all`
    ],
)
def test_two_workers_splitting_rows_train_as_one_worker_does(ray_cluster, documents, tmp_path, variant) -> None:
    over, corpus = VARIANTS[variant], documents
    whole_uri, _ = _run(tmp_path, corpus, f"{variant}-whole", 1, 1, over)
    split_uri, logs = _run(tmp_path, corpus, f"{variant}-split", 2, 2, over)
    assert "scaling.sequence_parallel: 1 group(s) of 2 workers, each worker computing 32 of every row's 64" in logs

    whole, split = _records(whole_uri), _records(split_uri)
    steps = [r for r in whole if r.get("kind", "train") == "train"]
    steps_split = [r for r in split if r.get("kind", "train") == "train"]
    assert [r["step"] for r in steps_split] == [1, 2, 3, 4]
    for a, b in zip(steps, steps_split):
        assert b["tokens"] == a["tokens"] > 0  # every token counted once, by the rank that computed it
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5), (a, b)
    if "lora" not in over:  # (LoRA's few adapters at this rate move the loss little in 4 steps)
        assert steps[-1]["loss"] < steps[0]["loss"]
    evals = [r for r in whole if r.get("kind") == "eval"]
    evals_split = [r for r in split if r.get("kind") == "eval"]
    assert evals_split and len(evals_split) == len(evals)
    for a, b in zip(evals, evals_split):
        assert (b["val_tokens"], b["val_sequences"]) == (a["val_tokens"], a["val_sequences"])
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=2e-5)

    # the data read once for the group (its two workers read the same rows)
    from pylon.jobs.ledger import measure

    read, read_whole = (measure(uri)["bytes"]["data"]["read"] for uri in (split_uri, whole_uri))
    assert read == read_whole > 0
    # the export (checked against the trainer's own logits on a whole row) is there and loads
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(storage.join(split_uri, "export"))
    assert model.config.model_type == "llama"

    if variant != "zero2-lora-chunked":
        return
    # Both submitted again for 6 steps: each resumes from its step-4 checkpoint (the split run's workers each from
    # their own data position, the same in a group) and steps 5-6 agree as steps 1-4 did
    _run(tmp_path, corpus, f"{variant}-whole", 1, 1, over, steps=6)
    _, logs = _run(tmp_path, corpus, f"{variant}-split", 2, 2, over, steps=6)
    assert f"resumed {variant}-split from step 4" in logs
    more, more_split = (
        [r for r in _records(uri) if r.get("kind", "train") == "train" and r["step"] > 4]
        for uri in (whole_uri, split_uri)
    )
    assert [r["step"] for r in more_split] == [5, 6]
    for a, b in zip(more, more_split):
        assert b["tokens"] == a["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=2e-5), (a, b)
