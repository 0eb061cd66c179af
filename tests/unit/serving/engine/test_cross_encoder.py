"""Cross-encoders (model/encoder.py): BERT's and XLM-RoBERTa's `*ForSequenceClassification` checkpoints (and every
other encoder family's, `test_each_encoder_family_classifies_and_embeds_as_transformers_does`) served as classifiers, each input read whole, both ways, in batches of inputs of different lengths: every input's logits are
`transformers`' own for the tokenizer's encoding of it (a pair with its segments), over HTTP as in the engine; what a
decoder needs is refused by name."""

from __future__ import annotations

import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, BertTokenizerFast

from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest
from pylon.serving.model.families import ENCODER_MODEL_TYPES
from pylon.specs import EngineSpec

WORDS = "the a quick brown fox jumps over lazy dog stock prices fell today hello world what is capital of france paris"
QUERY = "what is the capital of france"
DOCUMENTS = ["paris", "the quick brown fox", "stock prices fell today", "hello world"]
POOL = SamplingParams(max_tokens=0, embed=True)


def save(directory, model_type: str):
    """A tiny random cross-encoder of `model_type` (one label) with a WordPiece tokenizer of WORDS."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS.split()))]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(directory / "vocab.txt"))
    tokenizer.save_pretrained(directory)
    fields = {
        "vocab_size": len(vocab),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_labels": 1,
        "pad_token_id": 0,
        "initializer_range": 0.5,  # (at the default scale a random head scores every input alike)
    }
    if model_type == "bert":
        fields["type_vocab_size"] = 2
    else:  # RoBERTa's positions start after its padding index
        fields.update(max_position_embeddings=514, type_vocab_size=1)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def encoder(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "model"
    model, tokenizer = save(directory, request.param)
    return model, tokenizer, str(directory)


def reference(model, tokenizer, a: str, b: str | None = None) -> float:
    with torch.no_grad():
        segments = model.config.type_vocab_size > 1  # (XLM-RoBERTa's tokenizer gives none)
        return model(**tokenizer(a, b, return_tensors="pt", return_token_type_ids=segments)).logits[0, 0].item()


def spec(**fields) -> EngineSpec:
    return EngineSpec(
        **{"device": "cpu", "dtype": "fp32", "max_model_len": 128, "max_num_batched_tokens": 64, **fields}
    )


def test_every_input_reads_as_transformers_reads_it(encoder) -> None:
    model, tokenizer, directory = encoder
    engine = LLMEngine(directory, spec())
    assert engine.encoder and engine.generation.classifier.labels == ("LABEL_0",)
    pairs = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]  # different lengths, in the same steps
    singles = [tokenizer(d)["input_ids"] for d in DOCUMENTS]
    for i, ids in enumerate(pairs + singles):
        engine.add_request(str(i), ids, POOL)
    outs = {}
    steps = 0
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
        steps += 1
    assert steps < len(pairs + singles)  # batched (64 tokens a step)
    for i, d in enumerate(DOCUMENTS):
        (got,) = outs[str(i)].embedding
        assert abs(got - reference(model, tokenizer, QUERY, d)) < 1e-5, d
        (alone,) = outs[str(len(pairs) + i)].embedding
        assert abs(alone - reference(model, tokenizer, d)) < 1e-5, d
    with pytest.raises(InvalidRequest, match="reads each input whole"):
        engine.add_request("long", [2] + [5] * 70 + [3], POOL)  # 72 tokens of a 64-token step
    with pytest.raises(InvalidRequest, match="classifier"):
        engine.add_request("gen", singles[0], SamplingParams(max_tokens=2))


def test_what_needs_a_decoder_is_refused_by_name(encoder) -> None:
    _, _, directory = encoder
    with pytest.raises(PylonError, match="engine.quantization"):
        LLMEngine(directory, spec(quantization="int8"))
    with pytest.raises(PylonError, match="engine.speculative.method"):
        LLMEngine(directory, spec(speculative={"method": "ngram", "num_tokens": 2}))


def test_a_cross_encoder_reranks_over_http(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
    from test_serving_http import auth, serving

    model, tokenizer = save(tmp_path / "bert", "bert")
    with serving(str(tmp_path / "bert"), max_num_batched_tokens=64, max_model_len=128, kv_cache_tokens=1024) as (
        url,
        _,
    ):
        r = requests.post(
            f"{url}/v1/rerank",
            headers=auth(),
            json={"model": "tiny", "query": QUERY, "documents": DOCUMENTS},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        scores = [torch.sigmoid(torch.tensor(reference(model, tokenizer, QUERY, d))).item() for d in DOCUMENTS]
        got = r.json()["results"]
        # each document's score is transformers', best first; documents that score the same (two texts the tiny
        # vocabulary tokenizes alike) may come in either order, as float rounding in their batches falls
        assert sorted(x["index"] for x in got) == list(range(len(DOCUMENTS))), got
        assert all(abs(x["relevance_score"] - scores[x["index"]]) < 1e-5 for x in got), (got, scores)
        ranked = [x["relevance_score"] for x in got]
        assert ranked == sorted(ranked, reverse=True), got
        tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
        assert r.json()["usage"]["prompt_tokens"] == tokens


def save_embedder(directory, pooling: str | None, extra_module: bool = False, model_type: str = "bert"):
    """A tiny random BERT (or `model_type`) embedding model (no head), with sentence-transformers files naming
    `pooling` (None: none)."""
    import json

    _, tokenizer = save(directory, model_type)  # its vocabulary and tokenizer files
    for name in ("config.json", "model.safetensors"):
        (directory / name).unlink()
    positions = {} if model_type == "bert" else {"max_position_embeddings": 514, "type_vocab_size": 1}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=0,
        initializer_range=0.5,
        **positions,
    )
    torch.manual_seed(1)
    from transformers import AutoModel

    model = AutoModel.from_config(config).eval()
    model.save_pretrained(directory)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if extra_module:
            modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(
            json.dumps({"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean"})
        )
    return model, tokenizer


@pytest.mark.parametrize("pooling", [None, "cls", "mean"])
def test_an_encoders_embeddings_are_its_pooled_hidden_states(tmp_path, pooling) -> None:
    """An encoder that is not a classifier embeds: each input's CLS state (no sentence-transformers files, or theirs
    saying CLS) or its tokens' mean (theirs saying mean), as transformers computes them, inputs of different lengths
    batched; it generates nothing, and a module it would not apply (a Dense layer) stops it at start by name."""
    model, tokenizer = save_embedder(tmp_path / "e", pooling)
    engine = LLMEngine(str(tmp_path / "e"), spec())
    assert engine.generation.classifier is None
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "paris"]
    for i, t in enumerate(texts):
        engine.add_request(str(i), tokenizer(t)["input_ids"], POOL)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    for i, t in enumerate(texts):
        with torch.no_grad():
            hidden = model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0]
        want = hidden.mean(0) if pooling == "mean" else hidden[0]
        assert torch.allclose(torch.tensor(outs[str(i)].embedding), want, atol=1e-5), (pooling, t)
    with pytest.raises(InvalidRequest, match="embedding model"):
        engine.add_request("gen", tokenizer("hi")["input_ids"], SamplingParams(max_tokens=2))
    save_embedder(tmp_path / "dense", "mean", extra_module=True)
    with pytest.raises(PylonError, match="modules.json has sentence_transformers.models.Dense"):
        LLMEngine(str(tmp_path / "dense"), spec())


@pytest.mark.slow  # make test-all: ~11 s
def test_an_encoders_embeddings_over_http(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
    from test_serving_http import auth, serving

    model, tokenizer = save_embedder(tmp_path / "e", "mean")
    with serving(str(tmp_path / "e"), max_num_batched_tokens=64, max_model_len=128, kv_cache_tokens=1024) as (url, _):
        texts = ["hello world", "paris"]
        r = requests.post(f"{url}/v1/embeddings", headers=auth(), json={"model": "tiny", "input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        for data, t in zip(r.json()["data"], texts):
            with torch.no_grad():
                want = model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0].mean(0)
            want = want / want.norm()
            assert torch.allclose(torch.tensor(data["embedding"]), want, atol=1e-5), t
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        refused = requests.post(f"{url}/v1/chat/completions", headers=auth(), json=chat, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def save_m3(directory):
    """A tiny bge-m3: an XLM-RoBERTa embedding model pooled by its CLS token, with bge-m3's two token heads beside its
    weights as it ships them (colbert_linear.pt: hidden -> 24, sparse_linear.pt: hidden -> 1)."""
    model, tokenizer = save_embedder(directory, "cls", model_type="xlm-roberta")
    torch.manual_seed(2)
    colbert, sparse = torch.nn.Linear(32, 24), torch.nn.Linear(32, 1)
    torch.save(colbert.state_dict(), directory / "colbert_linear.pt")
    torch.save(sparse.state_dict(), directory / "sparse_linear.pt")
    return model, tokenizer, colbert, sparse


def m3_reference(model, tokenizer, colbert, sparse, text: str) -> tuple[torch.Tensor, torch.Tensor, dict, list]:
    """FlagEmbedding's BGEM3FlagModel outputs for `text`, computed here: the dense vector (the CLS state,
    normalised), the ColBERT vectors (every token's but the CLS's, normalised), the lexical weights (each token id's
    largest relu(sparse) weight, CLS, SEP, PAD and UNK left out, weights above 0) and every token's weight."""
    with torch.no_grad():
        encoded = tokenizer(text, return_tensors="pt")
        hidden = model(**encoded).last_hidden_state[0]
        weights = torch.relu(sparse(hidden))[:, 0]
        vectors = torch.nn.functional.normalize(colbert(hidden[1:]), dim=-1)
    unused = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    lexical: dict[str, float] = {}
    for token, w in zip(encoded["input_ids"][0].tolist(), weights.tolist()):
        if token not in unused and w > lexical.get(str(token), 0):
            lexical[str(token)] = w
    dense = hidden[0] / hidden[0].norm()
    return dense, vectors, lexical, weights.tolist()


@pytest.mark.slow  # make test-all: ~25 s
def test_bge_m3s_dense_sparse_and_multi_vector_outputs_over_http(tmp_path) -> None:
    """bge-m3's three outputs from one deployment, each as FlagEmbedding computes it: /v1/embeddings its dense
    vectors; /pooling with task token_embed its ColBERT vectors, token_classify its tokens' sparse weights (the CLS and
    the last SEP left out, vLLM's), and lexical_weights FlagEmbedding's {token id: weight}; a model without the heads
    refuses the token tasks naming task, and a task and a vector's settings do not mix."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
    from test_serving_http import auth, serving

    model, tokenizer, colbert, sparse = save_m3(tmp_path / "m3")
    texts = ["what is the capital of france", "paris paris hello world"]
    with serving(str(tmp_path / "m3"), max_num_batched_tokens=64, max_model_len=128, kv_cache_tokens=1024) as (url, _):

        def pool(task: str, **extra):
            body = {"model": "tiny", "input": texts, "task": task, **extra}
            return requests.post(f"{url}/pooling", headers=auth(), json=body, timeout=60)

        dense = requests.post(
            f"{url}/v1/embeddings", headers=auth(), json={"model": "tiny", "input": texts}, timeout=60
        )
        vectors, weights, lexical = pool("token_embed"), pool("token_classify"), pool("lexical_weights")
        for r in (dense, vectors, weights, lexical):
            assert r.status_code == 200, r.text
        for i, text in enumerate(texts):
            want_dense, want_vectors, want_lexical, want_weights = m3_reference(model, tokenizer, colbert, sparse, text)
            assert torch.allclose(torch.tensor(dense.json()["data"][i]["embedding"]), want_dense, atol=1e-5)
            got = torch.tensor(vectors.json()["data"][i]["data"])
            assert got.shape == want_vectors.shape and torch.allclose(got, want_vectors, atol=1e-5), text
            got = [w for (w,) in weights.json()["data"][i]["data"]]
            assert len(got) == len(want_weights) - 2  # the CLS and the SEP left out
            assert all(abs(g - w) < 1e-5 for g, w in zip(got, want_weights[1:-1])), text
            got = lexical.json()["data"][i]["data"]
            assert got.keys() == want_lexical.keys() and all(abs(got[k] - want_lexical[k]) < 1e-5 for k in got)
        assert lexical.json()["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts)
        for extra, param in (({"dimensions": 8}, "dimensions"), ({"encoding_format": "base64"}, "encoding_format")):
            r = pool("token_embed", **extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = pool("classify")
        assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text
        assert "token_classify" in r.json()["error"]["message"]  # (the tasks it has, named)

    save_embedder(tmp_path / "plain", "cls")
    with serving(str(tmp_path / "plain"), max_num_batched_tokens=64, max_model_len=128, kv_cache_tokens=1024) as (
        url,
        _,
    ):
        body = {"model": "tiny", "input": "paris", "task": "token_embed"}
        r = requests.post(f"{url}/pooling", headers=auth(), json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text
        assert "colbert_linear.pt" in r.json()["error"]["message"]


def tiny(model_type: str, vocab_size: int, **fields):
    """A tiny config of an encoder family, its token ids in WORDS' vocabulary ([PAD] 0, [CLS] 2, [SEP] 3, [MASK] 4)."""
    sizes = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 64}
    if model_type == "distilbert":
        sizes = {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}
    ids = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3}
    extra = {
        "electra": {"embedding_size": 32, "type_vocab_size": 2},
        "nomic_bert": {"type_vocab_size": 2},
        "deberta-v2": {"type_vocab_size": 0},
        "modernbert": {"mask_token_id": 4},
        "eurobert": {"mask_token_id": 4, "num_key_value_heads": 2},
    }.get(model_type, {})
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        max_position_embeddings=160,
        initializer_range=0.5,
        **sizes,
        **ids,
        **extra,
        **fields,
    )


FAMILIES = [t for t in ENCODER_MODEL_TYPES if t not in ("bert", "xlm-roberta")]  # (those two: the tests above)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_encoder_family_classifies_and_embeds_as_transformers_does(tmp_path, model_type) -> None:
    """Every encoder family the engine serves, a classifier (two labels) and an embedding model (mean pooling) of
    each: pairs and single texts of different lengths batched in the same steps read as transformers reads each
    alone; the longest input is what the family's position table holds (RoBERTa's and MPNet's start after their
    padding index)."""
    import json

    from transformers import AutoModel

    from pylon.serving.model.encoder import EncoderRunner

    _, tokenizer = save(tmp_path / "vocab", "bert")
    classifier_dir, embedder_dir = tmp_path / "classifier", tmp_path / "embedder"
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_config(tiny(model_type, len(tokenizer), num_labels=2))
    torch.manual_seed(1)
    embedder = AutoModel.from_config(tiny(model_type, len(tokenizer)))
    for directory, model in ((classifier_dir, classifier), (embedder_dir, embedder)):
        model.eval().save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    (embedder_dir / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (embedder_dir / "1_Pooling").mkdir()
    (embedder_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    segments = getattr(classifier.config, "type_vocab_size", 1) > 1

    def encode(a: str, b: str | None = None) -> dict:
        return tokenizer(a, b, return_tensors="pt", return_token_type_ids=segments)

    engine = LLMEngine(str(classifier_dir), spec())
    assert engine.encoder and engine.generation.classifier.labels == ("LABEL_0", "LABEL_1")
    inputs = [encode(QUERY, d) for d in DOCUMENTS] + [encode(d) for d in DOCUMENTS]
    for i, enc in enumerate(inputs):
        engine.add_request(str(i), enc["input_ids"][0].tolist(), POOL)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    for i, enc in enumerate(inputs):
        with torch.no_grad():
            want = classifier(**enc).logits[0]
        got = torch.tensor(outs[str(i)].embedding)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (model_type, i, (got - want).abs().max().item())

    engine = LLMEngine(str(embedder_dir), spec())
    assert engine.generation.classifier is None
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "paris"]
    for i, t in enumerate(texts):
        engine.add_request(str(i), encode(t)["input_ids"][0].tolist(), POOL)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    for i, t in enumerate(texts):
        with torch.no_grad():
            want = embedder(**encode(t)).last_hidden_state[0].mean(0)
        assert torch.allclose(torch.tensor(outs[str(i)].embedding), want, rtol=1e-4, atol=1e-5), (model_type, t)

    runner = EncoderRunner(str(embedder_dir), device="cpu", dtype="fp32")
    # Positions from the padding index + 1: the config's (0) for RoBERTa's kin, MPNet's own 1 whatever the config says
    after = {"roberta": 1, "xlm-roberta-xl": 1, "camembert": 1, "mpnet": 2}.get(model_type, 0)
    assert runner.max_position_embeddings == 160 - after
