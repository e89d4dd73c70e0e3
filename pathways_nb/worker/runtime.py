"""The XLA devices of one process: what a worker (and the single-process proxy) runs on.

``LocalRuntime`` wraps the process's own jaxlib client: it compiles StableHLO
for a list of its devices, turns host bytes into device arrays, runs programs
and reads arrays back. Arrays are ``jax.Array`` values, which are futures
already: ``execute`` returns before the device has finished, and a failure
inside XLA surfaces when the result is read. It relies on jaxlib internals
(``compile_and_load``, ``execute_sharded``, result handlers), which is why the
server pins jaxlib.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from pathways_nb.compat import result_handlers
from pathways_nb.core.convert import output_shardings as output_shardings_of
from pathways_nb.core.events import EventSink, ExecutionTimer
from pathways_nb.core.runtime_api import (
    ArgumentFacts,
    Aval,
    DeviceDescription,
    ProgramInfo,
    check_arguments,
    check_assemble_parts,
    check_sharding,
    describe_device,
)
from pathways_nb.core.string_arrays import StringArray
from pathways_nb.protocol import op_sharding, schema
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, NotFound, ResourceExhausted
from pathways_nb.protocol.layouts import ROW_MAJOR_PLATFORMS, row_major
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.worker import jaxlib_kernels
from pathways_nb.worker import signature as program_signature
from pathways_nb.worker.island import IslandMembership
from pathways_nb.worker.program_check import ProgramChecker

_LOGGER = logging.getLogger(__name__)

MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
# The kind of a colocated-Python worker's CPU devices that are not colocated ones. jax pairs a device
# with the device of kind "cpu" that shares its colocation_id (colocated_cpu_devices), so the devices
# that stand for accelerators must have another kind, or each would pair with itself as well.
CPU_ACCELERATOR_KIND = "cpu accelerator"


def configure_jax(platform: str | None, num_devices: int | None) -> None:
    """Points this process's JAX at local devices (never at a proxy) before first use."""
    import jax

    if platform in (None, "", "auto"):
        platform = ""
    if "proxy" in platform.split(","):
        raise ValueError("a worker runs on local devices; choose cpu, cuda, rocm or tpu, not proxy")
    os.environ.pop("JAX_BACKEND_TARGET", None)
    jax.config.update("jax_platforms", platform or None)
    if num_devices is not None:
        jax.config.update("jax_num_cpu_devices", num_devices)


@dataclass(frozen=True, eq=False)
class Program(ProgramInfo):
    """A program compiled on this process's devices."""

    executable: object = None  # jaxlib LoadedExecutable
    result_handlers: tuple = ()


class LocalRuntime:
    """This process's XLA devices, addressed by their jaxlib device ids.

    With ``colocated_python``, every device has a CPU device beside it (``colocated_devices``, in
    the same order) for the arrays of the user's Python (``jax.experimental.colocated_python``).
    Only CPU workers have them yet: they are more devices of the same CPU client.
    """

    def __init__(
        self,
        platform: str | None = None,
        num_devices: int | None = None,
        island: IslandMembership | None = None,
        colocated_python: bool = False,
    ):
        if colocated_python and platform != "cpu":
            raise ValueError(
                f"colocated Python needs CPU workers (--platform cpu), got --platform {platform or 'auto'}: "
                "a worker's colocated CPU devices are more devices of its CPU client"
            )
        count = num_devices or 1
        configure_jax(platform, 2 * count if colocated_python else num_devices)
        import jax

        if island is not None:
            island.join(platform or "")
        jaxlib_kernels.prepare()
        # This host's devices; in an island of several hosts, programs and shardings also name the
        # other hosts' devices (one id space for the island's distributed runtime).
        local = sorted(jax.local_devices(), key=lambda d: d.id)
        self.devices = local[:count] if colocated_python else local
        self.colocated_devices = local[count:] if colocated_python else []
        self.client = self.devices[0].client
        self._by_id = {d.id: d for d in jax.devices()}
        self._local_ids = frozenset(d.id for d in local)
        self._colocated_ids = frozenset(d.id for d in self.colocated_devices)
        self.timer = ExecutionTimer()
        # XLA's messages, read from jaxlib once (0.3-0.5 s): now, not on the loop at the first sharding.
        schema.load()
        # Programs are read in a child process first: a corrupted one must not abort this server.
        self.program_checker = ProgramChecker()

    def close(self) -> None:
        """Stops following executions (the devices themselves go with the process)."""
        self.timer.close()

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def colocated_device_ids(self) -> tuple[int, ...]:
        """The CPU devices beside ``device_ids`` (one each, same order); empty without colocated Python."""
        return tuple(d.id for d in self.colocated_devices)

    # -- devices ---------------------------------------------------------------------------

    @property
    def platform(self) -> str:
        return self.client.platform

    @property
    def platform_version(self) -> str:
        return self.client.platform_version

    def device(self, device_id: int):
        try:
            return self._by_id[device_id]
        except KeyError:
            known = ", ".join(str(i) for i in self._by_id)
            raise NotFound(f"device {device_id} is not one of this server's devices ({known})") from None

    def memory_kinds(self, device) -> tuple[str, ...]:
        """Memory kinds of ``device``, default first."""
        kinds = [m.kind for m in device.addressable_memories()]
        default = device.default_memory().kind
        return (default, *(k for k in kinds if k != default))

    def describe_devices(self, device_ids: Sequence[int]) -> list[DeviceDescription]:
        """This host's devices, as ``jax.devices()`` shows them (one process is one island's host 0)."""
        descriptions = []
        for device_id in device_ids:
            device = self.device(device_id)
            if device.id not in self._local_ids:
                raise NotFound(f"device {device_id} belongs to another host of this island; ask that host")
            hardware_id = device.local_hardware_id
            descriptions.append(
                describe_device(
                    device.id,
                    self.platform,
                    self._kind(device),
                    device.id if hardware_id is None else hardware_id,
                    self.memory_kinds(device),
                    island=0,
                    host_index=0,
                    host=socket.gethostname(),
                    ordinal=self._ordinal(device),
                    island_is_slice=False,
                )
            )
        return descriptions

    def _ordinal(self, device) -> int:
        """The device's place on this host (a colocated CPU device has its device's)."""
        if device.id in self._colocated_ids:
            return self.colocated_devices.index(device)
        return self.devices.index(device)

    def _kind(self, device) -> str:
        """The device's kind; with colocated CPU devices, the others are not "cpu" (see ``CPU_ACCELERATOR_KIND``)."""
        if self._colocated_ids and device.id not in self._colocated_ids:
            return CPU_ACCELERATOR_KIND
        return device.device_kind

    def default_layout(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bytes:
        """How the device stores an array of this shape, serialized as the IFRT client reads it."""
        device = self.device(device_id)
        if self.platform in ROW_MAJOR_PLATFORMS:
            return row_major(len(dims))
        layout = self.client.get_default_layout(dtype, tuple(dims), device)
        (serialized,) = layout.__getstate__()
        return serialized

    # -- shardings -------------------------------------------------------------------------

    def check_sharding(self, sharding: IfrtSharding) -> None:
        """``runtime_api.check_sharding`` over this process's devices (and those of its island's other hosts)."""
        check_sharding(sharding, lambda device_id: self.memory_kinds(self.device(device_id)))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - the runtime lives as long as the process
    def jax_sharding(self, sharding: IfrtSharding):
        """The ``jax.sharding.Sharding`` that places shards where ``sharding`` says.

        XLA sees only the plain OpSharding written from the checked tiling, never the bytes a client sent.
        """
        from jax._src.lib import xla_client as xc
        from jax._src.sharding_impls import GSPMDSharding
        from jax.sharding import SingleDeviceSharding

        self.check_sharding(sharding)
        devices = [self.device(i) for i in sharding.device_ids]
        memory_kind = sharding.memory_kind or None
        if sharding.is_single_device:
            return SingleDeviceSharding(devices[0], memory_kind=memory_kind)
        op = xc.OpSharding()
        op.ParseFromString(sharding.tiling().to_proto().SerializeToString())
        return GSPMDSharding(devices, op, memory_kind=memory_kind)

    # -- arrays ----------------------------------------------------------------------------

    def put(self, host: np.ndarray, sharding: IfrtSharding):
        """A device array holding ``host`` (the global value), laid out by ``sharding``."""
        return _exact_device_put(host, self.jax_sharding(sharding))

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        """A device array from one host buffer per device of ``sharding`` (in its order)."""
        singles = [
            _exact_device_put(shard, self.device(device_id))
            for shard, device_id in zip(shards, sharding.device_ids, strict=True)
        ]
        return self.assemble(shape, sharding, singles)

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence):
        """One array from single-device arrays, one per device of ``sharding`` on this host (in its order).

        Where ``sharding`` spans other hosts of the island, the result is this host's part of the
        island-wide array: the other hosts assemble theirs.
        """
        import jax

        check_assemble_parts(
            self.local_part(sharding), [[device.id for device in single.devices()] for single in singles]
        )
        target = self.jax_sharding(sharding)
        expected = target.shard_shape(shape)
        for single in singles:
            if single.shape != expected:
                raise InvalidRequest(f"shard of shape {single.shape} where the sharding needs {expected}")
        try:
            return jax.make_array_from_single_device_arrays(shape, target, list(singles))
        except ValueError as e:
            raise InvalidRequest(str(e)) from e

    def disassemble(self, array, sharding: IfrtSharding) -> list:
        """The single-device arrays of ``array``, in the order of ``sharding``'s devices."""
        if isinstance(array, StringArray):  # a host value: each device's shard is a copy of it
            return [StringArray(array.shape, array.strings) for _ in self.local_part(sharding).device_ids]
        if len(sharding.device_ids) == 1 and len(array.sharding.device_set) == 1:
            return [array]  # its one shard (which would share its buffer anyway), without building shards
        by_device = {shard.device.id: shard.data for shard in array.addressable_shards}
        return [by_device[device_id] for device_id in self.local_part(sharding).device_ids]

    def local_part(self, sharding: IfrtSharding) -> IfrtSharding:
        """The devices of ``sharding`` on this host (all of them, unless it spans several hosts)."""
        local = tuple(i for i in sharding.device_ids if i in self._local_ids)
        return sharding if len(local) == len(sharding.device_ids) else IfrtSharding(local, sharding.memory_kind)

    def copy(self, array, sharding: IfrtSharding):
        """``array``'s value laid out by ``sharding`` (other devices, memory or partitioning)."""
        import jax

        return _device_errors(jax.device_put, array, self.jax_sharding(sharding), may_alias=False)

    def to_host(self, array) -> np.ndarray:
        """The global value of ``array`` on the host, in memory of its own; waits for the device.

        A copy: on CPU ``np.asarray`` would be a view of the device buffer, and deleting the array
        while such a view lives (a download still being sent) is a CHECK failure in XLA.
        """
        return np.array(array)

    # -- programs --------------------------------------------------------------------------

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> Program:
        """Compiles a StableHLO artifact for ``device_ids`` with serialized ``xla.CompileOptionsProto``."""
        from jax._src import core
        from jax._src.lib import xla_client as xc

        self.program_checker.check(program)
        signature = program_signature.read(program)
        devices = [self.device(i) for i in device_ids]
        options = xc.CompileOptions.ParseFromString(compile_options)
        executable = _device_errors(self.client.compile_and_load, program, xc.DeviceList(tuple(devices)), options)
        device_ids = tuple(device_ids)
        parameter_ops = _serialized(executable.get_parameter_shardings(), len(devices))
        output_ops = _serialized(executable.get_output_shardings(), len(devices))
        output_shardings = output_shardings_of(output_ops, device_ids, len(signature.results))
        memory_kinds = tuple(executable.get_output_memory_kinds()[0]) if signature.results else ()
        handlers = []
        for aval, sharding, kind in zip(signature.results, output_shardings, memory_kinds, strict=True):
            if aval.is_token:  # held as jax holds a token: the token buffer behind a bool[0] array
                aval = Aval((0,), np.dtype(np.bool_))
            jax_sharding = self.jax_sharding(
                IfrtSharding(sharding.device_ids, None if kind == "device" else kind, sharding.op_sharding)
            )
            handlers.append(result_handlers.array(core.ShapedArray(aval.shape, aval.dtype), jax_sharding))
        try:
            fingerprint = executable.fingerprint
        except Exception:  # noqa: BLE001 - not every backend has fingerprints
            fingerprint = None
        return Program(
            executable=executable,
            device_ids=device_ids,
            signature=signature,
            output_shardings=output_shardings,
            parameter_op_shardings=parameter_ops,
            output_op_shardings=output_ops,
            # XLA describes no layouts of a program with token parameters or results (the metadata says so).
            parameter_layouts=_layouts(executable.get_parameter_layouts, signature.args),
            output_layouts=_layouts(executable.get_output_layouts, signature.results),
            output_memory_kinds=memory_kinds,
            memory_stats=_memory_stats(executable),
            donated_args=_donated_parameters(executable),
            result_handlers=tuple(handlers),
            name=executable.hlo_modules()[0].name,
            fingerprint=fingerprint,
        )

    def execute(
        self, program: Program, args: Sequence, keep: frozenset[int] = frozenset(), timed: EventSink | None = None
    ) -> list:
        """Starts ``program`` on ``args``; returns its results as arrays that fill in later.

        Arguments the program donates are consumed, except those in ``keep``,
        which are copied first so the caller's array stays alive. With
        ``timed``, an ``execute`` event goes there once the results are ready.
        """
        dispatched = time.time()
        check_arguments(
            program,
            [
                ArgumentFacts(arg.dtype, tuple(arg.shape), frozenset(d.id for d in arg.devices()), arg.is_deleted())
                for arg in args
            ],
        )
        args = list(args)
        for index in keep & program.donated_args:
            args[index] = self.copy(args[index], _sharding_of(args[index]))
        results = _device_errors(program.executable.execute_sharded, args)
        outputs = results.consume_with_handlers(list(program.result_handlers))
        if timed is not None:
            self.timer.watch(program.name, program.device_ids, outputs, dispatched, timed)
        return outputs

    def cost_analysis(self, program: ProgramInfo) -> dict[str, float]:
        return {key: float(value) for key, value in program.executable.cost_analysis().items()}

    def program_text(self, program: ProgramInfo) -> str:
        return "\n\n".join(module.to_string() for module in program.executable.hlo_modules())


def _sharding_of(array) -> IfrtSharding:
    devices = tuple(d.id for d in array.sharding._device_assignment)
    op = array.sharding._to_xla_hlo_sharding(array.ndim).to_proto()
    return IfrtSharding(devices, array.sharding.memory_kind, op.SerializeToString())


def _serialized(op_shardings, num_devices: int) -> tuple[bytes, ...] | None:
    """XLA's OpShardings serialized, in the plain form (its named ones, from jaxlib 0.10.2, rewritten)."""
    if op_shardings is None:
        return None
    return tuple(op_sharding.plain(op.SerializeToString(), num_devices) for op in op_shardings)


def _minor_to_major(layout) -> tuple[int, ...]:
    return tuple(layout._xla_layout().minor_to_major())


def _layouts(layouts_of_executable, avals: Sequence[Aval]) -> tuple[tuple[int, ...], ...]:
    """Each value's minor-to-major order; none at all where a value is a token, which XLA cannot lay out."""
    if any(aval.is_token for aval in avals):
        return ()
    return tuple(_minor_to_major(layout) for layout in layouts_of_executable())


_MEMORY_STATS_FIELDS = (
    "generated_code_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "peak_memory_in_bytes",
    "host_generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
)


def _memory_stats(executable) -> dict[str, int]:
    stats = executable.get_compiled_memory_stats()
    return {name: int(getattr(stats, name)) for name in _MEMORY_STATS_FIELDS}


def _donated_parameters(executable) -> frozenset[int]:
    """Parameters the compiled program consumes: those with an input/output alias, as PjRt donates.

    A buffer donor left in the compiled module found no output to alias, and its argument stays alive.
    """
    try:
        module = schema.load().xla.HloModuleProto.FromString(
            executable.hlo_modules()[0].as_serialized_hlo_module_proto()
        )
    except DecodeError as e:  # XLA keeps names that are not UTF-8; protobuf's Python reader refuses them
        raise InvalidRequest(
            f"the compiled program cannot be read back ({e}): a name or string attribute in it is not valid "
            "UTF-8; send the program as jax lowers it"
        ) from e
    return frozenset(entry.parameter_number for entry in module.input_output_alias.entries)


def _exact_device_put(host: np.ndarray, target):
    """``jax.device_put`` that keeps the client's dtype: without x64, jax would hold 64-bit values as 32-bit ones."""
    import jax

    with jax.enable_x64(True):
        return _device_errors(jax.device_put, host, target)


def _device_errors(function, *args, **kwargs):
    """Calls into XLA, turning its errors into request errors with XLA's own message."""
    from jax.errors import JaxRuntimeError

    try:
        return function(*args, **kwargs)
    except JaxRuntimeError as e:
        message = str(e)
        if message.startswith("RESOURCE_EXHAUSTED"):
            raise ResourceExhausted(
                f"{message}. The device is full: delete arrays you no longer need (x.delete()) or use smaller batches"
            ) from e
        if message.startswith("INVALID_ARGUMENT"):
            raise InvalidRequest(message) from e
        raise FailedPrecondition(message) from e
