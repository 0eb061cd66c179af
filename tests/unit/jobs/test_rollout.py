"""`grpo.sampler: engine` (pylon.jobs.rollout): the serving engine beside a trained model samples what the model
would (greedy: token for token), follows its weights as they change (LoRA merged, ZeRO-3 gathered), shares a
group's prompt among its copies through the prefix cache, and a model trained through DeepSpeed with it learns."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.tokenizer import ByteTokenizer, load_tokenizer
from pylon.jobs.grpo import (
    STAT_NAMES,
    GrpoLoss,
    Rewards,
    grpo_record,
    grpo_sample,
    grpo_train,
    prompts_and_answers,
    sample_completions,
    sample_seed,
)
from pylon.jobs.rollout import RolloutEngine, full_weights
from pylon.specs import TrainJobSpec, sampler_kv_cache_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_checkpoint import distributed  # noqa: E402, F401 (fixture: a one-process gloo world, for DeepSpeed)
from test_grpo import EOS, PAD, _batch, _model, _spec, deepspeed_start, replace_loss  # noqa: E402

BYTE = ByteTokenizer().info.model_dump(mode="json")


def _prompts(*texts: str) -> list[np.ndarray]:
    return [np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64) for t in texts]


def _rollout(module, spec=None, seq_len: int = 64) -> RolloutEngine:
    return RolloutEngine(
        module, BYTE, spec=spec or _spec(sampler="engine"), device=torch.device("cpu"), seq_len=seq_len
    )


def test_the_engine_samples_the_models_greedy_continuations_and_follows_its_weights() -> None:
    model = _model()
    with torch.no_grad():  # larger weights: a random model's argmax then depends on every position and token
        for p in model.parameters():
            p.mul_(4)
    prompts = _prompts("Hi", "A longer prompt", "xyz!")
    loss = GrpoLoss(max_tokens=6)
    rollout = _rollout(model)

    def both():
        want = sample_completions(model, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu", seed=0, greedy=True,
                                  copies=2)  # fmt: skip
        rollout.current(model)  # (a module without DeepSpeed's step count: given its weights every time)
        got = rollout.sample(prompts, loss, seed=0, greedy=True, copies=2)
        return [c.tolist() for c in want], [c.tolist() for c in got]

    want, got = both()
    assert got == want and len(got) == 6
    with torch.no_grad():  # an update: the engine follows it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    again_want, again = both()
    assert again == again_want and again != got
    assert rollout.syncs == 2


def test_a_groups_copies_read_its_prompt_from_the_prefix_cache_and_sampling_is_seeded() -> None:
    model = _model()
    prompts = _prompts("Say the letter a, and say it again: ", "Write down a colour name, then stop here: ")
    assert all(len(p) > 32 for p in prompts)  # two full blocks of 16 each
    loss = GrpoLoss(generations=4, max_tokens=12)
    rollout = _rollout(model)
    a = [c.tolist() for c in rollout.sample(prompts, loss, seed=1)]
    assert len(a) == 8 and all(len(x) == 12 or x[-1] == EOS for x in a) and all(EOS not in x[:-1] for x in a)
    assert len({tuple(x) for x in a}) > 1  # a group's completions differ
    # each prompt computed once: its three other copies read its two full blocks from the cache
    assert rollout.cached_tokens == 2 * 3 * 32
    prefill = sum(len(p) for p in prompts) + 3 * sum(len(p) - 32 for p in prompts)
    assert rollout.computed_tokens == prefill + sum(len(x) for x in a)
    assert prefill < loss.generations * sum(len(p) for p in prompts)  # (the model sampler computes every copy's)
    assert [c.tolist() for c in rollout.sample(prompts, loss, seed=1)] == a
    assert [c.tolist() for c in rollout.sample(prompts, loss, seed=2)] != a
    narrow = replace_loss(loss, top_p=1e-6)  # only the likeliest token left: greedy
    greedy = [c.tolist() for c in rollout.sample(prompts, loss, seed=0, greedy=True)]
    assert [c.tolist() for c in rollout.sample(prompts, narrow, seed=5)] == greedy


@pytest.mark.parametrize(
    "preset, targets",
    [("llama-tiny", ["q_proj", "down_proj", "lm_head"]), ("gpt-tiny", ["c_attn", "c_fc", "lm_head"])],
    ids=["llama", "gpt2"],
)
def test_lora_adapters_are_merged_into_the_weights_the_engine_gets(preset, targets) -> None:
    """The adapters' products added to their base weights apart from the trained model (peft's merge, which leaves
    it as it is), Llama's Linear layers and GPT-2's Conv1D ones (fan_in_fan_out); the engine's greedy completions are
    the model's, before and after the adapters move."""
    from pylon.models import build_model

    spec = _spec(preset, sampler="engine").model_copy(
        update={"lora": TrainJobSpec.model_validate(
            {"name": "l", "model": {"preset": preset}, "data": {"uri": "/x"}, "steps": 1,
             "lora": {"r": 4, "alpha": 8, "target_modules": targets}}).lora}
    )  # fmt: skip
    model = build_model(spec, vocab_size=258, eos_id=EOS, pad_id=PAD, seed=0).eval()

    def move_adapters(scale: float) -> None:  # (B starts at 0: merged, the adapters would change nothing)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * scale)

    move_adapters(0.2)
    got = {name: t.clone() for name, t in full_weights(model)}
    clone = copy.deepcopy(model)
    head = clone.get_base_model().get_output_embeddings()
    if head.base_layer.weight is clone.get_base_model().get_input_embeddings().weight:  # GPT-2's tied output layer:
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.clone())  # the input keeps the bare weight
    merged = clone.merge_and_unload().state_dict()
    assert set(got) <= set(merged) and len(got) >= len(merged) - 1  # (a tied lm_head given once, as its embeddings)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any("lora" in n for n, _ in model.named_parameters())  # the trained model keeps its adapters apart
    prompts = _prompts("Hi there", "xyz!")
    loss = GrpoLoss(max_tokens=6)
    rollout = _rollout(model, spec)

    def agree() -> list:
        want = sample_completions(model, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu", seed=0, greedy=True,
                                  copies=1)  # fmt: skip
        got = rollout.sample(prompts, loss, seed=0, greedy=True, copies=1)
        assert [c.tolist() for c in got] == [c.tolist() for c in want]
        return [c.tolist() for c in got]

    before = agree()
    move_adapters(1.0)
    rollout.current(model)
    assert agree() != before


def test_zero3_partitions_are_gathered_into_the_whole_weights(distributed) -> None:  # noqa: F811
    """At ZeRO-3 each module's partitions are gathered while its weights are read: the engine gets the whole model,
    the one a build without partitioning makes from the same seed."""
    spec = TrainJobSpec.model_validate(
        {"name": "z", "model": {"preset": "llama-tiny"}, "data": {"uri": "/none"}, "steps": 2,
         "deepspeed": {"zero_stage": 3}, "objective": "grpo",
         "grpo": {"rewards": [{"function": "exact_match"}], "sampler": "engine"}}
    )  # fmt: skip
    model, engine, _ = deepspeed_start(spec)
    whole = _model()  # (build_model: the same weights at every ZeRO stage from one seed)
    got = dict((n, t.clone()) for n, t in full_weights(engine.module))
    want = whole.state_dict()
    assert set(got) <= set(want) and len(got) >= len(want) - 1
    for name, tensor in got.items():
        assert tensor.shape == want[name].shape, name
        torch.testing.assert_close(tensor.float(), want[name].float(), msg=name)
    assert any(hasattr(p, "ds_id") and p.numel() == 0 for p in engine.module.parameters())  # still partitioned
    rollout = _rollout(engine, spec)
    prompts = _prompts("Hi", "xyz!")
    loss = GrpoLoss(max_tokens=5)
    assert [c.tolist() for c in rollout.sample(prompts, loss, seed=0, greedy=True, copies=1)] == [
        c.tolist()
        for c in sample_completions(
            whole, prompts, loss, eos_id=EOS, pad_id=PAD, device="cpu", seed=0, greedy=True, copies=1
        )  # fmt: skip
    ]


def test_a_model_sampled_by_the_engine_learns_what_its_reward_asks_for(tmp_path, distributed) -> None:  # noqa: F811
    """`test_grpo.test_a_model_learns_what_its_reward_asks_for` with the engine sampling: through DeepSpeed (ZeRO-2)
    with LoRA, the engine given the merged weights after every optimizer step (`current`: DeepSpeed's step count),
    the reward rises. (At lr 2e-2 the run learned, then collapsed to emitting none of it within 30 steps on an AMD EPYC
    VM's kernels: 1e-2 rises to 1.0 by step 10 and stays there.)"""
    from pylon.jobs.train import _global_mean_loss

    records = [{"prompt": f"Now say the letter a{'!' * i}: ", "completion": "a"} for i in range(4)]
    batch, _ = _batch(tmp_path, records)
    spec = TrainJobSpec.model_validate(
        {"name": "g", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2,
         "objective": "grpo", "grpo": {"rewards": [{"function": "contains_answer"}], "generations": 8,
                                       "max_completion_tokens": 8, "sampler": "engine"},
         "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
         "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]}}
    )  # fmt: skip
    _, engine, reference = deepspeed_start(spec)
    loss = GrpoLoss.of(spec)
    rewards, tok = Rewards(spec.grpo.rewards), load_tokenizer("byte")
    rollout = _rollout(engine, spec)
    figures, computed = [], []
    for step in range(30):
        sampled = grpo_sample(engine, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD,
                              seed=sample_seed(0, step, 0, 0), rollout=rollout)  # fmt: skip
        loss_t, count, _, stats = grpo_train(engine, engine.module, sampled, loss, reference)
        engine.backward(_global_mean_loss(loss_t, count, 1)[0])
        engine.step()
        figures.append(grpo_record(stats, rewards.names))
        computed.append((sampled.sampled_tokens, sampled.tokens))
    assert rollout.syncs == 29  # after each update but the last (step 0 samples the weights it was built from)
    first = np.mean([f["grpo_reward"] for f in figures[:8]])
    last = np.mean([f["grpo_reward"] for f in figures[-8:]])
    assert last > first + 0.3 and last > 0.6, (first, last, [round(f["grpo_reward"], 2) for f in figures])
    # what the engine computed: each prompt's full block once, then its copies' own tokens; the model sampler
    # computes every copy's whole prompt
    prompts = [p for p, _, _ in prompts_and_answers(batch, EOS)]
    assert all(len(p) > 16 for p in prompts)
    shared = (loss.generations - 1) * 16 * len(prompts)
    assert all(c == loss.generations * sum(map(len, prompts)) - shared + n for c, n in computed), computed


def test_the_sampler_settings_and_the_kv_cache_default() -> None:
    spec = _spec(sampler="engine", generations=4, max_completion_tokens=100)
    assert spec.grpo.sampler == "engine" and spec.grpo.sampler_max_num_seqs == 64
    assert sampler_kv_cache_tokens(spec, 512) == max(4096, spec.batch.micro_batch_size * (512 + 4 * 100))
    with pytest.raises(Exception, match="sampler"):
        _spec(sampler="vllm")
    with pytest.raises(Exception, match=r"grpo\.sampler_kv_cache_tokens: is grpo\.sampler engine\'s"):
        _spec(sampler_kv_cache_tokens=8192)


def test_the_driver_refuses_a_model_the_engine_cannot_sample_by_name(tmp_path) -> None:
    from pylon.data.reader import read_manifest
    from pylon.errors import PylonError
    from pylon.jobs.rollout import check_sampler

    _, out = _batch(tmp_path)
    manifest = read_manifest(out)
    check_sampler(_spec(sampler="engine"), manifest)  # llama: served, its weights taken as they are
    moe = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    spec = TrainJobSpec.model_validate({**_spec(sampler="engine").model_dump(), "model": {"config": moe}})
    with pytest.raises(PylonError, match=r"grpo\.sampler: engine: model_type 'mixtral''s weights are reshaped"):
        check_sampler(spec, manifest)
    bert = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 64}  # fmt: skip
    spec = TrainJobSpec.model_validate({**_spec(sampler="engine").model_dump(), "model": {"config": bert}})
    with pytest.raises(PylonError, match=r"does not run model_type 'bert'.*use grpo\.sampler: model"):
        check_sampler(spec, manifest)


def test_the_engines_sampling_is_corrected_by_each_tokens_capped_ratio_as_trl_does(tmp_path) -> None:
    """objective grpo with the engine (TRL's vllm_importance_sampling_correction, token_truncate): each completion
    token's surrogate weighed by min(cap, pi_old / pi_engine), pi_engine the distribution the engine drew it from.
    With top_k the engine draws from the k likeliest renormalised, so each weight is the tempered distribution's mass
    on those k tokens (here, where the engine computes as the model does, in fp32); the mean is logged."""
    from pylon.jobs.grpo import grpo_losses, token_logprobs

    batch, _ = _batch(tmp_path, [{"prompt": f"Now say the letter a{'!' * i}: ", "completion": "a"} for i in range(2)])
    spec = _spec(
        sampler="engine", generations=4, max_completion_tokens=6, top_k=5, temperature=0.8,
        sampler_correction="token_truncate",
    )  # fmt: skip
    loss = GrpoLoss.of(spec)
    assert loss.correction == "token_truncate" and loss.correction_max == 3.0 and loss.correction_min is None
    assert loss.sampling_logprobs  # (the trained model's logprobs at sampling)
    assert GrpoLoss.of(_spec(generations=4)).correction == "none"  # (the model sampler: nothing to correct)
    assert GrpoLoss.of(_spec(sampler="engine")).correction == "sequence_mask"  # (TRL's default)
    off = GrpoLoss.of(_spec(sampler="engine", sampler_correction="none"))
    assert not off.corrects and not off.sampling_logprobs
    model = _model()
    rollout = _rollout(model, spec)
    rewards, tok = Rewards(spec.grpo.rewards), load_tokenizer("byte")
    sampled = grpo_sample(model, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD, seed=7, rollout=rollout)
    weights = sampled.sampler_ratio
    assert weights is not None and len(weights) == sampled.tokens
    with torch.no_grad():  # the top-5 mass of the tempered distribution at each completion token's position
        logits = model(input_ids=sampled.inputs["input_ids"], attention_mask=sampled.inputs["attention_mask"]).logits
        probs = torch.softmax(logits[:, :-1].float() / 0.8, -1)
        counted = sampled.inputs["labels"][:, 1:] != -100
        mass = probs.topk(5, dim=-1).values.sum(-1)[counted]
    torch.testing.assert_close(weights, mass.clamp(max=3.0), rtol=1e-4, atol=1e-5)
    assert (weights < 1).all()
    # the loss: each token's clipped surrogate times its weight, then the KL term (TRL's order)
    logps, rows = token_logprobs(model, sampled.inputs, False, loss.temperature)
    a = sampled.advantages
    plain, _, _ = grpo_losses(logps, rows, a, loss, len(sampled.advantages))
    weighted, _, _ = grpo_losses(logps, rows, a, loss, len(sampled.advantages), weights=weights)
    per_token = -(torch.exp(logps - logps.detach()) * a[rows])
    assert float(plain) == pytest.approx(float(per_token.sum()), rel=1e-5, abs=1e-6)
    assert float(weighted) == pytest.approx(float((per_token * weights).sum()), rel=1e-5, abs=1e-6)
    _, _, _, stats = grpo_train(model, model, sampled, loss)
    record = grpo_record(stats, rewards.names, corrected=True)
    assert record["grpo_sampler_ratio"] == pytest.approx(float(weights.mean()), rel=1e-5)


def test_the_corrections_four_modes_bound_a_tokens_or_a_completions_ratio_as_trl_does() -> None:
    """TRL's vllm_importance_sampling_mode: per token or per completion (the product of its tokens' ratios), clipped
    to [min, cap] (truncate) or zero outside it (mask)."""
    from pylon.jobs.grpo import correction_weights

    # three completions of 2, 3 and 1 counted tokens; the trained model's log-probabilities and the engine's
    rows = torch.tensor([0, 0, 1, 1, 1, 2])
    old = torch.log(torch.tensor([0.5, 0.9, 0.2, 0.6, 0.3, 0.7]))
    drawn = torch.log(torch.tensor([0.1, 0.9, 0.4, 0.6, 0.3, 0.7]))
    token = torch.tensor([5.0, 1.0, 0.5, 1.0, 1.0, 1.0])  # pi_old / pi_engine
    sequence = torch.tensor([5.0, 0.5, 1.0])  # their products per completion

    def weights(mode: str, low=None, high=3.0):
        return correction_weights(
            old, drawn, rows, 3, GrpoLoss(correction=mode, correction_min=low, correction_max=high)
        )

    w, per = weights("token_truncate")
    torch.testing.assert_close(w, token.clamp(max=3.0))
    assert per is None
    w, _ = weights("token_mask", low=0.6)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0]))  # 5 > 3 and 0.5 < 0.6: left out
    w, per = weights("sequence_truncate", low=0.8)
    torch.testing.assert_close(per, torch.tensor([3.0, 0.8, 1.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, per[rows])
    w, per = weights("sequence_mask")
    torch.testing.assert_close(per, torch.tensor([0.0, 0.5, 1.0]), rtol=1e-5, atol=1e-6)  # only above the cap
    w, per = weights("sequence_mask", low=0.6, high=None)
    torch.testing.assert_close(per, torch.tensor([5.0, 0.0, 1.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sequence, torch.exp(torch.zeros(3).index_add(0, rows, old - drawn)))


def test_rloo_with_the_engine_weighs_each_completions_loss_by_its_sequence_ratio(tmp_path) -> None:
    """objective rloo (a completion's loss) with the engine: the sequence-level correction (sequence_mask, TRL's
    default): each completion's clipped surrogate times its ratio pi_old / pi_engine over its tokens, zero above the
    cap; the mean weight over completions logged. Token modes are refused for rloo, online_dpo takes none, and no bound
    at all is refused, each by name."""
    from pylon.jobs.grpo import rloo_losses, sequence_sums, token_logprobs

    batch, _ = _batch(tmp_path, [{"prompt": f"Now say the letter a{'!' * i}: ", "completion": "a"} for i in range(2)])
    grpo = {"rewards": [{"function": "contains_answer"}], "sampler": "engine", "generations": 4,
            "max_completion_tokens": 6, "top_k": 5, "temperature": 0.8}  # fmt: skip
    base = {"name": "g", "model": {"preset": "llama-tiny"}, "data": {"uri": "/tmp/none"}, "steps": 2}
    spec = TrainJobSpec.model_validate({**base, "objective": "rloo", "grpo": grpo})
    loss = GrpoLoss.of(spec)
    assert loss.rloo and loss.correction == "sequence_mask" and loss.sampling_logprobs
    model = _model()
    rewards, tok = Rewards(spec.grpo.rewards), load_tokenizer("byte")
    sampled = grpo_sample(
        model, batch, loss, rewards, tok, eos_id=EOS, pad_id=PAD, seed=3, rollout=_rollout(model, spec)
    )
    n = sampled.completions
    weights = sampled.sampler_ratio
    assert weights is not None and weights.shape == (n,)
    with torch.no_grad():  # each completion's product of its tokens' top-5 masses (the engine computes in fp32)
        logits = model(input_ids=sampled.inputs["input_ids"], attention_mask=sampled.inputs["attention_mask"]).logits
        probs = torch.softmax(logits[:, :-1].float() / 0.8, -1)
        counted = sampled.inputs["labels"][:, 1:] != -100
        mass = (probs.topk(5, dim=-1).values.sum(-1).log() * counted).sum(-1).exp()
    torch.testing.assert_close(weights, torch.where(mass > 3.0, 0.0, mass), rtol=1e-4, atol=1e-5)
    assert (weights > 0).all() and (weights < 1).all()
    logps, rows = token_logprobs(model, sampled.inputs, False, loss.temperature)
    a = sampled.advantages
    plain, _, _ = rloo_losses(logps, rows, a, loss, n)
    weighted, _, _ = rloo_losses(logps, rows, a, loss, n, weights=weights)
    per_completion = -(torch.exp(sequence_sums(logps, rows, n) - sequence_sums(logps, rows, n).detach()) * a)
    assert float(plain) == pytest.approx(float(per_completion.sum()), rel=1e-5, abs=1e-6)
    assert float(weighted) == pytest.approx(float((per_completion * weights).sum()), rel=1e-5, abs=1e-6)
    _, _, _, stats = grpo_train(model, model, sampled, loss)
    record = grpo_record(stats, rewards.names, corrected=True)
    assert record["grpo_sampler_ratio"] == pytest.approx(float(weights.mean()), rel=1e-5)
    assert "grpo_sampler_ratio" not in grpo_record(stats, rewards.names)  # (no correction: no figure)
    masked = [0.0 if name == "sampler_ratio" else v for name, v in zip(STAT_NAMES, stats)] + stats[len(STAT_NAMES) :]
    assert grpo_record(masked, rewards.names, corrected=True)["grpo_sampler_ratio"] == 0.0  # every token masked out

    def refused(objective: str, match: str, **more) -> None:
        with pytest.raises(Exception, match=match):
            TrainJobSpec.model_validate({**base, "objective": objective, "grpo": {**grpo, **more}})

    refused("rloo", r"grpo\.sampler_correction: objective rloo's loss is a completion's: use sequence_mask",
            sampler_correction="token_truncate")  # fmt: skip
    refused("online_dpo", r"grpo\.sampler_correction: objective online_dpo has no policy ratio",
            generations=2, sampler_correction="sequence_truncate")  # fmt: skip
    refused("grpo", r"grpo\.sampler_correction_cap: None with no grpo\.sampler_correction_min leaves the ratio unbounded",
            sampler_correction_cap=None)  # fmt: skip
    refused("grpo", r"grpo\.sampler_correction_min: is grpo\.sampler engine's", sampler="model",
            sampler_correction_min=0.5)  # fmt: skip
    dpo = TrainJobSpec.model_validate({**base, "objective": "online_dpo", "grpo": {**grpo, "generations": 2}})
    assert GrpoLoss.of(dpo).correction == "none"
