"""Tokenizers for preparing data: the built-in byte-level one, a `tokenizers` JSON file, or a Hugging Face
tokenizer directory, behind one small interface (`encode`, `decode`, `eos_id`, `pad_id`, `vocab_size`, `info`).

    load_tokenizer("byte")                          # no files: UTF-8 bytes 0-255, eos 256, pad 257
    load_tokenizer("s3://bucket/tok/tokenizer.json")  # a `tokenizers` JSON file (local path or URI)
    load_tokenizer("/models/llama-tok/")            # a directory `transformers.AutoTokenizer` can load

Documents are encoded without special tokens: packing appends exactly one eos after each document, the
same for every kind, so a tokenizer whose post-processor adds [CLS]/[SEP] or BOS does not change the layout.
`info.sha256` fingerprints the tokenizer's files, so a dataset records exactly which tokenizer made it.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pylon import storage
from pylon.data.shards import DataError, TokenizerInfo
from pylon.errors import StorageError
from pylon.presets import BYTE_VOCAB_SIZE

BYTE_EOS_ID = 256
BYTE_PAD_ID = 257
# Tried in this order when a `tokenizers` file does not say which token ends a document.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    vocab_size: int
    info: TokenizerInfo

    def encode(self, text: str, *, special: bool = False) -> np.ndarray: ...

    def encode_pair(self, text: str, pair: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; 256 ends a document, 257 pads. Needs no files."""

    eos_id: int = BYTE_EOS_ID
    pad_id: int = BYTE_PAD_ID
    vocab_size: int = BYTE_VOCAB_SIZE

    @property
    def info(self) -> TokenizerInfo:
        return TokenizerInfo(
            kind="byte", name="byte", vocab_size=self.vocab_size, eos_id=self.eos_id, pad_id=self.pad_id, sha256=None
        )

    def encode(self, text: str, *, special: bool = False) -> np.ndarray:
        """`text`'s UTF-8 bytes (`special`: the other tokenizers' special tokens; bytes have none to add)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_pair(self, text: str, pair: str) -> np.ndarray:
        """Two texts as one sequence (a cross-encoder's input): their bytes, one after the other."""
        return np.concatenate([self.encode(text), self.encode(pair)])

    def decode(self, ids) -> str:
        # Special and unused ids (>= 256) carry no text; a sequence cut mid-character decodes to U+FFFD.
        if isinstance(ids, list):  # the serving engine's streaming decodes: a few ids, many times a second
            try:
                return bytes(ids).decode("utf-8", errors="replace")
            except (ValueError, TypeError):  # an id past 255 (or not an int): filter as below
                pass
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class TokenizersFileTokenizer:
    """A `tokenizers` JSON file (what `Tokenizer.save()` writes)."""

    def __init__(self, path: str, name: str, sha256: str, *, where: str):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tok = RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a plain Exception for any malformed file
            raise DataError(f"{where}: not a `tokenizers` JSON file ({type(e).__name__}: {e})") from None
        self.eos_id = _first_id(self._tok.token_to_id, EOS_NAMES)
        if self.eos_id is None:
            raise DataError(
                f"{where}: has no end-of-document token; add one of {', '.join(EOS_NAMES)} to its "
                "special tokens (e.g. `trainer = BpeTrainer(special_tokens=['<|endoftext|>'])`)"
            )
        pad = _first_id(self._tok.token_to_id, PAD_NAMES)
        self.pad_id = self.eos_id if pad is None else pad
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.info = TokenizerInfo(
            kind="tokenizers",
            name=name,
            vocab_size=self.vocab_size,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            sha256=sha256,
        )

    def encode(self, text: str, *, special: bool = False) -> np.ndarray:
        """`text`'s ids; `special`: with the special tokens the tokenizer's post-processor adds (a BOS, an EOS)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=special).ids, dtype=np.int64)

    def encode_pair(self, text: str, pair: str) -> np.ndarray:
        """Two texts as one sequence (a cross-encoder's input), with the special tokens the post-processor puts
        around a pair."""
        return np.asarray(self._tok.encode(text, pair, add_special_tokens=True).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


class HuggingFaceTokenizer:
    """A directory `transformers.AutoTokenizer.from_pretrained` loads (never from a hub: local files only)."""

    def __init__(self, path: str, name: str, sha256: str, *, where: str):
        from transformers import AutoTokenizer  # slow to import; only for this kind

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad directory
            raise DataError(f"{where}: not a Hugging Face tokenizer directory ({type(e).__name__}: {e})") from None
        eos = self._tok.eos_token_id
        if eos is None:
            eos = _first_id(self._vocab_id, EOS_NAMES)
        if eos is None:
            raise DataError(
                f"{where}: the tokenizer has no eos token; set `eos_token` in its "
                f"tokenizer_config.json (e.g. one of {', '.join(EOS_NAMES)})"
            )
        self.eos_id = int(eos)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self._tok)  # includes added tokens, unlike `.vocab_size`
        self.info = TokenizerInfo(
            kind="huggingface",
            name=name,
            vocab_size=self.vocab_size,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            sha256=sha256,
        )

    def _vocab_id(self, token: str) -> int | None:
        return self._tok.get_vocab().get(token)

    def encode(self, text: str, *, special: bool = False) -> np.ndarray:
        """`text`'s ids; `special`: with the special tokens the tokenizer adds (a BOS; an EOS, as Qwen3-Embedding's)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=special), dtype=np.int64)

    def encode_pair(self, text: str, pair: str) -> np.ndarray:
        """Two texts as one sequence (a cross-encoder's input), with the special tokens the tokenizer puts around a
        pair (BERT's [CLS] a [SEP] b [SEP], Llama's BOS before each), as sentence-transformers' CrossEncoder and vLLM
        tokenize a pair."""
        return np.asarray(self._tok(text, pair, add_special_tokens=True)["input_ids"], dtype=np.int64)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_chat_prompt(self, messages: list[dict], where: str) -> np.ndarray:
        """A conversation's messages rendered by the chat template with its generation prompt (the assistant's turn
        opened), tokenized as `encode_chat` tokenizes: the prompt a model answers (a prompts dataset's, objective
        grpo's)."""
        if not getattr(self._tok, "chat_template", None):
            raise DataError(
                f"{where}: tokenizer {self.info.name} has no chat template; conversational prompts need one"
            )
        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own error, on this conversation
            raise DataError(f"{where}: the chat template cannot render it ({type(e).__name__}: {e})") from None
        return np.asarray(self._tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def encode_chat(
        self, messages: list[dict], where: str, tools: list[dict] | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """A conversation as the model's chat template renders it and the serving engine tokenizes it (the rendered
        text, its special tokens written in it), and which of its tokens are the assistant's replies (a boolean per
        token: the text from where the template opens an assistant turn, `add_generation_prompt`, to where that
        reply's rendering ends, its end-of-turn token included): one (ids, replies) example. A template that
        renders earlier turns otherwise once the conversation goes on (Qwen3's drops past reasoning) gives one
        example per reply instead, the conversation up to it as the template renders it then, only that reply
        counted: what the model sees when it writes each. A reply whose rendering does not begin with the
        template's opening of an assistant turn is a DataError naming `where` and the message. `tools`: the
        functions the conversation may call, given to the template as Hugging Face templates take them."""
        if not getattr(self._tok, "chat_template", None):
            raise DataError(f"{where}: tokenizer {self.info.name} has no chat template; a chat dataset needs one")

        def render(turns: list[dict], opened: bool) -> str:
            try:
                return self._tok.apply_chat_template(
                    turns, tools=tools or None, tokenize=False, add_generation_prompt=opened
                )
            except Exception as e:  # the template's own error, on this conversation
                raise DataError(f"{where}: the chat template cannot render it ({type(e).__name__}: {e})") from None

        def example(text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
            encoded = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.asarray(encoded["input_ids"], dtype=np.int64)
            starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
            replies = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                replies |= (starts >= lo) & (starts < hi)
            return ids, replies

        text = render(messages, False)
        turns = []  # (the conversation up to the reply, the reply's span in it)
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, upto = render(messages[:i], True), render(messages[: i + 1], False)
            if not upto.startswith(before):
                raise DataError(
                    f"{where}: message {i}: the chat template renders this reply's turn otherwise than it opens an "
                    "assistant's turn (add_generation_prompt), so the reply's tokens cannot be found; fix the template"
                )
            turns.append((upto, (len(before), len(upto))))
        if all(text.startswith(upto) for upto, _ in turns):  # rendered in order: one example, every reply in it
            return [example(text, [span for _, span in turns])]
        return [example(upto, [span]) for upto, span in turns]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


def _first_id(lookup, names: tuple[str, ...]) -> int | None:
    for name in names:
        found = lookup(name)
        if found is not None:
            return int(found)
    return None


def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """The tokenizer `spec` names: "byte", a `tokenizers` JSON file, or a Hugging Face tokenizer directory.

    Paths may be local or URIs (s3://, memory://, file://); the files are read on every call (Ray tasks get
    the spec string, not the object) but parsed once per process and content.
    """
    if not isinstance(spec, str) or not spec:
        raise DataError(f"{spec!r}: not a tokenizer; give 'byte' or a path to a tokenizer file or directory")
    if spec == "byte":
        return ByteTokenizer()
    return _load_from_files(spec)


# Parsed tokenizers by (sha256, name, is a directory): a Ray worker runs many tasks, each naming the same spec.
_LOADED: dict[tuple[str, str, bool], Tokenizer] = {}


def _load_from_files(uri: str) -> Tokenizer:
    where = f"tokenizer {uri}"
    is_directory, files = tokenizer_files(uri, where)
    name = posixpath.basename(uri.rstrip("/")) or uri
    # Keyed by content, not path: a tokenizer rewritten in place must never be served stale.
    key = (files_sha256(files), name, is_directory)
    if key not in _LOADED:
        _LOADED[key] = _parse(is_directory, name, files, key[0], where)
    return _LOADED[key]


def _parse(is_directory: bool, name: str, files: list[tuple[str, bytes]], sha256: str, where: str) -> Tokenizer:
    # Both libraries load from local files only; remote files are copied to a private temp dir first.
    tmp = tempfile.mkdtemp(prefix="pylon-tokenizer-")
    try:
        for rel, data in files:
            local = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as f:
                f.write(data)
        if is_directory:
            return HuggingFaceTokenizer(tmp, name, sha256, where=where)
        return TokenizersFileTokenizer(os.path.join(tmp, files[0][0]), name, sha256, where=where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # both libraries hold everything in memory once loaded


def tokenizer_files(uri: str, where: str) -> tuple[bool, list[tuple[str, bytes]]]:
    """(is a directory, [(name relative to the directory, bytes)] sorted by name). A single file is
    returned under the name "tokenizer.json"."""
    try:
        fs, path = storage.resolve(uri)
        if not fs.exists(path):
            raise DataError(
                f"{where}: no such file or directory (give 'byte' or a path to a `tokenizers` "
                "JSON file or a Hugging Face tokenizer directory)"
            )
        if not fs.isdir(path):
            return False, [("tokenizer.json", storage.read_bytes(uri))]
        found = sorted(fs.find(path))
        root = path.rstrip("/") + "/"
        rels = [p[len(root) :] for p in found if p.startswith(root)]
        rels = [r for r in rels if not any(part.startswith(".") for part in r.split("/"))]
        if not rels:
            raise DataError(
                f"{where}: an empty directory; expected a Hugging Face tokenizer directory "
                "(tokenizer.json, tokenizer_config.json)"
            )
        return True, [(rel, storage.read_bytes(storage.join(uri, rel))) for rel in rels]
    except DataError:
        raise
    except StorageError as e:
        raise DataError(f"{where}: {e}") from None
    except Exception as e:  # fsspec/botocore errors while listing
        raise DataError(f"{where}: cannot be read ({type(e).__name__}: {e})") from None


def files_sha256(files: list[tuple[str, bytes]]) -> str:
    """Identity of a tokenizer's files: names (relative, sorted) and bytes. A single file is hashed under the
    fixed name "tokenizer.json", so the same file copied under another name is still the same tokenizer."""
    h = hashlib.sha256()
    for rel, data in files:
        h.update(rel.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# A chat format for a base model's tokenizer, which has no template (`with_chat_template`'s "zephyr"): its role markers
# are plain text, and each turn ends with the tokenizer's own eos, so a model fine-tuned on it ends its replies with
# the eos that serving stops at, with no token added to the vocabulary (no embedding to resize). Zephyr's format.
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT_TEMPLATES = {"zephyr": ZEPHYR_TEMPLATE}
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where transformers keeps a template beside the config


def with_chat_template(source: str, template: str, out: str, *, overwrite: bool = False) -> "HuggingFaceTokenizer":
    """A copy of the Hugging Face tokenizer directory `source` at `out` (a directory, local or a URI) whose chat
    template is `template`: a built-in's name (`CHAT_TEMPLATES`) or a Jinja file (path or URI). For a base model's
    tokenizer, which has none, so that `pylon data prepare --chat` can render conversations with it; the copy is the
    tokenizer the dataset, the training run and the export then carry, so serving renders chats the same way (as
    TRL's `chat_template_path` sets one). Any template the source had (in `tokenizer_config.json` or a template
    file) is replaced. The template is checked on a conversation before anything is written: it must render, and
    open the assistant's turn where `add_generation_prompt` says. Returns the new tokenizer."""
    where = f"tokenizer {source}"
    is_directory, files = tokenizer_files(source, where)
    if not is_directory:
        raise DataError(
            f"{where}: a chat template goes with a Hugging Face tokenizer directory (tokenizer.json, "
            "tokenizer_config.json), not a single `tokenizers` file"
        )
    if template in CHAT_TEMPLATES:
        text = CHAT_TEMPLATES[template]
    else:
        try:
            text = storage.read_bytes(template).decode("utf-8")
        except (StorageError, OSError, UnicodeDecodeError) as e:
            raise DataError(
                f"chat template {template}: not a built-in ({', '.join(CHAT_TEMPLATES)}) and cannot be read as a "
                f"UTF-8 Jinja file ({e})"
            ) from None
    copied: list[tuple[str, bytes]] = []
    for rel, data in files:
        if rel in _TEMPLATE_FILES:
            continue
        if rel == "tokenizer_config.json":
            try:
                config = json.loads(data)
            except ValueError as e:
                raise DataError(f"{where}: tokenizer_config.json is not JSON ({e})") from None
            config.pop("chat_template", None)
            data = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        copied.append((rel, data))
    copied = sorted([*copied, ("chat_template.jinja", text.encode("utf-8"))])
    name = posixpath.basename(out.rstrip("/")) or out
    tok = _parse(True, name, copied, files_sha256(copied), f"chat template {template}")
    sample = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there."}]
    examples = tok.encode_chat(sample, f"chat template {template}")  # renders, and finds the assistant's reply
    if not any(replies.any() for _, replies in examples):
        raise DataError(f"chat template {template}: renders no assistant reply, so a chat dataset would count nothing")
    if storage.exists(out) and not overwrite:
        raise DataError(f"{out} already exists; pass --overwrite to replace it")
    for rel, data in copied:
        storage.atomic_write(storage.join(out, rel), data)
    return tok
