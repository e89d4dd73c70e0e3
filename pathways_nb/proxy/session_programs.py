"""A proxy session's programs on its workers: compiled where their devices are, run there, asked about.

XLA programs run on one island's workers, or on the members of the group of their islands; non-XLA
programs (``core.nonxla``) run their host halves on the islands' own workers.

``execute`` is the proxy's event loop's (it only queues commands); ``compile``, ``cost_analysis``,
``program_text`` and ``run_program`` are pool threads' blocking calls, which wait off the loop and hand each
step that touches the session's state to the loop (``loop_handoff.on_loop``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pathways_nb.core import nonxla
from pathways_nb.core.convert import array_meta
from pathways_nb.core.session_options import SessionOptions
from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import InvalidRequest, RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.cluster_api import Cluster, RemoteProgram
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
from pathways_nb.proxy.session_arrays import SessionArrays
from pathways_nb.proxy.worker_link import WorkerLink, WorkerLost
from pathways_nb.proxy.worker_streams import WorkerStreams
from pathways_nb.rpc import cluster_pb2 as pb


class SessionPrograms:
    """Compiling, running and querying the session's programs, as commands on its streams."""

    def __init__(
        self,
        cluster: Cluster,
        session_id: int,
        options: SessionOptions,
        allocation: pb.Allocation,
        devices: DeviceMap,
        streams: WorkerStreams,
        placement: Placement,
        arrays: SessionArrays,
    ):
        self.cluster = cluster
        self.session_id = session_id
        self.options = options
        self.allocation = allocation
        self._devices = devices
        self._streams = streams
        self._placement = placement
        self._arrays = arrays
        self._gangs = itertools.count(1)

    def compile(self, program: bytes, compile_options: bytes, device_ids: Sequence[int]) -> RemoteProgram:
        """Compiles for ``device_ids`` on every host they are on: an island's, or the members of the group of their
        islands (blocks, while the group forms and the hosts compile: for the compile pool)."""
        where = self._placement.where_waiting(device_ids)
        devices = on_loop(self.cluster.loop, lambda: [self._streams.current(where[d]) for d in device_ids])
        # On an island (or group) of several hosts every host runs the program; jaxlib ids span them all.
        hosts = list({d.worker_id: d for d in sorted(devices, key=lambda d: d.host_index)}.values())
        local_ids = tuple(d.local_id for d in devices)
        options = _localize(compile_options, {d.id: d.local_id for d in devices})
        return self.cluster.compile(
            hosts, program, options, device_ids, local_ids, stand_in=lambda: self._stand_in(hosts, local_ids)
        )

    def _stand_in(self, hosts: Sequence[pb.Device], local_ids: Sequence[int]) -> pb.Device | None:
        """A healthy worker that can compile a one-host program in its host's stead (None: none can; on the loop).

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
        for on_worker in by_worker.values():
            current = self._streams.current(on_worker[0])
            if current.healthy and set(local_ids) <= {d.local_id for d in on_worker}:
                return current
        return None

    def execute(self, program: RemoteProgram, args: Sequence, keep: frozenset[int] = frozenset()) -> list:
        """Queues the program's run on its host(s) (on the loop: nothing waits); its results, to be."""
        if len(program.hosts) > 1:
            return self._execute_on_hosts(program, args, keep)
        device = self._streams.current(self._devices.device(program.device_ids[0]))
        link = self._streams.link(device)
        args = list(args)
        for index, arg in enumerate(args):
            if isinstance(arg, RemoteArray) and arg.link is link:
                continue
            if isinstance(arg, RemoteArray) and arg.sharding.device_ids == program.device_ids and arg.link.group:
                args[index] = self._arrays.moved(arg, device)  # a shard of an array over a group: to its island
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
        execute = pb.Execute(
            program=program_id,
            args=[a.array_id for a in args],
            results=[r.array_id for r in results],
            keep=sorted(keep),
            tenant=self.options.tenant,
            weight=self.options.weight,
        )
        link.send(pb.Command(execute=execute))
        return results

    def _execute_on_hosts(self, program: RemoteProgram, args: Sequence, keep: frozenset[int]) -> list:
        """Runs a program on every host of its island (or group), each on its part of the arguments, in their order.

        An argument of a program over a group of islands that lives on the islands' own workers (it was made
        while the group did not serve) is sent to the group first.
        """
        hosts = [self._streams.current(host) for host in self._hosts_of(program)]
        links = [self._streams.link(host) for host in hosts]
        if hosts[0].group:
            args = [self._arrays.into(arg, links) for arg in args]
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
        return [self._devices.device(host.id) for host in program.hosts]

    def _answering(self, program: RemoteProgram) -> pb.Device:
        """The host that answers questions about a compiled program: its first device's worker, or that
        device's twin on the group of the program's islands (blocks while the group forms)."""
        first = self._placement.where_waiting(program.device_ids)[program.device_ids[0]]
        return on_loop(self.cluster.loop, self._streams.current, first)

    def cost_analysis(self, program: RemoteProgram) -> dict[str, float]:
        """XLA's cost analysis of the program, from the host that answers for it (blocks)."""
        device = self._answering(program)
        command = pb.Command(program_query=pb.ProgramQuery(program=self.cluster.compiled_on(program, device)))
        return dict(self.cluster.query(device, command, "program_query").costs.values)

    def program_text(self, program: RemoteProgram) -> str:
        """The compiled program's text, from the host that answers for it (blocks)."""
        device = self._answering(program)
        program_id = self.cluster.compiled_on(program, device)
        command = pb.Command(program_query=pb.ProgramQuery(program=program_id, text=True))
        return self.cluster.query(device, command, "program_query").text

    # -- programs that are not XLA -----------------------------------------------------------

    def run_program(self, plan: nonxla.ProgramPlan, request: bytes, args: Sequence, output_context: str = "") -> list:
        """Sends each host of ``plan`` its part on this session's stream to it, waits for all, assembles the results.

        Blocks (on the proxy's wait pool): a host that dies meanwhile fails it with DATA_LOSS naming the host.
        The host halves run on the islands' own workers: an argument that lives on a group of islands is sent
        there first.
        """
        loop = self.cluster.loop
        values, replies = on_loop(loop, self._send_run_program, plan, request, args, output_context)
        for link, reply in replies:
            try:
                reply.wait()
            except RequestError as error:
                raise explain_failure(error, on_loop(loop, self._streams.island_links, link.island)) from None
        return values

    def _send_run_program(
        self, plan: nonxla.ProgramPlan, request: bytes, args: Sequence, output_context: str
    ) -> tuple[list, list]:
        """Sends each host of ``plan`` its part (on the loop); the results to be, and each host's pending answer."""
        args = [self._arrays.off_groups(arg) for arg in args]
        plan_ids = dict.fromkeys((*plan.host_device_ids, *plan.device_ids))
        devices = [self._streams.current(self._devices.device(d)) for d in plan_ids]
        workers: dict[str, list[pb.Device]] = {}
        for device in devices:
            workers.setdefault(device.worker_id, []).append(device)
        runs = {worker_id: _HostRun(self._streams.link(on_worker[0])) for worker_id, on_worker in workers.items()}
        for worker_id, on_worker in workers.items():
            run = runs[worker_id]
            run.device_ids = [d.local_id for d in on_worker if d.id in plan.host_device_ids]
            run.args = [pb.ProgramArgument(ids=_pieces_on(arg, run.link, index)) for index, arg in enumerate(args)]
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
                session_device_ids=self._devices.colocated_on(run.link.worker_id),
            )
            replies.append((run.link, run.link.request(pb.Command(run_program=command), "run_program")))
        return values, replies

    def _program_output(self, spec: nonxla.OutputSpec, runs: dict[str, _HostRun]):
        """One output of a non-XLA program, as results of the hosts that hold its devices (as puts lay arrays out)."""
        where = self._devices.devices(spec.sharding.device_ids)  # (host halves run on the islands' workers)
        devices = list(where.values())
        holders = list(dict.fromkeys(d.worker_id for d in devices))
        missing = [w for w in holders if w not in runs]
        if missing:
            raise InvalidRequest(f"an output of the program lies on devices of {missing}, where it does not run")
        if len(holders) == 1 or len({d.island for d in devices}) == 1:
            local = local_sharding(spec.sharding, where)
            parts = [runs[w].result(spec.kind, spec.shape, spec.sharding, local) for w in holders]
            if len(parts) == 1:
                return parts[0]
            return MultiHostArray(sorted(parts, key=lambda p: p.link.host_index), spec.shape, spec.sharding)
        singles = []
        shard_shape = spec.sharding.shard_shape(spec.shape)
        for device in devices:
            single = IfrtSharding((device.id,), spec.sharding.memory_kind)
            singles.append(runs[device.worker_id].result(spec.kind, shard_shape, single, local_sharding(single, where)))
        return ShardedRemoteArray(singles, spec.shape, spec.sharding)


def _pieces_on(value, link: WorkerLink, index: int) -> list[int]:
    """The ids of ``value``'s pieces held by ``link``'s worker (none: it holds none of it)."""
    parts = value.parts if isinstance(value, PartedArray) else [value]
    pieces = [part.array_id for part in parts if part.link.worker_id == link.worker_id]
    if any(part.link.worker_id == link.worker_id and part.link is not link for part in parts):
        raise WorkerLost(f"argument {index} was lost when {link.describe()} restarted; compute or transfer it again")
    return pieces


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


def _localize(compile_options: bytes, local_ids: dict[int, int]) -> bytes:
    """The compile options with the device assignment in the worker's local ids."""
    options = schema.load().xla.CompileOptionsProto.FromString(compile_options)
    assignment = options.executable_build_options.device_assignment
    for computation in assignment.computation_devices:
        computation.replica_device_ids[:] = [local_ids[i] for i in computation.replica_device_ids]
    return options.SerializeToString()
