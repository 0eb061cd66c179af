"""Deploy and delete Serve applications from a client, through Serve's REST API on the dashboard (with the cluster's
token): `deploy(spec)` runs a `Deployment` on the cluster and waits until its replicas answer /ready; `delete(name)`
removes it. Neither joins the cluster as a Ray driver, so both work from any machine that reaches the dashboard.

Serve's REST API is declarative: `PUT /api/serve/applications/` names every application the cluster should run.
A deploy reads the applications already there (`GET`), keeps their configs as they are (Serve leaves an unchanged
application alone), and adds or replaces its own; a delete puts them back without it. Each application runs
`pylon.serving.api.builder:app_builder` with the spec as its argument, and its API keys' salted scrypt hashes as the
deployment's `user_config`, so the keys themselves stay on the client, and deploying the same spec with other keys
reconfigures the running replicas in place (no restart).
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import requests

from pylon import home, storage
from pylon.errors import ClusterError, PylonError
from pylon.specs import DeploymentSpec

SERVE_API = "/api/serve/applications/"
APP_BUILDER = "pylon.serving.api.builder:app_builder"
DEFAULT_PORT = 8000


def _where(address: home.ClusterAddress | str | None) -> home.ClusterAddress:
    if isinstance(address, home.ClusterAddress):
        return address
    where = home.resolve(address)
    home.ping(where)
    return where


# A PUT waits while the dashboard starts Serve's controller and proxies (the first deployment on a cluster), which
# on a busy 2-core machine has taken over a minute; reads answer at once.
PUT_TIMEOUT_S = 300
READ_TIMEOUT_S = 60


def _request(where: home.ClusterAddress, method: str, body: dict | None = None) -> requests.Response:
    url = where.dashboard_url.rstrip("/") + SERVE_API
    timeout = PUT_TIMEOUT_S if method == "PUT" else READ_TIMEOUT_S
    try:
        return requests.request(method, url, json=body, headers=where.headers, timeout=timeout)
    except requests.ReadTimeout:
        raise ClusterError(
            f"{url}: no answer within {timeout} s; the dashboard is up but busy (starting Serve takes longest): "
            "look at `ray status` and the dashboard's log (serve/ and dashboard_serve_head.log), then try again"
        ) from None
    except requests.RequestException as e:
        raise ClusterError(f"{url}: no answer ({type(e).__name__}); is the cluster's dashboard up?") from None


def serve_details(address: home.ClusterAddress | str | None = None) -> dict:
    """Serve's details of every application and its HTTP options (`GET /api/serve/applications/`)."""
    where = _where(address)
    r = _request(where, "GET")
    if r.status_code != 200:
        raise ClusterError(f"{where.dashboard_url}{SERVE_API} answered HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _other_configs(details: dict, name: str) -> list[dict]:
    """The configs of every application but `name`, as Serve keeps them: PUT them back unchanged."""
    configs = []
    for other, app in sorted((details.get("applications") or {}).items()):
        if other == name or app.get("status") == "DELETING":  # one being deleted is already left out
            continue
        config = app.get("deployed_app_config")
        if not config:
            raise PylonError(
                f"application '{other}' on this cluster was deployed with Serve's Python API (serve.run), and Serve "
                "cannot run it beside applications deployed through its REST API; delete it (serve.delete"
                f"('{other}')) or deploy this one the same way"
            )
        configs.append(config)
    return configs


PUT_ATTEMPTS = 3  # a PUT that lost Serve's starting HTTP proxy is repeated (it names the whole state: idempotent)
PUT_RETRY_WAIT_S = 2.0


def _lost_starting_proxy(r: requests.Response) -> bool:
    """The dashboard started Serve and waited for its HTTP proxies, and either the controller killed one that was not
    ready in time (it starts another) or the dashboard stopped waiting (Ray's fixed 60 s, `HTTP_PROXY_TIMEOUT`, passes
    on a loaded machine while the proxy still starts): the controller runs, so the same PUT connects to it and goes
    through."""
    if r.status_code != 500:
        return False
    died = "ActorDiedError" in r.text and "SERVE_PROXY_ACTOR" in r.text
    return died or "TimeoutError: HTTP proxies not available after" in r.text


def _put(where: home.ClusterAddress, http_options: dict, applications: list[dict]) -> None:
    body = {"http_options": http_options, "applications": applications}
    for attempt in range(1, PUT_ATTEMPTS + 1):
        r = _request(where, "PUT", body)
        if r.status_code == 200:
            return
        if attempt == PUT_ATTEMPTS or not _lost_starting_proxy(r):
            break
        time.sleep(PUT_RETRY_WAIT_S)
    raise PylonError(f"Serve refused the deployment (HTTP {r.status_code}): {r.text.strip()[-1500:]}")


def _running_http(details: dict) -> dict | None:
    """Serve's HTTP host and port when Serve is running (they are fixed until it stops), else None."""
    if not details.get("controller_info") or not details.get("http_options"):
        return None
    http = details["http_options"]
    return {"host": http.get("host") or "127.0.0.1", "port": int(http.get("port") or DEFAULT_PORT)}


def _http_options(spec: DeploymentSpec, where: home.ClusterAddress, details: dict) -> dict:
    """Where Serve's HTTP ingress listens: as it is when Serve runs already (a spec asking for another bind address
    or port is refused), else the spec's `http.host` and `http.port` (default: the port `pylon cluster up`
    reserved for this cluster, else 8000)."""
    running = _running_http(details)
    if running is not None:
        wanted = {"host": spec.http.host, "port": spec.http.port or running["port"]}
        differ = [k for k in ("host", "port") if wanted[k] != running[k]]
        if differ:
            raise PylonError(
                "; ".join(f"http.{k}: Serve on this cluster already listens on {k} {running[k]}" for k in differ)
                + f", and cannot change it while applications run; use {running['host']}:{running['port']}, or "
                "delete every deployment first"
            )
        return running
    port = spec.http.port
    if port is None:
        state = home.read_state() if where.shares_disk else None
        port = getattr(state, "serve_port", 0) or DEFAULT_PORT
    return {"host": spec.http.host, "port": port}


def base_url(http: dict, route_prefix: str, dashboard_url: str) -> str:
    """How a client reaches an application: Serve's bind address, or for one that listens on every interface
    (0.0.0.0, ::) the host the client reaches the dashboard on."""
    host = http.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = urlparse(dashboard_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{http.get('port', DEFAULT_PORT)}{route_prefix.rstrip('/')}"


def deploy(
    spec: DeploymentSpec,
    *,
    address: home.ClusterAddress | str | None = None,
    timeout_s: float = 600,
    force: bool = False,
) -> str:
    """Run `spec` on the cluster (`address`: an address to resolve, the local cluster by default, or a resolved
    `home.ClusterAddress`, as a `Client` passes) and return its base URL. A replica the planner says the cluster
    cannot hold (`pylon.plan.check_serve_fits`: its GPU type, or its largest node's RAM) is refused first with
    WontFitError, saying what does not fit and what to change; `force=True` deploys it anyway."""
    from pylon.serving.api.keys import api_keys_config

    where = _where(address)
    spec = _checked_model(spec, where)
    if not force:
        from pylon.plan import check_serve_fits

        check_serve_fits(spec, _nodes(where))
    keys = api_keys_config(spec)  # here, from this process's environment: only salted hashes leave it
    revision = f"rev-{os.urandom(16).hex()}"  # /ready reports it once a replica runs this config
    details = serve_details(where)
    others = _other_configs(details, spec.name)
    prefix = spec.http.route_prefix
    for other in others:
        if (other.get("route_prefix") or "/") == prefix:
            raise PylonError(
                f"http.route_prefix: {prefix} is already served by application '{other['name']}'; give "
                f"'{spec.name}' its own prefix (e.g. /{spec.name}) or delete that one first "
                f"(pylon serve --delete {other['name']})"
            )
    http = _http_options(spec, where, details)
    if where.shares_disk and _running_http(details) is None:
        _check_port_free(http["host"], http["port"])
    app = {
        "name": spec.name,
        "route_prefix": prefix,
        "import_path": APP_BUILDER,
        "args": {"spec": spec.model_dump(mode="json")},
        # Beside the args, not in them: new keys alone change no args, so Serve reconfigures the running replicas
        # in place (no restart) rather than rebuilding the app.
        "deployments": [{"name": spec.name, "user_config": {"api_keys": keys, "revision": revision}}],
    }
    _put(where, http, [*others, app])
    url = base_url(http, prefix, where.dashboard_url)
    _wait_ready(url, timeout_s, spec.name, where, revision)
    return url


def _nodes(where: home.ClusterAddress) -> list[home.NodeInfo]:
    try:
        return home.cluster_nodes(where)
    except Exception:  # the fit check is advice: an unreachable state API must not block a deployment
        return []


def _checked_model(spec: DeploymentSpec, where: home.ClusterAddress) -> DeploymentSpec:
    """Fail before deploying when `model` (or `engine.speculative.draft_model`) is not a model directory (a replica
    would only crash-loop), or is a path on this machine the cluster cannot read; make a local path absolute:
    replicas do not run in the caller's directory."""
    uri = _checked_model_dir("model", spec.model, where)
    speculative = spec.engine.speculative
    if speculative.draft_model is None:
        return spec.model_copy(update={"model": uri})
    draft = _checked_model_dir("engine.speculative.draft_model", speculative.draft_model, where)
    engine = spec.engine.model_copy(update={"speculative": speculative.model_copy(update={"draft_model": draft})})
    return spec.model_copy(update={"model": uri, "engine": engine})


def _checked_model_dir(field: str, uri: str, where: home.ClusterAddress) -> str:
    """`uri`, a model directory the cluster can read (a local path made absolute), or a PylonError naming `field`."""
    if "://" not in uri:
        uri = os.path.abspath(os.path.expanduser(uri))
        if not where.shares_disk:
            raise PylonError(
                f"{field}: {uri} is a path on this machine, and the cluster at {where.dashboard_url} shares no disk "
                "with it; copy the model directory to object storage (e.g. s3://BUCKET/models/NAME) and deploy that"
            )
    try:
        has_config = storage.exists(storage.join(uri, "config.json"))
    except Exception as e:  # storage or credential errors while looking
        raise PylonError(f"{field} {storage.describe(uri)}: cannot be read ({type(e).__name__}: {e})") from None
    if not has_config:
        raise PylonError(
            f"{field} {storage.describe(uri)}: not a Hugging Face model directory (no config.json); "
            "point it at a `pylon export` output or a saved transformers model"
        )
    return uri


def app_failure(details: dict, name: str) -> str | None:
    """Serve's message when application `name` failed to deploy (e.g. the replica's constructor raised)."""
    app = (details.get("applications") or {}).get(name)
    if app is None or app.get("status") != "DEPLOY_FAILED":
        return None
    messages = [d.get("message") for d in (app.get("deployments") or {}).values() if d.get("message")]
    return (messages[-1] if messages else app.get("message")) or "no message"


def port_owner(port: int, host: str | None = None) -> str | None:
    """What listens on TCP `port` on this machine ("NAME (pid N)"), if anything can tell; with `host`, a listener on
    that address or on every address (another process may listen on the same port of another of the machine's
    addresses, which does not stop a bind to `host`)."""
    import psutil

    wildcard = ("0.0.0.0", "::", "")
    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status != psutil.CONN_LISTEN or conn.laddr.port != port:
                continue
            if host is None or conn.laddr.ip in (host, *wildcard) or host in wildcard:
                try:
                    return f"{psutil.Process(conn.pid).name()} (pid {conn.pid})" if conn.pid else "another process"
                except psutil.Error:
                    return f"pid {conn.pid}"
    except psutil.Error:
        return None
    return None


def _check_port_free(host: str, port: int) -> None:
    """Before Serve starts its HTTP ingress on this machine: refuse at once when `host:port` is taken, naming the
    owner, rather than wait out Serve's retries of a bind that cannot succeed."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (e.g. an address of another machine): Serve will say
            owner = port_owner(port, host) or "another process"
            raise PylonError(
                f"http.port: {host}:{port} is already in use by {owner}, so Serve's HTTP ingress cannot listen there; "
                "set http.port in the spec to a free port, or stop what holds it"
            ) from None


PROXY_GRACE_S = 20.0  # how long Serve's HTTP proxy on a node may stay UNHEALTHY before a deploy gives up


def _check_proxies(details: dict, unhealthy_since: dict[str, float], url: str) -> None:
    """Fail at once, naming the node and its log, when Serve's HTTP proxy on a node stays UNHEALTHY (its ingress
    cannot start, e.g. the port is taken there): Serve would retry it until the deploy timed out."""
    now = time.monotonic()
    for node, proxy in (details.get("proxies") or {}).items():
        if proxy.get("status") != "UNHEALTHY":
            unhealthy_since.pop(node, None)
            continue
        since = unhealthy_since.setdefault(node, now)
        if now - since >= PROXY_GRACE_S:
            where = proxy.get("node_ip") or node[:12]
            log = proxy.get("log_file_path") or "the proxy's log under the node's Ray logs (logs/serve/proxy_*.log)"
            raise PylonError(
                f"Serve's HTTP proxy on node {where} has been unhealthy for {now - since:.0f} s, so {url} cannot "
                f"answer: its HTTP ingress did not start (a port already in use there is the usual cause; see {log} "
                "on that node); set http.port in the spec to a free port, or free it"
            )


def _wait_ready(url: str, timeout_s: float, name: str, where: home.ClusterAddress, revision: str) -> None:
    """Until the app's replicas answer /ready with `revision` (the config just put: until then the old replicas
    may answer, with the old config) and Serve reports every deployment healthy (all replicas updated)."""
    import sys

    from tqdm import tqdm

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # On a terminal, a line that says what is being waited for and for how long (loading a model takes a while).
    with tqdm(
        desc=f"loading {name} (replica starting, model loading)",
        bar_format="{desc}: {elapsed}",
        file=sys.stderr,
        disable=None,
    ) as bar:
        seen = False  # a replica answered with `revision`: Serve has taken the config in, so its status is current
        unhealthy_since: dict[str, float] = {}
        while time.monotonic() < deadline:
            details = serve_details(where)
            failure = app_failure(details, name)
            if failure:
                raise PylonError(f"deployment '{name}' failed to start: {failure.strip()[-2000:]}")
            _check_proxies(details, unhealthy_since, url)
            app = (details.get("applications") or {}).get(name) or {}
            deployments = (app.get("deployments") or {}).values()
            healthy = app.get("status") == "RUNNING" and all(d.get("status") == "HEALTHY" for d in deployments)
            if seen and healthy:
                return
            if not healthy:
                last = f"Serve: application {app.get('status', 'not listed yet')}"
            else:
                try:
                    r = requests.get(f"{url}/ready", timeout=5)
                    seen = r.status_code == 200 and r.json().get("revision") == revision
                    if seen:
                        continue  # once more: every replica updated (Serve's status), not only this one
                    last = f"HTTP {r.status_code}" if r.status_code != 200 else "a replica with the previous config"
                except (requests.RequestException, ValueError) as e:
                    last = type(e).__name__
            time.sleep(0.5)
            bar.refresh()
    raise PylonError(f"{url}/ready did not answer 200 within {timeout_s:.0f} s (last: {last})")


def delete(name: str, *, address: home.ClusterAddress | str | None = None, timeout_s: float = 120) -> None:
    """Remove application `name` from the cluster (`address` as for `deploy`) and wait until Serve has let go of it
    (its replicas stopped, its route answers 404), as `serve.delete` does."""
    where = _where(address)
    details = serve_details(where)
    if name not in (details.get("applications") or {}):
        raise PylonError(f"no Serve application '{name}' on the cluster at {where.dashboard_url}")
    http = _running_http(details) or {"host": "127.0.0.1", "port": DEFAULT_PORT}
    _put(where, http, _other_configs(details, name))
    deadline = time.monotonic() + timeout_s
    while name in (serve_details(where).get("applications") or {}):
        if time.monotonic() > deadline:
            raise PylonError(f"Serve still lists application '{name}' {timeout_s:.0f} s after deleting it")
        time.sleep(0.5)
