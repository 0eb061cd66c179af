"""Speculative decoding from an EAGLE-3 head (`engine.speculative.method: eagle3`) against plain decoding and prompt
lookup, on the same model and requests, legs alternating over `--rounds`.

No model with a released EAGLE-3 head can be downloaded here, so both are trained here: a Llama-shaped byte-level
model (`--layers` layers, `--hidden` wide) for `--train-steps` steps on the first 90% of tinyshakespeare, then an
EAGLE-3 head for it (`--head-steps` steps, the model frozen) by `objective: eagle3`'s own modules (pylon.jobs.eagle,
pylon.draft_head) in a plain AdamW loop: `fc` over the inputs of the model's layers 2, N // 2 and N - 3, one decoder
layer whose attention reads [its norm of the next token's embedding, its norm of that], its norm and output layer
over a draft vocabulary of the `--draft-vocab` most frequent tokens of the training text (`d2t`), trained to match
the model's next-token distribution with training-time test (`--unroll` drafts deep, as the engine drafts). The head
is exported as the TrainJob exports it (EAGLE-3's layout: `LlamaForCausalLMEagle3`, `midlayer.*`, `d2t`, `t2d`) and
the engine reads it from there. The requests measured are windows of the last 10% of the text.

Each leg: `--concurrency` requests, greedy, `--output-tokens` each, through an in-process `LLMEngine`; the speculating
engines' measured rule (engine/speculative.py) decides each step whether drafts pay. Prints output tokens/s per leg,
each speculating leg's ratio to plain with the spread over rounds, drafts proposed and accepted (and by position),
tokens a speculating step, and the model's forward passes per output token and the head's passes per output token
(machine-independent). `eagle3-always` is the head's drafts with the rule told to speculate at every step it can.

    .venv/bin/python bench/serve_eagle.py --concurrency 1 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from serve_mtp import compare, corpus

LEGS = ("plain", "ngram", "eagle3", "eagle3-always")  # eagle3-always: the rule told to speculate wherever it can


def train_model(directory: Path, train_ids: list[int], args) -> None:
    """A Llama-shaped byte-level model trained on the text, saved as a Pylon export."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=320,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.02,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data, g, started = torch.tensor(train_ids), torch.Generator().manual_seed(2), time.perf_counter()
    for step in range(args.train_steps):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=g).tolist()
        ids = torch.stack([data[s : s + args.context] for s in starts])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % max(1, args.train_steps // 4) == 0 or step == args.train_steps - 1:
            print(f"  model step {step}: loss {loss.item():.3f}, {time.perf_counter() - started:.0f} s")
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def train_head(model_dir: Path, head_dir: Path, train_ids: list[int], args) -> None:
    """An EAGLE-3 head for the model in `model_dir`, trained by objective eagle3's own modules (pylon.jobs.eagle,
    pylon.draft_head: training-time test, the model's distribution as the target) in a plain AdamW loop on this
    process, and exported as the TrainJob exports it (EAGLE-3's layout)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from pylon.jobs.eagle import build_trainer, eagle3_record, export_head, most_frequent
    from pylon.specs import Eagle3Spec

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab)
    chosen = most_frequent(counts, args.draft_vocab)  # (as draft_vocabulary chooses from a dataset's labels)
    spec = SimpleNamespace(eagle3=Eagle3Spec(draft_vocab_size=args.draft_vocab, ttt_steps=args.unroll))
    trainer = build_trainer(model, spec, chosen, seed=3).train()
    optimizer = torch.optim.AdamW(trainer.head.parameters(), lr=args.lr, weight_decay=0.0)
    T, B = args.context, args.batch
    data, g, started = torch.tensor(train_ids), torch.Generator().manual_seed(4), time.perf_counter()
    for step in range(args.head_steps):
        starts = torch.randint(0, len(data) - T, (B,), generator=g).tolist()
        ids = torch.stack([data[s : s + T] for s in starts])
        out = trainer(input_ids=ids, labels=ids)
        loss = out.loss_sum / out.tokens
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.head.parameters(), 1.0)
        optimizer.step()
        if step % max(1, args.head_steps // 4) == 0 or step == args.head_steps - 1:
            record = eagle3_record(out["stats"])
            said = ", ".join(f"{record[f'eagle3_accuracy_{k}']:.0%}" for k in range(args.unroll))
            print(
                f"  head step {step}: loss {loss.item():.3f}, the model's token matched by draft {said}, "
                f"{time.perf_counter() - started:.0f} s"
            )
    export_head(trainer.state_dict(), spec, model.config, str(head_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=3, help="engine.speculative.num_tokens")
    parser.add_argument("--train-steps", type=int, default=400, help="the model's")
    parser.add_argument("--head-steps", type=int, default=300, help="the EAGLE-3 head's")
    parser.add_argument("--unroll", type=int, default=3, help="the head's training-time test steps")
    parser.add_argument("--draft-vocab", type=int, default=96, help="the head's draft vocabulary (d2t)")
    parser.add_argument("--context", type=int, default=128, help="training sequences' length")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory, head = Path(tmp) / "llama", Path(tmp) / "eagle3"
        print(
            f"== EAGLE-3 speculation vs plain decoding and prompt lookup ({args.layers} layers, {args.hidden} wide, "
            f"{args.train_steps} + {args.head_steps} training steps, num_tokens {args.num_tokens})"
        )
        train_ids, held = corpus()
        train_model(directory, train_ids, args)
        train_head(directory, head, train_ids, args)
        compare(
            directory, args, held, LEGS, lambda method: {"draft_model": str(head)} if method == "eagle3" else {}, "head"
        )


if __name__ == "__main__":
    main()
