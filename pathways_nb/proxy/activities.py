"""What the proxy is doing right now (compiles, transfers, waits), for notebooks' progress bars."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

from pathways_nb.rpc import cluster_pb2 as pb


class Activities:
    """Activities under way, by id; a thread-safe registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._active: dict[int, pb.Activity] = {}

    @contextlib.contextmanager
    def track(self, kind: str, name: str, tenant: str, bytes_total: int = 0) -> Iterator[pb.Activity]:
        """Registers an activity for the duration of the block; update ``bytes_done`` as it goes."""
        activity = pb.Activity(kind=kind, name=name, tenant=tenant, started=time.time(), bytes_total=bytes_total)
        key = next(self._ids)
        with self._lock:
            self._active[key] = activity
        try:
            yield activity
        finally:
            with self._lock:
                del self._active[key]

    def snapshot(self) -> list[pb.Activity]:
        with self._lock:
            return [pb.Activity.FromString(a.SerializeToString()) for a in self._active.values()]
