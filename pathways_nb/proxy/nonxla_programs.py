"""Compile, metadata and execute of programs that are not XLA (``core.nonxla``), on the proxy.

A compile reads the program, finds its kind's proxy half (``program_kinds.PROXY_HALVES``) and
asks it for a plan, off the event loop; the session then holds a ``NonXlaProgram``. Its metadata
answers as the stock client needs before every Execute, with nothing to describe: no shardings, an
UNIMPLEMENTED layouts error (as for programs with tokens, so the client compares no counts), no
donations, empty memory stats.
An execute (``executions.execute``, shared with XLA programs) checks its arguments against the
plan, makes the plan's outputs at once (the same specs every time), and runs the hosts' halves once
its arguments exist and the session's earlier work on those hosts' devices has finished, off the
event loop; the status resolves when every host is done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pathways_nb.core import nonxla, session_options, tuning
from pathways_nb.core.dataflow import ArrayRecord, Pending
from pathways_nb.core.followers import wait_until_ended
from pathways_nb.protocol.errors import Code, InvalidRequest, RequestError, as_request_error
from pathways_nb.proxy import executions
from pathways_nb.proxy.dispatch import DEFERRED
from pathways_nb.proxy.program_kinds import PROXY_HALVES

_LOGGER = logging.getLogger(__name__)


@dataclass
class NonXlaProgram:
    """A session's handle on a compiled non-XLA program, and its execute strategy (``executions.Executable``).

    Plugin programs and colocated Python execute alike; what differs between kinds is in their plans
    (``ProgramPlan.execution``: the request, the proxy's own part, the undo, the callback).
    """

    parsed: nonxla.ParsedProgram
    plan: nonxla.ProgramPlan
    deleted: bool = False

    @property
    def name(self) -> str:
        return self.plan.name

    def check(self, request, inputs: Sequence[ArrayRecord]) -> None:
        plan = self.plan
        if len(inputs) != plan.num_args:
            raise InvalidRequest(f"{plan.name} takes {plan.num_args} arguments, got {len(inputs)}")
        for index, record in enumerate(inputs):
            shards = len(record.sharding.device_ids) if record.sharding is not None else 0
            if shards != len(plan.device_ids):
                raise InvalidRequest(
                    f"argument {index} of {plan.name} has {shards} shards; the program's arguments have one per "
                    f"addressable device ({len(plan.device_ids)})"
                )

    def new_outputs(self) -> list[ArrayRecord]:
        return [ArrayRecord(spec.kind, spec.shape, spec.sharding) for spec in self.plan.outputs]

    def credit(self, request, inputs: Sequence[ArrayRecord]) -> int:
        return 0

    def start(self, session, request, inputs, outputs, status: Pending | None, failed_input) -> None:
        """Runs the plan's next execution once its arguments exist and the session's earlier work on its hosts'
        devices has run, off the loop; the arguments stay alive until then (``_Run``)."""
        run = _Run(session, self.plan, inputs, outputs, status)
        if failed_input is not None:
            run.failed(failed_input)
        else:
            session.after(
                inputs, lambda: session.in_background(run.run, run.done), outputs=outputs, on_error=run.failed
            )


class _Run:
    """One execution of a planned program, from its start on the loop to its hosts' end.

    The session's order: it runs after the session's latest XLA and non-XLA work on its hosts'
    devices, and the next non-XLA program there runs after it. Its arguments stay alive until it has
    run (or will not): a deletion of one, or a program donating it, waits (an Orbax save's arrays may
    be donated by the next training step).
    """

    def __init__(self, session, plan: nonxla.ProgramPlan, inputs, outputs, status: Pending | None):
        self.session, self.plan, self.inputs, self.outputs, self.status = session, plan, inputs, outputs, status
        self.execution = plan.execution()
        # Where the client's calls come from now (its notebook cell): what this one writes is tagged with it.
        self.output_context = session.output.context if session.output is not None else ""
        self.earlier = [
            record
            for d in plan.host_device_ids
            for record in (*session.latest_work.get(d, ()), *session.latest_nonxla_work.get(d, ()))
        ]
        if outputs:  # the next non-XLA program on these devices runs after this one: the session's order
            for device_id in plan.host_device_ids:
                session.latest_nonxla_work[device_id] = outputs
        for record in inputs:
            record.begin_read()
        self.held = list(inputs)

    def release_arguments(self) -> None:
        """Once: after the run, or instead of it."""
        while self.held:
            self.held.pop().end_read()

    def run(self) -> list:
        """Blocks, on the wait pool: the earlier work, the proxy's own part, then every host's."""
        execution, session = self.execution, self.session
        try:
            _wait_for(self.earlier)
            if execution.on_proxy is not None:
                execution.on_proxy()
            args = [record.live() for record in self.inputs]
            try:
                return session.runtime.run_program(self.plan, execution.request, args, self.output_context)
            except RequestError:
                if execution.undo is not None:
                    _undo(session, self.plan, execution.undo, args)
                raise
        finally:
            self.release_arguments()

    def done(self, values, error: RequestError | None) -> None:
        """On the loop: the results hold the values, or every one of them and the status the error."""
        outputs = self.outputs
        if error is None and len(values) != len(outputs):
            error = as_request_error(RuntimeError(f"{self.plan.name} made {len(values)} results, not {len(outputs)}"))
        if error is not None:
            executions.fail_outputs(outputs, None, error)
        else:
            for record, value in zip(outputs, values, strict=True):
                record.set(value)
        if self.execution.finished is not None:
            self.execution.finished(error)
        if self.status is not None:
            self.status.fail(error) if error is not None else self.status.resolve(None)

    def failed(self, error: RequestError) -> None:
        """It will not run (an argument failed): the arguments go, the results and status hold the error."""
        self.release_arguments()
        self.done(None, error)


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
    parsed = nonxla.parse(request.program.type_name, request.program.data, PROXY_HALVES)
    view = session_view(session)

    def plan() -> nonxla.ProgramPlan:
        return nonxla.plan(parsed, view, PROXY_HALVES)

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
