"""Serving features, each against its off switch in one run on the same model: one function per feature.

quantization(): `engine.quantization: int8` and `int4` against float32, on a GPT-2-small-shaped model (12 layers, 768
wide, vocab 50257, ~124M parameters) with random weights (GPT-2's initializer), built in the run and saved as a Pylon
export (byte tokenizer). Prints, for each of int8, int4 and fp32 (legs alternate over `--rounds`):

1. the bytes of the projections' weights (and of the whole model), each over fp32;
2. one projection (768 -> 2304, c_attn's shape) at 1 and 8 rows: oneDNN's float32, Pylon's int8 and int4 kernels,
   and torch's `_weight_int8pack_mm`, which the engine does not use on a CPU (see serving/model/quant.py);
3. output tokens/s of an in-process `LLMEngine` at concurrency 1 and 8 (greedy, `--output-tokens` each, closed loop),
   int8 over fp32 (target >= 1.3x);
4. on held-out real text (the last `--eval-tokens` bytes of /work/shared/datasets/tinyshakespeare.txt, in windows of
   `--window`), the mean per-token log-likelihood and its perplexity for each, and int8's relative change (target
   < 2%); random weights make the absolute perplexity meaningless (about the vocabulary's size), so also the mean
   KL divergence from fp32's next-token distribution and how often the two agree on the most likely token.

On a GPU (`--device cuda`, bf16 unless `--dtype fp32`): the sections that compare engines only (quantization,
constrained, penalties, speculative), the engines on the GPU; quantization then measures int8 and, on a GPU of compute
capability 8.9+, fp8 (e4m3 weights and per-token activations on the fp8 tensor cores) against bf16, without the CPU's
one-projection micro-benchmark:

    python bench/serve_features.py --device cuda --only quantization --rounds 3

penalties(): presence/frequency/repetition penalties and logit_bias against free greedy decoding on the same model
and prompts, at concurrency 1 and 8 (output tokens/s, the ratio, the spread over rounds), and the shaping's own cost
per row of a batch.

constrained(): structured outputs against free decoding on the same model: output tokens/s of greedy requests whose
output must validate against a JSON schema (llguidance masks applied in the batched step) against the same requests
unconstrained, at concurrency 1 and 8 (target >= 0.9x), and the mask's own cost per token. Then the same guided
requests on extraction prompts (records of the schema's shape in the input), with `engine.speculative: ngram` against
without: tokens/s, acceptance, and the model's forward passes per output token.

speculative(): `engine.speculative: ngram` and `draft` against plain decoding at concurrency 1 and 32, greedy, on an
input-grounded workload (prompts that repeat their own phrases, as edits and summaries copy their input). Random
weights do not copy an input, so two models bracket what a trained one does: GPT-2's initializer (std 0.02), whose
greedy output falls into loops that prompt lookup predicts (acceptance near 1: the best case), and a 0.5-scale one
whose continuations follow the context and are almost never predicted (acceptance near 0: what the measured rule
must keep from costing; target >= 0.95x). Targets: >= 1.7x at 1 (best case), >= 0.95x at 32 (both). Also prints
acceptance, tokens per verifying step and how many steps the rule let speculate. The draft model is the model's
first `--draft-layers` layers with its embeddings, final norm and output layer, saved as an export of its own (an
early exit, as LayerSkip and Draft & Verify draft): no training needed, the same tokenizer by construction; the
counters also give the model's forward passes per output token, which do not depend on the machine. With
`--spec-shaped penalties` (or `logit_bias`), every request of every leg carries the penalties section's shaping (or
its logit_bias alone): shaped requests speculate too, each draft position's row shaped by the history up to it.

lora(): LoRA adapters (`engine.adapters`) on the same model: one engine holding `--lora-adapters` random adapters of
rank `--lora-rank` on every projection; output tokens/s of the same greedy requests for the base model, for one
adapter, and for the adapters in turn (every step mixing them), at concurrency 1 and 8, and the adapters'
multiply-adds per token as a share of the model's.

embeddings(): `POST /v1/embeddings`'s engine path (`SamplingParams(embed=True)`) against `transformers` as
sentence-transformers runs it (inputs sorted by length, the model's body over padded batches of `--embed-batch`, the
last real token's state taken): inputs/s for `--embed-inputs` texts of 16-256 tokens from the held-out text, legs
alternating, and the largest difference between the two legs' normalised vectors. Then inputs that share an
instruction prefix (as Qwen3-Embedding's queries do): the engine's prompt tokens computed per input, with the prefix
cache, against every token (the count that does not depend on the machine).

rewards(): a reward model (GPT-2's shape with a one-label head: GPT2ForSequenceClassification, served as a
classifier) scoring a GRPO-style batch, `--reward-prompts` prompts of `--reward-prompt-tokens` tokens each followed by
`--reward-group` responses: the engine (prefix cache on, so a prompt's responses share its blocks) against
`transformers`' sorted padded batches, legs alternating on a fresh batch each round: rollouts/s, the largest
difference between the two legs' rewards, and the prompt tokens the engine computed against every token.

images(): a chat about one image over several turns with the prefix cache against without (prompt tokens computed
and the vision tower's runs, which do not depend on the machine, and wall time), and the price of an image against
text of the same length; see `images`.

moe(): a mixture-of-experts model (Mixtral's layout: `--moe-experts` experts, top `--moe-top-k`, each expert's
intermediate size `--moe-intermediate`) against two dense models (Mistral's layout) built in the same run: one with the
parameters a token runs (intermediate size top_k x the expert's: the same FLOPs per token) and one with all of them
(num_experts x: the same bytes). Output tokens/s of the engine at each concurrency for the three, and the MoE model
with int8 weights (its experts quantized), legs alternating; the share of the expert weights a decode step of n
sequences reads (experts some token picked, counted in the engine's steps, against `pylon plan`'s 1 - (1 - k/E)^n:
machine-independent); and one MoE layer, Pylon's (serving/model/moe.py) against transformers' own block (its default
experts implementation), at 1 to 512 rows.

    .venv/bin/python bench/serve_features.py                 # all nine, CPU, ~35 min on 2 cores
    .venv/bin/python bench/serve_features.py --only constrained speculative
    .venv/bin/python bench/serve_features.py --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

DATASET = Path("/work/shared/datasets/tinyshakespeare.txt")


def build_gpt2(
    directory: Path, n_layer: int, n_embd: int, n_head: int, vocab: int, init: float = 0.02, *, reward: bool = False
) -> None:
    """A random GPT-2 (GPT-2's own initializer, std `init`) saved as a Pylon export with the byte tokenizer; `reward`:
    a GPT2ForSequenceClassification of one label (a reward model's head) instead of the causal LM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=1024,
        vocab_size=vocab,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=init,
    )
    if reward:
        config.num_labels = 1
    torch.manual_seed(0)
    (AutoModelForSequenceClassification if reward else AutoModelForCausalLM).from_config(config).save_pretrained(
        directory
    )
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


# Where the engines run (--device, --dtype): set by main() before any section runs.
PLACE = {"device": "cpu", "dtype": "fp32"}
# The sections that compare engines with engines only, which run on a GPU too; the others have a `transformers` or
# CPU-kernel leg of their own.
GPU_SECTIONS = ("quantization", "constrained", "penalties", "speculative")


def engine(directory: str, quantization: str, concurrency: int, **fields):
    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    settings = {
        "max_num_seqs": max(concurrency, 1),
        "max_num_batched_tokens": 512,
        "kv_cache_tokens": 16384,
        "block_size": 16,
        "max_model_len": 1024,
        **PLACE,
        "quantization": quantization,
    }
    return LLMEngine(directory, EngineSpec(**(settings | fields)))


def projection_bytes(runner) -> tuple[int, int]:
    """(bytes of the decoder layers' projection weights, of the whole model's weights) as the runner holds them."""
    from pylon.serving.model.quant import QuantWeight

    proj = 0
    for layer in runner._gpt2.layers:
        for w in (layer.qkv_w, layer.proj_w, layer.fc_w, layer.down_w):
            proj += w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()
    rest = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # the projections' are released
    return proj, proj + rest


def micro(rounds: int = 200) -> dict[str, dict[int, float]]:
    """Microseconds of one c_attn-shaped projection (768 -> 2304) per path and row count (best of 3)."""
    import torch

    from pylon.serving.model import linear, quant

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2304, 768, generator=g) * 0.02, torch.zeros(2304)
    q = quant.QuantWeight(w)
    q4 = quant.QuantWeight(w, "int4")
    packed = linear.pack(w) if linear.usable(torch.device("cpu"), torch.float32) else None
    out: dict[str, dict[int, float]] = {}
    for rows in (1, 8):
        x = torch.randn(rows, 768, generator=g)
        paths = {
            "fp32 (oneDNN)" if packed is not None else "fp32 (addmm)": (
                (lambda: linear.addmm(b, x, packed)) if packed is not None else (lambda: torch.addmm(b, x, w.t()))
            ),
            "int8 (Pylon kernel)" if q.kernel else "int8 (dequantized)": lambda: quant.addmm(b, x, q),
            "int4 (Pylon kernel)" if q4.int4_kernel else "int4 (dequantized)": lambda: quant.addmm(b, x, q4),
            "int8 (torch _weight_int8pack_mm)": lambda: torch.ops.aten._weight_int8pack_mm(x, q.q, q.scales),
        }
        for name, f in paths.items():
            n = rounds // 10 if "int8pack" in name else rounds
            f()
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                best = min(best, (time.perf_counter() - t0) / n)
            out.setdefault(name, {})[rows] = best * 1e6
    return out


def throughput(
    eng,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    *,
    guide=None,
    prompts=None,
    shaping: dict | None = None,
    adapters: list | None = None,
    adapter_root: str | None = None,
) -> float:
    """Output tokens/s of `requests` greedy requests, `concurrency` open at a time (closed loop); `shaping`:
    SamplingParams' penalties and logit_bias for them; `adapters`: the LoRA adapter of each request in turn (None:
    the base model), loaded on demand from `adapter_root` if given (engine.dynamic_adapters)."""
    import random

    from pylon.serving.engine.sampling import SamplingParams

    rng = random.Random(concurrency)
    if prompts is None:
        prompts = [[rng.randrange(32, 127) for _ in range(prompt_tokens)] for _ in range(requests)]
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True, guide=guide, **(shaping or {}))
    eng.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0))  # first-call costs, not counted
    pending, open_, tokens, n = list(reversed(prompts)), set(), 0, 0
    t0 = time.monotonic()
    while pending or open_:
        while pending and len(open_) < concurrency:
            if adapters:
                name = adapters[n % len(adapters)]
                path = None if adapter_root is None else os.path.join(adapter_root, name)
                params = dataclasses.replace(params, adapter=name, adapter_path=path)
            eng.add_request(f"r{n}", pending.pop(), params)
            open_.add(f"r{n}")
            n += 1
        for out in eng.step():
            tokens += len(out.token_ids)
            if out.finished:
                open_.discard(out.request_id)
    return tokens / (time.monotonic() - t0)


def log_likelihoods(eng, text: bytes, window: int):
    """Per window of held-out text: the log-probabilities of each next token under the engine (float32 `[n, vocab]`
    log-softmax rows and the targets), through the runner's prompt-logits path."""
    import torch

    from pylon.serving.model.step import StepSequence

    rows, targets = [], []
    for start in range(0, len(text) - window, window):
        ids = list(text[start : start + window + 1])
        blocks = list(range(-(-window // eng.spec.block_size)))
        step = StepSequence(token_ids=ids[:-1], start=0, block_table=blocks, samples=True, prompt_logits=True)
        rows.append(eng.runner.execute([step]).float().log_softmax(-1).cpu())
        targets.append(torch.tensor(ids[1:]))
    return torch.cat(rows), torch.cat(targets)


def quantization_legs() -> list[str]:
    """engine.quantization's values measured here: none (the baseline, in --dtype), int8 and int4; fp8 too on a CUDA
    GPU that has it (compute capability 8.9+)."""
    import torch

    legs = ["none", "int8", "int4"]
    if PLACE["device"] == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        legs.append("fp8")
    return legs


def quantization(args) -> dict:
    """int8 (and fp8 on a GPU) against the unquantized model: weights' bytes, one projection (CPU), tokens/s at each
    concurrency, and held-out likelihood."""
    import torch

    torch.set_num_threads(args.threads)
    legs = quantization_legs()
    results: dict = {"threads": args.threads, "legs": legs, **PLACE}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt2"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab)
        params = sum(
            p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(directory).parameters()
        )
        results["parameters"] = params

        # 1. weights' bytes
        held = {q: projection_bytes(engine(str(directory), q, 1).runner) for q in legs}
        results["bytes"] = held
        gc.collect()

        # 2. one projection (the CPU's paths)
        results["micro"] = micro() if PLACE["device"] == "cpu" else {}

        # 3. tokens/s, legs alternating
        tps: dict[int, dict[str, list[float]]] = {}
        for c in args.concurrency:
            tps[c] = {q: [] for q in legs}
            for r in range(args.rounds):
                for q in legs if r % 2 == 0 else legs[::-1]:
                    eng = engine(str(directory), q, c)
                    requests = max(2, c * args.requests_per_slot)
                    tps[c][q].append(throughput(eng, c, requests, args.prompt_tokens, args.output_tokens))
                    del eng
                    gc.collect()  # an engine holds its KV cache until the collector breaks its cycles
        results["tokens_per_s"] = tps

        # 4. held-out likelihood
        text = DATASET.read_bytes()[-args.eval_tokens - 1 :]
        lp = {}
        for q in legs:
            lp[q] = log_likelihoods(engine(str(directory), q, 1), text, args.window)
            gc.collect()
        fp, targets = lp["none"]
        ll = {q: lp[q][0].gather(1, targets[:, None]).mean().item() for q in lp}
        results["log_likelihood"] = ll
        results["perplexity"] = {q: math.exp(-v) for q, v in ll.items()}
        results["kl"] = {
            q: torch.nn.functional.kl_div(lp[q][0], fp, log_target=True, reduction="batchmean").item() for q in legs[1:]
        }
        results["top1_agree"] = {q: (lp[q][0].argmax(-1) == fp.argmax(-1)).float().mean().item() for q in legs[1:]}
        results["eval_tokens"] = len(targets)
    return results


def report_quantization(r: dict) -> None:
    base = r.get("dtype", "fp32")
    where = f"{r.get('device', 'cpu')}, {r['threads']} thread(s)" if r.get("device", "cpu") == "cpu" else "cuda"
    print(
        f"== quantization: {', '.join(r['legs'][1:])} vs {base}, GPT-2-shaped, {r['parameters'] / 1e6:.1f}M "
        f"parameters, random weights, {where}"
    )
    p0, m0 = r["bytes"]["none"]
    for q in r["legs"][1:]:
        pq, mq = r["bytes"][q]
        print(
            f"weights ({q}): projections {p0 / 2**20:.1f} MiB {base} -> {pq / 2**20:.1f} MiB ({pq / p0:.3f}x); "
            f"whole model {m0 / 2**20:.1f} -> {mq / 2**20:.1f} MiB ({mq / m0:.3f}x; embeddings/lm_head stay {base})"
        )
    if r["micro"]:
        print("one projection 768->2304 (us, best of 3):")
        for name, by_rows in r["micro"].items():
            print(f"  {name:36s} " + "  ".join(f"{rows} row(s) {us:8.1f}" for rows, us in by_rows.items()))
    cpu = r.get("device", "cpu") == "cpu"
    for c, legs in r["tokens_per_s"].items():
        plain = statistics.median(legs["none"])
        line = f"concurrency {c}: {base} {plain:.1f} tok/s"
        for q in r["legs"][1:]:
            got = statistics.median(legs[q])
            ratios = [a / b for a, b in zip(legs[q], legs["none"])]
            target = f"; target >= 1.3x: {'met' if got / plain >= 1.3 else 'NOT met'}" if cpu and q == "int8" else ""
            line += f", {q} {got:.1f} tok/s: {got / plain:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}{target})"
        print(line)
    ll, ppl = r["log_likelihood"], r["perplexity"]
    print(
        f"held-out text ({r['eval_tokens']} tokens of {DATASET.name}): mean log-likelihood {base} {ll['none']:.5f}, "
        f"perplexity {ppl['none']:.1f}"
    )
    kl, agree = r["kl"], r["top1_agree"]
    for q in r["legs"][1:]:
        change_ll = (ll[q] - ll["none"]) / abs(ll["none"])
        change_ppl = ppl[q] / ppl["none"] - 1
        print(
            f"  {q}: log-likelihood {ll[q]:.5f} ({change_ll:+.4%}); perplexity {ppl[q]:.1f} ({change_ppl:+.4%}; "
            f"target < 2%: {'met' if abs(change_ppl) < 0.02 else 'NOT met'}); KL({base} || {q}) per token "
            f"{kl[q]:.2e} nats; most likely next token agrees on {agree[q]:.2%}"
        )


# Long enough that a random model is still inside it after --output-tokens tokens: many small typed fields.
RECORDS = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 40,  # no request finishes early: every leg runs --output-tokens tokens a request
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                    "ok": {"type": "boolean"},
                    "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                },
                "required": ["id", "kind", "ok", "tag"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}


def two_legs(eng, c: int, args, legs: dict[str, dict]) -> dict[str, list[float]]:
    """Output tokens/s of each leg (`throughput`'s keyword arguments by name) on `eng` at concurrency `c`, over
    `args.rounds` rounds, the legs' order alternating."""
    names = list(legs)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            requests = max(2, c * args.requests_per_slot)
            out[name].append(throughput(eng, c, requests, args.prompt_tokens, args.output_tokens, **legs[name]))
    return out


def against_free(legs: dict[str, list[float]], name: str) -> tuple[float, float, list[float]]:
    """The free leg's and `name`'s median tokens/s, and `name` over free round by round."""
    ratios = [a / b for a, b in zip(legs[name], legs["free"])]
    return statistics.median(legs["free"]), statistics.median(legs[name]), ratios


def constrained(args) -> dict:
    """JSON-schema-constrained decoding against free decoding, same prompts, legs alternating."""
    import torch

    torch.set_num_threads(args.threads)
    guide = {"type": "json_schema", "schema": RECORDS}
    results: dict = {"tokens_per_s": {}, "mask_us": None}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt2"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab)
        for c in args.concurrency:
            eng = engine(str(directory), "none", c)
            results["tokens_per_s"][c] = two_legs(eng, c, args, {"free": {}, "json_schema": {"guide": guide}})
            guides = eng.guides
            del eng
            gc.collect()  # an engine holds its KV cache until the collector breaks its cycles
            # Guided requests speculating: an extraction (the output's records copy the input's shape) with
            # prompt lookup against the same guided requests decoding plainly, two engines, legs alternating.
            results.setdefault("speculative", {})[c] = guided_speculation(str(directory), c, args, guide)
        # the mask alone: one matcher advanced through a valid output, timed per token
        matcher = guides.matcher(guide)
        text = b'{"records":[' + b",".join(b'{"id":12,"kind":"beta","ok":true,"tag":"ab"}' for _ in range(45)) + b"]}"
        logits = torch.zeros(1, args.vocab)
        t0 = time.perf_counter()
        for byte in text:
            guides.apply(logits, [0], [matcher], 256)
            matcher.consume_token(byte)
        results["mask_us"] = (time.perf_counter() - t0) / len(text) * 1e6
    results["reasoning_mask_us"] = reasoning_mask()
    return results


def reasoning_mask(vocab: int = 150_000, rounds: int = 3) -> dict[str, float]:
    """The mask's cost per token in a reasoning-first grammar (pylon.serving.api.reply_guide: free text up to a
    closing tag token, then the schema), over a vocabulary of a real model's size (Qwen's 151k): a synthetic one of
    `vocab` tokens cut from real text, `<think>` and `</think>` tokens of their own. Per token, in the free reasoning
    and in the JSON after it, and the same JSON under the schema alone; the median of `rounds`."""
    import random

    import llguidance
    import torch

    text = Path("/work/shared/datasets/tinyshakespeare.txt").read_text()
    rng = random.Random(0)
    pieces = {bytes([i]) for i in range(256)}
    while len(pieces) < vocab - 3:
        at = rng.randrange(len(text) - 12)
        pieces.add(text[at : at + rng.randint(2, 10)].encode())
    tokens = sorted(pieces, key=lambda b: (len(b), b))
    n = len(tokens) + 3
    opening, closing, eos = n - 3, n - 2, n - 1

    class Words:  # llguidance's TokenizerWrapper protocol
        bos_token_id = None
        eos_token_id = eos
        special_token_ids = [opening, closing, eos]

        def __init__(self):
            self.tokens = tokens + [b"\xff<think>", b"\xff</think>", b"\xff<eos>"]

        def __call__(self, data: bytes) -> list[int]:
            return list(data)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Words()), n_vocab=n)
    schema = json.dumps({**RECORDS, "x-guidance": {"whitespace_flexible": False}})
    thinking = f"start: <[{opening}]> THOUGHT <[{closing}]> answer\nTHOUGHT: /(?s:.*)/\nanswer: %json {schema}\n"
    words = (n + 31) // 32
    mask = torch.empty(words, dtype=torch.int32)
    thought = [i for i in range(300, 90_000, 733)][:100]
    answer = list(
        b'{"records":[' + b",".join(b'{"id":12,"kind":"beta","ok":true,"tag":"ab"}' for _ in range(4)) + b"]}"
    )

    def walk(matcher, ids) -> float:
        t0 = time.perf_counter()
        for token in ids:
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
            matcher.consume_token(token)
        return (time.perf_counter() - t0) / len(ids) * 1e6

    got: dict[str, list[float]] = {"reasoning": [], "answer after it": [], "schema alone": []}
    for _ in range(rounds):
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(thinking), log_level=0)
        matcher.consume_token(opening)
        got["reasoning"].append(walk(matcher, thought))
        matcher.consume_token(closing)
        got["answer after it"].append(walk(matcher, answer))
        alone = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(RECORDS), log_level=0)
        got["schema alone"].append(walk(alone, answer))
    return {k: statistics.median(v) for k, v in got.items()}


def extraction_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that hold `RECORDS`-shaped records (compact JSON) to be extracted: the output copies their shape."""
    import random
    import string

    rng = random.Random(seed)
    kinds = RECORDS["properties"]["records"]["items"]["properties"]["kind"]["enum"]
    out = []
    for _ in range(n):
        records = [
            {
                "id": rng.randrange(10000),
                "kind": rng.choice(kinds),
                "ok": rng.random() < 0.5,
                "tag": "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(1, 7))),
            }
            for _ in range(4)
        ]
        out.append(list(f"input: {json.dumps({'records': records}, separators=(',', ':'))}\noutput: ".encode()))
    return out


def guided_speculation(directory: str, c: int, args, guide: dict) -> dict:
    """Guided requests on extraction prompts with `engine.speculative: ngram` against the same requests decoding
    plainly: tokens/s per round, and the model's forward passes per output token (machine-independent)."""
    methods = {
        "json_schema": {},
        "json_schema+ngram": {"speculative": {"method": "ngram", "num_tokens": args.spec_tokens}},
    }
    engines = {name: engine(directory, "none", c, **fields) for name, fields in methods.items()}
    steps = {name: _counting_steps(eng) for name, eng in engines.items()}
    requests = max(2, c * args.requests_per_slot)
    prompts = extraction_prompts(requests, seed=c)
    legs: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            legs[name].append(
                throughput(
                    engines[name],
                    c,
                    requests,
                    0,
                    args.spec_output_tokens,
                    guide=guide,
                    prompts=[list(p) for p in prompts],
                )
            )
    policy = engines["json_schema+ngram"].spec_policy
    out = {
        "legs": legs,
        "passes_per_token": {
            name: steps[name][0] / eng.stats().generation_tokens_total for name, eng in engines.items()
        },
        "proposed": policy.proposed_total,
        "accepted": policy.accepted_total,
        "speculated_steps": policy.speculated_steps_total,
        "skipped_steps": policy.skipped_steps_total,
    }
    del engines
    gc.collect()
    return out


def report_constrained(r: dict) -> None:
    print("== structured outputs: json_schema-constrained vs free greedy decoding, same model and prompts")
    for c, legs in r["tokens_per_s"].items():
        free, con, ratios = against_free(legs, "json_schema")
        met = "met" if con / free >= 0.9 else "NOT met"
        print(
            f"concurrency {c}: free {free:.1f} tok/s, constrained {con:.1f} tok/s: {con / free:.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.9x: {met})"
        )
    print(f"  the mask alone (llguidance + applying it to one row): {r['mask_us']:.0f} us per token")
    reasoned = r.get("reasoning_mask_us")
    if reasoned:  # machine-dependent, but the three in one run: the reasoning's free text costs what JSON does
        listed = ", ".join(f"{k} {v:.0f} us" for k, v in reasoned.items())
        print(f"  a reasoning-first grammar's mask over a 150k-token vocabulary, per token: {listed}")
    print("== structured outputs speculating: json_schema + ngram vs json_schema plain, greedy, extraction prompts")
    for c, got in r.get("speculative", {}).items():
        plain, spec = (statistics.median(got["legs"][k]) for k in ("json_schema", "json_schema+ngram"))
        ratios = [a / b for a, b in zip(got["legs"]["json_schema+ngram"], got["legs"]["json_schema"])]
        passes = got["passes_per_token"]
        accept = got["accepted"] / got["proposed"] if got["proposed"] else float("nan")
        print(
            f"concurrency {c}: plain {plain:.1f} tok/s, ngram {spec:.1f} tok/s: {spec / plain:.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); drafts {got['proposed']}, accepted {got['accepted']} "
            f"({accept:.0%}); the rule speculated in {got['speculated_steps']} steps, held back in "
            f"{got['skipped_steps']}; model passes per output token {passes['json_schema']:.2f} plain, "
            f"{passes['json_schema+ngram']:.2f} ngram"
        )


# What an application that discourages repeats sends: every kind of shaping at once.
SHAPING = {
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "logit_bias": {t: -5.0 for t in range(300, 310)},
}


def penalties(args) -> dict:
    """Penalties and logit_bias (`SHAPING`) against free greedy decoding, same prompts, legs alternating; and the
    shaping alone, one batch of rows timed."""
    import torch

    from pylon.serving.engine.sampling import SamplingParams, shape_logits

    torch.set_num_threads(args.threads)
    results: dict = {"tokens_per_s": {}, "shape_us": {}}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt2"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab)
        for c in args.concurrency:
            eng = engine(str(directory), "none", c)
            results["tokens_per_s"][c] = two_legs(eng, c, args, {"free": {}, "penalized": {"shaping": SHAPING}})
            del eng
            gc.collect()
            # the shaping alone: c rows of the vocabulary's logits, each with a prompt and half its output behind it
            logits = torch.randn(c, args.vocab)
            params = [SamplingParams(temperature=0, **SHAPING)] * c
            history = [(list(range(args.prompt_tokens)), list(range(args.output_tokens // 2)))] * c
            shape_logits(logits, params, history)
            t0 = time.perf_counter()
            for _ in range(50):
                shape_logits(logits, params, history)
            results["shape_us"][c] = (time.perf_counter() - t0) / 50 / c * 1e6
    return results


def report_penalties(r: dict) -> None:
    print("== penalties and logit_bias: repetition 1.1, frequency 0.5, presence 0.3, 10 biased tokens vs free greedy")
    for c, legs in r["tokens_per_s"].items():
        free, pen, ratios = against_free(legs, "penalized")
        print(
            f"concurrency {c}: free {free:.1f} tok/s, penalized {pen:.1f} tok/s: {pen / free:.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); the shaping alone {r['shape_us'][c]:.0f} us per row"
        )


LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]  # every projection of GPT-2's layers (c_proj: attention's and the MLP's)


def lora(args) -> dict:
    """LoRA adapters (`engine.adapters`): output tokens/s of the same greedy requests on one engine holding
    `--lora-adapters` random adapters (rank `--lora-rank` on every projection), for the base model alone, one adapter
    for all, and the adapters in turn (each step mixing them), legs alternating; and the adapters' arithmetic per
    token as a share of the model's (the count that does not depend on the machine)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    results: dict = {"tokens_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt2"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab)
        names = []
        for k in range(args.lora_adapters):
            torch.manual_seed(k)
            base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS)
            model = get_peft_model(base, dataclasses.replace(config, init_lora_weights=False))
            model.save_pretrained(Path(tmp) / f"adapter-{k}")
            names.append(f"adapter-{k}")
            if k == 0:
                adapter_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
                # multiply-adds per token: every weight but the position table (wte is also lm_head, counted once)
                base_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
                base_params -= base.transformer.wpe.weight.numel()
            del model, base
        adapters = [{"name": n, "path": str(Path(tmp) / n)} for n in names]
        results["flops_share"] = adapter_params / base_params
        # The same adapters again under other names, at a root: loaded on demand into --lora-slots slots.
        root = Path(tmp) / "root"
        root.mkdir()
        for n in names:
            (root / f"on-demand-{n}").symlink_to(Path(tmp) / n)
        dynamic = {"root": str(root), "max_loaded": args.lora_slots, "max_rank": args.lora_rank}
        results["slots"], results["loads_per_request"] = args.lora_slots, {}
        for c in args.concurrency:
            eng = engine(str(directory), "none", c, adapters=adapters, dynamic_adapters=dynamic)
            legs = {
                "free": {},
                "one adapter": {"adapters": names[:1]},
                "mixed": {"adapters": names},
                "mixed on demand": {"adapters": [f"on-demand-{n}" for n in names], "adapter_root": str(root)},
            }
            results["tokens_per_s"][c] = two_legs(eng, c, args, legs)
            on_demand_requests = args.rounds * max(2, c * args.requests_per_slot)  # two_legs' count for the leg
            results["loads_per_request"][c] = eng.stats().adapter_loads_total / on_demand_requests
            del eng
            gc.collect()
    return results


def report_lora(r: dict) -> None:
    print(
        "== LoRA adapters: base model vs one adapter for every request vs the adapters in turn (mixed steps); "
        f"the adapters' multiply-adds per token: {r['flops_share']:.1%} of the model's (lm_head included)"
    )
    for c, legs in r["tokens_per_s"].items():
        line = [f"concurrency {c}: base {statistics.median(legs['free']):.1f} tok/s"]
        for name in ("one adapter", "mixed", "mixed on demand"):
            free, it, ratios = against_free(legs, name)
            line.append(f"{name} {it:.1f} tok/s: {it / free:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")
        print("; ".join(line))
        print(
            f"  on demand: {r['slots']} slot(s) for the adapters in turn, {r['loads_per_request'][c]:.2f} adapter "
            "loads per request"
        )


def build_moe_family(directory: Path, args, kind: str) -> tuple[int, int]:
    """A random model of the moe section (GPT-2's initializer, std 0.02; the byte tokenizer): `kind` "moe" is
    Mixtral-shaped, "dense-active" and "dense-total" are Mistral-shaped with the MoE model's active and total MLP
    widths. Returns (its parameters, its experts' parameters)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    common = dict(
        hidden_size=args.moe_hidden,
        num_hidden_layers=args.moe_layers,
        num_attention_heads=args.moe_hidden // 64,
        num_key_value_heads=args.moe_hidden // 256,
        max_position_embeddings=1024,
        vocab_size=args.vocab,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.02,
    )
    if kind == "moe":
        config = AutoConfig.for_model(
            "mixtral",
            intermediate_size=args.moe_intermediate,
            num_local_experts=args.moe_experts,
            num_experts_per_tok=args.moe_top_k,
            **common,
        )
    else:
        width = args.moe_top_k if kind == "dense-active" else args.moe_experts
        config = AutoConfig.for_model("mistral", intermediate_size=width * args.moe_intermediate, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts


def moe_layer_micro(args, rows_list=(1, 8, 64, 512)) -> dict:
    """Microseconds of one MoE layer (best of 3) at each row count: Pylon's SparseMoE against transformers' block it
    replaces, on the same weights; and the largest difference between their outputs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.serving.model.moe import SparseMoE

    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=args.moe_hidden,
        intermediate_size=args.moe_intermediate,
        num_hidden_layers=1,
        num_attention_heads=args.moe_hidden // 64,
        num_key_value_heads=args.moe_hidden // 256,
        num_local_experts=args.moe_experts,
        num_experts_per_tok=args.moe_top_k,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    block = model.model.layers[0].mlp
    ours = SparseMoE(block, config, None)
    out: dict = {"implementation": model.config._experts_implementation or "eager", "us": {}, "max_diff": 0.0}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in rows_list:
            x = torch.randn(1, rows, args.moe_hidden, generator=g)
            out["max_diff"] = max(out["max_diff"], (block(x)[0] - ours(x[0])).abs().max().item())
            for name, f in (("transformers", lambda: block(x)), ("pylon", lambda: ours(x[0]))):
                f()
                best, n = math.inf, max(3, 64 // rows)
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        f()
                    best = min(best, (time.perf_counter() - t0) / n)
                out["us"].setdefault(name, {})[rows] = best * 1e6
    return out


def moe(args) -> dict:
    """The moe section (see the module's docstring)."""
    import torch

    from pylon.serving.model import moe as moe_module

    torch.set_num_threads(args.threads)
    results: dict = {"tokens_per_s": {}, "experts_read": {}, "params": {}}
    results["top_k"], results["experts"] = args.moe_top_k, args.moe_experts
    hits: list[tuple[int, int]] = []  # (rows, experts picked) of each MoE layer call of a decode-only step
    forward = moe_module.SparseMoE.forward

    def counted(self, x):
        flat = self.route(x.reshape(-1, x.shape[-1]))[0]
        hits.append((len(flat), len(flat.unique())))
        return forward(self, x)

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for kind in ("moe", "dense-active", "dense-total"):
            dirs[kind] = Path(tmp) / kind
            results["params"][kind], experts = build_moe_family(dirs[kind], args, kind)
            results["params"].setdefault("experts", experts)
        for c in args.concurrency:
            engines = {kind: engine(str(d), "none", c) for kind, d in dirs.items()}
            engines["moe int8"] = engine(str(dirs["moe"]), "int8", c)
            out: dict[str, list[float]] = {kind: [] for kind in engines}
            names = list(engines)
            for r in range(args.rounds):
                for kind in names if r % 2 == 0 else reversed(names):
                    requests = max(2, c * args.requests_per_slot)
                    out[kind].append(throughput(engines[kind], c, requests, args.prompt_tokens, args.output_tokens))
            results["tokens_per_s"][c] = out
            # The experts a decode step of c sequences picks: c requests decoding together, counted per layer call.
            moe_module.SparseMoE.forward = counted
            try:
                hits.clear()
                throughput(engines["moe"], c, c, args.prompt_tokens, args.output_tokens)
            finally:
                moe_module.SparseMoE.forward = forward
            full = [picked for rows, picked in hits if rows == c]
            results["experts_read"][c] = statistics.mean(full) / args.moe_experts if full else float("nan")
            del engines
            gc.collect()
    results["micro"] = moe_layer_micro(args)
    return results


def report_moe(r: dict) -> None:
    p = r["params"]
    print(
        f"== Mixture of experts: {p['moe']:,} parameters ({p['experts']:,} experts, a token runs their top-k share) "
        f"against dense models of its active ({p['dense-active']:,}) and total ({p['dense-total']:,}) size"
    )
    for c, legs in r["tokens_per_s"].items():
        moe_tps = statistics.median(legs["moe"])
        line = [f"concurrency {c}: MoE {moe_tps:.1f} tok/s"]
        for kind in ("dense-active", "dense-total"):
            ratios = [a / b for a, b in zip(legs["moe"], legs[kind])]
            line.append(
                f"{kind} {statistics.median(legs[kind]):.1f} tok/s: MoE {statistics.median(ratios):.2f}x it "
                f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
            )
        ratios = [a / b for a, b in zip(legs["moe int8"], legs["moe"])]
        line.append(
            f"MoE int8 {statistics.median(legs['moe int8']):.1f} tok/s: {statistics.median(ratios):.2f}x fp32 "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
        print("; ".join(line))
    for c, share in r["experts_read"].items():
        planned = 1 - (1 - r["top_k"] / r["experts"]) ** c
        print(
            f"  a decode step of {c} sequence(s) picks {share:.1%} of each layer's experts (counted in the engine; "
            f"pylon plan assumes {planned:.1%})"
        )
    m = r["micro"]
    print(
        f"  one MoE layer, µs, Pylon's against transformers' ({m['implementation']} experts; largest difference "
        f"{m['max_diff']:.1e}):"
    )
    for rows, us in m["us"]["pylon"].items():
        theirs = m["us"]["transformers"][rows]
        print(
            f"    {rows:4d} rows: Pylon {us:9.0f}, transformers {theirs:9.0f}: "
            f"transformers' time / Pylon's {theirs / us:.2f}"
        )


def grounded_prompts(n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Prompts made of a few phrases repeated (ASCII bytes), as an edit or a summary repeats its input."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(97, 123) for _ in range(rng.randrange(6, 16))] for _ in range(3)]
        prompt: list[int] = []
        while len(prompt) < prompt_tokens:
            prompt += rng.choice(phrases) + [32]
        out.append(prompt[:prompt_tokens])
    return out


def truncated_gpt2(source: Path, directory: Path, layers: int) -> None:
    """The GPT-2 export at `source` cut to its first `layers` layers (embeddings, final norm and lm_head kept), saved
    as an export of its own at `directory`: a draft model sharing the tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.transformer.h = model.transformer.h[:layers]
    model.config.n_layer = layers
    model.save_pretrained(directory)
    shutil.copy(source / "pylon_tokenizer.json", directory / "pylon_tokenizer.json")


SPEC_LEGS = ("plain", "ngram", "draft")
SPEC_SHAPING = {"penalties": SHAPING, "logit_bias": {"logit_bias": SHAPING["logit_bias"]}}


def speculative(args) -> dict:
    """n-gram and draft-model speculation against plain decoding, for a looping (0.02) and a context-following
    (0.5) model."""
    import torch

    torch.set_num_threads(args.threads)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for init in (0.02, 0.5):
            directory = Path(tmp) / f"gpt2-{init}"
            build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab, init=init)
            drafter = Path(tmp) / f"gpt2-{init}-draft"
            truncated_gpt2(directory, drafter, args.draft_layers)
            methods = {
                "ngram": {"method": "ngram", "num_tokens": args.spec_tokens},
                "draft": {"method": "draft", "draft_model": str(drafter), "num_tokens": args.spec_tokens},
            }
            by_c = {}
            for c in args.spec_concurrency:
                requests = max(2, c * args.requests_per_slot)
                prompts = grounded_prompts(requests, args.spec_prompt_tokens, seed=c)
                order = ("plain", *args.spec_methods)
                legs = {leg: [] for leg in order}
                stats = {}
                for r in range(args.rounds):
                    for leg in order[r % len(order) :] + order[: r % len(order)]:  # rotate the order
                        fields = {"speculative": methods[leg]} if leg in methods else {}
                        eng = engine(str(directory), "none", c, **fields)
                        steps = _counting_steps(eng)
                        legs[leg].append(
                            throughput(
                                eng,
                                c,
                                requests,
                                0,
                                args.spec_output_tokens,
                                prompts=[list(p) for p in prompts],
                                shaping=SPEC_SHAPING.get(args.spec_shaped),
                            )
                        )
                        generated = eng.stats().generation_tokens_total
                        stats.setdefault(leg, {})["passes_per_token"] = steps[0] / generated
                        if leg in methods:
                            policy = eng.spec_policy
                            stats[leg].update(
                                proposed=policy.proposed_total,
                                accepted=policy.accepted_total,
                                verify_steps=policy.verified_total,
                                speculated_steps=policy.speculated_steps_total,
                                skipped_steps=policy.skipped_steps_total,
                                draft_passes_per_token=(
                                    eng.drafter.forward_passes / generated if eng.drafter is not None else 0.0
                                ),
                            )
                        del eng
                        gc.collect()  # an engine holds its KV cache until the collector breaks its cycles
                by_c[c] = {"legs": legs, "stats": stats}
            results[init] = by_c
    results["shaped"] = args.spec_shaped
    return results


def _counting_steps(eng) -> list[int]:
    """A one-element list that counts the model's forward passes (the runner's steps) from now on."""
    count = [0]
    execute = eng.runner.execute

    def counted(steps):
        count[0] += 1
        return execute(steps)

    eng.runner.execute = counted
    return count


def report_speculative(r: dict) -> None:
    print(
        "== speculative decoding: ngram prompt lookup and a draft model vs plain, greedy, input-grounded prompts"
        + (f", every request with shaping: {shaped}" if (shaped := r.pop("shaped", None)) else "")
    )
    for init, by_c in r.items():
        kind = "loops (best case)" if init == 0.02 else "follows the context (worst case)"
        for c, got in by_c.items():
            plain = statistics.median(got["legs"]["plain"])
            print(
                f"init {init} ({kind}), concurrency {c}: plain {plain:.1f} tok/s, "
                f"{got['stats']['plain']['passes_per_token']:.2f} forward passes per output token"
            )
            for leg in [m for m in SPEC_LEGS[1:] if m in got["legs"]]:
                spec = statistics.median(got["legs"][leg])
                ratios = [a / b for a, b in zip(got["legs"][leg], got["legs"]["plain"])]
                target = 1.7 if (c == 1 and init == 0.02) else 0.95
                met = "met" if spec / plain >= target else "NOT met"
                s = got["stats"][leg]
                accept = s["accepted"] / s["proposed"] if s["proposed"] else float("nan")
                per_step = 1 + s["accepted"] / s["verify_steps"] if s["verify_steps"] else float("nan")
                print(
                    f"  {leg}: {spec:.1f} tok/s: {spec / plain:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}; "
                    f"target >= {target}x: {met}); drafts {s['proposed']}, accepted {s['accepted']} ({accept:.0%}), "
                    f"{per_step:.2f} tokens per verifying step; the rule speculated in {s['speculated_steps']} "
                    f"steps, held back in {s['skipped_steps']}; model passes per output token "
                    f"{s['passes_per_token']:.2f}"
                    + (f", draft model passes {s['draft_passes_per_token']:.2f}" if leg == "draft" else "")
                )


def embed_inputs(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """`n` inputs of 16-256 bytes of the held-out text (each after `prefix`, if given)."""
    import random

    text = DATASET.read_bytes()[-200_000:]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, at = rng.randrange(16, 257), rng.randrange(0, len(text) - 257)
        out.append((prefix or []) + list(text[at : at + length]))
    return out


def embed_engine(eng, inputs: list[list[int]]) -> tuple[list[list[float]], int]:
    """Every input embedded by the engine, all queued at once; (their vectors, prompt tokens taken from the cache)."""
    from pylon.serving.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=0, embed=True)
    for i, ids in enumerate(inputs):
        eng.add_request(f"e{i}", ids, params)
    vectors: dict[str, list[float]] = {}
    cached = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                vectors[out.request_id] = out.embedding
                cached += out.num_cached_tokens
    return [vectors[f"e{i}"] for i in range(len(inputs))], cached


def embed_transformers(model, inputs: list[list[int]], batch: int):
    """The baseline, as sentence-transformers' `encode` runs it: the inputs sorted by length (longest first, so that
    a batch pads little), the model's body over right-padded batches, each input's last real token's final state;
    returned in the inputs' order."""
    import torch

    vectors: list = [None] * len(inputs)
    with torch.no_grad():
        for part, ids, mask in padded_batches(inputs, batch, 0):
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(part):
                vectors[i] = hidden[row, len(inputs[i]) - 1]
    return vectors


def padded_batches(inputs: list[list[int]], batch: int, pad: int):
    """The inputs as sentence-transformers batches them: sorted by length, longest first (a batch pads little), each
    batch right-padded with `pad`: (the inputs' indices, ids, attention mask) per batch."""
    import torch

    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    for b in range(0, len(order), batch):
        part = order[b : b + batch]
        width = len(inputs[part[0]])
        ids = torch.tensor([inputs[i] + [pad] * (width - len(inputs[i])) for i in part])
        mask = torch.tensor([[1] * len(inputs[i]) + [0] * (width - len(inputs[i])) for i in part])
        yield part, ids, mask


def embeddings(args) -> dict:
    """Embedding inputs/s, the engine against transformers' padded batches, legs alternating; then the prompt tokens
    the engine computes for inputs sharing a prefix."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    results: dict = {"inputs_per_s": {"engine": [], "transformers": []}}
    inputs = embed_inputs(args.embed_inputs, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt2"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        eng = engine(str(directory), "none", 64, enable_prefix_caching=False)
        embed_engine(eng, inputs[:2])  # first-call costs, not counted
        for r in range(args.rounds):
            for leg in ("engine", "transformers") if r % 2 == 0 else ("transformers", "engine"):
                t0 = time.monotonic()
                if leg == "engine":
                    ours, _ = embed_engine(eng, inputs)
                else:
                    theirs = embed_transformers(model, inputs, args.embed_batch)
                results["inputs_per_s"][leg].append(len(inputs) / (time.monotonic() - t0))
        results["max_difference"] = max(
            (torch.tensor(a) / torch.tensor(a).norm() - b / b.norm()).abs().max().item() for a, b in zip(ours, theirs)
        )
        del eng
        gc.collect()
        prefix = list(b"Instruct: Given a question, retrieve passages of the play that answer it\nQuery: ") * 2
        shared = embed_inputs(args.embed_inputs, seed=1, prefix=prefix)
        eng = engine(str(directory), "none", 64)
        _, cached = embed_engine(eng, shared)
        total = sum(map(len, shared))
        results["prefix"] = {"prefix_tokens": len(prefix), "tokens": total, "computed": total - cached}
        del eng
        gc.collect()
    return results


def report_embeddings(r: dict) -> None:
    legs = r["inputs_per_s"]
    ratios = [a / b for a, b in zip(legs["engine"], legs["transformers"])]
    print(
        f"== embeddings: engine {statistics.median(legs['engine']):.1f} inputs/s, transformers' padded batches "
        f"{statistics.median(legs['transformers']):.1f}: {statistics.median(ratios):.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); largest difference between their normalised vectors "
        f"{r['max_difference']:.1e}"
    )
    p = r["prefix"]
    print(
        f"   a shared {p['prefix_tokens']}-token instruction prefix: the engine computed {p['computed']:,} of the "
        f"inputs' {p['tokens']:,} prompt tokens ({p['computed'] / p['tokens']:.2f}x; transformers computes them all)"
    )


def reward_inputs(prompts: int, group: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """A GRPO-style batch to score: `prompts` prompts of `prompt_tokens` bytes of the held-out text, each followed by
    `group` responses of 32-128 bytes (a response: another stretch of the text), the prompt's responses in a row."""
    import random

    text = DATASET.read_bytes()[-200_000:]
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        at = rng.randrange(0, len(text) - prompt_tokens)
        prompt = list(text[at : at + prompt_tokens])
        for _ in range(group):
            length, at = rng.randrange(32, 129), rng.randrange(0, len(text) - 129)
            out.append(prompt + list(text[at : at + length]))
    return out


def rewards_transformers(model, inputs: list[list[int]], batch: int) -> list[float]:
    """The baseline, as an RL trainer scores rollouts with `transformers`' reward model: the inputs sorted by length
    (longest first: little padding), right-padded batches of `batch` through AutoModelForSequenceClassification with
    an attention mask, each input's logit at its last real token (the model's own pooling, pad_token_id set)."""
    import torch

    scores: list = [None] * len(inputs)
    with torch.no_grad():
        for part, ids, mask in padded_batches(inputs, batch, model.config.pad_token_id):
            logits = model(input_ids=ids, attention_mask=mask).logits
            for row, i in enumerate(part):
                scores[i] = float(logits[row, 0])
    return scores


def rewards(args) -> dict:
    """Reward-model scoring of a GRPO-style batch (`--reward-prompts` prompts x `--reward-group` responses): the
    engine (a GPT2ForSequenceClassification served as a classifier, the prefix cache on: a prompt's responses share
    its blocks) against `transformers`' padded batches, legs alternating on a fresh batch each round; the rewards'
    largest difference, and the prompt tokens the engine computed against every token (machine-independent)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(args.threads)
    results: dict = {"inputs_per_s": {"engine": [], "transformers": []}, "computed": [], "tokens": [], "diff": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "reward"
        build_gpt2(directory, args.n_layer, args.n_embd, args.n_head, args.vocab, reward=True)
        model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
        eng = engine(str(directory), "none", 64, kv_cache_tokens=32768)
        embed_engine(eng, [list(b"warm up"), list(b"the first call")])  # first-call costs, not counted
        for r in range(args.rounds):
            inputs = reward_inputs(args.reward_prompts, args.reward_group, args.reward_prompt_tokens, seed=100 + r)
            for leg in ("engine", "transformers") if r % 2 == 0 else ("transformers", "engine"):
                t0 = time.monotonic()
                if leg == "engine":
                    ours, cached = embed_engine(eng, inputs)
                else:
                    theirs = rewards_transformers(model, inputs, args.embed_batch)
                results["inputs_per_s"][leg].append(len(inputs) / (time.monotonic() - t0))
            total = sum(map(len, inputs))
            results["tokens"].append(total)
            results["computed"].append(total - cached)
            results["diff"].append(max(abs(a[0] - b) for a, b in zip(ours, theirs)))
        results["inputs"] = len(inputs)
        del eng
        gc.collect()
    return results


def report_rewards(r: dict) -> None:
    legs = r["inputs_per_s"]
    ratios = [a / b for a, b in zip(legs["engine"], legs["transformers"])]
    computed, tokens = sum(r["computed"]), sum(r["tokens"])
    print(
        f"== rewards ({r['inputs']} rollouts a round): engine {statistics.median(legs['engine']):.1f} inputs/s, "
        f"transformers' padded batches {statistics.median(legs['transformers']):.1f}: {statistics.median(ratios):.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); largest reward difference {max(r['diff']):.1e}"
    )
    print(
        f"   prompt tokens the engine computed: {computed:,} of {tokens:,} ({computed / tokens:.2f}x; transformers "
        "computes them all, and its padding besides)"
    )


def images(args) -> dict:
    """Images (serving/engine/images.py) on a checkpoint built in the run with the image tests' builder
    (tests/image_models.py; random weights): `--image-family gemma3`, Gemma 3's shape with a SigLIP-shaped vision tower
    of `--image-vision-layers` layers over 224 x 224 images, 64 tokens an image; `qwen2_5_vl`, Qwen2.5-VL's (M-RoPE),
    its vision tower of as many layers, up to 64 tokens an image (the test picture's 320 x 240: 48). A chat about one
    image over `--image-turns` turns, each request sending the whole conversation as chat clients do, with the prefix
    cache against without (prompt tokens computed and the vision tower's runs: counts that do not depend on the
    machine; and the turns' wall time); then the price of an image, the time to the first token of a request with one
    image against one of the same length in text tokens, legs alternating; then the price of decoding after an image
    (Qwen's: each row's M-RoPE positions a step), 8 requests with an image each decoding `--image-reply-tokens`
    tokens against 8 of the same length in text."""
    import sys

    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import image_models

    from pylon.serving.engine.images import ImagePrompt
    from pylon.serving.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    layers = 6
    text = {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
    }
    vision = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": args.image_vision_layers}
    vision["num_attention_heads"] = 6
    questions = DATASET.read_text()[:4000].split("\n\n")
    results: dict = {"turns": {}, "price": [], "decode": [], "family": args.image_family}
    with tempfile.TemporaryDirectory() as tmp:
        family = args.image_family
        if family == "qwen2_5_vl":  # Qwen2's layer (no windows); a vision tower of as many layers, windowed
            text = {k: v for k, v in text.items() if k not in ("sliding_window", "layer_types", "head_dim")}
            vision = {"depth": args.image_vision_layers, "hidden_size": 384, "intermediate_size": 1536}
            vision |= {"num_heads": 6, "fullatt_block_indexes": [args.image_vision_layers - 1]}
        directory = image_models.image_checkpoint(
            family, Path(tmp) / family, text=text, vision=vision, image=224, image_tokens=64, max_image_tokens=64
        )
        picture = image_models.png(0, (320, 240))
        tokenizer = AutoTokenizer.from_pretrained(directory)
        params = SamplingParams(max_tokens=args.image_reply_tokens, temperature=0, ignore_eos=True)
        for cached in (True, False):
            eng = engine(str(directory), "none", 1, enable_prefix_caching=cached, max_model_len=4096)
            messages: list[dict] = []
            rows = []
            for turn in range(args.image_turns):
                content = [{"type": "text", "text": questions[turn % len(questions)][:200]}]
                if turn == 0:
                    content.insert(0, {"type": "image"})
                messages.append({"role": "user", "content": content})
                before = eng.stats()
                t0 = time.monotonic()
                eng.add_request(f"t{turn}", ImagePrompt(image_models.render(directory, messages), (picture,)), params)
                reply = []
                while eng.has_unfinished():
                    for out in eng.step():
                        reply.extend(out.token_ids)
                        prompt_tokens = out.num_prompt_tokens
                after = eng.stats()
                rows.append(
                    {
                        "prompt_tokens": prompt_tokens,
                        "computed": after.prefill_tokens_computed_total - before.prefill_tokens_computed_total,
                        "encoded": after.images_encoded_total - before.images_encoded_total,
                        "seconds": time.monotonic() - t0,
                    }
                )
                # (a random model's reply holds special tokens: an <start_of_image> in it would be a marker)
                messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
            results["turns"][cached] = rows
            del eng
            gc.collect()
        eng = engine(str(directory), "none", 1, enable_prefix_caching=False)
        prompt = ImagePrompt(
            image_models.render(directory, [{"role": "user", "content": [{"type": "image"}]}]), (picture,)
        )
        ids, _ = eng.images.prepare(prompt)
        words = [i for i in eng.tokenizer.encode(DATASET.read_text()[:20000]).tolist()][: len(ids)]
        one = SamplingParams(max_tokens=1, temperature=0)
        for r in range(args.rounds * 2):
            times = {}
            for leg in ("image", "text") if r % 2 == 0 else ("text", "image"):
                t0 = time.monotonic()
                eng.add_request(f"{leg}{r}", prompt if leg == "image" else words, one)
                while eng.has_unfinished():
                    eng.step()
                times[leg] = time.monotonic() - t0
            results["price"].append(times)
        results["prompt_tokens"] = len(ids)
        del eng
        gc.collect()
        # Decoding after an image: 8 requests at once, each an image (or as many text tokens), then its reply.
        eng = engine(str(directory), "none", 8, max_model_len=4096)
        reply = SamplingParams(max_tokens=args.image_reply_tokens, temperature=0, ignore_eos=True)
        for r in range(args.rounds * 2):
            times = {}
            for leg in ("image", "text") if r % 2 == 0 else ("text", "image"):
                for k in range(8):
                    eng.add_request(f"d{leg}{r}-{k}", prompt if leg == "image" else words, one)
                while eng.has_unfinished():  # (their prompts cached first: what follows is decoding, bar a block)
                    eng.step()
                for k in range(8):
                    eng.add_request(f"e{leg}{r}-{k}", prompt if leg == "image" else words, reply)
                t0 = time.monotonic()
                while eng.has_unfinished():
                    eng.step()
                times[leg] = time.monotonic() - t0
            results["decode"].append(times)
    return results


def report_images(r: dict) -> None:
    on, off = r["turns"][True], r["turns"][False]
    computed_on, computed_off = sum(t["computed"] for t in on), sum(t["computed"] for t in off)
    print(
        f"== images: a chat about one image over {len(on)} turns, the whole conversation sent each turn (prompts "
        f"{on[0]['prompt_tokens']}..{on[-1]['prompt_tokens']} tokens)"
    )
    print(
        f"prefix cache on: {computed_on} prompt tokens computed, the vision tower run "
        f"{sum(t['encoded'] for t in on)}x, {sum(t['seconds'] for t in on):.2f} s; off: {computed_off} computed, run "
        f"{sum(t['encoded'] for t in off)}x, {sum(t['seconds'] for t in off):.2f} s: tokens computed "
        f"{computed_on / computed_off:.2f}x, time {sum(t['seconds'] for t in on) / sum(t['seconds'] for t in off):.2f}x"
    )
    ratios = [p["image"] / p["text"] for p in r["price"]]
    print(
        f"the price of an image: a request of one image ({r['prompt_tokens']} tokens) to its first token "
        f"{statistics.median(p['image'] for p in r['price']):.3f} s, the same length in text "
        f"{statistics.median(p['text'] for p in r['price']):.3f} s: {statistics.median(ratios):.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if r.get("decode"):
        ratios = [p["image"] / p["text"] for p in r["decode"]]
        print(
            f"decoding after an image ({r['family']}): 8 requests of one image, each prompt then its reply, "
            f"{statistics.median(p['image'] for p in r['decode']):.3f} s against the same in text "
            f"{statistics.median(p['text'] for p in r['decode']):.3f} s: {statistics.median(ratios):.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=f"where the engines run; on cuda the sections {', '.join(GPU_SECTIONS)} (default cpu)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="the engines' dtype (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (an engine process per core runs 1)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests-per-slot", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--spec-concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--spec-prompt-tokens", type=int, default=200)
    p.add_argument("--spec-tokens", type=int, default=4, help="engine.speculative.num_tokens")
    p.add_argument("--draft-layers", type=int, default=2, help="the draft model's layers: the model's first N")
    p.add_argument(
        "--spec-methods", nargs="+", choices=SPEC_LEGS[1:], default=list(SPEC_LEGS[1:]), help="legs beside plain"
    )
    p.add_argument("--spec-output-tokens", type=int, default=96, help="decoding, not the prompt, is what it speeds")
    p.add_argument(
        "--spec-shaped",
        choices=list(SPEC_SHAPING),
        help="every speculative-section request (each leg's) carries the penalties section's shaping (penalties: all "
        "of it; logit_bias: its biased tokens only)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(SECTIONS),
        help="run these sections only",
    )
    p.add_argument("--embed-inputs", type=int, default=128, help="texts the embeddings section embeds per leg")
    p.add_argument("--embed-batch", type=int, default=32, help="the transformers leg's batch (sentence-transformers')")
    p.add_argument("--reward-prompts", type=int, default=8, help="prompts of the rewards section's batch")
    p.add_argument("--reward-group", type=int, default=8, help="responses scored per prompt (a GRPO group)")
    p.add_argument("--reward-prompt-tokens", type=int, default=160, help="each prompt's tokens")
    p.add_argument("--lora-adapters", type=int, default=4, help="LoRA adapters the lora section's engine holds")
    p.add_argument("--lora-rank", type=int, default=16, help="their rank (on every projection)")
    p.add_argument("--lora-slots", type=int, default=2, help="engine.dynamic_adapters.max_loaded for the on-demand leg")
    p.add_argument("--moe-hidden", type=int, default=512, help="the moe section's hidden size")
    p.add_argument("--moe-layers", type=int, default=4, help="its layers")
    p.add_argument("--moe-experts", type=int, default=8, help="its experts per layer (Mixtral's 8)")
    p.add_argument("--moe-top-k", type=int, default=2, help="the experts a token runs (Mixtral's 2)")
    p.add_argument("--moe-intermediate", type=int, default=1024, help="an expert's intermediate size")
    p.add_argument("--image-turns", type=int, default=6, help="turns of the images section's chat about one image")
    p.add_argument("--image-reply-tokens", type=int, default=32, help="the reply's tokens each turn")
    p.add_argument("--image-vision-layers", type=int, default=6, help="its vision tower's layers")
    p.add_argument(
        "--image-family",
        choices=("gemma3", "qwen2_5_vl"),
        default="gemma3",
        help="the images section's checkpoint: Gemma 3's shape, or Qwen2.5-VL's (M-RoPE positions)",
    )
    args = p.parse_args()
    PLACE.update(device=args.device, dtype=args.dtype or ("bf16" if args.device == "cuda" else "fp32"))
    chosen = args.only or (GPU_SECTIONS if args.device == "cuda" else list(SECTIONS))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
        off = [name for name in chosen if name not in GPU_SECTIONS]
        if off:
            p.error(f"--only {' '.join(off)}: CPU only (a transformers or CPU-kernel leg); on cuda: {GPU_SECTIONS}")
    for name, (run, report) in SECTIONS.items():
        if name in chosen:
            report(run(args))


# Each section's name (--only), what measures it and what prints it, in the order a whole run takes them.
SECTIONS = {
    "quantization": (quantization, report_quantization),
    "constrained": (constrained, report_constrained),
    "penalties": (penalties, report_penalties),
    "speculative": (speculative, report_speculative),
    "lora": (lora, report_lora),
    "embeddings": (embeddings, report_embeddings),
    "rewards": (rewards, report_rewards),
    "moe": (moe, report_moe),
    "images": (images, report_images),
}


if __name__ == "__main__":
    main()
