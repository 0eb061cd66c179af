"""A background response's cancel from one replica against its end stored by another (pylon.serving.api.response_store):
no lock is shared and the store has no compare-and-set, so each order in which the two replicas' reads and writes can
land is run against a real store (a directory), and in every one a cancel that answered `cancelled` stays so for
every later read, and one that answered "has ended" leaves the end as it was stored."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from pylon.serving.api.response_store import ResponseStore

OWNER, RID = "k1", "resp_abc123"


def _record(status: str) -> dict:
    response = {"id": RID, "object": "response", "background": True, "status": status, "output": []}
    return {"response": response, "input": [{"type": "message"}], "conversation": [{"type": "message"}]}


def _status(store: ResponseStore) -> str:
    return asyncio.run(store.get(OWNER, RID))["response"]["status"]


def _orders():
    """Every interleaving of the cancelling replica's steps (R: read, M: its own object, C: the response's place) with
    the running replica's (L: its last look, W: its end's write, S: settle), each replica's in its own order."""
    for places in itertools.combinations(range(6), 3):
        cancel, end = iter("RMC"), iter("LWS")
        yield "".join(next(cancel) if i in places else next(end) for i in range(6))


@pytest.mark.parametrize("order", list(_orders()))
def test_a_cancel_that_answered_cancelled_stays_so_in_every_order(tmp_path, order):
    store = ResponseStore(str(tmp_path))
    store.put_now(OWNER, RID, _record("in_progress"))
    cancelled = {**_record("in_progress"), "response": {**_record("in_progress")["response"], "status": "cancelled"}}
    answer, ended = None, False  # the cancel's answer; whether the running replica stopped without storing its end
    for step in order:
        if step == "R":  # the cancel reads the response: one still running is cancelled, one that ended is a 400
            answer = "cancelled" if _status(store) in ("queued", "in_progress") else "has ended"
        elif answer == "cancelled" and step == "M":
            store.mark_cancelled(OWNER, RID, cancelled)
        elif answer == "cancelled" and step == "C":
            store.put_now(OWNER, RID, cancelled)
        elif step == "L":  # the running replica's last look: a cancel found stops it
            ended = _status(store) == "cancelled"
        elif not ended and step == "W":
            store.put_now(OWNER, RID, _record("completed"))
        elif not ended and step == "S":
            asyncio.run(store.settle(OWNER, RID))
        if answer == "cancelled" and "C" in order[: order.index(step) + 1]:  # answered: every read from now on
            assert _status(store) == "cancelled", (order, step)
    want = "cancelled" if answer == "cancelled" else "completed"
    assert _status(store) == want, order
    stored = json.loads((tmp_path / OWNER / f"{RID}.json").read_text())["response"]["status"]
    assert stored == want, order  # the response's own object too, once both replicas are done


def test_cancel_writes_both_objects_and_delete_removes_both(tmp_path):
    store = ResponseStore(str(tmp_path))
    store.put_now(OWNER, RID, _record("in_progress"))
    cancelled = {**_record("x"), "response": {**_record("x")["response"], "status": "cancelled"}}
    asyncio.run(store.cancel(OWNER, RID, cancelled))
    assert sorted(p.name for p in (tmp_path / OWNER).iterdir()) == [f"{RID}.cancel.json", f"{RID}.json"]
    assert _status(store) == "cancelled"
    assert asyncio.run(store.delete(OWNER, RID)) is True
    assert list((tmp_path / OWNER).iterdir()) == [] and asyncio.run(store.get(OWNER, RID)) is None
