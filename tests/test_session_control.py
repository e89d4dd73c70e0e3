"""Pausing and resuming sessions, from the client's side, where no server is needed: the priority a session
asks for, and how ``pathways-nb sessions`` and ``%pathways`` read their words. tests/test_suspend.py drives
them against a real cluster's sessions.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from pathways_nb import cli
from pathways_nb.client import connection
from pathways_nb.core.session_options import PRIORITY, PRIORITY_ENV, SessionOptions
from pathways_nb.errors import PathwaysError

SECRET = "alice's secret"
PREEMPTED = "preempted by tenant carol (priority 10, exclusive)"


# -- the priority a session asks for -----------------------------------------------------------


@pytest.mark.parametrize("priority", [0, 7, -3, 2**31 - 1])
def test_the_priority_travels_with_the_session_options(priority):
    data = SessionOptions(tenant="t", priority=priority).to_initialization_data()
    assert data[PRIORITY] == str(priority).encode()
    assert SessionOptions.from_attributes(data, 60.0, "d").priority == priority


def test_a_client_that_sends_no_priority_gets_0():
    data = SessionOptions(tenant="t").to_initialization_data()
    del data[PRIORITY]
    assert SessionOptions.from_attributes(data, 60.0, "d").priority == 0


@pytest.mark.parametrize("sent", [b"high", b"1.5", b"", str(2**31).encode()])
def test_a_malformed_priority_is_refused_naming_the_attribute(sent):
    with pytest.raises(ValueError, match=rf"^{PRIORITY} must be an integer from -2147483648 to 2147483647"):
        SessionOptions.from_attributes({PRIORITY: sent}, 60.0, "d")


@pytest.mark.parametrize("priority", [1.5, "3", True, -(2**31) - 1])
def test_a_priority_that_is_no_int32_is_refused(priority):
    with pytest.raises(ValueError, match=r"^priority must be an integer"):
        SessionOptions(priority=priority)


@pytest.fixture
def environment(monkeypatch):
    """None of the session variables set; the test sets the ones it reads."""
    for name in ("PATHWAYS_TENANT", "PATHWAYS_WEIGHT", "PATHWAYS_ONE_SLICE", PRIORITY_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_jax_program_asks_for_a_priority_with_its_variable(environment):
    assert SessionOptions.from_environment() is None
    environment.setenv(PRIORITY_ENV, " 5 ")
    options = SessionOptions.from_environment()
    assert options is not None and options.priority == 5 and options.weight == 1.0
    environment.setenv("PATHWAYS_TENANT", "batch")
    environment.setenv(PRIORITY_ENV, "-1")
    assert SessionOptions.from_environment() == SessionOptions(tenant="batch", priority=-1)


def test_a_malformed_priority_variable_is_named(environment):
    environment.setenv(PRIORITY_ENV, "urgent")
    with pytest.raises(ValueError, match=rf"^{PRIORITY_ENV} must be an integer .*, got 'urgent'"):
        SessionOptions.from_environment()
    # A malformed priority is not blamed on the weight, which is read in the same call.
    environment.setenv("PATHWAYS_WEIGHT", "2")
    with pytest.raises(ValueError, match=rf"^{PRIORITY_ENV}"):
        SessionOptions.from_environment()


# -- pathways-nb sessions ----------------------------------------------------------------------


def test_sessions_lists_by_default_and_takes_ids_after_its_action():
    parser = cli.build_parser()
    listed = parser.parse_args(["sessions"])
    assert (listed.action, listed.session_ids, listed.address) == ("list", [], None)
    suspend = parser.parse_args(["sessions", "suspend", "3", "4", "--address", "h:1", "--token-file", "t"])
    assert (suspend.action, suspend.session_ids, suspend.address, suspend.token_file) == ("suspend", [3, 4], "h:1", "t")


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["suspend"], "name the sessions to suspend by id (pathways-nb sessions list shows them)"),
        (["resume"], "name the sessions to resume by id"),
    ],
)
def test_sessions_refuses_to_act_on_sessions_it_was_not_named(capsys, words, said):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sessions", *words, "--address", "127.0.0.1:1"])  # (refused before anything is called)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"pathways-nb sessions: {said}")


def test_sessions_says_where_the_address_comes_from(capsys, monkeypatch):
    monkeypatch.delenv("PATHWAYS_ADDRESS", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["sessions"])
    assert "pass the proxy's --address HOST:PORT, or set PATHWAYS_ADDRESS" in capsys.readouterr().err


# -- %pathways suspend | resume | sessions, connect --priority -----------------------------------


@pytest.mark.parametrize(("words", "priority"), [([], 0), (["--priority", "5"], 5), (["--priority", "-2"], -2)])
def test_connect_asks_for_the_priority_it_is_given(magic, monkeypatch, words, priority):
    asked = {}

    def connect(address, **options):
        asked.update(options)
        raise PathwaysError("not here")

    monkeypatch.setattr(connection, "connect", connect)
    with pytest.raises(UsageError, match="not here"):
        magic.pathways(" ".join(["connect", "grpc://127.0.0.1:1", *words]))
    assert asked["priority"] == priority


def test_help_lists_suspend_resume_and_sessions(magic, capsys):
    magic.pathways("help")
    shown = capsys.readouterr().out
    assert "[--priority N]" in shown and "| sessions |" in shown and "%pathways suspend | resume" in shown
