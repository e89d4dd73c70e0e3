"""Request errors with the status code the IFRT proxy client raises them under.

A handler raises one of these; the session turns it into the response's
``status`` (a ``tensorflow.StatusProto``), which the stock client raises as
``JaxRuntimeError("<CODE>: <message>")``. Codes are absl/gRPC status codes.
"""

from __future__ import annotations

import logging

_LOGGER = logging.getLogger(__name__)


class RequestError(Exception):
    """A request that cannot be served; ``code`` is its absl status code."""

    code = 13  # INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(RequestError):
    code = 3  # INVALID_ARGUMENT


class DeadlineExceeded(RequestError):
    code = 4  # DEADLINE_EXCEEDED


class NotFound(RequestError):
    code = 5  # NOT_FOUND


class PermissionDenied(RequestError):
    code = 7  # PERMISSION_DENIED


class ResourceExhausted(RequestError):
    code = 8  # RESOURCE_EXHAUSTED


class FailedPrecondition(RequestError):
    code = 9  # FAILED_PRECONDITION


class Unimplemented(RequestError):
    code = 12  # UNIMPLEMENTED


class Unavailable(RequestError):
    code = 14  # UNAVAILABLE


class Internal(RequestError):
    code = 13  # INTERNAL


class DataLoss(RequestError):
    """Data or work lost with a host that went down (pathwaysutils' elastic mode reads this code as slice down)."""

    code = 15  # DATA_LOSS


_STATUS_NAMES = {
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}


def as_request_error(error: BaseException) -> RequestError:
    """Any failure as a ``RequestError``; XLA's ``"CODE: message"`` keeps its code."""
    if isinstance(error, RequestError):
        return error
    message = str(error)
    name, _, rest = message.partition(": ")
    if name in _STATUS_NAMES and rest:
        converted = RequestError(rest)
        converted.code = _STATUS_NAMES[name]
        return converted
    _LOGGER.error("unexpected server error", exc_info=error)
    return Internal(f"{type(error).__name__}: {message}")
