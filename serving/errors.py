"""Errors the serving engine raises to its callers; the HTTP layer maps them to status codes."""

from __future__ import annotations

import json

from pylon.errors import PylonError


class InvalidRequest(PylonError, ValueError):
    """A request the engine refuses as given (HTTP 400). `param` names the offending field, as OpenAI's
    error objects do, so a client can tell which of its arguments to change."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


class EngineDeadError(PylonError, RuntimeError):
    """The engine's step loop stopped (shut down or crashed); no request can be served (HTTP 503)."""


class RequestFailed(PylonError, RuntimeError):
    """One request failed inside the engine through a fault of the engine's, not the request's; the engine serves
    on (HTTP 500 for that request alone)."""


def shown(value) -> str:
    """A request's value for an error message, as the client wrote it (JSON: null, true, "text"; else its repr), cut
    to 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
