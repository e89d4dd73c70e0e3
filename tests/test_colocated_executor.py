"""The colocated Python host and its executors, driven as a worker drives them (no proxy, no client).

Programs are made here the way jax's colocated_python makes them (its own serialization), on
this process's CPU devices 0 and 1, which stand for two colocated CPU devices of cluster ids 0
and 1. Where this machine lets executors run as users of their own (root, and a Python other
users can read), they do, and the isolation tests check it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import jax
import numpy as np
import psutil
import pytest
from jax import tree_util
from jax._src.lib import xla_client
from jax.experimental.colocated_python import serialization

from pathways_nb.colocated.executors import ArrayShards, ColocatedHostLink, ExecutorDied, ResultShape
from pathways_nb.core.security import ClusterCredentials, generate_token
from pathways_nb.launch.processes import ChildServer
from pathways_nb.protocol.errors import RequestError
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import other_users_python, wait_until

F32 = 11
DEADLINE_S = 60


@pytest.fixture(scope="module")
def host():
    token = generate_token()
    directory = tempfile.TemporaryDirectory(prefix="pathways-nb-test-colocated-")
    socket_path = os.path.join(directory.name, "host.sock")
    python = other_users_python()
    server = ChildServer(
        "colocated-host",
        ["colocated-host", "--socket", socket_path, *(["--colocated_python_executable", python] if python else [])],
        env={**os.environ, "PATHWAYS_CLUSTER_TOKEN": token},
    )
    server.start(120)
    link = ColocatedHostLink(f"unix:{socket_path}", ClusterCredentials(token=token), "the test host")
    link.separate_users = "a user of its own" in server.log()
    link.socket_path = socket_path
    link.token = token
    link.host_pid = server.process.pid
    yield link
    link.close()
    server.close()
    directory.cleanup()


def spec(shape, dtype=np.float32, device: int = 1):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[device]))


@dataclass(frozen=True)
class Program:
    name: str
    digest: bytes
    text: bytes
    results: list[ResultShape]


def program(fun, in_specs, out_specs, device: int = 1) -> Program:
    """``fun`` as jax's colocated_python ships it, and what its results must be."""
    in_leaves, in_tree = tree_util.tree_flatten((tuple(in_specs), {}))
    out_leaves, out_tree = tree_util.tree_flatten(out_specs)
    devices = xla_client.DeviceList((jax.devices()[device],))
    text = serialization._serialize((fun, in_tree, tuple(in_leaves), out_tree, tuple(out_leaves), devices))
    results = [ResultShape(F32, s.shape, s.shape) for s in out_leaves]
    return Program(fun.__name__, hashlib.sha256(text).digest(), text, results)


def run(executor, program: Program, args: list[ArrayShards], client: dict | None = None) -> list[ArrayShards]:
    return executor.run(program.name, program.digest, program.text, args, program.results, client or {})


def f32(values, device: int = 1) -> ArrayShards:
    values = np.asarray(values, np.float32)
    return ArrayShards(F32, values.shape, {device: values})


def test_runs_a_function_and_keeps_module_state_between_calls(host):
    def count(x):
        import builtins

        builtins.calls = getattr(builtins, "calls", 0) + 1
        return x * builtins.calls

    executor = host.executor("state", "tenant-a", [0, 1])
    counted = program(count, [spec((3,))], spec((3,)))
    first = run(executor, counted, [f32([1, 2, 3])])
    second = run(executor, counted, [f32([1, 2, 3])])
    assert first[0].shards[1].tolist() == [1, 2, 3]
    assert second[0].shards[1].tolist() == [2, 4, 6]
    host.end_session("state")


def test_big_arrays_pass_through_files_both_ways(host):
    def plus_one(x):
        return x + 1

    executor = host.executor("big", "tenant-a", [0, 1])
    big = np.arange(1 << 22, dtype=np.float32)  # 16 MiB: over the file threshold
    (out,) = run(executor, program(plus_one, [spec(big.shape)], spec(big.shape)), [f32(big)])
    np.testing.assert_array_equal(out.shards[1], big + 1)
    host.end_session("big")


def test_an_exception_comes_back_with_its_message_and_the_remote_traceback(host):
    def fails(x):
        raise ValueError("the input pipeline ran dry")

    executor = host.executor("raises", "tenant-a", [0, 1])
    with pytest.raises(RequestError) as raised:
        run(executor, program(fails, [spec((2,))], spec((2,))), [f32([1, 2])])
    assert raised.value.code == 2  # UNKNOWN: not a slice that went down
    assert "ValueError: the input pipeline ran dry" in raised.value.message
    assert "Remote traceback" in raised.value.message and "in fails" in raised.value.message
    # It keeps serving.
    (out,) = run(executor, program(lambda x: x, [spec((2,))], spec((2,))), [f32([1, 2])])
    assert out.shards[1].tolist() == [1, 2]
    host.end_session("raises")


def test_an_executor_killed_mid_call_fails_that_call_and_the_next_starts_a_new_one(host):
    def pid_and_wait(x):
        import os
        import pathlib

        if x[0] > 0:
            pathlib.Path("running").write_text("")
            time.sleep(120)  # until the test kills it
        return jax.device_put(np.float32(os.getpid()), x.sharding) + 0 * x[0]

    executor = host.executor("killed", "tenant-a", [0, 1])
    waits = program(pid_and_wait, [spec((1,))], spec(()))
    (before,) = run(executor, waits, [f32([0])])
    pid = int(before.shards[1])
    directory = Path(executor._running.started.directory)

    def kill_once_running():
        # Killed however long the call takes to start: the call must fail, not sleep on for 120 s.
        with contextlib.suppress(TimeoutError):
            wait_until((directory / "running").exists, DEADLINE_S, "the long call started")
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_running)
    killer.start()
    with pytest.raises(ExecutorDied) as died:
        run(executor, waits, [f32([1])])
    killer.join()
    assert "killed by signal SIGKILL" in died.value.message and "pid_and_wait" in died.value.message
    (after,) = run(executor, waits, [f32([0])])
    assert int(after.shards[1]) != pid
    host.end_session("killed")


def test_a_session_that_ends_takes_its_executor_and_its_directory_with_it(host):
    executor = host.executor("ends", "tenant-a", [0, 1])
    run(executor, program(lambda x: x, [spec((1,))], spec((1,))), [f32([1])])
    pid, directory = executor._running.started.pid, Path(executor._running.started.directory)
    host.end_session("ends")
    wait_until(
        lambda: {"executor running": psutil.pid_exists(pid), "its directory there": directory.exists()},
        DEADLINE_S,
        "the executor and its directory gone",
        holds=lambda left: not any(left.values()),
    )
    with pytest.raises(RequestError, match="session ended"):
        run(executor, program(lambda x: x, [spec((1,))], spec((1,))), [f32([1])])


def test_tenants_executors_see_neither_each_others_state_nor_files_nor_the_cluster_token(host):
    if not host.separate_users:
        pytest.skip("executors share this host's user here: only root, with a Python others can read, separates them")

    def probe(x):
        import builtins
        import os

        seen = getattr(builtins, "secret", None)
        builtins.secret = "mine"
        open("secret.txt", "w").write("tenant data")
        found = {"uid": os.getuid(), "seen": seen, "token": "PATHWAYS_CLUSTER_TOKEN" in os.environ}
        builtins.found = found
        return x

    def read_other(x, other_directory=None):
        import builtins
        import os

        outcome = {}
        for what, path in (
            ("file", os.path.join(builtins.other, "secret.txt")),
            ("host_environ", f"/proc/{os.getppid()}/environ"),
        ):
            try:
                open(path).read()
                outcome[what] = "read"
            except OSError as error:
                outcome[what] = type(error).__name__
        builtins.outcome = outcome
        return x

    a, b = host.executor("tenant-a", "a", [0, 1]), host.executor("tenant-b", "b", [0, 1])
    probing = program(probe, [spec((1,))], spec((1,)))
    run(a, probing, [f32([1])])
    run(b, probing, [f32([1])])
    uid_a, uid_b = a._running.started.uid, b._running.started.uid
    assert uid_a != uid_b and os.getuid() not in (uid_a, uid_b)

    def report(x):
        import builtins

        return jax.device_put(
            np.array([builtins.found["seen"] is None, builtins.found["token"]], np.float32), x.sharding
        )

    for executor in (a, b):
        (out,) = run(executor, program(report, [spec((1,))], spec((2,))), [f32([1])])
        assert out.shards[1].tolist() == [1.0, 0.0]  # nothing seen of the other, no token

    def point_at(directory):
        def set_other(x):
            import builtins

            builtins.other = directory
            return x

        return set_other

    run(b, program(point_at(a._running.started.directory), [spec((1,))], spec((1,))), [f32([1])])
    run(b, program(read_other, [spec((1,))], spec((1,))), [f32([1])])

    def outcome(x):
        import builtins

        codes = {"read": 0.0, "PermissionError": 1.0}
        return jax.device_put(
            np.array([codes.get(builtins.outcome[k], 2.0) for k in ("file", "host_environ")], np.float32), x.sharding
        )

    (out,) = run(b, program(outcome, [spec((1,))], spec((2,))), [f32([1])])
    assert out.shards[1].tolist() == [1.0, 1.0]  # PermissionError both times
    host.end_session("tenant-a")
    host.end_session("tenant-b")


def test_bad_calls_get_clear_errors_and_the_executor_keeps_serving(host):
    executor = host.executor("bad", "tenant-a", [0, 1])
    identity = program(lambda x: x, [spec((1,))], spec((1,)))
    with pytest.raises(RequestError, match="does not match its digest"):
        run(executor, replace(identity, digest=b"\0" * 32), [f32([1])])
    with pytest.raises(RequestError, match="not loaded on this executor"):
        run(executor, replace(identity, digest=hashlib.sha256(b"other").digest(), text=b""), [f32([1])])
    garbage = b"\x80\x05not a pickle"
    with pytest.raises(RequestError, match="could not be unpickled") as unpickled:
        run(executor, Program("garbage", hashlib.sha256(garbage).digest(), garbage, []), [])
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in unpickled.value.message
    with pytest.raises(RequestError, match="takes 1 arrays, got 0"):
        run(executor, identity, [])
    with pytest.raises(RequestError, match="cloudpickle's pickles are not portable"):
        run(executor, identity, [f32([1])], {"python": "2.7", "jax": "0.0.1"})
    # Results are checked against what the program says before any of their bytes are read.
    with pytest.raises(RequestError, match="the output spec says kind 11 \\[2\\]"):
        run(executor, replace(identity, results=[ResultShape(F32, (2,), (2,))]), [f32([1])])
    with pytest.raises(RequestError, match="where \\[2\\] was due"):
        run(executor, replace(identity, results=[ResultShape(F32, (1,), (2,))]), [f32([1])])
    (out,) = run(executor, identity, [f32([5])])
    assert out.shards[1].tolist() == [5.0]
    host.end_session("bad")


def test_the_host_refuses_callers_without_the_cluster_token(host):
    with grpc.insecure_channel(f"unix:{host.socket_path}") as channel:
        events = cluster_pb2_grpc.ColocatedHostStub(channel).Executor(pb.ExecutorRequest(session="x"))
        with pytest.raises(grpc.RpcError) as refused:
            next(events)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_caller_gone_while_its_executor_starts_leaves_nothing_behind(host):
    """A call cancelled while its executor imports: once up, the host stops it and removes its directory."""
    host_process = psutil.Process(host.host_pid)
    (executors_root,) = Path(os.environ.get("PATHWAYS_SHM_ROOT") or "/dev/shm").glob(
        f"pathways-nb-executors-{host.host_pid}-*"
    )
    before = {child.pid for child in host_process.children(recursive=True)}
    directories_before = set(executors_root.iterdir())

    def new_processes() -> set[int]:
        return {child.pid for child in host_process.children(recursive=True)} - before

    with ClusterCredentials(token=host.token).channel(f"unix:{host.socket_path}") as channel:
        call = cluster_pb2_grpc.ColocatedHostStub(channel).Executor(
            pb.ExecutorRequest(session="gone", tenant="tenant-a", device_ids=[0, 1])
        )
        wait_until(new_processes, DEADLINE_S, "the executor's process started")
        call.cancel()
    wait_until(
        lambda: (new_processes(), set(executors_root.iterdir()) - directories_before),
        DEADLINE_S,
        "the executor of the cancelled call and its directory gone",
        holds=lambda left: not any(left),
    )
    executor = host.executor("after-gone", "tenant-a", [0, 1])  # the host serves on
    assert run(executor, program(lambda x: x + 1, [spec((1,))], spec((1,))), [f32([1])])[0].shards[1].tolist() == [2]
    host.end_session("after-gone")


# The Python 3.12 environment with jax 0.12 that make test builds (tests/test_compat.py uses it too).
PY312 = os.environ.get("PATHWAYS_PY312_PYTHON")
NO_PY312 = "no Python 3.12 with jax 0.12: make test builds it and passes it in PATHWAYS_PY312_PYTHON"

# Run by that Python: a function as its jax's colocated_python ships it, on its CPU device 1 (cluster id 1).
SHIPS_A_FUNCTION = Path(__file__).with_name("clients") / "ships_a_colocated_function.py"


@pytest.fixture
def host_with(tmp_path):
    """``host_with(python)``: a colocated host whose executors run ``python``; its link (closed afterwards)."""
    started = []

    def start(python: str) -> ColocatedHostLink:
        token = generate_token()
        socket_path = str(tmp_path / f"host-{len(started)}.sock")
        server = ChildServer(
            "colocated-host",
            ["colocated-host", "--socket", socket_path, "--executor_python", python],
            env={**os.environ, "PATHWAYS_CLUSTER_TOKEN": token},
        )
        server.start(120)
        link = ColocatedHostLink(f"unix:{socket_path}", ClusterCredentials(token=token), "the test host")
        started.append((server, link))
        return link

    yield start
    for server, link in started:
        link.close()
        server.close()


@pytest.mark.skipif(not PY312, reason=NO_PY312)
def test_an_executor_of_another_python_runs_with_its_own_packages(host_with):
    """The client's interpreter (MaxText needs Python 3.12) as the executors': none of the cluster's packages."""
    made = subprocess.run([PY312, SHIPS_A_FUNCTION], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    numpy_version, text = made.stdout.split()
    text = bytes.fromhex(text)
    printed = []
    executor = host_with(PY312).executor("py312", "tenant", [0, 1], printed.extend)
    shipped = Program("where", hashlib.sha256(text).digest(), text, [ResultShape(F32, (3,), (3,))])
    (out,) = run(executor, shipped, [f32([1, 2, 3])])
    assert out.shards[1].tolist() == [2.0, 4.0, 6.0]
    assert [line.text for line in printed] == [f"executor 3 12 numpy {numpy_version}"]  # its own numpy


def _bare_python_of_another_version() -> str | None:
    """A Python 3.12 without the packages an executor needs (the interpreter of make test's 3.12 venv)."""
    if not PY312:
        return None
    found = subprocess.run([PY312, "-c", "import sys; print(sys._base_executable)"], capture_output=True, text=True)
    base = found.stdout.strip()
    bare = base and subprocess.run([base, "-I", "-c", "import grpc"], capture_output=True).returncode != 0
    return base if bare else None


def test_an_executor_that_cannot_start_says_why_in_its_own_words(host_with):
    python = _bare_python_of_another_version()
    if python is None:
        pytest.skip("no bare Python 3.12 here (the base interpreter of PATHWAYS_PY312_PYTHON, without grpc)")
    executor = host_with(python).executor("bare", "tenant", [0, 1])
    with pytest.raises(RequestError) as failed:
        run(executor, program(lambda x: x, [spec((1,))], spec((1,))), [f32([1])])
    message = failed.value.message
    assert f"the executor ({python}) did not start (exited with status 1); its output:" in message
    assert "ModuleNotFoundError: No module named" in message  # the executor's own words, not the host's
