"""Preparing shards: text files, directories of them, or JSONL in; tokenized fixed-length shards plus
`manifest.json` out (`pylon data prepare SRC... --out URI`).

The steps, each a function below:

1. **Find documents** (`find_source_files`): sources in the order given; a directory's files recursively, in
   sorted order, hidden ones skipped. Every text file is one document; a JSONL file holds one per line.
2. **Group** (`group_files`): consecutive files up to `GROUP_BYTES` of source form a group, the unit of
   parallel work. The rule depends only on the files, never on the executor, so a run on Ray and a run in
   this process write byte-identical shards.
3. **Tokenize and pack** (`pack_group`): each document's tokens plus eos, concatenated, cut into rows of
   exactly `seq_len`; only a group's last row is padded (its `num_tokens` says how much is real).
4. **Cut into shards** (`plan_shards`): rows get ids 0.. in group order; every shard holds `rows_per_shard`
   rows (from `shard_size_mb` of token bytes), the last the rest. Shards are named `part-<run>-<index>`, with
   a fresh run id each time, so a new run never overwrites a shard a committed manifest lists.
5. **Commit**: shards are written first, each atomically under a name unique to this run; the manifest is
   written last (the commit); with `overwrite`, files of the dataset it replaces are removed after that. A
   reader therefore sees the old dataset whole or the new one whole, never a mix, even if a run dies midway.

Groups run as Ray tasks when a cluster is up (`pylon cluster up`, or a process already connected to one),
otherwise in this process; the output is the same.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from tqdm import tqdm

from pylon import home, storage
from pylon.data.shards import (
    DOCUMENT_START,
    MANIFEST_NAME,
    PROMPT_MESSAGES,
    SHARD_SUFFIX,
    DataError,
    RecordsInfo,
    ShardInfo,
    ShardManifest,
    ShardRows,
    Totals,
    encode_shard,
    manifest_uri,
    records_name,
    sha256_hex,
    split_words,
)
from pylon.data.tokenizer import load_tokenizer
from pylon.errors import ClusterError, PylonError, StorageError
from pylon.specs import DatasetSpec

log = logging.getLogger(__name__)

# Source bytes per group (one Ray task). Part of the output's definition: each group's last row is padded,
# so changing this changes the shards. 32 MiB keeps padding negligible and a task's memory small.
GROUP_BYTES = 32 * 2**20
FORMATS = tuple(SHARD_SUFFIX)
PACKINGS = ("auto", "wrapped", "bfd")
_SHARD_NAME = re.compile(r"^part-[0-9a-f]{8}-\d{5}(\.parquet|\.tar|\.records\.jsonl)$")
# A source record's other fields (`record_fields`), JSON-encoded, at most: they ride in every worker's memory with
# their shard, and a reward function wants an id, a label or a test case, not a document.
RECORD_FIELDS_LIMIT = 64 * 2**10
# storage.atomic_write's temporary names: a crashed run can leave them behind.
_TEMP_NAME = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{32}$")
_CREDENTIALS_IN_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


# ---------------------------------------------------------------------------------------------------------
# 1-2. Finding documents and grouping them
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    uri: str
    size: int
    jsonl: bool


def find_source_files(
    sources: list[str], include: str | None = None, exclude: list[str] | tuple[str, ...] = ()
) -> list[SourceFile]:
    """Every file the sources name, in order. `include` (a glob on the file name, e.g. "*.py") filters the
    files found in directories; `exclude` globs drop files any of whose path components (below the source
    directory) match, e.g. "site-packages" or "test_*"; a file named directly is always read."""
    files: list[SourceFile] = []
    for source in sources:
        try:
            fs, path = storage.resolve(source)
            info = fs.info(path)
            found = fs.find(path, detail=True) if info["type"] == "directory" else None
        except FileNotFoundError:
            raise DataError(f"source {source}: no such file or directory") from None
        except StorageError as e:
            raise DataError(f"source {e}") from None
        except Exception as e:  # botocore/fsspec errors (endpoint, permissions)
            raise DataError(f"source {storage.describe(source)}: cannot be listed ({type(e).__name__}: {e})") from None
        if found is None:
            files.append(SourceFile(source, int(info["size"]), _is_jsonl(source)))
            continue
        root = path.rstrip("/") + "/"
        entries = []
        for found_path, entry in found.items():
            parts = found_path[len(root) :].split("/")
            if entry["type"] != "file" or not found_path.startswith(root) or any(p.startswith(".") for p in parts):
                continue
            if include and not fnmatch.fnmatchcase(parts[-1], include):
                continue
            if any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in exclude):
                continue
            entries.append((parts, int(entry["size"])))
        # Sorted by path components, so a directory's files come where its name sorts (like a sorted walk).
        for parts, size in sorted(entries):
            rel = "/".join(parts)
            try:
                uri = storage.join(source, rel)
            except StorageError as e:
                raise DataError(f"source {source}: {e}") from None
            files.append(SourceFile(uri, size, _is_jsonl(rel)))
    return files


def _is_jsonl(name: str) -> bool:
    return name.lower().endswith(".jsonl")


def group_files(files: list[SourceFile], group_bytes: int = GROUP_BYTES) -> list[list[SourceFile]]:
    """Consecutive files of up to `group_bytes` source bytes (a larger file is a group on its own)."""
    groups: list[list[SourceFile]] = []
    current: list[SourceFile] = []
    size = 0
    for f in files:
        if current and size + f.size > group_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(f)
        size += f.size
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------------------------------------------------
# 3. Tokenizing and packing one group
# ---------------------------------------------------------------------------------------------------------


@dataclass
class PackedGroup:
    tokens: np.ndarray  # (rows, seq_len), the dataset's dtype
    num_tokens: np.ndarray  # (rows,) int32: real tokens per row
    documents: int
    skipped: list[str] = field(default_factory=list)  # files left out: not UTF-8 text
    tokenizer_sha256: str | None = None
    truncated: int = 0  # documents longer than a row, cut to one (packing "bfd")
    truncated_tokens: int = 0  # the tokens cut off them
    conversational: int = 0  # preference pairs in a conversational format (the others are prompt and completion text)
    # each row's records file line (`shards.RecordsInfo`); None when no document of the group had other fields
    records: list[str] | None = None
    record_fields: list[str] = field(default_factory=list)  # their names, sorted

    @property
    def rows(self) -> int:
        return len(self.num_tokens)


def read_documents(
    file: SourceFile,
    text_field: str = "text",
    chat: bool = False,
    prompt_completion: bool = False,
    preference: bool = False,
    prompts: bool = False,
) -> list | None:
    """The documents in `file`; None when a text file is not UTF-8 (the caller skips and counts it). `chat`: each
    JSONL record's `text_field` is a conversation (a list of messages, each with a role), returned as
    (line number, messages, the record's `tools` or None, its other fields). `prompt_completion`: each JSONL record's
    `prompt` and `completion` strings, returned as (line number, prompt, completion, its other fields). `preference`:
    each JSONL record's `prompt`, `chosen` and `rejected` strings, returned as (line number, prompt, chosen, rejected).
    `prompts`: each JSONL record's `prompt` (a string or a list of messages) and optional `answer` string, returned as
    (line number, prompt, answer or "", its other fields). A record's other fields (`other_fields`): an object of
    every field but those read, or None when it has none."""
    try:
        data = storage.read_bytes(file.uri)
    except StorageError as e:
        raise DataError(f"source {e}") from None
    if not file.jsonl:
        if chat:
            raise DataError(f"{file.uri}: a chat dataset is JSON Lines, one conversation per line ({text_field!r})")
        if prompts:
            raise DataError(f"{file.uri}: a prompts dataset is JSON Lines, one record per line with a 'prompt'")
        if prompt_completion or preference:
            kind, fields = (
                ("preference", "'prompt', 'chosen' and 'rejected'")
                if preference
                else (
                    "prompt-completion",
                    "'prompt' and 'completion' strings",
                )
            )
            raise DataError(f"{file.uri}: a {kind} dataset is JSON Lines, one record per line with {fields}")
        try:
            return [data.decode("utf-8")]
        except UnicodeDecodeError:
            return None
    docs = []
    # Split on b"\n" only: JSON Lines' separator (str.splitlines would also split inside text on U+2028).
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{file.uri}: line {lineno}: not a JSON object ({e})") from None
        if preference:
            docs.append((lineno, *_preference(obj, f"{file.uri}: line {lineno}")))
            continue
        if prompt_completion:
            where = f"{file.uri}: line {lineno}"
            docs.append((lineno, *_prompt_completion(obj, where), other_fields(obj, ("prompt", "completion"), where)))
            continue
        if prompts:
            where = f"{file.uri}: line {lineno}"
            docs.append((lineno, *_prompt_record(obj, where), other_fields(obj, ("prompt", "answer"), where)))
            continue
        if not isinstance(obj, dict) or text_field not in obj:
            has = f"has {sorted(obj)[:8]}" if isinstance(obj, dict) else f"is a {type(obj).__name__}"
            raise DataError(
                f"{file.uri}: line {lineno}: no {text_field!r} field ({has}); choose the field with --text-field"
            )
        if chat:
            tools = obj.get("tools")
            if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
                raise DataError(f"{file.uri}: line {lineno}: tools: a list of tool objects, as the chat API takes them")
            where = f"{file.uri}: line {lineno}"
            fields = other_fields(obj, (text_field, "tools"), where)
            docs.append((lineno, _messages(obj[text_field], f"{where}: {text_field}"), tools, fields))
            continue
        if not isinstance(obj[text_field], str):
            raise DataError(
                f"{file.uri}: line {lineno}: field {text_field!r} is a {type(obj[text_field]).__name__}, not a string"
            )
        docs.append(obj[text_field])
    return docs


def other_fields(obj: dict, read: tuple[str, ...], where: str) -> dict | None:
    """A record's fields beyond the `read` ones (`ShardManifest.record_fields`), or None when it has none: a prompt's
    id, a task's test cases, a label, for reward functions to take by name. DataError naming the record when they
    are larger than RECORD_FIELDS_LIMIT encoded."""
    rest = {k: v for k, v in obj.items() if k not in read}
    if not rest:
        return None
    size = len(json.dumps(rest, ensure_ascii=False, separators=(",", ":")).encode())
    if size > RECORD_FIELDS_LIMIT:
        raise DataError(
            f"{where}: its other fields ({', '.join(sorted(rest)[:8])}) take {size:,} bytes as JSON, over the "
            f"{RECORD_FIELDS_LIMIT:,} kept per record; keep an id or a label there, and large content elsewhere"
        )
    return rest


def _prompt_completion(obj, where: str, keys: tuple[str, ...] = ("prompt", "completion")) -> tuple:
    """A record's `keys` (prompt and completion; a preference pair's prompt, chosen and rejected): all strings, the
    completions not empty (they are what the model learns from). A prompt-completion record in TRL's conversational
    format (`prompt` a list of messages, `completion` the messages after it, ending with the assistant's) is
    returned as a conversational preference pair's is: (the prompt's number of messages, the whole conversation)."""
    if keys == ("prompt", "completion") and isinstance(obj, dict) and isinstance(obj.get("prompt"), list):
        return _conversational_completion(obj, where)
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record is an object with {' and '.join(map(repr, keys))} strings")
    for key in keys:
        if key not in obj:
            raise DataError(f"{where}: no {key!r} field (has {sorted(obj)[:8]})")
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: {key} is a {type(obj[key]).__name__}, not a string")
    for key in keys[1:]:
        if not obj[key]:
            raise DataError(f"{where}: {key} is empty: nothing in it to learn from")
    return tuple(obj[key] for key in keys)


def _conversational_completion(obj: dict, where: str) -> tuple[int, list[dict]]:
    """A conversational prompt-completion record's (number of prompt messages, prompt and completion messages)."""
    prompt, completion = obj["prompt"], obj.get("completion")
    if not prompt:
        raise DataError(f"{where}: prompt: a non-empty list of messages")
    if not isinstance(completion, list) or not completion:
        got = "absent" if completion is None else f"a {type(completion).__name__}"
        raise DataError(
            f"{where}: completion: a non-empty list of messages, as prompt is ({got}); TRL's conversational "
            'format is {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}'
        )
    messages = _messages([*prompt, *completion], where)
    if messages[-1]["role"] != "assistant" or not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}: completion: the conversation must end with the assistant's reply")
    return len(prompt), messages


def _prompt_record(obj, where: str) -> tuple:
    """A prompts dataset's record (TRL's prompt-only format, for objective grpo): its `prompt`, a non-empty string or
    a non-empty list of messages (each an object with a string role), and its `answer`, a string or absent ("")."""
    if not isinstance(obj, dict) or "prompt" not in obj:
        has = f"has {sorted(obj)[:8]}" if isinstance(obj, dict) else f"is a {type(obj).__name__}"
        raise DataError(f"{where}: no 'prompt' field ({has})")
    prompt, answer = obj["prompt"], obj.get("answer", "")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
            raise DataError(f"{where}: prompt: a non-empty list of messages, each an object with a string role")
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: prompt: a non-empty string or a list of messages")
    if not isinstance(answer, str):
        raise DataError(f"{where}: answer is a {type(answer).__name__}, not a string")
    return prompt, answer


def _preference(obj, where: str) -> tuple:
    """A preference record's (prompt, chosen, rejected), in one of TRL's formats: strings (`prompt`, `chosen`,
    `rejected`); conversational with an explicit prompt (`prompt` a list of messages, `chosen` and `rejected` lists
    of the messages that follow it, ending with the assistant's); or conversational with the prompt implicit
    (`chosen` and `rejected` whole conversations, each ending with the assistant's reply: prompt None)."""
    if isinstance(obj, dict) and isinstance(obj.get("chosen"), list):
        prompt = obj.get("prompt", [])
        if not isinstance(prompt, list):
            raise DataError(f"{where}: prompt: a list of messages, as chosen and rejected are")
        out = []
        for key in ("chosen", "rejected"):
            if not isinstance(obj.get(key), list):
                raise DataError(f"{where}: {key}: a list of messages, as chosen is")
            messages = [*prompt, *obj[key]]
            _messages(messages, f"{where}: {key}")
            if messages[-1]["role"] != "assistant" or (prompt and not obj[key]):
                raise DataError(f"{where}: {key}: the conversation must end with the assistant's reply")
            out.append(messages)
        return (len(prompt), *out)
    return _prompt_completion(obj, where, ("prompt", "chosen", "rejected"))


def _conversational_pair(tok, prompt_length: int, conversations: list[list[dict]], where: str) -> np.ndarray:
    """A conversational preference pair's piece (or a conversational prompt-completion record's, one conversation):
    each conversation (the prompt's `prompt_length` messages and a completion; with the prompt implicit, 0: the last
    message is the completion) rendered by the chat template and tokenized as a chat dataset's, the loss on the
    completion's replies only, chosen then rejected."""
    if not hasattr(tok, "encode_chat"):
        raise DataError(
            f"{where}: conversational records need a Hugging Face tokenizer directory with a chat template "
            f"(tokenizer {tok.info.name} is not one)"
        )
    piece = []
    for conversation in conversations:
        examples = tok.encode_chat(conversation, where)
        ids, replies = examples[-1]  # (a template that rewrites history: the last example, the final reply's)
        completion = conversation[prompt_length:] if prompt_length else conversation[-1:]
        keep = sum(1 for m in completion if m["role"] == "assistant")
        if len(examples) > 1 and keep > 1:
            raise DataError(
                f"{where}: this chat template renders earlier turns otherwise as the conversation goes on, so a "
                "completion of several assistant messages is not one sequence; give one"
            )
        piece.append(chat_tokens(ids, _last_replies(replies, keep)))
    return np.concatenate(piece)


def _with_messages(other: dict | None, messages: list[dict]) -> dict:
    """A record's other fields with its conversational prompt's messages (`shards.PROMPT_MESSAGES`) beside them."""
    return {**(other or {}), PROMPT_MESSAGES: messages}


def _last_replies(replies: np.ndarray, keep: int) -> np.ndarray:
    """`replies` with only its last `keep` runs of reply tokens left (a conversational preference pair's completion:
    the replies after its prompt's)."""
    starts = np.flatnonzero(replies & ~np.concatenate([[False], replies[:-1]]))
    out = replies.copy()
    if len(starts) > keep:
        out[: starts[len(starts) - keep]] = False
    return out


def _messages(value, where: str) -> list[dict]:
    """A conversation as a chat template takes it: a non-empty list of messages, each an object with a string
    `role`, at least one of them the assistant's (what the model learns)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: a conversation is a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}.{i}: a message is an object with a string role")
    if not any(m["role"] == "assistant" for m in value):
        raise DataError(f"{where}: no assistant message: nothing in it to learn")
    return value


def pack_group(
    files: list[SourceFile],
    *,
    tokenizer: str,
    seq_len: int,
    dtype: str,
    text_field: str = "text",
    chat: bool = False,
    packing: str = "wrapped",
    prompt_completion: bool = False,
    preference: bool = False,
    prompts: bool = False,
) -> PackedGroup:
    """Tokenize a group's documents (each followed by eos) and pack them into rows of seq_len (`packing`: "wrapped"
    cuts their concatenation, "bfd" keeps each whole in one row, `pack_whole`). `chat`: each document is a
    conversation, rendered by the tokenizer's chat template, its tokens outside the assistant's replies stored as
    -(id + 1) (`chat_tokens`), no eos added (the template ends each turn). `prompt_completion`: each document is a
    prompt (tokenized with the special tokens the tokenizer adds, as a completions request's prompt is) and its
    completion (then eos), stored as a conversation is, the completion and its eos the reply. `preference`: each
    record is two such documents, its prompt with the chosen completion then with the rejected one, kept together
    in one piece (so in one row, chosen first: `pylon.jobs.dpo` reads them as pairs); a pair longer than a row is
    left out and counted (cut, its rejected completion would be lost). `prompts`: each record a prompt (text, as
    `prompt_completion`'s; or messages, rendered by the chat template with its generation prompt) and its answer,
    stored as a prompt-completion record (an empty answer: the eos alone counted).

    Takes the tokenizer's spec, not the object, so that it can run as a Ray task on any node.
    """
    tok = load_tokenizer(tokenizer)
    pieces: list[np.ndarray] = []
    fields: list[dict | None] = []  # each piece's record's other fields (`other_fields`)
    documents = 0
    skipped: list[str] = []
    dropped: list[int] = []  # preference pairs longer than a row: their lengths
    conversational = 0  # preference pairs, prompts or prompt-completion records given as conversations
    if chat and not hasattr(tok, "encode_chat"):
        raise DataError(
            f"tokenizer {tok.info.name}: a chat dataset needs a Hugging Face tokenizer directory with a chat template"
        )
    for file in files:
        docs = read_documents(file, text_field, chat, prompt_completion, preference, prompts)
        if docs is None:
            # Skipped and counted rather than fatal: real corpora (the Python standard library included)
            # hold a few files in legacy encodings; one of them should not sink a run over millions, and
            # the manifest's `skipped_files` plus a warning naming each file keep the choice visible.
            skipped.append(file.uri)
            continue
        if prompts:
            for lineno, prompt, answer, other in docs:
                where = f"{file.uri}: line {lineno}"
                if isinstance(prompt, list):
                    if not hasattr(tok, "encode_chat_prompt"):
                        raise DataError(
                            f"{where}: a prompt of messages needs a Hugging Face tokenizer directory with a chat "
                            f"template (tokenizer {tok.info.name} is not one)"
                        )
                    context = tok.encode_chat_prompt(prompt, where)
                    other = _with_messages(other, prompt)
                    conversational += 1
                else:
                    context = tok.encode(prompt, special=True)
                ids = np.concatenate([context, tok.encode(answer) if answer else [], [tok.eos_id]]).astype(np.int64)
                pieces.append(chat_tokens(ids, np.arange(ids.size) >= context.size))
                fields.append(other)
                documents += 1
            continue
        if prompt_completion or preference:
            for lineno, prompt, *completions in docs:
                other = completions.pop() if prompt_completion else None
                if isinstance(prompt, int):  # conversational: (the prompt's messages, conversations)
                    piece = _conversational_pair(tok, prompt, completions, f"{file.uri}: line {lineno}")
                    if prompt_completion:  # (a preference pair's prompt messages: not kept, DPO never reads them)
                        other = _with_messages(other, completions[0][:prompt])
                else:
                    context = tok.encode(prompt, special=True)
                    piece = []
                    for completion in completions:  # (a preference pair: chosen, then rejected)
                        ids = np.concatenate([context, tok.encode(completion), [tok.eos_id]]).astype(np.int64)
                        piece.append(chat_tokens(ids, np.arange(ids.size) >= context.size))
                    piece = np.concatenate(piece)
                if preference and piece.size > seq_len:
                    dropped.append(piece.size)
                    continue
                pieces.append(piece)
                fields.append(other)
                documents += 1
                conversational += isinstance(prompt, int)
            continue
        if chat:
            for lineno, messages, tools, other in docs:
                for ids, replies in tok.encode_chat(messages, f"{file.uri}: line {lineno}", tools):
                    pieces.append(chat_tokens(ids, replies))
                    fields.append(other)  # (every document a conversation makes carries its record's)
                documents += 1
            continue
        for text in docs:
            if not text:
                continue  # an empty document would only add a lone eos
            ids = tok.encode(text)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.vocab_size):
                raise DataError(
                    f"{file.uri}: tokenizer {tok.info.name} produced an id outside its vocabulary of {tok.vocab_size}"
                )
            piece = np.empty(ids.size + 1, dtype=dtype)
            piece[:-1] = ids
            piece[-1] = tok.eos_id
            pieces.append(piece)
            fields.append(None)
            documents += 1
    rows_of: list[int] = []  # each piece's row
    if packing == "bfd":
        tokens, num_tokens, truncated, cut = pack_whole(
            pieces, seq_len=seq_len, pad_id=tok.pad_id, dtype=dtype, rows_of=rows_of
        )
        truncated, cut = truncated + len(dropped), cut + sum(dropped)  # (a dropped pair: all its tokens)
        group = PackedGroup(tokens, num_tokens, documents, skipped, tok.info.sha256, truncated, cut, conversational)
    else:
        tokens, num_tokens = pack(pieces, seq_len=seq_len, pad_id=tok.pad_id, dtype=dtype)
        starts = np.cumsum([0, *(len(p) for p in pieces[:-1])]) if pieces else np.zeros(0, np.int64)
        rows_of = [int(a // seq_len) if len(p) else -1 for a, p in zip(starts, pieces)]
        group = PackedGroup(tokens, num_tokens, documents, skipped, tok.info.sha256)
    if any(f is not None for f in fields):
        group.records, group.record_fields = row_records(group.rows, rows_of, fields)
    return group


def no_records(tokens: np.ndarray, num_tokens: np.ndarray) -> list[str]:
    """The records file lines of rows whose documents had no other fields: a null for each document starting in
    each row (a masked dataset's words mark where each starts), as `row_records` writes them."""
    _, _, starts = split_words(tokens, loss_mask=True, eos_id=-1)
    real = np.arange(tokens.shape[1])[None, :] < np.asarray(num_tokens)[:, None]
    return ["[" + ",".join(["null"] * int(k)) + "]" for k in (starts & real).sum(axis=1)]


def row_records(rows: int, rows_of: list[int], fields: list[dict | None]) -> tuple[list[str], list[str]]:
    """Each row's records file line (`shards.RecordsInfo`), from each piece's row (-1: in none, as an empty piece)
    and its record's other fields; and the fields' names, sorted. Pieces come in source order, so a row's entries
    follow the order of its documents."""
    per_row: list[list[dict | None]] = [[] for _ in range(rows)]
    for row, other in zip(rows_of, fields):
        if row >= 0:
            per_row[row].append(other)
    names = sorted({k for f in fields if f is not None for k in f} - {PROMPT_MESSAGES})
    return [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in per_row], names


def _given_as(outcome: "_Outcome") -> str:
    """How a preference dataset's pairs (or a prompts or prompt-completion dataset's prompts) were given: all as
    text, all as conversations, or mixed (`ShardManifest.preference_format`, `prompt_format`)."""
    if outcome.conversational == 0:
        return "text"
    return "conversational" if outcome.conversational == outcome.documents else "mixed"


def chat_tokens(ids: np.ndarray, replies: np.ndarray) -> np.ndarray:
    """A conversation's tokens as a chat dataset stores them (int32 words): the assistant's replies' ids as they are,
    every other token's as -(word + 1), and the first token's word with DOCUMENT_START set, so that a row says
    which of its tokens the loss counts (`ShardManifest.loss_mask`) and where each conversation starts
    (`ShardManifest.document_starts`) without another column (`shards.split_words` reads them back)."""
    words = ids.astype(np.int64)
    if words.size:
        words[0] |= DOCUMENT_START
    return np.where(replies, words, -words - 1).astype(np.int32)


def pack(pieces: list[np.ndarray], *, seq_len: int, pad_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The concatenation of `pieces` as rows of exactly `seq_len` (the last padded) and each row's real length."""
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    rows = -(-flat.size // seq_len)
    tokens = np.full(rows * seq_len, pad_id, dtype=dtype)
    tokens[: flat.size] = flat
    num_tokens = np.full(rows, seq_len, dtype=np.int32)
    if rows:
        num_tokens[-1] = flat.size - (rows - 1) * seq_len
    return tokens.reshape(rows, seq_len), num_tokens


def pack_whole(
    pieces: list[np.ndarray], *, seq_len: int, pad_id: int, dtype: str, rows_of: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Each piece whole in one row (TRL's "bfd" packing): best-fit decreasing, the longest first, each into the row
    whose free space fits it most tightly, else a new row; each row padded after its pieces. A piece longer than a
    row is cut to `seq_len` (its beginning kept). Rows come in the order of their first piece in `pieces`, and each
    row's pieces in that order, so the rows follow the source (the held-out split, the tail of the ids, is the
    source's tail, as with wrapped packing). Returns (tokens, num_tokens, pieces cut, tokens cut off them); `rows_of`,
    when given, is filled with each piece's row (-1 for an empty piece, in none)."""
    lengths = np.array([min(len(p), seq_len) for p in pieces], dtype=np.int64)
    truncated = sum(1 for p in pieces if len(p) > seq_len)
    cut = sum(len(p) - seq_len for p in pieces if len(p) > seq_len)
    free_rows: list[list[int]] = [[] for _ in range(seq_len + 1)]  # rows by their free tokens
    free_count = np.zeros(seq_len + 1, dtype=np.int64)
    members: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        if n == 0:
            continue
        fits = np.flatnonzero(free_count[n:])
        if fits.size:  # the row with the least free space that still holds it
            free = n + int(fits[0])
            row = free_rows[free].pop()
            free_count[free] -= 1
        else:
            free, row = seq_len, len(members)
            members.append([])
        members[row].append(i)
        if free - n:
            free_rows[free - n].append(row)
            free_count[free - n] += 1
    order = sorted(range(len(members)), key=lambda r: min(members[r]))
    tokens = np.full((len(members), seq_len), pad_id, dtype=dtype)
    num_tokens = np.zeros(len(members), dtype=np.int32)
    for out, row in enumerate(order):
        at = 0
        for i in sorted(members[row]):
            n = int(lengths[i])
            tokens[out, at : at + n] = pieces[i][:n]
            at += n
        num_tokens[out] = at
    if rows_of is not None:
        placed = [-1] * len(pieces)
        for out, row in enumerate(order):
            for i in members[row]:
                placed[i] = out
        rows_of[:] = placed
    return tokens, num_tokens, truncated, cut


# ---------------------------------------------------------------------------------------------------------
# 4. Shards
# ---------------------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65535 else "int32"


def rows_per_shard(shard_size_mb: float, seq_len: int, dtype: str) -> int:
    return max(1, int(shard_size_mb * 2**20 // (seq_len * np.dtype(dtype).itemsize)))


def plan_shards(group_rows: list[int], per_shard: int) -> list[list[tuple[int, int, int]]]:
    """For each shard in order, the (group, lo, hi) row ranges it is made of. Rows are numbered across
    groups in order; shard k holds rows [k * per_shard, (k + 1) * per_shard), the last one the rest."""
    slices: list[tuple[int, int, int]] = []  # of the shard being filled
    plan: list[list[tuple[int, int, int]]] = []
    room = per_shard
    for g, rows in enumerate(group_rows):
        lo = 0
        while lo < rows:
            take = min(room, rows - lo)
            slices.append((g, lo, lo + take))
            lo += take
            room -= take
            if room == 0:
                plan.append(slices)
                slices, room = [], per_shard
    if slices:
        plan.append(slices)
    return plan


def shard_name(run_id: str, index: int, fmt: str) -> str:
    return f"part-{run_id[:8]}-{index:05d}{SHARD_SUFFIX[fmt]}"


def write_shard(
    out: str, fmt: str, name: str, first_id: int, parts: list[tuple[np.ndarray, np.ndarray, list[str] | None]]
) -> ShardInfo:
    """Encode (tokens, num_tokens, records lines or None) parts as one shard with ids from `first_id`, write it
    atomically; and, when any part has records, its records file (`shards.RecordsInfo`) before it."""
    tokens = np.concatenate([t for t, _, _ in parts])
    num_tokens = np.concatenate([n for _, n, _ in parts])
    ids = np.arange(first_id, first_id + len(num_tokens), dtype=np.int64)
    records = None
    if any(r is not None for _, _, r in parts):
        lines = [line for t, n, r in parts for line in (r if r is not None else no_records(t, n))]
        payload = "\n".join(lines).encode()
        records = RecordsInfo(file=records_name(name), bytes=len(payload), sha256=sha256_hex(payload))
        storage.atomic_write(storage.join(out, records.file), payload)
    data = encode_shard(fmt, ShardRows(ids, num_tokens, tokens))
    storage.atomic_write(storage.join(out, name), data)
    return ShardInfo(
        file=name,
        rows=len(ids),
        tokens=int(num_tokens.sum()),
        bytes=len(data),
        sha256=sha256_hex(data),
        first_id=first_id,
        records=records,
    )


# ---------------------------------------------------------------------------------------------------------
# 5. prepare
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """What every group and shard needs, in a form that travels to Ray tasks."""

    out: str
    fmt: str
    seq_len: int
    dtype: str
    tokenizer: str
    text_field: str
    run_id: str
    chat: bool
    per_shard: int
    progress: bool
    packing: str = "wrapped"
    prompt_completion: bool = False
    preference: bool = False
    prompts: bool = False


@dataclass
class _Outcome:
    shards: list[ShardInfo]
    documents: int
    skipped: list[str]
    tokenizer_sha256: set[str | None]
    truncated: int = 0
    truncated_tokens: int = 0
    conversational: int = 0
    record_fields: set[str] = field(default_factory=set)


def prepare(
    sources: list[str],
    out: str,
    *,
    fmt: str = "parquet",
    seq_len: int = 256,
    tokenizer: str = "byte",
    shard_size_mb: float = 64.0,
    include: str | None = None,
    exclude: list[str] | tuple[str, ...] = (),
    text_field: str | None = None,
    overwrite: bool = False,
    use_ray: bool | None = None,
    progress: bool = True,
    chat: bool = False,
    packing: str = "auto",
    prompt_completion: bool = False,
    preference: bool = False,
    prompts: bool = False,
) -> ShardManifest:
    """Tokenize `sources` into fixed-length shards plus a manifest at `out`; returns the committed manifest.

    `use_ray`: None runs on Ray when a cluster is up (else in this process), True requires Ray, False never
    uses it. The shards are the same either way. `progress` shows a bar on an interactive terminal.
    `out` must be empty unless `overwrite`, which replaces a prepared dataset whole. `text_field`: a JSONL record's
    field ("text"; "messages" with `chat`). `chat`: each record a conversation, the loss on its assistant replies
    only (supervised fine-tuning: `pack_group`, `ShardManifest.loss_mask`). `packing`: "wrapped" (documents one
    after another, cut into rows wherever a row ends), "bfd" (each document whole in one row, `pack_whole`; longer
    ones cut to a row), "auto": bfd for `chat` and `prompt_completion`, wrapped otherwise. `prompt_completion`: each
    JSONL record's `prompt` and `completion`, the loss on the completion (and its eos) only. `preference`: each
    JSONL record's `prompt`, `chosen` and `rejected` (TRL's preference format, for `objective: dpo`): the two
    completions after the prompt as two documents in one row, chosen first (bfd packing only; a pair longer than a
    row is left out and counted). `prompts`: each JSONL record's `prompt` (a string, or messages rendered by the chat
    template with its generation prompt) and optional `answer` (TRL's prompt-only format, for `objective: grpo`),
    stored as prompt-completion records.
    """
    started = time.perf_counter()
    if isinstance(sources, str):
        sources = [sources]
    _check_arguments(sources, fmt, seq_len, shard_size_mb)
    if packing not in PACKINGS:
        raise DataError(f"packing {packing!r}: must be one of {', '.join(PACKINGS)}")
    if chat + prompt_completion + preference + prompts > 1:
        raise DataError(
            "chat, prompt_completion, preference and prompts: choose one (a record is a conversation, a "
            "prompt-completion pair, a preference pair or a prompt)"
        )
    if preference and packing == "wrapped":
        raise DataError("packing wrapped: a preference pair must stay whole in one row; use bfd (or auto)")
    # the loss on part of each document: `chat_tokens`' words
    masked = chat or prompt_completion or preference or prompts
    if packing == "auto":
        packing = "bfd" if masked else "wrapped"
    tok = load_tokenizer(tokenizer)
    dtype = "int32" if masked else token_dtype(tok.vocab_size)
    if text_field is None:
        text_field = "messages" if chat else "text"
    replaced = _check_out(out, sources, overwrite)
    files = find_source_files(sources, include, exclude)
    if not files:
        raise DataError(
            f"empty dataset: no files in {', '.join(sources)}" + (f" match --include {include!r}" if include else "")
        )
    groups = group_files(files, GROUP_BYTES)
    job = _Job(
        out=out,
        fmt=fmt,
        seq_len=seq_len,
        dtype=dtype,
        tokenizer=tokenizer,
        text_field=text_field,
        run_id=uuid.uuid4().hex,
        chat=chat,
        per_shard=rows_per_shard(shard_size_mb, seq_len, dtype),
        progress=progress,
        packing=packing,
        prompt_completion=prompt_completion,
        preference=preference,
        prompts=prompts,
    )
    executor = _ray_executor(use_ray, [*sources, out] + ([] if tokenizer == "byte" else [tokenizer]))
    log.info(
        "preparing %d file(s), %.1f MiB, in %d group(s) %s",
        len(files),
        sum(f.size for f in files) / 2**20,
        len(groups),
        executor or "in this process",
    )
    try:
        outcome = _run_on_ray(job, groups) if executor else _run_here(job, groups)
        if outcome.documents == 0:
            raise DataError(
                f"empty dataset: no documents in {', '.join(sources)}"
                + (f" ({len(outcome.skipped)} file(s) skipped: not UTF-8 text)" if outcome.skipped else "")
            )
        if outcome.tokenizer_sha256 != {tok.info.sha256}:
            raise DataError(
                f"tokenizer {tokenizer}: its files changed during the run (different contents were "
                "read by different tasks); run again"
            )
        manifest = ShardManifest(
            format=fmt,
            seq_len=seq_len,
            dtype=dtype,
            shards=outcome.shards,
            tokenizer=tok.info
            if tokenizer == "byte"
            else tok.info.model_copy(update={"uri": _without_credentials(_absolute(tokenizer))}),
            totals=Totals(
                documents=outcome.documents,
                rows=sum(s.rows for s in outcome.shards),
                tokens=sum(s.tokens for s in outcome.shards),
                bytes=sum(s.bytes for s in outcome.shards),
                skipped_files=len(outcome.skipped),
                truncated_documents=outcome.truncated,
                truncated_tokens=outcome.truncated_tokens,
            ),
            packing=packing,
            sources=[_without_credentials(s) for s in sources],
            run_id=job.run_id,
            loss_mask=masked,
            document_starts=masked,
            prompt_completion=prompt_completion or preference or prompts,
            preference=preference,
            prompts=prompts,
            preference_format=_given_as(outcome) if preference else None,
            prompt_format=_given_as(outcome) if prompts or prompt_completion else None,
            record_fields=sorted(outcome.record_fields),
        )
        manifest.check(out)
        storage.atomic_write_json(manifest_uri(out), manifest.model_dump(mode="json"))  # the commit
    except BaseException:
        _remove_uncommitted(out, job.run_id)
        raise
    if replaced:
        try:
            records = [s.records.file for s in manifest.shards if s.records]
            _remove_replaced(out, keep={MANIFEST_NAME, *(s.file for s in manifest.shards), *records})
        except Exception as e:  # committed already: what is left is unreferenced, and the next overwrite removes it
            log.warning("prepared %s, but could not remove all of the dataset it replaced: %s", out, e)
    for uri in outcome.skipped[:20]:
        log.warning("skipped %s: not UTF-8 text", uri)
    if len(outcome.skipped) > 20:
        log.warning("skipped %d more file(s) that are not UTF-8 text", len(outcome.skipped) - 20)
    if outcome.truncated and preference:
        log.warning(
            "%d of %d preference pairs longer than seq_len %d together were left out (%d tokens); a longer seq_len "
            "keeps them",
            outcome.truncated,
            outcome.documents + outcome.truncated,
            seq_len,
            outcome.truncated_tokens,
        )
    elif outcome.truncated:
        log.warning(
            "%d of %d %s longer than seq_len %d were cut to it (%d tokens left out); a longer seq_len keeps them "
            "whole, packing wrapped keeps every token (cut across rows)",
            outcome.truncated,
            outcome.documents,
            "conversations" if chat else "records" if prompt_completion or prompts else "documents",
            seq_len,
            outcome.truncated_tokens,
        )
    seconds = max(time.perf_counter() - started, 1e-9)
    t = manifest.totals
    log.info(
        "prepared %s: %d shard(s), %d rows, %d tokens in %.1fs (%.0f rows/s, %.0f tokens/s)",
        out,
        len(manifest.shards),
        t.rows,
        t.tokens,
        seconds,
        t.rows / seconds,
        t.tokens / seconds,
    )
    return manifest


def prepare_spec(spec: DatasetSpec, **kw) -> ShardManifest:
    """`prepare` for a `Dataset` spec; keyword arguments (overwrite, use_ray, progress, include...) pass on."""
    return prepare(
        list(spec.sources),
        spec.output,
        fmt=spec.format,
        seq_len=spec.seq_len,
        tokenizer=spec.tokenizer,
        shard_size_mb=spec.shard_size_mb,
        include=spec.include,
        exclude=list(spec.exclude),
        chat=spec.chat,
        packing=spec.packing,
        prompt_completion=spec.prompt_completion,
        preference=spec.preference,
        prompts=spec.prompts,
        **kw,
    )


def _check_arguments(sources: list[str], fmt: str, seq_len: int, shard_size_mb: float) -> None:
    if not sources:
        raise DataError("no sources given: name text files, directories of them, or JSONL files")
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r}: must be one of {', '.join(FORMATS)}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len {seq_len!r}: must be a whole number >= 1")
    if not shard_size_mb > 0:
        raise DataError(f"shard_size_mb {shard_size_mb!r}: must be > 0")


def _check_out(out: str, sources: list[str], overwrite: bool) -> bool:
    """Refuse an `out` that overlaps a source or holds anything (unless `overwrite` and it is a prepared
    dataset). True when there is a dataset to replace."""
    out_fs, out_path = storage.resolve(out)
    for source in sources:
        src_fs, src_path = storage.resolve(source)
        if type(src_fs) is type(out_fs) and (_inside(out_path, src_path) or _inside(src_path, out_path)):
            raise DataError(
                f"--out {out} overlaps the source {source}: nothing is ever written into the "
                "input; choose an output location outside it"
            )
    existing = storage.listdir(out)
    if not existing:
        return False
    if not overwrite:
        what = "a prepared dataset" if MANIFEST_NAME in existing else f"{len(existing)} file(s) ({existing[0]}, ...)"
        raise DataError(f"{out} already holds {what}; pass --overwrite (CLI) / overwrite=True to replace it whole")
    # Overwrite replaces a prepared dataset, never anything else: `--out ~ --overwrite` must not empty a home.
    foreign = [n for n in existing if n != MANIFEST_NAME and not _SHARD_NAME.match(n)]
    if foreign:
        raise DataError(
            f"{out} holds files that are not part of a prepared dataset ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); --overwrite replaces only a dataset's "
            "manifest and shards: choose another location or remove them"
        )
    return True


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _absolute(uri: str) -> str:
    """A local path made absolute (a job elsewhere must find it again); URIs as they are."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def _without_credentials(uri: str) -> str:
    return _CREDENTIALS_IN_URI.sub(r"\1", uri)


def _remove_replaced(out: str, keep: set[str]) -> None:
    """After the commit: remove the replaced dataset's shards and manifest leftovers, and temporary files
    crashed runs left behind. Only names Pylon writes are touched."""
    fs, path = storage.resolve(out)
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        temp = _TEMP_NAME.match(name)
        target = temp.group(1) if temp else name
        ours = _SHARD_NAME.match(target) or (temp and target == MANIFEST_NAME)
        if ours and name not in keep:
            storage.remove(storage.join(out, name))


def _remove_uncommitted(out: str, run_id: str) -> None:
    """Best effort after a failure: this run's shards, which no manifest lists."""
    try:
        for name in storage.listdir(out):
            if _SHARD_NAME.match(name) and name.startswith(f"part-{run_id[:8]}-"):
                storage.remove(storage.join(out, name))
    except Exception as e:  # the original failure is the one to report
        log.warning("could not remove this run's unfinished shards from %s: %s", out, e)


# ---------------------------------------------------------------------------------------------------------
# Executors: the same groups and shards, in this process or as Ray tasks
# ---------------------------------------------------------------------------------------------------------


def _bar(job: _Job, **kw) -> tqdm:
    # disable=None: shown only on an interactive terminal, so logs and CI output stay clean.
    return tqdm(disable=None if job.progress else True, dynamic_ncols=True, **kw)


def _run_here(job: _Job, groups: list[list[SourceFile]]) -> _Outcome:
    """Groups one after another; a shard is written as soon as its rows exist, so memory holds about one
    group and one shard, never the dataset. Cuts where `plan_shards` cuts: every `per_shard` rows."""
    outcome = _Outcome([], 0, [], set())
    tokens = np.zeros((0, job.seq_len), dtype=job.dtype)  # rows not yet in a shard
    num_tokens = np.zeros(0, dtype=np.int32)
    records: list[str | None] = []  # their records file lines (None: a row of a group whose records had no fields)
    with _bar(job, total=sum(f.size for g in groups for f in g), unit="B", unit_scale=True, desc="tokenizing") as bar:
        for files in groups:
            group = pack_group(
                files,
                tokenizer=job.tokenizer,
                seq_len=job.seq_len,
                dtype=job.dtype,
                text_field=job.text_field,
                chat=job.chat,
                packing=job.packing,
                prompt_completion=job.prompt_completion,
                preference=job.preference,
                prompts=job.prompts,
            )
            outcome.documents += group.documents
            outcome.truncated += group.truncated
            outcome.truncated_tokens += group.truncated_tokens
            outcome.conversational += group.conversational
            outcome.skipped += group.skipped
            outcome.tokenizer_sha256.add(group.tokenizer_sha256)
            outcome.record_fields.update(group.record_fields)
            records += group.records if group.records is not None else [None] * group.rows
            tokens, num_tokens = np.concatenate([tokens, group.tokens]), np.concatenate([num_tokens, group.num_tokens])
            while len(num_tokens) >= job.per_shard:
                n = job.per_shard
                _write_next_shard(job, outcome, tokens[:n], num_tokens[:n], records[:n])
                tokens, num_tokens, records = tokens[n:], num_tokens[n:], records[n:]
            bar.update(sum(f.size for f in files))
    if len(num_tokens):
        _write_next_shard(job, outcome, tokens, num_tokens, records)
    return outcome


def _write_next_shard(
    job: _Job, outcome: _Outcome, tokens: np.ndarray, num_tokens: np.ndarray, records: list[str | None]
) -> None:
    """Write the next shard; `records` a line a row, None for a row of a group without fields: the shard has a
    records file when any row has a line (as on Ray, where a shard's parts each come from one group)."""
    index = len(outcome.shards)
    name = shard_name(job.run_id, index, job.fmt)
    if all(line is None for line in records):
        lines = None
    else:
        nulls = [i for i, line in enumerate(records) if line is None]
        filled = dict(zip(nulls, no_records(tokens[nulls], num_tokens[nulls]))) if nulls else {}
        lines = [filled.get(i, line) for i, line in enumerate(records)]
    outcome.shards.append(write_shard(job.out, job.fmt, name, index * job.per_shard, [(tokens, num_tokens, lines)]))


def _ray_executor(use_ray: bool | None, uris: list[str]) -> str | None:
    """Where groups run: a description of the Ray cluster, or None for this process."""
    if use_ray is False:
        return None
    in_memory = [u for u in uris if isinstance(storage.resolve(u)[0], MemoryFileSystem)]
    if in_memory:
        # memory:// lives inside one process; Ray workers would each see an empty one.
        if use_ray:
            raise DataError(
                f"{in_memory[0]}: memory:// storage exists only in this process; Ray tasks cannot "
                "reach it (use a local path or s3://, or run without Ray)"
            )
        return None
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return "on the Ray cluster this process is connected to"
    try:
        where = home.resolve()
        home.ping(where)
    except ClusterError as e:
        if use_ray:
            raise
        log.info("not using Ray: %s", str(e).split(". ")[0])
        return None
    local = [u for u in uris if isinstance(storage.resolve(u)[0], LocalFileSystem)]
    if local and not where.shares_disk:
        # The cluster is another machine: its tasks would look for these paths on its own disks.
        if use_ray:
            raise DataError(
                f"{local[0]}: a path on this machine, and the cluster at {where.dashboard_url} shares no disk with "
                "it; run without Ray (this process reads it), or submit the preparation as a job that ships it "
                "(`pylon.connect().prepare_data(...)`), or put it in object storage"
            )
        log.info(
            "tokenizing in this process: %s is on this machine's disk, which the cluster at %s cannot read",
            local[0],
            where.dashboard_url,
        )
        return None
    home.init_ray(where)
    return f"on the Ray cluster at {where.dashboard_url}"


def _run_on_ray(job: _Job, groups: list[list[SourceFile]]) -> _Outcome:
    """One task per group (tokenize + pack, arrays stay in the object store), then one task per shard, each
    phase through `_run_bounded`."""
    import ray

    options = _placement(job, groups)
    pack_task = ray.remote(num_cpus=1, num_returns=2, max_retries=2, **options)(_pack_group_task)
    write_task = ray.remote(num_cpus=1, max_retries=2, **options)(_write_shard_task)
    metas: dict[int, dict] = {}
    arrays: dict[int, ray.ObjectRef] = {}
    shards: dict[int, ShardInfo] = {}

    def pack(g: int) -> ray.ObjectRef:
        meta_ref, arrays[g] = pack_task.remote(groups[g], job)
        return meta_ref

    try:
        with _bar(
            job, total=sum(f.size for g in groups for f in g), unit="B", unit_scale=True, desc="tokenizing"
        ) as bar:

            def packed(g: int, meta: dict) -> None:
                metas[g] = meta
                bar.update(sum(f.size for f in groups[g]))

            _run_bounded(pack, len(groups), packed)
        plan = plan_shards([metas[g]["rows"] for g in range(len(groups))], job.per_shard)

        def write(index: int) -> ray.ObjectRef:
            slices = plan[index]
            return write_task.remote(
                job,
                shard_name(job.run_id, index, job.fmt),
                index * job.per_shard,
                [(lo, hi) for _, lo, hi in slices],
                *[arrays[g] for g, _, _ in slices],
            )

        with _bar(job, total=len(plan), unit="shard", desc="writing") as bar:

            def written(index: int, info: ShardInfo) -> None:
                shards[index] = info
                bar.update(1)

            _run_bounded(write, len(plan), written)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, PylonError):
            raise cause from None  # the task's own message, without a remote traceback around it
        raise
    return _Outcome(
        shards=[shards[i] for i in range(len(plan))],
        documents=sum(m["documents"] for m in metas.values()),
        skipped=[uri for g in range(len(groups)) for uri in metas[g]["skipped"]],
        tokenizer_sha256={m["tokenizer_sha256"] for m in metas.values()},
        truncated=sum(m["truncated"] for m in metas.values()),
        truncated_tokens=sum(m["truncated_tokens"] for m in metas.values()),
        conversational=sum(m["conversational"] for m in metas.values()),
        record_fields={name for m in metas.values() for name in m["record_fields"]},
    )


# Tasks a phase keeps in flight per CPU of the cluster: every CPU busy and one task queued behind it.
IN_FLIGHT_PER_CPU = 2
IN_FLIGHT_REFRESH_S = 10.0  # how often the cluster's CPUs are counted again (an autoscaler adds nodes)


def in_flight_limit(per_cpu: int = IN_FLIGHT_PER_CPU) -> int:
    """How many tasks `_run_bounded` keeps in flight on the connected cluster now: `per_cpu` per CPU, at least 2."""
    import ray

    return max(2, per_cpu * int(ray.cluster_resources().get("CPU", 1)))


def _run_bounded(submit, count: int, on_done, *, per_cpu: int = IN_FLIGHT_PER_CPU) -> None:
    """Run tasks 0..count-1: `submit(i)` starts the i-th and returns the ref its result comes in,
    `on_done(i, result)` takes each result as it arrives. At most `per_cpu` tasks per CPU of the cluster are in
    flight (at least 2), so a corpus of 100,000 groups does not queue 100,000 tasks in Ray's scheduler, and a
    failure has little left to stop. After a failure nothing new starts; the tasks in flight are waited for
    (up to 60 s), so what they write is there for the caller's cleanup, and then the failure is raised.

    They are never `ray.cancel`led: in Ray 2.60 a cancel that races with the task's reply fails a check in
    the caller's core worker ("Check failed: ... Tried to complete task that was not pending"; ray-project/ray
    PR 54798 fixed the same race for retries), and that aborts the calling process: a user's notebook, or
    `make test`'s whole integration session, which it did twice in CI after a prepare with a bad JSONL line."""
    import ray

    in_flight: dict = {}
    started = 0
    limit, counted_at = 0, float("-inf")
    try:
        while started < count or in_flight:
            if time.monotonic() - counted_at > IN_FLIGHT_REFRESH_S:
                limit, counted_at = in_flight_limit(per_cpu), time.monotonic()
            while started < count and len(in_flight) < limit:
                in_flight[submit(started)] = started
                started += 1
            done, _ = ray.wait(list(in_flight), num_returns=1)
            index = in_flight.pop(done[0])
            on_done(index, ray.get(done[0]))
    except BaseException:
        if in_flight:
            ray.wait(list(in_flight), num_returns=len(in_flight), timeout=60)
        raise


def _placement(job: _Job, groups: list[list[SourceFile]]) -> dict:
    """Pin tasks to this node when they read or write local paths: other nodes do not have them."""
    import ray

    uris: Iterable[str] = [job.out, *(f.uri for g in groups for f in g)]
    if job.tokenizer != "byte":
        uris = [*uris, job.tokenizer]
    if not any(isinstance(storage.resolve(u)[0], LocalFileSystem) for u in uris):
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def _pack_group_task(files: list[SourceFile], job: _Job) -> tuple[dict, tuple[np.ndarray, np.ndarray, list | None]]:
    group = pack_group(
        files,
        tokenizer=job.tokenizer,
        seq_len=job.seq_len,
        dtype=job.dtype,
        text_field=job.text_field,
        chat=job.chat,
        packing=job.packing,
        prompt_completion=job.prompt_completion,
        preference=job.preference,
        prompts=job.prompts,
    )
    meta = {
        "rows": group.rows,
        "documents": group.documents,
        "truncated": group.truncated,
        "truncated_tokens": group.truncated_tokens,
        "conversational": group.conversational,
        "skipped": group.skipped,
        "tokenizer_sha256": group.tokenizer_sha256,
        "record_fields": group.record_fields,
    }
    return meta, (group.tokens, group.num_tokens, group.records)


def _write_shard_task(
    job: _Job,
    name: str,
    first_id: int,
    ranges: list[tuple[int, int]],
    *group_arrays: tuple[np.ndarray, np.ndarray, list[str] | None],
) -> ShardInfo:
    parts = [
        (tokens[lo:hi], num_tokens[lo:hi], records[lo:hi] if records is not None else None)
        for (lo, hi), (tokens, num_tokens, records) in zip(ranges, group_arrays)
    ]
    return write_shard(job.out, job.fmt, name, first_id, parts)
