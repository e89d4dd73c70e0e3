"""Colocated Python's proxy half: a ``jax_colocated_python_v0.0.1`` custom call checked and planned.

jax's ``colocated_python`` compiles a ``CustomCallProgram`` whose text is cloudpickle of the
function and its specialization, over colocated CPU devices (docs/colocated_python.md). The proxy
half (``ColocatedPythonPlanner.plan``, on the proxy's compile pool) checks that the cluster runs
colocated Python, that the program's devices are the session's colocated CPU devices, all of one
host (each host runs its own executor), and takes its output specs as they are (a first,
unspecialized call's specs program returns a string scalar). Each execution sends the hosts a
``ColocatedCall``; the host half is ``colocated.worker``.
"""

from __future__ import annotations

from typing import Any

from pathways_nb.colocated import OFF, PROGRAM_TYPE
from pathways_nb.colocated import arrays as colocated_arrays
from pathways_nb.core import nonxla
from pathways_nb.protocol import shardings
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest
from pathways_nb.rpc import cluster_pb2 as pb


class ColocatedPythonPlanner(nonxla.ProxyHalf):
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
