"""One proxy session's view of a worker: the I/O around its state (``worker.session_state``).

Commands arrive in the order the proxy issued them and are served in that
order on the worker's event loop (``worker.handlers``), without waiting on a
device; a command whose inputs are not there yet (a chunked upload, an array
another worker is sending) is chained onto them. The session's state belongs to
the loop: work that waits (reads, compiles, large puts, pushes to peers) runs on
the worker's pool and hands its result back (``background``); programs are
dispatched by their turn's thread (``worker.share``, ``worker.gang``), which
touches only their own records and hands events and output to the loop too.
Only commands that ask for something (compile, fetch, wait, queries) reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pathways_nb.core import nonxla, shared_memory
from pathways_nb.core.colocated_output import WORKER
from pathways_nb.core.convert import status_of
from pathways_nb.core.dataflow import ArrayRecord, Pending, run_after, wait_on_loop
from pathways_nb.core.loop import call_on
from pathways_nb.core.memory import release_free_memory
from pathways_nb.protocol.errors import RequestError, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.gang import IslandOrder
from pathways_nb.worker.peers import Peers
from pathways_nb.worker.programs import CompileCache, Programs
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.session_state import SessionState
from pathways_nb.worker.share import FairShare
from pathways_nb.worker.suspended import HostBudget

_LOGGER = logging.getLogger(__name__)


class ReplySink(Protocol):
    """Where a session's replies, timeline events and output go (the stream's ``Replies``; loop only)."""

    def put(self, reply: pb.Reply) -> None: ...

    def put_event(self, recorded: pb.Event) -> None: ...

    def put_output(self, lines: Sequence[pb.OutputLine]) -> None: ...


@dataclass
class WorkerParts:
    """What the sessions of one worker share."""

    runtime: LocalRuntime
    programs: Programs
    compiles: CompileCache
    pool: Executor
    peers: Peers
    # Programs of one host's island are shared between tenants by weight (``worker.share``).
    share: FairShare | None = None
    # Multi-host programs run in the island's order (``worker.gang``); host 0 announces it.
    order: IslandOrder | None = None
    # Files for the proxy and peers on this host (None: array bytes only in messages).
    outbox: shared_memory.Outbox | None = None
    # This host's place and storage root, for non-XLA programs (None: it runs none).
    host: nonxla.HostContext | None = None
    # Where suspended sessions' arrays go: this host's memory, up to the budget its sessions share.
    suspend_budget: HostBudget | None = None


class WorkerSession:
    """The arrays and pending work of one proxy session on this worker, and the I/O around them."""

    def __init__(self, key: str, parts: WorkerParts, loop: asyncio.AbstractEventLoop, sink: ReplySink):
        self.key = key
        self.state = SessionState(key)
        self.runtime = parts.runtime
        self.programs = parts.programs
        self.compiles = parts.compiles
        self.peers = parts.peers
        self.share = parts.share
        self.order = parts.order
        self.outbox = parts.outbox
        self.host = parts.host
        self.suspend_budget = parts.suspend_budget or HostBudget(None)
        self.loop = loop
        self._pool = parts.pool
        self._sink = sink
        self.file_prefix = "".join(c if c.isalnum() or c in "-_." else "_" for c in key) + "-"
        # Resolved when the session ends: threads that dispatch its programs or write its files look here.
        self.ended = Pending()

    # -- the state's records -----------------------------------------------------------------

    def record(self, array_id: int) -> ArrayRecord:
        return self.state.record(array_id)

    def new(self, array_id: int, meta: pb.ArrayMeta | None = None) -> ArrayRecord:
        return self.state.new(array_id, meta)

    # -- handing work across -----------------------------------------------------------------

    def on_loop(self, function: Callable[..., None], *args) -> None:
        """Runs ``function(*args)`` on the worker's loop, which owns the session (``core.loop.call_on``)."""
        call_on(self.loop, function, *args)

    def derive(self, inputs: Sequence[ArrayRecord], outputs: Sequence[ArrayRecord], work: Callable[[], None]) -> None:
        run_after(inputs, work, self.on_loop, outputs)

    def background(self, work: Callable[[], object], done: Callable[[object, RequestError | None], None]) -> None:
        """Runs blocking ``work`` on the pool, then hands ``done(result, error)`` to the loop."""

        def run() -> None:
            try:
                result, error = work(), None
            except Exception as failure:  # noqa: BLE001 - handed to ``done``
                result, error = None, as_request_error(failure)
            self.on_loop(done, result, error)

        self._pool.submit(run)

    # -- replies, events, output ------------------------------------------------------------

    def reply(self, reply: pb.Reply) -> None:
        """Queues a reply to the proxy (on the loop)."""
        self._sink.put(reply)

    def post_reply(self, reply: pb.Reply) -> None:
        """``reply``, from a pool thread: handed to the loop."""
        self.on_loop(self._sink.put, reply)

    def reply_error(self, request: int, error: RequestError) -> None:
        self.reply(pb.Reply(request=request, error=status_of(error)))

    def reply_done(self, request: int, error: RequestError | None = None) -> None:
        """Replies done, or ``error`` (on the loop)."""
        if error is not None:
            self.reply_error(request, error)
        else:
            self.reply(pb.Reply(request=request, done=True))

    def record_event(self, recorded: pb.Event) -> None:
        """A timeline event (on the loop)."""
        self._sink.put_event(recorded)

    def post_event(self, recorded: pb.Event) -> None:
        """A timeline event, from a thread that dispatches or follows programs: handed to the loop."""
        self.on_loop(self._sink.put_event, recorded)

    def output(self, lines: Sequence[pb.OutputLine]) -> None:
        """The session's output (its code beside the devices, this worker's lines about its programs), from any
        thread: handed to the loop, for the proxy and the client."""
        self.on_loop(self._sink.put_output, lines)

    def note(self, level: int, text: str, context: str = "", log_level: int = logging.INFO) -> None:
        """A line about the session's programs: in this worker's log (at ``log_level``), and for its client
        (``%pathways logs --workers``) at ``level``. Any thread."""
        _LOGGER.log(log_level, "session %s: %s", self.key, text)
        line = pb.OutputLine(stream=WORKER, text=text, level=level, logger=_LOGGER.name, context=context)
        line.time = time.time()
        self.output([line])

    def dispatched(self) -> None:
        """A program of the session was dispatched (on its turn's thread): its execute event is to come."""
        self.on_loop(self.state.unreported.add)

    def report(self, recorded: pb.Event) -> None:
        """The execute event of a program the session dispatched (from the thread that followed it)."""
        self.on_loop(self._reported, recorded)

    def no_report(self) -> None:
        """A program ``dispatched`` reports no event (it failed to start, or made no results)."""
        self.on_loop(self.state.unreported.done)

    def _reported(self, recorded: pb.Event) -> None:
        self._sink.put_event(recorded)
        self.state.unreported.done()

    # -- files for the proxy and peers ------------------------------------------------------

    def write_shared(self, host: np.ndarray | Sequence[np.ndarray]) -> pb.SharedFile | None:
        """``host``'s row-major bytes (of each, one after the other) in a new file of this worker's outbox (None if
        that failed). Blocks on the copy: a pool thread."""
        parts = [host] if isinstance(host, np.ndarray) else host
        data = [memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)) for part in parts]
        path = self.outbox.write(self.file_prefix, data)
        if path is None:
            return None
        if self.ended.done:  # nobody will take it
            shared_memory.discard(path)
            return None
        return pb.SharedFile(path=str(path), size=sum(part.nbytes for part in data))

    # -- ending ----------------------------------------------------------------------------

    def give_up_turn(self, key: str) -> None:
        """The island's program ``key`` will not run here: its turn passes (on the loop)."""
        if self.state.give_up_turn(key):
            self.order.ready(key, None)

    async def reported(self, timeout_s: float) -> None:
        """Waits, on the loop, until programs dispatched so far have reported their events (``timeout_s`` at most)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wait_on_loop(self.state.unreported.drained()), timeout_s)

    def close(self) -> None:
        """Ends the session (on the loop, or on the thread that stops the worker once the loop has stopped)."""
        self.ended.resolve(None)
        closed = self.state.close()
        for key in closed.turns:
            self.order.ready(key, None)
        if self.outbox is not None:
            self.outbox.remove(self.file_prefix)  # replies the proxy will never take
        for record in closed.arrays:
            if record.value is not None and not record.value.is_deleted():
                record.delete()  # after any read of it under way on another thread
        self.suspend_budget.forget(self.file_prefix)
        release_free_memory()
