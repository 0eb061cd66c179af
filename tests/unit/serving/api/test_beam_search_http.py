"""Beam search over HTTP (vLLM's `use_beam_search`, serving/api/beam_search.py) against a real server: the `n` choices
are `transformers`' `generate(num_beams=n, num_return_sequences=n)` beams, best first, on both endpoints; a field beams
do not take, a stream, or too many beams is a 400 naming it."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from test_serving_http import auth, serving  # noqa: F401 (fixtures)

from pylon.data.tokenizer import ByteTokenizer

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def beams(tmp_path_factory):
    """A tiny model whose continuations follow the context (initializer_range 0.5: clear gaps between the best
    tokens, so fp32 rounding never reorders beams), served; (url, model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=258, eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id, pad_token_id=tok.pad_id, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tmp_path_factory.mktemp("beam-model")
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    with serving(str(directory), max_model_len=256, kv_cache_tokens=4096, separate_process=False) as (url, _):
        yield url, model


def hf_beams(model, prompt: list[int], n: int, new_tokens: int, eos: bool = False) -> list[list[int]]:
    """`transformers`' n best beams (best first): without an eos (every beam runs `new_tokens`), or ending at the
    byte tokenizer's (256), its default stopping rule (early_stopping False)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    config = GenerationConfig(
        num_beams=n, num_return_sequences=n, do_sample=False, max_new_tokens=new_tokens,
        eos_token_id=256 if eos else None, pad_token_id=257, early_stopping=False, length_penalty=1.0,
    )  # fmt: skip
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[:, len(prompt) :].tolist()


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", headers=auth(), json=body, timeout=120)


@pytest.mark.parametrize("n", [2, 4])
def test_the_choices_are_transformers_beams_best_first(beams, n) -> None:
    url, model = beams
    byte = ByteTokenizer()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "n": n, "use_beam_search": True, "ignore_eos": True}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    want = hf_beams(model, list(PROMPT.encode()), n, 10)
    assert [c["text"] for c in answer["choices"]] == [byte.decode(w) for w in want]
    assert [c["index"] for c in answer["choices"]] == list(range(n))
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) and answer["usage"]["completion_tokens"] == 10 * n
    greedy = post(url, "/v1/completions", {**body, "n": 1, "use_beam_search": False, "temperature": 0}).json()
    assert greedy["choices"][0]["text"] != answer["choices"][0]["text"]  # the best beam is not the greedy reply here
    messages = [{"role": "user", "content": "name a colour"}]
    rendered = "user: name a colour\nassistant: "  # the plain chat lines of a model without a template
    chat = post(url, "/v1/chat/completions", {k: v for k, v in body.items() if k != "prompt"} | {"messages": messages})
    assert chat.status_code == 200, chat.text
    want = hf_beams(model, list(rendered.encode()), n, 10)
    assert [c["message"]["content"] for c in chat.json()["choices"]] == [byte.decode(w) for w in want]


@pytest.mark.parametrize(
    "field, value",
    [
        ("stream", True),
        ("logit_bias", {"97": 5}),
        ("n", 11),
        ("stop", ["x"]),
        ("presence_penalty", 1.0),
        ("max_tokens", 250),  # past the context with the prompt: refused before any step after the first
    ],
)
def test_what_beams_do_not_take_is_a_400_naming_it(beams, field, value) -> None:
    url, _ = beams
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, field: value}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


@pytest.mark.parametrize("prompt", ["name a colour", "user: hi\nassistant: "])
def test_beams_that_end_are_ranked_by_their_length_as_transformers_ranks_them(beams, prompt) -> None:
    """Prompts where some of `transformers`' beams end at the eos (22 and 29 of 30 tokens): the same beams, in the
    same order, those that ended with finish_reason stop."""
    url, model = beams
    byte = ByteTokenizer()
    want = hf_beams(model, list(prompt.encode()), 4, 30, eos=True)
    assert any(256 in w for w in want)  # the case under test
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "n": 4, "use_beam_search": True}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [byte.decode([t for t in w if t < 256]) for w in want]
    assert [c["finish_reason"] for c in choices] == ["stop" if 256 in w else "length" for w in want]
