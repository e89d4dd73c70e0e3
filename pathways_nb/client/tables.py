"""The cluster's state as pandas DataFrames: devices, islands, allocations, sessions.

A suspended session holds no devices (the resource manager's allocations leave it out), but it resumes on the
ones it had: the device table names it beside them (``suspended``), and the allocation table lists it with its
state and why.

When the server offers no observe API (Pathways on Cloud), the devices and
islands come from ``jax.devices()``: their ``island`` attributes (a pathways-nb cluster's), else their
``slice_index`` (Pathways on Cloud's).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import pandas as pd

from pathways_nb.rpc import cluster_pb2 as pb

DEVICE_COLUMNS = [
    "id",
    "name",
    "island",
    "host_index",
    "host",
    "local_id",
    "kind",
    "healthy",
    "tenants",
    "exclusive",
    "suspended",
]
# States of a session that holds no devices now but resumes on those it had (SessionInfo.device_ids).
_OFF_ITS_DEVICES = frozenset({"suspended", "queued"})


def holders(state: pb.ClusterState) -> dict[int, list[pb.AllocationState]]:
    """Who holds each device."""
    held: dict[int, list[pb.AllocationState]] = {}
    for allocation in state.allocations:
        for device_id in allocation.device_ids:
            held.setdefault(device_id, []).append(allocation)
    return held


def _resuming_on(state: pb.ClusterState) -> dict[int, list[pb.SessionInfo]]:
    """The suspended sessions that resume on each device (a session queued before it ever ran has no devices)."""
    waiting: dict[int, list[pb.SessionInfo]] = {}
    for session in state.sessions:
        if state_of(session) in _OFF_ITS_DEVICES:
            for device_id in session.device_ids:
                waiting.setdefault(device_id, []).append(session)
    return waiting


def devices(state: pb.ClusterState) -> pd.DataFrame:
    """One row per device: who holds it (``tenants``) and whose suspended sessions resume on it (``suspended``)."""
    held = holders(state)
    suspended = _resuming_on(state)
    rows = [
        {
            "id": d.id,
            "name": f"{d.platform}:{d.id}",
            "island": d.island,
            "host_index": d.host_index,
            "host": d.worker_address,
            "local_id": d.local_id,
            "kind": d.kind,
            "healthy": d.healthy,
            "tenants": ", ".join(sorted({a.tenant for a in held.get(d.id, [])})),
            "exclusive": any(a.exclusive for a in held.get(d.id, [])),
            "suspended": ", ".join(sorted({s.tenant for s in suspended.get(d.id, [])})),
        }
        for d in state.devices
    ]
    return pd.DataFrame(rows, columns=DEVICE_COLUMNS)


def island_of(device) -> int:
    """The island of a ``jax.devices()`` device: a session of one slice (``connect(one_slice=True)``) sees
    every device in slice 0, but each still names its island."""
    return getattr(device, "island", getattr(device, "slice_index", 0))


def devices_from_jax(jax_devices: Sequence) -> pd.DataFrame:
    """What ``jax.devices()`` says, for servers without the observe API."""
    rows = [
        {
            "id": d.id,
            "name": str(d),
            "island": island_of(d),
            "host_index": getattr(d, "host_index", d.process_index),
            "host": str(getattr(d, "host", "")),
            "local_id": getattr(d, "local_hardware_id", d.id),
            "kind": d.device_kind,
            "healthy": True,
            "tenants": "",
            "exclusive": False,
            "suspended": "",
        }
        for d in jax_devices
    ]
    return pd.DataFrame(rows, columns=DEVICE_COLUMNS)


def islands(device_table: pd.DataFrame) -> pd.DataFrame:
    """One row per island: its hosts, devices and health."""
    if device_table.empty:
        return pd.DataFrame(columns=["island", "hosts", "devices", "healthy", "device_ids"])
    grouped = device_table.groupby("island", sort=True)
    return pd.DataFrame(
        {
            "island": list(grouped.groups),
            "hosts": grouped["host_index"].nunique().tolist(),
            "devices": grouped["id"].count().tolist(),
            "healthy": grouped["healthy"].all().tolist(),
            "device_ids": grouped["id"].apply(list).tolist(),
        }
    )


ALLOCATION_COLUMNS = ["tenant", "allocation", "state", "why", "exclusive", "priority", "devices", "age_s"]


def allocations(state: pb.ClusterState) -> pd.DataFrame:
    """Who holds which devices, who waits for some, and which suspended sessions wait to resume (on which devices,
    and why they do not run)."""
    sessions = {(s.tenant, tuple(sorted(s.device_ids))): s for s in state.sessions}
    # Suspended sessions waiting for their devices again: each has a row of the queue (``resuming``) once there.
    resuming = {s.tenant: s for s in state.sessions if state_of(s) == "queued" and s.device_ids}
    rows = []
    for a in state.allocations:
        # A session holds its allocation while it suspends and again while it resumes: its state says which.
        session = sessions.get((a.tenant, tuple(sorted(a.device_ids))))
        rows.append(_row(a.tenant, a.allocation_id, a.exclusive, a.priority, a.device_ids, a.age_s, session))
    for q in state.queue:
        session = resuming.pop(q.tenant, None) if q.resuming else None
        devices = session.device_ids if session is not None else ()
        waiting = f"waiting ({q.waiting.position})"
        rows.append(_row(q.tenant, waiting, q.exclusive, q.priority, devices, q.age_s, session, q.waiting.reason))
    for s in state.sessions:  # the suspended, and the queued whose request is not in the queue yet
        if state_of(s) == "suspended" or resuming.get(s.tenant) is s:
            since = max(0.0, time.time() - s.state_since) if s.state_since else 0.0
            rows.append(_row(s.tenant, "suspended", None, s.priority, s.device_ids, since, s))
    return pd.DataFrame(rows, columns=ALLOCATION_COLUMNS)


def _row(
    tenant: str,
    allocation: str,
    exclusive: bool | None,
    priority: int,
    device_ids: Iterable[int],
    age_s: float,
    session: pb.SessionInfo | None,
    waits_for: str = "",
) -> dict:
    """A row of the allocation table, in the words of the session's state where it has one."""
    if session is not None:
        state, why = state_of(session), session.state_reason
    else:
        state, why = ("queued", waits_for) if waits_for else ("running", "")
    return {
        "tenant": tenant,
        "allocation": allocation,
        "state": state,
        "why": why,
        "exclusive": exclusive,
        "priority": priority,
        "devices": list(device_ids),
        "age_s": round(age_s, 1),
    }


def state_of(session: pb.SessionInfo) -> str:
    """``running``, ``queued``, ``suspending``, ``suspended`` or ``resuming`` (a proxy older than suspending
    sessions says nothing: its sessions run)."""
    return session.state or "running"


SESSION_COLUMNS = ["id", "tenant", "state", "why", "idle_s", "priority", "devices", "arrays"]


def sessions(infos: Iterable[pb.SessionInfo]) -> pd.DataFrame:
    """One row per session: whose, running or not and why, how long idle, its priority, devices and arrays."""
    rows = [
        {
            "id": s.session_id,
            "tenant": s.tenant,
            "state": state_of(s),
            "why": s.state_reason,
            "idle_s": round(s.idle_s, 1),
            "priority": s.priority,
            "devices": list(s.device_ids),
            "arrays": s.arrays,
        }
        for s in infos
    ]
    return pd.DataFrame(rows, columns=SESSION_COLUMNS)


def not_running(state: pb.ClusterState | None) -> list[str]:
    """A line for each session of the cluster that does not run, and why (none without a ``state``):
    ``alice #3 suspended (idle for 12 min while bob waited)``."""
    return [
        f"{s.tenant} #{s.session_id} {state_of(s)}" + (f" ({s.state_reason})" if s.state_reason else "")
        for s in (state.sessions if state is not None else ())
        if state_of(s) != "running"
    ]
