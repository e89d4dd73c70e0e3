"""Device values of a cluster session, as the proxy holds them: references into workers.

They answer the calls a ``jax.Array`` answers in a single-process server
(``delete``, ``is_deleted``, ``block_until_ready``), so the proxy's request
handlers do not care where the devices are. ``block_until_ready`` is a pool
thread's call (it waits); a ``delete`` off the loop, and a reference garbage
collected on any thread (``WorkerLink.forget``), hand their id to the loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.loop import call_on
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
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

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.to_numpy(self.kind).itemsize

    def delete(self) -> None:
        """Frees the array on its worker: now on the loop, soon from another thread (a read that ended on a pool
        thread deletes what was deleted while it read: ``ArrayRecord.end_read``)."""
        if not self._deleted:
            self._deleted = True
            call_on(self.link.loop, self.link.delete, self.array_id)

    def is_deleted(self) -> bool:
        return self._deleted

    def block_until_ready(self) -> RemoteArray:
        """Waits until the array is computed (blocks: a pool thread's call)."""
        self.link.request_and_wait(pb.Command(wait=pb.Wait(ids=[self.array_id])), "wait")
        return self

    def __del__(self) -> None:
        try:
            self.link.forget(self.array_id)
        except Exception:  # noqa: BLE001 - finalizers must not raise (e.g. at interpreter exit)
            pass


class PartedArray:
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


class ShardedRemoteArray(PartedArray):
    """An array whose shards live on several workers: one single-device array per device."""

    __slots__ = ()


class MultiHostArray(PartedArray):
    """An array of an island of several hosts: each host holds its part of one island-wide array.

    Every part has the array's global shape and sharding; a host's part holds the shards of that
    host's devices, as a multi-process ``jax.Array`` does. Programs of the island take and make
    such arrays, one part per host, in host order.
    """

    __slots__ = ()

    def block_until_ready(self):
        try:
            return super().block_until_ready()
        except RequestError as error:
            raise explain_failure(error, [part.link for part in self.parts]) from None


def explain_failure(error: RequestError, island_links: Sequence[WorkerLink]) -> RequestError:
    """The error to report for a failed read on an island: the loss of one of its hosts, if that is the cause.

    When a host dies mid-collective, the other hosts' results fail with the transport's own
    error (gloo: "Connection reset by peer"), which names neither island nor host. The dead
    host's link says which host, and why, within moments of the death (``WorkerLink.loss``).
    Blocks up to ``tuning.LOSS_EXPLAIN_WAIT_S``: a pool thread's call.
    """
    if isinstance(error, WorkerLost) or len(island_links) < 2:
        return error
    first_loss = Pending()
    for link in island_links:
        link.loss.on_done(lambda lost, _error: first_loss.resolve(lost))
    try:
        return first_loss.wait(tuning.LOSS_EXPLAIN_WAIT_S.value)
    except TimeoutError:
        return error
