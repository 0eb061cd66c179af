"""pylon.jobs.deepspeed_config: the DeepSpeed config derived from a TrainJob spec, for every combination the spec
allows, checked key by key and by DeepSpeed's own config parser (which rejects unknown ZeRO keys)."""

from __future__ import annotations

import itertools

import pytest
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig
from pydantic import ValidationError

from pylon.jobs.deepspeed_config import build_deepspeed_config, reference_deepspeed_config
from pylon.specs import TrainJobSpec


def job(**fields) -> TrainJobSpec:
    spec = {"kind": "TrainJob", "name": "job", "model": {"preset": "gpt-tiny"}, "data": {"uri": "/data"}, "steps": 100}
    spec.update(fields)
    return TrainJobSpec.model_validate(spec)


def allowed_combinations() -> list[TrainJobSpec]:
    """Every stage x optimizer offload x parameter offload x precision x CPU/GPU the spec accepts."""
    specs = []
    for stage, opt, param, precision, gpu in itertools.product(
        range(4), ("none", "cpu", "nvme"), ("none", "cpu", "nvme"), ("fp32", "bf16", "fp16"), (False, True)
    ):
        fields = {
            "deepspeed": {"zero_stage": stage, "offload_optimizer": opt, "offload_param": param},
            "precision": precision,
            "scaling": {"num_workers": 2, "use_gpu": gpu},
            "batch": {"micro_batch_size": 3, "grad_accum_steps": 2},
        }
        if "nvme" in (opt, param):
            fields["deepspeed"]["nvme_path"] = "/local_nvme"
        try:
            specs.append(job(**fields))
        except ValidationError:
            continue
    return specs


COMBINATIONS = allowed_combinations()


def _id(spec: TrainJobSpec) -> str:
    return f"{spec.deepspeed.describe().replace(' ', '-')}-{spec.precision}-{'gpu' if spec.scaling.use_gpu else 'cpu'}"


def test_the_spec_allows_what_the_issue_lists() -> None:
    ids = {_id(s) for s in COMBINATIONS}
    # Offload settings: ZeRO-0 none; ZeRO-1/2 optimizer none/cpu (DeepSpeed has no NVMe path below stage 3);
    # ZeRO-3 optimizer x parameters = 1+2+2+9.
    # Precisions: fp32 and bf16 on CPU workers, and fp16 too on GPU workers.
    assert len(COMBINATIONS) == 14 * (2 + 3)
    assert "ZeRO-3-optimizer->nvme-params->nvme-bf16-cpu" in ids and "ZeRO-0-fp16-gpu" in ids
    assert not any(i.endswith("fp16-cpu") for i in ids)


@pytest.mark.parametrize("spec", COMBINATIONS, ids=_id)
def test_config_for_every_allowed_combination(spec: TrainJobSpec) -> None:
    config = build_deepspeed_config(spec, world_size=2)
    ds = spec.deepspeed

    assert config["train_micro_batch_size_per_gpu"] == 3
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 3 * 2 * 2

    zero = config["zero_optimization"]
    assert zero["stage"] == ds.zero_stage
    for key, target in (("offload_optimizer", ds.offload_optimizer), ("offload_param", ds.offload_param)):
        if target == "none":
            assert key not in zero
        else:
            expected = {"device": target, "pin_memory": spec.scaling.use_gpu}
            if target == "nvme":
                expected["nvme_path"] = "/local_nvme"
            if target == "nvme" and key == "offload_param":  # the swap buffers, DeepSpeed's defaults unless set
                expected.update(buffer_count=5, buffer_size=100_000_000, max_in_cpu=1_000_000_000)
            assert zero[key] == expected
    assert zero["reduce_bucket_size"] == 500_000_000
    if ds.zero_stage == 3:
        assert zero["sub_group_size"] == zero["stage3_max_live_parameters"] == 1_000_000_000
    uses_nvme = "nvme" in (ds.offload_optimizer, ds.offload_param)
    assert ("aio" in config) == uses_nvme

    assert config["bf16"] == {"enabled": spec.precision == "bf16"}
    assert config["fp16"]["enabled"] == (spec.precision == "fp16")
    if spec.precision == "fp16":
        assert config["fp16"]["loss_scale"] == 0  # dynamic

    # DeepSpeed's own parser accepts it (unknown ZeRO/offload keys are errors there). It takes the world size
    # from torch.distributed, which is 1 here, so give it the single-process batch.
    parsed = DeepSpeedConfig(build_deepspeed_config(spec, world_size=1))
    assert parsed.zero_optimization_stage == ds.zero_stage
    assert parsed.train_batch_size == 6
    assert parsed.bfloat16_config.enabled == (spec.precision == "bf16")
    if uses_nvme:
        assert parsed.aio_config["intra_op_parallelism"] == spec.deepspeed.aio.thread_count


def test_buffers_and_gradient_dtype_from_the_spec() -> None:
    """DeepSpeed's working buffers and the gradient dtype, sized by the spec (what fits a 1B model in 8 GiB)."""
    spec = job(
        deepspeed={
            "zero_stage": 3,
            "offload_optimizer": "nvme",
            "offload_param": "nvme",
            "nvme_path": "/nvme",
            "buffers": {"reduce_bucket_size": 1000, "sub_group_size": 2000, "param_buffer_count": 12},
            "grad_accum_dtype": "bf16",
        }
    )
    config = build_deepspeed_config(spec, world_size=1)
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000 and zero["sub_group_size"] == 2000
    assert zero["offload_param"]["buffer_count"] == 12
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}
    parsed = DeepSpeedConfig(config)
    assert parsed.zero_config.sub_group_size == 2000 and parsed.grad_accum_dtype == "bf16"


def test_aio_block_from_the_spec() -> None:
    spec = job(
        deepspeed={
            "zero_stage": 3,
            "offload_param": "nvme",
            "nvme_path": "/nvme",
            "aio": {
                "block_size": 262144,
                "queue_depth": 32,
                "thread_count": 4,
                "single_submit": True,
                "overlap_events": False,
            },
        }
    )
    assert build_deepspeed_config(spec, world_size=1)["aio"] == {
        "block_size": 262144,
        "queue_depth": 32,
        "intra_op_parallelism": 4,
        "single_submit": True,
        "overlap_events": False,
    }


def test_a_frozen_reference_model_gets_zero_3_without_optimizer_and_its_own_swap_folder() -> None:
    spec = job(
        precision="bf16",
        deepspeed={"zero_stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": "/nvme"},
    )
    trained = build_deepspeed_config(spec, world_size=1)
    reference = reference_deepspeed_config(trained)
    assert "optimizer" not in reference and "scheduler" not in reference and reference["gradient_clipping"] == 0
    zero = reference["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero and reference["bf16"] == {"enabled": True}
    # DeepSpeed empties a swap folder as it opens it: the reference's must not be the trained model's
    assert zero["offload_param"]["nvme_path"] == "/nvme/dpo-reference" and reference["aio"] == trained["aio"]
    assert trained["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme" and "optimizer" in trained
    assert DeepSpeedConfig(reference).zero_config.offload_param.nvme_path.as_posix() == "/nvme/dpo-reference"


def test_fp16_uses_dynamic_loss_scaling() -> None:
    config = build_deepspeed_config(job(precision="fp16", scaling={"use_gpu": True}), world_size=8)
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert config["bf16"] == {"enabled": False}
    spec = job(
        precision="fp16",
        scaling={"use_gpu": True},
        deepspeed={"loss_scaling": {"initial_power": 24, "window": 50, "hysteresis": 1, "min_scale": 0.5}},
    )
    scaled = build_deepspeed_config(spec, world_size=1)["fp16"]
    assert (scaled["initial_scale_power"], scaled["loss_scale_window"]) == (24, 50)
    assert (scaled["hysteresis"], scaled["min_loss_scale"]) == (1, 0.5)


def test_optimizer_clipping_and_logging() -> None:
    spec = job(optim={"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01, "grad_clip": 0.5})
    config = build_deepspeed_config(spec, world_size=1)
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01},
    }
    assert config["gradient_clipping"] == 0.5
    assert config["steps_per_print"] >= 2**31 - 1 and config["wall_clock_breakdown"] is False
    assert "activation_checkpointing" not in build_deepspeed_config(job(gradient_checkpointing=True), world_size=1)


def _lrs(spec: TrainJobSpec) -> list[float]:
    """The lr of each of the run's steps, from DeepSpeed's own scheduler class built as the engine builds it."""
    scheduler_config = build_deepspeed_config(spec, world_size=1)["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=spec.optim.lr)
    scheduler = getattr(lr_schedules, scheduler_config["type"])(optimizer, **scheduler_config["params"])
    lrs = []
    for _ in range(spec.steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()  # the engine steps it after every optimizer step
    return lrs


@pytest.mark.parametrize("warmup", [0, 10])
def test_cosine_schedule_warms_up_then_decays_to_min_lr(warmup: int) -> None:
    spec = job(steps=100, optim={"lr": 1.0, "warmup_steps": warmup, "schedule": "cosine", "min_lr_ratio": 0.1})
    assert build_deepspeed_config(spec, world_size=1)["scheduler"]["type"] == "WarmupCosineLR"
    lrs = _lrs(spec)
    peak = lrs.index(max(lrs))
    assert lrs[:peak] == sorted(lrs[:peak]) and lrs[peak:] == sorted(lrs[peak:], reverse=True)
    assert max(lrs) == pytest.approx(1.0, abs=0.01)
    assert abs(peak - warmup) <= 2  # DeepSpeed: step k runs at iteration k-1, warmup counts at least 2
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


@pytest.mark.parametrize("warmup", [0, 10])
def test_linear_schedule_warms_up_then_decays_towards_min_lr(warmup: int) -> None:
    spec = job(steps=100, optim={"lr": 1.0, "warmup_steps": warmup, "schedule": "linear", "min_lr_ratio": 0.1})
    assert build_deepspeed_config(spec, world_size=1)["scheduler"]["type"] == "WarmupDecayLR"
    lrs = _lrs(spec)
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(1.0) and abs(peak - warmup) <= 3
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True)
    assert min(lrs) == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1, abs=0.03)


def test_constant_schedule() -> None:
    assert set(_lrs(job(optim={"lr": 0.5, "schedule": "constant"}))) == {0.5}
    lrs = _lrs(job(steps=20, optim={"lr": 0.5, "schedule": "constant", "warmup_steps": 5}))
    assert lrs[:7] == sorted(lrs[:7]) and set(lrs[7:]) == {0.5}


def test_torch_fused_adamw_steps_where_deepspeeds_fused_adam_cannot_be_built(monkeypatch, capsys) -> None:
    """GPU jobs: DeepSpeed's fused Adam is built where it can be (this machine's op, for real: the config stays);
    where it cannot, torch's fused AdamW takes the step and the log says why."""
    from deepspeed.accelerator import get_accelerator

    from pylon.jobs.train import _torch_adam_unless_fused_adam_builds

    spec = job(precision="bf16")
    config = build_deepspeed_config(spec, world_size=1)
    _torch_adam_unless_fused_adam_builds(config, rank=0)
    assert config["optimizer"] == build_deepspeed_config(spec, world_size=1)["optimizer"]

    builder = type(get_accelerator().create_op_builder("FusedAdamBuilder"))
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    _torch_adam_unless_fused_adam_builds(config, rank=0)
    assert config["optimizer"]["params"]["torch_adam"] is True and config["optimizer"]["params"]["fused"] is True
    assert "DeepSpeed's fused Adam could not be built here (not compatible" in capsys.readouterr().out
