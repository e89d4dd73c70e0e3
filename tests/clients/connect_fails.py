"""Connects to argv[1] with a time-out of argv[2] seconds, where that fails.

Prints how many seconds the failure took (to a tenth) and its message. jax is imported first, so
that the clock times the connect, not a slow import.
"""

import sys
import time

import jax  # noqa: F401 - imported before the clock starts

import pathways_nb

started = time.monotonic()
try:
    pathways_nb.connect(sys.argv[1], timeout_s=float(sys.argv[2]))
except pathways_nb.ConnectionFailed as error:
    print(round(time.monotonic() - started, 1), error)
