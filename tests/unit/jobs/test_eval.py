"""Held-out evaluation (pylon.jobs.train): the loss it reports is the trainer's token-level cross-entropy, the
mean over every validation token whichever worker held it, and its records stay apart from the training steps
in metrics.jsonl."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pylon.data.reader import Batch, DataPosition
from pylon.jobs.run_dir import METRICS_FILE, MetricsLog, eval_record, read_metrics
from pylon.jobs.train import _evaluate, reduce_eval, token_loss_sum

VOCAB = 17


def _plain_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The reference, written out by hand: -log softmax of the next token, averaged over real tokens."""
    total, count = 0.0, 0
    logp = torch.log_softmax(logits.double(), dim=-1)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target != -100:
                total -= float(logp[b, t, target])
                count += 1
    return total / count


def _sequences(seed: int = 0, rows: int = 5, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (rows, seq), generator=g)
    lengths = [12, 3, 9, 2, 12][:rows]  # very different token counts: a plain mean of means would be wrong
    for b, n in enumerate(lengths):
        labels[b, n:] = -100
    return logits, labels


def test_sharded_token_weighted_mean_equals_one_plain_computation() -> None:
    logits, labels = _sequences()
    expected = _plain_mean_loss(logits, labels)
    # Two "ranks" with an uneven share (3 rows and 2 rows): sum the parts, then divide by all their tokens.
    parts = [token_loss_sum(logits[:3], labels[:3]), token_loss_sum(logits[3:], labels[3:])]
    loss_sum = sum(float(s) for s, _ in parts)
    tokens = sum(n for _, n in parts)
    assert tokens == sum(n - 1 for n in (12, 3, 9, 2, 12))  # position t predicts t+1: a row of n gives n-1
    assert reduce_eval(loss_sum, tokens, 5, 2) == (loss_sum, tokens, 5, 2)  # no process group: this rank alone
    record = eval_record(1, loss_sum=loss_sum, tokens=tokens, sequences=5, batches=2, val_ids=(95, 100), seconds=0.1)
    assert record["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert record["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    # The naive mean of the ranks' means weighs a token of the short rank more: not what is reported.
    naive = sum(float(s) / n for s, n in parts) / 2
    assert abs(naive - expected) > 1e-3


def test_the_loss_is_what_transformers_computes_for_a_causal_lm() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, VOCAB, (3, 10))
    labels = ids.clone()
    labels[1, 6:] = -100
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    loss_sum, n = token_loss_sum(out.logits, labels)
    assert float(loss_sum) / n == pytest.approx(float(out.loss), abs=1e-6)


class _Engine(torch.nn.Module):
    """What `_evaluate` uses of a DeepSpeed engine: a module with a device."""

    def __init__(self, model):
        super().__init__()
        self.module, self.device = model, torch.device("cpu")

    def forward(self, **kw):
        return self.module(**kw)


class _Stream:
    """A validation stream of fixed batches, ending with an empty one (a worker whose part ran out)."""

    def __init__(self, tokens: np.ndarray, lengths: list[int], batch_size: int):
        self.manifest = SimpleNamespace(seq_len=tokens.shape[1], tokenizer=SimpleNamespace(pad_id=0))
        self.batches = [
            Batch(np.arange(i, i + len(t)), t, np.array(lengths[i : i + len(t)], np.int32), 0.0)
            for i, t in ((i, tokens[i : i + batch_size]) for i in range(0, len(tokens), batch_size))
        ]
        self.batches.append(Batch(np.zeros(0, np.int64), tokens[:0], np.zeros(0, np.int32), 0.0))
        self.steps_per_epoch = len(self.batches)
        self.id_range = (100, 100 + len(tokens))
        self.position = DataPosition(epoch=3, window=2)

    def epoch(self):
        assert self.position == DataPosition(), "evaluation must start at the split's beginning"
        yield from self.batches
        self.position = DataPosition(1)


def test_evaluate_runs_in_eval_mode_over_every_batch_and_restores_training_mode() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.5)
    model = GPT2LMHeadModel(config)  # dropout 0.5: a forward pass in training mode would give another loss
    engine = _Engine(model).train()
    tokens = np.random.default_rng(0).integers(1, VOCAB, (5, 12)).astype(np.int64)
    lengths = [12, 4, 9, 12, 7]
    record = _evaluate(engine, _Stream(tokens, lengths, batch_size=2), step=7)
    assert engine.training and model.training
    ids = torch.from_numpy(tokens)
    mask = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]
    labels = ids.masked_fill(~mask, -100)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids, attention_mask=mask.long(), labels=labels).loss.item()
    assert record["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert (record["kind"], record["step"], record["val_tokens"]) == ("eval", 7, sum(lengths) - len(lengths))
    assert (record["val_sequences"], record["val_batches"], record["val_ids"]) == (5, 4, [100, 105])
    # max_batches: only the first batch (2 rows).
    model.train()
    first = _evaluate(engine, _Stream(tokens, lengths, batch_size=2), step=7, max_batches=1)
    assert (first["val_sequences"], first["val_tokens"]) == (2, 11 + 3)


def test_eval_records_stay_apart_from_training_steps(tmp_path, capsys) -> None:
    run = str(tmp_path)
    log = MetricsLog(run, enabled=True, resume_step=0)
    for step in (1, 2):
        log.write({"step": step, "loss": 3.0 - step})
    log.write_eval(eval_record(2, loss_sum=10.0, tokens=5, sequences=1, batches=1, val_ids=(9, 10), seconds=0.0))
    log.write({"step": 3, "loss": 0.5})
    log.write_eval(eval_record(3, loss_sum=5.0, tokens=5, sequences=1, batches=1, val_ids=(9, 10), seconds=0.0))
    log.flush()
    out = capsys.readouterr().out
    assert "evaluation at step 2: validation loss 2.0000, perplexity 7.389" in out
    assert not any(line.startswith('{"step": 2, "kind"') for line in out.splitlines())
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # training steps only, as readers expect
    assert all("loss" in r and "kind" not in r for r in read_metrics(run))
    assert [(r["step"], r["val_loss"]) for r in read_metrics(run, kind="eval")] == [(2, 2.0), (3, 1.0)]
    assert len(read_metrics(run, kind=None)) == 5
    # A resume from step 2 keeps step 2's evaluation (committed with its checkpoint) and drops step 3's.
    resumed = MetricsLog(run, enabled=True, resume_step=2)
    resumed.flush()
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [(r.get("kind", "train"), r["step"]) for r in lines] == [("train", 1), ("train", 2), ("eval", 2)]


def test_an_export_carries_the_evaluation_of_its_own_step_only(tmp_path) -> None:
    from pylon.jobs.export import export_eval
    from pylon.specs import TrainJobSpec

    spec = TrainJobSpec.model_validate(
        {
            "kind": "TrainJob",
            "name": "job",
            "model": {"preset": "gpt-tiny"},
            "data": {"uri": "/data/corpus", "validation_fraction": 0.1},
            "steps": 6,
            "eval": {"every_steps": 3},
        }
    )
    log = MetricsLog(str(tmp_path), enabled=True, resume_step=0)
    for step in range(1, 7):
        log.write({"step": step, "loss": 1.0})
        if step % 3 == 0:
            log.write_eval(
                eval_record(step, loss_sum=step, tokens=4, sequences=2, batches=1, val_ids=(90, 100), seconds=0.0)
            )
    log.flush()
    final = export_eval(str(tmp_path), spec, 6)
    assert (final["step"], final["loss"], final["perplexity"]) == (6, 1.5, pytest.approx(math.exp(1.5)))
    assert (final["tokens"], final["sequences"], final["ids"]) == (4, 2, [90, 100])
    assert (final["dataset"], final["split"], final["validation_fraction"]) == ("/data/corpus", "validation", 0.1)
    assert export_eval(str(tmp_path), spec, 3)["loss"] == 0.75
    assert export_eval(str(tmp_path), spec, 4) is None  # a step that was not evaluated
