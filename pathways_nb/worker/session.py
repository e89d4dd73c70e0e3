"""One proxy session's view of a worker: its arrays by id, and the commands that act on them.

Commands arrive in the order the proxy issued them and are served in that
order on the worker's event loop, without waiting on a device; a command whose
inputs are not there yet (a chunked upload, an array another worker is sending)
is chained onto them. Work that waits (reads, compiles, large puts, pushes to
peers) runs on the worker's pool and hands its result back to the loop, which
alone changes the session's state; programs are dispatched by their turn's
thread (``worker.share``, ``worker.gang``) and touch only their own records.
Only commands that ask for something (compile, fetch, wait, queries) reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from pathways_nb.core import nonxla, shared_memory, tuning
from pathways_nb.core.colocated_output import WORKER
from pathways_nb.core.convert import error_of, sharding_from_proto, status_of
from pathways_nb.core.dataflow import ArrayRecord, Pending, run_after, wait_on_loop
from pathways_nb.core.events import EventSink, event
from pathways_nb.core.loop import call_on
from pathways_nb.core.memory import release_free_memory
from pathways_nb.core.string_arrays import StringArray
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import (
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    RequestError,
    Unavailable,
    as_request_error,
)
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.gang import IslandOrder
from pathways_nb.worker.program_kinds import HOST_HALVES
from pathways_nb.worker.programs import Programs
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.share import FairShare
from pathways_nb.worker.suspended import HostBudget, HostCopy, from_shards, movable, to_devices, to_host

_LOGGER = logging.getLogger(__name__)


def _take(shared: pb.SharedFile) -> memoryview:
    """The bytes of a file a process of this host wrote for us (removed from shared memory)."""
    try:
        return shared_memory.take(shared.path, shared.size)
    except OSError as error:
        shared_memory.discard(shared.path)
        raise Unavailable(
            f"the array's bytes could not be taken from shared memory ({error}); set PATHWAYS_SHARED_MEMORY=0 "
            "for the proxy and the workers to send them over gRPC"
        ) from None


def host_array(data, meta: pb.ArrayMeta) -> np.ndarray:
    """Row-major host bytes as the array ``meta`` describes; a clear error if they do not fit."""
    dtype = dtypes.to_numpy(meta.dtype_kind)
    shape = tuple(meta.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise InvalidRequest(f"{len(data)} bytes arrived for a {dtype}{list(shape)} array, which needs {expected}")
    return np.frombuffer(data, dtype).reshape(shape)


class _Unreported:
    """Executions of a session dispatched whose timeline event is yet to come.

    The session's end waits for them (``drained``): the last steps of a client that leaves at
    once, say a script that ends as its results arrive, are on the timeline too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._drained: Pending | None = None

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def done(self) -> None:
        with self._lock:
            self._count -= 1
            drained = self._drained if self._count == 0 else None
            if drained is not None:
                self._drained = None
        if drained is not None:
            drained.resolve(None)

    def drained(self) -> Pending:
        """Resolved once none is left (at once if none is)."""
        with self._lock:
            if self._count:
                self._drained = self._drained or Pending()
                return self._drained
        drained = Pending()
        drained.resolve(None)
        return drained


class WorkerSession:
    """The arrays and pending work of one proxy session on this worker."""

    def __init__(
        self,
        key: str,
        runtime: LocalRuntime,
        programs: Programs,
        loop: asyncio.AbstractEventLoop,
        pool: Executor,
        reply: Callable[[pb.Reply], None],
        push: Callable[[str, pb.ArrayChunk, np.ndarray | None], bool],
        events: EventSink,
        order: IslandOrder | None = None,
        announce: Callable[[Sequence[str], str, int], Sequence[Pending]] | None = None,
        share: FairShare | None = None,
        outbox: shared_memory.Outbox | None = None,
        host: nonxla.HostContext | None = None,
        output: Callable[[Sequence[pb.OutputLine]], None] | None = None,
        suspend_budget: HostBudget | None = None,
    ):
        self.key = key
        # Where its arrays go while it is suspended: this host's memory, up to the budget the host's sessions share.
        self._suspend_budget = suspend_budget or HostBudget(None)
        # This host's place and storage root, for non-XLA programs (None: it runs none).
        self._host = host
        self.runtime = runtime
        self.programs = programs
        self.loop = loop
        self._pool = pool
        self._reply = reply
        self._push = push
        self._events = events
        # Where the session's output goes (its code beside the devices, and this worker's lines about its
        # programs): to the proxy, for the client (None: nowhere).
        self._output = output
        # Multi-host programs run in the island's order (``worker.gang``); host 0 announces it.
        self._order = order
        self._announce = announce
        self._gang_waiting: set[str] = set()
        # Programs of one host's island are shared between tenants by weight (``worker.share``).
        self._share = share
        # Files for the proxy and peers on this host (None: array bytes only in messages).
        self._outbox = outbox
        self._file_prefix = "".join(c if c.isalnum() or c in "-_." else "_" for c in key) + "-"
        self.arrays: dict[int, ArrayRecord] = {}
        self._uploads: dict[int, bytearray] = {}
        self._unreported = _Unreported()
        # Suspended: its arrays are in host memory and the proxy sends nothing but Resume (and Forget).
        self.suspended = False
        self.closed = False

    # -- records ---------------------------------------------------------------------------

    def _record(self, array_id: int) -> ArrayRecord:
        try:
            return self.arrays[array_id]
        except KeyError:
            raise NotFound(f"array {array_id} is unknown on this worker (session {self.key})") from None

    def _new(self, array_id: int, meta: pb.ArrayMeta | None = None) -> ArrayRecord:
        if array_id in self.arrays:
            raise InvalidRequest(f"array id {array_id} is already in use in session {self.key}")
        sharding = sharding_from_proto(meta.sharding) if meta is not None else None
        record = ArrayRecord(meta.dtype_kind if meta else 0, tuple(meta.shape) if meta else (), sharding)
        self.arrays[array_id] = record
        return record

    def _derive(self, inputs: Sequence[ArrayRecord], outputs: Sequence[ArrayRecord], work: Callable[[], None]) -> None:
        run_after(inputs, work, self.on_loop, outputs)

    def on_loop(self, function: Callable[[], None]) -> None:
        """Runs ``function`` on the worker's loop (now, if this is it)."""
        call_on(self.loop, function)

    def _background(self, work: Callable[[], object], done: Callable[[object, RequestError | None], None]) -> None:
        """Runs blocking ``work`` on the pool, then hands ``done(result, error)`` to the loop."""

        def run() -> None:
            try:
                result, error = work(), None
            except Exception as failure:  # noqa: BLE001 - handed to ``done``
                result, error = None, as_request_error(failure)
            self.on_loop(lambda: done(result, error))

        self._pool.submit(run)

    def _note(self, level: int, text: str, context: str = "", log_level: int = logging.INFO) -> None:
        """A line about the session's programs: in this worker's log (at ``log_level``), and for its client
        (``%pathways logs --workers``) at ``level``."""
        _LOGGER.log(log_level, "session %s: %s", self.key, text)
        if self._output is not None:
            line = pb.OutputLine(stream=WORKER, text=text, level=level, logger=_LOGGER.name, context=context)
            line.time = time.time()
            self._output([line])

    # -- serving ---------------------------------------------------------------------------

    def handle(self, command: pb.Command) -> None:
        kind = command.WhichOneof("command")
        body = getattr(command, kind) if kind else None
        if _LOGGER.isEnabledFor(logging.DEBUG):
            _LOGGER.debug("session %s: %s", self.key, str(command).replace("\n", " ")[:300])
        try:
            if kind is None:
                raise InvalidRequest("a command with no operation")
            if self.suspended and kind not in ("resume", "forget", "relocate"):
                raise FailedPrecondition(f"session {self.key} is suspended: resume it before sending {kind}")
            getattr(self, f"_{kind}")(body)
        except Exception as error:  # noqa: BLE001 - one bad command must not end the session
            failure = as_request_error(error)
            request = getattr(body, "request", 0)
            if request:
                self._reply(pb.Reply(request=request, error=status_of(failure)))
            else:
                _LOGGER.warning("session %s: %s failed: %s", self.key, kind, failure.message)

    def _put(self, command: pb.Put) -> None:
        if command.HasField("shared"):
            try:
                record = self._new(command.id, command.meta)
            except RequestError:
                shared_memory.discard(command.shared.path)
                raise
            self._store(record, command.meta, command.shared)
            return
        if command.id not in self._uploads:
            record = self._new(command.id, command.meta)
            self._uploads[command.id] = bytearray()
        else:
            record = self.arrays[command.id]
        buffer = self._uploads[command.id]
        buffer += command.data
        if command.more:
            return
        del self._uploads[command.id]
        self._store(record, command.meta, buffer)

    def _store(
        self,
        record: ArrayRecord,
        meta: pb.ArrayMeta,
        data: bytes | bytearray | pb.SharedFile,
        shard_devices: tuple[int, ...] = (),
    ) -> None:
        """Puts arrived bytes (or the shared file that holds them) on the devices as ``record``'s value.

        A large one on the pool: copying it to the devices on the loop would hold every session's
        commands for as long (``tuning.OFF_LOOP_BYTES``, as the proxy does for its uploads).
        """

        def put():
            host = _take(data) if isinstance(data, pb.SharedFile) else data
            if shard_devices:
                return from_shards(self.runtime, host, meta, shard_devices)
            return self.runtime.put(host_array(host, meta), sharding_from_proto(meta.sharding))

        def done(value, error: RequestError | None) -> None:
            if error is not None:
                record.fail(error)
            else:
                record.set(value)

        nbytes = data.size if isinstance(data, pb.SharedFile) else len(data)
        if nbytes >= tuning.OFF_LOOP_BYTES.value:
            self._background(put, done)
            return
        try:
            value, error = put(), None
        except Exception as failure:  # noqa: BLE001 - the array fails with it, not the caller (a peer's push)
            value, error = None, as_request_error(failure)
        done(value, error)

    def _assemble(self, command: pb.Assemble) -> None:
        parts = [self._record(i) for i in command.parts]
        record = self._new(command.id, command.meta)
        self._derive(
            parts,
            [record],
            lambda: record.set(self.runtime.assemble(record.shape, record.sharding, [p.live() for p in parts])),
        )

    def _disassemble(self, command: pb.Disassemble) -> None:
        source = self._record(command.source)
        sharding = sharding_from_proto(command.sharding)
        outputs = [self._new(i) for i in command.ids]

        def split() -> None:
            for output, value in zip(outputs, self.runtime.disassemble(source.live(), sharding), strict=True):
                output.set(value)

        self._derive([source], outputs, split)

    def _copy(self, command: pb.Copy) -> None:
        source = self._record(command.source)
        sharding = sharding_from_proto(command.sharding)
        record = self._new(command.id)
        self._derive([source], [record], lambda: record.set(self.runtime.copy(source.live(), sharding)))

    def _compile(self, command: pb.Compile) -> None:
        def compile_now():
            return self.programs.compile(
                command.program, command.stablehlo, command.compile_options, tuple(command.device_ids)
            )

        def done(compiled, error):
            if error is not None:
                self._note(logging.ERROR, f"compiling program {command.program} failed: {error.message}")
                self._reply(pb.Reply(request=command.request, error=status_of(error)))
            else:
                self._reply(pb.Reply(request=command.request, compiled=compiled))

        # Known from now on: an Execute after it on this stream waits for the compile.
        self.programs.expect(command.program)
        self._background(compile_now, done)

    def _execute(self, command: pb.Execute) -> None:
        if command.gang:
            self._execute_in_island_order(command)
            return
        compiled = self.programs.record(command.program)  # compiled, or compiling (its Compile came first)
        args = [self._record(i) for i in command.args]
        results = [self._new(i) for i in command.results]
        keep = frozenset(command.keep)
        arrived = time.time()

        if self._share is None:
            self._derive(
                [compiled, *args], results, lambda: self._dispatch(compiled.value, args, results, keep, arrived)
            )
            return
        tenant, weight = command.tenant or self.key, command.weight or 1.0

        def dispatch() -> list:
            return self._dispatch(compiled.value, args, results, keep, arrived, timed=False)

        def finished(start: float, end: float, failed: bool) -> None:
            # The share follows the program anyway: it reports the execution, no timer thread does.
            program = compiled.value
            self._report(event("execute", program.name, program.device_ids, start, end, failed=failed))

        def submit() -> None:
            self._share.submit(tenant, weight, dispatch, compiled.value.device_ids, finished)

        self._derive([compiled, *args], results, submit)

    def _execute_in_island_order(self, command: pb.Execute) -> None:
        """This host's part of a program that spans the island: dispatched at its turn in the island's order.

        Whatever happens to the part here (its arguments failed, the session ended), its turn is
        given up, so the island's later programs are not held back.
        """
        key = command.gang
        if self._order is None:
            raise InvalidRequest("this worker is not part of an island of several hosts")
        if command.gang_peers:
            self._assign_step(command)
        self._gang_waiting.add(key)
        try:
            # Compiled, or compiling (a host that restarted compiles again, on this stream, first).
            compiled = self.programs.record(command.program)
            args = [self._record(i) for i in command.args]
            results = [self._new(i) for i in command.results]
        except RequestError:
            self._give_up_turn(key)
            raise
        keep = frozenset(command.keep)
        arrived = time.time()

        def dispatch() -> list:
            return self._dispatch(compiled.value, args, results, keep, arrived)

        def take_turn() -> None:
            self._gang_waiting.discard(key)
            self._order.ready(key, dispatch)

        try:
            run_after(
                [compiled, *args], take_turn, self.on_loop, results, on_error=lambda _error: self._give_up_turn(key)
            )
        except Exception:
            self._give_up_turn(key)
            raise

    def _assign_step(self, command: pb.Execute) -> None:
        """Host 0: gives a program its step in the island's order (as its part arrives) and tells the other hosts.

        While several tenants' programs saturate the island, the next step goes to the tenant with
        the least weighted device time instead (the island's ``FairShare``, which follows each step
        until its part has run on every host: the others report theirs in their answers to
        ``OrderGang``), so weights hold for programs that span hosts too, whether or not they
        communicate; each tenant's programs keep their order.
        """
        key, peers = command.gang, list(command.gang_peers)

        def assign() -> list:
            step, turn = self._order.assign(key)
            turn.wait_for(self._announce(peers, key, step))  # the step is done once every host's part is
            return [turn]

        self._order.share.submit(command.tenant or self.key, command.weight or 1.0, assign)

    def _dispatch(
        self, program, args: Sequence[ArrayRecord], results: Sequence[ArrayRecord], keep, arrived, timed: bool = True
    ) -> list:
        """Runs a program now (its turn has come); the results hold its values or its error.

        ``timed``: the runtime reports the execution (else whoever follows the program does).
        """
        if self.closed:
            return []
        started = time.time()
        if started - arrived > 0.001:
            # Time it waited for its turn (the island's order, or busy devices shared by weight).
            self._events(event("wait", f"{program.name} waits its turn", program.device_ids, arrived, started))
        self._unreported.add()
        try:
            values = self.runtime.execute(program, [a.value for a in args], keep, timed=self._report if timed else None)
        except Exception as error:  # noqa: BLE001 - the results hold it
            self._unreported.done()  # no event comes
            failure = as_request_error(error)
            self._note(logging.ERROR, f"running {program.name} failed: {failure.message}")
            for record in results:
                record.fail(failure)
            return []
        if not timed and not values:
            self._unreported.done()  # the share reports programs with results only
        for record, value in zip(results, values, strict=True):
            record.set(value)
        return values

    def _report(self, recorded: pb.Event) -> None:
        """The execute event of a program ``_dispatch`` ran."""
        self._events(recorded)
        self._unreported.done()

    async def reported(self, timeout_s: float) -> None:
        """Waits, on the loop, until programs dispatched so far have reported their events (``timeout_s`` at most)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wait_on_loop(self._unreported.drained()), timeout_s)

    def _give_up_turn(self, key: str) -> None:
        if key in self._gang_waiting:
            self._gang_waiting.discard(key)
            self._order.ready(key, None)

    def _fetch(self, command: pb.Fetch) -> None:
        record = self._record(command.id)
        value = record.value
        small = value is not None and value.nbytes <= tuning.READ_AT_ONCE_BYTES.value
        if record.ready and small and not record.is_deleted:
            if value.is_ready():  # computed and small: answered at once, with no hop to a thread that waits
                record.read(lambda value: self._answer_bytes(command, value))
                return
        self._answer_when_ready(
            [record],
            command.request,
            lambda: record.read(lambda value: self._answer_bytes(command, value)),
        )

    def _answer_bytes(self, command: pb.Fetch, value) -> None:
        """Replies ``value``'s bytes: in a shared file if the proxy asked and one can be written, else in chunks."""
        if isinstance(value, StringArray):  # its contents as the client reads them (core.string_arrays)
            self._send_bytes(command.request, np.frombuffer(value.to_wire(), np.uint8))
            return
        if command.shared_memory and self._outbox is not None and value.nbytes >= tuning.SHARED_MEMORY_MIN_BYTES.value:
            shared = self._write_shared(np.asarray(value))  # read while the record guards the value from deletion
            if shared is not None:
                self._reply(pb.Reply(request=command.request, shared=shared))
                return
        self._send_bytes(command.request, self.runtime.to_host(value))

    def _write_shared(self, host: np.ndarray | Sequence[np.ndarray]) -> pb.SharedFile | None:
        """``host``'s row-major bytes (of each, one after the other) in a new file of this worker's outbox (None if
        that failed)."""
        parts = [host] if isinstance(host, np.ndarray) else host
        data = [memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)) for part in parts]
        path = self._outbox.write(self._file_prefix, data)
        if path is None:
            return None
        if self.closed:  # nobody will take it
            shared_memory.discard(path)
            return None
        return pb.SharedFile(path=str(path), size=sum(part.nbytes for part in data))

    def _send_bytes(self, request: int, host: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        if not data.nbytes:
            self._reply(pb.Reply(request=request, data=b""))
        chunk = tuning.MESSAGE_CHUNK_BYTES.value
        for start in range(0, data.nbytes, chunk):
            end = min(start + chunk, data.nbytes)
            self._reply(pb.Reply(request=request, data=data[start:end].tobytes(), more=end < data.nbytes))

    def _wait(self, command: pb.Wait) -> None:
        records = [self._record(i) for i in command.ids]

        def wait() -> None:
            for record in records:
                if not record.is_deleted:
                    record.value.block_until_ready()
            self._reply(pb.Reply(request=command.request, done=True))

        self._answer_when_ready(records, command.request, wait)

    def _answer_when_ready(self, records: Sequence[ArrayRecord], request: int, blocking: Callable[[], None]) -> None:
        """Runs ``blocking`` in the background once ``records`` exist; replies the error if any."""

        def failed(_result, error):
            if error is not None:
                self._reply(pb.Reply(request=request, error=status_of(error)))

        def on_error(error: RequestError) -> None:
            failed(None, error)

        run_after(records, lambda: self._background(blocking, failed), self.on_loop, on_error=on_error)

    def _forget(self, command: pb.Forget) -> None:
        for array_id in command.ids:
            record = self.arrays.get(array_id)
            if record is None:
                continue
            if command.delete:
                record.delete()
            elif record.ready:
                if isinstance(record.value, HostCopy):  # a suspended array's copy: its memory or file goes now
                    record.value.delete()
                del self.arrays[array_id]
            else:
                # Still arriving: keep it findable until then (work chained onto it needs its value).
                record.pending.on_done(
                    lambda _value, _error, i=array_id, r=record: self.on_loop(lambda: self._drop(i, r))
                )

    def _drop(self, array_id: int, record: ArrayRecord) -> None:
        if self.arrays.get(array_id) is record:
            del self.arrays[array_id]

    def _forget_program(self, command: pb.ForgetProgram) -> None:
        self.programs.forget(command.program)

    def _send(self, command: pb.Send) -> None:
        source = self._record(command.source)
        start, stop = tuple(command.start), tuple(command.stop)

        def read():
            host = source.read(self.runtime.to_host)
            if start:
                host = host[region()]
            return np.ascontiguousarray(host)

        def header(error: RequestError | None = None) -> pb.ArrayChunk:
            chunk = pb.ArrayChunk(session=command.peer_session, id=command.id, meta=command.meta)
            if error is not None:
                chunk.error.code, chunk.error.message = error.code, error.message
            return chunk

        def read_shared() -> pb.SharedFile | None:
            if start:  # a region: one copy out of the device buffer, into the file
                return source.read(lambda value: self._write_shared(np.asarray(value)[region()]))
            return source.read(lambda value: self._write_shared(np.asarray(value)))

        def region() -> tuple[slice, ...]:
            return tuple(slice(a, b) for a, b in zip(start, stop, strict=True))

        def push():
            started = time.time()
            try:
                nbytes, way = self._deliver(command.peer_address, command.peer_host_key, header, read, read_shared)
            except Exception as error:  # noqa: BLE001 - the receiver's copy fails with it
                failure = as_request_error(error)
                tell_peer(failure)
                raise failure from None
            devices = sorted(d.id for d in source.value.devices())
            name = f"to {command.peer_address} {way}"
            self._events(event("transfer", name, devices, started, time.time(), nbytes))

        def tell_peer(error: RequestError) -> None:
            """The peer's copy fails with ``error`` (if the peer cannot be told, the proxy tells it: ``pushed``)."""
            try:
                self._push(command.peer_address, header(error), None)
            except RequestError as unreachable:
                _LOGGER.warning("session %s: the peer could not be told: %s", self.key, unreachable.message)

        def on_error(error: RequestError) -> None:
            tell_peer(error)
            pushed(None, error)

        def pushed(_result, error: RequestError | None) -> None:
            if error is not None:
                text = f"sending array {command.source} failed: {error.message}"
                self._note(logging.WARNING, text, log_level=logging.WARNING)
            if command.request:  # the proxy fails the peer's copy if it never comes
                reply = pb.Reply(request=command.request, done=True)
                if error is not None:
                    reply = pb.Reply(request=command.request, error=status_of(error))
                self._reply(reply)

        run_after([source], lambda: self._background(push, pushed), self.on_loop, on_error=on_error)

    def _deliver(
        self,
        address: str,
        host_key: str,
        header: Callable[[], pb.ArrayChunk],
        read: Callable[[], np.ndarray],
        read_shared: Callable[[], pb.SharedFile | None] | None = None,
    ) -> tuple[int, str]:
        """Pushes an array to a peer worker (blocks: on the pool): in a shared file where the peer shares this host
        and takes it, else over gRPC. Returns how many bytes went, and which way."""
        if self._outbox is not None and self._outbox.shares_host(host_key):
            shared = read_shared() if read_shared is not None else self._write_shared(read())
            if shared is not None:
                chunk = header()
                chunk.shared.CopyFrom(shared)
                if self._push(address, chunk, None):
                    return shared.size, "through shared memory"
                _LOGGER.debug("session %s: %s could not take a shared file; sending over gRPC", self.key, address)
        host = read()
        self._push(address, header(), host)
        return host.nbytes, "over gRPC"

    def _relocate(self, command: pb.Relocate) -> None:
        """Sends suspended arrays, shard by shard, to the session's stream on another worker (the session moves to
        devices of the same shape there: ``proxy.cluster_session``); replies done once all went."""
        if not (len(command.ids) == len(command.new_ids) == len(command.metas)):
            raise InvalidRequest(
                f"relocate names {len(command.ids)} arrays, {len(command.new_ids)} new ids, {len(command.metas)} metas"
            )
        records = [self._record(array_id) for array_id in command.ids]
        copies = [record.value for record in records if isinstance(record.value, HostCopy)]

        def send_all() -> None:
            started, total, ways = time.time(), 0, set()
            for record, new_id, meta in zip(records, command.new_ids, command.metas, strict=True):
                header, read, read_shared = self._relocated(record, new_id, meta, command.peer_session)
                if read is None:
                    self._push(command.peer_address, header(), None)
                    continue
                nbytes, way = self._deliver(command.peer_address, command.peer_host_key, header, read, read_shared)
                total, _ = total + nbytes, ways.add(way)
            name = f"moving {len(records)} arrays to {command.peer_address} {' and '.join(sorted(ways))}"
            _LOGGER.info("session %s: %s (%d bytes) in %.2f s", self.key, name, total, time.time() - started)
            self._events(event("transfer", name, [], started, time.time(), total))

        def sent(_result, error: RequestError | None) -> None:
            reply = pb.Reply(request=command.request, done=True)
            if error is not None:
                reply = pb.Reply(request=command.request, error=status_of(error))
            self._reply(reply)

        self._background(_read_later(copies, lambda _copies: send_all()), sent)

    def _relocated(self, record: ArrayRecord, new_id: int, meta: pb.ArrayMeta, peer_session: str):
        """What a relocated array's push says (a header maker), and how to read its bytes (None: it says an error)
        and write them to a shared file (None: as ``read`` gives them)."""
        value = record.value
        error = record.error
        if error is None and (value is None or value.is_deleted()):
            error = InvalidRequest("the array was deleted before its session moved")
        devices: list[int] = []
        read = read_shared = None
        if error is None and isinstance(value, HostCopy):
            devices, read = value.shard_devices(), value.packed
            read_shared = lambda: self._write_shared(value.shard_arrays())  # noqa: E731 - no packed copy first
        elif error is None:
            read = lambda: np.ascontiguousarray(record.read(self.runtime.to_host))  # noqa: E731 - a host value

        def header() -> pb.ArrayChunk:
            chunk = pb.ArrayChunk(session=peer_session, id=new_id, meta=meta, shard_devices=devices)
            if error is not None:
                chunk.error.CopyFrom(status_of(as_request_error(error)))
            return chunk

        return header, read, read_shared

    def _expect(self, command: pb.Expect) -> None:
        record = self.arrays.get(command.id) or self._new(command.id, command.meta)
        if command.HasField("error") and not record.ready:
            record.fail(error_of(command.error))

    def arrive(
        self, array_id: int, meta: pb.ArrayMeta, data, error: pb.Status | None, shard_devices: Sequence[int] = ()
    ) -> None:
        """An array pushed by another worker (possibly before its ``Expect``); ``data``: any buffer, of the whole
        array, or (``shard_devices``) of its shards on this host's devices one after the other."""
        record = self.arrays.get(array_id) or self._new(array_id, meta)
        if record.ready:
            return
        if error is not None:
            record.fail(error_of(error))
            return
        self._store(record, meta, data, tuple(shard_devices))

    def _program_query(self, command: pb.ProgramQuery) -> None:
        program = self.programs.get(command.program)

        def query():
            if command.text:
                return pb.Reply(request=command.request, text=self.runtime.program_text(program))
            return pb.Reply(request=command.request, costs=pb.CostAnalysis(values=self.runtime.cost_analysis(program)))

        def done(reply, error):
            if error is not None:
                reply = pb.Reply(request=command.request, error=status_of(error))
            self._reply(reply)

        self._background(query, done)

    def _run_program(self, command: pb.RunProgram) -> None:
        """This host's part of a non-XLA program (``core.nonxla``): run on the pool once its arguments exist.

        The reply (done, or the error) comes when the kind's host half has finished; the results
        hold its values, or its error.
        """
        if self._host is None:
            raise InvalidRequest("this worker runs no plugin or custom-call programs")
        kind = HOST_HALVES.lookup(command.kind, command.key)
        args = [[self._record(i) for i in argument.ids] for argument in command.args]
        if len(command.results) != len(command.result_metas):
            raise InvalidRequest(f"{len(command.results)} result ids for {len(command.result_metas)} result specs")
        results = [self._new(i, meta) for i, meta in zip(command.results, command.result_metas, strict=True)]
        specs = [nonxla.ResultSpec(r.kind, r.shape, r.sharding) for r in results]
        context = self._host.for_tenant(
            command.tenant or self.key, self.key, self._output, command.context, dict(command.session_device_ids)
        )

        def run() -> list:
            pieces = [[record.live() for record in argument] for argument in args]
            values = kind.run(command.program, self.runtime, pieces, tuple(command.device_ids), specs, context)
            if len(values) != len(results):
                raise InvalidRequest(f"{command.key} made {len(values)} results on this host, not {len(results)}")
            return values

        def done(values, error: RequestError | None) -> None:
            if error is not None:
                self._note(logging.ERROR, f"{command.key} failed: {error.message}", command.context)
                for record in results:
                    if not record.ready:
                        record.fail(error)
                self._reply(pb.Reply(request=command.request, error=status_of(error)))
                return
            for record, value in zip(results, values, strict=True):
                record.set(value)
            self._reply(pb.Reply(request=command.request, done=True))

        def failed(error: RequestError) -> None:
            done(None, error)

        flat = [record for argument in args for record in argument]
        run_after(flat, lambda: self._background(run, done), self.on_loop, results, on_error=failed)

    def _layout_query(self, command: pb.LayoutQuery) -> None:
        layout = self.runtime.default_layout(dtypes.to_numpy(command.dtype_kind), command.dims, command.device_id)
        self._reply(pb.Reply(request=command.request, layout=layout))

    # -- suspending ------------------------------------------------------------------------

    def _suspend(self, command: pb.Suspend) -> None:
        """Moves the session's arrays to host memory once the work that makes them has settled; replies done."""

        def move() -> None:
            ids = [array_id for array_id, record in self.arrays.items() if movable(record)]
            records = [self.arrays[array_id] for array_id in ids]
            started = time.time()

            def moved(copies, error: RequestError | None) -> None:
                if error is not None:
                    self._reply(pb.Reply(request=command.request, error=status_of(error)))
                    return
                for array_id, record, copy in zip(ids, records, copies, strict=True):
                    if self.arrays.get(array_id) is record:
                        record.replace(copy)
                    else:  # forgotten while it was copied
                        copy.delete()
                self.suspended = True
                release_free_memory()
                _LOGGER.info(
                    "session %s suspended: %d arrays (%d bytes, %d of them to disk) in %.2f s",
                    self.key,
                    len(copies),
                    sum(copy.nbytes for copy in copies),
                    sum(copy.spilled_bytes for copy in copies),
                    time.time() - started,
                )
                self._reply(pb.Reply(request=command.request, done=True))

            self._background(lambda: to_host(records, self._suspend_budget, self._file_prefix), moved)

        self._when_settled(move)

    def _when_settled(self, then: Callable[[], None]) -> None:
        """Calls ``then`` on the loop once every array of the session has its value or its error."""
        unsettled = next((record for record in self.arrays.values() if not record.ready), None)
        if unsettled is None:
            then()
            return
        unsettled.pending.on_done(lambda _value, _error: self.on_loop(lambda: self._when_settled(then)))

    def _resume(self, command: pb.Resume) -> None:
        """Puts the suspended arrays back on their devices; replies done.

        An array let go meanwhile (forgotten, deleted) is not put back: its copy goes once it has been read.
        """
        records = [r for r in self.arrays.values() if isinstance(r.value, HostCopy) and not r.value.is_deleted()]
        copies = [record.value for record in records]

        def restored(values, error: RequestError | None) -> None:
            if error is not None:
                self._reply(pb.Reply(request=command.request, error=status_of(error)))
                return
            for record, copy, value in zip(records, copies, values, strict=True):
                if not copy.is_deleted():
                    record.replace(value)
            self.suspended = False
            for copy in copies:
                copy.delete()  # (its memory and files go on the budget's own thread)
            self._reply(pb.Reply(request=command.request, done=True))

        self._background(_read_later(copies, to_devices), restored)

    # -- ending ----------------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        for key in list(self._gang_waiting):
            self._give_up_turn(key)
        arrays, self.arrays = self.arrays, {}
        self._uploads.clear()
        if self._outbox is not None:
            self._outbox.remove(self._file_prefix)  # replies the proxy will never take
        for record in arrays.values():
            if record.value is not None and not record.value.is_deleted():
                record.delete()  # after any read of it under way on another thread
        self._suspend_budget.forget(self._file_prefix)
        release_free_memory()


def _read_later(copies: list[HostCopy], read: Callable[[list[HostCopy]], Any]) -> Callable[[], Any]:
    """``read(copies)`` as work for the session's pool, the copies kept from now (on the loop) until it is done:
    a forget or a delete that the loop serves before the read starts, or while it runs, deletes a copy after it.
    """
    for copy in copies:
        copy.keep_for_read()

    def read_them():
        try:
            return read(copies)
        finally:
            for copy in copies:
                copy.read_done()

    return read_them
