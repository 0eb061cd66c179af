"""The `pylon` command line. Every command has help text with examples; errors print without tracebacks.

Exit codes: 0 success, 1 a problem with input or environment (the message says what to do),
2 wrong command-line usage.

Each command group lives in its own module, its parser beside its handlers: `cluster`, `data`,
`jobs` (train, jobs, export), `cost`, `serve` (serve, demo), `evaluate` (eval) and `specs` (validate, plan,
infra); `common` holds what they share. This module only assembles them and runs a command.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from pylon.cli import batch, cluster, cost, data, evaluate, jobs, serve, specs
from pylon.cli.common import FORMATTER
from pylon.errors import PylonError, SpecError
from pylon.version import __version__


def build_parser() -> argparse.ArgumentParser:
    fmt = FORMATTER
    parser = argparse.ArgumentParser(
        prog="pylon",
        formatter_class=fmt,
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
              pylon cost stdlib-gpt            # what a run held, moved and cost; its goodput
              pylon demo                       # the whole path, end to end
            """),
    )
    parser.add_argument("--version", action="version", version=f"pylon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The order here is the order `pylon --help` lists the commands in.
    specs.add_validate_parser(sub, fmt)
    cluster.add_cluster_parser(sub, fmt)
    data.add_data_parser(sub, fmt)
    jobs.add_train_parser(sub, fmt)
    specs.add_plan_parser(sub, fmt)
    jobs.add_jobs_parser(sub, fmt)
    specs.add_infra_parser(sub, fmt)
    jobs.add_export_parser(sub, fmt)
    cost.add_cost_parser(sub, fmt)
    serve.add_serve_parser(sub, fmt)
    batch.add_batch_parser(sub, fmt)
    evaluate.add_eval_parser(sub, fmt)
    serve.add_demo_parser(sub, fmt)
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
