"""The engine's runner for a model split into tensor-parallel shards across the GPUs of one node
(`engine.tensor_parallel`; vLLM's `tensor_parallel_size`).

Shard 1 is the engine's own process; each other shard is a Ray actor (`ShardWorker`) in a bundle of the replica's
placement group, every bundle on the replica's node (STRICT_PACK: shards talk twice a layer, which only a node's own
links carry at speed). Each holds its slice of every layer and its heads' KV cache (pylon.serving.model.tensor).
A step: the engine schedules as always, sends the step's sequences to every other shard (a Ray call each, not
waited for), and computes it itself; the shards meet in each layer's all-reduces (gloo on CPUs, NCCL on GPUs, in a
torch.distributed group of them alone), so every shard ends the step with the whole logits; the engine samples from
its own. The group's rendezvous is a file in a private directory of the node, and gloo and NCCL are bound to the
loopback interface: nothing listens off the node's loopback.

The shards read the model from the engine's local copy (they are on its node): no shard copies it again.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
import time

import torch

from pylon.errors import PylonError
from pylon.serving.engine.split import PartWorker, SplitRunner, cause_of, packed, unpacked
from pylon.serving.model.stages import Stage
from pylon.serving.model.tensor import Shard

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # the shards load their slices (a large model: minutes)
COLLECTIVE_TIMEOUT_S = 300.0  # a shard that stops answering (its process died): the step fails after this long


def _join(rank: int, count: int, store: str, device: str) -> None:
    """This process as rank `rank` of the shards' torch.distributed group, met at the file `store`."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (the shards share a node: its loopback only)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=count,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def _device(runner_kwargs: dict) -> str:
    wanted = str(runner_kwargs.get("device", "auto"))
    return "cuda" if wanted != "cpu" and torch.cuda.is_available() else "cpu"


class ShardWorker(PartWorker):
    """One tensor-parallel shard after the first (a Ray actor on the engine's node): its `ModelRunner`, which runs
    every step the engine runs. `adapters`: the engine's local copies of engine.adapters (on this node), each served
    as this shard's slice of its matrices."""

    def __init__(
        self,
        directory: str,
        shard: Shard,
        runner_kwargs: dict,
        store: str,
        adapters: list[str] = (),
        stage: Stage | None = None,
    ):
        from pylon.serving.engine.split import log_to_stderr
        from pylon.serving.model.runner import ModelRunner

        where = f"pylon-stage-{stage.index + 1}-shard" if stage is not None and stage.count > 1 else "pylon-shard"
        log_to_stderr(f"{where}-{shard.rank + 1}")
        _join(shard.rank, shard.count, store, _device(runner_kwargs))
        self.shard, self.stage = shard, stage
        self.runner = ModelRunner(directory, shard=shard, stage=stage, adapters=adapters, **runner_kwargs)

    def describe(self) -> dict:
        from pylon.serving.engine.split import described_runner

        return described_runner(self.shard.rank, self.runner, None)

    def part(self) -> str:
        staged = self.stage is not None and self.stage.count > 1
        return f"{self.stage.describe()}, {self.shard.describe()}" if staged else self.shard.describe()

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.runner.warm_up(max_num_seqs, max_num_batched_tokens)

    def run(self, steps, hidden=None) -> None:
        """The step's part of this shard (of a pipeline stage after the first: from the previous stage's output
        `hidden`, as `packed`); what it computes stays here, the first shard's being the same."""
        if hidden is None:
            self.runner.execute_step(steps)
        else:
            self.runner.execute_step(steps, unpacked(hidden)[0])

    def finish(self, steps, hidden) -> None:
        """The first stage's end of a step (`ModelRunner.finish_step`): this shard's rows of the lm_head, gathered."""
        self.runner.finish_step(steps, unpacked(hidden)[0])

    def load_mtp(self, directory: str, runner_kwargs: dict, eagle: str | None = None) -> None:
        """This shard of the checkpoint's multi-token-prediction layer (engine/mtp.py), or of the EAGLE head in
        `directory` (`eagle`: its method), beside this shard of the model, which from now on computes every row's
        final hidden state (or the head's layers' inputs), as the first shard does for the layer (the shards' last
        layers meet in the same collectives)."""
        self.mtp = load_head(self.runner, self.shard, directory, runner_kwargs, eagle)

    def mtp_warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.mtp.warm_up(max_num_seqs, max_num_batched_tokens)

    def run_mtp(self, steps, hidden) -> None:
        """A pass of the layer (its input `hidden`, as `packed`); its output stays here, the first shard's the same."""
        self.mtp.execute_step(steps, unpacked(hidden)[0])

    def mtp_head(self, hidden) -> None:
        """The layer's outputs' logits: this shard's rows of the lm_head, gathered."""
        self.mtp.head_logits(unpacked(hidden)[0])

    def mtp_offload_to_host(self, slots: int, path: str | None = None) -> int:
        return self.mtp.offload_to_host(slots, path)

    def mtp_copy_blocks(self, copies: list) -> None:
        self.mtp.copy_blocks(copies)

    def mtp_kv_layout(self) -> list:
        return self.mtp.kv_layout()

    def mtp_read_blocks(self, blocks: list[int]) -> list:
        return self.mtp.read_blocks(blocks)

    def mtp_write_blocks(self, blocks: list[int], arrays: list) -> None:
        self.mtp.write_blocks(blocks, arrays)


class TensorRunner(SplitRunner):
    """`ModelRunner`'s interface (what the engine uses of it) over the tensor-parallel shards of a model: shard 1 in
    this process, the rest Ray actors on this node (see the module's docstring). `directory`: this process's local
    copy of the model, which the other shards read too; `placement`: `placement()` of the replica whose engine
    process this is (pylon.serving.engine.split; None: this process's own); `adapters`: this process's copies of
    engine.adapters, which the other shards read too (each shard serves its slice of their matrices);
    `expert_parallel`: an MoE model's experts divided among the shards whole (`Shard.experts`).

    `stage`: the shards of that pipeline stage (engine.pipeline_parallel with engine.tensor_parallel): the runner of
    the engine's process (the first stage) or of a stage's actor (engine/pipeline.py's `StageWorker`), its shards in
    a group of their own on its node, all in the stage's bundle of the replica's placement group (each its share of
    it); `execute_step` takes the previous stage's output then, and the first stage's shards make the logits
    together (`finish_step`)."""

    def __init__(
        self,
        directory: str,
        count: int,
        runner_kwargs: dict,
        placement: dict | None = None,
        adapters: list[str] = (),
        expert_parallel: bool = False,
        stage: Stage | None = None,
    ):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pylon.serving.engine.split import actor_options, connect_ray, described_runner, replica_placement_group
        from pylon.serving.model.runner import ModelRunner

        started = time.monotonic()
        placement = placement or {}
        ray = connect_ray(placement.get("address"))
        group = replica_placement_group(ray, placement.get("placement_group"))
        device = _device(runner_kwargs)
        self._rendezvous = tempfile.mkdtemp(prefix="pylon-tp-")  # (0700: this user's alone)
        store = os.path.join(self._rendezvous, "store")
        worker = ray.remote(ShardWorker)
        node = ray.get_runtime_context().get_node_id()
        self.workers = []
        self._puts: list = []  # the other shards' put_adapter calls, waited for before the next step
        adapters = list(adapters)
        self.of_stage = stage  # (None: the whole model's shards)
        for k in range(1, count):
            on_node = NodeAffinitySchedulingStrategy(node, soft=False)
            # each shard a bundle of its own, or a stage's shards sharing the stage's
            bundle, share = (k, 1) if stage is None else (stage.index, count)
            options = actor_options(group, bundle, runner_kwargs, on_node, share)
            self.workers.append(
                worker.options(**options).remote(
                    directory, Shard(k, count, expert_parallel), runner_kwargs, store, adapters, stage
                )
            )
        try:
            _join(0, count, store, device)
            self.local = ModelRunner(
                directory, shard=Shard(0, count, expert_parallel), stage=stage, adapters=adapters, **runner_kwargs
            )
            described = ray.get([w.describe.remote() for w in self.workers], timeout=START_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            self.shutdown()
            raise PylonError(f"engine.tensor_parallel: a shard failed to load the model: {cause_of(e)}") from None
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise PylonError(
                f"engine.tensor_parallel: the shards did not load within {START_TIMEOUT_S:.0f} s: this node may "
                "have no room for them (each asks for its placement group bundle, or one CPU or GPU of the node)"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        self.described = [described_runner(0, self.local, None), *described]
        of = f"{stage.describe()}: " if stage is not None and stage.count > 1 else ""
        for d in self.described:
            log.info(
                "%stensor-parallel shard %d of %d: %.1f MiB of weights, %.1f MiB of KV cache, node %s, pid %d",
                of,
                d["index"] + 1,
                count,
                d["weights_bytes"] / 2**20,
                d["kv_cache_bytes"] / 2**20,
                d["node"][:12],
                d["pid"],
            )
        log.info("%s%d tensor-parallel shards loaded in %.1f s", of, count, time.monotonic() - started)

    @torch.no_grad()
    def execute_step(self, steps, hidden: torch.Tensor | None = None):
        """The step on every shard (`hidden`: a pipeline stage's input, the previous stage's output); the first
        shard's outputs (every shard's are the same)."""
        import ray

        self._placed()  # adapters placed since the last step: on every shard before this step computes
        sent = None if hidden is None or not self.workers else ray.put(packed(hidden))  # (once for all shards)
        done = [w.run.remote(steps, sent) for w in self.workers]  # every shard computes the step; they meet in it
        if hidden is None:
            return self._together(done, lambda: self.local.execute_step(steps))
        return self._together(done, lambda: self.local.execute_step(steps, hidden))

    @torch.no_grad()
    def finish_step(self, steps, hidden: torch.Tensor):
        """The first pipeline stage's end of a step (`ModelRunner.finish_step`), every shard computing its rows of the
        lm_head, gathered."""
        return self.with_hidden(
            hidden, lambda w, sent: w.finish.remote(steps, sent), lambda: self.local.finish_step(steps, hidden)
        )

    def with_hidden(self, hidden: torch.Tensor, call, compute):
        """`compute()` here while every other shard runs `call(worker, hidden as sent)` (`hidden` put once for all)."""
        import ray

        sent = ray.put(packed(hidden)) if self.workers else None
        return self._together([call(w, sent) for w in self.workers], compute)

    def _together(self, done: list, compute):
        """`compute()` (this shard's part) while the other shards compute theirs (`done`, their calls); a shard
        gone (its process killed) breaks the collectives at once, and is named."""
        import ray

        try:
            out = compute()
            ray.get(done)
        except Exception as e:
            lost = self._lost(done)
            if not lost:
                raise
            raise PylonError(
                f"engine.tensor_parallel: {lost}; this engine cannot step without it (a replica's engine stops, and "
                "Serve replaces the replica)"
            ) from e
        return out

    def _lost(self, done: list) -> str:
        """The shards whose step failed, and why ("" when none did)."""
        import ray

        lost = []
        stage = self.of_stage
        of = f"{stage.describe()}'s " if stage is not None and stage.count > 1 else ""
        for k, ref in enumerate(done, start=2):
            try:
                ray.get(ref, timeout=10)
            except Exception as e:  # RayActorError (its process gone), RayTaskError, GetTimeoutError
                why = "its process is gone" if isinstance(e, ray.exceptions.RayActorError) else type(e).__name__
                lost.append(f"{of}shard {k} of {len(done) + 1} failed ({why})")
        return ", ".join(lost)

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        import ray

        remote = [w.warm_up.remote(max_num_seqs, max_num_batched_tokens) for w in self.workers]
        done = self.local.warm_up(max_num_seqs, max_num_batched_tokens)
        ray.get(remote)
        return done

    def load_mtp(self, directory: str, runner_kwargs: dict, eagle: str | None = None) -> "TensorMtp":
        """The checkpoint's multi-token-prediction layer in this runner's shards, or the EAGLE head in `directory`
        (`eagle`: its method), each shard's beside its part of the model, which from now on keeps every row's final
        hidden state (`ModelRunner.keep_hidden`; an EAGLE-3 head's layers' inputs); its runner's interface for
        engine/mtp.py."""
        import ray

        count = len(self.workers) + 1
        loaded = [w.load_mtp.remote(directory, runner_kwargs, eagle) for w in self.workers]
        try:
            local = load_head(self.local, self.local.shard, directory, runner_kwargs, eagle)
            ray.get(loaded, timeout=START_TIMEOUT_S)
        except ray.exceptions.RayTaskError as e:
            raise PylonError(str(cause_of(e))) from None
        what = f"the {eagle} head" if eagle else "the multi-token-prediction layer"
        log.info("%s loaded in %d tensor-parallel shards", what, count)
        return TensorMtp(self, local)

    @property
    def actors(self) -> list:
        return self.workers

    def fixed_weights(self) -> str | None:
        return "it is split into tensor-parallel shards (engine.tensor_parallel)"

    def shutdown(self) -> None:
        import ray
        import torch.distributed as dist

        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._rendezvous, ignore_errors=True)


def load_head(runner, shard, directory: str, runner_kwargs: dict, eagle: str | None):
    """Shard `shard`'s runner of the multi-token-prediction layer of the checkpoint in `directory` beside `runner`
    (that shard's of the model), or of the EAGLE head there (`eagle`: its method, the head read and checked against
    the whole model), the model's runner told to keep what it reads."""
    from pylon.serving.model import eagle as eagle_head
    from pylon.serving.model.runner import ModelRunner

    head = eagle_head.read(directory, eagle, runner.full_config.get_text_config()) if eagle else None
    runner.keep_hidden = True
    runner.keep_layers = head.aux_layers if head is not None else ()
    return ModelRunner(directory, shard=shard, mtp=runner, eagle=head, **runner_kwargs)


class TensorMtp:
    """The multi-token-prediction layer's runner interface (what engine/mtp.py uses) over a `TensorRunner`'s shards:
    each pass on every shard (its input sent once to all), the first shard's outputs returned."""

    def __init__(self, tensor: TensorRunner, local) -> None:
        self.tensor, self.local = tensor, local

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
        import ray

        remote = [w.mtp_warm_up.remote(max_num_seqs, max_num_batched_tokens) for w in self.tensor.workers]
        done = self.local.warm_up(max_num_seqs, max_num_batched_tokens)
        ray.get(remote)
        return done

    @torch.no_grad()
    def execute_step(self, steps, hidden: torch.Tensor):
        return self.tensor.with_hidden(
            hidden, lambda w, sent: w.run_mtp.remote(steps, sent), lambda: self.local.execute_step(steps, hidden)
        )

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tensor.with_hidden(
            hidden, lambda w, sent: w.mtp_head.remote(sent), lambda: self.local.head_logits(hidden)
        )

    def mtp_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.mtp_hidden(hidden)  # (the layer's final norm: whole on every shard)

    def offload_to_host(self, slots: int, path: str | None = None) -> int:
        """The layer's share of the prefix cache's host tier on every shard (`SplitRunner.offload_to_host`)."""
        import ray

        remote = [w.mtp_offload_to_host.remote(slots, path) for w in self.tensor.workers]
        local = self.local.offload_to_host(slots, path)
        try:
            return local + sum(ray.get(remote))
        except ray.exceptions.RayTaskError as e:
            raise PylonError(str(cause_of(e))) from None

    def copy_blocks(self, copies: list) -> None:
        for w in self.tensor.workers:
            w.mtp_copy_blocks.remote(copies)
        self.local.copy_blocks(copies)

    # The layer's share of blocks sent to another engine, as `SplitRunner.read_blocks` (every shard holds as many).
    def kv_layout(self) -> list:
        import ray

        parts = ray.get([w.mtp_kv_layout.remote() for w in self.tensor.workers])
        return self.local.kv_layout() + [x for part in parts for x in part]

    def read_blocks(self, blocks: list[int]) -> list:
        import ray

        remote = [w.mtp_read_blocks.remote(blocks) for w in self.tensor.workers]
        return self.local.read_blocks(blocks) + [x for part in ray.get(remote) for x in part]

    def write_blocks(self, blocks: list[int], arrays: list) -> None:
        import ray

        n = len(self.local.kv_tensors())
        done = [
            w.mtp_write_blocks.remote(blocks, arrays[n * (i + 1) : n * (i + 2)])
            for i, w in enumerate(self.tensor.workers)
        ]
        self.local.write_blocks(blocks, arrays[:n])
        ray.get(done)
