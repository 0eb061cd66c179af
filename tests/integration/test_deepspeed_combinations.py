"""Every kind of DeepSpeed setup the spec allows on CPU really trains: ZeRO 0-3, optimizer and parameter offload
to CPU and NVMe, fp32 and bf16, plus gradient accumulation, gradient checkpointing and LoRA.

Each combination runs in its own process (`deepspeed_steps.py`): the model from `pylon.models.build_model`,
the config from `pylon.jobs.deepspeed_config.build_deepspeed_config`, real DeepSpeed on gloo, three steps on
one fixed batch. Two processes run at a time (this machine has two cores).

The full product (32 combinations) is pruned to a covering set: every stage and every offload target
(optimizer cpu/nvme, parameters cpu/nvme) appears with both fp32 and bf16. Not run: ZeRO-1/2 with
`offload_optimizer: nvme` -- DeepSpeed 0.19 runs that exactly like `cpu` (its ZeRO-1/2 optimizer has no NVMe
swapper; nothing is written to nvme_path), so it would prove nothing beyond the cpu cases.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deepspeed_steps import RESULT_PREFIX  # the helper beside this file

pytestmark = pytest.mark.integration

HELPER = Path(__file__).with_name("deepspeed_steps.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
LR = 1e-2

# A GPT-2 shape just wide enough that ZeRO-3 really partitions and offloads its matrices (DeepSpeed keeps
# parameters under 1e5 elements resident: stage3_param_persistence_threshold) and that NVMe swapping really
# writes them (DeepSpeed swaps only tensors of at least 1 MiB). gpt-tiny is below both, so offloading it
# would move nothing. Dropout is off so that runs are deterministic and comparable.
MODEL = {
    "config": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 384,
        "n_positions": 64,
        "vocab_size": 320,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
}


@dataclass(frozen=True)
class Combo:
    stage: int
    precision: str
    offload_optimizer: str = "none"
    offload_param: str = "none"
    extra: tuple[tuple[str, object], ...] = field(default=())  # more spec fields, as (key, value) pairs
    world_size: int = 1
    plain: bool = False  # plain PyTorch, no DeepSpeed: the parity reference
    steps: int = STEPS

    @property
    def id(self) -> str:
        if self.plain:
            return f"plain-{self.precision}"
        parts = [f"zero{self.stage}", self.precision]
        if self.offload_optimizer != "none":
            parts.append(f"opt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param-{self.offload_param}")
        parts += [key.replace("_", "-") for key, _ in self.extra]
        if self.world_size > 1:
            parts.append(f"{self.world_size}ranks")
        return "-".join(parts)

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    def spec(self, nvme_path: Path) -> dict:
        spec = {
            "kind": "TrainJob",
            "name": "combo",
            "model": MODEL,
            "data": {"uri": str(nvme_path / "unused")},
            "steps": 10,
            "precision": self.precision,
            "deepspeed": {
                "zero_stage": self.stage,
                "offload_optimizer": self.offload_optimizer,
                "offload_param": self.offload_param,
            },
            "batch": {"micro_batch_size": 4},
            # A constant lr, so that every one of the three steps applies an update.
            "optim": {"lr": LR, "schedule": "constant"},
        }
        if self.uses_nvme:
            spec["deepspeed"]["nvme_path"] = str(nvme_path)
        for key, value in self.extra:  # "a.b" sets spec["a"]["b"]
            *parents, leaf = key.split(".")
            target = spec
            for parent in parents:
                target = target.setdefault(parent, {})
            target[leaf] = value
        return spec


COMBOS = [
    # NVMe first: on a fresh clone they build DeepSpeed's async_io op, which then overlaps the other runs.
    Combo(3, "bf16", "nvme", "nvme"),
    Combo(3, "fp32", "nvme", "nvme"),
    Combo(3, "fp32", "nvme"),
    Combo(0, "fp32"),
    Combo(1, "fp32"),
    Combo(2, "fp32"),
    Combo(3, "fp32"),
    # bf16 at every stage, each once: stage 0 and 2 plain, 1 with the optimizer offloaded, 3 with everything
    # offloaded (here and to NVMe above). Fewer runs than stage x precision x offload, the same code paths.
    Combo(0, "bf16"),
    Combo(2, "bf16"),
    Combo(1, "bf16", "cpu"),
    # Half the rows per micro-batch make a noisier step: at LR the third overshoots this batch's minimum.
    Combo(
        2,
        "fp32",
        "cpu",
        extra=(("batch", {"micro_batch_size": 2, "grad_accum_steps": 2}), ("optim.lr", LR / 4)),
    ),
    Combo(3, "fp32", "none", "cpu"),
    Combo(3, "fp32", "cpu", "cpu"),
    # ... with the loss a chunk of tokens at a time too: each chunk's output layer gathered again, and recomputed
    Combo(3, "bf16", "cpu", "cpu", extra=(("gradient_checkpointing", True), ("loss_chunk_tokens", 24))),
    Combo(3, "fp32", "cpu", "cpu", extra=(("lora", {"r": 4, "target_modules": ["c_attn", "c_fc"]}),)),
]


# Loss parity: the same global batch of 4 rows as one plain PyTorch process, and as 2 DeepSpeed ranks of 2 rows
# for each ZeRO stage. Five steps, so four of the compared losses come after optimizer updates.
PARITY_STEPS = 5
PARITY = [
    Combo(0, "fp32", plain=True, steps=PARITY_STEPS, extra=(("batch", {"micro_batch_size": 4}),)),
    *(
        Combo(stage, "fp32", world_size=2, steps=PARITY_STEPS, extra=(("batch", {"micro_batch_size": 2}),))
        for stage in (1, 2, 3)
    ),
]

# The combinations the comparison tests below read, so the fixture can start them early.
_COMPARED = {
    "test_sharded_ranks_match_a_single_plain_process": [c.id for c in PARITY],
    "test_first_step_loss_is_identical_across_stages": [f"zero{stage}-fp32" for stage in range(4)],
    "test_offload_trains_like_no_offload": [
        "zero3-fp32",
        "zero3-fp32-param-cpu",
        "zero3-fp32-opt-cpu-param-cpu",
        "zero3-fp32-opt-nvme",
        "zero3-fp32-opt-nvme-param-nvme",
    ],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(combo: Combo, workdir: Path, *, resume: Path | None = None, steps_after: int = 1) -> dict:
    """Runs `combo` as `combo.world_size` processes (ranks of one gloo group); returns rank 0's result. `resume`:
    the processes first load the latest commit of an earlier run's checkpoint directory."""
    workdir.mkdir(parents=True)
    command = [sys.executable, str(HELPER), "--spec", json.dumps(combo.spec(workdir)), "--steps", str(combo.steps)]
    command += ["--plain"] if combo.plain else ["--checkpoint", str(workdir / "run")]
    command += ["--resume", str(resume)] if resume else []
    command += ["--steps-after", str(steps_after)]
    port = str(_free_port())
    procs = []
    for rank in range(combo.world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(combo.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        # Built DeepSpeed ops are cached in the repository's ignored .cache (the Makefile sets the same).
        env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
        procs.append(
            subprocess.Popen(command, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, stderr = proc.communicate()
        outputs.append((proc.returncode, stdout, stderr))
    for rank, (code, stdout, stderr) in enumerate(outputs):
        if code != 0:
            return {"error": f"rank {rank} exit {code}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-6000:]}"}
    code, stdout, stderr = outputs[0]
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        return {"error": f"no result line\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-6000:]}"}
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


class ComboRuns:
    """Each combination's run, started at most once, two at a time; `result` waits for one."""

    def __init__(self, root: Path):
        self._root = root
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._futures: dict[str, Future] = {}

    def start(self, combo: Combo) -> None:
        if combo.id not in self._futures:
            self._futures[combo.id] = self._pool.submit(_run, combo, self._root / combo.id)

    def result(self, combo: Combo) -> dict:
        self.start(combo)
        result = self._futures[combo.id].result()
        assert "error" not in result, f"{combo.id} failed: {result['error']}"
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Starts, up front, every combination the selected tests of this module will ask for."""
    runs = ComboRuns(tmp_path_factory.mktemp("deepspeed-combos"))
    # Only this module's contiguous run of items from here: the NVMe ones are moved to the session's end
    # (tests/conftest.py), where this fixture is set up again for them.
    items = request.session.items
    current = getattr(request, "_pyfuncitem", None)  # the test this module-scoped fixture is set up for
    first = items.index(current) if current in items else 0
    block = []
    for item in items[first:]:
        if item.module is not request.module:
            break
        block.append(item)
    for item in block:
        if item.get_closest_marker("skip"):
            continue
        if hasattr(item, "callspec") and "combo" in item.callspec.params:
            runs.start(item.callspec.params["combo"])
        else:
            for combo_id in _COMPARED.get(item.originalname, ()):
                runs.start(_by_id(combo_id))
    yield runs
    runs.close()


def _by_id(combo_id: str) -> Combo:
    return next(c for c in COMBOS + PARITY if c.id == combo_id)


# `make test` (CI, within 30 minutes) runs every stage, every offload target and every combination the comparison
# tests read; these add bf16 and feature variants of paths already covered, and run with `make test-all`.
SLOW = {
    # NVMe: make test-all (with DeepSpeed's async_io op, built for them in the background: minutes of a 2-core CI
    # machine's CPU); the offload paths themselves run with cpu in make test
    "zero3-bf16-opt-nvme-param-nvme",
    "zero3-fp32-opt-nvme-param-nvme",
    "zero3-fp32-opt-nvme",
    "zero0-bf16",
    "zero1-bf16-opt-cpu",
    "zero2-fp32-opt-cpu-batch-optim.lr",
    "zero3-fp32-opt-cpu-param-cpu-lora",
}


@pytest.mark.timeout(1500)  # the first NVMe combination may wait for DeepSpeed's async_io op to finish building
@pytest.mark.parametrize(
    "combo", [pytest.param(c, marks=pytest.mark.slow) if c.id in SLOW else c for c in COMBOS], ids=lambda c: c.id
)
def test_combination_trains(combo: Combo, runs: ComboRuns) -> None:
    result = runs.result(combo)
    losses = result["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    # One fixed batch: every applied step must lower its loss.
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert result["lrs"] == pytest.approx([dict(combo.extra).get("optim.lr", LR)] * STEPS)
    assert result["global_steps"] == STEPS
    assert result["zero_stage"] == combo.stage
    assert result["bf16"] == (combo.precision == "bf16")
    assert result["module_dtype"] == ("torch.bfloat16" if combo.precision == "bf16" else "torch.float32")
    if combo.offload_optimizer != "none":
        assert result["optimizer"] == "DeepSpeedCPUAdam"  # an offloaded optimizer steps on the host
    if combo.offload_param == "nvme":
        assert result["nvme_param_files"] > 0, "no parameter was swapped to nvme_path"
    if combo.offload_optimizer == "nvme":
        assert result["nvme_optimizer_files"] > 0, "no optimizer state was swapped to nvme_path"
    if dict(combo.extra).get("lora"):
        assert 0 < result["trainable"] < result["parameters"] / 10
    else:
        assert result["trainable"] == result["parameters"]
    # A committed checkpoint restores everything a step depends on (weights, optimizer state, lr schedule,
    # swapped tensors): the step after loading it repeats the step after saving it.
    assert result["committed_step"] == STEPS
    assert result["extra_after_load"] == {"rank": 0}
    if combo.stage > 0:  # ZeRO-1..3 write the partitioned optimizer state as its own file per rank
        assert any(name.endswith("optim_states.pt") for name in result["checkpoint_files"]), result["checkpoint_files"]
    else:  # stage 0 keeps the optimizer state inside the model-states file
        assert any(name.endswith("model_states.pt") for name in result["checkpoint_files"]), result["checkpoint_files"]
    assert result["losses_after_load"] == pytest.approx(result["losses_after_save"], rel=1e-6, abs=1e-6)
    # `pylon export`'s consolidation of that commit (NVMe master weights included) holds the engine's weights.
    assert result["export_tensors"] >= result["weights"] - 1, result  # a tied lm_head is saved once
    assert result["export_max_diff"] == 0.0, result


# ~110 s of four more runs; make test keeps every stage's own round trip and the first step's loss across stages
# (test_first_step_loss_is_identical_across_stages). `make test-all`.
@pytest.mark.slow
def test_sharded_ranks_match_a_single_plain_process(runs: ComboRuns) -> None:
    """Two ranks under ZeRO-1, -2 and -3 follow a plain single-process PyTorch run (torch AdamW, torch's
    clipping) on the same global batch: partitioning optimizer states, gradients and parameters across ranks
    must not change the arithmetic beyond rounding."""
    results = {c.id: runs.result(c) for c in PARITY}
    reference = results["plain-fp32"]
    assert reference["optimizer"] == "AdamW" and len(reference["losses"]) == PARITY_STEPS
    assert min(reference["losses"][1:]) < reference["losses"][0] - 0.5, reference["losses"]  # it really trained
    for combo in PARITY[1:]:
        result = results[combo.id]
        assert result["world_size"] == 2 and result["zero_stage"] == combo.stage
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4), (
            combo.id,
            result["losses"],
            reference["losses"],
        )


def test_first_step_loss_is_identical_across_stages(runs: ComboRuns) -> None:
    """Before any update, every fp32 stage computes the same loss from the same seed: sharding changes where
    the weights live, never what they are."""
    first = {
        combo_id: runs.result(_by_id(combo_id))["losses"][0]
        for combo_id in _COMPARED["test_first_step_loss_is_identical_across_stages"]
    }
    assert len(set(first.values())) == 1, first


@pytest.mark.slow  # ~45 s; make test trains and round-trips each offload target (test_combination_trains)
@pytest.mark.nvme
@pytest.mark.timeout(1500)  # may wait for DeepSpeed's async_io op to finish building
def test_offload_trains_like_no_offload(runs: ComboRuns) -> None:
    """fp32 runs follow the same loss curve wherever the tensors live: offload moves tensors, it must not
    change the arithmetic (on CPU, DeepSpeed's fused Adam and the CPU Adam an offloaded optimizer runs share
    one kernel, so they agree to rounding too)."""
    losses = {
        combo_id: runs.result(_by_id(combo_id))["losses"]
        for combo_id in _COMPARED["test_offload_trains_like_no_offload"]
    }
    reference = losses["zero3-fp32"]
    for combo_id in ("zero3-fp32-param-cpu", "zero3-fp32-opt-cpu-param-cpu", "zero3-fp32-opt-nvme"):
        assert losses[combo_id] == pytest.approx(reference, rel=1e-6), combo_id
    # Parameters swapped to NVMe come back rounded to bf16 on the CPU accelerator, even in an fp32 run:
    # DeepSpeed 0.19's zero.Init._set_dtype reads `dtype or torch.float16 if <fp16 supported> else
    # torch.bfloat16 ...`, and the CPU accelerator has no fp16, so the parameter swapper gets bf16. The fp32
    # master weights in the optimizer stay exact, so the curve stays close, not identical.
    assert losses["zero3-fp32-opt-nvme-param-nvme"] == pytest.approx(reference, rel=1e-3)


def _pretrained_directory(local: Path, remote: str) -> None:
    """A model directory as `save_pretrained` writes it (safetensors), different from any seed's fresh model
    (its token embeddings scaled up), on local disk and on object storage."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon import storage

    fields = dict(MODEL["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(local, safe_serialization=True)
    fs, path = storage.resolve(remote)
    fs.put(str(local), path, recursive=True)


def _pretrained_parity(tmp_path: Path, s3_root: str, zero3: Combo) -> tuple[dict, dict]:
    local, remote = tmp_path / "base", f"{s3_root}/base"
    _pretrained_directory(local, remote)
    plain = Combo(0, "fp32", plain=True, steps=PARITY_STEPS, extra=(("batch", {"micro_batch_size": 4}),))
    with ThreadPoolExecutor(max_workers=2) as pool:
        reference = pool.submit(_run, _with_model(plain, {"path": str(local)}), tmp_path / "plain")
        partitioned = pool.submit(_run, _with_model(zero3, {"path": remote}), tmp_path / "zero3")
        reference, partitioned = reference.result(), partitioned.result()
    assert "error" not in reference, reference.get("error")
    assert "error" not in partitioned, partitioned.get("error")
    # The scaled embeddings make the pretrained loss far from a fresh model's (about ln 320 = 5.77).
    assert abs(reference["losses"][0] - math.log(320)) > 0.5, reference["losses"]
    assert partitioned["world_size"] == 2 and partitioned["zero_stage"] == 3
    # Before any update the two models are the same function: the first losses agree to rounding.
    assert partitioned["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5), (partitioned, reference)
    return reference, partitioned


def _with_model(combo: Combo, model: dict) -> Combo:
    return Combo(**{**combo.__dict__, "extra": (*combo.extra, ("model", model))})


def test_zero3_streams_pretrained_weights_into_partitions(tmp_path: Path, s3_root: str) -> None:
    """ZeRO-3 builds the model partitioned (zero.Init) and streams a pretrained directory from object storage
    into the partitions, rank 0 reading one tensor at a time: two ranks, parameters offloaded to CPU, start from
    exactly the weights one plain process loads with `from_pretrained`, and train like it."""
    zero3 = Combo(
        3, "fp32", "none", "cpu", world_size=2, steps=PARITY_STEPS, extra=(("batch", {"micro_batch_size": 2}),)
    )
    reference, partitioned = _pretrained_parity(tmp_path, s3_root, zero3)
    assert partitioned["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@pytest.mark.slow
def test_zero3_lora_on_a_pretrained_base(tmp_path: Path, s3_root: str) -> None:
    """LoRA on a pretrained base built partitioned: the adapters start at zero (B = 0), so the first loss is the
    base's; only the adapters train, and the loss falls."""
    lora = {"r": 4, "target_modules": ["c_attn", "c_fc"]}
    zero3 = Combo(
        3,
        "fp32",
        "cpu",
        "cpu",
        world_size=2,
        steps=PARITY_STEPS,
        extra=(("batch", {"micro_batch_size": 2}), ("lora", lora)),
    )
    _, partitioned = _pretrained_parity(tmp_path, s3_root, zero3)
    assert 0 < partitioned["trainable"] < partitioned["parameters"] / 10
    assert partitioned["losses"][-1] < partitioned["losses"][0]


@pytest.mark.slow  # ~30 s of a two-rank ZeRO-3 start for one bad-input case, for make test's time; `make test-all`
def test_zero3_pretrained_weights_of_another_shape_name_the_tensor(tmp_path: Path, s3_root: str) -> None:
    """A model directory whose weights do not match its config is an error naming the file and the tensor, on
    every rank, before anything trains (not a hang in a collective, not a silently random model)."""
    local, remote = tmp_path / "base", f"{s3_root}/base"
    _pretrained_directory(local, remote)
    config = json.loads((local / "config.json").read_text())
    config["n_embd"] = 256  # the weights are 384 wide
    (local / "config.json").write_text(json.dumps(config))
    zero3 = Combo(3, "fp32", world_size=2, steps=1, extra=(("batch", {"micro_batch_size": 2}),))
    result = _run(_with_model(zero3, {"path": str(local)}), tmp_path / "run")
    assert "error" in result, result
    shape = r"model\.safetensors: tensor (\S+) has shape \[([\d, ]+)\], the model expects \[([\d, ]+)\]"
    found = re.search(shape, result["error"])
    assert found, result["error"][-3000:]
    assert found.group(2) != found.group(3), found.group(0)  # the file's shape (384 wide), then the config's (256)


@pytest.mark.slow  # ~60 s; make test sees NVMe round trips in-process (test_combination_trains)
@pytest.mark.nvme
@pytest.mark.timeout(1500)
def test_nvme_offload_resumes_in_a_new_process(tmp_path: Path) -> None:
    """A run with parameters and optimizer on NVMe, resumed by new processes with fresh swap files (as a resubmitted
    job on another machine is): their first two steps repeat the two steps the first run took after committing.

    Small optimizer sub-groups put each rank's partition into four, the last (the final norms, 576 elements)
    under DeepSpeed's smallest swap, so it stays in memory: DeepSpeed's own NVMe load restores neither it nor any
    sub-group's Adam moments and step count (`jobs/checkpoint.py: _restore_swapped_optimizer`); the second step
    after the resume is where lost moments show."""
    extra = (("batch", {"micro_batch_size": 2}), ("deepspeed.buffers", {"sub_group_size": 400_000}))
    combo = Combo(3, "fp32", "nvme", "nvme", world_size=2, extra=extra)
    first = _run(combo, tmp_path / "first", steps_after=2)
    assert "error" not in first, first.get("error")
    assert first["losses_after_load"] == pytest.approx(first["losses_after_save"], rel=1e-6), first
    # Four sub-groups a rank, swap files padded to the I/O alignment: the export still reads the exact weights.
    assert first["export_max_diff"] == 0.0 and first["export_tensors"] >= first["weights"] - 1, first
    again = Combo(**{**combo.__dict__, "steps": 2})
    resumed = _run(again, tmp_path / "resumed", resume=tmp_path / "first" / "run")
    assert "error" not in resumed, resumed.get("error")
    assert resumed["losses"] == pytest.approx(first["losses_after_save"], rel=1e-5), (resumed, first)
