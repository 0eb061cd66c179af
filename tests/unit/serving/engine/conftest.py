"""The engine tests' models, as fixtures: each module builds them once (engine_models.Family)."""

from __future__ import annotations

import pytest
from engine_models import FAMILIES, Family


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Family:
    return Family("gpt2", tmp_path_factory.mktemp("gpt2-only"))
