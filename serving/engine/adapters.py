"""LoRA adapters: the spec's local copies (`engine.adapters`: `spec_adapter_dirs`), and those loaded on demand
(`engine.dynamic_adapters`): the first request that names an adapter at the root
brings it into the engine, beside the adapters of the spec (`engine.adapters`, always loaded).

The replica fetches `<root>/<name>/` to a local directory (serving/api/adapters.py) and hands the engine that path
with the request (`SamplingParams.adapter_path`). The engine reads the adapter when it takes the request
(`OnDemandAdapters.stage`: a bad adapter fails that request at once, naming the file), and serves it in one of
`max_loaded` runner slots after the spec's adapters when the step takes the request in (`place`): the slot it
already has, a free one, or the slot of the least recently used adapter that no unfinished request runs with and
none waiting names. When every slot is held by unfinished requests, the request waits (parked by the engine) until
one finishes. So a step never sees an adapter change under a running request, and the runner's table changes only
between steps.

Cached KV blocks are salted with the adapter's name (kv_cache.cache_salt), so they outlive its eviction and are
reused when it comes back. A name whose files changed at the root (its digest differs from what was loaded under it
before) would meet blocks computed with the old weights: the engine then forgets every cached block no request holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict

from pylon.errors import PylonError
from pylon.serving.errors import InvalidRequest

log = logging.getLogger(__name__)

RANK_LIMIT = "engine.dynamic_adapters.max_rank"


def _adapter_where(i: int, adapter) -> str:
    """engine.adapters[i] in a message: its field, name and path (an object store's with its endpoint)."""
    from pylon import storage

    path = storage.describe(adapter.path) if "://" in adapter.path else adapter.path
    return f"engine.adapters[{i}].path ({adapter.name}, {path})"


def spec_adapter_dirs(stack: contextlib.ExitStack, adapters) -> list[str]:
    """Local directories holding `engine.adapters` (private copies of remote ones, removed with `stack`); errors
    name the field and the adapter."""
    from pylon.models import local_model_dir

    directories = []
    for i, adapter in enumerate(adapters):
        try:
            directories.append(stack.enter_context(local_model_dir(adapter.path)))
        except PylonError as e:
            detail = str(e).split(": ", 1)[-1]  # local_model_dir's message starts "model.path <uri>: "
            detail = detail.replace("a Hugging Face model directory", "an adapter directory in peft's format")
            raise PylonError(f"{_adapter_where(i, adapter)}: {detail}") from None
    return directories


def named_adapter_error(error: PylonError, directories: list[str], adapters) -> PylonError:
    """The runner's error about one of `directories` (`spec_adapter_dirs`' copies of `adapters`) as one naming its
    field, name and path; any other error as it is."""
    message = str(error)
    for i, (directory, adapter) in enumerate(zip(directories, adapters)):
        if directory in message:
            return PylonError(message.replace(directory, _adapter_where(i, adapter)))
    return error


class OnDemandAdapters:
    """Adapters from the root in runner slots `first_slot` .. `first_slot + max_loaded - 1`, least recently used
    first. `stage` may run on any thread; `place` runs on the stepping one, under the engine's lock."""

    def __init__(self, runner, pool, *, first_slot: int, max_loaded: int, max_rank: int):
        self.runner = runner
        self.pool = pool
        self.max_rank = max_rank
        self.slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._free = list(range(first_slot + max_loaded - 1, first_slot - 1, -1))  # pop() takes the lowest
        self._staged: dict[str, object] = {}  # read, and waiting for a slot (lora.Adapter)
        self._digests: dict[str, str] = {}  # what each name was loaded with, last time
        self._lock = threading.Lock()  # over _staged: `stage` runs on request threads in a threaded engine
        self.loads_total = 0
        self.evictions_total = 0

    def stage(self, name: str, directory: str) -> None:
        """Read the adapter `name` from `directory` for a request that names it, unless it is served or read already;
        an adapter that cannot be served on this model fails the request (InvalidRequest, param `model`)."""
        if name in self.slots or name in self._staged:
            return
        try:
            adapter = self.runner.read_adapter(directory, max_rank=self.max_rank, rank_limit=RANK_LIMIT)
        except PylonError as e:
            raise InvalidRequest(f"model '{name}': {e}", param="model") from None
        with self._lock:
            self._staged.setdefault(name, adapter)

    def needs_staging(self, name: str) -> bool:
        return name not in self.slots and name not in self._staged

    def place(self, name: str, busy: set[int], needed: set[str]) -> int | None:
        """The slot `name` is served in from the next step, or None when every slot is held (`busy`: slots of
        unfinished requests) or kept for a request that waits (`needed`: names waiting requests give)."""
        slot = self.slots.get(name)
        if slot is not None:
            self.slots.move_to_end(name)
            return slot
        with self._lock:
            adapter = self._staged.get(name)
        if adapter is None:  # never: a request is staged unless its adapter was served, and a needed one stays
            raise RuntimeError(f"adapter {name!r} was neither loaded nor read for its request")
        if not self._free:
            victim = next((n for n, s in self.slots.items() if s not in busy and n not in needed), None)
            if victim is None:
                return None
            freed = self.slots.pop(victim)
            self.runner.put_adapter(freed, None)
            self._free.append(freed)
            self.evictions_total += 1
            log.info("engine: unloaded adapter %s (least recently used) from slot %d", victim, freed)
        slot = self._free.pop()
        before = self._digests.get(name)
        if before is not None and before != adapter.digest:
            forgotten = self.pool.forget_cached()
            log.warning(
                "engine: adapter %s has other files than when it was last loaded; forgot the %d cached blocks no "
                "request holds, as some were computed with its old weights (publish a changed adapter under a new "
                "name to keep the cache)",
                name,
                forgotten,
            )
        self._digests[name] = adapter.digest
        self.runner.put_adapter(slot, adapter)
        self.slots[name] = slot
        with self._lock:
            self._staged.pop(name, None)
        self.loads_total += 1
        log.info("engine: loaded adapter %s (%s) into slot %d", name, adapter.directory, slot)
        return slot

    def keep_staged(self, names: set[str]) -> None:
        """Drop what was read for requests that are gone (aborted while they waited), keeping `names`'."""
        with self._lock:
            for name in [n for n in self._staged if n not in names]:
                del self._staged[name]
