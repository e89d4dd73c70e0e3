"""A whole Pathways cluster on this machine: resource manager, workers and proxy, as child processes.

``LocalCluster(islands=2, devices_per_host=4)`` starts them on 127.0.0.1 and
gives the address to connect to; leaving the ``with`` block, ``close()``,
interpreter exit or the death of this process stops them all (each child
watches its parent), so no process is left behind. While it runs, a process
that dies is noticed at once, reported with its cause and started again
(``pathways_nb.launch.supervisor``): a crashed worker costs its island a few seconds,
and the island serves again by itself.

Each process logs to a file of its own in the cluster's directory (``log_paths``; ``pathways-nb logs``
reads them from another terminal): kept after ``close()`` when the run failed, removed otherwise.

The same launcher lays a cluster out over the nodes of a Slurm allocation
(``nodes=``, see ``pathways_nb.launch.slurm``): the resource manager and the proxy
on the first node, one worker per node, each a job step that ``srun`` starts
from here, supervised from here in the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from pathways_nb.core import tuning
from pathways_nb.core.keepalive import Liveness
from pathways_nb.core.security import ClusterCredentials, TlsFiles, generate_token
from pathways_nb.core.wait import wait_until
from pathways_nb.launch import cluster_logs, live
from pathways_nb.launch.processes import THIS_MACHINE, ChildServer, Node, Status
from pathways_nb.launch.supervisor import ChildExit, Supervisor
from pathways_nb.rm.policy import SessionPolicy
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

# Called with each cluster as it starts serving (``status`` running) and again as it begins to stop (closing),
# on the thread that starts or closes it: the test suite's stall guard (``testing.stall_guard``) reads its loops.
watchers: list[Callable[[LocalCluster], None]] = []


@dataclass(frozen=True)
class ClusterSpec:
    islands: int = 2
    hosts_per_island: int = 1
    devices_per_host: int = 4
    platform: str = "cpu"

    def check(self) -> None:
        if min(self.islands, self.hosts_per_island, self.devices_per_host) < 1:
            raise ValueError(f"islands, hosts_per_island and devices_per_host must be >= 1, got {self}")

    @property
    def devices(self) -> int:
        return self.islands * self.hosts_per_island * self.devices_per_host


class LocalCluster:
    """A cluster of child processes on 127.0.0.1.

    >>> with LocalCluster(islands=2, devices_per_host=4) as cluster:   # doctest: +SKIP
    ...     pathways_nb.connect(cluster.address)

    ``colocated_python=True`` runs tenants' ``jax.experimental.colocated_python`` beside the
    devices (off by default; docs/colocated_python.md): each host gets a ``colocated-host`` that
    starts its sessions' executors with ``colocated_python_executable`` (default: this Python).

    ``nodes`` (default: this machine for everything) places the processes on other machines: the
    resource manager and the proxy on ``nodes[0]``, the worker of island ``i`` host ``h`` on
    ``nodes[i * hosts_per_island + h]`` (``launch.slurm.Allocation.nodes``: a Slurm allocation's).

    ``storage_root``: where the workers and the proxy write profiles and checkpoints
    (``pathways_nb.core.storage``); default ``storage/`` in the cluster's own directory, which is kept after
    ``close()`` if anything was written there. ``worker_timeout_s``: within how long a worker that stopped
    answering (``SIGSTOP``) is found dead; a stall of less than five sixths of it is never a death.
    ``suspend_idle_after_s``, ``suspend_idle_always``, ``priority_ceilings``: the resource manager's policy
    on sessions (its ``--suspend_idle_after``, ``--suspend_idle_always`` and ``--priority_ceiling``;
    docs/cluster.md). ``suspend_memory_budget``: the bytes of suspended sessions' arrays each worker keeps
    in memory (the rest go to files under the storage root; None: no limit). ``log_level``: its processes'
    (their ``--log_level``; default WARNING). ``keep_logs``: whether ``close()`` leaves their logs
    (``logs/`` in the cluster's directory); default: only those of a failed run (see ``failures``).
    ``directory``: the cluster's own directory (default: a new temporary one, removed at ``close()`` unless
    its storage or its logs are kept); one given is left in place. ``on_end(why)``: called (from a
    supervising thread) if the cluster's machines are gone for good (its Slurm job ended); nothing is
    restarted then, and ``ended`` says why. ``tls``: the resource manager and the workers serve TLS, and the
    workers, the proxy and this launcher call them over it (for clusters whose traffic crosses a network;
    the proxy's own port stays plaintext).
    """

    def __init__(
        self,
        islands: int = 2,
        hosts_per_island: int = 1,
        devices_per_host: int = 4,
        port: int = 0,
        platform: str = "cpu",
        start: bool = True,
        token: str | None = None,
        colocated_python: bool = False,
        colocated_python_executable: str | None = None,
        storage_root: str | os.PathLike[str] | None = None,
        worker_timeout_s: float = tuning.ONE_MACHINE_WORKER_TIMEOUT_S.value,
        suspend_idle_after_s: float = 0.0,
        suspend_idle_always: bool = False,
        priority_ceilings: dict[str, int] | None = None,
        suspend_memory_budget: int | None = None,
        log_level: str | None = None,
        keep_logs: bool | None = None,
        nodes: Sequence[Node] | None = None,
        directory: str | os.PathLike[str] | None = None,
        on_end: Callable[[str], None] | None = None,
        tls: TlsFiles | None = None,
    ):
        self.spec = ClusterSpec(islands, hosts_per_island, devices_per_host, platform)
        self.spec.check()
        Liveness.within(worker_timeout_s)  # one the resource manager would refuse fails here, before any process
        self.worker_timeout_s = worker_timeout_s
        # (One the resource manager would refuse fails here too.)
        self.session_policy = SessionPolicy(suspend_idle_after_s, suspend_idle_always, priority_ceilings)
        self.suspend_memory_budget = suspend_memory_budget
        self.nodes = list(nodes) if nodes else [THIS_MACHINE]
        self._on_end = on_end
        self.ended: str | None = None
        self._exits_before_end: int | None = None
        if nodes and len(self.nodes) < islands * hosts_per_island:
            raise ValueError(
                f"{islands} island(s) of {hosts_per_island} host(s) need {islands * hosts_per_island} nodes "
                f"(one worker per node), and there are {len(self.nodes)}: ask for more nodes, or fewer islands"
            )
        # User Python beside the devices (jax.experimental.colocated_python): off unless asked for.
        # Each host then gets a colocated host (``pathways-nb colocated-host``) that starts its
        # executors, with ``colocated_python_executable`` (default: this Python).
        self.colocated_python = colocated_python
        self.colocated_python_executable = colocated_python_executable
        self.colocated_hosts: dict[tuple[int, int], ChildServer] = {}
        self._colocated_sockets: tempfile.TemporaryDirectory | None = None
        # The cluster's own directory (its storage root by default).
        self._own_directory = directory is None
        self.directory = os.path.abspath(directory or tempfile.mkdtemp(prefix="pathways-nb-cluster-"))
        self.storage_root = os.path.abspath(storage_root or os.path.join(self.directory, "storage"))
        self.log_directory = os.path.join(self.directory, "logs")
        os.makedirs(self.log_directory, exist_ok=True)
        self.log_level = log_level
        self.keep_logs = keep_logs
        # Why close() left the cluster's directory ("" until then, or if it removed it).
        self.kept_because = ""
        self._record: cluster_logs.ClusterRecord | None = None
        self._logged_before_stop: dict[str, int] = {}
        # The cluster token its internal endpoints require (None: a fresh random one); children get it
        # in their environment, never on their command line.
        self.token = token or generate_token()
        self.tls = tls
        self.credentials = tls.credentials(self.token) if tls else ClusterCredentials(token=self.token)
        self._child_env = {**os.environ, **self.credentials.child_env()}
        self.port = port
        self.status = Status.created
        self.startup_s: float | None = None
        self.resource_manager: ChildServer | None = None
        self.supervisor: Supervisor | None = None
        self._coordinators: dict[int, str] = {}
        self._stopped_with_island: set[int] = set()
        self.workers: dict[tuple[int, int], ChildServer] = {}
        self.proxy: ChildServer | None = None
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        """Starts the resource manager, then the workers (in parallel), then the proxy."""
        if self.status is Status.running:
            return self
        started = time.monotonic()
        self.status = Status.starting
        live.add(self)
        spec = self.spec
        try:
            self.resource_manager = self._child(
                "resource-manager",
                [
                    "resource-manager",
                    "--server_port",
                    "0",
                    "--host",
                    self.nodes[0].address,
                    "--instance_count",
                    str(spec.islands),
                    "--instance_type",
                    f"{spec.platform}:{spec.hosts_per_island}x{spec.devices_per_host}",
                    "--worker_timeout",
                    f"{self.worker_timeout_s:g}",
                    *self.session_policy.flags(),
                    *(self.tls.serving() if self.tls else []),
                ],
                self.nodes[0],
            )
            self.resource_manager.start(timeout_s)
            if self.colocated_python:
                self._start_colocated_hosts(timeout_s)
            for island in range(spec.islands):
                for host in range(spec.hosts_per_island):
                    self.workers[(island, host)] = self._worker(island, host)
            for worker in self.workers.values():
                worker.launch()
            for worker in self.workers.values():
                worker.wait_started(timeout_s)
            self.proxy = self._child(
                "proxy",
                [
                    "proxy",
                    "--server_port",
                    str(self.port),
                    "--host",
                    self.nodes[0].address,
                    "--resource_manager_address",
                    self.resource_manager.hostport,
                    "--storage_root",
                    self.storage_root,
                    *(self.tls.calling() if self.tls else []),
                ],
                self.nodes[0],
            )
            self.proxy.start(timeout_s)
            self._wait_for_workers(timeout_s)
            self._supervise()
            self._record = cluster_logs.ClusterRecord(
                self.address, self.proxy.port, os.getpid(), self.directory, self.log_paths
            )
            cluster_logs.record(self._record)
        except BaseException:
            self.status = Status.failed
            self.close()
            raise
        self.startup_s = time.monotonic() - started
        self.status = Status.running
        self._tell_watchers()
        return self

    def _tell_watchers(self) -> None:
        for watcher in watchers:
            watcher(self)

    def node(self, island: int, host: int) -> Node:
        """The machine the worker of ``island`` / ``host`` runs on."""
        if len(self.nodes) == 1:
            return self.nodes[0]
        return self.nodes[island * self.spec.hosts_per_island + host]

    def _worker(self, island: int, host: int) -> ChildServer:
        assert self.resource_manager is not None
        node = self.node(island, host)
        return self._child(
            f"worker-{island}-{host}",
            [
                "worker",
                "--resource_manager_address",
                self.resource_manager.hostport,
                "--server_port",
                "0",
                "--host",
                node.address,
                "--island",
                str(island),
                "--host_index",
                str(host),
                "--devices",
                str(self.spec.devices_per_host),
                "--platform",
                self.spec.platform,
                "--storage_root",
                self.storage_root,
                *(
                    []
                    if self.suspend_memory_budget is None
                    else ["--suspend_memory_budget", str(self.suspend_memory_budget)]
                ),
                *self._island_flags(island),
                *(["--log_directory", self.log_directory] if node.local else []),
                *self._colocated_flags(island, host),
                *([*self.tls.serving(), *self.tls.calling()] if self.tls else []),
            ],
            node,
        )

    def _child(self, name: str, arguments: list[str], node: Node = THIS_MACHINE) -> ChildServer:
        """One of the cluster's processes, on ``node``: its token in its environment, its log in ``logs/``, at the
        log level."""
        level = ["--log_level", self.log_level] if self.log_level else []
        log_path = os.path.join(self.log_directory, f"{name}.log")
        return ChildServer(name, [*arguments, *level], env=self._child_env, log_path=log_path, node=node)

    def _start_colocated_hosts(self, timeout_s: float) -> None:
        """One ``colocated-host`` per host, on a unix socket in a directory of this user only."""
        self._colocated_sockets = tempfile.TemporaryDirectory(prefix="pathways-nb-colocated-")
        executable = (
            ["--colocated_python_executable", self.colocated_python_executable]
            if self.colocated_python_executable
            else []
        )
        for island in range(self.spec.islands):
            for host in range(self.spec.hosts_per_island):
                self.colocated_hosts[(island, host)] = self._child(
                    f"colocated-host-{island}-{host}",
                    ["colocated-host", "--socket", self._colocated_socket(island, host), *executable],
                    self.node(island, host),
                )
        for colocated in self.colocated_hosts.values():
            colocated.launch()
        for colocated in self.colocated_hosts.values():
            colocated.wait_started(timeout_s)

    def _colocated_socket(self, island: int, host: int) -> str:
        """Where the colocated host of ``island`` / ``host`` listens: a directory of this user here, or one
        the host makes on its node (it must be of that machine: a unix socket is)."""
        node = self.node(island, host)
        if not node.local:
            return node.private_socket(f"colocated-{island}-{host}")
        assert self._colocated_sockets is not None
        return os.path.join(self._colocated_sockets.name, f"host-{island}-{host}.sock")

    def _colocated_flags(self, island: int, host: int) -> list[str]:
        if not self.colocated_python:
            return []
        return ["--colocated_python", "--colocated_python_host", f"unix:{self._colocated_socket(island, host)}"]

    def _island_flags(self, island: int) -> list[str]:
        """Flags that make the hosts of a multi-host island one distributed runtime, led by host 0."""
        hosts = self.spec.hosts_per_island
        if hosts == 1:
            return []
        if island not in self._coordinators:
            leader = self.node(island, 0)
            self._coordinators[island] = f"{leader.address}:{leader.free_port()}"
        return ["--hosts_per_island", str(hosts), "--coordinator_address", self._coordinators[island]]

    def _wait_for_workers(self, timeout_s: float) -> None:
        wait_until(
            self.state,
            timeout_s,
            "every worker registered",
            holds=lambda state: sum(w.healthy for w in state.workers) == len(self.workers),
            timeout_error=lambda state: TimeoutError(
                f"only {len(state.workers)} of {len(self.workers)} workers registered"
            ),
        )

    def close(self) -> None:
        """Stops the proxy, the workers and the resource manager; idempotent."""
        if self.status is Status.closed:
            return
        failed_to_start, serving = self.status is Status.failed, self.status is Status.running
        self.status = Status.closing
        if serving:
            self._tell_watchers()
        # What the processes log while they stop (streams they abort, say) is not what went wrong in the run.
        if self.ended is None:
            self._logged_before_stop = {child.name: child.log_size() for child in self.processes()}
        if self.supervisor is not None:
            self.supervisor.close()
        # All asked to stop at once: a host of an island waits at exit for the island's other hosts.
        for child in [self.proxy, *self.workers.values()]:
            if child is not None and child.alive():
                child.process.terminate()
        for child in [self.proxy, *self.workers.values(), *self.colocated_hosts.values(), self.resource_manager]:
            if child is not None:
                child.close()
        if self._colocated_sockets is not None:
            self._colocated_sockets.cleanup()
        if self._record is not None:
            cluster_logs.forget(self._record)
        self.status = Status.closed
        self._remove_directory_unless_kept(failed_to_start)
        live.discard(self)

    def _remove_directory_unless_kept(self, failed_to_start: bool) -> None:
        """Removes the cluster's directory, unless its storage root holds what the cluster wrote or its logs
        are kept (``keep_logs``; by default those of a failed run); ``kept_because`` says why it stays."""
        reasons = []
        storage = os.path.join(self.directory, "storage")
        if os.path.isdir(storage) and any(files for _dir, _subdirs, files in os.walk(storage)):
            reasons.append("storage/ holds what the cluster wrote")
        failures = (["it failed to start"] if failed_to_start else []) + self.failures()
        if self.keep_logs is None and failures:
            reasons.append(f"logs/ tells what went wrong ({'; '.join(failures)})")
        elif self.keep_logs:
            reasons.append("logs/ was asked for")
        else:
            shutil.rmtree(self.log_directory, ignore_errors=True)
        if not reasons:
            if self._own_directory:  # (a directory given is the caller's)
                shutil.rmtree(self.directory, ignore_errors=True)
            return
        self.kept_because = "; ".join(reasons)
        level = logging.WARNING if failures and self.keep_logs is None else logging.INFO
        _LOGGER.log(level, "the cluster's directory %s is kept: %s", self.directory, self.kept_because)

    def failures(self) -> list[str]:
        """What went wrong in this run, as its processes' logs and exits tell: which process ended unexpectedly,
        which logged an error before the cluster began to stop (the first of each). Processes that ended with
        their machines (its Slurm job's end) ended as they should."""
        ended = [f"{ended.name} {ended.description}" for ended in self.exits[: self._exits_before_end]]
        errors = [
            (child.name, child.first_error(self._logged_before_stop.get(child.name))) for child in self.processes()
        ]
        return list(dict.fromkeys(ended)) + [f"{name} logged {error!r}" for name, error in errors if error]

    @property
    def log_paths(self) -> dict[str, str]:
        """Each process's log file, by name ("resource-manager", "worker-0-0", "proxy", ...)."""
        return {child.name: child.log_path for child in self.processes()}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- what it is ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The proxy's ``grpc://host:port``: what ``pathways_nb.connect`` takes."""
        if self.proxy is None or self.proxy.port is None:
            raise RuntimeError("the cluster is not running; call start()")
        return self.proxy.address

    def serves(self, address: str) -> bool:
        """Whether this cluster runs and its proxy is at ``address``."""
        return self.status is Status.running and self.address == address

    @property
    def resource_manager_address(self) -> str:
        assert self.resource_manager is not None
        return self.resource_manager.hostport

    def state(self) -> pb.ClusterState:
        """The resource manager's view: workers, devices, health, allocations."""
        with self.credentials.channel(self.resource_manager_address) as channel:
            stub = cluster_pb2_grpc.ResourceManagerStub(channel)
            return stub.GetClusterState(pb.ClusterStateRequest(), timeout=10)

    def loop_stats(self) -> list[pb.LoopStats]:
        """How every process's event loop has turned (its watchdog's counts: ``core.loop``), one entry each, the
        members of groups of islands that serve included."""
        addresses = [child.hostport for child in (self.resource_manager, self.proxy, *self.workers.values()) if child]
        addresses += [f"unix:{self._colocated_socket(*place)}" for place in self.colocated_hosts]
        addresses += [m.address for g in self.state().groups for m in g.members if m.healthy]  # groups' members
        return [loop_stats(address, self.credentials) for address in addresses]

    def kill_worker(self, island: int, host: int = 0) -> None:
        """Kills a worker process (SIGKILL), as a crash would."""
        worker = self.workers[(island, host)]
        if worker.process is not None:
            worker.process.kill()
            worker.process.wait()

    def restart_worker(self, island: int, host: int = 0, timeout_s: float = 60.0) -> None:
        """Replaces a worker process (killing it if it still runs) and waits until the new one has rejoined."""
        worker = self.workers[(island, host)]
        old_pid = worker.process.pid
        if worker.alive():
            self.kill_worker(island, host)
        self.wait_for_worker(island, host, timeout_s, not_pid=old_pid)

    def wait_for_worker(self, island: int, host: int = 0, timeout_s: float = 60.0, not_pid: int = 0) -> None:
        """Waits until the worker of ``island``/``host`` is registered and healthy (and not process ``not_pid``)."""
        worker_id = f"island{island}-host{host}"
        wait_until(
            self.state,
            timeout_s,
            f"{worker_id} registered",
            holds=lambda state: any(w.worker_id == worker_id and w.healthy and w.pid != not_pid for w in state.workers),
            timeout_error=lambda _state: TimeoutError(
                f"{worker_id} did not come back within {timeout_s:g} s; its last output:\n"
                f"{self.workers[(island, host)].log_tail()}"
            ),
        )

    @property
    def exits(self) -> list[ChildExit]:
        """Every unexpected end of one of the cluster's processes so far (each was restarted)."""
        return list(self.supervisor.exits) if self.supervisor is not None else []

    def _supervise(self) -> None:
        """Restarts any process of the cluster that dies; the resource manager and the proxy keep their ports."""
        self.supervisor = Supervisor(on_exit=self._child_ended)
        self.supervisor.watch(self.resource_manager, keep_port=True)
        for worker in self.workers.values():
            self.supervisor.watch(worker)
        for colocated in self.colocated_hosts.values():
            self.supervisor.watch(colocated)
        self.supervisor.watch(self.proxy, keep_port=True)

    def _child_ended(self, child: ChildServer, ended: ChildExit) -> None:
        """A process ended: reported (a worker; first, so that its cause reaches the resource manager before
        its stream's end does) and started again, unless its machine is gone for good."""
        self._report_exit(child, ended)
        gone = child.node.gone()
        if gone is None:
            return
        _LOGGER.warning("%s ended and is not started again: %s", child.name, gone)
        self.supervisor.close()
        if self.ended is None:  # what its processes do and log from now on is the machines' end, not a failure
            self._exits_before_end = len(self.exits) - 1
            self._logged_before_stop = {child.name: child.log_size() for child in self.processes()}
        self.ended = gone
        if self._on_end is not None:
            self._on_end(gone)

    def _report_exit(self, child: ChildServer, ended: ChildExit) -> None:
        """Tells the resource manager that a worker's process ended: its island is down at once, with the cause."""
        place = next((key for key, worker in self.workers.items() if worker is child), None)
        if place is None:
            return
        # An island's distributed runtime cannot outlive one of its hosts: the others are replaced too,
        # and the island forms again (not again for the deaths this causes).
        if ended.pid not in self._stopped_with_island:
            for (island, _host), other in self.workers.items():
                if island == place[0] and other is not child and other.alive():
                    _LOGGER.warning("stopping %s: island %d forms again without the dead host", other.name, island)
                    self._stopped_with_island.add(other.process.pid)
                    other.process.kill()
        # (A server elsewhere is not the process started here, srun: pid 0 stands for whichever registered.)
        pid = ended.pid if child.node.local else 0
        report = pb.WorkerExitReport(
            island=place[0], host_index=place[1], pid=pid, reason=f"its process {ended.description}"
        )
        try:
            with self.credentials.channel(self.resource_manager_address) as channel:
                cluster_pb2_grpc.ResourceManagerStub(channel).ReportWorkerExit(report, timeout=5)
        except grpc.RpcError as error:
            _LOGGER.info("could not report the end of %s: %s", child.name, error.details())

    def processes(self) -> list[ChildServer]:
        children = [self.resource_manager, *self.colocated_hosts.values(), *self.workers.values(), self.proxy]
        return [c for c in children if c is not None]

    def __repr__(self) -> str:
        where = f" at {self.address}" if self.status is Status.running else ""
        spec = self.spec
        return (
            f"<LocalCluster {self.status.value}{where}: {spec.islands} island(s) x {spec.hosts_per_island} host(s) "
            f"x {spec.devices_per_host} {spec.platform} device(s)>"
        )


def loop_stats(address: str, credentials: ClusterCredentials) -> pb.LoopStats:
    """The loop watchdog's counts of the server at ``address`` (``host:port`` or ``unix:PATH``)."""
    with credentials.channel(address) as channel:
        return cluster_pb2_grpc.DiagnosticsStub(channel).GetLoopStats(pb.LoopStatsRequest(), timeout=10)
