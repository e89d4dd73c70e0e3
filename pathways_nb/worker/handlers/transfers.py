"""Arrays between workers: a Send pushes one (or a region of it) to a peer, which expects it (Expect) and
takes it when it arrives (``arrive``, from the service's PushArray).

The loop looks the peer up and chains the push onto the array; the pool reads the array and pushes
it (``deliver``: a shared file where the peer shares this host, else gRPC) and hands the transfer's
event and the reply back to the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from pathways_nb.core.convert import error_of
from pathways_nb.core.dataflow import run_after
from pathways_nb.core.events import event
from pathways_nb.protocol.errors import RequestError, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.handlers.arrays import store
from pathways_nb.worker.peers import Peer, push
from pathways_nb.worker.session import WorkerSession

_LOGGER = logging.getLogger(__name__)

Header = Callable[[], pb.ArrayChunk]


def send(session: WorkerSession, command: pb.Send) -> None:
    source = session.record(command.source)
    start, stop = tuple(command.start), tuple(command.stop)
    region = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
    address, peer = command.peer_address, session.peers.stub(command.peer_address)

    def read():
        host = source.read(session.runtime.to_host)
        if start:
            host = host[region]
        return np.ascontiguousarray(host)

    def header(error: RequestError | None = None) -> pb.ArrayChunk:
        chunk = pb.ArrayChunk(session=command.peer_session, id=command.id, meta=command.meta)
        if error is not None:
            chunk.error.code, chunk.error.message = error.code, error.message
        return chunk

    def read_shared() -> pb.SharedFile | None:
        if start:  # a region: one copy out of the device buffer, into the file
            return source.read(lambda value: session.write_shared(np.asarray(value)[region]))
        return source.read(lambda value: session.write_shared(np.asarray(value)))

    def push_it() -> pb.Event:
        started = time.time()
        try:
            nbytes, way = deliver(session, peer, address, command.peer_host_key, header, read, read_shared)
        except Exception as error:  # noqa: BLE001 - the receiver's copy fails with it
            failure = as_request_error(error)
            tell_peer(failure)
            raise failure from None
        devices = sorted(d.id for d in source.value.devices())
        return event("transfer", f"to {address} {way}", devices, started, time.time(), nbytes)

    def tell_peer(error: RequestError) -> None:
        """The peer's copy fails with ``error`` (if the peer cannot be told, the proxy tells it: ``pushed``)."""
        try:
            push(peer, address, header(error), None)
        except RequestError as unreachable:
            _LOGGER.warning("session %s: the peer could not be told: %s", session.key, unreachable.message)

    def on_error(error: RequestError) -> None:
        session.background(lambda: tell_peer(error), lambda _result, _error: pushed(None, error))

    def pushed(recorded: pb.Event | None, error: RequestError | None) -> None:
        if recorded is not None:
            session.record_event(recorded)
        if error is not None:
            text = f"sending array {command.source} failed: {error.message}"
            session.note(logging.WARNING, text, log_level=logging.WARNING)
        if command.request:  # the proxy fails the peer's copy if it never comes
            session.reply_done(command.request, error)

    run_after([source], lambda: session.background(push_it, pushed), session.on_loop, on_error=on_error)


def deliver(
    session: WorkerSession,
    peer: Peer,
    address: str,
    host_key: str,
    header: Header,
    read: Callable[[], np.ndarray],
    read_shared: Callable[[], pb.SharedFile | None] | None = None,
) -> tuple[int, str]:
    """Pushes an array to a peer worker (blocks: on the pool): in a shared file where the peer shares this host
    and takes it, else over gRPC. Returns how many bytes went, and which way."""
    if session.outbox is not None and session.outbox.shares_host(host_key):
        shared = read_shared() if read_shared is not None else session.write_shared(read())
        if shared is not None:
            chunk = header()
            chunk.shared.CopyFrom(shared)
            if push(peer, address, chunk, None):
                return shared.size, "through shared memory"
            _LOGGER.debug("session %s: %s could not take a shared file; sending over gRPC", session.key, address)
    host = read()
    push(peer, address, header(), host)
    return host.nbytes, "over gRPC"


def expect(session: WorkerSession, command: pb.Expect) -> None:
    record = session.state.expected(command.id, command.meta)
    if command.HasField("error") and not record.ready:
        record.fail(error_of(command.error))


def arrive(
    session: WorkerSession,
    array_id: int,
    meta: pb.ArrayMeta,
    data,
    error: pb.Status | None,
    shard_devices: Sequence[int] = (),
) -> None:
    """An array pushed by another worker (possibly before its ``Expect``), on the loop; ``data``: any buffer, of the
    whole array, or (``shard_devices``) of its shards on this host's devices one after the other."""
    record = session.state.expected(array_id, meta)
    if record.ready:
        return
    if error is not None:
        record.fail(error_of(error))
        return
    store(session, record, meta, data, tuple(shard_devices))
