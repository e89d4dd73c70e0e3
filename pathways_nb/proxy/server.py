"""Starting and stopping an IFRT proxy server (``pathways-nb proxy``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pathways_nb.proxy.context import ProxyContext, ProxyLimits
from pathways_nb.proxy.service import SERVICE_NAME, DevicePlan, IfrtProxyService
from pathways_nb.worker.runtime import LocalRuntime

_LOGGER = logging.getLogger(__name__)

# gRPC's 4 MiB default is too small for compile requests of big programs.
UNLIMITED_MESSAGES = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class ProxyServer:
    """An IFRT proxy server on ``host:port`` (port 0 picks a free one), started on construction."""

    def __init__(
        self,
        runtime: LocalRuntime,
        port: int = 0,
        host: str = "127.0.0.1",
        limits: ProxyLimits | None = None,
        device_plan: DevicePlan | None = None,
        max_sessions: int = 64,
    ):
        self.context = ProxyContext(runtime, limits)
        self.service = IfrtProxyService(self.context, device_plan)
        # One handler thread per open session stream, plus room for host-buffer calls.
        self._server = grpc.server(
            ThreadPoolExecutor(max_sessions * 2, thread_name_prefix="pathways-grpc"), options=UNLIMITED_MESSAGES
        )
        self._server.add_generic_rpc_handlers((self.service.generic_handler(),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}; is the port in use?")
        self.host = host
        self._server.start()
        self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """The ``grpc://host:port`` address clients connect to."""
        return f"grpc://{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace_s``), ends every session, frees devices."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._health.enter_graceful_shutdown()
        self.service.close()
        self._server.stop(grace_s).wait()
        self.context.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until ``stop()``; True if stopped."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
