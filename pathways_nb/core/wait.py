"""The one way pathways-nb waits for something it cannot be told about: poll a condition, with a deadline.

Launchers wait for a child's port file, a cluster's workers to register, a Slurm job to serve or
end; an operator's ``drain --wait`` for a host to empty; tests (``pathways_nb.testing.wait_until``,
this same function) for anything. Each polls what it waits for and never sleeps a fixed time in its
place. A wait that can be told (a future, an event, a stream) awaits that instead. ``poll`` and
``wait_until`` block: never call them on an event loop, where ``poll_on_loop`` is the same wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Of the last value seen, the end that a TimeoutError quotes (a log's last lines, say).
_QUOTED_CHARS = 3000


def poll(
    condition: Callable[[], T],
    timeout_s: float | None,
    *,
    holds: Callable[[T], object] = bool,
    interval_s: float = 0.05,
) -> tuple[T, bool]:
    """Calls ``condition()`` every ``interval_s`` until ``holds`` of what it returned is true, or ``timeout_s``
    has passed (None: no limit); returns the last value and whether it held.

    For a wait whose end without the condition is an answer, not an error (``pathways-nb drain --wait``);
    ``wait_until`` is the same wait that raises. An exception from ``condition`` ends the wait at once.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        value = condition()
        if holds(value):
            return value, True
        if deadline is not None and time.monotonic() >= deadline:
            return value, False
        time.sleep(interval_s)


async def poll_on_loop(
    condition: Callable[[], T],
    timeout_s: float,
    *,
    holds: Callable[[T], object] = bool,
    interval_s: float = 0.01,
) -> tuple[T, bool]:
    """``poll`` for a coroutine on an event loop: the loop serves everything else between the calls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if holds(value) or time.monotonic() >= deadline:
            return value, bool(holds(value))
        await asyncio.sleep(interval_s)


def wait_until(
    condition: Callable[[], T],
    timeout_s: float | None,
    what: str,
    *,
    holds: Callable[[T], object] = bool,
    interval_s: float = 0.05,
    timeout_error: Callable[[T], BaseException] | None = None,
) -> T:
    """Calls ``condition()`` every ``interval_s`` until ``holds`` of what it returned is true (by default:
    until it returns something true), and returns that; ``TimeoutError`` after ``timeout_s`` (None: no limit).

    The error names ``what`` was awaited and the last value seen, so a wait that failed says how far
    things got: return what was observed (a state, a list) rather than a bare bool where it helps, and
    say in ``holds`` what it must be. An exception from ``condition`` ends the wait at once (raise one to
    give up early, say when the process that was to do the thing has died). ``timeout_error``, given the
    last value seen, makes the exception raised instead (a launcher's own error, with the log it quotes).
    """
    value, held = poll(condition, timeout_s, holds=holds, interval_s=interval_s)
    if held:
        return value
    if timeout_error is not None:
        raise timeout_error(value)
    seen = repr(value)
    if len(seen) > _QUOTED_CHARS:
        seen = f"({len(seen) - _QUOTED_CHARS} characters before) ..." + seen[-_QUOTED_CHARS:]
    raise TimeoutError(f"{what}: not within {timeout_s:g} s; the last value seen: {seen}")
