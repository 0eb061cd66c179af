"""Suffix decoding (`engine.speculative.method: suffix`) against plain decoding and prompt lookup on a workload that
asks again what it asked before, as agents, tool loops and templated traffic do.

The model is the Llama-shaped byte model bench/serve_eagle.py trains (`--train-steps` steps on the first 90% of
tinyshakespeare). The workload: `--requests` requests a leg, each prompt a 64-byte window of the held-out text drawn
from a pool of `--pool` windows (so most prompts were asked before, by an earlier round or an earlier request of
the same round), greedy, `--output-tokens` each, `--concurrency` at a time, through an in-process `LLMEngine` per leg
kept across rounds (suffix decoding's cache of finished outputs fills as traffic goes by; the first round starts
empty). Prints output tokens/s per leg, each speculating leg's ratio to plain with the spread over rounds, drafts
proposed and accepted, and the model's forward passes per output token (machine-independent).

    .venv/bin/python bench/serve_suffix.py --concurrency 1 8

Draft trees (`engine.speculative.tree_width`): `--tree-width W` adds the legs `ngram-tree` and `suffix-tree`, the same
methods drafting trees of `--num-tokens` nodes, up to W children a node. Their case is output that varies where the
same text was followed differently before: `--temperature T` samples every request (seeded, the same seeds in every
leg, so each leg's outputs are the same tokens). `--always` speculates every step the drafts allow (the measured rule
off), so that tokens a speculating step and passes per output token depend on the traffic and the model only.

    .venv/bin/python bench/serve_suffix.py --concurrency 1 8 --temperature 0.8 --tree-width 3 --always
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from serve_eagle import train_model
from serve_mtp import corpus, engine

LEGS = ("plain", "ngram", "suffix")


def leg(eng, concurrency: int, args, pool: list[list[int]], seed: int) -> tuple[float, int]:
    """(output tokens/s, steps) of `--requests` requests drawn from `pool`, `concurrency` at a time."""
    from pylon.serving.engine.sampling import SamplingParams

    rng = random.Random(seed)
    queue = [rng.choice(pool) for _ in range(args.requests)]
    steps, tokens, started, n = 0, 0, time.perf_counter(), 0
    while queue or eng.has_unfinished():
        while queue and len(eng.scheduler.running) + len(eng.scheduler.waiting) < concurrency:
            params = SamplingParams(
                max_tokens=args.output_tokens, temperature=args.temperature, seed=seed * 100_000 + n, ignore_eos=True
            )
            eng.add_request(f"{seed}-{n}", queue.pop(), params)
            n += 1
        tokens += sum(len(o.token_ids) for o in eng.step())
        steps += 1
    return tokens / (time.perf_counter() - started), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=32, help="requests a leg and round")
    parser.add_argument("--pool", type=int, default=24, help="distinct prompts the requests are drawn from")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=8, help="engine.speculative.num_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded")
    parser.add_argument("--tree-width", type=int, default=1, help=">1: also the legs drafting trees this wide")
    parser.add_argument("--model-dir", help="keep the trained model here and reuse it when it is there already")
    parser.add_argument("--always", action="store_true", help="speculate whenever there are drafts (rule off)")
    args = parser.parse_args()
    legs = LEGS + (("ngram-tree", "suffix-tree") if args.tree_width > 1 else ())

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.model_dir) if args.model_dir else Path(tmp) / "llama"
        print(
            f"== suffix decoding vs plain decoding and prompt lookup ({args.layers} layers, {args.hidden} wide, "
            f"{args.requests} requests a round from {args.pool} prompts, num_tokens {args.num_tokens}, temperature "
            f"{args.temperature}, tree_width {args.tree_width}{', every step speculating' if args.always else ''})"
        )
        train_ids, held = corpus()
        if not (directory / "config.json").exists():  # (--model-dir: trained once, kept for the next runs)
            train_model(directory, train_ids, args)
        rng = random.Random(7)
        pool = [held[s : s + args.prompt_tokens] for s in rng.sample(range(len(held) - args.prompt_tokens), args.pool)]
        for c in args.concurrency:
            engines = {}
            for name in legs:
                method, _, tree = name.partition("-")
                speculative = {"method": method, "num_tokens": args.num_tokens} if name != "plain" else {}
                if tree:
                    speculative["tree_width"] = args.tree_width
                engines[name] = engine(directory, c, speculative)
                if args.always and name != "plain":
                    engines[name].spec_policy.decide = lambda decodes, drafts, other, **_: decodes > 0 and drafts > 0
            speeds: dict[str, list[float]] = {name: [] for name in legs}
            passes: dict[str, list[float]] = {name: [] for name in legs}
            for r in range(args.rounds):
                for name in legs if r % 2 == 0 else legs[::-1]:
                    speed, steps = leg(engines[name], c, args, pool, r)
                    speeds[name].append(speed)
                    passes[name].append(steps * min(c, args.requests) / (args.requests * args.output_tokens))
            print(f"concurrency {c}: plain {statistics.median(speeds['plain']):.1f} tok/s")
            for name in legs[1:]:
                ratios = [a / b for a, b in zip(speeds[name], speeds["plain"])]
                stats = engines[name].stats()
                rate = stats.spec_accepted_tokens_total / max(stats.spec_draft_tokens_total, 1)
                by_round = ", ".join(f"{p:.2f}" for p in passes[name])
                print(
                    f"  {name}: {statistics.median(speeds[name]):.1f} tok/s, {statistics.median(ratios):.2f}x (rounds "
                    f"{', '.join(f'{x:.2f}' for x in ratios)}); drafts {stats.spec_draft_tokens_total:,}, accepted "
                    f"{rate:.0%}, {engines[name].spec_policy.mean_acceptance_length:.2f} tokens a speculating step; "
                    f"model passes per output token by round {by_round} (plain "
                    f"{statistics.median(passes['plain']):.2f})"
                    + (
                        f"; {stats.spec_tree_branch_tokens_total:,} accepted off a tree's first path"
                        if "-" in name
                        else ""
                    )
                )


if __name__ == "__main__":
    main()
