"""Training step time and MFU: plain PyTorch DDP vs DeepSpeed ZeRO-1, -2, -3, and levers on top of them (fused
AdamW, torch.compile, bucket sizes, activation checkpointing), in one run, on the same model and the same data.

    .venv/bin/python bench/train_step.py                         # CPU: gpt-small, 2 workers, fp32
    .venv/bin/python bench/train_step.py --model gpt-tiny --steps 2 --warmup 1 --workers 1
    python bench/train_step.py --device cuda --json /tmp/ts.json             # GPU: the default variants, ~3 min
    python bench/train_step.py --device cuda --only levers --json /tmp/tl.json   # GPU: the levers, ~6 min
    python bench/train_step.py --device cuda --only ddp,zero2+ckpt --micro-batch 4

Each variant runs as `--workers` fresh processes of one process group (gloo on CPU; NCCL on CUDA, one process
per GPU: more workers than GPUs is refused), started the same way; the model comes from
`pylon.models.build_model` and every DeepSpeed config from `pylon.jobs.deepspeed_config.build_deepspeed_config`,
as a Pylon training job builds them. The data is `shared/datasets/tinyshakespeare.txt` as bytes (the byte
tokenizer's ids, < 256), the same rows for every variant (repeated when the run needs more; seeded random bytes
if the file is not there). After `--warmup` untimed steps (compilation happens there), the median of `--steps`
timed steps is the step time. The baseline is DDP (torch.nn.parallel.DistributedDataParallel +
torch.optim.AdamW, torch's gradient clipping; bf16/fp16 by torch.autocast over fp32 weights, as DeepSpeed keeps
fp32 masters).

Defaults: on CPU gpt-small, 2 workers x micro-batch 4 x seq 256, fp32, 2 + 8 steps; on CUDA llama-1b, 1 worker
x micro-batch 8 x seq 2048 (micro-batch 4 on a GPU under 100 GiB, such as an H100 80GB: DDP would need ~60 GiB),
bf16, 3 + 10 steps. Models: a Pylon preset (`pylon.presets`, with the byte tokenizer's 320-token vocabulary) or
one of the bench's Llama shapes, passed as an explicit `model.config`: llama-1b (Llama 3.2 1B's shape: hidden
2048, 16 layers, MLP 8192, 32 heads / 8 KV heads, tied embeddings; here a 32000-token vocabulary: 1.04B
parameters) and llama-350m.

Variants are named `BASE[+LEVER...]`, BASE one of ddp, zero1, zero2, zero3; the levers:
  fused-adamw     torch.optim.AdamW(fused=True). For ZeRO, a bench override of the DeepSpeed config Pylon builds
                  (optimizer.params torch_adam + fused: torch's fused AdamW steps DeepSpeed's fp32 partitions)
                  in place of Pylon's choice, "AdamW", which DeepSpeed runs as its FusedAdam on a GPU
  compile         torch.compile of the whole model: torch.compile(DDP(model)) (with one rank, without
                  DDPOptimizer's graph splits); DeepSpeed's engine.compile()
  compile-layers  torch.compile of each decoder layer (TorchTitan's per-block compile), before DDP/DeepSpeed
  ckpt            activation checkpointing (spec gradient_checkpointing: each decoder layer's forward is
                  recomputed in the backward); MFU counts model FLOPs only, HFU adds the recomputed forward
  buckets-N       gradient buckets of N elements (e.g. 50m, 1g): ZeRO reduce_bucket_size and allgather_bucket_size
                  (prefetch at ZeRO-3; a bench override of the config), DDP bucket_cap_mb (N fp32 gradients)
  cpu-offload     ZeRO optimizer offload to the CPU (DeepSpeedCPUAdam)
  chunk-N         the loss N tokens at a time (TrainJob loss_chunk_tokens: the output layer and cross-entropy per
                  chunk, recomputed in the backward pass; no whole-batch logits)
  docs-N          rows packed from documents of N tokens (an eos ends each), attended each on its own
                  (TrainJob attention_mask: document: `Batch.to_torch(documents=True)`'s restarting position_ids,
                  which transformers turns into a block-diagonal mask); against the same rows attended causally
`--only` takes names and the groups `default`, `levers`, `all`. Default variants: on CPU ddp, zero1, zero2,
zero3, zero2+cpu-offload; on CUDA ddp, ddp+fused-adamw, zero1, zero2, zero3, zero2+ckpt (about 3 minutes on
one H100/H200). `levers`: ddp, ddp+fused-adamw, ddp+fused-adamw+compile-layers, zero2, zero2+fused-adamw,
zero2+buckets-50m, zero2+compile (about 6 minutes). On a GPU, DeepSpeed's fused_adam op is JIT-built once
(nvcc, about a minute) in the background while the DDP variants run; if it cannot be built, the ZeRO variants
step torch's fused AdamW instead and the output says so (`--ds-adam` chooses explicitly). A variant that fails
(out of memory, a compile error, `--variant-timeout`) prints its error's tail and the run goes on.

Prints, as each variant ends, its step time, tokens/s, MFU and peak memory; then a header (device, compute
capability, driver, CUDA, torch / DeepSpeed / transformers versions, the model's parameters and FLOPs per token,
the catalog's dense peak for this GPU -- `pylon.plan` accelerators.yaml, matched by the device's name -- and the
matmul peak measured in the same run), and a table per variant: step time and its forward / backward /
optimizer parts (CUDA events; the clock on CPU), tokens/s, ratio to DDP's step time, MFU against the catalog
peak, MFU against the measured peak, HFU, peak memory (torch.cuda.max_memory_allocated on a GPU; on CPU rank 0's
peak resident set, the process's whole: weights, optimizer, activations, Python), first and last
loss; the optimizer each variant stepped and the bench's config overrides; what each lever changed (a variant
against the same one without its last lever); and, on a GPU, the gap to TorchTitan's published 33-39% MFU
(Llama 3.1 8B on 8 H100s, FSDP, bf16, no float8: 33% eager, 39% with torch.compile) in this run's numbers: the
matmul ceiling (measured / datasheet peak), the step's time at the measured matmul rate against its forward,
backward and optimizer parts, and the scale difference. MFU = flops_per_token x tokens/s / (peak x workers),
`pylon.models.flops_per_token` being 6N + 12·layers·d_model·seq (PaLM's estimate, TorchTitan's convention; no
recomputation). The measured peak is the best rate of large matmuls in the run's precision (8192^3 on a GPU,
1024^3 on CPU) in each variant's rank 0 process, after its steps. `--json PATH` writes every result and the
derived numbers, after each variant. Target on CPU: ZeRO-2 within 1.3x of DDP's step time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_FILES = (
    REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt",
    REPO / "shared" / "datasets" / "tinyshakespeare.txt",
)
RESULT = "train_step: "
BYTE_VOCAB, BYTE_EOS, BYTE_PAD = 320, 256, 257

# The bench's own model shapes (explicit `model.config` specs): Llama-shaped, sized for one GPU.
BENCH_MODELS: dict[str, dict] = {
    # Llama 3.2 1B's shape (tied embeddings) with a 32000-token vocabulary: 1.04B parameters.
    "llama-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 32000,
    },
    # ~350M parameters.
    "llama-350m": {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
}

BASES = {"ddp": None, "zero1": 1, "zero2": 2, "zero3": 3}
DEFAULT_VARIANTS = {
    "cpu": ["ddp", "zero1", "zero2", "zero3", "zero2+cpu-offload"],
    "cuda": ["ddp", "ddp+fused-adamw", "zero1", "zero2", "zero3", "zero2+ckpt"],
}
# The levers on a GPU, each next to the variant without it (about 6 minutes on one H100/H200: two compiles).
LEVER_VARIANTS = [
    "ddp",
    "ddp+fused-adamw",
    "ddp+fused-adamw+compile-layers",
    "zero2",
    "zero2+fused-adamw",
    "zero2+buckets-50m",
    "zero2+compile",
]
# Settings per device where the command line gives none.
DEVICE_DEFAULTS = {
    "cpu": {
        "model": "gpt-small",
        "workers": 2,
        "micro_batch": 4,
        "seq_len": 256,
        "steps": 8,
        "warmup": 2,
        "precision": "fp32",
        "variant_timeout": 1800.0,
    },
    "cuda": {
        "model": "llama-1b",
        "workers": 1,
        "micro_batch": None,  # 8 on a GPU with 100 GiB or more, else 4 (main)
        "seq_len": 2048,
        "steps": 10,
        "warmup": 3,
        "precision": "bf16",
        "variant_timeout": 300.0,
    },
}
MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}  # large enough to reach a GPU's tensor-core rate
TORCHTITAN_MFU = (0.33, 0.39)


@dataclass(frozen=True)
class Variant:
    name: str
    stage: int | None  # None: DDP
    offload: str = "none"
    fused_adamw: bool = False
    compile: str | None = None  # "model" or "layers"
    ckpt: bool = False
    buckets: int | None = None  # elements
    docs: int | None = None  # tokens per packed document, attended each on its own
    chunk: int | None = None  # loss_chunk_tokens


def parse_variant(name: str) -> Variant:
    """`BASE[+LEVER...]` as a Variant (ValueError saying what is wrong)."""
    base, *levers = name.split("+")
    if base not in BASES:
        raise ValueError(f"{name}: the base must be one of {', '.join(BASES)}")
    stage = BASES[base]
    fields: dict = {}
    for lever in levers:
        if lever == "cpu-offload":
            if stage is None:
                raise ValueError(f"{name}: cpu-offload needs a ZeRO stage")
            fields["offload"] = "cpu"
        elif lever == "fused-adamw":
            fields["fused_adamw"] = True
        elif lever in ("compile", "compile-layers"):
            fields["compile"] = "model" if lever == "compile" else "layers"
        elif lever == "ckpt":
            fields["ckpt"] = True
        elif m := re.fullmatch(r"chunk-(\d+)", lever):
            if int(m.group(1)) < 1:
                raise ValueError(f"{name}: chunk-N needs at least 1 token a chunk")
            fields["chunk"] = int(m.group(1))
        elif m := re.fullmatch(r"docs-(\d+)", lever):
            if int(m.group(1)) < 2:
                raise ValueError(f"{name}: docs-N needs documents of at least 2 tokens")
            fields["docs"] = int(m.group(1))
        elif m := re.fullmatch(r"buckets-(\d+(?:\.\d+)?)([kmg]?)", lever):
            fields["buckets"] = int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])
        else:
            raise ValueError(
                f"{name}: unknown lever {lever!r}; levers: fused-adamw, compile, compile-layers, ckpt, "
                "buckets-N (e.g. buckets-50m), cpu-offload, chunk-N (e.g. chunk-2048), docs-N (e.g. docs-256)"
            )
    if fields.get("offload") == "cpu" and fields.get("fused_adamw"):
        raise ValueError(f"{name}: cpu-offload steps DeepSpeed's CPU Adam; fused-adamw does not apply")
    return Variant(name=name, stage=stage, **fields)


def select_variants(only: str | None, device: str) -> list[Variant]:
    names: list[str] = []
    for item in (only or "default").split(","):
        item = item.strip()
        if item == "default":
            group = DEFAULT_VARIANTS[device]
        elif item == "levers":
            group = LEVER_VARIANTS
        elif item == "all":
            group = DEFAULT_VARIANTS["cpu"] + DEFAULT_VARIANTS["cuda"] + LEVER_VARIANTS
        else:
            group = [item]
        names += [n for n in group if n and n not in names]
    return [parse_variant(n) for n in names]


def model_fields(model: str) -> dict:
    """The Hugging Face config fields `--model` names: a bench shape or a Pylon preset (with the byte vocabulary,
    as a training job on the byte tokenizer would have)."""
    if model in BENCH_MODELS:
        return dict(BENCH_MODELS[model])
    from pylon.presets import MODEL_PRESETS, preset_config

    if model not in MODEL_PRESETS:
        raise SystemExit(
            f"--model {model}: neither a bench model ({', '.join(BENCH_MODELS)}) nor a Pylon preset "
            f"({', '.join(MODEL_PRESETS)})"
        )
    return {**preset_config(model), "vocab_size": BYTE_VOCAB}


def _spec(args, variant: Variant) -> dict:
    model = {"config": BENCH_MODELS[args.model]} if args.model in BENCH_MODELS else {"preset": args.model}
    return {
        "kind": "TrainJob",
        "name": "bench",
        "model": model,
        "data": {"uri": "unused"},
        "scaling": {"num_workers": args.workers, "use_gpu": args.device == "cuda"},
        "deepspeed": {"zero_stage": variant.stage or 0, "offload_optimizer": variant.offload},
        "precision": args.precision,
        "gradient_checkpointing": variant.ckpt,
        "loss_chunk_tokens": variant.chunk or 0,
        "steps": args.warmup + args.steps,
        "batch": {"micro_batch_size": args.micro_batch},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
    }


def _rows(rank: int, world: int, steps: int, micro: int, seq_len: int):
    """This rank's batches: consecutive windows of the text's bytes, the same for every variant."""
    import torch

    need = steps * micro * world * seq_len
    path = next((p for p in DATA_FILES if p.exists()), None)
    if path is not None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        data = data.repeat(-(-need // len(data)))[:need]  # repeated when the run needs more bytes than the file has
    else:
        data = torch.randint(0, 256, (need,), generator=torch.Generator().manual_seed(0))
    data = data.reshape(steps, world, micro, seq_len)
    return [data[s, rank] for s in range(steps)]


def _inputs(ids, docs: int | None) -> dict:
    """A batch's model inputs: the rows as they are (labels = ids, the model shifts them), or with `docs` cut into
    documents of that many tokens (each ending with eos) attended each on its own, as a training job's
    `attention_mask: document` batches are (`Batch.to_torch`, `model_inputs`)."""
    if docs is None:
        return {"input_ids": ids, "labels": ids}
    import numpy as np

    from pylon.data.reader import Batch
    from pylon.jobs.train import model_inputs

    rows = ids.numpy().copy()
    rows[:, docs - 1 :: docs] = BYTE_EOS
    length = np.full(len(rows), rows.shape[1], dtype=np.int32)
    inputs = Batch(np.arange(len(rows)), rows, length, 0.0, eos_id=BYTE_EOS).to_torch(BYTE_PAD, documents=True)
    return {**model_inputs(inputs), "labels": inputs["labels"]}


def _decoder_layers(model):
    """The model's list of decoder blocks (Llama's model.layers, GPT-2's transformer.h)."""
    base = model.base_model
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise RuntimeError(f"compile-layers: no decoder layers found in {type(model).__name__}")
    return layers


class _Phases:
    """Marks between a step's parts: CUDA events on a GPU (read after the step's synchronize), else the clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        pairs = list(zip(self.marks, self.marks[1:]))
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in pairs]
        return [b - a for a, b in pairs]


def worker(args) -> None:
    """One rank of one variant (runs in its own process)."""
    import torch
    import torch.distributed as dist

    from pylon.models import (
        build_model,
        flops_per_token,
        mean_token_loss,
        measure_matmul_peak_flops,
        parameter_counts,
    )
    from pylon.specs import TrainJobSpec

    variant = parse_variant(args.variant)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = TrainJobSpec.model_validate(_spec(args, variant))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    vocab = model_fields(args.model)["vocab_size"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
    info: dict = {"torch": torch.__version__}
    forward_kwargs = {"use_cache": False}  # no KV cache while training
    if variant.compile:
        import torch._dynamo

        # Every decoder layer is compiled on its own with compile-layers: room for one recompile per layer, should
        # a guard tell them apart, rather than a silent fall back to eager after 8.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if world == 1 and variant.stage is None:
            # DDPOptimizer splits the graph at every gradient bucket (25 MiB: here about one per weight matrix) to
            # overlap all-reduces with the backward: with one rank nothing to overlap, only many more compiles.
            torch._dynamo.config.optimize_ddp = False
            info["dynamo_optimize_ddp"] = False

    if variant.stage is None:
        dist.init_process_group(backend)
        model = build_model(spec, vocab_size=vocab, eos_id=BYTE_EOS, pad_id=BYTE_PAD, seed=0).to(device)
        model.train()
        if variant.compile == "layers":
            for layer in _decoder_layers(model):
                layer.compile()
        ddp_kwargs = {}
        if variant.buckets:
            ddp_kwargs["bucket_cap_mb"] = max(1, round(variant.buckets * 4 / 2**20))  # fp32 gradients, MiB
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None, **ddp_kwargs
        )
        runner = torch.compile(ddp) if variant.compile == "model" else ddp
        optimizer = torch.optim.AdamW(
            ddp.parameters(),
            lr=spec.optim.lr,
            betas=spec.optim.betas,
            eps=spec.optim.eps,
            weight_decay=spec.optim.weight_decay,
            fused=True if variant.fused_adamw else None,
        )
        info["optimizer"] = _describe_optimizer(optimizer)

        def step(ids, phases):
            optimizer.zero_grad(set_to_none=True)
            phases.mark()
            # Mixed precision the torch way (fp32 weights, autocast matmuls), as DeepSpeed's bf16 keeps fp32 masters.
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = mean_token_loss(runner(**{**forward_kwargs, **ids}))
            phases.mark()
            loss.backward()
            phases.mark()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), spec.optim.grad_clip)
            optimizer.step()
            phases.mark()
            return loss
    else:
        import deepspeed

        from pylon.jobs.deepspeed_config import build_deepspeed_config

        info["deepspeed"] = deepspeed.__version__
        deepspeed.init_distributed(dist_backend=backend)
        config = build_deepspeed_config(spec, world_size=world)
        overrides = {}
        if variant.fused_adamw or (args.ds_adam == "torch-fused" and variant.offload == "none"):
            # Bench override: torch's fused AdamW (DeepSpeed's torch_adam path passes `fused` on to it).
            config["optimizer"]["params"].update(torch_adam=True, fused=True)
            overrides["optimizer.params"] = {"torch_adam": True, "fused": True}
        if variant.buckets:
            zero = config["zero_optimization"]
            zero["reduce_bucket_size"] = variant.buckets
            keys = ["reduce_bucket_size"]
            if variant.stage == 3:
                zero["stage3_prefetch_bucket_size"] = variant.buckets
                keys.append("stage3_prefetch_bucket_size")
            else:
                zero["allgather_bucket_size"] = variant.buckets
                keys.append("allgather_bucket_size")
            overrides.update({f"zero_optimization.{k}": variant.buckets for k in keys})
        info["config_overrides"] = overrides
        # As a training job builds it: ZeRO-3 partitioned (zero.Init); stages 1-2 built once and broadcast.
        model = build_model(
            spec,
            vocab_size=vocab,
            eos_id=BYTE_EOS,
            pad_id=BYTE_PAD,
            seed=0,
            deepspeed_config=config,
            device=device if cuda else None,
        )
        model.train()
        if variant.compile == "layers":
            for layer in _decoder_layers(model):
                layer.compile()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
        )
        if variant.compile == "model":
            engine.compile()
        info["optimizer"] = _describe_optimizer(engine.basic_optimizer)

        def step(ids, phases):
            phases.mark()
            loss = mean_token_loss(engine(**{**forward_kwargs, **ids}))
            phases.mark()
            engine.backward(loss)
            phases.mark()
            engine.step()
            phases.mark()
            return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rows = [
        _inputs(r, variant.docs) for r in _rows(rank, world, args.warmup + args.steps, args.micro_batch, args.seq_len)
    ]
    times, phase_times, losses = [], [], []
    for i, ids in enumerate(rows):
        ids = {k: v.to(device) if hasattr(v, "to") else v for k, v in ids.items()}
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        phases = _Phases(cuda)
        t0 = time.perf_counter()
        loss = step(ids, phases)
        losses.append(loss.item())  # .item() waits for the step to finish on any device
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        if i >= args.warmup:
            times.append(elapsed.item())
            phase_times.append(phases.seconds())
    if variant.compile:
        try:
            from torch._dynamo.utils import counters

            info["dynamo"] = {
                "unique_graphs": counters["stats"]["unique_graphs"],
                "graph_breaks": sum(counters["graph_break"].values()),
            }
        except Exception as e:  # counters are internal: report, never fail over them
            info["dynamo"] = {"error": repr(e)}
    if not cuda:  # each variant runs in fresh processes: rank 0's peak resident set is this variant's
        import resource

        info["max_memory_allocated"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if cuda:
        info.update(
            max_memory_allocated=torch.cuda.max_memory_allocated(device),
            device_name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            device_memory=torch.cuda.get_device_properties(device).total_memory,
            torch_cuda=torch.version.cuda,
        )
    base_config = model.config
    fpt = flops_per_token(base_config, args.seq_len)
    # HF checkpointing recomputes each decoder layer's forward: a third of the model FLOPs except the output
    # projection's (vocab x d_model, not recomputed).
    recompute = (fpt - 6.0 * base_config.vocab_size * base_config.hidden_size) / 3 if variant.ckpt else 0.0
    size = MATMUL_SIZE[args.device]
    peak = measure_matmul_peak_flops(seconds=1.0, device=device, dtype=dtype, size=size) if rank == 0 else 0.0
    if rank == 0:
        info.update(
            params=parameter_counts(model)[0], attn_implementation=getattr(base_config, "_attn_implementation", None)
        )
        result = {
            "times": times,
            "phases": phase_times,
            "losses": losses,
            "peak_flops": peak,
            "matmul_size": size,
            "flops_per_token": fpt,
            "recompute_flops_per_token": recompute,
            **info,
        }
        print(RESULT + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _describe_optimizer(optimizer) -> str:
    name = type(optimizer).__name__
    if not type(optimizer).__module__.startswith("torch."):
        return name  # DeepSpeed's FusedAdam (multi-tensor CUDA kernel) or DeepSpeedCPUAdam
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        return f"torch {name} (fused)"
    if group.get("foreach") is not None:
        return f"torch {name} (foreach={group['foreach']})"
    return f"torch {name} (torch's default: foreach on a GPU, a loop on CPU)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _extensions_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env


def _kill(procs) -> None:
    """Our own ranks (and what they started: compile workers), each by its process group."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_variant(args, variant: Variant) -> dict:
    """Start `--workers` ranks of one variant and return rank 0's result, or {"error": ..., "tail": ...}."""
    port = str(_free_port())
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    command = [sys.executable, __file__, "--worker", "--variant", variant.name, "--ds-adam", args.ds_adam]
    command += args.passthrough
    procs, logs = [], []
    why, line = None, None
    with tempfile.TemporaryDirectory(prefix="train-step-") as tmp:
        try:
            for rank in range(args.workers):
                env = dict(
                    _extensions_env(),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(args.workers),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    OMP_NUM_THREADS=str(threads),
                )
                out, err = Path(tmp, f"{rank}.out"), Path(tmp, f"{rank}.err")
                logs.append((out, err))
                with out.open("w") as o, err.open("w") as e:
                    procs.append(subprocess.Popen(command, env=env, stdout=o, stderr=e, start_new_session=True))
            deadline = time.monotonic() + args.variant_timeout
            failed_at = result_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now  # the others may wait on it forever in a collective: a little grace, then kill
                if result_at is None and _result_line(logs[0][0]) is not None:
                    result_at = now  # measured: a teardown that hangs must not lose it
                if now > deadline:
                    why = f"timed out after {args.variant_timeout:.0f} s (--variant-timeout)"
                    break
                if (failed_at is not None and now - failed_at > 30) or (result_at is not None and now - result_at > 60):
                    break
                time.sleep(0.2)
        finally:
            _kill(procs)
        line = _result_line(logs[0][0])
        texts = [(out.read_text(errors="replace"), err.read_text(errors="replace")) for out, err in logs]
    if line is not None:  # rank 0 measured and reported: a failure while tearing down does not undo that
        return json.loads(line[len(RESULT) :])
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    rank = failed[0] if failed and not why else 0
    out, err = texts[rank]
    tail = "\n".join((out[-1500:] + "\n" + err[-4000:]).strip().splitlines()[-40:])
    return {"error": why or f"rank {rank} exited with {procs[rank].returncode}", "tail": tail}


def _result_line(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return next((x for x in text.splitlines() if x.startswith(RESULT)), None)


def _needs_fused_adam(variant: Variant) -> bool:
    """Whether the variant steps Pylon's optimizer choice, DeepSpeed's FusedAdam on a GPU."""
    return variant.stage is not None and variant.offload == "none" and not variant.fused_adamw


class FusedAdamBuild:
    """DeepSpeed's fused_adam op (the optimizer Pylon's config gets on a GPU), JIT-built once by a process of its
    own, started before the variants (at low priority, while those that need no DeepSpeed run) and waited for
    before the first variant that needs it, so that no variant's start-up is the build. If it fails, the ZeRO
    variants step torch's fused AdamW instead (args.ds_adam = "torch-fused") and `note` says so."""

    CODE = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(verbose=False)"

    def __init__(self, args, variants: list[Variant]) -> None:
        self.args, self.proc, self.note, self.log = args, None, None, None
        if args.device != "cuda" or args.ds_adam != "auto" or not any(_needs_fused_adam(v) for v in variants):
            return
        self.log = tempfile.TemporaryFile(mode="w+")
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [*nice, sys.executable, "-c", self.CODE],
            env=_extensions_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        print("building DeepSpeed's fused_adam op in the background (JIT, about a minute) ...", flush=True)

    def wait(self, timeout: float = 600) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - self.t0)))
            ok, why = proc.returncode == 0, f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            _kill([proc])
            ok, why = False, f"not done after {timeout:.0f} s"
        self.log.seek(0)
        tail = self.log.read()[-3000:].strip()
        self.log.close()
        if ok:
            self.args.ds_adam = "deepspeed"
            print(f"  fused_adam ready after {time.perf_counter() - self.t0:.0f} s", flush=True)
            return
        self.args.ds_adam = "torch-fused"
        self.note = (
            f"DeepSpeed's FusedAdam could not be built here ({why}): the ZeRO variants step torch's fused AdamW "
            "(config override torch_adam + fused)"
        )
        print(f"  fused_adam could not be built ({why}):\n{_indent(tail)}", flush=True)

    def close(self) -> None:
        if self.proc is not None:
            _kill([self.proc])
            self.proc = None


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()[-30:])


def _query_gpu() -> tuple[str | None, float | None]:
    """(driver version, the first GPU's memory in GiB) from nvidia-smi, None where it does not answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None, None
    driver, _, memory = (x.strip() for x in lines[0].partition(","))
    try:
        return driver or None, float(memory) / 1024  # MiB
    except ValueError:
        return driver or None, None


def catalog_accelerator(device_name: str):
    """(the catalog's Accelerator for this device name or None, a sentence saying how it was matched)."""
    from pylon.errors import PylonError
    from pylon.plan.catalog import load_catalog

    catalog = load_catalog()
    words = [w for w in device_name.split() if w.upper() not in {"NVIDIA", "AMD", "TESLA"}]
    found = None
    for end in range(len(words), 0, -1):  # the longest leading run of words the catalog knows
        try:
            found = catalog.get(" ".join(words[:end]))
            break
        except PylonError:
            continue
    if found is None:
        return None, f"'{device_name}' is not in the accelerator catalog ({', '.join(catalog.names())})"
    if re.search(r"\b(PCIe|NVL)\b", device_name, re.IGNORECASE) and found.name.startswith(("H100", "H200")):
        # Hopper's PCIe and NVL boards run lower clocks and power than the SXM parts the catalog lists.
        return None, f"'{device_name}' is not the catalog's {found.name} (an SXM part: higher clocks and power)"
    return found, f"{found.name} (matched from '{device_name}')"


def _versions() -> dict:
    out = {}
    for package in ("torch", "deepspeed", "transformers"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _median(values):
    return statistics.median(values) if values else float("nan")


def summarise_one(args, r: dict, tokens_per_step: int, catalog_peak: float | None, ddp_step: float | None) -> dict:
    """One variant's derived numbers (what the table and the JSON show)."""
    if "error" in r:
        return {"error": r["error"]}
    t = _median(r["times"])
    tps = tokens_per_step / t
    model_flops = r["flops_per_token"] * tps / args.workers  # per worker, per second
    hw_flops = (r["flops_per_token"] + r["recompute_flops_per_token"]) * tps / args.workers
    phases = [_median([p[i] for p in r["phases"]]) for i in range(3)] if r["phases"] else [float("nan")] * 3
    measured = r["peak_flops"]
    return {
        "step_s": t,
        "forward_s": phases[0],
        "backward_s": phases[1],
        "optimizer_s": phases[2],
        "tokens_per_s": tps,
        "vs_ddp": t / ddp_step if ddp_step else None,
        "mfu_catalog": model_flops / catalog_peak if catalog_peak else None,
        "mfu_measured": model_flops / measured if measured else None,
        "hfu_catalog": hw_flops / catalog_peak if catalog_peak else None,
        "hfu_measured": hw_flops / measured if measured else None,
        "measured_peak_flops": measured,
        "max_memory_allocated": r.get("max_memory_allocated"),
        "loss_first": r["losses"][0],
        "loss_last": r["losses"][-1],
        "optimizer": r.get("optimizer"),
    }


def summarise(args, results: dict, tokens_per_step: int, catalog_peak: float | None) -> dict:
    ddp = results.get("ddp", {})
    ddp_step = _median(ddp["times"]) if "times" in ddp else None
    return {name: summarise_one(args, r, tokens_per_step, catalog_peak, ddp_step) for name, r in results.items()}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x) -> str:
    return f"{x * 1000:.0f}ms"


def _gib(x) -> str:
    return f"{x / 2**30:.1f} GiB" if x else "-"


def print_table(rows: dict, results: dict, catalog_peak: float | None) -> None:
    ref = "catalog" if catalog_peak else "measured"
    print(
        f"{'variant':<31}{'step':>8}{'fwd':>8}{'bwd':>8}{'optim':>8}{'tokens/s':>11}{'vs DDP':>8}"
        f"{'MFU cat.':>10}{'MFU meas.':>10}{'HFU ' + ref[:4].replace('cata', 'cat') + '.':>10}{'peak mem':>11}"
        "  loss 1st→last"
    )
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<31}FAILED: {row['error']}")
            continue
        ratio = f"{row['vs_ddp']:.2f}x" if row["vs_ddp"] else "-"
        print(
            f"{name:<31}{_ms(row['step_s']):>8}{_ms(row['forward_s']):>8}{_ms(row['backward_s']):>8}"
            f"{_ms(row['optimizer_s']):>8}{row['tokens_per_s']:>11,.0f}{ratio:>8}"
            f"{_pct(row['mfu_catalog']):>10}{_pct(row['mfu_measured']):>10}{_pct(row['hfu_' + ref]):>10}"
            f"{_gib(row['max_memory_allocated']):>11}  {row['loss_first']:.3f}→{row['loss_last']:.3f}"
        )
    print("MFU = model FLOPs (6N + attention) x tokens/s / peak; HFU adds ckpt's recomputed forward.")
    optimizers = {name: r.get("optimizer") for name, r in results.items() if "error" not in r}
    if optimizers:
        print("optimizers: " + "; ".join(f"{n}: {o}" for n, o in optimizers.items()))
    for name, r in results.items():
        if isinstance(r.get("dynamo"), dict) and "unique_graphs" in r["dynamo"]:
            d = r["dynamo"]
            print(f"torch.compile in {name}: {d['unique_graphs']} graphs, {d['graph_breaks']} graph break(s)")
    for name, r in results.items():
        if r.get("config_overrides"):
            print(f"bench override of Pylon's DeepSpeed config in {name}: {r['config_overrides']}")


def lever_effects(rows: dict) -> list[str]:
    """What each lever changed: a variant against the same variant without its last lever, when both ran."""
    lines = []
    ok = {n: r for n, r in rows.items() if "error" not in r}
    for name, row in ok.items():
        without, _, lever = name.rpartition("+")
        if not without or without not in ok:
            continue
        a = ok[without]
        line = (
            f"  {lever:<15} {without} → {name}: step {_ms(a['step_s'])} → {_ms(row['step_s'])} "
            f"({row['step_s'] / a['step_s'] - 1:+.0%}; fwd {_ms(a['forward_s'])} → {_ms(row['forward_s'])}, "
            f"bwd {_ms(a['backward_s'])} → {_ms(row['backward_s'])}, "
            f"optim {_ms(a['optimizer_s'])} → {_ms(row['optimizer_s'])})"
        )
        ref = "catalog" if row["mfu_catalog"] is not None else "measured"
        line += f", MFU {_pct(a['mfu_' + ref])} → {_pct(row['mfu_' + ref])}"
        if lever == "ckpt":
            line += f" (HFU {_pct(row['hfu_' + ref])}: the recomputed forward is work MFU does not count)"
        if row.get("max_memory_allocated") and a.get("max_memory_allocated"):
            line += f", peak memory {_gib(a['max_memory_allocated'])} → {_gib(row['max_memory_allocated'])}"
        lines.append(line)
    return lines


def gap_paragraph(args, rows: dict, results: dict, catalog_peak: float | None, measured_peak: float) -> list[str]:
    """The gap between this run's best MFU and TorchTitan's 33-39%, in this run's numbers."""
    ok = {n: r for n, r in rows.items() if "error" not in r and r["mfu_catalog"] is not None}
    if not ok or not catalog_peak:
        return ["gap to TorchTitan's 33-39% MFU: needs a GPU the catalog knows (MFU against its datasheet peak)"]
    best_name = max(ok, key=lambda n: ok[n]["mfu_catalog"])
    best, r = ok[best_name], results[best_name]
    lo, hi = TORCHTITAN_MFU
    mfu = best["mfu_catalog"]
    if mfu < lo:
        where = f"{(lo - mfu) * 100:.1f}-{(hi - mfu) * 100:.1f} points below"
    elif mfu > hi:
        where = f"{(mfu - hi) * 100:.1f} points above"
    else:
        where = "within"
    peak = best["measured_peak_flops"] or measured_peak or catalog_peak
    ceiling = peak / catalog_peak
    t, opt = best["step_s"], best["optimizer_s"]
    fwd_bwd = best["forward_s"] + best["backward_s"]
    other = t - fwd_bwd - opt
    tokens = args.micro_batch * args.seq_len  # per worker and step
    ideal = r["flops_per_token"] * tokens / peak  # the model FLOPs at the measured matmul rate
    recompute = r["recompute_flops_per_token"] * tokens / peak
    fields = model_fields(args.model)
    hidden = fields.get("hidden_size") or fields.get("n_embd")
    layers = fields.get("num_hidden_layers") or fields.get("n_layer")
    attention = 12.0 * layers * hidden * args.seq_len / r["flops_per_token"]
    lines = [
        "gap to TorchTitan's 33-39% MFU (Llama 3.1 8B on 8 H100s, FSDP, bf16, no float8, local batch 2 x seq "
        "8192, selective activation checkpointing; 33% eager, 39% with torch.compile; against the 989 TFLOP/s "
        "datasheet peak, FLOPs counted as here):",
        f"  best here: {best_name}, {mfu:.1%} MFU against the catalog peak ({catalog_peak / 1e12:.0f} TFLOP/s): "
        f"{where} TorchTitan's range.",
        f"  matmul ceiling: large {args.precision} matmuls ({r['matmul_size']}^3) ran at {peak / 1e12:.0f} TFLOP/s "
        f"in that variant's process, {ceiling:.0%} of the datasheet figure: a step made only of such matmuls "
        f"would show {ceiling:.0%} MFU; against the measured rate the best variant is at {best['mfu_measured']:.1%} "
        f"(TorchTitan's 33-39% would be {lo / ceiling:.0%}-{hi / ceiling:.0%} of it, on this GPU's matmul rate).",
        f"  its {_ms(t)} step: forward {_ms(best['forward_s'])} + backward {_ms(best['backward_s'])} + optimizer "
        f"{_ms(opt)}"
        + (f" + {_ms(other)} outside them (barrier, synchronize, launch)" if other > 0.0005 else "")
        + ".",
        f"  the model's FLOPs at the measured matmul rate would take {_ms(ideal)}"
        + (f" (+ {_ms(recompute)} recomputed)" if recompute else "")
        + f": forward+backward run at {(ideal + recompute) / fwd_bwd:.0%} of matmul speed, "
        f"{_ms(fwd_bwd - ideal - recompute)} above it: attention ({attention:.0%} of the model FLOPs, at the "
        f"attention kernel's rate), norms, RoPE, SiLU, residual adds, the cross-entropy over "
        f"{fields['vocab_size']} logits, casts and launch gaps; the optimizer step (memory-bound, no model "
        f"FLOPs) is {opt / t:.0%} of the step.",
        f"  scale: d_model {hidden} here (Llama 3.1 8B: 4096) at seq {args.seq_len} (8192): matmul FLOPs per token "
        f"grow with d_model² and the elementwise work (norms, activations, residuals) with d_model, so the same "
        f"kernels weigh about {4096 / hidden:.0f}x more in this step than in an 8B one; "
        + (
            "one GPU: no gradient communication here (TorchTitan's FSDP all-gathers and reduce-scatters over 8 GPUs)."
            if args.workers == 1
            else f"{args.workers} GPUs communicate here, TorchTitan's FSDP over 8."
        ),
    ]
    return lines


def _variant_line(name: str, row: dict, seconds: float) -> str:
    if "error" in row:
        return f"  {name}: FAILED after {seconds:.0f} s: {row['error']}"
    measured = f"{_pct(row['mfu_measured'])} against the measured {row['measured_peak_flops'] / 1e12:.3g} TFLOP/s"
    mfu = f"{_pct(row['mfu_catalog'])} against the catalog's, {measured}" if row["mfu_catalog"] else measured
    return (
        f"  {name}: done in {seconds:.0f} s: step {_ms(row['step_s'])}, {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}"
        + (f", peak mem {_gib(row['max_memory_allocated'])}" if row["max_memory_allocated"] else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--model", help="a bench model (llama-1b, llama-350m) or a Pylon preset (default: gpt-small; CUDA llama-1b)"
    )
    parser.add_argument("--workers", type=int, help="processes, one per GPU on CUDA (default: 2; CUDA 1)")
    parser.add_argument(
        "--micro-batch", type=int, help="rows per worker and step (default: 4; CUDA 8 with >= 100 GiB, else 4)"
    )
    parser.add_argument("--seq-len", type=int, help="tokens per row (default: 256; CUDA 2048)")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default: 8; CUDA 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 2; CUDA 3)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: fp32; CUDA bf16")
    parser.add_argument("--only", help="comma-separated variants (BASE[+LEVER...]) or default, levers, all")
    parser.add_argument(
        "--ds-adam",
        default="auto",
        choices=("auto", "deepspeed", "torch-fused"),
        help="the ZeRO variants' optimizer: Pylon's config (DeepSpeed's FusedAdam on a GPU; auto falls back to "
        "torch's fused AdamW if it cannot be built) or torch's fused AdamW (a config override)",
    )
    parser.add_argument("--variant-timeout", type=float, help="seconds per variant (default: 1800; CUDA 300)")
    parser.add_argument("--json", help="write every result and the derived numbers to this file (after each variant)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        worker(args)
        return 0

    try:
        variants = select_variants(args.only, args.device)
    except ValueError as e:
        raise SystemExit(f"--only: {e}") from None
    fields = model_fields(args.model)
    positions = fields.get("n_positions") or fields.get("max_position_embeddings")
    if fields["model_type"] == "gpt2" and positions < args.seq_len:
        raise SystemExit(f"--seq-len {args.seq_len}: {args.model} has {positions} positions")
    if args.device == "cuda":
        import torch

        from pylon.ops import plain_cuda_arch_list

        plain_cuda_arch_list()  # one DeepSpeed's fused_adam build reads (the variants' processes inherit it)
        if torch.version.cuda is None or not torch.cuda.is_available():
            raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
        gpus = torch.cuda.device_count()
        if args.workers > gpus:
            raise SystemExit(
                f"--workers {args.workers}: this machine has {gpus} GPU(s); on CUDA each worker is one process on "
                f"its own GPU (NCCL), so at most {gpus}"
            )
        driver, gpu_gib = _query_gpu()
        if args.micro_batch is None:
            # llama-1b at seq 2048: DDP (fp32 weights, gradients, Adam, DDP's buckets, autocast activations) takes
            # about 40 GiB at micro-batch 4 and 60 at 8 (`pylon plan`'s activation model): 8 where there is room.
            args.micro_batch = 8 if gpu_gib is not None and gpu_gib >= 100 else 4
    else:
        driver = None
    args.passthrough = [
        "--device",
        args.device,
        "--model",
        args.model,
        "--workers",
        str(args.workers),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--precision",
        args.precision,
    ]
    tokens_per_step = args.workers * args.micro_batch * args.seq_len
    versions = _versions()
    print(
        f"model {args.model}, {args.workers} workers x micro-batch {args.micro_batch} x seq {args.seq_len} "
        f"({tokens_per_step:,} tokens/step), {args.precision} on {args.device}; "
        f"median of {args.steps} steps after {args.warmup} warm-up; variants: {', '.join(v.name for v in variants)}",
        flush=True,
    )
    build = FusedAdamBuild(args, variants)

    results: dict[str, dict] = {}
    accelerator, catalog_peak = None, None
    matched = "not for a CPU (MFU against the measured peak only)"
    report: dict = {}
    try:
        for variant in variants:
            if _needs_fused_adam(variant):
                build.wait()
            t0 = time.perf_counter()
            results[variant.name] = r = run_variant(args, variant)
            if args.device == "cuda" and accelerator is None and "device_name" in r:
                accelerator, matched = catalog_accelerator(r["device_name"])
                catalog_peak = accelerator.peak_flops(args.precision) if accelerator else None
            ddp = results.get("ddp", {})
            ddp_step = _median(ddp["times"]) if "times" in ddp else None
            row = summarise_one(args, r, tokens_per_step, catalog_peak, ddp_step)
            print(_variant_line(variant.name, row, time.perf_counter() - t0), flush=True)
            if "error" in r:
                print(_indent(r["tail"]), flush=True)
            if args.json:  # after each variant: a run cut short keeps what it measured
                report = _report(
                    args, versions, driver, accelerator, matched, catalog_peak, variants, results, build.note
                )
                _write_json(args.json, report)
    finally:
        build.close()
    note = build.note

    done = [r for r in results.values() if "error" not in r]
    first = done[0] if done else {}
    measured = [r["peak_flops"] for r in done if r["peak_flops"]]
    measured_peak = _median(measured) if measured else 0.0
    if args.device == "cuda" and not first:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        accelerator, matched = catalog_accelerator((out.stdout.strip().splitlines() or ["unknown GPU"])[0])
        catalog_peak = accelerator.peak_flops(args.precision) if accelerator else None
    rows = summarise(args, results, tokens_per_step, catalog_peak)

    print()
    if args.device == "cuda":
        memory = first.get("device_memory")
        print(
            f"device: {first.get('device_name', '?')} (sm_{first.get('capability', '?').replace('.', '')}"
            + (f", {memory / 2**30:.1f} GiB" if memory else "")
            + f"), driver {driver or '?'}, CUDA {first.get('torch_cuda', '?')} (torch's)"
            + (
                f"; PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}"
                if "PYTORCH_CUDA_ALLOC_CONF" in os.environ
                else ""
            )
        )
    print(
        f"torch {versions['torch']}, deepspeed {versions['deepspeed']}, transformers {versions['transformers']}"
        + (f"; attention: {first['attn_implementation']}" if first.get("attn_implementation") else "")
    )
    if first:
        print(
            f"model {args.model}: {first['params'] / 1e9:.3g}B parameters, "
            f"{first['flops_per_token'] / 1e9:.3g} GFLOP/token (6N + attention, no recomputation)"
        )
    if catalog_peak:
        print(f"catalog peak: {matched}, dense {args.precision} {catalog_peak / 1e12:.1f} TFLOP/s (accelerators.yaml)")
    else:
        print(f"catalog peak: none -- {matched}")
    if measured:
        size = first["matmul_size"]
        print(
            f"measured matmul peak per worker: {measured_peak / 1e12:.3g} TFLOP/s ({args.precision}, {size}x{size} "
            f"matmuls; median over {len(measured)} variants, {min(measured) / 1e12:.3g}-{max(measured) / 1e12:.3g})"
            + (f" = {measured_peak / catalog_peak:.0%} of the catalog's" if catalog_peak else "")
        )
    if note:
        print(f"note: {note}")
    print()
    print_table(rows, results, catalog_peak)
    base, zero2 = rows.get("ddp", {}), rows.get("zero2", {})
    if "step_s" in base and "step_s" in zero2:
        ratio = zero2["step_s"] / base["step_s"]
        print(f"\ntarget: ZeRO-2 step time <= 1.3x DDP's -> {ratio:.2f}x ({'met' if ratio <= 1.3 else 'NOT met'})")
    effects = lever_effects(rows)
    if effects:
        print("\nlevers (each against the same variant without it):")
        print("\n".join(effects))
    gap = gap_paragraph(args, rows, results, catalog_peak, measured_peak) if args.device == "cuda" else []
    if gap:
        print()
        print("\n".join(gap))
    if args.json:
        report = _report(args, versions, driver, accelerator, matched, catalog_peak, variants, results, note)
        report.update(measured_peak_flops=measured_peak, levers=effects, gap=gap)
        _write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


def _report(args, versions, driver, accelerator, matched, catalog_peak, variants, results, note) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("passthrough", "worker", "variant", "json")}
    tokens_per_step = args.workers * args.micro_batch * args.seq_len
    return {
        "settings": settings,
        "tokens_per_step": tokens_per_step,
        "versions": versions,
        "driver": driver,
        "catalog": {
            "accelerator": accelerator.name if accelerator else None,
            "match": matched,
            "peak_flops": catalog_peak,
        },
        "variants": {v.name: asdict(v) for v in variants},
        "results": results,
        "derived": summarise(args, results, tokens_per_step, catalog_peak),
        "note": note,
    }


def _write_json(path: str, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
