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
import time

import torch

from pylon.errors import PylonError
from pylon.serving.engine.split import (
    PartWorker,
    SplitRunner,
    actor_options,
    cause_of,
    connect_ray,
    described_runner,
    log_to_stderr,
    packed,
    replica_placement_group,
    unpacked,
)
from pylon.serving.model.stages import Stage, stage_model_dir, stage_of

log = logging.getLogger(__name__)

STAGE_START_TIMEOUT_S = 900.0  # a stage loads its part of the model (from object storage: minutes)


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
            raise PylonError(f"engine.pipeline_parallel: a stage failed to load {model}: {cause_of(e)}") from None
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
