"""The model families the serving engine runs, by `config.json`'s `model_type`, and what their configs say about
attention that the runner must honour.

GPT-2 has a forward pass of its own; the others are built as Llama is (RMSNorm, RoPE, grouped-query attention,
gated MLP) up to what the runner reads from the loaded modules themselves: projection biases (Qwen2 and Qwen2.5),
per-head query and key norms and a head_dim of their own (Qwen3), and a sliding window (`layer_windows`): in every
layer of Mistral 7B v0.1, in the layers `layer_types` says of Qwen2's and Qwen3's with `use_sliding_window`. The
runner attends each windowed layer over its window only, as `transformers` does (pylon.serving.model.attention).
"""

from __future__ import annotations

LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILIES)


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window, as `transformers` applies it: a query at position p attends to the keys at
    positions p - window + 1 .. p (masking_utils' `sliding_window_causal_mask_function`), or None for a layer that
    attends to the whole context. Mistral's `sliding_window` holds in every layer (its modeling code reads no
    `layer_types`); Qwen2's and Qwen3's in the layers whose `layer_types` entry is "sliding_attention" (their configs
    make it from `use_sliding_window` and `max_window_layers`: layers from max_window_layers on, and clear the window
    unless use_sliding_window)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or layer_types is None:
        return [int(window)] * n
    return [int(window) if layer_types[i] == "sliding_attention" else None for i in range(n)]


def attention_window(config) -> int | None:
    """The sliding window of a model's windowed layers (`layer_windows`), or None where every layer attends to the
    whole context."""
    return next((w for w in layer_windows(config) if w is not None), None)
