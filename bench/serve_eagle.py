"""Speculative decoding from an EAGLE-3 head (`engine.speculative.method: eagle3`) against plain decoding and prompt
lookup, on the same model and requests, legs alternating over `--rounds`.

No model with a released EAGLE-3 head can be downloaded here, so both are trained here: a Llama-shaped byte-level
model (`--layers` layers, `--hidden` wide) for `--train-steps` steps on the first 90% of tinyshakespeare, then an
EAGLE-3 head for it (`--head-steps` steps, the model frozen) as EAGLE-3 trains one: `fc` over the inputs of the
model's layers 2, N // 2 and N - 3, one decoder layer whose attention reads [its norm of the next token's embedding,
its norm of that], its norm and output layer over a draft vocabulary of the `--draft-vocab` most frequent tokens of
the training text (`d2t`), trained to match the model's next-token distribution with training-time test: `--unroll`
steps, each next one fed the head's own outputs before, its queries attending the first step's keys and values of the
positions before and the later steps' of its own chain, as the engine's drafts attend them. The head is saved as
EAGLE-3's releases hold it (`LlamaForCausalLMEagle3`, `midlayer.*`, `d2t`, `t2d`, pytorch_model.bin) and the engine
reads it from there. The requests measured are windows of the last 10% of the text.

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
    """An EAGLE-3 head for the model in `model_dir`, trained with training-time test, saved in EAGLE-3's layout."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    mc = model.config
    n, hidden, vocab = mc.num_hidden_layers, mc.hidden_size, mc.vocab_size
    aux = (2, n // 2, n - 3)
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab)
    chosen = counts.argsort(descending=True)[: args.draft_vocab].sort().values  # the draft vocabulary, by frequency
    heads, kv_heads, head_dim, width = 8, 4, hidden // 8, hidden * 3
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=width,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=1024,
        draft_vocab_size=args.draft_vocab,
        architectures=["LlamaForCausalLMEagle3"],
    )
    torch.manual_seed(3)
    eps = config.rms_norm_eps
    p = torch.nn.ModuleDict(
        {
            "fc": torch.nn.Linear(3 * hidden, hidden, bias=False),
            "input_layernorm": LlamaRMSNorm(hidden, eps),
            "hidden_norm": LlamaRMSNorm(hidden, eps),
            "q_proj": torch.nn.Linear(2 * hidden, heads * head_dim, bias=False),
            "k_proj": torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
            "v_proj": torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
            "o_proj": torch.nn.Linear(heads * head_dim, hidden, bias=False),
            "post_attention_layernorm": LlamaRMSNorm(hidden, eps),
            "gate_proj": torch.nn.Linear(hidden, width, bias=False),
            "up_proj": torch.nn.Linear(hidden, width, bias=False),
            "down_proj": torch.nn.Linear(width, hidden, bias=False),
            "norm": LlamaRMSNorm(hidden, eps),
            "lm_head": torch.nn.Linear(hidden, args.draft_vocab, bias=False),
        }
    )
    rotary = LlamaRotaryEmbedding(config)
    T, k, B = args.context, args.unroll, args.batch
    positions = torch.arange(T)[None]
    cos, sin = rotary(torch.zeros(1, T, hidden), positions)
    # Which keys each step's queries see (training-time test): step s's row i attends the first step's rows before
    # i - s + 1 (the positions the head caught up on), and step r's row i - (s - r) for 1 < r <= s (its own chain).
    allowed = torch.zeros(k, T, k, T, dtype=torch.bool)
    i = torch.arange(T)
    for s in range(k):
        allowed[s, :, 0] = i[None, :] <= i[:, None] - s
        for r in range(1, s + 1):
            allowed[s, i[i - (s - r) >= 0], r, (i - (s - r))[i - (s - r) >= 0]] = True
    mask = torch.zeros(k * T, k * T).masked_fill(~allowed.view(k * T, k * T), float("-inf"))
    optimizer = torch.optim.AdamW(p.parameters(), lr=args.lr, weight_decay=0.0)
    data, g, started = torch.tensor(train_ids), torch.Generator().manual_seed(4), time.perf_counter()
    for step in range(args.head_steps):
        starts = torch.randint(0, len(data) - T - 2, (B,), generator=g).tolist()
        ids = torch.stack([data[s : s + T + 1] for s in starts])  # [B, T + 1]
        with torch.no_grad():
            out = model(input_ids=ids[:, :-1], output_hidden_states=True)
            # the model's distribution at i + 1 (of the token at i + 2), over the draft vocabulary
            teacher = F.softmax(out.logits[:, 1:, chosen], dim=-1)  # [B, T - 1, Vd]
            features = torch.cat([out.hidden_states[j] for j in aux], dim=-1)  # [B, T, 3H]
            greedy = out.logits.argmax(-1)  # the model's token at i + 1: what an accepted chain feeds the head
        # the token at i + 1 ([B, T, H]): the text's where the head catches up, the model's own along a chain
        e, chained = (p["input_layernorm"](model.model.embed_tokens(t)) for t in (ids[:, 1:], greedy))
        g_rows, keys, values, losses, right = p["fc"](features), [], [], [], []
        for s in range(k):
            normed = p["hidden_norm"](g_rows)
            x = torch.cat([e if s == 0 else chained, normed], dim=-1)
            q = p["q_proj"](x).view(B, T, heads, head_dim).transpose(1, 2)
            kk = p["k_proj"](x).view(B, T, kv_heads, head_dim).transpose(1, 2)
            v = p["v_proj"](x).view(B, T, kv_heads, head_dim).transpose(1, 2)
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk)
            values.append(v)
            K = torch.cat(keys, dim=2).repeat_interleave(heads // kv_heads, dim=1)
            V = torch.cat(values, dim=2).repeat_interleave(heads // kv_heads, dim=1)
            rows = slice(s * T, (s + 1) * T)
            a = F.scaled_dot_product_attention(q, K, V, attn_mask=mask[rows, : (s + 1) * T])
            h = g_rows + p["o_proj"](a.transpose(1, 2).reshape(B, T, -1))
            y = p["post_attention_layernorm"](h)
            h = h + p["down_proj"](F.silu(p["gate_proj"](y)) * p["up_proj"](y))
            logits = p["lm_head"](p["norm"](h))[:, s : T - 1]  # (rows whose chain exists and whose target is known)
            aimed = teacher[:, s:]
            losses.append(-(aimed * F.log_softmax(logits, dim=-1)).sum(-1).mean())
            right.append((logits.argmax(-1) == aimed.argmax(-1)).float().mean().item())
            # the next step's row i: this step's output at i - 1, as the engine's next draft is fed
            g_rows = torch.cat([h[:, :1] * 0, h[:, :-1]], dim=1)
        loss = sum(losses) / k
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.parameters(), 1.0)
        optimizer.step()
        if step % max(1, args.head_steps // 4) == 0 or step == args.head_steps - 1:
            said = ", ".join(f"{r:.0%}" for r in right)
            print(
                f"  head step {step}: loss {loss.item():.3f}, the model's token matched by step {said}, "
                f"{time.perf_counter() - started:.0f} s"
            )
    head_dir.mkdir()
    (head_dir / "config.json").write_text(config.to_json_string())
    names = {"fc": "fc", "norm": "norm", "lm_head": "lm_head"}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[name] = f"midlayer.{name}"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[name] = f"midlayer.self_attn.{name}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        names[name] = f"midlayer.mlp.{name}"
    tensors = {f"{names[k]}.weight": m.weight.detach().clone() for k, m in p.items()}
    tensors["d2t"] = chosen - torch.arange(args.draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True)
    torch.save(tensors, head_dir / "pytorch_model.bin")


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
