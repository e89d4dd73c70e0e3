"""Colocated Python programs on this worker: its arrays in, the session's executor runs, its arrays out.

The arrays stay the worker's: a program's arguments are arrays on this host's colocated CPU
devices, whose shards go to the session's executor (``worker.executors``); its results come back
as shards and become arrays on the same devices. Device ids: the worker's own (local) ids on its
side, the cluster's on the executor's, which is how jax's pickled shardings name them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pathways_nb.core import colocated_arrays
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.worker.executors import ArrayShards, ColocatedHostLink
from pathways_nb.worker.runtime import LocalRuntime


class ColocatedPython:
    """This worker's colocated Python: its host's executors, and its colocated CPU devices' cluster ids."""

    def __init__(self, runtime: LocalRuntime, host_address: str, credentials: ClusterCredentials, describe: str):
        if not runtime.colocated_device_ids:
            raise ValueError("--colocated_python_host needs --colocated_python (the colocated CPU devices)")
        self.runtime = runtime
        self.host = ColocatedHostLink(host_address, credentials, describe)
        self._cluster_ids: dict[int, int] = {}  # local id -> cluster id

    def registered(self, cluster_ids: Sequence[int]) -> None:
        """The cluster ids the resource manager gave this worker's colocated CPU devices (in their order)."""
        local = self.runtime.colocated_device_ids
        if len(cluster_ids) != len(local):
            raise ValueError(f"{len(cluster_ids)} colocated device ids registered for {len(local)} devices")
        self._cluster_ids = dict(zip(local, cluster_ids, strict=True))

    def run(
        self,
        session: str,
        tenant: str,
        name: str,
        text: bytes,
        client: dict[str, str],
        args: Sequence,
        results: Sequence[tuple[int, tuple[int, ...], IfrtSharding]],
    ) -> list:
        """Runs one program in the session's executor: ``args`` are arrays on this host's colocated devices,
        ``results`` (dtype kind, shape, sharding in local ids) say what comes back."""
        import hashlib

        if not self._cluster_ids:
            raise FailedPrecondition("this worker has not registered its colocated CPU devices yet; try again")
        executor = self.host.executor(session, tenant, list(self._cluster_ids.values()))
        outputs = executor.run(name, hashlib.sha256(text).digest(), text, [self._shards(a) for a in args], client)
        if len(outputs) != len(results):
            raise InvalidRequest(f"{name} returned {len(outputs)} arrays, its output specs say {len(results)}")
        return [self._array(output, *result) for output, result in zip(outputs, results, strict=True)]

    def _shards(self, array) -> ArrayShards:
        shards = {}
        for shard in array.addressable_shards:
            cluster_id = self._cluster_ids.get(shard.device.id)
            if cluster_id is None:
                raise InvalidRequest(
                    f"an argument lives on {shard.device}, not on a colocated CPU device: "
                    "put it there first (jax.device_put(x, colocated_cpu_devices(...)))"
                )
            shards[cluster_id] = np.asarray(shard.data)
        return ArrayShards(colocated_arrays.kind_of(np.dtype(array.dtype)), tuple(array.shape), shards)

    def _array(self, output: ArrayShards, kind: int, shape: tuple[int, ...], sharding: IfrtSharding):
        if output.kind != kind or output.shape != tuple(shape):
            raise InvalidRequest(
                f"a result of kind {output.kind} {list(output.shape)}; the output spec says kind {kind} {list(shape)}"
            )
        try:
            shards = [output.shards[self._cluster_ids[local]] for local in self.runtime.local_part(sharding).device_ids]
        except KeyError as missing:
            raise InvalidRequest(f"the executor returned no shard for device {missing}") from None
        return self.runtime.put_shards(tuple(shape), sharding, shards)

    def end_session(self, session: str) -> None:
        """The session ended here: its executor stops."""
        self.host.end_session(session)

    def close(self) -> None:
        self.host.close()
