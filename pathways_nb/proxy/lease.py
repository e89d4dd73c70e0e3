"""A session's allocation, held open on the proxy's event loop for as long as the session lasts.

An allocation lasts as long as its ``Allocate`` call. Each session holds one as
a coroutine on the loop that serves the streams to workers: an idle session
costs no thread and no wake-up (a blocking gRPC stream read in a thread wakes
ten times a second, which 200 idle sessions would pay 2,000 times a second).
When the call breaks because the resource manager restarted, the allocation
is claimed again, under the same id and devices, once it is back; a claim that
fails is tried again after a backoff, and one that can never succeed (the
resource manager refuses this proxy's token) gives up with an error in the log.
While it is held, the resource manager may say on the same call that a waiting request
wants its devices (``Wanted``): the lease hands that to its session (``on_wanted``), which
decides whether to suspend (``proxy.suspension``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pathways_nb.core.loop import call_on
from pathways_nb.core.retry import Retry
from pathways_nb.protocol.errors import RequestError, Unavailable
from pathways_nb.proxy.rm_client import RmClient
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


async def grant(rm: RmClient, request: pb.AllocateRequest, on_waiting: Callable[[pb.Waiting], None]) -> Lease:
    """The granted ``Lease``, awaited on the loop (``on_waiting(Waiting)`` while queued); the resource manager's
    refusal, or an end before the grant, as a ``RequestError``."""
    call = rm.allocate(request)
    try:
        async for update in call:
            if update.HasField("granted"):
                return Lease(rm, asyncio.get_running_loop(), call, request, update.granted)
            on_waiting(update.waiting)
    except grpc.aio.AioRpcError as error:
        raise rm.error(error) from None
    except BaseException:
        call.cancel()
        raise
    raise Unavailable(f"the resource manager at {rm.address} ended the allocation before granting it")


class Lease:
    """One granted allocation; ``hold`` keeps it until ``release``."""

    def __init__(
        self, rm: RmClient, loop: asyncio.AbstractEventLoop, call, request: pb.AllocateRequest, granted: pb.Allocation
    ):
        self._rm = rm
        self._loop = loop  # the proxy's: the call, its reclaims and ``_released`` are the loop's
        self._call = call
        self._request = request
        self.granted = granted
        self._released = False
        # Told of each Wanted the resource manager sends while the lease is held (on the loop).
        self.on_wanted: Callable[[pb.Wanted], None] | None = None

    def hold(self, session_id: int) -> None:
        """Keeps the allocation for the session's life, claiming it again from a restarted resource manager."""
        loop = self._loop
        call_on(loop, lambda: loop.create_task(self._hold(session_id)))

    async def _hold(self, session_id: int) -> None:
        reclaim = pb.AllocateRequest()
        reclaim.CopyFrom(self._request)
        reclaim.reclaim_allocation_id = self.granted.allocation_id
        reclaim.reclaim_device_ids.extend(d.id for d in self.granted.devices)
        retry = Retry(f"claiming allocation {self.granted.allocation_id} again")
        while not self._released:
            try:
                async for update in self._call:
                    retry.succeeded()
                    if update.HasField("wanted") and self.on_wanted is not None:
                        self.on_wanted(update.wanted)
            except asyncio.CancelledError:
                return
            except grpc.aio.AioRpcError as error:
                if self._released or error.code() == grpc.StatusCode.CANCELLED:
                    return
                try:
                    wait_s = retry.failed(error)
                except RequestError as failure:
                    _LOGGER.error(
                        "session %d: the resource manager will not hold its allocation (%s); its devices stay "
                        "in use, but the cluster no longer counts them as held",
                        session_id,
                        failure.message,
                    )
                    return
                _LOGGER.warning(
                    "session %d: lost the resource manager at %s (%s); its devices stay in use, and the "
                    "allocation is claimed again when it is back",
                    session_id,
                    self._rm.address,
                    error.code().name,
                )
                await asyncio.sleep(wait_s)
            if self._released or self._rm.closed:
                return
            # Waits (without polling) until the resource manager answers again.
            self._call = self._rm.allocate(reclaim, wait_for_ready=True)

    def release(self) -> None:
        """Ends the allocation (from any thread: the loop ends it); idempotent."""
        call_on(self._loop, self._end)

    def _end(self) -> None:
        self._released = True
        self._call.cancel()  # the call ``_hold`` holds now (it makes no other once released)
