"""GRPO's sampling at ZeRO-3: the model gathered once for a micro-batch's sampling (`grpo.zero3_gather_for_sampling`,
the default; DeepSpeed's unwrap_model_for_generation, TRL's ds3_gather_for_generation) against each partitioned layer
gathered for every token with the ranks decoding in step (false), in one run, on the same model and prompts.

    .venv/bin/python bench/grpo_sampling.py                  # 2 ranks (gloo), a 17M-parameter Llama, 8 x 32 tokens
    .venv/bin/python bench/grpo_sampling.py --hidden 768 --layers 6 --tokens 64 --rounds 5

Each rank builds the model as a Pylon job does (`pylon.models.build_model` under the DeepSpeed config
`build_deepspeed_config` makes, ZeRO-3, partitioned at construction) and samples its prompts' completions with
`pylon.jobs.grpo.sample_completions` inside `sampling_model`, the modes alternating over `--rounds` after one untimed
round each. Prints per mode: the median seconds a micro-batch's sampling takes on rank 0 (and the spread), its
CPU-seconds, and the machine-independent counts: the parameters DeepSpeed's per-layer coordinator gathers per sampled
token (elements, and calls), and whole-model gathers; then the ratio of the per-layer way's seconds to the gathered
way's. Between hosts the per-layer way's collectives cross the network for every token, so this machine's loopback
ratio is its lower bound.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    import deepspeed
    import numpy as np
    import torch
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    from pylon.jobs.deepspeed_config import build_deepspeed_config
    from pylon.jobs.grpo import GrpoLoss, sample_completions, sampling_model
    from pylon.models import build_model
    from pylon.specs import TrainJobSpec

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    vocab = 4096
    spec = TrainJobSpec.model_validate(
        {"name": "bench", "data": {"uri": "/nonexistent"}, "steps": 1, "deepspeed": {"zero_stage": 3},
         "model": {"config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": args.hidden,
                              "intermediate_size": int(args.hidden * 2.6875), "num_hidden_layers": args.layers,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}},
         "objective": "grpo", "grpo": {"rewards": [{"function": "exact_match"}], "generations": args.generations,
                                       "max_completion_tokens": args.tokens}}
    )  # fmt: skip
    config = build_deepspeed_config(spec, world_size=world)
    model = build_model(spec, vocab_size=vocab, eos_id=vocab - 1, pad_id=vocab - 2, seed=0, deepspeed_config=config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    total = sum(p.ds_numel for p in model.parameters())
    rng = np.random.default_rng(rank)
    prompts = [rng.integers(0, vocab - 2, size=args.prompt_tokens) for _ in range(args.prompts)]
    gathered_elems, gathered_calls = [0], [0]
    original = coordinator.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_

    def counted(self, params, forward, quantize=False):
        todo = [p for p in params if p.ds_status == coordinator.ZeroParamStatus.NOT_AVAILABLE]
        gathered_elems[0] += sum(p.ds_numel for p in todo)
        gathered_calls[0] += 1 if todo else 0
        return original(self, params, forward, quantize)

    setattr(coordinator.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_",
            counted)  # fmt: skip
    results = {True: [], False: []}
    for round_ in range(args.rounds + 1):
        for gather in (True, False) if round_ % 2 == 0 else (False, True):
            loss = GrpoLoss.of(spec)
            loss = type(loss)(**{**loss.__dict__, "gather": gather})
            torch.distributed.barrier()
            gathered_elems[0] = gathered_calls[0] = 0
            cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            with sampling_model(engine, loss, synced=True) as (module, in_step):
                got = sample_completions(module, prompts, loss, eos_id=vocab - 1, pad_id=vocab - 2, device="cpu",
                                         seed=round_, synced=in_step)  # fmt: skip
            seconds = time.perf_counter() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            tokens = max(len(c) for c in got)  # decoding steps
            if round_:  # (round 0 warms up)
                results[gather].append(
                    {"s": seconds, "cpu_s": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                     "elems_per_token": gathered_elems[0] / tokens, "calls_per_token": gathered_calls[0] / tokens,
                     "tokens": tokens}
                )  # fmt: skip
    if rank == 0:
        out.put({"results": results, "params": total})
    torch.distributed.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="ranks of the gloo process group (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="the Llama's hidden size (default 512)")
    p.add_argument("--layers", type=int, default=4, help="its decoder layers (default 4)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per rank's micro-batch (default 1)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens a prompt (default 32)")
    p.add_argument("--generations", type=int, default=8, help="completions a prompt (default 8)")
    p.add_argument("--tokens", type=int, default=32, help="max_completion_tokens (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each mode, alternating (default 3)")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.workers, port, args, out)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    got = out.get(timeout=3600)
    for proc in procs:
        proc.join()
    res = got["results"]
    print(
        f"GRPO sampling at ZeRO-3: {args.workers} ranks (gloo, loopback), Llama {got['params'] / 1e6:.1f}M parameters, "
        f"{args.prompts} prompt(s) x {args.generations} completions x up to {args.tokens} tokens a rank, "
        f"{args.rounds} rounds"
    )
    print(
        f"{'mode':<34}{'s / micro-batch':>16}{'spread':>16}{'CPU-s':>8}{'gathered elems/token':>22}{'calls/token':>13}"
    )
    med = {}
    for gather, name in ((True, "gathered once (default)"), (False, "per layer, ranks in step")):
        rows = res[gather]
        s = [r["s"] for r in rows]
        med[gather] = statistics.median(s)
        print(
            f"{name:<34}{med[gather]:>16.3f}{f'{min(s):.3f}-{max(s):.3f}':>16}"
            f"{statistics.median(r['cpu_s'] for r in rows):>8.2f}"
            f"{statistics.median(r['elems_per_token'] for r in rows):>22,.0f}"
            f"{statistics.median(r['calls_per_token'] for r in rows):>13.1f}"
        )
    print(f"whole-model gathers per micro-batch: 1 (gathered once), 0 (per layer); model elements {got['params']:,}")
    print(f"ratio: per-layer / gathered seconds = {med[False] / med[True]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
