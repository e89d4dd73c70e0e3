"""The stall guard: a test fails if a loop of a server it started, or of a shared one while it ran, ran one
callback for more than 0.5 s (what the loop discipline forbids; docs/testing.md).

What it reads is each server's loop watchdog (``core.loop``, through ``Diagnostics.GetLoopStats``). What
it reads it from registers here once ``enable()`` has run (the test suite's ``conftest.py`` does): every
``LocalCluster`` as it starts serving and again just before it stops (``launch.local_cluster.watchers``),
and every ``testing.proxy_process``. A server still serving is read when ``check()`` runs; one that
stopped was read as it stopped. Each ``check()`` returns the stalls that ended since the previous one,
so the servers that outlive a test (the session's shared ones) are judged over each test alone.

A stall while the loop waited for a CPU (a loaded machine) is counted apart by the watchdog and never
fails. Two kinds of stall in a callback are ``StallNotJudged`` warnings rather than failures:

- one whose loop thread was found entering a Python function (its innermost frame on the ``def`` line):
  CPython's thread waits there for the GIL, which another thread holds or the machine gives no CPU to run
  and hand over; a callback that blocks is found inside the call that blocks. (The watchdog counts it as in
  a callback; it would need the thread's and the process's CPU time over the stall to say which.)
- one the watchdog counted (``stalls_in_callbacks``) but did not keep: it keeps each process's 8 longest
  stalls, so how long this one was is unknown.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from pathways_nb.rpc import cluster_pb2 as pb

T = TypeVar("T")

LONGEST_CALLBACK_S = 0.5  # longer than this in one callback fails a test


@dataclass(frozen=True)
class Stall:
    """One callback that held a server's loop too long."""

    source: str  # the cluster or server, e.g. "LocalCluster at grpc://127.0.0.1:4242"
    process: str  # its process, as its watchdog names it, e.g. "worker island0-host0"
    seconds: float
    ended: float  # time.time()
    where: str  # the loop thread's innermost frames during the stall

    @property
    def entering_a_function(self) -> bool:
        """Whether the loop's thread was found on a function's ``def`` line: waiting for the GIL (or for a CPU to
        take it with), not in a call that blocks."""
        innermost = self.where.rstrip().splitlines()[-1:]
        return bool(innermost) and innermost[0].strip().startswith(("def ", "async def "))

    def __str__(self) -> str:
        ended = datetime.datetime.fromtimestamp(self.ended).strftime("%H:%M:%S.%f")[:-3]
        where = "\n".join(f"    {line}" for line in self.where.splitlines())
        return (
            f"{self.process} ({self.source}): one callback held the loop for {self.seconds:.2f} s, "
            f"until {ended}; the loop was in:\n{where}"
        )


class StallNotJudged(UserWarning):
    """A callback stall the guard cannot blame on the callback: the loop's thread waited for the GIL or a CPU, or
    the watchdog did not keep it (its length is unknown)."""


def callback_stalls(
    stats: Iterable[pb.LoopStats], longer_than_s: float, since: float = 0.0
) -> list[tuple[str, object]]:
    """``(process, pb.LoopStall)`` for each kept stall in a callback longer than ``longer_than_s`` that ended
    after ``since`` (``time.time()``)."""
    return [
        (process.process, stall)
        for process in stats
        for stall in process.longest
        if stall.in_callback and stall.seconds > longer_than_s and stall.ended > since
    ]


class Watched:
    """A cluster or server the guard reads: how, up to when it was judged, and what it said as it stopped."""

    def __init__(self, source: str, read: Callable[[], list[pb.LoopStats]]):
        self.source = source
        self._read: Callable[[], list[pb.LoopStats]] | None = read
        self.judged_until = 0.0  # time.time(): stalls that ended before were judged (or came before the first check)
        self.counted: dict[str, int] = {}  # stalls_in_callbacks per process at the last check
        self.last: list[pb.LoopStats] | None = None  # read as it stopped

    def stopping(self) -> None:
        """Reads it one last time, while it still serves."""
        if self._read is None:
            return
        try:
            self.last = _counted(self._read)
        except grpc.RpcError as error:  # a process of it was killed or stopped by the test
            _count_unread(self.source, error)
        self._read = None

    def judge(self, now: float) -> tuple[list[Stall], list[str]]:
        """The stalls over the limit that ended since the last judgement, and what it could not judge."""
        if self._read is not None:
            try:
                stats = _counted(self._read)
            except grpc.RpcError as error:  # a process is down at the moment (the test killed it): judged next time
                _count_unread(self.source, error)
                return [], []
        else:
            stats = self.last or []
        stalls = [
            Stall(self.source, process, stall.seconds, stall.ended, stall.where)
            for process, stall in callback_stalls(stats, LONGEST_CALLBACK_S, self.judged_until)
        ]
        doubts = [f"{stall} (waiting for the GIL or a CPU)" for stall in stalls if stall.entering_a_function]
        for process in stats:
            before = self.counted.get(process.process, 0)
            kept = sum(1 for s in process.longest if s.in_callback and s.ended > self.judged_until)
            smallest_kept = min((s.seconds for s in process.longest), default=0.0)
            if process.stalls_in_callbacks - before > kept and smallest_kept > LONGEST_CALLBACK_S:
                doubts.append(
                    f"{process.process} ({self.source}): a callback held the loop for more than 0.25 s, and the "
                    "watchdog kept longer stalls only: how long is unknown"
                )
            self.counted[process.process] = process.stalls_in_callbacks
        self.judged_until = now
        return [stall for stall in stalls if not stall.entering_a_function], doubts


_lock = threading.Lock()  # guards the state below: clusters start and stop on the tests' threads and others
_serving: weakref.WeakKeyDictionary[object, Watched] = weakref.WeakKeyDictionary()
_stopped: list[Watched] = []  # read as they stopped, judged at the next check
_enabled = False
reads = 0  # how many times a cluster or server was read (what ``summary`` says)
unread: list[str] = []  # each read that failed: which, and why


def _counted(read: Callable[[], list[pb.LoopStats]]) -> list[pb.LoopStats]:
    global reads
    with _lock:
        reads += 1
    return read()


def _count_unread(source: str, error: grpc.RpcError) -> None:
    with _lock:
        unread.append(f"{source}: {error.code().name}")


def summary() -> str:
    """How many reads the guard made, and which failed (a process the test had killed or stopped)."""
    with _lock:
        failed = f"; {len(unread)} failed (a process down): {', '.join(unread[:5])}" if unread else ""
        return f"the stall guard read servers' loop watchdogs {reads} times{failed}"


def enable() -> None:
    """Registers what starts from now on (``LocalCluster`` through its ``watchers``); idempotent."""
    global _enabled
    from pathways_nb.launch import local_cluster

    with _lock:
        if _enabled:
            return
        _enabled = True
    local_cluster.watchers.append(_cluster_changed)


def watch(owner: T, source: str, read: Callable[[T], list[pb.LoopStats]]) -> None:
    """Reads ``read(owner)`` at each check while ``owner`` serves (nothing unless ``enable()`` ran). ``owner`` is
    held weakly: one that was dropped without stopping is read no more."""
    if not _enabled:
        return
    held = weakref.ref(owner)

    def read_it() -> list[pb.LoopStats]:
        alive = held()
        return read(alive) if alive is not None else []

    with _lock:
        _serving[owner] = Watched(source, read_it)


def stopping(owner: object) -> None:
    """``owner`` is about to stop: read one last time, judged at the next check."""
    with _lock:
        watched = _serving.pop(owner, None)
    if watched is not None:
        watched.stopping()
        with _lock:
            _stopped.append(watched)


def watch_server(server, source: str) -> None:
    """``watch`` for one server (a ``ChildServer``) of no cluster, which needs no token."""
    from pathways_nb.core.security import ClusterCredentials
    from pathways_nb.launch.local_cluster import loop_stats

    watch(server, source, lambda alive: [loop_stats(alive.hostport, ClusterCredentials())])


def _cluster_changed(cluster) -> None:
    """``LocalCluster.watchers``: it serves now, or is about to stop."""
    from pathways_nb.launch.processes import Status

    if cluster.status is Status.running:
        watch(cluster, f"LocalCluster at {cluster.address}", lambda alive: alive.loop_stats())
    else:
        stopping(cluster)


def check() -> list[Stall]:
    """The callback stalls over ``LONGEST_CALLBACK_S`` that ended since the last check, of everything registered
    (each serving one read now); a ``StallNotJudged`` warning for each it cannot blame on a callback."""
    now = time.time()
    with _lock:
        watched = [*_serving.values(), *_stopped]
        _stopped.clear()
    stalls: list[Stall] = []
    for one in watched:
        found, doubts = one.judge(now)
        stalls += found
        for doubt in doubts:
            warnings.warn(doubt, StallNotJudged, stacklevel=2)
    return stalls


def failure(stalls: list[Stall]) -> str:
    """What a test that saw ``stalls`` fails with."""
    return f"a server's loop ran one callback for more than {LONGEST_CALLBACK_S} s:\n" + "\n".join(map(str, stalls))
