"""This host's part of a program that is not XLA (``core.nonxla``: plugin programs, colocated Python,
persistence): one entry point, which dispatches to the kind's host half on the pool."""

from __future__ import annotations

import logging

from pathways_nb.core import nonxla
from pathways_nb.core.convert import status_of
from pathways_nb.core.dataflow import run_after
from pathways_nb.protocol.errors import InvalidRequest, RequestError
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.program_kinds import HOST_HALVES
from pathways_nb.worker.session import WorkerSession


def run_program(session: WorkerSession, command: pb.RunProgram) -> None:
    """This host's part of a non-XLA program (``core.nonxla``): run on the pool once its arguments exist.

    The reply (done, or the error) comes when the kind's host half has finished; the results
    hold its values, or its error.
    """
    if session.host is None:
        raise InvalidRequest("this worker runs no plugin or custom-call programs")
    kind = HOST_HALVES.lookup(command.kind, command.key)
    args = [[session.record(i) for i in argument.ids] for argument in command.args]
    if len(command.results) != len(command.result_metas):
        raise InvalidRequest(f"{len(command.results)} result ids for {len(command.result_metas)} result specs")
    results = [session.new(i, meta) for i, meta in zip(command.results, command.result_metas, strict=True)]
    specs = [nonxla.ResultSpec(r.kind, r.shape, r.sharding) for r in results]
    context = session.host.for_tenant(
        command.tenant or session.key, session.key, session.output, command.context, dict(command.session_device_ids)
    )

    def run() -> list:
        pieces = [[record.live() for record in argument] for argument in args]
        values = kind.run(command.program, session.runtime, pieces, tuple(command.device_ids), specs, context)
        if len(values) != len(results):
            raise InvalidRequest(f"{command.key} made {len(values)} results on this host, not {len(results)}")
        return values

    def done(values, error: RequestError | None) -> None:
        if error is not None:
            session.note(logging.ERROR, f"{command.key} failed: {error.message}", command.context)
            for record in results:
                if not record.ready:
                    record.fail(error)
            session.reply(pb.Reply(request=command.request, error=status_of(error)))
            return
        for record, value in zip(results, values, strict=True):
            record.set(value)
        session.reply(pb.Reply(request=command.request, done=True))

    def failed(error: RequestError) -> None:
        done(None, error)

    flat = [record for argument in args for record in argument]
    run_after(flat, lambda: session.background(run, done), session.on_loop, results, on_error=failed)
