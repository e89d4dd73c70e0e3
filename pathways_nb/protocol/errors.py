"""Request errors with the status code the IFRT proxy client raises them under, and the one table of codes.

A handler raises one of these; the session turns it into the response's
``status`` (a ``tensorflow.StatusProto``), which the stock client raises as
``JaxRuntimeError("<CODE>: <message>")``. Codes are absl/gRPC status codes:
``Code`` names them, and every conversion (a code to an error, an error to a
gRPC status, a gRPC failure to an error, XLA's ``"CODE: message"`` text) goes
through this module, so each code means one thing everywhere.
"""

from __future__ import annotations

import enum
import logging

import grpc

_LOGGER = logging.getLogger(__name__)


class Code(enum.IntEnum):
    """absl/gRPC status codes (``grpc.StatusCode`` has the same numbers)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# Failures that the same call will meet again however often it is retried: a retry loop stops on them.
PERMANENT = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.PERMISSION_DENIED,
        Code.FAILED_PRECONDITION,
        Code.OUT_OF_RANGE,
        Code.UNIMPLEMENTED,
        Code.UNAUTHENTICATED,
    }
)


class RequestError(Exception):
    """A request that cannot be served; ``code`` is its absl status code."""

    code: int = Code.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(RequestError):
    code = Code.INVALID_ARGUMENT


class DeadlineExceeded(RequestError):
    code = Code.DEADLINE_EXCEEDED


class NotFound(RequestError):
    code = Code.NOT_FOUND


class PermissionDenied(RequestError):
    code = Code.PERMISSION_DENIED


class ResourceExhausted(RequestError):
    code = Code.RESOURCE_EXHAUSTED


class FailedPrecondition(RequestError):
    code = Code.FAILED_PRECONDITION


class Unimplemented(RequestError):
    code = Code.UNIMPLEMENTED


class Unavailable(RequestError):
    code = Code.UNAVAILABLE


class Internal(RequestError):
    code = Code.INTERNAL


class DataLoss(RequestError):
    """Data or work lost with a host that went down (pathwaysutils' elastic mode reads this code as slice down)."""

    code = Code.DATA_LOSS


# The class each code is raised as where one exists (isinstance checks in the servers rely on them).
_CLASSES: dict[int, type[RequestError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        DeadlineExceeded,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Unimplemented,
        Unavailable,
        Internal,
        DataLoss,
    )
}


def error_for(code: int, message: str) -> RequestError:
    """The error for a status received from elsewhere (a worker's reply, an executor, a client's error array)."""
    cls = _CLASSES.get(code)
    if cls is not None:
        return cls(message)
    error = RequestError(message)
    error.code = code if code in Code._value2member_map_ and code != Code.OK else Code.UNKNOWN
    return error


def grpc_code(error: RequestError) -> grpc.StatusCode:
    """The gRPC status a request error is sent as (``context.abort``)."""
    return _GRPC[error.code] if error.code in _GRPC else grpc.StatusCode.UNKNOWN


def from_rpc_error(error: grpc.RpcError, what: str = "") -> RequestError:
    """A failed gRPC call as a request error with the same code; ``what`` says which call, for the message."""
    code = error.code()
    details = error.details() or code.name
    return error_for(code.value[0], f"{what}: {details}" if what else details)


_GRPC = {code.value[0]: code for code in grpc.StatusCode}


def as_request_error(error: BaseException) -> RequestError:
    """Any failure as a ``RequestError``; XLA's ``"CODE: message"`` keeps its code."""
    if isinstance(error, RequestError):
        return error
    message = str(error)
    name, _, rest = message.partition(": ")
    if name in Code.__members__ and rest:
        return error_for(Code[name], rest)
    _LOGGER.error("unexpected server error", exc_info=error)
    return Internal(f"{type(error).__name__}: {message}")
