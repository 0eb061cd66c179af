"""`pylon data chat-template`: a base model's tokenizer copied with a chat template (a built-in or a Jinja file), so
that a chat dataset can be prepared with it and the export carries the same template; a template that does not
render a conversation, or an existing --out, is refused before anything is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pylon.cli import main
from pylon.data.prepare import prepare
from pylon.data.shards import DataError
from pylon.data.tokenizer import ZEPHYR_TEMPLATE, load_tokenizer, with_chat_template

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harmony_models import bpe_tokenizer  # noqa: E402
from test_chat_data import _jsonl  # noqa: E402
from test_prepare import no_cluster, read_rows  # noqa: E402, F401 (fixture)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
     {"role": "assistant", "content": "Hello, friend"}],
]  # fmt: skip


def _base(directory: Path, template: str | None = None) -> str:
    text = " ".join(m["content"] for c in CHATS for m in c) * 3
    bpe_tokenizer(["<s>", "</s>"], template, text=text, eos_token="</s>", bos_token="<s>").save_pretrained(directory)
    return str(directory)


def test_a_base_tokenizer_gets_a_template_and_a_chat_dataset_prepares_with_it(tmp_path, capsys) -> None:
    base = _base(tmp_path / "base")
    chats = _jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    with pytest.raises(DataError, match="has no chat template"):
        prepare([chats], str(tmp_path / "no"), tokenizer=base, chat=True, progress=False)

    out = str(tmp_path / "chat-tok")
    assert main(["data", "chat-template", base, "--template", "zephyr", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "<|assistant|>" in printed and "warning" not in printed and f"--tokenizer {out}" in printed
    assert (Path(out) / "chat_template.jinja").read_text() == ZEPHYR_TEMPLATE
    assert "chat_template" not in json.loads((Path(out) / "tokenizer_config.json").read_text())
    tok = load_tokenizer(out)
    assert tok.vocab_size == load_tokenizer(base).vocab_size  # no token added: nothing to resize

    manifest = prepare([chats], str(tmp_path / "sft"), tokenizer=out, chat=True, progress=False)
    assert manifest.loss_mask and manifest.totals.documents == len(CHATS)
    _, tokens, num_tokens, _ = read_rows(str(tmp_path / "sft"))
    hf = tok._tok
    want = [hf(hf.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"] for c in CHATS]
    stored = [abs(int(w)) for row, n in zip(tokens, num_tokens) for w in row[:n]]
    assert len(stored) == sum(len(w) for w in want)
    # each reply is counted with the eos that ends its turn: a fine-tuned model ends its replies where serving stops
    replies = [int(w) & 0xFFFFFF for row, n in zip(tokens, num_tokens) for w in row[:n] if w >= 0]
    assert replies.count(tok.eos_id) == len(CHATS)

    # the export's tokenizer files are the dataset's: the same template, so serving renders chats the same way
    from transformers import AutoTokenizer

    from pylon.jobs.export import write_tokenizer_files

    (tmp_path / "export").mkdir()
    write_tokenizer_files(manifest.tokenizer.model_dump(mode="json"), str(tmp_path / "export"), None)
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    assert exported.chat_template == ZEPHYR_TEMPLATE


def test_a_template_file_replaces_the_tokenizers_own_and_bad_ones_are_refused(tmp_path) -> None:
    base = _base(tmp_path / "base", template="{{ messages[0]['content'] }}")  # a template of its own, replaced
    chatml = tmp_path / "chatml.jinja"
    chatml.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out = tmp_path / "chatml-tok"
    assert main(["data", "chat-template", base, "--template", str(chatml), "--out", str(out), "--json"]) == 0
    tok = load_tokenizer(str(out))
    rendered = tok._tok.apply_chat_template(CHATS[0], tokenize=False)
    assert rendered.startswith("<|im_start|>user\nWhat is the capital")
    with pytest.raises(DataError, match="already exists; pass --overwrite"):
        with_chat_template(base, str(chatml), str(out))
    with_chat_template(base, "zephyr", str(out), overwrite=True)
    assert (out / "chat_template.jinja").read_text() == ZEPHYR_TEMPLATE

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")  # unclosed
    with pytest.raises(DataError, match=f"chat template {broken}"):
        with_chat_template(base, str(broken), str(tmp_path / "never"))
    no_reply = tmp_path / "no-reply.jinja"
    no_reply.write_text("{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}{% endfor %}")  # no reply
    with pytest.raises(DataError, match=f"chat template {no_reply}"):
        with_chat_template(base, str(no_reply), str(tmp_path / "never"))
    with pytest.raises(DataError, match="not a built-in .* cannot be read"):
        with_chat_template(base, "chatml-please", str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()  # nothing written for a refused template
    single = tmp_path / "tokenizer.json"
    single.write_bytes((Path(base) / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="not a single `tokenizers` file"):
        with_chat_template(str(single), "zephyr", str(tmp_path / "never"))
