"""One client session's devices in a cluster, as the proxy's handlers see them (``core.runtime_api.DeviceSession``).

Device ids are the cluster's global ids; a worker only ever sees its own local ids. ``ClusterSession``
is a facade over the session's concerns, each in a module of its own:

- ``device_map.DeviceMap``: the session's devices and their names (session, physical, group member,
  worker-local);
- ``placement.Placement``: where work lives (an island's workers, or a group of islands' members);
- ``worker_streams.WorkerStreams``: its command streams to workers;
- ``session_arrays.SessionArrays`` and ``session_programs.SessionPrograms``: what the handlers ask;
- ``relocation``: its move to other devices while suspended (``proxy.suspension`` drives it).

It depends on its cluster only through ``cluster_api.Cluster``. Its state is the proxy's event loop's:
every call is the loop's, but the blocking ones a pool thread makes (``put_blocking``, ``put_shards_blocking``,
``copy_blocking``, ``to_host``, ``compile``, ``cost_analysis``, ``program_text``, ``run_program``, and
``default_layout`` where ``layout_waits``), which hand each step that touches the state to the loop
(``loop_handoff.on_loop``) and wait off it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np

from pathways_nb.core import nonxla
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.events import EventSink
from pathways_nb.core.runtime_api import DeviceDescription, check_sharding, describe_device
from pathways_nb.core.session_options import SessionOptions
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy import relocation
from pathways_nb.proxy.cluster_api import Cluster, RemoteProgram
from pathways_nb.proxy.connection_output import HostLineSink
from pathways_nb.proxy.device_map import DeviceMap
from pathways_nb.proxy.lease import Lease
from pathways_nb.proxy.placement import Placement
from pathways_nb.proxy.relocation import Move
from pathways_nb.proxy.rm_client import allocate_request
from pathways_nb.proxy.session_arrays import SessionArrays
from pathways_nb.proxy.session_programs import SessionPrograms
from pathways_nb.proxy.worker_link import WorkerLink
from pathways_nb.proxy.worker_streams import WorkerStreams
from pathways_nb.rpc import cluster_pb2 as pb


class ClusterSession:
    """One client session's devices in the cluster, and its streams to their workers."""

    proxy_is_host = False

    def __init__(
        self,
        cluster: Cluster,
        session_id: int,
        lease: Lease,
        events: EventSink,
        options: SessionOptions,
        output: HostLineSink | None = None,
    ):
        self.cluster = cluster
        self.options = options
        self.events = events
        self.session_id = session_id
        self.allocation = allocation = lease.granted
        self._lease = lease
        self._platform = allocation.platform or allocation.devices[0].platform
        self._on_drain: Callable[[], None] | None = None
        self.devices = DeviceMap(allocation.devices)
        self.streams = WorkerStreams(cluster, session_id, self.devices, events, output)
        self.placement = Placement(cluster, self.devices)
        self.arrays = SessionArrays(cluster, self.devices, self.streams, self.placement)
        self.programs = SessionPrograms(
            cluster, session_id, options, allocation, self.devices, self.streams, self.placement, self.arrays
        )

    # -- devices ---------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self.devices.device_ids

    @property
    def colocated_device_ids(self) -> tuple[int, ...]:
        return self.devices.colocated_device_ids

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
                ordinal=self.devices.ordinal(device.id),
                island_is_slice=island_is_slice,
                colocation_id=self.devices.colocation_id(device.id),
            )
            for device in map(self.devices.device, device_ids)
        ]

    def check_sharding(self, sharding: IfrtSharding) -> None:
        check_sharding(sharding, lambda device_id: self.devices.device(device_id).memory_kinds)

    def layout_waits(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bool:
        device = self.devices.device(device_id)
        return self.cluster.layout_waits(device, dtypes.from_numpy(dtype), tuple(dims), memory_kind)

    def default_layout(self, dtype: np.dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bytes:
        """Blocks (a pool thread's call) where ``layout_waits``; it reads the device's platform and kind, which no
        move changes, and its worker is asked on the loop (``ClusterRuntime.query``)."""
        device = self.devices.device(device_id)
        return self.cluster.default_layout(device, dtypes.from_numpy(dtype), tuple(dims), memory_kind)

    def ready(self, device_ids: Sequence[int]) -> Pending | None:
        return self.placement.ready(device_ids)

    def worker_down(self, worker: pb.WorkerState) -> None:
        self.streams.worker_down(worker)

    def taken_in(self, worker_id: str) -> Pending | None:
        return self.streams.taken_in(worker_id)

    # -- arrays ----------------------------------------------------------------------------

    def put(self, host: np.ndarray, sharding: IfrtSharding):
        return self.arrays.put(host, sharding)

    def put_blocking(self, host: np.ndarray, sharding: IfrtSharding):
        return self.arrays.put_blocking(host, sharding)

    def put_shards(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        return self.arrays.put_shards(shape, sharding, shards)

    def put_shards_blocking(self, shape: tuple[int, ...], sharding: IfrtSharding, shards: Sequence[np.ndarray]):
        return self.arrays.put_shards_blocking(shape, sharding, shards)

    def assemble(self, shape: tuple[int, ...], sharding: IfrtSharding, singles: Sequence):
        return self.arrays.assemble(shape, sharding, singles)

    def disassemble(self, value, sharding: IfrtSharding) -> list:
        return self.arrays.disassemble(value, sharding)

    def copy(self, value, sharding: IfrtSharding):
        return self.arrays.copy(value, sharding)

    def copy_blocking(self, value, sharding: IfrtSharding):
        return self.arrays.copy_blocking(value, sharding)

    def copy_blocks(self, value, sharding: IfrtSharding) -> bool:
        return self.arrays.copy_blocks(value, sharding)

    def to_host(self, value) -> np.ndarray:
        return self.arrays.to_host(value)

    def to_host_later(self, value, wait_pool: Executor) -> Pending:
        return self.arrays.to_host_later(value, wait_pool)

    # -- programs --------------------------------------------------------------------------

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> RemoteProgram:
        return self.programs.compile(program, compile_options, device_ids)

    def execute(self, program: RemoteProgram, args: Sequence, keep: frozenset[int] = frozenset()) -> list:
        return self.programs.execute(program, args, keep)

    def cost_analysis(self, program: RemoteProgram) -> dict[str, float]:
        return self.programs.cost_analysis(program)

    def program_text(self, program: RemoteProgram) -> str:
        return self.programs.program_text(program)

    @property
    def host(self) -> nonxla.HostContext:
        """The proxy's own place, for the parts of non-XLA programs it runs itself."""
        return self.cluster.host

    def profile_resource_manager(self, control: pb.ProfileControl) -> bytes:
        """Starts or stops a trace of the resource manager (blocks); the stop returns it."""
        return self.cluster.profile_resource_manager(control)

    def run_program(self, plan: nonxla.ProgramPlan, request: bytes, args: Sequence, output_context: str = "") -> list:
        return self.programs.run_program(plan, request, args, output_context)

    # -- suspending ------------------------------------------------------------------------

    @property
    def uses_groups(self) -> bool:
        """Whether the session has run on a group of islands (multislice): its arrays may live on the group's
        members, and it resumes on its own devices only."""
        return self.streams.uses_groups

    def on_wanted(self, tell: Callable[[pb.Wanted], None]) -> None:
        """``tell(wanted)`` whenever the resource manager says a waiting request wants this session's devices."""
        self._lease.on_wanted = tell

    def suspend_on_workers(self) -> list[tuple[WorkerLink, Pending]]:
        """Asks each worker that holds the session's arrays to move them to host memory; each pending is done once
        it has (after the work already sent to it)."""
        return self.streams.to_workers(pb.Command(suspend=pb.Suspend()), "suspend")

    def resume_on_workers(self) -> list[tuple[WorkerLink, Pending]]:
        """Asks each worker that holds the session's suspended arrays to put them back on their devices."""
        return self.streams.to_workers(pb.Command(resume=pb.Resume()), "resume")

    def give_back_devices(self) -> None:
        """Ends the allocation while the session is suspended (its streams to the workers stay open)."""
        self._lease.release()

    @property
    def physical_device_ids(self) -> tuple[int, ...]:
        """The cluster's devices that serve the session's now (or will, once it resumes)."""
        return self.devices.physical_device_ids

    def allocation_request(self) -> pb.AllocateRequest:
        """What the session asks for to resume, at its priority, for as long as it waits: the devices it had (its
        arrays are there), or others of the same shape where those are taken or drained (not for a session that has
        run across islands: its arrays on the group's members stay there). Its client waits for nothing (it is never
        told): the request waits in the queue as long as it takes (timeout 0), keeping its place there."""
        return allocate_request(
            self.options,
            len(self.device_ids),
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
        """Moves the suspended session to the devices its new lease granted, if they are others (``relocation``);
        once the move's answers are in and it held (``Move.failure``), ``drop_links`` ends the old streams."""
        granted = list(self._lease.granted.devices)
        return relocation.relocate(self.session_id, self.devices, self.streams, granted, values)

    def move_back(self, move: Move) -> None:
        """Undoes a move that did not hold (``relocation.move_back``)."""
        relocation.move_back(self.devices, move)

    def drop_links(self, links: Sequence[WorkerLink]) -> None:
        """Ends the streams to workers the session moved away from (their sessions there end, and their copies)."""
        self.streams.drop(links)

    def on_drain(self, check: Callable[[], None]) -> None:
        """``check()`` whenever the cluster says hosts are being drained."""
        self._on_drain = check

    def hosts_draining(self) -> None:
        if self._on_drain is not None:
            self._on_drain()

    def draining_hosts(self) -> list[str]:
        """The hosts being drained where the session keeps arrays (it has a stream to their workers)."""
        return self.streams.draining_hosts()

    # -- ending ----------------------------------------------------------------------------

    def release(self) -> None:
        self.streams.close()
        self._lease.release()
