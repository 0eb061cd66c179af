"""`grpo.sampler: engine`: a training worker samples its completions through Pylon's serving engine, colocated.

TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"`: each worker holds a serving engine (paged KV cache,
continuous batching, prefix cache) beside the model it trains, on the same device, and before each sampling step
copies the policy's current weights into it (`sync`, vLLM's `load_weights`): LoRA adapters merged into their base
weights, ZeRO-3's partitions gathered a module at a time. What that buys over the model sampling itself
(`grpo.sample_completions`): a group's prompt is computed once and its copies read its keys and values from the
prefix cache (the model computes it once per copy), a completion that ended stops computing (the model's batch runs
until its last row ends, padding the rest), and no row computes the left padding of a shorter prompt.

The engine samples with each completion's own seeded random stream (`SamplingParams.seed`), so a resumed run samples
what the uninterrupted one did; its draws are not the model sampler's (another stream), though from the same
distribution: the same temperature, top_k, top_p, min_p and repetition penalty. The loss's log-probabilities are the
training model's own, as before: the engine only picks the tokens (TRL's colocated vLLM likewise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pylon.errors import PylonError

log = logging.getLogger(__name__)


def full_weights(module) -> Iterator[tuple[str, object]]:
    """The weights of `module` (a `*ForCausalLM`, a peft model of one, or DeepSpeed's engine's module) as its
    checkpoint names them, one tensor at a time: a LoRA layer's base weight with its adapters' product added (peft's
    merge, computed apart: the trained module is left as it is), at ZeRO-3 each module's partitions gathered while
    its tensors are read (every rank must call this together). A tensor is valid until the next one is asked for."""
    import deepspeed
    import torch

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # (peft is a dependency; a model without adapters needs none of it)
        LoraLayer = ()

    def walk(prefix: str, m) -> Iterator[tuple[str, object]]:
        if LoraLayer and isinstance(m, LoraLayer):
            layer = m.get_base_layer()
            with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=None), torch.no_grad():
                weight = layer.weight.detach()
                for adapter in m.active_adapters:
                    if adapter in m.lora_A or adapter in getattr(m, "lora_embedding_A", {}):
                        if adapter not in m.merged_adapters:
                            weight = weight + m.get_delta_weight(adapter).to(weight.dtype)
                yield f"{prefix}weight", weight
                if getattr(layer, "bias", None) is not None:
                    yield f"{prefix}bias", layer.bias.detach()
            return
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        if own:
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                for name, p in own:
                    yield f"{prefix}{name}", p.detach()
        for name, child in m.named_children():
            yield from walk(f"{prefix}{name}.", child)

    seen: set[int] = set()  # parameters given already: a tied one (lm_head = embed_tokens) is given once
    yield from walk("", base)


def check_sampler(spec, manifest) -> None:
    """`grpo.sampler: engine`, before workers start: a PylonError naming it where the serving engine cannot sample
    the model or could not take its weights as it trains (a model type it does not serve; experts, latent attention
    or a multimodal checkpoint, whose weights it reshapes at load)."""
    from pylon.models import model_config
    from pylon.serving.model.families import SUPPORTED_MODEL_TYPES, reshaped_at_load, unsupported

    tok = manifest.tokenizer
    config = model_config(spec.model, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    kind = config.model_type
    reshaped = reshaped_at_load(kind)
    why = (
        f"the serving engine does not run model_type {kind!r} (it runs {', '.join(SUPPORTED_MODEL_TYPES)})"
        if kind not in SUPPORTED_MODEL_TYPES
        else f"model_type {kind!r}'s weights are reshaped when the engine loads them ({reshaped}), so it cannot take "
        "the policy's as it trains"
        if reshaped is not None
        else unsupported(config)
    )
    if why is not None:
        raise PylonError(f"grpo.sampler: engine: {why}; use grpo.sampler: model ({spec.model.describe()})")


def _row_seed(seed: int, row: int) -> int:
    return int.from_bytes(hashlib.sha256(f"rollout/{seed}/{row}".encode()).digest()[:8], "little") >> 1


class RolloutEngine:
    """A serving engine beside a training worker's model (`grpo.sampler: engine`): built from the model's weights as
    they are when it is made, given the policy's again by `sync`, sampling with `sample`."""

    def __init__(self, trainer, tokenizer: dict, *, spec, device, seq_len: int) -> None:
        """`trainer`: DeepSpeed's engine of the trained model (its module: see `full_weights`), or the module itself;
        `tokenizer`: the dataset's tokenizer identity (`TokenizerInfo` as a dict); `spec`: the TrainJobSpec (its grpo
        block's sampler settings, its precision); `device`: the worker's; `seq_len`: the dataset's row length (a
        prompt's length at most). The engine loads the model from a checkpoint of its current weights written once
        to a private temporary directory (in the engine's dtype), removed as soon as it is loaded."""
        from pylon.jobs.export import TOKENIZER_FILE, write_tokenizer_files
        from pylon.serving.engine.engine import LLMEngine
        from pylon.specs import EngineSpec, sampler_kv_cache_tokens

        g = spec.grpo
        self.eos_id = int(tokenizer["eos_id"])
        self.block_size = 16
        max_model_len = seq_len + g.max_completion_tokens
        kv_tokens = sampler_kv_cache_tokens(spec, seq_len)
        kv_tokens = max(kv_tokens, max_model_len + self.block_size)
        on_gpu = getattr(device, "type", str(device)) == "cuda"
        dtype = {"bf16": "bf16", "fp16": "fp16"}.get(spec.precision, "fp32") if on_gpu else "fp32"
        self.spec = EngineSpec(
            max_num_seqs=g.sampler_max_num_seqs,
            max_num_batched_tokens=max(2048, max_model_len),
            kv_cache_tokens=-(-kv_tokens // self.block_size) * self.block_size,
            block_size=self.block_size,
            max_model_len=max_model_len,
            device="cuda" if on_gpu else "cpu",
            dtype=dtype,
            enable_prefix_caching=True,
            generation_config="none",
        )
        started = time.perf_counter()
        directory = tempfile.mkdtemp(prefix="pylon-rollout-")
        try:
            self._write_model(getattr(trainer, "module", trainer), directory, dtype)
            Path(directory, TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2) + "\n")
            write_tokenizer_files(tokenizer, directory, None)
            try:
                self.engine = LLMEngine(directory, self.spec)
            except PylonError as e:
                raise PylonError(f"grpo.sampler: engine: the serving engine cannot sample this model: {e}") from e
            why = self.engine.runner.fixed_weights()
            if why is not None:
                raise PylonError(
                    f"grpo.sampler: engine: the serving engine could not take the policy's weights as it trains "
                    f"({why}); use grpo.sampler: model"
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.computed_tokens = 0  # tokens the engine's forward passes computed: prompts (less cache hits) and samples
        self.cached_tokens = 0  # prompt tokens read from its prefix cache instead
        self.sync_s, self.syncs = 0.0, 0
        self.last_logprobs: list[np.ndarray] | None = None  # `sample(logprobs=True)`'s, per completion
        self._weights_step = getattr(trainer, "global_steps", None) if trainer is not None else None
        log.info(
            "grpo.sampler: engine: a serving engine beside this worker's model (%s, %s, %d KV tokens) in %.1f s",
            self.spec.device,
            self.spec.dtype,
            self.spec.kv_cache_tokens,
            time.perf_counter() - started,
        )

    @staticmethod
    def _write_model(module, directory: str, dtype: str) -> None:
        """The model as a checkpoint the engine loads: its config and its current (merged, gathered) weights, in
        `dtype` (the engine's)."""
        import torch
        from safetensors.torch import save_file

        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        config = base.config.to_dict()
        config["use_cache"] = True
        tensors = {  # (a tied weight is given once, and tied again at load)
            name: tensor.to("cpu", torch_dtype).contiguous().clone() for name, tensor in full_weights(module)
        }
        head = base.get_output_embeddings()
        head_name = next((f"{n}.weight" for n, m in base.named_modules() if m is head), None)
        if config.get("tie_word_embeddings") and head_name in tensors:
            # tied, with a LoRA adapter on the output layer: the trained model reads its embeddings without the
            # adapter and its logits with it, two weights the engine keeps apart
            config["tie_word_embeddings"] = False
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    def sync(self, module) -> None:
        """The policy's current weights into the engine (every rank together at ZeRO-3: gathers are collective)."""
        started = time.perf_counter()
        self.engine.load_weights(full_weights(module))
        self.syncs += 1
        self.sync_s += time.perf_counter() - started

    def current(self, trainer) -> None:
        """The engine given the weights of DeepSpeed's `trainer` unless it has them already: once per optimizer step
        that changed them (`global_steps`), before the step's first sampling or an evaluation after it. Every rank
        calls it at the same points (a sampling step, an evaluation), so ZeRO-3's gathers meet."""
        step = getattr(trainer, "global_steps", None)
        if step is None or step != self._weights_step:
            self.sync(getattr(trainer, "module", trainer))
            self._weights_step = step

    def sample(
        self,
        prompts: list[np.ndarray],
        loss,
        *,
        seed: int,
        greedy: bool = False,
        copies: int | None = None,
        logprobs: bool = False,
    ):
        """`copies` (default `loss.generations`) completions of each prompt, the copies of a prompt consecutive,
        each up to and including its eos or `loss.max_tokens` tokens without one: `grpo.sample_completions`'
        result, sampled by the engine. Each prompt's first copy goes first; once its prompt is computed (and in
        the prefix cache) the others follow and read its full blocks from there. `logprobs`: `last_logprobs` holds
        each completion's tokens' log-probabilities under the distributions they were drawn from (the engine's
        processed logprobs: after temperature, top-k, min-p, top-p and the repetition penalty)."""
        from pylon.serving.engine.sampling import SamplingParams

        copies = loss.generations if copies is None else copies
        engine = self.engine
        before = engine.stats()

        def params(row: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=loss.max_tokens,
                temperature=0.0 if greedy else loss.temperature,
                top_p=1.0 if greedy else loss.top_p,
                top_k=0 if greedy else loss.top_k,
                min_p=0.0 if greedy else loss.min_p,
                repetition_penalty=1.0 if greedy else loss.repetition_penalty,
                seed=_row_seed(seed, row),
                ignore_eos=True,  # only the training tokenizer's eos ends a completion, as the model sampler's
                stop_token_ids=[self.eos_id],
                logprobs=0 if logprobs else None,
                logprobs_mode="processed",
            )

        rows = len(prompts) * copies
        tokens: dict[str, list[int]] = {str(r): [] for r in range(rows)}
        drawn: dict[str, list[float]] = {str(r): [] for r in range(rows)}
        first = [i * copies for i in range(len(prompts))]
        for r in first:
            engine.add_request(str(r), [int(t) for t in prompts[r // copies]], params(r))
        waiting = set(map(str, first))  # first copies whose prompt is not computed yet
        rest = [r for r in range(rows) if r % copies]
        while engine.has_unfinished() or rest:
            if rest and not waiting:
                for r in rest:
                    engine.add_request(str(r), [int(t) for t in prompts[r // copies]], params(r))
                rest = []
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
                if out.logprobs:
                    drawn[out.request_id].extend(lp.logprob for lp in out.logprobs)
                waiting.discard(out.request_id)
        after = engine.stats()
        self.cached_tokens += after.prefix_cache_hits_total - before.prefix_cache_hits_total
        self.computed_tokens += (after.prefill_tokens_computed_total - before.prefill_tokens_computed_total) + (
            after.generation_tokens_total - before.generation_tokens_total
        )
        self.last_logprobs = (
            [np.asarray(drawn[str(r)][: loss.max_tokens], dtype=np.float32) for r in range(rows)] if logprobs else None
        )
        return [np.asarray(tokens[str(r)][: loss.max_tokens], dtype=np.int64) for r in range(rows)]
