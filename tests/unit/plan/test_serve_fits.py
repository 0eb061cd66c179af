"""`check_serve_fits` (pylon.plan.fits): a Deployment's replica, or a BatchJob's engine, the cluster cannot hold is
refused before it is deployed, saying what does not fit and what to change; what the planner cannot size, or a
cluster it cannot see, is let through. Through `pylon serve` on a real cluster:
tests/integration/test_serving.py::test_pylon_serve_cli_deploys_answers_and_deletes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pylon.home import NodeInfo
from pylon.plan import WontFitError, check_serve_fits
from pylon.specs import BatchJobSpec, DeploymentSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_plan import LLAMA_70B  # noqa: E402

GIB = 2**30
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip


def _node(memory_gib: float, state: str = "ALIVE", **extra: float) -> NodeInfo:
    resources = {"CPU": 8.0, "memory": memory_gib * 0.8 * GIB, "object_store_memory": memory_gib * 0.2 * GIB, **extra}
    return NodeInfo(node_id="n", ip="127.0.0.1", state=state, is_head=True, resources=resources)


def _model(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_cpu_replica_whose_kv_cache_no_node_holds_is_refused_naming_the_field(tmp_path) -> None:
    model = _model(tmp_path, TINY)
    # a KV token of this model: 2 layers x 2 heads x 16 x 2 (keys, values) x 4 bytes (fp32, a CPU engine's dtype) =
    # 512 bytes; 2^26 tokens: 32 GiB
    big = DeploymentSpec(name="m", model=model, engine={"device": "cpu", "kv_cache_tokens": 2**26})
    with pytest.raises(WontFitError) as info:
        check_serve_fits(big, [_node(16), _node(24)])
    message = str(info.value)
    assert message.startswith("Deployment 'm' needs about 32.") and "engine.kv_cache_tokens 67,108,864" in message
    assert "the cluster's largest node has 24.0 GiB" in message and "--force" in message, message
    check_serve_fits(big, [_node(16), _node(64)])  # a node large enough
    with pytest.raises(WontFitError):  # a dead node holds nothing
        check_serve_fits(big, [_node(16), _node(64, state="DEAD")])
    check_serve_fits(big, [])  # a cluster it cannot see: let through
    small = DeploymentSpec(name="m", model=model, engine={"device": "cpu", "kv_cache_tokens": 2**16})
    check_serve_fits(small, [_node(16)])
    # a BatchJob's engine is the same deployment
    batch = BatchJobSpec(name="b", model=model, input="in/", output="out/", engine=big.engine)
    with pytest.raises(WontFitError, match=r"^BatchJob 'b' needs about"):
        check_serve_fits(batch, [_node(24)])


def test_a_gpu_replica_is_planned_on_the_clusters_gpu_and_told_what_would_fit(tmp_path) -> None:
    model = _model(tmp_path, LLAMA_70B)
    gpus = [_node(512, **{"GPU": 8.0, "accelerator_type:H100": 1.0}), _node(64)]
    whole = DeploymentSpec(
        name="big", model=model, replica={"num_gpus": 1}, engine={"device": "cuda", "max_model_len": 4096}
    )
    with pytest.raises(WontFitError) as info:
        check_serve_fits(whole, gpus)
    message = str(info.value)
    assert message.startswith("Deployment 'big' will not fit a replica on H100-SXM, the cluster's GPU: weights")
    assert "tensor-parallel shards" in message and "--force" in message, message  # the plan's suggestion
    sharded = whole.model_copy(update={"engine": whole.engine.model_copy(update={"tensor_parallel": 4})})
    check_serve_fits(sharded, gpus)
    # GPUs the catalog does not know (or none at all): nothing to plan on, let through
    check_serve_fits(whole, [_node(512, **{"GPU": 8.0, "accelerator_type:TPU-V9": 1.0})])
