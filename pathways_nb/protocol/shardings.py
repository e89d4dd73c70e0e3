"""IFRT shardings on the wire (``xla.ifrt.ShardingProto``) as plain values.

The client describes where an array lives with a serialized IFRT sharding:
one device (``SingleDeviceSharding``), or a device list plus an
``xla.OpSharding`` (``HloSharding``), or a list whose shards are all equal
copies (a fully replicated ``ConcreteEvenSharding``). ``IfrtSharding`` keeps
what the server needs of each: the devices in order, the memory kind and the
serialized ``OpSharding`` (``None`` when every device holds the whole array).
"""

from __future__ import annotations

from dataclasses import dataclass

from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented

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
        if self.op_sharding is None:
            return tuple(shape)
        partitions = self._partitions(len(shape))
        return tuple(-(-dim // parts) for dim, parts in zip(shape, partitions, strict=True))

    def shard_indices(self, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], ...]:
        """The region of an array of ``shape`` each device holds, in the order of ``device_ids``."""
        if self.op_sharding is None:
            return tuple((slice(None),) * len(shape) for _ in self.device_ids)
        from jax._src import op_shardings
        from jax._src.lib import xla_client as xc

        self._partitions(len(shape))
        op = xc.OpSharding()
        op.ParseFromString(self.op_sharding)
        try:
            return op_shardings.op_sharding_to_indices(xc.HloSharding.from_proto(op), shape, len(self.device_ids))
        except AssertionError as e:
            raise InvalidRequest(f"shape {list(shape)} cannot be split evenly by this sharding") from e

    def _partitions(self, rank: int) -> list[int]:
        from jax._src import op_shardings
        from jax._src.lib import xla_client as xc

        op = xc.OpSharding()
        op.ParseFromString(self.op_sharding)
        partitions, _ = op_shardings.get_num_ways_dim_sharded(xc.HloSharding.from_proto(op))
        if len(partitions) != rank:
            raise InvalidRequest(f"a sharding over {len(partitions)} dimensions was given for a rank-{rank} array")
        return partitions

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
    """Decodes a ``ShardingProto``; unknown or malformed ones raise a clear error."""
    messages = schema.load()
    type_name = proto.serialized_sharding.type_name
    data = proto.serialized_sharding.data
    try:
        if type_name == SINGLE_DEVICE:
            body = messages.ifrt.SingleDeviceShardingProto.FromString(data)
            return IfrtSharding((body.device_id,), _memory_kind(body))
        if type_name == HLO:
            body = messages.ifrt.HloShardingProto.FromString(data)
            devices = tuple(body.devices.device_ids)
            if not devices:
                raise InvalidRequest("an HloSharding with no devices")
            op = body.xla_op_sharding
            replicated = op.type == _REPLICATED_OP_SHARDING_TYPE or len(devices) == 1
            return IfrtSharding(devices, _memory_kind(body), None if replicated else op.SerializeToString())
        if type_name == CONCRETE_EVEN:
            body = messages.ifrt.ConcreteEvenShardingProto.FromString(data)
            devices = tuple(body.devices.device_ids)
            if body.is_fully_replicated or len(devices) == 1:
                return IfrtSharding(devices, _memory_kind(body))
        if type_name == OPAQUE:
            body = messages.ifrt.OpaqueShardingProto.FromString(data)
            devices = tuple(body.devices.device_ids)
            if len(devices) == 1:
                return IfrtSharding(devices, _memory_kind(body))
    except InvalidRequest:
        raise
    except Exception as e:
        raise InvalidRequest(f"malformed {type_name or 'sharding'}: {e}") from e
    if not type_name:
        raise InvalidRequest("the request carries no sharding")
    raise Unimplemented(
        f"sharding type {type_name} is not supported by this server; "
        "use a NamedSharding, PositionalSharding or SingleDeviceSharding"
    )


def _memory_kind(body) -> str | None:
    return body.memory_kind if body.HasField("memory_kind") else None
