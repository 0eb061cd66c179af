#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (docs/training.md, "On a GPU"; issue 36), in two
# calls made back to back (the machine keeps /tmp/site between calls only while it stays warm):
#
#   1. carrying .whl-b:  bash scripts/gpu_check.sh speed   # DeepSpeed's ops, bench/train_step.py --device cuda
#   2. carrying .whl-a:  bash scripts/gpu_check.sh train   # the training test, bench/plan_accuracy.py --device
#                                                           # cuda and the serving engine's GPU tests, side by side
#   3. (time left) carrying .whl-b:  bash scripts/gpu_check.sh serve   # issue 37's GPU figures:
#                                     # bench/serve_features.py --device cuda --only quantization (int8, fp8 vs bf16)
#
# The wheels come from scripts/device_wheels.py (run here first): .whl-a holds Ray, .whl-b DeepSpeed, pydantic,
# transformers and the rest; scripts/device_setup.sh installs what a call carries into /tmp/site. The first call
# needs no Ray (the bench is processes of its own); the second adds Ray and runs what goes through a cluster. What
# runs side by side measures per process (memory), never time; the speed bench has the GPU to itself.
# On an H200 (set 51, docs/benchmarks) `speed` took 228 s and `train` 311 s of command time, about 10 of the lease's 15
# minutes with the machine's start: the rest is room for one rerun of a part.
# Logs and JSON results go to $OUT (what comes back from the device; .cache/gpu-check elsewhere), under 8 files a
# call. On a machine with network and this repo's .venv, `make test-gpu` runs the same tests.
set -u
part=${1:-}
OUT=${OUT:-.cache/gpu-check}
mkdir -p "$OUT"
started=$(date +%s)
failed=0
say() { echo "[gpu_check +$(($(date +%s) - started))s] $*"; }

case "$part" in
speed) check="deepspeed pydantic transformers peft pylon pylon.jobs.train" ;;
serve) check="pydantic transformers llguidance pylon pylon.serving" ;;
train) check="" ;; # device_setup.sh's default: Ray, its dashboard and Ray Train too
*)
    echo "usage: bash scripts/gpu_check.sh speed|train|serve (see the top of this file)" >&2
    exit 2
    ;;
esac
say "setup ($part)"
if ! CHECK=${check:-} bash scripts/device_setup.sh >"$OUT/setup.log" 2>&1; then
    tail -40 "$OUT/setup.log"
    exit 2
fi
# shellcheck disable=SC1091
source "${SITE:-/tmp/site}/env.sh"
export PYLON_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
PY=${PYLON_PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY - <<'EOF'
import importlib
import torch
found = []
for name in ("deepspeed", "transformers", "ray"):
    try:
        found.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        found.append(f"{name} (not installed yet)")
print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__} (CUDA {torch.version.cuda}); " + ", ".join(found))
EOF
} >>"$OUT/setup.log" 2>&1
tail -2 "$OUT/setup.log"

if [ "$part" = serve ]; then
    say "quantized weights on the GPU: int8 and fp8 against bf16 (tokens/s, bytes, held-out likelihood)"
    timeout "${SERVE_LIMIT:-300}" $PY bench/serve_features.py --device cuda --only quantization --rounds 2 \
        >"$OUT/serve_features.log" 2>&1
    code=$?
    echo "serve_features exit $code"
    [ $code -eq 0 ] || failed=1
    grep -v "Loading weights" "$OUT/serve_features.log" | tail -20
elif [ "$part" = speed ]; then
    # DeepSpeed's ops build (nvcc and g++, CPU only) beside the bench, to fit the 15-minute lease: the bench's GPU
    # work is what it times, and it waits on the same lock for the fused Adam it needs.
    say "DeepSpeed's ops: fused Adam (GPU), CPU Adam (offload), async I/O where libaio is; built beside the bench"
    timeout 240 $PY -m pylon.ops --nvme >"$OUT/ops.log" 2>&1 &
    ops=$!
    say "training step speed and MFU"
    timeout "${SPEED_LIMIT:-300}" $PY bench/train_step.py --device cuda --json "$OUT/train_step.json" \
        >"$OUT/train_step.log" 2>&1
    code=$?
    wait $ops
    echo "ops exit $?"
    tail -7 "$OUT/ops.log"
    echo "train_step exit $code"
    [ $code -eq 0 ] || failed=1
    tail -45 "$OUT/train_step.log"
else
    say "the training test, the planner's memory, the serving engine's tests and activation offload, side by side"
    timeout 480 $PY -m pytest -s -p no:cacheprovider tests/integration/test_train_gpu.py >"$OUT/train.log" 2>&1 &
    train=$!
    timeout 420 $PY -m pytest -q -p no:cacheprovider tests/unit/serving/engine/test_serving_engine.py \
        tests/unit/serving/engine/test_serving_engine_async.py tests/unit/serving/engine/test_serving_quant_engine.py \
        tests/unit/serving/engine/test_sampling_penalties.py tests/unit/serving/engine/test_speculative.py \
        tests/unit/serving/engine/test_speculative_draft.py tests/unit/serving/engine/test_structured_outputs.py \
        tests/unit/serving/engine/test_load_weights.py tests/unit/jobs/test_activation_offload.py >"$OUT/serve.log" 2>&1 &
    serve=$!
    timeout 420 $PY bench/plan_accuracy.py --device cuda --json "$OUT/plan_accuracy.json" >"$OUT/plan_accuracy.log" 2>&1
    code=$?
    echo "plan_accuracy exit $code (its ratios are figures to record, not a pass or fail)"
    wait $train
    code=$?
    echo "training test exit $code"
    [ $code -eq 0 ] || failed=1
    wait $serve
    code=$?
    echo "serving tests exit $code"
    [ $code -eq 0 ] || failed=1
    tail -30 "$OUT/plan_accuracy.log"
    tail -25 "$OUT/train.log"
    tail -6 "$OUT/serve.log"
fi
say "done"
exit "$failed"
