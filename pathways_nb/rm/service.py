"""The resource manager's gRPC service: registration, liveness, allocations, cluster state.

Everything runs on one asyncio loop, so the registry and the allocator need no
locks; every change of what can be allocated wakes the queued allocations at
once. A worker's liveness costs this loop nothing while it lasts: the worker's
Attach stream stays open, gRPC's core pings its connection (``core.keepalive``),
and the loop hears only of a stream that ends and of load reports, which are
rare by design (only changes, at most one per interval per worker, the interval
growing with the cluster) and cost O(1) each; they never wake an allocation.
Cluster watchers are fed by one publisher, at most once per
``publish_interval_s``: each update is built once and shared by every watcher,
and a watcher that asked for deltas gets only the workers that changed (a
whole state if it fell behind).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pathways_nb.core import host_profiler, tuning
from pathways_nb.core.keepalive import Liveness
from pathways_nb.protocol.errors import RequestError, as_request_error, grpc_code
from pathways_nb.rm.allocator import ANONYMOUS, Allocator, Ticket, Unsatisfiable
from pathways_nb.rm.groups import Groups, GroupUnavailable, Orders, Phase
from pathways_nb.rm.policy import SessionPolicy
from pathways_nb.rm.registry import Registry, WorkerEntry
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = "pathways_nb.v1.ResourceManager"


@dataclass(frozen=True)
class _Publication:
    """One update for the watchers: ``delta`` holds what changed since publication ``version - 1``."""

    version: int
    delta: pb.ClusterState


class ResourceManagerService(cluster_pb2_grpc.ResourceManagerServicer):
    def __init__(
        self,
        topology: Topology | None,
        worker_timeout_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        publish_interval_s: float = 0.1,
        max_heartbeats_per_s: float = 256.0,
        max_load_reports_per_s: float = 64.0,
        suspend_idle_after_s: float = 0.0,
        suspend_idle_always: bool = False,
        priority_ceilings: dict[str, int] | None = None,
    ):
        """The last three are the policy on sessions (``rm.policy.SessionPolicy``); ``ValueError`` if it is
        inconsistent."""
        self.policy = SessionPolicy(suspend_idle_after_s, suspend_idle_always, priority_ceilings)
        self.topology = topology
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_heartbeats_per_s = max_heartbeats_per_s
        self.max_load_reports_per_s = max_load_reports_per_s
        self.publish_interval_s = publish_interval_s
        self.liveness = Liveness.within(worker_timeout_s)
        self.registry = Registry(topology, worker_timeout_s)
        self.allocator = Allocator(suspend_idle_after_s)
        # Set when what a granted allocation's holder is told of those who want its devices changed.
        self._news: dict[Ticket, asyncio.Event] = {}
        self.groups = Groups(self.registry)
        # The replies each attached worker is sent on its Attach stream (group orders), by worker id.
        self._outboxes: dict[str, asyncio.Queue] = {}
        self._change = asyncio.Event()
        self._dirty = asyncio.Event()  # something changed that the watchers have not been sent
        self._version = 0  # counts changes: the cached state is good while it stays the same
        self._cached: tuple[int, float, pb.ClusterState] | None = None
        self._publication = _Publication(0, pb.ClusterState(delta=True))
        self._published = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # -- changes ---------------------------------------------------------------------------

    def _changed(self) -> None:
        """Wakes the allocations that wait for the cluster to change, and tells the publisher."""
        self._version += 1
        self._change.set()
        self._change = asyncio.Event()
        self._dirty.set()

    async def _next_change(self, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(self._change.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def start(self) -> None:
        """Starts sweeping for silent workers and publishing to watchers (on the running loop)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._sweep_forever()), loop.create_task(self._publish_forever())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _publish_forever(self) -> None:
        # The first change after a quiet spell goes out at once; a burst is sent as one update per interval.
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self._publish()
            await asyncio.sleep(self.publish_interval_s)

    def _publish(self) -> None:
        changed = self.registry.take_changes()
        # A drained host's status follows grants and its load: sent with every update while it drains.
        draining = [e for e in self.registry.workers.values() if self._draining(e) and e not in changed]
        delta = self._summary()
        delta.delta = True
        delta.workers.extend(self._worker_states([*changed, *draining]))
        for entry in changed:  # not for a worker whose load alone changed
            if entry.devices_changed:
                delta.devices.extend(entry.devices)
                entry.devices_changed = False
        self._publication = _Publication(self._publication.version + 1, delta)
        self._published.set()
        self._published = asyncio.Event()

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
                self._worker_down(entry)
            expired = self.groups.expire(tuning.GROUP_FORM_TIMEOUT_S.value)
            if expired:
                self._send(expired)
                self._changed()

    def worker_heartbeat_interval_s(self) -> float:
        """The interval handed to workers that heartbeat: the configured one, longer in big clusters (at
        most a third of the timeout, so that a worker misses three before it is declared dead)."""
        spread = len(self.registry.workers) / self.max_heartbeats_per_s
        return max(self.heartbeat_interval_s, min(spread, self.registry.worker_timeout_s / 3))

    def worker_update_interval_s(self) -> float:
        """How often an attached worker may report its load: once a second, less in big clusters, so that
        all of them together send at most ``max_load_reports_per_s`` (each costs this loop ~0.2-0.4 ms;
        liveness does not depend on them)."""
        return max(tuning.LOAD_REPORT_INTERVAL_S.value, len(self.registry.workers) / self.max_load_reports_per_s)

    def _grant(self) -> None:
        """Grants what fits, then tells holders who wants their devices (both cheap: done on every change)."""
        if self.allocator.queue and self.allocator.grant(self.registry):
            self._changed()
        for holder in self.allocator.contention(self.registry):
            wanted = holder.told
            if wanted.by:
                _LOGGER.info(
                    "asking %s of tenant %s (priority %d) to suspend %s: %s waits for its devices",
                    holder.allocation_id,
                    holder.tenant,
                    holder.priority,
                    "now" if wanted.preempt else f"once idle for {self.policy.suspend_idle_after_s:g} s",
                    wanted.by,
                )
            else:
                _LOGGER.info(
                    "%s of tenant %s: nobody waits for its devices any more", holder.allocation_id, holder.tenant
                )
            if holder in self._news:
                self._news[holder].set()

    # -- workers ---------------------------------------------------------------------------

    async def _register(
        self, request: pb.RegisterWorkerRequest, context
    ) -> tuple[WorkerEntry, pb.RegisterWorkerResponse]:
        try:
            if request.HasField("group"):
                self.groups.check_member(request.group)
            previous = self.registry.workers.get(f"island{request.island}-host{request.host_index}")
            entry = self.registry.register(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot register worker: {e}")
        if not entry.group and previous is not None and previous.incarnation != entry.incarnation:
            # A new process for a host: the members the old one started went with it.
            self._send(self.groups.host_down(previous))
        _LOGGER.info(
            "worker %s registered at %s (incarnation %d, devices %s)",
            entry.worker_id,
            request.address,
            entry.incarnation,
            entry.device_ids,
        )
        self._grant()
        self._changed()
        return entry, pb.RegisterWorkerResponse(
            worker_id=entry.worker_id,
            incarnation=entry.incarnation,
            device_ids=entry.device_ids,
            heartbeat_interval_s=self.worker_heartbeat_interval_s(),
            colocated_device_ids=[d.colocated.id for d in entry.devices if d.HasField("colocated")],
        )

    async def RegisterWorker(self, request, context):
        _entry, response = await self._register(request, context)
        return response

    async def Attach(self, request_iterator, context):
        first = await anext(request_iterator, None)
        if first is None or not first.HasField("registration"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message of Attach must register the worker"
            )
        entry, registered = await self._register(first.registration, context)
        self.registry.attach(entry)
        if entry.group:
            self.groups.registered(entry)  # attached now: its group may serve
            self._changed()
        # What this stream says back: group orders, a longer update interval; None ends it.
        outbox: asyncio.Queue = asyncio.Queue()
        self._outboxes[entry.worker_id] = outbox
        reader = asyncio.get_running_loop().create_task(self._read_updates(entry, first, request_iterator, outbox))
        try:
            yield pb.AttachReply(registration=registered, update_interval_s=self.worker_update_interval_s())
            while (reply := await outbox.get()) is not None:
                yield reply
        finally:
            # However it ended: the worker closed it, its connection broke or missed a ping, this server stops.
            reader.cancel()
            if self._outboxes.get(entry.worker_id) is outbox:
                del self._outboxes[entry.worker_id]
            if self.registry.detach(entry):
                self._dirty.set()
                asyncio.get_running_loop().call_later(self.liveness.settle_s, self._detached_for_good, entry)

    async def _read_updates(self, entry: WorkerEntry, first: pb.WorkerUpdate, request_iterator, outbox) -> None:
        """A worker's messages on its Attach stream: its load, and news of the group members it runs."""
        interval_s = self.worker_update_interval_s()
        try:
            update = first
            while True:
                if update.HasField("load"):
                    self.registry.report_load(entry, update.load)
                    self._dirty.set()
                for event in update.group_events:
                    self._group_event(event)
                if self.worker_update_interval_s() >= 2 * interval_s:  # the cluster grew: report less often
                    interval_s = self.worker_update_interval_s()
                    outbox.put_nowait(pb.AttachReply(update_interval_s=interval_s))
                update = await anext(request_iterator, None)
                if update is None:
                    break
        except grpc.aio.AioRpcError as error:
            _LOGGER.info("worker %s: its stream ended (%s)", entry.worker_id, error.code().name)
        outbox.put_nowait(None)

    def _group_event(self, event: pb.GroupMemberEvent) -> None:
        if event.coordinator_address:
            self._send(self.groups.coordinator_started(event))
        if event.exited:
            _LOGGER.warning(
                "group %s epoch %d member %d ended: %s", event.group, event.epoch, event.member, event.exited
            )
            self._send(self.groups.member_exited(event))
        self._changed()

    def _send(self, orders: Orders) -> None:
        """Sends group orders to workers on their Attach streams (one not attached now gets none: see ``expire``)."""
        for worker_id, order in orders:
            outbox = self._outboxes.get(worker_id)
            if outbox is not None:
                outbox.put_nowait(pb.AttachReply(group_orders=[order]))
            else:
                _LOGGER.warning("worker %s is not attached: it cannot be told %s", worker_id, order)

    def _worker_down(self, entry: WorkerEntry) -> None:
        """A worker is down: so is every group over its island, or the group it is a member of."""
        if entry.group:
            self._send(self.groups.member_down(entry, entry.down_reason))
        else:
            self._send(self.groups.host_down(entry))
        self._changed()

    def _detached_for_good(self, entry: WorkerEntry) -> None:
        """A worker's stream ended a moment ago: unless its launcher said why, or it attached again, it is down."""
        if self.registry.detached_for_good(entry):
            _LOGGER.warning(
                "worker %s (%s): %s; island %d is unhealthy",
                entry.worker_id,
                entry.request.address,
                entry.down_reason,
                entry.island,
            )
            self._worker_down(entry)

    def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        known, revived = self.registry.heartbeat(request.worker_id, request.incarnation)
        if revived:
            self._changed()
        return pb.HeartbeatResponse(known=known, heartbeat_interval_s=self.worker_heartbeat_interval_s())

    async def Heartbeat(self, request, context):
        return self._heartbeat(request)

    async def Heartbeats(self, request_iterator, context):
        async for request in request_iterator:
            yield self._heartbeat(request)

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
            self._worker_down(entry)
        return pb.WorkerExitAck(known=entry is not None)

    # -- allocations -----------------------------------------------------------------------

    async def Allocate(self, request, context):
        if request.num_devices < 0 or request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_devices and timeout_s must be >= 0")
        tenant = request.tenant or ANONYMOUS
        ceiling = self.policy.ceiling(tenant)
        if ceiling is not None and request.priority > ceiling:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant} asked for priority {request.priority}, above its ceiling {ceiling}: ask for "
                f"priority <= {ceiling}, or an operator raises --priority_ceiling {tenant}={request.priority}",
            )
        if request.reclaim_allocation_id:
            async for update in self._hold_reclaimed(request):
                yield update
            return
        ticket = self.allocator.submit(
            tenant,
            request.exclusive,
            request.num_devices,
            tuple(request.islands),
            request.priority,
            tuple(request.want_device_ids),
            request.want_same_shape,
        )
        deadline = time.monotonic() + request.timeout_s if request.timeout_s else None
        try:
            try:
                self.allocator.check(ticket, self.registry)
            except Unsatisfiable as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            while True:
                self._grant()
                if ticket.granted:
                    break
                waiting = self.allocator.waiting(ticket, self.registry)
                if deadline is not None and time.monotonic() >= deadline:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"gave up after {request.timeout_s:g} s {waiting.reason}; try again later, "
                        "ask for fewer devices, or share instead of asking for exclusive use",
                    )
                yield pb.AllocateUpdate(waiting=waiting)
                await self._next_change(None if deadline is None else max(0.0, deadline - time.monotonic()))
            _LOGGER.info("%s granted to %s: devices %s", ticket.allocation_id, ticket.tenant, list(ticket.devices))
            yield pb.AllocateUpdate(granted=self._allocation(ticket))
            async for update in self._held(ticket):
                yield update
        finally:
            self.allocator.release(ticket)
            self._grant()
            self._changed()

    async def _hold_reclaimed(self, request):
        """Grants again, at once, an allocation a proxy held before this resource manager restarted."""
        ticket = self.allocator.reclaim(
            request.reclaim_allocation_id,
            request.tenant,
            request.exclusive,
            tuple(request.reclaim_device_ids),
            request.priority,
        )
        _LOGGER.info("%s of %s reclaimed: devices %s", ticket.allocation_id, ticket.tenant, list(ticket.devices))
        self._grant()  # those waiting for its devices ask it to suspend
        self._changed()
        try:
            yield pb.AllocateUpdate(granted=self._allocation(ticket))
            async for update in self._held(ticket):
                yield update
        finally:
            self.allocator.release(ticket)
            self._grant()
            self._changed()

    def _allocation(self, ticket: Ticket) -> pb.Allocation:
        granted = pb.Allocation(
            allocation_id=ticket.allocation_id,
            platform=self._platform(),
            cluster_islands=self._islands(),
            suspend_idle_after_s=self.policy.suspend_idle_after_s,
            suspend_idle_always=self.policy.suspend_idle_always,
        )
        devices = (self.registry.device(i) for i in ticket.devices)
        # (A reclaimed allocation's workers may not have registered again yet.)
        granted.devices.extend(device for device in devices if device is not None)
        return granted

    async def _held(self, ticket: Ticket):
        """A granted allocation lasts as long as its call, until the holder cancels it or goes away; meanwhile the
        holder is told each time who wants its devices changes (``Allocator.contention``)."""
        news = self._news[ticket] = asyncio.Event()
        sent = pb.Wanted()
        try:
            while True:
                if ticket.told != sent:
                    sent = ticket.told
                    yield pb.AllocateUpdate(wanted=sent)
                await news.wait()
                news.clear()
        finally:
            del self._news[ticket]

    def _islands(self) -> int:
        return self.topology.islands if self.topology else len(self.registry.islands())

    def _platform(self) -> str:
        return self.registry.platform or (self.topology.platform if self.topology else "")

    # -- state -----------------------------------------------------------------------------

    def _summary(self) -> pb.ClusterState:
        """The state without workers and devices: allocations, the queue, the shape."""
        topology = self.topology
        return pb.ClusterState(
            allocations=self.allocator.states(),
            waiting=len(self.allocator.queue),
            queue=self.allocator.queued(self.registry),
            islands=self._islands(),
            hosts_per_island=topology.hosts_per_island if topology else 0,
            devices_per_host=topology.devices_per_host if topology else 0,
            platform=self._platform(),
            groups=self.groups.states(),
        )

    def state(self) -> pb.ClusterState:
        """The whole state; built again only after a change, or once its ages are a publish interval old."""
        now = time.monotonic()
        if self._cached is not None:
            version, built, state = self._cached
            if version == self._version and now - built < self.publish_interval_s:
                return state
        state = self._summary()
        state.workers.extend(self._worker_states())
        state.devices.extend(self.registry.devices())
        self._cached = (self._version, now, state)
        return state

    def _worker_states(self, entries: list[WorkerEntry] | None = None) -> list[pb.WorkerState]:
        """The registry's worker states, with how far each host being drained is."""
        states = self.registry.worker_states(entries)
        for state in states:
            if (state.island, state.host_index) in self.allocator.draining:
                state.draining = True
                state.drain_status = self._drain_status(state)
        return states

    def _draining(self, entry: WorkerEntry) -> bool:
        return not entry.group and (entry.island, entry.host_index) in self.allocator.draining

    def _drain_status(self, state: pb.WorkerState) -> str:
        """What keeps a host being drained, or "drained" (no grant holds its devices, no session keeps arrays
        there, or its worker is down: stopping it loses nothing more)."""
        holders = self.allocator.holders_on(self.registry, (state.island, state.host_index))
        if holders:
            tenants = ", ".join(sorted({holder.tenant for holder in holders}))
            return f"draining: {len(holders)} allocation(s) of {tenants} hold its devices (asked to suspend)"
        if state.healthy and state.load.session_arrays:
            return (
                f"draining: suspended sessions keep {state.load.session_arrays} arrays there "
                "(they move once devices like theirs are free)"
            )
        return "drained"

    async def Drain(self, request, context):
        """Drains a host, or puts it back in service (``undo``); answers with its state."""
        host = (request.island, request.host_index)
        entry = self.registry.workers.get(f"island{request.island}-host{request.host_index}")
        if entry is None:
            known = sorted((e.island, e.host_index) for e in self.registry.workers.values() if not e.group)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no host {request.island}/{request.host_index} in this cluster (ISLAND/HOST: "
                f"{', '.join(f'{i}/{h}' for i, h in known) or 'none registered'}); nothing was drained",
            )
        if request.undo:
            self.allocator.draining.discard(host)
            _LOGGER.info("island %d host %d is back in service", *host)
        elif host not in self.allocator.draining:
            self.allocator.draining.add(host)
            _LOGGER.info("draining island %d host %d: its sessions are asked to suspend", *host)
        self.registry.mark_changed(entry)
        self._grant()
        self._changed()
        return self._worker_states([entry])[0]

    async def Profile(self, request, context):
        """Starts or stops a trace of this process (the proxy asks, for a client's profile); the stop returns it."""

        def control() -> bytes:
            if request.start:
                options = host_profiler.TraceOptions(
                    request.host_tracer_level, request.python_tracer, {}, request.max_duration_s
                )
                host_profiler.PROFILER.start(
                    request.trace, request.owner, options, "the resource manager", host_profiler.in_memory
                )
                return b""
            return host_profiler.PROFILER.stop(request.trace, "the resource manager").xspace

        try:
            xspace = await asyncio.to_thread(control)
        except RequestError as error:
            await context.abort(grpc_code(error), error.message)
        except Exception as error:  # noqa: BLE001 - jaxlib's own failure, reported to the caller
            await context.abort(grpc.StatusCode.INTERNAL, as_request_error(error).message)
        return pb.ProfileResult(xspace=xspace)

    async def FormGroup(self, request, context):
        """Forms the group of ``request.islands`` if it does not serve yet; answers once it serves, or why not."""
        try:
            group, orders = self.groups.request(request.islands)
        except GroupUnavailable as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the islands {sorted(request.islands)} cannot form a group: {error}"
            )
        if orders:
            _LOGGER.info("forming group %s (epoch %d) over %d hosts", group.name, group.epoch, len(group.hosts))
            self._send(orders)
            self._changed()
        timeout_s = request.timeout_s or tuning.GROUP_FORM_TIMEOUT_S.value
        if group.phase is Phase.forming:
            waiter = asyncio.get_running_loop().create_future()
            group.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the group of islands {group.name} did not form within {timeout_s:g} s; try again",
                )
        if group.phase is not Phase.serving:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the group of islands {group.name} is down ({group.down_reason}); it forms again once its "
                "hosts are back",
            )
        return group.state(time.monotonic())

    async def GetClusterState(self, request, context):
        return self.state()

    async def WatchCluster(self, request, context):
        seen = self._publication.version
        yield self.state()
        while True:
            if self._publication.version == seen:
                await self._published.wait()
            publication = self._publication
            # One update behind: the delta; further (this watcher was slow), or no deltas asked: all of it.
            yield publication.delta if request.deltas and publication.version == seen + 1 else self.state()
            seen = publication.version
