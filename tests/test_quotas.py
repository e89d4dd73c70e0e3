"""Per-session quotas: host-buffer and device bytes are counted before anything is allocated.

One ``pathways-nb proxy`` with small limits serves these tests. A client that
declares a huge upload, sends a different size than it declared, or keeps
more arrays than its limit gets a clear error at once (naming the flag that
raises the limit), the server's memory does not grow, and every other
session goes on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest

from pathways_nb import testing
from pathways_nb.protocol import dtypes, shardings
from pathways_nb.testing import WireSession

MIB = 1 << 20
CLIENTS = Path(__file__).with_name("clients")
HOST_LIMIT = 64 * MIB
DEVICE_LIMIT = 32 * MIB
F32 = dtypes.from_numpy(np.dtype(np.float32))


@pytest.fixture(scope="module")
def limited():
    with testing.proxy_process(
        4,
        "--session_host_buffer_bytes",
        str(HOST_LIMIT),
        "--session_device_bytes",
        str(DEVICE_LIMIT),
        "--host_buffer_timeout",
        "5",
    ) as server:
        yield server


@pytest.fixture
def wire(limited):
    with WireSession(limited.address) as session:
        yield session


def _rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def _status(response) -> tuple[int, str]:
    return response.response_metadata.status.code, response.response_metadata.status.message


def _round_trip(session: WireSession, handle: int, value: np.ndarray) -> np.ndarray:
    """Uploads ``value``, makes an array of it on device 0 and reads it back (the session still works)."""
    session.store_host_buffer(handle, value.tobytes())
    request = session.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
    request.dtype.kind = dtypes.from_numpy(value.dtype)
    request.shape.dims.extend(value.shape)
    request.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
    assert _status(session.call("make_array_from_host_buffer_request", request)) == (0, "")
    read = session.messages.proxy.CopyToHostBufferRequest(array_handle=handle, host_buffer_handle=handle + 1)
    assert _status(session.call("copy_to_host_buffer_request", read)) == (0, "")
    data = session.lookup_host_buffer(handle + 1)
    session.delete_host_buffer(handle + 1)
    session.call("destruct_array_request", session.messages.proxy.DestructArrayRequest(array_handle=[handle]))
    return np.frombuffer(data, value.dtype).reshape(value.shape)


def _array_from(session: WireSession, handle: int, shape: tuple[int, ...]) -> tuple[int, str]:
    """Makes an f32 array from host buffer ``handle`` and reads it: the status the client would see."""
    request = session.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
    request.dtype.kind = F32
    request.shape.dims.extend(shape)
    request.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
    session.call("make_array_from_host_buffer_request", request)
    read = session.messages.proxy.CopyToHostBufferRequest(array_handle=handle, host_buffer_handle=handle + 1000)
    return _status(session.call("copy_to_host_buffer_request", read))


def test_a_declared_huge_upload_is_refused_at_once_and_costs_no_memory(limited, wire):
    """The upload RPC itself succeeds (the stock client drops its session on an upload error): the array fails."""
    before = _rss(limited)
    started = time.monotonic()
    wire.store_host_buffer(1, b"\x01" * 4096, declared_size=1 << 33)
    assert time.monotonic() - started < 5
    code, message = _array_from(wire, 1, (1024,))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "8.0 GiB" in message and "64.0 MiB" in message and "--session_host_buffer_bytes" in message
    assert _rss(limited) - before < 16 * MIB
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_round_trip(wire, 10, value), value)


def test_an_upload_that_declares_more_than_it_sends_commits_only_what_arrived(limited, wire):
    """Bytes are written as they arrive: declaring 60 MiB and sending 1 KiB does not cost 60 MiB."""
    before = _rss(limited)
    with pytest.raises(grpc.RpcError) as error:
        wire.store_host_buffer(2, b"\x01" * 1024, declared_size=60 * MIB)
    assert error.value.code() == grpc.StatusCode.DATA_LOSS
    assert f"after 1024 of {60 * MIB} bytes" in error.value.details()
    assert _rss(limited) - before < 16 * MIB


def test_an_upload_larger_than_declared_is_data_loss(wire):
    with pytest.raises(grpc.RpcError) as error:
        wire.store_host_buffer(3, b"\x01" * (3 * MIB), declared_size=2 * MIB)
    assert error.value.code() == grpc.StatusCode.DATA_LOSS
    assert f"larger than its declared {2 * MIB} bytes" in error.value.details()
    value = np.ones((5,), np.int32)
    np.testing.assert_array_equal(_round_trip(wire, 20, value), value)


def test_a_failed_upload_frees_its_memory_and_its_quota_at_once(limited, wire):
    before = _rss(limited)
    with pytest.raises(grpc.RpcError) as error:
        wire.store_host_buffer(4, b"\x02" * (40 * MIB), declared_size=48 * MIB)
    assert error.value.code() == grpc.StatusCode.DATA_LOSS
    # Less than the 40 MiB that arrived (gRPC keeps some receive buffers of its own).
    assert _rss(limited) - before < 32 * MIB
    # The 48 MiB it reserved are free again: 60 of the session's 64 MiB can be uploaded.
    wire.store_host_buffer(5, b"\x03" * (60 * MIB))
    assert wire.lookup_host_buffer(5)[-3:] == b"\x03\x03\x03"


def test_stored_host_buffers_count_until_deleted(wire):
    wire.store_host_buffer(6, b"\x00" * (40 * MIB))
    wire.store_host_buffer(7, b"\x00" * (40 * MIB))
    code, message = _array_from(wire, 7, (1024,))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "needs 40.0 MiB" in message and "already holds 40.0 MiB" in message
    wire.delete_host_buffer(6)
    wire.store_host_buffer(8, b"\x05" * (40 * MIB))
    assert wire.lookup_host_buffer(8)[-2:] == b"\x05\x05"


def test_a_session_that_ends_gives_its_quota_back(limited):
    """Each session has its own limit; what an ended session held is gone with it."""
    with WireSession(limited.address) as first:
        first.store_host_buffer(1, b"\x00" * (50 * MIB))
    with WireSession(limited.address) as second:
        second.store_host_buffer(1, b"\x00" * (50 * MIB))


def test_a_client_over_its_host_buffer_quota_gets_resource_exhausted_and_its_session_lives(limited):
    client = testing.python_script(CLIENTS / "over_host_buffer_quota.py", limited.address)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err[-4000:]
    report = json.loads(out.splitlines()[-1])
    # Over both limits: the device limit is checked first; either way the session lives on.
    assert "RESOURCE_EXHAUSTED" in report["over"] and "--session_" in report["over"], report
    assert report["after"] == 12.0


def test_a_client_over_its_device_memory_gets_resource_exhausted_and_can_go_on(limited):
    client = testing.python_script(CLIENTS / "over_device_quota.py", limited.address)
    try:
        first = client.stdout.readline()
        assert first, client.stderr.read()[-4000:]
        assert json.loads(first) == {"sums": [0.0, 1.0, 2.0, 3.0]}
        # Another session is not affected by this one's limit.
        with WireSession(limited.address) as other:
            value = np.arange(2 * MIB, dtype=np.float32)
            np.testing.assert_array_equal(_round_trip(other, 100, value), value)
        out, err = client.communicate("go\n", timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err[-4000:]
    report = json.loads(out.splitlines()[-1])
    for key in ("over", "program"):
        assert "RESOURCE_EXHAUSTED" in report[key], report
        assert "--session_device_bytes" in report[key] and "32.0 MiB" in report[key], report
    assert report["after_delete"] == 28.0
