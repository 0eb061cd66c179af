"""The layout promises of docs/architecture.md: one distribution, four import roots, and no shadowed stdlib."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pylon

REPO = Path(__file__).resolve().parents[2]


def test_import_platform_from_repo_root_is_the_stdlib():
    # `python -m`, `serve run` and Ray working_dirs put the repository root on sys.path.
    out = subprocess.run(
        [sys.executable, "-c", "import platform, pylon; print(platform.system()); print(platform.__file__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[0] == "Linux"
    assert Path(out[1]).resolve().parent == Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_no_package_named_platform_at_the_root():
    assert not (REPO / "platform" / "__init__.py").exists()


def test_subpackages_map_to_their_folders():
    import pylon.data
    import pylon.jobs
    import pylon.serving

    assert Path(pylon.__file__).parent == REPO / "platform" / "pylon"
    assert Path(pylon.data.__file__).parent == REPO / "data"
    assert Path(pylon.jobs.__file__).parent == REPO / "jobs"
    assert Path(pylon.serving.__file__).parent == REPO / "serving"


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "pylon"
    assert script.exists()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("validate", "cluster", "demo"):
        assert command in out.stdout


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_installed_distribution():
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_canonical(name)] = version.strip()
    assert pins["torch"] == "2.13.0"
    unpinned, drifted = [], []
    # Only what pip installed into this environment: Ray puts its vendored thirdparty_files on sys.path.
    site_packages = sysconfig.get_paths()["purelib"]
    for dist in importlib.metadata.distributions(path=[site_packages]):
        name = _canonical(dist.metadata["Name"])
        if name == "pylon":
            continue
        version = dist.version.split("+")[0]  # torch's "+cpu" local label
        if name not in pins:
            unpinned.append(f"{name}=={version}")
        elif pins[name] != version:
            drifted.append(f"{name}: installed {version}, pinned {pins[name]}")
    assert not unpinned, f"installed but not in constraints.txt: {unpinned}"
    assert not drifted, f"installed versions differ from constraints.txt: {drifted}"


def test_version_is_exposed():
    assert pylon.__version__ == importlib.metadata.version("pylon")
