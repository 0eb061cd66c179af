"""The model families the serving engine runs, by `config.json`'s `model_type`, and what their configs say about
attention that the runner must honour.

GPT-2 and OPT (`opt`: OPT-125m to 66B, vLLM's quickstart model; learned positions, LayerNorms before the blocks or,
in 350m, after them, a ReLU MLP, 350m's projections in and out) and GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B,
Dolly v2; a fused per-head query-key-value projection, partial rotary embedding, parallel residual) have forward
passes of their own; the others are
built as Llama is (RMSNorm, RoPE, grouped-query attention, gated MLP) up to what the runner reads from the loaded
modules themselves: projection biases (Qwen2 and Qwen2.5),
per-head query and key norms and a head_dim of their own (Qwen3, Gemma 3), and a sliding window (`layer_windows`): in
every layer of Mistral 7B v0.1, in the layers `layer_types` says of Qwen2's and Qwen3's with `use_sliding_window` and
of Gemma 3's (five windowed layers to one full one in its checkpoints). The runner attends each windowed layer over
its window only, as `transformers` does (pylon.serving.model.attention).

Gemma 3's text models (`gemma3_text`: Gemma3ForCausalLM, Gemma 3 270M and 1B) differ from Llama further, each part
computed by the loaded modules as transformers computes it: embeddings scaled by sqrt(hidden_size) (its embedding
module does), RMSNorms of `x * (1 + w)` (its norm modules do), four norms a layer (the attention's and the MLP's
outputs are normalised too, `post_attention_layernorm` and `post_feedforward_layernorm`, before they join the
residual; `pre_feedforward_layernorm` is the MLP's input norm), an attention scale of query_pre_attn_scalar**-0.5
(`attn.scaling`), the rotary embedding of each layer's type (the windowed layers' base is rope_local_base_freq), and
the logits soft-capped by `final_logit_softcapping` where the config sets it. What the engine cannot compute is
refused at load (`unsupported`): an attention logit soft cap in a Gemma 3 config (transformers' Gemma 3 does not apply
it) and its bidirectional attention (embedding models). The multimodal Gemma 3 checkpoints (`gemma3`:
Gemma3ForConditionalGeneration: 4B, 12B, 27B) are served for their text (`TEXT_MODELS`), as are Mistral 3's
(`mistral3`: Mistral3ForConditionalGeneration, Mistral Small 3.1 and 3.2 24B, whose language model is Mistral's):
loaded as they ship, their language model kept, so they answer text as the conditional model does on text alone (LoRA
adapters trained on it adapt that language model: pylon.serving.model.lora); their vision tower is kept for images
where the checkpoint ships its image processor (`IMAGE_MODELS`, pylon.serving.engine.images), else dropped.

Gemma (`gemma`: Gemma 2B and 7B, CodeGemma) is Gemma 3's embedding scale and `x * (1 + w)` norms on Llama's layer
(two norms, one rotary embedding, a head_dim of 256 apart from hidden_size / heads), its MLP gated by GELU (tanh), as
its modules compute. Gemma 2 (`gemma2`: 2B, 9B, 27B) has Gemma 3's four norms a layer and query_pre_attn_scalar, its
`layer_types` alternating windowed and full layers (a window of 4096), no per-head norms, one rotary embedding, and
soft-capped attention logits (`attn_logit_softcapping`, 50 in its checkpoints: `attention_softcap`), which the runner
applies in the PyTorch attention (the compiled CPU kernels take no cap, so a Gemma 2 model does not use them), and
soft-capped final logits (30). Gemma 2 and Gemma 3 are served in bf16 or fp32 (`FP16_UNSAFE`).

Granite (`granite`: IBM Granite 3.x dense, GraniteForCausalLM) is Llama with four multipliers from its config, each
applied where transformers applies it: the embeddings times `embedding_multiplier`, an attention scale of
`attention_multiplier` (`attn.scaling`), the attention's and the MLP's outputs times `residual_multiplier` as they join
the residual, and the logits divided by `logits_scaling`. OLMo 2 (`olmo2`: OLMo 2 7B, 13B, 32B) normalises the outputs
of the attention and the MLP (`post_attention_layernorm`, `post_feedforward_layernorm`) and not their inputs (no
`input_layernorm`), and its query and key norms span all the heads at once (an RMSNorm over heads x head_dim before the
heads are split), which the runner tells from the norm's size. OLMo 3 (`olmo3`: OLMo 3 7B, 32B) is OLMo 2 with
windowed layers (three in four, `layer_types`) and a rotary embedding per layer type (YaRN in its full layers), as
Gemma 3's (`rope_layer_types`). SmolLM3 (`smollm3`: SmolLM3-3B) is Llama whose every
fourth layer has no rotary embedding (`no_rope_layers`: NoPE), and whose windowed layers, where `use_sliding_window`
turns them on, are those NoPE layers. StarCoder2 (`starcoder2`: 3B, 7B, 15B) is Llama with LayerNorms (weights and
biases), biases on every projection, and a plain MLP (`c_proj(act(c_fc(x)))`, GELU), its modules' own; its
`sliding_window` holds in every layer; LoRA adapts its attention's projections and `mlp.c_fc`, `mlp.c_proj`.

Phi-3 and Phi-4 (`phi3`: Phi3ForCausalLM: Phi-3-mini, Phi-3-medium, Phi-3.5-mini, Phi-4 14B, Phi-4-mini; not
Phi-3-small, a model type of its own) are Llama with fused projections, kept fused (one matmul each):
`self_attn.qkv_proj` (queries, then keys, then values along its output) and `mlp.gate_up_proj` (gate, then up:
`up * act(gate)`); their LoRA adapters adapt those modules by those names (`pylon.serving.model.lora`). A
`partial_rotary_factor` below 1 (Phi-4-mini's 0.75) rotates only the first part of each head's dimensions, as phi3's
`apply_rotary_pos_emb` does (the runner calls it for this family). Phi-3-mini-4k's `sliding_window` (2047) holds in
every layer, as transformers masks it. Residual dropout is the identity in eval.

The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) are their dense siblings' attention (Mistral's, Qwen2's
with projection biases, Qwen3's with per-head norms) with sparse MoE blocks for MLPs, which the runner computes from
the loaded blocks' weights (`pylon.serving.model.moe`); a Qwen MoE's `mlp_only_layers` are dense MLPs, as loaded.
Families that are Llama up to what their loaded modules compute: Seed-OSS (`seed_oss`: Seed-OSS-36B, biases on every
attention projection), ERNIE 4.5 (`ernie4_5`: ERNIE-4.5-0.3B, rotating interleaved pairs), Helium (`helium`: Kyutai's
Helium-1, interleaved pairs too), Arcee (`arcee`: AFM-4.5B, an MLP without a gate, `down(relu(up(x))^2)`), Ministral
(`ministral`: Ministral-8B, a window in its layers by `layer_types`), Ministral 3 (`ministral3`: Ministral 3 3B-14B,
its queries scaled past `original_max_position_embeddings` by Llama 4's `1 + beta * log(1 + floor(position /
original))`), HunYuan dense (`hunyuan_v1_dense`: Hunyuan-7B and smaller, per-head query and key norms applied after
the rotation, `query_layernorm` and `key_layernorm`), and EXAONE 4 (`exaone4`: EXAONE 4.0 1.2B and 32B: OLMo 2's
output norms, per-head query and key norms, three windowed layers in four and, as Cohere 2, no rotation in the full
ones), and Apertus (`apertus`: Apertus 8B and 70B: Qwen3's per-head query and key norms, Arcee's MLP without a gate,
its activation xIELU with learned parameters per layer, computed by its module; its two norms named
`attention_layernorm` and `feedforward_layernorm`, which the runner renames Llama's at load). The rotary embedding of
every family is its modeling module's own `apply_rotary_pos_emb`.

GLM-4 (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) is Llama with biased query, key and value projections, a rotary
embedding of interleaved pairs over the first half of each head's dimensions (its own `apply_rotary_pos_emb`), its
MLP's gate and up in one projection (`gate_up_proj`, as Phi-3's), and four norms a layer: the attention's output
normalised (`post_self_attn_layernorm`) before it joins the residual, `post_attention_layernorm` the MLP's input norm,
and the MLP's output normalised (`post_mlp_layernorm`).

ERNIE 4.5 MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B) is ERNIE 4.5's attention (interleaved pairs)
with MoE blocks in the layers its config names (`moe_layer_start_index` to `moe_layer_end_index`, every
`moe_layer_interval`-th), each with ungated shared experts and a router of its own (`pylon.serving.model.moe`).

OLMoE (`olmoe`: OLMoE-1B-7B) and FlexOlmo (`flex_olmo`) are OLMo's attention (query and key norms over all heads;
FlexOlmo's output norms as OLMo 2's) with Qwen-style routers (softmax, top_k, renormalised where `norm_topk_prob`).
dots.llm1 (`dots1`) is Qwen3's attention with GLM-4.5's MoE blocks (DeepSeek-V3's router, shared experts, dense first
layers).

GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6) is Llama's attention with biased query, key and value
projections, per-head query and key norms where `use_qk_norm`, and the rotary embedding of the first half of each head's
dimensions (`partial_rotary_factor` 0.5, applied as Phi-3's); its first `first_k_dense_replace` layers are dense MLPs,
the rest sparse blocks with shared experts beside the routed ones and DeepSeek-V3's router (sigmoid scores, a
correction bias, groups of experts, a scaling factor). Its checkpoints' multi-token-prediction layer (which transformers
skips) drafts with `engine.speculative.method: mtp` (pylon.serving.model.mtp).

DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3, V3.1, R1, Kimi K2, Moonlight) has GLM-4.5's MoE blocks (DeepSeek's router,
shared experts, dense first layers) and multi-head latent attention (MLA): each token's keys and values are one
latent of `kv_lora_rank` dimensions (after `kv_a_layernorm`) that `kv_b_proj` expands into every head's key (its
`qk_nope_head_dim` part) and value, beside a `qk_rope_head_dim` key part shared by the heads and rotated (in interleaved
pairs where `rope_interleave`, as its checkpoints). The engine caches the latent and the rotated part, `kv_lora_rank +
qk_rope_head_dim` numbers a token and layer (576 for V3, against 128 heads x 2 x 192 expanded), one "kv head" that all
query heads share, and computes attention over it with the expansion folded into the queries and the outputs (the
weights absorbed, as DeepSeek's and vLLM's MLA kernels do): each head's query part is multiplied by its slice of
`kv_b_proj` (the key half) into the latent's space, the rotated parts appended, and the attention output over the
latents multiplied by the value half: the same scores and outputs as the expanded keys and values give, at a
fraction of the cache. Its attention scale is `qk_head_dim ** -0.5` times YaRN's mscale squared, as the module sets it.
Its multi-token-prediction layer drafts with `engine.speculative.method: mtp` (pylon.serving.model.mtp). LoRA adapters
adapt its `o_proj` only. DeepSeek-V2 (`deepseek_v2`:
DeepSeek-V2, V2-Lite, DeepSeek-Coder-V2) has the same latent attention, its rotation a complex product over
interleaved pairs (its rotary embedding gives complex frequencies), and DeepSeek-V2's router (softmax scores, groups
by their best expert, no renormalisation, a scaling factor).

GPT-OSS (`gpt_oss`: gpt-oss-20b, gpt-oss-120b) is an MoE family with an attention of its own: biases on every
projection, windowed layers (a window of 128) and full ones by turns (`layer_types`), YaRN's rotary embedding
rotating the two halves of each head (its own `apply_rotary_pos_emb`, whose cos and sin span half a head), and a
learned sink per head (`sinks`, SINK_FAMILIES): one more logit in each query's softmax, which takes its share of the
weight and adds no value, so a query may attend to nothing much. The runner gives each layer's sinks to the attention
(pylon.serving.model.attention; the compiled CPU kernels take none, so a GPT-OSS model attends through PyTorch). Its
MoE blocks route by the top 4 of the router's logits (a bias of its own), softmaxed over those 4, and its experts
(weights stored `[experts, in, out]`, biases on both) apply a clamped SwiGLU to interleaved gate and up columns
(`pylon.serving.model.moe`). Its checkpoints store the experts in MXFP4 (`quantization_config`); transformers
dequantizes them at load where its MXFP4 kernels are not installed (Pylon's case), so the engine computes what the
dequantized model computes, its experts in the engine's dtype, or int8 / fp8 by `engine.quantization`. Its chat
format is OpenAI's harmony (reasoning, answer and tool calls as channels: pylon.serving.api.harmony).

Llama 4 (`llama4_text`: Llama4ForCausalLM; the text of Llama 4 Scout and Maverick) is Llama's layer with three
kinds of attention layer and MoE blocks of its own, each as transformers computes it: its rotating layers
(`no_rope_layers` 1: three in four in its checkpoints) rotate interleaved pairs of dimensions by complex frequencies
(DeepSeek-V2's rotation), normalise each head's query and key by their L2 norm after the rotation (`qk_norm` where
`use_qk_norm`), and attend within chunks of `attention_chunk_size` positions (8192: a query sees the keys of its own
chunk up to itself, `Chunk`); its NoPE layers attend to the whole context without positions, their queries scaled by
`1 + attn_scale * log(1 + floor((position + 1) / floor_scale))` where `attn_temperature_tuning`. Its MoE blocks
(every `interleave_moe_layer_step`-th layer; the others dense MLPs of `intermediate_size_mlp`) route each token to its
top `num_experts_per_tok` experts (1 in its checkpoints) by the sigmoid of their logits, which scales the expert's
*input*, and add a shared expert (`pylon.serving.model.moe`). Its layers' `feed_forward` is the runner's `mlp`. Its
multimodal checkpoints (`llama4`: Llama4ForConditionalGeneration, as Scout and Maverick ship) are served for their
text (TEXT_MODELS): the conditional model's whole Llama4ForCausalLM kept, its vision model dropped, no images taken.

Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B) mixes two kinds of layer (`layer_types`, `linear_layers`): three in
four are Gated DeltaNet layers, recurrent: each sequence's state is a depthwise convolution's last
`linear_conv_kernel_dim - 1` inputs and one `[key_dim, value_dim]` matrix per value head, carried from token to token
(the delta rule, gated), in place of a KV cache; the fourth is attention with a sigmoid gate on its output (half of
`q_proj`'s output, per head), per-head query and key norms and a quarter of each head rotated. Its MLPs are
Qwen2-MoE's sparse blocks with a gated shared expert. The runner computes the recurrent layers one sequence at a time
with transformers' own delta-rule functions (the chunked one over a prompt's chunk, the recurrent one for a decode),
each sequence's state kept under its request's id (`StepSequence.state`); a speculating sequence's states are kept
after each draft, to go back to the last one accepted (`keep_state`), and a cached prefix restores them from snapshots
at block boundaries (docs/serving.md). Its checkpoints' multi-token-prediction layer (`mtp.`, which transformers
skips) drafts with `engine.speculative.method: mtp` (pylon.serving.model.mtp), Qwen3.5's too.
Qwen3.5 (`qwen3_5_text`, and `qwen3_5_moe_text` with Qwen3-Next's MoE blocks; their multimodal checkpoints `qwen3_5`
and `qwen3_5_moe`, images included) has the same layers, its recurrent layers' projections apart
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` in place of Qwen3-Next's interleaved `in_proj_qkvz` and
`in_proj_ba`) and a multimodal rotary embedding, which on text alone is its rotation of the text's positions.

Qwen2-VL and Qwen2.5-VL (`qwen2_vl`, `qwen2_5_vl`: Qwen2's layers) and Qwen3-VL (`qwen3_vl`: Qwen3's) are conditional
models whose language models (`qwen2_vl_text`, ...) transformers has no causal-LM class for: the runner loads the
conditional model and puts its text model in its family's causal LM (`causal_lm_from_config`). Their rotary embedding
is M-RoPE (`MROPE_MODELS`): three positions a token, which on text are its one; an image's tokens' are its rows and
columns (pylon.serving.engine.images.mrope_positions). InternVL (`internvl`: the "-hf" releases of InternVL3 and 3.5,
InternVLForConditionalGeneration) is a Qwen2 (or Qwen3) language model beside an InternViT tower whose tiles' features
are pixel-shuffled and projected, 256 tokens a tile. LLaVA (`llava`: llava-hf's LLaVA-1.5 and kin,
LlavaForConditionalGeneration) is a Llama (Mistral, ...) language model beside a CLIP tower whose patch features of one
layer (`vision_feature_layer`) are projected, 576 tokens an image at 336 x 336.

LongRoPE (`rope_type` "longrope": Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini; any family may name it) rotates with its
short factors while a sequence stays within `original_max_position_embeddings` and switches every position to its long
factors past it, recomputing the whole cache, which a batched paged engine cannot do per sequence: the engine serves
such a model up to `original_max_position_embeddings` positions (`position_limit`), where its outputs are the
model's own (the rotary module's attention scaling, applied at every length, included).
"""

from __future__ import annotations

# Mixture-of-experts families: their dense siblings' attention (Mixtral's is Mistral's, Qwen2-MoE's Qwen2's, Qwen3-MoE's
# Qwen3's; GLM-4.5's Llama's with a partial rotary embedding; GPT-OSS's its own, below) and sparse MoE blocks for MLPs
# (pylon.serving.model.moe).
MOE_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "flex_olmo",
    "gpt_oss",
    "glm4_moe",
    "dots1",
    "deepseek_v2",
    "deepseek_v3",
    "llama4_text",
    "ernie4_5_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
)
# Families with recurrent (linear-attention) layers beside attention ones: Qwen3-Next's Gated DeltaNet layers keep a
# state per sequence (a convolution's last inputs and a matrix per head) in place of a KV cache (`linear_layers`).
LINEAR_ATTENTION_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Families whose attention is multi-head latent attention (DeepSeek-V3's MLA, below): the cache holds one compressed
# latent per token and layer, not keys and values per head.
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
# Families whose attention has a learned sink per head: a logit that joins each query's softmax and takes its share of
# the weight without a value (GPT-OSS's `sinks`); the runner passes each layer's to the attention.
SINK_FAMILIES = ("gpt_oss",)
LLAMA_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "granite",
    "olmo2",
    "olmo3",
    "smollm3",
    "starcoder2",
    "cohere",
    "cohere2",
    "glm4",
    "seed_oss",
    "ernie4_5",
    "exaone4",
    "arcee",
    "hunyuan_v1_dense",
    "ministral",
    "ministral3",
    "helium",
    "apertus",
    "qwen3_5_text",
    *MOE_MODEL_TYPES,
    *("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"),
)
# Cohere's layers run the attention and the MLP side by side on the same normed input (one LayerNorm a layer, no bias:
# CohereLayerNorm), both added to the residual at once; its rotary embedding rotates interleaved pairs of dimensions
# (its own apply_rotary_pos_emb), its query and key norms are LayerNorms per head (weights [heads, head_dim]), and its
# logits are multiplied by `logit_scale`. Cohere 2 (Command R7B, Command A) adds windowed layers (`layer_types`) and
# rotates only those: its full-attention layers have no rotary embedding.
PARALLEL_FAMILIES = ("cohere", "cohere2")
# Families whose activations pass fp16's range (vLLM refuses fp16 for them too): served in bf16 or fp32.
FP16_UNSAFE = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
# Multimodal checkpoints, their language model one of the families above (text_config's model_type): the runner loads
# the checkpoint as it ships and keeps its language model, and its vision tower for images (engine/images.py).
TEXT_MODELS = (
    "gemma3",
    "mistral3",
    "llama4",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "internvl",
    "llava",
)
# Those whose images the engine embeds (engine/images.py); Llama 4's multimodal checkpoints are served for their text.
IMAGE_MODELS = (
    "gemma3",
    "mistral3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "internvl",
    "llava",
)
# The files a multimodal checkpoint's image processor ships in (one saved without them is served for its text only).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Those whose language model rotates an image's tokens by their place in it (M-RoPE: a temporal, a height and a width
# position a token; a text token's three are its one): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 (engine/images.py).
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
# Language models transformers has no causal-LM class for (only their conditional model's): the causal LM of the
# family whose layers theirs are, as a shell their loaded text model goes in (`causal_lm_from_config`).
_CAUSAL_SHELLS = {
    "qwen2_vl_text": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2_5_vl_text": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_vl_text": ("Qwen3Config", "Qwen3ForCausalLM"),
}
SUPPORTED_MODEL_TYPES = ("gpt2", "opt", "gpt_neox", *LLAMA_FAMILIES, *TEXT_MODELS)
# Encoders, served as cross-encoders (their *ForSequenceClassification checkpoints: ms-marco's MiniLM cross-encoders
# are BERT, BAAI's bge-reranker-base/large and -v2-m3 XLM-RoBERTa, mxbai-rerank-v1 DeBERTa-v3, gte-reranker-modernbert
# ModernBERT) or embedding models (all-mpnet-base-v2 is MPNet, gte-modernbert ModernBERT, e5 and bge BERT or
# XLM-RoBERTa): every input read whole, both ways, through transformers' own classes
# (model/encoder.py)
ENCODER_MODEL_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "distilbert",
    "electra",
    "mpnet",
    "deberta-v2",
    "modernbert",
    "nomic_bert",
    "gte",
    "eurobert",
)


def has_processor(uri: str) -> bool:
    """Whether the checkpoint at `uri` (a directory, or object storage) ships an image processor (`PROCESSOR_FILES`):
    a multimodal checkpoint as published does; one saved without it is served, and planned, for its text only."""
    from pylon import storage

    return any(storage.exists(storage.join(uri, name)) for name in PROCESSOR_FILES)


def causal_lm_from_config(config):
    """transformers' causal LM of a (text) config, built as `AutoModelForCausalLM.from_config` builds it (under the
    caller's device context: meta for a shell or a count); for a language model with no causal-LM class of its own
    (Qwen2-VL's, Qwen2.5-VL's: Qwen2's layers; Qwen3-VL's: Qwen3's), its family's class built from its config (the
    same modules and names, `model.layers.N...`; the rotary embedding is its own text model's where loaded)."""
    import transformers

    shell = _CAUSAL_SHELLS.get(config.model_type)
    if shell is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    family_config, causal_lm = (getattr(transformers, name) for name in shell)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    if isinstance(fields.get("rope_parameters"), dict):  # (M-RoPE's sections: the text model's rotary reads them)
        fields["rope_parameters"] = {k: v for k, v in fields["rope_parameters"].items() if not k.startswith("mrope")}
    model = causal_lm(family_config(**fields))
    model.config = config  # (the checkpoint's own, as the text model's)
    return model


def recurrent_state_bytes(config, dtype_bytes: int) -> int:
    """The bytes of one sequence's recurrent states in a model with recurrent layers (Qwen3-Next's and Qwen3.5's
    Gated DeltaNet, `layer_types`' "linear_attention"), as the serving engine keeps them: per such layer the
    convolution's last kernel - 1 inputs of every channel (queries, keys and values) in the model's dtype, and the delta
    rule's matrix per value head (key_dim x value_dim) in float32; 0 for a model without them."""
    types = getattr(config, "layer_types", None) or []
    layers = sum(t == "linear_attention" for t in types)
    if not layers:
        return 0
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    matrices = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return layers * (conv + matrices)


def is_sequence_classifier(config) -> bool:
    """Whether a checkpoint is its family's `*ForSequenceClassification` (a reward model, a cross-encoder, a
    classifier: a head over the last token's final hidden state instead of an lm_head), by its config's
    `architectures` (`pylon.models.is_classifier`, which training builds its reward models by)."""
    from pylon.models import is_classifier

    return is_classifier(config)


# Modules the runner renames at load to the names its Llama-like forward reads, per family (old -> new): Llama 4's
# layers call their MLP (or MoE block) `feed_forward`; Apertus has its own names for Llama's two norms. A checkpoint's
# weights keep the old names (`ModelRunner.load_weights` maps them).
RENAMED_MODULES: dict[str, dict[str, str]] = {
    "llama4_text": {"feed_forward": "mlp"},
    "apertus": {"attention_layernorm": "input_layernorm", "feedforward_layernorm": "post_attention_layernorm"},
}


def reshaped_at_load(model_type: str | None) -> str | None:
    """Why the engine's weights of a checkpoint of `model_type` are not the checkpoint's tensors as they load (so that
    it cannot take a trainer's weights again: `ModelRunner.load_weights`), or None."""
    if model_type in MLA_FAMILIES:
        return "its latent attention's kv_b_proj is absorbed into the queries and outputs at load"
    if model_type in MOE_MODEL_TYPES:
        return "its experts are regrouped at load (pylon.serving.model.moe)"
    if model_type in TEXT_MODELS:
        return "it is a multimodal checkpoint whose language model is taken apart at load"
    return None


def unsupported(config) -> str | None:
    """What in a supported family's `config` the engine does not compute, naming the field, or None."""
    if getattr(config, "attn_logit_softcapping", None) and config.model_type != "gemma2":
        return (
            f"attn_logit_softcapping is {config.attn_logit_softcapping}: the engine soft-caps the attention of Gemma 2 "
            f"only, whose modeling code applies it; {config.model_type}'s (in transformers) does not say how it would "
            "(Gemma 3's checkpoints leave it null)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        return (
            "use_bidirectional_attention is true: the engine's attention is causal (a bidirectional Gemma 3 is an "
            "embedding model, not a generator)"
        )
    return None


def attention_softcap(config) -> float | None:
    """The cap of a model's attention scores (Gemma 2's `attn_logit_softcapping`: each score, once scaled, becomes
    cap * tanh(score / cap) before the mask), or None where they are not capped."""
    cap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
    return float(cap) if cap else None


def position_limit(config) -> tuple[int, str | None]:
    """How many positions the engine serves `config`'s model over, and why, where fewer than its
    `max_position_embeddings` (else None): a LongRoPE model (see above) is served up to its
    `original_max_position_embeddings`, within which transformers rotates with the short factors."""
    limit = config.max_position_embeddings
    params = getattr(config, "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]  # Gemma 3's: one set per layer type
    for p in nested if nested and "rope_type" not in params else [params]:
        if p.get("rope_type") != "longrope":
            continue
        original = p.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if original and original < limit:
            return original, (
                f"LongRoPE (rope_type longrope) switches every position from its short to its long factors once a "
                f"sequence passes original_max_position_embeddings {original} (transformers recomputes the whole "
                "cache there), which a batched paged engine cannot do per sequence; within it the model computes with "
                "the short factors, as transformers does"
            )
    return limit, None


def rope_layer_types(config) -> list[str] | None:
    """Each layer's type where the model's rotary embedding takes it (Gemma 3: a base of its own for the windowed
    layers, rope_parameters["sliding_attention"], and for the full ones; OLMo 3: YaRN in the full ones), else None:
    one rotary embedding for every layer."""
    if config.model_type not in ("gemma3_text", "olmo3"):
        return None
    return list(config.layer_types)


class Chunk(int):
    """A layer's chunked attention (Llama 4's `attention_chunk_size`), passed where a sliding window goes (an int: the
    chunk's size): the query at position p sees the keys of its own chunk up to p, positions (p // size) * size .. p
    (masking_utils' `chunked_causal_mask_function`), where a window of that size would see the last `size` keys."""

    def __repr__(self) -> str:
        return f"Chunk({int(self)})"


def first_key(window: int, position: int) -> int:
    """The first key a query at `position` sees through `window` (a sliding window's size, or a `Chunk`), and no later
    query sees an earlier one: what a sequence whose queries start there may let go of the blocks before."""
    if isinstance(window, Chunk):
        return position // window * window
    return max(position - window + 1, 0)


def kv_groups(
    windows: list, max_len: int, block_size: int, step_tokens: int, pool_tokens: int
) -> list[tuple[list[int], int | None]]:
    """The KV cache's groups of layers for a model whose windowed layers mix with full ones (`layer_windows`; vLLM's
    hybrid KV cache manager): groups of `g` layers of one kind each (g the fewer kind's count; the more numerous kind's
    last group may be short), full groups first, each group with its own block table, so that a windowed group's table
    lets go of the blocks before its window as the sequence goes on while the full groups' hold the whole context. Each
    block id stands for `g` layers' keys and values (a layer's tensor is shared with the layers at its place in the
    other groups). Returns [(layers, window or None)], or [] where the groups would not do: no mix of kinds; a decoding
    sequence of `max_len` tokens would hold as many layers' blocks as with one table for all (a window near the
    context, or short groups' slack); or one at its last step (a prompt chunk of up to `step_tokens` past the window)
    would not fit a pool of `pool_tokens` tokens in every layer."""
    full = [i for i, w in enumerate(windows) if w is None]
    windowed = [i for i, w in enumerate(windows) if w is not None]
    if not full or not windowed or len({windows[i] for i in windowed}) > 1:
        return []
    g = min(len(full), len(windowed))
    groups = [(full[k : k + g], None) for k in range(0, len(full), g)]
    window = windows[windowed[0]]
    groups += [(windowed[k : k + g], window) for k in range(0, len(windowed), g)]

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    def held(step: int) -> int:  # a sequence's blocks of every group, at a step of `step` tokens at its end
        whole = blocks(max_len)
        return sum(whole if w is None else min(whole, blocks(window + step) + 1) for _, w in groups)

    saves = held(1) * g < len(windows) * blocks(max_len)
    fits = held(step_tokens) * g <= len(windows) * (pool_tokens // block_size)
    return groups if saves and fits else []


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window, as `transformers` applies it: a query at position p attends to the keys at
    positions p - window + 1 .. p (masking_utils' `sliding_window_causal_mask_function`), or None for a layer that
    attends to the whole context. Mistral's and Phi-3's `sliding_window` holds in every layer (their modeling code
    reads no `layer_types`); Qwen2's, Qwen3's and Gemma 3's in the layers whose `layer_types` entry is
    "sliding_attention" (Qwen's configs make it from `use_sliding_window` and `max_window_layers`: layers from
    max_window_layers on, and clear the window unless use_sliding_window; Gemma 3's from `sliding_window_pattern`:
    every 6th layer full). Llama 4's chunked layers have a `Chunk` in its place."""
    n = config.num_hidden_layers
    if config.model_type == "llama4_text":  # chunked attention in its rotating layers (`Chunk`)
        size = getattr(config, "attention_chunk_size", None)
        if not size:
            return [None] * n
        return [Chunk(size) if t == "chunked_attention" else None for t in config.layer_types]
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:  # (SmolLM3's config keeps the size)
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in ("mistral", "phi3") or layer_types is None:
        return [int(window)] * n
    return [int(window) if layer_types[i] == "sliding_attention" else None for i in range(n)]


def linear_layers(config) -> list[bool] | None:
    """Which layers are recurrent (Qwen3-Next's `layer_types` "linear_attention": three in four in its checkpoints),
    or None for a model without any."""
    if config.model_type not in LINEAR_ATTENTION_FAMILIES:
        return None
    return [t == "linear_attention" for t in config.layer_types]


def attention_window(config) -> int | None:
    """The sliding window of a model's windowed layers (`layer_windows`), or None where every layer attends to the
    whole context."""
    return next((w for w in layer_windows(config) if w is not None), None)
