"""The ``pathways-nb`` command line reads as one tool: one flag spelling, the log level everywhere, the logs.

Every flag of every command (and of the ``%pathways`` magic) is declared with underscores and read
with hyphens too, found by walking the real parsers, so a command added later is checked with
nothing to list. ``up`` runs for real: its children log at its level to files it names, which
``pathways-nb logs`` shows (and follows) from another process, and which stay after a failed run.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from pathways_nb import cli
from pathways_nb.launch import cluster_logs
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer
from pathways_nb.notebook import magics
from pathways_nb.testing import wait_until

DECLARED = re.compile(r"--[a-z0-9]+(_[a-z0-9]+)*")


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(words, parser) of the program and each of its commands, "deploy k8s" as ("deploy", "k8s")."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*words, name))


def _programs():
    return [("pathways-nb", cli.build_parser()), ("%pathways", magics._parser())]


def _flag_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        for flag in action.option_strings:
            if flag.startswith("--"):
                yield flag, action


# Valid values of the flags whose values have a form (their metavar says which).
VALUES_BY_METAVAR = {"TENANT=N": "alice=3", "BYTES": "1024"}


def _value(action: argparse.Action) -> list[str]:
    """Words that give ``action`` a valid value (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if action.type is int:
        return ["3"]
    if action.type is float:
        return ["2.5"]
    return [VALUES_BY_METAVAR.get(action.metavar, "x")]


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """Words for the command's required flags and positionals, so that it parses."""
    words = []
    for action in parser._actions:
        if action.required and action.option_strings:
            words += [action.option_strings[0], *_value(action)]
        elif not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            words += ["x"] if action.nargs not in ("*", "?") else []
    return words


def test_every_flag_of_every_command_is_spelled_with_underscores_and_help_shows_only_that():
    problems = []
    for program, root in _programs():
        for words, parser in _commands(root):
            where = " ".join((program, *words))
            problems += [f"{where} {flag}" for flag, _action in _flag_actions(parser) if not DECLARED.fullmatch(flag)]
            shown = set(re.findall(r"(?<![\w-])--[\w-]+", parser.format_help()))
            problems += [f"{where} --help shows {flag}" for flag in shown if "-" in flag[2:]]
    assert not problems, "flags not spelled with underscores:\n" + "\n".join(problems)


def test_every_flag_of_every_command_reads_its_hyphen_spelling_as_itself():
    checked = 0
    for program, root in _programs():
        for words, parser in _commands(root):
            if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
                continue  # a group of commands: its commands are checked
            required = _required(parser)
            for flag, action in _flag_actions(parser):
                if "_" not in flag:
                    continue
                hyphens = flag.replace("_", "-")
                value = _value(action)
                declared = root.parse_args([*words, *required, flag, *value])
                assert root.parse_args([*words, *required, hyphens, *value]) == declared, (program, words, flag)
                if value:
                    assert root.parse_args([*words, *required, f"{hyphens}={value[0]}"]) == declared
                checked += 1
    assert checked > 40  # every command's: a walk that found nothing would pass


def test_former_names_are_read_as_the_flags_that_replaced_them_and_hidden():
    parser = cli.build_parser()
    assert parser.parse_args(["up", "--port", "0"]).server_port == 0
    for spelling in ("--executor_python", "--executor-python", "--colocated-python-executable"):
        args = parser.parse_args(["colocated-host", "--socket", "s", spelling, "/usr/bin/python3"])
        assert args.colocated_python_executable == "/usr/bin/python3"
    help_text = " ".join(
        parser._subparsers._group_actions[0].choices[c].format_help() for c in ("up", "colocated-host")
    )
    assert "--executor_python" not in help_text and not re.search(r"--port\b", help_text)


def test_what_is_not_a_flag_is_left_as_typed(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--no-such-flag", "1"])
    assert "unrecognized arguments: --no-such-flag 1" in capsys.readouterr().err
    # Abbreviations still work in either spelling; words after "--" are values, however they look.
    assert parser.parse_args(["up", "--hosts-per", "2"]).hosts_per_island == 2
    assert parser.parse_args(["logs", "--", "--log-level"]).process == ["--log-level"]


def test_a_command_added_later_reads_hyphens_with_nothing_declared():
    parser = cli.build_parser()
    targets = next(
        a for a in parser._subparsers._group_actions[0].choices["deploy"]._actions if a.dest == "deploy_target"
    )
    later = targets.add_parser("later")
    later.add_argument("--nodes_per_job", type=int)
    assert parser.parse_args(["deploy", "later", "--nodes-per-job", "4"]).nodes_per_job == 4


@pytest.mark.parametrize(
    "words",
    [
        [
            "deploy",
            "--log_level",
            "DEBUG",
            "k8s",
            "--islands",
            "1",
            "--hosts_per_island",
            "1",
            "--devices_per_host",
            "1",
            "--output",
            "o",
        ],
        [
            "deploy",
            "k8s",
            "--log-level",
            "DEBUG",
            "--islands",
            "1",
            "--hosts_per_island",
            "1",
            "--devices_per_host",
            "1",
            "--output",
            "o",
        ],
        ["kernel", "--log_level", "DEBUG", "install"],
        ["kernel", "--log_level", "INFO", "install", "--log_level", "DEBUG"],
        ["up", "--log_level", "DEBUG"],
        ["logs", "--log-level", "DEBUG"],
    ],
)
def test_the_log_level_is_honoured_at_every_level_and_the_last_given_wins(words):
    assert cli.build_parser().parse_args(words).log_level == "DEBUG"


def test_every_command_logs_at_warning_unless_told():
    root = cli.build_parser()
    for words, parser in _commands(root):
        if words and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            assert root.parse_args([*words, *_required(parser)]).log_level == "WARNING", words


# -- the logs of a cluster ------------------------------------------------------------------------


def _pathways_nb(*words: str, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pathways_nb.cli", *words]
    return subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _shown(*words: str, env: dict[str, str]) -> str:
    """What ``pathways-nb logs WORDS`` prints (it must succeed)."""
    command = [sys.executable, "-m", "pathways_nb.cli", "logs", *words]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def test_up_logs_at_its_level_to_files_it_names_which_logs_shows_follows_and_a_failed_run_keeps(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # a directory of running clusters of its own
    records = tmp_path / f"pathways-nb-{getpass.getuser()}" / "clusters"
    up = _pathways_nb(
        "up", "--islands", "1", "--devices_per_host", "1", "--server_port", "0", "--log_level", "INFO", env=env
    )
    follow = None
    try:
        printed = ""
        for line in iter(up.stdout.readline, ""):  # to its last line, or its end (a failed start)
            printed += line
            if line.startswith("  Ctrl-C stops it."):
                break
        match = re.search(r"its processes log \(INFO\) to (\S+)/: (.*)\n", printed)
        assert match, printed
        directory, names = Path(match[1]), match[2].split(", ")
        assert names == ["resource-manager.log", "worker-0-0.log", "proxy.log"]
        assert all((directory / name).is_file() for name in names)
        assert len(list(records.glob("*.json"))) == 1

        shown = _shown(env=env)
        for name in ("resource-manager", "worker-0-0", "proxy"):
            assert re.search(rf"^{name} *\| pathways-nb .* \(started in", shown, re.MULTILINE), shown
        # The children log at up's level: the worker's INFO record of its registration.
        assert re.search(r"^worker-0-0 +\| .* INFO registered as island0-host0", shown, re.MULTILINE), shown
        last = _shown("proxy", "--tail", "1", env=env)
        assert last.startswith("proxy | ") and last.count("\n") == 1, last

        follow = _pathways_nb("logs", "worker-0-0", "--follow", env=env)
        (worker,) = [c for c in psutil.Process(up.pid).children() if "worker" in c.cmdline()]
        worker.send_signal(signal.SIGSEGV)
        log = directory / "worker-0-0.log"
        wait_until(
            lambda: log.read_text().count("pathways-nb worker island0-host0 at"),
            60,
            "the worker's second start in its log",
            holds=lambda starts: starts == 2,
        )
    finally:
        up.send_signal(signal.SIGINT)
        _out, err = up.communicate(timeout=60)
    followed, _ = follow.communicate(timeout=30)
    # What --follow showed: the worker's first start, then the new one's, then the end of the cluster.
    assert followed.count("worker-0-0 | pathways-nb worker island0-host0 at") == 2, followed
    assert followed.rstrip().endswith("stopped)"), followed
    # The run failed (a worker crashed): its logs stay, and up says so and why.
    assert f"the cluster's directory {directory.parent} is kept: logs/ tells what went wrong" in err, err[-3000:]
    assert "worker-0-0 killed by signal SIGSEGV" in err
    assert "INFO stopping on SIGTERM" in (directory / "proxy.log").read_text()
    assert not list(records.glob("*.json")), "a stopped cluster's record is removed"


def test_a_run_that_went_well_leaves_nothing_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    clean = LocalCluster(start=False)
    clean.close()
    assert not os.path.exists(clean.directory) and clean.kept_because == ""
    kept = LocalCluster(start=False, keep_logs=True)
    kept.close()
    assert os.path.isdir(kept.log_directory) and kept.kept_because == "logs/ was asked for"


def test_a_log_with_an_error_is_a_failed_run(tmp_path):
    log = tmp_path / "worker.log"
    child = ChildServer("worker-0-0", ["worker"], log_path=str(log))
    log.write_text(
        "pathways-nb worker ... (started in 1.0 s)\n2026-12-03 10:00:00,001 pathways_nb.worker WARNING slow\n"
    )
    assert child.first_error() is None
    log.write_text(
        'Exception in thread pathways-x:\nTraceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "    g()\nKeyError: 3\n"
    )
    assert child.first_error() == "KeyError: 3"
    before_stop = "pathways-nb worker ... (started in 1.0 s)\n"
    log.write_text(before_stop + "2026-12-03 10:00:00,001 pathways_nb.worker.service ERROR session 4 failed\n")
    assert child.first_error() == "2026-12-03 10:00:00,001 pathways_nb.worker.service ERROR session 4 failed"
    assert child.first_error(within_bytes=len(before_stop)) is None  # logged while the cluster stopped
    child.close()
    assert log.exists(), "a log given to a child outlives it"


def test_logs_says_which_cluster_to_choose(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit):
        cli.main(["logs"])
    assert "no local cluster of yours is running: start one with pathways-nb up" in capsys.readouterr().err
    for port in (41000, 41001):  # two clusters this process owns (records as LocalCluster writes them)
        log = tmp_path / f"{port}.log"
        log.write_text(f"hello from {port}\n")
        cluster_logs.record(
            cluster_logs.ClusterRecord(
                f"grpc://127.0.0.1:{port}", port, os.getpid(), str(tmp_path), {"proxy": str(log)}
            )
        )
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_owner = cluster_logs.ClusterRecord("grpc://127.0.0.1:41002", 41002, int(ended.stdout), str(tmp_path), {})
    stale = cluster_logs.record(dead_owner)  # a cluster whose owner was killed: ignored, and its record removed
    with pytest.raises(SystemExit):
        cli.main(["logs"])
    assert "2 local clusters of yours are running" in capsys.readouterr().err
    assert not stale.exists()
    assert cli.main(["logs", "--server_port", "41001"]) == 0
    assert capsys.readouterr().out == "proxy | hello from 41001\n"
    with pytest.raises(SystemExit):
        cli.main(["logs", "worker-9-9", "--server_port", "41001"])
    assert "has no process worker-9-9; its processes: proxy" in capsys.readouterr().err


def test_a_worker_given_a_log_directory_that_is_not_one_says_so_and_exits(tmp_path):
    """Found at start, in one line, not when the first group's member fails to start on the orders' thread."""
    missing = tmp_path / "no-such-directory"
    arguments = ["worker", "--resource_manager_address", "127.0.0.1:1", "--log_directory", str(missing)]
    worker = subprocess.run(
        [sys.executable, "-m", "pathways_nb.cli", *arguments], capture_output=True, text=True, timeout=120
    )
    assert worker.returncode == 2, worker.stderr[-2000:]
    assert f"pathways-nb worker: --log_directory '{missing}' is not a directory: create it" in worker.stderr


@pytest.mark.parametrize("host", ["0", "a/1", "0/-1", "0/1/2", "/"])
def test_drain_refuses_what_is_not_island_slash_host_before_calling_anyone(host, capsys):
    with pytest.raises(SystemExit, match="2"):
        cli.main(["drain", host, "--address", "127.0.0.1:1"])
    assert f"name the host as ISLAND/HOST (e.g. 0/1), not {host!r}" in capsys.readouterr().err


def test_a_server_on_a_port_another_server_holds_is_refused_not_sharing_it():
    """gRPC's default SO_REUSEPORT let a second server bind the same port and take part of its connections."""
    first = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"])
    first.start()
    try:
        second = subprocess.run(
            [sys.executable, "-m", "pathways_nb.cli", "proxy", "--server_port", str(first.port), "--devices", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0, second.stderr[-2000:]
        assert f"cannot listen on 127.0.0.1:{first.port}; is the port in use?" in second.stderr
    finally:
        first.close()
