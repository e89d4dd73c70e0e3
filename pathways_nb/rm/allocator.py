"""Who holds which devices, and the queue of those waiting.

Tenants share devices by default (time-sharing: each session's programs
interleave on them). An exclusive request waits until nobody else holds any
of its devices, and while it waits, later requests for those devices wait
behind it, so it is never starved. Requests are served first come, first
served, except that a later request that conflicts with nobody waiting ahead
of it does not wait for them.

Decisions take time in the size of the request and the queue, not of the
cluster: who holds which device is counted as grants come and go, and the
devices to choose from come sorted from the registry's index.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from pathways_nb.rm.registry import Registry
from pathways_nb.rpc import cluster_pb2 as pb


class Unsatisfiable(ValueError):
    """A request no state of the cluster could grant (more devices than exist, unknown islands)."""


@dataclass
class Ticket:
    """One request: waiting (``devices is None``) or granted."""

    allocation_id: str
    tenant: str
    exclusive: bool
    num_devices: int
    islands: tuple[int, ...]
    created: float = field(default_factory=time.monotonic)
    devices: tuple[int, ...] | None = None
    holding: bool = False  # its devices are counted as held

    @property
    def granted(self) -> bool:
        return self.devices is not None


class Allocator:
    """Grants and queues allocations; not thread-safe (used from one loop)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        # Ids stay unique across restarts, whose reclaimed allocations keep their old ids.
        self._prefix = secrets.token_hex(3)
        self.granted: dict[str, Ticket] = {}
        self.queue: list[Ticket] = []
        # Device id -> how many grants hold it (all of them; exclusive ones); no zero counts.
        self._held: dict[int, int] = {}
        self._held_exclusively: dict[int, int] = {}

    def submit(self, tenant: str, exclusive: bool, num_devices: int, islands: tuple[int, ...]) -> Ticket:
        ticket = Ticket(
            f"alloc-{self._prefix}-{next(self._ids)}", tenant or "anonymous", exclusive, num_devices, islands
        )
        self.queue.append(ticket)
        return ticket

    def reclaim(self, allocation_id: str, tenant: str, exclusive: bool, devices: tuple[int, ...]) -> Ticket:
        """Records a grant made before a restart of the resource manager (the holder still uses it)."""
        ticket = Ticket(allocation_id, tenant or "anonymous", exclusive, len(devices), (), devices=devices)
        self._hold(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        if self.granted.get(ticket.allocation_id) is ticket:
            del self.granted[ticket.allocation_id]
        if ticket.holding:
            ticket.holding = False
            for counts in (self._held, self._held_exclusively) if ticket.exclusive else (self._held,):
                for device in ticket.devices:
                    if counts[device] == 1:
                        del counts[device]
                    else:
                        counts[device] -= 1
        if ticket in self.queue:
            self.queue.remove(ticket)

    def _hold(self, ticket: Ticket) -> None:
        self.granted[ticket.allocation_id] = ticket
        ticket.holding = True
        for counts in (self._held, self._held_exclusively) if ticket.exclusive else (self._held,):
            for device in ticket.devices:
                counts[device] = counts.get(device, 0) + 1

    def grant(self, registry: Registry) -> list[Ticket]:
        """Grants every queued request that fits now; returns them. Raises nothing: see ``check``."""
        newly = []
        blocked: set[int] = set()
        for ticket in list(self.queue):
            pool = registry.device_ids(ticket.islands)
            wanted = self._candidates(ticket, pool)
            if wanted is not None and blocked.isdisjoint(wanted):
                ticket.devices = wanted
                self.queue.remove(ticket)
                self._hold(ticket)
                newly.append(ticket)
            else:
                blocked.update(self._wanted_devices(ticket, pool))
        return newly

    def check(self, ticket: Ticket, registry: Registry) -> None:
        """Raises ``Unsatisfiable`` if the request could never be granted on the registry's devices."""
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
        """Where a queued request stands, and for whom it waits."""
        wanted = set(self._wanted_devices(ticket, registry.device_ids(ticket.islands)))
        holders = sorted(
            {
                f"{other.tenant} ({'exclusive' if other.exclusive else 'shared'})"
                for other in self.granted.values()
                if (ticket.exclusive or other.exclusive) and not wanted.isdisjoint(other.devices)
            }
        )
        ahead = self.queue.index(ticket) if ticket in self.queue else 0
        kind = "exclusive use of" if ticket.exclusive else "a share of"
        what = f"{ticket.num_devices or len(wanted)} devices" + (
            f" on islands {list(ticket.islands)}" if ticket.islands else ""
        )
        reason = f"waiting for {kind} {what}"
        if holders:
            reason += f", held by {', '.join(holders)}"
        if ahead:
            reason += f"; {ahead} request(s) ahead"
        return pb.Waiting(position=ahead + 1, reason=reason, holders=holders)

    # -- selection -------------------------------------------------------------------------

    @staticmethod
    def _wanted_devices(ticket: Ticket, pool: list[int]) -> list[int]:
        return pool[: ticket.num_devices] if ticket.num_devices else pool

    def _candidates(self, ticket: Ticket, pool: list[int]) -> tuple[int, ...] | None:
        """The devices (lowest ids first) to grant now, or None if the request must wait."""
        unavailable = self._held if ticket.exclusive else self._held_exclusively
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
            )
            for t in self.granted.values()
        ]
