"""Speculative decoding from an EAGLE or EAGLE-3 head (`engine.speculative.method: eagle | eagle3`, `draft_model` the
head's directory; `model/eagle.py`, run by `engine/mtp.py`): the drafts are the head's, as its decoder layer computes
them (written out here over transformers' layer and the model's hidden states, as vLLM's EagleLlamaForCausalLM and
Eagle3LlamaForCausalLM compute them); greedy outputs stay the model's; a head that predicts the model is accepted; the
checkpoint layouts of EAGLE's releases and of the speculators format are read; what cannot draft is refused by
name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from engine_models import GREEDY, HEAD_SHARDS, PROMPTS, Family, assert_pool_empty, recorded, run, speculating, tokens_of
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from pylon.errors import PylonError
from pylon.specs import EngineSpec

HEAD = {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def method(kind: str, head: str | Path, num_tokens: int = 3) -> dict:
    return {"method": kind, "draft_model": str(head), "num_tokens": num_tokens}


def write_head(
    directory: Path,
    target,
    kind: str,
    *,
    layout: str = "eagle",
    draft_vocab: int | None = None,
    aux: list[int] | None = None,
    norm_before_residual: bool = False,
    own_embeddings: bool = False,
    seed: int = 5,
) -> dict[str, torch.Tensor]:
    """A random EAGLE (`kind` eagle) or EAGLE-3 (eagle3) head for the model of config `target`, written as its
    releases hold it (`layout` eagle: a Llama config.json, `LlamaForCausalLMEagle3` for EAGLE-3, its layer under
    `midlayer.`, pytorch_model.bin) or in the speculators format (`layout` speculators: the layer's config under
    `transformer_layer_config`, `layers.0.`, model.safetensors); returns its tensors by the names the reference reads
    (`layers.0.*`, `fc.*`, `norm.weight`, `lm_head.weight`, `d2t`, `embed_tokens.weight`)."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = target.hidden_size, target.vocab_size
    config = LlamaConfig(
        hidden_size=hidden, vocab_size=vocab, num_hidden_layers=1, max_position_embeddings=256, **HEAD
    ).to_dict()

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols**-0.5 * 1.5

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(hidden, generator=g)

    q, kv, width = HEAD["num_attention_heads"] * 32, HEAD["num_key_value_heads"] * 32, HEAD["intermediate_size"]
    wide = 2 * hidden if kind == "eagle3" else hidden
    t = {
        "layers.0.self_attn.q_proj.weight": w(q, wide),
        "layers.0.self_attn.k_proj.weight": w(kv, wide),
        "layers.0.self_attn.v_proj.weight": w(kv, wide),
        "layers.0.self_attn.o_proj.weight": w(hidden, q),
        "layers.0.mlp.gate_proj.weight": w(width, hidden),
        "layers.0.mlp.up_proj.weight": w(width, hidden),
        "layers.0.mlp.down_proj.weight": w(hidden, width),
        "layers.0.post_attention_layernorm.weight": norm(),
    }
    if kind == "eagle":
        t["fc.weight"], t["fc.bias"] = w(hidden, 2 * hidden), 0.1 * torch.randn(hidden, generator=g)
        t["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)  # (a copy the engine does not read)
    else:
        draft_vocab = draft_vocab or vocab
        chosen = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t |= {
            "layers.0.input_layernorm.weight": norm(),
            "layers.0.hidden_norm.weight": norm(),
            "norm.weight": norm(),
            "fc.weight": w(hidden, 3 * hidden),
            "lm_head.weight": w(draft_vocab, hidden),
            "d2t": chosen - torch.arange(draft_vocab),
        }
        config |= {"draft_vocab_size": draft_vocab, "architectures": ["LlamaForCausalLMEagle3"]}
        if own_embeddings:
            t["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    directory.mkdir(parents=True)
    stored = dict(t)
    if kind == "eagle3":
        stored["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True)
    else:  # (some EAGLE checkpoints keep the first layer's input norm, which EAGLE does not apply: not read)
        stored["layers.0.input_layernorm.weight"] = norm()
    if layout == "speculators":
        from safetensors.torch import save_file

        head = {
            "transformer_layer_config": config,
            "speculators_model_type": kind,
            "architectures": ["Eagle3Speculator"],
        }
        head |= {"draft_vocab_size": config.get("draft_vocab_size"), "norm_before_residual": norm_before_residual}
        head |= {"target_hidden_size": hidden, **({"eagle_aux_hidden_state_layer_ids": aux} if aux else {})}
        (directory / "config.json").write_text(json.dumps(head))
        save_file({k: v.contiguous() for k, v in stored.items()}, str(directory / "model.safetensors"))
    else:
        if aux:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        config["norm_before_residual"] = norm_before_residual
        (directory / "config.json").write_text(json.dumps(config))
        named = {
            ("midlayer." + k.removeprefix("layers.0.") if kind == "eagle3" and k.startswith("layers.0.") else k): v
            for k, v in stored.items()
        }
        torch.save(named, directory / "pytorch_model.bin")
    return t


class Reference:
    """The head as vLLM computes it, written out over the whole sequence without a cache: transformers' Llama decoder
    layer's attention (its projections read twice the width for EAGLE-3) and MLP, the model's hidden states from
    transformers (`output_hidden_states`)."""

    def __init__(self, family: Family, tensors: dict, kind: str, aux: list[int] | None, before_residual: bool = False):
        hidden = family.model.config.hidden_size
        config = LlamaConfig(hidden_size=hidden, vocab_size=family.model.config.vocab_size, **HEAD)
        config._attn_implementation = "eager"
        self.layer = LlamaDecoderLayer(config, 0).eval()
        if kind == "eagle3":
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.layer.self_attn, name)
                setattr(self.layer.self_attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=False))
        state = {k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")}
        state.pop("hidden_norm.weight", None)
        state.setdefault("input_layernorm.weight", torch.ones(hidden))
        self.layer.load_state_dict(state)
        self.rotary = LlamaRotaryEmbedding(config)
        self.family, self.t, self.kind, self.aux, self.before = family, tensors, kind, aux, before_residual

        def rms(name: str) -> torch.nn.Module:
            module = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            module.weight.data.copy_(tensors[name])
            return module

        if kind == "eagle3":
            self.e_norm, self.h_norm = rms("layers.0.input_layernorm.weight"), rms("layers.0.hidden_norm.weight")
            self.out_norm = rms("norm.weight")

    @torch.no_grad()
    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        """Row p reads the model's hidden state(s) at p and the embedding of the token at p + 1; the first draft is
        the last row's (EAGLE: its output through the model's head; EAGLE-3: through its norm, its head, d2t); each
        next one appends the draft before, with the output before any norm as its hidden (EAGLE-3: in place of g)."""
        model, t = self.family.model, self.t
        out = model.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True)
        if self.kind == "eagle":
            rows = out.last_hidden_state[0]  # after the final norm
        else:
            rows = torch.cat([out.hidden_states[j][0] for j in self.aux], dim=-1) @ t["fc.weight"].T  # g
        embed = t["embed_tokens.weight"] if self.kind == "eagle3" and "embed_tokens.weight" in t else None
        tokens, hidden = list(token_ids[1:]), [rows[p] for p in range(len(token_ids) - 1)]
        drafts = []
        for _ in range(k):
            e = embed[torch.tensor(tokens)] if embed is not None else model.model.embed_tokens(torch.tensor(tokens))
            h = torch.stack(hidden)
            if self.kind == "eagle":
                x = residual = torch.cat([e, h], dim=-1) @ t["fc.weight"].T + t["fc.bias"]
            else:
                normed = self.h_norm(h)
                residual = normed if self.before else h
                x = torch.cat([self.e_norm(e), normed], dim=-1)
            x, residual = x[None], residual[None]
            positions = torch.arange(x.shape[1])[None]
            causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
            a, _ = self.layer.self_attn(
                hidden_states=x, position_embeddings=self.rotary(residual, positions), attention_mask=causal
            )
            y = residual + a
            y = y + self.layer.mlp(self.layer.post_attention_layernorm(y))
            last = y[0, -1]
            if self.kind == "eagle":
                draft = int(model.lm_head(last).argmax())
            else:
                i = int((self.out_norm(last) @ t["lm_head.weight"].T).argmax())
                draft = i + int(t["d2t"][i])
            drafts.append(draft)
            tokens.append(draft)
            hidden.append(last)
        return drafts


# (name, target family and its settings, head kind, write_head's settings)
HEADS = {
    "eagle-llama": ("llama", {}, "eagle", {}),
    "eagle3-llama-default-layers": ("llama", {"num_hidden_layers": 8}, "eagle3", {"draft_vocab": 96}),
    # windowed layers (4-7, a window of 16) mixed with full ones: the KV cache in two groups of layers, the head's cache
    # in their block ids, reading the full group's table (kv_cache.HybridKVBlockPool)
    "eagle3-qwen2-windowed": (
        "qwen2",
        {"num_hidden_layers": 8, "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 4},
        "eagle3",
        {},
    ),
    "eagle3-qwen3-speculators": (
        "qwen3",
        {"num_hidden_layers": 4},
        "eagle3",
        {"layout": "speculators", "aux": [3, 1, 2], "norm_before_residual": True, "own_embeddings": True},
    ),
}


@pytest.fixture(scope="module", params=list(HEADS))
def headed(request, tmp_path_factory):
    name, overrides, kind, settings = HEADS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    family = Family(name, root / "m", greedy=False, **overrides)
    tensors = write_head(root / "head", family.model.config, kind, **settings)
    n = family.model.config.num_hidden_layers
    aux = settings.get("aux") or [2, n // 2, n - 3]
    return (
        family,
        kind,
        root / "head",
        Reference(family, tensors, kind, aux, settings.get("norm_before_residual", False)),
    )


def test_the_drafts_are_the_head_s_and_greedy_outputs_the_model_s(headed) -> None:
    """Each step's drafts are what the head computes over the model's hidden states (its cache caught up over prompts
    and verified drafts, its own outputs fed back), and greedy outputs stay transformers' own (a random head: its
    drafts mostly rejected, which the outputs never show)."""
    family, kind, head, reference = headed
    engine = speculating(family.engine(speculative=method(kind, head)))
    if any(w is not None for w in engine.runner.layer_windows):  # (the groups apart, the windowed ones let go)
        assert [w for _, w in engine.runner.kv_groups] == [None, 16] and engine.scheduler.window == 16
        assert engine.mtp.runner.k_cache[0].shape[1] == engine.pool.num_blocks == 2048 // 16 * 2
    proposed = recorded(engine)
    prompts = PROMPTS[:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    got = run(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[str(i)]) == family.hf_greedy(prompt, GREEDY.max_tokens), i
    assert len(proposed) > 20
    for token_ids, drafts in proposed[:: max(1, len(proposed) // 12)]:
        assert drafts == reference.drafts(token_ids, len(drafts)), token_ids
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_draft_model_steps_total > 0, stats
    assert_pool_empty(engine)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> tuple[Family, Path]:
    """A Llama of one layer (its norms ones, its embeddings' rows of RMS 1) and an EAGLE head that is that layer, `fc`
    passing the next token's embedding through: it proposes what the model itself computes a token later (short of
    the context's first token)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("predictor")
    family = Family("llama", root / "m", greedy=False, num_hidden_layers=1)
    path = root / "m" / "model.safetensors"
    tensors = load_file(str(path))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(tensors, str(path))
    family.model = AutoModelForCausalLM.from_pretrained(family.dir, dtype=torch.float32).eval()
    config = family.model.config
    hidden = config.hidden_size
    head = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    del head["layers.0.input_layernorm.weight"]  # (ones, on rows of RMS 1: the head has none)
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    shape = {k: getattr(config, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    layer = LlamaConfig(hidden_size=hidden, vocab_size=config.vocab_size, num_hidden_layers=1, **shape)
    (root / "head").mkdir()
    (root / "head" / "config.json").write_text(layer.to_json_string())
    torch.save(head, root / "head" / "pytorch_model.bin")
    return family, root / "head"


def test_a_head_that_predicts_the_model_is_accepted_several_tokens_a_step(predictor) -> None:
    """The head's drafts are accepted where it predicts the model (here: most tokens), greedy outputs unchanged, a
    prompt sharing a cached prefix drafting as well (the head's keys and values come with the model's blocks)."""
    family, head = predictor
    engine = speculating(family.engine(speculative=method("eagle", head), enable_prefix_caching=True))
    shared = PROMPTS[5][:40]
    prompts = [*PROMPTS, shared + [1, 2, 3], shared + [9, 8, 7, 6]]
    got = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        if i >= len(PROMPTS) - 1:
            got.update(run(engine))
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[str(i)]) == family.hf_greedy(prompt, GREEDY.max_tokens), i
    stats = engine.stats()
    assert stats.prefix_cache_hits_total >= 32, stats
    assert stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total > 0.5, stats
    assert engine.spec_policy.mean_acceptance_length > 2.0, stats
    assert_pool_empty(engine)


def test_under_preemption_and_quantization_outputs_stay_the_plain_engine_s(predictor) -> None:
    """A pool too small for the batch (requests preempted, their held rows dropped) and the head's projections int8
    as the model's: outputs are the plain engine's under the same settings, and the head still drafts the model."""
    family, head = predictor
    settings = {"kv_cache_tokens": 256, "block_size": 8, "max_num_batched_tokens": 64, "quantization": "int8"}
    runs = []
    for speculative in (None, method("eagle", head)):
        engine = family.engine(**settings, **({"speculative": speculative} if speculative else {}))
        if speculative:
            speculating(engine)
        runs.append([c.token_ids for c in engine.generate(PROMPTS, GREEDY)])
        stats = engine.stats()
        assert stats.num_preemptions_total > 0, stats
        if speculative:
            assert stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total > 0.3, stats
            assert not engine.mtp._held and not engine.mtp._outputs
        assert_pool_empty(engine)
    assert runs[0] == runs[1]


def test_what_cannot_draft_is_refused_by_name(tmp_path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="method eagle3 needs draft_model"):
        EngineSpec(speculative={"method": "eagle3"})
    with pytest.raises(ValidationError, match=r"speculative\.method.*eagle drafts with its head.*pipeline_parallel 2"):
        EngineSpec(pipeline_parallel=2, speculative=method("eagle", tmp_path))
    family = Family("llama", tmp_path / "m", greedy=False)  # (2 layers: EAGLE-3's default layers do not exist)
    config = family.model.config
    write_head(tmp_path / "one", config, "eagle")
    with pytest.raises(
        PylonError, match=r"draft_model .*one: holds an EAGLE head .*set engine\.speculative\.method eagle"
    ):
        family.engine(speculative=method("eagle3", tmp_path / "one"))
    write_head(tmp_path / "three", config, "eagle3")
    with pytest.raises(
        PylonError, match=r"default \(2, N // 2, N - 3\) \[2, 1, -1\].*eagle_aux_hidden_state_layer_ids"
    ):
        family.engine(speculative=method("eagle3", tmp_path / "three"))
    other = LlamaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size + 5)
    write_head(tmp_path / "foreign", other, "eagle")
    with pytest.raises(PylonError, match=r"foreign: its vocab_size 325 is not the model's 320"):
        family.engine(speculative=method("eagle", tmp_path / "foreign"))
    with pytest.raises(PylonError, match=r"draft_model .*/m: not an EAGLE head \(no fc\.weight"):
        family.engine(speculative=method("eagle", family.dir))
    gpt2 = Family("gpt2", tmp_path / "gpt2", greedy=False)
    write_head(tmp_path / "gpt2-head", gpt2.model.config, "eagle3", aux=[1, 1, 1])
    with pytest.raises(PylonError, match=r"method eagle3: model gpt2: an EAGLE-3 head reads hidden states inside"):
        gpt2.engine(speculative=method("eagle3", tmp_path / "gpt2-head"))


def test_a_head_in_object_storage_is_read_from_there_and_planned(predictor, s3_root) -> None:
    """`draft_model` an s3:// URI: the engine copies the head (pytorch_model.bin) and drafts with it as from disk;
    `pylon plan` reads its config.json there; a URI with no head behind it is refused naming the field."""
    from pylon import storage
    from pylon.plan.serve import plan_serve
    from pylon.specs import DeploymentSpec

    family, head = predictor
    for path in head.iterdir():
        storage.upload_file(path, f"{s3_root}/{path.name}")
    engine = speculating(family.engine(speculative=method("eagle", s3_root)))
    got = [c.token_ids for c in engine.generate(PROMPTS[:3], GREEDY)]
    assert got == [family.hf_greedy(p, GREEDY.max_tokens) for p in PROMPTS[:3]]
    stats = engine.stats()
    assert stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total > 0.5, stats
    spec = DeploymentSpec(
        name="e", model=family.dir, replica={"num_gpus": 1}, engine={"speculative": method("eagle", s3_root)}
    )
    plan = plan_serve(spec, config=family.model.config, gpu="L40S")
    note = next(n for n in plan.notes if "eagle head" in n)
    planned = int(re.search(r"\(([\d,]+) parameters\)", note).group(1).replace(",", ""))
    held = sum(t.numel() for t in torch.load(head / "pytorch_model.bin").values())
    assert 0 <= planned - held <= family.model.config.hidden_size, (planned, held)  # (fc's bias, which this one lacks)
    with pytest.raises(PylonError, match=r"engine\.speculative\.draft_model s3://.*/none"):
        family.engine(speculative=method("eagle", f"{s3_root}/none"))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_head_in_two_shards_computes_the_whole_head(kind, tmp_path) -> None:
    """engine.tensor_parallel 2: each shard holds its slices of the head's layer (its heads, its MLP's slice; fc, the
    norms and an EAGLE-3 head's output layer whole) beside its shard of the model, and their catch-up and their draft
    fed back give the whole head's logits."""
    from test_tensor_shards import _processes

    family = Family("llama", tmp_path / "m", greedy=False, num_hidden_layers=8)
    write_head(tmp_path / "head", family.model.config, kind, **({"draft_vocab": 96} if kind == "eagle3" else {}))
    args = [str(tmp_path / "head"), kind, json.dumps(PROMPTS[2])]
    (whole,) = _processes(HEAD_SHARDS, family.dir, 1, tmp_path, args)
    shards = _processes(HEAD_SHARDS, family.dir, 2, tmp_path, args)
    assert whole["hidden"].shape[1] == (3 if kind == "eagle3" else 1) * family.model.config.hidden_size
    # (float32 sums in another order: the layers' inputs, in the hundreds on this model, differ by ~2e-6 of their
    # norm, a few in the 6th digit of the largest)
    scale = float(whole["hidden"].abs().max())
    for part in shards:
        torch.testing.assert_close(part["hidden"], whole["hidden"], atol=2e-5 * scale, rtol=1e-4)
        torch.testing.assert_close(part["first"], whole["first"], atol=5e-4, rtol=1e-3)
        torch.testing.assert_close(part["second"], whole["second"], atol=5e-4, rtol=1e-3)
        assert part["first"].argmax(-1).tolist() == whole["first"].argmax(-1).tolist()
        assert part["heads"] * 2 == whole["heads"], (part["heads"], whole["heads"])


def test_served_over_http_a_head_s_drafts_change_no_text(predictor) -> None:
    """A Deployment whose engine drafts with the head (`engine.speculative: {method: eagle, draft_model: ...}`), served
    over HTTP by the replica class Serve runs: the OpenAI client's greedy completions are those of a replica without
    speculation, and the replica's engine speculated to give them."""
    import sys

    import openai

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
    from test_serving_http import KEY, serving

    family, head = predictor
    texts, engines = [], []
    for speculative in (None, method("eagle", head)):
        engine = {"max_num_seqs": 4, "max_model_len": 256, "separate_process": False}
        with serving(family.dir, **engine, **({"speculative": speculative} if speculative else {})) as (url, replica):
            if speculative:  # (the rule told to speculate wherever it can: this machine's timings aside)
                speculating(replica.engine.engine)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
            prompts = ["ROMEO: what light", "First Citizen:\nBefore we proceed"]
            got = [
                client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
                for p in prompts
            ]
            texts.append(got)
            engines.append(replica.engine.stats())
    assert texts[0] == texts[1], texts
    assert engines[1].spec_accepted_tokens_total > 0 and engines[1].spec_draft_model_steps_total > 0, engines[1]
