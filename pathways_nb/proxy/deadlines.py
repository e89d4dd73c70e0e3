"""One background thread that runs callbacks after a delay (upload time-outs and the like).

``threading.Timer`` starts a thread per timer; the proxy arms one for every
host buffer it waits for, so it shares a single thread and a heap instead.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

_LOGGER = logging.getLogger(__name__)


class Deadline:
    """A scheduled callback; ``cancel()`` before it fires and it never runs."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]):
        self.when = when
        self.callback: Callable[[], None] | None = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Drops the callback now (and what it holds); the heap entry goes at its time."""
        self.cancelled = True
        self.callback = None


class Deadlines:
    """Runs callbacks at their deadlines on one daemon thread."""

    def __init__(self, name: str = "pathways-deadlines"):
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._wakeup = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Deadline:
        deadline = Deadline(time.monotonic() + delay_s, callback)
        with self._wakeup:
            heapq.heappush(self._heap, (deadline.when, next(self._order), deadline))
            if self._heap[0][2] is deadline:
                self._wakeup.notify()
        return deadline

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._wakeup.wait(timeout)
                if self._closed:
                    return
                _, _, deadline = heapq.heappop(self._heap)
            callback = deadline.callback
            if callback is not None:
                try:
                    callback()
                except Exception:
                    _LOGGER.exception("deadline callback failed")
