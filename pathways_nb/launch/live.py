"""The clusters this process started and has not closed: found by address (for their token), closed at exit.

``LocalCluster`` and ``SlurmCluster`` add themselves when they start and leave when they
close; ``pathways_nb.connect(cluster.address)`` finds the cluster's token here, and the
interpreter's exit closes whatever is still open, so no cluster outlives the process that
started it (a Slurm job is cancelled).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class Cluster(Protocol):
    token: str | None

    def serves(self, address: str) -> bool: ...

    def close(self) -> None: ...


_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()


def add(cluster: Cluster) -> None:
    _LIVE.add(cluster)


def discard(cluster: Cluster) -> None:
    _LIVE.discard(cluster)


def token_for(address: str) -> str | None:
    """The token of the running cluster of this process whose proxy is at ``address``, if any."""
    for cluster in list(_LIVE):
        if cluster.serves(address):
            return cluster.token
    return None


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()
