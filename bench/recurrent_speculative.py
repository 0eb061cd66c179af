"""Speculative decoding on a model with recurrent layers (Qwen3-Next's Gated DeltaNet): n-gram drafts verified with each
recurrent layer's state kept after every draft (`ModelRunner.keep_state`), against plain decoding, on the same model and
requests, legs alternating over `--rounds`.

A Qwen3-Next-shaped model with random weights (bench/recurrent_decode.py's `build`: `--layers` layers, three recurrent
in four, `--hidden` wide, MoE blocks), its embeddings tied to its output layer: at the small initializer a random model
so built keeps repeating what it has written, so that prompt lookup's drafts land, as they do on an input-grounded
workload (edits, summaries that copy). Each leg: `--concurrency` requests of a random phrase said three times
(`--prompt-tokens`), greedy, `--output-tokens` each, through an in-process `LLMEngine`; the speculating engine's
measured rule (engine/speculative.py) decides each step whether drafts pay. Prints output tokens/s for each leg and
their ratio with the spread over rounds, the drafts proposed and accepted, and the model's forward passes per output
token (machine-independent).

    .venv/bin/python bench/recurrent_speculative.py --concurrency 1 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from recurrent_decode import build


def leg(engine, concurrency: int, args, seed: int) -> tuple[float, int]:
    """(output tokens/s, forward passes) of `concurrency` requests on `engine`, prefill included."""
    import torch

    from pylon.serving.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        phrase = torch.randint(0, 256, (args.prompt_tokens // 3,), generator=g).tolist()
        engine.add_request(f"{seed}-{i}", phrase * 3, params)
    steps, tokens, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    return tokens / (time.perf_counter() - t0), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=4, help="engine.speculative.num_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3-next"
        build(directory, args.layers, args.hidden, tie_word_embeddings=True)
        print(f"== recurrent layers: n-gram speculation vs plain decoding ({args.layers} layers, {args.hidden} wide)")
        for c in args.concurrency:
            engines = {}
            for name, speculative in (("plain", {}), ("ngram", {"method": "ngram", "num_tokens": args.num_tokens})):
                spec = EngineSpec(
                    max_num_seqs=max(c, 1),
                    max_num_batched_tokens=4096,
                    kv_cache_tokens=c * 256 + 512,
                    max_model_len=256,
                    dtype="fp32",
                    enable_prefix_caching=False,  # every round computes its prompts
                    speculative=speculative,
                )
                engines[name] = LLMEngine(str(directory), spec)
                leg(engines[name], c, args, 99)  # warm-up (the rule's first measures too)
            speeds = {"plain": [], "ngram": []}
            passes = {}
            for r in range(args.rounds):
                for name in ("plain", "ngram") if r % 2 == 0 else ("ngram", "plain"):
                    speed, steps = leg(engines[name], c, args, r)
                    speeds[name].append(speed)
                    passes[name] = steps / (c * args.output_tokens)
            ratios = [a / b for a, b in zip(speeds["ngram"], speeds["plain"])]
            stats = engines["ngram"].stats()
            rate = stats.spec_accepted_tokens_total / max(stats.spec_draft_tokens_total, 1)
            print(
                f"concurrency {c}: plain {statistics.median(speeds['plain']):.1f} tok/s, ngram "
                f"{statistics.median(speeds['ngram']):.1f} tok/s: {statistics.median(ratios):.2f}x (rounds "
                f"{min(ratios):.2f}-{max(ratios):.2f}); drafts {stats.spec_draft_tokens_total:,}, accepted {rate:.0%}, "
                f"verifying steps {stats.spec_verify_steps_total:,}; forward passes per output token "
                f"{passes['plain']:.2f} -> {passes['ngram']:.2f}"
            )


if __name__ == "__main__":
    main()
