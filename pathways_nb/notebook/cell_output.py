"""Colocated Python's output under the notebook cell whose call wrote it, even when it comes after that cell ended.

Each cell's calls carry a context of its own, which the proxy stamps on them and the executor on
their lines (docs/design.md, "Output beside the devices"). As a cell ends (IPython's
``post_run_cell``), what its calls wrote is printed under it, and later calls get a new context,
which the next cell takes as its own (``pre_run_cell``): a call whose results the cell waited for
has all of its output at the proxy by then, so a notebook run from start to end (nbclient, papermill)
has each call's lines under its cell. Lines that come later (a call the cell did not wait for, a
thread a call started) go out as they arrive with the header of their cell (ipykernel's message
``parent``), and a notebook shows them under that cell (JupyterLab's cells keep listening after
they ran).

``print_under_cells(shell)`` makes the connections made from then on print this way (the ``%pathways``
magics call it as they load: the Pathways kernel, ``%load_ext pathways_nb``).
"""

from __future__ import annotations

import collections
import itertools
import sys

from pathways_nb.client import remote_output
from pathways_nb.client.remote_output import RemoteOutput

# The cells whose headers are kept for lines that come late (a context older than these goes to the current cell).
KEPT_CELLS = 1000


def print_under_cells(shell) -> None:
    """Connections made from now on in ``shell`` print their output under their cells, if it is an ipykernel's
    (a terminal's IPython keeps the process's streams)."""
    if getattr(shell, "kernel", None) is not None:
        remote_output.print_with(lambda remote: CellOutput(shell, remote))


class CellOutput:
    """Prints ``remote``'s lines (as its printer) under the cells of ``shell`` (an ipykernel's) that made the
    calls."""

    def __init__(self, shell, remote: RemoteOutput):
        self._shell = shell
        self._kernel = shell.kernel
        self._remote = remote
        self._contexts = (str(number) for number in itertools.count(1))
        self._parents: collections.OrderedDict[str, dict] = collections.OrderedDict()
        shell.events.register("pre_run_cell", self.cell_started)
        shell.events.register("post_run_cell", self.cell_finished)
        self._next_context()  # the rest of the cell that connects is its own

    def _parent(self) -> dict:
        return self._kernel.get_parent("shell")

    def _next_context(self) -> None:
        """Prints what the calls so far wrote, and gives later calls a new context (this cell's, until the next)."""
        context = next(self._contexts)
        self._parents[context] = self._parent()
        while len(self._parents) > KEPT_CELLS:
            self._parents.popitem(last=False)
        self._remote.switch(context)

    def cell_started(self, _info=None) -> None:
        self._parents[self._remote.context] = self._parent()

    def cell_finished(self, _result=None) -> None:
        for stream in (sys.stdout, sys.stderr):  # the cell's own output first
            stream.flush()
        self._next_context()

    def write(self, context: str, name: str, text: str) -> None:
        """Sends ``text`` as stream output of the cell of ``context`` (from any thread: ipykernel's iopub is)."""
        parent = self._parents.get(context) or self._parent()
        content = {"name": name, "text": text}
        self._kernel.session.send(
            self._kernel.iopub_socket, "stream", content, parent=parent, ident=f"stream.{name}".encode()
        )

    def close(self) -> None:
        self._shell.events.unregister("pre_run_cell", self.cell_started)
        self._shell.events.unregister("post_run_cell", self.cell_finished)
