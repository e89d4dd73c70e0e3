"""The resource manager's state machines on their own: the registry (workers, devices, health) and the
allocator (grants, the queue), driven by plain calls; then what cluster watchers receive, over real gRPC.

Sized for Pathways: a registry of 512 hosts and allocation decisions on 2048 devices are timed here.
"""

from __future__ import annotations

import time

import pytest

from pathways_nb.core.security import ClusterCredentials, generate_token
from pathways_nb.rm.allocator import Allocator, Unsatisfiable
from pathways_nb.rm.registry import Registry
from pathways_nb.rm.server import ResourceManagerServer
from pathways_nb.rm.service import ResourceManagerService
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc


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
    registry = _registry(2, timeout_s=0.05)
    assert [e.worker_id for e in registry.take_changes()] == ["island0-host0", "island1-host0"]
    assert registry.heartbeat("island0-host0", 1000) == (True, False)
    assert registry.heartbeat("island0-host0", 999) == (False, False)  # another incarnation: register again
    assert registry.heartbeat("island7-host0", 1) == (False, False)
    assert registry.take_changes() == []  # heartbeats of healthy workers change nothing

    time.sleep(0.06)
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


def test_512_hosts_register_in_well_under_a_second():
    requests = [_request(island, port=20000 + island) for island in range(512)]
    registry = Registry(Topology(512, "cpu", 1, 4), 3.0)
    started = time.perf_counter()
    for request in requests:
        registry.register(request)
    elapsed = time.perf_counter() - started
    assert len(registry.device_ids()) == 2048
    assert elapsed < 0.25, f"registering 512 hosts took {elapsed:.3f} s"
    started = time.perf_counter()
    for _ in range(512):
        registry.heartbeat("island300-host0", 1300)
    registry.sweep()
    assert time.perf_counter() - started < 0.05


# -- allocator -----------------------------------------------------------------------------


def _submit(allocator: Allocator, registry: Registry, tenant: str, exclusive=False, n=0, islands=()):
    ticket = allocator.submit(tenant, exclusive, n, tuple(islands))
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


def test_allocation_decisions_on_2048_devices_take_under_10_ms():
    registry, allocator = _registry(512), Allocator()
    for island in range(0, 512, 2):  # every other island held exclusively, and the rest shared
        _submit(allocator, registry, f"x{island}", exclusive=True, islands=[island])
        _submit(allocator, registry, f"s{island}", n=2, islands=[island + 1])
    assert len(allocator.grant(registry)) == 512
    blocked = _submit(allocator, registry, "whole", exclusive=True)  # waits behind everyone
    timings = []
    for i in range(200):
        started = time.perf_counter()
        ticket = _submit(allocator, registry, f"t{i}", exclusive=bool(i % 2), n=8)
        granted = allocator.grant(registry)
        allocator.waiting(blocked, registry)
        allocator.release(ticket)
        timings.append(time.perf_counter() - started)
        assert granted == [] and ticket not in allocator.queue  # all of them conflict with "whole", ahead
    timings.sort()
    assert timings[int(len(timings) * 0.99)] < 0.010, f"p99 {timings[int(len(timings) * 0.99)] * 1e3:.1f} ms"
    allocator.release(blocked)
    timings = []
    for i in range(64):  # until the cluster is full: each one looks further for free devices
        started = time.perf_counter()
        ticket = _submit(allocator, registry, f"g{i}", exclusive=True, n=8)
        assert allocator.grant(registry) == [ticket]
        timings.append(time.perf_counter() - started)
    assert len(set(d for t in allocator.granted.values() for d in t.devices)) == 2048
    timings.sort()
    assert timings[int(len(timings) * 0.99)] < 0.010, f"p99 {timings[int(len(timings) * 0.99)] * 1e3:.1f} ms"


def test_big_clusters_hand_out_longer_heartbeat_intervals():
    service = ResourceManagerService(Topology(512, "cpu", 1, 4), worker_timeout_s=3.0, heartbeat_interval_s=0.5)
    assert service.worker_heartbeat_interval_s() == 0.5
    for island in range(512):
        service.registry.register(_request(island, port=20000 + island))
        if island == 63:
            assert service.worker_heartbeat_interval_s() == 0.5
    # 512 workers at 256 heartbeats/s would be 2 s apart; a third of the timeout is the most.
    assert service.worker_heartbeat_interval_s() == 1.0


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
