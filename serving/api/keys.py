"""API keys: what a deployment stores of them (salted scrypt hashes), and how a replica checks one.

The keys themselves stay where they were read (the client's environment for `pylon serve` / `Client.deploy`, the
Serve controller's for a RayService); what travels, and what Serve's config and dashboard show, is

    {"scheme": "scrypt", "n": 16384, "r": 8, "p": 1, "salt": "<32 hex>", "hashes": ["<64 hex>", ...]}

a fresh random salt per deploy, so equal keys in two deployments hash differently and a leaked config costs an
attacker ~16 MiB and tens of ms of scrypt per guess per deployment. It reaches the replica as the deployment's
`user_config` (`{"api_keys": ...}`), so changing the keys (adding one, removing one) is Serve's in-place
`reconfigure` of the running replicas, not a new replica: run `pylon serve SPEC` again with the new keys in the
environment.

A replica checks a presented key once with scrypt, in a thread, comparing against every hash in constant time;
the answer is remembered (under a keyed BLAKE2b of the key, with a key that lives only in this process's memory)
until the key set changes, so a client's later requests cost a dictionary lookup. Unknown keys are checked one
at a time: a flood of wrong keys costs at most one core, never the event loop."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import threading

from pylon.errors import PylonError
from pylon.specs import DeploymentSpec

SCHEME = "scrypt"
# RFC 7914's interactive parameters: 16 MiB and ~30-60 ms per hash on one core.
N, R, P = 2**14, 8, 1
_HASH_BYTES = 32
_MAX_REMEMBERED = 4096  # presented keys whose answer a replica remembers; past this it forgets them all and starts over


def read_keys(spec: DeploymentSpec, environ: dict | None = None) -> list[str]:
    """The keys in the environment variable `http.api_keys_env` names ([] when the spec turns auth off)."""
    env_name = spec.http.api_keys_env
    if not env_name:
        return []
    raw = (environ if environ is not None else os.environ).get(env_name, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if not keys:
        raise PylonError(
            f"http.api_keys_env: environment variable {env_name} is empty or unset; set it to "
            f"comma-separated API keys, or set http.api_keys_env: null to serve without auth"
        )
    return keys


def _scrypt(key: str, salt: bytes, n: int = N, r: int = R, p: int = P) -> bytes:
    return hashlib.scrypt(key.encode(), salt=salt, n=n, r=r, p=p, maxmem=2 * 128 * r * n + 2**20, dklen=_HASH_BYTES)


def hash_keys(keys: list[str], *, salt: bytes | None = None) -> dict:
    """The stored form of `keys`: salted scrypt hashes under one fresh random salt (see the module's doc)."""
    salt = secrets.token_bytes(16) if salt is None else salt
    return {
        "scheme": SCHEME,
        "n": N,
        "r": R,
        "p": P,
        "salt": salt.hex(),
        "hashes": [_scrypt(k, salt).hex() for k in keys],
    }


def api_keys_config(spec: DeploymentSpec, environ: dict | None = None) -> dict | None:
    """What a deployment of `spec` stores of its API keys, read from this process's environment: their salted
    hashes, or None when the spec serves without auth."""
    keys = read_keys(spec, environ)
    return hash_keys(keys) if keys else None


class KeyCheck:
    """A replica's view of its keys. `required`: the spec asks for keys; with no hashes then (a deployment whose
    key config never arrived) every key is refused: auth fails closed."""

    def __init__(self, config: dict | None, *, required: bool):
        self.required = required or config is not None
        self._hashes: list[bytes] = []
        self._params: tuple[bytes, int, int, int] | None = None
        if config is not None:
            if config.get("scheme") != SCHEME:
                raise ValueError(f"api_keys.scheme: {config.get('scheme')!r} is not {SCHEME!r}")
            self._params = (bytes.fromhex(config["salt"]), int(config["n"]), int(config["r"]), int(config["p"]))
            self._hashes = [bytes.fromhex(h) for h in config["hashes"]]
        self._memo_key = secrets.token_bytes(32)  # this process's only: the memo's names mean nothing elsewhere
        self._memo: dict[bytes, bool] = {}
        self._owners: dict[bytes, str] = {}  # `owner`'s answers, under the memo's names
        self._one_at_a_time = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._hashes)

    def _check(self, key: str) -> bool:
        if self._params is None:
            return False
        salt, n, r, p = self._params
        with self._one_at_a_time:
            presented = _scrypt(key, salt, n, r, p)
        ok = False
        for stored in self._hashes:  # every one, whatever matched: no timing of which
            ok |= hmac.compare_digest(presented, stored)
        return ok

    def _memo_name(self, key: str) -> bytes:
        """What the memos remember `key`'s answers under: a keyed BLAKE2b of it, never the key."""
        return hashlib.blake2b(key.encode(), key=self._memo_key, digest_size=32).digest()

    async def verify(self, key: str) -> bool:
        name = self._memo_name(key)
        known = self._memo.get(name)
        if known is None:
            known = await asyncio.to_thread(self._check, key)
            if len(self._memo) >= _MAX_REMEMBERED:
                self._memo.clear()
            self._memo[name] = known
        return known

    async def owner(self, key: str | None, deployment: str) -> str:
        """Who `key` (a verified one; None without auth) is to what the deployment keeps for its clients (stored
        responses, pylon.serving.api.response_store): a name stable across replicas, redeploys and key rotations of
        the deployment, not a secret, and as costly to turn back into the key as the deployment's stored hashes
        (scrypt with a salt of the deployment's name, then BLAKE2b). Without auth every client is "anonymous"."""
        if key is None:
            return "anonymous"
        name = self._memo_name(key)
        owner = self._owners.get(name)
        if owner is None:
            salt = b"pylon-owner/" + deployment.encode()

            def derive() -> str:
                with self._one_at_a_time:
                    return hashlib.blake2b(_scrypt(key, salt), digest_size=16).hexdigest()

            owner = await asyncio.to_thread(derive)
            if len(self._owners) >= _MAX_REMEMBERED:
                self._owners.clear()
            self._owners[name] = owner
        return owner
