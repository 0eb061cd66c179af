"""Which prefill replica computes a prompt (a deployment's `prefill` with several prefill replicas): routed by the
prefix each caches (PrefixAffinityRouter's policy, `routing.choose`) against Serve's own balancing (power of two
choices on load alone), on conversations whose every turn goes to a prefill replica: in one run, the same model,
conversations and engine processes.

    .venv/bin/python bench/serve_prefill_routing.py                 # 2 prefill engines, 12 conversations of 4 turns
    .venv/bin/python bench/serve_prefill_routing.py --rounds 3 --prefill-replicas 3

A random Llama saved as a Pylon export, byte tokenizer, greedy, `ignore_eos`. Engine processes as replicas
(`ProcessLLMEngine`, one thread each): one decodes (the replica that took the requests), `--prefill-replicas` compute
prompts. `--conversations` run at once; each opens with `--opening` random tokens and then, `--turns` times, asks
for `--ask` tokens and adds them and `--turn` new tokens to its history. Every turn is sent to a prefill replica
from the first block the decoding engine does not hold (as `RemotePrefill` does); the prefill replica computes the
whole prompt its own prefix cache does not hold, and sends the blocks.

- `prefix`: the decision of Pylon's router (`routing.choose` over a `ReplicaView` per prefill engine): each view
  takes its engine's cached-block report every `ROUTING_STATS_PERIOD_S`, counts what it routed since, and its
  engine's prompts in flight (Serve's queue-length probe, here exact);
- `load`: Serve's default for a deployment handle: two prefill replicas at random, the one with fewer prompts in
  flight (ties either way).

Counted, machine-independent: prompt tokens the prefill engines computed (what routing saves), and routing
decisions by kind. Timed on this machine: the turns' time to first token (median, p90) and the run's wall time,
median over `--rounds`, legs alternating. Every output is checked equal across legs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

from serve_offload import _model  # (the same random Llama: --hidden, --layers, --max-model-len)


class _Prefills:
    """The prefill engines and one routing policy over them."""

    def __init__(self, engines: list, policy: str, capacity: int, rng: random.Random):
        from pylon.serving.api import routing

        self.engines, self.policy, self.rng = engines, policy, rng
        self.views = [routing.ReplicaView(capacity=capacity) for _ in engines]
        self.in_flight = [0] * len(engines)
        self.decisions: dict[str, int] = {}
        self._reporting = asyncio.create_task(self._report(capacity)) if policy == "prefix" else None

    async def _report(self, capacity: int) -> None:
        """Each prefill engine's routing stats, as a replica reports them to Serve's controller."""
        from pylon.serving.api import routing

        while True:
            for engine, view in zip(self.engines, self.views):
                blocks = await asyncio.to_thread(engine.cached_block_hashes)
                view.update({"blocks": routing.short_hashes(blocks), "capacity": capacity})
            await asyncio.sleep(routing.ROUTING_STATS_PERIOD_S)

    def close(self) -> None:
        if self._reporting is not None:
            self._reporting.cancel()

    def choose(self, hashes: list[bytes]) -> int:
        from pylon.serving.api import routing

        if self.policy == "load":  # Serve's PowerOfTwoChoicesRequestRouter on queue lengths alone
            a, b = self.rng.sample(range(len(self.engines)), 2) if len(self.engines) > 1 else (0, 0)
            pick = a if (self.in_flight[a], self.rng.random()) < (self.in_flight[b], 0.5) else b
            self.decisions["load"] = self.decisions.get("load", 0) + 1
            return pick
        key = routing.RoutingKey(tuple(h[: routing.HASH_BYTES] for h in hashes))
        now = time.monotonic()
        for view, n in zip(self.views, self.in_flight):
            view.ongoing = n
        order, why = routing.choose(dict(enumerate(self.views)), key, now, self.rng)
        self.views[order[0]].routed(key, now)
        kind = why.split(":")[0]
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
        return order[0]


async def _conversation(c: int, decoder, prefills: _Prefills, args, salt: str, ttft: list, outputs: list) -> None:
    from pylon.serving.engine.kv_cache import prompt_prefix
    from pylon.serving.engine.sampling import SamplingParams

    rng = random.Random(1000 + c)
    history = [rng.randrange(256) for _ in range(args.opening)]
    ask = SamplingParams(max_tokens=args.ask, temperature=0, ignore_eos=True, cache_salt=salt)
    for t in range(args.turns):
        started = time.perf_counter()
        ids, hashes = prompt_prefix(None, history, args.block_size, ask)
        held = decoder.cached_prefix_blocks(hashes)
        i = prefills.choose(hashes)
        prefills.in_flight[i] += 1
        run = SamplingParams(max_tokens=1, temperature=0, kv_export_from=held, cache_salt=salt)
        last = None
        try:
            async for out in prefills.engines[i].generate(f"{salt}-c{c}-t{t}-p", ids, run):
                last = out
        finally:
            prefills.in_flight[i] -= 1
        params = dataclasses.replace(ask, kv_import=last.kv_transfer)
        first, tokens = None, []
        async for out in decoder.generate(f"{salt}-c{c}-t{t}", ids, params):
            first = first or time.perf_counter()
            tokens.extend(out.token_ids)
        ttft.append(first - started)
        outputs[c].append(tokens)
        history = ids + tokens + [rng.randrange(256) for _ in range(args.turn)]


async def _leg(decoder, engines: list, policy: str, args, salt: str, rng: random.Random) -> dict:
    before = [e.stats() for e in engines]
    prefills = _Prefills(engines, policy, capacity=args.max_num_seqs, rng=rng)
    ttft: list[float] = []
    outputs: list[list] = [[] for _ in range(args.conversations)]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(
            *(_conversation(c, decoder, prefills, args, salt, ttft, outputs) for c in range(args.conversations))
        )
    finally:
        prefills.close()
    wall = time.perf_counter() - t0
    after = [e.stats() for e in engines]
    ttft.sort()
    return {
        "outputs": outputs,
        "computed": sum(
            a.prefill_tokens_computed_total - b.prefill_tokens_computed_total for a, b in zip(after, before)
        ),
        "decisions": dict(prefills.decisions),
        "ttft_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "wall_s": wall,
    }


async def _run(directory: str, args) -> dict:
    from pylon.serving.engine.process import ProcessLLMEngine
    from pylon.specs import EngineSpec

    spec = EngineSpec(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        device="cpu",
        dtype="fp32",
    )
    env = {"OMP_NUM_THREADS": "1"}
    decoder = ProcessLLMEngine(directory, spec, env=env)
    engines = [ProcessLLMEngine(directory, spec, env=env) for _ in range(args.prefill_replicas)]
    legs: dict[str, list[dict]] = {"load": [], "prefix": []}
    try:
        for r in range(args.rounds):
            for policy in ("load", "prefix") if r % 2 == 0 else ("prefix", "load"):
                # (a cache salt of the leg's own: the same conversations, found in no engine's prefix cache)
                got = await _leg(decoder, engines, policy, args, f"{policy}-{r}", random.Random(r))
                legs[policy].append(got)
                print(f"round {r + 1} {policy}: {_line(got)}", flush=True)
    finally:
        for e in [decoder, *engines]:
            e.shutdown()
    return legs


def _line(leg: dict) -> str:
    decided = ", ".join(f"{k} {v}" for k, v in sorted(leg["decisions"].items()))
    return (
        f"prefill engines computed {leg['computed']:,} prompt tokens; routed: {decided}; turns' TTFT median "
        f"{leg['ttft_s'] * 1e3:.0f} ms, p90 {leg['ttft_p90_s'] * 1e3:.0f} ms; {leg['wall_s']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill-replicas", type=int, default=2, help="prefill engines (replicas)")
    p.add_argument("--conversations", type=int, default=12, help="conversations at once")
    p.add_argument("--turns", type=int, default=4, help="turns of each")
    p.add_argument("--opening", type=int, default=768, help="a conversation's first prompt's tokens")
    p.add_argument("--turn", type=int, default=256, help="new tokens each later turn adds")
    p.add_argument("--ask", type=int, default=16, help="tokens each turn asks for")
    p.add_argument("--max-num-seqs", type=int, default=16, help="each engine's sequence slots")
    p.add_argument("--chunk", type=int, default=512, help="engine.max_num_batched_tokens (a prompt's chunk)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.opening + args.turns * (args.turn + args.ask) > args.max_model_len:
        raise SystemExit("--opening + --turns x (--turn + --ask) must fit --max-model-len")
    with tempfile.TemporaryDirectory() as tmp:
        directory = _model(Path(tmp) / "llama", args)
        legs = asyncio.run(_run(directory, args))
    first = legs["load"][0]["outputs"]
    bad = [f"{k} {i}" for k, runs in legs.items() for i, leg in enumerate(runs) if leg["outputs"] != first]
    if bad:
        raise SystemExit(f"the legs' outputs differ ({bad}): routing changed what was computed")
    print("every leg's outputs are the same tokens")

    def med(policy: str, key: str) -> float:
        return statistics.median(leg[key] for leg in legs[policy])

    turns = args.conversations * args.turns
    least = args.conversations * args.opening + args.conversations * (args.turns - 1) * (args.turn + args.ask)
    print()
    print(f"                          load      prefix    prefix / load   (median over {args.rounds} rounds)")
    for key, what, scale in (
        ("computed", "prefill tokens computed", 1),
        ("ttft_s", "turn TTFT median, ms", 1e3),
        ("ttft_p90_s", "turn TTFT p90, ms", 1e3),
        ("wall_s", "wall, s", 1),
    ):
        a, b = med("load", key) * scale, med("prefix", key) * scale
        print(f"  {what:<23} {a:>9.0f} {b:>9.0f}     {b / a if a else float('nan'):>6.2f}x")
    print(
        f"  {turns} turns; every prompt token computed once would be ~{least:,} (each opening, then each turn's new "
        "tokens and its answer)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
