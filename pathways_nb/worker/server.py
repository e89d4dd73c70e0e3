"""A worker process: serves its devices and keeps itself registered with the resource manager.

It registers at start (retrying until the resource manager answers) on a
stream it keeps open to the resource manager: that stream is its liveness
(gRPC's keepalive pings, answered by gRPC's core, keep vouching for it; no
message is needed) and carries its load when it changes. When the stream ends
(the resource manager restarted, or lost this host a while), it registers again
on a new one, keeping its incarnation. A resource manager without that stream
(an earlier version) gets RegisterWorker and a heartbeat call per interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from pathways_nb.colocated.worker import ColocatedPython
from pathways_nb.core import keepalive
from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.dataflow import Pending, fulfil
from pathways_nb.core.loop import call_on
from pathways_nb.core.nonxla import HostContext
from pathways_nb.core.retry import Retry
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.protocol.errors import RequestError
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.worker.load import LoadGauge
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.service import SERVICE_NAME, WorkerService, local_devices

_LOGGER = logging.getLogger(__name__)

# How long the load's thread waits for the loop to count the sessions.
_COUNT_TIMEOUT_S = 5.0


class MemberProcesses(Protocol):
    """What starts and stops this host's group members on the resource manager's orders (``launch.members``)."""

    report: Callable[[pb.GroupMemberEvent], None]

    def apply(self, order: pb.GroupOrder) -> None: ...

    def close(self) -> None: ...


class WorkerServer:
    """Serves ``runtime``'s devices as host ``host_index`` of ``island`` (or, with ``group``, as a member of a
    group of islands: ``rm.groups``)."""

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
        colocated_python_host: str | None = None,
        storage: StorageRoot | None = None,
        on_fatal: Callable[[str], None] | None = None,
        members: MemberProcesses | None = None,
        group: pb.GroupMembership | None = None,
        suspend_memory_budget: int | None = None,
    ):
        """``storage``: where the non-XLA programs clients send (profiles, checkpoints) write, and where suspended
        sessions' arrays beyond ``suspend_memory_budget`` bytes of this host's memory go (None: no limit).
        ``on_fatal(why)``: called (on a thread of its own) if the worker can no longer be part of its cluster;
        default: ``stop``.
        ``members``: starts this host's members of groups of islands when the resource manager says (None: this
        worker takes part in no group); ``group``: this process is such a member."""
        credentials = credentials or ClusterCredentials()
        self.runtime = runtime
        self.island, self.host_index = island, host_index
        self.group = group
        self._members = members
        # What this worker has to say on its Attach stream beyond its load (its members' news); None wakes it.
        self._news: queue.SimpleQueue = queue.SimpleQueue()
        if members is not None:
            members.report = self._tell
        # This process's identity in the cluster: kept when it registers again with a restarted
        # resource manager (its arrays are still here), new for every new process.
        self.incarnation = 1 + secrets.randbits(62)
        name = f"group{group.group}-member{group.member}" if group else f"island{island}-host{host_index}"
        colocated = None
        if colocated_python_host:
            where = f"island {island} host {host_index}"
            colocated = ColocatedPython(runtime, colocated_python_host, credentials, where)
        place = HostContext(storage or StorageRoot(default_root()), island, host_index, name, colocated=colocated)
        self.service = WorkerService(
            runtime,
            credentials=credentials,
            host=place,
            colocated=colocated,
            suspend_memory_budget=suspend_memory_budget,
        )
        self._server = BackgroundServer(
            lambda server: cluster_pb2_grpc.add_WorkerServicer_to_server(self.service, server),
            [SERVICE_NAME],
            port,
            host,
            credentials=credentials,
            process=f"worker {name}",
        )
        self.port = self._server.port
        self.advertised = f"{advertise_address or host}:{self.port}"
        self._rm = cluster_pb2_grpc.ResourceManagerStub(
            credentials.channel(resource_manager_address, options=keepalive.client_options())
        )
        self._stopped = threading.Event()
        self._on_fatal = on_fatal or (lambda _why: self.stop())
        self._load = LoadGauge(runtime, self._session_counts)
        self._last_counts = (0, 0)
        self._attaching = True  # False while the resource manager has no Attach (heartbeats instead)
        self._update_interval_s = 1.0
        self._attachment: tuple[grpc.Call, threading.Event] | None = None  # the open stream, and what ends it
        try:
            self.registration = self._register(register_timeout_s)
        except BaseException:
            self._server.stop(0)
            raise
        self._interval_s = self.registration.heartbeat_interval_s
        self._liveness = threading.Thread(target=self._stay_alive, name="pathways-liveness", daemon=True)
        self._liveness.start()

    def _register(self, timeout_s: float) -> pb.RegisterWorkerResponse:
        """Registers this worker on a new Attach stream (kept open: it is this worker's liveness), or,
        with a resource manager without Attach, with RegisterWorker (then it heartbeats)."""
        request = pb.RegisterWorkerRequest(
            address=self.advertised,
            island=self.island,
            host_index=self.host_index,
            platform=self.runtime.platform,
            platform_version=self.runtime.platform_version,
            devices=local_devices(self.runtime, self.runtime.device_ids),
            colocated_devices=local_devices(self.runtime, self.runtime.colocated_device_ids),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            host_key=self.service.outbox.host_key,
            group=self.group,
        )
        retry = Retry("registering with the resource manager", None if timeout_s == float("inf") else timeout_s)
        while not self._stopped.is_set():
            try:
                response = self._attach(request) if self._attaching else self._rm.RegisterWorker(request, timeout=5)
                _LOGGER.info("registered as %s with devices %s", response.worker_id, list(response.device_ids))
                if self.service.colocated is not None:
                    self.service.colocated.registered(response.colocated_device_ids)
                return response
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED and self._attaching:
                    _LOGGER.info("the resource manager has no Attach (an earlier version): heartbeating instead")
                    self._attaching = False
                    continue
                try:
                    wait_s = retry.failed(error)
                except RequestError as failure:
                    raise RuntimeError(f"this worker could not register: {failure.message}") from None
                self._stopped.wait(wait_s)
        raise RuntimeError("the worker stopped before it was registered")

    def _attach(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        """Opens an Attach stream that registers this worker, and keeps it for ``_follow``."""
        over = threading.Event()
        call = self._rm.Attach(self._updates(pb.WorkerUpdate(registration=request, load=self._load.measure()), over))
        try:
            first = next(call, None)
        except BaseException:
            self._end_stream(over)
            raise
        if first is None:
            self._end_stream(over)
            raise RuntimeError("the resource manager ended the Attach stream without registering this worker")
        self._update_interval_s = first.update_interval_s or self._update_interval_s
        self._attachment = (call, over)
        return first.registration

    def _follow(self) -> None:
        """Reads the Attach stream's replies until it ends (this worker stops, or the stream broke)."""
        call, over = self._attachment
        try:
            for reply in call:
                self._update_interval_s = reply.update_interval_s or self._update_interval_s  # the cluster grew
                for order in reply.group_orders:
                    self._obey(order)
            ended = "the resource manager ended it"
        except grpc.RpcError as error:
            ended = f"{error.code().name}: {error.details()}"
        finally:
            self._end_stream(over)
        if not self._stopped.is_set():
            _LOGGER.warning("the stream to the resource manager ended (%s); registering on a new one", ended)

    def _updates(self, first: pb.WorkerUpdate, over: threading.Event):
        """The stream's messages: the registration, then the load when it changed, at most once per interval,
        and the members' news as it comes."""
        yield first
        last = first.load
        due = time.monotonic() + self._load.wait_s(self._update_interval_s)
        while not over.is_set():
            try:
                news = self._news.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                news = None
            if over.is_set():
                if news is not None:
                    self._news.put(news)  # for the next stream
                return
            if news is not None:
                yield pb.WorkerUpdate(group_events=[news])
                continue
            if time.monotonic() < due:
                continue  # woken by ``_end_stream`` for another stream's sake
            due = time.monotonic() + self._load.wait_s(self._update_interval_s)
            load = self._load.measure()
            if load != last:
                last = load
                yield pb.WorkerUpdate(load=load)

    def _end_stream(self, over: threading.Event) -> None:
        over.set()
        self._news.put(None)  # wakes the stream's writer

    def _session_counts(self) -> tuple[int, int]:
        """The service's open sessions and their arrays, counted on its loop, which owns them (this thread waits;
        the last counts if the loop does not answer: it is stopping)."""
        counted = Pending()
        call_on(self._server.loop, fulfil, counted, self.service.load_counts)
        with contextlib.suppress(TimeoutError):
            self._last_counts = counted.wait(_COUNT_TIMEOUT_S)
        return self._last_counts

    def _tell(self, event: pb.GroupMemberEvent) -> None:
        """Tells the resource manager what became of one of this host's group members (from any thread)."""
        self._news.put(event)

    def _obey(self, order: pb.GroupOrder) -> None:
        if self._members is None:
            _LOGGER.warning("the resource manager ordered group members, but this worker runs none: %s", order)
            return
        try:
            self._members.apply(order)
        except Exception:  # a member that cannot start is reported by its group's time-out, with this in the log
            _LOGGER.exception("carrying out %s failed", order)

    def _stay_alive(self) -> None:
        """Keeps this worker attached (or heartbeating, to a resource manager without Attach) until ``stop``.

        A failure that registering again cannot get past (the resource manager refuses this worker's
        token, say) ends the worker (``on_fatal``): a worker no one can reach serves nobody, and its
        launcher, which sees it end, says why and starts a new one.
        """
        heartbeats = Retry("heartbeating to the resource manager")
        while not self._stopped.is_set():
            try:
                if self._attaching:
                    self._follow()
                    if not self._stopped.is_set():
                        self.registration = self._register(timeout_s=float("inf"))
                elif not self._stopped.wait(self._jittered()):
                    self._answered(self._rm.Heartbeat(self._beat(), timeout=5))
                    heartbeats.succeeded()
            except grpc.RpcError as error:
                if self._stopped.is_set():
                    return
                _LOGGER.warning("heartbeat failed (%s); retrying", error.code().name)
                try:
                    self._stopped.wait(heartbeats.failed(error))
                except RequestError as failure:
                    self._fatal(failure.message)
                    return
            except RuntimeError as error:
                if not self._stopped.is_set():
                    self._fatal(str(error))
                return

    def _fatal(self, reason: str) -> None:
        _LOGGER.error("the worker cannot stay in its cluster, and stops: %s", reason)
        self._on_fatal(reason)

    def _jittered(self) -> float:
        # Jittered, so that workers started together do not heartbeat in lockstep bursts.
        return self._interval_s * random.uniform(0.8, 1.0)

    def _beat(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(worker_id=self.registration.worker_id, incarnation=self.registration.incarnation)

    def _answered(self, reply: pb.HeartbeatResponse) -> None:
        """Follows the interval the resource manager asks for; registers again (and tries to attach) if it must."""
        # A growing cluster spreads heartbeats out: the resource manager says how far.
        self._interval_s = reply.heartbeat_interval_s or self.registration.heartbeat_interval_s
        if reply.known:
            return
        _LOGGER.warning("the resource manager does not know this worker: registering again")
        self._attaching = True  # it may be a newer one, that has Attach
        self.registration = self._register(timeout_s=float("inf"))
        self._interval_s = self.registration.heartbeat_interval_s

    @property
    def address(self) -> str:
        return self.advertised

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._stopped.set()
        call_on(self._server.loop, self.service.begin_stopping)  # (before the server's stop, which the loop runs next)
        if self._attachment is not None:
            self._end_stream(self._attachment[1])  # ends the Attach stream: the resource manager finds this worker gone
        self._server.stop(grace_s)
        if self._members is not None:
            self._members.close()
        self.service.close()  # (the loop has stopped)
        self.runtime.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._server.wait(timeout_s)
