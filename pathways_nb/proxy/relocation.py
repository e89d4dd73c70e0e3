"""A suspended proxy session's move to other devices (virtual devices), and its undoing.

The client's device ids stay; each comes to mean the granted device at the same place (host order,
local id). Each old worker sends the session's arrays (its suspended host copies) straight to its new
worker, which puts them on the devices; the proxy's references point there at once (commands that use
them wait there for them). Programs compile on the new workers at their first use there, in the same
local ids. ``proxy.suspension`` drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pathways_nb.core.convert import array_meta
from pathways_nb.core.dataflow import Pending
from pathways_nb.protocol.errors import RequestError, as_request_error
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.placement import local_sharding
from pathways_nb.proxy.remote_arrays import PartedArray, RemoteArray
from pathways_nb.proxy.session_arrays import fail_if_not_sent
from pathways_nb.proxy.worker_link import WorkerLink
from pathways_nb.proxy.worker_streams import WorkerStreams
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


@dataclass
class Move:
    """A suspended session's move to other devices (``relocate``), and what undoes it."""

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


def relocate(
    session_id: int, devices: DeviceMap, streams: WorkerStreams, granted: Sequence[pb.Device], values: Sequence
) -> Move:
    """Moves the session to the ``granted`` devices if they are others; its arrays among ``values`` with it.

    Returns the move: each old worker's pending answer, and what ``move_back`` needs; once those are
    answered and the move held (``Move.failure``), the caller ends the streams to the old workers
    (``Move.old_links``).
    """
    if sorted(d.id for d in granted) == sorted(devices.physical_device_ids):
        return Move({}, [])
    move = Move(dict(devices.physical), devices.current())
    workers = devices.move_to(granted)
    _LOGGER.info(
        "session %d moves to devices %s (its client's %s)", session_id, devices.physical_device_ids, devices.device_ids
    )
    links = {worker_id: streams.get(worker_id) for worker_id in workers}
    for worker_id, target_device in workers.items():
        source = links[worker_id]
        if source is None or not source.alive:
            continue  # nothing there, or lost with its worker (reading it says so)
        try:
            target = streams.link(target_device)
        except RequestError as error:  # granted before the cluster learnt that its worker had died
            move.unreached.append((source, error.message))
            continue
        move.asked.append((source, _send_suspended(devices, source, target, values, move)))
    return move


def _send_suspended(
    devices: DeviceMap, source: WorkerLink, target: WorkerLink, values: Sequence, move: Move
) -> Pending:
    """Has ``source``'s worker send its suspended arrays among ``values`` to ``target``'s; re-points them."""
    arrays = [a for a in _remote_arrays(values) if a.link is source and not a.is_deleted()]
    relocate_command = pb.Relocate(peer_address=target.address, peer_session=target.session_key)
    relocate_command.peer_host_key = target.host_key
    for array in arrays:
        where = devices.devices(array.sharding.device_ids)
        relocate_command.ids.append(array.array_id)
        relocate_command.new_ids.append(target.new_id())
        relocate_command.metas.add().CopyFrom(
            array_meta(array.kind, array.shape, local_sharding(array.sharding, where))
        )
    sent = source.request(pb.Command(relocate=relocate_command), "relocate")
    move.targets.append((target, list(relocate_command.new_ids)))
    for array, new_id, meta in zip(arrays, relocate_command.new_ids, relocate_command.metas, strict=True):
        target.send(pb.Command(expect=pb.Expect(id=new_id, meta=meta)))
        sent.on_done(
            lambda _reply, error, new_id=new_id, meta=meta: fail_if_not_sent(error, source, target, new_id, meta)
        )
        move.arrays.append((array, array.link, array.array_id))
        array.link, array.array_id = target, new_id
    return sent


def move_back(devices: DeviceMap, move: Move) -> None:
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
    devices.restore(move.physical, move.devices)


def _remote_arrays(values: Sequence) -> list[RemoteArray]:
    """The remote arrays that hold ``values`` (a parted array's parts; each once)."""
    found: dict[int, RemoteArray] = {}
    for value in values:
        for part in value.parts if isinstance(value, PartedArray) else [value]:
            if isinstance(part, RemoteArray):
                found[id(part)] = part
    return list(found.values())
