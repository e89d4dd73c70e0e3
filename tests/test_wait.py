"""``core.wait``: the one way pathways-nb polls for a condition, the launchers' and the tests' alike."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pathways_nb import testing
from pathways_nb.core.wait import poll, poll_on_loop, wait_until


def test_the_tests_wait_is_the_library_s():
    assert testing.wait_until is wait_until


def test_it_returns_the_first_value_that_holds():
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 10, "three", holds=lambda n: n >= 3, interval_s=0) == 3


def test_a_wait_that_ends_without_the_condition_names_what_and_the_last_value():
    with pytest.raises(TimeoutError, match=r"^the answer: not within 0.01 s; the last value seen: \[41\]$"):
        wait_until(lambda: [41], 0.01, "the answer", holds=lambda v: v == [42], interval_s=0.001)


def test_a_long_last_value_is_quoted_by_its_end():
    with pytest.raises(TimeoutError) as raised:
        wait_until(lambda: "x" * 5000 + "the end", 0, "a log", holds=lambda _text: False)
    assert str(raised.value).endswith("the end'") and "characters before) ..." in str(raised.value)


def test_a_launcher_raises_its_own_error_made_from_the_last_value():
    with pytest.raises(RuntimeError, match="only 2 of 3"):
        wait_until(
            lambda: 2, 0, "all 3", holds=lambda n: n == 3, timeout_error=lambda n: RuntimeError(f"only {n} of 3")
        )


def test_an_error_of_the_condition_ends_the_wait_at_once():
    def gone():
        raise ProcessLookupError("the process died")

    with pytest.raises(ProcessLookupError):
        wait_until(gone, None, "never")


def test_poll_says_whether_the_condition_held_and_with_no_deadline_waits_until_it_does():
    assert poll(lambda: "draining", 0, holds=lambda s: s == "drained") == ("draining", False)
    counter = itertools.count()
    assert poll(lambda: next(counter), None, holds=lambda n: n == 5, interval_s=0) == (5, True)


def test_poll_on_loop_lets_the_loop_serve_between_calls():
    served = []

    async def main():
        asyncio.get_running_loop().call_later(0.02, served.append, "other work")
        return await poll_on_loop(lambda: served[:], 5, interval_s=0.005)

    value, held = asyncio.run(main())
    assert held and value == ["other work"]


def test_poll_on_loop_gives_up_at_its_deadline_with_the_last_value():
    value, held = asyncio.run(poll_on_loop(lambda: 0, 0.02, interval_s=0.005))
    assert (value, held) == (0, False)
