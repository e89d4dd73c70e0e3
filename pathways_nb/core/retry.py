"""Calling another server again after a failure: how long to wait, and when to stop.

Every retry loop of pathways-nb (a worker registering, a proxy following the cluster or holding an
allocation, a launcher restarting a child) waits by one ``Backoff``: the first wait, doubling up to a
ceiling, each with up to a fifth of jitter so that processes started together do not retry in
lockstep. ``Retry`` adds the stop: a failure that the same call will meet however often it is made
(a refused token, an invalid request: ``protocol.errors.PERMANENT``) ends the loop at once with that
error, as does a deadline, instead of spinning on it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from pathways_nb.core import tuning
from pathways_nb.protocol.errors import PERMANENT, DeadlineExceeded, RequestError, from_rpc_error


@dataclass(frozen=True)
class Backoff:
    """Waits between attempts: ``first_s``, doubling up to ``max_s`` (defaults: the tuning registry's)."""

    first_s: float | None = None
    max_s: float | None = None

    def after(self, previous_s: float | None) -> float:
        """The wait after one of ``previous_s`` (None: the first failure, or the first since things went well)."""
        first = tuning.RETRY_INITIAL_S.value if self.first_s is None else self.first_s
        ceiling = tuning.RETRY_MAX_S.value if self.max_s is None else self.max_s
        base = first if previous_s is None else min(ceiling, previous_s * 2)
        return base * random.uniform(0.8, 1.0)


def is_permanent(error: BaseException) -> bool:
    """Whether the same call would fail the same way however often it is made."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error.code().value[0] in PERMANENT
    if isinstance(error, RequestError):
        return error.code in PERMANENT
    return False


class Retry:
    """The failures of one call that is made again until it works, a permanent error, or ``deadline_s``.

    >>> retry = Retry("registering with the resource manager", deadline_s=60)   # doctest: +SKIP
    >>> while True:
    ...     try:
    ...         return call()
    ...     except grpc.RpcError as error:
    ...         stopped.wait(retry.failed(error))     # raises instead of waiting, when it is time to stop
    """

    def __init__(self, what: str, deadline_s: float | None = None, backoff: Backoff | None = None):
        self.what = what
        self.backoff = backoff or Backoff()
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.failures = 0
        self._wait_s: float | None = None

    def failed(self, error: BaseException) -> float:
        """Counts a failed attempt and returns how long to wait before the next one.

        Raises the failure as a ``RequestError`` (its own code) if it is permanent, and
        ``DeadlineExceeded`` once the deadline has passed.
        """
        self.failures += 1
        failure = from_rpc_error(error, self.what) if isinstance(error, grpc.RpcError) else error
        if is_permanent(error):
            raise failure
        if self.deadline is not None and time.monotonic() >= self.deadline:
            detail = failure.message if isinstance(failure, RequestError) else str(failure)
            raise DeadlineExceeded(f"gave up {self.what} after {self.failures} attempts: {detail}")
        self._wait_s = self.backoff.after(self._wait_s)
        return self._wait_s

    def succeeded(self) -> None:
        """The call worked: a later failure waits the first wait again."""
        self._wait_s = None
