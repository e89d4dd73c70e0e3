"""The programs that are not XLA a host runs: their host halves, in one explicit list.

Each half is what one host does with its local pieces of a program the proxy planned
(``core.nonxla.HostHalf``); the proxy's halves are in ``proxy/program_kinds.py``. A worker runs
them, and so does the single-process proxy, which is its own only host.
"""

from __future__ import annotations

from pathways_nb.colocated.worker import ColocatedPythonHost
from pathways_nb.core.nonxla import HostHalf, ProgramHalves
from pathways_nb.worker.persistence import PersistenceReadHost, PersistenceWriteHost
from pathways_nb.worker.profiles import ProfileHost

HOST_HALVES: ProgramHalves[HostHalf] = ProgramHalves(
    [ProfileHost(), PersistenceWriteHost(), PersistenceReadHost(), ColocatedPythonHost()]
)
