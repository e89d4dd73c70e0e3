"""Priorities and suspending: the queue's order, whom a waiting request asks to suspend, resuming on the
same devices, and tenants' priority ceilings.

First the allocator on its own, driven by plain calls; then a real resource manager over gRPC, whose
holders' ``Allocate`` streams carry ``Wanted``; then the flags of the commands that start one.
"""

from __future__ import annotations

import contextlib
import queue
import tempfile
import threading
from collections.abc import Iterator

import grpc
import pytest
import yaml
from test_rm_state import _registry, _request, _submit

from pathways_nb import cli
from pathways_nb.core.security import ClusterCredentials, generate_token
from pathways_nb.deploy import kubernetes
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.rm import server as rm_server
from pathways_nb.rm.allocator import Allocator
from pathways_nb.rm.server import ResourceManagerServer
from pathways_nb.rm.service import ResourceManagerService
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

# -- the allocator ---------------------------------------------------------------------------


def test_the_queue_serves_higher_priorities_first_and_equal_ones_in_arrival_order():
    registry, allocator = _registry(2), Allocator()
    everything = _submit(allocator, registry, "holder", exclusive=True)
    allocator.grant(registry)
    for tenant, priority in [("a", 0), ("b", 5), ("c", 5), ("d", -1), ("e", 0)]:
        _submit(allocator, registry, tenant, exclusive=True, priority=priority)
    queued = allocator.queued(registry)
    assert [(q.tenant, q.priority, q.waiting.position) for q in queued] == [
        ("b", 5, 1),
        ("c", 5, 2),
        ("a", 0, 3),
        ("e", 0, 4),
        ("d", -1, 5),
    ]
    served = []
    holder = everything
    while holder is not None:
        allocator.release(holder)
        granted = allocator.grant(registry)
        served += [t.tenant for t in granted]
        holder = granted[0] if granted else None
    assert served == ["b", "c", "a", "e", "d"]


def test_a_higher_priority_request_preempts_and_does_not_wait_behind_lower_ones_queued_first():
    registry, allocator = _registry(2), Allocator()
    holder = _submit(allocator, registry, "holder", exclusive=True, islands=[0])
    allocator.grant(registry)
    _submit(allocator, registry, "early", exclusive=True, islands=[0])
    urgent = _submit(allocator, registry, "urgent", exclusive=True, islands=[0], priority=5)
    assert allocator.grant(registry) == []
    assert allocator.contention(registry) == [holder]
    assert holder.told == pb.Wanted(by="tenant urgent (priority 5, exclusive)", preempt=True, priority=5)
    assert allocator.waiting(urgent, registry).reason == (
        "waiting for exclusive use of 4 devices on islands [0], held by holder (exclusive); "
        "asking holder to suspend (preempted)"
    )
    allocator.release(holder)  # its proxy suspended the session
    assert allocator.grant(registry) == [urgent]
    # "early" (priority 0) now waits for "urgent" (priority 5), which keeps its devices: nobody is asked.
    assert allocator.contention(registry) == []
    assert urgent.told == pb.Wanted()


def test_each_holder_is_told_of_the_highest_priority_request_that_asks_it_and_once():
    registry, allocator = _registry(2), Allocator()
    holder = _submit(allocator, registry, "holder", exclusive=True, islands=[1])
    allocator.grant(registry)
    low = _submit(allocator, registry, "low", n=1, islands=[1], priority=3)  # shared, but the holder is not
    assert allocator.grant(registry) == []
    assert allocator.contention(registry) == [holder]
    assert holder.told == pb.Wanted(by="tenant low (priority 3, shared)", preempt=True, priority=3)
    high = _submit(allocator, registry, "high", exclusive=True, islands=[1], priority=7)
    allocator.grant(registry)
    assert allocator.contention(registry) == [holder]
    assert holder.told.by == "tenant high (priority 7, exclusive)"
    assert allocator.contention(registry) == []  # nothing changed: nothing to tell
    allocator.release(high)  # it gave up
    assert allocator.contention(registry) == [holder]
    assert holder.told.by == "tenant low (priority 3, shared)"
    allocator.release(low)
    assert allocator.contention(registry) == [holder]
    assert holder.told == pb.Wanted()  # nobody wants its devices any more: told once
    assert allocator.contention(registry) == []


def test_nobody_is_asked_when_a_holder_would_keep_its_devices_unless_idle_sessions_are_suspended():
    for suspend_idle_after_s in (0.0, 60.0):
        registry, allocator = _registry(2), Allocator(suspend_idle_after_s)
        low = _submit(allocator, registry, "low", exclusive=True, islands=[0])
        high = _submit(allocator, registry, "high", exclusive=True, islands=[1], priority=10)
        shared = _submit(allocator, registry, "shared", n=1, islands=[1], priority=-5)
        assert allocator.grant(registry) == [high, low]  # in priority order
        assert allocator.grant(registry) == []  # "shared" waits for "high", which is exclusive
        everything = _submit(allocator, registry, "everything", exclusive=True, priority=5)
        allocator.grant(registry)
        changed = allocator.contention(registry)
        reason = allocator.waiting(everything, registry).reason
        assert reason.startswith("waiting for exclusive use of 8 devices, held by high (exclusive), low (exclusive)")
        if not suspend_idle_after_s:
            assert "asking" not in reason
            assert changed == []  # suspending "low" would not free "high"'s devices, nor would "shared" help
        else:
            assert reason.endswith("; asking low to suspend (preempted); asking high to suspend once idle for 60 s")
            assert set(changed) == {low, high}
            assert low.told == pb.Wanted(by="tenant everything (priority 5, exclusive)", preempt=True, priority=5)
            assert high.told == pb.Wanted(by="tenant everything (priority 5, exclusive)", priority=5)
            assert shared.granted is False and allocator.queue == [everything, shared]


def test_shared_requests_ask_only_exclusive_holders():
    registry, allocator = _registry(1), Allocator(30.0)
    sharer = _submit(allocator, registry, "sharer", n=2)
    allocator.grant(registry)
    _submit(allocator, registry, "alone", exclusive=True, priority=1)
    other = _submit(allocator, registry, "other", n=2)  # could share with "sharer", but waits behind "alone"
    assert allocator.grant(registry) == []
    assert allocator.contention(registry) == [sharer]
    assert sharer.told == pb.Wanted(by="tenant alone (priority 1, exclusive)", preempt=True, priority=1)
    assert "asking" not in allocator.waiting(other, registry).reason


def test_a_resuming_request_waits_for_exactly_its_devices_registered():
    registry, allocator = _registry(2), Allocator()
    holder = _submit(allocator, registry, "holder", exclusive=True, n=2)
    allocator.grant(registry)
    assert holder.devices == (0, 1)
    resuming = _submit(allocator, registry, "resuming", exclusive=True, n=5, islands=[1], want=(1, 0, 1))
    assert (resuming.want, resuming.num_devices, resuming.islands) == ((0, 1), 2, ())
    assert allocator.grant(registry) == []  # devices 2-7 are free, but they are not its devices
    (queued,) = allocator.queued(registry)
    assert queued.resuming and queued.num_devices == 2
    assert queued.waiting.reason == "waiting for exclusive use of the devices [0, 1] again, held by holder (exclusive)"
    allocator.release(holder)
    assert allocator.grant(registry) == [resuming]
    assert resuming.devices == (0, 1)
    allocator.release(resuming)
    away = _submit(allocator, registry, "away", want=(0, 99))  # device 99's worker is not registered (now)
    assert allocator.grant(registry) == []
    (queued,) = allocator.queued(registry)
    assert (
        queued.waiting.reason
        == "waiting for a share of the devices [0, 99] again (the worker of [99] is not registered now)"
    )
    assert not away.granted


def test_a_resume_that_accepts_the_same_shape_takes_free_devices_like_its_own():
    """Its own devices first; where they are taken, the same local ids on another host (of the islands it asked
    for); a session over two hosts moves to another island's two hosts at the same host indices."""
    registry, allocator = _registry(3, hosts=2, devices=2), Allocator()  # island i host h: 4i + 2h, 4i + 2h + 1
    holder = _submit(allocator, registry, "holder", exclusive=True, islands=[0])
    allocator.grant(registry)
    one_host = _submit(allocator, registry, "one", exclusive=True, want=(1,), same_shape=True)
    assert allocator.grant(registry) == [one_host]
    assert one_host.devices == (5,)  # local id 1 of island 0 host 1 is taken too: island 1 host 0's
    allocator.release(one_host)
    kept_to_2 = _submit(allocator, registry, "kept", exclusive=True, islands=[2], want=(1,), same_shape=True)
    assert allocator.grant(registry) == [kept_to_2]
    assert kept_to_2.devices == (9,)
    two_hosts = _submit(allocator, registry, "two", exclusive=True, want=(0, 1, 2, 3), same_shape=True)
    assert allocator.grant(registry) == [two_hosts]
    assert two_hosts.devices == (4, 5, 6, 7)
    mine = _submit(allocator, registry, "mine", exclusive=True, want=(0, 1, 2, 3), same_shape=True)
    allocator.release(holder)
    assert allocator.grant(registry) == [mine]
    assert mine.devices == (0, 1, 2, 3)  # its own, free again


def test_a_drained_host_goes_to_nobody_new_and_its_holders_are_asked_to_suspend():
    registry, allocator = _registry(2, devices=2), Allocator()
    on_0 = _submit(allocator, registry, "resident", exclusive=True, want=(0,))
    allocator.grant(registry)
    allocator.draining.add((0, 0))
    allocator.grant(registry)
    assert allocator.contention(registry) == [on_0]
    assert on_0.told == pb.Wanted(by="an operator draining island 0 host 0", preempt=True, drain=True)
    newcomer = _submit(allocator, registry, "newcomer", n=2)
    assert allocator.grant(registry) == [newcomer]
    assert newcomer.devices == (2, 3)  # not island 0's
    allocator.release(on_0)  # its proxy suspended it; it resumes elsewhere, or waits
    back = _submit(allocator, registry, "resident", exclusive=True, want=(0,))
    assert allocator.grant(registry) == []
    assert "(island 0 host 0 is being drained)" in allocator.waiting(back, registry).reason
    moved = _submit(allocator, registry, "mover", want=(0,), same_shape=True)
    assert allocator.grant(registry) == [moved]
    assert moved.devices == (2,)
    allocator.draining.discard((0, 0))
    assert allocator.grant(registry) == [back]


# -- over gRPC -------------------------------------------------------------------------------


class _Stream:
    """An ``Allocate`` call read on a thread, so that a test awaits each update with a time-out."""

    def __init__(self, stub: cluster_pb2_grpc.ResourceManagerStub, **request):
        self.call = stub.Allocate(pb.AllocateRequest(**request), timeout=60)
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for update in self.call:
                self._updates.put(update)

    def next(self) -> pb.AllocateUpdate:
        return self._updates.get(timeout=10)

    def granted(self) -> pb.Allocation:
        """The grant, after any updates of the wait."""
        while (update := self.next()).HasField("waiting"):
            pass
        return update.granted

    def wanted(self) -> pb.Wanted:
        update = self.next()
        assert update.HasField("wanted"), update
        return update.wanted


@contextlib.contextmanager
def _resource_manager(**policy) -> Iterator[tuple[ResourceManagerServer, cluster_pb2_grpc.ResourceManagerStub]]:
    """A resource manager with the session ``policy``, and two islands of 2 devices registered."""
    credentials = ClusterCredentials(token=generate_token())
    # Workers registered without Attach: the time-out is long, so that they never turn unhealthy here.
    server = ResourceManagerServer(Topology(2, "cpu", 1, 2), worker_timeout_s=300, credentials=credentials, **policy)
    try:
        with credentials.channel(server.address) as channel:
            stub = cluster_pb2_grpc.ResourceManagerStub(channel)
            for island in range(2):
                stub.RegisterWorker(_request(island, devices=2), timeout=10)
            yield server, stub
    finally:
        server.stop()


def test_a_holder_is_asked_to_suspend_for_a_higher_priority_request_and_resumes_on_its_devices():
    with _resource_manager() as (_server, stub):
        alice = _Stream(stub, tenant="alice", exclusive=True, islands=[1])
        granted = alice.granted()
        assert [d.id for d in granted.devices] == [2, 3]
        assert (granted.suspend_idle_after_s, granted.suspend_idle_always) == (0.0, False)
        bob = _Stream(stub, tenant="bob", exclusive=True, islands=[1], priority=10)
        assert bob.next().waiting.reason == (
            "waiting for exclusive use of 2 devices on islands [1], held by alice (exclusive); "
            "asking alice to suspend (preempted)"
        )
        assert alice.wanted() == pb.Wanted(by="tenant bob (priority 10, exclusive)", preempt=True, priority=10)
        state = stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)
        assert [(a.tenant, a.priority) for a in state.allocations] == [("alice", 0)]
        assert [(q.tenant, q.priority, q.resuming) for q in state.queue] == [("bob", 10, False)]

        alice.call.cancel()  # her proxy suspended her session: the devices are free
        assert [d.id for d in bob.granted().devices] == [2, 3]
        resumed = _Stream(stub, tenant="alice", exclusive=True, want_device_ids=[3, 2])
        assert resumed.next().waiting.reason == (
            "waiting for exclusive use of the devices [2, 3] again, held by bob (exclusive)"
        )
        state = stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)
        assert [(q.tenant, q.num_devices, q.resuming) for q in state.queue] == [("alice", 2, True)]
        # Bob outranks her and idle sessions are never suspended: he is told nothing of her, so the first
        # thing he hears is of carol, who outranks him, then that nobody wants his devices once she gives up.
        carol = _Stream(stub, tenant="carol", exclusive=True, islands=[1], priority=20)
        carol.next()
        assert bob.wanted() == pb.Wanted(by="tenant carol (priority 20, exclusive)", preempt=True, priority=20)
        carol.call.cancel()
        assert bob.wanted() == pb.Wanted()
        bob.call.cancel()
        assert [d.id for d in resumed.granted().devices] == [2, 3]
        resumed.call.cancel()


def test_idle_holders_are_asked_for_requests_of_their_priority_only_with_the_idle_policy():
    with _resource_manager(suspend_idle_after_s=30, suspend_idle_always=True) as (_server, stub):
        alice = _Stream(stub, tenant="alice", exclusive=True, islands=[0])
        granted = alice.granted()
        assert (granted.suspend_idle_after_s, granted.suspend_idle_always) == (30.0, True)
        bob = _Stream(stub, tenant="bob", exclusive=True, islands=[0])
        assert bob.next().waiting.reason.endswith("; asking alice to suspend once idle for 30 s")
        assert alice.wanted() == pb.Wanted(by="tenant bob (priority 0, exclusive)", preempt=False, priority=0)
        bob.call.cancel()  # he gave up
        assert alice.wanted() == pb.Wanted()
        alice.call.cancel()

    with _resource_manager() as (_server, stub):
        alice = _Stream(stub, tenant="alice", exclusive=True, islands=[0])
        alice.granted()
        bob = _Stream(stub, tenant="bob", exclusive=True, islands=[0])
        assert "asking" not in bob.next().waiting.reason
        # The first thing alice hears is of carol (a higher priority): nothing was sent for bob.
        carol = _Stream(stub, tenant="carol", exclusive=True, islands=[0], priority=1)
        carol.next()
        assert alice.wanted().by == "tenant carol (priority 1, exclusive)"
        for stream in (alice, bob, carol):
            stream.call.cancel()


def test_a_priority_above_the_tenants_ceiling_is_refused_with_what_to_do():
    with _resource_manager(priority_ceilings={"alice": 10, "*": 0}) as (_server, stub):
        for tenant, priority, ceiling in [("alice", 11, 10), ("bob", 1, 0), ("", 1, 0)]:
            with pytest.raises(grpc.RpcError) as error:
                next(stub.Allocate(pb.AllocateRequest(tenant=tenant, priority=priority), timeout=10))
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            name = tenant or "anonymous"
            assert error.value.details() == (
                f"tenant {name} asked for priority {priority}, above its ceiling {ceiling}: ask for priority <= "
                f"{ceiling}, or an operator raises --priority_ceiling {name}={priority}"
            )
        for tenant, priority in [("alice", 10), ("bob", -3)]:  # at the ceiling, or below the default
            call = stub.Allocate(pb.AllocateRequest(tenant=tenant, priority=priority), timeout=10)
            assert next(call).HasField("granted")
            call.cancel()


def test_an_inconsistent_idle_policy_is_refused():
    with pytest.raises(ValueError, match="--suspend_idle_always needs --suspend_idle_after SECONDS"):
        ResourceManagerService(None, suspend_idle_always=True)
    with pytest.raises(ValueError, match="--suspend_idle_after -1: give seconds >= 0"):
        ResourceManagerService(None, suspend_idle_after_s=-1)


# -- the flags -------------------------------------------------------------------------------

POLICY_FLAGS = [
    "--suspend_idle_after",
    "90",
    "--suspend-idle-always",
    "--priority_ceiling",
    "alice=10",
    "--priority-ceiling",
    "*=-1",
    "--priority_ceiling",
    "alice=20",  # given again: the last one counts
]
POLICY = {"suspend_idle_after_s": 90.0, "suspend_idle_always": True, "priority_ceilings": {"alice": 20, "*": -1}}


class _Started(Exception):
    """Stops a command where it would start a server."""


def test_the_resource_manager_takes_the_policy(monkeypatch):
    def server(topology, **arguments):
        raise _Started(arguments)

    monkeypatch.setattr(rm_server, "ResourceManagerServer", server)
    with pytest.raises(_Started) as started:
        cli.main(["resource-manager", *POLICY_FLAGS])
    assert {key: started.value.args[0][key] for key in POLICY} == POLICY


def test_up_hands_the_policy_to_its_resource_manager(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def child(cluster, name, arguments, node=None):
        raise _Started(arguments)

    monkeypatch.setattr(LocalCluster, "_child", child)
    with pytest.raises(_Started) as started:
        cli.main(["up", "--no_slurm", *POLICY_FLAGS])
    read = cli.build_parser().parse_args(started.value.args[0])
    assert read.command == "resource-manager"
    assert (read.suspend_idle_after, read.suspend_idle_always, read.priority_ceiling) == tuple(POLICY.values())


def test_deploy_k8s_gives_the_policy_to_the_resource_manager_container(tmp_path):
    shape = ["--islands", "1", "--hosts_per_island", "1", "--devices_per_host", "4"]
    assert cli.main(["deploy", "k8s", *shape, *POLICY_FLAGS, "--output", str(tmp_path)]) == 0
    text = (tmp_path / kubernetes.MANIFEST_FILE).read_text()
    assert "--suspend_idle_after=90 --suspend_idle_always --priority_ceiling=alice=20 '--priority_ceiling=*=-1'" in text
    jobset = next(o for o in yaml.safe_load_all(text) if o["kind"] == "JobSet")
    rm = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "rm")
    args = rm["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    read = cli.build_parser().parse_args(args)
    assert (read.suspend_idle_after, read.suspend_idle_always, read.priority_ceiling) == tuple(POLICY.values())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--priority_ceiling", "alice"], "'alice' is not TENANT=N: give a tenant and a whole number"),
        (["--priority_ceiling", "=3"], "'=3' is not TENANT=N"),
        (["--priority_ceiling", "alice=high"], "'alice=high' is not TENANT=N"),
        (["--suspend_idle_after", "soon"], "invalid float value: 'soon'"),
        (["--suspend_idle_always"], "--suspend_idle_always needs --suspend_idle_after SECONDS"),
    ],
)
def test_bad_policy_flags_say_what_to_do(flags, message, tmp_path, capsys):
    shape = ["--islands", "1", "--hosts_per_island", "1", "--devices_per_host", "4"]
    for command in (["resource-manager"], ["deploy", "k8s", *shape, "--output", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*command, *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("budget", ["-1", "lots", "1.5"])
def test_a_suspend_memory_budget_that_is_no_byte_count_is_refused(budget, capsys):
    for command in (["worker", "--resource_manager_address", "127.0.0.1:1"], ["up", "--no_slurm"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*command, "--suspend_memory_budget", budget])
        assert exit_info.value.code == 2
        assert f"{budget!r} is not a number of bytes (an integer, 0 or more)" in capsys.readouterr().err
