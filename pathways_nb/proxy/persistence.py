"""Orbax persistence's proxy halves: a checkpoint write or read checked and planned before any host sees it.

With ``ENABLE_PATHWAYS_PERSISTENCE=1`` Orbax's ``CloudPathwaysArrayHandler`` saves and restores
``jax.Array`` leaves with two plugin programs (``core.persistence_requests`` reads them):
``bulk_persistence_write_request`` (the arrays of one directory and one device assignment as
arguments, no results) and ``bulk_persistence_read_request`` (no arguments, one result per array,
in the sharding the request names). The proxy half checks the request against the session (its
devices, the places lexically) and tells each host which of the session's devices are its own, so
that a host can place the pieces it gets (in its local device ids) in the global arrays; the
hosts' halves (``worker/persistence.py``) write and read the files.
"""

from __future__ import annotations

from typing import Any

from pathways_nb.core import nonxla
from pathways_nb.core import persistence_requests as requests
from pathways_nb.core.persistence_requests import ArrayRequest, HostRequest
from pathways_nb.core.storage import check_location
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import InvalidRequest


def _devices(arrays: list[ArrayRequest], session: nonxla.SessionView, key: str) -> tuple[int, ...]:
    """The devices every array of the request lives on (Orbax sends one request per device assignment)."""
    first = arrays[0].sharding.device_ids
    for array in arrays:
        if sorted(array.sharding.device_ids) != sorted(first):
            raise InvalidRequest(
                f"Bad PluginProgram: {key} puts {array.what} on devices {list(array.sharding.device_ids)} and "
                f"{arrays[0].what} on {list(first)}; one request's arrays share their devices"
            )
        check_location(array.place)
    return session.check_devices(first, key)


class _PersistencePlanner(nonxla.ProxyHalf):
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


class PersistenceWritePlanner(_PersistencePlanner):
    """Saves: the arrays are the arguments; no results."""

    key = requests.WRITE_KEY
    verb = "write"

    def num_args(self, arrays: list[ArrayRequest]) -> int:
        return len(arrays)


class PersistenceReadPlanner(_PersistencePlanner):
    """Restores: one result per array, in the sharding the request names."""

    key = requests.READ_KEY
    verb = "read"

    def outputs(self, arrays: list[ArrayRequest]) -> tuple[nonxla.OutputSpec, ...]:
        return tuple(nonxla.OutputSpec(dtypes.from_numpy(a.dtype), a.shape, a.sharding) for a in arrays)
