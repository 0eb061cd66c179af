"""Evaluation against a live deployment: `pylon eval` through the tiny deployment of test_serving.py and through its
model directory agree on the held-out split of a small prepared dataset, and match the trainer's `token_loss_sum`
computed directly with transformers; lm-evaluation-harness's `local-completions` runs a local multiple-choice task
against the deployment, with nothing reached beyond loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
from pathlib import Path

import numpy as np
import pytest
import test_serving
from test_serving import API_KEY, KEYS_ENV

pytestmark = pytest.mark.integration

# test_serving.py's fixtures: the tiny model (byte tokenizer) and its deployment "tiny" with API keys.
tiny = test_serving.tiny
served = test_serving.served

REPO = Path(__file__).resolve().parents[2]
FRACTION = 0.25
SEQ_LEN = 64  # within the tiny deployment's max_model_len (192)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """Text prepared with the byte tokenizer, without Ray: 33 rows of 64 tokens, the last one padded; the
    held-out split is the last 8 rows."""
    from pylon.data.prepare import prepare

    src = tmp_path_factory.mktemp("eval-text")
    (src / "code.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(60)))
    out = str(tmp_path_factory.mktemp("eval-data") / "ds")
    manifest = prepare([str(src)], out, seq_len=SEQ_LEN, tokenizer="byte", use_ray=False, progress=False)
    assert manifest.totals.rows > 8 and manifest.totals.tokens % SEQ_LEN != 0  # a padded row at the end
    return out


def _direct_loss(model, uri: str) -> tuple[float, int]:
    """The trainer's loss on the held-out rows, with transformers, read straight from the shards."""
    import torch

    from pylon import storage
    from pylon.data.reader import split_ids
    from pylon.data.shards import decode_shard, read_manifest
    from pylon.jobs.train import token_loss_sum

    manifest = read_manifest(uri)
    lo, hi = split_ids(manifest, FRACTION)["validation"]
    tokens, lengths = [], []
    for info in manifest.shards:
        rows = decode_shard(
            manifest.format,
            storage.read_bytes(storage.join(uri, info.file)),
            shard=info.file,
            seq_len=manifest.seq_len,
            dtype=manifest.dtype,
        )
        keep = (rows.ids >= lo) & (rows.ids < hi)
        tokens.append(rows.tokens[keep].astype(np.int64))
        lengths.append(rows.num_tokens[keep])
    ids = torch.from_numpy(np.concatenate(tokens))
    mask = torch.arange(SEQ_LEN)[None, :] < torch.from_numpy(np.concatenate(lengths).astype(np.int64))[:, None]
    assert len(ids) == hi - lo and not bool(mask.all())  # the padded row is held out
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long()).logits
    loss_sum, n = token_loss_sum(logits, ids.masked_fill(~mask, -100))
    return float(loss_sum) / n, n


def _pylon_eval(capsys, *argv: str) -> tuple[int, dict | None, str]:
    from pylon.cli import main

    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


def test_pylon_eval_through_the_deployment_and_the_model_directory_agree(served, tiny, dataset, capsys, monkeypatch):
    direct, tokens = _direct_loss(tiny.model, dataset)
    common = ["--data", dataset, "--validation-fraction", str(FRACTION), "--json"]

    monkeypatch.setenv(KEYS_ENV, f"{API_KEY},another")
    rc, remote, err = _pylon_eval(capsys, served, "--api-key-env", KEYS_ENV, *common)
    assert rc == 0, err
    rc, local, err = _pylon_eval(capsys, str(tiny.dir), *common)
    assert rc == 0, err

    assert (remote["source"], remote["served_model"], local["source"]) == ("endpoint", "tiny", "model")
    assert remote["tokens"] == local["tokens"] == tokens and remote["sequences"] == local["sequences"] == 8
    assert abs(remote["loss"] - local["loss"]) < 1e-3, (remote["loss"], local["loss"])
    assert abs(local["loss"] - direct) < 1e-4 and abs(remote["loss"] - direct) < 1e-3, (remote, local, direct)
    with capsys.disabled():
        print(
            f"held-out loss: endpoint {remote['loss']:.6f}, model {local['loss']:.6f}, direct {direct:.6f} ({tokens} tokens)"
        )

    monkeypatch.delenv(KEYS_ENV)  # no key: the server's 401, and what to do about it
    rc, _, err = _pylon_eval(capsys, served, "--api-key-env", KEYS_ENV, *common)
    assert rc == 1 and "HTTP 401" in err and f"set {KEYS_ENV}" in err, err


@pytest.fixture
def loopback_only(monkeypatch):
    """Every socket connection of this process must go to a loopback address (no hub, no download)."""
    connect = socket.socket.connect
    refused = []

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                refused.append(address)
                raise OSError(f"test: connection to {address} refused (loopback only)")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yield refused
    assert not refused, f"connections beyond loopback: {refused}"


@pytest.mark.slow  # make test-all: ~0.5 min
def test_lm_eval_local_completions_on_a_local_multiple_choice_task(served, tiny, tmp_path, monkeypatch, loopback_only):
    import requests

    from pylon.sdk.lm_eval import completions_model, hf_tokenizer_dir, import_lm_eval

    lm_eval = import_lm_eval()  # lm-eval 0.4.9 under transformers 5
    from lm_eval.tasks import TaskManager

    sent = []  # every completions request lm-eval makes, and the answer's status
    post = requests.post

    def counting(url, *args, **kwargs):
        response = post(url, *args, **kwargs)
        if url.endswith("/v1/completions"):
            sent.append((kwargs.get("json"), response.status_code, response.text[:300]))
        return response

    monkeypatch.setattr(requests, "post", counting)
    monkeypatch.chdir(REPO)  # the task's data_files is relative to the repository root, as docs/eval.md runs it
    tokenizer = hf_tokenizer_dir(str(tiny.dir), str(tmp_path / "tokenizer"))

    def evaluate(**kwargs) -> dict:
        """lm-eval's task run through `pylon-completions` (`kwargs`: the model's), every request answered 200."""
        lm = completions_model(served, tokenizer=tokenizer, api_key=API_KEY, max_retries=1, **kwargs)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=["pylon_mc"],
            task_manager=TaskManager(include_path=str(REPO / "examples" / "lm_eval")),
            log_samples=True,
        )
        failed = [(body, status, text) for body, status, text in sent if status != 200]
        assert not failed, f"the server refused {len(failed)} of {len(sent)} requests; the first: {failed[0]}"
        return results

    results = evaluate()
    docs = [json.loads(line) for line in (REPO / "examples/lm_eval/pylon_mc.jsonl").read_text().splitlines()]
    expected = sum(len(d["choices"]) for d in docs)
    samples = results["samples"]["pylon_mc"]
    assert len(samples) == len(docs)
    assert sum(len(s["resps"]) for s in samples) == expected == len(sent)
    prompts = [b["prompt"][0] if isinstance(b["prompt"][0], list) else b["prompt"] for b, _, _ in sent]
    assert all(b["echo"] is True for b, _, _ in sent) and all(isinstance(p[0], int) for p in prompts), sent[0][0]
    acc = results["results"]["pylon_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0

    # batch_size: several prompts per request (a batch of prompts), the same log-likelihoods
    unbatched, first = len(sent), sent[0][0]
    sent.clear()
    again = evaluate(batch_size=8)
    assert len(sent) == -(-expected // 8) and max(len(b["prompt"]) for b, _, _ in sent) == 8
    assert _floats([s["resps"] for s in again["samples"]["pylon_mc"]]) == pytest.approx(
        _floats([s["resps"] for s in samples]), abs=1e-4
    )
    print(
        f"lm-eval pylon_mc: acc {acc:.3f} over {len(docs)} documents, {unbatched} requests (batch_size 8: "
        f"{len(sent)}); the first: {first}"
    )


def _floats(value) -> list[float]:
    """Every number in nested lists and tuples, in order (lm-eval's responses: log-likelihood, is-greedy)."""
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _floats(item)]
    return [float(value)]


@pytest.mark.slow  # a second process importing lm-eval and transformers: ~20 s more
def test_lm_eval_command_line_with_pylon_completions(served, tiny, tmp_path):
    """The command docs/eval.md gives, as a user runs it (offline, from the repository root)."""
    import os
    import subprocess
    import sys

    from pylon.sdk.lm_eval import hf_tokenizer_dir

    tokenizer = hf_tokenizer_dir(str(tiny.dir), str(tmp_path / "tokenizer"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", KEYS_ENV: API_KEY}
    args = f"base_url={served},tokenizer={tokenizer},api_key_env={KEYS_ENV}"
    done = subprocess.run(
        [sys.executable, "-m", "pylon.sdk.lm_eval", "--model", "pylon-completions", "--model_args", args]
        + ["--include_path", "examples/lm_eval", "--tasks", "pylon_mc", "--limit", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pylon_mc" in done.stdout and "acc" in done.stdout, done.stdout[-2000:]
