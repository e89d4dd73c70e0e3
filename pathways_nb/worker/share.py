"""Proportional share of an island's devices between tenants, by weight, when they are saturated.

While one tenant alone has programs for the devices, each is dispatched as
soon as its arguments are there (JAX's asynchronous dispatch, unchanged), or,
with ``alone_depth`` (an island's order of steps sets it), at most that many
are in flight, so that a tenant that comes back waits behind no more.
Once several tenants are busy, at most ``depth`` programs are in flight on
the devices and the next one dispatched is the oldest program of the tenant
with the least weighted device time (start-time fair queueing on measured
device time: a tenant is charged ``busy seconds / weight`` when its program
finishes). Over a busy minute each tenant's device time then follows its
weight; a tenant that was idle does not bank credit (its virtual time is
brought up to the least busy one's when it returns).

A tenant is busy while it has programs queued or in flight, and for
``tuning.SHARE_IDLE_AFTER_S`` after its last one ended: a client that waits
for each batch's results before it sends the next has nothing queued for that
round trip after every batch. Counted idle then, it let the others run ahead
as if alone (an island's ``alone_depth`` steps) and came back level with them,
losing its place at every batch: weights 1 and 3 completed steps in the ratio
1.6-2.2 on an island of two hosts.

A ``core.followers.Follower`` learns when each program's results are ready, and
from that alone the share charges its tenant, releases the next dispatch and
reports the program's busy interval on its devices (``Finished``: the worker's
``execute`` events), so a program costs the worker one wake-up while the device
computes; none if its results are ready when its dispatch returns (XLA's CPU
client runs a small program inside the dispatch) and no older program is still
followed. Programs whose turn comes when another ends are started on the
follower's thread, one after the other (never by recursion on the thread that
dispatched: a chain of small programs would nest as deep as it is long).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pathways_nb.core import tuning
from pathways_nb.core.followers import Follower

_LOGGER = logging.getLogger(__name__)

# A dispatch function runs a program and returns its outputs (values with ``block_until_ready``).
Dispatch = Callable[[], Sequence]
# Told when a program's results are ready: (busy start, end, whether it failed). The busy interval
# starts when it was dispatched or when the previous program on its devices finished, if later.
Finished = Callable[[float, float, bool], None]


@dataclass
class _Tenant:
    weight: float
    virtual_s: float = 0.0
    pending: collections.deque = None  # of _Program
    in_flight: int = 0
    starting: int = 0  # taken from ``pending`` into the share's ``_starting``, not dispatched yet
    busy_s: float = 0.0  # device time used so far
    busy_until: float = 0.0  # when its last program ended, plus ``SHARE_IDLE_AFTER_S``

    def __post_init__(self) -> None:
        self.pending = collections.deque()

    def busy(self, now: float) -> bool:
        """Has programs on the devices, or had a moment ago (its client may wait for their results to send more)."""
        return bool(self.pending or self.in_flight) or now < self.busy_until


@dataclass(frozen=True)
class _Program:
    dispatch: Dispatch
    devices: tuple[int, ...]
    finished: Finished | None


class FairShare:
    """Dispatches the programs of one island's devices in proportional share between tenants."""

    def __init__(self, depth: int = 1, alone_depth: int | None = None):
        """``depth``: programs in flight while several tenants have work; ``alone_depth``: while one has (None: any)."""
        self.depth = depth
        self.alone_depth = alone_depth
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self._in_flight = 0
        self._last_end = 0.0
        self._device_end: dict[int, float] = {}
        # Programs whose turn has come, in the order they were taken from the tenants' queues; only
        # the follower's thread dispatches them (``_start_waiting``), one after the other.
        self._starting: collections.deque[tuple[str, _Program]] = collections.deque()
        self._idle_after_s = tuning.SHARE_IDLE_AFTER_S.value
        self._follower = Follower("share")

    def submit(
        self,
        tenant: str,
        weight: float,
        dispatch: Dispatch,
        devices: Sequence[int] = (),
        finished: Finished | None = None,
    ) -> None:
        """Runs ``dispatch`` now, or at its turn if the devices are shared and saturated.

        ``finished`` is told the program's busy interval on ``devices`` once its results are ready.
        """
        program = _Program(dispatch, tuple(devices), finished)
        now = time.time()
        with self._lock:
            entry = self._tenants.get(tenant)
            if entry is None or not entry.busy(now):
                entry = self._wake(tenant, weight, entry, now)
            entry.weight = weight
            if self._saturated(entry, now):
                entry.pending.append(program)
                return
            self._start(entry)
        self._run(tenant, program)

    def close(self) -> None:
        self._follower.close()

    def device_seconds(self) -> dict[str, float]:
        """Device time each tenant has used on these devices."""
        with self._lock:
            return {name: entry.busy_s for name, entry in self._tenants.items()}

    # -- inside the lock -------------------------------------------------------------------

    def _wake(self, tenant: str, weight: float, entry: _Tenant | None, now: float) -> _Tenant:
        """A tenant that is not busy (new, or back from idle) starts level with the busy ones."""
        busy = [e.virtual_s for e in self._tenants.values() if e.busy(now)]
        floor = min(busy) if busy else 0.0
        if entry is None:
            entry = self._tenants[tenant] = _Tenant(weight)
        entry.virtual_s = max(entry.virtual_s, floor)
        return entry

    def _saturated(self, entry: _Tenant, now: float) -> bool:
        if entry.starting:  # dispatched now, it would overtake its own older programs
            return True
        others = any(e.busy(now) for e in self._tenants.values() if e is not entry)
        if not others:  # alone: keep its own order, and wait for capacity only beyond ``alone_depth``
            return bool(entry.pending) or (self.alone_depth is not None and self._in_flight >= self.alone_depth)
        return bool(entry.pending) or self._in_flight >= self.depth

    def _start(self, entry: _Tenant) -> None:
        entry.in_flight += 1
        self._in_flight += 1

    def _take_startable(self) -> bool:
        """Moves to ``_starting`` the programs that may start now, each the oldest of the tenant with the
        least weighted device time; whether there were any."""
        taken, now = False, time.time()
        while True:
            waiting = [(e.virtual_s, name) for name, e in self._tenants.items() if e.pending]
            several = sum(1 for e in self._tenants.values() if e.busy(now)) > 1
            limit = self.depth if several or self.alone_depth is None else self.alone_depth
            if not waiting or self._in_flight >= limit:
                return taken
            _, name = min(waiting)
            entry = self._tenants[name]
            self._start(entry)
            entry.starting += 1
            self._starting.append((name, entry.pending.popleft()))
            taken = True

    # -- running and finishing -------------------------------------------------------------

    def _run(self, tenant: str, program: _Program) -> None:
        """Dispatches ``program``; when it ends, starts what may start then (on the follower's thread)."""
        started = time.time()
        try:
            outputs = list(program.dispatch())
        except Exception:
            outputs = []
            _LOGGER.warning("a program of %s failed to dispatch", tenant, exc_info=True)

        def ended(failed: bool) -> None:
            if self._finish(tenant, program, outputs, started, failed):
                self._follower.call(self._start_waiting)

        self._follower.follow(outputs, ended)

    def _start_waiting(self) -> None:
        """Dispatches the programs in ``_starting``, in order (on the follower's thread only).

        A tenant's program submitted meanwhile queues behind its older ones (``_saturated``): run at
        once on the submitting thread it would overtake them, and an island's order would give it
        the earlier step, which would then wait for its own arguments from the later one, for ever.
        """
        while True:
            with self._lock:
                if not self._starting:
                    return
                name, program = self._starting.popleft()
            self._run(name, program)
            with self._lock:
                self._tenants[name].starting -= 1
                self._take_startable()  # what queued behind it while it waited, if there is room

    def _finish(self, tenant: str, program: _Program, outputs: list, dispatched: float, failed: bool) -> bool:
        """Charges the tenant of a program whose results are ready and reports it; whether others may start now."""
        end = time.time()
        with self._lock:
            busy = max(0.0, end - max(dispatched, self._last_end))
            self._last_end = end
            start = max([dispatched, *(self._device_end.get(d, 0.0) for d in program.devices)])
            for device in program.devices:
                self._device_end[device] = end
            entry = self._tenants[tenant]
            entry.busy_s += busy
            entry.virtual_s += busy / entry.weight
            entry.in_flight -= 1
            entry.busy_until = end + self._idle_after_s
            self._in_flight -= 1
            ready = self._take_startable()
        if program.finished is not None and outputs:
            try:
                program.finished(min(start, end), end, failed)
            except Exception:
                _LOGGER.exception("reporting a finished program failed")
        return ready
