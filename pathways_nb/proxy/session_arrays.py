"""A proxy session's arrays on its workers: made, laid out, split, joined, copied and read back.

Where data moves:

- host <-> device: through the proxy, which is where the client's bytes are;
- device -> device on one worker: a copy on that worker;
- device -> device across workers (islands): the source worker sends straight
  to the destination worker; the proxy only tells both what to do.

Every method is the proxy's event loop's (the streams, ids and placement it changes are the loop's), but
the ``..._blocking`` ones and ``to_host``: a pool thread's calls, which copy or wait off the loop and hand
each step that touches the session's state to the loop (``loop_handoff.on_loop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from pathways_nb.core import string_arrays, tuning
from pathways_nb.core.convert import array_meta, status_of
from pathways_nb.core.dataflow import Pending, fulfil
from pathways_nb.core.runtime_api import check_assemble_parts
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import Internal, RequestError, as_request_error
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.cluster_api import Cluster
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.loop_handoff import on_loop
from pathways_nb.proxy.placement import Placement, local_sharding
from pathways_nb.proxy.remote_arrays import (
    MultiHostArray,
    PartedArray,
    RemoteArray,
    ShardedRemoteArray,
    explain_failure,
)
from pathways_nb.proxy.worker_link import Upload, WorkerLink
from pathways_nb.proxy.worker_streams import WorkerStreams
from pathways_nb.rpc import cluster_pb2 as pb


class SessionArrays:
    """The session's array operations, as commands on its streams to the workers that hold the arrays."""

    def __init__(self, cluster: Cluster, devices: DeviceMap, streams: WorkerStreams, placement: Placement):
        self.cluster = cluster
        self._devices = devices
        self._streams = streams
        self._placement = placement

    def put(self, host: np.ndarray, sharding: IfrtSharding):
        """``host`` on the devices of ``sharding`` (on the loop: for small arrays, as it copies them here)."""
        puts = self._puts(host, sharding)
        return self._put_sent(puts, [piece.upload() for piece in puts.pieces])

    def put_blocking(self, host: np.ndarray, sharding: IfrtSharding):
        """``put``, with the bytes copied on this pool thread (blocks)."""
        puts = on_loop(self.cluster.loop, self._puts, host, sharding)
        uploads = [piece.upload() for piece in puts.pieces]
        return on_loop(self.cluster.loop, self._put_sent, puts, uploads)

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        """One array of ``shards`` (one per device of ``sharding``; on the loop: for small ones)."""
        puts = self._shard_puts(shape, sharding, shards)
        return self._put_sent(puts, [piece.upload() for piece in puts.pieces])

    def put_shards_blocking(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        """``put_shards``, with the bytes copied on this pool thread (blocks)."""
        puts = on_loop(self.cluster.loop, self._shard_puts, shape, sharding, shards)
        uploads = [piece.upload() for piece in puts.pieces]
        return on_loop(self.cluster.loop, self._put_sent, puts, uploads)

    def _puts(self, host: np.ndarray, sharding: IfrtSharding) -> _Puts:
        """Where ``host``'s pieces go: one array of one worker, or one per device assembled (on the loop)."""
        where = self._placement.placed(sharding.device_ids)
        shape = tuple(host.shape)
        if len({device.worker_id for device in where.values()}) > 1:
            pieces = [
                self._piece(where[device_id], host[index], IfrtSharding((device_id,), sharding.memory_kind))
                for device_id, index in zip(sharding.device_ids, sharding.shard_indices(shape), strict=True)
            ]
            return _Puts(pieces, shape, sharding, assembled=True)
        return _Puts([self._piece(where[sharding.device_ids[0]], host, sharding, where)], shape, sharding)

    def _shard_puts(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]) -> _Puts:
        where = self._placement.placed(sharding.device_ids)
        pieces = [
            self._piece(where[device_id], shard, IfrtSharding((device_id,), sharding.memory_kind))
            for shard, device_id in zip(shards, sharding.device_ids, strict=True)
        ]
        return _Puts(pieces, shape, sharding, assembled=True)

    def _piece(self, device: pb.Device, host: np.ndarray, sharding: IfrtSharding, where=None) -> _Piece:
        """``host`` as an array of ``device``'s worker to be, laid out by ``sharding`` (one device's, unless
        ``where``): its stream and id (on the loop)."""
        link = self._streams.link(device)
        kind = dtypes.from_numpy(host.dtype)
        meta = array_meta(kind, tuple(host.shape), local_sharding(sharding, where or {sharding.device_ids[0]: device}))
        return _Piece(link, link.new_id(), kind, meta, host, sharding)

    def _put_sent(self, puts: _Puts, uploads: Sequence[Upload]):
        """Sends the pieces' uploads; the array they make (on the loop)."""
        singles = []
        for piece, upload in zip(puts.pieces, uploads, strict=True):
            piece.link.put(upload)
            singles.append(RemoteArray(piece.link, piece.array_id, piece.kind, tuple(piece.host.shape), piece.sharding))
        return self.assemble(puts.shape, puts.sharding, singles) if puts.assembled else singles[0]

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence):
        check_assemble_parts(sharding, [single.sharding.device_ids for single in singles])
        return self.assemble_where(shape, sharding, singles, self._placement.placed(sharding.device_ids))

    def assemble_where(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence, where):
        """One array of ``singles`` (one per device of ``sharding``), its shards where ``where`` says."""
        # A shard that lives elsewhere (of an island's worker, for an array over a group, or the other way) moves.
        singles = [self.moved(single, where[single.sharding.device_ids[0]]) for single in singles]
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

    def moved(self, single: RemoteArray, device: pb.Device) -> RemoteArray:
        """``single`` (one device's array) on ``device``'s worker: itself, or a copy sent there."""
        if single.link.worker_id == device.worker_id:
            return single
        target = self._streams.link(device)
        return self._send(single, target, single.shape, single.sharding, None, {single.sharding.device_ids[0]: device})

    def _assemble_on(self, link: WorkerLink, shape, sharding: IfrtSharding, singles: Sequence, where) -> RemoteArray:
        array_id = link.new_id()
        meta = array_meta(singles[0].kind, shape, local_sharding(sharding, where))
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
        where = self._placement.of(value)
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
        local = array_meta(0, (), local_sharding(sharding, where)).sharding
        part.link.send(pb.Command(disassemble=pb.Disassemble(source=part.array_id, ids=ids, sharding=local)))
        return [
            RemoteArray(part.link, array_id, part.kind, shard_shape, IfrtSharding((device_id,), sharding.memory_kind))
            for array_id, device_id in zip(ids, device_ids, strict=True)
        ]

    def copy_blocking(self, value, sharding: IfrtSharding):
        """The value laid out by ``sharding`` through the proxy, where no source shard holds some target shard
        (``copy_blocks``): read, then put again (blocks)."""
        return self.put_blocking(self.to_host(value), sharding)

    def copy(self, value, sharding: IfrtSharding):
        """The value laid out by ``sharding``, on one worker or by sending between workers (on the loop; a copy
        that goes through the proxy is ``copy_blocking``)."""
        if isinstance(value, MultiHostArray):
            value = ShardedRemoteArray(self.disassemble(value, value.sharding), value.shape, value.sharding)
        where = self._placement.placed(sharding.device_ids)
        targets = sorted({device.worker_id for device in where.values()})
        if isinstance(value, RemoteArray) and targets == [value.link.worker_id] and value.link.alive:
            array_id = value.link.new_id()
            local = array_meta(0, (), local_sharding(sharding, where)).sharding
            value.link.send(pb.Command(copy=pb.Copy(source=value.array_id, id=array_id, sharding=local)))
            return RemoteArray(value.link, array_id, value.kind, value.shape, sharding)
        if isinstance(value, RemoteArray) and len(targets) == 1:
            target = where[sharding.device_ids[0]]
            return self._send(value, self._streams.link(target), value.shape, sharding, None, where)
        return self._copy_by_shards(value, sharding, where)

    def _send(
        self, value: RemoteArray, target: WorkerLink, shape, sharding: IfrtSharding, region, where
    ) -> RemoteArray:
        """Has ``value``'s worker send it (or ``region`` of it) straight to ``target``'s worker."""
        array_id = target.new_id()
        meta = array_meta(value.kind, shape, local_sharding(sharding, where))
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
        sent.on_done(lambda _reply, error: fail_if_not_sent(error, value.link, target, array_id, meta))
        return RemoteArray(target, array_id, value.kind, shape, sharding)

    def copy_blocks(self, value, sharding: IfrtSharding) -> bool:
        """Whether the copy goes through the proxy (no source shard holds some target shard): it reads the value."""
        if isinstance(value, RemoteArray) and len(self._placement.worker_ids(sharding)) == 1:
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
            if holder is None:  # (``copy_blocks`` says so beforehand: such a copy is ``copy_blocking``)
                raise Internal(f"target shard {device_id} is held by no source shard: the copy reads the value")
            relative = tuple(
                slice(w.start - r.start, w.stop - r.start) for w, r in zip(wanted, source_regions[holder], strict=True)
            )
            part_shape = tuple(s.stop - s.start for s in wanted)
            target = self._streams.link(where[device_id])
            single = IfrtSharding((device_id,), sharding.memory_kind)
            parts.append(self._send(sources[holder], target, part_shape, single, relative, where))
        return self.assemble(shape, sharding, parts)

    def to_host(self, value) -> np.ndarray:
        """The value's bytes, read from its workers (blocks: a pool thread's call)."""
        if isinstance(value, MultiHostArray):
            singles = on_loop(self.cluster.loop, self.disassemble, value, value.sharding)
            value = ShardedRemoteArray(singles, value.shape, value.sharding)
        if isinstance(value, ShardedRemoteArray):
            dtype = dtypes.to_numpy(value.parts[0].kind)
            host = np.empty(value.shape, dtype)
            for part, index in zip(value.parts, value.sharding.shard_indices(value.shape), strict=True):
                host[index] = self.to_host(part)
            return host
        try:
            data = value.link.fetch(value.array_id)
        except RequestError as error:
            links = on_loop(self.cluster.loop, self._streams.island_links, value.link.island)
            raise explain_failure(error, links) from None
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
                failure, links = as_request_error(error), self._streams.island_links(value.link.island)
                wait_pool.submit(lambda: read.fail(explain_failure(failure, links)))  # it may wait for the cause
                return
            data = b"".join(chunks)
            fulfil(read, lambda: np.frombuffer(data, dtype).reshape(value.shape))

        value.link.fetch_in_reply(value.array_id).on_done(arrived)
        return read

    # -- arrays of groups of islands ---------------------------------------------------------

    def into(self, value, links: list[WorkerLink]):
        """``value`` as an array of the group whose members ``links`` lead to: as it is, or moved there."""
        if isinstance(value, MultiHostArray) and [part.link for part in value.parts] == links:
            return value
        if not isinstance(value, PartedArray | RemoteArray) or not links[0].group:
            return value
        placement = self.cluster.last_placement(links[0].group)
        if placement is None or any(d not in placement.devices for d in value.sharding.device_ids):
            return value  # (not over the group's devices: the check after says so)
        where = self._placement.members(placement, value.sharding.device_ids)
        singles = value.parts if isinstance(value, ShardedRemoteArray) else self.disassemble(value, value.sharding)
        return self.assemble_where(value.shape, value.sharding, singles, where)

    def off_groups(self, value):
        """``value`` on its islands' own workers: as it is, or, if it lives on a group of islands, sent there shard
        by shard."""
        parts = value.parts if isinstance(value, PartedArray) else [value]
        if not any(part.link.group for part in parts):
            return value
        singles = self.disassemble(value, value.sharding) if isinstance(value, MultiHostArray) else parts
        moved = [self.moved(single, self._devices.device(single.sharding.device_ids[0])) for single in singles]
        return moved[0] if len(moved) == 1 else ShardedRemoteArray(moved, value.shape, value.sharding)


def fail_if_not_sent(error: BaseException | None, source: WorkerLink, target: WorkerLink, array_id: int, meta) -> None:
    """A send whose worker was lost or could not push: the target's expected array fails instead of waiting forever."""
    if error is None:
        return
    failure = as_request_error(error)
    message = f"an array sent from {source.describe()} did not arrive: {failure.message}"
    try:
        target.send(pb.Command(expect=pb.Expect(id=array_id, meta=meta, error=status_of(failure, message))))
    except RequestError:
        pass  # the target is gone too: its own loss fails the array


def _source_regions(value) -> list[tuple[slice, ...]]:
    """The region of the global array each part of ``value`` holds (a single array: all of it)."""
    if isinstance(value, PartedArray):
        return [_region(index, value.shape) for index in value.sharding.shard_indices(value.shape)]
    return [tuple(slice(0, d) for d in value.shape)]


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def _contains(outer: tuple[slice, ...], inner: tuple[slice, ...]) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner, strict=True))


@dataclass
class _Piece:
    """One array of one worker that a put makes: where, under which id, and its bytes (``_put_sent`` sends them)."""

    link: WorkerLink
    array_id: int
    kind: int
    meta: pb.ArrayMeta
    host: np.ndarray
    sharding: IfrtSharding

    def upload(self) -> Upload:
        """The piece's bytes as commands (any thread: they are copied)."""
        data = memoryview(np.ascontiguousarray(self.host).reshape(-1).view(np.uint8))
        return self.link.upload(self.array_id, self.meta, data)


@dataclass
class _Puts:
    """A put's pieces, and whether they are assembled into one array (else there is one)."""

    pieces: list[_Piece]
    shape: tuple[int, ...]
    sharding: IfrtSharding
    assembled: bool = False
