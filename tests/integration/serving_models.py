"""Small models the serving integration tests build (a Pylon export each, byte tokenizer) and transformers' greedy
continuations of them."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_llama(directory: Path, layers: int = 4):
    """A random Llama of `layers` layers saved as a Pylon export (byte tokenizer), and transformers' model of it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pylon.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=320,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    return model


def tiny_adapter(base_dir: Path, out: Path, target_modules=("q_proj", "v_proj", "down_proj")):
    """A random LoRA adapter (peft's format, rank 4) of the model in `base_dir`, large enough to change the tokens,
    saved to `out`; and peft's model of it (base + adapter) for `greedy_text`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), init_lora_weights=False)
    adapted = get_peft_model(base, lora).eval()
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    adapted.save_pretrained(out)
    return adapted


def greedy_text(model, prompt: str, new_tokens: int) -> str:
    import torch

    from pylon.data.tokenizer import ByteTokenizer

    ids = torch.tensor([list(prompt.encode())])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=257,
    )
    return ByteTokenizer().decode(out[0, ids.shape[1] :].tolist())


def greedy_completion(url: str, model: str, prompt: str, max_tokens: int, headers: dict | None = None) -> str:
    """A deployment's greedy completion of `prompt` (`ignore_eos`: exactly `max_tokens` tokens) over HTTP; a status
    other than 200 fails the test with the body."""
    import requests

    r = requests.post(
        f"{url}/v1/completions",
        headers=headers,
        timeout=120,
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# The unit tests' engine models (tests/unit/serving/engine/engine_models.py), which the engine drivers import.
ENGINE_MODELS = Path(__file__).resolve().parents[1] / "unit" / "serving" / "engine"


def engine_driver(driver: str, directory: str, *args: str) -> dict:
    """Run `driver` (Python source) in a child process against the session's Ray cluster: its argv is the cluster's
    GCS address, the model `directory`, ENGINE_MODELS (for it to import `engine_models`), then `args`. An engine of
    parts places its actors from there, as a replica would. Returns the JSON object its last line of output prints."""
    import subprocess
    import sys

    import pylon

    child = subprocess.run(
        [sys.executable, "-c", driver, pylon.connect().gcs_address, directory, str(ENGINE_MODELS), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
