"""The prefix cache of a model with recurrent layers (Qwen3-Next's Gated DeltaNet; kv_cache.StateSnapshots): a
multi-turn chat on an engine that keeps snapshots of the recurrent states (`engine.recurrent_state_snapshots`, the
default) against one that keeps none (0: such a model shared no prefix before), legs alternating over `--rounds`, a
fresh chat each round.

A Qwen3-Next-shaped model with random weights (bench/recurrent_decode.py's `build`: `--layers` layers, three recurrent
in four, `--hidden` wide, MoE blocks). A chat: a `--system-tokens` prompt, then `--turns` turns, each adding a
`--user-tokens` message to the whole conversation so far and generating a `--reply-tokens` greedy reply (the next
turn's prompt holds it). Prints the prompt tokens each leg computed (machine-independent: snapshots let a turn start
past the last one) and the chat's wall time, with the spread over rounds.

    .venv/bin/python bench/recurrent_prefix.py --turns 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from recurrent_decode import build


def chat(engine, args, seed: int) -> tuple[int, int, float]:
    """One chat on `engine`: (prompt tokens of every turn, those it computed, seconds)."""
    import torch

    from pylon.serving.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    conversation = torch.randint(0, 256, (args.system_tokens,), generator=g).tolist()
    total = computed = 0
    t0 = time.perf_counter()
    for t in range(args.turns):
        conversation += torch.randint(0, 256, (args.user_tokens,), generator=g).tolist()
        engine.add_request(f"{seed}-{t}", conversation, params)
        reply, cached = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                reply += out.token_ids
                cached = max(cached, out.num_cached_tokens)
        total += len(conversation)
        computed += len(conversation) - cached
        conversation += reply
    return total, computed, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    torch.set_num_threads(args.threads)
    length = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3-next"
        build(directory, args.layers, args.hidden)
        engines = {}
        for snapshots in (16, 0):
            spec = EngineSpec(
                max_num_seqs=4,
                max_num_batched_tokens=512,
                kv_cache_tokens=4 * length,
                max_model_len=length + 16,
                dtype="fp32",
                recurrent_state_snapshots=snapshots,
            )
            engines[snapshots] = LLMEngine(str(directory), spec)
            chat(engines[snapshots], argparse.Namespace(**{**vars(args), "turns": 1}), 99)  # warm-up
        seconds = {16: [], 0: []}
        counted = {}
        for r in range(args.rounds):
            for snapshots in (16, 0) if r % 2 == 0 else (0, 16):
                total, computed, s = chat(engines[snapshots], args, r)
                seconds[snapshots].append(s)
                counted[snapshots] = (total, computed)
        ratios = [a / b for a, b in zip(seconds[0], seconds[16])]
        total, with_snapshots = counted[16]
        _, without = counted[0]
        print(
            f"== a {args.turns}-turn chat ({args.system_tokens}-token system prompt, {args.user_tokens}-token "
            f"messages, {args.reply_tokens}-token replies; {args.layers} layers, {args.hidden} wide)"
        )
        print(
            f"prompt tokens computed: {without:,} without snapshots, {with_snapshots:,} with "
            f"({with_snapshots / without:.2f}x) of {total:,}; snapshots restored {engines[16].snapshots.restored}, "
            f"stored {engines[16].snapshots.stored}"
        )
        print(
            f"chat wall time: without {statistics.median(seconds[0]):.2f} s, with "
            f"{statistics.median(seconds[16]):.2f} s: {statistics.median(ratios):.2f}x faster (rounds "
            f"{min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
