"""Orbax persistence as plugin programs: checkpoints written and read by the hosts that hold the arrays.

With ``ENABLE_PATHWAYS_PERSISTENCE=1`` Orbax's ``CloudPathwaysArrayHandler`` saves and restores
``jax.Array`` leaves with two plugin programs (``core.persistence_requests`` reads them):

- ``bulk_persistence_write_request``: the arrays of one directory and one device assignment as
  arguments, no results. Each host writes the shards it holds (``worker.checkpoint_shards``), all
  hosts at once; the program's status resolves once every write has finished.
- ``bulk_persistence_read_request``: no arguments, one result per array, in the sharding the
  request names; each host reads the regions its devices need, whatever sharding was saved.

The proxy half (``plan``) checks the request against the session (its devices, the places
lexically) before any host sees it, and tells each host which of the session's devices are its
own, so that a host can place the pieces it gets (in its local device ids) in the global arrays.
The host half (``run``) checks the place again against its storage root, where the files are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways_nb.core import nonxla
from pathways_nb.core import persistence_requests as requests
from pathways_nb.core.persistence_requests import ArrayRequest
from pathways_nb.core.storage import check_location
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import Internal, InvalidRequest
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.worker import checkpoint_shards


@dataclass(frozen=True)
class HostRequest:
    """What every host of one execution gets: the client's request, and whose devices are whose."""

    arrays: list[ArrayRequest]
    # (island, host index) -> that host's devices among the plan's, in the plan's order (the
    # order in which the host is given its local ids).
    hosts: dict[tuple[int, int], list[int]]

    def encode(self, key: str, body: Any) -> bytes:
        hosts = [[island, host, ids] for (island, host), ids in self.hosts.items()]
        return json.dumps({"key": key, "body": body, "hosts": hosts}).encode()

    @classmethod
    def decode(cls, data: bytes) -> HostRequest:
        message = json.loads(data)
        hosts = {(island, host): ids for island, host, ids in message["hosts"]}
        return cls(requests.parse(message["key"], message["body"]), hosts)

    def global_ids(self, context: nonxla.HostContext, local_ids: Sequence[int]) -> dict[int, int]:
        """This host's local device ids -> the session's ids for them."""
        mine = self.hosts.get((context.island, context.host_index), [])
        if len(mine) != len(local_ids):
            raise Internal(
                f"island {context.island} host {context.host_index} was given devices {list(local_ids)}, "
                f"but the plan gives it {mine}"
            )
        return dict(zip(local_ids, mine, strict=True))


def _devices(arrays: list[ArrayRequest], session: nonxla.SessionView, key: str) -> tuple[int, ...]:
    """The devices every array of the request lives on (Orbax sends one request per device assignment)."""
    first = arrays[0].sharding.device_ids
    for array in arrays:
        if sorted(array.sharding.device_ids) != sorted(first):
            raise InvalidRequest(
                f"Bad PluginProgram: {key} puts {array.what} on devices {list(array.sharding.device_ids)} and "
                f"{arrays[0].what} on {list(first)}; one request's arrays share their devices"
            )
        check_location(_array_location(array))
    return session.check_devices(first, key)


def _array_location(array: ArrayRequest) -> str:
    """Where the array's files go: its own directory in the checkpoint's."""
    return array.location.rstrip("/") + "/" + array.name


def _where(context: nonxla.HostContext) -> str:
    return f"island {context.island} host {context.host_index}"


class _Persistence(nonxla.ProgramKind):
    """What both kinds' proxy halves do: check the arrays' devices and places, tell each host its devices."""

    kind = nonxla.PLUGIN
    verb = ""

    def plan(self, body: Any, session: nonxla.SessionView) -> nonxla.ProgramPlan:
        arrays = requests.parse(self.key, body)
        device_ids = _devices(arrays, session, self.key)
        hosts = {
            (host.island, host.host_index): [d for d in device_ids if d in host.device_ids]
            for host in session.hosts
            if set(host.device_ids) & set(device_ids)
        }
        return nonxla.ProgramPlan(
            kind=self.kind,
            key=self.key,
            name=f"checkpoint {self.verb} of {len(arrays)} array(s)",
            device_ids=device_ids,
            outputs=self.outputs(arrays),
            request=HostRequest(arrays, hosts).encode(self.key, body),
            num_args=self.num_args(arrays),
        )

    def outputs(self, arrays: list[ArrayRequest]) -> tuple[nonxla.OutputSpec, ...]:
        return ()

    def num_args(self, arrays: list[ArrayRequest]) -> int:
        return 0


class PersistenceWrite(_Persistence):
    """Saves: each host writes the shards of the arguments it holds."""

    key = requests.WRITE_KEY
    verb = "write"

    def num_args(self, arrays: list[ArrayRequest]) -> int:
        return len(arrays)

    def run(self, request, runtime, args, device_ids, results, context) -> list:
        host = HostRequest.decode(request)
        global_ids = host.global_ids(context, device_ids)
        for array, pieces in zip(host.arrays, args, strict=True):
            if not pieces:
                continue
            shards = {global_ids[s.device.id]: s.data for piece in pieces for s in piece.addressable_shards}
            location = context.storage.directory(_array_location(array)).parent
            checkpoint_shards.write(array, str(location), shards, np.dtype(pieces[0].dtype), _where(context))
        return []


class PersistenceRead(_Persistence):
    """Restores: each host reads the regions of the results its devices hold."""

    key = requests.READ_KEY
    verb = "read"

    def outputs(self, arrays: list[ArrayRequest]) -> tuple[nonxla.OutputSpec, ...]:
        return tuple(nonxla.OutputSpec(dtypes.from_numpy(a.dtype), a.shape, a.sharding) for a in arrays)

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
            location = context.storage.resolve(_array_location(array)).parent

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


WRITE = nonxla.register(PersistenceWrite())
READ = nonxla.register(PersistenceRead())
