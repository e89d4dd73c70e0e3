"""One order for the programs of an island that span its hosts (gang scheduling).

Every host of an island must dispatch its parts of multi-host programs in the
same order, whichever proxy, session or tenant sent them, or two hosts wait in
different collectives forever. The island's host 0 decides the order: it
numbers each such program as its part arrives (so a session's programs keep
the order the session sent them in, and sessions interleave first come, first
served) and tells the other hosts; every host, host 0 too, dispatches step n
only once steps 0..n-1 are dispatched and its own part of step n is ready
(arguments there). Dispatch runs on one thread per island order, which never
holds the order's lock while it runs a program, so no lock of a session is
ever taken inside it. At most ``MAX_IN_FLIGHT`` such programs are in flight:
with more, XLA's CPU collectives can wait on each other's threads and never
finish (a plain multi-process JAX loop of 2000 ``psum`` steps hangs the same
way on jaxlib 0.10.2), so the dispatcher waits for the oldest first.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Sequence

_LOGGER = logging.getLogger(__name__)

# Runs this host's part of a program; returns its outputs (values with ``block_until_ready``).
Dispatch = Callable[[], Sequence]

MAX_IN_FLIGHT = 2


class IslandOrder:
    """The steps of this host's island, and the parts waiting for their turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_assigned = 0  # host 0: the next step number to hand out
        self._next_dispatched = 0
        self._step_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._ready: dict[str, Dispatch | None] = {}
        self._runnable: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._dispatch_forever, name="pathways-gang", daemon=True)
        self._thread.start()

    def assign(self, key: str) -> int:
        """Host 0: gives the program ``key`` the next step of the island."""
        with self._lock:
            step = self._next_assigned
            self._next_assigned += 1
            self._order(key, step)
        return step

    def ordered(self, key: str, step: int) -> None:
        """Hosts > 0: host 0 gave ``key`` step ``step``."""
        with self._lock:
            self._order(key, step)

    def ready(self, key: str, dispatch: Dispatch | None) -> None:
        """This host's part of ``key`` can run (``None``: it failed here; its turn passes)."""
        with self._lock:
            self._ready[key] = dispatch
            self._release()

    def _order(self, key: str, step: int) -> None:
        self._step_of[key] = step
        self._key_of[step] = key
        self._release()

    def _release(self) -> None:
        """Queues every step whose turn has come, in order (called with the lock held)."""
        while True:
            key = self._key_of.get(self._next_dispatched)
            if key is None or key not in self._ready:
                return
            dispatch = self._ready.pop(key)
            del self._key_of[self._next_dispatched]
            del self._step_of[key]
            self._next_dispatched += 1
            if dispatch is not None:
                self._runnable.put(dispatch)

    def _dispatch_forever(self) -> None:
        in_flight: collections.deque = collections.deque()
        while True:
            dispatch = self._runnable.get()
            while len(in_flight) >= MAX_IN_FLIGHT:
                outputs = in_flight.popleft()
                for output in outputs[:1]:
                    try:
                        output.block_until_ready()
                    except Exception:  # noqa: BLE001 - a failed program is finished too
                        pass
            try:
                in_flight.append(list(dispatch()))
            except Exception:
                _LOGGER.exception("dispatching an island program failed")
