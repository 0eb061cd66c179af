"""What the spec tests share: minimal valid documents, the DESIGN example, and helpers that return the problems a
text has."""

from __future__ import annotations

from pathlib import Path

import pytest

import pylon.specs
from pylon.errors import SpecError
from pylon.specs import parse_specs

EXAMPLES = Path(pylon.specs.__file__).parent / "examples"
SRC = "spec.yaml"
NAME_MSG = "must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"

# The TrainJob + Deployment example from the original design (../shared/DESIGN.md), verbatim.
DESIGN_YAML = """\
kind: TrainJob
name: stdlib-gpt
model: {preset: gpt-small}          # or {config: {...HF config...}} or {path: s3://.../base-model}
data: {uri: s3://bucket/corpus/, format: parquet, seq_len: 256, shuffle_seed: 0}
scaling: {num_workers: 2, use_gpu: false, resources_per_worker: {CPU: 1}}
deepspeed: {zero_stage: 2, offload_optimizer: cpu, offload_param: none, nvme_path: /local_nvme}
precision: bf16                      # fp32 | fp16 | bf16
gradient_checkpointing: false
optim: {lr: 3.0e-4, weight_decay: 0.1, warmup_steps: 100, schedule: cosine, grad_clip: 1.0}
batch: {micro_batch_size: 8, grad_accum_steps: 1}
steps: 2000
checkpoint: {storage: s3://bucket/runs/, every_steps: 200, keep_last: 3, keep_every: 1000, async_upload: true}
lora: null                           # or {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}
---
kind: Deployment
name: stdlib-gpt
model: s3://bucket/runs/stdlib-gpt/export/      # a Hugging Face format directory
engine: {max_num_seqs: 64, max_num_batched_tokens: 2048, kv_cache_tokens: 65536, max_model_len: 1024, device: auto}
autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 16, upscale_delay_s: 5, downscale_delay_s: 60}
http: {api_keys_env: PYLON_API_KEYS, max_queued_requests: 256, request_timeout_s: 60}
"""

# Minimal valid documents. Whatever is appended starts on line 6 (TrainJob), 4 (Deployment), 5 (Dataset), 3 (Cluster).
TRAIN = "kind: TrainJob\nname: job\nmodel: {preset: gpt-tiny}\ndata: {uri: corpus/}\nsteps: 10\n"
DEPLOY = "kind: Deployment\nname: svc\nmodel: runs/job/export/\n"
DATASET = "kind: Dataset\nname: ds\nsources: [text/]\noutput: corpus/\n"
CLUSTER = "kind: Cluster\nname: c\n"


def problems(text: str, source: str = SRC) -> list[str]:
    """The problems parse_specs reports for `text` (fails the test if it is valid)."""
    with pytest.raises(SpecError) as info:
        parse_specs(text, source)
    assert info.value.problems, "SpecError without problems"
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def one_problem(text: str, source: str = SRC) -> str:
    found = problems(text, source)
    assert len(found) == 1, found
    return found[0]


def train_error(extra: str) -> str:
    return one_problem(TRAIN + extra)
