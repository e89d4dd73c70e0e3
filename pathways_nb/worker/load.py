"""What a worker tells the resource manager about its load: sessions, arrays, memory in use.

Counting the arrays walks every live array (about 9 µs each here), so a worker
holding many of them waits a hundred times as long as its last count took
before the next one: the reports cost it at most 1% of a core, whatever it
holds. The resource manager is told only what changed (``worker.server``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pathways_nb.core import tuning
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.runtime import LocalRuntime


class LoadGauge:
    """Measures the load of the worker serving ``runtime``'s devices; ``counts()``: its open sessions and their
    arrays (blocks)."""

    def __init__(self, runtime: LocalRuntime, counts: Callable[[], tuple[int, int]]):
        self._runtime = runtime
        self._counts = counts
        self._took_s = 0.0

    def measure(self) -> pb.WorkerLoad:
        """The load now (blocks: a thread of the worker's liveness, never its loop)."""
        started = time.perf_counter()
        arrays = self._runtime.client.live_arrays()
        sessions, session_arrays = self._counts()
        load = pb.WorkerLoad(
            sessions=sessions,
            session_arrays=session_arrays,
            arrays=len(arrays),
            array_bytes=sum(array.nbytes for array in arrays),
            device_bytes=_device_bytes(self._runtime),
        )
        self._took_s = time.perf_counter() - started
        return load

    def wait_s(self, interval_s: float) -> float:
        """How long to wait before the next measurement, at least ``interval_s``."""
        return max(interval_s, self._took_s / tuning.LOAD_MEASURE_SHARE.value)


def _device_bytes(runtime: LocalRuntime) -> list[int]:
    """Bytes in use per local device as the platform reports them; empty if it does not (CPU)."""
    stats = [device.memory_stats() for device in runtime.devices]
    if not all(stats):
        return []
    return [int(s.get("bytes_in_use", 0)) for s in stats]
