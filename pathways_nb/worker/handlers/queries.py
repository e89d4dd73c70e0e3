"""Commands that ask: an array's bytes (Fetch), its readiness (Wait), a program's text or costs, a layout.

A small value already computed is answered on the loop; anything else waits on the pool, which
hands each reply to the loop as it is made (``WorkerSession.post_reply``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import ArrayRecord, run_after
from pathways_nb.core.string_arrays import StringArray
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import RequestError
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.session import WorkerSession

Send = Callable[[pb.Reply], None]


def fetch(session: WorkerSession, command: pb.Fetch) -> None:
    record = session.record(command.id)
    value = record.value
    small = value is not None and value.nbytes <= tuning.READ_AT_ONCE_BYTES.value
    if record.ready and small and not record.is_deleted:
        if value.is_ready():  # computed and small: answered at once, with no hop to a thread that waits
            record.read(lambda value: _answer_bytes(session, command, value, session.reply))
            return
    _answer_when_ready(
        session,
        [record],
        command.request,
        lambda: record.read(lambda value: _answer_bytes(session, command, value, session.post_reply)),
    )


def _answer_bytes(session: WorkerSession, command: pb.Fetch, value, send: Send) -> None:
    """Replies ``value``'s bytes: in a shared file if the proxy asked and one can be written, else in chunks."""
    if isinstance(value, StringArray):  # its contents as the client reads them (core.string_arrays)
        _send_bytes(command.request, np.frombuffer(value.to_wire(), np.uint8), send)
        return
    if command.shared_memory and session.outbox is not None and value.nbytes >= tuning.SHARED_MEMORY_MIN_BYTES.value:
        shared = session.write_shared(np.asarray(value))  # read while the record guards the value from deletion
        if shared is not None:
            send(pb.Reply(request=command.request, shared=shared))
            return
    _send_bytes(command.request, session.runtime.to_host(value), send)


def _send_bytes(request: int, host: np.ndarray, send: Send) -> None:
    data = memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    if not data.nbytes:
        send(pb.Reply(request=request, data=b""))
    chunk = tuning.MESSAGE_CHUNK_BYTES.value
    for start in range(0, data.nbytes, chunk):
        end = min(start + chunk, data.nbytes)
        send(pb.Reply(request=request, data=data[start:end].tobytes(), more=end < data.nbytes))


def wait(session: WorkerSession, command: pb.Wait) -> None:
    records = [session.record(i) for i in command.ids]

    def block() -> None:
        for record in records:
            if not record.is_deleted:
                record.value.block_until_ready()

    _answer_when_ready(session, records, command.request, block, lambda: session.reply_done(command.request))


def _answer_when_ready(
    session: WorkerSession,
    records: Sequence[ArrayRecord],
    request: int,
    blocking: Callable[[], None],
    answered: Callable[[], None] | None = None,
) -> None:
    """Runs ``blocking`` on the pool once ``records`` exist, then ``answered`` on the loop; replies the error if any."""

    def done(_result, error: RequestError | None) -> None:
        if error is not None:
            session.reply_error(request, error)
        elif answered is not None:
            answered()

    def on_error(error: RequestError) -> None:
        done(None, error)

    run_after(records, lambda: session.background(blocking, done), session.on_loop, on_error=on_error)


def program_query(session: WorkerSession, command: pb.ProgramQuery) -> None:
    program = session.programs.get(command.program)
    runtime = session.runtime

    def query():
        if command.text:
            return pb.Reply(request=command.request, text=runtime.program_text(program))
        return pb.Reply(request=command.request, costs=pb.CostAnalysis(values=runtime.cost_analysis(program)))

    def done(reply, error: RequestError | None) -> None:
        if error is not None:
            session.reply_error(command.request, error)
        else:
            session.reply(reply)

    session.background(query, done)


def layout_query(session: WorkerSession, command: pb.LayoutQuery) -> None:
    layout = session.runtime.default_layout(dtypes.to_numpy(command.dtype_kind), command.dims, command.device_id)
    session.reply(pb.Reply(request=command.request, layout=layout))
