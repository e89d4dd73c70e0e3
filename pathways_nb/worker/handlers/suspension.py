"""Commands of a suspended session (docs/design.md, "Suspending and resuming sessions"): its arrays to host
memory (Suspend), back onto its devices (Resume), or to the session's stream on another worker (Relocate).

The loop chooses the arrays and keeps their host copies for the pool's reads (``read_later``); the
pool copies and sends; the loop puts the results in the session's records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pathways_nb.core.convert import status_of
from pathways_nb.core.dataflow import ArrayRecord
from pathways_nb.core.events import event
from pathways_nb.core.memory import release_free_memory
from pathways_nb.protocol.errors import InvalidRequest, RequestError, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.handlers.transfers import deliver
from pathways_nb.worker.peers import push
from pathways_nb.worker.session import WorkerSession
from pathways_nb.worker.suspended import HostCopy, to_devices, to_host

_LOGGER = logging.getLogger(__name__)


def suspend(session: WorkerSession, command: pb.Suspend) -> None:
    """Moves the session's arrays to host memory once the work that makes them has settled; replies done."""

    def move() -> None:
        ids, records = session.state.movable()
        started = time.time()

        def moved(copies, error: RequestError | None) -> None:
            if error is not None:
                session.reply_error(command.request, error)
                return
            session.state.suspend(ids, records, copies)
            release_free_memory()
            _LOGGER.info(
                "session %s suspended: %d arrays (%d bytes, %d of them to disk) in %.2f s",
                session.key,
                len(copies),
                sum(copy.nbytes for copy in copies),
                sum(copy.spilled_bytes for copy in copies),
                time.time() - started,
            )
            session.reply_done(command.request)

        session.background(lambda: to_host(records, session.suspend_budget, session.file_prefix), moved)

    _when_settled(session, move)


def _when_settled(session: WorkerSession, then: Callable[[], None]) -> None:
    """Calls ``then`` on the loop once every array of the session has its value or its error."""
    unsettled = session.state.unsettled()
    if unsettled is None:
        then()
        return
    unsettled.pending.on_done(lambda _value, _error: session.on_loop(_when_settled, session, then))


def resume(session: WorkerSession, command: pb.Resume) -> None:
    """Puts the suspended arrays back on their devices; replies done.

    An array let go meanwhile (forgotten, deleted) is not put back: its copy goes once it has been read.
    """
    records = session.state.host_copies()
    copies = [record.value for record in records]

    def restored(values, error: RequestError | None) -> None:
        if error is not None:
            session.reply_error(command.request, error)
            return
        session.state.resume(records, copies, values)
        for copy in copies:
            copy.delete()  # (its memory and files go on the budget's own thread)
        session.reply_done(command.request)

    session.background(read_later(session, copies, to_devices), restored)


def relocate(session: WorkerSession, command: pb.Relocate) -> None:
    """Sends suspended arrays, shard by shard, to the session's stream on another worker (the session moves to
    devices of the same shape there: ``proxy.cluster_session``); replies done once all went."""
    if not (len(command.ids) == len(command.new_ids) == len(command.metas)):
        raise InvalidRequest(
            f"relocate names {len(command.ids)} arrays, {len(command.new_ids)} new ids, {len(command.metas)} metas"
        )
    records = [session.record(array_id) for array_id in command.ids]
    copies = [record.value for record in records if isinstance(record.value, HostCopy)]
    address, peer = command.peer_address, session.peers.stub(command.peer_address)
    moves = [
        _relocated(session, record, new_id, meta, command.peer_session)
        for record, new_id, meta in zip(records, command.new_ids, command.metas, strict=True)
    ]

    def send_all() -> pb.Event:
        started, total, ways = time.time(), 0, set()
        for header, read, read_shared in moves:
            if read is None:
                push(peer, address, header(), None)
                continue
            nbytes, way = deliver(session, peer, address, command.peer_host_key, header, read, read_shared)
            total, _ = total + nbytes, ways.add(way)
        name = f"moving {len(records)} arrays to {address} {' and '.join(sorted(ways))}"
        _LOGGER.info("session %s: %s (%d bytes) in %.2f s", session.key, name, total, time.time() - started)
        return event("transfer", name, [], started, time.time(), total)

    def sent(recorded: pb.Event | None, error: RequestError | None) -> None:
        if recorded is not None:
            session.record_event(recorded)
        session.reply_done(command.request, error)

    session.background(read_later(session, copies, lambda _copies: send_all()), sent)


def _relocated(session: WorkerSession, record: ArrayRecord, new_id: int, meta: pb.ArrayMeta, peer_session: str):
    """What a relocated array's push says (a header maker), and how to read its bytes (None: it says an error)
    and write them to a shared file (None: as ``read`` gives them). Chosen on the loop, called on the pool."""
    value = record.value
    error = record.error
    if error is None and (value is None or value.is_deleted()):
        error = InvalidRequest("the array was deleted before its session moved")
    devices: list[int] = []
    read = read_shared = None
    if error is None and isinstance(value, HostCopy):
        devices, read = value.shard_devices(), value.packed
        read_shared = lambda: session.write_shared(value.shard_arrays())  # noqa: E731 - no packed copy first
    elif error is None:
        read = lambda: np.ascontiguousarray(record.read(session.runtime.to_host))  # noqa: E731 - a host value

    def header() -> pb.ArrayChunk:
        chunk = pb.ArrayChunk(session=peer_session, id=new_id, meta=meta, shard_devices=devices)
        if error is not None:
            chunk.error.CopyFrom(status_of(as_request_error(error)))
        return chunk

    return header, read, read_shared


def read_later(
    session: WorkerSession, copies: list[HostCopy], read: Callable[[list[HostCopy]], Any]
) -> Callable[[], Any]:
    """``read(copies)`` as work for the session's pool, the copies kept from now (on the loop) until it is done
    (the loop is told): a forget or a delete that the loop serves before the read starts, or while it runs,
    deletes a copy after it."""
    for copy in copies:
        copy.keep_for_read()

    def read_them():
        try:
            return read(copies)
        finally:
            session.on_loop(_reads_done, copies)

    return read_them


def _reads_done(copies: list[HostCopy]) -> None:
    for copy in copies:
        copy.read_done()
