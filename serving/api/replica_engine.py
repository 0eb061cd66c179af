"""The engine a replica runs for its deployment's spec: a pool of engine processes (engine.data_parallel), one
engine process (engine.separate_process), or the engine on a thread; a split model's parts in the replica's
placement group. A decoding replica (pylon.serving.api.server) and a prefill replica (pylon.serving.api.prefill)
start theirs the same way."""

from __future__ import annotations

from pylon.specs import DeploymentSpec


def start_engine(spec: DeploymentSpec):
    """`spec.model`'s engine, loaded and running, of `spec.engine`."""
    from pylon.serving.engine.engine import AsyncLLMEngine
    from pylon.serving.engine.process import EnginePool, ProcessLLMEngine

    engine = spec.engine
    kind = EnginePool if engine.data_parallel > 1 else ProcessLLMEngine if engine.separate_process else AsyncLLMEngine
    options = {}
    if (engine.pipeline_parallel > 1 or engine.tensor_parallel > 1) and kind is ProcessLLMEngine:
        from pylon.serving.engine.split import placement

        options["pipeline"] = placement()  # its stages (shards) go in this replica's placement group
    return kind.from_model(spec.model, engine, **options)


def accelerator_name(device) -> str | None:
    """The GPU's name as CUDA reports it (the catalog knows most by an alias), None on a CPU."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return None
