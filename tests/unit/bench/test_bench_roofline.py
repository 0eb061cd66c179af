"""bench/serve_load.py's roofline: the work it says the engine leg's requests need (projection FLOPs, bytes of cached
keys and values read by decodes) is what the engine really does, counted while it serves a small workload: matmul
FLOPs by torch's FlopCounterMode (the projections through torch.addmm, PYLON_ONEDNN_LINEAR=0), cache reads by the
context lengths every call of the paged-attention kernel attends over."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.model import kernels
from pylon.specs import EngineSpec

BENCH = Path(__file__).resolve().parents[3] / "bench" / "serve_load.py"


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_workload_cost_is_what_the_engine_computes_and_reads(serve_load, tmp_path, monkeypatch):
    monkeypatch.setenv("PYLON_ONEDNN_LINEAR", "0")  # torch.addmm, which FlopCounterMode counts
    args = SimpleNamespace(
        n_layer=3, n_head=4, n_embd=128, n_positions=256, seed=0, device="cpu", dtype="fp32", kv_cache_dtype="auto"
    )
    serve_load.build_model(args, tmp_path)
    rng = random.Random(3)
    # Prompts longer than the step's token budget (chunked prefill) and shorter; outputs of 1 token and more.
    reqs = [
        serve_load.Req(i, "", [rng.randrange(256) for _ in range(p)], o)
        for i, (p, o) in enumerate([(5, 1), (40, 7), (150, 12), (2, 20), (97, 3)])
    ]
    engine = LLMEngine(
        str(tmp_path),
        EngineSpec(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            kv_cache_tokens=2048,
            block_size=16,
            max_model_len=256,
            device="cpu",
            dtype="fp32",
        ),
    )
    calls = []
    uses_kernel = engine.runner.kernel
    if uses_kernel:
        real = kernels.paged_decode

        def counted(q, k_cache, v_cache, block_tables, context_lens, scale):
            calls.append(int(context_lens.sum()) * k_cache.shape[0] * k_cache.shape[-1] * 2 * k_cache.element_size())
            return real(q, k_cache, v_cache, block_tables, context_lens, scale)

        monkeypatch.setattr(kernels, "paged_decode", counted)
    for r in reqs:
        engine.add_request(
            f"r{r.index}", r.ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        )
    generated = 0
    with FlopCounterMode(display=False) as counter:
        while engine.has_unfinished():
            generated += sum(len(o.token_ids) for o in engine.step())
    assert generated == sum(r.max_tokens for r in reqs)
    assert engine.stats().num_preemptions_total == 0  # recomputation is not in the floor

    cost = serve_load.workload_cost(args, reqs)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counts.items() if str(op) in ("aten.addmm", "aten.mm"))
    assert matmuls == cost["projection_flop"]
    assert cost["attention_flop"] > 0 and cost["gflop"] == pytest.approx(
        (cost["projection_flop"] + cost["attention_flop"]) / 1e9
    )
    if not uses_kernel:
        pytest.skip(f"the paged-attention kernel is not built here ({kernels._failed}): cache reads not counted")
    assert sum(calls) == cost["kv_bytes"]


def test_roofline_floor_and_fraction(serve_load):
    cost = {"gflop": 200.0, "kv_gb": 20.0, "projection_flop": 0, "attention_flop": 0, "kv_bytes": 0}
    line = serve_load.roofline(cost, {"gemm_gflops": 100.0, "read_gbs": 25.0}, engine_cpu_s=5.6)
    assert line["floor_cpu_s"] == pytest.approx(2.8)  # 200 / 100 + 20 / 25
    assert line["fraction"] == pytest.approx(0.5)
    assert "2.8 CPU-s" in serve_load.roofline_line(line) and "50%" in serve_load.roofline_line(line)


def test_hardware_rates_measure_something_and_restore_threads(serve_load):
    threads = torch.get_num_threads()
    rates = serve_load.hardware_rates(SimpleNamespace(n_embd=64))
    assert rates["gemm_gflops"] > 0.1 and rates["read_gbs"] > 0.1
    assert torch.get_num_threads() == threads


def test_rounds_alternate_which_of_the_engine_and_http_legs_runs_first(serve_load):
    legs = ["hf-single", "hf-static", "engine", "http"]
    assert serve_load.round_legs(legs, 0) == legs
    assert serve_load.round_legs(legs, 1) == ["hf-single", "hf-static", "http", "engine"]
    assert serve_load.round_legs(legs, 2) == legs
    assert serve_load.round_legs(["http", "engine"], 1) == ["engine", "http"]
    assert serve_load.round_legs(["engine", "hf-single"], 1) == ["engine", "hf-single"]  # no http leg: as given
