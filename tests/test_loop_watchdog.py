"""The loop watchdog tells a callback that holds the loop from a loop that waits for events, on uvloop and asyncio.

A server's loop runs on a thread of its own (``loop.run_forever`` as the thread's target, as
``core.aio_server`` runs it). uvloop's loop is C: waiting for events leaves only the thread's entry on
its stack, where asyncio's waits in ``selectors.py``. A stall while the loop waits (a busy machine gave its
thread no CPU) is not a server's fault; a callback that blocks is, and must be named.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from pathways_nb.core import loop as server_loop
from pathways_nb.core import tuning
from pathways_nb.core.loop import LoopWatchdog
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import wait_until

BLOCKED_S = 0.6  # longer than tuning's loop_stall_s (0.25 s)


@pytest.fixture(params=["uvloop", "asyncio"])
def watched(request) -> Iterator[tuple[asyncio.AbstractEventLoop, LoopWatchdog]]:
    with tuning.EVENT_LOOP.overridden(request.param):
        loop = server_loop.new_event_loop()
    assert server_loop.loop_kind(loop) == request.param
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    watchdog = LoopWatchdog(loop, f"test-{request.param}")
    watchdog.start()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)  # the first tick has run
    yield loop, watchdog
    watchdog.stop()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_loop_that_waits_for_events_is_not_in_a_callback(watched):
    _loop, watchdog = watched
    seen = [watchdog.where() for _ in range(20)]  # between ticks (every 50 ms) it waits
    assert any(not in_callback for _where, in_callback in seen), seen


def test_a_callback_that_blocks_is_seen_and_counted_with_its_frames(watched):
    loop, watchdog = watched
    released = threading.Event()

    def blocks_the_loop() -> None:
        released.wait(BLOCKED_S * 5)  # what the loop discipline forbids

    loop.call_soon_threadsafe(blocks_the_loop)
    where, _ = wait_until(watchdog.where, 10, "the loop in the callback", holds=lambda seen: seen[1])
    assert "blocks_the_loop" in where, where
    threading.Timer(BLOCKED_S, released.set).start()
    stats = wait_until(watchdog.stats, 10, "the stall recorded", holds=lambda s: s.stalls_in_callbacks >= 1)
    (stall,) = [s for s in stats.longest if s.in_callback]
    assert stall.seconds >= BLOCKED_S - 0.1 and "blocks_the_loop" in stall.where, stall


@pytest.mark.parametrize(("variable", "kind"), [(None, "uvloop"), ("asyncio", "asyncio")])
def test_every_server_runs_the_event_loop_its_environment_names(variable, kind, monkeypatch):
    """``PATHWAYS_EVENT_LOOP`` (``tuning.EVENT_LOOP``) chooses each server's loop, uvloop unless it says asyncio:
    every process of a cluster started with it says which loop its watchdog watches."""
    if variable is None:
        monkeypatch.delenv(tuning.EVENT_LOOP.env_var, raising=False)
    else:
        monkeypatch.setenv(tuning.EVENT_LOOP.env_var, variable)
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
        loops = {stats.process: stats.event_loop for stats in cluster.loop_stats()}
    assert len(loops) == 3 and set(loops.values()) == {kind}, loops  # the resource manager, the proxy, the worker


def test_a_switch_refuses_a_word_it_does_not_know(monkeypatch):
    monkeypatch.setenv(tuning.EVENT_LOOP.env_var, "tokio")
    unread = tuning.Setting(tuning.EVENT_LOOP.name, "uvloop", "", tuning.EVENT_LOOP.choices)  # (not read yet)
    with pytest.raises(ValueError, match="PATHWAYS_EVENT_LOOP='tokio' is not one of uvloop, asyncio"):
        _ = unread.value


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time spinner needs root (CAP_SYS_NICE)")
def test_a_loop_thread_given_no_cpu_is_counted_as_waiting_for_one_not_as_a_callback(watched):
    """On a loaded machine the loop's thread can be caught anywhere, a callback's first line too, while it waits
    for a core: the kernel's count of its time in the run queue says so, and such a stall fails no test.

    A real-time process spins on the loop thread's one core for a while and then ends by itself: the loop's
    thread, runnable, waits in the run queue (all but the kernel's 5% that real-time work leaves to the rest)."""
    loop, watchdog = watched
    native = asyncio.run_coroutine_threadsafe(_native_id(), loop).result(10)
    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", SPIN_FOR_A_WHILE])
    try:
        os.sched_setaffinity(spinner.pid, {core})
        os.sched_setaffinity(native, {core})
        os.sched_setscheduler(spinner.pid, os.SCHED_FIFO, os.sched_param(1))
        loop.call_soon_threadsafe(lambda: None)  # something for it to do
        assert spinner.wait(60) == 0
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(native, os.sched_getaffinity(0))
    stats = wait_until(watchdog.stats, 30, "a stall recorded", holds=lambda s: s.stalls >= 1)
    assert stats.stalls_in_callbacks == 0, stats
    assert any("waiting for a CPU" in stall.where for stall in stats.longest), stats


# Keeps a core busy for 1.5 s, then ends.
SPIN_FOR_A_WHILE = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end:\n    pass\n"


async def _native_id() -> int:
    return threading.get_native_id()
