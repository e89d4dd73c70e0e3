"""The stock client's batch flusher runs only on cores that nothing else wants.

jaxlib's IFRT proxy client sends batched array deletions from a thread of its
own (``RpcHelper::Batcher::PeriodicFlusher``) that sleeps 50 µs between looks:
about 9,000 wake-ups a second and 13% of a core for as long as the client
lives, busy or not. Where the client shares its machine with the devices (an
embedded cluster of CPU devices, a notebook on a GPU host) that is compute
taken from every step: a chain of 12 ms steps ran at 0.90 of local JAX, and
local JAX itself, in the connected process, lost as much.

That thread is given Linux's ``SCHED_IDLE`` policy, under which it runs only
when a core is otherwise idle. Where the process may (``CAP_SYS_NICE``: root
outside a container, or a container given it), its sleeps also get 2 ms of
timer slack, so the kernel wakes it about 500 times a second instead of 9,000:
on an idle core it still cost 0.11 cores, taken from the control plane's core
beside the devices (per 3 ms step, 0.53 ms of the client's CPU before, 0.18 ms
after). Nothing waits on it: every other request the client sends flushes the batch first, so
a deletion waits at most until the next request or ~2 ms. It is found by what
it does (a thread the connection started that wakes thousands of times a
second), not by name: the client's threads have none. ``PATHWAYS_BATCH_FLUSHER=stock``
(``tuning.BATCH_FLUSHER``) leaves it as the stock client made it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from pathways_nb.core import tuning

_LOGGER = logging.getLogger(__name__)

_TASKS = "/proc/self/task"
# The flusher wakes ~9,000 times a second; the client's other threads, idle, a few times at most.
BUSY_WAKEUPS_PER_S = 2000
WATCH_S = 0.05
# How late the flusher's 50 µs sleeps may end (where the process may set it).
TIMER_SLACK_NS = 2_000_000


@contextlib.contextmanager
def demoting_new_flusher() -> Iterator[None]:
    """Around the stock client's start: demotes the busy thread it started (``demote_busy_new_threads``),
    unless ``tuning.BATCH_FLUSHER`` says to leave it alone."""
    if tuning.BATCH_FLUSHER.value != "idle":
        yield
        return
    before = thread_ids()
    yield
    demote_busy_new_threads(before)


def thread_ids() -> set[int]:
    """This process's threads (Linux); empty where ``/proc`` does not list them."""
    try:
        return {int(name) for name in os.listdir(_TASKS)}
    except OSError:
        return set()


def demote_busy_new_threads(before: set[int]) -> list[int]:
    """Gives ``SCHED_IDLE`` (and ``TIMER_SLACK_NS``, where allowed) to the threads not in ``before`` that
    wake more than ``BUSY_WAKEUPS_PER_S``.

    Returns the ids of those it demoted; none where the platform has no ``SCHED_IDLE`` (not Linux).
    """
    if not hasattr(os, "SCHED_IDLE"):
        return []
    new = thread_ids() - before
    if not new:  # none started, or no /proc to tell
        return []
    first = {tid: _wakeups(tid) for tid in new}
    time.sleep(WATCH_S)
    busy = [
        tid
        for tid, count in first.items()
        if count is not None and (_wakeups(tid) or 0) - count > BUSY_WAKEUPS_PER_S * WATCH_S
    ]
    demoted = []
    for tid in busy:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            demoted.append(tid)
        except OSError as e:  # the thread ended, or a sandbox forbids it: the client works as before
            _LOGGER.debug("thread %d keeps its scheduling policy: %s", tid, e)
            continue
        _widen_timer_slack(tid)
    return demoted


def _widen_timer_slack(tid: int) -> None:
    """Lets the kernel end thread ``tid``'s sleeps up to ``TIMER_SLACK_NS`` late (Linux 4.6+; another
    thread's slack needs ``CAP_SYS_NICE``, and without it the thread keeps its 50 µs sleeps)."""
    try:
        with open(f"/proc/{tid}/timerslack_ns", "w") as slack:
            slack.write(str(TIMER_SLACK_NS))
    except OSError as e:
        _LOGGER.debug("thread %d keeps its timer slack: %s", tid, e)


def _wakeups(tid: int) -> int | None:
    """How often thread ``tid`` has gone to sleep of its own accord (its voluntary context switches)."""
    try:
        with open(f"{_TASKS}/{tid}/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
