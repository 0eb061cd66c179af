"""Group relative policy optimisation (`objective: grpo`, pylon.jobs.grpo): prompts and answers read from a
prompt-completion dataset's rows; completions sampled with a KV cache from left-padded prompts (greedy: each prompt's
own argmax continuation, computed alone and without a cache); rewards from built-in or imported functions, a bad one
named by its field; TRL's advantages and losses, value and gradient; and a model that learns, in this process through
DeepSpeed, to say what its reward asks for."""

from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pylon.data.prepare import prepare
from pylon.data.reader import Batch
from pylon.errors import PylonError
from pylon.jobs.grpo import (
    GrpoLoss,
    Rewards,
    completion_batch,
    exact_match,
    group_advantages,
    grpo_forward,
    grpo_losses,
    grpo_record,
    grpo_sample,
    grpo_train,
    prompts_and_answers,
    sample_completions,
    sample_seed,
    token_logprobs,
)
from pylon.specs import TrainJobSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from test_chat_data import _jsonl  # noqa: E402
from test_checkpoint import distributed  # noqa: E402, F401 (fixture: a one-process gloo world, for DeepSpeed)
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

EOS, PAD = 256, 257  # the byte tokenizer's
RECORDS = [
    {"prompt": "Say a: ", "completion": "a"},
    {"prompt": "Q: 2 + 2 = ", "completion": "4"},
    {"prompt": "Name a colour. ", "completion": "blue"},
    {"prompt": "Write the letter a. ", "completion": "a"},
]


def _batch(tmp_path, records=RECORDS, seq_len: int = 64) -> Batch:
    out = str(tmp_path / "pc")
    prepare([_jsonl(tmp_path / "pc.jsonl", records)], out, seq_len=seq_len, prompt_completion=True, progress=False)
    _, tokens, num_tokens, ids = read_rows(out)
    return Batch(ids, tokens, num_tokens, 0.0, True, EOS), out


def _spec(preset: str = "llama-tiny", **grpo) -> TrainJobSpec:
    return TrainJobSpec.model_validate(
        {"name": "g", "model": {"preset": preset}, "data": {"uri": "/tmp/none"}, "steps": 2,
         "objective": "grpo", "grpo": {"rewards": [{"function": "contains_answer"}], **grpo}}
    )  # fmt: skip


def _model(seed: int = 0, preset: str = "llama-tiny"):
    from pylon.models import build_model

    return build_model(_spec(preset), vocab_size=258, eos_id=EOS, pad_id=PAD, seed=seed).eval()


def deepspeed_start(spec: TrainJobSpec):
    """(model, DeepSpeed engine, reference) for `spec` on the byte tokenizer, as the trainer starts them in this
    process (`distributed`'s one-process world): the reference None with lora (its adapters disabled), else a frozen
    copy of the start."""
    import deepspeed

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.dpo import frozen_reference
    from pylon.models import build_model

    ds_config = build_deepspeed_config(spec, world_size=1)
    built = {"vocab_size": 258, "eos_id": EOS, "pad_id": PAD, "seed": 0}
    model = build_model(spec, deepspeed_config=ds_config, **built)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    reference = None if spec.lora else frozen_reference(spec, ds_config, **built, device=None, dtype=torch.float32)
    return model, engine, reference


def test_each_document_is_a_prompt_and_its_completion_the_answer(tmp_path) -> None:
    batch, _ = _batch(tmp_path)
    found = sorted(
        (bytes(p.tolist()).decode(), bytes(a.tolist()).decode()) for p, a, _ in prompts_and_answers(batch, EOS)
    )
    assert found == sorted((r["prompt"], r["completion"]) for r in RECORDS)
    text = Batch(batch.sample_ids, np.abs(batch.tokens), batch.num_tokens, 0.0, False, EOS)
    with pytest.raises(PylonError, match="prompt-completion or chat dataset"):
        prompts_and_answers(text, EOS)


def test_a_conversation_is_its_last_reply_after_the_generation_prompt(tmp_path) -> None:
    from test_chat_data import CONVERSATIONS, _tokenizer

    from pylon.data.tokenizer import load_tokenizer

    tokenizer = _tokenizer(tmp_path / "tok")
    out = str(tmp_path / "chat")
    prepare([_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])], out, seq_len=128,
            tokenizer=tokenizer, chat=True, progress=False)  # fmt: skip
    tok = load_tokenizer(tokenizer)
    _, tokens, num_tokens, ids = read_rows(out)
    found = prompts_and_answers(Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id), tok.eos_id)
    hf = tok._tok
    want = sorted(
        (hf.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True), c[-1]["content"])
        for c in CONVERSATIONS
    )
    assert sorted((tok.decode(p), tok.decode(a)) for p, a, _ in found) == want


def test_a_prompts_dataset_holds_text_and_chat_prompts_with_optional_answers(tmp_path) -> None:
    from test_chat_data import _tokenizer

    from pylon.data.shards import DataError, read_manifest
    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.train import check_objective

    tokenizer = _tokenizer(tmp_path / "tok")
    chat = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "And of Norway?"}]
    records = [
        {"prompt": "What is the capital of France? ", "answer": "Paris"},
        {"prompt": chat, "answer": "Oslo"},
        {"prompt": "hello there", "id": 7},  # no answer: the prompt alone (other fields ignored)
    ]
    out = str(tmp_path / "prompts")
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", records)], out, seq_len=64, tokenizer=tokenizer, prompts=True,
                       progress=False)  # fmt: skip
    assert manifest.prompts and manifest.prompt_completion and manifest.loss_mask and manifest.document_starts
    assert "prompts and their answers, for objective grpo" in manifest.summary()
    tok = load_tokenizer(tokenizer)
    _, tokens, num_tokens, ids = read_rows(out)
    found = prompts_and_answers(Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id), tok.eos_id)
    hf = tok._tok
    want = [
        (hf.decode(hf("What is the capital of France? ")["input_ids"]), "Paris"),
        (hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), "Oslo"),
        (hf.decode(hf("hello there")["input_ids"]), ""),
    ]
    assert sorted((tok.decode(p), tok.decode(a)) for p, a, _ in found) == sorted(want)
    grpo = _spec().model_copy(update={"data": _spec().data.model_copy(update={"uri": out})})
    check_objective(grpo, read_manifest(out))
    sft = TrainJobSpec.model_validate(
        {"name": "s", "model": {"preset": "llama-tiny"}, "data": {"uri": out}, "steps": 1}
    )
    with pytest.raises(PylonError, match=r"objective causal_lm: data.uri .* holds prompts .* for objective grpo"):
        check_objective(sft, read_manifest(out))
    for record, message in [
        ({"answer": "x"}, r"line 1: no 'prompt' field \(has \['answer'\]\)"),
        ({"prompt": ""}, "line 1: prompt: a non-empty string or a list of messages"),
        (
            {"prompt": [{"content": "hi"}]},
            "line 1: prompt: a non-empty list of messages, each an object with a string role",
        ),
        ({"prompt": "q", "answer": 4}, "line 1: answer is a int, not a string"),
    ]:
        with pytest.raises(DataError, match=message):
            prepare([_jsonl(tmp_path / "bad.jsonl", [record])], str(tmp_path / "bad"), seq_len=64, tokenizer=tokenizer,
                    prompts=True, progress=False)  # fmt: skip
    with pytest.raises(DataError, match="a prompt of messages needs a Hugging Face tokenizer directory"):
        prepare([_jsonl(tmp_path / "c.jsonl", [{"prompt": chat}])], str(tmp_path / "b2"), seq_len=64, prompts=True,
                progress=False)  # fmt: skip
    with pytest.raises(DataError, match="choose one"):
        prepare([str(tmp_path / "p.jsonl")], str(tmp_path / "b3"), prompts=True, prompt_completion=True, progress=False)


def _reward_model_export(export: Path, hf):
    """A small random reward model (a one-label LlamaForSequenceClassification) with tokenizer `hf` in `export`, as
    an `objective: reward` run exports one; its config."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    hf.save_pretrained(export)
    config = LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=hf.pad_token_id,
                         architectures=["LlamaForSequenceClassification"])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(export)
    return config


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt-tiny"])  # rotary positions, and learnt absolute ones
def test_greedy_sampling_from_left_padded_prompts_is_each_prompts_own_continuation(preset) -> None:
    model = _model(preset=preset)
    with torch.no_grad():  # larger weights: a random model's argmax then depends on every position and token
        for p in model.parameters():
            p.mul_(4)
    prompts = [np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64) for t in ("Hi", "A longer prompt", "xyz!")]
    loss = GrpoLoss(max_tokens=6)
    got = sample_completions(model, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu", seed=0, greedy=True, copies=2)
    assert len(got) == 6
    for i, p in enumerate(prompts):
        ids = torch.from_numpy(p)[None]
        want = []
        with torch.no_grad():
            for _ in range(6):  # alone, no padding, no cache: the whole sequence each time
                token = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
                want.append(token)
                if token == EOS:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        assert got[2 * i].tolist() == want and got[2 * i + 1].tolist() == want


def test_sampling_is_seeded_ends_at_the_eos_and_top_p_narrows_it() -> None:
    model = _model()
    prompts = [np.frombuffer(b"Say a: ", dtype=np.uint8).astype(np.int64)] * 2
    loss = GrpoLoss(generations=4, max_tokens=12)

    def draw(seed, **kw):
        return [c.tolist() for c in sample_completions(model, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu",
                                                        seed=seed, **kw)]  # fmt: skip

    a, b, c = draw(1), draw(1), draw(2)
    assert a == b and a != c and len(a) == 8
    assert all(len(x) == 12 or x[-1] == EOS for x in a) and all(EOS not in x[:-1] for x in a)
    assert len({tuple(x) for x in a}) > 1  # a group's completions differ
    greedy = draw(0, greedy=True, copies=4)
    narrow = GrpoLoss(generations=4, max_tokens=12, top_p=1e-6)  # only the likeliest token left: greedy
    assert [x.tolist() for x in sample_completions(model, prompts, narrow, eos_id=EOS, pad_id=PAD, device="cpu",
                                                   seed=5)] == greedy  # fmt: skip
    assert sample_seed(0, 3, 1, 0) == sample_seed(0, 3, 1, 0) != sample_seed(0, 3, 1, 1)


def test_advantages_are_trls_group_relative_ones() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    t = torch.tensor(rewards).view(-1, 4)
    want = ((t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-4)).view(-1)  # TRL's, torch's unbiased std
    assert np.allclose(group_advantages(rewards, 4, "group"), want.numpy())
    assert np.allclose(group_advantages(rewards, 4, "none"), (t - t.mean(1, keepdim=True)).view(-1).numpy())
    batch = (t - t.mean(1, keepdim=True)).view(-1) / (torch.tensor(rewards).std() + 1e-4)
    assert np.allclose(group_advantages(rewards, 4, "batch"), batch.numpy())
    assert np.all(group_advantages(rewards, 4, "group")[4:] == 0)  # a group all alike teaches nothing


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo", "bnpo", "cispo"])
def test_the_loss_is_the_policy_gradient_and_kl_trl_writes(kind) -> None:
    torch.manual_seed(0)
    rows = torch.tensor([0, 0, 0, 1, 2, 2])  # three completions of 3, 1 and 2 tokens
    base = torch.randn(6)
    ref = base + 0.3 * torch.randn(6)
    adv = torch.tensor([1.5, -0.5, -1.0])
    loss = GrpoLoss(beta=0.04, kind=kind, max_tokens=4, epsilon_high=5.0 if kind == "cispo" else 0.2)
    logps = base.clone().requires_grad_(True)
    total, count, figures = grpo_losses(logps, rows, adv, loss, 3, ref)
    kl = figures[0]
    (total / count).backward()
    # TRL's per-token loss: -exp(lp - sg(lp)) A + beta (exp(ref - lp) - (ref - lp) - 1), reduced by loss_type; cispo's
    # -sg(min(r, epsilon_high)) A lp, r = 1 here: the same gradient, another value
    lp = base.clone().requires_grad_(True)
    d = ref - lp
    surrogate = -lp * adv[rows] if kind == "cispo" else -torch.exp(lp - lp.detach()) * adv[rows]
    per_token = surrogate + 0.04 * (torch.exp(d) - d - 1)
    mask = torch.zeros(3, 3)
    mask[rows, torch.tensor([0, 1, 2, 0, 0, 1])] = 1
    grid = torch.zeros(3, 3).index_put((rows, torch.tensor([0, 1, 2, 0, 0, 1])), per_token)
    want = {"dapo": grid.sum() / mask.sum(), "grpo": ((grid.sum(1) / mask.sum(1)).mean()),
            "dr_grpo": grid.sum() / (3 * 4), "bnpo": grid.sum() / mask.sum(),
            "cispo": grid.sum() / mask.sum()}[kind]  # fmt: skip
    want.backward()
    assert abs(float(total / count) - float(want)) < 1e-6
    assert torch.allclose(logps.grad, lp.grad, atol=1e-6)
    assert abs(float(kl) - float((torch.exp(ref - base) - (ref - base) - 1).sum())) < 1e-5
    assert count == {"dapo": 6, "cispo": 6, "bnpo": 1}.get(kind, 3)  # (bnpo: this rank's mean already)


@pytest.mark.parametrize("kind", ["dapo", "grpo", "delta"])  # delta: dapo's with TRL's two-sided clipping
def test_a_later_update_clips_the_policy_ratio_as_trl_does(kind) -> None:
    """`iterations` > 1: against the sampling policy's log-probabilities, TRL's clipped surrogate, DAPO's clip-higher
    above; the tokens the clip held counted by side. `delta` (INTELLECT-2's two-sided clip): the unclipped ratio
    bounded too, so that a negative advantage's runaway ratio stops there."""
    torch.manual_seed(1)
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    base, old = torch.randn(6), torch.randn(6)  # ratios from ~0.1 to ~10: some inside, some clipped each way
    adv = torch.tensor([1.5, -0.5, -1.0])
    delta = 2.0 if kind == "delta" else None
    loss = GrpoLoss(kind="dapo" if kind == "delta" else kind, epsilon=0.2, epsilon_high=0.28, delta=delta)
    logps = base.clone().requires_grad_(True)
    total, count, figures = grpo_losses(logps, rows, adv, loss, 3, None, old)
    (total / count).backward()
    lp = base.clone().requires_grad_(True)
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    if delta is not None:  # TRL's: coef_1 = clamp(coef_1, max=delta) before the min
        assert bool(((coef_1 > delta) & (adv[rows] < 0)).any())  # (a token it bounds)
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv[rows], coef_2 * adv[rows])  # TRL's
    grid = torch.zeros(3, 3).index_put((rows, torch.tensor([0, 1, 2, 0, 0, 1])), per_token)
    counts = torch.tensor([3.0, 1.0, 2.0])
    want = (grid.sum(1) / counts).mean() if kind == "grpo" else grid.sum() / 6
    want.backward()
    assert abs(float(total.detach() / count) - float(want)) < 1e-6
    assert torch.allclose(logps.grad, lp.grad, atol=1e-6)
    low = int(((coef_1 < 0.8) & (adv[rows] < 0)).sum())
    high = int(((coef_1 > 1.28) & (adv[rows] > 0)).sum())
    assert figures[1:].tolist() == [low, high] and low + high > 0
    assert (lp.grad == 0).any()  # a clipped token: no gradient
    if kind == "delta":  # the same ratios unbounded: another loss
        unbounded, _, _ = grpo_losses(base.clone(), rows, adv, GrpoLoss(epsilon=0.2, epsilon_high=0.28), 3, None, old)
        assert abs(float(unbounded) - float(total)) > 1e-3


def test_cispo_bounds_the_importance_weight_and_keeps_every_tokens_gradient() -> None:
    """loss cispo (MiniMax-M1's CISPO; TRL's loss_type cispo) on a later update: -sg(min(r, epsilon_high)) A log pi,
    averaged over the tokens, value and gradient as TRL's; no token's gradient is clipped to 0 (grpo's clip would
    zero some); the tokens whose weight the bound held with a positive advantage are counted (TRL's
    cispo_clip_ratio). The spec takes it for objective grpo with epsilon_high at least 1."""
    from pylon.errors import SpecError

    torch.manual_seed(1)
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    base, old = torch.randn(6), torch.randn(6)
    adv = torch.tensor([1.5, -0.5, -1.0])
    loss = GrpoLoss(kind="cispo", epsilon_high=2.0)
    logps = base.clone().requires_grad_(True)
    total, count, figures = grpo_losses(logps, rows, adv, loss, 3, None, old)
    (total / count).backward()
    lp = base.clone().requires_grad_(True)
    coef_1 = torch.exp(lp - old)
    want = (-torch.clamp(coef_1, max=2.0).detach() * adv[rows] * lp).sum() / 6  # TRL's, normalised as dapo
    want.backward()
    assert count == 6 and abs(float(total.detach() / count) - float(want)) < 1e-6
    assert torch.allclose(logps.grad, lp.grad, atol=1e-6) and (lp.grad != 0).all()
    high = int(((coef_1 > 2.0) & (adv[rows] > 0)).sum())
    assert figures[1:].tolist() == [0, high] and high > 0
    spec = _spec(loss="cispo", epsilon_high=5.0, iterations=2)
    assert GrpoLoss.of(spec).kind == "cispo" and GrpoLoss.of(spec).epsilon_high == 5.0
    base_spec = spec.model_dump(mode="json")
    for grpo, field, message in [
        ({"epsilon_high": None}, "grpo.epsilon_high", "bounds loss cispo's importance weight itself"),
        ({"epsilon_high": 0.28}, "grpo.epsilon_high", "at least 1"),
        ({"delta": 4.0}, "grpo.delta", "loss cispo has none"),
        ({"loss": "dapo", "delta": 1.0}, "grpo.delta", "greater than 1"),
    ]:
        with pytest.raises((SpecError, ValueError), match=f"(?s){re.escape(field)}.*{message}"):
            TrainJobSpec.model_validate({**base_spec, "grpo": {**base_spec["grpo"], **grpo}})
    assert _spec(delta=4.0, epsilon_high=0.28).grpo.delta == 4.0


def test_a_sequence_level_ratio_is_gspos_as_trl_writes_it() -> None:
    """`importance_sampling_level: sequence` (GSPO): each completion's tokens share one ratio, exp of the mean of their
    log-ratios, clipped once; value and gradient as TRL's, and the spec refuses it for rloo."""
    torch.manual_seed(2)
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    base, old = torch.randn(6) * 0.3, torch.randn(6) * 0.3
    adv = torch.tensor([1.5, -0.5, -1.0])
    loss = GrpoLoss(kind="grpo", epsilon=0.2, epsilon_high=0.28, sequence_ratio=True)
    logps = base.clone().requires_grad_(True)
    total, count, figures = grpo_losses(logps, rows, adv, loss, 3, None, old)
    (total / count).backward()
    lp = base.clone().requires_grad_(True)
    mask = torch.zeros(3, 3)
    cols = torch.tensor([0, 1, 2, 0, 0, 1])
    mask[rows, cols] = 1.0
    grid = torch.zeros(3, 3).index_put((rows, cols), lp - old)  # TRL's (batch, tokens) layout
    log_w = ((grid * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    want = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()  # loss_type grpo
    want.backward()
    assert abs(float(total.detach() / count) - float(want)) < 1e-6
    assert torch.allclose(logps.grad, lp.grad, atol=1e-6)
    assert GrpoLoss.of(_spec(importance_sampling_level="sequence")).sequence_ratio
    with pytest.raises(Exception, match="grpo.importance_sampling_level: is objective grpo's"):
        TrainJobSpec.model_validate(
            {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
             "objective": "rloo", "grpo": {"rewards": [{"function": "contains_answer"}],
                                           "importance_sampling_level": "sequence"}}
        )  # fmt: skip


def test_online_dpo_prefers_the_better_rewarded_completion_with_dpos_loss_as_trl_writes_it() -> None:
    """objective online_dpo: each prompt's two completions a pair, the larger reward chosen (the first on a tie), and
    TRL's sigmoid loss on the pair's implicit rewards beta (log pi - log ref), value and gradient; the spec asks for
    two generations and takes dpo_beta."""
    from pylon.jobs.grpo import online_dpo_losses, pair_preferences

    assert pair_preferences(np.array([0.2, 0.9, 1.0, 1.0, 3.0, -1.0])).tolist() == [-1, 1, 0, 0, 1, -1]
    torch.manual_seed(3)
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    base, ref = torch.randn(7), torch.randn(7)
    prefs = torch.tensor([-1.0, 1.0, 1.0, -1.0])  # pair 0: completion 1 chosen; pair 1: completion 2 chosen
    tied = online_dpo_losses(base, rows, torch.tensor([0.0, 0.0, 1.0, -1.0]), ref, GrpoLoss(beta=0.3), 4)
    assert tied[1] == 1  # (a tied pair prefers nothing: left out)
    loss = GrpoLoss(kind="online_dpo", beta=0.3, generations=2)
    logps = base.clone().requires_grad_(True)
    total, count, figures = online_dpo_losses(logps, rows, prefs, ref, loss, 4)
    (total / count).backward()
    lp = base.clone().requires_grad_(True)
    seq = torch.zeros(4).index_add(0, rows, lp)
    ref_seq = torch.zeros(4).index_add(0, rows, ref)
    chosen, rejected = torch.tensor([1, 2]), torch.tensor([0, 3])
    logits = (seq[chosen] - seq[rejected]) - (ref_seq[chosen] - ref_seq[rejected])  # TRL's
    want = -torch.nn.functional.logsigmoid(0.3 * logits)
    want.mean().backward()
    assert count == 2 and abs(float(total.detach()) / 2 - float(want.mean())) < 1e-6
    assert torch.allclose(logps.grad, lp.grad, atol=1e-6)
    assert figures[1] == float((logits > 0).sum()) and abs(float(figures[2]) - float(0.3 * logits.sum())) < 1e-5
    spec = _spec(generations=2).model_copy(update={"objective": "online_dpo", "dpo_beta": 0.2})
    assert GrpoLoss.of(spec).online_dpo and GrpoLoss.of(spec).beta == 0.2 and GrpoLoss.of(spec).needs_reference
    with pytest.raises(Exception, match="grpo.generations: must be 2: objective online_dpo samples a pair a prompt"):
        TrainJobSpec.model_validate(
            {"name": "o", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
             "objective": "online_dpo", "grpo": {"rewards": [{"function": "contains_answer"}]}}
        )  # fmt: skip


def test_token_logprobs_count_the_completion_tokens_only(tmp_path) -> None:
    model = _model()
    prompts = [np.array([72, 105]), np.array([65, 66, 67])]
    completions = [np.array([1, 2, EOS]), np.array([3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    inputs = completion_batch(prompts, completions, PAD, "cpu")
    assert inputs["input_ids"][1].tolist()[:3] == [72, 105, 3] and inputs["attention_mask"][1].sum() == 3
    with torch.no_grad():
        lp, rows = token_logprobs(model, inputs, chunked=False)
        assert rows.tolist() == [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]
        seq = torch.tensor([[65, 66, 67, 6, 7, 8, 9]])  # the last completion alone
        alone = torch.log_softmax(model(input_ids=seq).logits[0, 2:-1], -1).gather(1, seq[0, 3:, None])[:, 0]
    assert torch.allclose(lp[-4:], alone, atol=1e-5)


def test_reward_functions_built_in_imported_and_refused_by_name(tmp_path, monkeypatch) -> None:
    from pylon.specs import RewardFunctionSpec

    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def shorter(completions, **kw):
                return [-len(c) for c in completions]

            def none_for_empty(completions, answers, **kw):
                return [None if not a else 1.0 for a in answers]

            def wrong_count(completions, **kw):
                return [1.0]

            def raises(completions, **kw):
                raise KeyError("solution")

            def nan(completions, **kw):
                return [float("nan")] * len(completions)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def rewards(*names, weights=None):
        return Rewards([RewardFunctionSpec(function=n, weight=w) for n, w in zip(names, weights or [1.0] * len(names))])

    r = rewards("exact_match", "contains_answer", "last_number_match", "my_rewards:shorter", weights=[1, 1, 1, 0.5])
    completions, answers = [" 4 ", "it is 4.0", "x", "1,204 apples"], ["4", "4", "", "1204"]
    scores = r.scores(["p"] * 4, completions, answers, [[1]] * 4)
    assert scores[:, 0].tolist() == [1, 0, 0, 0] and scores[:, 1].tolist() == [1, 1, 0, 0]
    assert scores[:3, 2].tolist()[:2] == [1, 1] and np.isnan(scores[2, 2]) and scores[3, 2] == 1
    assert r.total(scores).tolist() == [3 - 1.5, 2 - 4.5, -0.5, 1 - 6]  # a missing score counts 0
    assert r.names == ["exact_match", "contains_answer", "last_number_match", "shorter"]
    assert np.isnan(rewards("my_rewards:none_for_empty").scores(["p"], ["c"], [""], [[1]])[0, 0])
    for name, message in [
        ("my_rewards:wrong_count", r"grpo.rewards\[0\].function \(my_rewards:wrong_count\) returned 1 scores for 2"),
        ("my_rewards:raises", r"grpo.rewards\[0\].function \(my_rewards:raises\) raised KeyError"),
        ("my_rewards:nan", "a score is a finite number or None"),
    ]:
        with pytest.raises(PylonError, match=message):
            rewards(name).scores(["p", "q"], ["c", "d"], ["a", "b"], [[1], [2]])
    with pytest.raises(PylonError, match=r"grpo.rewards\[0\].function: cannot import no_such_module"):
        rewards("no_such_module:f")
    with pytest.raises(PylonError, match="my_rewards has no function missing"):
        rewards("my_rewards:missing")


def test_a_reward_model_export_scores_completions_as_transformers_does(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pylon.specs import RewardFunctionSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from harmony_models import bpe_tokenizer

    export = tmp_path / "rm-export"
    hf = bpe_tokenizer(["<s>", "</s>", "<pad>"], None, eos_token="</s>", bos_token="<s>", pad_token="<pad>")
    config = _reward_model_export(export, hf)
    r = Rewards([RewardFunctionSpec(model=str(export), weight=2.0)])
    assert r.names == ["rm-export"] and r.fields == [f"grpo.rewards[0].model ({export})"]
    prompts, completions = ["Q: the sky? ", "Say hello. "], ["Blue, mostly.", "Hello there, friend!"]
    scores = r.scores(prompts, completions, ["", ""], [[1], [2]])
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # each alone, unpadded: transformers reads its last token
        with torch.no_grad():
            want = model(**tok(p + c, return_tensors="pt")).logits[0, 0].item()
        assert abs(scores[i, 0] - want) < 1e-5, (scores[i, 0], want)
    assert np.allclose(r.total(scores), 2 * scores[:, 0])
    causal = tmp_path / "causal"
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(causal)
    with pytest.raises(PylonError, match=r"grpo.rewards\[0\].model: .*causal is not a reward model"):
        Rewards([RewardFunctionSpec(model=str(causal))])
    with pytest.raises(PylonError, match=r"grpo.rewards\[0\].model: .*nowhere is not a model directory"):
        Rewards([RewardFunctionSpec(model=str(tmp_path / "nowhere"))])
    with pytest.raises(ValueError, match="give a reward function or a reward model"):
        RewardFunctionSpec(function="exact_match", model=str(export))


def test_prompts_given_as_messages_reach_the_rewards_as_trl_passes_them(tmp_path, monkeypatch) -> None:
    """A prompt given as messages reaches every reward function as those messages, its completions as
    `[{"role": "assistant", "content": text}]` (TRL's conversational format); a text prompt as its text, its
    completions as text; the built-in functions read both. A reward model scores the conversation with the
    completion as the assistant's reply, rendered by its own chat template (TRL's), and one without a template is
    refused before workers start when the dataset has such prompts."""
    from test_chat_data import CHATML, _tokenizer
    from transformers import AutoModelForSequenceClassification

    from pylon.data.reader import RecordReader
    from pylon.data.shards import read_manifest
    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.grpo import check_rewards
    from pylon.specs import RewardFunctionSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from harmony_models import bpe_tokenizer

    (tmp_path / "seen_rewards.py").write_text(
        textwrap.dedent(
            """
            SEEN = []

            def seen(prompts, completions, level, **kw):
                SEEN.append((prompts, completions, level))
                return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    chat = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "And of Norway?"}]
    records = [{"prompt": "What is the capital of France? ", "answer": "Paris"},
               {"prompt": chat, "answer": "Oslo", "level": 2}]  # fmt: skip
    out = str(tmp_path / "prompts")
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", records)], out, seq_len=64, tokenizer=tokenizer, prompts=True,
                       progress=False)  # fmt: skip
    assert manifest.prompt_format == "mixed" and manifest.record_fields == ["level"]
    _, tokens, num_tokens, ids = read_rows(out)
    batch = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id, RecordReader(out, manifest).rows(ids))
    pairs = sorted(prompts_and_answers(batch, tok.eos_id), key=lambda pair: tok.decode(pair[1]))  # Oslo, Paris
    texts = ["Oslo, of course.", "I think Paris"]
    completions = [np.asarray([*tok.encode(t), tok.eos_id]) for t in texts]  # one a prompt
    specs = [RewardFunctionSpec(function="seen_rewards:seen"), RewardFunctionSpec(function="contains_answer")]
    scores = Rewards(specs, manifest.record_fields).score_completions(pairs, completions, tok, tok.eos_id)
    import seen_rewards

    ((prompts, given, level),) = seen_rewards.SEEN
    rendered = tok.decode(tok.encode("What is the capital of France? ", special=True))
    assert prompts == [chat, rendered] and level == [2, None]
    assert given == [[{"role": "assistant", "content": texts[0]}], texts[1]]
    assert scores.tolist() == [[len(texts[0]), 1.0], [len(texts[1]), 1.0]]
    assert [exact_match([[{"role": "assistant", "content": " 4 "}], "5"], ["4", "4"])] == [[1.0, 0.0]]

    export = tmp_path / "rm"  # a reward model whose tokenizer renders chats with its own template
    hf = bpe_tokenizer(["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"], CHATML, eos_token="<|im_end|>",
                       bos_token="<s>", pad_token="<pad>")  # fmt: skip
    config = _reward_model_export(export, hf)
    rm = Rewards([RewardFunctionSpec(model=str(export))])
    got = rm.scores(prompts, given, ["", ""], [[1], [2]])[:, 0]
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    conversation = hf.apply_chat_template([*chat, {"role": "assistant", "content": texts[0]}], tokenize=False)
    for i, text in enumerate([conversation, rendered + texts[1]]):  # each alone: transformers reads its last token
        with torch.no_grad():
            special = i == 1  # (text as /classify tokenizes it; a chat as rendered, its specials written in it)
            want = model(**hf(text, return_tensors="pt", add_special_tokens=special)).logits[0, 0].item()
        assert abs(got[i] - want) < 1e-5, (i, got[i], want)
    spec = _spec().model_copy(update={"data": _spec().data.model_copy(update={"uri": out})})
    spec.grpo.rewards.append(RewardFunctionSpec(model=str(export)))
    check_rewards(spec, read_manifest(out))  # (a template: taken)
    plain = tmp_path / "plain-rm"
    hf.chat_template = None
    hf.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(plain)
    spec.grpo.rewards[-1] = RewardFunctionSpec(model=str(plain))
    with pytest.raises(PylonError, match=r"grpo.rewards\[1\].model \(.*plain-rm\): its tokenizer has no chat "
                                         r"template, and data.uri .* holds prompts given as messages"):  # fmt: skip
        check_rewards(spec, read_manifest(out))
    text_only = str(tmp_path / "text-prompts")
    prepare([_jsonl(tmp_path / "t.jsonl", records[:1])], text_only, seq_len=64, tokenizer=tokenizer, prompts=True,
            progress=False)  # fmt: skip
    assert read_manifest(text_only).prompt_format == "text"
    check_rewards(spec.model_copy(update={"data": spec.data.model_copy(update={"uri": text_only})}),
                  read_manifest(text_only))  # fmt: skip


def test_the_spec_refuses_what_grpo_cannot_run_with() -> None:
    from pylon.errors import SpecError

    spec = _spec(generations=4, beta=0.04)
    assert spec.grpo.generations == 4 and GrpoLoss.of(spec).needs_reference
    base = spec.model_dump(mode="json")
    for change, field in [
        ({"grpo": None}, "grpo"),
        ({"objective": "causal_lm"}, "grpo"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
        ({"grpo": {"rewards": [{"function": "not a path"}]}}, "grpo.rewards.0.function"),
        ({"grpo": {"rewards": []}}, "grpo.rewards"),
        ({"grpo": {"rewards": [{"function": "exact_match"}], "generations": 1}}, "grpo.generations"),
        ({"grpo": {"rewards": [{"function": "exact_match"}], "iterations": 3}}, "steps"),
        (
            {"grpo": {"rewards": [{"function": "exact_match"}], "iterations": 2}, "checkpoint": {"every_steps": 3}},
            "checkpoint.every_steps",
        ),
    ]:
        with pytest.raises((SpecError, ValueError), match=field.replace(".", r"\.")):
            TrainJobSpec.model_validate({**base, **change})


def test_reward_functions_take_the_records_other_fields_by_name(tmp_path, monkeypatch) -> None:
    """A prompts dataset's record fields reach every function by name, one value per completion (each prompt's G
    copies consecutive, None where its record lacks the field), as TRL passes a dataset's columns; a field named as
    an argument already passed is refused before workers start; a function that takes no such argument is told."""
    from pylon.data.reader import RecordReader
    from pylon.data.shards import read_manifest
    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.grpo import check_rewards
    from pylon.jobs.train import check_objective
    from pylon.specs import RewardFunctionSpec

    (tmp_path / "field_rewards.py").write_text(
        textwrap.dedent(
            """
            def by_level(completions, level, tag, **kw):
                return [None if lv is None else float(lv) + (0.5 if t == "x" else 0.0) for lv, t in zip(level, tag)]

            def strict(prompts, completions, answers, completion_ids):
                return [0.0] * len(completions)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"prompt": f"P{i}: " + "z" * (5 - i), "answer": "a", "level": i, "tag": "x" if i % 2 else "y"}
               for i in range(5)] + [{"prompt": "P9: ", "answer": "a"}]  # fmt: skip
    out = str(tmp_path / "prompts")
    manifest = prepare([_jsonl(tmp_path / "p.jsonl", records)], out, seq_len=32, prompts=True, progress=False)
    _, tokens, num_tokens, ids = read_rows(out)
    batch = Batch(ids, tokens, num_tokens, 0.0, True, EOS, RecordReader(out, manifest).rows(ids))
    pairs = prompts_and_answers(batch, EOS)
    specs = [RewardFunctionSpec(function="field_rewards:by_level"), RewardFunctionSpec(function="exact_match")]
    rewards = Rewards(specs, manifest.record_fields)
    g = 3
    completions = [np.array([ord("a"), EOS]) for _ in range(len(pairs) * g)]
    scores = rewards.score_completions(pairs, completions, load_tokenizer("byte"), EOS)
    for k, (prompt, _, _) in enumerate(pairs):
        i = int(bytes(prompt.tolist()).decode()[1])
        want = np.nan if i == 9 else i + (0.5 if i % 2 else 0.0)
        np.testing.assert_array_equal(scores[k * g : (k + 1) * g, 0], [want] * g)
        assert scores[k * g : (k + 1) * g, 1].tolist() == [1.0] * g
    with pytest.raises(PylonError, match=r"raised TypeError: .*'level'.*; the dataset's record fields \(level, tag\)"
                       r" are passed by name: take them, or \*\*kwargs"):  # fmt: skip
        Rewards([RewardFunctionSpec(function="field_rewards:strict")], manifest.record_fields).score_completions(
            pairs, completions, load_tokenizer("byte"), EOS
        )
    spec = _spec().model_copy(update={"data": _spec().data.model_copy(update={"uri": out})})
    check_objective(spec, manifest)
    clash = str(tmp_path / "clash")
    prepare([_jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "answers": ["a"]}])], clash, seq_len=32, prompts=True,
            progress=False)  # fmt: skip
    with pytest.raises(PylonError, match=r"its records' field 'answers' would be passed to the reward functions"):
        check_rewards(spec, read_manifest(clash))


def test_check_objective_refuses_data_without_prompts(tmp_path) -> None:
    from pylon.data.shards import read_manifest
    from pylon.jobs.train import check_objective

    (tmp_path / "t.txt").write_text("plain text, no prompt in it\n" * 4)
    text = str(tmp_path / "text")
    prepare([str(tmp_path / "t.txt")], text, seq_len=32, progress=False)
    spec = _spec()
    with pytest.raises(PylonError, match=r"objective grpo: data.uri .* holds text.*--prompts"):
        check_objective(spec, read_manifest(text))
    _, pc = _batch(tmp_path)
    check_objective(spec, read_manifest(pc))


@pytest.mark.parametrize(
    "lora, iterations, kind",
    [
        # (make test-all, all of them: full fine-tuning against a frozen copy; LoRA, which make test runs with the
        # engine sampling, test_rollout.py's test_a_model_sampled_by_the_engine_learns_what_its_reward_asks_for)
        pytest.param(False, 1, "dapo", marks=pytest.mark.slow),
        pytest.param(True, 1, "dapo", marks=pytest.mark.slow),
        # (make test-all: the clipped second update; make test checks the clipping against TRL's formula, above)
        pytest.param(False, 2, "dapo", marks=pytest.mark.slow),
        # (make test-all: tests the cispo loss against TRL's formula, value and gradient, above)
        pytest.param(False, 2, "cispo", marks=pytest.mark.slow),
    ],
    ids=["full", "lora", "full-2-updates", "cispo-2-updates"],
)
def test_a_model_learns_what_its_reward_asks_for(tmp_path, distributed, lora, iterations, kind) -> None:  # noqa: F811
    """Through DeepSpeed (ZeRO-2) in this process, as the trainer's loop runs it: prompts whose answer is "a",
    rewarded when a completion contains it. The reward rises; with beta, against a frozen copy (full fine-tuning) or
    the adapters disabled (LoRA); with two updates on each sampled batch, the second's ratios clipped (cispo: its
    importance weights bounded instead)."""

    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.train import _global_mean_loss

    records = [{"prompt": f"Say a{'!' * i}: ", "completion": "a"} for i in range(4)]
    batch, _ = _batch(tmp_path, records)
    spec = TrainJobSpec.model_validate(
        {"name": "g", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
         "objective": "grpo", "grpo": {"rewards": [{"function": "contains_answer"}], "generations": 8,
                                       "max_completion_tokens": 8, "beta": 0.02, "iterations": iterations,
                                       "loss": kind, **({"epsilon_high": 1.1} if kind == "cispo" else {})},
         "optim": {"lr": 2e-2 if lora else 3e-3, "warmup_steps": 0, "schedule": "constant"},
         **({"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]}} if lora
            else {})}
    )  # fmt: skip
    model, engine, reference = deepspeed_start(spec)
    loss = GrpoLoss.of(spec)
    rewards, tok = Rewards(spec.grpo.rewards), load_tokenizer("byte")
    figures = []
    for step in range(40):
        fresh = step % iterations == 0
        if fresh:  # (what `train_loop` does: sample at the first of every `iterations` steps, then train on it)
            rollout = grpo_sample(engine, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD,
                                  seed=sample_seed(0, step, 0, 0))  # fmt: skip
        loss_t, count, _, stats = grpo_train(engine, engine.module, rollout, loss, reference, first=fresh)
        engine.backward(_global_mean_loss(loss_t, count, 1)[0])
        engine.step()
        figures.append(grpo_record(stats, rewards.names))
    if iterations > 1:  # a second update: its ratios against the sampling policy, some clipped; the first's are 1
        assert all(f["grpo_clip_ratio"] == 0 for f in figures[0::2])
        assert any(f["grpo_clip_ratio"] > 0 for f in figures[1::2])  # (cispo's: weights over 1.1, bounded)
        assert [f["grpo_reward"] for f in figures[0::2]] == [f["grpo_reward"] for f in figures[1::2]]
    first = np.mean([f["grpo_reward"] for f in figures[:8]])
    last = np.mean([f["grpo_reward"] for f in figures[-8:]])
    assert figures[0]["grpo_completions"] == 32 and figures[0].get("grpo_kl", 0.0) < 1e-6  # the start is the reference
    assert last > first + 0.3 and last > 0.6, (
        first,
        last,
        [(round(f["grpo_reward"], 2), f["grpo_completion_length"], round(f.get("grpo_kl", 0), 3)) for f in figures],
    )
    assert figures[-1]["grpo_kl"] > 0 and figures[-1]["grpo_rewards.contains_answer"] == figures[-1]["grpo_reward"]
    # a worker whose data ran out a step early joins the step with nothing: no completion, no loss
    empty = Batch(np.zeros(0, dtype=np.int64), batch.tokens[:0], batch.num_tokens[:0], 0.0, True, EOS)
    loss_t, count, tokens, stats, _ = grpo_forward(engine, engine.module, empty, loss, rewards, tok, eos_id=EOS,
                                                   pad_id=PAD, seed=1, reference=reference)  # fmt: skip
    assert (float(loss_t), count, tokens, stats[0]) == (0.0, 0, 0, 0.0)
    engine.backward(_global_mean_loss(loss_t, count, 1)[0])  # (the step still runs, on every rank)
    engine.step()


JUDGES = """
SEEN = []  # each call's pairs

def says_a(prompts, completions):
    SEEN.append(completions)
    return [-1 if ("a" in x) == ("a" in y) else 0 if "a" in x else 1 for x, y in completions]

class SaysA:  # as TRL's pairwise judges: an object with a judge method
    def judge(self, prompts, completions, shuffle_order=True):
        return says_a(prompts, completions)

says_a_judge = SaysA()
"""


def test_a_pairwise_judges_verdicts_prefer_one_of_each_pair_and_bad_ones_are_named(tmp_path, monkeypatch) -> None:
    """grpo.judge (objective online_dpo's, TRL's pairwise judges): a function or an object with a judge method, called
    with one prompt a pair and the pairs' completions as text; 0 prefers the first, 1 the second, -1 or None neither;
    anything else, or a verdict count that is not the pairs', fails naming grpo.judge. The spec takes it for
    online_dpo only, instead of rewards."""
    from pylon.errors import SpecError
    from pylon.jobs.grpo import pair_preferences

    (tmp_path / "pair_judges2.py").write_text(
        JUDGES.replace("SEEN = []", "SEEN = []\nVERDICTS = []")
        + "\ndef fixed(prompts, completions):\n    SEEN.append((prompts, completions))\n    return VERDICTS.pop()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import pair_judges2

    rewards = Rewards([], judge="pair_judges2:fixed")
    assert rewards.judged and rewards.names == ["fixed"] and not Rewards.of(_spec().grpo).judged
    prompts = ["p0", "p0", [{"role": "user", "content": "p1"}], [{"role": "user", "content": "p1"}], "p2", "p2"]
    completions = ["x", "y", [{"role": "assistant", "content": "u"}], [{"role": "assistant", "content": "v"}], "s", "t"]
    pair_judges2.VERDICTS.append([1, np.int64(0), None])
    scores = rewards.scores(prompts, completions, [""] * 6, [[1]] * 6)
    assert pair_judges2.SEEN[-1] == (prompts[::2], [["x", "y"], ["u", "v"], ["s", "t"]])
    np.testing.assert_array_equal(scores[:, 0], [0.0, 1.0, 1.0, 0.0, np.nan, np.nan])
    assert pair_preferences(rewards.total(scores)).tolist() == [-1, 1, 1, -1, 0, 0]  # (the third left out)
    for verdicts, message in [
        ([0, 2, -1], r"grpo.judge \(pair_judges2:fixed\) judged pair 1 2; a verdict is 0 \(the first"),
        ([0, True, 1], "judged pair 1 True"),
        ([0, 1], r"returned 2 verdicts for 3 pairs; return one a pair"),
        (None, r"returned NoneType verdicts for 3 pairs"),
    ]:
        pair_judges2.VERDICTS.append(verdicts)
        with pytest.raises(PylonError, match=message):
            rewards.scores(prompts, completions, [""] * 6, [[1]] * 6)
    assert Rewards([], judge="pair_judges2:says_a_judge").scores(["p", "p"], ["a", "b"], ["", ""], [[1], [2]])[
        :, 0
    ].tolist() == [1.0, 0.0]  # (an object's judge method)
    with pytest.raises(PylonError, match=r"grpo.judge \(pair_judges2:JUDGES\): pair_judges2 has no function"):
        Rewards([], judge="pair_judges2:JUDGES")
    with pytest.raises(PylonError, match=r"grpo.judge \(pair_judges2:SEEN\): pair_judges2:SEEN is neither a"):
        Rewards([], judge="pair_judges2:SEEN")
    base = {"name": "o", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
            "objective": "online_dpo", "grpo": {"judge": "pair_judges2:fixed", "generations": 2}}  # fmt: skip
    assert TrainJobSpec.model_validate(base).grpo.judge == "pair_judges2:fixed"
    both = {**base["grpo"], "rewards": [{"function": "exact_match"}]}
    for change, field, message in [
        ({"objective": "grpo"}, "grpo.judge", "is objective online_dpo's, a judge of pairs; objective grpo"),
        ({"grpo": both}, "grpo.rewards", "prefers by grpo.judge or by rewards: give one"),
        ({"grpo": {"generations": 2}}, "grpo.rewards", "give at least one reward function .*; or grpo.judge"),
        ({"grpo": {"judge": "not a path", "generations": 2}}, "grpo.judge", "is not a `package.module:function` path"),
    ]:
        with pytest.raises((SpecError, ValueError), match=f"(?s){re.escape(field)}.*{message}"):
            TrainJobSpec.model_validate({**base, **change})


# a reward function's pairs, and a pairwise judge's: make test-all (~27 s each on CI; make test keeps online DPO's loss
# against TRL's and the judge's verdicts; GRPO's learning with LoRA through the engine: test_rollout.py)
@pytest.mark.slow
@pytest.mark.parametrize("judge", [False, True])
def test_an_online_dpo_model_learns_what_its_reward_prefers(tmp_path, distributed, judge, monkeypatch) -> None:  # noqa: F811
    """objective online_dpo through DeepSpeed (ZeRO-2), against a frozen copy of the start, as the trainer's loop runs
    it: the pairs' implicit reward accuracy and the completions' reward rise; with a pairwise judge (TRL's judge) in
    the reward's place, the share of completions it prefers."""

    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.train import _global_mean_loss

    (tmp_path / "pair_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"prompt": f"Say a{'!' * i}: ", "completion": "a"} for i in range(4)]
    batch, _ = _batch(tmp_path, records)
    scoring = {"judge": "pair_judges:says_a_judge"} if judge else {"rewards": [{"function": "contains_answer"}]}
    spec = TrainJobSpec.model_validate(
        {"name": "o", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
         "objective": "online_dpo", "dpo_beta": 0.1,
         "grpo": {**scoring, "generations": 2, "max_completion_tokens": 8},
         "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}}
    )  # fmt: skip
    _, engine, reference = deepspeed_start(spec)
    loss = GrpoLoss.of(spec)
    rewards, tok = Rewards.of(spec.grpo), load_tokenizer("byte")
    figures = []
    for step in range(60):
        rollout = grpo_sample(engine, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD,
                              seed=sample_seed(0, step, 0, 0))  # fmt: skip
        loss_t, count, _, stats = grpo_train(engine, engine.module, rollout, loss, reference)
        assert count <= 4  # (one pair a prompt; a tied one left out)
        engine.backward(_global_mean_loss(loss_t, count, 1)[0])
        engine.step()
        figures.append(grpo_record(stats, rewards.names, online_dpo=True, judged=judge))
    assert figures[0]["online_dpo_reward_margin"] == 0.0 and "grpo_clip_ratio" not in figures[0]
    if judge:  # no reward figures (a judge's scores only mark its choice); the share of completions saying "a"
        import pair_judges

        assert len(pair_judges.SEEN) == 60 and all(len(pairs) == 4 for pairs in pair_judges.SEEN)
        assert "grpo_reward" not in figures[0] and "grpo_rewards.says_a_judge" not in figures[0]
        for f, pairs in zip(figures, pair_judges.SEEN):
            f["grpo_reward"] = np.mean([float("a" in c) for pair in pairs for c in pair])
    first = np.mean([f["grpo_reward"] for f in figures[:10]])
    last = np.mean([f["grpo_reward"] for f in figures[-10:]])
    # (the pairs' accuracy where any pair prefers: once every completion says "a", every pair ties)
    accuracy = np.mean([f["online_dpo_reward_accuracy"] for f in figures[20:] if f["grpo_zero_std_groups"] < 1])
    assert last > first + 0.2 and accuracy > 0.5, (first, last, accuracy, [round(f["grpo_reward"], 2) for f in figures])


def test_a_grpo_runs_plot_is_its_reward_and_its_evaluation_line_says_the_greedy_reward() -> None:
    from pylon.jobs.run_dir import eval_line, loss_figure

    records = [{"step": i, "loss": 0.01 * i, "grpo_reward": 0.1 * i} for i in range(1, 5)]
    evals = [{"kind": "eval", "step": 4, "val_loss": 2.0, "val_perplexity": 7.39, "val_tokens": 4, "val_sequences": 2,
              "val_grpo_reward": 0.75, "val_grpo_completions": 2}]  # fmt: skip
    ax = loss_figure(records, title="g", evals=evals).axes[0]
    assert "reward" in ax.get_ylabel() and "reward" in ax.get_title()
    assert list(ax.lines[0].get_ydata()) == [r["grpo_reward"] for r in records]
    assert list(ax.lines[1].get_ydata()) == [0.75]
    assert eval_line(evals[0]).endswith("mean reward 0.7500 over 2 greedy completions")
    plain = loss_figure([{"step": 1, "loss": 3.0}], title="c").axes[0]  # any other run: its loss
    assert list(plain.lines[0].get_ydata()) == [3.0] and "loss" in plain.get_ylabel()


@pytest.mark.parametrize("gather", [True, False])
def test_zero3_sampling_gathers_the_model_once_not_each_layer_for_every_token(distributed, gather) -> None:  # noqa: F811
    """ZeRO-3 with `zero3_gather_for_sampling` (the default): the whole model gathered once for a micro-batch's
    sampling (DeepSpeed's unwrap_model_for_generation, TRL's way), so the per-layer coordinator gathers nothing while
    it decodes; without, each partitioned layer is gathered for every token. The completions are the same either way,
    and training goes on after it (the hooks are back: a forward gathers again and the step runs)."""
    import deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.grpo import sampling_model
    from pylon.models import build_model

    vocab = 4096  # the embeddings and the output layer above DeepSpeed's persistence threshold: partitioned
    spec = TrainJobSpec.model_validate(
        {"name": "z", "model": {"config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
                                           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "max_position_embeddings": 64}},
         "data": {"uri": "/nonexistent"}, "steps": 2, "deepspeed": {"zero_stage": 3}, "objective": "grpo",
         "grpo": {"rewards": [{"function": "exact_match"}], "zero3_gather_for_sampling": gather}}
    )  # fmt: skip
    config = build_deepspeed_config(spec, world_size=1)
    lm = build_model(spec, vocab_size=vocab, eos_id=0, pad_id=1, seed=0, deepspeed_config=config)
    engine, *_ = deepspeed.initialize(model=lm, model_parameters=list(lm.parameters()), config=config)
    loss = replace_loss(GrpoLoss.of(spec), max_tokens=12, generations=2)
    gathers = []
    original = coordinator.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_

    def counted(self, params, forward, quantize=False):
        gathers.extend(p for p in params if p.ds_status == coordinator.ZeroParamStatus.NOT_AVAILABLE)
        return original(self, params, forward, quantize)

    prompts = [np.array([5, 6, 7, 8]), np.array([9, 10])]
    setattr(coordinator.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_",
            counted)  # fmt: skip
    try:
        with sampling_model(engine, loss, synced=False) as (module, _):
            got = sample_completions(module, prompts, loss, eos_id=0, pad_id=1, device="cpu", seed=3)
        sampling = len(gathers)
        inputs = completion_batch(prompts, got, 1, "cpu")
        lp, rows = token_logprobs(engine, inputs, chunked=False)
        assert len(gathers) > sampling  # the hooks are back: the training pass gathers its layers
    finally:
        setattr(coordinator.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_",
                original)  # fmt: skip
    assert sum(len(c) for c in got) > 8  # decoding went on for several tokens
    if gather:
        assert sampling == 0, sampling
    else:
        assert sampling >= 2 * max(len(c) for c in got), sampling  # at least the two large layers, every token
    engine.backward(-(lp * 0.1).sum())
    engine.step()
    # the same completions whichever way: the gathered model is the partitioned one
    with sampling_model(engine, replace_loss(loss, gather=not gather), synced=False) as (module, _):
        again = sample_completions(module, prompts, loss, eos_id=0, pad_id=1, device="cpu", seed=3)
    with sampling_model(engine, loss, synced=False) as (module, _):
        same = sample_completions(module, prompts, loss, eos_id=0, pad_id=1, device="cpu", seed=3)
    assert [c.tolist() for c in again] == [c.tolist() for c in same]


def test_top_k_min_p_and_the_repetition_penalty_shape_sampling_as_transformers_does() -> None:
    """`sampling_probs` against transformers' own logits processors and warpers (temperature, top-k, top-p, min-p, in
    its order) and the repetition penalty against `RepetitionPenaltyLogitsProcessor`; in `sample_completions`, top_k 1
    is greedy, and a penalty reads the prompt's tokens, not its padding."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from pylon.jobs.grpo import _penalize_repeats, sampling_probs

    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 3
    for k, p, m in [(0, 1.0, 0.0), (7, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (9, 0.9, 0.05)]:
        loss = GrpoLoss(temperature=0.7, top_k=k, top_p=p, min_p=m)
        chain = LogitsProcessorList([TemperatureLogitsWarper(0.7)] + ([TopKLogitsWarper(k)] if k else [])
                                    + ([TopPLogitsWarper(p)] if p < 1 else []) + ([MinPLogitsWarper(m)] if m else []))  # fmt: skip
        want = torch.softmax(chain(None, logits.clone()), dim=-1)
        got = sampling_probs(logits, loss)
        torch.testing.assert_close(got / got.sum(-1, keepdim=True), want, atol=1e-6, rtol=1e-5)
        if k:
            assert ((got > 0).sum(-1) <= k).all()
    history = torch.tensor([[3, 3, 5, 39], [0, 1, 2, 3], [7, 7, 7, 7], [10, 20, 30, 0], [1, 1, 1, 1]])
    seen = torch.zeros(5, 40, dtype=torch.bool).scatter_(1, history, True)
    torch.testing.assert_close(
        _penalize_repeats(logits, seen, 1.3), RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    )
    model = _model()
    prompts = [np.frombuffer(b"Say a: ", dtype=np.uint8).astype(np.int64), np.array([65], dtype=np.int64)]

    def draw(loss, **kw):
        return [c.tolist() for c in sample_completions(model, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu",
                                                        seed=3, **kw)]  # fmt: skip

    greedy = draw(GrpoLoss(generations=2, max_tokens=10), greedy=True)
    assert draw(GrpoLoss(generations=2, max_tokens=10, top_k=1)) == greedy
    # an overwhelming penalty with top_k 1: each token is the likeliest not yet in its row (its prompt included)
    for row, completion in zip([p for p in prompts for _ in range(2)], draw(
        GrpoLoss(generations=2, max_tokens=10, top_k=1, repetition_penalty=1e4))):  # fmt: skip
        held = set(row.tolist())
        for token in completion:
            assert token not in held or token == EOS, (row, completion)
            held.add(token)
    # the short prompt's row is left-padded: its padding is no token of its, so the likeliest first token stays its
    # first even when it is the pad id
    first = greedy[2][0]
    padded = sample_completions(model, prompts, GrpoLoss(generations=2, max_tokens=1, top_k=1, repetition_penalty=1e4),
                                eos_id=EOS, pad_id=first, device="cpu", seed=3)  # fmt: skip
    assert first != 65 and padded[2].tolist() == [first]


def test_the_losss_logprobs_are_the_tempered_distributions_chunked_or_not() -> None:
    """TRL's: each token's log-probability under the logits divided by the sampling temperature, through the
    chunked output layer as through the whole."""
    from pylon.jobs.dpo import counted_logprobs
    from pylon.models import build_model

    spec = _spec().model_copy(update={"loss_chunk_tokens": 3})
    chunked = build_model(spec, vocab_size=258, eos_id=EOS, pad_id=PAD, seed=0).eval()
    whole = _model(seed=0)
    inputs = completion_batch([np.array([72, 105])], [np.array([1, 2, EOS]), np.array([3, 4])], PAD, "cpu")
    with torch.no_grad():
        logits = whole(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        want = counted_logprobs(logits / 0.6, inputs["labels"])
        for model, is_chunked in ((whole, False), (chunked, True)):
            got, _ = token_logprobs(model, inputs, is_chunked, temperature=0.6)
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
            plain, _ = token_logprobs(model, inputs, is_chunked)
            assert not torch.allclose(plain, got)


def replace_loss(loss: GrpoLoss, **changes) -> GrpoLoss:
    from dataclasses import replace

    return replace(loss, **changes)


def test_a_chunked_output_layer_gives_the_same_token_logprobs_and_gradients() -> None:
    """`loss_chunk_tokens`: the completions' log-probabilities a chunk at a time (no whole logits), as the whole."""
    from pylon.models import build_model

    spec = _spec().model_copy(update={"loss_chunk_tokens": 3})
    chunked = build_model(spec, vocab_size=258, eos_id=EOS, pad_id=PAD, seed=0)
    whole = _model(seed=0).train()
    prompts = [np.array([72, 105]), np.array([65, 66, 67])]
    completions = [np.array([1, 2, EOS]), np.array([3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    inputs = completion_batch(prompts, completions, PAD, "cpu")
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for model, is_chunked in ((chunked, True), (whole, False)):
        lp, rows = token_logprobs(model, inputs, chunked=is_chunked)
        total, count, _ = grpo_losses(lp, rows, adv, GrpoLoss(kind="grpo"), 4)
        (total / count).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert rows.tolist() == [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]
        if is_chunked:
            first = lp.detach()
        else:
            assert torch.allclose(lp.detach(), first, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


def test_a_prompt_and_its_longest_completion_must_fit_the_models_positions() -> None:
    from pylon.jobs.train import check_completion_room

    config = _model().config  # llama-tiny: 256 positions
    check_completion_room(config, 192, 64)
    with pytest.raises(PylonError, match=r"grpo.max_completion_tokens: 65 .* 257 positions, more than the model's 256"):
        check_completion_room(config, 192, 65)


@pytest.mark.parametrize("mask", [False, True])
def test_truncated_completions_can_be_left_out_of_the_loss(tmp_path, mask) -> None:
    """`mask_truncated_completions`: a completion cut at max_completion_tokens without an eos counts no token in the
    loss (TRL's); its reward still counts in its group's advantages and the figures."""
    from types import SimpleNamespace

    from pylon.data.tokenizer import load_tokenizer
    from pylon.specs import RewardFunctionSpec

    model = _model()
    loss = replace_loss(GrpoLoss.of(_spec(mask_truncated_completions=mask)), generations=4, max_tokens=3)
    engine = SimpleNamespace(device=torch.device("cpu"), module=model)  # (samples as a ZeRO-0-2 engine's module)
    batch, _ = _batch(tmp_path, RECORDS[:2])
    rewards = Rewards([RewardFunctionSpec(function="contains_answer")])
    rollout = grpo_sample(engine, batch, loss, rewards, load_tokenizer("byte"), eos_id=EOS, pad_id=PAD, seed=4)
    labels = rollout.inputs["labels"]
    completions, cut = int(rollout.stats[0]), int(rollout.stats[6])
    assert cut > 0 and completions == 8
    counted_rows = int(((labels[:, 1:] != -100).sum(1) > 0).sum())
    assert counted_rows == (completions - cut if mask else completions)
    lp, rows = token_logprobs(model, rollout.inputs, chunked=False)
    _, count, _ = grpo_losses(lp, rows, rollout.advantages, loss, completions)
    assert count == int((labels[:, 1:] != -100).sum())  # dapo: over the counted tokens only


def test_a_rollout_keeps_its_first_completions_to_log_and_the_run_keeps_them_as_metrics(tmp_path, capsys) -> None:
    """`log_completions` (TRL's completions table): the first completions of a micro-batch, decoded, beside each
    function's score, the reward and the advantage the loss uses; the run's completions.jsonl keeps them, prints one
    at each printed step, and a resume drops those past its step, as metrics.jsonl does."""
    from types import SimpleNamespace

    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.run_dir import COMPLETIONS_FILE, CompletionsLog, read_completions
    from pylon.specs import RewardFunctionSpec

    loss = replace_loss(GrpoLoss.of(_spec(log_completions=6)), generations=4, max_tokens=5)
    assert GrpoLoss.of(_spec()).log_completions == 4  # (the default)
    engine = SimpleNamespace(device=torch.device("cpu"), module=_model())
    batch, _ = _batch(tmp_path, RECORDS[:2])
    rewards = Rewards(
        [RewardFunctionSpec(function="contains_answer"), RewardFunctionSpec(function="last_number_match")]
    )
    tok = load_tokenizer("byte")
    rollout = grpo_sample(engine, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD, seed=4)
    samples = rollout.samples
    pairs = prompts_and_answers(batch, EOS)
    assert len(samples) == 6 and [s["prompt"] for s in samples] == [tok.decode(pairs[0][0])] * 4 + [
        tok.decode(pairs[1][0])] * 2  # fmt: skip
    for i, s in enumerate(samples):
        assert s["answer"] == tok.decode(pairs[i // 4][1]) and s["advantage"] == pytest.approx(
            float(rollout.advantages[i]))  # fmt: skip
        assert s["rewards"]["contains_answer"] == float(s["answer"] in s["completion"])
        want = None if not any(ch.isdigit() for ch in s["answer"]) else s["rewards"]["last_number_match"]
        assert s["rewards"]["last_number_match"] == want and s["reward"] == sum(v or 0 for v in s["rewards"].values())
        assert s["ended"] or s["tokens"] == 5  # (a completion shorter than max_tokens ended with its eos)
    log = CompletionsLog(str(tmp_path), enabled=True, resume_step=0)
    for step in (1, 2, 5):
        log.write_step(step, samples[:2])
    log.flush()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" completion:")[0] for line in out] == ["step 1", "step 2"]  # (step 5 is not printed)
    assert f'"{samples[0]["prompt"]}" -> "' in out[0] and not out[0].startswith("{")
    assert [r["step"] for r in read_completions(str(tmp_path))] == [1, 1, 2, 2, 5, 5]
    CompletionsLog(str(tmp_path), enabled=True, resume_step=2).flush()
    assert [r["step"] for r in read_completions(str(tmp_path))] == [1, 1, 2, 2]
    assert (tmp_path / COMPLETIONS_FILE).exists()
    quiet = replace_loss(loss, log_completions=0)
    assert grpo_sample(engine, batch, quiet, rewards, tok, eos_id=EOS, pad_id=PAD, seed=4).samples == []


def test_a_rollouts_model_flops_count_sampling_and_every_pass_over_prompts_and_completions(tmp_path) -> None:
    """MFU's FLOPs for a GRPO step (in trained tokens, each forward + backward: 3 forward passes): the update over
    prompts and completions, the reference's forward (beta > 0), and on the step that sampled, sampling's forward
    passes (each completion's prompt and its sampled tokens) and the sampling policy's log-probabilities
    (iterations > 1). Not the completion tokens alone, which the step reports as its tokens."""
    from types import SimpleNamespace

    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.grpo import prompts_and_answers
    from pylon.specs import RewardFunctionSpec

    model = _model()
    loss = replace_loss(GrpoLoss.of(_spec()), generations=4, max_tokens=3)
    engine = SimpleNamespace(device=torch.device("cpu"), module=model)
    batch, _ = _batch(tmp_path, RECORDS[:2])
    rewards = Rewards([RewardFunctionSpec(function="contains_answer")])
    rollout = grpo_sample(engine, batch, loss, rewards, load_tokenizer("byte"), eos_id=EOS, pad_id=PAD, seed=4)
    prompt_tokens = sum(len(p) for p, _, _ in prompts_and_answers(batch, EOS))
    assert rollout.sampled_tokens == 4 * prompt_tokens + rollout.tokens
    assert rollout.model_tokens == int(rollout.inputs["attention_mask"].sum()) == rollout.sampled_tokens
    assert rollout.model_tokens > rollout.tokens  # the prompts are computed too
    m, s = rollout.model_tokens, rollout.sampled_tokens
    plain = replace_loss(loss, beta=0.0)
    assert plain.needs_reference is False and loss.needs_reference is (loss.beta > 0)
    assert rollout.trained_token_units(plain, fresh=False) == m
    assert rollout.trained_token_units(plain, fresh=True) == m + s / 3
    with_ref = replace_loss(loss, beta=0.04)
    assert rollout.trained_token_units(with_ref, fresh=True) == pytest.approx(m * 4 / 3 + s / 3)
    again = replace_loss(loss, beta=0.0, iterations=2)
    assert rollout.trained_token_units(again, fresh=True) == pytest.approx(m + (s + m) / 3)
    assert rollout.trained_token_units(again, fresh=False) == m


# ---------------------------------------------------------------------------------------------------------
# objective rloo: REINFORCE leave-one-out (TRL's RLOOTrainer), on the same sampling and rewards
# ---------------------------------------------------------------------------------------------------------


def _rloo_spec(**grpo) -> TrainJobSpec:
    return TrainJobSpec.model_validate(
        {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
         "objective": "rloo", "grpo": {"rewards": [{"function": "contains_answer"}], **grpo}}
    )  # fmt: skip


class _Engine:
    """What `grpo_sample` and `grpo_train` call at ZeRO-0-2 without DeepSpeed: the model, its module and device."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, **kwargs):
        return self.module(**kwargs)


def test_rloo_advantages_are_each_reward_against_its_groups_other_completions() -> None:
    from pylon.jobs.grpo import leave_one_out_advantages

    rewards = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    got = leave_one_out_advantages(rewards, 4, normalize=False)
    want = [r - (rewards[g * 4 : g * 4 + 4].sum() - r) / 3 for g in range(2) for r in rewards[g * 4 : g * 4 + 4]]
    np.testing.assert_allclose(got, want)
    assert got[0] == pytest.approx(-2 / 3) and got[4] == pytest.approx(1.0)  # (TRL's docs: 0 - mean(1, 0, 1))
    np.testing.assert_allclose(got, 4 / 3 * (rewards - np.repeat(rewards.reshape(2, 4).mean(1), 4)))
    normed = leave_one_out_advantages(rewards, 4, normalize=True)
    assert abs(normed.mean()) < 1e-9 and normed.std(ddof=1) == pytest.approx(1.0, abs=1e-3)


def test_rloo_loss_is_one_clipped_ratio_per_completion_of_its_summed_log_probabilities() -> None:
    """On the sampling policy (ratio 1) the loss is -sum(A) and its gradient REINFORCE's: -A on every token's log-
    probability of its completion. Against an older policy, each completion's whole-sequence ratio is clipped."""
    from pylon.jobs.grpo import rloo_losses

    loss = GrpoLoss.of(_rloo_spec(epsilon=0.2))
    logps = torch.tensor([-1.0, -2.0, -0.5, -0.3, -0.2], requires_grad=True)
    rows = torch.tensor([0, 0, 1, 1, 2])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    total, count, figures = rloo_losses(logps, rows, advantages, loss, 3)
    assert count == 3 and total.item() == pytest.approx(-2.5)
    total.backward()
    assert logps.grad.tolist() == pytest.approx([-1.0, -1.0, 0.5, 0.5, -2.0])
    assert figures.tolist() == [0.0, 0.0, 0.0]
    # sums now: -3.0, -0.8, -0.2; the sampling policy's -3.5 (ratio e^0.5: clipped, A > 0), -0.8, -0.1 (e^-0.1: in)
    total, _, figures = rloo_losses(logps.detach(), rows, advantages, loss, 3, torch.tensor([-3.5, -0.8, -0.1]))
    want = -(1.2 * 1.0) + 0.5 * 1.0 - 2.0 * math.exp(-0.1)
    assert total.item() == pytest.approx(want, rel=1e-6)
    assert figures.tolist() == [0.0, 0.0, 1.0]


def test_rloo_samples_with_its_kl_to_the_start_in_the_reward(tmp_path) -> None:
    """With beta > 0, rloo reads the sampling policy's and the reference's log-probabilities as it samples; each
    completion's advantage is the leave-one-out one of its reward less beta x its summed KL, and the figures report
    the KL per token. The loss has no KL term."""
    from pylon.data.tokenizer import load_tokenizer
    from pylon.jobs.grpo import leave_one_out_advantages, token_logprobs
    from pylon.specs import RewardFunctionSpec

    model, start = _model(seed=0), _model(seed=1)  # the reference: another model, so the KL is not 0
    loss = replace_loss(GrpoLoss.of(_rloo_spec(beta=0.5)), generations=4, max_tokens=3)
    assert loss.rloo and loss.sampling_logprobs and loss.needs_reference
    batch, _ = _batch(tmp_path, RECORDS[:2])
    rewards = Rewards([RewardFunctionSpec(function="contains_answer")])
    engine = _Engine(model)
    rollout = grpo_sample(
        engine, batch, loss, rewards, load_tokenizer("byte"), eos_id=EOS, pad_id=PAD, seed=4, reference=start
    )
    n = rollout.completions
    old, rows = token_logprobs(model, rollout.inputs, chunked=False)
    ref, _ = token_logprobs(start, rollout.inputs, chunked=False)
    seq_kl = torch.zeros(n).index_add(0, rows, (old - ref).detach()).double().numpy()
    assert rollout.stats[1] == pytest.approx(rollout.stats[7])  # the figures: the reward alone (one function)
    got = rollout.advantages.numpy()
    # the advantages sum to 0 per group whatever the rewards; the KL's part is the leave-one-out of -beta x seq_kl
    np.testing.assert_allclose(got.reshape(-1, 4).sum(1), 0, atol=1e-5)
    kl_part = leave_one_out_advantages(-0.5 * seq_kl, 4, normalize=False)
    reward_part = got - kl_part
    assert np.abs(kl_part).max() > 1e-3  # the reference differs: the KL moves the advantages
    for group in reward_part.reshape(-1, 4):  # what is left is a leave-one-out of 0/1 rewards: multiples of 1/3
        np.testing.assert_allclose(group * 3 - np.round(group * 3), 0, atol=1e-4)
    assert rollout.kl[0] == pytest.approx(float(seq_kl.sum()), rel=1e-4) and rollout.kl[1] == float(old.numel())
    _, count, _, stats = grpo_train(engine, model, rollout, loss, start)
    assert count == n and stats[7] == pytest.approx(rollout.kl[0]) and stats[8] == rollout.kl[1]


def test_rloo_counts_its_reference_and_sampling_passes_at_sampling() -> None:
    from pylon.jobs.grpo import Rollout

    r = Rollout(inputs={}, advantages=None, completions=8, tokens=20, stats=[], sample_s=0.0,
                sampled_tokens=100, model_tokens=100)  # fmt: skip
    with_kl = GrpoLoss.of(_rloo_spec(beta=0.05))
    assert r.trained_token_units(with_kl, fresh=True) == pytest.approx(100 + (100 + 2 * 100) / 3)
    assert r.trained_token_units(with_kl, fresh=False) == 100  # (iterations > 1: no reference pass again)
    assert r.trained_token_units(GrpoLoss.of(_rloo_spec()), fresh=True) == pytest.approx(100 + 100 / 3)


@pytest.mark.parametrize(
    ("objective", "grpo", "field"),
    [
        ("rloo", {"loss": "grpo"}, "grpo.loss"),
        ("rloo", {"scale_rewards": "none"}, "grpo.scale_rewards"),
        ("grpo", {"normalize_advantages": True}, "grpo.normalize_advantages"),
        ("rloo", {"delta": 4.0}, "grpo.delta"),
        ("rloo", {"loss": "cispo", "epsilon_high": 5.0}, "grpo.loss"),
        ("online_dpo", {"delta": 4.0, "generations": 2}, "grpo.delta"),
        ("online_dpo", {"loss": "bnpo", "generations": 2}, "grpo.loss"),
    ],
)
def test_each_objective_refuses_the_others_settings_by_name(objective, grpo, field) -> None:
    with pytest.raises(ValidationError, match=re.escape(field)):
        TrainJobSpec.model_validate(
            {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
             "objective": objective, "grpo": {"rewards": [{"function": "contains_answer"}], **grpo}}
        )  # fmt: skip
    with pytest.raises(ValidationError, match="objective rloo needs reward functions"):
        TrainJobSpec.model_validate(
            {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
             "objective": "rloo"}
        )  # fmt: skip
