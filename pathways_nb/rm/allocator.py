"""Who holds which devices, and the queue of those waiting.

Tenants share devices by default (time-sharing: each session's programs
interleave on them). An exclusive request waits until nobody else holds any
of its devices, and while it waits, later requests for those devices wait
behind it, so it is never starved. Requests are served first come, first
served, except that a later request that conflicts with nobody waiting ahead
of it does not wait for them.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

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

    def submit(self, tenant: str, exclusive: bool, num_devices: int, islands: tuple[int, ...]) -> Ticket:
        ticket = Ticket(
            f"alloc-{self._prefix}-{next(self._ids)}", tenant or "anonymous", exclusive, num_devices, islands
        )
        self.queue.append(ticket)
        return ticket

    def reclaim(self, allocation_id: str, tenant: str, exclusive: bool, devices: tuple[int, ...]) -> Ticket:
        """Records a grant made before a restart of the resource manager (the holder still uses it)."""
        ticket = Ticket(allocation_id, tenant or "anonymous", exclusive, len(devices), (), devices=devices)
        self.granted[allocation_id] = ticket
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.granted.pop(ticket.allocation_id, None)
        if ticket in self.queue:
            self.queue.remove(ticket)

    def grant(self, devices: list[pb.Device]) -> list[Ticket]:
        """Grants every queued request that fits now; returns them. Raises nothing: see ``check``."""
        newly = []
        blocked: set[int] = set()
        for ticket in list(self.queue):
            wanted = self._candidates(ticket, devices)
            if wanted is not None and not (set(wanted) & blocked):
                ticket.devices = wanted
                self.queue.remove(ticket)
                self.granted[ticket.allocation_id] = ticket
                newly.append(ticket)
            else:
                blocked.update(self._wanted_devices(ticket, devices))
        return newly

    def check(self, ticket: Ticket, devices: list[pb.Device]) -> None:
        """Raises ``Unsatisfiable`` if the request could never be granted on these devices."""
        pool = self._pool(ticket, devices)
        if ticket.islands:
            missing = sorted(set(ticket.islands) - {d.island for d in devices})
            if missing:
                known = sorted({d.island for d in devices})
                raise Unsatisfiable(f"no island {missing} in this cluster (islands: {known})")
        if ticket.num_devices > len(pool):
            raise Unsatisfiable(f"{ticket.num_devices} devices were asked for, but the chosen islands have {len(pool)}")
        if not pool:
            raise Unsatisfiable("the cluster has no devices yet: no worker has registered")

    def waiting(self, ticket: Ticket, devices: list[pb.Device]) -> pb.Waiting:
        """Where a queued request stands, and for whom it waits."""
        wanted = set(self._wanted_devices(ticket, devices))
        holders = sorted(
            {
                f"{other.tenant} ({'exclusive' if other.exclusive else 'shared'})"
                for other in self.granted.values()
                if set(other.devices) & wanted and (ticket.exclusive or other.exclusive)
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

    def _pool(self, ticket: Ticket, devices: list[pb.Device]) -> list[pb.Device]:
        return [d for d in devices if not ticket.islands or d.island in ticket.islands]

    def _wanted_devices(self, ticket: Ticket, devices: list[pb.Device]) -> list[int]:
        pool = [d.id for d in self._pool(ticket, devices)]
        return pool[: ticket.num_devices] if ticket.num_devices else pool

    def _candidates(self, ticket: Ticket, devices: list[pb.Device]) -> tuple[int, ...] | None:
        """The devices to grant now, or None if the request must wait."""
        held_exclusively = {d for t in self.granted.values() if t.exclusive for d in t.devices}
        held = {d for t in self.granted.values() for d in t.devices}
        unavailable = held if ticket.exclusive else held_exclusively
        pool = [d.id for d in self._pool(ticket, devices)]
        if not ticket.num_devices:
            return None if set(pool) & unavailable else tuple(pool)
        free = [d for d in pool if d not in unavailable]
        return tuple(free[: ticket.num_devices]) if len(free) >= ticket.num_devices else None

    def queued(self, devices: list[pb.Device]) -> list[pb.QueuedRequest]:
        now = time.monotonic()
        return [
            pb.QueuedRequest(
                tenant=t.tenant,
                exclusive=t.exclusive,
                num_devices=t.num_devices,
                waiting=self.waiting(t, devices),
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
