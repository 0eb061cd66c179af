"""`pylon cost`: what a run or a deployment held, moved and cost, beside the planner's prediction; a run's goodput."""

from __future__ import annotations

import argparse
import json
import os

from pylon import settings, storage
from pylon.errors import PylonError

RUN, DEPLOYMENT = "run", "deployment"


def resolve_target(target: str, kind: str | None = None) -> tuple[str, str]:
    """(kind, what): a run directory (a URI or path holding run.json, a run's name under $PYLON_HOME/runs, or a
    TrainJob spec file) or a deployment's name (or a Deployment spec file; a BatchJob's, whose engines keep the
    ledger a deployment's replicas do)."""
    from pylon.jobs.run_dir import RUN_FILE, run_uri_of

    if target.endswith((".yaml", ".yml")) and os.path.isfile(target):
        from pylon.specs import BatchJobSpec, DeploymentSpec, TrainJobSpec, load_spec, load_specs

        kinds = {d.spec.kind for d in load_specs(target)}
        if kinds == {"BatchJob"}:
            return DEPLOYMENT, load_spec(target, BatchJobSpec).name
        try:
            return RUN, run_uri_of(load_spec(target, TrainJobSpec))
        except PylonError:
            return DEPLOYMENT, load_spec(target, DeploymentSpec).name
    if kind != DEPLOYMENT:
        candidates = [target] if ("://" in target or os.sep in target) else []
        candidates = list(dict.fromkeys([*candidates, str(settings.pylon_home() / "runs" / target)]))
        for uri in candidates:
            try:
                if storage.exists(storage.join(uri, RUN_FILE)):
                    return RUN, uri
            except PylonError:
                continue
        if kind == RUN or candidates[0] == target:  # a path or URI is never a deployment's name
            raise PylonError(
                f"no run at {' or '.join(candidates)} (no run.json): give the run directory, e.g. "
                "~/.pylon/runs/<name> or s3://bucket/runs/<name>"
            )
    return DEPLOYMENT, target


def ledger_of(target: str, *, kind: str | None = None, prices: str | None = None) -> dict:
    kind, what = resolve_target(target, kind)
    if kind == RUN:
        from pylon.jobs.ledger import report

        return report(what, prices=prices)
    from pylon.serving.api.ledger import report

    return report(what, prices=prices)


def _hours(h: float) -> str:
    return f"{h:.4f} h" if h < 10 else f"{h:,.1f} h"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _beside(measured: float, predicted: float | None, fmt) -> str:
    if predicted is None:
        return fmt(measured)
    ratio = f" ({measured / predicted:.2f}x)" if predicted else ""
    return f"{fmt(measured)}   predicted {fmt(predicted)}{ratio}"


def render(ledger: dict) -> str:
    usd = lambda x: f"${x:,.4f}"  # noqa: E731
    if ledger["kind"] == DEPLOYMENT:
        per_m = ledger["cost_per_million_output_tokens_usd"]
        p = ledger["predicted"]
        lines = [
            f"deployment {ledger['deployment']}: {ledger['replicas']} replica(s), {ledger['replicas_live']} live",
            f"  replica-hours    {_hours(ledger['replica_hours'])}",
            f"  CPU-hours        {_hours(ledger['cpu_hours'])}",
            f"  GPU-hours        {_hours(ledger['accelerator_hours'])}",
            f"  requests         {ledger['requests']:,}",
            f"  tokens in / out  {ledger['tokens_in']:,} / {ledger['tokens_out']:,}",
            f"  output tokens/s  {ledger['output_tokens_per_s']:.1f} while busy"
            + (f"   predicted ceiling {p['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in p else ""),
            f"  idle             {ledger['idle_fraction']:.0%} of replica time",
            f"  cost             {usd(ledger['cost_usd'])}"
            f"   predicted {usd(p['cost_per_replica_hour_usd'])} per replica-hour",
            "  per 1M output    "
            + (usd(per_m) if per_m is not None else "no output tokens yet")
            + (
                f"   predicted {usd(p['cost_per_million_output_tokens_usd'])} at the plan's load"
                if "cost_per_million_output_tokens_usd" in p
                else ""
            ),
            f"  prices           {ledger['prices']['source']}",
        ]
        pre = ledger.get("prefill")
        if pre:  # its prefill replicas (`prefill`): in the hours and cost above; their prompts apart
            lines.insert(
                4,
                f"  prefill          {pre['replicas']} replica(s), {_hours(pre['replica_hours'])} replica-hours, "
                f"{pre['prompts']:,} prompts of {pre['prompt_tokens']:,} tokens, idle {pre['idle_fraction']:.0%}",
            )
        models = ledger.get("by_model") or []
        if len(models) > 1:  # LoRA adapters beside the base model: each one's part of the tokens and the cost
            lines.append("  by model (cost split by the share of tokens in + out)")
            width = max(len(m["model"]) for m in models)
            lines.extend(
                f"    {m['model']:<{width}}  {m['requests']:,} requests, {m['tokens_in']:,} / {m['tokens_out']:,} "
                f"tokens, {m['token_share']:.0%}, {usd(m['cost_usd'])}"
                for m in models
            )
        return "\n".join(lines)
    p = ledger["predicted"]
    g = ledger["goodput"]
    lines = [
        f"run {ledger['run']} ({ledger['run_uri']}): {ledger['sessions']} submission(s), {ledger['attempts']} "
        f"attempt(s), {ledger['failures']} failure(s)",
        f"  wall time        {_beside(g['wall_s'], p.get('wall_s'), lambda s: f'{s:,.0f} s')}",
        f"  CPU-hours        {_beside(ledger['cpu_hours'], p.get('cpu_hours'), _hours)}",
        f"  GPU-hours        {_beside(ledger['accelerator_hours'], p.get('accelerator_hours'), _hours)}",
        f"  tokens trained   {_beside(ledger['tokens'], p.get('tokens'), lambda t: f'{int(t):,}')}",
    ]
    for kind, moved in ledger["bytes"].items():
        lines.append(f"  {kind + ' bytes':<16} {_bytes(moved['read'])} read, {_bytes(moved['written'])} written")
    lines += [
        f"  egress (est.)    {_bytes(ledger['egress_bytes'])} read out of object storage",
        f"  cost             {_beside(ledger['cost_usd'], p.get('cost_usd'), usd)}",
        f"  prices           {ledger['prices']['source']}",
        f"  predicted by     {p.get('source', p.get('error', '-'))}",
        f"goodput {g['fraction']:.1%} of {g['wall_s']:,.0f} s:",
    ]
    width = 40
    for part, seconds in g.items():
        if part in ("fraction", "wall_s"):
            continue
        share = seconds / g["wall_s"] if g["wall_s"] else 0.0
        bar = "#" * round(share * width)
        lines.append(f"  {part[:-2]:<18} {seconds:>10.1f} s {share:>6.1%} {bar}")
    c = ledger["checkpoints"]
    lines.append(
        f"checkpoints: {c['saves']} save(s), {c['failures']} failed; blocked "
        + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in c["blocked_s"].items())
    )
    return "\n".join(lines)


def _cmd_cost(args: argparse.Namespace) -> int:
    kind = RUN if args.run else DEPLOYMENT if args.deployment else None
    ledger = ledger_of(args.target, kind=kind, prices=args.prices)
    print(json.dumps(ledger, indent=2, sort_keys=True, default=str) if args.json else render(ledger))
    return 0


def add_cost_parser(sub, fmt) -> None:
    c = sub.add_parser(
        "cost",
        formatter_class=fmt,
        help="what a run or deployment held, moved and cost; a run's goodput",
        description="The ledger of a training run or a deployment, measured as it ran: accelerator- and CPU-hours "
        "held, bytes read and written by kind, estimated egress, cost at the catalog's prices (or --prices), "
        "the planner's prediction beside each figure, and for a run the goodput: its wall time split into "
        "productive steps and each kind of loss. For a deployment: replica-hours, tokens in and out, cost per "
        "million output tokens and the idle fraction. The --json keys are documented in docs/operating.md.",
        epilog="examples:\n  pylon cost stdlib-gpt                      # a run under $PYLON_HOME/runs\n"
        "  pylon cost s3://bucket/runs/stdlib-gpt --json\n"
        "  pylon cost chat --deployment                # a deployment's replicas\n"
        "  pylon cost train.yaml --prices prices.yaml  # {H100-SXM: 2.10, vCPU: 0.04, egress_GB: 0.02}",
    )
    c.add_argument(
        "target",
        metavar="RUN_OR_DEPLOYMENT",
        help="a run's directory or name, a deployment's name, or the spec file of either",
    )
    which = c.add_mutually_exclusive_group()
    which.add_argument("--run", action="store_true", help="TARGET is a run (default: a run if one has that name)")
    which.add_argument("--deployment", action="store_true", help="TARGET is a deployment's name")
    c.add_argument("--json", action="store_true", help="the whole ledger as JSON (keys: docs/operating.md)")
    c.add_argument(
        "--prices",
        metavar="FILE",
        help="a YAML file of prices: GPU name -> USD per GPU-hour, vCPU, egress_GB (default: the catalog's)",
    )
    c.set_defaults(func=_cmd_cost)
