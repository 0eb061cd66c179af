"""pylon.serving's engine beyond one synchronous loop: the asyncio engine and its health, half precision and
device choices, narrower KV caches, the engine process and its pool, coalesced streams, and the CPU paths
(oneDNN projections, padded rows, fixed-shape decode steps, one-copy uploads), each against `transformers`'
own greedy outputs."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_models import (
    DEVICE,
    GREEDY,
    NEW_TOKENS,
    ON_CUDA,
    PROMPTS,
    Family,
    assert_pool_empty,
    eventually,
    run,
    spec,
    tokens_of,
)
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.serving.engine.engine import AsyncLLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import EngineDeadError, InvalidRequest
from pylon.specs import EngineSpec

# ---------------------------------------------------------------------------------------------------------
# AsyncLLMEngine
# ---------------------------------------------------------------------------------------------------------


def test_async_concurrent_generate_and_abort_by_cancelling(gpt2: Family) -> None:
    engine = AsyncLLMEngine(gpt2.engine())
    try:
        assert engine.check_health()

        async def collect(i: int) -> list:
            return [out async for out in engine.generate(f"c{i}", PROMPTS[i], GREEDY)]

        async def cancel_midway() -> list:
            got, first = [], asyncio.Event()

            async def consume():
                async for out in engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=240, temperature=0)):
                    got.append(out)
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return got

        async def main():
            return await asyncio.gather(cancel_midway(), *(collect(i) for i in range(6)))

        cancelled, *streams = asyncio.run(main())
        for i, outs in enumerate(streams):
            assert tokens_of(outs) == gpt2.greedy[i]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert outs[0].metrics.time_to_first_token >= outs[0].metrics.queue_time >= 0
            assert [o.num_output_tokens for o in outs] == list(range(1, len(outs) + 1))
        assert 1 <= len(cancelled) < 240

        assert eventually(lambda: engine.stats().requests_finished_total.get("abort") == 1)
        stats = engine.stats()
        assert stats.requests_finished_total == {"abort": 1, "length": 6}
        assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
        assert engine.check_health()

        async def invalid():
            async for _ in engine.generate("bad", "hi", SamplingParams(max_tokens=1000)):
                pass

        with pytest.raises(InvalidRequest) as e:
            asyncio.run(invalid())
        assert e.value.param == "max_tokens"
    finally:
        engine.shutdown()
    assert not engine.check_health()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.generate("late", "hi", GREEDY).__anext__())


def test_async_health_follows_the_step_loop(gpt2: Family) -> None:
    inner = gpt2.engine()
    engine = AsyncLLMEngine(inner, heartbeat_timeout_s=0.5)
    execute, release = inner.runner.execute_step, threading.Event()
    try:

        def stuck(*args):
            release.wait(30)
            return execute(*args)

        inner.runner.execute_step = stuck
        inner.add_request("stuck", PROMPTS[0], GREEDY)  # the idle loop finds it within IDLE_WAIT_S
        assert eventually(lambda: not engine.check_health())  # a loop stuck in a step is not healthy
        release.set()
        assert eventually(engine.check_health)

        def crash(*args):
            raise RuntimeError("device lost")

        inner.runner.execute_step = crash

        async def main():
            async for _ in engine.generate("doomed", PROMPTS[1], GREEDY):
                pass

        with pytest.raises(EngineDeadError, match="device lost"):
            asyncio.run(main())
        assert not engine.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()


def test_half_precision_and_device_choices(gpt2: Family) -> None:
    engine = gpt2.engine(dtype="bf16")
    assert engine.runner.k_cache[0].dtype == torch.bfloat16
    [c] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert len(c.token_ids) == NEW_TOKENS  # bf16 rounding may pick other tokens than fp32; it must still run
    # auto: fp32 on a CPU; bf16 on a GPU that has it (fp16 on one that does not)
    auto = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if ON_CUDA else torch.float32
    assert gpt2.engine(dtype="auto").runner.k_cache[0].dtype == auto
    if not torch.cuda.is_available():
        with pytest.raises(PylonError, match="no CUDA device"):
            gpt2.engine(device="cuda")


@pytest.mark.skipif(not ON_CUDA, reason="half-precision serving is a GPU's (PYLON_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_on_a_gpu_follows_the_models_own_greedy(family: Family, dtype: str) -> None:
    """The whole model in bf16/fp16 on the GPU (what `dtype: auto` serves there), eight prompts batched: each
    one's first token comes from its prefill and its second from the first decode over the paged cache, and both
    equal what `transformers` computes in the same dtype on the prompt alone (for all but at most one prompt: a
    near-tie may flip). Later tokens may part: a batched
    and a single-sequence matmul round differently in 8 or 11 mantissa bits, and a flipped near-tie changes the
    rest."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reference = AutoModelForCausalLM.from_pretrained(family.dir, dtype=torch_dtype).to(DEVICE).eval()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=DEVICE)
        out = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            do_sample=False,
            eos_token_id=256,
            pad_token_id=257,
        )
        expected.append(out[0, len(prompt) :].tolist())
    engine = family.engine(dtype=dtype)
    assert engine.runner.model.dtype == torch_dtype and engine.runner.k_cache[0].dtype == torch_dtype
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = [r.token_ids[:2] for r in engine.generate(PROMPTS, GREEDY)]
    assert sum(g == e for g, e in zip(got, expected)) >= len(PROMPTS) - 1, (got, expected)
    assert_pool_empty(engine)
    # The prompts went through flash or memory-efficient attention, not cuDNN's (which plans every new shape on the
    # host: pylon.serving.model.attention.GPU_PROMPT_BACKENDS).
    ops = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops and not any("cudnn_attention" in op for op in ops), ops


def test_every_eager_step_runs_inside_the_devices_attention_backends(gpt2: Family, monkeypatch) -> None:
    """The runner enters prompt_attention_backends(its device) around every step it runs eagerly (on a GPU, steps of
    decodes only replay a CUDA graph instead), so that on CUDA no prompt chunk reaches cuDNN's attention."""
    import contextlib

    from pylon.serving.model import runner as model_runner

    entered = []

    @contextlib.contextmanager
    def spy(device):
        entered.append(device.type)
        yield

    monkeypatch.setattr(model_runner, "prompt_attention_backends", spy)
    engine = gpt2.engine()
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], GREEDY)] == gpt2.greedy[:2]
    assert set(entered) == {DEVICE}
    assert len(entered) >= (1 if ON_CUDA else NEW_TOKENS)  # a CPU runs all ~20 steps eagerly


def test_a_gpu_step_keeps_sdpa_off_cudnns_attention_and_puts_the_backends_back() -> None:
    """prompt_attention_backends: on CUDA, flash and memory-efficient attention (and math) but not cuDNN's, for the
    step only; on a CPU nothing changes (the flags are torch's process-wide settings, so this runs anywhere)."""
    from pylon.serving.model.attention import prompt_attention_backends

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    assert before == (True, True, True)
    with prompt_attention_backends(torch.device("cuda")):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    with prompt_attention_backends(torch.device("cpu")):
        assert cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
def test_a_narrower_kv_cache_stays_close_to_the_models_own_greedy(family: Family, kv: str) -> None:
    """kv_cache_dtype: the cache holds keys and values in `kv` (half or a quarter of float32's bytes), so outputs
    are close to the model's own but not exact. Every prompt chunk attends over keys read back from the narrow cache
    (the first one too, so that outputs are the same with prefix caching on and off: test_prefix_cache.py): bf16
    and fp16 give transformers' first 2 tokens of every prompt here and most of the 20 (2-20 agree, 16 on average;
    with a float32 cache all 20 do), fp8's 3 mantissa bits a third of the first tokens and soon part from it. The
    kernel and the PyTorch path read the same cache and must agree token for token."""
    results = {}
    for kernel in (False,) if ON_CUDA else (True, False):  # the compiled kernel is a CPU's
        engine = family.engine(kv_cache_dtype=kv, max_num_batched_tokens=512)  # no prompt is chunked
        assert (
            engine.runner.k_cache[0].dtype
            == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[kv]
        )
        assert engine.runner.kernel is not ON_CUDA  # the kernel reads narrow caches (fp32 compute on a CPU)
        engine.runner.kernel = kernel
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        outputs = run(engine)
        results[kernel] = [tokens_of(outputs[f"r{i}"]) for i in range(len(PROMPTS))]
        assert_pool_empty(engine)
    if True in results:
        assert results[True] == results[False]
    if kv == "fp8":  # a wrong widening would match 1 in 320 by chance
        assert sum(got[0] == expected[0] for got, expected in zip(results[False], family.greedy)) >= 3
    else:
        assert all(got[:2] == expected[:2] for got, expected in zip(results[False], family.greedy))
        agree = [
            next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e))
            for g, e in zip(results[False], family.greedy)
        ]
        assert sum(agree) >= 10 * len(agree), agree
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineSpec(kv_cache_dtype="int4")


def test_many_concurrent_requests_beyond_max_num_seqs_match_transformers_greedy(family: Family) -> None:
    """24 requests of mixed lengths submitted at once to the asyncio engine with max_num_seqs = 6: requests
    wait, join as others finish, and every one's greedy output equals `generate` on its prompt alone."""
    g = torch.Generator().manual_seed(7)
    lengths = [int(n) for n in torch.randint(2, 70, (24,), generator=g)]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    expected = [family.hf_greedy(p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0)

    engine = AsyncLLMEngine(family.engine(max_num_seqs=6, max_num_batched_tokens=96))
    most_running = []

    async def one(i: int) -> list[int]:
        tokens = []
        async for out in engine.generate(f"c{i}", prompts[i], params):
            tokens.extend(out.token_ids)
            most_running.append(engine.stats().num_running)
        return tokens

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == expected
    assert max(most_running) == 6  # the batch was full, and the rest waited their turn
    assert_pool_empty(engine.engine)


# ---------------------------------------------------------------------------------------------------------
# Coalesced streams and the engine in a child process (what a Serve replica runs)
# ---------------------------------------------------------------------------------------------------------


def test_an_interval_coalesces_a_stream_without_changing_its_tokens(gpt2: Family) -> None:
    engine = AsyncLLMEngine(gpt2.engine())
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    async def run(interval: float, busy_s: float = 0.0) -> list:
        times, outs = [], []
        async for out in engine.generate(f"i{interval}", PROMPTS[2], params, interval_s=interval):
            outs.append(out)
            times.append(time.monotonic())
            await asyncio.sleep(busy_s)  # a consumer that awaits (a replica writing a chunk): outputs queue meanwhile
        return outs, times

    try:
        every, every_times = asyncio.run(run(0.0))
        # The consumer stays busy for a few steps' worth of time per chunk, so outputs queue behind it however long a
        # step takes here (a fixed 1 ms was shorter than a step on a loaded machine: nothing queued, nothing joined).
        per_step = (every_times[-1] - every_times[0]) / (len(every_times) - 1)
        merged, times = asyncio.run(run(0.005, busy_s=max(0.001, 3 * per_step)))
    finally:
        engine.shutdown()
    assert len(every) == 60 and all(len(o.token_ids) == 1 for o in every)
    assert tokens_of(merged) == tokens_of(every) and "".join(o.text for o in merged) == "".join(o.text for o in every)
    assert len(merged[0].token_ids) == 1  # the first token is never held back
    assert len(merged) < len(every)  # later ones are joined...
    # ...at least half an interval apart (next_tick), all but the last, which is heard at once. Counted, not
    # timed gap by gap: a descheduled consumer only stretches the span, so this holds on a loaded machine.
    # A stream that took queued outputs without waiting for the tick gave a chunk per step here.
    span = times[-2] - times[0]
    assert len(merged) - 2 <= span / 0.0025 + 1, (len(merged), span)
    assert [o.finished for o in merged].count(True) == 1 and merged[-1].finish_reason == "length"
    assert merged[-1].num_output_tokens == 60


def test_a_coalesced_stream_hears_its_end_at_once_not_at_the_next_tick(gpt2: Family) -> None:
    """A request that finishes while its stream waits for a tick ends the stream at once: a closed-loop
    client sends its next request then, and until it does its sequence slot in the engine stands empty."""
    engine = AsyncLLMEngine(gpt2.engine())
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    interval = 2.0  # the next tick is at least 1 s after the first output; the 3 later tokens take milliseconds

    async def run() -> tuple[list, float]:
        outs = []
        async for out in engine.generate("end", PROMPTS[1], params, interval_s=interval):
            outs.append(out)
        return outs, time.monotonic()

    try:
        outs, ended = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outs] == [1, 3]  # the first alone, the rest merged into the last
    assert outs[-1].finish_reason == "length"
    assert ended - outs[-1].metrics.last_token_time < 0.5, ended - outs[-1].metrics.last_token_time


def test_coalesced_streams_wake_together_on_shared_ticks() -> None:
    from pylon.serving.engine.engine import next_tick

    interval = 0.05
    for now in (1000.0, 1000.001, 1000.0249, 1000.025, 1000.049, 1000.0999):
        tick = next_tick(now, interval)
        assert 0.025 - 1e-9 <= tick - now <= 0.075 + 1e-9, (now, tick)  # once an interval on average
        assert abs(tick / interval - round(tick / interval)) < 1e-6  # a multiple of it: every stream's tick
    # Streams that took outputs at different moments of one interval take their next ones together.
    assert len({round(next_tick(1000.0 + t / 1000, interval), 9) for t in range(0, 25)}) == 1


@pytest.mark.slow  # make test-all: ~12 s
def test_an_engine_process_holds_outputs_for_coalesced_streams_only(gpt2: Family) -> None:
    """Streams that take outputs every 50 ms get the child's steps in fewer messages (first and last tokens at
    once), each with one output per request (the held steps merged); a stream that takes every step gets one
    message per step. The tokens are the same either way."""
    from pylon.serving.engine.process import ProcessLLMEngine

    engine = ProcessLLMEngine.from_model(
        gpt2.dir, spec(max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tokens=4096)
    )
    received = []
    deliver = engine._deliver_step
    engine._deliver_step = lambda outputs: (received.append([o.request_id for o in outputs]), deliver(outputs))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def run(interval: float) -> list:
        async def one(i: int) -> list:
            return [o async for o in engine.generate(f"{interval}-{i}", PROMPTS[i], params, interval_s=interval)]

        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        every = asyncio.run(run(0.0))
        messages_every = len(received)
        received.clear()
        held = asyncio.run(run(0.05))
        messages_held = len(received)
        merged = all(len(ids) == len(set(ids)) for ids in received)
    finally:
        engine.shutdown()
    assert [tokens_of(o) for o in held] == [tokens_of(o) for o in every]
    assert all(len(o[0].token_ids) == 1 and o[-1].finish_reason == "length" for o in held)
    assert messages_every >= 40  # one per step
    assert messages_held < messages_every / 2, (messages_held, messages_every)
    assert merged, received  # a request's held steps arrive as one output


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_request_the_engine_fails_to_take_fails_alone(gpt2: Family, where: str) -> None:
    """A fault of ours in taking one request fails that request (RequestFailed: a 500 for it alone) and the engine
    serves on, whether its loop is a thread or a process. Here the fault is a SamplingParams whose stop list was
    corrupted after it was validated, as a bug elsewhere might leave it. An engine process used to die of it: every
    request after it got EngineDeadError."""
    from pylon.serving.engine.process import ProcessLLMEngine
    from pylon.serving.errors import RequestFailed

    kind = ProcessLLMEngine if where == "process" else AsyncLLMEngine
    engine = kind.from_model(gpt2.dir, spec())
    try:
        broken = SamplingParams(max_tokens=3, temperature=0)
        broken.stop = [3]  # not a string: the request's detokenizer cannot be built

        async def run(request_id: str, params: SamplingParams) -> list:
            return [out async for out in engine.generate(request_id, PROMPTS[0], params)]

        with pytest.raises(RequestFailed) as e:
            asyncio.run(run("broken", broken))
        assert "could not take the request (TypeError" in str(e.value)
        assert tokens_of(asyncio.run(run("after", GREEDY))) == gpt2.greedy[0]
        assert engine.check_health()
    finally:
        engine.shutdown()


def test_engine_in_a_child_process_streams_the_same_tokens_refuses_and_dies_cleanly(gpt2: Family) -> None:
    from pylon.serving.engine.process import ProcessLLMEngine

    engine = ProcessLLMEngine.from_model(gpt2.dir, spec(max_num_seqs=3, max_num_batched_tokens=96))
    try:
        assert engine.check_health() and engine.max_model_len == 256
        assert engine.tokenizer.decode(engine.tokenizer.encode("def f():")) == "def f():"
        # A CPU engine serves under SCHED_BATCH, every thread of the child (its torch threads included); a GPU's
        # keeps the default policy (pylon.serving.engine.sched_batch).
        assert engine.device == DEVICE
        policies = {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{engine._proc.pid}/task")}
        assert policies == {os.SCHED_BATCH if DEVICE == "cpu" else os.SCHED_OTHER}
        # A CPU engine runs on TCMalloc where it is installed (`make setup` installs it), a GPU's on glibc's
        # (pylon.serving.engine.heap); the greedy tokens below are the same either way.
        from pylon.serving.engine.heap import tcmalloc_path

        maps = open(f"/proc/{engine.pid}/maps").read()
        if DEVICE == "cpu" and tcmalloc_path():
            assert engine.allocator == "tcmalloc" and tcmalloc_path() in maps
        else:
            assert engine.allocator == "glibc" and "tcmalloc" not in maps

        async def collect(i: int) -> list:
            return [out async for out in engine.generate(f"p{i}", PROMPTS[i], GREEDY)]

        async def invalid():
            async for _ in engine.generate("bad", "hi", SamplingParams(max_tokens=1000)):
                pass

        async def main():
            return await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))

        streams = asyncio.run(main())  # 8 requests, 3 at a time: they queue and join in the child
        for i, outs in enumerate(streams):
            assert tokens_of(outs) == gpt2.greedy[i]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        with pytest.raises(InvalidRequest) as e:  # refused in the child, raised here, naming the field
            asyncio.run(invalid())
        assert e.value.param == "max_tokens" and "max_model_len (256)" in str(e.value)
        assert eventually(lambda: engine.stats().num_free_blocks == engine.stats().num_blocks)
        assert engine.stats().requests_finished_total == {"length": len(PROMPTS)}

        async def killed_midway():
            async for out in engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=240, temperature=0)):
                engine._proc.kill()  # the child dies under a running request (OOM killer, a segfault)

        with pytest.raises(EngineDeadError, match="exited with code -9"):
            asyncio.run(killed_midway())
        assert not engine.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(1))
    finally:
        engine.shutdown()


@pytest.mark.slow  # make test-all: ~12 s
def test_engine_process_reports_a_model_it_cannot_load(tmp_path: Path) -> None:
    from pylon.serving.engine.process import ProcessLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PylonError, match="has no tokenizer; expected Hugging Face tokenizer files"):
        ProcessLLMEngine.from_model(str(tmp_path), EngineSpec(device="cpu"))


@pytest.mark.skipif(ON_CUDA, reason="oneDNN projections are a CPU's")
def test_cpu_projections_go_through_onednn_and_keep_greedy_parity(family: Family, monkeypatch) -> None:
    """On a CPU the projections run on oneDNN over weights reordered at load (pylon.serving.model.linear), the modules'
    own copies released; the greedy continuations stay `transformers`' own, as with `PYLON_ONEDNN_LINEAR=0`."""
    from pylon.serving.model import linear

    if not linear.usable(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no usable oneDNN")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    packed = family.engine()
    assert packed.runner.packed_linear
    if family.name == "gpt2":
        assert packed.runner.model.transformer.h[0].attn.c_attn.weight is None
    else:
        assert isinstance(packed.runner.model.model.layers[0].mlp.down_proj, linear.PackedLinear)
    monkeypatch.setenv("PYLON_ONEDNN_LINEAR", "0")
    plain = family.engine()
    assert not plain.runner.packed_linear
    for engine in (packed, plain):
        assert [c.token_ids for c in engine.generate(PROMPTS, params)] == family.greedy


def test_no_step_compiles_a_kernel_and_prompt_steps_run_padded_rows(family: Family, capfd) -> None:
    """oneDNN compiles a kernel per row count (pylon.serving.model.linear): the engine compiles every count its steps
    will use when it starts (`ModelRunner.warm_up`), steps with a prompt chunk run `padded_rows` rows, and then
    serving mixed prompt lengths in chunks compiles nothing, the continuations still `transformers`' own."""
    import ctypes
    import re

    from pylon.serving.model import linear
    from pylon.settings import switched_on

    if ON_CUDA or not linear.usable(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN projections are the CPU's")
    if not switched_on("PYLON_PADDED_ROWS"):
        pytest.skip("PYLON_PADDED_ROWS=0 in the environment")
    engine = family.engine(max_num_batched_tokens=64)  # prompts of up to 90 tokens go in chunks
    assert engine.runner.pad_rows
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    ctypes.CDLL(None).fflush(None)  # oneDNN prints through C's stdout buffer
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("onednn_verbose")]
    assert got == family.greedy
    created = [line for line in lines if ",create" in line]
    assert created, "the projections did not go through oneDNN"
    assert not [line for line in created if "cache_miss" in line]
    rows = {int(m.group(1)) for line in created if (m := re.search(r",mb(\d+)ic\d+oc\d+", line))}
    allowed = set(linear.row_counts(8, 64))
    assert rows <= allowed and max(rows) > 8 and all(r % 16 == 0 for r in rows if r > 8)


def test_fixed_shape_sizes_cover_every_step_up_to_the_limits() -> None:
    from pylon.serving.model.graphs import batch_sizes, block_counts

    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_sizes(5) == [1, 2, 4, 5] and batch_sizes(1) == [1] and batch_sizes(8) == [1, 2, 4, 8]
    assert block_counts(64) == [4, 8, 16, 32, 64] and block_counts(3) == [3] and block_counts(6) == [4, 6]


def test_decode_steps_in_fixed_shapes_match_transformers_greedy(family: Family, monkeypatch) -> None:
    """Steps of decodes only run in one of a few fixed shapes (pylon.serving.model.graphs): rows padded to a batch size,
    their keys and values stored in a scratch block, block tables padded to a block count, the bias made from the
    context lengths. On a GPU those steps replay CUDA graphs; on a CPU the same fixed-shape step runs eagerly
    (capture=False). Either way the continuations stay transformers' own: had a padding row written anywhere but the
    scratch block (block 0 holds the first request's first tokens), or a padded key been attended, they would not."""
    from pylon.serving.model.graphs import DecodeGraphs

    engine = family.engine()
    runner = engine.runner
    if ON_CUDA:  # engine.cuda_graphs defaults to true
        assert runner.decode_graphs is not None and runner.decode_graphs.capture
    else:
        assert runner.decode_graphs is None
        runner.add_scratch_block()
        runner.decode_graphs = DecodeGraphs(runner, 8, engine.max_model_len, capture=False)
        assert runner.decode_graphs.capture_all() == 4 * 3  # rows 1, 2, 4, 8; blocks 4, 8, 16
    graphs = runner.decode_graphs
    replayed = set()
    for shape, graph in graphs.graphs.items():
        graph.replay = (lambda shape, replay: lambda: (replayed.add(shape), replay()))(shape, graph.replay)
    assert runner.scratch_slot == engine.pool.num_blocks * 16
    assert runner.k_cache[0].shape[1] == runner.v_cache[-1].shape[1] == engine.pool.num_blocks + 1
    # Five requests decode as 8 rows (three of them padding) over 8 blocks each, two as 2 rows, the 8-token prompt
    # alone over 4 blocks.
    got = []
    for part in (PROMPTS[:5], PROMPTS[5:7], PROMPTS[7:]):
        got += [c.token_ids for c in engine.generate(part, GREEDY)]
    assert got == family.greedy
    assert graphs.replays > NEW_TOKENS  # most steps, in three runs of ~20 steps
    assert {b for b, _ in replayed} >= {1, 2, 8} and {nb for _, nb in replayed} == {4, 8}
    assert graphs.shape_for(9, 10) is None and graphs.shape_for(8, 257) is None  # these run eagerly
    assert graphs.shapes()[0] == (8, 16) and graphs.gather_bytes(8, 16) == 2 * runner.k_cache[0][:, :128].numel() * 4
    assert {g.logits.data_ptr() for g in graphs.graphs.values()} == {graphs.logits.data_ptr()}  # one logits buffer
    # A shape that would gather more than GATHER_BYTES gets no graph: its steps run eagerly.
    monkeypatch.setattr("pylon.serving.model.graphs.GATHER_BYTES", graphs.gather_bytes(4, 8))
    assert max(b * nb for b, nb in graphs.shapes()) == 32 and (8, 16) not in graphs.shapes()
    assert_pool_empty(engine)


def test_every_step_sends_its_integer_tensors_in_one_copy_and_keeps_greedy_parity(family: Family) -> None:
    """A step's token ids, positions, slots, block tables and lengths go to a GPU in one copy from page-locked memory
    (attention.HostStage), not ~20 pageable ones. On a CPU the runner's stage is unstaged; here it is staged as a
    GPU's is (and the compiled kernels are off, so decodes go through the padded group whose bias is made on the
    device from the lengths after the copy, and decode steps in fixed shapes take their inputs through it too):
    greedy continuations stay transformers' own, in one copy a step."""
    from pylon.serving.model.attention import HostStage
    from pylon.serving.model.graphs import DecodeGraphs

    engine = family.engine()
    runner = engine.runner
    if not ON_CUDA:
        assert not runner.stage.staged
        runner.stage = HostStage(runner.device, staged=True)
        runner.kernel = runner.prefill = False
        # Decode steps in fixed shapes, run eagerly here, take their inputs through the stage too (`upload`).
        runner.add_scratch_block()
        runner.decode_graphs = DecodeGraphs(runner, 8, engine.max_model_len, capture=False)
        runner.decode_graphs.capture_all()
    assert runner.stage.staged
    steps = []
    execute = runner.execute_step
    runner.execute_step = lambda *a: (steps.append(1), execute(*a))[1]
    got = []
    for part in (PROMPTS[:5], PROMPTS[5:]):  # at most 8 decodes a step, so that fixed shapes take them
        got += [c.token_ids for c in engine.generate(part, GREEDY)]
    assert got == family.greedy
    assert runner.stage.copies == len(steps) >= NEW_TOKENS
    if runner.decode_graphs is not None:
        assert 0 < runner.decode_graphs.replays < len(steps)  # both kinds of step ran, each in one copy
    assert_pool_empty(engine)
