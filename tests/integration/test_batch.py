"""Offline batch inference end to end on the session's Ray cluster: a BatchJob submitted through the SDK as a Ray job,
its lines answered by a Ray Data actor pool of two engines, its answers in the S3-protocol server; the greedy
completions are transformers' own; a part's answers removed and the job submitted again, only that part is answered
again; another batch at the same output is refused naming what differs (tests/unit/serving/api/test_batch.py checks
the answers against a replica's over HTTP)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from serving_models import greedy_text, tiny_llama

import pylon
from pylon import storage

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _pool_actors():
    """The pids of the batch pool's actor processes (PartAnswerer's) seen while the block runs, polled."""
    import threading

    import psutil

    seen: set[int] = set()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for p in psutil.process_iter(["cmdline"]):
                if "PartAnswerer" in " ".join(p.info["cmdline"] or []):
                    seen.add(p.pid)
            done.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def test_a_batch_job_answers_every_line_and_goes_on_from_its_parts(ray_cluster, s3_root, tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "model", layers=2)
    prompts = [f"request {i}: " for i in range(9)]
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 48, "min_tokens": 48, "temperature": 0},
        }
        for i, p in enumerate(prompts)
    ]
    lines.insert(5, "{not json")
    lines.append({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "old"}]})
    (tmp_path / "requests.jsonl").write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    )
    spec = {
        "name": "answers",
        "model": str(tmp_path / "model"),
        "input": str(tmp_path / "requests.jsonl"),
        "output": f"{s3_root}/answers",
        "body": {"max_tokens": 4, "temperature": 0, "ignore_eos": True},
        "replicas": 2,
        "chunk_lines": 2,
        "replica": {"num_cpus": 0.5},
        "engine": {"device": "cpu", "dtype": "fp32", "max_num_seqs": 4, "kv_cache_tokens": 2048, "max_model_len": 256},
    }
    client = pylon.connect()
    with _pool_actors() as actors:
        job = client.batch(spec)
        assert job.wait(timeout=600) == "SUCCEEDED", job.logs()
    # The pool's two actors, each starting an engine. (Which of them answers which part is Ray Data's: under load the
    # first engine up may answer all six before the second is, so the answers' engines are not counted.)
    assert len(actors) == 2, actors
    manifest = job.manifest()
    assert manifest["state"] == "done" and manifest["parts"] == 6 and manifest["lines"] == 11
    assert manifest["counts"] == {
        "lines": 11,
        "answered": 10,
        "failed": 1,
        "tokens_in": manifest["counts"]["tokens_in"],
        "tokens_out": 9 * 48 + 4,
    }
    results = list(job.results())
    assert [r["custom_id"] for r in results] == [*(f"c{i}" for i in range(9)), "requests.jsonl:11"]
    for i, prompt in enumerate(prompts):
        assert results[i]["response"]["body"]["choices"][0]["text"] == greedy_text(model, prompt, 48)
    engines = {r["response"]["request_id"].split("-")[1] for r in results}  # batch-<pid>-<n>
    assert 1 <= len(engines) <= 2, engines
    (error,) = job.errors()
    assert error["error"]["line"] == "requests.jsonl:6" and "not JSON" in error["error"]["message"]
    assert "10 answered, 1 failed" in job.logs()

    kept = {
        n: storage.read_text(storage.join(spec["output"], "results", n))
        for n in ("part-00000.jsonl", "part-00002.jsonl")
    }
    storage.remove(storage.join(spec["output"], "results", "part-00001.jsonl"))  # as if stopped before it committed
    again = client.batch(spec)
    assert again.wait(timeout=600) == "SUCCEEDED", again.logs()
    manifest = again.manifest()
    assert [r["parts"] for r in manifest["runs"]] == [6, 1]  # only the missing part answered again
    assert manifest["runs"][1]["counts"]["lines"] == 2 and manifest["counts"]["lines"] == 11
    assert "5 part(s) answered by an earlier submission" in again.logs()
    for name, text in kept.items():  # the parts already committed are untouched
        assert storage.read_text(storage.join(spec["output"], "results", name)) == text
    redone = list(again.results())
    assert [r["custom_id"] for r in redone] == [r["custom_id"] for r in results]
    assert [r["response"]["body"]["choices"] for r in redone] == [r["response"]["body"]["choices"] for r in results]

    other = client.batch({**spec, "body": {"max_tokens": 5}})
    assert other.wait(timeout=600, check=False) == "FAILED"
    assert "holds the answers of another batch (it differs in body)" in other.logs()


def test_an_engine_killed_mid_job_is_restarted_and_every_line_answered(ray_cluster, s3_root, tmp_path: Path) -> None:
    """The engine process of the job's one engine SIGKILLed once its first part is committed, while it decodes: its
    actor exits with it, Ray Data restarts the actor and hands it the parts it held again, and the job ends with every
    line answered."""
    import time

    import psutil
    from faults import kill

    tiny_llama(tmp_path / "model", layers=2)
    lines = [{"prompt": f"line {i}: "} for i in range(64)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = {
        "name": "killed",
        "model": str(tmp_path / "model"),
        "input": str(tmp_path / "prompts.jsonl"),
        "output": f"{s3_root}/killed",
        "body": {"max_tokens": 200, "min_tokens": 200, "temperature": 0},
        "chunk_lines": 8,
        "replica": {"num_cpus": 0.5},
        "engine": {"device": "cpu", "dtype": "fp32", "max_num_seqs": 8, "kv_cache_tokens": 4096, "max_model_len": 256},
    }
    job = pylon.connect().batch(spec)
    first = storage.join(spec["output"], "results", "part-00000.jsonl")
    deadline = time.monotonic() + 300
    while not storage.exists(first):
        assert time.monotonic() < deadline and job.status() in ("PENDING", "RUNNING"), job.logs()
        time.sleep(0.2)

    def engines() -> list[int]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if "pylon.serving.engine.process" in " ".join(p.info["cmdline"] or []):
                parent = p.parent()
                if parent is not None and "PartAnswerer" in " ".join(parent.cmdline()):
                    found.append(p.pid)
        return found

    (victim,) = engines()
    # killed while it answers a part's lines (its process busy), not in the moment between the parts it was handed and
    # the next ones, when it holds none
    results = storage.join(spec["output"], "results")
    process = psutil.Process(victim)
    while True:
        assert len(storage.listdir(results)) < 8, "every part was answered before the engine could be killed"
        before = process.cpu_times()
        time.sleep(0.3)
        after = process.cpu_times()
        if (after.user + after.system) - (before.user + before.system) > 0.05:
            break
        assert time.monotonic() < deadline, job.logs()
    kill(victim)
    assert job.wait(timeout=600) == "SUCCEEDED", job.logs()
    counts = job.manifest()["counts"]
    assert (counts["lines"], counts["answered"], counts["failed"]) == (64, 64, 0)
    assert counts["tokens_out"] == 64 * 200
    # the parts it held when it died, each answered again (its actor's log line saying so may not reach the job's log:
    # the process exits right after it)
    attempts = storage.join(spec["output"], "attempts")
    held = storage.listdir(attempts)
    assert held and all(storage.read_json(storage.join(attempts, name)) == {"attempts": 1} for name in held)
    assert sorted(r["custom_id"] for r in job.results()) == sorted(f"prompts.jsonl:{i}" for i in range(1, 65))
