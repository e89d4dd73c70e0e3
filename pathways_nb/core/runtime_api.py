"""The interface between the proxy and whatever holds the devices.

The proxy serves the IFRT protocol against a ``Runtime``: ``LocalProxyRuntime``
(this process's own devices, ``pathways-nb proxy``) or ``ClusterRuntime``
(workers of a cluster, reached over the network). Device values are opaque
to the proxy; like ``jax.Array`` they can be deleted, asked whether they are,
and waited for. The checks both runtimes make of what a client sends live
here, so that both refuse the same bad input with the same words.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pathways_nb.core.dataflow import Pending
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, NotFound
from pathways_nb.protocol.shardings import IfrtSharding


@dataclass(frozen=True, slots=True)
class Aval:
    """Shape and dtype of one value; ``dtype is None`` for a token."""

    shape: tuple[int, ...]
    dtype: np.dtype | None

    @property
    def is_token(self) -> bool:
        return self.dtype is None

    @property
    def kind(self) -> int:
        """The value's IFRT dtype kind (``dtypes.TOKEN_KIND`` for a token)."""
        return dtypes.TOKEN_KIND if self.is_token else dtypes.from_numpy(self.dtype)


@dataclass(frozen=True, slots=True)
class Signature:
    """Global argument and result types of a program's ``main``."""

    args: tuple[Aval, ...]
    results: tuple[Aval, ...]


@dataclass(frozen=True)
class DeviceDescription:
    """One device as the client's ``jax.devices()`` shows it."""

    id: int
    platform: str
    kind: str
    debug_string: str  # str(device), e.g. "cpu:0"
    to_string: str  # repr(device), e.g. "CpuDevice(id=0)"
    local_hardware_id: int
    memory_kinds: tuple[str, ...]  # default first
    attributes: dict[str, Any] = field(default_factory=dict)


# The class the stock client's ``repr(device)`` names, per platform (as local jaxlib devices print).
_DEVICE_CLASS = {"cpu": "CpuDevice", "cuda": "CudaDevice", "rocm": "RocmDevice", "tpu": "TpuDevice"}


def describe_device(
    device_id: int,
    platform: str,
    kind: str,
    local_hardware_id: int,
    memory_kinds: Sequence[str],
    *,
    island: int,
    host_index: int,
    host: str,
    ordinal: int,
    island_is_slice: bool,
    colocation_id: int | None = None,
) -> DeviceDescription:
    """A device as ``jax.devices()`` shows it, wherever it is.

    ``island`` is always the device's island; where ``island_is_slice`` it is its ``slice_index`` too, named
    in ``repr``, as a TPU device of a multi-slice job names its slice (``mesh_utils.create_hybrid_device_mesh``
    groups devices by it, and ``jax.make_mesh`` refuses a mesh over several); else every device is of slice 0,
    as in a one-slice job. ``coords`` is the device's place in its island's mesh: (host, device on the host). A
    device and the CPU device beside it share a ``colocation_id``
    (``jax.experimental.colocated_python.colocated_cpu_devices`` pairs them).
    """
    device_class = _DEVICE_CLASS.get(platform, "Device")
    named = f", slice_index={island}" if island_is_slice else ""
    attributes = {
        "island": island,
        "slice_index": island if island_is_slice else 0,
        "host_index": host_index,
        "host": host,
        "coords": [host_index, ordinal],
    }
    if colocation_id is not None:
        attributes["colocation_id"] = colocation_id
    return DeviceDescription(
        id=device_id,
        platform=platform,
        kind=kind,
        debug_string=f"{platform}:{device_id}",
        to_string=f"{device_class}(id={device_id}{named})",
        local_hardware_id=local_hardware_id,
        memory_kinds=tuple(memory_kinds),
        attributes=attributes,
    )


def not_in_session(device_id: int, session_device_ids: Sequence[int]) -> NotFound:
    """The error for a request that names a device its session does not hold."""
    return NotFound(f"device {device_id} is not allocated to this session (devices {list(session_device_ids)})")


def check_sharding(sharding: IfrtSharding, memory_kinds: Callable[[int], Sequence[str]]) -> None:
    """Refuses shardings over no, unknown or repeated devices, unknown memory kinds or a bad OpSharding.

    Pure Python, before any jax or XLA object exists: XLA aborts the process (a CHECK) on some
    malformed shardings instead of raising. ``memory_kinds(device_id)`` gives a device's memory
    kinds and raises ``NotFound`` for a device the caller does not hold.
    """
    if not sharding.device_ids:
        raise InvalidRequest("a sharding over no devices; list the devices the array lives on")
    kinds = [memory_kinds(device_id) for device_id in sharding.device_ids]
    if len(set(sharding.device_ids)) != len(sharding.device_ids):
        raise InvalidRequest(f"a sharding lists a device twice: {list(sharding.device_ids)}")
    if sharding.memory_kind:
        for device_id, available in zip(sharding.device_ids, kinds, strict=True):
            if sharding.memory_kind not in available:
                raise InvalidRequest(
                    f"memory kind {sharding.memory_kind!r} does not exist on device {device_id}; "
                    f"use one of {list(available)}"
                )
    sharding.tiling()


@dataclass(frozen=True, eq=False)
class ProgramInfo:
    """What the proxy reports about a compiled program (compared by identity)."""

    device_ids: tuple[int, ...]
    signature: Signature
    output_shardings: tuple[IfrtSharding, ...]
    # Serialized xla.OpSharding per parameter / output, as XLA reports them (None: single device).
    parameter_op_shardings: tuple[bytes, ...] | None
    output_op_shardings: tuple[bytes, ...] | None
    parameter_layouts: tuple[tuple[int, ...], ...]
    output_layouts: tuple[tuple[int, ...], ...]
    output_memory_kinds: tuple[str, ...]
    memory_stats: dict[str, int]
    donated_args: frozenset[int]
    name: str
    fingerprint: bytes | None


@dataclass(frozen=True, slots=True)
class ArgumentFacts:
    """What is known about one argument before a program runs."""

    dtype: np.dtype | None
    shape: tuple[int, ...]
    device_ids: frozenset[int]
    deleted: bool


def check_arguments(program: ProgramInfo, args: Sequence[ArgumentFacts]) -> None:
    """Refuses arguments XLA would fail or crash on: wrong count, type, or devices."""
    expected = program.signature.args
    if len(args) != len(expected):
        raise InvalidRequest(f"program {program.name} takes {len(expected)} arguments, got {len(args)}")
    wanted_devices = frozenset(program.device_ids)
    for index, (arg, aval) in enumerate(zip(args, expected, strict=True)):
        if arg.deleted:
            raise FailedPrecondition(f"argument {index} of {program.name} was deleted or donated to an earlier program")
        if aval.is_token:
            continue
        if arg.shape != aval.shape or arg.dtype != aval.dtype:
            raise InvalidRequest(
                f"argument {index} of {program.name} is {arg.dtype}{list(arg.shape)}, "
                f"the program takes {aval.dtype}{list(aval.shape)}"
            )
        if arg.device_ids != wanted_devices:
            raise InvalidRequest(
                f"argument {index} of {program.name} is on devices {sorted(arg.device_ids)}, "
                f"the program runs on {sorted(wanted_devices)}; move it first (jax.device_put)"
            )


def check_assemble_parts(sharding: IfrtSharding, part_device_ids: Sequence[Sequence[int]]) -> None:
    """Refuses parts that are not one single-device array per device of ``sharding``, in its order."""
    if len(part_device_ids) != len(sharding.device_ids):
        raise InvalidRequest(
            f"{len(part_device_ids)} single-device arrays given for a sharding over {len(sharding.device_ids)} devices"
        )
    for devices, device_id in zip(part_device_ids, sharding.device_ids, strict=True):
        if tuple(devices) != (device_id,):
            raise InvalidRequest(
                f"shard for device {device_id} lives on {list(devices)}; "
                "assemble shards in the order of the sharding's devices"
            )


class DeviceValue(Protocol):
    """A value on devices: ``jax.Array`` locally, a remote reference in a cluster."""

    def delete(self) -> None: ...

    def is_deleted(self) -> bool: ...

    def block_until_ready(self) -> Any: ...


class Runtime(Protocol):
    """The devices a proxy serves: each client session gets its share with ``open_session``."""

    async def open_session(
        self, session_id: int, attributes: dict[str, Any], events: Callable, output: Callable | None = None
    ) -> DeviceSession:
        """The devices of a new session, awaited on the proxy's loop (it may queue for capacity; raises
        ``RequestError``). ``events`` receives the session's ``execute`` and ``transfer`` events; ``output(island,
        host_index, lines)`` what its code beside the devices writes (``pathways_nb.v1.OutputLine``s; None: nowhere).
        """
        ...

    async def cluster_state(self) -> Any:
        """The devices, workers, allocations and queue (a ``pathways_nb.v1.ClusterState``), awaited on the
        proxy's loop."""
        ...

    def serve_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """The proxy's event loop, before any session opens: streams of the runtime's own may live there."""
        ...

    async def stop_serving(self) -> None:
        """The proxy stops (on its loop, before ``close``): what the runtime runs there ends."""
        ...

    @property
    def host(self) -> Any:
        """The proxy's own place and storage root (a ``core.nonxla.HostContext``)."""
        ...

    def close(self) -> None:
        """Lets go of everything (the server is stopping)."""
        ...


class DeviceSession(Protocol):
    """What one client session's requests need from its devices."""

    @property
    def device_ids(self) -> tuple[int, ...]: ...

    @property
    def colocated_device_ids(self) -> tuple[int, ...]:
        """The CPU devices beside ``device_ids`` for colocated Python (addressable, not primary); may be empty."""
        ...

    def release(self) -> None:
        """Frees everything the session holds on its devices, and the devices themselves."""
        ...

    @property
    def platform(self) -> str: ...

    @property
    def platform_version(self) -> str: ...

    def describe_devices(self, device_ids: Sequence[int]) -> list[DeviceDescription]: ...

    def default_layout(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bytes:
        """The serialized default layout; never fails for a device of the session (the client aborts on errors)."""
        ...

    def layout_waits(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bool:
        """Whether ``default_layout`` would ask a worker (the proxy then asks off its event loop)."""
        ...

    def check_sharding(self, sharding: IfrtSharding) -> None: ...

    def put(self, host: np.ndarray, sharding: IfrtSharding) -> DeviceValue: ...

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]) -> DeviceValue:
        """One host shard per device of ``sharding``, each of its shard shape and the array's dtype.

        The protocol handler checks that before the bytes arrive, once for both runtimes.
        """
        ...

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence) -> DeviceValue: ...

    def disassemble(self, value, sharding: IfrtSharding) -> list: ...

    def copy(self, value, sharding: IfrtSharding) -> DeviceValue: ...

    def put_blocking(self, host: np.ndarray, sharding: IfrtSharding) -> DeviceValue:
        """``put`` for a pool thread (a large upload): ``put`` itself is the event loop's."""
        ...

    def put_shards_blocking(
        self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]
    ) -> DeviceValue:
        """``put_shards`` for a pool thread."""
        ...

    def copy_blocking(self, value, sharding: IfrtSharding) -> DeviceValue:
        """``copy`` for a pool thread, where ``copy_blocks`` says it waits for the devices."""
        ...

    def ready(self, device_ids: Sequence[int]) -> Pending | None:
        """What a program over ``device_ids`` must wait for before it is compiled or run (their islands' group
        forming), or None; it fails with the reason the group cannot serve."""
        ...

    def copy_blocks(self, value, sharding: IfrtSharding) -> bool:
        """Whether ``copy`` would wait for the devices (it reads the value into the server first).

        The proxy then runs it off its event loop, so that other requests never wait behind it.
        """
        ...

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> ProgramInfo: ...

    def execute(self, program: ProgramInfo, args: Sequence, keep: frozenset[int] = frozenset()) -> list: ...

    def to_host_later(self, value, wait_pool: Executor) -> Pending:
        """The value's global array on the host (``np.ndarray``), delivered to the returned pending.

        Never waits on the calling thread (it may be the event loop's): a small value is read
        at once where that costs nothing, else when a worker's reply arrives, else on ``wait_pool``.
        """
        ...

    def cost_analysis(self, program: ProgramInfo) -> dict[str, float]: ...

    def program_text(self, program: ProgramInfo) -> str: ...

    @property
    def proxy_is_host(self) -> bool:
        """Whether the proxy's own process holds the devices (the single-process server)."""
        ...

    @property
    def host(self) -> Any:
        """The proxy's own place and storage root (a ``core.nonxla.HostContext``): the host's on the
        single-process server, else the proxy's."""
        ...

    def run_program(self, plan: Any, request: bytes, args: Sequence, output_context: str = "") -> list:
        """Runs a non-XLA program's host half (``core.nonxla``) on every host of ``plan``; blocks until all are done.

        ``plan`` is a ``nonxla.ProgramPlan``; returns one value per output of the plan. ``output_context``:
        the client's context of the call, which tags what the call writes (``HostContext.output_context``).
        """
        ...
