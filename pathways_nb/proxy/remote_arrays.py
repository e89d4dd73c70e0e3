"""Device values of a cluster session, as the proxy holds them: references into workers.

They answer the calls a ``jax.Array`` answers in a single-process server
(``delete``, ``is_deleted``, ``block_until_ready``), so the proxy's request
handlers do not care where the devices are.
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.worker_link import WorkerLink
from pathways_nb.rpc import cluster_pb2 as pb


class RemoteArray:
    """An array held by one worker, under ``array_id`` in this session's stream to it."""

    __slots__ = ("_deleted", "array_id", "kind", "link", "shape", "sharding")

    def __init__(self, link: WorkerLink, array_id: int, kind: int, shape: tuple[int, ...], sharding: IfrtSharding):
        self.link = link
        self.array_id = array_id
        self.kind = kind
        self.shape = shape
        self.sharding = sharding  # in the proxy's (global) device ids
        self._deleted = False

    def delete(self) -> None:
        if not self._deleted:
            self._deleted = True
            if self.link.alive:
                self.link.send(pb.Command(forget=pb.Forget(ids=[self.array_id], delete=True)))

    def is_deleted(self) -> bool:
        return self._deleted

    def block_until_ready(self) -> RemoteArray:
        wait = pb.Command(wait=pb.Wait(ids=[self.array_id]))
        self.link.request(wait, "wait").result()
        return self

    def __del__(self) -> None:
        try:
            self.link.forget(self.array_id)
        except Exception:  # noqa: BLE001 - finalizers must not raise (e.g. at interpreter exit)
            pass


class _PartedArray:
    """An array held as several remote arrays (its parts), deleted and waited for together."""

    __slots__ = ("parts", "shape", "sharding")

    def __init__(self, parts: Sequence[RemoteArray], shape: tuple[int, ...], sharding: IfrtSharding):
        self.parts = list(parts)
        self.shape = shape
        self.sharding = sharding

    @property
    def kind(self) -> int:
        return self.parts[0].kind

    def delete(self) -> None:
        for part in self.parts:
            part.delete()

    def is_deleted(self) -> bool:
        return any(part.is_deleted() for part in self.parts)

    def block_until_ready(self):
        for part in self.parts:
            part.block_until_ready()
        return self


class ShardedRemoteArray(_PartedArray):
    """An array whose shards live on several workers: one single-device array per device."""

    __slots__ = ()


class MultiHostArray(_PartedArray):
    """An array of an island of several hosts: each host holds its part of one island-wide array.

    Every part has the array's global shape and sharding; a host's part holds the shards of that
    host's devices, as a multi-process ``jax.Array`` does. Programs of the island take and make
    such arrays, one part per host, in host order.
    """

    __slots__ = ()
