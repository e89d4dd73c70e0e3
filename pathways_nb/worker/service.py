"""The worker's gRPC service: one command stream per proxy session, and arrays pushed by peers.

Commands are served on the event loop as they arrive (``worker.handlers``); the loop owns the
sessions and their state. Blocking work (reading arrays back, waiting for devices, compiling,
sending to peers) runs on a thread pool and hands its results back to the loop. Replies are
batched: everything queued when the stream's writer wakes goes out in one message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from pathways_nb.colocated.worker import ColocatedPython
from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.dataflow import wait_on_loop
from pathways_nb.core.nonxla import HostContext
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.worker import handlers
from pathways_nb.worker.gang import IslandOrder
from pathways_nb.worker.peers import Peers
from pathways_nb.worker.programs import CompileCache, Programs
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.session import WorkerParts, WorkerSession
from pathways_nb.worker.share import FairShare
from pathways_nb.worker.suspended import HostBudget

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = "pathways_nb.v1.Worker"


class Replies:
    """A session stream's replies, timeline events and output, drained in batches by the stream's writer.

    Loop-owned: the session hands what other threads make to the loop first (``WorkerSession.post_reply``).
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: list[pb.Reply] = []
        self._events: list[pb.Event] = []
        self._output: list[pb.OutputLine] = []
        self._ready = asyncio.Event()
        self._timer_queued = False  # one wake-up for events and output is on its way (never more than one)
        self._closed = False

    def put(self, reply: pb.Reply) -> None:
        self._items.append(reply)
        if len(self._items) == 1:
            self._ready.set()

    def put_event(self, recorded: pb.Event) -> None:
        self._events.append(recorded)
        self._wake_later()

    def put_output(self, lines: Sequence[pb.OutputLine]) -> None:
        """Output of the session (bounded where it was written); not urgent, as events are not."""
        if not lines:
            return
        self._output.extend(lines)
        self._wake_later()

    def _wake_later(self) -> None:
        """Wakes the writer for what was just queued (not urgent), unless a reply's or one timer's wake-up is on its
        way. One timer per drained batch would pile up while a stream both replies and records (each reply's
        batch started another), until every event went alone, a message per program."""
        if self._items or self._timer_queued:
            return
        self._timer_queued = True
        self._loop.call_later(tuning.EVENTS_DELAY_S.value, self._timer_fired)

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def _timer_fired(self) -> None:
        self._timer_queued = False
        self._ready.set()

    async def batches(self) -> AsyncIterator[pb.ReplyBatch]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            items, self._items = self._items, []
            events, self._events = self._events, []
            output, self._output = self._output, []
            if items or events or output:
                yield pb.ReplyBatch(replies=items, events=events, clock=time.time(), output=output)
            if self._closed:
                return


class WorkerService(cluster_pb2_grpc.WorkerServicer):
    """The worker's sessions and pushes, served on its event loop, which owns ``sessions`` (and each session's state).

    Other threads reach them through the loop: the load's thread counts them with ``load_counts`` (a ``Pending``
    the loop resolves); ``close`` runs once the loop has stopped.
    """

    def __init__(
        self,
        runtime: LocalRuntime,
        threads: int = 8,
        credentials: ClusterCredentials | None = None,
        host: HostContext | None = None,
        colocated: ColocatedPython | None = None,
        suspend_memory_budget: int | None = None,
    ):
        self.runtime = runtime
        # This host's place and storage root, for the non-XLA programs it runs.
        self.host = host or HostContext(StorageRoot(default_root()))
        # Colocated Python (None: off): the sessions' executors, which the host's supervisor starts.
        self.colocated = colocated
        self.credentials = credentials or ClusterCredentials()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pathways-worker")
        # The order of this host's island for programs that span its hosts (see worker.gang).
        self.island_order = IslandOrder()
        # Busy devices shared between tenants by weight.
        self.share = FairShare()
        # Array bytes for the proxy and peers on this host go through shared memory (its key is registered).
        self.outbox = shared_memory.Outbox("worker")
        # Suspended sessions' arrays: in this host's memory up to the budget, beyond it in files.
        self.suspend_budget = HostBudget(suspend_memory_budget, self.host.storage.root / "suspended" / self.host.name)
        self.parts = WorkerParts(
            runtime=runtime,
            programs=Programs(),
            compiles=CompileCache(runtime),
            pool=self.pool,
            peers=Peers(self.credentials),
            share=self.share,
            order=self.island_order,
            outbox=self.outbox,
            host=self.host,
            suspend_budget=self.suspend_budget,
        )
        self.sessions: dict[str, WorkerSession] = {}
        # Pushes that arrived before their session's stream (streams from the proxy and from peers
        # race), by session key: each waits a moment for it (on the loop).
        self._early_pushes: dict[str, list[asyncio.Future]] = {}
        # Set (on the loop) as the worker begins to stop: the streams its server then ends are not failures.
        self.stopping = False

    def load_counts(self) -> tuple[int, int]:
        """How many sessions are open, and how many arrays they hold (on the loop)."""
        return len(self.sessions), sum(len(session.state.arrays) for session in self.sessions.values())

    async def Session(self, request_iterator, context):
        replies = Replies()
        first = await request_iterator.__anext__()
        key = first.session
        if not key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first command batch must name its session")
        if key in self.sessions:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {key} is already open on this worker")
        session = WorkerSession(key, self.parts, asyncio.get_running_loop(), replies)
        self.sessions[key] = session
        for waiting in self._early_pushes.pop(key, ()):
            if not waiting.done():
                waiting.set_result(None)
        _LOGGER.info("session %s opened", key)
        reader = asyncio.create_task(self._serve(session, first, request_iterator, replies))
        try:
            async for batch in replies.batches():
                yield batch
        finally:
            reader.cancel()
            self.sessions.pop(key, None)
            session.close()
            if self.colocated is not None:
                self.colocated.end_session(key)
            _LOGGER.info("session %s closed", key)

    async def _serve(self, session: WorkerSession, first: pb.CommandBatch, request_iterator, replies: Replies) -> None:
        """Serves the stream's commands in order until it ends, then ends the replies."""
        try:
            batch = first
            while True:
                for command in batch.commands:
                    handlers.handle(session, command)
                batch = await request_iterator.__anext__()
        except StopAsyncIteration:
            # The proxy is done with the session: its last timeline events go before the stream ends.
            await session.reported(tuning.SESSION_END_EVENTS_WAIT_S.value)
        except grpc.aio.AioRpcError as error:
            _LOGGER.info("session %s: the proxy's stream ended (%s)", session.key, error.code().name)
        except asyncio.CancelledError:
            replies.close()
            raise
        except Exception:
            if not self.stopping:
                _LOGGER.exception("session %s failed", session.key)
        replies.close()

    async def PushArray(self, request_iterator, context):
        header = None
        chunks = []
        async for chunk in request_iterator:
            if header is None:
                header = chunk
            chunks.append(chunk.data)
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty push: the first chunk names the array")
        session = await self._session_for_push(header.session)
        if session is None:
            if header.HasField("shared"):
                shared_memory.discard(header.shared.path)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {header.session} is not open on this worker")
        data = bytearray().join(chunks)
        if header.HasField("shared"):
            try:
                data = shared_memory.take(header.shared.path, header.shared.size)
            except shared_memory.NotShared as error:
                _LOGGER.debug("array %d: %s; asking the sender for the bytes over gRPC", header.id, error)
                return pb.PushArrayResponse(not_shared=True)
        handlers.arrive(session, header, data)
        return pb.PushArrayResponse()

    async def _session_for_push(self, key: str) -> WorkerSession | None:
        """The session a push is for; one whose stream is still on its way is waited for, a moment."""
        session = self.sessions.get(key)
        if session is not None:
            return session
        opened = asyncio.get_running_loop().create_future()
        self._early_pushes.setdefault(key, []).append(opened)
        try:
            await asyncio.wait_for(opened, tuning.EARLY_PUSH_WAIT_S.value)
        except asyncio.TimeoutError:
            return None
        finally:
            waiting = self._early_pushes.get(key)
            if waiting is not None and opened in waiting:
                waiting.remove(opened)
                if not waiting:
                    del self._early_pushes[key]
        return self.sessions.get(key)

    async def OrderGang(self, request, context):
        """Takes host 0's order at once, and answers once this host's parts of those steps have run.

        Host 0 counts a step as done (for the tenants' weights) only when the answer comes.
        """
        turns = [self.island_order.ordered(step.gang, step.step) for step in request.steps]
        for turn in turns:
            await wait_on_loop(turn.ran)
        return pb.GangOrdersAck()

    def begin_stopping(self) -> None:
        """The worker begins to stop (on the loop)."""
        self.stopping = True

    def close(self) -> None:
        """Lets everything go, once the loop has stopped (its sessions are this thread's then)."""
        for session in list(self.sessions.values()):
            session.close()
        self.sessions.clear()
        if self.colocated is not None:
            self.colocated.close()
        self.island_order.close()
        self.share.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def local_devices(runtime: LocalRuntime, device_ids) -> list[pb.LocalDevice]:
    """``device_ids`` of ``runtime`` as the worker registers them."""
    return [
        pb.LocalDevice(
            local_id=d.id,
            kind=d.kind,
            memory_kinds=d.memory_kinds,
            local_hardware_id=d.local_hardware_id,
            debug_string=d.debug_string,
        )
        for d in runtime.describe_devices(device_ids)
    ]
