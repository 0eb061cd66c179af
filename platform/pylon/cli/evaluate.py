"""`pylon eval`: the perplexity of an export directory or a live deployment on a prepared dataset's held-out split
(`pylon.sdk.evaluate`)."""

from __future__ import annotations

import argparse
import json
import sys

from pylon.sdk.evaluate import DEFAULT_API_KEY_ENV, DEFAULT_CONCURRENCY


def _cmd_eval(args: argparse.Namespace) -> int:
    from pylon.sdk.evaluate import evaluate

    result = evaluate(
        args.model_or_endpoint,
        data=args.data,
        validation_fraction=args.validation_fraction,
        max_sequences=args.max_sequences,
        model=args.model,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        attention_mask=args.attention_mask,
        progress=sys.stderr.isatty(),
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    lo, hi = result.ids
    where = (
        f"deployment {result.model} (model {result.served_model})"
        if result.source == "endpoint"
        else f"{result.model} (transformers, fp32, {result.device})"
    )
    if result.rewards is not None:  # a reward model, on preference pairs
        r = result.rewards
        print(f"loss        {result.loss:.4f} (mean Bradley-Terry loss, -log sigmoid(r(chosen) - r(rejected)))")
        print(f"accuracy    {r['reward_accuracy']:.4f} (pairs whose chosen completion has the larger reward)")
        print(
            f"rewards     chosen {r['reward_chosen']:.4f}, rejected {r['reward_rejected']:.4f}, margin "
            f"{r['reward_margin']:.4f}"
        )
        print(f"pairs       {result.pairs:,} scored over {result.sequences:,} sequences")
    else:
        print(f"loss        {result.loss:.4f} nats/token (mean next-token cross-entropy)")
        print(f"perplexity  {result.perplexity:.3f}")
        print(f"tokens      {result.tokens:,} scored over {result.sequences:,} sequences")
    print(f"data        {result.dataset}, held-out ids [{lo}, {hi}) (validation fraction {result.validation_fraction})")
    print(f"model       {where}, {result.seconds:.1f} s")
    if result.attention_mask == "document":
        print("attention   each packed document on its own (attention_mask: document)")
    if result.recorded is not None:
        r = result.recorded
        scored = (
            f"over {r['tokens']:,} pairs"
            if r.get("perplexity") is None
            else f"perplexity {r['perplexity']:.3f} over {r['tokens']:,} tokens"
        )
        print(f"trainer     loss {r['loss']:.4f}, {scored} at step {r['step']} (eval.json)")
    return 0


def add_eval_parser(sub, fmt) -> None:
    e = sub.add_parser(
        "eval",
        formatter_class=fmt,
        help="perplexity of a model or a deployment on a dataset's held-out split",
        description="The mean next-token cross-entropy (loss, nats/token) and perplexity of a model on the "
        "held-out split of a prepared dataset: the rows a training run with the same "
        "data.validation_fraction never trained on, scored with the trainer's own loss (padding excluded, "
        "every token weighing the same).\n\n"
        "MODEL_OR_ENDPOINT is an export directory (local or s3://; run with transformers in fp32 on the GPU "
        "if there is one) or a deployment's base URL (http(s)://HOST:PORT[/prefix]; each row is sent as a "
        "token-id prompt with echo, logprobs 0 and max_tokens 0, --concurrency at a time). For an export "
        "with eval.json, --data and --validation-fraction default to the data its run evaluated on, and its "
        "recorded figure is shown beside; otherwise both are required.\n\n"
        "A reward model (a classifier of one label, objective reward: an export, or a deployment, through its "
        "/classify) is scored on a preference dataset's held-out pairs instead: its mean Bradley-Terry loss, reward "
        "accuracy, margin and mean rewards, each completion read where its training run read it.",
        epilog="examples:\n"
        "  pylon eval ./stdlib-gpt-hf                   # the data and split named by its eval.json\n"
        "  pylon eval s3://bucket/models/stdlib-gpt --max-sequences 200\n"
        "  PYLON_API_KEYS=sk-mine pylon eval http://127.0.0.1:8000 --data s3://bucket/stdlib/ "
        "--validation-fraction 0.05\n"
        "  pylon eval ./stdlib-gpt-hf --data ./other-ds/ --validation-fraction 0.1 --json | jq .perplexity",
    )
    e.add_argument(
        "model_or_endpoint",
        metavar="MODEL_OR_ENDPOINT",
        help="an export directory (local path or s3:// URI) or a deployment's base URL (http:// or https://)",
    )
    e.add_argument("--data", metavar="URI", help="the prepared dataset (default: the dataset in the model's eval.json)")
    e.add_argument(
        "--validation-fraction",
        type=float,
        metavar="F",
        help="the held-out share of the dataset, as the training run's data.validation_fraction "
        "(default: the model's eval.json's)",
    )
    e.add_argument("--max-sequences", type=int, metavar="N", help="score only the held-out split's first N rows")
    e.add_argument(
        "--model",
        metavar="NAME",
        help="endpoint only: the served model's name (default: the one it serves; with LoRA adapters, its base model)",
    )
    e.add_argument(
        "--api-key-env",
        metavar="VAR",
        default=DEFAULT_API_KEY_ENV,
        help="endpoint only: environment variable holding the API key (the first of comma-separated keys; "
        f"default {DEFAULT_API_KEY_ENV}; unset: no key sent)",
    )
    e.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help=f"endpoint only: requests in flight at once (default {DEFAULT_CONCURRENCY})",
    )
    e.add_argument(
        "--batch-size", type=int, default=8, metavar="N", help="model only: rows per forward pass (default 8)"
    )
    e.add_argument(
        "--attention-mask",
        choices=("auto", "causal", "document"),
        help="how a row packed from several documents is attended, as the TrainJob field: causal (the whole row "
        "before a token), document (each document on its own; a deployment gets each as its own prompt), auto "
        "(document for a chat dataset); default: as the model's training run did (its eval.json), else auto",
    )
    e.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: loss, perplexity, tokens, sequences, source, model, served_model, device, "
        "dataset, split, validation_fraction, ids, seconds, recorded, attention_mask, metric, pairs, rewards "
        "(docs/eval.md)",
    )
    e.set_defaults(func=_cmd_eval)
