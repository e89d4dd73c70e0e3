"""pathways-nb: a cluster of accelerators that feels like one machine from a notebook.

>>> import pathways_nb
>>> pathways_nb.connect("grpc://127.0.0.1:29000")   # doctest: +SKIP
"""

from pathways_nb.client import Connection, connect, current, disconnect
from pathways_nb.errors import ConnectionFailed, PathwaysError

__version__ = "0.1.0"

__all__ = ["Connection", "ConnectionFailed", "PathwaysError", "__version__", "connect", "current", "disconnect"]
