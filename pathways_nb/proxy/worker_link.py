"""A proxy session's command stream to one worker.

Commands are queued without waiting, on the proxy's event loop, and go out in batches:
whatever has been queued when the stream's writer next runs goes in one
message, so a burst of requests costs one message. Requests that want an
answer get a ``Pending``. If the stream breaks (the worker died or restarted),
every waiting one and every later command fails with an error that names
the island and host.

The stream is a grpc.aio call on the proxy's own event loop (the one that
serves its clients; see ``ClusterRuntime.serve_on``), and the link's state is
that loop's alone: it is changed only there, with no lock. A command queued on
the loop costs no thread hop, and one loop per process is what grpc.aio wants.
Other threads reach the link in three ways only: ``forget`` (a finalizer's,
from any thread) hands the id to the loop; ``upload`` (bytes made into
commands, a pool's copy) touches nothing of the link's state; and the blocking
calls for pool threads (``fetch``, ``request_and_wait``) hand their request to
the loop (``loop_handoff.on_loop``) and wait off it for the reply.

Array bytes go through shared memory when the worker is on this host (its
host key equals ours, see ``pathways_nb.core.shared_memory``): the message carries
only a file's name, and the reader takes the file. Otherwise, or where that
fails, they go in the messages themselves.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.aio_server import SERVER_OPTIONS
from pathways_nb.core.convert import error_of
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.wait import poll_on_loop
from pathways_nb.protocol.errors import DataLoss, RequestError, Unavailable
from pathways_nb.proxy.loop_handoff import on_loop
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

# Each stream gets a connection of its own: with gRPC's shared pool, a new stream to a worker that
# just restarted on its old port inherits the failed connection's back-off (anyone who dialed the
# port while it was down) and fails at once, and the session could never reach that worker again.
LINK_OPTIONS = [*SERVER_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
# The proxy's files for workers on its host.
OUTBOX = shared_memory.Outbox("proxy")


class WorkerLost(DataLoss):
    """The worker of an island is gone: its arrays are lost, and work on it fails until a new one is back."""


@dataclass
class Upload:
    """An array's bytes made into the commands that put them on a worker (``WorkerLink.upload``)."""

    commands: list[pb.Command]
    way: str  # "shared memory" or "gRPC"
    nbytes: int
    shared: list = field(default_factory=list)  # the file handed over, removed if it is never sent


class WorkerLink:
    """One session's ordered command stream to one worker."""

    def __init__(
        self,
        worker: pb.Device,
        session_key: str,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[WorkerLink, list], None] | None = None,
        credentials: ClusterCredentials | None = None,
        cause: Callable[[], str] | None = None,
        on_output: Callable[[WorkerLink, list], None] | None = None,
    ):
        """``loop``: the running event loop the stream lives on, and the thread that makes and uses the link.

        ``on_events`` and ``on_output`` get the events and the output lines the worker sends (output
        before the replies of the same batch: a call's results are never ahead of what it wrote).
        """
        self.worker_id = worker.worker_id
        self.address = worker.worker_address
        self.island = worker.island
        self.host_index = worker.host_index
        self.place = worker.place  # how messages name a group member ("": "island I host H" says it)
        self.group = worker.group  # the group of islands a member serves ("" for an island's worker)
        self.incarnation = worker.incarnation
        self.host_key = worker.host_key
        self.session_key = session_key
        # Whether array bytes to and from this worker go through shared memory.
        self.shared_memory = OUTBOX.shares_host(worker.host_key)
        # Names of this link's files in the outbox (removed if the link ends before the worker takes them).
        self._file_prefix = f"{session_key}-{self.worker_id}-"
        # Array bytes moved each way ("shared memory" or "gRPC"): what tests and benchmarks observe.
        self.moved: collections.Counter[str] = collections.Counter()
        # Messages written: "commands" (forgotten ids riding along) or "forgotten ids alone"; the same observers.
        self.messages: collections.Counter[str] = collections.Counter()
        # Why the worker went down, once the cluster knows (its launcher reports how the process ended).
        self._cause = cause
        self._on_events = on_events
        self._on_output = on_output
        self._credentials = credentials or ClusterCredentials()
        # The worker's clock minus ours, as low as seen (network delay only makes it look larger).
        self.clock_offset = float("inf")
        self._pending: list[pb.Command] = []
        self._forgotten: collections.deque[int] = collections.deque()
        self._wake_queued = False  # a wake-up of the writer is on its way (no second one is needed)
        self._forgotten_since = 0.0  # when the oldest of the forgotten ids waiting was forgotten (monotonic)
        self._forget_timer_queued = False  # the one timer that sends forgotten ids alone once they waited too long
        self._forget_due = False  # tuning.FORGET_DELAY_S passed: they go even with no command
        self._closed = False
        self._error: RequestError | None = None
        self._lost_at = 0.0
        self._ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._waiters: dict[int, tuple[Pending, list[bytes] | None]] = {}
        self.loop = loop  # (where other threads hand the link their work)
        self._wakeup: asyncio.Event | None = None
        self._call = None
        # Done with the error once the worker is lost (never, while it serves): what a pool thread that saw a
        # failure on the island waits on a moment for its cause (``remote_arrays.explain_failure``).
        self.loss = Pending()
        self._open()

    def describe(self) -> str:
        return self.place or f"island {self.island} host {self.host_index} ({self.address})"

    @property
    def alive(self) -> bool:
        return self._error is None and not self._closed

    @property
    def lost(self) -> WorkerLost | None:
        """Why the worker is gone (its host, island and cause), or None while it serves."""
        return self._error

    def lost_for_s(self) -> float:
        """Seconds since the stream broke (0 while it serves)."""
        return time.monotonic() - self._lost_at if self._error is not None else 0.0

    def new_id(self) -> int:
        return next(self._ids)

    # -- sending ---------------------------------------------------------------------------

    def send(self, command: pb.Command) -> None:
        """Queues a command (on the loop); raises ``WorkerLost`` if the worker is gone."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise Unavailable(f"the session's link to {self.describe()} is closed")
        self._pending.append(command)
        if self._queue_wake():
            self._wake()

    def delete(self, array_id: int) -> None:
        """Has the worker free array ``array_id`` now (on the loop; nothing to do if the worker is gone)."""
        if self.alive:
            self.send(pb.Command(forget=pb.Forget(ids=[array_id], delete=True)))

    def upload(self, array_id: int, meta: pb.ArrayMeta, data: memoryview) -> Upload:
        """Row-major bytes as the commands that put them as array ``array_id``: one file through shared memory,
        else chunks. Any thread (it copies, so large ones are a pool's work): it touches no state of the link's."""
        if self.shared_memory and data.nbytes >= tuning.SHARED_MEMORY_MIN_BYTES.value:
            # A client's upload the proxy kept as a file goes on as that file: no copy here.
            path = OUTBOX.hand_over(self._file_prefix, data) or OUTBOX.write(self._file_prefix, data)
            if path is not None:
                shared = pb.SharedFile(path=str(path), size=data.nbytes)
                command = pb.Command(put=pb.Put(id=array_id, meta=meta, shared=shared))
                return Upload([command], "shared memory", data.nbytes, [path])
        chunk = tuning.MESSAGE_CHUNK_BYTES.value
        commands = []
        for start in range(0, max(data.nbytes, 1), chunk):
            end = min(start + chunk, data.nbytes)
            put = pb.Put(id=array_id, meta=meta, data=data[start:end].tobytes(), more=end < data.nbytes)
            commands.append(pb.Command(put=put))
        return Upload(commands, "gRPC", data.nbytes)

    def put(self, upload: Upload) -> None:
        """Sends an ``upload`` (on the loop); its file is removed if the worker is gone."""
        try:
            for command in upload.commands:
                self.send(command)
        except RequestError:
            for path in upload.shared:
                shared_memory.discard(path)
            raise
        self.moved[upload.way] += upload.nbytes

    def fetch(self, array_id: int) -> memoryview | bytearray:
        """The row-major bytes of array ``array_id``; over gRPC if shared memory fails.

        Blocks (a pool thread's call): the request goes out on the loop, the reply is waited for here. The worker
        decides: a small array comes in the reply (``tuning.SHARED_MEMORY_MIN_BYTES``).
        """
        received = None
        if self.shared_memory:
            try:
                fetch = pb.Command(fetch=pb.Fetch(id=array_id, shared_memory=True))
                received = self.request_and_wait(fetch, "fetch", collect_bytes=True)
            except shared_memory.NotShared as error:
                _LOGGER.debug("array %d from %s: %s; fetching it over gRPC", array_id, self.describe(), error)
        if received is None:
            received = self.request_and_wait(pb.Command(fetch=pb.Fetch(id=array_id)), "fetch", collect_bytes=True)
        if isinstance(received, list):  # the bytes came in messages
            return bytearray().join(received)  # one copy (here, not on the loop), and writable as the array it becomes
        return received

    def request_and_wait(self, command: pb.Command, field: str, collect_bytes: bool = False):
        """``request``, handed to the loop, and its reply (blocks: a pool thread's call, never the loop's)."""
        return on_loop(self.loop, self.request, command, field, collect_bytes).wait()

    def fetch_in_reply(self, array_id: int) -> Pending:
        """Asks for the bytes of array ``array_id`` in the reply itself, without waiting for them.

        For small arrays (the worker never answers under ``tuning.SHARED_MEMORY_MIN_BYTES`` with a file): the
        pending gets the list of the reply's byte chunks, on the link's loop.
        """
        return self.request(pb.Command(fetch=pb.Fetch(id=array_id)), "fetch", collect_bytes=True)

    def request(self, command: pb.Command, field: str, collect_bytes: bool = False) -> Pending:
        """Queues a command that answers (on the loop); the pending gets the reply (or the fetched bytes).

        Sets the request id in ``command`` itself: a command sent to several links is copied for each.
        """
        request_id = next(self._requests)
        getattr(command, field).request = request_id
        future = Pending()
        if self._error is not None:
            raise self._error
        self._waiters[request_id] = (future, [] if collect_bytes else None)
        try:
            self.send(command)
        except RequestError:
            self._waiters.pop(request_id, None)
            raise
        return future

    def forget(self, array_id: int) -> None:
        """Lets the worker drop an array no handle refers to any more: sent with the next batch, or alone soon.

        Not at once: a read of the next value comes right after the client drops the last one
        (``destruct_array``), and the worker reads one message fewer before it if this rides along.
        Called from finalizers, on any thread, at any moment: the id is handed to the loop, in a turn of its
        own (never in the middle of whatever the finalizer interrupted).
        """
        try:
            self.loop.call_soon_threadsafe(self._forgotten_now, array_id)
        except RuntimeError:
            pass  # the loop is closed: the process is ending, and the stream with it

    def _forgotten_now(self, array_id: int) -> None:
        if not self._forgotten:
            self._forgotten_since = time.monotonic()
        self._forgotten.append(array_id)
        if not self._forget_timer_queued:
            self._forget_timer_queued = True
            self.loop.call_later(tuning.FORGET_DELAY_S.value, self._forget_timer_fired)

    def _forget_timer_fired(self) -> None:
        """Forgotten ids that no command took along within ``tuning.FORGET_DELAY_S`` go alone; younger ones get
        the timer again. One timer at most: one per forget that rode along piled up while a chain both ran
        and dropped arrays, and their firings made a fifth to a half of the link's messages forgotten ids alone."""
        waited_s = time.monotonic() - self._forgotten_since
        later_s = tuning.FORGET_DELAY_S.value - waited_s if self._forgotten else None
        if later_s is not None and later_s > 0:
            self.loop.call_later(later_s, self._forget_timer_fired)
            return
        self._forget_timer_queued = False
        self._forget_due = later_s is not None
        if self._forget_due and self._queue_wake():
            self._wake()

    def _queue_wake(self) -> bool:
        """Whether the writer must be woken: not if a wake-up is already on its way."""
        if self._wake_queued:
            return False
        self._wake_queued = True
        return True

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _open(self) -> None:
        """Starts the stream (on the loop): a writer that sends the batches, a reader that takes the replies."""
        self._wakeup = asyncio.Event()
        self._channel = self._credentials.aio_channel(self.address, options=LINK_OPTIONS)
        self._call = cluster_pb2_grpc.WorkerStub(self._channel).Session(metadata=self._credentials.call_metadata())
        self._tasks = (self.loop.create_task(self._write()), self.loop.create_task(self._read()))

    def _next_batch(self) -> tuple[pb.CommandBatch | None, bool]:
        """What is queued, as one message (None: nothing), and whether the stream takes no more after it."""
        commands, self._pending = self._pending, []
        self._wake_queued = False
        closed = self._closed or self._error is not None  # a broken stream takes no more
        forgotten = []
        if commands or self._forget_due:  # forgotten ids ride along, or go alone once due
            self._forget_due = False
            forgotten, self._forgotten = list(self._forgotten), collections.deque()
        if commands or forgotten:
            self.messages["commands" if commands else "forgotten ids alone"] += 1
        if forgotten:
            commands.append(pb.Command(forget=pb.Forget(ids=forgotten)))
        return (pb.CommandBatch(commands=commands) if commands else None), closed

    async def _write(self) -> None:
        try:
            await self._call.write(pb.CommandBatch(session=self.session_key))
            while True:
                batch, last = self._next_batch()
                if batch is not None:
                    await self._call.write(batch)
                if last:
                    await self._call.done_writing()
                    return
                if batch is None:
                    await self._wakeup.wait()
                    self._wakeup.clear()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream ended: the reader says why

    # -- receiving -------------------------------------------------------------------------

    async def _read(self) -> None:
        detail = "the worker ended the session"
        try:
            async for batch in self._call:
                if batch.clock:
                    self.clock_offset = min(self.clock_offset, time.time() - batch.clock)
                if batch.output and self._on_output is not None:
                    self._on_output(self, list(batch.output))
                for reply in batch.replies:
                    self._deliver(reply)
                if batch.events and self._on_events is not None:
                    for recorded in batch.events:
                        recorded.start += self.clock_offset
                        recorded.end += self.clock_offset
                    self._on_events(self, list(batch.events))
        except grpc.RpcError as error:
            detail = f"{error.code().name}: {error.details()}"
        except asyncio.CancelledError:
            if self._closed:
                raise
            detail = "its stream was cancelled"  # (not by ``close``): its waiters must not hang either
        except Exception:  # a reply that cannot be handed on must not leave its waiters hanging
            _LOGGER.exception("reading the stream of %s failed", self.describe())
            detail = "its replies could not be read (see the proxy's log)"
        if self._closed:
            await self._channel.close()
        else:
            self.declare_lost(await self._cause_of_loss(detail))

    def _deliver(self, reply: pb.Reply) -> None:
        kind = reply.WhichOneof("reply")
        entry = self._waiters.get(reply.request)
        if entry is None:
            if kind == "shared":
                shared_memory.discard(reply.shared.path)  # nobody waits for it any more
            return
        future, chunks = entry
        if kind == "data" and chunks is not None:
            chunks.append(reply.data)
            if reply.more:
                return
        del self._waiters[reply.request]
        if kind == "error":
            future.fail(error_of(reply.error))
        elif kind == "shared":
            try:
                future.resolve(shared_memory.take(reply.shared.path, reply.shared.size))
            except shared_memory.NotShared as error:
                shared_memory.discard(reply.shared.path)
                future.fail(error)
            else:
                self.moved["shared memory"] += reply.shared.size
        elif chunks is not None and kind == "data":
            self.moved["gRPC"] += sum(len(chunk) for chunk in chunks)
            future.resolve(chunks)  # joined by the waiter (``fetch``), off the loop
        else:
            future.resolve(reply)

    async def _cause_of_loss(self, detail: str) -> str:
        """``detail``, or the cluster's reason for the loss if it arrives within a moment of the broken stream."""
        if self._cause is None:
            return detail
        cause, _ = await poll_on_loop(self._cause, tuning.LOSS_CAUSE_WAIT_S.value)
        return cause or detail

    def declare_lost(self, detail: str) -> None:
        """The worker is gone (the stream broke, or the cluster says so; on the loop): every waiter and later command
        fails."""
        where = "the group" if self.place else f"island {self.island}"
        error = WorkerLost(
            f"{self.describe()} is unreachable ({detail}); arrays on {where} are lost and "
            f"work on it fails until it is back. Other islands keep serving"
        )
        _LOGGER.warning("%s", error.message)
        self._error = error
        self._lost_at = time.monotonic()
        waiters, self._waiters = self._waiters, {}
        self._wake()  # the writer ends the stream's sending side
        for future, _data in waiters.values():
            future.fail(error)
        self.loss.resolve(error)
        OUTBOX.remove(self._file_prefix)  # uploads the worker will never take

    def close(self) -> None:
        """Ends the stream (on the loop; the worker drops the session's arrays); pending requests fail.

        The worker still sends the session's last timeline events and output (up to
        ``tuning.SESSION_END_EVENTS_WAIT_S`` later), which the reader takes before the stream ends.
        """
        self._closed = True
        waiters, self._waiters = self._waiters, {}
        for future, _data in waiters.values():
            future.fail(Unavailable(f"the session's link to {self.describe()} was closed"))
        self._end_sending()
        OUTBOX.remove(self._file_prefix)

    def _end_sending(self) -> None:
        """The writer ends the stream's sending side; the rest of it is cut if the worker does not end it in time."""
        self._wake()
        self.loop.call_later(tuning.SESSION_END_EVENTS_WAIT_S.value + 1.0, self._shut)

    def _shut(self) -> None:
        if self._tasks[1].done():
            return  # the worker ended the stream (the reader closed the channel)
        for task in self._tasks:
            task.cancel()
        self._call.cancel()
        self.loop.create_task(self._channel.close())
