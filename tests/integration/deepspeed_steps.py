"""Train a few DeepSpeed steps on fixed random tokens and print what happened as one JSON line.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/integration/deepspeed_steps.py --spec '{"kind": "TrainJob", ...}' --steps 3

Run as its own process by tests/integration/test_deepspeed_combinations.py, one process per combination
(one per rank when WORLD_SIZE > 1): DeepSpeed keeps process-wide state (the process group, built ops, ZeRO-3's
module hooks) that a second engine in the same process would inherit. The model comes from
`pylon.models.build_model` and the config from `pylon.jobs.deepspeed_config.build_deepspeed_config`, exactly as
a training job builds them.

Every step trains on the same global batch of `micro_batch_size * WORLD_SIZE` rows; rank r takes rows
[r*micro, (r+1)*micro), so runs of different world sizes see the same data. The loss printed is the mean over
ranks, i.e. the global batch's loss.

--plain trains with plain PyTorch instead (torch.optim.AdamW, torch's gradient clipping, one process): the
reference DeepSpeed's sharded runs are compared against.
--checkpoint DIR commits a checkpoint with Pylon's CheckpointCommitter after the steps, takes --steps-after more
steps (1), loads the checkpoint back and takes those steps again: both must give the same losses (the first step
tests the weights, a second one the optimizer state: Adam's moments and step count).
--resume DIR loads the latest commit of such a DIR before the steps, in this new process: its first steps must give
the losses the earlier run's steps after saving gave.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import deepspeed
import torch

from pylon.jobs.deepspeed_config import build_deepspeed_config
from pylon.models import build_model, mean_token_loss, parameter_counts
from pylon.specs import TrainJobSpec

BYTE_VOCAB, BYTE_EOS, BYTE_PAD = 320, 256, 257
# Marks the result line: DeepSpeed and its op loader also print to stdout.
RESULT_PREFIX = "deepspeed_steps: "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="a TrainJob spec as JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--plain", action="store_true", help="plain PyTorch AdamW, no DeepSpeed (one process)")
    parser.add_argument("--checkpoint", help="a directory to commit, reload and re-step a checkpoint in")
    parser.add_argument(
        "--resume", help="a --checkpoint directory of an earlier run: load its latest commit first, as a new job does"
    )
    parser.add_argument(
        "--steps-after", type=int, default=1, help="steps after saving and after loading (2 tests the optimizer state)"
    )
    args = parser.parse_args(argv)

    spec = TrainJobSpec.model_validate(json.loads(args.spec))
    micro = spec.batch.micro_batch_size
    if args.plain:
        model = build_model(spec, vocab_size=BYTE_VOCAB, eos_id=BYTE_EOS, pad_id=BYTE_PAD, seed=0)
        return _plain(spec, model, args, *parameter_counts(model))

    deepspeed.init_distributed(dist_backend="gloo")
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = build_deepspeed_config(spec, world_size=world_size)
    # As a training job builds it: partitioned at ZeRO-3 (zero.Init), whole otherwise.
    model = build_model(spec, vocab_size=BYTE_VOCAB, eos_id=BYTE_EOS, pad_id=BYTE_PAD, seed=0, deepspeed_config=config)
    total, trainable = parameter_counts(model)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )

    tokens = _global_batch(micro * world_size, args.seq_len)[rank * micro : (rank + 1) * micro]

    def train_step() -> float:
        step_losses = []
        for _ in range(spec.batch.grad_accum_steps):
            loss = mean_token_loss(engine(input_ids=tokens, labels=tokens))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.detach())
        mean = torch.stack(step_losses).mean()
        torch.distributed.all_reduce(mean)  # the global batch's loss: every rank's rows weigh the same
        return mean.item() / world_size

    if args.resume:  # a fresh process (fresh swap files, a freshly initialised model) loads the earlier commit
        from pylon.jobs.checkpoint import CheckpointCommitter

        committer = CheckpointCommitter(args.resume, rank=rank, world_size=world_size, keep_last=1)
        committer.load(engine, committer.latest())
        committer.close()
    losses, lrs = [], []
    for _ in range(args.steps):
        lrs.append(engine.get_lr()[0])
        losses.append(train_step())
    global_steps = engine.global_steps
    resumed = (
        _checkpoint_round_trip(engine, train_step, args.checkpoint, rank, world_size, args.steps_after)
        if args.checkpoint
        else {}
    )
    if rank != 0:
        return 0

    print(
        RESULT_PREFIX
        + json.dumps(
            {
                **resumed,
                "world_size": world_size,
                "losses": losses,
                "lrs": lrs,
                "optimizer": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
                "module_dtype": str(next(engine.module.parameters()).dtype),
                "parameters": total,
                "trainable": trainable,
                "global_steps": global_steps,
                "zero_stage": engine.zero_optimization_stage(),
                "bf16": engine.bfloat16_enabled(),
                # Swap files DeepSpeed wrote under nvme_path: proof that NVMe offload really moved tensors there.
                "nvme_param_files": _swap_files(spec, "params"),
                "nvme_optimizer_files": _swap_files(spec, "optimizer"),
            }
        )
    )
    return 0


def _global_batch(rows: int, seq_len: int) -> torch.Tensor:
    """The same batch every step: the loss must fall as the model memorises it."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (rows, seq_len), generator=generator)


def _plain(spec: TrainJobSpec, model: torch.nn.Module, args, total: int, trainable: int) -> int:
    """The reference: one process, plain PyTorch, the same optimizer settings DeepSpeed gets from the spec."""
    optim = spec.optim
    assert optim.schedule == "constant" and optim.warmup_steps == 0, "the plain loop has a constant lr only"
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    tokens = _global_batch(spec.batch.micro_batch_size, args.seq_len)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = mean_token_loss(model(input_ids=tokens, labels=tokens))
        loss.backward()
        if optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "world_size": 1,
                "losses": losses,
                "parameters": total,
                "trainable": trainable,
                "optimizer": type(optimizer).__name__,
            }
        )
    )
    return 0


def _checkpoint_round_trip(engine, train_step, directory: str, rank: int, world_size: int, after: int = 1) -> dict:
    """Commit, step, load, step again: a checkpoint that restores the model, optimizer and schedule exactly
    makes the two steps identical."""
    from pylon.jobs.checkpoint import CheckpointCommitter

    committer = CheckpointCommitter(directory, rank=rank, world_size=world_size, keep_last=1)
    step = engine.global_steps
    saved_weights = _gathered_weights(engine, rank)
    committer.save(engine, step, extra={"rank": rank})
    after_save = [train_step() for _ in range(after)]
    info = committer.latest()
    exported = _exported_weights_diff(info, engine, saved_weights) if rank == 0 else {}
    extra = committer.load(engine, info)
    after_load = [train_step() for _ in range(after)]
    committer.close()
    return {
        "committed_step": info.step,
        "losses_after_save": after_save,
        "losses_after_load": after_load,
        "extra_after_load": extra,
        "checkpoint_files": sorted(info.manifest["files"]),
        **exported,
    }


def _gathered_weights(engine, rank: int) -> dict[str, torch.Tensor]:
    """The engine's whole weights as the module holds them (collective: ZeRO-3 gathers them), on rank 0."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().clone() for name, p in params.items()} if rank == 0 else {}


def _exported_weights_diff(info, engine, saved: dict[str, torch.Tensor]) -> dict:
    """What `pylon export` consolidates from the committed checkpoint (`jobs.export`: NVMe-swapped master weights
    filled in, then DeepSpeed's zero_to_fp32), against the weights the engine held when it saved: in the module's
    dtype they must be equal."""
    import tempfile

    from pylon.jobs.checkpoint import download
    from pylon.jobs.export import _consolidated_state_dict, _fill_swapped_master_weights

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(download(info, tmp))
        _fill_swapped_master_weights(info, ckpt)
        state = _consolidated_state_dict(ckpt, engine.zero_optimization_stage())
    common = [name for name in saved if name in state]
    diff = max((state[n].to(saved[n].dtype) - saved[n]).abs().max().item() for n in common) if common else None
    return {"export_tensors": len(common), "weights": len(saved), "export_max_diff": diff}


def _swap_files(spec: TrainJobSpec, kind: str) -> int:
    """Swap files under DeepSpeed's `<nvme_path>/zero_stage_3/<...params|optimizer>/` folders."""
    if not spec.deepspeed.nvme_path:
        return 0
    root = os.path.join(spec.deepspeed.nvme_path, "zero_stage_3")
    return sum(
        len([f for f in files if f.endswith(".swp")])
        for folder, _, files in os.walk(root)
        if os.path.basename(os.path.dirname(folder)).endswith(kind)
    )


if __name__ == "__main__":
    code = main()
    # End without the interpreter's teardown: DeepSpeed's async-io handles (NVMe offload) keep worker threads that
    # teardown can destroy while they are joinable, which aborts the process ("terminate called without an active
    # exception", exit -6: seen once in CI, on zero3-fp32-opt-nvme, after its result was out). Everything the rank
    # reports is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
