"""What the engine tests share: tiny random GPT-2 and Llama models saved as Pylon exports (safetensors +
pylon_tokenizer.json for the byte tokenizer), `transformers`' own greedy continuations of fixed prompts, and small
helpers. `PYLON_TEST_DEVICE=cuda` (`make test-gpu`) runs them on a GPU."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.specs import EngineSpec

# Where the engines and the reference models run: `make test-gpu` sets PYLON_TEST_DEVICE=cuda on a machine with a
# GPU (the CUDA path: decode attention through PyTorch, not the CPU kernel); everywhere else, the CPU.
DEVICE = os.environ.get("PYLON_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"PYLON_TEST_DEVICE must be cpu or cuda (got {DEVICE!r})")
ON_CUDA = DEVICE == "cuda"
# head_dim 32: the CPU decode kernel's vectorised path (pylon.serving.model.kernels), as real models take it.
FAMILIES = {
    "gpt2": {"n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 256, "vocab_size": 320},
    "llama": {
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "vocab_size": 320,
    },
}
# Qwen3-Next's and Qwen3.5's layers at a tiny size (three recurrent, then attention; Gated DeltaNet of 2 key heads
# and 4 value heads of 16), and their MoE blocks (4 experts, top 2, a gated shared expert): LLAMA_LIKE below.
_DELTANET = {
    **FAMILIES["llama"],
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_SHARED_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
# DeepSeek's latent attention and MoE blocks at a tiny size: both DeepSeek fixtures' shared part (LLAMA_LIKE below).
_LATENT = {
    **FAMILIES["llama"],
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
# The families built as Llama is (pylon.serving.model.families), each at a shape that exercises what sets it apart:
# Qwen2's projection biases, Qwen3's per-head query and key norms, its head_dim apart from hidden_size / heads (32 x 4
# heads over a hidden size of 96) and its tied embeddings; Gemma 3's as its 1B checkpoint is laid out (layer_types from
# its config's rule: every 6th layer full, the rest windowed, the last one too), a window narrower than most prompts,
# the windowed layers' rotary base (rope_local_base_freq) apart from the full ones' (rope_theta), an attention scale
# (query_pre_attn_scalar) apart from head_dim's, and soft-capped logits (the checkpoints leave the cap null; set here,
# it changes the log-probabilities, not the argmax); Gemma's head_dim apart from hidden_size / heads; Gemma 2's
# windowed and full layers by turns (the last one full) and its attention scores soft-capped at 10 (its checkpoints'
# 50 would rarely bind on a random model this small; at 10 the cap changes every continuation); Granite's four
# multipliers off 1 (and its attention's off head_dim's scale); OLMo 2 as it is (output norms only, whole-projection
# query and key norms); SmolLM3 with every other layer NoPE (its checkpoints: every fourth); StarCoder2 as it is
# (LayerNorms, biases, a plain GELU MLP); Phi-3's fused projections (qkv_proj with fewer key and value heads
# than query heads, so that its three parts differ in size; gate_up_proj) and a partial rotary embedding (16 of each
# head's 32 dimensions rotated, as Phi-4-mini rotates 96 of 128); the mixture-of-experts families with fewer experts
# than their checkpoints (Mixtral 8x7B: 8, top 2; Qwen1.5-MoE-A2.7B: 60, top 4, with a shared expert, router weights
# not renormalised; Qwen3-30B-A3B: 128, top 8, renormalised), each expert picked by some prompt token: Mixtral's 4,
# top 2; Qwen2-MoE's 6, top 2, its shared expert and, in layer 1, a dense MLP (mlp_only_layers, as some checkpoints
# set); Qwen3-MoE's 8, top 3, renormalised, on Qwen3's attention. Their tests: test_model_families.py.
LLAMA_LIKE = {
    "mistral": FAMILIES["llama"],
    "qwen2": FAMILIES["llama"],
    "qwen3": {**FAMILIES["llama"], "hidden_size": 96, "head_dim": 32, "tie_word_embeddings": True},
    "gemma3_text": {
        **FAMILIES["llama"],
        "num_hidden_layers": 7,
        "head_dim": 32,
        "sliding_window": 16,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 100.0,
        "query_pre_attn_scalar": 20,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": False,  # tied, a random model at this scale repeats its last token: its embedding wins
    },
    "gemma": {**FAMILIES["llama"], "hidden_size": 96, "head_dim": 32, "tie_word_embeddings": False},
    "gemma2": {
        **FAMILIES["llama"],
        "num_hidden_layers": 4,
        "head_dim": 32,
        "sliding_window": 16,
        "query_pre_attn_scalar": 20,
        "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": False,
    },
    "phi3": {**FAMILIES["llama"], "partial_rotary_factor": 0.5},
    "granite": {
        **FAMILIES["llama"],
        "embedding_multiplier": 3.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    },
    "olmo2": FAMILIES["llama"],
    # OLMo 3 as its checkpoints lay it out (every 4th layer full), a window of 16, YaRN in the full layers only
    "olmo3": {
        **FAMILIES["llama"],
        "num_hidden_layers": 4,
        "sliding_window": 16,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.2,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "smollm3": {**FAMILIES["llama"], "num_hidden_layers": 4, "no_rope_layer_interval": 2},
    "starcoder2": FAMILIES["llama"],
    # Cohere (Command R+) with its per-head query and key LayerNorms; Cohere 2 (Command R7B) with every 4th layer full
    # and unrotated, as its checkpoints. Both scale their logits (Command R's 0.0625); untied, as Gemma's fixtures.
    "cohere": {**FAMILIES["llama"], "use_qk_norm": True, "logit_scale": 0.25, "tie_word_embeddings": False},
    "cohere2": {
        **FAMILIES["llama"],
        "num_hidden_layers": 4,
        "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "logit_scale": 0.25,
        "tie_word_embeddings": False,
    },
    "mixtral": {**FAMILIES["llama"], "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        **FAMILIES["llama"],
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        **FAMILIES["llama"],
        "hidden_size": 96,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    # GLM-4 (GLM-4-9B-0414) as it is: biased query, key and value projections, half of each head rotated by
    # interleaved pairs, its fused MLP and four norms a layer.
    "glm4": {**FAMILIES["llama"], "head_dim": 32, "attention_bias": True, "partial_rotary_factor": 0.5},
    # Llama up to their modules: Seed-OSS with biases on every attention projection; ERNIE 4.5 and Helium rotating
    # interleaved pairs; Arcee's gateless ReLU^2 MLP; Ministral's window (every layer, by layer_types); Ministral 3's
    # queries scaled past 32 positions (its checkpoints: 16384) by a beta of 0.5 (its checkpoints': 0.1); HunYuan's
    # query and key norms after the rotation; EXAONE 4's output norms and three windowed layers in four.
    "seed_oss": {**FAMILIES["llama"], "attention_bias": True, "attention_out_bias": True},
    "ernie4_5": FAMILIES["llama"],
    "helium": {**FAMILIES["llama"], "head_dim": 32},
    "arcee": FAMILIES["llama"],
    "ministral": {**FAMILIES["llama"], "head_dim": 32, "num_hidden_layers": 3, "sliding_window": 16},
    "ministral3": {
        **FAMILIES["llama"],
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.5,
            "original_max_position_embeddings": 32,
        },
    },
    "hunyuan_v1_dense": {**FAMILIES["llama"], "head_dim": 32, "use_qk_norm": True},
    "exaone4": {**FAMILIES["llama"], "num_hidden_layers": 4, "sliding_window": 16},
    # OLMoE (64 experts, top 8, not renormalised) and FlexOlmo: 8 experts, top 2, on OLMo's attention; dots.llm1 (128
    # experts, top 6, DeepSeek-V3's router): the GLM-4.5 fixture's experts on Qwen3's attention.
    "olmoe": {
        **FAMILIES["llama"],
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    "flex_olmo": {
        **FAMILIES["llama"],
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    "dots1": {
        **FAMILIES["llama"],
        "head_dim": 32,
        "num_hidden_layers": 3,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
    },
    # GLM-4.5 (GLM-4.5-Air: 128 experts, top 8, 1 group; the first layer dense; a shared expert; scaling 1): 8 experts
    # in 2 groups, the best 1 group's experts eligible, top 3, scaled by 2.5, its correction bias off zero (the
    # fixture's), per-head query and key norms (use_qk_norm, as GLM-4.5's) and half of each head rotated.
    "glm4_moe": {
        **FAMILIES["llama"],
        "head_dim": 32,
        "num_hidden_layers": 3,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    # DeepSeek-V3 (671B: 128 heads, a query rank of 1536, a latent of 512 and 64 rotated dimensions, keys' other
    # parts 128 and values 128; 256 experts in 8 groups, the best 4 eligible, top 8; 3 dense layers; YaRN x40): 4
    # heads, a query rank of 48, a latent of 32 and 16 rotated dimensions, keys' other parts 32 and values 24 (apart, so
    # that the halves of kv_b_proj cannot be swapped unseen), GLM-4.5's fixture's experts, YaRN x4 with its mscale.
    "deepseek_v3": {
        **_LATENT,
        "q_lora_rank": 48,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # DeepSeek-V2-Lite (16B: no query rank, a latent of 512, 64 experts, top 6, greedy): its latent attention at the
    # DeepSeek-V3 fixture's sizes without a query rank, and 8 experts in 2 groups routed "group_limited_greedy" (as
    # DeepSeek-V2's 236B), top 3, scaled by 2.
    "deepseek_v2": {
        **_LATENT,
        "q_lora_rank": None,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 2.0,
    },
    # Qwen3-Next (80B-A3B: 48 layers, three recurrent in four, 512 experts, top 10, a gated shared expert): 4 layers
    # (layer 3 attention), 4 experts, top 2; its Gated DeltaNet with 2 key heads and 4 value heads of 16
    "qwen3_next": {**_DELTANET, **_SHARED_MOE},
    # Qwen3.5, dense and MoE: Qwen3-Next's shape (their recurrent layers' projections apart)
    "qwen3_5_text": {**_DELTANET, "tie_word_embeddings": False},
    "qwen3_5_moe_text": {**_DELTANET, **_SHARED_MOE, "tie_word_embeddings": False},
    # ERNIE 4.5 MoE (21B-A3B: 64 experts, top 6, 2 shared, layer 0 dense): 8 experts, top 2, one shared, layer 0
    # dense, as its checkpoints lay them out
    "ernie4_5_moe": {
        **FAMILIES["llama"],
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "use_bias": True,
    },
    # Apertus as it is: per-head query and key norms, a gateless MLP with xIELU
    "apertus": {**FAMILIES["llama"], "tie_word_embeddings": False},
    # Llama 4 (Scout: 16 experts, top 1, every layer MoE; Maverick: 128, MoE every other layer; chunks of 8192, every
    # 4th layer NoPE with its queries scaled past floor_scale 8192): 4 experts, top 1, MoE in layers 1 and 3, chunks of
    # 16 in layers 0-2, layer 3 NoPE, its queries scaled from position 7 on (floor_scale 8, attn_scale 0.5).
    "llama4_text": {
        **FAMILIES["llama"],
        "intermediate_size": 32,
        "intermediate_size_mlp": 96,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 16,
        "floor_scale": 8,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # GPT-OSS (gpt-oss-20b: 32 experts, top 4, a window of 128 in every other layer, YaRN over 4096 positions): 4
    # experts, top 2, a window of 16 in layers 0 and 2, YaRN over 64 positions (its attention scaling off 1), and the
    # SwiGLU's clamp at 1 (its checkpoints' 7 would rarely bind on a random model this small; at 1 it changes every
    # continuation).
    "gpt_oss": {
        **FAMILIES["llama"],
        "intermediate_size": 64,
        "head_dim": 32,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "swiglu_limit": 1.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
}
PROMPT_LENGTHS = (3, 17, 40, 90, 5, 64, 33, 8)
NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


def spec(**fields) -> EngineSpec:
    """The tests' engine: small, on DEVICE, in fp32 as the reference computes (`auto` would be bf16 on a GPU)."""
    return EngineSpec(
        **{
            "max_num_seqs": 8,
            "max_num_batched_tokens": 256,
            "kv_cache_tokens": 2048,
            "block_size": 16,
            "max_model_len": 256,
            "device": DEVICE,
            "dtype": "fp32",
            **fields,
        }
    )


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


PROMPTS = make_prompts()


def hf_greedy(model, prompt: list[int], new_tokens: int, min_tokens: int = 0) -> list[int]:
    """`model`'s (`transformers`' or peft's) greedy continuation of `prompt`, stopping at the byte tokenizer's eos (not
    before `min_tokens`)."""
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=min_tokens,
        do_sample=False,
        eos_token_id=256,
        pad_token_id=257,
    )
    return out[0, len(prompt) :].tolist()


class Family:
    """A tiny random model saved as a Pylon export, and `transformers`' greedy continuation of each prompt."""

    def __init__(self, name: str, directory: Path, initializer_range: float = 0.5, greedy: bool = True, **overrides):
        """`greedy`: compute transformers' continuation of every prompt (`self.greedy`); False: none (a test that
        asks `hf_greedy` for what it needs)."""
        tok = ByteTokenizer()
        # initializer_range 0.5 (not 0.02): a model at the default scale mostly repeats one token, which a
        # broken attention could reproduce too; this one's continuations depend on the context, with
        # comfortable gaps between the best two logits so fp32 rounding never flips an argmax.
        config = AutoConfig.for_model(
            name,
            **{**(FAMILIES | LLAMA_LIKE).get(name, {}), **overrides},  # (a family tested on its own: overrides)
            eos_token_id=tok.eos_id,
            bos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
            initializer_range=initializer_range,
        )
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        if name in LLAMA_LIKE:  # their biases and norm weights off their zeros and ones, so that each one counts
            with torch.no_grad():
                for key, p in self.model.named_parameters():
                    if key.endswith("bias") or "norm" in key:
                        p.add_(torch.randn_like(p) * initializer_range * 0.5)
                for key, b in self.model.named_buffers():  # GLM-4.5's router correction (zeros at init)
                    if key.endswith("e_score_correction_bias"):
                        b.add_(torch.randn_like(b) * initializer_range * 0.2)
        self.model.save_pretrained(directory)
        self.model.to(DEVICE)
        # What `pylon export` writes: the run's tokenizer identity (TokenizerInfo) as JSON.
        (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
        self.name, self.dir = name, str(directory)
        self.greedy = [self.hf_greedy(p, NEW_TOKENS) for p in PROMPTS] if greedy else []

    def hf_greedy(self, prompt: list[int], new_tokens: int, min_tokens: int = 0) -> list[int]:
        return hf_greedy(self.model, prompt, new_tokens, min_tokens)

    def engine(self, **fields) -> LLMEngine:
        return LLMEngine(self.dir, spec(**fields))


def run(engine: LLMEngine, steps: int | None = None) -> dict[str, list]:
    """Step until done (or `steps` steps); every request's outputs, by id."""
    outputs: dict[str, list] = {}
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        n += 1
    return outputs


def eventually(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_pool_empty(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.kv_cache_utilization == 0.0
    assert stats.num_running == stats.num_waiting == 0


def speculating(engine: LLMEngine) -> LLMEngine:
    """`engine` with its speculation rule saying yes whenever a step has drafts: whether speculating pays depends on
    this machine's timings, and the rule has tests of its own (test_speculative.py); what a test that uses this
    checks is the verification of drafts, which must then run."""
    engine.spec_policy.decide = lambda decodes, drafts, other, **_: decodes > 0 and drafts > 0
    return engine


def recorded(engine) -> list[tuple[list[int], list[int]]]:
    """Each proposal the engine's hidden-state drafter (an MTP layer, an EAGLE head: `engine.mtp`) makes from now on:
    the request's tokens then, and its drafts."""
    proposed = []
    propose = engine.mtp.propose

    def recording(requests, tables):
        drafts = propose(requests, tables)
        proposed.extend((list(r.token_ids), drafts[r.request_id]) for r in requests if r.request_id in drafts)
        return drafts

    engine.mtp.propose = recording
    return proposed


# A script `test_tensor_shards._processes` runs in each shard's process: the model and a head drafting from its hidden
# states (argv: the head's directory, the method: mtp, the checkpoint's own layer, or eagle, eagle3; the prompt), the
# head's catch-up over the prompt and its first two drafts' logits saved (`hidden`, `first`, `second`, and `heads`, the
# shard's share of the head's attention heads).
HEAD_SHARDS = """
import json, sys, torch, torch.distributed as dist
from pylon.serving.engine.tensor import load_head
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence
from pylon.serving.model.tensor import Shard

directory, rank, count, store, saved = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
head_dir, method, prompt = sys.argv[6], sys.argv[7], json.loads(sys.argv[8])
shard = None
if count > 1:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=count)
    shard = Shard(rank, count)
kwargs = dict(num_blocks=32, block_size=16, dtype="fp32", device="cpu")
model = ModelRunner(directory, shard=shard, **kwargs)
head = load_head(model, shard, head_dir, kwargs, None if method == "mtp" else method)
table = [0, 1, 2, 3]
token = int(model.execute([StepSequence(prompt, 0, table, True)])[-1].argmax())
hidden = model.step_hidden  # every row's: the final hidden states (after the final norm), or three layers' inputs
out, _ = head.execute_step([StepSequence(prompt[1:] + [token], 0, table, True)], hidden=hidden)
first = head.head_logits(out)
draft = int(first[-1].argmax())  # the head fed its first draft: the second
out2, _ = head.execute_step([StepSequence([draft], len(prompt), table, True)], hidden=head.mtp_hidden(out))
second = head.head_logits(out2)
heads = head.config.num_attention_heads  # (the shard's config: its share of the heads)
torch.save({"hidden": hidden, "first": first, "second": second, "heads": heads}, saved)
if count > 1:
    dist.destroy_process_group()
"""


# The quantized checkpoint layouts `save_quantized` writes: DeepSeek's block FP8, and compressed-tensors' FP8 per
# channel ("-FP8-dynamic"), INT8 per channel with zero points (asymmetric "-W8A8"), INT4 in groups of 32 packed eight to
# an int32 ("-W4A16"); AutoGPTQ's INT4 (and GPTQModel's INT8) in activation-ordered groups, AutoAWQ's GEMM INT4.
QUANTIZED = ("fp8-block", "fp8-channel", "int8-channel", "w4a16", "gptq", "gptq-int8", "awq")


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as the int32s holding their bits."""
    return packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.to(torch.int32)


def _asymmetric(w: torch.Tensor, groups: torch.Tensor, count: int, bits: int, low_zero: int):
    """`w` `[out, in]` quantized asymmetrically per (group of input rows, output column): `groups` `[in]` each input
    row's group of `count`. Returns q `[out, in]`, zero points and float16 scales `[count, out]` (zero points at least
    `low_zero`), and the dequantized weight."""
    top = (1 << bits) - 1
    scales = torch.zeros(count, w.shape[0])
    zeros = torch.zeros(count, w.shape[0], dtype=torch.int64)
    for g in range(count):
        rows = w[:, groups == g]
        low, high = rows.amin(dim=1).clamp(max=0), rows.amax(dim=1).clamp(min=0)
        scales[g] = ((high - low) / top).clamp_min(1e-6)
        zeros[g] = torch.round(-low / scales[g]).clamp(low_zero, top).to(torch.int64)
    scales = scales.to(torch.float16)
    s, z = scales.float()[groups].t(), zeros[groups].t()  # [out, in]
    q = (torch.round(w / s) + z).clamp(0, top).to(torch.int64)
    return q, zeros, scales, (q - z).float() * s


def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned ints of `bits` packed 32 // bits to an int32 along `dim` of a 2-D tensor: value i of each at bits
    `bits x i`, or value `order[i]` of each at bits `bits x i` (AWQ's)."""
    per = 32 // bits
    values = values.to(torch.int64)
    if dim == 0:
        values = values.t()
    packed = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        packed |= values[:, (order[i] if order else i) :: per] << (bits * i)
    packed = _as_int32(packed)
    return packed.t().contiguous() if dim == 0 else packed


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed ints in [-8, 7], `[rows, columns]`, as compressed-tensors packs them: offset by 8, eight to an int32
    along the columns (column 8p + i at bits 4i of int32 p), the last padded with zeros."""
    rows, cols = q.shape
    per = 8
    u = torch.zeros(rows, -(-cols // per) * per, dtype=torch.int64)
    u[:, :cols] = q.to(torch.int64) + 8
    packed = torch.zeros(rows, u.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        packed |= u[:, i::per] << (4 * i)
    return _as_int32(packed)


def save_quantized(source: str, directory: Path, scheme: str, block: int = 32) -> dict[str, torch.Tensor]:
    """The export in `source` saved to `directory` quantized as published checkpoints are (`QUANTIZED`): each decoder
    layer's projection weights (2-D, the router's aside), `fp8-block` as DeepSeek-V3's (float8_e4m3fn, a float32
    `weight_scale_inv` per `block` x `block` block, partial at the edges), the others in compressed-tensors' layouts
    (`weight_scale` per output channel, or per group of `block` columns; int8's `weight_zero_point`; int4's
    `weight_packed` and `weight_shape`). Returns each quantized weight dequantized, what a reader of the checkpoint
    must compute."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and not os.path.isdir(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), directory / name)
    tensors, dequantized = {}, {}
    for name in sorted(n for n in os.listdir(source) if n.endswith(".safetensors")):
        out = {}
        for key, w in load_file(os.path.join(source, name)).items():
            if (
                not (key.startswith("model.layers.") and key.endswith(".weight") and w.dim() == 2)
                or ".mlp.gate." in key
            ):
                out[key] = w
                continue
            rows, cols = w.shape
            w = w.float()
            if scheme == "fp8-block":
                grid = (-(-rows // block), -(-cols // block))
                padded = torch.zeros(grid[0] * block, grid[1] * block)
                padded[:rows, :cols] = w
                scales = (padded.view(grid[0], block, grid[1], block).abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
                whole = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
                q = (w / whole).to(torch.float8_e4m3fn)
                out[key], out[key + "_scale_inv"] = q, scales
                dequantized[key] = q.float() * whole
            elif scheme == "fp8-channel":
                scales = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12).to(torch.bfloat16)
                q = (w / scales.float()).to(torch.float8_e4m3fn)
                out[key], out[key + "_scale"] = q, scales
                dequantized[key] = q.float() * scales.float()
            elif scheme == "int8-channel":  # asymmetric: [min, max] of each row onto [-128, 127]
                low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
                scales = ((high - low) / 255.0).clamp_min(1e-12)
                zero = (-128 - torch.round(low / scales)).clamp(-128, 127).to(torch.int8)
                q = (torch.round(w / scales) + zero.float()).clamp(-128, 127).to(torch.int8)
                out[key], out[key + "_scale"], out[key + "_zero_point"] = q, scales, zero
                dequantized[key] = (q.float() - zero.float()) * scales
            elif scheme in ("gptq", "gptq-int8"):  # AutoGPTQ's layout, transposed, activation-ordered groups
                bits = 4 if scheme == "gptq" else 8
                order = torch.randperm(cols, generator=torch.Generator().manual_seed(cols + rows))
                groups = torch.empty(cols, dtype=torch.int64)
                groups[order] = torch.arange(cols) // block  # (input rows in a permuted order, `block` a group)
                count = -(-cols // block)
                # (checkpoint_format gptq stores zero points one less: the test's are at least 1, as AutoGPTQ's
                # dequantization reads a stored -1 as 2^bits)
                q, zero, scales, dequantized[key] = _asymmetric(w, groups, count, bits, 1 if bits == 4 else 0)
                prefix = key.removesuffix("weight")
                out[prefix + "qweight"] = _pack(q.t(), bits, 0)  # [in / per, out]: inputs packed
                out[prefix + "qzeros"] = _pack(zero - (1 if bits == 4 else 0), bits, 1)  # [groups, out / per]
                out[prefix + "scales"], out[prefix + "g_idx"] = scales, groups.to(torch.int32)
            elif scheme == "awq":  # AutoAWQ's GEMM layout: outputs packed in its order, groups of `block` inputs
                groups = torch.arange(cols) // block
                q, zero, scales, dequantized[key] = _asymmetric(w, groups, -(-cols // block), 4, 0)
                prefix = key.removesuffix("weight")
                pack_order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: nibble i holds column 8p + pack_order[i]
                out[prefix + "qweight"] = _pack(q.t(), 4, 1, pack_order)  # [in, out / 8]
                out[prefix + "qzeros"] = _pack(zero, 4, 1, pack_order)
                out[prefix + "scales"] = scales
            else:  # w4a16: symmetric int4 in groups of `block` columns (the last partial)
                groups = -(-cols // block)
                padded = torch.zeros(rows, groups * block)
                padded[:, :cols] = w
                scales = (padded.view(rows, groups, block).abs().amax(dim=2) / 7.0).clamp_min(1e-12)
                whole = scales.repeat_interleave(block, 1)[:, :cols]
                q = torch.round(w / whole).clamp(-8, 7).to(torch.int8)
                out[key + "_packed"], out[key + "_scale"] = _pack_int4(q), scales
                out[key + "_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
                dequantized[key] = q.float() * whole
        tensors[name] = out
    for name, out in tensors.items():
        save_file(out, str(directory / name), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    if scheme == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        }
    elif scheme in ("gptq", "gptq-int8"):
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4 if scheme == "gptq" else 8,
            "group_size": block,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq" if scheme == "gptq" else "gptq_v2",
        }
    elif scheme == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": block,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        weights = {
            "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "int8-channel": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False},
            "w4a16": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": block, "symmetric": True},
        }[scheme]
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": {"fp8-channel": "float-quantized", "int8-channel": "int-quantized"}.get(scheme, "pack-quantized"),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**weights, "dynamic": False}}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


def add_mtp_layer(directory: str, *, predictor: bool = False) -> dict[str, torch.Tensor]:
    """Write a multi-token-prediction layer into the checkpoint in `directory` as the family's releases hold it, and
    return its tensors: DeepSeek-V3's and GLM-4.5's `model.layers.{N}` (a decoder layer, `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, and copies of the embeddings and the head, which the engine does not read), Qwen3-Next's and
    Qwen3.5's `mtp.` (`layers.0`, a full-attention layer, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `norm`).
    The decoder layer is random: layer N of the model's class built with N + 1 layers (Qwen's: of one full-attention
    layer). `predictor` (DeepSeek's layout): instead the model's own last layer (a model of one sparse layer), `eh_proj`
    passing the next token's embedding through and the model's final norm, so that the layer computes what the model
    computes one token later, its context short of the first two tokens (the embeddings' rows scaled to RMS 1, so that
    `enorm` keeps them as the model reads them)."""
    from safetensors.torch import load_file, save_file

    path = Path(directory) / "model.safetensors"
    tensors = load_file(str(path))
    config = AutoConfig.from_pretrained(directory)
    n, hidden = config.num_hidden_layers, config.hidden_size
    qwen = config.model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
    g = torch.Generator().manual_seed(7)
    layer: dict[str, torch.Tensor] = {}
    if predictor:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        for name, t in tensors.items():
            if name.startswith(f"model.layers.{n - 1}."):
                layer[f"model.layers.{n}." + name.removeprefix(f"model.layers.{n - 1}.")] = t.clone()
        own = {
            "enorm.weight": torch.ones(hidden),
            "hnorm.weight": torch.ones(hidden),
            "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
            "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        }
    else:
        if qwen:  # one full-attention layer (the fixture's recurrent layers' neighbour)
            bigger = AutoConfig.from_pretrained(directory, num_hidden_layers=1, layer_types=["full_attention"])
        else:
            bigger = AutoConfig.from_pretrained(directory, num_hidden_layers=n + 1)
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_config(bigger, dtype=torch.float32)
        with torch.no_grad():
            for key, p in model.named_parameters():  # (Qwen's norms are 1 + w: zeros at init, made to count)
                if "norm" in key:
                    p.add_(torch.randn(p.shape, generator=g) * 0.2)
            for key, b in model.named_buffers():  # (the router's correction, off its zeros as the fixture's)
                if key.endswith("e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * 0.1)
        scratch = Path(directory) / "mtp-scratch"
        model.save_pretrained(scratch)
        index = 0 if qwen else n
        for name, t in load_file(str(scratch / "model.safetensors")).items():
            if name.startswith(f"model.layers.{index}."):
                layer[name] = t
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
        base = 0.0 if qwen else 1.0  # (Qwen's norms scale by 1 + w)
        norms = (
            ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm") if qwen else ("enorm", "hnorm", "shared_head.norm")
        )
        own = {f"{name}.weight": base + 0.2 * torch.randn(hidden, generator=g) for name in norms}
        own["fc.weight" if qwen else "eh_proj.weight"] = (
            torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5
        )
    if qwen:
        layer = {"mtp.layers.0." + k.removeprefix("model.layers.0."): v for k, v in layer.items()}
        layer.update({f"mtp.{k}": v for k, v in own.items()})
    else:
        layer.update({f"model.layers.{n}.{k}": v for k, v in own.items()})
        layer[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        layer[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **layer}, str(path), metadata={"format": "pt"})
    return layer
