"""Storage URIs: the one place that turns a URI into an fsspec filesystem and a path.

Supported: plain paths (relative ones made absolute), ``file://``, ``s3://bucket/key``, ``memory://``.
Every user-facing failure is a StorageError naming the URI.

S3 reads the standard AWS environment, so any S3-compatible store (AWS, MinIO, Ceph, R2) works: endpoint
from AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; region from AWS_REGION, else AWS_DEFAULT_REGION;
credentials from botocore's usual chain. Retries: botocore's "standard" mode, 3 attempts (the AWS SDK
default) unless AWS_RETRY_MODE / AWS_MAX_ATTEMPTS say otherwise, so a dead endpoint fails in seconds.
fsspec caches instances by their arguments; endpoint, region and retries are arguments, so changing them
in the environment gives a new instance. Credentials are not (they must never be stored or printed):
an instance reads them when it first connects.

State goes through atomic_write: a temporary file/key beside the target, then a commit, so a reader
sees the old content or all of the new, never a part.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pylon import settings
from pylon.errors import StorageError

SUPPORTED_SCHEMES = ("file", "s3", "memory")
_SCHEMES_TEXT = "a plain path, " + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
_TEMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")
_S3_HINT = (
    "check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and the credentials in "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
)


def _parse(uri: str) -> tuple[str, str]:
    """(scheme, path in the form the scheme's filesystem expects)."""
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"{uri!r}: not a storage URI (supported: {_SCHEMES_TEXT})")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", uri
    elif scheme.lower() not in SUPPORTED_SCHEMES:
        raise StorageError(f"{uri}: unsupported scheme {scheme!r} (supported: {_SCHEMES_TEXT})")
    scheme = scheme.lower()
    if scheme == "file":
        if not rest:
            raise StorageError(f"{uri}: no path after file://")
        return scheme, os.path.abspath(os.path.expanduser(rest))
    if scheme == "s3":
        path = rest.rstrip("/")
        if not path or path.startswith("/"):
            raise StorageError(f"{uri}: an s3 URI needs a bucket (s3://BUCKET/key)")
        return scheme, path
    return scheme, "/" + rest.strip("/")


def _s3_endpoint() -> str | None:
    return settings.value(settings.S3_ENDPOINT) or settings.value(settings.ENDPOINT)


def _s3_filesystem() -> fsspec.AbstractFileSystem:
    client_kwargs: dict[str, Any] = {}
    if endpoint := _s3_endpoint():
        client_kwargs["endpoint_url"] = endpoint
    if region := settings.value(settings.REGION) or settings.value(settings.DEFAULT_REGION):
        client_kwargs["region_name"] = region
    attempts = settings.value(settings.MAX_ATTEMPTS) or "3"
    if not attempts.isdigit() or int(attempts) < 1:
        raise StorageError(f"AWS_MAX_ATTEMPTS={attempts!r}: must be a whole number >= 1")
    retries = {"mode": settings.value(settings.RETRY_MODE) or "standard", "max_attempts": int(attempts)}
    # Listings are not cached: other processes (Ray workers) write the keys we look for.
    return fsspec.filesystem(
        "s3", client_kwargs=client_kwargs, config_kwargs={"retries": retries}, use_listings_cache=False
    )


def _resolve(uri: str) -> tuple[str, fsspec.AbstractFileSystem, str]:
    scheme, path = _parse(uri)
    fs = _s3_filesystem() if scheme == "s3" else fsspec.filesystem(scheme)
    return scheme, fs, path


def resolve(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `uri` and the path within it (absolute for local files)."""
    _, fs, path = _resolve(uri)
    return fs, path


def describe(uri: str) -> str:
    """`uri` for logs and messages: scheme and path, and the endpoint for s3; never credentials."""
    scheme, path = _parse(uri)
    if scheme == "s3":
        return f"s3://{path} (endpoint {_s3_endpoint() or 'AWS default'})"
    return f"{scheme}://{path}"


def join(base_uri: str, *names: str) -> str:
    """`names` appended under `base_uri`; a name that could leave the base is refused."""
    if not base_uri:
        raise StorageError("cannot join names under an empty base URI")
    parts: list[str] = []
    for name in names:
        problem = _name_problem(name)
        if problem:
            raise StorageError(f"{name!r}: {problem} (joining under {base_uri})")
        parts.extend(name.split("/"))
    if not parts:
        return base_uri
    base = base_uri if base_uri.endswith("://") else base_uri.rstrip("/")
    return base + ("" if base.endswith("://") else "/") + "/".join(parts)


def _name_problem(name: str) -> str | None:
    if not isinstance(name, str) or not name:
        return "empty name"
    if "\x00" in name:
        return "contains a NUL character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    for component in name.split("/"):
        if not component:
            return "has an empty path component"
        if component in (".", ".."):
            return f"has a {component!r} path component"
    return None


@contextlib.contextmanager
def _storage_errors(uri: str, scheme: str, action: str) -> Iterator[None]:
    """Turn filesystem/botocore exceptions into StorageErrors that say what to check."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as e:
        if scheme == "s3" and "bucket" in str(e).lower():
            raise StorageError(f"{describe(uri)}: no such bucket; {_S3_HINT}") from e
        raise StorageError(f"{uri}: no such file or directory") from e
    except Exception as e:
        if scheme == "s3":
            from botocore.exceptions import BotoCoreError  # loaded already: s3fs is built on it

            if isinstance(e, (OSError, BotoCoreError)):
                raise StorageError(f"{describe(uri)}: cannot {action}: {type(e).__name__}: {e}; {_S3_HINT}") from e
        if isinstance(e, OSError):
            raise StorageError(f"{uri}: cannot {action}: {e}") from e
        raise


def atomic_write(uri: str, data: bytes) -> None:
    """Write `data` to `uri` so that readers see the old content or all of the new, never a part."""
    scheme, fs, path = _resolve(uri)
    parent, name = posixpath.split(path)
    if not name or not parent:
        raise StorageError(f"{uri}: names no file to write")
    temp = posixpath.join(parent, f".{name}.tmp-{uuid.uuid4().hex}")
    with _storage_errors(uri, scheme, "write"):
        if isinstance(fs, LocalFileSystem):
            _commit_local(temp, path, data)
        else:
            _commit_object(fs, temp, path, data)


def _commit_local(temp: str, path: str, data: bytes) -> None:
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    # The rename is durable only once the directory entry is on disk.
    dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _commit_object(fs: fsspec.AbstractFileSystem, temp: str, path: str, data: bytes) -> None:
    # Object stores have no rename: a server-side copy makes the target appear whole, in one step.
    try:
        fs.pipe_file(temp, data)
        fs.cp_file(temp, path)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort; the original error is the one to report
            fs.rm_file(temp)
        raise
    fs.rm_file(temp)  # committed; a failure here is still reported (listdir hides a leftover temp)


def atomic_write_text(uri: str, text: str) -> None:
    atomic_write(uri, text.encode("utf-8"))


def atomic_write_json(uri: str, obj: Any) -> None:
    """`obj` as JSON (sorted keys, indent 2, trailing newline), written atomically."""
    try:
        text = json.dumps(obj, sort_keys=True, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise StorageError(f"{uri}: cannot write as JSON: {e}") from e
    atomic_write_text(uri, text)


def read_bytes(uri: str) -> bytes:
    scheme, fs, path = _resolve(uri)
    with _storage_errors(uri, scheme, "read"):
        return fs.cat_file(path)


def read_text(uri: str) -> str:
    data = read_bytes(uri)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorageError(f"{uri}: not UTF-8 text (byte {e.start})") from e


def read_json(uri: str) -> Any:
    try:
        return json.loads(read_text(uri))
    except json.JSONDecodeError as e:
        raise StorageError(f"{uri}: not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from e


def exists(uri: str) -> bool:
    scheme, fs, path = _resolve(uri)
    with _storage_errors(uri, scheme, "check"):
        return bool(fs.exists(path))


def listdir(uri: str) -> list[str]:
    """Sorted names directly under `uri`; [] where nothing is there. In-flight atomic-write temps are hidden."""
    scheme, fs, path = _resolve(uri)
    with _storage_errors(uri, scheme, "list"):
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
    names = {posixpath.basename(e["name"].rstrip("/")) for e in entries}
    if len(entries) == 1 and entries[0]["type"] == "file" and entries[0]["name"].rstrip("/") == path:
        raise StorageError(f"{uri}: not a directory")
    return sorted(n for n in names if n and not _TEMP_NAME.match(n))


def remove(uri: str, recursive: bool = False) -> None:
    """Remove a file, or with `recursive` a directory and everything under it. Missing is an error."""
    scheme, fs, path = _resolve(uri)
    with _storage_errors(uri, scheme, "remove"):
        if not fs.exists(path):
            raise StorageError(f"{uri}: no such file or directory")
        if fs.isdir(path):
            if not recursive:
                raise StorageError(f"{uri}: is a directory; pass recursive=True to remove it and its contents")
            fs.rm(path, recursive=True)
        else:
            fs.rm_file(path)


def arrow_filesystem(uri: str) -> tuple["pyarrow.fs.FileSystem", str]:  # noqa: F821
    """The pyarrow filesystem and path for `uri`, for readers that take one (Ray Data, pyarrow).

    Local paths get pyarrow's native filesystem; s3:// and memory:// wrap the same fsspec instance that
    `resolve` configures (endpoint, region, retries), so every reader sees one configuration.
    """
    import pyarrow.fs as pafs

    scheme, fs, path = _resolve(uri)
    if scheme == "file":
        return pafs.LocalFileSystem(), path
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
