"""Orbax persistence's host halves: checkpoints written and read by the hosts that hold the arrays.

With ``ENABLE_PATHWAYS_PERSISTENCE=1`` Orbax saves and restores ``jax.Array`` leaves with two
plugin programs, checked and planned by their proxy halves (``proxy/persistence.py``); each host
gets the request and which of the session's devices are its own (``core.persistence_requests.HostRequest``):

- ``bulk_persistence_write_request``: each host writes the shards it holds
  (``worker.checkpoint_shards``), all hosts at once; the program's status resolves once every
  write has finished.
- ``bulk_persistence_read_request``: each host reads the regions its devices need, whatever
  sharding was saved.

A host checks the place again against its storage root, where the files are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pathways_nb.core import nonxla
from pathways_nb.core import persistence_requests as requests
from pathways_nb.core.persistence_requests import ArrayRequest, HostRequest
from pathways_nb.protocol.errors import Internal
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.worker import checkpoint_shards


def _where(context: nonxla.HostContext) -> str:
    return f"island {context.island} host {context.host_index}"


class PersistenceWriteHost(nonxla.HostHalf):
    """Saves: each host writes the shards of the arguments it holds."""

    kind = nonxla.PLUGIN
    key = requests.WRITE_KEY

    def run(self, request, runtime, args, device_ids, results, context) -> list:
        host = HostRequest.decode(request)
        global_ids = host.global_ids(context, device_ids)
        for array, pieces in zip(host.arrays, args, strict=True):
            if not pieces:
                continue
            shards = {global_ids[s.device.id]: s.data for piece in pieces for s in piece.addressable_shards}
            location = context.storage.directory(array.place).parent
            checkpoint_shards.write(array, str(location), shards, np.dtype(pieces[0].dtype), _where(context))
        return []


class PersistenceReadHost(nonxla.HostHalf):
    """Restores: each host reads the regions of the results its devices hold."""

    kind = nonxla.PLUGIN
    key = requests.READ_KEY

    def run(self, request, runtime, args, device_ids, results, context) -> list:
        host = HostRequest.decode(request)
        global_ids = host.global_ids(context, device_ids)
        local_ids = {g: local for local, g in global_ids.items()}
        values = []
        specs = iter(results)
        for array in host.arrays:
            mine = [d for d in array.sharding.device_ids if d in local_ids]
            if not mine:
                continue
            location = context.storage.resolve(array.place).parent

            def place(host_values: np.ndarray, device_id: int) -> Any:
                return runtime.put(host_values, IfrtSharding((local_ids[device_id],)))

            singles = checkpoint_shards.read(array, str(location), mine, place, _where(context))
            values.extend(_results(array, mine, singles, specs, runtime, local_ids))
        return values


def _results(array: ArrayRequest, mine: list[int], singles: dict, specs, runtime, local_ids) -> list:
    """This host's results for ``array``: one array over its devices, or (across islands) one per device."""
    spec = next(specs, None)
    if spec is None:
        raise Internal(f"{array.what}: this host holds devices {mine} of it but was given no result to fill")
    if spec.sharding.is_single_device and len(array.sharding.device_ids) > 1:
        # Across islands each device's shard is a result of its own (as the cluster lays such arrays out).
        for _ in mine[1:]:
            next(specs)
        return [singles[device_id] for device_id in mine]
    local_part = runtime.local_part(spec.sharding).device_ids
    by_local = {local_ids[d]: single for d, single in singles.items()}
    return [runtime.assemble(array.shape, spec.sharding, [by_local[local] for local in local_part])]
