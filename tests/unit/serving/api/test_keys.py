"""API keys as a deployment stores them (salted scrypt hashes) and as a replica checks them (pylon.serving.api.keys).
The same on a live deployment, with keys rotated on running replicas: tests/integration/test_security.py."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from pylon.errors import PylonError
from pylon.serving.api import keys
from pylon.specs import DeploymentSpec


def _spec(env: str | None = "PYLON_TEST_KEYS") -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "d", "model": "m", "http": {"api_keys_env": env}})


def test_stored_form_is_salted_scrypt_and_holds_no_key() -> None:
    a = keys.api_keys_config(_spec(), {"PYLON_TEST_KEYS": " sk-alpha , sk-beta,"})
    b = keys.api_keys_config(_spec(), {"PYLON_TEST_KEYS": "sk-alpha,sk-beta"})
    assert a["scheme"] == "scrypt" and (a["n"], a["r"], a["p"]) == (2**14, 8, 1) and len(a["hashes"]) == 2
    assert a["salt"] != b["salt"] and set(a["hashes"]).isdisjoint(b["hashes"]), "a fresh salt per deploy"
    text = json.dumps(a)
    assert "sk-alpha" not in text and hashlib.sha256(b"sk-alpha").hexdigest() not in text
    salt = bytes.fromhex(a["salt"])
    expected = hashlib.scrypt(b"sk-alpha", salt=salt, n=2**14, r=8, p=1, dklen=32).hex()
    assert a["hashes"][0] == expected


def test_keys_come_from_the_named_variable_or_auth_is_off() -> None:
    assert keys.api_keys_config(_spec(None), {}) is None
    with pytest.raises(PylonError, match=r"http.api_keys_env: environment variable PYLON_TEST_KEYS is empty or unset"):
        keys.api_keys_config(_spec(), {"PYLON_TEST_KEYS": " , "})


def test_a_replica_accepts_its_keys_only_and_fails_closed_without_them() -> None:
    stored = keys.hash_keys(["sk-alpha", "sk-beta"])
    check = keys.KeyCheck(stored, required=True)
    verify = lambda key: asyncio.run(check.verify(key))  # noqa: E731
    assert verify("sk-alpha") and verify("sk-beta") and verify("sk-alpha")  # the third from its memo
    assert not verify("sk-alph") and not verify("sk-alpha ") and not verify("")
    # A key set replaced (rotation): the old memo goes with the old check.
    rotated = keys.KeyCheck(keys.hash_keys(["sk-beta", "sk-gamma"]), required=True)
    assert not asyncio.run(rotated.verify("sk-alpha")) and asyncio.run(rotated.verify("sk-gamma"))
    # The spec names a key variable but no hashes arrived: nothing gets in.
    closed = keys.KeyCheck(None, required=True)
    assert closed.required and not asyncio.run(closed.verify("sk-alpha"))
    assert not keys.KeyCheck(None, required=False).required  # auth off by the spec's own choice
    with pytest.raises(ValueError, match="api_keys.scheme: 'sha256' is not 'scrypt'"):
        keys.KeyCheck({**stored, "scheme": "sha256"}, required=True)
