"""The executor's gRPC service: the worker sends a call, the executor runs it and answers.

Calls come one at a time, in the session's order (the worker sends the next once this one is
answered). The user's function may fail in any way; the answer then carries its message and the
remote traceback, and the executor keeps serving.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pathways_nb.colocated import arrays as colocated_arrays
from pathways_nb.colocated.executor.output import OutputChannel
from pathways_nb.colocated.executor.programs import ColocatedDevices, Programs, call, check_client_versions, make_args
from pathways_nb.core.convert import status_of
from pathways_nb.protocol.errors import InvalidRequest, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)


class ExecutorService(cluster_pb2_grpc.ColocatedExecutorServicer):
    """Runs one session's colocated programs on ``devices``; shard files live in ``directory``.

    What a call writes goes to ``output`` tagged with the call (its end tells the host that it has it all).
    """

    def __init__(self, devices: ColocatedDevices, directory: Path, output: OutputChannel):
        self.devices = devices
        self.directory = directory
        self.programs = Programs()
        self.output = output

    def Run(self, request: pb.ColocatedCall, context) -> pb.ColocatedResult:
        with self.output.call(request.call, request.name, request.context):
            return self._run(request)

    def _run(self, request: pb.ColocatedCall) -> pb.ColocatedResult:
        try:
            check_client_versions(
                {"python": request.client_python, "jax": request.client_jax, "cloudpickle": request.client_cloudpickle}
            )
            program = self.programs.get(request.program_digest, request.program, request.name)
            if len(request.args) != len(program.in_specs):
                raise InvalidRequest(f"{program.name} takes {len(program.in_specs)} arrays, got {len(request.args)}")
            leaves = [self._array(spec, arg) for spec, arg in zip(program.in_specs, request.args, strict=True)]
            args, kwargs = make_args(program, leaves)
            outputs = call(program, args, kwargs)
            return pb.ColocatedResult(results=[self._message(output) for output in outputs])
        except Exception as error:  # noqa: BLE001 - answered; the executor serves the next call
            return pb.ColocatedResult(error=status_of(as_request_error(error)))

    def _array(self, spec, message: pb.ColocatedArray):
        """An input as the function receives it: a jax array laid out as its spec says."""
        import jax

        kind = colocated_arrays.kind_of(np.dtype(spec.dtype))
        shape = tuple(spec.shape)
        if message.dtype_kind != kind:
            raise InvalidRequest(f"an input of dtype kind {message.dtype_kind} for the spec {spec}")
        singles = []
        for shard in message.shards:
            device = self.devices.by_cluster_id.get(shard.device_id)
            if device is None:
                raise InvalidRequest(f"device {shard.device_id} is not a colocated CPU device of this host")
            host = colocated_arrays.decode(shard, kind, self.directory, map_file=True)
            singles.append(jax.device_put(host, device))
        try:
            return jax.make_array_from_single_device_arrays(shape, spec.sharding, singles)
        except (ValueError, TypeError) as error:  # shards that do not make the spec's array
            raise InvalidRequest(f"the input shards do not make a {spec.dtype}{list(shape)} array: {error}") from None

    def _message(self, output) -> pb.ColocatedArray:
        """An output's shards on this host, for the worker."""
        return pb.ColocatedArray(
            dtype_kind=colocated_arrays.kind_of(np.dtype(output.dtype)),
            shape=output.shape,
            shards=[
                colocated_arrays.encode(self.devices.cluster_id(shard.device), np.asarray(shard.data), self.directory)
                for shard in output.addressable_shards
            ],
        )
