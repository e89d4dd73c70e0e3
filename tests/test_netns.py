"""A 2-host island whose hosts are really separate: each worker runs in its own network namespace.

Two namespaces (``ip netns``) hang off one bridge in the root namespace, on a
private subnet: the resource manager and the proxy listen on the bridge's
address, each worker on its own namespace's address (``--host``, the same
``--advertise_address``), host 0 serves the island's distributed runtime there
too. 127.0.0.1 in a namespace is that namespace's own, so a component that
leaned on loopback, on this machine's hostname or on a process of another host
would fail here. The hosts share only the file system (the token file). A
client in the root namespace runs SPMD programs across both hosts and compares
them with local JAX on 4 CPU devices.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and ``ip`` (iproute2); skips with
the reason otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from pathways_nb.core import security
from pathways_nb.launch.processes import ChildServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import finished_ok, python_script, wait_until

HOSTS = 2
DEVICES_PER_HOST = 2
COORDINATOR_PORT = 29476  # any port: nothing else listens in a fresh namespace
PREFIX = "pwnb-"
CLIENTS = Path(__file__).with_name("clients")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@dataclass
class Network:
    """A bridge in the root namespace (at ``root_address``) and a namespace per host (at ``address(host)``)."""

    tag: str = field(default_factory=lambda: f"{os.getpid()}")
    subnet: str = ""
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pw{self.tag}b"  # interface names have at most 15 characters

    @property
    def root_address(self) -> str:
        return f"{self.subnet}.1"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 2}"

    def create(self, hosts: int) -> None:
        self.subnet = _free_subnet()
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in range(hosts):
            namespace, outside, inside = f"{PREFIX}{self.tag}-h{host}", f"pw{self.tag}r{host}", f"pw{self.tag}n{host}"
            _ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self.links.append(outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def delete(self) -> None:
        """Removes what ``create`` made (a veth pair goes with its namespace); never raises."""
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


def _free_subnet() -> str:
    """A 10.201.N subnet no interface of the root namespace is on (runs in parallel pick different ones)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for n in [(os.getpid() + i) % 250 + 1 for i in range(250)]:
        if f" 10.201.{n}." not in used:
            return f"10.201.{n}"
    raise RuntimeError("every 10.201.N.0/24 subnet is taken")


def _remove_stale_namespaces() -> None:
    """Namespaces of earlier runs that were killed before their teardown (their pid is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        tag = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and tag.isdigit() and not psutil.pid_exists(int(tag)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"pw{tag}b"], capture_output=True, timeout=30)


def _why_not() -> str | None:
    """Why this machine cannot run the test, or None."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2 (make test does)"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); CI runs as root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return f"`ip netns add` failed (no CAP_SYS_ADMIN?): {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    _remove_stale_namespaces()
    network = Network()
    try:
        try:
            network.create(HOSTS + 2)  # the island's hosts, then two islands of one host
        except RuntimeError as error:  # e.g. no CAP_NET_ADMIN, or a kernel without veth or bridges
            pytest.skip(f"could not build the hosts' network: {error}")
        yield network
    finally:
        network.delete()


@dataclass
class Cluster:
    network: Network
    token: str
    resource_manager: ChildServer
    workers: list[ChildServer]
    proxy: ChildServer

    @property
    def children(self) -> list[ChildServer]:
        return [self.resource_manager, *self.workers, self.proxy]

    def state(self) -> pb.ClusterState:
        credentials = security.ClusterCredentials(token=self.token)
        with credentials.channel(self.resource_manager.hostport) as channel:
            return cluster_pb2_grpc.ResourceManagerStub(channel).GetClusterState(pb.ClusterStateRequest(), timeout=10)


def _environment(home: str | None = None) -> dict[str, str]:
    """This process's environment without JAX settings or the token (the children read --token_file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != security.TOKEN_ENV}
    if home is not None:
        env["HOME"] = env["TMPDIR"] = home
    return env


@contextlib.contextmanager
def _cluster(network: Network, islands: int, hosts_per_island: int, first_namespace: int = 0) -> Iterator[Cluster]:
    """A cluster whose resource manager and proxy are on the bridge, and whose every host is a namespace of its
    own (``first_namespace`` on): host h of island i in namespace ``first_namespace + i * hosts_per_island + h``."""
    directory = tempfile.TemporaryDirectory(prefix="pathways-netns-")
    token = security.generate_token()
    token_file = os.path.join(directory.name, "token")
    security.write_token_file(token_file, token)
    root = network.root_address
    children: list[ChildServer] = []
    try:
        rm = ChildServer(
            "resource-manager",
            f"resource-manager --server_port 0 --host {root} --instance_count {islands} "
            f"--instance_type cpu:{hosts_per_island}x{DEVICES_PER_HOST} --token_file {token_file}".split(),
            env=_environment(),
            host=root,
        )
        children.append(rm)
        rm.start(60)
        workers = []
        for island in range(islands):
            first = first_namespace + island * hosts_per_island  # the island's host 0 serves its coordination
            for host in range(hosts_per_island):
                namespace = first + host
                home = os.path.join(directory.name, f"host{namespace}")
                os.mkdir(home)
                address = network.address(namespace)
                worker = ChildServer(
                    f"worker-{island}-{host}",
                    f"worker --resource_manager_address {rm.hostport} --server_port 0 --host {address} "
                    f"--advertise_address {address} --island {island} --host_index {host} "
                    f"--hosts_per_island {hosts_per_island} "
                    f"--coordinator_address {network.address(first)}:{COORDINATOR_PORT} --devices {DEVICES_PER_HOST} "
                    f"--platform cpu --token_file {token_file}".split(),
                    env=_environment(home),
                    host=address,
                    prefix=["ip", "netns", "exec", network.namespaces[namespace]],
                    cwd=home,
                )
                children.append(worker)
                workers.append(worker)
                worker.launch()
        for worker in workers:
            worker.wait_started(120)
        proxy = ChildServer(
            "proxy",
            f"proxy --server_port 0 --host {root} --resource_manager_address {rm.hostport} "
            f"--token_file {token_file}".split(),
            env=_environment(),
            host=root,
        )
        children.append(proxy)
        proxy.start(60)
        yield Cluster(network, token, rm, workers, proxy)
    finally:
        pids = [child.process.pid for child in children if child.process is not None]
        # Stopped all at once: a host leaving the island's distributed runtime waits at exit for the others
        # (stopped one by one, each but the last would wait out close()'s 10 s before its SIGKILL).
        for child in children:
            if child.alive():
                child.process.terminate()
        for child in reversed(children):
            child.close()
        directory.cleanup()
        assert not [pid for pid in pids if psutil.pid_exists(pid)], "a cluster process outlived its teardown"


@pytest.fixture(scope="module")
def cluster(network: Network) -> Iterator[Cluster]:
    """One island of two hosts, in namespaces 0 and 1."""
    with _cluster(network, islands=1, hosts_per_island=HOSTS) as cluster:
        yield cluster


def test_spmd_programs_across_namespaced_hosts_equal_local_jax(cluster: Cluster):
    client = python_script(CLIENTS / "netns_spmd_equals_local.py", cluster.proxy.address, cluster.token)
    try:
        out, err = client.communicate(timeout=240)
    finally:
        client.kill()
    assert client.returncode == 0, f"client failed:\n{out[-2000:]}\n{err[-4000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    assert report.pop("hosts") == [0, 1]
    assert report == dict.fromkeys(report, True) and len(report) == 5, report
    # The collectives went host to host (gloo's pairs), beside host 1's link to host 0's coordinator.
    host0 = cluster.network.address(0)
    direct = [c for c in _connections(cluster.workers[1]) if c.remote == host0 and c.remote_port != COORDINATOR_PORT]
    assert direct, "host 1 has no connection to host 0 but the coordinator's"


@dataclass(frozen=True)
class Connection:
    local: str
    local_port: int
    remote: str
    remote_port: int
    status: str


def _connections(child: ChildServer, pid: int | None = None) -> list[Connection]:
    """A child's TCP sockets (or those of process ``pid`` in the child's namespace), seen from inside its
    namespace (psutil reads the caller's namespace's /proc/net)."""
    seen = subprocess.run(
        [*child.prefix, sys.executable, str(CLIENTS / "inet_connections.py"), str(pid or child.process.pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen.returncode == 0, seen.stderr
    return [
        Connection(_ipv4(local), local_port, _ipv4(remote), remote_port, status)
        for local, local_port, remote, remote_port, status in json.loads(seen.stdout)
    ]


def _ipv4(text: str) -> str:
    """An IPv4-mapped IPv6 address (gRPC listens on AF_INET6 sockets) as IPv4 text; others as they are."""
    if not text:
        return text
    ip = ipaddress.ip_address(text)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def test_no_component_listens_or_talks_on_loopback(cluster: Cluster):
    """Run after the SPMD test (as in this file's order), this covers the hosts' collectives and peer calls too."""
    network = cluster.network
    state = cluster.state()
    workers = [f"{network.address(h)}:{cluster.workers[h].port}" for h in range(HOSTS)]
    assert sorted(w.address for w in state.workers) == workers
    assert all(w.healthy for w in state.workers) and len(state.devices) == HOSTS * DEVICES_PER_HOST
    for child in cluster.children:
        connections = _connections(child)
        assert {c.local for c in connections if c.status == psutil.CONN_LISTEN} == {child.host}, (child, connections)
        looped = [
            c for c in connections if security.is_loopback(c.local) or (c.remote and security.is_loopback(c.remote))
        ]
        assert not looped, (child, looped)
    # Host 1 reaches host 0's distributed runtime at host 0's own address, from its own.
    to_coordinator = [c for c in _connections(cluster.workers[1]) if c.remote_port == COORDINATOR_PORT]
    assert to_coordinator and {(c.local, c.remote) for c in to_coordinator} == {
        (network.address(1), network.address(0))
    }


def _worker_state(cluster: Cluster, worker_id: str) -> pb.WorkerState | None:
    return next((w for w in cluster.state().workers if w.worker_id == worker_id), None)


def _wait_for_worker(cluster: Cluster, worker_id: str, what: str, condition, timeout_s: float) -> pb.WorkerState:
    """The state of ``worker_id`` once ``condition`` holds of it (``what``, in words)."""
    return wait_until(
        lambda: _worker_state(cluster, worker_id),
        timeout_s,
        f"{worker_id} {what}",
        holds=lambda state: state is not None and condition(state),
    )


def test_a_program_over_two_islands_in_namespaces_crosses_between_them(network: Network):
    """Two islands of one host each, in namespaces 2 and 3: programs over a hybrid mesh of both (their group's
    members, started by each island's worker in its namespace, reach each other only at the namespaces'
    addresses) equal local JAX, and island 1's member talks to island 0's at island 0's own address. Run
    before the cut: it needs every namespace's link up."""
    with _cluster(network, islands=2, hosts_per_island=1, first_namespace=HOSTS) as pair:
        client = python_script(CLIENTS / "multislice_equals_local.py", pair.proxy.address, pair.token)
        checks = json.loads(finished_ok(client, 300).splitlines()[-1])
        assert all(checks.values()) and len(checks) == 9, checks
        (group,) = pair.state().groups
        island_0, island_1 = network.address(HOSTS), network.address(HOSTS + 1)
        hosts = sorted(member.address.rsplit(":", 1)[0] for member in group.members)
        assert group.healthy and hosts == sorted([island_0, island_1]), group
        member_1 = next(member for member in group.members if member.address.startswith(island_1 + ":"))
        seen = _connections(pair.workers[1], member_1.pid)
        across = [c for c in seen if c.remote == island_0]
        assert across and all(c.local == island_1 for c in across), seen


def test_a_host_whose_network_is_cut_is_found_unhealthy_and_is_back_when_it_returns(cluster: Cluster):
    """Host 1's link is cut (its veth on the bridge's side down): no connection is closed, packets just
    stop, as when a machine vanishes. Only the resource manager's keepalive ping can tell. Run last: the
    island's distributed runtime rides out a cut this short (its own time-out is 10 s)."""
    worker_id = "island0-host1"
    before = _wait_for_worker(cluster, worker_id, "healthy and attached", lambda w: w.healthy and w.attached, 30)
    link = f"pw{cluster.network.tag}r1"
    _ip("link", "set", link, "down")
    try:
        # The bound is the worker time-out (3 s); the deadline leaves room for a loaded machine.
        found = _wait_for_worker(cluster, worker_id, "unhealthy", lambda w: not w.healthy, 15)
        assert "stream to the resource manager ended" in found.down_reason, found
        assert _worker_state(cluster, "island0-host0").healthy
    finally:
        _ip("link", "set", link, "up")
    # The worker notices its stream is gone (its own pings to the resource manager) and registers again.
    back = _wait_for_worker(cluster, worker_id, "healthy and attached", lambda w: w.healthy and w.attached, 60)
    assert (back.pid, back.incarnation) == (before.pid, before.incarnation)
