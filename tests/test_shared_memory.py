"""Uploads through shared memory when client and proxy share a host; gRPC otherwise; downloads bitwise equal.

Real stock clients (subprocesses) against real ``pathways-nb proxy`` servers. A
server started with another ``PATHWAYS_SHM_ROOT`` has another host key: to the
client it is on another host. Bad files are sent with raw ``HostBufferReadFromDisk``
calls on a hand-driven session whose shared directory the server accepted.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from pathways_nb import testing
from pathways_nb.client import jax_plugin
from pathways_nb.core import session_options, shared_memory, tuning
from pathways_nb.launch.processes import ChildServer
from pathways_nb.protocol import attributes, dtypes, shardings

MIB = 1 << 20
HOST_LIMIT = 32 * MIB
THRESHOLD = tuning.CLIENT_SHARED_MEMORY_BYTES.value
CLIENTS = Path(__file__).with_name("clients")


@pytest.fixture(scope="module")
def near():
    """A proxy on this host, with a host-buffer quota."""
    with testing.proxy_process(
        2, "--session_host_buffer_bytes", str(HOST_LIMIT), "--host_buffer_timeout", "5"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    """A proxy whose private root is elsewhere: a client sees it as a server on another host."""
    env = dict(os.environ, **{shared_memory.ROOT_ENV: str(tmp_path_factory.mktemp("far-root"))})
    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "2"], env=env)
    try:
        server.start(60.0)
        yield server
    finally:
        server.close()


def _client(script: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """Runs the client ``script`` in a fresh process; it prints one JSON line, returned here."""
    process = testing.python_script(script, *args, env=env)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


ROUND_TRIPS = CLIENTS / "shm_round_trips.py"


def test_uploads_through_shared_memory_are_bitwise_equal_and_leave_no_file(near):
    # As a child of a pathways-nb process would have them: the parent's directory is never used.
    parents = str(shared_memory.private_root() / "ifrt-1-parent")
    inherited = {jax_plugin.DIRECTORY_ENV: parents, jax_plugin.THRESHOLD_ENV: str(THRESHOLD)}
    result = _client(ROUND_TRIPS, near.address, env=inherited)
    assert result["threshold"] == str(THRESHOLD)
    assert result["directory"] != parents
    assert result["directory"].startswith(str(shared_memory.private_root()))
    assert result["mode"] == 0o700
    assert result["left"] == ["owner"]  # every lt_<handle> was taken (and removed) by the server
    assert len(result["checked"]) == 7
    assert not os.path.exists(result["directory"])  # removed at the client's exit


def test_a_server_on_another_host_gets_uploads_over_grpc(far):
    result = _client(ROUND_TRIPS, far.address)
    assert result["directory"] is None and result["threshold"] is None
    assert len(result["checked"]) == 7


def test_the_first_connection_decides_and_a_later_one_elsewhere_is_refused_clearly(near, far):
    result = _client(CLIENTS / "shm_first_connection_decides.py", near.address, far.address)
    assert result["same"]
    assert "not on this host" in result["refused"] and "PATHWAYS_SHARED_MEMORY=0" in result["refused"]


def test_a_server_without_the_observe_api_answers_the_probe_at_once():
    """A gRPC server without the observe API (Pathways on Cloud) answers the probe at once: no shared memory."""
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        started = time.monotonic()
        assert jax_plugin._server_key(f"grpc://127.0.0.1:{port}", 10.0) == ""
        assert time.monotonic() - started < 5
    finally:
        server.stop(None)


def test_shared_memory_off_keeps_every_upload_on_grpc(near):
    result = _client(ROUND_TRIPS, near.address, env={shared_memory.ENABLE_ENV: "0"})
    assert result["directory"] is None and len(result["checked"]) == 7


def test_an_uploaded_mapping_is_the_device_array_and_goes_with_it(near):
    """Zero copies on the server: the device array aliases the mapped file, and deleting it unmaps it."""
    result = _client(CLIENTS / "shm_mapping_goes_with_its_array.py", near.address, str(near.process.pid))
    assert result == {"alive": 1, "after": 0}


# -- raw HostBufferReadFromDisk calls ------------------------------------------------------


class _SharedWireSession(testing.WireSession):
    """A hand-driven session that names a shared directory in its initialization data, as the plugin does."""

    def __init__(self, address: str, init: dict):
        import itertools
        import queue

        from pathways_nb.protocol import schema

        self.messages = schema.load()
        self.channel = grpc.insecure_channel(address.removeprefix("grpc://"))
        self._op_ids = itertools.count(1)
        self._requests = queue.SimpleQueue()
        metadata = self.messages.proxy.GrpcIfrtSessionMetadata()
        metadata.version.protocol_version = 25
        metadata.initialization_data.CopyFrom(attributes.to_proto(init))
        stream = self.channel.stream_stream(
            testing.SERVICE + "IfrtSession",
            request_serializer=lambda data: data,
            response_deserializer=self.messages.proxy.IfrtResponse.FromString,
        )
        self._responses = stream(
            iter(self._requests.get, None), metadata=((testing.SESSION_METADATA_KEY, metadata.SerializeToString()),)
        )
        self.session_id = self.call("init_request", self.messages.proxy.InitRequest()).init_response.session_id

    def read_from_disk(self, handle: int, size: int) -> None:
        call = self.channel.unary_unary(
            testing.SERVICE + "HostBufferReadFromDisk",
            request_serializer=self.messages.proxy.GrpcHostBufferReadFromDiskRequest.SerializeToString,
            response_deserializer=self.messages.proxy.GrpcHostBufferReadFromDiskResponse.FromString,
        )
        request = self.messages.proxy.GrpcHostBufferReadFromDiskRequest()
        request.metadata.session_id = self.session_id
        request.metadata.handle, request.metadata.buffer_size = handle, size
        call(request, timeout=30)  # an error here would end the stock client's session: there must be none

    def array_status(self, handle: int, nbytes: int) -> tuple[int, str]:
        """Makes a uint8 array of ``nbytes`` from host buffer ``handle``; the status of reading it back."""
        request = self.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
        request.dtype.kind = dtypes.from_numpy(np.dtype(np.uint8))
        request.shape.dims.append(nbytes)
        request.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
        self.call("make_array_from_host_buffer_request", request)
        read = self.messages.proxy.CopyToHostBufferRequest(array_handle=handle, host_buffer_handle=handle + 1000)
        status = self.call("copy_to_host_buffer_request", read).response_metadata.status
        return status.code, status.message


@pytest.fixture
def shared_dir():
    directory = shared_memory.SharedDirectory("test-ifrt")
    secret = secrets.token_hex(16)
    directory.write("owner", secret.encode())
    yield (
        directory,
        {
            session_options.SHARED_DIRECTORY: str(directory.path).encode(),
            session_options.SHARED_SECRET: secret.encode(),
            session_options.SHARED_HOST: session_options.shared_memory_key().encode(),
        },
    )
    directory.close()


def test_bad_shared_files_fail_their_arrays_and_the_server_keeps_serving(near, shared_dir):
    directory, init = shared_dir
    with _SharedWireSession(near.address, init) as wire:
        directory.write("lt_1", b"\x07" * 1000)
        wire.read_from_disk(1, 4096)  # declares more than the file holds
        code, message = wire.array_status(1, 4096)
        assert code == grpc.StatusCode.DATA_LOSS.value[0] and "holds 1000 bytes, not the 4096 declared" in message
        assert not (directory.path / "lt_1").exists()

        wire.read_from_disk(2, 64)  # no file at all
        code, message = wire.array_status(2, 64)
        assert code == grpc.StatusCode.DATA_LOSS.value[0] and "lt_2" in message

        directory.write("lt_3", b"\x01" * (HOST_LIMIT + 1))
        wire.read_from_disk(3, HOST_LIMIT + 1)  # over the session's quota
        code, message = wire.array_status(3, HOST_LIMIT + 1)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "--session_host_buffer_bytes" in message
        assert not (directory.path / "lt_3").exists()

        good = np.arange(3 * MIB, dtype=np.uint8) % 251
        directory.write("lt_4", good)
        wire.read_from_disk(4, good.nbytes)
        assert wire.array_status(4, good.nbytes) == (0, "")
        assert wire.lookup_host_buffer(1004) == good.tobytes()
        assert sorted(p.name for p in directory.path.iterdir()) == ["owner"]


def test_a_directory_the_client_cannot_prove_is_never_read(near, shared_dir):
    directory, init = shared_dir
    wrong = dict(init, **{session_options.SHARED_SECRET: b"not-the-secret"})
    with _SharedWireSession(near.address, wrong) as wire:
        directory.write("lt_5", b"\x01" * 64)
        wire.read_from_disk(5, 64)
        code, message = wire.array_status(5, 64)
        assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "is not a private directory of the client's" in message and "PATHWAYS_SHARED_MEMORY=0" in message
        assert (directory.path / "lt_5").exists()  # a directory it did not accept: nothing there is touched
    assert stat.S_IMODE(directory.path.stat().st_mode) == 0o700
