"""The on-storage format of prepared data: shards of fixed-length token sequences and their manifest.

A prepared dataset is a directory (local or object storage) holding shard files and `manifest.json`.
The manifest is written last and atomically: it is the commit. Readers read only the shards it lists,
so a crashed or concurrent `prepare` can never mix into what a reader sees.

Every row ("sample") has a dataset-wide `id` (contiguous from 0 in shard order), `num_tokens` (real tokens; the rest
of the row is the tokenizer's pad id: only a group's last row under wrapped packing, any row under bfd) and `tokens`
(exactly `seq_len`).

- parquet: columns `id: int64`, `num_tokens: int32`, `tokens: list<uint16|int32>`.
- webdataset: a POSIX tar; per sample `<id:012d>.tokens.npy` (a 1-D numpy array) and `<id:012d>.json`
  (`{"id": ..., "num_tokens": ...}`), so any WebDataset reader can decode it.

Documents are packed one after another. In a text dataset each ends with the tokenizer's eos, which is where the
next one starts. A chat dataset (`loss_mask`) stores int32 words: a token outside the assistant's replies as
-(word + 1), and a conversation's first token with `DOCUMENT_START` set in its word (`document_starts`), so that a
row says which tokens the loss counts and where each conversation starts without another column (`split_words`).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from pylon import storage
from pylon.errors import PylonError, StorageError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
SHARD_SUFFIX = {"parquet": ".parquet", "webdataset": ".tar"}


class DataError(PylonError):
    """A dataset or shard that cannot be used; the message names the shard or URI at fault."""


class BadShardError(DataError):
    """One shard failed its checks (checksum, size, schema, truncation)."""

    def __init__(self, shard: str, problem: str):
        self.shard, self.problem = shard, problem
        super().__init__(f"shard {shard}: {problem}")

    def __reduce__(self):  # crosses process boundaries inside Ray tasks
        return (BadShardError, (self.shard, self.problem))


# ---------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerInfo(_Model):
    """Identity of the tokenizer a dataset was made with; training and serving must use the same one."""

    kind: Literal["byte", "tokenizers", "huggingface"]
    name: str
    vocab_size: int = Field(ge=1)
    eos_id: int = Field(ge=0)
    pad_id: int = Field(ge=0)
    sha256: str | None = Field(None, description="of the tokenizer's files; None for the built-in byte tokenizer")
    uri: str | None = Field(
        None,
        description="where the tokenizer's files were read (credentials removed); "
        "`pylon export` copies them into the model from here",
    )


def _plain_name(name: str) -> str:
    """A file of the dataset's own directory: a manifest names nothing outside it."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{name!r} is not a file name in the dataset's directory")
    return name


FileName = Annotated[str, AfterValidator(_plain_name)]


class RecordsInfo(_Model):
    """A shard's records file (`records_name`): JSON Lines, one line per row of the shard, each a JSON list with one
    entry per document that starts in that row (in order): the object of its source record's other fields, or null."""

    file: FileName
    bytes: int = Field(ge=0)
    sha256: str


class ShardInfo(_Model):
    file: FileName
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str
    first_id: int = Field(ge=0)
    # the source records' other fields of the documents in this shard (ShardManifest.record_fields); None: none had any
    records: RecordsInfo | None = None


class Totals(_Model):
    documents: int = Field(ge=0)
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    skipped_files: int = Field(0, ge=0, description="source files left out because they are not UTF-8 text")
    truncated_documents: int = Field(0, ge=0, description="documents longer than a row, cut to one (packing bfd)")
    truncated_tokens: int = Field(0, ge=0, description="the tokens cut off them")


class ShardManifest(_Model):
    format_version: int = FORMAT_VERSION
    format: Literal["parquet", "webdataset"]
    seq_len: int = Field(ge=1)
    dtype: Literal["uint16", "int32"]
    tokenizer: TokenizerInfo
    shards: list[ShardInfo]
    totals: Totals
    sources: list[str] = Field(default_factory=list)
    run_id: str = ""
    created_at: float = Field(default_factory=time.time)
    # A chat dataset (`pylon data prepare --chat`): its tokens outside the assistant's replies are stored as
    # -(id + 1) (prepare.chat_tokens), and the loss counts only the others (reader.Batch.to_torch)
    loss_mask: bool = False
    # A chat dataset whose words mark each conversation's first token (DOCUMENT_START); one prepared before Pylon
    # recorded that has none, and cannot be trained with `attention_mask: document`
    document_starts: bool = False
    # How documents were packed into rows: "wrapped", one after another and cut wherever a row ends (a document can
    # run on into the next row); "bfd", each whole in one row (best-fit decreasing), rows padded
    packing: Literal["wrapped", "bfd"] = "wrapped"
    # A prompt-completion dataset (`pylon data prepare --prompt-completion`): stored as a chat dataset is, each
    # record's completion (and its eos) the part the loss counts
    prompt_completion: bool = False
    # A preference dataset (`pylon data prepare --preference`, for `objective: dpo`): stored as a prompt-completion
    # dataset is, each record two documents in one row, its prompt with the chosen completion then with the rejected
    preference: bool = False
    # How its pairs were given (a reward model reads them differently, `pylon.jobs.dpo.document_rewards`): "text",
    # a prompt and completions as strings, each completion followed by the eos prepare appends; "conversational",
    # messages rendered by the chat template; "mixed", both. None: not a preference dataset, or one prepared before
    # Pylon recorded it (read as text)
    preference_format: Literal["text", "conversational", "mixed"] | None = None
    # A prompts dataset (`pylon data prepare --prompts`, for `objective: grpo`): stored as a prompt-completion one, each
    # record's answer (possibly empty) its completion
    prompts: bool = False
    # How a prompts or prompt-completion dataset's prompts were given: "text", strings; "conversational", lists of
    # messages (TRL's conversational format), rendered by the chat template, each record's messages kept in its
    # records file under `prompt` (objective grpo's reward functions and reward models take them as messages,
    # `PROMPT_MESSAGES`); "mixed", both. None: neither kind of dataset, or one prepared before Pylon recorded it (text)
    prompt_format: Literal["text", "conversational", "mixed"] | None = None
    # The names of the fields its source records held beside the ones prepare reads (a prompt's `answer` and
    # `prompt`, a prompt-completion record's, a conversation's): kept per document in each shard's records file
    # (`RecordsInfo`) and handed to objective grpo's reward functions by name, as TRL hands a dataset's columns
    record_fields: list[str] = Field(default_factory=list)

    @property
    def has_records(self) -> bool:
        """Whether its shards have records files: fields beside the ones prepare reads, or conversational prompts'
        messages."""
        return bool(self.record_fields) or self.prompt_format in ("conversational", "mixed")

    def check(self, where: str) -> None:
        """Internal consistency: ids contiguous in shard order, totals adding up."""
        next_id = 0
        for shard in self.shards:
            if shard.first_id != next_id:
                raise DataError(f"{where}: shard {shard.file} starts at id {shard.first_id}, expected {next_id}")
            next_id += shard.rows
        sums = (sum(s.rows for s in self.shards), sum(s.tokens for s in self.shards), sum(s.bytes for s in self.shards))
        if sums != (self.totals.rows, self.totals.tokens, self.totals.bytes):
            raise DataError(f"{where}: totals {self.totals.model_dump()} do not match the shards' sums {sums}")

    def summary(self) -> str:
        t = self.totals
        return (
            f"{self.format} dataset: {len(self.shards)} shard(s), {t.rows:,} sequences of {self.seq_len} tokens, "
            f"{t.tokens:,} tokens from {t.documents:,} documents, {t.bytes / 2**20:.1f} MiB; "
            f"tokenizer {self.tokenizer.kind}:{self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
            + (
                "; preference pairs (a prompt, its chosen and its rejected completion"
                + {"conversational": ", as conversations)", "mixed": ", as text and as conversations)"}.get(
                    self.preference_format or "", ")"
                )
                if self.preference
                else "; prompts and their answers, for objective grpo" + _as_messages(self.prompt_format)
                if self.prompts
                else "; prompts and completions, the loss on the completions" + _as_messages(self.prompt_format)
                if self.prompt_completion
                else "; conversations, the loss on the assistant's replies"
                if self.loss_mask
                else ""
            )
            + (f"; record fields {', '.join(self.record_fields)}" if self.record_fields else "")
            + (
                f"; each document whole in a row (rows {t.tokens / max(t.rows * self.seq_len, 1):.0%} full"
                + (f", {t.truncated_documents:,} cut to a row" if t.truncated_documents else "")
                + ")"
                if self.packing == "bfd"
                else ""
            )
        )


def _as_messages(prompt_format: str | None) -> str:
    return {"conversational": " (as conversations)", "mixed": " (as text and as conversations)"}.get(
        prompt_format or "", ""
    )


# Where a conversational prompt's messages sit in its record (`ShardManifest.prompt_format`): the source's own key,
# which prepare reads, so never one of `record_fields`
PROMPT_MESSAGES = "prompt"

DOCUMENT_START = 1 << 30  # in a chat dataset's word: this token starts a conversation (ids stay below 2**30)


def split_words(
    tokens: np.ndarray, *, loss_mask: bool, eos_id: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Stored rows as (their token ids as int64, which of them are context or None, which start a document).

    A chat dataset's (`ShardManifest.loss_mask`, `prepare.chat_tokens` wrote it): context (tokens outside the
    assistant's replies) stored as -(word + 1), a conversation's first word with DOCUMENT_START set. A text
    dataset's documents each end with `eos_id`: the token after one starts the next (a row's first token is not
    marked, whether or not a document begins there; a chat row's is when a conversation does)."""
    tokens = np.asarray(tokens)
    if loss_mask:
        context = tokens < 0
        words = np.where(context, -tokens.astype(np.int64) - 1, tokens.astype(np.int64))
        starts = (words & DOCUMENT_START) != 0
        return words & ~DOCUMENT_START, context, starts
    ids = tokens.astype(np.int64)
    starts = np.zeros(ids.shape, dtype=bool)
    starts[..., 1:] = ids[..., :-1] == eos_id
    return ids, None, starts


def separate_documents(setting: str, manifest: ShardManifest, where: str) -> bool:
    """Whether rows of `manifest`'s dataset are attended one document at a time under `attention_mask` `setting`
    (TrainJobSpec.attention_mask): "document" yes, "causal" no, "auto" for a chat dataset that marks where its
    conversations start. DataError naming `where` (the dataset) for "document" on a chat dataset without marks."""
    if setting == "causal":
        return False
    if setting == "auto":
        return manifest.loss_mask and manifest.document_starts
    if manifest.loss_mask and not manifest.document_starts:
        raise DataError(
            f"{where}: attention_mask document needs to know where each conversation starts, and this chat dataset "
            "was prepared before Pylon recorded it; prepare it again (`pylon data prepare --chat ... --overwrite`) "
            "or set attention_mask: causal"
        )
    return True


def manifest_uri(dataset_uri: str) -> str:
    return storage.join(dataset_uri, MANIFEST_NAME)


def read_manifest(dataset_uri: str) -> ShardManifest:
    """The committed manifest of a prepared dataset, checked; DataError saying what is wrong otherwise."""
    uri = manifest_uri(dataset_uri)
    try:
        raw = storage.read_json(uri)
    except StorageError as e:
        if not storage.exists(uri):
            hint = (
                f"no dataset was prepared there (run `pylon data prepare SRC... --out {dataset_uri}`)"
                if not storage.listdir(dataset_uri)
                else "the directory has files but no manifest: a `prepare` did not finish; re-run it with --overwrite"
            )
            raise DataError(f"{dataset_uri}: no {MANIFEST_NAME}; {hint}") from None
        raise DataError(str(e)) from None
    try:
        manifest = ShardManifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        raise DataError(f"{uri}: not a Pylon manifest ({path}: {first['msg']})") from None
    if manifest.format_version != FORMAT_VERSION:
        raise DataError(f"{uri}: format_version {manifest.format_version}; this Pylon reads {FORMAT_VERSION}")
    manifest.check(uri)
    return manifest


# ---------------------------------------------------------------------------------------------------------
# Shard codec
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ShardRows:
    """Rows of one shard as arrays: ids (n,), num_tokens (n,), tokens (n, seq_len)."""

    ids: np.ndarray
    num_tokens: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_shard(fmt: str, rows: ShardRows) -> bytes:
    """A shard file's bytes in `fmt`."""
    if fmt == "parquet":
        n, seq_len = rows.tokens.shape
        values = pa.array(rows.tokens.reshape(-1))
        table = pa.table(
            {
                "id": pa.array(rows.ids.astype(np.int64)),
                "num_tokens": pa.array(rows.num_tokens.astype(np.int32)),
                "tokens": pa.FixedSizeListArray.from_arrays(values, seq_len),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="snappy", row_group_size=max(1, min(n, 8192)))
        return sink.getvalue()
    if fmt == "webdataset":
        sink = io.BytesIO()
        with tarfile.open(fileobj=sink, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(len(rows)):
                key = f"{int(rows.ids[i]):012d}"
                npy = io.BytesIO()
                np.save(npy, rows.tokens[i], allow_pickle=False)
                meta = json.dumps({"id": int(rows.ids[i]), "num_tokens": int(rows.num_tokens[i])}).encode()
                for name, payload in ((f"{key}.tokens.npy", npy.getvalue()), (f"{key}.json", meta)):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(payload), 0, 0o644
                    tar.addfile(info, io.BytesIO(payload))
        return sink.getvalue()
    raise ValueError(f"unknown shard format {fmt!r}")


def decode_shard_table(fmt: str, data: bytes, *, shard: str, seq_len: int, dtype: str) -> pa.Table:
    """A shard as an Arrow table (id, num_tokens, tokens: fixed_size_list). For parquet this is the file's own
    decoded columns with no further copy, which is what a streaming reader wants to hand on."""
    if fmt != "parquet":
        rows = decode_shard(fmt, data, shard=shard, seq_len=seq_len, dtype=dtype)
        return pa.table(
            {
                "id": rows.ids,
                "num_tokens": rows.num_tokens,
                "tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.tokens.reshape(-1)), seq_len),
            }
        )
    try:
        table = pq.read_table(pa.BufferReader(data), use_threads=False)
    except Exception as e:
        raise BadShardError(shard, f"cannot be decoded as parquet ({type(e).__name__}: {e})") from None
    missing = _PARQUET_SCHEMA - set(table.column_names)
    if missing:
        raise BadShardError(shard, f"schema lacks column(s) {sorted(missing)} (has {table.column_names})")
    tokens = table.schema.field("tokens").type
    if not pa.types.is_fixed_size_list(tokens) or tokens.list_size != seq_len or str(tokens.value_type) != dtype:
        raise BadShardError(shard, f"tokens column is {tokens}, manifest says fixed_size_list<{dtype}>[{seq_len}]")
    return table.select(["id", "num_tokens", "tokens"])


def decode_shard(fmt: str, data: bytes, *, shard: str, seq_len: int, dtype: str) -> ShardRows:
    """Rows from a shard file's bytes; BadShardError naming `shard` for anything malformed."""
    try:
        rows = _decode_parquet(data, seq_len) if fmt == "parquet" else _decode_tar(data, seq_len)
    except BadShardError as e:
        raise BadShardError(shard, e.problem) from None
    except Exception as e:  # pyarrow/tarfile/numpy each have their own error types for a damaged file
        raise BadShardError(shard, f"cannot be decoded as {fmt} ({type(e).__name__}: {e})") from None
    if rows.tokens.shape[1:] != (seq_len,):
        raise BadShardError(shard, f"rows hold {rows.tokens.shape[1:]} tokens, manifest says seq_len {seq_len}")
    return ShardRows(rows.ids.astype(np.int64), rows.num_tokens.astype(np.int32), rows.tokens.astype(dtype, copy=False))


_PARQUET_SCHEMA = {"id", "num_tokens", "tokens"}


def _decode_parquet(data: bytes, seq_len: int) -> ShardRows:
    table = pq.read_table(pa.BufferReader(data))
    missing = _PARQUET_SCHEMA - set(table.column_names)
    if missing:
        raise BadShardError("?", f"schema lacks column(s) {sorted(missing)} (has {table.column_names})")
    tokens_col = table.column("tokens").combine_chunks()
    flat = tokens_col.flatten().to_numpy(zero_copy_only=False)
    n = len(table)
    if flat.size != n * seq_len:
        raise BadShardError("?", f"{flat.size} tokens in {n} rows, expected {n * seq_len} (seq_len {seq_len})")
    return ShardRows(table.column("id").to_numpy(), table.column("num_tokens").to_numpy(), flat.reshape(n, seq_len))


def _decode_tar(data: bytes, seq_len: int) -> ShardRows:
    ids, lens, toks = [], [], []
    meta: dict[str, dict] = {}
    arrays: dict[str, np.ndarray] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            payload = tar.extractfile(member).read()
            if len(payload) != member.size:
                raise BadShardError("?", f"member {member.name} is truncated")
            if ext == "json":
                meta[key] = json.loads(payload)
            elif ext == "tokens.npy":
                arrays[key] = read_npy(payload)
    if set(meta) != set(arrays):
        raise BadShardError("?", f"{len(set(meta) ^ set(arrays))} sample(s) lack their .json or .tokens.npy member")
    for key in sorted(meta):
        ids.append(meta[key]["id"])
        lens.append(meta[key]["num_tokens"])
        toks.append(arrays[key])
    if not toks:
        return ShardRows(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros((0, seq_len), np.int32))
    return ShardRows(np.asarray(ids), np.asarray(lens), np.stack(toks))


# The header of a 1-D .npy array as numpy writes it (format 1.0-3.0): read without `ast`.
_NPY_HEADER = re.compile(r"\{'descr': '([<>|][iuf][1248])', 'fortran_order': (False|True), 'shape': \((\d+),\), \}\s*")
_NP_LOAD_LOCK = threading.Lock()


def read_npy(payload: bytes) -> np.ndarray:
    """A 1-D array from .npy bytes.

    numpy parses an .npy header with `ast.literal_eval`, and CPython 3.11 up to 3.11.7 can fail that with
    "SystemError: AST constructor recursion depth mismatch" when threads parse at once (shards are verified
    and decoded in parallel). The headers numpy writes for 1-D arrays are parsed here by a strict pattern;
    anything else goes to `np.load` one thread at a time.
    """
    if payload[:6] == b"\x93NUMPY" and len(payload) >= 10:
        major = payload[6]
        size_bytes = 2 if major == 1 else 4
        start = 8 + size_bytes
        header_len = int.from_bytes(payload[8:start], "little")
        try:
            header = payload[start : start + header_len].decode("latin1" if major < 3 else "utf8")
        except UnicodeDecodeError:
            header = ""
        m = _NPY_HEADER.fullmatch(header)
        if m and m.group(2) == "False":
            dtype = np.dtype(m.group(1))
            count = int(m.group(3))
            body = payload[start + header_len :]
            if len(body) != count * dtype.itemsize:
                raise ValueError(f".npy body is {len(body)} bytes, its header says {count} x {dtype}")
            return np.frombuffer(body, dtype=dtype).copy()
    with _NP_LOAD_LOCK:
        return np.load(io.BytesIO(payload), allow_pickle=False)


# ---------------------------------------------------------------------------------------------------------
# Records files: the source records' other fields, per document
# ---------------------------------------------------------------------------------------------------------

RECORDS_SUFFIX = ".records.jsonl"


def records_name(shard_file: str) -> str:
    """The records file beside shard `shard_file` (`part-...-00003.parquet` -> `part-...-00003.records.jsonl`)."""
    return shard_file.rsplit(".", 1)[0] + RECORDS_SUFFIX


def decode_records(data: bytes, *, info: ShardInfo) -> list[list[dict | None]]:
    """A records file's rows (each row's documents' records, in order), checked against `info` (its shard's entry:
    size, sha256, one line per row); BadShardError naming the file otherwise."""
    where = info.records.file
    if len(data) != info.records.bytes:
        raise BadShardError(where, f"{len(data)} bytes, manifest says {info.records.bytes} (truncated or replaced)")
    digest = sha256_hex(data)
    if digest != info.records.sha256:
        want = info.records.sha256[:12]
        raise BadShardError(where, f"sha256 {digest[:12]}... does not match the manifest's {want}...")
    lines = data.decode("utf-8").split("\n") if data else []
    if len(lines) != info.rows:
        raise BadShardError(where, f"{len(lines)} lines, its shard {info.file} holds {info.rows} rows")
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadShardError(where, f"line {i + 1}: not JSON ({e})") from None
        if not isinstance(row, list) or not all(r is None or isinstance(r, dict) for r in row):
            raise BadShardError(where, f"line {i + 1}: not a list of records (objects or null)")
        rows.append(row)
    return rows


def verify_shard_bytes(info: ShardInfo, data: bytes) -> None:
    """Size and sha256 against the manifest; BadShardError naming the shard otherwise."""
    if len(data) != info.bytes:
        raise BadShardError(info.file, f"{len(data)} bytes, manifest says {info.bytes} (truncated or replaced)")
    digest = sha256_hex(data)
    if digest != info.sha256:
        raise BadShardError(info.file, f"sha256 {digest[:12]}... does not match the manifest's {info.sha256[:12]}...")
