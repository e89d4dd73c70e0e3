"""pathways-nb: a cluster of accelerators that feels like one machine from a notebook.

>>> import pathways_nb
>>> pathways_nb.connect("grpc://127.0.0.1:29000")   # doctest: +SKIP
"""

__version__ = "0.1.0"

from pathways_nb.client import Session, connect, current, disconnect
from pathways_nb.errors import ConnectionFailed, PathwaysError


def load_ipython_extension(ipython) -> None:
    """``%load_ext pathways_nb``: the ``%pathways`` magics."""
    from pathways_nb.notebook.magics import load

    load(ipython)


__all__ = [
    "ConnectionFailed",
    "PathwaysError",
    "Session",
    "__version__",
    "connect",
    "current",
    "disconnect",
    "load_ipython_extension",
]
