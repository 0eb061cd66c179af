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

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


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


def _leg(directory: str, args, prompts: list[list[int]], grouped: bool) -> dict:
    from pylon.serving.engine import engine as engine_module
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    engine_module.HYBRID_KV_CACHE = grouped  # False: one table for every layer, as the engine did before
    engine = LLMEngine(
        directory,
        EngineSpec(
            device="cpu",
            dtype="fp32",
            kv_cache_tokens=args.kv_cache_tokens,
            max_model_len=args.prompt + args.new,
            max_num_seqs=args.sequences,
            max_num_batched_tokens=max(512, args.prompt),
            block_size=16,
            enable_prefix_caching=False,
        ),
    )
    engine_module.HYBRID_KV_CACHE = True
    assert bool(engine.runner.kv_groups) == grouped
    layers = max((len(g) for g, _ in engine.runner.kv_groups), default=args.layers)  # a block's layers
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs: dict[str, list[int]] = {}
    running = held = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        running = max(running, len(engine.scheduler.running))
        held = max([held, *(engine.pool.held_blocks(r.request_id) for r in engine.scheduler.running)])
    seconds = time.perf_counter() - started
    stats = engine.stats()
    return {
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
        "preemptions": engine.scheduler.num_preemptions,
        "prefill_tokens_computed": engine.scheduler.prefill_tokens_computed,
        "forward_passes": stats.forward_passes_total,
        "most_running": running,
        "most_layer_blocks_a_sequence": held * layers,
        "out_tokens_per_s": sum(len(o) for o in outputs.values()) / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256, help="the sliding window, tokens (default 256)")
    parser.add_argument("--sequences", type=int, default=16, help="requests, all at once (default 16)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens each (default 64)")
    parser.add_argument("--new", type=int, default=960, help="tokens generated each (default 960)")
    parser.add_argument("--kv-cache-tokens", type=int, default=6144, help="the KV cache (default 6,144 tokens)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=6, help="layers, every sixth full (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, legs alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    prompts = [[rng.randrange(32, 127) for _ in range(args.prompt)] for _ in range(args.sequences)]
    total = args.sequences * (args.prompt + args.new)
    print(
        f"gemma3_text {args.layers} x {args.hidden}, window {args.window} in five layers of six; "
        f"{args.sequences} sequences of {args.prompt} + "
        f"{args.new} tokens ({total:,} in all) in a KV cache of {args.kv_cache_tokens:,}; fp32, CPU",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = _model(Path(tmp), args)
        legs: dict[str, list[dict]] = {"grouped": [], "one_table": []}
        for _ in range(args.rounds):
            for name in legs:
                legs[name].append(_leg(directory, args, prompts, grouped=name == "grouped"))
    first = {name: runs[0] for name, runs in legs.items()}
    assert first["grouped"]["outputs"] == first["one_table"]["outputs"], "the two legs' outputs differ"
    rates = {name: [r["out_tokens_per_s"] for r in runs] for name, runs in legs.items()}
    row = {
        name: {k: v for k, v in first[name].items() if k != "outputs"} | {"out_tokens_per_s_rounds": rates[name]}
        for name in legs
    }
    row["throughput_ratio"] = statistics.median(rates["grouped"]) / statistics.median(rates["one_table"])
    if args.json:
        print(json.dumps(row))
        return 0
    for name in legs:
        r = row[name]
        print(
            f"{name:>9}: {r['preemptions']:3d} preemptions, {r['prefill_tokens_computed']:6,} prefill tokens computed, "
            f"{r['forward_passes']:5,} forward passes, at most {r['most_running']:2d} running and "
            f"{r['most_layer_blocks_a_sequence']:4d} layers' blocks a sequence; "
            f"{statistics.median(rates[name]):7.1f} out tok/s "
            f"({', '.join(f'{x:.1f}' for x in rates[name])})",
            flush=True,
        )
    print(f"outputs equal; throughput grouped / one table {row['throughput_ratio']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
