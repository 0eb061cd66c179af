"""`grpo.sampler: engine`: a training worker samples its completions through Pylon's serving engine, colocated;
`grpo.sampler: server`: through that engine in sampling servers of their own (`SamplingServer`, `RemoteRollout`).

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
    """`grpo.sampler: engine` or `server`, before workers start: a PylonError naming it where the serving engine
    cannot sample the model or could not take its weights as it trains (a model type it does not serve; experts,
    latent attention or a multimodal checkpoint, whose weights it reshapes at load)."""
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
        raise PylonError(f"grpo.sampler: {spec.grpo.sampler}: {why}; use grpo.sampler: model ({spec.model.describe()})")


def _row_seed(seed: int, row: int) -> int:
    return int.from_bytes(hashlib.sha256(f"rollout/{seed}/{row}".encode()).digest()[:8], "little") >> 1


def engine_spec(spec, seq_len: int, *, on_gpu: bool):
    """The serving engine's settings for sampling `spec`'s completions of prompts of up to `seq_len` tokens
    (`grpo.sampler: engine` and `server` alike): on a GPU in the training precision, else in fp32."""
    from pylon.specs import EngineSpec, sampler_kv_cache_tokens

    g = spec.grpo
    block_size = 16
    max_model_len = seq_len + g.max_completion_tokens
    kv_tokens = max(sampler_kv_cache_tokens(spec, seq_len), max_model_len + block_size)
    dtype = {"bf16": "bf16", "fp16": "fp16"}.get(spec.precision, "fp32") if on_gpu else "fp32"
    return EngineSpec(
        max_num_seqs=g.sampler_max_num_seqs,
        max_num_batched_tokens=max(2048, max_model_len),
        kv_cache_tokens=-(-kv_tokens // block_size) * block_size,
        block_size=block_size,
        max_model_len=max_model_len,
        device="cuda" if on_gpu else "cpu",
        dtype=dtype,
        enable_prefix_caching=True,
        generation_config="none",
    )


def _torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)


def policy_tensors(module, dtype: str) -> dict:
    """The policy's current weights (`full_weights`: LoRA merged, ZeRO-3 gathered: every rank calls this together)
    as CPU tensors in `dtype` (the engine's), named as its checkpoint names them."""
    torch_dtype = _torch_dtype(dtype)
    return {name: tensor.to("cpu", torch_dtype).contiguous().clone() for name, tensor in full_weights(module)}


def policy_config(module, names) -> dict:
    """The trained model's config as the engine loads it, given the `names` of the weights it gets (a tied weight is
    given once, and tied again at load)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = base.config.to_dict()
    config["use_cache"] = True
    head = base.get_output_embeddings()
    head_name = next((f"{n}.weight" for n, m in base.named_modules() if m is head), None)
    if config.get("tie_word_embeddings") and head_name in names:
        # tied, with a LoRA adapter on the output layer: the trained model reads its embeddings without the
        # adapter and its logits with it, two weights the engine keeps apart
        config["tie_word_embeddings"] = False
    return config


def build_engine(config: dict, tensors, tokenizer: dict, spec):
    """An `LLMEngine` (EngineSpec `spec`) of the model `config` with the weights `tensors` ((name, tensor) pairs or a
    dict), loaded from a checkpoint written to a private temporary directory, removed once it is loaded; a PylonError
    naming grpo.sampler where the engine cannot sample the model or could not take its weights again."""
    from safetensors.torch import save_file

    from pylon.jobs.export import TOKENIZER_FILE, write_tokenizer_files
    from pylon.serving.engine.engine import LLMEngine

    directory = tempfile.mkdtemp(prefix="pylon-rollout-")
    try:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        save_file(dict(tensors), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        Path(directory, TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2) + "\n")
        write_tokenizer_files(tokenizer, directory, None)
        try:
            engine = LLMEngine(directory, spec)
        except PylonError as e:
            raise PylonError(f"grpo.sampler: the serving engine cannot sample this model: {e}") from e
        why = engine.runner.fixed_weights()
        if why is not None:
            raise PylonError(
                f"grpo.sampler: the serving engine could not take the policy's weights as it trains ({why}); use "
                "grpo.sampler: model"
            )
        return engine
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def sampling_fields(loss, eos_id: int, seed: int, row: int, *, greedy: bool = False, logprobs: bool = False) -> dict:
    """`SamplingParams`' fields for completion `row` of a micro-batch sampled with `seed` under `loss`'s settings
    (a `GrpoLoss`): its own seeded random stream, up to and including the training tokenizer's eos."""
    return {
        "max_tokens": loss.max_tokens,
        "temperature": 0.0 if greedy else loss.temperature,
        "top_p": 1.0 if greedy else loss.top_p,
        "top_k": 0 if greedy else loss.top_k,
        "min_p": 0.0 if greedy else loss.min_p,
        "repetition_penalty": 1.0 if greedy else loss.repetition_penalty,
        "seed": _row_seed(seed, row),
        "ignore_eos": True,  # only the training tokenizer's eos ends a completion, as the model sampler's
        "stop_token_ids": [eos_id],
        "logprobs": 0 if logprobs else None,
        "logprobs_mode": "processed",
    }


class RolloutEngine:
    """A serving engine beside a training worker's model (`grpo.sampler: engine`): built from the model's weights as
    they are when it is made, given the policy's again by `sync`, sampling with `sample`."""

    def __init__(self, trainer, tokenizer: dict, *, spec, device, seq_len: int) -> None:
        """`trainer`: DeepSpeed's engine of the trained model (its module: see `full_weights`), or the module itself;
        `tokenizer`: the dataset's tokenizer identity (`TokenizerInfo` as a dict); `spec`: the TrainJobSpec (its grpo
        block's sampler settings, its precision); `device`: the worker's; `seq_len`: the dataset's row length (a
        prompt's length at most). The engine loads the model from a checkpoint of its current weights written once
        to a private temporary directory (in the engine's dtype), removed as soon as it is loaded."""
        self.eos_id = int(tokenizer["eos_id"])
        self.spec = engine_spec(spec, seq_len, on_gpu=getattr(device, "type", str(device)) == "cuda")
        started = time.perf_counter()
        module = getattr(trainer, "module", trainer)
        tensors = policy_tensors(module, self.spec.dtype)
        self.engine = build_engine(policy_config(module, tensors), tensors, tokenizer, self.spec)
        del tensors
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
        result, sampled by the engine (`sample_rows`). `logprobs`: `last_logprobs` holds each completion's tokens'
        log-probabilities under the distributions they were drawn from (the engine's processed logprobs: after
        temperature, top-k, min-p, top-p and the repetition penalty)."""
        copies = loss.generations if copies is None else copies
        rows = worker_rows(prompts, loss, self.eos_id, seed, copies=copies, greedy=greedy, logprobs=logprobs)
        got = sample_rows(self.engine, rows, copies)
        self.cached_tokens += got["cached"]
        self.computed_tokens += got["computed"]
        return _completions(self, got, loss, logprobs)


def worker_rows(prompts, loss, eos_id: int, seed: int, *, copies: int, greedy: bool = False, logprobs: bool = False):
    """A worker's rows to sample: `copies` of each prompt, consecutive, as (prompt token ids, SamplingParams
    fields), each row with its own seeded stream (`sampling_fields`)."""
    return [
        (
            [int(t) for t in prompts[r // copies]],
            sampling_fields(loss, eos_id, seed, r, greedy=greedy, logprobs=logprobs),
        )
        for r in range(len(prompts) * copies)
    ]


def sample_rows(engine, rows: list, copies: int) -> dict:
    """Sample `rows` ((prompt token ids, SamplingParams fields) each, each prompt's `copies` consecutive) on the
    `LLMEngine` `engine`, stepping it to the end: each prompt's first copy first; once every first copy's prompt is
    computed (and in the prefix cache) the others follow and read its full blocks from there. The same rows in the
    same order take the same steps every time (what a resumed run relies on). Returns each row's `tokens` and
    `logprobs` (with the fields' logprobs), and the tokens its forward passes `computed` (prompts less prefix-cache
    hits, and each sampled token) and read from the prefix cache (`cached`)."""
    from pylon.serving.engine.sampling import SamplingParams

    before = engine.stats()
    copies = max(1, copies)
    n = len(rows)
    tokens: dict[str, list[int]] = {str(r): [] for r in range(n)}
    drawn: dict[str, list[float]] = {str(r): [] for r in range(n)}
    last = {}  # each row's last output: its counts
    first = list(range(0, n, copies))
    for r in first:
        engine.add_request(str(r), rows[r][0], SamplingParams(**rows[r][1]))
    waiting = set(map(str, first))  # first copies whose prompt is not computed yet
    rest = [r for r in range(n) if r % copies]
    while engine.has_unfinished() or rest:
        if rest and not waiting:
            for r in rest:
                engine.add_request(str(r), rows[r][0], SamplingParams(**rows[r][1]))
            rest = []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.logprobs:
                drawn[out.request_id].extend(lp.logprob for lp in out.logprobs)
            waiting.discard(out.request_id)
            last[out.request_id] = out
    after = engine.stats()
    return {
        "tokens": [tokens[str(r)] for r in range(n)],
        "logprobs": [drawn[str(r)] for r in range(n)],
        # each row's share: its prompt's tokens not read from the cache, and its own
        "row_computed": [
            o.num_prompt_tokens - o.num_cached_tokens + o.num_output_tokens if (o := last.get(str(r))) else 0
            for r in range(n)
        ],
        "row_cached": [o.num_cached_tokens if (o := last.get(str(r))) else 0 for r in range(n)],
        "cached": after.prefix_cache_hits_total - before.prefix_cache_hits_total,
        "computed": (after.prefill_tokens_computed_total - before.prefill_tokens_computed_total)
        + (after.generation_tokens_total - before.generation_tokens_total),
    }


def _completions(rollout, got: dict, loss, logprobs: bool) -> list[np.ndarray]:
    """`sample_rows`' result as `grpo.sample_completions` returns completions (each cut at `loss.max_tokens`), the
    logprobs in `rollout.last_logprobs`."""
    rollout.last_logprobs = (
        [np.asarray(lp[: loss.max_tokens], dtype=np.float32) for lp in got["logprobs"]] if logprobs else None
    )
    return [np.asarray(t[: loss.max_tokens], dtype=np.int64) for t in got["tokens"]]


# grpo.sampler: server. The engine in Ray actors of their own (TRL's `vllm_mode="server"`): the workers keep no engine
# beside the model. Before each sampling step the first worker sends the policy's weights through Ray's object store
# to every server; at each sampling it gathers every worker's rows (a collective), sends each server the rows of the
# workers it serves (worker r: server r mod sampler_servers) in one call, in rank order, and hands each worker its
# completions back (TRL's server mode likewise gathers the prompts to the main process). One call a server a step, its
# rows in a fixed order, sampled as the colocated engine samples (`sample_rows`): the same steps every time, so a
# resumed run samples exactly what the uninterrupted one did, and the workers' rows share the server's batches.

CHUNK_BYTES = 64 << 20  # weights sent in objects of about this size: the sender's store holds them until all loaded


class SamplingServer:
    """A sampling server (`grpo.sampler: server`): a serving engine, built when the first weights arrive and given
    each later version in place, sampling the rows it is sent. Run as a Ray actor (`start_servers`), or directly (the
    unit tests). Every call names the version of the weights it was made for (a token the first worker draws for
    each sync): rows for another version are refused, naming both (a server that restarted has none)."""

    def __init__(self, name: str = "sampler") -> None:
        import asyncio

        self.name = name
        self.engine = None  # LLMEngine, from the first weights
        self.version: str | None = None
        self._busy = asyncio.Lock()  # one load or sampling at a time; `stats` and `ready` answer meanwhile
        self.loads, self.load_s = 0, 0.0

    async def ready(self) -> dict:
        """Where this server runs: its node and process (for the job's log and the tests)."""
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"name": self.name, "node_id": node, "pid": os.getpid()}

    async def current_version(self) -> str | None:
        """The version of the weights it holds (None: none yet; a restarted server has none)."""
        return self.version

    async def load(self, version: str, config: dict, tokenizer: dict, spec: dict, chunks: list) -> dict:
        """Take the policy's weights `version`: `chunks`, lists of (name, tensor) pairs (or Ray object refs of them,
        fetched one at a time as they are read); the engine built from them first where this server has none yet
        (`config`, `tokenizer` and the EngineSpec `spec` as a dict)."""
        import asyncio

        from pylon.specs import EngineSpec

        async with self._busy:
            started = time.perf_counter()
            self.version = None  # (until every weight is in)
            if self.engine is None:
                tensors = dict(_pairs(chunks))
                self.engine = await asyncio.to_thread(
                    build_engine, config, tensors, tokenizer, EngineSpec.model_validate(spec)
                )
                del tensors
            else:
                await asyncio.to_thread(self.engine.load_weights, _pairs(chunks))
            self.version = version
            self.loads += 1
            self.load_s += time.perf_counter() - started
            return {"version": version, "seconds": time.perf_counter() - started}

    async def sample(self, version: str, rows: list, copies: int) -> dict:
        """`sample_rows(rows, copies)` on its engine, with the weights `version`."""
        import asyncio

        async with self._busy:
            if self.version != version or self.engine is None:
                raise PylonError(
                    f"grpo.sampler server {self.name}: rows for weights {version} but the server holds "
                    f"{self.version or 'none'} (a server that restarted lost its weights: the next step sends them)"
                )
            return await asyncio.to_thread(sample_rows, self.engine, rows, copies)

    async def stats(self) -> dict:
        """Its loads so far and what its engine computed (the job's log, the tests, the bench)."""
        engine_stats = self.engine.stats() if self.engine is not None else None
        return {
            "name": self.name,
            "version": self.version,
            "loads": self.loads,
            "load_s": self.load_s,
            "generation_tokens_total": engine_stats.generation_tokens_total if engine_stats else 0,
            "prefix_cache_hits_total": engine_stats.prefix_cache_hits_total if engine_stats else 0,
            "forward_passes_total": engine_stats.forward_passes_total if engine_stats else 0,
            "cpu_s": time.process_time(),  # the server process's CPU-seconds so far
        }


def _pairs(chunks: list) -> Iterator[tuple[str, object]]:
    """The (name, tensor) pairs of `chunks`, each chunk a list of them or a Ray object ref of one (fetched when its
    turn comes, and let go after)."""
    for chunk in chunks:
        if not isinstance(chunk, list):
            import ray

            chunk = ray.get(chunk)
        yield from chunk


def put_weights(module, dtype: str) -> tuple[list, list[str], int]:
    """The policy's current weights (`full_weights`: every rank calls this together at ZeRO-3) put in Ray's object
    store as CPU tensors in `dtype`, in objects of about CHUNK_BYTES, one tensor at a time (never the whole model
    twice in this process): (the objects' refs, the weights' names, their bytes). What a server's `load` takes."""
    import ray

    torch_dtype = _torch_dtype(dtype)
    refs, chunk, size, total, names = [], [], 0, 0, []
    for name, tensor in full_weights(module):
        t = tensor.to("cpu", torch_dtype).contiguous().clone()
        chunk.append((name, t))
        names.append(name)
        size += t.numel() * t.element_size()
        if size >= CHUNK_BYTES:
            refs.append(ray.put(chunk))
            total, chunk, size = total + size, [], 0
    if chunk:
        refs.append(ray.put(chunk))
        total += size
    return refs, names, total


def server_names(session: str, count: int) -> list[str]:
    """The Ray actor names of a run's `count` sampling servers (`session`: the run's submission, unique)."""
    return [f"pylon-sampler-{session}-{i}" for i in range(count)]


def start_servers(spec, session: str, *, say=print) -> list:
    """The run's sampling servers (`grpo.sampler: server`), started on the connected cluster as Ray actors named
    `server_names(session, ...)` in this driver's namespace, each holding `grpo.sampler_resources`; returns their
    handles once each is placed (while the cluster has no room, `say` tells every 30 s what they wait for). They
    live as long as this driver (or `stop_servers`)."""
    import ray

    g = spec.grpo
    resources = dict(g.sampler_resources)
    options = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources,
        "max_restarts": 3,  # a server that died comes back without weights: the first worker sends them again
        "max_concurrency": 1000,  # (an async actor: every worker's rows at once)
    }
    if g.sampler_labels:
        options["label_selector"] = dict(g.sampler_labels)
    namespace = ray.get_runtime_context().namespace
    names = server_names(session, g.sampler_servers)
    actor = ray.remote(SamplingServer)
    handles = [actor.options(name=name, namespace=namespace, **options).remote(name) for name in names]
    pending = {h.ready.remote(): h for h in handles}
    started = time.monotonic()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=30)
        for ref in done:
            where = ray.get(ref)
            pending.pop(ref)
            say(f"grpo.sampler server: {where['name']} is up (node {str(where['node_id'])[:12]}, pid {where['pid']})")
        if pending:
            say(
                f"grpo.sampler server: waiting {time.monotonic() - started:.0f} s for room for {len(pending)} sampling "
                f"server(s) of {_wants(g)}: free or add such a node (an autoscaling cluster adds one itself)"
            )
    return handles


def _wants(g) -> str:
    """What a sampling server asks of a node, as the spec says it."""
    wants = f"{dict(g.sampler_resources)} (grpo.sampler_resources)"
    if g.sampler_labels:
        wants += f" on a node labelled {dict(g.sampler_labels)} (grpo.sampler_labels)"
    return wants


def stop_servers(handles: list, *, say=None) -> None:
    """Stop the run's sampling servers; `say`: first tell what each did (its weight loads and the tokens it
    generated), as far as it still answers."""
    import ray

    if say is not None:
        for handle in handles:
            try:
                got = ray.get(handle.stats.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - a server that is gone has nothing to tell
                say(f"grpo.sampler server: a server did not answer ({type(e).__name__})")
                continue
            say(
                f"grpo.sampler server: {got['name']} took {got['loads']} weight loads ({got['load_s']:.1f} s) and "
                f"generated {got['generation_tokens_total']:,} tokens ({got['prefix_cache_hits_total']:,} prompt "
                "tokens read from its prefix cache)"
            )
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass


class RemoteRollout:
    """A training worker's side of `grpo.sampler: server`: what `RolloutEngine` offers (`current`, `sample`, the
    counts), its engine in the sampling servers. `servers`: the names of the run's servers (`server_names`), found in
    `namespace`; worker `rank` of `world`'s rows are sampled on server rank mod len(servers); rank 0 sends every
    server the weights and the rows, and hands the completions back."""

    def __init__(
        self, tokenizer: dict, *, spec, seq_len: int, servers: list[str], namespace: str, rank: int, world: int
    ) -> None:
        import ray

        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer["eos_id"])
        on_gpu = spec.grpo.sampler_resources.get("GPU", 0) > 0
        self.spec = engine_spec(spec, seq_len, on_gpu=on_gpu)
        self.rank, self.world = rank, world
        self.servers = [ray.get_actor(name, namespace=namespace) for name in servers] if rank == 0 else []
        self.stage3 = spec.deepspeed.zero_stage == 3
        self.computed_tokens = 0
        self.cached_tokens = 0
        self.sync_s, self.syncs = 0.0, 0
        self.last_logprobs: list[np.ndarray] | None = None
        self.version: str | None = None  # the weights this worker's rows ask for
        self._weights_step = None  # the trainer's step those are (None: none sent yet: sync at the first sampling)

    def current(self, trainer) -> None:
        """The servers given the weights of DeepSpeed's `trainer` unless they have them already: once per optimizer
        step that changed them, and again where a server restarted since (it lost them). Every rank calls this at
        the same points; rank 0 decides and tells the others (a collective), and at ZeRO-3 all gather together."""
        import ray

        step = getattr(trainer, "global_steps", None)
        version = None
        if self.rank == 0:
            stale = step is None or step != self._weights_step or self.version is None
            if not stale:
                held = ray.get([s.current_version.remote() for s in self.servers])
                stale = any(v != self.version for v in held)
            if stale:
                import uuid

                version = uuid.uuid4().hex
        version = _from_rank0(version, self.world)
        if version is not None:
            self.sync(getattr(trainer, "module", trainer), version)
            self._weights_step = step

    def sync(self, module, version: str) -> None:
        """Send the policy's current weights to every server as `version` (rank 0, until every server has taken
        them; at ZeRO-3 every rank gathers with it)."""
        import ray

        started = time.perf_counter()
        self.version = version
        if self.rank != 0:
            if self.stage3:  # the gathers are collective: take part, keep nothing
                for _ in full_weights(module):
                    pass
            self.syncs += 1
            return
        refs, names, total = put_weights(module, self.spec.dtype)
        config = policy_config(module, names)
        spec = self.spec.model_dump(mode="json")
        try:
            ray.get([s.load.remote(version, config, self.tokenizer, spec, refs) for s in self.servers])
        except ray.exceptions.RayActorError as e:
            raise PylonError(
                f"grpo.sampler server: a server stopped while taking the weights ({type(e).__name__}); the run "
                "resumes from its last checkpoint, and the restarted server is sent the weights again"
            ) from e
        del refs
        if not self.syncs:
            print(
                f"grpo.sampler server: the weights ({total / 2**20:.1f} MiB, {self.spec.dtype}) sent to "
                f"{len(self.servers)} server(s) in {time.perf_counter() - started:.2f} s through the object store",
                flush=True,
            )
        self.syncs += 1
        self.sync_s += time.perf_counter() - started

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
        """`RolloutEngine.sample`, on the servers: every rank calls it together; rank 0 gathers every rank's rows
        (the same seeded streams as beside a worker), sends each server its workers' rows in rank order in one call,
        and every rank gets its own completions back."""
        import ray

        copies = loss.generations if copies is None else copies
        mine = worker_rows(prompts, loss, self.eos_id, seed, copies=copies, greedy=greedy, logprobs=logprobs)
        everyone = _to_rank0(mine, self.world)
        answers = None
        if self.rank == 0:
            n = len(self.servers)
            calls = [
                self.servers[k].sample.remote(
                    self.version, [row for r in range(k, self.world, n) for row in everyone[r]], copies
                )
                for k in range(n)
            ]
            try:
                got = ray.get(calls)
            except ray.exceptions.RayActorError as e:
                raise PylonError(
                    f"grpo.sampler server: a server stopped while sampling ({type(e).__name__}); the run resumes from "
                    "its last checkpoint, and the restarted server is sent the weights again"
                ) from e
            answers = [None] * self.world
            for k, result in enumerate(got):
                start = 0
                for r in range(k, self.world, n):  # each rank's rows back, in the order they were sent
                    end = start + len(everyone[r])
                    answers[r] = {
                        "tokens": result["tokens"][start:end],
                        "logprobs": result["logprobs"][start:end],
                        "computed": sum(result["row_computed"][start:end]),  # what its own rows cost there
                        "cached": sum(result["row_cached"][start:end]),
                    }
                    start = end
        got = _from_rank0(answers, self.world)[self.rank]
        self.computed_tokens += got["computed"]
        self.cached_tokens += got["cached"]
        return _completions(self, got, loss, logprobs)


def _to_rank0(value, world: int) -> list:
    """Every rank's `value`, in rank order, on rank 0 (elsewhere None); a collective (every rank calls it together)."""
    if world <= 1:
        return [value]
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [value]
    everyone = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone


def _from_rank0(value, world: int):
    """`value` as rank 0 has it, on every rank (a collective: every rank calls it together)."""
    if world <= 1:
        return value
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
