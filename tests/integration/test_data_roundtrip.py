"""Round trip: text -> `prepare` -> Ray Data stream -> decode gives back exactly the original tokens.

Both formats, from local disk and from the S3 server, prepared on the session's Ray cluster.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from pylon.data.prepare import prepare
from pylon.data.reader import ShardStream
from pylon.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> tuple[Path, list[str]]:
    """Source files and, in the order `prepare` reads them (sorted), their texts."""
    root = tmp_path_factory.mktemp("roundtrip") / "src"
    root.mkdir()
    texts = {}
    for name in ("argparse.py", "base64.py", "colorsys.py"):
        texts[f"a-{name}"] = (STDLIB / name).read_text(encoding="utf-8")
    if SHAKESPEARE.exists():
        texts["b-shakespeare.txt"] = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    texts["c-unicode.txt"] = "naïve café, 日本語, 🦊 — " * 200
    for name, text in texts.items():
        (root / name).write_text(text, encoding="utf-8")
    return root, [texts[k] for k in sorted(texts)]


def _expected_tokens(texts: list[str]) -> np.ndarray:
    tok = load_tokenizer("byte")
    return np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in texts])


def _streamed_tokens(uri: str, **kw) -> tuple[np.ndarray, list[int]]:
    stream = ShardStream(uri, batch_size=37, **kw)
    rows = {}
    for batch in stream.epoch():
        for i, sample in enumerate(batch.sample_ids.tolist()):
            assert sample not in rows
            rows[sample] = batch.tokens[i, : batch.num_tokens[i]]
    order = list(rows)
    return np.concatenate([rows[i] for i in sorted(rows)]), order


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
@pytest.mark.parametrize("store", ["local", "s3"])
def test_text_survives_prepare_and_the_stream_exactly(documents, ray_cluster, s3_root, tmp_path, fmt, store):
    root, texts = documents
    out = f"{s3_root}/{fmt}" if store == "s3" else str(tmp_path / fmt)
    manifest = prepare([str(root)], out, fmt=fmt, seq_len=128, shard_size_mb=0.1, use_ray=True, progress=False)
    assert len(manifest.shards) > 2
    expected = _expected_tokens(texts)

    tokens, order = _streamed_tokens(out, shuffle_buffer=0)
    assert order == sorted(order)  # no shuffling asked for: id order
    assert np.array_equal(tokens, expected)
    tok = load_tokenizer("byte")
    assert _split_on_eos(tokens, tok) == texts

    shuffled, order = _streamed_tokens(out, shuffle_buffer=64, seed=4)
    assert order != sorted(order)
    assert np.array_equal(shuffled, expected)  # same samples, reassembled by id


def _split_on_eos(tokens: np.ndarray, tok) -> list[str]:
    bounds = np.flatnonzero(tokens == tok.eos_id)
    out, start = [], 0
    for end in bounds:
        out.append(tok.decode(tokens[start:end].tolist()))
        start = end + 1
    return out
