"""Who holds which devices, and the queue of those waiting.

Tenants share devices by default (time-sharing: each session's programs
interleave on them). An exclusive request waits until nobody else holds any
of its devices, and while it waits, later requests for those devices wait
behind it, so it is never starved. The queue is in priority order, higher
first, and first come, first served among equal priorities; a request that
conflicts with nobody waiting ahead of it does not wait for them.

A suspended session resuming asks for the devices it had (``want``), and, where those are taken,
away or drained, accepts others of the same shape (``same_shape``): as many on one host under the
same local ids, or, for a session over several hosts of an island, another island's hosts at the same
host indices. Its proxy moves its arrays there (virtual devices: the client's ids stay the same).

An operator drains a host: its devices go to nobody new, and those holding them are asked to suspend
at once (to resume elsewhere).

A request blocked by granted ones asks them to suspend (their proxies move
their sessions off the devices and release them): at once if it has a higher
priority than theirs (preemption), else once they are idle, if the cluster's
policy suspends idle sessions. It asks nobody when that could not free its
devices: when one of them has its priority or a higher one and idle sessions
are never suspended. Each holder is told of the highest-priority request that
asks it, and once nobody does any more.

Decisions take time in the size of the request and the queue, not of the
cluster: who holds which device is recorded as grants come and go, and the
devices to choose from come sorted from the registry's index.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
import time
from dataclasses import dataclass, field

from pathways_nb.rm.registry import Registry
from pathways_nb.rpc import cluster_pb2 as pb


class Unsatisfiable(ValueError):
    """A request no state of the cluster could grant (more devices than exist, unknown islands)."""


# The tenant of a request that names none.
ANONYMOUS = "anonymous"


@dataclass(eq=False)  # each request is itself: compared and hashed by identity
class Ticket:
    """One request: waiting (``devices is None``) or granted."""

    allocation_id: str
    tenant: str
    exclusive: bool
    num_devices: int
    islands: tuple[int, ...]
    priority: int = 0
    want: tuple[int, ...] = ()  # exactly these devices (a suspended session resuming), sorted
    same_shape: bool = False  # with ``want``: or devices of the same shape, where those are not to be had
    created: float = field(default_factory=time.monotonic)
    devices: tuple[int, ...] | None = None
    holding: bool = False  # its devices are recorded as held
    told: pb.Wanted = field(default_factory=pb.Wanted)  # granted: what it was last told of who wants its devices

    @property
    def granted(self) -> bool:
        return self.devices is not None

    def describe(self) -> str:
        return f"tenant {self.tenant} (priority {self.priority}, {'exclusive' if self.exclusive else 'shared'})"


class Allocator:
    """Grants and queues allocations; not thread-safe (used from one loop)."""

    def __init__(self, suspend_idle_after_s: float = 0.0) -> None:
        """``suspend_idle_after_s``: whether (> 0) idle holders are asked to suspend for requests of no
        higher priority than theirs, and after how long idle (said in the reasons of those waiting)."""
        self.suspend_idle_after_s = suspend_idle_after_s
        self._ids = itertools.count(1)
        # Ids stay unique across restarts, whose reclaimed allocations keep their old ids.
        self._prefix = secrets.token_hex(3)
        self.granted: dict[str, Ticket] = {}
        self.queue: list[Ticket] = []
        # Device id -> the grants that hold it; how many of them are exclusive. No empty entries.
        self._holders: dict[int, set[Ticket]] = {}
        self._held_exclusively: dict[int, int] = {}
        # The grants told that a request wants their devices (``told.by`` set).
        self._asked: set[Ticket] = set()
        # Hosts an operator drains, (island, host index): their devices go to nobody new.
        self.draining: set[tuple[int, int]] = set()

    def submit(
        self,
        tenant: str,
        exclusive: bool,
        num_devices: int,
        islands: tuple[int, ...],
        priority: int = 0,
        want: tuple[int, ...] = (),
        same_shape: bool = False,
    ) -> Ticket:
        """Queues a request: behind those of its priority or a higher one. With ``want``, for exactly
        those devices (``num_devices`` is ignored), or, ``same_shape``, others like them on ``islands`` (if any)."""
        want = tuple(sorted(set(want)))
        ticket = Ticket(
            f"alloc-{self._prefix}-{next(self._ids)}",
            tenant or ANONYMOUS,
            exclusive,
            len(want) if want else num_devices,
            islands if same_shape or not want else (),  # (a resume: where others of the same shape may be)
            priority,
            want,
            same_shape=same_shape and bool(want),
        )
        self.queue.insert(bisect.bisect_right(self.queue, -priority, key=lambda t: -t.priority), ticket)
        return ticket

    def reclaim(
        self, allocation_id: str, tenant: str, exclusive: bool, devices: tuple[int, ...], priority: int = 0
    ) -> Ticket:
        """Records a grant made before a restart of the resource manager (the holder still uses it)."""
        ticket = Ticket(allocation_id, tenant or ANONYMOUS, exclusive, len(devices), (), priority, devices=devices)
        self._hold(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        if self.granted.get(ticket.allocation_id) is ticket:
            del self.granted[ticket.allocation_id]
        self._asked.discard(ticket)
        if ticket.holding:
            ticket.holding = False
            for device in ticket.devices:
                holders = self._holders[device]
                holders.discard(ticket)
                if not holders:
                    del self._holders[device]
                if ticket.exclusive:
                    if self._held_exclusively[device] == 1:
                        del self._held_exclusively[device]
                    else:
                        self._held_exclusively[device] -= 1
        if ticket in self.queue:
            self.queue.remove(ticket)

    def _hold(self, ticket: Ticket) -> None:
        self.granted[ticket.allocation_id] = ticket
        ticket.holding = True
        for device in ticket.devices:
            self._holders.setdefault(device, set()).add(ticket)
            if ticket.exclusive:
                self._held_exclusively[device] = self._held_exclusively.get(device, 0) + 1

    def grant(self, registry: Registry) -> list[Ticket]:
        """Grants every queued request that fits now; returns them. Raises nothing: see ``check``."""
        newly = []
        blocked: set[int] = set()
        for ticket in list(self.queue):
            pool = self._pool(ticket, registry)
            wanted = self._candidates(ticket, pool)
            if (wanted is None or not blocked.isdisjoint(wanted)) and ticket.same_shape:
                wanted = self._same_shape(ticket, registry, blocked)
            if wanted is not None and blocked.isdisjoint(wanted):
                ticket.devices = wanted
                self.queue.remove(ticket)
                self._hold(ticket)
                newly.append(ticket)
            else:
                blocked.update(self._wanted_devices(ticket, pool))
        return newly

    def contention(self, registry: Registry) -> list[Ticket]:
        """Updates what each grant is told (``told``) of the queued requests that ask it to suspend; returns
        the grants whose news changed. Call it after ``grant``: every queued request is then blocked."""
        asks: dict[Ticket, pb.Wanted] = {}
        for host in sorted(self.draining):  # first: a drain is told before any request
            by = f"an operator draining island {host[0]} host {host[1]}"
            for holder in self.holders_on(registry, host):
                asks.setdefault(holder, pb.Wanted(by=by, preempt=True, drain=True))
        for waiter in self.queue:  # highest priority first: the first to ask a holder is the one it is told of
            for holder, now in self._asks(waiter, self._blockers(waiter, registry)).items():
                if holder not in asks:
                    asks[holder] = pb.Wanted(by=waiter.describe(), preempt=now, priority=waiter.priority)
        changed = []
        for holder in self._asked | asks.keys():
            news = asks.get(holder, pb.Wanted())  # nobody wants its devices any more
            if news != holder.told:
                holder.told = news
                changed.append(holder)
        self._asked = set(asks)
        return changed

    def _asks(self, ticket: Ticket, blockers: set[Ticket]) -> dict[Ticket, bool]:
        """Which of a queued request's ``blockers`` it asks to suspend, each with whether at once (its priority
        is lower): none if one of them keeps its devices anyway."""
        now = {holder: ticket.priority > holder.priority for holder in blockers}
        return now if self.suspend_idle_after_s or all(now.values()) else {}

    def _blockers(self, ticket: Ticket, registry: Registry) -> set[Ticket]:
        """The grants that hold devices a queued request waits for, in conflict with it (either is exclusive)."""
        return {
            holder
            for device in self._wanted_devices(ticket, self._pool(ticket, registry))
            for holder in self._holders.get(device, ())
            if ticket.exclusive or holder.exclusive
        }

    def check(self, ticket: Ticket, registry: Registry) -> None:
        """Raises ``Unsatisfiable`` if the request could never be granted on the registry's devices."""
        if ticket.want:  # devices it had: their worker may be away a while (restarting), and it waits for them
            return
        pool = registry.device_ids(ticket.islands)
        if ticket.islands:
            known = registry.islands()
            missing = sorted(set(ticket.islands) - set(known))
            if missing:
                raise Unsatisfiable(f"no island {missing} in this cluster (islands: {known})")
        if ticket.num_devices > len(pool):
            raise Unsatisfiable(f"{ticket.num_devices} devices were asked for, but the chosen islands have {len(pool)}")
        if not pool:
            raise Unsatisfiable("the cluster has no devices yet: no worker has registered")

    def waiting(self, ticket: Ticket, registry: Registry) -> pb.Waiting:
        """Where a queued request stands, for whom it waits, and whom it asks to suspend."""
        blockers = self._blockers(ticket, registry)
        holders = sorted({f"{other.tenant} ({'exclusive' if other.exclusive else 'shared'})" for other in blockers})
        ahead = self.queue.index(ticket) if ticket in self.queue else 0
        kind = "exclusive use of" if ticket.exclusive else "a share of"
        if ticket.want:
            what = f"the devices {list(ticket.want)} again" + (" or others like them" if ticket.same_shape else "")
            away = [device for device in ticket.want if registry.device(device) is None]
            if away:
                what += f" (the worker of {away} is not registered now)"
            drained = sorted({(d.island, d.host_index) for d in map(registry.device, ticket.want) if self._drained(d)})
            if drained:
                what += f" ({', '.join(f'island {i} host {h}' for i, h in drained)} is being drained)"
        else:
            what = f"{ticket.num_devices or len(self._pool(ticket, registry))} devices" + (
                f" on islands {list(ticket.islands)}" if ticket.islands else ""
            )
        reason = f"waiting for {kind} {what}"
        if holders:
            reason += f", held by {', '.join(holders)}"
        asks = self._asks(ticket, blockers)
        preempted = sorted({holder.tenant for holder, now in asks.items() if now})
        idle = sorted({holder.tenant for holder, now in asks.items() if not now})
        if preempted:
            reason += f"; asking {', '.join(preempted)} to suspend (preempted)"
        if idle:
            reason += f"; asking {', '.join(idle)} to suspend once idle for {self.suspend_idle_after_s:g} s"
        if ahead:
            reason += f"; {ahead} request(s) ahead"
        return pb.Waiting(position=ahead + 1, reason=reason, holders=holders)

    # -- selection -------------------------------------------------------------------------

    def _pool(self, ticket: Ticket, registry: Registry) -> list[int]:
        """The devices a request may be granted, sorted (of those it wants again, the registered ones), but
        none of a host being drained."""
        if ticket.want:
            return [d for d in ticket.want if (device := registry.device(d)) is not None and not self._drained(device)]
        pool = registry.device_ids(ticket.islands)
        if self.draining:
            pool = [d for d in pool if not self._drained(registry.device(d))]
        return pool

    def _drained(self, device: pb.Device | None) -> bool:
        return device is not None and (device.island, device.host_index) in self.draining

    def holders_on(self, registry: Registry, host: tuple[int, int]) -> set[Ticket]:
        """The grants that hold devices of ``host`` (island, host index)."""
        found: set[Ticket] = set()
        for entry in registry.island_workers(host[0]):
            if entry.host_index == host[1]:
                for device_id in entry.device_ids:
                    found.update(self._holders.get(device_id, ()))
        return found

    def _same_shape(self, ticket: Ticket, registry: Registry, blocked: set[int]) -> tuple[int, ...] | None:
        """Devices like those ``ticket`` wants (the lowest ids that are free), or None.

        Like them: of the same platform and kind, as many on each host under the same local ids (the
        session's programs are compiled in local ids); a session over several hosts moves to another
        island's hosts at the same host indices. Only on the islands the session asked for. Takes time in
        the size of the cluster: only a resume whose devices are taken looks.
        """
        devices = [registry.device(d) for d in ticket.want]
        if any(device is None for device in devices):
            return None  # (a worker away since a restart of the resource manager: its shape is not known)
        shape: dict[int, set[int]] = {}
        for device in devices:
            shape.setdefault(device.host_index, set()).add(device.local_id)
        kinds = {(device.platform, device.kind) for device in devices}
        islands = {device.island for device in devices}
        if len(kinds) != 1 or len(islands) != 1:
            return None
        unavailable = self._holders if ticket.exclusive else self._held_exclusively

        def free_on(entry, local_ids: set[int]) -> list[int] | None:
            if not entry.healthy or entry.group or (entry.island, entry.host_index) in self.draining:
                return None
            if ticket.islands and entry.island not in ticket.islands:
                return None
            chosen = [d.id for d in entry.devices if d.local_id in local_ids and (d.platform, d.kind) in kinds]
            if len(chosen) != len(local_ids) or any(d in unavailable or d in blocked for d in chosen):
                return None
            return chosen

        options: list[tuple[int, ...]] = []
        if len(shape) == 1:
            (local_ids,) = shape.values()
            for entry in registry.workers.values():
                chosen = free_on(entry, local_ids)
                if chosen is not None:
                    options.append(tuple(sorted(chosen)))
        else:
            for island in registry.islands():
                hosts = {entry.host_index: entry for entry in registry.island_workers(island)}
                if island in islands or not set(shape) <= set(hosts):
                    continue
                chosen = [free_on(hosts[index], local_ids) for index, local_ids in shape.items()]
                if all(part is not None for part in chosen):
                    options.append(tuple(sorted(d for part in chosen for d in part)))
        return min(options, default=None)

    @staticmethod
    def _wanted_devices(ticket: Ticket, pool: list[int]) -> list[int]:
        """The devices a request that must wait waits for: the lowest ids it could have."""
        return pool[: ticket.num_devices] if ticket.num_devices else pool

    def _candidates(self, ticket: Ticket, pool: list[int]) -> tuple[int, ...] | None:
        """The devices (lowest ids first) to grant now, or None if the request must wait."""
        unavailable = self._holders if ticket.exclusive else self._held_exclusively
        wanted = ticket.num_devices
        if not wanted:
            return None if any(d in unavailable for d in pool) else tuple(pool)
        if not unavailable:
            return tuple(pool[:wanted]) if len(pool) >= wanted else None
        free = []
        for device in pool:  # stops at the first ``wanted`` free devices
            if device not in unavailable:
                free.append(device)
                if len(free) == wanted:
                    return tuple(free)
        return None

    def queued(self, registry: Registry) -> list[pb.QueuedRequest]:
        now = time.monotonic()
        return [
            pb.QueuedRequest(
                tenant=t.tenant,
                exclusive=t.exclusive,
                num_devices=t.num_devices,
                waiting=self.waiting(t, registry),
                age_s=now - t.created,
                priority=t.priority,
                resuming=bool(t.want),
            )
            for t in self.queue
        ]

    def states(self) -> list[pb.AllocationState]:
        now = time.monotonic()
        return [
            pb.AllocationState(
                allocation_id=t.allocation_id,
                tenant=t.tenant,
                exclusive=t.exclusive,
                device_ids=t.devices,
                age_s=now - t.created,
                priority=t.priority,
            )
            for t in self.granted.values()
        ]
