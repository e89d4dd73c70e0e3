"""Groups of islands: the member processes that make several islands one JAX runtime (multislice).

A program whose devices span islands runs as one SPMD program over every host of those islands,
its collectives across islands on the network between them. The islands' own workers cannot run
it: each island is a JAX runtime of its own, and a process joins one. So the islands of such a
program form a *group*: every host of them starts a member process beside its worker (the worker
starts it when the resource manager says), the members join one runtime of their own (member 0
serves its coordination), and each member serves the devices of its host again, as twins of
the island's devices. A group is an island of several hosts, as far as the proxy and the members
are concerned: a program over it is gang-scheduled by member 0, its arrays are parted by member.

Why members and not the islands' workers: a host that dies ends the runtime it is part of (its
peers' collectives fail or wait forever, and jaxlib ends a process whose coordination service is
gone). In a group of its own, that costs the group, whose members are stopped and started again
once every host is back, and never the islands' own runtimes: another island's sessions and its
single-island programs go on untouched (docs/design.md, "Programs across islands").

This module decides; ``rm.service`` sends the orders it returns (on the workers' Attach streams)
and wakes whoever waits for a group. Groups are formed when a proxy first needs one
(``FormGroup``), and formed again, under a new epoch, after a loss.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from pathways_nb.core.islands import group_name
from pathways_nb.rm.registry import Registry, WorkerEntry
from pathways_nb.rpc import cluster_pb2 as pb


class GroupUnavailable(Exception):
    """The group cannot be formed now (an island is down, or unknown); the message says which and why."""


class Phase(enum.Enum):
    forming = "forming"
    serving = "serving"
    down = "down"


@dataclass
class Group:
    """One group of islands, in its current epoch."""

    name: str
    islands: tuple[int, ...]
    epoch: int = 0
    phase: Phase = Phase.down
    down_reason: str = ""
    hosts: list[WorkerEntry] = field(default_factory=list)  # the islands' workers, in member order
    members: list[WorkerEntry | None] = field(default_factory=list)  # registered members, by index
    coordinator_address: str = ""
    started: float = 0.0
    waiters: list[asyncio.Future] = field(default_factory=list)

    def membership(self, member: int) -> pb.GroupMembership:
        host = self.hosts[member]
        return pb.GroupMembership(
            group=self.name,
            epoch=self.epoch,
            member=member,
            members=len(self.hosts),
            coordinator_address=self.coordinator_address,
            island=host.island,
            host_index=host.host_index,
            islands=self.islands,
        )

    def state(self, now: float) -> pb.GroupState:
        members = [m for m in self.members if m is not None]
        return pb.GroupState(
            group=self.name,
            islands=self.islands,
            epoch=self.epoch,
            healthy=self.phase is Phase.serving,
            forming=self.phase is Phase.forming,
            down_reason=self.down_reason,
            members=[m.state(now) for m in members],
            devices=[d for m in members for d in m.devices],
        )


Orders = list[tuple[str, pb.GroupOrder]]  # (the worker to tell, what)


class Groups:
    """Every group of islands the cluster has formed; not thread-safe (the resource manager's loop)."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.groups: dict[str, Group] = {}

    # -- forming ---------------------------------------------------------------------------

    def request(self, islands) -> tuple[Group, Orders]:
        """The group of ``islands``: as it is if it serves or forms, else formed anew (the orders start it).

        Raises ``GroupUnavailable`` if one of its hosts is down or the islands are not two or more.
        """
        chosen = tuple(sorted(set(islands)))
        if len(chosen) < 2:
            raise GroupUnavailable(f"a group needs two or more islands, not {list(chosen)}")
        known = self.registry.islands()
        missing = [i for i in chosen if i not in known]
        if missing:
            raise GroupUnavailable(f"no island {missing} in this cluster (islands: {known})")
        name = group_name(chosen)
        group = self.groups.setdefault(name, Group(name, chosen))
        if group.phase is not Phase.down:
            return group, []
        hosts = self._hosts(chosen)
        group.epoch += 1
        group.phase = Phase.forming
        group.down_reason = ""
        group.hosts = hosts
        group.members = [None] * len(hosts)
        group.coordinator_address = ""
        group.started = time.monotonic()
        return group, [(hosts[0].worker_id, pb.GroupOrder(start=group.membership(0)))]

    def _hosts(self, islands: tuple[int, ...]) -> list[WorkerEntry]:
        """Every host of ``islands``, healthy and attached, in (island, host) order; else why not."""
        topology = self.registry.topology
        hosts = []
        for island in islands:
            present = {e.host_index: e for e in self.registry.island_workers(island)}
            expected = range(topology.hosts_per_island) if topology is not None else sorted(present)
            for host_index in expected:
                entry = present.get(host_index)
                if entry is None:
                    raise GroupUnavailable(f"island {island} host {host_index} has not registered")
                if not entry.healthy:
                    raise GroupUnavailable(
                        f"island {island} host {host_index} ({entry.request.address}) is down"
                        + (f" ({entry.down_reason})" if entry.down_reason else "")
                    )
                hosts.append(entry)
        return hosts

    def coordinator_started(self, event: pb.GroupMemberEvent) -> Orders:
        """Member 0 serves the group's coordination at ``event.coordinator_address``: the others start."""
        group = self._current(event.group, event.epoch)
        if group is None or group.phase is not Phase.forming or event.member != 0:
            return []
        group.coordinator_address = event.coordinator_address
        return [
            (group.hosts[k].worker_id, pb.GroupOrder(start=group.membership(k))) for k in range(1, len(group.hosts))
        ]

    def check_member(self, membership: pb.GroupMembership) -> None:
        """Raises ``ValueError`` unless ``membership`` is a member the resource manager started and awaits."""
        group = self._current(membership.group, membership.epoch)
        if group is None or group.phase is Phase.down:
            raise ValueError(f"group {membership.group} epoch {membership.epoch} is not being formed (any more)")
        if not 0 <= membership.member < len(group.hosts):
            raise ValueError(f"group {membership.group} has no member {membership.member}")
        host = group.hosts[membership.member]
        if (membership.island, membership.host_index) != (host.island, host.host_index):
            raise ValueError(
                f"member {membership.member} of group {membership.group} shadows island {host.island} host "
                f"{host.host_index}, not island {membership.island} host {membership.host_index}"
            )

    def registered(self, entry: WorkerEntry) -> None:
        """A member registered (``check_member`` passed): the group serves once every member has."""
        membership = entry.request.group
        group = self._current(membership.group, membership.epoch)
        if group is None:
            return
        group.members[membership.member] = entry
        if group.phase is Phase.forming and all(m is not None and m.healthy for m in group.members):
            group.phase = Phase.serving
            self._wake(group)

    # -- losing ----------------------------------------------------------------------------

    def host_down(self, entry: WorkerEntry) -> Orders:
        """An island's worker is down: every group over its island is too, with its reason."""
        where = f"island {entry.island} host {entry.host_index} ({entry.request.address}) is down"
        reason = f"{where} ({entry.down_reason})" if entry.down_reason else where
        orders: Orders = []
        for group in self.groups.values():
            if entry.island in group.islands and group.phase is not Phase.down:
                orders += self._down(group, reason)
        return orders

    def member_down(self, entry: WorkerEntry, reason: str) -> Orders:
        """A member's process ended, or its stream did: its group is down (its runtime cannot go on)."""
        membership = entry.request.group
        group = self._current(membership.group, membership.epoch)
        if group is None or group.phase is Phase.down:
            return []
        where = f"its member on island {membership.island} host {membership.host_index}"
        return self._down(group, f"{where} {reason}")

    def member_exited(self, event: pb.GroupMemberEvent) -> Orders:
        group = self._current(event.group, event.epoch)
        if group is None or group.phase is Phase.down:
            return []
        host = group.hosts[event.member] if event.member < len(group.hosts) else None
        where = f"its member on island {host.island} host {host.host_index}" if host else f"member {event.member}"
        return self._down(group, f"{where} ended: {event.exited}")

    def expire(self, timeout_s: float) -> Orders:
        """Groups still forming after ``timeout_s`` are given up (their members are stopped)."""
        orders: Orders = []
        now = time.monotonic()
        for group in self.groups.values():
            if group.phase is Phase.forming and now - group.started > timeout_s:
                waiting = [f"member {k}" for k, m in enumerate(group.members) if m is None]
                orders += self._down(group, f"its members did not all start within {timeout_s:g} s ({waiting})")
        return orders

    def _down(self, group: Group, reason: str) -> Orders:
        group.phase = Phase.down
        group.down_reason = reason
        for member in group.members:
            if member is not None and member.healthy:
                member.set_health(False, f"the group of islands {group.name} is down: {reason}")
        self._wake(group)
        stop = pb.GroupOrder(stop=group.name, stop_epoch=group.epoch, reason=reason)
        return [(host.worker_id, stop) for host in group.hosts]

    # -- reading ---------------------------------------------------------------------------

    def _current(self, name: str, epoch: int) -> Group | None:
        group = self.groups.get(name)
        return group if group is not None and group.epoch == epoch else None

    def _wake(self, group: Group) -> None:
        waiters, group.waiters = group.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def states(self) -> list[pb.GroupState]:
        now = time.monotonic()
        return [group.state(now) for group in self.groups.values()]
