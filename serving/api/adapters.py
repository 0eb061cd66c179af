"""A replica's copies of the LoRA adapters loaded on demand (`engine.dynamic_adapters.root`): `<root>/<name>/` for a
request whose `model` is `name`, fetched once and kept, the most recently used `keep` of them.

A local root is read in place (its directories are the copies); an object-storage root's adapter is downloaded (its
adapter_config.json and weight file only) into this replica's private temporary directory, in a thread, once however
many requests for it arrive together. A name that is no adapter at the root is a 404 naming the root; a root that
cannot be read, a 503. The engine reads the copy when it takes the request (engine/adapters.py), and names it in
any error about the adapter's contents.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import OrderedDict

from fsspec.implementations.local import LocalFileSystem

from pylon import storage
from pylon.errors import PylonError
from pylon.serving.api.http import HttpError

# What peft's save_pretrained writes that the engine reads (serving/model/lora.py's CONFIG_FILE and WEIGHT_FILES).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class AdapterFetcher:
    def __init__(self, root: str, *, keep: int):
        self.root = root
        fs, path = storage.resolve(root)
        self.local = isinstance(fs, LocalFileSystem)
        self._root_path = os.path.realpath(path) if self.local else path
        self._copies = None if self.local else tempfile.mkdtemp(prefix="pylon-adapters-")
        self.keep = keep
        self._ready: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    def names(self) -> list[str]:
        """The adapters this replica holds a copy of, least recently used first."""
        return list(self._ready)

    def path(self, name: str) -> str | None:
        """The local directory of `name` fetched already (`fetch`), or None."""
        return self._ready.get(name)

    async def fetch(self, name: str) -> str:
        """The local directory of the adapter `name` at the root, fetched if need be (HttpError if there is none)."""
        path = self._ready.get(name)
        if path is not None:
            self._ready.move_to_end(name)
            return path
        task = self._pending.get(name)
        if task is None:
            task = self._pending[name] = asyncio.ensure_future(asyncio.to_thread(self._fetch, name))
            task.add_done_callback(lambda _: self._pending.pop(name, None))
        path = await asyncio.shield(task)  # a client that goes away leaves the fetch to finish for the next
        if name not in self._ready:
            self._ready[name] = path
            self._evict()
        return path

    def named(self, message: str) -> str:
        """`message` (an engine's error about an adapter's copy) with each copy's path replaced by its URI."""
        for name, path in self._ready.items():
            if not self.local and path in message:
                message = message.replace(path, storage.describe(storage.join(self.root, name)))
        return message

    def close(self) -> None:
        if self._copies is not None:
            shutil.rmtree(self._copies, ignore_errors=True)

    def _evict(self) -> None:
        while len(self._ready) > self.keep:
            _, path = self._ready.popitem(last=False)
            if not self.local:
                shutil.rmtree(path, ignore_errors=True)

    def _not_found(self, name: str, what: str) -> HttpError:
        return HttpError(
            404,
            f"model '{name}' does not exist: it is neither served nor a LoRA adapter at "
            f"{storage.describe(storage.join(self.root, name))} ({what}; engine.dynamic_adapters.root; see GET "
            "/v1/models for the models served)",
            type="invalid_request_error",
            param="model",
        )

    def _fetch(self, name: str) -> str:
        if self.local:
            path = os.path.realpath(os.path.join(self._root_path, name))
            if os.path.commonpath([self._root_path, path]) != self._root_path:  # a link out of the root
                raise self._not_found(name, "it leads out of the root")
            if not os.path.isfile(os.path.join(path, ADAPTER_FILES[0])):
                raise self._not_found(name, f"no {ADAPTER_FILES[0]} there")
            return path
        source = storage.join(self.root, name)
        try:
            present = set(storage.listdir(source))
        except PylonError as e:
            raise HttpError(
                503,
                f"model '{name}': the adapters' root cannot be read ({e}); retry, or check "
                "engine.dynamic_adapters.root",
                type="server_error",
                headers={"Retry-After": "5"},
            ) from None
        if ADAPTER_FILES[0] not in present:
            raise self._not_found(name, f"no {ADAPTER_FILES[0]} there")
        copy = tempfile.mkdtemp(dir=self._copies, prefix=f"{name}-")
        try:
            for file in ADAPTER_FILES:
                if file in present:
                    storage.download_file(storage.join(source, file), os.path.join(copy, file))
        except PylonError as e:
            shutil.rmtree(copy, ignore_errors=True)
            raise HttpError(
                503,
                f"model '{name}': the adapter cannot be copied from the root ({e}); retry",
                type="server_error",
                headers={"Retry-After": "5"},
            ) from None
        return copy
