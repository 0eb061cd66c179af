"""`pylon cluster join` without a cluster: where the token comes from, the `ray start` command line it builds (no token
on it), labels and resources, the head address, which node of the GCS's list is ours, and the refusals that come
before anything starts. The join itself, against a real head, is tests/integration/test_cluster_join.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pylon.errors import ClusterError
from pylon.infra import local as cluster
from pylon.specs import is_loopback

TOKEN = "f" * 64  # what a token looks like; every message and command line below is checked not to hold it


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home with nothing in it, no token variables, and a user home of its own (for ~/.ray/auth_token)."""
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    home = tmp_path / "home"
    monkeypatch.setenv("PYLON_HOME", str(home))
    return home


def _token_file(path: Path, value: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    return path


def test_the_token_comes_from_the_flag_then_the_variables_then_pylon_home_then_rays_default(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_default = _token_file(tmp_path / "user" / ".ray" / "auth_token", "from-ray-default")
    found = cluster.join_token(None, env)
    assert (found.value, found.path) == ("from-ray-default", ray_default.resolve())

    _token_file(env / "auth_token", "from-pylon-home")
    assert cluster.join_token(None, env).value == "from-pylon-home"

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(_token_file(tmp_path / "by-path", "from-token-path")))
    assert cluster.join_token(None, env).value == "from-token-path"

    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-variable")
    found = cluster.join_token(None, env)
    assert (found.value, found.path, found.origin) == ("from-variable", None, "RAY_AUTH_TOKEN")

    flag = _token_file(tmp_path / "copied-token", "from-flag")
    found = cluster.join_token(str(flag), env)
    assert (found.value, found.path) == ("from-flag", flag.resolve())
    assert "from-flag" not in repr(found) and str(flag) in found.origin


def test_no_token_is_a_clear_error_that_says_what_to_do(env: Path, tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ClusterError, match=r"no auth token found.*--token-file PATH"):
        cluster.join_token(None, env)
    with pytest.raises(ClusterError, match=r"--token-file .*missing: no such file.*copy the head's token file"):
        cluster.join_token(str(tmp_path / "missing"), env)
    empty = _token_file(tmp_path / "empty", "")
    with pytest.raises(ClusterError, match="the file is empty"):
        cluster.join_token(str(empty), env)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ClusterError, match=r"RAY_AUTH_TOKEN_PATH=.*nowhere: no such file"):
        cluster.join_token(None, env)


def test_the_ray_start_command_line_holds_no_token(env: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    temp_dir = cluster.ray_temp_dir(env)
    cmd = cluster.join_command(
        "10.0.0.1:6379",
        temp_dir,
        num_cpus=4,
        num_gpus=0,
        memory=2 * 2**30,
        object_store_memory=2**30,
        resources={"nvme": 1.0},
        labels={"zone": "a", "pylon-test": "yes"},
        node_ip_address="10.0.0.7",
        agent_port=52366,
        metrics_port=9100,
    )
    assert Path(cmd[0]).name == "ray" and cmd[1] == "start"
    assert cmd[2:] == [
        "--address=10.0.0.1:6379",
        f"--temp-dir={temp_dir}",
        "--dashboard-agent-listen-port=52366",
        "--disable-usage-stats",
        "--metrics-export-port=9100",
        "--num-cpus=4",
        "--num-gpus=0",
        f"--memory={2 * 2**30}",
        f"--object-store-memory={2**30}",
        "--node-ip-address=10.0.0.7",
        '--resources={"nvme": 1.0}',
        "--labels=zone=a,pylon-test=yes",
    ]
    assert not any("--head" in arg or "token" in arg.lower() or TOKEN in arg for arg in cmd)
    # Nothing optional given: only what every worker node needs.
    bare = cluster.join_command("10.0.0.1:6379", temp_dir)
    assert [a.split("=")[0] for a in bare[2:]] == [
        "--address",
        "--temp-dir",
        "--dashboard-agent-listen-port",
        "--disable-usage-stats",
    ]

    # The token reaches Ray as a file in the environment; RAY_AUTH_TOKEN itself is dropped there.
    node_env = cluster.node_env(env / "auth_token", temp_dir)
    assert node_env["RAY_AUTH_MODE"] == "token" and node_env["RAY_AUTH_TOKEN_PATH"] == str(env / "auth_token")
    assert "RAY_AUTH_TOKEN" not in node_env and "RAY_ADDRESS" not in node_env
    assert node_env["PATH"].split(os.pathsep)[0] == str(Path(cluster.sys.executable).parent)
    assert cluster.LOCAL_RAY_ENV.items() <= node_env.items()
    assert node_env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


def test_labels_are_rays_key_value_format_checked_by_rays_rules() -> None:
    assert cluster.parse_labels("zone=a, disk=nvme,example.com/tier=gold") == {
        "zone": "a",
        "disk": "nvme",
        "example.com/tier": "gold",
    }
    assert cluster.parse_labels("") == {} and cluster.parse_labels(None) == {}
    assert cluster.parse_labels("empty=") == {"empty": ""}
    for text, problem in (
        ("zone", "not KEY=VALUE"),
        ("=a", "not KEY=VALUE"),
        ("a=b=c", "not KEY=VALUE"),
        ("zone=a,zone=b", "given twice"),
        ("ray.io/accelerator-type=H100", "Ray's own"),
        ("zone=-a", "Invalid label key value"),
        ("bad key=a", "Invalid label key name"),
    ):
        with pytest.raises(ClusterError, match=problem):
            cluster.parse_labels(text)


def test_resources_are_a_json_object_of_custom_amounts() -> None:
    assert cluster.parse_resources('{"nvme": 1, "accelerator_type:A100-80GB": 1}') == {
        "nvme": 1.0,
        "accelerator_type:A100-80GB": 1.0,
    }
    assert cluster.parse_resources(None) == {}
    for text, problem in (
        ("nvme", "not JSON"),
        ("[1]", "JSON object"),
        ('{"CPU": 2}', "set CPU with --num-cpus"),
        ('{"GPU": 1}', "--num-gpus"),
        ('{"memory": 1}', "--memory-gib"),
        ('{"nvme": -1}', "not a number >= 0"),
        ('{"nvme": "one"}', "not a number >= 0"),
        ('{"nvme": true}', "not a number >= 0"),
    ):
        with pytest.raises(ClusterError, match=problem):
            cluster.parse_resources(text)


def test_the_head_address_is_the_gcs_address_not_the_dashboard_url() -> None:
    assert cluster.parse_head_address(" 10.0.0.1:6379 ") == "10.0.0.1:6379"
    assert cluster.parse_head_address("head.example.com:6380") == "head.example.com:6380"
    with pytest.raises(ClusterError, match=r"is a URL; .*GCS address HOST:PORT.*pylon cluster up"):
        cluster.parse_head_address("http://10.0.0.1:8265")
    with pytest.raises(ClusterError, match="is a URL"):
        cluster.parse_head_address("ray://10.0.0.1:10001")
    for bad in ("10.0.0.1", ":6379", "10.0.0.1:port", "10.0.0.1:0", "10.0.0.1:70000"):
        with pytest.raises(ClusterError, match="not a GCS address"):
            cluster.parse_head_address(bad)


def test_ours_is_the_newest_node_with_this_temp_dir_on_this_host() -> None:
    def node(node_id: str, temp_dir: str, hostname: str, start_s: float, state: str = "ALIVE") -> dict:
        return {
            "node_id": node_id,
            "temp_dir": temp_dir,
            "hostname": hostname,
            "start_time_ms": int(start_s * 1000),
            "state": state,
        }

    nodes = [
        node("head", "/tmp/pylon-head", "here", 900),
        node("earlier", "/tmp/pylon-mine", "here", 950, "DEAD"),  # an earlier join from the same home
        node("other-machine", "/tmp/pylon-mine", "there", 1001),  # the same home path elsewhere
        node("mine", "/tmp/pylon-mine", "here", 1002),
    ]
    assert cluster.our_node(nodes, "/tmp/pylon-mine", "here", started_at=1000)["node_id"] == "mine"
    assert cluster.our_node(nodes[:3], "/tmp/pylon-mine", "here", started_at=1000) is None


def test_refusals_come_before_anything_starts(env: Path, tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="is a URL"):
        cluster.join("http://127.0.0.1:8265", home=env)
    with pytest.raises(ClusterError, match="no auth token found"):
        cluster.join("127.0.0.1:6379", home=env)
    token = _token_file(tmp_path / "token", TOKEN)
    with pytest.raises(ClusterError, match="--num-cpus must be >= 0"):
        cluster.join("127.0.0.1:6379", token_file=str(token), num_cpus=-1, home=env)
    with pytest.raises(ClusterError, match="--labels"):
        cluster.join("127.0.0.1:6379", token_file=str(token), labels="zone", home=env)
    # Nothing listens on port 1: said so, with what to check, before `ray start`.
    with pytest.raises(ClusterError, match=r"nothing answers at 127.0.0.1:1 .*GCS address") as failed:
        cluster.join("127.0.0.1:1", token_file=str(token), home=env)
    assert TOKEN not in str(failed.value)
    assert not env.exists() or sorted(p.name for p in env.iterdir()) == []  # no record, no token copy, no log


def test_a_stale_node_record_is_read_and_its_gpu_type_is_rays(env: Path) -> None:
    env.mkdir(parents=True)
    record = {
        "head_address": "10.0.0.1:6379",
        "node_id": "ab" * 28,
        "node_ip": "10.0.0.7",
        "temp_dir": str(cluster.ray_temp_dir(env)),
        "token_path": str(env / "auth_token"),
        "home": str(env),
        "started_at": 1.0,
        "resources": {"CPU": 8.0, "GPU": 1.0, "accelerator_type:H100": 1.0},
        "labels": {"ray.io/accelerator-type": "H100"},
    }
    (env / "node.json").write_text(json.dumps(record))
    node = cluster.read_node(env)
    assert node.gpu_type == "H100" and not node.is_running()
    assert cluster.read_state(env) is None  # a node's home holds no head record
    # `down` on a home whose node is gone removes the record; nothing else runs that names its temp dir.
    assert cluster.down(home=env) == node
    assert cluster.read_node(env) is None
    (env / "node.json").write_text("{not json")
    with pytest.raises(ClusterError, match="unreadable node record"):
        cluster.read_node(env)


def test_the_token_copy_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "home" / "auth_token"
    cluster._write_token(path, TOKEN)
    assert path.read_text() == TOKEN and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    cluster._write_token(path, "g" * 64)  # replaced atomically by a new owner-only file
    assert path.read_text() == "g" * 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["auth_token"]


def test_the_dashboard_url_names_an_address_clients_reach() -> None:
    assert cluster.dashboard_host("127.0.0.1", "10.0.0.1:6379") == "127.0.0.1"
    assert cluster.dashboard_host("0.0.0.0", "10.0.0.1:6379") == "10.0.0.1"  # every interface: the node's IP
    assert cluster.dashboard_host("::", "10.0.0.1:6379") == "10.0.0.1"
    assert cluster.dashboard_host("10.0.0.5", "10.0.0.1:6379") == "10.0.0.5"
    assert cluster.dashboard_host("fd00::5", "10.0.0.1:6379") == "[fd00::5]"
    assert [is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "10.0.0.5")] == [
        True,
        True,
        True,
        False,
        False,
    ]
