"""Where a proxy session's arrays and programs live: its islands' own workers, or the members of a group of islands.

A program runs where its devices are: on one island's workers, or, if they span islands, on the
members of the group of those islands (``rm.groups``), which the proxy has the resource manager form
when a program first needs it. An array over several islands lives on their group if it serves, else
on the islands' own workers until a program over it moves it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.islands import group_name
from pathways_nb.core.loop import on_loop_thread
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.cluster_api import Cluster, GroupPlacement
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.remote_arrays import PartedArray
from pathways_nb.proxy.worker_link import WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb


class Placement:
    """Places the session's work on its islands' workers or on their group's members."""

    def __init__(self, cluster: Cluster, devices: DeviceMap):
        self.cluster = cluster
        self._devices = devices

    def where(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """Where a program over exactly ``device_ids`` runs: its devices' own worker if they are of one island,
        else each device's twin on the members of the group of their islands (``rm.groups``).

        Off the loop this waits for the group to form; on the loop it must serve already (``ready``).
        """
        devices = self._devices.devices(device_ids)
        islands = {device.island for device in devices.values()}
        if len(islands) <= 1:
            return devices
        placement = self.cluster.group(islands)
        if not placement.done and on_loop_thread(self.cluster.loop):
            raise WorkerLost(
                f"the group of islands {group_name(islands)} is not serving now (it forms again once its hosts are "
                "back). Programs over one island keep running"
            )
        return self.members(placement.wait(tuning.GROUP_FORM_TIMEOUT_S.value + 60), device_ids)

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
