"""objective eagle3 (pylon.jobs.eagle): the head the trainer unrolls drafts as the serving engine's EAGLE-3 drafter
runs the exported head (the same tokens at every depth of every proposal checked); packed documents and later rows
change nothing a row drafts; the loss teaches draft k the model's distribution k + 2 tokens ahead; the draft
vocabulary is the labels' most frequent tokens; the spec refuses what a frozen model cannot take. The run through Ray
Train and DeepSpeed: tests/integration/test_train_eagle.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving" / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from engine_models import GREEDY, PROMPTS, Family, recorded, run, speculating, tokens_of  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint import distributed  # noqa: E402, F401 (fixture: a one-process gloo world, for DeepSpeed)

from pylon.errors import PylonError  # noqa: E402
from pylon.jobs.eagle import build_trainer, draft_vocabulary, eagle3_record, export_head  # noqa: E402
from pylon.specs import Eagle3Spec, TrainJobSpec  # noqa: E402


def _decisive(trainer, seed: int = 7) -> None:
    """The head's weights random at a scale whose argmaxes have comfortable gaps (fp32 rounding never flips one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5 * 1.5)
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def headed(tmp_path_factory):
    """An 8-layer Llama, a trainer's random EAGLE-3 head for it over 96 of its 320 tokens, exported."""
    root = tmp_path_factory.mktemp("eagle3-train")
    family = Family("llama", root / "m", greedy=False, num_hidden_layers=8)
    draft = torch.randperm(320, generator=torch.Generator().manual_seed(1))[:96].sort().values
    spec = SimpleNamespace(eagle3=Eagle3Spec(ttt_steps=4, aux_layers=[1, 4, 6]))
    trainer = build_trainer(family.model, spec, draft, seed=3)
    _decisive(trainer)
    with torch.no_grad():  # g of RMS 1 (the model's hidden states are hundreds): attention and MLP then count
        hidden = family.model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
        g = trainer.head.fc(torch.cat([hidden[j] for j in trainer.aux], dim=-1))
        trainer.head.fc.weight /= g.pow(2).mean().sqrt()
    export_head(trainer.state_dict(), spec, family.model.config, str(root / "head"))
    return family, trainer, root / "head"


def test_the_exported_head_drafts_in_the_engine_what_the_trainer_unrolled(headed) -> None:
    """For each proposal of the engine (its cache caught up over prompts and verified drafts, its own drafts fed
    back), the trainer's unrolled head over the request's tokens and those drafts guesses the same token at every
    depth: the same inputs, positions, keys and values at training time as at serving time."""
    family, trainer, head = headed
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 96
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}
    engine = speculating(family.engine(speculative={"method": "eagle3", "draft_model": str(head), "num_tokens": 3}))
    proposed = recorded(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, GREEDY)
    got = run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        assert tokens_of(got[str(i)]) == family.hf_greedy(prompt, GREEDY.max_tokens), i
    assert len(proposed) > 20
    checked = 0
    for token_ids, drafts in proposed[:: max(1, len(proposed) // 10)]:
        ids = torch.tensor([token_ids + drafts])
        with torch.no_grad():
            logits, *_ = trainer.drafts(ids)
        row = len(token_ids) - 2  # the row of the request's last hidden state and its newest token
        guessed = [int(trainer.head.draft_tokens[logits[k][0, row].argmax()]) for k in range(len(drafts))]
        assert guessed == drafts, token_ids
        checked += len(drafts)
    assert checked >= 20


def test_packed_documents_and_later_tokens_change_nothing_a_row_drafts(headed) -> None:
    """Two documents packed into a row (positions restarting) draft as each does alone; a row's draft k reads nothing
    past the token at i + k + 1."""
    _, trainer, _ = headed
    a, b = PROMPTS[1][:17], PROMPTS[2][:23]
    with torch.no_grad():
        alone_a, *_ = trainer.drafts(torch.tensor([a]))
        alone_b, *_ = trainer.drafts(torch.tensor([b]))
        positions = torch.tensor([list(range(len(a))) + list(range(len(b)))])
        packed, *_ = trainer.drafts(torch.tensor([a + b]), position_ids=positions)
        early, *_ = trainer.drafts(torch.tensor([a[:12]]))
    for k in range(trainer.steps):
        torch.testing.assert_close(packed[k][0, len(a) :], alone_b[k][0], rtol=1e-4, atol=1e-4)
        rows = len(a) - k - 1  # (rows whose chain's tokens lie within a)
        torch.testing.assert_close(packed[k][0, :rows], alone_a[k][0, :rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(early[k][0, : 12 - k - 1], alone_a[k][0, : 12 - k - 1], rtol=1e-4, atol=1e-4)


def test_the_loss_teaches_draft_k_the_model_s_distribution_k_plus_2_tokens_ahead(headed) -> None:
    """The loss of a row is the soft cross-entropy against the model's distribution over the draft vocabulary at
    i + k + 1, weighted decay ** k, over rows whose target token the labels count; accuracy: the head's top token
    against the model's."""
    family, trainer, _ = headed
    ids = torch.tensor([PROMPTS[3][:30]])
    labels = ids.clone()
    labels[0, :9] = -100  # (a prompt: its tokens not taught)
    out = trainer(input_ids=ids, labels=labels)
    with torch.no_grad():
        drafts, *_ = trainer.drafts(ids)
        logits = family.model(ids).logits[0].float()
    want, counted = 0.0, []
    for k in range(trainer.steps):
        rows = [i for i in range(30 - k - 2) if labels[0, i + k + 2] != -100]
        counted.append(len(rows))
        teacher = torch.softmax(logits[[i + k + 1 for i in rows]][:, trainer.head.draft_tokens], dim=-1)
        mine = torch.log_softmax(drafts[k][0, rows].float(), dim=-1)
        want += trainer.decay**k * float(-(teacher * mine).sum())
        right = sum(
            int(trainer.head.draft_tokens[drafts[k][0, i].argmax()]) == int(logits[i + k + 1].argmax()) for i in rows
        )
        assert out["stats"][2 * k : 2 * k + 2] == [right, len(rows)]
    assert out.tokens == counted[0] == 30 - 2 - 7
    assert float(out.loss_sum.detach()) == pytest.approx(want, rel=1e-5)
    out.loss_sum.backward()
    assert all(p.grad is not None for p in trainer.head.parameters())
    assert all(p.grad is None for p in trainer.target.parameters())  # (frozen)
    trainer.zero_grad(set_to_none=True)


def test_the_accuracy_record_and_the_expected_accepted_drafts() -> None:
    record = eagle3_record([8, 10, 3, 6, 0, 0], prefix="val_")
    assert record["val_eagle3_accuracy_0"] == 0.8 and record["val_eagle3_accuracy_1"] == 0.5
    assert record["val_eagle3_accuracy_2"] == 0.0
    assert record["val_eagle3_accept_length"] == pytest.approx(0.8 + 0.8 * 0.5)


class _Rows:
    """A prepared dataset's rows as a stream gives them (`epoch()`: its batches, `manifest`): read from its shards
    here, where no Ray cluster runs (the trainer's workers read through `ShardStream`)."""

    def __init__(self, out: str, batch: int = 2) -> None:
        from pylon.data.reader import Batch

        self.manifest, tokens, num_tokens, ids = read_rows(out)
        eos = self.manifest.tokenizer.eos_id
        self.batches = [
            Batch(ids[i : i + batch], tokens[i : i + batch], num_tokens[i : i + batch], 0.0, False, eos)
            for i in range(0, len(ids), batch)
        ]

    def epoch(self):
        yield from self.batches


def test_the_draft_vocabulary_is_the_labels_most_frequent_tokens(tmp_path, no_cluster) -> None:  # noqa: F811
    from pylon.data.prepare import prepare

    text = tmp_path / "t.txt"
    text.write_text("aaaa bbb cc d " * 40)
    prepare([str(text)], str(tmp_path / "d"), seq_len=32, progress=False, use_ray=False)
    stream = _Rows(str(tmp_path / "d"))
    ids, seen, covered = draft_vocabulary(stream, 3, 320, 10_000)
    assert ids.tolist() == sorted([ord("a"), ord(" "), ord("b")])  # (a: 4, space: 4, b: 3 a line; c, d fewer)
    assert seen >= 500 and covered == pytest.approx(11 / 14, abs=0.02)
    whole, _, share = draft_vocabulary(stream, 400, 320, 10_000)
    assert whole.tolist() == list(range(320)) and share == 1.0
    few, seen_few, _ = draft_vocabulary(stream, 3, 320, 50)
    assert 50 <= seen_few < seen
    with pytest.raises(PylonError, match="token 2.* past the model's vocabulary of 200"):
        draft_vocabulary(stream, 3, 200, 10_000)


def _spec(**extra) -> dict:
    return {"name": "e", "model": {"path": "/tmp/m"}, "data": {"uri": "/tmp/d"}, "steps": 4, "objective": "eagle3",
            **extra}  # fmt: skip


def test_the_spec_refuses_what_a_frozen_model_cannot_take() -> None:
    from pydantic import ValidationError

    assert TrainJobSpec.model_validate(_spec()).eagle3 is None
    assert TrainJobSpec.model_validate(_spec(eagle3={"ttt_steps": 3})).eagle3.ttt_steps == 3
    for extra, field in (
        ({"model": {"preset": "llama-tiny"}}, "model.path"),
        ({"lora": {"target_modules": ["q_proj"]}}, "lora"),
        ({"loss_chunk_tokens": 64}, "loss_chunk_tokens"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"objective": "causal_lm", "eagle3": {}}, "eagle3"),
        ({"eagle3": {"aux_layers": [1, 2]}}, "eagle3.aux_layers"),
        ({"eagle3": {"ttt_steps": 0}}, "eagle3.ttt_steps"),
    ):
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            TrainJobSpec.model_validate(_spec(**extra))


def test_a_head_given_as_the_model_is_refused_saying_how_to_serve_it(headed) -> None:
    _, _, head = headed
    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    with pytest.raises(
        PylonError, match=r"is an EAGLE drafting head \(LlamaForCausalLMEagle3\), not a model: serve the model it "
        r"drafts for as model, with engine\.speculative: \{method: eagle3, draft_model: "
    ):  # fmt: skip
        LLMEngine(str(head), EngineSpec(dtype="fp32", kv_cache_tokens=256, max_model_len=64))


def test_pylon_eval_of_a_head_is_refused_saying_how_to_serve_it(headed, tmp_path, no_cluster) -> None:  # noqa: F811
    from pylon.data.prepare import prepare
    from pylon.sdk.evaluate import evaluate

    _, _, head = headed
    (tmp_path / "t.txt").write_text("some held-out text " * 20)
    prepare([str(tmp_path / "t.txt")], str(tmp_path / "d"), seq_len=32, progress=False, use_ray=False)
    with pytest.raises(PylonError, match=r"is an EAGLE drafting head .* engine\.speculative: \{method: eagle3"):
        evaluate(str(head), data=str(tmp_path / "d"), validation_fraction=0.5)


def test_at_zero_3_the_frozen_model_is_partitioned_and_the_head_trains_saves_and_resumes_as_at_zero_2(
    tmp_path,
    distributed,  # noqa: F811
) -> None:
    """Through DeepSpeed: at ZeRO-3 (the model built partitioned from model.path, its output rows gathered to start the
    head's) the steps' losses are ZeRO-2's; a checkpoint without the frozen parameters holds the head alone, exports
    it whole (zero_to_fp32), and a fresh engine resumed from it (started with another draft vocabulary, as a resumed
    run starts) computes the same loss."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.export import _consolidated_state_dict
    from pylon.models import build_model

    config = AutoConfig.for_model(
        "llama", vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))

    def start(stage: int, seed: int = 1, vocabulary=torch.arange(40, 120)):
        spec = TrainJobSpec.model_validate(
            _spec(model={"path": str(tmp_path / "m")}, deepspeed={"zero_stage": stage}, eagle3={"ttt_steps": 2},
                  optim={"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"})
        )  # fmt: skip
        ds = build_deepspeed_config(spec, world_size=1)
        model = build_model(spec, vocab_size=320, eos_id=256, pad_id=257, deepspeed_config=ds)
        trainer = build_trainer(model, spec, vocabulary, seed=seed)
        engine, *_ = deepspeed.initialize(
            model=trainer, model_parameters=[p for p in trainer.parameters() if p.requires_grad], config=ds
        )
        return trainer, engine

    losses = {}
    for stage in (2, 3):
        trainer, engine = start(stage)
        losses[stage] = []
        for _ in range(3):
            out = engine(input_ids=ids, labels=ids)
            loss = out.loss_sum / out.tokens
            engine.backward(loss)
            engine.step()
            losses[stage].append(float(loss))
    assert losses[3] == pytest.approx(losses[2], rel=1e-5), losses
    engine.save_checkpoint(str(tmp_path / "c"), tag="ds", save_latest=False, exclude_frozen_parameters=True)
    state = _consolidated_state_dict(str(tmp_path / "c"), 3)
    assert all(k.startswith("head.") for k in state) and state["head.draft_tokens"].tolist() == list(range(40, 120))
    with deepspeed.zero.GatheredParameters(list(trainer.head.parameters())):
        for name, value in trainer.head.named_parameters():
            torch.testing.assert_close(state[f"head.{name}"], value.detach().float())
    _, fresh = start(3, seed=9, vocabulary=torch.arange(80))  # (the checkpoint's vocabulary replaces it)
    fresh.load_checkpoint(str(tmp_path / "c"), tag="ds", load_module_strict=False)
    assert float(fresh(input_ids=ids, labels=ids).loss_sum) == pytest.approx(
        float(engine(input_ids=ids, labels=ids).loss_sum)
    )
