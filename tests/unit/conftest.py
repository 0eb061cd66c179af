"""Unit tests never write into the user's ~/.pylon: replicas built in-process keep their ledger in a temporary root."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _ledger_root(tmp_path_factory) -> None:
    if not os.environ.get("PYLON_LEDGER_URI"):
        os.environ["PYLON_LEDGER_URI"] = str(tmp_path_factory.mktemp("ledger"))
