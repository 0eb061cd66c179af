"""The engine's runner for a model split into pipeline stages across processes and nodes (`engine.pipeline_parallel`).

A model larger than one machine's memory is served by N stages (vLLM's `pipeline_parallel_size`): the engine's own
process holds stage 1 (the embeddings, the first layers and the head: final norm and lm_head), and each other stage
is a Ray actor holding its run of layers and their KV cache (pylon.serving.model.stages: no stage ever reads
another's weights). A step goes through them in order: the engine computes stage 1 and hands its hidden states with
the step's sequences to stage 2, whose output goes to stage 3 as an object reference (Ray moves it from node to node,
over its authenticated transport: nothing else listens), and the last hands back its sampling rows' hidden states,
which the engine turns into logits with its head: `[rows, hidden]` crosses the network, never `[rows, vocabulary]`.
Every stage builds the step's attention metadata from the same sequences and writes its own layers' keys and values
into the same block ids, so the scheduler, the KV block pool and the prefix cache stay the engine's alone.

Hidden states travel as bytes (a numpy view of the tensor's memory, which Ray serializes without a copy, where a
torch tensor goes through pickle: ~2 ms a hop against ~4-14 ms for a small one on this machine).

Placement: in a Serve replica the stages take the bundles of its placement group after the replica's own (bundle 0:
the replica and its engine), spread over nodes as `engine.pipeline_placement` says (serving/api/builder.py); outside
Serve (an engine made in a driver or a notebook), each stage asks for one CPU (one GPU on CUDA) of the cluster the
process is connected to.

Micro-batches (`engine.pipeline_microbatches`, off by default): a step of several sequences is cut into up to that
many contiguous groups of about as many tokens, sent down the pipeline one after another without waiting, so that
stage 1 computes the second group while stage 2 computes the first (GPipe's schedule for inference, vLLM's virtual
engines in spirit); each group's logits come back in its order, the step's outputs the same as in one piece. A step
of one sequence (a long prompt's chunk) goes whole. Each group costs a step's fixed work and a hop and computes a
smaller batch: on one machine it lost (bench/serve_pipeline.py, set 53), hence off unless asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass

import torch

from pylon.errors import PylonError
from pylon.serving.model.stages import Stage, stage_model_dir, stage_of

log = logging.getLogger(__name__)

STAGE_START_TIMEOUT_S = 900.0  # a stage loads its part of the model (from object storage: minutes)


def placement() -> dict[str, str]:
    """In a Ray worker (a Serve replica): what its engine process needs to place the stages in the replica's
    placement group, `{"address": the cluster's GCS, "placement_group": its id}` (empty outside Ray); the replica
    sends it with the engine's start (engine/process.py)."""
    import ray

    if not ray.is_initialized():
        return {}
    found = {"address": ray.get_runtime_context().gcs_address}
    group = ray.util.get_current_placement_group()
    if group is not None:
        found["placement_group"] = group.id.hex()
    return found


def connect_ray(address: str | None):
    """Ray, connected: this process's own connection (a replica's, a driver's), or the cluster at `address` (the
    replica's), else RAY_ADDRESS's, else the local one."""
    import ray

    from pylon import settings

    if not ray.is_initialized():
        address = address or settings.value(settings.RAY_ADDRESS) or "auto"
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as e:
            raise PylonError(
                f"engine.pipeline_parallel: its stages run on a Ray cluster, and none was found ({e}); serve the "
                "deployment on a cluster (pylon serve), or connect this process to one first (ray.init)"
            ) from None
    return ray


def replica_placement_group(ray, given: str | None):
    """This process's placement group (a replica's), or the one whose id is `given` (the replica's, for its engine
    process), or None."""
    group = ray.util.get_current_placement_group()
    if group is None and given:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        group = PlacementGroup(PlacementGroupID(bytes.fromhex(given)))
    return group


def actor_options(group, k: int, runner_kwargs: dict, outside, share: int = 1) -> dict:
    """Part `k`'s actor options (a pipeline stage's, a tensor-parallel shard's): bundle k of the replica's placement
    group `group` (`share`: of that many parts that bundle holds, each its share of it: a stage's tensor-parallel
    shards), or outside one, one CPU (GPU on CUDA) placed by the scheduling strategy `outside`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if group is not None and len(group.bundle_specs) > k:
        bundle = group.bundle_specs[k]
        return {
            "num_cpus": bundle.get("CPU", 0) / share,
            "num_gpus": bundle.get("GPU", 0) / share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=k),
        }
    cuda = str(runner_kwargs.get("device", "auto")) != "cpu" and torch.cuda.is_available()
    return {"num_cpus": 1, "num_gpus": 1 if cuda else 0, "scheduling_strategy": outside}


def microbatches(steps: list, count: int) -> list[list]:
    """`steps` cut into at most `count` contiguous, non-empty groups of about as many tokens each (none cut where
    there is one sequence, or `count` is 1)."""
    count = min(count, len(steps))
    if count <= 1:
        return [steps]
    total = sum(s.num_new_tokens for s in steps)
    groups, current, done = [], [], 0
    for i, s in enumerate(steps):
        current.append(s)
        done += s.num_new_tokens
        left = len(steps) - i - 1  # sequences after this one
        wanted = count - len(groups) - 1  # groups still to make after this one
        if wanted and left >= wanted and (done >= total * (len(groups) + 1) / count or left == wanted):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def _kv_cache_bytes(runner) -> int:
    """The bytes of a runner's KV cache (its own layers'; one tensor where keys and values share it)."""
    tensors = {id(t): t for t in runner.k_cache + runner.v_cache}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def packed(tensor: torch.Tensor, seconds: float = 0.0) -> tuple:
    """A tensor as (bytes as a numpy array, dtype, shape) on the CPU, what Ray serializes without pickling, and the
    seconds the stages so far computed the step for."""
    tensor = tensor.detach().to("cpu").contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return tensor.view(-1).view(torch.uint8).numpy(), dtype, tuple(tensor.shape), seconds


def unpacked(message: tuple) -> tuple[torch.Tensor, float]:
    data, dtype, shape, seconds = message
    if data.size == 0:  # (a step without rows to sample: the last stage hands back none)
        return torch.empty(shape, dtype=getattr(torch, dtype)), seconds
    if not data.flags.writeable:  # (Ray's zero-copy arrays are read-only; torch wants its memory writable)
        data = data.copy()
    return torch.from_numpy(data).view(getattr(torch, dtype)).view(shape), seconds


def described_runner(index: int, runner, read_bytes: int | None) -> dict:
    """What a pipeline stage (or a tensor-parallel shard: engine/tensor.py) reports of itself once loaded: its index,
    its layers, the bytes of its weights and KV cache, the weights' bytes it read from object storage (None: from a
    local directory), and where it runs."""
    import ray

    return {
        "index": index,
        "layers": [runner.layers.start, runner.layers.stop],
        "weights_bytes": runner.stage_weights_bytes,
        "kv_cache_bytes": _kv_cache_bytes(runner),
        "read_bytes": read_bytes,
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "device": str(runner.device),
    }


def log_to_stderr(name: str) -> None:
    """Pylon's INFO lines to this process's stderr (an actor's log file), as the engine process logs (a Ray worker
    passes WARNING and above only)."""
    logger = logging.getLogger("pylon")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _drop_snapshot(actors: list, name: str) -> None:
    for actor in actors:
        try:
            actor.drop_snapshot.remote(name)
        except Exception:  # (Ray shut down, the part gone: nothing is kept there any more)
            pass


class PartsSnapshot:
    """A snapshot of a sequence's recurrent states across a split model's parts (the prefix cache's; `SplitRunner`:
    tensor-parallel shards, each its heads' states; pipeline stages, each its layers'): this process's part's
    (`local`, its runner's `snapshot_state` form), the other parts' kept by them as `name`. The engine keeps it as it
    keeps any snapshot (kv_cache.StateSnapshots); once it lets it go (evicted, replaced, forgotten), the other parts
    let theirs go too (a finalizer: nothing to call)."""

    __slots__ = ("local", "name", "__weakref__")

    def __init__(self, local, name: str):
        self.local, self.name = local, name

    @classmethod
    def made(cls, local, name: str, actors: list) -> "PartsSnapshot":
        snapshot = cls(local, name)
        weakref.finalize(snapshot, _drop_snapshot, list(actors), name)
        return snapshot


class PartWorker:
    """An actor holding a part of a split model (`StageWorker`, engine/tensor.py's `ShardWorker`): its `runner`'s
    share of each adapter loaded on demand, read from the adapter's files as the engine's part reads it, and of a
    model with recurrent layers, its part of each sequence's states and of their snapshots (`SplitRunner`)."""

    runner: object

    @property
    def _snapshots(self) -> dict:
        """The prefix cache's snapshots of this part's recurrent states, by the name the engine's part gave them
        (`PartsSnapshot`), kept until the engine lets its own go."""
        return self.__dict__.setdefault("_kept_snapshots", {})

    def keep_state(self, key: str, count: int, snapshot: int | None = None, name: str | None = None) -> None:
        """As the engine's part does (`ModelRunner.keep_state`); its snapshot, if any, kept as `name`."""
        copy = self.runner.keep_state(key, count, snapshot)
        if copy is not None and name is not None:
            self._snapshots[name] = copy

    def release_state(self, key: str) -> None:
        self.runner.release_state(key)

    def snapshot_state(self, key: str, name: str) -> None:
        self._snapshots[name] = self.runner.snapshot_state(key)

    def restore_state(self, key: str, name: str) -> None:
        self.runner.restore_state(key, self._snapshots[name])

    def drop_snapshot(self, name: str) -> None:
        self._snapshots.pop(name, None)  # (a stage of shards: its own `PartsSnapshot` let go, its shards' with it)

    def held_snapshots(self) -> list[str]:
        return sorted(self._snapshots)

    def held_states(self) -> list[str]:
        """The sequences whose recurrent states this part holds (none once they finish)."""
        return sorted(self.runner._states)

    def part(self) -> str:
        """This part, as errors name it."""
        raise NotImplementedError

    def _adapter(self, files: dict[str, bytes], where: str, max_rank, rank_limit: str):
        """The adapter of `files` (its directory's, by name; `where` the directory as errors name it), read as the
        runner reads one (its layers' matrices, or its shard's slice of them)."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="pylon-adapter-") as directory:
            for name, data in files.items():
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(data)
            try:
                return self.runner.read_adapter(directory, max_rank=max_rank, rank_limit=rank_limit)
            except PylonError as e:
                raise PylonError(f"{self.part()}: {str(e).replace(directory, where)}") from None

    def check_adapter(self, files: dict[str, bytes], where: str, max_rank, rank_limit: str) -> None:
        """Raises the PylonError this part's `read_adapter` would (its projections, ranks)."""
        self._adapter(files, where, max_rank, rank_limit)

    def put_adapter(self, slot: int, files: dict[str, bytes] | None, where: str, max_rank, rank_limit: str) -> None:
        """Serve the adapter of `files` in `slot` from the next step on (None: empty it), as the engine's part does.
        (Read again here rather than kept from `check_adapter`: a part keeps nothing for an adapter never placed.)"""
        adapter = None if files is None else self._adapter(files, where, max_rank, rank_limit)
        self.runner.put_adapter(slot, adapter)


class StageWorker(PartWorker):
    """One pipeline stage after the first (a Ray actor): its `ModelRunner`, loaded from the model's URI on the node it
    runs on (its own tensors only: `stage_model_dir`); with `shards` > 1 (engine.tensor_parallel), a `TensorRunner`
    over that many shards of the stage on its node, this actor the first (engine/tensor.py)."""

    def __init__(
        self,
        model: str,
        stage: Stage,
        runner_kwargs: dict,
        adapters: list = (),
        shards: int = 1,
        expert_parallel: bool = False,
    ):
        from pylon.serving.engine.adapters import named_adapter_error, spec_adapter_dirs
        from pylon.serving.model.runner import ModelRunner

        log_to_stderr(f"pylon-stage-{stage.index + 1}")
        with contextlib.ExitStack() as stack:
            directory, own, read = stack.enter_context(stage_model_dir(model, stage.index, stage.count))
            if own != stage:  # (the engine split the same config's layers)
                raise PylonError(f"model {model}: {stage.describe()} is {own.describe()} in its config")
            # engine.adapters, copied on this node: their matrices of this stage's layers (model/lora.py)
            adapter_dirs = spec_adapter_dirs(stack, adapters)
            try:
                if shards > 1:  # (its shards read this node's copy while this loads its own: all loaded here)
                    from pylon.serving.engine.tensor import TensorRunner

                    self.runner = TensorRunner(
                        directory,
                        shards,
                        runner_kwargs,
                        adapters=adapter_dirs,
                        expert_parallel=expert_parallel,
                        stage=stage,
                    )
                else:
                    self.runner = ModelRunner(directory, stage=stage, adapters=adapter_dirs, **runner_kwargs)
            except PylonError as e:
                raise named_adapter_error(e, adapter_dirs, adapters) from None
        self.stage, self.read_bytes = stage, read

    def describe(self) -> dict:
        return described_runner(self.stage.index, self.runner, self.read_bytes)

    def part(self) -> str:
        return self.stage.describe()

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.runner.warm_up(max_num_seqs, max_num_batched_tokens)

    def run(self, steps, hidden):
        """The stage's part of a step: its output hidden states for the next stage (the last stage's: its sampling
        rows', for the engine's head), from the previous stage's; both as `packed`."""
        started = time.perf_counter()
        hidden, seconds = unpacked(hidden)
        out, _ = self.runner.execute_step(steps, hidden)
        return packed(out, seconds + time.perf_counter() - started)


class SplitRunner:
    """What the runners of a model split across processes share (`PipelineRunner`, engine/tensor.py's
    `TensorRunner`): `local`, this process's part (a `ModelRunner`), answers what the engine reads of its runner
    (vocab_size, config, device, dtype, ...); each step runs eagerly (a CUDA graph would capture one part of it), and
    the weights cannot be replaced (`fixed_weights` says why)."""

    local: object
    actors: list  # the other parts' actors (`PartWorker`s)
    _puts: list  # their put_adapter calls, waited for before the next step

    def __getattr__(self, name: str):
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def execute(self, steps):
        return self.execute_step(steps)[0]

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        return 0

    def load_weights(self, weights) -> int:
        raise PylonError(f"model ({self.local.model_type}): its weights cannot be replaced: {self.fixed_weights()}")

    def read_adapter(self, directory: str, *, max_rank: int | None = None, rank_limit: str = "max_rank"):
        """An adapter loaded on demand (engine.dynamic_adapters), read by every part: the engine's here, the others
        from its files sent through Ray (an adapter's few MiB; the replica copied them to this node), each checking
        its own share (a stage's layers, a shard's slices). Not yet served (`put_adapter`)."""
        import ray

        from pylon.serving.model.lora import CONFIG_FILE, WEIGHT_FILES

        local = self.local.read_adapter(directory, max_rank=max_rank, rank_limit=rank_limit)
        files = {}
        for name in (CONFIG_FILE, *WEIGHT_FILES):
            path = os.path.join(directory, name)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
        ref = ray.put(files)
        try:
            ray.get([s.check_adapter.remote(ref, directory, max_rank, rank_limit) for s in self.actors])
        except ray.exceptions.RayTaskError as e:
            if isinstance(getattr(e, "cause", None), PylonError):
                raise PylonError(str(e.cause)) from None
            raise
        return StagedAdapter(local, ref, directory, max_rank, rank_limit)

    def put_adapter(self, slot: int, adapter: StagedAdapter | None) -> None:
        """Serve `adapter` (`read_adapter`'s) in `slot` on every part from the next step on; None empties it. The
        other parts' calls run before the next step's on each (Ray runs an actor's calls from one caller in order),
        and the next step waits for them to have succeeded (`_placed`)."""
        self.local.put_adapter(slot, adapter.local if adapter is not None else None)
        if adapter is None:
            self._puts += [s.put_adapter.remote(slot, None, "", None, "") for s in self.actors]
            return
        a = adapter
        self._puts += [s.put_adapter.remote(slot, a.files, a.where, a.max_rank, a.rank_limit) for s in self.actors]

    def _placed(self) -> None:
        """Wait for the adapters placed since the last step to be on every part, before this step computes."""
        import ray

        if self._puts:
            puts, self._puts = self._puts, []
            ray.get(puts)

    # A model with recurrent layers (Qwen3-Next, Qwen3.5): each part keeps its share of each sequence's states (a
    # shard its heads', a stage its layers'); what the engine does to them, every part does, in order with the steps
    # (a Ray actor runs one caller's calls in order), not waited for. A snapshot (the prefix cache's) is each part's
    # of its own share: this process's in the `PartsSnapshot` the engine keeps, the others' kept by them under its
    # name until the engine lets it go.
    def keep_state(self, key: str, count: int, snapshot: int | None = None) -> PartsSnapshot | None:
        name = self._snapshot_name() if snapshot is not None else None
        for actor in self.actors:
            actor.keep_state.remote(key, count, snapshot, name)
        local = self.local.keep_state(key, count, snapshot)
        if name is None or local is None:  # (then no part kept one: the same sequence, the same step)
            return None
        return PartsSnapshot.made(local, name, self.actors)

    def release_state(self, key: str) -> None:
        for actor in self.actors:
            actor.release_state.remote(key)
        self.local.release_state(key)

    def snapshot_state(self, key: str) -> PartsSnapshot:
        name = self._snapshot_name()
        for actor in self.actors:
            actor.snapshot_state.remote(key, name)
        return PartsSnapshot.made(self.local.snapshot_state(key), name, self.actors)

    def restore_state(self, key: str, snapshot: PartsSnapshot) -> None:
        for actor in self.actors:
            actor.restore_state.remote(key, snapshot.name)
        self.local.restore_state(key, snapshot.local)

    def _snapshot_name(self) -> str:
        made = self.__dict__.get("_snapshots_made", 0) + 1
        self.__dict__["_snapshots_made"] = made
        return f"s{made}"


@dataclass(frozen=True)
class StagedAdapter:
    """An adapter loaded on demand, read for a split model's parts (`SplitRunner.read_adapter`: pipeline stages,
    tensor-parallel shards): the engine's part's `lora.Adapter`, and its files in Ray's object store for the other
    parts to read when it is placed."""

    local: object
    files: object  # ObjectRef of {file name: bytes}
    where: str  # its directory, as errors name it
    max_rank: int | None
    rank_limit: str

    @property
    def digest(self) -> str:
        return self.local.digest

    @property
    def directory(self) -> str:
        return self.local.directory


class PipelineRunner(SplitRunner):
    """`ModelRunner`'s interface (what the engine uses of it) over the stages of a model: stage 1 in this process,
    the rest Ray actors (see the module's docstring). `model`: the URI the stages load from (each on its own node);
    `directory`: this process's copy of what stage 1 loads (`stage_model_dir`), `read_bytes` of weights read for it
    from object storage (None: a local directory); `adapters`: engine.adapters and this process's copies of them
    (every stage serves each adapter's matrices of its own layers); `microbatches`: at most this many groups a step
    (None: 1, each step whole); `placement`: `placement()` of the replica whose engine process this is (None: this
    process's own); `shards` > 1: each stage that many tensor-parallel shards on its node (engine.tensor_parallel:
    stage 1's a `TensorRunner` here, each other stage's in its actor; `expert_parallel` as there)."""

    def __init__(
        self,
        model: str,
        directory: str,
        count: int,
        runner_kwargs: dict,
        microbatches: int | None = None,
        placement: dict | None = None,
        read_bytes: int | None = None,
        adapters: tuple[list, list[str]] = ((), []),
        shards: int = 1,
        expert_parallel: bool = False,
    ):
        from transformers import AutoConfig

        from pylon.serving.model.runner import ModelRunner

        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        num_layers = config.get_text_config().num_hidden_layers
        specs, dirs = adapters  # engine.adapters, and this process's copies of them (each stage copies its own)
        self.count = count
        self.microbatches = microbatches or 1
        # Per step, summed: the other stages' computing (timed inside them) and the rest of the wait for them (Ray's
        # calls and the hidden states' hops): where a pipeline's time goes (bench/serve_pipeline.py).
        self.pipeline_steps, self.pipeline_stage_seconds, self.pipeline_hop_seconds = 0, 0.0, 0.0
        self._puts: list = []  # the other stages' put_adapter calls, waited for before the next step
        started = time.monotonic()
        # The actors first: they load while this process loads its own stage.
        placement = placement or {}
        ray = connect_ray(placement.get("address"))
        group = replica_placement_group(ray, placement.get("placement_group"))
        worker = ray.remote(StageWorker)
        self.stages = []
        for k in range(1, count):
            stage = stage_of(num_layers, k, count)
            options = actor_options(group, k, runner_kwargs, "SPREAD", share=shards)
            self.stages.append(
                worker.options(**options).remote(model, stage, runner_kwargs, list(specs), shards, expert_parallel)
            )
        first = stage_of(num_layers, 0, count)
        try:
            if shards > 1:
                from pylon.serving.engine.tensor import TensorRunner

                self.local = TensorRunner(
                    directory, shards, runner_kwargs, placement, dirs, expert_parallel=expert_parallel, stage=first
                )
            else:
                self.local = ModelRunner(directory, stage=first, adapters=dirs, **runner_kwargs)
            described = ray.get([s.describe.remote() for s in self.stages], timeout=STAGE_START_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            self.shutdown()
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise PylonError(f"engine.pipeline_parallel: a stage failed to load {model}: {cause}") from None
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise PylonError(
                f"engine.pipeline_parallel: the stages did not load {model} within {STAGE_START_TIMEOUT_S:.0f} s: "
                "no node may have room for them (each asks for its placement group bundle, or one CPU or GPU)"
            ) from None
        except BaseException:  # (this process's stage failed to load: the others go with it)
            self.shutdown()
            raise
        self.described = [described_runner(0, self.local, read_bytes), *described]
        # the weights' bytes the stages read from object storage (each its own tensors: model/stages.py)
        self.pipeline_weights_read_bytes = sum(d["read_bytes"] or 0 for d in self.described)
        for d in self.described:
            log.info(
                "pipeline stage %d of %d: layers %d-%d, %.1f MiB of weights (%s), node %s, pid %d",
                d["index"] + 1,
                count,
                d["layers"][0],
                d["layers"][1] - 1,
                d["weights_bytes"] / 2**20,
                "local" if d["read_bytes"] is None else f"{d['read_bytes'] / 2**20:.1f} MiB read from storage",
                d["node"][:12],
                d["pid"],
            )
        log.info("pipeline of %d stages loaded in %.1f s", count, time.monotonic() - started)

    @torch.no_grad()
    def execute_step(self, steps):
        import ray

        self._placed()  # adapters placed since the last step: on every stage before this step computes
        groups = microbatches(steps, self.microbatches)
        refs, started = [], time.perf_counter()
        local = 0.0
        for group in groups:  # each group down the pipeline without waiting: stage 1 computes the next meanwhile
            t = time.perf_counter()
            hidden, _ = self.local.execute_step(group)
            local += time.perf_counter() - t
            ref = packed(hidden)
            for stage in self.stages:
                ref = stage.run.remote(group, ref)
            refs.append(ref)
        outputs, computing = [], 0.0
        for group, message in zip(groups, ray.get(refs)):
            hidden, seconds = unpacked(message)
            computing += seconds
            outputs.append(self.local.finish_step(group, hidden))
        waited = time.perf_counter() - started - local
        self.pipeline_steps += 1
        self.pipeline_stage_seconds += computing
        self.pipeline_hop_seconds += max(0.0, waited - computing)
        if len(outputs) == 1:
            return outputs[0]
        logits = torch.cat([o[0] for o in outputs])
        pooled = [o[1] for o in outputs if o[1] is not None]
        return logits, (torch.cat(pooled) if pooled else None)

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        import ray

        remote = [s.warm_up.remote(max_num_seqs, max_num_batched_tokens) for s in self.stages]
        done = self.local.warm_up(max_num_seqs, max_num_batched_tokens)
        ray.get(remote)
        return done

    @property
    def actors(self) -> list:
        return self.stages

    def fixed_weights(self) -> str | None:
        return "it is split into pipeline stages (engine.pipeline_parallel)"

    def shutdown(self) -> None:
        import ray

        for stage in self.stages:  # (a stage's tensor-parallel shards, its actors, end with it)
            ray.kill(stage)
        self.stages = []
        local = self.__dict__.get("local")
        if local is not None and hasattr(type(local), "shutdown"):  # stage 1's shards (engine/tensor.py)
            local.shutdown()
