"""objective eagle3 end to end on the session's Ray cluster: a byte-level Llama trained on the first 90% of
tinyshakespeare, then a TrainJob submitted through the SDK training an EAGLE-3 head for it (two workers, ZeRO-2, the
model frozen) for 16 steps, resubmitted for 64 (resumed from its checkpoint, which holds the head alone); each export
is the head's directory, and the serving engine drafts with it (`engine.speculative.method: eagle3`) on windows of the
held-out 10%: greedy outputs the model's own, and the longer-trained head's drafts accepted more often, as its
held-out accuracy said (tests/unit/jobs/test_eagle.py checks the unrolled head against the engine's drafts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pylon

pytestmark = pytest.mark.integration

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "tinyshakespeare.txt"
CONTEXT = 96


def _model(directory: Path, ids: list[int]) -> None:
    """A 6-layer Llama over bytes, trained until it writes like the text (as a Pylon export)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "llama", vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_id, bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data, g = torch.tensor(ids), torch.Generator().manual_seed(2)
    for _ in range(250):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (16,), generator=g).tolist()
        batch = torch.stack([data[s : s + CONTEXT] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 2.6, loss.item()  # (it has learnt more than the letters' frequencies: ~3.3)
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def _accepted(model: Path, head: str, prompts: list[list[int]]) -> tuple[float, list]:
    """The share of the head's drafts the engine accepted over `prompts` (greedy, 48 tokens each), and the outputs."""
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    spec = EngineSpec(
        max_num_seqs=4, kv_cache_tokens=2048, max_model_len=512, dtype="fp32",
        speculative={"method": "eagle3", "draft_model": head, "num_tokens": 3} if head else {"method": "none"},
    )  # fmt: skip
    engine = LLMEngine(str(model), spec)
    if head:  # (the rule told to speculate wherever drafts exist: what is measured is the head)
        engine.spec_policy.decide = lambda decodes, drafts, other, **_: decodes > 0 and drafts > 0
    outputs = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0))]
    stats = engine.stats()
    return (stats.spec_accepted_tokens_total / max(stats.spec_draft_tokens_total, 1) if head else 0.0), outputs


# (make test-all: 2.5 minutes, past what CI's time allows beside the rest; tests/unit/jobs/test_eagle.py keeps the
# trainer's head against the engine's drafts, ZeRO-2 and 3, saving and resuming, without a cluster)
@pytest.mark.slow
def test_an_eagle3_head_trained_for_a_model_drafts_for_it_in_the_engine(ray_cluster, tmp_path, capsys):
    from pylon.data.prepare import prepare
    from pylon.data.tokenizer import ByteTokenizer

    ids = ByteTokenizer().encode(SHAKESPEARE.read_text()).tolist()
    cut = len(ids) * 9 // 10
    train, held = ids[:cut], ids[cut:]
    _model(tmp_path / "model", train)
    (tmp_path / "text.txt").write_bytes(bytes(train[:120_000]))
    prepare([str(tmp_path / "text.txt")], str(tmp_path / "data"), seq_len=CONTEXT, use_ray=False, progress=False)

    spec = {
        "kind": "TrainJob",
        "name": "drafter",
        "model": {"path": str(tmp_path / "model")},
        "objective": "eagle3",
        "eagle3": {"draft_vocab_size": 72, "ttt_steps": 3},
        "data": {"uri": str(tmp_path / "data"), "validation_fraction": 0.05},
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 2},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
        "steps": 16,
        "eval": {"every_steps": 16, "max_batches": 4},
        "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 16},
    }
    client = pylon.connect()
    run_dir = tmp_path / "runs" / "drafter"
    exports = []
    for steps in (16, 64):
        spec["steps"] = steps
        job = client.train(spec)
        status = client.wait_job(job.job_id, timeout_s=900, poll_s=1)
        logs = client.job_logs(job.job_id)
        assert status == "SUCCEEDED", logs[-4000:]
        assert "draft vocabulary of 72 of the model's 320 tokens" in logs, logs[-3000:]
        if steps == 64:
            assert "resumed drafter from step 16" in logs, logs[-3000:]
        assert "serve " + str(tmp_path / "model") + " with engine.speculative: {method: eagle3, draft_model: " in logs
        export = run_dir / "export"
        assert json.loads((export / "pylon_export.json").read_text())["objective"] == "eagle3"
        exports.append(tmp_path / f"head-{steps}")
        export.rename(exports[-1])
    # checkpoints hold the head alone: far smaller than the frozen model's weights
    model_bytes = (tmp_path / "model" / "model.safetensors").stat().st_size
    shares = [p for p in (run_dir / "checkpoints").rglob("*model_states.pt")]
    assert shares and all(p.stat().st_size < model_bytes / 2 for p in shares), [p.stat().st_size for p in shares]

    from pylon.cli import main

    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "again")]) == 0  # (what `pylon export` says)
    said = capsys.readouterr().out
    assert "serve it with a Deployment of the model it drafts for, engine.speculative: {method: eagle3" in said, said
    assert "drafts a verification would accept" in said and "first draft" in said, said
    assert json.loads((tmp_path / "again" / "eval.json").read_text())["eagle3_accept_length"] > 1.0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    steps_done = [r for r in records if r.get("kind", "train") == "train"]
    assert [r["step"] for r in evals] == [16, 32, 48, 64]
    assert evals[-1]["val_eagle3_accuracy_0"] > evals[0]["val_eagle3_accuracy_0"] + 0.05, evals
    assert evals[-1]["val_eagle3_accept_length"] > 1.0 and evals[-1]["val_perplexity"] is None, evals[-1]
    assert steps_done[-1]["eagle3_accept_length"] > 0.8 and steps_done[-1]["mfu"] > 0, steps_done[-1]

    import torch

    g = torch.Generator().manual_seed(5)
    prompts = [held[s : s + 64] for s in torch.randint(0, len(held) - 64, (6,), generator=g).tolist()]
    _, plain = _accepted(tmp_path / "model", "", prompts)
    early, first = _accepted(tmp_path / "model", str(exports[0]), prompts)
    late, second = _accepted(tmp_path / "model", str(exports[1]), prompts)
    assert first == plain and second == plain  # (greedy: the model's own tokens, whatever drafts them)
    print(
        f"eagle3 head: {early:.0%} of drafts accepted after 16 steps, {late:.0%} after 64; held-out accuracy "
        f"{evals[0]['val_eagle3_accuracy_0']:.0%} -> {evals[-1]['val_eagle3_accuracy_0']:.0%}",
        flush=True,
    )
    assert late > early + 0.05 and late > 0.4, (early, late)
