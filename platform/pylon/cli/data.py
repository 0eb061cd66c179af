"""`pylon data prepare|tokenizer|chat-template|inspect`: turn text into tokenized training shards, and check them.

Prepare packs text files, directories or JSONL into fixed-length token rows (parquet or WebDataset shards
plus manifest.json), tokenizer learns a byte-level BPE for it, chat-template copies a tokenizer with a chat template,
inspect prints and verifies a dataset.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from pylon.data.prepare import prepare
    from pylon.data.shards import manifest_uri

    _show_data_logs()
    started = time.perf_counter()
    manifest = prepare(
        args.sources,
        args.out,
        fmt=args.format,
        seq_len=args.seq_len,
        tokenizer=args.tokenizer,
        shard_size_mb=args.shard_size_mb,
        include=args.include,
        exclude=args.exclude,
        text_field=args.text_field,
        overwrite=args.overwrite,
        use_ray=False if args.local else None,
        progress=not args.json,
        chat=args.chat,
        packing=args.packing,
        prompt_completion=args.prompt_completion,
        preference=args.preference,
        prompts=args.prompts,
    )
    seconds = max(time.perf_counter() - started, 1e-9)
    t = manifest.totals
    if args.json:
        print(
            json.dumps(
                {
                    "manifest": manifest_uri(args.out),
                    "shards": len(manifest.shards),
                    "rows": t.rows,
                    "tokens": t.tokens,
                    "bytes": t.bytes,
                    "documents": t.documents,
                    "skipped_files": t.skipped_files,
                    "packing": manifest.packing,
                    "truncated_documents": t.truncated_documents,
                    "seconds": round(seconds, 3),
                    "rows_per_s": round(t.rows / seconds, 1),
                    "tokens_per_s": round(t.tokens / seconds, 1),
                },
                indent=2,
            )
        )
        return 0
    print(f"prepared {manifest.summary()}")
    print(f"  {seconds:.1f}s: {t.rows / seconds:,.0f} rows/s, {t.tokens / seconds:,.0f} tokens/s")
    if t.skipped_files:
        print(f"  skipped {t.skipped_files} file(s) that are not UTF-8 text (named in the warnings above)")
    print(f"  manifest: {manifest_uri(args.out)}")
    return 0


def _cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from pylon.data.bpe import train_bpe

    _show_data_logs()
    tok = train_bpe(
        args.sources,
        args.out,
        vocab_size=args.vocab_size,
        include=args.include,
        exclude=args.exclude,
        text_field=args.text_field,
        min_frequency=args.min_frequency,
        max_mb=args.max_mb,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps({"tokenizer": args.out, **tok.info.model_dump(mode="json")}, indent=2))
        return 0
    print(f"tokenizer: {args.out} ({tok.vocab_size:,} tokens, end of document {tok.eos_id})")
    print(f"  next: pylon data prepare SRC... --tokenizer {args.out} --out DIR")
    return 0


def _show_data_logs() -> None:
    """pylon.data's progress lines (where the work runs, skipped files, rates) on stderr, as plain messages."""
    import logging

    logger = logging.getLogger("pylon.data")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    from pylon.data.inspect import inspect

    manifest, problems = inspect(args.uri, verify=args.verify, progress=not args.json)
    if args.json:
        print(
            json.dumps(
                {"manifest": manifest.model_dump(mode="json"), "verified": args.verify, "problems": problems}, indent=2
            )
        )
        return 1 if problems else 0
    print(manifest.summary())
    tok = manifest.tokenizer
    print(
        f"  tokenizer: {tok.kind}{'' if tok.name == tok.kind else ' ' + tok.name}, eos {tok.eos_id}, "
        f"pad {tok.pad_id}, dtype {manifest.dtype}" + (f", sha256 {tok.sha256[:16]}" if tok.sha256 else "")
    )
    print(f"  sources: {', '.join(manifest.sources) or '-'}")
    if manifest.totals.skipped_files:
        print(f"  skipped when prepared: {manifest.totals.skipped_files} file(s) that were not UTF-8 text")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created_at))
    print(f"  run {manifest.run_id[:8]}, prepared {created}")
    width = max([len("file")] + [len(s.file) for s in manifest.shards])
    print(f"{'file':<{width}}  {'rows':>10}  {'tokens':>14}  {'MiB':>9}  sha256")
    for s in manifest.shards:
        print(f"{s.file:<{width}}  {s.rows:>10,}  {s.tokens:>14,}  {s.bytes / 2**20:>9.2f}  {s.sha256[:16]}")
    if args.verify:
        for problem in problems:
            print(f"error  {problem}", file=sys.stderr)
        if problems:
            print(f"{len(problems)} of {len(manifest.shards)} shard(s) failed verification", file=sys.stderr)
        else:
            print(f"verified {len(manifest.shards)} shard(s): sizes, sha256 and contents match the manifest")
    return 1 if problems else 0


def add_data_parser(sub, fmt) -> None:
    data = sub.add_parser(
        "data",
        formatter_class=fmt,
        help="prepare tokenized shards from text, inspect and verify them",
        description="Prepared data is a directory (local or object storage) of parquet or WebDataset shards of "
        "fixed-length token sequences, plus manifest.json (written last: the commit).",
        epilog="examples:\n  pylon data prepare /usr/lib/python3.11 --include '*.py' --out s3://bucket/stdlib/\n"
        "  pylon data inspect s3://bucket/stdlib/ --verify",
    )
    dsub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    _add_prepare_parser(dsub, fmt)
    _add_tokenizer_parser(dsub, fmt)
    _add_chat_template_parser(dsub, fmt)
    _add_inspect_parser(dsub, fmt)


def _add_prepare_parser(dsub, fmt) -> None:
    pr = dsub.add_parser(
        "prepare",
        formatter_class=fmt,
        help="tokenize text files, directories or JSONL into shards + manifest",
        description="Read text files, directories of them (recursively, sorted, hidden files skipped) or JSONL "
        "(one document per line), tokenize each document, append an end-of-document token, and "
        "pack everything into rows of exactly --seq-len tokens, written as shards of about "
        "--shard-size-mb plus manifest.json. Runs as Ray tasks when a cluster is up "
        "(`pylon cluster up`), else in this process; the shards are identical either way. Files "
        "that are not UTF-8 text are skipped, counted and named. --out must be empty; --overwrite "
        "replaces a dataset there whole (a reader never sees a mix).",
        epilog=textwrap.dedent("""\
            examples:
              pylon data prepare notes.txt books/ --out ./corpus --seq-len 512
              pylon data prepare /usr/lib/python3.11 --include '*.py' --out s3://bucket/stdlib/ --format webdataset
              pylon data prepare chats.jsonl --text-field body --tokenizer ./tokenizer.json --out ./chats
              pylon data prepare books/ --out ./corpus --overwrite --local
              pylon data prepare sft.jsonl --chat --tokenizer ./Qwen3-0.6B --out ./sft --seq-len 2048
            """),
    )
    pr.add_argument("sources", nargs="+", metavar="SRC", help="text file, directory or .jsonl file (path or URI)")
    pr.add_argument("--out", required=True, metavar="URI", help="where shards and manifest.json go (path, s3://...)")
    pr.add_argument(
        "--format",
        choices=("parquet", "webdataset"),
        default="parquet",
        help="shard format (default parquet; webdataset writes .tar shards)",
    )
    pr.add_argument("--seq-len", type=int, default=256, metavar="N", help="tokens per row (default 256)")
    pr.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH",
        help="'byte' (built in, default), a `tokenizers` JSON file, or a Hugging Face tokenizer "
        "directory; paths may be URIs",
    )
    pr.add_argument(
        "--shard-size-mb", type=float, default=64.0, metavar="X", help="target shard size in MiB of tokens (default 64)"
    )
    pr.add_argument("--include", metavar="GLOB", help="only files in directories whose name matches, e.g. '*.py'")
    pr.add_argument(
        "--exclude",
        metavar="GLOB",
        action="append",
        default=[],
        help="skip files with a path component matching, e.g. 'site-packages' (repeatable)",
    )
    pr.add_argument(
        "--text-field",
        default=None,
        metavar="NAME",
        help="the JSONL field holding the text (default text; with --chat, messages)",
    )
    pr.add_argument(
        "--chat",
        action="store_true",
        help="supervised fine-tuning: each JSONL record's messages (role, content) rendered by the --tokenizer's "
        "chat template (a Hugging Face tokenizer directory), the loss on the assistant's replies only",
    )
    pr.add_argument(
        "--prompt-completion",
        action="store_true",
        help="each JSONL record's prompt and completion (TRL's prompt-completion format): strings, the prompt "
        "tokenized as a completions request's is, then the completion and eos; or lists of messages (TRL's "
        "conversational one), rendered by the chat template; the loss on the completion only",
    )
    pr.add_argument(
        "--preference",
        action="store_true",
        help="each JSONL record's prompt, chosen and rejected (TRL's preference format: strings, or lists of "
        "messages rendered by the chat template), for a TrainJob with objective dpo, simpo or orpo: the prompt "
        "with each completion, the pair kept together in one row, the loss on the completions",
    )
    pr.add_argument(
        "--prompts",
        action="store_true",
        help="each JSONL record's prompt (a string, or messages rendered by the chat template with its generation "
        "prompt) and optional answer string (TRL's prompt-only format), for a TrainJob with objective grpo: the "
        "prompts it samples from, the answers its reward functions compare with; a record's other fields (an id, "
        "test cases) are kept beside it and passed to the reward functions by name",
    )
    pr.add_argument(
        "--packing",
        choices=("auto", "wrapped", "bfd"),
        default="auto",
        help="how documents fill the rows: wrapped, one after another, cut wherever a row ends (no padding); bfd, "
        "each whole in one row (best-fit decreasing, as TRL packs; rows padded, documents longer than --seq-len cut "
        "to it); auto (default): bfd with --chat or --prompt-completion, else wrapped",
    )
    pr.add_argument("--overwrite", action="store_true", help="replace a prepared dataset at --out")
    pr.add_argument("--local", action="store_true", help="run in this process even if a Ray cluster is up")
    pr.add_argument("--json", action="store_true", help="machine-readable summary on stdout (no progress bar)")
    pr.set_defaults(func=_cmd_data_prepare)


def _add_tokenizer_parser(dsub, fmt) -> None:
    tk = dsub.add_parser(
        "tokenizer",
        formatter_class=fmt,
        help="train a byte-level BPE tokenizer on a corpus, for --tokenizer",
        description="Learn a byte-level BPE tokenizer of --vocab-size tokens from the same files `pylon data "
        "prepare` reads (directories, --include/--exclude globs, JSONL text fields; files that are "
        "not UTF-8 are skipped), with <|endoftext|> as its end-of-document token, and write it as "
        "one `tokenizers` JSON file. Give that file to `pylon data prepare --tokenizer`; `pylon "
        "export` copies it into the model as Hugging Face tokenizer files. A model trained on "
        "such tokens sees about 3x more text per token than on bytes.",
        epilog=textwrap.dedent("""\
            examples:
              pylon data tokenizer /usr/lib/python3.11 --include '*.py' --vocab-size 4096 --out ./tokenizer.json
              pylon data prepare /usr/lib/python3.11 --include '*.py' --tokenizer ./tokenizer.json --out ./corpus
              pylon data tokenizer chats.jsonl --text-field body --out s3://bucket/tok/tokenizer.json
            """),
    )
    tk.add_argument("sources", nargs="+", metavar="SRC", help="text file, directory or .jsonl file (path or URI)")
    tk.add_argument("--out", required=True, metavar="FILE", help="the tokenizer file to write (path or URI)")
    tk.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        metavar="N",
        help="tokens in the vocabulary, the 256 bytes and <|endoftext|> included (default 4096)",
    )
    tk.add_argument(
        "--min-frequency", type=int, default=2, metavar="N", help="merge only pairs seen at least N times (default 2)"
    )
    tk.add_argument(
        "--max-mb",
        type=float,
        default=256.0,
        metavar="X",
        help="learn from at most X MiB of text, in file order (default 256)",
    )
    tk.add_argument("--include", metavar="GLOB", help="only files in directories whose name matches, e.g. '*.py'")
    tk.add_argument(
        "--exclude",
        metavar="GLOB",
        action="append",
        default=[],
        help="skip files with a path component matching, e.g. 'test' (repeatable)",
    )
    tk.add_argument(
        "--text-field", default="text", metavar="NAME", help="the JSONL field holding the text (default text)"
    )
    tk.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    tk.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    tk.set_defaults(func=_cmd_data_tokenizer)


def _cmd_data_chat_template(args: argparse.Namespace) -> int:
    from pylon.data.tokenizer import with_chat_template

    tok = with_chat_template(args.tokenizer, args.template, args.out, overwrite=args.overwrite)
    sample = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there."}]
    ((ids, replies),) = tok.encode_chat(sample, "sample")[-1:]
    ends_with_eos = bool(replies.any()) and tok.eos_id in ids[replies].tolist()
    if args.json:
        summary = {"tokenizer": args.out, "reply_ends_with_eos": ends_with_eos, **tok.info.model_dump(mode="json")}
        print(json.dumps(summary, indent=2))
        return 0
    print(f"tokenizer: {args.out} ({tok.vocab_size:,} tokens) with chat template {args.template}")
    print("  a conversation renders as:")
    for line in tok.decode(ids.tolist()).splitlines():
        print(f"    {line}")
    if not ends_with_eos:
        print(
            f"  warning: the assistant's turn does not contain the eos ({tok.decode([tok.eos_id])}); a model "
            "fine-tuned on it will not end its replies where serving stops (end the turn with {{ eos_token }})"
        )
    print(f"  next: pylon data prepare chats.jsonl --chat --tokenizer {args.out} --out DIR")
    return 0


def _add_chat_template_parser(dsub, fmt) -> None:
    from pylon.data.tokenizer import CHAT_TEMPLATES

    ct = dsub.add_parser(
        "chat-template",
        formatter_class=fmt,
        help="copy a tokenizer with a chat template, to fine-tune a base model on conversations",
        description="Write a copy of a Hugging Face tokenizer directory whose chat template is --template: a "
        "built-in (zephyr: <|user|> and <|assistant|> as plain text, each turn ended by the tokenizer's own eos, so "
        "no token is added and served replies stop at the eos) or a Jinja file. A base model's tokenizer has none, "
        "and `pylon data prepare --chat` needs one; the copy is the tokenizer the dataset, the run and `pylon "
        "export` then carry, so the served model renders chats as it was trained on them (TRL's "
        "chat_template_path). The template is checked on a conversation before anything is written.",
        epilog=textwrap.dedent("""\
            examples:
              pylon data chat-template ./Llama-3.2-1B --template zephyr --out ./tokenizer-chat
              pylon data prepare chats.jsonl --chat --tokenizer ./tokenizer-chat --out ./sft
              pylon data chat-template s3://models/base --template ./chatml.jinja --out s3://models/base-chat
            """),
    )
    ct.add_argument("tokenizer", metavar="TOKENIZER", help="a Hugging Face tokenizer directory (path or URI)")
    ct.add_argument(
        "--template",
        required=True,
        metavar="NAME|FILE",
        help=f"a built-in ({', '.join(CHAT_TEMPLATES)}) or a Jinja chat template file (path or URI)",
    )
    ct.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write (path or URI)")
    ct.add_argument("--overwrite", action="store_true", help="replace an existing directory at --out")
    ct.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    ct.set_defaults(func=_cmd_data_chat_template)


def _add_inspect_parser(dsub, fmt) -> None:
    ins = dsub.add_parser(
        "inspect",
        formatter_class=fmt,
        help="print a dataset's manifest and shards; --verify checks every shard",
        description="Print the manifest summary and one line per shard. With --verify, read every shard and "
        "check its size, sha256 and contents against the manifest; exit 1 listing every problem.",
        epilog="examples:\n  pylon data inspect ./corpus\n  pylon data inspect s3://bucket/stdlib/ --verify --json",
    )
    ins.add_argument("uri", metavar="URI", help="the dataset directory (path or URI)")
    ins.add_argument("--verify", action="store_true", help="read and check every shard")
    ins.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    ins.set_defaults(func=_cmd_data_inspect)
