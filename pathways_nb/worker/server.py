"""A worker process: serves its devices and keeps itself registered with the resource manager.

It registers at start (retrying until the resource manager answers), then
heartbeats; when the resource manager does not know it (it restarted, or
declared this worker dead), it registers again.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time

import grpc

from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.nonxla import HostContext
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.service import SERVICE_NAME, WorkerService, local_devices

_LOGGER = logging.getLogger(__name__)

_STREAM_RENEWAL_S = 10.0


class WorkerServer:
    """Serves ``runtime``'s devices as host ``host_index`` of ``island``."""

    def __init__(
        self,
        runtime: LocalRuntime,
        resource_manager_address: str,
        island: int = 0,
        host_index: int = 0,
        port: int = 0,
        host: str = "127.0.0.1",
        advertise_address: str | None = None,
        register_timeout_s: float = 60.0,
        credentials: ClusterCredentials | None = None,
        storage: StorageRoot | None = None,
    ):
        """``storage``: where the non-XLA programs clients send (profiles, checkpoints) write."""
        credentials = credentials or ClusterCredentials()
        self.runtime = runtime
        self.island, self.host_index = island, host_index
        # This process's identity in the cluster: kept when it registers again with a restarted
        # resource manager (its arrays are still here), new for every new process.
        self.incarnation = 1 + secrets.randbits(62)
        name = f"island{island}-host{host_index}"
        place = HostContext(storage or StorageRoot(default_root()), island, host_index, name)
        self.service = WorkerService(runtime, credentials=credentials, host=place)
        self._server = BackgroundServer(
            lambda server: cluster_pb2_grpc.add_WorkerServicer_to_server(self.service, server),
            [SERVICE_NAME],
            port,
            host,
            credentials=credentials,
        )
        self.port = self._server.port
        self.advertised = f"{advertise_address or host}:{self.port}"
        self._rm = cluster_pb2_grpc.ResourceManagerStub(credentials.channel(resource_manager_address))
        self._stopped = threading.Event()
        self.registration = self._register(register_timeout_s)
        self._heartbeats = threading.Thread(target=self._heartbeat_forever, name="pathways-heartbeat", daemon=True)
        self._heartbeats.start()

    def _register(self, timeout_s: float) -> pb.RegisterWorkerResponse:
        request = pb.RegisterWorkerRequest(
            address=self.advertised,
            island=self.island,
            host_index=self.host_index,
            platform=self.runtime.platform,
            platform_version=self.runtime.platform_version,
            devices=local_devices(self.runtime),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            host_key=self.service.outbox.host_key,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = self._rm.RegisterWorker(request, timeout=5)
                _LOGGER.info("registered as %s with devices %s", response.worker_id, list(response.device_ids))
                return response
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT or time.monotonic() > deadline:
                    self._server.stop(0)
                    raise RuntimeError(f"the resource manager refused this worker: {error.details()}") from None
                time.sleep(0.2)

    def _heartbeat_forever(self) -> None:
        """Heartbeats as messages on one stream (cheaper for the resource manager than a call each);
        one without that stream (an older version) gets a call per heartbeat."""
        self._interval_s = self.registration.heartbeat_interval_s
        streaming = True
        while not self._stopped.is_set():
            try:
                if streaming:
                    # Renewed every few seconds: a stream to a resource manager that vanished without a
                    # word (its host gone) ends soon, as a call's timeout would end it.
                    replies = self._rm.Heartbeats(self._beats(), timeout=_STREAM_RENEWAL_S)
                    for reply in replies:
                        if not self._answered(reply):
                            replies.cancel()  # beats already sent named the old registration
                            break
                    else:
                        self._stopped.wait(self._interval_s)  # the resource manager ended it: open another
                elif not self._stopped.wait(self._jittered()):
                    self._answered(self._rm.Heartbeat(self._beat(), timeout=5))
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue  # ended here, or renewed
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    streaming = False
                    continue
                _LOGGER.warning("heartbeat failed (%s); retrying", error.code().name)
                self._stopped.wait(self._interval_s)
            except RuntimeError:
                _LOGGER.exception("re-registration failed")

    def _jittered(self) -> float:
        # Jittered, so that workers started together do not heartbeat in lockstep bursts.
        return self._interval_s * random.uniform(0.8, 1.0)

    def _beat(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(worker_id=self.registration.worker_id, incarnation=self.registration.incarnation)

    def _beats(self):
        while not self._stopped.wait(self._jittered()):
            yield self._beat()

    def _answered(self, reply: pb.HeartbeatResponse) -> bool:
        """Follows the interval the resource manager asks for; False if this worker had to register again."""
        # A growing cluster spreads heartbeats out: the resource manager says how far.
        self._interval_s = reply.heartbeat_interval_s or self.registration.heartbeat_interval_s
        if reply.known:
            return True
        _LOGGER.warning("the resource manager does not know this worker: registering again")
        self.registration = self._register(timeout_s=float("inf"))
        self._interval_s = self.registration.heartbeat_interval_s
        return False

    @property
    def address(self) -> str:
        return self.advertised

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._stopped.set()
        self._server.stop(grace_s)
        self.service.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._server.wait(timeout_s)
