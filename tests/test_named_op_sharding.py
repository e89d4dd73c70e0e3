"""Named (HloShardingV3: mesh and axes) OpShardings are read in pure Python as jax lays arrays out.

jaxlib 0.10.2's XLA writes them for the outputs of programs a jaxlib >= 0.11
client lowered; a jaxlib 0.12 client aborts if a reply carries one. Each named
sharding here is built from a jax ``NamedSharding`` (mesh, device order,
partition spec) and must give every device the region jax gives it, and the
same tiling as jax's own plain (V2) form of it. This file imports only what
every supported jax has: tests/test_compat.py runs it under jax 0.12 too.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_nb.protocol import op_sharding, schema
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented

jax.config.update("jax_num_cpu_devices", 4)

MESSAGES = schema.load()
OpSharding = MESSAGES.xla.OpSharding
NEWER = f"newer than this server's jaxlib {op_sharding.server_jaxlib_version()}"

MESHES = [((4,), ("x",)), ((2, 2), ("x", "y")), ((1, 4), ("x", "y")), ((2, 1, 2), ("x", "y", "z"))]
DEVICE_ORDERS = [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]
SPECS = [P(), P("x"), P(None, "x"), P("y"), P("x", "y"), P("y", "x"), P(("x", "y")), P(("y", "z")), P("z", "x")]


def _named(mesh: Mesh, spec: P, rank: int, device_list: list) -> bytes:
    """The named OpSharding of ``NamedSharding(mesh, spec)`` for a sharding whose device list is ``device_list``."""
    op = OpSharding(type=op_sharding.OTHER)
    named = op.named_sharding
    for name, size in mesh.shape.items():
        named.mesh.axes.add(name=name, size=size)
    positions = [device_list.index(d) for d in mesh.devices.flat]
    if positions != list(range(len(positions))):
        named.mesh.device_ids.extend(positions)
    names = list(mesh.axis_names)
    for entry in (*spec, *([None] * (rank - len(spec)))):
        dim = named.dim_shardings.add(is_closed=True)
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            dim.axes.add(mesh_axis_index=names.index(axis))
    return op.SerializeToString()


def _regions(indices, shape) -> list[tuple]:
    return [tuple(s.indices(d) for s, d in zip(index, shape, strict=True)) for index in indices]


def _cases():
    devices = jax.devices("cpu")[:4]
    for (mesh_shape, names), order, spec in itertools.product(MESHES, DEVICE_ORDERS, SPECS):
        if any(axis not in names for entry in spec for axis in ((entry,) if isinstance(entry, str) else entry or ())):
            continue
        mesh = Mesh(np.array([devices[i] for i in order]).reshape(mesh_shape), names)
        shape = (8, 12, 4)[: max(len(spec), 1) + 1]
        yield mesh, spec, shape


def test_named_shardings_give_each_device_jax_s_region():
    """The device list is the sorted devices; the mesh names them in its own order (device_ids)."""
    checked = 0
    for mesh, spec, shape in _cases():
        device_list = sorted(mesh.devices.flat, key=lambda d: d.id)
        tiling = op_sharding.read(_named(mesh, spec, len(shape), device_list), len(device_list))
        got = dict(zip((d.id for d in device_list), _regions(tiling.shard_indices(shape), shape), strict=True))
        jax_map = NamedSharding(mesh, spec).devices_indices_map(shape)
        want = dict(zip((d.id for d in jax_map), _regions(jax_map.values(), shape), strict=True))
        assert got == want, (mesh, spec)
        checked += 1
    assert checked > 60


def test_named_shardings_read_as_jax_s_plain_form():
    """Over the mesh's own device order, the tiling (replica order included) is that of jax's V1/V2 OpSharding."""
    for mesh, spec, shape in _cases():
        sharding = NamedSharding(mesh, spec)
        plain = sharding._to_xla_hlo_sharding(len(shape)).to_proto().SerializeToString()
        named = _named(mesh, spec, len(shape), list(mesh.devices.flat))
        assert op_sharding.read(named, 4) == op_sharding.read(plain, 4), (mesh, spec)
        rewritten = op_sharding.plain(named, 4)
        assert not OpSharding.FromString(rewritten).HasField("named_sharding")
        assert op_sharding.read(rewritten, 4) == op_sharding.read(plain, 4)
        assert op_sharding.plain(plain, 4) == plain


def _op(mesh_sizes, dims, **fields) -> OpSharding:
    op = OpSharding(type=op_sharding.OTHER)
    for index, size in enumerate(mesh_sizes):
        op.named_sharding.mesh.axes.add(name=f"a{index}", size=size)
    for axes in dims:
        dim = op.named_sharding.dim_shardings.add()
        for axis in axes:
            ref = dim.axes.add(mesh_axis_index=axis[0])
            if len(axis) == 3:
                ref.sub_axis_info.pre_size, ref.sub_axis_info.size = axis[1:]
    for name, axes in fields.items():
        for axis in axes:
            getattr(op.named_sharding, name).add(mesh_axis_index=axis)
    return op


def test_sub_axes_and_iota_meshes():
    # Axis a0 of size 4 split into sub-axes (1)2 and (2)2 is the 2x2 mesh: dimension 0 over the major half.
    by_sub_axes = op_sharding.read(_op([4], [[(0, 1, 2)], [(0, 2, 2)]]).SerializeToString(), 4)
    assert by_sub_axes == op_sharding.read(_op([2, 2], [[(0,)], [(1,)]]).SerializeToString(), 4)
    major_only = op_sharding.read(_op([4], [[(0, 1, 2)]]).SerializeToString(), 4)
    assert (major_only.partitions, major_only.replicas, major_only.tile_devices) == ((2,), 2, (0, 1, 2, 3))
    # A mesh whose devices are an iota transform (transposed 2x2), and an empty mesh (replicated).
    transposed = _op([2, 2], [[(0,)]])
    transposed.named_sharding.mesh.iota_transform.reshape_dims.extend([2, 2])
    transposed.named_sharding.mesh.iota_transform.transpose_perm.extend([1, 0])
    assert op_sharding.read(transposed.SerializeToString(), 4).tile_devices == (0, 2, 1, 3)
    empty = OpSharding(type=op_sharding.OTHER)
    empty.named_sharding.mesh.SetInParent()
    assert op_sharding.read(empty.SerializeToString(), 4).is_fully_replicated


def _with_unknown_field(op: OpSharding) -> bytes:
    """``op`` with a field this schema does not have inside its named sharding (what a newer XLA may add)."""
    named = MESSAGES.xla.NamedShardingProto.FromString(op.named_sharding.SerializeToString() + b"\xa0\x06\x01")
    return OpSharding(type=op_sharding.OTHER, named_sharding=named).SerializeToString()


BAD = [
    (_op([2, 2], [[(0,)]]).SerializeToString(), 2, InvalidRequest, "mesh of axis sizes \\[2, 2\\] does not hold"),
    (_op([2], [[(1,)]]).SerializeToString(), 2, InvalidRequest, "names mesh axis 1 of a mesh with 1 axes"),
    (_op([2, 2], [[(0,)], [(0,)]]).SerializeToString(), 4, InvalidRequest, "more than once"),
    (_op([4], [[(0, 1, 3)]]).SerializeToString(), 4, InvalidRequest, "sub-axis \\(1\\)3 does not divide"),
    (_op([2, 2], [[(0,)]], unreduced_axes=[1]).SerializeToString(), 4, Unimplemented, "unreduced axes"),
    (_op([2, 2], [[(0,)]], manual_axes=[1]).SerializeToString(), 4, Unimplemented, "manual axes"),
    (
        OpSharding(
            type=op_sharding.OTHER, tile_assignment_dimensions=[2], named_sharding=_op([2], [[(0,)]]).named_sharding
        ).SerializeToString(),
        2,
        InvalidRequest,
        "both a named sharding and a tile assignment",
    ),
    (_with_unknown_field(_op([2], [[(0,)]])), 2, Unimplemented, f"{NEWER}.*named sharding field 100"),
]


@pytest.mark.parametrize(("serialized", "num_devices", "error", "message"), BAD)
def test_bad_named_shardings_are_refused_in_python(serialized, num_devices, error, message):
    with pytest.raises(error, match=message):
        op_sharding.read(serialized, num_devices)
