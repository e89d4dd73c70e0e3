"""What a proxy session needs of its cluster, apart from the class that serves it (``ClusterRuntime``).

The session's modules (``cluster_session`` and the concerns it is made of) depend on this small
interface and on the plain records below, never on ``cluster_runtime``; the runtime makes sessions and
passes itself as their ``Cluster``. So the two never import each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from pathways_nb.core import nonxla
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.runtime_api import ProgramInfo
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.rpc import cluster_pb2 as pb


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
    """Where the arrays and programs over a group of islands live: each device's twin on the group's members.

    ``island`` is a number of the proxy's own for the group (negative, never an island's), so that the
    group's members are one island of several hosts to everything that groups links by island.
    """

    name: str
    island: int
    epoch: int
    devices: dict[int, pb.Device]  # the client's device id -> its member device


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteProgram(ProgramInfo):
    """A program of one island; kept to compile it on each of its hosts, and again if a host restarts."""

    hosts: tuple = ()  # one device (pb.Device) per host the program runs on, in host order
    stablehlo: bytes = b""
    compile_options: bytes = b""  # with the worker's local device ids
    local_device_ids: tuple[int, ...] = ()


class Cluster(Protocol):
    """The cluster as a session sees it: its workers, its groups of islands, and the programs compiled on it."""

    key: str
    credentials: ClusterCredentials
    islands: int
    host: nonxla.HostContext

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def worker(self, worker_id: str) -> pb.WorkerState | None: ...

    def down(self, device: pb.Device) -> Exception: ...

    def down_reason(self, worker_id: str, incarnation: int) -> str: ...

    def group(self, islands) -> Pending: ...

    def serving(self, islands) -> GroupPlacement | None: ...

    def last_placement(self, name: str) -> GroupPlacement | None: ...

    def layout_waits(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bool: ...

    def default_layout(self, device: pb.Device, dtype_kind: int, dims: tuple[int, ...], memory_kind: str) -> bytes: ...

    def program_id_on(self, program: RemoteProgram, worker: pb.Device, link=None) -> int: ...

    def compiled_on(self, program: RemoteProgram, worker: pb.Device) -> int: ...

    def query(self, worker: pb.Device, command: pb.Command, field: str) -> pb.Reply: ...

    def compile(
        self,
        hosts: Sequence[pb.Device],
        stablehlo: bytes,
        options: bytes,
        device_ids,
        local_ids,
        stand_in: Callable[[], pb.Device | None] | None = None,
    ) -> RemoteProgram: ...

    def profile_resource_manager(self, control: pb.ProfileControl) -> bytes: ...
