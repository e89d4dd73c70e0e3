"""``xla.ifrt.proxy.GrpcIfrtService`` over gRPC: version handshake, session streams, host buffers.

Each ``IfrtSession`` stream gets a reader thread that serves requests in
arrival order while the gRPC handler thread writes replies as they come, so
reading never waits for writing and the client can pipeline freely.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from pathways_nb.protocol import attributes, schema
from pathways_nb.protocol.errors import RequestError
from pathways_nb.proxy import (
    handlers,  # noqa: F401 - importing registers the request handlers
    versions,
)
from pathways_nb.proxy.context import ProxyContext
from pathways_nb.proxy.session import Session

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = "xla.ifrt.proxy.GrpcIfrtService"
SESSION_METADATA_KEY = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA_KEY = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
CHUNK_BYTES = 1 << 20

_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}

# Devices (and their attributes) a new session gets: the proxy asks this
# when a session opens. The single-process server gives every session all its
# devices; the cluster asks its resource manager instead.
DevicePlan = Callable[[Session], tuple[Sequence[int], dict[int, dict]]]


class IfrtProxyService:
    """The servicer: sessions by id, and the four host-buffer side channels."""

    def __init__(self, context: ProxyContext, device_plan: DevicePlan | None = None):
        self.context = context
        self.messages = schema.load()
        self._device_plan = device_plan
        self._sessions: dict[int, Session] = {}
        self._sessions_lock = threading.Lock()
        self._session_ids = itertools.count(1)

    # -- handshake -------------------------------------------------------------------------

    def GetVersion(self, request, context):
        try:
            chosen = versions.choose(
                request.min_version.protocol_version,
                request.max_version.protocol_version,
                request.min_version.ifrt_serdes_version_number,
                request.max_version.ifrt_serdes_version_number,
            )
        except versions.VersionMismatch as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        response = self.messages.proxy.GrpcGetVersionResponse()
        response.version.protocol_version = chosen.protocol_version
        response.version.ifrt_serdes_version_number = chosen.serdes_version
        return response

    # -- the session stream ----------------------------------------------------------------

    def IfrtSession(self, request_iterator, context) -> Iterator:
        metadata = self._session_metadata(context)
        version = metadata.version
        if not versions.PROTOCOL_MIN <= version.protocol_version <= versions.PROTOCOL_MAX:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {version.protocol_version} is not served here "
                f"({versions.PROTOCOL_MIN}-{versions.PROTOCOL_MAX}); call GetVersion first",
            )
        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        session_id = next(self._session_ids)
        session = Session(
            session_id,
            versions.Negotiated(version.protocol_version, version.ifrt_serdes_version_number),
            self.context,
            device_ids=(),
            send=outgoing.put,
            init_attributes=attributes.to_dict(metadata.initialization_data),
        )
        device_ids, device_attributes = self._plan(session)
        session.device_ids = tuple(device_ids)
        session.device_attributes = device_attributes
        with self._sessions_lock:
            self._sessions[session_id] = session
        context.add_callback(lambda: self._end_session(session_id, "the client disconnected", outgoing))
        reader = threading.Thread(
            target=self._serve_requests,
            args=(session, request_iterator, outgoing),
            name=f"pathways-session-{session_id}",
            daemon=True,
        )
        reader.start()
        seq_num = 0
        while True:
            response = outgoing.get()
            if response is None:
                return
            if response.WhichOneof("response") is not None:
                response.response_metadata.seq_num = seq_num
                seq_num += 1
            yield response

    def _plan(self, session: Session) -> tuple[Sequence[int], dict[int, dict]]:
        if self._device_plan is None:
            return [d.id for d in self.context.runtime.devices], {}
        return self._device_plan(session)

    def _session_metadata(self, context):
        for key, value in context.invocation_metadata():
            if key == SESSION_METADATA_KEY:
                try:
                    return self.messages.proxy.GrpcIfrtSessionMetadata.FromString(value)
                except Exception:  # noqa: BLE001 - protobuf decode errors
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unable to parse GrpcIfrtSessionMetadata")
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"missing {SESSION_METADATA_KEY} metadata; connect with the IFRT proxy client",
        )

    def _serve_requests(self, session: Session, request_iterator, outgoing: queue.SimpleQueue) -> None:
        try:
            for request in request_iterator:
                session.handle(request)
        except grpc.RpcError:
            pass  # the client went away; the done-callback ends the session
        except Exception:
            _LOGGER.exception("session %d failed", session.session_id)
        self._end_session(session.session_id, "the session stream ended", outgoing)

    def _end_session(self, session_id: int, reason: str, outgoing: queue.SimpleQueue) -> None:
        with self._sessions_lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.close(f"session {session_id} ended: {reason}")
            outgoing.put(None)

    def sessions(self) -> list[Session]:
        with self._sessions_lock:
            return list(self._sessions.values())

    def close(self) -> None:
        for session in self.sessions():
            session.close("the server is shutting down")

    # -- host buffers ----------------------------------------------------------------------

    def _session(self, session_id: int, context) -> Session:
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id} does not exist (it may have ended)")
        return session

    def HostBufferStore(self, request_iterator, context):
        metadata = None
        for key, value in context.invocation_metadata():
            if key == STORE_METADATA_KEY:
                try:
                    metadata = self.messages.proxy.GrpcHostBufferStoreMetadata.FromString(value)
                except Exception:  # noqa: BLE001 - protobuf decode errors
                    context.abort(grpc.StatusCode.DATA_LOSS, "unable to parse GrpcHostBufferStoreMetadata")
        if metadata is None:
            context.abort(grpc.StatusCode.INTERNAL, f"missing {STORE_METADATA_KEY} metadata")
        session = self._session(metadata.session_id, context)
        size = metadata.buffer_size
        if size < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"negative buffer size {size}")
        data = _receive(request_iterator, size, context)
        try:
            session.host_buffers.store(metadata.handle, data)
        except RequestError as e:
            context.abort(_GRPC_CODES.get(e.code, grpc.StatusCode.INTERNAL), e.message)
        return self.messages.proxy.GrpcHostBufferStoreResponse()

    def HostBufferLookup(self, request, context):
        session = self._session(request.session_id, context)
        try:
            data = session.host_buffers.read(request.handle)
        except RequestError as e:
            context.abort(_GRPC_CODES.get(e.code, grpc.StatusCode.INTERNAL), e.message)
        response_type = self.messages.proxy.GrpcHostBufferLookupResponse
        if data.nbytes == 0:
            yield response_type()
            return
        for start in range(0, data.nbytes, CHUNK_BYTES):
            yield response_type(data=data[start : start + CHUNK_BYTES].tobytes())

    def HostBufferDelete(self, request, context):
        session = self._session(request.session_id, context)
        try:
            session.host_buffers.delete(request.handle)
        except RequestError as e:
            context.abort(_GRPC_CODES.get(e.code, grpc.StatusCode.INTERNAL), e.message)
        return self.messages.proxy.GrpcHostBufferDeleteResponse()

    def HostBufferReadFromDisk(self, request, context):
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this server does not read host buffers from a shared directory; unset "
            "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES on the client",
        )

    # -- wiring ----------------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        proxy = self.messages.proxy

        def codec(request_type, response_type) -> dict:
            return {
                "request_deserializer": request_type.FromString,
                "response_serializer": response_type.SerializeToString,
            }

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "GetVersion": grpc.unary_unary_rpc_method_handler(
                    self.GetVersion, **codec(proxy.GrpcGetVersionRequest, proxy.GrpcGetVersionResponse)
                ),
                "IfrtSession": grpc.stream_stream_rpc_method_handler(
                    self.IfrtSession, **codec(proxy.IfrtRequest, proxy.IfrtResponse)
                ),
                "HostBufferStore": grpc.stream_unary_rpc_method_handler(
                    self.HostBufferStore,
                    **codec(proxy.GrpcHostBufferStoreRequest, proxy.GrpcHostBufferStoreResponse),
                ),
                "HostBufferLookup": grpc.unary_stream_rpc_method_handler(
                    self.HostBufferLookup,
                    **codec(proxy.GrpcHostBufferLookupRequest, proxy.GrpcHostBufferLookupResponse),
                ),
                "HostBufferDelete": grpc.unary_unary_rpc_method_handler(
                    self.HostBufferDelete,
                    **codec(proxy.GrpcHostBufferDeleteRequest, proxy.GrpcHostBufferDeleteResponse),
                ),
                "HostBufferReadFromDisk": grpc.unary_unary_rpc_method_handler(
                    self.HostBufferReadFromDisk,
                    **codec(proxy.GrpcHostBufferReadFromDiskRequest, proxy.GrpcHostBufferReadFromDiskResponse),
                ),
            },
        )


def _receive(request_iterator, size: int, context) -> memoryview:
    """Joins upload chunks into one buffer of exactly ``size`` bytes."""
    buffer = bytearray(size)
    offset = 0
    for chunk in request_iterator:
        data = chunk.data
        end = offset + len(data)
        if end > size:
            context.abort(grpc.StatusCode.DATA_LOSS, f"host buffer upload is larger than its declared {size} bytes")
        buffer[offset:end] = data
        offset = end
    if offset != size:
        context.abort(grpc.StatusCode.DATA_LOSS, f"host buffer upload ended after {offset} of {size} bytes")
    return memoryview(buffer)
