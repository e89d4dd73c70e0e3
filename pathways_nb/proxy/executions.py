"""One execute for every kind of program: what all kinds check and make is written here once.

An Execute names a loaded executable, its arguments and (after the client's first) its result
handles. Whatever the program, the server refuses a deleted executable, a status handle without
``fill_status`` and a wrong number of result handles the same way, registers the results against
the session's device memory, fails them (and the status) with the error of an argument that holds
one, and answers at once with the status handle and, when it chose the handles, the output specs.

What differs is an ``Executable`` strategy, the session's handle on the compiled program:

- XLA programs (``handlers.programs.LoadedProgram``): the devices match the compiled ones; donated
  arguments free their bytes; the program runs once its arguments exist and its group of islands
  serves;
- programs that are not XLA, plugin programs and colocated Python alike (``nonxla_programs.NonXlaProgram``):
  the arguments match the plan; each execution is the plan's next (``ProgramPlan.execution``),
  runs after the session's earlier work on its devices, holds its arguments until it has run, and
  resolves its status when every host is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pathways_nb.core.dataflow import ArrayRecord, Pending
from pathways_nb.protocol.errors import InvalidRequest, RequestError


class Executable(Protocol):
    """What one kind of compiled program does with an Execute, around the preparation all kinds share."""

    deleted: bool

    @property
    def name(self) -> str:
        """The program's name in messages ("the 2 result(s) of <name>")."""

    def check(self, request: Any, inputs: Sequence[ArrayRecord]) -> None:
        """Refuses (``InvalidRequest``) arguments or options this kind of program cannot run with."""

    def new_outputs(self) -> list[ArrayRecord]:
        """Fresh records for the execution's results, in the program's order."""

    def credit(self, request: Any, inputs: Sequence[ArrayRecord]) -> int:
        """Bytes of the arguments the execution frees (donates): counted before its results are."""

    def start(
        self,
        session: Any,
        request: Any,
        inputs: list[ArrayRecord],
        outputs: list[ArrayRecord],
        status: Pending | None,
        failed_input: RequestError | None,
    ) -> None:
        """Starts the execution once its results are the session's (on the loop; never waits).

        ``failed_input``: the error of an argument that already holds one; the execution then does not run,
        and its results and status hold that error (``fail_outputs``).
        """


def execute(session: Any, loaded: Executable, request: Any):
    """Starts one execution of ``loaded`` and returns the reply to send at once (on the session's loop)."""
    if loaded.deleted:
        raise InvalidRequest(f"loaded executable {request.loaded_executable_handle} was deleted")
    inputs = session.records(request.args_handles)
    loaded.check(request, inputs)
    options = request.execute_options
    if request.result_status_handle and not options.fill_status:
        raise InvalidRequest("result_status_handle is set but execute_options.fill_status is not")
    outputs = loaded.new_outputs()
    client_handles = list(request.result_array_handle)
    if client_handles and len(client_handles) != len(outputs):
        raise InvalidRequest(f"{len(client_handles)} result handles for a program with {len(outputs)} results")
    output_handles = client_handles or [session.server_handle() for _ in outputs]
    credit = loaded.credit(request, inputs)
    session.add_new_arrays(output_handles, outputs, f"the {len(outputs)} result(s) of {loaded.name}", credit=credit)
    status = Pending() if options.fill_status else None
    failed_input = next((record.error for record in inputs if record.ready and record.error is not None), None)
    loaded.start(session, request, inputs, outputs, status, failed_input)
    return execute_response(session, request, status, output_handles, outputs)


def fail_outputs(outputs: Sequence[ArrayRecord], status: Pending | None, error: RequestError) -> None:
    """The results that have no value yet hold ``error``, and so does the status: read later, they raise it."""
    for record in outputs:
        if not record.ready:
            record.fail(error)
    if status is not None:
        status.fail(error)


def execute_response(session, request, status: Pending | None, handles: list[int], outputs: list[ArrayRecord]):
    """The reply to an execute (of any program): its status handle, and the output specs if the server chose the
    handles (the client's first execute of an executable; it caches them for the later ones)."""
    response = session.messages.proxy.LoadedExecutableExecuteResponse()
    if status is not None:
        response.status_handle = session.add_future(status, request.result_status_handle or None)
    if not request.result_array_handle:
        for handle, record in zip(handles, outputs, strict=True):
            out = response.outputs.add(array_handle=handle)
            out.dtype.kind = record.kind
            out.shape.dims.extend(record.shape)
            out.sharding.CopyFrom(record.sharding.to_proto())
    return response
