"""A model with recurrent layers (Qwen3-Next's Gated DeltaNet) over HTTP: the server names where a chat's last message
begins (`SamplingParams.snapshot_at`), so a conversation with the same system prompt as an earlier one starts past
it (`usage.prompt_tokens_details.cached_tokens`), and a chat's next turn past the whole of the last one; every reply
is the one the same request gets with nothing shared (another `cache_salt`)."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from test_serving_http import auth, serving
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one short line. " * 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "qwen3_next",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=2048,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("qwen3-next-http")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    with serving(str(directory), max_num_seqs=4, max_num_batched_tokens=256, kv_cache_tokens=8192) as (url, _):
        yield url


def chat(server, messages: list[dict], salt: str = "a") -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "cache_salt": salt}
    r = requests.post(f"{server}/v1/chat/completions", headers=auth(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_conversations_share_their_system_prompt_and_turns(server) -> None:
    first = chat(server, [SYSTEM, {"role": "user", "content": "What is the capital of France?"}])
    assert cached(first) == 0
    other = [SYSTEM, {"role": "user", "content": "Name a prime number above ten."}]
    shared = requests.post(
        f"{server}/tokenize",
        headers=auth(),
        json={"model": "tiny", "messages": [SYSTEM], "add_generation_prompt": False},
    ).json()["count"]
    answer = chat(server, other)
    assert cached(answer) == (shared - 1) // 16 * 16 > 64  # past the system prompt, to its last block boundary
    alone = chat(server, other, salt="b")  # nothing shared under another salt
    assert cached(alone) == 0 and alone["choices"][0]["message"] == answer["choices"][0]["message"]
    # The next turn of the first conversation: past the whole of it, to the last boundary its reply reached.
    turn = [*other, answer["choices"][0]["message"], {"role": "user", "content": "And one below ten?"}]
    again = chat(server, turn)
    assert cached(again) > cached(answer)
    assert chat(server, turn, salt="c")["choices"][0]["message"] == again["choices"][0]["message"]
