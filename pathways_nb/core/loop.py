"""A server's event loop: handing work to it from other threads, timers, and the watchdog that proves it never waits.

Every server (proxy, resource manager, worker, colocated host) serves on one asyncio loop, and the
rule is that nothing on it waits: a blocking call, a lock held by another thread, a long
computation stall every client of that server at once. Work that waits runs on a pool, and its
result comes back to the loop with ``call_on``; nothing holds a lock across the two.

``LoopWatchdog`` is the proof, as dask's tick monitor is: the loop stamps a tick every
``tuning.LOOP_TICK_S``; a thread of the watchdog's own notices when no tick came for
``tuning.LOOP_STALL_S``, captures where the loop's thread is (its Python stack) and logs it once, and
the late tick records the stall, how long it was, and whether the thread was running a callback
(what the rule forbids: its stack was in one, or it spent the stall computing) or waiting for
events, or for a CPU to wait on (a busy machine, not a bug). A callback's frames lie deeper than
the loop's own: the watchdog measures how deep a callback starts (its first tick is one), and a
stack shallower than that is the loop's own code. uvloop's loop is C, so waiting there leaves no
frame of a selector to see, only the thread's entry; asyncio's waits in ``selectors.py``. When the
watchdog's own thread did not get to look (the whole process stalled: a fork, a long call that
holds the GIL), the loop thread's CPU time over the stall tells which. Where the kernel says how
long the loop's thread waited in its run queue (Linux's ``schedstat``), a stall it spent mostly
there is the machine's, whatever the stack shows: on a loaded machine a thread caught entering a
callback is waiting for a core, not blocked in it, and a callback that really blocks sleeps instead.
Callback stalls are kept apart from the others, so that longer waits for a CPU never push them out
of the stats. Servers answer ``Diagnostics.GetLoopStats`` with the counts, which tests and
benchmarks read.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import uvloop

from pathways_nb.core import tuning
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

# Stalls kept for the stats, of each kind (in callbacks, not), the longest first.
_KEPT_STALLS = 8
# Frames of the loop's thread named in a stall's ``where``.
_WHERE_FRAMES = 6


def _depth(frame) -> int:
    """How many frames deep ``frame`` is on its thread's stack."""
    depth = 0
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop for a server to run on its own thread: uvloop's (libuv), unless ``PATHWAYS_EVENT_LOOP=asyncio``
    (``tuning.EVENT_LOOP``) asks for asyncio's own.

    A server's loop mostly turns over gRPC's completions and its own timers, a few callbacks each,
    and uvloop schedules them in C where asyncio does it in Python. Measured on 2 cores (issue 35,
    alternating runs of a cluster's chain of 1.2 ms steps): the proxy's loop thread spent 322-347 µs
    per step instead of 364-384, the worker's 146-163 instead of 171-178. A single-process proxy's
    chained tiny programs cost its loop the same either way (243-249 µs each): there gRPC's own work
    is nearly all of it.
    """
    if tuning.EVENT_LOOP.value == "asyncio":
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """Which event loop ``loop`` is, as ``tuning.EVENT_LOOP`` names them: "uvloop" or "asyncio"."""
    return "uvloop" if isinstance(loop, uvloop.Loop) else "asyncio"


def on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread is the one running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def call_on(loop: asyncio.AbstractEventLoop, function: Callable[..., Any], *args: Any) -> None:
    """Runs ``function(*args)`` on ``loop``: now if this is its thread, else as soon as it turns.

    A closed loop (the process is stopping) drops it.
    """
    if on_loop_thread(loop):
        function(*args)
        return
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:
        _LOGGER.debug("the loop is closed; dropped %r", function)


class Later:
    """A call scheduled on a loop from any thread; ``cancel()`` from any thread before it runs and it never does."""

    __slots__ = ("_cancelled", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float, function: Callable[[], None]):
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._cancelled = False
        call_on(loop, self._schedule, delay_s, function)

    def _schedule(self, delay_s: float, function: Callable[[], None]) -> None:
        if not self._cancelled:
            self._handle = self._loop.call_later(delay_s, function)

    def cancel(self) -> None:
        self._cancelled = True
        call_on(self._loop, self._cancel_handle)

    def _cancel_handle(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class LoopWatchdog:
    """Notices, logs and counts the times ``loop`` does not turn for ``tuning.LOOP_STALL_S``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, process: str):
        self.process = process
        self._loop = loop
        self._tick_s = tuning.LOOP_TICK_S.value
        self._stall_s = tuning.LOOP_STALL_S.value
        self._started = time.monotonic()
        self._last_tick = self._started
        self._last_cpu = 0.0  # the loop thread's CPU time at its last tick
        self._last_queued = 0.0  # how long the loop thread had waited in the run queue at its last tick (s)
        self._schedstat: str | None = None  # where the kernel counts that, if it does
        self._loop_thread: int | None = None
        self._callback_depth = 0  # the depth of the loop thread's stack in a callback (its first tick's)
        self._seen: tuple[float, str, bool] | None = None  # the stall under way: (its last tick, where, in a callback)
        self._lock = threading.Lock()  # guards the counts below (the loop writes them, any thread reads them)
        self._stalls = 0
        self._in_callbacks = 0
        self._total_s = 0.0
        self._longest_callback_s = 0.0
        # Min-heaps of (seconds, ended, in_callback, where): stalls in callbacks, and the others.
        self._longest: dict[bool, list[tuple[float, float, bool, str]]] = {True: [], False: []}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"pathways-watchdog-{process}", daemon=True)

    def start(self) -> None:
        """Starts watching (from any thread, once the loop runs)."""
        self._loop.call_soon_threadsafe(self._first_tick)  # a callback of its own, even from the loop's thread
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- on the loop ---------------------------------------------------------------------------

    def _first_tick(self) -> None:
        self._loop_thread = threading.get_ident()
        self._callback_depth = _depth(sys._getframe())
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._last_queued = self._queued_s()
        self._tick()

    def _queued_s(self) -> float:
        """How long the loop's thread has waited for a CPU in all (s); 0 where the kernel does not say."""
        if self._schedstat is None:
            return 0.0
        try:
            with open(self._schedstat) as counts:
                return int(counts.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            self._schedstat = None
            return 0.0

    def _tick(self) -> None:
        now, cpu, queued = time.monotonic(), time.thread_time(), self._queued_s()
        late_s = now - self._last_tick - self._tick_s
        if late_s >= self._stall_s:
            self._record(late_s, (cpu - self._last_cpu) > late_s / 2, (queued - self._last_queued) > late_s / 2)
        self._last_tick, self._last_cpu, self._last_queued = now, cpu, queued
        if not self._stopped.is_set():
            self._loop.call_later(self._tick_s, self._tick)

    def _record(self, seconds: float, computing: bool, starved: bool = False) -> None:
        """A stall of ``seconds``; ``computing``: the loop's thread was busy on a CPU for most of it; ``starved``:
        it waited in the run queue for most of it (the machine's load, not the loop's doing)."""
        seen = self._seen
        self._seen = None
        if seen is not None:
            where, in_callback = seen[1], seen[2] or computing
        else:
            where, in_callback = "(not seen: the watchdog's thread stalled too)", computing
        if starved:
            where, in_callback = f"(waiting for a CPU for most of it) {where}", False
        ended = time.time()
        with self._lock:
            self._stalls += 1
            self._total_s += seconds
            if in_callback:
                self._in_callbacks += 1
                self._longest_callback_s = max(self._longest_callback_s, seconds)
            entry, kept = (seconds, ended, in_callback, where), self._longest[in_callback]
            if len(kept) < _KEPT_STALLS:
                heapq.heappush(kept, entry)
            else:
                heapq.heappushpop(kept, entry)
        level = logging.WARNING if in_callback else logging.INFO
        _LOGGER.log(level, "%s: the event loop did not turn for %.2f s; it was in:\n%s", self.process, seconds, where)

    # -- the watchdog's own thread --------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopped.wait(self._tick_s):
            last = self._last_tick
            if time.monotonic() - last < self._stall_s or (self._seen is not None and self._seen[0] == last):
                continue
            where, in_callback = self.where()
            self._seen = (last, where, in_callback)

    def where(self) -> tuple[str, bool]:
        """The loop thread's innermost frames, and whether it is running a callback (not waiting for events)."""
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        if frame is None or not self._callback_depth:
            return "(the loop's thread is not running Python)", True
        frames = traceback.extract_stack(frame)[-_WHERE_FRAMES:]
        innermost = frames[-1] if frames else None
        in_selector = innermost is not None and innermost.filename.endswith("selectors.py")
        waiting = in_selector or _depth(frame) < self._callback_depth
        return "".join(traceback.format_list(frames)).rstrip(), not waiting

    # -- what tests and benchmarks read ------------------------------------------------------------

    def stats(self) -> pb.LoopStats:
        with self._lock:
            longest = sorted([*self._longest[True], *self._longest[False]], reverse=True)
            stats = pb.LoopStats(
                process=self.process,
                event_loop=loop_kind(self._loop),
                watched_s=time.monotonic() - self._started,
                stalls=self._stalls,
                stalls_in_callbacks=self._in_callbacks,
                total_stall_s=self._total_s,
                longest_callback_stall_s=self._longest_callback_s,
            )
        for seconds, ended, in_callback, where in longest:
            stats.longest.add(seconds=seconds, ended=ended, in_callback=in_callback, where=where)
        stats.longest_stall_s = max((s.seconds for s in stats.longest), default=0.0)
        return stats
