"""A suspended session's arrays in this host's memory (or on its disk), and their way back onto the devices.

Suspending a session gives its devices to another (docs/design.md, "Suspending and resuming
sessions"): each of its arrays is copied off its devices shard by shard, and its device buffers are
freed once nothing reads them (a CPU device's buffers are this host's memory already: they are kept as
they are, without a copy). A host keeps up to its budget of suspended bytes in memory
(``--suspend_memory_budget``); shards beyond it are written to files under the storage root, and read
back on resume. Resuming puts each shard back on the device it came from, with the sharding (and
memory kind) it had, so the session's programs, compiled for those devices, run on them unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pathways_nb.core.dataflow import ArrayRecord
from pathways_nb.protocol.errors import InvalidRequest


class HostBudget:
    """The bytes of suspended arrays this host keeps in memory; what does not fit goes to files under
    ``spill_root`` (a directory per session).

    ``limit`` None: no limit. Shared by the host's sessions. The bytes in use are the budget's own thread's:
    copies (on the worker's pool) ask it for room (``take`` waits for its answer), and copies are let go on it,
    in order (freeing a big buffer or unlinking a big file is a wait the loop must not have).
    """

    def __init__(self, limit: int | None, spill_root: Path | None = None):
        if limit is not None and (limit < 0 or spill_root is None):
            raise ValueError(f"a budget of {limit} bytes is not 0 or more with a directory to spill to")
        self.limit = limit
        self._spill_root = spill_root
        self._used = 0
        self._names = itertools.count()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pathways-suspended-release")

    def take(self, nbytes: int) -> bool:
        """Counts ``nbytes`` as kept in memory, if they fit (blocks: a pool thread asks the budget's thread)."""
        return self._thread.submit(self._take, nbytes).result()

    def _take(self, nbytes: int) -> bool:
        if self.limit is not None and self._used + nbytes > self.limit:
            return False
        self._used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Memory of ``nbytes`` is free again (on the budget's thread)."""
        self._used -= nbytes

    def used(self) -> int:
        """Bytes in memory now (blocks: asks the budget's thread)."""
        return self._thread.submit(lambda: self._used).result()

    def spill_file(self, session: str) -> Path:
        """A new file for one shard of ``session`` (its directory made when first needed)."""
        directory = self._spill_root / session
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"{next(self._names)}.npy"

    def release_later(self, shards: list[_Shard]) -> None:
        """Lets go of ``shards`` for one copy (see ``_Shard.release``), soon, after what was let go before."""
        self._thread.submit(lambda: [shard.release(self) for shard in shards])

    def forget(self, session: str) -> None:
        """Removes the session's directory (its files went with its arrays, or go first), if it has one."""
        if self._spill_root is not None:
            self._thread.submit(_remove_directory, self._spill_root / session)


def _remove_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        directory.rmdir()


class _Shard:
    """One device buffer off its device: in memory, or in a file; shared by the copies of every array that used it
    (an array and the single-device arrays taken apart from it share their buffers, and keep sharing them).

    Its count of users is made by the pool thread that copies (``to_host``), then is the budget's thread's.
    """

    __slots__ = ("host", "nbytes", "path", "sharding", "users")

    def __init__(self, data: Any, budget: HostBudget, session: str):
        self.sharding, self.nbytes, self.users = data.sharding, data.nbytes, 0
        if budget.take(data.nbytes):
            # A CPU device's memory is this host's: a view keeps the buffer as it is, and the resume puts it back
            # without a copy. Any other device's is copied, which frees the device's memory.
            on_cpu = next(iter(data.devices())).platform == "cpu"
            self.host, self.path = (np.asarray(data) if on_cpu else np.array(data, copy=True)), None
        else:
            self.host, self.path = None, budget.spill_file(session)
            np.save(self.path, np.asarray(data), allow_pickle=False)

    def read(self) -> np.ndarray:
        return self.host if self.path is None else np.load(self.path)

    def release(self, budget: HostBudget) -> None:
        """One copy less uses it: the last one frees its memory or removes its file (on the budget's thread)."""
        self.users -= 1
        if self.users:
            return
        if self.path is None:
            budget.give(self.nbytes)
            self.host = None
        else:
            self.path.unlink(missing_ok=True)


class HostCopy:
    """One array's addressable shards off the devices, with what it takes to make the array again.

    Made on the pool (``to_host``), then the worker's loop's: a copy that a resume or a move reads on the pool is
    kept for that read (``keep_for_read``, on the loop) and the loop is told when it is done (``read_done``): the
    session's client may let its array go meanwhile, and the copy then goes once the read is done.
    """

    __slots__ = ("_budget", "_delete_when_read", "_deleted", "_reads", "shape", "sharding", "shards")

    def __init__(self, value: Any, budget: HostBudget, shards: list[_Shard]):
        self.shape = value.shape
        self.sharding = value.sharding
        self._budget = budget
        self._deleted = self._delete_when_read = False
        self._reads = 0
        self.shards = shards
        for shard in shards:
            shard.users += 1

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def spilled_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards if shard.path is not None)

    def shard_devices(self) -> list[int]:
        """The device of each shard, in order (their ids on this host, which ``from_shards`` reads elsewhere)."""
        return [next(iter(shard.sharding.device_set)).id for shard in self.shards]

    def shard_arrays(self) -> list[np.ndarray]:
        """The shards' values, in order (blocks: a spilled one is read back)."""
        return [shard.read() for shard in self.shards]

    def packed(self) -> np.ndarray:
        """The shards' bytes one after the other."""
        parts = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in self.shard_arrays()]
        return np.concatenate(parts) if parts else np.empty(0, np.uint8)

    # As a record's value while the session is suspended: deletable, like the device array it replaces.
    def is_deleted(self) -> bool:
        return self._deleted

    def delete(self) -> None:
        if self._deleted:
            return
        self._deleted = True
        if self._reads:
            self._delete_when_read = True
            return
        self._release_shards()

    def keep_for_read(self) -> None:
        """Keeps the shards for a read that starts later, on another thread, until ``read_done``."""
        self._reads += 1

    def read_done(self) -> None:
        self._reads -= 1
        if not self._reads and self._delete_when_read:
            self._release_shards()

    def _release_shards(self) -> None:
        shards, self.shards = self.shards, []
        self._budget.release_later(shards)


def movable(record: ArrayRecord) -> bool:
    """Whether ``record`` holds a device array to move (not a token, a host string array, a failure or a deletion)."""
    value = record.value
    return record.error is None and not record.is_deleted and hasattr(value, "addressable_shards")


def to_host(records: Sequence[ArrayRecord], budget: HostBudget, session: str) -> list[HostCopy]:
    """Host copies of ``records``' values (blocks until each is computed), one per device buffer however many
    arrays share it; each read guards its value."""
    buffers: dict[tuple[int, int], _Shard] = {}

    def shard_of(data: Any) -> _Shard:
        key = (next(iter(data.devices())).id, data.unsafe_buffer_pointer())
        if key not in buffers:
            buffers[key] = _Shard(data, budget, session)
        return buffers[key]

    def copy(value: Any) -> HostCopy:
        return HostCopy(value, budget, [shard_of(shard.data) for shard in value.addressable_shards])

    return [record.read(copy) for record in records]


def from_shards(runtime: Any, data: Any, meta: Any, shard_devices: Sequence[int]) -> Any:
    """The array ``meta`` describes (its part on this host), from ``data``: its shards' bytes one after the other, for
    ``shard_devices`` in order (a session moved here from a host of the same shape: ``HostCopy.packed``). Blocks."""
    import jax

    from pathways_nb.core.convert import sharding_from_proto
    from pathways_nb.protocol import dtypes

    shape, dtype = tuple(meta.shape), dtypes.to_numpy(meta.dtype_kind)
    sharding = sharding_from_proto(meta.sharding)
    shard_shape = runtime.jax_sharding(sharding).shard_shape(shape)
    nbytes = math.prod(shard_shape) * dtype.itemsize
    flat = np.frombuffer(data, np.uint8)
    if flat.nbytes != nbytes * len(shard_devices):
        raise InvalidRequest(f"{flat.nbytes} bytes arrived for {len(shard_devices)} shards of {nbytes} bytes")
    singles = {}
    for index, device_id in enumerate(shard_devices):
        host = flat[index * nbytes : (index + 1) * nbytes].view(dtype).reshape(shard_shape)
        target = jax.sharding.SingleDeviceSharding(runtime.device(device_id), memory_kind=sharding.memory_kind or None)
        singles[device_id] = jax.device_put(host, target)
    return runtime.assemble(shape, sharding, [singles[d] for d in runtime.local_part(sharding).device_ids])


def to_devices(copies: Sequence[HostCopy]) -> list[Any]:
    """The device arrays of ``copies`` again (blocks while they move), sharing buffers as they did."""
    import jax

    placed: dict[int, Any] = {}

    def single(shard: _Shard) -> Any:
        if id(shard) not in placed:
            placed[id(shard)] = jax.device_put(shard.read(), shard.sharding)
        return placed[id(shard)]

    return [
        jax.make_array_from_single_device_arrays(copy.shape, copy.sharding, [single(s) for s in copy.shards])
        for copy in copies
    ]
