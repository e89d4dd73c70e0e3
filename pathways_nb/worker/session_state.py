"""What a worker knows of one proxy session, apart from any I/O: its arrays by id, uploads still arriving,
whether it is suspended or closed, the island turns it holds, and the programs whose events are yet to come.

``SessionState`` is the state machine under ``worker.session.WorkerSession`` (as dask's ``WorkerState``
is under its ``Worker``): no sockets, no locks, no threads. It belongs to the worker's event loop and
changes only there; the session's pool threads and the threads that dispatch programs hand their
results to the loop (``core.loop.call_on``) rather than touch it. ``tests/test_worker_session_state.py``
drives it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pathways_nb.core.convert import sharding_from_proto
from pathways_nb.core.dataflow import ArrayRecord, Pending
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, NotFound
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.suspended import HostCopy, movable

# The commands a suspended session still takes: the proxy sends nothing else until it resumes.
WHILE_SUSPENDED = frozenset({"resume", "forget", "relocate"})


class Unreported:
    """Programs of a session dispatched whose timeline event is yet to come.

    The session's end waits for them (``drained``): the last steps of a client that leaves at
    once, say a script that ends as its results arrive, are on the timeline too.
    """

    def __init__(self) -> None:
        self._count = 0
        self._drained: Pending | None = None

    @property
    def count(self) -> int:
        return self._count

    def add(self) -> None:
        self._count += 1

    def done(self) -> None:
        self._count -= 1
        if self._count == 0 and self._drained is not None:
            drained, self._drained = self._drained, None
            drained.resolve(None)

    def drained(self) -> Pending:
        """Resolved once none is left (at once if none is)."""
        if self._count:
            self._drained = self._drained or Pending()
            return self._drained
        drained = Pending()
        drained.resolve(None)
        return drained


@dataclass
class Forgotten:
    """What forgetting some arrays leaves to do: records still arriving, dropped once they have arrived."""

    arriving: list[tuple[int, ArrayRecord]] = field(default_factory=list)


@dataclass
class Closed:
    """What a session's end leaves to do: arrays to delete and island turns to give up."""

    arrays: list[ArrayRecord]
    turns: list[str]


class SessionState:
    """The arrays and pending work of one proxy session on this worker (loop-owned; no I/O)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.arrays: dict[int, ArrayRecord] = {}
        self._uploads: dict[int, bytearray] = {}
        # Island programs (by their gang key) whose part here waits for its arguments: its turn is given up if
        # the session ends first, so the island's later programs are not held back.
        self.gang_waiting: set[str] = set()
        self.unreported = Unreported()
        # Suspended: its arrays are in host memory and the proxy sends nothing but Resume (and Forget).
        self.suspended = False
        self.closed = False

    # -- commands ----------------------------------------------------------------------------

    def admit(self, kind: str | None) -> None:
        """Raises if a command of ``kind`` cannot be served now."""
        if kind is None:
            raise InvalidRequest("a command with no operation")
        if self.suspended and kind not in WHILE_SUSPENDED:
            raise FailedPrecondition(f"session {self.key} is suspended: resume it before sending {kind}")

    # -- records -----------------------------------------------------------------------------

    def record(self, array_id: int) -> ArrayRecord:
        try:
            return self.arrays[array_id]
        except KeyError:
            raise NotFound(f"array {array_id} is unknown on this worker (session {self.key})") from None

    def new(self, array_id: int, meta: pb.ArrayMeta | None = None) -> ArrayRecord:
        if array_id in self.arrays:
            raise InvalidRequest(f"array id {array_id} is already in use in session {self.key}")
        sharding = sharding_from_proto(meta.sharding) if meta is not None else None
        record = ArrayRecord(meta.dtype_kind if meta else 0, tuple(meta.shape) if meta else (), sharding)
        self.arrays[array_id] = record
        return record

    def expected(self, array_id: int, meta: pb.ArrayMeta) -> ArrayRecord:
        """The record of an array another worker sends (its ``Expect`` and its push race): known or new."""
        return self.arrays.get(array_id) or self.new(array_id, meta)

    def upload(self, array_id: int, meta: pb.ArrayMeta, data: bytes, more: bool) -> tuple[ArrayRecord, bytearray]:
        """One chunk of an upload; the record and the whole upload's bytes once ``more`` is false (else empty)."""
        if array_id not in self._uploads:
            record = self.new(array_id, meta)
            self._uploads[array_id] = bytearray()
        else:
            record = self.arrays[array_id]
        buffer = self._uploads[array_id]
        buffer += data
        if more:
            return record, bytearray()
        del self._uploads[array_id]
        return record, buffer

    def forget(self, ids: list[int] | tuple[int, ...], delete: bool) -> Forgotten:
        """Lets the client's arrays go: deleted (``delete``) or dropped from the table; a suspended array's host
        copy goes now. Records still arriving stay findable until they have arrived (work chained onto them
        needs their value): the caller drops them then (``drop``)."""
        forgotten = Forgotten()
        for array_id in ids:
            record = self.arrays.get(array_id)
            if record is None:
                continue
            if delete:
                record.delete()
            elif record.ready:
                if isinstance(record.value, HostCopy):  # its memory or file goes now
                    record.value.delete()
                del self.arrays[array_id]
            else:
                forgotten.arriving.append((array_id, record))
        return forgotten

    def drop(self, array_id: int, record: ArrayRecord) -> None:
        """Forgets ``record`` if ``array_id`` still names it."""
        if self.arrays.get(array_id) is record:
            del self.arrays[array_id]

    def unsettled(self) -> ArrayRecord | None:
        """An array whose value or error is not known yet (None: every one's is)."""
        return next((record for record in self.arrays.values() if not record.ready), None)

    # -- suspending ----------------------------------------------------------------------------

    def movable(self) -> tuple[list[int], list[ArrayRecord]]:
        """The arrays a suspension moves to host memory (device arrays, not tokens, host strings or failures)."""
        ids = [array_id for array_id, record in self.arrays.items() if movable(record)]
        return ids, [self.arrays[array_id] for array_id in ids]

    def suspend(self, ids: list[int], records: list[ArrayRecord], copies: list[HostCopy]) -> None:
        """The arrays ``movable`` named are in host memory now; one forgotten while it was copied lets its copy go."""
        for array_id, record, copy in zip(ids, records, copies, strict=True):
            if self.arrays.get(array_id) is record:
                record.replace(copy)
            else:
                copy.delete()
        self.suspended = True

    def host_copies(self) -> list[ArrayRecord]:
        """The suspended arrays a resume puts back (not those let go meanwhile)."""
        return [r for r in self.arrays.values() if isinstance(r.value, HostCopy) and not r.value.is_deleted()]

    def resume(self, records: list[ArrayRecord], copies: list[HostCopy], values: list) -> None:
        """The arrays ``host_copies`` named are on their devices again (those still wanted)."""
        for record, copy, value in zip(records, copies, values, strict=True):
            if not copy.is_deleted():
                record.replace(value)
        self.suspended = False

    # -- island turns ------------------------------------------------------------------------

    def wait_turn(self, key: str) -> None:
        self.gang_waiting.add(key)

    def take_turn(self, key: str) -> None:
        self.gang_waiting.discard(key)

    def give_up_turn(self, key: str) -> bool:
        """Whether the session held ``key``'s turn (and so must give it up)."""
        if key not in self.gang_waiting:
            return False
        self.gang_waiting.discard(key)
        return True

    # -- ending ------------------------------------------------------------------------------

    def close(self) -> Closed:
        """Ends the session: what it held is for the caller to let go of."""
        self.closed = True
        turns, self.gang_waiting = list(self.gang_waiting), set()
        arrays, self.arrays = self.arrays, {}
        self._uploads.clear()
        return Closed(list(arrays.values()), turns)
