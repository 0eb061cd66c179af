"""The DeepSpeed config, generated from a `TrainJobSpec`: the one place it is written.

    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                      config=build_deepspeed_config(job, world_size=world_size))

Every key below is derived from a spec field; nothing else in Pylon writes DeepSpeed settings. Key names are
those of DeepSpeed 0.19 (`deepspeed/runtime/zero/config.py`, `offload_config.py`, `swap_tensor/aio_config.py`,
`runtime/lr_schedules.py`).

Gradient checkpointing is not here: it is a model setting (`pylon.models.build_model` turns on the
`transformers` model's own checkpointing), not DeepSpeed's `activation_checkpointing`, which only applies to
models written against `deepspeed.checkpointing`.
"""

from __future__ import annotations

from pylon.specs import TrainJobSpec

# DeepSpeed logs a progress line every `steps_per_print` steps; Pylon writes its own metrics, so never.
_NEVER = 2**31 - 1


def build_deepspeed_config(spec: TrainJobSpec, *, world_size: int) -> dict:
    """The DeepSpeed config dict for `spec` run by `world_size` processes."""
    batch = spec.batch
    config = {
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.grad_accum_steps,
        "train_batch_size": batch.micro_batch_size * batch.grad_accum_steps * world_size,
        "gradient_clipping": spec.optim.grad_clip,  # 0 turns clipping off
        "zero_optimization": _zero(spec),
        "optimizer": _optimizer(spec),
        "scheduler": _scheduler(spec),
        "fp16": _fp16(spec),
        "bf16": {"enabled": spec.precision == "bf16"},
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    if "nvme" in (spec.deepspeed.offload_optimizer, spec.deepspeed.offload_param):
        config["aio"] = _aio(spec)
    if spec.deepspeed.grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": spec.deepspeed.grad_accum_dtype}
    return config


def reference_deepspeed_config(config: dict) -> dict:
    """The config of a frozen model run beside the trained one at ZeRO-3 (objective dpo's reference, `pylon.jobs.dpo`):
    partitioned and gathered as the trained model is, its parameters offloaded where the trained model's are, but no
    optimizer, scheduler or gradients (DeepSpeed's ZeRO-Inference: an engine without an optimizer). DeepSpeed empties
    a parameter swap folder when it opens it, so an NVMe-offloaded reference swaps to a folder of its own below the
    trained model's."""
    import copy
    import os

    reference = copy.deepcopy(config)
    for key in ("optimizer", "scheduler"):
        reference.pop(key, None)
    reference["gradient_clipping"] = 0.0
    zero = reference["zero_optimization"]
    zero.pop("offload_optimizer", None)
    if zero.get("offload_param", {}).get("device") == "nvme":
        zero["offload_param"]["nvme_path"] = os.path.join(zero["offload_param"]["nvme_path"], "dpo-reference")
    return reference


def _zero(spec: TrainJobSpec) -> dict:
    ds = spec.deepspeed
    buffers = ds.buffers
    zero: dict = {"stage": ds.zero_stage, "reduce_bucket_size": buffers.reduce_bucket_size}
    if ds.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=buffers.prefetch_bucket_size,
            stage3_max_live_parameters=buffers.max_live_parameters,
            stage3_max_reuse_distance=buffers.max_reuse_distance,
            sub_group_size=buffers.sub_group_size,
        )
    # Pinned (page-locked) host memory only speeds up copies to and from a GPU; on CPU workers it is useless
    # and pinning needs a memlock allowance containers rarely grant.
    pin_memory = spec.scaling.use_gpu
    if ds.offload_optimizer != "none":
        # With an offloaded optimizer DeepSpeed runs its own CPU Adam (DeepSpeedCPUAdam) on the host.
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path, pin_memory)
    if ds.offload_param != "none":
        zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path, pin_memory)
        if ds.offload_param == "nvme":
            zero["offload_param"].update(
                buffer_size=buffers.param_buffer_size,
                buffer_count=buffers.param_buffer_count,
                max_in_cpu=buffers.param_max_in_cpu,
            )
    return zero


def _offload(device: str, nvme_path: str | None, pin_memory: bool) -> dict:
    block = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        # DeepSpeed keeps each rank's swap files in their own subdirectory, so workers on one node share a path.
        block["nvme_path"] = nvme_path
    return block


def _aio(spec: TrainJobSpec) -> dict:
    aio = spec.deepspeed.aio
    return {
        "block_size": aio.block_size,
        "queue_depth": aio.queue_depth,
        # DeepSpeed renamed `thread_count` to `intra_op_parallelism` and ignores the old key silently.
        "intra_op_parallelism": aio.thread_count,
        "single_submit": aio.single_submit,
        "overlap_events": aio.overlap_events,
    }


def _fp16(spec: TrainJobSpec) -> dict:
    if spec.precision != "fp16":
        return {"enabled": False}
    # Dynamic loss scaling (loss_scale 0): start at 2**initial_power (16 by default), halve on overflow (after
    # `hysteresis` overflows in a row), double after `window` clean steps; overflowing steps are skipped, not applied.
    scaling = spec.deepspeed.loss_scaling
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": scaling.initial_power,
        "loss_scale_window": scaling.window,
        "hysteresis": scaling.hysteresis,
        "min_loss_scale": scaling.min_scale,
    }


def _optimizer(spec: TrainJobSpec) -> dict:
    optim = spec.optim
    return {
        "type": "AdamW",
        "params": {
            "lr": optim.lr,
            "betas": list(optim.betas),
            "eps": optim.eps,
            "weight_decay": optim.weight_decay,
        },
    }


def _scheduler(spec: TrainJobSpec) -> dict:
    """Linear warmup, then cosine or linear decay to `lr * min_lr_ratio`, or a constant lr.

    DeepSpeed's schedulers have two quirks this works around or accepts:
    - `warmup_num_steps` must be >= 1 and is raised to 2 internally. With `warmup_steps: 0` the cosine and
      constant warmups start at the full lr (min ratio 1, or min lr = lr), so they are flat: no warmup. The
      linear schedule cannot do that (its warmup start is also where its decay ends, `lr * min_lr_ratio`),
      so it ramps up over 2 steps.
    - The lr of step k is the schedule at iteration k-1; before the first step WarmupCosineLR sets lr 0 (and
      WarmupLR/WarmupDecayLR their warmup start), so the first optimizer step of a cosine run has lr 0.
    """
    optim = spec.optim
    warmup = optim.warmup_steps
    warmup_steps = max(1, warmup)
    if optim.schedule == "cosine":
        return {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": spec.steps,
                "warmup_num_steps": warmup_steps,
                "warmup_min_ratio": 0.0 if warmup else 1.0,
                "cos_min_ratio": optim.min_lr_ratio,
                "warmup_type": "linear",
            },
        }
    if optim.schedule == "linear":
        # WarmupDecayLR warms up from warmup_min_lr and decays linearly back to it at total_num_steps.
        return {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": spec.steps,
                "warmup_num_steps": warmup_steps,
                "warmup_min_lr": optim.lr * optim.min_lr_ratio,
                "warmup_max_lr": optim.lr,
                "warmup_type": "linear",
            },
        }
    return {
        "type": "WarmupLR",
        "params": {
            "warmup_num_steps": warmup_steps,
            "warmup_min_lr": 0.0 if warmup else optim.lr,
            "warmup_max_lr": optim.lr,
            "warmup_type": "linear",
        },
    }
