"""Following dispatched programs to their end, in dispatch order, without making anyone wait.

XLA returns from a dispatch before the device has finished; whoever must know when a program ended
(a worker's share of its devices between tenants, an island's order of steps, the timeline's
execute events) hands its outputs to a ``Follower``. XLA's CPU client runs a small program inside
its dispatch, and then nothing needs to wake: the follower tells at once, on the calling thread,
if nothing older is still followed. Otherwise its one thread waits on the outputs in the order
they were handed over, and tells each in turn, so what it reports keeps the dispatch order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

_LOGGER = logging.getLogger(__name__)

# Told when a program's outputs are ready: whether it failed (its outputs hold an error).
Ended = Callable[[bool], None]

_STOP = object()


class Follower:
    """One thread that follows programs to their end; ``close()`` stops it."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._followed = 0  # programs handed to the thread whose end it has not told yet
        self._thread = threading.Thread(target=self._run, name=f"pathways-{name}", daemon=True)
        self._thread.start()

    def follow(self, outputs: Sequence, ended: Ended) -> None:
        """Calls ``ended(failed)`` once ``outputs`` are ready: now, if they are and nothing older is followed."""
        with self._lock:
            at_once = not self._followed and all(output.is_ready() for output in outputs[:1])
            if not at_once:
                self._followed += 1
        if at_once:
            _tell(ended, wait_until_ended(outputs), self.name)
        else:
            self._queue.put((outputs, ended))

    def call(self, function: Callable[[], None]) -> None:
        """Runs ``function`` on the follower's thread, after everything handed to it so far."""
        with self._lock:
            self._followed += 1
        self._queue.put(((), lambda _failed: function()))

    def close(self) -> None:
        """Stops the thread once it has told what it follows now (programs still running are not waited for)."""
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            outputs, ended = item
            failed = wait_until_ended(outputs)
            _tell(ended, failed, self.name)
            with self._lock:
                self._followed -= 1


def wait_until_ended(outputs: Sequence) -> bool:
    """Waits until a program whose ``outputs`` these are has ended (they finish together); whether it failed.

    Blocks: for a follower's thread or a pool's, never an event loop.
    """
    for output in outputs[:1]:
        try:
            output.block_until_ready()
        except Exception:  # noqa: BLE001 - a failed program has ended too; its outputs report the error
            return True
    return False


def _tell(ended: Ended, failed: bool, name: str) -> None:
    try:
        ended(failed)
    except Exception:
        _LOGGER.exception("%s: telling that a program ended failed", name)
