"""The proxy's observe service: the cluster as notebooks show it (devices, health, allocations, queue), and
what a client's own code beside the devices wrote (``proxy.connection_output``)."""

from __future__ import annotations

import asyncio
import hmac

import grpc

from pathways_nb._version import __version__
from pathways_nb.core import session_options, tuning
from pathways_nb.core.host_profiler import XPLANE_SUFFIX, check_session_name, session_location
from pathways_nb.protocol.errors import InvalidRequest, NotFound, RequestError, grpc_code
from pathways_nb.proxy.cluster_runtime import ClusterRuntime
from pathways_nb.proxy.connection_output import ConnectionOutput
from pathways_nb.proxy.context import ProxyContext
from pathways_nb.proxy.service import IfrtProxyService
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

SERVICE_NAME = "pathways_nb.v1.Observe"


class ObserveService(cluster_pb2_grpc.ObserveServicer):
    def __init__(self, context: ProxyContext, service: IfrtProxyService):
        self.context = context
        self.service = service

    async def EndSessions(self, request, context):
        """Ends the caller's own sessions: those of ``tenant`` whose connection sent ``secret``."""
        if not request.tenant:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name the tenant whose sessions to end")
        if not request.secret:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "pass the secret the sessions' connection sent (pathways_nb.connect makes one): "
                "a client ends only its own sessions",
            )
        return pb.EndSessionsResponse(ended=self.service.end_tenant(request.tenant, request.secret.encode()))

    async def GetHost(self, request, context):
        """Where this proxy runs: a client whose own key is the same uploads through shared memory."""
        return pb.HostInfo(shared_memory_key=session_options.shared_memory_key())

    async def WatchEvents(self, request, context):
        """Events after ``request.after``, then new ones, polled a few times a second."""
        after = request.after
        log = self.context.events
        while True:
            if log.sequence > after:
                events, after = log.after(after, request.tenant)
                if events:
                    yield pb.EventBatch(events=events)
            await asyncio.sleep(tuning.OBSERVE_WATCH_INTERVAL_S.value)

    async def WatchOutput(self, request, context):
        """The connection's lines after ``request.after``, then new ones, until its last session ends."""
        output = await self._output_of(request.tenant, request.secret, context)
        after = request.after
        while True:
            closed = output.closed
            if output.latest > after:
                lines = output.after(after)
                after = lines.latest
                yield lines
            if closed:
                return
            await asyncio.sleep(tuning.OUTPUT_WATCH_INTERVAL_S.value)

    async def GetOutput(self, request, context):
        output = await self._output_of(request.tenant, request.secret, context)
        return output.worker_lines() if request.workers else output.after(request.after)

    async def SwitchOutputContext(self, request, context):
        output = await self._output_of(request.tenant, request.secret, context)
        output.switch(request.context)
        return output.after(request.after)

    async def _output_of(self, tenant: str, secret: str, context) -> ConnectionOutput:
        """The output of the caller's own connection; refused unless ``tenant`` and ``secret`` name one."""
        output = self.context.outputs.find(tenant, secret.encode())
        if output is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no connection of tenant {tenant!r} with that secret is open here: a client reads the output of "
                "its own connection only, with the secret pathways_nb.connect sent (Session.secret)",
            )
        return output

    async def GetEvents(self, request, context):
        events, _latest = self.context.events.after(request.after, request.tenant)
        return pb.EventBatch(events=events)

    async def ReadProfile(self, request, context):
        """The ``*.xplane.pb`` files of one trace session under this proxy's storage root, in chunks.

        Read where the cluster wrote them: every server of a cluster shares one storage root (a
        LocalCluster's directory, a volume on Kubernetes).
        """
        storage = self.context.runtime.host.storage
        try:
            directory = storage.resolve(session_location(request.location, check_session_name(request.session)))
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        files = sorted(directory.glob(f"*{XPLANE_SUFFIX}")) if directory.is_dir() else []
        if not files:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no trace files of session {request.session!r} under {request.location} (at {directory})",
            )
        for path in files:
            data = await asyncio.to_thread(path.read_bytes)
            chunk = tuning.MESSAGE_CHUNK_BYTES.value
            yield pb.ProfileFileChunk(name=path.name, size=len(data), data=data[:chunk])
            for start in range(chunk, len(data), chunk):
                yield pb.ProfileFileChunk(data=data[start : start + chunk])

    async def GetClusterState(self, request, context):
        try:
            state = await self.context.runtime.cluster_state()
        except RequestError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, e.message)
        state.proxy_version = __version__
        state.activities.extend(self.context.activities.snapshot())
        state.sessions.extend(session_info(session) for session in self.service.sessions())
        return state

    async def ControlSessions(self, request, context):
        """Suspends or resumes the caller's own sessions (tenant and secret) or, for an operator, sessions by id;
        answers once each is suspended, or running again, with their states."""
        try:
            chosen = self._chosen_sessions(request)
        except RequestError as error:
            await context.abort(grpc_code(error), error.message)
        action = pb.SessionControl.Action
        if request.action != action.LIST:
            not_suspendable = [session.session_id for session in chosen if session.suspension is None]
            if not_suspendable:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"sessions {not_suspendable} cannot be suspended: only a cluster's sessions can (a single-process "
                    "proxy has no resource manager to lend devices to others), once they have their devices",
                )
            by = "its client" if request.secret else "an operator"
            moves = [
                session.suspension.suspend(f"by {by}")
                if request.action == action.SUSPEND
                else session.suspension.resume(f"by {by}")
                for session in chosen
            ]
            await asyncio.gather(*moves)
        return pb.SessionControlResponse(sessions=[session_info(session) for session in chosen])

    async def Drain(self, request, context):
        """Drains a host of the cluster (an operator's: the cluster token), or puts it back in service."""
        runtime = self.context.runtime
        if not isinstance(runtime, ClusterRuntime):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this proxy serves its own devices, not a cluster's: there are no hosts to drain",
            )
        try:
            return await runtime.drain(request)
        except RequestError as error:
            await context.abort(grpc_code(error), error.message)

    def _chosen_sessions(self, request: pb.SessionControl) -> list:
        """The sessions a ControlSessions call names: its connection's, those with the ids given, or (LIST) all."""
        sessions = self.service.sessions()
        if request.tenant or request.secret:
            if not (request.tenant and request.secret):
                raise InvalidRequest("name both the tenant and the secret of the connection whose sessions to control")
            secret = request.secret.encode()
            own = [s for s in sessions if s.tenant == request.tenant and hmac.compare_digest(s.secret, secret)]
            if not own:
                raise NotFound(f"no session of tenant {request.tenant!r} with that secret is open here")
            return own
        if request.session_ids:
            by_id = {session.session_id: session for session in sessions}
            unknown = sorted(set(request.session_ids) - set(by_id))
            if unknown:
                raise NotFound(
                    f"no sessions {unknown} on this proxy (open: {sorted(by_id)}); pathways-nb sessions lists them"
                )
            return [by_id[session_id] for session_id in dict.fromkeys(request.session_ids)]
        if request.action != pb.SessionControl.Action.LIST:
            raise InvalidRequest(
                "name the sessions to suspend or resume: by id, or your connection's tenant and secret"
            )
        return sessions


def session_info(session) -> pb.SessionInfo:
    """What notebooks and ``pathways-nb sessions`` show of a session."""
    info = pb.SessionInfo(
        session_id=session.session_id,
        tenant=session.tenant,
        device_ids=session.device_ids if session.has_devices else (),
        arrays=len(session.arrays),
        programs=len(session.programs),
        requests=session.requests_served,
        state="running" if session.has_devices else "queued",
    )
    if session.suspension is not None:
        for name, value in session.suspension.info().items():
            setattr(info, name, value)
        # The cluster's devices (where it runs, or will resume): its client's ids stay, if it moved.
        info.device_ids[:] = session.suspension.physical_device_ids
    return info
