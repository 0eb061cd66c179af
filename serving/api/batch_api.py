"""OpenAI's Files and Batch APIs on a deployment (`http.batch_store`): a client uploads a JSONL file of Batch API
requests (`POST /v1/files`, purpose `batch`), creates a batch of it (`POST /v1/batches`), polls it (`GET
/v1/batches/{id}`) and downloads its output and error files (`GET /v1/files/{id}/content`), with the official
`openai` client's `files` and `batches` as they are. SGLang serves these from one process's memory; here they live in
object storage, so any replica of the deployment answers a poll or a download, and a redeploy keeps them.

The replica that creates a batch answers it in the background, each line through its own request handling
(`pylon.serving.api.batch_lines.call`, in-process, with the creator's key: a line means what the same body POSTed
means), at most `max_num_seqs` lines at once, each at the scheduler's priority 1 (OpenAI's flex tier: a waiting live
request goes first) beside the live traffic. Every `HEARTBEAT_S` it stores the batch's counts and reads back a cancel
(`POST /v1/batches/{id}/cancel`, on any replica); at the end it stores the output file (the answered lines, in input
order) and the error file (the rest), each a file of the same API. A batch in progress whose replica has written
nothing for `STALE_S` is answered failed (its replica stopped): create it again. `pylon batch` answers such files
offline on engines across the cluster instead (`pylon.serving.api.batch`).

Store layout, each client's under its API key's owner name (as `http.responses_store`): `<root>/<owner>/files/<id>.json`
(the file object) and `<id>.jsonl` (its bytes), `<root>/<owner>/batches/<id>.json` (the batch object, with the
replica's private `_heartbeat`). Ids are checked before they name an object, so none leaves the store's root.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import logging
import re
import time
import uuid

from pylon import storage
from pylon.errors import StorageError
from pylon.serving.api.batch_lines import LineError, error_line, openai_line, request_of
from pylon.serving.errors import InvalidRequest

log = logging.getLogger(__name__)

FILE_ID = re.compile(r"^file-[A-Za-z0-9]{1,64}$")
BATCH_ID = re.compile(r"^batch_[A-Za-z0-9]{1,64}$")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_FILE_BYTES = 100 * 2**20  # an upload past this is a 413: larger batches are `pylon batch` jobs
HEARTBEAT_S = 5.0
STALE_S = 120.0
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
CANCEL = ".cancel.json"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """Files and batches under `root`, each owner's apart. Blocking (object storage): callers run it in a thread."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def _uri(self, owner: str, kind: str, object_id: str, suffix: str = ".json") -> str:
        pattern = FILE_ID if kind == "files" else BATCH_ID
        assert pattern.match(object_id) and re.fullmatch(r"[a-z0-9]+", owner), (owner, object_id)
        return f"{self.root}/{owner}/{kind}/{object_id}{suffix}"

    def _read(self, uri: str) -> dict | None:
        return storage.read_json(uri) if storage.exists(uri) else None

    def put_file(self, owner: str, meta: dict, data: bytes) -> None:
        storage.atomic_write(self._uri(owner, "files", meta["id"], ".jsonl"), data)
        storage.atomic_write_json(self._uri(owner, "files", meta["id"]), meta)  # last: the file exists once this does

    def file(self, owner: str, file_id: str) -> dict | None:
        return self._read(self._uri(owner, "files", file_id))

    def content(self, owner: str, file_id: str) -> bytes:
        return storage.read_bytes(self._uri(owner, "files", file_id, ".jsonl"))

    def delete_file(self, owner: str, file_id: str) -> bool:
        uri = self._uri(owner, "files", file_id)
        if not storage.exists(uri):
            return False
        storage.remove(uri)
        data = self._uri(owner, "files", file_id, ".jsonl")
        if storage.exists(data):
            storage.remove(data)
        return True

    def _list(self, owner: str, kind: str) -> list[dict]:
        where = f"{self.root}/{owner}/{kind}"
        found = []
        for name in storage.listdir(where):
            if name.endswith(".json") and not name.endswith(CANCEL):
                record = self._read(f"{where}/{name}")
                if record is not None:
                    found.append(record)
        return sorted(found, key=lambda r: (r["created_at"], r["id"]), reverse=True)  # newest first, as OpenAI lists

    def files(self, owner: str) -> list[dict]:
        return self._list(owner, "files")

    def put_batch(self, owner: str, batch: dict) -> None:
        storage.atomic_write_json(self._uri(owner, "batches", batch["id"]), batch)

    def batch(self, owner: str, batch_id: str) -> dict | None:
        return self._read(self._uri(owner, "batches", batch_id))

    def batches(self, owner: str) -> list[dict]:
        return self._list(owner, "batches")

    def cancel(self, owner: str, batch_id: str) -> int:
        """Mark `batch_id` cancelled, as an object of its own: the replica running it reads it at its next heartbeat,
        and its own writes of the batch cannot overwrite it. Returns when it was cancelled."""
        uri = self._uri(owner, "batches", batch_id, CANCEL)
        earlier = self._read(uri)
        if earlier is not None:
            return int(earlier["cancelling_at"])
        at = int(time.time())
        storage.atomic_write_json(uri, {"cancelling_at": at})
        return at

    def cancelling_at(self, owner: str, batch_id: str) -> int | None:
        marker = self._read(self._uri(owner, "batches", batch_id, CANCEL))
        return None if marker is None else int(marker["cancelling_at"])


def file_object(file_id: str, filename: str, purpose: str, size: int) -> dict:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def upload(content_type: str, body: bytes) -> tuple[str, str, bytes]:
    """A `POST /v1/files` body (multipart/form-data: `file` and `purpose`, as the openai client sends them) as
    (filename, purpose, bytes); an InvalidRequest naming the part at fault otherwise."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest(
            f"a file is uploaded as multipart/form-data with the parts 'file' and 'purpose' (got Content-Type "
            f"{content_type or 'none'!r})",
            param="file",
        )
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    parts: dict[str, tuple[str | None, bytes]] = {}
    if message.is_multipart():
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str):
                parts[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    purpose = parts.get("purpose", (None, b""))[1].decode("utf-8", errors="replace").strip()
    if "file" not in parts:
        raise InvalidRequest("the form has no 'file' part: the JSONL file of requests", param="file")
    if purpose != "batch":
        raise InvalidRequest(
            f"purpose: 'batch' (files here are batches' inputs; got {purpose or 'none'!r})", param="purpose"
        )
    filename, data = parts["file"]
    return (filename or "input.jsonl"), purpose, data


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict | None, total: int) -> dict:
    now = int(time.time())
    return {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "in_progress",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": now,
        "expires_at": now + 24 * 3600,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
        "_heartbeat": time.time(),
    }


def public(batch: dict, cancelling_at: int | None = None) -> dict:
    """The batch object a client sees: the private fields out; one in progress that a cancel names (its time:
    `cancelling_at`) cancelling; and one in progress whose replica has written nothing for STALE_S answered failed
    (its replica stopped)."""
    shown = {k: v for k, v in batch.items() if not k.startswith("_")}
    if shown["status"] in ACTIVE and cancelling_at is not None:
        shown.update(status="cancelling", cancelling_at=cancelling_at)
    if shown["status"] in ACTIVE and time.time() - batch.get("_heartbeat", 0) > STALE_S:
        shown.update(
            status="failed",
            failed_at=int(batch.get("_heartbeat", time.time())),
            errors={
                "object": "list",
                "data": [
                    {
                        "code": "replica_stopped",
                        "message": "the replica answering this batch stopped before it finished; create it again",
                        "param": None,
                        "line": None,
                    }
                ],
            },
        )
    return shown


def lines_of(data: bytes) -> list[tuple[int, str]]:
    """A file's lines that are not blank, numbered from 1."""
    text = data.decode("utf-8", errors="replace")
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


async def answer(
    store: BatchStore,
    owner: str,
    batch: dict,
    lines: list[tuple[int, str]],
    ask,
    name: str,
    in_flight: int,
    cancelled: asyncio.Event,
) -> dict:
    """Answer `batch`'s `lines` with `ask(path, body) -> (status, answer, request id)`, at most `in_flight` at once,
    storing its counts every HEARTBEAT_S and ending it: completed with its output and error files, or cancelled
    (`cancelled` set: by this replica's cancel at once, by another's through the store at the next heartbeat) with
    those answered so far. Returns the batch as last stored."""
    endpoint = batch["endpoint"]
    counts = batch["request_counts"]
    results: dict[int, dict] = {}
    errors: dict[int, dict] = {}

    async def one(lineno: int, line: str) -> None:
        where = f"line {lineno}"
        custom_id = None
        try:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise LineError(f"{where}: not JSON ({e})") from None
            if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
                custom_id = obj["custom_id"]
            if not isinstance(obj, dict) or "custom_id" not in obj:
                raise LineError(f"{where}: a Batch API request, {{custom_id, method, url, body}}", "custom_id")
            request = request_of(obj, where, name, {})
            if request.url != endpoint:
                raise LineError(f"{where}: url: the batch's endpoint {endpoint!r} (got {request.url!r})", "url")
        except LineError as e:
            errors[lineno] = error_line(custom_id, where, e)
            counts["failed"] += 1
            return
        status, body, request_id = await ask(request.url, request.body)
        line_out = openai_line(request.custom_id, status, body, request_id)
        if status < 400:
            results[lineno] = line_out
            counts["completed"] += 1
        else:
            errors[lineno] = line_out
            counts["failed"] += 1

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                at = await asyncio.to_thread(store.cancelling_at, owner, batch["id"])
                if at is not None:
                    batch.update(status="cancelling", cancelling_at=at)
                    cancelled.set()
                batch["_heartbeat"] = time.time()
                await asyncio.to_thread(store.put_batch, owner, batch)
            except StorageError as e:  # the next beat tries again (a batch goes stale only after STALE_S of these)
                log.warning("%s: batch %s: its counts not stored this beat: %s", name, batch["id"], e)

    pending = iter(lines)

    async def worker() -> None:  # `in_flight` of these take the lines in order: no task per line of a large file
        for lineno, line in pending:
            if cancelled.is_set():
                return
            await one(lineno, line)

    beat = asyncio.create_task(heartbeat())
    work = [asyncio.create_task(worker()) for _ in range(min(in_flight, len(lines)))]
    try:
        waiter = asyncio.create_task(cancelled.wait())
        done = asyncio.gather(*work)
        await asyncio.wait([done, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if done.done() and done.exception() is not None:
            raise done.exception()  # (a bug of ours: the batch ends failed, not completed with lines missing)
        if cancelled.is_set():
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
    finally:
        beat.cancel()
    now = int(time.time())
    batch.update(status="finalizing", finalizing_at=now)
    if results:
        batch["output_file_id"] = await _output(store, owner, batch["id"], "output", results)
    if errors:
        batch["error_file_id"] = await _output(store, owner, batch["id"], "errors", errors)
    if cancelled.is_set():
        at = await asyncio.to_thread(store.cancelling_at, owner, batch["id"])
        batch.update(status="cancelled", cancelling_at=at, cancelled_at=int(time.time()))
    else:
        batch.update(status="completed", completed_at=int(time.time()))
    batch["_heartbeat"] = time.time()
    await asyncio.to_thread(store.put_batch, owner, batch)
    log.info("%s: batch %s %s: %s", name, batch["id"], batch["status"], counts)
    return batch


async def _output(store: BatchStore, owner: str, batch_id: str, kind: str, lines: dict[int, dict]) -> str:
    data = "".join(json.dumps(lines[n], ensure_ascii=False) + "\n" for n in sorted(lines)).encode()
    meta = file_object(new_id("file-"), f"{batch_id}_{kind}.jsonl", "batch_output", len(data))
    await asyncio.to_thread(store.put_file, owner, meta, data)
    return meta["id"]


def page(records: list[dict], query: bytes, shown=lambda r: r) -> dict:
    """A list answer, OpenAI's: `limit` (1-100, default 20) records after the id `after`, newest first (`order`:
    `asc`, oldest first), those of one `purpose` where it is given (files)."""
    import urllib.parse

    params = dict(urllib.parse.parse_qsl(query.decode("latin-1")))
    if "purpose" in params:
        records = [r for r in records if r.get("purpose") == params["purpose"]]
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: asc or desc (got {order!r})", param="order")
    if order == "asc":
        records = records[::-1]
    try:
        limit = int(params.get("limit", "20"))
    except ValueError:
        raise InvalidRequest(f"limit: an integer from 1 to 100 (got {params['limit']!r})", param="limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest(f"limit: an integer from 1 to 100 (got {limit})", param="limit")
    after = params.get("after")
    if after is not None:
        ids = [r["id"] for r in records]
        if after not in ids:
            raise InvalidRequest(f"after: no object {after!r} in this list", param="after")
        records = records[ids.index(after) + 1 :]
    chosen = [shown(r) for r in records[:limit]]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
        "has_more": len(records) > limit,
    }
