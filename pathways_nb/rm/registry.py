"""The workers of a cluster: who they are, which devices they own, whether they are alive.

A worker registers and then attaches: it keeps a stream open to the resource
manager, and is healthy while that stream is open (gRPC's keepalive, not a
message, keeps vouching for it); a stream that ends marks it unhealthy, a new
one healthy again. A worker that does not attach (an earlier version)
heartbeats instead, and one silent for ``worker_timeout_s`` is unhealthy. A
worker whose launcher reports that its process ended is unhealthy at once,
with the cause. The incarnation is the worker process's own: a worker that
registers again after a restart of the resource manager keeps it (its arrays
are still there), a new process brings a new one.

Built for clusters of thousands of devices: the device index (by id, by
island) changes only when a worker registers; attaching, a load report or a
heartbeat costs O(1); only workers that are not attached are swept for
silence; and every change is noted (``take_changes``) so that the resource
manager can tell watchers what changed instead of everything.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb


@dataclass
class WorkerEntry:
    worker_id: str
    request: pb.RegisterWorkerRequest
    incarnation: int
    device_ids: list[int]
    last_heartbeat: float = field(default_factory=time.monotonic)
    healthy: bool = True
    down_reason: str = ""
    # The worker's devices as the cluster reports them, built once at registration.
    devices: list[pb.Device] = field(default_factory=list)
    # Whether its devices changed (it registered, its health flipped) since watchers were last told.
    devices_changed: bool = True
    # Its Attach stream (on which it registered) is open.
    attached: bool = False
    load: pb.WorkerLoad = field(default_factory=pb.WorkerLoad)

    @property
    def island(self) -> int:
        return self.request.island

    @property
    def host_index(self) -> int:
        return self.request.host_index

    @property
    def group(self) -> str:
        """The group of islands this worker is a member of ("" for an island's own worker: ``rm.groups``)."""
        return self.request.group.group if self.request.HasField("group") else ""

    def set_health(self, healthy: bool, reason: str) -> None:
        self.healthy = healthy
        self.down_reason = reason
        self.devices_changed = True
        for device in self.devices:
            device.healthy = healthy

    def state(self, now: float) -> pb.WorkerState:
        return pb.WorkerState(
            worker_id=self.worker_id,
            address=self.request.address,
            island=self.island,
            host_index=self.host_index,
            healthy=self.healthy,
            heartbeat_age_s=0.0 if self.attached else now - self.last_heartbeat,
            hostname=self.request.hostname,
            incarnation=self.incarnation,
            device_ids=self.device_ids,
            pid=self.request.pid,
            down_reason=self.down_reason,
            host_key=self.request.host_key,
            attached=self.attached,
            load=self.load,
        )


class Registry:
    """Workers and their devices; not thread-safe (the resource manager uses it from one loop)."""

    def __init__(self, topology: Topology | None, worker_timeout_s: float):
        self.topology = topology
        self.worker_timeout_s = worker_timeout_s
        self.workers: dict[str, WorkerEntry] = {}
        self._incarnations = 0
        # Free-form clusters (no topology): ids are handed out once per (island, host, local device).
        self._assigned_ids: dict[tuple[int, int, int], int] = {}
        self._by_address: dict[str, str] = {}
        self._devices: dict[int, pb.Device] = {}
        self._ids: list[int] = []  # every device id, sorted
        self._island_ids: dict[int, list[int]] = {}  # island -> its device ids, sorted
        self._changed: set[str] = set()  # worker ids changed since the last take_changes
        self._unattached: set[str] = set()  # worker ids whose liveness is their heartbeats

    def register(self, request: pb.RegisterWorkerRequest) -> WorkerEntry:
        """Adds (or replaces) a worker; ``ValueError`` says why one does not fit the cluster."""
        if not request.address or ":" not in request.address:
            raise ValueError(f"worker address {request.address!r} is not host:port")
        if not request.devices:
            raise ValueError("a worker must own at least one device")
        if self.topology is not None:
            self.topology.check_worker(request.island, request.host_index, request.platform, len(request.devices))
        elif request.island < 0 or request.host_index < 0:
            raise ValueError("island and host index must be >= 0")
        if request.colocated_devices and len(request.colocated_devices) != len(request.devices):
            raise ValueError(
                f"a worker names one colocated CPU device per device: it has {len(request.devices)} devices "
                f"and {len(request.colocated_devices)} colocated ones"
            )
        membership = request.group if request.HasField("group") else None
        if membership is not None and request.colocated_devices:
            raise ValueError("a group member serves no colocated Python")
        worker_id = (
            f"group{membership.group}-member{membership.member}"
            if membership is not None
            else f"island{request.island}-host{request.host_index}"
        )
        other = self._by_address.get(request.address)
        if other is not None and other != worker_id and other in self.workers:
            raise ValueError(f"{request.address} is already registered as {other}")
        self._incarnations += 1
        entry = WorkerEntry(
            worker_id,
            request,
            request.incarnation or self._incarnations,
            [self._device_id(request.island, request.host_index, index) for index in range(len(request.devices))],
        )
        entry.devices = [
            pb.Device(
                id=device_id,
                island=request.island,
                host_index=request.host_index,
                local_id=local.local_id,
                worker_id=worker_id,
                worker_address=request.address,
                incarnation=entry.incarnation,
                platform=request.platform,
                kind=local.kind,
                memory_kinds=local.memory_kinds,
                local_hardware_id=local.local_hardware_id,
                healthy=True,
                host_key=request.host_key,
                group=membership.group if membership is not None else "",
                place=_place(request),
            )
            for device_id, local in zip(entry.device_ids, request.devices, strict=True)
        ]
        if request.colocated_devices:  # the cluster runs colocated Python
            for index, (device, cpu) in enumerate(zip(entry.devices, request.colocated_devices, strict=True)):
                device.colocated.CopyFrom(
                    pb.ColocatedDevice(
                        id=self._colocated_id(request.island, request.host_index, index),
                        local_id=cpu.local_id,
                        memory_kinds=cpu.memory_kinds,
                        local_hardware_id=cpu.local_hardware_id,
                    )
                )
        previous = self.workers.get(worker_id)
        if previous is not None:
            self._unindex(previous)
        self.workers[worker_id] = entry
        self._index(entry)
        self._changed.add(worker_id)
        self._unattached.add(worker_id)  # until it attaches, silence for worker_timeout_s is death
        return entry

    def _index(self, entry: WorkerEntry) -> None:
        self._by_address[entry.request.address] = entry.worker_id
        if entry.group:
            return  # a member's devices are twins of its island's: never allocated, not in the index
        island_ids = self._island_ids.setdefault(entry.island, [])
        for device in entry.devices:
            if device.id not in self._devices:
                bisect.insort(self._ids, device.id)
                bisect.insort(island_ids, device.id)
            self._devices[device.id] = device

    def _unindex(self, entry: WorkerEntry) -> None:
        if self._by_address.get(entry.request.address) == entry.worker_id:
            del self._by_address[entry.request.address]
        if entry.group:
            return
        island_ids = self._island_ids[entry.island]
        for device_id in entry.device_ids:
            del self._devices[device_id]
            del self._ids[bisect.bisect_left(self._ids, device_id)]
            del island_ids[bisect.bisect_left(island_ids, device_id)]
        if not island_ids:
            del self._island_ids[entry.island]

    def _device_id(self, island: int, host_index: int, index: int) -> int:
        """The cluster id of the ``index``-th device of a host (its jaxlib id is the host's business)."""
        if self.topology is not None:
            return self.topology.device_id(island, host_index, index)
        key = (island, host_index, index)
        if key not in self._assigned_ids:
            self._assigned_ids[key] = len(self._assigned_ids)
        return self._assigned_ids[key]

    def _colocated_id(self, island: int, host_index: int, index: int) -> int:
        """The id of the CPU device beside a host's ``index``-th device (with a topology: after every device's)."""
        if self.topology is not None:
            return self.topology.devices + self.topology.device_id(island, host_index, index)
        key = (island, host_index, -1 - index)
        if key not in self._assigned_ids:
            self._assigned_ids[key] = len(self._assigned_ids)
        return self._assigned_ids[key]

    def heartbeat(self, worker_id: str, incarnation: int) -> tuple[bool, bool]:
        """Records a heartbeat: (known, revived). Not known: the worker must register (again)."""
        entry = self.workers.get(worker_id)
        if entry is None or entry.incarnation != incarnation:
            return False, False
        entry.last_heartbeat = time.monotonic()
        if entry.healthy:
            return True, False
        # A heartbeat from a worker declared dead: it was only slow, or the network came back.
        entry.set_health(True, "")
        self._changed.add(worker_id)
        return True, True

    def attach(self, entry: WorkerEntry) -> None:
        """The worker's Attach stream (on which it just registered) is open: it is alive while it lasts."""
        entry.attached = True
        self._unattached.discard(entry.worker_id)

    def detach(self, entry: WorkerEntry) -> bool:
        """Its stream ended; False if the worker registered again since (a new stream, or a new process)."""
        if self.workers.get(entry.worker_id) is not entry or not entry.attached:
            return False
        entry.attached = False
        self._changed.add(entry.worker_id)
        return True

    def detached_for_good(self, entry: WorkerEntry) -> bool:
        """After ``detach`` and a moment's wait: marks the worker unhealthy unless it registered again
        or its launcher already said why it ended; True if it did now."""
        if self.workers.get(entry.worker_id) is not entry or entry.attached or not entry.healthy:
            return False
        entry.set_health(False, "its stream to the resource manager ended (its process, host or network is gone)")
        self._changed.add(entry.worker_id)
        return True

    def mark_changed(self, entry: WorkerEntry) -> None:
        """Watchers are sent the worker's state again (its drain, which the registry does not keep, changed)."""
        self._changed.add(entry.worker_id)

    def report_load(self, entry: WorkerEntry, load: pb.WorkerLoad) -> None:
        entry.load = load
        self._changed.add(entry.worker_id)

    def exited(self, island: int, host_index: int, pid: int, reason: str) -> WorkerEntry | None:
        """Marks the island's worker whose process ``pid`` ended down; None if that is not the registered process."""
        return self.set_down(f"island{island}-host{host_index}", pid, reason)

    def set_down(self, worker_id: str, pid: int, reason: str) -> WorkerEntry | None:
        """Marks a worker down; None if it is unknown, or ``pid`` (if given) is not its process."""
        entry = self.workers.get(worker_id)
        if entry is None or (pid and entry.request.pid != pid):
            return None
        entry.set_health(False, reason)
        self._changed.add(entry.worker_id)
        return entry

    def sweep(self) -> list[WorkerEntry]:
        """Marks workers that are not attached and silent for too long unhealthy; returns those that just changed."""
        deadline = time.monotonic() - self.worker_timeout_s
        silent = (self.workers[w] for w in self._unattached)
        changed = [e for e in silent if e.healthy and e.last_heartbeat < deadline]
        for entry in changed:
            entry.set_health(False, f"it missed its heartbeats for {self.worker_timeout_s:g} s")
            self._changed.add(entry.worker_id)
        return changed

    def take_changes(self) -> list[WorkerEntry]:
        """The islands' workers registered or whose health changed since the last call (group members are
        reported with their groups), and forgets them."""
        changed = [self.workers[w] for w in sorted(self._changed) if w in self.workers and not self.workers[w].group]
        self._changed.clear()
        return changed

    # -- the device index ------------------------------------------------------------------

    def device(self, device_id: int) -> pb.Device | None:
        return self._devices.get(device_id)

    def device_ids(self, islands: tuple[int, ...] = ()) -> list[int]:
        """The ids of the devices of ``islands`` (empty: all), sorted; the caller must not change the list."""
        if not islands:
            return self._ids
        if len(islands) == 1:
            return self._island_ids.get(islands[0], [])
        return sorted(i for island in set(islands) for i in self._island_ids.get(island, ()))

    def devices(self) -> list[pb.Device]:
        """Every known device, in id order."""
        return [self._devices[i] for i in self._ids]

    @property
    def platform(self) -> str:
        """The platform of the lowest device id ("" before any worker registered)."""
        return self._devices[self._ids[0]].platform if self._ids else ""

    def islands(self) -> list[int]:
        return sorted(self._island_ids)

    def island_workers(self, island: int) -> list[WorkerEntry]:
        """The workers of ``island`` (not group members), in host order."""
        found = [e for e in self.workers.values() if e.island == island and not e.group]
        return sorted(found, key=lambda e: e.host_index)

    def worker_states(self, entries: list[WorkerEntry] | None = None) -> list[pb.WorkerState]:
        """The state of ``entries`` (None: every island's worker; group members are their groups'), in island and
        host order."""
        now = time.monotonic()
        chosen = [e for e in self.workers.values() if not e.group] if entries is None else entries
        return [entry.state(now) for entry in sorted(chosen, key=lambda e: (e.island, e.host_index))]


def _place(request: pb.RegisterWorkerRequest) -> str:
    """Where a worker is, in words, for messages ("" for an island's worker: "island I host H" says it)."""
    if not request.HasField("group"):
        return ""
    membership = request.group
    return (
        f"the group of islands {membership.group} (its member on island {membership.island} "
        f"host {membership.host_index}, {request.address})"
    )
