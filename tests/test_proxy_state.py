"""The proxy session's pure state, driven directly: no servers, no streams, no threads (microseconds each)."""

from __future__ import annotations

import pytest

from pathways_nb.protocol.errors import NotFound, Unavailable
from pathways_nb.proxy.device_map import DeviceMap, same_places
from pathways_nb.rpc import cluster_pb2 as pb


def _device(device_id: int, island: int, host: int, local: int, colocated: int | None = None) -> pb.Device:
    device = pb.Device(
        id=device_id,
        island=island,
        host_index=host,
        local_id=local,
        worker_id=f"w{island}.{host}",
        worker_address=f"10.0.{island}.{host}:1",
        platform="cpu",
        kind="cpu",
        healthy=True,
    )
    if colocated is not None:
        device.colocated.id, device.colocated.local_id = colocated, 100 + local
    return device


def _two_islands() -> list[pb.Device]:
    """Islands 0 and 1, two hosts each, two devices per host; ids 0..7 in host order."""
    return [_device(4 * i + 2 * h + d, i, h, d) for i in (0, 1) for h in (0, 1) for d in (0, 1)]


def test_a_session_knows_its_devices_and_refuses_others_naming_its_own():
    devices = DeviceMap(_two_islands()[:4])
    assert devices.device_ids == (0, 1, 2, 3)
    assert devices.device(3).worker_id == "w0.1"
    assert devices.devices([1, 2]) == {1: devices.device(1), 2: devices.device(2)}
    with pytest.raises(NotFound, match="7"):
        devices.device(7)


def test_ordinals_count_from_zero_on_each_host_in_local_id_order():
    shuffled = [_device(10, 0, 0, 1), _device(11, 0, 0, 0), _device(12, 0, 1, 0)]
    devices = DeviceMap(shuffled)
    assert [devices.ordinal(d) for d in (10, 11, 12)] == [1, 0, 0]


def test_colocated_cpu_devices_are_devices_of_their_workers_with_their_devices_place():
    devices = DeviceMap([_device(0, 0, 0, 0, colocated=50), _device(1, 0, 0, 1, colocated=51), _device(2, 0, 1, 0)])
    assert devices.colocated_device_ids == (50, 51)
    cpu = devices.device(51)
    assert (cpu.kind, cpu.local_id, cpu.worker_id, cpu.HasField("colocated")) == ("cpu", 101, "w0.0", False)
    assert devices.ordinal(51) == devices.ordinal(1) == 1
    assert devices.colocation_id(51) == devices.colocation_id(1) == 1
    assert devices.colocation_id(2) is None
    assert devices.colocated_on("w0.0") == {100: 50, 101: 51}
    assert devices.colocated_on("w0.1") == {}


def test_a_workers_local_ids_translate_to_the_sessions_and_group_members_are_noted():
    devices = DeviceMap(_two_islands())
    assert devices.session_id_of("w1.1", 1) == 7
    assert devices.session_id_of("w1.1", 9) == -1
    member = pb.Device(id=7, worker_id="g0-1.m3", local_id=0)
    devices.note_members({7: member})
    assert devices.session_id_of("g0-1.m3", 0) == 7


def test_a_move_keeps_the_sessions_ids_and_points_them_at_the_granted_devices_at_the_same_places():
    devices = DeviceMap(_two_islands()[:4])
    granted = [_device(100 + d.id, 5, d.host_index, d.local_id) for d in _two_islands()[:4]]
    before_physical, before_devices = dict(devices.physical), devices.current()
    workers = devices.move_to(list(reversed(granted)))
    assert devices.device_ids == (0, 1, 2, 3)
    assert devices.physical_device_ids == (100, 101, 102, 103)
    assert devices.device(2).worker_id == "w5.1" and devices.device(2).id == 2
    assert {old: new.worker_id for old, new in workers.items()} == {"w0.0": "w5.0", "w0.1": "w5.1"}
    assert devices.session_id_of("w5.1", 1) == 3 and devices.session_id_of("w0.1", 1) == -1
    devices.restore(before_physical, before_devices)
    assert devices.physical_device_ids == (0, 1, 2, 3)
    assert devices.device(2).worker_id == "w0.1"


def test_a_grant_of_another_shape_is_refused_and_changes_nothing():
    devices = DeviceMap(_two_islands()[:4])
    one_host = [_device(100 + k, 5, 0, k) for k in range(4)]
    with pytest.raises(Unavailable, match="not of the shape"):
        devices.move_to(one_host)
    assert devices.physical_device_ids == (0, 1, 2, 3)
    assert devices.device(3).worker_id == "w0.1"


def test_same_places_orders_hosts_by_island_then_host_index():
    old = [_device(0, 0, 1, 0), _device(1, 0, 0, 0)]
    granted = [_device(20, 3, 7, 0), _device(21, 3, 2, 0)]
    assert [d.id for d in same_places(old, granted)] == [20, 21]
