"""``xla.ifrt.proxy.GrpcIfrtService`` over gRPC: version handshake, session streams, host buffers.

The service runs on one asyncio loop (grpc.aio). A session's requests are
served on that loop as they arrive, and its replies are written by the
stream's generator as they are queued, from any thread: so reading never
waits for writing, the client can pipeline freely, and no message crosses
more threads than the loop's own.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
from collections.abc import AsyncIterator

import grpc

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import wait_on_loop
from pathways_nb.core.loop import call_on
from pathways_nb.protocol import attributes, data_messages, schema
from pathways_nb.protocol.errors import DataLoss, RequestError, grpc_code
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

# Error messages in a status trailer (a download's) are cut to this length (gRPC's limit on metadata is 8 KiB).
_TRAILER_CHARS = 4000


class _Outbox:
    """A session's replies, queued from any thread, written by the stream's generator."""

    def __init__(self) -> None:
        # Created on the loop's thread, inside the stream's coroutine.
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, response) -> None:
        call_on(self._loop, self._queue.put_nowait, response)

    def close(self, error: grpc.StatusCode | None = None, message: str = "") -> None:
        self.put(_Closed(error, message))

    async def get(self):
        return await self._queue.get()


class _Closed:
    """Ends the reply stream, with an error status if the client misbehaved."""

    def __init__(self, code: grpc.StatusCode | None, message: str):
        self.code = code
        self.message = message


class IfrtProxyService:
    """The servicer: sessions by id, and the four host-buffer side channels."""

    def __init__(self, context: ProxyContext):
        self.context = context
        self.messages = schema.load()
        self._sessions: dict[int, Session] = {}
        self._outboxes: dict[int, _Outbox] = {}
        self._sessions_lock = threading.Lock()
        self._session_ids = itertools.count(1)

    # -- handshake -------------------------------------------------------------------------

    async def GetVersion(self, request, context):
        try:
            chosen = versions.choose(
                request.min_version.protocol_version,
                request.max_version.protocol_version,
                request.min_version.ifrt_serdes_version_number,
                request.max_version.ifrt_serdes_version_number,
            )
        except versions.VersionMismatch as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        response = self.messages.proxy.GrpcGetVersionResponse()
        response.version.protocol_version = chosen.protocol_version
        response.version.ifrt_serdes_version_number = chosen.serdes_version
        return response

    # -- the session stream ----------------------------------------------------------------

    async def IfrtSession(self, request_iterator, context) -> AsyncIterator:
        metadata = await self._session_metadata(context)
        version = metadata.version
        if not versions.PROTOCOL_MIN <= version.protocol_version <= versions.PROTOCOL_MAX:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {version.protocol_version} is not served here "
                f"({versions.PROTOCOL_MIN}-{versions.PROTOCOL_MAX}); call GetVersion first",
            )
        outbox = _Outbox()
        session_id = next(self._session_ids)
        session = Session(
            session_id,
            versions.Negotiated(version.protocol_version, version.ifrt_serdes_version_number),
            self.context,
            send=outbox.put,
            init_attributes=attributes.to_dict(metadata.initialization_data),
        )
        session.host_buffers.use_shared_directory(session.init_attributes)
        with self._sessions_lock:
            self._sessions[session_id] = session
            self._outboxes[session_id] = outbox
        reader = asyncio.create_task(self._serve_requests(session, request_iterator, outbox))
        seq_num = 0
        try:
            while True:
                response = await outbox.get()
                if isinstance(response, _Closed):
                    if response.code is not None:
                        await context.abort(response.code, response.message)
                    return
                if response.WhichOneof("response") is not None:
                    response.response_metadata.seq_num = seq_num
                    seq_num += 1
                yield response
        finally:
            reader.cancel()
            self._end_session(session_id, "the client disconnected")

    async def _session_metadata(self, context):
        for key, value in context.invocation_metadata():
            if key == SESSION_METADATA_KEY:
                try:
                    return self.messages.proxy.GrpcIfrtSessionMetadata.FromString(value)
                except Exception:  # noqa: BLE001 - protobuf decode errors
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unable to parse GrpcIfrtSessionMetadata")
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"missing {SESSION_METADATA_KEY} metadata; connect with the IFRT proxy client",
        )

    async def _serve_requests(self, session: Session, request_iterator, outbox: _Outbox) -> None:
        parse = self.messages.proxy.IfrtRequest.FromString
        try:
            async for raw in request_iterator:
                try:
                    request = parse(raw)
                except Exception:  # noqa: BLE001 - protobuf decode errors
                    outbox.close(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed IfrtRequest ({len(raw)} bytes) on session {session.session_id}; "
                        "this stream only accepts messages of the IFRT proxy client",
                    )
                    return
                session.handle(request)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            pass  # the client went away
        except grpc.aio.AbortError:
            pass  # this server ended the stream (the client's disconnect, its own stop): not a failure
        except Exception:
            _LOGGER.exception("session %d failed", session.session_id)
        outbox.close()

    def _end_session(self, session_id: int, reason: str) -> None:
        with self._sessions_lock:
            session = self._sessions.pop(session_id, None)
            self._outboxes.pop(session_id, None)
        if session is not None:
            session.close(f"session {session_id} ended: {reason}")

    def end_tenant(self, tenant: str, secret: bytes) -> int:
        """Ends the sessions of ``tenant`` whose connection sent ``secret`` (its client asked to disconnect).

        Returns how many; a session that sent no secret is never ended this way.
        """
        with self._sessions_lock:
            ended = [
                (session_id, self._outboxes.get(session_id))
                for session_id, session in self._sessions.items()
                if session.tenant == tenant and session.secret and hmac.compare_digest(session.secret, secret)
            ]
        for session_id, outbox in ended:
            if outbox is not None:
                outbox.close(grpc.StatusCode.UNAVAILABLE, "the client disconnected (pathways_nb.disconnect)")
            self._end_session(session_id, "the client disconnected")
        return len(ended)

    def sessions(self) -> list[Session]:
        with self._sessions_lock:
            return list(self._sessions.values())

    def close(self, reason: str | None = None) -> None:
        """Ends every session: its client is told the proxy is shutting down, and ``reason`` if given.

        Sessions first: a read under way fails with the reason (the stock client reports a read's own
        error, but only ``CANCELLED`` for the end of its session's stream), then the streams end.
        """
        shutting_down = "the Pathways proxy is shutting down" + (f": {reason}" if reason else "")
        for session in self.sessions():
            session.close(shutting_down)
        with self._sessions_lock:
            outboxes = list(self._outboxes.values())
        for outbox in outboxes:
            outbox.close(grpc.StatusCode.UNAVAILABLE, shutting_down)

    # -- host buffers ----------------------------------------------------------------------

    async def _session(self, session_id: int, context) -> Session:
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id} does not exist (it may have ended)")
        return session

    async def HostBufferStore(self, request_iterator, context):
        metadata = None
        for key, value in context.invocation_metadata():
            if key == STORE_METADATA_KEY:
                try:
                    metadata = self.messages.proxy.GrpcHostBufferStoreMetadata.FromString(value)
                except Exception:  # noqa: BLE001 - protobuf decode errors
                    await context.abort(grpc.StatusCode.DATA_LOSS, "unable to parse GrpcHostBufferStoreMetadata")
        if metadata is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"missing {STORE_METADATA_KEY} metadata; upload with the IFRT proxy client",
            )
        session = await self._session(metadata.session_id, context)
        size = metadata.buffer_size
        if size < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"negative buffer size {size}")
        try:
            # Counted before a byte is allocated: a declared size over the quota is refused at once.
            reserved = session.host_buffers.reserve(size, f"the upload of host buffer {metadata.handle}")
        except RequestError as e:
            # Not an error of the RPC (the stock client would drop its whole session): the bytes are
            # read and dropped, and the array made from this buffer fails with the quota's message.
            async for _chunk in request_iterator:
                pass
            session.host_buffers.fail(metadata.handle, e)
            return self.messages.proxy.GrpcHostBufferStoreResponse()
        try:
            with self.context.activities.track(
                "upload", f"{size >> 20} MiB to the server", session.tenant, size
            ) as progress:
                data = await _receive(request_iterator, size, progress)
        except BaseException as e:
            session.host_buffers.release(reserved)
            if isinstance(e, RequestError):
                await context.abort(grpc_code(e), e.message)
            raise
        try:
            session.host_buffers.store(metadata.handle, data, reserved)
        except RequestError as e:
            await context.abort(grpc_code(e), e.message)
        return self.messages.proxy.GrpcHostBufferStoreResponse()

    async def HostBufferLookup(self, request, context):
        session = await self._session(request.session_id, context)
        reading = session.host_buffers.ready(request.handle)
        if reading is not None:
            await wait_on_loop(reading)  # staged by CopyToHostBuffer, whose reply did not wait for the bytes
        try:
            data = session.host_buffers.read(request.handle)
        except RequestError as e:
            await context.abort(grpc_code(e), _trailer_text(e.message))
        if data.nbytes == 0:
            yield b""
            return
        chunk = tuning.MESSAGE_CHUNK_BYTES.value
        if data.nbytes <= chunk:
            yield data_messages.encode(data)  # one message: nothing for a progress bar to show
            return
        name = f"{data.nbytes >> 20} MiB from the server"
        with self.context.activities.track("download", name, session.tenant, data.nbytes) as progress:
            for start in range(0, data.nbytes, chunk):
                yield data_messages.encode(data[start : start + chunk])
                progress.bytes_done = min(start + chunk, data.nbytes)

    async def HostBufferDelete(self, request, context):
        session = await self._session(request.session_id, context)
        try:
            session.host_buffers.delete(request.handle)
        except RequestError as e:
            await context.abort(grpc_code(e), e.message)
        return self.messages.proxy.GrpcHostBufferDeleteResponse()

    async def HostBufferReadFromDisk(self, request, context):
        """An upload the client wrote to its shared directory (a client on this host; see host_buffers)."""
        metadata = request.metadata
        session = await self._session(metadata.session_id, context)
        session.host_buffers.read_from_disk(metadata.handle, metadata.buffer_size)
        return self.messages.proxy.GrpcHostBufferReadFromDiskResponse()

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
                # Requests are parsed by the session reader, which answers malformed bytes itself.
                "IfrtSession": grpc.stream_stream_rpc_method_handler(
                    self.IfrtSession, response_serializer=proxy.IfrtResponse.SerializeToString
                ),
                # The data messages are read and written as raw bytes (see protocol.data_messages).
                "HostBufferStore": grpc.stream_unary_rpc_method_handler(
                    self.HostBufferStore,
                    response_serializer=proxy.GrpcHostBufferStoreResponse.SerializeToString,
                ),
                "HostBufferLookup": grpc.unary_stream_rpc_method_handler(
                    self.HostBufferLookup,
                    request_deserializer=proxy.GrpcHostBufferLookupRequest.FromString,
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


def _trailer_text(message: str) -> str:
    """An error message short enough for a status trailer (clients refuse trailers of more than 8 KiB)."""
    return message if len(message) <= _TRAILER_CHARS else message[: _TRAILER_CHARS - 3] + "..."


async def _receive(request_iterator, size: int, progress) -> memoryview:
    """Appends upload chunks to one buffer as they arrive; exactly ``size`` bytes, else DATA_LOSS.

    The buffer grows with what arrives (never from the declared size), so a
    client that declares more than it sends costs what it sent, and a failed
    upload is freed at once. (An anonymous mapping of the declared size was no
    faster for 64 MiB, and with it a disconnected client's arrays did not give
    their memory back: tests/test_sessions.py.)
    """
    buffer = bytearray()
    try:
        async for raw in request_iterator:
            try:
                data = data_messages.decode(raw)
            except Exception as e:  # protobuf decode errors
                raise DataLoss(f"malformed host buffer chunk ({len(raw)} bytes) after {len(buffer)} bytes") from e
            end = len(buffer) + data.nbytes
            if end > size:
                raise DataLoss(
                    f"host buffer upload is larger than its declared {size} bytes (at least {end} arrived); "
                    "the client must declare the size it sends"
                )
            buffer += data
            progress.bytes_done = end
        if len(buffer) != size:
            raise DataLoss(f"host buffer upload ended after {len(buffer)} of {size} bytes; the upload was cut short")
    except BaseException:
        del buffer[:]
        raise
    return memoryview(buffer)
