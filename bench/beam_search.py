"""Beam search (`serving/api/beam_search.py`) with the prefix cache on against off, in one run on the same model.

Each step of a beam search asks the engine for one token of every beam, the beam's whole sequence as the prompt: with
the prefix cache (engine.enable_prefix_caching, the default), the blocks the last step computed are found and a step
computes about a block per beam; without it, every step computes every beam's whole sequence again. Legs alternate
over `--rounds`, each on a fresh in-process `AsyncLLMEngine` (a random GPT-2 saved as a Pylon export, byte tokenizer):
`--prompts` searches of `--prompt-tokens` random tokens, `--beams` beams, `--output-tokens` steps, one at a time; then
greedy requests of other prompts as long (nothing cached for them), the baseline of one sequence.

Prints per leg: output tokens/s (the beams' tokens over wall time) and the engine's prefill tokens computed per output
token (a counter that does not depend on the machine); then the ratios on/off with the spread over rounds. A greedy
request of the same length is the baseline: what one beam costs when nothing is searched.

    .venv/bin/python bench/beam_search.py
    .venv/bin/python bench/beam_search.py --beams 8 --prompt-tokens 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(directory: Path) -> None:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2", n_layer=4, n_head=8, n_embd=256, n_positions=4096, vocab_size=320, eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id, pad_token_id=tok.pad_id, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def leg(directory: Path, args, caching: bool, prompts: list[list[int]], others: list[list[int]]) -> dict:
    from pylon.serving.api import beam_search
    from pylon.serving.engine.engine import AsyncLLMEngine, LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    spec = EngineSpec(
        max_num_seqs=max(args.beams, 8), max_num_batched_tokens=2048, kv_cache_tokens=65536, block_size=16,
        max_model_len=4096, device="cpu", dtype="fp32", enable_prefix_caching=caching,
    )  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(str(directory), spec))

    async def run() -> dict:
        params = SamplingParams(max_tokens=args.output_tokens)
        before = engine.engine.stats()
        t0, cpu0, out = time.monotonic(), time.process_time(), 0
        for i, prompt in enumerate(prompts):
            found, _, _ = await beam_search.search(
                engine, f"b{i}", prompt, params, args.beams, args.output_tokens, 1.0, frozenset(), 4096
            )
            out += sum(len(b.tokens) for b in found)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        after = engine.engine.stats()
        greedy_t0 = time.monotonic()
        plain = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(others):  # the baseline: a greedy request of the same length, nothing cached
            async for _ in engine.generate(f"g{i}", prompt, plain):
                pass
        greedy = args.output_tokens * len(prompts) / (time.monotonic() - greedy_t0)
        computed = after.prefill_tokens_computed_total - before.prefill_tokens_computed_total
        return {"tok_s": out / wall, "tok_cpu_s": out / cpu, "computed_per_token": computed / out, "greedy": greedy}

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (rounds {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(32, 127) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    others = [[rng.randrange(32, 127) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        build(directory)
        results = {True: [], False: []}
        for r in range(args.rounds):
            for caching in (True, False) if r % 2 == 0 else (False, True):
                got = leg(directory, args, caching, prompts, others)
                results[caching].append(got)
                print(
                    f"round {r} cache {'on ' if caching else 'off'}: {got['tok_s']:.1f} beam tokens/s "
                    f"({got['tok_cpu_s']:.1f} per CPU s), prefill tokens computed per beam token "
                    f"{got['computed_per_token']:.1f}; greedy baseline {got['greedy']:.1f} tokens/s",
                    flush=True,
                )
    on, off = results[True], results[False]
    print(f"beams {args.beams}, prompt {args.prompt_tokens} tokens, {args.output_tokens} steps")
    print("beam tokens/s, cache on/off:", spread([a["tok_s"] / b["tok_s"] for a, b in zip(on, off)]))
    print("CPU-accounted, on/off:", spread([a["tok_cpu_s"] / b["tok_cpu_s"] for a, b in zip(on, off)]))
    print(
        "prefill tokens computed per beam token, off/on:",
        spread([b["computed_per_token"] / a["computed_per_token"] for a, b in zip(on, off)]),
        f"(on {statistics.median(a['computed_per_token'] for a in on):.1f}, "
        f"off {statistics.median(b['computed_per_token'] for b in off):.1f})",
    )
    print(
        "beam tokens/s against greedy tokens/s (cache on):",
        spread([a["tok_s"] / a["greedy"] for a in on]),
    )


if __name__ == "__main__":
    main()
