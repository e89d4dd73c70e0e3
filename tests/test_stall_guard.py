"""The stall guard (``pathways_nb.testing.stall_guard``) fails a test whose server ran a callback that held its loop,
and says which process, how long and where; the test after it, on the same server, passes."""

from __future__ import annotations

from pathlib import Path

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
