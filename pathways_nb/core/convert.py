"""Conversions between the cluster RPC messages and the values the proxy and workers use."""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from pathways_nb.core.runtime_api import Aval, ProgramInfo, Signature
from pathways_nb.protocol import dtypes, schema
from pathways_nb.protocol.errors import RequestError, error_for
from pathways_nb.protocol.op_sharding import REPLICATED, UNREDUCED
from pathways_nb.protocol.op_sharding import read as read_op_sharding
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.rpc import cluster_pb2 as pb


def status_of(error: RequestError, message: str | None = None) -> pb.Status:
    """A request error as the status a reply or a message between servers carries (``message`` replaces its own)."""
    return pb.Status(code=error.code, message=error.message if message is None else message)


def error_of(status: pb.Status) -> RequestError:
    """The request error a received status stands for."""
    return error_for(status.code, status.message)


def sharding_from_proto(proto: pb.Sharding) -> IfrtSharding:
    return IfrtSharding(
        tuple(proto.device_ids),
        proto.memory_kind if proto.has_memory_kind else None,
        proto.op_sharding or None,
    )


def sharding_to_proto(sharding: IfrtSharding) -> pb.Sharding:
    return pb.Sharding(
        device_ids=sharding.device_ids,
        op_sharding=sharding.op_sharding or b"",
        has_memory_kind=sharding.memory_kind is not None,
        memory_kind=sharding.memory_kind or "",
    )


def array_meta(kind: int, shape: tuple[int, ...], sharding: IfrtSharding) -> pb.ArrayMeta:
    return pb.ArrayMeta(dtype_kind=kind, shape=shape, sharding=sharding_to_proto(sharding))


def _aval_to_proto(aval: Aval) -> pb.Aval:
    kind = dtypes.TOKEN_KIND if aval.is_token else dtypes.from_numpy(aval.dtype)
    return pb.Aval(dtype_kind=kind, shape=aval.shape)


def _aval_from_proto(proto: pb.Aval) -> Aval:
    dtype = None if proto.dtype_kind == dtypes.TOKEN_KIND else np.dtype(dtypes.to_numpy(proto.dtype_kind))
    return Aval(tuple(proto.shape), dtype)


def program_to_proto(program: ProgramInfo) -> pb.CompiledProgram:
    proto = pb.CompiledProgram(
        name=program.name,
        has_fingerprint=program.fingerprint is not None,
        fingerprint=program.fingerprint or b"",
        args=[_aval_to_proto(a) for a in program.signature.args],
        results=[_aval_to_proto(a) for a in program.signature.results],
        has_parameter_shardings=program.parameter_op_shardings is not None,
        parameter_shardings=program.parameter_op_shardings or (),
        has_output_shardings=program.output_op_shardings is not None,
        output_shardings=program.output_op_shardings or (),
        parameter_layouts=[pb.Layout(minor_to_major=m) for m in program.parameter_layouts],
        output_layouts=[pb.Layout(minor_to_major=m) for m in program.output_layouts],
        output_memory_kinds=program.output_memory_kinds,
        donated_args=sorted(program.donated_args),
    )
    proto.memory_stats.update(program.memory_stats)
    return proto


def program_from_proto(proto: pb.CompiledProgram, device_ids: tuple[int, ...]) -> ProgramInfo:
    """The program as the proxy reports it, over ``device_ids`` (the proxy's ids)."""
    output_ops = tuple(proto.output_shardings) if proto.has_output_shardings else None
    results = tuple(_aval_from_proto(a) for a in proto.results)
    return ProgramInfo(
        device_ids=device_ids,
        signature=Signature(tuple(_aval_from_proto(a) for a in proto.args), results),
        output_shardings=output_shardings(output_ops, device_ids, len(results)),
        parameter_op_shardings=tuple(proto.parameter_shardings) if proto.has_parameter_shardings else None,
        output_op_shardings=output_ops,
        parameter_layouts=tuple(tuple(layout.minor_to_major) for layout in proto.parameter_layouts),
        output_layouts=tuple(tuple(layout.minor_to_major) for layout in proto.output_layouts),
        output_memory_kinds=tuple(proto.output_memory_kinds),
        memory_stats=dict(proto.memory_stats),
        donated_args=frozenset(proto.donated_args),
        name=proto.name,
        fingerprint=proto.fingerprint if proto.has_fingerprint else None,
    )


def output_shardings(
    op_shardings: tuple[bytes, ...] | None, device_ids: tuple[int, ...], count: int
) -> tuple[IfrtSharding, ...]:
    """Each result's sharding over ``device_ids`` from XLA's output OpShardings (read in pure Python).

    XLA gives a program without results one OpSharding (of its empty result tuple): no result has it.
    """
    if op_shardings is None or len(device_ids) == 1 or count == 0:
        return tuple(IfrtSharding(device_ids) for _ in range(count))
    result = []
    for index, serialized in enumerate(op_shardings):
        try:
            held = _holding_unreduced(serialized)
            replicated = read_op_sharding(held, len(device_ids)).is_fully_replicated
        except RequestError as e:
            raise type(e)(f"result {index} of the program: {e.message}") from e
        result.append(IfrtSharding(device_ids, None, None if replicated else held))
    return tuple(result)


def _holding_unreduced(serialized: bytes) -> bytes:
    """The layout that holds a result with unreduced parts: each device keeps a full-size partial value.

    Unreduced devices hold their partial sums as replicas hold copies (jax reads such an array only
    shard by shard, and a later program takes the shards as they are); any other sharding is returned as it is.
    """
    try:
        op = schema.load().xla.OpSharding.FromString(serialized)
    except DecodeError:
        return serialized  # read_op_sharding says what is wrong with it
    if op.type == UNREDUCED:
        return schema.load().xla.OpSharding(type=REPLICATED).SerializeToString()
    if UNREDUCED not in op.last_tile_dims:
        return serialized
    op.last_tile_dims[:] = [REPLICATED if kind == UNREDUCED else kind for kind in op.last_tile_dims]
    return op.SerializeToString()
