"""Tensor-parallel shards (engine.tensor_parallel; pylon.serving.model.tensor): two processes, each a runner of one
shard in a gloo group (as the engine's process and its shard actor are), compute what the whole model computes: a
chunked prompt and greedy decodes give the whole runner's logits (to float32 rounding: the all-reduce adds partial
sums in another order) and transformers' greedy tokens, each shard holding half the heads, their KV cache and half
of the MLP. Through Ray actors in a Serve replica: tests/integration/test_serving.py."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from engine_models import PROMPTS, Family, hf_greedy

from pylon.errors import PylonError
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.stages import split_layers
from pylon.serving.model.tensor import Shard, local_config, refused

# DeepSeek-V3 (latent attention split by heads, the latent whole on each shard; experts split, its grouped router, a
# shared expert, a dense first layer; a vocabulary of 321 split 161 + 160; ~13 s); make test-all: Qwen2-MoE (a gated
# shared expert), DeepSeek-V2 (no query low rank, its own router), Llama (grouped-query attention), Qwen3's per-head
# norms and tied embeddings, Qwen2's biased q/k/v projections, Gemma 3's windowed and full layers and its output norms,
# Mixtral's checkpoint names, Qwen3-MoE, GLM-4.5's grouped router and shared experts, dots.llm1, ERNIE 4.5's renamed
# router correction, Phi-3's fused q/k/v and gate/up projections, GLM-4's fused gate/up, ERNIE 4.5, Ministral 3,
# Cohere's side-by-side attention and MLP and per-head key norms, Cohere 2, StarCoder2's c_fc/c_proj with biases.
SHARDED = (
    "deepseek_v3",
    *(
        pytest.param(f, marks=pytest.mark.slow)
        for f in (
            "qwen2_moe",
            "llama",
            "qwen3",
            "qwen2",
            "gemma3_text",
            "mixtral",
            "qwen3_moe",
            "glm4_moe",
            "dots1",
            "ernie4_5_moe",
            "phi3",
            "glm4",
            "ernie4_5",
            "ministral3",
            "cohere",
            "cohere2",
            "starcoder2",
            "gpt_oss",
            "deepseek_v2",
            "olmo2",
            "olmo3",
            "olmoe",
            "flex_olmo",
            "llama4_text",
            "qwen3_next",
            "qwen3_5_text",
            "qwen3_5_moe_text",
        )
    ),
)

_SHARD = """
import json, sys, torch, torch.distributed as dist
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence
from pylon.serving.model.tensor import Shard

directory, rank, count, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
shard = Shard(rank, count, experts=sys.argv[7] == "experts")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=count)
stages = int(sys.argv[8])  # pipeline stages, each of `count` shards: this process holds shard `rank` of each
kwargs = dict(num_blocks=32, block_size=16, dtype="fp32", device="cpu", shard=shard)
if stages == 1:
    runners = [ModelRunner(directory, **kwargs)]
else:
    from transformers import AutoConfig
    from pylon.serving.model.stages import stage_of
    layers = AutoConfig.from_pretrained(directory).num_hidden_layers
    runners = [ModelRunner(directory, stage=stage_of(layers, k, stages), **kwargs) for k in range(stages)]


def execute(steps):  # (through the stages in turn, the first's head last, as PipelineRunner does)
    if stages == 1:
        return runners[0].execute(steps)
    hidden = None
    for runner in runners:
        hidden, _ = runner.execute_step(steps, hidden)
    return runners[0].finish_step(steps, hidden)[0]


prompt = json.loads(sys.argv[6])
logits, table = [], [0, 1, 2, 3]
for start, stop in ((0, 24), (24, len(prompt))):
    logits.append(execute([StepSequence(prompt[start:stop], start, table, samples=stop == len(prompt))]))
tokens = list(prompt)
for _ in range(6):
    tokens.append(int(logits[-1][-1].argmax()))
    logits.append(execute([StepSequence([tokens[-1]], len(tokens) - 1, table, samples=True)]))
kv = [tuple(t.shape) for t in runners[-1].k_cache]
figures = {"logits": logits, "tokens": tokens, "kv": kv, "bytes": sum(r.stage_weights_bytes for r in runners)}
figures["parts"] = [(sorted(r.model.state_dict()), r.stage_weights_bytes) for r in runners]
torch.save(figures, out)
dist.destroy_process_group()
"""


def _processes(script: str, directory: str, count: int, tmp_path, args: list[str]) -> list[dict]:
    """`script` run by `count` processes, rank r's arguments: `directory`, r, `count`, the group's rendezvous file, its
    output file, then `args`; each one's output (what it saved there)."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))  # (a run's own: a test may run several)
    store, outs = work / "store", [work / f"shard{r}.pt" for r in range(count)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, directory, str(r), str(count), str(store), str(outs[r]), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(count)
    ]
    for p in procs:
        output = p.communicate(timeout=300)[0]
        assert p.returncode == 0, output[-4000:]
    return [torch.load(o) for o in outs]


def _compare(
    family: Family, count: int, tmp_path, atol: float = 1e-4, experts: bool = False, stages: int = 1
) -> list[dict]:
    """`count` shards of `family`'s model, each a process, against the whole runner and transformers: a prompt in two
    chunks and 6 greedy decodes give the same logits and tokens. `stages`: of each of that many pipeline stages (a
    process holding its shard of each). Returns each shard's figures."""
    prompt = PROMPTS[2]  # 40 tokens: two chunks, then decodes
    split = ["experts" if experts else "sliced", str(stages)]
    shards = _processes(_SHARD, family.dir, count, tmp_path, [json.dumps(prompt), *split])
    whole = ModelRunner(family.dir, num_blocks=32, block_size=16, dtype="fp32", device="cpu")
    table, tokens = [0, 1, 2, 3], list(prompt)
    from pylon.serving.model.step import StepSequence

    expected = [whole.execute([StepSequence(prompt[0:24], 0, table, samples=False)])]
    expected.append(whole.execute([StepSequence(prompt[24:], 24, table, samples=True)]))
    for _ in range(6):
        tokens.append(int(expected[-1][-1].argmax()))
        expected.append(whole.execute([StepSequence([tokens[-1]], len(tokens) - 1, table, samples=True)]))
    for shard in shards:
        assert shard["tokens"] == tokens
        for got, want in zip(shard["logits"], expected):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)
    assert tokens[len(prompt) :] == family.hf_greedy(prompt, 6)
    whole_bytes = sum(p.numel() * p.element_size() for p in family.model.parameters())
    assert all(shard["bytes"] < 0.8 * whole_bytes for shard in shards), ([s["bytes"] for s in shards], whole_bytes)
    return shards


@pytest.mark.parametrize("name", SHARDED)
def test_two_shards_compute_the_whole_model(name, tmp_path):
    # (DeepSeek-V3's vocabulary 321, not a multiple of 2: the second shard's last lm_head row is padding; below)
    family = Family(name, tmp_path / name, greedy=False, **({"vocab_size": 321} if name == "deepseek_v3" else {}))
    # GPT-OSS: its clamped SwiGLU and sinks carry the all-reduce's other rounding further (up to 2e-3 of logits ~19);
    # Llama 4: its experts' inputs scaled by the router and its L2 query and key norms, to 1.6e-4
    atol = {"gpt_oss": 4e-3, "llama4_text": 5e-4}.get(name, 1e-4)
    shards = _compare(family, 2, tmp_path, atol=atol)
    # each shard: half the key-value heads in its KV cache ([kv heads, blocks, block size, head dim]), about half the
    # layers' weights
    config = family.model.config
    # (DeepSeek's latent attention: every shard caches each token's whole latent and rotated key part, one "head")
    latent = getattr(config, "kv_lora_rank", None)
    kv_heads, kv_dim = (2, latent + config.qk_rope_head_dim) if latent else (config.num_key_value_heads, None)
    for shape in (shape for shard in shards for shape in shard["kv"]):
        assert shape[0] == kv_heads // 2 and shape[-1] == (kv_dim or shape[-1]), shards[0]["kv"]


# make test-all (~11 s each): Llama, DeepSeek-V3's latent attention and experts, Qwen3's tied embeddings (the first
# stage's, its rows split), Gemma 3's windowed and full layers by index. make test serves a Llama in 2 stages of 2
# shards across two machines as transformers (tests/integration/test_hosts.py).
STAGED = tuple(pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "deepseek_v3", "qwen3", "gemma3_text"))


@pytest.mark.parametrize("name", STAGED)
def test_two_pipeline_stages_of_two_shards_compute_the_whole_model(name, tmp_path):
    """engine.pipeline_parallel with engine.tensor_parallel (vLLM's TP x PP): each of two processes holds one shard of
    each of two stages, run one after the other as the stages' groups run (each in its own group there; here both in
    the processes' one): the whole runner's logits and transformers' tokens. Each part holds its stage's layers only
    (the embeddings, final norm and lm_head on the first stage, their rows split too), about half of what the
    stage holds whole."""
    family = Family(name, tmp_path / name, greedy=False)
    shards = _compare(family, 2, tmp_path, stages=2)
    spans = split_layers(family.model.config.num_hidden_layers, 2)

    def stage_of_key(key: str) -> int:  # (outside the layers: the first stage's)
        return next(
            (k for k, span in enumerate(spans) if key.startswith("model.layers.") and int(key.split(".")[2]) in span), 0
        )

    whole = [0, 0]  # each stage's bytes in the whole model (a tied lm_head once)
    for key, p in family.model.named_parameters():
        whole[stage_of_key(key)] += p.numel() * p.element_size()
    for figures in shards:
        for k, (keys, held) in enumerate(figures["parts"]):
            layers = {int(key.split(".")[2]) for key in keys if key.startswith("model.layers.")}
            assert layers == set(spans[k]), (k, layers)
            assert any("embed_tokens" in key for key in keys) == any("lm_head" in key for key in keys) == (k == 0)
            assert held < 0.75 * whole[k], (k, held, whole)  # (about half: norms, routers and latents whole)


_CLASSIFIER = """
import json, sys, torch, torch.distributed as dist
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence
from pylon.serving.model.tensor import Shard

directory, rank, count, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
prompts, tokens = json.loads(sys.argv[6]), json.loads(sys.argv[7])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=count)
runner = ModelRunner(
    directory, num_blocks=32, block_size=16, dtype="fp32", device="cpu", shard=Shard(rank, count),
    classifier_from_token=tokens,
)
pooled = [runner.execute_step([StepSequence(p, 0, [0, 1, 2, 3], samples=True, pooled=True)])[1][0] for p in prompts]
torch.save({"pooled": pooled, "bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters())}, out)
"""


@pytest.mark.parametrize("kind", ["reward-model", pytest.param("from-token", marks=pytest.mark.slow)])  # ~12 s each
def test_two_shards_of_a_classifier_score_as_the_whole_model(kind, tmp_path):
    """A reward model (LlamaForSequenceClassification, three labels: its `score` head whole on every shard, read from
    the checkpoint) and a causal LM scoring by its tokens' logits (engine.classifier_from_token ["n", "y"]: the
    tokens' lm_head rows read whole, whichever shard holds them) in two shards, each a process: every prompt's
    outputs are the whole runner's (and the reward model's transformers' own), each shard holding about half of the
    layers' weights."""
    from test_classifier_engine import save_classifier

    directory = tmp_path / kind
    if kind == "reward-model":
        model, tokens = save_classifier("llama", directory), []
    else:
        model, tokens = Family("llama", directory, greedy=False).model, [ord("n"), ord("y")]
    prompts = [p[:60] for p in PROMPTS[:4]]

    shards = _processes(_CLASSIFIER, str(directory), 2, tmp_path, [json.dumps(prompts), json.dumps(tokens)])
    runner = ModelRunner(
        str(directory), num_blocks=32, block_size=16, dtype="fp32", device="cpu", classifier_from_token=tokens
    )
    from pylon.serving.model.step import StepSequence

    whole = {
        "pooled": [
            runner.execute_step([StepSequence(p, 0, [0, 1, 2, 3], samples=True, pooled=True)])[1][0] for p in prompts
        ],
        "bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
    }
    for figures in shards:
        for got, want in zip(figures["pooled"], whole["pooled"]):
            assert got.shape == want.shape == (len(tokens) and 1 or 3,)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert figures["bytes"] < 0.75 * whole["bytes"], (figures["bytes"], whole["bytes"])
    if kind == "reward-model":
        with torch.no_grad():
            for got, p in zip(shards[0]["pooled"], prompts):
                want = model(torch.tensor([p], device=model.device)).logits[0].float().cpu()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


EXPERT_PARALLEL = (
    "deepseek_v3",
    "qwen2_moe",
    "ernie4_5_moe",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v2",
    "glm4_moe",
    "dots1",
    "olmoe",
    "flex_olmo",
)


@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_with_expert_parallelism_each_shard_holds_half_the_experts_whole(name, tmp_path):
    """engine.expert_parallel: each of two shards holds half of the experts at their full width (shard 1 the first
    half), the router whole (its correction bias too: DeepSeek's a buffer, ERNIE's `[1, experts]`), the attention,
    dense MLPs and shared experts sliced as without it (DeepSeek's shared expert, as wide as an expert, rebuilt
    sliced; Qwen2-MoE's gated one; GPT-OSS's experts stored [in, out], interleaved, biased). In make test-all the
    shards compute the whole model (below)."""
    from pylon.serving.model.tensor import load_shard, num_experts

    family = Family(name, tmp_path / name, greedy=False)
    config = family.model.config
    experts = num_experts(config)
    # (the first MoE layer: DeepSeek's, GLM-4.5's, dots.llm1's and ERNIE's first layers are dense)
    moe = next(i for i, layer in enumerate(family.model.model.layers) if hasattr(layer.mlp, "experts"))
    whole = family.model.model.layers[moe].mlp
    shared = getattr(whole, "shared_experts", None) or getattr(whole, "shared_expert", None)
    for r in range(2):
        shard = load_shard(family.dir, config, torch.float32, Shard(r, 2, experts=True))
        block = shard.model.layers[moe].mlp
        half = slice(r * experts // 2, (r + 1) * experts // 2)
        assert torch.equal(block.experts.gate_up_proj, whole.experts.gate_up_proj[half])
        assert torch.equal(block.experts.down_proj, whole.experts.down_proj[half])
        router, full = (getattr(m, "router", None) or m.gate for m in (block, whole))
        assert torch.equal(router.weight, full.weight)
        for name_, buffer in full.named_buffers():
            assert torch.equal(block.get_buffer(f"{'router' if hasattr(block, 'router') else 'gate'}.{name_}"), buffer)
        if shared is not None:
            held = getattr(block, "shared_experts", None) or block.shared_expert
            rows = held.up_proj.weight.shape[0]
            assert rows * 2 == shared.up_proj.weight.shape[0]
            assert torch.equal(held.up_proj.weight, shared.up_proj.weight[r * rows : (r + 1) * rows])
            assert torch.equal(held.down_proj.weight, shared.down_proj.weight[:, r * rows : (r + 1) * rows])


@pytest.mark.slow  # make test-all (~12 s each): two processes
@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_with_expert_parallelism_the_shards_compute_the_whole_model(name, tmp_path):
    family = Family(name, tmp_path / name, greedy=False)
    _compare(family, 2, tmp_path, atol=4e-3 if name == "gpt_oss" else 1e-4, experts=True)


def test_four_shards_of_two_key_value_heads_read_their_query_heads_head(tmp_path):
    """More shards than key-value heads (Qwen3-30B-A3B's 4 in 8 shards): each shard reads the one head its query heads
    attend with (shards 1-2 the first, 3-4 the second), its key and value rows exactly the checkpoint's."""
    from pylon.serving.model.tensor import kv_replicas, load_shard

    family = Family("llama", tmp_path / "llama", greedy=False)
    config = family.model.config
    assert (config.num_attention_heads, config.num_key_value_heads, kv_replicas(config, 4)) == (4, 2, 2)
    attention = family.model.model.layers[0].self_attn
    size = attention.k_proj.weight.shape[0] // 2
    for r in range(4):
        held = load_shard(family.dir, config, torch.float32, Shard(r, 4)).model.layers[0].self_attn
        head = slice((r // 2) * size, (r // 2 + 1) * size)
        assert torch.equal(held.k_proj.weight, attention.k_proj.weight[head]), r
        assert torch.equal(held.v_proj.weight, attention.v_proj.weight[head]), r
        assert held.q_proj.weight.shape[0] == size  # (one query head each)


# make test-all (4 processes, ~22 s each): the shards' arithmetic with replicated heads: Llama; Phi-3 (the heads in its
# fused qkv_proj), Cohere (a key norm weight per head).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "phi3", "cohere", "olmo2"])
def test_four_shards_of_two_key_value_heads_hold_one_each_as_their_query_heads_group(name, tmp_path):
    """More shards than key-value heads: each shard holds the one head its query heads attend with, replicated, and
    the shards still compute the whole model."""
    from pylon.serving.model.tensor import kv_replicas

    family = Family(name, tmp_path / name, greedy=False)
    config = family.model.config
    assert (config.num_attention_heads, config.num_key_value_heads, kv_replicas(config, 4)) == (4, 2, 2)
    shards = _compare(family, 4, tmp_path)
    assert all(shape[0] == 1 for shard in shards for shape in shard["kv"]), shards[0]["kv"]


def test_each_shard_holds_its_share_of_the_vocabulary_the_last_padded(tmp_path):
    """The embeddings and the lm_head (one matrix, tied, as Qwen3's) are split by vocabulary rows: a vocabulary of 321
    in 2 shards gives each 161 rows (the second's last a zero row past the vocabulary). An id's embedding comes from
    the shard holding it and the logits of both are gathered into the whole 321, the padding dropped: the shards
    compute the whole model (Qwen3 in make test-all, below; DeepSeek-V3's 2 shards in make test have a vocabulary of
    321 too, untied)."""
    from pylon.serving.model.tensor import load_shard

    family = Family("qwen3", tmp_path / "qwen3", greedy=False, vocab_size=321)
    config = family.model.config
    assert config.tie_word_embeddings
    embeddings = family.model.model.embed_tokens.weight
    for r in range(2):
        shard = load_shard(family.dir, config, torch.float32, Shard(r, 2))
        held = shard.model.embed_tokens.weight
        assert held.shape == (161, config.hidden_size) and shard.config.vocab_size == 321
        assert torch.equal(held[: 321 - 161 * r], embeddings[161 * r : 161 * (r + 1)])
        assert r == 0 or not held[160].any()  # (the padding row)
        assert shard.lm_head.weight is held  # (tied)


@pytest.mark.slow  # make test-all (~10 s)
def test_shards_of_a_tied_vocabulary_not_a_multiple_of_their_count_compute_the_whole_model(tmp_path):
    family = Family("qwen3", tmp_path / "qwen3", greedy=False, vocab_size=321)
    shards = _compare(family, 2, tmp_path)
    assert all(len(row) == 321 for shard in shards for logits in shard["logits"] for row in logits)


def test_what_cannot_be_split_is_refused_by_name(tmp_path):
    family = Family("llama", tmp_path / "llama", greedy=False)
    config = family.model.config
    assert refused("llama", config, 2) is None
    assert "do not split into 3 equal shards" in refused("llama", config, 3)
    assert "the gpt2 family is not split for tensor parallelism" in refused("gpt2", config, 2)
    quantized = local_config(config, 1)
    quantized.quantization_config = {"quant_method": "mxfp4"}  # (GPT-OSS's checkpoints as published)
    assert "its checkpoint is quantized (mxfp4)" in refused("gpt_oss", quantized, 2)
    assert "divides the experts of mixtral, qwen2_moe, qwen3_moe, gpt_oss, glm4_moe, dots1, ernie4_5_moe, " in refused(
        "llama", config, 2, experts=True
    )
    six = Family("qwen2_moe", tmp_path / "qwen2_moe", greedy=False).model.config  # 6 experts
    assert refused("qwen2_moe", six, 2, experts=True) is None
    assert "its 6 experts do not divide among 4 shards" in refused("qwen2_moe", six, 4, experts=True)
    # DeepSeek: its shared expert, as wide as an expert, is sliced while the experts stay whole
    latent = local_config(Family("deepseek_v3", tmp_path / "v3", greedy=False).model.config, 1)
    assert refused("deepseek_v3", latent, 4, experts=True) is None
    latent.moe_intermediate_size = 66
    assert refused("deepseek_v3", latent, 4) is not None and refused("deepseek_v3", latent, 2, experts=True) is None
    assert "its 66 shared experts' width do not split into 4" in refused("deepseek_v3", latent, 4, experts=True)
    local = local_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 172)
    assert local.head_dim == config.hidden_size // config.num_attention_heads
    assert refused("llama", config, 4) is None  # (one key-value head each, replicated)
    other = local_config(config, 1)
    other.num_attention_heads, other.num_key_value_heads, other.head_dim = 12, 4, 32  # 6 shards: 2 heads each
    assert "its 4 key-value heads neither split into 6 equal shards nor" in refused("llama", other, 6)
    with pytest.raises(
        PylonError, match=r"engine.tensor_parallel: model .*: its 4 attention heads do not split into 3"
    ):
        ModelRunner(family.dir, num_blocks=4, block_size=16, dtype="fp32", device="cpu", shard=Shard(0, 3))


def test_a_replica_of_shards_asks_for_a_bundle_a_shard_all_on_one_node():
    from pylon.serving.api.builder import pipeline_placement
    from pylon.specs import DeploymentSpec

    spec = DeploymentSpec(
        name="m",
        model="s3://b/m",
        engine={"tensor_parallel": 4, "device": "cuda"},
        replica={"num_cpus": 2, "num_gpus": 1},
    )
    assert pipeline_placement(spec) == {
        "placement_group_bundles": [{"CPU": 2, "GPU": 1}] * 4,
        "placement_group_strategy": "STRICT_PACK",
    }


def _whole_experts(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    experts = model.model.layers[layer].mlp.experts
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


@pytest.mark.parametrize("fused", [False, True], ids=["each-expert", "fused"])
def test_shards_of_an_moe_model_hold_a_slice_of_every_expert(fused, tmp_path):
    """Mixtral's checkpoint names each expert's projections apart (`block_sparse_moe.experts.{e}.w1.weight`); one saved
    with transformers' fused names is read too: either way the two shards' experts, side by side, are the whole
    model's (gate rows, up rows, down columns), the router every shard's whole, the experts' width halved."""
    from safetensors.torch import save_file

    from pylon.serving.model.tensor import load_shard

    family = Family("mixtral", tmp_path / "mixtral", greedy=False)
    if fused:  # the model's own names: experts.gate_up_proj [experts, 2 x width, hidden], experts.down_proj
        state = {k: v.contiguous() for k, v in family.model.state_dict().items()}
        save_file(state, str(tmp_path / "mixtral" / "model.safetensors"))
    config = family.model.config
    shards = [load_shard(family.dir, config, torch.float32, Shard(r, 2)) for r in range(2)]
    width = config.intermediate_size // 2
    assert all(s.config.intermediate_size == width for s in shards)
    for layer in range(config.num_hidden_layers):
        gate_up, down = _whole_experts(family.model, layer)
        parts = [_whole_experts(s, layer) for s in shards]
        full = config.intermediate_size
        gates = torch.cat([p[0][:, :width] for p in parts], dim=1)
        ups = torch.cat([p[0][:, width:] for p in parts], dim=1)
        torch.testing.assert_close(gates, gate_up[:, :full], rtol=0, atol=0)
        torch.testing.assert_close(ups, gate_up[:, full:], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts], dim=2), down, rtol=0, atol=0)
        router = family.model.model.layers[layer].mlp.gate.weight
        assert all(torch.equal(s.model.layers[layer].mlp.gate.weight, router) for s in shards)


def test_an_moe_checkpoint_whose_experts_do_not_fit_the_config_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from pylon.serving.model.tensor import load_shard

    family = Family("qwen2_moe", tmp_path / "m", greedy=False)
    path = str(tmp_path / "m" / "model.safetensors")
    state = load_file(path)
    key = "model.layers.0.mlp.experts.2.up_proj.weight"
    state[key] = state[key][:-2]  # two rows short
    save_file(state, path)
    config = family.model.config
    with pytest.raises(PylonError, match=rf"{key}: its shape \[62, 128\] is not the \[64, 128\]"):
        load_shard(family.dir, config, torch.float32, Shard(1, 2))
    del state[key]
    save_file(state, path)
    with pytest.raises(
        PylonError, match=r"1 of its tensors are not in the checkpoint .*layers.0.mlp.experts.gate_up_proj"
    ):
        load_shard(family.dir, config, torch.float32, Shard(0, 2))


_ADAPTED_SHARD = """
import json, sys, torch, torch.distributed as dist
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence
from pylon.serving.model.tensor import Shard

directory, rank, count, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
adapters, prompts = json.loads(sys.argv[6]), json.loads(sys.argv[7])
shard = Shard(rank, count) if count > 1 else None
if shard is not None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=count)
runner = ModelRunner(
    directory, num_blocks=32, block_size=16, dtype="fp32", device="cpu", shard=shard, adapters=adapters[:2]
)
tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
slots = [0, 1, 2, 1]  # the base model and two adapters in one step, an adapter on some rows only
logits = [runner.execute([StepSequence(p, 0, t, samples=True, adapter=a) for p, t, a in zip(prompts, tables, slots)])]
tokens = [list(p) for p in prompts]
for _ in range(4):
    for seq, row in zip(tokens, logits[-1]):
        seq.append(int(row.argmax()))
    steps = [StepSequence([s[-1]], len(s) - 1, t, samples=True, adapter=a) for s, t, a in zip(tokens, tables, slots)]
    logits.append(runner.execute(steps))
# loaded on demand (engine.dynamic_adapters): read, then placed in slot 3
runner.put_adapter(3, runner.read_adapter(adapters[2]))
logits.append(runner.execute([StepSequence(prompts[0], 0, [12, 13], samples=True, adapter=3)]))
sizes = [{m: (tuple(a.shape), tuple(b.shape)) for m, (a, b) in ad.weights.items()} for ad in runner.adapter_set.adapters]
torch.save({"logits": logits, "tokens": tokens, "sizes": sizes}, out)
if shard is not None:
    dist.destroy_process_group()
"""

ADAPTER_TARGETS = {
    "llama": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "phi3": (["qkv_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "deepseek_v3": (["o_proj"], ["o_proj"]),  # (its latent attention's other projections are absorbed at load)
}


# make test-all (~22 s each: three processes); make test checks each shard's slices in-process (below)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "phi3", "deepseek_v3"])
def test_shards_serve_lora_adapters_each_holding_its_slice_of_their_matrices(name, tmp_path):
    """engine.adapters (and dynamic_adapters) with tensor-parallel shards: each shard holds its slice of an adapter's
    matrices (B's rows of its heads and MLP slice for the column-parallel projections, A's columns for the row-parallel
    ones, whose low-rank partial sums are all-reduced); a step mixing the base model and two adapters, one on some of
    its rows only, then decodes, and an adapter placed on demand, give the whole runner's logits with them and peft's
    greedy tokens. make test-all: Phi-3, its fused qkv_proj and gate_up_proj adapted part by part; DeepSeek-V3, its
    latent attention's o_proj."""
    from test_lora_engine import save_adapter

    family = Family(name, tmp_path / name, greedy=False)
    attention, everything = ADAPTER_TARGETS[name]
    dirs, peft = [], []
    for adapter, seed, config in (
        ("terse", 1, {"r": 4, "lora_alpha": 8, "target_modules": attention}),
        ("wordy", 2, {"r": 8, "lora_alpha": 16, "target_modules": everything, "use_rslora": True}),
        ("late", 3, {"r": 4, "lora_alpha": 8, "target_modules": everything}),
    ):
        dirs.append(str(tmp_path / adapter))
        peft.append(save_adapter(family.dir, dirs[-1], seed, **config))
    prompts = [PROMPTS[0][:20], PROMPTS[1][:20], PROMPTS[2][:20], PROMPTS[3][:20]]

    def run(count: int) -> list[dict]:
        outs = [tmp_path / f"{count}-{r}.pt" for r in range(count)]
        args = [family.dir, "", str(count), str(tmp_path / f"store{count}"), "", json.dumps(dirs), json.dumps(prompts)]
        procs = []
        for r in range(count):
            args[1], args[4] = str(r), str(outs[r])
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _ADAPTED_SHARD, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        for p in procs:
            output = p.communicate(timeout=300)[0].decode()
            assert p.returncode == 0, output[-4000:]
        return [torch.load(o) for o in outs]

    (whole,) = run(1)
    shards = run(2)
    for shard in shards:
        assert shard["tokens"] == whole["tokens"]
        for got, want in zip(shard["logits"], whole["logits"]):
            # (float32 sums in another order, of logits the adapters' large B make large: to their scale)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5 * float(want.abs().max()))
    # a shard's adapter matrices: half of B's rows (column parallel), half of A's columns (row parallel)
    wordy = shards[0]["sizes"][1]
    full = whole["sizes"][1]
    for module, (a, b) in wordy.items():
        (fa, fb) = full[module]
        if module.endswith(("o_proj", "down_proj")):
            assert a == (fa[0] // 2, fa[1]) and b == fb, module  # (kept as A^T [in, r], B^T [r, out])
        else:
            assert a == fa and b == (fb[0], fb[1] // 2), module
    references = [family.model, peft[0], peft[1], peft[0]]
    for seq, prompt, model in zip(whole["tokens"], prompts, references):
        want = hf_greedy(model, prompt, 4)  # (up to the eos, where peft's stops)
        assert seq[len(prompt) : len(prompt) + len(want)] == want, prompt
    # the adapter placed on demand: the prompt's next token as peft computes it
    assert int(shards[0]["logits"][-1][-1].argmax()) == hf_greedy(peft[2], prompts[0], 1)[0]


def _conditional(name: str):
    """A tiny multimodal checkpoint of `name`'s kind, as it ships: Llama 4's (a whole causal LM under
    language_model.*), Gemma 3's and Mistral 3's (language_model.model.*), Qwen3.5's (model.language_model.*, its
    recurrent layers), each beside a vision model (test_model_families' fixtures)."""
    from test_model_families import _multimodal

    torch.manual_seed(0)
    return _multimodal(name)[0]


@pytest.mark.slow  # make test-all (~20 s each): two processes
@pytest.mark.parametrize("name", ["llama4", "gemma3", "mistral3", "qwen3_5"])
def test_a_multimodal_checkpoint_is_split_for_its_text(name, tmp_path):
    """Llama 4 Scout and Maverick, Gemma 3, Mistral Small 3.1 and Qwen3.5 ship as conditional models (a vision model
    beside the language model): two shards read their slices of the language model's tensors under its prefix (Llama
    4's experts stored [experts, in, out], gate then up), never the vision model's, and compute what the whole runner
    and the conditional model compute on text."""
    from pylon.data.tokenizer import ByteTokenizer

    model = _conditional(name).eval()
    directory = tmp_path / name
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(ByteTokenizer().info.model_dump(mode="json")))

    class Multimodal:  # (what `_compare` reads of a Family)
        dir = str(directory)

        def __init__(self):
            self.model = model

        def hf_greedy(self, prompt, n):
            return hf_greedy(model, prompt, n)

    _compare(Multimodal(), 2, tmp_path, atol=5e-4)


def test_each_shard_holds_its_slice_of_an_adapters_matrices(tmp_path):
    """engine.adapters with shards, in-process (the arithmetic through processes: make test-all, above): checked
    against the whole model's projections, each of two shards keeps B's rows of its heads and MLP slice for the
    column-parallel projections (q/k/v, gate/up: its key-value head's rows where the heads are few) and A's columns for
    the row-parallel ones (o, down), the other matrix whole."""
    from test_lora_engine import save_adapter

    from pylon.serving.model.lora import load_adapter, projection_shapes
    from pylon.serving.model.tensor import adapter_split, load_shard, whole_shapes

    family = Family("llama", tmp_path / "llama", greedy=False)
    config = family.model.config
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    save_adapter(family.dir, str(tmp_path / "lora"), 1, r=4, lora_alpha=8, target_modules=targets)
    whole = load_adapter(str(tmp_path / "lora"), "llama", projection_shapes(family.model, "llama"))
    for r in range(2):
        shard = Shard(r, 2)
        shapes = projection_shapes(load_shard(family.dir, config, torch.float32, shard), "llama")
        split = adapter_split(config, shard, shapes)
        held = load_adapter(str(tmp_path / "lora"), "llama", whole_shapes(config, "llama"), split=split)
        assert held.weights.keys() == whole.weights.keys()
        for module, (a, b) in held.weights.items():
            (wa, wb), rows = whole.weights[module], shapes[module]
            if module.endswith(("o_proj", "down_proj")):  # (kept as A^T [in, r]: the shard's rows of its inputs)
                n = rows[0]
                assert torch.equal(a, wa[r * n : (r + 1) * n]) and torch.equal(b, wb), module
            else:  # (B^T [r, out]: the shard's columns of the outputs; one key-value head each)
                n = rows[1]
                assert torch.equal(a, wa) and torch.equal(b, wb[:, r * n : (r + 1) * n]), module
