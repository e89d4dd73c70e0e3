"""The cluster as a whole: islands, pipelines across them, tenants, dead workers, bad messages, processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest

from pathways_nb.core.security import TOKEN_ENV
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import finish, finished_ok, python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
PIPELINE = CLIENTS / "pipeline_across_islands.py"
CLIENT = CLIENTS / "steps_on_every_device.py"  # argv: address, tenant
HOLD = CLIENTS / "holds_devices_exclusively.py"
WAIT = CLIENTS / "waits_for_exclusive_devices.py"
KILLED = CLIENTS / "island_worker_killed.py"


@pytest.fixture(scope="module")
def island_cluster():
    """A cluster of its own: these tests kill workers and hold devices exclusively."""
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        yield cluster


def test_two_stage_pipeline_across_islands(island_cluster):
    result = json.loads(finished_ok(python_script(PIPELINE, island_cluster.address)))
    assert result["islands"] == [1]
    assert result["max_error"] == 0.0


def test_two_clients_at_once(island_cluster):
    clients = [python_script(CLIENT, island_cluster.address, f"tenant-{i}") for i in range(2)]
    outputs = [finished_ok(client).split() for client in clients]
    assert outputs == [["4", "tenant-0"], ["4", "tenant-1"]]


def test_exclusive_use_queues_others_and_times_out(island_cluster):
    # The token lets disconnect() end the session through the observe API.
    holder = python_script(HOLD, island_cluster.address, env={TOKEN_ENV: island_cluster.token})
    try:
        assert holder.stdout.readline().strip() == "holding"
        waiter = python_script(WAIT, island_cluster.address)
        queued = wait_until(
            lambda: [q for q in island_cluster.state().queue if q.tenant == "bob"], 30, "bob queued", interval_s=0.1
        )
        assert "held by alice (exclusive)" in queued[0].waiting.reason
        seconds, message = finished_ok(waiter).split(" ", 1)
        assert 2 <= int(seconds) <= 30
        assert "alice (exclusive)" in message and "exclusive" in message
        # Disconnecting releases the devices, although alice still holds an array.
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        assert finished_ok(python_script(WAIT, island_cluster.address)).strip() == "connected"
    finally:
        holder.communicate("\n", timeout=60)
    assert not island_cluster.state().allocations


def test_dead_worker_fails_its_island_fast_and_rejoins(island_cluster):
    client = python_script(KILLED, island_cluster.address)
    try:
        assert client.stdout.readline().strip() == "1.0"
        island_cluster.kill_worker(1)
        client.stdin.write("\n")
        client.stdin.flush()
        report = json.loads(client.stdout.readline())
        assert "island 1 host 0" in report["failure"]
        assert "unreachable" in report["failure"] or "down" in report["failure"]
        assert report["seconds"] < 10
        assert report["island0"] == 1.0
        island_cluster.restart_worker(1)
        wait_until(
            island_cluster.state,
            30,
            "every worker healthy",
            holds=lambda state: all(w.healthy for w in state.workers),
            interval_s=0.1,
        )
        client.stdin.write("\n")
        client.stdin.flush()
        line = client.stdout.readline()
        # A client that ended here once, on a loaded machine: what it said is the first thing to know.
        assert line, f"the client ended after island 1 came back; its stderr:\n{finish(client)[1][-4000:]}"
        assert json.loads(line) == {"island1": 42.0}
    finally:
        client.kill()
        client.communicate()


def test_malformed_messages_to_resource_manager_and_worker(island_cluster):
    with island_cluster.credentials.channel(island_cluster.resource_manager_address) as channel:
        garbage = channel.unary_unary("/pathways_nb.v1.ResourceManager/RegisterWorker")
        with pytest.raises(grpc.RpcError) as error:
            garbage(b"\xff\xfe not a protobuf", timeout=10)
        assert "Error parsing message with type 'pathways_nb.v1.RegisterWorkerRequest'" in error.value.details()
        stub = cluster_pb2_grpc.ResourceManagerStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.RegisterWorker(pb.RegisterWorkerRequest(address="nowhere", island=7), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "host:port" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            next(stub.Allocate(pb.AllocateRequest(num_devices=99), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "99 devices" in error.value.details()
        assert len(stub.GetClusterState(pb.ClusterStateRequest(), timeout=10).workers) == 2
    worker_address = island_cluster.workers[(0, 0)].hostport
    with island_cluster.credentials.channel(worker_address) as channel:
        session = channel.stream_stream("/pathways_nb.v1.Worker/Session")
        with pytest.raises(grpc.RpcError):
            list(session(iter([b"\x0a\xff\xff\xff"]), timeout=10))
        stub = cluster_pb2_grpc.WorkerStub(channel)
        no_name = stub.Session(iter([pb.CommandBatch()]), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(no_name)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        unknown = pb.Command(fetch=pb.Fetch(id=12345, request=1))
        replies = stub.Session(iter([pb.CommandBatch(session="probe", commands=[unknown])]), timeout=10)
        reply = next(replies).replies[0]
        assert reply.error.code == grpc.StatusCode.NOT_FOUND.value[0] and "12345" in reply.error.message
        replies.cancel()
    assert finished_ok(python_script(CLIENT, island_cluster.address, "after-bad-messages")).split()[0] == "4"


def test_malformed_messages_to_observe_api(island_cluster):
    with island_cluster.credentials.channel(island_cluster.address.removeprefix("grpc://")) as channel:
        garbage = channel.unary_unary("/pathways_nb.v1.Observe/GetEvents")
        with pytest.raises(grpc.RpcError) as error:
            garbage(b"\xff\xfe not a protobuf", timeout=10)
        assert "Error parsing message with type 'pathways_nb.v1.WatchEventsRequest'" in error.value.details()
        stub = cluster_pb2_grpc.ObserveStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.EndSessions(pb.EndSessionsRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "name the tenant" in error.value.details()
        assert len(stub.GetEvents(pb.WatchEventsRequest(after=2**63), timeout=10).events) == 0
        assert len(stub.GetClusterState(pb.ClusterStateRequest(), timeout=10).workers) == 2


def _children_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_close_leaves_no_process_behind():
    cluster = LocalCluster(islands=1, devices_per_host=1)
    pids = [child.process.pid for child in cluster.processes()]
    assert len(pids) == 3 and all(psutil.pid_exists(pid) for pid in pids)
    cluster.close()
    cluster.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


def test_children_stop_when_their_launcher_is_killed():
    launcher = python_script(CLIENTS / "launches_a_cluster.py")
    pids = [int(p) for p in launcher.stdout.readline().split()]
    assert len(pids) == 3
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    wait_until(
        lambda: [pid for pid in pids if psutil.pid_exists(pid)], 20, "no child left", holds=lambda left: not left
    )


def test_up_prints_its_address_and_stops_on_ctrl_c():
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
    first = up.stdout.readline()
    assert first.startswith("pathways-nb cluster serving grpc://127.0.0.1:") and "started in" in first
    children = _children_of(up.pid)
    assert len(children) == 3
    up.send_signal(signal.SIGINT)
    assert up.wait(30) == 0
    assert not any(child.is_running() and child.status() != "zombie" for child in children)
