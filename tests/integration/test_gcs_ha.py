"""A head that survives (`pylon cluster up --ha`): the GCS is SIGKILLed while a deployment serves and a TrainJob
trains, on a cluster of the test's own. Serving goes on (each request answered, with at most the one retry
docs/many-machines.md allows a client), the supervisor starts the GCS again, it recovers the cluster from Redis
(the same head node, ALIVE), and the job finishes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

import pylon
from pylon.infra import ha
from pylon.infra import local as cluster

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])
KEYS_ENV = "PYLON_HA_TEST_KEYS"
API_KEY = "sk-pylon-ha-test-0c41"
STEPS = 400  # ~0.1 s each here: the job trains for a while after the kill
RETRYABLE = (502, 503, 504)  # and connection errors: the documented client retry (once)


def _tiny_model(directory: Path) -> Path:
    """A random 2-layer GPT-2 saved as a Pylon export (byte tokenizer), as tests/integration/test_serving.py's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2",
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=256,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return directory


def _deployment(model_dir: Path):
    from pylon.specs import DeploymentSpec

    return DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "ha-tiny",
            "model": str(model_dir),
            "engine": {
                "max_num_seqs": 4,
                "max_num_batched_tokens": 256,
                "kv_cache_tokens": 1024,
                "block_size": 16,
                "max_model_len": 128,
                "device": "cpu",
            },
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "http": {"api_keys_env": KEYS_ENV, "max_queued_requests": 16, "request_timeout_s": 60},
            "replica": {"num_cpus": 0.5},
        }
    )


def _train_spec(corpus: str, runs: Path) -> dict:
    return {
        "name": "ha-train",
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "batch": {"micro_batch_size": 4},
        "steps": STEPS,
        "checkpoint": {"storage": str(runs), "every_steps": 200, "keep_last": 1},
    }


class Client(threading.Thread):
    """Sends completions one after another until stopped; a request that meets a connection error or a 502/503/504
    is sent once more after 0.5 s (the retry rule of docs/many-machines.md). Records (start, status, tries)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.results = url, threading.Event(), []

    def run(self) -> None:
        body = {"model": "ha-tiny", "prompt": "def main(", "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        while not self.stop.is_set():
            started, status, tries = time.time(), None, 0
            for tries in (1, 2):
                try:
                    r = requests.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=60)
                    status = r.status_code
                    if status == 200:
                        assert r.json()["choices"][0]["text"] is not None
                except requests.ConnectionError as e:
                    status = f"connection error: {e}"[:200]
                if status not in RETRYABLE and not isinstance(status, str):
                    break
                time.sleep(0.5)
            self.results.append((started, status, tries))
            time.sleep(0.05)


def _last_step(logs: str) -> int:
    """The last training step the job logged (`{"step": N, ...}` lines, after Ray's worker prefix: steps 1-4, then
    every 10th)."""
    return max((int(m) for m in re.findall(r'\{"step": (\d+)', logs)), default=0)


def _gcs(processes: list[psutil.Process]) -> psutil.Process | None:
    return next((p for p in processes if p.name() == "gcs_server"), None)


# A cluster, a deployment and a training job of its own: ~3 min on an idle 2-core machine, 5 beside other
# clusters; `make test-all`.
@pytest.mark.slow
def test_gcs_killed_mid_serve_and_mid_train_serving_goes_on_and_the_job_finishes(tmp_path, monkeypatch):
    if shutil.which(ha.REDIS_PACKAGE) is None:
        pytest.skip(f"GCS fault tolerance needs Redis: install the `{ha.REDIS_PACKAGE}` package (make system-packages)")
    from pylon.data.prepare import prepare
    from pylon.sdk.serve import deploy

    home = tmp_path / "home"
    monkeypatch.setenv("PYLON_HOME", str(home))
    monkeypatch.setenv(KEYS_ENV, API_KEY)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)

    src = tmp_path / "src"
    src.mkdir()
    for name in ("argparse.py", "textwrap.py"):
        shutil.copy(STDLIB / name, src / name)
    corpus = str(tmp_path / "corpus")
    prepare([str(src)], corpus, seq_len=64, use_ray=False, progress=False)
    model_dir = _tiny_model(tmp_path / "model")

    t0 = time.monotonic()
    # Free ports of its own: beside the session's cluster (and others on the machine), Ray's usual ones may be taken.
    info, started = cluster.up(
        num_cpus=3,
        object_store_memory=256 * 2**20,
        port=cluster._free_port(),
        dashboard_port=cluster._free_port(),
        home=home,
        ha=True,
    )
    assert started
    record = ha.read_record(home)
    redis_pid = record.redis_pid
    try:
        password = Path(record.password_file).read_text().strip()
        assert os.stat(record.password_file).st_mode & 0o777 == 0o600
        assert record.redis_address.startswith("127.0.0.1:")
        assert password not in (home / ha.HA_FILE).read_text() + (home / "cluster.json").read_text()
        assert ha.redis_ping("127.0.0.1", int(record.redis_address.rsplit(":", 1)[1]), "wrong") is not None

        print(f"up: {time.monotonic() - t0:.0f}s")
        # Serve's port too (up takes 8000 when free then, and other clusters on this machine may take it since).
        info.serve_port = cluster._free_port()
        cluster._write_state(home, info)
        url = deploy(_deployment(model_dir))
        print(f"deployed: {time.monotonic() - t0:.0f}s")
        client = pylon.connect()
        run = client.train(_train_spec(corpus, tmp_path / "runs"), export=False)
        # Kill once the job trains: it logs its first steps' records.
        deadline = time.monotonic() + 300
        while _last_step(run.logs()) < 2:
            assert run.status() in ("PENDING", "RUNNING"), run.logs()[-3000:]
            assert time.monotonic() < deadline, "the job did not start training within 300 s: " + run.logs()[-3000:]
            time.sleep(0.5)

        print(f"training: {time.monotonic() - t0:.0f}s")
        sender = Client(url)
        sender.start()
        time.sleep(2)
        old = _gcs(info.processes())
        head_id = cluster._gcs_query("nodes", info.gcs_address, Path(info.token_path))["nodes"][0]["node_id"]
        steps_at_kill, status_at_kill = _last_step(run.logs()), run.status()
        killed_at = time.time()
        os.kill(old.pid, signal.SIGKILL)

        deadline = time.monotonic() + 30
        while (new := _gcs(info.processes())) is None or new.pid == old.pid:
            assert time.monotonic() < deadline, (
                "the supervisor did not start the GCS again: " + (home / ha.SUPERVISOR_LOG).read_text()
            )
            time.sleep(0.2)
        nodes = cluster._gcs_query("nodes", info.gcs_address, Path(info.token_path))
        assert [(n["node_id"], n["state"]) for n in nodes["nodes"]] == [(head_id, "ALIVE")], nodes
        back_at = time.time()
        time.sleep(5)  # serve on for a while with the new GCS
        sender.stop.set()
        sender.join(70)

        during = [r for r in sender.results if killed_at - 1 <= r[0] <= back_at + 1]
        failed = [r for r in sender.results if r[1] != 200]
        assert len(sender.results) >= 10 and during, sender.results
        assert not failed, f"requests not answered (after one retry): {failed}"
        assert ha.gcs_restarts(home) == 1
        assert steps_at_kill < STEPS and status_at_kill == "RUNNING", "the job ended before the GCS was killed"

        retried = sum(1 for r in sender.results if r[2] == 2)
        print(
            f"GCS back: {time.monotonic() - t0:.0f}s, {len(sender.results)} requests ({len(during)} during the gap, "
            f"{retried} retried once)"
        )
        assert run.wait(timeout=240) == "SUCCEEDED", run.logs()[-6000:]
        print(f"job done: {time.monotonic() - t0:.0f}s")
        assert list(run.metrics()["step"])[-1] == STEPS
        # Serving still answers, and the state API works against the new GCS.
        r = requests.post(
            f"{url}/v1/completions",
            json={"model": "ha-tiny", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        status = client.status()
        assert [n.state for n in status.nodes] == ["ALIVE"]

        # The password appears in no record or log Pylon or Ray wrote (only in its 0600 files).
        for root in (home, Path(info.temp_dir) / "session_latest" / "logs"):
            for path in root.rglob("*"):
                if path.is_file() and path.name not in (ha.PASSWORD_FILE, ha.REDIS_CONF):
                    assert password.encode() not in path.read_bytes(), path
    finally:
        # Ray's logs (the GCS's: every start appends to them) outlive `down`, which removes the temp dir, for a failure.
        shutil.copytree(Path(info.temp_dir) / "session_latest" / "logs", tmp_path / "ray-logs", dirs_exist_ok=True)
        cluster.down(home=home)
    assert not psutil.pid_exists(redis_pid) or psutil.Process(redis_pid).status() == psutil.STATUS_ZOMBIE
    assert not (home / ha.HA_FILE).exists() and not (home / ha.PASSWORD_FILE).exists()
