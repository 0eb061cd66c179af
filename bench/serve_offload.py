"""The prefix cache's host tier (engine.kv_offload_tokens) against the device's cache alone, on chats whose
conversations together hold more context than the device's cache: in one run, the same model and requests.

    .venv/bin/python bench/serve_offload.py                 # 16 conversations of 1,024 tokens' context, 3 turns
    .venv/bin/python bench/serve_offload.py --rounds 3 --kv-cache-tokens 8192

A random Llama saved as a Pylon export, byte tokenizer, greedy. `--conversations` chats, each opening with a document
of `--context` random tokens of its own; each turn adds the last reply and a message of `--message` tokens and asks for
`--new` tokens. A turn of every conversation is added at once to an in-process `LLMEngine` (at most `--max-num-seqs`
running), the next turn once all have answered: by the time a conversation comes back, the others' turns have been
through a device cache of `--kv-cache-tokens`, fewer than the conversations' contexts together. Three legs: the
device's cache alone (`device`), the same with a host tier of `--offload-tokens` (`tiered`), and a device cache that
holds everything (`roomy`: what the tier can at best give). Counted, machine-independent: prompt tokens computed,
prompt tokens found cached, blocks copied to and from host memory and their bytes, forward passes; timed on this
machine: the whole run's seconds and the mean time to first token (median over `--rounds`, legs alternating). The
legs' outputs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def _model(directory: Path, args) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.max_model_len,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return str(directory)


def _leg(directory: str, args, documents: list[list[int]], messages: list[list[list[int]]], kind: str) -> dict:
    from pylon.serving.engine.engine import LLMEngine
    from pylon.serving.engine.sampling import SamplingParams
    from pylon.specs import EngineSpec

    total = len(documents) * args.max_model_len
    engine = LLMEngine(
        directory,
        EngineSpec(
            device="cpu",
            dtype="fp32",
            kv_cache_tokens=total if kind == "roomy" else args.kv_cache_tokens,
            kv_offload_tokens=args.offload_tokens if kind == "tiered" else 0,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=512,
            block_size=16,
        ),
    )
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    chats = [list(d) for d in documents]
    outputs: list[list[int]] = []
    first_token: list[float] = []
    started = time.perf_counter()
    for turn in range(args.turns):
        added: dict[str, float] = {}
        replies: dict[str, list[int]] = {}
        for i, chat in enumerate(chats):
            chat.extend(messages[turn][i])
            added[str(i)] = time.perf_counter()
            engine.add_request(str(i), chat, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in replies:
                    first_token.append(time.perf_counter() - added[out.request_id])
                replies.setdefault(out.request_id, []).extend(out.token_ids)
        for i, chat in enumerate(chats):
            chat.extend(replies[str(i)])
            outputs.append(replies[str(i)])
    seconds = time.perf_counter() - started
    stats = engine.stats()
    block_bytes = sum(t[:, :1].numel() * t.element_size() for t in engine.runner.kv_tensors())
    return {
        "outputs": outputs,
        "prompt_tokens": stats.prefix_cache_queries_total,
        "prompt_tokens_cached": stats.prefix_cache_hits_total,
        "prefill_tokens_computed": stats.prefill_tokens_computed_total,
        "blocks_saved": stats.kv_offload_saved_blocks_total,
        "blocks_loaded": stats.kv_offload_loaded_blocks_total,
        "bytes_copied": (stats.kv_offload_saved_blocks_total + stats.kv_offload_loaded_blocks_total) * block_bytes,
        "forward_passes": stats.forward_passes_total,
        "preemptions": stats.num_preemptions_total,
        "seconds": seconds,
        "mean_ttft_s": statistics.fmean(first_token),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16, help="chats, a turn of each at once (default 16)")
    parser.add_argument("--context", type=int, default=1024, help="each chat's opening document (default 1,024)")
    parser.add_argument("--turns", type=int, default=3, help="turns of each chat (default 3)")
    parser.add_argument("--message", type=int, default=32, help="tokens of each turn's message (default 32)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated a turn (default 32)")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192, help="the device's cache (default 8,192)")
    parser.add_argument("--offload-tokens", type=int, default=32768, help="the host tier (default 32,768)")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="running at once (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, legs alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    args.max_model_len = args.context + args.turns * (args.message + args.new) + 16
    rng = random.Random(1)
    documents = [[rng.randrange(32, 127) for _ in range(args.context)] for _ in range(args.conversations)]
    messages = [
        [[rng.randrange(32, 127) for _ in range(args.message)] for _ in range(args.conversations)]
        for _ in range(args.turns)
    ]
    print(
        f"llama {args.layers} x {args.hidden}; {args.conversations} chats of {args.context} tokens' document, "
        f"{args.turns} turns of {args.message} + {args.new} tokens; a device cache of {args.kv_cache_tokens:,} tokens, "
        f"a host tier of {args.offload_tokens:,}; fp32, CPU",
        flush=True,
    )
    legs: dict[str, list[dict]] = {"device": [], "tiered": [], "roomy": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = _model(Path(tmp), args)
        for _ in range(args.rounds):
            for name in legs:
                legs[name].append(_leg(directory, args, documents, messages, name))
    first = {name: runs[0] for name, runs in legs.items()}
    assert first["tiered"]["outputs"] == first["device"]["outputs"] == first["roomy"]["outputs"], "outputs differ"
    row = {name: {k: v for k, v in first[name].items() if k != "outputs"} for name in legs}
    for name, runs in legs.items():
        row[name]["seconds_rounds"] = [r["seconds"] for r in runs]
        row[name]["seconds"] = statistics.median(r["seconds"] for r in runs)
        row[name]["mean_ttft_s"] = statistics.median(r["mean_ttft_s"] for r in runs)
    row["computed_ratio"] = row["tiered"]["prefill_tokens_computed"] / row["device"]["prefill_tokens_computed"]
    row["speedup"] = row["device"]["seconds"] / row["tiered"]["seconds"]
    row["ttft_ratio"] = row["tiered"]["mean_ttft_s"] / row["device"]["mean_ttft_s"]
    if args.json:
        print(json.dumps(row))
        return 0
    for name in legs:
        r = row[name]
        print(
            f"{name:>6}: {r['prefill_tokens_computed']:7,} prompt tokens computed of {r['prompt_tokens']:7,} "
            f"({r['prompt_tokens_cached']:7,} cached), {r['blocks_saved']:5,} blocks to host and "
            f"{r['blocks_loaded']:5,} back ({r['bytes_copied'] / 2**20:6.1f} MiB), {r['forward_passes']:4,} passes; "
            f"{r['seconds']:6.2f} s ({', '.join(f'{x:.2f}' for x in r['seconds_rounds'])}), mean TTFT "
            f"{r['mean_ttft_s'] * 1e3:6.1f} ms",
            flush=True,
        )
    print(
        f"outputs equal; tiered / device: prompt tokens computed {row['computed_ratio']:.2f}x, time "
        f"{1 / row['speedup']:.2f}x (speedup {row['speedup']:.2f}x), mean TTFT {row['ttft_ratio']:.2f}x",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
