"""Named model shapes (Hugging Face `transformers` configs) that `TrainJob.model.preset` may name.

Small presets are for tests and the demo; the large ones are real shapes for the planner. The
tokenizer defines the vocabulary at training time; `vocab_size` here is the default for the built-in
byte-level tokenizer (256 bytes + special tokens, padded to a multiple of 64).
"""

from __future__ import annotations

import copy

BYTE_VOCAB_SIZE = 320

MODEL_PRESETS: dict[str, dict] = {
    # ~0.2M parameters: unit and integration tests.
    "gpt-tiny": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 64,
        "n_positions": 256,
        "vocab_size": BYTE_VOCAB_SIZE,
    },
    # ~7M parameters: the demo, trainable on two CPU cores in minutes.
    "gpt-small": {
        "model_type": "gpt2",
        "n_layer": 4,
        "n_head": 4,
        "n_embd": 256,
        "n_positions": 512,
        "vocab_size": BYTE_VOCAB_SIZE,
    },
    # GPT-2 (124M) shape.
    "gpt2-124m": {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "n_positions": 1024,
        "vocab_size": 50257,
    },
    "llama-tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "vocab_size": BYTE_VOCAB_SIZE,
    },
    # Qwen3's layout (per-head query and key norms, head_dim apart from hidden_size / heads, tied embeddings) at the
    # size of llama-tiny: tests of the families the serving engine runs beside Llama (pylon.serving.model.families).
    "qwen3-tiny": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "max_position_embeddings": 256,
        "vocab_size": BYTE_VOCAB_SIZE,
    },
    # Llama-2-7B and -13B shapes: for planning memory and cost.
    "llama-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
    "llama-13b": {
        "model_type": "llama",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
}


def preset_config(name: str) -> dict:
    """A copy of the preset's config dict (callers may change it)."""
    return copy.deepcopy(MODEL_PRESETS[name])
