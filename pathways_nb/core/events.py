"""What took time where: compiles, executions per device, transfers, waits.

The proxy keeps the recent events of every session in an ``EventLog`` (a
bounded ring, cheap enough to leave on) and streams them to notebooks for
timelines and traces. An ``ExecutionTimer`` finds when asynchronous
executions finish without making anyone wait (``core.followers``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

from pathways_nb.core.followers import Follower
from pathways_nb.rpc import cluster_pb2 as pb

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
    later, and ends when its results are ready. A ``Follower`` tells when that
    is: at once for results that are ready when they are watched, with nothing
    older still followed (XLA's CPU client runs a small program inside its
    dispatch), so no thread has to wake for them.
    """

    def __init__(self) -> None:
        self._follower = Follower("execution-timer")
        self._lock = threading.Lock()
        self._last_end: dict[int, float] = {}

    def watch(
        self, name: str, device_ids: Sequence[int], outputs: Sequence, dispatched: float, sink: EventSink
    ) -> None:
        devices = tuple(device_ids)
        self._follower.follow(outputs, lambda failed: sink(self._finished(name, devices, dispatched, failed)))

    def _finished(self, name: str, device_ids: tuple[int, ...], dispatched: float, failed: bool) -> pb.Event:
        """The event of an execution whose results are ready."""
        end = time.time()
        with self._lock:
            start = max([dispatched, *(self._last_end.get(d, 0.0) for d in device_ids)])
            for device in device_ids:
                self._last_end[device] = end
        return event("execute", name, device_ids, min(start, end), end, failed=failed)

    def close(self) -> None:
        self._follower.close()
