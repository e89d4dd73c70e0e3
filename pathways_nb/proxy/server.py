"""Starting and stopping an IFRT proxy server (``pathways-nb proxy``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.runtime_api import Runtime
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.proxy import observe
from pathways_nb.proxy.context import ProxyContext, ProxyLimits
from pathways_nb.proxy.service import SERVICE_NAME, IfrtProxyService
from pathways_nb.rpc import cluster_pb2_grpc

# The ports this process serves the IFRT proxy protocol on (see ``serves_here``).
_SERVING: set[int] = set()


def serves_here(port: int) -> bool:
    """Whether this very process serves the IFRT proxy on ``port``.

    Its own JAX must not connect there: jaxlib's client holds the GIL while it waits
    for some replies (a compile), so a server in the same process never gets to send them.
    """
    return port in _SERVING


class ProxyServer:
    """An IFRT proxy server on ``host:port`` (port 0 picks a free one), serving once constructed."""

    def __init__(
        self,
        runtime: Runtime,
        port: int = 0,
        host: str = "127.0.0.1",
        limits: ProxyLimits | None = None,
        credentials: ClusterCredentials | None = None,
        stop_reason: Callable[[], str | None] | None = None,
    ):
        """``stop_reason``: asked when the server stops, for why, which every open session is told
        (None: that the proxy is shutting down, and nothing more)."""
        self._stop_reason = stop_reason
        self._why_stopping: str | None = None
        self.context = ProxyContext(runtime, limits)
        self.service = IfrtProxyService(self.context)
        try:
            handler = self.service.generic_handler()
            observer = observe.ObserveService(self.context, self.service)

            def register(server) -> None:
                server.add_generic_rpc_handlers((handler,))
                cluster_pb2_grpc.add_ObserveServicer_to_server(observer, server)

            self._server = BackgroundServer(
                register,
                [SERVICE_NAME, observe.SERVICE_NAME],
                port,
                host,
                on_start=self._serve_runtime,
                on_stop=self._close_sessions,
                credentials=credentials,
                process="proxy",
            )
        except BaseException:
            self.context.close()
            raise
        self.host, self.port = host, self._server.port
        _SERVING.add(self.port)

    async def _serve_runtime(self) -> None:
        self.context.runtime.serve_on(asyncio.get_running_loop())

    async def _close_sessions(self) -> None:
        self.service.close(self._why_stopping)
        await self.context.runtime.stop_serving()

    @property
    def address(self) -> str:
        """The ``grpc://host:port`` address clients connect to."""
        return f"grpc://{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops serving, ends every session, frees the devices."""
        _SERVING.discard(self.port)
        # Asked before the loop stops serving (the question may wait: a Slurm command, say).
        self._why_stopping = self._stop_reason() if self._stop_reason is not None else None
        self._server.stop(grace_s)
        self.context.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._server.wait(timeout_s)

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
