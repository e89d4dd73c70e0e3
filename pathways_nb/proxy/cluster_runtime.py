"""The devices of a cluster, as a proxy serves them: the resource manager's view, leases, programs on workers.

``ClusterRuntime`` follows the cluster's workers (``WatchCluster``), gives each client session an
allocation (a lease that lasts as long as its ``Allocate`` call; ``cluster_session.ClusterSession``
serves the session's work on it), and compiles programs on workers, once per worker process.
Following the cluster, granting leases and telling workers to forget programs are coroutines and
callbacks on the proxy's event loop: they hold no thread, and no call on the loop waits for the
resource manager (what the proxy must know of the cluster, it keeps from the watch).

Its state (the workers and groups as last told, the programs compiled and being compiled, the control
streams) is the event loop's, with no lock: every method is the loop's, but the blocking calls of pool
threads (``compile``, ``compiled_on``, ``query``, ``default_layout``), which hand each step that touches it
to the loop (``loop_handoff.on_loop``) and wait off it, and ``close``, which hands the closing to the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pathways_nb.core import nonxla, tuning
from pathways_nb.core.convert import program_from_proto
from pathways_nb.core.dataflow import Pending, when_all
from pathways_nb.core.events import EventSink
from pathways_nb.core.islands import group_name
from pathways_nb.core.loop import call_on, new_event_loop
from pathways_nb.core.retry import Retry
from pathways_nb.core.runtime_api import (
    ProgramInfo,
)
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.core.session_options import SECRET, SessionOptions
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.protocol.errors import Code, InvalidRequest, RequestError, Unavailable
from pathways_nb.protocol.layouts import LayoutBook
from pathways_nb.proxy.cluster_api import GroupPlacement, RemoteProgram
from pathways_nb.proxy.cluster_session import ClusterSession
from pathways_nb.proxy.connection_output import HostLineSink
from pathways_nb.proxy.lease import Lease, grant
from pathways_nb.proxy.loop_handoff import on_loop
from pathways_nb.proxy.rm_client import CLOSE_WAIT_S, PROFILE_DEADLINE_S, RmClient, allocate_request, run_on_loop
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


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
        # The proxy's one client of the resource manager (its channel lives on the loop).
        self.rm = RmClient(rm_address, self.credentials)
        # Taken only to start a loop of its own (used without a proxy server), where none exists yet: never on a loop.
        self._own_loop_lock = threading.Lock()
        # Program ids name programs on workers, which every proxy of the cluster shares: each proxy
        # counts from its own random start, far from any other's (ids of two proxies never meet).
        self._program_ids = itertools.count(secrets.randbits(40) << 20)
        # Per program (by identity): worker incarnation -> program id on that worker.
        self._compiled: weakref.WeakKeyDictionary[RemoteProgram, dict[int, int]] = weakref.WeakKeyDictionary()
        # Each program's hosts, by worker id, and the workers it was compiled on since (a session that moved to
        # other devices compiles its programs there): where to forget it.
        self._compiled_where: weakref.WeakKeyDictionary[RemoteProgram, dict[str, pb.Device]] = (
            weakref.WeakKeyDictionary()
        )
        # Compiles sent without waiting (program_id_on), by program id, until their reply: (reply, stream).
        self._compiling: dict[int, tuple[Pending, WorkerLink]] = {}
        self._control: dict[str, WorkerLink] = {}
        self._layouts = LayoutBook()
        self._sessions: weakref.WeakSet[ClusterSession] = weakref.WeakSet()
        self._workers: dict[str, pb.WorkerState] = {}
        # How many islands the cluster has (0 until the watch says): devices name theirs when there are several.
        self.islands = 0
        # Why the watch stopped for good (a permanent error, e.g. a refused token), if it did.
        self.watch_failure: RequestError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch_task: asyncio.Task | None = None
        self._owns_loop = False  # (used without a proxy server: the loop thread is its own, stopped by close)
        self._closed = False
        # Programs no one can run any more (see ``compile``), until the loop tells their workers.
        self._dropped: list[tuple] = []
        # Groups of islands as the watch (or a FormGroup) last told, their numbers, and the formings under way.
        self._groups: dict[str, pb.GroupState] = {}
        self._group_islands: dict[str, int] = {}
        self._forming: dict[str, Pending] = {}

    # -- cluster state ---------------------------------------------------------------------

    async def _watch(self) -> None:
        """Follows the resource manager's view of the workers, failing fast on dead ones.

        While the resource manager is away the stream waits for it (``wait_for_ready``, no polling);
        a stream that fails is opened again after a backoff, and a failure no retry gets past
        (``retry.is_permanent``: a refused token) stops the watch with an error in the log.
        """
        retry = Retry(f"following the resource manager at {self.rm_address}")
        request = pb.ClusterStateRequest(deltas=True)  # after the first state, only the workers that changed
        while not self._closed and not self.rm.closed:
            try:
                async for state in self.rm.watch(request):
                    self._update(state)
                    retry.succeeded()
            except grpc.aio.AioRpcError as error:
                if self._closed or self.rm.closed:
                    return
                try:
                    wait_s = retry.failed(error)
                except RequestError as failure:
                    self.watch_failure = failure
                    _LOGGER.error("stopped following the cluster: %s", failure.message)
                    return
                name = error.code().name
                _LOGGER.warning("lost the resource manager at %s (%s); again in %.1f s", self.rm_address, name, wait_s)
                await asyncio.sleep(wait_s)

    def _update(self, state: pb.ClusterState) -> None:
        if state.islands:
            self.islands = state.islands
        # Merged, not replaced: a resource manager that just restarted does not know every worker
        # yet, and a worker it has not heard from again is where it was, not gone.
        self._workers.update((w.worker_id, w) for w in state.workers)
        for worker in state.workers:
            if not worker.healthy:
                for session in list(self._sessions):
                    session.worker_down(worker)
        if any(worker.draining for worker in state.workers):
            for session in list(self._sessions):
                session.hosts_draining()
        self._update_groups(state.groups)

    # -- groups of islands (multislice) ---------------------------------------------------------

    def _update_groups(self, groups) -> None:
        """Takes the groups' states: their members are workers too, and a group that went down fails its links."""
        for group in groups:
            self._groups[group.group] = group
            self._workers.update((m.worker_id, m) for m in group.members)
        for group in groups:
            for member in group.members:
                if not member.healthy:
                    for session in list(self._sessions):
                        session.worker_down(member)

    def serving(self, islands) -> GroupPlacement | None:
        """The placement of the group of ``islands`` if it serves now (never forms one)."""
        state = self._groups.get(group_name(islands))
        return self._placement(state) if state is not None and state.healthy else None

    def last_placement(self, name: str) -> GroupPlacement | None:
        """The group's placement as last known, serving or not (for arrays that live, or lived, on it)."""
        state = self._groups.get(name)
        return self._placement(state) if state is not None else None

    def group(self, islands) -> Pending:
        """The placement of a group of islands, once it serves (on the loop; never waits: the forming is a task).

        Fails with ``WorkerLost`` (DATA_LOSS) naming the host that keeps it from serving.
        """
        name = group_name(islands)
        state = self._groups.get(name)
        if state is not None and state.healthy:
            placed = Pending()
            placed.resolve(self._placement(state))
            return placed
        forming = self._forming.get(name)
        if forming is None:
            forming = self._forming[name] = Pending()
            self.loop.create_task(self._form(name, sorted(set(islands)), forming))
        return forming

    async def _form(self, name: str, islands: list[int], forming: Pending) -> None:
        try:
            state = await self.rm.form_group(islands, tuning.GROUP_FORM_TIMEOUT_S.value)
        except RequestError as failure:
            if failure.code == Code.UNAVAILABLE:  # a host is down: the work fails as on its island
                failure = WorkerLost(f"{failure.message}. Programs over one island keep running on the others")
            self._forming.pop(name, None)
            forming.fail(failure)
            return
        self._update_groups([state])
        self._forming.pop(name, None)
        forming.resolve(self._placement(state))

    def _placement(self, state: pb.GroupState) -> GroupPlacement:
        number = self._group_islands.setdefault(state.group, -1 - len(self._group_islands))
        order = {m.worker_id: k for k, m in enumerate(state.members)}
        devices = {}
        for device in state.devices:
            member = pb.Device()
            member.CopyFrom(device)
            # One island of several hosts, as far as links go: its own number, the member's index as host.
            member.island, member.host_index = number, order[device.worker_id]
            devices[device.id] = member
        return GroupPlacement(state.group, number, state.epoch, devices)

    def worker(self, worker_id: str) -> pb.WorkerState | None:
        return self._workers.get(worker_id)

    def current(self, device: pb.Device) -> pb.Device:
        """The device's worker as the cluster knows it now (it may have restarted since the allocation)."""
        worker = self.worker(device.worker_id)
        if worker is None or (worker.incarnation == device.incarnation and worker.healthy == device.healthy):
            return device
        current = pb.Device()
        current.CopyFrom(device)
        current.incarnation = worker.incarnation
        current.worker_address = worker.address
        current.healthy = worker.healthy
        current.host_key = worker.host_key
        return current

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
        if device.group:
            return WorkerLost(
                f"{device.place} is down{reason}; work over islands {device.group} fails until the group is formed "
                "again, once its hosts are back. Programs over one island keep running"
            )
        return WorkerLost(
            f"island {device.island} host {device.host_index} ({device.worker_address}) is down{reason}; "
            f"work on island {device.island} fails until its worker is back. Other islands keep serving"
        )

    async def cluster_state(self) -> pb.ClusterState:
        """The resource manager's view of the cluster (on the loop)."""
        return await self.rm.cluster_state()

    # -- the loop the worker streams live on ---------------------------------------------------

    def serve_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs the watch and the streams to workers on ``loop``, the proxy's own (before any session opens)."""
        self._loop = loop
        self._start_watching(loop)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The streams' loop: the proxy's, or (used without a proxy server) a loop thread of its own."""
        if self._loop is not None:
            return self._loop
        with self._own_loop_lock:  # (no loop exists yet: no loop takes it)
            if self._loop is not None:
                return self._loop
            loop = new_event_loop()
            self._owns_loop = True
            threading.Thread(target=loop.run_forever, name="pathways-links", daemon=True).start()
            self._start_watching(loop)
            self._loop = loop
        return loop

    async def stop_serving(self) -> None:
        """The proxy stops (on its loop): the watch ends, the streams close (what waits on them fails), and the client
        of the resource manager closes."""
        self._close_streams()
        await self.rm.close()

    def _start_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        def start() -> None:
            if self._watch_task is None:
                self._watch_task = loop.create_task(self._watch())

        call_on(loop, start)

    # -- sessions --------------------------------------------------------------------------

    async def open_session(
        self, session_id: int, attributes: dict[str, Any], events: EventSink, output: HostLineSink | None = None
    ) -> ClusterSession:
        """Allocates devices for a session (on the loop), waiting in the queue if the cluster is busy."""
        options = _session_options(attributes, self.allocation_timeout_s, f"{self.key}-s{session_id}")
        request = allocate_request(options, options.num_devices, options.timeout_s)
        lease = await self.allocate(session_id, request)
        session = ClusterSession(self, session_id, lease, events, options, output)
        self._sessions.add(session)
        lease.hold(session_id)
        return session

    async def allocate(self, session_id: int, request: pb.AllocateRequest, on_waiting=None) -> Lease:
        """A granted lease for ``request`` (on the loop), waiting in the queue as long as it says; the resource
        manager's refusal as a ``RequestError``."""

        def waiting(update: pb.Waiting) -> None:
            _LOGGER.info("session %d: %s", session_id, update.reason)
            if on_waiting is not None:
                on_waiting(update)

        return await grant(self.rm, request, waiting)

    # -- programs --------------------------------------------------------------------------

    def control_link(self, worker: pb.Device) -> WorkerLink:
        """The proxy's own stream to a worker, for compiling and querying programs (on the loop)."""
        link = self._control.get(worker.worker_id)
        if link is None or not link.alive or link.incarnation != worker.incarnation:
            if link is not None:
                link.close()
            link = WorkerLink(
                worker, f"{self.key}-control-{worker.incarnation}", self.loop, credentials=self.credentials
            )
            self._control[worker.worker_id] = link
        return link

    def program_id_on(self, program: RemoteProgram, worker: pb.Device, link: WorkerLink | None = None) -> int:
        """The id of ``program`` on the worker's current incarnation; if it is not compiled there, the compile is sent.

        On the loop. The compile goes on ``link`` (the stream of the command that uses the id; the worker serves
        a stream in order, so that command waits there for the compile) and is not waited for: no
        caller, the proxy's event loop least of all, waits for a worker here. A compile that fails
        fails the commands that use the id, and the next use compiles again. While the compile is
        on its way on another stream (another session's), it is sent on ``link`` too, under the
        same id: streams are not ordered with each other (the worker compiles once, by content).
        """
        known = self._compiled.setdefault(program, {})
        program_id = known.get(worker.incarnation)
        sent = self._compiling.get(program_id) if program_id is not None else None
        if program_id is not None and (sent is None or link is None or sent[1] is link):
            return program_id
        new = program_id is None
        if new:
            program_id = known[worker.incarnation] = next(self._program_ids)
            self._compiled_where.setdefault(program, {}).setdefault(worker.worker_id, worker)
        link = link or self.control_link(worker)
        try:
            reply = self._send_compile(
                link, program_id, program.stablehlo, program.compile_options, program.local_device_ids
            )
        except RequestError:
            if new:
                known.pop(worker.incarnation, None)
            raise

        def replied(_value, error: BaseException | None) -> None:  # (on the loop: the link's replies are read there)
            if self._compiling.get(program_id, (None,))[0] is reply:
                del self._compiling[program_id]
            if error is not None and known.get(worker.incarnation) == program_id:
                del known[worker.incarnation]

        self._compiling[program_id] = (reply, link)
        reply.on_done(replied)
        return program_id

    def compiled_on(self, program: RemoteProgram, worker: pb.Device) -> int:
        """``program_id_on``, once the program is compiled there (blocks: a pool thread's call)."""
        program_id, compiling = on_loop(self.loop, self._compiling_on, program, worker)
        if compiling is not None:
            compiling.wait()
        return program_id

    def _compiling_on(self, program: RemoteProgram, worker: pb.Device) -> tuple[int, Pending | None]:
        """The program's id on the worker, and its compile's pending reply if it is on its way (on the loop)."""
        program_id = self.program_id_on(program, worker)
        sent = self._compiling.get(program_id)
        return program_id, (sent[0] if sent is not None else None)

    def _send_compile(
        self, link: WorkerLink, program_id: int, stablehlo: bytes, options: bytes, local_ids: tuple[int, ...]
    ) -> Pending:
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
        """Compiles on every host of the program at once (blocks: it runs on the compile pool; the compiles are
        sent, and the program recorded, on the loop).

        A program compiles whatever the state of its island, as on Pathways, where the compile
        does not need the slice (pathwaysutils' elastic health check compiles a program for each
        slice and counts a slice down only when running it fails): a host that is down, or lost
        meanwhile, compiles it when it is back, on the stream of its first execution there
        (``program_id_on``), and executions on it fail with DATA_LOSS until then. If every host is
        down, a healthy worker with the same kind of devices (``stand_in``) compiles it in their
        stead, for its description, and forgets it; with none, the compile fails with the loss.
        """
        ids, sent = on_loop(self.loop, self._send_compiles, hosts, stablehlo, options, local_ids)
        compiled: dict[int, pb.CompiledProgram] = {}
        lost: list[WorkerLost] = []
        for index, reply in enumerate(sent):
            try:
                if isinstance(reply, WorkerLost):
                    raise reply
                compiled[index] = reply.wait().compiled
            except WorkerLost as error:
                lost.append(error)
        description = next(iter(compiled.values()), None)
        if description is None:
            substitute = on_loop(self.loop, stand_in) if stand_in is not None else None
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
        on_loop(self.loop, self._compiled_now, program, {hosts[i].incarnation: ids[i] for i in compiled})
        return program

    def _send_compiles(
        self, hosts: Sequence[pb.Device], stablehlo: bytes, options: bytes, local_ids
    ) -> tuple[list[int], list[Pending | WorkerLost]]:
        """A new program id per host, and its compile sent there (or the loss of its worker; on the loop)."""
        ids = [next(self._program_ids) for _ in hosts]
        sent: list[Pending | WorkerLost] = []
        for host, program_id in zip(hosts, ids, strict=True):
            try:
                if not host.healthy:
                    raise self.down(host)
                sent.append(self._send_compile(self.control_link(host), program_id, stablehlo, options, local_ids))
            except WorkerLost as lost:
                sent.append(lost)
        return ids, sent

    def _compiled_now(self, program: RemoteProgram, known: dict[int, int]) -> None:
        """Records where ``program`` is compiled (on the loop)."""
        self._compiled[program] = known
        where = self._compiled_where[program] = {host.worker_id: host for host in program.hosts}
        # Once no session handle, compile-cache entry or running request holds the program, its
        # workers drop it too (their table of programs would only grow otherwise).
        weakref.finalize(program, self._drop, (where, known))

    def _compile_in_stead(
        self, worker: pb.Device, stablehlo: bytes, options: bytes, local_ids, lost: WorkerLost
    ) -> pb.CompiledProgram:
        """The program compiled on ``worker`` for its description only (it forgets it at once).

        Raises ``lost`` (the hosts' loss) if ``worker`` is lost too. Blocks (a pool thread's call).
        """

        def send() -> tuple[int, Pending]:
            program_id = next(self._program_ids)
            return program_id, self._send_compile(self.control_link(worker), program_id, stablehlo, options, local_ids)

        def forget(program_id: int) -> None:
            self.control_link(worker).send(pb.Command(forget_program=pb.ForgetProgram(program=program_id)))

        try:
            program_id, reply = on_loop(self.loop, send)
            compiled = reply.wait().compiled
            on_loop(self.loop, forget, program_id)
        except WorkerLost:
            raise lost from None
        return compiled

    def _drop(self, dropped: tuple) -> None:
        """A program no one can run any more (a finalizer, on any thread): its workers are told soon, on the loop.

        Always through ``call_soon_threadsafe``, never at once: a finalizer may run on the loop's
        own thread in the middle of other work.
        """
        loop = self._loop  # (not ``self.loop``, which would start a loop of its own: GC runs anywhere)
        if self._closed or loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._collect_dropped, dropped)
        except RuntimeError:
            pass  # the loop is closed: the process is ending, and the workers forget with their sessions

    def _collect_dropped(self, dropped: tuple) -> None:
        self._dropped.append(dropped)
        if len(self._dropped) == 1:  # the first of a batch: the rest of this turn's finalizers join it
            self.loop.call_soon(self._forget_dropped)

    def _forget_dropped(self) -> None:
        """Sends ``ForgetProgram`` once each worker has taken in every command sent to it before.

        An ``Execute`` of the program may still be on its way on a session's stream (the stream
        ``ForgetProgram`` goes on is another): an empty ``Wait`` on each such stream answers only
        after the worker has read all that came before it (or, at most, ``tuning.FORGET_PROGRAM_WAIT_S`` later).
        """
        dropped, self._dropped = self._dropped, []
        by_worker: dict[str, tuple[pb.Device, list[int]]] = {}
        for where, known in dropped:
            for host in list(where.values()):
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
            taken_in = [p for session in list(self._sessions) if (p := session.taken_in(worker_id)) is not None]
            send = _once(lambda device=device, program_ids=program_ids: self._send_forget(device, program_ids))
            when_all(taken_in, lambda _error, send=send: call_on(self.loop, send))
            # (A stream that breaks meanwhile took its session, and its arrays, with it.)
            self.loop.call_later(tuning.FORGET_PROGRAM_WAIT_S.value, send)

    def _send_forget(self, device: pb.Device, program_ids: list[int]) -> None:
        if self._closed:
            return
        try:
            link = self.control_link(device)
            for program_id in program_ids:
                link.send(pb.Command(forget_program=pb.ForgetProgram(program=program_id)))
        except RequestError as error:
            _LOGGER.info("telling %s to forget programs failed: %s", device.worker_id, error.message)

    async def drain(self, request: pb.DrainRequest) -> pb.WorkerState:
        """Has the resource manager drain a host (or put it back in service); its state (on the loop)."""
        return await self.rm.drain(request)

    def profile_resource_manager(self, control: pb.ProfileControl) -> bytes:
        """Starts or stops a trace of the resource manager's process; the stop returns it (blocks: for a pool
        thread, which waits for the loop's call)."""
        answer = run_on_loop(self.loop, lambda: self.rm.profile(control))
        try:
            return answer.wait(PROFILE_DEADLINE_S + CLOSE_WAIT_S)
        except TimeoutError:  # the loop never made the call: the proxy is stopping
            raise Unavailable("the proxy stopped before it asked the resource manager for its trace") from None

    def query(self, worker: pb.Device, command: pb.Command, field: str) -> pb.Reply:
        """The worker's (current process's) reply to ``command`` on the proxy's control stream (blocks)."""
        return on_loop(self.loop, lambda: self.control_link(self.current(worker)).request(command, field)).wait()

    def layout_waits(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bool:
        return not self._layouts.known(device.platform, (device.kind, dtype_kind, dims, memory_kind))

    def default_layout(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bytes:
        """The device's default layout, answered whatever the state of its worker (see ``proxy.layouts``).

        Blocks (a pool thread's call) when its worker is asked (``layout_waits``); answers at once when known.
        """
        command = pb.Command(layout_query=pb.LayoutQuery(dtype_kind=dtype_kind, dims=dims, device_id=device.local_id))
        return self._layouts.layout(
            device.platform,
            (device.kind, dtype_kind, dims, memory_kind),
            dims,
            lambda: self.query(device, command, "layout_query").layout,
            fallback_on=RequestError,
        )

    def close(self) -> None:
        """Ends every session's leases and streams, on the loop (the call does not wait for it: a proxy server's loop
        may have stopped already, its sessions closed); anything waiting on a worker fails."""
        self._closed = True  # (set once, read on the loop: nothing is compiled or forgotten after it)
        loop = self._loop
        if loop is not None:
            call_on(loop, self._close_streams)
        if self._owns_loop:  # (a proxy server's loop closed the client as it stopped: ``stop_serving``)
            try:
                run_on_loop(self.loop, self.rm.close).wait(CLOSE_WAIT_S)
            except TimeoutError:
                _LOGGER.warning("the channel to the resource manager did not close in time")
            self.loop.call_soon_threadsafe(self.loop.stop)  # after the links' last callbacks on it

    def _close_streams(self) -> None:
        """Ends the watch, every session's leases and streams, and the control streams (on the loop)."""
        self._closed = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        for session in list(self._sessions):
            session.release()
        for link in self._control.values():
            link.close()


def _once(function: Callable[[], None]) -> Callable[[], None]:
    """``function``, run the first time the result is called only."""
    done = []

    def run() -> None:
        if not done:
            done.append(True)
            function()

    return run


def _session_options(attributes: dict[str, Any], default_timeout_s: float, default_tenant: str) -> SessionOptions:
    try:
        return SessionOptions.from_attributes(attributes, default_timeout_s, default_tenant)
    except ValueError as e:
        shown = {k: v for k, v in attributes.items() if k != SECRET}
        raise InvalidRequest(f"malformed session options {shown}: {e}") from e
