"""User Python beside the devices: ``jax.experimental.colocated_python``, stock client, a 2-island cluster.

Each client runs in a child process (its JAX must talk to this cluster only) from a script that
prints JSON lines; the test reads them. Where this machine lets executors run as users of their
own (root, and a Python other users can read), the cluster's executors do.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.core import shared_memory
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.testing import other_users_python, python_script, wait_until

CLIENT_TIMEOUT_S = 300
DEADLINE_S = 60

CLIENTS = Path(__file__).with_name("clients")  # colocated_*.py: the clients of these tests


@pytest.fixture
def open_directory():
    """A directory every user may write in (executors run as users of their own), removed afterwards.

    Not under pytest's ``tmp_path``, whose parents only this user may enter.
    """
    directory = tempfile.mkdtemp(prefix="pathways-nb-test-")
    os.chmod(directory, 0o777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def start_client(cluster: LocalCluster, script: str, tenant: str = "tenant-a", *args: str):
    """The client ``script`` (under tests/clients/) connected to ``cluster`` as ``tenant``, given ``args`` too."""
    return python_script(CLIENTS / script, cluster.address, cluster.token, tenant, *args)


def run_client(cluster: LocalCluster, script: str, tenant: str = "tenant-a", *args: str) -> list[dict]:
    """Runs the client ``script`` against ``cluster``; the JSON lines it printed."""
    process = start_client(cluster, script, tenant, *args)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, f"client failed:\n{err[-4000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def executors(cluster: LocalCluster) -> list[psutil.Process]:
    """The executors the cluster's colocated hosts run now."""
    found = []
    for host in cluster.colocated_hosts.values():
        for child in psutil.Process(host.process.pid).children():
            try:
                if "pathways_nb.colocated.executor" in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
    return found


def test_each_device_has_a_colocated_cpu_device_and_jax_devices_is_unchanged(colocated_cluster):
    (result,) = run_client(colocated_cluster, "colocated_devices.py")
    assert result["devices"] == [0, 1, 2, 3] and result["local_count"] == 4
    assert result["kinds"] == ["cpu accelerator"]
    assert result["cpus"] == [4, 5, 6, 7] and result["cpu_kinds"] == ["cpu"]
    assert all(a == b for a, b in result["pairs"])
    assert result["islands"] == [0, 0, 1, 1]
    assert result["on_cpu"] == [7]
    assert result["back"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_an_unspecialized_function_compiles_three_programs_then_runs_one(colocated_cluster):
    lines = run_client(colocated_cluster, "colocated_unspecialized_call.py")
    first, second = lines
    assert first["compiled"] == ["stats_output_specs_and_push_result", "stats", "stats_pop_result"]
    assert first["double"] == [0.0, 2.0, 4.0, 6.0] and first["sum"] == [6.0] and first["runs"] == 1
    assert second["compiled"] == first["compiled"]  # the second call runs the function alone
    assert second["double"] == [2.0, 4.0, 6.0, 8.0] and second["runs"] == 2


def test_specialize_runs_one_program_with_the_given_output_specs(colocated_cluster):
    (result,) = run_client(colocated_cluster, "colocated_specialized_call.py")
    assert result["values"] == [[[3.0] * 3] * 2] * 3
    assert result["devices"] == [6]


def test_a_colocated_class_keeps_its_state_across_calls(colocated_cluster):
    (result,) = run_client(colocated_cluster, "colocated_class_state.py")
    assert result["totals"] == [14.0, 18.0, 22.0]
    assert result["other"] == 4.0


def test_asynchronous_calls_run_in_the_order_the_session_made_them(colocated_cluster):
    (result,) = run_client(colocated_cluster, "colocated_call_order.py")
    assert result["items"] == [float(i) for i in range(13)]


def test_an_exception_raised_remotely_arrives_with_its_message_and_traceback(colocated_cluster):
    result, after = run_client(colocated_cluster, "colocated_remote_exception.py")
    assert result["raised"] == "JaxRuntimeError"
    assert "ValueError: the input pipeline ran dry" in result["message"]
    assert "Remote traceback" in result["message"] and "in fails" in result["message"]
    assert after["after"] == [2.0, 2.0]  # the executor keeps serving


def test_an_executor_killed_mid_call_fails_that_call_only_and_the_next_call_works(colocated_cluster):
    process = start_client(colocated_cluster, "colocated_executor_killed.py")
    first = json.loads(process.stdout.readline())
    marker = f"/proc/{first['pid']}/cwd/running"
    wait_until(lambda: os.path.exists(marker), DEADLINE_S, "the executor started the long call")
    os.kill(first["pid"], signal.SIGKILL)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, err[-4000:]
    failed, after = (json.loads(line) for line in out.splitlines())
    assert failed["raised"] == "JaxRuntimeError"
    assert "killed by signal SIGKILL" in failed["message"] and "pid_or_wait" in failed["message"]
    assert after["after"] != first["pid"]  # a new executor
    assert all(w.alive() for w in colocated_cluster.workers.values())


def test_two_tenants_executors_see_neither_each_others_globals_nor_files_nor_output(colocated_cluster, open_directory):
    meeting = open_directory  # where each tenant's executor says where its files are
    a = start_client(colocated_cluster, "colocated_tenants_apart.py", "tenant-a", "a", meeting)
    clients = [a]
    try:
        first = json.loads(a.stdout.readline())  # a's executor has written its file, and lives on
        clients.append(b := start_client(colocated_cluster, "colocated_tenants_apart.py", "tenant-b", "b", meeting))
        second = json.loads(b.stdout.readline())
    finally:
        errors = [process.communicate("\n", timeout=CLIENT_TIMEOUT_S)[1] for process in clients]
    assert first["fresh"] == second["fresh"] == 1.0  # neither saw the other's globals
    for role, other, error in (("a", "b", errors[0]), ("b", "a", errors[1])):
        assert f"[island 0 host 0] tenant {role} was here" in error and f"tenant {other} was here" not in error
    if other_users_python() is None:
        pytest.skip("executors share this host's user here: files are not kept apart (docs/colocated_python.md)")
    assert first["uid"] != second["uid"] and 0 not in (first["uid"], second["uid"])
    assert first["outcome"] == 0.0 and second["outcome"] == 2.0  # b found a's directory and was refused


def test_an_executor_has_no_cluster_token_nor_the_workers_files_and_ends_with_its_session(colocated_cluster):
    process = start_client(
        colocated_cluster,
        "colocated_executor_ends_with_session.py",
        "tenant-a",
        str(shared_memory.private_root()),
    )
    probed = json.loads(process.stdout.readline())
    assert not probed["has_token"] and probed["variables"] < 12
    if other_users_python() is not None:
        assert not probed["workers_files"]
    assert json.loads(process.stdout.readline())["after_disconnect"] is not None  # refused once the session ended
    wait_until(lambda: not psutil.pid_exists(probed["pid"]), DEADLINE_S, "the ended session's executor gone")
    process.communicate("\n", timeout=CLIENT_TIMEOUT_S)


def test_a_call_over_several_hosts_colocated_devices_is_refused_with_what_to_do(colocated_cluster):
    (result,) = run_client(colocated_cluster, "colocated_across_hosts_refused.py")
    assert result["raised"] == "JaxRuntimeError"
    assert "INVALID_ARGUMENT" in result["message"] and "several hosts" in result["message"]
    assert "call the function once per host" in result["message"]


def test_colocated_programs_are_refused_where_the_cluster_runs_no_colocated_python(cluster):
    process = python_script(CLIENTS / "colocated_on_a_cluster_without_it.py", cluster.address, cluster.token)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["raised"] == "JaxRuntimeError"
    assert "colocated Python is off on this cluster" in result["message"]
    assert "--colocated_python" in result["message"]


def test_orbax_pathways_handlers_save_and_restore_through_colocated_python_as_local_orbax_does(
    colocated_cluster, open_directory
):
    path = os.path.join(open_directory, "checkpoint")  # the executors write there as users of their own
    expected = {"w": np.arange(16, dtype=np.float32).reshape(4, 4).tolist(), "b": [1.5, -2.0]}
    (saved,) = run_client(colocated_cluster, "colocated_orbax.py", "tenant-a", path, "save")
    assert saved["restored"] == expected and saved["shardings_kept"]
    # The arrays' bytes were written beside the devices, by the executor, not by the client.
    owners = {p.stat().st_uid for p in pathlib.Path(path).rglob("*") if p.is_file() and "ocdbt.process" in str(p)}
    assert owners and (other_users_python() is None or 0 not in owners)
    # A later session (another executor, another user) restores it.
    (later,) = run_client(colocated_cluster, "colocated_orbax.py", "tenant-a", path, "restore")
    assert later["restored"] == expected and later["shardings_kept"]
    # It is an ordinary Orbax checkpoint: local Orbax (no cluster) reads the same values.
    local = python_script(CLIENTS / "orbax_restore_locally.py", path, env={"JAX_PLATFORMS": "cpu"})
    out, err = local.communicate(timeout=CLIENT_TIMEOUT_S)
    assert local.returncode == 0, err[-4000:]
    assert json.loads(out.strip().splitlines()[-1]) == expected


@pytest.fixture
def empty_colocated_cluster():
    """A colocated-Python cluster of its own (2 islands of 2 devices): nobody else's session holds an island."""
    with LocalCluster(
        islands=2, devices_per_host=2, colocated_python=True, colocated_python_executable=other_users_python()
    ) as cluster:
        yield cluster


def test_a_session_that_moves_to_other_devices_takes_its_colocated_arrays_along(empty_colocated_cluster):
    """Suspended while another tenant takes its island, the session resumes on the other island: its arrays on
    colocated CPU devices moved with it, its colocated function runs there on them, and its colocated CPU devices
    keep their ids (the executor there knows them by the session's ids)."""
    colocated_cluster = empty_colocated_cluster
    operator = Observer(colocated_cluster.address, token=colocated_cluster.token)
    mover = start_client(colocated_cluster, "colocated_moves.py", "mover")
    taker = None
    try:
        ready = json.loads(mover.stdout.readline())["ready"]
        (session,) = [s for s in operator.state().sessions if s.tenant == "mover"]
        operator.control_sessions(pb.SessionControl.SUSPEND, session_ids=[session.session_id])
        taker = python_script(
            CLIENTS / "takes_an_island.py",
            colocated_cluster.address,
            "taker",
            str(next(d.island for d in operator.state().devices if d.id == session.device_ids[0])),
            "0",
            env={"PATHWAYS_CLUSTER_TOKEN": colocated_cluster.token},
        )
        assert taker.stdout.readline().startswith("granted")
        mover.stdin.write("go\n")
        mover.stdin.flush()
        said = mover.stdout.readline()
        assert said, f"the mover ended:\n{mover.communicate()[1][-4000:]}"
        found = json.loads(said)
        assert found == {"x_equal": True, "y_equal": True, "called_again": True, "cpus": ready}, found
        (moved,) = [s for s in operator.state().sessions if s.tenant == "mover"]
        assert set(moved.device_ids).isdisjoint(session.device_ids), (moved, session)
    finally:
        for process in (mover, taker):
            if process is not None:
                process.kill()
                process.communicate()
        operator.close()
