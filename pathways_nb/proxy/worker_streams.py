"""A proxy session's command streams to its workers: one ``WorkerLink`` per worker, opened (again) when needed.

Owned by the proxy's event loop, like the links themselves: every method is the loop's (pool threads hand
their steps to it with ``loop_handoff.on_loop``), so no lock guards the table of streams.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pathways_nb.core import tuning
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.events import EventSink
from pathways_nb.protocol.errors import RequestError
from pathways_nb.proxy.cluster_api import Cluster
from pathways_nb.proxy.connection_output import HostLineSink
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.worker_link import WorkerLink
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


class WorkerStreams:
    """The session's streams to workers, by worker id; what workers send back, in the session's device ids."""

    def __init__(
        self,
        cluster: Cluster,
        session_id: int,
        devices: DeviceMap,
        events: EventSink,
        output: HostLineSink | None = None,
    ):
        self.cluster = cluster
        self.session_id = session_id
        self.events = events
        self.output = output  # what the session's code beside the devices writes (None: nowhere)
        self._devices = devices
        self._links: dict[str, WorkerLink] = {}

    def current(self, device: pb.Device) -> pb.Device:
        """The device's worker as the cluster knows it now (it may have restarted since the allocation)."""
        return self.cluster.current(device)

    def link(self, device: pb.Device) -> WorkerLink:
        """This session's stream to the device's worker, opened (again) when needed.

        A stream that broke to the worker's current process keeps failing new work with its
        error, until the cluster says that process is gone (then the next one gets a new stream),
        or, if the cluster still finds it healthy ``tuning.RELINK_AFTER_S`` later, the break was the
        stream's alone, and a new one is opened: the arrays of the old one are lost either way.
        """
        device = self.current(device)
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

    def get(self, worker_id: str) -> WorkerLink | None:
        """The stream to the worker, as it is (None: none was opened)."""
        return self._links.get(worker_id)

    def island_links(self, island: int) -> list[WorkerLink]:
        """This session's links to the hosts of ``island``."""
        return [link for link in self._links.values() if link.island == island]

    def alive(self) -> list[WorkerLink]:
        return [link for link in self._links.values() if link.alive]

    def _worker_events(self, link: WorkerLink, events: list[pb.Event]) -> None:
        """Events a worker reported, in the session's device ids."""
        for recorded in events:
            global_ids = [self._devices.session_id_of(link.worker_id, d) for d in recorded.device_ids]
            recorded.device_ids[:] = [d for d in global_ids if d >= 0]
            self.events(recorded)

    def _worker_output(self, link: WorkerLink, lines: list[pb.OutputLine]) -> None:
        """Output a worker sent for this session: where it was written is that worker's island and host."""
        if self.output is not None:
            self.output(link.island, link.host_index, lines)

    def taken_in(self, worker_id: str) -> Pending | None:
        """Done once the worker has read every command this session sent it so far (None: no open stream)."""
        link = self.get(worker_id)
        if link is None or not link.alive:
            return None
        try:
            return link.request(pb.Command(wait=pb.Wait()), "wait")
        except RequestError:
            return None

    def worker_down(self, worker: pb.WorkerState) -> None:
        """The resource manager declared a worker dead: fail this session's stream to it now."""
        link = self.get(worker.worker_id)
        if link is not None and link.alive and link.incarnation == worker.incarnation:
            link.declare_lost(worker.down_reason or "the resource manager lost it")

    def to_workers(self, command: pb.Command, field: str) -> list[tuple[WorkerLink, Pending]]:
        """Asks every worker with an open stream ``command`` (a copy each); each one's pending answer."""
        asked = []
        for link in self.alive():
            try:  # a command each: the request id is the link's, and the link sends the object later
                asked.append((link, link.request(_copy(command), field)))
            except RequestError as error:  # its worker is gone, and the arrays with it
                _LOGGER.warning("session %d: %s: %s", self.session_id, link.describe(), error.message)
        return asked

    @property
    def uses_groups(self) -> bool:
        """Whether a stream leads to a member of a group of islands."""
        return any(link.group for link in self._links.values())

    def draining_hosts(self) -> list[str]:
        """The hosts being drained where the session keeps arrays (it has a stream to their workers)."""
        found = []
        for link in self._links.values():
            worker = self.cluster.worker(link.worker_id)
            if link.alive and worker is not None and worker.draining:
                found.append(f"island {worker.island} host {worker.host_index}")
        return found

    def drop(self, links: Sequence[WorkerLink]) -> None:
        """Ends the streams to workers the session moved away from (their sessions there end, and their copies)."""
        for link in links:
            if self._links.get(link.worker_id) is link:
                del self._links[link.worker_id]
        for link in links:
            link.close()

    def close(self) -> None:
        """Ends every stream (the workers drop the session's arrays)."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


def _copy(command: pb.Command) -> pb.Command:
    copied = pb.Command()
    copied.CopyFrom(command)
    return copied
