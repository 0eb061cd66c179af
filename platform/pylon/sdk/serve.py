"""Deploy and delete Serve applications from a client: `deploy(spec)` runs a `Deployment` on the cluster and waits
until its replicas answer /ready; `delete(name)` removes it."""

from __future__ import annotations

import os
import re
import time

from pylon import home, storage
from pylon.errors import PylonError
from pylon.specs import DeploymentSpec


def deploy(spec: DeploymentSpec, *, address: home.ClusterAddress | str | None = None, timeout_s: float = 600) -> str:
    """Run `spec` on the cluster (`address`: an address to resolve, the local cluster by default, or a resolved
    `home.ClusterAddress`, as a `Client` passes) and return its base URL."""
    from ray import serve  # Ray Serve and the replica's code load only when deploying

    from pylon.serving.api.builder import build_app

    spec = _checked_model(spec)
    home.init_ray(address)
    state = home.read_state()
    port = getattr(state, "serve_port", 0) or 8000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(spec), name=spec.name, route_prefix=spec.http.route_prefix, blocking=False)
    except Exception as e:  # Serve's controller raises it wrapped in a RayTaskError
        used = re.search(r'Prefix (\S+) is being used by application "([^"]+)"', str(e))
        if used:
            raise PylonError(
                f"http.route_prefix: {used.group(1)} is already served by application "
                f"'{used.group(2)}'; give '{spec.name}' its own prefix (e.g. /{spec.name}) or "
                f"delete that one first (pylon serve --delete {used.group(2)})"
            ) from None
        raise
    url = f"http://127.0.0.1:{port}{spec.http.route_prefix.rstrip('/')}"
    _wait_ready(url, timeout_s, spec.name)
    return url


def _checked_model(spec: DeploymentSpec) -> DeploymentSpec:
    """Fail before deploying when `model` is not a model directory (a replica would only crash-loop), and
    make a local path absolute: replicas do not run in the caller's directory."""
    uri = spec.model
    if "://" not in uri:
        uri = os.path.abspath(os.path.expanduser(uri))
    try:
        has_config = storage.exists(storage.join(uri, "config.json"))
    except Exception as e:  # storage or credential errors while looking
        raise PylonError(f"model {storage.describe(uri)}: cannot be read ({type(e).__name__}: {e})") from None
    if not has_config:
        raise PylonError(
            f"model {storage.describe(uri)}: not a Hugging Face model directory (no config.json); "
            "point it at a `pylon export` output or a saved transformers model"
        )
    return spec.model_copy(update={"model": uri})


def _app_failure(name: str) -> str | None:
    """Serve's message when application `name` failed to deploy (e.g. the replica's constructor raised)."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None or str(app.status) not in ("DEPLOY_FAILED", "ApplicationStatus.DEPLOY_FAILED"):
        return None
    details = [d.message for d in app.deployments.values() if d.message]
    return (details[-1] if details else app.message) or "no message"


def _wait_ready(url: str, timeout_s: float, name: str | None = None) -> None:
    import sys
    import urllib.error
    import urllib.request

    from tqdm import tqdm

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # On a terminal, a line that says what is being waited for and for how long (loading a model takes a while).
    with tqdm(
        desc=f"loading {name or url} (replica starting, model loading)",
        bar_format="{desc}: {elapsed}",
        file=sys.stderr,
        disable=None,
    ) as bar:
        while time.monotonic() < deadline:
            failure = _app_failure(name) if name else None
            if failure:
                raise PylonError(f"deployment '{name}' failed to start: {failure.strip()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except OSError as e:
                last = str(e)
            time.sleep(0.5)
            bar.refresh()
    raise PylonError(f"{url}/ready did not answer 200 within {timeout_s:.0f} s (last: {last})")


def delete(name: str, *, address: home.ClusterAddress | str | None = None) -> None:
    """Remove application `name` from the cluster (`address` as for `deploy`)."""
    from ray import serve

    home.init_ray(address)
    serve.delete(name)
