"""Storage URIs: the one place that turns a URI into an fsspec filesystem and a path.

Supported: plain paths (relative ones made absolute), ``file://``, ``s3://bucket/key``, ``memory://``.
Every user-facing failure is a StorageError naming the URI.

S3 reads the standard AWS environment, so any S3-compatible store (AWS, MinIO, Ceph, R2) works: endpoint
from AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; region from AWS_REGION, else AWS_DEFAULT_REGION;
credentials from botocore's usual chain.

Retries, in two layers. Each request: botocore's "standard" mode, 3 attempts (the AWS SDK default) unless
AWS_RETRY_MODE / AWS_MAX_ATTEMPTS say otherwise, each waiting at most PYLON_STORAGE_TIMEOUT_S to connect and per
read. Each operation of this module (a write, a read, a listing, a file's streamed upload or download): a transient
failure (connection refused, reset or closed, a timeout, a 5xx, SlowDown; `is_transient`) is retried, the whole
operation again, with exponential backoff and jitter, until PYLON_STORAGE_RETRY_S (default 120 s) have passed;
then the StorageError names the URI, the last error and how long it was retried. Every operation may be repeated:
a write is one PUT or one multipart upload to the final key (a retried multipart upload is a new one; the failed
one is aborted, it never becomes visible), a read starts its file again. Anything else fails at once.
fsspec caches instances by their arguments; endpoint, region, timeouts and retries are arguments, so changing them
in the environment gives a new instance. Credentials are not (they must never be stored or printed):
an instance reads them when it first connects.

Small state goes through atomic_write, so a reader sees the old content or all of the new, never a part: on local
disk a temporary file beside the target renamed over it; on object storage one direct PUT (an object store makes
an object visible only once it is whole), so every object is written once.

Large files go through upload_file / download_file: streamed in parts of `part_size` bytes (DEFAULT_PART_SIZE),
sha256 computed on the way, at most one part in memory whatever the file's size (an upload to S3 reads each
part from the file as it sends it, so holds none). To S3 a file of more than one part is a multipart upload
straight to its final key (visible only once completed; aborted on error), one part a single PUT; on local disk
it is streamed into a temporary file that is renamed over the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import posixpath
import random
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from pylon import settings
from pylon.errors import StorageError

log = logging.getLogger(__name__)

SUPPORTED_SCHEMES = ("file", "s3", "memory")
_SCHEMES_TEXT = "a plain path, " + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
_TEMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")
DEFAULT_PART_SIZE = 8 * 2**20
# S3's multipart limits: every part but the last at least 5 MiB, at most 5 GiB, at most 10,000 parts.
_S3_MIN_PART, _S3_MAX_PART, _S3_MAX_PARTS = 5 * 2**20, 5 * 2**30, 10_000
_NET_READ = 256 * 2**10  # a download's reads from the socket: aiohttp buffers up to twice the largest asked for
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
    timeout = _seconds(settings.STORAGE_TIMEOUT_S, "60", minimum=0.001)
    config = {"retries": retries, "connect_timeout": timeout, "read_timeout": timeout}
    # Listings are not cached: other processes (Ray workers) write the keys we look for.
    return fsspec.filesystem("s3", client_kwargs=client_kwargs, config_kwargs=config, use_listings_cache=False)


def _seconds(name: str, default: str, *, minimum: float) -> float:
    text = settings.value(name) or default
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= minimum or seconds == float("inf"):
        raise StorageError(f"{name}={text!r}: must be a number of seconds >= {minimum:g}")
    return seconds


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


# ---------------------------------------------------------------------------------------------------------
# Transient failures, retried with backoff until a deadline
# ---------------------------------------------------------------------------------------------------------

_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.5, 8.0
# S3 error codes that say "try again" (besides any 5xx status).
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "Throttling"}
    | {"ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "OperationAborted"}
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE}
    | {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN}
)


def retry_deadline_s() -> float:
    """PYLON_STORAGE_RETRY_S: how long an operation keeps retrying transient failures (0: not at all)."""
    return _seconds(settings.STORAGE_RETRY_S, "120", minimum=0)


def is_transient(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is a failure that trying again may cure: a connection
    refused, reset or closed, a timeout, an S3 5xx or SlowDown. A missing key, a refused credential, a full disk
    are not."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _transient_one(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):  # the builtins: refused, reset, aborted, broken pipe
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    # Only libraries already loaded can have raised their errors: a local-only process never imports them here.
    if (boto := sys.modules.get("botocore.exceptions")) is not None:
        if isinstance(e, (boto.ConnectionError, boto.HTTPClientError, boto.ResponseStreamingError)):
            return True  # endpoint unreachable, connection closed, read/connect timeouts, a body cut short
        if isinstance(e, getattr(boto, "IncompleteReadError", ())):
            return True
        if isinstance(e, boto.ClientError):
            response = getattr(e, "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return response.get("Error", {}).get("Code") in _TRANSIENT_CODES or int(status) >= 500
    if (aiohttp := sys.modules.get("aiohttp")) is not None and isinstance(
        e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
    ):
        return True
    if (fsspec_exceptions := sys.modules.get("fsspec.exceptions")) is not None and isinstance(
        e, fsspec_exceptions.FSTimeoutError
    ):
        return True
    return type(e).__name__ == "IncompleteRead"  # http.client's and urllib3's


class _Attempts:
    """One operation's tries: how many, since when, and until when."""

    def __init__(self) -> None:
        self.limit_s = retry_deadline_s()
        self.started = time.monotonic()
        self.count = 0

    def note(self, error: BaseException) -> str:
        """For a transient `error` that ended the operation: how long it was retried."""
        if not is_transient(error):
            return ""
        elapsed = time.monotonic() - self.started
        attempts = f"{self.count} attempts" if self.count != 1 else "1 attempt"
        return (
            f" (still failing after {attempts} over {elapsed:.0f}s; "
            f"{settings.STORAGE_RETRY_S}={self.limit_s:g} bounds the retries)"
        )


def _retrying(uri: str, action: str, fn: Callable[[], Any], attempts: _Attempts) -> Any:
    """`fn()`, tried again after each transient failure, with exponential backoff and jitter, until the
    deadline; the last failure is raised as it was."""
    while True:
        attempts.count += 1
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            backoff = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (attempts.count - 1))
            pause = random.uniform(backoff / 2, backoff)  # jitter: ranks retrying together spread out
            if time.monotonic() + pause - attempts.started > attempts.limit_s:
                raise
            log.warning(
                "%s: cannot %s (%s: %s); retrying in %.1fs (attempt %d; retrying for up to %gs in all)",
                _describe_safe(uri),
                action,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
                pause,
                attempts.count,
                attempts.limit_s,
            )
            time.sleep(pause)


def _describe_safe(uri: str) -> str:
    try:
        return describe(uri)
    except StorageError:
        return str(uri)


def with_retries(uri: str, action: str, fn: Callable[[], Any]) -> Any:
    """`fn()` (work on `uri` that this module does not do itself, such as a recursive listing or opening a Ray Data
    source), with the retries of every storage operation and its errors as StorageErrors naming `uri`."""
    scheme, _ = _parse(uri)
    return _run(uri, scheme, action, fn)


def _run(uri: str, scheme: str, action: str, fn: Callable[[], Any]) -> Any:
    attempts = _Attempts()
    with _storage_errors(uri, scheme, action, attempts):
        return _retrying(uri, action, fn, attempts)


@contextlib.contextmanager
def _storage_errors(uri: str, scheme: str, action: str, attempts: _Attempts | None = None) -> Iterator[None]:
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
        retried = attempts.note(e) if attempts is not None else ""
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise StorageError(_no_space(uri, action, e)) from e
        if scheme == "s3":
            from botocore.exceptions import BotoCoreError  # loaded already: s3fs is built on it

            if isinstance(e, (OSError, BotoCoreError)) or is_transient(e):
                raise StorageError(
                    f"{describe(uri)}: cannot {action}: {type(e).__name__}: {e}{retried}; {_S3_HINT}"
                ) from e
        if isinstance(e, OSError) or is_transient(e):
            raise StorageError(f"{uri}: cannot {action}: {e}{retried}") from e
        raise


def _no_space(uri: str, action: str, e: OSError) -> str:
    """The message for a full disk: which path, how much room is left, what to do."""
    where = e.filename or uri
    probe = where if os.path.isdir(where) else os.path.dirname(where)
    free = ""
    with contextlib.suppress(OSError):
        st = os.statvfs(probe)
        free = f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB)"
    return (
        f"{uri}: cannot {action}: No space left on the device holding {where}{free}; "
        "free space there or write somewhere with more room"
    )


def atomic_write(uri: str, data: bytes) -> None:
    """Write `data` to `uri` so that readers see the old content or all of the new, never a part.

    Local disk: a temporary file beside the target, fsynced, renamed over it. Object storage: one direct write
    (a PUT: the object appears whole or not at all), so the object is written once, with no temporary key."""
    scheme, fs, path = _resolve(uri)
    parent, name = posixpath.split(path)
    if not name or not parent:
        raise StorageError(f"{uri}: names no file to write")
    if isinstance(fs, LocalFileSystem):
        _run(uri, scheme, "write", lambda: _write_local(path, lambda f: f.write(data)))
    else:
        _run(uri, scheme, "write", lambda: fs.pipe_file(path, data))


def _write_local(path: str, fill: Callable[[IO[bytes]], Any], *, durable: bool = True) -> Any:
    """`fill(file)` into a temporary file beside `path`, then renamed over `path`: readers see the old file or
    all of the new. `durable`: the file and the directory entry are fsynced too. Returns what `fill` returned."""
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(temp, "xb") as f:
            result = fill(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if not durable:
        return result
    # The rename is durable only once the directory entry is on disk.
    dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return result


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
    return _run(uri, scheme, "read", lambda: fs.cat_file(path))


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


# ---------------------------------------------------------------------------------------------------------
# Large files, streamed: bounded memory whatever their size
# ---------------------------------------------------------------------------------------------------------


def upload_file(local_path: str | os.PathLike, uri: str, *, part_size: int = DEFAULT_PART_SIZE) -> tuple[str, int]:
    """Copy the local file `local_path` to `uri`, streamed in parts of `part_size` bytes, with its sha256 computed
    on the way. Returns (sha256 hex digest, bytes) of what was written.

    The file is written once, at its final name, and readers see it whole or not at all: to S3 one PUT, or for a
    file of more than one part a multipart upload (aborted on error); on local disk a temporary file renamed over
    the target. To S3 each part's body is read from the file as it is signed and sent, a few parts in flight, so
    memory is a few MiB whatever the part or file size; elsewhere one buffer of `part_size` bytes. Parts grow past
    `part_size` only for a file of more than 10,000 parts (S3's limit).
    """
    scheme, fs, path = _resolve(uri)
    _check_part_size(part_size, minimum=_S3_MIN_PART if scheme == "s3" else 1)
    if not posixpath.basename(path):
        raise StorageError(f"{uri}: names no file to write")
    with open(local_path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        unaborted: list[str] = []  # multipart uploads of failed attempts that could not be aborted then

        def attempt() -> tuple[str, int]:
            if isinstance(fs, LocalFileSystem):
                src.seek(0)
                return _write_local(path, lambda out: _copy_hashing(src, out.write, part_size, size))
            if scheme == "s3":
                return fsspec.asyn.sync(fs.loop, _upload_s3, fs, path, src, size, part_size, unaborted)
            # memory:// keeps whole files in memory by nature; one pipe_file makes the file appear whole.
            src.seek(0)
            data = bytearray()
            digest, total = _copy_hashing(src, data.extend, part_size, size)
            fs.pipe_file(path, bytes(data))
            return digest, total

        result = _run(uri, scheme, "write", attempt)
        if unaborted:  # the store answers again: drop the invisible parts the failed attempts left (best effort)
            fsspec.asyn.sync(fs.loop, _abort_uploads, fs, path, unaborted)
        return result


def download_file(
    uri: str, local_path: str | os.PathLike, *, part_size: int = DEFAULT_PART_SIZE, expect_sha256: str | None = None
) -> tuple[str, int]:
    """Copy `uri` to the local file `local_path`, streamed in parts of `part_size` bytes, with its sha256 computed
    on the way. Returns (sha256 hex digest, bytes).

    The bytes go to a temporary file beside `local_path`, renamed over it once complete: `local_path` is never
    a part of the file. With `expect_sha256`, a different digest raises StorageError naming `uri` and leaves no
    file. At most one part is in memory: from S3 as two halves, one being received while the other is hashed and
    written.
    """
    scheme, fs, path = _resolve(uri)
    _check_part_size(part_size, minimum=1)

    def attempt(out: IO[bytes]) -> tuple[str, int]:
        out.seek(0)  # a retry starts the file again
        out.truncate()
        try:
            if scheme == "s3":
                return fsspec.asyn.sync(fs.loop, _download_s3, fs, path, out, part_size)
            with open(path, "rb") if isinstance(fs, LocalFileSystem) else fs.open(path, "rb") as src:
                return _copy_hashing(src, out.write, part_size, fs.size(path))
        except OSError as e:
            if e.errno == errno.ENOSPC and not e.filename:  # the local copy's disk, not the store, is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.abspath(local_path)) from e
            raise

    def fill(out: IO[bytes]) -> tuple[str, int]:
        digest, total = _run(uri, scheme, "read", lambda: attempt(out))
        if expect_sha256 is not None and digest != expect_sha256:
            raise StorageError(
                f"{uri}: corrupt: {total} bytes with sha256 {digest}, expected sha256 {expect_sha256}; not kept"
            )
        return digest, total

    # A scratch copy: no fsync (a crash loses it either way), only the rename that hides a partial file.
    try:
        return _write_local(os.path.abspath(local_path), fill, durable=False)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StorageError(_no_space(str(local_path), "write", e)) from e
        raise


def _check_part_size(part_size: int, *, minimum: int) -> None:
    if not isinstance(part_size, int) or not minimum <= part_size <= _S3_MAX_PART:
        raise ValueError(f"part_size must be a whole number of bytes, {minimum} to {_S3_MAX_PART} (got {part_size!r})")


def _copy_hashing(
    src: IO[bytes], write: Callable[[memoryview], Any], part_size: int, size: int | None = None
) -> tuple[str, int]:
    """Copy `src` to `write` through one reused buffer of `part_size` bytes (or `size`, the file's, if smaller);
    (sha256 hex digest, bytes)."""
    digest, total = hashlib.sha256(), 0
    buffer = bytearray(max(1, min(part_size, part_size if size is None else size)))
    view = memoryview(buffer)
    while n := src.readinto(buffer):
        digest.update(view[:n])
        write(view[:n])
        total += n
    return digest.hexdigest(), total


class _FilePart(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable stream of their own: an upload's body read
    straight from the file (pread, so parts in flight share the descriptor, not a position), never held whole.
    botocore reads it in 1 MiB chunks to sign and checksum it, seeks back, and aiohttp sends it in 64 KiB reads."""

    def __init__(self, fd: int, start: int, length: int, name: str) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._name, self._pos = fd, start, length, name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            want = min(len(view), self._length - self._pos)
            if want <= 0:
                return 0
            n = os.preadv(self._fd, [view[:want]], self._start + self._pos)
        if n == 0:
            raise OSError(f"{self._name}: the file shrank while it was being uploaded")
        self._pos += n
        return n


def _sha256_fd(fd: int, size: int, name: str) -> str:
    """sha256 of a file's first `size` bytes, read in 1 MiB chunks (pread: no shared position)."""
    digest, offset = hashlib.sha256(), 0
    buffer = bytearray(min(size, 2**20) or 1)
    with memoryview(buffer) as view:
        while offset < size:
            n = os.preadv(fd, [view[: min(len(view), size - offset)]], offset)
            if n == 0:
                raise OSError(f"{name}: the file shrank while it was being uploaded")
            digest.update(view[:n])
            offset += n
    return digest.hexdigest()


_PARTS_IN_FLIGHT = 4  # an upload's concurrent part requests; each holds ~1 MiB at a time, never a whole part


async def _upload_s3(
    fs: Any, path: str, src: IO[bytes], size: int, part_size: int, unaborted: list[str] | None = None
) -> tuple[str, int]:
    """Each part's body is its range of the file, read as it is signed and sent: no part is ever in memory whole.
    The sha256 is one sequential read of the file in a thread, alongside the parts on the wire. A failed multipart
    upload is aborted; one that cannot be (the store is unreachable) is added to `unaborted`."""
    bucket, key, _ = fs.split_path(path)
    part_size = max(part_size, -(-size // _S3_MAX_PARTS))  # S3 takes at most 10,000 parts
    fd, name = src.fileno(), getattr(src, "name", path)
    hashing = asyncio.ensure_future(asyncio.to_thread(_sha256_fd, fd, size, name))
    try:
        if size <= part_size:
            await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=_FilePart(fd, 0, size, name))
            fs.invalidate_cache(path)
            return await hashing, size
        upload_id = (await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
    except BaseException:
        await asyncio.wait([hashing])
        raise

    async def send(number: int) -> tuple[int, str]:
        start = (number - 1) * part_size
        body = _FilePart(fd, start, min(part_size, size - start), name)
        sent = await fs._call_s3(
            "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
        )
        return number, sent["ETag"]

    sending: set[asyncio.Future] = set()
    try:
        etags: dict[int, str] = {}
        for number in range(1, -(-size // part_size) + 1):
            if len(sending) == _PARTS_IN_FLIGHT:
                done, sending = await asyncio.wait(sending, return_when=asyncio.FIRST_COMPLETED)
                etags.update(task.result() for task in done)
            sending.add(asyncio.ensure_future(send(number)))
        etags.update(await asyncio.gather(*sending))
        sending = set()
        digest = await hashing
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]},
        )
    except BaseException:
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)
        await asyncio.wait([hashing])  # it reads `src`, which the caller closes once this returns
        # The parts are invisible but stored (and billed) until aborted; best effort, the first error is reported.
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:
            if unaborted is not None:
                unaborted.append(upload_id)
        raise
    fs.invalidate_cache(path)
    return digest, size


async def _abort_uploads(fs: Any, path: str, upload_ids: list[str]) -> None:
    bucket, key, _ = fs.split_path(path)
    for upload_id in upload_ids:
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # the store drops it later (a lifecycle rule for incomplete multipart uploads)
            log.warning("s3://%s: could not abort the failed multipart upload %s: %s", path, upload_id, e)


async def _download_s3(fs: Any, path: str, out: IO[bytes], part_size: int) -> tuple[str, int]:
    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    body = response["Body"]
    # Two buffers of half a part: one filled from the socket while the other is hashed and written.
    part_size = max(1, min(-(-part_size // 2), response.get("ContentLength", part_size)))
    digest, total = hashlib.sha256(), 0

    def consume(view: memoryview) -> None:  # in a thread, while the loop receives into the other buffer
        digest.update(view)
        out.write(view)

    buffers = (bytearray(part_size), bytearray(part_size))
    writing: asyncio.Future | None = None
    try:
        eof, index = False, 0
        while not eof:
            view = memoryview(buffers[index % 2])  # free: its last write was awaited before the previous fill
            index += 1
            filled = 0
            while filled < part_size:
                # Small reads: aiohttp buffers up to twice the largest read asked for.
                chunk = await body.read(min(part_size - filled, _NET_READ))
                if not chunk:
                    eof = True
                    break
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            if writing is not None:
                pending, writing = writing, None
                await pending
            if filled:
                writing = asyncio.ensure_future(asyncio.to_thread(consume, view[:filled]))
                total += filled
        if writing is not None:
            pending, writing = writing, None
            await pending
    finally:
        if writing is not None:  # failed while a write was in flight: let it finish before `out` is closed
            await asyncio.wait([writing])
        body.close()
    return digest.hexdigest(), total


def exists(uri: str) -> bool:
    scheme, fs, path = _resolve(uri)
    return _run(uri, scheme, "check", lambda: bool(fs.exists(path)))


def listdir(uri: str) -> list[str]:
    """Sorted names directly under `uri`; [] where nothing is there. In-flight atomic-write temps are hidden."""
    scheme, fs, path = _resolve(uri)

    def ls() -> list[dict]:
        try:
            return fs.ls(path, detail=True)
        except FileNotFoundError:
            return []

    entries = _run(uri, scheme, "list", ls)
    names = {posixpath.basename(e["name"].rstrip("/")) for e in entries}
    if len(entries) == 1 and entries[0]["type"] == "file" and entries[0]["name"].rstrip("/") == path:
        raise StorageError(f"{uri}: not a directory")
    return sorted(n for n in names if n and not _TEMP_NAME.match(n))


def remove(uri: str, recursive: bool = False) -> None:
    """Remove a file, or with `recursive` a directory and everything under it. Missing is an error."""
    scheme, fs, path = _resolve(uri)
    if not _run(uri, scheme, "check", lambda: fs.exists(path)):
        raise StorageError(f"{uri}: no such file or directory")
    if _run(uri, scheme, "check", lambda: fs.isdir(path)):
        if not recursive:
            raise StorageError(f"{uri}: is a directory; pass recursive=True to remove it and its contents")
        _run(uri, scheme, "remove", lambda: fs.rm(path, recursive=True))
    else:
        # Retried after a lost answer, the key may be gone already: that is the outcome asked for.
        _run(uri, scheme, "remove", lambda: _rm_missing_ok(fs, path))


def _rm_missing_ok(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
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
    return pafs.PyFileSystem(_retrying_handler(fs, scheme)), path


def _retrying_handler(fs: fsspec.AbstractFileSystem, scheme: str):
    """pyarrow's FSSpecHandler over `fs`, with every call retried as this module's operations are (Ray Train writes
    its records, Ray Data looks shards up, through it). A file opened for writing is staged in a local temporary
    file and stored whole when closed, retried: one PUT, or a multipart upload for a large one."""
    return _retrying_handler_class()(fs, scheme)


_HANDLER_CLASS: type | None = None


def _retrying_handler_class() -> type:
    """`_RetryingHandler`, made on first use (it subclasses pyarrow's FSSpecHandler, and this module does not import
    pyarrow until a reader needs it). A module attribute by name (see `__getattr__`), so pickle ships it by
    reference to Ray's processes, as any class of a module."""
    global _HANDLER_CLASS
    if _HANDLER_CLASS is not None:
        return _HANDLER_CLASS
    import pyarrow as pa
    import pyarrow.fs as pafs

    base = pafs.FSSpecHandler

    class _RetryingHandler(base):
        def __init__(self, fs: Any, scheme: str) -> None:
            super().__init__(fs)
            self.scheme = scheme

        def _retried(self, action: str, path: Any, fn: Callable[[], Any]) -> Any:
            where = f"{self.scheme}://{path if isinstance(path, str) else getattr(path, 'base_dir', path)}"
            return _retrying(where, action, fn, _Attempts())

        def get_file_info(self, paths):
            return self._retried("check", paths[0] if paths else "", lambda: base.get_file_info(self, paths))

        def get_file_info_selector(self, selector):
            return self._retried("list", selector, lambda: base.get_file_info_selector(self, selector))

        def create_dir(self, path, recursive):
            return self._retried("create", path, lambda: base.create_dir(self, path, recursive))

        def delete_dir(self, path):
            return self._retried("remove", path, lambda: base.delete_dir(self, path))

        def delete_dir_contents(self, path, missing_dir_ok=False):
            return self._retried("remove", path, lambda: base.delete_dir_contents(self, path, missing_dir_ok))

        def delete_file(self, path):
            return self._retried("remove", path, lambda: base.delete_file(self, path))

        def move(self, src, dest):
            return self._retried("move", src, lambda: base.move(self, src, dest))

        def copy_file(self, src, dest):
            return self._retried("copy", src, lambda: base.copy_file(self, src, dest))

        def open_input_stream(self, path):
            return self._retried("read", path, lambda: base.open_input_stream(self, path))

        def open_input_file(self, path):
            return self._retried("read", path, lambda: base.open_input_file(self, path))

        def open_output_stream(self, path, metadata):
            return pa.PythonFile(_StagedWrite(self.fs, path, self.scheme), mode="w")

    _RetryingHandler.__module__, _RetryingHandler.__qualname__ = __name__, "_RetryingHandler"
    _HANDLER_CLASS = _RetryingHandler
    return _RetryingHandler


def __getattr__(name: str) -> Any:
    if name == "_RetryingHandler":
        return _retrying_handler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _StagedWrite(io.RawIOBase):
    """A file written through pyarrow: staged in a local temporary file, stored whole on close, with retries."""

    def __init__(self, fs: Any, path: str, scheme: str) -> None:
        import tempfile

        super().__init__()
        self._fs, self._path, self._uri = fs, path, f"{scheme}://{path}"
        self._tmp = tempfile.TemporaryFile()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._tmp.write(data)

    def close(self) -> None:
        if self.closed:
            return
        try:
            size = self._tmp.seek(0, io.SEEK_END)
            if "s3" in self._fs.protocol and size > DEFAULT_PART_SIZE:
                upload = lambda: fsspec.asyn.sync(  # noqa: E731
                    self._fs.loop, _upload_s3, self._fs, self._path, self._tmp, size, DEFAULT_PART_SIZE
                )
                _retrying(self._uri, "write", upload, _Attempts())
            else:
                self._tmp.seek(0)
                data = self._tmp.read()
                _retrying(self._uri, "write", lambda: self._fs.pipe_file(self._path, data), _Attempts())
        finally:
            self._tmp.close()
            super().close()
