"""Decode steps of a model with recurrent layers (Qwen3-Next's Gated DeltaNet): a step's decodes through each
recurrent layer in one batched convolution and delta-rule call (`ModelRunner._recurrent_decodes`) against one call per
sequence, on the same engine and requests, legs alternating over `--rounds`.

A Qwen3-Next-shaped model with random weights (`--layers` layers, three recurrent in four; `--hidden` wide; MoE
blocks), built in the run. Each leg: `--concurrency` requests of `--prompt-tokens` random tokens, greedy,
`--output-tokens` each, through an in-process `LLMEngine` (after one leg of each to warm up). Prints decode tokens/s
for each leg and the ratio (batched / per sequence), with the spread over rounds, and the delta-rule calls per output
token (a counter that does not depend on the machine: one per recurrent layer and sequence in a per-sequence step,
one per recurrent layer in a batched one).

    .venv/bin/python bench/recurrent_decode.py --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def build(directory: Path, layers: int, hidden: int, **overrides) -> None:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "qwen3_next",
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        **overrides,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def leg(engine, concurrency: int, args, batched: bool, seed: int) -> tuple[float, float]:
    import torch

    from pylon.serving.engine.sampling import SamplingParams

    runner = engine.runner
    runner.batch_recurrent_decodes = batched
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(
            f"{seed}-{batched}-{i}", torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist(), params
        )
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill first: the legs time decodes only
    calls, t0, tokens = runner.recurrent_rule_calls, time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    seconds = time.perf_counter() - t0
    return tokens / seconds, (runner.recurrent_rule_calls - calls) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3-next"
        build(directory, args.layers, args.hidden)
        print(
            f"== recurrent layers' decodes: batched vs one call a sequence ({args.layers} layers, {args.hidden} wide)"
        )
        for c in args.concurrency:
            spec = EngineSpec(
                max_num_seqs=max(c, 1),
                max_num_batched_tokens=4096,
                kv_cache_tokens=c * 256 + 512,
                max_model_len=256,
                dtype="fp32",
            )
            engine = LLMEngine(str(directory), spec)
            got = {True: [], False: []}
            per_token = {}
            for batched in (False, True):  # warm-up: the first steps of an engine are slower
                leg(engine, c, args, batched, 99)
            for r in range(args.rounds):
                for batched in (False, True):
                    speed, calls = leg(engine, c, args, batched, r)
                    got[batched].append(speed)
                    per_token[batched] = calls
            ratios = [b / s for b, s in zip(got[True], got[False])]
            print(
                f"concurrency {c}: per sequence {statistics.median(got[False]):.1f} tok/s, batched "
                f"{statistics.median(got[True]):.1f} tok/s: {statistics.median(ratios):.2f}x (rounds "
                f"{min(ratios):.2f}-{max(ratios):.2f}); delta-rule calls per output token {per_token[False]:.2f} -> "
                f"{per_token[True]:.2f}"
            )


if __name__ == "__main__":
    main()
