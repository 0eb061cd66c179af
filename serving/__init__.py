"""pylon.serving: the continuous-batching engine, Ray Serve deployments and the OpenAI-compatible API.

The engine is plain PyTorch, on CPU or CUDA, with vLLM v1's division of labour: the scheduler decides what
runs each step, the KV block pool owns memory, the model runner only executes.

    engine.py        LLMEngine (add_request / step / abort, synchronous) and AsyncLLMEngine (the step loop on
                     a thread, `async generate()` streams per request, optionally coalesced per interval,
                     check_health, stats)
    engine_process.py ProcessLLMEngine: AsyncLLMEngine's interface over an engine in a child process (what a
                     Serve replica runs, so HTTP and the step loop never share one interpreter lock)
    kernels.py       the compiled CPU kernels: paged attention for decodes and for prompt chunks, GELU, KV stores
    linear.py        the projections on a CPU through oneDNN, over weights reordered once at load
    scheduler.py     Scheduler: continuous batching under a token budget and a sequence cap, chunked
                     prefill, preemption of the newest request when KV blocks run out
    kv_cache.py      KVBlockPool: fixed-size KV blocks, one block table per request
    model_runner.py  ModelRunner: loads a Hugging Face GPT-2 or Llama directory and runs one step, reusing the
                     model's own layers and replacing only attention
    attention.py     paged attention over the block pool, batched with padding and masks (torch SDPA)
    graphs.py        on a GPU, steps of decodes only replayed from CUDA graphs in a few fixed shapes
    sampling.py      SamplingParams (validated) and the sampler: greedy, temperature, top-k, top-p, per-request
                     seeded generators
    tokenization.py  the model directory's tokenizer (pylon.data.tokenizer), streaming detokenization with
                     stop strings, chat prompts
    request.py       Request (engine-side state) and RequestOutput (what each step hands back)
    errors.py        InvalidRequest (names the bad parameter: HTTP 400), EngineDeadError (HTTP 503)
    scheduling.py    CPU serving processes under Linux's SCHED_BATCH policy
    heap.py          an engine process keeps the memory it frees (glibc's malloc thresholds, or TCMalloc preloaded)

Importing the package imports nothing heavy; torch and transformers load with the modules that need them.
"""
import os


def switched_on(name: str) -> bool:
    """An on-by-default environment switch of the engine (PYLON_PAGED_KERNEL, PYLON_ONEDNN_LINEAR,
    PYLON_PADDED_ROWS, PYLON_SCHED_BATCH, PYLON_KEEP_HEAP, PYLON_TCMALLOC, PYLON_PREFILL_KERNEL, PYLON_CUDA_GRAPHS):
    off when set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
