"""Commands that make and let go of a session's arrays: uploads, assembling, splitting, copies, forgets."""

from __future__ import annotations

import numpy as np

from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.convert import sharding_from_proto
from pathways_nb.core.dataflow import ArrayRecord
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import InvalidRequest, RequestError, Unavailable, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.session import WorkerSession
from pathways_nb.worker.suspended import from_shards


def take_shared(shared: pb.SharedFile) -> memoryview:
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


def put(session: WorkerSession, command: pb.Put) -> None:
    if command.HasField("shared"):
        try:
            record = session.new(command.id, command.meta)
        except RequestError:
            shared_memory.discard(command.shared.path)
            raise
        store(session, record, command.meta, command.shared)
        return
    record, data = session.state.upload(command.id, command.meta, command.data, command.more)
    if not command.more:
        store(session, record, command.meta, data)


def store(
    session: WorkerSession,
    record: ArrayRecord,
    meta: pb.ArrayMeta,
    data: bytes | bytearray | pb.SharedFile,
    shard_devices: tuple[int, ...] = (),
) -> None:
    """Puts arrived bytes (or the shared file that holds them) on the devices as ``record``'s value.

    A large one on the pool: copying it to the devices on the loop would hold every session's
    commands for as long (``tuning.OFF_LOOP_BYTES``, as the proxy does for its uploads).
    """
    runtime = session.runtime

    def put_on_devices():
        host = take_shared(data) if isinstance(data, pb.SharedFile) else data
        if shard_devices:
            return from_shards(runtime, host, meta, shard_devices)
        return runtime.put(host_array(host, meta), sharding_from_proto(meta.sharding))

    def done(value, error: RequestError | None) -> None:
        if error is not None:
            record.fail(error)
        else:
            record.set(value)

    nbytes = data.size if isinstance(data, pb.SharedFile) else len(data)
    if nbytes >= tuning.OFF_LOOP_BYTES.value:
        session.background(put_on_devices, done)
        return
    try:
        value, error = put_on_devices(), None
    except Exception as failure:  # noqa: BLE001 - the array fails with it, not the caller (a peer's push)
        value, error = None, as_request_error(failure)
    done(value, error)


def assemble(session: WorkerSession, command: pb.Assemble) -> None:
    parts = [session.record(i) for i in command.parts]
    record = session.new(command.id, command.meta)
    session.derive(
        parts,
        [record],
        lambda: record.set(session.runtime.assemble(record.shape, record.sharding, [p.live() for p in parts])),
    )


def disassemble(session: WorkerSession, command: pb.Disassemble) -> None:
    source = session.record(command.source)
    sharding = sharding_from_proto(command.sharding)
    outputs = [session.new(i) for i in command.ids]

    def split() -> None:
        for output, value in zip(outputs, session.runtime.disassemble(source.live(), sharding), strict=True):
            output.set(value)

    session.derive([source], outputs, split)


def copy(session: WorkerSession, command: pb.Copy) -> None:
    source = session.record(command.source)
    sharding = sharding_from_proto(command.sharding)
    record = session.new(command.id)
    session.derive([source], [record], lambda: record.set(session.runtime.copy(source.live(), sharding)))


def forget(session: WorkerSession, command: pb.Forget) -> None:
    state = session.state
    for array_id, record in state.forget(command.ids, command.delete).arriving:
        # Still arriving: kept findable until then (work chained onto it needs its value).
        record.pending.on_done(lambda _value, _error, i=array_id, r=record: session.on_loop(state.drop, i, r))
