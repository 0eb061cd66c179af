"""What every target of `pylon infra render` shares: Ray's ports and paths on a node, the Serve settings of
every cluster Pylon starts or renders, and the YAML writer."""

from __future__ import annotations

import yaml

from pylon.specs import ClusterSpec, NodeShape
from pylon.version import __version__

# Ray Serve's HTTP ingress on every cluster Pylon starts or renders: HAProxy (C, event-driven) in front of
# replicas that answer HTTP themselves (Serve's "direct ingress"), instead of Serve's Python proxy actor
# relaying every request and every streamed chunk over Ray's RPC to the replica. Ray's recommended
# high-throughput mode since 2.56 ("Enable High Throughput on Ray Serve with KubeRay"); measured here on the
# serving benchmark (docs/benchmarks.md). HAProxy serves plain HTTP: terminate TLS in front of it. Set
# RAY_SERVE_ENABLE_HA_PROXY=0 in the environment of `pylon cluster up` for Serve's own proxy.
# HAProxy retries a request on another replica when its replica closed the connection before answering
# (`empty-response`: the replica's process died with the request still queued in its engine), as well as when it
# could not connect. Serve's default is `conn-failure` alone, and its HAProxy config turns the 502 of an
# empty response into a 500 ("Internal Server Error", plain text), which clients of a killed replica's queued
# requests got (tests/integration/test_serving_faults.py). A completion has no side effect to repeat. A stream
# already started cannot be retried: its client sees the connection close before `data: [DONE]`.
# HAProxy hands a request's body to a deployment's ingress request router (Pylon's prefix-aware router,
# pylon.serving.api.routing), which routes by the prompt; without it the router sees no prompt.
SERVE_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
}

# A replica's request handlers on the event loop of its HTTP server, on every cluster Pylon starts or renders.
# Serve's default runs them on a second loop in a thread of their own, and every ASGI message (the request, each
# streamed chunk) crosses between the two loops. Pylon's handlers never block that loop (the engine steps in a
# process of its own), so the hop buys nothing but CPU (docs/serving.md). Part of Serve's
# RAY_SERVE_THROUGHPUT_OPTIMIZED.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}

# Where the node image puts `pylon-haproxy` (pylon.infra.haproxy): Serve's HAProxy with its stats page and
# Prometheus exporter on loopback (Ray's template binds them to every interface, without credentials).
HAPROXY_WRAPPER_PATH = "/usr/local/bin/pylon-haproxy"

# Serve's settings on every node of a rendered cluster: HAProxy ingress (through `pylon-haproxy`), handlers on the
# HTTP server's loop.
RENDERED_SERVE_ENV = {**SERVE_INGRESS_ENV, "RAY_SERVE_HAPROXY_BINARY_PATH": HAPROXY_WRAPPER_PATH, **SERVE_ENV}

# Ray's ports on every node Pylon renders.
RAY_PORT = 6379
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
METRICS_PORT = 8080


# Where the token lives on every node / pod (the launcher copies the local ~/.ray/auth_token there).
NODE_HOME = "/home/ray"
TOKEN_PATH = f"{NODE_HOME}/.ray/auth_token"
SOURCE_DIR = "/opt/pylon/src"


# Ray's object store takes about 30% of a node's memory by default; the rest is what tasks may reserve.
TASK_MEMORY_SHARE = 0.7
DEFAULT_MEMORY_GB_PER_CPU = 4

# What a render produces: file name -> contents.
Files = dict[str, str]


def _memory_gb(shape: NodeShape) -> float:
    return shape.memory_gb or shape.cpus * DEFAULT_MEMORY_GB_PER_CPU or DEFAULT_MEMORY_GB_PER_CPU


def _header(cluster: ClusterSpec, use: str) -> str:
    return (
        f"# Rendered by `pylon infra render` from Cluster '{cluster.name}' (pylon {__version__}); edit the\n"
        f"# spec and re-render rather than this file. Use: {use}{'' if use.endswith('=') else ' '}<this file>\n"
    )


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper, data: str):
    # Multi-line strings (serveConfigV2, runtimeEnvYAML, a spec in a ConfigMap) as readable literal blocks.
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


def _dump(*docs: dict, header: str = "") -> str:
    return header + yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, explicit_start=len(docs) > 1
    )


_Dumper.add_representer(str, _str_presenter)
