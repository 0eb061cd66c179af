"""Speculative decoding from the checkpoint's own multi-token-prediction layer (`engine.speculative.method: mtp`)
against plain decoding and prompt lookup, on the same model and requests, legs alternating over `--rounds`.

The model is trained here as DeepSeek-V3 was, with its MTP layer: a DeepSeek-V3-shaped byte-level model (`--layers`
layers, the first dense, the rest MoE; latent attention; `--hidden` wide) and one more decoder layer with `enorm`,
`hnorm`, `eh_proj` and its norm, the model's embeddings and head shared, trained together for `--train-steps` steps on
the first 90% of tinyshakespeare (the next-token loss plus 0.3 x the layer's loss on the token after next, DeepSeek-V3's
lambda). It is saved as DeepSeek's releases hold it (`model.layers.{N}`, which transformers skips), and the engine reads
the layer from there. The requests measured are windows of the last 10% of the text.

Each leg: `--concurrency` requests, greedy, `--output-tokens` each, through an in-process `LLMEngine`; the speculating
engines' measured rule (engine/speculative.py) decides each step whether drafts pay. Prints output tokens/s per leg,
each speculating leg's ratio to plain with the spread over rounds, drafts proposed and accepted, tokens a speculating
step, and the model's forward passes per output token and the layer's passes per output token (machine-independent).
`mtp-always` is the layer's drafts with the rule told to speculate at every step it can: what speculating with them
costs and gains on this machine, whatever the rule would decide.

    .venv/bin/python bench/serve_mtp.py --concurrency 1 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

LEGS = ("plain", "ngram", "mtp", "mtp-always")  # mtp-always: the rule told to speculate at every step it can


def build(directory: Path, args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=320,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=args.hidden // 4,
        kv_lora_rank=args.hidden // 4,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=args.hidden // 2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=args.init,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


DATASET = Path("/work/shared/datasets/tinyshakespeare.txt")


def corpus() -> tuple[list[int], list[int]]:
    """The text's token ids (the byte tokenizer's), the first 90% for training and the rest held out."""
    from pylon.data.tokenizer import ByteTokenizer

    ids = ByteTokenizer().encode(DATASET.read_text()).tolist()
    cut = len(ids) * 9 // 10
    return ids[:cut], ids[cut:]


def prompts(held: list[int], n: int, tokens: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held) - tokens, (n,), generator=g).tolist()
    return [held[s : s + tokens] for s in starts]


def engine(directory: Path, concurrency: int, speculative: dict):
    from pylon.serving.engine.engine import LLMEngine
    from pylon.specs import EngineSpec

    spec = EngineSpec(
        max_num_seqs=max(concurrency, 1),
        max_num_batched_tokens=4096,
        kv_cache_tokens=concurrency * 512 + 1024,
        max_model_len=512,
        dtype="fp32",
        enable_prefix_caching=False,  # every round computes its prompts
        speculative=speculative,
    )
    return LLMEngine(str(directory), spec)


def train(directory: Path, train_ids: list[int], args) -> None:
    """Train the model and its MTP layer together, and save them as DeepSeek's checkpoints hold them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    n, hidden = config.num_hidden_layers, config.hidden_size
    bigger = AutoConfig.from_pretrained(directory, num_hidden_layers=n + 1)
    bigger._attn_implementation = "eager"
    torch.manual_seed(1)
    host = AutoModelForCausalLM.from_config(bigger, dtype=torch.float32)
    m = host.model
    norm_cls = type(m.norm)
    enorm, hnorm, snorm = (norm_cls(hidden, eps=config.rms_norm_eps) for _ in range(3))
    eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    extra = torch.nn.ModuleList([enorm, hnorm, snorm, eh_proj])
    optimizer = torch.optim.AdamW([*host.parameters(), *extra.parameters()], lr=args.lr, weight_decay=0.0)
    length = args.context
    data = torch.tensor(train_ids)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    positions = torch.arange(length)[None]
    cos_sin = m.rotary_emb(torch.zeros(1, length, hidden), positions)
    g = torch.Generator().manual_seed(2)
    started = time.perf_counter()
    for step in range(args.train_steps):
        starts = torch.randint(0, len(data) - length - 1, (args.batch,), generator=g)
        ids = torch.stack([data[s : s + length + 1] for s in starts.tolist()])  # [B, T + 1]
        h = m.embed_tokens(ids[:, :-1])
        for layer in m.layers[:n]:
            h = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
            h = h[0] if isinstance(h, tuple) else h
        h = m.norm(h)
        loss_lm = torch.nn.functional.cross_entropy(host.lm_head(h).flatten(0, 1), ids[:, 1:].flatten())
        # the layer at p: h_p and the token at p + 1 -> the token at p + 2 (rows 0 .. T - 2)
        e = m.embed_tokens(ids[:, 1:-1]).clone()
        e[:, 0] = 0
        x = eh_proj(torch.cat([enorm(e), hnorm(h[:, :-1])], dim=-1))
        mask, pos = causal[..., :-1, :-1], positions[:, :-1]
        out = m.layers[n](
            x, attention_mask=mask, position_ids=pos, position_embeddings=tuple(c[:, :-1] for c in cos_sin)
        )
        out = out[0] if isinstance(out, tuple) else out
        logits = host.lm_head(snorm(out))
        loss_mtp = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
        loss = loss_lm + 0.3 * loss_mtp
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*host.parameters(), *extra.parameters()], 1.0)
        optimizer.step()
        if step % max(1, args.train_steps // 6) == 0 or step == args.train_steps - 1:
            accuracy = (logits.argmax(-1) == ids[:, 2:]).float().mean().item()
            print(
                f"  step {step}: next-token loss {loss_lm.item():.3f}, MTP loss {loss_mtp.item():.3f} (the token "
                f"after next right {accuracy:.0%}), {time.perf_counter() - started:.0f} s"
            )
    scratch = directory.parent / "mtp-host"
    host.save_pretrained(scratch)
    saved = load_file(str(scratch / "model.safetensors"))
    tensors = {k: v for k, v in saved.items() if not k.startswith(f"model.layers.{n}.")}
    layer = {k: v for k, v in saved.items() if k.startswith(f"model.layers.{n}.")}
    own = {"enorm": enorm.weight, "hnorm": hnorm.weight, "shared_head.norm": snorm.weight, "eh_proj": eh_proj.weight}
    layer.update({f"model.layers.{n}.{k}.weight": v.detach().clone() for k, v in own.items()})
    layer[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    layer[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **layer}, str(directory / "model.safetensors"), metadata={"format": "pt"})


def leg(eng, concurrency: int, args, held: list[int], seed: int) -> tuple[float, int]:
    """(output tokens/s, the model's forward passes) of `concurrency` requests, prefill included."""
    from pylon.serving.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts(held, concurrency, args.prompt_tokens, seed=1000 + seed)):
        eng.add_request(f"{seed}-{i}", prompt, params)
    steps, tokens, t0 = 0, 0, time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(o.token_ids) for o in eng.step())
        steps += 1
    return tokens / (time.perf_counter() - t0), steps


def compare(directory: Path, args, held: list[int], legs: tuple[str, ...], extra, drafter: str) -> None:
    """At each `--concurrency`: every leg of `legs` (plain, then methods; a `-always` leg is its method with the rule
    told to speculate wherever it can; `extra(method)`: more speculative settings) on its own engine over the same
    requests, alternating over `--rounds`; prints tokens/s, ratios to plain with their spread, drafts accepted (and by
    position), tokens a speculating step, and the model's passes and the `drafter`'s per output token."""
    for c in args.concurrency:
        engines = {}
        for name in legs:
            method = name.removesuffix("-always")
            speculative = {"method": method, "num_tokens": args.num_tokens, **extra(method)} if name != "plain" else {}
            engines[name] = engine(directory, c, speculative)
            if name.endswith("-always"):  # (what speculating costs and gains here, whatever the rule would say)
                engines[name].spec_policy.decide = lambda decodes, drafts, other, **_: decodes > 0 and drafts > 0
            leg(engines[name], c, args, held, 99)  # warm-up (the rule's first measures too)
        speeds: dict[str, list[float]] = {name: [] for name in legs}
        passes: dict[str, float] = {}
        for r in range(args.rounds):
            for name in legs if r % 2 == 0 else legs[::-1]:
                speed, steps = leg(engines[name], c, args, held, r)
                speeds[name].append(speed)
                passes[name] = steps / (c * args.output_tokens)
        print(f"concurrency {c}: plain {statistics.median(speeds['plain']):.1f} tok/s")
        for name in legs[1:]:
            ratios = [a / b for a, b in zip(speeds[name], speeds["plain"])]
            stats = engines[name].stats()
            rate = stats.spec_accepted_tokens_total / max(stats.spec_draft_tokens_total, 1)
            by_position = "/".join(
                f"{a / max(v, 1):.0%}"
                for a, v in zip(stats.spec_accepted_tokens_by_position, stats.spec_draft_tokens_by_position)
            )
            length = engines[name].spec_policy.mean_acceptance_length
            per_token = stats.spec_draft_model_steps_total / max(stats.generation_tokens_total, 1)
            drafts = (
                f", {drafter} passes per output token {per_token:.2f}" if stats.spec_draft_model_steps_total else ""
            )
            print(
                f"  {name}: {statistics.median(speeds[name]):.1f} tok/s, {statistics.median(ratios):.2f}x (rounds "
                f"{min(ratios):.2f}-{max(ratios):.2f}); drafts {stats.spec_draft_tokens_total:,}, accepted "
                f"{rate:.0%} (by position {by_position}), {length:.2f} tokens a speculating step, verifying steps "
                f"{stats.spec_verify_steps_total:,}; model forward passes per output token "
                f"{passes['plain']:.2f} -> {passes[name]:.2f}{drafts}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--init", type=float, default=0.02, help="initializer_range of the model before training")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=3, help="engine.speculative.num_tokens")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--context", type=int, default=128, help="training sequences' length")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "deepseek"
        build(directory, args)
        print(
            f"== MTP speculation vs plain decoding and prompt lookup ({args.layers} layers, {args.hidden} wide, "
            f"{args.train_steps} training steps, num_tokens {args.num_tokens})"
        )
        train_ids, held = corpus()
        train(directory, train_ids, args)
        compare(directory, args, held, LEGS, lambda method: {}, "MTP layer")


if __name__ == "__main__":
    main()
