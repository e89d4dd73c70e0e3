"""One order for the programs of an island that span its hosts (gang scheduling).

Every host of an island must dispatch its parts of multi-host programs in the
same order, whichever proxy, session or tenant sent them, or two hosts wait in
different collectives forever. The island's host 0 decides the order: it
numbers each such program as its part arrives (so a session's programs keep
the order the session sent them in, and sessions interleave first come, first
served; while several tenants saturate the island, the next step goes by
weight, through the island's own ``FairShare``, see
``worker.handlers.programs._assign_step``) and tells the other hosts; every host, host 0
too, dispatches step n only once steps 0..n-1 are dispatched and its own part
of step n is ready (arguments there). Dispatch runs on one thread per island order, which never
holds the order's lock while it runs a program. At most ``tuning.GANG_MAX_IN_FLIGHT`` such
programs are in flight: with more, XLA's CPU collectives can wait on each other's threads and
never finish (a plain multi-process JAX loop of 2000 ``psum`` steps hangs the same way on jaxlib
0.10.2), so the dispatcher waits for a slot, which a ``core.followers.Follower`` frees when the
oldest has run.

A step's turn (``Turn``) ends when its part has run on every host, not only on
host 0: each other host answers host 0's ``OrderGang`` once its parts of those
steps have run (``ran``). A program with no collective between the hosts lets
each host run at its own pace; were host 0's own part the measure, a slower host
would fall behind by whole queues of steps, which it runs in the order it was
given, and the weights would decide nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.followers import Follower
from pathways_nb.worker.share import FairShare

_LOGGER = logging.getLogger(__name__)

# Runs this host's part of a program; returns its outputs (values with ``block_until_ready``).
Dispatch = Callable[[], Sequence]


class Turn:
    """One step's part on this host, ready once it has run (or given its turn up: failed here, its session ended).

    On host 0 it is also what ``FairShare`` follows: ready once the other hosts have said that
    their parts ran too (``wait_for``).
    """

    def __init__(self) -> None:
        self.ran = Pending()  # resolved once this host's part has run
        self._others: list[Pending] = []

    def wait_for(self, others: Sequence[Pending]) -> None:
        """Host 0: the step is done only once each of ``others`` (another host's part) is."""
        self._others.extend(others)

    def is_ready(self) -> bool:
        return self.ran.done and all(part.done for part in self._others)

    def block_until_ready(self) -> None:
        for part in (self.ran, *self._others):
            part.wait()


class IslandOrder:
    """The steps of this host's island, and the parts waiting for their turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_assigned = 0  # host 0: the next step number to hand out
        self._next_dispatched = 0
        self._step_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._ready: dict[str, Dispatch | None] = {}
        self._turns: dict[str, Turn] = {}  # the steps ordered whose part here has not been dispatched
        self._runnable: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.Semaphore(tuning.GANG_MAX_IN_FLIGHT.value)
        self._closed = False
        self._follower = Follower("gang")
        self._thread = threading.Thread(target=self._dispatch_until_closed, name="pathways-gang", daemon=True)
        self._thread.start()
        # Host 0: who gets the next step while several tenants saturate the island. Apart from the
        # share of the host's own devices, so that no step waits behind a one-host program that
        # waits for the step's turn, or the other way round. A tenant alone on the island (the others
        # idle for SHARE_IDLE_AFTER_S) gets at most GANG_ALONE_AHEAD steps ahead of their end: one that
        # comes back (after its client stalled, say) waits behind that many, not the other's whole queue.
        self.share = FairShare(alone_depth=tuning.GANG_ALONE_AHEAD.value)

    def assign(self, key: str) -> tuple[int, Turn]:
        """Host 0: gives the program ``key`` the next step of the island; the turn is its part here."""
        with self._lock:
            step = self._next_assigned
            self._next_assigned += 1
            return step, self._order(key, step)

    def ordered(self, key: str, step: int) -> Turn:
        """Hosts > 0: host 0 gave ``key`` step ``step``; the turn is this host's part."""
        with self._lock:
            return self._order(key, step)

    def ready(self, key: str, dispatch: Dispatch | None) -> None:
        """This host's part of ``key`` can run (``None``: it failed here; its turn passes)."""
        with self._lock:
            self._ready[key] = dispatch
            self._release()

    def _order(self, key: str, step: int) -> Turn:
        self._step_of[key] = step
        self._key_of[step] = key
        turn = self._turns[key] = Turn()
        self._release()
        return turn

    def _release(self) -> None:
        """Queues every step whose turn has come, in order (called with the lock held)."""
        while True:
            key = self._key_of.get(self._next_dispatched)
            if key is None or key not in self._ready:
                return
            dispatch = self._ready.pop(key)
            turn = self._turns.pop(key)
            del self._key_of[self._next_dispatched]
            del self._step_of[key]
            self._next_dispatched += 1
            if dispatch is not None:
                self._runnable.put((dispatch, turn))
            else:
                turn.ran.resolve(None)

    def _dispatch_until_closed(self) -> None:
        while (item := self._runnable.get()) is not None:
            dispatch, turn = item
            self._slots.acquire()  # freed once the oldest part in flight has run (or by ``close``)
            if self._closed:
                turn.ran.resolve(None)
                continue
            outputs: list = []
            try:
                outputs = list(dispatch())
            except Exception:
                _LOGGER.exception("dispatching an island program failed")
            self._follower.follow(outputs, lambda _failed, turn=turn: self._ran(turn))

    def _ran(self, turn: Turn) -> None:
        self._slots.release()
        turn.ran.resolve(None)

    def close(self) -> None:
        """Stops dispatching (parts still waiting for their turn never run) and following."""
        self._closed = True
        self._runnable.put(None)
        self._slots.release(tuning.GANG_MAX_IN_FLIGHT.value)
        self._thread.join(timeout=5)
        self._follower.close()
        self.share.close()
