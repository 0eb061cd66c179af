"""Serving end to end on the session's Ray cluster: a tiny model deployed with `pylon.sdk.serve.deploy` on
Ray Serve, spoken to over real HTTP by the official `openai` client and by raw HTTP; greedy parity with
`transformers`, bad input, auth, backpressure, disconnects, block leaks, metrics and autoscaling."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requests
from serving_models import greedy_completion, greedy_text, tiny_adapter, tiny_llama

pytestmark = pytest.mark.integration

API_KEY = "sk-pylon-test-7f3a91"
SECOND_KEY = "sk-pylon-test-other"
KEYS_ENV = "PYLON_TEST_API_KEYS"
MAX_NUM_SEQS = 8
MAX_QUEUED = 16
MAX_MODEL_LEN = 192
ADAPTER = "tiny-shout"  # the `served` deployment's LoRA adapter (engine.adapters)
ON_DEMAND = "shout-on-demand"  # the same adapter at its root of adapters loaded on demand (engine.dynamic_adapters)


class TinyModel:
    """A random GPT-2 saved as a Pylon export (byte tokenizer); `transformers`' greedy continuations."""

    def __init__(self, directory: Path):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from pylon.data.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        # initializer_range 0.5: continuations that depend on the context (see test_serving_engine.py).
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
            initializer_range=0.5,
        )
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.model.save_pretrained(directory)
        (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
        self.dir, self.tok = directory, tok
        # A LoRA adapter of it in peft's format (engine.adapters), random and large enough to change the tokens.
        from peft import LoraConfig, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False)
        self.adapted = get_peft_model(base, lora).eval()
        with torch.no_grad():
            for name, p in self.adapted.named_parameters():
                if "lora_B" in name:
                    p.mul_(20)
        self.adapter_dir = directory.parent / f"{directory.name}-adapter"
        self.adapted.save_pretrained(self.adapter_dir)
        self.adapter_root = directory.parent / f"{directory.name}-adapters"
        self.adapted.save_pretrained(self.adapter_root / ON_DEMAND)

    def greedy_text(self, prompt: str, new_tokens: int, *, adapted: bool = False) -> tuple[str, list[int]]:
        """transformers' greedy continuation of `prompt`; `adapted`: with the LoRA adapter (peft's model)."""
        import torch

        ids = torch.tensor([list(prompt.encode())])
        out = (self.adapted if adapted else self.model).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=257,
        )
        new = out[0, ids.shape[1] :].tolist()
        return self.tok.decode(new), new


def _spec(name: str, model_dir: Path, **over):
    from pylon.specs import DeploymentSpec

    spec = {
        "kind": "Deployment",
        "name": name,
        "model": str(model_dir),
        "engine": {
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": 256,
            "kv_cache_tokens": 2048,
            "block_size": 16,
            "max_model_len": MAX_MODEL_LEN,
            "device": "cpu",
        },
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "http": {"api_keys_env": KEYS_ENV, "max_queued_requests": MAX_QUEUED, "request_timeout_s": 60},
        "replica": {"num_cpus": 0.5},
    }
    spec.update(over)
    return DeploymentSpec.model_validate(spec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return TinyModel(tmp_path_factory.mktemp("tiny-model"))


def _served_spec(tiny: TinyModel, s3_server):
    """The `served` deployment: the tiny model with its LoRA adapter (engine.adapters), and the same adapter under
    another name at a root of adapters loaded on demand (engine.dynamic_adapters); its Responses API keeps responses
    in the object store (http.responses_store), and its Files and Batch APIs there too (http.batch_store)."""
    base = _spec("tiny", tiny.dir)
    engine = base.engine.model_dump(mode="json")
    adapters = [{"name": ADAPTER, "path": str(tiny.adapter_dir)}]
    dynamic = {"root": str(tiny.adapter_root), "max_loaded": 1}
    http = {
        **base.http.model_dump(mode="json"),
        "responses_store": _responses_store(s3_server),
        "batch_store": f"s3://{s3_server.bucket}/served-batches",
    }
    return _spec("tiny", tiny.dir, engine={**engine, "adapters": adapters, "dynamic_adapters": dynamic}, http=http)


def _responses_store(s3_server) -> str:
    """Where the `served` deployment keeps its Responses API responses: a prefix of the S3 server's bucket."""
    return f"s3://{s3_server.bucket}/served-responses"


@pytest.fixture(scope="module")
def served(ray_cluster, tiny, s3_server):
    from pylon.sdk.serve import delete, deploy

    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEYS_ENV, f"{API_KEY},{SECOND_KEY}")
        url = deploy(_served_spec(tiny, s3_server))
    yield url
    delete("tiny")


def _auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _replica_processes(cluster, marker: str) -> list:
    """The cluster's Serve replica processes whose command line holds `marker` ("ServeReplica:<deployment>")."""
    return [p for p in cluster.processes() if marker in " ".join(p.cmdline())]


def _engine_processes(replica) -> list:
    """A replica process's engine processes (engine.separate_process)."""
    return [c for c in replica.children() if "pylon.serving.engine.process" in " ".join(c.cmdline())]


def _replaced(cluster, url: str, marker: str, dead, what: str) -> list:
    """The cluster's processes marked `marker` other than `dead` once Serve has replaced `what` and /ready answers
    200 (within 180 s)."""
    deadline = time.monotonic() + 180
    while True:
        fresh = [p for p in _replica_processes(cluster, marker) if p.pid != dead.pid]
        if fresh and requests.get(f"{url}/ready", timeout=30).status_code == 200:
            return fresh
        assert time.monotonic() < deadline, f"Serve did not replace {what}"
        time.sleep(1)


def _ready(url: str) -> dict:
    return requests.get(f"{url}/ready", timeout=10).json()


def test_a_batch_through_serve_keeps_its_files_in_object_storage(served, tiny, s3_server, tmp_path):
    """OpenAI's Files and Batch APIs through Serve, the store on the S3 server: the official client uploads a file of
    requests, creates a batch, polls it to its end and reads its output file; greedy answers are transformers' own."""
    from pylon import storage

    client = _openai(served)
    prompts = [f"batch line {i}: " for i in range(6)]
    lines = [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        for i, p in enumerate(prompts)
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 6 and batch.error_file_id is None
    answers = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [a["response"]["body"]["choices"][0]["text"] for a in answers] == [
        tiny.greedy_text(p, 8)[0] for p in prompts
    ]
    (owner,) = storage.listdir(f"s3://{s3_server.bucket}/served-batches")  # one key's, in the object store
    kept = storage.listdir(f"s3://{s3_server.bucket}/served-batches/{owner}/files")
    assert f"{uploaded.id}.jsonl" in kept and f"{batch.output_file_id}.jsonl" in kept


def test_openai_client_completions_and_chat_streamed_and_not(served, tiny, s3_server):
    client = _openai(served)
    assert [(m.id, m.parent) for m in client.models.list().data] == [("tiny", None), (ADAPTER, "tiny")]

    prompt = "def fibonacci(n):\n    "
    expected, _ = tiny.greedy_text(prompt, 12)
    done = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        len(prompt.encode()),
        12,
        len(prompt.encode()) + 12,
    )

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())

    messages = [{"role": "user", "content": "Write a loop."}]
    chat_prompt = "user: Write a loop.\nassistant: "  # the default template of a model without one
    expected_chat, _ = tiny.greedy_text(chat_prompt, 10)
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_prompt.encode()), 10)

    stream = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_chat
    assert stream[-1].usage.completion_tokens == 10 and stream[-1].usage.total_tokens == len(chat_prompt.encode()) + 10

    # The Responses API on the same conversation (through Serve, HAProxy and the router's key of its input): the
    # chat's greedy text, up to the model's end of text (the Responses API has no ignore_eos), streamed as typed events.
    reply = client.responses.create(model="tiny", input="Write a loop.", max_output_tokens=10, temperature=0)
    assert reply.object == "response" and reply.output_text and expected_chat.startswith(reply.output_text)
    assert reply.usage.input_tokens == len(chat_prompt.encode()) and reply.usage.output_tokens <= 10
    events = list(
        client.responses.create(model="tiny", input="Write a loop.", max_output_tokens=10, temperature=0, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    # Kept in the object store (http.responses_store on the S3 server) and continued by id through Serve: the reply
    # to the whole conversation sent at once, token for token.
    assert reply.store is True and client.responses.retrieve(reply.id).output_text == reply.output_text
    turn = {"model": "tiny", "max_output_tokens": 10, "temperature": 0}
    follow = client.responses.create(previous_response_id=reply.id, input="Another.", **turn)
    whole = [{"role": "user", "content": "Write a loop."}, *reply.output, {"role": "user", "content": "Another."}]
    sent = client.responses.create(input=whole, store=False, **turn)
    assert (follow.output_text, follow.usage.input_tokens) == (sent.output_text, sent.usage.input_tokens)
    from pylon import storage

    owners = storage.listdir(_responses_store(s3_server))
    kept = storage.listdir(f"{_responses_store(s3_server)}/{owners[0]}")
    assert len(owners) == 1 and {f"{reply.id}.json", f"{follow.id}.json"} <= set(kept) and API_KEY not in owners[0]

    # n choices and logit_bias through Serve and the engine's own process: greedy choices are all transformers'
    three = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, n=3, extra_body={"ignore_eos": True}
    )
    assert [(c.index, c.text) for c in three.choices] == [(0, expected), (1, expected), (2, expected)]
    assert three.usage.completion_tokens == 36
    forced = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == "AAAAA"


def test_a_lora_adapter_answers_as_peft_beside_the_base_model(served, tiny):
    """engine.adapters through Serve, HAProxy, the router and the engine's own process: requests naming the adapter
    and the base model at once, each token for token what peft's (or transformers') greedy decoding gives, streamed
    and not, and the adapter's name in the answers. The same adapter loaded on demand by another name from the
    deployment's root (engine.dynamic_adapters) answers the same; a name with no adapter there is a 404."""
    import openai

    client = _openai(served)
    prompts = [f"adapter test {i}: " + "xyz" * i for i in range(6)]
    jobs = [(p, model) for p in prompts for model in ("tiny", ADAPTER, ON_DEMAND)]
    expected = {(p, m): tiny.greedy_text(p, 12, adapted=m != "tiny")[0] for p, m in jobs}
    assert all(expected[p, "tiny"] != expected[p, ADAPTER] for p in prompts)

    def complete(job):
        prompt, model = job
        done = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert done.model == model
        return done.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        assert dict(zip(jobs, pool.map(complete, jobs))) == expected
    chunks = list(
        client.chat.completions.create(
            model=ADAPTER,
            messages=[{"role": "user", "content": "Write a loop."}],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.model for c in chunks} == {ADAPTER}
    want, _ = tiny.greedy_text("user: Write a loop.\nassistant: ", 10, adapted=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with pytest.raises(openai.NotFoundError, match=r"model 'not-there' does not exist: .*not-there .*no adapter"):
        client.completions.create(model="not-there", prompt="hi", max_tokens=1)
    assert [m.id for m in client.models.list().data] == ["tiny", ADAPTER, ON_DEMAND]


def test_embeddings_through_serve_are_the_models_last_hidden_states(served, tiny):
    """POST /v1/embeddings through Serve, HAProxy and the engine process, for the base model and its adapter, with the
    official client (base64): each input's last-token final hidden state, L2-normalised, as transformers and peft
    compute it."""
    client = _openai(served)
    texts = ["embed me", "and me, a little longer"]

    def want(model, text: str):
        import torch

        body = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's: adapters in place
        with torch.no_grad():
            out = body.base_model(torch.tensor([list(text.encode())])).last_hidden_state[0, -1]
        return out / out.norm()

    for name, model in (("tiny", tiny.model), (ADAPTER, tiny.adapted)):
        got = client.embeddings.create(model=name, input=texts)
        assert got.model == name and got.usage.prompt_tokens == sum(len(t.encode()) for t in texts)
        for d, text in zip(got.data, texts):
            assert (want(model, text) - want(model, text).new_tensor(d.embedding)).abs().max() < 1e-5, (name, text)


def test_raw_sse_ends_with_done_and_carries_a_request_id(served):
    with requests.post(
        f"{served}/v1/completions",
        headers={**_auth(), "X-Request-Id": "my-trace-42"},
        stream=True,
        json={"model": "tiny", "prompt": "x = ", "max_tokens": 5, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "my-trace-42"
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    r = requests.post(
        f"{served}/v1/completions",
        headers=_auth(SECOND_KEY),
        timeout=60,
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
    )
    assert r.status_code == 200 and len(r.headers["x-request-id"]) >= 8  # one is made up when none is sent


def test_http_goes_through_haproxy_straight_to_the_replica(served, ray_cluster):
    """The local cluster runs Serve's HAProxy ingress (pylon.infra.local.SERVE_INGRESS_ENV): the URL that answers is
    HAProxy's, its files are under the cluster's temp dir, and it sends requests to the replica itself."""
    procs = ray_cluster.processes()
    haproxy = [p for p in procs if p.name() == "haproxy"]
    assert haproxy, "no haproxy process in the cluster"
    port = int(served.rsplit(":", 1)[1])
    listening = {c.laddr.port for p in haproxy for c in p.net_connections(kind="tcp") if c.status == "LISTEN"}
    assert port in listening
    config = Path(haproxy[0].cmdline()[haproxy[0].cmdline().index("-f") + 1])
    assert config.is_relative_to(ray_cluster.temp_dir)
    # HAProxy sends requests to the replica's own HTTP server; Serve's Python proxy is only the backup.
    servers = [line.split() for line in config.read_text().splitlines() if line.strip().startswith("server ")]
    assert [s for s in servers if s[1].startswith("SERVE_REPLICA") and "backup" not in s]
    assert all("backup" in s for s in servers if s[1].startswith("SERVE_PROXY"))
    assert requests.get(f"{served}/health", timeout=30).status_code == 200


def test_a_cpu_replica_and_its_engine_process_run_sched_batch(served, ray_cluster):
    """On a CPU every thread of the replica and of its engine process is on SCHED_BATCH (pylon.serving.engine.sched_batch):
    their wakeups do not preempt an engine mid-step."""
    replicas = _replica_processes(ray_cluster, "ServeReplica:tiny")
    assert replicas, "no replica process of 'tiny' in the cluster"
    for replica in replicas:
        engines = _engine_processes(replica)
        assert len(engines) == 1, f"replica {replica.pid}: engine processes {engines}"
        for proc in (replica, engines[0]):
            policies = {os.sched_getscheduler(t.id) for t in proc.threads()}
            assert policies == {os.SCHED_BATCH}, (proc.pid, " ".join(proc.cmdline())[:80], policies)


def test_concurrent_greedy_requests_match_transformers(served, tiny):
    """20 concurrent requests of mixed lengths (more than max_num_seqs = 8) through HTTP."""
    import random

    rng = random.Random(3)
    text = Path(__file__).read_text()
    prompts = []
    for _ in range(20):
        start, n = rng.randrange(0, 2000), rng.randrange(3, 80)
        prompts.append(text[start : start + n])
    expected = [tiny.greedy_text(p, 16)[0] for p in prompts]

    def complete(prompt: str) -> str:
        return greedy_completion(served, "tiny", prompt, 16, headers=_auth())

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        got = list(pool.map(complete, prompts))
    assert got == expected


def test_a_long_prefix_sent_twice_is_reused_and_scores_the_same_as_transformers(served, tiny):
    """Prompt log-probabilities through HTTP (echo, logprobs, max_tokens 0) of a held-out text of 150 tokens: the
    model's own log-softmax within 1e-4; sent again, 144 of its tokens come from the prefix cache
    (usage.prompt_tokens_details.cached_tokens), and its log-probabilities are the first answer's."""
    import torch

    text = "".join(chr(32 + (i * 37) % 90) for i in range(150))  # in no test file: no earlier request sent it
    ids = list(text.encode())

    def score() -> dict:
        body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
        r = requests.post(f"{served}/v1/completions", headers=_auth(), json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first, again = score(), score()
    with torch.no_grad():
        logits = tiny.model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    lp = first["choices"][0]["logprobs"]
    assert first["choices"][0]["text"] == text and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    # A dict by token text (OpenAI's legacy shape): the two most likely and the prompt's own token; alternatives that
    # decode to the same text (two bytes of one character both "\ufffd") are one key.
    tops = lp["top_logprobs"][1:]
    assert all(1 <= len(top) <= 3 for top in tops) and any(len(top) == 3 for top in tops)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # the full blocks short of the last token
    lp_again = again["choices"][0]["logprobs"]
    assert lp_again["token_logprobs"][:145] == lp["token_logprobs"][:145]  # kept beside the cached blocks
    assert lp_again["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert lp_again["tokens"] == lp["tokens"] and lp_again["text_offset"] == lp["text_offset"]


# ~65 s; tests/unit/serving/api checks an engine pool spreads requests and matches one engine, and make test's
# replicas here run an engine process each. `make test-all`.
@pytest.mark.slow
def test_one_replica_with_two_engine_processes_spreads_requests_and_matches_transformers(ray_cluster, tiny, served):
    """engine.data_parallel: 2 engine processes behind one replica (the layout for a CPU node); 12 concurrent greedy
    requests through HTTP, both engines working, outputs token for token transformers' own; then one engine killed:
    the other serves on until Serve replaces the replica."""
    import psutil

    from pylon.sdk.serve import delete, deploy

    spec = _spec("tiny-dp", tiny.dir).model_dump(mode="json")
    spec["engine"]["data_parallel"] = 2
    spec["http"].update(api_keys_env=None, route_prefix="/dp")
    url = deploy(_spec("tiny-dp", tiny.dir, engine=spec["engine"], http=spec["http"]))
    try:
        replicas = _replica_processes(ray_cluster, "ServeReplica:tiny-dp")
        assert len(replicas) == 1, replicas
        engines = _engine_processes(replicas[0])
        assert len(engines) == 2, engines
        before = [sum(e.cpu_times()[:2]) for e in engines]
        prompts = [f"request number {i}: " + "abc" * i for i in range(12)]
        expected = [tiny.greedy_text(p, 16)[0] for p in prompts]

        def complete(prompt: str) -> str:
            return greedy_completion(url, "tiny-dp", prompt, 16)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            assert list(pool.map(complete, prompts)) == expected
        used = [sum(e.cpu_times()[:2]) - b for e, b in zip(engines, before)]
        assert min(used) > 0.3 * max(used), f"engine CPU-s during the burst: {used} (one engine did the work)"
        ready = requests.get(f"{url}/ready", timeout=30).json()
        assert ready["ready"] and ready["running"] == 0 and ready["waiting"] == 0, ready

        # One engine dies (the OOM killer, a segfault): the replica says so on /ready, the live engine serves every
        # request meanwhile (none sent to the dead one), and Serve's health check replaces the replica.
        engines[0].kill()
        deadline = time.monotonic() + 10
        while requests.get(f"{url}/ready", timeout=30).status_code != 503:
            assert time.monotonic() < deadline, "/ready did not report the dead engine"
            time.sleep(0.1)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(complete, prompts[:6])) == expected[:6]
        fresh = _replaced(ray_cluster, url, "ServeReplica:tiny-dp", replicas[0], "the replica with the dead engine")
        new_engines = _engine_processes(fresh[0])
        assert len(new_engines) == 2, new_engines
        assert complete(prompts[0]) == expected[0]
        engines += new_engines
    finally:
        delete("tiny-dp")
    _, alive = psutil.wait_procs(engines, timeout=30)  # no engine outlives its replica
    assert not alive, alive


# ~90 s (a replica replaced); make test keeps the two-machine deployment in test_hosts.py. `make test-all`.
@pytest.mark.slow
def test_a_model_in_two_pipeline_stages_answers_as_transformers(ray_cluster, served, tmp_path_factory):
    """engine.pipeline_parallel 2: the replica's engine process holds layers 0-1 and the embeddings, a StageWorker
    actor (a process of its own, in the replica's placement group) layers 2-3, the norm and the lm_head; 8 concurrent
    greedy requests through HTTP are token for token transformers' own, the steps' time on the replica's metrics
    (the second stage's computing, the hops). The stage killed: a request fails with an
    error body, and Serve replaces the replica, a new stage with it. Deleting the deployment ends the stage too."""
    import psutil

    from pylon.sdk.serve import delete, deploy

    directory = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(directory)
    base = _spec("tiny-pp", directory)
    engine = {**base.engine.model_dump(mode="json"), "pipeline_parallel": 2, "pipeline_placement": "pack"}
    http = {**base.http.model_dump(mode="json"), "api_keys_env": None, "route_prefix": "/pp"}
    url = deploy(_spec("tiny-pp", directory, engine=engine, http=http, replica={"num_cpus": 0.25}))
    try:
        replicas = _replica_processes(ray_cluster, "ServeReplica:tiny-pp")
        assert len(replicas) == 1, replicas
        engines = _engine_processes(replicas[0])
        stages = _replica_processes(ray_cluster, "StageWorker")
        assert len(engines) == 1 and len(stages) == 1, (engines, stages)
        assert stages[0].pid not in {replicas[0].pid, engines[0].pid}
        prompts = [f"stage request {i}: " + "xyz" * i for i in range(8)]
        expected = [greedy_text(model, p, 12) for p in prompts]

        def complete(prompt: str) -> str:
            return greedy_completion(url, "tiny-pp", prompt, 12)

        before = sum(stages[0].cpu_times()[:2])
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, prompts)) == expected
        assert sum(stages[0].cpu_times()[:2]) > before  # the second stage computed its layers
        # where the steps' time went, on the replica's metrics: the second stage's computing, and the hops
        totals, deadline = {}, time.monotonic() + 60
        names = ("pylon_pipeline_steps_total", "pylon_pipeline_stage_seconds_total", "pylon_pipeline_hop_seconds_total")
        while time.monotonic() < deadline and len(totals) < len(names):
            for line in "\n".join(_get(u) for u in _metrics_urls(ray_cluster)).splitlines():
                for name in names:
                    if line.startswith(f"ray_{name}") and 'model="tiny-pp"' in line and float(line.split()[-1]) > 0:
                        totals[name] = float(line.split()[-1])
            time.sleep(2)
        assert len(totals) == len(names), totals

        # The second stage's process dies (its node lost, the OOM killer): the engine's next step fails, /ready says
        # so, and Serve replaces the replica with its placement group, a new stage in it.
        stages[0].kill()
        r = requests.post(
            f"{url}/v1/completions", timeout=120, json={"model": "tiny-pp", "prompt": prompts[0], "max_tokens": 4}
        )
        assert r.status_code >= 500 and "error" in r.json(), r.text
        fresh = _replaced(ray_cluster, url, "StageWorker", stages[0], "the replica whose stage died")
        assert complete(prompts[1]) == expected[1]
        stages += fresh
    finally:
        delete("tiny-pp")
    _, alive = psutil.wait_procs(stages, timeout=60)  # no stage outlives its replica
    assert not alive, alive


# ~60 s (a replica replaced); tests/unit/serving/engine/test_tensor_shards.py checks the shards' arithmetic.
# `make test-all`.
@pytest.mark.slow
def test_a_model_in_two_tensor_parallel_shards_answers_as_transformers(ray_cluster, served, tmp_path_factory):
    """engine.tensor_parallel 2: the replica's engine process holds half of every layer's heads and MLP, a ShardWorker
    actor (a process of its own, in the replica's placement group, on its node) the other half; 8 concurrent greedy
    requests through HTTP are token for token transformers' own, both shards computing every step; a LoRA adapter of
    the spec and the same loaded on demand (each shard applying its slice of the matrices) give peft's tokens beside
    the base model's. The shard killed: the next request fails at once with an error body naming the shard, and Serve
    replaces the replica, a new shard with it. Deleting the deployment ends the shard too."""
    import psutil

    from pylon.sdk.serve import delete, deploy

    directory = tmp_path_factory.mktemp("tiny-llama-tp")
    model = tiny_llama(directory / "model")
    adapted = tiny_adapter(directory / "model", directory / "lora", ("q_proj", "k_proj", "o_proj", "down_proj"))
    shutil.copytree(directory / "lora", directory / "adapters" / "tp-demand")  # (the on-demand root's)
    base = _spec("tiny-tp", directory / "model")
    engine = {
        **base.engine.model_dump(mode="json"),
        "tensor_parallel": 2,
        "adapters": [{"name": "tp-lora", "path": str(directory / "lora")}],
        "dynamic_adapters": {"root": str(directory / "adapters")},
    }
    http = {**base.http.model_dump(mode="json"), "api_keys_env": None, "route_prefix": "/tp"}
    url = deploy(_spec("tiny-tp", directory / "model", engine=engine, http=http, replica={"num_cpus": 0.25}))
    try:
        replicas = _replica_processes(ray_cluster, "ServeReplica:tiny-tp")
        assert len(replicas) == 1, replicas
        engines = _engine_processes(replicas[0])
        shards = _replica_processes(ray_cluster, "ShardWorker")
        assert len(engines) == 1 and len(shards) == 1, (engines, shards)
        prompts = [f"shard request {i}: " + "xyz" * i for i in range(8)]
        expected = [greedy_text(model, p, 12) for p in prompts]

        def complete(prompt: str) -> str:
            return greedy_completion(url, "tiny-tp", prompt, 12)

        before = sum(shards[0].cpu_times()[:2])
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, prompts)) == expected
        assert sum(shards[0].cpu_times()[:2]) > before  # the second shard computed its half
        names = ["tp-lora", "tiny-tp", "tp-demand"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            lora, plain, demand = pool.map(lambda m: greedy_completion(url, m, prompts[0], 12), names)
        assert lora == demand == greedy_text(adapted, prompts[0], 12) != plain == expected[0]

        shards[0].kill()
        r = requests.post(
            f"{url}/v1/completions", timeout=120, json={"model": "tiny-tp", "prompt": prompts[0], "max_tokens": 4}
        )
        assert r.status_code >= 500 and "error" in r.json(), r.text
        fresh = _replaced(ray_cluster, url, "ShardWorker", shards[0], "the replica whose shard died")
        assert complete(prompts[1]) == expected[1]
        shards += fresh
    finally:
        delete("tiny-tp")
    _, alive = psutil.wait_procs(shards, timeout=60)  # no shard outlives its replica
    assert not alive, alive


# ~50 s of a second deployment; tests/unit/serving/api/test_routing.py checks the router's policy and key against
# real engines' block hashes. `make test-all`.
@pytest.mark.slow
def test_requests_that_share_a_prefix_go_to_the_replica_that_caches_it(ray_cluster, tiny, served, tmp_path):
    """Two replicas behind HAProxy and Pylon's router (pylon.serving.api.routing). Each of 8 prompts sent cold, then
    again with other endings: every follow-up finds its prefix cached (`cached_tokens`), both while the router knows
    where it sent the first (at once) and once only the replicas' reports of their cache say so (after
    RECENT_S). Responses continued by id go back to the replica that made the response (its id names it), where the
    conversation is cached. Then 12 long requests on one prefix at once: the replica holding it takes what fits its
    sequence slots and the other replica the rest, computing the prefix itself. Balancing by load alone sends about
    half of the follow-ups to the replica without the prefix."""
    import random

    from pylon.sdk.serve import delete, deploy
    from pylon.serving.api.routing import RECENT_S

    spec = _spec(
        "tiny-route",
        tiny.dir,
        autoscaling={"min_replicas": 2, "max_replicas": 2},
        http={
            "api_keys_env": None,
            "max_queued_requests": 64,
            "request_timeout_s": 120,
            "route_prefix": "/route",
            "responses_store": str(tmp_path / "responses"),
            "batch_store": str(tmp_path / "batches"),
        },
        replica={"num_cpus": 0.25},
    )
    url = deploy(spec)
    try:
        assert _replicas(ray_cluster, "tiny-route") == 2
        assert _replicas(ray_cluster, "tiny-route", "tiny-route-router") == 1
        rng = random.Random(0)
        prefixes = ["".join(rng.choice("abcdefghij klmnop") for _ in range(96)) for _ in range(8)]  # 6 blocks

        def send(prompt: str, max_tokens: int = 4) -> tuple[int, str]:
            r = requests.post(
                f"{url}/v1/completions",
                timeout=120,
                json={"model": "tiny-route", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers.get("X-Pylon-Route", "")

        # HAProxy takes up the router once Serve's controller has pushed it the router's address, within seconds of
        # the deployment being ready (while the previous HAProxy process drains, some requests still skip it); until
        # then it balances by load, and responses carry no X-Pylon-Route.
        deadline, in_a_row = time.monotonic() + 60, 0
        while in_a_row < 10:
            assert time.monotonic() < deadline, "HAProxy does not ask the router"
            in_a_row = in_a_row + 1 if send("x", 1)[1] else 0
        assert [send(p + " first") for p in prefixes] == [(0, "load")] * 8
        # Routed right after the first: the router remembers where it sent each prefix.
        assert [send(p + " second question") for p in prefixes] == [(96, "prefix:6")] * 8
        time.sleep(RECENT_S + 2)  # that memory is gone; the replicas' reports of their caches remain
        assert [send(p + " third, longer question") for p in prefixes] == [(96, "prefix:6")] * 8

        # A conversation continued by previous_response_id: the router cannot read the stored conversation (it has no
        # API key to read it by), but the id names the replica that made it, which holds its blocks.
        for p in prefixes[:4]:
            first = requests.post(
                f"{url}/v1/responses",
                timeout=120,
                json={"model": "tiny-route", "input": p + " fourth", "max_output_tokens": 4, "temperature": 0},
            )
            assert first.status_code == 200, first.text
            follow = requests.post(
                f"{url}/v1/responses",
                timeout=120,
                json={
                    "model": "tiny-route",
                    "previous_response_id": first.json()["id"],
                    "input": "and then?",
                    "max_output_tokens": 4,
                    "temperature": 0,
                },
            )
            assert follow.status_code == 200, follow.text
            assert follow.headers.get("X-Pylon-Route") == "response", follow.headers
            assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 96, follow.json()["usage"]

        # The holder is busy: past its 8 sequence slots, the other replica takes requests (and computes the prefix).
        hot = prefixes[0][:64]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda i: send(f"{hot} #{i:02d}", max_tokens=100), range(12)))
        assert sum(1 for c, _ in got if c == 64) >= MAX_NUM_SEQS, got  # a full batch to the holder, from its cache
        assert any(route == "load" for _, route in got), got  # then the holder was busy: the other replica
        assert 0 in [c for c, _ in got], got  # which computed the prefix itself

        # The router's own HTTP port (on Serve's http.host: loopback here, the node's address on a cluster of several
        # machines) answers only HAProxy's key, an HMAC of the cluster token.
        import psutil

        from pylon.infra.haproxy import ROUTER_KEY_HEADER, router_key

        (proc,) = _replica_processes(ray_cluster, "ServeReplica:tiny-route:tiny-route-router")
        ports = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections("tcp")
            if c.pid == proc.pid and c.status == psutil.CONN_LISTEN
        }
        key = router_key(Path(ray_cluster.token_path).read_text().strip())
        answers = {}
        for ip, port in ports:
            base = f"http://{ip if ip not in ('0.0.0.0', '::') else '127.0.0.1'}:{port}"
            try:
                answers[port] = (
                    requests.get(f"{base}/health", timeout=5).status_code,
                    requests.post(f"{base}/internal/route", json={"prompt": "x"}, timeout=5).status_code,
                    requests.get(f"{base}/health", headers={ROUTER_KEY_HEADER: key}, timeout=5).status_code,
                )
            except requests.RequestException:
                pass  # gRPC
        assert answers and all(a == (401, 401, 200) for a in answers.values()), (answers, ports)

        # OpenAI's Batch API across the two replicas: a batch created on one, polled through HAProxy (either replica
        # answers from the shared store) until the one answering it ends it; its output file read the same way.
        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny-route", "prompt": f"routed batch {i}", "max_tokens": 4, "ignore_eos": True},
            }
            for i in range(8)
        ]
        uploaded = requests.post(
            f"{url}/v1/files",
            files={"file": ("b.jsonl", "".join(json.dumps(x) + "\n" for x in lines)), "purpose": (None, "batch")},
            timeout=60,
        ).json()
        batch = requests.post(
            f"{url}/v1/batches",
            json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
            timeout=60,
        ).json()
        deadline = time.monotonic() + 120
        while batch["status"] not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            r = requests.get(f"{url}/v1/batches/{batch['id']}", timeout=60)
            assert r.status_code == 200, r.text  # from either replica: never a 404
            batch = r.json()
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 8, batch
        output = requests.get(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=60)
        assert [json.loads(x)["custom_id"] for x in output.text.splitlines()] == [f"r{i}" for i in range(8)]
    finally:
        delete("tiny-route")


BAD = [
    ("invalid json", b'{"model": "tiny", "prompt": ', 400, "body"),
    ("not an object", b'["tiny"]', 400, "body"),
    ("wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type temperature", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("unknown field", {"model": "tiny", "prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
    ("missing prompt", {"model": "tiny"}, 400, "prompt"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("empty prompt", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("prompt past the context", {"model": "tiny", "prompt": "y" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
    ("max_tokens zero", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens past the context", {"model": "tiny", "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("n past its bound", {"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
    ("top_p out of range", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("token id out of vocab", {"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("an empty prompt in a batch", {"model": "tiny", "prompt": ["a", ""]}, 400, "prompt.1"),
]


@pytest.mark.parametrize("case,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_an_error_body(served, case, body, status, param):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    r = requests.post(
        f"{served}/v1/completions", headers={**_auth(), "Content-Type": "application/json"}, timeout=30, **kwargs
    )
    assert r.status_code == status, (case, r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error
    assert r.headers["x-request-id"]


def test_bad_chat_and_paths_and_the_server_still_answers(served):
    for body in (
        {"model": "tiny", "messages": []},
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ):
        r = requests.post(f"{served}/v1/chat/completions", headers=_auth(), json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(("messages", "top_logprobs")), r.text
    r = requests.get(f"{served}/v1/nothing-here", headers=_auth(), timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = requests.post(
        f"{served}/v1/completions",
        headers=_auth(),
        timeout=60,
        json={"model": "tiny", "prompt": "still here", "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_api_keys_are_required_and_never_logged(served, ray_cluster):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        r = requests.post(f"{served}/v1/completions", headers=headers, json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
    assert requests.get(f"{served}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{served}/health", timeout=30).status_code == 200  # probes need no key
    # No key in any log, event or config Ray keeps for the session.
    leaked = []
    for path in Path(ray_cluster.temp_dir).rglob("*"):
        if path.is_file() and path.stat().st_size < 50 * 2**20:
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if API_KEY.encode() in data or SECOND_KEY.encode() in data:
                leaked.append(str(path))
    assert not leaked


def test_disconnect_mid_stream_aborts_and_nothing_leaks(served):
    """A client that goes away mid-stream frees its engine slot within seconds (the abort reaches the engine at
    once; 5 s leaves room for a loaded CI machine); after 1,000 requests, some of them abandoned mid-stream, every KV
    block is back in the pool."""
    import socket

    def abandon() -> None:
        """Send a long stream and go away after its first chunk of text, before its end. A stream can end before
        that: a replica stalled on a loaded machine merges every step queued since its last tick into one chunk (the
        whole completion, then [DONE]); that try did not test a disconnect, so it is made again."""
        body = json.dumps(
            {"model": "tiny", "prompt": "while True:", "max_tokens": 150, "stream": True, "ignore_eos": True}
        ).encode()
        host, port = served.split("//")[1].split("/")[0].split(":")
        ended = []
        for _ in range(10):
            with socket.create_connection((host, int(port)), timeout=120) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                received = b""
                # Until a whole first event (an HTTP chunk ends after its blank line), or the stream's end.
                while b"data: [DONE]" not in received and not (
                    b"data: " in received and received.endswith(b"\n\n\r\n")
                ):
                    chunk = sock.recv(4096)
                    assert chunk, f"the server closed the stream before its end: {received!r}"
                    received += chunk
                if b"data: [DONE]" not in received:
                    return  # leaves mid-stream
                ended.append(len(received))
        raise AssertionError(f"10 streams of 150 tokens each ended before their first chunk was read: {ended} bytes")

    abandon()
    deadline = time.monotonic() + 5.0
    while _ready(served)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ready(served)["running"] == 0, "the abandoned request is still running"

    def one(i: int) -> int:
        if i % 50 == 0:
            abandon()
            return 200
        r = requests.post(
            f"{served}/v1/completions",
            headers=_auth(),
            timeout=120,
            json={"model": "tiny", "prompt": f"print({i})", "max_tokens": 1 + i % 4, "stream": i % 2 == 0},
        )
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        statuses = list(pool.map(one, range(1000)))
    assert statuses.count(200) == 1000
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_ready(served)["kv_cache_usage"] or _ready(served)["running"]):
        time.sleep(0.1)
    ready = _ready(served)
    assert (ready["running"], ready["waiting"], ready["kv_cache_usage"]) == (0, 0, 0), ready


def test_backpressure_is_429_with_retry_after(served):
    """A burst past the replica's queue is answered 429 with Retry-After and an OpenAI error, through Serve. Each
    request asks for `n` = MAX_NUM_SEQS choices (one engine request each), so three requests fill the running batch
    and the queue, and the burst overflows it however fast the ingress hands requests over: one request's choices
    take a whole batch's 120 steps, while the ingress passes a request on in tens of milliseconds. (With one choice
    per request the engine could keep up with a slow ingress, and the queue never filled: ci195.)"""

    def one(_):
        r = requests.post(
            f"{served}/v1/completions",
            headers=_auth(),
            timeout=120,
            json={"model": "tiny", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": MAX_NUM_SEQS},
        )
        return r.status_code, r.headers.get("retry-after"), r.json()

    n = 16
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) * MAX_NUM_SEQS >= MAX_NUM_SEQS + MAX_QUEUED  # the batch and the queue were filled
    for status, retry_after, body in results:
        if status == 429:
            assert retry_after == "1" and body["error"]["type"] == "rate_limit_error"
        else:
            assert len(body["choices"]) == MAX_NUM_SEQS
            assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_the_deployments_ledger_has_its_replica_hours_tokens_and_cost(served):
    """After a burst, `pylon cost tiny --json` (the replica's record under the cluster's Pylon home, which this test
    process shares) has replica-hours, the burst's tokens, an idle fraction and a cost per million output tokens."""
    from pylon.serving.api.ledger import read_replicas, report

    before = report("tiny")["tokens_out"] if read_replicas("tiny") else 0

    def one(i: int) -> int:
        body = {"model": "tiny", "prompt": f"ledger {i}", "max_tokens": 8, "ignore_eos": True}
        return requests.post(f"{served}/v1/completions", headers=_auth(), timeout=120, json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [200] * 16
    deadline = time.monotonic() + 30  # the replica rewrites its record every few seconds
    while time.monotonic() < deadline and report("tiny")["tokens_out"] < before + 16 * 8:
        time.sleep(1)
    ledger = _cost("tiny")  # as a user reads it
    assert ledger["tokens_out"] >= before + 16 * 8, ledger
    assert ledger["tokens_in"] > 0 and ledger["requests"] >= 16
    assert ledger["replicas_live"] == 1 and ledger["replica_hours"] > 0
    assert ledger["cpu_hours"] == pytest.approx(ledger["replica_hours"] * 0.5)  # replica.num_cpus
    assert 0 <= ledger["idle_fraction"] < 1
    assert ledger["cost_usd"] > 0 and ledger["cost_per_million_output_tokens_usd"] > 0
    assert ledger["predicted"]["cost_per_replica_hour_usd"] == pytest.approx(0.5 * ledger["prices"]["per_vcpu_hour"])
    # By model: the base model's and its adapters' (test_a_lora_adapter_answers_as_peft_beside_the_base_model) requests.
    by_model = {row["model"]: row for row in ledger["by_model"]}
    assert {"tiny", ADAPTER, ON_DEMAND} <= set(by_model) and by_model["tiny"]["requests"] >= 16
    assert sum(row["cost_usd"] for row in ledger["by_model"]) == pytest.approx(ledger["cost_usd"])


def _cost(name: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "pylon", "cost", name, "--deployment", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_prometheus_metrics_carry_the_model_label(served, ray_cluster):
    for model in ("tiny", ADAPTER):
        body = {"model": model, "prompt": "m", "max_tokens": 4}
        assert requests.post(f"{served}/v1/completions", headers=_auth(), json=body, timeout=60).status_code == 200
    wanted = [
        "pylon_time_to_first_token_seconds",
        "pylon_inter_token_latency_seconds",
        "pylon_e2e_request_latency_seconds",
        "pylon_request_queue_time_seconds",
        "pylon_num_requests_running",
        "pylon_num_requests_waiting",
        "pylon_kv_cache_usage_ratio",
        "pylon_prompt_tokens_total",
        "pylon_generation_tokens_total",
        "pylon_lora_adapter_loads_total",  # ON_DEMAND's load (test_a_lora_adapter_answers_as_peft_beside_the_base_model)
    ]
    urls = _metrics_urls(ray_cluster)
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        text = "\n".join(_get(u) for u in urls)
        if all(f"{name}" in text for name in wanted) and 'model="tiny"' in text and f'adapter="{ADAPTER}"' in text:
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, (missing, urls)
    assert any('model="tiny"' in line for line in text.splitlines() if line.startswith("ray_pylon_time_to_first"))
    # A LoRA adapter's finished requests (test_a_lora_adapter_answers_as_peft_beside_the_base_model) under its name.
    adapted = [
        line
        for line in text.splitlines()
        if line.startswith("ray_pylon_generation_tokens_total") and f'adapter="{ADAPTER}"' in line
    ]
    assert adapted and float(adapted[0].rsplit(" ", 1)[1]) > 0, adapted


def _metrics_urls(ray_cluster) -> list[str]:
    import psutil

    hosts = {"127.0.0.1"} | {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == 2}
    return [f"http://{h}:{ray_cluster.metrics_port}/metrics" for h in sorted(hosts)]


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


@pytest.mark.slow  # waits out Serve's scaling delays; `make test-all`
def test_autoscaling_up_under_load_and_back_down(ray_cluster, tiny, served):
    from pylon.sdk.serve import delete, deploy

    spec = _spec(
        "tiny-autoscale",
        tiny.dir,
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 1,
            "downscale_delay_s": 3,
        },
        http={"api_keys_env": None, "max_queued_requests": 64, "request_timeout_s": 120, "route_prefix": "/autoscale"},
        replica={"num_cpus": 0.25},
    )
    from pylon.errors import PylonError

    with pytest.raises(PylonError, match=r"http.route_prefix: / is already served by application 'tiny'"):
        deploy(spec.model_copy(update={"http": spec.http.model_copy(update={"route_prefix": "/"})}))
    url = deploy(spec)
    assert url.endswith("/autoscale")
    try:
        assert _replicas(ray_cluster, "tiny-autoscale") == 1
        stop = time.monotonic() + 120
        seen = [1]

        def load(_):
            while time.monotonic() < stop and max(seen) < 2:
                requests.post(
                    f"{url}/v1/completions",
                    timeout=120,
                    json={"model": "tiny-autoscale", "prompt": "x", "max_tokens": 60, "ignore_eos": True},
                )

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(load, i) for i in range(10)]
            while time.monotonic() < stop and max(seen) < 2:
                seen.append(_replicas(ray_cluster, "tiny-autoscale"))
                time.sleep(1)
            stop = time.monotonic()
            for f in futures:
                f.result()
        assert max(seen) == 2, seen
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _replicas(ray_cluster, "tiny-autoscale") != 1:
            time.sleep(1)
        assert _replicas(ray_cluster, "tiny-autoscale") == 1
    finally:
        delete("tiny-autoscale")


def _replicas(ray_cluster, app: str, deployment: str | None = None) -> int:
    """RUNNING replicas of the app's deployment (named as the app unless `deployment` says), from Serve's REST API
    on the dashboard."""
    token = Path(ray_cluster.token_path).read_text().strip()
    r = requests.get(
        f"{ray_cluster.dashboard_url}/api/serve/applications/", timeout=10, headers={"Authorization": f"Bearer {token}"}
    )
    r.raise_for_status()
    replicas = r.json()["applications"][app]["deployments"][deployment or app]["replicas"]
    return sum(1 for rep in replicas if rep["state"] == "RUNNING")


def test_pylon_serve_cli_deploys_answers_and_deletes(ray_cluster, tiny, tmp_path, served):
    """`pylon serve FILE` prints the URL of a ready deployment; a wrong model path fails before deploying,
    naming the field, and so does a KV cache no node of the cluster holds (the planner's `check_serve_fits`);
    `pylon serve --delete NAME` removes it."""
    import subprocess
    import sys

    from pylon.sdk.serve import serve_details

    def pylon(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pylon", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )

    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Deployment\nname: nowhere\nmodel: no/such/model\nhttp: {api_keys_env: null}\n")
    r = pylon("serve", str(bad))
    assert r.returncode == 1 and "model" in r.stderr and "no/such/model" in r.stderr and "config.json" in r.stderr, r
    assert "Traceback" not in r.stderr

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny.dir, target_is_directory=True)
    huge = tmp_path / "huge.yaml"  # 2^32 tokens of KV cache: terabytes, on a cluster of one machine
    huge.write_text(
        "kind: Deployment\nname: tiny-huge\nmodel: models/tiny\nengine: {kv_cache_tokens: 4294967296}\n"
        "http: {api_keys_env: null, route_prefix: /huge}\n"
    )
    r = pylon("serve", str(huge))
    assert r.returncode == 1 and "Deployment 'tiny-huge' needs about" in r.stderr, r
    assert "engine.kv_cache_tokens 4,294,967,296" in r.stderr and "--force" in r.stderr and "Traceback" not in r.stderr
    assert "tiny-huge" not in (serve_details().get("applications") or {})  # nothing was deployed
    good = tmp_path / "deploy.yaml"
    good.write_text(
        "kind: Deployment\nname: tiny-cli\nmodel: models/tiny\n"  # relative to where pylon runs
        "engine: {max_num_seqs: 4, kv_cache_tokens: 1024, max_model_len: 128}\n"
        "http: {api_keys_env: null, route_prefix: /cli}\nreplica: {num_cpus: 0.25}\n"
    )
    r = pylon("serve", str(good))
    assert r.returncode == 0, r.stderr
    url = r.stdout.strip().splitlines()[-1]
    assert url.endswith("/cli") and "pylon serve --delete tiny-cli" in r.stderr
    models = requests.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-cli"]
    r = pylon("serve", "--delete", "tiny-cli")
    assert r.returncode == 0 and "deleted" in r.stdout, r.stderr
    assert requests.get(f"{url}/v1/models", timeout=30).status_code == 404


# Ray's own listeners that answer without credentials and that no Ray setting binds to loopback (docs/security.md):
# the dashboard agent's Prometheus exporter (`--metrics-export-port`), and the dashboard's and the autoscaler's
# metrics (Ray's fixed 44227 and 44217). Anything else off loopback must refuse a request without credentials.
RAY_OPEN_METRICS = (44217, 44227)
# Ray's core processes: their gRPC servers check the cluster token (Ray's token authentication).
RAY_CORE = ("gcs_server", "raylet", "ray::", "ray-dashboard", "python")


def _http_status(host: str, port: int) -> int | None:
    try:
        return requests.get(f"http://{host}:{port}/", timeout=5).status_code
    except requests.RequestException:
        return None  # not HTTP (gRPC), or nothing


def _grpc_status(host: str, port: int, method: str = "/ray.rpc.CoreWorkerService/NumPendingTasks") -> str:
    """A gRPC call without the token: UNAUTHENTICATED where the server has `method` and checks the token,
    UNIMPLEMENTED where it has no such method (a server routes before it checks)."""
    import grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary(method)
        try:
            call(b"", timeout=5)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def test_no_listener_off_loopback_answers_without_credentials(served, ray_cluster):
    """A listener scan as a new user would run it after `pylon cluster up` and a deployment: every TCP listener of
    the cluster's processes that is not on loopback either refuses a request without the token or a key, or is one
    of Ray's metrics exporters that docs/security.md names. HAProxy (Serve's ingress) and the replicas have none."""
    import psutil

    from pylon.infra.local import _name
    from pylon.sdk.serve import serve_details

    requests.post(f"{served}/v1/completions", headers=_auth(), json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    # Names are read once, now: a short-lived process of the cluster (a Ray worker starting or exiting) may be gone
    # by the time it is named, and one gone before the scan below has no listener to scan.
    pids = {p.pid: _name(p) for p in ray_cluster.processes()}
    pids = {pid: name for pid, name in pids.items() if name}
    haproxy = [pid for pid, name in pids.items() if name == "haproxy"]
    assert haproxy, "Serve's ingress is HAProxy on a Pylon cluster"
    assert serve_details(None)["proxies"], "Serve's proxy is up"
    address = next(
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == 2 and not a.address.startswith("127.")
    )
    seen, open_metrics, problems = [], [], []
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        ip, port = conn.laddr.ip, conn.laddr.port
        if ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1"):
            continue
        name = pids[conn.pid]
        status = _http_status(address, port)
        seen.append((name, port, status))
        where = f"{name} (pid {conn.pid}) on {ip}:{port}"
        if name == "haproxy":
            problems.append(f"{where}: HAProxy's listeners (stats, metrics, the service) stay on loopback")
        elif status in (401, 403):
            continue
        elif status is not None:
            if port in (ray_cluster.metrics_port, *RAY_OPEN_METRICS):
                open_metrics.append(port)
            else:
                problems.append(f"{where} answers HTTP {status} without credentials")
        elif not name.startswith(RAY_CORE):
            problems.append(f"{where} is not one of Ray's core processes")
        elif _grpc_status(address, port) == "OK":
            problems.append(f"{where} answers gRPC without the token")
    assert seen, "the scan found Ray's own listeners (GCS, raylet): it saw the cluster"
    assert not problems, (problems, seen)
    assert ray_cluster.metrics_port in open_metrics, seen  # the one Ray exporter always there (documented)
    # Ray's gRPC servers check the cluster token: the GCS refuses a call without it.
    gcs_port = int(ray_cluster.gcs_address.rsplit(":", 1)[1])
    assert _grpc_status(address, gcs_port, "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo") == "UNAUTHENTICATED"


def test_api_keys_rotate_on_the_running_replica(served, ray_cluster, tiny, s3_server):
    """Adding a key and removing one is `pylon serve` of the same spec with other keys in the environment: Serve
    reconfigures the running replica in place (the same process, no new engine) and the change holds at once."""
    from pylon.sdk.serve import deploy, serve_details

    def status(key: str) -> int:
        body = {"model": "tiny", "prompt": "k", "max_tokens": 1}
        return requests.post(f"{served}/v1/completions", headers=_auth(key), json=body, timeout=60).status_code

    [replica] = _replica_processes(ray_cluster, "ServeReplica:tiny:tiny")
    new_key = "sk-pylon-test-rotated"
    assert status(new_key) == 401
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(KEYS_ENV, f"{API_KEY},{new_key}")  # SECOND_KEY removed, new_key added
            deploy(_served_spec(tiny, s3_server))  # the same spec, other keys
        assert status(new_key) == 200 and status(API_KEY) == 200
        assert status(SECOND_KEY) == 401
        stored = serve_details(None)["applications"]["tiny"]["deployed_app_config"]["deployments"][0]["user_config"]
        assert stored["api_keys"]["scheme"] == "scrypt" and len(stored["api_keys"]["hashes"]) == 2
        assert new_key not in json.dumps(stored) and API_KEY not in json.dumps(stored)
    finally:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(KEYS_ENV, f"{API_KEY},{SECOND_KEY}")  # as the module's other tests expect
            deploy(_served_spec(tiny, s3_server))  # the same spec, other keys
    assert status(SECOND_KEY) == 200 and status(new_key) == 401
    assert _replica_processes(ray_cluster, "ServeReplica:tiny:tiny") == [replica], "the same replica process"
