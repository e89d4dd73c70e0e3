"""Values that arrive later: uploads not yet stored, arrays whose inputs are not ready.

The session stream never waits. A request whose inputs are not there yet
registers a callback on them and returns; the callback finishes the work on
whichever thread delivers the last input.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

Callback = Callable[[Any, BaseException | None], None]


class Pending:
    """A value or an error, delivered once; callbacks run on the delivering thread."""

    __slots__ = ("_callbacks", "_done", "_lock", "error", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self._callbacks: list[Callback] = []

    @property
    def done(self) -> bool:
        return self._done

    def on_done(self, callback: Callback) -> None:
        """Calls ``callback(value, error)`` now if done, else when done."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self.value, self.error)

    def resolve(self, value: Any) -> bool:
        return self._finish(value, None)

    def fail(self, error: BaseException) -> bool:
        return self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self.value, self.error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(value, error)
        return True


def when_all(pendings: Sequence[Pending], callback: Callable[[BaseException | None], None]) -> None:
    """Calls ``callback(first_error_or_None)`` once every pending is done."""
    if not pendings:
        callback(None)
        return
    remaining = [len(pendings)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one_done(_value: Any, error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback(errors[0] if errors else None)

    for pending in pendings:
        pending.on_done(one_done)
