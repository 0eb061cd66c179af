"""Train a few DeepSpeed steps on fixed random tokens and print what happened as one JSON line.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/integration/deepspeed_steps.py --spec '{"kind": "TrainJob", ...}' --steps 3

Run as its own process by tests/integration/test_deepspeed_combinations.py, one process per combination:
DeepSpeed keeps process-wide state (the process group, built ops, ZeRO-3's module hooks) that a second
engine in the same process would inherit. The model comes from `pylon.models.build_model` and the config
from `pylon.jobs.deepspeed_config.build_deepspeed_config`, exactly as a training job builds them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import deepspeed
import torch

from pylon.jobs.deepspeed_config import build_deepspeed_config
from pylon.models import build_model, parameter_counts
from pylon.specs import TrainJobSpec

BYTE_VOCAB, BYTE_EOS, BYTE_PAD = 320, 256, 257
# Marks the result line: DeepSpeed and its op loader also print to stdout.
RESULT_PREFIX = "deepspeed_steps: "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="a TrainJob spec as JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)

    spec = TrainJobSpec.model_validate(json.loads(args.spec))
    deepspeed.init_distributed(dist_backend="gloo")
    world_size = int(os.environ["WORLD_SIZE"])
    model = build_model(spec, vocab_size=BYTE_VOCAB, eos_id=BYTE_EOS, pad_id=BYTE_PAD, seed=0)
    total, trainable = parameter_counts(model)
    config = build_deepspeed_config(spec, world_size=world_size)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)

    # The same batch every step: the loss must fall as the model memorises it.
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 256, (spec.batch.micro_batch_size, args.seq_len), generator=generator)
    losses, lrs = [], []
    for _ in range(args.steps):
        lrs.append(engine.get_lr()[0])
        step_losses = []
        for _ in range(spec.batch.grad_accum_steps):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))

    print(RESULT_PREFIX + json.dumps({
        "losses": losses,
        "lrs": lrs,
        "optimizer": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
        "module_dtype": str(next(engine.module.parameters()).dtype),
        "parameters": total,
        "trainable": trainable,
        "global_steps": engine.global_steps,
        "zero_stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        # Swap files DeepSpeed wrote under nvme_path: proof that NVMe offload really moved tensors there.
        "nvme_param_files": _swap_files(spec, "params"),
        "nvme_optimizer_files": _swap_files(spec, "optimizer"),
    }))
    return 0


def _swap_files(spec: TrainJobSpec, kind: str) -> int:
    """Swap files under DeepSpeed's `<nvme_path>/zero_stage_3/<...params|optimizer>/` folders."""
    if not spec.deepspeed.nvme_path:
        return 0
    root = os.path.join(spec.deepspeed.nvme_path, "zero_stage_3")
    return sum(len([f for f in files if f.endswith(".swp")]) for folder, _, files in os.walk(root)
               if os.path.basename(os.path.dirname(folder)).endswith(kind))


if __name__ == "__main__":
    sys.exit(main())
