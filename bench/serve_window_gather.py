"""A windowed layer's attention reading only the blocks its queries' windows hold, against reading every block from
position 0 and masking (`pylon.serving.model.attention.WINDOW_GATHER`), in one run on the same models and requests.

    .venv/bin/python bench/serve_window_gather.py                  # 4 sequences of 4,096 + 64 tokens, a 256 window
    .venv/bin/python bench/serve_window_gather.py --rounds 3 --prompt 8192

Two random models saved as Pylon exports, byte tokenizer, fp32: a Mistral (every layer attending within `--window`
tokens) and a Qwen2 whose layers after the first attend within it (three in four: Gemma 3's and gpt-oss's kind of
mix, the full layer reading every block either way). `--sequences` requests of `--prompt` random tokens generating
`--new` tokens each, all added at once to an in-process `LLMEngine` (prefix caching off). Two legs a model: window
blocks only (as the engine runs) and every block (`WINDOW_GATHER` off, as before). Counted, machine-independent: the
keys a windowed layer's decode attended to on average (gathered, padding included), and a prompt chunk's; timed on
this machine: the prompts' seconds and the decodes' output tokens/s (medians over `--rounds`, legs alternating). The
outputs of the two legs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def _model(directory: Path, kind: str, args) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    shared = {
        "vocab_size": tok.vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 3,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": args.window,
        "max_position_embeddings": args.prompt + args.new + 64,
        "eos_token_id": tok.eos_id,
        "bos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
    }
    torch.manual_seed(0)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**shared))
    else:  # every layer from the second on windowed (Qwen's max_window_layers)
        model = Qwen2ForCausalLM(Qwen2Config(**shared, use_sliding_window=True, max_window_layers=1))
    model.eval().save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


def _leg(directory: str, args, prompts: list[list[int]], gather: bool) -> dict:
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.serving.model import attention
    from pylon.specs import EngineSpec

    engine = LLMEngine(
        directory,
        EngineSpec(
            device="cpu",
            dtype="fp32",
            kv_cache_tokens=len(prompts) * (args.prompt + args.new + 32),
            max_model_len=args.prompt + args.new,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=512,
            block_size=16,
            enable_prefix_caching=False,
        ),
    )
    attention.WINDOW_GATHER = gather
    keys = {"decode": [], "chunk": []}
    group, chunk = attention._group, attention._chunk

    def counted_group(seqs, *a):  # the keys each windowed decode's attention reads (its group's, padding included)
        g = group(seqs, *a)
        if a[-1] is not None:
            keys["decode"].extend([g.num_keys] * len(seqs))
        return g

    def counted_chunk(seq, *a):  # and each windowed prompt chunk's that reads the cache
        c = chunk(seq, *a)
        if a[-1] is not None and c.key_blocks is not None:
            keys["chunk"].append(c.start + c.num_new - c.key_start)
        return c

    attention._group, attention._chunk = counted_group, counted_chunk
    try:
        params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outputs: dict[str, list[int]] = {}
        started = time.perf_counter()
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if first is None and len(outputs) == len(prompts):  # every prompt done: decodes from here
                first = time.perf_counter()
        ended = time.perf_counter()
    finally:
        attention._group, attention._chunk = group, chunk
        attention.WINDOW_GATHER = True
    decoded = sum(len(o) for o in outputs.values()) - len(prompts)
    return {
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
        "decode_keys_mean": statistics.fmean(keys["decode"]),
        "chunk_keys_mean": statistics.fmean(keys["chunk"]) if keys["chunk"] else 0.0,
        "prompt_s": first - started,
        "decode_tokens_per_s": decoded / (ended - first),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256, help="the sliding window, tokens (default 256)")
    parser.add_argument("--sequences", type=int, default=4, help="requests, all at once (default 4)")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens each (default 4,096)")
    parser.add_argument("--new", type=int, default=64, help="tokens generated each (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, legs alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    prompts = [[rng.randrange(32, 127) for _ in range(args.prompt)] for _ in range(args.sequences)]
    print(
        f"{args.layers} x {args.hidden}, window {args.window}; {args.sequences} sequences of {args.prompt:,} + "
        f"{args.new} tokens; fp32, CPU",
        flush=True,
    )
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mistral", "qwen2-mixed"):
            directory = _model(Path(tmp) / kind, kind, args)
            legs: dict[str, list[dict]] = {"window": [], "every": []}
            for _ in range(args.rounds):
                for name in legs:
                    legs[name].append(_leg(directory, args, prompts, gather=name == "window"))
            assert legs["window"][0]["outputs"] == legs["every"][0]["outputs"], f"{kind}: the legs' outputs differ"
            row = {}
            for name, runs in legs.items():
                row[name] = {
                    "decode_keys_mean": runs[0]["decode_keys_mean"],
                    "chunk_keys_mean": runs[0]["chunk_keys_mean"],
                    "prompt_s_rounds": [r["prompt_s"] for r in runs],
                    "decode_tokens_per_s_rounds": [r["decode_tokens_per_s"] for r in runs],
                }
            med = {n: statistics.median(row[n]["decode_tokens_per_s_rounds"]) for n in legs}
            pre = {n: statistics.median(row[n]["prompt_s_rounds"]) for n in legs}
            row["decode_ratio"] = med["window"] / med["every"]
            row["prompt_ratio"] = pre["window"] / pre["every"]
            report[kind] = row
            if not args.json:
                for name in legs:
                    r = row[name]
                    print(
                        f"{kind:>12} {name:>6}: a windowed decode reads {r['decode_keys_mean']:7.1f} keys, a chunk "
                        f"{r['chunk_keys_mean']:7.1f}; prompts {pre[name]:6.2f} s "
                        f"({', '.join(f'{x:.2f}' for x in r['prompt_s_rounds'])}), decodes {med[name]:7.1f} tok/s "
                        f"({', '.join(f'{x:.1f}' for x in r['decode_tokens_per_s_rounds'])})",
                        flush=True,
                    )
                print(
                    f"{kind:>12}: outputs equal; window / every: decode tok/s {row['decode_ratio']:.2f}x, "
                    f"prompt seconds {row['prompt_ratio']:.2f}x",
                    flush=True,
                )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
