"""`pylon eval` / `pylon.evaluate` without a cluster: the endpoint path's reduction of prompt-token logprobs is the
trainer's `token_loss_sum` on the same logits; the held-out rows are the trainer's split; an export directory and
an OpenAI-shaped server (a stand-in on loopback, answering with a tiny model's log_softmax) give the same loss;
HTTP errors say the status, the server's message and what to do."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.reader import split_ids
from pylon.data.testing import synthetic_tokens, write_synthetic_dataset
from pylon.errors import PylonError
from pylon.jobs.train import token_loss_sum
from pylon.sdk.evaluate import evaluate, held_out, prompt_loss_sum, reduce_losses

VOCAB = 320  # the byte tokenizer's, as write_synthetic_dataset records it
KEY = "sk-eval-unit"


def _tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2, initializer_range=0.5)
    return GPT2LMHeadModel(config).eval()


def _echo_logprobs(logits: torch.Tensor, ids: list[int]) -> list[float | None]:
    """What the server returns for a prompt: token_logprobs [null, lp(t1 | t0), lp(t2 | t0 t1), ...] from the
    log_softmax of the logits of one row (position t's distribution scores token t+1)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return [None] + [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


def test_the_endpoint_reduction_is_the_trainers_token_loss_on_the_same_logits() -> None:
    model = _tiny_model()
    g = torch.Generator().manual_seed(1)
    lengths = [16, 3, 11, 1, 16, 7]  # very different lengths, one row with a single token (scores nothing)
    ids = torch.randint(0, 256, (len(lengths), 16), generator=g)
    labels = ids.clone()
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, n:] = 257  # padding, as packed rows end
        labels[b, n:] = -100
        mask[b, :n] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    expected_sum, expected_n = token_loss_sum(logits, labels)
    expected = float(expected_sum) / expected_n

    parts = []
    for b, n in enumerate(lengths):
        seq = ids[b, :n].tolist()
        parts.append(prompt_loss_sum(_echo_logprobs(logits[b, :n], seq), n))
    loss, tokens = reduce_losses(parts)
    assert tokens == expected_n == sum(n - 1 for n in lengths)
    assert loss == pytest.approx(expected, abs=1e-5)

    # The figures differ enough that each plausible mistake would fail the assertion above:
    per_sequence_means = [s / n for s, n in parts if n]
    assert abs(sum(per_sequence_means) / len(per_sequence_means) - expected) > 1e-3  # a mean of means
    first_as_zero = math.fsum(s for s, _ in parts) / sum(n + 1 for _, n in parts)  # counting the null first token
    assert abs(first_as_zero - expected) > 1e-3
    with_padding = sum(
        float(-torch.log_softmax(logits[b].double(), -1)[t, ids[b, t + 1]])
        for b in range(len(lengths))
        for t in range(15)
    ) / (len(lengths) * 15)  # scoring the padding too
    assert abs(with_padding - expected) > 1e-3


def test_prompt_loss_sum_refuses_answers_that_are_not_the_prompt_scored() -> None:
    assert prompt_loss_sum([None, -1.0, -2.5], 3) == (3.5, 2)
    assert prompt_loss_sum([None], 1) == (0.0, 0)
    with pytest.raises(PylonError, match="scored 2 prompt tokens of 3"):
        prompt_loss_sum([None, -1.0], 3)
    with pytest.raises(PylonError, match="first prompt token a logprob"):
        prompt_loss_sum([-0.5, -1.0], 2)
    with pytest.raises(PylonError, match="nothing to score"):
        reduce_losses([(0.0, 0)])


def test_held_out_rows_are_the_trainers_validation_split(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    manifest = write_synthetic_dataset(uri, rows=23, rows_per_shard=5, seq_len=8)
    lo, hi = split_ids(manifest, 0.2)["validation"]
    data = held_out(uri, 0.2)
    assert data.ids == (lo, hi) == (18, 23)
    expected = synthetic_tokens(np.arange(lo, hi), 8)
    assert [s.tolist() for s in data.sequences] == expected.tolist()
    assert [s.tolist() for s in held_out(uri, 0.2, max_sequences=2).sequences] == expected[:2].tolist()
    with pytest.raises(PylonError, match="must be in \\(0, 1\\)"):
        held_out(uri, 0.0)


def _export(tmp_path: Path):
    model = _tiny_model()
    directory = tmp_path / "model"
    model.save_pretrained(directory)
    tok = {"kind": "byte", "name": "byte", "vocab_size": VOCAB, "eos_id": 256, "pad_id": 257, "sha256": None}
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok))
    return model, directory


class _Server:
    """An OpenAI-shaped /v1/completions on loopback scoring token-id prompts with a model (echo, logprobs 0,
    max_tokens 0), requiring Bearer KEY; records the requests and how many were in flight at once."""

    def __init__(self, model):
        self.model, self.lock, self.bodies, self.in_flight, self.most = model, threading.Lock(), [], 0, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {KEY}":
                    return True
                self._send(401, {"error": {"message": "invalid API key", "type": "invalid_request_error"}})
                return False

            def do_GET(self):
                if self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    server.in_flight += 1
                    server.most = max(server.most, server.in_flight)
                try:
                    ids = body["prompt"]
                    with torch.no_grad():
                        logits = server.model(input_ids=torch.tensor([ids])).logits[0]
                    lps = _echo_logprobs(logits, ids)
                    logprobs = {
                        "tokens": [str(i) for i in ids],
                        "token_logprobs": lps,
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                    self._send(200, {"choices": [{"index": 0, "text": "", "logprobs": logprobs}]})
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_export_and_endpoint_agree_with_a_direct_computation(tmp_path: Path, monkeypatch) -> None:
    """Rows of different lengths (padding at their ends, as packing leaves the last row of a group)."""
    uri = str(tmp_path / "ds")
    lengths = np.array([12] * 15 + [12, 5, 1, 9, 2], np.int32)
    tokens = synthetic_tokens(np.arange(20), 12)
    for i, n in enumerate(lengths):
        tokens[i, n:] = 257
    manifest = write_synthetic_dataset(uri, rows=20, rows_per_shard=20, seq_len=12, tokens=tokens, lengths=lengths)

    model, directory = _export(tmp_path)
    lo, hi = split_ids(manifest, 0.25)["validation"]
    assert (lo, hi) == (15, 20)
    rows = torch.from_numpy(tokens[lo:hi].astype(np.int64))
    mask = (torch.arange(12)[None, :] < torch.from_numpy(lengths[lo:hi])[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=rows, attention_mask=mask).logits
    s, n = token_loss_sum(logits, rows.masked_fill(mask == 0, -100))
    direct = float(s) / n
    assert n == sum(int(k) - 1 for k in lengths[lo:hi] if k > 0)

    local = evaluate(str(directory), data=uri, validation_fraction=0.25)
    assert (local.source, local.sequences, local.tokens, local.ids) == ("model", 5, n, [15, 20])
    assert local.loss == pytest.approx(direct, abs=1e-5)
    assert local.perplexity == pytest.approx(math.exp(direct), rel=1e-5)

    server = _Server(model)
    try:
        monkeypatch.setenv("EVAL_UNIT_KEYS", f"{KEY},other")
        remote = evaluate(
            server.url + "/v1", data=uri, validation_fraction=0.25, api_key_env="EVAL_UNIT_KEYS", concurrency=2
        )
        assert (remote.source, remote.served_model, remote.tokens, remote.sequences) == ("endpoint", "tiny", n, 5)
        assert remote.loss == pytest.approx(direct, abs=1e-5)
        # Each row with something to predict sent once, its padding stripped; never more than 2 in flight.
        assert sorted(len(b["prompt"]) for b in server.bodies) == [2, 5, 9, 12]
        assert all(b["echo"] is True and b["logprobs"] == 0 and b["max_tokens"] == 0 for b in server.bodies)
        assert server.most <= 2

        monkeypatch.delenv("EVAL_UNIT_KEYS")
        with pytest.raises(PylonError) as e:
            evaluate(server.url, data=uri, validation_fraction=0.25, api_key_env="EVAL_UNIT_KEYS")
        assert "HTTP 401: invalid API key" in str(e.value) and "set EVAL_UNIT_KEYS" in str(e.value)
    finally:
        server.close()


def test_missing_data_options_are_named(tmp_path: Path) -> None:
    _, directory = _export(tmp_path)
    with pytest.raises(PylonError, match="--data and --validation-fraction required: .* has no eval.json"):
        evaluate(str(directory))
    with pytest.raises(PylonError, match="--validation-fraction required: an endpoint does not say"):
        evaluate("http://127.0.0.1:1", data=str(tmp_path))


def test_a_reward_model_is_scored_on_preference_pairs_and_refused_on_other_data(tmp_path: Path, capsys) -> None:
    """A reward model's export (a classifier of one label) is scored on a preference dataset's held-out pairs, as its
    training run scores them (`dpo_forward` with objective reward: the same loss, accuracy and rewards), with no
    perplexity; on a dataset without pairs it is refused saying what to give."""
    import sys

    from transformers import LlamaConfig, LlamaForSequenceClassification

    from pylon.cli import main
    from pylon.jobs.dpo import DpoLoss, dpo_forward
    from pylon.jobs.train import model_inputs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from test_chat_data import _jsonl
    from test_dpo import PAIRS, tokenizer_dir

    from pylon.data.prepare import prepare

    tok_dir = tokenizer_dir(tmp_path / "tok")
    data = str(tmp_path / "pairs")
    manifest = prepare([_jsonl(tmp_path / "pairs.jsonl", PAIRS * 4)], data, seq_len=64, tokenizer=tok_dir,
                       preference=True, progress=False)  # fmt: skip
    tok = manifest.tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_id,
                         eos_token_id=tok.eos_id)  # fmt: skip
    rm = LlamaForSequenceClassification(config).eval()
    rm.save_pretrained(tmp_path / "rm")

    result = evaluate(str(tmp_path / "rm"), data=data, validation_fraction=0.5)
    assert result.perplexity is None and result.pairs and result.pairs == result.tokens, result
    held = held_out(data, 0.5)
    ((_, inputs),) = held.batches(len(held.sequences))  # every held-out row in one batch
    with torch.no_grad():
        loss, pairs, _, stats, _ = dpo_forward(rm, rm, inputs, DpoLoss(kind="reward"), "test", model_inputs)
    assert pairs == result.pairs and abs(result.loss - loss.item() / pairs) < 1e-5, (result, loss.item() / pairs)
    assert abs(result.rewards["reward_chosen"] - stats[0] / pairs) < 1e-5
    assert result.rewards["reward_accuracy"] == stats[2] / pairs
    assert result.metric.startswith("a reward model's mean Bradley-Terry loss")

    assert main(["eval", str(tmp_path / "rm"), "--data", data, "--validation-fraction", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "perplexity" not in printed and f"{result.pairs:,} scored" in printed

    # A deployment of it (Pylon's replica over real HTTP): each completion's token ids to /classify, raw values
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving" / "api"))
    from test_serving_http import KEY as SERVING_KEY
    from test_serving_http import serving

    for f in Path(tok_dir).iterdir():
        shutil.copy(f, tmp_path / "rm" / f.name)  # the tokenizer beside the weights, as an export has it
    with serving(str(tmp_path / "rm"), max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=4096) as (url, _):
        remote = evaluate(url, data=data, validation_fraction=0.5, api_key=SERVING_KEY)
    assert (remote.source, remote.served_model, remote.pairs, remote.perplexity) == ("endpoint", "tiny", pairs, None)
    assert abs(remote.loss - result.loss) < 1e-4, (remote.loss, result.loss)
    assert remote.rewards["reward_accuracy"] == result.rewards["reward_accuracy"]
    assert abs(remote.rewards["reward_margin"] - result.rewards["reward_margin"]) < 1e-4

    # a causal LM's deployment answers /classify that it is not a classifier: the completions' loss, as before
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: dict) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "lm", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/classify":  # the replica's words (serving/api/server.py)
                message = "this model is not a classifier (a *ForSequenceClassification checkpoint, or ...)"
                return self._send(400, {"error": {"message": message, "type": "invalid_request_error"}})
            lps = [None] + [-1.0] * (len(body["prompt"]) - 1)
            self._send(200, {"choices": [{"index": 0, "text": "", "logprobs": {"token_logprobs": lps}}]})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        causal = evaluate(f"http://127.0.0.1:{httpd.server_address[1]}", data=data, validation_fraction=0.5)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert causal.rewards is None and causal.pairs is None and causal.loss == pytest.approx(1.0), causal

    write_synthetic_dataset(str(tmp_path / "text"), rows=8, rows_per_shard=8, seq_len=16)
    with pytest.raises(PylonError, match="a classifier .*LlamaForSequenceClassification.* holds no preference pairs"):
        evaluate(str(tmp_path / "rm"), data=str(tmp_path / "text"), validation_fraction=0.5)


def test_the_byte_tokenizer_as_hugging_face_files_is_utf8_bytes(tmp_path: Path) -> None:
    """What lm-eval tokenizes with for a byte-tokenizer export: the same ids Pylon's ByteTokenizer gives."""
    from transformers import AutoTokenizer

    from pylon.data.tokenizer import ByteTokenizer
    from pylon.sdk.lm_eval import hf_tokenizer_dir

    _, directory = _export(tmp_path)
    tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir(str(directory), str(tmp_path / "tok")))
    byte = ByteTokenizer()
    for text in ["Question: What is 2 ** 3?\nAnswer: 8", "naïve café — 東京\n\t x  y ", " leading space", ""]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == byte.encode(text).tolist()
        assert tok.decode(ids) == text
    assert (tok.eos_token_id, tok.pad_token_id) == (byte.eos_id, byte.pad_id)
    (directory / "pylon_tokenizer.json").write_text(json.dumps({"kind": "tokenizers", "name": "bpe"}))
    with pytest.raises(PylonError, match="no Hugging Face tokenizer files"):
        hf_tokenizer_dir(str(directory))
    (directory / "tokenizer.json").write_text("{}")
    assert hf_tokenizer_dir(str(directory)) == str(directory)  # a BPE export carries its own
