"""What this process's code beside the devices prints, printed here: colocated Python's output.

A connection to a cluster that runs colocated Python follows its own output (``Observe.WatchOutput``,
which only its tenant and per-connection secret can read) on a thread, and prints each line as it
comes, tagged with where it ran: ``[island 0 host 1] ...``; stdout lines on stdout, the rest (stderr,
logging records with their level and logger, counts of lines dropped over the bounds) on stderr. In
a notebook, ``pathways_nb.notebook.cell_output`` prints each line under the cell whose call wrote
it, and flushes what a cell's calls wrote as the cell ends (the notebook layer gives this module its
printer, ``print_with``: the client imports no notebook code); elsewhere lines go to ``sys.stdout`` and
``sys.stderr`` as they come. Lines come numbered: the follower and a flush never print one twice,
and a gap in the numbers (lines the proxy no longer held) is reported as dropped lines.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

import grpc

from pathways_nb.core import colocated_output, tuning
from pathways_nb.errors import PathwaysError
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


class Printer(Protocol):
    """Where lines are printed: ``text`` (whole lines) on stream ``name`` for the calls of ``context``."""

    def write(self, context: str, name: str, text: str) -> None: ...

    def close(self) -> None:
        """The connection ended: nothing more comes."""


class StreamPrinter:
    """This process's ``sys.stdout`` and ``sys.stderr``, whatever the context."""

    def write(self, context: str, name: str, text: str) -> None:
        stream = sys.stdout if name == colocated_output.STDOUT else sys.stderr
        stream.write(text)
        stream.flush()

    def close(self) -> None:
        """Nothing to let go of: the streams are the process's."""


def place(line: pb.OutputLine) -> str:
    return f"island {line.island} host {line.host_index}"


def format_line(line: pb.OutputLine) -> tuple[str, str]:
    """``(stream name, text)`` of a line as printed here: each of its lines tagged with where it ran."""
    if line.dropped:
        return colocated_output.STDERR, f"{line.dropped:,} lines dropped on {place(line)} ({line.text})\n"
    text = colocated_output.text_of(line.stream, line.text, line.level, line.logger)
    name = colocated_output.STDOUT if line.stream == colocated_output.STDOUT else colocated_output.STDERR
    return name, "".join(f"[{place(line)}] {part}\n" for part in text.split("\n"))


def format_lines(lines: Iterable[pb.OutputLine]) -> str:
    """Lines as text, as ``%pathways logs`` shows them."""
    return "".join(format_line(line)[1] for line in lines)


class RemoteOutput:
    """One connection's output from beside the devices, printed by ``printer`` (see the module's docstring).

    ``context``: what the connection's calls are tagged with now (``switch``).
    """

    def __init__(self, observer, tenant: str, secret: str, printer: Printer | None = None):
        self._observer = observer
        self._tenant = tenant
        self._secret = secret
        self.printer: Printer = printer or StreamPrinter()
        self.context = ""
        self.printed = 0  # the number of the latest line printed
        self._lock = threading.Lock()
        self._stream = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Follows the connection's output on a thread, from its first line."""
        self._stream = self._observer.watch_output(self._tenant, self._secret, self.printed)
        self._thread = threading.Thread(target=self._follow, args=(self._stream,), name="pathways-output", daemon=True)
        self._thread.start()

    def _follow(self, stream) -> None:
        try:
            for lines in stream:
                self.show(lines)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                _LOGGER.info("following the output of colocated Python ended: %s", error.details())

    def show(self, lines: pb.OutputLines) -> None:
        """Prints the lines not printed yet, in order (the follower's and a flush's alike)."""
        with self._lock:
            new = [line for line in lines.lines if line.sequence > self.printed]
            if not new:
                return
            if new[0].sequence > self.printed + 1:
                lost = new[0].sequence - self.printed - 1
                self.printer.write(
                    new[0].context,
                    colocated_output.STDERR,
                    f"{lost:,} lines dropped: the proxy keeps a connection's latest "
                    f"{tuning.OUTPUT_HISTORY_LINES.value:,} lines, and this process read them too late\n",
                )
            self.printed = new[-1].sequence
            for context, name, text in _grouped(new):
                self.printer.write(context, name, text)

    def switch(self, context: str) -> None:
        """Prints what the calls so far wrote (at the proxy by now if their results were waited for), and tags
        the connection's later calls with ``context``."""
        try:
            lines = self._observer.switch_output_context(self._tenant, self._secret, context, self.printed)
        except PathwaysError as error:  # a cell must not fail for it: the follower still prints what comes
            _LOGGER.info("the output of colocated Python could not be flushed: %s", error)
            return
        self.context = context
        self.show(lines)

    def flush(self) -> None:
        """Prints what has reached the proxy and is not printed yet."""
        try:
            self.show(self._observer.output(self._tenant, self._secret, self.printed))
        except PathwaysError as error:
            _LOGGER.info("the output of colocated Python could not be flushed: %s", error)

    def close(self) -> None:
        """Prints what is left, and stops following."""
        self.flush()
        if self._stream is not None:
            self._stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.printer.close()


def _grouped(lines: list[pb.OutputLine]) -> Iterable[tuple[str, str, str]]:
    """``(context, stream name, text)`` of runs of lines printed together."""
    runs: list[tuple[str, str, str]] = []
    for line in lines:
        name, text = format_line(line)
        if runs and runs[-1][:2] == (line.context, name):
            runs[-1] = (line.context, name, runs[-1][2] + text)
        else:
            runs.append((line.context, name, text))
    return runs


def runs_colocated_python(state: pb.ClusterState) -> bool:
    """Whether the cluster gives its devices colocated CPU devices (it runs colocated Python)."""
    return any(device.HasField("colocated") for device in state.devices)


# What makes a new connection's printer (``print_with``); None: a ``StreamPrinter``.
_printer: Callable[[RemoteOutput], Printer] | None = None


def print_with(printer: Callable[[RemoteOutput], Printer] | None) -> None:
    """Connections made from now on print their output with ``printer(remote)`` (None: this process's streams).

    Called by the layer that runs the user's code where output belongs elsewhere than the process's
    streams (``%load_ext pathways_nb`` and the Pathways kernel: under each call's cell), on the user's
    thread, before it connects.
    """
    global _printer
    _printer = printer


def follow(session) -> RemoteOutput | None:
    """Prints ``session``'s output from beside the devices here (in a notebook, under the cell that made each
    call); None where the cluster runs no colocated Python, or is not a pathways-nb cluster."""
    state = session._state
    if state is None or not runs_colocated_python(state) or not session.secret:
        return None
    remote = RemoteOutput(session.observer, session.tenant, session.secret)
    if _printer is not None:
        remote.printer = _printer(remote)
    remote.start()
    return remote
