"""Pointing this process's JAX at a Pathways cluster, and back at local devices.

``connect()`` works in a process that has already used local JAX: it sets
JAX's platform and backend target, resets JAX's backends and caches, and
connects at once, so a wrong address fails here (within ``timeout_s``) with a
message that names it, rather than at the first ``jax.devices()``.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd

from pathways_nb.client import jax_plugin, remote_output, tables
from pathways_nb.client.observe import Observer, ObserveUnavailable
from pathways_nb.client.timeline import DeviceLabel, Timeline
from pathways_nb.core import tuning
from pathways_nb.core.security import generate_token, token_from_env
from pathways_nb.core.session_options import SessionOptions, default_tenant
from pathways_nb.core.wait import wait_until
from pathways_nb.errors import ConnectionFailed, PathwaysError
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

ADDRESS_ENV = "PATHWAYS_ADDRESS"
T = TypeVar("T")


def normalize_address(address: str) -> str:
    """``host:port`` or ``grpc://host:port`` as ``grpc://host:port``."""
    address = address.strip()
    if not address:
        raise ValueError("the address is empty; pass grpc://host:port")
    if "://" in address and not address.startswith("grpc://"):
        scheme = address.split("://", 1)[0]
        raise ValueError(f"unsupported scheme {scheme!r} in {address!r}; use grpc://host:port (or slurm://JOBID)")
    if not address.startswith("grpc://"):
        address = "grpc://" + address
    if ":" not in address.removeprefix("grpc://"):
        raise ValueError(f"{address!r} has no port; use grpc://host:port")
    return address


def resolve_address(address: str) -> tuple[str, str | None]:
    """``grpc://host:port``, and the cluster token where ``address`` says where to find both:
    ``slurm://JOBID`` or the path of a cluster's ``address`` file."""
    from pathways_nb.launch import connection_files, slurm

    job_id = slurm.job_id_of(address.strip())
    if job_id is not None:
        address, token = slurm.find(job_id)
    elif os.path.isfile(address):
        address, token = connection_files.read(address)
    else:
        token = None
    return normalize_address(address), token


class Session:
    """A connection to a Pathways cluster: the devices it gave this process, and views of the cluster.

    ``state()``, ``device_table()``, ``islands()``, ``allocations()``, ``sessions()``, ``status`` and
    ``timeline()`` ask the server; ``repr`` and the notebook display use what
    was last fetched. ``suspend()`` gives the devices back to the cluster while keeping the arrays,
    and the next request (or ``resume()``) takes them again.
    """

    def __init__(
        self,
        address: str,
        devices: list,
        platform: str,
        runtime: str,
        tenant: str,
        *,
        token: str | None = None,
        secret: str = "",
    ):
        self.address = address
        self.devices = devices
        self.platform = platform
        self.runtime = runtime
        self.tenant = tenant
        self.token = token  # the cluster token, for the observe API
        self.secret = secret  # what this connection sent, so that it can end its own sessions
        # A LocalCluster started for this session (%pathways connect local): stopped with it.
        self.local_cluster = None
        # What the session's code beside the devices prints, printed here (None: the cluster runs none).
        self.output: remote_output.RemoteOutput | None = None
        self._observer: Observer | None = None
        self._state: pb.ClusterState | None = None
        self._note = ""
        # What the devices did in profiled runs (``pathways_nb.profile``): drawn beside the proxy's events.
        self.device_spans: list[pb.Event] = []

    @property
    def observer(self) -> Observer:
        if self._observer is None:
            self._observer = Observer(self.address, self.token)
        return self._observer

    def state(self) -> pb.ClusterState:
        """The cluster now: devices, islands, health, allocations, queue, sessions, work under way."""
        self._state = self.observer.state()
        return self._state

    def device_table(self) -> pd.DataFrame:
        """One row per device of the cluster: island, host, kind, health, tenants holding it."""
        try:
            return tables.devices(self.state())
        except ObserveUnavailable as error:
            self._note = str(error)
            return tables.devices_from_jax(self.devices)

    def islands(self) -> pd.DataFrame:
        """One row per island: hosts, devices, health."""
        return tables.islands(self.device_table())

    def allocations(self) -> pd.DataFrame:
        """Who holds which devices, who waits, and which sessions are suspended: each with its state and why."""
        return tables.allocations(self.state())

    def sessions(self) -> pd.DataFrame:
        """Every session of the cluster: its tenant, whether it runs (and if not, why), how long it has been
        idle, its priority, devices and arrays."""
        return tables.sessions(self.state().sessions)

    @property
    def status(self) -> str:
        """This connection's state, asked of the server now: ``"running"``, or ``"queued"``, ``"suspending"``,
        ``"suspended"`` or ``"resuming"`` while one of its sessions is (``sessions()`` says why)."""
        mine = self.observer.control_sessions(pb.SessionControl.LIST, self.tenant, self.secret)
        return next((tables.state_of(s) for s in mine if tables.state_of(s) != "running"), "running")

    def suspend(self) -> pd.DataFrame:
        """Gives this connection's devices back to the cluster, keeping its arrays and compiled programs in its
        workers' memory; returns once that is done, with its sessions' rows (state ``suspended``).

        Nothing else changes here: the arrays stay usable, and the next call that needs the devices
        (any computation, a transfer) resumes the session transparently, as ``resume()`` does. A
        session resumes on the devices it had, so that call may wait in the cluster's queue while
        another tenant holds them. A cluster may also suspend a session itself, for a tenant of higher
        priority or one that waits while the session is idle; ``sessions()`` says why. A
        single-process ``pathways-nb proxy`` refuses: only a cluster's sessions can be suspended.
        """
        mine = self.observer.control_sessions(pb.SessionControl.SUSPEND, self.tenant, self.secret)
        return tables.sessions(mine)

    def resume(self, progress: bool = True) -> pd.DataFrame:
        """Puts this connection's suspended sessions back on their devices; returns once they run, with their rows.

        A session resumes on the devices it had, so this waits in the cluster's queue while another
        tenant holds them (a progress bar says for whom, unless ``progress=False``). Running sessions
        are left as they are.
        """
        mine = _showing_the_wait(
            lambda: self.observer.control_sessions(pb.SessionControl.RESUME, self.tenant, self.secret),
            self.address,
            self.tenant,
            self.token,
            progress,
        )
        return tables.sessions(mine)

    def device_labels(self) -> list[DeviceLabel]:
        """This session's devices as timelines label them."""
        devices = tables.devices(self.state())
        mine = {d.id for d in self.devices}
        return [DeviceLabel(int(r.id), r.name, int(r.island)) for r in devices.itertuples() if r.id in mine]

    def timeline(self, last: int | None = None, step_program: str | None = None) -> Timeline:
        """This session's compiles, executions, transfers and waits per device (the last ``last`` steps),
        and the ops and programs of its profiled runs."""
        events = [*self.observer.events(self.tenant), *self.device_spans]
        timeline = Timeline(events, self.device_labels(), step_program)
        return timeline.last(last) if last else timeline

    def add_device_spans(self, events: list[pb.Event], keep: int = 200_000) -> None:
        """Adds a profiled run's device spans to the session's timelines (the newest ``keep``)."""
        self.device_spans = [*self.device_spans, *events][-keep:]

    def logs(self, workers: bool = False) -> str:
        """What the session's code beside the devices (colocated Python) printed lately, each line tagged with
        where it ran; with ``workers``, the workers' lines about the session's programs (errors, warnings)."""
        lines = self.observer.output(self.tenant, self.secret, workers=workers).lines
        return remote_output.format_lines(lines)

    def trace(self, path: str, last: int | None = None) -> str:
        """Writes the timeline as Chrome-trace JSON (Perfetto, chrome://tracing); returns ``path``."""
        return self.timeline(last).save_trace(path)

    def disconnect(self) -> None:
        if current() is self:
            disconnect()

    def __repr__(self) -> str:
        return (
            f"<pathways_nb.Session {self.address} tenant={self.tenant!r} devices={len(self.devices)} "
            f"platform={self.platform}>"
        )

    def _repr_html_(self) -> str:
        import jax

        state = self._state
        islands = sorted({tables.island_of(d) for d in self.devices})
        held = tables.holders(state) if state is not None else {}
        tenants = sorted({a.tenant for allocations in held.values() for a in allocations})
        unhealthy = [w.worker_id for w in state.workers if not w.healthy] if state is not None else []
        return _template("session.html.j2").render(
            address=self.address,
            tenant=self.tenant,
            devices=len(self.devices),
            platform=self.platform,
            islands=len(islands),
            jax_version=jax.__version__,
            server=f"pathways-nb {state.proxy_version}" if state is not None and state.proxy_version else self.runtime,
            tenants=", ".join(tenants),
            unhealthy=", ".join(unhealthy),
            not_running=tables.not_running(state),
            cluster=self._describe_cluster(state),
            note=self._note,
        )

    def _describe_cluster(self, state: pb.ClusterState | None) -> str:
        """The whole cluster in a line: its shape (islands, hosts, devices), its server and address."""
        if state is not None and state.devices:
            places = [(d.island, d.host_index) for d in state.devices]
            platform, server = state.devices[0].platform, f"pathways-nb {state.proxy_version}"
        else:  # a server without the observe API: what jax.devices() says, as the island map reads it
            table = tables.devices_from_jax(self.devices)
            places = list(zip(table["island"], table["host_index"], strict=True))
            platform, server = self.platform, self.runtime
        described = [_shape(places, platform), server, f"at {self.address}"]
        if self.local_cluster is not None:
            described.append("started by this notebook (%pathways disconnect stops it)")
        return ", ".join(part for part in described if part)


def _shape(places: list[tuple[int, int]], platform: str) -> str:
    """``2 island(s) x 1 host(s) x 4 cpu device(s)`` where all islands and hosts are alike, else the totals."""
    islands = collections.Counter(island for island, _host in places)
    hosts = collections.Counter(places)
    hosts_per_island = collections.Counter(island for island, _host in hosts)
    if len(set(hosts_per_island.values())) == 1 and len(set(hosts.values())) == 1:
        per_island, per_host = next(iter(hosts_per_island.values())), next(iter(hosts.values()))
        return f"{len(islands)} island(s) x {per_island} host(s) x {per_host} {platform} device(s)"
    return f"{len(islands)} island(s), {len(hosts)} host(s), {len(places)} {platform} device(s)"


def _template(name: str):
    import jinja2

    environment = jinja2.Environment(
        # Every template is HTML (``.html.j2``, which select_autoescape's default, by extension, left unescaped:
        # the cluster row's ``<LocalCluster ...>`` was read as a tag and showed nothing).
        loader=jinja2.PackageLoader("pathways_nb.client", "templates"),
        autoescape=True,
    )
    return environment.get_template(name)


@dataclass
class _Previous:
    platforms: str | None
    backend_target: str


_state: dict[str, object] = {}


def connect(
    address: str | None = None,
    *,
    timeout_s: float = 60.0,
    exclusive: bool = False,
    num_devices: int = 0,
    islands: Sequence[int] = (),
    tenant: str | None = None,
    progress: bool = True,
    token: str | None = None,
    weight: float = 1.0,
    one_slice: bool = False,
    priority: int = 0,
) -> Session:
    """Makes ``jax.devices()`` the devices of the cluster at ``address``.

    ``address`` defaults to the ``PATHWAYS_ADDRESS`` environment variable. By
    default the session shares every device of the cluster with other
    tenants; ``exclusive=True`` waits until nobody else holds them (a progress
    bar says for whom it waits), ``num_devices`` and ``islands`` ask for part
    of the cluster. ``weight`` is this tenant's share of busy devices against
    the other tenants' (proportional share: weights 1 and 3 get a quarter and
    three quarters of an island both saturate). On a cluster of several islands each island is a
    slice, as Pathways on Cloud shows TPU slices: devices carry their island as ``slice_index``, a
    mesh across islands comes from ``mesh_utils.create_hybrid_device_mesh`` and ``jax.make_mesh``
    refuses one; ``one_slice=True`` makes every device of slice 0 instead, so that code written for
    one slice (``jax.make_mesh`` over all devices) runs across islands unchanged (the island stays
    in each device's ``island`` attribute). ``priority`` ranks this session against other tenants' (higher
    first, default 0, at most what the cluster allows the tenant): an exclusive session of a higher
    priority has the sessions that hold its devices suspended (``Session.suspend``) until it is done.
    ``token`` is the cluster token its views (the observe API)
    need; default: that of this process's ``LocalCluster`` at ``address``, else
    ``$PATHWAYS_CLUSTER_TOKEN``. Raises ``ConnectionFailed`` (JAX left on its previous
    devices) if the server does not answer, or the devices are not free,
    within ``timeout_s`` seconds.

    ``address`` may also say where a running cluster wrote its address: ``slurm://JOBID`` (a Slurm
    job's cluster: ``pathways-nb deploy slurm``, ``pathways-nb up --slurm``) or the path of its
    ``address`` file; the token beside that file is then the default ``token``.
    """
    import jax

    address, found_token = resolve_address(address or os.environ.get(ADDRESS_ENV, ""))
    current = _state.get("connection")
    if current is not None:
        raise PathwaysError(f"already connected to {current.address}; call pathways_nb.disconnect() first")
    options = SessionOptions(
        tenant=tenant or default_tenant(),
        exclusive=exclusive,
        num_devices=num_devices,
        islands=tuple(islands),
        timeout_s=timeout_s,
        secret=generate_token(),
        weight=weight,
        one_slice=one_slice,
        priority=priority,
    )
    from pathways_nb.launch import live

    token = token or found_token or live.token_for(address) or token_from_env()
    _check_listening(address, timeout_s)
    previous = _point_jax_at(address, options)
    try:
        devices = _showing_the_wait(lambda: jax.devices(jax_plugin.PLATFORM), address, options.tenant, token, progress)
    except Exception as e:  # noqa: BLE001 - JAX wraps connection errors in RuntimeError
        _restore(previous)
        raise ConnectionFailed(address, timeout_s, _reason(e)) from None
    jax.clear_caches()
    session = _session_on(address, devices, options, token)
    _state["connection"] = session
    _state["previous"] = previous
    return session


def _session_on(address: str, devices: list, options: SessionOptions, token: str | None) -> Session:
    """The ``Session`` of a client whose JAX now lists ``devices``, following its output."""
    from jax.extend import backend

    proxy = backend.get_backend(jax_plugin.PLATFORM)
    session = Session(
        address, devices, proxy.platform, proxy.runtime_type, options.tenant, token=token, secret=options.secret
    )
    try:
        session.state()
    except PathwaysError as error:  # a server without the observe API (Pathways on Cloud)
        session._note = str(error)
    session.output = remote_output.follow(session)
    return session


def _point_jax_at(address: str, options: SessionOptions) -> _Previous:
    """Points JAX's backends at the proxy at ``address``; returns what to restore if the session fails."""
    import jax
    from jax.extend import backend

    previous = _Previous(jax.config.jax_platforms, jax.config.read("jax_backend_target"))
    os.environ[jax_plugin.INSECURE_ENV] = "true"
    # The client waits a little longer than the server, so that the server's reason arrives.
    os.environ[jax_plugin.TIMEOUT_ENV] = str(options.timeout_s + 5)
    jax_plugin.session_options = options
    backend.clear_backends()
    jax.config.update("jax_platforms", f"{jax_plugin.PLATFORM},cpu")
    jax.config.update("jax_backend_target", address)
    jax_plugin.register()
    return previous


def _check_listening(address: str, timeout_s: float) -> None:
    """Fails at once if nothing listens at ``address``; the stock client would retry until its timeout.

    A server that accepts but does not answer is left to the client's own
    ``timeout_s`` (a tunnel whose far end is down looks like that).
    """
    host, _, port = address.removeprefix("grpc://").rpartition(":")
    host = host.strip("[]")

    def refusal() -> OSError | None:
        """Why nothing answered, or None once something accepts (or takes longer than a refusal would)."""
        try:
            socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)).close()
        except socket.gaierror as e:
            raise ConnectionFailed(address, timeout_s, f"the host name {host!r} does not resolve ({e})") from None
        except TimeoutError:
            return None
        except OSError as e:
            return e
        return None

    wait_until(
        refusal,
        tuning.CONNECT_REFUSED_RETRY_S.value,
        f"a server listening at {address}",
        holds=lambda error: error is None,
        interval_s=0.1,
        timeout_error=lambda e: ConnectionFailed(address, timeout_s, f"nothing is listening there ({e.strerror or e})"),
    )


def _showing_the_wait(work: Callable[[], T], address: str, tenant: str, token: str | None, progress: bool) -> T:
    """``work()`` (taking devices: a connection, a resume), with a progress bar if the cluster makes ``tenant``
    wait for them."""
    result: dict[str, object] = {}

    def work_now() -> None:
        try:
            result["done"] = work()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    thread = threading.Thread(target=work_now, name="pathways-wait-for-devices", daemon=True)
    thread.start()
    thread.join(1.0)
    bar = None
    try:
        while thread.is_alive():
            reason = _queue_position(address, tenant, token)
            if reason and progress:
                if bar is None:
                    from tqdm.auto import tqdm

                    bar = tqdm(total=None, desc="waiting for devices", bar_format="{desc} ({elapsed})")
                bar.set_description_str(reason)
                bar.refresh()
            thread.join(0.5)
    finally:
        if bar is not None:
            bar.close()
    if "error" in result:
        raise result["error"]
    return result["done"]


def _queue_position(address: str, tenant: str, token: str | None) -> str | None:
    """Why this tenant waits, as the cluster's queue says (None if it does not wait)."""
    observer = Observer(address, token)
    try:
        state = observer.state()
    except PathwaysError:
        return None
    finally:
        observer.close()
    for queued in state.queue:
        if queued.tenant == tenant:
            return queued.waiting.reason
    return None


def _reason(error: Exception) -> str:
    """The server's own words from JAX's wrapped connection error."""
    text = str(error)
    marker = "detailed error: "
    return text.split(marker, 1)[1] if marker in text else text


def disconnect() -> None:
    """Returns JAX to this machine's devices; the session ends and its arrays become unusable."""
    connection = _state.pop("connection", None)
    if connection is None:
        return
    _restore(_state.pop("previous"))
    _end_sessions(connection)


def _end_sessions(session: Session) -> None:
    """Asks the proxy to end this tenant's sessions now: arrays still held here would keep them open."""
    if session.output is not None:
        session.output.close()  # (what is left first)
    try:
        session.observer.end_sessions(session.tenant, session.secret)
    except PathwaysError as error:
        _LOGGER.info("could not end the session at %s: %s", session.address, error)
    session.observer.close()
    if session.local_cluster is not None:
        session.local_cluster.close()


def current() -> Session | None:
    """The active connection, or None."""
    return _state.get("connection")


def _restore(previous: _Previous) -> None:
    import gc

    import jax
    from jax.extend import backend

    # Drop compiled programs while the connection is up, so they are released cleanly.
    jax.clear_caches()
    gc.collect()
    backend.clear_backends()
    jax_plugin.unregister()
    jax_plugin.session_options = None
    jax.config.update("jax_platforms", previous.platforms)
    jax.config.update("jax_backend_target", previous.backend_target)
