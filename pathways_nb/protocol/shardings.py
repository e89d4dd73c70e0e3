"""IFRT shardings on the wire (``xla.ifrt.ShardingProto``) as plain values.

The client describes where an array lives with a serialized IFRT sharding:
one device (``SingleDeviceSharding``), or a device list plus an
``xla.OpSharding`` (``HloSharding``), or a list whose shards are all equal
copies (a fully replicated ``ConcreteEvenSharding``). ``IfrtSharding`` keeps
what the server needs of each: the devices in order, the memory kind and the
serialized ``OpSharding`` (``None`` when every device holds the whole array).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented
from pathways_nb.protocol.op_sharding import Tiling, check_no_unknown_fields
from pathways_nb.protocol.op_sharding import plain as plain_op_sharding
from pathways_nb.protocol.op_sharding import read as read_op_sharding

SINGLE_DEVICE = "xla::ifrt::SingleDeviceSharding"
HLO = "xla::ifrt::HloSharding"
CONCRETE_EVEN = "xla::ifrt::ConcreteEvenSharding"
OPAQUE = "xla::ifrt::OpaqueSharding"

_REPLICATED_OP_SHARDING_TYPE = 0  # xla.OpSharding.Type.REPLICATED


@dataclass(frozen=True, slots=True)
class IfrtSharding:
    """Where an array's shards live: devices (by id, in order), memory kind, layout of shards."""

    device_ids: tuple[int, ...]
    memory_kind: str | None = None
    # Serialized xla.OpSharding; None means each device holds the whole array.
    op_sharding: bytes | None = None

    @property
    def is_single_device(self) -> bool:
        return len(self.device_ids) == 1

    def with_devices(self, device_ids: tuple[int, ...], memory_kind: str | None) -> IfrtSharding:
        """The same partitioning over other devices (what ``copy_arrays`` produces)."""
        if len(device_ids) != len(self.device_ids):
            raise InvalidRequest(
                f"cannot move an array sharded over {len(self.device_ids)} devices "
                f"onto {len(device_ids)} devices; give as many devices as the array has shards"
            )
        return IfrtSharding(device_ids, memory_kind, self.op_sharding)

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of each shard of an array of ``shape`` (XLA pads uneven shards to this size)."""
        return self.tiling().shard_shape(tuple(shape))

    def shard_indices(self, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], ...]:
        """The region of an array of ``shape`` each device holds, in the order of ``device_ids``."""
        return self.tiling().shard_indices(tuple(shape))

    def tiling(self) -> Tiling:
        """The layout of the shards, read and checked in pure Python (never by XLA); raises if malformed."""
        if self.op_sharding is None:
            return Tiling(len(self.device_ids))
        return read_op_sharding(self.op_sharding, len(self.device_ids))

    def to_proto(self):
        """This sharding as an ``xla.ifrt.ShardingProto`` the stock client reads."""
        messages = schema.load()
        proto = messages.ifrt.ShardingProto()
        serialized = proto.serialized_sharding
        if self.is_single_device:
            body = messages.ifrt.SingleDeviceShardingProto(device_id=self.device_ids[0])
            serialized.type_name = SINGLE_DEVICE
        else:
            body = messages.ifrt.HloShardingProto()
            body.devices.device_ids.extend(self.device_ids)
            if self.op_sharding is None:
                body.xla_op_sharding.type = _REPLICATED_OP_SHARDING_TYPE
            else:
                body.xla_op_sharding.ParseFromString(self.op_sharding)
            serialized.type_name = HLO
        if self.memory_kind is not None:
            body.memory_kind = self.memory_kind
        serialized.data = body.SerializeToString()
        return proto


def from_proto(proto) -> IfrtSharding:
    """Decodes a ``ShardingProto``; unknown or malformed ones raise a clear error.

    Everything is checked here in pure Python (never by XLA, which aborts the
    process on some malformed input): the device list is not empty, and an
    ``OpSharding`` fits it.
    """
    type_name = proto.serialized_sharding.type_name
    if not type_name:
        raise InvalidRequest("the request carries no sharding")
    body_class = _body_classes().get(type_name)
    if body_class is None:
        raise Unimplemented(
            f"sharding type {type_name} is not supported by this server; "
            "use a NamedSharding, PositionalSharding or SingleDeviceSharding"
        )
    try:
        body = body_class.FromString(proto.serialized_sharding.data)
    except DecodeError as e:
        raise InvalidRequest(f"malformed {type_name}: {e}") from e
    check_no_unknown_fields(body, type_name)
    if type_name == SINGLE_DEVICE:
        return IfrtSharding((body.device_id,), _memory_kind(body))
    check_no_unknown_fields(body.devices, f"{type_name}'s device list")
    devices = tuple(body.devices.device_ids)
    if not devices:
        raise InvalidRequest(f"a {type_name} with no devices; list the devices the array lives on")
    if type_name == HLO:
        serialized = plain_op_sharding(body.xla_op_sharding.SerializeToString(), len(devices))
        replicated = read_op_sharding(serialized, len(devices)).is_fully_replicated
        return IfrtSharding(devices, _memory_kind(body), None if replicated else serialized)
    if type_name == CONCRETE_EVEN and (body.is_fully_replicated or len(devices) == 1):
        return IfrtSharding(devices, _memory_kind(body))
    if type_name == OPAQUE and len(devices) == 1:
        return IfrtSharding(devices, _memory_kind(body))
    raise Unimplemented(
        f"a {type_name} over {len(devices)} devices that is not fully replicated is not supported by this server; "
        "use a NamedSharding, PositionalSharding or SingleDeviceSharding"
    )


@functools.cache
def _body_classes() -> dict[str, type]:
    ifrt = schema.load().ifrt
    return {
        SINGLE_DEVICE: ifrt.SingleDeviceShardingProto,
        HLO: ifrt.HloShardingProto,
        CONCRETE_EVEN: ifrt.ConcreteEvenShardingProto,
        OPAQUE: ifrt.OpaqueShardingProto,
    }


def _memory_kind(body) -> str | None:
    return body.memory_kind if body.HasField("memory_kind") else None
