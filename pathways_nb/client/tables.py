"""The cluster's state as pandas DataFrames: devices, islands, allocations, sessions.

When the server offers no observe API (Pathways on Cloud), the devices and
islands come from ``jax.devices()``: their ``island`` attributes (a pathways-nb cluster's), else their
``slice_index`` (Pathways on Cloud's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pandas as pd

from pathways_nb.rpc import cluster_pb2 as pb

DEVICE_COLUMNS = ["id", "name", "island", "host_index", "host", "local_id", "kind", "healthy", "tenants", "exclusive"]


def holders(state: pb.ClusterState) -> dict[int, list[pb.AllocationState]]:
    """Who holds each device."""
    held: dict[int, list[pb.AllocationState]] = {}
    for allocation in state.allocations:
        for device_id in allocation.device_ids:
            held.setdefault(device_id, []).append(allocation)
    return held


def devices(state: pb.ClusterState) -> pd.DataFrame:
    held = holders(state)
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


def allocations(state: pb.ClusterState) -> pd.DataFrame:
    rows = [
        {
            "tenant": a.tenant,
            "allocation": a.allocation_id,
            "exclusive": a.exclusive,
            "devices": list(a.device_ids),
            "age_s": round(a.age_s, 1),
        }
        for a in state.allocations
    ]
    queued = [
        {
            "tenant": q.tenant,
            "allocation": f"waiting ({q.waiting.position})",
            "exclusive": q.exclusive,
            "devices": [],
            "age_s": round(q.age_s, 1),
        }
        for q in state.queue
    ]
    return pd.DataFrame(rows + queued, columns=["tenant", "allocation", "exclusive", "devices", "age_s"])


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
