"""A model windowed in every layer with its blocks before the window let go of, against the same engine keeping them,
in one run on the same model and requests.

    .venv/bin/python bench/serve_window.py                 # 16 sequences of 64 + 960 tokens, a 256-token window
    .venv/bin/python bench/serve_window.py --rounds 3 --kv-cache-tokens 8192

A random Mistral (every layer attending within `--window` tokens) saved as a Pylon export, byte tokenizer, greedy,
`--sequences` requests of `--prompt` random tokens generating `--new` tokens each, all added at once to an in-process
`LLMEngine` whose KV cache holds `--kv-cache-tokens` tokens (fewer than the sequences' contexts together). Two legs:
the engine as it runs (each sequence lets go of its blocks before the window: `KVBlockPool.trim`), and the same engine
with that switched off (every sequence holds its whole context's blocks, as before). Counted, machine-independent:
preemptions, the tokens the steps computed (a preempted sequence computes its context again), forward passes, the most
sequences running at once and the most blocks one sequence held; timed on this machine: output tokens/s (median over
`--rounds`). The outputs of the two legs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _model(directory: Path, args) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = MistralConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        sliding_window=args.window,
        max_position_embeddings=args.prompt + args.new + 64,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


def run_leg(directory: str, args, prompts: list[list[int]], configure: Callable) -> dict:
    """The requests through an in-process engine, `configure(engine)` first (it returns the layers a block of the
    engine's pool holds): what the legs count and time (see the module's docs); bench/serve_hybrid_kv.py's too."""
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

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
    layers = configure(engine)
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
        "most_blocks_a_sequence": held,
        "layers_a_block": layers,
        "out_tokens_per_s": sum(len(o) for o in outputs.values()) / seconds,
    }


def _trimmed(trim: bool) -> Callable:
    def configure(engine) -> int:
        if not trim:  # the engine as it was: every sequence keeps its whole context's blocks
            engine.scheduler.window = None
        return 1

    def leg(directory: str, args, prompts: list[list[int]]) -> dict:
        return run_leg(directory, args, prompts, configure)

    return leg


def arguments(doc: str, layers: int, layers_help: str) -> argparse.ArgumentParser:
    """The options both window benches take (`layers`: the default layer count)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256, help="the sliding window, tokens (default 256)")
    parser.add_argument("--sequences", type=int, default=16, help="requests, all at once (default 16)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens each (default 64)")
    parser.add_argument("--new", type=int, default=960, help="tokens generated each (default 960)")
    parser.add_argument("--kv-cache-tokens", type=int, default=6144, help="the KV cache (default 6,144 tokens)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=layers, help=f"{layers_help} (default {layers})")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, legs alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    return parser


def compare(args, title: str, model: Callable, legs: dict[str, Callable], ratio: str) -> int:
    """Run `legs` (name -> leg(directory, args, prompts), `run_leg`'s dict; the first the engine as it runs)
    `args.rounds` times alternating on `model(directory, args)`'s model, check their outputs equal, and print what
    they counted and their tokens/s."""
    rng = random.Random(1)
    prompts = [[rng.randrange(32, 127) for _ in range(args.prompt)] for _ in range(args.sequences)]
    total = args.sequences * (args.prompt + args.new)
    print(
        f"{title}; {args.sequences} sequences of {args.prompt} + {args.new} tokens ({total:,} in all) in a KV cache of "
        f"{args.kv_cache_tokens:,}; fp32, CPU",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = model(Path(tmp), args)
        runs: dict[str, list[dict]] = {name: [] for name in legs}
        for _ in range(args.rounds):
            for name, leg in legs.items():
                runs[name].append(leg(directory, args, prompts))
    first = {name: r[0] for name, r in runs.items()}
    new, old = list(legs)
    assert first[new]["outputs"] == first[old]["outputs"], "the two legs' outputs differ"
    rates = {name: [r["out_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    row = {
        name: {k: v for k, v in first[name].items() if k != "outputs"} | {"out_tokens_per_s_rounds": rates[name]}
        for name in legs
    }
    row["throughput_ratio"] = statistics.median(rates[new]) / statistics.median(rates[old])
    if args.json:
        print(json.dumps(row))
        return 0
    width = max(len(name) for name in legs)
    for name in legs:
        r = row[name]
        each = f" ({r['layers_a_block']} layers each)" if r["layers_a_block"] > 1 else ""
        print(
            f"{name:>{width}}: {r['preemptions']:3d} preemptions, {r['prefill_tokens_computed']:6,} prefill tokens "
            f"computed, {r['forward_passes']:5,} forward passes, at most {r['most_running']:2d} running and "
            f"{r['most_blocks_a_sequence']:3d} blocks a sequence{each}; {statistics.median(rates[name]):7.1f} out "
            f"tok/s ({', '.join(f'{x:.1f}' for x in rates[name])})",
            flush=True,
        )
    print(f"outputs equal; throughput {ratio} {row['throughput_ratio']:.2f}x", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, 2, "layers").parse_args(argv)
    title = f"mistral {args.layers} x {args.hidden}, window {args.window}"
    return compare(args, title, _model, {"trimmed": _trimmed(True), "kept": _trimmed(False)}, "trimmed / kept")


if __name__ == "__main__":
    sys.exit(main())
