"""Commands that compile, run and let go of XLA programs: alone, shared by weight, or in an island's order.

The compile runs on the pool and hands its program to the loop (``worker.programs``). A program
runs on its turn's thread (the loop, the share's follower, the island's dispatcher): that thread
sets its own result records and hands the session's events and output to the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pathways_nb.core.convert import program_to_proto
from pathways_nb.core.dataflow import ArrayRecord, run_after
from pathways_nb.core.events import event
from pathways_nb.protocol.errors import InvalidRequest, RequestError, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.peers import announce_step
from pathways_nb.worker.session import WorkerSession


def compile_program(session: WorkerSession, command: pb.Compile) -> None:
    # Known from now on: an Execute after it on this stream waits for the compile.
    record = session.programs.expect(command.program)
    compiles = session.compiles

    def compile_now():
        program = compiles.compile(command.stablehlo, command.compile_options, tuple(command.device_ids))
        return program, program_to_proto(program)

    def done(compiled, error: RequestError | None) -> None:
        if error is not None:
            session.programs.failed(record, error)
            session.note(logging.ERROR, f"compiling program {command.program} failed: {error.message}")
            session.reply_error(command.request, error)
            return
        program, proto = compiled
        session.programs.compiled(record, program)
        session.reply(pb.Reply(request=command.request, compiled=proto))

    session.background(compile_now, done)


def forget_program(session: WorkerSession, command: pb.ForgetProgram) -> None:
    program = session.programs.forget(command.program)
    if program is not None:  # no id names it now: the compile cache (the pool's) lets it go too
        session.background(lambda: session.compiles.evict(program), _ignore)


def _ignore(_result, _error) -> None:
    pass


def execute(session: WorkerSession, command: pb.Execute) -> None:
    if command.gang:
        _execute_in_island_order(session, command)
        return
    compiled = session.programs.record(command.program)  # compiled, or compiling (its Compile came first)
    args = [session.record(i) for i in command.args]
    results = [session.new(i) for i in command.results]
    keep = frozenset(command.keep)
    arrived = time.time()

    if session.share is None:
        session.derive(
            [compiled, *args], results, lambda: dispatch(session, compiled.value, args, results, keep, arrived)
        )
        return
    tenant, weight = command.tenant or session.key, command.weight or 1.0

    def run() -> list:
        return dispatch(session, compiled.value, args, results, keep, arrived, timed=False)

    def finished(start: float, end: float, failed: bool) -> None:
        # The share follows the program anyway: it reports the execution, no timer thread does.
        program = compiled.value
        session.report(event("execute", program.name, program.device_ids, start, end, failed=failed))

    def submit() -> None:
        session.share.submit(tenant, weight, run, compiled.value.device_ids, finished)

    session.derive([compiled, *args], results, submit)


def _execute_in_island_order(session: WorkerSession, command: pb.Execute) -> None:
    """This host's part of a program that spans the island: dispatched at its turn in the island's order.

    Whatever happens to the part here (its arguments failed, the session ended), its turn is
    given up, so the island's later programs are not held back.
    """
    key = command.gang
    if session.order is None:
        raise InvalidRequest("this worker is not part of an island of several hosts")
    if command.gang_peers:
        _assign_step(session, command)
    session.state.wait_turn(key)
    try:
        # Compiled, or compiling (a host that restarted compiles again, on this stream, first).
        compiled = session.programs.record(command.program)
        args = [session.record(i) for i in command.args]
        results = [session.new(i) for i in command.results]
    except RequestError:
        session.give_up_turn(key)
        raise
    keep = frozenset(command.keep)
    arrived = time.time()

    def run() -> list:
        return dispatch(session, compiled.value, args, results, keep, arrived)

    def take_turn() -> None:
        session.state.take_turn(key)
        session.order.ready(key, run)

    try:
        run_after(
            [compiled, *args], take_turn, session.on_loop, results, on_error=lambda _error: session.give_up_turn(key)
        )
    except Exception:
        session.give_up_turn(key)
        raise


def _assign_step(session: WorkerSession, command: pb.Execute) -> None:
    """Host 0: gives a program its step in the island's order (as its part arrives) and tells the other hosts.

    While several tenants' programs saturate the island, the next step goes to the tenant with
    the least weighted device time instead (the island's ``FairShare``, which follows each step
    until its part has run on every host: the others report theirs in their answers to
    ``OrderGang``), so weights hold for programs that span hosts too, whether or not they
    communicate; each tenant's programs keep their order.
    """
    key, order = command.gang, session.order
    peers = [(address, session.peers.stub(address)) for address in command.gang_peers]  # (looked up on the loop)

    def assign() -> list:
        step, turn = order.assign(key)
        turn.wait_for(announce_step(peers, key, step))  # the step is done once every host's part is
        return [turn]

    order.share.submit(command.tenant or session.key, command.weight or 1.0, assign)


def dispatch(
    session: WorkerSession,
    program,
    args: Sequence[ArrayRecord],
    results: Sequence[ArrayRecord],
    keep: frozenset[int],
    arrived: float,
    timed: bool = True,
) -> list:
    """Runs a program now, on its turn's thread; the results hold its values or its error.

    ``timed``: the runtime reports the execution (else whoever follows the program does).
    """
    if session.ended.done:
        return []
    started = time.time()
    if started - arrived > 0.001:
        # Time it waited for its turn (the island's order, or busy devices shared by weight).
        session.post_event(event("wait", f"{program.name} waits its turn", program.device_ids, arrived, started))
    session.dispatched()
    try:
        values = session.runtime.execute(
            program, [a.value for a in args], keep, timed=session.report if timed else None
        )
    except Exception as error:  # noqa: BLE001 - the results hold it
        session.no_report()  # no event comes
        failure = as_request_error(error)
        session.note(logging.ERROR, f"running {program.name} failed: {failure.message}")
        for record in results:
            record.fail(failure)
        return []
    if not timed and not values:
        session.no_report()  # the share reports programs with results only
    for record, value in zip(results, values, strict=True):
        record.set(value)
    return values
