"""A worker's table of programs (``worker.programs``), as a state machine apart from any server."""

from __future__ import annotations

import pytest

from pathways_nb.protocol.errors import NotFound
from pathways_nb.worker.programs import Programs


def test_work_waiting_for_a_compile_fails_when_the_program_is_dropped_first():
    """An Execute chained onto a compile still on its way waited forever if the program was dropped meanwhile
    (the compile then made a new record, and the one the Execute waited on never resolved)."""
    programs = Programs()  # (no compile runs here: that is the pool's CompileCache)
    programs.expect(7)
    waiting = programs.record(7)
    assert not waiting.ready
    programs.forget(7)
    assert waiting.ready and isinstance(waiting.error, NotFound) and "dropped" in waiting.error.message
    programs.expect(7)  # the id may come again (another stream's compile): a fresh record
    assert not programs.record(7).ready


def test_a_dropped_program_is_unknown_and_an_unknown_id_says_so():
    programs = Programs()
    programs.expect(3)
    programs.forget(3)
    with pytest.raises(NotFound, match="is not compiled on this worker"):
        programs.record(3)


def test_a_compile_gives_its_program_to_every_stream_that_expected_it_and_a_failure_only_to_the_waiting():
    """Two streams expect the same id: the first compile that finishes gives the program to both; a later
    compile's failure does not undo it, and a failed record is replaced at the next expect."""
    programs = Programs()
    first, second = programs.expect(5), programs.expect(5)
    assert first is second
    program = object()
    programs.compiled(first, program)
    programs.failed(second, NotFound("a second compile failed"))
    assert programs.get(5) is program
    failed = programs.expect(6)
    programs.failed(failed, NotFound("no"))
    with pytest.raises(NotFound, match="no"):
        programs.get(6)
    assert programs.expect(6) is not failed and not programs.record(6).ready


def test_forgetting_the_last_id_of_a_program_lets_the_compile_cache_drop_it():
    programs = Programs()
    program = object()
    for program_id in (1, 2):
        programs.compiled(programs.expect(program_id), program)
    assert programs.forget(1) is None  # id 2 still names it
    assert programs.forget(2) is program
