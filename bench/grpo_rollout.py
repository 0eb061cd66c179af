"""GRPO's sampler: the trained model sampling itself (`grpo.sampler: model`, transformers' way: a left-padded batch
with its KV cache) against Pylon's serving engine beside it (`grpo.sampler: engine`, TRL's colocated vLLM: paged KV
cache, a group's prompt computed once and shared from the prefix cache, continuous batching), in one run, on the same
model, prompts and sampling settings.

    .venv/bin/python bench/grpo_rollout.py                     # 4 prompts of 48-112 tokens x 8 completions x 64
    .venv/bin/python bench/grpo_rollout.py --vocab 64          # a small vocabulary: the eos comes, lengths vary

The model is a random Llama built by `pylon.models.build_model` (fp32, this process, no DeepSpeed: the sampling is
what is compared). Each mode samples the micro-batch with `pylon.jobs.grpo.sample_completions` or
`pylon.jobs.rollout.RolloutEngine.sample`, alternating over `--rounds` timed rounds after one untimed round each (the
engine's weights given again before each of its rounds, as a trainer gives them after each update: timed apart).
Prints per mode the median seconds a micro-batch takes (and the spread), its CPU-seconds, and the machine-independent
count: the tokens its forward passes computed (the model: every row's padded prompt, then every row for every step
until the longest completion ends; the engine: what its steps computed, prompts less prefix-cache hits, and each
sampled token); then the ratios model / engine.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary; a small one ends completions early")
    parser.add_argument("--prompts", type=int, default=4, help="prompts in the micro-batch (default 4)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="max_completion_tokens (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (default 3)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from pylon.data.shards import TokenizerInfo
    from pylon.jobs.grpo import GrpoLoss, sample_completions
    from pylon.jobs.rollout import RolloutEngine
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    vocab, eos, pad = args.vocab, args.vocab - 1, args.vocab - 2
    spec = TrainJobSpec.model_validate(
        {"name": "bench", "data": {"uri": "/nonexistent"}, "steps": 1,
         "model": {"config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": args.hidden,
                              "intermediate_size": int(args.hidden * 2.6875), "num_hidden_layers": args.layers,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}},
         "batch": {"micro_batch_size": args.prompts},
         "objective": "grpo", "grpo": {"rewards": [{"function": "exact_match"}], "generations": args.generations,
                                       "max_completion_tokens": args.tokens, "sampler": "engine"}}
    )  # fmt: skip
    model = build_model(spec, vocab_size=vocab, eos_id=eos, pad_id=pad, seed=0).eval()
    params = sum(p.numel() for p in model.parameters())
    g = np.random.default_rng(0)
    lengths = np.linspace(48, 112, args.prompts).astype(int) if args.prompts > 1 else [64]
    prompts = [g.integers(0, vocab - 2, n).astype(np.int64) for n in lengths]
    loss = GrpoLoss(generations=args.generations, max_tokens=args.tokens)
    tokenizer = TokenizerInfo(kind="byte", name="bench", vocab_size=vocab, eos_id=eos, pad_id=pad).model_dump(
        mode="json"
    )
    rollout = RolloutEngine(model, tokenizer, spec=spec, device=torch.device("cpu"), seq_len=max(lengths))

    def model_round(seed: int) -> tuple[list, int]:
        got = sample_completions(model, prompts, loss, eos_id=eos, pad_id=pad, device="cpu", seed=seed)
        n, width = len(got), max(len(p) for p in prompts)
        steps = max(len(c) for c in got)  # tokens the longest row sampled: a forward pass for each but the last
        return got, n * width + n * (steps - 1)

    def engine_round(seed: int) -> tuple[list, int]:
        before = rollout.computed_tokens
        got = rollout.sample(prompts, loss, seed=seed)
        return got, rollout.computed_tokens - before

    modes = {"model": model_round, "engine": engine_round}
    figures = {m: {"s": [], "cpu": [], "tokens": 0, "sampled": 0} for m in modes}
    syncs = []
    for r in range(args.rounds + 1):
        for name, run in modes.items():
            if name == "engine":
                t = time.perf_counter()
                rollout.sync(model)
                syncs.append(time.perf_counter() - t)
            t, c = time.perf_counter(), time.process_time()
            got, computed = run(r)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            if r:  # (round 0: untimed, warming both up)
                f = figures[name]
                f["s"].append(wall)
                f["cpu"].append(cpu)
                f["tokens"], f["sampled"] = computed, sum(len(x) for x in got)

    print(
        f"model: llama {args.hidden} x {args.layers} layers, vocab {vocab}: {params / 1e6:.1f}M parameters, fp32, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens x "
        f"{args.generations} completions x up to {args.tokens} tokens; {args.rounds} rounds"
    )
    print("| sampler | s / micro-batch (median) | spread | CPU-s (median) | tokens computed | tokens sampled |")
    print("|---|---|---|---|---|---|")
    for name, f in figures.items():
        print(
            f"| {name} | {statistics.median(f['s']):.3f} | {min(f['s']):.3f}-{max(f['s']):.3f} | "
            f"{statistics.median(f['cpu']):.2f} | {f['tokens']:,} | {f['sampled']:,} |"
        )
    m, e = figures["model"], figures["engine"]
    print(
        f"ratio model / engine: {statistics.median(m['s']) / statistics.median(e['s']):.2f}x wall, "
        f"{statistics.median(m['cpu']) / statistics.median(e['cpu']):.2f}x CPU, "
        f"{m['tokens'] / max(e['tokens'], 1):.2f}x tokens computed; the engine's weight sync "
        f"{statistics.median(syncs):.3f} s (median, once per optimizer step)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
