"""One client session's devices in a cluster: its streams to their workers, its arrays and its programs.

Device ids are the cluster's global ids; a worker only ever sees its own local ids. Where data moves:

- host <-> device: through the proxy, which is where the client's bytes are;
- device -> device on one worker: a copy on that worker;
- device -> device across workers (islands): the source worker sends straight
  to the destination worker; the proxy only tells both what to do.

A program runs where its devices are: on one island's workers, or, if they span islands, on the
members of the group of those islands (``rm.groups``), which the proxy has the resource manager form
when a program first needs it. An array over several islands lives on their group if it serves, else
on the islands' own workers until a program over it moves it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pathways_nb.core import nonxla, string_arrays, tuning
from pathways_nb.core.convert import array_meta, status_of
from pathways_nb.core.dataflow import Pending, fulfil
from pathways_nb.core.events import EventSink
from pathways_nb.core.islands import group_name
from pathways_nb.core.loop import on_loop_thread
from pathways_nb.core.runtime_api import (
    DeviceDescription,
    check_assemble_parts,
    check_sharding,
    describe_device,
    not_in_session,
)
from pathways_nb.core.session_options import SessionOptions
from pathways_nb.protocol import dtypes, schema
from pathways_nb.protocol.errors import (
    InvalidRequest,
    RequestError,
    Unavailable,
    as_request_error,
)
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.connection_output import HostLineSink
from pathways_nb.proxy.remote_arrays import (
    MultiHostArray,
    PartedArray,
    RemoteArray,
    ShardedRemoteArray,
    explain_failure,
)
from pathways_nb.proxy.rm_client import allocate_request
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb

if TYPE_CHECKING:
    from pathways_nb.proxy.cluster_runtime import ClusterRuntime, RemoteProgram
    from pathways_nb.proxy.lease import Lease

_LOGGER = logging.getLogger(__name__)


class ClusterSession:
    """One client session's devices in the cluster, and its streams to their workers."""

    proxy_is_host = False

    def __init__(
        self,
        cluster: ClusterRuntime,
        session_id: int,
        lease: Lease,
        events: EventSink,
        options: SessionOptions,
        output: HostLineSink | None = None,
    ):
        self.cluster = cluster
        self.options = options
        self.events = events
        self.output = output  # what the session's code beside the devices writes (None: nowhere)
        self.session_id = session_id
        self.allocation = allocation = lease.granted
        self._lease = lease
        self._devices: dict[int, pb.Device] = {}
        self._global_ids: dict[tuple[str, int], int] = {}
        self._take(allocation.devices)
        colocated = {d.id: _colocated_device(d) for d in allocation.devices if d.HasField("colocated")}
        # A device's place on its host (jaxlib's ids of an island's hosts are offsets in one id space);
        # a colocated CPU device has its device's place.
        by_worker: dict[str, list[pb.Device]] = {}
        for device in allocation.devices:
            by_worker.setdefault(device.worker_id, []).append(device)
        self._ordinals = {
            device.id: ordinal
            for devices in by_worker.values()
            for ordinal, device in enumerate(sorted(devices, key=lambda d: d.local_id))
        }
        self._colocation_ids: dict[int, int] = {}
        for device_id, cpu in colocated.items():
            self._ordinals[cpu.id] = self._ordinals[device_id]
            self._colocation_ids[device_id] = self._colocation_ids[cpu.id] = device_id
        self._device_ids = tuple(d.id for d in allocation.devices)
        self._colocated_device_ids = tuple(cpu.id for cpu in colocated.values())
        self._links: dict[str, WorkerLink] = {}
        self._gangs = itertools.count(1)
        self._lock = threading.Lock()
        self._platform = allocation.platform or allocation.devices[0].platform
        self._on_drain: Callable[[], None] | None = None
        # The session's devices (the ids its client knows, for its whole life) -> the cluster's devices that serve
        # them now: the same ones until it resumes on others (virtual devices).
        self._physical = {device_id: device_id for device_id in self._device_ids}

    def _take(self, devices: Sequence[pb.Device]) -> None:
        """Makes ``devices`` (each under the session's id for it) the session's, with their colocated CPU devices
        (a cluster with colocated Python: as devices of their workers)."""
        colocated = [_colocated_device(d) for d in devices if d.HasField("colocated")]
        self._devices = {d.id: d for d in [*devices, *colocated]}
        self._global_ids = {(d.worker_id, d.local_id): d.id for d in self._devices.values()}

    # -- devices ---------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self._device_ids

    @property
    def colocated_device_ids(self) -> tuple[int, ...]:
        return self._colocated_device_ids

    @property
    def platform(self) -> str:
        return self._platform

    @property
    def platform_version(self) -> str:
        return self.allocation.platform_version or "pathways-nb cluster"

    def describe_devices(self, device_ids: Sequence[int]) -> list[DeviceDescription]:
        # Each island a slice where the cluster has several (unless the session asked for one slice); on one
        # island, devices print as local ones do (``runtime_api.describe_device``).
        several_islands = max(self.cluster.islands, self.allocation.cluster_islands) > 1
        island_is_slice = several_islands and not self.options.one_slice
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
                island_is_slice=island_is_slice,
                colocation_id=self._colocation_ids.get(device.id),
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
        if worker is None or (worker.incarnation == device.incarnation and worker.healthy == device.healthy):
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
        or, if the cluster still finds it healthy ``tuning.RELINK_AFTER_S`` later, the break was the
        stream's alone, and a new one is opened: the arrays of the old one are lost either way.
        """
        device = self._current(device)
        with self._lock:
            link = self._links.get(device.worker_id)
            if link is not None and (link.alive or link.incarnation == device.incarnation):
                if link.alive:
                    return link
                if not (self._healthy(device) and link.lost_for_s() > tuning.RELINK_AFTER_S.value):
                    link.send(pb.Command())  # raises the WorkerLost error that ended it
            if not device.healthy:
                raise self.cluster.down(device)
            if link is not None:
                link.close()
            link = WorkerLink(
                device,
                f"{self.cluster.key}-s{self.session_id}-{device.incarnation}",
                self.cluster.loop,
                self._worker_events,
                on_output=self._worker_output,
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

    def _worker_output(self, link: WorkerLink, lines: list[pb.OutputLine]) -> None:
        """Output a worker sent for this session: where it was written is that worker's island and host."""
        if self.output is not None:
            self.output(link.island, link.host_index, lines)

    def taken_in(self, worker_id: str) -> Pending | None:
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
            link.declare_lost(worker.down_reason or "the resource manager lost it")

    # -- where arrays and programs live ----------------------------------------------------------

    def _where(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """Where a program over exactly ``device_ids`` runs: its devices' own worker if they are of one island,
        else each device's twin on the members of the group of their islands (``rm.groups``).

        Off the loop this waits for the group to form; on the loop it must serve already (``ready``).
        """
        devices = {d: self._device(d) for d in device_ids}
        islands = {device.island for device in devices.values()}
        if len(islands) <= 1:
            return devices
        placement = self.cluster.group(islands)
        if not placement.done and on_loop_thread(self.cluster.loop):
            raise WorkerLost(
                f"the group of islands {group_name(islands)} is not serving now (it forms again once its hosts are "
                "back). Programs over one island keep running"
            )
        return self._members(placement.wait(tuning.GROUP_FORM_TIMEOUT_S.value + 60), device_ids)

    def _placed(self, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        """Where a new array over exactly ``device_ids`` is made: on the group of their islands if it serves
        (programs over them run there), else on the islands' own workers (never waits: a program that needs the
        array in the group moves it there)."""
        devices = {d: self._device(d) for d in device_ids}
        islands = {device.island for device in devices.values()}
        group = self.cluster.serving(islands) if len(islands) > 1 else None
        return devices if group is None else self._members(group, device_ids)

    def _placement_of(self, value) -> dict[int, pb.Device]:
        """Where ``value``'s shards are: its group's members' devices if it lives on a group, else its islands'."""
        parts = value.parts if isinstance(value, PartedArray) else [value]
        group = next((part.link.group for part in parts if part.link.group), "")
        placement = self.cluster.last_placement(group) if group else None
        if placement is None:
            return {d: self._device(d) for d in value.sharding.device_ids}
        return self._members(placement, value.sharding.device_ids)

    def _members(self, group, device_ids: Sequence[int]) -> dict[int, pb.Device]:
        where = {d: group.devices[d] for d in device_ids}
        for device_id, member in where.items():  # its events name its devices in the member's ids
            self._global_ids[(member.worker_id, member.local_id)] = device_id
        return where

    def ready(self, device_ids: Sequence[int]) -> Pending | None:
        """What a program over ``device_ids`` must wait for before it is compiled or run (the group of their
        islands forming), or None; it fails with DATA_LOSS naming a host that keeps the group from serving."""
        islands = {self._device(d).island for d in device_ids}
        if len(islands) <= 1:
            return None
        placement = self.cluster.group(islands)
        return None if placement.done and placement.error is None else placement

    def _worker_ids(self, sharding: IfrtSharding) -> list[str]:
        return sorted({device.worker_id for device in self._placed(sharding.device_ids).values()})

    @staticmethod
    def _local(sharding: IfrtSharding, where: dict[int, pb.Device]) -> IfrtSharding:
        """The sharding in its workers' local device ids (``where``: as ``_where`` placed its devices)."""
        return IfrtSharding(
            tuple(where[d].local_id for d in sharding.device_ids), sharding.memory_kind, sharding.op_sharding
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
        where = self._placed(sharding.device_ids)
        shape = tuple(host.shape)
        if len({device.worker_id for device in where.values()}) > 1:
            parts = [
                self._put_on(where[device_id], host[index], IfrtSharding((device_id,), sharding.memory_kind))
                for device_id, index in zip(sharding.device_ids, sharding.shard_indices(shape), strict=True)
            ]
            return self.assemble(shape, sharding, parts)
        return self._put_on(where[sharding.device_ids[0]], host, sharding, where)

    def _put_on(self, device: pb.Device, host: np.ndarray, sharding: IfrtSharding, where=None) -> RemoteArray:
        """``host`` as an array of ``device``'s worker, laid out by ``sharding`` (one device's, unless ``where``)."""
        link = self._link(device)
        array_id = link.new_id()
        kind, shape = dtypes.from_numpy(host.dtype), tuple(host.shape)
        meta = array_meta(kind, shape, self._local(sharding, where or {sharding.device_ids[0]: device}))
        link.put(array_id, meta, memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8)))
        return RemoteArray(link, array_id, kind, shape, sharding)

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        where = self._placed(sharding.device_ids)
        singles = [
            self._put_on(where[device_id], shard, IfrtSharding((device_id,), sharding.memory_kind))
            for shard, device_id in zip(shards, sharding.device_ids, strict=True)
        ]
        return self.assemble(shape, sharding, singles)

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence):
        check_assemble_parts(sharding, [single.sharding.device_ids for single in singles])
        return self._assemble_where(shape, sharding, singles, self._placed(sharding.device_ids))

    def _assemble_where(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence, where):
        """One array of ``singles`` (one per device of ``sharding``), its shards where ``where`` says."""
        # A shard that lives elsewhere (of an island's worker, for an array over a group, or the other way) moves.
        singles = [self._moved(single, where[single.sharding.device_ids[0]]) for single in singles]
        by_link: dict[int, list] = {}
        for single in singles:
            by_link.setdefault(id(single.link), []).append(single)
        if len(by_link) == 1:
            return self._assemble_on(singles[0].link, shape, sharding, singles, where)
        if len({single.link.island for single in singles}) > 1:
            return ShardedRemoteArray(singles, shape, sharding)
        # The hosts of one island (or group): each assembles its part of one array over all of them.
        hosts = sorted(by_link.values(), key=lambda group: group[0].link.host_index)
        parts = [self._assemble_on(group[0].link, shape, sharding, group, where) for group in hosts]
        return MultiHostArray(parts, shape, sharding)

    def _moved(self, single: RemoteArray, device: pb.Device) -> RemoteArray:
        """``single`` (one device's array) on ``device``'s worker: itself, or a copy sent there."""
        if single.link.worker_id == device.worker_id:
            return single
        return self._send(
            single, self._link(device), single.shape, single.sharding, None, {single.sharding.device_ids[0]: device}
        )

    def _assemble_on(self, link: WorkerLink, shape, sharding: IfrtSharding, singles: Sequence, where) -> RemoteArray:
        array_id = link.new_id()
        meta = array_meta(singles[0].kind, shape, self._local(sharding, where))
        link.send(pb.Command(assemble=pb.Assemble(id=array_id, meta=meta, parts=[s.array_id for s in singles])))
        return RemoteArray(link, array_id, singles[0].kind, shape, sharding)

    def disassemble(self, value, sharding: IfrtSharding) -> list:
        if isinstance(value, ShardedRemoteArray):
            return list(value.parts)
        if isinstance(value, RemoteArray) and len(sharding.device_ids) == 1:
            # Its one shard is the array itself (as a local jax array's one shard shares its buffer):
            # no command to the worker, which reading a result back (fully_replicated_shard) would wait for.
            return [value]
        parts = value.parts if isinstance(value, MultiHostArray) else [value]
        where = self._placement_of(value)
        singles = {}
        for part in parts:
            # Each host splits its own part: the shards of its devices, in the sharding's order.
            device_ids = [d for d in sharding.device_ids if where[d].worker_id == part.link.worker_id]
            for device_id, single in zip(
                device_ids, self._disassemble_on(part, sharding, device_ids, where), strict=True
            ):
                singles[device_id] = single
        return [singles[device_id] for device_id in sharding.device_ids]

    def _disassemble_on(
        self, part: RemoteArray, sharding: IfrtSharding, device_ids: list[int], where
    ) -> list[RemoteArray]:
        shard_shape = sharding.shard_shape(part.shape)
        ids = [part.link.new_id() for _ in device_ids]
        local = array_meta(0, (), self._local(sharding, where)).sharding
        part.link.send(pb.Command(disassemble=pb.Disassemble(source=part.array_id, ids=ids, sharding=local)))
        return [
            RemoteArray(part.link, array_id, part.kind, shard_shape, IfrtSharding((device_id,), sharding.memory_kind))
            for array_id, device_id in zip(ids, device_ids, strict=True)
        ]

    def copy(self, value, sharding: IfrtSharding):
        """The value laid out by ``sharding``: on one worker, by sending between workers, or via the proxy."""
        if isinstance(value, MultiHostArray):
            value = ShardedRemoteArray(self.disassemble(value, value.sharding), value.shape, value.sharding)
        where = self._placed(sharding.device_ids)
        targets = sorted({device.worker_id for device in where.values()})
        if isinstance(value, RemoteArray) and targets == [value.link.worker_id] and value.link.alive:
            array_id = value.link.new_id()
            local = array_meta(0, (), self._local(sharding, where)).sharding
            value.link.send(pb.Command(copy=pb.Copy(source=value.array_id, id=array_id, sharding=local)))
            return RemoteArray(value.link, array_id, value.kind, value.shape, sharding)
        if isinstance(value, RemoteArray) and len(targets) == 1:
            target = where[sharding.device_ids[0]]
            return self._send(value, self._link(target), value.shape, sharding, None, where)
        return self._copy_by_shards(value, sharding, where)

    def _send(
        self, value: RemoteArray, target: WorkerLink, shape, sharding: IfrtSharding, region, where
    ) -> RemoteArray:
        """Has ``value``'s worker send it (or ``region`` of it) straight to ``target``'s worker."""
        array_id = target.new_id()
        meta = array_meta(value.kind, shape, self._local(sharding, where))
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
        # Asked first: a sender already lost fails the copy here, before the target expects anything.
        sent = value.link.request(pb.Command(send=send), "send")
        target.send(pb.Command(expect=pb.Expect(id=array_id, meta=meta)))
        sent.on_done(lambda _reply, error: _fail_if_not_sent(error, value.link, target, array_id, meta))
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

    def _copy_by_shards(self, value, sharding: IfrtSharding, where):
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
            target = self._link(where[device_id])
            single = IfrtSharding((device_id,), sharding.memory_kind)
            parts.append(self._send(sources[holder], target, part_shape, single, relative, where))
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
        if value.kind == dtypes.STRING_KIND:
            return np.asarray(string_arrays.decode(data, value.shape))
        return np.frombuffer(data, dtypes.to_numpy(value.kind)).reshape(value.shape)

    def to_host_later(self, value, wait_pool: Executor) -> Pending:
        """A small array of one worker is fetched without waiting (its reply delivers it); others on ``wait_pool``."""
        read = Pending()
        numeric = isinstance(value, RemoteArray) and value.kind != dtypes.STRING_KIND
        if not (numeric and value.nbytes <= tuning.READ_AT_ONCE_BYTES.value):
            wait_pool.submit(fulfil, read, lambda: self.to_host(value))
            return read
        dtype = dtypes.to_numpy(value.kind)

        def arrived(chunks: list[bytes], error: BaseException | None) -> None:
            if error is not None:
                failure, links = as_request_error(error), self._island_links(value.link.island)
                wait_pool.submit(lambda: read.fail(explain_failure(failure, links)))  # it may wait for the cause
                return
            data = b"".join(chunks)
            fulfil(read, lambda: np.frombuffer(data, dtype).reshape(value.shape))

        value.link.fetch_in_reply(value.array_id).on_done(arrived)
        return read

    # -- programs --------------------------------------------------------------------------

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> RemoteProgram:
        """Compiles for ``device_ids`` on every host they are on: an island's, or the members of the group of their
        islands (blocks while the group forms: for the compile pool)."""
        where = self._where(device_ids)
        devices = [self._current(where[d]) for d in device_ids]
        # On an island (or group) of several hosts every host runs the program; jaxlib ids span them all.
        hosts = list({d.worker_id: d for d in sorted(devices, key=lambda d: d.host_index)}.values())
        local_ids = tuple(d.local_id for d in devices)
        options = _localize(compile_options, {d.id: d.local_id for d in devices})
        return self.cluster.compile(
            hosts, program, options, device_ids, local_ids, stand_in=lambda: self._stand_in(hosts, local_ids)
        )

    def _stand_in(self, hosts: Sequence[pb.Device], local_ids: Sequence[int]) -> pb.Device | None:
        """A healthy worker that can compile a one-host program in its host's stead (None: none can).

        It has devices of the same platform and kind under the same local ids, so the program's
        compile options (in local ids) compile there to the same program.
        """
        if len(hosts) != 1:
            return None
        host = hosts[0]
        by_worker: dict[str, list[pb.Device]] = {}
        for device in self.allocation.devices:
            if device.worker_id != host.worker_id and (device.platform, device.kind) == (host.platform, host.kind):
                by_worker.setdefault(device.worker_id, []).append(device)
        for devices in by_worker.values():
            current = self._current(devices[0])
            if current.healthy and set(local_ids) <= {d.local_id for d in devices}:
                return current
        return None

    def execute(self, program: RemoteProgram, args: Sequence, keep: frozenset[int] = frozenset()) -> list:
        if len(program.hosts) > 1:
            return self._execute_on_hosts(program, args, keep)
        device = self._current(self._device(program.device_ids[0]))
        link = self._link(device)
        args = list(args)
        for index, arg in enumerate(args):
            if isinstance(arg, RemoteArray) and arg.link is link:
                continue
            if isinstance(arg, RemoteArray) and arg.sharding.device_ids == program.device_ids and arg.link.group:
                args[index] = self._moved(arg, device)  # a shard of an array over a group of islands: to its island
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
        """Runs a program on every host of its island (or group), each on its part of the arguments, in their order.

        An argument of a program over a group of islands that lives on the islands' own workers (it was made
        while the group did not serve) is sent to the group first.
        """
        hosts = [self._current(host) for host in self._hosts_of(program)]
        links = [self._link(host) for host in hosts]
        if hosts[0].group:
            args = [self._into(arg, links) for arg in args]
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

    def _hosts_of(self, program: RemoteProgram) -> Sequence[pb.Device]:
        """Where this session runs ``program``: one device per host, of its own devices (the program may have been
        compiled for another session's, or before this one moved), or the members of a group of islands."""
        if program.hosts[0].group:
            return program.hosts
        return [self._device(host.id) for host in program.hosts]

    def _into(self, value, links: list[WorkerLink]):
        """``value`` as an array of the group whose members ``links`` lead to: as it is, or moved there."""
        if isinstance(value, MultiHostArray) and [part.link for part in value.parts] == links:
            return value
        if not isinstance(value, PartedArray | RemoteArray) or not links[0].group:
            return value
        placement = self.cluster.last_placement(links[0].group)
        if placement is None or any(d not in placement.devices for d in value.sharding.device_ids):
            return value  # (not over the group's devices: the check after says so)
        where = self._members(placement, value.sharding.device_ids)
        singles = value.parts if isinstance(value, ShardedRemoteArray) else self.disassemble(value, value.sharding)
        return self._assemble_where(value.shape, value.sharding, singles, where)

    def _answering(self, program: RemoteProgram) -> pb.Device:
        """The host that answers questions about a compiled program: its first device's worker, or that
        device's twin on the group of the program's islands (blocks while the group forms)."""
        return self._current(self._where(program.device_ids)[program.device_ids[0]])

    def cost_analysis(self, program: RemoteProgram) -> dict[str, float]:
        device = self._answering(program)
        command = pb.Command(program_query=pb.ProgramQuery(program=self.cluster.compiled_on(program, device)))
        return dict(self.cluster.query(device, command, "program_query").costs.values)

    def program_text(self, program: RemoteProgram) -> str:
        device = self._answering(program)
        program_id = self.cluster.compiled_on(program, device)
        command = pb.Command(program_query=pb.ProgramQuery(program=program_id, text=True))
        return self.cluster.query(device, command, "program_query").text

    # -- programs that are not XLA -----------------------------------------------------------

    @property
    def host(self) -> nonxla.HostContext:
        """The proxy's own place, for the parts of non-XLA programs it runs itself."""
        return self.cluster.host

    def profile_resource_manager(self, control: pb.ProfileControl) -> bytes:
        """Starts or stops a trace of the resource manager (blocks); the stop returns it."""
        return self.cluster.profile_resource_manager(control)

    def run_program(self, plan: nonxla.ProgramPlan, request: bytes, args: Sequence, output_context: str = "") -> list:
        """Sends each host of ``plan`` its part on this session's stream to it, waits for all, assembles the results.

        Blocks (on the proxy's wait pool): a host that dies meanwhile fails it with DATA_LOSS naming the host.
        The host halves run on the islands' own workers: an argument that lives on a group of islands is sent
        there first.
        """
        args = [self._off_groups(arg) for arg in args]
        devices = [self._current(self._device(d)) for d in dict.fromkeys((*plan.host_device_ids, *plan.device_ids))]
        workers: dict[str, list[pb.Device]] = {}
        for device in devices:
            workers.setdefault(device.worker_id, []).append(device)
        runs = {worker_id: _HostRun(self._link(host_devices[0])) for worker_id, host_devices in workers.items()}
        for worker_id, host_devices in workers.items():
            run = runs[worker_id]
            run.device_ids = [d.local_id for d in host_devices if d.id in plan.host_device_ids]
            run.args = [pb.ProgramArgument(ids=self._pieces_on(arg, run.link, index)) for index, arg in enumerate(args)]
        values = [self._program_output(spec, runs) for spec in plan.outputs]
        replies = []
        for run in runs.values():
            command = pb.RunProgram(
                kind=plan.kind,
                key=plan.key,
                program=request,
                args=run.args,
                results=run.results,
                result_metas=run.metas,
                device_ids=run.device_ids,
                tenant=self.options.tenant,
                context=output_context,
                session_device_ids=self._colocated_on(run.link.worker_id),
            )
            replies.append((run.link, run.link.request(pb.Command(run_program=command), "run_program")))
        for link, reply in replies:
            try:
                link.result(reply)
            except RequestError as error:
                raise explain_failure(error, self._island_links(link.island)) from None
        return values

    def _colocated_on(self, worker_id: str) -> dict[int, int]:
        """The worker's colocated CPU devices of this session: local id -> the session's id for each."""
        devices = (self._devices[d] for d in self._colocated_device_ids)
        return {device.local_id: device.id for device in devices if device.worker_id == worker_id}

    def _off_groups(self, value):
        """``value`` on its islands' own workers: as it is, or, if it lives on a group of islands, sent there shard
        by shard."""
        parts = value.parts if isinstance(value, PartedArray) else [value]
        if not any(part.link.group for part in parts):
            return value
        singles = self.disassemble(value, value.sharding) if isinstance(value, MultiHostArray) else parts
        moved = [self._moved(single, self._device(single.sharding.device_ids[0])) for single in singles]
        return moved[0] if len(moved) == 1 else ShardedRemoteArray(moved, value.shape, value.sharding)

    def _pieces_on(self, value, link: WorkerLink, index: int) -> list[int]:
        """The ids of ``value``'s pieces held by ``link``'s worker (none: it holds none of it)."""
        parts = value.parts if isinstance(value, PartedArray) else [value]
        pieces = [part.array_id for part in parts if part.link.worker_id == link.worker_id]
        if any(part.link.worker_id == link.worker_id and part.link is not link for part in parts):
            raise WorkerLost(
                f"argument {index} was lost when {link.describe()} restarted; compute or transfer it again"
            )
        return pieces

    def _program_output(self, spec: nonxla.OutputSpec, runs: dict[str, _HostRun]):
        """One output of a non-XLA program, as results of the hosts that hold its devices (as puts lay arrays out)."""
        where = {d: self._device(d) for d in spec.sharding.device_ids}  # (host halves run on the islands' workers)
        devices = list(where.values())
        holders = list(dict.fromkeys(d.worker_id for d in devices))
        missing = [w for w in holders if w not in runs]
        if missing:
            raise InvalidRequest(f"an output of the program lies on devices of {missing}, where it does not run")
        if len(holders) == 1 or len({d.island for d in devices}) == 1:
            local = self._local(spec.sharding, where)
            parts = [runs[w].result(spec.kind, spec.shape, spec.sharding, local) for w in holders]
            if len(parts) == 1:
                return parts[0]
            return MultiHostArray(sorted(parts, key=lambda p: p.link.host_index), spec.shape, spec.sharding)
        singles = []
        shard_shape = spec.sharding.shard_shape(spec.shape)
        for device in devices:
            single = IfrtSharding((device.id,), spec.sharding.memory_kind)
            singles.append(runs[device.worker_id].result(spec.kind, shard_shape, single, self._local(single, where)))
        return ShardedRemoteArray(singles, spec.shape, spec.sharding)

    # -- suspending ------------------------------------------------------------------------

    @property
    def uses_groups(self) -> bool:
        """Whether the session has run on a group of islands (multislice): its arrays may live on the group's
        members, and it resumes on its own devices only."""
        with self._lock:
            return any(link.group for link in self._links.values())

    def on_wanted(self, tell: Callable[[pb.Wanted], None]) -> None:
        """``tell(wanted)`` whenever the resource manager says a waiting request wants this session's devices."""
        self._lease.on_wanted = tell

    def suspend_on_workers(self) -> list[tuple[WorkerLink, Pending]]:
        """Asks each worker that holds the session's arrays to move them to host memory; each pending is done once
        it has (after the work already sent to it)."""
        return self._to_workers(pb.Command(suspend=pb.Suspend()), "suspend")

    def resume_on_workers(self) -> list[tuple[WorkerLink, Pending]]:
        """Asks each worker that holds the session's suspended arrays to put them back on their devices."""
        return self._to_workers(pb.Command(resume=pb.Resume()), "resume")

    def _to_workers(self, command: pb.Command, field: str) -> list[tuple[WorkerLink, Pending]]:
        with self._lock:
            links = [link for link in self._links.values() if link.alive]
        asked = []
        for link in links:
            try:  # a command each: the request id is the link's, and the link sends the object later
                asked.append((link, link.request(_copy(command), field)))
            except RequestError as error:  # its worker is gone, and the arrays with it
                _LOGGER.warning("session %d: %s: %s", self.session_id, link.describe(), error.message)
        return asked

    def give_back_devices(self) -> None:
        """Ends the allocation while the session is suspended (its streams to the workers stay open)."""
        self._lease.release()

    @property
    def physical_device_ids(self) -> tuple[int, ...]:
        """The cluster's devices that serve the session's now (or will, once it resumes)."""
        return tuple(self._physical[d] for d in self._device_ids)

    def allocation_request(self) -> pb.AllocateRequest:
        """What the session asks for to resume, at its priority, for as long as it waits: the devices it had (its
        arrays are there), or others of the same shape where those are taken or drained (not for a session that has
        run across islands: its arrays on the group's members stay there). Its client waits for nothing (it is never
        told): the request waits in the queue as long as it takes (timeout 0), keeping its place there."""
        return allocate_request(
            self.options,
            len(self._device_ids),
            timeout_s=0,
            want_device_ids=self.physical_device_ids,
            want_same_shape=not self.uses_groups,
        )

    def take_devices(self, lease: Lease) -> None:
        """Holds the allocation that gave the session its devices again (``allocation_request``: the same ones, or
        others like them, which ``relocate`` moves the session to)."""
        lease.on_wanted = self._lease.on_wanted
        self._lease = lease
        lease.hold(self.session_id)

    def relocate(self, values: Sequence) -> Move:
        """Moves the suspended session to the devices its new lease granted, if they are others (virtual devices).

        The client's device ids stay; each now means the granted device at the same place (host order, local
        id). Each old worker sends the session's arrays in ``values`` (its suspended host copies) straight to its
        new worker, which puts them on the devices; the proxy's references point there at once (commands that use
        them wait there for them). Programs compile on the new workers at their first use there, in the same local
        ids. Returns the move: each old worker's pending answer, and what ``move_back`` needs; once those are
        answered and the move held (``Move.failure``), ``drop_links`` ends the streams to the old workers
        (``Move.old_links``).
        """
        granted = list(self._lease.granted.devices)
        if sorted(d.id for d in granted) == sorted(self.physical_device_ids):
            return Move({}, [])
        old = [self._devices[d] for d in self._device_ids]
        new = _same_places(old, granted)
        move = Move(dict(self._physical), old)
        moved: list[pb.Device] = []
        for before, after in zip(old, new, strict=True):
            device = pb.Device()
            device.CopyFrom(after)
            device.id = before.id
            if device.HasField("colocated"):
                device.colocated.id = before.colocated.id
            moved.append(device)
            self._physical[before.id] = after.id
        workers = {before.worker_id: after for before, after in zip(old, moved, strict=True)}
        self._take(moved)
        _LOGGER.info(
            "session %d moves to devices %s (its client's %s)", self.session_id, [d.id for d in new], self._device_ids
        )
        with self._lock:
            links = {worker_id: self._links.get(worker_id) for worker_id in workers}
        for worker_id, target_device in workers.items():
            source = links[worker_id]
            if source is None or not source.alive:
                continue  # nothing there, or lost with its worker (reading it says so)
            try:
                target = self._link(target_device)
            except RequestError as error:  # granted before the cluster learnt that its worker had died
                move.unreached.append((source, error.message))
                continue
            move.asked.append((source, self._send_suspended(source, target, values, move)))
        return move

    def _send_suspended(self, source: WorkerLink, target: WorkerLink, values: Sequence, move: Move) -> Pending:
        """Has ``source``'s worker send its suspended arrays among ``values`` to ``target``'s; re-points them."""
        arrays = [a for a in _remote_arrays(values) if a.link is source and not a.is_deleted()]
        relocate = pb.Relocate(peer_address=target.address, peer_session=target.session_key)
        relocate.peer_host_key = target.host_key
        for array in arrays:
            where = {d: self._device(d) for d in array.sharding.device_ids}
            relocate.ids.append(array.array_id)
            relocate.new_ids.append(target.new_id())
            relocate.metas.add().CopyFrom(array_meta(array.kind, array.shape, self._local(array.sharding, where)))
        sent = source.request(pb.Command(relocate=relocate), "relocate")
        move.targets.append((target, list(relocate.new_ids)))
        for array, new_id, meta in zip(arrays, relocate.new_ids, relocate.metas, strict=True):
            target.send(pb.Command(expect=pb.Expect(id=new_id, meta=meta)))
            sent.on_done(
                lambda _reply, error, new_id=new_id, meta=meta: _fail_if_not_sent(error, source, target, new_id, meta)
            )
            move.arrays.append((array, array.link, array.array_id))
            array.link, array.array_id = target, new_id
        return sent

    def move_back(self, move: Move) -> None:
        """Undoes a move that did not hold: the arrays are the old workers' again (their streams, and the host copies
        on them, are still open), the client's device ids mean the old devices, and what reached a new worker that
        is still there is forgotten. The caller gives the granted devices back and asks again."""
        for array, source, array_id in move.arrays:
            array.link, array.array_id = source, array_id
        for target, ids in move.targets:
            if target.alive and ids:
                try:
                    target.send(pb.Command(forget=pb.Forget(ids=ids, delete=True)))
                except RequestError:
                    pass  # lost meanwhile: so are the copies there
        self._physical = move.physical
        self._take(move.devices)

    def drop_links(self, links: Sequence[WorkerLink]) -> None:
        """Ends the streams to workers the session moved away from (their sessions there end, and their copies)."""
        with self._lock:
            for link in links:
                if self._links.get(link.worker_id) is link:
                    del self._links[link.worker_id]
        for link in links:
            link.close()

    def on_drain(self, check: Callable[[], None]) -> None:
        """``check()`` whenever the cluster says hosts are being drained."""
        self._on_drain = check

    def hosts_draining(self) -> None:
        if self._on_drain is not None:
            self._on_drain()

    def draining_hosts(self) -> list[str]:
        """The hosts being drained where the session keeps arrays (it has a stream to their workers)."""
        with self._lock:
            links = list(self._links.values())
        found = []
        for link in links:
            worker = self.cluster.worker(link.worker_id)
            if link.alive and worker is not None and worker.draining:
                found.append(f"island {worker.island} host {worker.host_index}")
        return found

    # -- ending ----------------------------------------------------------------------------

    def release(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._lease.release()


def _fail_if_not_sent(error: BaseException | None, source: WorkerLink, target: WorkerLink, array_id: int, meta) -> None:
    """A send whose worker was lost or could not push: the target's expected array fails instead of waiting forever."""
    if error is None:
        return
    failure = as_request_error(error)
    message = f"an array sent from {source.describe()} did not arrive: {failure.message}"
    try:
        target.send(pb.Command(expect=pb.Expect(id=array_id, meta=meta, error=status_of(failure, message))))
    except RequestError:
        pass  # the target is gone too: its own loss fails the array


def _copy(command: pb.Command) -> pb.Command:
    copied = pb.Command()
    copied.CopyFrom(command)
    return copied


def _remote_arrays(values: Sequence) -> list[RemoteArray]:
    """The remote arrays that hold ``values`` (a parted array's parts; each once)."""
    found: dict[int, RemoteArray] = {}
    for value in values:
        for part in value.parts if isinstance(value, PartedArray) else [value]:
            if isinstance(part, RemoteArray):
                found[id(part)] = part
    return list(found.values())


def _same_places(old: Sequence[pb.Device], granted: Sequence[pb.Device]) -> list[pb.Device]:
    """For each of ``old``, the granted device at its place: the same local id on the host at the same position
    among the hosts (by host index). Raises if the grant is not of the same shape."""

    def hosts(devices: Sequence[pb.Device]) -> list[dict[int, pb.Device]]:
        by_host: dict[tuple[int, int], dict[int, pb.Device]] = {}
        for device in devices:
            by_host.setdefault((device.island, device.host_index), {})[device.local_id] = device
        return [by_host[key] for key in sorted(by_host)]

    before, after = hosts(old), hosts(granted)
    if [sorted(h) for h in before] != [sorted(h) for h in after]:
        raise Unavailable(
            f"the resource manager granted devices {sorted(d.id for d in granted)}, not of the shape of the "
            "session's; it stays suspended"
        )
    place = {id(device): index for index, host in enumerate(before) for device in host.values()}
    return [after[place[id(device)]][device.local_id] for device in old]


def _colocated_device(device: pb.Device) -> pb.Device:
    """The CPU device colocated with ``device``, as a device of its own (on the same worker)."""
    cpu = pb.Device()
    cpu.CopyFrom(device)
    cpu.ClearField("colocated")
    cpu.id, cpu.local_id, cpu.kind = device.colocated.id, device.colocated.local_id, "cpu"
    cpu.memory_kinds[:] = device.colocated.memory_kinds
    cpu.local_hardware_id = device.colocated.local_hardware_id
    return cpu


@dataclass
class Move:
    """A suspended session's move to other devices (``ClusterSession.relocate``), and what undoes it."""

    physical: dict[int, int]  # the client's device ids' devices before
    devices: list[pb.Device]  # the session's devices before
    asked: list[tuple[WorkerLink, Pending]] = field(default_factory=list)  # each old worker's pending answer
    targets: list[tuple[WorkerLink, list[int]]] = field(default_factory=list)  # each new worker, and the ids sent it
    arrays: list[tuple[RemoteArray, WorkerLink, int]] = field(default_factory=list)  # each array's link and id before
    # old workers not asked to send, as their new ones could not be reached, and why
    unreached: list[tuple[WorkerLink, str]] = field(default_factory=list)

    @property
    def old_links(self) -> list[WorkerLink]:
        """The streams to the old workers that hold what moves."""
        return [link for link, _ in self.asked] + [link for link, _ in self.unreached]

    def failure(self) -> str:
        """Why the move did not hold, once every old worker answered: a new worker that died or could not be
        reached, or an old one that could not send (its arrays would be lost); "" if it held."""
        failures = [why for _link, why in self.unreached]
        failures += [
            f"{source.describe()} could not send: {as_request_error(pending.error).message}"
            for source, pending in self.asked
            if pending.error is not None
        ]
        failures += [f"{target.describe()} was lost" for target, _ids in self.targets if not target.alive]
        return "; ".join(failures)


class _HostRun:
    """One host's part of a non-XLA program's execution, as it is being put together."""

    def __init__(self, link: WorkerLink):
        self.link = link
        self.device_ids: list[int] = []
        self.args: list[pb.ProgramArgument] = []
        self.results: list[int] = []
        self.metas: list[pb.ArrayMeta] = []

    def result(self, kind: int, shape, sharding: IfrtSharding, local: IfrtSharding) -> RemoteArray:
        array_id = self.link.new_id()
        self.results.append(array_id)
        self.metas.append(array_meta(kind, shape, local))
        return RemoteArray(self.link, array_id, kind, shape, sharding)


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
