"""Kahneman-Tversky optimisation (`objective: kto`, pylon.jobs.kto) on labelled prompt-completion records: the loss of
packed rows is, completion for completion, TRL's `kto_loss` computed on each prompt and completion alone, its KL
baseline the mean log-ratio of each prompt with the completion before it; w / 2 while the model is its reference. The
labels ride in the records (`ShardManifest.record_fields`) and are checked before any worker starts; the model learns
through DeepSpeed against a frozen copy of its start."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.prepare import prepare
from pylon.data.reader import Batch, RecordReader
from pylon.data.shards import DataError, read_manifest
from pylon.errors import PylonError
from pylon.jobs.grpo import prompts_and_answers
from pylon.jobs.kto import KtoLoss, balance_note, document_labels, kto_forward, kto_record, label_counts
from pylon.jobs.train import check_objective, model_inputs
from pylon.specs import TrainJobSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from test_chat_data import _jsonl  # noqa: E402
from test_checkpoint import distributed  # noqa: E402, F401 (fixture: a one-process gloo world, for DeepSpeed)
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

EOS, PAD = 256, 257  # the byte tokenizer's
RECORDS = [
    {"prompt": "Q: the capital of France? ", "completion": "Paris.", "label": True},
    {"prompt": "Q: the capital of France? ", "completion": "Berlin, I think.", "label": False},
    {"prompt": "Q: 2 + 2 = ", "completion": "4", "label": True},
    {"prompt": "Q: 2 + 2 = ", "completion": "5", "label": False},
    {"prompt": "Say hello. ", "completion": "Hello there!", "label": True},
    {"prompt": "Say hello. ", "completion": "No.", "label": False, "source": "forum"},
]
BETA = 0.5


def _spec(**extra) -> TrainJobSpec:
    return TrainJobSpec.model_validate(
        {"name": "k", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2, "objective": "kto",
         "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}, **extra}
    )  # fmt: skip


def _conversational(record: dict) -> dict:
    """`record` in TRL's conversational format: the prompt a user's message after a system prompt, the completion
    the assistant's."""
    prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": record["prompt"]}]
    return {**record, "prompt": prompt, "completion": [{"role": "assistant", "content": record["completion"]}]}


def _prepared(tmp_path, records=RECORDS, seq_len: int = 80, tokenizer: str = "byte") -> tuple[str, Batch]:
    out = str(tmp_path / "kto")
    prepare([_jsonl(tmp_path / "kto.jsonl", records)], out, seq_len=seq_len, prompt_completion=True, progress=False,
            tokenizer=tokenizer)  # fmt: skip
    manifest, tokens, num_tokens, ids = read_rows(out)
    eos = manifest.tokenizer.eos_id
    return out, Batch(ids, tokens, num_tokens, 0.0, True, eos, RecordReader(out, manifest).rows(ids))


def _model(seed: int = 0, vocab_size: int = 258, eos_id: int = EOS, pad_id: int = PAD):
    from pylon.models import build_model

    return build_model(_spec(), vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, seed=seed).eval()


def _logp(model, prompt: np.ndarray, completion: np.ndarray) -> float:
    """The summed log-probability of `completion` after `prompt`, the pair alone in its batch."""
    ids = torch.as_tensor(np.concatenate([prompt, completion]), dtype=torch.long)[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    n = len(prompt)
    return float(lp[n - 1 :, :].gather(1, ids[0, n:, None]).sum())


@pytest.mark.parametrize("conversational", [False, True])  # TRL's two formats: strings, and lists of messages
def test_the_packed_kto_loss_is_trls_completion_by_completion_and_half_at_the_start(tmp_path, conversational) -> None:
    from test_chat_data import _tokenizer

    from pylon.data.tokenizer import load_tokenizer

    tokenizer = _tokenizer(tmp_path / "tok") if conversational else "byte"
    records = [_conversational(r) for r in RECORDS] if conversational else RECORDS
    out, batch = _prepared(tmp_path, records, seq_len=160 if conversational else 80, tokenizer=tokenizer)
    tok = load_tokenizer(tokenizer)
    EOS, PAD = tok.eos_id, tok.pad_id  # noqa: N806 (the module's, for the byte tokenizer)
    assert read_manifest(out).prompt_format == ("conversational" if conversational else "text")
    if conversational:  # each prompt rendered with the generation prompt, each completion the reply and its end
        hf = tok._tok
        found = [(tok.decode(p), tok.decode(c)) for p, c, _ in prompts_and_answers(batch, EOS, whole=True)]
        want = [(hf.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                 r["completion"][0]["content"] + "<|im_end|>\n") for r in records]  # fmt: skip
        assert sorted(found) == sorted(want)
    inputs = batch.to_torch(PAD, documents=True)
    model, reference = (_model(0, tok.vocab_size if conversational else 258, EOS, PAD) for _ in range(2))
    run = {"eos_id": EOS, "pad_id": PAD}
    loss, n, tokens, stats, _ = kto_forward(model, model, inputs, batch, KtoLoss(BETA), "test", model_inputs,
                                            reference, **run)  # fmt: skip
    assert n == 6 and loss.item() / n == pytest.approx(0.5) and stats == [0.0, 0.0, 3.0, 3.0, 0.0]
    assert tokens == int((inputs["labels"][:, 1:] != -100).sum())
    with torch.no_grad():  # the model off its start: the packed loss is TRL's formula on each pair alone
        for p in reference.parameters():  # (the reference moved, so that the mismatched pairs' mean log-ratio is > 0)
            p.add_(
                torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                * (0.2 if conversational else 0.05)
            )
    docs = prompts_and_answers(batch, EOS, whole=True)
    labels = document_labels(batch, "test")
    assert sorted(labels) == [False] * 3 + [True] * 3
    ratio = [_logp(model, p, c) - _logp(reference, p, c) for p, c, _ in docs]
    shifted = [c for _, c, _ in docs][-1:] + [c for _, c, _ in docs][:-1]
    z = max(0.0, float(np.mean([_logp(model, p, c) - _logp(reference, p, c) for (p, _, _), c in zip(docs, shifted)])))
    for kind, weights in [("kto", (1.0, 1.0)), ("kto", (2.0, 0.5)), ("apo_zero_unpaired", (1.0, 1.0))]:
        setting = KtoLoss(BETA, kind, *weights)
        loss, n, _, stats, _ = kto_forward(model, model, inputs, batch, setting, "test", model_inputs, reference, **run)
        sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
        if kind == "kto":
            want = [weights[0] * (1 - sig(BETA * (r - z))) if good else weights[1] * (1 - sig(BETA * (z - r)))
                    for r, good in zip(ratio, labels)]  # fmt: skip
        else:
            want = [1 - sig(BETA * r) if good else sig(BETA * r) for r, good in zip(ratio, labels)]
        assert loss.item() == pytest.approx(sum(want), rel=1e-4), kind
        assert stats[0] == pytest.approx(BETA * sum(r for r, g in zip(ratio, labels) if g), rel=1e-4, abs=1e-5)
        assert stats[1] == pytest.approx(BETA * sum(r for r, g in zip(ratio, labels) if not g), rel=1e-4, abs=1e-5)
        assert stats[4] == pytest.approx(z if kind == "kto" else 0.0, rel=1e-4, abs=1e-6)
    assert z > 0  # (else the baseline's floor would be all this checks)
    record = kto_record(loss.item(), n, *stats, passes=1)
    assert record["kto_reward_margin"] == pytest.approx(record["kto_rewards_chosen"] - record["kto_rewards_rejected"])
    assert record["kto_desirable_share"] == 0.5 and record["kto_completions"] == 6


def test_labels_are_read_from_the_records_and_checked_before_workers_start(tmp_path, capsys) -> None:
    out, batch = _prepared(tmp_path)
    manifest = read_manifest(out)
    assert manifest.record_fields == ["label", "source"] and label_counts(out, manifest) == (3, 3)
    assert "3 desirable and 3 undesirable completions" in balance_note(3, 3, KtoLoss())
    note = balance_note(1, 5, KtoLoss())
    assert "= 0.20, outside the KTO paper's 1 to 4/3: set kto_undesirable_weight to 0.15-0.20" in note
    assert "no undesirable completion" in balance_note(4, 0, KtoLoss())
    spec = _spec().model_copy(update={"data": _spec().data.model_copy(update={"uri": out})})
    assert check_objective(spec, manifest) == [balance_note(3, 3, KtoLoss.of(spec))]  # (the driver prints it)
    assert check_objective(spec, manifest, labels=False) == []  # (a worker's: the driver read them)
    for bad, message in [
        ({"prompt": "q ", "completion": "a"}, r"row 0, document 1: no label; objective kto needs each record's label"),
        ({"prompt": "q ", "completion": "a", "label": "yes"}, r"row 0, document 1: label 'yes'"),
    ]:
        where = tmp_path / f"bad-{len(bad)}"
        where.mkdir()
        bad_out, bad_batch = _prepared(where, [RECORDS[0], bad])
        with pytest.raises(DataError, match=message):
            check_objective(spec.model_copy(update={"data": spec.data.model_copy(update={"uri": bad_out})}),
                            read_manifest(bad_out))  # fmt: skip
        with pytest.raises(DataError, match=message.replace("row 0", "test: row 0")):
            document_labels(bad_batch, "test")
    # records without a field of their own, in a group (a file) of their own: a shard with no records file, or
    # nulls in a shared one; either way their missing labels are found before workers start
    import pylon.data.prepare as prepare_module

    for rows_a_shard, message in [
        (1, r"shard part-\S+: no record in it has a label"),
        (64, r"row 0, document 0: no label"),
    ]:
        mixed = tmp_path / f"mixed-{rows_a_shard}"
        (mixed / "src").mkdir(parents=True)
        _jsonl(mixed / "src" / "a.jsonl", [{"prompt": "q ", "completion": "a" * 70}])
        _jsonl(mixed / "src" / "b.jsonl", RECORDS[:2])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prepare_module, "GROUP_BYTES", 1)
            prepare([str(mixed / "src")], str(mixed / "kto"), seq_len=80, prompt_completion=True, progress=False,
                    shard_size_mb=rows_a_shard * 80 * 4 / 2**20)  # fmt: skip
        with pytest.raises(DataError, match=message):
            label_counts(str(mixed / "kto"), read_manifest(str(mixed / "kto")))
    plain = tmp_path / "plain"
    plain.mkdir()
    plain_out, _ = _prepared(plain, [{k: v for k, v in r.items() if k != "label"} for r in RECORDS[:5]])
    with pytest.raises(PylonError, match=r"has no `label` field in its records \(its fields: none\)"):
        check_objective(spec.model_copy(update={"data": spec.data.model_copy(update={"uri": plain_out})}),
                        read_manifest(plain_out))  # fmt: skip
    prompts = str(tmp_path / "prompts")
    prepare([_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "label": True}])], prompts, seq_len=32, prompts=True,
            progress=False)  # fmt: skip
    with pytest.raises(PylonError, match=r"objective kto: data.uri .* holds prompts .* `--prompt-completion`"):
        check_objective(spec.model_copy(update={"data": spec.data.model_copy(update={"uri": prompts})}),
                        read_manifest(prompts))  # fmt: skip


def test_the_spec_takes_kto_settings_for_kto_only() -> None:
    spec = _spec(kto_loss="apo_zero_unpaired", kto_desirable_weight=1.5)
    assert KtoLoss.of(spec) == KtoLoss(0.1, "apo_zero_unpaired", 1.5, 1.0, False) and not KtoLoss.of(spec).baseline
    with pytest.raises(Exception, match="kto_desirable_weight: is objective kto's; objective is dpo"):
        _spec(objective="dpo", kto_desirable_weight=2.0)
    with pytest.raises(Exception, match="attention_mask: objective kto reads each completion on its own"):
        _spec(attention_mask="causal")
    with pytest.raises(Exception, match="precompute_reference: reads objective dpo's reference ahead; objective: kto"):
        _spec(precompute_reference=True)


@pytest.mark.parametrize("lora", [False, True])
def test_a_model_learns_to_prefer_the_desirable_completions(tmp_path, distributed, lora) -> None:  # noqa: F811
    """Through DeepSpeed (ZeRO-2), against a frozen copy of the start (full fine-tuning) or the adapters disabled
    (LoRA): the desirable completions' rewards rise above the undesirable ones', the loss falls below its start's
    w / 2, and the reference does not move."""
    from test_grpo import deepspeed_start

    out, batch = _prepared(tmp_path)
    inputs = batch.to_torch(PAD, documents=True)
    extra = {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "lm_head"]}} if lora else {}
    spec = _spec(**extra, dpo_beta=BETA)
    model, engine, reference = deepspeed_start(spec)
    loss_setting = KtoLoss.of(spec)
    figures = []
    for _ in range(12):
        loss, n, _, stats, _ = kto_forward(engine, model, inputs, batch, loss_setting, "test", model_inputs,
                                           reference, eos_id=EOS, pad_id=PAD)  # fmt: skip
        figures.append(kto_record(loss.item(), n, *stats, passes=1))
        engine.backward(loss / n)
        engine.step()
    assert figures[0]["kto_loss"] == pytest.approx(0.5) and figures[0]["kto_kl"] == 0.0
    last = figures[-1]
    assert last["kto_loss"] < 0.45 and last["kto_reward_margin"] > 0.1, figures
    assert last["kto_rewards_chosen"] > 0 > last["kto_rewards_rejected"], last
