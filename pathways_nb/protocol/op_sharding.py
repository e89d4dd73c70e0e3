"""``xla.OpSharding`` read in pure Python, so client input never reaches XLA's C++ in the proxy.

XLA stops the whole process with a CHECK on some shardings it does not expect
(asking a named sharding for its tiles, a jax sharding built over no devices),
so the proxy reads OpShardings here: it checks every field, answers what the
proxy needs (which region of an array each device holds, the shard shape,
whether every device holds all of it) and writes the validated sharding back
in the plain form (explicit tile assignment) that the workers hand to XLA and
that every client reads. Named shardings (HloShardingV3: a mesh and axes,
which jaxlib 0.10.2's XLA writes for programs a jaxlib >= 0.11 client lowered)
are read into the same ``Tiling``; fields this server's schema does not know
(a newer XLA's) are refused as a newer format.

A sharding over ``n`` devices names them by position ``0..n-1`` in the
device list it travels with. Its tiles are laid out row-major over the
array's dimensions; each tile is held by ``replicas`` devices (the
replicated "last tile dimension" of a partially replicated sharding).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from google.protobuf import message as protobuf_message
from google.protobuf import unknown_fields

from pathways_nb.errors import SUPPORTED_JAXLIB
from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented

# xla.OpSharding.Type values.
REPLICATED = 0
MAXIMAL = 1
TUPLE = 2
OTHER = 3  # tiled
MANUAL = 4
UNKNOWN = 5
UNREDUCED = 6
_TYPE_NAMES = {
    REPLICATED: "REPLICATED",
    MAXIMAL: "MAXIMAL",
    TUPLE: "TUPLE",
    OTHER: "OTHER",
    MANUAL: "MANUAL",
    UNKNOWN: "UNKNOWN",
    UNREDUCED: "UNREDUCED",
}


def server_jaxlib_version() -> str:
    """The jaxlib this server runs (its version module loads none of XLA)."""
    import jaxlib.version

    return jaxlib.version.__version__


def newer_format(what: str) -> Unimplemented:
    """The error for a sharding written by a newer XLA than this server's."""
    version = server_jaxlib_version()
    return Unimplemented(
        f"this sharding uses a format newer than this server's jaxlib {version} ({what}); "
        f"upgrade the server's jaxlib (pathways-nb's servers run on jaxlib {SUPPORTED_JAXLIB}) "
        f"or use a client jax <= {version}"
    )


def check_no_unknown_fields(message: protobuf_message.Message, what: str) -> None:
    """Refuses a message that carries fields this server's schema does not know (a newer client's)."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        raise newer_format(f"{what} field{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}")


@dataclass(frozen=True, slots=True)
class Tiling:
    """How an array is laid out over ``num_devices`` devices.

    ``partitions`` is the number of tiles along each array dimension (``None``
    when every device holds the whole array, which fits arrays of any rank);
    ``tile_devices`` lists the device positions tile by tile (row-major), each
    tile's ``replicas`` holders next to each other.
    """

    num_devices: int
    partitions: tuple[int, ...] | None = None
    replicas: int = 1
    tile_devices: tuple[int, ...] = ()

    @property
    def is_fully_replicated(self) -> bool:
        return self.partitions is None

    def check_rank(self, rank: int) -> None:
        if self.partitions is not None and len(self.partitions) != rank:
            raise InvalidRequest(
                f"a sharding over {len(self.partitions)} dimensions was given for a rank-{rank} array; "
                "give a sharding with one entry per array dimension"
            )

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of each shard (XLA pads uneven shards to this size, so it rounds up)."""
        self.check_rank(len(shape))
        if self.partitions is None:
            return tuple(shape)
        return tuple(-(-dim // parts) for dim, parts in zip(shape, self.partitions, strict=True))

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Refuses an array this sharding cannot split: another rank, or tiles of unequal size (as jax does)."""
        self.check_rank(len(shape))
        for axis, (dim, parts) in enumerate(zip(shape, self.partitions or (), strict=False)):
            if dim % parts:
                raise InvalidRequest(
                    f"shape {list(shape)} cannot be split evenly by this sharding: dimension {axis} "
                    f"of size {dim} into {parts} parts; make it a multiple of {parts}"
                )

    def shard_indices(self, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], ...]:
        """The region of the array each device holds, in device-list order (as jax's ``op_sharding_to_indices``)."""
        self.check_shape(shape)
        if self.partitions is None:
            return tuple((slice(None),) * len(shape) for _ in range(self.num_devices))
        per_dim = [
            [slice(None)] if parts == 1 else [slice(i * (dim // parts), (i + 1) * (dim // parts)) for i in range(parts)]
            for dim, parts in zip(shape, self.partitions, strict=True)
        ]
        indices: list[tuple[slice, ...] | None] = [None] * self.num_devices
        holders = iter(self.tile_devices)
        for region in itertools.product(*per_dim):
            for _ in range(self.replicas):
                indices[next(holders)] = region
        return tuple(indices)

    def to_proto(self):
        """The plain ``xla.OpSharding`` of this layout (explicit devices, only fields checked here)."""
        op = schema.load().xla.OpSharding()
        if self.partitions is None:
            op.type = REPLICATED
            return op
        op.type = OTHER
        op.tile_assignment_dimensions.extend(self.partitions)
        if self.replicas > 1:
            op.tile_assignment_dimensions.append(self.replicas)
            op.replicate_on_last_tile_dim = True
        op.tile_assignment_devices.extend(self.tile_devices)
        return op


def read(serialized: bytes, num_devices: int) -> Tiling:
    """Reads and checks a serialized ``xla.OpSharding`` for a list of ``num_devices`` devices.

    Raises ``InvalidRequest`` for a malformed sharding and ``Unimplemented``
    for one this server cannot hold (manual, unreduced, a newer format).
    """
    return _read_cached(bytes(serialized), num_devices)


def plain(serialized: bytes, num_devices: int) -> bytes:
    """``serialized`` in the V1/V2 form every client reads: a named sharding rewritten, any other as it is.

    A jaxlib 0.12 client aborts (a CHECK in ``HloSharding::tile_assignment``)
    when a reply carries a named sharding, and jaxlib 0.10.2's XLA writes them
    for programs a jaxlib >= 0.11 client lowered, so nothing named leaves the server.
    """
    if not _is_named(bytes(serialized)):
        return serialized
    return read(serialized, num_devices).to_proto().SerializeToString()


@functools.lru_cache(maxsize=4096)
def _is_named(serialized: bytes) -> bool:
    try:
        return schema.load().xla.OpSharding.FromString(serialized).HasField("named_sharding")
    except protobuf_message.DecodeError:
        return False  # read() says what is wrong with it


@functools.lru_cache(maxsize=4096)
def _read_cached(serialized: bytes, num_devices: int) -> Tiling:
    try:
        op = schema.load().xla.OpSharding.FromString(serialized)
    except protobuf_message.DecodeError as e:
        raise InvalidRequest(f"malformed OpSharding ({len(serialized)} bytes): {e}") from e
    return from_message(op, num_devices)


def from_message(op, num_devices: int) -> Tiling:
    """Checks a parsed ``xla.OpSharding`` for a list of ``num_devices`` devices (see ``read``)."""
    if num_devices < 1:
        raise InvalidRequest("a sharding over no devices; give at least one device")
    check_no_unknown_fields(op, "OpSharding")
    if op.HasField("named_sharding"):
        if op.tile_assignment_dimensions or op.tile_assignment_devices or op.iota_reshape_dims:
            raise InvalidRequest("an OpSharding gives both a named sharding and a tile assignment")
        return _named(op.named_sharding, num_devices)
    kind = op.type
    if kind == REPLICATED:
        return Tiling(num_devices)
    if kind == MAXIMAL:
        return _maximal(op, num_devices)
    if kind == OTHER:
        return _tiled(op, num_devices)
    if kind == TUPLE:
        raise InvalidRequest("a TUPLE OpSharding was given where one array's sharding is needed")
    if kind in (MANUAL, UNREDUCED):
        raise Unimplemented(
            f"{_TYPE_NAMES[kind]} shardings (inside shard_map, or unreduced partial sums) cannot describe "
            "an array on this server; give the array a tiled or replicated sharding"
        )
    if kind == UNKNOWN:
        raise InvalidRequest("an UNKNOWN OpSharding (a placeholder of XLA's sharding propagation) describes no layout")
    raise newer_format(f"OpSharding type {kind}")


def _maximal(op, num_devices: int) -> Tiling:
    devices = list(op.tile_assignment_devices)
    if len(devices) != 1 or not 0 <= devices[0] < num_devices:
        raise InvalidRequest(
            f"a MAXIMAL OpSharding must name one device of the {num_devices} in its list, got {devices}"
        )
    if num_devices > 1:
        raise Unimplemented(
            f"a MAXIMAL OpSharding (the whole array on one device) over {num_devices} devices; "
            "put the array on one device with a SingleDeviceSharding"
        )
    return Tiling(num_devices)


def _tiled(op, num_devices: int) -> Tiling:
    dims = list(op.tile_assignment_dimensions)
    if not dims or any(d < 1 for d in dims):
        raise InvalidRequest(f"a tiled OpSharding needs tile_assignment_dimensions of at least 1, got {dims}")
    if math.prod(dims) != num_devices:
        raise InvalidRequest(
            f"an OpSharding for {math.prod(dims)} devices (tiles {dims}) was sent with {num_devices} devices; "
            "give the sharding as many devices as it has tiles"
        )
    devices = _tile_assignment(op, num_devices)
    subgroups = _subgroup_dims(op, len(dims))
    # Trailing subgroup dimensions are all REPLICATED by now: fold them into one.
    data_dims = dims[: len(dims) - len(subgroups)]
    replicas = math.prod(dims[len(data_dims) :])
    if math.prod(data_dims) == 1:
        return Tiling(num_devices)
    return Tiling(num_devices, tuple(data_dims), replicas, tuple(devices))


def _tile_assignment(op, num_devices: int) -> list[int]:
    """The device positions in tile order, from the explicit list or the iota form; a permutation."""
    explicit = list(op.tile_assignment_devices)
    reshape = list(op.iota_reshape_dims)
    perm = list(op.iota_transpose_perm)
    if explicit and (reshape or perm):
        raise InvalidRequest("an OpSharding gives both tile_assignment_devices and an iota tile assignment")
    if reshape or perm:
        if any(d < 1 for d in reshape) or math.prod(reshape) != num_devices:
            raise InvalidRequest(f"iota_reshape_dims {reshape} do not multiply to the {num_devices} devices")
        if sorted(perm) != list(range(len(reshape))):
            raise InvalidRequest(
                f"iota_transpose_perm {perm} is not a permutation of the {len(reshape)} iota_reshape_dims"
            )
        return _iota(reshape, perm)
    if len(explicit) != num_devices:
        raise InvalidRequest(
            f"an OpSharding with {len(explicit)} tile_assignment_devices for {num_devices} devices; "
            "list each device once"
        )
    if sorted(explicit) != list(range(num_devices)):
        raise InvalidRequest(
            f"tile_assignment_devices {explicit} must name each of the {num_devices} devices "
            f"(positions 0 to {num_devices - 1}) exactly once"
        )
    return explicit


def _iota(reshape: list[int], perm: list[int]) -> list[int]:
    """``arange(prod(reshape)).reshape(reshape).transpose(perm).ravel()``, without numpy's C in the way."""
    strides = [math.prod(reshape[i + 1 :]) for i in range(len(reshape))]
    ranges = [range(reshape[p]) for p in perm]
    return [sum(i * strides[p] for i, p in zip(index, perm, strict=True)) for index in itertools.product(*ranges)]


def _subgroup_dims(op, rank: int) -> list[int]:
    """The subgroup (trailing) dimensions of the tile assignment, all checked to be replication."""
    kinds = list(op.last_tile_dims)
    if op.replicate_on_last_tile_dim:
        if kinds:
            raise InvalidRequest("an OpSharding sets both replicate_on_last_tile_dim and last_tile_dims")
        kinds = [REPLICATED]
    if len(kinds) > rank:
        raise InvalidRequest(f"{len(kinds)} last_tile_dims for a tile assignment of {rank} dimensions")
    dims = list(op.tile_assignment_dimensions)[rank - len(kinds) :]
    for kind, size in zip(kinds, dims, strict=True):
        if kind not in _TYPE_NAMES:
            raise newer_format(f"last_tile_dims type {kind}")
        if kind in (MANUAL, UNREDUCED) and size > 1:
            raise Unimplemented(
                f"a sharding with a {_TYPE_NAMES[kind]} subgroup cannot describe an array on this server; "
                "give the array a tiled or replicated sharding"
            )
        if kind not in (REPLICATED, MANUAL, UNREDUCED):
            raise InvalidRequest(f"last_tile_dims may hold REPLICATED, MANUAL or UNREDUCED, not {_TYPE_NAMES[kind]}")
    return kinds


def _named(named, num_devices: int) -> Tiling:
    """A named (HloShardingV3: mesh and axes) sharding as the same tiling its V2 form has.

    Each device sits at one coordinate of the mesh; a dimension sharded over
    axes (major to minor) is split into the product of their sizes, and the
    device's tile along it is the mixed-radix number of its coordinates on
    those axes. Axes no dimension uses replicate; a device's rank among its
    tile's holders follows mesh order, as XLA's V3-to-V2 conversion does.
    """
    for part, what in ((named, "named sharding"), (named.mesh, "named sharding's mesh")):
        check_no_unknown_fields(part, what)
    if named.manual_axes:
        raise Unimplemented(
            "a named sharding with manual axes (inside shard_map) cannot describe an array on this server; "
            "give the array a tiled or replicated sharding"
        )
    sizes = [axis.size for axis in named.mesh.axes]
    if not sizes:  # XLA's replicated named sharding: an empty mesh, no axis named anywhere
        for ref in (*named.replicated_axes, *named.unreduced_axes, *(r for d in named.dim_shardings for r in d.axes)):
            _axis_part(ref, sizes)
        return Tiling(num_devices)
    if any(size < 1 for size in sizes) or math.prod(sizes) != num_devices:
        raise InvalidRequest(
            f"a named sharding's mesh of axis sizes {sizes} does not hold the {num_devices} devices it was sent with; "
            "give it as many devices as its mesh has"
        )
    mesh_devices = _mesh_devices(named.mesh, num_devices)
    unreduced = [_axis_part(ref, sizes) for ref in named.unreduced_axes]
    if any(size > 1 for _, size, _ in unreduced):
        raise Unimplemented(
            "a named sharding with unreduced axes (partial sums) cannot describe an array on this server; "
            "reduce the array (or give it a tiled or replicated sharding) first"
        )
    for ref in named.replicated_axes:
        _axis_part(ref, sizes)
    for dim in named.dim_shardings:
        check_no_unknown_fields(dim, "named sharding's dimension")
    dims = [[_axis_part(ref, sizes) for ref in dim.axes] for dim in named.dim_shardings]
    partitions = tuple(math.prod(size for _, size, _ in axes) for axes in dims)
    tiles = math.prod(partitions)
    if tiles == 1:
        return Tiling(num_devices)
    keys = {}
    for position, coordinate in enumerate(itertools.product(*(range(size) for size in sizes))):
        keys[mesh_devices[position]] = tuple(_tile_index(axes, coordinate) for axes in dims)
    holders: dict[tuple[int, ...], int] = {}
    for key in keys.values():
        holders[key] = holders.get(key, 0) + 1
    replicas = num_devices // tiles
    if len(holders) != tiles or any(count != replicas for count in holders.values()):
        raise InvalidRequest(
            "a named sharding uses a mesh axis (or part of one) more than once; shard each axis over one dimension"
        )
    order = sorted(mesh_devices, key=keys.__getitem__)  # stable: mesh order among a tile's holders
    return Tiling(num_devices, partitions, replicas, tuple(order))


def _mesh_devices(mesh, num_devices: int) -> list[int]:
    """The device position at each mesh coordinate (row-major): explicit, an iota transform, or in order."""
    explicit = list(mesh.device_ids)
    if mesh.HasField("iota_transform"):
        check_no_unknown_fields(mesh.iota_transform, "named sharding's mesh iota")
        if explicit:
            raise InvalidRequest("a named sharding's mesh gives both device_ids and an iota transform")
        reshape = list(mesh.iota_transform.reshape_dims)
        perm = list(mesh.iota_transform.transpose_perm)
        if any(d < 1 for d in reshape) or math.prod(reshape) != num_devices:
            raise InvalidRequest(f"a mesh iota's reshape_dims {reshape} do not multiply to the {num_devices} devices")
        if sorted(perm) != list(range(len(reshape))):
            raise InvalidRequest(f"a mesh iota's transpose_perm {perm} is not a permutation of its reshape_dims")
        return _iota(reshape, perm)
    if not explicit:
        return list(range(num_devices))
    if sorted(explicit) != list(range(num_devices)):
        raise InvalidRequest(
            f"a named sharding's mesh device_ids {explicit} must name each of the {num_devices} devices "
            f"(positions 0 to {num_devices - 1}) exactly once"
        )
    return explicit


def _axis_part(ref, sizes: list[int]) -> tuple[int, int, int]:
    """(mesh axis, size, stride) of an axis reference: a whole axis, or the sub-axis ``(pre_size)size`` of one."""
    check_no_unknown_fields(ref, "named sharding's axis reference")
    index = ref.mesh_axis_index
    if not 0 <= index < len(sizes):
        raise InvalidRequest(f"a named sharding names mesh axis {index} of a mesh with {len(sizes)} axes")
    full = sizes[index]
    if not ref.HasField("sub_axis_info"):
        return index, full, 1
    check_no_unknown_fields(ref.sub_axis_info, "named sharding's sub-axis")
    pre, size = ref.sub_axis_info.pre_size, ref.sub_axis_info.size
    if pre < 1 or size < 1 or full % (pre * size):
        raise InvalidRequest(f"sub-axis ({pre}){size} does not divide mesh axis {index} of size {full}")
    return index, size, full // (pre * size)


def _tile_index(axes: list[tuple[int, int, int]], coordinate: tuple[int, ...]) -> int:
    """A device's tile along one dimension: its (sub-)axis coordinates read as one mixed-radix number."""
    tile = 0
    for index, size, stride in axes:
        tile = tile * size + (coordinate[index] // stride) % size
    return tile
