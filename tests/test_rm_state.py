"""The resource manager's state machines on their own: the registry (workers, devices, health) and the
allocator (grants, the queue), driven by plain calls; then what cluster watchers receive, and workers'
Attach streams (registration and liveness in one), over real gRPC.

Sized for Pathways: a registry of 512 hosts and allocation decisions on 2048 devices are timed here.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.security import ClusterCredentials, generate_token
from pathways_nb.launch.processes import ChildServer
from pathways_nb.rm.allocator import Allocator, Unsatisfiable
from pathways_nb.rm.registry import Registry
from pathways_nb.rm.server import ResourceManagerServer
from pathways_nb.rm.service import SERVICE_NAME, ResourceManagerService
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import wait_until


def _request(island: int, host: int = 0, devices: int = 4, port: int | None = None, pid: int = 100):
    return pb.RegisterWorkerRequest(
        address=f"127.0.0.1:{port or 20000 + island * 16 + host}",
        island=island,
        host_index=host,
        platform="cpu",
        devices=[pb.LocalDevice(local_id=i, kind="cpu", memory_kinds=["unpinned_host"]) for i in range(devices)],
        pid=pid,
        incarnation=1000 + island,
    )


def _registry(islands: int, hosts: int = 1, devices: int = 4, timeout_s: float = 3.0) -> Registry:
    registry = Registry(Topology(islands, "cpu", hosts, devices), timeout_s)
    for island in range(islands):
        for host in range(hosts):
            registry.register(_request(island, host, devices))
    return registry


def _silent_for(registry: Registry, seconds: float, *worker_ids: str) -> None:
    """As if the workers' last heartbeat came ``seconds`` ago (no sleeping, whatever the machine's load)."""
    for worker_id in worker_ids:
        registry.workers[worker_id].last_heartbeat = time.monotonic() - seconds


# -- registry ------------------------------------------------------------------------------


def test_registration_indexes_devices_by_id_and_island():
    registry = Registry(Topology(3, "cpu", 2, 2), 3.0)
    for island, host in [(2, 1), (0, 0), (2, 0), (0, 1)]:  # out of order, island 1 missing
        registry.register(_request(island, host, devices=2))
    assert registry.device_ids() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert registry.device_ids((2,)) == [8, 9, 10, 11]
    assert registry.device_ids((2, 0)) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert registry.device_ids((1,)) == []
    assert registry.islands() == [0, 2]
    assert [d.id for d in registry.devices()] == registry.device_ids()
    device = registry.device(9)
    assert (device.island, device.host_index, device.local_id, device.worker_id) == (2, 0, 1, "island2-host0")
    assert registry.platform == "cpu"
    assert [w.worker_id for w in registry.worker_states()] == [
        "island0-host0",
        "island0-host1",
        "island2-host0",
        "island2-host1",
    ]


def test_registering_again_replaces_the_worker_and_keeps_its_ids():
    registry = _registry(2)
    again = _request(1, port=31000, pid=200)
    again.incarnation = 77
    entry = registry.register(again)
    assert entry.device_ids == [4, 5, 6, 7]
    assert registry.device_ids() == list(range(8))
    assert registry.device(4).incarnation == 77
    assert registry.device(4).worker_address == "127.0.0.1:31000"
    # Its old address is free now; its new one is taken.
    registry.register(_request(0, port=20016))
    with pytest.raises(ValueError, match="already registered as island1-host0"):
        registry.register(_request(0, port=31000))


def test_workers_that_do_not_fit_are_refused():
    registry = _registry(1)
    with pytest.raises(ValueError, match="island 3 does not exist"):
        registry.register(_request(3))
    with pytest.raises(ValueError, match="2 devices, hosts of this cluster have 4"):
        registry.register(_request(0, devices=2))
    with pytest.raises(ValueError, match="not host:port"):
        registry.register(pb.RegisterWorkerRequest(address="nowhere", devices=[pb.LocalDevice()]))


def test_an_instance_type_may_name_the_platform_as_workers_are_told_it():
    """``--instance_type cuda:1x4`` fits a ``--platform cuda`` worker, whose jaxlib reports its GPUs as ``gpu``."""
    for name in ("cuda", "rocm", "gpu"):
        topology = Topology.parse(2, f"{name}:1x4")
        assert topology.instance_type == "gpu:1x4"
        topology.check_worker(1, 0, "gpu", 4)
    with pytest.raises(ValueError, match="the worker's devices are cpu, the cluster's are gpu"):
        Topology.parse(1, "cuda:1x4").check_worker(0, 0, "cpu", 4)
    with pytest.raises(ValueError, match="is not PLATFORM:HOSTSxDEVICES"):
        Topology.parse(1, "cuda:4")


def test_free_form_ids_are_handed_out_once_per_device():
    registry = Registry(None, 3.0)
    registry.register(_request(5, devices=2))
    registry.register(_request(1, devices=2))
    registry.register(_request(5, devices=2))  # again: the same ids
    assert {d.id: d.island for d in registry.devices()} == {0: 5, 1: 5, 2: 1, 3: 1}
    assert registry.device_ids((1,)) == [2, 3]


def test_health_follows_heartbeats_and_exits_and_only_flips_are_changes():
    registry = _registry(2)
    assert [e.worker_id for e in registry.take_changes()] == ["island0-host0", "island1-host0"]
    assert registry.heartbeat("island0-host0", 1000) == (True, False)
    assert registry.heartbeat("island0-host0", 999) == (False, False)  # another incarnation: register again
    assert registry.heartbeat("island7-host0", 1) == (False, False)
    assert registry.take_changes() == []  # heartbeats of healthy workers change nothing

    _silent_for(registry, 3.1, "island0-host0", "island1-host0")
    registry.heartbeat("island1-host0", 1001)
    assert [e.worker_id for e in registry.sweep()] == ["island0-host0"]
    assert registry.sweep() == []
    assert not registry.device(0).healthy and registry.device(4).healthy
    assert "missed its heartbeats" in registry.workers["island0-host0"].down_reason
    assert registry.heartbeat("island0-host0", 1000) == (True, True)  # it was only slow
    assert registry.device(0).healthy

    assert registry.exited(1, 0, pid=999, reason="killed") is None  # not the registered process
    assert registry.exited(1, 0, pid=100, reason="killed by signal SIGKILL").worker_id == "island1-host0"
    assert not registry.device(7).healthy
    states = {w.worker_id: w for w in registry.worker_states([registry.workers["island1-host0"]])}
    assert states["island1-host0"].down_reason == "killed by signal SIGKILL"
    assert [e.worker_id for e in registry.take_changes()] == ["island0-host0", "island1-host0"]
    assert registry.take_changes() == []


def test_attached_workers_live_by_their_stream_and_only_the_unattached_are_swept():
    registry = _registry(3)
    attached, gone = registry.workers["island0-host0"], registry.workers["island1-host0"]
    registry.attach(attached)
    registry.attach(gone)
    registry.take_changes()
    _silent_for(registry, 3.1, *registry.workers)
    # Silent for longer than the time-out: only island 2, which heartbeats, is swept.
    assert [e.worker_id for e in registry.sweep()] == ["island2-host0"]
    assert attached.healthy and attached.state(time.monotonic()).heartbeat_age_s == 0.0

    assert registry.detach(gone) and not registry.detach(gone)  # one stream, one end
    assert gone.healthy  # until the moment for its launcher to say why has passed
    assert registry.detached_for_good(gone)
    assert not gone.healthy and "stream to the resource manager ended" in gone.down_reason
    assert [d.healthy for d in registry.worker_states([gone])] == [False]

    # A worker that registered again on a new stream meanwhile is not the one whose stream ended.
    assert registry.detach(attached)
    again = registry.register(_request(0))
    registry.attach(again)
    assert not registry.detached_for_good(attached) and again.healthy
    # Nor is one whose launcher said why it ended: that cause stays.
    assert registry.detach(again)
    registry.exited(0, 0, pid=100, reason="its process killed by signal SIGKILL")
    assert not registry.detached_for_good(again)
    assert again.down_reason == "its process killed by signal SIGKILL"


def test_load_reports_are_changes_for_watchers_but_not_of_devices():
    registry = _registry(2)
    entry = registry.workers["island1-host0"]
    registry.attach(entry)
    registry.take_changes()
    entry.devices_changed = False
    registry.report_load(entry, pb.WorkerLoad(sessions=2, arrays=5, array_bytes=80))
    assert registry.take_changes() == [entry] and not entry.devices_changed
    assert registry.worker_states([entry])[0].load == pb.WorkerLoad(sessions=2, arrays=5, array_bytes=80)


def test_512_hosts_register_and_a_heartbeat_or_sweep_touches_only_its_own_worker():
    """What keeps 1,024 hosts cheap, as behaviour (the times are in benchmarks/rm_scale.py)."""
    registry = Registry(Topology(512, "cpu", 1, 4), 3.0)
    for island in range(512):
        registry.register(_request(island, port=20000 + island))
    assert len(registry.device_ids()) == 2048
    assert registry.device_ids((300,)) == [1200, 1201, 1202, 1203]
    registry.take_changes()
    for island in range(512):
        registry.attach(registry.workers[f"island{island}-host0"])
    registry.take_changes()
    # Attached workers are never swept, however long since a message: none is looked at.
    _silent_for(registry, 60, *registry.workers)
    assert registry.sweep() == [] and registry.take_changes() == []
    assert registry.heartbeat("island300-host0", 1300) == (True, False)
    assert registry.take_changes() == []


# -- allocator -----------------------------------------------------------------------------


def _submit(allocator: Allocator, registry: Registry, tenant: str, exclusive=False, n=0, islands=(), **more):
    """Submits and checks a request; ``more``: the rest of ``Allocator.submit`` (priority, want)."""
    ticket = allocator.submit(tenant, exclusive, n, tuple(islands), **more)
    allocator.check(ticket, registry)
    return ticket


def test_shared_requests_share_and_exclusive_ones_wait_their_turn():
    registry, allocator = _registry(2), Allocator()
    alice = _submit(allocator, registry, "alice", n=2)
    bob = _submit(allocator, registry, "bob", n=2)
    assert allocator.grant(registry) == [alice, bob]
    assert alice.devices == bob.devices == (0, 1)  # shared: the same lowest ids

    carol = _submit(allocator, registry, "carol", exclusive=True, islands=[0])  # needs 0 and 1
    dave = _submit(allocator, registry, "dave", n=1, islands=[0])  # wants 0: behind carol
    erin = _submit(allocator, registry, "erin", exclusive=True, n=2, islands=[1])  # conflicts with nobody ahead
    assert allocator.grant(registry) == [erin]
    assert erin.devices == (4, 5)
    waiting = allocator.waiting(carol, registry)
    assert waiting.position == 1 and waiting.holders == ["alice (shared)", "bob (shared)"]
    assert (
        allocator.waiting(dave, registry).reason
        == "waiting for a share of 1 devices on islands [0]; 1 request(s) ahead"
    )

    allocator.release(alice)
    allocator.release(bob)
    assert allocator.grant(registry) == [carol]
    assert carol.devices == (0, 1, 2, 3)
    allocator.release(carol)
    assert allocator.grant(registry) == [dave]
    assert [q.tenant for q in allocator.queued(registry)] == []
    assert sorted(s.tenant for s in allocator.states()) == ["dave", "erin"]


def test_a_whole_island_request_waits_for_every_device_of_it():
    registry, allocator = _registry(2), Allocator()
    held = _submit(allocator, registry, "a", exclusive=True, n=1, islands=[1])
    allocator.grant(registry)
    whole = _submit(allocator, registry, "b", islands=[1])
    assert allocator.grant(registry) == []
    allocator.release(held)
    assert allocator.grant(registry) == [whole]
    assert whole.devices == (4, 5, 6, 7)


def test_unsatisfiable_requests_say_why():
    registry, allocator = _registry(2), Allocator()
    with pytest.raises(Unsatisfiable, match=r"no island \[5\] in this cluster \(islands: \[0, 1\]\)"):
        _submit(allocator, registry, "a", islands=[5])
    with pytest.raises(Unsatisfiable, match="9 devices were asked for, but the chosen islands have 8"):
        _submit(allocator, registry, "a", n=9)
    with pytest.raises(Unsatisfiable, match="no worker has registered"):
        _submit(Allocator(), Registry(None, 3.0), "a")


def test_reclaimed_grants_hold_their_devices_until_released_once():
    registry, allocator = _registry(1), Allocator()
    first = allocator.reclaim("alloc-x-1", "alice", True, (0, 1))
    again = allocator.reclaim("alloc-x-1", "alice", True, (0, 1))  # the proxy reclaimed it twice
    bob = _submit(allocator, registry, "bob", n=4)
    assert allocator.grant(registry) == []
    allocator.release(first)
    allocator.release(first)
    assert allocator.grant(registry) == []  # the second reclaim still holds them
    allocator.release(again)
    assert allocator.grant(registry) == [bob]


def test_allocation_decisions_on_2048_devices_respect_the_queue_and_fill_the_cluster():
    """Decisions on a big, busy cluster (their times: benchmarks/rm_scale.py, Allocate p50/p99)."""
    registry, allocator = _registry(512), Allocator()
    for island in range(0, 512, 2):  # every other island held exclusively, and the rest shared
        _submit(allocator, registry, f"x{island}", exclusive=True, islands=[island])
        _submit(allocator, registry, f"s{island}", n=2, islands=[island + 1])
    assert len(allocator.grant(registry)) == 512
    blocked = _submit(allocator, registry, "whole", exclusive=True)  # waits behind everyone
    for i in range(200):
        ticket = _submit(allocator, registry, f"t{i}", exclusive=bool(i % 2), n=8)
        granted = allocator.grant(registry)
        allocator.waiting(blocked, registry)
        allocator.release(ticket)
        assert granted == [] and ticket not in allocator.queue  # all of them conflict with "whole", ahead
    allocator.release(blocked)
    for i in range(64):  # until the cluster is full: each one looks further for free devices
        ticket = _submit(allocator, registry, f"g{i}", exclusive=True, n=8)
        assert allocator.grant(registry) == [ticket]
    assert len(set(d for t in allocator.granted.values() for d in t.devices)) == 2048


def test_big_clusters_hand_out_longer_heartbeat_intervals():
    service = ResourceManagerService(Topology(512, "cpu", 1, 4), worker_timeout_s=3.0, heartbeat_interval_s=0.5)
    assert service.worker_heartbeat_interval_s() == 0.5
    for island in range(512):
        service.registry.register(_request(island, port=20000 + island))
        if island == 63:
            assert service.worker_heartbeat_interval_s() == 0.5
    # 512 workers at 256 heartbeats/s would be 2 s apart; a third of the timeout is the most.
    assert service.worker_heartbeat_interval_s() == 1.0


def test_big_clusters_hand_out_longer_load_intervals():
    service = ResourceManagerService(Topology(1024, "cpu", 1, 4))
    for island in range(1024):
        service.registry.register(_request(island, port=20000 + island))
        if island == 63:
            assert service.worker_update_interval_s() == 1.0
    assert service.worker_update_interval_s() == 16.0  # 1024 workers, 64 reports/s at most


# -- what watchers receive -----------------------------------------------------------------


def test_watchers_get_the_whole_state_then_only_what_changed_and_heartbeats_stream():
    credentials = ClusterCredentials(token=generate_token())
    server = ResourceManagerServer(Topology(3, "cpu", 1, 2), credentials=credentials)
    try:
        with credentials.channel(server.address) as channel:
            stub = cluster_pb2_grpc.ResourceManagerStub(channel)
            stub.RegisterWorker(_request(0, devices=2), timeout=10)
            deltas = stub.WatchCluster(pb.ClusterStateRequest(deltas=True), timeout=30)
            whole = stub.WatchCluster(pb.ClusterStateRequest(), timeout=30)
            first = next(deltas)
            assert not first.delta and [w.worker_id for w in first.workers] == ["island0-host0"]
            assert len(next(whole).devices) == 2
            stub.RegisterWorker(_request(2, devices=2), timeout=10)
            stub.RegisterWorker(_request(1, devices=2), timeout=10)
            seen: set[str] = set()
            while seen != {"island1-host0", "island2-host0"}:
                update = next(deltas)
                assert update.delta and update.islands == 3
                assert {d.worker_id for d in update.devices} == {w.worker_id for w in update.workers}
                seen.update(w.worker_id for w in update.workers)
            while len((state := next(whole)).workers) < 3:
                assert not state.delta
            assert [d.id for d in state.devices] == [0, 1, 2, 3, 4, 5]
            stub.ReportWorkerExit(pb.WorkerExitReport(island=2, host_index=0, pid=100, reason="gone"), timeout=10)
            update = next(deltas)
            assert [(w.worker_id, w.healthy, w.down_reason) for w in update.workers] == [
                ("island2-host0", False, "gone")
            ]
            assert [d.healthy for d in update.devices] == [False, False]
            # Heartbeats as messages on one stream: a reply each, with the interval to keep.
            beats = [pb.HeartbeatRequest(worker_id="island0-host0", incarnation=1000), pb.HeartbeatRequest()]
            replies = list(stub.Heartbeats(iter(beats), timeout=10))
            assert [(r.known, r.heartbeat_interval_s) for r in replies] == [(True, 0.5), (False, 0.5)]
            deltas.cancel()
            whole.cancel()
    finally:
        server.stop()


# -- workers' Attach streams ---------------------------------------------------------------


class _Attached:
    """A worker's Attach stream driven by hand, as ``pathways_nb.worker.server`` drives it."""

    def __init__(self, stub: cluster_pb2_grpc.ResourceManagerStub, request: pb.RegisterWorkerRequest):
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._messages.put(pb.WorkerUpdate(registration=request))
        self.call = stub.Attach(iter(self._messages.get, None), timeout=60)
        self.first = next(self.call)

    def report(self, load: pb.WorkerLoad) -> None:
        self._messages.put(pb.WorkerUpdate(load=load))

    def close(self) -> None:
        """Ends the stream from the worker's side, as a worker that stops does."""
        self._messages.put(None)


def _worker(stub: cluster_pb2_grpc.ResourceManagerStub, worker_id: str) -> pb.WorkerState:
    state = stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)
    return next(w for w in state.workers if w.worker_id == worker_id)


def _holds(condition: Callable[[], bool], for_s: float) -> bool:
    """Whether ``condition`` stays true for ``for_s`` seconds (polled)."""
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def resource_manager():
    """A resource manager with the default worker time-out (3 s: pings every 0.5 s, 2 s to answer, 0.5 s to settle)."""
    credentials = ClusterCredentials(token=generate_token())
    server = ResourceManagerServer(Topology(2, "cpu", 1, 2), credentials=credentials)
    try:
        with credentials.channel(server.address) as channel:
            yield server, cluster_pb2_grpc.ResourceManagerStub(channel)
    finally:
        server.stop()


def test_an_attached_worker_lives_by_its_open_stream_without_a_message(resource_manager):
    _server, stub = resource_manager
    deltas = stub.WatchCluster(pb.ClusterStateRequest(deltas=True), timeout=60)
    assert not next(deltas).workers
    worker = _Attached(stub, _request(1, devices=2))
    assert worker.first.registration.worker_id == "island1-host0"
    assert list(worker.first.registration.device_ids) == [2, 3]
    assert worker.first.update_interval_s == 1.0
    # Two time-outs without a message: still healthy (gRPC's keepalive vouches for it).
    assert _holds(lambda: _worker(stub, "island1-host0").healthy, 2 * 3.0)
    state = _worker(stub, "island1-host0")
    assert state.attached and state.heartbeat_age_s == 0.0

    worker.report(pb.WorkerLoad(sessions=2, arrays=3, array_bytes=96))
    wait_until(lambda: _worker(stub, "island1-host0"), 10, "the load report", holds=lambda w: w.load.arrays == 3)
    seen = []
    while not any(w.load.arrays == 3 for w in seen):
        update = next(deltas)
        seen.extend(update.workers)
        # Its devices went out when it registered; a load report does not send them again.
        assert not update.devices or any(not w.load.arrays for w in update.workers)

    worker.close()  # the worker stops: its stream ends
    wait_until(
        lambda: _worker(stub, "island1-host0"), 10, "unhealthy once its stream ended", holds=lambda w: not w.healthy
    )
    assert "stream to the resource manager ended" in _worker(stub, "island1-host0").down_reason
    again = _Attached(stub, _request(1, devices=2))  # registering again on a new stream: healthy again
    assert again.first.registration.incarnation == 1001
    state = _worker(stub, "island1-host0")
    assert state.healthy and state.attached and not state.load.arrays
    again.close()
    deltas.cancel()


def test_a_launcher_report_just_after_the_stream_ended_gives_the_cause(resource_manager):
    server, stub = resource_manager
    worker = _Attached(stub, _request(0, devices=2))
    worker.call.cancel()  # the process died: its connection closed at once
    report = pb.WorkerExitReport(island=0, host_index=0, pid=100, reason="its process killed by signal SIGKILL")
    assert stub.ReportWorkerExit(report, timeout=10).known
    reason = lambda: _worker(stub, "island0-host0").down_reason  # noqa: E731
    assert reason() == "its process killed by signal SIGKILL"
    assert _holds(lambda: reason() == "its process killed by signal SIGKILL", 2 * server.service.liveness.settle_s)


def test_attach_without_a_valid_registration_is_refused_and_the_server_serves_on(resource_manager):
    _server, stub = resource_manager
    cases = [
        ([], "must register the worker"),
        ([pb.WorkerUpdate(load=pb.WorkerLoad(sessions=1))], "must register the worker"),
        ([pb.WorkerUpdate(registration=_request(0, devices=3))], "cannot register worker: the worker has 3 devices"),
        ([pb.WorkerUpdate(registration=_request(5, devices=2))], "cannot register worker: island 5 does not exist"),
    ]
    for messages, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Attach(iter(messages), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()
    worker = _Attached(stub, _request(0, devices=2))
    assert _worker(stub, "island0-host0").attached
    worker.close()


def test_load_reports_never_wake_a_waiting_allocation(resource_manager):
    _server, stub = resource_manager
    worker = _Attached(stub, _request(0, devices=2))
    holder = stub.Allocate(pb.AllocateRequest(tenant="a", exclusive=True, num_devices=2), timeout=60)
    assert next(holder).HasField("granted")
    waiting = stub.Allocate(pb.AllocateRequest(tenant="b", exclusive=True, num_devices=2), timeout=60)
    updates: queue.SimpleQueue = queue.SimpleQueue()

    def follow() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for update in waiting:
                updates.put(update)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert updates.get(timeout=10).HasField("waiting")
    for arrays in range(1, 21):
        worker.report(pb.WorkerLoad(arrays=arrays))
    wait_until(lambda: _worker(stub, "island0-host0"), 10, "the load reports", holds=lambda w: w.load.arrays == 20)
    assert updates.empty()  # each wake-up would have sent the waiting request another update
    holder.cancel()
    while not (update := updates.get(timeout=10)).HasField("granted"):
        assert update.HasField("waiting")
    waiting.cancel()
    follower.join(10)
    worker.close()


class _WithoutAttach(ResourceManagerService):
    """The resource manager as it was before Attach: gRPC answers UNIMPLEMENTED for it, as it does for
    any method a server does not have (the generated servicer's default)."""

    Attach = cluster_pb2_grpc.ResourceManagerServicer.Attach


def test_a_worker_registers_and_heartbeats_with_a_resource_manager_without_attach():
    service = _WithoutAttach(Topology(1, "cpu", 1, 1))

    async def start() -> None:
        service.start()

    server = BackgroundServer(
        lambda grpc_server: cluster_pb2_grpc.add_ResourceManagerServicer_to_server(service, grpc_server),
        [SERVICE_NAME],
        on_start=start,
        on_stop=service.stop,
    )
    worker = ChildServer(
        "worker",
        f"worker --resource_manager_address {server.address} --server_port 0 --devices 1 --platform cpu".split(),
    )
    try:
        worker.start(120)
        with grpc.insecure_channel(server.address) as channel:
            stub = cluster_pb2_grpc.ResourceManagerStub(channel)
            state = _worker(stub, "island0-host0")
            assert state.healthy and not state.attached and state.pid == worker.process.pid
            # Alive by its heartbeats, for two time-outs.
            assert _holds(lambda: _worker(stub, "island0-host0").healthy, 2 * 3.0)
            worker.process.send_signal(signal.SIGSTOP)  # silent: found dead by its missed heartbeats
            wait_until(
                lambda: _worker(stub, "island0-host0"),
                30,
                "the silent worker found dead",
                holds=lambda w: not w.healthy,
            )
            assert "missed its heartbeats" in _worker(stub, "island0-host0").down_reason
            worker.process.send_signal(signal.SIGCONT)
            wait_until(lambda: _worker(stub, "island0-host0"), 30, "the worker back", holds=lambda w: w.healthy)
    finally:
        if worker.process is not None:
            worker.process.send_signal(signal.SIGCONT)
        worker.close()
        server.stop()
