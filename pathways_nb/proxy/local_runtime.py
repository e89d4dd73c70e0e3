"""The single-process proxy's devices: this process's own (``pathways-nb proxy`` without a cluster).

``worker.runtime.LocalRuntime`` is XLA on this process's devices, as a worker
uses it; here it gets the proxy's interface (``runtime_api.Runtime``): every
session sees every device and has its own event sink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from pathways_nb.core import nonxla, tuning
from pathways_nb.core.dataflow import Pending, fulfil
from pathways_nb.core.events import EventSink
from pathways_nb.core.runtime_api import check_sharding, not_in_session
from pathways_nb.core.storage import StorageRoot, default_root
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.program_kinds import HOST_HALVES
from pathways_nb.worker.runtime import LocalRuntime, Program


class LocalProxyRuntime:
    """A ``LocalRuntime`` served to proxy sessions: one island of one host, all devices shared."""

    def __init__(self, runtime: LocalRuntime, storage: StorageRoot | None = None):
        self.runtime = runtime
        # Where non-XLA programs (profiles, checkpoints) write: this process is the only host.
        self.host = nonxla.HostContext(storage or StorageRoot(default_root()))

    async def open_session(
        self, session_id: int, attributes: dict, events: EventSink, output: Callable | None = None
    ) -> LocalSession:
        """Every session of a single-process server shares all its devices (at once)."""
        return LocalSession(self.runtime, events, self.host, output)

    def serve_on(self, loop) -> None:
        """Nothing runs on the proxy's loop: the devices are this process's own."""

    async def stop_serving(self) -> None:
        """Nothing of the runtime's runs on the proxy's loop."""

    def close(self) -> None:
        """Stops following executions (the devices themselves go with the process)."""
        self.runtime.close()

    async def cluster_state(self) -> pb.ClusterState:
        """This process as a one-island cluster whose sessions all share every device (asked of XLA off the loop)."""
        return await asyncio.to_thread(self._cluster_state)

    def _cluster_state(self) -> pb.ClusterState:
        runtime = self.runtime
        address = f"{socket.gethostname()} (this process)"
        worker = pb.WorkerState(
            worker_id="island0-host0",
            address=address,
            healthy=True,
            hostname=socket.gethostname(),
            device_ids=runtime.device_ids,
            pid=os.getpid(),
            incarnation=1,
        )
        devices = [
            pb.Device(
                id=d.id,
                island=0,
                host_index=0,
                local_id=d.id,
                worker_id=worker.worker_id,
                worker_address=address,
                incarnation=1,
                platform=d.platform,
                kind=d.kind,
                memory_kinds=d.memory_kinds,
                local_hardware_id=d.local_hardware_id,
                healthy=True,
            )
            for d in runtime.describe_devices(runtime.device_ids)
        ]
        return pb.ClusterState(
            workers=[worker],
            devices=devices,
            islands=1,
            hosts_per_island=1,
            devices_per_host=len(devices),
            platform=runtime.platform,
        )


class LocalSession:
    """One session's view of a ``LocalRuntime``: all its devices, its own event sink."""

    proxy_is_host = True

    def __init__(
        self, runtime: LocalRuntime, events: EventSink, host: nonxla.HostContext, output: Callable | None = None
    ):
        self.runtime = runtime
        self.events = events
        self.host = host
        self._output = output  # (island, host_index, lines): what the session's host halves write
        self.platform = runtime.platform
        self.platform_version = runtime.platform_version
        self.device_ids = runtime.device_ids
        self.colocated_device_ids = ()  # colocated Python needs a cluster (an executor per worker host)
        self.describe_devices = runtime.describe_devices
        self.default_layout = runtime.default_layout
        self.put = runtime.put
        self.put_shards = runtime.put_shards
        self.assemble = runtime.assemble
        self.disassemble = runtime.disassemble
        self.copy = runtime.copy
        # This process's jax takes them from any thread: the pool's calls are the same functions.
        self.put_blocking = runtime.put
        self.put_shards_blocking = runtime.put_shards
        self.copy_blocking = runtime.copy
        self.compile = runtime.compile
        self.cost_analysis = runtime.cost_analysis
        self.program_text = runtime.program_text

    def copy_blocks(self, value, sharding: IfrtSharding) -> bool:
        """Never: jax copies between this process's devices asynchronously."""
        return False

    def ready(self, device_ids: Sequence[int]) -> None:
        """Work over any of this process's devices can go at once."""

    def layout_waits(self, dtype, dims: Sequence[int], device_id: int, memory_kind: str = "") -> bool:
        """Never: this process's own client knows its layouts."""
        return False

    def check_sharding(self, sharding: IfrtSharding) -> None:
        """The checks a cluster session makes too (``runtime_api.check_sharding``), with the same words."""
        check_sharding(sharding, self._memory_kinds)

    def _memory_kinds(self, device_id: int) -> tuple[str, ...]:
        if device_id not in self.device_ids:
            raise not_in_session(device_id, self.device_ids)
        return self.runtime.memory_kinds(self.runtime.device(device_id))

    def to_host_later(self, value, wait_pool: Executor) -> Pending:
        """The value on the host: read at once if it is computed and small, else on ``wait_pool`` (it waits)."""
        read = Pending()
        # (A string array is a host value: ready.)
        if value.nbytes <= tuning.READ_AT_ONCE_BYTES.value and value.is_ready():
            fulfil(read, lambda: self.runtime.to_host(value))
        else:
            wait_pool.submit(fulfil, read, lambda: self.runtime.to_host(value))
        return read

    def execute(self, program: Program, args: Sequence, keep: frozenset[int] = frozenset()) -> list:
        return self.runtime.execute(program, args, keep, timed=self.events)

    def run_program(self, plan: nonxla.ProgramPlan, request: bytes, args: Sequence, output_context: str = "") -> list:
        """The host half, here: this process is the only host, its device ids are the session's."""
        results = [nonxla.ResultSpec(spec.kind, spec.shape, spec.sharding) for spec in plan.outputs]
        kind = HOST_HALVES.lookup(plan.kind, plan.key)
        output = self._output and functools.partial(self._output, self.host.island, self.host.host_index)
        context = dataclasses.replace(self.host, output=output, output_context=output_context)
        return kind.run(request, self.runtime, [[value] for value in args], plan.host_device_ids, results, context)

    def release(self) -> None:
        """Nothing to give back: the proxy deletes the session's arrays."""
