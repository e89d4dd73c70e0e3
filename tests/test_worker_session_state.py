"""A worker session's state (``worker.session_state``), driven directly: no server, no loop, no threads."""

from __future__ import annotations

import numpy as np
import pytest

from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, NotFound
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.session_state import SessionState, Unreported
from pathways_nb.worker.suspended import HostBudget, HostCopy


def _meta(shape=(2,)) -> pb.ArrayMeta:
    return pb.ArrayMeta(dtype_kind=0, shape=list(shape))


class _Deletable:
    """A value that can be deleted, as a device array can."""

    def __init__(self) -> None:
        self.deleted = False

    def is_deleted(self) -> bool:
        return self.deleted

    def delete(self) -> None:
        self.deleted = True


def test_ids_are_unique_and_an_unknown_one_names_the_session():
    state = SessionState("s1")
    state.new(1)
    with pytest.raises(InvalidRequest, match="already in use in session s1"):
        state.new(1)
    with pytest.raises(NotFound, match="array 2 is unknown on this worker \\(session s1\\)"):
        state.record(2)


def test_an_upload_in_chunks_is_whole_only_with_its_last_chunk():
    state = SessionState("s")
    record, data = state.upload(4, _meta(), b"ab", more=True)
    assert data == b"" and state.record(4) is record and not record.ready
    again, data = state.upload(4, _meta(), b"cd", more=False)
    assert again is record and bytes(data) == b"abcd"
    with pytest.raises(InvalidRequest):  # the upload is over: the id is taken
        state.upload(4, _meta(), b"ef", more=False)


def test_a_suspended_session_takes_only_resume_forget_and_relocate():
    state = SessionState("s")
    with pytest.raises(InvalidRequest, match="no operation"):
        state.admit(None)
    state.admit("execute")
    state.suspended = True
    for kind in ("resume", "forget", "relocate"):
        state.admit(kind)
    with pytest.raises(FailedPrecondition, match="resume it before sending execute"):
        state.admit("execute")


def test_forgetting_drops_ready_arrays_at_once_and_arriving_ones_once_they_arrive():
    state = SessionState("s")
    ready, arriving = state.new(1), state.new(2)
    ready.set(np.zeros(2))
    forgotten = state.forget([1, 2, 3], delete=False)
    assert 1 not in state.arrays and state.record(2) is arriving
    assert forgotten.arriving == [(2, arriving)]
    arriving.set(np.ones(2))
    state.drop(2, arriving)
    assert state.arrays == {}


def test_a_dropped_id_used_again_is_not_dropped_by_the_old_records_arrival():
    state = SessionState("s")
    old = state.new(7)
    state.forget([7], delete=False)
    state.drop(7, old)
    new = state.new(7)
    state.drop(7, old)  # the old record's late drop
    assert state.record(7) is new


def test_deleting_keeps_the_record_and_deletes_its_value():
    state = SessionState("s")
    record = state.new(1)
    value = _Deletable()
    record.set(value)
    state.forget([1], delete=True)
    assert state.record(1) is record and value.deleted and record.is_deleted


def test_an_expected_array_is_the_same_record_whether_its_push_or_its_expect_comes_first():
    state = SessionState("s")
    pushed = state.expected(3, _meta())
    assert state.expected(3, _meta()) is pushed


def test_unsettled_names_an_array_still_arriving():
    state = SessionState("s")
    state.new(1).set(np.zeros(2))
    assert state.unsettled() is None
    waiting = state.new(2)
    assert state.unsettled() is waiting


def test_island_turns_are_given_up_once_and_the_session_end_lists_those_still_held():
    state = SessionState("s")
    state.wait_turn("a")
    state.wait_turn("b")
    state.take_turn("a")
    assert not state.give_up_turn("a")  # taken: nothing to give up
    assert state.give_up_turn("b") and not state.give_up_turn("b")
    state.wait_turn("c")
    closed = state.close()
    assert closed.turns == ["c"] and state.closed and state.gang_waiting == set()


def test_closing_hands_over_every_array_and_forgets_uploads():
    state = SessionState("s")
    first = state.new(1)
    state.upload(2, _meta(), b"ab", more=True)
    closed = state.close()
    assert first in closed.arrays and len(closed.arrays) == 2
    assert state.arrays == {}
    state.upload(2, _meta(), b"", more=True)  # a fresh upload (the old one's bytes went with the session)


def test_unreported_programs_drain_when_the_last_event_comes():
    unreported = Unreported()
    assert unreported.drained().done
    unreported.add()
    unreported.add()
    drained = unreported.drained()
    assert unreported.drained() is drained and not drained.done
    unreported.done()
    assert not drained.done
    unreported.done()
    assert drained.done and unreported.count == 0
    assert unreported.drained() is not drained  # a new wait after it starts done


class _Value:
    """What a host copy keeps of an array: its shape and sharding."""

    shape = (2,)
    sharding = None


def test_suspending_lets_a_copy_go_whose_array_was_forgotten_meanwhile_and_resuming_puts_back_the_others():
    state = SessionState("s")
    kept, forgotten = state.new(1), state.new(2)
    kept.set(np.zeros(2))
    forgotten.set(np.zeros(2))
    ids, records = [1, 2], [kept, forgotten]
    state.forget([2], delete=False)  # while the copies were made on the pool
    budget = HostBudget(None)
    copies = [HostCopy(_Value(), budget, []), HostCopy(_Value(), budget, [])]
    state.suspend(ids, records, copies)
    assert state.suspended and kept.value is copies[0] and copies[1].is_deleted()
    assert state.host_copies() == [kept]
    back = np.ones(2)
    state.resume([kept], [copies[0]], [back])
    assert not state.suspended and kept.value is back
