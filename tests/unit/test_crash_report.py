"""`make test`'s report on an integration run that died before pytest's summary (tests/crash_report.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location("crash_report", Path(__file__).resolve().parents[1] / "crash_report.py")
crash_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crash_report)

CHECK = (
    "[2026-11-25 13:07:22,790 C 4140 7407] task_manager.cc:1329:  An unexpected system state has occurred. "
    "You have likely discovered a bug in Ray. Check failed: it != submissible_tasks_.end() Tried to complete "
    "task that was not pending 03470be5\n"
)


def _cluster(base: Path, temp: Path, lines: str) -> None:
    home = base / "pytest-7" / "pylon-home0"
    home.mkdir(parents=True)
    (home / "cluster.json").write_text(json.dumps({"temp_dir": str(temp)}))
    logs = temp / "session_1" / "logs"
    logs.mkdir(parents=True)
    (temp / "session_latest").symlink_to(temp / "session_1")
    (logs / "python-core-driver-01_4140.log").write_text("[...] I all is well\n" + lines)
    (logs / "raylet.out").write_text("[...] I all is well\n")


def test_an_aborted_run_gets_its_log_end_and_rays_fatal_lines(tmp_path, capsys):
    _cluster(tmp_path / "base", tmp_path / "ray", CHECK)
    log = tmp_path / "integration.log"
    log.write_text("tests/integration/test_prepare_s3_ray.py ...\n")
    crash_report.main(str(log), 134, time.time() - 60, base=str(tmp_path / "base"))
    out = capsys.readouterr().out
    assert "without pytest's summary (signal SIGABRT)" in out
    assert "test_prepare_s3_ray.py ..." in out
    assert "python-core-driver-01_4140.log" in out and "raylet.out" not in out
    assert "[2026-11-25 13:07:22,790 C 4140 7407] ta ... Check failed: it != submissible_tasks_.end() Tried" in out


def test_a_run_that_reported_prints_nothing_more(tmp_path, capsys):
    _cluster(tmp_path / "base", tmp_path / "ray", CHECK)
    log = tmp_path / "integration.log"
    log.write_text("FAILED tests/x.py::y\n========= 1 failed, 3 passed in 12.50s =========\n")
    crash_report.main(str(log), 1, time.time() - 60, base=str(tmp_path / "base"))
    assert capsys.readouterr().out == ""


def test_logs_older_than_the_run_are_left_out(tmp_path, capsys):
    _cluster(tmp_path / "base", tmp_path / "ray", CHECK)
    old = time.time() - 3600
    for path in (tmp_path / "ray" / "session_1" / "logs").iterdir():
        os.utime(path, (old, old))
    log = tmp_path / "integration.log"
    log.write_text("tests/x.py ..\n")
    crash_report.main(str(log), 137, time.time() - 60, base=str(tmp_path / "base"))
    out = capsys.readouterr().out
    assert "(signal SIGKILL)" in out and "Check failed" not in out
