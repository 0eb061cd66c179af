"""`pylon validate`, `pylon plan` and `pylon infra render`: what can be known from spec files alone.

Check them, estimate memory, time and cost before anything launches, and render a Cluster spec into
`ray up` YAML or KubeRay manifests. None of these needs a running cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from pylon.errors import SpecError


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
        print(
            json.dumps(
                {
                    "valid": [
                        {"file": d.source, "document": d.index, "kind": d.spec.kind, "name": d.spec.name} for d in valid
                    ],
                    "errors": problems,
                },
                indent=2,
            )
        )
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
    return [
        f"{d.source}: document {d.index}: {problem}"
        for d in docs
        if isinstance(d.spec, ClusterSpec)
        for problem in infra.check(d.spec, jobs=jobs, deployments=deployments)
    ]


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
    how = (
        f"ray up {args.out}/cluster.yaml" if args.target == "ray-up" else f"kubectl apply -f {args.out}/raycluster.yaml"
    )
    print(
        f"rendered {cluster.summary()} for {args.target}: {len(written)} file(s), every manifest valid; "
        f"bring it up with: {how} (see infra/README.md)",
        file=sys.stderr,
    )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from pylon.plan import plan_file, render
    from pylon.plan.catalog import load_catalog

    plans, skipped = plan_file(
        args.file,
        catalog=load_catalog(args.prices),
        gpu=args.gpu,
        gpus=args.gpus,
        mfu=args.mfu,
        seq_len=args.seq_len,
        utilization=args.utilization,
        deadline_days=args.deadline,
        budget_usd=args.budget,
    )
    for note in skipped:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"plans": [p.to_dict() for p in plans]}, indent=2))
    else:
        print("\n\n".join(render(p) for p in plans))
    return 0


def add_validate_parser(sub, fmt) -> None:
    p = sub.add_parser(
        "validate",
        formatter_class=fmt,
        help="check spec files; exit 1 with every error",
        description="Validate Dataset, TrainJob, Deployment and Cluster specs (YAML; several "
        "documents per file allowed). Prints one line per valid document, or every "
        "error with its file, line, document and field path.",
        epilog="examples:\n  pylon validate train.yaml serve.yaml\n  pylon validate --json specs/*.yaml",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML spec files")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=_cmd_validate)


def add_plan_parser(sub, fmt) -> None:
    pl = sub.add_parser(
        "plan",
        formatter_class=fmt,
        help="memory, time and cost of a job before it launches; the cheapest that fits and meets a deadline",
        description="For each TrainJob and Deployment in FILE, before anything launches: memory per GPU by term "
        "(parameters, gradients, optimizer states -- DeepSpeed's own accounting -- activations, "
        "buffers), host RAM and NVMe for offload; for every accelerator of the catalog whether it "
        "fits (and what binds), time and cost; the time/cost Pareto front of the configurations that fit "
        "(ZeRO stage, offload, gradient checkpointing, micro-batch, GPU count: 1, 2, 4, then whole nodes "
        "doubling to 16,384); and the recommendation: the cheapest that finishes within --deadline and "
        "--budget, else the fastest and what it would take (a longer deadline, more money, or tensor, "
        "pipeline or context parallelism where data parallelism cannot get there). Deployments: weights, "
        "KV cache per token, concurrent sequences that fit, tokens/s ceiling and cost per million tokens. "
        "Time is model FLOPs over peak x an assumed MFU (as papers report it; the implied HFU is printed), "
        "with ZeRO's collectives where they outlast compute; prices come from the catalog, --prices or "
        "$PYLON_GPU_PRICES. Needs no cluster.",
        epilog=textwrap.dedent("""\
            examples:
              pylon plan train.yaml                          # every accelerator of the catalog
              pylon plan train.yaml --gpu A100-80GB --gpus 8 # one accelerator, a fixed GPU count
              pylon plan train.yaml --mfu 0.3 --prices my-prices.yaml   # prices: {H100-SXM: 2.10, ...}
              pylon plan train.yaml --deadline 14 --budget 500000    # the cheapest done in 14 days for <= $500k
              pylon plan serve.yaml --utilization 0.3        # a Deployment: cost per million tokens
              pylon plan train.yaml --json | jq '.plans[0].recommendation'
            """),
    )
    pl.add_argument("file", metavar="FILE", help="YAML file with TrainJob and/or Deployment documents")
    pl.add_argument("--json", action="store_true", help='machine-readable plans on stdout: {"plans": [...]}')
    pl.add_argument(
        "--gpu",
        metavar="NAME",
        help="only this accelerator (a catalog name or alias: H100, A100-80GB, 4090, MI300X, ...)",
    )
    pl.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="plan for exactly N GPUs (default: the spec's workers as requested; any count when searching)",
    )
    pl.add_argument(
        "--mfu",
        type=float,
        default=0.4,
        metavar="X",
        help="assumed model FLOPs utilisation, 0-1, as papers report it: model FLOPs only, recomputation's cost "
        "inside it (default 0.4)",
    )
    pl.add_argument(
        "--deadline",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="a TrainJob must finish within DAYS of wall time; the recommendation is the cheapest that does "
        "(default 30)",
    )
    pl.add_argument(
        "--budget",
        type=float,
        metavar="USD",
        help="a TrainJob may cost at most USD; the recommendation is the cheapest within the deadline and this "
        "(default: no limit)",
    )
    pl.add_argument(
        "--prices",
        metavar="FILE",
        help="YAML of US dollars per GPU-hour by GPU name (default: $PYLON_GPU_PRICES, else the catalog's)",
    )
    pl.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="sequence length, when the spec does not give data.seq_len and its dataset is not prepared yet",
    )
    pl.add_argument(
        "--utilization",
        type=float,
        default=0.5,
        metavar="X",
        help="share of a serving replica's time at its throughput ceiling, for cost per million tokens (default 0.5)",
    )
    pl.set_defaults(func=_cmd_plan)


def add_infra_parser(sub, fmt) -> None:
    inf = sub.add_parser(
        "infra",
        formatter_class=fmt,
        help="render a Cluster spec into ray up YAML or KubeRay manifests",
        description="Files that run a Cluster spec somewhere other than this machine, derived "
        "from the specs and checked against Ray's and KubeRay's schemas offline.",
        epilog="examples:\n  pylon infra render cluster-aws.yaml --target ray-up --out infra/aws\n"
        "  pylon infra render cluster-k8s.yaml --target kuberay --out infra/kuberay",
    )
    isub = inf.add_subparsers(dest="infra_command", metavar="ACTION", required=True)
    ir = isub.add_parser(
        "render",
        formatter_class=fmt,
        help="write launcher YAML or KubeRay manifests, Dockerfile, Prometheus, Grafana",
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
            """),
    )
    ir.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="YAML files holding one Cluster (and, for kuberay, any TrainJobs and Deployments)",
    )
    ir.add_argument(
        "--target",
        required=True,
        choices=("ray-up", "kuberay"),
        help="ray-up: Ray's cluster launcher (aws, gcp); kuberay: Kubernetes with KubeRay",
    )
    ir.add_argument("--out", required=True, metavar="DIR", help="folder to write the files to (created if needed)")
    ir.set_defaults(func=_cmd_infra_render)
