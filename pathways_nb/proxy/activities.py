"""What the proxy is doing right now (compiles, transfers, waits), for notebooks' progress bars."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from pathways_nb.core.loop import call_on
from pathways_nb.rpc import cluster_pb2 as pb


class Activities:
    """Activities under way; owned by the proxy's event loop, where ``GetClusterState`` reads them.

    Work on the loop registers itself with ``track`` and may update the activity it gets
    (``bytes_done``); a pool thread (a compile) uses ``track_from_pool``, which hands the
    registering and the removing to the loop.
    """

    def __init__(self) -> None:
        # id(activity) -> activity: an id is unique among the activities held here, as they are alive.
        self._active: dict[int, pb.Activity] = {}

    @contextlib.contextmanager
    def track(self, kind: str, name: str, tenant: str, bytes_total: int = 0) -> Iterator[pb.Activity]:
        """On the loop: registers an activity for the duration of the block; update ``bytes_done`` as it goes."""
        activity = _activity(kind, name, tenant, bytes_total)
        self._add(activity)
        try:
            yield activity
        finally:
            self._remove(activity)

    @contextlib.contextmanager
    def track_from_pool(self, loop: asyncio.AbstractEventLoop, kind: str, name: str, tenant: str) -> Iterator[None]:
        """On a pool thread: registers an activity on ``loop`` (this registry's owner) for the block's duration."""
        activity = _activity(kind, name, tenant, 0)
        call_on(loop, self._add, activity)
        try:
            yield
        finally:
            call_on(loop, self._remove, activity)  # after the adding: the loop runs them in order

    def snapshot(self) -> list[pb.Activity]:
        return [pb.Activity.FromString(a.SerializeToString()) for a in self._active.values()]

    def _add(self, activity: pb.Activity) -> None:
        self._active[id(activity)] = activity

    def _remove(self, activity: pb.Activity) -> None:
        self._active.pop(id(activity), None)


def _activity(kind: str, name: str, tenant: str, bytes_total: int) -> pb.Activity:
    return pb.Activity(kind=kind, name=name, tenant=tenant, started=time.time(), bytes_total=bytes_total)
