"""A proxy session's devices and the names each has: pure state, no I/O, no locks (owned by the proxy's loop).

A device has up to four names: the session's id (what its client knows, for the session's whole life),
the cluster's physical device that serves it now (another after the session resumes elsewhere:
virtual devices), its twin on the members of a group of islands (multislice), and the (worker, local
id) a worker names it by. ``DeviceMap`` keeps them and translates between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_nb.core.runtime_api import not_in_session
from pathways_nb.protocol.errors import Unavailable
from pathways_nb.rpc import cluster_pb2 as pb


class DeviceMap:
    """The session's devices under the session's ids, and how workers and the cluster name them."""

    def __init__(self, devices: Sequence[pb.Device]):
        self.device_ids = tuple(d.id for d in devices)
        colocated = {d.id: colocated_device(d) for d in devices if d.HasField("colocated")}
        self.colocated_device_ids = tuple(cpu.id for cpu in colocated.values())
        # A device's place on its host (jaxlib's ids of an island's hosts are offsets in one id space);
        # a colocated CPU device has its device's place.
        by_worker: dict[str, list[pb.Device]] = {}
        for device in devices:
            by_worker.setdefault(device.worker_id, []).append(device)
        self._ordinals = {
            device.id: ordinal
            for on_worker in by_worker.values()
            for ordinal, device in enumerate(sorted(on_worker, key=lambda d: d.local_id))
        }
        self._colocation_ids: dict[int, int] = {}
        for device_id, cpu in colocated.items():
            self._ordinals[cpu.id] = self._ordinals[device_id]
            self._colocation_ids[device_id] = self._colocation_ids[cpu.id] = device_id
        # The session's devices -> the cluster's devices that serve them now: the same ones until it resumes on
        # others (virtual devices).
        self.physical = {device_id: device_id for device_id in self.device_ids}
        self._devices: dict[int, pb.Device] = {}
        self._global_ids: dict[tuple[str, int], int] = {}
        self.take(devices)

    def take(self, devices: Sequence[pb.Device]) -> None:
        """Makes ``devices`` (each under the session's id for it) the session's, with their colocated CPU devices
        (a cluster with colocated Python: as devices of their workers)."""
        colocated = [colocated_device(d) for d in devices if d.HasField("colocated")]
        self._devices = {d.id: d for d in [*devices, *colocated]}
        self._global_ids = {(d.worker_id, d.local_id): d.id for d in self._devices.values()}

    def device(self, device_id: int) -> pb.Device:
        """The session's device ``device_id`` (raises NOT_FOUND naming the session's devices if it has none)."""
        try:
            return self._devices[device_id]
        except KeyError:
            raise not_in_session(device_id, self.device_ids) from None

    def devices(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        return {d: self.device(d) for d in device_ids}

    def ordinal(self, device_id: int) -> int:
        return self._ordinals[device_id]

    def colocation_id(self, device_id: int) -> int | None:
        return self._colocation_ids.get(device_id)

    def session_id_of(self, worker_id: str, local_id: int) -> int:
        """The session's id of the device a worker names ``local_id`` (-1: none of the session's)."""
        return self._global_ids.get((worker_id, local_id), -1)

    def note_members(self, where: dict[int, pb.Device]) -> None:
        """``where`` places session devices on a group's members: their events name them in the members' ids."""
        for device_id, member in where.items():
            self._global_ids[(member.worker_id, member.local_id)] = device_id

    def colocated_on(self, worker_id: str) -> dict[int, int]:
        """The worker's colocated CPU devices of this session: local id -> the session's id for each."""
        devices = (self._devices[d] for d in self.colocated_device_ids)
        return {device.local_id: device.id for device in devices if device.worker_id == worker_id}

    @property
    def physical_device_ids(self) -> tuple[int, ...]:
        """The cluster's devices that serve the session's now (or will, once it resumes)."""
        return tuple(self.physical[d] for d in self.device_ids)

    def current(self) -> list[pb.Device]:
        """The session's (non-colocated) devices as they are served now, in the session's order."""
        return [self._devices[d] for d in self.device_ids]

    def move_to(self, granted: Sequence[pb.Device]) -> dict[str, pb.Device]:
        """Makes the ``granted`` devices serve the session's, each at its device's place (``same_places``).

        The session's ids stay. Returns, for each old worker, a device (under the session's id) of its new one.
        Raises UNAVAILABLE, changing nothing, if the grant is not of the session's shape.
        """
        old = self.current()
        new = same_places(old, granted)
        moved: list[pb.Device] = []
        for before, after in zip(old, new, strict=True):
            device = pb.Device()
            device.CopyFrom(after)
            device.id = before.id
            if device.HasField("colocated"):
                device.colocated.id = before.colocated.id
            moved.append(device)
            self.physical[before.id] = after.id
        self.take(moved)
        return {before.worker_id: after for before, after in zip(old, moved, strict=True)}

    def restore(self, physical: dict[int, int], devices: Sequence[pb.Device]) -> None:
        """Back to what ``physical`` and ``current()`` were before a ``move_to``."""
        self.physical = dict(physical)
        self.take(devices)


def same_places(old: Sequence[pb.Device], granted: Sequence[pb.Device]) -> list[pb.Device]:
    """For each of ``old``, the granted device at its place: the same local id on the host at the same position
    among the hosts (by host index). Raises if the grant is not of the same shape."""

    def hosts(devices: Sequence[pb.Device]) -> list[dict[int, pb.Device]]:
        by_host: dict[tuple[int, int], dict[int, pb.Device]] = {}
        for device in devices:
            by_host.setdefault((device.island, device.host_index), {})[device.local_id] = device
        return [by_host[key] for key in sorted(by_host)]

    before, after = hosts(old), hosts(granted)
    if [sorted(h) for h in before] != [sorted(h) for h in after]:
        raise Unavailable(
            f"the resource manager granted devices {sorted(d.id for d in granted)}, not of the shape of the "
            "session's; it stays suspended"
        )
    place = {id(device): index for index, host in enumerate(before) for device in host.values()}
    return [after[place[id(device)]][device.local_id] for device in old]


def colocated_device(device: pb.Device) -> pb.Device:
    """The CPU device colocated with ``device``, as a device of its own (on the same worker)."""
    cpu = pb.Device()
    cpu.CopyFrom(device)
    cpu.ClearField("colocated")
    cpu.id, cpu.local_id, cpu.kind = device.colocated.id, device.colocated.local_id, "cpu"
    cpu.memory_kinds[:] = device.colocated.memory_kinds
    cpu.local_hardware_id = device.colocated.local_hardware_id
    return cpu
