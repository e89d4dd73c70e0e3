"""The committed cluster RPC modules match cluster.proto in what matters, whatever grpcio-tools is installed.

The generated text carries the generator's own version (and its template changes between releases), so
comparing text would fail on every new grpcio-tools although nothing of ours changed (docs/testing.md,
"Generated code"). What must hold is what the code does: the message descriptors embedded in cluster_pb2
are those protoc compiles from cluster.proto now, and cluster_pb2_grpc wires every method of every service
with its path, its streaming kind and its message types, both on the client's stub and the server's side.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2

from pathways_nb.rpc import cluster_pb2, cluster_pb2_grpc, generate

KIND = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _compiled_descriptor(tmp_path: pathlib.Path) -> descriptor_pb2.FileDescriptorProto:
    """cluster.proto as the installed protoc compiles it now."""
    out = tmp_path / "cluster.pb"
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{generate.ROOT}",
        f"--descriptor_set_out={out}",
        str(generate.HERE / "cluster.proto"),
    ]
    subprocess.run(command, check=True, capture_output=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (compiled,) = files.file
    return compiled


def _without_json_names(file: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """The Python generator leaves fields' json_name out of the descriptor it embeds; a descriptor set has it."""

    def clear(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            clear(message.nested_type)

    clear(file.message_type)
    return file


def test_committed_messages_are_what_cluster_proto_compiles_to(tmp_path):
    compiled = _without_json_names(_compiled_descriptor(tmp_path))
    committed = _without_json_names(descriptor_pb2.FileDescriptorProto.FromString(cluster_pb2.DESCRIPTOR.serialized_pb))
    assert committed == compiled, "cluster_pb2.py is stale: run python -m pathways_nb.rpc.generate"


def _recorder(kind: str):
    def make(self, path, request_serializer=None, response_deserializer=None, **_):
        self.made[path] = (kind, request_serializer, response_deserializer)
        return path

    return make


class _RecordingChannel:
    """A channel that records what a generated stub asks of it, instead of calling anything."""

    def __init__(self):
        self.made: dict[str, tuple[str, object, object]] = {}

    unary_unary = _recorder("unary_unary")
    unary_stream = _recorder("unary_stream")
    stream_unary = _recorder("stream_unary")
    stream_stream = _recorder("stream_stream")


class _RecordingServer:
    """A server that records the handlers a generated add_*Servicer_to_server registers."""

    def __init__(self):
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers):
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service, handlers):
        self.handlers.append(grpc.method_handlers_generic_handler(service, handlers))


def _message(full_name: str):
    return getattr(cluster_pb2, full_name.rsplit(".", 1)[-1])


@pytest.mark.parametrize("service", sorted(cluster_pb2.DESCRIPTOR.services_by_name))
def test_committed_stubs_wire_every_method_of(service):
    described = cluster_pb2.DESCRIPTOR.services_by_name[service]
    channel = _RecordingChannel()
    getattr(cluster_pb2_grpc, f"{service}Stub")(channel)
    server = _RecordingServer()
    servicer = getattr(cluster_pb2_grpc, f"{service}Servicer")()
    getattr(cluster_pb2_grpc, f"add_{service}Servicer_to_server")(servicer, server)
    assert len(channel.made) == len(described.methods), f"{service}Stub's methods differ from cluster.proto's"
    for method in described.methods:
        path = f"/{described.full_name}/{method.name}"
        kind = KIND[(method.client_streaming, method.server_streaming)]
        request, response = _message(method.input_type.full_name), _message(method.output_type.full_name)
        assert channel.made[path] == (kind, request.SerializeToString, response.FromString), path
        assert callable(getattr(servicer, method.name)), path

        class _Details(grpc.HandlerCallDetails):
            method = path
            invocation_metadata = ()

        handler = next(h.service(_Details()) for h in server.handlers if h.service(_Details()) is not None)
        assert (handler.request_streaming, handler.response_streaming) == (
            method.client_streaming,
            method.server_streaming,
        ), path
        assert handler.request_deserializer == request.FromString, path
        assert handler.response_serializer == response.SerializeToString, path


def test_generate_still_writes_both_modules(tmp_path):
    generate.generate(tmp_path)
    for name in ("cluster_pb2.py", "cluster_pb2_grpc.py"):
        assert "pathways_nb.v1" in (tmp_path / name).read_text()
