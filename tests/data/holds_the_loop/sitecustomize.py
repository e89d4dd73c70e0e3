"""Makes every server of a process started with this directory on ``PYTHONPATH`` run one callback that holds its
loop for ``PATHWAYS_TEST_HOLD_LOOP_S`` seconds, ``PATHWAYS_TEST_HOLD_LOOP_AFTER_S`` (default 0.5) after it serves:
the fault the stall guard must catch (tests/test_stall_guard.py). Python imports ``sitecustomize`` at start-up,
before the server's own code."""

import os
import threading

from pathways_nb.core import aio_server

_HOLD_S = float(os.environ.get("PATHWAYS_TEST_HOLD_LOOP_S", "0.8"))
_AFTER_S = float(os.environ.get("PATHWAYS_TEST_HOLD_LOOP_AFTER_S", "0.5"))
_serve = aio_server.BackgroundServer.__init__


def holds_the_loop() -> None:
    """What the loop discipline forbids: a callback that waits."""
    threading.Event().wait(_HOLD_S)


def _serves_then_holds_its_loop(server, *args, **kwargs) -> None:
    _serve(server, *args, **kwargs)
    server.loop.call_soon_threadsafe(server.loop.call_later, _AFTER_S, holds_the_loop)


aio_server.BackgroundServer.__init__ = _serves_then_holds_its_loop
