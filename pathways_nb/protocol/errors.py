"""Request errors with the status code the IFRT proxy client raises them under.

A handler raises one of these; the session turns it into the response's
``status`` (a ``tensorflow.StatusProto``), which the stock client raises as
``JaxRuntimeError("<CODE>: <message>")``. Codes are absl/gRPC status codes.
"""

from __future__ import annotations


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
