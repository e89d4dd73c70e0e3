"""Colocated Python programs (``jax_colocated_python_v0.0.1`` custom calls): both halves, and the worker's part.

jax's ``colocated_python`` compiles a ``CustomCallProgram`` whose text is cloudpickle of the
function and its specialization, over colocated CPU devices (docs/colocated_python.md):

- the proxy half (``ColocatedPythonProgram.plan``) checks that the cluster runs colocated Python,
  that the program's devices are the session's colocated CPU devices, all of one host (each host
  runs its own executor), and takes its output specs as they are (a first, unspecialized call's
  specs program returns a string scalar);
- the host half (``run``) hands the program and this host's argument shards to the session's
  executor (``worker.executors``), and makes its results arrays of this worker again, on the same
  colocated CPU devices. Device ids: local on the worker's side, the cluster's on the executor's,
  as jax's pickled shardings name them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathways_nb.core import colocated_arrays, nonxla
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.string_arrays import StringArray
from pathways_nb.protocol import shardings
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.executors import ArrayShards, ColocatedHostLink, ResultShape

PROGRAM_TYPE = "jax_colocated_python_v0.0.1"
OFF = (
    "colocated Python is off on this cluster: start it with --colocated_python "
    "(pathways_nb.LocalCluster(colocated_python=True), pathways-nb up --colocated_python); "
    "docs/colocated_python.md says what a tenant can do with it"
)


class ColocatedPythonProgram(nonxla.ProgramKind):
    """``jax.experimental.colocated_python``'s programs, run in the session's executor of one host."""

    kind = nonxla.CUSTOM_CALL
    key = PROGRAM_TYPE

    def plan(self, body: Any, session: nonxla.SessionView) -> nonxla.ProgramPlan:
        name = body.name or "colocated_python"
        if not session.colocated_device_ids:
            raise FailedPrecondition(f"{name}: {OFF}")
        device_ids = tuple(body.devices.device_ids)
        unknown = [d for d in device_ids if d not in session.colocated_device_ids]
        if not device_ids or unknown:
            raise InvalidRequest(
                f"{name} runs on devices {list(device_ids)}; colocated Python runs on the session's colocated CPU "
                f"devices {list(session.colocated_device_ids)} (jax.experimental.colocated_python."
                "colocated_cpu_devices(jax.devices()))"
            )
        if len(set(device_ids)) != len(device_ids):
            raise InvalidRequest(f"{name} names a device twice: {list(device_ids)}")
        hosts = [h for h in session.hosts if set(h.colocated_device_ids) & set(device_ids)]
        if len(hosts) > 1:
            places = ", ".join(f"island {h.island} host {h.host_index}" for h in hosts)
            raise InvalidRequest(
                f"{name} runs on the colocated CPU devices of several hosts ({places}); each host runs the calls "
                "in its own executor here, so a call's arrays must all be on one host's colocated CPU devices: "
                "call the function once per host (e.g. one colocated_python_class object per island)"
            )
        for index, spec in enumerate(body.input_specs):
            _spec(spec, device_ids, f"input {index} of {name}")
        outputs = tuple(_spec(s, device_ids, f"output {index} of {name}") for index, s in enumerate(body.output_specs))
        versions = session.client_versions
        call = pb.ColocatedCall(
            name=name,
            program=body.serialized_program_text,
            client_python=versions.get("python", ""),
            client_jax=versions.get("jax", ""),
            client_cloudpickle=versions.get("cloudpickle", ""),
        )
        return nonxla.ProgramPlan(
            self.kind, self.key, name, device_ids, outputs, call.SerializeToString(), num_args=len(body.input_specs)
        )

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


def _spec(spec: Any, device_ids: tuple[int, ...], what: str) -> nonxla.OutputSpec:
    """An input or output spec of the program, checked: a dtype with a host form, on the program's devices."""
    colocated_arrays.dtype_of(spec.dtype.kind)
    sharding = shardings.from_proto(spec.sharding)
    outside = [d for d in sharding.device_ids if d not in device_ids]
    if outside:
        raise InvalidRequest(f"{what} lies on devices {outside}, outside the program's {list(device_ids)}")
    if any(d < 0 for d in spec.shape.dims):
        raise InvalidRequest(f"{what} has a negative dimension: {list(spec.shape.dims)}")
    return nonxla.OutputSpec(spec.dtype.kind, tuple(spec.shape.dims), sharding)


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


nonxla.register(ColocatedPythonProgram())
