"""A model in pipeline stages (`engine.pipeline_parallel`) against the same model whole, on the same machine and
requests, legs alternating over `--rounds`.

What the stages buy is memory: each process holds its share of the weights and of the KV cache, so a model larger
than one machine's memory is served across machines. What they cost is time: the stages compute one after another,
and every step hands `[step tokens, hidden]` from stage to stage through Ray. This prints both:

- per process, the weights and KV cache each holds (machine-independent: bytes), whole against each stage;
- the bytes a step hands between stages per output token (machine-independent);
- decode tokens/s whole and in stages at each `--concurrency`, the stages each step whole (the default,
  `pipeline_microbatches: 1`: the stages in turn) and cut into micro-batches (`pipeline_microbatches` = `--stages`:
  the stages computing different groups at once), the ratios to whole with their spread over rounds, and per staged
  step the other stages' computing time and the rest of the step's wall time past the computing (Ray's calls and the
  hops not hidden behind it). On one machine all of them run on the same cores: the ratios are the cost of the hops
  and the gain (or loss) of the overlap there, not what separate machines would do.

A Llama-shaped model with random weights (`--layers`, `--hidden`) is built in the run; the stages' actors run on a
local Ray started here (`--cpus`).

    .venv/bin/python bench/serve_pipeline.py --stages 2 --concurrency 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(directory: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def leg(engine, concurrency: int, args, seed: int) -> float:
    """Decode tokens/s of `concurrency` greedy requests, `--output-tokens` each, their prompts prefilled first."""
    import torch

    from pylon.serving.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"{seed}-{i}", torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist(), params)
    out = 0
    started = None
    while engine.has_unfinished():
        for o in engine.step():
            if started is None:  # the first token out: the prompts are in; decoding from here
                started, out = time.perf_counter(), -concurrency
            out += len(o.token_ids)
    return out / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2)
    args = p.parse_args()

    import ray
    import torch

    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    # Each stage's actor computes on the one CPU it asks for (Ray gives it one thread); this process too, so that the
    # whole model and every stage compute alike and the ratio is the pipeline's own cost.
    torch.set_num_threads(1)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "llama"
            build(model, args.layers, args.hidden)
            common = {"device": "cpu", "dtype": "fp32", "max_num_seqs": max(args.concurrency), "kv_cache_tokens": 8192}
            whole = LLMEngine(str(model), EngineSpec(**common))
            in_turn = LLMEngine(str(model), EngineSpec(**common, pipeline_parallel=args.stages))
            staged = LLMEngine(
                str(model), EngineSpec(**common, pipeline_parallel=args.stages, pipeline_microbatches=args.stages)
            )
            print(f"model: llama, {args.layers} layers, hidden {args.hidden}, fp32; {args.stages} stages")
            for d in staged.runner.described:
                print(
                    f"  stage {d['stage'] + 1}: layers {d['layers'][0]}-{d['layers'][1] - 1}, weights "
                    f"{d['weights_bytes'] / 2**20:.1f} MiB, KV cache {d['kv_cache_bytes'] / 2**20:.1f} MiB"
                )
            total = sum(d["weights_bytes"] for d in staged.runner.described)
            largest = max(d["weights_bytes"] for d in staged.runner.described)
            print(f"  the largest stage holds {largest / total:.0%} of the weights (1 process whole: 100%)")
            handed = (args.stages - 1) * args.hidden * 4
            print(f"  handed between stages per decode token: {handed:,} bytes ({args.stages - 1} hop(s) x hidden x 4)")
            legs = {"whole": whole, "stages in turn": in_turn, "stages, micro-batches": staged}
            for engine in legs.values():  # warm-up
                leg(engine, 1, args, seed=0)
            for concurrency in args.concurrency:
                for engine in (in_turn, staged):
                    runner = engine.runner
                    runner.pipeline_steps, runner.pipeline_stage_seconds, runner.pipeline_hop_seconds = 0, 0.0, 0.0
                rates = {name: [] for name in legs}
                for r in range(args.rounds):
                    for name, engine in legs.items():
                        rates[name].append(leg(engine, concurrency, args, seed=100 + r))
                print(f"concurrency {concurrency}: whole {statistics.median(rates['whole']):.1f} tok/s")
                for name in ("stages in turn", "stages, micro-batches"):
                    ratios = [b / a for a, b in zip(rates["whole"], rates[name])]
                    runner = legs[name].runner
                    print(
                        f"  {name}: {statistics.median(rates[name]):.1f} tok/s, / whole "
                        f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); per step: "
                        f"the other stages {runner.pipeline_stage_seconds / runner.pipeline_steps * 1e3:.1f} ms "
                        f"computing, {runner.pipeline_hop_seconds / runner.pipeline_steps * 1e3:.1f} ms past computing"
                    )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
