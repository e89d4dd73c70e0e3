"""Reading a cluster's state and events from its proxy (the ``pathways_nb.v1.Observe`` service).

A cluster that is not a pathways-nb cluster (Google's Pathways on Cloud, say)
does not offer the service; ``ObserveUnavailable`` says so, and callers fall
back to what ``jax.devices()`` tells. A pathways-nb cluster's observe API
needs its token (see ``pathways_nb.core.security``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grpc

from pathways_nb.core.security import TOKEN_ENV, ClusterCredentials, token_from_env
from pathways_nb.errors import PathwaysError
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

# Refusals whose details say what to do ("only a cluster's sessions can be suspended"): shown as they are.
_IN_ITS_OWN_WORDS = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
)


class ObserveUnavailable(PathwaysError):
    """The server does not offer the pathways-nb observe API."""


class Observer:
    """The observe service at a proxy's address, called with the cluster ``token`` (default: its variable)."""

    def __init__(self, address: str, token: str | None = None):
        self.address = address
        credentials = ClusterCredentials(token=token or token_from_env())
        self._channel = credentials.channel(address.removeprefix("grpc://"))
        self._stub = cluster_pb2_grpc.ObserveStub(self._channel)

    def _call(self, method, request, timeout_s: float | None = 10.0):
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ObserveUnavailable(
                    f"{self.address} does not offer the pathways-nb observe API (it is not a pathways-nb "
                    "cluster, e.g. Pathways on Cloud): devices and islands come from jax.devices(); "
                    "allocations and timelines are unavailable"
                ) from None
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PathwaysError(
                    f"the observe API at {self.address} refused the call ({error.details()}): pass the cluster's "
                    f"token, pathways_nb.connect(..., token=...) or %pathways connect ... --token, or set {TOKEN_ENV} "
                    "(pathways-nb up prints where its token is)"
                ) from None
            if error.code() in _IN_ITS_OWN_WORDS:
                raise PathwaysError(error.details()) from None
            raise PathwaysError(f"the server at {self.address} did not answer: {error.details()}") from None

    def state(self) -> pb.ClusterState:
        """Devices, islands, health, allocations, queue, sessions and what is under way."""
        return self._call(self._stub.GetClusterState, pb.ClusterStateRequest())

    def events(self, tenant: str = "", after: int = 0) -> list[pb.Event]:
        """The recorded events (of ``tenant``, if given) after sequence number ``after``."""
        return list(self._call(self._stub.GetEvents, pb.WatchEventsRequest(tenant=tenant, after=after)).events)

    def follow(
        self, tenant: str, after: int, on_events: Callable[[list[pb.Event]], None], stop: threading.Event
    ) -> threading.Thread:
        """Calls ``on_events`` with new events as they come, on a background thread, until ``stop`` is set."""

        def run() -> None:
            stream = self._stub.WatchEvents(pb.WatchEventsRequest(tenant=tenant, after=after))
            stopper = threading.Thread(target=lambda: (stop.wait(), stream.cancel()), daemon=True)
            stopper.start()
            try:
                for batch in stream:
                    on_events(list(batch.events))
            except grpc.RpcError:
                pass  # cancelled, or the server went away

        thread = threading.Thread(target=run, name="pathways-follow-events", daemon=True)
        thread.start()
        return thread

    def read_profile(self, location: str, session: str, timeout_s: float = 600.0):
        """The trace files of one profile session the cluster wrote (``ProfileFileChunk``s, streamed)."""
        try:
            yield from self._stub.ReadProfile(
                pb.ReadProfileRequest(location=location, session=session), timeout=timeout_s
            )
        except grpc.RpcError as error:
            raise PathwaysError(f"reading the cluster's traces failed: {error.details()}") from None

    def output(self, tenant: str, secret: str, after: int = 0, workers: bool = False) -> pb.OutputLines:
        """The lines after ``after`` that the proxy holds of the connection ``tenant`` and ``secret`` name (its
        code beside the devices), or with ``workers`` the workers' lines about its programs."""
        request = pb.OutputRequest(tenant=tenant, secret=secret, after=after, workers=workers)
        return self._call(self._stub.GetOutput, request)

    def switch_output_context(
        self, tenant: str, secret: str, context: str, after: int, timeout_s: float = 5.0
    ) -> pb.OutputLines:
        """Tags the connection's later calls with ``context``; returns its lines after ``after``."""
        request = pb.OutputContextRequest(tenant=tenant, secret=secret, context=context, after=after)
        return self._call(self._stub.SwitchOutputContext, request, timeout_s)

    def watch_output(self, tenant: str, secret: str, after: int = 0):
        """The connection's lines as they come: a stream of ``OutputLines`` (``cancel()`` ends it)."""
        return self._stub.WatchOutput(pb.OutputRequest(tenant=tenant, secret=secret, after=after))

    def end_sessions(self, tenant: str, secret: str) -> int:
        """Ends the sessions of ``tenant`` whose connection sent ``secret``; returns how many."""
        return self._call(self._stub.EndSessions, pb.EndSessionsRequest(tenant=tenant, secret=secret)).ended

    def control_sessions(
        self, action: int, tenant: str = "", secret: str = "", session_ids: Sequence[int] = ()
    ) -> list[pb.SessionInfo]:
        """Does ``action`` (``pb.SessionControl.LIST``, ``SUSPEND``, ``RESUME``) to the sessions of the connection
        ``tenant`` and ``secret`` name, or to ``session_ids`` (an operator's choice), or with neither to every
        session (LIST only); returns their states.

        A suspend or resume answers once it is done, which can take minutes (a resume waits in the
        cluster's queue for its devices): it has no deadline.
        """
        request = pb.SessionControl(action=action, tenant=tenant, secret=secret, session_ids=session_ids)
        timeout_s = 10.0 if action == pb.SessionControl.LIST else None
        return list(self._call(self._stub.ControlSessions, request, timeout_s).sessions)

    def drain(self, island: int, host_index: int, undo: bool = False) -> pb.WorkerState:
        """Drains a host of the cluster, or (``undo``) puts it back in service; returns its state at once
        (``drain_status`` says how far it is: ``"drained"`` once it may be stopped). Needs the cluster token."""
        request = pb.DrainRequest(island=island, host_index=host_index, undo=undo)
        return self._call(self._stub.Drain, request, 30.0)

    def close(self) -> None:
        self._channel.close()
