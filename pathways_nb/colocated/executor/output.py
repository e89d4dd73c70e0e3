"""The executor's output, tagged with the call it belongs to, for its host (``core.colocated_output``).

``capture`` makes ``sys.stdout``, ``sys.stderr`` and the root logger write records on the pipe the
host gave the executor (``--output_fd``): each line with its stream, each logging record with its
level and logger, and with the call that wrote it: the call running on the thread that wrote it, or,
on a thread a call started (a prefetching iterator, say), the call that started it; else the latest
call. Lines over the budget are dropped here, where a print loop costs least, and counted; the
counts go to the host as a call ends, and before the next line that goes. What bypasses Python's
streams (``os.write(1, ...)``, C libraries, processes the code starts) reaches the host on the
executor's own stdout and stderr, which the host reads and bounds too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import NamedTuple

from pathways_nb.core import colocated_output, tuning
from pathways_nb.core.colocated_output import LineBudget

# A partial line's pieces are joined, to check its length, once there are this many, or one this long.
_PIECES = 64
_LONG = 1024


class Call(NamedTuple):
    """A call of the session: the worker's number for it, the function's name, the client's output context."""

    number: int = 0
    name: str = ""
    context: str = ""


class OutputChannel:
    """Records for the host, written on the pipe ``fd``, within ``budget`` (thread-safe)."""

    def __init__(self, fd: int, budget: LineBudget | None = None):
        self._fd = fd
        self._budget = budget or LineBudget()
        self._lock = threading.Lock()
        self._dropped: dict[Call, int] = {}
        # The call each thread writes for (by thread id): a call's own thread while it runs, and the threads
        # it started; other threads write for the latest call.
        self._threads: dict[int, Call] = {}
        self._latest = Call()
        self._streams: list[LineStream] = []
        self._broken = False

    def current(self) -> Call:
        """The call whose output this thread writes (see the module's docstring)."""
        return self._threads.get(threading.get_ident()) or self._latest

    @contextlib.contextmanager
    def writes_for(self, call: Call) -> Iterator[None]:
        """This thread (one that ``call``'s code started) writes for ``call`` meanwhile."""
        thread = threading.get_ident()
        self._threads[thread] = call
        try:
            yield
        finally:
            self._threads.pop(thread, None)

    @contextlib.contextmanager
    def call(self, number: int, name: str, context: str) -> Iterator[None]:
        """Runs a call: what this thread writes meanwhile is the call's; its end tells the host it wrote all
        (the counts of lines dropped so far included)."""
        self._latest = Call(number, name, context)
        self._write(colocated_output.call_record(number, name, context))
        try:
            with self.writes_for(self._latest):
                yield
                for stream in self._streams:
                    stream.flush_line()
        finally:
            with self._lock:
                dropped, self._dropped = self._dropped, {}
            for over, count in dropped.items():
                self._write(colocated_output.dropped_record(count, over.name, over.context, self._why()))
            self._write(colocated_output.end_record(number))

    def line(self, stream: str, text: str, level: int = 0, logger: str = "") -> None:
        """One line (or logging record) of the current call."""
        self.lines(stream, [text], level, logger)

    def lines(self, stream: str, texts: list[str], level: int = 0, logger: str = "") -> None:
        """Lines of the current call; those over the budget are counted (cheaply: a print loop spends most of
        its lines here), and reported before the next lines that go, or as the call ends."""
        call = self.current()
        with self._lock:
            granted = self._budget.take(len(texts))
            earlier = {}
            if granted:
                earlier, self._dropped = self._dropped, {}
            if granted < len(texts):
                self._dropped[call] = self._dropped.get(call, 0) + len(texts) - granted
        for over, count in earlier.items():
            self._write(colocated_output.dropped_record(count, over.name, over.context, self._why()))
        for text in texts[:granted]:
            self._write(colocated_output.line_record(stream, text, call.name, call.context, level, logger))

    def _why(self) -> str:
        return colocated_output.over_budget(self._budget.rate, self._budget.burst)

    def _write(self, record: bytes) -> None:
        """Writes one record whole, under the lock: the host reads lines, and two threads' records must not mix.

        A pipe the host no longer reads (it is stopping this executor) takes nothing more, silently:
        the user's ``print`` must not fail for it.
        """
        with self._lock:
            view = memoryview(record)
            try:
                while view and not self._broken:
                    view = view[os.write(self._fd, view) :]
            except OSError:
                self._broken = True

    def adopt(self, stream: LineStream) -> None:
        self._streams.append(stream)


class LineStream(io.TextIOBase):
    """A text stream whose lines become records of ``name`` (stdout or stderr).

    Each thread's partial line waits for its end apart: lines of two threads never mix.
    """

    def __init__(self, channel: OutputChannel, name: str, original):
        super().__init__()
        self._channel = channel
        self._name = name
        self._original = original
        self._partials = threading.local()
        channel.adopt(self)

    @property
    def name(self) -> str:
        return f"<{self._name}>"

    @property
    def encoding(self) -> str:
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        """The executor's own descriptor (what writes there goes to the host untagged, as C libraries' output does)."""
        return self._original.fileno()

    def write(self, text: str) -> int:
        """Keeps this thread's partial line; hands complete lines to the channel (``print`` writes each piece apart)."""
        ends_a_line = "\n" in text  # (a TypeError for what is not text, as from any text stream)
        try:
            partial = self._partials.pieces
        except AttributeError:
            partial = self._partials.pieces = []
        partial.append(text)
        if ends_a_line:
            lines = "".join(partial).split("\n")
            partial.clear()
            if lines[-1]:
                partial.append(lines[-1])
            self._channel.lines(self._name, lines[:-1])
        elif len(text) >= _LONG or len(partial) >= _PIECES:
            joined = "".join(partial)
            partial.clear()
            if len(joined) > tuning.OUTPUT_MAX_LINE_CHARS.value:  # no newline in sight: a line anyway
                self._channel.lines(self._name, [joined])
            else:
                partial.append(joined)
        return len(text)

    def flush_line(self) -> None:
        """Sends this thread's partial line as it is (its call ended)."""
        partial = getattr(self._partials, "pieces", None)
        if partial:
            line = "".join(partial)
            partial.clear()
            self._channel.lines(self._name, [line])


class RecordHandler(logging.Handler):
    """Logging records as records of the host's pipe: level, logger, message (with its traceback)."""

    def __init__(self, channel: OutputChannel):
        super().__init__()
        self._channel = channel
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.line(colocated_output.LOG, self.format(record), record.levelno, record.name)
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise into the caller
            self.handleError(record)


def capture(channel: OutputChannel) -> None:
    """Points this process's Python output at ``channel``: streams, root logger, and threads calls start."""
    sys.stdout = LineStream(channel, colocated_output.STDOUT, sys.__stdout__)
    sys.stderr = LineStream(channel, colocated_output.STDERR, sys.__stderr__)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(RecordHandler(channel))
    root.setLevel(logging.WARNING)
    start = threading.Thread.start

    def start_for_the_current_call(thread: threading.Thread, *args, **kwargs):
        call, run = channel.current(), thread.run

        def run_for_the_call() -> None:
            with channel.writes_for(call):
                run()

        thread.run = run_for_the_call
        return start(thread, *args, **kwargs)

    threading.Thread.start = start_for_the_current_call
