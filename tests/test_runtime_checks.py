"""The single-process proxy and a cluster refuse the same bad requests with the same error.

Both runtimes check what a client sends with the functions of ``runtime_api``
(shardings) and the protocol handlers (shards of host buffers); each request
here goes to both servers and the replies are compared. Only the list of the
session's devices may differ (a cluster session holds the cluster's devices).
"""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from pathways_nb.protocol import dtypes
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.testing import WireSession

F32 = dtypes.from_numpy(np.dtype(np.float32))
I32 = dtypes.from_numpy(np.dtype(np.int32))
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


def _put(wire: WireSession, handle: int, sharding: IfrtSharding):
    """``make_array_from_host_buffer`` of a float32[2, 2] laid out by ``sharding``."""
    wire.store_host_buffer(handle, np.zeros((2, 2), np.float32).tobytes())
    request = wire.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
    request.dtype.kind = F32
    request.shape.dims.extend((2, 2))
    request.sharding.CopyFrom(sharding.to_proto())
    return wire.call("make_array_from_host_buffer_request", request)


def _put_shards(wire: WireSession, handle: int, devices, buffers, covered):
    """A float32[4, 2] over ``devices`` (rows split) from host buffers ``(dtype kind, shape)`` covering ``covered``."""
    tiled = wire.messages.xla.OpSharding(type=3, tile_assignment_dimensions=[len(devices), 1])
    tiled.tile_assignment_devices.extend(range(len(devices)))
    request = wire.messages.proxy.MakeArraysFromHostBufferShardsRequest(array_handles=[handle])
    spec = request.specs.add()
    spec.array_spec.dtype.kind = F32
    spec.array_spec.shape.dims.extend((4, 2))
    spec.array_spec.sharding.CopyFrom(IfrtSharding(tuple(devices), None, tiled.SerializeToString()).to_proto())
    for index, ((kind, shape), shards) in enumerate(zip(buffers, covered, strict=True)):
        buffer_handle = handle * 10 + index
        wire.store_host_buffer(buffer_handle, np.zeros(shape, dtypes.to_numpy(kind)).tobytes())
        buffer = spec.host_buffers.add(host_buffer_handle=buffer_handle)
        buffer.dtype.kind = kind
        buffer.shape.dims.extend(shape)
        spec.addressable_shard_indices.add(indices=shards)
    return wire.call("make_arrays_from_host_buffer_shards_request", request)


# name -> (request on the session's first two devices, expected status code, expected start of the message)
CASES = {
    "device twice": (lambda w, d: _put(w, 1, IfrtSharding((d[0], d[0]))), INVALID, "a sharding lists a device twice"),
    "unknown memory kind": (
        lambda w, d: _put(w, 2, IfrtSharding(tuple(d), "hbm")),
        INVALID,
        f"memory kind 'hbm' does not exist on device 0; use one of {['device', 'pinned_host', 'unpinned_host']}",
    ),
    "unknown device": (
        lambda w, d: _put(w, 3, IfrtSharding((d[0], 99))),
        NOT_FOUND,
        "device 99 is not allocated to this session",
    ),
    "too few shards": (
        lambda w, d: _put_shards(w, 4, d, [(F32, (2, 2))], [[0]]),
        INVALID,
        "host buffers cover 1 of 2 shards",
    ),
    "wrong shard shape": (
        lambda w, d: _put_shards(w, 5, d, [(F32, (1, 2)), (F32, (2, 2))], [[0], [1]]),
        INVALID,
        "a host buffer of float32[1, 2] for shards of float32[2, 2]",
    ),
    "wrong shard dtype": (
        lambda w, d: _put_shards(w, 6, d, [(F32, (2, 2)), (I32, (2, 2))], [[0], [1]]),
        INVALID,
        "a host buffer of int32[2, 2] for shards of float32[2, 2]",
    ),
}


@pytest.fixture(scope="module")
def servers(proxy_server, cluster):
    """A wire session on each kind of server, and its first two devices (the same ids on both)."""
    sessions = {"single-process": WireSession(proxy_server.address), "cluster": WireSession(cluster.address)}
    yield {name: (wire, sorted(wire.init_response.addressable_device_ids)[:2]) for name, wire in sessions.items()}
    for wire in sessions.values():
        wire.close()


def _shown(message: str) -> str:
    """The message without the session's device list, which differs between the servers."""
    return re.sub(r"\(devices \[[\d, ]*\]\)", "(devices ...)", message)


@pytest.mark.parametrize("case", CASES)
def test_both_runtimes_refuse_the_same_bad_request_in_the_same_words(servers, case):
    request, code, message = CASES[case]
    replies = {}
    for name, (wire, devices) in servers.items():
        assert devices == [0, 1], devices
        status = request(wire, devices).response_metadata.status
        replies[name] = (status.code, _shown(status.message))
    assert replies["single-process"] == replies["cluster"], replies
    got_code, got_message = replies["cluster"]
    assert got_code == code and got_message.startswith(message), replies


def test_both_runtimes_describe_devices_alike(servers):
    """Same attributes on both; the cluster's devices also say where they are (their worker)."""
    described = {}
    for name, (wire, _devices) in servers.items():
        device = next(d for d in wire.init_response.all_devices if d.id == 0)
        described[name] = device
        assert (device.debug_string, device.to_string) == (
            "cpu:0",
            "CpuDevice(id=0)" if name != "cluster" else "CpuDevice(id=0, slice_index=0)",
        )
    names = {name: sorted(device.attributes.attributes) for name, device in described.items()}
    assert names["single-process"] == names["cluster"] == ["coords", "host", "host_index", "island", "slice_index"], (
        names
    )
