"""Embeddings in the engine (`SamplingParams(embed=True)`): a request computes its prompt and returns its last token's
final hidden state (after the model's last norm), which is `transformers`' `last_hidden_state` at that token within
1e-5, for every family, whether the prompt runs alone, in chunks, beside generating requests, or from the prefix
cache; it generates nothing, holds no block once done, and the generating requests beside it keep their outputs."""

from __future__ import annotations

import pytest
import torch
from engine_models import DEVICE, GREEDY, PROMPTS, Family, assert_pool_empty, run, tokens_of
from test_serving_text import hf_dir  # noqa: F401 - a byte-level BPE tokenizer's directory (the fixture)

from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest

EMBED = SamplingParams(max_tokens=0, embed=True)


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen3"])
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}-embed"))


def reference(family: Family, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = family.model.base_model(torch.tensor([prompt], device=DEVICE)).last_hidden_state
    return out[0, -1].float().cpu()


def close(got: list[float], want: torch.Tensor) -> bool:
    got = torch.tensor(got)
    return got.shape == want.shape and ((got - want).norm() / want.norm()).item() < 1e-5


def test_an_embedding_is_the_last_tokens_final_hidden_state(family) -> None:
    for fields in ({}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}):
        engine = family.engine(**fields)
        for i, p in enumerate(PROMPTS):  # generating and embedding requests share the steps
            engine.add_request(f"gen-{i}", p, GREEDY)
            engine.add_request(f"emb-{i}", p, EMBED)
        outputs = run(engine)
        assert [tokens_of(outputs[f"gen-{i}"]) for i in range(len(PROMPTS))] == family.greedy, fields
        for i, p in enumerate(PROMPTS):
            outs = outputs[f"emb-{i}"]
            last = outs[-1]
            assert len(outs) == 1 and last.finished and last.finish_reason == "stop", fields
            assert last.token_ids == [] and last.num_output_tokens == 0 and last.num_prompt_tokens == len(p)
            assert close(last.embedding, reference(family, p)), (fields, i)
            assert all(o.embedding is None for o in outputs[f"gen-{i}"])
        assert_pool_empty(engine)


def test_an_embedding_from_the_prefix_cache_is_the_same(family) -> None:
    engine = family.engine()
    prompt = PROMPTS[3]  # 90 tokens: five full blocks of 16
    engine.add_request("first", prompt, EMBED)
    first = run(engine)["first"][-1]
    engine.add_request("again", prompt, EMBED)
    again = run(engine)["again"][-1]
    assert again.num_cached_tokens >= 80 and first.num_cached_tokens == 0
    assert close(again.embedding, reference(family, prompt))
    # A longer prompt whose start is cached: its own last token's state, not the cached prefix's.
    engine.add_request("longer", prompt + PROMPTS[0], EMBED)
    longer = run(engine)["longer"][-1]
    assert longer.num_cached_tokens >= 80 and close(longer.embedding, reference(family, prompt + PROMPTS[0]))


def test_an_embedding_request_asks_for_nothing_it_cannot_have(gpt2) -> None:
    for fields, param in (
        ({"max_tokens": 5}, "max_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(embed=True, **{"max_tokens": 0, **fields})
        assert e.value.param == param
    engine = gpt2.engine()
    with pytest.raises(InvalidRequest, match="max_model_len"):
        engine.add_request("long", list(range(100)) * 3, EMBED)  # 300 tokens of a 256-token context
    engine.add_request("full", list(range(200)) + list(range(56)), EMBED)  # a whole context: no token follows it
    assert run(engine)["full"][-1].embedding is not None


def test_a_text_to_embed_gets_the_special_tokens_its_tokenizer_adds(hf_dir, tmp_path) -> None:  # noqa: F811
    """Qwen3-Embedding's tokenizer appends its EOS, and the model pools there: a text to embed is tokenized with the
    tokenizer's special tokens (`prompt_ids` without `special` gives the text's own)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from pylon.serving.engine.tokenization import embedding_ids, load_model_tokenizer, prompt_ids

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    eos = raw.token_to_id("</s>")
    raw.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>").save_pretrained(str(tmp_path))
    tokenizer = load_model_tokenizer(str(tmp_path))
    assert embedding_ids(tokenizer, "hello world") == prompt_ids(tokenizer, "hello world") + [eos]
