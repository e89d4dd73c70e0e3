"""pathways-nb: a cluster of accelerators that feels like one machine from a notebook.

>>> import pathways_nb
>>> pathways_nb.connect("grpc://127.0.0.1:29000")   # doctest: +SKIP

The package's folders say where their code runs: ``client/`` and ``notebook/`` in the user's
process, ``proxy/``, ``rm/`` and ``worker/`` in the cluster's servers, ``launch/`` starts and
supervises processes on one machine, ``core/`` is what both sides use. The public names below are
imported on first use, so a server process that imports ``pathways_nb.worker`` never loads the
client side (jax's client backends, pandas, the notebook layer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pathways_nb._version import __version__
from pathways_nb.errors import ConnectionFailed, PathwaysError

if TYPE_CHECKING:
    from pathways_nb.client.connection import Session, connect, current, disconnect
    from pathways_nb.client.profiles import profile
    from pathways_nb.client.slurm_cluster import SlurmCluster
    from pathways_nb.launch.local_cluster import LocalCluster

# Public name -> the module that defines it.
_LAZY = {
    "Session": "pathways_nb.client.connection",
    "connect": "pathways_nb.client.connection",
    "current": "pathways_nb.client.connection",
    "disconnect": "pathways_nb.client.connection",
    "LocalCluster": "pathways_nb.launch.local_cluster",
    "SlurmCluster": "pathways_nb.client.slurm_cluster",
    "profile": "pathways_nb.client.profiles",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pathways_nb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def load_ipython_extension(ipython) -> None:
    """``%load_ext pathways_nb``: the ``%pathways`` magics."""
    from pathways_nb.notebook.magics import load

    load(ipython)


__all__ = [
    "ConnectionFailed",
    "LocalCluster",
    "PathwaysError",
    "Session",
    "SlurmCluster",
    "__version__",
    "connect",
    "current",
    "disconnect",
    "load_ipython_extension",
    "profile",
]
