"""Direct preference optimisation (`objective: dpo`, pylon.jobs.dpo) on preference data (`pylon data prepare
--preference`): each pair is two documents in one row, chosen first, the loss counting the completions only; a pair
longer than a row is left out and counted. The DPO loss of packed rows is, pair for pair, TRL's formula computed on
each completion alone (policy with its LoRA adapters, reference with them disabled); it is log 2 while the adapters
are still zero, and only the adapters learn. Without LoRA (full fine-tuning) the reference is a frozen copy of the model
as it started, whole at ZeRO-2 and partitioned at ZeRO-3: log 2 at the start, and unmoved while the model learns. The
spec refuses what DPO cannot run with, naming the field."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.prepare import prepare
from pylon.data.reader import Batch
from pylon.data.shards import DataError
from pylon.data.tokenizer import load_tokenizer
from pylon.jobs.dpo import LOG_2, DpoLoss, RunningMean, dpo_forward, pair_up, sequence_logprobs
from pylon.jobs.train import model_inputs
from pylon.specs import DPO_LOSSES, SMOOTHED_DPO_LOSSES, TrainJobSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harmony_models import bpe_tokenizer  # noqa: E402
from test_chat_data import _jsonl  # noqa: E402
from test_checkpoint import distributed  # noqa: E402, F401 (fixture: a one-process gloo world, for DeepSpeed)
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

PAIRS = [
    {"prompt": "Q: the capital of France?", "chosen": " Paris.", "rejected": " Berlin, I think."},
    {"prompt": "Q: 2 + 2 =", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Say hello.", "chosen": " Hello there!", "rejected": " No."},
    {"prompt": "Q: the colour of the sky?", "chosen": " Blue.", "rejected": " Green, mostly."},
]
BETA = 0.5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return tokenizer_dir(tmp_path_factory.mktemp("tok"))


def tokenizer_dir(directory) -> str:
    """A small BPE tokenizer learnt on `PAIRS`' text (<s> its BOS, </s> its eos), saved in `directory`."""
    text = " ".join(p["prompt"] + p["chosen"] + p["rejected"] for p in PAIRS) * 4
    hf = bpe_tokenizer(["<s>", "</s>"], None, text=text, eos_token="</s>", bos_token="<s>")
    hf.save_pretrained(directory)
    return str(directory)


def _prepared(tmp_path, tokenizer: str, records=PAIRS, seq_len: int = 64):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = str(tmp_path / "pref")
    manifest = prepare([_jsonl(tmp_path / "pref.jsonl", records)], out, seq_len=seq_len, tokenizer=tokenizer,
                       preference=True, progress=False)  # fmt: skip
    return manifest, out


def _rows(out: str, tokenizer: str) -> dict:
    tok = load_tokenizer(tokenizer)
    _, tokens, num_tokens, ids = read_rows(out)
    return Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id, documents=True)


def test_a_preference_pair_is_two_documents_in_one_row_chosen_first(tmp_path, tokenizer) -> None:
    manifest, out = _prepared(tmp_path, tokenizer)
    assert manifest.preference and manifest.loss_mask and manifest.document_starts and manifest.packing == "bfd"
    assert manifest.totals.documents == len(PAIRS) and "preference pairs" in manifest.summary()
    inputs = _rows(out, tokenizer)
    hf = load_tokenizer(tokenizer)._tok
    # Each row's documents (runs of positions from 0) in order, with their counted tokens: pairs, chosen first
    found = []
    for (
        ids,
        positions,
        labels,
    ) in zip(inputs["input_ids"], inputs["position_ids"], inputs["labels"]):
        starts = (positions == 0).nonzero()[:, 0].tolist() + [len(ids)]
        docs = [(ids[a:b].tolist(), labels[a:b]) for a, b in zip(starts, starts[1:]) if (labels[a:b] != -100).any()]
        assert len(docs) % 2 == 0
        found += docs
    want = []
    for p in PAIRS:
        prompt = hf(p["prompt"])["input_ids"]
        for completion in (p["chosen"], p["rejected"]):
            counted = hf(completion, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
            want.append((prompt + counted, counted))
    pairs = {tuple(map(tuple, (found[i][0], found[i + 1][0]))) for i in range(0, len(found), 2)}
    assert pairs == {(tuple(want[i][0]), tuple(want[i + 1][0])) for i in range(0, len(want), 2)}
    for ids, labels in found:  # the loss counts the completion and its eos only
        counted = next(c for w, c in want if w == ids)
        assert labels[labels != -100].tolist() == counted


def test_a_pair_longer_than_a_row_is_left_out_and_bad_records_are_named(tmp_path, tokenizer, caplog) -> None:
    long = {"prompt": "Q: the capital of France?", "chosen": " Paris." * 10, "rejected": " Berlin." * 10}
    manifest, _ = _prepared(tmp_path, tokenizer, [*PAIRS, long], seq_len=48)
    assert manifest.totals.documents == len(PAIRS) and manifest.totals.truncated_documents == 1
    assert "preference pairs longer than seq_len 48" in caplog.text
    with pytest.raises(DataError, match=r"line 2: no 'rejected' field"):
        _prepared(tmp_path / "a", tokenizer, [PAIRS[0], {"prompt": "x", "chosen": "y"}])
    with pytest.raises(DataError, match=r"line 1: chosen is empty"):
        _prepared(tmp_path / "b", tokenizer, [{**PAIRS[0], "chosen": ""}])
    with pytest.raises(DataError, match="packing wrapped"):
        prepare([_jsonl(tmp_path / "c.jsonl", PAIRS)], str(tmp_path / "c"), tokenizer=tokenizer, preference=True,
                packing="wrapped", progress=False)  # fmt: skip


def test_conversational_pairs_count_the_final_reply_only(tmp_path) -> None:
    """TRL's conversational preference formats: an explicit prompt (a list of messages; chosen and rejected the
    assistant's messages after it) and an implicit one (chosen and rejected whole conversations): each rendered by the
    chat template as a chat dataset is, the loss on the completion's reply only (not an earlier reply in the
    prompt), chosen first in the row."""
    from test_chat_data import _tokenizer

    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"},
    ]
    good, bad = {"role": "assistant", "content": "Berlin."}, {"role": "assistant", "content": "Paris."}
    records = [
        {"prompt": history, "chosen": [good], "rejected": [bad]},
        {"chosen": [*history, good], "rejected": [*history, bad]},
    ]
    prepare([_jsonl(tmp_path / "c.jsonl", records)], str(tmp_path / "c"), seq_len=128, tokenizer=tokenizer,
            preference=True, progress=False)  # fmt: skip
    inputs = _rows(str(tmp_path / "c"), tokenizer)
    counted = []
    for positions, labels in zip(inputs["position_ids"], inputs["labels"]):
        starts = (positions == 0).nonzero()[:, 0].tolist() + [len(positions)]
        counted += [labels[a:b][labels[a:b] != -100].tolist() for a, b in zip(starts, starts[1:])]
    counted = [c for c in counted if c]
    hf = tok._tok
    want = []
    for reply in (good, bad):  # TRL's completion: the whole conversation's tokens after the prompt's
        prompt = hf(
            hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        whole = hf(hf.apply_chat_template([*history, reply], tokenize=False), add_special_tokens=False)
        prompt, whole = prompt["input_ids"], whole["input_ids"]
        assert whole[: len(prompt)] == prompt
        want.append(whole[len(prompt) :])
    assert len(counted) == 4 and counted == [*want, *want], (counted, want)  # both formats alike, chosen first
    with pytest.raises(DataError, match="line 1: chosen: the conversation must end with the assistant's reply"):
        prepare([_jsonl(tmp_path / "d.jsonl", [{"prompt": history, "chosen": [], "rejected": [bad]}])],
                str(tmp_path / "d"), tokenizer=tokenizer, preference=True, progress=False)  # fmt: skip


def _model(vocab: int, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def _alone(model, prompt: list[int], completion: list[int], mean: bool = False) -> float:
    """log p(completion | prompt) (`mean`: per token), the pair's one sequence alone through the model."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1 :]
    return float(lp.mean() if mean else lp.sum())


def _trl(kind: str, beta: float, h: float, smoothing: float = 0.0) -> float:
    """TRL's DPOTrainer loss of one pair (loss_type `kind`) from h = (pi_c - ref_c) - (pi_r - ref_r)."""
    return _trl_sum(kind, beta, [(h, 0.0, 0.0, 0.0)], smoothing)


def _trl_sum(kind: str, beta: float, pairs: list, e: float = 0.0, tau: float = 0.05) -> float:
    """TRL's DPOTrainer losses (loss_type `kind`, its formulas written out here) summed over `pairs`, each the
    (pi_c, ref_c, pi_r, ref_r) log-probabilities of one pair; aot and aot_pair sort across them, as TRL sorts a
    batch."""

    def ls(x: float) -> float:  # log sigmoid
        return -math.log1p(math.exp(-x))

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    if kind == "bco_pair":  # each reward against the mean of them all (a fresh running mean: this batch's)
        rewards = [beta * (pc - rc) for pc, rc, _, _ in pairs] + [beta * (pr - rr) for _, _, pr, rr in pairs]
        delta = sum(rewards) / len(rewards)
        return sum(-ls(beta * (pc - rc) - delta) - ls(-(beta * (pr - rr) - delta)) for pc, rc, pr, rr in pairs)
    if kind in ("aot", "aot_pair"):
        if kind == "aot":
            left, right = sorted(pc - pr for pc, _, pr, _ in pairs), sorted(rc - rr for _, rc, _, rr in pairs)
        else:
            left, right = sorted(pc - rc for pc, rc, _, _ in pairs), sorted(pr - rr for _, _, pr, rr in pairs)
        return sum(-ls(beta * d) * (1 - e) - ls(-beta * d) * e for d in (x - y for x, y in zip(left, right)))
    total = 0.0
    for pc, rc, pr, rr in pairs:
        a, b = pc - rc, pr - rr
        h, z = a - b, beta * (a - b)
        if kind == "hinge":
            total += max(0.0, 1 - z)
        elif kind == "ipo":
            total += (h - 1 / (2 * beta)) ** 2
        elif kind == "robust":
            total += (-(1 - e) * ls(z) + e * ls(-z)) / (1 - 2 * e)
        elif kind == "exo_pair":
            eps = e or 1e-3
            total += sig(z) * (ls(z) - math.log(1 - eps)) + sig(-z) * (ls(-z) - math.log(eps))
        elif kind == "nca_pair":
            total += -ls(beta * a) - 0.5 * ls(-beta * a) - 0.5 * ls(-beta * b)
        elif kind == "sppo_hard":
            total += (a - 0.5 / beta) ** 2 + (b + 0.5 / beta) ** 2
        elif kind == "apo_zero":
            total += (1 - sig(beta * a)) + sig(beta * b)
        elif kind == "apo_down":
            total += sig(beta * a) + (1 - sig(z))
        elif kind == "discopop":
            blend = sig(z / tau)
            total += -ls(z) * (1 - blend) + math.exp(-z) * blend
        else:
            total += -ls(z) * (1 - e) - ls(-z) * e
    return total


def test_the_packed_dpo_loss_is_trls_pair_by_pair_and_log_2_at_the_start(tmp_path, tokenizer) -> None:
    _, out = _prepared(tmp_path, tokenizer)
    inputs = _rows(out, tokenizer)
    hf = load_tokenizer(tokenizer)._tok
    model = _model(len(hf), 0)
    # At the start the adapters are zero: the model is its reference, every pair's loss log 2
    loss, pairs, tokens, stats, _ = dpo_forward(model, model, inputs, DpoLoss(BETA), "test", model_inputs)
    assert pairs == len(PAIRS) and abs(loss.item() / pairs - LOG_2) < 1e-6 and stats[:2] == [0.0, 0.0]
    for kind in DPO_LOSSES:  # every loss's value at the start
        start = DpoLoss(BETA, kind)
        got = dpo_forward(model, model, inputs, start, "test", model_inputs, running=RunningMean())[0].item() / pairs
        assert abs(got - start.at_start()) < 1e-5, kind
        assert abs(start.at_start() - _trl_sum(kind, BETA, [(0.0, 0.0, 0.0, 0.0)])) < 1e-9, kind
    assert tokens == int((inputs["labels"][:, 1:] != -100).sum())
    # Adapters off their zeros: the packed loss is TRL's formula on each completion alone
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    loss, pairs, _, stats, _ = dpo_forward(model, model, inputs, DpoLoss(BETA), "test", model_inputs)
    margins = {False: [], True: []}  # each pair's h, from summed and (IPO's) mean token log-probabilities
    means = []  # each pair's (chosen, rejected) mean token log-probabilities under the policy: SimPO's and ORPO's
    logps = {False: [], True: []}  # each pair's (pi_c, ref_c, pi_r, ref_r), summed and (IPO's) mean
    chosen_rewards, correct = 0.0, 0
    for p in PAIRS:
        prompt = hf(p["prompt"])["input_ids"]
        c = hf(p["chosen"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        r = hf(p["rejected"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        for mean in (False, True):
            with torch.no_grad():
                pc, pr = _alone(model, prompt, c, mean), _alone(model, prompt, r, mean)
                with model.disable_adapter():
                    rc, rr = _alone(model, prompt, c, mean), _alone(model, prompt, r, mean)
            margins[mean].append((pc - rc) - (pr - rr))
            logps[mean].append((pc, rc, pr, rr))
            if mean:
                means.append((pc, pr))
            if not mean:
                chosen_rewards += BETA * (pc - rc)
                correct += margins[mean][-1] > 0
    want = sum(_trl("sigmoid", BETA, h) for h in margins[False])
    assert abs(loss.item() - want) < 1e-4 * max(1.0, want), (loss.item(), want)
    assert abs(stats[0] - chosen_rewards) < 1e-4 and stats[2] == correct
    for kind, smoothing in (("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)):  # TRL's other losses, the same way
        got = dpo_forward(model, model, inputs, DpoLoss(BETA, kind, smoothing), "test", model_inputs)[0].item()
        want_other = sum(_trl(kind, BETA, h, smoothing) for h in margins[kind == "ipo"])
        assert abs(got - want_other) < 1e-4 * max(1.0, want_other), (kind, got, want_other)
    for kind in DPO_LOSSES:  # and every other, smoothed where it may be
        e = 0.2 if kind in SMOOTHED_DPO_LOSSES else 0.0
        running = RunningMean()
        got, _, _, stats_k, _ = dpo_forward(
            model, model, inputs, DpoLoss(BETA, kind, e, discopop_tau=0.5), "test", model_inputs, running=running
        )
        want_other = _trl_sum(kind, BETA, logps[kind == "ipo"], e, tau=0.5)
        assert abs(got.item() - want_other) < 1e-4 * max(1.0, abs(want_other)), (kind, got.item(), want_other)
        assert abs(stats_k[0] - chosen_rewards) < 1e-4 or kind == "ipo"  # the rewards reported are DPO's

    # RPO (TRL's rpo_alpha): DPO's loss plus alpha times the chosen completion's mean NLL
    got = dpo_forward(model, model, inputs, DpoLoss(BETA, rpo_alpha=0.5), "test", model_inputs)[0].item()
    want_rpo = want + 0.5 * sum(-c for c, _ in means)
    assert abs(got - want_rpo) < 1e-4 * max(1.0, want_rpo), (got, want_rpo)

    # A list of losses (TRL's loss_type list and loss_weights; MPO's sigmoid, bco_pair and sft): their weighted sum,
    # sft the chosen completion's mean NLL, as rpo_alpha's
    mpo = TrainJobSpec.model_validate(
        {"name": "m", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 1, "objective": "dpo",
         "dpo_beta": BETA, "dpo_loss": ["sigmoid", "bco_pair", "sft"], "dpo_loss_weights": [0.8, 0.2, 1.0]}
    )  # fmt: skip
    mix = DpoLoss.of(mpo)
    assert mix.mix == (("sigmoid", 0.8), ("bco_pair", 0.2)) and mix.rpo_alpha == 1.0 and mix.bco
    got, _, _, stats_m, _ = dpo_forward(model, model, inputs, mix, "test", model_inputs, running=RunningMean())
    want_mix = 0.8 * want + 0.2 * _trl_sum("bco_pair", BETA, logps[False]) + sum(-c for c, _ in means)
    assert abs(got.item() - want_mix) < 1e-4 * max(1.0, want_mix), (got.item(), want_mix)
    assert abs(stats_m[0] - chosen_rewards) < 1e-4
    start = DpoLoss.of(mpo.model_copy(update={"dpo_loss": ["sigmoid", "hinge"], "dpo_loss_weights": [0.5, 2.0]}))
    assert start.at_start() == pytest.approx(0.5 * LOG_2 + 2.0)  # (a mix's loss at the start: its parts' weighted)

    # SimPO and ORPO, TRL's formulas on the policy's mean log-probabilities: no reference pass (the reference given
    # here would fail if called), rewards beta * mean
    def log_odds(m: float) -> float:
        return m - math.log1p(-math.exp(m))

    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x))

    def never(**_):
        raise AssertionError("a reference-free loss ran the reference")

    gamma, e = 0.3, 0.1
    for kind, one in (
        (
            "simpo",
            lambda c, r: -log_sigmoid(BETA * (c - r) - gamma) * (1 - e) - log_sigmoid(gamma - BETA * (c - r)) * e,
        ),
        ("orpo", lambda c, r: -c - BETA * log_sigmoid(log_odds(c) - log_odds(r))),
    ):
        spec = DpoLoss(BETA, kind, e if kind == "simpo" else 0.0, gamma)
        got, pairs, _, stats, _ = dpo_forward(model, model, inputs, spec, "test", model_inputs, never)
        want_other = sum(one(c, r) for c, r in means)
        assert abs(got.item() - want_other) < 1e-4 * max(1.0, want_other), (kind, got.item(), want_other)
        assert abs(stats[0] - sum(BETA * c for c, _ in means)) < 1e-4 and stats[2] == sum(c > r for c, r in means)
        assert spec.objective == kind and not spec.needs_reference
    # Only the adapters learn
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads) and any(g.abs().sum() > 0 for g in grads.values())


def test_a_chunked_output_layer_gives_the_same_preference_losses_and_gradients(tmp_path, tokenizer) -> None:
    import copy

    from pylon.models import with_chunked_loss

    _, out = _prepared(tmp_path, tokenizer)
    inputs = _rows(out, tokenizer)
    model = _model(len(load_tokenizer(tokenizer)._tok), 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    chunked = with_chunked_loss(copy.deepcopy(model), 5)  # 5 tokens at a time: completions span chunks
    for kind in ("sigmoid", "ipo", "simpo", "orpo"):
        got = {}
        for m, is_chunked in ((model, False), (chunked, True)):
            m.zero_grad()
            loss, pairs, tokens, stats, out = dpo_forward(
                m, m, inputs, DpoLoss(BETA, kind, chunked=is_chunked), "test", model_inputs
            )
            loss.backward()
            grads = [p.grad.clone() for n, p in m.named_parameters() if p.requires_grad]
            got[is_chunked] = (loss.item(), pairs, tokens, stats, grads)
            assert hasattr(out, "logits") != is_chunked  # chunked: no logits at all
        (a, pa, ta, sa, ga), (b, pb, tb, sb, gb) = got[False], got[True]
        assert abs(a - b) < 1e-5 * max(1.0, abs(a)) and (pa, ta) == (pb, tb), (kind, a, b)
        assert all(abs(x - y) < 1e-4 for x, y in zip(sa, sb)), (kind, sa, sb)
        assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(ga, gb)), kind


@pytest.mark.parametrize("stage", [2, 3])
def test_full_fine_tuning_measures_against_a_frozen_copy_of_the_start(tmp_path, tokenizer, stage) -> None:
    import deepspeed

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.dpo import frozen_reference
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    manifest, out = _prepared(tmp_path, tokenizer)
    inputs = _rows(out, tokenizer)
    tok = manifest.tokenizer
    spec = TrainJobSpec.model_validate(
        {"name": "d", "model": {"preset": "llama-tiny"}, "data": {"uri": out}, "steps": 2, "objective": "dpo",
         "deepspeed": {"zero_stage": stage}, "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}}
    )  # fmt: skip
    ds_config = build_deepspeed_config(spec, world_size=1)
    built = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "seed": 3}
    model = build_model(spec, deepspeed_config=ds_config, **built)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    reference = frozen_reference(spec, ds_config, **built, device=None, dtype=torch.float32)
    assert isinstance(reference, deepspeed.DeepSpeedEngine) == (stage == 3)  # ZeRO-3: partitioned, an engine
    assert not any(p.requires_grad for p in reference.parameters())
    assert not getattr(reference, "module", reference).training  # eval mode (an engine's is its module's)

    def ref_logits():
        with torch.no_grad():
            return reference(**model_inputs(inputs)).logits.clone()

    before = ref_logits()
    loss, pairs, _, stats, _ = dpo_forward(engine, model, inputs, DpoLoss(BETA), "test", model_inputs, reference)
    assert pairs == len(PAIRS) and abs(loss.item() / pairs - LOG_2) < 1e-6 and stats[:2] == [0.0, 0.0]
    for _ in range(3):  # every weight learns (no adapters here); the reference stays as it started
        engine.backward(loss / pairs)
        engine.step()
        loss, pairs, _, stats, _ = dpo_forward(engine, model, inputs, DpoLoss(BETA), "test", model_inputs, reference)
    assert loss.item() / pairs < 0.9 * LOG_2 and stats[0] > stats[1], (loss.item() / pairs, stats)
    assert torch.equal(ref_logits(), before)


@pytest.mark.parametrize("lora", [False, True])
def test_a_reward_model_scores_each_packed_completion_as_it_scores_it_alone(tmp_path, tokenizer, lora) -> None:
    from pylon.models import build_model, is_classifier
    from pylon.specs import TrainJobSpec

    manifest, out = _prepared(tmp_path, tokenizer)
    inputs = _rows(out, tokenizer)
    tok, hf = manifest.tokenizer, load_tokenizer(tokenizer)._tok
    spec = TrainJobSpec.model_validate(
        {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": out}, "steps": 2, "objective": "reward",
         **({"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}} if lora else {})}
    )  # fmt: skip
    model = build_model(spec, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=1)
    assert is_classifier(model.config) and model.config.num_labels == 1
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trained)  # the new head learns, with LoRA too
    assert not lora or all("lora_" in n or "score" in n for n in trained)
    reward = DpoLoss.of(spec)
    assert (reward.kind, reward.objective, reward.needs_reference) == ("reward", "reward", False)

    def alone(prompt: str, completion: str) -> float:  # the classifier's own reading of the text: its last token
        ids = hf(prompt)["input_ids"] + hf(completion, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 0])

    model.eval()
    loss, pairs, _, stats, _ = dpo_forward(model, model, inputs, reward, "test", model_inputs)
    want = [(alone(p["prompt"], p["chosen"]), alone(p["prompt"], p["rejected"])) for p in PAIRS]
    bt = sum(math.log1p(math.exp(-(c - r))) for c, r in want)  # -log sigmoid(c - r)
    assert pairs == len(PAIRS) and abs(loss.item() - bt) < 1e-4 * max(1.0, bt), (loss.item(), bt)
    assert abs(stats[0] - sum(c for c, _ in want)) < 1e-4 and stats[2] == sum(c > r for c, r in want)
    # TRL's center_rewards_coefficient: each pair's squared reward sum, weighted, on top (the figures unchanged)
    centred, _, _, stats_c, _ = dpo_forward(model, model, inputs, replace(reward, center=0.25), "test", model_inputs)
    squares = sum((c + r) ** 2 for c, r in want)
    assert abs(centred.item() - (bt + 0.25 * squares)) < 1e-4 * max(1.0, bt) and stats_c == stats
    # it learns the preferences: a few steps of Adam on the pairs
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(15):
        loss, pairs, _, stats, _ = dpo_forward(model, model, inputs, reward, "test", model_inputs)
        optimizer.zero_grad()
        (loss / pairs).backward()
        optimizer.step()
    assert loss.item() / pairs < 0.3 and stats[2] == pairs, (loss.item() / pairs, stats)


def test_a_reward_model_reads_a_conversation_where_classify_reads_its_messages(tmp_path, tokenizer) -> None:
    """Conversational pairs are read at the rendered conversation's last token, what `/classify` with `messages`
    (and transformers' classifier on the template's text) reads, even where the template ends a turn with the eos
    (as Llama 3's does); text pairs before the eos prepare appends. A dataset of both is refused for a reward model."""
    from test_chat_data import _tokenizer

    from pylon.errors import PylonError
    from pylon.jobs.train import check_objective
    from pylon.models import build_model, head_outputs
    from pylon.specs import TrainJobSpec

    ends_in_eos = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    chat_tok = _tokenizer(tmp_path / "tok", ends_in_eos)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    records = [
        {"prompt": question, "chosen": [{"role": "assistant", "content": "Paris."}],
         "rejected": [{"role": "assistant", "content": "Oslo, on the fjord."}]},
        {"chosen": [*question, {"role": "assistant", "content": "hello there, friend"}],
         "rejected": [*question, {"role": "assistant", "content": "Paris."}]},
    ]  # fmt: skip
    out = str(tmp_path / "c")
    manifest = prepare([_jsonl(tmp_path / "c.jsonl", records)], out, seq_len=128, tokenizer=chat_tok,
                       preference=True, progress=False)  # fmt: skip
    assert manifest.preference_format == "conversational"
    tok, hf = manifest.tokenizer, load_tokenizer(chat_tok)._tok
    spec = TrainJobSpec.model_validate(
        {"name": "r", "model": {"preset": "llama-tiny"}, "data": {"uri": out}, "steps": 2, "objective": "reward"}
    )
    model = build_model(spec, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=1).eval()
    reward = DpoLoss.of(spec, manifest)
    assert reward.conversations

    def alone(conversation: list[dict]) -> float:  # /classify's reading: the template's text, no special tokens added
        ids = hf(hf.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]
        assert ids[-1] == hf.eos_token_id  # (this template ends with the eos)
        # at the last token, as Pylon's engine reads it (transformers' classifier skips trailing pad ids, and this
        # tokenizer pads with its eos)
        with torch.no_grad(), head_outputs(model) as heads:
            model(input_ids=torch.tensor([ids]), use_cache=False)
        return float(heads[-1][0, -1, 0])

    whole = [r["chosen"] if "prompt" not in r else [*r["prompt"], *r["chosen"]] for r in records]
    whole += [r["rejected"] if "prompt" not in r else [*r["prompt"], *r["rejected"]] for r in records]
    want = [alone(c) for c in whole]
    inputs = _rows(out, chat_tok)
    _, pairs, _, stats, _ = dpo_forward(model, model, inputs, reward, "test", model_inputs)
    assert pairs == 2 and abs(stats[0] - sum(want[:2])) < 1e-4 and abs(stats[1] - sum(want[2:])) < 1e-4, (stats, want)
    before_eos = dpo_forward(model, model, inputs, replace(reward, conversations=False), "test", model_inputs)[3]
    assert abs(before_eos[0] + before_eos[1] - sum(want)) > 1e-3  # the text rule would read another token
    # text pairs are read before the eos prepare appends; a dataset of both formats is refused for a reward model
    mixed = prepare([_jsonl(tmp_path / "m.jsonl", [*records, {"prompt": "Q: 2 + 2 =", "chosen": " 4",
                                                               "rejected": " 5"}])],
                    str(tmp_path / "m"), seq_len=128, tokenizer=chat_tok, preference=True, progress=False)  # fmt: skip
    assert mixed.preference_format == "mixed"
    assert _prepared(tmp_path / "t", tokenizer)[0].preference_format == "text"
    with pytest.raises(PylonError, match="objective reward: data.uri .* both as text and as conversations"):
        check_objective(spec, mixed)
    check_objective(spec.model_copy(update={"objective": "dpo"}), mixed)  # DPO reads log-probabilities: either way


@pytest.mark.parametrize("stage", [2, 3])
def test_a_reward_model_starts_from_a_causal_lm_checkpoint_with_a_new_head(tmp_path, stage) -> None:
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.models import build_model, is_classifier
    from pylon.specs import TrainJobSpec

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0)  # fmt: skip
    sft = LlamaForCausalLM(config)
    sft.save_pretrained(tmp_path / "sft")
    spec = TrainJobSpec.model_validate(
        {"name": "r", "model": {"path": str(tmp_path / "sft")}, "data": {"uri": str(tmp_path)}, "steps": 2,
         "objective": "reward", "deepspeed": {"zero_stage": stage}}
    )  # fmt: skip
    # ZeRO-3: partitioned, the checkpoint streamed in (its lm_head skipped, the head left as initialised)
    model = build_model(
        spec, vocab_size=64, eos_id=1, pad_id=0, deepspeed_config=build_deepspeed_config(spec, world_size=1)
    )
    assert is_classifier(model.config) and model.config.architectures == ["LlamaForSequenceClassification"]
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in sft.state_dict().items():
        if not name.startswith("lm_head"):
            assert torch.equal(weights[name], w), name  # the body is the checkpoint's
    assert weights["score.weight"].shape == (1, 32) and weights["score.weight"].abs().sum() > 0


def test_bco_pairs_running_mean_goes_on_across_micro_batches_and_checkpoints(tmp_path, tokenizer) -> None:
    """bco_pair's delta is the running mean of every micro-batch's mean reward (TRL's RunningMoments): updated by
    each training micro-batch, read as it stands by an evaluation, and carried through a checkpoint's state."""
    _, out = _prepared(tmp_path, tokenizer)
    inputs = _rows(out, tokenizer)
    hf = load_tokenizer(tokenizer)._tok
    model = _model(len(hf), 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    bco = DpoLoss(BETA, "bco_pair")
    running = RunningMean()
    _, pairs, _, stats, _ = dpo_forward(model, model, inputs, bco, "test", model_inputs, running=running)
    first = (stats[0] + stats[1]) / (2 * pairs)  # this micro-batch's mean reward
    assert running.count == 1 and abs(running.mean - first) < 1e-6
    running.update(torch.tensor(first + 1.0))  # another micro-batch's mean: the mean of the two
    assert running.count == 2 and abs(running.mean - (first + 0.5)) < 1e-6
    running.update(None)  # a micro-batch with no pair adds nothing
    assert running.count == 2
    state = running.state_dict()
    resumed = RunningMean()
    resumed.load_state_dict(state)
    a = dpo_forward(model, model, inputs, bco, "test", model_inputs, running=resumed, update=False)[0].item()
    assert resumed.state_dict() == state  # an evaluation reads it, never moves it
    b = dpo_forward(model, model, inputs, bco, "test", model_inputs, running=RunningMean())[0].item()
    assert abs(a - b) > 1e-4  # the delta is the loss's: another mean, another loss
    with pytest.raises(ValueError, match="bco_pair needs its RunningMean"):
        dpo_forward(model, model, inputs, bco, "test", model_inputs)


def test_rows_that_are_not_pairs_are_refused_naming_the_dataset() -> None:
    logits = torch.zeros(1, 6, 5)
    labels = torch.tensor([[-100, 1, 2, -100, 3, 4]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    logprobs, per_row = sequence_logprobs(logits, labels, positions)
    assert per_row.tolist() == [2] and torch.allclose(logprobs, torch.full((2,), 2 * math.log(1 / 5)))
    with pytest.raises(DataError, match="data.uri s3://b/d: a row holds 3 documents"):
        pair_up(torch.zeros(3), torch.tensor([3]), "data.uri s3://b/d")


def test_the_spec_refuses_what_dpo_cannot_run_with() -> None:
    from pylon.errors import SpecError
    from pylon.specs import TrainJobSpec

    base = {"name": "d", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/d"}, "steps": 2,
            "objective": "dpo", "lora": {"target_modules": ["q_proj"]}}  # fmt: skip
    assert TrainJobSpec.model_validate(base).dpo_beta == 0.1
    assert TrainJobSpec.model_validate({**base, "lora": None}).lora is None  # full fine-tuning: a frozen copy
    simpo = TrainJobSpec.model_validate({**base, "objective": "simpo", "simpo_gamma": 1.0, "dpo_label_smoothing": 0.1})
    assert DpoLoss.of(simpo) == DpoLoss(0.1, "simpo", 0.1, 1.0)
    assert DpoLoss.of(TrainJobSpec.model_validate({**base, "objective": "orpo", "lora": None})).kind == "orpo"
    disco = TrainJobSpec.model_validate({**base, "dpo_loss": "discopop", "dpo_discopop_tau": 0.1})
    assert (DpoLoss.of(disco).kind, DpoLoss.of(disco).discopop_tau) == ("discopop", 0.1)
    robust = TrainJobSpec.model_validate({**base, "dpo_loss": "robust", "dpo_label_smoothing": 0.1})
    assert DpoLoss.of(robust).label_smoothing == 0.1
    reward = TrainJobSpec.model_validate({**base, "objective": "reward", "reward_center_coefficient": 0.01})
    assert DpoLoss.of(reward).center == 0.01
    for change, field in (
        ({"attention_mask": "causal"}, "attention_mask"),
        ({"dpo_beta": 0}, "dpo_beta"),
        ({"dpo_loss": "ipo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({"dpo_label_smoothing": 0.5}, "dpo_label_smoothing"),
        ({"dpo_loss": "nca_pair", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({"dpo_loss": "sppo_hard", "dpo_discopop_tau": 0.1}, "dpo_discopop_tau"),
        ({"dpo_loss": "kto"}, "dpo_loss"),
        ({"simpo_gamma": 1.0}, "simpo_gamma"),  # simpo's, not dpo's
        ({"objective": "simpo", "dpo_rpo_alpha": 1.0}, "dpo_rpo_alpha"),
        ({"objective": "orpo", "dpo_loss": "hinge"}, "dpo_loss"),
        ({"objective": "orpo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({"objective": "reward", "loss_chunk_tokens": 16}, "loss_chunk_tokens"),
        ({"objective": "orpo", "attention_mask": "causal"}, "attention_mask"),
        ({"objective": "causal_lm", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({"reward_center_coefficient": 0.01}, "reward_center_coefficient"),  # a reward model's, not dpo's
        # a list of losses (TRL's loss_type list): one preference loss at least, each once, ipo alone, sft or
        # dpo_rpo_alpha, a weight each
        ({"dpo_loss": ["sft"]}, "dpo_loss: a list needs a preference loss"),
        ({"dpo_loss": ["sigmoid", "sigmoid"]}, "dpo_loss: names a loss twice"),
        ({"dpo_loss": ["ipo", "hinge"]}, "dpo_loss: ipo reads mean log-probabilities"),
        ({"dpo_loss": ["sigmoid", "sft"], "dpo_rpo_alpha": 1.0}, "dpo_rpo_alpha: is the same NLL term as sft"),
        ({"dpo_loss": ["sigmoid", "hinge"], "dpo_loss_weights": [1.0]}, "dpo_loss_weights: 1 weights for 2 losses"),
        ({"dpo_loss_weights": [1.0]}, "dpo_loss_weights: weighs dpo_loss given as a list"),
        ({"dpo_loss": ["sigmoid"], "dpo_loss_weights": [-1.0]}, "dpo_loss_weights.0"),
        ({"dpo_loss": ["hinge", "discopop"], "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({"objective": "simpo", "dpo_loss": ["sigmoid", "hinge"]}, "dpo_loss: chooses objective dpo's loss"),
    ):
        with pytest.raises((SpecError, ValueError), match=field):
            TrainJobSpec.model_validate({**base, **change})
    mixed = TrainJobSpec.model_validate({**base, "dpo_loss": ["robust", "hinge"], "dpo_label_smoothing": 0.1})
    assert DpoLoss.of(mixed).mix == (("robust", 1.0), ("hinge", 1.0))  # (weights: 1 each; smoothing for robust)


def test_precomputed_reference_values_are_the_reference_passes_and_a_resume_reads_them(
    tmp_path,
    tokenizer,
    distributed,  # noqa: F811
) -> None:
    """`precompute_reference`: every row's documents' reference values, read a rank's part at a time across shard
    ends (ranks padding to the same passes), are what the reference pass gives those rows in training; the DPO loss
    with them is the loss with the pass; a resumed run reads the committed table, and another dataset's is not
    taken for it."""
    from pylon.data.shards import read_manifest
    from pylon.jobs.dpo import reference_logprobs
    from pylon.jobs.reference_cache import committed, precompute, rank_rows

    out = str(tmp_path / "pref")
    prepare(
        [_jsonl(tmp_path / "pref.jsonl", PAIRS * 3 + PAIRS[:1])],
        out,
        seq_len=64,
        tokenizer=tokenizer,
        preference=True,
        progress=False,
        shard_size_mb=4 * 64 * 4 / 2**20,
    )  # fmt: skip (13 rows: 6 and 7)
    manifest = read_manifest(out)
    assert len(manifest.shards) > 1
    hf = load_tokenizer(tokenizer)._tok
    model, reference = _model(len(hf), 0), _model(len(hf), 1)  # (a reference unlike the model: it must be the one read)
    loss = DpoLoss(BETA)
    padded = []

    def padding():
        padded.append(1)
        return {"input_ids": torch.zeros((1, 64), dtype=torch.long), "attention_mask": torch.ones((1, 64), dtype=torch.long),
                "labels": torch.full((1, 64), -100)}  # fmt: skip

    run = str(tmp_path / "run")
    common = {"rank": 0, "world": 2, "micro_batch_size": 3, "device": torch.device("cpu"), "loss": loss,
              "model_inputs": model_inputs, "padding": padding}  # fmt: skip
    for rank in (1, 0):  # (one process plays both ranks: rank 0 commits once both parts are there)
        table, _, reused = precompute(reference, model, out, manifest, run, **(common | {"rank": rank}))
        assert not reused
    parts = [rank_rows(manifest.totals.rows, r, 2) for r in (0, 1)]
    most = -(-(-(-manifest.totals.rows // 2)) // 3)
    assert len(padded) == sum(most - -(-(hi - lo) // 3) for lo, hi in parts) > 0, (parts, padded)
    inputs = _rows(out, tokenizer)
    _, _, _, ids = read_rows(out)
    want, per_row = reference_logprobs(reference, model, model_inputs(inputs), inputs["labels"], inputs["position_ids"],
                                       loss)  # fmt: skip
    got, got_rows = table.lookup(ids, "cpu")
    assert torch.equal(got_rows, per_row) and torch.allclose(got, want, atol=1e-5)
    with_pass = dpo_forward(model, model, inputs, loss, "test", model_inputs, reference)
    ahead = dpo_forward(model, model, inputs, loss, "test", model_inputs, None, precomputed=(got, got_rows))
    assert abs(with_pass[0].item() - ahead[0].item()) < 1e-4 and with_pass[3] == pytest.approx(ahead[3], abs=1e-4)
    assert committed(run, manifest, loss) and not committed(run, manifest, DpoLoss(BETA, "ipo"))  # (means: others)
    again, _, reused = precompute(None, model, out, manifest, run, **common)  # (a resume: no reference needed)
    assert reused and all(np.array_equal(again.rows[i], table.rows[i]) for i in table.rows)
    other = prepare([_jsonl(tmp_path / "pref.jsonl", PAIRS * 3)], out, seq_len=64, tokenizer=tokenizer, preference=True,
                    progress=False, overwrite=True)  # fmt: skip
    assert other.run_id != manifest.run_id
    _, _, reused = precompute(reference, model, out, other, run, **(common | {"world": 1}))
    assert not reused and not committed(run, manifest, loss)  # (another dataset's run: read again)
