"""The devices of a cluster, as a proxy serves them: the resource manager's view, leases, programs on workers.

``ClusterRuntime`` follows the cluster's workers (``WatchCluster``), gives each client session an
allocation (a lease that lasts as long as its ``Allocate`` call; ``cluster_session.ClusterSession``
serves the session's work on it), and compiles programs on workers, once per worker process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import secrets
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any

import grpc

from pathways_nb.core import nonxla
from pathways_nb.core.convert import program_from_proto
from pathways_nb.core.events import EventSink
from pathways_nb.core.runtime_api import (
    ProgramInfo,
)
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.session_options import SECRET, SessionOptions
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.protocol.errors import (
    DeadlineExceeded,
    InvalidRequest,
    RequestError,
    Unavailable,
)
from pathways_nb.protocol.layouts import LayoutBook
from pathways_nb.proxy.cluster_session import ClusterSession
from pathways_nb.proxy.connection_output import HostLineSink
from pathways_nb.proxy.lease import Leases
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteProgram(ProgramInfo):
    """A program of one island; kept to compile it on each of its hosts, and again if a host restarts."""

    hosts: tuple = ()  # one device (pb.Device) per host the program runs on, in host order
    stablehlo: bytes = b""
    compile_options: bytes = b""  # with the worker's local device ids
    local_device_ids: tuple[int, ...] = ()


class ClusterRuntime:
    """A cluster reached through its resource manager at ``rm_address``."""

    def __init__(
        self,
        rm_address: str,
        allocation_timeout_s: float = 60.0,
        credentials: ClusterCredentials | None = None,
        storage: StorageRoot | None = None,
    ):
        self.rm_address = rm_address
        # The proxy's own place, for the parts of non-XLA programs it runs itself (its own profile).
        self.host = nonxla.HostContext(storage or StorageRoot(default_root()), name="proxy")
        self.allocation_timeout_s = allocation_timeout_s
        self.key = f"proxy-{uuid.uuid4().hex[:8]}"
        self.credentials = credentials or ClusterCredentials()
        self._channel = self.credentials.channel(rm_address)
        self._rm = cluster_pb2_grpc.ResourceManagerStub(self._channel)
        self._lock = threading.Lock()
        # Program ids name programs on workers, which every proxy of the cluster shares: each proxy
        # counts from its own random start, far from any other's (ids of two proxies never meet).
        self._program_ids = itertools.count(secrets.randbits(40) << 20)
        # Per program (by identity): worker incarnation -> program id on that worker.
        self._compiled: weakref.WeakKeyDictionary[RemoteProgram, dict[int, int]] = weakref.WeakKeyDictionary()
        # Compiles sent without waiting (program_id_on), by program id, until their reply: (reply, stream).
        self._compiling: dict[int, tuple[Future, WorkerLink]] = {}
        self._control: dict[str, WorkerLink] = {}
        self._layouts = LayoutBook()
        self._sessions: weakref.WeakSet[ClusterSession] = weakref.WeakSet()
        self._workers: dict[str, pb.WorkerState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leases: Leases | None = None
        self._watching = threading.Event()
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name="pathways-cluster-watch", daemon=True)
        self._watcher.start()
        # Programs no one can run any more (see ``compile``): (hosts, worker incarnation -> program id).
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._forget_forever, name="pathways-forget-programs", daemon=True).start()

    # -- cluster state ---------------------------------------------------------------------

    def _watch(self) -> None:
        """Follows the resource manager's view of the workers, failing fast on dead ones."""
        while not self._closed:
            try:
                # wait_for_ready: while the resource manager is away, wait for it without polling.
                # Deltas: after the first state, only the workers that changed (merged by _update).
                for state in self._rm.WatchCluster(pb.ClusterStateRequest(deltas=True), wait_for_ready=True):
                    try:
                        self._update(state)
                    except Exception:
                        _LOGGER.exception("applying the cluster state failed")
                    self._watching.set()
            except grpc.RpcError as error:
                if self._closed:
                    return
                _LOGGER.warning("lost the resource manager at %s (%s); retrying", self.rm_address, error.code().name)

    def _update(self, state: pb.ClusterState) -> None:
        with self._lock:
            # Merged, not replaced: a resource manager that just restarted does not know every worker
            # yet, and a worker it has not heard from again is where it was, not gone.
            self._workers.update((w.worker_id, w) for w in state.workers)
        for worker in state.workers:
            if not worker.healthy:
                for session in list(self._sessions):
                    session.worker_down(worker)

    def worker(self, worker_id: str) -> pb.WorkerState | None:
        with self._lock:
            return self._workers.get(worker_id)

    def down_reason(self, worker_id: str, incarnation: int) -> str:
        """Why the cluster says that incarnation of a worker is down ("" while it does not know)."""
        worker = self.worker(worker_id)
        if worker is None or worker.healthy or worker.incarnation != incarnation:
            return ""
        return worker.down_reason

    def down(self, device: pb.Device) -> WorkerLost:
        """The error for work on a device whose worker the cluster reports down (with why, when it knows)."""
        worker = self.worker(device.worker_id)
        reason = f" ({worker.down_reason})" if worker is not None and worker.down_reason else ""
        return WorkerLost(
            f"island {device.island} host {device.host_index} ({device.worker_address}) is down{reason}; "
            f"work on island {device.island} fails until its worker is back. Other islands keep serving"
        )

    def cluster_state(self) -> pb.ClusterState:
        try:
            return self._rm.GetClusterState(pb.ClusterStateRequest(), timeout=10)
        except grpc.RpcError as error:
            raise _rm_error(error, self.rm_address) from None

    # -- the loop the worker streams live on ---------------------------------------------------

    def serve_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs the streams to workers on ``loop``, the proxy's own (before any session opens)."""
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The streams' loop: the proxy's, or (used without a proxy server) a loop thread of its own."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="pathways-links", daemon=True).start()
            return self._loop

    # -- sessions --------------------------------------------------------------------------

    def open_session(
        self, session_id: int, attributes: dict[str, Any], events: EventSink, output: HostLineSink | None = None
    ) -> ClusterSession:
        """Allocates devices for a session, waiting in the queue if the cluster is busy."""
        options = _session_options(attributes, self.allocation_timeout_s, f"{self.key}-s{session_id}")
        request = pb.AllocateRequest(
            tenant=options.tenant,
            exclusive=options.exclusive,
            num_devices=options.num_devices,
            islands=options.islands,
            timeout_s=options.timeout_s,
        )
        try:
            lease = self.leases.grant(
                request, lambda waiting: _LOGGER.info("session %d: %s", session_id, waiting.reason)
            ).result()
        except grpc.aio.AioRpcError as error:
            raise _rm_error(error, self.rm_address) from None
        except EOFError:
            raise Unavailable(
                f"the resource manager at {self.rm_address} ended the allocation before granting it"
            ) from None
        session = ClusterSession(self, session_id, lease, events, options, output)
        self._sessions.add(session)
        lease.hold(session_id)
        return session

    @property
    def leases(self) -> Leases:
        """Allocations, held on the streams' loop."""
        loop = self.loop
        with self._lock:
            if self._leases is None:
                self._leases = Leases(self.rm_address, loop, self.credentials)
            return self._leases

    # -- programs --------------------------------------------------------------------------

    def control_link(self, worker: pb.Device) -> WorkerLink:
        """The proxy's own stream to a worker, for compiling and querying programs."""
        loop = self.loop
        with self._lock:
            link = self._control.get(worker.worker_id)
            if link is None or not link.alive or link.incarnation != worker.incarnation:
                if link is not None:
                    link.close()
                link = WorkerLink(
                    worker, f"{self.key}-control-{worker.incarnation}", loop, credentials=self.credentials
                )
                self._control[worker.worker_id] = link
            return link

    def program_id_on(self, program: RemoteProgram, worker: pb.Device, link: WorkerLink | None = None) -> int:
        """The id of ``program`` on the worker's current incarnation; if it is not compiled there, the compile is sent.

        The compile goes on ``link`` (the stream of the command that uses the id; the worker serves
        a stream in order, so that command waits there for the compile) and is not waited for: no
        caller, the proxy's event loop least of all, waits for a worker here. A compile that fails
        fails the commands that use the id, and the next use compiles again. While the compile is
        on its way on another stream (another session's), it is sent on ``link`` too, under the
        same id: streams are not ordered with each other (the worker compiles once, by content).
        """
        with self._lock:
            known = self._compiled.setdefault(program, {})
            program_id = known.get(worker.incarnation)
            sent = self._compiling.get(program_id) if program_id is not None else None
            if program_id is not None and (sent is None or link is None or sent[1] is link):
                return program_id
            new = program_id is None
            if new:
                program_id = known[worker.incarnation] = next(self._program_ids)
        link = link or self.control_link(worker)
        try:
            reply = self._send_compile(
                link, program_id, program.stablehlo, program.compile_options, program.local_device_ids
            )
        except RequestError:
            if new:
                with self._lock:
                    known.pop(worker.incarnation, None)
            raise

        def replied(future: Future) -> None:
            with self._lock:
                if self._compiling.get(program_id, (None,))[0] is future:
                    del self._compiling[program_id]
                if future.exception() is not None and known.get(worker.incarnation) == program_id:
                    del known[worker.incarnation]

        with self._lock:
            self._compiling[program_id] = (reply, link)
        reply.add_done_callback(replied)
        return program_id

    def compiled_on(self, program: RemoteProgram, worker: pb.Device) -> int:
        """``program_id_on``, once the program is compiled there (blocks: for work off the event loop)."""
        program_id = self.program_id_on(program, worker)
        with self._lock:
            sent = self._compiling.get(program_id)
        if sent is not None:
            reply, link = sent
            link.result(reply)
        return program_id

    def _send_compile(
        self, link: WorkerLink, program_id: int, stablehlo: bytes, options: bytes, local_ids: tuple[int, ...]
    ) -> Future:
        command = pb.Command(
            compile=pb.Compile(program=program_id, stablehlo=stablehlo, compile_options=options, device_ids=local_ids)
        )
        return link.request(command, "compile")

    def compile(
        self,
        hosts: Sequence[pb.Device],
        stablehlo: bytes,
        options: bytes,
        device_ids,
        local_ids,
        stand_in: Callable[[], pb.Device | None] | None = None,
    ) -> RemoteProgram:
        """Compiles on every host of the program at once (blocks: it runs on the compile pool).

        A program compiles whatever the state of its island, as on Pathways, where the compile
        does not need the slice (pathwaysutils' elastic health check compiles a program for each
        slice and counts a slice down only when running it fails): a host that is down, or lost
        meanwhile, compiles it when it is back, on the stream of its first execution there
        (``program_id_on``), and executions on it fail with DATA_LOSS until then. If every host is
        down, a healthy worker with the same kind of devices (``stand_in``) compiles it in their
        stead, for its description, and forgets it; with none, the compile fails with the loss.
        """
        ids = [next(self._program_ids) for _ in hosts]
        sent: list[tuple[WorkerLink, Future] | WorkerLost] = []
        for host, program_id in zip(hosts, ids, strict=True):
            try:
                if not host.healthy:
                    raise self.down(host)
                link = self.control_link(host)
                sent.append((link, self._send_compile(link, program_id, stablehlo, options, local_ids)))
            except WorkerLost as lost:
                sent.append(lost)
        compiled: dict[int, pb.CompiledProgram] = {}
        lost: list[WorkerLost] = []
        for index, reply in enumerate(sent):
            try:
                if isinstance(reply, WorkerLost):
                    raise reply
                link, future = reply
                compiled[index] = link.result(future).compiled
            except WorkerLost as error:
                lost.append(error)
        description = next(iter(compiled.values()), None)
        if description is None:
            substitute = stand_in() if stand_in is not None else None
            if substitute is None:
                raise lost[0]
            description = self._compile_in_stead(substitute, stablehlo, options, local_ids, lost[0])
        info = program_from_proto(description, tuple(device_ids))
        program = RemoteProgram(
            **{f.name: getattr(info, f.name) for f in dataclasses.fields(ProgramInfo)},
            hosts=tuple(hosts),
            stablehlo=stablehlo,
            compile_options=options,
            local_device_ids=tuple(local_ids),
        )
        with self._lock:
            known = self._compiled[program] = {hosts[i].incarnation: ids[i] for i in compiled}
        # Once no session handle, compile-cache entry or running request holds the program, its
        # workers drop it too (their table of programs would only grow otherwise).
        weakref.finalize(program, self._dropped.put, (program.hosts, known))
        return program

    def _compile_in_stead(
        self, worker: pb.Device, stablehlo: bytes, options: bytes, local_ids, lost: WorkerLost
    ) -> pb.CompiledProgram:
        """The program compiled on ``worker`` for its description only (it forgets it at once).

        Raises ``lost`` (the hosts' loss) if ``worker`` is lost too.
        """
        program_id = next(self._program_ids)
        link = self.control_link(worker)
        try:
            compiled = link.result(self._send_compile(link, program_id, stablehlo, options, local_ids)).compiled
            link.send(pb.Command(forget_program=pb.ForgetProgram(program=program_id)))
        except WorkerLost:
            raise lost from None
        return compiled

    def _forget_forever(self) -> None:
        """Tells workers to drop the programs no one can run any more, in batches."""
        while True:
            dropped = [self._dropped.get()]
            while not self._dropped.empty():
                dropped.append(self._dropped.get())
            if self._closed:
                return
            try:
                self._forget(dropped)
            except Exception:
                _LOGGER.exception("telling workers to forget programs failed")

    def _forget(self, dropped: list) -> None:
        """Sends ``ForgetProgram`` once each worker has taken in every command sent to it before.

        An ``Execute`` of the program may still be on its way on a session's stream (the stream
        ``ForgetProgram`` goes on is another): an empty ``Wait`` on each such stream answers only
        after the worker has read all that came before it.
        """
        by_worker: dict[str, tuple[pb.Device, list[int]]] = {}
        for hosts, known in filter(None, dropped):
            for host in hosts:
                state = self.worker(host.worker_id)
                program_id = known.get(state.incarnation) if state is not None and state.healthy else None
                if program_id is None:
                    continue  # not compiled there, or that worker restarted (and forgot it with its process)
                if host.worker_id not in by_worker:
                    current = pb.Device()
                    current.CopyFrom(host)
                    current.incarnation, current.worker_address = state.incarnation, state.address
                    by_worker[host.worker_id] = (current, [])
                by_worker[host.worker_id][1].append(program_id)
        for worker_id, (device, program_ids) in by_worker.items():
            taken_in = [f for session in list(self._sessions) if (f := session.taken_in(worker_id)) is not None]
            wait(taken_in, timeout=30)  # a stream that breaks meanwhile took its worker's session with it
            link = self.control_link(device)
            for program_id in program_ids:
                link.send(pb.Command(forget_program=pb.ForgetProgram(program=program_id)))

    def profile_resource_manager(self, control: pb.ProfileControl) -> bytes:
        """Starts or stops a trace of the resource manager's process; the stop returns it (blocks)."""
        try:
            return self._rm.Profile(control, timeout=120).xspace
        except grpc.RpcError as error:
            raise _rm_error(error, self.rm_address) from None

    def query(self, worker: pb.Device, command: pb.Command, field: str) -> pb.Reply:
        link = self.control_link(worker)
        return link.result(link.request(command, field))

    def layout_waits(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bool:
        return not self._layouts.known(device.platform, (device.kind, dtype_kind, dims, memory_kind))

    def default_layout(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bytes:
        """The device's default layout, answered whatever the state of its worker (see ``proxy.layouts``)."""
        command = pb.Command(layout_query=pb.LayoutQuery(dtype_kind=dtype_kind, dims=dims, device_id=device.local_id))
        return self._layouts.layout(
            device.platform,
            (device.kind, dtype_kind, dims, memory_kind),
            dims,
            lambda: self.query(device, command, "layout_query").layout,
            fallback_on=RequestError,
        )

    def close(self) -> None:
        """Ends every session's leases and streams; anything waiting on a worker fails."""
        self._closed = True
        self._dropped.put(None)
        for session in list(self._sessions):
            session.release()
        for link in self._control.values():
            link.close()
        self._channel.close()


def _session_options(attributes: dict[str, Any], default_timeout_s: float, default_tenant: str) -> SessionOptions:
    try:
        return SessionOptions.from_attributes(attributes, default_timeout_s, default_tenant)
    except ValueError as e:
        shown = {k: v for k, v in attributes.items() if k != SECRET}
        raise InvalidRequest(f"malformed session options {shown}: {e}") from e


def _rm_error(error: grpc.RpcError, address: str) -> RequestError:
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"the resource manager at {address} is unreachable: {error.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(error.details())
    failure = RequestError(error.details() or code.name)
    failure.code = code.value[0]
    return failure
