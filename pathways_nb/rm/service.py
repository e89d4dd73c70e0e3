"""The resource manager's gRPC service: registration, heartbeats, allocations, cluster state.

Everything runs on one asyncio loop, so the registry and the allocator need no
locks; every change wakes the calls that wait for one (queued allocations,
cluster watchers).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pathways_nb.rm.allocator import Allocator, Unsatisfiable
from pathways_nb.rm.registry import Registry
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = "pathways_nb.v1.ResourceManager"


class ResourceManagerService(cluster_pb2_grpc.ResourceManagerServicer):
    def __init__(self, topology: Topology | None, worker_timeout_s: float = 3.0, heartbeat_interval_s: float = 0.5):
        self.topology = topology
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry = Registry(topology, worker_timeout_s)
        self.allocator = Allocator()
        self._change = asyncio.Event()
        self._sweeper: asyncio.Task | None = None

    # -- changes ---------------------------------------------------------------------------

    def _changed(self) -> None:
        """Wakes everything that waits for the cluster to change."""
        self._change.set()
        self._change = asyncio.Event()

    async def _next_change(self, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(self._change.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def start_sweeping(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            for entry in self.registry.sweep():
                _LOGGER.warning(
                    "worker %s (%s) missed heartbeats for %.1f s: island %d is unhealthy",
                    entry.worker_id,
                    entry.request.address,
                    self.registry.worker_timeout_s,
                    entry.island,
                )
                self._changed()

    def _grant(self) -> None:
        if self.allocator.grant(self.registry.devices()):
            self._changed()

    # -- workers ---------------------------------------------------------------------------

    async def RegisterWorker(self, request, context):
        try:
            entry = self.registry.register(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot register worker: {e}")
        _LOGGER.info(
            "worker %s registered at %s (incarnation %d, devices %s)",
            entry.worker_id,
            request.address,
            entry.incarnation,
            entry.device_ids,
        )
        self._grant()
        self._changed()
        return pb.RegisterWorkerResponse(
            worker_id=entry.worker_id,
            incarnation=entry.incarnation,
            device_ids=entry.device_ids,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )

    async def Heartbeat(self, request, context):
        entry = self.registry.workers.get(request.worker_id)
        was_healthy = entry is not None and entry.healthy
        known = self.registry.heartbeat(request.worker_id, request.incarnation)
        if known and not was_healthy:
            self._changed()
        return pb.HeartbeatResponse(known=known)

    async def ReportWorkerExit(self, request, context):
        entry = self.registry.exited(request.island, request.host_index, request.pid, request.reason)
        if entry is not None:
            _LOGGER.warning(
                "worker %s (%s) ended: %s; island %d is down",
                entry.worker_id,
                entry.request.address,
                request.reason,
                entry.island,
            )
            self._changed()
        return pb.WorkerExitAck(known=entry is not None)

    # -- allocations -----------------------------------------------------------------------

    async def Allocate(self, request, context):
        if request.num_devices < 0 or request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_devices and timeout_s must be >= 0")
        if request.reclaim_allocation_id:
            async for update in self._hold_reclaimed(request):
                yield update
            return
        ticket = self.allocator.submit(request.tenant, request.exclusive, request.num_devices, tuple(request.islands))
        deadline = time.monotonic() + request.timeout_s if request.timeout_s else None
        try:
            try:
                self.allocator.check(ticket, self.registry.devices())
            except Unsatisfiable as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            while True:
                self._grant()
                if ticket.granted:
                    break
                waiting = self.allocator.waiting(ticket, self.registry.devices())
                if deadline is not None and time.monotonic() >= deadline:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"gave up after {request.timeout_s:g} s {waiting.reason}; try again later, "
                        "ask for fewer devices, or share instead of asking for exclusive use",
                    )
                yield pb.AllocateUpdate(waiting=waiting)
                await self._next_change(None if deadline is None else max(0.0, deadline - time.monotonic()))
            _LOGGER.info("%s granted to %s: devices %s", ticket.allocation_id, ticket.tenant, list(ticket.devices))
            devices = {d.id: d for d in self.registry.devices()}
            yield pb.AllocateUpdate(
                granted=pb.Allocation(
                    allocation_id=ticket.allocation_id,
                    devices=[devices[i] for i in ticket.devices],
                    platform=self._platform(),
                )
            )
            # The allocation lasts as long as this call: until the holder cancels it or goes away.
            await asyncio.Event().wait()
        finally:
            self.allocator.release(ticket)
            self._grant()
            self._changed()

    async def _hold_reclaimed(self, request):
        """Grants again, at once, an allocation a proxy held before this resource manager restarted."""
        ticket = self.allocator.reclaim(
            request.reclaim_allocation_id, request.tenant, request.exclusive, tuple(request.reclaim_device_ids)
        )
        _LOGGER.info("%s of %s reclaimed: devices %s", ticket.allocation_id, ticket.tenant, list(ticket.devices))
        self._changed()
        try:
            devices = {d.id: d for d in self.registry.devices()}
            granted = pb.Allocation(allocation_id=ticket.allocation_id, platform=self._platform())
            granted.devices.extend(devices[i] for i in ticket.devices if i in devices)
            yield pb.AllocateUpdate(granted=granted)
            await asyncio.Event().wait()
        finally:
            self.allocator.release(ticket)
            self._grant()
            self._changed()

    def _platform(self) -> str:
        devices = self.registry.devices()
        return devices[0].platform if devices else (self.topology.platform if self.topology else "")

    # -- state -----------------------------------------------------------------------------

    def state(self) -> pb.ClusterState:
        topology = self.topology
        return pb.ClusterState(
            workers=self.registry.worker_states(),
            devices=self.registry.devices(),
            allocations=self.allocator.states(),
            waiting=len(self.allocator.queue),
            queue=self.allocator.queued(self.registry.devices()),
            islands=topology.islands if topology else len(self.registry.islands()),
            hosts_per_island=topology.hosts_per_island if topology else 0,
            devices_per_host=topology.devices_per_host if topology else 0,
            platform=self._platform(),
        )

    async def GetClusterState(self, request, context):
        return self.state()

    async def WatchCluster(self, request, context):
        while True:
            change = self._change
            yield self.state()
            await change.wait()
