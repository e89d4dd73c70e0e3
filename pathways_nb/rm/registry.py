"""The workers of a cluster: who they are, which devices they own, whether they are alive.

A worker registers and then heartbeats; one that misses heartbeats for
``worker_timeout_s``, or whose launcher reports that its process ended, is
marked unhealthy (with the reason), and healthy again when it registers anew.
The incarnation is the worker process's own: a worker that registers again
after a restart of the resource manager keeps it (its arrays are still
there), a new process brings a new one.
"""

from __future__ import annotations

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

    @property
    def island(self) -> int:
        return self.request.island

    @property
    def host_index(self) -> int:
        return self.request.host_index


class Registry:
    """Workers and their devices; not thread-safe (the resource manager uses it from one loop)."""

    def __init__(self, topology: Topology | None, worker_timeout_s: float):
        self.topology = topology
        self.worker_timeout_s = worker_timeout_s
        self.workers: dict[str, WorkerEntry] = {}
        self._incarnations = 0
        # Free-form clusters (no topology): ids are handed out once per (island, host, local device).
        self._assigned_ids: dict[tuple[int, int, int], int] = {}

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
        worker_id = f"island{request.island}-host{request.host_index}"
        for other in self.workers.values():
            if other.request.address == request.address and other.worker_id != worker_id:
                raise ValueError(f"{request.address} is already registered as {other.worker_id}")
        self._incarnations += 1
        entry = WorkerEntry(
            worker_id,
            request,
            request.incarnation or self._incarnations,
            [self._device_id(request.island, request.host_index, index) for index in range(len(request.devices))],
        )
        self.workers[worker_id] = entry
        return entry

    def _device_id(self, island: int, host_index: int, index: int) -> int:
        """The cluster id of the ``index``-th device of a host (its jaxlib id is the host's business)."""
        if self.topology is not None:
            return self.topology.device_id(island, host_index, index)
        key = (island, host_index, index)
        if key not in self._assigned_ids:
            self._assigned_ids[key] = len(self._assigned_ids)
        return self._assigned_ids[key]

    def heartbeat(self, worker_id: str, incarnation: int) -> bool:
        """Records a heartbeat; False if the worker must register (again)."""
        entry = self.workers.get(worker_id)
        if entry is None or entry.incarnation != incarnation:
            return False
        entry.last_heartbeat = time.monotonic()
        if not entry.healthy:
            # A heartbeat from a worker declared dead: it was only slow, or the network came back.
            entry.healthy = True
            entry.down_reason = ""
        return True

    def exited(self, island: int, host_index: int, pid: int, reason: str) -> WorkerEntry | None:
        """Marks the worker whose process ``pid`` ended down; None if that process is not the registered one."""
        entry = self.workers.get(f"island{island}-host{host_index}")
        if entry is None or (pid and entry.request.pid != pid):
            return None
        entry.healthy = False
        entry.down_reason = reason
        return entry

    def sweep(self) -> list[WorkerEntry]:
        """Marks workers silent for too long unhealthy; returns those that just changed."""
        now = time.monotonic()
        changed = []
        for entry in self.workers.values():
            if entry.healthy and now - entry.last_heartbeat > self.worker_timeout_s:
                entry.healthy = False
                entry.down_reason = f"it missed its heartbeats for {self.worker_timeout_s:g} s"
                changed.append(entry)
        return changed

    def devices(self) -> list[pb.Device]:
        """Every known device, in id order."""
        devices = []
        for entry in self.workers.values():
            for device_id, local in zip(entry.device_ids, entry.request.devices, strict=True):
                devices.append(
                    pb.Device(
                        id=device_id,
                        island=entry.island,
                        host_index=entry.host_index,
                        local_id=local.local_id,
                        worker_id=entry.worker_id,
                        worker_address=entry.request.address,
                        incarnation=entry.incarnation,
                        platform=entry.request.platform,
                        kind=local.kind,
                        memory_kinds=local.memory_kinds,
                        local_hardware_id=local.local_hardware_id,
                        healthy=entry.healthy,
                    )
                )
        return sorted(devices, key=lambda d: d.id)

    def islands(self) -> list[int]:
        return sorted({entry.island for entry in self.workers.values()})

    def worker_states(self) -> list[pb.WorkerState]:
        now = time.monotonic()
        return [
            pb.WorkerState(
                worker_id=entry.worker_id,
                address=entry.request.address,
                island=entry.island,
                host_index=entry.host_index,
                healthy=entry.healthy,
                heartbeat_age_s=now - entry.last_heartbeat,
                hostname=entry.request.hostname,
                incarnation=entry.incarnation,
                device_ids=entry.device_ids,
                pid=entry.request.pid,
                down_reason=entry.down_reason,
            )
            for entry in sorted(self.workers.values(), key=lambda e: (e.island, e.host_index))
        ]
