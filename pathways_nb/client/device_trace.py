"""What each device did, read from the trace files the cluster's processes wrote (``*.xplane.pb``).

The files are parsed by jaxlib's own reader (``jax.profiler.ProfileData``), not by hand. A worker's
file is named for its place (``island1-host0.xplane.pb``); inside it, XLA's ops carry the local
ordinal of the device that ran them (``device_ordinal`` on CPU, one ``/device:...`` plane per device
on accelerators), which ``placement`` turns into the device as the notebook knows it. Ops become
``op`` spans, and each run of a program (an ``hlo_module`` and its ``run_id``) a ``program`` span
around its ops; times are seconds since the epoch, on the host's clock (the trace's start time plus
the op's offset). The spans are drawn by the notebook's ``Timeline`` and exported from it for Perfetto.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pathways_nb.client.timeline import DeviceLabel, Timeline
from pathways_nb.rpc import cluster_pb2 as pb

XPLANE_SUFFIX = ".xplane.pb"
_WORKER_FILE = re.compile(r"island(\d+)-host(\d+)")
_DEVICE_PLANE = re.compile(r"/device:[A-Z]+:(\d+)")
# Placement of a worker's device: (island, host, local ordinal) -> the device, or None if unknown.
Placement = Callable[[int, int, int], DeviceLabel | None]


@dataclass(frozen=True)
class HostTrace:
    """One process's trace file: where it ran, and its device spans (events)."""

    path: Path
    island: int | None  # None: not a worker (the client, the proxy, the resource manager)
    host: int | None
    events: tuple[pb.Event, ...]


def read_file(path: Path, placement: Placement) -> HostTrace:
    """The device spans of one ``*.xplane.pb`` file (none for a process that ran no XLA op)."""
    from jax.profiler import ProfileData

    place = _WORKER_FILE.fullmatch(path.name.removesuffix(XPLANE_SUFFIX))
    if place is None:  # the client's, the proxy's or the resource manager's: host activity, no device spans
        return HostTrace(path, None, None, ())
    island, host = int(place.group(1)), int(place.group(2))
    data = ProfileData.from_file(str(path))
    start_ns = _profile_start_ns(data)
    ops: list[tuple[int, str, str, int, float, float]] = []  # (ordinal, op, module, run, start, end)
    for plane in data.planes:
        device_plane = _DEVICE_PLANE.fullmatch(plane.name)
        for line in plane.lines:
            if device_plane is not None and line.name != "XLA Ops":
                continue
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats and device_plane is None:
                    continue
                ordinal = int(device_plane.group(1)) if device_plane else int(stats.get("device_ordinal", 0))
                start = (start_ns + event.start_ns) / 1e9
                module = str(stats.get("hlo_module", ""))
                ops.append(
                    (ordinal, str(stats.get("hlo_op", event.name)), module, int(stats.get("run_id", 0)), start,
                     start + event.duration_ns / 1e9)
                )  # fmt: skip
    events: list[pb.Event] = []
    runs: dict[tuple[int, str, int], list[float]] = {}
    for ordinal, op, module, run, start, end in ops:
        label = placement(island, host, ordinal)
        if label is None:
            continue
        events.append(pb.Event(kind="op", name=op, device_ids=[label.id], start=start, end=end, tenant=module))
        span = runs.setdefault((label.id, module, run), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    for (device, module, _run), (start, end) in runs.items():
        events.append(pb.Event(kind="program", name=module, device_ids=[device], start=start, end=end))
    return HostTrace(path, island, host, tuple(sorted(events, key=lambda e: (e.start, e.kind != "program"))))


def _profile_start_ns(data) -> int:
    """When the trace started (ns since the epoch), from its "Task Environment" plane."""
    for plane in data.planes:
        if plane.name == "Task Environment":
            stats = dict(plane.stats)
            if "profile_start_time" in stats:
                return int(stats["profile_start_time"])
    return 0


class DeviceTrace:
    """One trace session's files, read: one row per device, the XLA ops and programs of each step."""

    def __init__(self, logdir: str | Path, session: str, traces: Iterable[HostTrace], devices: list[DeviceLabel]):
        self.logdir = Path(logdir)
        self.session = session
        self.directory = self.logdir / "plugins" / "profile" / session
        self.traces = list(traces)
        used = {d for trace in self.traces for e in trace.events for d in e.device_ids}
        self.devices = [d for d in devices if d.id in used]
        self.events = sorted((e for trace in self.traces for e in trace.events), key=lambda e: e.start)

    @property
    def files(self) -> list[Path]:
        return [trace.path for trace in self.traces]

    def timeline(self) -> Timeline:
        """The device spans as the notebook's timeline (one row per device; programs and their ops)."""
        return Timeline(self.events, self.devices, step_program=self.step_program)

    @property
    def step_program(self) -> str | None:
        """The program that ran most often: the training step, usually."""
        counts = pd.Series([e.name for e in self.events if e.kind == "program"]).value_counts()
        return str(counts.index[0]) if len(counts) else None

    def ops(self) -> pd.DataFrame:
        """Every op span: program, op, device, island, start, duration (ms)."""
        island = {d.id: d.island for d in self.devices}
        rows = [
            {
                "program": e.tenant,
                "op": e.name,
                "device": e.device_ids[0],
                "island": island.get(e.device_ids[0], -1),
                "start": pd.Timestamp(e.start, unit="s"),
                "duration_ms": (e.end - e.start) * 1e3,
            }
            for e in self.events
            if e.kind == "op"
        ]
        return pd.DataFrame(rows, columns=["program", "op", "device", "island", "start", "duration_ms"])

    def slowest_ops(self, count: int = 10) -> pd.DataFrame:
        """The ops that took the most time in all, per program: total and mean ms, how often, on how many devices."""
        ops = self.ops()
        if ops.empty:
            return pd.DataFrame(columns=["program", "op", "total_ms", "mean_ms", "count", "devices"])
        table = ops.groupby(["program", "op"]).agg(
            total_ms=("duration_ms", "sum"),
            mean_ms=("duration_ms", "mean"),
            count=("duration_ms", "size"),
            devices=("device", "nunique"),
        )
        return table.sort_values("total_ms", ascending=False).head(count).reset_index()

    def save_perfetto(self, path: str | Path | None = None) -> Path:
        """A Chrome/Perfetto trace of the device spans (``perfetto_trace.json.gz`` in the session directory)."""
        target = Path(path) if path is not None else self.directory / "perfetto_trace.json.gz"
        opener = gzip.open if target.suffix == ".gz" else open
        with opener(target, "wt") as f:
            json.dump(self.timeline().chrome_trace(), f)
        return target

    @property
    def xprof_command(self) -> str:
        """The command that opens this run in XProf (``pip install xprof``)."""
        return f"xprof --logdir {self.logdir} --port 8791"

    @property
    def tensorboard_command(self) -> str:
        """The same in TensorBoard's profile plugin (``pip install tensorboard tensorboard-plugin-profile``)."""
        return f"tensorboard --logdir {self.logdir}"

    def _repr_html_(self) -> str:
        import html

        files = ", ".join(html.escape(p.name) for p in self.files)
        return (
            f"<div><b>Device trace</b> {html.escape(self.session)}: {len(self.devices)} devices, "
            f"{sum(e.kind == 'op' for e in self.events)} op spans, from {files}<br>"
            f"{self.timeline().svg()}<br>"
            f"<code>{html.escape(self.xprof_command)}</code> or <code>{html.escape(self.tensorboard_command)}</code>"
            "</div>"
        )

    def __repr__(self) -> str:
        return (
            f"<DeviceTrace {self.session}: {len(self.devices)} devices, {len(self.events)} spans from "
            f"{len(self.files)} files in {self.directory}>"
        )


def read_session(logdir: str | Path, session: str, placement: Placement, devices: list[DeviceLabel]) -> DeviceTrace:
    """Reads every ``*.xplane.pb`` of ``<logdir>/plugins/profile/<session>``."""
    directory = Path(logdir) / "plugins" / "profile" / session
    traces = [read_file(path, placement) for path in sorted(directory.glob(f"*{XPLANE_SUFFIX}"))]
    return DeviceTrace(logdir, session, traces, devices)
