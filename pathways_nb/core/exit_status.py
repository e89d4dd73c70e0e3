"""How a child process ended, in words (for the logs and errors of whoever watched it)."""

from __future__ import annotations

import signal


def exit_description(returncode: int | None) -> str:
    """``killed by signal SIGSEGV``, ``exited with status 1`` or ``still running``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"
