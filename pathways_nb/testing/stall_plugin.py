"""The stall guard as a pytest plugin (``pytest_plugins = ["pathways_nb.testing.stall_plugin"]``): every test
fails whose servers' loops ran one callback for more than 0.5 s while it ran (``testing.stall_guard``)."""

from __future__ import annotations

import pytest

from pathways_nb.testing import stall_guard


def pytest_configure(config) -> None:
    stall_guard.enable()


@pytest.fixture(autouse=True)
def no_long_callback_stalls():
    """After the test (and the fixtures it alone used), reads the loop watchdog of every server it started and
    of every one still serving, and fails it with each callback that held a loop for more than 0.5 s."""
    yield
    stalls = stall_guard.check()
    if stalls:
        pytest.fail(stall_guard.failure(stalls), pytrace=False)


def pytest_sessionfinish(session) -> None:
    """What the servers that stopped after the last test (the session's own, a module's) saw since it ran."""
    stalls = stall_guard.check()
    if stalls:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", "after the last test", red=True)
            reporter.write_line(stall_guard.failure(stalls))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(stall_guard.summary())
