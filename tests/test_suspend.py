"""Suspending and resuming sessions: their devices go to others, and come back with every array intact.

One cluster of two islands (one host, two CPU devices each) serves these tests, with the resource
manager's idle policy (``--suspend_idle_after 2``) and priority ceilings (``boss`` up to 10, everyone
else up to 5). Clients are stock jax processes; what they hold and compute is checked bitwise, and
what the proxy says of each session (its state and why) is read as an operator reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from IPython.core.error import UsageError

from pathways_nb import cli
from pathways_nb.client import tables
from pathways_nb.client.connection import Session
from pathways_nb.client.observe import Observer
from pathways_nb.errors import PathwaysError
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import WireSession, finished_ok, python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
IDLE_AFTER_S = 2.0
MIB = 1 << 20
BUDGET = 64 * MIB


@pytest.fixture(scope="module")
def suspending_cluster():
    with LocalCluster(
        islands=2,
        devices_per_host=2,
        suspend_idle_after_s=IDLE_AFTER_S,
        priority_ceilings={"boss": 10, "*": 5},
        suspend_memory_budget=BUDGET,
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def operator(suspending_cluster):
    observer = Observer(suspending_cluster.address, token=suspending_cluster.token)
    yield observer
    observer.close()


def _client(cluster: LocalCluster, script: str, *args: str):
    return python_script(CLIENTS / script, cluster.address, *args, env={"PATHWAYS_CLUSTER_TOKEN": cluster.token})


def _session_of(operator: Observer, tenant: str) -> pb.SessionInfo | None:
    sessions = [s for s in operator.state().sessions if s.tenant == tenant]
    return sessions[0] if sessions else None


def _line(process) -> str:
    line = process.stdout.readline().strip()
    if not line:
        process.kill()
        raise AssertionError(f"the client ended early:\n{process.communicate()[1][-4000:]}")
    return line


def _spilled_bytes(cluster: LocalCluster) -> int:
    return sum(path.stat().st_size for path in Path(cluster.storage_root, "suspended").rglob("*.npy"))


def test_suspended_session_keeps_its_arrays_and_programs(suspending_cluster, operator):
    """256 MiB of arrays (sharded, int8, bfloat16) and a compiled program survive a suspension, in host memory up
    to each host's budget and in files beyond it: arrays deleted or dropped meanwhile resume nothing, and their
    copies go at once; a program dispatched while suspended resumes the session and runs, without compiling
    anything again; the files are gone once it has."""
    client = _client(suspending_cluster, "suspends_its_session.py", "256")
    assert _line(client) == "suspended"
    # Island 0's one host holds the 256 MiB array and the 128 MiB one to drop: what its budget does not keep is
    # on disk.
    spilled = _spilled_bytes(suspending_cluster)
    assert spilled >= (256 + 128) * MIB - BUDGET
    _tell(client, "let go")
    assert _line(client) == "let go"
    # The dropped array's copy goes while the session stays suspended, files and all (at least the part of its
    # 128 MiB that the budget did not keep).
    wait_until(
        lambda: _spilled_bytes(suspending_cluster),
        30,
        "the dropped array's files removed",
        holds=lambda left: left <= spilled - (128 * MIB - BUDGET),
    )
    assert _session_of(operator, "sleeper").state == "suspended"  # letting go (and checking it) resumed nothing
    _tell(client, "resume")
    found = json.loads(finished_ok(client, 300).splitlines()[-1])
    wait_until(lambda: _spilled_bytes(suspending_cluster), 30, "the files removed", holds=lambda left: left == 0)
    assert found["state_suspended"] == "suspended", found
    assert found["state_after_letting_go"] == "suspended", found
    assert found["state_after"] == "running", found
    assert found["result_equal"] and found["big_equal"] and found["small_equal"] and found["halves_equal"], found
    assert found["compiles_after_resume"] == 0, found


def _tell(process, line: str) -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _takes(cluster: LocalCluster, tenant: str, island: int, priority: int, processes: list):
    """A client that takes ``island`` exclusively at ``priority`` (added to ``processes``), once it has it."""
    taker = _client(cluster, "takes_an_island.py", tenant, str(island), str(priority))
    processes.append(taker)
    granted, _, waited_s = _line(taker).partition(" ")
    assert granted == "granted" and float(waited_s) < 30, (granted, waited_s)
    return taker


@contextlib.contextmanager
def _ended_at_the_end() -> Iterator[list]:
    """A list of client processes that are killed at the end, whatever happened, unless they ended."""
    processes: list = []
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


def test_higher_priority_preempts_and_the_preempted_training_goes_on(suspending_cluster, operator):
    """A trains with island 1 to itself at priority 0; boss asks for it at priority 10 and gets it at once
    (A is suspended, its loop waits); when boss leaves, A resumes, and every loss is as on local JAX."""
    with _ended_at_the_end() as processes:
        trainer = _client(suspending_cluster, "trains_until_told.py", "trainer", "1", "0")
        processes.append(trainer)
        assert _line(trainer) == "training"
        boss = _takes(suspending_cluster, "boss", 1, 10, processes)
        preempted = _session_of(operator, "trainer")
        assert preempted.state in ("suspended", "queued"), preempted
        assert "preempted by" in preempted.state_reason and "boss" in preempted.state_reason, preempted
        _tell(boss, "done")
        assert _line(boss) == "released"
        wait_until(lambda: _session_of(operator, "trainer").state, 60, "the trainer runs again", holds="running".__eq__)
        _tell(trainer, "stop")
        result = json.loads(finished_ok(trainer, 120).splitlines()[-1])
    assert result["steps"] > 1 and result["same_losses"], result


def test_idle_session_gives_its_island_to_a_waiting_one(suspending_cluster, operator):
    """napper holds island 0 and goes idle; waiter asks for it: napper is suspended once idle for 2 s, waiter
    runs; napper's next call waits for waiter to leave, then finds every array as it was."""
    with _ended_at_the_end() as processes:
        napper = _client(suspending_cluster, "keeps_arrays_while_idle.py", "0")
        processes.append(napper)
        assert _line(napper) == "idle"
        waiter = _takes(suspending_cluster, "waiter", 0, 0, processes)
        idle = _session_of(operator, "napper")
        assert idle.state == "suspended", idle
        assert "idle for" in idle.state_reason and "waiter" in idle.state_reason, idle
        _tell(napper, "wake")
        wait_until(lambda: _session_of(operator, "napper").state, 30, "napper queues", holds="queued".__eq__)
        _tell(waiter, "done")
        assert _line(waiter) == "released"
        assert _line(napper) == "intact"
        finished_ok(napper, 60)


def test_priority_above_the_ceiling_is_refused(suspending_cluster, operator):
    """A tenant that asks for more than its ceiling is told which ceiling (the stock client tries again until its
    time-out, kept short here), and nothing is allocated."""
    for tenant, priority, ceiling in (("someone", "6", "5"), ("boss", "11", "10")):
        out = finished_ok(
            python_script(CLIENTS / "asks_for_a_priority.py", suspending_cluster.address, tenant, priority), 120
        )
        assert f"priority {priority}" in out and f"ceiling {ceiling}" in out, out
    assert not {"someone", "boss"} & {allocation.tenant for allocation in operator.state().allocations}


def test_control_refuses_bad_requests(suspending_cluster, operator, proxy_server):
    """Unknown sessions, no sessions named, no token, and a single-process proxy's sessions: clear errors."""
    control = pb.SessionControl
    with pytest.raises(PathwaysError, match="no sessions \\[987654\\]"):
        operator.control_sessions(control.SUSPEND, session_ids=[987654])
    with pytest.raises(PathwaysError, match="name the sessions to suspend or resume"):
        operator.control_sessions(control.SUSPEND)
    with grpc.insecure_channel(suspending_cluster.address.removeprefix("grpc://")) as channel:
        with pytest.raises(grpc.RpcError) as tokenless:
            cluster_pb2_grpc.ObserveStub(channel).ControlSessions(control(action=control.LIST), timeout=10)
    assert tokenless.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with WireSession(proxy_server.address) as wire:
        single = Observer(proxy_server.address)
        try:
            with pytest.raises(PathwaysError, match="only a cluster's sessions can"):
                single.control_sessions(control.SUSPEND, session_ids=[wire.session_id])
        finally:
            single.close()


@pytest.fixture
def two_holders(suspending_cluster):
    """alice's and bob's sessions on island 0 (clients that hold an array), and alice's connection as her
    notebook's ``Session`` sees it (her tenant, her connection's secret, the cluster's token)."""
    with _ended_at_the_end() as processes:
        clients = {tenant: _client(suspending_cluster, "holds_a_session.py", tenant) for tenant in ("alice", "bob")}
        processes.extend(clients.values())
        secrets = {tenant: _line(client) for tenant, client in clients.items()}
        token, secret = suspending_cluster.token, secrets["alice"]
        alice = Session(suspending_cluster.address, [], "cpu", "pathways-nb", "alice", token=token, secret=secret)
        yield alice, clients
        for client in clients.values():  # each checks its array (resuming its session if it is suspended)
            _tell(client, "check")
            assert _line(client) == "intact"


def _states(operator: Observer) -> dict[str, str]:
    return {s.tenant: s.state for s in operator.state().sessions if s.tenant in ("alice", "bob")}


def test_a_notebook_suspends_and_resumes_its_own_sessions(two_holders, operator):
    """Session.suspend/status/sessions/resume act on the connection's own sessions (bob's stay running), and
    the session's display says which do not run, and why."""
    alice, _clients = two_holders
    assert alice.status == "running"
    suspended = alice.suspend()
    assert list(suspended.columns) == tables.SESSION_COLUMNS
    assert list(suspended["tenant"]) == ["alice"] and list(suspended["state"]) == ["suspended"]
    assert list(suspended["why"]) == ["by its client"]
    assert alice.status == "suspended" and _states(operator) == {"alice": "suspended", "bob": "running"}
    assert "by its client" in list(alice.sessions().set_index("tenant").loc[["alice"], "why"])
    alice.state()
    assert "alice #" in alice._repr_html_() and "suspended (by its client)" in alice._repr_html_()
    assert list(alice.resume(progress=False)["state"]) == ["running"]
    assert alice.status == "running"


def test_an_operator_lists_suspends_and_resumes_sessions_by_id(two_holders, operator, suspending_cluster, capsys):
    """pathways-nb sessions: every session with its state; suspend and resume by id, with the cluster's token."""
    token_file = Path(suspending_cluster.directory, "operator-token")
    token_file.write_text(suspending_cluster.token)
    where = ["--address", suspending_cluster.address, "--token_file", str(token_file)]
    assert cli.main(["sessions", *where]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == tables.SESSION_COLUMNS and len(listed) >= 3
    ids = {s.tenant: s.session_id for s in operator.state().sessions if s.tenant in ("alice", "bob")}
    assert cli.main(["sessions", "suspend", str(ids["bob"]), *where]) == 0
    assert "by an operator" in capsys.readouterr().out
    assert _states(operator) == {"alice": "running", "bob": "suspended"}
    assert cli.main(["sessions", "resume", str(ids["bob"]), *where]) == 0
    assert _states(operator) == {"alice": "running", "bob": "running"}


def test_the_magics_suspend_resume_and_list_the_connection_s_sessions(two_holders, operator, magic, capsys):
    alice, _clients = two_holders
    for command in ("suspend", "resume", "sessions"):
        with pytest.raises(UsageError, match="not connected"):
            magic.pathways(command)
    magic.connected["session"] = alice
    magic.pathways("suspend   # for lunch")
    assert "your next computation resumes the session" in capsys.readouterr().out
    assert _states(operator) == {"alice": "suspended", "bob": "running"}
    magic.pathways("sessions")
    shown = capsys.readouterr().out
    assert re.search(r"alice +suspended", shown) and re.search(r"bob +running", shown), shown
    magic.pathways("resume")
    assert "running" in capsys.readouterr().out
    assert _states(operator) == {"alice": "running", "bob": "running"}


def test_a_refusal_reaches_the_magic_in_one_line(suspending_cluster, magic):
    """A connection with no session open (its sessions ended): %pathways suspend says so, in the proxy's words."""
    cluster = suspending_cluster
    magic.connected["session"] = Session(cluster.address, [], "cpu", "pathways-nb", "ghost", token=cluster.token)
    magic.connected["session"].secret = "not a secret anyone sent"
    with pytest.raises(UsageError, match=r"^no session of tenant 'ghost' with that secret is open here$"):
        magic.pathways("suspend")


def test_a_suspended_session_outlives_a_restart_of_the_resource_manager(suspending_cluster, operator):
    """Suspended, a session holds no allocation: the resource manager dies and comes back, its workers register
    again, and the session's next request resumes it on its devices with its array intact."""
    with _ended_at_the_end() as processes:
        client = _client(suspending_cluster, "holds_a_session.py", "phoenix")
        processes.append(client)
        _line(client)
        (session,) = [s for s in operator.state().sessions if s.tenant == "phoenix"]
        (suspended,) = operator.control_sessions(pb.SessionControl.SUSPEND, session_ids=[session.session_id])
        assert suspended.state == "suspended"
        rm = suspending_cluster.resource_manager
        rm_pid = rm.process.pid
        os.kill(rm_pid, signal.SIGKILL)
        wait_until(lambda: rm.alive() and rm.process.pid != rm_pid, 30, "the resource manager restarted")
        _tell(client, "check")  # resumes it: asks the new resource manager for its devices
        assert _line(client) == "intact"
        assert _session_of(operator, "phoenix").state == "running"


def test_a_suspended_session_whose_worker_dies_loses_only_that_worker_s_arrays(suspending_cluster, operator):
    """A worker that dies takes the host copies of a suspended session's arrays with it, as it would have taken
    them off its devices: the session resumes once the worker is back, and reading such an array fails with
    DATA_LOSS naming the worker, instead of hanging or ending the client."""
    with _ended_at_the_end() as processes:
        client = _client(suspending_cluster, "holds_a_session.py", "unlucky")
        processes.append(client)
        _line(client)
        (session,) = [s for s in operator.state().sessions if s.tenant == "unlucky"]
        operator.control_sessions(pb.SessionControl.SUSPEND, session_ids=[session.session_id])
        suspending_cluster.kill_worker(0)
        _tell(client, "check")  # resumes it once island 0's worker is back (the cluster restarts it)
        said = _line(client)
        assert said.startswith("lost: ") and "DATA_LOSS" in said and "island 0" in said, said
        assert _session_of(operator, "unlucky").state == "running"


def test_a_session_that_ends_while_it_waits_to_resume_leaves_the_queue(suspending_cluster, operator):
    """A preempted session queued to resume whose client goes away asks for nothing any more."""
    with _ended_at_the_end() as processes:
        trainer = _client(suspending_cluster, "trains_until_told.py", "quitter", "1", "0")
        processes.append(trainer)
        assert _line(trainer) == "training"
        boss = _takes(suspending_cluster, "boss", 1, 10, processes)
        wait_until(lambda: _session_of(operator, "quitter").state, 30, "quitter queues", holds="queued".__eq__)
        assert [q.tenant for q in operator.state().queue] == ["quitter"]
        trainer.kill()
        trainer.communicate()
        wait_until(lambda: [q.tenant for q in operator.state().queue], 30, "an empty queue", holds=lambda q: not q)
        _tell(boss, "done")
        assert _line(boss) == "released"


def test_a_session_that_ran_across_islands_is_preempted_and_resumes_intact(suspending_cluster, operator):
    """A multislice session (an array over both islands, a program on the group of them) is preempted by boss, who
    takes island 1: its arrays on the group's members wait there, its next request waits for boss to leave, and
    then computes the same. (Suspending one once hung: one command object was queued on several workers' streams
    and the last request id was the only one answered.)"""
    with _ended_at_the_end() as processes:
        client = _client(suspending_cluster, "spans_two_islands.py")
        processes.append(client)
        assert _line(client) == "3072.0"
        boss = _takes(suspending_cluster, "boss", 1, 10, processes)
        preempted = _session_of(operator, "spanning")
        assert preempted.state == "suspended" and "preempted by" in preempted.state_reason, preempted
        _tell(client, "again")
        wait_until(lambda: _session_of(operator, "spanning").state, 30, "spanning queues", holds="queued".__eq__)
        _tell(boss, "done")
        assert _line(boss) == "released"
        assert _line(client) == "3072.0 True"
        assert _session_of(operator, "spanning").state == "running"


def _moving(cluster: LocalCluster, tenant: str, devices: int, processes: list):
    """A client with ``devices`` devices to itself on any island (added to ``processes``), once it holds its arrays."""
    mover = _client(cluster, "moves_to_other_devices.py", tenant, str(devices))
    processes.append(mover)
    assert _line(mover) == "ready"
    return mover


def _intact_after_the_move(mover, operator: Observer, tenant: str, devices: list[int]) -> None:
    """The mover's arrays and programs are as they were, and the cluster's ``devices`` serve its session now."""
    _tell(mover, "check")
    found = json.loads(_line(mover))
    assert all(found.values()), found
    session = _session_of(operator, tenant)
    assert (session.state, list(session.device_ids)) == ("running", devices), session
    _tell(mover, "done")
    finished_ok(mover, 60)


def _suspended_and_island_0_taken(cluster: LocalCluster, operator: Observer, mover: str, taker: str, processes: list):
    """A ``_moving`` client with island 0's two devices, suspended, and a client that then took island 0."""
    moving = _moving(cluster, mover, 2, processes)
    session = _session_of(operator, mover)
    assert list(session.device_ids) == [0, 1]
    operator.control_sessions(pb.SessionControl.SUSPEND, session_ids=[session.session_id])
    return moving, _takes(cluster, taker, 0, 0, processes)


def test_a_suspended_session_resumes_on_other_devices_of_the_same_shape(suspending_cluster, operator):
    """Virtual devices: mover holds island 0 (any island would do) and is suspended; taker takes island 0; mover's
    next call resumes it on island 1. Its arrays moved there bitwise equal, its program runs there, a new one
    compiles there, and its jax.devices() and shardings are what they were."""
    with _ended_at_the_end() as processes:
        mover, taker = _suspended_and_island_0_taken(suspending_cluster, operator, "mover", "taker", processes)
        _intact_after_the_move(mover, operator, "mover", [2, 3])
        _tell(taker, "done")
        assert _line(taker) == "released"


def test_a_move_whose_new_worker_dies_midway_is_made_again(suspending_cluster, operator):
    """mover is suspended on island 0 and taker takes it; island 1's worker is stopped, so that mover's move there
    hangs halfway (its arrays on their way), and then killed. The old worker still holds the arrays' host copies:
    the proxy gives the new devices back and asks again, and mover resumes where devices are free once the worker
    is back (on island 1, or on its own island 0 if taker went idle meanwhile and gave it back), with every array
    bitwise equal and its programs running."""
    with _ended_at_the_end() as processes:
        mover, taker = _suspended_and_island_0_taken(suspending_cluster, operator, "unmoved", "squatter", processes)
        target = suspending_cluster.workers[(1, 0)].process.pid
        os.kill(target, signal.SIGSTOP)
        try:
            _tell(mover, "check")  # resumes it on island 1: its move there waits on the stopped worker
            wait_until(lambda: _session_of(operator, "unmoved").state, 30, "the move starts", holds="resuming".__eq__)
        finally:
            suspending_cluster.kill_worker(1)
        found = json.loads(_line(mover))
        assert all(found.values()), found
        session = _session_of(operator, "unmoved")
        assert session.state == "running" and list(session.device_ids) in ([0, 1], [2, 3]), session
        log = Path(suspending_cluster.log_paths["proxy"]).read_text()
        assert f"session {session.session_id}: moving to other devices failed" in log
        _tell(mover, "done")
        finished_ok(mover, 60)
        _tell(taker, "done")
        assert _line(taker) == "released"


def test_an_operator_drains_a_host_and_stops_it_without_losing_work(suspending_cluster, operator, capsys):
    """Two sessions keep arrays on island 0's host; pathways-nb drain 0/0 moves both to island 1's, reports the
    host drained, and its worker is killed: both go on with every array intact. Draining an unknown host, or
    without the cluster token, changes nothing and says why."""
    token_file = Path(suspending_cluster.directory, "operator-token")
    token_file.write_text(suspending_cluster.token)
    address = ["--address", suspending_cluster.address, "--token_file", str(token_file)]
    with _ended_at_the_end() as processes:
        movers = {tenant: _moving(suspending_cluster, tenant, 1, processes) for tenant in ("first", "second")}
        assert [list(_session_of(operator, t).device_ids) for t in ("first", "second")] == [[0], [1]]
        capsys.readouterr()
        try:
            assert cli.main(["drain", "0/0", *address, "--wait", "60"]) == 0
            assert capsys.readouterr().out.strip().endswith(": drained")
            wait_until(
                lambda: {
                    t: (_session_of(operator, t).state, list(_session_of(operator, t).device_ids)) for t in movers
                },
                30,
                "both sessions running on island 1",
                holds={"first": ("running", [2]), "second": ("running", [3])}.__eq__,
            )
            states = {(w.island, w.host_index): w for w in operator.state().workers}
            assert states[0, 0].draining and states[0, 0].drain_status == "drained"
            assert not states[1, 0].draining
            suspending_cluster.kill_worker(0)
            for (tenant, mover), device in zip(movers.items(), (2, 3), strict=True):
                _intact_after_the_move(mover, operator, tenant, [device])
        finally:
            assert cli.main(["drain", "0/0", "--undo", *address]) == 0
        assert "back in service" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        cli.main(["drain", "7/0", *address])
    assert "no host 7/0 in this cluster (ISLAND/HOST: 0/0, 1/0); nothing was drained" in capsys.readouterr().err
    tokenless = Observer(suspending_cluster.address, token=None)
    with pytest.raises(PathwaysError, match="cluster token"):
        tokenless.drain(1, 0)
    tokenless.close()
    assert not any(w.draining for w in operator.state().workers)
    wait_until(
        lambda: {w.worker_id: w.healthy for w in operator.state().workers},
        60,
        "worker 0 back",
        holds=lambda h: all(h.values()),
    )
