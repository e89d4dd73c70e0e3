"""A dead process of a local cluster is noticed at once, reported with its cause, and replaced.

The client's process never aborts: after a worker dies, new shapes, dtypes and
programs on its island give errors (DATA_LOSS, naming the island, host and
cause), the other island keeps serving, and the island serves again by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pathways_nb import cli
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
NEW_WORK_ON_A_DEAD_ISLAND = CLIENTS / "new_work_on_a_dead_island.py"
SENT_FROM_A_DYING_ISLAND = CLIENTS / "moves_from_a_dying_island.py"
KEEPS_WORKING = CLIENTS / "sums_on_every_device_per_line.py"
KEEPS_ITS_ARRAY = CLIENTS / "keeps_its_array.py"


@pytest.fixture(scope="module")
def supervised():
    """A cluster of its own: these tests kill its processes."""
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        yield cluster


def _send(process: subprocess.Popen, line: str = "") -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _read_json(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    if not line:
        raise AssertionError(f"the client ended early:\n{process.stderr.read()[-4000:]}")
    return json.loads(line)


def _wait_healthy(cluster: LocalCluster, timeout_s: float) -> None:
    wait_until(
        cluster.state,
        timeout_s,
        "every worker healthy",
        holds=lambda state: state.workers and all(w.healthy for w in state.workers),
    )


def test_dead_worker_fails_new_work_clearly_and_comes_back_by_itself(supervised):
    client = python_script(NEW_WORK_ON_A_DEAD_ISLAND, supervised.address)
    try:
        assert _read_json(client) == {"before": 6.0}
        old_pid = supervised.workers[(1, 0)].process.pid
        os.kill(old_pid, signal.SIGKILL)
        _send(client)
        report = _read_json(client)
        for key in ("put", "jit", "kept"):
            failure = report[key].get("error", "")
            assert "DATA_LOSS" in failure and "island 1 host 0" in failure, report
        assert "killed by signal SIGKILL" in report["put"]["error"] + report["jit"]["error"], report
        assert report["island0"] == {"value": [[2] * 9] * 2}
        # Back by itself (how soon: benchmarks/faults.py).
        supervised.wait_for_worker(1, 0, timeout_s=120, not_pid=old_pid)
        ended = [e for e in supervised.exits if e.pid == old_pid]
        assert ended and ended[0].description == "killed by signal SIGKILL" and ended[0].name == "worker-1-0"
        _send(client)
        report = _read_json(client)
        assert report["fresh"] == {"value": [42.0] * 3}
        assert "DATA_LOSS" in report["kept"]["error"]
        assert client.wait(60) == 0, client.stderr.read()[-3000:]
    finally:
        client.kill()
        client.communicate()


def test_an_array_on_its_way_from_a_worker_that_dies_fails_its_reads(supervised):
    """The receiving worker is alive and waits for the bytes, which will never come: the proxy tells it."""
    _wait_healthy(supervised, 30)
    client = python_script(SENT_FROM_A_DYING_ISLAND, supervised.address)
    try:
        assert _read_json(client) == {"issued": True}
        old_pid = supervised.workers[(1, 0)].process.pid
        os.kill(old_pid, signal.SIGKILL)
        _send(client)
        out, err = finish(client, 120)
        report = json.loads(out.splitlines()[-1])
        assert "DATA_LOSS" in report.get("error", "") and "island 1 host 0" in report["error"], (report, err[-3000:])
    finally:
        client.kill()
    supervised.wait_for_worker(1, 0, timeout_s=120, not_pid=old_pid)


def test_resource_manager_restart_keeps_running_sessions(supervised):
    _wait_healthy(supervised, 30)
    client = python_script(KEEPS_WORKING, supervised.address)
    try:
        assert _read_json(client) == {"ready": True}
        _send(client)
        assert _read_json(client) == {"sums": [0.0, 8.0, 16.0, 24.0]}
        # A worker restarted during the session: its new incarnation must survive the resource manager's.
        supervised.restart_worker(1, 0, timeout_s=30)
        _wait_healthy(supervised, 30)
        _send(client)
        assert _read_json(client) == {"sums": [0.0, 8.0, 16.0, 24.0]}
        workers_before = {w.worker_id: (w.pid, w.incarnation) for w in supervised.state().workers}
        rm = supervised.resource_manager
        rm_pid = rm.process.pid
        port = rm.port
        os.kill(rm_pid, signal.SIGKILL)
        # The session does not need the resource manager: it keeps computing while it is gone, while
        # it comes back and while the workers register with it again.
        steps_until = time.monotonic() + 4
        while time.monotonic() < steps_until:
            _send(client)
            assert _read_json(client) == {"sums": [0.0, 8.0, 16.0, 24.0]}
        try:
            wait_until(lambda: rm.alive() and rm.process.pid != rm_pid, 10, "the resource manager restarted")
        except TimeoutError as error:
            raise AssertionError(f"{error}; its log ends:\n{rm.log_tail()}") from None
        assert rm.port == port

        # Workers register again with the same incarnation (their arrays are still there); the proxy
        # claims its session's allocation again.
        def state_once_up():
            try:
                return supervised.state()
            except Exception:  # noqa: BLE001 - still starting
                return None

        state = wait_until(
            state_once_up,
            10,
            "both workers registered again and the session's allocation claimed",
            holds=lambda state: (
                state is not None and len(state.workers) == 2 and any(a.tenant == "steady" for a in state.allocations)
            ),
            interval_s=0.1,
        )
        assert {w.worker_id: (w.pid, w.incarnation) for w in state.workers} == workers_before
        _send(client)
        assert _read_json(client) == {"sums": [0.0, 8.0, 16.0, 24.0]}
    finally:
        client.kill()
        client.communicate()
    second = python_script(CLIENTS / "shows_devices.py", supervised.address)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and json.loads(out)["count"] == 4, err[-3000:]


def _wait_worker(cluster: LocalCluster, worker_id: str, what: str, condition, timeout_s: float):
    """The state of ``worker_id`` once ``condition`` holds of it (``what``, in words)."""
    return wait_until(
        lambda: next((w for w in cluster.state().workers if w.worker_id == worker_id), None),
        timeout_s,
        f"{worker_id} {what}",
        holds=lambda state: state is not None and condition(state),
    )


def test_a_worker_whose_host_vanishes_is_found_unhealthy_and_is_back_when_it_returns(supervised):
    """SIGSTOP: the worker's process is there and its connections open, but nothing answers, as when its
    host vanishes without closing them. No launcher sees it: the resource manager's keepalive ping does."""
    _wait_healthy(supervised, 30)
    worker = supervised.workers[(0, 0)].process
    before = _wait_worker(supervised, "island0-host0", "attached", lambda w: w.attached, 10)
    stopped = time.monotonic()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # The bound is the worker time-out (10 s on one machine); the deadline leaves room for a loaded
        # machine, and fails where the keepalive does not work (gRPC's default ping time-out alone is a minute).
        found = _wait_worker(supervised, "island0-host0", "unhealthy", lambda w: not w.healthy, 40)
        found_after_s = time.monotonic() - stopped
        assert "stream to the resource manager ended" in found.down_reason, found
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    back = _wait_worker(supervised, "island0-host0", "healthy and attached", lambda w: w.healthy and w.attached, 30)
    # The same process (its arrays are still there), registered again on a new stream.
    assert (back.pid, back.incarnation) == (before.pid, before.incarnation), found_after_s


STALLED_S = 4.0  # longer than the 3 s a cluster across hosts allows, well within one machine's 10 s


def test_a_stalled_worker_of_a_machine_s_cluster_is_not_called_dead_and_keeps_its_arrays(supervised):
    """All processes of a one-machine cluster share its cores: a live worker left unscheduled for
    seconds (a busy machine) must not be called dead, which would cost every session its arrays."""
    _wait_healthy(supervised, 30)
    client = python_script(KEEPS_ITS_ARRAY, supervised.address)
    worker = supervised.workers[(0, 0)].process
    try:
        assert _read_json(client) == {"before": [0.0, 1.0, 2.0, 3.0]}
        before = _wait_worker(supervised, "island0-host0", "attached", lambda w: w.attached, 10)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            resume_at = time.monotonic() + STALLED_S
            while time.monotonic() < resume_at:
                state = supervised.state()
                assert all(w.healthy for w in state.workers), state
                time.sleep(0.1)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        _send(client)
        assert _read_json(client) == {"after": [1.0, 2.0, 3.0, 4.0]}
        after = _wait_worker(
            supervised, "island0-host0", "healthy and attached", lambda w: w.healthy and w.attached, 30
        )
        assert (after.pid, after.incarnation) == (before.pid, before.incarnation)
        assert client.wait(60) == 0, client.stderr.read()[-3000:]
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        client.kill()
        client.communicate()


@pytest.mark.parametrize("timeout", ["0", "-3", "nan", "inf"])
def test_up_refuses_a_worker_time_out_that_is_not_a_positive_number_before_starting_anything(timeout, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--server_port", "0", "--worker_timeout", timeout])
    assert exit_.value.code == 2
    assert f"pathways-nb up: the worker time-out must be a number of seconds > 0, not {float(timeout)!r}" in (
        capsys.readouterr().err
    )


def _workers_of(pid: int) -> list[psutil.Process]:
    """The live worker processes among ``pid``'s children (a dead one may not be reaped yet)."""
    workers = []
    for child in psutil.Process(pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "worker" in child.cmdline():
                workers.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return workers


def test_up_restarts_a_dead_worker_and_says_why():
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pathways_nb.cli",
            "up",
            "--islands",
            "1",
            "--devices_per_host",
            "1",
            "--server_port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout.readline().startswith("pathways-nb cluster serving")
        workers = _workers_of(up.pid)
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGSEGV)
        wait_until(
            lambda: [c for c in _workers_of(up.pid) if c.pid != workers[0].pid], 20, "a new worker", interval_s=0.1
        )
        assert not psutil.pid_exists(workers[0].pid) or psutil.Process(workers[0].pid).status() != "zombie"
    finally:
        up.send_signal(signal.SIGINT)
        _out, err = up.communicate(timeout=60)
    assert "worker-0-0" in err and "killed by signal SIGSEGV; restarting" in err, err[-3000:]
