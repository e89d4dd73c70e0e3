"""A worker's table of programs (``worker.programs``), as a state machine apart from any server."""

from __future__ import annotations

import pytest

from pathways_nb.protocol.errors import NotFound
from pathways_nb.worker.programs import Programs


def test_work_waiting_for_a_compile_fails_when_the_program_is_dropped_first():
    """An Execute chained onto a compile still on its way waited forever if the program was dropped meanwhile
    (the compile then made a new record, and the one the Execute waited on never resolved)."""
    programs = Programs(runtime=None)  # (no compile runs here)
    programs.expect(7)
    waiting = programs.record(7)
    assert not waiting.ready
    programs.forget(7)
    assert waiting.ready and isinstance(waiting.error, NotFound) and "dropped" in waiting.error.message
    programs.expect(7)  # the id may come again (another stream's compile): a fresh record
    assert not programs.record(7).ready


def test_a_dropped_program_is_unknown_and_an_unknown_id_says_so():
    programs = Programs(runtime=None)
    programs.expect(3)
    programs.forget(3)
    with pytest.raises(NotFound, match="is not compiled on this worker"):
        programs.record(3)
