"""Prefill-decode disaggregation through Ray Serve (a deployment's `prefill`; pylon.serving.api.prefill): a long
prompt is computed on the prefill replica, its blocks travel through Ray's object store to the replica that took the
request over HTTP, which computes only the prompt's last partial block and decodes; transformers' tokens either way,
short prompts computed where they arrive, a chat's next turn sending only its new blocks, and a dead prefill replica
costing no request. (The same across two machines: test_hosts.py.)"""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request

import psutil
import pytest
import requests
from serving_models import greedy_text, tiny_llama

pytestmark = pytest.mark.integration

NEW = 12


def _text(seed: int, n: int) -> str:
    return "".join(chr(32 + (i * seed + seed) % 90) for i in range(n))


def _complete(url: str, prompt: str, n: int = 1) -> dict:
    body = {"model": "pd", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "n": n}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(text: str, name: str, **tags) -> float:
    """The sum of `name`'s samples in a Prometheus text whose tags include `tags`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{") and all(f'{k}="{v}"' in line for k, v in tags.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(ray_cluster) -> str:
    """The cluster's one node's metrics (from the first of its addresses that answers: each serves the same)."""
    hosts = {"127.0.0.1"} | {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == 2}
    for h in sorted(hosts):
        try:
            with urllib.request.urlopen(f"http://{h}:{ray_cluster.metrics_port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            pass
    return ""


def test_long_prompts_are_computed_on_the_prefill_replica_and_decoded_where_they_arrived(ray_cluster, tmp_path):
    from pylon.sdk.serve import delete, deploy
    from pylon.serving.api.ledger import report
    from pylon.specs import DeploymentSpec

    model = tiny_llama(tmp_path / "llama")
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "pd",
            "model": str(tmp_path / "llama"),
            "engine": {
                "max_num_seqs": 4,
                "max_num_batched_tokens": 256,
                "kv_cache_tokens": 2048,
                "block_size": 16,
                "max_model_len": 256,
                "device": "cpu",
            },
            "http": {"api_keys_env": None, "route_prefix": "/pd"},
            "replica": {"num_cpus": 0.5},
            # two prefill replicas at least (Serve's autoscaling keeps them), prompts routed by what they cache
            "prefill": {
                "autoscaling": {"min_replicas": 2, "max_replicas": 3},
                "min_prompt_tokens": 64,
                "timeout_s": 30,
                "replica": {"num_cpus": 0.25},
            },
        }
    )
    url = deploy(spec)
    try:
        prefills = [p for p in ray_cluster.processes() if "ServeReplica:pd:pd-prefill" in " ".join(p.cmdline())]
        assert len(prefills) == 2, prefills
        for prefill in prefills:  # each prefill replica's own engine process
            engines = [c for c in prefill.children() if "pylon.serving.engine.process" in " ".join(c.cmdline())]
            assert len(engines) == 1

        # A long prompt, never seen here before, reports its full blocks short of the last token as cached on its
        # first request: the prefill replica computed them. transformers' tokens.
        long = _text(37, 150)
        first = _complete(url, long)
        assert first["choices"][0]["text"] == greedy_text(model, long, NEW)
        assert _cached(first) == 144
        # Several at once, and one of two choices (one transfer for both)
        prompts = [_text(s, 100 + 20 * s) for s in (3, 5, 7)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: _complete(url, p), prompts))
        for p, a in zip(prompts, answers):
            assert a["choices"][0]["text"] == greedy_text(model, p, NEW)
            assert _cached(a) == (len(p) - 1) // 16 * 16
        two = _complete(url, _text(11, 120), n=2)
        assert [c["text"] for c in two["choices"]] == [greedy_text(model, _text(11, 120), NEW)] * 2
        # A short prompt is computed where it arrived (min_prompt_tokens 64)
        short = _complete(url, _text(13, 40))
        assert _cached(short) == 0 and short["choices"][0]["text"] == greedy_text(model, _text(13, 40), NEW)
        # A chat's next turn: the first turn, its answer and more; the replica holds the first turn's blocks, and
        # is sent the rest
        turn = long + first["choices"][0]["text"] + _text(17, 70)
        following = _complete(url, turn)
        assert following["choices"][0]["text"] == greedy_text(model, turn, NEW)
        assert _cached(following) == (len(turn) - 1) // 16 * 16
        # Conversations: each next turn goes to the prefill replica that computed its first (the decoding replica's
        # handle routes by the blocks each prefill replica caches), which computes only what it has not cached.
        conversations = []
        for seed in (23, 29, 31, 41):
            opening = _complete(url, _text(seed, 140))
            nxt = _text(seed, 140) + opening["choices"][0]["text"] + _text(seed + 1, 80)
            answer = _complete(url, nxt)
            assert answer["choices"][0]["text"] == greedy_text(model, nxt, NEW)
            conversations.append((opening, answer))

        # What the decoding replica computed of the prompts: their tails only (every prompt token not cached),
        # the prefill replica the rest; blocks sent and received alike; where each prompt was computed.
        answered = [first, *answers, short, following, *(a for c in conversations for a in c)]
        tails = sum(a["usage"]["prompt_tokens"] - _cached(a) for a in answered) + 2 * (120 - 112)  # (two's choices)
        # The prefill replicas computed every first prompt whole and each next turn past what its holder had cached
        # (its first turn's full blocks), nothing twice.
        firsts = [first, *answers, two, *(c[0] for c in conversations)]
        nexts = [(first, following), *conversations]
        expected = sum(a["usage"]["prompt_tokens"] for a in firsts) + sum(
            b["usage"]["prompt_tokens"] - a["usage"]["prompt_tokens"] // 16 * 16 for a, b in nexts
        )

        def counters(text: str) -> dict:
            return {
                "remote": _metric(text, "pylon_prefill_requests_total", model="pd", where="remote"),
                "routed": _metric(text, "pylon_prefill_routed_total", model="pd"),
                "on_prefill": _metric(text, "pylon_prefill_tokens_computed_total", model="pd", deployment="pd-prefill"),
                "computed": _metric(text, "pylon_prefill_tokens_computed_total", model="pd", deployment="pd"),
                "sent": _metric(text, "pylon_kv_transfer_sent_blocks_total", model="pd"),
                "received": _metric(text, "pylon_kv_transfer_received_blocks_total", model="pd"),
            }

        # (each replica's counters reach the node's metrics on their own schedule: wait until every one has)
        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline:
            text = _metrics(ray_cluster)
            c = counters(text)
            if (
                c["remote"] >= 14
                and c["routed"] >= 14
                and c["on_prefill"] >= expected
                and c["computed"] >= tails
                and c["sent"] >= c["received"] > 0
            ):
                break
            time.sleep(2)
        c = counters(text)
        assert c["remote"] == 14 and _metric(text, "pylon_prefill_requests_total", model="pd", where="local") == 1
        # Routed: the next turns (the conversations' and `following`) to the prefill replica holding their prefix;
        # the rest by load.
        assert _metric(text, "pylon_prefill_routed_total", model="pd", by="prefix") == 5
        assert _metric(text, "pylon_prefill_routed_total", model="pd", by="load") == 9
        assert c["on_prefill"] == expected, (c["on_prefill"], expected)
        assert c["computed"] == tails, (c["computed"], tails)
        assert c["sent"] == c["received"] > 0
        assert re.search(r"ray_pylon_prefill_remote_seconds_bucket\{[^}]*model=\"pd\"", text)
        # The deployment's ledger counts the prefill replica's hours, and its prompts apart
        deadline = time.monotonic() + 30
        while (ledger := report("pd")).get("prefill", {}).get("prompts", 0) < 14:
            assert time.monotonic() < deadline, ledger
            time.sleep(1)
        assert ledger["replicas"] == 1 and ledger["prefill"]["replicas"] == 2 and ledger["requests"] >= 15

        # A prefill replica dies: requests are still answered (computed here, or on the other, until Serve has
        # replaced it)
        prefills[0].kill()
        later = _text(19, 130)
        assert _complete(url, later)["choices"][0]["text"] == greedy_text(model, later, NEW)
    finally:
        delete("pd")


def _prefill_replicas(name: str) -> int:
    """The prefill replicas running (Serve's REST API, as `pylon serve status` reads it)."""
    from pylon.sdk.serve import serve_details

    app = serve_details()["applications"].get(name) or {}
    replicas = app.get("deployments", {}).get(f"{name}-prefill", {}).get("replicas", [])
    return sum(1 for r in replicas if r["state"] == "RUNNING")


@pytest.mark.slow
def test_prefill_replicas_are_added_while_prompts_wait_for_them_and_taken_away_when_they_stop(ray_cluster, tmp_path):
    """`prefill.autoscaling`: one prefill replica while there is little to compute, a second one while prompts
    queue at it (Serve's autoscaling on the prompts at each prefill replica), one again when they stop; every
    answer transformers' either way."""
    from pylon.sdk.serve import delete, deploy
    from pylon.specs import DeploymentSpec

    model = tiny_llama(tmp_path / "llama")
    spec = DeploymentSpec.model_validate(
        {
            "kind": "Deployment",
            "name": "pds",
            "model": str(tmp_path / "llama"),
            "engine": {
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "kv_cache_tokens": 4096,
                "block_size": 16,
                "max_model_len": 256,
                "device": "cpu",
            },
            "http": {"api_keys_env": None, "route_prefix": "/pds"},
            "replica": {"num_cpus": 0.5},
            "prefill": {
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 0,
                    "downscale_delay_s": 5,
                },
                "min_prompt_tokens": 64,
                "timeout_s": 60,
                "replica": {"num_cpus": 0.25},
            },
        }
    )
    url = deploy(spec)
    try:
        assert _prefill_replicas("pds") == 1
        stop, answers, errors = False, [], []

        def client(seed: int) -> None:
            n = 0
            while not stop:
                prompt = _text(seed + 100 * n, 240)
                body = {"model": "pds", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
                (answers if r.status_code == 200 else errors).append((prompt, r))
                n += 1

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            running = [pool.submit(client, seed) for seed in range(3, 11)]
            deadline, most = time.monotonic() + 120, 1
            while time.monotonic() < deadline and most < 2:
                time.sleep(1)
                most = max(most, _prefill_replicas("pds"))
            stop = True
            for f in running:
                f.result()
        assert most == 2, f"the prefill replicas stayed at one under {len(answers)} prompts"
        assert not errors, errors[0][1].text
        for prompt, r in answers[:3]:
            assert r.json()["choices"][0]["text"] == greedy_text(model, prompt, 1)
        deadline = time.monotonic() + 120
        while _prefill_replicas("pds") > 1:
            assert time.monotonic() < deadline, "the second prefill replica was not taken away once idle"
            time.sleep(2)
    finally:
        delete("pds")
