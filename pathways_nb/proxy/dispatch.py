"""The table from IFRT request kinds to the functions that serve them.

Handler modules register with ``@handles("copy_arrays_request", outputs=...)``.
``outputs`` names the client-chosen result handles of a request: if serving it
fails, those handles hold the error, so the client's later use of them raises
the original message (the client does not wait for most replies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# Returned by a handler that replies later through ``session.reply``.
DEFERRED = object()


@dataclass(frozen=True)
class Handler:
    function: Callable[..., Any]
    response_field: str
    outputs: Callable[[Any], Iterable[int]] | None


HANDLERS: dict[str, Handler] = {}


def handles(request_field: str, outputs: Callable[[Any], Iterable[int]] | None = None):
    """Registers ``function(session, request) -> response body | DEFERRED`` for a request kind."""

    def register(function: Callable[..., Any]) -> Callable[..., Any]:
        if request_field in HANDLERS:
            raise RuntimeError(f"two handlers for {request_field}")
        response_field = request_field.removesuffix("_request") + "_response"
        HANDLERS[request_field] = Handler(function, response_field, outputs)
        return function

    return register
