"""Arrays of an Orbax checkpoint on storage, written and read shard by shard with TensorStore.

The format is Orbax's own for a checkpoint saved without OCDBT (``use_ocdbt=False,
use_zarr3=False``, which ``CloudPathwaysArrayHandler`` records): each array is a zarr (v2) array
in ``<location>/<name>`` (``.zarray`` plus one file per chunk, ``<i>.<j>...``), zstd level 1,
``store_data_equal_to_fill_value``; stock Orbax restores it, and this module reads what stock
Orbax wrote, also with OCDBT or zarr3.

Memory stays bounded on the host: a shard goes to storage one chunk at a time, from a view of
the device buffer where the device is the host's own memory (CPU), and reads fetch one shard's
region at a time, so a host never stages a whole array, and holds at most ``tuning.CHECKPOINT_IN_FLIGHT_BYTES`` of
chunks (or one chunk, if larger) on their way.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pathways_nb.core import tuning
from pathways_nb.protocol.errors import DeadlineExceeded, NotFound, RequestError, as_request_error, error_for

# Orbax's defaults for zarr v2 (``tensorstore_utils._build_zarr2_metadata``).
ZARR_COMPRESSOR = {"id": "zstd", "level": 1}
OCDBT_MANIFEST = "manifest.ocdbt"


@dataclass(frozen=True)
class Deadline:
    """When a request's time is up."""

    at: float
    seconds: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise self._exceeded()
        return left

    def wait(self, future):
        """``future``'s result, or DEADLINE_EXCEEDED (the operation is cancelled)."""
        try:
            return future.result(timeout=min(self.remaining(), threading.TIMEOUT_MAX))
        except TimeoutError:
            future.cancel()
            raise self._exceeded() from None

    def _exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"did not finish within the request's timeout ({self.seconds:g} s)")


def kvstore(path: str) -> dict:
    """TensorStore's key-value store at ``path``, a directory under the storage root (``core.storage``).

    Cloud Storage is reached as directories too (Cloud Storage FUSE), never by TensorStore's own
    gcs driver, so that one storage root confines every write.
    """
    return {"driver": "file", "path": path}


def join(location: str, name: str) -> str:
    """The path of array ``name`` in the checkpoint directory ``location``."""
    return location.rstrip("/") + "/" + name


def chunk_shape(shard_shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """One chunk per shard, halved along its largest even dimension while too large (``CHECKPOINT_MAX_CHUNK_BYTES``)."""
    chunks = [max(d, 1) for d in shard_shape]
    while math.prod(chunks) * itemsize > tuning.CHECKPOINT_MAX_CHUNK_BYTES.value:
        even = [i for i, d in enumerate(chunks) if d % 2 == 0]
        if not even:
            break
        axis = max(even, key=lambda i: chunks[i])
        chunks[axis] //= 2
    return tuple(chunks)


def _ts():
    import tensorstore

    return tensorstore


def open_for_write(
    path: str, shape: Sequence[int], dtype: np.dtype, shard_shape: Sequence[int], create: bool, deadline
):
    """The zarr array at ``path``; ``create``: this host writes its metadata (``.zarray``), others assume it."""
    ts = _ts()
    spec = {
        "driver": "zarr",
        "kvstore": kvstore(path),
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "chunks": list(chunk_shape(shard_shape, dtype.itemsize)),
            "compressor": ZARR_COMPRESSOR,
        },
    }
    # Orbax saves into a fresh temporary directory, so there is nothing there to replace; the other
    # hosts write their chunks without waiting for the metadata.
    options = {"create": True, "open": True} if create else {"open": True, "assume_metadata": True}
    return deadline.wait(ts.open(spec, dtype=ts.dtype(dtype.name), **options))


def chunk_regions(region: Sequence[slice], chunks: Sequence[int]) -> Iterator[tuple[slice, ...]]:
    """``region`` (aligned to ``chunks``) cut into the chunks it covers, row-major."""
    ranges = [range(r.start, r.stop, c) for r, c in zip(region, chunks, strict=True)]
    for starts in _product(ranges):
        yield tuple(slice(s, min(s + c, r.stop)) for s, c, r in zip(starts, chunks, region, strict=True))


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (first, *rest)


def write_region(store, region: tuple[slice, ...], host_chunk: Callable[[tuple[slice, ...]], np.ndarray], deadline):
    """Writes ``region`` of ``store`` chunk by chunk, ``host_chunk(r)`` giving each chunk's values.

    At most ``tuning.CHECKPOINT_IN_FLIGHT_BYTES`` (or one chunk) are on their way at once; each write has
    finished on storage when this returns.
    """
    chunks = store.chunk_layout.write_chunk.shape or ()  # none for a scalar
    pending: list = []
    in_flight = 0
    for piece in chunk_regions(region, chunks):
        values = host_chunk(piece)
        pending.append((store[piece].write(values).commit, values.nbytes))
        in_flight += values.nbytes
        while pending and in_flight > tuning.CHECKPOINT_IN_FLIGHT_BYTES.value:
            future, nbytes = pending.pop(0)
            deadline.wait(future)
            in_flight -= nbytes
    for future, _nbytes in pending:
        deadline.wait(future)


def open_for_read(location: str, name: str, deadline):
    """The array ``name`` of the checkpoint in ``location``, whichever of Orbax's formats holds it."""
    ts = _ts()
    base = kvstore(location)
    if _exists(base, OCDBT_MANIFEST, deadline):
        directory = {**base, "path": base["path"].rstrip("/") + "/"}
        store_kv = {"driver": "ocdbt", "base": directory, "path": name}
    else:
        store_kv = kvstore(join(location, name))
    if _exists(store_kv, "zarr.json", deadline):
        driver = "zarr3"
    elif _exists(store_kv, ".zarray", deadline):
        driver = "zarr"
    else:
        raise NotFound(f"{location} holds no array {name!r} (no .zarray or zarr.json); was it saved there?")
    spec = {"driver": driver, "kvstore": store_kv, "recheck_cached_data": False, "recheck_cached_metadata": False}
    return deadline.wait(ts.open(spec, open=True, read=True))


def _exists(kv_spec: dict, key: str, deadline) -> bool:
    ts = _ts()
    directory = {**kv_spec, "path": kv_spec.get("path", "").rstrip("/") + "/"}
    store = deadline.wait(ts.KvStore.open(directory))
    return deadline.wait(store.read(key)).state == "value"


def cast(store, dtype: np.dtype):
    """``store`` read as ``dtype`` (a restore may ask for another dtype than was saved, as Orbax's does)."""
    return _ts().cast(store, _ts().dtype(dtype.name))


def read_region(store, region: tuple[slice, ...], deadline) -> np.ndarray:
    """The values of ``region`` of ``store``, in host memory of their own."""
    return deadline.wait(store[region].read())


def storage_error(error: BaseException, what: str) -> RequestError:
    """Any failure of ``what`` (e.g. "writing array 'w' in /ckpt on island 0 host 0") as a request error naming it.

    TensorStore's errors start with their status (``NOT_FOUND: ...``), which they keep.
    """
    failure = as_request_error(error)
    return error_for(failure.code, f"{what}: {failure.message}")
