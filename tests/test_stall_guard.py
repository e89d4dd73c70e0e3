"""The stall guard (``pathways_nb.testing.stall_guard``) fails a test whose server ran a callback that held its loop,
and says which process, how long and where; the test after it, on the same server, passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.testing import stall_guard

HOLDS_THE_LOOP = Path(__file__).parent / "data" / "holds_the_loop"

TESTS = f"""
from pathways_nb import testing
from pathways_nb.launch import local_cluster
from pathways_nb.core.security import ClusterCredentials


def test_a_proxy_whose_loop_is_held(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", {str(HOLDS_THE_LOOP)!r})
    monkeypatch.setenv("PATHWAYS_TEST_HOLD_LOOP_S", "0.8")
    with testing.proxy_process(1) as server:
        testing.wait_until(
            lambda: local_cluster.loop_stats(server.hostport, ClusterCredentials()),
            60,
            "the proxy's loop held in a callback",
            holds=lambda stats: stats.stalls_in_callbacks >= 1,
        )


def test_after_it():
    pass
"""


def test_a_test_whose_server_held_its_loop_fails_naming_the_process_the_length_and_where(pytester):
    pytester.makeconftest('pytest_plugins = ["pathways_nb.testing.stall_plugin"]')
    pytester.makepyfile(test_held=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_a_proxy_whose_loop_is_held*",
            "*a server's loop ran one callback for more than 0.5 s:",
            "*proxy (pathways-nb proxy at grpc://127.0.0.1:*): one callback held the loop for 0.[789]* s, until *;"
            " the loop was in:",
            "*sitecustomize.py*in holds_the_loop*",
        ]
    )


AFTER_THE_LAST_TEST = f"""
import os

import pytest

from pathways_nb import testing
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.launch import local_cluster


@pytest.fixture(scope="module")
def proxy_held_later():
    os.environ.update(PYTHONPATH={str(HOLDS_THE_LOOP)!r}, PATHWAYS_TEST_HOLD_LOOP_AFTER_S="5")
    with testing.proxy_process(1) as server:
        yield server
        testing.wait_until(
            lambda: local_cluster.loop_stats(server.hostport, ClusterCredentials()),
            60,
            "the proxy's loop held in a callback",
            holds=lambda stats: stats.stalls_in_callbacks >= 1,
        )


def test_before_the_stall(proxy_held_later):
    pass
"""


def test_a_stall_after_the_last_test_fails_the_run(pytester):
    """A shared server's stall after the last test's check (a module's or the session's fixture stopping it) fails
    the run at its end, naming it."""
    pytester.makeconftest('pytest_plugins = ["pathways_nb.testing.stall_plugin"]')
    pytester.makepyfile(test_held_later=AFTER_THE_LAST_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= after the last test =*",
            "*proxy (pathways-nb proxy at grpc://127.0.0.1:*): one callback held the loop for 0.[789]* s*",
        ]
    )


BLOCKED = """  File "/srv/pathways_nb/proxy/session.py", line 298, in after
    run_after(inputs, work, self.on_loop, outputs, on_error)
  File "/usr/lib/python3.11/threading.py", line 331, in wait
    gotit = waiter.acquire(True, timeout)"""
ENTERING = """  File "/srv/pathways_nb/core/dataflow.py", line 394, in run_after
    when_all([record.pending for record in inputs], lambda error: schedule(lambda: run_later(error)))
  File "/srv/pathways_nb/core/dataflow.py", line 112, in when_all
    def when_all(pendings: Sequence[Pending], callback: Callable[[BaseException | None], None]) -> None:"""


def _stats(process: str, counted: int, *stalls: tuple[float, float, bool, str]) -> pb.LoopStats:
    stats = pb.LoopStats(process=process, stalls_in_callbacks=counted)
    for seconds, ended, in_callback, where in stalls:
        stats.longest.add(seconds=seconds, ended=ended, in_callback=in_callback, where=where)
    return stats


def test_each_stall_is_judged_once_and_only_a_callback_that_blocks_fails():
    """A blocked callback over 0.5 s fails the check after it and no later one; one found entering a function (the
    GIL's or a CPU's wait), one shorter, or a wait outside callbacks does not fail."""
    now = time.time()
    read = [[_stats("proxy", 1, (0.6, now - 5, True, BLOCKED), (2.0, now - 6, False, "(selector)"))]]
    watched = stall_guard.Watched("a cluster", lambda: read[-1])
    (stall,), doubts = watched.judge(now)
    assert (stall.process, stall.seconds, stall.where) == ("proxy", 0.6, BLOCKED) and not doubts
    assert "proxy (a cluster): one callback held the loop for 0.60 s" in str(stall)
    assert watched.judge(now + 1) == ([], [])  # judged already
    read.append(
        [
            _stats(
                "proxy",
                3,
                (0.6, now - 5, True, BLOCKED),
                (1.2, now + 2, True, ENTERING),
                (0.4, now + 2, True, BLOCKED),
                (2.0, now - 6, False, "(selector)"),
            )
        ]
    )
    stalls, (doubt,) = watched.judge(now + 3)
    assert not stalls and "held the loop for 1.20 s" in doubt and "waiting for the GIL or a CPU" in doubt


def test_a_callback_stall_counted_but_not_kept_is_a_doubt_not_a_failure():
    """Eight longer stalls kept: a ninth in a callback is counted, its length unknown."""
    now = time.time()
    kept = [(1.0 + i, now - 60, False, "(selector)") for i in range(8)]
    watched = stall_guard.Watched("a cluster", lambda: [_stats("worker island0-host0", 1, *kept)])
    stalls, (doubt,) = watched.judge(now)
    assert not stalls and "worker island0-host0 (a cluster)" in doubt and "how long is unknown" in doubt
