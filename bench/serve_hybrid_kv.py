"""A model whose windowed layers mix with full ones (Gemma 3's five in six) with its KV cache in groups of layers, a
block table each (kv_cache.HybridKVBlockPool), against the same engine with one table for every layer, in one run on
the same model and requests, in the same memory.

    .venv/bin/python bench/serve_hybrid_kv.py                 # 16 sequences of 64 + 960 tokens, a 256-token window
    .venv/bin/python bench/serve_hybrid_kv.py --rounds 3 --kv-cache-tokens 8192

A random Gemma 3 (`--layers`, every sixth full, the others attending within `--window` tokens) saved as a Pylon export,
byte tokenizer, greedy, `--sequences` requests of `--prompt` random tokens generating `--new` tokens each, all added at
once to an in-process `LLMEngine` whose KV cache is the memory of `--kv-cache-tokens` tokens in every layer (fewer than
the sequences' contexts together). Two legs: the engine as it runs (the cache in groups: a sequence holds its window's
blocks in the windowed layers' groups, its context's in the full ones'), and the same engine with one table for every
layer (`engine.HYBRID_KV_CACHE = False`: every sequence holds its whole context's blocks in every layer, as before).
Counted, machine-independent: preemptions, the tokens the steps computed (a preempted sequence computes its context
again), forward passes, the most sequences running at once and the most layers' blocks one sequence held (a block of the
grouped cache is a group's layers'); timed on this machine: output tokens/s (median over `--rounds`). The outputs of the
two legs are checked equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from serve_window import arguments, compare, run_leg


def _model(directory: Path, args) -> str:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = Gemma3TextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        sliding_window=args.window,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(args.layers)],
        max_position_embeddings=args.prompt + args.new + 64,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


def _grouped(grouped: bool):
    from pylon.serving.engine import engine as engine_module

    def configure(engine) -> int:
        assert bool(engine.runner.kv_groups) == grouped
        return max((len(g) for g, _ in engine.runner.kv_groups), default=engine.runner.config.num_hidden_layers)

    def leg(directory: str, args, prompts: list[list[int]]) -> dict:
        engine_module.HYBRID_KV_CACHE = grouped  # False: one table for every layer, as the engine did before
        try:
            return run_leg(directory, args, prompts, configure)
        finally:
            engine_module.HYBRID_KV_CACHE = True

    return leg


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, 6, "layers, every sixth full").parse_args(argv)
    title = f"gemma3_text {args.layers} x {args.hidden}, window {args.window} in five layers of six"
    return compare(args, title, _model, {"grouped": _grouped(True), "one_table": _grouped(False)}, "grouped / one")


if __name__ == "__main__":
    sys.exit(main())
