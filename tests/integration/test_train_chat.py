"""Supervised fine-tuning on conversations end to end on the session's Ray cluster: a chat dataset prepared with
`--chat` (tests/unit/data/test_chat_data.py checks its rows), trained by a TrainJob through Ray Train and DeepSpeed;
the loss the run records counts exactly the assistant's replies' tokens of the rows it read, none of the prompts';
each conversation packed into a row is attended on its own (`attention_mask: auto` on a chat dataset:
tests/unit/jobs/test_document_attention.py), and `pylon.evaluate` on the export gives the trainer's held-out figure
attending them the same way. The run computes its loss a chunk of tokens at a time (`loss_chunk_tokens`:
tests/unit/jobs/test_chunked_loss.py), `pylon.evaluate` from whole logits: the same figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import pylon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
from test_chat_data import CONVERSATIONS, _jsonl, _tokenizer  # noqa: E402
from test_prepare import read_rows  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.slow  # make test-all: ~2 min; tests/unit/data checks the reply masks
def test_a_chat_fine_tune_counts_the_loss_on_the_replies_only(ray_cluster, tmp_path):
    from pylon.data.prepare import prepare
    from pylon.data.reader import Batch, split_ids

    tokenizer = _tokenizer(tmp_path / "tok")
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CONVERSATIONS * 6])
    data = str(tmp_path / "sft")
    # packed whole, best-fit decreasing (the default for conversations): rows of two or more conversations
    prepare([source], data, seq_len=112, tokenizer=tokenizer, chat=True, use_ray=False, progress=False)
    manifest, tokens, num_tokens, ids = read_rows(data)
    lo, hi = split_ids(manifest, 0.25)["validation"]
    assert 0 < lo < hi == len(ids)
    train = ids < lo  # the rows the run trains on; the rest are held out
    tokens, num_tokens, ids = tokens[train], num_tokens[train], ids[train]
    rows = len(ids)
    # the tokens the loss should count: replies, each predicted from the token before it in its row
    labels = Batch(ids, tokens, num_tokens, 0.0, True).to_torch(0)["labels"]
    counted = int((labels[:, 1:] != -100).sum())
    whole = int(num_tokens.sum()) - rows  # every real token but each row's first: what plain rows would count
    assert 0 < counted < whole

    spec = {
        "kind": "TrainJob",
        "name": "chat-sft",
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": data, "seq_len": 112, "validation_fraction": 0.25},
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 0},
        "loss_chunk_tokens": 16,
        "batch": {"micro_batch_size": rows, "grad_accum_steps": 1},  # one step: every row once
        "optim": {"warmup_steps": 0},
        "steps": 1,
        "checkpoint": {"storage": str(tmp_path / "runs"), "every_steps": 1},
    }
    client = pylon.connect()
    run = client.train(spec)
    status = client.wait_job(run.job_id, timeout_s=600, poll_s=1)
    assert status == "SUCCEEDED", client.job_logs(run.job_id)[-4000:]
    run_dir = tmp_path / "runs" / "chat-sft"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind", "train") == "train"]
    assert [r["step"] for r in steps] == [1] and steps[0]["tokens"] == counted, (steps, counted, whole)
    # The held-out conversations: the trainer's figure, recorded with how it attended them, is what `pylon eval`
    # computes on the exported model (transformers in fp32) attending each conversation on its own.
    recorded = json.loads((run_dir / "export" / "eval.json").read_text())
    assert recorded["step"] == 1 and recorded["attention_mask"] == "document", recorded
    result = pylon.evaluate(str(run_dir / "export"))
    assert result.attention_mask == "document" and result.tokens == recorded["tokens"] > 0, (result, recorded)
    assert abs(result.loss - recorded["loss"]) < 1e-4, (result.loss, recorded["loss"])
    across = pylon.evaluate(str(run_dir / "export"), attention_mask="causal")  # the same rows, attended across
    assert across.attention_mask == "causal" and abs(across.loss - recorded["loss"]) > 1e-4
