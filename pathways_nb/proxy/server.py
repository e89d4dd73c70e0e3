"""Starting and stopping an IFRT proxy server (``pathways-nb proxy``).

The gRPC server runs on its own asyncio loop in a background thread, so the
API here is plain blocking calls usable from scripts, tests and notebooks.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pathways_nb.proxy.context import ProxyContext, ProxyLimits
from pathways_nb.proxy.service import SERVICE_NAME, DevicePlan, IfrtProxyService
from pathways_nb.runtime_api import Runtime

_LOGGER = logging.getLogger(__name__)

SERVER_OPTIONS = [
    # gRPC's 4 MiB default is too small for compile requests of big programs.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A 64 MiB receive window lets a large upload stream without waiting for window updates.
    ("grpc.http2.lookahead_bytes", 64 << 20),
]


class ProxyServer:
    """An IFRT proxy server on ``host:port`` (port 0 picks a free one), serving once constructed."""

    def __init__(
        self,
        runtime: Runtime,
        port: int = 0,
        host: str = "127.0.0.1",
        limits: ProxyLimits | None = None,
        device_plan: DevicePlan | None = None,
    ):
        self.context = ProxyContext(runtime, limits)
        self.service = IfrtProxyService(self.context, device_plan)
        self.host = host
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pathways-proxy-loop", daemon=True)
        self._thread.start()
        try:
            self.port = self._call(self._start(host, port))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self.context.close()
            raise

    async def _start(self, host: str, port: int) -> int:
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((self.service.generic_handler(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port}; is the port in use?")
        await self._server.start()
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        return bound

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def address(self) -> str:
        """The ``grpc://host:port`` address clients connect to."""
        return f"grpc://{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace_s``), ends every session, frees devices."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._call(self._stop(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self.context.close()

    async def _stop(self, grace_s: float | None) -> None:
        await self._health.enter_graceful_shutdown()
        self.service.close()
        await self._server.stop(grace_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until ``stop()``; True if stopped."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
