"""`grpo.sampler: server` (pylon.jobs.rollout.SamplingServer): the sampling server, run here in this process as its
Ray actor runs it, builds its engine from the first weights sent, samples what the colocated engine
(`grpo.sampler: engine`) samples for the same rows and seeds, follows the weights it is sent, refuses rows for weights
it does not hold (naming both versions), and samples several workers' rows in the same steps. The actors, the
weights through Ray's object store, the rows gathered from the workers and a run on the cluster:
tests/integration/test_train_grpo.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.errors import PylonError
from pylon.jobs.grpo import GrpoLoss
from pylon.jobs.queue import job_need
from pylon.jobs.rollout import (
    CHUNK_BYTES,
    RolloutEngine,
    SamplingServer,
    engine_spec,
    policy_config,
    policy_tensors,
    worker_rows,
)
from pylon.specs import TrainJobSpec, sampler_kv_cache_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo import EOS, _model, _spec  # noqa: E402
from test_rollout import BYTE, _prompts  # noqa: E402

SEQ_LEN = 64


@pytest.fixture
def run():
    """One event loop for a test's calls, as a Ray actor has one for all of its calls (its condition binds to it)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


def _send(run, server: SamplingServer, module, version: str, spec) -> dict:
    """What RemoteRollout.sync sends, without Ray: the weights in chunks (here lists, not object refs)."""
    espec = engine_spec(spec, SEQ_LEN, on_gpu=False)
    tensors = policy_tensors(module, espec.dtype)
    items = list(tensors.items())
    chunks = [items[i : i + 5] for i in range(0, len(items), 5)]  # several chunks, as a large model's
    return run(server.load(version, policy_config(module, tensors), BYTE, espec.model_dump(mode="json"), chunks))


def _rows(prompts, loss, seed, *, copies, greedy=False, logprobs=False):
    return worker_rows(prompts, loss, EOS, seed, copies=copies, greedy=greedy, logprobs=logprobs)


def test_the_server_samples_what_the_colocated_engine_does_and_follows_the_weights_it_is_sent(run) -> None:
    model = _model()
    with torch.no_grad():  # larger weights: a random model's argmax then depends on every position and token
        for p in model.parameters():
            p.mul_(4)
    spec = _spec(sampler="server")
    prompts = _prompts("Say the letter a, and say it again: ", "Write down a colour name, then stop here: ")
    loss = GrpoLoss(generations=4, max_tokens=10)
    local = RolloutEngine(model, BYTE, spec=_spec(sampler="engine"), device=torch.device("cpu"), seq_len=SEQ_LEN)
    server = SamplingServer("s0")
    assert run(server.current_version()) is None and server.engine is None
    assert _send(run, server, model, "v1", spec)["version"] == "v1"
    assert run(server.current_version()) == "v1" and server.loads == 1

    def both(seed, greedy=False):
        want = [c.tolist() for c in local.sample(prompts, loss, seed=seed, greedy=greedy, logprobs=True)]
        got = run(server.sample(server.version, _rows(prompts, loss, seed, copies=4, greedy=greedy,
                                                               logprobs=True), 4))  # fmt: skip
        return want, got

    want, got = both(seed=3)
    assert got["tokens"] == want and len(want) == 8
    assert len({tuple(x) for x in want}) > 1  # a group's completions differ: sampled, each its own seeded stream
    for drawn, local_drawn in zip(got["logprobs"], local.last_logprobs, strict=True):
        np.testing.assert_allclose(np.asarray(drawn, dtype=np.float32), local_drawn, rtol=1e-5, atol=1e-5)
    # each prompt computed once: its three other copies read its two full blocks of 16 from the prefix cache
    assert got["cached"] == 2 * 3 * 32
    prefill = sum(len(p) for p in prompts) + 3 * sum(len(p) - 32 for p in prompts)
    assert got["computed"] == prefill + sum(len(x) for x in want)
    greedy_want, greedy = both(seed=0, greedy=True)
    assert greedy["tokens"] == greedy_want
    with torch.no_grad():  # an update: sent as v2, the server follows it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    local.current(model)
    _send(run, server, model, "v2", spec)
    assert server.loads == 2
    again_want, again = both(seed=0, greedy=True)
    assert again["tokens"] == again_want and again_want != greedy_want


def test_rows_for_weights_the_server_does_not_hold_are_refused_naming_both_versions(run) -> None:
    model = _model()
    spec = _spec(sampler="server")
    loss = GrpoLoss(generations=2, max_tokens=4)
    rows = _rows(_prompts("abc"), loss, 0, copies=2)
    server = SamplingServer("s1")
    with pytest.raises(PylonError, match=r"server s1: rows for weights v1 but the server holds none"):
        run(server.sample("v1", rows, 2))  # (a server that restarted: no weights yet)
    _send(run, server, model, "v1", spec)
    assert len(run(server.sample("v1", rows, 2))["tokens"]) == 2
    with pytest.raises(PylonError, match=r"rows for weights v2 but the server holds v1"):
        run(server.sample("v2", rows, 2))
    _send(run, server, model, "v2", spec)
    assert run(server.current_version()) == "v2" and server.loads == 2


def test_one_server_samples_several_workers_rows_in_the_same_steps(run) -> None:
    """Two workers' rows in one call (as the first worker sends them): each worker's completions are what it would
    get alone (its own seeded streams), in fewer forward passes than one after the other, and each row's share of
    what the engine computed sums to the whole."""
    model = _model()
    spec = _spec(sampler="server")
    loss = GrpoLoss(generations=2, max_tokens=8)
    server = SamplingServer("s2")
    _send(run, server, model, "v1", spec)
    a = _rows(_prompts("first worker's prompt"), loss, 11, copies=2)
    b = _rows(_prompts("the second one's"), loss, 12, copies=2)
    passes = lambda: server.engine.stats().forward_passes_total  # noqa: E731
    alone, alone_passes = [], []
    for rows in (a, b):
        before = passes()
        alone.append(run(server.sample("v1", rows, 2))["tokens"])
        alone_passes.append(passes() - before)
    before = passes()
    both = run(server.sample("v1", a + b, 2))
    assert both["tokens"] == alone[0] + alone[1]
    # both workers' rows in the same forward passes: about as many as the longer one's alone, not their sum
    assert passes() - before < sum(alone_passes) and min(alone_passes) >= 8, (passes() - before, alone_passes)
    assert sum(both["row_computed"]) == both["computed"] and sum(both["row_cached"]) == both["cached"]


def test_the_server_settings_are_checked_and_counted_in_the_jobs_need() -> None:
    spec = _spec(sampler="server")
    assert spec.grpo.sampler_servers == 1 and spec.grpo.sampler_resources == {"CPU": 1.0}
    with pytest.raises(ValueError, match=r"grpo\.sampler_servers: is grpo\.sampler server's"):
        _spec(sampler="engine", sampler_servers=2)
    with pytest.raises(ValueError, match=r"grpo\.sampler_resources: is grpo\.sampler server's"):
        _spec(sampler_resources={"GPU": 1})
    with pytest.raises(ValueError, match=r"grpo\.sampler_servers: 2 servers for 1 workers"):
        _spec(sampler="server", sampler_servers=2)
    with pytest.raises(ValueError, match=r"grpo\.sampler_resources: holds nothing"):
        _spec(sampler="server", sampler_resources={"CPU": 0})
    # the engine's own settings are the server's too
    assert _spec(sampler="server", sampler_max_num_seqs=8).grpo.sampler_max_num_seqs == 8
    two = TrainJobSpec.model_validate(
        {**spec.model_dump(), "scaling": {"num_workers": 4, "resources_per_worker": {"CPU": 2}},
         "grpo": {**spec.grpo.model_dump(), "sampler_servers": 2, "sampler_resources": {"CPU": 1, "GPU": 1}}}
    )  # fmt: skip
    assert job_need(two) == {"CPU": 10.0, "GPU": 2.0}  # the workers' and the servers'
    # a server's KV cache holds the rows of the 2 workers it samples for (the engine beside a worker: its own)
    beside = two.model_copy(update={"grpo": two.grpo.model_copy(update={"sampler": "engine"})})
    assert sampler_kv_cache_tokens(two, 512) == 2 * sampler_kv_cache_tokens(beside, 512) > 4096
    assert engine_spec(two, SEQ_LEN, on_gpu=True).device == "cuda"
    assert CHUNK_BYTES >= 1 << 20
