"""When a server learns that an execution ended: at once if XLA ran it inside its dispatch, else from a thread.

``ExecutionTimer`` (the single-process proxy's timeline) and ``FairShare`` (a worker's devices shared
by weight) follow every execution to its end. XLA's CPU client runs a small program inside its
dispatch, and then nothing needs to wake for it; a program still running when it is dispatched is
followed by a thread, and every later one waits behind it, so events keep the dispatch order.
Real jax arrays of this process's CPU device are the outputs followed.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pathways_nb.core.events import ExecutionTimer
from pathways_nb.worker.share import FairShare


@pytest.fixture(scope="module")
def programs():
    """A program XLA runs inside its dispatch, and one that is still running when dispatched (~0.1-1 s)."""
    tiny = jax.jit(lambda a: a * 2 + 1)
    slow = jax.jit(lambda a: jnp.tanh(jnp.linalg.matrix_power(a, 8)).sum())
    # On this process's own CPU device: an earlier test may have connected it to a proxy (the default then).
    cpu = jax.devices("cpu")[0]
    small = jax.device_put(np.float32(3), cpu)
    big = jax.device_put(np.ones((512, 512), np.float32) / 512, cpu)
    tiny(small).block_until_ready()
    slow(big).block_until_ready()
    assert tiny(small).is_ready(), "XLA's CPU client no longer runs small programs inside the dispatch"
    return (lambda: tiny(small)), (lambda: slow(big))


class Events:
    """A sink that remembers what it got and on which thread."""

    def __init__(self) -> None:
        self.got: list = []
        self.arrived = threading.Condition()

    def __call__(self, recorded) -> None:
        with self.arrived:
            self.got.append((recorded, threading.get_ident()))
            self.arrived.notify_all()

    def wait_for(self, count: int) -> list:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.got) >= count, timeout=60), self.got
            return [recorded for recorded, _thread in self.got]


def test_the_timer_records_an_execution_that_ended_in_its_dispatch_at_once(programs):
    tiny, _slow = programs
    timer, events = ExecutionTimer(), Events()
    timer.watch("tiny", [0], [tiny()], 0.0, events)
    ((recorded, thread),) = events.got  # before watch returned: no thread woke for it
    assert thread == threading.get_ident() and recorded.kind == "execute" and recorded.start <= recorded.end


def test_the_timer_keeps_the_dispatch_order_behind_a_running_execution(programs):
    tiny, slow = programs
    timer, events = ExecutionTimer(), Events()
    running = slow()
    assert not running.is_ready(), "the slow program ended inside its dispatch; make it slower"
    timer.watch("slow", [0], [running], 0.0, events)
    timer.watch("tiny", [0], [tiny()], 0.0, events)  # ready, but an older one is still followed
    slow_event, tiny_event = events.wait_for(2)
    assert [slow_event.name, tiny_event.name] == ["slow", "tiny"]
    assert tiny_event.start >= slow_event.end  # its busy interval starts where the older one's ended


def test_fair_share_finishes_a_program_that_ended_in_its_dispatch_at_once(programs):
    tiny, _slow = programs
    share = FairShare()
    finished = []
    share.submit("a", 1.0, lambda: [tiny()], [0], lambda start, end, failed: finished.append(threading.get_ident()))
    assert finished == [threading.get_ident()] and share.device_seconds()["a"] >= 0


def test_fair_share_follows_a_running_program_and_finishes_later_ones_behind_it(programs):
    tiny, slow = programs
    share, events = FairShare(), Events()

    def report(name):
        return lambda start, end, failed: events((name, start, end))

    share.submit("a", 1.0, lambda: [slow()], [0], report("slow"))
    share.submit("a", 1.0, lambda: [tiny()], [0], report("tiny"))
    (slow_name, _, slow_end), (tiny_name, tiny_start, _) = events.wait_for(2)
    assert (slow_name, tiny_name) == ("slow", "tiny") and tiny_start >= slow_end
    assert all(thread != threading.get_ident() for _recorded, thread in events.got)


def test_programs_that_wait_for_their_turn_are_started_by_the_following_thread(programs):
    """Not by whoever submits: a caller may hold its session's lock, another tenant's dispatch takes its own."""
    tiny, slow = programs
    share, started = FairShare(), []

    def dispatch(run, name):
        def go():
            started.append((name, threading.get_ident()))
            return [run()]

        return go

    share.submit("a", 1.0, dispatch(slow, "a: slow"), [0])
    share.submit("b", 1.0, dispatch(tiny, "b: waits for its turn"), [0])  # saturated: pending
    events = Events()
    share.submit("a", 1.0, dispatch(tiny, "a: tiny"), [0], lambda start, end, failed: events(end))
    events.wait_for(1)
    assert dict(started)["b: waits for its turn"] != threading.get_ident()
    np.testing.assert_equal(sorted(name for name, _ in started), ["a: slow", "a: tiny", "b: waits for its turn"])


def test_a_tenant_alone_gets_at_most_alone_depth_ahead_so_one_that_comes_back_waits_behind_no_more(programs):
    """An island's share (``alone_depth``): a tenant that returns waits behind a few steps, not a whole queue."""
    _tiny, slow = programs
    share, started, events = FairShare(alone_depth=2), [], Events()

    def dispatch(name):
        def go():
            started.append(name)
            return [slow()]

        return go

    def ended(name):
        return lambda start, end, failed: events(name)

    for index in range(6):
        share.submit("busy", 1.0, dispatch(f"busy {index}"), [0], ended(f"busy {index}"))
    assert started == ["busy 0", "busy 1"]  # alone, yet only two ahead
    share.submit("back", 1.0, dispatch("back"), [0], ended("back"))
    events.wait_for(7)  # (all of them: no thread may be inside XLA when the interpreter exits)
    assert started.index("back") <= 3, started  # behind the two in flight (and at most one chosen meanwhile)
