"""The pure-Python OpSharding reader agrees with jax and XLA, and refuses what would crash XLA.

Valid shardings are compared with jax's own answers (``NamedSharding`` over
this process's 4 CPU devices, and XLA's ``HloSharding`` for hand-written
OpShardings over up to 16 devices, which need no real devices). Malformed
ones must raise a clear ``InvalidRequest``/``Unimplemented``, in this process
and through a real server, which must keep serving afterwards.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from jax._src import op_shardings
from jax._src.lib import xla_client as xc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_nb import testing
from pathways_nb.core import convert
from pathways_nb.protocol import dtypes, op_sharding, schema, shardings
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented
from pathways_nb.testing import WireSession

MESSAGES = schema.load()
OpSharding = MESSAGES.xla.OpSharding
VERSION = op_sharding.server_jaxlib_version()
NEWER = f"newer than this server's jaxlib {VERSION}"

MESH_SHAPES = [((4,), ("x",)), ((2, 2), ("x", "y")), ((1, 4), ("x", "y")), ((4, 1), ("x", "y"))]
DEVICE_ORDERS = [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]
SPECS = [
    P(),
    P("x"),
    P(None, "x"),
    P("y"),
    P("x", "y"),
    P("y", "x"),
    P(("x", "y")),
    P(("y", "x")),
    P(None, ("x", "y")),
    P("x", None, "y"),
]
SHAPES = [(8,), (8, 12), (4, 8, 4), (0, 4)]


def _named_cases():
    devices = jax.devices("cpu")
    for (mesh_shape, names), order, spec, shape in itertools.product(MESH_SHAPES, DEVICE_ORDERS, SPECS, SHAPES):
        used = {
            axis for entry in spec if entry is not None for axis in (entry if isinstance(entry, tuple) else (entry,))
        }
        if len(spec) > len(shape) or not used <= set(names):
            continue
        mesh = Mesh(np.array([devices[i] for i in order]).reshape(mesh_shape), names)
        yield NamedSharding(mesh, spec), shape


def _tiling_of(sharding: NamedSharding, rank: int) -> tuple[op_sharding.Tiling, xc.HloSharding, list]:
    hlo = sharding._to_xla_hlo_sharding(rank)
    device_list = list(sharding._device_assignment)
    return op_sharding.read(hlo.to_proto().SerializeToString(), len(device_list)), hlo, device_list


def test_named_shardings_match_jax():
    compared = 0
    for sharding, shape in _named_cases():
        tiling, hlo, device_list = _tiling_of(sharding, len(shape))
        by_device = sharding.devices_indices_map(shape)
        assert tiling.shard_indices(shape) == tuple(by_device[d] for d in device_list), (sharding, shape)
        assert tiling.shard_shape(shape) == sharding.shard_shape(shape), (sharding, shape)
        assert tiling.is_fully_replicated == sharding.is_fully_replicated, (sharding, shape)
        assert tiling.num_devices == len(device_list) == 4
        # The plain form handed to workers' XLA is the same sharding as XLA's own.
        assert _hlo(tiling.to_proto()) == hlo, (sharding, shape)
        compared += 1
    assert compared > 300


def test_ifrt_sharding_from_a_named_sharding_matches_jax():
    """The whole path a client's array takes: its IFRT HloSharding proto, read by the proxy."""
    devices = jax.devices("cpu")
    mesh = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    for spec in [P("x", "y"), P("y"), P(), P(None, ("y", "x"))]:
        sharding = NamedSharding(mesh, spec)
        proto = MESSAGES.ifrt.ShardingProto()
        body = MESSAGES.ifrt.HloShardingProto()
        body.devices.device_ids.extend(d.id for d in sharding._device_assignment)
        body.xla_op_sharding.ParseFromString(sharding._to_xla_hlo_sharding(2).to_proto().SerializeToString())
        proto.serialized_sharding.type_name = shardings.HLO
        proto.serialized_sharding.data = body.SerializeToString()
        ifrt = shardings.from_proto(proto)
        assert (ifrt.op_sharding is None) == sharding.is_fully_replicated
        by_device = sharding.devices_indices_map((4, 8))
        assert ifrt.shard_indices((4, 8)) == tuple(by_device[devices[i]] for i in ifrt.device_ids)
        assert ifrt.shard_shape((4, 8)) == sharding.shard_shape((4, 8))
        assert ifrt.with_devices((7, 6, 5, 4), "device").shard_indices((4, 8)) == ifrt.shard_indices((4, 8))


def _hlo(op) -> xc.HloSharding:
    parsed = xc.OpSharding()
    parsed.ParseFromString(op.SerializeToString())
    return xc.HloSharding.from_proto(parsed)


def _permutation(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


# Hand-written OpShardings (valid), as XLA and newer or older jax write them: explicit devices,
# iota tile assignments with transposes, partial replication both ways, subgroups of size 1.
HAND_WRITTEN = [
    dict(type=op_sharding.OTHER, tile_assignment_dimensions=[8], tile_assignment_devices=_permutation(8, 1)),
    dict(type=op_sharding.OTHER, tile_assignment_dimensions=[2, 4], tile_assignment_devices=_permutation(8, 2)),
    dict(type=op_sharding.OTHER, tile_assignment_dimensions=[2, 2, 2], iota_reshape_dims=[8], iota_transpose_perm=[0]),
    dict(
        type=op_sharding.OTHER, tile_assignment_dimensions=[4, 2], iota_reshape_dims=[2, 4], iota_transpose_perm=[1, 0]
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[4, 4],
        iota_reshape_dims=[2, 2, 4],
        iota_transpose_perm=[2, 0, 1],
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[2, 1, 4],
        tile_assignment_devices=_permutation(8, 3),
        replicate_on_last_tile_dim=True,
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[2, 2, 4],
        iota_reshape_dims=[4, 4],
        iota_transpose_perm=[1, 0],
        replicate_on_last_tile_dim=True,
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[4, 2],
        tile_assignment_devices=_permutation(8, 4),
        last_tile_dims=[op_sharding.REPLICATED],
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[2, 2, 2],
        tile_assignment_devices=_permutation(8, 5),
        last_tile_dims=[op_sharding.REPLICATED, op_sharding.REPLICATED],
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[8, 1],
        tile_assignment_devices=_permutation(8, 6),
        last_tile_dims=[op_sharding.MANUAL],
    ),
    dict(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[1, 8],
        tile_assignment_devices=_permutation(8, 7),
        replicate_on_last_tile_dim=True,
    ),
    dict(type=op_sharding.OTHER, tile_assignment_dimensions=[1, 1], tile_assignment_devices=[0]),
    dict(type=op_sharding.REPLICATED),
    dict(type=op_sharding.MAXIMAL, tile_assignment_devices=[0]),
]


@pytest.mark.parametrize("fields", HAND_WRITTEN, ids=lambda f: str(sorted(f.items())))
def test_hand_written_op_shardings_match_xla(fields):
    op = OpSharding(**fields)
    dims = list(op.tile_assignment_dimensions)
    num_devices = int(np.prod(dims)) if dims else 1
    subgroups = 1 if op.replicate_on_last_tile_dim else len(op.last_tile_dims)
    rank = max(len(dims) - subgroups, 0) or 2
    hlo = _hlo(op)
    tiling = op_sharding.read(op.SerializeToString(), num_devices)
    assert tiling.is_fully_replicated == op_shardings.is_hlo_sharding_replicated(hlo)
    shape = tuple(8 * (i + 1) for i in range(rank))
    expected = op_shardings.op_sharding_to_indices(hlo, shape, num_devices)
    assert tiling.shard_indices(shape) == expected
    if not tiling.is_fully_replicated:
        partitions, replicas = op_shardings.get_num_ways_dim_sharded(hlo)
        assert (list(tiling.partitions), tiling.replicas) == (partitions, replicas)
        assert tiling.shard_shape(shape) == tuple(d // p for d, p in zip(shape, partitions, strict=True))
        assert _hlo(tiling.to_proto()) == hlo


def test_uneven_shapes_round_shards_up_and_have_no_indices():
    """jax refuses to index uneven shards (``IndivisibleError``); XLA pads each shard to the rounded-up size."""
    devices = jax.devices("cpu")
    sharding = NamedSharding(Mesh(np.array(devices).reshape(2, 2), ("x", "y")), P("x", "y"))
    tiling, _, _ = _tiling_of(sharding, 2)
    with pytest.raises(ValueError, match="evenly divide"):
        sharding.devices_indices_map((5, 4))
    with pytest.raises(InvalidRequest, match=r"shape \[5, 4\] cannot be split evenly.*dimension 0 of size 5 into 2"):
        tiling.shard_indices((5, 4))
    assert tiling.shard_shape((5, 3)) == (3, 2)


def _tiled(**fields) -> bytes:
    return OpSharding(type=op_sharding.OTHER, **fields).SerializeToString()


MALFORMED = [
    (_tiled(tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2, 3]), 2, "for 4 devices.*with 2"),
    (_tiled(tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1, 1, 3]), 4, "exactly once"),
    (_tiled(tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1, 2, 7]), 4, "positions 0 to 3"),
    (_tiled(tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1, 2]), 4, "3 tile_assignment_devices"),
    (_tiled(tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1, 2, 3]), 0, "no devices"),
    (_tiled(tile_assignment_dimensions=[], tile_assignment_devices=[0]), 1, "at least 1"),
    (_tiled(tile_assignment_dimensions=[0, 4], tile_assignment_devices=[0, 1, 2, 3]), 4, "at least 1"),
    (_tiled(tile_assignment_dimensions=[4], iota_reshape_dims=[2, 3], iota_transpose_perm=[1, 0]), 4, "multiply"),
    (_tiled(tile_assignment_dimensions=[4], iota_reshape_dims=[2, 2], iota_transpose_perm=[1, 1]), 4, "permutation"),
    (_tiled(tile_assignment_dimensions=[4], iota_reshape_dims=[2, 2]), 4, "permutation"),
    (
        _tiled(tile_assignment_dimensions=[2], tile_assignment_devices=[0, 1], iota_reshape_dims=[2]),
        2,
        "both tile_assignment_devices and an iota",
    ),
    (
        _tiled(
            tile_assignment_dimensions=[2, 2],
            tile_assignment_devices=[0, 1, 2, 3],
            replicate_on_last_tile_dim=True,
            last_tile_dims=[op_sharding.REPLICATED],
        ),
        4,
        "both replicate_on_last_tile_dim and last_tile_dims",
    ),
    (
        _tiled(tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1, 2, 3], last_tile_dims=[0, 0]),
        4,
        "2 last_tile_dims for a tile assignment of 1",
    ),
    (
        _tiled(
            tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2, 3], last_tile_dims=[op_sharding.OTHER]
        ),
        4,
        "not OTHER",
    ),
    (OpSharding(type=op_sharding.MAXIMAL).SerializeToString(), 1, "must name one device"),
    (OpSharding(type=op_sharding.MAXIMAL, tile_assignment_devices=[3]).SerializeToString(), 2, "must name one"),
    (OpSharding(type=op_sharding.TUPLE).SerializeToString(), 2, "TUPLE"),
    (OpSharding(type=op_sharding.UNKNOWN).SerializeToString(), 2, "UNKNOWN"),
    (b"\xff\xff\xff", 2, "malformed OpSharding"),
]


@pytest.mark.parametrize(("serialized", "num_devices", "message"), MALFORMED)
def test_malformed_op_shardings_are_invalid_requests(serialized, num_devices, message):
    with pytest.raises(InvalidRequest, match=message):
        op_sharding.read(serialized, num_devices)


def _named_op() -> bytes:
    """A named (V3) OpSharding as jaxlib >= 0.11 writes it: array dimension 0 split over mesh axis x of size 2.

    jaxlib 0.10.2's ``HloSharding.from_proto`` reads it, then aborts the process when asked for its tiles;
    op_sharding reads it in Python (tests/test_named_op_sharding.py).
    """
    named = MESSAGES.xla.NamedShardingProto()
    named.mesh.axes.add(name="x", size=2)
    named.dim_shardings.add().axes.add(mesh_axis_index=0)
    return OpSharding(type=op_sharding.OTHER, named_sharding=named).SerializeToString()


def _newer_named_op() -> bytes:
    """``_named_op()`` with a field this schema does not know (varint field 100), as a newer XLA may add one."""
    named = OpSharding.FromString(_named_op()).named_sharding.SerializeToString() + b"\xa0\x06\x01"
    return OpSharding(
        type=op_sharding.OTHER, named_sharding=MESSAGES.xla.NamedShardingProto.FromString(named)
    ).SerializeToString()


UNSUPPORTED = [
    (OpSharding(type=op_sharding.MANUAL).SerializeToString(), 2, "MANUAL"),
    (OpSharding(type=op_sharding.UNREDUCED).SerializeToString(), 2, "UNREDUCED"),
    (OpSharding(type=op_sharding.MAXIMAL, tile_assignment_devices=[1]).SerializeToString(), 2, "SingleDevice"),
    (
        _tiled(tile_assignment_dimensions=[2, 2], iota_reshape_dims=[4], iota_transpose_perm=[0], last_tile_dims=[4]),
        4,
        "MANUAL subgroup",
    ),
    # What a newer XLA may send: a type this schema does not name, an unknown subgroup type,
    # a field this schema does not have (varint field 100), in an OpSharding and in a named (V3) one.
    (OpSharding(type=17).SerializeToString(), 2, f"{NEWER}.*type 17"),
    (
        _tiled(tile_assignment_dimensions=[2, 2], iota_reshape_dims=[4], iota_transpose_perm=[0], last_tile_dims=[9]),
        4,
        f"{NEWER}.*last_tile_dims type 9",
    ),
    (
        _tiled(tile_assignment_dimensions=[2], iota_reshape_dims=[2], iota_transpose_perm=[0]) + b"\xa0\x06\x01",
        2,
        NEWER,
    ),
    (_newer_named_op(), 2, f"{NEWER}.*named sharding field 100"),
]


@pytest.mark.parametrize(("serialized", "num_devices", "message"), UNSUPPORTED)
def test_unsupported_and_newer_op_shardings_are_unimplemented(serialized, num_devices, message):
    with pytest.raises(Unimplemented, match=message) as error:
        op_sharding.read(serialized, num_devices)
    if NEWER in message:
        assert f"use a client jax <= {VERSION}" in error.value.message


def test_unknown_fields_are_seen_by_this_protobuf():
    """The newer-format check relies on protobuf keeping unknown fields (upb does); a regression here would hide it."""
    op = OpSharding.FromString(_tiled(tile_assignment_dimensions=[1]) + b"\xa0\x06\x01")
    with pytest.raises(Unimplemented, match="OpSharding field 100"):
        op_sharding.check_no_unknown_fields(op, "OpSharding")
    op_sharding.check_no_unknown_fields(OpSharding(type=op_sharding.REPLICATED), "OpSharding")


def test_shard_indices_check_the_rank():
    tiling = op_sharding.read(_tiled(tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2, 3]), 4)
    with pytest.raises(InvalidRequest, match="over 2 dimensions was given for a rank-1 array"):
        tiling.shard_indices((8,))
    with pytest.raises(InvalidRequest, match="rank-3"):
        tiling.shard_shape((8, 8, 8))


def _sharding_proto(type_name: str, body) -> object:
    proto = MESSAGES.ifrt.ShardingProto()
    proto.serialized_sharding.type_name = type_name
    proto.serialized_sharding.data = body.SerializeToString() if hasattr(body, "SerializeToString") else body
    return proto


def _empty_concrete_even():
    return _sharding_proto(shardings.CONCRETE_EVEN, MESSAGES.ifrt.ConcreteEvenShardingProto(is_fully_replicated=True))


def _hlo_sharding(device_ids, op_bytes: bytes):
    body = MESSAGES.ifrt.HloShardingProto()
    body.devices.device_ids.extend(device_ids)
    body.xla_op_sharding.ParseFromString(op_bytes)
    return _sharding_proto(shardings.HLO, body)


NEWER_OP = _tiled(tile_assignment_dimensions=[2], iota_reshape_dims=[2], iota_transpose_perm=[0]) + b"\xa0\x06\x01"


def test_from_proto_refuses_empty_device_lists_for_every_type():
    replicated = OpSharding(type=op_sharding.REPLICATED).SerializeToString()
    for proto in [
        _empty_concrete_even(),
        _hlo_sharding([], replicated),
        _sharding_proto(shardings.OPAQUE, MESSAGES.ifrt.OpaqueShardingProto()),
    ]:
        with pytest.raises(InvalidRequest, match="no devices"):
            shardings.from_proto(proto)


def test_from_proto_checks_the_op_sharding_and_unknown_fields():
    with pytest.raises(InvalidRequest, match=r"for 4 devices.*with 2"):
        shardings.from_proto(_hlo_sharding([0, 1], _tiled(tile_assignment_dimensions=[4], iota_reshape_dims=[4])))
    with pytest.raises(Unimplemented, match=NEWER):
        shardings.from_proto(_hlo_sharding([0, 1], NEWER_OP))
    body = MESSAGES.ifrt.HloShardingProto.FromString(_hlo_sharding([0, 1], NEWER_OP).serialized_sharding.data)
    body.xla_op_sharding.Clear()
    with pytest.raises(Unimplemented, match=f"{NEWER}.*HloSharding field 100"):
        shardings.from_proto(_sharding_proto(shardings.HLO, body.SerializeToString() + b"\xa0\x06\x01"))
    # A tiling that covers every device with the whole array reads as fully replicated.
    all_ones = _tiled(
        tile_assignment_dimensions=[1, 1, 2],
        iota_reshape_dims=[2],
        iota_transpose_perm=[0],
        replicate_on_last_tile_dim=True,
    )
    assert shardings.from_proto(_hlo_sharding([4, 5], all_ones)).op_sharding is None


def test_program_output_shardings_are_read_without_xla():
    tiled = _tiled(tile_assignment_dimensions=[2], tile_assignment_devices=[1, 0])
    replicated = OpSharding(type=op_sharding.REPLICATED).SerializeToString()
    got = convert.output_shardings((tiled, replicated), (4, 5), 2)
    assert got == (shardings.IfrtSharding((4, 5), None, tiled), shardings.IfrtSharding((4, 5)))
    with pytest.raises(Unimplemented, match="result 1 of the program: MANUAL"):
        convert.output_shardings((tiled, OpSharding(type=op_sharding.MANUAL).SerializeToString()), (4, 5), 2)


WORKER_RUNTIME = Path(__file__).with_name("clients") / "worker_runtime_bad_shardings.py"


def test_the_worker_runtime_refuses_bad_shardings_before_xla_sees_them():
    """LocalRuntime (the workers' and the single-process proxy's) checks in Python first; XLA would abort."""
    process = testing.python_script(WORKER_RUNTIME)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    results: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, _, result = line.partition("|")
        results.setdefault(name, []).append(result)
    assert results.pop("good") == ["True"], out
    expected = {
        "empty": "InvalidRequest a sharding over no devices",
        "empty tiled": "InvalidRequest a sharding over no devices",
        "count": "InvalidRequest an OpSharding for 4 devices (tiles [2, 2]) was sent with 2 devices",
        "named": "accepted",
        "memory": "InvalidRequest memory kind 'hbm' does not exist",
        "twice": "InvalidRequest a sharding lists a device twice",
        "unknown": "NotFound device 9 is not one of this server's devices",
    }
    assert set(results) == set(expected), out
    for name, prefix in expected.items():
        assert len(results[name]) == 2 and all(r.startswith(prefix) for r in results[name]), (name, results[name])


# -- through a real server ------------------------------------------------------------------------


def _status(response):
    return response.response_metadata.status.code, response.response_metadata.status.message


def _put_request(wire, handle: int, sharding_proto, shape=(2, 2)):
    request = wire.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
    request.dtype.kind = dtypes.from_numpy(np.dtype(np.float32))
    request.shape.dims.extend(shape)
    request.sharding.CopyFrom(sharding_proto)
    return request


def test_bad_shardings_through_the_server_are_refused_and_it_keeps_serving(backend):
    """Each of these aborted the proxy process (an XLA CHECK) before shardings were read in Python."""
    with WireSession(backend.address) as wire:
        init = wire.call("init_request", wire.messages.proxy.InitRequest()).init_response
        devices = list(init.addressable_device_ids) or [d.id for d in init.all_devices]
        cases = [
            (_empty_concrete_even(), grpc.StatusCode.INVALID_ARGUMENT, "ConcreteEvenSharding with no devices"),
            (_hlo_sharding(devices[:2], NEWER_OP), grpc.StatusCode.UNIMPLEMENTED, NEWER),
            (_hlo_sharding(devices[:2], _newer_named_op()), grpc.StatusCode.UNIMPLEMENTED, NEWER),
        ]
        for handle, (proto, code, message) in enumerate(cases, start=100):
            wire.store_host_buffer(handle, np.zeros((2, 2), np.float32).tobytes())
            got_code, got_message = _status(
                wire.call("make_array_from_host_buffer_request", _put_request(wire, handle, proto))
            )
            assert got_code == code.value[0], (got_code, got_message)
            assert message in got_message
        # Still serving: a sharded array over two devices, written and read back.
        value = np.arange(4, dtype=np.float32).reshape(2, 2)
        tiled = _hlo_sharding(devices[:2], _tiled(tile_assignment_dimensions=[2, 1], tile_assignment_devices=[1, 0]))
        wire.store_host_buffer(200, value.tobytes())
        assert _status(wire.call("make_array_from_host_buffer_request", _put_request(wire, 200, tiled))) == (0, "")
        response = wire.call(
            "copy_to_host_buffer_request",
            wire.messages.proxy.CopyToHostBufferRequest(array_handle=200, host_buffer_handle=201),
        )
        assert _status(response) == (0, "")
        assert np.frombuffer(wire.lookup_host_buffer(201), np.float32).tolist() == value.ravel().tolist()
