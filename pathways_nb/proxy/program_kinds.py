"""The programs that are not XLA this proxy plans: their proxy halves, in one explicit list.

Each half checks a compile request against the session and plans where the program runs
(``core.nonxla.ProxyHalf``); the hosts run the other halves (``worker/program_kinds.py``). A program
of a kind not listed here is refused at compile, with the kinds that are.
"""

from __future__ import annotations

from pathways_nb.colocated.proxy import ColocatedPythonPlanner
from pathways_nb.core.nonxla import ProgramHalves, ProxyHalf
from pathways_nb.proxy.persistence import PersistenceReadPlanner, PersistenceWritePlanner
from pathways_nb.proxy.profiles import ProfilePlanner

PROXY_HALVES: ProgramHalves[ProxyHalf] = ProgramHalves(
    [ProfilePlanner(), PersistenceWritePlanner(), PersistenceReadPlanner(), ColocatedPythonPlanner()]
)
