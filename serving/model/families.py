"""The model families the serving engine runs, by `config.json`'s `model_type`, and what their configs say about
attention that the runner must honour.

GPT-2 has a forward pass of its own; the others are built as Llama is (RMSNorm, RoPE, grouped-query attention,
gated MLP) up to what the runner reads from the loaded modules themselves: projection biases (Qwen2 and Qwen2.5),
per-head query and key norms and a head_dim of their own (Qwen3), a sliding window (Mistral 7B v0.1).
"""

from __future__ import annotations

LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILIES)


def attention_window(config) -> int | None:
    """The sliding window of a model's attention (each token attends to the `window` positions up to its own), or
    None where every layer attends to the whole context: Mistral's `sliding_window`, or Qwen2's and Qwen3's when
    `layer_types` holds a "sliding_attention" layer (their configs clear the window unless `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
