"""One host's part of a checkpoint write or read: the shards it holds, or the shards its devices need.

Each host decides alone, from the request, what is its to do, so hosts work in parallel with no
coordination: a region of an array held by several devices (a replicated shard) is written once,
by the first device in the sharding's order that holds it; the host that writes the array's first
region also writes its metadata (``.zarray``), and the others write their chunks assuming it.
Reads bring each region a device of this host needs from storage, whatever sharding the array was
saved with: a region read once serves every local device that needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pathways_nb.core.persistence_requests import ArrayRequest
from pathways_nb.protocol.errors import FailedPrecondition
from pathways_nb.worker import checkpoint_arrays as storage

Region = tuple[slice, ...]


def regions(array: ArrayRequest) -> list[Region]:
    """The region of the array each device of the request's sharding holds, in its device order, as plain bounds."""
    return [
        tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, array.shape, strict=True))
        for index in array.sharding.shard_indices(array.shape)
    ]


def _key(region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in region)


def writers(array: ArrayRequest) -> list[tuple[int, Region]]:
    """Each distinct region of the array with the device that writes it (its first holder), first region first."""
    chosen: dict[tuple, tuple[int, Region]] = {}
    for device_id, region in zip(array.sharding.device_ids, regions(array), strict=True):
        chosen.setdefault(_key(region), (device_id, region))
    return list(chosen.values())


def write(array: ArrayRequest, location: str, shards: Mapping[int, object], dtype: np.dtype, host: str) -> int:
    """Writes the regions of ``array`` this host's shards (device id -> single-device array) are to write.

    ``location`` is the checkpoint's directory on this host's storage (the request's, mapped).
    Returns the bytes written. Each shard is read from the device as a host view where the
    device's memory is the host's own (CPU), one copy of one shard elsewhere; it goes to
    storage chunk by chunk. Fails with the array and ``host`` named.
    """
    what = f"writing {array.what} on {host}"
    mine = [(i, device_id, region) for i, (device_id, region) in enumerate(writers(array)) if device_id in shards]
    if not mine:
        return 0
    deadline = storage.Deadline.after(array.timeout_s)
    shard_shape = array.sharding.shard_shape(array.shape)
    written = 0
    try:
        store = storage.open_for_write(
            storage.join(location, array.name), array.shape, dtype, shard_shape, mine[0][0] == 0, deadline
        )
        for _index, device_id, region in mine:
            host_shard = np.asarray(shards[device_id])
            if host_shard.shape != tuple(s.stop - s.start for s in region):
                raise FailedPrecondition(
                    f"the shard on device {device_id} is {list(host_shard.shape)}, where the request's "
                    f"sharding gives it {[s.stop - s.start for s in region]}"
                )
            if host_shard.size:
                storage.write_region(
                    store, region, lambda piece, r=region, h=host_shard: h[_within(piece, r)], deadline
                )
            written += host_shard.nbytes
    except Exception as error:  # noqa: BLE001 - reported with the array and the host named
        raise storage.storage_error(error, what) from None
    return written


def _within(piece: Region, region: Region) -> Region:
    """``piece`` of the array as a region of the shard that holds ``region``."""
    return tuple(slice(p.start - r.start, p.stop - r.start) for p, r in zip(piece, region, strict=True))


def read(array: ArrayRequest, location: str, device_ids: Sequence[int], place, host: str) -> dict[int, object]:
    """Each of ``device_ids`` (this host's devices in the request's sharding) given its region of the array.

    ``place(values, device_id)`` puts host values on a device. The array is read in the
    request's dtype (converted if it was saved in another), and must have the request's shape.
    """
    what = f"reading {array.what} on {host}"
    deadline = storage.Deadline.after(array.timeout_s)
    by_device = dict(zip(array.sharding.device_ids, regions(array), strict=True))
    placed: dict[int, object] = {}
    try:
        store = storage.open_for_read(location, array.name, deadline)
        if tuple(store.shape) != array.shape:
            raise FailedPrecondition(
                f"the checkpoint holds an array of shape {list(store.shape)}, the restore asks for "
                f"{list(array.shape)}; restore with the saved shape"
            )
        if store.dtype.numpy_dtype != array.dtype:
            store = storage.cast(store, array.dtype)
        held_key, held = None, None  # one region in host memory at a time
        for device_id in sorted(device_ids, key=lambda d: _key(by_device[d])):
            region = by_device[device_id]
            if _key(region) != held_key:
                held = None  # the last region goes before the next is read
                held, held_key = storage.read_region(store, region, deadline), _key(region)
            placed[device_id] = place(held, device_id)
    except Exception as error:  # noqa: BLE001 - reported with the array and the host named
        raise storage.storage_error(error, what) from None
    return placed
