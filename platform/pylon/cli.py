"""The `pylon` command line. Every command has help text with examples; errors print without tracebacks.

Exit codes: 0 success, 1 a problem with input or environment (the message says what to do),
2 wrong command-line usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

from pylon import __version__
from pylon.errors import PylonError, SpecError

EXAMPLES_DIR = Path(__file__).parent / "examples"


def _cmd_validate(args: argparse.Namespace) -> int:
    from pylon.specs import load_specs

    problems: list[str] = []
    valid = []
    for path in args.files:
        try:
            docs = load_specs(path)
        except SpecError as e:
            problems.extend(e.problems)
            continue
        valid.extend(docs)
        problems.extend(_cluster_render_problems(docs))
    if args.json:
        print(json.dumps({"valid": [{"file": d.source, "document": d.index, "kind": d.spec.kind,
                                     "name": d.spec.name} for d in valid],
                          "errors": problems}, indent=2))
    else:
        for doc in valid:
            print(f"ok  {doc.summary()}")
        for problem in problems:
            print(f"error  {problem}", file=sys.stderr)
        if problems:
            print(f"{len(problems)} error(s) in {len(args.files)} file(s)", file=sys.stderr)
    return 1 if problems else 0


def _cluster_render_problems(docs) -> list[str]:
    """A Cluster spec is also checked the way it will be used: rendered for its target (ray-up for aws/gcp,
    kuberay for kubernetes, with the file's TrainJobs and Deployments) and validated against the schemas."""
    from pylon import infra
    from pylon.specs import ClusterSpec, DeploymentSpec, TrainJobSpec

    jobs = [d.spec for d in docs if isinstance(d.spec, TrainJobSpec)]
    deployments = [d.spec for d in docs if isinstance(d.spec, DeploymentSpec)]
    return [f"{d.source}: document {d.index}: {problem}"
            for d in docs if isinstance(d.spec, ClusterSpec)
            for problem in infra.check(d.spec, jobs=jobs, deployments=deployments)]


def _cmd_infra_render(args: argparse.Namespace) -> int:
    from pylon import infra

    cluster, files = infra.render_file(args.files, args.target)
    problems = infra.validate_files(files)
    if problems:
        for problem in problems:
            print(f"error  {problem}", file=sys.stderr)
        print(f"{len(problems)} schema error(s); nothing written", file=sys.stderr)
        return 1
    written = infra.write(files, args.out)
    for path in written:
        print(path)
    how = (f"ray up {args.out}/cluster.yaml" if args.target == "ray-up"
           else f"kubectl apply -f {args.out}/raycluster.yaml")
    print(f"rendered {cluster.summary()} for {args.target}: {len(written)} file(s), every manifest valid; "
          f"bring it up with: {how} (see infra/README.md)", file=sys.stderr)
    return 0


def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from pylon import cluster

    spec = None
    if args.autoscale is not None:
        from pylon.specs import ClusterSpec, load_spec

        spec = load_spec(args.autoscale, ClusterSpec)
    running = cluster.read_state()
    if running is None or not running.is_running():
        print("starting a local Ray head (token authentication on)"
              + (f", autoscaling {spec.summary()}" if spec else "") + "...", file=sys.stderr)
    info, started = cluster.up(num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                               object_store_memory=_gib_to_bytes(args.object_store_gib),
                               port=args.port, dashboard_port=args.dashboard_port, autoscale=spec)
    print(("started" if started else "already running") + " local Ray cluster"
          + (" with autoscaling" if info.autoscaler_config else ""))
    print(f"  dashboard / Jobs API: {info.dashboard_url}")
    print(f"  GCS address:          {info.gcs_address}")
    print(f"  auth token file:      {info.token_path}")
    print("  submit jobs with:     "
          f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={info.token_path} "
          f"ray job submit --address {info.dashboard_url} -- python ...")
    if info.autoscaler_config:
        print(f"  autoscaler config:    {info.autoscaler_config}")
        print(f"  autoscaler log:       {info.temp_dir}/session_latest/logs/monitor.log")
        print("  watch nodes with:     pylon cluster status")
    print("  stop it with:         pylon cluster down")
    return 0


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    import pylon

    status = pylon.connect(args.address).status()
    if args.json:
        print(json.dumps({"dashboard_url": status.dashboard_url, "gcs_address": status.gcs_address,
                          "nodes": [asdict(n) for n in status.nodes],
                          "resources": status.total_resources(),
                          "jobs": [asdict(j) for j in status.jobs]}, indent=2))
    else:
        print(status)
    return 0


def _cmd_cluster_down(args: argparse.Namespace) -> int:
    from pylon import cluster

    stopped = cluster.down()
    if stopped is None:
        print("no cluster started by `pylon cluster up` is recorded; nothing to stop")
    else:
        print(f"stopped the local Ray cluster at {stopped.dashboard_url}")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from pylon.data.prepare import prepare
    from pylon.data.shards import manifest_uri

    _show_data_logs()
    started = time.perf_counter()
    manifest = prepare(args.sources, args.out, fmt=args.format, seq_len=args.seq_len, tokenizer=args.tokenizer,
                       shard_size_mb=args.shard_size_mb, include=args.include, exclude=args.exclude, text_field=args.text_field,
                       overwrite=args.overwrite, use_ray=False if args.local else None,
                       progress=not args.json)
    seconds = max(time.perf_counter() - started, 1e-9)
    t = manifest.totals
    if args.json:
        print(json.dumps({"manifest": manifest_uri(args.out), "shards": len(manifest.shards), "rows": t.rows,
                          "tokens": t.tokens, "bytes": t.bytes, "documents": t.documents,
                          "skipped_files": t.skipped_files, "seconds": round(seconds, 3),
                          "rows_per_s": round(t.rows / seconds, 1), "tokens_per_s": round(t.tokens / seconds, 1)},
                         indent=2))
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
    tok = train_bpe(args.sources, args.out, vocab_size=args.vocab_size, include=args.include, exclude=args.exclude,
                    text_field=args.text_field, min_frequency=args.min_frequency, max_mb=args.max_mb,
                    overwrite=args.overwrite)
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
        print(json.dumps({"manifest": manifest.model_dump(mode="json"), "verified": args.verify,
                          "problems": problems}, indent=2))
        return 1 if problems else 0
    print(manifest.summary())
    tok = manifest.tokenizer
    print(f"  tokenizer: {tok.kind}{'' if tok.name == tok.kind else ' ' + tok.name}, eos {tok.eos_id}, "
          f"pad {tok.pad_id}, dtype {manifest.dtype}"
          + (f", sha256 {tok.sha256[:16]}" if tok.sha256 else ""))
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


def _cmd_train(args: argparse.Namespace) -> int:
    import pylon

    client = pylon.connect(args.address)
    run = client.train(args.file, force=args.force)  # every spec error, and a job that cannot fit, refused first
    if args.json:
        print(json.dumps({"job_id": run.job_id, "run_uri": run.run_uri}), flush=True)
    else:
        print(run.job_id, flush=True)
    if not args.follow:
        print(f"follow it with: pylon jobs logs {run.job_id} --follow, or the dashboard at {client.dashboard_url}",
              file=sys.stderr)
        return 0
    # With --json, stdout stays one JSON document: the logs go to stderr.
    from pylon.specs import TrainJobSpec, load_spec

    steps = load_spec(args.file, TrainJobSpec).steps
    return _follow(client, run.job_id, out=sys.stderr if args.json else None, total_steps=steps)


def _cmd_plan(args: argparse.Namespace) -> int:
    from pylon.catalog import load_catalog
    from pylon.plan import plan_file, render

    plans, skipped = plan_file(args.file, catalog=load_catalog(args.prices), gpu=args.gpu, gpus=args.gpus,
                               mfu=args.mfu, seq_len=args.seq_len, utilization=args.utilization)
    for note in skipped:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"plans": [p.to_dict() for p in plans]}, indent=2))
    else:
        print("\n\n".join(render(p) for p in plans))
    return 0


def _follow(client, job_id: str, *, out=None, total_steps: int | None = None) -> int:
    """Stream a job's logs until it ends (a step progress bar on a terminal); exit 0 only if it succeeded."""
    from pylon.sdk import follow_logs

    status = follow_logs(client, job_id, out=out, progress=True, total_steps=total_steps)
    print(f"job {job_id} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def _cmd_jobs_list(args: argparse.Namespace) -> int:
    import pylon

    jobs = pylon.connect(args.address).jobs()
    if args.json:
        print(json.dumps([asdict(j) | {"kind": j.kind} for j in jobs], indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    rows = [(j.job_id, j.status, j.kind or "-", j.metadata.get("pylon_name", "-"),
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.start_time)) if j.start_time else "-",
             j.entrypoint if len(j.entrypoint) <= 60 else j.entrypoint[:57] + "...") for j in jobs]
    header = ("JOB ID", "STATUS", "KIND", "NAME", "STARTED", "ENTRYPOINT")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _cmd_jobs_logs(args: argparse.Namespace) -> int:
    import pylon

    client = pylon.connect(args.address)
    if args.follow:
        return _follow(client, args.job_id)
    sys.stdout.write(client.job_logs(args.job_id))
    return 0


def _cmd_jobs_stop(args: argparse.Namespace) -> int:
    import pylon
    from pylon.client import TERMINAL_JOB_STATES
    from pylon.sdk import Job

    client = pylon.connect(args.address)
    status = client.job_status(args.job_id)
    if status in TERMINAL_JOB_STATES:
        print(f"job {args.job_id} had already ended: {status}")
        return 0
    status = Job(client, args.job_id).stop(timeout=args.timeout)  # ClusterError (exit 1) if it will not end
    print(f"job {args.job_id} {status}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pylon.jobs.export import export_run

    out = export_run(args.run_uri, args.out, step=args.step, lora=args.lora)
    how = ("peft.PeftModel.from_pretrained(base_model, DIR)" if args.lora == "adapter"
           else "transformers.AutoModelForCausalLM.from_pretrained(DIR)")
    print(f"exported {args.run_uri} to {out} (load it with {how})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pylon.specs import DeploymentSpec, load_spec

    if args.delete:
        from pylon.serving.app import delete

        delete(args.delete, address=args.address)
        print(f"deleted deployment '{args.delete}'")
        return 0
    if not args.file:
        raise PylonError("pylon serve: give a Deployment spec FILE to deploy, or --delete NAME")
    spec = load_spec(args.file, DeploymentSpec)  # every spec error before anything is deployed
    print(spec.summary(), file=sys.stderr)
    print(f"deploying '{spec.name}' (loading the model on its replica; this can take a while)...", file=sys.stderr)
    from pylon.serving.app import deploy

    url = deploy(spec, address=args.address, timeout_s=args.timeout)
    print(url)
    auth = f' -H "Authorization: Bearer ${spec.http.api_keys_env}"' if spec.http.api_keys_env else ""
    print(f"try it:  curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{spec.name}\", \"prompt\": \"def \", \"max_tokens\": 32}}'\n"
          f"OpenAI clients: base_url={url}/v1; stop it with: pylon serve --delete {spec.name}", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pylon.demo import run_demo

    return run_demo(down=args.down, steps=args.steps)


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="pylon", formatter_class=fmt,
        description="Pylon: data, DeepSpeed training and continuous-batching serving on one Ray cluster.",
        epilog=textwrap.dedent("""\
            examples:
              pylon cluster up                 # start the embedded local Ray cluster
              pylon validate train.yaml        # check specs before launching anything
              pylon data prepare txt/ --out ds # tokenize text into training shards
              pylon cluster status             # nodes, resources, running jobs
              pylon plan train.yaml            # memory, time and cost before launching; what fits cheapest
              pylon train train.yaml --follow  # submit a training run, stream its logs
              pylon jobs list                  # every job: id, status, kind, name
              pylon demo                       # the whole path, end to end
            """),
    )
    parser.add_argument("--version", action="version", version=f"pylon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("validate", formatter_class=fmt, help="check spec files; exit 1 with every error",
                       description="Validate Dataset, TrainJob, Deployment and Cluster specs (YAML; several "
                                   "documents per file allowed). Prints one line per valid document, or every "
                                   "error with its file, line, document and field path.",
                       epilog="examples:\n  pylon validate train.yaml serve.yaml\n  pylon validate --json specs/*.yaml")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML spec files")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=_cmd_validate)

    c = sub.add_parser("cluster", formatter_class=fmt, help="start, inspect or stop the local Ray cluster",
                       description="The embedded default: a real Ray head on this machine, dashboard and Jobs "
                                   "API on 127.0.0.1, Ray's token authentication on. State lives in "
                                   "$PYLON_HOME (default ~/.pylon).",
                       epilog="examples:\n  pylon cluster up --num-cpus 4\n  pylon cluster status --json\n"
                              "  pylon cluster down")
    csub = c.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = csub.add_parser("up", formatter_class=fmt, help="start a local Ray head and print its addresses",
                         description="Start a local Ray head (`ray start --head`) with token auth. Does nothing "
                                     "but print the addresses if one started by Pylon is already running.",
                         epilog="examples:\n  pylon cluster up\n  pylon cluster up --num-cpus 4 --object-store-gib 2\n"
                                "  pylon cluster up --autoscale                  # worker nodes come and go with the work\n"
                                "  pylon cluster up --autoscale my-cluster.yaml  # worker groups from a local Cluster spec\n"
                                "  PYLON_HOME=/tmp/other pylon cluster up --dashboard-port 8266   # a second cluster")
    up.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    up.add_argument("--num-gpus", type=int, help="GPUs Ray may schedule (default: detected)")
    up.add_argument("--object-store-gib", type=float, help="object store size in GiB (default: Ray's choice)")
    up.add_argument("--port", type=int, help="GCS port (default 6379, or a free one if taken)")
    up.add_argument("--dashboard-port", type=int, help="dashboard/Jobs API port (default 8265, or a free one)")
    up.add_argument("--autoscale", nargs="?", metavar="CLUSTER_YAML", const=str(EXAMPLES_DIR / "cluster-local.yaml"),
                    help="run Ray's autoscaler on the head: the worker groups of a local Cluster spec start as "
                         "logical nodes (local processes) when work does not fit, and stop after the spec's "
                         "idle_timeout_minutes (default spec: pylon/examples/cluster-local.yaml, head 1 CPU, "
                         "0-2 nodes of 1 CPU)")
    up.set_defaults(func=_cmd_cluster_up)
    st = csub.add_parser("status", formatter_class=fmt, help="show nodes, resources and running jobs",
                         description="Show the cluster's nodes, resources and running jobs.",
                         epilog="examples:\n  pylon cluster status\n  pylon cluster status --json\n"
                                "  pylon cluster status --address http://head:8265")
    st.add_argument("--address", help="dashboard URL or GCS address (default: RAY_ADDRESS, else the local one)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_cmd_cluster_status)
    dn = csub.add_parser("down", help="stop the cluster `pylon cluster up` started (nothing else)",
                         formatter_class=fmt,
                         description="Stop exactly the Ray processes `pylon cluster up` started; other Ray "
                                     "clusters on this machine are left alone.",
                         epilog="examples:\n  pylon cluster down\n  PYLON_HOME=/tmp/other pylon cluster down")
    dn.set_defaults(func=_cmd_cluster_down)

    data = sub.add_parser(
        "data", formatter_class=fmt, help="prepare tokenized shards from text, inspect and verify them",
        description="Prepared data is a directory (local or object storage) of parquet or WebDataset shards of "
                    "fixed-length token sequences, plus manifest.json (written last: the commit).",
        epilog="examples:\n  pylon data prepare /usr/lib/python3.11 --include '*.py' --out s3://bucket/stdlib/\n"
               "  pylon data inspect s3://bucket/stdlib/ --verify")
    dsub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    pr = dsub.add_parser(
        "prepare", formatter_class=fmt, help="tokenize text files, directories or JSONL into shards + manifest",
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
            """))
    pr.add_argument("sources", nargs="+", metavar="SRC", help="text file, directory or .jsonl file (path or URI)")
    pr.add_argument("--out", required=True, metavar="URI", help="where shards and manifest.json go (path, s3://...)")
    pr.add_argument("--format", choices=("parquet", "webdataset"), default="parquet",
                    help="shard format (default parquet; webdataset writes .tar shards)")
    pr.add_argument("--seq-len", type=int, default=256, metavar="N", help="tokens per row (default 256)")
    pr.add_argument("--tokenizer", default="byte", metavar="byte|PATH",
                    help="'byte' (built in, default), a `tokenizers` JSON file, or a Hugging Face tokenizer "
                         "directory; paths may be URIs")
    pr.add_argument("--shard-size-mb", type=float, default=64.0, metavar="X",
                    help="target shard size in MiB of tokens (default 64)")
    pr.add_argument("--include", metavar="GLOB", help="only files in directories whose name matches, e.g. '*.py'")
    pr.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                    help="skip files with a path component matching, e.g. 'site-packages' (repeatable)")
    pr.add_argument("--text-field", default="text", metavar="NAME", help="the JSONL field holding the text "
                                                                         "(default text)")
    pr.add_argument("--overwrite", action="store_true", help="replace a prepared dataset at --out")
    pr.add_argument("--local", action="store_true", help="run in this process even if a Ray cluster is up")
    pr.add_argument("--json", action="store_true", help="machine-readable summary on stdout (no progress bar)")
    pr.set_defaults(func=_cmd_data_prepare)
    tk = dsub.add_parser(
        "tokenizer", formatter_class=fmt, help="train a byte-level BPE tokenizer on a corpus, for --tokenizer",
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
            """))
    tk.add_argument("sources", nargs="+", metavar="SRC", help="text file, directory or .jsonl file (path or URI)")
    tk.add_argument("--out", required=True, metavar="FILE", help="the tokenizer file to write (path or URI)")
    tk.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                    help="tokens in the vocabulary, the 256 bytes and <|endoftext|> included (default 4096)")
    tk.add_argument("--min-frequency", type=int, default=2, metavar="N",
                    help="merge only pairs seen at least N times (default 2)")
    tk.add_argument("--max-mb", type=float, default=256.0, metavar="X",
                    help="learn from at most X MiB of text, in file order (default 256)")
    tk.add_argument("--include", metavar="GLOB", help="only files in directories whose name matches, e.g. '*.py'")
    tk.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                    help="skip files with a path component matching, e.g. 'test' (repeatable)")
    tk.add_argument("--text-field", default="text", metavar="NAME", help="the JSONL field holding the text "
                                                                         "(default text)")
    tk.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    tk.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    tk.set_defaults(func=_cmd_data_tokenizer)
    ins = dsub.add_parser(
        "inspect", formatter_class=fmt, help="print a dataset's manifest and shards; --verify checks every shard",
        description="Print the manifest summary and one line per shard. With --verify, read every shard and "
                    "check its size, sha256 and contents against the manifest; exit 1 listing every problem.",
        epilog="examples:\n  pylon data inspect ./corpus\n  pylon data inspect s3://bucket/stdlib/ --verify --json")
    ins.add_argument("uri", metavar="URI", help="the dataset directory (path or URI)")
    ins.add_argument("--verify", action="store_true", help="read and check every shard")
    ins.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    ins.set_defaults(func=_cmd_data_inspect)

    t = sub.add_parser("train", formatter_class=fmt, help="submit a TrainJob through the Ray Jobs API",
                       description="Validate a TrainJob spec, then submit `python -m pylon.jobs.train --config FILE` "
                                   "as a Ray job and print its id. Submitting a run name again resumes it. A job "
                                   "the planner (`pylon plan`) says cannot fit on the workers it asks for is "
                                   "refused, with the reason and what would fit, unless --force.",
                       epilog="examples:\n  pylon train train.yaml --follow\n  pylon train train.yaml --json\n"
                              "  pylon train train.yaml --address http://head:8265\n"
                              "  pylon train big.yaml --force      # submit even if the planner says it will not fit")
    t.add_argument("file", metavar="FILE", help="YAML file with one TrainJob document")
    t.add_argument("--follow", action="store_true", help="stream the job's logs until it ends (exit 1 if it fails)")
    t.add_argument("--json", action="store_true",
                   help='print {"job_id": ..., "run_uri": ...} on stdout (with --follow, the logs go to stderr)')
    t.add_argument("--address", help="dashboard URL (default: RAY_ADDRESS, else the local cluster)")
    t.add_argument("--force", action="store_true",
                   help="submit even if the planner says the job cannot fit on the resources it asks for")
    t.set_defaults(func=_cmd_train)

    pl = sub.add_parser(
        "plan", formatter_class=fmt, help="memory, time and cost of a job before it launches; what fits cheapest",
        description="For each TrainJob and Deployment in FILE, before anything launches: memory per GPU by term "
                    "(parameters, gradients, optimizer states -- DeepSpeed's own accounting -- activations, "
                    "buffers), host RAM and NVMe for offload; for every accelerator of the catalog whether it "
                    "fits (and what binds), time and cost; and the cheapest configuration that fits (ZeRO stage, "
                    "offload, gradient checkpointing, micro-batch, GPU count). Deployments: weights, KV cache per "
                    "token, concurrent sequences that fit, tokens/s ceiling and cost per million tokens. Time is "
                    "FLOPs over peak x an assumed MFU; prices come from the catalog, --prices or $PYLON_GPU_PRICES. "
                    "Needs no cluster.",
        epilog=textwrap.dedent("""\
            examples:
              pylon plan train.yaml                          # every accelerator of the catalog
              pylon plan train.yaml --gpu A100-80GB --gpus 8 # one accelerator, a fixed GPU count
              pylon plan train.yaml --mfu 0.3 --prices my-prices.yaml   # prices: {H100-SXM: 2.10, ...}
              pylon plan serve.yaml --utilization 0.3        # a Deployment: cost per million tokens
              pylon plan train.yaml --json | jq '.plans[0].recommendation'
            """))
    pl.add_argument("file", metavar="FILE", help="YAML file with TrainJob and/or Deployment documents")
    pl.add_argument("--json", action="store_true", help='machine-readable plans on stdout: {"plans": [...]}')
    pl.add_argument("--gpu", metavar="NAME", help="only this accelerator (a catalog name or alias: H100, A100-80GB, "
                                                 "4090, MI300X, ...)")
    pl.add_argument("--gpus", type=int, metavar="N", help="plan for exactly N GPUs (default: the spec's workers as "
                                                         "requested; any count when searching)")
    pl.add_argument("--mfu", type=float, default=0.4, metavar="X",
                    help="assumed model FLOPs utilisation, 0-1 (default 0.4)")
    pl.add_argument("--prices", metavar="FILE", help="YAML of US dollars per GPU-hour by GPU name "
                                                    "(default: $PYLON_GPU_PRICES, else the catalog's)")
    pl.add_argument("--seq-len", type=int, metavar="N", help="sequence length, when the spec does not give "
                                                            "data.seq_len and its dataset is not prepared yet")
    pl.add_argument("--utilization", type=float, default=0.5, metavar="X",
                    help="share of a serving replica's time at its throughput ceiling, for cost per million "
                         "tokens (default 0.5)")
    pl.set_defaults(func=_cmd_plan)

    jb = sub.add_parser("jobs", formatter_class=fmt, help="list Ray jobs, read or follow their logs, stop them",
                        description="The cluster's Ray jobs (Pylon's and any others), through the Ray Jobs API. "
                                    "Pylon's jobs have readable ids: train-<name>-<hex>, data-<name>-<hex>.",
                        epilog="examples:\n  pylon jobs list\n  pylon jobs logs train-stdlib-gpt-1a2b3c --follow\n"
                               "  pylon jobs stop train-stdlib-gpt-1a2b3c")
    jsub = jb.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    jl = jsub.add_parser("list", formatter_class=fmt, help="every job, oldest first: id, status, kind, name, start",
                         description="List every job the cluster knows, running and ended, oldest first, with "
                                     "its status, what Pylon submitted it as (TrainJob, Dataset; '-' for other "
                                     "jobs), its name, start time and entrypoint.",
                         epilog="examples:\n  pylon jobs list\n  pylon jobs list --json | jq '.[] | select(.status == \"RUNNING\")'")
    jl.add_argument("--json", action="store_true", help="machine-readable list on stdout (with metadata and times)")
    jl.add_argument("--address", help="dashboard URL (default: RAY_ADDRESS, else the local cluster)")
    jl.set_defaults(func=_cmd_jobs_list)
    jg = jsub.add_parser("logs", formatter_class=fmt, help="print a job's logs; --follow streams them until it ends",
                         description="Print a job's logs so far. With --follow, keep printing them as they grow "
                                     "until the job ends, then exit 0 if it SUCCEEDED, else 1.",
                         epilog="examples:\n  pylon jobs logs train-stdlib-gpt-1a2b3c\n"
                                "  pylon jobs logs train-stdlib-gpt-1a2b3c --follow")
    jg.add_argument("job_id", metavar="ID", help="the job's submission id (as `pylon jobs list` shows it)")
    jg.add_argument("--follow", action="store_true", help="stream until the job ends (exit 1 unless it succeeded)")
    jg.add_argument("--address", help="dashboard URL (default: RAY_ADDRESS, else the local cluster)")
    jg.set_defaults(func=_cmd_jobs_logs)
    js = jsub.add_parser("stop", formatter_class=fmt, help="stop a running job and wait until it has ended",
                         description="Ask Ray to stop a job (SIGTERM to its entrypoint, SIGKILL after a grace "
                                     "period) and wait until it is STOPPED. A job that already ended is left as "
                                     "it is (exit 0). A stopped training run resumes from its last checkpoint "
                                     "when submitted again.",
                         epilog="examples:\n  pylon jobs stop train-stdlib-gpt-1a2b3c")
    js.add_argument("job_id", metavar="ID", help="the job's submission id (as `pylon jobs list` shows it)")
    js.add_argument("--timeout", type=float, default=60, help="seconds to wait for it to end (default 60)")
    js.add_argument("--address", help="dashboard URL (default: RAY_ADDRESS, else the local cluster)")
    js.set_defaults(func=_cmd_jobs_stop)

    inf = sub.add_parser("infra", formatter_class=fmt,
                         help="render a Cluster spec into ray up YAML or KubeRay manifests",
                         description="Files that run a Cluster spec somewhere other than this machine, derived "
                                     "from the specs and checked against Ray's and KubeRay's schemas offline.",
                         epilog="examples:\n  pylon infra render cluster-aws.yaml --target ray-up --out infra/aws\n"
                                "  pylon infra render cluster-k8s.yaml --target kuberay --out infra/kuberay")
    isub = inf.add_subparsers(dest="infra_command", metavar="ACTION", required=True)
    ir = isub.add_parser(
        "render", formatter_class=fmt, help="write launcher YAML or KubeRay manifests, Dockerfile, Prometheus, Grafana",
        description="Render the one Cluster spec in FILE(s) for a target and write the files to --out: for ray-up "
                    "(provider aws or gcp) cluster.yaml for `ray up`, a CPU head and worker groups that scale "
                    "from their min_workers (0 for GPUs) with spot/preemptible nodes and the idle timeout; for "
                    "kuberay (provider kubernetes) raycluster.yaml with the in-tree autoscaler v2, plus a RayJob "
                    "per TrainJob and a RayService per Deployment found in the same files. Both also get the "
                    "image's Dockerfile, prometheus.yml and grafana-dashboard.json. Every manifest is validated "
                    "against ray-schema.json or the KubeRay CRD schemas before anything is written. Ray's auth "
                    "token and API keys are never written: they come from ~/.ray/auth_token or Kubernetes "
                    "Secrets (infra/README.md).",
        epilog=textwrap.dedent("""\
            examples:
              pylon infra render cluster-aws.yaml --target ray-up --out infra/aws && ray up infra/aws/cluster.yaml
              pylon infra render cluster-gcp.yaml --target ray-up --out infra/gcp
              pylon infra render cluster-k8s.yaml --target kuberay --out infra/kuberay
              pylon infra render cluster.yaml train.yaml serve.yaml --target kuberay --out k8s/
            """))
    ir.add_argument("files", nargs="+", metavar="FILE",
                    help="YAML files holding one Cluster (and, for kuberay, any TrainJobs and Deployments)")
    ir.add_argument("--target", required=True, choices=("ray-up", "kuberay"),
                    help="ray-up: Ray's cluster launcher (aws, gcp); kuberay: Kubernetes with KubeRay")
    ir.add_argument("--out", required=True, metavar="DIR", help="folder to write the files to (created if needed)")
    ir.set_defaults(func=_cmd_infra_render)

    e = sub.add_parser("export", formatter_class=fmt, help="consolidate a run's ZeRO shards into one HF model",
                       description="Export the latest committed checkpoint of a run (ZeRO stage 0-3 shards) as "
                                   "one Hugging Face directory (safetensors, config, tokenizer identity).",
                       epilog="examples:\n  pylon export ~/.pylon/runs/stdlib-gpt --out ./stdlib-gpt-hf\n"
                              "  pylon export s3://bucket/runs/stdlib-gpt --out s3://bucket/models/stdlib-gpt --step 200")
    e.add_argument("run_uri", metavar="RUN_URI", help="the run directory (<checkpoint.storage>/<name>)")
    e.add_argument("--out", required=True, help="where to write the model (local path or URI)")
    e.add_argument("--step", type=int, help="a committed step (default: the latest)")
    e.add_argument("--lora", choices=("merged", "adapter"),
                   help="for a LoRA run: write the adapters folded into the base weights (a plain model) or the "
                        "adapters alone in peft's format (default: the spec's lora.merge_on_export)")
    e.set_defaults(func=_cmd_export)

    sv = sub.add_parser("serve", formatter_class=fmt, help="deploy a model on Ray Serve behind OpenAI-compatible HTTP",
                        description="Deploy a Deployment spec on Ray Serve: continuous batching over a paged KV cache, "
                                    "POST /v1/completions and /v1/chat/completions (streaming), GET /v1/models, "
                                    "/health, /ready. Prints the base URL once the first replica is ready. API keys "
                                    "come from the environment variable named by http.api_keys_env.",
                        epilog="examples:\n  PYLON_API_KEYS=sk-mine pylon serve deploy.yaml\n"
                               "  pylon serve --delete stdlib-gpt")
    sv.add_argument("file", metavar="FILE", nargs="?", help="YAML file with one Deployment document")
    sv.add_argument("--delete", metavar="NAME", help="remove the deployment NAME instead")
    sv.add_argument("--address", help="dashboard URL (default: RAY_ADDRESS, else the local cluster)")
    sv.add_argument("--timeout", type=float, default=600, help="seconds to wait for the first replica (default 600)")
    sv.set_defaults(func=_cmd_serve)

    d = sub.add_parser("demo", formatter_class=fmt, help="run the end-to-end path on the embedded local cluster",
                       description="Start the local cluster if needed, validate the bundled example specs, prepare "
                                   "the Python standard library's sources as a Ray job, stream them back as "
                                   "training reads them, train the example GPT on 2 Ray Train workers with "
                                   "DeepSpeed ZeRO-2 + CPU optimizer offload, export it, deploy it on Ray Serve "
                                   "behind OpenAI-compatible HTTP, query it, and print what happened.",
                       epilog="examples:\n  pylon demo\n  pylon demo --down\n  pylon demo --steps 50")
    d.add_argument("--down", action="store_true",
                   help="stop the cluster afterwards if the demo started it (default: leave it and the endpoint up)")
    d.add_argument("--steps", type=int, default=160, help="training steps (0 skips training; default 160)")
    d.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pylon.ops import venv_tools_first

    venv_tools_first()  # whatever this command starts builds ops with the venv's ninja
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        for problem in e.problems:
            print(f"error  {problem}", file=sys.stderr)
        return 1
    except PylonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
