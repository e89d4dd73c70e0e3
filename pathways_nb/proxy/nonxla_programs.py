"""Compile, metadata and execute of programs that are not XLA (``core.nonxla``), on the proxy.

A compile reads the program, finds its kind and asks the kind's proxy half for a plan, off the
event loop; the session then holds a ``NonXlaProgram``. Its metadata answers as the stock client
needs before every Execute, with nothing to describe: no shardings, an UNIMPLEMENTED layouts error
(as for programs with tokens, so the client compares no counts), no donations, empty memory stats.
An execute checks its arguments against the plan, makes the plan's outputs at once (the same specs
every time), and runs the hosts' halves once its arguments exist and the session's earlier work on
those hosts' devices has finished, off the event loop; the status resolves when every host is done.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from pathways_nb.core import nonxla, session_options, tuning
from pathways_nb.core.dataflow import ArrayRecord, Pending
from pathways_nb.core.followers import wait_until_ended
from pathways_nb.protocol.errors import Code, InvalidRequest, RequestError, as_request_error
from pathways_nb.proxy.dispatch import DEFERRED

_LOGGER = logging.getLogger(__name__)


@dataclass
class NonXlaProgram:
    """A session's handle on a compiled non-XLA program."""

    parsed: nonxla.ParsedProgram
    plan: nonxla.ProgramPlan
    deleted: bool = False


def session_view(session) -> nonxla.SessionView:
    """What a kind's proxy half may know of ``session``: its devices grouped by host, its tenant."""
    colocated = session.runtime.colocated_device_ids
    by_host: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for device in session.runtime.describe_devices(session.device_ids + colocated):
        place = (int(device.attributes.get("island", 0)), int(device.attributes.get("host_index", 0)))
        devices, colocated_devices = by_host.setdefault(place, ([], []))
        (colocated_devices if device.id in colocated else devices).append(device.id)
    hosts = tuple(
        nonxla.SessionHost(island, host, tuple(ids), tuple(colocated_ids))
        for (island, host), (ids, colocated_ids) in sorted(by_host.items())
    )
    return nonxla.SessionView(
        session.session_id,
        session.tenant,
        session.device_ids,
        hosts,
        session.runtime.proxy_is_host,
        session.runtime,
        colocated,
        session_options.read_client_versions(session.init_attributes),
    )


def compile_program(session, request, op_id):
    """Reads and plans the program off the event loop, then replies with the executable's handle."""
    if request.host_callbacks:
        raise InvalidRequest("a plugin or custom-call program takes no host callbacks")
    parsed = nonxla.parse(request.program.type_name, request.program.data)
    view = session_view(session)

    def plan() -> nonxla.ProgramPlan:
        return nonxla.plan(parsed, view)

    def planned(program_plan: nonxla.ProgramPlan | None, error) -> None:
        if error is not None:
            session.reply_error(op_id, error)
            return
        handle = session.server_handle()
        session.programs[handle] = NonXlaProgram(parsed, program_plan)
        ready = Pending()
        ready.resolve(None)
        response = session.messages.proxy.CompileResponse(
            loaded_executable_handle=handle,
            name=program_plan.name,
            num_devices=len(program_plan.device_ids),
            device_ids=program_plan.device_ids,
            addressable_device_ids=program_plan.device_ids,
            ready_future_handle=session.add_future(ready),
        )
        session.reply(op_id, "compile_response", response)

    session.in_background(plan, planned, pool=session.context.compile_pool)
    return DEFERRED


def metadata(session, loaded: NonXlaProgram):
    """Nothing to describe, said so that the stock client goes on to execute."""
    response = session.messages.proxy.LoadedExecutableMetadataResponse()
    for which in ("parameter", "output"):
        error = getattr(response, f"{which}_layouts_error")
        error.code = Code.UNIMPLEMENTED
        error.message = f"a {loaded.parsed.kind} program has no {which} layouts"
    response.output_memory_kinds.memory_kind_lists.add(
        memory_kinds=[spec.sharding.memory_kind or "device" for spec in loaded.plan.outputs]
    )
    response.donated_input_indices.SetInParent()
    response.compiled_memory_stats.SetInParent()
    return response


def execute(session, loaded: NonXlaProgram, request, op_id):
    """Starts one execution of a planned program; replies at once (with the output specs on the first)."""
    plan = loaded.plan
    if loaded.deleted:
        raise InvalidRequest(f"loaded executable {request.loaded_executable_handle} was deleted")
    inputs = session.records(request.args_handles)
    if len(inputs) != plan.num_args:
        raise InvalidRequest(f"{plan.name} takes {plan.num_args} arguments, got {len(inputs)}")
    for index, record in enumerate(inputs):
        shards = len(record.sharding.device_ids) if record.sharding is not None else 0
        if shards != len(plan.device_ids):
            raise InvalidRequest(
                f"argument {index} of {plan.name} has {shards} shards; the program's arguments have one per "
                f"addressable device ({len(plan.device_ids)})"
            )
    options = request.execute_options
    if request.result_status_handle and not options.fill_status:
        raise InvalidRequest("result_status_handle is set but execute_options.fill_status is not")
    client_handles = list(request.result_array_handle)
    if client_handles and len(client_handles) != len(plan.outputs):
        raise InvalidRequest(f"{len(client_handles)} result handles for a program with {len(plan.outputs)} results")
    outputs = [ArrayRecord(spec.kind, spec.shape, spec.sharding) for spec in plan.outputs]
    output_handles = client_handles or [session.server_handle() for _ in outputs]
    session.add_new_arrays(output_handles, outputs, f"the {len(outputs)} result(s) of {plan.name}")
    status = Pending() if options.fill_status else None
    execution = plan.execution()
    # Where the client's calls come from now (its notebook cell): what this one writes is tagged with it.
    output_context = session.output.context if session.output is not None else ""
    earlier = [
        record
        for d in plan.host_device_ids
        for record in (*session.latest_work.get(d, ()), *session.latest_nonxla_work.get(d, ()))
    ]
    if outputs:  # the next non-XLA program on these devices runs after this one: the session's order
        for device_id in plan.host_device_ids:
            session.latest_nonxla_work[device_id] = outputs

    # The arguments stay alive until the program has run (or will not): a deletion of one, or a
    # program donating it, waits (an Orbax save's arrays may be donated by the next training step).
    for record in inputs:
        record.begin_read()
    held = list(inputs)

    def release_arguments() -> None:  # once: after the run, or instead of it
        while held:
            held.pop().end_read()

    def run() -> list:
        try:
            _wait_for(earlier)
            if execution.on_proxy is not None:
                execution.on_proxy()
            args = [record.live() for record in inputs]
            try:
                return session.runtime.run_program(plan, execution.request, args, output_context)
            except RequestError:
                if execution.undo is not None:
                    _undo(session, plan, execution.undo, args)
                raise
        finally:
            release_arguments()

    def done(values, error: RequestError | None) -> None:
        if error is None and len(values) != len(outputs):
            error = as_request_error(RuntimeError(f"{plan.name} made {len(values)} results, not {len(outputs)}"))
        if error is not None:
            for record in outputs:
                if not record.ready:
                    record.fail(error)
        else:
            for record, value in zip(outputs, values, strict=True):
                record.set(value)
        if execution.finished is not None:
            execution.finished(error)
        if status is not None:
            status.fail(error) if error is not None else status.resolve(None)

    def failed(error: RequestError) -> None:
        release_arguments()
        done(None, error)

    failed_input = next((record.error for record in inputs if record.ready and record.error is not None), None)
    if failed_input is not None:
        failed(failed_input)
    else:
        session.after(inputs, lambda: session.in_background(run, done), outputs=outputs, on_error=failed)
    return execute_response(session, request, status, output_handles, outputs)


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


def _undo(session, plan: nonxla.ProgramPlan, undo: bytes, args: list) -> None:
    """Undoes a failed execution on the hosts where it succeeded (best effort: the failure is what is reported)."""
    try:
        session.runtime.run_program(plan, undo, args)
    except RequestError as error:
        _LOGGER.info("undoing a failed %s left an error: %s", plan.name, error.message)


def _wait_for(records: list[ArrayRecord]) -> None:
    """Waits (bounded) until each record's program has run; their failures are theirs, not this program's."""
    for record in records:
        arrived = threading.Event()
        record.pending.on_done(lambda _value, _error, e=arrived: e.set())
        arrived.wait(tuning.EARLIER_WORK_WAIT_S.value)
        value = record.value
        if value is not None and not record.is_deleted:
            wait_until_ended([value])  # (an earlier program's failure is reported by its own results)
