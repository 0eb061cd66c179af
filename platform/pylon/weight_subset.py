"""Part of a safetensors checkpoint, copied from object storage: only the tensors asked for, each read by byte range.

A pipeline stage of a model served across machines holds a run of its layers (pylon.serving.model.stages): of a
140 GB checkpoint in 4 stages, each stage's node copies its ~35 GB, not the whole checkpoint (vLLM's and SGLang's
pipeline stages each download every file and skip the others' tensors while loading).

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
byte range in the data after it, then the data. Its header is read first (two small ranged reads), then the chosen
tensors' ranges (neighbours merged into one read, at most CHUNK_BYTES in memory at a time), written into a local
safetensors file holding them alone: their offsets renumbered in the same order, the header's metadata kept. A
sharded checkpoint's index (`model.safetensors.index.json`) says which shard holds each tensor: a shard holding none
of the chosen is not read at all, and the local index lists the copied tensors only, so that transformers loads what
is there. A checkpoint of PyTorch `.bin` files (pickles: no byte ranges) is copied whole.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from pylon import storage
from pylon.errors import PylonError

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 64 * 2**20  # one ranged read at most: what a copy holds in memory
_HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on a header (a larger "length" is a foreign file)


@dataclass
class Copied:
    """What a partial copy read: `read` bytes from storage (headers included) of the checkpoint's `total` bytes of
    weight files; `tensors` of its `of` tensors."""

    read: int = 0
    total: int = 0
    tensors: int = 0
    of: int = 0

    def describe(self) -> str:
        return (
            f"{self.tensors} of its {self.of} tensors, {self.read / 2**20:.1f} MiB of its "
            f"{self.total / 2**20:.1f} MiB of weights"
        )


def _header(fs, uri: str, path: str, name: str) -> tuple[dict, int]:
    """The safetensors header of `path` (file `name` of the checkpoint `uri`) and where its data starts."""

    def read(start: int, end: int) -> bytes:
        return storage.with_retries(uri, f"read {name}", lambda: fs.cat_file(path, start=start, end=end))

    head = read(0, 8)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
    if length is None or not 2 <= length <= _HEADER_LIMIT:
        raise PylonError(f"model.path {storage.describe(uri)}: {name}: not a safetensors file (no header)")
    try:
        header = json.loads(read(8, 8 + length))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        where = f"model.path {storage.describe(uri)}: {name}"
        raise PylonError(f"{where}: its safetensors header is corrupt ({e})") from None
    return header, 8 + length


def _ranges(header: dict, keys: list[str]) -> list[tuple[int, int]]:
    """The byte ranges (in the data) of `keys`, in the file's order, neighbours merged."""
    merged: list[list[int]] = []
    for start, end in sorted(tuple(header[k]["data_offsets"]) for k in keys):
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def copy_file(fs, uri: str, path: str, name: str, local: str, keep: Callable[[str], bool]) -> tuple[Copied, list[str]]:
    """Of the safetensors file `path` (`name` in the checkpoint `uri`), the tensors `keep` accepts into the local
    file `local` (none: no file). Returns what was read, and the names of the tensors copied."""
    header, data_start = _header(fs, uri, path, name)
    metadata = header.pop("__metadata__", None)
    where = f"model.path {storage.describe(uri)}: {name}"
    try:
        kept = sorted((k for k in header if keep(k)), key=lambda k: header[k]["data_offsets"][0])
        sizes = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in kept}
    except (TypeError, KeyError, IndexError) as e:
        raise PylonError(f"{where}: its safetensors header is corrupt ({type(e).__name__}: {e})") from None
    copied = Copied(read=data_start, tensors=len(kept), of=len(header))
    if not kept:
        return copied, kept
    entries, offset = {}, 0
    if metadata is not None:
        entries["__metadata__"] = metadata
    for k in kept:
        entries[k] = {**header[k], "data_offsets": [offset, offset + sizes[k]]}
        offset += sizes[k]
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data 8-byte aligned, as safetensors writes it
    with open(local, "wb") as out:
        out.write(struct.pack("<Q", len(body)) + body)
        for start, end in _ranges(header, kept):
            for at in range(start, end, CHUNK_BYTES):
                stop = min(end, at + CHUNK_BYTES)
                a, b = data_start + at, data_start + stop
                data = storage.with_retries(uri, f"read {name}", lambda a=a, b=b: fs.cat_file(path, start=a, end=b))
                if len(data) != stop - at:
                    raise PylonError(
                        f"{where}: truncated: {len(data)} of the {stop - at} bytes at {a} (its header says more)"
                    )
                out.write(data)
                copied.read += len(data)
    return copied, kept


def copy_tensors(uri: str, local_dir: str, keep: Callable[[str], bool]) -> Copied:
    """Into `local_dir` (a model directory's copy holding its other files, the index among them), the weights of
    the checkpoint `uri` that `keep` accepts by name: the safetensors files' chosen tensors (see the module), `.bin`
    files whole. Returns what was read."""
    fs, root = storage.resolve(uri)
    root = root.rstrip("/")
    listing = storage.with_retries(uri, "list", lambda: fs.ls(root, detail=True))
    sizes = {
        os.path.basename(i["name"].rstrip("/")): int(i.get("size") or 0)
        for i in listing
        if i.get("type") != "directory"
    }
    index_path = os.path.join(local_dir, INDEX)
    index = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
            weight_map = dict(index["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise PylonError(f"model.path {storage.describe(uri)}: {INDEX}: not a safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if n not in sizes]
        if missing:
            raise PylonError(
                f"model.path {storage.describe(uri)}: {INDEX} names files that are not there "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the checkpoint is incomplete"
            )
    else:
        weight_map = None
        names = sorted(n for n in sizes if n.endswith(".safetensors"))
    total = Copied(total=sum(sizes[n] for n in names))
    kept_keys: dict[str, str] = {}
    by_file: dict[str, list[str]] = {}
    for key, name in (weight_map or {}).items():
        by_file.setdefault(name, []).append(key)
    for name in names:
        if weight_map is not None and not any(keep(k) for k in by_file[name]):
            total.of += len(by_file[name])
            continue  # none of its tensors is asked for: not even its header is read
        part, keys = copy_file(fs, uri, f"{root}/{name}", name, os.path.join(local_dir, name), keep)
        total.read += part.read
        total.tensors += part.tensors
        total.of += part.of
        kept_keys.update((k, name) for k in keys)
    if not names:  # no safetensors: PyTorch pickles, copied whole (transformers reads them whole anyway)
        for name in sorted(n for n in sizes if n.endswith(".bin")):
            storage.with_retries(uri, f"read {name}", lambda n=name: fs.get(f"{root}/{n}", os.path.join(local_dir, n)))
            total.read += sizes[name]
            total.total += sizes[name]
    if index is not None:
        index["weight_map"] = kept_keys
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    return total
