"""What the runners of a model split across processes share (engine/pipeline.py's stages, engine/tensor.py's
shards): where their actors go (the replica's placement group, the cluster), a step's hidden states as bytes between
processes, the actors' common part (`PartWorker`: adapters loaded on demand, recurrent states and their snapshots) and
the engine's side of them (`SplitRunner`). Neither of those modules is imported here: pipeline.py builds on tensor.py
(a stage of shards), both on this."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch

from pylon.errors import PylonError

log = logging.getLogger(__name__)


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


def cause_of(error: Exception) -> BaseException:
    """What a Ray call's error (a part's task or actor failing) was raised for in the part: its cause where Ray kept it,
    else the error itself."""
    return error.cause if getattr(error, "cause", None) is not None else error


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

    def offload_to_host(self, slots: int, path: str | None = None) -> int:
        return self.runner.offload_to_host(slots, path)

    def copy_blocks(self, copies: list) -> None:
        self.runner.copy_blocks(copies)

    def move_kv(self, moves: list) -> None:
        self.runner.move_kv(moves)

    def add_scratch_block(self) -> int:
        return self.runner.add_scratch_block()

    def kv_layout(self) -> list:
        return self.runner.kv_layout()

    def read_blocks(self, blocks: list[int]) -> list:
        return self.runner.read_blocks(blocks)

    def write_blocks(self, blocks: list[int], arrays: list) -> None:
        self.runner.write_blocks(blocks, arrays)

    def kv_groups(self) -> list:
        return self.runner.kv_groups

    def mapped_files(self) -> list[str]:
        """The files this part's host tier is mapped from (engine.kv_offload_path), as its process's maps name them."""
        with open("/proc/self/maps") as maps:
            return sorted({line.split(None, 5)[-1].strip() for line in maps if "/pylon-kv-" in line})

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

    # The prefix cache's host tier (engine.kv_offload_tokens): each part keeps its own share of a block's keys and
    # values (a shard its heads', a stage its layers') in host memory, and makes the pool's copies in order with the
    # steps, as the engine's part does.
    def offload_to_host(self, slots: int, path: str | None = None) -> int:
        """Every part's room for `slots` blocks (in files under `path` on its node, with one), waited for: a part short
        of memory or disk fails the start, its error named; bytes."""
        import ray

        remote = [actor.offload_to_host.remote(slots, path) for actor in self.actors]
        local = self.local.offload_to_host(slots, path)  # (beside the other parts')
        try:
            return local + sum(ray.get(remote))
        except ray.exceptions.RayTaskError as e:
            raise PylonError(str(cause_of(e))) from None

    def copy_blocks(self, copies: list) -> None:
        for actor in self.actors:
            actor.copy_blocks.remote(copies)
        self.local.copy_blocks(copies)

    def move_kv(self, moves: list) -> None:
        """Every part's share of the accepted draft tree tokens' keys and values moved (`ModelRunner.move_kv`), in
        order with the parts' steps."""
        for actor in self.actors:
            actor.move_kv.remote(moves)
        self.local.move_kv(moves)

    # Blocks sent to another engine (pylon.serving.engine.kv_transfer): every part's share, this part's first and the
    # others' in their order, so that an engine of the same parts writes each share back to its own part.
    def kv_layout(self) -> list:
        import ray

        parts = ray.get([actor.kv_layout.remote() for actor in self.actors])
        return self.local.kv_layout() + [x for part in parts for x in part]

    def read_blocks(self, blocks: list[int]) -> list:
        import ray

        remote = [actor.read_blocks.remote(blocks) for actor in self.actors]
        return self.local.read_blocks(blocks) + [x for part in ray.get(remote) for x in part]

    def write_blocks(self, blocks: list[int], arrays: list) -> None:
        import ray

        sizes = [len(self.local.kv_tensors())] + self._part_sizes()
        parts, at = [], 0
        for n in sizes:
            parts.append(arrays[at : at + n])
            at += n
        if at != len(arrays):
            raise PylonError(f"blocks of {len(arrays)} tensors given to parts holding {at}")
        done = [actor.write_blocks.remote(blocks, part) for actor, part in zip(self.actors, parts[1:])]
        self.local.write_blocks(blocks, parts[0])
        ray.get(done)  # (before a step reads them: the parts' next step is queued after, but a failure shows here)

    def _part_sizes(self) -> list[int]:
        """How many of `kv_tensors` each other part holds (kept: it never changes)."""
        sizes = self.__dict__.get("_kv_part_sizes")
        if sizes is None:
            import ray

            sizes = [len(layout) for layout in ray.get([a.kv_layout.remote() for a in self.actors])]
            self.__dict__["_kv_part_sizes"] = sizes
        return sizes

    def add_scratch_block(self) -> int:
        """The scratch block (`ModelRunner.add_scratch_block`) on every part, at the same slot (a windowed table's null
        block names it on each)."""
        import ray

        remote = [actor.add_scratch_block.remote() for actor in self.actors]
        slot = self.local.add_scratch_block()
        if any(other != slot for other in ray.get(remote)):
            raise PylonError("the parts' KV caches differ in their blocks: their scratch blocks are at other slots")
        return slot

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
