"""`pylon cluster up|join|down` on the command line, without a cluster: what each option parses to, and the
refusals `join` prints (exit 1, no traceback, never the token) before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from pylon.cli import build_parser, main
from pylon.cli.cluster import _cmd_cluster_join, _cmd_cluster_up

TOKEN = "e" * 64


def test_join_parses_every_option() -> None:
    args = build_parser().parse_args(
        [
            "cluster",
            "join",
            "10.0.0.1:6379",
            "--token-file",
            "~/head-token",
            "--num-cpus",
            "4",
            "--num-gpus",
            "1",
            "--memory-gib",
            "8",
            "--object-store-gib",
            "2.5",
            "--resources",
            '{"nvme": 1}',
            "--labels",
            "zone=a,disk=nvme",
            "--node-ip-address",
            "10.0.0.7",
        ]
    )
    assert args.func is _cmd_cluster_join
    assert (args.head_address, args.token_file) == ("10.0.0.1:6379", "~/head-token")
    assert (args.num_cpus, args.num_gpus, args.memory_gib, args.object_store_gib) == (4, 1, 8.0, 2.5)
    assert (args.resources, args.labels, args.node_ip_address) == ('{"nvme": 1}', "zone=a,disk=nvme", "10.0.0.7")
    bare = build_parser().parse_args(["cluster", "join", "10.0.0.1:6379"])
    assert bare.token_file is bare.num_cpus is bare.labels is bare.resources is bare.node_ip_address is None


def test_join_needs_the_head_address() -> None:
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["cluster", "join"])
    assert usage.value.code == 2


def test_up_binds_to_loopback_unless_told_otherwise() -> None:
    args = build_parser().parse_args(["cluster", "up"])
    assert args.func is _cmd_cluster_up and (args.host, args.node_ip_address) == ("127.0.0.1", None)
    args = build_parser().parse_args(["cluster", "up", "--host", "0.0.0.0", "--node-ip-address", "10.0.0.1"])
    assert (args.host, args.node_ip_address) == ("0.0.0.0", "10.0.0.1")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("PYLON_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["http://10.0.0.1:8265"], "is a URL; `pylon cluster join` needs the head's GCS address HOST:PORT"),
        (["10.0.0.1"], "is not a GCS address"),
        (["127.0.0.1:1"], "no auth token found"),
        (["127.0.0.1:1", "--token-file", "TOKEN", "--labels", "zone"], "--labels: 'zone' is not KEY=VALUE"),
        (["127.0.0.1:1", "--token-file", "TOKEN", "--resources", '{"GPU": 1}'], "set GPU with --num-gpus"),
        (["127.0.0.1:1", "--token-file", "TOKEN", "--num-gpus", "-1"], "--num-gpus must be >= 0"),
        (["127.0.0.1:1", "--token-file", "TOKEN"], "nothing answers at 127.0.0.1:1"),
    ],
)
def test_join_refusals_are_one_line_errors_without_the_token(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], says: str
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    argv = [str(token) if a == "TOKEN" else a for a in argv]
    assert main(["cluster", "join", *argv]) == 1
    out, err = capsys.readouterr()
    assert says in err and "Traceback" not in err and TOKEN not in out + err
    assert not home.exists()  # nothing recorded, copied or started


def test_down_with_nothing_recorded_says_so(home: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["cluster", "down"]) == 0
    assert "nothing to stop" in capsys.readouterr().out
