"""Fill in the middle (OpenAI's completions `suffix`, which vLLM refuses): a code model's own tokens around the code
before the cursor and after it, in its family's order (tokenization.FIM_FORMATS: Qwen-Coder and CodeGemma,
StarCoder and Granite, DeepSeek-Coder, Codestral), after the tokenizer's BOS; through the official client the engine
computes exactly that prompt, streamed and not, and the prefix-aware router keys it the same; a model without such
tokens, a token-id prompt and echo are 400s naming the field."""

from __future__ import annotations

import pytest
import requests
from harmony_models import bpe_tokenizer
from test_serving_http import KEY, auth, model_dir, server, serving  # noqa: F401 (fixtures)

from pylon.serving.engine.tokenization import FIM_FORMATS, fim_ids, load_model_tokenizer, prompt_ids

BEFORE = "def add(a, b):\n    return "
AFTER = "\n\nprint(add(1, 2))\n"


def _saved(directory, specials: list[str], bos: bool = False):
    """A byte-level BPE tokenizer with `specials` (and <|endoftext|>, its eos), saved; with `bos`, one that starts
    every text with <s>, as Llama's and DeepSeek's do."""
    from tokenizers.processors import TemplateProcessing

    names = ["<|endoftext|>", *(["<s>"] if bos else []), *specials]
    tok = bpe_tokenizer(names, eos_token="<|endoftext|>", **({"bos_token": "<s>"} if bos else {}))
    if bos:
        tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save_pretrained(directory)
    return tok


@pytest.mark.parametrize("fmt", FIM_FORMATS, ids=lambda f: f[0])
def test_each_family_gets_its_own_tokens_in_its_own_order(tmp_path, fmt) -> None:
    prefix_token, suffix_token, middle_token, order = fmt
    names = [n for n in (prefix_token, suffix_token, middle_token) if n is not None]
    tok = _saved(tmp_path / "t", names, bos=True)
    tokenizer = load_model_tokenizer(str(tmp_path / "t"))
    pre, suf = (tok.convert_tokens_to_ids(n) for n in (prefix_token, suffix_token))
    before, after = prompt_ids(tokenizer, BEFORE), prompt_ids(tokenizer, AFTER)

    def want(after: list[int]) -> list[int]:
        if order == "psm":
            return [pre, *before, suf, *after, tok.convert_tokens_to_ids(middle_token)]
        return [suf, *after, pre, *before]  # Codestral: the suffix first, and the model writes on after the prefix

    assert fim_ids(tokenizer, BEFORE, AFTER, special=False) == want(after)
    assert fim_ids(tokenizer, BEFORE, AFTER) == [1, *want(after)]  # the BOS once, before the whole prompt
    assert fim_ids(tokenizer, BEFORE, "") == [1, *want([])]  # at the end of the file


@pytest.mark.slow  # make test-all: ~15 s
def test_the_engine_fills_in_the_middle_through_the_openai_client(tmp_path) -> None:
    import torch
    from openai import OpenAI
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.serving.api.routing import routing_key

    directory = tmp_path / "coder"
    tok = _saved(directory, ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    config = AutoConfig.for_model(
        "gpt2", n_layer=1, n_head=2, n_embd=32, n_positions=256, vocab_size=len(tok), eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer = load_model_tokenizer(str(directory))
    want = fim_ids(tokenizer, BEFORE, AFTER)
    assert want[0] == tok.convert_tokens_to_ids("<|fim_prefix|>") and want[-1] == tok.convert_tokens_to_ids(
        "<|fim_middle|>"
    )
    with serving(str(directory), max_model_len=256, kv_cache_tokens=1024, max_num_batched_tokens=256) as (url, _):
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        fields = {"model": "tiny", "prompt": BEFORE, "suffix": AFTER, "max_tokens": 5, "temperature": 0}
        reply = client.completions.create(**fields, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        assert choice.model_extra["prompt_token_ids"] == want and reply.usage.prompt_tokens == len(want)
        plain = client.completions.create(
            model="tiny", prompt=want, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
        )
        assert choice.text == plain.choices[0].text  # the same prompt, the same middle
        chunks = list(client.completions.create(**fields, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        for body, param in (
            ({"prompt": [5, 6, 7]}, "suffix"),
            ({"echo": True}, "echo"),
        ):
            r = requests.post(f"{url}/v1/completions", headers=auth(), json={**fields, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # The router keys it by the prompt the replica builds.
    key = routing_key(tokenizer, 16, {"model": "tiny", "prompt": BEFORE, "suffix": AFTER})
    assert key.hashes == routing_key(tokenizer, 16, {"model": "tiny", "prompt": want}).hashes and key.hashes


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix(server):  # noqa: F811
    r = requests.post(
        f"{server}/v1/completions",
        headers=auth(),
        json={"model": "tiny", "prompt": BEFORE, "suffix": AFTER, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert "fill-in-the-middle" in r.json()["error"]["message"]
