"""A grpc.aio server on its own event loop thread, driven by plain blocking calls.

The proxy, the resource manager and the workers all serve this way, so that
scripts, tests and notebooks can start and stop them without asyncio.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pathways_nb.core.loop import LoopWatchdog, new_event_loop
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.rpc import cluster_pb2_grpc

SERVER_OPTIONS = [
    # gRPC's 4 MiB default is too small for compile requests of big programs.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A 64 MiB receive window lets a large upload stream without waiting for window updates.
    ("grpc.http2.lookahead_bytes", 64 << 20),
    # A port another server holds is refused, not shared: with gRPC's default SO_REUSEPORT a second
    # server on the same port (a second cluster, a port picked twice) took half its connections silently.
    ("grpc.so_reuseport", 0),
]


Register = Callable[[grpc.aio.Server], None]


class BackgroundServer:
    """Serves what ``register`` adds on ``host:port`` (port 0 picks a free one) until ``stop()``.

    A ``host`` of ``unix:PATH`` serves on that unix socket instead (``port`` is then unused).

    ``register(server)`` runs on the loop before the server starts (as the
    generated ``add_XServicer_to_server`` functions expect); ``on_start`` and
    ``on_stop`` run on the loop too. ``credentials`` decide whether callers need
    the cluster token and whether the port speaks TLS (default: neither, and
    then only a loopback ``host`` is allowed). ``options`` are gRPC server
    options beside ``SERVER_OPTIONS`` (e.g. keepalive). A ``LoopWatchdog`` named
    ``process`` watches the loop; the server answers ``Diagnostics.GetLoopStats``.
    """

    def __init__(
        self,
        register: Register,
        service_names: Sequence[str],
        port: int = 0,
        host: str = "127.0.0.1",
        on_start: Callable[[], Awaitable[None]] | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        credentials: ClusterCredentials | None = None,
        options: Sequence[tuple[str, object]] = (),
        process: str = "",
    ):
        self.host = host
        self.credentials = credentials or ClusterCredentials()
        if not host.startswith("unix:"):  # (a unix socket is reached through its file's permissions)
            self.credentials.check_bind(host, ", ".join(service_names) or "a gRPC server")
        self._on_stop = on_stop
        self._stopped = threading.Event()
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pathways-loop", daemon=True)
        self._thread.start()
        self.watchdog = LoopWatchdog(self.loop, process or ", ".join(service_names))
        self.watchdog.start()
        try:
            self.port = self.call(self._start(register, service_names, host, port, on_start, options))
        except BaseException:
            self.watchdog.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            raise

    async def _start(self, register: Register, service_names, host: str, port: int, on_start, options) -> int:
        self._server = grpc.aio.server(
            options=[*SERVER_OPTIONS, *options], interceptors=self.credentials.server_interceptors()
        )
        register(self._server)
        cluster_pb2_grpc.add_DiagnosticsServicer_to_server(_Diagnostics(self.watchdog), self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        address = host if host.startswith("unix:") else f"{host}:{port}"
        try:
            bound = self.credentials.add_port(self._server, address)
        except RuntimeError:  # grpc.aio's "Failed to bind to address ...", which names no cause
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {address}; is the port in use?")
        if on_start is not None:
            await on_start()
        await self._server.start()
        for name in (*service_names, ""):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    def call(self, coroutine):
        """Runs ``coroutine`` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace_s``); idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.call(self._stop(grace_s))
        self.watchdog.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()

    async def _stop(self, grace_s: float | None) -> None:
        await self._health.enter_graceful_shutdown()
        if self._on_stop is not None:
            await self._on_stop()
        await self._server.stop(grace_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until ``stop()``; True if stopped."""
        return self._stopped.wait(timeout_s)


class _Diagnostics(cluster_pb2_grpc.DiagnosticsServicer):
    """How the server's loop has turned (``Diagnostics.GetLoopStats``)."""

    def __init__(self, watchdog: LoopWatchdog):
        self._watchdog = watchdog

    async def GetLoopStats(self, request, context):
        return self._watchdog.stats()
