"""The proxy's one client of the resource manager: one grpc.aio channel on the proxy's loop.

Every call the proxy makes to the resource manager goes through ``RmClient``: the streaming ones that
last (``Allocate``, a session's lease; ``WatchCluster``, the proxy's view of the cluster), and the
short ones (``FormGroup``, ``GetClusterState``, ``Drain``, ``Profile``), each under its own deadline,
with the cluster token as call metadata, and its failure as a ``RequestError`` of the status table
(``protocol.errors``). Calls that only read or set a state (``GetClusterState``, ``Drain``) are made
again after a transient failure (``core.retry.Retry``), within their deadline; ``FormGroup`` is not
(its UNAVAILABLE means a host is down, an answer) nor ``Profile`` (a trace started twice is not one).

The channel is made on the loop at the first call and closed by ``close`` when the proxy stops. A
thread off the loop (a pool's) that needs an answer asks through ``run_on_loop`` and waits on the
``Pending`` it returns; it never makes a channel of its own, and never blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pathways_nb.core.dataflow import Pending
from pathways_nb.core.loop import call_on
from pathways_nb.core.retry import Retry
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.session_options import SessionOptions
from pathways_nb.protocol.errors import RequestError, Unavailable, as_request_error, from_rpc_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

# Deadlines of the short calls, in seconds. FormGroup's is the group-forming time-out plus this margin.
CLUSTER_STATE_DEADLINE_S = 10.0
DRAIN_DEADLINE_S = 30.0
PROFILE_DEADLINE_S = 120.0
FORM_GROUP_MARGIN_S = 30.0
# How long a runtime with a loop of its own waits for the channel to close as it stops.
CLOSE_WAIT_S = 5.0


def allocate_request(
    options: SessionOptions,
    num_devices: int,
    timeout_s: float,
    want_device_ids: tuple[int, ...] = (),
    want_same_shape: bool = False,
) -> pb.AllocateRequest:
    """The one ``AllocateRequest`` of a session: its tenant, sharing, islands and priority, for ``num_devices``,
    waiting at most ``timeout_s`` in the queue (0: as long as it takes); ``want_*`` for a session that resumes."""
    return pb.AllocateRequest(
        tenant=options.tenant,
        exclusive=options.exclusive,
        num_devices=num_devices,
        islands=options.islands,
        timeout_s=timeout_s,
        priority=options.priority,
        want_device_ids=want_device_ids,
        want_same_shape=want_same_shape,
    )


def run_on_loop(loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[Any]]) -> Pending:
    """The outcome of the coroutine ``make()``, run on ``loop``, for a thread off it (``Pending.wait``)."""
    outcome = Pending()

    def finished(task: asyncio.Future) -> None:
        if task.cancelled():
            outcome.fail(Unavailable("the proxy stopped before the resource manager answered"))
        elif task.exception() is not None:
            outcome.fail(as_request_error(task.exception()))
        else:
            outcome.resolve(task.result())

    call_on(loop, lambda: asyncio.ensure_future(make(), loop=loop).add_done_callback(finished))
    return outcome


class RmClient:
    """Calls to the resource manager at ``address``, all on the proxy's loop, over one channel."""

    def __init__(self, address: str, credentials: ClusterCredentials):
        self.address = address
        self._credentials = credentials
        self._metadata = credentials.call_metadata()
        # Made on the loop at the first call (a grpc.aio channel belongs to the loop it is made on).
        self._channel: grpc.aio.Channel | None = None
        self._stub: cluster_pb2_grpc.ResourceManagerStub | None = None
        self.channels_made = 0  # how many channels this client made (one, however long the proxy serves)
        self.closed = False

    def _rm(self) -> cluster_pb2_grpc.ResourceManagerStub:
        if self.closed:
            raise Unavailable(f"the proxy stopped: it no longer calls the resource manager at {self.address}")
        if self._stub is None:
            self._channel = self._credentials.aio_channel(self.address)
            self._stub = cluster_pb2_grpc.ResourceManagerStub(self._channel)
            self.channels_made += 1
        return self._stub

    def error(self, error: grpc.RpcError) -> RequestError:
        """A failed call as a ``RequestError``: the status table's, saying so where the resource manager is away."""
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"the resource manager at {self.address} is unreachable: {error.details()}")
        return from_rpc_error(error)

    # -- calls that last -------------------------------------------------------------------

    def allocate(self, request: pb.AllocateRequest, wait_for_ready: bool = False) -> grpc.aio.UnaryStreamCall:
        """An ``Allocate`` call (on the loop): waiting updates, the grant, then ``Wanted``s while it is held."""
        return self._rm().Allocate(request, metadata=self._metadata, wait_for_ready=wait_for_ready)

    def watch(self, request: pb.ClusterStateRequest) -> grpc.aio.UnaryStreamCall:
        """A ``WatchCluster`` call (on the loop), waiting for the resource manager while it is away."""
        return self._rm().WatchCluster(request, metadata=self._metadata, wait_for_ready=True)

    # -- short calls -----------------------------------------------------------------------

    async def cluster_state(self) -> pb.ClusterState:
        """The cluster's devices, workers, allocations and queue."""
        return await self._again_until(
            "asking the resource manager for the cluster's state",
            lambda timeout: self._rm().GetClusterState(
                pb.ClusterStateRequest(), metadata=self._metadata, timeout=timeout
            ),
            CLUSTER_STATE_DEADLINE_S,
        )

    async def drain(self, request: pb.DrainRequest) -> pb.WorkerState:
        """Has the resource manager drain a host (or put it back in service); the host's state."""
        return await self._again_until(
            f"draining island {request.island} host {request.host_index}",
            lambda timeout: self._rm().Drain(request, metadata=self._metadata, timeout=timeout),
            DRAIN_DEADLINE_S,
        )

    async def form_group(self, islands: list[int], forming_timeout_s: float) -> pb.GroupState:
        """The group of ``islands``, formed (the resource manager starts its members) or as it serves.

        Raises the resource manager's answer as it is: UNAVAILABLE there says that a host is down.
        """
        try:
            return await self._rm().FormGroup(
                pb.FormGroupRequest(islands=islands),
                metadata=self._metadata,
                timeout=forming_timeout_s + FORM_GROUP_MARGIN_S,
            )
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None

    async def profile(self, control: pb.ProfileControl) -> bytes:
        """Starts or stops a trace of the resource manager's process; the stop returns it."""
        try:
            reply = await self._rm().Profile(control, metadata=self._metadata, timeout=PROFILE_DEADLINE_S)
        except grpc.aio.AioRpcError as error:
            raise self.error(error) from None
        return reply.xspace

    async def _again_until(self, what: str, call: Callable[[float], Awaitable[Any]], deadline_s: float) -> Any:
        """``call(timeout)``, made again after transient failures (``Retry``) until it works or ``deadline_s``."""
        retry = Retry(what, deadline_s=deadline_s)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                return await call(max(0.1, deadline - time.monotonic()))
            except grpc.aio.AioRpcError as error:
                try:
                    wait_s = retry.failed(error)
                except RequestError:
                    raise self.error(error) from None
                if time.monotonic() + wait_s >= deadline:
                    raise self.error(error) from None
                await asyncio.sleep(wait_s)

    # -- ending ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Closes the channel (on the loop): its calls under way end CANCELLED. Idempotent."""
        self.closed = True
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
