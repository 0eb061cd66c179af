"""Packing documents into rows (`pylon data prepare --packing`): wrapped (one after another, cut wherever a row ends)
or bfd (each whole in one row, best-fit decreasing, as TRL packs), the default for conversations, where a
conversation cut across two rows would train the second part's replies without their prompt."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from pylon.data.prepare import pack_whole, prepare
from pylon.data.reader import Batch
from pylon.data.shards import DataError, split_words
from pylon.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat_data import CONVERSATIONS, _jsonl, _tokenizer  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

PAD = 99


def _pieces(lengths: list[int]) -> list[np.ndarray]:
    return [np.full(n, i + 1, dtype=np.int32) for i, n in enumerate(lengths)]


def test_each_piece_lands_whole_in_one_row_best_fit_decreasing() -> None:
    lengths = [5, 3, 8, 2, 6, 12, 4, 1]
    tokens, num_tokens, truncated, cut = pack_whole(_pieces(lengths), seq_len=10, pad_id=PAD, dtype="int32")
    assert (truncated, cut) == (1, 2)  # the 12 cut to 10
    rows = [[int(v) for v in row[:n]] for row, n in zip(tokens, num_tokens)]
    assert all((row[n:] == PAD).all() for row, n in zip(tokens, num_tokens))
    # every piece exactly once, contiguous and whole in one row (the long one cut to the row)
    for i, n in enumerate(lengths):
        holding = [r for r in rows if i + 1 in r]
        assert len(holding) == 1 and holding[0].count(i + 1) == min(n, 10), (i, rows)
    # best-fit decreasing: 10 | 8 | 6+4 | 5+3, then the 2 into the tightest of the two rows with 2 free, the 1 into
    # the other: 4 rows for 39 tokens, the fewest 10-token rows can hold them
    assert sorted(sorted(set(r)) for r in rows) == [[1, 2, 4], [3, 8], [5, 7], [6]]
    # rows follow the source: ordered by their first piece, pieces in source order within a row
    firsts = [r[0] for r in rows]
    assert firsts == sorted(firsts) and all(r == sorted(r) for r in rows)
    assert int(num_tokens.sum()) == sum(lengths) - cut


def test_a_conversation_is_never_cut_across_rows(tmp_path) -> None:
    tokenizer = _tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tokenizer)
    conversations = CONVERSATIONS * 5
    lengths = [len(tok.encode_chat(c, "test")[0][0]) for c in conversations]
    seq_len = max(lengths) + 8  # every conversation fits a row
    source = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in conversations])
    out = str(tmp_path / "sft")
    manifest = prepare([source], out, seq_len=seq_len, tokenizer=tokenizer, chat=True, progress=False)
    assert manifest.packing == "bfd" and manifest.totals.truncated_documents == 0
    assert "each document whole in a row" in manifest.summary()
    _, tokens, num_tokens, ids = read_rows(out)
    words, _, starts = split_words(tokens, loss_mask=True, eos_id=tok.eos_id)
    found = []
    for row, n, first in zip(words, num_tokens, starts):
        at = np.flatnonzero(first[:n]).tolist()
        assert at and at[0] == 0  # a row starts with a conversation, never with the end of one
        found += np.diff([*at, int(n)]).tolist()
    assert sorted(found) == sorted(lengths)  # each conversation whole, once
    # fewer rows than conversations (they share rows), and every reply token counted under document attention
    assert len(ids) < len(conversations)
    labels = Batch(ids, tokens, num_tokens, 0.0, True, tok.eos_id).to_torch(tok.pad_id, documents=True)["labels"]
    replies = sum(int(r.sum()) for c in conversations for _, r in tok.encode_chat(c, "test"))
    assert int((labels != -100).sum()) == replies


def test_documents_longer_than_a_row_are_cut_and_said(tmp_path, caplog) -> None:
    docs = [{"text": "x" * n} for n in (10, 40, 25, 70)]  # the byte tokenizer: a token a byte, plus eos
    out = str(tmp_path / "ds")
    with caplog.at_level(logging.WARNING, logger="pylon.data.prepare"):
        manifest = prepare([_jsonl(tmp_path / "d.jsonl", docs)], out, seq_len=32, packing="bfd", progress=False)
    t = manifest.totals
    assert (t.truncated_documents, t.truncated_tokens) == (2, (41 - 32) + (71 - 32))
    assert t.tokens == 11 + 32 + 26 + 32 and t.rows == 4  # 11 does not fit beside 26
    assert "2 of 4 documents longer than seq_len 32 were cut to it" in caplog.text
    wrapped = prepare([_jsonl(tmp_path / "d.jsonl", docs)], str(tmp_path / "w"), seq_len=32, progress=False)
    assert wrapped.packing == "wrapped" and wrapped.totals.tokens == 11 + 41 + 26 + 71  # every token kept
    with pytest.raises(DataError, match="packing 'tight': must be one of auto, wrapped, bfd"):
        prepare([_jsonl(tmp_path / "d.jsonl", docs)], str(tmp_path / "x"), packing="tight", progress=False)
