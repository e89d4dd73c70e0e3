"""``proxy.loop_handoff.on_loop``: a pool thread's step runs on the loop's thread, and never hangs on a stopped loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pathways_nb.protocol.errors import InvalidRequest, Unavailable
from pathways_nb.proxy.loop_handoff import on_loop


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_the_step_runs_on_the_loops_thread_and_its_result_comes_back(loop):
    assert on_loop(loop, lambda a, b: (threading.current_thread().ident, a + b), 2, 3) == (loop._thread_id, 5)


def test_the_steps_error_is_raised_on_the_calling_thread(loop):
    def refuse():
        raise InvalidRequest("no")

    with pytest.raises(InvalidRequest, match="no"):
        on_loop(loop, refuse)


def test_a_loop_that_stopped_fails_the_step_instead_of_hanging():
    stopped = asyncio.new_event_loop()  # never runs: a proxy's loop after it stopped
    try:
        with pytest.raises(Unavailable, match="stopped"):
            on_loop(stopped, lambda: None)
    finally:
        stopped.close()
    with pytest.raises(Unavailable, match="stopped"):
        on_loop(stopped, lambda: None)  # closed
