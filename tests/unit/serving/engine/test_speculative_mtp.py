"""Speculative decoding from the checkpoint's own multi-token-prediction layer (`engine.speculative.method: mtp`,
`engine/mtp.py`, `model/mtp.py`): the drafts are the layer's, as transformers' own decoder layer computes it over the
model's hidden states; greedy outputs stay the model's; a layer that predicts well is accepted; the layer's cache is
the model's blocks, prefix cache included; what cannot draft is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from engine_models import (
    GREEDY,
    HEAD_SHARDS,
    PROMPTS,
    Family,
    add_mtp_layer,
    assert_pool_empty,
    recorded,
    run,
    spec,
    speculating,
    tokens_of,
)
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.specs import EngineSpec


def mtp(num_tokens: int = 3) -> dict:
    return {"method": "mtp", "num_tokens": num_tokens}


QWEN = ("qwen3_next", "qwen3_5_moe_text")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", *QWEN])
def checkpoint(request, tmp_path_factory) -> tuple[Family, dict]:
    """The DeepSeek-V3 fixture (3 layers: 1 dense, 2 sparse; latent attention), GLM-4.5's (its attention Llama's with
    biases, query and key norms and half of each head rotated), Qwen3-Next's and Qwen3.5 MoE's (recurrent layers and a
    gated attention one; the layer: gated attention and MoE), each with a random multi-token-prediction layer written
    into the checkpoint as their releases hold it."""
    family = Family(request.param, tmp_path_factory.mktemp(request.param) / "m", greedy=False)
    return family, add_mtp_layer(family.dir)


def reference_layer(family: Family, tensors: dict, scratch) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The layer's decoder layer as transformers builds it, its tensors read by transformers' own loader, and its rotary
    embedding: DeepSeek's, layer N of the model's class with N + 1 layers loaded from the checkpoint; Qwen's, layer 0
    of a model of one full-attention layer saved from the checkpoint's `mtp.layers.0`."""
    from safetensors.torch import save_file

    config = AutoConfig.from_pretrained(family.dir)
    if config.model_type in QWEN:
        one = AutoConfig.from_pretrained(family.dir, num_hidden_layers=1, layer_types=["full_attention"])
        one.save_pretrained(scratch)
        state = {k: v for k, v in family.model.state_dict().items() if not k.startswith("model.layers.")}
        state.update(
            {"model.layers.0." + k.removeprefix("mtp.layers.0."): v for k, v in tensors.items() if ".layers." in k}
        )
        save_file({k: v.contiguous() for k, v in state.items()}, str(scratch / "model.safetensors"))
        directory, index = str(scratch), 0
    else:
        one = AutoConfig.from_pretrained(family.dir, num_hidden_layers=config.num_hidden_layers + 1)
        directory, index = family.dir, config.num_hidden_layers
    one._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(directory, config=one, dtype=torch.float32).eval()
    return model.model.layers[index], model.model.rotary_emb


def norm(family: Family, weight: torch.Tensor) -> torch.nn.Module:
    """An RMSNorm of the family's class (Qwen's scale by 1 + w) holding `weight`."""
    config = family.model.config
    module = type(family.model.model.norm)(config.hidden_size, eps=config.rms_norm_eps)
    module.weight.data.copy_(weight)
    return module


@torch.no_grad()
def reference_drafts(family: Family, tensors: dict, layer, rotary, token_ids: list[int], k: int) -> list[int]:
    """DeepSeek-V3's multi-token prediction (its report's 2.2, vLLM's DeepSeekMultiTokenPredictorLayer; GLM-4.5's the
    same; Qwen's as vLLM's Qwen3NextMultiTokenPredictor), written out over the whole sequence without a cache: row p
    reads the model's final hidden state at p and the embedding of the token at p + 1 (DeepSeek's: zeroed at position
    0); the first draft is the argmax of the last row's output through the layer's norm and the model's head; each next
    one appends the draft before with the layer's own output (Qwen's: after the norm) as its hidden."""
    qwen = family.model.config.model_type in QWEN
    parts = (
        ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm") if qwen else ("enorm", "hnorm", "eh_proj", "norm")
    )
    n = family.model.config.num_hidden_layers
    prefix = "mtp." if qwen else f"model.layers.{n}."
    e_norm, h_norm = (norm(family, tensors[f"{prefix}{parts[i]}.weight"]) for i in (0, 1))
    projection = tensors[f"{prefix}{parts[2]}.weight"]
    out_norm = norm(family, tensors[f"{prefix}{'norm' if qwen else 'shared_head.norm'}.weight"])
    ids = torch.tensor([token_ids])
    h = family.model.model(input_ids=ids).last_hidden_state[0]  # after the final norm
    embed = family.model.model.embed_tokens
    tokens, hidden = list(token_ids[1:]), [h[p] for p in range(len(token_ids) - 1)]
    drafts = []
    for _ in range(k):
        e = embed(torch.tensor(tokens))
        if not qwen:
            e[0] = 0
        x = (torch.cat([e_norm(e), h_norm(torch.stack(hidden))], dim=-1) @ projection.T)[None]
        positions = torch.arange(x.shape[1])[None]
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rotary(x, positions))
        last = (out[0] if isinstance(out, tuple) else out)[0, -1]
        normed = out_norm(last)
        draft = int(family.model.lm_head(normed).argmax())
        drafts.append(draft)
        tokens.append(draft)
        hidden.append(normed if qwen else last)
    return drafts


def test_the_drafts_are_the_checkpoint_layer_s_and_greedy_outputs_the_model_s(checkpoint, tmp_path) -> None:
    """Each step's drafts are what the layer computes (transformers' decoder layer over the model's hidden states:
    the catch-up's cache after prompts and verified drafts, and the drafts fed back), and greedy outputs stay
    transformers' own (a random layer: its drafts are mostly rejected, which the outputs never show)."""
    family, tensors = checkpoint
    layer, rotary = reference_layer(family, tensors, tmp_path)
    engine = speculating(family.engine(speculative=mtp(3)))
    proposed = recorded(engine)
    prompts = PROMPTS[:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    got = run(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[str(i)]) == family.hf_greedy(prompt, GREEDY.max_tokens), i
    assert len(proposed) > 20
    checked = proposed[:: max(1, len(proposed) // 12)]
    for token_ids, drafts in checked:
        assert drafts == reference_drafts(family, tensors, layer, rotary, token_ids, len(drafts)), token_ids
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_draft_model_steps_total > 0, stats
    assert_pool_empty(engine)


def test_a_request_that_does_not_speculate_is_caught_up_in_few_passes_and_drafts_right_when_it_does(
    checkpoint, tmp_path
) -> None:
    """While the rule says no, the layer holds the model's rows and catches up once a request holds 64 of them (a few
    passes for hundreds of tokens, not one a step); when the rule says yes, it catches up on the rest first, and the
    drafts are still the layer's own."""
    from pylon.serving.engine.mtp import HOLD

    family, tensors = checkpoint
    engine = family.engine(speculative=mtp(3), max_model_len=512)
    calls = []
    engine.spec_policy.decide = lambda decodes, drafts, other, **_: calls.append(1) or len(calls) > 150
    proposed = recorded(engine)
    prompt = PROMPTS[1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    passes = []
    while engine.has_unfinished() and len(calls) < 150:
        engine.step()
        passes.append(engine.mtp.forward_passes)
    # 150 plain steps: 150 decodes' rows and the prompt's, caught up HOLD at a time
    assert passes[-1] == (len(prompt) + 150) // HOLD, passes
    run(engine)
    assert proposed, "the rule said yes: the request speculated"
    layer, rotary = reference_layer(family, tensors, tmp_path)
    token_ids, drafts = proposed[0]
    assert len(token_ids) > len(prompt) + 140
    assert drafts == reference_drafts(family, tensors, layer, rotary, token_ids, len(drafts))
    assert_pool_empty(engine)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Family:
    """A DeepSeek-V3 of one sparse layer whose multi-token-prediction layer is that layer, fed the next token: it
    proposes what the model itself would compute a token later (short of the context's first two tokens)."""
    family = Family(
        "deepseek_v3",
        tmp_path_factory.mktemp("predictor") / "m",
        greedy=False,
        num_hidden_layers=1,
        first_k_dense_replace=0,
    )
    add_mtp_layer(family.dir, predictor=True)
    family.model = AutoModelForCausalLM.from_pretrained(family.dir, dtype=torch.float32).eval()  # (rescaled rows)
    return family


def test_a_layer_that_predicts_the_model_is_accepted_several_tokens_a_step(predictor: Family) -> None:
    """The layer's drafts are accepted where it predicts the model (here: most tokens), greedy outputs unchanged, and
    a prompt that shares a cached prefix drafts as well, the layer's keys and values coming with the model's blocks."""
    engine = speculating(predictor.engine(speculative=mtp(3), enable_prefix_caching=True))
    shared = PROMPTS[5][:40]
    prompts = [*PROMPTS, shared + [1, 2, 3], shared + [9, 8, 7, 6]]
    got = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        if i >= len(PROMPTS) - 1:  # (the shared prefix's first request done before the second: its blocks cached)
            got.update(run(engine))
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[str(i)]) == predictor.hf_greedy(prompt, GREEDY.max_tokens), i
    stats = engine.stats()
    assert stats.prefix_cache_hits_total >= 32, stats
    rate = stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total
    assert rate > 0.3, stats
    # by position among a request's drafts: each accepted after those before it, the first the most often
    accepted, verified = stats.spec_accepted_tokens_by_position, stats.spec_draft_tokens_by_position
    assert len(accepted) == 3 and sum(accepted) == stats.spec_accepted_tokens_total, stats
    assert list(accepted) == sorted(accepted, reverse=True) and sum(verified) == stats.spec_draft_tokens_total
    assert engine.spec_policy.mean_acceptance_length > 1.8, stats
    assert_pool_empty(engine)


def test_a_prefix_back_from_the_host_tier_brings_the_layer_s_keys_and_values_with_it(predictor: Family) -> None:
    """engine.kv_offload_tokens: the layer's cache is in the model's blocks, so a prefix copied to host memory and back
    brings the layer's entries with the model's: the request after it drafts exactly what it drafts where the device
    kept the blocks (the same drafts accepted), and writes the model's tokens."""
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(0, 256, (70,), generator=g).tolist()
    others = [torch.randint(0, 256, (70,), generator=g).tolist() for _ in range(3)]
    counts = []
    for fields in ({}, {"kv_cache_tokens": 128, "max_model_len": 128, "kv_offload_tokens": 512}):
        engine = speculating(predictor.engine(speculative=mtp(3), max_num_seqs=1, **fields))
        for i, prompt in enumerate([doc + [1, 2], *others]):
            engine.add_request(str(i), prompt, GREEDY)
            run(engine)
        before = engine.stats()
        engine.add_request("again", doc + [9, 8, 7], GREEDY)
        got = run(engine)["again"]
        assert tokens_of(got) == predictor.hf_greedy(doc + [9, 8, 7], GREEDY.max_tokens)
        after = engine.stats()
        assert got[-1].num_cached_tokens == 64
        counts.append(
            (
                after.spec_draft_tokens_total - before.spec_draft_tokens_total,
                after.spec_accepted_tokens_total - before.spec_accepted_tokens_total,
            )
        )
    assert after.kv_offload_loaded_blocks_total == 4, after  # (the device's 8 blocks had let the document go)
    assert counts[0] == counts[1] and counts[0][1] > 0, counts


def test_under_preemption_quantization_and_a_narrower_cache_outputs_stay_the_plain_engine_s(predictor: Family) -> None:
    """A pool too small for the batch (requests preempted and computed again, their held rows dropped), the layer's
    projections int8 as the model's (engine.quantization) and its cache bf16 as the model's: outputs are the plain
    engine's under the same settings, and the layer still drafts what the model writes."""
    settings = {"kv_cache_tokens": 256, "block_size": 8, "max_num_batched_tokens": 64, "quantization": "int8"}
    settings["kv_cache_dtype"] = "bf16"
    runs = []
    for speculative in (None, mtp(3)):
        engine = predictor.engine(**settings, **({"speculative": speculative} if speculative else {}))
        if speculative:
            speculating(engine)
        runs.append([c.token_ids for c in engine.generate(PROMPTS, GREEDY)])
        stats = engine.stats()
        assert stats.num_preemptions_total > 0, stats
        if speculative:
            assert stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total > 0.3, stats
            assert not engine.mtp._held and not engine.mtp._outputs  # (every request's let go)
        assert_pool_empty(engine)
    assert runs[0] == runs[1]


def test_a_block_fp8_checkpoint_s_layer_is_read_dequantized_and_still_predicts(predictor: Family, tmp_path) -> None:
    """DeepSeek-V3's checkpoints are block FP8, the layer's projections too (`weight_scale_inv` beside each): read
    dequantized as the model's, the layer that predicts the model still does, and outputs are the plain engine's."""
    from engine_models import save_quantized

    quantized = tmp_path / "fp8"
    save_quantized(predictor.dir, quantized, "fp8-block")
    n = predictor.model.config.num_hidden_layers
    assert (quantized / "model.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert f"model.layers.{n}.self_attn.q_a_proj.weight_scale_inv" in f.keys()
    runs = []
    for speculative in (None, mtp(3)):
        engine = LLMEngine(str(quantized), spec(speculative=speculative) if speculative else spec())
        if speculative:
            speculating(engine)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        got = run(engine)
        runs.append([tokens_of(got[str(i)]) for i in range(len(PROMPTS))])
        if speculative:
            stats = engine.stats()
            assert stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total > 0.3, stats
    assert runs[0] == runs[1]


def test_a_seeded_request_gives_plain_decodings_tokens_with_the_layer_s_drafts(predictor: Family) -> None:
    """Sampled requests speculate with the layer's drafts, and a seeded one draws the tokens plain decoding gives it."""
    runs = []
    for speculative in (None, mtp(2)):
        engine = predictor.engine(speculative=speculative) if speculative else predictor.engine()
        if speculative:
            speculating(engine)
        for i, prompt in enumerate(PROMPTS[:4]):
            params = SamplingParams(max_tokens=24, temperature=0.2, seed=i, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
        got = run(engine)
        runs.append({k: tokens_of(v) for k, v in got.items()})
        if speculative:
            assert engine.stats().spec_accepted_tokens_total > 0, engine.stats()
        assert_pool_empty(engine)
    assert runs[0] == runs[1]


def test_what_cannot_draft_from_such_a_layer_is_refused_by_name(tmp_path) -> None:
    plain = Family("deepseek_v3", tmp_path / "plain", greedy=False)  # (transformers' save: no such layer)
    with pytest.raises(PylonError, match=r"engine\.speculative\.method mtp: .*model\.layers\.3\.eh_proj\.weight"):
        plain.engine(speculative=mtp())
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(PylonError, match=r"engine\.speculative\.method mtp: .*num_nextn_predict_layers 0"):
        plain.engine(speculative=mtp())
    llama = Family("llama", tmp_path / "llama", greedy=False)
    with pytest.raises(PylonError, match=r"engine\.speculative\.method mtp: .*a llama checkpoint has no"):
        llama.engine(speculative=mtp())
    with pytest.raises(ValueError, match=r"speculative\.method.*pipeline_parallel 2"):
        EngineSpec(pipeline_parallel=2, speculative=mtp())
    EngineSpec(tensor_parallel=2, speculative=mtp())  # (shards take it: test_the_layer_in_two_shards_...)


@pytest.mark.parametrize(
    "name", ["deepseek_v3", *(pytest.param(n, marks=pytest.mark.slow) for n in ("glm4_moe", *QWEN))]
)
def test_the_layer_in_two_shards_computes_the_whole_layer(name, tmp_path) -> None:
    """engine.tensor_parallel 2: each shard holds its slices of the layer (its heads, its experts' slices) beside its
    shard of the model, and their catch-up and their draft fed back give the whole layer's logits."""
    from test_tensor_shards import _processes

    family = Family(name, tmp_path / "m", greedy=False)
    add_mtp_layer(family.dir)
    args = [family.dir, "mtp", json.dumps(PROMPTS[2])]
    (whole,) = _processes(HEAD_SHARDS, family.dir, 1, tmp_path, args)
    shards = _processes(HEAD_SHARDS, family.dir, 2, tmp_path, args)
    for part in shards:  # (float32 sums in another order: a few units in the 4th decimal, the second pass's more)
        torch.testing.assert_close(part["hidden"], whole["hidden"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(part["first"], whole["first"], atol=5e-4, rtol=1e-3)
        torch.testing.assert_close(part["second"], whole["second"], atol=5e-4, rtol=1e-3)
        assert part["first"].argmax(-1).tolist() == whole["first"].argmax(-1).tolist()
        assert part["heads"] * 2 == whole["heads"], (part["heads"], whole["heads"])
