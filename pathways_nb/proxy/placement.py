"""Where a proxy session's arrays and programs live: its islands' own workers, or the members of a group of islands.

A program runs where its devices are: on one island's workers, or, if they span islands, on the
members of the group of those islands (``rm.groups``), which the proxy has the resource manager form
when a program first needs it. An array over several islands lives on their group if it serves, else
on the islands' own workers until a program over it moves it.

The state it reads and changes (the session's devices, the cluster's groups) is the proxy's event loop's:
every method is the loop's but ``where_waiting``, a pool thread's blocking call that hands its steps to the loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import Pending
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.cluster_api import Cluster, GroupPlacement
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.loop_handoff import on_loop
from pathways_nb.proxy.remote_arrays import PartedArray
from pathways_nb.rpc import cluster_pb2 as pb


class Placement:
    """Places the session's work on its islands' workers or on their group's members."""

    def __init__(self, cluster: Cluster, devices: DeviceMap):
        self.cluster = cluster
        self._devices = devices

    def where_waiting(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """Where a program over exactly ``device_ids`` runs: its devices' own worker if they are of one island,
        else each device's twin on the members of the group of their islands (``rm.groups``).

        Blocks (a pool thread's call) while the group forms, up to its forming's timeout; fails with DATA_LOSS
        naming a host that keeps the group from serving.
        """
        loop = self.cluster.loop
        devices, forming = on_loop(loop, self._forming, device_ids)
        if forming is None:
            return devices
        group = forming.wait(tuning.GROUP_FORM_TIMEOUT_S.value + 60)
        return on_loop(loop, self.members, group, device_ids)

    def _forming(self, device_ids: Sequence[int]) -> tuple[dict[int, pb.Device], Pending | None]:
        """The devices of one island, or the group of their islands (a pending placement) if they span several."""
        devices = self._devices.devices(device_ids)
        islands = {device.island for device in devices.values()}
        return (devices, None) if len(islands) <= 1 else (devices, self.cluster.group(islands))

    def placed(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """Where a new array over exactly ``device_ids`` is made: on the group of their islands if it serves
        (programs over them run there), else on the islands' own workers (never waits: a program that needs the
        array in the group moves it there)."""
        devices = self._devices.devices(device_ids)
        islands = {device.island for device in devices.values()}
        group = self.cluster.serving(islands) if len(islands) > 1 else None
        return devices if group is None else self.members(group, device_ids)

    def of(self, value) -> dict[int, pb.Device]:
        """Where ``value``'s shards are: its group's members' devices if it lives on a group, else its islands'."""
        parts = value.parts if isinstance(value, PartedArray) else [value]
        group = next((part.link.group for part in parts if part.link.group), "")
        placement = self.cluster.last_placement(group) if group else None
        if placement is None:
            return self._devices.devices(value.sharding.device_ids)
        return self.members(placement, value.sharding.device_ids)

    def members(self, group: GroupPlacement, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """The twins of ``device_ids`` on the group's members."""
        where = {d: group.devices[d] for d in device_ids}
        self._devices.note_members(where)  # its events name its devices in the member's ids
        return where

    def ready(self, device_ids: Sequence[int]) -> Pending | None:
        """What a program over ``device_ids`` must wait for before it is compiled or run (the group of their
        islands forming), or None; it fails with DATA_LOSS naming a host that keeps the group from serving."""
        islands = {self._devices.device(d).island for d in device_ids}
        if len(islands) <= 1:
            return None
        placement = self.cluster.group(islands)
        return None if placement.done and placement.error is None else placement

    def worker_ids(self, sharding: IfrtSharding) -> list[str]:
        """The workers a new array laid out by ``sharding`` would be made on."""
        return sorted({device.worker_id for device in self.placed(sharding.device_ids).values()})


def local_sharding(sharding: IfrtSharding, where: dict[int, pb.Device]) -> IfrtSharding:
    """The sharding in its workers' local device ids (``where``: where its devices were placed)."""
    return IfrtSharding(
        tuple(where[d].local_id for d in sharding.device_ids), sharding.memory_kind, sharding.op_sharding
    )
