# The two commands: `make demo` and `make test`. Both set themselves up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pylon-installed
# System packages Pylon needs: libaio for DeepSpeed's NVMe offload (async I/O op); TCMalloc for CPU serving engines
# (pylon.serving.engine.heap preloads it into an engine process; Ubuntu 24.04 names it libtcmalloc-minimal4t64);
# Prometheus for `pylon cluster up --metrics`; Redis for `pylon cluster up --ha` (GCS fault tolerance). Pylon starts
# its own prometheus and redis-server processes, on loopback: the packages' own services are disabled where systemd
# started them (Debian's Prometheus listens on every interface without auth), and recommends are not installed.
SYSTEM_PACKAGES := libaio-dev libtcmalloc-minimal4 prometheus redis-server
# DeepSpeed builds its CPU ops (cpu_adam, shm comm, async I/O) once, here, and reuses them.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
# The venv's tools first, for every process: torch builds those ops with whichever `ninja` is on PATH, and the
# venv's (pip's ninja 1.13) and a system one (1.11) log commands differently, so each rebuilds from scratch
# what the other built. Ray's processes already get the venv's bin first (pylon.infra.local.up).
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup system-packages test test-all test-gpu offload-cap unit integration demo lint format clean help

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: system-packages $(STAMP)  ## create .venv and install pylon[dev] under constraints.txt

system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || dpkg -s $${p}t64 >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages: $$missing"; \
	    apt-get update -qq || true; \
	    for p in $$missing; do \
	      (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$p >/dev/null 2>&1 \
	       || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $${p}t64 >/dev/null 2>&1) \
	      || echo "warning: could not install $$p (libaio-dev: NVMe offload unavailable; libtcmalloc-minimal4: CPU engines use glibc's malloc; prometheus: no --metrics; redis-server: no --ha)"; \
	    done; \
	    if [ -d /run/systemd/system ]; then systemctl disable --now prometheus redis-server >/dev/null 2>&1 || true; fi; \
	  else echo "note: not root; install $$missing yourself (NVMe offload; TCMalloc for CPU serving; Prometheus; Redis)"; fi; \
	fi

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade -c constraints.txt pip setuptools wheel
	# torch first and on its own, so nothing resolves a CUDA build in its place.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@# DeepSpeed's CPU ops and the serving kernel, compiled once into TORCH_EXTENSIONS_DIR, side by side; else the
	@# first training job or replica compiles them (minutes here) and every other process waits on the lock.
	$(PY) -m pylon.ops || echo "warning: some ops did not build now; they are built on first use"
	@touch $@

test: setup  ## run the whole test suite: ruff, then unit tests alongside the integration tests (real cluster, S3 server)
	@mkdir -p .cache
	@$(VENV)/bin/ruff check --quiet . && $(VENV)/bin/ruff format --check --quiet . \
	  || { echo "ruff: run 'make format' (or fix what it names), then 'make test' again"; exit 1; }
	@# The integration tests spend much of their time waiting on Ray, jobs and replicas; the unit tests (no
	@# cluster) use that idle CPU instead of running before them: one torch thread each and a lower priority, so
	@# that they neither spin OpenMP threads against the cluster's processes nor hold up its timed waits (alone they
	@# take 10 minutes; with two threads beside the integration run, 25). Their output follows the integration run's,
	@# and a summary of both (failed tests by name, then the counts) ends the output, where CI's excerpt of it looks;
	@# an integration run killed or aborted before its own summary adds its log's end and Ray's fatal lines.
	@started=$$(date +%s); \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 5 $(PY) -m pytest tests/unit -p no:cacheprovider \
	  > .cache/unit-tests.log 2>&1 & unit=$$!; \
	$(PY) -m pytest tests/integration 2>&1 | tee .cache/integration-tests.log; integration=$${PIPESTATUS[0]}; \
	wait $$unit; unit=$$?; \
	echo "=== unit tests, run alongside (whole log: .cache/unit-tests.log) ==="; \
	if [ $$unit -ne 0 ]; then cat .cache/unit-tests.log; else tail -n 35 .cache/unit-tests.log; fi; \
	echo "=== summary (whole logs: .cache/integration-tests.log, .cache/unit-tests.log) ==="; \
	grep -hE '^(FAILED|ERROR) |^=+ .*(passed|failed|error).* =+$$' .cache/integration-tests.log .cache/unit-tests.log; \
	if [ $$integration -ne 0 ]; then $(PY) tests/crash_report.py .cache/integration-tests.log $$integration $$started; fi; \
	[ $$unit -eq 0 ] && [ $$integration -eq 0 ]

test-all: setup  ## the whole suite including the tests marked slow (what `make test` skips for CI's time limit)
	PYLON_ALL_TESTS=1 $(MAKE) --no-print-directory test

test-gpu: setup  ## on a CUDA GPU: the serving engine's tests (parity in fp32, bf16/fp16) and training's (ZeRO-2/3, bf16, fp16, offload, LoRA)
	PYLON_TEST_DEVICE=cuda $(PY) -m pytest tests/unit/serving/engine/test_serving_engine.py tests/unit/serving/engine/test_serving_engine_async.py tests/unit/serving/engine/test_serving_quant_engine.py tests/unit/serving/engine/test_sampling_penalties.py tests/unit/serving/engine/test_speculative.py tests/unit/serving/engine/test_speculative_draft.py tests/unit/serving/engine/test_structured_outputs.py tests/unit/serving/engine/test_vllm_extras.py tests/unit/serving/engine/test_load_weights.py
	PYLON_ALL_TESTS=1 PYLON_TEST_DEVICE=cuda $(PY) -m pytest tests/unit/serving/engine/test_model_families.py -k "moe or mixtral or gpt_oss or glm4 or deepseek or latent or llama4 or qwen3_next or recurrent or window"
	PYLON_TEST_DEVICE=cuda $(PY) -m pytest tests/unit/serving/engine/test_images.py
	PYLON_TEST_DEVICE=cuda $(PY) -m pytest -s tests/integration/test_train_gpu.py

offload-cap: setup  ## a 1B model trained by ZeRO-3 + NVMe offload on a local cluster in an 8 GiB cgroup (root; ~15 min)
	PYLON_ALL_TESTS=1 $(PY) -m pytest -s tests/integration/test_offload_memory_cap.py

unit: setup  ## fast tests only, no cluster
	$(PY) -m pytest tests/unit

integration: setup
	$(PY) -m pytest tests/integration

lint: setup  ## ruff: lint and check formatting (configured in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup  ## ruff: fix what it can and format the code
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: setup  ## run the end-to-end demo on the embedded local cluster
	$(VENV)/bin/pylon demo

clean:  ## remove the virtual environment
	rm -rf $(VENV)
