"""The IFRT proxy requests a hand-driven session sends, built once for the blocking and the asyncio transport.

``WireSession`` (blocking gRPC, one thread per session) and ``AsyncWireSession``
(grpc.aio, many sessions as coroutines of one loop) differ only in how bytes
reach the proxy; what they send is built here.
"""

from __future__ import annotations

import itertools

from pathways_nb.protocol import schema

SERVICE = "/xla.ifrt.proxy.GrpcIfrtService/"
SESSION_METADATA_KEY = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA_KEY = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
CHUNK_BYTES = 1 << 20  # a host buffer upload's chunk


def identity(data: bytes) -> bytes:
    """The stream's serializer: requests are serialized before they are queued."""
    return data


class WireRequests:
    """The messages of one session: its op ids, its metadata, and each request it sends."""

    def __init__(self, protocol_version: int, serdes_version: int):
        self.messages = schema.load()
        self._op_ids = itertools.count(1)
        self._protocol_version = protocol_version
        self._serdes_version = serdes_version
        self.session_id = 0  # the proxy's, once the init request is answered

    def stub(self, channel, method: str):
        """The callable for ``method`` (``IfrtSession``, ``HostBufferStore``, ``HostBufferLookup`` or
        ``HostBufferDelete``) on ``channel``, a blocking ``grpc.Channel`` or a ``grpc.aio.Channel`` alike."""
        proxy = self.messages.proxy
        arity, request, response = {
            "IfrtSession": ("stream_stream", None, proxy.IfrtResponse),
            "HostBufferStore": ("stream_unary", proxy.GrpcHostBufferStoreRequest, proxy.GrpcHostBufferStoreResponse),
            "HostBufferLookup": (
                "unary_stream",
                proxy.GrpcHostBufferLookupRequest,
                proxy.GrpcHostBufferLookupResponse,
            ),
            "HostBufferDelete": ("unary_unary", proxy.GrpcHostBufferDeleteRequest, proxy.GrpcHostBufferDeleteResponse),
        }[method]
        serializer = identity if request is None else request.SerializeToString  # session requests: bytes already
        return getattr(channel, arity)(
            SERVICE + method, request_serializer=serializer, response_deserializer=response.FromString
        )

    def session_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The gRPC metadata that opens the session stream."""
        metadata = self.messages.proxy.GrpcIfrtSessionMetadata()
        metadata.version.protocol_version = self._protocol_version
        metadata.version.ifrt_serdes_version_number = self._serdes_version
        return ((SESSION_METADATA_KEY, metadata.SerializeToString()),)

    def request(self, kind: str, body) -> tuple[int, bytes]:
        """An ``IfrtRequest`` of ``kind`` (its oneof field) carrying ``body``: (its op id, its bytes)."""
        request = self.messages.proxy.IfrtRequest()
        op_id = next(self._op_ids)
        request.request_metadata.op_id = op_id
        getattr(request, kind).CopyFrom(body)
        return op_id, request.SerializeToString()

    def store_metadata(self, handle: int, size: int) -> tuple[tuple[str, bytes], ...]:
        """The gRPC metadata of a ``HostBufferStore`` call that uploads ``size`` bytes under ``handle``."""
        metadata = self.messages.proxy.GrpcHostBufferStoreMetadata(
            session_id=self.session_id, handle=handle, buffer_size=size
        )
        return ((STORE_METADATA_KEY, metadata.SerializeToString()),)

    def store_chunks(self, data: bytes) -> list:
        """``data`` as the ``HostBufferStore`` requests that carry it."""
        chunk = self.messages.proxy.GrpcHostBufferStoreRequest
        return [chunk(data=data[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)]

    def lookup_request(self, handle: int):
        return self.messages.proxy.GrpcHostBufferLookupRequest(session_id=self.session_id, handle=handle)

    def delete_request(self, handle: int):
        return self.messages.proxy.GrpcHostBufferDeleteRequest(session_id=self.session_id, handle=handle)

    def array_request(self, handle: int, shape, kind: int, device: int):
        """A MakeArrayFromHostBufferRequest of host buffer ``handle`` into array ``handle`` (``kind``: the
        IFRT dtype kind)."""
        from pathways_nb.protocol import shardings

        request = self.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=handle, array_handle=handle)
        request.dtype.kind = kind
        request.shape.dims.extend(shape)
        request.sharding.CopyFrom(shardings.IfrtSharding((device,)).to_proto())
        return request

    def value_request(self, handle: int, value, device: int):
        """``array_request`` for a numpy ``value`` uploaded under ``handle``."""
        from pathways_nb.protocol import dtypes

        return self.array_request(handle, value.shape, dtypes.from_numpy(value.dtype), device)

    def copy_request(self, array_handle: int, host_handle: int):
        """Asks for an array's bytes in host buffer ``host_handle``."""
        return self.messages.proxy.CopyToHostBufferRequest(array_handle=array_handle, host_buffer_handle=host_handle)

    def compile_request(self, program: tuple[bytes, bytes]):
        """A CompileRequest for ``program`` (from ``lowered_program``)."""
        artifact, options = program
        request = self.messages.proxy.CompileRequest()
        request.program.type_name = "xla::ifrt::XlaProgram"
        request.program.data = artifact
        request.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
        request.compile_options.data = options
        return request

    def execute_request(self, executable: int, args: list[int], results: list[int]):
        return self.messages.proxy.LoadedExecutableExecuteRequest(
            loaded_executable_handle=executable, args_handles=args, result_array_handle=results
        )

    def destruct_request(self, handles: list[int]):
        """Forgets arrays, as the client does when it drops them."""
        return self.messages.proxy.DestructArrayRequest(array_handle=handles)


def expect_reply(response, op_id: int):
    """``response``, if it answers ``op_id`` (replies to one request at a time come in order)."""
    if response.response_metadata.op_id != op_id:
        raise AssertionError(f"reply to op {response.response_metadata.op_id} while waiting for {op_id}")
    return response


def read_status_checked(response, array_handle: int) -> None:
    """Raises if the CopyToHostBuffer reply for ``array_handle`` is an error."""
    status = response.response_metadata.status
    if status.code:
        raise AssertionError(f"reading array {array_handle} failed: {status.message}")
