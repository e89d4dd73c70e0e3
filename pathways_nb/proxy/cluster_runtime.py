"""The devices of a cluster, as a proxy serves them: leases from the resource manager, work on workers.

Each client session holds an allocation (a lease that lasts as long as its
``Allocate`` call) and opens a command stream to each worker it uses. Device
ids are the cluster's global ids; a worker only ever sees its own local ids.

Where data moves:

- host <-> device: through the proxy, which is where the client's bytes are;
- device -> device on one worker: a copy on that worker;
- device -> device across workers (islands): the source worker sends straight
  to the destination worker; the proxy only tells both what to do.

A program runs on one island (H=1: one worker); one that spans islands is
refused with an explanation of how to pipeline across them.
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
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any

import grpc
import numpy as np

from pathways_nb.events import EventSink
from pathways_nb.protocol import dtypes, schema
from pathways_nb.protocol.errors import (
    DeadlineExceeded,
    InvalidRequest,
    RequestError,
    Unavailable,
)
from pathways_nb.protocol.layouts import LayoutBook
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.remote_arrays import (
    MultiHostArray,
    PartedArray,
    RemoteArray,
    ShardedRemoteArray,
    explain_failure,
)
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.rpc.convert import array_meta, program_from_proto
from pathways_nb.runtime_api import (
    DeviceDescription,
    ProgramInfo,
    check_assemble_parts,
    check_sharding,
    describe_device,
    not_in_session,
)
from pathways_nb.security import ClusterCredentials
from pathways_nb.session_options import SECRET, SessionOptions

_LOGGER = logging.getLogger(__name__)

# How long after its stream to a worker broke a session opens a new one, if the cluster still finds
# that worker healthy (a dead worker is reported well within this; see ``ClusterSession._link``).
RELINK_AFTER_S = 5.0


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
        self, rm_address: str, allocation_timeout_s: float = 60.0, credentials: ClusterCredentials | None = None
    ):
        self.rm_address = rm_address
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

    def open_session(self, session_id: int, attributes: dict[str, Any], events: EventSink) -> ClusterSession:
        """Allocates devices for a session, waiting in the queue if the cluster is busy."""
        options = _session_options(attributes, self.allocation_timeout_s, f"{self.key}-s{session_id}")
        request = pb.AllocateRequest(
            tenant=options.tenant,
            exclusive=options.exclusive,
            num_devices=options.num_devices,
            islands=options.islands,
            timeout_s=options.timeout_s,
        )
        lease = self.allocate(request)
        try:
            for update in lease:
                if update.HasField("granted"):
                    session = ClusterSession(self, session_id, update.granted, lease, events, options)
                    self._sessions.add(session)
                    session.hold_lease(request)
                    return session
                _LOGGER.info("session %d: %s", session_id, update.waiting.reason)
        except grpc.RpcError as error:
            raise _rm_error(error, self.rm_address) from None
        raise Unavailable(f"the resource manager at {self.rm_address} ended the allocation before granting it")

    def allocate(self, request: pb.AllocateRequest, wait_for_ready: bool = False):
        """The resource manager's ``Allocate`` stream (``wait_for_ready``: wait for it to be reachable)."""
        return self._rm.Allocate(request, wait_for_ready=wait_for_ready)

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
        self, hosts: Sequence[pb.Device], stablehlo: bytes, options: bytes, device_ids, local_ids
    ) -> RemoteProgram:
        """Compiles on every host of the program at once (blocks: it runs on the compile pool)."""
        ids = [next(self._program_ids) for _ in hosts]
        links = [self.control_link(host) for host in hosts]
        replies = [
            self._send_compile(link, program_id, stablehlo, options, local_ids)
            for link, program_id in zip(links, ids, strict=True)
        ]
        compiled = [link.result(reply).compiled for link, reply in zip(links, replies, strict=True)]
        info = program_from_proto(compiled[0], tuple(device_ids))
        program = RemoteProgram(
            **{f.name: getattr(info, f.name) for f in dataclasses.fields(ProgramInfo)},
            hosts=tuple(hosts),
            stablehlo=stablehlo,
            compile_options=options,
            local_device_ids=tuple(local_ids),
        )
        with self._lock:
            known = self._compiled[program] = {host.incarnation: i for host, i in zip(hosts, ids, strict=True)}
        # Once no session handle, compile-cache entry or running request holds the program, its
        # workers drop it too (their table of programs would only grow otherwise).
        weakref.finalize(program, self._dropped.put, (program.hosts, known))
        return program

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


class ClusterSession:
    """One client session's devices in the cluster, and its streams to their workers."""

    def __init__(
        self,
        cluster: ClusterRuntime,
        session_id: int,
        allocation: pb.Allocation,
        lease,
        events: EventSink,
        options: SessionOptions,
    ):
        self.cluster = cluster
        self.options = options
        self.events = events
        self.session_id = session_id
        self.allocation = allocation
        self._lease = lease
        self._released = False
        self._devices = {d.id: d for d in allocation.devices}
        self._global_ids = {(d.worker_id, d.local_id): d.id for d in allocation.devices}
        # A device's place on its host (jaxlib's ids of an island's hosts are offsets in one id space).
        by_worker: dict[str, list[pb.Device]] = {}
        for device in allocation.devices:
            by_worker.setdefault(device.worker_id, []).append(device)
        self._ordinals = {
            device.id: ordinal
            for devices in by_worker.values()
            for ordinal, device in enumerate(sorted(devices, key=lambda d: d.local_id))
        }
        self._device_ids = tuple(d.id for d in allocation.devices)
        self._links: dict[str, WorkerLink] = {}
        self._gangs = itertools.count(1)
        self._lock = threading.Lock()
        self._platform = allocation.platform or allocation.devices[0].platform

    # -- devices ---------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self._device_ids

    @property
    def platform(self) -> str:
        return self._platform

    @property
    def platform_version(self) -> str:
        return self.allocation.platform_version or "pathways-nb cluster"

    def describe_devices(self, device_ids: Sequence[int]) -> list[DeviceDescription]:
        # On one island, devices print as local ones do (``runtime_api.describe_device``).
        several_islands = self.cluster.cluster_state().islands > 1
        return [
            describe_device(
                device.id,
                device.platform,
                device.kind,
                device.local_hardware_id,
                device.memory_kinds,
                island=device.island,
                host_index=device.host_index,
                host=device.worker_address,
                ordinal=self._ordinals[device.id],
                name_island=several_islands,
            )
            for device in map(self._device, device_ids)
        ]

    def _device(self, device_id: int) -> pb.Device:
        try:
            return self._devices[device_id]
        except KeyError:
            raise not_in_session(device_id, self._device_ids) from None

    def _current(self, device: pb.Device) -> pb.Device:
        """The device's worker as the cluster knows it now (it may have restarted since the allocation)."""
        worker = self.cluster.worker(device.worker_id)
        if worker is None or worker.incarnation == device.incarnation:
            return device
        current = pb.Device()
        current.CopyFrom(device)
        current.incarnation = worker.incarnation
        current.worker_address = worker.address
        current.healthy = worker.healthy
        current.host_key = worker.host_key
        return current

    def _link(self, device: pb.Device) -> WorkerLink:
        """This session's stream to the device's worker, opened (again) when needed.

        A stream that broke to the worker's current process keeps failing new work with its
        error, until the cluster says that process is gone (then the next one gets a new stream),
        or, if the cluster still finds it healthy ``RELINK_AFTER_S`` later, the break was the
        stream's alone, and a new one is opened: the arrays of the old one are lost either way.
        """
        device = self._current(device)
        with self._lock:
            link = self._links.get(device.worker_id)
            if link is not None and (link.alive or link.incarnation == device.incarnation):
                if link.alive:
                    return link
                if not (self._healthy(device) and link.lost_for_s() > RELINK_AFTER_S):
                    link.send(pb.Command())  # raises the WorkerLost error that ended it
            if not device.healthy:
                worker = self.cluster.worker(device.worker_id)
                reason = f" ({worker.down_reason})" if worker is not None and worker.down_reason else ""
                raise WorkerLost(
                    f"island {device.island} host {device.host_index} ({device.worker_address}) is down{reason}; "
                    f"work on island {device.island} fails until its worker is back. Other islands keep serving"
                )
            if link is not None:
                link.close()
            link = WorkerLink(
                device,
                f"{self.cluster.key}-s{self.session_id}-{device.incarnation}",
                self.cluster.loop,
                self._worker_events,
                credentials=self.cluster.credentials,
                cause=lambda: self.cluster.down_reason(device.worker_id, device.incarnation),
            )
            self._links[device.worker_id] = link
            return link

    def _healthy(self, device: pb.Device) -> bool:
        """Whether the cluster finds the device's worker process (that incarnation) healthy now."""
        worker = self.cluster.worker(device.worker_id)
        return worker is not None and worker.healthy and worker.incarnation == device.incarnation

    def _island_links(self, island: int) -> list[WorkerLink]:
        """This session's links to the hosts of ``island``."""
        with self._lock:
            return [link for link in self._links.values() if link.island == island]

    def _worker_events(self, link: WorkerLink, events: list[pb.Event]) -> None:
        """Events a worker reported, in the cluster's device ids."""
        for recorded in events:
            global_ids = [self._global_ids.get((link.worker_id, d), -1) for d in recorded.device_ids]
            recorded.device_ids[:] = [d for d in global_ids if d >= 0]
            self.events(recorded)

    def taken_in(self, worker_id: str) -> Future | None:
        """Done once the worker has read every command this session sent it so far (None: no open stream)."""
        with self._lock:
            link = self._links.get(worker_id)
        if link is None or not link.alive:
            return None
        try:
            return link.request(pb.Command(wait=pb.Wait()), "wait")
        except RequestError:
            return None

    def worker_down(self, worker: pb.WorkerState) -> None:
        """The resource manager declared a worker dead: fail this session's stream to it now."""
        with self._lock:
            link = self._links.get(worker.worker_id)
        if link is not None and link.alive and link.incarnation == worker.incarnation:
            link.declare_lost(worker.down_reason or "it missed its heartbeats")

    def _worker_ids(self, sharding: IfrtSharding) -> list[str]:
        return sorted({self._device(d).worker_id for d in sharding.device_ids})

    def _local(self, sharding: IfrtSharding) -> IfrtSharding:
        """The sharding in its worker's local device ids."""
        return IfrtSharding(
            tuple(self._device(d).local_id for d in sharding.device_ids), sharding.memory_kind, sharding.op_sharding
        )

    def check_sharding(self, sharding: IfrtSharding) -> None:
        check_sharding(sharding, lambda device_id: self._device(device_id).memory_kinds)

    def layout_waits(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bool:
        device = self._device(device_id)
        return self.cluster.layout_waits(device, dtypes.from_numpy(dtype), tuple(dims), memory_kind)

    def default_layout(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bytes:
        device = self._current(self._device(device_id))
        return self.cluster.default_layout(device, dtypes.from_numpy(dtype), tuple(dims), memory_kind)

    # -- arrays ----------------------------------------------------------------------------

    def put(self, host: np.ndarray, sharding: IfrtSharding):
        kind = dtypes.from_numpy(host.dtype)
        shape = tuple(host.shape)
        if len(self._worker_ids(sharding)) > 1:
            parts = [
                self.put(host[index], IfrtSharding((device_id,), sharding.memory_kind))
                for device_id, index in zip(sharding.device_ids, sharding.shard_indices(shape), strict=True)
            ]
            return self.assemble(shape, sharding, parts)
        link = self._link(self._device(sharding.device_ids[0]))
        array_id = link.new_id()
        meta = array_meta(kind, shape, self._local(sharding))
        link.put(array_id, meta, memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8)))
        return RemoteArray(link, array_id, kind, shape, sharding)

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        singles = [
            self.put(shard, IfrtSharding((device_id,), sharding.memory_kind))
            for shard, device_id in zip(shards, sharding.device_ids, strict=True)
        ]
        return self.assemble(shape, sharding, singles)

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence):
        check_assemble_parts(sharding, [single.sharding.device_ids for single in singles])
        by_link: dict[int, list] = {}
        for single in singles:
            by_link.setdefault(id(single.link), []).append(single)
        if len(by_link) == 1:
            return self._assemble_on(singles[0].link, shape, sharding, singles)
        if len({single.link.island for single in singles}) > 1:
            return ShardedRemoteArray(singles, shape, sharding)
        # The hosts of one island: each assembles its part of one island-wide array.
        hosts = sorted(by_link.values(), key=lambda group: group[0].link.host_index)
        parts = [self._assemble_on(group[0].link, shape, sharding, group) for group in hosts]
        return MultiHostArray(parts, shape, sharding)

    def _assemble_on(self, link: WorkerLink, shape, sharding: IfrtSharding, singles: Sequence) -> RemoteArray:
        array_id = link.new_id()
        meta = array_meta(singles[0].kind, shape, self._local(sharding))
        link.send(pb.Command(assemble=pb.Assemble(id=array_id, meta=meta, parts=[s.array_id for s in singles])))
        return RemoteArray(link, array_id, singles[0].kind, shape, sharding)

    def disassemble(self, value, sharding: IfrtSharding) -> list:
        if isinstance(value, ShardedRemoteArray):
            return list(value.parts)
        parts = value.parts if isinstance(value, MultiHostArray) else [value]
        singles = {}
        for part in parts:
            # Each host splits its own part: the shards of its devices, in the sharding's order.
            device_ids = [d for d in sharding.device_ids if self._device(d).worker_id == part.link.worker_id]
            for device_id, single in zip(device_ids, self._disassemble_on(part, sharding, device_ids), strict=True):
                singles[device_id] = single
        return [singles[device_id] for device_id in sharding.device_ids]

    def _disassemble_on(self, part: RemoteArray, sharding: IfrtSharding, device_ids: list[int]) -> list[RemoteArray]:
        shard_shape = sharding.shard_shape(part.shape)
        ids = [part.link.new_id() for _ in device_ids]
        local = array_meta(0, (), self._local(sharding)).sharding
        part.link.send(pb.Command(disassemble=pb.Disassemble(source=part.array_id, ids=ids, sharding=local)))
        return [
            RemoteArray(part.link, array_id, part.kind, shard_shape, IfrtSharding((device_id,), sharding.memory_kind))
            for array_id, device_id in zip(ids, device_ids, strict=True)
        ]

    def copy(self, value, sharding: IfrtSharding):
        """The value laid out by ``sharding``: on one worker, by sending between workers, or via the proxy."""
        if isinstance(value, MultiHostArray):
            value = ShardedRemoteArray(self.disassemble(value, value.sharding), value.shape, value.sharding)
        targets = self._worker_ids(sharding)
        if isinstance(value, RemoteArray) and targets == [value.link.worker_id] and value.link.alive:
            array_id = value.link.new_id()
            local = array_meta(0, (), self._local(sharding)).sharding
            value.link.send(pb.Command(copy=pb.Copy(source=value.array_id, id=array_id, sharding=local)))
            return RemoteArray(value.link, array_id, value.kind, value.shape, sharding)
        if isinstance(value, RemoteArray) and len(targets) == 1:
            return self._send(value, self._link(self._device(sharding.device_ids[0])), value.shape, sharding, None)
        return self._copy_by_shards(value, sharding)

    def _send(self, value: RemoteArray, target: WorkerLink, shape, sharding: IfrtSharding, region) -> RemoteArray:
        """Has ``value``'s worker send it (or ``region`` of it) straight to ``target``'s worker."""
        array_id = target.new_id()
        meta = array_meta(value.kind, shape, self._local(sharding))
        target.send(pb.Command(expect=pb.Expect(id=array_id, meta=meta)))
        send = pb.Send(
            source=value.array_id,
            peer_address=target.address,
            peer_session=target.session_key,
            id=array_id,
            meta=meta,
            peer_host_key=target.host_key,
        )
        if region is not None:
            send.start.extend(s.start for s in region)
            send.stop.extend(s.stop for s in region)
        value.link.send(pb.Command(send=send))
        return RemoteArray(target, array_id, value.kind, shape, sharding)

    def copy_blocks(self, value, sharding: IfrtSharding) -> bool:
        """Whether the copy goes through the proxy (no source shard holds some target shard): it reads the value."""
        if isinstance(value, RemoteArray) and len(self._worker_ids(sharding)) == 1:
            return False
        source_regions = _source_regions(value)
        return any(
            not any(_contains(region, _region(index, value.shape)) for region in source_regions)
            for index in sharding.shard_indices(value.shape)
        )

    def _copy_by_shards(self, value, sharding: IfrtSharding):
        """Each target shard sent from the source shard that holds it; through the proxy if none does."""
        shape = value.shape
        sources = value.parts if isinstance(value, ShardedRemoteArray) else [value]
        source_regions = _source_regions(value)
        parts = []
        for device_id, index in zip(sharding.device_ids, sharding.shard_indices(shape), strict=True):
            wanted = _region(index, shape)
            holder = next(
                (i for i, region in enumerate(source_regions) if _contains(region, wanted)),
                None,
            )
            if holder is None:  # (``copy_blocks`` says so beforehand: the proxy runs this copy off its loop)
                return self.put(self.to_host(value), sharding)
            relative = tuple(
                slice(w.start - r.start, w.stop - r.start) for w, r in zip(wanted, source_regions[holder], strict=True)
            )
            part_shape = tuple(s.stop - s.start for s in wanted)
            target = self._link(self._device(device_id))
            parts.append(
                self._send(
                    sources[holder], target, part_shape, IfrtSharding((device_id,), sharding.memory_kind), relative
                )
            )
        return self.assemble(shape, sharding, parts)

    def to_host(self, value) -> np.ndarray:
        if isinstance(value, MultiHostArray):
            value = ShardedRemoteArray(self.disassemble(value, value.sharding), value.shape, value.sharding)
        if isinstance(value, ShardedRemoteArray):
            dtype = dtypes.to_numpy(value.parts[0].kind)
            host = np.empty(value.shape, dtype)
            for part, index in zip(value.parts, value.sharding.shard_indices(value.shape), strict=True):
                host[index] = self.to_host(part)
            return host
        try:
            data = value.link.fetch(value.array_id)
        except RequestError as error:
            raise explain_failure(error, self._island_links(value.link.island)) from None
        return np.frombuffer(data, dtypes.to_numpy(value.kind)).reshape(value.shape)

    # -- programs --------------------------------------------------------------------------

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> RemoteProgram:
        devices = [self._current(self._device(d)) for d in device_ids]
        islands = sorted({d.island for d in devices})
        if len(islands) > 1:
            raise InvalidRequest(
                f"this program's devices {list(device_ids)} span islands {islands}. A program runs on one "
                "island (devices that share a fast interconnect); between islands, data moves with "
                "jax.device_put. Split the model into stages, one jit per island, and pipeline microbatches: "
                "run stage 1 on island 0, device_put its outputs to island 1, run stage 2 there"
            )
        # On an island of several hosts every host runs the program; jaxlib ids span the island.
        hosts = list({d.host_index: d for d in sorted(devices, key=lambda d: d.host_index)}.values())
        local_ids = tuple(d.local_id for d in devices)
        options = _localize(compile_options, {d.id: d.local_id for d in devices})
        return self.cluster.compile(hosts, program, options, device_ids, local_ids)

    def execute(self, program: RemoteProgram, args: Sequence, keep: frozenset[int] = frozenset()) -> list:
        if len(program.hosts) > 1:
            return self._execute_on_hosts(program, args, keep)
        device = self._current(self._device(program.device_ids[0]))
        link = self._link(device)
        for index, arg in enumerate(args):
            if isinstance(arg, RemoteArray) and arg.link is link:
                continue
            if isinstance(arg, RemoteArray) and arg.link.worker_id == link.worker_id:
                raise WorkerLost(
                    f"argument {index} of {program.name} was lost when {link.describe()} restarted; "
                    "compute or transfer it again"
                )
            raise InvalidRequest(
                f"argument {index} of {program.name} is not on island {device.island} where the program "
                "runs; move it first (jax.device_put)"
            )
        program_id = self.cluster.program_id_on(program, device, link)
        results = [
            RemoteArray(link, link.new_id(), aval.kind, aval.shape, sharding)
            for aval, sharding in zip(program.signature.results, program.output_shardings, strict=True)
        ]
        link.send(
            pb.Command(
                execute=pb.Execute(
                    program=program_id,
                    args=[a.array_id for a in args],
                    results=[r.array_id for r in results],
                    keep=sorted(keep),
                    tenant=self.options.tenant,
                    weight=self.options.weight,
                )
            )
        )
        return results

    def _execute_on_hosts(self, program: RemoteProgram, args: Sequence, keep: frozenset[int]) -> list:
        """Runs a program on every host of its island, each on its part of the arguments, in the island's order."""
        hosts = [self._current(self._device(d.id)) for d in program.hosts]
        links = [self._link(host) for host in hosts]
        for index, arg in enumerate(args):
            if not (isinstance(arg, MultiHostArray) and [part.link for part in arg.parts] == links):
                raise InvalidRequest(
                    f"argument {index} of {program.name} is not laid out over the hosts of island "
                    f"{hosts[0].island} where the program runs (or was lost when one of them restarted); "
                    "move it there first (jax.device_put with the program's sharding)"
                )
        gang = f"{self.cluster.key}-s{self.session_id}-g{next(self._gangs)}"
        results = [
            [RemoteArray(link, link.new_id(), aval.kind, aval.shape, sharding) for link in links]
            for aval, sharding in zip(program.signature.results, program.output_shardings, strict=True)
        ]
        peers = [link.address for link in links[1:]]
        for host_index, (host, link) in enumerate(zip(hosts, links, strict=True)):
            execute = pb.Execute(
                # Compiled on every host; after a host restarted, compiled there again on this stream,
                # not waited for (the host takes its turn in the island's order once it is compiled).
                program=self.cluster.program_id_on(program, host, link),
                args=[arg.parts[host_index].array_id for arg in args],
                results=[parts[host_index].array_id for parts in results],
                keep=sorted(keep),
                gang=gang,
                gang_peers=peers if host_index == 0 else (),
                tenant=self.options.tenant,
                weight=self.options.weight,
            )
            link.send(pb.Command(execute=execute))
        return [
            MultiHostArray(parts, aval.shape, sharding)
            for parts, aval, sharding in zip(results, program.signature.results, program.output_shardings, strict=True)
        ]

    def cost_analysis(self, program: RemoteProgram) -> dict[str, float]:
        device = self._current(self._device(program.device_ids[0]))
        command = pb.Command(program_query=pb.ProgramQuery(program=self.cluster.compiled_on(program, device)))
        return dict(self.cluster.query(device, command, "program_query").costs.values)

    def program_text(self, program: RemoteProgram) -> str:
        device = self._current(self._device(program.device_ids[0]))
        program_id = self.cluster.compiled_on(program, device)
        command = pb.Command(program_query=pb.ProgramQuery(program=program_id, text=True))
        return self.cluster.query(device, command, "program_query").text

    # -- ending ----------------------------------------------------------------------------

    def hold_lease(self, request: pb.AllocateRequest) -> None:
        """Keeps the allocation for the session's life, claiming it again from a restarted resource manager."""
        threading.Thread(
            target=self._hold_lease, args=(request,), name=f"pathways-lease-{self.session_id}", daemon=True
        ).start()

    def _hold_lease(self, request: pb.AllocateRequest) -> None:
        reclaim = pb.AllocateRequest()
        reclaim.CopyFrom(request)
        reclaim.reclaim_allocation_id = self.allocation.allocation_id
        reclaim.reclaim_device_ids.extend(self._device_ids)
        lease = self._lease
        while True:
            try:
                for _update in lease:
                    pass
            except grpc.RpcError as error:
                if not self._released:
                    _LOGGER.warning(
                        "session %d: lost the resource manager at %s (%s); its devices stay in use, and "
                        "the allocation is claimed again when it is back",
                        self.session_id,
                        self.cluster.rm_address,
                        error.code().name,
                    )
            with self._lock:
                if self._released:
                    return
                # Blocks (without polling) until the resource manager answers again.
                lease = self._lease = self.cluster.allocate(reclaim, wait_for_ready=True)

    def release(self) -> None:
        with self._lock:
            self._released = True
            links, self._links = list(self._links.values()), {}
            lease = self._lease
        for link in links:
            link.close()
        lease.cancel()


def _source_regions(value) -> list[tuple[slice, ...]]:
    """The region of the global array each part of ``value`` holds (a single array: all of it)."""
    if isinstance(value, PartedArray):
        return [_region(index, value.shape) for index in value.sharding.shard_indices(value.shape)]
    return [tuple(slice(0, d) for d in value.shape)]


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def _contains(outer: tuple[slice, ...], inner: tuple[slice, ...]) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner, strict=True))


def _localize(compile_options: bytes, local_ids: dict[int, int]) -> bytes:
    """The compile options with the device assignment in the worker's local ids."""
    options = schema.load().xla.CompileOptionsProto.FromString(compile_options)
    assignment = options.executable_build_options.device_assignment
    for computation in assignment.computation_devices:
        computation.replica_device_ids[:] = [local_ids[i] for i in computation.replica_device_ids]
    return options.SerializeToString()
