"""Colocated Python's host half, on a worker: a call handed to the session's executor of this host.

The proxy half (``colocated.proxy``) checked the call and sent this host a ``ColocatedCall``; the
host half (``ColocatedPythonHost.run``) hands the program and this host's argument shards to the
session's executor (``colocated.executors``), and makes its results arrays of this worker again, on
the same colocated CPU devices. Device ids: local on the worker's side, the cluster's on the
executor's, as jax's pickled shardings name them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathways_nb.colocated import OFF, PROGRAM_TYPE
from pathways_nb.colocated import arrays as colocated_arrays
from pathways_nb.colocated.executors import ArrayShards, ColocatedHostLink, ResultShape
from pathways_nb.core import nonxla
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.string_arrays import StringArray
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest
from pathways_nb.rpc import cluster_pb2 as pb


class ColocatedPythonHost(nonxla.HostHalf):
    """Runs a call in this host's executor of the session (``ColocatedPython.run``)."""

    kind = nonxla.CUSTOM_CALL
    key = PROGRAM_TYPE

    def run(
        self,
        request: bytes,
        runtime: Any,
        args: Sequence[Sequence[Any]],
        device_ids: tuple[int, ...],
        results: Sequence[nonxla.ResultSpec],
        context: nonxla.HostContext,
    ) -> list:
        colocated = context.colocated
        if colocated is None:
            raise FailedPrecondition(f"this worker runs no executors (no --colocated_python_host): {OFF}")
        try:
            call = pb.ColocatedCall.FromString(request)
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise InvalidRequest(f"a malformed colocated Python call ({error})") from None
        return colocated.run(context, call, args, results)


class ColocatedPython:
    """This worker's colocated Python: its host's executors, and its colocated CPU devices' cluster ids."""

    def __init__(self, runtime: Any, host_address: str, credentials: ClusterCredentials, describe: str):
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
        context: nonxla.HostContext,
        call: pb.ColocatedCall,
        args: Sequence[Sequence[Any]],
        results: Sequence[nonxla.ResultSpec],
    ) -> list:
        """Runs one call in the executor of ``context``'s session: ``args`` (per argument, this host's pieces
        of it, on its colocated CPU devices) in; one value per entry of ``results`` out. What it writes goes
        to ``context.output``, tagged with ``context.output_context``."""
        if not self._cluster_ids:
            raise FailedPrecondition("this worker has not registered its colocated CPU devices yet; try again")
        ids = context.session_device_ids or self._cluster_ids  # the ids the session knows them by
        executor = self.host.executor(context.session, context.tenant, list(ids.values()), context.output)
        versions = {"python": call.client_python, "jax": call.client_jax, "cloudpickle": call.client_cloudpickle}
        digest = hashlib.sha256(call.program).digest()
        expected = [ResultShape(r.kind, tuple(r.shape), r.sharding.shard_shape(tuple(r.shape))) for r in results]
        arguments = [self._shards(pieces, ids) for pieces in args]
        outputs = executor.run(call.name, digest, call.program, arguments, expected, versions, context.output_context)
        return [self._value(output, result, ids) for output, result in zip(outputs, results, strict=True)]

    def _shards(self, pieces: Sequence[Any], ids: dict[int, int]) -> ArrayShards:
        """One argument's shards on this host, by the session's ids of their devices (``ids``: local -> those)."""
        shards, kinds = {}, set()
        for piece in pieces:
            if isinstance(piece, StringArray):
                raise InvalidRequest("colocated Python takes no string arrays as arguments here")
            kinds.add(colocated_arrays.kind_of(np.dtype(piece.dtype)))
            for shard in piece.addressable_shards:
                cluster_id = ids.get(shard.device.id)
                if cluster_id is None:
                    raise InvalidRequest(
                        f"an argument lives on {shard.device}, not on a colocated CPU device: put it there first "
                        "(jax.device_put(x, colocated_cpu_devices(...)))"
                    )
                shards[cluster_id] = np.asarray(shard.data)
        if len(kinds) != 1:
            raise InvalidRequest(f"an argument whose pieces have {len(kinds)} dtypes")
        return ArrayShards(kinds.pop(), tuple(pieces[0].shape) if len(pieces) == 1 else (), shards)

    def _value(self, output: ArrayShards, result: nonxla.ResultSpec, ids: dict[int, int]):
        """A result as this worker holds it: a string array, or an array on its colocated CPU devices."""
        local_ids = self.runtime.local_part(result.sharding).device_ids
        try:
            shards = [output.shards[ids[local]] for local in local_ids]
        except KeyError as missing:
            raise InvalidRequest(f"the executor returned no shard for device {missing}") from None
        if result.kind == colocated_arrays.STRING_KIND:  # strings are host values here (core.string_arrays)
            return StringArray(tuple(result.shape), [str(s) for s in np.asarray(shards[0]).reshape(-1)])
        return self.runtime.put_shards(tuple(result.shape), result.sharding, shards)

    def end_session(self, session: str) -> None:
        """The session ended here: its executor stops."""
        self.host.end_session(session)

    def close(self) -> None:
        self.host.close()
