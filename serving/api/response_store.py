"""Stored responses of the Responses API (`http.responses_store`): what `previous_response_id`, `GET` and `DELETE
/v1/responses/{response_id}` and `GET /v1/responses/{response_id}/input_items` read.

Each response a client asks to keep (`store` not false: OpenAI's default) is one JSON object at
`<responses_store>/<owner>/<response id>.json`, written atomically before the reply's last byte goes out, so a
client's next request, on any replica of the deployment (or after a redeploy), finds it. `<owner>` is the client's
API key as `KeyCheck.owner` names it: a response is found only with the key that made it (another key's request is a
404, as a response that does not exist is). The object holds

    {"response": <the Response object>, "input": [<this request's input items, each with an id>],
     "conversation": [<every item of the conversation so far: the previous response's conversation, this input,
                       this output>]}

so continuing from it is one read. As OpenAI does, a continued request's `instructions` replace the previous ones
(they are not part of the conversation), and its tools and settings are its own.

A cancel of a background response (`POST /v1/responses/{id}/cancel`, on any replica) must stay cancelled even where
the replica running it stores its end in the same instant, and replicas share no lock while the store has no
compare-and-set. So a cancel is written twice, first as an object of its own (`<response id>.cancel.json`), then in
the response's place; every read of a background response prefers the cancel's object, and a running response's end,
once stored, puts a cancel it finds back in the response's place (`settle`). Whichever order the two replicas' writes
land in, every read after the cancel was answered says cancelled (`tests/unit/serving/api/test_response_store.py`
runs each order).

Response ids are checked before they name a file (`resp_` and letters and digits only), so a path in one never leaves
the store's root. Nothing is deleted by age: `DELETE /v1/responses/{response_id}`, or a lifecycle rule on the bucket.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from pylon import storage
from pylon.errors import StorageError

log = logging.getLogger(__name__)

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")  # the ids responses.new_item_id("resp") makes


def valid_id(response_id: str) -> bool:
    return bool(RESPONSE_ID.match(response_id))


class ResponseStore:
    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def _uri(self, owner: str, response_id: str, kind: str = "") -> str:
        assert valid_id(response_id) and re.fullmatch(r"[a-z0-9]+", owner), (owner, response_id)
        return f"{self.root}/{owner}/{response_id}{kind}.json"  # (an id has no dot: no kind names another's file)

    async def cancel(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """Store `record` (a background response cancelled) for good: as the cancel's own object, which reads prefer,
        then in the response's place."""

        def write() -> None:
            self.mark_cancelled(owner, response_id, record)
            self.put_now(owner, response_id, record)

        await asyncio.to_thread(write)

    def mark_cancelled(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """A cancel's first write: its own object."""
        storage.atomic_write_json(self._uri(owner, response_id, ".cancel"), record)

    async def settle(self, owner: str, response_id: str) -> bool:
        """After a background response's end is stored: a cancel stored meanwhile (by another replica, after this one
        last looked) is put back in the response's place. True where the response stands cancelled."""
        return await asyncio.to_thread(self.settle_now, owner, response_id)

    def settle_now(self, owner: str, response_id: str) -> bool:
        cancel = self._uri(owner, response_id, ".cancel")
        if not storage.exists(cancel):
            return False
        storage.atomic_write_json(self._uri(owner, response_id), storage.read_json(cancel))
        return True

    async def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        await asyncio.to_thread(self.put_now, owner, response_id, record)

    def put_now(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """`put`, in the calling thread (a replica's last writes, as it stops)."""
        storage.atomic_write_json(self._uri(owner, response_id), record)

    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The stored record, or None where `owner` has none by that id (an id of the wrong shape included)."""
        if not valid_id(response_id):
            return None
        uri = self._uri(owner, response_id)

        def read():
            if not storage.exists(uri):
                return None
            record = storage.read_json(uri)
            if not isinstance(record, dict) or not all(
                isinstance(record.get(k), list) for k in ("input", "conversation")
            ):
                raise StorageError(f"{uri}: not a stored response (no input and conversation lists)")
            response = record.get("response") or {}
            if response.get("background") and response.get("status") != "cancelled":
                cancel = self._uri(owner, response_id, ".cancel")
                if storage.exists(cancel):  # cancelled as its end was stored (`settle` puts it back)
                    return storage.read_json(cancel)
            return record

        return await asyncio.to_thread(read)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete `owner`'s response; False where there was none."""
        if not valid_id(response_id):
            return False
        uri = self._uri(owner, response_id)

        def remove() -> bool:
            if not storage.exists(uri):
                return False
            cancel = self._uri(owner, response_id, ".cancel")
            if storage.exists(cancel):
                storage.remove(cancel)
            storage.remove(uri)
            return True

        return await asyncio.to_thread(remove)
