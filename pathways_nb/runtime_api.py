"""The interface between the proxy and whatever holds the devices.

The proxy serves the IFRT protocol against a ``Runtime``: ``LocalRuntime``
(this process's own devices, ``pathways-nb proxy``) or ``ClusterRuntime``
(workers of a cluster, reached over the network). Device values are opaque
to the proxy; like ``jax.Array`` they can be deleted, asked whether they are,
and waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest
from pathways_nb.protocol.shardings import IfrtSharding


@dataclass(frozen=True, slots=True)
class Aval:
    """Shape and dtype of one value; ``dtype is None`` for a token."""

    shape: tuple[int, ...]
    dtype: np.dtype | None

    @property
    def is_token(self) -> bool:
        return self.dtype is None


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

    def open_session(self, session_id: int, attributes: dict[str, Any], events: Callable) -> DeviceSession:
        """The devices of a new session (may wait for capacity; raises ``RequestError``).

        ``events`` receives the session's ``execute`` and ``transfer`` events.
        """
        ...

    def cluster_state(self) -> Any:
        """The devices, workers, allocations and queue (a ``pathways_nb.v1.ClusterState``)."""
        ...

    def close(self) -> None:
        """Lets go of everything (the server is stopping)."""
        ...


class DeviceSession(Protocol):
    """What one client session's requests need from its devices."""

    @property
    def device_ids(self) -> tuple[int, ...]: ...

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

    def check_sharding(self, sharding: IfrtSharding) -> None: ...

    def put(self, host: np.ndarray, sharding: IfrtSharding) -> DeviceValue: ...

    def put_shards(
        self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]
    ) -> DeviceValue: ...

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence) -> DeviceValue: ...

    def disassemble(self, value, sharding: IfrtSharding) -> list: ...

    def copy(self, value, sharding: IfrtSharding) -> DeviceValue: ...

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> ProgramInfo: ...

    def execute(self, program: ProgramInfo, args: Sequence, keep: frozenset[int] = frozenset()) -> list: ...

    def to_host(self, value) -> np.ndarray: ...

    def cost_analysis(self, program: ProgramInfo) -> dict[str, float]: ...

    def program_text(self, program: ProgramInfo) -> str: ...
