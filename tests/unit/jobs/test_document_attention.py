"""`attention_mask: document`: each document packed into a row is attended on its own, as if it were alone.

The rows (`Batch.to_torch(documents=True)`): positions restart where a document starts (after a text dataset's eos,
at a chat dataset's marked conversation start, and where the padding starts), no attention mask, and a document's
first token is no label. The model (`transformers`, through `pylon.jobs.train.model_inputs`) turns the positions
into a block-diagonal causal mask, so the loss of a packed row is exactly the sum of its documents' losses computed
one document at a time; `check_document_attention` refuses an architecture that would attend across anyway; the
held-out evaluation (`pylon eval`, a model or a deployment) scores the same way; the planner counts the mask."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pylon.data.prepare import prepare
from pylon.data.reader import Batch
from pylon.data.shards import DOCUMENT_START, DataError, read_manifest, separate_documents, split_words
from pylon.errors import PylonError
from pylon.jobs.train import check_document_attention, model_inputs, token_loss_sum

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from test_chat_data import CONVERSATIONS, _jsonl, _tokenizer  # noqa: E402
from test_prepare import read_rows  # noqa: E402

EOS, PAD = 0, 1


def _model(model_type: str, vocab: int = 64, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {
        "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
        "opt": dict(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
            max_position_embeddings=64,
        ),
    }.get(model_type, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64))  # fmt: skip
    config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=EOS, eos_token_id=EOS,
                                  pad_token_id=PAD, **sizes)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _text_rows() -> tuple[np.ndarray, np.ndarray, list[list[list[int]]]]:
    """Two rows of 12 packed from documents ending in eos (the first row's last document runs on into the second
    row, the second row ends in padding), and each row's documents as they are cut."""
    docs = [[5, 6, 7, EOS], [8, 9, 10, 11, 12, EOS], [13, 14, 15, 16, 17, EOS], [18, 19, 20, EOS]]
    flat = [t for d in docs for t in d]  # 20 tokens
    tokens = np.full((2, 12), PAD, dtype=np.uint16)
    tokens[0], tokens[1, :8] = flat[:12], flat[12:]
    pieces = [[flat[0:4], flat[4:10], flat[10:12]], [flat[12:16], flat[16:20]]]
    return tokens, np.array([12, 8], dtype=np.int32), pieces


def test_positions_restart_at_each_document_and_its_first_token_is_no_label() -> None:
    tokens, num_tokens, _ = _text_rows()
    inputs = Batch(np.arange(2), tokens, num_tokens, 0.0, eos_id=EOS).to_torch(PAD, documents=True)
    assert "attention_mask" not in inputs
    assert inputs["position_ids"].tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1],
        [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3],  # the padding: a segment of its own
    ]
    labels = inputs["labels"]
    assert labels[0, [4, 10]].tolist() == [-100, -100] and labels[1, 4] == -100  # each document's first token
    assert (labels[1, 8:] == -100).all()  # padding
    want = int((torch.from_numpy(tokens.astype(np.int64)) != -1).sum()) - 3 - 4  # minus 3 starts and 4 padding
    assert int((labels != -100).sum()) == want
    # causal: the mask and the labels it always had
    plain = Batch(np.arange(2), tokens, num_tokens, 0.0, eos_id=EOS).to_torch(PAD)
    assert "position_ids" not in plain and plain["attention_mask"].sum() == 20
    with pytest.raises(ValueError, match="eos_id"):
        Batch(np.arange(2), tokens, num_tokens, 0.0).to_torch(PAD, documents=True)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3"])
def test_a_packed_rows_loss_is_its_documents_losses_each_alone(model_type) -> None:
    model = _model(model_type)
    tokens, num_tokens, pieces = _text_rows()
    batch = Batch(np.arange(2), tokens, num_tokens, 0.0, eos_id=EOS)
    with torch.no_grad():
        inputs = batch.to_torch(PAD, documents=True)
        packed, n_packed = token_loss_sum(model(**model_inputs(inputs)).logits, inputs["labels"])
        alone, n_alone = 0.0, 0
        for row in pieces:
            for doc in row:
                ids = torch.tensor([doc])
                part, n = token_loss_sum(model(input_ids=ids).logits, ids)
                alone, n_alone = alone + float(part), n_alone + n
        plain_inputs = batch.to_torch(PAD)
        plain, _ = token_loss_sum(model(**model_inputs(plain_inputs)).logits, plain_inputs["labels"])
    assert n_packed == n_alone == 20 - 2 - 3  # 20 real tokens, 2 row starts, 3 document starts inside rows
    assert float(packed) == pytest.approx(alone, rel=1e-5)
    # attended across documents the same tokens score otherwise (and the 3 document starts count too)
    assert abs(float(plain) - alone) > 1e-3


def test_the_check_passes_models_that_read_packed_positions_and_refuses_the_others() -> None:
    assert check_document_attention(_model("llama"), 64, where="preset llama-tiny") < 1e-4
    model = _model("gpt2")
    model.train()
    assert check_document_attention(model, 64, where="config gpt2") < 1e-4
    assert model.training  # restored
    for model_type in ("bloom", "opt"):  # ALiBi from an attention mask; positions from the mask's cumsum
        with pytest.raises(PylonError, match=f"config {model_type} does not attend packed documents apart") as e:
            check_document_attention(_model(model_type), 64, where=f"config {model_type}")
        assert "attention_mask: causal" in str(e.value)


def test_chat_rows_mark_where_each_conversation_starts(tmp_path) -> None:
    from pylon.data.tokenizer import load_tokenizer

    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    conversations = CONVERSATIONS * 3
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in conversations])
    out = str(tmp_path / "sft")
    manifest = prepare([source], out, seq_len=32, tokenizer=tokenizer, chat=True, packing="wrapped", progress=False)
    assert manifest.document_starts and manifest.loss_mask
    _, tokens, num_tokens, ids = read_rows(out)
    words, context, starts = split_words(tokens, loss_mask=True, eos_id=tok.eos_id)
    lengths = [len(tok.encode_chat(c, "test")[0][0]) for c in conversations]
    flat_starts = np.flatnonzero(starts.reshape(-1))
    assert flat_starts.tolist() == np.cumsum([0, *lengths[:-1]]).tolist()  # each conversation's first token
    assert words.max() < DOCUMENT_START and (words[starts] == words.reshape(-1)[flat_starts]).all()
    inputs = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id, documents=True)
    positions = inputs["position_ids"].reshape(-1)[: sum(lengths)]
    assert (positions[torch.from_numpy(flat_starts)] == 0).all()
    # a row that begins inside a conversation continues it from position 0; the labels are the replies' alone,
    # as they are under causal attention (a conversation's first token is never a reply)
    plain = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id)
    assert torch.equal(inputs["labels"], plain["labels"])


def test_which_datasets_attend_documents_apart(tmp_path) -> None:
    tokenizer = _tokenizer(tmp_path / "tok")
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CONVERSATIONS])
    chat = read_manifest(str(prepare([source], str(tmp_path / "c"), seq_len=32, tokenizer=tokenizer, chat=True,
                                     progress=False) and tmp_path / "c"))  # fmt: skip
    text_src = tmp_path / "t.txt"
    text_src.write_text("some text to pack\n" * 20)
    prepare([str(text_src)], str(tmp_path / "t"), seq_len=32, progress=False)
    text = read_manifest(str(tmp_path / "t"))
    assert [separate_documents(s, chat, "c") for s in ("auto", "causal", "document")] == [True, False, True]
    assert [separate_documents(s, text, "t") for s in ("auto", "causal", "document")] == [False, False, True]
    old = chat.model_copy(update={"document_starts": False})  # a chat dataset prepared before the marks
    assert separate_documents("auto", old, "c") is False
    with pytest.raises(DataError, match=r"^s3://b/sft: attention_mask document .* prepare it again"):
        separate_documents("document", old, "s3://b/sft")


def test_held_out_rows_score_each_document_as_its_own_prompt(tmp_path) -> None:
    """`pylon eval` on a model directory and on a deployment (one prompt per document, its echoed logprobs summed
    by `prompt_loss_sum`) give the trainer's figure."""
    from pylon.sdk.evaluate import held_out, model_loss, prompt_loss_sum, reduce_losses

    docs = [{"text": f"document {i}: " + "word " * (i % 7 + 1)} for i in range(40)]  # 17-43 bytes each
    data = str(tmp_path / "ds")
    prepare([_jsonl(tmp_path / "docs.jsonl", docs)], data, seq_len=48, progress=False)
    manifest = read_manifest(data)
    model = _model("llama", vocab=manifest.tokenizer.vocab_size)
    model.save_pretrained(tmp_path / "m")

    held = held_out(data, 0.5, attention_mask="document")
    assert held.documents and any(len(held.pieces(s)) > 1 for s in held.sequences)
    loss, tokens, _ = model_loss(str(tmp_path / "m"), held, batch_size=3, device="cpu")
    parts = []  # as endpoint_loss scores: each piece a prompt, position t's logprob of token t+1
    with torch.no_grad():
        for seq in held.sequences:
            ids = held.token_ids(seq)
            for lo, hi in held.pieces(seq):
                logp = torch.log_softmax(model(input_ids=torch.from_numpy(ids[lo:hi])[None]).logits[0].float(), -1)
                echoed = [None] + [float(logp[t, ids[lo + t + 1]]) for t in range(hi - lo - 1)]
                parts.append(prompt_loss_sum(echoed, hi - lo))
    want, want_tokens = reduce_losses(parts)
    assert tokens == want_tokens and loss == pytest.approx(want, rel=1e-5)
    causal, causal_tokens, _ = model_loss(str(tmp_path / "m"), held_out(data, 0.5), batch_size=3, device="cpu")
    assert causal_tokens > tokens and not math.isclose(causal, loss, rel_tol=1e-4)


def test_the_planner_counts_the_block_mask() -> None:
    from transformers import AutoConfig

    from pylon.plan.activations import step_activations

    config = AutoConfig.for_model("llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    kw = dict(micro_batch=4, seq_len=512, precision="bf16", checkpointing=False, lora=None, device="cuda")
    causal = step_activations(config, **kw)
    documents = step_activations(config, documents=True, **kw)
    # the (batch, 1, seq, seq) booleans transformers builds, kept for backward by the fused kernel
    assert documents.saved_bytes - causal.saved_bytes >= 4 * 512 * 512
