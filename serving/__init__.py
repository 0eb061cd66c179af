"""pylon.serving: the continuous-batching engine behind Ray Serve and an OpenAI-compatible API, split by process.

    api/      the Serve replica (one per replica process): builder.py (spec -> Serve application), server.py
              (PylonLLMServer: admission, streams, metrics), http.py (the ASGI app: auth, routes, SSE), protocol.py
    engine/   the engine process (`engine.separate_process`, `engine.data_parallel` of them): engine.py (LLMEngine,
              AsyncLLMEngine), process.py (ProcessLLMEngine, EnginePool), scheduler.py (continuous batching,
              chunked prefill, preemption), kv_cache.py (KV blocks), request.py, sampling.py, tokenization.py,
              generation.py (the model's generation_config.json: eos ids, sampling defaults), heap.py and
              sched_batch.py (the process's malloc and CPU policy)
    model/    the model executor, inside the engine process: runner.py (ModelRunner: one step over a list of
              step.StepSequence, plain data), attention.py (paged attention), graphs.py (CUDA graphs), linear.py
              (oneDNN projections), kernels.py + csrc/ (compiled CPU kernels)
    errors.py InvalidRequest (names the bad parameter: HTTP 400), EngineDeadError (HTTP 503)

The engine has vLLM v1's division of labour: the scheduler decides what runs each step, the KV block pool owns
memory, the runner only executes. Arrows run api -> engine -> model, never back (tests/unit/test_layers.py).
Importing the package imports nothing heavy; torch and transformers load with the modules that need them.
"""
