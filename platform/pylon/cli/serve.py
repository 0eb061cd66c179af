"""`pylon serve` and `pylon demo`: put a model behind OpenAI-compatible HTTP on Ray Serve, or run the
whole path (cluster, data, training, export, serving) end to end on the embedded local cluster.
"""

from __future__ import annotations

import argparse
import sys

from pylon.cli.common import ADDRESS_HELP
from pylon.errors import PylonError


def _cmd_serve(args: argparse.Namespace) -> int:
    from pylon.specs import DeploymentSpec, load_spec

    if args.delete:
        from pylon.sdk.serve import delete

        delete(args.delete, address=args.address)
        print(f"deleted deployment '{args.delete}'")
        return 0
    if not args.file:
        raise PylonError("pylon serve: give a Deployment spec FILE to deploy, or --delete NAME")
    spec = load_spec(args.file, DeploymentSpec)  # every spec error before anything is deployed
    print(spec.summary(), file=sys.stderr)
    print(f"deploying '{spec.name}' (loading the model on its replica; this can take a while)...", file=sys.stderr)
    from pylon.sdk.serve import deploy

    url = deploy(spec, address=args.address, timeout_s=args.timeout, force=args.force)
    print(url)
    auth = f' -H "Authorization: Bearer ${spec.http.api_keys_env}"' if spec.http.api_keys_env else ""
    print(
        f"try it:  curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{spec.name}", "prompt": "def ", "max_tokens": 32}}\'\n'
        f"OpenAI clients: base_url={url}/v1; stop it with: pylon serve --delete {spec.name}",
        file=sys.stderr,
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pylon.cli.demo import run_demo

    return run_demo(down=args.down, steps=args.steps)


def add_serve_parser(sub, fmt) -> None:
    sv = sub.add_parser(
        "serve",
        formatter_class=fmt,
        help="deploy a model on Ray Serve behind OpenAI-compatible HTTP",
        description="Deploy a Deployment spec on Ray Serve: continuous batching over a paged KV cache, "
        "POST /v1/completions, /v1/chat/completions, /v1/responses and Anthropic's /v1/messages (streaming), "
        "POST /v1/embeddings, "
        "/v1/rerank, /v1/score, /classify and /pooling, GET /v1/models and "
        "/v1/models/{model}, "
        "POST /tokenize and /detokenize, GET /health, /ready and /openapi.json (docs/http.md). Prints the base "
        "URL once the first replica is ready. API keys come from the environment variable named by "
        "http.api_keys_env.",
        epilog="examples:\n  PYLON_API_KEYS=sk-mine pylon serve deploy.yaml\n  pylon serve --delete stdlib-gpt",
    )
    sv.add_argument("file", metavar="FILE", nargs="?", help="YAML file with one Deployment document")
    sv.add_argument("--delete", metavar="NAME", help="remove the deployment NAME instead")
    sv.add_argument("--address", help=ADDRESS_HELP)
    sv.add_argument("--timeout", type=float, default=600, help="seconds to wait for the first replica (default 600)")
    sv.add_argument(
        "--force",
        action="store_true",
        help="deploy even if the planner says a replica cannot hold its model on the cluster (its GPU type, or its "
        "largest node's RAM)",
    )
    sv.set_defaults(func=_cmd_serve)


def add_demo_parser(sub, fmt) -> None:
    d = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="run the end-to-end path on the embedded local cluster",
        description="Start the local cluster if needed, validate the bundled example specs, prepare "
        "the Python standard library's sources as a Ray job, stream them back as "
        "training reads them, train the example GPT on 2 Ray Train workers with "
        "DeepSpeed ZeRO-2 + CPU optimizer offload, export it, deploy it on Ray Serve "
        "behind OpenAI-compatible HTTP, query it, and print what happened.",
        epilog="examples:\n  pylon demo\n  pylon demo --down\n  pylon demo --steps 50",
    )
    d.add_argument(
        "--down",
        action="store_true",
        help="stop the cluster afterwards if the demo started it (default: leave it and the endpoint up)",
    )
    d.add_argument("--steps", type=int, default=160, help="training steps (0 skips training; default 160)")
    d.set_defaults(func=_cmd_demo)
