"""How a pool thread of the proxy has the event loop change state for it: ``on_loop`` runs a step there and waits.

The proxy's session state (its streams to workers, its devices and placement, the cluster's view and
programs) is the event loop's alone. Work that must wait (for a worker's reply, a group of islands to
form, bytes to copy) runs on the proxy's pools; each of its steps that reads or changes that state is
handed to the loop with ``on_loop`` (dask's ``sync`` the other way round): the pool thread waits, the
loop never does. A function that calls ``on_loop`` is a blocking call, for pool threads only: on the
loop it would wait for itself (the loop watchdog names such a stall).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from pathways_nb.core.dataflow import Pending, fulfil
from pathways_nb.protocol.errors import Unavailable

T = TypeVar("T")

# How often a pool thread whose step has not run yet looks whether the loop still runs (it stops with the proxy).
_STOPPED_CHECK_S = 1.0


def on_loop(loop: asyncio.AbstractEventLoop, step: Callable[..., T], *args: Any) -> T:
    """``step(*args)``, run on ``loop`` (never at once: always in a turn of its own); blocks until it ran.

    Raises what ``step`` raised (as a ``RequestError``), or UNAVAILABLE if the loop stops first (the proxy stopped).
    """
    done = Pending()
    try:
        loop.call_soon_threadsafe(fulfil, done, lambda: step(*args))
    except RuntimeError:  # the loop is closed
        raise _stopped() from None
    while True:
        try:
            return done.wait(_STOPPED_CHECK_S)
        except TimeoutError:
            if not loop.is_running():
                raise _stopped() from None


def _stopped() -> Unavailable:
    return Unavailable("the proxy stopped before this work could go on")
