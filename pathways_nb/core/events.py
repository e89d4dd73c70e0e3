"""What took time where: compiles, executions per device, transfers, waits.

The proxy keeps the recent events of every session in an ``EventLog`` (a
bounded ring, cheap enough to leave on) and streams them to notebooks for
timelines and traces. An ``ExecutionTimer`` finds when asynchronous
executions finish without making anyone wait: one thread waits on each
execution's results in dispatch order.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

EventSink = Callable[[pb.Event], None]


def event(
    kind: str,
    name: str,
    device_ids: Sequence[int],
    start: float,
    end: float,
    nbytes: int = 0,
    failed: bool = False,
) -> pb.Event:
    return pb.Event(kind=kind, name=name, device_ids=device_ids, start=start, end=end, bytes=nbytes, failed=failed)


class EventLog:
    """The last ``capacity`` events, numbered in the order they were recorded."""

    def __init__(self, capacity: int = 200_000):
        self._events: collections.deque[pb.Event] = collections.deque(maxlen=capacity)
        self._sequence = 0
        self._lock = threading.Lock()

    def add(self, recorded: pb.Event, tenant: str) -> None:
        recorded.tenant = tenant
        with self._lock:
            self._sequence += 1
            recorded.sequence = self._sequence
            self._events.append(recorded)

    def sink(self, tenant: str) -> EventSink:
        """Where a session's events go."""
        return lambda recorded: self.add(recorded, tenant)

    def after(self, sequence: int, tenant: str = "") -> tuple[list[pb.Event], int]:
        """The events recorded after ``sequence`` (of ``tenant``, if given), and the latest sequence number."""
        with self._lock:
            events, latest = list(self._events), self._sequence
        return [e for e in events if e.sequence > sequence and (not tenant or e.tenant == tenant)], latest

    @property
    def sequence(self) -> int:
        return self._sequence


class ExecutionTimer:
    """Records when each dispatched execution finishes, in the order they were dispatched.

    An execution's busy interval on its devices starts when it was dispatched
    or when the previous execution on those devices finished, whichever is
    later, and ends when its results are ready. Results that are ready when
    they are watched, with nothing older still followed, are recorded at once
    (XLA's CPU client runs a small program inside its dispatch): no thread has
    to wake for them.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._followed = 0  # watched executions the thread has not recorded yet
        self._last_end: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="pathways-execution-timer", daemon=True)
        self._thread.start()

    def watch(
        self, name: str, device_ids: Sequence[int], outputs: Sequence, dispatched: float, sink: EventSink
    ) -> None:
        watched = (name, tuple(device_ids), outputs[:1], dispatched, sink)
        with self._lock:
            if not self._followed and all(output.is_ready() for output in watched[2]):
                recorded = self._finish(*watched)
            else:
                self._followed += 1
                recorded = None
        if recorded is None:
            self._queue.put(watched)
        else:
            _deliver(sink, recorded)

    def _run(self) -> None:
        while True:
            watched = self._queue.get()
            for output in watched[2]:
                try:
                    output.block_until_ready()
                except Exception:  # noqa: BLE001 - a failed execution is still an event (``_finish`` sees it)
                    pass
            with self._lock:
                recorded = self._finish(*watched)
                self._followed -= 1
            _deliver(watched[4], recorded)

    def _finish(self, name: str, device_ids: tuple[int, ...], outputs: Sequence, dispatched: float, _sink) -> pb.Event:
        """The event of an execution whose results are ready (called with the lock held)."""
        failed = False
        for output in outputs:
            try:
                output.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed execution is still an event
                failed = True
        end = time.time()
        start = max([dispatched, *(self._last_end.get(d, 0.0) for d in device_ids)])
        for device in device_ids:
            self._last_end[device] = end
        return event("execute", name, device_ids, min(start, end), end, failed=failed)


def _deliver(sink: EventSink, recorded: pb.Event) -> None:
    try:
        sink(recorded)
    except Exception:
        _LOGGER.exception("recording an execution failed")
