"""The commands of a proxy session's stream, each served on the worker's loop by the module of its concern.

``HANDLERS`` is the one list: arrays (``arrays``), programs (``programs``), arrays between workers
(``transfers``), suspended sessions (``suspension``), programs that are not XLA (``nonxla``) and the
commands that ask (``queries``). A handler raises to fail its command: ``handle`` replies the error
if the command asked for a reply, and logs it if not; the session goes on either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pathways_nb.protocol.errors import as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.handlers import arrays, nonxla, programs, queries, suspension, transfers
from pathways_nb.worker.session import WorkerSession

_LOGGER = logging.getLogger(__name__)

Handler = Callable[[WorkerSession, Any], None]

# By the name of the command's field in ``pb.Command``.
HANDLERS: dict[str, Handler] = {
    "put": arrays.put,
    "assemble": arrays.assemble,
    "disassemble": arrays.disassemble,
    "copy": arrays.copy,
    "forget": arrays.forget,
    "compile": programs.compile_program,
    "execute": programs.execute,
    "forget_program": programs.forget_program,
    "send": transfers.send,
    "expect": transfers.expect,
    "suspend": suspension.suspend,
    "resume": suspension.resume,
    "relocate": suspension.relocate,
    "run_program": nonxla.run_program,
    "fetch": queries.fetch,
    "wait": queries.wait,
    "program_query": queries.program_query,
    "layout_query": queries.layout_query,
}


def handle(session: WorkerSession, command: pb.Command) -> None:
    """Serves one command of ``session``'s stream (on the loop)."""
    kind = command.WhichOneof("command")
    body = getattr(command, kind) if kind else None
    if _LOGGER.isEnabledFor(logging.DEBUG):
        _LOGGER.debug("session %s: %s", session.key, str(command).replace("\n", " ")[:300])
    try:
        session.state.admit(kind)
        HANDLERS[kind](session, body)
    except Exception as error:  # noqa: BLE001 - one bad command must not end the session
        failure = as_request_error(error)
        request = getattr(body, "request", 0)
        if request:
            session.reply_error(request, failure)
        else:
            _LOGGER.warning("session %s: %s failed: %s", session.key, kind, failure.message)


def arrive(session: WorkerSession, chunk: pb.ArrayChunk, data) -> None:
    """An array another worker pushed to ``session`` (``chunk``: the push's header), on the loop."""
    error = chunk.error if chunk.HasField("error") else None
    transfers.arrive(session, chunk.id, chunk.meta, data, error, chunk.shard_devices)
