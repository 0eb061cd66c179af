"""Offline batch inference (`pylon batch`): what answering through the replica's request handling and in parts costs,
against the engine's own offline `generate` (vLLM's `LLM.generate`), on the same requests, in one run.

    .venv/bin/python bench/batch_answers.py                 # 256 requests, 3 rounds
    .venv/bin/python bench/batch_answers.py --quick         # 64 requests, 1 round

The model is a random-weight GPT-2 built from a config (no download, byte tokenizer, as bench/serve_load.py's). The
requests are completion requests for prompts cut from `../shared/datasets/tinyshakespeare.txt` (real text), prompt
lengths uniform in --prompt-len, max_tokens uniform in --output-len, `ignore_eos`, greedy: every leg computes the
same tokens. One engine in this process (`engine.separate_process: false`) for every leg, so the legs differ only in
how requests reach it.

Legs:
  generate   `LLMEngine.generate(prompts)`: every request added at once, stepped to the end. The ceiling.
  batch      `PartAnswerer.answer_parts` on one part of every line: each line parsed, POSTed in-process to the
             replica's ASGI app, answered and written as the Batch API's output line (what a BatchJob's engine does).
  parts      the same in --parts parts (chunk_lines = requests / parts), two at a time as a job's engine answers
             them (PARTS_AT_ONCE): the next part's lines fill the batch as a part's last ones end.
  parts-1    the parts one after another: at each part's end the engine drains before the next part's lines
             arrive (what answering two at a time saves).

Printed: each leg's generated tokens/s (median over --rounds, with the spread), the engine steps it took (a
count that does not depend on the machine: a fuller batch takes fewer), and each leg's ratio to `generate`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt"


def build_model(directory: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=4,
        n_head=4,
        n_embd=256,
        n_positions=1024,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0) -> list[dict]:
    text = TEXT.read_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(0, len(text) - length)
        out.append({"prompt": text[start : start + length], "max_tokens": rng.randint(*output_len)})
    return out


def count_steps(engine) -> list[int]:
    """A counter of `engine.step()` calls (a one-element list), counted from now on."""
    count, step = [0], engine.step

    def counted():
        count[0] += 1
        return step()

    engine.step = counted
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", default="16,128")
    parser.add_argument("--output-len", default="16,96")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.rounds = 64, 1
    os.environ.setdefault("PYLON_SCHED_BATCH", "0")
    from pylon.serving.api import batch
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import BatchJobSpec

    pl = tuple(int(x) for x in args.prompt_len.split(","))
    ol = tuple(int(x) for x in args.output_len.split(","))
    reqs = requests(args.num_requests, pl, ol)
    work = Path(tempfile.mkdtemp(prefix="pylon-bench-batch-"))
    build_model(work / "model")
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**r, "temperature": 0, "ignore_eos": True},
        }
        for i, r in enumerate(reqs)
    ]
    (work / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    engine = {
        "device": "cpu",
        "dtype": "fp32",
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_tokens": 65536,
        "max_model_len": 1024,
        "separate_process": False,
    }

    def spec(out: str, chunk: int) -> BatchJobSpec:
        return BatchJobSpec(
            name="bench",
            model=str(work / "model"),
            input=str(work / "in.jsonl"),
            output=out,
            chunk_lines=chunk,
            engine=engine,
        )

    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    alone = LLMEngine(str(work / "model"), EngineSpec(**engine))  # the generate leg's: the same model and spec
    answerer = batch.PartAnswerer(spec(str(work / "warm"), len(lines)).model_dump(mode="json"))
    steps = {"generate": count_steps(alone), "batch": count_steps(answerer.server.engine.engine)}
    expected = sum(r["max_tokens"] for r in reqs)
    results: dict[str, list[tuple[float, int]]] = {"generate": [], "batch": [], "parts": [], "parts-1": []}
    prompts = [list(x["prompt"].encode()) for x in reqs]
    params = [SamplingParams(max_tokens=x["max_tokens"], temperature=0.0, ignore_eos=True) for x in reqs]
    alone.generate(prompts[:8], params[:8])  # warm-up: every code path once
    answerer.answer_parts(batch.plan_parts([str(work / "in.jsonl")], len(lines))[0])
    for r in range(args.rounds):
        s0, t0 = steps["generate"][0], time.perf_counter()
        done = alone.generate(prompts, params)
        seconds = time.perf_counter() - t0
        assert sum(len(c.token_ids) for c in done) == expected
        results["generate"].append((expected / seconds, steps["generate"][0] - s0))
        chunk = -(-len(lines) // args.parts)
        for leg, chunk, at_once in (("batch", len(lines), 1), ("parts", chunk, 2), ("parts-1", chunk, 1)):
            answerer.spec = spec(str(work / f"{leg}-{r}"), chunk)
            parts, _ = batch.plan_parts([str(work / "in.jsonl")], chunk)
            s0, t0 = steps["batch"][0], time.perf_counter()
            tokens = sum(a["tokens_out"] for a in answerer.answer_parts(parts, at_once))
            seconds = time.perf_counter() - t0
            assert tokens == expected, (leg, tokens, expected)
            results[leg].append((expected / seconds, steps["batch"][0] - s0))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:,.0f} tok/s" for k, v in results.items()), flush=True)
    answerer.close()
    base = statistics.median(t for t, _ in results["generate"])
    print(
        f"\n{args.num_requests} requests, {expected:,} generated tokens, max_num_seqs {args.max_num_seqs}, "
        f"{args.rounds} round(s)"
    )
    print(f"{'leg':<10}{'tok/s (median)':>16}{'spread':>18}{'engine steps':>14}{'vs generate':>13}")
    for leg, runs in results.items():
        rates = [t for t, _ in runs]
        med = statistics.median(rates)
        print(
            f"{leg:<10}{med:>16,.0f}{f'{min(rates):,.0f}-{max(rates):,.0f}':>18}{runs[-1][1]:>14,}{med / base:>12.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
