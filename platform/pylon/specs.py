"""The product's language: typed specs for `Dataset`, `TrainJob`, `Deployment` and `Cluster`.

These pydantic models are the single source of truth. The CLI, the SDK, the job entrypoints and every
generated config (DeepSpeed, Serve, KubeRay) derive from them. Unknown keys are errors, and every error
names the file, the document, the line and the field path, with the allowed values:

    train.yaml:12: document 1 (TrainJob 'stdlib-gpt'): deepspeed.zero_stage: must be one of 0, 1, 2, 3 (got 5)
"""

from __future__ import annotations

import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from pylon.display import Html, html_table
from pylon.errors import SpecError
from pylon.presets import MODEL_PRESETS
from pylon.storage import SUPPORTED_SCHEMES as _URI_SCHEMES

# ---------------------------------------------------------------------------------------------------------
# Field types
# ---------------------------------------------------------------------------------------------------------

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a spec name's grammar (`Name`)
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_name(value: str) -> str:
    # Names become directory names, Ray job ids, Serve app names and Kubernetes object names, so they
    # take the strictest of those grammars (RFC 1123 label) and can never escape a storage root.
    if not NAME_RE.fullmatch(value):
        raise ValueError(
            f"must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit, "
            f"e.g. 'stdlib-gpt' (got {_show(value)})"
        )
    return value


def _check_uri(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty path or URI")
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme and scheme not in _URI_SCHEMES:
        raise ValueError(
            f"unsupported URI scheme '{scheme}://'; use a local path or one of "
            + ", ".join(f"{s}://" for s in _URI_SCHEMES)
        )
    return value


def _check_env_name(value: str) -> str:
    if not _ENV_RE.fullmatch(value):
        # The likeliest wrong value here is the secret itself, so the message never echoes it.
        raise ValueError(
            "must be the name of an environment variable such as PYLON_API_KEYS, not the keys themselves "
            "(the value given is not shown, in case it is a secret)"
        )
    return value


Name = Annotated[str, AfterValidator(_check_name)]
Uri = Annotated[str, AfterValidator(_check_uri)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Offload = Literal["none", "cpu", "nvme"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)

    def _repr_html_(self) -> str:
        """Jupyter's view: a table of every field (nested specs as nested tables). Specs hold the names of
        environment variables, never secrets, so showing every field shows nothing private."""

        rows = []
        for field in type(self).model_fields:
            value = getattr(self, field)
            if isinstance(value, _Spec):
                value = Html(value._repr_html_())
            elif isinstance(value, BaseModel):
                value = value.model_dump(mode="json")
            elif isinstance(value, list) and value and isinstance(value[0], _Spec):
                value = Html("".join(v._repr_html_() for v in value))
            rows.append((field, value))
        name = getattr(self, "name", None)
        kind = getattr(self, "kind", None)
        title = f"{kind} '{name}'" if kind and isinstance(name, str) else None
        return html_table(title, rows)


class CrossFieldError(ValueError):
    """Several rules that involve more than one field; each problem keeps its own field path."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))


def _raise_problems(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise CrossFieldError(problems)


# ---------------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------------


class DatasetSpec(_Spec):
    """Raw text in, tokenized fixed-length shards plus `manifest.json` out (`pylon data prepare`)."""

    kind: Literal["Dataset"] = "Dataset"
    name: Name
    sources: list[Uri] = Field(min_length=1, description="text files, directories of them, or JSONL")
    output: Uri
    format: Literal["parquet", "webdataset"] = "parquet"
    seq_len: PositiveInt = 256
    tokenizer: str = Field("byte", min_length=1, description="'byte', or a path to tokenizer files")
    include: str | None = Field(None, description="glob on file names in source directories, e.g. '*.py'")
    exclude: list[str] = Field(default_factory=list, description="globs on path components to skip")
    shard_size_mb: Annotated[float, Field(gt=0)] = 64.0
    chat: bool = Field(
        False,
        description="JSONL of conversations (each record's 'messages': role and content, as a chat template takes "
        "them), rendered by the tokenizer's chat template, the loss on the assistant's replies only (supervised "
        "fine-tuning); needs a Hugging Face tokenizer directory with a chat template",
    )
    prompt_completion: bool = Field(
        False,
        description="JSONL of {'prompt': ..., 'completion': ...} records (TRL's prompt-completion format): strings, "
        "the prompt tokenized as a completions request's is, then the completion and eos; or lists of messages "
        "(TRL's conversational format) rendered by the chat template; the loss on the completion only",
    )
    preference: bool = Field(
        False,
        description="JSONL of {'prompt': ..., 'chosen': ..., 'rejected': ...} records (TRL's preference format, for "
        "a TrainJob with objective dpo, simpo or orpo; strings, or lists of messages rendered by the chat "
        "template): the prompt with each completion, the pair in one row, the loss on the completions",
    )
    prompts: bool = Field(
        False,
        description="JSONL of {'prompt': ..., 'answer': ...} records (TRL's prompt-only format, for a TrainJob with "
        "objective grpo): the prompt a string, or a list of messages rendered by the chat template with its generation "
        "prompt; the answer (optional) what reward functions compare completions with",
    )
    packing: Literal["auto", "wrapped", "bfd"] = Field(
        "auto",
        description="how documents fill the rows: wrapped, one after another, cut wherever a row ends (no padding; a "
        "document runs on into the next row); bfd, each whole in one row, best-fit decreasing (TRL's), rows padded "
        "and documents longer than seq_len cut to it; auto, bfd for chat and prompt_completion, wrapped for text",
    )

    def summary(self) -> str:
        return (
            f"Dataset '{self.name}': {len(self.sources)} source(s) -> {self.output} "
            f"({self.format}, seq_len {self.seq_len}, tokenizer {self.tokenizer})"
        )


# ---------------------------------------------------------------------------------------------------------
# TrainJob
# ---------------------------------------------------------------------------------------------------------


class ModelSpec(_Spec):
    """Exactly one of: a named preset, an explicit Hugging Face config, or a model directory."""

    preset: Literal[tuple(MODEL_PRESETS)] | None = None  # type: ignore[valid-type]
    config: dict[str, Any] | None = None
    path: Uri | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSpec":
        given = [k for k in ("preset", "config", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of preset, config or path"
                + (f" (got {', '.join(given)})" if given else "")
                + f"; presets: {', '.join(MODEL_PRESETS)}"
            )
        if self.config is not None and "model_type" not in self.config:
            raise CrossFieldError([("config.model_type", "required in an explicit config, e.g. gpt2 or llama")])
        return self

    def describe(self) -> str:
        if self.preset:
            return f"preset {self.preset}"
        if self.config is not None:
            return f"config {self.config['model_type']}"
        return f"path {self.path}"


class DataSpec(_Spec):
    """Where training reads prepared shards from, and how it walks them."""

    uri: Uri
    format: Literal["parquet", "webdataset"] = "parquet"
    seq_len: PositiveInt | None = Field(None, description="checked against the manifest when given")
    shuffle_seed: int = 0
    shuffle_buffer: NonNegInt = 1024
    validation_fraction: Annotated[float, Field(ge=0.0, le=0.5)] = Field(
        0.0, description="share of the samples (the tail of their ids) held out from training and evaluated (eval)"
    )
    on_bad_shard: Literal["error", "skip"] = "error"


class ScalingSpec(_Spec):
    num_workers: PositiveInt = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="how workers are placed on nodes (a Ray placement group strategy): PACK fills "
        "few nodes, STRICT_SPREAD puts every worker on its own node",
    )
    sequence_parallel: PositiveInt = Field(
        1,
        description="workers that split each row along its tokens (DeepSpeed Ulysses, ALST): groups of this many "
        "read the same rows, each computing 1/N of every row's tokens (activations and logits 1/N as large), "
        "attention all-to-all within the group; must divide num_workers, the rows' length and the model's heads. "
        "objective causal_lm; 1: off",
    )


class AioSpec(_Spec):
    """DeepSpeed async I/O settings for NVMe offload."""

    block_size: PositiveInt = 1048576
    queue_depth: PositiveInt = 8
    thread_count: PositiveInt = 1
    single_submit: bool = False
    overlap_events: bool = True


class DeepSpeedBuffersSpec(_Spec):
    """DeepSpeed's working buffers, in elements (DeepSpeed's defaults). Each is memory per worker that does not
    shrink with the number of workers: lower them to fit a large model into little memory (`pylon plan` counts
    them)."""

    reduce_bucket_size: PositiveInt = Field(
        500_000_000, description="gradients reduced at once (zero_optimization.reduce_bucket_size)"
    )
    prefetch_bucket_size: PositiveInt = Field(
        50_000_000, description="ZeRO-3: parameters fetched ahead of use (stage3_prefetch_bucket_size)"
    )
    max_live_parameters: PositiveInt = Field(
        1_000_000_000, description="ZeRO-3: gathered parameters kept before release (stage3_max_live_parameters)"
    )
    max_reuse_distance: NonNegInt = Field(
        1_000_000_000,
        description="ZeRO-3: a gathered parameter used again within this many elements stays gathered "
        "(stage3_max_reuse_distance)",
    )
    sub_group_size: PositiveInt = Field(
        1_000_000_000, description="ZeRO-3: parameters the optimizer steps (and swaps from NVMe) at a time"
    )
    param_buffer_size: PositiveInt = Field(
        100_000_000, description="NVMe parameter offload: elements per swap buffer (offload_param.buffer_size)"
    )
    param_buffer_count: PositiveInt = Field(5, description="NVMe parameter offload: swap buffers")
    param_max_in_cpu: NonNegInt = Field(
        1_000_000_000,
        description="NVMe parameter offload: parameter elements also kept in host memory (offload_param.max_in_cpu)",
    )


class LossScalingSpec(_Spec):
    """fp16's dynamic loss scaling (DeepSpeed's): the loss is multiplied by a scale before backward so that small
    gradients survive fp16; a step whose gradients overflow is skipped (not applied), and after `hysteresis` such
    steps in a row the scale halves."""

    initial_power: Annotated[int, Field(ge=0, le=40)] = Field(16, description="the scale starts at 2**initial_power")
    window: PositiveInt = Field(1000, description="steps without an overflow before the scale doubles")
    hysteresis: PositiveInt = Field(2, description="overflows in a row before the scale halves")
    min_scale: Annotated[float, Field(gt=0)] = Field(1.0, description="the scale never goes below this")


class DeepSpeedSpec(_Spec):
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    nvme_path: str | None = None
    aio: AioSpec = Field(default_factory=AioSpec)
    buffers: DeepSpeedBuffersSpec = Field(default_factory=DeepSpeedBuffersSpec)
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="ZeRO: the dtype gradients are accumulated and reduced in (default: the training precision); "
        "bf16 halves an fp32 run's gradient partitions, the optimizer still steps in fp32",
    )
    loss_scaling: LossScalingSpec = Field(
        default_factory=LossScalingSpec, description="precision fp16 only: dynamic loss scaling"
    )

    @model_validator(mode="after")
    def _rules(self) -> "DeepSpeedSpec":
        problems = []
        if self.offload_param != "none" and self.zero_stage != 3:
            problems.append(
                ("offload_param", f"'{self.offload_param}' needs zero_stage 3 (got zero_stage {self.zero_stage})")
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            problems.append(
                ("offload_optimizer", f"'{self.offload_optimizer}' needs zero_stage 1, 2 or 3 (got zero_stage 0)")
            )
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            # DeepSpeed's stage 1/2 optimizer has no NVMe path: it would quietly keep the states in host RAM.
            problems.append(
                (
                    "offload_optimizer",
                    f"'nvme' needs zero_stage 3 (got zero_stage {self.zero_stage}); use 'cpu' with stages 1-2",
                )
            )
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            problems.append(("nvme_path", "required when offload_optimizer or offload_param is 'nvme'"))
        _raise_problems(problems)
        return self

    def describe(self) -> str:
        parts = [f"ZeRO-{self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        return " ".join(parts)


class OptimSpec(_Spec):
    """AdamW with warmup and a decay schedule."""

    lr: Annotated[float, Field(gt=0)] = 3.0e-4
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    eps: Annotated[float, Field(gt=0)] = 1.0e-8
    warmup_steps: NonNegInt = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    grad_clip: Annotated[float, Field(ge=0)] = 1.0


class BatchSpec(_Spec):
    micro_batch_size: PositiveInt = 8
    grad_accum_steps: PositiveInt = 1


class CheckpointSpec(_Spec):
    storage: Uri | None = Field(None, description="runs root; default $PYLON_HOME/runs")
    every_steps: PositiveInt = 200
    keep_last: PositiveInt = 3
    keep_every: NonNegInt = Field(0, description="also keep every N-th step forever; 0 = none")
    async_upload: bool = Field(
        False,
        description="save by a snapshot to host memory (/dev/shm when it has room) and upload and commit in the "
        "background, at most one in flight: the steps block for the snapshot only (docs/operating.md)",
    )

    @model_validator(mode="after")
    def _rules(self) -> "CheckpointSpec":
        if self.keep_every and self.keep_every % self.every_steps:
            _raise_problems(
                [
                    (
                        "keep_every",
                        f"must be a multiple of every_steps ({self.every_steps}), or no checkpoint would ever be kept "
                        f"by it (got {self.keep_every})",
                    )
                ]
            )
        return self


class EvalSpec(_Spec):
    """Held-out evaluation: mean token cross-entropy and perplexity on the validation split
    (`data.validation_fraction`), at the end of the run and every `every_steps` steps."""

    every_steps: NonNegInt = Field(
        0, description="also evaluate every N optimizer steps; 0 = at the end of the run only"
    )
    max_batches: NonNegInt = Field(
        0, description="micro-batches per worker per evaluation; 0 = the whole validation split"
    )


class LoraSpec(_Spec):
    r: PositiveInt = 8
    alpha: Annotated[float, Field(gt=0)] = 16
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    merge_on_export: bool = True


class Eagle3Spec(_Spec):
    """objective eagle3's head (pylon.jobs.eagle; docs/training.md, "Drafting heads"): SpecForge's settings."""

    aux_layers: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        min_length=3,
        max_length=3,
        description="the three of the model's layers whose inputs the head reads (numbered as vLLM's and SGLang's "
        "eagle_aux_hidden_state_layer_ids: j is the input of layer j, the output of layer j - 1); default EAGLE-3's, "
        "2, N // 2 and N - 3 of the model's N layers",
    )
    draft_vocab_size: PositiveInt = Field(
        32000,
        description="the head's output layer's tokens: the most frequent of the tokens the training data's labels "
        "count (d2t maps them to the model's); a drafted token outside them is never proposed. At least the model's "
        "vocabulary: all of it",
    )
    vocab_sample_tokens: PositiveInt = Field(
        10_000_000,
        description="counted tokens of the training split read (from its start, before the first step) to choose "
        "the draft vocabulary",
    )
    ttt_steps: Annotated[int, Field(ge=1, le=16)] = Field(
        7,
        description="training-time test (EAGLE-3's, SpecForge's ttt_length): the head is unrolled this many drafts "
        "deep, each next draft fed its own output and the text's next token, as the engine drafts; set it to at least "
        "engine.speculative.num_tokens",
    )
    ttt_decay: Annotated[float, Field(gt=0, le=1)] = Field(
        0.8, description="the loss of the head's draft k (from 0) weighs ttt_decay ** k (SpecForge's 0.8)"
    )
    intermediate_size: PositiveInt | None = Field(
        None, description="the head's MLP width; default the model's intermediate_size"
    )


class QueueSpec(_Spec):
    """Where a TrainJob waits when the cluster is busy (docs/training.md, "Job queue")."""

    user: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(
        None,
        description="whose job it is, for the per-user limit on running jobs (PYLON_QUEUE_MAX_JOBS_PER_USER); "
        "default: the submitting user",
    )
    kueue_queue: Name | None = Field(
        None,
        description="on Kubernetes: the Kueue LocalQueue the RayJob waits in (label kueue.x-k8s.io/queue-name); "
        "the RayJob then starts suspended with a cluster of its own, as Kueue requires",
    )
    kueue_priority_class: Name | None = Field(
        None,
        description="on Kubernetes: the Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class); its "
        "value plays the part of `priority` there",
    )


# The objectives that train on preference pairs (`pylon data prepare --preference`; pylon.jobs.dpo)
PREFERENCE_OBJECTIVES = ("dpo", "simpo", "orpo", "reward")
# objective dpo's losses (TRL's DPOTrainer loss_type; pylon.jobs.dpo.dpo_losses); those label smoothing applies to
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_pair",
              "apo_zero", "apo_down", "discopop")  # fmt: skip
SMOOTHED_DPO_LOSSES = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair")


# The objectives that sample completions of prompts and learn from their rewards (pylon.jobs.grpo; the `grpo` block)
RL_OBJECTIVES = ("grpo", "rloo", "online_dpo")
# objective grpo's built-in reward functions (pylon.jobs.grpo.BUILT_IN_REWARDS; a `module:function` path names another)
GRPO_REWARDS = ("exact_match", "contains_answer", "last_number_match")
_REWARD_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _check_reward_function(value: str) -> str:
    if value in GRPO_REWARDS or _REWARD_PATH.match(value):
        return value
    raise ValueError(
        f"{value!r} is neither a built-in reward ({', '.join(GRPO_REWARDS)}) nor a `package.module:function` path"
    )


def _check_judge(value: str) -> str:
    if _REWARD_PATH.match(value):
        return value
    raise ValueError(
        f"{value!r} is not a `package.module:function` path (or `package.module:name` of an object with a `judge` "
        "method, as TRL's pairwise judges are)"
    )


class RewardFunctionSpec(_Spec):
    function: Annotated[str, AfterValidator(_check_reward_function)] | None = Field(
        None,
        description="a built-in reward (exact_match, contains_answer, last_number_match: the completion against the "
        "record's answer) or `package.module:function`, importable where the job runs (a module in the directory "
        "`pylon train` runs from travels with the job; `ray job submit --working-dir`; or an installed package), "
        "called as TRL calls reward functions: f(prompts=[...], completions=[...], answers=[...], "
        "completion_ids=[...]) -> one float (or None: no score) per completion",
    )
    model: str | None = Field(
        None,
        description="instead of a function, a reward model: the directory of an `objective: reward` run's export (a "
        "local path or a URI such as s3://...), which scores each prompt and completion as text, read at its last "
        "token as `/classify` reads it; every worker holds a whole fp32 copy",
    )
    weight: float = Field(
        1.0, description="its weight in each completion's reward (the weighted sum of every function's)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> "RewardFunctionSpec":
        if (self.function is None) == (self.model is None):
            raise CrossFieldError(
                [("function", "give a reward function or a reward model (model: the export's directory), one of them")]
            )
        return self

    @property
    def short_name(self) -> str:
        """Its name in metrics (`grpo_rewards.<name>`): the function's, or the model directory's last part."""
        if self.function is not None:
            return self.function.rsplit(":", 1)[-1]
        return self.model.rstrip("/").rsplit("/", 1)[-1] or "reward_model"


class GrpoSpec(_Spec):
    """objective grpo's, rloo's and online_dpo's settings (TRL's GRPOConfig, RLOOConfig and OnlineDPOConfig)."""

    rewards: list[RewardFunctionSpec] = Field(
        default_factory=list,
        description="the reward functions; a completion's reward is their weighted sum (at least one; objective "
        "online_dpo: these or grpo.judge)",
    )
    judge: Annotated[str, AfterValidator(_check_judge)] | None = Field(
        None,
        description="objective online_dpo, instead of rewards: a pairwise judge (TRL's `judge`), `package.module:"
        "function` or an object with a `judge` method, importable where the job runs as a reward function is, called "
        "with the prompts and each prompt's two completions as text, judge(prompts, [[a, b], ...]), and returning for "
        "each pair the index of the preferred completion: 0 or 1; -1 or None, neither (the pair is left out)",
    )
    generations: int = Field(
        8, ge=2, description="completions sampled for each prompt: its group, whose rewards set the advantages"
    )
    max_completion_tokens: PositiveInt = Field(
        64, description="a completion's length at most; one that reaches it without an eos is cut there (clipped)"
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="the sampling temperature of the completions; the loss's log-probabilities are taken at it too "
        "(the logits divided by it, as TRL's), so the policy trained is the one sampled from",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens this likely")
    top_k: PositiveInt | None = Field(None, description="sample from the k likeliest tokens only; None: all")
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="sample only tokens at least this many times as likely as the likeliest (min-p sampling, e.g. "
        "0.05); None: all",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="CTRL's repetition penalty as transformers applies it: a token already in the prompt or the "
        "completion has its logit divided by this where positive, multiplied where negative (> 1 discourages "
        "repeats); 1: off. Like top_k, top_p and min_p it shapes sampling only: the loss's log-probabilities are the "
        "model's own at `temperature` (TRL's)",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="the weight of each token's KL divergence from the model as it started (the reference: with "
        "lora the model with its adapters disabled, without a frozen copy); 0 (TRL's default): no reference, no "
        "second forward pass",
    )
    loss: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo"] = Field(
        "dapo",
        description="the token loss and how it is averaged (TRL's loss_type): dapo, over every completion token of "
        "the micro-batch's ranks; grpo, over each completion's tokens, then over completions (longer completions' "
        "tokens weigh less); dr_grpo, summed per completion and divided by max_completion_tokens (Dr. GRPO); bnpo, "
        "over each rank's completion tokens, then over ranks; cispo (MiniMax-M1's CISPO), -min(r, epsilon_high) A "
        "log pi, the importance weight bounded and without gradient, so that no token's gradient is clipped away, "
        "averaged as dapo (give epsilon_high, the bound: ScaleRL's 5.0)",
    )
    iterations: PositiveInt = Field(
        1,
        description="updates on each sampled micro-batch (TRL's num_iterations, PPO's epochs): its completions are "
        "sampled at the first of every `iterations` steps and trained on at each, the policy ratio against the "
        "sampling policy clipped by epsilon; steps and checkpoint.every_steps must be multiples of it",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="the clip of the policy ratio below 1: 1 - epsilon")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="the clip above 1: 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); None: epsilon. With loss "
        "cispo, the importance weight's bound itself (at least 1; ScaleRL's 5.0)",
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="objective grpo: two-sided clipping (INTELLECT-2; TRL's delta): the policy ratio of the clipped "
        "surrogate's unclipped term bounded above by delta, so that a token with a negative advantage and a "
        "runaway ratio cannot make the loss unbounded (INTELLECT-2's 4; keep it above 1 + epsilon_high); None: off",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="objective grpo: the policy ratio each token's clipped surrogate takes (TRL's "
        "importance_sampling_level): token, its own; sequence (GSPO, Zheng et al. 2025), its completion's, the "
        "geometric mean of its tokens' (exp of the mean log-ratio), clipped once for the whole completion; it "
        "matters from the second update on a sampled batch (iterations > 1), when the ratios leave 1",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="leave out of the loss the completions cut at max_completion_tokens without an eos (TRL's "
        "mask_truncated_completions; DAPO's overlong filtering): their rewards still set their groups' advantages",
    )
    zero3_gather_for_sampling: bool = Field(
        True,
        description="at ZeRO-3, gather the whole model on every worker once for each micro-batch's sampling rather "
        "than each layer for every token (TRL's ds3_gather_for_generation): far fewer collectives, at the cost of "
        "holding the whole model (in the training precision) while sampling; false for a model that does not fit whole",
    )
    sampler: Literal["model", "engine", "server"] = Field(
        "model",
        description="what samples the completions: model, the trained model itself (transformers' way: a padded "
        "batch with its KV cache, every row computing until the last one ends); engine, Pylon's serving engine "
        "colocated on each worker (TRL's use_vllm with vllm_mode colocate): the policy's weights copied into it "
        "before each sampling step (LoRA merged, ZeRO-3 gathered a module at a time), its paged KV cache sharing "
        "each prompt among its copies, and continuous batching. The engine holds a second copy of the weights and "
        "its KV cache (grpo.sampler_kv_cache_tokens): the planner counts both. server, the same engine in "
        "grpo.sampler_servers Ray actors of their own (TRL's vllm_mode server), each on grpo.sampler_resources "
        "(another GPU or node): the workers' memory holds no engine, the first worker sends the policy's weights "
        "through Ray's object store before each sampling step and every worker's rows, gathered, at each, and each "
        "server samples the rows of the workers it serves together",
    )
    sampler_servers: PositiveInt = Field(
        1,
        description="grpo.sampler server: how many sampling servers (TRL's vllm data_parallel_size); worker r "
        "samples on server r mod sampler_servers, and each server is sent the weights",
    )
    sampler_resources: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="grpo.sampler server: the Ray resources each sampling server holds for the whole run, as "
        "scaling.resources_per_worker ({GPU: 1} puts it on a GPU of its own, and the engine on CUDA)",
    )
    sampler_labels: dict[str, str] = Field(
        default_factory=dict,
        description="grpo.sampler server: the node labels a server's node must have (Ray's label_selector; the "
        "labels `pylon cluster join --labels` gives a node, e.g. {pool: inference}); {}: any node with room",
    )
    sampler_kv_cache_tokens: PositiveInt | None = Field(
        None,
        description="grpo.sampler engine or server: the tokens its KV cache holds; None: a micro-batch's rows of "
        "prompts and `generations` completions of max_completion_tokens for each row (at least 4,096), for each "
        "worker a server samples for. Fewer is slower, never wrong: completions wait for room",
    )
    sampler_max_num_seqs: PositiveInt = Field(
        64, description="grpo.sampler engine or server: completions it computes at once (vLLM's max_num_seqs)"
    )
    sampler_correction: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "none"] = Field(
        "sequence_mask",
        description="grpo.sampler engine or server, objectives grpo and rloo: the importance-sampling correction for "
        "the engine sampling from a slightly different policy than the one trained (its numerics; top-k/top-p "
        "truncation), TRL's vllm_importance_sampling_mode. The ratio of the trained model's probability of the sampled "
        "tokens to the engine's, per token (token_*) or per completion (sequence_*: the product over its tokens), "
        "weighs each token's (rloo: each completion's) loss, held to [sampler_correction_min, sampler_correction_cap]: "
        "clipped to it (*_truncate) or zero outside it (*_mask: the completion or token left out). Its mean is logged "
        "(grpo_sampler_ratio). objective rloo takes sequence_* only (its loss is a completion's); none: no correction",
    )
    sampler_correction_cap: float | None = Field(
        3.0,
        gt=1,
        description="grpo.sampler engine or server: the upper bound of grpo.sampler_correction's ratio (TRL's "
        "vllm_importance_sampling_clip_max); None: none (then sampler_correction_min must be set)",
    )
    sampler_correction_min: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="grpo.sampler engine or server: the lower bound of grpo.sampler_correction's ratio (TRL's "
        "vllm_importance_sampling_clip_min); None: none",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="objective grpo: advantages are each reward less its group's mean, divided by the standard "
        "deviation of its group (group), of the micro-batch (batch), or not at all (none: Dr. GRPO)",
    )
    normalize_advantages: bool = Field(
        False,
        description="objective rloo: standardise the leave-one-out advantages over the micro-batch's completions "
        "(mean 0, standard deviation 1; TRL's normalize_advantages)",
    )
    log_completions: NonNegInt = Field(
        4,
        description="completions of each step the run keeps in its completions.jsonl (TRL's log_completions): the "
        "first worker's first, each with its prompt, answer, every function's score, reward and advantage "
        "(`Run.completions()` in the SDK); one of them printed beside each step the job's log prints; 0: none",
    )

    def changed(self, *names: str) -> list[str]:
        """Those of the fields `names` whose values differ from their defaults (by value: a default given explicitly
        is no change)."""
        fields = type(self).model_fields
        return [n for n in names if getattr(self, n) != fields[n].get_default(call_default_factory=True)]

    def server_problems(self, num_workers: int) -> list[tuple[str, str]]:
        """grpo.sampler server: what is wrong with its servers' settings for `num_workers` workers."""
        problems = []
        if self.sampler_servers > num_workers:
            problems.append(
                (
                    "grpo.sampler_servers",
                    f"{self.sampler_servers} servers for {num_workers} workers: worker r samples on server r mod "
                    f"sampler_servers, so {self.sampler_servers - num_workers} would sample nothing; at most "
                    f"{num_workers}",
                )
            )
        if not any(v > 0 for v in self.sampler_resources.values()):
            problems.append(
                ("grpo.sampler_resources", "holds nothing: give each server a share of a node: {CPU: 1}, {GPU: 1}")
            )
        return problems

    def correction_problems(self, objective: str) -> list[tuple[str, str]]:
        """grpo.sampler engine: what is wrong with its correction's settings for `objective` (field, problem)."""
        if self.sampler_correction == "none":
            return []
        if objective == "online_dpo":  # (the default is on, and online_dpo takes none: only a change is refused)
            why = "objective online_dpo has no policy ratio to correct: leave it out"
            return [(f"grpo.{n}", why) for n in self.changed(*CORRECTION_FIELDS)]
        problems = []
        if objective == "rloo" and self.sampler_correction.startswith("token"):
            problems.append(
                (
                    "grpo.sampler_correction",
                    f"objective rloo's loss is a completion's: use sequence_mask or sequence_truncate, not "
                    f"{self.sampler_correction}",
                )
            )
        if self.sampler_correction_cap is None and self.sampler_correction_min is None:
            problems.append(
                (
                    "grpo.sampler_correction_cap",
                    "None with no grpo.sampler_correction_min leaves the ratio unbounded: set a cap (3.0, TRL's), or "
                    "grpo.sampler_correction: none to turn the correction off",
                )
            )
        return problems


# grpo.sampler engine's settings, and of them its correction's
CORRECTION_FIELDS = ("sampler_correction", "sampler_correction_cap", "sampler_correction_min")
ENGINE_SAMPLER_FIELDS = ("sampler_kv_cache_tokens", "sampler_max_num_seqs", *CORRECTION_FIELDS)
# grpo.sampler server's own settings
SERVER_SAMPLER_FIELDS = ("sampler_servers", "sampler_resources", "sampler_labels")


def sampler_kv_cache_tokens(spec: "TrainJobSpec", seq_len: int) -> int:
    """`grpo.sampler_kv_cache_tokens`, or its default for prompts of up to `seq_len` tokens: a micro-batch's rows of
    prompts (each computed once, its copies sharing it) and, for each row, `generations` completions of
    `max_completion_tokens` (at least 4,096), for each worker the engine samples for (`grpo.sampler: server`: the
    workers of a server, whose rows it samples together: as much room for each as beside it). A micro-batch needing
    more waits for room; it does not fail."""
    g = spec.grpo
    if g.sampler_kv_cache_tokens:
        return g.sampler_kv_cache_tokens
    workers = -(-spec.scaling.num_workers // g.sampler_servers) if g.sampler == "server" else 1
    return workers * max(4096, spec.batch.micro_batch_size * (seq_len + g.generations * g.max_completion_tokens))


# What a TrainJob's model learns (TrainJobSpec.objective)
Objective = Literal["causal_lm", "dpo", "simpo", "orpo", "reward", "kto", "grpo", "rloo", "online_dpo", "eagle3"]


class TrainJobSpec(_Spec):
    """One training run: model, data, workers, DeepSpeed, optimisation and checkpoints."""

    kind: Literal["TrainJob"] = "TrainJob"
    name: Name
    model: ModelSpec
    data: DataSpec
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    gradient_checkpointing: bool = False
    activation_offload: bool = Field(
        False,
        description="keep what the forward pass saves for the backward pass in pinned host memory until the backward "
        "pass needs it (torch's save_on_cpu; TorchTitan's and TorchTune's activation offloading): with "
        "gradient_checkpointing, each decoder block's input, so that a GPU holds one block's activations at a time "
        "whatever the depth; without, every activation. Costs two copies over PCIe per saved tensor a step. GPU "
        "workers only",
    )
    attention_mask: Literal["auto", "causal", "document"] = Field(
        "auto",
        description="how a row packed from several documents is attended: causal, every token sees the row before "
        "it (the usual for pretraining); document, each document only itself, its positions restarting at 0 and its "
        "first token not predicted from the one before (TorchTitan's block_causal, TRL's padding_free, Llama 3's "
        "pretraining); auto, document for a chat or prompt-completion dataset, causal for text",
    )
    neftune_noise_alpha: float = Field(
        0.0,
        ge=0,
        description="NEFTune (Jain et al. 2023; transformers' and TRL's neftune_noise_alpha): uniform noise of "
        "magnitude alpha / sqrt(seq_len x hidden) added to the input embeddings in training passes (never in "
        "evaluation, a preference objective's reference, or the export); the paper uses 5; 0: off",
    )
    loss_chunk_tokens: NonNegInt = Field(
        0,
        description="compute the output layer and the loss this many tokens at a time, each chunk recomputed in the "
        "backward pass, so that a micro-batch's logits (micro_batch x seq_len x vocab, in fp32 for the loss) never "
        "exist at once (Liger's fused linear cross-entropy, chunked); only the tokens the loss counts are projected. "
        "0: the whole micro-batch at once",
    )
    objective: Objective = Field(
        "causal_lm",
        description="what the model learns: causal_lm, the next token (pretraining, fine-tuning); on a dataset "
        "prepared with --preference, each pair's chosen completion over its rejected one: dpo, direct preference "
        "optimisation (TRL's DPOTrainer), relative to the model as it started (the reference: with lora, the model "
        "with its adapters disabled; without, a frozen copy, partitioned as the model is at ZeRO-3); simpo (SimPO, "
        "TRL's CPOTrainer loss_type simpo) and orpo (ORPO, TRL's ORPOTrainer, the chosen completion's NLL too) need "
        "no reference: no frozen copy, no second forward pass; reward, a reward model (TRL's RewardTrainer): the "
        "model with a scalar head (*ForSequenceClassification, num_labels 1) scoring each completion at its last "
        "token, trained so the chosen one scores higher (Bradley-Terry), exported as a classifier Pylon serves; kto, "
        "Kahneman-Tversky optimisation (TRL's KTOTrainer) on unpaired feedback: a --prompt-completion dataset whose "
        "records each carry a `label`, true for a desirable completion and false for an undesirable one, each "
        "pushed away from the reference by its side of a KL baseline (dpo_beta its beta); grpo, "
        "group relative policy optimisation (TRL's GRPOTrainer) on a prompt-completion or chat dataset: each prompt's "
        "completions sampled from the model as it trains, scored by the reward functions of `grpo` against the "
        "record's completion (its answer), and each reinforced by its reward against its group's; rloo, REINFORCE "
        "leave-one-out (TRL's RLOOTrainer) with the same sampling and rewards: each completion's reward, less beta "
        "times its KL to the start (summed over its tokens), against the mean of its group's other completions, and "
        "one clipped ratio per completion (its tokens' summed log-probabilities); online_dpo (TRL's "
        "OnlineDPOTrainer) with the same sampling and rewards: each prompt's two completions a preference pair, the "
        "better-rewarded chosen, trained with DPO's loss against the reference (dpo_beta its beta); eagle3, an "
        "EAGLE-3 drafting head for the model in model.path (SpecForge's training), the model frozen: trained to "
        "guess the model's next tokens from three of its layers' hidden states, unrolled as the engine drafts "
        "(training-time test), exported as the head engine.speculative.method eagle3 reads as its draft_model",
    )
    eagle3: Eagle3Spec | None = Field(None, description="objective eagle3: its head and training-time test")
    grpo: GrpoSpec | None = Field(
        None, description="objectives grpo, rloo and online_dpo: their reward functions, sampling and loss"
    )
    dpo_beta: float = Field(
        0.1,
        gt=0,
        description="the preference objectives' beta: dpo's, how far from the starting model the preferences may "
        "pull it (a larger beta keeps it closer); simpo's, the scale of its length-normalised rewards (SimPO's paper "
        "uses 2-2.5); orpo's lambda, the weight of its odds-ratio term against the NLL",
    )
    precompute_reference: bool = Field(
        False,
        description="objective dpo: read the reference's log-probabilities of every document once, before the first "
        "step, and let the reference go (TRL's precompute_ref_log_probs): no frozen copy of the model held while "
        "training (its weights' bytes again) and no reference pass a micro-batch, for one forward pass over the "
        "dataset first; kept in the run's directory, so a resumed run reads them",
    )
    kto_loss: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto",
        description="objective kto's loss (TRL's loss_type): kto, each desirable completion's 1 - sigmoid(beta (its "
        "log-ratio to the reference - z)) and each undesirable one's 1 - sigmoid(beta (z - its log-ratio)), z the "
        "batch's KL to the reference estimated on mismatched prompts and completions (the KTO paper's eq. 7); "
        "apo_zero_unpaired (APO-zero on unpaired data): no KL baseline, undesirable completions' sigmoid(beta "
        "log-ratio)",
    )
    kto_desirable_weight: float = Field(
        1.0,
        gt=0,
        description="objective kto: the weight of the desirable completions' losses (TRL's desirable_weight); with "
        "kto_undesirable_weight, keep desirable_weight x desirable count / (undesirable_weight x undesirable count) "
        "within 1-4/3 (the KTO paper's advice; the job says where the data stands)",
    )
    kto_undesirable_weight: float = Field(
        1.0, gt=0, description="objective kto: the weight of the undesirable completions' losses"
    )
    dpo_rpo_alpha: float = Field(
        0.0,
        ge=0,
        description="objective dpo: the weight of the chosen completion's negative log-likelihood (its tokens' mean) "
        "added to each pair's loss (RPO; TRL's rpo_alpha, 1.0 in the paper), which keeps the chosen completions' "
        "likelihood from falling; 0: none",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="objective simpo: the margin the chosen completion's reward must beat the rejected one's by "
        "(SimPO's gamma; TRL's simpo_gamma)",
    )
    reward_center_coefficient: float = Field(
        0.0,
        ge=0,
        description="objective reward: the weight of each pair's squared reward sum, (r(chosen) + r(rejected))^2, "
        "added to its loss so that the rewards centre on 0 (TRL's center_rewards_coefficient; Eisenstein et al. 2023 "
        "use 0.01): the Bradley-Terry loss sees only differences, so without it a reward model's scores may drift "
        "by any constant; 0: none",
    )
    dpo_loss: Literal[DPO_LOSSES] | list[Literal[(*DPO_LOSSES, "sft")]] = Field(
        "sigmoid",
        description="objective dpo: the preference loss (TRL's loss_type): sigmoid, DPO's; hinge, SLiC's; ipo, IPO's "
        "(on the completions' mean token log-probabilities); robust (robust DPO, for noisy labels: with "
        "dpo_label_smoothing); exo_pair (EXO); nca_pair (NCA); bco_pair (BCO on pairs, against the rewards' running "
        "mean); sppo_hard (SPPO, hard probabilities); aot and aot_pair (AOT, sorted across a micro-batch's pairs); "
        "apo_zero and apo_down (APO: chosen completions better, or worse, than the model's own); discopop "
        "(DiscoPOP, with dpo_discopop_tau). Or a list of them, each pair's loss their sum weighted by "
        "dpo_loss_weights (TRL's loss_type list, MPO: e.g. [sigmoid, bco_pair, sft]), sft the chosen completion's "
        "NLL (dpo_rpo_alpha's term); ipo, on mean log-probabilities, only alone",
    )
    dpo_loss_weights: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        None,
        description="dpo_loss as a list: each loss's weight, in its order (TRL's loss_weights); None: 1 each",
    )
    dpo_discopop_tau: float = Field(
        0.05,
        gt=0,
        description="dpo_loss discopop: the temperature of its blend of the logistic and the exponential loss (TRL's "
        "discopop_tau)",
    )
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="objective dpo with the sigmoid, robust, exo_pair, aot or aot_pair loss, or simpo: the chance "
        "that a pair's preference is wrong (conservative DPO); 0 trusts every pair (exo_pair takes 0 as 1e-3)",
    )
    optim: OptimSpec = Field(default_factory=OptimSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    steps: PositiveInt
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    lora: LoraSpec | None = None
    eval: EvalSpec = Field(default_factory=EvalSpec)
    priority: int = Field(
        0,
        description="place in the cluster's job queue: a job that does not fit waits behind every waiting job of "
        "higher priority (then earlier submission)",
    )
    queue: QueueSpec = Field(default_factory=QueueSpec)

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_style_precision(cls, data: Any) -> Any:
        # People arrive with DeepSpeed configs in mind; say what to write instead of "unknown field".
        if isinstance(data, dict) and "fp16" in data and "bf16" in data:
            raise CrossFieldError(
                [
                    (
                        "fp16",
                        "fp16 and bf16 are exclusive; choose one with 'precision: fp16' or 'precision: bf16'",
                    )
                ]
            )
        for key in ("fp16", "bf16"):
            if isinstance(data, dict) and key in data:
                raise CrossFieldError([(key, f"not a field here; write 'precision: {key}'")])
        return data

    @property
    def dpo_losses(self) -> list[str]:
        """`dpo_loss` as a list: the one loss, or the list given."""
        return list(self.dpo_loss) if isinstance(self.dpo_loss, list) else [self.dpo_loss]

    def _loss_list_problems(self) -> list[tuple[str, str]]:
        """dpo_loss as a list (TRL's loss_type list) and its dpo_loss_weights."""
        if not isinstance(self.dpo_loss, list):
            if self.dpo_loss_weights is not None:
                return [("dpo_loss_weights", "weighs dpo_loss given as a list; dpo_loss is one loss")]
            return []
        losses, weights = self.dpo_loss, self.dpo_loss_weights
        if self.objective != "dpo":
            return []  # (refused as any dpo_loss is on another objective)
        if not [k for k in losses if k != "sft"]:
            return [("dpo_loss", "a list needs a preference loss (sigmoid, ...) beside sft")]
        if len(set(losses)) != len(losses):
            return [("dpo_loss", "names a loss twice: give it once, with its weight in dpo_loss_weights")]
        if "ipo" in losses and len(losses) > 1:
            return [("dpo_loss", "ipo reads mean log-probabilities, the others summed ones: ipo only alone")]
        if "sft" in losses and self.dpo_rpo_alpha:
            return [("dpo_rpo_alpha", "is the same NLL term as sft in dpo_loss: give one of them")]
        if weights is not None and len(weights) != len(losses):
            return [("dpo_loss_weights", f"{len(weights)} weights for {len(losses)} losses: one each, in order")]
        return []

    def _eagle3_problems(self) -> list[tuple[str, str]]:
        """objective eagle3 trains a head beside a frozen model: what would change the model, or is of no use to a
        head, is refused."""
        if self.objective != "eagle3":
            return [("eagle3", f"sets objective eagle3's head; objective: {self.objective}")] if self.eagle3 else []
        problems = []
        if self.model.path is None:
            problems.append(
                ("model.path", "objective eagle3 trains a drafting head for a trained model: give its directory")
            )
        for name, why in (
            ("lora", "the model is frozen: only the head trains"),
            ("loss_chunk_tokens", "the head's output layer is the draft vocabulary's: set 0"),
            ("neftune_noise_alpha", "would add noise to the hidden states the head learns from: set 0"),
            ("gradient_checkpointing", "the model is frozen (no activations kept for it): leave it out"),
            ("precompute_reference", "is objective dpo's"),
        ):
            value = getattr(self, name)
            if value and value != type(self).model_fields[name].default:
                problems.append((name, f"objective eagle3: {why}"))
        return problems

    def _sequence_parallel_problems(self) -> list[tuple[str, str]]:
        """scaling.sequence_parallel: groups of workers that split rows (pylon.jobs.sequence_parallel)."""
        sp, workers = self.scaling.sequence_parallel, self.scaling.num_workers
        if sp == 1:
            return []
        field = "scaling.sequence_parallel"
        if workers % sp:
            return [(field, f"must divide scaling.num_workers ({workers}): each group of {sp} reads the same rows")]
        if self.objective != "causal_lm":
            return [(field, f"splits rows for objective causal_lm; objective {self.objective} reads whole rows")]
        if self.neftune_noise_alpha:
            return [("neftune_noise_alpha", f"scales its noise by a row's length, which {field} splits: set 0")]
        return []

    @model_validator(mode="after")
    def _rules(self) -> "TrainJobSpec":
        problems = []
        if self.optim.warmup_steps >= self.steps:
            problems.append(
                ("optim.warmup_steps", f"must be less than steps ({self.steps}) (got {self.optim.warmup_steps})")
            )
        if self.precision == "fp16" and not self.scaling.use_gpu:
            problems.append(("precision", "fp16 needs GPUs (scaling.use_gpu: true); use bf16 or fp32 on CPU"))
        if self.activation_offload and not self.scaling.use_gpu:
            problems.append(
                (
                    "activation_offload",
                    "the workers train on CPUs, whose activations are in host memory already: leave it out (or set "
                    "scaling.use_gpu: true)",
                )
            )
        objective = self.objective
        if self.precompute_reference and objective != "dpo":
            problems.append(("precompute_reference", f"reads objective dpo's reference ahead; objective: {objective}"))
        if objective == "kto" and self.attention_mask == "causal":
            problems.append(("attention_mask", "objective kto reads each completion on its own: set auto or document"))
        for name in ("kto_loss", "kto_desirable_weight", "kto_undesirable_weight"):
            if getattr(self, name) != type(self).model_fields[name].default and objective != "kto":
                problems.append((name, f"is objective kto's; objective is {objective}"))
        if objective in PREFERENCE_OBJECTIVES:
            if self.loss_chunk_tokens and objective == "reward":
                problems.append(("loss_chunk_tokens", "objective reward has no output layer to chunk: set 0"))
            if self.attention_mask == "causal":
                problems.append(
                    ("attention_mask", f"objective {objective} reads each completion on its own: set auto or document")
                )
        if self.dpo_label_smoothing and not (
            (objective == "dpo" and any(k in SMOOTHED_DPO_LOSSES for k in self.dpo_losses)) or objective == "simpo"
        ):
            problems.append(
                (
                    "dpo_label_smoothing",
                    f"smooths objective dpo's {', '.join(SMOOTHED_DPO_LOSSES)} losses and simpo's only (objective "
                    f"{objective}" + (f", dpo_loss {self.dpo_loss})" if objective == "dpo" else ")"),
                )
            )
        # (by value, not by whether the field was given: a submitted spec is dumped whole and read again)
        if self.dpo_loss != "sigmoid" and objective != "dpo":
            problems.append(("dpo_loss", f"chooses objective dpo's loss; objective is {objective}"))
        if self.dpo_rpo_alpha and objective != "dpo":
            problems.append(("dpo_rpo_alpha", f"adds an NLL to objective dpo's loss; objective is {objective}"))
        if self.dpo_discopop_tau != type(self).model_fields["dpo_discopop_tau"].default and not (
            objective == "dpo" and "discopop" in self.dpo_losses
        ):
            problems.append(
                (
                    "dpo_discopop_tau",
                    f"is dpo_loss discopop's temperature; objective {objective}, dpo_loss {self.dpo_loss}",
                )
            )
        problems.extend(self._loss_list_problems())
        if self.simpo_gamma != type(self).model_fields["simpo_gamma"].default and objective != "simpo":
            problems.append(("simpo_gamma", f"is objective simpo's margin; objective is {objective}"))
        if objective in RL_OBJECTIVES:
            if self.grpo is None:
                problems.append(
                    ("grpo", f"objective {objective} needs reward functions: grpo: {{rewards: [{{function: ...}}]}}")
                )
            elif self.grpo.judge is not None and objective != "online_dpo":
                problems.append(
                    ("grpo.judge", f"is objective online_dpo's, a judge of pairs; objective {objective}: grpo.rewards")
                )
            elif self.grpo.judge is not None and self.grpo.rewards:
                problems.append(("grpo.rewards", "objective online_dpo prefers by grpo.judge or by rewards: give one"))
            elif self.grpo.judge is None and not self.grpo.rewards:
                problems.append(
                    (
                        "grpo.rewards",
                        "give at least one reward function ({function: ...} or {model: ...})"
                        + ("; or grpo.judge, a pairwise judge" if objective == "online_dpo" else ""),
                    )
                )
            elif objective == "rloo":  # (by value: a submitted spec is dumped whole and read again)
                if self.grpo.loss != "dapo":
                    problems.append(("grpo.loss", "averages objective grpo's token losses; rloo's is per completion"))
                if self.grpo.scale_rewards != "group":
                    problems.append(
                        ("grpo.scale_rewards", "scales objective grpo's advantages; rloo's: grpo.normalize_advantages")
                    )
                if self.grpo.importance_sampling_level != "token":
                    problems.append(
                        ("grpo.importance_sampling_level", "is objective grpo's; rloo's ratio is a completion's")
                    )
                if self.grpo.delta is not None:
                    problems.append(("grpo.delta", "is objective grpo's two-sided clip of a token's ratio"))
            elif objective == "online_dpo":
                g = self.grpo
                for name, value, want, why in (
                    ("generations", g.generations, 2, "samples a pair a prompt"),
                    ("beta", g.beta, 0.0, "takes dpo_beta as its beta"),
                    ("iterations", g.iterations, 1, "trains once on each sampled pair"),
                    ("loss", g.loss, "dapo", "has DPO's loss"),
                    ("scale_rewards", g.scale_rewards, "group", "prefers by reward: no advantages to scale"),
                    ("importance_sampling_level", g.importance_sampling_level, "token", "has no policy ratio"),
                    ("normalize_advantages", g.normalize_advantages, False, "has no advantages"),
                    ("delta", g.delta, None, "has no policy ratio"),
                ):
                    if value != want:
                        problems.append((f"grpo.{name}", f"must be {want!r}: objective online_dpo {why}"))
            else:
                if self.grpo.normalize_advantages:
                    problems.append(
                        ("grpo.normalize_advantages", "is objective rloo's; grpo's advantages: grpo.scale_rewards")
                    )
                if self.grpo.loss == "cispo" and (self.grpo.epsilon_high is None or self.grpo.epsilon_high < 1):
                    problems.append(
                        (
                            "grpo.epsilon_high",
                            "bounds loss cispo's importance weight itself, min(r, epsilon_high): give it, at least 1 "
                            "(ScaleRL's 5.0; below 1 it would scale every token's gradient down)",
                        )
                    )
                if self.grpo.loss == "cispo" and self.grpo.delta is not None:
                    problems.append(("grpo.delta", "bounds the clipped surrogate's ratio; loss cispo has none"))
            if self.neftune_noise_alpha:
                problems.append(("neftune_noise_alpha", "would add noise to the sampled completions' scores: set 0"))
            if self.grpo is not None and self.grpo.sampler == "model":  # (by value, as above)
                for name in self.grpo.changed(*ENGINE_SAMPLER_FIELDS):
                    problems.append(
                        (
                            f"grpo.{name}",
                            "is grpo.sampler engine's (and server's): set grpo.sampler: engine, or leave it out",
                        )
                    )
            elif self.grpo is not None:
                problems.extend(self.grpo.correction_problems(objective))
            if self.grpo is not None and self.grpo.sampler != "server":
                for name in self.grpo.changed(*SERVER_SAMPLER_FIELDS):
                    problems.append(
                        (f"grpo.{name}", "is grpo.sampler server's: set grpo.sampler: server, or leave it out")
                    )
            if self.grpo is not None and self.grpo.sampler == "server":
                problems.extend(self.grpo.server_problems(self.scaling.num_workers))
            mu = self.grpo.iterations if self.grpo is not None else 1
            for field, value in (("steps", self.steps), ("checkpoint.every_steps", self.checkpoint.every_steps)):
                if value % mu:
                    why = "a checkpoint between the updates of one sampled batch would have to keep its completions"
                    problems.append((field, f"must be a multiple of grpo.iterations ({mu}): {why} (got {value})"))
        elif self.grpo is not None:
            problems.append(("grpo", f"sets objective grpo's and rloo's sampling and rewards; objective: {objective}"))
        problems.extend(self._eagle3_problems())
        problems.extend(self._sequence_parallel_problems())
        if self.reward_center_coefficient and objective != "reward":
            problems.append(
                ("reward_center_coefficient", f"centres objective reward's scores; objective is {objective}")
            )
        if self.data.validation_fraction == 0:
            for field in ("every_steps", "max_batches"):
                if getattr(self.eval, field):
                    problems.append(
                        (
                            f"eval.{field}",
                            "evaluation needs a held-out split: set data.validation_fraction (e.g. 0.05) "
                            f"(got {field} {getattr(self.eval, field)} with validation_fraction 0)",
                        )
                    )
        _raise_problems(problems)
        return self

    @property
    def global_batch_size(self) -> int:
        """Rows a step trains: each worker's micro-batches, a sequence-parallel group's workers sharing theirs."""
        rows = self.batch.micro_batch_size * self.batch.grad_accum_steps * self.scaling.num_workers
        return rows // self.scaling.sequence_parallel

    def summary(self) -> str:
        device = "GPU" if self.scaling.use_gpu else "CPU"
        ckpt = self.checkpoint.storage or "$PYLON_HOME/runs"
        return (
            f"TrainJob '{self.name}': {self.model.describe()}, {self.scaling.num_workers} {device} worker(s), "
            + (f"sequence parallel {self.scaling.sequence_parallel}, " if self.scaling.sequence_parallel > 1 else "")
            + f"{self.deepspeed.describe()}, {self.precision}, {self.steps} steps x {self.global_batch_size} "
            f"sequences, data {self.data.uri}, checkpoints -> {ckpt} every {self.checkpoint.every_steps}"
            + (f", LoRA r={self.lora.r}" if self.lora else "")
            + (f", objective {self.objective}" if self.objective != "causal_lm" else "")
        )


# ---------------------------------------------------------------------------------------------------------
# Deployment
# ---------------------------------------------------------------------------------------------------------


# engine.speculative's methods that draft with an EAGLE head (`draft_model` its directory), and those that draft from
# the model's hidden states (the checkpoint's MTP layer, or such a head): run by the engine's MTP machinery
EAGLE_METHODS = ("eagle", "eagle3")
HEAD_METHODS = ("mtp", *EAGLE_METHODS)


class SpeculativeSpec(_Spec):
    method: Literal["none", "ngram", "suffix", "draft", "mtp", "eagle", "eagle3"] = Field(
        "none",
        description="speculative decoding: ngram = draft tokens by prompt lookup (the request's own earlier "
        "tokens: the continuation of the latest earlier occurrence of its last n tokens, no second model); suffix = "
        "suffix decoding: the most frequent continuation of its latest tokens in suffix trees of its own tokens "
        "and of the outputs of the requests that finished before it (agents, tool loops, templated output: what "
        "earlier requests wrote drafts the next one's); draft = "
        "the greedy tokens of a smaller model (draft_model) with the same tokenizer, run beside the model with a "
        "KV cache of its own; mtp = the greedy tokens of the checkpoint's own multi-token-prediction layer "
        "(DeepSeek-V3, R1, GLM-4.5, Qwen3-Next, Qwen3.5: the layer transformers skips), fed the model's "
        "hidden states, its KV cache one more layer in the model's blocks; eagle, eagle3 = the greedy tokens of "
        "an EAGLE or EAGLE-3 head trained for the model (draft_model: its directory, as EAGLE's, SGLang's, "
        "SpecForge's and the speculators releases hold it), run the same way (EAGLE-3's from three of the "
        "model's layers' hidden states). Either way all drafts are "
        "verified in one forward pass and accepted by the standard rule, so greedy outputs are token for token "
        "those without it and sampled ones keep their distribution. ngram pays off where outputs copy from the "
        "input (code edits, summaries, extraction), draft wherever the small model guesses the large one well; "
        "the engine turns it off per step when its own measured step times "
        "say the verification would cost more than the accepted tokens save (docs/serving.md, 'Speculative "
        "decoding')",
    )
    draft_model: str | None = Field(
        None,
        description="method draft: the draft model's directory (a local path or a URI such as s3://..., as "
        "`model`), e.g. a smaller `pylon export` trained with the same tokenizer; method eagle or eagle3: the "
        "head's directory (its config.json and weights, safetensors or pytorch_model.bin)",
    )
    num_tokens: int = Field(
        4,
        ge=1,
        le=32,
        description="draft tokens proposed per request and step at most (suffix decoding's long matches: up to 32)",
    )
    tree_width: int = Field(
        1,
        ge=1,
        le=8,
        description="methods ngram and suffix: drafts branch into up to this many alternatives at each position (a "
        "draft tree, as SGLang's and Arctic Inference's), num_tokens nodes in all, the likeliest first; the model "
        "verifies every branch in the same one forward pass (each node attends only to its own ancestors) and "
        "keeps the longest path it agrees with. Where the likeliest continuation is uncertain (several earlier "
        "occurrences went on differently) a tree accepts more tokens per pass than one path of as many tokens. "
        "1: one path (docs/serving.md, 'Draft trees')",
    )
    ngram_max: int = Field(3, ge=1, le=16, description="the longest suffix of the request's tokens looked up")
    ngram_min: int = Field(1, ge=1, le=16, description="the shortest suffix looked up before giving up")
    suffix_max_depth: int = Field(
        24, ge=2, le=256, description="method suffix: the longest run of tokens its trees count (vLLM's default)"
    )
    suffix_max_cached_requests: int = Field(
        10000,
        ge=0,
        description="method suffix: the finished requests whose outputs draft later ones (the oldest let go first); "
        "0: each request drafts from its own tokens only",
    )
    suffix_max_spec_factor: float = Field(
        1.0, gt=0, description="method suffix: a draft is at most this many times the matched suffix's length"
    )
    suffix_min_token_prob: float = Field(
        0.1,
        ge=0,
        le=1,
        description="method suffix: a draft stops where its estimated probability (the product of each token's "
        "share of what followed) falls below this",
    )

    @model_validator(mode="after")
    def _ngram_bounds(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method draft needs draft_model: the directory of a smaller model with this tokenizer")
        if self.method in EAGLE_METHODS and not self.draft_model:
            raise ValueError(
                f"method {self.method} needs draft_model: the directory of the head trained for this model"
            )
        if self.tree_width > 1 and self.method not in ("ngram", "suffix"):
            raise ValueError(
                f"tree_width {self.tree_width} needs method ngram or suffix (got {self.method}): a draft model's or "
                "head's drafts are one path; set tree_width: 1"
            )
        if self.tree_width > 1 and self.num_tokens < 2:
            raise ValueError(f"tree_width {self.tree_width} needs num_tokens >= 2 (the tree's nodes in all)")
        if self.draft_model and self.method not in ("draft", *EAGLE_METHODS):
            raise ValueError(
                f"draft_model is set but method is {self.method}; set method: draft (a smaller model) or eagle, "
                "eagle3 (a head) to use it"
            )
        return self


MAX_ADAPTERS = 64


class AdapterSpec(_Spec):
    """A LoRA adapter served beside the base model (docs/serving.md, "LoRA adapters")."""

    name: Name = Field(
        description="what clients put in a request's `model` to use it (GET /v1/models lists it); unique, and "
        "not the deployment's own name"
    )
    path: Uri = Field(
        description="its directory in peft's format (adapter_config.json, adapter_model.safetensors), local or "
        "object storage: what `pylon export --lora adapter` writes for a LoRA run on this base model"
    )


class DynamicAdaptersSpec(_Spec):
    """LoRA adapters loaded when a request first names one (docs/serving.md, "Adapters loaded on demand")."""

    root: Uri | None = Field(
        None,
        description="a directory, local or object storage, whose sub-directories are LoRA adapters of this model in "
        "peft's format (`<root>/<name>/adapter_config.json`, `adapter_model.safetensors`): a request whose `model` "
        "is a name that is neither the deployment's nor one of `adapters` runs with `<root>/<name>/`, fetched by the "
        "replica the first time (as Ray Serve LLM's dynamic_lora_loading_path). Names take the grammar of a spec's "
        "names (lowercase letters, digits, '-'), so a request never reaches outside the root. A name is an adapter's "
        "identity: a replica keeps what it fetched, so publish a changed adapter under a new name. null: off",
    )
    max_loaded: PositiveInt = Field(
        8,
        description="adapters from the root an engine holds loaded at once (vLLM's --max-loras), beside `adapters`; "
        "a request for another one loads it in the place of the least recently used one that no unfinished request "
        "runs with, or waits until one is free. The planner counts this many adapters of `max_rank` on every "
        "projection",
    )
    max_rank: PositiveInt = Field(
        16,
        description="the largest LoRA rank an adapter from the root may have (vLLM's --max-lora-rank); a request for "
        "one of a higher rank is refused naming it",
    )


class EngineSpec(_Spec):
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    kv_cache_tokens: PositiveInt = 65536
    block_size: PositiveInt = 16
    max_model_len: PositiveInt = 1024
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    kv_cache_dtype: Literal["auto", "fp32", "fp16", "bf16", "fp8"] = Field(
        "auto",
        description="how the paged KV cache stores keys and values (vLLM's kv_cache_dtype): auto = as the "
        "model computes (dtype); bf16 or fp16 halve the cache's memory per token and the bytes "
        "every decode step reads, fp8 (e4m3, unscaled, saturating at +-448) quarters them. "
        "Attention still computes in dtype, but outputs are no longer exactly the model's own: "
        "greedy outputs can part from `transformers` generate's after a few tokens",
    )
    quantization: Literal["none", "int8", "fp8", "int4"] = Field(
        "none",
        description="weight-only quantization of the decoder layers' projections (attention and MLP; the "
        "embeddings and lm_head stay), applied at load from a float checkpoint: int8 = one int8 per weight "
        "and a float32 scale per output channel, a quarter of float32's bytes (half of bf16's), on any device; "
        "on a CPU decode steps read fewer bytes and run faster, long prompt chunks slower. fp8 = e4m3 with "
        "per-channel scales, CUDA GPUs of compute capability 8.9+ only (refused elsewhere at start). int4 = 4 "
        "bits a weight in groups of 64 inputs (a 4-bit GPTQ, AWQ or W4A16 checkpoint's own groups where they fit: "
        "its weights served in 4 bits as published), a float32 scale and min a group: about a sixth of "
        "float32's bytes; a CPU kernel for float32 engines, dequantized per call elsewhere. "
        "Activations and the KV cache stay in dtype; greedy outputs part from the float model's after some tokens",
    )
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters of the model served beside it by the same engine (vLLM's --lora-modules): a "
        "request names one in `model`; requests for different adapters and for the base model share each "
        "batched step, each row computing its own adapter's low-rank update on top of the shared weights. All "
        "stay loaded (their weights are small: 2 x r x width per adapted projection). The prefix cache is kept "
        "apart per adapter",
    )
    dynamic_adapters: DynamicAdaptersSpec = Field(
        default_factory=DynamicAdaptersSpec,
        description="LoRA adapters loaded on demand from a root directory, by the name a request gives in `model`",
    )
    max_images_per_prompt: int = Field(
        8,
        ge=0,
        le=64,
        description="images a chat request may send (image_url parts, data: URLs), for a multimodal checkpoint "
        "(Gemma 3 4B-27B, Mistral Small 3.1/3.2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, InternVL3/3.5 -hf, "
        "LLaVA-1.5; vLLM's limit_mm_per_prompt) that ships its image processor: its vision tower and projector are "
        "kept on the device and each request's images run through them once. 0 = text only: the vision tower is "
        "dropped at load (less memory) and a request with an image is a 400. No effect for a text-only model, "
        "which refuses images",
    )
    mm_processor_kwargs: dict[str, int | float | bool | str | list[int] | dict[str, int]] = Field(
        default_factory=dict,
        description="arguments for the multimodal checkpoint's image processor, each request's images processed with "
        "them (vLLM's mm_processor_kwargs): Qwen-VL's {max_pixels: 1003520} caps an image at 1,280 tokens (its "
        "checkpoints' 12,845,056 allow 16,384), min_pixels raises small ones; InternVL's {max_patches: 6} cuts an "
        "image into at most 6 tiles of 256 tokens. Checked at engine start on a test "
        "image: a name or value the processor refuses fails the start naming this field",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="reuse the KV cache blocks of a prompt's prefix that an earlier request computed (vLLM's "
        "automatic prefix caching): full blocks are named by a hash of their tokens and all before them, shared "
        "between requests, and kept after a request ends until the pool needs them. Outputs are the same with it "
        "off; false: every request computes its whole prompt",
    )
    kv_offload_tokens: int = Field(
        0,
        ge=0,
        description="a second tier of the prefix cache in host memory, of this many tokens' KV blocks (vLLM's CPU "
        "KV offloading, SGLang's HiCache): a cached block the device's cache lets go of (its block taken for other "
        "contents) is first copied there, and a later request whose prefix runs on into it has those blocks copied "
        "back instead of computing them again: a chat whose next turn comes after many others', a long shared "
        "document. Host memory (pinned on a GPU): this many tokens x the KV cache's bytes a token, per engine "
        "(`pylon plan` says how much). 0: off. Needs enable_prefix_caching; a multiple of block_size",
    )
    kv_offload_path: str | None = Field(
        None,
        description="a local directory (an NVMe disk's) that holds the prefix cache's host tier instead of RAM "
        "(LMCache's local disk, SGLang's HiCache storage): each engine (each shard or stage on its node) maps its "
        "tier's blocks to files there, their space reserved at start (too little space fails the start, naming "
        "it) and the files deleted from the directory at once, so that nothing is left behind when the engine "
        "stops, even killed. The OS keeps what it can of them in its page cache. None: the tier in RAM. Needs "
        "kv_offload_tokens",
    )
    separate_process: bool = Field(
        True,
        description="in a Serve replica, run the engine in a child process of its own (as vLLM v1 runs its "
        "engine core): HTTP and Serve's work then never hold the Python lock the step loop needs",
    )
    cuda_graphs: bool = Field(
        True,
        description="on a GPU, capture CUDA graphs for steps of decodes only in a few fixed shapes at start-up "
        "and replay them (fewer kernel launches per step); false: every step runs eagerly. "
        "No effect on a CPU",
    )
    data_parallel: PositiveInt = Field(
        1,
        description="engine processes per replica, each with its own copy of the model and its own KV cache "
        "(max_num_seqs and kv_cache_tokens are per engine); a request goes to the one with the fewest "
        "open requests. The replica's CPUs are divided among them (on a GPU: one GPU each, so "
        "replica.num_gpus must match). On a CPU node, one replica with an engine per core serves "
        "more than a replica per core: one HTTP server and one set of Serve's and Ray's per-process "
        "costs instead of one per engine. autoscaling.target_ongoing_requests counts a replica's "
        "requests, all its engines'",
    )
    pipeline_parallel: PositiveInt = Field(
        1,
        description="split the model into this many pipeline stages, each a process holding a contiguous run of its "
        "decoder layers and their KV cache (the first the embeddings and the final norm and lm_head too), so that "
        "a model larger than one machine's memory is served across machines (vLLM's pipeline_parallel_size). No "
        "stage reads another's weights: from s3:// each copies its own tensors alone. In a Serve replica the stages "
        "after the first take the bundles of the replica's placement group (each replica.num_cpus and "
        "replica.num_gpus), placed by pipeline_placement; each stage loads its part from model.path itself, so the "
        "path must reach every node (s3://, or a shared directory). A step goes through the stages in turn (see "
        "pipeline_microbatches). Llama-like decoder families only (Qwen3-Next's and Qwen3.5's recurrent layers each "
        "stage's own, their states snapshotted by each for the prefix cache), and multimodal checkpoints for their "
        "text (Llama 4, Gemma 3, Mistral 3; max_images_per_prompt 0); LoRA adapters (adapters, dynamic_adapters) are "
        "served, each stage applying their matrices of its own layers; kv_cache_tokens are every stage's. With "
        "tensor_parallel, each stage is that many shards on its node (vLLM's TP x PP: a node's GPUs a stage, the "
        "stages across nodes), its bundle holding tensor_parallel times the replica's resources",
    )
    pipeline_microbatches: PositiveInt = Field(
        1,
        description="with pipeline_parallel, cut each step of several sequences into up to this many groups of about "
        "as many tokens, sent down the stages one after another without waiting, so that the stages compute "
        "different groups at once (1: each step whole, the stages in turn). Outputs are the same either way. Each "
        "group costs a step's fixed work and a hop, and computes a smaller batch: on one 2-core machine it lost "
        "(benchmark set 53: 0.77x of whole at 16 sequences, against 0.87x in turn); a lever for stages on separate "
        "machines whose layers' computing dominates a step, to be measured there",
    )
    pipeline_placement: Literal["spread", "strict_spread", "pack"] = Field(
        "spread",
        description="where the pipeline stages go (Ray's placement group strategies): spread = on different nodes "
        "where the cluster has them, else together; strict_spread = each on a node of its own, waiting for "
        "nodes (or the autoscaler) until there are enough; pack = on as few nodes as they fit. No effect with "
        "pipeline_parallel 1",
    )
    tensor_parallel: PositiveInt = Field(
        1,
        description="split each decoder layer into this many tensor-parallel shards (vLLM's tensor_parallel_size), "
        "each a process on the replica's node holding its share of the attention heads (and their KV cache) and of "
        "the MLP, reading only its slices of the checkpoint: a model larger than one GPU's memory is served by the "
        "GPUs of one node together, every shard computing every step, its layers' outputs summed across the shards "
        "(gloo on CPUs, NCCL on GPUs, over the node's loopback and its own links). In a Serve replica the shards "
        "after the first take the bundles of the replica's placement group (each replica.num_cpus and "
        "replica.num_gpus), all on one node (STRICT_PACK). Llama-like families (Phi-3's and GLM-4's fused projections "
        "split part by part; OLMo 2 and 3's norms over all heads summed across the shards), and Mixtral, Qwen2-MoE, "
        "Qwen3-MoE, GLM-4.5, dots.llm1, ERNIE 4.5 MoE, GPT-OSS, OLMoE, FlexOlmo and Llama 4 (every expert split as "
        "the MLP is), Qwen3-Next and Qwen3.5 (recurrent layers split by heads, each shard snapshotting its own), "
        "multimodal checkpoints for their text (Llama 4, Gemma 3, Mistral 3, Qwen3.5; max_images_per_prompt 0), "
        "DeepSeek-V2 and V3 (latent attention split by heads, the latent cache whole on each shard), whose attention "
        "heads and MLP and experts' widths it divides, and whose key-value heads it divides or is a multiple of (one "
        "a shard, replicated); LoRA adapters each shard's slice of their matrices; float and quantized checkpoints in "
        "block FP8 or compressed-tensors' layouts (another quantized one: save it dequantized). With "
        "pipeline_parallel: each stage in this many shards on its node (see there). Classifiers too (a reward model's "
        "...ForSequenceClassification, classifier_from_token), their head whole on every shard; not with "
        "data_parallel",
    )
    expert_parallel: bool = Field(
        False,
        description="with tensor_parallel, divide a mixture-of-experts model's experts among the shards whole (vLLM's "
        "--enable-expert-parallel) instead of slicing every expert across them: each shard holds tensor_parallel "
        "times fewer experts at their full width (whole matmuls, however narrow a slice would be), the router, "
        "attention, dense MLPs and shared experts split as before, each MoE block's output summed across the shards "
        "once. Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5, dots.llm1, ERNIE 4.5 MoE, DeepSeek-V2 and V3, OLMoE "
        "and FlexOlmo, whose experts tensor_parallel divides",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="the sampling defaults of the model's generation_config.json (vLLM's --generation-config, auto "
        "as there): auto = a request that leaves out temperature, top_p, top_k, min_p, repetition_penalty or "
        "max_tokens takes the model's value where the file sets one (max_new_tokens for max_tokens, capped by the "
        "context left; do_sample is ignored, as vLLM ignores it), and a value the request gives wins; a value "
        "outside what a request may ask stops the engine at start. none = OpenAI's defaults, the file's sampling "
        "values unread. Either way a generation ends at every end-of-sequence id the model lists "
        "(generation_config.json's and config.json's eos_token_id, and the tokenizer's eos)",
    )
    recurrent_state_snapshots: int = Field(
        16,
        ge=0,
        le=4096,
        description="for a model with recurrent layers (Qwen3-Next, Qwen3.5: Gated DeltaNet), the snapshots of "
        "their states the prefix cache keeps beside its blocks, least recently used let go first: a request "
        "starts from a cached prefix only as far as a block with a snapshot, which is taken at the last block "
        "boundary of each prompt, at the last one before a chat's last message (another conversation with the "
        "same system prompt starts there) and at the last one each request reached in decoding (a chat's next turn "
        "starts there). Each holds every recurrent layer's state for one sequence (the engine logs its size at start); "
        "0: such a model shares no prefix cache. No effect without enable_prefix_caching or recurrent layers",
    )
    recurrent_snapshot_interval: int = Field(
        0,
        ge=0,
        description="for a model with recurrent layers, with the prefix cache: also snapshot their states every this "
        "many tokens of a prompt (rounded down to blocks), so that prompts sharing a long start that is neither a "
        "system prompt nor an earlier turn (one document, different questions) share it to within this many tokens; "
        "each such prompt is computed in steps that end there. 0: only a prompt's last boundary, a chat's last "
        "message and decoding's last (see recurrent_state_snapshots)",
    )
    classifier_from_token: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        max_length=2,
        description="serve a causal LM as a classifier of one label, for /classify, /v1/score and /rerank "
        "(vLLM's hf_overrides classifier_from_token): its head made of these tokens' lm_head rows, each one "
        "token of the model's vocabulary. One token: its logit; two, [no, yes]: yes's logit less no's, whose "
        'sigmoid is P(yes) / (P(yes) + P(no)) (Qwen3-Reranker: ["no", "yes"]). Empty: the model as it '
        "ships (a *ForSequenceClassification checkpoint is a classifier by itself). A classifier generates no text",
    )

    @model_validator(mode="after")
    def _rules(self) -> "EngineSpec":
        problems = []
        if self.data_parallel > 1 and not self.separate_process:
            problems.append(
                (
                    "data_parallel",
                    f"needs separate_process: true (each engine is a process of its own) "
                    f"(got data_parallel {self.data_parallel} with separate_process false)",
                )
            )
        if self.expert_parallel and self.tensor_parallel == 1:
            problems.append(
                (
                    "expert_parallel",
                    "divides the experts among tensor-parallel shards: set tensor_parallel to the shards to divide "
                    "them among (2 or more), or expert_parallel to false",
                )
            )
        if self.speculative.method in EAGLE_METHODS and self.pipeline_parallel > 1:
            problems.append(
                (
                    "speculative.method",
                    f"{self.speculative.method} drafts with its head beside the model's last layer, in one stage, not "
                    f"with pipeline_parallel {self.pipeline_parallel}: use method ngram or suffix there "
                    "(tensor_parallel takes it)",
                )
            )
        if self.speculative.method == "mtp" and self.pipeline_parallel > 1:
            problems.append(
                (
                    "speculative.method",
                    "mtp drafts with the checkpoint's layer beside the model's last layer, in one stage, not with "
                    f"pipeline_parallel {self.pipeline_parallel}: use method ngram there (tensor_parallel takes mtp)",
                )
            )
        if self.tensor_parallel > 1:
            for field, value, neutral in (("data_parallel", self.data_parallel, 1),):
                if value != neutral:
                    problems.append(
                        (
                            field,
                            f"is not served with tensor_parallel {self.tensor_parallel} (set it to {neutral!r}, "
                            "or tensor_parallel to 1)",
                        )
                    )
        if self.pipeline_parallel > 1:
            for field, value, neutral in (
                ("data_parallel", self.data_parallel, 1),
                ("classifier_from_token", self.classifier_from_token, []),
            ):
                if value != neutral:
                    problems.append(
                        (
                            field,
                            f"is not served with pipeline_parallel {self.pipeline_parallel} (set it to {neutral!r}, "
                            "or pipeline_parallel to 1)",
                        )
                    )
        if self.kv_cache_tokens < self.max_model_len:
            problems.append(
                (
                    "kv_cache_tokens",
                    f"must hold at least one full sequence: >= max_model_len ({self.max_model_len}) "
                    f"(got {self.kv_cache_tokens})",
                )
            )
        if self.kv_cache_tokens % self.block_size:
            problems.append(
                (
                    "kv_cache_tokens",
                    f"must be a multiple of block_size ({self.block_size}) (got {self.kv_cache_tokens})",
                )
            )
        if self.kv_offload_tokens and not self.enable_prefix_caching:
            problems.append(
                (
                    "kv_offload_tokens",
                    f"is the prefix cache's second tier: set enable_prefix_caching to true, or kv_offload_tokens to 0 "
                    f"(got {self.kv_offload_tokens})",
                )
            )
        if self.kv_offload_path is not None and not self.kv_offload_tokens:
            problems.append(
                (
                    "kv_offload_path",
                    "holds the prefix cache's host tier: set kv_offload_tokens to its size in tokens, or remove "
                    "kv_offload_path",
                )
            )
        if self.kv_offload_path is not None and "://" in self.kv_offload_path:
            problems.append(
                (
                    "kv_offload_path",
                    f"must be a directory on the replica's own disk, not object storage (got {self.kv_offload_path!r})",
                )
            )
        if self.kv_offload_tokens % self.block_size:
            problems.append(
                (
                    "kv_offload_tokens",
                    f"must be a multiple of block_size ({self.block_size}) (got {self.kv_offload_tokens})",
                )
            )
        seen: set[str] = set()
        for i, adapter in enumerate(self.adapters):
            if adapter.name in seen:
                problems.append((f"adapters[{i}].name", f"'{adapter.name}' names an earlier adapter too"))
            seen.add(adapter.name)
        _raise_problems(problems)
        return self


class AutoscalingSpec(_Spec):
    min_replicas: NonNegInt = 1
    max_replicas: PositiveInt = 1
    initial_replicas: NonNegInt | None = None
    target_ongoing_requests: Annotated[float, Field(gt=0)] = 16
    upscale_delay_s: Annotated[float, Field(ge=0)] = 5
    downscale_delay_s: Annotated[float, Field(ge=0)] = 60
    target_ttft_ms: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="the time to first token (90th percentile of the requests that ended in the last 30 s, at the "
        "replicas) the replicas' number aims at: a longer one adds replicas in proportion, one under half of every "
        "target takes one away (after upscale_delay_s, downscale_delay_s); target_ongoing_requests stays a floor. "
        "null: scale on target_ongoing_requests alone",
    )
    target_itl_ms: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="the time between a request's tokens (90th percentile, as target_ttft_ms) the replicas' number "
        "aims at, as target_ttft_ms does; null: none",
    )

    @model_validator(mode="after")
    def _rules(self) -> "AutoscalingSpec":
        problems = []
        targets = self.target_ttft_ms is not None or self.target_itl_ms is not None
        if targets and self.min_replicas == self.max_replicas:
            problems.append(
                (
                    "max_replicas",
                    f"a latency target needs room to scale: max_replicas ({self.max_replicas}) must be more than "
                    f"min_replicas ({self.min_replicas})",
                )
            )
        if self.min_replicas > self.max_replicas:
            problems.append(
                ("min_replicas", f"must be <= max_replicas ({self.max_replicas}) (got {self.min_replicas})")
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            problems.append(
                (
                    "initial_replicas",
                    f"must be between min_replicas ({self.min_replicas}) and max_replicas ({self.max_replicas}) "
                    f"(got {self.initial_replicas})",
                )
            )
        _raise_problems(problems)
        return self


class HttpSpec(_Spec):
    api_keys_env: EnvName | None = Field(
        "PYLON_API_KEYS", description="name of the env var holding comma-separated API keys; null disables auth"
    )
    max_queued_requests: PositiveInt = 256
    request_timeout_s: Annotated[float, Field(gt=0)] = 60
    stream_interval_ms: Annotated[float, Field(ge=0, le=1000)] = Field(
        50,
        description="a stream's first token goes out at once, later ones once per this many ms on average "
        "(on ticks every stream of a replica shares, at least half of it apart), the tokens in "
        "between joined into one chunk (every chunk costs the replica and the ingress; 0: one "
        "chunk per decoding step)",
    )
    route_prefix: str = Field("/", pattern=r"^/[A-Za-z0-9_\-/]*$")
    trust_request_chat_template: bool = Field(
        False,
        description="take a chat request's own chat_template (vLLM's --trust-request-chat-template): a Jinja "
        "template runs sandboxed, but a client's may take a replica's time; false: such a request is a 400",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="a reasoning model's <think> block as chat replies' reasoning_content, the rest as content "
        "(deepseek_r1: the chat template opens the block; qwen3: the model does); null: replies as generated. A "
        "harmony model (gpt-oss) needs none: its channels are read by themselves",
    )
    responses_store: Uri | None = Field(
        None,
        description="where the Responses API keeps the responses clients ask it to store (s3://bucket/prefix for "
        "replicas on several machines; a local directory for one machine), so that previous_response_id and GET/"
        "DELETE /v1/responses/{id} work on any replica; each client's under its API key. null: nothing is kept "
        "(previous_response_id is a 400 saying to set this)",
    )
    batch_store: Uri | None = Field(
        None,
        description="where OpenAI's Files and Batch APIs keep uploaded files, batches and their output files "
        "(s3://bucket/prefix for replicas on several machines; a local directory for one machine), each client's "
        "under its API key; the replica that creates a batch answers it in the background. null: /v1/files and "
        "/v1/batches answer 400 saying to set this",
    )
    background_timeout_s: Annotated[float, Field(gt=0)] = Field(
        3600,
        description="how long a Responses request with background: true may run (request_timeout_s is the limit "
        "of a request a client waits on); past it the response ends failed. A background response still in "
        "progress this long after it started is answered failed by GET (its replica stopped)",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="the address Serve's HTTP ingress binds to (0.0.0.0: every interface, for clients on other "
        "machines; needs api_keys_env). Serve's, so the cluster's: the first deployment sets it",
    )
    port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None, description="Serve's HTTP port; default: the one `pylon cluster up` reserved, else 8000"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReplicaSpec(_Spec):
    num_cpus: Annotated[float, Field(ge=0)] = 1
    num_gpus: Annotated[float, Field(ge=0)] = 0
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="the node labels a replica's node must have (Ray's label_selector; the labels `pylon cluster up "
        "--labels` and `pylon cluster join --labels` give a node, e.g. {pool: decode}); {}: any node with room",
    )


class PrefillAutoscalingSpec(AutoscalingSpec):
    """The prefill replicas' autoscaling (Ray Serve's, on the prompts at each prefill replica: those it computes and
    those waiting for it)."""

    target_ongoing_requests: Annotated[float, Field(gt=0)] = Field(
        4,
        description="the prompts at a prefill replica (computing or waiting) its autoscaling aims at: more add "
        "replicas, fewer take them away; each prompt waiting there adds its compute time to a request's time to "
        "first token",
    )
    upscale_delay_s: Annotated[float, Field(ge=0)] = 2
    downscale_delay_s: Annotated[float, Field(ge=0)] = 60
    target_ttft_ms: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="the prefill replicas' share of the time to first token (90th percentile over the last 30 s, from "
        "a prompt's arrival at a prefill replica to its KV blocks being ready) their number aims at: a longer one "
        "adds replicas in proportion, one under half of it takes one away; target_ongoing_requests stays a floor. "
        "null: scale on target_ongoing_requests alone",
    )
    target_itl_ms: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="not for prefill replicas (they compute prompts, not tokens one after another): refused here; "
        "give it under the deployment's autoscaling (its decoding replicas)",
    )

    @model_validator(mode="after")
    def _prefill_rules(self) -> "PrefillAutoscalingSpec":
        if self.target_itl_ms is not None:
            _raise_problems(
                [
                    (
                        "target_itl_ms",
                        "prefill replicas compute prompts, not tokens one after another: give target_itl_ms under the "
                        "deployment's autoscaling (its decoding replicas)",
                    )
                ]
            )
        return self


class PrefillSpec(_Spec):
    """Prefill-decode disaggregation: replicas of their own compute long prompts and send their KV blocks to the
    replica that decodes them (docs/serving.md, "Prefill on replicas of its own")."""

    replicas: PositiveInt | None = Field(
        None,
        description="how many prefill replicas run (each its own engine); None: one, or as many as `autoscaling` "
        "keeps (give one of the two)",
    )
    autoscaling: PrefillAutoscalingSpec | None = Field(
        None,
        description="the prefill replicas' number follows their load, apart from the decoding replicas' (between "
        "min_replicas and max_replicas); None: `replicas` of them",
    )
    min_prompt_tokens: PositiveInt = Field(
        256,
        description="a prompt goes to a prefill replica when at least this many of its tokens are not already in the "
        "decoding replica's prefix cache; shorter ones are computed where they are decoded (a hop costs more than "
        "they do)",
    )
    timeout_s: Annotated[float, Field(gt=0)] = Field(
        60,
        description="how long a replica waits for a prefill replica's blocks before it computes the prompt itself",
    )
    replica: ReplicaSpec | None = Field(
        None, description="a prefill replica's resources and node labels; None: the deployment's `replica`"
    )

    @model_validator(mode="after")
    def _rules(self) -> "PrefillSpec":
        if self.autoscaling is not None and self.replicas is not None:
            _raise_problems(
                [
                    (
                        "replicas",
                        "give either replicas (a fixed number) or autoscaling (min_replicas to max_replicas), not both",
                    )
                ]
            )
        return self

    def replica_range(self) -> tuple[int, int]:
        """The fewest and the most prefill replicas that may run."""
        a = self.autoscaling
        fixed = self.replicas or 1
        return (a.min_replicas, a.max_replicas) if a is not None else (fixed, fixed)

    def describe_replicas(self) -> str:
        low, high = self.replica_range()
        return f"{low}" if low == high else f"{low}-{high}"


class DeploymentSpec(_Spec):
    """A model served on Ray Serve with continuous batching behind OpenAI-compatible HTTP."""

    kind: Literal["Deployment"] = "Deployment"
    name: Name
    model: Uri = Field(description="a Hugging Face format model directory (local or object storage)")
    engine: EngineSpec = Field(default_factory=EngineSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    http: HttpSpec = Field(default_factory=HttpSpec)
    replica: ReplicaSpec = Field(default_factory=ReplicaSpec)
    prefill: PrefillSpec | None = Field(
        None,
        description="prefill-decode disaggregation: replicas of their own compute long prompts, whose KV blocks go to "
        "the replica that decodes them; None: every replica computes its own prompts",
    )

    @model_validator(mode="after")
    def _rules(self) -> "DeploymentSpec":
        if not is_loopback(self.http.host) and not self.http.api_keys_env:
            _raise_problems(
                [
                    (
                        "http.host",
                        f"{self.http.host} lets other machines in, so it needs API keys: set http.api_keys_env "
                        "(or keep the default host 127.0.0.1)",
                    )
                ]
            )
        if self.prefill is not None and self.autoscaling.target_ttft_ms is not None:
            _raise_problems(
                [
                    (
                        "autoscaling.target_ttft_ms",
                        "with prefill replicas, prompts are computed there: give the target as "
                        "prefill.autoscaling.target_ttft_ms (the decoding replicas scale on target_itl_ms)",
                    )
                ]
            )
        for i, adapter in enumerate(self.engine.adapters):
            if adapter.name == self.name:
                _raise_problems(
                    [
                        (
                            f"engine.adapters[{i}].name",
                            f"'{adapter.name}' is the deployment's own name, which requests use for the base "
                            "model; name the adapter otherwise",
                        )
                    ]
                )
        if self.engine.device == "cuda" and self.replica.num_gpus == 0:
            _raise_problems([("replica.num_gpus", "must be > 0 when engine.device is 'cuda' (got 0)")])
        dp = self.engine.data_parallel
        if dp > 1 and self.engine.device == "cuda" and self.replica.num_gpus < dp:
            _raise_problems(
                [
                    (
                        "replica.num_gpus",
                        f"must be >= engine.data_parallel ({dp}): each engine takes a GPU "
                        f"of its own (got {self.replica.num_gpus:g})",
                    )
                ]
            )
        for field, count, each in (
            ("pipeline_parallel", self.engine.pipeline_parallel, "stage"),
            ("tensor_parallel", self.engine.tensor_parallel, "shard"),
        ):
            if count > 1 and self.replica.num_cpus == 0 and self.replica.num_gpus == 0:
                _raise_problems(
                    [
                        (
                            "replica.num_cpus",
                            f"must be > 0 with engine.{field} {count}: each {each} takes a placement group bundle of "
                            "the replica's resources, and an empty bundle places nothing (got 0, and num_gpus 0)",
                        )
                    ]
                )
        if self.prefill is not None:
            if not self.engine.enable_prefix_caching:
                _raise_problems(
                    [
                        (
                            "prefill",
                            "needs engine.enable_prefix_caching: a prefill replica's blocks are taken into the "
                            "decoding replica's prefix cache, where its request finds them",
                        )
                    ]
                )
            own = self.prefill.replica or self.replica
            if self.engine.device == "cuda" and own.num_gpus == 0:
                _raise_problems([("prefill.replica.num_gpus", "must be > 0 when engine.device is 'cuda' (got 0)")])
            split = max(self.engine.pipeline_parallel, self.engine.tensor_parallel)
            if split > 1 and own.num_cpus == 0 and own.num_gpus == 0:
                _raise_problems(
                    [
                        (
                            "prefill.replica.num_cpus",
                            "must be > 0 with a model split in parts (pipeline_parallel, tensor_parallel): each part "
                            "takes a placement group bundle of the replica's resources (got 0, and num_gpus 0)",
                        )
                    ]
                )
        return self

    def prefill_replica(self) -> ReplicaSpec:
        """A prefill replica's resources and labels (`prefill.replica`, or the deployment's own)."""
        return (self.prefill.replica if self.prefill is not None else None) or self.replica

    def summary(self) -> str:
        a = self.autoscaling
        return (
            f"Deployment '{self.name}': model {self.model}, {a.min_replicas}-{a.max_replicas} replica(s), "
            f"max_num_seqs {self.engine.max_num_seqs}, KV cache {self.engine.kv_cache_tokens} tokens, "
            + (
                f"{self.engine.pipeline_parallel} pipeline stages ({self.engine.pipeline_placement}), "
                if self.engine.pipeline_parallel > 1
                else ""
            )
            + (f"{self.engine.tensor_parallel} tensor-parallel shards, " if self.engine.tensor_parallel > 1 else "")
            + (
                f"{self.prefill.describe_replicas()} prefill replica(s) (prompts of "
                f"{self.prefill.min_prompt_tokens}+ new tokens), "
                if self.prefill is not None
                else ""
            )
            + f"auth {'from $' + self.http.api_keys_env if self.http.api_keys_env else 'OFF'}"
        )


# ---------------------------------------------------------------------------------------------------------
# BatchJob
# ---------------------------------------------------------------------------------------------------------


class BatchJobSpec(_Spec):
    """Offline batch inference: every request in `input` answered by Pylon's serving engine on the cluster's
    workers, the answers written to `output` (`pylon batch`)."""

    kind: Literal["BatchJob"] = "BatchJob"
    name: Name
    model: Uri = Field(description="a Hugging Face format model directory (local or object storage)")
    input: Uri = Field(
        description="a JSONL or Parquet file, or a directory of them (read in name order). Each JSONL line is an "
        "OpenAI Batch API request ({custom_id, method: POST, url, body}: url any POST route of the HTTP API, body "
        "its request), or a record with 'messages' (a chat request for a reply to them: a last assistant message is "
        "dropped) or 'prompt' (a completion request), its other fields kept; each Parquet row a record"
    )
    output: Uri = Field(
        description="the directory the answers go to: results/part-NNNNN.jsonl (answered), errors/part-NNNNN.jsonl "
        "(refused or failed, each naming the line and field at fault), stats/ (each part's counts) and _batch.json "
        "(the job's counts); a job submitted again with the same output goes on from the parts already written"
    )
    body: dict[str, Any] = Field(
        default_factory=dict,
        description="the fields of the requests made from records (messages or prompt), e.g. max_tokens, "
        "temperature, seed; checked as a chat or completion request before the engines start. An OpenAI Batch API "
        "line's body is sent as written",
    )
    output_format: Literal["openai", "conversations"] = Field(
        "openai",
        description="openai: each answer as the Batch API's output line {id, custom_id, response: {status_code, "
        "request_id, body}, error}; conversations: each chat answer as the record with the reply appended to its "
        "messages, each completion as the record with its 'completion' (one line a choice): the files `pylon data "
        "prepare --chat` or `--prompt-completion` takes (a model's own replies to train on: objective eagle3, "
        "distillation)",
    )
    replicas: PositiveInt = Field(1, description="engines answering at once, each with replica's resources")
    chunk_lines: PositiveInt = Field(
        256,
        description="input lines per part: an engine answers a part's lines together, two parts at a time, and "
        "commits each part's files whole, so a job stopped and submitted again redoes at most two parts an engine",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="as a Deployment's http.reasoning_parser: a <think> block as reasoning_content"
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replica: ReplicaSpec = Field(default_factory=ReplicaSpec)

    @model_validator(mode="after")
    def _rules(self) -> "BatchJobSpec":
        self.deployment()  # the engine's and replica's rules, a Deployment's, by the same field paths
        return self

    def deployment(self) -> DeploymentSpec:
        """The Deployment each engine of the job is: its model, engine and replica, answering in-process (no HTTP
        listens; nothing to authorise, no request waits on a client's timeout)."""
        return DeploymentSpec(
            name=self.name,
            model=self.model,
            engine=self.engine,
            replica=self.replica,
            http=HttpSpec(
                api_keys_env=None,
                max_queued_requests=2**31 - 1,
                request_timeout_s=7 * 24 * 3600,
                reasoning_parser=self.reasoning_parser,
            ),
        )

    def summary(self) -> str:
        return (
            f"BatchJob '{self.name}': {self.input} -> {self.output} ({self.output_format}), model {self.model}, "
            f"{self.replicas} engine(s), max_num_seqs {self.engine.max_num_seqs}"
        )


# ---------------------------------------------------------------------------------------------------------
# Cluster
# ---------------------------------------------------------------------------------------------------------


class ProviderSpec(_Spec):
    type: Literal["local", "aws", "gcp", "kubernetes"] = "local"
    region: str | None = None
    zone: str | None = None
    project_id: str | None = None
    namespace: Name = "default"

    @model_validator(mode="after")
    def _rules(self) -> "ProviderSpec":
        problems = []
        if self.type in ("aws", "gcp") and not self.region:
            problems.append(("region", f"required for provider type '{self.type}'"))
        if self.type == "gcp":
            if not self.zone:
                problems.append(("zone", "required for provider type 'gcp'"))
            if not self.project_id:
                problems.append(("project_id", "required for provider type 'gcp'"))
        _raise_problems(problems)
        return self


class NodeShape(_Spec):
    instance_type: str | None = Field(None, description="cloud machine type (aws, gcp)")
    cpus: NonNegInt = 4
    gpus: NonNegInt = 0
    gpu_type: str | None = Field(None, description="accelerator type, e.g. A100-80GB, H100")
    memory_gb: Annotated[float, Field(gt=0)] | None = None

    def _shape_problems(self) -> list[tuple[str, str]]:
        if self.gpu_type and self.gpus == 0:
            return [("gpu_type", f"'{self.gpu_type}' given but gpus is 0")]
        return []


class HeadSpec(NodeShape):
    @model_validator(mode="after")
    def _rules(self) -> "HeadSpec":
        _raise_problems(self._shape_problems())
        return self


class WorkerGroupSpec(NodeShape):
    name: Name
    min_workers: NonNegInt = 0
    max_workers: NonNegInt = 1
    spot: bool = False

    @model_validator(mode="after")
    def _rules(self) -> "WorkerGroupSpec":
        problems = self._shape_problems()
        if self.min_workers > self.max_workers:
            problems.append(("min_workers", f"must be <= max_workers ({self.max_workers}) (got {self.min_workers})"))
        _raise_problems(problems)
        return self


class HaSpec(_Spec):
    """GCS fault tolerance (docs/many-machines.md, "A head that survives"): the GCS keeps its tables in Redis and
    a restarted GCS recovers the cluster from them. Local: `pylon cluster up` starts a Redis (127.0.0.1, a new
    password) and a GCS supervisor itself; Kubernetes: KubeRay's gcsFaultToleranceOptions, with a Redis you run."""

    redis_address: str | None = Field(
        None,
        description="Kubernetes: the Redis the head's GCS uses, HOST:PORT (e.g. redis.ray.svc:6379; "
        "rediss:// for TLS); local clusters start their own",
    )
    redis_password_secret: Name | None = Field(
        None, description="Kubernetes: the Secret (in the cluster's namespace) holding the Redis password"
    )
    redis_password_key: str = Field("password", description="the key of the password in that Secret")

    @model_validator(mode="after")
    def _rules(self) -> "HaSpec":
        if self.redis_address is not None:
            address = self.redis_address.split("://", 1)[-1]
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                _raise_problems([("redis_address", f"must be HOST:PORT (got {self.redis_address!r})")])
        return self


class ClusterSpec(_Spec):
    """One autoscaling Ray cluster: a head and worker groups, local, on a cloud, or on Kubernetes."""

    kind: Literal["Cluster"] = "Cluster"
    name: Name
    provider: ProviderSpec = Field(default_factory=ProviderSpec)
    image: str = "pylon:0.1.0"
    head: HeadSpec = Field(default_factory=HeadSpec)
    worker_groups: list[WorkerGroupSpec] = Field(default_factory=list)
    idle_timeout_minutes: Annotated[float, Field(gt=0)] = 5
    ha: HaSpec | None = Field(None, description="GCS fault tolerance: the head survives a GCS crash (`ha: {}` locally)")

    @model_validator(mode="after")
    def _rules(self) -> "ClusterSpec":
        problems = []
        if self.ha is not None:
            problems += [(f"ha.{p}" if p else "ha", m) for p, m in _ha_problems(self.ha, self.provider.type)]
        seen: set[str] = set()
        for i, group in enumerate(self.worker_groups):
            if group.name in seen:
                problems.append((f"worker_groups[{i}].name", f"duplicate worker group name '{group.name}'"))
            seen.add(group.name)
        if self.provider.type in ("aws", "gcp"):
            if not self.head.instance_type:
                problems.append(("head.instance_type", f"required for provider type '{self.provider.type}'"))
            for i, group in enumerate(self.worker_groups):
                if not group.instance_type:
                    problems.append(
                        (f"worker_groups[{i}].instance_type", f"required for provider type '{self.provider.type}'")
                    )
        _raise_problems(problems)
        return self

    def summary(self) -> str:
        groups = (
            ", ".join(
                f"{g.name} {g.min_workers}-{g.max_workers}x({g.cpus} CPU"
                + (f", {g.gpus} {g.gpu_type or 'GPU'}" if g.gpus else "")
                + ")"
                for g in self.worker_groups
            )
            or "no worker groups"
        )
        return f"Cluster '{self.name}': provider {self.provider.type}, head {self.head.cpus} CPU, {groups}"


def _ha_problems(ha: HaSpec, provider: str) -> list[tuple[str, str]]:
    if provider == "kubernetes":
        return [
            (name, "required for provider type 'kubernetes' (KubeRay's gcsFaultToleranceOptions)")
            for name in ("redis_address", "redis_password_secret")
            if getattr(ha, name) is None
        ]
    if provider == "local":
        return [
            (name, "not for provider type 'local': `pylon cluster up` starts its own Redis, with a new password")
            for name in ("redis_address", "redis_password_secret")
            if getattr(ha, name) is not None
        ]
    return [("", f"GCS fault tolerance runs on provider types 'local' and 'kubernetes', not '{provider}'")]


SPEC_KINDS: dict[str, type[_Spec]] = {
    "Dataset": DatasetSpec,
    "TrainJob": TrainJobSpec,
    "Deployment": DeploymentSpec,
    "BatchJob": BatchJobSpec,
    "Cluster": ClusterSpec,
}
AnySpec = Union[DatasetSpec, TrainJobSpec, DeploymentSpec, BatchJobSpec, ClusterSpec]


# ---------------------------------------------------------------------------------------------------------
# Loading YAML, with errors that point at the file, document, line and field
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecDocument:
    source: str  # file name as the user gave it
    index: int  # 1-based document number in the file
    line: int  # 1-based line where the document starts
    spec: AnySpec

    def summary(self) -> str:
        return f"{self.source}: document {self.index}: {self.spec.summary()}"


def load_specs(path: str | os.PathLike) -> list[SpecDocument]:
    """Every document of a YAML file as a validated spec, or SpecError listing every problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{source}: no such file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{source}: is a directory, not a YAML file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([f"{source}: cannot read: {e}"]) from None
    return parse_specs(text, source)


def parse_specs(text: str, source: str = "<string>") -> list[SpecDocument]:
    """Parse and validate YAML text that may hold several documents (empty documents are skipped)."""
    try:
        nodes = _compose_documents(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise SpecError([f"{where}: YAML syntax error: {problem}"]) from None
    except yaml.YAMLError as e:
        raise SpecError([f"{source}: YAML error: {e}"]) from None

    docs, problems = [], []
    if not nodes:
        raise SpecError([f"{source}: no documents (the file is empty)"])
    for index, (node, data) in enumerate(nodes, start=1):
        try:
            docs.append(SpecDocument(source, index, node.start_mark.line + 1, _validate_document(data, node)))
        except _DocumentProblems as e:
            label = f"document {index}"
            if isinstance(data, dict) and isinstance(data.get("kind"), str) and data["kind"] in SPEC_KINDS:
                name = data.get("name")
                label += f" ({data['kind']}" + (f" {_show(name)})" if isinstance(name, str) else ")")
            for line, msg in e.problems:
                problems.append(f"{source}:{line}: {label}: {msg}")
    if problems:
        raise SpecError(problems)
    return docs


def load_spec(path: str | os.PathLike, kind: type[_Spec] | None = None):
    """The one spec of `kind` in a file (handy for job entrypoints: `--config train.yaml`)."""
    docs = load_specs(path)
    if kind is not None:
        docs = [d for d in docs if isinstance(d.spec, kind)]
    if len(docs) != 1:
        want = kind.model_fields["kind"].default if kind else "spec"
        raise SpecError([f"{path}: expected exactly one {want} document, found {len(docs)}"])
    return docs[0].spec


def to_yaml(*specs: _Spec) -> str:
    """Specs back to YAML (defaults included, so the dump shows what will actually run)."""
    return yaml.safe_dump_all([s.model_dump(mode="json") for s in specs], sort_keys=False, default_flow_style=None)


class _DocumentProblems(Exception):
    def __init__(self, problems: list[tuple[int, str]]):
        self.problems = problems


def _compose_documents(text: str) -> list[tuple[yaml.Node, Any]]:
    """Documents as (node, data) pairs: nodes keep line numbers for error messages."""
    loader = yaml.SafeLoader(text)
    out = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            _reject_duplicate_keys(node)
            data = loader.construct_document(node)
            if data is None:
                continue
            out.append((node, data))
    finally:
        loader.dispose()
    return out


def _reject_duplicate_keys(node: yaml.Node, seen_nodes: set[int] | None = None) -> None:
    # PyYAML keeps the last of two equal keys silently; a spec that says a thing twice is a mistake.
    # Aliases make the node graph shared or even cyclic: visit each node once.
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key.value}'", key.start_mark)
                seen.add(key.value)
            _reject_duplicate_keys(value, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, seen_nodes)


def _validate_document(data: Any, node: yaml.Node) -> AnySpec:
    line0 = node.start_mark.line + 1
    kinds = ", ".join(SPEC_KINDS)
    if not isinstance(data, dict):
        raise _DocumentProblems([(line0, f"must be a mapping with a 'kind' ({kinds}), got {type(data).__name__}")])
    kind = data.get("kind")
    if kind is None:
        raise _DocumentProblems([(line0, f"kind: required; must be one of {kinds}")])
    if not isinstance(kind, str) or kind not in SPEC_KINDS:
        raise _DocumentProblems([(_line_of(node, ("kind",)), f"kind: must be one of {kinds} (got {_show(kind)})")])
    cls = SPEC_KINDS[kind]
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            for loc, msg in _explain(cls, err):
                problems.append((_line_of(node, loc), f"{_dotted(loc)}: {msg}" if loc else msg))
        raise _DocumentProblems(problems) from None


def spec_errors(spec_cls: type[_Spec], error: ValidationError) -> list[str]:
    """A ValidationError from constructing a spec in Python, as 'field.path: message' lines."""
    return [
        f"{_dotted(loc)}: {msg}" if loc else msg
        for err in error.errors(include_url=False)
        for loc, msg in _explain(spec_cls, err)
    ]


def _explain(cls: type[BaseModel], err: dict) -> list[tuple[tuple, str]]:
    """One pydantic error as (field path, plain message) pairs; cross-field errors may give several."""
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    given = err.get("input")
    if kind == "value_error" and isinstance(ctx.get("error"), CrossFieldError):
        return [(loc + _split_path(path), msg) for path, msg in ctx["error"].problems]
    if kind == "extra_forbidden":
        allowed = _allowed_fields(cls, loc[:-1])
        return [(loc, "unknown field" + (f"; allowed fields: {', '.join(allowed)}" if allowed else ""))]
    if kind == "missing":
        return [(loc, "required field is missing")]
    if kind in ("literal_error", "enum"):
        expected = ctx.get("expected", "")
        expected = re.sub(r"'([^']*)'", r"\1", expected).replace(" or ", ", ")
        return [(loc, f"must be one of {expected} (got {_show(given)})")]
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    elif msg.startswith("Input should be"):
        msg = "must be" + msg[len("Input should be") :] + f" (got {_show(given)})"
    return [(loc, msg[0].lower() + msg[1:] if msg else msg)]


def _allowed_fields(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model found at `loc` inside `cls` (for 'unknown field' errors)."""
    current: Any = cls
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            args = get_args(current)
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[part].annotation
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    """Optional[X] / Annotated[X, ...] -> X, so the walk above reaches the model class."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
            continue
        if origin is Union or origin is types.UnionType:
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _line_of(node: yaml.Node, loc: tuple) -> int:
    """The line of the deepest YAML node the field path reaches (the key's line for mapping entries)."""
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _split_path(path: str) -> tuple:
    """'worker_groups[1].name' -> ('worker_groups', 1, 'name')."""
    out: list[Any] = []
    for piece in path.split("."):
        for m in re.finditer(r"([^\[\]]+)|\[(\d+)\]", piece):
            out.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
    return tuple(out)


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    """A short, safe rendering of a user value for an error message."""
    if isinstance(value, (dict, list)):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
