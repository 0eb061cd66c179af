"""Prefix caching, on against off, in one run on the same model and the same requests.

Two workloads, each run with `engine.enable_prefix_caching` on and off, alternating over `--rounds` rounds, on a fresh
in-process `LLMEngine` per leg (a random GPT-2 saved as a Pylon export, byte tokenizer; greedy decoding):

(a) **shared prefix**: a system prompt of `--system-tokens` (~1,000) tokens before short questions, and multi-turn
    chats (each turn's prompt is the previous turn's prompt, its answer and a new question), `--concurrency` requests
    open at a time (closed loop: a finished request's slot takes the next), after one request of the system prompt
    that is not counted (the steady state of a deployment that has served before);
(b) **no reuse**: random prompts of the same lengths, one turn each: nothing shared.

Prints per leg: median and p90 time to first token, output tokens/s, and the engine's own counters (prompt tokens
looked up and found in the cache; prefill tokens computed by steps: machine-independent). Then the ratios off/on:
TTFT (target >= 3x lower with the cache), throughput on/off (target >= 1.5x), prefill tokens computed on/off (about
1 - the shared fraction), and for (b) throughput on/off (target >= 0.97x), each as the median over rounds with the
spread.

    .venv/bin/python bench/prefix_cache.py                  # CPU, ~5 min
    .venv/bin/python bench/prefix_cache.py --rounds 5 --questions 48
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def workload(args, shared: bool) -> list[list[list[int]]]:
    """Conversations: each a list of turns' new tokens (the first turn's includes the system prompt when `shared`).
    Single questions are one-turn conversations. Token ids < 256 (bytes of the byte tokenizer)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(32, 127) for _ in range(args.system_tokens)]
    convs = []
    for i in range(args.questions):
        turns = 1 if i % 4 or not shared else args.turns  # with a shared prefix, one conversation in four is a chat
        conv = []
        for t in range(turns):
            question = [rng.randrange(32, 127) for _ in range(rng.randint(8, args.question_tokens))]
            if t == 0:
                head = system if shared else [rng.randrange(32, 127) for _ in range(args.system_tokens)]
                question = head + question
            conv.append(question)
        convs.append(conv)
    return convs


def run_leg(directory: str, args, convs: list[list[list[int]]], warm_up: list[int], caching: bool) -> dict:
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    engine = LLMEngine(
        directory,
        EngineSpec(
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_tokens=args.kv_cache_tokens,
            block_size=16,
            max_model_len=args.max_model_len,
            device="cpu",
            dtype="fp32",
            enable_prefix_caching=caching,
        ),
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    # Steady state, as a deployment that has served before sees it: one request, not counted, on both legs: the
    # system prompt when there is one (with the cache on, it leaves it cached), else a prompt no request shares.
    engine.generate([warm_up], SamplingParams(max_tokens=1, temperature=0))
    warm = engine.stats()
    pending = [(i, 0, []) for i in range(len(convs))]  # (conversation, turn, history tokens)
    pending.reverse()
    open_, ttft, out_tokens = {}, [], 0
    cpu0, t0 = time.process_time(), time.monotonic()
    n = 0
    while pending or open_:
        while pending and len(open_) < args.concurrency:
            conv, turn, history = pending.pop()
            prompt = history + convs[conv][turn]
            rid = f"r{n}"
            n += 1
            engine.add_request(rid, prompt, params)
            open_[rid] = (conv, turn, prompt, [])
        for out in engine.step():
            conv, turn, prompt, got = open_[out.request_id]
            got.extend(out.token_ids)
            if out.finished:
                del open_[out.request_id]
                ttft.append(out.metrics.time_to_first_token)
                out_tokens += len(got)
                if turn + 1 < len(convs[conv]):  # the chat's next turn: its whole history, then a new question
                    pending.append((conv, turn + 1, prompt + got))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    stats = engine.stats()
    ttft.sort()
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "tok_s": out_tokens / wall,
        "tok_cpu_s": out_tokens / cpu,
        "requests": len(ttft),
        "queries": stats.prefix_cache_queries_total - warm.prefix_cache_queries_total,
        "hits": stats.prefix_cache_hits_total - warm.prefix_cache_hits_total,
        "prefill": stats.prefill_tokens_computed_total - warm.prefill_tokens_computed_total,
        "wall": wall,
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (rounds {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--questions", type=int, default=32, help="conversations per workload (default 32)")
    p.add_argument("--turns", type=int, default=3, help="turns of each multi-turn chat (one conversation in four)")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=40, help="a question's tokens at most (8 at least)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from serve_load_legs import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = {"shared": workload(args, True), "random": workload(args, False)}
    rng = random.Random(args.seed + 1)
    warm_ups = {
        "shared": workloads["shared"][0][0][: args.system_tokens] + [10],
        "random": [rng.randrange(32, 127) for _ in range(args.system_tokens)],
    }
    for name, convs in workloads.items():
        prompts = [t for c in convs for t in c]
        print(
            f"workload {name}: {len(convs)} conversations, {len(prompts)} requests, first-turn prompts "
            f"{min(len(c[0]) for c in convs)}-{max(len(c[0]) for c in convs)} tokens, {args.output_tokens} out"
        )
    results: dict[tuple[str, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pylon-bench-prefix-") as tmp:
        build_model(
            argparse.Namespace(
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
                n_positions=args.max_model_len,
                seed=args.seed,
                device="cpu",
                dtype="fp32",
            ),
            Path(tmp),
        )
        for r in range(args.rounds):
            for name, convs in workloads.items():
                for caching in (True, False) if r % 2 == 0 else (False, True):  # alternate which goes first
                    res = run_leg(tmp, args, convs, warm_ups[name], caching)
                    results.setdefault((name, caching), []).append(res)
                    print(
                        f"round {r + 1} {name:6s} cache {'on ' if caching else 'off'}: TTFT p50 "
                        f"{res['ttft_p50'] * 1000:8.1f} ms p90 {res['ttft_p90'] * 1000:8.1f} ms  "
                        f"{res['tok_s']:7.1f} out tok/s ({res['tok_cpu_s']:7.1f}/CPU-s)  prefill computed "
                        f"{res['prefill']:7d}  cache hits {res['hits']}/{res['queries']}  {res['wall']:.1f} s",
                        flush=True,
                    )

    def ratios(name: str, key: str, invert: bool = False) -> list[float]:
        on, off = results[(name, True)], results[(name, False)]
        return [(b[key] / a[key]) if invert else (a[key] / b[key]) for a, b in zip(on, off)]

    on, off = results[("shared", True)][0], results[("shared", False)][0]
    print("\nshared prefix (a):")
    print(f"  median TTFT, off / on:        {spread(ratios('shared', 'ttft_p50', invert=True))}  target >= 3x")
    print(f"  output tokens/s, on / off:    {spread(ratios('shared', 'tok_s'))}  target >= 1.5x")
    print(f"  per CPU-second, on / off:     {spread(ratios('shared', 'tok_cpu_s'))}")
    print(
        f"  prefill tokens computed:      on {on['prefill']}, off {off['prefill']}: "
        f"{on['prefill'] / off['prefill']:.3f} of off; cache hits {on['hits']} of {on['queries']} tokens looked up "
        f"(1 - hit fraction = {1 - on['hits'] / on['queries']:.3f})"
    )
    print("no reuse (b):")
    print(f"  output tokens/s, on / off:    {spread(ratios('random', 'tok_s'))}  target >= 0.97x")
    print(f"  per CPU-second, on / off:     {spread(ratios('random', 'tok_cpu_s'))}")
    r_on = results[("random", True)][0]
    print(f"  cache hits {r_on['hits']} of {r_on['queries']} tokens looked up")


if __name__ == "__main__":
    main()
