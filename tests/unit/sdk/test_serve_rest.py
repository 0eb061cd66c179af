"""Deploying through Serve's REST API (pylon.sdk.serve): the configs put back unchanged, Serve's HTTP options, the
URL a client reaches, and the builder's arguments. The whole path on a real cluster: tests/integration."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pylon import home
from pylon.errors import PylonError
from pylon.sdk.serve import _http_options, _other_configs, _running_http, app_failure, base_url
from pylon.specs import DeploymentSpec

WHERE = home.ClusterAddress("http://10.0.0.1:8265")


def _details(*apps: dict, http: dict | None = None, running: bool = True) -> dict:
    return {
        "controller_info": {"node_id": "abc"} if running else {},
        "http_options": http or {"host": "127.0.0.1", "port": 8123},
        "applications": {a["name"]: a for a in apps},
    }


def _app(name: str, *, config: bool = True, status: str = "RUNNING", prefix: str = "/") -> dict:
    return {
        "name": name,
        "status": status,
        "route_prefix": prefix,
        "deployed_app_config": {"name": name, "route_prefix": prefix, "import_path": "x:y"} if config else None,
        "deployments": {},
    }


def test_the_other_applications_are_put_back_as_serve_keeps_them() -> None:
    details = _details(_app("a"), _app("b"), _app("mine"))
    assert [c["name"] for c in _other_configs(details, "mine")] == ["a", "b"]
    with pytest.raises(PylonError, match=r"application 'legacy' .* deployed with Serve's Python API"):
        _other_configs(_details(_app("legacy", config=False)), "mine")


def test_http_options_follow_a_running_serve_and_refuse_to_change_it() -> None:
    spec = DeploymentSpec(name="d", model="s3://b/m")
    assert _http_options(spec, WHERE, _details()) == {"host": "127.0.0.1", "port": 8123}
    with pytest.raises(PylonError, match=r"http.port: Serve on this cluster already listens on port 8123"):
        _http_options(spec.model_copy(update={"http": spec.http.model_copy(update={"port": 9000})}), WHERE, _details())
    # Not running yet: the spec's, with 8000 for a cluster that is not this machine's.
    assert _http_options(spec, WHERE, _details(running=False)) == {"host": "127.0.0.1", "port": 8000}
    assert _running_http(_details(running=False)) is None


def test_a_client_reaches_an_application_where_serve_listens() -> None:
    assert base_url({"host": "127.0.0.1", "port": 8123}, "/gpt/", WHERE.dashboard_url) == "http://127.0.0.1:8123/gpt"
    assert base_url({"host": "0.0.0.0", "port": 8000}, "/", WHERE.dashboard_url) == "http://10.0.0.1:8000"
    assert base_url({"host": "::1", "port": 8000}, "/", WHERE.dashboard_url) == "http://[::1]:8000"


def test_a_failed_application_says_why() -> None:
    failed = _app("d", status="DEPLOY_FAILED")
    failed["deployments"] = {"d": {"message": "ValueError: no config.json"}}
    assert app_failure(_details(failed), "d") == "ValueError: no config.json"
    assert app_failure(_details(_app("d")), "d") is None and app_failure(_details(), "d") is None


def test_serving_off_loopback_needs_api_keys() -> None:
    DeploymentSpec(name="d", model="m", http={"host": "0.0.0.0"})  # keys from $PYLON_API_KEYS: fine
    with pytest.raises(ValidationError, match=r"http.host: 0.0.0.0 lets other machines in, so it needs API keys"):
        DeploymentSpec.model_validate({"name": "d", "model": "m", "http": {"host": "0.0.0.0", "api_keys_env": None}})
    DeploymentSpec.model_validate({"name": "d", "model": "m", "http": {"api_keys_env": None}})  # loopback: allowed


def test_the_builder_takes_a_clients_spec_or_a_bare_spec_with_keys_from_its_environment(monkeypatch) -> None:
    pytest.importorskip("ray.serve")
    from pylon.serving.api import builder, keys

    monkeypatch.setenv("PYLON_TEST_KEYS", "sk-one,sk-two")
    spec = DeploymentSpec(name="d", model="s3://b/m", http={"api_keys_env": "PYLON_TEST_KEYS"}).model_dump(mode="json")
    # A client's REST deploy: the spec only; the key hashes come beside it as the deployment's user_config override.
    client = builder.app_builder({"spec": spec})._bound_deployment
    assert client.init_args == (spec,) and client.user_config["api_keys"] is None
    # A RayService's serveConfigV2: the spec itself, keys read (and hashed) where the builder runs.
    bare = builder.app_builder(spec)._bound_deployment
    stored = bare.user_config["api_keys"]
    assert stored["scheme"] == "scrypt" and len(stored["hashes"]) == 2
    assert "sk-one" not in json.dumps(stored) and bare.init_args == (spec,)
    salt = bytes.fromhex(stored["salt"])
    assert stored["hashes"] == keys.hash_keys(["sk-one", "sk-two"], salt=salt)["hashes"]


def test_a_taken_http_port_is_refused_at_once_naming_its_owner() -> None:
    import os
    import socket

    from pylon.sdk.serve import _check_port_free

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PylonError) as err:
            _check_port_free("127.0.0.1", port)
        message = str(err.value)
        assert message.startswith(f"http.port: 127.0.0.1:{port} is already in use by ")
        assert f"(pid {os.getpid()})" in message and "set http.port in the spec to a free port" in message
    _check_port_free("127.0.0.1", port)  # released: free again


def test_the_owner_named_is_the_listener_on_that_address_not_another_on_the_same_port() -> None:
    """Another process listening on the same port of another address (127.0.0.2: the loopback range) does not stop a
    bind to 127.0.0.1 and is not its owner."""
    import os
    import socket
    import subprocess
    import sys

    from pylon.sdk.serve import port_owner

    other = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.2', 0)); s.listen()\n"
         "print(s.getsockname()[1], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(other.stdout.readline())
        with socket.socket() as held:
            held.bind(("127.0.0.1", port))
            held.listen()
            assert port_owner(port, "127.0.0.1").endswith(f"(pid {os.getpid()})")
            assert port_owner(port, "127.0.0.2").endswith(f"(pid {other.pid})")
    finally:
        other.kill()
        other.wait()


def test_a_proxy_that_stays_unhealthy_fails_the_deploy_naming_the_node(monkeypatch) -> None:
    from pylon.sdk import serve

    clock = [100.0]
    monkeypatch.setattr(serve.time, "monotonic", lambda: clock[0])
    since: dict[str, float] = {}
    proxies = {"n1": {"status": "HEALTHY"}, "n2": {"status": "UNHEALTHY", "node_ip": "10.0.0.7", "log_file_path": "/l"}}
    serve._check_proxies({"proxies": proxies}, since, "http://h:8000")  # first seen unhealthy: a grace period
    clock[0] += serve.PROXY_GRACE_S - 1
    serve._check_proxies({"proxies": proxies}, since, "http://h:8000")
    clock[0] += 2
    with pytest.raises(PylonError, match=r"proxy on node 10\.0\.0\.7 has been unhealthy for 21 s.*see /l on that node"):
        serve._check_proxies({"proxies": proxies}, since, "http://h:8000")
    # Healthy again within the grace period: the clock starts over.
    since.clear()
    serve._check_proxies({"proxies": proxies}, since, "u")
    serve._check_proxies({"proxies": {"n2": {"status": "HEALTHY"}}}, since, "u")
    assert since == {}


def test_a_put_that_lost_serves_starting_proxy_is_repeated_and_no_other_failure_is(monkeypatch) -> None:
    """The dashboard starting Serve waits for its HTTP proxies; the controller kills one not ready in time (and
    starts another), and the PUT answers 500 with that actor's death (CI, stop 51). The controller runs by then, so
    the same PUT goes through. Any other refusal is reported at once. Served here by an HTTP server on loopback
    that answers as the dashboard did."""
    import http.server
    import threading

    from pylon.sdk import serve

    died = (
        "Traceback (most recent call last):\n  ...\nray.exceptions.ActorDiedError: The actor died unexpectedly before "
        "finishing this task.\n\tclass_name: HAProxyManager\n\tname: SERVE_PROXY_ACTOR-9aaa92f2\n\tnamespace: serve\n"
        "The actor is dead because it was killed by `ray.kill`."
    )
    waited = (
        'Traceback (most recent call last):\n  File ".../ray/serve/_private/api.py", line 223, in serve_start_async\n'
        "    raise TimeoutError(\nTimeoutError: HTTP proxies not available after 60s."
    )
    answers: list[tuple[int, str]] = []
    bodies: list[dict] = []

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, text = answers.pop(0)
            self.send_response(status)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(serve, "PUT_RETRY_WAIT_S", 0.0)
    where = home.ClusterAddress(f"http://127.0.0.1:{server.server_address[1]}")
    app = {"name": "a", "import_path": "x:y"}
    try:
        answers[:] = [(500, died), (200, "")]
        serve._put(where, {"host": "127.0.0.1", "port": 8000}, [app])
        assert len(bodies) == 2 and bodies[0] == bodies[1] == {
            "http_options": {"host": "127.0.0.1", "port": 8000},
            "applications": [app],
        }
        # The dashboard stopped waiting for a proxy that still starts (Ray's fixed 60 s): the same, repeated.
        bodies.clear()
        answers[:] = [(500, waited), (200, "")]
        serve._put(where, {}, [app])
        assert len(bodies) == 2
        # Lost every time: given up after PUT_ATTEMPTS, with Serve's words.
        bodies.clear()
        answers[:] = [(500, died)] * serve.PUT_ATTEMPTS
        with pytest.raises(PylonError, match=r"(?s)Serve refused the deployment \(HTTP 500\):.*SERVE_PROXY_ACTOR"):
            serve._put(where, {}, [app])
        assert len(bodies) == serve.PUT_ATTEMPTS
        # Another failure (a 500 of another cause, a 400): not repeated.
        for status, text in [(500, "Traceback ...\nValueError: bad import path"), (400, "ValidationError ...")]:
            bodies.clear()
            answers[:] = [(status, text)]
            with pytest.raises(PylonError, match=rf"HTTP {status}\): {text[:9]}"):
                serve._put(where, {}, [app])
            assert len(bodies) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_the_clusters_messages_to_a_driver_go_to_stderr(capsys, monkeypatch) -> None:
    """Ray prints a raylet's warnings to every driver's stdout from a thread of its own (`listen_error_messages`),
    which broke `pylon jobs list --json` in CI; a driver Pylon connects (`home.init_ray`) prints them to stderr, through
    Ray's own printer, so stdout holds only what Pylon writes."""
    from ray._private import worker

    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # restored after the test
    home._raylet_messages_to_stderr()
    home._raylet_messages_to_stderr()  # once only, however often a process connects
    assert not getattr(worker.print_to_stdstream.__wrapped__, "pylon_to_stderr", False)  # Ray's own, wrapped once
    warning = "WARNING: 8 PYTHON worker processes have been started on node: abc"
    worker.print_to_stdstream({"lines": [warning], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out, err = capsys.readouterr()
    assert out == "" and warning in err
