"""The engine: requests in, streamed outputs back, one `step()` at a time.

    engine = LLMEngine("s3://bucket/runs/stdlib-gpt/export/", EngineSpec(max_num_seqs=32))
    engine.add_request("r1", "def main(", SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.text, out.finish_reason)

A step is: take in new requests and aborts, let the `Scheduler` pick the step's tokens, let the
`ModelRunner` compute them, sample, then detokenize and check stop conditions. `AsyncLLMEngine` runs that
loop on a thread of its own and streams each request's outputs to an asyncio consumer.

`add_request` and `abort` may be called from any thread: they only queue work that the next step takes in.
Everything else belongs to the thread that calls `step()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pylon.errors import PylonError
from pylon.models import local_model_dir
from pylon.serving.engine import kv_transfer
from pylon.serving.engine.adapters import OnDemandAdapters, named_adapter_error, spec_adapter_dirs
from pylon.serving.engine.draft import DraftModel, DraftRequest
from pylon.serving.engine.generation import GenerationConfig, read_generation_config
from pylon.serving.engine.guided import Guides
from pylon.serving.engine.images import ImageInputs, ImageProcessor, ImagePrompt
from pylon.serving.engine.kv_cache import HybridKVBlockPool, KVBlockPool, StateSnapshots, cache_salt
from pylon.serving.engine.mtp import Computed, MtpDrafter
from pylon.serving.engine.pooling import read_classifier
from pylon.serving.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from pylon.serving.engine.sampling import (
    POOL_TASK_NAMES,
    SamplingParams,
    filtered_probs,
    sample,
    shape_logits,
    token_logprobs,
)
from pylon.serving.engine.scheduler import Scheduler
from pylon.serving.engine.speculative import (
    SpecPolicy,
    chain_length,
    ngram_propose,
    ngram_tree,
    verify,
    verify_tree,
)
from pylon.serving.engine.suffix import SuffixDecoding
from pylon.serving.engine.tokenization import (
    IncrementalDetokenizer,
    bad_words_ids,
    chars_per_token_bound,
    load_model_tokenizer,
    prompt_ids,
    special_token_ids,
)
from pylon.serving.errors import EngineDeadError, InvalidRequest, RequestFailed
from pylon.serving.model.families import ENCODER_MODEL_TYPES, recurrent_state_bytes
from pylon.serving.model.step import StepSequence
from pylon.specs import EAGLE_METHODS, HEAD_METHODS, EngineSpec

log = logging.getLogger(__name__)

# A model whose windowed layers mix with full ones keeps its KV cache in groups of layers, each with its own block table
# (kv_cache.HybridKVBlockPool, ModelRunner.kv_groups); False: one table for every layer, a sequence holding its whole
# context's blocks in every layer (what the engine did before: bench/serve_hybrid_kv.py's baseline).
HYBRID_KV_CACHE = True

Prompt = str | Sequence[int] | ImagePrompt  # text, token ids already, or a chat prompt with images


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_utilization: float  # fraction of KV blocks held by requests
    num_free_blocks: int
    num_blocks: int
    prompt_tokens_total: int  # prompt tokens of requests that produced a first token
    generation_tokens_total: int
    num_preemptions_total: int
    requests_finished_total: dict[str, int]  # by finish reason
    # Prefix caching, in tokens: looked up and found (vLLM's prefix_cache_queries / _hits), and the prompt tokens
    # steps computed (what a cache hit saves); cached blocks: those holding reusable contents, held or free.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefill_tokens_computed_total: int = 0
    num_cached_blocks: int = 0
    # The prefix cache's host tier (engine.kv_offload_tokens): blocks copied there as the device's cache let go of
    # them, blocks copied back for a request's prefix (each a block's prompt tokens not computed again), blocks held.
    kv_offload_saved_blocks_total: int = 0
    kv_offload_loaded_blocks_total: int = 0
    num_offloaded_blocks: int = 0
    adapter_loads_total: int = 0  # adapters loaded on demand (engine.dynamic_adapters) into a slot...
    adapter_evictions_total: int = 0  # ...and unloaded to make room for another
    # Speculative decoding (vLLM's spec_decode counters): draft tokens verified, those accepted, and the requests'
    # speculating steps (accepted / steps + 1 = the mean acceptance length, tokens per step).
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_steps_total: int = 0
    # by draft position: verified, and accepted (accepted[i] / verified[i]: the i-th draft's acceptance rate)
    spec_draft_tokens_by_position: tuple[int, ...] = ()
    spec_accepted_tokens_by_position: tuple[int, ...] = ()
    # The draft model's forward passes (engine.speculative.method: draft), or the multi-token-prediction layer's (mtp)
    # or EAGLE head's (eagle, eagle3)
    spec_draft_model_steps_total: int = 0
    # Draft trees (engine.speculative.tree_width): accepted draft tokens off their tree's first path (the tokens a
    # path of the likeliest continuation would have missed)
    spec_tree_branch_tokens_total: int = 0
    # Images (engine/images.py): in the requests taken, and run through the vision tower (a request whose images'
    # blocks were all in the prefix cache runs none; a preempted one runs its own again).
    images_total: int = 0
    images_encoded_total: int = 0
    # Pipeline stages (engine.pipeline_parallel; engine/pipeline.py): steps through them, the seconds the stages
    # after the first computed, and the rest of the wait for them (Ray's calls, the hidden states' hops).
    pipeline_steps_total: int = 0
    pipeline_stage_seconds_total: float = 0.0
    pipeline_hop_seconds_total: float = 0.0
    pipeline_weights_read_bytes: int = 0  # of the checkpoint, read from object storage at load (each stage its own)
    # The model's forward passes: one a step that scheduled anything (every request in it together; the draft
    # model's or head's passes are spec_draft_model_steps_total)
    forward_passes_total: int = 0
    # Prefill-decode disaggregation (engine/kv_transfer.py): a prefill engine's blocks sent with its requests, a
    # decode engine's taken in from theirs (the blocks it lacked), and transfers it refused (not its layout)
    kv_transfer_sent_blocks_total: int = 0
    kv_transfer_sent_bytes_total: int = 0
    kv_transfer_received_blocks_total: int = 0
    kv_transfer_received_bytes_total: int = 0
    kv_transfer_refused_total: int = 0


@dataclass(frozen=True)
class Completion:
    """A whole finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason


def _token_ids(tokenizer, tokens: list[str]) -> tuple[int, ...]:
    """The ids of engine.classifier_from_token's tokens, each one token of the tokenizer's vocabulary."""
    ids = []
    for i, token in enumerate(tokens):
        found = tokenizer.encode(token).tolist()
        if len(found) != 1:
            raise PylonError(
                f"engine.classifier_from_token.{i}: {token!r} is {len(found)} tokens of this model's vocabulary, "
                'not one; give tokens as the tokenizer writes them (Qwen3-Reranker: "no", "yes")'
            )
        ids.append(found[0])
    return tuple(ids)


def _takes_images(directory: str, model: str) -> bool:
    """Whether the engine keeps `model`'s vision tower for requests with images: a multimodal checkpoint
    (families.TEXT_MODELS) that ships its image processor; one without is served for its text only, said once."""
    from pylon.serving.model.families import IMAGE_MODELS, PROCESSOR_FILES, TEXT_MODELS, has_processor
    from pylon.serving.model.runner import model_type_of

    model_type = model_type_of(directory)
    if model_type not in IMAGE_MODELS:
        if model_type in TEXT_MODELS:
            log.info(
                "model %s: a %s checkpoint: served for its text (the engine does not embed its images)",
                model,
                model_type,
            )
        return False
    if not has_processor(directory):
        log.warning(
            "model %s: a multimodal checkpoint without its image processor (%s): served for its text only; copy "
            "those files from the checkpoint to take images",
            model,
            " or ".join(PROCESSOR_FILES),
        )
        return False
    return True


class LLMEngine:
    def __init__(self, model: str, spec: EngineSpec | None = None, *, pipeline: dict | None = None):
        """Load the Hugging Face model directory `model` (a local path or a URI such as s3://...; remote
        directories are copied to a temporary directory, loaded, and the copy removed). `pipeline`: with
        engine.pipeline_parallel (engine.tensor_parallel), the cluster and placement group the stages (shards) go to
        (engine/split.py's `placement()`, from a replica to its engine process); None: this process's own."""
        # Imported here so that importing this module stays light (no torch, no transformers).
        from pylon.serving.model.eagle import refuse_as_model
        from pylon.serving.model.runner import ModelRunner, model_type_of

        self.spec = spec = spec or EngineSpec()
        self.pool = KVBlockPool.for_tokens(
            spec.kv_cache_tokens,
            spec.block_size,
            enable_caching=spec.enable_prefix_caching,
            offload_tokens=spec.kv_offload_tokens,
        )
        # LoRA adapters (engine.adapters): the runner's slot k is the k-th; requests name them (params.adapter).
        self.adapter_slots = {a.name: k for k, a in enumerate(spec.adapters, 1)}
        # A model with recurrent layers, with the prefix cache: their states at block boundaries (kv_cache.py).
        self.snapshots: StateSnapshots | None = None
        self._latest_snapshot: dict[str, tuple[int, list]] = {}  # request -> (blocks, its states there), decoding
        read_bytes = None
        with contextlib.ExitStack() as stack:
            if spec.pipeline_parallel > 1:  # stage 1's part of the checkpoint only (the other stages copy theirs)
                from pylon.serving.model.stages import stage_model_dir

                directory, _, read_bytes = stack.enter_context(stage_model_dir(model, 0, spec.pipeline_parallel))
            else:
                directory = stack.enter_context(local_model_dir(model))
            refuse_as_model(directory, model)  # (a head `objective: eagle3` exported: what to do instead)
            self.tokenizer = load_model_tokenizer(directory)
            self._chars_per_token = chars_per_token_bound(self.tokenizer)
            adapter_dirs = spec_adapter_dirs(stack, spec.adapters)
            images = spec.max_images_per_prompt > 0 and _takes_images(directory, model)
            self.encoder = model_type_of(directory) in ENCODER_MODEL_TYPES  # a cross-encoder (model/encoder.py)
            runner_kwargs = {
                "num_blocks": self.pool.num_blocks,
                "block_size": spec.block_size,
                "device": spec.device,
                "dtype": spec.dtype,
                "kv_cache_dtype": spec.kv_cache_dtype,
                "quantization": spec.quantization,
            }
            try:
                if self.encoder:
                    self.runner = self._encoder_runner(directory, model, spec)
                elif spec.tensor_parallel > 1 and spec.pipeline_parallel == 1:  # shards across GPUs of this node
                    from pylon.serving.engine.tensor import TensorRunner

                    classifier = _token_ids(self.tokenizer, spec.classifier_from_token)
                    self.runner = TensorRunner(
                        directory,
                        spec.tensor_parallel,
                        {**runner_kwargs, "classifier_from_token": classifier, "hybrid_kv": self._hybrid_kv(spec)},
                        pipeline,
                        adapters=adapter_dirs,
                        expert_parallel=spec.expert_parallel,
                    )
                elif spec.pipeline_parallel > 1:  # stages across nodes, each of tensor_parallel shards on its node
                    from pylon.serving.engine.pipeline import PipelineRunner

                    self.runner = PipelineRunner(
                        model,
                        directory,
                        spec.pipeline_parallel,
                        runner_kwargs,
                        spec.pipeline_microbatches,
                        pipeline,
                        read_bytes,
                        adapters=(spec.adapters, adapter_dirs),
                        shards=spec.tensor_parallel,
                        expert_parallel=spec.expert_parallel,
                    )
                else:
                    self.runner = ModelRunner(
                        directory,
                        **runner_kwargs,
                        adapters=adapter_dirs,
                        images=images,
                        classifier_from_token=_token_ids(self.tokenizer, spec.classifier_from_token),
                        hybrid_kv=self._hybrid_kv(spec),
                    )
            except PylonError as e:
                raise named_adapter_error(e, adapter_dirs, spec.adapters) from e.__cause__
            # The checkpoint's multi-token-prediction layer, drafting (engine/mtp.py); read while the directory is.
            # An EAGLE head (model/eagle.py) drafts the same way, from the model's hidden states.
            method = spec.speculative.method
            if getattr(self.runner, "kv_groups", None):  # windowed layers mixed with full ones, in groups (kv_cache.py)
                self.pool = HybridKVBlockPool(
                    self.runner.num_kv_blocks,
                    spec.block_size,
                    [window for _, window in self.runner.kv_groups],
                    enable_caching=spec.enable_prefix_caching,
                    offload_blocks=self.pool.offload_blocks,
                )
                # (a drafting layer's or head's cache in the same block ids: it reads the first, full group's table)
                runner_kwargs = {**runner_kwargs, "num_blocks": self.pool.num_blocks}
            self.mtp = self._mtp_drafter(directory, spec, runner_kwargs) if method in HEAD_METHODS else None
            if self.runner.recurrent:  # a model with recurrent layers (families.LINEAR_ATTENTION_FAMILIES)
                # (split, each part snapshots its own share of the states: engine/split.py's PartsSnapshot)
                if self.pool.enable_caching and spec.recurrent_state_snapshots:
                    # A cached block holds keys and values, not the recurrent layers' state there: their states'
                    # snapshots at block boundaries beside the blocks (kv_cache.StateSnapshots).
                    self.snapshots = StateSnapshots(spec.recurrent_state_snapshots)
                    log.info(
                        "model %s has recurrent layers: its prefix cache keeps up to %d snapshots of their states "
                        "(engine.recurrent_state_snapshots), %.1f MiB each",
                        model,
                        spec.recurrent_state_snapshots,
                        recurrent_state_bytes(self.runner.config, self.runner.dtype.itemsize) / 2**20,
                    )
                elif self.pool.enable_caching:
                    log.info("model %s has recurrent layers: its requests share no prefix cache", model)
                    self.pool = KVBlockPool.for_tokens(spec.kv_cache_tokens, spec.block_size, enable_caching=False)
            # A multimodal checkpoint's processor, for requests with images (engine/images.py); None: text only.
            self.images = (
                ImageProcessor(directory, self.runner.full_config, spec.max_images_per_prompt, spec.mm_processor_kwargs)
                if self.runner.vision is not None
                else None
            )
            # Adapters loaded when a request first names one (engine.dynamic_adapters), in the slots after these.
            dynamic = spec.dynamic_adapters
            self.on_demand = (
                OnDemandAdapters(
                    self.runner,
                    self.pool,
                    first_slot=len(spec.adapters) + 1,
                    max_loaded=dynamic.max_loaded,
                    max_rank=dynamic.max_rank,
                )
                if dynamic.root is not None
                else None
            )
            self._parked: list[Request] = []  # requests whose adapter waits for a slot (OnDemandAdapters.place)
            # The model's end-of-sequence ids and (engine.generation_config: auto) sampling defaults, from its
            # generation_config.json (engine/generation.py): an error names the file and key (the URI, if remote).
            self.generation: GenerationConfig = read_generation_config(
                directory,
                tokenizer_eos=self.tokenizer.eos_id,
                vocab_size=self.runner.vocab_size,
                sampling=spec.generation_config == "auto",
            )
            if self.snapshots is not None:  # the server names where a chat's shared part ends (snapshot_at)
                self.generation = dataclasses.replace(self.generation, snapshots=True)
            if getattr(self.runner, "pool_tasks", ()):  # an encoder's token heads (bge-m3's)
                self.generation = dataclasses.replace(self.generation, pool_tasks=self.runner.pool_tasks)
            if self.runner.classifier is not None:  # what its logits mean (engine/pooling.py), for the HTTP layer
                classifier = read_classifier(
                    directory, self.runner.config, from_tokens=tuple(spec.classifier_from_token)
                )
                self.generation = dataclasses.replace(self.generation, classifier=classifier)
                log.info("model %s is a classifier (%s): it generates no text", model, classifier.describe())
        # Any of them ends a request (unless it ignores eos), and min_tokens holds all of them back.
        self.eos_ids = frozenset(self.generation.eos_token_ids)
        self._default_max_tokens = self.generation.sampling.get("max_tokens")
        self.guides = Guides(self.tokenizer, self.runner.vocab_size)  # structured outputs' grammars and masks
        speculative = spec.speculative
        self.spec_policy = SpecPolicy(speculative.num_tokens) if speculative.method != "none" else None
        if speculative.tree_width > 1 and self.runner.recurrent:
            raise PylonError(
                f"engine.speculative.tree_width {speculative.tree_width}: model {model}: its recurrent layers keep "
                "one state a token, which a draft tree's branches cannot share; set tree_width: 1"
            )
        self._kv_moves: list[list[tuple[int, int]]] = []  # draft trees' accepted keys and values to move (per group)
        self._spec_branch_tokens = 0  # accepted draft tokens off their tree's first path
        # The tokens the step computed and the rows of logits it returned: the speculation rule's measure of its size.
        self._step_tokens = self._step_rows = 0
        self._draft_seconds = 0.0  # the step's time in the draft model (timed apart from the step's own)
        started = time.monotonic()
        compiled, counts = self.runner.warm_up(spec.max_num_seqs, spec.max_num_batched_tokens)
        if compiled:
            log.info(
                "engine: compiled the projections' kernels for %d of %d row counts in %.2f s",
                compiled,
                counts,
                time.monotonic() - started,
            )
        # A model cannot attend past its position table; the spec's own rules keep the pool >= max_model_len.
        self.max_model_len = min(spec.max_model_len, self.runner.max_position_embeddings)
        self.drafter = self._load_draft_model(spec) if speculative.method == "draft" else None
        # Suffix decoding's trees (engine/suffix.py): each running request's, and the finished outputs'.
        self.suffix = (
            SuffixDecoding(
                speculative.suffix_max_depth,
                speculative.suffix_max_cached_requests,
                speculative.suffix_max_spec_factor,
                speculative.suffix_min_token_prob,
            )
            if speculative.method == "suffix"
            else None
        )
        started = time.monotonic()
        # (not with a multi-token-prediction layer: its catch-up reads every row's hidden states, which the graphs'
        # steps do not keep)
        graphs = 0
        if spec.cuda_graphs and self.mtp is None:
            graphs = self.runner.use_decode_graphs(spec.max_num_seqs, self.max_model_len)
        if graphs:
            log.info(
                "engine: captured %d CUDA graphs for steps of decodes only in %.2f s (engine.cuda_graphs: false "
                "turns them off)",
                graphs,
                time.monotonic() - started,
            )
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            snapshots=self.snapshots,
            whole_prompts=self.encoder,
            snapshot_interval=spec.recurrent_snapshot_interval if self.snapshots is not None else 0,
            window=self._kv_window(model),
        )
        self._offload_to_host(model)
        # Filled by any thread, emptied by the stepping one. One lock over both, so that a step takes in an
        # abort only together with or after the add it cancels, never in between.
        self._lock = threading.Lock()
        self._incoming: list[Request] = []
        self._abort_ids: list[str] = []
        self._unfinished_ids: set[str] = set()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._forward_passes_total = 0  # steps that ran the model (a step with nothing scheduled runs none)
        self._images_total = self._images_encoded_total = 0
        self._finished_total: Counter[str] = Counter()
        # Prefill-decode disaggregation (engine/kv_transfer.py): requests finished this step whose prompt's blocks go
        # back with their output, this engine's layout of a block (made when first needed), and the counters.
        self._exporting: list[Request] = []
        # ...and with a drafting layer or head, their block tables, for the layer to catch up on them as they end
        self._export_tables: dict[str, list[int]] = {}
        self._transfer_layout: dict | None = None
        self._sent_blocks = self._sent_bytes = self._received_blocks = self._received_bytes = self._refused = 0

    @staticmethod
    def _hybrid_kv(spec: EngineSpec) -> tuple[int, int] | None:
        """What a runner (or each tensor-parallel shard's) groups its KV cache's layers by, where windowed layers mix
        with full ones (`ModelRunner(hybrid_kv=...)`; a drafting layer or head then reads the first, full group's
        table); None with HYBRID_KV_CACHE off."""
        return (spec.max_model_len, spec.max_num_batched_tokens) if HYBRID_KV_CACHE else None

    def _kv_window(self, model: str) -> int | None:
        """The sliding window (tokens) every layer of the model attends within, where the pool lets go of a request's
        blocks before it (`KVBlockPool.trim`; vLLM's sliding-window manager): a sequence then holds its window's
        blocks, not its whole context's. The runner's scratch block (zeros, or a padded row's finite keys) stands in
        for those let go of: the window's mask hides them. None where a layer attends past a window (the blocks stay),
        or where something else reads a request's blocks beyond it: a multi-token-prediction layer or EAGLE head, or a
        runner in pipeline stages. Where windowed layers mix with full ones and the KV cache is in groups of layers
        (HybridKVBlockPool), the windowed groups' tables let go so (a drafting layer or head reads group 0's)."""
        from pylon.serving.engine.tensor import TensorRunner
        from pylon.serving.model.runner import ModelRunner

        window = getattr(self.runner, "step_window", None)
        hybrid = isinstance(self.pool, HybridKVBlockPool)
        if hybrid:
            window = self.pool.window
        # (tensor-parallel shards each hold every layer's share: the scratch block on each; pipeline stages are not)
        runners = (ModelRunner, TensorRunner)
        # (a drafting layer or head reads a table: the one trimmed where every layer is windowed, group 0's, never
        # trimmed, where the groups are apart)
        if window is None or type(self.runner) not in runners or (self.mtp is not None and not hybrid) or self.encoder:
            return None
        slot = self.runner.add_scratch_block()
        self.pool.set_window(slot // self.pool.block_size)
        if hybrid:
            groups = self.runner.kv_groups
            width = max(len(layers) for layers, _ in groups)
            log.info(
                "model %s: its KV cache in %d groups of up to %d layers, %d of them windowed (%s), each group a block "
                "table of its own: a sequence holds its window's blocks in those, its context's in the others; %d "
                "blocks of %d layers each",
                model,
                len(groups),
                width,
                sum(1 for _, w in groups if w is not None),
                window,
                self.pool.num_blocks,
                width,
            )
            return window
        log.info(
            "model %s attends within %d tokens in every layer: a sequence holds the KV blocks of its window only",
            model,
            window,
        )
        return int(window)

    def _encoder_runner(self, directory: str, model: str, spec: EngineSpec):
        """A cross-encoder's runner (model/encoder.py): its inputs read whole, nothing cached; the settings that need a
        decoder refused by name."""
        from pylon.serving.model.encoder import EncoderRunner

        for name, value, neutral in (
            ("engine.quantization", spec.quantization, "none"),
            ("engine.speculative.method", spec.speculative.method, "none"),
            ("engine.classifier_from_token", spec.classifier_from_token, []),
            ("engine.adapters", [a.name for a in spec.adapters], []),
            ("engine.dynamic_adapters.root", spec.dynamic_adapters.root, None),
            ("engine.pipeline_parallel", spec.pipeline_parallel, 1),
            ("engine.tensor_parallel", spec.tensor_parallel, 1),
        ):
            if value != neutral:
                raise PylonError(
                    f"{name}: model {model} is an encoder (a cross-encoder, read whole): set {name} to {neutral!r}"
                )
        if self.pool.enable_caching:  # an input attended both ways shares nothing with another's
            self.pool = KVBlockPool.for_tokens(spec.kv_cache_tokens, spec.block_size, enable_caching=False)
        tok = getattr(self.tokenizer, "_tok", None)
        # A pair's segments where the tokenizer gives them (BERT's, ELECTRA's; RoBERTa's and ModernBERT's give none)
        segments = "token_type_ids" in (getattr(tok, "model_input_names", None) or ())
        sep = getattr(tok, "sep_token_id", None) if segments else None
        return EncoderRunner(directory, device=spec.device, dtype=spec.dtype, sep_token_id=sep)

    def _offload_to_host(self, model: str) -> None:
        """The prefix cache's host tier (engine.kv_offload_tokens; kv_cache.py): room in host memory for that many
        tokens' blocks of every layer's keys and values, the model's and its multi-token-prediction layer's or EAGLE
        head's (their caches are in the model's blocks)."""
        slots = self.pool.offload_blocks
        if not slots:
            if self.spec.kv_offload_tokens:
                log.info("model %s: no prefix cache here, so no host tier (engine.kv_offload_tokens)", model)
            return
        path = self.spec.kv_offload_path
        try:
            held = sum(runner.offload_to_host(slots, path) for runner in self._kv_runners())
        except PylonError:
            if self.spec.tensor_parallel > 1 or self.spec.pipeline_parallel > 1:  # (its parts' actors go with it)
                self.runner.shutdown()
            raise
        if path is not None:
            where = f"in files under {path} (engine.kv_offload_path; their pages cached as the OS sees fit)"
        elif self.runner.device.type == "cuda":
            where = "of host memory (pinned)"
        else:
            where = (
                "of host memory; on a CPU that is the cache's own memory: a larger engine.kv_cache_tokens would hold "
                "as much without copies (engine.kv_offload_path puts the tier on disk)"
            )
        log.info(
            "engine: the prefix cache's host tier holds %d blocks (%d tokens) in %.1f MiB %s",
            slots,
            slots * self.pool.block_size,
            held / 2**20,
            where,
        )

    def _kv_runners(self) -> list:
        """The runners whose KV caches are in the pool's blocks: the model's and its drafting layer's (if any)."""
        return [self.runner] if self.mtp is None else [self.runner, self.mtp.runner]

    def _copy_blocks(self) -> None:
        """Make the copies the pool queued (the host tier's saves and loads) before a pass reads or writes a block."""
        if self.pool.offload_blocks:
            copies = self.pool.drain_copies()
            if copies:
                for runner in self._kv_runners():
                    runner.copy_blocks(copies)

    def _mtp_drafter(self, directory: str, spec: EngineSpec, runner_kwargs: dict) -> MtpDrafter:
        """The multi-token-prediction layer of the model's checkpoint (or the EAGLE head of
        `engine.speculative.draft_model`), its KV cache in the model's blocks, and the model's runner told to keep its
        steps' hidden states for it (an EAGLE-3 head's: three layers' inputs). Every error it raises names the field."""
        from pylon.serving.model.runner import ModelRunner

        method = spec.speculative.method
        where = f"engine.speculative.method {method}"  # (the spec refuses it with pipeline stages)
        started = time.monotonic()
        try:
            if method in EAGLE_METHODS:  # (the spec refuses them with pipeline stages)
                runner = self._eagle_runner(spec, runner_kwargs)
            elif spec.tensor_parallel > 1:  # each shard's slices beside that shard of the model
                runner = self.runner.load_mtp(directory, runner_kwargs)
            else:
                runner = ModelRunner(directory, **runner_kwargs, mtp=self.runner)
                self.runner.keep_hidden = True
        except PylonError as e:
            if spec.tensor_parallel > 1:  # (its shards' actors go with the engine that failed to start)
                self.runner.shutdown()
            message = str(e)
            named = message.startswith(("engine.speculative.", where))  # (an EAGLE head's errors name it)
            raise PylonError(message if named else f"{where}: {message}") from e.__cause__
        runner.warm_up(spec.max_num_seqs, spec.max_num_batched_tokens)
        what = "the checkpoint's multi-token-prediction layer" if method == "mtp" else f"the {method} head"
        log.info("engine: loaded %s in %.2f s", what, time.monotonic() - started)
        return MtpDrafter(runner, spec.max_num_batched_tokens)

    def _eagle_runner(self, spec: EngineSpec, runner_kwargs: dict):
        """The runner of the EAGLE head of `engine.speculative.draft_model` (model/eagle.py), checked against the
        model (with `engine.tensor_parallel`: each shard's slices beside its shard of the model); the model's runner
        told to keep what it reads."""
        from pylon import storage
        from pylon.serving.engine.tensor import load_head
        from pylon.serving.model import eagle
        from pylon.serving.model.runner import LLAMA_FAMILIES

        method, uri = spec.speculative.method, spec.speculative.draft_model
        where = f"engine.speculative.draft_model {storage.describe(uri)}"
        why = eagle.refused(method, self.runner.config.model_type, LLAMA_FAMILIES)
        if why is not None:
            raise PylonError(f"engine.speculative.method {method}: model {self.runner.config.model_type}: {why}")
        directory = None
        try:
            with local_model_dir(uri) as directory:  # (read by every shard while it is there)
                if spec.tensor_parallel > 1:
                    return self.runner.load_mtp(directory, runner_kwargs, eagle=method)
                return load_head(self.runner, None, directory, runner_kwargs, method)
        except PylonError as e:
            message = str(e)
            if message.startswith("model.path "):  # (local_model_dir's, about the URI: "model.path <uri>: ...")
                message = message.split(": ", 1)[-1]
            if directory is not None:  # (eagle.read's name the copy: the URI instead)
                message = message.replace(f"engine.speculative.draft_model {directory}", where)
            raise PylonError(message if message.startswith(where) else f"{where}: {message}") from None

    def _load_draft_model(self, spec: EngineSpec) -> DraftModel:
        """The draft model of `engine.speculative.draft_model`, on this engine's device and dtype, with a KV cache
        as large as the engine's plus each running request's drafts (its requests hold no more than that). Every
        error it raises names the field."""
        from pylon import storage

        uri = spec.speculative.draft_model
        where = f"engine.speculative.draft_model {storage.describe(uri)}"
        started = time.monotonic()
        try:
            with local_model_dir(uri) as directory:
                drafter = DraftModel(
                    directory,
                    where=where,
                    tokenizer=self.tokenizer,
                    vocab_size=self.runner.vocab_size,
                    max_model_len=self.max_model_len,
                    kv_cache_tokens=spec.kv_cache_tokens
                    + spec.max_num_seqs * (spec.speculative.num_tokens + spec.block_size),
                    block_size=spec.block_size,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                    device=self.runner.device.type,
                    dtype=spec.dtype,
                )
        except PylonError as e:
            message = str(e)
            raise PylonError(message if message.startswith(where) else f"{where}: {message}") from None
        drafter.warm_up(spec.max_num_seqs)
        log.info("engine: loaded the draft model (%s) in %.2f s", uri, time.monotonic() - started)
        return drafter

    # -- requests in ------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a request for the next step. `prompt` is text or token ids. Raises `InvalidRequest`
        (naming the parameter) for a request that can never run, and `RequestFailed` for a fault of the engine's
        own in taking it: that request fails, and the engine serves on."""
        try:
            self._add_request(request_id, prompt, params)
        except InvalidRequest:
            raise
        except Exception as e:
            log.exception("engine: taking request %s failed", request_id)
            raise RequestFailed(f"the engine could not take the request ({type(e).__name__}: {e})") from e

    def _add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None) -> None:
        params = params if params is not None else self.generation.default_params()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string (got {request_id!r})", param="request_id")
        if self.encoder and self.generation.classifier is None and not params.embed:
            raise InvalidRequest(
                "this model is an encoder's embedding model: it generates no text; send its inputs to /v1/embeddings",
                param="model",
            )
        if params.pool_task and params.pool_task not in self.generation.pool_tasks:
            offered = ", ".join(POOL_TASK_NAMES[t] for t in self.generation.pool_tasks) or "none"
            raise InvalidRequest(
                f"task {POOL_TASK_NAMES[params.pool_task]}: this model has no such token head (bge-m3's ship "
                f"colbert_linear.pt and sparse_linear.pt beside the weights); its token tasks: {offered}",
                param="task",
            )
        if self.generation.classifier is not None and not params.embed:
            raise InvalidRequest(
                f"this model is a classifier ({self.generation.classifier.describe()}): it generates no text and "
                "scores no tokens; send its inputs to /classify, /pooling, /v1/score or /rerank",
                param="model",
            )
        images = None
        if isinstance(prompt, ImagePrompt):
            prompt, images = self._image_prompt(prompt, params)
        prompt_ids = self._prompt_token_ids(prompt, scoring=params.max_tokens == 0, special=params.add_special_tokens)
        if self.encoder and len(prompt_ids) > self.spec.max_num_batched_tokens:
            raise InvalidRequest(
                f"the input is {len(prompt_ids)} tokens; this model is an encoder, which reads each input whole in "
                f"one step: at most engine.max_num_batched_tokens ({self.spec.max_num_batched_tokens})",
                param="prompt",
            )
        truncate = params.truncate_prompt_tokens
        if truncate is not None and images is None:  # the prompt's last tokens (left truncation, vLLM's), or first
            keep = max(truncate if truncate > 0 else self.max_model_len - (params.max_tokens or 1), 1)
            prompt_ids = prompt_ids[:keep] if params.truncation_side == "right" else prompt_ids[-keep:]
        max_tokens = params.max_tokens
        if max_tokens is None:  # what the context leaves, and no more than the model's own default (if it has one)
            max_tokens = self.max_model_len - len(prompt_ids)
            if self._default_max_tokens is not None:
                max_tokens = min(max_tokens, self._default_max_tokens)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"max_tokens ({max_tokens}) plus the prompt ({len(prompt_ids)} tokens) exceed max_model_len "
                f"({self.max_model_len}); ask for at most {self.max_model_len - len(prompt_ids)} tokens",
                param="max_tokens",
            )
        for name, ids in (
            ("logit_bias", sorted(params.logit_bias or ())),
            ("logprob_token_ids", params.logprob_token_ids or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= self.runner.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{name}: token id {bad} is not in the model's vocabulary (ids 0 to {self.runner.vocab_size - 1})",
                    param=f"logit_bias.{bad}" if name == "logit_bias" else name,
                )
        if params.thinking_token_budget is not None and (not params.reasoning_tags or not params.reasoning_tags[1]):
            raise InvalidRequest(
                "thinking_token_budget needs to know what the model's reasoning is: give reasoning_tags (a deployment "
                "gives them from its http.reasoning_parser)",
                param="thinking_token_budget",
            )
        if params.bad_words and params.bad_words_ids is None:
            params.bad_words_ids = bad_words_ids(self.tokenizer, params.bad_words, self.runner.vocab_size)
        adapter, on_demand = 0, None
        if params.adapter is not None:
            adapter = self.adapter_slots.get(params.adapter, 0)
            if not adapter and self.on_demand is not None and params.adapter_path is not None:
                on_demand = params.adapter  # its slot is given when the step takes it in (`_place_adapters`)
                self.on_demand.stage(on_demand, params.adapter_path)
            elif not adapter:
                known = ", ".join(self.adapter_slots) or "none"
                raise InvalidRequest(
                    f"adapter {params.adapter!r} is not loaded in this engine (its adapters: {known})", param="model"
                )
        request = Request(
            request_id,
            prompt_ids,
            params,
            max_tokens,
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.stop,
                keep_stop=params.include_stop_str_in_output,
                skip=self._skipped(params),
            ),
            params.new_generator(),
            adapter=adapter,
            cache_salt=cache_salt(params.adapter if adapter or on_demand else None, params.cache_salt),
            on_demand_adapter=on_demand,
            images=images,
        )
        if params.guide is not None:
            request.guide = self.guides.matcher(params.guide)  # compiled once per grammar; InvalidRequest if it can't
        with self._lock:
            if request_id in self._unfinished_ids:
                raise InvalidRequest(f"request_id {request_id!r} is already in use", param="request_id")
            if on_demand is not None and self.on_demand.needs_staging(on_demand):
                # Unloaded by a step since `stage` looked (a threaded engine's request thread): read it again.
                self.on_demand.stage(on_demand, params.adapter_path)
            self._unfinished_ids.add(request_id)
            self._incoming.append(request)

    def _skipped(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that write no text for a request (`SamplingParams.skip_special_tokens`)."""
        if not params.skip_special_tokens:
            return frozenset()
        special = special_token_ids(self.tokenizer)
        return special.difference(params.keep_special_ids) if params.keep_special_ids else special

    @property
    def max_images(self) -> int:
        """Images a prompt may have (ImagePrompt): engine.max_images_per_prompt for a model that takes them, else 0."""
        return self.images.max_images if self.images is not None else 0

    def _image_prompt(self, prompt: ImagePrompt, params: SamplingParams) -> tuple[list[int], ImageInputs]:
        """A prompt with images: its token ids (each image's placeholders in place of its marker) and its images'
        inputs, by the model's processor. Refused for a model (or a deployment) without images, for an image whose
        run of placeholders attended both ways cannot fit one step, and with prompt log-probabilities or
        embedding."""
        if self.images is None:
            why = (
                "this deployment serves its text only (engine.max_images_per_prompt: 0)"
                if self.runner.full_config is not self.runner.config
                else "the model takes no images (a text-only model)"
            )
            raise InvalidRequest(f"the request has images, and {why}; send text parts only", param="messages")
        if params.embed or params.prompt_logprobs is not None:
            raise InvalidRequest(
                "prompt_logprobs and embeddings are not computed for prompts with images", param="prompt_logprobs"
            )
        ids, inputs = self.images.prepare(prompt, params.add_special_tokens)
        longest = max((b - a for a, b in inputs.spans), default=0)
        if longest > self.spec.max_num_batched_tokens:
            raise InvalidRequest(
                f"an image of this model is {longest} tokens, which attend each other in one step: more than "
                f"engine.max_num_batched_tokens ({self.spec.max_num_batched_tokens}); raise it",
                param="messages",
            )
        self._images_total += inputs.count
        return ids, inputs

    def _prompt_token_ids(self, prompt: Prompt, *, scoring: bool = False, special: bool = False) -> list[int]:
        # The step loop waits while a prompt is tokenized and checked: a prompt that cannot fit is refused on its
        # length first (characters: see chars_per_token_bound; token ids: before each is looked at). A prompt to be
        # scored only (max_tokens 0) may fill the context, as the sequences a model was trained on do; one to be
        # continued must leave room for a token.
        limit = self.max_model_len if scoring else self.max_model_len - 1
        if isinstance(prompt, str):
            bound = self._chars_per_token
            if bound is not None and len(prompt) > limit * bound:
                raise InvalidRequest(
                    f"prompt is {len(prompt)} characters, and this model's tokens stand for at most {bound} each: at "
                    f"least {-(-len(prompt) // bound)} tokens, past max_model_len ({self.max_model_len})",
                    param="prompt",
                )
            ids = prompt_ids(self.tokenizer, prompt, special)
        elif isinstance(prompt, Sequence):
            ids = prompt
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")
        if len(ids) > limit:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens; max_model_len is {self.max_model_len}, so a prompt "
                f"may have at most {limit} tokens" + ("" if scoring else " (or max_model_len with max_tokens 0)"),
                param="prompt",
            )
        if ids is prompt:
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
                raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")
            ids = list(prompt)
        # Also for text: a tokenizer larger than the model's embedding table would crash the step loop.
        bad = [i for i in ids if not 0 <= i < self.runner.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {self.runner.vocab_size}) (got {bad[:5]})", param="prompt"
            )
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop `request_id` at the next step, which frees its blocks and outputs finish_reason "abort".
        Unknown or already finished ids are ignored."""
        with self._lock:
            self._abort_ids.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._incoming or self._abort_ids or self._parked or self.scheduler.has_unfinished())

    # -- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished in it."""
        started = time.perf_counter()
        outputs = self._step()
        if self._exporting:
            self._export_blocks(outputs)
        if self.spec_policy is not None and self._step_tokens:
            # (a catch-up the multi-token-prediction layer took unasked, its rows piled up: timed apart)
            catch_up = self.mtp.catch_up_seconds if self.mtp is not None else 0.0
            self.spec_policy.end_step(
                self._step_tokens,
                self._step_rows,
                time.perf_counter() - started - self._draft_seconds - catch_up,
                self._draft_seconds,
            )
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._step_tokens = self._step_rows = 0
        self._draft_seconds = 0.0
        if self.mtp is not None:
            self.mtp.catch_up_seconds = 0.0
        outputs = []
        with self._lock:
            incoming, self._incoming = self._incoming, []
            abort_ids, self._abort_ids = self._abort_ids, []
            if self.on_demand is not None and (self._parked or any(r.on_demand_adapter for r in incoming)):
                incoming = self._place_adapters(incoming)
        for request in incoming:
            if request.params.kv_import is not None:
                self._import_blocks(request)
            self.scheduler.add(request)
        for request_id in abort_ids:
            request = self.scheduler.requests.get(request_id)
            if request is None:  # maybe one waiting for its adapter's slot
                request = next((r for r in self._parked if r.request_id == request_id), None)
                if request is not None:  # never scheduled: ended here rather than by the scheduler
                    self._parked.remove(request)
                    request.finish_reason = "abort"
                    request.metrics.finished_time = time.monotonic()
            if request is not None:
                self._finish(request, "abort")
                outputs.append(RequestOutput.of(request, request.detokenizer.flush(), []))

        self._propose_drafts()
        batch = self.scheduler.schedule()
        self._copy_blocks()
        if self.snapshots is not None:
            self._restore_states(batch)
        if self.mtp is not None:  # (their positions are computed again: what the layer held for them goes)
            for request in batch.preempted:
                self.mtp.forget(request.request_id)
        if not batch.scheduled:
            return outputs
        recurrent = self.runner.recurrent
        hybrid = isinstance(self.pool, HybridKVBlockPool)
        steps = [
            StepSequence(
                s.request.token_ids[s.start : s.start + s.num_new_tokens] + s.request.draft[: s.num_draft],
                s.start,
                self.pool.block_table(s.request.request_id),
                s.samples,
                s.num_draft > 0  # a speculating decode: every position's logits, to verify its drafts
                or (
                    s.request.prompt_logprobs is not None and _needs_prompt_logits(s.request, s.start, s.num_new_tokens)
                ),
                s.request.adapter,
                s.request.params.embed,
                pool_task=s.request.params.pool_task,
                **(self._image_step(s.request, s.start, s.num_new_tokens) if s.request.images is not None else {}),
                state=s.request.request_id if recurrent else None,
                speculative=s.num_draft > 0,
                tree=_step_tree(s.request.draft_parents, s.num_draft),
                group_tables=self.pool.group_tables(s.request.request_id) if hybrid else (),
            )
            for s in batch.scheduled
        ]
        self._step_tokens = sum(step.num_new_tokens for step in steps)
        self._forward_passes_total += 1
        logits, pooled = self.runner.execute_step(steps)
        if self.snapshots is not None:
            self._snapshot_states(batch.scheduled)
        if pooled is not None:  # embedding requests whose prompt this step finished: their rows are not logits
            embedded = [s.request for s in batch.scheduled if s.samples and s.request.params.embed]
            rows = pooled.cpu() if hasattr(pooled, "cpu") else [p.cpu() for p in pooled]  # (a list: token outputs)
            outputs.extend(self._finish_embedded(r, row) for r, row in zip(embedded, rows))
        self._step_rows = logits.shape[0]
        draft_rows: dict[str, object] = {}  # a speculating request's rows: its last token's and each draft's
        if any(step.prompt_logits for step in steps):
            logits = self._take_prompt_logprobs(batch.scheduled, steps, logits, draft_rows)
        sampling = [s.request for s in batch.scheduled if s.samples and not s.request.params.embed]
        # Penalties and logit_bias shape a copy of the rows that ask; logprobs below stay the model's own.
        params = [r.params for r in sampling]
        shaped = logits
        if any(p.shapes_logits for p in params):  # a step where no request shapes builds no history
            histories = [
                (r.prompt_tensor(), r.output_token_ids) if p.shapes_logits else ([], [])
                for r, p in zip(sampling, params)
            ]
            shaped = shape_logits(logits, params, histories, self.eos_ids)
        # (A speculating request's grammar masks its rows and takes its tokens in `_append_verified`.)
        guided = [
            i
            for i, r in enumerate(sampling)
            if r.guide is not None and r.max_tokens > 0 and r.request_id not in draft_rows
        ]
        # Guided rows sample from the grammar's tokens only; a grammar ends on the tokenizer's eos (one of eos_ids).
        allowed = (
            self.guides.apply(shaped, guided, [sampling[i].guide for i in guided], self.tokenizer.eos_id)
            if guided
            else shaped
        )
        # A speculating request's tokens come from `_append_verified`: its first row here is not drawn from (its
        # random stream gives one draw per token emitted, as a plain step's does).
        drawn = (
            [_NOT_DRAWN if r.request_id in draft_rows else p for r, p in zip(sampling, params)]
            if draft_rows
            else params
        )
        tokens = sample(allowed, drawn, [r.generator for r in sampling])
        for i in guided:
            sampling[i].guide.consume_token(tokens[i])
        # Logprobs cost nothing to a step without a request that asks for them: one pass over its sampling requests.
        wanted = [i for i, r in enumerate(sampling) if r.params.logprobs is not None and r.request_id not in draft_rows]
        chosen = [None] * len(sampling)
        if wanted:
            source = logits[wanted]
            processed = [j for j, i in enumerate(wanted) if sampling[i].params.logprobs_mode == "processed"]
            if processed:  # (the log of what each was drawn from: `filtered_probs` of the rows `sample` took)
                import torch

                rows = [wanted[j] for j in processed]
                drawn_from = filtered_probs(allowed[rows], [params[i] for i in rows]).to(source.device)
                source = source.float().clone()
                source[processed] = torch.log(drawn_from)
            found = token_logprobs(
                source, [tokens[i] for i in wanted], [sampling[i].params.alternatives for i in wanted]
            )
            for i, logprob in zip(wanted, found):
                chosen[i] = logprob
        now = time.monotonic()
        for request, token, logprob in zip(sampling, tokens, chosen):
            if request.max_tokens == 0:  # the prompt is scored (its logprobs are in), nothing is generated
                outputs.append(self._finish_scored(request))
                continue
            rows = draft_rows.get(request.request_id)
            if rows is not None:
                outputs.append(self._append_verified(request, rows, now))
                continue
            outputs.append(self._append_token(request, token, now, logprob))
        if self._kv_moves:  # draft trees' accepted tokens' keys and values to their positions, before the next pass
            moves, self._kv_moves = self._kv_moves, []
            self.runner.move_kv(moves)
        if self.mtp is not None:
            self._advance_mtp(batch.scheduled, steps)
        return outputs

    def _advance_mtp(self, scheduled, steps: list[StepSequence]) -> None:
        """What the step computed, handed to the multi-token-prediction layer (engine/mtp.py): each unfinished
        request's positions whose tokens stand (a prompt chunk's, a decode's and its accepted drafts), their hidden
        states, and the token after each."""
        hidden, computed, row = self.runner.step_hidden, [], 0  # (the runner's, until its next step)
        for s, step in zip(scheduled, steps):
            request, n = s.request, step.num_new_tokens
            valid = request.num_computed_tokens - s.start  # (a speculating decode's: 1 + the drafts accepted)
            ending = request.request_id in self._export_tables  # (a prefill request: its blocks carry the layer's)
            if (ending or not request.finished) and not request.params.embed and 0 < valid <= n:
                computed.append(
                    Computed(
                        request.request_id,
                        s.start,
                        request.token_ids[s.start + 1 : s.start + valid + 1],
                        hidden[row : row + valid],
                        s.start + valid + 1 == request.num_tokens,
                    )
                )
            row += n
        if not self._export_tables:
            self.mtp.advance(computed, self.pool.block_table)
            return
        # A prefill request's every row now, into the blocks it held (let go of, still its): so that the blocks sent
        # carry the layer's keys and values at every position and the decoding engine drafts right there.
        tables, self._export_tables = self._export_tables, {}
        table = lambda request_id: tables[request_id] if request_id in tables else self.pool.block_table(request_id)  # noqa: E731
        self.mtp.advance(computed, table)
        for request_id in tables:
            self.mtp.catch_up(request_id, table)
            self.mtp.forget(request_id)

    def _restore_states(self, batch) -> None:
        """Recurrent layers: the states of each request the step starts from a cached prefix, from its snapshot; then
        a preempted request's latest snapshot kept (its blocks were registered as it let them go), after the restores,
        whose snapshots the scheduler found and which keeping one could let go."""
        for s in batch.scheduled:
            if s.request.restore_from is not None:
                self.runner.restore_state(s.request.request_id, self.snapshots.get(s.request.restore_from))
                self.snapshots.restored += 1
                s.request.restore_from = None
        for request in batch.preempted:
            self._keep_latest_snapshot(request)

    def _snapshot_states(self, scheduled) -> None:
        """Recurrent layers: snapshot the states of each request whose computed tokens the step ended on a block
        boundary: at its prompt's snapshot boundary, kept at once; in decoding, its latest, kept when it ends."""
        bs = self.pool.block_size
        for s in scheduled:
            end = s.start + s.num_new_tokens
            if end % bs or not end or s.num_draft:  # (a speculating decode's: once its drafts are verified)
                continue
            request = s.request
            if end in self.scheduler.snapshot_boundaries(request):
                snapshot = self.runner.snapshot_state(request.request_id)
                self.snapshots.put(self.scheduler.block_hashes(request)[end // bs - 1], snapshot)
            elif end > request.num_prompt_tokens:
                self._latest_snapshot[request.request_id] = (end // bs, self.runner.snapshot_state(request.request_id))

    def _keep_verified_state(self, request: Request, accepted: int) -> None:
        """A speculating request of a model with recurrent layers: its states as they were after its decoded token
        and the `accepted` drafts (the runner computed them after every draft), and, with the prefix cache, their
        snapshot at the last block boundary the accepted tokens reached (its latest, `_snapshot_states`)."""
        start = request.num_computed_tokens - 1  # the decoded token's position (the scheduler counted it)
        end = start + 1 + accepted
        boundary = end // self.pool.block_size * self.pool.block_size
        at = None
        if self.snapshots is not None and boundary > start and boundary > request.num_prompt_tokens:
            at = boundary - start
        snapshot = self.runner.keep_state(request.request_id, 1 + accepted, snapshot=at)
        if snapshot is not None:
            self._latest_snapshot[request.request_id] = (boundary // self.pool.block_size, snapshot)

    def _keep_latest_snapshot(self, request: Request) -> None:
        latest = self._latest_snapshot.pop(request.request_id, None)
        if latest is not None:
            blocks, snapshot = latest
            hashes = self.scheduler.block_hashes(request)
            if len(hashes) >= blocks:
                self.snapshots.put(hashes[blocks - 1], snapshot)

    def _image_step(self, request: Request, start: int, num_new: int) -> dict:
        """A step's image fields (StepSequence) for `request`'s positions start .. start + num_new - 1: its images'
        rows among them, from the vision tower's output, computed when the prompt first reaches an image (and again
        after a preemption) and let go once the prompt is past the last."""
        images = request.images
        offsets, first, last = images.rows(start, num_new)
        fields: dict = {"image_spans": images.spans_in(start, num_new), "mrope": images.mrope}
        if offsets:
            if request.image_embeds is None:
                request.image_embeds = self.runner.embed_images(images.pixels)
                self._images_encoded_total += images.count
            fields.update(image_rows=tuple(offsets), image_embeds=request.image_embeds[first:last])
        if start + num_new > images.last_position:
            request.image_embeds = None
        return fields

    def _place_adapters(self, incoming: list[Request]) -> list[Request]:
        """The requests the step takes in: `incoming` and those parked before, each request of an adapter loaded on
        demand with its slot (OnDemandAdapters.place), oldest first; those whose adapter finds no slot wait, parked,
        for a later step. Under the engine's lock."""
        waiting = [*self._parked, *incoming]
        needed = {r.on_demand_adapter for r in waiting if r.on_demand_adapter and not r.adapter}
        busy = {r.adapter for r in self.scheduler.requests.values() if r.adapter}
        ready, parked = [], []
        for request in waiting:
            name = request.on_demand_adapter
            if name is not None and not request.adapter:
                slot = self.on_demand.place(name, busy, needed)
                if slot is None:
                    parked.append(request)
                    continue
                request.adapter = slot
                busy.add(slot)
            ready.append(request)
        self._parked = parked
        self.on_demand.keep_staged({r.on_demand_adapter for r in parked})
        return ready

    def _propose_drafts(self) -> None:
        """Speculative decoding (`engine/speculative.py`): give this step's decodes their drafts, when the measured
        rule says speculating pays at this batch. Every kind of request may: penalties, logit_bias and min_tokens shape
        each draft position's row as its history up to there says, a grammar masks it as its state after the drafts
        before it says, logprobs come from the row that scored each token, and a sampled row draws as the sampler
        would, from the request's own stream (`_append_verified`, `speculative.verify`)."""
        policy = self.spec_policy
        if policy is None:
            return
        running = self.scheduler.running
        decodes, other = [], 0
        for request in running:
            request.draft, request.draft_parents = [], []
            left = request.num_tokens - request.num_computed_tokens
            if left == 1 and request.num_output_tokens > 0:
                decodes.append(request)
            else:
                other += left
        other = min(other, self.scheduler.max_num_batched_tokens)
        if not decodes:
            return
        spec = self.spec.speculative
        drafted, rooms = [], []
        for request in decodes:
            room = min(
                spec.num_tokens,
                self.max_model_len - request.num_tokens - 1,
                request.max_tokens - request.num_output_tokens - 1,
            )
            if room <= 0:
                continue
            if self.drafter is not None:  # the draft model's tokens cost a forward pass each: decide first
                drafted.append(request)
                rooms.append(room)
                continue
            if self.mtp is not None:  # (the layer's: those whose first draft it holds)
                if self.mtp.ready(request.request_id, request.num_tokens):
                    drafted.append(request)
                    rooms.append(room)
                continue
            # A request with a grammar drafts one path (its rows are masked by its state along the drafts).
            width = spec.tree_width if request.guide is None else 1
            if self.suffix is not None:
                request.draft, parents = self.suffix.propose_tree(
                    request.request_id, request.token_ids, room, request.num_prompt_tokens, width
                )
            elif width > 1:
                request.draft, parents = ngram_tree(request.token_ids, room, spec.ngram_max, spec.ngram_min, width)
            else:
                request.draft = ngram_propose(request.token_ids, room, spec.ngram_max, spec.ngram_min)
                parents = []
            if chain_length(parents) < len(parents):  # (a tree that is one path is drafted as one)
                request.draft_parents = parents
            if request.draft:
                drafted.append(request)
        if self.drafter is not None:
            asked = [DraftRequest(r.request_id, r.token_ids, room) for r, room in zip(drafted, rooms)]
            proposing, floor = self.drafter.estimate(asked) if asked else (None, 0.0)
            if asked and policy.decide(len(decodes), sum(rooms), other, proposing=proposing, floor=floor):
                started = time.perf_counter()
                drafts = self.drafter.propose(asked)
                self._draft_seconds = time.perf_counter() - started
                for request in drafted:
                    request.draft = drafts.get(request.request_id, [])
            return
        if self.mtp is not None:
            asked = [DraftRequest(r.request_id, r.token_ids, room) for r, room in zip(drafted, rooms)]
            proposing, floor = self.mtp.estimate(asked) if asked else (None, 0.0)
            if asked and policy.decide(len(decodes), sum(rooms), other, proposing=proposing, floor=floor):
                started = time.perf_counter()
                # The drafts after the first are the layer's passes at the positions the verification computes (all
                # but the last draft's): their keys and values go to the request's blocks, given room for them here.
                asked = [a for a in asked if self.pool.allocate(a.request_id, len(a.token_ids) + a.room - 2)]
                tables = {a.request_id: self.pool.block_table(a.request_id) for a in asked}
                self._copy_blocks()  # (a block given for the drafts may have held what the host tier keeps)
                drafts = self.mtp.propose(asked, tables)
                self._draft_seconds = time.perf_counter() - started
                for request in drafted:
                    request.draft = drafts.get(request.request_id, [])
            return
        if not policy.decide(len(decodes), sum(len(r.draft) for r in drafted), other):
            for request in drafted:
                request.draft, request.draft_parents = [], []

    def _append_verified(self, request: Request, rows, now: float) -> RequestOutput:
        """A speculating request's step: its accepted drafts and the model's next token, up to where it finishes."""
        params = request.params
        draft = request.draft[: rows.shape[0] - 1]
        parents = request.draft_parents[: len(draft)]
        request.draft, request.draft_parents = [], []
        if chain_length(parents) == len(draft):  # (a tree cut to its first path by the step's budget)
            parents = []
        # Row i follows the drafts on the way to it (a path: the i before it; a tree: its ancestors).
        paths = _tree_paths(draft, parents) if parents else [draft[:i] for i in range(len(draft) + 1)]
        shaped = rows
        if params.shapes_logits:  # each row's history holds the drafts before it, as a plain step's would
            prompt, generated = request.prompt_tensor(), request.output_token_ids
            histories = [(prompt, generated + path) for path in paths]
            shaped = shape_logits(rows, [params] * len(histories), histories, self.eos_ids)
        proposed = len(draft)
        if request.guide is not None:  # each row masked by the grammar's state after the drafts before it
            shaped, draft = self.guides.draft_rows(shaped, draft, request.guide, self.tokenizer.eos_id)
        if parents:
            emitted, path = verify_tree(shaped, draft, parents, params, request.generator)
            accepted = len(path)
            self._move_accepted(request, path)
            rows = rows[[0, *(1 + node for node in path)]]  # (the rows that scored the emitted tokens)
            self._spec_branch_tokens += sum(node != t for t, node in enumerate(path))
            self.spec_policy.observe_drafts(proposed, accepted, depth=max(len(p) for p in paths))
        else:
            emitted, accepted = verify(shaped, draft, params, request.generator)
            self.spec_policy.observe_drafts(proposed, accepted)
        if self.runner.recurrent:  # its recurrent states back to where the accepted drafts end
            self._keep_verified_state(request, accepted)
        request.num_computed_tokens += accepted  # the step wrote the accepted drafts' KV: they are computed
        # Each emitted token's logprobs from the model's own row that scored it, as a plain step gives them.
        logprobs = (
            token_logprobs(rows[: len(emitted)], emitted, [params.alternatives] * len(emitted))
            if params.logprobs is not None
            else [None] * len(emitted)
        )
        outs = []
        for token, logprob in zip(emitted, logprobs):
            if request.guide is not None:
                request.guide.consume_token(token)
                self.guides.guided_tokens_total += 1
            outs.append(self._append_token(request, token, now, logprob))
            if outs[-1].finished:
                break
        return outs[0] if len(outs) == 1 else merge_outputs(outs)

    def _move_accepted(self, request: Request, path: list[int]) -> None:
        """A draft tree's accepted nodes `path`: the step wrote node i's keys and values at position start + 1 + i
        (its index), the t-th accepted one belongs at start + t; queued for `ModelRunner.move_kv` at the step's end.
        (Each one moved to is below every later one moved from: the moves commute.)"""
        start = request.num_computed_tokens - 1  # the decoded token's position (the scheduler counted it)
        moved = [(start + 1 + node, start + t) for t, node in enumerate(path, 1) if node != t - 1]
        if not moved:
            return
        bs = self.pool.block_size
        tables = [self.pool.block_table(request.request_id)]
        if isinstance(self.pool, HybridKVBlockPool):
            tables = list(self.pool.group_tables(request.request_id))
        if not self._kv_moves:
            self._kv_moves = [[] for _ in tables]
        for group, table in zip(self._kv_moves, tables):
            group.extend((table[a // bs] * bs + a % bs, table[b // bs] * bs + b % bs) for a, b in moved)

    def _take_prompt_logprobs(self, scheduled, steps: list[StepSequence], logits, draft_rows: dict):
        """Fill the prompt logprobs of this step's `prompt_logits` sequences from their rows of `logits` (see
        `ModelRunner.execute`): the row at position p scores prompt token p + 1. A speculating sequence's rows go to
        `draft_rows` by request id. Returns the sampling rows only (a speculating sequence's: its first)."""
        rows, offset = [], 0
        for s, step in zip(scheduled, steps):
            if not step.prompt_logits:
                if s.samples and not step.pooled:  # a pooled sequence's row is not among the logits
                    rows.append(offset)
                    offset += 1
                continue
            if s.num_draft:
                draft_rows[s.request.request_id] = logits[offset : offset + step.num_new_tokens]
                rows.append(offset)
                offset += step.num_new_tokens
                continue
            request, n = s.request, s.num_new_tokens
            scored = min(n, request.num_prompt_tokens - 1 - s.start)  # rows whose next token is a prompt token
            if scored > 0:
                first = s.start + 1
                request.prompt_logprobs[first : first + scored] = token_logprobs(
                    logits[offset : offset + scored],
                    request.prompt_token_ids[first : first + scored],
                    [request.params.prompt_logprobs] * scored,
                )
            offset += n
            if s.samples:
                rows.append(offset - 1)
        return logits[rows]

    def _finish_embedded(self, request: Request, hidden) -> RequestOutput:
        """An embedding request whose prompt has been computed: it ends ("stop") with its last token's final hidden
        state and no token."""
        self._prompt_tokens_total += request.num_prompt_tokens
        self._finish(request, "stop")
        return dataclasses.replace(RequestOutput.of(request, "", []), embedding=hidden.tolist())

    def _finish_scored(self, request: Request) -> RequestOutput:
        """A request with max_tokens 0 whose prompt has been computed: it ends ("length") with no token."""
        self._prompt_tokens_total += request.num_prompt_tokens
        self._finish(request, "length")
        return RequestOutput.of(request, "", [], [] if request.params.logprobs is not None else None)

    def _append_token(
        self, request: Request, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        if request.num_output_tokens == 0:
            self._prompt_tokens_total += request.num_prompt_tokens
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        request.token_ids.append(token)
        self._generation_tokens_total += 1

        params, text, reason = request.params, "", None
        # A stop token ends the request without becoming text (eos would otherwise decode as "<|endoftext|>"); so does
        # any of the model's eos ids (engine/generation.py). A speculating step's tokens past it are dropped.
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            reason = "stop"
        else:
            # Stop strings are looked for once min_tokens are out (vLLM's rule; the text before is never searched).
            text = request.detokenizer.add(token, find_stop=request.num_output_tokens >= params.min_tokens)
            # A grammar that is complete and can take no more (a JSON object's closing brace) ends the request.
            if request.detokenizer.stopped or (request.guide is not None and request.guide.is_stopped()):
                reason = "stop"
        if reason is None and (
            request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if (
            reason is None
            and params.repetition_detection is not None
            and request.num_output_tokens >= params.min_tokens
            and params.repeats(request.output_token_ids)
        ):
            reason = "repetition"  # (vLLM's: the output ends in a loop)
        if reason is not None:
            text += request.detokenizer.flush()
            self._finish(request, reason)
        return RequestOutput.of(request, text, [token], None if logprob is None else [logprob])

    def _finish(self, request: Request, reason: FinishReason) -> None:
        exporting = request.params.kv_export_from is not None and reason != "abort"
        if exporting and self.mtp is not None:  # (the layer catches up on it after the step: `_advance_mtp`)
            self._export_tables[request.request_id] = list(self.pool.block_table(request.request_id))
        self.scheduler.finish(request, reason)
        if self.runner.recurrent:
            if self.snapshots is not None:
                self._keep_latest_snapshot(request)
            self.runner.release_state(request.request_id)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        if self.mtp is not None and request.request_id not in self._export_tables:
            self.mtp.forget(request.request_id)
        if self.suffix is not None:  # (its output drafts later requests')
            self.suffix.finish(request.request_id, request.output_token_ids)
        self._finished_total[reason] += 1
        if exporting:
            self._exporting.append(request)
        with self._lock:
            self._unfinished_ids.discard(request.request_id)

    # -- prefill-decode disaggregation (engine/kv_transfer.py) ----------------------------------------------------

    def _layout(self) -> dict:
        if self._transfer_layout is None:
            self._transfer_layout = kv_transfer.engine_layout(self.pool, self._kv_runners())
        return self._transfer_layout

    def _export_blocks(self, outputs: list[RequestOutput]) -> None:
        """The prompt blocks of this step's finished prefill requests, read before any later step can take them,
        onto their last outputs."""
        exporting, self._exporting = self._exporting, []
        last = {out.request_id: i for i, out in enumerate(outputs) if out.finished}
        for request in exporting:
            at = last.get(request.request_id)
            if at is None or not self.pool.enable_caching:
                continue
            out = outputs[at]
            usable = (request.num_prompt_tokens - 1) // self.pool.block_size  # (what a prefix lookup may use)
            hashes = self.scheduler.block_hashes(request)[:usable]
            transfer = kv_transfer.export_blocks(
                self.pool,
                self._kv_runners(),
                self._layout(),
                hashes,
                min(request.params.kv_export_from, usable),
                request.num_prompt_tokens,
                out.num_cached_tokens,
            )
            if transfer is not None:
                outputs[at] = dataclasses.replace(out, kv_transfer=transfer)
                self._sent_blocks += transfer.num_blocks
                self._sent_bytes += transfer.nbytes

    def _import_blocks(self, request: Request) -> None:
        """Another engine's blocks of `request`'s prompt into the prefix cache, before the step schedules it (what the
        request then finds cached, it does not compute). A transfer of another layout is refused and the prompt
        computed here."""
        transfer, request.params.kv_import = request.params.kv_import, None  # (its bytes are let go of once taken)
        if not isinstance(transfer, kv_transfer.KVTransfer):
            return
        try:
            if not self.pool.enable_caching:  # (a model with recurrent layers and no snapshots of their states)
                raise kv_transfer.TransferRefused("this engine keeps no prefix cache, where another's blocks would go")
            self._received_blocks += kv_transfer.import_blocks(
                self.pool, self._kv_runners(), self._layout(), transfer, copy_out=self._copy_blocks
            )
            self._received_bytes += transfer.nbytes
        except kv_transfer.TransferRefused as e:
            self._refused += 1
            if self._refused == 1 or self._refused % 100 == 0:
                log.warning("engine: %s; computing the prompts here (%d refused so far)", e, self._refused)

    # -- conveniences -------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Offline use: run `prompts` to completion, all batched together; one `Completion` per prompt, in
        order. Runs the engine alone (refuses while other requests are unfinished)."""
        if self.has_unfinished():
            raise PylonError("generate() runs the engine alone; finish or abort the other requests first")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise PylonError(f"generate(): {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [f"generate-{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        texts = {i: [] for i in ids}
        tokens = {i: [] for i in ids}
        reasons = {}
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id].append(out.text)
                tokens[out.request_id].extend(out.token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [Completion(i, "".join(texts[i]), tokens[i], reasons[i]) for i in ids]

    def load_weights(self, weights) -> int:
        """Compute with new weights from the next request on: (name, tensor) pairs for every weight of the model,
        named as its checkpoint names them (`ModelRunner.load_weights`), and the prefix cache forgotten (its blocks
        hold the old weights' keys and values). Only between requests: a PylonError while any is unfinished. What a
        trainer calls to sample from the policy it is training (TRL's colocated vLLM: `pylon.jobs.rollout`)."""
        if self.has_unfinished():
            raise PylonError("load_weights: the engine has unfinished requests; finish or abort them first")
        if self.encoder or self.drafter is not None or self.mtp is not None:
            raise PylonError(
                "load_weights: an encoder or an engine with a draft model (or layer) cannot take new weights"
            )
        taken = self.runner.load_weights(weights)
        self.pool.forget_cached()
        if self.snapshots is not None:
            self.snapshots = StateSnapshots(self.spec.recurrent_state_snapshots)
            self.scheduler.snapshots = self.snapshots
        return taken

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=expected_waiting(
                len(self.scheduler.running),
                len(self.scheduler.waiting) + len(self._parked),
                len(self._incoming),
                self.spec.max_num_seqs,
            ),
            kv_cache_utilization=self.pool.utilization,
            num_free_blocks=self.pool.num_free_blocks,
            num_blocks=self.pool.num_blocks,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            requests_finished_total=dict(self._finished_total),
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits,
            prefill_tokens_computed_total=self.scheduler.prefill_tokens_computed,
            num_cached_blocks=self.pool.num_cached_blocks,
            kv_offload_saved_blocks_total=self.pool.offload_saved,
            kv_offload_loaded_blocks_total=self.pool.offload_loaded,
            num_offloaded_blocks=self.pool.num_offloaded_blocks,
            adapter_loads_total=self.on_demand.loads_total if self.on_demand is not None else 0,
            adapter_evictions_total=self.on_demand.evictions_total if self.on_demand is not None else 0,
            images_total=self._images_total,
            images_encoded_total=self._images_encoded_total,
            pipeline_steps_total=getattr(self.runner, "pipeline_steps", 0),
            forward_passes_total=self._forward_passes_total,
            kv_transfer_sent_blocks_total=self._sent_blocks,
            kv_transfer_sent_bytes_total=self._sent_bytes,
            kv_transfer_received_blocks_total=self._received_blocks,
            kv_transfer_received_bytes_total=self._received_bytes,
            kv_transfer_refused_total=self._refused,
            pipeline_stage_seconds_total=getattr(self.runner, "pipeline_stage_seconds", 0.0),
            pipeline_hop_seconds_total=getattr(self.runner, "pipeline_hop_seconds", 0.0),
            pipeline_weights_read_bytes=getattr(self.runner, "pipeline_weights_read_bytes", 0),
            **(
                {
                    "spec_draft_tokens_total": self.spec_policy.proposed_total,
                    "spec_accepted_tokens_total": self.spec_policy.accepted_total,
                    "spec_verify_steps_total": self.spec_policy.verified_total,
                    "spec_draft_tokens_by_position": tuple(self.spec_policy.proposed_by_position),
                    "spec_accepted_tokens_by_position": tuple(self.spec_policy.accepted_by_position),
                    "spec_tree_branch_tokens_total": self._spec_branch_tokens,
                    "spec_draft_model_steps_total": (
                        self.drafter.forward_passes
                        if self.drafter is not None
                        else self.mtp.forward_passes
                        if self.mtp is not None
                        else 0
                    ),
                }
                if self.spec_policy is not None
                else {}
            ),
        )


def expected_waiting(running: int, waiting: int, arrived: int, max_num_seqs: int) -> int:
    """Requests that will be waiting once the next step has taken in the `arrived` ones, which join behind the
    `waiting` ones and run at once up to the free sequence slots. What admission control (max_queued_requests)
    counts: a burst that arrives between two steps is not "waiting" when it will start at the next one."""
    free = max(0, max_num_seqs - running - waiting)
    return waiting + max(0, arrived - free)


def next_tick(now: float, interval_s: float) -> float:
    """When a coalesced stream next takes its outputs: the first multiple of `interval_s` (on the monotonic
    clock every process shares) at least half an interval away. Every stream with the same interval wakes on
    the same ticks, so a replica with 32 open streams wakes 20 times a second (at 50 ms) and writes its
    chunks together, instead of 640 times at moments spread over each interval: each wake-up of the replica,
    of the ingress and of the clients' event loops took a core from the engine mid-step. Chunks come every
    0.5-1.5 intervals, once per interval on average, as before."""
    return (math.floor(now / interval_s + 0.5) + 1) * interval_s


_NOT_DRAWN = SamplingParams(temperature=0)  # a row `sample` takes the argmax of, drawing nothing


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their deltas joined (logprobs too), the last one's counts and
    state, the prompt logprobs of the one that carried them (the request's first)."""
    last = outputs[-1]  # built directly: dataclasses.replace introspects the fields on every call
    logprobs = None
    if any(o.logprobs is not None for o in outputs):
        logprobs = [lp for o in outputs if o.logprobs for lp in o.logprobs]
    return RequestOutput(
        last.request_id,
        "".join(o.text for o in outputs),
        [t for o in outputs for t in o.token_ids],
        last.num_prompt_tokens,
        last.num_output_tokens,
        last.finish_reason,
        last.metrics,
        logprobs,
        next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
        last.num_cached_tokens,
        last.embedding,
        next((o.prompt_token_ids for o in outputs if o.prompt_token_ids is not None), None),
        last.kv_transfer,
    )


def _step_tree(parents: list[int], num_draft: int) -> tuple[int, ...]:
    """`StepSequence.tree` of a decode and its first `num_draft` drafts, drafted as a tree (`Request.draft_parents`):
    each token's parent among the step's (the decoded token first); () where they are one path."""
    parents = parents[:num_draft]
    if not num_draft or chain_length(parents) == len(parents):
        return ()
    return (-1, *(p + 1 for p in parents))


def _tree_paths(draft: list[int], parents: list[int]) -> list[list[int]]:
    """For the last known token and each node of a draft tree, the drafts on the way to it from the root."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(draft, parents):
        paths.append(paths[parent + 1] + [token])
    return paths


def _needs_prompt_logits(request: Request, start: int, num_new: int) -> bool:
    """Whether a step computing `request`'s positions [start, start + num_new) must score prompt tokens: the row at
    position p scores token p + 1, and some of those entries are still missing (a recomputation after preemption,
    or a prefix someone else filled, needs none)."""
    entries = request.prompt_logprobs
    return any(entries[p + 1] is None for p in range(start, min(start + num_new, request.num_prompt_tokens - 1)))


class _StreamQueue(asyncio.Queue):
    """A stream's outputs. `wake`: set while the consumer waits for its next tick; an output that ends the
    stream (finished, or an error) ends that wait at once, and `ended` says one is queued."""

    wake: asyncio.Future | None = None
    ended: bool = False

    def put_output(self, item: RequestOutput | BaseException) -> None:
        self.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self.ended = True
            if self.wake is not None:
                _resolve(self.wake)


def _put_all(puts: list[tuple[_StreamQueue, RequestOutput]]) -> None:
    for queue, item in puts:
        queue.put_output(item)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class AsyncLLMEngine:
    """An `LLMEngine` stepping on a background thread, streaming outputs to asyncio consumers.

    The thread steps while any request is unfinished and otherwise sleeps until one arrives, beating a
    heartbeat on every pass; `check_health()` is true only while that heartbeat is recent. If a step
    raises, the loop stops: every open stream and every later `generate()` raises `EngineDeadError`.
    """

    IDLE_WAIT_S = 0.1  # how often an idle loop wakes to beat its heartbeat

    def __init__(self, engine: LLMEngine, *, heartbeat_timeout_s: float = 60.0):
        # Generous: a step (a long prefill on a CPU) must never read as a dead loop.
        self.engine = engine
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _StreamQueue]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._dead: EngineDeadError | None = None
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="pylon-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, spec: EngineSpec | None = None, **kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine(model, spec), **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_images(self) -> int:
        return self.engine.max_images

    @property
    def image_processor(self) -> ImageProcessor | None:
        """The model's processor for prompts with images (None: text only), which the replica runs to count such a
        prompt's tokens as the engine will (`/tokenize`, Anthropic's count_tokens)."""
        return self.engine.images

    @property
    def generation(self) -> GenerationConfig:
        """The model's eos ids and sampling defaults (engine/generation.py)."""
        return self.engine.generation

    @property
    def device(self) -> str:
        """Where the model computes: 'cpu' or 'cuda'."""
        return self.engine.runner.device.type

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                if not self.engine.has_unfinished():
                    self._wake.wait(self.IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._deliver_step(self.engine.step())
            self._dead = EngineDeadError("the engine was shut down")
        except BaseException as e:  # anything at all: the streams must learn the loop is gone
            log.exception("engine step loop crashed")
            self._dead = EngineDeadError(f"the engine's step loop crashed ({type(e).__name__}: {e})")
            self._dead.__cause__ = e
        # After `_dead` is set: a stream registered from here on sees it in generate() itself.
        for request_id in list(self._streams):
            self._deliver(request_id, self._dead)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each consumer's event loop in one call per loop: one wake-up of the
        loop per step instead of one per request (each is a write to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_StreamQueue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # else its consumer went away; the abort it sent is on its way
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that event loop is closed
                pass

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:  # its consumer went away; the abort it sent is on its way
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_output, item)
        except RuntimeError:  # that event loop is closed
            pass

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *, interval_s: float = 0.0
    ) -> AsyncIterator[RequestOutput]:
        """Stream `request_id`'s outputs (text and token deltas) until one has a finish_reason.

        `interval_s` > 0 coalesces: the first output comes at once (time to first token is untouched), each
        later one at least `interval_s` after the previous, carrying every step's tokens since then merged
        into one output. A consumer that ships each output somewhere (an SSE chunk through Serve's proxy)
        pays that per output, not per token; Ray Serve LLM batches its streams the same way (50 ms).

        `InvalidRequest` and `EngineDeadError` are raised by the first iteration, before any output.
        Leaving the iteration early (break, or cancelling the consuming task) aborts the request.
        """
        self._raise_if_dead()
        if request_id in self._streams:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", param="request_id")
        queue = _StreamQueue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        added = finished = False
        try:
            self._raise_if_dead()  # again: the loop may have died, and told its streams, just before we registered
            self._submit(request_id, prompt, params, interval_s)
            added = True
            loop = asyncio.get_running_loop()
            next_at = 0.0
            while not finished:
                if interval_s > 0 and not queue.ended and (wait := next_at - loop.time()) > 0:
                    # Let this interval's steps pile up, but not the last output: a finished request's client
                    # (a closed-loop one sends its next request then) hears it at once, not at the tick.
                    # Outputs already queued wait for the tick too: a consumer slower than the engine (a busy
                    # replica) would otherwise take each step as it came, one chunk per token.
                    queue.wake = loop.create_future()
                    timer = loop.call_later(wait, _resolve, queue.wake)
                    try:
                        await queue.wake
                    finally:
                        timer.cancel()
                        queue.wake = None
                items = [await queue.get()]
                # The first output goes alone, whenever this task gets to it: the time to first token is the
                # first step's; a later one takes every step queued since the previous.
                while not queue.empty() and not isinstance(items[-1], BaseException) and interval_s > 0 and next_at:
                    items.append(queue.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    finished = True  # nothing left to abort: the engine is gone, or refused the request
                    if isinstance(error, EngineDeadError):
                        self._raise_if_dead()
                    raise error
                item = items[0] if len(items) == 1 else merge_outputs(items)
                finished = item.finished
                next_at = next_tick(loop.time(), interval_s) if interval_s > 0 else 0.0
                yield item
        finally:
            self._streams.pop(request_id, None)
            if added and not finished:
                self.abort(request_id)

    def _submit(self, request_id: str, prompt: Prompt, params: SamplingParams | None, interval_s: float = 0.0) -> None:
        """Hand a request to the engine (raises `InvalidRequest` here, or delivers it to the stream).
        `interval_s`: how often the stream's consumer takes outputs (an engine in another process may hold its
        outputs up to half of that, to send the steps' outputs for many requests at once)."""
        self.engine.add_request(request_id, prompt, params)
        self._wake.set()

    def _raise_if_dead(self) -> None:
        if self._dead is not None:  # a fresh error per caller: one instance raised in many tasks tangles tracebacks
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" (if anyone still listens)."""
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def open_streams(self) -> int:
        """Requests being streamed now (from the first iteration of `generate` to its end)."""
        return len(self._streams)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def check_health(self) -> bool:
        """True while the step loop runs and has beaten its heartbeat within `heartbeat_timeout_s`."""
        return (
            self._dead is None
            and self._thread.is_alive()
            and time.monotonic() - self._heartbeat < self.heartbeat_timeout_s
        )

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cached_block_hashes(self) -> list[bytes]:
        """The hashes (kv_cache.block_hashes) of the blocks the engine holds cached now: what its replica reports
        to the router that keeps prefixes on the replica that holds them (pylon.serving.api.routing)."""
        # One C-level copy of the dict's keys under the GIL: the step thread cannot change it halfway.
        return self.engine.pool.cached_hashes()

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many of a prompt's first blocks (`hashes`, kv_cache.block_hashes) the engine holds cached now."""
        return self.engine.pool.reachable(list(hashes))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (open streams raise `EngineDeadError`) and wait for the thread to end."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)
