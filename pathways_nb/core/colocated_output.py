"""What a tenant's code beside the devices writes, on its way to the tenant's notebook: the bounds and the format.

A colocated Python executor writes its Python output and logging records as
records, one JSON object a line, on a pipe to its host (``pathways-nb colocated-host``), which also reads
the executor's own stdout and stderr (what C libraries and processes it starts write there). The host
bounds them, and sends them to the worker, the worker to the proxy, the proxy to the client that made
the calls (docs/design.md, "Output beside the devices"). Both the executor and its host hold the
session's output to the same budget (``LineBudget``): the executor so that a print loop costs it
little, the host because the executor runs the tenant's code and need not keep to it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from pathways_nb.core import tuning

STDOUT, STDERR, LOG, WORKER = "stdout", "stderr", "log", "worker"


class LineBudget:
    """``rate`` lines a second, ``burst`` at once (a token bucket): what it refuses is dropped, and counted."""

    def __init__(
        self, rate: float | None = None, burst: int | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.rate = tuning.OUTPUT_RATE_LINES_S.value if rate is None else rate
        self.burst = tuning.OUTPUT_BURST_LINES.value if burst is None else burst
        self._clock = clock
        self._tokens = float(self.burst)
        self._last = clock()

    def take(self, lines: int = 1) -> int:
        """How many of ``lines`` may go now (taken from the budget); the rest are over it."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        granted = min(lines, int(self._tokens))
        self._tokens -= granted
        return granted


def cut(text: str, limit: int | None = None) -> str:
    """``text``, or its first ``limit`` characters (``tuning.OUTPUT_MAX_LINE_CHARS``) and how many more there were."""
    limit = tuning.OUTPUT_MAX_LINE_CHARS.value if limit is None else limit
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def over_budget(rate: float | None = None, burst: int | None = None) -> str:
    """Why lines were dropped at a budget (the text of a drop report)."""
    rate = tuning.OUTPUT_RATE_LINES_S.value if rate is None else rate
    burst = tuning.OUTPUT_BURST_LINES.value if burst is None else burst
    return f"over the budget of {rate:g} lines a second, {burst:,} at once"


# -- the executor's records pipe: one JSON object a line ------------------------------------------------


def line_record(
    stream: str, text: str, call: str, context: str, level: int = 0, logger: str = "", when: float | None = None
) -> bytes:
    """A line (``stream`` stdout/stderr) or a logging record (``stream`` log) the executor's code wrote."""
    record = {"stream": stream, "text": cut(text), "call": call, "context": context, "time": when or time.time()}
    if level:
        record["level"], record["logger"] = level, logger
    return _encode(record)


def dropped_record(lines: int, call: str, context: str, why: str) -> bytes:
    """``lines`` lines of ``call`` the executor dropped, and ``why``."""
    return _encode({"dropped": lines, "call": call, "context": context, "why": why})


def call_record(began: int, call: str, context: str) -> bytes:
    """A call's start: the executor's lines from now on are ``call``'s (in the client's ``context``)."""
    return _encode({"began": began, "call": call, "context": context})


def end_record(ended: int) -> bytes:
    """A call's end: everything the executor's Python wrote for call number ``ended`` is before this line."""
    return _encode({"ended": ended})


def _encode(record: dict) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode("utf-8", errors="replace") + b"\n"


# Text lines begin so (keys in the order ``line_record`` writes them): the host tells them from the
# rest (call boundaries, drop counts) without parsing the lines it drops.
LINE_PREFIX = b'{"stream": '


def read_record(line: bytes) -> dict | None:
    """A record of the executor's pipe, or None for a line that is not one (whatever its code wrote there)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def text_of(stream: str, text: str, level: int = 0, logger: str = "") -> str:
    """A line as people read it: a logging record (or a worker's line) with its level and logger, others as written."""
    if stream in (LOG, WORKER):
        return f"{logging.getLevelName(level)} {logger}: {text}"
    return text
