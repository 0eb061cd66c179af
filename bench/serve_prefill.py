"""Prefill-decode disaggregation (a deployment's `prefill`) against the same engines each computing their own
prompts, on streams being decoded while long prompts arrive: in one run, the same model, requests and engine
processes.

    .venv/bin/python bench/serve_prefill.py                 # 8 streams of 160 tokens, 6 prompts of 1,536 tokens
    .venv/bin/python bench/serve_prefill.py --rounds 3 --prompt 2048

A random Llama saved as a Pylon export, byte tokenizer, greedy, `ignore_eos`. Two engine processes in each leg
(`ProcessLLMEngine`, one thread each: what two replicas of one CPU each run), as two replicas of a deployment:

- `colocated`: the streams and the long prompts spread over both engines, each computing its own prompts (every
  replica both prefills and decodes: a deployment without `prefill`);
- `split`: one engine decodes every stream, the other computes every long prompt (one token, its blocks sent with
  its output: `SamplingParams.kv_export_from`) and the decoding engine takes the blocks in with the request
  (`kv_import`) and decodes it (`prefill: {replicas: 1}`; the blocks cross a pipe here, Ray's object store there).

`--streams` requests of `--new` tokens start first; a long prompt of `--prompt` random tokens (asking `--ask` tokens)
arrives every `--every` seconds once they run. Every leg the same prompts, under a cache salt of its own (none found
cached from an earlier leg). Timed on this machine: the streams' inter-token latency (median,
p99, worst) and the long prompts' time to first token (median), median over `--rounds`, legs alternating. Counted,
machine-independent: prompt tokens the decoding engines computed, KV blocks and bytes sent between engines, and the
streams' steps that waited on a prompt's chunk (a gap over 4x the leg's median). Every output is checked equal
across legs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from serve_offload import _model  # (the same random Llama: --hidden, --layers, --max-model-len)


async def _stream(engine, rid: str, prompt, params, times: list, tokens: list) -> None:
    async for out in engine.generate(rid, prompt, params):
        now = time.perf_counter()
        times.extend([now] * len(out.token_ids))
        tokens.extend(out.token_ids)


async def _leg(engines: list, kind: str, streams: list, longs: list, args, salt: str) -> dict:
    import dataclasses

    from pylon.serving.engine.sampling import SamplingParams

    # (a cache salt of the leg's own: the same prompts, found in no engine's prefix cache)
    stream_params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True, cache_salt=salt)
    ask = SamplingParams(max_tokens=args.ask, temperature=0, ignore_eos=True, cache_salt=salt)
    decoders = engines[:1] if kind == "split" else engines
    before = [e.stats() for e in engines]
    times = [[] for _ in streams]
    tokens = [[] for _ in streams + longs]
    tasks = [
        asyncio.create_task(_stream(decoders[i % len(decoders)], f"{kind}-s{i}", p, stream_params, times[i], tokens[i]))
        for i, p in enumerate(streams)
    ]
    while not all(times):  # every stream decoding
        await asyncio.sleep(0.01)
    ttft = []

    async def long_one(j: int, prompt: list[int]) -> None:
        await asyncio.sleep(j * args.every)
        started = time.perf_counter()
        rid = f"{kind}-l{j}"
        if kind == "split":
            prefill = SamplingParams(max_tokens=1, temperature=0, kv_export_from=0, cache_salt=salt)
            last = None
            async for out in engines[1].generate(f"{rid}-p", prompt, prefill):
                last = out
            params, engine = dataclasses.replace(ask, kv_import=last.kv_transfer), engines[0]
        else:
            params, engine = ask, engines[j % 2]
        first = None
        async for out in engine.generate(rid, prompt, params):
            first = first or time.perf_counter()
            tokens[len(streams) + j].extend(out.token_ids)
        ttft.append(first - started)

    await asyncio.gather(*(long_one(j, p) for j, p in enumerate(longs)), *tasks)
    after = [e.stats() for e in engines]
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]) if b > a)  # (tokens of one output: no gap)
    median = statistics.median(gaps)
    decoding = [engines.index(e) for e in decoders]
    return {
        "tokens": tokens,
        "itl_ms": median * 1e3,
        "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
        "itl_max_ms": gaps[-1] * 1e3,
        "ttft_s": statistics.median(ttft),
        "stalls": sum(g > 4 * median for g in gaps),
        "decoders_prompt_tokens": sum(
            after[i].prefill_tokens_computed_total - before[i].prefill_tokens_computed_total for i in decoding
        ),
        "blocks_sent": sum(
            a.kv_transfer_sent_blocks_total - b.kv_transfer_sent_blocks_total for a, b in zip(after, before)
        ),
        "bytes_sent": sum(
            a.kv_transfer_sent_bytes_total - b.kv_transfer_sent_bytes_total for a, b in zip(after, before)
        ),
    }


async def _run(directory: str, args) -> dict:
    from pylon.serving.engine.process import ProcessLLMEngine
    from pylon.specs import EngineSpec

    spec = EngineSpec(
        max_num_seqs=args.streams + 4,
        max_num_batched_tokens=args.chunk,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        device="cpu",
        dtype="fp32",
    )
    engines = [ProcessLLMEngine(directory, spec, env={"OMP_NUM_THREADS": "1"}) for _ in range(2)]
    rng = random.Random(0)
    streams = [[rng.randrange(256) for _ in range(args.stream_prompt)] for _ in range(args.streams)]
    longs = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(args.longs)]
    legs: dict[str, list[dict]] = {"colocated": [], "split": []}
    try:
        for r in range(args.rounds):
            for kind in ("colocated", "split") if r % 2 == 0 else ("split", "colocated"):
                got = await _leg(engines, kind, streams, longs, args, salt=f"{kind}-{r}")
                legs[kind].append(got)
                print(f"round {r + 1} {kind}: {_line(got)}", flush=True)
    finally:
        for e in engines:
            e.shutdown()
    return legs


def _line(leg: dict) -> str:
    return (
        f"ITL median {leg['itl_ms']:.1f} ms, p99 {leg['itl_p99_ms']:.1f} ms, worst {leg['itl_max_ms']:.0f} ms; "
        f"long prompts' TTFT {leg['ttft_s']:.2f} s; stalls {leg['stalls']}; decoding engines computed "
        f"{leg['decoders_prompt_tokens']} prompt tokens; {leg['blocks_sent']} blocks ({leg['bytes_sent'] / 2**20:.1f} "
        "MiB) sent"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8, help="requests decoding throughout")
    p.add_argument("--stream-prompt", type=int, default=32, help="their prompts' tokens")
    p.add_argument("--new", type=int, default=160, help="tokens each stream asks for")
    p.add_argument("--longs", type=int, default=6, help="long prompts arriving while they decode")
    p.add_argument("--prompt", type=int, default=1536, help="a long prompt's tokens")
    p.add_argument("--ask", type=int, default=8, help="tokens a long prompt asks for")
    p.add_argument("--every", type=float, default=0.4, help="seconds between long prompts")
    p.add_argument("--chunk", type=int, default=512, help="engine.max_num_batched_tokens (a prompt's chunk)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = _model(Path(tmp) / "llama", args)
        legs = asyncio.run(_run(directory, args))
    co, split = legs["colocated"], legs["split"]
    first = co[0]["tokens"]
    bad = [i for i, leg in enumerate(co + split) if leg["tokens"] != first]
    if bad:
        raise SystemExit(f"the legs' outputs differ (legs {bad}): the blocks sent are not what was computed")
    print("every leg's outputs are the same tokens")

    def med(kind: list, key: str) -> float:
        return statistics.median(leg[key] for leg in kind)

    print()
    print(f"                       colocated    split     split / colocated   (median over {args.rounds} rounds)")
    for key, what in (
        ("itl_ms", "ITL median, ms"),
        ("itl_p99_ms", "ITL p99, ms"),
        ("itl_max_ms", "ITL worst, ms"),
        ("ttft_s", "long TTFT, s"),
        ("stalls", "stream stalls"),
        ("decoders_prompt_tokens", "decoders' prompt toks"),
    ):
        a, b = med(co, key), med(split, key)
        print(f"  {what:<21} {a:>9.1f} {b:>9.1f}     {b / a if a else float('nan'):>6.2f}x")
    print(
        f"  KV sent per long prompt: {med(split, 'bytes_sent') / args.longs / 2**20:.2f} MiB "
        f"({med(split, 'blocks_sent') / args.longs:.0f} blocks)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
