"""Starting and stopping the resource manager (``pathways-nb resource-manager``)."""

from __future__ import annotations

from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.rm.service import SERVICE_NAME, ResourceManagerService
from pathways_nb.rm.topology import Topology
from pathways_nb.rpc import cluster_pb2_grpc


class ResourceManagerServer:
    """The cluster's resource manager on ``host:port``, serving once constructed."""

    def __init__(
        self,
        topology: Topology | None,
        port: int = 0,
        host: str = "127.0.0.1",
        worker_timeout_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        credentials: ClusterCredentials | None = None,
        suspend_idle_after_s: float = 0.0,
        suspend_idle_always: bool = False,
        priority_ceilings: dict[str, int] | None = None,
    ):
        """The last three: the policy on sessions (``rm.policy.SessionPolicy``)."""
        self.service = ResourceManagerService(
            topology,
            worker_timeout_s,
            heartbeat_interval_s,
            suspend_idle_after_s=suspend_idle_after_s,
            suspend_idle_always=suspend_idle_always,
            priority_ceilings=priority_ceilings,
        )

        async def start() -> None:
            self.service.start()

        self._server = BackgroundServer(
            lambda server: cluster_pb2_grpc.add_ResourceManagerServicer_to_server(self.service, server),
            [SERVICE_NAME],
            port,
            host,
            on_start=start,
            on_stop=self.service.stop,
            credentials=credentials,
            # Pings every caller's connection: a worker whose host vanished ends its Attach stream.
            options=self.service.liveness.server_options(),
            process="resource manager",
        )
        self.host, self.port = host, self._server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._server.stop(grace_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._server.wait(timeout_s)
